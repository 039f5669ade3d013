#!/usr/bin/env python3
"""The Python side of hmoe-bench-tokenizer: the `tiktoken` package encoding a
corpus with a model directory's tiktoken.model + tokenizer_config.json as
Kimi's tokenization_kimi.py does (its pattern, its special ids, its encode():
400,000 / 25,000 code-point cuts, allowed_special="all"). Prints one JSON line:

  {"tiktoken": VERSION, "docs": {"tokens": N, "seconds": S, "passes": P, "fnv1a64": H},
   "whole": {...}, "docs_raw": {...}, "whole_raw": {...}}

"docs" encodes each document (corpus split at lines holding only "%") on its
own, "whole" the file as one text; the _raw ones call Encoding.encode
(allowed_special="all") alone, without tokenization_kimi.py's cuts (the
Python loop over every character that finds runs); passes repeat until --seconds have passed;
tokens and fnv1a64 (FNV-1a 64 of the ids as little-endian int32) are one
pass's. Needs the packages of tests/fixtures/make_tiktoken_fixture_requirements.txt.

    python3 bench/tiktoken_bench.py --model-dir DIR --corpus FILE [--seconds 2]
"""
import argparse
import json
import os
import time

import tiktoken
from tiktoken.load import load_tiktoken_bpe

KIMI_PAT = "|".join([
    r"""[\p{Han}]+""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""\p{N}{1,3}""",
    r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",
    r"""\s*[\r\n]+""",
    r"""\s+(?!\S)""",
    r"""\s+""",
])


def kimi_split(text, max_run):
    if not text:
        yield text
        return
    start, run, is_space = 0, 0, text[0].isspace()
    for i, ch in enumerate(text):
        now = ch.isspace()
        if now != is_space:
            run, is_space = 1, now
        else:
            run += 1
            if run > max_run:
                yield text[start:i]
                start, run = i, 1
    yield text[start:]


def kimi_encode(enc, text):
    out = []
    for i in range(0, len(text), 400_000):
        for piece in kimi_split(text[i:i + 400_000], 25_000):
            out.extend(enc.encode(piece, allowed_special="all"))
    return out


def fnv1a64(ids):
    h = 0xcbf29ce484222325
    for i in ids:
        for byte in int(i).to_bytes(4, "little", signed=True):
            h = ((h ^ byte) * 0x100000001b3) & 0xffffffffffffffff
    return f"{h:016x}"


def measure(enc, texts, seconds, encode):
    ids = [t for text in texts for t in encode(enc, text)]
    passes, start = 0, time.perf_counter()
    while True:
        for text in texts:
            encode(enc, text)
        passes += 1
        elapsed = time.perf_counter() - start
        if elapsed >= seconds:
            break
    return {"tokens": len(ids), "seconds": elapsed, "passes": passes, "fnv1a64": fnv1a64(ids)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model-dir", required=True)
    ap.add_argument("--corpus", required=True)
    ap.add_argument("--seconds", type=float, default=2.0)
    a = ap.parse_args()
    ranks = load_tiktoken_bpe(os.path.join(a.model_dir, "tiktoken.model"))
    config = json.load(open(os.path.join(a.model_dir, "tokenizer_config.json"), encoding="utf-8"))
    n = len(ranks)
    names = {int(k): v["content"] for k, v in config.get("added_tokens_decoder", {}).items()}
    specials = {names.get(i, f"<|reserved_token_{i}|>"): i for i in range(n, n + 256)}
    enc = tiktoken.Encoding(name="bench", pat_str=KIMI_PAT, mergeable_ranks=ranks,
                            special_tokens=specials)
    text = open(a.corpus, encoding="utf-8").read()
    docs = text.split("\n%\n")
    def raw(enc, text):
        return enc.encode(text, allowed_special="all")

    print(json.dumps({"tiktoken": tiktoken.__version__,
                      "docs": measure(enc, docs, a.seconds, kimi_encode),
                      "whole": measure(enc, [text], a.seconds, kimi_encode),
                      "docs_raw": measure(enc, docs, a.seconds, raw),
                      "whole_raw": measure(enc, [text], a.seconds, raw)}))


if __name__ == "__main__":
    main()
