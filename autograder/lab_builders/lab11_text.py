"""Lab 11, section 3: from token ids to text a client reads. Problem 2 (incremental detokenization
with stop strings) and Problem 3 (a completion streamed as server-sent events)."""
from autograder.authoring import code, md, solution, tests

# Hidden reference for Problem 2: what a correct stream has sent after each token, from the text so
# far alone (independent of how the student keeps state).
HIDDEN_TEXT_REF = r'''
import random as _random
def _safe_prefix(text, stops, before):
    # the most a stream may have sent once the text so far is `text` (it had sent `before` characters)
    hits = [i for s in stops if (i := text.find(s)) >= 0]
    if hits:
        return min(hits), True
    if text.endswith("\ufffd"):
        return before, False
    hold = max((k for s in stops for k in range(1, len(s)) if text.endswith(s[:k])), default=0)
    return max(before, len(text) - hold), False
def _bytes_decoder(pieces):
    return lambda ids: b"".join(pieces[i] for i in ids).decode("utf-8", errors="replace")
'''.strip("\n")

cells = [
md(r"""
## 3. From tokens to text

A client asked for text, and the engine makes token ids. Two things make the translation harder than
`tokenizer.decode([token])` per token.

**A token is not a piece of text.** SmolLM2's tokenizer, like GPT-2's, works on **bytes**: a
character that takes several bytes in UTF-8 (an accented letter, a Chinese character, an emoji) can
be cut across tokens, and a token holding half a character decodes to the replacement character
`"\ufffd"`. Look:
"""),
code(r'''
ids = encode("Crème brûlée 😀 日本")
print(ids)
print("one token at a time:", [decode([t]) for t in ids])
print("all together:       ", repr(decode(ids)))
'''),
md(r"""
So a stream decodes **all** the ids so far and sends only the characters it has not sent yet, and
while the text ends in `"\ufffd"` (a character still incomplete) it sends nothing and waits for the
next token. (vLLM's detokenizer does the same with a window of recent ids, so the work per token stays
small; our answers are short, so we decode everything.)

**Stop strings.** A request may say `"stop": ["\n\n", "User:"]`: the answer ends right **before** the
first stop string, which the client never sees, not even a part of it. But a stop string can arrive
cut across tokens: the text `...Use` may become `...User:` one token later, or `...Used`. So the stream
**holds back** any tail of the text that could still grow into a stop string, and sends it once it
cannot (or finds the stop string and sends what comes before it).

```
stop = ["User:"]
token      text so far            sent now
" Hi"      " Hi"                  " Hi"
" there"   " Hi there"            " there"
"."        " Hi there."           "."
" Use"     " Hi there. Use"       " "        "Use" may be the start of "User:": held back
"r:"       " Hi there. User:"     ""         the stop string: stopped, "Use" is never sent
```

## Problem 2: Incremental detokenization with stop strings (3 points)

**Deliverable:** the methods `push` and `flush` of `TextStream` (its state is given):
- `push(token)` adds one token id and returns the text to send now, possibly `""`, from the text so
  far, `self.decode(self.ids)`, past the `self.sent` characters already sent:
  - if a stop string occurs in it, everything up to (not including) the earliest occurrence of any
    stop string, and set `self.stopped = True` (from then on `push` returns `""`);
  - else, if it ends in `"\ufffd"` (an incomplete character), nothing yet;
  - else everything but the longest tail that is the start of some stop string (held back).
- `flush()`, at the end of a generation that was not stopped: everything not sent yet (a held-back
  tail was not a stop string after all). After a stop it returns `""`.

Keep `self.sent` (characters sent) up to date: the whole stream is the concatenation of what `push`
and `flush` returned.
"""),
solution("text_stream", r'''
class TextStream:
    """Token ids in, one at a time; text that is safe to send out."""

    def __init__(self, decode: Callable[[list[int]], str], stop: Sequence[str] = ()):
        self.decode = decode                   # ids -> text (the tokenizer's decode)
        self.stop = [s for s in stop if s]     # stop strings
        self.ids: list[int] = []               # every token so far
        self.sent = 0                          # characters of the text already sent
        self.stopped = False                   # a stop string was found

    def push(self, token: int) -> str:
        """Add a token; return the new text to send now (possibly "")."""
        ### BEGIN SOLUTION
        if self.stopped:
            return ""
        self.ids.append(token)
        text = self.decode(self.ids)
        hits = [i for s in self.stop if (i := text.find(s, max(0, self.sent - len(s) + 1))) >= 0]
        if hits:
            self.stopped = True
            end = min(hits)                               # the text ends right before the first stop string
        elif text.endswith("\ufffd"):
            return ""                                     # half a character: wait for the rest
        else:
            hold = max((k for s in self.stop for k in range(1, len(s)) if text.endswith(s[:k])), default=0)
            end = len(text) - hold
        out = text[self.sent:end]
        self.sent = max(self.sent, end)
        return out
        ### END SOLUTION

    def flush(self) -> str:
        """At the end (no stop string found): the text still held back."""
        ### BEGIN SOLUTION
        if self.stopped:
            return ""
        text = self.decode(self.ids)
        out = text[self.sent:]
        self.sent = len(text)
        return out
        ### END SOLUTION
'''),
code(r'''
def show(text: str, stop: list[str]) -> None:
    ts = TextStream(decode, stop)
    pieces = [ts.push(t) for t in encode(text)] + [ts.flush()]
    print(f"stop={stop}: {pieces} -> {''.join(pieces)!r}")

show("Crème brûlée 😀 日本", [])
show("Question: why? Answer: because.\nUser: next", ["User:"])
show("Bye now. Used cars are cheap.", ["User:"])
'''),
tests("text_stream_tests", 3, r"""
PIECES = {1: b"Hel", 2: b"lo", 3: b" w", 4: b"orld", 5: "😀".encode()[:2], 6: "😀".encode()[2:], 7: b" E", 8: b"ND", 9: b"!"}
fake_decode = lambda ids: b"".join(PIECES[i] for i in ids).decode("utf-8", errors="replace")
def pushes(tokens, stop=()):
    ts = TextStream(fake_decode, stop)
    out = [expect_type(ts.push(t), f"push({t})", str) for t in tokens]
    return ts, out, expect_type(ts.flush(), "flush()", str)
ts, out, tail = pushes([1, 2, 3, 4])
assert out == ["Hel", "lo", " w", "orld"] and tail == "", f"no stop strings, whole characters: send each token's text at once, got {out}"
ts, out, tail = pushes([1, 5, 6, 9])
assert out == ["Hel", "", "😀", "!"], f"half an emoji decodes to '\\ufffd': send nothing until it is whole, got {out}"
ts, out, tail = pushes([1, 2, 7, 8, 9], stop=[" END"])
assert out == ["Hel", "lo", "", "", ""] and tail == "", f"' E' may start ' END': hold it; then stop before ' END', got {out}"
assert expect_bool(ts.stopped, "stopped") is True, "a stop string was found: stopped must be True"
ts, out, tail = pushes([1, 2, 7, 9], stop=[" END"])
assert out == ["Hel", "lo", "", " E!"] and tail == "", f"' E!' cannot become ' END' any more: send the held ' E' too, got {out}"
ts, out, tail = pushes([1, 2, 7], stop=[" END"])
assert out == ["Hel", "lo", ""] and tail == " E", "at the end, flush sends what was held back"
ts, out, tail = pushes([1, 2, 3, 4], stop=["lo w"])
assert "".join(out) + tail == "Hel", f"the stop string may span tokens; the text ends right before it, got {''.join(out) + tail!r}"
### BEGIN HIDDEN TESTS
""" + HIDDEN_TEXT_REF + r"""
# random byte pieces (some split multi-byte characters), random stop strings: after every push, exactly
# the safe prefix has been sent; the concatenation is the text up to the first stop string
rng = _random.Random(0)
alphabet = "ab c\nxé😀"
for trial in range(300):
    text = "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 25)))
    data = text.encode()
    cuts = sorted(rng.sample(range(1, len(data)), min(len(data) - 1, rng.randint(0, 8)))) if len(data) > 1 else []
    pieces, last = {}, 0
    for i, c in enumerate(cuts + [len(data)]):
        pieces[i] = data[last:c]
        last = c
    stops = [] if trial % 4 == 0 else ["".join(rng.choice("ab c\n") for _ in range(rng.randint(1, 3))) for _ in range(rng.randint(1, 3))]
    dec = _bytes_decoder(pieces)
    ts = TextStream(dec, stops)
    sent, stopped = "", False
    for n in range(1, len(pieces) + 1):
        piece = expect_type(ts.push(n - 1), "push", str)
        sent += piece
        want, hit = _safe_prefix(dec(list(range(n))), stops, len(sent) - len(piece)) if not stopped else (len(sent), True)
        assert sent == dec(list(range(n)))[:want], \
            (f"stops {stops}: after {n} tokens of {text!r}, sent {sent!r}: send all the text that cannot become a stop string any "
             "more, hold back only a tail that may still start one, and never half a character ('\\ufffd')")
        stopped = stopped or hit
        assert expect_bool(ts.stopped, "stopped") == stopped, f"stops {stops}, text {text!r}: stopped must say whether a stop string appeared"
    sent += expect_type(ts.flush(), "flush", str)
    full = dec(list(range(len(pieces))))
    hits = [i for s in stops if (i := full.find(s)) >= 0]
    assert sent == full[:min(hits)] if hits else sent == full, f"stops {stops}: the stream of {text!r} must be {full!r} cut before the first stop"
    assert ts.push(0) == "" or not hits, "after a stop, push returns ''"
# a stop string inside one token; several stop strings (the earliest wins); a held tail released by a later token
one = {0: b"abcSTOPdef"}
ts = TextStream(_bytes_decoder(one), ["STOP"])
assert ts.push(0) == "abc" and ts.stopped and ts.flush() == "", "a stop string inside one token: send what comes before it, then stop"
two = {0: b"xx", 1: b"yz", 2: b"w"}
ts = TextStream(_bytes_decoder(two), ["yzw", "xy"])
assert ts.push(0) == "x" and ts.push(1) == "" and ts.stopped, "'xy' occurs first: the text ends at 'x'"
ts = TextStream(_bytes_decoder({0: b"a", 1: b"b", 2: b"c"}), ["abd"])
assert [ts.push(0), ts.push(1), ts.push(2)] == ["", "", "abc"], "'abc' can no longer become 'abd': send it all"
ts = TextStream(_bytes_decoder({0: "é".encode()[:1], 1: "é".encode()[1:] + b"x"}), [])
assert [ts.push(0), ts.push(1)] == ["", "éx"] and ts.sent == 2, "sent counts characters"
### END HIDDEN TESTS
"""),
md(r"""
### Server-sent events

How do the pieces reach the client? OpenAI's API (and so vLLM's, and ours) streams with
**server-sent events** (SSE): one HTTP response whose body never seems to end, media type
`text/event-stream`, made of events. Each event is a line `data: <payload>` followed by an empty
line; the payload is a JSON **chunk**, and the stream ends with the event `data: [DONE]`:

```
data: {"id": "cmpl-req-7", "object": "text_completion", "created": 1750000000, "model": "SmolLM2-135M-Instruct",
       "choices": [{"index": 0, "text": " Paris", "logprobs": null, "finish_reason": null}]}

data: {... "choices": [{"index": 0, "text": ".", "logprobs": null, "finish_reason": null}]}

data: {... "choices": [{"index": 0, "text": "", "logprobs": null, "finish_reason": "length"}]}

data: {... "choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7}}

data: [DONE]
```

(One event per line in the real stream; the JSON is split here to fit.) The last chunk with a choice
carries the **finish reason**: `"length"` (max_tokens reached), or `"stop"` (the model's end-of-text
token, or a stop string). With `"stream_options": {"include_usage": true}`, a chunk with an empty
`choices` list and the token counts follows. Why not WebSockets? SSE is plain HTTP: proxies, load
balancers and `curl` handle it, and the data flows one way, which is all a completion needs.

## Problem 3: A completion as server-sent events (3 points)

**Deliverable:** `completion_events(outputs, text, meta, include_usage=False)`, an async generator of
`str` events, each `"data: " + json.dumps(payload) + "\n\n"`:
- for every `StepOutput` from the async generator `outputs`: push its token into `text` (a
  `TextStream`) and, if that returns text, yield a chunk with it and `"finish_reason": None`;
- stop reading when the output is `finished` or `text.stopped`, and close `outputs` when you stop
  (`await outputs.aclose()`: after a stop string the request is not finished in the engine, and
  closing its stream aborts it);
- then yield one last chunk with `text.flush()` as its text (maybe `""`) and the finish reason:
  `"stop"` if a stop string was found, else the last output's `finish_reason`;
- with `include_usage`, a chunk with `"choices": []` and `"usage"`: `prompt_tokens` from `meta`,
  `completion_tokens` the number of outputs read, and `total_tokens` their sum;
- finally `"data: [DONE]\n\n"`.

Every chunk is `{"id": meta["id"], "object": "text_completion", "created": meta["created"],
"model": meta["model"], "choices": [{"index": 0, "text": ..., "logprobs": None, "finish_reason": ...}]}`.
"""),
solution("sse_events", r'''
async def completion_events(outputs, text: TextStream, meta: dict, include_usage: bool = False):
    """SSE events of one streamed completion. meta: {"id", "created", "model", "prompt_tokens"}."""
    ### BEGIN SOLUTION
    def event(payload) -> str:
        return f"data: {json.dumps(payload)}\n\n"

    def chunk(piece: str, finish: str | None) -> dict:
        return {"id": meta["id"], "object": "text_completion", "created": meta["created"], "model": meta["model"],
                "choices": [{"index": 0, "text": piece, "logprobs": None, "finish_reason": finish}]}

    n, finish = 0, None
    try:
        async for out in outputs:
            n += 1
            piece = text.push(out.token)
            if piece:
                yield event(chunk(piece, None))
            if text.stopped or out.finished:
                finish = "stop" if text.stopped else out.finish_reason
                break
    finally:
        await outputs.aclose()                             # after a stop string, this aborts the request
    yield event(chunk(text.flush(), finish))
    if include_usage:
        usage = {"prompt_tokens": meta["prompt_tokens"], "completion_tokens": n,
                 "total_tokens": meta["prompt_tokens"] + n}
        yield event({"id": meta["id"], "object": "text_completion", "created": meta["created"],
                     "model": meta["model"], "choices": [], "usage": usage})
    yield "data: [DONE]\n\n"
    ### END SOLUTION
'''),
code(r'''
async def fake_outputs(tokens, finish="length"):
    for i, t in enumerate(tokens):
        yield StepOutput("r", t, i, finish if i == len(tokens) - 1 else None)

meta = {"id": "cmpl-demo", "created": 0, "model": MODEL_NAME, "prompt_tokens": 3}
ids = encode(" The answer is 42. User: thanks")
events = [e async for e in completion_events(fake_outputs(ids), TextStream(decode, ["User:"]), meta, include_usage=True)]
print("".join(events))
'''),
tests("sse_events_tests", 3, r"""
class Pieces:                                   # a given text stream: token t -> str(t), token 0 = a stop string
    def __init__(self):
        self.stopped, self.held = False, ""
    def push(self, t):
        if t == 0:
            self.stopped = True
            return ""
        if t < 0:                               # a negative token is held back (like half a character)
            self.held += "?"
            return ""
        return str(t)
    def flush(self):
        return "" if self.stopped else self.held
async def outputs_of(tokens, finish, log):
    try:
        for i, t in enumerate(tokens):
            yield StepOutput("r", t, i, finish if i == len(tokens) - 1 else None)
            log.append(i)
    finally:
        log.append("closed")
async def events_of(tokens, finish, include_usage=False):
    log = []
    evs = [e async for e in completion_events(outputs_of(tokens, finish, log), Pieces(), meta, include_usage)]
    return evs, list(log)                       # as it was when the events ended
meta = {"id": "cmpl-7", "created": 123, "model": "m", "prompt_tokens": 5}
evs, log = run(events_of([11, 12], "length"))
expect_type(evs, "the events", list)
for e in evs:
    expect_type(e, "an event", str)
    assert e.startswith("data: ") and e.endswith("\n\n") and "\n" not in e[:-2], f"an event is 'data: <payload>' and an empty line, got {e!r}"
assert evs[-1] == "data: [DONE]\n\n", f"the stream ends with 'data: [DONE]\\n\\n', got {evs[-1]!r}"
chunks = [json.loads(e[6:]) for e in evs[:-1]]
assert [c["choices"][0]["text"] for c in chunks] == ["11", "12", ""], f"a chunk per piece of text, then the last chunk: {chunks}"
assert [c["choices"][0]["finish_reason"] for c in chunks] == [None, None, "length"], "only the last chunk has the finish reason"
assert chunks[0] == {"id": "cmpl-7", "object": "text_completion", "created": 123, "model": "m",
                     "choices": [{"index": 0, "text": "11", "logprobs": None, "finish_reason": None}]}, f"chunk fields: {chunks[0]}"
evs, log = run(events_of([11, 0, 13], "length"))
chunks = [json.loads(e[6:]) for e in evs[:-1]]
assert [c["choices"][0]["finish_reason"] for c in chunks] == [None, "stop"], "a stop string: the last chunk says 'stop'"
assert log[-1] == "closed" and 2 not in log, "after a stop string, read no more and close the outputs (aclose)"
### BEGIN HIDDEN TESTS
def _parse(evs):
    for e in evs:
        expect_type(e, "an event", str)
        assert e.startswith("data: ") and e.endswith("\n\n") and e.count("\n") == 2, f"malformed event {e!r}"
    assert evs[-1] == "data: [DONE]\n\n" and "[DONE]" not in "".join(evs[:-1]), "[DONE] once, as the last event"
    return [json.loads(e[6:]) for e in evs[:-1]]
for tokens, finish, usage_on in (([5], "length", True), ([3, -1, -1, 4], "length", False), ([7, 8, 9], "stop", True),
                                 ([-1, -1], "length", True), ([1, 2, 0], "length", True), ([0], "length", False)):
    evs, log = run(events_of(tokens, finish, usage_on))
    chunks = _parse(evs)
    stop_at = tokens.index(0) if 0 in tokens else None
    read = tokens if stop_at is None else tokens[:stop_at + 1]
    texts = [str(t) for t in read if t > 0]
    held = "" if stop_at is not None else "?" * sum(t < 0 for t in read)
    body = chunks[:-1] if usage_on else chunks
    assert [c["choices"][0]["text"] for c in body] == texts + [held], f"tokens {tokens}: texts {[c['choices'][0]['text'] for c in body]}"
    assert [c["choices"][0]["finish_reason"] for c in body] == [None] * len(texts) + ["stop" if stop_at is not None else finish], \
        f"tokens {tokens}: finish reasons"
    for c in body:
        assert c["id"] == "cmpl-7" and c["object"] == "text_completion" and c["created"] == 123 and c["model"] == "m", \
            f"every chunk carries id, object, created and model from meta: {c}"
        assert c["choices"][0]["index"] == 0 and c["choices"][0]["logprobs"] is None and len(c["choices"]) == 1, \
            f"one choice, index 0, logprobs None: {c}"
    if usage_on:
        u = chunks[-1]
        assert u["choices"] == [] and u["usage"] == {"prompt_tokens": 5, "completion_tokens": len(read), "total_tokens": 5 + len(read)}, \
            f"tokens {tokens}: the usage chunk counts every output read, got {u}"
        assert u["id"] == "cmpl-7" and u["model"] == "m", "the usage chunk carries id and model too"
    else:
        assert all(c["choices"] for c in chunks), "no usage chunk unless include_usage"
    assert log[-1] == "closed", "close the outputs generator when you stop reading it (await outputs.aclose())"
    if stop_at is not None:
        assert stop_at not in log, "after a stop string the next output is never read"
### END HIDDEN TESTS
"""),
]
