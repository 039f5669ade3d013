// Synthetic routed experts (the expert service's --synthetic, and whatever
// must hold the same weights: the worker's hot experts in benchmarks).
#pragma once

#include <cstdint>

#include "common/experts/expert_weights.h"

namespace hmoe {

struct SyntheticExperts {
  int64_t hidden = 0, intermediate = 0, experts = 0;
  uint64_t seed = 1;
  // Aliased experts (fit checks of a full-size shape in little memory; not
  // a model whose speed means anything): N > 0 distinct weight sets, expert e
  // of layer l holding set SyntheticAliasIndex(spec, l, e). 0: every expert
  // its own weights.
  int64_t alias = 0;
};

// One MoE layer's experts as bf16 tensors, w ~ U(-1, 1) / sqrt(K): a pure
// function of (seed, layer, expert, matrix, element), so every shard count,
// split and process sees the same model. Aliased: expert e holds
// SyntheticAliasSet's expert SyntheticAliasIndex(spec, layer, e).
MoeWeightsSource SyntheticExpertSource(const SyntheticExperts& spec, int layer);

// (layer * experts + e) % alias: the weight set expert e of `layer` holds
// (spec.alias > 0).
int64_t SyntheticAliasIndex(const SyntheticExperts& spec, int layer, int64_t e);

// The alias distinct weight sets as one source of `alias` experts: set k is
// the unaliased model's expert k % experts of layer k / experts (so layer 0's
// first experts when alias <= experts). spec.alias > 0.
MoeWeightsSource SyntheticAliasSet(const SyntheticExperts& spec);

}  // namespace hmoe
