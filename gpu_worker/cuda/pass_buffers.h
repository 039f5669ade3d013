// The CUDA backend's per-pass activations: one device workspace carved into
// named buffers (each [rows, width] row-major, rows = the pass's T or its
// slot bucket), and the pinned host buffers that carry a pass's inputs and
// the routed experts' inputs. Internal to gpu_worker/cuda/.
#pragma once

#include <cstdint>

namespace hmoe::cuda {

struct PassBuffers {
  // The residual stream and what joins it.
  float* residual = nullptr;        // [T, H] x
  float* layer_out = nullptr;       // [T, H] attention's / the dense MLP's output
  float* normed = nullptr;          // [T, H] post-attention norm (f32, the router's input)
  float* shared_out = nullptr;      // [T, H] the shared experts' output
  float* routed = nullptr;          // [T, H] staging for the routed experts' sum
  uint16_t* normed_bf16 = nullptr;  // [T, H] the current norm's output (the GEMMs' input)
  // Attention (MLA: q_a, q_a_bf16, q, kv_a, q_latent, out_latent; GQA: q, k, v, attn_out).
  float *q_a = nullptr, *q = nullptr, *kv_a = nullptr, *q_latent = nullptr, *out_latent = nullptr,
        *k = nullptr, *v = nullptr, *attn_out = nullptr;
  uint16_t *q_a_bf16 = nullptr, *attn_out_bf16 = nullptr;
  // MLPs: gate and up rows [T, 2I], silu(gate) * up [T, I].
  float* gate_up = nullptr;
  uint16_t* act_bf16 = nullptr;
  // Routing: router logits [T, E]; top-k ids and weights [T, K]; Deferral's
  // split of them (now: [T, K - n], later: [T, n]).
  float* router_logits = nullptr;
  float* route_weights = nullptr;
  int32_t* route_ids = nullptr;
  float *now_weights = nullptr, *later_weights = nullptr;
  int32_t *now_ids = nullptr, *later_ids = nullptr;
  float* rope_cs = nullptr;       // [T, rope_dim]
  float* logit_inputs = nullptr;  // [R, H] the kept rows of the residual
  float* logits = nullptr;        // [R, V]
  int32_t* meta = nullptr;        // slot, table start, pos, logit rows (, ids), block table
};

// The pinned host side (one allocation).
struct HostPassBuffers {
  float* normed = nullptr;         // [T, H] the routed experts' input (bf16-rounded)
  float* route_weights = nullptr;  // [T, K]
  int32_t* route_ids = nullptr;    // [T, K]
  int32_t* meta = nullptr;         // as PassBuffers::meta
  float* rope_cs = nullptr;        // [T, rope_dim] a slot pass's rope rows
  int32_t* tokens = nullptr;       // a slot pass's real T (read by host nodes)
};

}  // namespace hmoe::cuda
