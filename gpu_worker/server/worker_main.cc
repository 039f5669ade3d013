// hmoe-gpu-worker: serves hmoe.api.v1.Generation (and, with --http-listen,
// the OpenAI-compatible HTTP API) for one model.
//
//   hmoe-gpu-worker --model DIR [flags]
//
// Flags, health, signals and exit codes: AddFlags and Run's FlagSet below,
// printed by --help and in docs/FLAGS.md.
#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <limits>
#include <memory>
#include <mutex>
#include <optional>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"
#include "absl/strings/str_split.h"
#include "common/auth_token.h"
#include "common/expert_placement.h"
#include "common/experts/weight_format.h"
#include "common/flags.h"
#include "common/load_progress.h"
#include "common/metrics.h"
#include "common/safetensors.h"
#include "common/small_file.h"
#include "common/systemd_notify.h"
#include "common/text/chat_template.h"
#include "common/text/tokenizer.h"
#include "common/text/tool_calls.h"
#include "common/transport/grpc_tls.h"
#include "common/transport/ucx_wire.h"
#include "common/weight_map.h"
#include "gpu_worker/calibrate.h"
#include "gpu_worker/engine/engine.h"
#include "gpu_worker/hot_weights.h"
#include "gpu_worker/memory_plan.h"
#include "gpu_worker/model.h"
#include "gpu_worker/server/generation_service.h"
#include "gpu_worker/server/http_service.h"
#include "gpu_worker/server/remote_experts.h"
#include "grpcpp/grpcpp.h"
#include "grpcpp/health_check_service_interface.h"

namespace hmoe {
namespace {

struct WorkerOptions {
  std::string model_dir;
  std::string listen = "127.0.0.1:50051";
  std::string experts = "local";
  std::string transport = "grpc";
  std::string port_file;  // written with the bound port once serving (for --listen HOST:0)
  int max_batch = 16;
  int max_queue = 64;
  int64_t prefill_chunk = 64;
  int64_t max_context = 0;  // 0: the model's max_position_embeddings
  int64_t kv_blocks = 0;
  int threads = 0;
  int expert_timeout_ms = 10000;
  int drain_seconds = 30;
  int defer_experts = 0;
  std::string backend = "auto";
  int cuda_device = 0;
  double gpu_mem_gb = 0;
  DenseWeights gpu_weights = DenseWeights::kAuto;
  KvDtype kv_dtype = KvDtype::kBf16;
  bool cuda_graphs = true;
  bool cuda_expert_slots = true;
  SlotCalls cuda_slot_calls = SlotCalls::kDeviceSends;
  int64_t gemm_attention_tokens = 64;
  bool gemm_attention_tf32 = true;
  PrefillExperts prefill_experts = PrefillExperts::kCpu;
  std::string prefill_rates;  // file
  bool log_prefill_plans = false;
  bool prefill_prefetch = true;
  int64_t debug_cuda_fault_after = 0;
  std::string routing_stats_out;
  std::string hot_experts;  // routing-stats file
  std::string calibrate;    // prompts file
  double hot_experts_gb = 0;
  bool hot_experts_fill = false;
  std::string auth_token_file;
  std::string expert_auth_token_file;
  std::string http_listen;     // empty: no HTTP API
  std::string http_port_file;  // written with the HTTP port once serving
  int http_max_connections = HttpServiceOptions().max_connections;
  int http_header_timeout_seconds = 10;
  std::string served_model_name;
  std::string chat_template;                   // a .jinja file; empty: the model directory's
  std::optional<ToolSyntax> tool_call_syntax;  // nullopt: the chat template's
  std::optional<bool> reasoning_content;       // nullopt: where the template writes </think>
  TlsServerFiles tls;
  TlsClientFiles expert_tls;
};

[[noreturn]] void Die(const std::string& msg, int code = 2) {
  std::fprintf(stderr, "hmoe-gpu-worker: %s\n", msg.c_str());
  std::exit(code);
}

// The flags, bound to `o`'s fields.
void AddFlags(FlagSet& fs, WorkerOptions* o) {
  const std::vector<std::pair<std::string, bool>> on_off = {{"on", true}, {"off", false}};
  fs.Group("model and serving");
  fs.String("model", &o->model_dir, "DIR", "the model directory (required)");
  fs.String("listen", &o->listen, "HOST:PORT", "the gRPC API (hmoe.api.v1.Generation)");
  fs.String("port-file", &o->port_file, "PATH",
            "gets the bound port once serving (for --listen HOST:0)");
  fs.Int("max-batch", &o->max_batch, 1, 4096,
         "requests decoded together (cuda: the KV pool is planned for this many sequences of "
         "--max-context, or as many whole ones as fit)");
  fs.Int("max-queue", &o->max_queue, 1, 1 << 20, "requests waiting at most; more are refused");
  fs.Int("max-context", &o->max_context, 0, int64_t{1} << 24,
         "tokens per request; 0: the model's max_position_embeddings");
  fs.Int("kv-blocks", &o->kv_blocks, 0, int64_t{1} << 40,
         "the paged KV pool's blocks (cuda) and the engine's budget; 0: the memory plan's "
         "(hmoe inspect --gpu-mem-gb prints it)");
  fs.Int("prefill-chunk", &o->prefill_chunk, 1, int64_t{1} << 20,
         "prompt tokens per scheduler step, all requests together (streamed prefill experts pay "
         "off only for chunks of thousands of tokens, which also hold the running requests' "
         "next token that long)");
  fs.Int("threads", &o->threads, 0, 4096, "CPU threads; 0: one per core");
  fs.Int("drain-seconds", &o->drain_seconds, 0, 24 * 3600,
         "on SIGTERM, how long in-flight requests may finish");
  fs.String("routing-stats-out", &o->routing_stats_out, "FILE",
            "at shutdown, the tokens routed to each expert of each MoE layer (`hmoe stats "
            "--save`'s JSON, common/routing_stats.h)");
  fs.Group("routed experts");
  fs.String("experts", &o->experts, "local|HOST:PORT,...",
            "in-process (reference), or the expert service shards");
  fs.Choice("transport", &o->transport, {"grpc", "shm", "ucx"}, "to the expert service shards");
  fs.Int("expert-timeout-ms", &o->expert_timeout_ms, 1, 3600 * 1000,
         "an expert call that misses it fails its request UNAVAILABLE, and expert calls fail "
         "at once for the next second");
  fs.Int("defer-experts", &o->defer_experts, 0, 256,
         "Expert Deferral: the N lowest-weighted routed experts per token join one layer late "
         "(0: the exact model)");
  fs.Group("backend");
  fs.Choice("backend", &o->backend, {"cpu", "cuda", "auto"},
            "where attention, router, shared experts and the LM head run (auto: cuda when a "
            "usable GPU is present, else cpu; the choice is logged at start)");
  fs.Int("cuda-device", &o->cuda_device, 0, 1024, "the GPU");
  fs.Double(
      "gpu-mem-gb", &o->gpu_mem_gb,
      "bounds the cuda backend's weights, KV cache and workspaces (to emulate a smaller card); "
      "0: the card's",
      [](double x) { return x >= 0 && x <= 1e6; }, "a number of GiB >= 0");
  fs.Enum<DenseWeights>("gpu-weights", &o->gpu_weights,
                        {{"auto", DenseWeights::kAuto},
                         {"bf16", DenseWeights::kBf16},
                         {"fp8", DenseWeights::kFp8},
                         {"int8", DenseWeights::kInt8},
                         {"int4", DenseWeights::kInt4}},
                        "precision of attention, dense MLPs, shared experts and the LM head "
                        "(auto: the checkpoint's own)");
  fs.Enum<KvDtype>("kv-dtype", &o->kv_dtype,
                   {{"f32", KvDtype::kF32}, {"bf16", KvDtype::kBf16}, {"fp8", KvDtype::kFp8}},
                   "element type of the KV cache");
  fs.Enum<bool>("cuda-graphs", &o->cuda_graphs, on_off,
                "replay one CUDA Graph per decode step (off: the same work kernel by kernel)");
  fs.Enum<bool>("cuda-expert-slots", &o->cuda_expert_slots, on_off,
                "off: every pass's routed experts go the host-copy way (no slots, no graphs)");
  fs.Enum<SlotCalls>(
      "cuda-expert-calls", &o->cuda_slot_calls,
      {{"device", SlotCalls::kDeviceSends}, {"host", SlotCalls::kHostNodes}},
      "who sends each expert call and waits for its answer inside a slot pass (device: "
      "kernels, over shm; host: host nodes)");
  fs.Int("gemm-attention-tokens", &o->gemm_attention_tokens, 0, int64_t{1} << 20,
         "a prompt chunk of at least N tokens computes attention by tensor-core GEMMs (0: off)");
  fs.Enum<bool>("gemm-attention-tf32", &o->gemm_attention_tf32, on_off,
                "off: those GEMMs in full fp32 (slower)");
  fs.Int("debug-cuda-fault-after", &o->debug_cuda_fault_after, 1, int64_t{1} << 40,
         "tests: inject a sticky device error at the start of pass N + 1");
  fs.Group("hot experts and prefill (cuda)");
  fs.String("hot-experts", &o->hot_experts, "STATS",
            "routing statistics (`hmoe stats --save`, --routing-stats-out): the routed experts "
            "that save the most CPU bytes per token fill --hot-experts-gb and run on the GPU in "
            "decode steps, quantized as the expert service serves them (its --format); the "
            "placement is logged at start; foreign or malformed stats stop the worker (exit 1) "
            "naming the file and field");
  fs.String("calibrate", &o->calibrate, "PROMPTS",
            "or: the statistics from a calibration run at start: the model loads without hot "
            "experts, prefills each line of PROMPTS (text, one prompt per line), plans from its "
            "routing counts and loads again with the hot experts (logged: prompts, tokens, "
            "seconds)");
  fs.Double(
      "hot-experts-gb", &o->hot_experts_gb, "GPU memory for the hot experts",
      [](double x) { return x > 0 && x <= 1e6; }, "a number of GiB > 0");
  fs.Bool("hot-experts-fill", &o->hot_experts_fill,
          "instead of --hot-experts-gb: the hot experts fill what the GPU memory plan leaves "
          "after weights, KV pool and workspaces (hmoe inspect --gpu-mem-gb --fill-hot prints it)");
  fs.Enum<PrefillExperts>(
      "prefill-experts", &o->prefill_experts,
      {{"cpu", PrefillExperts::kCpu},
       {"stream", PrefillExperts::kStream},
       {"auto", PrefillExperts::kAuto}},
      "where a prefill pass's routed experts run per MoE layer: the service, "
      "streamed to the GPU over PCIe, or the cost model's choice (stream and auto "
      "keep a pinned host copy of every routed expert in the shards' format)");
  fs.String("prefill-rates", &o->prefill_rates, "FILE",
            "with --prefill-experts auto: the cost model's rates from FILE (the JSON the worker "
            "logs once it has measured them) instead of measured at start and at the first "
            "prefill; a missing or malformed file stops the worker (exit 1) naming it and the "
            "field");
  fs.Enum<bool>("log-prefill-plans", &o->log_prefill_plans, on_off,
                "one stderr line per streamed-prefill pass with each layer's choice");
  fs.Enum<bool>("prefill-prefetch", &o->prefill_prefetch, on_off,
                "upload the next MoE layer's experts ahead (one more layer's experts of GPU "
                "memory)");
  fs.Group("HTTP API");
  fs.String("http-listen", &o->http_listen, "HOST:PORT",
            "also serve the OpenAI-compatible HTTP API there (/v1/chat/completions, "
            "/v1/completions, /v1/models, /metrics, /health; 127.0.0.1:8000 is usual), with the "
            "same --auth-token-file tokens (as Bearer) and --tls-* files (HTTPS) as the gRPC "
            "port");
  fs.String("http-port-file", &o->http_port_file, "PATH", "gets the HTTP port once serving");
  fs.Int("http-max-connections", &o->http_max_connections, 1, 1 << 20,
         "HTTP connections open at once (each streamed request holds one; idle keep-alive ones "
         "close after 5 s); more are answered 503 and closed");
  fs.Int("http-header-timeout-seconds", &o->http_header_timeout_seconds, 1, 3600,
         "a request's head (and an HTTPS handshake) must arrive within this many seconds, else "
         "the connection is closed (408): slow clients cannot hold connections");
  fs.String("served-model-name", &o->served_model_name, "NAME",
            "the model's name for clients (default: the model directory's)");
  fs.String("chat-template", &o->chat_template, "FILE",
            "a .jinja chat template instead of the model directory's (tokenizer_config.json's "
            "chat_template, or chat_template.jinja); a template with a construct the interpreter "
            "does not support stops the worker at start (exit 1), naming it and where");
  fs.Enum<std::optional<ToolSyntax>>(
      "tool-call-syntax", &o->tool_call_syntax,
      {{"auto", std::nullopt},
       {"none", ToolSyntax::kNone},
       {"deepseek", ToolSyntax::kDeepseek},
       {"kimi_k2", ToolSyntax::kKimiK2},
       {"qwen3", ToolSyntax::kQwen3},
       {"qwen3_coder", ToolSyntax::kQwen3Coder},
       {"glm45", ToolSyntax::kGlm45},
       {"mixtral", ToolSyntax::kMixtral}},
      "how the model writes tool calls, parsed into chat completions' tool_calls (auto: from "
      "the chat template's markers; none: calls stay content)");
  fs.Enum<std::optional<bool>>(
      "reasoning-content", &o->reasoning_content,
      {{"auto", std::nullopt}, {"on", true}, {"off", false}},
      "return <think> blocks as chat completions' reasoning_content (auto: when the chat "
      "template writes </think>)");
  fs.Group(
      "security (--tls-*: the client API speaks TLS; --expert-tls-*: TLS to the shards' gRPC "
      "ports, their --tls-cert-file)");
  fs.String("auth-token-file", &o->auth_token_file, "PATH",
            "clients must send a token in this file (one per line, so a token can rotate; "
            "SIGHUP re-reads it), else UNAUTHENTICATED; health stays open");
  fs.String("expert-auth-token-file", &o->expert_auth_token_file, "PATH",
            "the token the expert service shards require (their --auth-token-file); the "
            "worker sends the file's first token");
  AddTlsFlags(fs, &o->tls);
  AddTlsFlags(fs, &o->expert_tls, "expert-tls");
}

// The checks across flags.
absl::Status CheckFlags(const WorkerOptions& o) {
  if (o.model_dir.empty()) return absl::InvalidArgumentError("--model DIR is required");
  if (o.http_listen.empty() && !o.http_port_file.empty())
    return absl::InvalidArgumentError("--http-port-file needs --http-listen");
  return absl::OkStatus();
}

// SIGHUP: a token file is read again; one that fails its checks leaves the
// tokens in force, saying why.
void ReloadTokens(const char* flag, const std::string& path, AuthTokens* tokens) {
  if (path.empty()) return;
  std::fprintf(stderr, "hmoe-gpu-worker: SIGHUP: %s %s\n", flag,
               tokens->ReloadForLog(path).c_str());
}

int Run(int argc, char** argv) {
  // Signals are taken by a sigwait thread, never by a handler.
  sigset_t sigs;
  // A client gone mid-write is an error on that write, not the process's
  // end (cpp-httplib's TLS writes go through OpenSSL's write(), which raises
  // SIGPIPE on a closed connection).
  signal(SIGPIPE, SIG_IGN);
  sigemptyset(&sigs);
  sigaddset(&sigs, SIGTERM);
  sigaddset(&sigs, SIGINT);
  sigaddset(&sigs, SIGHUP);
  pthread_sigmask(SIG_BLOCK, &sigs, nullptr);

  WorkerOptions flagged;
  FlagSet flags("hmoe-gpu-worker", "--model DIR [flags]",
                "Serves hmoe.api.v1.Generation (and, with --http-listen, the OpenAI-compatible "
                "HTTP API)\nfor one model. Health (grpc.health.v1) is SERVING once the model is "
                "loaded and, with\nremote experts, while every shard answers.\n"
                "SIGTERM / SIGINT: stop accepting, let in-flight requests finish within\n"
                "--drain-seconds (the rest end UNAVAILABLE), exit 0. SIGHUP (systemctl reload): "
                "the\ntoken files are read again. A backend that failed for good (a sticky CUDA "
                "error)\nturns health NOT_SERVING, fails what is in flight, and the worker "
                "drains and exits 3\nso that systemd restarts it. A bad flag exits 2.");
  AddFlags(flags, &flagged);
  if (auto exit = flags.ParseOrExit(argc, argv, [&] { return CheckFlags(flagged); })) return *exit;
  const WorkerOptions& o = flagged;
  std::fprintf(stderr,
               "hmoe-gpu-worker: model %s, listen %s, experts %s (%s), max_batch %d, max_queue %d, "
               "max_context %lld, drain %ds, deferred experts %d\n",
               o.model_dir.c_str(), o.listen.c_str(), o.experts.c_str(), o.transport.c_str(),
               o.max_batch, o.max_queue, static_cast<long long>(o.max_context), o.drain_seconds,
               o.defer_experts);

  // Token files are read (and their errors reported) before anything loads.
  auto read_tokens = [](const std::string& path) -> std::shared_ptr<AuthTokens> {
    if (path.empty()) return std::make_shared<AuthTokens>();
    auto t = AuthTokens::FromFile(path);
    if (!t.ok()) Die(std::string(t.status().message()));
    return *t;
  };
  const std::shared_ptr<AuthTokens> auth_tokens = read_tokens(o.auth_token_file);
  const std::shared_ptr<AuthTokens> expert_auth_tokens = read_tokens(o.expert_auth_token_file);
  auto server_credentials = ServerCredentialsFrom(o.tls);
  if (!server_credentials.ok()) Die(std::string(server_credentials.status().message()));
  auto expert_credentials = ChannelCredentialsFrom(o.expert_tls, "--expert-tls");
  if (!expert_credentials.ok()) Die(std::string(expert_credentials.status().message()));
  if (!auth_tokens->enabled() && !IsLoopbackListenAddress(o.listen)) {
    std::fprintf(stderr,
                 "hmoe-gpu-worker: warning: listening on %s without --auth-token-file: any host "
                 "that reaches it can use this worker\n",
                 o.listen.c_str());
  }

  auto config = LoadModelConfig(o.model_dir);
  if (!config.ok()) Die(config.status().ToString(), 1);
  // The engine's and the expert pool's metrics (/metrics on the HTTP API);
  // declared first, so it outlives both.
  MetricsRegistry metrics;
  std::unique_ptr<ExpertPool> pool;
  std::unique_ptr<PoolRoutedExperts> remote;
  std::string backend = "in-process reference";
  if (o.experts != "local") {
    ExpertPoolOptions po;
    po.targets = absl::StrSplit(o.experts, ',', absl::SkipEmpty());
    auto kind = ParseTransportKind(o.transport);
    if (!kind.ok()) Die(kind.status().ToString());
    po.transport = *kind;
    if (po.transport == TransportKind::kUcx && std::getenv("UCX_NET_DEVICES") == nullptr) {
      // UCX's TCP listeners only on the interfaces the shards are reached by
      // (loopback for loopback targets), not on every device.
      const std::string devices = UcxNetDevicesForTargets(po.targets);
      if (!devices.empty()) {
        ::setenv("UCX_NET_DEVICES", devices.c_str(), 1);
        std::fprintf(stderr, "hmoe-gpu-worker: UCX data plane on network device(s) %s\n",
                     devices.c_str());
      } else {
        std::fprintf(stderr,
                     "hmoe-gpu-worker: UCX data plane on every network device (a target "
                     "is not a literal address with a known route; UCX_NET_DEVICES sets them)\n");
      }
    }
    // A hung shard costs one --expert-timeout-ms, not one per queued call.
    po.fail_fast_after_miss = absl::Seconds(1);
    // A shard the health monitor (every second) finds down costs no
    // timeout at all until it finds it up again.
    po.fail_fast_after_failed_check = absl::Seconds(3);
    po.auth_tokens = expert_auth_tokens;
    po.credentials = *expert_credentials;  // insecure ones without --expert-tls-*
    po.metrics = &metrics;
    auto p = ExpertPool::Connect(po);
    if (!p.ok()) Die("expert service: " + p.status().ToString(), 1);
    pool = std::move(*p);
    // The checkpoint's routed experts, to compare with the shards' (a model
    // dir without them cannot say).
    std::string fingerprint;
    if (auto ckpt = Checkpoint::Open(o.model_dir); ckpt.ok()) {
      if (auto fp = RoutedExpertsFingerprint(**ckpt, *config); fp.ok()) fingerprint = *fp;
    }
    auto r = PoolRoutedExperts::Create(*config, pool.get(), absl::Milliseconds(o.expert_timeout_ms),
                                       fingerprint);
    if (!r.ok()) Die(r.status().ToString(), 1);
    remote = std::move(*r);
    backend = o.experts + " over " + o.transport;
  }
  ModelOptions mo;
  mo.num_threads = o.threads;
  mo.max_seq_len = o.max_context;
  mo.deferred_experts = o.defer_experts;
  mo.weights = o.gpu_weights;
  mo.kv_dtype = o.kv_dtype;
  mo.metrics = &metrics;
  mo.cuda.device = o.cuda_device;
  mo.cuda.gpu_mem_gb = o.gpu_mem_gb;
  mo.cuda.kv_sequences = o.max_batch;
  mo.cuda.graphs = o.cuda_graphs;
  mo.cuda.expert_slots = o.cuda_expert_slots;
  mo.cuda.gemm_attention_tokens = o.gemm_attention_tokens;
  mo.cuda.gemm_attention_tf32 = o.gemm_attention_tf32;
  mo.cuda.slot_calls = o.cuda_slot_calls;
  mo.cuda.prefill_experts = o.prefill_experts;
  if (!o.prefill_rates.empty()) {
    if (o.prefill_experts != PrefillExperts::kAuto)
      Die("--prefill-rates needs --prefill-experts auto");
    auto text = ReadSmallFile(o.prefill_rates, kMaxIndexJsonBytes);
    if (!text.ok()) Die("--prefill-rates: " + text.status().ToString(), 1);
    auto rates = ParsePrefillRates(*text, o.prefill_rates);
    if (!rates.ok()) Die("--prefill-rates: " + rates.status().ToString(), 1);
    mo.cuda.prefill_rates = *rates;
  }
  mo.cuda.log_prefill_plans = o.log_prefill_plans;
  mo.cuda.prefill_prefetch = o.prefill_prefetch;
  mo.cuda.debug_fault_after = o.debug_cuda_fault_after;
  mo.cuda.kv_blocks = o.kv_blocks;
  auto resolved = ResolveBackend(o.backend, o.cuda_device);
  if (!resolved.ok()) Die(resolved.status().ToString(), 1);
  mo.backend = *resolved;
  std::fprintf(stderr, "hmoe-gpu-worker: backend %s (--backend %s)\n", mo.backend.c_str(),
               o.backend.c_str());
  // The tokenizer first: a calibration run needs it.
  std::unique_ptr<Tokenizer> tokenizer;
  std::string no_tokenizer = "this model has no tokenizer (tokenizer.json or tiktoken.model)";
  // tokenizer.json, else tiktoken.model + tokenizer_config.json.
  const std::string dir_prefix = (std::filesystem::path(o.model_dir) / "").string();
  if (auto t = Tokenizer::FromModelDir(o.model_dir); absl::IsNotFound(t.status())) {
    // No tokenizer: token ids only.
  } else if (absl::IsUnimplemented(t.status())) {
    // A tokenizer this build cannot run: serve token ids, say why once.
    // Clients are told why without the server's path (the log has it).
    no_tokenizer = absl::StrCat("the model's tokenizer is not supported here (",
                                absl::StrReplaceAll(t.status().message(), {{dir_prefix, ""}}), ")");
    std::fprintf(stderr,
                 "hmoe-gpu-worker: warning: the model's tokenizer is not supported here (%s): "
                 "text prompts, Tokenize and Detokenize are refused; prompt_ids work\n",
                 std::string(t.status().message()).c_str());
  } else if (!t.ok()) {
    Die(t.status().ToString(), 1);
  } else {
    tokenizer = std::move(*t);
  }
  // The chat template (for the HTTP API's chat completions): parsed now, so
  // a construct our interpreter does not support stops the worker here.
  std::optional<ChatTemplate> chat;
  std::string no_chat =
      "the model directory has no chat template (tokenizer_config.json's "
      "chat_template or chat_template.jinja; --chat-template FILE)";
  if (!o.chat_template.empty()) {
    auto text = ReadSmallFile(o.chat_template, kMaxChatTemplateBytes);
    if (!text.ok()) Die("--chat-template: " + text.status().ToString(), 1);
    auto from_dir = ChatTemplate::FromModelDir(o.model_dir);  // for its special tokens
    std::optional<std::string> bos, eos;
    if (from_dir.ok()) {
      const auto& st = from_dir->special_tokens();
      if (auto it = st.find("bos_token"); it != st.end()) bos = it->second;
      if (auto it = st.find("eos_token"); it != st.end()) eos = it->second;
    }
    auto t = ChatTemplate::FromString(*text, bos, eos);
    if (!t.ok())
      Die(absl::StrCat("--chat-template ", o.chat_template, ": ", t.status().message()), 1);
    chat = std::move(*t);
  } else if (auto t = ChatTemplate::FromModelDir(o.model_dir); t.ok()) {
    chat = std::move(*t);
  } else if (!absl::IsNotFound(t.status())) {
    Die("chat template: " + t.status().ToString(), 1);
  }
  const bool hot =
      !o.hot_experts.empty() || !o.calibrate.empty() || o.hot_experts_gb > 0 || o.hot_experts_fill;
  if (o.prefill_experts != PrefillExperts::kCpu && mo.backend != "cuda")
    Die("--prefill-experts " + std::string(PrefillExpertsName(o.prefill_experts)) +
        " needs the cuda backend (backend " + mo.backend + ")");
  if (hot) {
    if (!o.hot_experts.empty() && !o.calibrate.empty())
      Die("--hot-experts and --calibrate are exclusive (a stats file, or a calibration run)");
    if (o.hot_experts_fill && o.hot_experts_gb > 0)
      Die("--hot-experts-fill and --hot-experts-gb are exclusive (a budget, or what is left)");
    if (!(o.hot_experts_gb > 0) && !o.hot_experts_fill)
      Die(absl::StrCat(o.calibrate.empty() ? "--hot-experts" : "--calibrate",
                       " and --hot-experts-gb go together"));
    if (o.hot_experts.empty() && o.calibrate.empty())
      Die(absl::StrCat(o.hot_experts_fill ? "--hot-experts-fill" : "--hot-experts-gb",
                       " needs --hot-experts STATS or --calibrate PROMPTS"));
  }
  auto need_cuda = [&](const char* flag) {
    if (mo.backend != "cuda")
      Die(absl::StrCat(flag, " needs the cuda backend (backend ", mo.backend, ")"));
  };
  PlacementOptions plo;
  int group = 64;
  WeightFormat hot_fmt = WeightFormat::kBf16;
  if (hot || o.prefill_experts != PrefillExperts::kCpu) {
    // The shards' format (the same quantized weights on both sides), or the
    // in-process experts' bf16.
    auto fmt = ParseWeightFormat(pool ? pool->model().weight_format : "bf16", &group);
    if (!fmt.ok()) Die("expert service: " + fmt.status().ToString(), 1);
    hot_fmt = *fmt;
    plo.budget_bytes = static_cast<int64_t>(o.hot_experts_gb * (1ull << 30));
    plo.expert_bytes = HotExpertBytes(*config, hot_fmt, group);
  }
  if (o.hot_experts_fill) {
    // The budget: what the memory plan leaves (gpu_worker/memory_plan.h), under
    // --gpu-mem-gb or, as the backend bounds it, the free memory less 1 GiB.
    need_cuda("--hot-experts-fill");
    int64_t limit = static_cast<int64_t>(o.gpu_mem_gb * (1ull << 30));
    if (limit == 0) {
      auto dm = QueryDeviceMemory(o.cuda_device);
      if (!dm.ok()) Die("--hot-experts-fill: " + dm.status().ToString(), 1);
      limit = dm->total_bytes - dm->used_bytes - (int64_t{1} << 30);
    }
    PlanRequest req = PlanRequestFor(*config, mo, limit, CudaBackendFormats());
    req.fill_hot_experts = true;
    req.hot_format = hot_fmt;
    req.hot_group = group;
    auto plan = PlanGpuMemory(*config, req);
    if (!plan.ok()) Die("--hot-experts-fill: " + plan.status().ToString(), 1);
    if (!plan->fits) Die("--hot-experts-fill: GPU memory plan: " + plan->message, 1);
    plo.budget_bytes = plan->hot_experts_fit * plo.expert_bytes;
    std::fprintf(stderr, "hmoe-gpu-worker: the GPU memory plan leaves room for %lld hot experts\n",
                 static_cast<long long>(plan->hot_experts_fit));
  }
  absl::StatusOr<Placement> placed = Placement{};
  std::string placed_from = o.hot_experts;
  if (!o.hot_experts.empty()) {
    placed = PlanPlacementFromFile(o.hot_experts, *config, plo);
    if (!placed.ok()) Die("--hot-experts: " + placed.status().ToString(), 1);
    need_cuda("--hot-experts");
  } else if (!o.calibrate.empty()) {
    need_cuda("--calibrate");
    if (!tokenizer) Die("--calibrate: " + no_tokenizer + " (the prompts are text)", 1);
    // The calibration model prefills on the service only (no pinned copy
    // of the experts for hybrid prefill: it is thrown away).
    ModelOptions cmo = mo;
    cmo.cuda.prefill_experts = PrefillExperts::kCpu;
    auto calib_model = Model::Load(o.model_dir, cmo, remote.get());
    if (!calib_model.ok()) Die(calib_model.status().ToString(), 1);
    auto calib = CalibrateRouting(**calib_model, *tokenizer, o.calibrate);
    if (!calib.ok()) Die("--calibrate: " + calib.status().ToString(), 1);
    calib_model->reset();
    std::fprintf(stderr,
                 "hmoe-gpu-worker: calibrated on %lld prompts (%lld tokens, %lld cut to the "
                 "context) from %s in %.1f s\n",
                 static_cast<long long>(calib->prompts), static_cast<long long>(calib->tokens),
                 static_cast<long long>(calib->truncated), o.calibrate.c_str(), calib->seconds);
    placed = PlanPlacement(calib->routing, *config, plo);
    if (!placed.ok()) Die("--calibrate: " + placed.status().ToString(), 1);
    placed_from = "the calibration run";
  }
  if (hot || o.prefill_experts != PrefillExperts::kCpu) {
    // The GPU's copies of experts (hot, streamed) in the shards' format.
    mo.cuda.hot_format = hot_fmt;
    mo.cuda.hot_group = group;
  }
  if (hot) {
    std::fprintf(stderr, "hmoe-gpu-worker: hot experts from %s: %s (%s, %.2f GiB budget)\n",
                 placed_from.c_str(), placed->Describe().c_str(),
                 WeightFormatName(hot_fmt, group).c_str(),
                 static_cast<double>(plo.budget_bytes) / static_cast<double>(1ull << 30));
    mo.cuda.hot_experts = std::make_shared<Placement>(std::move(*placed));
  }
  const LoadProgressOptions load_progress = ProcessLoadProgressOptions(
      "",
      [](const std::string& line) { std::fprintf(stderr, "hmoe-gpu-worker: %s\n", line.c_str()); });
  mo.load_progress = &load_progress;
  auto model = Model::Load(o.model_dir, mo, remote.get());
  if (!model.ok()) Die(model.status().ToString(), 1);
  EngineOptions eo;
  eo.max_batch = o.max_batch;
  eo.max_queue = o.max_queue;
  eo.prefill_chunk = o.prefill_chunk;
  eo.kv_blocks = o.kv_blocks;
  eo.metrics = &metrics;
  auto engine = Engine::Create(model->get(), tokenizer.get(), eo);
  if (!engine.ok()) Die(engine.status().ToString(), 1);
  // The cuda backend's device memory on /metrics (NaN when the driver
  // cannot be asked); declared after `metrics`, so destroyed before it.
  std::vector<std::unique_ptr<CallbackGauge>> gpu_memory;
  if (mo.backend == "cuda") {
    const int device = o.cuda_device;
    auto device_memory = [device](bool used) {
      auto m = QueryDeviceMemory(device);
      if (!m.ok()) return std::numeric_limits<double>::quiet_NaN();
      return static_cast<double>(used ? m->used_bytes : m->total_bytes);
    };
    for (const bool used : {true, false}) {
      auto g = metrics.AddCallbackGauge(
          used ? "hmoe_gpu_memory_used_bytes" : "hmoe_gpu_memory_total_bytes",
          used ? "Memory in use on the worker's GPU, every process's together (the driver's "
                 "total - free)."
               : "The worker's GPU's memory in all.",
          {}, {}, [device_memory, used] { return device_memory(used); });
      if (!g.ok()) Die(g.status().ToString(), 1);
      gpu_memory.push_back(std::move(*g));
    }
  }

  GenerationService service(engine->get(), model->get(), tokenizer.get(), o.model_dir, backend,
                            auth_tokens);
  service.set_no_tokenizer_reason(no_tokenizer);
  service.set_chat_template(chat ? &*chat : nullptr, no_chat);
  grpc::EnableDefaultHealthCheckService(true);
  grpc::ServerBuilder builder;
  int port = 0;
  builder.AddListeningPort(o.listen, *server_credentials, &port);
  // gRPC sets SO_REUSEPORT by default: a second worker on a taken port would
  // start and split the clients with the first.
  builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
  builder.RegisterService(&service);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  if (!server || port == 0) Die("cannot listen on " + o.listen, 1);
  auto* health = server->GetHealthCheckService();
  // The service's own name answers as the server does (later
  // SetServingStatus(bool) calls set every registered name).
  health->SetServingStatus(hmoe::api::v1::Generation::service_full_name(), true);
  health->SetServingStatus(true);
  std::fprintf(stderr,
               "hmoe-gpu-worker: serving on port %d (%s, %lld-token context, experts: %s)\n", port,
               (*model)->config().model_type.c_str(),
               static_cast<long long>((*model)->options().max_seq_len), backend.c_str());
  auto write_port = [](const std::string& path, int p, const char* flag) {
    const std::string tmp = path + ".tmp";
    FILE* f = std::fopen(tmp.c_str(), "w");
    if (f == nullptr || std::fprintf(f, "%d\n", p) < 0 || std::fclose(f) != 0 ||
        std::rename(tmp.c_str(), path.c_str()) != 0)
      Die(absl::StrCat("cannot write ", flag, " ", path), 1);
  };
  // The expert shards' health as the monitor below last saw it (new HTTP
  // requests get 503 while a shard is down).
  std::atomic<bool> experts_up{true};
  std::unique_ptr<HttpService> http;
  if (!o.http_listen.empty()) {
    HttpServiceOptions ho;
    ho.listen = o.http_listen;
    // Clients see the directory's name ("/models/ds3/" -> "ds3"), never its path.
    std::filesystem::path dir = std::filesystem::path(o.model_dir).lexically_normal();
    if (!dir.has_filename() && dir.has_parent_path()) dir = dir.parent_path();
    ho.model_name = o.served_model_name.empty() ? dir.filename().string() : o.served_model_name;
    if (ho.model_name.empty()) ho.model_name = "model";
    const std::string model_name = ho.model_name;
    ho.auth_tokens = auth_tokens;
    ho.tls = o.tls;
    ho.max_connections = o.http_max_connections;
    ho.header_timeout = absl::Seconds(o.http_header_timeout_seconds);
    ho.ready = [&experts_up] { return experts_up.load(); };
    ho.metrics = [&metrics] { return metrics.RenderPrometheus(); };
    if (chat) {
      ChatRenderOptions with_tools;
      with_tools.tools = nlohmann::ordered_json::array();
      const std::string source = chat->source(with_tools);
      ho.tool_syntax = o.tool_call_syntax.value_or(ToolSyntaxOfTemplate(source));
      ho.split_reasoning = o.reasoning_content.value_or(absl::StrContains(source, "</think>"));
    }
    const ToolSyntax tool_syntax = ho.tool_syntax;
    const bool split_reasoning = ho.split_reasoning;
    auto h = HttpService::Start(engine->get(), tokenizer.get(), chat ? &*chat : nullptr, no_chat,
                                std::move(ho));
    if (!h.ok()) Die(h.status().ToString(), 1);
    http = std::move(*h);
    if (!IsLoopbackListenAddress(o.http_listen) && !auth_tokens->enabled()) {
      std::fprintf(stderr,
                   "hmoe-gpu-worker: warning: the HTTP API on %s is reachable beyond this host "
                   "and no --auth-token-file is set: anyone who reaches it can use it\n",
                   o.http_listen.c_str());
    }
    std::fprintf(
        stderr,
        "hmoe-gpu-worker: OpenAI-compatible HTTP API on port %d (%s, model \"%s\", chat %s)\n",
        http->port(), o.tls.enabled() ? "https" : "http", model_name.c_str(),
        chat ? absl::StrCat("on, tool calls ", ToolSyntaxName(tool_syntax), ", reasoning_content ",
                            split_reasoning ? "on" : "off")
                   .c_str()
             : "off: no chat template");
    if (!o.http_port_file.empty()) write_port(o.http_port_file, http->port(), "--http-port-file");
  }
  if (!o.port_file.empty()) write_port(o.port_file, port, "--port-file");
  NotifySystemd("READY=1");

  // Health follows the expert shards and the model: a backend that failed
  // for good (Model::health, e.g. a CUDA error) is NOT_SERVING from then on,
  // said once on stderr, so a load balancer or systemd's watchdog can act.
  // `health_mu` orders the monitor's update against the shutdown's
  // NOT_SERVING, which must be the last word.
  std::atomic<bool> stopping{false};
  std::atomic<bool> model_failed_exit{false};
  std::mutex health_mu;
  std::thread monitor([&] {
    bool model_failed = false;
    while (!stopping.load()) {
      bool all_up = true;
      if (pool) {
        for (const Health& h : pool->CheckHealth(absl::Milliseconds(500)))
          all_up &= h == Health::kServing;
        // A control plane that answers over a data path that does not.
        for (bool broken : pool->DataPathsBroken()) all_up &= !broken;
      }
      if (const absl::Status mh = (*model)->health(); !mh.ok()) {
        all_up = false;
        if (!model_failed) {
          std::fprintf(stderr,
                       "hmoe-gpu-worker: the %s backend failed for good, NOT_SERVING: %s; "
                       "exiting non-zero for a restart\n",
                       (*model)->options().backend.c_str(), mh.ToString().c_str());
          // The requests in flight fail with it; stop as on SIGTERM, then exit 3
          // (systemd's Restart=on-failure brings up a fresh process and GPU context).
          model_failed_exit = true;
          ::kill(::getpid(), SIGTERM);
        }
        model_failed = true;
      }
      experts_up = all_up;
      if (pool || model_failed) {
        std::lock_guard<std::mutex> lock(health_mu);
        if (!stopping.load()) health->SetServingStatus(all_up);
      }
      for (int i = 0; i < 10 && !stopping.load(); ++i)
        std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
  });

  int sig = 0;
  while (sigwait(&sigs, &sig) != 0 || sig == SIGHUP) {
    if (sig == SIGHUP) {
      ReloadTokens("--auth-token-file", o.auth_token_file, auth_tokens.get());
      ReloadTokens("--expert-auth-token-file", o.expert_auth_token_file, expert_auth_tokens.get());
      if (o.tls.enabled() || o.expert_tls.enabled())
        std::fprintf(stderr, "hmoe-gpu-worker: SIGHUP: TLS files are read at start only\n");
    }
  }
  std::fprintf(stderr, "hmoe-gpu-worker: signal %d, draining for up to %ds\n", sig,
               o.drain_seconds);
  NotifySystemd("STOPPING=1");
  {
    std::lock_guard<std::mutex> lock(health_mu);
    stopping = true;
    health->SetServingStatus(false);
  }
  if (http) http->SetDraining();
  (*engine)->Shutdown(absl::Seconds(o.drain_seconds));  // new requests refused, in-flight finish
  server->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(2));
  if (http) http->Stop();
  monitor.join();
  if (!o.routing_stats_out.empty()) {
    const std::string tmp = o.routing_stats_out + ".tmp";
    const std::string table = RoutingTableJson((*model)->routing_stats());
    FILE* f = std::fopen(tmp.c_str(), "w");
    if (f == nullptr || std::fputs(table.c_str(), f) < 0 || std::fclose(f) != 0 ||
        std::rename(tmp.c_str(), o.routing_stats_out.c_str()) != 0) {
      std::fprintf(stderr, "hmoe-gpu-worker: cannot write --routing-stats-out %s\n",
                   o.routing_stats_out.c_str());
    } else {
      std::fprintf(stderr, "hmoe-gpu-worker: routing statistics written to %s\n",
                   o.routing_stats_out.c_str());
    }
  }
  std::fprintf(stderr, "hmoe-gpu-worker: stopped\n");
  return model_failed_exit.load() ? 3 : 0;
}

}  // namespace
}  // namespace hmoe

int main(int argc, char** argv) { return hmoe::Run(argc, argv); }
