"""Drives hmoe-gpu-worker's Anthropic Messages API with the official
`anthropic` client (tests/e2e/http_test.cc runs it; requirements.txt pins it).

    check.py BASE_URL API_KEY

Greedy messages whole and streamed (the SDK's own event accumulation), a
tool-use round trip in the history, count_tokens, a stop sequence, and the
client's own exceptions for refused requests. Prints one line per check;
exits 1 on the first failure.
"""
import sys

import anthropic

# The 2026 SDK has no sampling parameters; the server still takes them (as
# Anthropic's API did): greedy, so that whole and streamed agree.
GREEDY = {"temperature": 0}


def main() -> int:
    base, key = sys.argv[1], sys.argv[2]
    c = anthropic.Anthropic(base_url=base, api_key=key, max_retries=0, timeout=60)

    def check(name, ok, detail=""):
        print(("ok   " if ok else "FAIL ") + name + (": " + detail if detail else ""))
        if not ok:
            sys.exit(1)

    msgs = [{"role": "user", "content": "Tell me a fortune"}]
    whole = c.messages.create(model="any-model", max_tokens=12, extra_body=GREEDY,
                              system="Be brief.", messages=msgs)
    text = "".join(b.text for b in whole.content if b.type == "text")
    check("messages whole", whole.type == "message" and whole.role == "assistant" and
          whole.stop_reason in ("end_turn", "max_tokens") and whole.usage.output_tokens >= 1 and
          whole.usage.input_tokens >= 1 and len(text) > 0, repr(whole))

    with c.messages.stream(model="any-model", max_tokens=12, extra_body=GREEDY, system="Be brief.",
                           messages=msgs) as s:
        streamed = "".join(s.text_stream)
        final = s.get_final_message()
    check("messages streamed", streamed == text and final.stop_reason == whole.stop_reason and
          final.usage.output_tokens == whole.usage.output_tokens, repr((streamed, text)))

    n = c.messages.count_tokens(model="any-model", system="Be brief.", messages=msgs)
    check("count_tokens", n.input_tokens == whole.usage.input_tokens,
          "%d vs %d" % (n.input_tokens, whole.usage.input_tokens))

    tools = [{"name": "get_weather", "description": "Current weather in a city.",
              "input_schema": {"type": "object", "properties": {"city": {"type": "string"}},
                               "required": ["city"]}}]
    history = msgs + [
        {"role": "assistant", "content": [
            {"type": "text", "text": "Let me check."},
            {"type": "tool_use", "id": "toolu_01", "name": "get_weather",
             "input": {"city": "Paris"}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_01", "content": "21 C and sunny"}]}]
    after = c.messages.create(model="any-model", max_tokens=8, extra_body=GREEDY, tools=tools,
                              messages=history)
    check("tool round trip", after.type == "message" and len(after.content) >= 1 and
          after.stop_reason in ("end_turn", "max_tokens", "tool_use"), repr(after))

    words = text.split()
    if len(words) >= 2:
        stop = words[1]
        cut = c.messages.create(model="any-model", max_tokens=12, extra_body=GREEDY,
                                system="Be brief.", messages=msgs, stop_sequences=[stop])
        check("stop sequence", cut.stop_reason == "stop_sequence" and cut.stop_sequence == stop,
              repr(cut))

    try:
        c.messages.create(model="any-model", max_tokens=4, messages=[
            {"role": "user", "content": [{"type": "image", "source": {
                "type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}]}])
        check("an image is refused", False)
    except anthropic.BadRequestError as e:
        check("an image -> BadRequestError", e.status_code == 400 and "image" in str(e), str(e))

    bad = anthropic.Anthropic(base_url=base, api_key="wrong-key", max_retries=0, timeout=60)
    try:
        bad.messages.create(model="any-model", max_tokens=4, messages=msgs)
        check("a wrong key is refused", False)
    except anthropic.AuthenticationError as e:
        check("a wrong key -> AuthenticationError", e.status_code == 401, str(e))
    return 0


if __name__ == "__main__":
    sys.exit(main())
