// hmoe-bench-moe: the MoE operator against the machine's measured limits and
// against oneDNN, at real model shapes, cache-cold. Flags: AddFlags below
// (`--help`; docs/FLAGS.md).
//
// Kernel tuning (expert_service/kernels/tuning.h) comes from the HMOE_AMX_*,
// HMOE_FEW_*, HMOE_MOE_* and HMOE_PROFILE environment variables. --tune
// compares settings in one process on the same weights: every row is measured
// --reps times per setting, settings interleaved, and tagged cfg=NAME; a
// setting is the defaults plus the knobs it names (and HMOE_PROFILE from the
// environment).
//
// Per row: microseconds per call, weight GB/s over the distinct expert bytes
// the call touched, TFLOP/s, % of the measured read bandwidth (the best of
// bench/dram_probe.h's access patterns, on the pool's threads), % of the
// measured AMX peak (bf16 peak for bf16/int4, int8 peak for int8), and the
// speedup over oneDNN (int4 is compared with oneDNN int8; oneDNN runs on as
// many OpenMP threads as our pool has). Enough layers are allocated that the
// weights cycled through exceed 4x the last-level cache, and each layer's
// routing sweeps through its experts (see Router) so no call finds its
// weights in cache.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iterator>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <numeric>
#include <optional>
#include <random>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "bench/dram_probe.h"
#include "common/dtype.h"
#include "common/experts/weight_format.h"
#include "common/flags.h"
#include "common/runtime/numa.h"
#include "common/runtime/thread_pool.h"
#include "expert_service/kernels/gemm.h"
#include "expert_service/kernels/isa.h"
#include "expert_service/kernels/moe.h"
#include "expert_service/kernels/onednn_moe.h"
#include "expert_service/kernels/tuning.h"

namespace hmoe {
namespace {

struct Preset {
  const char* name;
  int64_t H, I, E;
  int K;
};
const Preset kPresets[] = {{"ds-v3", 7168, 2048, 256, 8},     {"qwen3-30b", 2048, 768, 128, 8},
                           {"ds-v2-lite", 2048, 1408, 64, 6}, {"mixtral", 4096, 14336, 8, 2},
                           {"kimi-k2", 7168, 2048, 384, 8},   {"glm-4.5", 5120, 1536, 160, 8}};

// A preset by name, or a custom shape spelled HxIxExK (e.g. 7168x2048x4x4:
// ds-v3's expert shape, 4 experts, top-4; with --layers 1 its weights stay in
// the LLC, which separates the GEMM from DRAM streaming).
std::optional<Preset> FindPreset(const std::string& name) {
  for (const auto& p : kPresets)
    if (name == p.name) return p;
  long long h = 0, i = 0, e = 0;
  int k = 0;
  char tail = 0;
  if (std::sscanf(name.c_str(), "%lldx%lldx%lldx%d%c", &h, &i, &e, &k, &tail) == 4 && h > 0 &&
      i > 0 && e > 0 && k > 0 && k <= e)
    return Preset{"custom", h, i, e, k};
  return std::nullopt;
}

double Now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

std::vector<std::string> List(const std::string& s, char sep = ',') {
  std::vector<std::string> out;
  for (auto p : absl::StrSplit(s, sep, absl::SkipEmpty())) out.emplace_back(p);
  return out;
}

// ---- machine limits ----------------------------------------------------------------
// The register-only tile loop on every thread: best of several timed reps
// of ~50 ms each after an untimed one (the first rep after idle ran 10-20%
// low on the GPU machine: clock ramp, sleeping workers).
double MeasureAmxTops(ThreadPool& pool, bool int8) {
  const int64_t iters = 400000;  // x 8 tile products
  pool.Run([&](const Worker&) { kern::AmxPeakLoop(iters, int8); });
  double best = 0;
  for (int rep = 0; rep < 5; ++rep) {
    const double t0 = Now();
    pool.Run([&](const Worker&) { kern::AmxPeakLoop(iters, int8); });
    const double ops =
        static_cast<double>(pool.num_threads()) * iters * 8 * 16 * 16 * (int8 ? 64 : 32) * 2;
    best = std::max(best, ops / (Now() - t0) / 1e12);
  }
  return best;
}

// ---- routing ------------------------------------------------------------------------
// One router per layer (each keeps its own sweep, so the layers cycled
// through never alias with the sweep period: every call finds its experts
// cold). Top-k ids are distinct within a token; weights uniform in
// [0.05, 1); deterministic per seed.
//   uniform: a balanced sweep through a fixed random permutation of the
//     experts (each gets T*k/E tokens, +-1).
//   random: each token's k distinct experts drawn uniformly, independently
//     per token and per call (loads vary around T*k/E as a router's do).
//   zipf: expert ranks drawn with P(rank r) ~ 1/r^s (--zipf-s), ranks mapped
//     to experts by a permutation drawn afresh every call: the skew is within
//     a call (a few experts take many tokens); which experts are hot moves,
//     so no expert stays cache-resident across calls by construction.
enum class Routing { kSweep, kRandom, kZipf };
const char* RoutingName(Routing r) {
  return r == Routing::kSweep ? "uniform" : r == Routing::kRandom ? "random" : "zipf";
}

struct Router {
  int64_t E;
  int K;
  Routing mode;
  std::mt19937_64 rng;
  std::vector<int32_t> perm;
  int64_t cursor = 0;
  std::vector<double> cdf;
  Router(int64_t e, int k, Routing m, double zipf_s, uint64_t seed)
      : E(e), K(k), mode(m), rng(seed) {
    perm.resize(static_cast<size_t>(E));
    std::iota(perm.begin(), perm.end(), 0);
    std::shuffle(perm.begin(), perm.end(), rng);
    double sum = 0;
    for (int64_t i = 0; i < E; ++i)
      cdf.push_back(sum += std::pow(static_cast<double>(i + 1), -zipf_s));
    for (auto& c : cdf) c /= sum;
  }
  void Route(int64_t T, std::vector<int32_t>& ids, std::vector<float>& w) {
    ids.resize(static_cast<size_t>(T * K));
    w.resize(static_cast<size_t>(T * K));
    std::uniform_real_distribution<double> u(0, 1);
    std::uniform_int_distribution<int32_t> any(0, static_cast<int32_t>(E - 1));
    if (mode == Routing::kZipf) std::shuffle(perm.begin(), perm.end(), rng);
    for (int64_t t = 0; t < T; ++t) {
      for (int j = 0; j < K; ++j) {
        int32_t e;
        for (;;) {
          if (mode == Routing::kZipf) {
            const auto rank = std::lower_bound(cdf.begin(), cdf.end(), u(rng)) - cdf.begin();
            e = perm[static_cast<size_t>(std::min<int64_t>(rank, E - 1))];
          } else if (mode == Routing::kRandom) {
            e = any(rng);
          } else {
            e = perm[static_cast<size_t>(cursor++ % E)];
          }
          bool dup = false;
          for (int jj = 0; jj < j; ++jj) dup |= ids[static_cast<size_t>(t * K + jj)] == e;
          if (!dup) break;
        }
        ids[static_cast<size_t>(t * K + j)] = e;
        w[static_cast<size_t>(t * K + j)] = static_cast<float>(0.05 + 0.95 * u(rng));
      }
    }
  }
};

// Routers for `layers` layers: layer l's has seed 12345 + l, so our rows and
// oneDNN's see the same routing wherever their layer counts agree.
std::vector<Router> LayerRouters(int64_t layers, int64_t E, int K, Routing mode, double zipf_s) {
  std::vector<Router> r;
  for (int64_t l = 0; l < layers; ++l)
    r.emplace_back(E, K, mode, zipf_s, 12345 + static_cast<uint64_t>(l));
  return r;
}

struct Args {
  std::vector<std::string> presets{"ds-v3", "qwen3-30b"};
  std::vector<int64_t> Ts{1, 2, 4, 8, 32, 128, 512, 2048, 8192};
  std::vector<std::string> formats{"int4", "int8", "bf16"};
  std::vector<std::string> isas;
  Routing routing = Routing::kSweep;
  double zipf_s = 1.0;
  int layers = 0;
  int threads = 0;
  int vnuma = 0;
  int group = 128;
  int many = RunOptions{}.many_threshold;
  int many_int4 = RunOptions{}.many_threshold_int4;
  double min_time = 0.25;
  bool onednn = true;
  bool kernel_probe = false;
  bool row_limits = false;
  bool pin_caller = true;
  std::string json;
  struct Tune {
    std::string name;  // empty: untagged (no --tune)
    KernelTuning tuning;
    std::optional<int> many, many_int4;  // MANY=N / MANY_INT4=N: --many / --many-int4
  };
  std::vector<Tune> tunes;  // empty: one untagged measurement per row, tuned by the environment
  int reps = 1;
};

// "A:K=V,K=V;B:K=V" -> settings; false (with a message) on a malformed list,
// an unknown knob or a bad value.
bool ParseTunes(const std::string& s, std::vector<Args::Tune>& out) {
  const std::vector<std::string>& known = KernelTuningVariables();
  for (const auto& item : List(s, ';')) {
    const size_t colon = item.find(':');
    if (colon == std::string::npos || colon == 0) return false;
    std::vector<std::pair<std::string, std::string>> env;
    std::optional<int> many, many_int4;
    for (const auto& kv : List(item.substr(colon + 1), ',')) {
      const size_t eq = kv.find('=');
      if (eq == std::string::npos) return false;
      const std::string key = kv.substr(0, eq);
      if (key == "MANY" || key == "MANY_INT4") {
        int n = 0;
        if (!absl::SimpleAtoi(kv.substr(eq + 1), &n) || n < 0 || n > (1 << 20)) {
          std::fprintf(stderr, "--tune: %s wants an integer in [0, %d]\n", key.c_str(), 1 << 20);
          return false;
        }
        (key == "MANY" ? many : many_int4) = n;
        continue;
      }
      if (std::find(known.begin(), known.end(), key) == known.end()) {
        std::fprintf(stderr, "--tune: unknown knob %s\n", key.c_str());
        return false;
      }
      env.emplace_back(key, kv.substr(eq + 1));
    }
    auto tuning = KernelTuningFromEnv([&](const char* name) -> const char* {
      for (auto it = env.rbegin(); it != env.rend(); ++it)  // the last one named wins
        if (it->first == name) return it->second.c_str();
      return std::string_view(name) == "HMOE_PROFILE" ? std::getenv(name) : nullptr;
    });
    if (!tuning.ok()) {
      std::fprintf(stderr, "--tune %s: %s\n", item.c_str(), tuning.status().ToString().c_str());
      return false;
    }
    out.push_back({item.substr(0, colon), *tuning, many, many_int4});
  }
  return !out.empty();
}

// --kernel-probe: the AMX "many" GEMM alone, every thread running its own
// copy, in rounds; each round times the register-only tile loop for the same
// number of tile products, then the GEMM once per --tune setting (interleaved,
// same buffers). Each sample is one thread's GEMM time against the faster of
// its own peak-loop times just before and after the round, so a shared host
// that slows the AMX units for a while (other tenants) moves both alike.
// Shapes: 32 rows x 2 panels x K 256 (all in L1), 256 x 16 x 1024 (A and B in
// L2) and 256 x 16 x the preset's hidden size, weights cycling through 4
// copies per thread (B from L3 / DRAM). Separates the micro-kernel's
// efficiency from the memory system's and compares the AMX knobs cheaply.
void KernelProbe(ThreadPool& pool, int64_t hidden, const std::vector<Args::Tune>& settings,
                 double min_time) {
  struct Shape {
    int rows, panels;
    int64_t K;
    int copies;
  };
  const int nt = pool.num_threads();
  for (bool i8 : {false, true})
    for (Shape sh : {Shape{32, 2, 256, 1}, Shape{256, 16, 1024, 1}, Shape{256, 16, hidden, 4}}) {
      const int rows = sh.rows, panels = sh.panels;
      const PackedGeom g =
          MakeGeom(i8 ? WeightFormat::kInt8 : WeightFormat::kBf16, 0, panels * 16, sh.K);
      const int64_t lda = g.kp * (i8 ? 1 : 2);
      // Scratch: at least the kernels' minimum, and 1 KiB per 16 rows x 1
      // panel (room the removed contiguous partial-C tiles took; kept so
      // probe rows compare with earlier runs).
      const int64_t scratch_bytes =
          std::max<int64_t>(kern::kGemmScratchBytes, int64_t{(rows + 31) / 32 * 32} * panels * 64);
      std::vector<NumaBuffer> w(static_cast<size_t>(nt * sh.copies)), A(nt), C(nt), S(nt);
      std::vector<float> scales(static_cast<size_t>(rows), 0.01f);
      pool.Run([&](const Worker& wk) {
        const int t = wk.global;
        for (int c = 0; c < sh.copies; ++c)
          w[static_cast<size_t>(t * sh.copies + c)] =
              *NumaBuffer::Allocate(static_cast<size_t>(g.bytes()), wk.node);
        A[t] = *NumaBuffer::Allocate(static_cast<size_t>(rows * lda), wk.node);
        C[t] = *NumaBuffer::Allocate(static_cast<size_t>(rows * panels * 16 * 4), wk.node);
        S[t] = *NumaBuffer::Allocate(static_cast<size_t>(scratch_bytes), wk.node);
        uint64_t x = 0x9e3779b97f4a7c15ull * static_cast<uint64_t>(t + 1);
        auto fill = [&](uint8_t* p, int64_t n) {
          for (int64_t i = 0; i < n; i += 2) {
            x ^= x << 13, x ^= x >> 7, x ^= x << 17;
            const uint16_t v =
                i8 ? static_cast<uint16_t>(x & 0x0707) : F32ToBf16(((x >> 40) % 200) * 1e-4f);
            std::memcpy(p + i, &v, 2);
          }
        };
        for (int c = 0; c < sh.copies; ++c) {
          uint8_t* p = w[static_cast<size_t>(t * sh.copies + c)].data();
          fill(p, g.bytes());
          if (i8)
            for (int64_t j = 0; j < g.nblocks; ++j)
              for (int col = 0; col < 16; ++col)
                reinterpret_cast<float*>(p + j * g.panel_bytes + g.i8_scale_offset())[col] = 1.0f;
        }
        fill(A[t].data(), rows * lda);
      });
      const kern::GemmFn fn = i8 ? kern::AmxKernels().i8 : kern::AmxKernels().bf16;
      const int64_t products = (rows + 15) / 16 * panels * (g.kp / (i8 ? 64 : 32));
      const int64_t iters = std::max<int64_t>(1, products / 8);
      const size_t ns = settings.size();
      // peak[r][t], gemm[r][s][t]: seconds.
      std::vector<std::vector<double>> peak;
      std::vector<std::vector<std::vector<double>>> gemm;
      std::vector<int> cursor(static_cast<size_t>(nt), 0);
      auto time_peak = [&] {
        std::vector<double> v(static_cast<size_t>(nt));
        pool.Run([&](const Worker& wk) {
          const double t0 = Now();
          kern::AmxPeakLoop(iters, i8);
          v[static_cast<size_t>(wk.global)] = Now() - t0;
        });
        peak.push_back(std::move(v));
      };
      const double t_start = Now();
      time_peak();
      while (Now() - t_start < min_time * static_cast<double>(ns) || peak.size() < 12) {
        std::vector<std::vector<double>> round(ns, std::vector<double>(static_cast<size_t>(nt)));
        for (size_t s = 0; s < ns; ++s) {
          pool.Run([&](const Worker& wk) {
            const int t = wk.global;
            int& cur = cursor[static_cast<size_t>(t)];
            kern::GemmArgs ga;
            ga.g = &g;
            ga.w = w[static_cast<size_t>(t * sh.copies + cur)].data();
            cur = (cur + 1) % sh.copies;
            ga.next_g = &g;
            ga.next_w = w[static_cast<size_t>(t * sh.copies + cur)].data();
            ga.nb0 = ga.next_nb0 = 0;
            ga.nb1 = ga.next_nb1 = panels;
            ga.a = A[t].data();
            ga.lda = lda;
            ga.a_tiled = true;
            ga.m = rows;
            ga.a_scale = scales.data();
            ga.c = reinterpret_cast<float*>(C[t].data());
            ga.ldc = panels * 16;
            ga.scratch = S[t].data();
            ga.scratch_bytes = scratch_bytes;
            ga.tuning = &settings[s].tuning;
            const double t0 = Now();
            fn(ga);
            round[s][static_cast<size_t>(t)] = Now() - t0;
          });
        }
        gemm.push_back(std::move(round));
        time_peak();
      }
      for (size_t s = 0; s < ns; ++s) {
        std::vector<double> ratio;
        for (size_t r = 0; r < gemm.size(); ++r)
          for (int t = 0; t < nt; ++t) {
            const auto ti = static_cast<size_t>(t);
            ratio.push_back(std::min(peak[r][ti], peak[r + 1][ti]) / gemm[r][s][ti]);
          }
        std::sort(ratio.begin(), ratio.end());
        auto q = [&](double f) {
          return 100.0 * ratio[static_cast<size_t>(f * static_cast<double>(ratio.size() - 1))];
        };
        std::printf(
            "# kernel-probe %s %3dx%2dx%-5lld %-8s %% of the adjacent register-only loop: median "
            "%5.1f  p10 %5.1f  p90 %5.1f  (%zu samples)\n",
            i8 ? "int8" : "bf16", rows, panels, static_cast<long long>(sh.K),
            settings[s].name.c_str(), q(0.5), q(0.1), q(0.9), ratio.size());
      }
      std::fflush(stdout);
    }
}

// The flags, bound to `a`'s fields.
void AddFlags(FlagSet& fs, Args* a) {
  auto names = [](std::vector<std::string>* out) {
    return [out](std::string_view v) {
      *out = List(std::string(v));
      return absl::OkStatus();
    };
  };
  fs.Custom("preset", "LIST",
            "ds-v3, qwen3-30b, ds-v2-lite, mixtral, kimi-k2, glm-4.5, or a shape HxIxExK",
            names(&a->presets), absl::StrJoin(a->presets, ","));
  fs.Custom(
      "T", "LIST", "tokens per call, each >= 1",
      [a](std::string_view v) {
        a->Ts.clear();
        for (const auto& t : List(std::string(v))) {
          int64_t n = 0;
          if (!absl::SimpleAtoi(t, &n) || n < 1 || n > (int64_t{1} << 20))
            return absl::InvalidArgumentError(
                absl::StrCat("'", t, "' is not a token count in [1, 1048576]"));
          a->Ts.push_back(n);
        }
        return absl::OkStatus();
      },
      absl::StrJoin(a->Ts, ","));
  fs.Custom("format", "LIST",
            "bf16, int8, int4 (with --group, or int4g32 / int4g64 / int4g128), and the native "
            "formats mxfp4, int4bf16 (compressed-tensors int4, bf16 scales; int4bf16g64 ...), "
            "fp8 (128x128 blocks), mxfp8",
            names(&a->formats), absl::StrJoin(a->formats, ","));
  fs.Custom("isa", "LIST",
            "amx, avx512, avx2, scalar (default: the best this CPU has; one above it is skipped "
            "with a note)",
            names(&a->isas));
  fs.Enum<Routing>("routing", &a->routing,
                   {{RoutingName(Routing::kSweep), Routing::kSweep},
                    {RoutingName(Routing::kRandom), Routing::kRandom},
                    {RoutingName(Routing::kZipf), Routing::kZipf}},
                   "uniform (a balanced sweep: every expert T*k/E tokens), random (each token's k "
                   "experts drawn at random: a real router's imbalance without skew) or zipf");
  fs.Double(
      "zipf-s", &a->zipf_s, "Zipf exponent, P(rank r) ~ 1/r^S",
      [](double x) { return x > 0 && x <= 4; }, "a number in (0, 4]");
  fs.Int("layers", &a->layers, 0, 4096,
         "layers to cycle through (0: enough that the weights exceed 4x the last-level cache)");
  fs.Int("threads", &a->threads, 0, 4096, "pool threads (0: one per core)");
  fs.Int("vnuma", &a->vnuma, 0, 256,
         "split the cores into N virtual NUMA nodes (tensor-parallel split of every expert; 0 "
         "or 1: one node); N > 1 also runs every row on the same cores as one node (rows tagged "
         "nodes=N / nodes=1, interleaved), so the split's cost reads off adjacent rows");
  fs.Enum<int>("group", &a->group, {{"32", 32}, {"64", 64}, {"128", 128}}, "int4 group");
  fs.Int("many", &a->many, 0, 1 << 20,
         "experts with more than N tokens in a call take the AMX (\"many\") kernels, int8 / "
         "bf16 (default: RunOptions')");
  fs.Int("many-int4", &a->many_int4, 0, 1 << 20, "the same for int4 (default: RunOptions')");
  fs.Double(
      "min-time", &a->min_time, "seconds of timed calls per row",
      [](double x) { return x > 0 && x <= 3600; }, "seconds in (0, 3600]");
  fs.Int("reps", &a->reps, 1, 1000, "measurements per row and --tune setting");
  fs.Custom(
      "tune", "SETTINGS",
      "\"A:HMOE_AMX_KC_BYTES=512,HMOE_AMX_STREAM=0;B:\" compares kernel settings in one "
      "process, interleaved; MANY=N and MANY_INT4=N in a setting override --many / "
      "--many-int4",
      [a](std::string_view v) {
        if (ParseTunes(std::string(v), a->tunes)) return absl::OkStatus();
        return absl::InvalidArgumentError("wants NAME:HMOE_AMX_K=V,HMOE_MOE_K=V,...;NAME:...");
      });
  fs.Bool("row-limits", &a->row_limits,
          "re-measure the AMX peak after every AMX row with T >= 128");
  fs.Bool("pin-caller", &a->pin_caller,
          "the pool moves the calling thread (worker 0) to its first core during our calls "
          "(off: the OS places it)");
  fs.Bool("kernel-probe", &a->kernel_probe, "the AMX GEMM alone vs the register-only tile loop");
  fs.Bool("onednn", &a->onednn, "the oneDNN baseline");
  fs.String("json", &a->json, "FILE", "also write the rows as JSON");
}

int Main(int argc, char** argv) {
  Args a;
  FlagSet fs("hmoe-bench-moe", "[flags]",
             "The MoE operator against the machine's measured limits and against oneDNN, at\n"
             "real model shapes, cache-cold. Kernel tuning comes from the HMOE_AMX_*, HMOE_FEW_*,\n"
             "HMOE_MOE_* and HMOE_PROFILE environment variables (--tune compares settings).");
  AddFlags(fs, &a);
  if (std::optional<int> exit = fs.ParseOrExit(argc, argv)) return *exit;
  auto bad = [](const std::string& msg) {
    std::fprintf(stderr, "hmoe-bench-moe: %s (--help for usage)\n", msg.c_str());
    return 2;
  };
  // Names checked before the probes spend any time.
  if (a.Ts.empty()) return bad("--T lists no token counts");
  if (a.presets.empty()) return bad("--preset lists no presets");
  for (const auto& p : a.presets)
    if (!FindPreset(p))
      return bad(absl::StrCat("unknown preset '", p,
                              "' (ds-v3, qwen3-30b, ds-v2-lite, mixtral, kimi-k2, glm-4.5 or "
                              "HxIxExK)"));
  if (a.formats.empty()) return bad("--format lists no formats");
  for (const auto& fm : a.formats)
    if (auto f = ParseFormatFlag(fm, a.group); !f.ok())
      return bad(std::string(f.status().message()));
  for (const auto& is : a.isas)
    if (!ParseIsa(is))
      return bad(absl::StrCat("unknown ISA '", is, "' (amx, avx512, avx2, scalar)"));
  if (a.isas.empty()) a.isas = {std::string(IsaName(DetectedIsa()))};
  // HMOE_ISA caps every --isa (read once here; the kernels read no environment).
  const char* env_isa = std::getenv("HMOE_ISA");
  const absl::StatusOr<std::optional<Isa>> isa_cap =
      ParseIsaCap(env_isa != nullptr ? env_isa : "", "HMOE_ISA");
  if (!isa_cap.ok()) return bad(std::string(isa_cap.status().message()));
  const absl::StatusOr<KernelTuning> env_tuning_or = KernelTuningFromEnv();
  if (!env_tuning_or.ok()) {
    std::fprintf(stderr, "%s\n", env_tuning_or.status().ToString().c_str());
    return 2;
  }
  const KernelTuning env_tuning = *env_tuning_or;
  if (const std::string t = KernelTuningToString(env_tuning); !t.empty()) {
    // --tune settings take HMOE_PROFILE from the environment and nothing else.
    KernelTuning ignored = env_tuning;
    ignored.moe.profile = false;
    if (a.tunes.empty())
      std::printf("# kernel tuning from the environment: %s\n", t.c_str());
    else if (const std::string i = KernelTuningToString(ignored); !i.empty())
      std::printf(
          "# kernel tuning from the environment (%s) ignored: each --tune setting "
          "starts from the defaults\n",
          i.c_str());
  }
  ThreadPoolOptions po;
  po.max_threads = a.threads;
  po.virtual_nodes = a.vnuma > 0 ? a.vnuma : 1;
  po.pin_caller = a.pin_caller;
  if (const absl::Status env = ThreadCountsFromEnv(&po.max_threads, &po.virtual_nodes); !env.ok()) {
    std::fprintf(stderr, "pool: %s\n", env.ToString().c_str());  // HMOE_THREADS, with --threads 0
    return 1;
  }
  auto pool_or = ThreadPool::Create(po);
  if (!pool_or.ok()) {
    std::fprintf(stderr, "pool: %s\n", pool_or.status().ToString().c_str());
    return 1;
  }
  ThreadPool& pool = **pool_or;
  // --vnuma N > 1: the same cores as one node too, so every row also runs
  // unsplit in this process and the split's cost reads off adjacent rows.
  std::unique_ptr<ThreadPool> pool1;
  if (pool.num_nodes() > 1) {
    ThreadPoolOptions p1 = po;
    p1.virtual_nodes = 1;
    auto p1_or = ThreadPool::Create(p1);
    if (!p1_or.ok()) {
      std::fprintf(stderr, "one-node pool: %s\n", p1_or.status().ToString().c_str());
      return 1;
    }
    pool1 = std::move(*p1_or);
  }
  OnednnMoe::SetThreads(pool.num_threads());  // the baseline gets as many threads as we do
  const int64_t llc = LlcBytes();
  const int64_t min_touched = 4 * llc;
  nlohmann::json J;
  J["threads"] = pool.num_threads();
  J["virtual_nodes"] = pool.num_nodes();
  J["llc_bytes"] = llc;
  J["detected_isa"] = std::string(IsaName(DetectedIsa()));
  double bw = 0, amx_bf16 = 0, amx_i8 = 0;
  {
    // The best of the probe's access patterns (bench/dram_probe.h).
    absl::StatusOr<DramProbe> probe = MeasureDramRead(pool, DefaultProbeBytes());
    if (!probe.ok()) {
      std::fprintf(stderr, "read probe: %s\n", probe.status().ToString().c_str());
      return 1;
    }
    bw = probe->best_gbs;
    nlohmann::json patterns = nlohmann::json::object();
    for (const DramPattern& d : probe->patterns) patterns[d.name] = d.gbs;
    J["read_patterns_gbs"] = patterns;
    J["read_best_pattern"] = probe->best;
    std::printf("# read probe: %s\n", DramProbeSummary(*probe).c_str());
  }
  if (DetectedIsa() >= Isa::kAmx) {
    amx_bf16 = MeasureAmxTops(pool, false);
    amx_i8 = MeasureAmxTops(pool, true);
  }
  double best_bf16 = amx_bf16, best_i8 = amx_i8;  // raised by --row-limits re-measurements
  struct AmxRow {
    std::string label;
    double tf;
    bool i8;
  };
  std::vector<AmxRow> amx_rows;  // --row-limits: AMX rows with T >= 128, for the closing summary
  J["read_gbs"] = bw;
  J["amx_bf16_tflops"] = amx_bf16;
  J["amx_int8_tops"] = amx_i8;
  std::printf(
      "# threads %d, nodes %d, LLC %.0f MB, ISA %s | read %.1f GB/s | AMX bf16 %.1f TFLOP/s, int8 "
      "%.1f TOP/s\n",
      pool.num_threads(), pool.num_nodes(), llc / 1048576.0,
      std::string(IsaName(DetectedIsa())).c_str(), bw, amx_bf16, amx_i8);
  std::printf(
      "# routing %s; AMX (\"many\") kernels for experts with > %d tokens (int4: > %d) unless a "
      "--tune setting says MANY / MANY_INT4\n",
      RoutingName(a.routing), a.many, a.many_int4);
  if (a.kernel_probe) {
    if (DetectedIsa() < Isa::kAmx) {
      std::fprintf(stderr, "--kernel-probe needs AMX\n");
      return 1;
    }
    for (const auto& pname : a.presets)
      if (auto p = FindPreset(pname))
        KernelProbe(pool, p->H,
                    a.tunes.empty() ? std::vector<Args::Tune>{{"D", env_tuning}} : a.tunes,
                    a.min_time);
    return 0;
  }
  std::printf("%-10s %-5s %-6s %5s %11s %9s %8s %7s %7s %11s %8s\n", "preset", "fmt", "isa", "T",
              "us", "GB/s", "TFLOP/s", "%BW", "%AMX", "onednn_us", "speedup");
  std::fflush(stdout);
  J["rows"] = nlohmann::json::array();
  auto flush_json = [&] {
    if (a.json.empty()) return;
    std::ofstream(a.json) << J.dump(1) << "\n";
  };
  flush_json();
  const int64_t Tmax = *std::max_element(a.Ts.begin(), a.Ts.end());

  for (const auto& pname : a.presets) {
    const Preset preset = *FindPreset(pname);  // names checked after parsing
    const Preset* P = &preset;
    // bf16 x for the largest T
    std::vector<uint16_t> x(static_cast<size_t>(Tmax * P->H));
    {
      std::mt19937 rng(7);
      std::normal_distribution<float> nd(0.0f, 1.0f);
      for (auto& v : x) v = F32ToBf16(nd(rng));
    }
    std::vector<float> out(static_cast<size_t>(Tmax * P->H));
    std::map<std::string, std::map<int64_t, double>> dnn_us;  // by oneDNN format
    for (const auto& fname : a.formats) {
      const auto fg = *ParseFormatFlag(fname, a.group);  // checked after parsing
      const WeightFormat* fmt = &fg.first;
      PackOptions o;
      o.format = fg.first;
      o.group = fg.second;
      // One layer's packed bytes decide how many layers make > 4x LLC.
      const PackedGeom gu = MakeGeom(*fmt, o.group, 2 * RoundUp(P->I, 16), P->H),
                       dn = MakeGeom(*fmt, o.group, P->H, P->I);
      const int64_t layer_bytes = (gu.bytes() + dn.bytes()) * P->E;
      const int L = a.layers > 0 ? a.layers
                                 : static_cast<int>(std::max<int64_t>(
                                       1, (min_touched + layer_bytes - 1) / layer_bytes));
      // The pools rows run on: the main one, and with --vnuma the one-node
      // twin (same weights, packed unsplit).
      struct Variant {
        ThreadPool* pool;
        std::string tag;  // "nodes=N" when comparing, else empty
        std::vector<PackedMoeLayer> layers;
        std::unique_ptr<MoeWorkspace> ws;
        // Weight bytes per expert as packed (all node parts, with their int8
        // scale / int4 group trailers): what a touched expert streams.
        int64_t expert_bytes = 0;
      };
      std::vector<Variant> variants;
      variants.push_back({&pool, pool1 ? absl::StrCat("nodes=", pool.num_nodes()) : "", {}, {}, 0});
      if (pool1) variants.push_back({pool1.get(), "nodes=1", {}, {}, 0});
      const double tp0 = Now();
      for (Variant& v : variants) {
        for (int l = 0; l < L; ++l) {
          auto lay = PackRandom(P->H, P->I, P->E, o, *v.pool, 1000 + static_cast<uint64_t>(l));
          if (!lay.ok()) {
            std::fprintf(stderr, "pack: %s\n", lay.status().ToString().c_str());
            return 1;
          }
          v.layers.push_back(std::move(*lay));
        }
        v.expert_bytes = v.layers[0].expert_bytes();
        auto ws_or = MoeWorkspace::Create(v.layers[0], Tmax, P->K, *v.pool);
        if (!ws_or.ok()) {
          std::fprintf(stderr, "workspace: %s\n", ws_or.status().ToString().c_str());
          return 1;
        }
        v.ws = std::move(*ws_or);
      }
      std::fprintf(stderr, "# %s %s: %d layer(s) x %.2f GB packed in %.1f s\n", pname.c_str(),
                   fname.c_str(), L, layer_bytes / 1e9, Now() - tp0);
      // oneDNN in the comparable format (int4 -> int8), built once per preset+format.
      const std::string dfmt = *fmt == WeightFormat::kBf16 ? "bf16" : "int8";
      const bool need_dnn = a.onednn && !dnn_us.count(dfmt);
      std::vector<std::unique_ptr<OnednnMoe>> dnns;
      int64_t dnn_expert_bytes = 3 * P->H * P->I * (dfmt == "bf16" ? 2 : 1);
      if (need_dnn) {
        const int64_t dl = a.layers > 0
                               ? a.layers
                               : std::max<int64_t>(1, (min_touched + dnn_expert_bytes * P->E - 1) /
                                                          (dnn_expert_bytes * P->E));
        const double t0 = Now();
        for (int l = 0; l < dl; ++l) {
          auto d = OnednnMoe::Create(
              *ParseWeightFormat(dfmt), P->H, P->I, P->E, 0,
              [&](int64_t e, void* gu_w, float* gus, void* dn_w, float* dns) {
                const int64_t n1 = 2 * P->I * P->H * (dfmt == "bf16" ? 2 : 1), n2 = n1 / 2;
                const int64_t chunk = 1 << 20;
                auto fill = [&](uint8_t* p, int64_t n) {
                  pool.ParallelFor((n + chunk - 1) / chunk, [&](int64_t c, const Worker&) {
                    uint64_t s =
                        0x9e3779b97f4a7c15ull * static_cast<uint64_t>(e * 131 + c + l * 7919 + 1);
                    for (int64_t i = c * chunk; i < std::min(n, (c + 1) * chunk); i += 2) {
                      s ^= s << 13;
                      s ^= s >> 7;
                      s ^= s << 17;
                      if (dfmt == "bf16") {
                        const float v = (static_cast<float>(s >> 40) / 16777216.0f - 0.5f) * 0.05f;
                        const uint16_t b = F32ToBf16(v);
                        std::memcpy(p + i, &b, 2);
                      } else {
                        p[i] = static_cast<uint8_t>(static_cast<int>(s % 255) - 127);
                        if (i + 1 < n)
                          p[i + 1] = static_cast<uint8_t>(static_cast<int>((s >> 8) % 255) - 127);
                      }
                    }
                  });
                };
                fill(static_cast<uint8_t*>(gu_w), n1);
                fill(static_cast<uint8_t*>(dn_w), n2);
                for (int64_t i = 0; i < 2 * P->I; ++i) gus[i] = 1e-3f;
                for (int64_t i = 0; i < P->H; ++i) dns[i] = 1e-3f;
              });
          if (!d.ok()) {
            std::fprintf(stderr, "onednn: %s\n", d.status().ToString().c_str());
            return 1;
          }
          dnns.push_back(std::move(*d));
        }
        std::fprintf(stderr, "# oneDNN %s: %lld layer(s) built in %.1f s\n", dfmt.c_str(),
                     static_cast<long long>(dl), Now() - t0);
      }
      for (int64_t T : a.Ts) {
        // oneDNN row first (same routing stream).
        if (need_dnn) {
          std::vector<Router> routers =
              LayerRouters(static_cast<int64_t>(dnns.size()), P->E, P->K, a.routing, a.zipf_s);
          std::vector<int32_t> ids;
          std::vector<float> w;
          int iters = 0;
          double total = 0;
          for (int it = 0; it < 1000; ++it) {
            const size_t l = static_cast<size_t>(it) % dnns.size();
            routers[l].Route(T, ids, w);
            MoeInput in{T, P->K, x.data(), ids.data(), w.data()};
            const double t0 = Now();
            auto s = dnns[l]->Run(in, out.data());
            const double dt = Now() - t0;
            if (!s.ok()) {
              std::fprintf(stderr, "onednn run: %s\n", s.ToString().c_str());
              return 1;
            }
            if (it == 0) continue;  // warm-up
            total += dt;
            ++iters;
            if (total > a.min_time && iters >= 2) break;
          }
          dnn_us[dfmt][T] = total / iters * 1e6;
        }
        for (const auto& iname : a.isas) {
          const std::optional<Isa> isa = ParseIsa(iname);  // checked after parsing
          if (*isa > DetectedIsa()) {
            std::fprintf(stderr, "# skip isa %s (not on this CPU)\n", iname.c_str());
            continue;
          }
          const std::vector<Args::Tune> tunes =
              a.tunes.empty() ? std::vector<Args::Tune>{Args::Tune{"", env_tuning}} : a.tunes;
          for (int rep = 0; rep < a.reps; ++rep)
            for (const Args::Tune& tune : tunes)
              for (Variant& v : variants) {
                const std::vector<PackedMoeLayer>& layers = v.layers;
                const std::string tag = absl::StrCat(tune.name.empty() ? "" : " cfg=", tune.name,
                                                     v.tag.empty() ? "" : " ", v.tag);
                RunOptions ro;
                ro.isa = MinIsa(*isa, *isa_cap);
                ro.many_threshold = tune.many.value_or(a.many);
                ro.many_threshold_int4 = tune.many_int4.value_or(a.many_int4);
                ro.tuning = tune.tuning;
                std::vector<Router> routers = LayerRouters(static_cast<int64_t>(layers.size()),
                                                           P->E, P->K, a.routing, a.zipf_s);
                std::vector<int32_t> ids;
                std::vector<float> w;
                int iters = 0;
                double total = 0, bytes = 0, flops = 0;
                for (int it = 0; it < 100000; ++it) {
                  const size_t l = static_cast<size_t>(it) % layers.size();
                  routers[l].Route(T, ids, w);
                  MoeInput in{T, P->K, x.data(), ids.data(), w.data()};
                  std::vector<char> touched(static_cast<size_t>(P->E), 0);
                  for (int32_t e : ids) touched[static_cast<size_t>(e)] = 1;
                  const int64_t ne = std::count(touched.begin(), touched.end(), 1);
                  const double t0 = Now();
                  auto s = RunMoe(layers[l], in, out.data(), *v.pool, *v.ws, ro);
                  const double dt = Now() - t0;
                  if (!s.ok()) {
                    std::fprintf(stderr, "run: %s\n", s.ToString().c_str());
                    return 1;
                  }
                  if (it == 0) {
                    v.ws->TakeProfile();  // the warm-up call's phases are not reported
                    continue;
                  }
                  total += dt;
                  bytes += static_cast<double>(ne * v.expert_bytes);
                  flops += static_cast<double>(T * P->K) * 6.0 * P->H * P->I;
                  ++iters;
                  if (total > a.min_time && iters >= 3) break;
                }
                const double us = total / iters * 1e6;
                const double gbs = bytes / total / 1e9, tf = flops / total / 1e12;
                const double peak = *fmt == WeightFormat::kInt8 ? amx_i8 : amx_bf16;
                const double dus =
                    dnn_us.count(dfmt) && dnn_us[dfmt].count(T) ? dnn_us[dfmt][T] : 0;
                const std::string dnn_cols = dus > 0
                                                 ? absl::StrFormat("%11.1f %7.2fx", dus, dus / us)
                                                 : absl::StrFormat("%11s %8s", "-", "-");
                std::printf("%-10s %-5s %-6s %5lld %11.1f %9.1f %8.2f %6.1f%% %6.1f%% %s%s\n",
                            pname.c_str(), fname.c_str(), iname.c_str(), static_cast<long long>(T),
                            us, gbs, tf, bw > 0 ? 100 * gbs / bw : 0,
                            peak > 0 ? 100 * tf / peak : 0, dnn_cols.c_str(), tag.c_str());
                std::fflush(stdout);
                // --row-limits: the peak again, right after the row, so a row's
                // ratio can be read against the machine's state at that moment
                // (on a shared VM the start-of-run peak drifts between processes).
                double row_peak = 0;
                if (a.row_limits && T >= 128 && *isa == Isa::kAmx) {
                  row_peak = MeasureAmxTops(pool, *fmt == WeightFormat::kInt8);
                  double& best = *fmt == WeightFormat::kInt8 ? best_i8 : best_bf16;
                  best = std::max(best, row_peak);
                  std::printf("#   AMX peak after the row: %.1f T(FL)OP/s -> %.1f%% of it\n",
                              row_peak, 100 * tf / row_peak);
                  amx_rows.push_back({absl::StrCat(pname, " ", fname, " T=", T, tag), tf,
                                      *fmt == WeightFormat::kInt8});
                }
                // HMOE_PROFILE=1: where this row's time went, per call.
                const MoePhaseProfile phases = v.ws->TakeProfile();
                nlohmann::json phase_us = nlohmann::json::object();
                if (phases.calls > 0) {
                  std::printf("#   phases (us/call)%s:", tag.c_str());
                  for (int i = 0; i < MoePhaseProfile::kPhases; ++i) {
                    const double v = phases.seconds[i] / static_cast<double>(phases.calls) * 1e6;
                    std::printf(" %s %.0f", MoePhaseProfile::Name(i), v);
                    phase_us[MoePhaseProfile::Name(i)] = v;
                  }
                  std::printf("\n");
                  std::fflush(stdout);
                }
                J["rows"].push_back(
                    {{"preset", pname},
                     {"format", fname},
                     {"isa", iname},
                     {"T", T},
                     {"us", us},
                     {"weight_gbs", gbs},
                     {"tflops", tf},
                     {"pct_bw", bw > 0 ? 100 * gbs / bw : 0},
                     {"pct_amx", peak > 0 ? 100 * tf / peak : 0},
                     {"onednn_format", dfmt},
                     {"onednn_us", dus > 0 ? nlohmann::json(dus) : nlohmann::json()},
                     {"speedup", dus > 0 ? nlohmann::json(dus / us) : nlohmann::json()},
                     {"layers", L},
                     {"routing", RoutingName(a.routing)},
                     {"zipf_s", a.routing == Routing::kZipf ? a.zipf_s : 0.0},
                     {"many_threshold", ro.many_threshold},
                     {"many_threshold_int4", ro.many_threshold_int4},
                     {"virtual_nodes", v.pool->num_nodes()},
                     {"cfg", tune.name},
                     {"row_peak", row_peak},
                     {"phases_us", phase_us}});
                flush_json();
              }
        }
      }
    }
  }
  if (a.row_limits && !amx_rows.empty()) {
    // The same rows against the best peak any measurement of this run saw.
    std::printf("# AMX peak, best of this run: bf16 %.1f TFLOP/s, int8 %.1f TOP/s\n", best_bf16,
                best_i8);
    for (const AmxRow& r : amx_rows)
      std::printf("#   %-32s %6.2f T(FL)OP/s = %5.1f%% of the best peak\n", r.label.c_str(), r.tf,
                  100 * r.tf / (r.i8 ? best_i8 : best_bf16));
    J["amx_bf16_tflops_best"] = best_bf16;
    J["amx_int8_tops_best"] = best_i8;
    flush_json();
  }
  return 0;
}

}  // namespace
}  // namespace hmoe

int main(int argc, char** argv) { return hmoe::Main(argc, argv); }
