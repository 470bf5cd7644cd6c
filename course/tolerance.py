"""How far apart two computation orders of one float computation may land, for tests.

Cached vs uncached, batched vs one by one, graph vs eager, paged vs contiguous, our decoder vs
transformers': the same sums, accumulated in another order. PyTorch picks its CPU kernels by
instruction set (ATEN_CPU_CAPABILITY=default|avx2|avx512) and splits work by thread count, and each
choice groups the terms of a dot product differently: logits of about 10 that agreed to 1e-7 with
AVX2 kernels differed by 1.6e-5 (14 ulps of the largest logit) with AVX-512 ones on an AMD EPYC.

The budget: a float32 reduction as PyTorch's kernels compute it (SIMD lanes, blocks of a matmul,
a tree at the end) moves by about log2(n) ulps of its scale when its n terms are regrouped; chained
stages (layers, the head) add their errors like independent ones, sqrt(stages), and large random
weights amplify what reaches them. ULPS ulps per log2(2 n) sqrt(stages) is allowed, at the scale of
the largest |value| compared: for a tiny 2-layer test model (d_ff 64) that is 2.3e-5 of the largest
logit, for SmolLM2-135M (d_ff 1536, 30 layers) 1.2e-4; the differences measured were at most 14 and
17 ulps (1.7e-6, 2.0e-6), and a bug does far more (a wrong position, mask, scale or cache row moves logits
by 1e-1 or more). The budget is absolute at the scale of the whole tensor (rtol 0): a logit near 0
was summed from terms as large as the largest one's.

    from course.tolerance import assert_orders_close, for_decoder, order_tol
    assert_orders_close(cached, uncached, **for_decoder(model.cfg), what="decode step 3")
    assert torch.allclose(got, want, **order_tol(want, terms=64, stages=2))
"""
from __future__ import annotations

import math

import torch

# ulps of the scale per log2(2 terms) sqrt(stages). Measured worst: tests/ with default, AVX2 and AVX-512 kernels,
# 1 and 2 threads, 14 ulps of a budget of 194 (tiny Llama, 2 layers); labs 03-12 with AVX-512, 17 of 224.
ULPS = 16

__all__ = ["ULPS", "order_tol", "for_decoder", "assert_orders_close"]


def order_tol(want: torch.Tensor, *, terms: int, stages: int = 1) -> dict[str, float]:
    """{"rtol", "atol"} for torch.allclose / torch.testing.assert_close(got, want, ...) between two
    orders of the computation whose result is `want`: its dtype (float32 or float64) sets the ulp, its
    largest |value| the scale; `terms` is the longest reduction (d_model, d_ff, the context), `stages`
    how many chained reductions pass their errors on (a decoder: n_layer + 1; one matmul: 1)."""
    if type(want) is not torch.Tensor or want.dtype not in (torch.float32, torch.float64):
        got = want.dtype if isinstance(want, torch.Tensor) else type(want).__name__
        raise ValueError(f"want must be a float32 or float64 tensor, got {got}: half precision rounds every "
                         "op's output, so compare it with a float32 reference at its own dtype's tolerance")
    if type(terms) is not int or type(stages) is not int or terms < 1 or stages < 1:
        raise ValueError(f"terms and stages must be ints >= 1, got {terms!r}, {stages!r}")
    scale = float(want.detach().abs().max()) if want.numel() else 0.0
    rel = ULPS * torch.finfo(want.dtype).eps * math.log2(2 * terms) * math.sqrt(stages)
    return {"rtol": 0.0, "atol": rel * scale}


def for_decoder(cfg, context: int = 0) -> dict[str, int]:
    """`terms` and `stages` of a decoder's logits (cfg: a course.ModelConfig): its widest reduction
    (d_model, d_ff or the attended context) and its layers plus the head."""
    return {"terms": max(cfg.d_model, cfg.d_ff, int(context)), "stages": cfg.n_layer + 1}


def assert_orders_close(got: torch.Tensor, want: torch.Tensor, *, terms: int, stages: int = 1, what: str = "") -> None:
    """torch.testing.assert_close(got, want) within order_tol's budget; `what` names the comparison
    in the message (which gives the largest difference and the budget)."""
    tol = order_tol(want, terms=terms, stages=stages)
    torch.testing.assert_close(got, want, **tol, msg=lambda m: f"{what}: {m}" if what else m)

