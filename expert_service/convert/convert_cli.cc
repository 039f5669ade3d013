#include "expert_service/convert/convert_cli.h"

#include <pthread.h>
#include <signal.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <thread>

#include "absl/status/status.h"
#include "common/flags.h"
#include "expert_service/convert/packed_file.h"

namespace hmoe {

int ConvertCommand(const std::vector<std::string>& args) {
  ConvertOptions o;
  FlagSet fs("hmoe convert", "MODEL_DIR OUT [--format FORMAT] [flags]",
             "Packed expert files for hmoe-expert-service --packed-dir.");
  fs.String("format", &o.format,
            "int4g32|int4g64|int4g128|int8|bf16|mxfp4|int4bf16g32|int4bf16g64|int4bf16g128|fp8|"
            "mxfp8",
            "the files' weight format; default: the checkpoint's own (mxfp4, int4bf16g32 for "
            "compressed-tensors int4, fp8, mxfp8: kept as stored), else int4g64");
  fs.Int("shards", &o.shards, 1, 1 << 16, "files for this many expert service shards");
  fs.Enum<SplitMode>("split", &o.split, {{"tp", SplitMode::kTp}, {"ep", SplitMode::kEp}},
                     "how the experts are split over the shards");
  fs.Int("threads", &o.threads, 0, 1024,
         "experts quantized at once; 0: the CPUs this process may use (<= 64)");
  std::vector<std::string> pos;
  if (auto exit = fs.ParseOrExit(args, &pos, [&]() -> absl::Status {
        if (pos.size() != 2) return absl::InvalidArgumentError("MODEL_DIR and OUT are required");
        return absl::OkStatus();
      }))
    return *exit;
  const auto t0 = std::chrono::steady_clock::now();
  o.progress = [t0](int layer, int done, int total) {
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    std::fprintf(stderr, "hmoe convert: layer %d written (%d of %d MoE layers) after %.1f s\n",
                 layer, done, total, s);
  };
  // SIGINT / SIGTERM / SIGHUP stop the conversion at the next batch of
  // experts, its .tmp files removed (hundreds of GB for a 671B model), not
  // killed mid-write. Blocked here (threads started below inherit it) and
  // taken by a waiting thread; the caller's mask is restored after.
  sigset_t sigs, old_mask;
  sigemptyset(&sigs);
  for (int sig : {SIGINT, SIGTERM, SIGHUP}) {
    // One the caller ignores (nohup, a script's background job) stays ignored.
    struct sigaction now {};
    if (sigaction(sig, nullptr, &now) == 0 && now.sa_handler == SIG_IGN) continue;
    sigaddset(&sigs, sig);
  }
  pthread_sigmask(SIG_BLOCK, &sigs, &old_mask);
  std::atomic<int> signalled{0};
  std::atomic<bool> done{false};
  std::thread waiter([&] {
    const timespec tick{0, 100 * 1000 * 1000};
    while (!done.load()) {
      const int sig = sigtimedwait(&sigs, nullptr, &tick);
      if (sig > 0) {
        signalled.store(sig);
        return;
      }
    }
  });
  o.cancelled = [&signalled] { return signalled.load() != 0; };
  if (o.format.empty()) {
    // Resolved here to be printed; ConvertModel reports a config it cannot read.
    const absl::StatusOr<ModelConfig> cfg = LoadModelConfig(pos[0]);
    const absl::StatusOr<std::string> native =
        cfg.ok() ? DefaultConvertFormat(*cfg, pos[0]) : absl::StatusOr<std::string>(cfg.status());
    if (native.ok()) o.format = *native;
  }
  absl::Status st = ConvertModel(pos[0], pos[1], o);
  done.store(true);
  waiter.join();
  pthread_sigmask(SIG_SETMASK, &old_mask, nullptr);
  if (signalled.load() != 0 && absl::IsCancelled(st)) {
    std::fprintf(stderr, "hmoe convert: signal %d: stopped, no files written\n", signalled.load());
    return 128 + signalled.load();
  }
  if (!st.ok()) {
    std::fprintf(stderr, "hmoe convert: %s\n", st.ToString().c_str());
    return 1;
  }
  std::printf("hmoe convert: wrote %d %s shard file(s) (%s split) to %s in %.1f s\n", o.shards,
              o.format.c_str(), SplitModeName(o.split), pos[1].c_str(),
              std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  return 0;
}

}  // namespace hmoe
