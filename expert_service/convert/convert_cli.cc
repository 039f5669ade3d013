#include "expert_service/convert/convert_cli.h"

#include <pthread.h>
#include <signal.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <thread>

#include "absl/status/status.h"
#include "absl/strings/numbers.h"
#include "expert_service/convert/packed_file.h"

namespace hmoe {

int ConvertCommand(const std::vector<std::string>& args) {
  ConvertOptions o;
  std::vector<std::string> pos;
  for (size_t i = 0; i < args.size(); ++i) {
    std::string a = args[i], v;
    const auto eq = a.find('=');
    if (a.rfind("--", 0) == 0) {
      if (eq != std::string::npos) {
        v = a.substr(eq + 1);
        a = a.substr(0, eq);
      } else if (i + 1 < args.size()) {
        v = args[++i];
      } else {
        std::fprintf(stderr, "hmoe convert: %s needs a value\n", a.c_str());
        return 2;
      }
    }
    if (a == "--format") {
      o.format = v;
    } else if (a == "--shards") {
      if (!absl::SimpleAtoi(v, &o.shards) || o.shards < 1) {
        std::fprintf(stderr, "hmoe convert: --shards must be a positive integer\n");
        return 2;
      }
    } else if (a == "--threads") {
      if (!absl::SimpleAtoi(v, &o.threads) || o.threads < 0 || o.threads > 1024) {
        std::fprintf(stderr, "hmoe convert: --threads must be an integer in [0, 1024]\n");
        return 2;
      }
    } else if (a == "--split") {
      if (v != "tp" && v != "ep") {
        std::fprintf(stderr, "hmoe convert: --split must be tp or ep\n");
        return 2;
      }
      o.split = v == "ep" ? SplitMode::kEp : SplitMode::kTp;
    } else if (a.rfind("--", 0) == 0) {
      std::fprintf(stderr, "hmoe convert: unknown flag %s\n", a.c_str());
      return 2;
    } else {
      pos.push_back(a);
    }
  }
  if (pos.size() != 2) {
    std::fprintf(stderr,
                 "usage: hmoe convert MODEL_DIR OUT --format int4g64|int8|bf16 "
                 "[--shards n --split tp|ep] [--threads n]\n");
    return 2;
  }
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
