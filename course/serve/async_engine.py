"""The engine behind the server: many clients at once, each reading its own stream of tokens.

    engine = AsyncEngine(LLMEngine(model, ...), max_waiting=32)
    async for out in engine.generate(prompt_ids, params, max_tokens=20):    # inside any coroutine
        print(out.token, out.finish_reason)

    rid = engine.add(prompt_ids, params, max_tokens)     # what a server does: QueueFull -> 429 at once
    async for out in engine.stream(rid): ...             # leaving early (break, cancel) aborts it
    engine.abort(rid)                                    # idempotent: a no-op once it finished

One task, the engine loop, owns the core. It runs on the server's event loop and is the only code
that touches the core: `add` and `abort` leave notes (add this, abort that) that the loop applies
between steps, never while a step runs. The forward pass runs in a worker thread
(`asyncio.to_thread`), so while the model computes, the event loop keeps accepting connections and
sending the tokens of the previous step. Each request's tokens go into its own asyncio.Queue.

Back-pressure: when `max_waiting` requests already wait for a place in the batch, `add` raises
`QueueFull` before queuing anything (the server answers 429 with Retry-After).
"""
from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator, Hashable

from course.engine.sampler import SamplingParams
from course.serve.engine import LLMEngine, StepOutput


class QueueFull(RuntimeError):
    """Too many requests wait already; try again later (HTTP 429)."""


class AsyncEngine:
    """Streams per request over an LLMEngine core, with cancellation and a bounded waiting queue."""

    def __init__(self, core: LLMEngine, max_waiting: int = 64):
        if type(max_waiting) is not int or max_waiting < 0:
            raise ValueError(f"max_waiting must be an int >= 0, got {max_waiting!r}")
        self.core, self.max_waiting = core, max_waiting
        self.streams: dict[Hashable, asyncio.Queue] = {}   # rid -> its tokens (an exception ends it)
        self.to_add: list[tuple] = []                       # core.add_request arguments, for the loop
        self.to_abort: set[Hashable] = set()                # rids the loop must abort
        self.wake: asyncio.Event | None = None              # set when there is work for the loop
        self.loop_task: asyncio.Task | None = None
        self.ids = itertools.count()

    @property
    def num_waiting(self) -> int:
        """Requests not yet in the batch: in the core's waiting queue, or not yet handed to it."""
        return len(self.core.waiting) + len(self.to_add)

    def start(self) -> None:
        """Start the engine loop on the running event loop (the server's lifespan calls it)."""
        if self.loop_task is None or self.loop_task.done():
            self.wake = asyncio.Event()
            self.loop_task = asyncio.get_running_loop().create_task(self._loop(), name="engine-loop")

    async def stop(self) -> None:
        """Cancel the loop (a step in progress finishes in its thread); open streams end with an error."""
        if self.loop_task is not None:
            self.loop_task.cancel()
            await asyncio.gather(self.loop_task, return_exceptions=True)
            self.loop_task = None
        for queue in self.streams.values():
            queue.put_nowait(RuntimeError("the engine stopped"))

    def add(self, prompt: list[int], params: SamplingParams | None = None, max_tokens: int = 16, **options) -> str:
        """Queue a request; its id. Raises QueueFull (queuing nothing) when max_waiting requests wait."""
        if self.num_waiting >= self.max_waiting:
            raise QueueFull(f"{self.num_waiting} requests are waiting (max_waiting={self.max_waiting})")
        rid = f"req-{next(self.ids)}"
        self.streams[rid] = asyncio.Queue()
        self.to_add.append((rid, list(prompt), params, max_tokens, options))
        self.start()
        self.wake.set()
        return rid

    async def stream(self, rid: Hashable) -> AsyncIterator[StepOutput]:
        """The tokens of request `rid`, ending after the one whose finish_reason is set.
        Leaving early (break and close, or cancellation) aborts the request."""
        queue = self.streams.get(rid)
        if queue is None:
            raise KeyError(f"no request {rid!r} is streaming (add it first, and read it once)")
        finished = False
        try:
            while not finished:
                out = await queue.get()
                if isinstance(out, BaseException):
                    raise out
                finished = out.finished
                yield out
        finally:
            if not finished:
                self.abort(rid)
            self.streams.pop(rid, None)

    def abort(self, rid: Hashable) -> None:
        """Stop request `rid` and free its blocks at the next step (nothing happens if it finished)."""
        if self.streams.pop(rid, None) is not None:
            self.to_abort.add(rid)
            if self.wake is not None:
                self.wake.set()

    async def generate(self, prompt: list[int], params: SamplingParams | None = None, max_tokens: int = 16,
                       **options) -> AsyncIterator[StepOutput]:
        """add, then stream: one request's tokens."""
        async for out in self.stream(self.add(prompt, params, max_tokens, **options)):
            yield out

    async def _loop(self) -> None:
        while True:
            self._apply()
            if not self.core.has_work():
                self.wake.clear()
                await self.wake.wait()
                continue
            try:
                outputs = await asyncio.to_thread(self.core.step)   # the model runs off the event loop
            except Exception as e:  # noqa: BLE001 - a failed step fails its requests, not the server
                for req in list(self.core.running) + list(self.core.waiting):
                    self.core.abort(req.rid)
                    if req.rid in self.streams:
                        self.streams[req.rid].put_nowait(RuntimeError(f"the engine step failed: {e!r}"))
                continue
            for out in outputs:
                if out.rid in self.streams:
                    self.streams[out.rid].put_nowait(out)

    def _apply(self) -> None:
        """Hand new requests to the core and abort the cancelled ones: only here, while no step runs."""
        adds, self.to_add = self.to_add, []
        for rid, prompt, params, max_tokens, options in adds:
            if rid in self.to_abort:                            # cancelled before it reached the core
                self.to_abort.discard(rid)
                continue
            try:
                self.core.add_request(rid, prompt, params, max_tokens, **options)
            except ValueError as e:
                if rid in self.streams:
                    self.streams[rid].put_nowait(e)
        for rid in self.to_abort:
            self.core.abort(rid)
        self.to_abort.clear()
