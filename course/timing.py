"""Timing that tells the truth on CPU and GPU.

GPU work is asynchronous: a kernel launch returns before the GPU finishes, so a clock read without
synchronizing measures the launch, not the work. The first call of anything pays one-time costs
(allocator, kernel compilation, caches), so we warm up first. Machines are noisy, so we report the
median of several runs.
"""
from __future__ import annotations

import statistics
import time
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
