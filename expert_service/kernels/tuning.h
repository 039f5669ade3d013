// Tuning of the CPU expert kernels: typed options with the measured-best
// defaults in the structs (bench/results/README.md has the measurements).
// They change speed only: every valid setting computes the same numbers
// (tests/kernels/moe_test.cc checks each against the reference).
//
// Callers carry a KernelTuning in RunOptions; nothing in the kernels reads
// the environment. Benchmarks and operators set knobs through HMOE_AMX_*,
// HMOE_FEW_*, HMOE_MOE_* and HMOE_PROFILE, read once by KernelTuningFromEnv.
// Knobs whose other settings lost or tied their measurements were removed
// with their code paths (AMX edge overlap, contiguous partial C, int8
// one-pass epilogue, A prefetches; RunMoe's phased stages, overlapped
// reduce, direct y): bench/results/README.md keeps the numbers.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace hmoe {

// AMX GEMM ("many" tokens per expert; kernels_amx.cc, whose header comment
// describes the blocking these knobs change).
struct AmxTuning {
  // HMOE_AMX_KC_BYTES: bytes of each A row per K chunk, 256..4096 (a power
  // of two) or 0 = per format (1024 for bf16 / int8 and staged int4: a row
  // pair's A chunk is 32 KiB and stays in L1; 2048 for unstaged int4).
  int64_t kc_bytes = 0;
  // HMOE_AMX_PREFETCH: prefetch into L2 the B lines that come next (order 0:
  // the next panel pair's chunk; order 1: the next K chunk of the task's
  // panels; staged int4: its int4 lines and scales).
  bool prefetch = true;
  // HMOE_AMX_ORDER = 0 | 1: inside a K chunk, panel pairs outer (0) or row
  // pairs outer (1).
  int order = 1;
  // HMOE_AMX_ORDER0_ROWS = 0..512: with order 1, calls of at most this many
  // rows run order 0 (kernels_amx.cc says what differs for one row pair:
  // which operand streams, what is prefetched). 32: at ds-v3 T=128-512 with
  // random routing (4-16 rows per expert) order 0 won 18 of 18 interleaved
  // pairs in three grants (1-12% faster); at T=2048-4096 (64-128 rows) it
  // won in one grant and lost in another, at T=8192 it lost
  // (bench/results run 21). 0: order 1 throughout.
  int order0_rows = 32;
  // HMOE_AMX_STREAM: load the operand not reused from L1 (order 1: B;
  // order 0: A) with tileloaddt1 so it does not evict the other (bf16, int8
  // and staged int4; unstaged int4 never streams).
  bool stream = true;
  // HMOE_AMX_TAIL16: a last row pair whose second 16-row block is only
  // padding (rows >= m) runs as one row block (1x2 C tiles), so rows are
  // padded to 16, not 32 (0: the padding block is computed too).
  // (A tile product over fewer configured rows takes as long as over 16:
  // hmoe-amx-microprobe --rows, bench/results run 21.)
  bool tail16 = true;
  // HMOE_AMX_I4_STAGE: int4 "many" calls run order 1 like bf16: per K chunk
  // (1 KiB of each A row) the task's panels are dequantized to bf16 into a
  // staging half of the scratch, the next chunk's one int4 line at a time
  // between the current chunk's k steps (0: order 0 with 2 KiB chunks, each
  // panel pair dequantized just before its blocks). Needs 2 x panels x
  // 16 KiB of scratch, else order 0.
  bool i4_stage = true;
};

// Software prefetch distances of the AVX-512 GEMV kernels ("few" tokens per
// expert): bytes ahead in each panel stream, 0 = none, at most 65536.
struct FewTuning {
  int64_t pf_i4 = 2048;    // HMOE_FEW_PF_I4 (rounded up to whole int4 groups)
  int64_t pf_i8 = 2048;    // HMOE_FEW_PF_I8
  int64_t pf_bf16 = 1024;  // HMOE_FEW_PF_BF16
};

// RunMoe's scheduling (moe.cc, whose header comment describes the stages).
struct MoeTuning {
  static constexpr int64_t kMaxTaskPanels = 32;  // sizes the workers' C buffers
  // HMOE_MOE_TASK_PANELS: panels (16 columns each) per gate_up / down task
  // at most; even, 2..kMaxTaskPanels.
  int64_t task_panels = 16;
  // HMOE_MOE_LOOKAHEAD: workers claim one task ahead so the kernel
  // prefetches its first K chunk.
  bool lookahead = true;
  // HMOE_MOE_GATHER_STREAM: write gathered activations with streaming stores.
  bool gather_stream = true;
  // HMOE_PROFILE: accumulate per-phase wall time in the workspace
  // (MoeWorkspace::TakeProfile).
  bool profile = false;
};

struct KernelTuning {
  AmxTuning amx;
  FewTuning few;
  MoeTuning moe;
};
inline constexpr KernelTuning kDefaultKernelTuning{};

// OK, or INVALID_ARGUMENT naming the first field out of range.
absl::Status ValidateKernelTuning(const KernelTuning& t);

// The defaults overridden by the environment variables named above, looked
// up with `getenv` (tests pass their own). Booleans take 0 or 1; a bad value
// is INVALID_ARGUMENT naming the variable and the value.
absl::StatusOr<KernelTuning> KernelTuningFromEnv(
    const std::function<const char*(const char*)>& getenv);
absl::StatusOr<KernelTuning> KernelTuningFromEnv();  // the process environment

// The settings that differ from the defaults, as "HMOE_X=v HMOE_Y=w"; empty
// when none do. For logging once at start-up.
std::string KernelTuningToString(const KernelTuning& t);

// The names of every variable KernelTuningFromEnv reads.
const std::vector<std::string>& KernelTuningVariables();

}  // namespace hmoe
