"""Lab 14's grouped-GEMM kernels on a GPU: compiled correctness, then time against the loop and dense.

    .venv/bin/python dev/moe_bench.py            # on a machine with CUDA (TRITON_INTERPRET unset)

1. fused_moe (course/moe/grouped_gemm.py) against dispatch.moe_reference in float32 (TF32 tensor cores:
   a 10-bit mantissa, so 1e-2 of the output's scale), fp16 and bf16 (3 ulps of the output's scale,
   from a float64 reference on the same rounded inputs), over edge cases: 1 token, idle experts,
   every pair on one expert, groups of exact block multiples.
2. The perf_report of grouped_gemm.make_benchmark: milliseconds per MoE layer vs tokens, for the
   course model's shape after MoEfication (E = 8, N = 192, C = 576, k = 2, bf16), the per-expert
   PyTorch loop and the dense MLP of the same width.
Not run by the tests (they use the interpreter and a compile check); no numbers from it are claimed yet.
"""
from __future__ import annotations

import os
import sys

if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
    sys.exit("run without TRITON_INTERPRET: this script checks the compiled kernels")

import torch

from course.kernels import run_perf_report
from course.moe.dispatch import moe_reference
from course.moe.grouped_gemm import fused_moe, make_benchmark
from course.moe.router import topk_route


def check() -> bool:
    ok = True
    g = torch.Generator(device="cuda").manual_seed(0)
    for T, E, k, N, C, skew in [(1, 8, 2, 192, 576, False), (37, 8, 2, 192, 576, False), (256, 8, 2, 192, 576, True),
                                (64, 4, 1, 64, 128, False), (1000, 16, 4, 96, 576, False)]:
        for dtype, tol in ((torch.float32, 1e-2), (torch.float16, 3 * 2 ** -10), (torch.bfloat16, 3 * 2 ** -7)):
            x = torch.randn(T, C, device="cuda", generator=g).to(dtype)
            wg, wu = (torch.randn(E, N, C, device="cuda", generator=g).mul(C ** -0.5).to(dtype) for _ in range(2))
            wd = torch.randn(E, C, N, device="cuda", generator=g).mul(N ** -0.5).to(dtype)
            ids, w = topk_route(torch.randn(T, E, device="cuda", generator=g), k)
            if skew:                                        # every token's first choice is expert 0: 256 rows, 4 blocks of 64
                ids[:, 0], ids[:, 1] = 0, torch.where(ids[:, 1] == 0, 1, ids[:, 1])
            got = fused_moe(x, wg, wu, wd, ids, w, block_m=64, block_n=64, block_k=64).double()
            want = moe_reference(x.double(), wg.double(), wu.double(), wd.double(), ids, w.double())
            err = float((got - want).abs().max() / want.abs().max())
            print(f"T={T:5d} E={E:2d} k={k} N={N} C={C} {str(dtype):15s} relative error {err:.1e} (tolerance {tol:.0e})"
                  f"{'' if err < tol else '  FAILED'}")
            ok &= err < tol
    return ok


if __name__ == "__main__":
    if not torch.cuda.is_available():
        sys.exit("no CUDA device: the tests check these kernels in the interpreter and compile them for sm_80/sm_90")
    passed = check()
    run_perf_report(make_benchmark(), print_data=True, show_plots=False)
    sys.exit(0 if passed else 1)
