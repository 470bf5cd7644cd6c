"""Time a GPU kernel, not the Python that launches it, and not the L2 cache that holds its inputs.

`triton.testing.do_bench` records a CUDA event, calls the function, records another, and reads the
time between them. When Python needs longer to launch a call than the GPU needs to run it (a split-KV
decode call is two Triton launches, ~90 µs of CPU on the H100 we tried, for ~10 µs of GPU work),
the GPU sits idle between the events and do_bench measures Python. Engines do not pay that: they
replay their decode steps from CUDA graphs (lab 02).

`bench_replayed` therefore times calls replayed from a CUDA graph (`triton.testing.do_bench_cudagraph`,
which unrolls many calls into one graph and divides), and feeds each call its own copy of the
inputs, cycling through enough copies that their bytes exceed the L2 cache twice over: by the time
a copy comes round again, the cache holds the others, so every call reads its inputs from memory,
as a decode step does.

    ms = bench_replayed(paged_attention_split, q, k_cache, v_cache, tables, lens, scale)
"""
from __future__ import annotations

import itertools
from collections.abc import Callable

import torch


def copies_to_outrun_l2(nbytes: int, l2_bytes: int) -> int:
    """How many copies of `nbytes` of inputs make sure a copy has left an `l2_bytes` cache before
    it is read again: the other copies must fill the cache twice. At least 2."""
    if nbytes <= 0:
        raise ValueError(f"nbytes must be > 0 (the bytes of one call's tensor inputs), got {nbytes}")
    if l2_bytes < 0:
        raise ValueError(f"l2_bytes must be >= 0, got {l2_bytes}")
    return max(2, -(-2 * l2_bytes // nbytes) + 1)


def input_copies(args: tuple, l2_bytes: int) -> list[tuple]:
    """`args` followed by clones of it (tensors cloned, everything else shared), as many in all as
    `copies_to_outrun_l2` asks for."""
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    if not tensors:
        raise ValueError("bench_replayed needs at least one tensor argument (the inputs each call reads)")
    n = copies_to_outrun_l2(sum(t.numel() * t.element_size() for t in tensors), l2_bytes)
    return [args] + [tuple(a.clone() if isinstance(a, torch.Tensor) else a for a in args) for _ in range(n - 1)]


def bench_replayed(fn: Callable, *args, quantiles: list[float] | None = None, rep: int = 20):
    """Median milliseconds per call of `fn(*args)` on the GPU, replayed from a CUDA graph over
    copies of the tensor arguments that outrun the L2 cache (see the module's docstring). With
    `quantiles`, those quantiles instead, as `triton.testing.do_bench` returns them.

    `fn` should be capturable: no synchronization, no `.item()`, no copy from the host (an autotuned
    kernel tunes on the first, uncaptured call). One that is not is timed with do_bench instead,
    launches included, and a printed line says so."""
    if not callable(fn):
        raise TypeError(f"fn must be the function to time, got {type(fn).__name__}")
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    if not tensors:
        raise ValueError("bench_replayed needs at least one tensor argument (the inputs each call reads)")
    if not all(t.is_cuda for t in tensors):
        raise ValueError("bench_replayed times a GPU: every tensor argument must be on a CUDA device, got "
                         + ", ".join(sorted({str(t.device) for t in tensors})))
    import triton.testing

    l2 = torch.cuda.get_device_properties(tensors[0].device).L2_cache_size
    sets = itertools.cycle(input_copies(args, l2))
    torch.cuda.synchronize()             # the copies are made before the timing runs on its own stream
    try:
        return triton.testing.do_bench_cudagraph(lambda: fn(*next(sets)), rep=rep, quantiles=quantiles,
                                                 return_mode="median")
    except RuntimeError as e:            # a call a graph cannot hold (a .item(), a host copy, a sync)
        torch.cuda.synchronize()
        print(f"bench_replayed: {getattr(fn, '__name__', 'fn')} could not be captured in a CUDA graph "
              f"({str(e).splitlines()[0][:120]}); timed with triton.testing.do_bench instead, Python's launches included")
        return triton.testing.do_bench(lambda: fn(*next(sets)), quantiles=quantiles, return_mode="median")
