// hmoe-expert-service: serves one shard of a model's routed experts: flags
// (AddFlags; --help and docs/FLAGS.md say them, with the signals and health)
// and wiring. The shard is expert_shard.h; the gRPC services, data planes,
// CPU binding and port file it is served through are front_ends.h.
//
//   hmoe-expert-service --check-ucx-address   (internal: the UCX address
//       checker child the service starts itself; see UcxServerOptions)
#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "common/auth_token.h"
#include "common/dtype.h"
#include "common/flags.h"
#include "common/load_progress.h"
#include "common/runtime/numa.h"
#include "common/status.h"
#include "common/systemd_notify.h"
#include "common/transport/fragments.h"
#include "common/transport/grpc_auth.h"
#include "common/transport/grpc_tls.h"
#include "expert_service/kernels/isa.h"
#include "expert_service/server/expert_shard.h"
#include "expert_service/server/front_ends.h"
#include "expert_service/server/grpc_services.h"
#include "grpcpp/grpcpp.h"
#include "proto/expert.grpc.pb.h"

namespace hmoe {
namespace {
namespace pb = ::hmoe::expert::v1;

struct ServiceOptions {
  ShardOptions shard;
  std::string listen = "127.0.0.1:50061";
  std::string port_file;  // written (port number) once READY
  int numa_node = -1;
  std::string cores;  // e.g. "0-7,16"
  bool shm = true;
  bool ucx = true;
  DrainOptions drain;
  std::string instance;
  int port_offset = 0;  // added to the --listen port (systemd: the NUMA node)
  std::string auth_token_file;
  // Read from auth_token_file (off without it); SIGHUP re-reads it.
  std::shared_ptr<AuthTokens> auth_tokens = std::make_shared<AuthTokens>();
  int64_t max_peers = 64;
  int64_t ucx_fragment_bytes = static_cast<int64_t>(kDefaultUcxFragmentBytes);
  int64_t ucx_lanes = kDefaultUcxLanes;
  TlsServerFiles tls;
  std::shared_ptr<grpc::ServerCredentials> credentials;  // from `tls`

  // The checks across fields and those the flags' ranges do not make (each
  // flag's own range is FlagSet's).
  absl::Status Validate() const {
    RETURN_IF_ERROR(shard.Validate());
    if (numa_node >= 0 && !cores.empty()) {
      return absl::InvalidArgumentError("--numa-node and --cores are exclusive");
    }
    if (listen.empty()) return absl::InvalidArgumentError("--listen: empty");
    return Annotate(CheckFragmentBytes(static_cast<uint64_t>(ucx_fragment_bytes)),
                    "--ucx-fragment-bytes");
  }
  std::string ToString() const {
    return absl::StrCat(
        shard.ToString(), " listen=", listen, " numa_node=", numa_node,
        " cores=", cores.empty() ? "all" : cores, " shm=", shm, " ucx=", ucx,
        " drain_timeout_s=", drain.timeout_s, " drain_quiet_s=", drain.quiet_s,
        " instance=", instance.empty() ? "-" : instance,
        " auth=", auth_token_file.empty() ? "none" : "token file " + auth_token_file,
        " max_peers=", max_peers, " ucx_fragment_bytes=", ucx_fragment_bytes,
        " ucx_lanes=", ucx_lanes,
        " tls=", tls.enabled() ? (tls.client_ca_file.empty() ? "on" : "mutual") : "off");
  }
};

// The flags, bound to `o`'s fields.
void AddFlags(FlagSet& fs, ServiceOptions* o) {
  ShardOptions& sh = o->shard;
  fs.Group("model");
  fs.String("model-dir", &sh.model_dir, "DIR", "Hugging Face checkpoint (safetensors)");
  fs.String("packed-dir", &sh.packed_dir, "DIR",
            "`hmoe convert` output (then --model-dir gives config.json)");
  fs.String("synthetic", &sh.synthetic, "SPEC",
            "random weights: hidden=H,intermediate=I,experts=E,top_k=K,layers=L"
            "[,first_dense=D][,seed=S][,alias=N] (alias=N: every layer's experts share N "
            "distinct weight sets, held once: a fit check, not a speed figure)");
  fs.Custom(
      "shard", "i/n", "serve shard i of n",
      [&sh](std::string_view v) -> absl::Status {
        std::vector<std::string> p = absl::StrSplit(std::string(v), '/');
        if (p.size() != 2 || !absl::SimpleAtoi(p[0], &sh.shard_index) ||
            !absl::SimpleAtoi(p[1], &sh.num_shards))
          return absl::InvalidArgumentError(absl::StrCat("\"", std::string(v), "\" is not i/n"));
        return absl::OkStatus();
      },
      "0/1");
  fs.Enum<SplitMode>("split", &sh.split, {{"tp", SplitMode::kTp}, {"ep", SplitMode::kEp}},
                     "how the experts are split over the shards");
  fs.Custom(
      "format", WeightFormatChoices(),
      "weight format served; with --packed-dir the files' must be in it (default: theirs)",
      [&sh](std::string_view v) -> absl::Status {
        ASSIGN_OR_RETURN(sh.format, ParseWeightFormat(std::string(v), &sh.group));
        sh.format_explicit = true;
        return absl::OkStatus();
      },
      "bf16");
  fs.Bool("memory-check", &sh.check_memory,
          "refuse to load packed weights that exceed the node's, the machine's or the cgroup's "
          "memory");
  fs.Group("compute");
  fs.Int("max-tokens", &sh.max_tokens, 1, 1 << 20, "tokens one call may carry");
  fs.Int("threads", &sh.threads, 0, 4096, "compute threads; 0: one per core the process may use");
  fs.Enum<std::optional<Isa>>("isa", &sh.isa,
                              {{"amx", Isa::kAmx},
                               {"avx512", Isa::kAvx512},
                               {"avx2", Isa::kAvx2},
                               {"scalar", Isa::kScalar}},
                              "the kernels' instruction set at most (default: $HMOE_ISA, else the "
                              "best this CPU has)");
  fs.Int("numa-node", &o->numa_node, -1, 1023,
         "run on and take memory from this NUMA node (-1: unbound)");
  fs.String("cores", &o->cores, "LIST", "run on these cores (\"0-7,16\"); not with --numa-node");
  fs.Bool("null-compute", &sh.null_compute,
          "benchmarks: validate each call, answer zeros, skip the experts");
  fs.Group("serving");
  fs.String("listen", &o->listen, "HOST:PORT", "the gRPC port (UCX and shm are set up through it)");
  fs.Int("port-offset", &o->port_offset, 0, 65535,
         "added to the --listen port (systemd units: the NUMA node)");
  fs.String("port-file", &o->port_file, "PATH", "gets the bound port once the service is READY");
  fs.Bool("shm", &o->shm, "the shared-memory data plane");
  fs.Bool("ucx", &o->ucx, "the UCX data plane");
  fs.Int("ucx-fragment-bytes", &o->ucx_fragment_bytes, 0, std::numeric_limits<int64_t>::max(),
         "UCX answers over N bytes go in N-byte fragments; 0: one message, else >= 65536");
  fs.Int("ucx-lanes", &o->ucx_lanes, 1, kMaxUcxLanes,
         "UCX workers, each with its thread and connection; a client uses min(its, these)");
  fs.Int("max-peers", &o->max_peers, 1, 65536,
         "gRPC MoE streams, shm segments and UCX clients at once, each; one more is refused "
         "RESOURCE_EXHAUSTED");
  fs.Double(
      "drain-timeout-s", &o->drain.timeout_s, "on SIGTERM, how long in-flight work may finish",
      [](double x) { return x >= 0 && x <= 3600; }, "a number of seconds in [0, 3600]");
  fs.Double(
      "drain-quiet-s", &o->drain.quiet_s,
      "on SIGTERM, calls are served until none came for this long (the workers' generations "
      "in flight finish), within --drain-timeout-s",
      [](double x) { return x >= 0 && x <= 3600; }, "a number of seconds in [0, 3600]");
  fs.String("instance", &o->instance, "NAME", "a name for the logs and Info");
  fs.Group(
      "security (--tls-*: the gRPC port speaks TLS, the worker's --expert-tls-ca-file "
      "verifies it; UCX and shared memory are not encrypted)");
  fs.String("auth-token-file", &o->auth_token_file, "PATH",
            "every control and data call must carry a token in this file (one per line, so a "
            "token can rotate; the worker's --expert-auth-token-file), else UNAUTHENTICATED; "
            "health stays open. SIGHUP re-reads it for calls and set-ups that start afterwards "
            "(shm and UCX sessions already set up stay). Without it, anyone who reaches "
            "--listen may call the service");
  AddTlsFlags(fs, &o->tls);
}

// What the flags imply, checked across them: the port offset applied, the
// kernel tuning (HMOE_* environment), the token file and TLS files read.
absl::Status Finish(ServiceOptions& o) {
  if (o.port_offset != 0) {
    const auto colon = o.listen.rfind(':');
    int port = 0;
    if (colon == std::string::npos || !absl::SimpleAtoi(o.listen.substr(colon + 1), &port) ||
        port <= 0 || port + o.port_offset > 65535 || o.port_offset < 0) {
      return absl::InvalidArgumentError(absl::StrCat("--port-offset: ", o.port_offset,
                                                     " cannot be added to --listen=", o.listen));
    }
    o.listen = absl::StrCat(o.listen.substr(0, colon + 1), port + o.port_offset);
  }
  ASSIGN_OR_RETURN(o.shard.tuning, KernelTuningFromEnv());
  RETURN_IF_ERROR(ThreadCountsFromEnv(&o.shard.threads, &o.shard.virtual_nodes));
  RETURN_IF_ERROR(o.Validate());
  if (!o.auth_token_file.empty()) {
    ASSIGN_OR_RETURN(o.auth_tokens, AuthTokens::FromFile(o.auth_token_file));
  }
  ASSIGN_OR_RETURN(o.credentials, ServerCredentialsFrom(o.tls));
  return absl::OkStatus();
}

void Log(const std::string& s) {
  std::fprintf(stderr, "hmoe-expert-service[%d]: %s\n", ::getpid(), s.c_str());
  std::fflush(stderr);
}

// SIGHUP: the token file is read again; a file that fails its checks
// leaves the tokens in force (and the service serving), saying why.
void ReloadCredentials(const ServiceOptions& o) {
  if (o.auth_token_file.empty()) {
    Log("SIGHUP: no --auth-token-file, nothing to reload");
    return;
  }
  Log("SIGHUP: " + o.auth_tokens->ReloadForLog(o.auth_token_file));
  if (o.tls.enabled()) Log("SIGHUP: TLS certificates are read at start only");
}

constexpr char kAbout[] =
    "Serves one shard of a model's routed experts over gRPC, shared memory and UCX, on\n"
    "the CPU kernels with one thread pool over the cores the process is bound to\n"
    "(--numa-node / --cores, bound before the weights load, so memory and workers stay\n"
    "there). Control plane and data plane on gRPC (proto/expert.proto) plus\n"
    "grpc.health.v1; the shared-memory and UCX data planes are set up through the\n"
    "control plane. READY=1 goes to systemd once the weights are loaded and every front\n"
    "end listens. SIGTERM / SIGINT: health goes NOT_SERVING, calls are served until\n"
    "none came for --drain-quiet-s (the generations in flight finish), then new calls\n"
    "are refused and in-flight ones finish (all within --drain-timeout-s), exit 0;\n"
    "during loading the load stops at the next expert and the process exits 0 without\n"
    "READY. SIGHUP (systemctl reload) re-reads --auth-token-file. Exit 2 on a bad flag\n"
    "or binding, 1 when the start fails.\n";

int Main(int argc, char** argv) {
  // The UCX address checker (UcxServerOptions::address_checker): this binary
  // re-run by the service itself, its socket at kCheckerFd.
  if (argc == 2 && std::strcmp(argv[1], "--check-ucx-address") == 0)
    return UcxAddressCheckMain(kCheckerFd, kCheckerFd);
  // Signals go to the sigwait thread only: block them before any thread starts.
  sigset_t sigs;
  sigemptyset(&sigs);
  sigaddset(&sigs, SIGTERM);
  sigaddset(&sigs, SIGINT);
  sigaddset(&sigs, SIGHUP);
  pthread_sigmask(SIG_BLOCK, &sigs, nullptr);
  signal(SIGPIPE, SIG_IGN);

  ServiceOptions opts;
  // The environment's defaults, read here once: HMOE_ISA (the --isa default).
  const char* env_isa = std::getenv("HMOE_ISA");
  if (auto cap = ParseIsaCap(env_isa != nullptr ? env_isa : "", "HMOE_ISA"); cap.ok()) {
    opts.shard.isa = *cap;
  } else {
    std::fprintf(stderr, "hmoe-expert-service: %s\n", std::string(cap.status().message()).c_str());
    return 2;
  }
  FlagSet flags("hmoe-expert-service",
                "(--model-dir DIR [--packed-dir DIR] | --synthetic SPEC) [flags]", kAbout);
  AddFlags(flags, &opts);
  if (auto exit = flags.ParseOrExit(argc, argv, [&] { return Finish(opts); })) return *exit;
  opts.shard.log = [](const std::string& line) { Log(line); };
  const ServiceOptions& o = opts;
  ServiceState state;
  state.instance = o.instance;
  state.shm_enabled = o.shm;
  state.ucx_enabled = o.ucx;
  state.max_peers = o.max_peers;
  state.auth_tokens = o.auth_tokens;  // shared: SIGHUP's reload reaches the handlers
  Log("options: " + o.ToString());
  if (o.ucx) PinUcxToListenDevice(o.listen, Log);  // before any thread starts
  if (!o.auth_tokens->enabled() && !IsLoopbackListenAddress(o.listen)) {
    Log("warning: listening on " + o.listen +
        " without --auth-token-file: any host that reaches it can use this service");
  }
  if (absl::Status st = BindProcess(o.numa_node, o.cores); !st.ok()) {
    Log(std::string(st.message()));
    return 2;
  }
  const PortFile port_file(o.port_file);
  if (absl::Status st = port_file.Prepare(); !st.ok()) {
    Log(std::string(st.message()));
    return 2;
  }

  absl::StatusOr<std::unique_ptr<GrpcFrontEnd>> grpc_fe =
      StartGrpcFrontEnd(o.listen, o.credentials, o.shard.max_tokens, &state);
  if (!grpc_fe.ok()) {
    Log(std::string(grpc_fe.status().message()));
    return 1;
  }
  grpc::Server* server = (*grpc_fe)->server.get();
  const int port = (*grpc_fe)->port;
  auto* health = server->GetHealthCheckService();

  std::atomic<bool> stop{false};
  std::atomic<bool> load_failed{false};  // the thread is being woken to exit, not to drain
  std::thread signals([&] {
    int sig = 0;
    while (sigwait(&sigs, &sig) != 0 || sig == SIGHUP) {
      if (sig == SIGHUP) ReloadCredentials(o);
    }
    if (!load_failed.load()) Log(absl::StrCat("signal ", sig, ": stopping"));
    stop.store(true);
    state.progress.cancel.store(true);  // a load still running stops at the next expert
  });

  const auto t0 = std::chrono::steady_clock::now();
  LoadProgressReporter load_progress(ProcessLoadProgressOptions("loading experts", Log));
  state.progress.bytes = &load_progress;
  auto shard = ExpertShard::Load(o.shard, &state.progress);
  state.progress.bytes = nullptr;
  load_progress.Finish();
  state.load_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  if (stop.load() && (shard.ok() || absl::IsCancelled(shard.status()))) {
    // Asked to stop while loading (the load stopped at its next expert, or
    // had just ended): nothing was served, nothing to drain; do not announce
    // READY (or turn health SERVING) on the way out.
    Log(absl::StrCat("stop requested while loading", shard.ok() ? "" : ": load cancelled",
                     " after ", state.load_seconds, " s; exiting without serving"));
    server->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(1));
    signals.join();
    return 0;
  }
  // The start failed before anything was served: FAILED, never SERVING.
  auto fail_start = [&](const char* what, const std::string& why) {
    state.load_error = why;
    state.load_state = pb::LoadStatus::FAILED;
    Log(absl::StrCat(what, " failed: ", state.load_error));
    NotifySystemd(absl::StrCat("STATUS=", what, " failed: ", state.load_error));
    server->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(1));
    // Joined, not detached: it references this frame. SIGTERM is blocked
    // here, so sent to that thread it is what its sigwait returns.
    load_failed.store(true);
    pthread_kill(signals.native_handle(), SIGTERM);
    signals.join();
    return 1;
  };
  if (!shard.ok()) return fail_start("load", std::string(shard.status().message()));
  DataPlanes planes =
      StartDataPlanes(shard->get(),
                      {.shm = o.shm,
                       .ucx = o.ucx,
                       .max_peers = o.max_peers,
                       .ucx_fragment_bytes = static_cast<uint64_t>(o.ucx_fragment_bytes),
                       .ucx_lanes = static_cast<int>(o.ucx_lanes)},
                      &state, Log);
  if (const std::string w = GrpcShapeWarning((*shard)->info()); !w.empty()) Log(w);
  // A launcher waits for the port file: written before the service turns
  // SERVING, renamed into place after (PortFile).
  if (absl::Status st = port_file.WriteTemp(port); !st.ok())
    return fail_start("start", std::string(st.message()));
  state.shard.store(shard->get());
  state.load_state = pb::LoadStatus::READY;
  health->SetServingStatus(true);
  Log(ReadyLine(**shard, port, state.load_seconds));
  int exit_code = 0;
  if (absl::Status st = port_file.Publish(); !st.ok()) {
    // Rare (the .tmp beside it was written): drain what may have started.
    Log(absl::StrCat(st.message(), "; stopping"));
    port_file.RemoveTemp();
    exit_code = 1;
    load_failed.store(true);  // no "signal" line: the thread is woken to stop
    pthread_kill(signals.native_handle(), SIGTERM);
  }
  if (exit_code == 0) NotifySystemd(absl::StrCat("READY=1\nSTATUS=serving on port ", port));

  while (!stop.load()) std::this_thread::sleep_for(std::chrono::milliseconds(20));
  signals.join();

  NotifySystemd("STOPPING=1");
  StopServing(**shard, o.drain, **grpc_fe, planes, &state);
  if (o.shard.tuning.moe.profile) Log("RunMoe phases: " + (*shard)->TakeProfile().ToString());
  Log("stopped");
  return exit_code;
}

}  // namespace
}  // namespace hmoe

int main(int argc, char** argv) { return hmoe::Main(argc, argv); }
