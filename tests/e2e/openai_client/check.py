"""Drives hmoe-gpu-worker's OpenAI-compatible HTTP API with the official
`openai` client (tests/e2e/http_test.cc runs it; requirements.txt pins it).

    check.py BASE_URL MODEL [API_KEY]

Greedy chat and completions, whole and streamed (with usage), the model
list, and the client's own exceptions for refused requests. Prints one line
per check; exits 1 on the first failure.
"""
import sys

import openai


def main() -> int:
    base, model = sys.argv[1], sys.argv[2]
    key = sys.argv[3] if len(sys.argv) > 3 else "unused"
    c = openai.OpenAI(base_url=base, api_key=key, max_retries=0, timeout=60)

    def check(name, ok, detail=""):
        print(("ok   " if ok else "FAIL ") + name + (": " + detail if detail else ""))
        if not ok:
            sys.exit(1)

    models = c.models.list()
    check("models.list", [m.id for m in models.data] == [model], str([m.id for m in models.data]))

    msgs = [{"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Tell me a fortune"}]
    whole = c.chat.completions.create(model=model, messages=msgs, max_tokens=12, temperature=0)
    text = whole.choices[0].message.content
    check("chat whole", whole.object == "chat.completion" and
          whole.choices[0].message.role == "assistant" and isinstance(text, str) and
          whole.choices[0].finish_reason in ("stop", "length") and
          whole.usage.completion_tokens >= 1 and
          whole.usage.total_tokens == whole.usage.prompt_tokens + whole.usage.completion_tokens,
          repr(text))
    streamed, usage, finish = "", None, None
    for chunk in c.chat.completions.create(model=model, messages=msgs, max_tokens=12,
                                           temperature=0, stream=True,
                                           stream_options={"include_usage": True}):
        if chunk.usage is not None:
            usage = chunk.usage
        for ch in chunk.choices:
            streamed += ch.delta.content or ""
            finish = ch.finish_reason or finish
    check("chat streamed = whole", streamed == text, repr(streamed))
    check("chat streamed usage", usage is not None and
          usage.completion_tokens == whole.usage.completion_tokens and
          finish == whole.choices[0].finish_reason)

    lp = c.chat.completions.create(model=model, messages=msgs, max_tokens=6, temperature=0,
                                   logprobs=True, top_logprobs=2)
    check("chat logprobs", len(lp.choices[0].logprobs.content) == lp.usage.completion_tokens and
          all(len(t.top_logprobs) == 2 and t.logprob <= 0 for t in lp.choices[0].logprobs.content))

    comp = c.completions.create(model=model, prompt="The fortune of", max_tokens=10,
                                temperature=0, seed=7)
    check("completions whole", comp.object == "text_completion" and
          len(comp.choices) == 1 and comp.usage.completion_tokens >= 1,
          repr(comp.choices[0].text))
    streamed = "".join(ch.choices[0].text for ch in c.completions.create(
        model=model, prompt="The fortune of", max_tokens=10, temperature=0, stream=True)
        if ch.choices)
    check("completions streamed = whole", streamed == comp.choices[0].text, repr(streamed))
    sampled = c.completions.create(model=model, prompt="The fortune of", max_tokens=10,
                                   temperature=0.9, top_p=0.9, seed=11,
                                   extra_body={"top_k": 40, "min_p": 0.05,
                                               "repetition_penalty": 1.1},
                                   presence_penalty=0.5, frequency_penalty=0.5, stop=["\n"])
    again = c.completions.create(model=model, prompt="The fortune of", max_tokens=10,
                                 temperature=0.9, top_p=0.9, seed=11,
                                 extra_body={"top_k": 40, "min_p": 0.05,
                                             "repetition_penalty": 1.1},
                                 presence_penalty=0.5, frequency_penalty=0.5, stop=["\n"])
    check("seeded sampling repeats", sampled.choices[0].text == again.choices[0].text and
          "\n" not in sampled.choices[0].text, repr(sampled.choices[0].text))

    try:
        c.completions.create(model="gpt-4o", prompt="x", max_tokens=2)
        check("unknown model refused", False)
    except openai.NotFoundError as e:
        check("unknown model -> NotFoundError", e.status_code == 404)
    try:
        c.chat.completions.create(model=model, messages=msgs, max_tokens=2, n=2)
        check("n=2 refused", False)
    except openai.BadRequestError as e:
        check("n=2 -> BadRequestError naming n", e.status_code == 400 and
              e.body.get("param") == "n", str(e.body))
    if key != "unused":
        bad = openai.OpenAI(base_url=base, api_key="wrong", max_retries=0, timeout=30)
        try:
            bad.models.list()
            check("a wrong key refused", False)
        except openai.AuthenticationError as e:
            check("a wrong key -> AuthenticationError", e.status_code == 401)
    return 0


if __name__ == "__main__":
    sys.exit(main())
