"""Lab 11, sections 0-2: title, the engine assembled from earlier labs (a stalled decode, measured),
and Problem 1, the asynchronous engine (streams, cancellation, a bounded queue)."""
from autograder.authoring import code, locked, md, solution, tests
from autograder.lab_builders.common_cells import COLAB_INSTALL, SETUP

# Hidden reference for Problem 1: a stricter fake core than the given one. It checks that nothing
# touches it during a step (from any thread), that aborts name requests it holds or held, and it can
# be told to hold its requests waiting (to fill a queue).
HIDDEN_CORE = r'''
import random as _random
import threading as _threading
class _StrictCore:
    def __init__(self, step_s=0.001, max_running=3, admit=True):
        self.step_s, self.max_running, self.admit = step_s, max_running, admit
        self.waiting, self.running, self.blocks = [], [], {}
        self.added, self.aborted, self.violations, self.steps = [], [], [], 0
        self.lock = _threading.Lock()
    def _touch(self, what):
        if not self.lock.acquire(blocking=False):
            self.violations.append(what)
        else:
            self.lock.release()
    def add_request(self, rid, prompt, params=None, max_tokens=16, **options):
        self._touch("add_request")
        assert rid not in self.added, f"request {rid!r} was handed to the core twice"
        self.added.append(rid)
        self.waiting.append([rid, prompt[0], max_tokens, 0])
    def abort(self, rid):
        self._touch("abort")
        for q in (self.waiting, self.running):
            for r in list(q):
                if r[0] == rid:
                    q.remove(r); self.blocks.pop(rid, None); self.aborted.append(rid)
                    return True
        return False
    def has_work(self):
        return bool(self.waiting or self.running)
    def step(self):
        with self.lock:
            time.sleep(self.step_s)
            while self.admit and self.waiting and len(self.running) < self.max_running:
                r = self.waiting.pop(0); self.running.append(r); self.blocks[r[0]] = 2
            outs = []
            for r in list(self.running):
                r[3] += 1
                done = r[3] == r[2]
                outs.append(StepOutput(r[0], 100 * r[1] + r[3] - 1, r[3] - 1, "length" if done else None))
                if done:
                    self.running.remove(r); del self.blocks[r[0]]
            self.steps += 1
            return outs
async def _until(cond, seconds=5.0):
    deadline = time.monotonic() + seconds
    while not cond() and time.monotonic() < deadline:
        await asyncio.sleep(0.002)
    return cond()
'''.strip("\n")

cells = [
md(r"""
# Lab 11: Serving

Every engine of this course so far was handed its whole workload up front, ran it to the end, and
returned the results. A server lives differently. Requests arrive one at a time, at moments nobody
chose, over the network, from many clients at once; each client wants its tokens **as they are made**,
may hang up halfway, or may send a request that makes no sense. What users feel is not the throughput
of one run but the **time to the first token** and the **gaps between tokens**, and serving systems
are judged by how those behave under load. This capstone puts the engine you built (continuous
batching, paged blocks, prefix caching, the batched sampler) behind the interface real clients use,
an OpenAI-compatible HTTP API, measures it the way vLLM measures itself, and fixes the stall you will
measure first with **chunked prefill** (Sarathi-Serve, 2024).

**You will**
- wrap the engine in an asynchronous loop: one token stream per request, cancellation that frees a
  request's KV blocks, a bounded waiting queue;
- turn token ids into text a client can read (incremental detokenization, stop strings) and stream it
  as server-sent events; check requests and answer bad ones with OpenAI-style errors;
- serve it with uvicorn, talk to it with `curl` and the `openai` client, read its `/metrics`;
- write a load generator (Poisson arrivals with a burstiness knob, concurrent streaming clients) and
  the metrics of vLLM's serving benchmark: TTFT, TPOT, inter-token latency, end-to-end latency, goodput;
- write a chunked-prefill scheduler with a per-step token budget, watch it on a batch timeline, and
  measure it against prefill-first under a mixed load.

**Time:** about 5 hours: 1 hour of reading, seven problems (the async engine about 45 minutes, text
streaming 30, server-sent events 20, request checks 30, the load generator 25, the metrics 20, the
scheduler 25), 30 minutes for the written questions at the end, and about 4 minutes of running on
a laptop CPU (3.7 minutes measured on 2 cores). **Hardware:** everything runs on a laptop CPU (2 cores suffice; the loads are sized down
there), and on a GPU when there is one. The server only ever listens on 127.0.0.1 (this machine).
"""),
locked("colab_install", COLAB_INSTALL),
locked("setup", SETUP),
md(r"""
## 1. The engine you built, and what a server adds

`course.serve.LLMEngine` assembles the released answers of the earlier labs into one engine: the
continuous-batching scheduler (lab 04), a paged KV cache whose blocks come from the prefix cache's
pool (labs 05 and 09), lab 07's batched sampler with a generator per seeded request, and a forward
pass, `forward_extend`, that extends many sequences by different numbers of tokens at once. Its
interface is three calls:

```
core.add_request(rid, prompt_ids, SamplingParams(...), max_tokens)   # queue a request
outputs = core.step()      # one forward pass over the batch -> [StepOutput(rid, token, index, finish_reason), ...]
core.abort(rid)            # drop a request, free its blocks
```

Inside, a request is a `Seq`: its tokens so far (prompt, then output) and `num_computed`, how many of
them already have keys and values in the cache. A step gives each scheduled sequence some tokens to
compute: a **decode** computes exactly one (its newest token), a **prefill** many. Which sequences get
how many tokens is the scheduling **policy**. The classic one, vLLM's original default, is
**prefill-first**: when requests wait, the next step runs their whole prompts and nothing else.

The cell below loads the model and gives a few helpers used all along the lab.
"""),
locked("helpers", r'''
import asyncio
import concurrent.futures
import contextlib
import itertools
import json
import math
import time
from collections.abc import AsyncIterator, Callable, Hashable, Sequence
from dataclasses import dataclass, field

import httpx
import matplotlib.pyplot as plt
import numpy as np
import torch

from course.engine import SamplingParams
from course.engine.scheduler import Seq, schedule_prefill_first
from course.expect import expect_bool, expect_float, expect_floats, expect_int, expect_ints, expect_tuple, expect_type
from course.serve import (APIError, GenerationRequest, LLMEngine, QueueFull, RequestRecord, ServerThread, StepOutput,
                          build_app, random_requests, send_completion)
from course.serve.metrics import parse as parse_metrics

tokenizer = course.load_tokenizer()
model = course.load_model(device=env.device, dtype=env.dtype)
MODEL_NAME = "SmolLM2-135M-Instruct"        # what clients send as "model"
BLOCK = 16


def encode(text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False).input_ids


def decode(ids: list[int]) -> str:
    return tokenizer.decode(ids, skip_special_tokens=True)


def make_core(policy="prefill_first", budget: int = 4096, max_running: int = 8, n_blocks: int | None = None) -> LLMEngine:
    """A fresh engine core on the lab's model: `policy` is "prefill_first", "chunked" or a function."""
    n_blocks = n_blocks or env.pick(2048, 256, cpu=512)
    return LLMEngine(model, n_blocks=n_blocks, block_size=BLOCK, max_running=max_running, budget=budget, policy=policy,
                     eos_token_id=tokenizer.eos_token_id)


def random_ids(n: int, seed: int) -> list[int]:
    """n random token ids: a long document stands in for what a user pastes (the cost of a prompt
    does not depend on what its tokens say); different seeds never share a cached prefix."""
    return torch.randint(1000, len(tokenizer), (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def decode_step_ms(n_requests: int = 4, steps: int = 8) -> float:
    """Median time of one decode step of `n_requests` short requests on this machine, in ms (after a
    warm-up): the yardstick the measurements of sections 6 and 7 size their loads with."""
    from course.timing import benchmark
    core = make_core("prefill_first")
    for i in range(n_requests):
        core.add_request(i, random_ids(24, seed=i), SamplingParams(temperature=0.0), max_tokens=1000, ignore_eos=True)
    core.step()                                                     # the prefill
    return 1e3 * benchmark(core.step, warmup=2, repeats=steps, device=env.device).median


def run(coro, timeout_s: float = 120):
    """Run a coroutine to the end from ordinary code, inside Jupyter too (whose own event loop is busy
    running this cell): a fresh event loop on a worker thread. Test cells use it; demo cells `await`.
    A coroutine still running after timeout_s is cancelled: TimeoutError instead of a notebook that hangs."""
    async def bounded():
        try:
            return await asyncio.wait_for(coro, timeout_s)
        except asyncio.TimeoutError:
            raise TimeoutError(f"still running after {timeout_s} s: a stream that never ends, or an engine loop "
                               "that never runs a step?") from None
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, bounded()).result()


print(f"{MODEL_NAME} on {env.device} ({str(env.dtype).removeprefix('torch.')}); "
      f"KV cache: {make_core().pc.pool.n_blocks} blocks of {BLOCK} tokens")
'''),
md(r"""
What does a client of this engine see? Three short chat requests decode together; at step 4 someone
pastes a long document. We run the steps by hand and print what each step did and how long it took.
"""),
code(r'''
core = make_core("prefill_first")
core.record_trace()                        # who did what at every step (for the timeline later)
chats = ["The capital of France is", "Once upon a time, there was", "My favourite food is"]
for i, text in enumerate(chats):
    core.add_request(f"chat-{i}", encode(text), SamplingParams(temperature=0.0), max_tokens=12)
doc_len = env.pick(2048, 384, cpu=512)
rows = []
while core.has_work():
    if core.stats.steps == 4:
        core.add_request("doc", random_ids(doc_len, seed=1), SamplingParams(temperature=0.0), max_tokens=4)
        doc_step = len(rows)
    core.step()
    states = core.trace[-1]
    did = {s: [rid for rid, st in states.items() if st == s] for s in ("prefill", "decode", "waiting")}
    rows.append((core.last_step_s, did))
for t, (secs, did) in enumerate(rows):
    stalled = f"   waiting: {', '.join(did['waiting'])}" if did["waiting"] else ""
    work = " ".join(f"{k} {', '.join(v)}" for k, v in did.items() if v and k != "waiting")
    print(f"step {t:2d}: {1e3 * secs:6.0f} ms  {work}{stalled}")
# chat-0's inter-token gaps: the steps it waited through, plus the step that gave it its next token
chat0_gaps, waited = {}, 0.0               # step that ended the gap -> gap in ms
for t, (secs, did) in enumerate(rows):
    if "chat-0" in did["waiting"]:
        waited += secs
    elif "chat-0" in did["decode"]:
        chat0_gaps[t], waited = 1e3 * (waited + secs), 0.0
after_doc = next(g for t, g in chat0_gaps.items() if t >= doc_step)
print(f"chat-0's tokens came {np.median(list(chat0_gaps.values())):.0f} ms apart (median); "
      f"the one after the document arrived, {after_doc:.0f} ms after the one before it")
'''),
md(r"""
Read your numbers. A decode step of three requests is short. The step that holds the document's
prefill is longer (on a CPU many times longer), and during it the three chat requests get
**nothing**: each of their users sees the text stop for as long as someone else's prompt takes. (On
a GPU this small model's eager steps are launch-bound, so the document's step may cost little more
than a decode step; section 7 says when the stall comes back there.) The time between two tokens of
one request is an **inter-token latency**; the one after the document arrived holds the whole
prefill plus the next decode step. Such gaps make the tail (the 99th percentile) of the inter-token
latency, and that tail is what chunked prefill will cut in section 7.

Before that, the engine must become a server. The loop above is synchronous: while it runs, no new
request can come in and no client can read its tokens as they come out. A server must do everything
at once:

```
 client A --HTTP--+                                              +-- worker thread
 client B --HTTP--+   event loop (one thread, many coroutines)   |   core.step(): the model
 client C --HTTP--+                                              |
                      add()    -> to_add   --+                   |
                      abort()  -> to_abort --+-> engine loop ----+   await asyncio.to_thread(core.step)
                      stream() <- queue    <-+   (one task)          then each token into its request's queue
```

An **event loop** (asyncio, and uvicorn on top of it) runs many coroutines in one thread: each
HTTP request is a coroutine that runs until it waits (for the network, for its next token) and lets
the others run. The model must not run on that thread, or every client would freeze for the length
of a step: the **engine loop** hands each `core.step()` to a **worker thread** and awaits it (PyTorch
releases Python's lock while it computes, so the event loop keeps serving). And only the engine loop
touches the core, **between** steps: a request that arrives while a step runs leaves a note
(`to_add`), a client that hangs up leaves another (`to_abort`), and the loop applies them before the
next step. Changing the core's lists while `step()` iterates over them in another thread is a bug
that shows up once in a thousand requests.

## 2. The asynchronous engine

## Problem 1: Streams, cancellation and a bounded queue (5 points)

Each request gets an `asyncio.Queue`: the engine loop puts the request's `StepOutput`s in it, and the
request's reader takes them out. The class below gives the state, `start`/`stop`, `generate` (add,
then stream) and `_apply` (the notes, applied by the loop).

**Deliverable:** the four methods of `AsyncEngine`:
- `add(prompt, params=None, max_tokens=16, **options)`: if `num_waiting >= max_waiting`, raise
  `QueueFull` and change nothing (the server will answer 429). Otherwise make an id
  `f"req-{next(self.ids)}"`, give it a new `asyncio.Queue` in `self.streams`, append
  `(rid, prompt, params, max_tokens, options)` to `self.to_add`, make sure the loop runs
  (`self.start()`), wake it (`self.wake.set()`) and return the id.
- `stream(rid)`: an **async generator** that yields the `StepOutput`s arriving in the request's queue,
  up to and including the one that is `finished`; an exception found in the queue is raised. If the
  generator is left before the end (its reader breaks out and closes it, or its task is cancelled
  because the client went away), it aborts the request: use `try`/`finally`. Either way the request's
  queue leaves `self.streams` when the generator ends.
- `abort(rid)`: if `rid` still has a queue in `self.streams`, remove it, add `rid` to `self.to_abort`
  and wake the loop; otherwise do nothing (the request finished, or was aborted already).
- `_loop()`: forever: `self._apply()`; then, if the core has no work, clear `self.wake`, wait for it
  and go round again (an idle loop must sleep, not spin); otherwise run one step in a worker thread,
  `outputs = await asyncio.to_thread(self.core.step)`, and put each output in its request's queue
  (skip outputs whose request has no queue any more: it was aborted while the step ran).

The core can be the real `LLMEngine` or `FakeCore`, a stand-in without a model that the tests use
(given below): request `[p, ...]` gets the tokens `100p, 100p + 1, ...`, so a mixed-up stream shows.
"""),
locked("fake_core", r'''
@dataclass(eq=False)
class FakeRequest:
    rid: Hashable
    first: int
    max_tokens: int
    made: int = 0


class FakeCore:
    """LLMEngine's interface with no model, to test an async engine fast. Request [p, ...] gets tokens
    100p, 100p + 1, ...; at most `max_running` run per step, each step takes `step_s` seconds. It counts
    KV blocks (2 per request it holds) and records every call made while a step runs (`violations`)."""

    def __init__(self, step_s: float = 0.002, max_running: int = 4):
        self.step_s, self.max_running = step_s, max_running
        self.waiting: list[FakeRequest] = []
        self.running: list[FakeRequest] = []
        self.blocks: dict = {}                               # rid -> blocks it holds
        self.added, self.aborted, self.violations, self.steps = [], [], [], 0
        self.stepping = False

    def _touch(self, what: str) -> None:
        if self.stepping:
            self.violations.append(what)

    def add_request(self, rid, prompt, params=None, max_tokens=16, **options) -> None:
        self._touch("add_request")
        self.added.append(rid)
        self.waiting.append(FakeRequest(rid, prompt[0], max_tokens))

    def abort(self, rid) -> bool:
        self._touch("abort")
        for queue in (self.waiting, self.running):
            for r in list(queue):
                if r.rid == rid:
                    queue.remove(r)
                    self.blocks.pop(rid, None)
                    self.aborted.append(rid)
                    return True
        return False

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def step(self) -> list[StepOutput]:
        self.stepping = True
        try:
            time.sleep(self.step_s)
            while self.waiting and len(self.running) < self.max_running:
                r = self.waiting.pop(0)
                self.running.append(r)
                self.blocks[r.rid] = 2
            outputs = []
            for r in list(self.running):
                r.made += 1
                done = r.made == r.max_tokens
                outputs.append(StepOutput(r.rid, 100 * r.first + r.made - 1, r.made - 1, "length" if done else None))
                if done:
                    self.running.remove(r)
                    del self.blocks[r.rid]
            self.steps += 1
            return outputs
        finally:
            self.stepping = False
'''),
solution("async_engine", r'''
class AsyncEngine:
    """Streams per request over a core (LLMEngine or FakeCore), with cancellation and a bounded queue."""

    def __init__(self, core, max_waiting: int = 64):
        self.core, self.max_waiting = core, max_waiting
        self.streams: dict = {}            # rid -> asyncio.Queue of its StepOutputs (an exception ends it)
        self.to_add: list[tuple] = []      # (rid, prompt, params, max_tokens, options): for the loop to add
        self.to_abort: set = set()         # rids for the loop to abort
        self.wake: asyncio.Event | None = None
        self.loop_task: asyncio.Task | None = None
        self.ids = itertools.count()

    @property
    def num_waiting(self) -> int:
        """Requests not yet in the batch: waiting in the core, or not yet handed to it."""
        return len(self.core.waiting) + len(self.to_add)

    def start(self) -> None:
        """Start the engine loop on the running event loop (once; again after it crashed)."""
        if self.loop_task is None or self.loop_task.done():
            self.wake = asyncio.Event()
            self.loop_task = asyncio.get_running_loop().create_task(self._loop())

    async def stop(self) -> None:
        """Cancel the engine loop and wait for it; open streams end with an error."""
        if self.loop_task is not None:
            self.loop_task.cancel()
            await asyncio.gather(self.loop_task, return_exceptions=True)
            self.loop_task = None
        for queue in self.streams.values():
            queue.put_nowait(RuntimeError("the engine stopped"))

    def _apply(self) -> None:
        """Hand the new requests to the core, then abort the cancelled ones. Only the loop calls it, between steps."""
        adds, self.to_add = self.to_add, []
        for rid, prompt, params, max_tokens, options in adds:
            if rid in self.to_abort:                       # cancelled before it ever reached the core
                self.to_abort.discard(rid)
                continue
            try:
                self.core.add_request(rid, prompt, params, max_tokens, **options)
            except ValueError as e:                        # e.g. a prompt the core refuses: end its stream
                if rid in self.streams:
                    self.streams[rid].put_nowait(e)
        for rid in self.to_abort:
            self.core.abort(rid)
        self.to_abort.clear()

    async def generate(self, prompt: list[int], params=None, max_tokens: int = 16, **options):
        """add, then stream: the tokens of one request."""
        async for out in self.stream(self.add(prompt, params, max_tokens, **options)):
            yield out

    def add(self, prompt: list[int], params=None, max_tokens: int = 16, **options) -> str:
        """Queue a request and return its id; QueueFull (queuing nothing) when max_waiting requests wait."""
        ### BEGIN SOLUTION
        if self.num_waiting >= self.max_waiting:
            raise QueueFull(f"{self.num_waiting} requests are waiting (max_waiting={self.max_waiting})")
        rid = f"req-{next(self.ids)}"
        self.streams[rid] = asyncio.Queue()
        self.to_add.append((rid, list(prompt), params, max_tokens, options))
        self.start()
        self.wake.set()
        return rid
        ### END SOLUTION

    async def stream(self, rid):
        """Yield request rid's StepOutputs up to the finished one; leaving early aborts the request."""
        ### BEGIN SOLUTION
        queue = self.streams[rid]
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
        ### END SOLUTION

    def abort(self, rid) -> None:
        """Have the loop abort request rid before its next step; nothing for a request that ended."""
        ### BEGIN SOLUTION
        if self.streams.pop(rid, None) is not None:
            self.to_abort.add(rid)
            if self.wake is not None:
                self.wake.set()
        ### END SOLUTION

    async def _loop(self) -> None:
        """The engine loop: apply the notes, run a step in a worker thread, route its tokens; sleep when idle."""
        ### BEGIN SOLUTION
        while True:
            self._apply()
            if not self.core.has_work():
                self.wake.clear()
                await self.wake.wait()
                continue
            outputs = await asyncio.to_thread(self.core.step)
            for out in outputs:
                if out.rid in self.streams:
                    self.streams[out.rid].put_nowait(out)
        ### END SOLUTION
'''),
tests("async_engine_tests", 5, r"""
async def _three():
    core = FakeCore()
    eng = AsyncEngine(core, max_waiting=8)
    async def read(p, n):
        return [o async for o in eng.generate([p], max_tokens=n)]
    got = await asyncio.gather(read(3, 4), read(5, 2), read(7, 3))
    await eng.stop()
    return core, got
core, got = run(_three())
assert [[type(o) for o in g] for g in got] == [[StepOutput] * 4, [StepOutput] * 2, [StepOutput] * 3], \
    "stream must yield the core's StepOutputs, one per token, up to the finished one"
assert [[o.token for o in g] for g in got] == [[300, 301, 302, 303], [500, 501], [700, 701, 702]], \
    f"each reader must get exactly its own tokens in order, got {[[o.token for o in g] for g in got]}"
assert [g[-1].finish_reason for g in got] == ["length"] * 3, "the stream ends with the finished output"
assert core.violations == [], f"the core was called while a step ran: {core.violations} (only the loop, between steps)"
assert core.blocks == {}, "finished requests hold no blocks"

async def _abort_notes():
    core = FakeCore()
    eng = AsyncEngine(core)
    rid = eng.add([2], max_tokens=1000)
    await asyncio.sleep(0.02)                          # the loop hands it to the core, which runs it
    eng.abort(rid)
    noted = (list(core.aborted), rid in eng.to_abort, rid in eng.streams)   # before the loop runs again
    await eng.stop()
    return noted
aborted_at_once, noted, kept = run(_abort_notes())
assert aborted_at_once == [] and noted and not kept, \
    "abort(rid) must not call the core (a step may be running in another thread): remove the request's queue, " \
    "add rid to to_abort and wake the loop, which aborts it in the core between steps"

async def _leave_early():
    core = FakeCore(step_s=0.005)
    eng = AsyncEngine(core)
    rid = eng.add([4], max_tokens=10_000)
    expect_type(rid, "add(...)", str)
    tokens, s = [], eng.stream(rid)
    async for o in s:
        tokens.append(o.token)
        if len(tokens) == 3:
            break
    await s.aclose()                                    # what a server does when the client hangs up
    deadline = time.monotonic() + 5
    while rid not in core.aborted and time.monotonic() < deadline:
        await asyncio.sleep(0.005)
    steps = core.steps
    await asyncio.sleep(0.05)
    idle_steps = core.steps - steps
    await eng.stop()
    return core, rid, tokens, idle_steps
core, rid, tokens, idle_steps = run(_leave_early())
assert tokens == [400, 401, 402], f"the first three tokens, got {tokens}"
assert core.aborted == [rid], "a reader that leaves early must abort its request (try/finally in stream)"
assert core.blocks == {} and not core.has_work(), "after the abort the core holds nothing"
assert idle_steps == 0, "with no work the loop must wait for wake, not call core.step"

async def _full():
    eng = AsyncEngine(FakeCore(), max_waiting=2)
    a, b = eng.add([1], max_tokens=2), eng.add([2], max_tokens=2)
    try:
        eng.add([3])
    except QueueFull:
        refused = True
    else:
        refused = False
    n = len(eng.streams)
    outs = [[o.token async for o in eng.stream(r)] for r in (a, b)]
    await eng.stop()
    return refused, n, outs
refused, n, outs = run(_full())
assert refused, "a third request while two wait (max_waiting=2) must raise QueueFull"
assert n == 2, "a refused request must leave nothing behind (no stream, no note)"
assert outs == [[100, 101], [200, 201]], "the two accepted requests are served"
### BEGIN HIDDEN TESTS
""" + HIDDEN_CORE + r"""
# many clients at once, random lengths, random early exits: every stream whole and its own
async def _crowd(seed, n_clients):
    rng = _random.Random(seed)
    core = _StrictCore(step_s=0.001, max_running=3)
    eng = AsyncEngine(core, max_waiting=1000)
    plans = [(p, rng.randint(1, 9), rng.choice([0, 0, 1, 2, 5])) for p in range(1, n_clients + 1)]
    async def client(p, n, leave_after):
        await asyncio.sleep(rng.random() * 0.01)
        got, rid = [], eng.add([p], max_tokens=n)
        async with contextlib.aclosing(eng.stream(rid)) as s:
            async for o in s:
                expect_type(o, "a streamed output", StepOutput)
                got.append((o.token, o.index, o.finish_reason))
                if len(got) == leave_after:
                    break
        return rid, got
    results = await asyncio.gather(*[client(*pl) for pl in plans])
    ok = await _until(lambda: not core.has_work())
    await eng.stop()
    return plans, results, core, eng, ok
for seed in (0, 1):
    plans, results, core, eng, ok = run(_crowd(seed, 30))
    assert ok, "requests whose readers left must be aborted; finished ones leave the core"
    for (p, n, leave), (rid, got) in zip(plans, results):
        k = leave if 0 < leave < n else n
        want = [(100 * p + i, i, "length" if i == n - 1 else None) for i in range(k)]
        assert got == want, (f"client {p} (max_tokens {n}, leaves after {leave}): got {got}: each reader must get its own "
                             "tokens, in order, up to the finished one or until it leaves, none lost or doubled")
    left = {rid for (p, n, leave), (rid, got) in zip(plans, results) if 0 < leave < n}
    assert core.violations == [], f"the core was touched during a step: {core.violations}"
    assert core.blocks == {}, "every block must be freed (finished or aborted)"
    assert set(core.aborted) <= left, "only requests whose readers left may be aborted"
    assert eng.streams == {} and eng.to_add == [] and not eng.to_abort, "nothing may stay behind in streams or notes"
# a reader cancelled while it waits for its first token (a client gone before the answer started)
async def _cancel_waiting():
    core = _StrictCore(step_s=0.01, max_running=1)
    eng = AsyncEngine(core)
    long = asyncio.ensure_future(_drain(eng.generate([1], max_tokens=50)))
    await asyncio.sleep(0.02)
    victim = asyncio.ensure_future(_drain(eng.generate([2], max_tokens=50)))
    await asyncio.sleep(0.03)
    victim.cancel()
    await asyncio.gather(victim, return_exceptions=True)
    ok = await _until(lambda: "req-1" in core.aborted)
    first = await long
    await eng.stop()
    return core, ok, first, eng
async def _drain(gen):
    return [o.token async for o in gen]
core, ok, first, eng = run(_cancel_waiting())
assert ok, "a reader cancelled before its first token must abort its request"
assert first == [100 + i for i in range(50)], "the other request is unaffected"
assert core.violations == [] and core.blocks == {} and eng.streams == {}, \
    "after a cancelled reader: no call during a step, no block held, no stream left behind"
# abort is idempotent and ignores finished requests; a queued request cancelled before the loop ran never reaches the core
async def _aborts():
    core = _StrictCore()
    eng = AsyncEngine(core)
    done = [o.token async for o in eng.generate([6], max_tokens=2)]
    eng.abort("req-0"); eng.abort("req-0"); eng.abort("no-such-request")
    rid = eng.add([7], max_tokens=5)
    eng.abort(rid)
    await asyncio.sleep(0.02)
    await eng.stop()
    return core, done, rid
core, done, rid = run(_aborts())
assert done == [600, 601], f"a request alone gets its tokens, got {done}"
assert "req-0" not in core.aborted, "aborting a finished request must not reach the core"
assert rid not in core.added or rid in core.aborted, "a request aborted before it reached the core must not run"
assert not core.has_work() and core.violations == [], "aborts reach the core only through the loop, between steps"
# the queue bound counts requests not yet handed to the core, and requests the core holds waiting
async def _bound():
    core = _StrictCore(admit=False)              # a core with no room: everything waits
    eng = AsyncEngine(core, max_waiting=3)
    rids = [eng.add([i], max_tokens=1) for i in range(3)]
    await asyncio.sleep(0.02)                    # the loop hands them to the core
    refused = 0
    for i in range(4):
        try:
            eng.add([9])
        except QueueFull:
            refused += 1
    n_streams = len(eng.streams)
    for r in rids:
        eng.abort(r)
    ok = await _until(lambda: not core.has_work())
    await eng.stop()
    return refused, n_streams, ok, core
refused, n_streams, ok, core = run(_bound())
assert refused == 4 and n_streams == 3, "3 requests wait in the core (max_waiting=3): every further add must raise QueueFull"
assert ok and core.violations == [], "aborting waiting requests empties the core"
# an exception put in a request's queue ends its stream with that exception
async def _error():
    eng = AsyncEngine(_StrictCore(step_s=0.05))
    rid = eng.add([1], max_tokens=100)
    eng.streams[rid].put_nowait(RuntimeError("boom"))
    try:
        async for o in eng.stream(rid):
            pass
    except RuntimeError as e:
        raised = str(e)
    else:
        raised = None
    await eng.stop()
    return raised
assert run(_error()) == "boom", "an exception found in the queue must be raised by stream"
### END HIDDEN TESTS
"""),
md(r"""
### See it: three streams at once, then a client that hangs up

Your engine on the real model, in this notebook's own event loop (a notebook cell may `await`). Three
clients start together; each prints its text as its tokens arrive, with the time since the start. The
lines interleave: the three requests share every step.
"""),
code(r'''
engine = AsyncEngine(make_core("chunked", budget=256), max_waiting=8)
t0 = time.perf_counter()

async def client(name: str, text: str, n: int) -> str:
    ids = []
    async for out in engine.generate(encode(text), SamplingParams(temperature=0.0), max_tokens=n):
        ids.append(out.token)
        if out.index % 4 == 3 or out.finished:
            print(f"{time.perf_counter() - t0:5.2f} s  {name}: {decode(ids)!r}")
    return decode(ids)

texts = await asyncio.gather(client("A", "The capital of France is", 8), client("B", "Water boils at", 12),
                             client("C", "def fibonacci(n):", 12))
print(engine.core.metrics()["steps"], "steps for", sum(len(encode(t)) for t in texts), "tokens of text")
'''),
md(r"""
Now a client that reads three tokens of a long answer and goes away. Its blocks must come back, or
every client that disconnects early would leak KV memory until the server falls over.
"""),
code(r'''
core = engine.core
stream = engine.stream(engine.add(encode("Tell me a long story about a dragon."), SamplingParams(temperature=0.8, seed=1),
                                  max_tokens=500, ignore_eos=True))
async for out in stream:
    if out.index == 2:
        break
print(f"after 3 tokens: {core.pc.blocks_in_use} KV blocks in use, {len(core.running)} request running")
await stream.aclose()                      # what the server does when the connection drops
deadline = time.monotonic() + 10
while (core.pc.blocks_in_use or core.running) and time.monotonic() < deadline:
    await asyncio.sleep(0.01)
print(f"after the client left: {core.pc.blocks_in_use} KV blocks in use, {len(core.running)} running, "
      f"{core.stats.aborted} aborted")
await engine.stop()
'''),
]
