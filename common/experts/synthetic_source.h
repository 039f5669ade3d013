// Synthetic routed experts (the expert service's --synthetic, and whatever
// must hold the same weights: the worker's hot experts in benchmarks).
#pragma once

#include <cstdint>

#include "common/experts/expert_weights.h"

namespace hmoe {

struct SyntheticExperts {
  int64_t hidden = 0, intermediate = 0, experts = 0;
  uint64_t seed = 1;
};

// One MoE layer's experts as bf16 tensors, w ~ U(-1, 1) / sqrt(K): a pure
// function of (seed, layer, expert, matrix, element), so every shard count,
// split and process sees the same model.
MoeWeightsSource SyntheticExpertSource(const SyntheticExperts& spec, int layer);

}  // namespace hmoe
