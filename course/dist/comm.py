"""The communicator that every distributed function of lab 12 talks through.

A rank never calls `torch.distributed` directly: it gets a `comm` and calls

    comm.rank, comm.world_size          who am I, how many of us
    comm.all_reduce(x)                  x (in place) becomes the sum of every rank's x
    comm.send(x, dst) / comm.recv(buf, src)        point to point; recv fills `buf` in place
    comm.isend(x, dst) / comm.irecv(buf, src)      the same, started now; `.wait()` finishes it
    comm.barrier()

as `torch.distributed` defines them (vLLM wraps its process groups the same way, in a
`GroupCoordinator`). A wrapper buys two things: every call is counted (`comm.stats`: calls,
payload bytes, a log of what was sent where), which is how the lab measures communication; and
the same code runs on two transports: real processes over `torch.distributed` (`TorchComm`, made
by `course.dist.launch`), or threads of one process (`ThreadComm`, `course.dist.run_threads`),
which the tests use because they are fast and start no process.

Semantics follow gloo, so code that works on threads works on processes: a blocking `send`
returns only once the receiver has taken the message (two ranks that both send first wait for
each other forever), and every rank must make the same collective calls in the same order.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class CommStats:
    """What one rank communicated. Bytes are payload bytes (the tensors' `nbytes`), not headers."""

    all_reduce_calls: int = 0
    all_reduce_bytes: int = 0        # the buffers handed to all_reduce, once per call
    sends: int = 0
    bytes_sent: int = 0
    recvs: int = 0
    bytes_received: int = 0
    log: list = field(default_factory=list)   # ("all_reduce", shape) | ("send", dst, shape) | ("recv", src, shape)

    def reset(self) -> None:
        """Zero every counter (e.g. after a warm-up run)."""
        self.__init__()


class Work:
    """A started operation: `wait()` blocks until it is done (torch.distributed's Work does the same)."""

    def wait(self) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


class Comm:
    """Checks and counting shared by every transport; subclasses move the bytes."""

    backend = "none"

    def __init__(self, rank: int, world_size: int):
        if type(world_size) is not int or world_size < 1:
            raise ValueError(f"world_size must be an int >= 1, got {world_size!r}")
        if type(rank) is not int or not 0 <= rank < world_size:
            raise ValueError(f"rank must be an int in 0..{world_size - 1}, got {rank!r}")
        self.rank, self.world_size = rank, world_size
        self.stats = CommStats()

    def __repr__(self) -> str:
        return f"{type(self).__name__}(rank={self.rank}, world_size={self.world_size}, backend={self.backend!r})"

    # --- what ranks call --------------------------------------------------------------------------
    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum `x` over all ranks, in place; every rank ends with the same sum. Returns `x`."""
        self._check(x, "all_reduce", "x")
        self.stats.all_reduce_calls += 1
        self.stats.all_reduce_bytes += x.nbytes
        self.stats.log.append(("all_reduce", tuple(x.shape)))
        if self.world_size > 1:
            self._all_reduce(x)
        return x

    def isend(self, x: torch.Tensor, dst: int) -> Work:
        """Start sending `x` to rank `dst`. Do not change `x` until `.wait()` has returned."""
        self._check(x, "isend", "x")
        self._peer(dst, "isend", "dst")
        self.stats.sends += 1
        self.stats.bytes_sent += x.nbytes
        self.stats.log.append(("send", dst, tuple(x.shape)))
        return self._isend(x, dst)

    def irecv(self, buf: torch.Tensor, src: int) -> Work:
        """Start receiving into `buf` (its shape and dtype must be those the sender sends) from rank `src`."""
        self._check(buf, "irecv", "buf")
        self._peer(src, "irecv", "src")
        self.stats.recvs += 1
        self.stats.bytes_received += buf.nbytes
        self.stats.log.append(("recv", src, tuple(buf.shape)))
        return self._irecv(buf, src)

    def send(self, x: torch.Tensor, dst: int) -> None:
        """Send `x` to rank `dst`; returns once `dst` has received it."""
        self.isend(x, dst).wait()

    def recv(self, buf: torch.Tensor, src: int) -> torch.Tensor:
        """Receive from rank `src` into `buf`, in place. Returns `buf`."""
        self.irecv(buf, src).wait()
        return buf

    def barrier(self) -> None:
        """Wait until every rank has called barrier."""
        if self.world_size > 1:
            self._barrier()

    def counter(self, key: str, add: int = 0) -> int:
        """A counter every rank shares, without waiting for anyone: add `add` to counter `key` and
        return its new value (add=0 reads it). A rank uses it to tell another "a message is ready"
        that the other can check between two steps of its own work (a gloo receive cannot be polled)."""
        if not isinstance(key, str) or not key:
            raise ValueError(f"key must be a non-empty str, got {key!r}")
        if type(add) is not int:
            raise TypeError(f"add must be an int, got {type(add).__name__}")
        return self._counter(key, add)

    # --- checks ------------------------------------------------------------------------------------
    def _check(self, x, op: str, name: str) -> None:
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"comm.{op}: {name} must be a torch.Tensor, got {type(x).__name__}")
        if not x.is_contiguous():
            raise ValueError(f"comm.{op}: {name} must be contiguous (its bytes in one run): call .contiguous() first")

    def _peer(self, peer, op: str, name: str) -> None:
        if type(peer) is not int or not 0 <= peer < self.world_size or peer == self.rank:
            raise ValueError(f"comm.{op}: {name} must be another rank, an int in 0..{self.world_size - 1} other than "
                             f"this rank ({self.rank}), got {peer!r}")

    # --- transports --------------------------------------------------------------------------------
    def _all_reduce(self, x: torch.Tensor) -> None:
        raise NotImplementedError

    def _isend(self, x: torch.Tensor, dst: int) -> Work:
        raise NotImplementedError

    def _irecv(self, buf: torch.Tensor, src: int) -> Work:
        raise NotImplementedError

    def _barrier(self) -> None:
        raise NotImplementedError

    def _counter(self, key: str, add: int) -> int:
        raise NotImplementedError


class TorchComm(Comm):
    """`torch.distributed` on the default process group (gloo on CPU tensors, NCCL on GPUs)."""

    def __init__(self, store=None):
        import torch.distributed as dist

        if not dist.is_initialized():
            raise RuntimeError("torch.distributed is not initialized: start the ranks with course.dist.launch "
                               "(or under torchrun, call course.dist.init_from_env() first)")
        super().__init__(dist.get_rank(), dist.get_world_size())
        self.backend = str(dist.get_backend())
        self._dist, self._store = dist, store

    def _all_reduce(self, x):
        self._dist.all_reduce(x)

    def _isend(self, x, dst):
        return self._dist.isend(x, dst)

    def _irecv(self, buf, src):
        return self._dist.irecv(buf, src)

    def _barrier(self):
        self._dist.barrier()

    def _counter(self, key, add):
        if self._store is None:
            raise RuntimeError("this TorchComm has no key-value store for counters")
        return int(self._store.add(f"course/{key}", add))


class CustomAllReduce(Comm):
    """`comm` with its all_reduce done by `fn(x, comm)` (a hand-written ring, say). Everything else goes
    to `comm` itself, whose counters then show the bytes `fn` really sent."""

    def __init__(self, comm: Comm, fn):
        if not isinstance(comm, Comm):
            raise TypeError(f"comm must be a Comm, got {type(comm).__name__}")
        if not callable(fn):
            raise TypeError(f"fn must be a function fn(x, comm), got {type(fn).__name__}")
        super().__init__(comm.rank, comm.world_size)
        self.inner, self.fn = comm, fn
        self.backend = f"{comm.backend}, all-reduce by {getattr(fn, '__name__', 'fn')}"

    def _all_reduce(self, x):
        self.fn(x, self.inner)

    def _isend(self, x, dst):
        return self.inner.isend(x, dst)

    def _irecv(self, buf, src):
        return self.inner.irecv(buf, src)

    def _barrier(self):
        self.inner.barrier()

    def _counter(self, key, add):
        return self.inner.counter(key, add)
