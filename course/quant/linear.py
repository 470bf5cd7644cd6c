"""Quantized weights as a model can use them (lab 10): dequantize, then multiply.

    qmodel = quantize_linears(model, quantize=lambda w: my_quantizer(w), dequantize=my_dequantizer)
    linear_bytes(qmodel)            # what the block linears' weights take in memory, as stored

Every `nn.Linear` of every block (attention q, k, v, o and the MLP) is replaced by a `QuantLinear`
that keeps only what `quantize(weight)` returned (codes, scales, ...) and rebuilds the weight at
every call: `F.linear(x, dequantize(*parts))`. That is the reference, not a fast kernel: it
stores few bytes but reads them, writes a full float weight and reads that again. Real kernels
(llama.cpp's, Marlin, AWQ's) dequantize tile by tile inside the matmul. The embedding (tied with
the output layer) keeps its format: llama.cpp stores it in Q8_0 in the course model's file.
"""
from __future__ import annotations

import copy
from collections.abc import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from course.models.decoder import Decoder


class QuantLinear(nn.Module):
    """A linear layer whose weight is kept as the tensors `parts` and rebuilt by `dequantize(*parts)`."""

    def __init__(self, parts: tuple[torch.Tensor, ...], dequantize: Callable[..., torch.Tensor],
                 out_features: int, in_features: int, bias: torch.Tensor | None = None):
        super().__init__()
        if not isinstance(parts, tuple) or not parts or not all(isinstance(p, torch.Tensor) for p in parts):
            raise TypeError("parts must be a non-empty tuple of tensors (what quantize returned)")
        self.dequantize = dequantize
        self.out_features, self.in_features = out_features, in_features
        for i, p in enumerate(parts):
            self.register_buffer(f"part{i}", p)
        self.n_parts = len(parts)
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone(), requires_grad=False)

    @property
    def parts(self) -> tuple[torch.Tensor, ...]:
        return tuple(getattr(self, f"part{i}") for i in range(self.n_parts))

    def weight_now(self) -> torch.Tensor:
        w = self.dequantize(*self.parts)
        if not isinstance(w, torch.Tensor) or w.shape != (self.out_features, self.in_features):
            got = tuple(w.shape) if isinstance(w, torch.Tensor) else type(w).__name__
            raise ValueError(f"dequantize must rebuild a weight ({self.out_features}, {self.in_features}), got {got}")
        return w

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight_now().to(x.dtype), None if self.bias is None else self.bias.to(x.dtype))

    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)

    def extra_repr(self) -> str:
        kinds = ", ".join(f"{tuple(p.shape)} {str(p.dtype).removeprefix('torch.')}" for p in self.parts)
        return f"{self.in_features} -> {self.out_features}, stores [{kinds}]"


def block_linears(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(name, module) of every linear layer inside the blocks, quantized or not."""
    return [(n, m) for n, m in model.named_modules() if n.startswith("blocks.") and isinstance(m, (nn.Linear, QuantLinear))]


@torch.no_grad()
def quantize_linears(model: Decoder, quantize: Callable[[torch.Tensor], tuple],
                     dequantize: Callable[..., torch.Tensor]) -> Decoder:
    """A copy of `model` whose block linears keep quantize(weight) (a tuple of tensors) and compute
    with dequantize(*that). The original model is not changed; the copy shares its other parameters
    (embedding, norms) instead of copying them."""
    if not isinstance(model, Decoder):
        raise TypeError(f"model must be a course Decoder, got {type(model).__name__}")
    shared = {id(p): p for p in model.parameters()}         # deepcopy reuses these: no copy of the weights
    out = copy.deepcopy(model, memo=shared)
    for name, lin in block_linears(out):
        if not isinstance(lin, nn.Linear):
            raise ValueError(f"{name} is already quantized")
        parts = quantize(lin.weight.detach().float())
        if isinstance(parts, torch.Tensor):
            parts = (parts,)
        parts = tuple(parts)
        parent, attr = name.rsplit(".", 1)
        q = QuantLinear(parts, dequantize, lin.out_features, lin.in_features, lin.bias)
        q.weight_now()                                          # fail here, naming the layer, not mid-forward
        setattr(out.get_submodule(parent), attr, q)
    return out


def linear_bytes(model: nn.Module) -> int:
    """Bytes of the block linears' weights as stored (codes and scales for a QuantLinear)."""
    return sum(m.nbytes() if isinstance(m, QuantLinear) else m.weight.nbytes for _, m in block_linears(model))


def linear_params(model: nn.Module) -> int:
    """Number of weights in the block linears."""
    return sum(m.out_features * m.in_features for _, m in block_linears(model))


@torch.no_grad()
def max_weight_change(a: nn.Module, b: nn.Module) -> float:
    """Largest |w_a - w_b| over the block linears of two versions of one model (as they compute)."""
    worst = 0.0
    for (_, ma), (_, mb) in zip(block_linears(a), block_linears(b)):
        wa = ma.weight_now() if isinstance(ma, QuantLinear) else ma.weight
        wb = mb.weight_now() if isinstance(mb, QuantLinear) else mb.weight
        worst = max(worst, float((wa.float() - wb.float()).abs().max()))
    return worst
