"""`run_threads`: W ranks as threads of this process, talking through `ThreadComm`.

Tests use it: threads start in microseconds, need no port, and leave nothing behind. It keeps the
rules of gloo so that code which passes here also runs in processes (`course.dist.launch`):

- `all_reduce` and `barrier` are collectives: every rank must call the same ones in the same
  order, with tensors of the same shape and dtype; each rank gets the sum in rank order, so all
  ranks hold bit-identical results (as gloo's all-reduce gives them);
- `send` returns only when the receiver has taken the message (gloo waits for the matching
  receive too), so two ranks that both `send` before they `recv` wait forever: here that is
  detected and reported as a deadlock instead of hanging;
- messages between two ranks arrive in the order they were sent; a receive buffer must have the
  dtype and number of elements of what is sent.

A rank that raises stops the others (they see `RankAborted`), and `run_threads` re-raises the
first error, with a note naming the rank.
"""
from __future__ import annotations

import os
import threading
import time
from collections import deque
from collections.abc import Callable

import torch

from course.dist.comm import Comm, Work

POLL_S = 0.02          # how often a blocked rank looks again
DEADLOCK_S = 0.5       # every live rank blocked, nothing moving for this long: a deadlock


class RankAborted(RuntimeError):
    """Raised inside a rank when another rank failed: its work is pointless now."""


class _Message:
    def __init__(self, tensor: torch.Tensor):
        self.tensor, self.taken, self.error = tensor, False, None


class _Posted:
    def __init__(self, buf: torch.Tensor):
        self.buf, self.filled, self.error = buf, False, None


class _World:
    """State shared by the ranks of one `run_threads` call."""

    def __init__(self, n: int, timeout: float):
        self.n, self.timeout = n, timeout
        self.cond = threading.Condition()
        self.slots: list = [None] * n            # what each rank brought to the current collective
        self.arrived, self.generation, self.result = 0, 0, None
        self.messages: dict[tuple[int, int], deque] = {}   # (src, dst) -> sent, not yet received
        self.posted: dict[tuple[int, int], deque] = {}     # (src, dst) -> receives waiting for a message
        self.finished: set[int] = set()
        self.failed: int | None = None           # the first rank that raised
        self.waiting: dict[int, str] = {}        # rank -> what it waits for
        self.progress = 0                        # bumps on every change: no change + all waiting = deadlock
        self.counters: dict[str, int] = {}

    def wait(self, rank: int, what: str, done: Callable[[], bool], peer: int | None = None) -> None:
        """Block (holding `cond`) until done(); fail clearly on an abort, a peer that left, a deadlock or the timeout."""
        start = time.monotonic()
        stuck_since, stuck_at = None, None
        self.waiting[rank] = what
        try:
            while not done():
                if self.failed is not None and self.failed != rank:
                    raise RankAborted(f"rank {rank} stopped: rank {self.failed} raised an error")
                gone = self.finished if peer is None else self.finished & {peer}
                if gone:
                    who = ", ".join(str(r) for r in sorted(gone))
                    raise RuntimeError(f"rank {rank} waits in {what}, but rank {who} already returned: every send needs "
                                       f"a matching recv, and every rank must call the same collectives in the same order")
                live = self.n - len(self.finished)
                if len(self.waiting) == live:
                    if stuck_at != self.progress:
                        stuck_since, stuck_at = time.monotonic(), self.progress
                    elif time.monotonic() - stuck_since > DEADLOCK_S:
                        state = "; ".join(f"rank {r} in {w}" for r, w in sorted(self.waiting.items()))
                        raise RuntimeError(f"deadlock: every rank is waiting ({state}). A blocking send waits for its "
                                           f"receiver: when two ranks both send first, use isend, then recv, then wait")
                else:
                    stuck_since, stuck_at = None, None
                if time.monotonic() - start > self.timeout:
                    raise TimeoutError(f"rank {rank} waited more than {self.timeout:g} s in {what}")
                self.cond.wait(POLL_S)
        finally:
            del self.waiting[rank]

    def exchange(self, rank: int, what: str, value) -> list:
        """A collective: every rank brings (what, value); all get the list of everyone's, in rank order."""
        with self.cond:
            self.slots[rank] = (what, value)
            self.arrived += 1
            self.progress += 1
            gen = self.generation
            if self.arrived == self.n:
                self.result = (gen, list(self.slots))
                self.slots, self.arrived = [None] * self.n, 0
                self.generation += 1
                self.cond.notify_all()
            else:
                self.wait(rank, what, lambda: self.generation != gen)
            got_gen, values = self.result
            assert got_gen == gen
        kinds = [w for w, _ in values]
        if len(set(kinds)) > 1:
            raise RuntimeError("ranks called different collectives at the same point: "
                               + ", ".join(f"rank {r}: {w}" for r, w in enumerate(kinds)))
        return [v for _, v in values]


class _SendWork(Work):
    def __init__(self, world: _World, rank: int, dst: int, msg: _Message):
        self.world, self.rank, self.dst, self.msg = world, rank, dst, msg

    def wait(self) -> bool:
        with self.world.cond:
            self.world.wait(self.rank, f"send to rank {self.dst}", lambda: self.msg.taken, peer=self.dst)
        if self.msg.error:
            raise ValueError(self.msg.error)
        return True

    def is_completed(self) -> bool:
        return self.msg.taken


class _RecvWork(Work):
    def __init__(self, world: _World, rank: int, src: int, posted: _Posted):
        self.world, self.rank, self.src, self.posted = world, rank, src, posted

    def wait(self) -> bool:
        with self.world.cond:
            self.world.wait(self.rank, f"recv from rank {self.src}", lambda: self.posted.filled, peer=self.src)
        if self.posted.error:
            raise ValueError(self.posted.error)
        return True

    def is_completed(self) -> bool:
        return self.posted.filled


def _deliver(msg: _Message, posted: _Posted, src: int, dst: int) -> None:
    """Copy a message into a posted buffer, or record why it cannot go there (on both ends)."""
    t, buf = msg.tensor, posted.buf
    if t.dtype != buf.dtype or t.numel() != buf.numel():
        msg.error = posted.error = (
            f"rank {src} sent a tensor of shape {tuple(t.shape)} ({t.dtype}) to rank {dst}, whose receive buffer has "
            f"shape {tuple(buf.shape)} ({buf.dtype}): a receiver must know what comes (send the sizes first)")
    else:
        buf.copy_(t.view(buf.shape))
    msg.taken = posted.filled = True


class ThreadComm(Comm):
    """One rank of a `run_threads` world."""

    backend = "threads"

    def __init__(self, world: _World, rank: int):
        super().__init__(rank, world.n)
        self._world = world

    def _all_reduce(self, x):
        values = self._world.exchange(self.rank, "all_reduce", (tuple(x.shape), x.dtype, x.detach().clone()))
        shapes = {(s, d) for s, d, _ in values}
        if len(shapes) > 1:
            raise ValueError("all_reduce needs the same shape and dtype on every rank, got "
                             + ", ".join(f"rank {r}: {tuple(s)} {d}" for r, (s, d, _) in enumerate(values)))
        total = values[0][2].clone()
        for _, _, t in values[1:]:
            total += t
        x.copy_(total)

    def _barrier(self):
        self._world.exchange(self.rank, "barrier", None)

    def _counter(self, key, add):
        w = self._world
        with w.cond:
            w.counters[key] = w.counters.get(key, 0) + add
            if add:
                w.progress += 1
                w.cond.notify_all()
            return w.counters[key]

    def _isend(self, x, dst):
        w = self._world
        msg = _Message(x.detach().clone())
        with w.cond:
            waiting = w.posted.get((self.rank, dst))
            if waiting:
                _deliver(msg, waiting.popleft(), self.rank, dst)
            else:
                w.messages.setdefault((self.rank, dst), deque()).append(msg)
            w.progress += 1
            w.cond.notify_all()
        return _SendWork(w, self.rank, dst, msg)

    def _irecv(self, buf, src):
        w = self._world
        posted = _Posted(buf)
        with w.cond:
            queued = w.messages.get((src, self.rank))
            if queued:
                _deliver(queued.popleft(), posted, src, self.rank)
            else:
                w.posted.setdefault((src, self.rank), deque()).append(posted)
            w.progress += 1
            w.cond.notify_all()
        return _RecvWork(w, self.rank, src, posted)


def _wait_until_gone(threads: list[threading.Thread], limit_s: float = 2.0) -> None:
    """Wait until the joined threads have left the OS too. `join` returns before a thread's C-level
    exit: MKL then frees the thread's matmul buffers under a spin lock, and a process forked at that
    moment (`course.dist.launch`, right after) inherits the lock held and spins in its first matmul."""
    deadline = time.monotonic() + limit_s
    for t in threads:
        while t.native_id is not None and os.path.exists(f"/proc/self/task/{t.native_id}") and time.monotonic() < deadline:
            time.sleep(0.001)


def run_threads(fn: Callable, world_size: int, *args, timeout: float = 60.0, **kwargs) -> list:
    """Run `fn(comm, *args, **kwargs)` on `world_size` ranks, each a thread with its own `ThreadComm`.
    Returns the ranks' return values, in rank order. If a rank raises, the others are stopped and
    the first error (lowest rank among those that raised first) is raised here."""
    if not callable(fn):
        raise TypeError(f"fn must be a function fn(comm, ...), got {type(fn).__name__}")
    if type(world_size) is not int or not 1 <= world_size <= 64:
        raise ValueError(f"world_size must be an int in 1..64, got {world_size!r}")
    if not timeout > 0:
        raise ValueError(f"timeout must be > 0 seconds, got {timeout!r}")
    world = _World(world_size, timeout)
    results: list = [None] * world_size
    errors: list[BaseException | None] = [None] * world_size

    def rank_main(rank: int) -> None:
        comm = ThreadComm(world, rank)
        try:
            results[rank] = fn(comm, *args, **kwargs)
        except RankAborted as e:
            errors[rank] = e
        except BaseException as e:  # noqa: BLE001 - handed to the caller below
            errors[rank] = e
            with world.cond:
                if world.failed is None:
                    world.failed = rank
                world.cond.notify_all()
        finally:
            with world.cond:
                world.finished.add(rank)
                world.progress += 1
                world.cond.notify_all()

    threads = [threading.Thread(target=rank_main, args=(r,), name=f"course-rank-{r}", daemon=True)
               for r in range(world_size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout + 5)
    if any(t.is_alive() for t in threads):
        raise TimeoutError(f"ranks {[r for r, t in enumerate(threads) if t.is_alive()]} did not finish")
    _wait_until_gone(threads)
    first = world.failed
    if first is None:   # only aborts (cannot happen without a failure) or success
        first = next((r for r, e in enumerate(errors) if e is not None), None)
    if first is not None:
        err = errors[first]
        if hasattr(err, "add_note"):
            err.add_note(f"(raised in rank {first} of {world_size})")
        raise err
    return results
