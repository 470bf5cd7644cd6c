"""From the engine's token ids to the text a client reads, as server-sent events (SSE).

Two problems sit between a token stream and a text stream:

- A token is not a piece of text. Byte-level BPE cuts characters that take several bytes in UTF-8
  (an emoji, most non-Latin letters) across tokens, and one such token alone decodes to "\\ufffd".
  `TextStream` decodes all the ids so far and sends only what is new, holding back while the text
  ends in an incomplete character.
- Stop strings. The text must end right before the first stop string, and a client must never see
  part of one: so the stream also holds back any tail that could still grow into a stop string.

SSE framing (the `text/event-stream` media type): every event is one `data: <json>` line followed
by an empty line; OpenAI's streams end with the event `data: [DONE]`.

    data: {"id": "cmpl-1", "object": "text_completion", "choices": [{"index": 0, "text": " Paris", ...}], ...}
    <empty line>
    ...
    data: [DONE]
    <empty line>
"""
from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable, Sequence

from course.serve.engine import StepOutput

REPLACEMENT = "\ufffd"      # what a decoder writes for bytes that are not (yet) a whole character


class TextStream:
    """Turns token ids, one at a time, into new text that is safe to send."""

    def __init__(self, decode: Callable[[list[int]], str], stop: Sequence[str] = ()):
        self.decode, self.stop = decode, [s for s in stop if s]
        self.ids: list[int] = []
        self.text = ""              # the text of every id so far
        self.sent = 0               # characters of `text` already sent
        self.stopped = False        # a stop string was found: nothing more will be sent

    def push(self, token: int) -> str:
        """Add one token; return the text to send now (often "", never part of a stop string)."""
        if self.stopped:
            return ""
        self.ids.append(token)
        self.text = self.decode(self.ids)
        hits = [i for s in self.stop if (i := self.text.find(s, max(0, self.sent - len(s) + 1))) >= 0]
        if hits:
            self.stopped = True
            return self._send(min(hits))
        if self.text.endswith(REPLACEMENT):
            return ""                                          # wait for the rest of the character
        hold = max((k for s in self.stop for k in range(1, len(s)) if self.text.endswith(s[:k])), default=0)
        return self._send(max(self.sent, len(self.text) - hold))

    def flush(self) -> str:
        """At the end of the generation: whatever was held back (nothing after a stop string)."""
        return "" if self.stopped else self._send(len(self.text))

    def _send(self, end: int) -> str:
        out, self.sent = self.text[self.sent:end], max(self.sent, end)
        return out


def sse(data: dict | str) -> str:
    """One server-sent event: `data: <json>` and an empty line (a str such as "[DONE]" as it is)."""
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n"


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


async def completion_events(outputs: AsyncIterator[StepOutput], text: TextStream, meta: dict,
                            include_usage: bool = False, chat: bool = False) -> AsyncIterator[str]:
    """SSE events of one streamed completion: a chunk per piece of new text, a last chunk with the
    finish reason (and any text held back), an optional usage chunk, then [DONE].
    meta: {"id", "created", "model", "prompt_tokens"}."""
    head = {"id": meta["id"], "object": "chat.completion.chunk" if chat else "text_completion",
            "created": meta["created"], "model": meta["model"]}

    def chunk(delta: str, finish: str | None, first: bool = False) -> dict:
        if chat:
            choice = {"index": 0, "delta": ({"role": "assistant"} if first else {}) | ({"content": delta} if delta else {}),
                      "logprobs": None, "finish_reason": finish}
        else:
            choice = {"index": 0, "text": delta, "logprobs": None, "finish_reason": finish}
        return head | {"choices": [choice]}

    n, finish = 0, None
    if chat:
        yield sse(chunk("", None, first=True))
    try:
        async for out in outputs:
            n += 1
            delta = text.push(out.token)
            if delta:
                yield sse(chunk(delta, None))
            if text.stopped or out.finished:
                finish = "stop" if text.stopped else out.finish_reason
                break
    finally:
        await outputs.aclose()                              # a stop string ends the request: the engine aborts it
    yield sse(chunk(text.flush(), finish or "stop"))
    if include_usage:
        yield sse(head | {"choices": [], "usage": usage(meta["prompt_tokens"], n)})
    yield sse("[DONE]")


async def collect(outputs: AsyncIterator[StepOutput], text: TextStream) -> tuple[str, str, int]:
    """A whole (non-streamed) completion: (text, finish_reason, completion tokens)."""
    pieces, n, finish = [], 0, "stop"
    try:
        async for out in outputs:
            n += 1
            pieces.append(text.push(out.token))
            if text.stopped or out.finished:
                finish = "stop" if text.stopped else out.finish_reason
                break
    finally:
        await outputs.aclose()
    return "".join(pieces) + text.flush(), finish, n
