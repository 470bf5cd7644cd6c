"""One matmul where the model has several: q, k and v in one, gate and up in one.

On a GPU a small model's decode step costs about what its kernels cost to launch and run, each a few
microseconds however little it does (lab 02), so an engine counts kernels. The model keeps q_proj,
k_proj and v_proj apart, the way the paper draws them; they read the same input, so their weights
stacked row after row give all three outputs from one matmul. Llama's gate_proj and up_proj are the
same case. vLLM (`QKVParallelLinear`, `MergedColumnParallelLinear`) and nano-vllm store them stacked.

`stacked(linears)` stacks the weights once, then makes each module's weight a view of its rows of
the stack: no second copy in memory, and whatever changes a weight in place later (a load, an
optimizer step) changes the stack too. The model still computes what it did, module by module.
A module whose weight is replaced (cast, moved, quantized) no longer points into the stack: the next
call sees it and stacks again. What cannot be stacked (not a plain `nn.Linear`, a hook on it, mixed
dtypes or devices) gets None, and the caller runs the modules one by one.
"""
from __future__ import annotations

import weakref
from collections.abc import Sequence

import torch
import torch.nn as nn
from torch.nn.modules import module as _module

__all__ = ["stacked", "stack_model", "unhooked"]

_STACKS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()   # first module -> (layout, weight, bias)


def _layout(linears: Sequence[nn.Module]) -> tuple:
    return tuple((id(m), m.weight.data_ptr(), tuple(m.weight.shape),
                  None if m.bias is None else m.bias.data_ptr()) for m in linears)


def unhooked(m: nn.Module) -> bool:
    """Nothing but the module's own forward runs when it is called: no hook on it or on every module,
    no forward of its own set on the instance. Code that computes what the module computes, by
    other means, may then skip calling it; otherwise it must call it (a hook may count passes)."""
    return not (m._forward_hooks or m._forward_pre_hooks or "forward" in m.__dict__
                or _module._global_forward_hooks or _module._global_forward_pre_hooks)


def _plain(m: nn.Module) -> bool:
    """A bare nn.Linear: calling it is exactly F.linear with its weight and bias, nothing to bypass."""
    return type(m) is nn.Linear and unhooked(m)


def stacked(linears: Sequence[nn.Module]) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """(weight, bias) with the rows of every module in `linears`, in order, or None when they cannot
    share one: `F.linear(x, *stacked(mods))` is `torch.cat([m(x) for m in mods], -1)` in one kernel."""
    if not all(_plain(m) for m in linears):
        return None
    if torch.is_grad_enabled() and any(p.requires_grad for m in linears for p in m.parameters()):
        return None                                       # training: gradients must reach each module's own weight
    got = _STACKS.get(linears[0])
    if got is not None and got[0] == _layout(linears):
        return got[1], got[2]
    weights, biases = [m.weight for m in linears], [m.bias for m in linears]
    if len({(w.dtype, w.device, w.dim(), w.shape[-1]) for w in weights}) != 1 or weights[0].dim() != 2 \
            or len({b is None for b in biases}) != 1:
        return None
    if weights[0].is_cuda and torch.cuda.is_current_stream_capturing():
        return None                                       # a graph being captured cannot allocate and copy
    rows = [w.shape[0] for w in weights]
    with torch.inference_mode(False), torch.no_grad():
        weight = torch.cat([w.detach() for w in weights])
        for w, part in zip(weights, weight.split(rows)):
            w.data = part                                 # the module's Parameter stays; its memory is the stack's
        bias = None
        if biases[0] is not None:
            bias = torch.cat([b.detach() for b in biases])
            for b, part in zip(biases, bias.split(rows)):
                b.data = part
    _STACKS[linears[0]] = (_layout(linears), weight, bias)
    return weight, bias


def stack_model(model) -> None:
    """Stack every layer's q/k/v and gate/up now, before a graph capture records the forward (the
    copy that stacks them is one-off work, not part of a step)."""
    for block in model.blocks:
        stacked((block.attn.q_proj, block.attn.k_proj, block.attn.v_proj))
        if getattr(block.mlp, "family", None) == "llama":
            stacked((block.mlp.gate_proj, block.mlp.up_proj))
