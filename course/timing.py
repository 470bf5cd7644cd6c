"""Timing that tells the truth on CPU and GPU.

GPU work is asynchronous: a kernel launch returns before the GPU finishes, so a clock read without
synchronizing measures the launch, not the work. The first call of anything pays one-time costs
(allocator, kernel compilation, caches), so we warm up first. Machines are noisy, so we report the
median of several runs. `profile_step` shows where one step's time goes (how many ops or kernels,
how long the device was busy), `launch_cost` what handing out one op costs the host, and
`count_ops` how many of a call's ops compute something (the same count on every run).
"""
from __future__ import annotations

import collections
import math
import statistics
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable

import torch


def synchronize(device: str | torch.device | None = None) -> None:
    """Wait for queued GPU work to finish (a no-op on CPU)."""
    dev = torch.device(device) if device is not None else None
    if (dev is None or dev.type == "cuda") and torch.cuda.is_available():
        torch.cuda.synchronize(dev)


def clock(device: str | torch.device | None = None) -> float:
    """Seconds on a monotonic clock, after the device has finished all queued work."""
    synchronize(device)
    return time.perf_counter()


@dataclass
class Timing:
    """Seconds per run: `median` is what to report, `runs` shows the spread."""

    runs: list[float] = field(default_factory=list)

    @property
    def median(self) -> float:
        return statistics.median(self.runs)

    @property
    def spread(self) -> float:
        """(max - min) / median: above ~0.2, the machine was busy; take more runs."""
        return (max(self.runs) - min(self.runs)) / self.median if self.median else 0.0

    def __repr__(self) -> str:
        return f"Timing(median={self.median * 1e3:.2f} ms, runs={len(self.runs)}, spread={self.spread:.0%})"


def benchmark(fn: Callable[[], object], *, warmup: int = 1, repeats: int = 5,
              device: str | torch.device | None = None) -> Timing:
    """Time `fn()`: `warmup` untimed calls, then `repeats` timed ones, each bracketed by syncs."""
    if warmup < 0 or repeats < 1:
        raise ValueError(f"need warmup >= 0 and repeats >= 1, got warmup={warmup}, repeats={repeats}")
    with torch.inference_mode():
        for _ in range(warmup):
            fn()
        runs = []
        for _ in range(repeats):
            start = clock(device)
            fn()
            runs.append(clock(device) - start)
    return Timing(runs)


class TokenTimer:
    """Records when each streamed token arrives, as a transformers streamer.

        timer = TokenTimer()
        model.generate(ids, streamer=timer, max_new_tokens=20)
        timer.times   # seconds since start, one per generated token

    `generate` first hands the streamer the prompt (ignored here), then each new token.
    """

    def __init__(self, device: str | torch.device | None = None):
        self.device = device
        self.start = clock(device)
        self.times: list[float] = []
        self.tokens: list[int] = []
        self._seen_prompt = False

    def put(self, value: torch.Tensor) -> None:
        if not self._seen_prompt:
            self._seen_prompt = True
            return
        now = clock(self.device) - self.start
        for tok in value.reshape(-1).tolist():
            self.tokens.append(int(tok))
            self.times.append(now)

    def end(self) -> None:
        pass


# --- where the time of one step goes -----------------------------------------------------------------

@dataclass
class StepProfile:
    """One call of a step, profiled. `n_launches`: the work items the host handed out one by one
    (GPU kernels and copies on a GPU; aten ops called from Python on a CPU); `busy_s`: the time the
    device spent computing them; `intervals`: when (seconds from the first one), for a timeline."""

    device: str
    n_launches: int
    busy_s: float
    span_s: float                                      # first start to last end, as profiled
    intervals: list[tuple[float, float]] = field(default_factory=list)
    by_name: list[tuple[str, int, float]] = field(default_factory=list)   # (name, count, seconds), most time first

    @property
    def idle_share(self) -> float:
        """Share of the profiled span in which the device computed nothing (waiting for the host); nan
        when the profile timed nothing (a GPU profile without CUPTI records no device activity)."""
        if not self.span_s or math.isnan(self.busy_s):
            return float("nan")
        return max(0.0, 1 - self.busy_s / self.span_s)

    def table(self, n: int = 8) -> str:
        """The `n` names that took the most time: count, total and mean time each."""
        kind = "GPU kernels and copies" if self.device.startswith("cuda") else "aten ops (CPU)"
        lines = [f"{kind}: {self.n_launches} in one step, busy {self.busy_s * 1e3:.2f} ms of "
                 f"{self.span_s * 1e3:.2f} ms ({1 - self.idle_share:.0%})",
                 f"{'name':44} {'count':>6} {'total ms':>9} {'mean us':>8}"]
        for name, count, secs in self.by_name[:n]:
            lines.append(f"{name[:44]:44} {count:6d} {secs * 1e3:9.3f} {secs / count * 1e6:8.1f}")
        return "\n".join(lines)


@contextmanager
def _quiet_stderr_fd():
    """The profiler's C++ side prints start/stop lines straight to file descriptor 2: hide them."""
    import os
    import sys

    sys.stderr.flush()
    saved = os.dup(2)
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 2)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)


def profile_step(fn: Callable[[], object], device: str | torch.device | None = None, *, warmup: int = 1) -> StepProfile:
    """Profile one call of `fn` with torch.profiler (after `warmup` calls): on a GPU its kernels and
    copies, on a CPU the aten ops Python called (the nested ones inside them are part of their time)."""
    from collections import defaultdict
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    gpu = torch.device(device).type == "cuda" if device is not None else False
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if gpu else [])
    with torch.inference_mode():
        for _ in range(warmup):
            fn()
        synchronize(device)
        with _quiet_stderr_fd():
            prof = profile(activities=activities)
            prof.start()
        try:
            fn()
            synchronize(device)
        finally:
            with _quiet_stderr_fd():
                prof.stop()
    events = prof.events()
    if gpu:
        work = [e for e in events if e.device_type == DeviceType.CUDA]
        if not work:              # no GPU activity recorded (no CUPTI): count the launches the CPU made instead
            launches = [e for e in events if "LaunchKernel" in e.name or "MemcpyAsync" in e.name]
            return StepProfile(str(device), len(launches), float("nan"), 0.0, [],
                               [(e.name, 1, (e.time_range.end - e.time_range.start) / 1e6) for e in launches[:1]])
    else:
        work = [e for e in events if e.device_type == DeviceType.CPU and e.name.startswith("aten::")
                and (e.cpu_parent is None or not e.cpu_parent.name.startswith("aten::"))]
    if not work:
        return StepProfile(str(device or "cpu"), 0, 0.0, 0.0)
    t0 = min(e.time_range.start for e in work)
    intervals = sorted(((e.time_range.start - t0) / 1e6, (e.time_range.end - t0) / 1e6) for e in work)
    busy, end = 0.0, 0.0                                   # union of the intervals: overlaps count once
    for a, b in intervals:
        if b > end:
            busy += b - max(a, end)
            end = b
    totals: dict[str, list] = defaultdict(lambda: [0, 0.0])
    for e in work:
        totals[e.name][0] += 1
        totals[e.name][1] += (e.time_range.end - e.time_range.start) / 1e6
    by_name = sorted(((k, c, s) for k, (c, s) in totals.items()), key=lambda r: -r[2])
    return StepProfile(str(device or "cpu"), len(work), busy, intervals[-1][1] if intervals else 0.0,
                       intervals, by_name)


def launch_cost(device: str | torch.device | None = None, n: int = 200, repeats: int = 5) -> float:
    """Seconds the host needs to hand out one tiny op (`x.add_(1)` on a 1-element tensor), the
    smallest unit of work: PyTorch's dispatch, and on a GPU the kernel launch. Median per op."""
    x = torch.zeros(1, device=device)

    def burst():
        for _ in range(n):
            x.add_(1)

    return benchmark(burst, warmup=1, repeats=repeats, device=device).median / n


def storages(tree) -> set[int]:
    """The addresses of the memory that the tensors in `tree` (nested lists, tuples, dicts) live in."""
    from torch.utils._pytree import tree_flatten

    return {t.untyped_storage().data_ptr() for t in tree_flatten(tree)[0] if isinstance(t, torch.Tensor)}


def op_writes(func, args: tuple, kwargs: dict, out) -> str | None:
    """What one ATen op call wrote: "in place" (one of its arguments), "new" (fresh tensors), or None
    for a view, which only relabels memory it was given (its schema says so, or its output lives
    in an argument's memory: `_unsafe_view` is a view its schema does not mark)."""
    schema = func._schema
    if any(a.alias_info is not None and a.alias_info.is_write for a in schema.arguments):
        return "in place"
    if any(r.alias_info is not None for r in schema.returns) or storages(out) & storages((args, kwargs)):
        return None
    return "new"


def count_ops(fn: Callable[[], object]) -> collections.Counter:
    """The ATen ops one call of `fn` runs that compute something, by name: each writes memory, in
    place or into a new tensor (`op_writes`), and is a kernel (or more) on a GPU. Views (`view`,
    `transpose`, slicing), which only relabel memory, are left out. Unlike a profile, the count is
    the same on every run and, for ops that are one kernel on a GPU, the same on every device; a
    composite op counts as the ops it runs on this device (`F.rms_norm` is five on a CPU, one fused
    kernel on CUDA), so a GPU's count can be lower: lab 03's cache step counts 1159 on a CPU, 917
    on an H100."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Counter(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.counts: collections.Counter = collections.Counter()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            out = func(*args, **kwargs)
            if op_writes(func, args, kwargs, out):
                self.counts[func.overloadpacket.__name__] += 1
            return out

    with torch.no_grad(), Counter() as counter:
        fn()
    return counter.counts
