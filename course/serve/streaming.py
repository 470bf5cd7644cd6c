"""From the engine's token ids to the text a client reads, as server-sent events (SSE).

Two problems sit between a token stream and a text stream:

- A token is not a piece of text. Byte-level BPE cuts characters that take several bytes in UTF-8
  (an emoji, most non-Latin letters) across tokens, and one such token alone decodes to "\\ufffd".
  Decoding all the ids so far at every token would be correct but costs more per token as the text
  grows. `TextStream` decodes a small window instead, as vLLM's detokenizer does: the ids from
  `prefix_offset` on, and the same window without the ids not yet turned into text (from
  `read_offset` on); the new text is the difference. The prefix gives the decoder its context (a
  tokenizer may write a token differently at the start of a text); the window stays a few ids long,
  so a token's cost does not grow with the text. While the window's text ends in an incomplete
  character it waits for the next token.
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
        self.prefix_offset = 0      # ids[prefix_offset:read_offset]: context whose text was produced already
        self.read_offset = 0        # the ids from here on have not produced their text yet
        self.pending = ""           # text produced but not sent: a tail that may start a stop string
        self.sent = 0               # characters sent
        self.stopped = False        # a stop string was found: nothing more will be sent
        self.decoded_ids = 0        # ids passed to decode so far (the detokenizer's work)

    def push(self, token: int) -> str:
        """Add one token; return the text to send now (often "", never part of a stop string)."""
        if self.stopped:
            return ""
        self.ids.append(token)
        return self._release(self._new_text(final=False), final=False)

    def flush(self) -> str:
        """At the end of the generation: whatever was held back (nothing after a stop string)."""
        return "" if self.stopped else self._release(self._new_text(final=True), final=True)

    def _decode(self, ids: list[int]) -> str:
        self.decoded_ids += len(ids)
        return self.decode(ids) if ids else ""

    def _new_text(self, final: bool) -> str:
        """The text the ids since read_offset add (vLLM's offsets), "" while a character is incomplete."""
        if self.read_offset == len(self.ids):
            return ""
        prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
        text = self._decode(self.ids[self.prefix_offset:])
        if not final and (len(text) <= len(prefix) or text.endswith(REPLACEMENT)):
            return ""
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        return text[len(prefix):]

    def _release(self, new: str, final: bool) -> str:
        """Add new text to the pending tail and send what can no longer start a stop string."""
        self.pending += new
        hits = [i for s in self.stop if (i := self.pending.find(s)) >= 0]
        if hits:
            self.stopped = True
            end = min(hits)
        elif final:
            end = len(self.pending)
        else:
            hold = max((k for s in self.stop for k in range(1, len(s)) if self.pending.endswith(s[:k])), default=0)
            end = len(self.pending) - hold
        out, self.pending = self.pending[:end], "" if self.stopped else self.pending[end:]
        self.sent += len(out)
        return out


async def deltas(outputs: AsyncIterator[StepOutput], text: TextStream) -> AsyncIterator[tuple[str, list, str | None]]:
    """(new text, the outputs read since the last delta, None) while text comes, then one last delta whose
    finish reason is set: "stop" for a stop string, else the engine's. Closes `outputs` when it ends
    (after a stop string the engine has not finished the request: closing its stream aborts it)."""
    read, finish, tail = [], None, ""
    try:
        async for out in outputs:
            read.append(out)
            piece = text.push(out.token)
            if text.stopped or out.finished:
                finish, tail = ("stop" if text.stopped else out.finish_reason), piece
                break
            if piece:
                yield piece, read, None
                read = []
    finally:
        await outputs.aclose()
    yield tail + text.flush(), read, finish or "stop"


def sse(data: dict | str) -> str:
    """One server-sent event: `data: <json>` and an empty line (a str such as "[DONE]" as it is)."""
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n"


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


async def completion_events(outputs: AsyncIterator[StepOutput], text: TextStream, meta: dict,
                            include_usage: bool = False, chat: bool = False, *, logprobs: Callable | None = None,
                            continuous_usage: bool = False, index: int = 0, echo: str = "",
                            done: bool = True) -> AsyncIterator[str]:
    """SSE events of one streamed completion: a chunk per piece of new text, the last one with the finish
    reason, an optional usage chunk, then [DONE]. meta: {"id", "created", "model", "prompt_tokens"}.
    Options the server uses: `logprobs(outputs) -> dict` (a chunk's "logprobs" for the outputs its text
    came from), `continuous_usage` (usage so far in every chunk, vLLM's stream_options.continuous_usage_stats),
    `index` (the choice, in a batch), `echo` (text sent before the first piece), `done=False` (no usage
    chunk and no [DONE]: the caller merges several choices)."""
    head = {"id": meta["id"], "object": "chat.completion.chunk" if chat else "text_completion",
            "created": meta["created"], "model": meta["model"]}
    n = 0

    def chunk(piece: str, outs: list, finish: str | None, first: bool = False) -> dict:
        lp = logprobs(outs) if logprobs is not None and not first else None
        if chat:
            delta = ({"role": "assistant"} if first else {}) | ({"content": piece} if piece else {})
            choice = {"index": index, "delta": delta, "logprobs": lp, "finish_reason": finish}
        else:
            choice = {"index": index, "text": piece, "logprobs": lp, "finish_reason": finish}
        return head | {"choices": [choice]} | ({"usage": usage(meta["prompt_tokens"], n)} if continuous_usage else {})

    if chat:
        yield sse(chunk("", [], None, first=True))
    first = True
    async for piece, outs, finish in deltas(outputs, text):
        n += len(outs)
        if first and echo:
            piece = echo + piece
        first = False
        yield sse(chunk(piece, outs, finish))
    if include_usage and done:
        yield sse(head | {"choices": [], "usage": usage(meta["prompt_tokens"], n)})
    if done:
        yield sse("[DONE]")


async def collect(outputs: AsyncIterator[StepOutput], text: TextStream) -> tuple[str, str, int]:
    """A whole (non-streamed) completion: (text, finish_reason, completion tokens)."""
    whole, _, finish, n = await collect_outputs(outputs, text)
    return whole, finish, n


async def collect_outputs(outputs: AsyncIterator[StepOutput], text: TextStream) -> tuple[str, list, str, int]:
    """(text, every output read, finish_reason, completion tokens)."""
    pieces, read, finish = [], [], "stop"
    async for piece, outs, finish in deltas(outputs, text):
        pieces.append(piece)
        read += outs
    return "".join(pieces), read, finish, len(read)
