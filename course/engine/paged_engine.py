"""Lab 05's engine, released for the labs after it: greedy continuous batching over a paged KV cache,
with hold-back at admission and preempt-and-recompute when blocks run out; and lab 04's engine on
the slot cache (`contiguous_generate`) to compare it with.

    run = paged_generate(model, [Request(0, prompt, 16), ...], max_batch_size=8, n_blocks=64, block_size=16)
    run.outputs, run.throughput, run.waste, run.snapshots      # tokens, speed, memory, the widget's input

Every piece of a step can be swapped for the lab's own: the allocator, the admission and decode
reservation policies, and the two functions the model calls on the pool (`write_kv`, `attention`;
lab 06 passes its Triton kernels). `graphs` (default: on a GPU) captures the decode step in CUDA
graphs, one per batch bucket (course/engine/graphs.py, lab 02): prefills stay eager, and a step
that cannot be captured (a function that reads a value on the host) runs eagerly, as `run.graphs` says. One step: reserve a slot for every running request's newest
token (preempting the newest when the pool is dry); admit newcomers unless someone was just
preempted; run pending copy-on-write copies; prefill each newcomer (prompt + any output it already
had); decode the others together; retire finished requests.
"""
from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from course.engine.block_manager import BlockAllocator, OutOfBlocks
from course.engine.graphs import capture_decode_graphs
from course.engine.paged import PagedKVCache, block_table_tensor, forward_paged
from course.engine.paged_ops import paged_attention, write_kv
from course.engine.runner import forward_cached
from course.engine.slot_cache import SlotKVCache
from course.timing import clock


@dataclass(eq=False)  # eq=False: two requests are the same only if they are the same object
class Request:
    rid: int                              # request id; also its sequence id in the allocator
    prompt: list[int]
    max_new_tokens: int
    arrival: int = 0                      # the engine step at which it arrives
    output: list[int] = field(default_factory=list)   # the new tokens so far
    preemptions: int = 0                  # how many times it was evicted

    def __post_init__(self):
        if not self.prompt or self.max_new_tokens < 1:
            raise ValueError(f"request {self.rid}: needs a non-empty prompt and max_new_tokens >= 1")


class Queues:
    """waiting (arrival order, preempted requests back at the front), running (oldest first), finished."""

    def __init__(self, requests: list[Request], max_batch_size: int):
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        self.waiting: deque[Request] = deque(sorted(requests, key=lambda r: r.arrival))
        self.running: list[Request] = []
        self.finished: list[Request] = []
        self.max_batch_size = max_batch_size

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)


def admit(queues: Queues, alloc: BlockAllocator, step: int) -> list[tuple[Request, list[int]]]:
    """Hold back: arrived requests join, oldest first, while the batch has room and their tokens
    (prompt and any output) fit in free blocks; the first that does not fit stops everyone behind it."""
    admitted = []
    while queues.waiting and len(queues.running) < queues.max_batch_size and queues.waiting[0].arrival <= step:
        r = queues.waiting[0]
        n = len(r.prompt) + len(r.output)
        if alloc.blocks_for(n) > alloc.n_free:
            break
        queues.waiting.popleft()
        queues.running.append(r)
        admitted.append((r, alloc.append(r.rid, n)))
    return admitted


def reserve_decode(queues: Queues, alloc: BlockAllocator) -> tuple[list[tuple[Request, int]], list[Request]]:
    """A slot for every running request's newest token, oldest first; when blocks run out, preempt
    the newest running request (free it, back to the front of waiting) and try again."""
    decoding, preempted, i = [], [], 0
    while i < len(queues.running):
        r = queues.running[i]
        try:
            slot = alloc.append(r.rid, 1)[0]
        except OutOfBlocks:
            victim = queues.running.pop()           # the newest; may be r itself
            alloc.free(victim.rid)
            victim.preemptions += 1
            queues.waiting.appendleft(victim)
            preempted.append(victim)
            continue
        decoding.append((r, slot))
        i += 1
    return decoding, preempted


@dataclass
class Run:
    outputs: list[list[int]]          # new tokens per request, in the order the requests were given
    times: list[float]                # seconds from the start to the end of each step
    used: list[int]                   # token slots holding a token, after each step
    reserved: list[int]               # token slots reserved, after each step
    snapshots: list[dict] = field(default_factory=list)   # per step: rid -> (block table, token ids)
    events: list[str] = field(default_factory=list)       # per step: what happened
    preemptions: int = 0
    graphs: str = "eager"                                 # how decode steps ran: eager, or graphs for which batch sizes

    @property
    def throughput(self) -> float:
        """New tokens per second over the whole run."""
        return sum(len(o) for o in self.outputs) / self.times[-1]

    @property
    def waste(self) -> float:
        """Share of the reserved token slots that held no token, over the whole run."""
        return 1 - sum(self.used) / sum(self.reserved)


def _check_requests(requests: list[Request]) -> None:
    if not requests or len({r.rid for r in requests}) != len(requests) or any(r.output for r in requests):
        raise ValueError("requests must be fresh Request objects with distinct rids (make new ones for each run)")


def paged_generate(model, requests: list[Request], max_batch_size: int, n_blocks: int, block_size: int, *,
                   allocator: BlockAllocator | None = None, admit: Callable = admit,
                   reserve_decode: Callable = reserve_decode, write_kv: Callable = write_kv,
                   attention: Callable = paged_attention, eos_token_id: int | None = None,
                   graphs: bool | None = None) -> Run:
    """Greedy continuous batching over a paged cache of n_blocks blocks of block_size tokens;
    decode steps in CUDA graphs when `graphs` (None: when the model is on a GPU)."""
    _check_requests(requests)
    dev, fns = model.device, dict(write_kv=write_kv, attention=attention)
    alloc = allocator if allocator is not None else BlockAllocator(n_blocks, block_size)
    if (alloc.n_blocks, alloc.block_size) != (n_blocks, block_size):
        raise ValueError(f"allocator has {alloc.n_blocks} blocks of {alloc.block_size}; the cache {n_blocks} of {block_size}")
    queues = Queues(requests, max_batch_size)
    cache = PagedKVCache(model.cfg, n_blocks, block_size, dtype=model.dtype, device=dev)
    runner = None
    if _use_graphs(graphs, model):
        longest = max(len(r.prompt) + r.max_new_tokens for r in requests)
        runner = capture_decode_graphs(model, cache, max_batch_size, max_blocks=min(n_blocks, -(-longest // block_size)),
                                       write_kv=write_kv, attention=attention)
    run, start, step = Run([], [], [], []), clock(dev), 0
    while queues.has_work():
        decoding, preempted = reserve_decode(queues, alloc)
        newcomers = [] if preempted else admit(queues, alloc, step)
        if not queues.running and queues.waiting and queues.waiting[0].arrival <= step:
            r = queues.waiting[0]
            raise OutOfBlocks(f"request {r.rid} needs {alloc.blocks_for(len(r.prompt) + len(r.output))} blocks "
                              f"and the whole pool has {n_blocks}: it can never run")
        for src, dst in alloc.pending_copies:
            cache.copy_block(src, dst)
        alloc.pending_copies.clear()
        for r, slots in newcomers:                      # prefill: prompt (+ output so far, after a preemption)
            tokens = r.prompt + r.output
            logits = forward_paged(model, torch.tensor([tokens], device=dev), torch.arange(len(tokens), device=dev)[None],
                                   cache, torch.tensor(slots, device=dev), None, None, **fns)
            r.output.append(int(logits[0, -1].argmax()))
        if decoding:                                    # decode: one token for every other running request
            ids = torch.tensor([[r.output[-1]] for r, _ in decoding], device=dev)                       # (B, 1)
            pos = torch.tensor([[len(r.prompt) + len(r.output) - 1] for r, _ in decoding], device=dev)  # (B, 1)
            tables = block_table_tensor([alloc.block_tables[r.rid] for r, _ in decoding], dev)           # (B, max_blocks)
            lens = torch.tensor([alloc.lengths[r.rid] for r, _ in decoding], dtype=torch.int32, device=dev)
            logits = forward_paged(model, ids, pos, cache, torch.tensor([s for _, s in decoding], device=dev),
                                   tables, lens, **fns)
            for (r, _), tok in zip(decoding, logits[:, -1].argmax(dim=-1).tolist()):
                r.output.append(tok)
        done = [r for r in queues.running if len(r.output) >= r.max_new_tokens or r.output[-1] == eos_token_id]
        for r in done:
            queues.running.remove(r)
            alloc.free(r.rid)
            queues.finished.append(r)
        run.times.append(clock(dev) - start)
        run.used.append(sum(alloc.lengths.values()))
        run.reserved.append((n_blocks - alloc.n_free) * block_size)
        run.snapshots.append({r.rid: (list(alloc.block_tables[r.rid]), (r.prompt + r.output)[:alloc.lengths[r.rid]])
                              for r in queues.running})
        said = [f"admitted {[r.rid for r, _ in newcomers]}" if newcomers else "",
                f"preempted {[r.rid for r in preempted]}" if preempted else "",
                f"finished {[r.rid for r in done]}" if done else ""]
        run.events.append(", ".join(s for s in said if s) or "decode")
        run.preemptions += len(preempted)
        step += 1
    run.outputs = [r.output for r in requests]
    run.graphs = runner.describe() if runner is not None else "eager"
    return run


def _use_graphs(graphs: bool | None, model) -> bool:
    if graphs is not None and not isinstance(graphs, bool):
        raise TypeError(f"graphs must be True, False or None (None: on a GPU), got {graphs!r}")
    return model.device.type == "cuda" if graphs is None else graphs


def contiguous_generate(model, requests: list[Request], max_batch_size: int, max_len: int,
                        eos_token_id: int | None = None, graphs: bool | None = None) -> Run:
    """Lab 04's continuous batching on the slot cache: each running request holds a slot of max_len;
    decode steps in CUDA graphs when `graphs` (None: when the model is on a GPU)."""
    _check_requests(requests)
    dev, queues = model.device, Queues(requests, max_batch_size)
    cache = SlotKVCache(model.cfg, n_slots=max_batch_size, max_len=max_len, dtype=model.dtype, device=dev)
    runner = capture_decode_graphs(model, cache, max_batch_size) if _use_graphs(graphs, model) else None
    free_slots, slot_of = list(range(max_batch_size)), {}
    run, start, step = Run([], [], [], []), clock(dev), 0
    while queues.has_work():
        newcomers = []
        while free_slots and queues.waiting and queues.waiting[0].arrival <= step:
            r = queues.waiting.popleft()
            slot_of[r.rid] = free_slots.pop(0)
            newcomers.append(r)
        others = list(queues.running)
        queues.running += newcomers
        for r in newcomers:
            cache.reset(slot_of[r.rid])
            logits = forward_cached(model, torch.tensor([r.prompt], device=dev), torch.arange(len(r.prompt), device=dev)[None],
                                    cache, torch.tensor([slot_of[r.rid]], device=dev))
            r.output.append(int(logits[0, -1].argmax()))
        if others:
            logits = forward_cached(model, torch.tensor([[r.output[-1]] for r in others], device=dev),
                                    torch.tensor([[len(r.prompt) + len(r.output) - 1] for r in others], device=dev),
                                    cache, torch.tensor([slot_of[r.rid] for r in others], device=dev))
            for r, tok in zip(others, logits[:, -1].argmax(dim=-1).tolist()):
                r.output.append(tok)
        for r in [r for r in queues.running if len(r.output) >= r.max_new_tokens or r.output[-1] == eos_token_id]:
            queues.running.remove(r)
            free_slots.append(slot_of.pop(r.rid))
            queues.finished.append(r)
        run.times.append(clock(dev) - start)
        run.used.append(int(cache.valid.sum()))
        run.reserved.append(len(queues.running) * max_len)
        step += 1
    run.outputs = [r.output for r in requests]
    run.graphs = runner.describe() if runner is not None else "eager"
    return run
