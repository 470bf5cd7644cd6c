"""Prefill-decode disaggregation, the given parts: a tiny greedy engine over a paged KV cache, run
two ways on two processes, with wall-clock arrivals.

    colocated_worker(comm, model, requests, ...)          every rank a whole engine (requests split
                                                           between ranks): prefill and decode take turns
    disaggregated_worker(comm, model, requests, send_kv=..., recv_kv=...)
                                                           rank 0 only prefills and sends each request's
                                                           KV blocks; rank 1 only decodes

Each worker warms its engine (one prefill and one decode step, then frees them) before the clock
that all ranks share starts: a freshly forked process runs its first passes several times slower.
Both return what happened (`WorkerLog`: token times, outputs, the worker's timeline of prefills,
decode steps and transfers), so the notebook can compare inter-token latency with and without
prefills in the way. The KV transfer itself (`send_kv`, `recv_kv`) is the lab's.

The engine is lab 05's paged cache and model pass (`PagedKVCache`, `forward_paged`, `BlockAllocator`,
`write_kv`, `paged_attention`): a prefill writes a prompt's keys and values into blocks, a decode
step runs every running request one token further, reading its blocks through its block table.
"""
from __future__ import annotations

import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from course.dist.comm import Comm
from course.engine import BlockAllocator, PagedKVCache, block_table_tensor, forward_paged, paged_attention, write_kv
from course.models.decoder import Decoder

READY = "kv-ready"      # the counter the prefill worker bumps before each transfer


@dataclass
class ServeRequest:
    """A request of the serving demo: `arrival` in seconds after the start."""

    rid: int
    prompt: list[int]
    max_new_tokens: int
    arrival: float = 0.0

    def __post_init__(self):
        if not self.prompt or self.max_new_tokens < 1 or self.arrival < 0:
            raise ValueError(f"request {self.rid}: needs a non-empty prompt, max_new_tokens >= 1 and arrival >= 0")


@dataclass
class WorkerLog:
    """What one worker did. Times are seconds since the common start."""

    rank: int
    role: str                                                   # "colocated", "prefill" or "decode"
    outputs: dict[int, list[int]] = field(default_factory=dict)        # rid -> new tokens
    token_times: dict[int, list[float]] = field(default_factory=dict)  # rid -> when each new token was ready
    events: list[tuple[str, float, float, int | None]] = field(default_factory=list)  # (kind, start, end, rid)
    transfers: list[tuple[int, int, float]] = field(default_factory=list)             # (rid, bytes, seconds)


class Engine:
    """One process's paged KV cache and the two model passes of greedy generation."""

    def __init__(self, model: Decoder, n_blocks: int, block_size: int):
        self.model = model
        self.cache = PagedKVCache(model.cfg, n_blocks, block_size, dtype=model.dtype, device=model.device)
        self.alloc = BlockAllocator(n_blocks, block_size)
        self.fns = dict(write_kv=write_kv, attention=paged_attention)

    @torch.no_grad()
    def prefill(self, seq, prompt: list[int], slots: list[int] | None = None) -> int:
        """Write the prompt's keys and values into fresh blocks of `seq` (or into `slots`, already
        allocated for it); return the first new token."""
        dev = self.model.device
        if slots is None:
            slots = self.alloc.append(seq, len(prompt))
        logits = forward_paged(self.model, torch.tensor([prompt], device=dev), torch.arange(len(prompt), device=dev)[None],
                               self.cache, torch.tensor(slots, device=dev), None, None, **self.fns)
        return int(logits[0, -1].argmax())

    @torch.no_grad()
    def decode(self, seqs: list, last_tokens: list[int]) -> list[int]:
        """One new token for each sequence (batched), given each one's newest token."""
        dev = self.model.device
        slots = [self.alloc.append(s, 1)[0] for s in seqs]
        pos = torch.tensor([[self.alloc.lengths[s] - 1] for s in seqs], device=dev)             # (B, 1)
        tables = block_table_tensor([self.alloc.block_tables[s] for s in seqs], dev)            # (B, max_blocks)
        lens = torch.tensor([self.alloc.lengths[s] for s in seqs], dtype=torch.int32, device=dev)
        logits = forward_paged(self.model, torch.tensor([[t] for t in last_tokens], device=dev), pos, self.cache,
                               torch.tensor(slots, device=dev), tables, lens, **self.fns)
        return logits[:, -1].argmax(dim=-1).tolist()


def _warm_up(engine: Engine, prompt: list[int]) -> None:
    """One prefill of `prompt` and one decode step, under a sequence id no request can have, then its
    blocks are freed. A freshly forked process runs its first model passes several times slower
    (memory to map, kernels to pick): that belongs before the clock starts, not in a request's
    latency. Every worker of both setups does the same."""
    seq = object()                                   # equal to nothing but itself: no rid collides with it
    first = engine.prefill(seq, prompt)
    engine.decode([seq], [first])
    engine.alloc.free(seq)


def _start_clock(comm: Comm) -> float:
    """A start time all ranks share: rank 0's clock after a barrier (time.monotonic is one clock
    for every process of a machine)."""
    comm.barrier()
    t0 = torch.tensor([time.monotonic() if comm.rank == 0 else 0.0], dtype=torch.float64)
    comm.all_reduce(t0)
    return float(t0)


def _check(requests, n_blocks, block_size):
    if not requests or not all(isinstance(r, ServeRequest) for r in requests):
        raise TypeError("requests must be a non-empty list of ServeRequest")
    if len({r.rid for r in requests}) != len(requests):
        raise ValueError("requests must have distinct rids")
    biggest = max(len(r.prompt) + r.max_new_tokens for r in requests)
    if -(-biggest // block_size) > n_blocks:
        raise ValueError(f"a request needs {-(-biggest // block_size)} blocks of {block_size}; the pool has {n_blocks}")


def _decode_step(engine: Engine, log: WorkerLog, running: dict, now: Callable[[], float]) -> None:
    """One decode step for every running request; retire the finished ones."""
    rids = list(running)
    t = now()
    toks = engine.decode(rids, [log.outputs[r][-1] for r in rids])
    done_at = now()
    log.events.append(("decode", t, done_at, None))
    for r, tok in zip(rids, toks):
        log.outputs[r].append(tok)
        log.token_times[r].append(done_at)
        if len(log.outputs[r]) >= running[r].max_new_tokens:
            engine.alloc.free(r)
            del running[r]


def colocated_worker(comm: Comm, model: Decoder, requests: list[ServeRequest], n_blocks: int = 64,
                     block_size: int = 16) -> WorkerLog:
    """A whole engine per rank; rank r serves the requests with rid % world_size == r. Each loop:
    prefill every request that has arrived (prefill first, as vLLM's default scheduler does), then
    one decode step for all running requests."""
    _check(requests, n_blocks, block_size)
    engine, log = Engine(model, n_blocks, block_size), WorkerLog(comm.rank, "colocated")
    mine = deque(sorted((r for r in requests if r.rid % comm.world_size == comm.rank), key=lambda r: r.arrival))
    _warm_up(engine, min(requests, key=lambda r: r.arrival).prompt)      # the same warm-up on every rank
    t0 = _start_clock(comm)
    now = lambda: time.monotonic() - t0  # noqa: E731
    running: dict[int, ServeRequest] = {}
    while mine or running:
        while mine and mine[0].arrival <= now():
            r = mine.popleft()
            t = now()
            first = engine.prefill(r.rid, r.prompt)
            log.events.append(("prefill", t, now(), r.rid))
            log.outputs[r.rid], log.token_times[r.rid] = [first], [now()]
            if r.max_new_tokens > 1:
                running[r.rid] = r
            else:
                engine.alloc.free(r.rid)
        if running:
            _decode_step(engine, log, running, now)
        elif mine:
            time.sleep(max(0.0, min(0.01, mine[0].arrival - now())))
    return log


def disaggregated_worker(comm: Comm, model: Decoder, requests: list[ServeRequest], n_blocks: int = 64,
                         block_size: int = 16, *, send_kv: Callable, recv_kv: Callable) -> WorkerLog:
    """Rank 0 prefills each request when it arrives and sends its KV blocks to rank 1 with
    `send_kv(comm, 1, cache, table, n_tokens, first_token)`; rank 1 decodes. Between two decode
    steps rank 1 takes every transfer that is ready with `recv_kv(comm, 0, cache, alloc, seq)`
    (a counter tells it one is ready: a gloo receive cannot be polled)."""
    if comm.world_size != 2:
        raise ValueError(f"disaggregation here uses 2 ranks (0 prefills, 1 decodes), got world_size {comm.world_size}")
    _check(requests, n_blocks, block_size)
    order = sorted(requests, key=lambda r: r.arrival)
    engine = Engine(model, n_blocks, block_size)
    _warm_up(engine, order[0].prompt)                # as the colocated ranks do
    t0 = _start_clock(comm)
    now = lambda: time.monotonic() - t0  # noqa: E731
    if comm.rank == 0:
        return _prefill_worker(comm, engine, order, now, send_kv)
    log = WorkerLog(1, "decode")
    running: dict[int, ServeRequest] = {}
    taken = 0
    while taken < len(order) or running:
        while taken < len(order) and comm.counter(READY) > taken:
            r = order[taken]
            t = now()
            n_tokens, first = recv_kv(comm, 0, engine.cache, engine.alloc, r.rid)
            log.events.append(("recv", t, now(), r.rid))
            if n_tokens != len(r.prompt):
                raise ValueError(f"request {r.rid}: recv_kv returned n_tokens={n_tokens}, the prompt has {len(r.prompt)}")
            log.outputs[r.rid], log.token_times[r.rid] = [first], []
            taken += 1
            if r.max_new_tokens > 1:
                running[r.rid] = r
            else:
                engine.alloc.free(r.rid)
        if running:
            _decode_step(engine, log, running, now)
        else:
            time.sleep(0.001)
    return log


def _prefill_worker(comm: Comm, engine: Engine, order: list[ServeRequest], now: Callable[[], float],
                    send_kv: Callable) -> WorkerLog:
    """Rank 0: prefill each request when it arrives. A second thread sends finished requests' KV
    (it waits for rank 1 to take each one), so prefills never wait for the decoder. Only that thread
    communicates; the block allocator, shared by both threads, is guarded by a lock."""
    log, lock, ready = WorkerLog(0, "prefill"), threading.Lock(), queue.Queue()
    failed: list[BaseException] = []

    def sender() -> None:
        try:
            while (item := ready.get()) is not None:
                r, first = item
                with lock:
                    table = list(engine.alloc.block_tables[r.rid])
                comm.counter(READY, 1)                # "a request's KV is ready": rank 1 takes it between two steps
                t = now()
                sent = send_kv(comm, 1, engine.cache, table, len(r.prompt), first)
                log.events.append(("send", t, now(), r.rid))
                log.transfers.append((r.rid, int(sent), now() - t))
                with lock:
                    engine.alloc.free(r.rid)
        except BaseException as e:  # noqa: BLE001 - re-raised by the main thread
            failed.append(e)

    thread = threading.Thread(target=sender, name="kv-sender", daemon=True)
    thread.start()
    try:
        for r in order:
            while (wait := r.arrival - now()) > 0 and not failed:
                time.sleep(min(wait, 0.05))
            if failed:
                break
            t = now()
            with lock:
                slots = engine.alloc.append(r.rid, len(r.prompt))
            first = engine.prefill(r.rid, r.prompt, slots)
            log.events.append(("prefill", t, now(), r.rid))
            log.outputs[r.rid], log.token_times[r.rid] = [first], [now()]
            ready.put((r, first))
    finally:
        ready.put(None)
        thread.join()
    if failed:
        raise failed[0]
    return log


def merge_logs(logs: list[WorkerLog]) -> tuple[dict[int, list[int]], dict[int, list[float]]]:
    """Every request's new tokens and token times, from the workers that produced them (a request
    served disaggregated has its first token from the prefill worker, the rest from the decoder)."""
    outputs: dict[int, list[int]] = {}
    times: dict[int, list[float]] = {}
    for log in sorted(logs, key=lambda g: g.role != "prefill"):
        for rid, toks in log.outputs.items():
            if log.role == "decode":
                outputs[rid] = outputs.get(rid, [])[:1] + toks[1:]
            else:
                outputs[rid] = list(toks)
            times[rid] = times.get(rid, []) + list(log.token_times[rid])
    return outputs, times
