#!/usr/bin/env python3
"""Writes a random DeepSeek-V3-shaped checkpoint (config.json, bf16
safetensors, the fixtures' tokenizer) for serving benchmarks: real shapes and
file formats, meaningless weights. Standard library only (tooling, not a
dependency of the product).

  bench/make_random_checkpoint.py OUT_DIR [--hidden 2048] [--moe-inter 1024]
      [--experts 64] [--top-k 4] [--layers 4] [--dense-layers 1] [--vocab 3072]

Weights come from one 2 MiB block of random bf16 values (|x| in [2^-9,
2^-5)), each tensor starting at its own random offset and wrapping around,
so experts and router rows differ (routing spreads as in a real model);
norms are 1, the router's correction bias 0.
"""
import argparse
import json
import os
import random
import shutil
import struct


def random_block(seed, values):
    rng = random.Random(seed)
    bits = [(rng.getrandbits(1) << 15) | (rng.randint(118, 121) << 7) | rng.getrandbits(7)
            for _ in range(values)]
    return struct.pack(f"<{values}H", *bits)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--moe-inter", type=int, default=1024)
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--top-k", type=int, default=4)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--dense-layers", type=int, default=1)
    ap.add_argument("--vocab", type=int, default=3072)
    a = ap.parse_args()
    H, I, E, V = a.hidden, a.moe_inter, a.experts, a.vocab
    heads, nope, rope, vdim, kv_rank, q_rank = 4, 16, 16, 24, 32, 48
    dense_inter = 2 * H
    cfg = {
        "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
        "hidden_size": H, "intermediate_size": dense_inter, "moe_intermediate_size": I,
        "n_routed_experts": E, "num_experts_per_tok": a.top_k, "n_shared_experts": 1,
        "n_group": 4, "topk_group": 2, "topk_method": "noaux_tc", "scoring_func": "sigmoid",
        "norm_topk_prob": True, "routed_scaling_factor": 2.5,
        "first_k_dense_replace": a.dense_layers, "num_hidden_layers": a.layers,
        "num_attention_heads": heads, "num_key_value_heads": heads,
        "q_lora_rank": q_rank, "kv_lora_rank": kv_rank, "qk_nope_head_dim": nope,
        "qk_rope_head_dim": rope, "qk_head_dim": nope + rope, "v_head_dim": vdim,
        "head_dim": rope, "rope_interleave": True, "hidden_act": "silu",
        "max_position_embeddings": 8192, "rms_norm_eps": 1e-6, "vocab_size": V,
        "bos_token_id": 0, "eos_token_id": 1, "tie_word_embeddings": False,
        "attention_bias": False, "dtype": "bfloat16",
    }
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "config.json"), "w") as f:
        json.dump(cfg, f, indent=1)
    here = os.path.dirname(os.path.abspath(__file__))
    shutil.copy(os.path.join(here, "..", "tests", "fixtures", "tokenizer.json"), a.out)

    tensors = []  # (name, shape, kind)
    add = lambda n, s, k="rand": tensors.append((n, s, k))
    add("model.embed_tokens.weight", [V, H])
    add("lm_head.weight", [V, H])
    add("model.norm.weight", [H], "one")
    for l in range(a.layers):
        p = f"model.layers.{l}."
        add(p + "input_layernorm.weight", [H], "one")
        add(p + "post_attention_layernorm.weight", [H], "one")
        s = p + "self_attn."
        add(s + "q_a_proj.weight", [q_rank, H])
        add(s + "q_a_layernorm.weight", [q_rank], "one")
        add(s + "q_b_proj.weight", [heads * (nope + rope), q_rank])
        add(s + "kv_a_proj_with_mqa.weight", [kv_rank + rope, H])
        add(s + "kv_a_layernorm.weight", [kv_rank], "one")
        add(s + "kv_b_proj.weight", [heads * (nope + vdim), kv_rank])
        add(s + "o_proj.weight", [H, heads * vdim])
        m = p + "mlp."
        if l < a.dense_layers:
            for proj, shape in (("gate", [dense_inter, H]), ("up", [dense_inter, H]),
                                ("down", [H, dense_inter])):
                add(f"{m}{proj}_proj.weight", shape)
            continue
        add(m + "gate.weight", [E, H])
        add(m + "gate.e_score_correction_bias", [E], "zero_f32")
        for who, inter in [("shared_experts", I)] + [(f"experts.{e}", I) for e in range(E)]:
            add(f"{m}{who}.gate_proj.weight", [inter, H])
            add(f"{m}{who}.up_proj.weight", [inter, H])
            add(f"{m}{who}.down_proj.weight", [H, inter])

    header, off = {}, 0
    for name, shape, kind in tensors:
        n = 1
        for d in shape:
            n *= d
        size = 4 * n if kind == "zero_f32" else 2 * n
        header[name] = {"dtype": "F32" if kind == "zero_f32" else "BF16", "shape": shape,
                        "data_offsets": [off, off + size]}
        off += size
    blob = json.dumps(header).encode()
    blob += b" " * ((8 - len(blob) % 8) % 8)
    block = random_block(1, 1 << 20)
    offsets = random.Random(2)
    with open(os.path.join(a.out, "model.safetensors"), "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for name, shape, kind in tensors:
            size = header[name]["data_offsets"][1] - header[name]["data_offsets"][0]
            if kind == "zero_f32":
                f.write(bytes(size))
            elif kind == "one":
                f.write(struct.pack("<H", 0x3F80) * (size // 2))
            else:
                at = 2 * offsets.randrange(len(block) // 2)
                while size > 0:
                    chunk = block[at : at + min(size, len(block) - at)]
                    f.write(chunk)
                    size -= len(chunk)
                    at = 0
    print(f"{a.out}: {len(tensors)} tensors, {off / 1e9:.2f} GB")


if __name__ == "__main__":
    main()
