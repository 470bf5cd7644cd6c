"""`launch`: W real processes on this machine, one `torch.distributed` rank each, from a notebook.

    results = launch(fn, 3, model, prompt)       # fn(comm, model, prompt) runs in ranks 0, 1, 2

Why fork: a function defined in a notebook cell lives in the kernel's `__main__`, which a freshly
started ("spawn") process cannot import, so it could not run it. A forked child is a copy of the
kernel: it has the function, the model and every argument already, with no pickling and no copy
of the weights (pages are shared until written). Forking a process that has used threads has two
known traps, and both are handled here:

- OpenMP: a child that enters a parallel region of the thread pool it inherited (torch on CPU)
  hangs. Each rank therefore sets `torch.set_num_threads(1)` before anything else: one thread per
  rank, which is what W ranks sharing a few cores want anyway.
- CUDA cannot be used in a forked child of a process that initialized it. Ranks here work on CPU
  tensors with gloo; on a machine with several GPUs, run the same rank function under `torchrun`
  with NCCL (`init_from_env`, and `course.dist.torchrun_tp` for the tensor-parallel model).

The ranks meet over TCP on 127.0.0.1 (a free port, found by binding port 0) as torchrun's ranks
do, with gloo on the loopback interface (`GLOO_SOCKET_IFNAME=lo`). Each rank's stdout and stderr go
to files; its prints are shown here afterwards, prefixed with its rank. Nothing is left running: when a rank raises, dies or
the timeout passes, or the caller is interrupted, every rank is killed and reaped before
`launch` raises, and a rank whose parent disappears exits by itself.
"""
from __future__ import annotations

import datetime
import os
import pickle
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
import traceback
import warnings
from collections.abc import Callable

import torch

from course.dist.comm import TorchComm

MAX_WORLD = 16


class RankError(RuntimeError):
    """A rank raised: the message holds its error and the end of its traceback."""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now (the OS picks it when we bind port 0)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(fn: Callable, world_size: int, *args, timeout: float = 120.0, quiet: bool = False, **kwargs) -> list:
    """Run `fn(comm, *args, **kwargs)` in `world_size` forked processes, rank r getting a `TorchComm`
    (gloo, CPU tensors) with `comm.rank == r`. Returns the ranks' return values (pickled back), in
    rank order. Raises RankError if a rank raises or dies, TimeoutError after `timeout` seconds;
    either way every rank is stopped first. `quiet`: do not show what the ranks printed."""
    if not callable(fn):
        raise TypeError(f"fn must be a function fn(comm, ...), got {type(fn).__name__}")
    if type(world_size) is not int or not 1 <= world_size <= MAX_WORLD:
        raise ValueError(f"world_size must be an int in 1..{MAX_WORLD}, got {world_size!r}")
    if not (isinstance(timeout, (int, float)) and timeout > 0):
        raise ValueError(f"timeout must be a number of seconds > 0, got {timeout!r}")
    if not hasattr(os, "fork"):
        raise RuntimeError("launch forks the notebook's process, which this system cannot do (Windows): "
                           "use WSL or Linux, or run the ranks under torchrun")
    import multiprocessing as mp
    from multiprocessing.connection import wait

    ctx = mp.get_context("fork")
    port, logs = free_port(), tempfile.mkdtemp(prefix="course-dist-")
    parent = os.getpid()
    procs, conns = [], []
    results: dict[int, object] = {}
    try:
        with warnings.catch_warnings():   # Python >= 3.12 warns about forking a multi-threaded process
            warnings.simplefilter("ignore", DeprecationWarning)
            for rank in range(world_size):
                read, write = ctx.Pipe(duplex=False)
                p = ctx.Process(target=_rank_main, name=f"course-rank-{rank}", daemon=True,
                                args=(fn, rank, world_size, port, timeout, write, logs, parent, args, kwargs))
                p.start()
                write.close()                     # the child holds the write end now
                procs.append(p)
                conns.append(read)
        deadline = time.monotonic() + timeout
        pending = set(range(world_size))
        while pending:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"ranks {sorted(pending)} of {world_size} did not finish within {timeout:g} s: "
                                   f"a deadlock? (every send needs a matching recv, every rank must call the same "
                                   f"collectives in the same order)" + _tails(logs, sorted(pending)))
            ready = wait([conns[r] for r in pending] + [procs[r].sentinel for r in pending], timeout=min(left, 1.0))
            for r in sorted(pending):
                if conns[r] in ready or procs[r].sentinel in ready:
                    status = _read(conns[r])
                    if status is None:   # died without a word: a crash, a kill, a memory limit
                        procs[r].join(1)
                        raise RankError(f"rank {r} of {world_size} died ({_exit_reason(procs[r].exitcode)}) before "
                                        f"returning" + _tails(logs, [r]))
                    if status[0] == "error":
                        _, name, message, tb = status
                        raise RankError(f"rank {r} of {world_size} raised {name}: {message}\n"
                                        f"--- traceback in rank {r} ---\n{_short(tb)}")
                    results[r] = status[1]
                    pending.discard(r)
        for p in procs:
            p.join(10)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
        for p in procs:
            p.join(5)
        for c in conns:
            c.close()
        if not quiet:
            _show_prints(logs, world_size)
        shutil.rmtree(logs, ignore_errors=True)
    return [results[r] for r in range(world_size)]


def _rank_main(fn, rank, world_size, port, timeout, conn, logs, parent, args, kwargs) -> None:
    """The body of one forked rank. Never returns: os._exit skips the kernel's exit handlers."""
    torch.set_num_threads(1)             # first: an inherited OpenMP pool hangs a forked child
    out = os.open(os.path.join(logs, f"rank{rank}.out"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    err = os.open(os.path.join(logs, f"rank{rank}.err"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.dup2(out, 1)                      # C++ (gloo) output too: not into the notebook's streams
    os.dup2(err, 2)
    sys.stdout = open(1, "w", buffering=1, closefd=False)
    sys.stderr = open(2, "w", buffering=1, closefd=False)
    signal.signal(signal.SIGINT, signal.SIG_DFL)   # an interrupt of the kernel's group stops ranks at once
    threading.Thread(target=_watch_parent, args=(parent,), daemon=True).start()
    code = 0
    try:
        import torch.distributed as dist

        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                          WORLD_SIZE=str(world_size))
        loopback = _loopback_interface()
        if loopback:                         # gloo would otherwise look up the host name (unknown in a sandbox)
            os.environ["GLOO_SOCKET_IFNAME"] = loopback
        wait_s = datetime.timedelta(seconds=timeout + 60)   # the launcher's own timeout stops the ranks first
        store = dist.TCPStore("127.0.0.1", port, world_size, is_master=rank == 0, timeout=wait_s)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size, timeout=wait_s)
        try:
            result = fn(TorchComm(store), *args, **kwargs)
            payload = pickle.dumps(("ok", result))
        except BaseException as e:  # noqa: BLE001 - reported to the parent
            payload = pickle.dumps(("error", type(e).__name__, str(e), traceback.format_exc()))
            code = 1
        conn.send_bytes(payload)
        if code == 0:
            dist.barrier()                   # nobody tears down its sockets while a peer still needs them
        dist.destroy_process_group()
    except BaseException as e:  # noqa: BLE001 - setup failed, or the result does not pickle
        try:
            conn.send_bytes(pickle.dumps(("error", type(e).__name__, str(e), traceback.format_exc())))
        except Exception:  # noqa: BLE001
            pass
        code = 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _loopback_interface() -> str | None:
    """The loopback network interface: "lo" on Linux, "lo0" on macOS; None if there is none by that name."""
    try:
        names = [name for _, name in socket.if_nameindex()]
    except OSError:
        return None
    return "lo" if "lo" in names else next((n for n in names if n.startswith("lo")), None)


def _watch_parent(parent: int) -> None:
    """In a rank: exit when the process that launched us is gone (no orphan outlives its kernel)."""
    while os.getppid() == parent:
        time.sleep(0.5)
    os._exit(1)


def _read(conn):
    """The rank's report, or None when it closed its pipe without one."""
    try:
        if conn.poll():
            return pickle.loads(conn.recv_bytes())
    except (EOFError, OSError):
        return None
    return None


def _exit_reason(code: int | None) -> str:
    if code is None:
        return "still running"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


def _short(tb: str, lines: int = 12) -> str:
    """The end of a traceback: where it was raised matters, the launcher's frames do not."""
    kept = tb.strip().splitlines()
    return "\n".join(kept[-lines:])


def _tails(logs: str, ranks: list[int]) -> str:
    """The last lines each rank wrote to stderr, for an error message."""
    parts = []
    for r in ranks:
        try:
            with open(os.path.join(logs, f"rank{r}.err"), errors="replace") as f:
                text = f.read().strip()
        except OSError:
            continue
        if text:
            parts.append(f"\n--- end of rank {r}'s stderr ---\n" + "\n".join(text.splitlines()[-8:]))
    return "".join(parts)


def _show_prints(logs: str, world_size: int) -> None:
    for r in range(world_size):
        try:
            with open(os.path.join(logs, f"rank{r}.out"), errors="replace") as f:
                text = f.read()
        except OSError:
            continue
        for line in text.splitlines():
            print(f"[rank {r}] {line}")


def init_from_env(backend: str | None = None) -> TorchComm:
    """Under torchrun (which sets RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT): join the
    process group and return this rank's `TorchComm`. backend None: NCCL when this machine has a GPU
    for each of its local ranks (each rank then uses cuda:LOCAL_RANK), else gloo on CPU."""
    import torch.distributed as dist

    missing = [k for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
    if missing:
        raise RuntimeError(f"init_from_env needs the variables torchrun sets; missing {missing}. "
                           f"Start with: torchrun --nproc-per-node=N your_script.py")
    local = int(os.environ["LOCAL_RANK"])
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ["WORLD_SIZE"]))
    if backend is None:   # every rank must choose the same: NCCL only if this node has a GPU for each of its ranks
        backend = "nccl" if torch.cuda.is_available() and torch.cuda.device_count() >= local_world else "gloo"
    if backend not in ("nccl", "gloo"):
        raise ValueError(f"backend must be 'nccl' or 'gloo', got {backend!r}")
    if backend == "nccl":
        torch.cuda.set_device(local)
    if not dist.is_initialized():
        dist.init_process_group(backend)
    from torch.distributed import distributed_c10d

    return TorchComm(getattr(distributed_c10d, "_get_default_store", lambda: None)())
