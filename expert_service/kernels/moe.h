// The routed-expert MoE operator of one expert-service shard.
//
//   out[t] = sum_{j < top_k, ids[t][j] in [expert_begin, expert_end)}
//              weights[t][j] * down_e( SiLU(gate_e(x[t])) * up_e(x[t]) )
//
// over the experts this shard owns and, when the shard owns only a slice
// [i_begin, i_end) of every expert's intermediate dim (tensor parallel), over
// that slice only: the output is then a partial sum for the caller to add up.
// x is bf16 [T][H], out is f32 [T][H] (overwritten).
//
// Numerics (the scalar reference, RunMoeReference, is the definition; every
// kernel matches it up to fp32 summation order, see tests/kernels):
//   Per expert call the regime is "many" when the expert received more than
//   RunOptions::many_threshold (INT4: many_threshold_int4) tokens in this
//   call (AMX kernels), else "few"
//   (AVX-512/AVX2 GEMV). The regime, not the ISA, fixes the numerics:
//   * BF16 weights: activations are the bf16 inputs; gate/up accumulate in
//     fp32; h = bf16(SiLU(g) * u) (round to nearest even); down accumulates
//     h * w in fp32.
//   * INT8 weights (w = q * s_row): x is quantized per token,
//     s_x = max|x|/127, xq = rne(x / s_x) (multiply by 1/s_x); g = s_x * s_row *
//     sum(xq * q) (exact int32 sum); h = SiLU(g) * u in fp32, then quantized
//     per (token, expert) over the shard's whole slice the same way; down as gate.
//   * INT4 weights (w = q * s_group), "few": as INT8 but with a per-group
//     int32 sum scaled by s_group; "many": weights are dequantized to
//     bf16(q * s_group) and everything else is as BF16.
//   * Native formats (mxfp4, int4bf16, fp8, mxfp8: w = v * s, v the exact
//     element value, s the group's or block's scale): activations as BF16;
//     "few": per scale group, sum(x * v) in fp32 times s; "many": weights
//     dequantized to bf16(v * s), then as BF16. h as BF16.
//   SiLU(g) = g / (1 + exp(-g)). The final sum over top-k and over NUMA-node
//   partials is fp32, weights applied per expert.
//
// Nothing here allocates on the hot path: MoeWorkspace is sized once for the
// largest call.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/experts/quantize.h"
#include "common/experts/weight_format.h"
#include "common/runtime/numa.h"
#include "common/runtime/thread_pool.h"
#include "common/tensor.h"
#include "expert_service/kernels/isa.h"
#include "expert_service/kernels/packed.h"
#include "expert_service/kernels/tuning.h"

namespace hmoe {

// ---- the packed layer ------------------------------------------------------------

class PackedMoeLayer {
 public:
  // One per (real or virtual) NUMA node of the pool: the node's slice
  // [i0, i1) (absolute intermediate indices) of every owned expert, in memory
  // bound to that node. Slices are disjoint: weights are never duplicated
  // (only the per-row int8 scales of down are).
  struct Part {
    int64_t i0 = 0, i1 = 0;
    PackedGeom gu;    // interleaved gate/up: n = 2 * roundup(i1 - i0, 16), k = hidden
    PackedGeom down;  // n = hidden, k = i1 - i0
    int64_t expert_stride = 0;
    NumaBuffer mem;
    // An aliased layer (Aliased): expert e_local's bytes are slot
    // alias[e_local] of `shared`, the memory of the base layer every layer
    // aliased to it holds; `mem` is empty. Otherwise alias is empty.
    std::shared_ptr<const NumaBuffer> shared;
    std::vector<int32_t> alias;
    const uint8_t* gate_up(int64_t e_local) const {
      return alias.empty() ? mem.data() + e_local * expert_stride
                           : shared->data() + alias[static_cast<size_t>(e_local)] * expert_stride;
    }
    const uint8_t* down_w(int64_t e_local) const { return gate_up(e_local) + gu.bytes(); }
    uint8_t* mutable_gate_up(int64_t e_local) { return mem.data() + e_local * expert_stride; }
    uint8_t* mutable_down(int64_t e_local) { return mutable_gate_up(e_local) + gu.bytes(); }
    bool empty() const { return i1 <= i0; }
  };

  WeightFormat format() const { return format_; }
  int group() const { return group_; }
  int64_t hidden() const { return hidden_; }
  int64_t i_begin() const { return i_begin_; }
  int64_t i_end() const { return i_end_; }
  int64_t expert_begin() const { return expert_begin_; }
  int64_t expert_end() const { return expert_end_; }
  int64_t num_local_experts() const { return expert_end_ - expert_begin_; }
  const std::vector<Part>& parts() const { return parts_; }
  std::vector<Part>& mutable_parts() { return parts_; }
  // Packed bytes of one expert (all parts): what a call streams per expert.
  int64_t expert_bytes() const;

  // The layer's layout split over the pool's nodes, without memory.
  static absl::StatusOr<PackedMoeLayer> Plan(int64_t hidden, int64_t intermediate,
                                             int64_t num_experts, const PackOptions& opts,
                                             const ThreadPool& pool);
  // Packed bytes per memory node (ThreadPool::mem_node) of this layout, each
  // part rounded to whole pages as Allocate maps it.
  std::map<int, int64_t> NodeBytes(const ThreadPool& pool) const;
  // Allocates an empty layer split over the pool's nodes.
  static absl::StatusOr<PackedMoeLayer> Allocate(int64_t hidden, int64_t intermediate,
                                                 int64_t num_experts, const PackOptions& opts,
                                                 const ThreadPool& pool);
  // A layer of `opts`' experts whose expert e_local is `base`'s local expert
  // alias[e_local], sharing base's memory (kept alive by the result): no
  // bytes of its own. base must have this layout's parts (format, group,
  // intermediate slice, pool); INVALID_ARGUMENT naming what differs or an
  // alias out of base's range. Packing into it is not allowed (it has no
  // mutable memory).
  static absl::StatusOr<PackedMoeLayer> Aliased(std::shared_ptr<const PackedMoeLayer> base,
                                                int64_t intermediate, int64_t num_experts,
                                                const PackOptions& opts, const ThreadPool& pool,
                                                std::vector<int32_t> alias);
  bool aliased() const { return !parts_.empty() && !parts_.front().alias.empty(); }

 private:
  WeightFormat format_ = WeightFormat::kBf16;
  int group_ = 0;
  int64_t hidden_ = 0, i_begin_ = 0, i_end_ = 0, expert_begin_ = 0, expert_end_ = 0;
  std::vector<Part> parts_;
};

// Quantizes and packs the shard's experts (parallel over experts on `pool`).
absl::StatusOr<PackedMoeLayer> Pack(const MoeWeightsSource& src, const PackOptions& opts,
                                    ThreadPool& pool);
// Packs already-quantized experts (index = local expert).
absl::Status PackExpert(const QuantExpert& q, int64_t e_local, PackedMoeLayer& layer);
// Reconstructs the plain quantized form of a packed expert (inverse of PackExpert).
absl::StatusOr<QuantExpert> UnpackExpert(const PackedMoeLayer& layer, int64_t e_local);
// Fills a layer with random weights directly in packed form (benchmarks):
// bf16 ~ U(-1/sqrt(K), 1/sqrt(K)), int q uniform, scales ~ 1/(sqrt(K) * qmax).
absl::StatusOr<PackedMoeLayer> PackRandom(int64_t hidden, int64_t intermediate, int64_t num_experts,
                                          const PackOptions& opts, ThreadPool& pool, uint64_t seed);

// ---- running ---------------------------------------------------------------------

struct MoeInput {
  int64_t tokens = 0;
  int top_k = 0;
  const uint16_t* x = nullptr;     // [tokens][hidden] bf16
  const int32_t* ids = nullptr;    // [tokens][top_k] global expert ids (others' ids are skipped)
  const float* weights = nullptr;  // [tokens][top_k]
};

struct RunOptions {
  std::optional<Isa> isa;   // cap; the effective ISA is min(detected, this)
  bool strict_isa = false;  // requesting an ISA the CPU lacks fails instead of falling back
  int many_threshold = 4;   // experts with more tokens than this use the "many" (AMX) kernels
  // INT4 "many" dequantizes weights to bf16 for AMX, which pays off only with
  // more rows per weight than the VNNI kernel's 4: INT4 uses this instead.
  int many_threshold_int4 = 16;
  // Tests only: on a CPU with AVX-512 but no AMX, run the "many" experts on
  // the AMX kernels over a software model of the tile registers (slow), so
  // the AMX code path and its tile layouts are checked without AMX.
  bool emulate_amx = false;
  // Loop orders, chunk sizes, prefetch and scheduling (tuning.h): speed
  // only, every valid setting gives the same result; the defaults are the
  // measured best. RunMoe rejects invalid ones (INVALID_ARGUMENT).
  KernelTuning tuning;
};

// RunMoe's per-phase wall time (worker 0's view, seconds) summed over calls
// with MoeTuning::profile set, in phase order (route: the plan; wake; xquant:
// the activation quantization before the stage, when the plan asks for it;
// stage: gather, gate_up, hquant and down as one dependency-driven stage;
// reduce; join).
struct MoePhaseProfile {
  static constexpr int kPhases = 6;
  static const char* Name(int phase);
  int64_t calls = 0;
  double seconds[kPhases] = {};
  // "N calls, us per call: route 12 wake 3 ..."; "no calls" when calls == 0.
  std::string ToString() const;
};

// Scratch for RunMoe, sized for `max_tokens` x `max_top_k` on layers shaped
// like `layer` (same hidden, node split and format); node-local per part.
// One workspace serves all layers of a model, one call at a time.
class MoeWorkspace {
 public:
  static absl::StatusOr<std::unique_ptr<MoeWorkspace>> Create(const PackedMoeLayer& layer,
                                                              int64_t max_tokens, int max_top_k,
                                                              ThreadPool& pool);
  ~MoeWorkspace();
  // What Create allocates for these arguments, bytes per memory node
  // (ThreadPool::mem_node), without allocating; node_bytes() is what it did.
  static std::map<int, int64_t> NodeBytes(const PackedMoeLayer& layer, int64_t max_tokens,
                                          int max_top_k, const ThreadPool& pool);
  std::map<int, int64_t> node_bytes() const;
  // The profile of the calls since the last take (see MoePhaseProfile);
  // starts over. Not while a RunMoe call on this workspace runs.
  MoePhaseProfile TakeProfile();
  struct Impl;
  Impl* impl() const { return impl_.get(); }

 private:
  MoeWorkspace() = default;
  std::unique_ptr<Impl> impl_;
};

// The operator. `out` is [tokens][hidden] f32. Cheap checks only (token
// count vs workspace, pointers): shapes are validated one layer up.
absl::Status RunMoe(const PackedMoeLayer& layer, const MoeInput& in, float* out, ThreadPool& pool,
                    MoeWorkspace& ws, const RunOptions& opts = {});

// The "many" threshold of an expert in format `f`: many_threshold_int4 for
// the formats whose "many" kernels dequantize the weights to bf16 (int4 and
// the native formats), else many_threshold.
int ManyThreshold(WeightFormat f, const RunOptions& opts);

// The ISA RunMoe would use for these options (after the cap and fallback).
absl::StatusOr<Isa> EffectiveIsa(const RunOptions& opts);

// The scalar reference (double accumulation where the kernels use fp32,
// otherwise the exact numerics above). experts[e - expert_begin]; `i_parts`
// > 1 is not modeled (node partials only change fp32 summation order).
absl::Status RunMoeReference(const std::vector<QuantExpert>& experts, int64_t hidden,
                             int64_t expert_begin, const MoeInput& in, float* out,
                             const RunOptions& opts = {});

}  // namespace hmoe
