#include "sdk/commands.h"

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <iostream>
#include <limits>
#include <mutex>
#include <optional>
#include <thread>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/auth_token.h"
#include "common/flags.h"
#include "common/routing_stats.h"
#include "common/status.h"
#include "common/transport/grpc_tls.h"
#include "httplib.h"
#include "nlohmann/json.hpp"
#include "sdk/agent_replay.h"
#include "sdk/client.h"
#include "sdk/stats.h"

namespace hmoe {
namespace {

// The request flags of generate, chat and bench-serve: sampling, limits and
// the per-request --timeout.
struct RequestFlags {
  int64_t max_tokens = 64;
  double temperature = 0, top_p = 1, min_p = 0, repetition_penalty = 1, presence_penalty = 0,
         frequency_penalty = 0;
  int64_t top_k = 0;
  uint64_t seed = 0;
  std::vector<std::string> stop;
  bool ignore_eos = false, add_special_tokens = false;
  double timeout = 0;  // seconds; 0: none

  absl::Time Deadline() const {
    return timeout > 0 ? absl::Now() + absl::Seconds(timeout) : absl::InfiniteFuture();
  }
};

// Binds `r` (its fields' values are the defaults) to the sampling flags.
void AddRequestFlags(FlagSet& fs, RequestFlags* r) {
  constexpr int64_t kI32 = std::numeric_limits<int32_t>::max();
  fs.Group("sampling");
  fs.Int("max-tokens", &r->max_tokens, 1, kI32, "tokens to generate at most");
  fs.Double("temperature", &r->temperature, "0: greedy");
  fs.Int("top-k", &r->top_k, 0, kI32, "0: all");
  fs.Double("top-p", &r->top_p, "nucleus sampling");
  fs.Double("min-p", &r->min_p, "drop tokens below this share of the likeliest");
  fs.Double("repetition-penalty", &r->repetition_penalty, "1: none");
  fs.Double("presence-penalty", &r->presence_penalty, "0: none");
  fs.Double("frequency-penalty", &r->frequency_penalty, "0: none");
  fs.Uint64("seed", &r->seed, "sampling seed (the worker picks one when not given)");
  fs.Strings("stop", &r->stop, "STR", "stop when the text contains STR");
  fs.Bool("ignore-eos", &r->ignore_eos, "generate past the end-of-sequence token");
  fs.Bool("add-special-tokens", &r->add_special_tokens,
          "let the tokenizer add its special tokens (BOS) to the prompt");
  fs.Double(
      "timeout", &r->timeout, "seconds per request; 0: none", [](double t) { return t >= 0; },
      ">= 0 seconds");
}

// The request's sampling and limits from the flags (a sampling field the
// command line does not name stays unset: the worker's default).
void ApplySampling(const FlagSet& fs, const RequestFlags& r, api::v1::GenerateRequest& req) {
  req.set_max_tokens(static_cast<int32_t>(r.max_tokens));
  auto* s = req.mutable_sampling();
  if (fs.seen("temperature")) s->set_temperature(static_cast<float>(r.temperature));
  if (fs.seen("top-k")) s->set_top_k(static_cast<int32_t>(r.top_k));
  if (fs.seen("top-p")) s->set_top_p(static_cast<float>(r.top_p));
  if (fs.seen("min-p")) s->set_min_p(static_cast<float>(r.min_p));
  if (fs.seen("repetition-penalty"))
    s->set_repetition_penalty(static_cast<float>(r.repetition_penalty));
  if (fs.seen("presence-penalty")) s->set_presence_penalty(static_cast<float>(r.presence_penalty));
  if (fs.seen("frequency-penalty"))
    s->set_frequency_penalty(static_cast<float>(r.frequency_penalty));
  if (fs.seen("seed")) s->set_seed(r.seed);
  for (const std::string& stop : r.stop) req.add_stop(stop);
  req.set_ignore_eos(r.ignore_eos);
  req.set_add_special_tokens(r.add_special_tokens);
}

// A subcommand that talks to the worker: its flags (the caller binds its
// own; the connection's are added here, their defaults from $HMOE_SERVER,
// $HMOE_TOKEN_FILE and $HMOE_TLS_CA_FILE), the parse, and the connection.
// Every message starts "hmoe NAME: ".
class Command {
 public:
  Command(const std::string& name, const std::string& synopsis, const std::string& about)
      : flags_("hmoe " + name, synopsis, about) {}
  FlagSet& flags() { return flags_; }

  // Parses `args` (positional arguments into `positional`; nullptr: none
  // taken), then `check`. nullopt: go on; else the exit code, the usage or
  // the error printed: 0 after --help, 2 after a bad flag.
  std::optional<int> Parse(const std::vector<std::string>& args,
                           std::vector<std::string>* positional = nullptr,
                           const std::function<absl::Status()>& check = nullptr) {
    AddConnectionFlags();
    return flags_.ParseOrExit(args, positional, check);
  }
  // Parse, then Connect: the client, or nullptr with *exit_code set (1 when
  // the connection failed, said on stderr).
  std::unique_ptr<Client> Start(const std::vector<std::string>& args,
                                std::vector<std::string>* positional,
                                const std::function<absl::Status()>& check, int* exit_code) {
    if (std::optional<int> exit = Parse(args, positional, check)) {
      *exit_code = *exit;
      return nullptr;
    }
    auto client = Connect();
    if (!client.ok()) {
      *exit_code = Fail(client.status());
      return nullptr;
    }
    return std::move(*client);
  }

  absl::StatusOr<std::unique_ptr<Client>> Connect() const {
    ClientOptions o;
    o.target = server_;
    ASSIGN_OR_RETURN(o.auth_token, Token());
    o.tls = tls_;
    return Client::Connect(o);
  }
  // The token to send: --token-file's; "" for none.
  absl::StatusOr<std::string> Token() const {
    if (token_file_.empty()) return std::string();
    return ReadAuthTokenFile(token_file_);
  }
  // Prints "hmoe NAME<what>: status"; the exit code 1.
  int Fail(const absl::Status& s, const std::string& what = "") const {
    std::fprintf(stderr, "%s%s: %s\n", flags_.program().c_str(), what.c_str(),
                 s.ToString().c_str());
    return 1;
  }

 private:
  void AddConnectionFlags() {
    if (connection_flags_) return;
    connection_flags_ = true;
    auto env = [](const char* name, const char* def) {
      const char* v = std::getenv(name);
      return std::string(v != nullptr ? v : def);
    };
    server_ = env("HMOE_SERVER", "127.0.0.1:50051");
    token_file_ = env("HMOE_TOKEN_FILE", "");
    tls_.ca_file = env("HMOE_TLS_CA_FILE", "");
    flags_.Group("connection (defaults from $HMOE_SERVER, $HMOE_TOKEN_FILE, $HMOE_TLS_CA_FILE)");
    flags_.String("server", &server_, "HOST:PORT", "the hmoe-gpu-worker");
    flags_.String("token-file", &token_file_, "PATH",
                  "the file with the worker's --auth-token-file token");
    AddTlsFlags(flags_, &tls_);
  }

  FlagSet flags_;
  bool connection_flags_ = false;
  std::string server_, token_file_;
  TlsClientFiles tls_;
};

const char* FinishName(api::v1::FinishReason r) {
  switch (r) {
    case api::v1::FINISH_REASON_LENGTH:
      return "length";
    case api::v1::FINISH_REASON_STOP:
      return "stop";
    case api::v1::FINISH_REASON_STOP_STRING:
      return "stop string";
    default:
      return "unfinished";
  }
}

}  // namespace

int GenerateCommand(const std::vector<std::string>& args) {
  Command cmd("generate", "-p|--prompt TEXT [flags]",
              "Streams a completion from hmoe-gpu-worker and prints tok/s.");
  std::string prompt;
  bool ids = false;
  RequestFlags rf;
  FlagSet& fs = cmd.flags();
  fs.String("prompt", &prompt, "TEXT", "the prompt (or as the one argument)").Alias("-p");
  fs.Bool("ids", &ids, "print token ids instead of text");
  AddRequestFlags(fs, &rf);
  std::vector<std::string> positional;
  int exit_code = 0;
  auto client = cmd.Start(
      args, &positional,
      [&]() -> absl::Status {
        const bool flag_prompt = !prompt.empty();
        if (!flag_prompt && !positional.empty()) prompt = positional[0];
        if (positional.size() > (flag_prompt ? 0u : 1u))
          return UnexpectedArgument(positional[flag_prompt ? 0 : 1]);
        if (prompt.empty()) return absl::InvalidArgumentError("-p|--prompt TEXT is required");
        return absl::OkStatus();
      },
      &exit_code);
  if (!client) return exit_code;
  api::v1::GenerateRequest req;
  req.set_prompt(prompt);
  ApplySampling(fs, rf, req);
  std::fputs(prompt.c_str(), stdout);
  std::fflush(stdout);
  auto r = client->Generate(
      req,
      [&](const api::v1::GenerateResponse& c) {
        if (ids) {
          for (int32_t t : c.token_ids()) std::printf(" [%d]", t);
        } else {
          std::fputs(c.text().c_str(), stdout);
        }
        std::fflush(stdout);
        return true;
      },
      rf.Deadline());
  std::printf("\n");
  std::fflush(stdout);
  if (!r.ok()) return cmd.Fail(r.status());
  const double decode_s = r->timings.decode_ms() / 1e3;
  const int64_t n = r->usage.completion_tokens();
  std::fprintf(
      stderr,
      "-- %lld prompt + %lld generated tokens (%s); first token %.1f ms; decode %.2f tok/s; "
      "%.2f s wall\n",
      static_cast<long long>(r->usage.prompt_tokens()), static_cast<long long>(n),
      FinishName(r->finish_reason), r->timings.time_to_first_token_ms(),
      n > 1 && decode_s > 0 ? static_cast<double>(n - 1) / decode_s : 0.0, r->wall_ms / 1e3);
  return 0;
}

namespace {

// The next line of text for the conversation into *line (prompting "> " on a
// terminal): false at the end (EOF, /quit, /exit); /reset calls `reset` and
// empty lines are skipped.
bool NextChatText(bool tty, std::string* line, const std::function<void()>& reset) {
  for (;;) {
    if (tty) std::fputs("> ", stderr);
    if (!std::getline(std::cin, *line)) return false;
    if (*line == "/quit" || *line == "/exit") return false;
    if (*line == "/reset") {
      reset();
    } else if (!line->empty()) {
      return true;
    }
  }
}

// A Generate callback that prints each chunk's text as it comes and keeps it.
std::function<bool(const api::v1::GenerateResponse&)> PrintInto(std::string* reply) {
  return [reply](const api::v1::GenerateResponse& c) {
    std::fputs(c.text().c_str(), stdout);
    std::fflush(stdout);
    *reply += c.text();
    return true;
  };
}

// `hmoe chat` on a model with a chat template: the conversation goes as
// GenerateRequest.chat messages, rendered by the worker. The --system
// message stays first; when the prompt outgrows the context, the oldest
// exchanges go.
int ChatWithTemplate(const Command& cmd, const std::string& system, const RequestFlags& rf,
                     const api::v1::GenerateRequest& base, Client& client) {
  std::vector<std::pair<std::string, std::string>> turns;  // (user, assistant)
  const bool tty = isatty(0);
  std::string line;
  while (NextChatText(tty, &line, [&] { turns.clear(); })) {
    for (;;) {
      api::v1::GenerateRequest req = base;
      api::v1::Chat* chat = req.mutable_chat();
      auto add = [&](const char* role, const std::string& content) {
        api::v1::ChatMessage* m = chat->add_messages();
        m->set_role(role);
        m->set_content(content);
      };
      if (!system.empty()) add("system", system);
      for (const auto& [user, assistant] : turns) {
        add("user", user);
        add("assistant", assistant);
      }
      add("user", line);
      std::string reply;
      auto r = client.Generate(req, PrintInto(&reply), rf.Deadline());
      // The history no longer fits: drop the oldest exchange and ask again.
      if (!r.ok() && absl::IsInvalidArgument(r.status()) && !turns.empty() &&
          absl::StrContains(r.status().message(), "the context holds")) {
        turns.erase(turns.begin());
        continue;
      }
      std::printf("\n");
      if (!r.ok()) {
        cmd.Fail(r.status());
      } else {
        turns.emplace_back(line, reply);
      }
      break;
    }
  }
  return 0;
}

}  // namespace

int ChatCommand(const std::vector<std::string>& args) {
  Command cmd("chat", "[flags]",
              "Interactive chat that keeps the conversation: the model's chat template on the\n"
              "worker; --plain-text or no template: a User:/Assistant: transcript. /reset clears\n"
              "the history; /quit or Ctrl-D ends.");
  std::string system;
  bool plain_text = false;
  RequestFlags rf;
  FlagSet& fs = cmd.flags();
  fs.String("system", &system, "TEXT", "a system message, kept first");
  fs.Bool("plain-text", &plain_text, "a User:/Assistant: transcript even with a chat template");
  AddRequestFlags(fs, &rf);
  // Every flag is checked before connecting.
  int exit_code = 0;
  auto client = cmd.Start(args, nullptr, nullptr, &exit_code);
  if (!client) return exit_code;
  api::v1::GenerateRequest base;
  ApplySampling(fs, rf, base);
  auto info = client->ModelInfo();
  if (!info.ok()) return cmd.Fail(info.status());
  const bool tty = isatty(0);
  if (tty)
    std::fprintf(stderr,
                 "hmoe chat with %s (%lld-token context). /reset clears the history, /quit or "
                 "Ctrl-D ends.\n",
                 info->model_type().c_str(), static_cast<long long>(info->max_context()));
  if (info->has_chat_template() && !plain_text)
    return ChatWithTemplate(cmd, system, rf, base, *client);
  // Plain-text transcript (a model without a chat template, or
  // --plain-text). The --system text stays first; the oldest turns go when
  // the context is full.
  if (base.stop_size() == 0) base.add_stop("\nUser:");
  if (!system.empty()) system += "\n";
  std::vector<std::string> turns;  // "User: ...\nAssistant: ...\n"
  // Room kept for the reply (the engine clamps max_tokens to the context).
  const int64_t reply_room = std::min<int64_t>(base.max_tokens(), info->max_context() / 2);
  std::string line;
  while (NextChatText(tty, &line, [&] { turns.clear(); })) {
    const std::string ask = "User: " + line + "\nAssistant:";
    auto compose = [&] {
      std::string p = system;
      for (const std::string& t : turns) p += t;
      return p + ask;
    };
    std::string prompt = compose();
    // Keep the most recent turns that fit the context (by tokens). A line
    // the server refuses (not UTF-8, say) is reported; the chat goes on.
    absl::Status tokenized;
    for (;;) {
      auto ids = client->Tokenize(prompt, base.add_special_tokens());
      if (!ids.ok()) {
        tokenized = ids.status();
        break;
      }
      if (static_cast<int64_t>(ids->size()) + reply_room <= info->max_context() || turns.empty())
        break;
      turns.erase(turns.begin());
      prompt = compose();
    }
    if (!tokenized.ok()) {
      cmd.Fail(tokenized);
      continue;
    }
    api::v1::GenerateRequest req = base;
    req.set_prompt(prompt);
    std::string reply;
    auto r = client->Generate(req, PrintInto(&reply), rf.Deadline());
    std::printf("\n");
    if (!r.ok()) {
      cmd.Fail(r.status());
      continue;
    }
    turns.push_back(ask + reply + "\n");
  }
  return 0;
}

int BenchServeCommand(const std::vector<std::string>& args) {
  Command cmd("bench-serve", "[flags]",
              "N concurrent clients: latency percentiles and throughput (exit 1 when any\n"
              "request is refused or fails).");
  int clients = 8, retry = 0;
  int64_t requests_flag = 0;
  std::string prompt = "Once upon a time";
  RequestFlags rf;
  rf.max_tokens = 32;
  // Fixed-length outputs measure steadier: EOS is ignored unless --ignore-eos=false.
  rf.ignore_eos = true;
  FlagSet& fs = cmd.flags();
  fs.Int("clients", &clients, 1, 4096, "concurrent clients, one connection each");
  fs.Int("requests", &requests_flag, 1, 1 << 24, "requests in all (default 4 per client)");
  // A request the server refuses with RESOURCE_EXHAUSTED (its queue full)
  // is sent again up to this many times, after 5 ms doubling to 200 ms.
  fs.Int("retry", &retry, 0, 1 << 20, "send a request refused (queue full) again up to N times");
  fs.String("prompt", &prompt, "TEXT", "every request's prompt").Alias("-p");
  AddRequestFlags(fs, &rf);
  if (std::optional<int> exit = cmd.Parse(args)) return *exit;
  const int requests = fs.seen("requests") ? static_cast<int>(requests_flag) : clients * 4;
  api::v1::GenerateRequest base;
  base.set_prompt(prompt);
  ApplySampling(fs, rf, base);
  // Every client connects before the clock starts (the run times requests,
  // not handshakes); one that cannot is a failed run.
  std::vector<std::unique_ptr<Client>> conns;
  for (int c = 0; c < clients; ++c) {
    auto client = cmd.Connect();
    if (!client.ok())
      return cmd.Fail(client.status(), absl::StrCat(": client ", c + 1, " of ", clients));
    conns.push_back(std::move(*client));
  }
  std::atomic<int> next{0}, done{0}, failed{0}, exhausted{0}, retries{0};
  std::atomic<int64_t> tokens{0};
  std::mutex mu;
  std::vector<double> latency, ttft;
  std::string first_error;
  const absl::Time start = absl::Now();
  std::vector<std::thread> threads;
  for (int c = 0; c < clients; ++c) {
    threads.emplace_back([&, c] {
      Client& client = *conns[static_cast<size_t>(c)];
      while (next.fetch_add(1) < requests) {
        auto send = [&] { return client.Generate(base, nullptr, rf.Deadline()); };
        auto r = send();
        absl::Duration backoff = absl::Milliseconds(5);
        for (int a = 0;
             a < retry && !r.ok() && r.status().code() == absl::StatusCode::kResourceExhausted;
             ++a) {
          ++retries;
          absl::SleepFor(backoff);
          backoff = std::min(backoff * 2, absl::Milliseconds(200));
          r = send();
        }
        if (r.ok()) {
          tokens += r->usage.completion_tokens();
          std::lock_guard<std::mutex> lock(mu);
          latency.push_back(r->wall_ms);
          ttft.push_back(r->first_chunk_ms);
        } else {
          (r.status().code() == absl::StatusCode::kResourceExhausted ? exhausted : failed)++;
          std::lock_guard<std::mutex> lock(mu);
          if (first_error.empty()) first_error = r.status().ToString();
        }
        ++done;
      }
    });
  }
  // Progress bar on stderr while the clients run.
  std::thread progress([&] {
    while (done.load() < requests) {
      const int d = done.load(), w = 40, filled = w * d / requests;
      std::fprintf(stderr, "\r[%s%s] %d/%d requests",
                   std::string(static_cast<size_t>(filled), '#').c_str(),
                   std::string(static_cast<size_t>(w - filled), '.').c_str(), d, requests);
      std::fflush(stderr);
      std::this_thread::sleep_for(std::chrono::milliseconds(200));
      bool nothing_works;
      {
        std::lock_guard<std::mutex> lock(mu);
        nothing_works = !first_error.empty() && latency.empty();
      }
      if (nothing_works && done.load() == 0 && absl::Now() - start > absl::Seconds(30)) break;
    }
    std::fprintf(stderr, "\r%*s\r", 70, "");
  });
  for (auto& t : threads) t.join();
  // Timed before the progress thread is joined: it wakes every 200 ms, and
  // waiting for it rounded the run time (and so the throughput) to that tick.
  const double secs = absl::ToDoubleSeconds(absl::Now() - start);
  done = requests;
  progress.join();
  auto pct = [](std::vector<double> v, double p) { return NearestRankPercentile(std::move(v), p); };
  std::printf("bench-serve: %d clients, %d requests, %d max tokens each, prompt \"%s\"\n", clients,
              requests, base.max_tokens(), prompt.c_str());
  std::printf("  completed %zu, refused (queue full%s) %d, failed %d in %.2f s; %d retries\n",
              latency.size(), retry > 0 ? absl::StrCat(", after ", retry, " retries").c_str() : "",
              exhausted.load(), failed.load(), secs, retries.load());
  std::printf("  throughput  %.2f tok/s, %.2f req/s\n", static_cast<double>(tokens.load()) / secs,
              static_cast<double>(latency.size()) / secs);
  std::printf("  latency ms  p50 %.1f  p90 %.1f  p99 %.1f  max %.1f\n", pct(latency, 0.5),
              pct(latency, 0.9), pct(latency, 0.99), pct(latency, 1.0));
  std::printf("  first token ms  p50 %.1f  p90 %.1f  p99 %.1f\n", pct(ttft, 0.5), pct(ttft, 0.9),
              pct(ttft, 0.99));
  if (!first_error.empty()) std::printf("  first error: %s\n", first_error.c_str());
  // Non-zero when any request did not complete, refused ones included.
  if (static_cast<int>(latency.size()) != requests) {
    std::fprintf(
        stderr, "hmoe bench-serve: %d of %d requests did not complete (%d refused, %d failed)%s\n",
        requests - static_cast<int>(latency.size()), requests, exhausted.load(), failed.load(),
        retry == 0 && exhausted.load() > 0 ? "; --retry N sends refused ones again" : "");
    return 1;
  }
  return 0;
}

int BenchAgentCommand(const std::vector<std::string>& args) {
  Command cmd("bench-agent", "[flags]",
              "Replays a coding agent's conversation (sdk/agent_replay.h: a long system prompt,\n"
              "tools, turns of user text and tool results, recorded replies): each turn's\n"
              "prompt tokens, time to first token and decode tok/s, one request at a time.");
  AgentReplayOptions ro;
  int64_t turns = ro.turns, seed = static_cast<int64_t>(ro.seed);
  std::string json_out, label;
  RequestFlags rf;
  rf.max_tokens = 32;
  rf.ignore_eos = true;  // each turn decodes the same number of tokens
  FlagSet& fs = cmd.flags();
  fs.Int("turns", &turns, 1, 10000, "turns to replay");
  fs.Int("system-words", &ro.system_words, 0, int64_t{1} << 24,
         "words of system prompt (~1.3 tokens each with a BPE tokenizer)");
  fs.Int("turn-words", &ro.turn_words, 1, int64_t{1} << 24, "words each turn adds");
  int64_t tools = ro.tools;
  fs.Int("tools", &tools, 1, 8, "tool definitions sent with every turn");
  fs.Int("seed", &seed, 0, std::numeric_limits<int64_t>::max(), "the conversation's seed");
  fs.String("label", &label, "TEXT", "printed with the table and in the JSON (e.g. \"cache on\")");
  fs.String("json", &json_out, "FILE", "also write the turns as JSON");
  AddRequestFlags(fs, &rf);
  int exit_code = 0;
  std::unique_ptr<Client> client = cmd.Start(args, nullptr, nullptr, &exit_code);
  if (client == nullptr) return exit_code;
  ro.turns = static_cast<int>(turns);
  ro.tools = static_cast<int>(tools);
  ro.seed = static_cast<uint64_t>(seed);
  const AgentConversation conv = MakeAgentConversation(ro);
  api::v1::GenerateRequest base;
  ApplySampling(fs, rf, base);
  nlohmann::ordered_json rows = nlohmann::ordered_json::array();
  std::printf("bench-agent%s: %d turns, %d max tokens each\n",
              label.empty() ? "" : absl::StrCat(" (", label, ")").c_str(), ro.turns,
              base.max_tokens());
  std::printf("  turn  prompt tok  new tok  first token ms  decode tok/s\n");
  int64_t last_prompt = 0;
  std::vector<double> ttfts;
  for (int t = 0; t < ro.turns; ++t) {
    api::v1::GenerateRequest req = base;
    *req.mutable_chat() = AgentChat(conv, t);
    auto r = client->Generate(req, nullptr, rf.Deadline());
    if (!r.ok()) return cmd.Fail(r.status(), absl::StrCat(": turn ", t + 1));
    const int64_t prompt = r->usage.prompt_tokens(), out = r->usage.completion_tokens();
    const double decode_s = (r->wall_ms - r->first_chunk_ms) / 1000;
    const double tps = out > 1 && decode_s > 0 ? static_cast<double>(out - 1) / decode_s : 0;
    std::printf("  %4d  %10lld  %7lld  %14.1f  %12.2f\n", t + 1, static_cast<long long>(prompt),
                static_cast<long long>(prompt - last_prompt), r->first_chunk_ms, tps);
    rows.push_back({{"turn", t + 1},
                    {"prompt_tokens", prompt},
                    {"new_prompt_tokens", prompt - last_prompt},
                    {"completion_tokens", out},
                    {"first_token_ms", r->first_chunk_ms},
                    {"decode_tokens_per_s", tps},
                    {"wall_ms", r->wall_ms}});
    ttfts.push_back(r->first_chunk_ms);
    last_prompt = prompt;
  }
  if (ttfts.size() > 1) {
    double later = 0;
    for (size_t i = 1; i < ttfts.size(); ++i) later += ttfts[i];
    later /= static_cast<double>(ttfts.size() - 1);
    std::printf("  first token: turn 1 %.1f ms, turns 2-%zu mean %.1f ms\n", ttfts[0], ttfts.size(),
                later);
  }
  if (!json_out.empty()) {
    nlohmann::ordered_json j = {{"label", label},
                                {"turns", ro.turns},
                                {"system_words", ro.system_words},
                                {"turn_words", ro.turn_words},
                                {"max_tokens", base.max_tokens()},
                                {"rows", rows}};
    std::ofstream f(json_out);
    f << j.dump(1) << "\n";
    if (!f) {
      std::fprintf(stderr, "hmoe bench-agent: cannot write %s\n", json_out.c_str());
      return 1;
    }
  }
  return 0;
}

int StatsCommand(const std::vector<std::string>& args) {
  Command cmd("stats", "[flags]",
              "The worker's requests, KV use and tokens routed per layer and expert.");
  bool json = false;
  std::string save;
  cmd.flags().Bool("json", &json, "print the routing table as JSON");
  cmd.flags().String("save", &save, "FILE",
                     "write the routing table as JSON (for --hot-experts placement)");
  int exit_code = 0;
  auto client = cmd.Start(args, nullptr, nullptr, &exit_code);
  if (!client) return exit_code;
  auto s = client->Stats();
  if (!s.ok()) return cmd.Fail(s.status());
  RoutingTable t;
  t.model_type = s->model_type();
  t.num_experts = s->num_experts();
  t.experts_per_token = s->experts_per_token();
  for (const api::v1::LayerRouting& l : s->routing())
    t.layers.push_back({l.layer(), std::vector<uint64_t>(l.tokens().begin(), l.tokens().end())});
  const std::string table = RoutingTableJson(t);
  if (!save.empty()) {
    const std::string tmp = save + ".tmp";
    FILE* out = std::fopen(tmp.c_str(), "w");
    if (out == nullptr || std::fputs(table.c_str(), out) < 0 || std::fclose(out) != 0 ||
        std::rename(tmp.c_str(), save.c_str()) != 0) {
      std::fprintf(stderr, "hmoe stats: cannot write --save %s\n", save.c_str());
      return 1;
    }
  }
  if (json) {
    std::fputs(table.c_str(), stdout);
    return 0;
  }
  std::printf("requests: %lld running, %lld waiting, %lld completed, %lld rejected; %lld tokens\n",
              static_cast<long long>(s->running()), static_cast<long long>(s->waiting()),
              static_cast<long long>(s->completed()), static_cast<long long>(s->rejected()),
              static_cast<long long>(s->tokens_generated()));
  std::printf("KV cache: %lld of %lld blocks of %lld tokens in use\n",
              static_cast<long long>(s->kv_blocks_used()),
              static_cast<long long>(s->kv_blocks_total()),
              static_cast<long long>(s->kv_block_tokens()));
  std::printf("routing (%s, %lld experts, top-%lld): %llu tokens routed per MoE layer\n",
              t.model_type.c_str(), static_cast<long long>(t.num_experts),
              static_cast<long long>(t.experts_per_token),
              static_cast<unsigned long long>(t.routed_tokens()));
  // Per layer: how concentrated the routing is (the share of the busiest
  // eighth of the experts), what hot-expert placement can exploit.
  for (const RoutingTable::Layer& l : t.layers) {
    std::vector<uint64_t> c = l.tokens;
    std::sort(c.rbegin(), c.rend());
    uint64_t all = 0, top = 0;
    for (size_t i = 0; i < c.size(); ++i) {
      all += c[i];
      if (i < std::max<size_t>(1, c.size() / 8)) top += c[i];
    }
    std::printf("  layer %3d: busiest 1/8 of the experts take %5.1f%%\n", l.layer,
                all ? 100.0 * static_cast<double>(top) / static_cast<double>(all) : 0.0);
  }
  if (!save.empty()) std::printf("saved to %s\n", save.c_str());
  return 0;
}

// One streamed chat request over the worker's HTTP API: wall time, time to
// the first content and completion tokens (from the usage chunk).
struct HttpRun {
  double wall_ms = 0, first_ms = 0;
  int64_t tokens = 0;
  std::string text;
};
absl::StatusOr<HttpRun> HttpChatOnce(httplib::Client& http, const std::string& body) {
  HttpRun run;
  std::string pending;
  absl::Status failed;
  const auto t0 = std::chrono::steady_clock::now();
  httplib::Request req;
  req.method = "POST";
  req.path = "/v1/chat/completions";
  req.body = body;
  req.set_header("Content-Type", "application/json");
  req.content_receiver = [&](const char* data, size_t len, uint64_t, uint64_t) {
    pending.append(data, len);
    size_t end;
    while ((end = pending.find("\n\n")) != std::string::npos) {
      const std::string event = pending.substr(0, end);
      pending.erase(0, end + 2);
      if (event.rfind("data: ", 0) != 0 || event == "data: [DONE]") continue;
      auto j = nlohmann::json::parse(event.substr(6), nullptr, false);
      if (j.is_discarded() || j.contains("error")) {
        failed = absl::InternalError("HTTP stream: " + event);
        return false;
      }
      if (j.contains("usage") && j["usage"].is_object())
        run.tokens = j["usage"]["completion_tokens"].get<int64_t>();
      if (!j["choices"].empty() && j["choices"][0]["delta"].contains("content")) {
        if (run.text.empty())
          run.first_ms =
              std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0)
                  .count();
        run.text += j["choices"][0]["delta"]["content"].get<std::string>();
      }
    }
    return true;
  };
  auto res = http.send(req);
  run.wall_ms =
      std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  if (!failed.ok()) return failed;
  if (!res) return absl::UnavailableError("HTTP: " + httplib::to_string(res.error()));
  if (res->status != 200)
    return absl::InternalError(absl::StrCat("HTTP ", res->status, ": ", res->body));
  return run;
}

int BenchHttpCommand(const std::vector<std::string>& args) {
  Command cmd("bench-http", "[flags]",
              "Streaming chat tok/s at batch 1 over the HTTP API beside gRPC (alternating).");
  std::string url = "http://127.0.0.1:8000";
  int requests = 20, max_tokens = 128;
  std::string prompt = "Tell me a fortune";
  FlagSet& fs = cmd.flags();
  fs.String("http", &url, "URL", "the worker's HTTP API (its --http-listen)");
  fs.Int("requests", &requests, 1, 1 << 20, "requests each way, after one warm-up each");
  fs.Int("max-tokens", &max_tokens, 1, 1 << 20, "tokens per request (EOS ignored)");
  fs.String("prompt", &prompt, "TEXT", "the user message").Alias("-p");
  int exit_code = 0;
  auto client = cmd.Start(args, nullptr, nullptr, &exit_code);
  if (!client) return exit_code;
  auto info = client->ModelInfo();
  if (!info.ok()) return cmd.Fail(info.status());
  if (!info->has_chat_template()) {
    std::fprintf(stderr, "hmoe bench-http: the model has no chat template\n");
    return 1;
  }
  httplib::Client http(url);
  http.set_read_timeout(600, 0);
  auto token = cmd.Token();
  if (!token.ok()) return cmd.Fail(token.status());
  if (!token->empty()) http.set_bearer_token_auth(token->c_str());
  // The same conversation both ways, greedy, eos ignored: the same tokens.
  api::v1::GenerateRequest g;
  api::v1::ChatMessage* m = g.mutable_chat()->add_messages();
  m->set_role("user");
  m->set_content(prompt);
  g.set_max_tokens(max_tokens);
  g.set_ignore_eos(true);
  g.mutable_sampling()->set_temperature(0);
  const std::string body = nlohmann::json{{"messages", {{{"role", "user"}, {"content", prompt}}}},
                                          {"max_tokens", max_tokens},
                                          {"ignore_eos", true},
                                          {"temperature", 0},
                                          {"stream", true},
                                          {"stream_options", {{"include_usage", true}}}}
                               .dump();
  // Alternating, one at a time (batch 1), after one warm-up each: drift in
  // the machine's speed falls on both alike.
  std::vector<double> grpc_tps, http_tps, grpc_first, http_first;
  for (int i = -1; i < requests; ++i) {
    auto r = client->Generate(g, [](const api::v1::GenerateResponse&) { return true; });
    if (!r.ok()) return cmd.Fail(r.status(), " (gRPC)");
    auto h = HttpChatOnce(http, body);
    if (!h.ok()) return cmd.Fail(h.status(), " (HTTP)");
    if (h->text != r->text || h->tokens != r->usage.completion_tokens()) {
      std::fprintf(stderr, "hmoe bench-http: HTTP and gRPC generated different text\n");
      return 1;
    }
    if (i < 0) continue;
    grpc_tps.push_back(static_cast<double>(r->usage.completion_tokens()) / (r->wall_ms / 1e3));
    http_tps.push_back(static_cast<double>(h->tokens) / (h->wall_ms / 1e3));
    grpc_first.push_back(r->first_chunk_ms);
    http_first.push_back(h->first_ms);
  }
  auto median = [](std::vector<double> v) {
    std::sort(v.begin(), v.end());
    return v[v.size() / 2];
  };
  const double g_tps = median(grpc_tps), h_tps = median(http_tps);
  std::printf(
      "{\"model\": \"%s\", \"requests\": %d, \"max_tokens\": %d, \"grpc_tok_s\": %.2f, "
      "\"http_tok_s\": %.2f, \"http_vs_grpc\": %.4f, \"grpc_first_ms\": %.2f, "
      "\"http_first_ms\": %.2f}\n",
      info->model_type().c_str(), requests, max_tokens, g_tps, h_tps, h_tps / g_tps,
      median(grpc_first), median(http_first));
  return 0;
}

}  // namespace hmoe
