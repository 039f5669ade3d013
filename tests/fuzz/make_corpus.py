#!/usr/bin/env python3
"""Writes the fuzz targets' seed corpora (tests/fuzz/corpus/<target>/).

Run from the repository root: python3 tests/fuzz/make_corpus.py. Uses protoc
(--encode) for the protobuf seeds; everything else is built here. The
seeds are committed; this records how they were made.
"""
import base64
import json
import os
import shutil
import struct
import subprocess

ROOT = os.path.join("tests", "fuzz", "corpus")


def put(target, name, data):
    d = os.path.join(ROOT, target)
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, name), "wb") as f:
        f.write(data if isinstance(data, bytes) else data.encode())


def encode(message, text, proto):
    return subprocess.run(["protoc", "-Iproto", "--encode=" + message, proto], input=text.encode(),
                          capture_output=True, check=True).stdout


def safetensors(tensors, metadata=None):
    header, blobs, off = {}, b"", 0
    for name, (dtype, shape, data) in tensors.items():
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [off, off + len(data)]}
        blobs += data
        off += len(data)
    if metadata:
        header["__metadata__"] = metadata
    h = json.dumps(header).encode()
    return struct.pack("<Q", len(h)) + h + blobs


# The targets whose seeds this script writes (chat_template's come from
# tests/fixtures/chat_templates/ and are kept).
MINE = ["safetensors", "config", "tokenizer", "generate_request", "expert_protocol",
        "openai_request", "tool_calls"]


def main():
    for t in MINE:
        shutil.rmtree(os.path.join(ROOT, t), ignore_errors=True)
    # safetensors
    put("safetensors", "f32", safetensors({"w": ("F32", [2, 3], struct.pack("<6f", *range(6)))}))
    put("safetensors", "bf16_meta", safetensors(
        {"a": ("BF16", [4], b"\x80\x3f" * 4), "b.c": ("I32", [1, 2], struct.pack("<2i", -1, 7))},
        {"format": "pt"}))
    put("safetensors", "fp8_scale", safetensors(
        {"q": ("F8_E4M3", [2, 2], b"\x38\x40\xb8\x7e"), "q_scale_inv": ("F32", [1, 1],
                                                                       struct.pack("<f", 0.5))}))
    put("safetensors", "empty_tensor", safetensors({"z": ("F16", [0, 5], b"")}))
    put("safetensors", "overlap", struct.pack("<Q", 80) +
        b'{"x":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"y":{"dtype":"F32","shape":[2],'
        b'"data_offsets":[4,12]}}'.ljust(80) + b"\0" * 12)
    # config.json: the fixtures' and the published ones
    for d in sorted(os.listdir("tests/fixtures")):
        p = os.path.join("tests/fixtures", d, "config.json")
        if os.path.exists(p):
            put("config", d, open(p, "rb").read())
    for d in sorted(os.listdir("tests/fixtures/configs")):
        p = os.path.join("tests/fixtures/configs", d, "config.json")
        if os.path.exists(p):
            put("config", "published_" + d, open(p, "rb").read())
    # tokenizer: even first byte + a tokenizer.json; odd + text
    put("tokenizer", "sp_bpe_json", b"\x00" + open("tests/fixtures/sp_bpe/tokenizer.json", "rb").read())
    tiny = {"version": "1.0", "added_tokens": [{"id": 5, "content": "<s>", "special": True}],
            "normalizer": {"type": "NFC"}, "pre_tokenizer": {"type": "ByteLevel",
                                                            "add_prefix_space": False},
            "post_processor": None, "decoder": {"type": "ByteLevel"},
            "model": {"type": "BPE", "vocab": {"a": 0, "b": 1, "ab": 2, "\u0120": 3, "c": 4},
                      "merges": ["a b"]}}
    put("tokenizer", "tiny_bytelevel_json", b"\x02" + json.dumps(tiny).encode())
    for i, text in enumerate(["Hello, world!", "A wise man once said", "caf\u00e9 \u4e16\u754c \U0001F600",
                              "  leading\tand\ntrailing  ", "<s>special</s><|endoftext|>",
                              "e\u0301 NFC", "1234567890 x=y+z;"]):
        put("tokenizer", "text%d" % i, b"\x01" + text.encode())
    put("tokenizer", "bad_utf8", b"\x01\xff\xfe\xc3")
    # tiktoken: even first byte + a rank file, NUL, a tokenizer_config.json; odd + text
    tk_ranks = b"".join(b"%s %d\n" % (base64.b64encode(bytes([b])), b) for b in range(256))
    tk_ranks += base64.b64encode(b"ab") + b" 256\n" + base64.b64encode(b"abc") + b" 257\n"
    put("tiktoken", "tiny", b"\x00" + tk_ranks + b"\0" +
        json.dumps({"added_tokens_decoder": {"258": {"content": "[BOS]"}},
                    "bos_token": "[BOS]"}).encode())
    put("tiktoken", "fixture", b"\x02" + open("tests/fixtures/tiktoken/tiktoken.model", "rb").read() +
        b"\0" + open("tests/fixtures/tiktoken/tokenizer_config.json", "rb").read())
    for i, text in enumerate(["Hello, world! It's 1234567 ok", "\u4e2d\u6587\u3002\u300c\u5f15\u300d \U0001F600",
                              "  leading\tand\r\ntrailing  \u3000", "<|im_user|>u<|im_middle|>hi<|im_end|>",
                              "\u212aelvin it'\u017f CamelCaseHTTP", "\u0627\u0644\u0639\u0631\u0628\u064a\u0629 \u0928\u092e\u0938\u094d\u0924\u0947"]):
        put("tiktoken", "text%d" % i, b"\x01" + text.encode())
    put("tiktoken", "bad_utf8", b"\x01\xff\xfe\xc3")
    # Generate requests
    for name, text in {
        "text": 'prompt: "A wise man once said" max_tokens: 16 add_special_tokens: true',
        "ids_sampling": 'prompt_ids { ids: [1, 2, 3] } max_tokens: 8 sampling { temperature: 0.7 '
                        'top_k: 40 top_p: 0.9 min_p: 0.05 repetition_penalty: 1.1 seed: 42 }',
        "stops": 'prompt: "Love is" max_tokens: 32 stop: "\\n" stop: "The end" '
                 'stop_token_ids: [0, 2] ignore_eos: true',
        "bad_ids": 'prompt_ids { ids: [-1, 99999999] } max_tokens: 0',
        "bad_sampling": 'prompt: "x" sampling { temperature: -1 top_p: 0 presence_penalty: 3 }',
        "chat": 'chat { messages { role: "system" content: "Be brief." } '
                'messages { role: "user" content: "Hi" } add_generation_prompt: true '
                'template_kwargs_json: "{\\"enable_thinking\\": false}" } max_tokens: 4',
        "chat_bad_role": 'chat { messages { role: "tool" content: "x" } tools_json: "[" }',
    }.items():
        put("generate_request", name, encode("hmoe.api.v1.GenerateRequest", text, "api.proto"))
    openai_bodies()
    # Expert protocol: even first byte + a MoeRequest; odd + a slot
    hidden = b"\x80\x3f" * 64 * 2
    ids = struct.pack("<8i", 0, 1, 2, 3, 15, 14, -1, 4)
    w = struct.pack("<8f", *([0.25] * 8))

    def moe(name, layer, tokens, top_k, h, i, ww, output=0):
        text = 'request_id: 1 layer: %d tokens: %d top_k: %d output: %d' % (layer, tokens, top_k, output)
        msg = encode("hmoe.expert.v1.MoeRequest", text, "expert.proto")
        # bytes fields appended on the wire (5, 6, 7: length-delimited)
        for field, data in ((5, h), (6, i), (7, ww)):
            msg += bytes([field << 3 | 2]) + varint(len(data)) + data
        put("expert_protocol", name, b"\x00" + msg)

    moe("grpc_ok", 1, 2, 4, hidden, ids, w)
    moe("grpc_bad_layer", 0, 2, 4, hidden, ids, w, 1)
    moe("grpc_short_ids", 2, 2, 4, hidden, ids[:20], w)
    moe("grpc_nan", 2, 2, 4, hidden, ids, struct.pack("<8f", *([float("nan")] * 8)))
    # slot: geometry (u32, 6 x u64), request (3 x i32, 6 x u64), then the region
    region = hidden + ids + w
    geo = struct.pack("<I6Q", 4, 256, 8192, 4096, 4352, 3840, 256 + 4 * 8192)
    req = struct.pack("<3i6Q", 1, 2, 4, 0, len(hidden), len(hidden), len(ids), len(hidden) + len(ids),
                      len(w))
    put("expert_protocol", "slot_ok", b"\x01" + geo + req + region)
    req_bad = struct.pack("<3i6Q", 1, 2, 4, 1, len(hidden), 2 ** 63, 8, 0, 2 ** 64 - 1)
    put("expert_protocol", "slot_bad_ranges", b"\x01" + geo + req_bad + region)
    geo_bad = struct.pack("<I6Q", 0, 8, 100, 2 ** 64 - 1, 3, 2 ** 64 - 1, 64)
    put("expert_protocol", "slot_bad_geometry", b"\x01" + geo_bad + req + region)


def openai_bodies():
    """OpenAI-style request bodies: first byte even = chat, odd = completions."""
    chat = [
        {"model": "fortunes", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4},
        {"messages": [{"role": "developer", "content": "Be brief."},
                      {"role": "user", "content": [{"type": "text", "text": "a"},
                                                   {"type": "text", "text": "b"}]}],
         "stream": True, "stream_options": {"include_usage": True}, "temperature": 0.7,
         "top_p": 0.9, "top_k": 40, "min_p": 0.05, "seed": -3, "stop": ["\n", "User:"],
         "logprobs": True, "top_logprobs": 5, "chat_template_kwargs": {"x": 1}},
        {"messages": [{"role": "tool", "content": None}], "tools": [{"type": "function"}],
         "tool_choice": "auto", "n": 1, "max_completion_tokens": 3},
        {"messages": [], "max_tokens": "3"},
    ]
    comp = [
        {"prompt": "The fortune", "max_tokens": 5, "logprobs": 2, "echo": False},
        {"prompt": [1, 2, 3], "stop_token_ids": [5], "ignore_eos": True},
        {"prompt": [["x"]], "n": 2, "logit_bias": {"1": 2}},
        {"prompt": ["The"], "presence_penalty": 2.5, "frequency_penalty": -2,
         "repetition_penalty": 1.2, "response_format": {"type": "text"}},
    ]
    for i, b in enumerate(chat):
        put("openai_request", "chat%d" % i, b"\x00" + json.dumps(b).encode())
    for i, b in enumerate(comp):
        put("openai_request", "completions%d" % i, b"\x01" + json.dumps(b).encode())
    # Anthropic Messages bodies (mode bit 1), with the qwen3 syntax (bits
    # 2-4 = 3) and reasoning split (bit 5); bit 6: count_tokens.
    messages = [
        {"model": "m", "max_tokens": 8, "system": [{"type": "text", "text": "Hi"}],
         "messages": [{"role": "user", "content": "x"}], "stop_sequences": ["."]},
        {"model": "m", "max_tokens": 8, "tools": [{"name": "f", "input_schema": {}}],
         "tool_choice": {"type": "tool", "name": "f", "disable_parallel_tool_use": True},
         "messages": [{"role": "user", "content": "x"},
                      {"role": "assistant", "content": [
                          {"type": "thinking", "thinking": "t", "signature": ""},
                          {"type": "tool_use", "id": "a", "name": "f", "input": {"k": 1}}]},
                      {"role": "user", "content": [
                          {"type": "tool_result", "tool_use_id": "a", "content": "r"}]}]},
        {"model": "m", "messages": [{"role": "user", "content": [{"type": "image"}]}]},
    ]
    for i, b in enumerate(messages):
        put("openai_request", "messages%d" % i, bytes([2 | (3 << 2) | 32 | (64 if i == 2 else 0)])
            + json.dumps(b).encode())
    # tool_calls: mode byte (syntax = low 3 bits in tool_calls_fuzz.cc's
    # order; 8: starts in reasoning; 16: no reasoning split; 32: tools), a
    # seed byte, then model output in that syntax.
    outputs = [
        (1, "Sure.<\uff5ctool\u2581calls\u2581begin\uff5c><\uff5ctool\u2581call\u2581begin\uff5c>function"
            "<\uff5ctool\u2581sep\uff5c>f\n```json\n{\"s\": 1}\n```<\uff5ctool\u2581call\u2581end\uff5c>"
            "<\uff5ctool\u2581calls\u2581end\uff5c>"),
        (2, "Ok<|tool_calls_section_begin|><|tool_call_begin|>functions.f:0"
            "<|tool_call_argument_begin|>{\"n\": 2}<|tool_call_end|><|tool_calls_section_end|>"),
        (3 | 32, "<think>\nhm\n</think>\n\nx\n<tool_call>\n{\"name\": \"f\", \"arguments\": {}}\n</tool_call>"),
        (4 | 32, "<tool_call>\n<function=f>\n<parameter=s>\na < b\n</parameter>\n</function>\n</tool_call>"),
        (5 | 32, "<tool_call>f\n<arg_key>n</arg_key>\n<arg_value>3</arg_value>\n</tool_call>"),
        (6, "[TOOL_CALLS] [{\"name\": \"f\", \"arguments\": {\"s\": \"x\"}}]"),
        (8, "reasoning first</think>\n\nthen content"),
        (16, "<think>kept</think> as content"),
    ]
    for i, (mode, text) in enumerate(outputs):
        put("tool_calls", "out%d" % i, bytes([mode, 37 + i]) + text.encode())


def varint(n):
    out = b""
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out += bytes([b | 0x80])
        else:
            return out + bytes([b])


if __name__ == "__main__":
    main()
