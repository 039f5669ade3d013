#include "sdk/commands.h"

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <limits>
#include <map>
#include <mutex>
#include <thread>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/auth_token.h"
#include "common/routing_stats.h"
#include "common/status.h"
#include "httplib.h"
#include "nlohmann/json.hpp"
#include "sdk/client.h"
#include "sdk/stats.h"

namespace hmoe {
namespace {

// --name value / --name=value / boolean --name; positional arguments kept in order.
class Flags {
 public:
  Flags(const std::vector<std::string>& args, const std::vector<std::string>& booleans) {
    for (size_t i = 0; i < args.size(); ++i) {
      const std::string& a = args[i];
      if (a.size() < 2 || a[0] != '-') {
        positional_.push_back(a);
        continue;
      }
      std::string name = a, value;
      const size_t eq = a.find('=');
      if (eq != std::string::npos) {
        name = a.substr(0, eq);
        value = a.substr(eq + 1);
      } else if (std::find(booleans.begin(), booleans.end(), a) != booleans.end()) {
        value = "true";
      } else if (i + 1 < args.size()) {
        value = args[++i];
      } else {
        error_ = a + " needs a value";
      }
      values_[name].push_back(value);
    }
  }
  std::string error() const { return error_; }
  bool Has(const std::string& n) const { return values_.count(n) > 0; }
  std::string Str(const std::string& n, const std::string& def = "") const {
    auto it = values_.find(n);
    return it == values_.end() ? def : it->second.back();
  }
  std::vector<std::string> All(const std::string& n) const {
    auto it = values_.find(n);
    return it == values_.end() ? std::vector<std::string>{} : it->second;
  }
  // A boolean flag: absent -> `def`; `--x` or `--x=true|1|yes|on` -> true;
  // `--x=false|0|no|off` -> false; anything else records an error.
  bool Bool(const std::string& n, bool def) {
    if (!Has(n)) return def;
    const std::string v = Str(n);
    if (v == "true" || v == "1" || v == "yes" || v == "on") return true;
    if (v == "false" || v == "0" || v == "no" || v == "off") return false;
    error_ = absl::StrCat(n, " is true or false, got \"", v, "\"");
    return def;
  }
  // Parses a number; records an error naming the flag.
  double Num(const std::string& n, double def) {
    if (!Has(n)) return def;
    const std::string v = Str(n);
    char* end = nullptr;
    const double x = std::strtod(v.c_str(), &end);
    if (end == v.c_str() || *end != '\0')
      error_ = absl::StrCat(n, " must be a number, got \"", v, "\"");
    return x;
  }
  // Parses an integer in [lo, hi]; records an error naming the flag.
  int64_t Int(const std::string& n, int64_t def, int64_t lo, int64_t hi) {
    if (!Has(n)) return def;
    const std::string v = Str(n);
    char* end = nullptr;
    errno = 0;
    const long long x = std::strtoll(v.c_str(), &end, 10);
    if (end == v.c_str() || *end != '\0' || errno == ERANGE || x < lo || x > hi) {
      error_ = absl::StrCat(n, " must be an integer in [", lo, ", ", hi, "], got \"", v, "\"");
      return def;
    }
    return x;
  }
  // Parses an unsigned 64-bit integer (decimal); records an error naming the flag.
  uint64_t U64(const std::string& n, uint64_t def) {
    if (!Has(n)) return def;
    const std::string v = Str(n);
    char* end = nullptr;
    errno = 0;
    const unsigned long long x = std::strtoull(v.c_str(), &end, 10);
    if (v.empty() || v[0] == '-' || v[0] == '+' || end == v.c_str() || *end != '\0' ||
        errno == ERANGE) {
      error_ = absl::StrCat(n, " must be an integer in [0, 2^64), got \"", v, "\"");
      return def;
    }
    return x;
  }
  const std::vector<std::string>& positional() const { return positional_; }
  // Records an error for positional arguments past the first `allowed`
  // (they were dropped silently: `--ignore-eos false` left ignore_eos on).
  void NoMorePositional(size_t allowed) {
    if (positional_.size() > allowed && error_.empty())
      error_ = absl::StrCat("unexpected argument \"", positional_[allowed],
                            "\" (boolean flags take --flag=false)");
  }
  // --timeout SEC per request: >= 0, 0 (the default) for none.
  double TimeoutSeconds() {
    const double t = Num("--timeout", 0);
    if (!(t >= 0) && error_.empty())
      error_ = absl::StrCat("--timeout must be >= 0 seconds, got \"", Str("--timeout"), "\"");
    return t > 0 ? t : 0;
  }
  // Names not in `known`, for an error.
  std::string Unknown(const std::vector<std::string>& known) const {
    for (const auto& [name, v] : values_)
      if (std::find(known.begin(), known.end(), name) == known.end()) return name;
    return "";
  }

 private:
  std::map<std::string, std::vector<std::string>> values_;
  std::vector<std::string> positional_;
  std::string error_;
};

const std::vector<std::string> kSamplingFlags = {"--server",
                                                 "--token-file",
                                                 "--tls-ca-file",
                                                 "--tls-cert-file",
                                                 "--tls-key-file",
                                                 "--max-tokens",
                                                 "--temperature",
                                                 "--top-k",
                                                 "--top-p",
                                                 "--min-p",
                                                 "--repetition-penalty",
                                                 "--presence-penalty",
                                                 "--frequency-penalty",
                                                 "--seed",
                                                 "--stop",
                                                 "--ignore-eos",
                                                 "--add-special-tokens",
                                                 "--timeout"};

// Fills the request's sampling and limits from flags.
void ApplySampling(Flags& f, api::v1::GenerateRequest& req, int default_max_tokens) {
  constexpr int64_t kI32 = std::numeric_limits<int32_t>::max();
  req.set_max_tokens(static_cast<int32_t>(f.Int("--max-tokens", default_max_tokens, 1, kI32)));
  auto* s = req.mutable_sampling();
  if (f.Has("--temperature")) s->set_temperature(static_cast<float>(f.Num("--temperature", 0)));
  if (f.Has("--top-k")) s->set_top_k(static_cast<int32_t>(f.Int("--top-k", 0, 0, kI32)));
  if (f.Has("--top-p")) s->set_top_p(static_cast<float>(f.Num("--top-p", 1)));
  if (f.Has("--min-p")) s->set_min_p(static_cast<float>(f.Num("--min-p", 0)));
  if (f.Has("--repetition-penalty"))
    s->set_repetition_penalty(static_cast<float>(f.Num("--repetition-penalty", 1)));
  if (f.Has("--presence-penalty"))
    s->set_presence_penalty(static_cast<float>(f.Num("--presence-penalty", 0)));
  if (f.Has("--frequency-penalty"))
    s->set_frequency_penalty(static_cast<float>(f.Num("--frequency-penalty", 0)));
  if (f.Has("--seed")) s->set_seed(f.U64("--seed", 0));
  for (const std::string& stop : f.All("--stop")) req.add_stop(stop);
  req.set_ignore_eos(f.Bool("--ignore-eos", false));
  req.set_add_special_tokens(f.Bool("--add-special-tokens", false));
}

// The token to send: --token-file's, else $HMOE_TOKEN_FILE's; "" for none.
absl::StatusOr<std::string> TokenFrom(Flags& f) {
  const char* env_token = std::getenv("HMOE_TOKEN_FILE");
  const std::string token_file = f.Str("--token-file", env_token ? env_token : "");
  if (token_file.empty()) return std::string();
  return ReadAuthTokenFile(token_file);
}

absl::StatusOr<std::unique_ptr<Client>> ConnectFrom(Flags& f) {
  ClientOptions o;
  o.target = f.Str("--server",
                   std::getenv("HMOE_SERVER") ? std::getenv("HMOE_SERVER") : "127.0.0.1:50051");
  ASSIGN_OR_RETURN(o.auth_token, TokenFrom(f));
  const char* env_ca = std::getenv("HMOE_TLS_CA_FILE");
  o.tls.ca_file = f.Str("--tls-ca-file", env_ca ? env_ca : "");
  o.tls.cert_file = f.Str("--tls-cert-file");
  o.tls.key_file = f.Str("--tls-key-file");
  return Client::Connect(o);
}

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

int Fail(const std::string& cmd, const absl::Status& s) {
  std::fprintf(stderr, "hmoe %s: %s\n", cmd.c_str(), s.ToString().c_str());
  return 1;
}

}  // namespace

int GenerateCommand(const std::vector<std::string>& args) {
  Flags f(args, {"--ignore-eos", "--add-special-tokens", "--ids"});
  std::vector<std::string> known = kSamplingFlags;
  known.insert(known.end(), {"-p", "--prompt", "--ids"});
  if (!f.Unknown(known).empty()) {
    std::fprintf(stderr, "hmoe generate: unknown flag %s\n", f.Unknown(known).c_str());
    return 2;
  }
  std::string prompt = f.Str("-p", f.Str("--prompt"));
  const bool flag_prompt = !prompt.empty();
  if (!flag_prompt && !f.positional().empty()) prompt = f.positional()[0];
  f.NoMorePositional(flag_prompt ? 0 : 1);
  if (prompt.empty()) {
    std::fprintf(stderr,
                 "usage: hmoe generate -p|--prompt TEXT [--server ADDR] [sampling flags] [--ids]\n"
                 "       [--timeout SEC] [--token-file PATH] [--tls-ca-file PEM]\n"
                 "(hmoe --help lists the sampling flags)\n");
    return 2;
  }
  api::v1::GenerateRequest req;
  req.set_prompt(prompt);
  ApplySampling(f, req, 64);
  const double timeout = f.TimeoutSeconds();
  const bool ids = f.Bool("--ids", false);
  if (!f.error().empty()) {
    std::fprintf(stderr, "hmoe generate: %s\n", f.error().c_str());
    return 2;
  }
  auto client = ConnectFrom(f);
  if (!client.ok()) return Fail("generate", client.status());
  std::fputs(prompt.c_str(), stdout);
  std::fflush(stdout);
  auto r = (*client)->Generate(
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
      timeout > 0 ? absl::Now() + absl::Seconds(timeout) : absl::InfiniteFuture());
  std::printf("\n");
  std::fflush(stdout);
  if (!r.ok()) return Fail("generate", r.status());
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

// One line of `hmoe chat`'s input: text to send, /reset, a line to skip
// (empty), or the end (EOF, /quit, /exit). The "> " prompt on a terminal.
enum class ChatLine { kText, kReset, kSkip, kEnd };
ChatLine ReadChatLine(bool tty, std::string* line) {
  if (tty) std::fputs("> ", stderr);
  if (!std::getline(std::cin, *line)) return ChatLine::kEnd;
  if (*line == "/quit" || *line == "/exit") return ChatLine::kEnd;
  if (*line == "/reset") return ChatLine::kReset;
  return line->empty() ? ChatLine::kSkip : ChatLine::kText;
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
int ChatWithTemplate(Flags& f, const api::v1::GenerateRequest& base, double timeout,
                     Client& client) {
  const std::string system = f.Str("--system");
  std::vector<std::pair<std::string, std::string>> turns;  // (user, assistant)
  const bool tty = isatty(0);
  std::string line;
  for (;;) {
    const ChatLine next = ReadChatLine(tty, &line);
    if (next == ChatLine::kEnd) break;
    if (next == ChatLine::kReset) turns.clear();
    if (next != ChatLine::kText) continue;
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
      auto r = client.Generate(
          req, PrintInto(&reply),
          timeout > 0 ? absl::Now() + absl::Seconds(timeout) : absl::InfiniteFuture());
      // The history no longer fits: drop the oldest exchange and ask again.
      if (!r.ok() && absl::IsInvalidArgument(r.status()) && !turns.empty() &&
          absl::StrContains(r.status().message(), "the context holds")) {
        turns.erase(turns.begin());
        continue;
      }
      std::printf("\n");
      if (!r.ok()) {
        Fail("chat", r.status());
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
  Flags f(args, {"--ignore-eos", "--add-special-tokens", "--plain-text"});
  std::vector<std::string> known = kSamplingFlags;
  known.push_back("--system");
  known.push_back("--plain-text");
  if (!f.Unknown(known).empty()) {
    std::fprintf(stderr, "hmoe chat: unknown flag %s\n", f.Unknown(known).c_str());
    return 2;
  }
  // Every flag is checked before connecting.
  api::v1::GenerateRequest base;
  ApplySampling(f, base, 64);
  const bool plain_text = f.Bool("--plain-text", false);
  const double timeout = f.TimeoutSeconds();
  f.NoMorePositional(0);
  if (!f.error().empty()) {
    std::fprintf(stderr, "hmoe chat: %s\n", f.error().c_str());
    return 2;
  }
  auto client = ConnectFrom(f);
  if (!client.ok()) return Fail("chat", client.status());
  auto info = (*client)->ModelInfo();
  if (!info.ok()) return Fail("chat", info.status());
  const bool tty = isatty(0);
  if (tty)
    std::fprintf(stderr,
                 "hmoe chat with %s (%lld-token context). /reset clears the history, /quit or "
                 "Ctrl-D ends.\n",
                 info->model_type().c_str(), static_cast<long long>(info->max_context()));
  if (info->has_chat_template() && !plain_text) return ChatWithTemplate(f, base, timeout, **client);
  // Plain-text transcript (a model without a chat template, or
  // --plain-text). The --system text stays first; the oldest turns go when
  // the context is full.
  if (base.stop_size() == 0) base.add_stop("\nUser:");
  std::string system = f.Str("--system");
  if (!system.empty()) system += "\n";
  std::vector<std::string> turns;  // "User: ...\nAssistant: ...\n"
  // Room kept for the reply (the engine clamps max_tokens to the context).
  const int64_t reply_room = std::min<int64_t>(base.max_tokens(), info->max_context() / 2);
  std::string line;
  for (;;) {
    const ChatLine next = ReadChatLine(tty, &line);
    if (next == ChatLine::kEnd) break;
    if (next == ChatLine::kReset) turns.clear();
    if (next != ChatLine::kText) continue;
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
      auto ids = (*client)->Tokenize(prompt, base.add_special_tokens());
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
      Fail("chat", tokenized);
      continue;
    }
    api::v1::GenerateRequest req = base;
    req.set_prompt(prompt);
    std::string reply;
    auto r = (*client)->Generate(
        req, PrintInto(&reply),
        timeout > 0 ? absl::Now() + absl::Seconds(timeout) : absl::InfiniteFuture());
    std::printf("\n");
    if (!r.ok()) {
      Fail("chat", r.status());
      continue;
    }
    turns.push_back(ask + reply + "\n");
  }
  return 0;
}

int BenchServeCommand(const std::vector<std::string>& args) {
  Flags f(args, {"--ignore-eos", "--add-special-tokens"});
  std::vector<std::string> known = kSamplingFlags;
  known.insert(known.end(), {"--clients", "--requests", "--prompt", "-p", "--retry"});
  if (!f.Unknown(known).empty()) {
    std::fprintf(stderr, "hmoe bench-serve: unknown flag %s\n", f.Unknown(known).c_str());
    return 2;
  }
  const int clients = static_cast<int>(f.Int("--clients", 8, 1, 4096));
  const int requests = static_cast<int>(f.Int("--requests", int64_t{clients} * 4, 1, 1 << 24));
  // A request the server refuses with RESOURCE_EXHAUSTED (its queue full)
  // is sent again up to this many times, after 5 ms doubling to 200 ms.
  const int retry = static_cast<int>(f.Int("--retry", 0, 0, 1 << 20));
  const std::string prompt = f.Str("-p", f.Str("--prompt", "Once upon a time"));
  api::v1::GenerateRequest base;
  base.set_prompt(prompt);
  ApplySampling(f, base, 32);
  // Fixed-length outputs measure steadier: EOS is ignored unless --ignore-eos=false.
  base.set_ignore_eos(f.Bool("--ignore-eos", true));
  const double timeout = f.TimeoutSeconds();
  f.NoMorePositional(0);
  if (!f.error().empty() || clients < 1 || requests < 1) {
    std::fprintf(stderr, "hmoe bench-serve: %s\n",
                 f.error().empty() ? "--clients and --requests must be >= 1" : f.error().c_str());
    return 2;
  }
  // Every client connects before the clock starts (the run times requests,
  // not handshakes); one that cannot is a failed run.
  std::vector<std::unique_ptr<Client>> conns;
  for (int c = 0; c < clients; ++c) {
    auto client = ConnectFrom(f);
    if (!client.ok()) {
      std::fprintf(stderr, "hmoe bench-serve: client %d of %d: %s\n", c + 1, clients,
                   client.status().ToString().c_str());
      return 1;
    }
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
        auto send = [&] {
          return client.Generate(
              base, nullptr,
              timeout > 0 ? absl::Now() + absl::Seconds(timeout) : absl::InfiniteFuture());
        };
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

int StatsCommand(const std::vector<std::string>& args) {
  Flags f(args, {"--json"});
  const std::vector<std::string> known = {"--server",        "--token-file",   "--tls-ca-file",
                                          "--tls-cert-file", "--tls-key-file", "--save",
                                          "--json"};
  if (!f.Unknown(known).empty()) {
    std::fprintf(stderr, "hmoe stats: unknown flag %s\n", f.Unknown(known).c_str());
    return 2;
  }
  const bool json = f.Bool("--json", false);
  const std::string save = f.Str("--save");
  f.NoMorePositional(0);
  if (!f.error().empty()) {
    std::fprintf(stderr, "hmoe stats: %s\n", f.error().c_str());
    return 2;
  }
  auto client = ConnectFrom(f);
  if (!client.ok()) {
    std::fprintf(stderr, "hmoe stats: %s\n", client.status().ToString().c_str());
    return 1;
  }
  auto s = (*client)->Stats();
  if (!s.ok()) {
    std::fprintf(stderr, "hmoe stats: %s\n", s.status().ToString().c_str());
    return 1;
  }
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
  Flags f(args, {});
  std::vector<std::string> known = {
      "--server", "--token-file", "--tls-ca-file", "--tls-cert-file", "--tls-key-file",
      "--http",   "--requests",   "--max-tokens",  "--prompt",        "-p"};
  if (!f.Unknown(known).empty()) {
    std::fprintf(stderr, "hmoe bench-http: unknown flag %s\n", f.Unknown(known).c_str());
    return 2;
  }
  const std::string url = f.Str("--http", "http://127.0.0.1:8000");
  const int requests = static_cast<int>(f.Int("--requests", 20, 1, 1 << 20));
  const int max_tokens = static_cast<int>(f.Int("--max-tokens", 128, 1, 1 << 20));
  const std::string prompt = f.Str("-p", f.Str("--prompt", "Tell me a fortune"));
  f.NoMorePositional(0);
  if (!f.error().empty()) {
    std::fprintf(stderr, "hmoe bench-http: %s\n", f.error().c_str());
    return 2;
  }
  auto client = ConnectFrom(f);
  if (!client.ok()) return Fail("bench-http", client.status());
  auto info = (*client)->ModelInfo();
  if (!info.ok()) return Fail("bench-http", info.status());
  if (!info->has_chat_template()) {
    std::fprintf(stderr, "hmoe bench-http: the model has no chat template\n");
    return 1;
  }
  httplib::Client http(url);
  http.set_read_timeout(600, 0);
  auto token = TokenFrom(f);
  if (!token.ok()) return Fail("bench-http", token.status());
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
    auto r = (*client)->Generate(g, [](const api::v1::GenerateResponse&) { return true; });
    if (!r.ok()) return Fail("bench-http (gRPC)", r.status());
    auto h = HttpChatOnce(http, body);
    if (!h.ok()) return Fail("bench-http (HTTP)", h.status());
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
