"""Dispatch: regroup tokens by expert, run each expert once on its group, put the results back.

After routing, token t goes to experts ids[t, 0..k-1]. Each (token, slot) is a "pair"; pair
p = t * k + j, so there are P = T * k pairs. Running experts one token at a time would be slow, so
an MoE layer sorts the pairs by expert: each expert then sees one contiguous group of rows, a GEMM.

    ids (T, k) --flatten--> (P,) --stable argsort--> order (P,): pair ids, expert 0's first
    counts (E,): pairs per expert          offsets (E + 1,): where each expert's group starts
    permute:   xs = x[order // k]                           (P, C) rows grouped by expert
    experts:   ys[offsets[e]:offsets[e+1]] = expert_e(xs[offsets[e]:offsets[e+1]])
    combine:   out[t] = sum_j weights[t, j] * ys[position of pair t * k + j]     (un-permute)

A GPU kernel (grouped_gemm.py) works in tiles of BLOCK_M rows, and a tile must not mix experts.
So each expert's group is padded to a multiple of BLOCK_M (vLLM's `moe_align_block_size`):

    sorted_ids (n_blocks * BLOCK_M,)  pair ids by expert, each group padded with the sentinel P
    expert_ids (n_blocks,)            the expert of each block (-1 past the last used block)
    n_padded                          how many entries of sorted_ids are used (a multiple of BLOCK_M)

The arrays have a fixed size, P + E * (BLOCK_M - 1) rounded up to a whole block, whatever the
routing: the worst case, every expert one row past a multiple. They are computed without reading
anything back to the host (no bincount, no repeat_interleave by counts: both need the output size
first), so a launch over all those blocks (the unused ones exit at once) needs no synchronization
and can be captured in a CUDA graph.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


def _check_ids(topk_ids: torch.Tensor, n_experts: int) -> None:
    if not isinstance(topk_ids, torch.Tensor) or topk_ids.dim() != 2 or topk_ids.is_floating_point():
        got = f"{tuple(topk_ids.shape)} {topk_ids.dtype}" if isinstance(topk_ids, torch.Tensor) else type(topk_ids).__name__
        raise ValueError(f"topk_ids must be an integer tensor (T, k), got {got}")
    if type(n_experts) is not int or n_experts < 1:
        raise ValueError(f"n_experts must be an int >= 1, got {n_experts!r}")
    # the range check reads the ids on the host: on a GPU that is a synchronization, so there they are trusted
    if topk_ids.device.type == "cpu" and topk_ids.numel() and (int(topk_ids.min()) < 0 or int(topk_ids.max()) >= n_experts):
        raise ValueError(f"topk_ids must be expert ids in 0..{n_experts - 1}, got values from "
                         f"{int(topk_ids.min())} to {int(topk_ids.max())}")


@dataclass
class Sorted:
    """Pairs sorted by expert. order: (P,) pair ids; counts: (E,); offsets: (E + 1,)."""

    order: torch.Tensor
    counts: torch.Tensor
    offsets: torch.Tensor


def sort_by_expert(topk_ids: torch.Tensor, n_experts: int) -> Sorted:
    """Group the (token, slot) pairs by expert. Stable: inside a group, pairs keep token order."""
    _check_ids(topk_ids, n_experts)
    flat = topk_ids.reshape(-1).long()                                       # (P,): expert of pair p
    order = torch.sort(flat, stable=True).indices                            # (P,): pair ids, by expert
    counts = torch.zeros(n_experts, dtype=torch.long, device=flat.device).scatter_add_(0, flat, torch.ones_like(flat))  # (E,)
    offsets = F.pad(counts.cumsum(0), (1, 0))                                # (E + 1,)
    return Sorted(order, counts, offsets)


@dataclass
class Aligned:
    """`sort_by_expert` padded to blocks, as a grouped-GEMM kernel reads it (see the module's docstring).
    n_padded is a 1-element int32 tensor (it stays on the device); sentinel = P = T * k."""

    sorted_ids: torch.Tensor
    expert_ids: torch.Tensor
    n_padded: torch.Tensor
    block_m: int
    sentinel: int


def max_padded(n_pairs: int, n_experts: int, block_m: int) -> int:
    """Length of `sorted_ids`: the padded total in the worst case, rounded up to a whole block."""
    worst = n_pairs + n_experts * (block_m - 1)
    return -(-worst // block_m) * block_m


def align_block_size(topk_ids: torch.Tensor, n_experts: int, block_m: int) -> Aligned:
    """Pairs sorted by expert, each expert's group padded with the sentinel to a multiple of block_m.
    An expert with no pairs gets no block."""
    if type(block_m) is not int or block_m < 1:
        raise ValueError(f"block_m must be an int >= 1 (the kernel's BLOCK_M), got {block_m!r}")
    s = sort_by_expert(topk_ids, n_experts)
    P, dev = topk_ids.numel(), topk_ids.device
    padded = (s.counts + block_m - 1) // block_m * block_m                   # (E,): each group, padded
    starts = padded.cumsum(0) - padded                                       # (E,): where each group starts
    experts = topk_ids.reshape(-1).long()[s.order]                           # (P,): expert of each sorted pair
    rank = torch.arange(P, device=dev) - s.offsets[experts]                  # (P,): place inside its group
    length = max_padded(P, n_experts, block_m)
    sorted_ids = torch.full((length,), P, dtype=torch.int32, device=dev)     # sentinel everywhere ...
    sorted_ids[starts[experts] + rank] = s.order.to(torch.int32)             # ... except the real pairs
    ends = padded.cumsum(0)                                                  # (E,): where each group ends
    block_starts = torch.arange(0, length, block_m, device=dev)              # (n_blocks,)
    owner = torch.searchsorted(ends, block_starts, right=True)               # the group each block starts in
    expert_ids = torch.where(block_starts < ends[-1], owner, -1).to(torch.int32)
    n_padded = ends[-1:].to(torch.int32)                                     # (1,): stays on the device
    return Aligned(sorted_ids, expert_ids, n_padded, block_m, P)


def permute(x: torch.Tensor, order: torch.Tensor, k: int) -> torch.Tensor:
    """x (T, C) -> (P, C): row i is the token of pair order[i] (a token appears once per expert it chose)."""
    return x[order // k]


def unpermute_combine(ys: torch.Tensor, order: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
    """The inverse of `permute`, weighted and summed: out[t] = sum_j topk_weights[t, j] * (row of pair t*k+j).

    ys: (P, C) in sorted order; topk_weights: (T, k). Returns (T, C) in float32 (k terms per row)."""
    T, k = topk_weights.shape
    w = topk_weights.reshape(-1)[order].float()                              # (P,): weight of each sorted pair
    out = torch.zeros(T, ys.shape[1], dtype=torch.float32, device=ys.device)
    out.index_add_(0, order // k, ys.float() * w[:, None])                   # scatter-add back to the tokens
    return out


def capacity_keep(topk_ids: torch.Tensor, n_experts: int, capacity: int) -> torch.Tensor:
    """Which pairs an expert with room for `capacity` rows keeps: (T, k) bool.

    When more pairs choose an expert than it has room for, the rest are dropped (they add nothing;
    the token passes that expert by on the residual stream). Priority as in GShard: every token's
    first choice before anyone's second choice, and in token order inside a choice."""
    _check_ids(topk_ids, n_experts)
    if type(capacity) is not int or capacity < 0:
        raise ValueError(f"capacity must be an int >= 0 (rows per expert), got {capacity!r}")
    T, k = topk_ids.shape
    slot_major = topk_ids.T.reshape(-1).long()                              # (k * T,): slot 0 of every token first
    s = sort_by_expert(slot_major[:, None], n_experts)
    rank = torch.arange(T * k, device=topk_ids.device) - s.offsets[slot_major[s.order]]
    keep = torch.empty(T * k, dtype=torch.bool, device=topk_ids.device)
    keep[s.order] = rank < capacity                                          # the first `capacity` of each group
    return keep.view(k, T).T                                                 # (T, k)


def capacity(n_tokens: int, k: int, n_experts: int, factor: float) -> int:
    """Rows per expert for a capacity factor: ceil(factor * T * k / E). factor 1.0 is exactly the
    average load, so any imbalance drops pairs; 1.25 (Switch Transformer's default) leaves 25% slack."""
    if not isinstance(factor, (int, float)) or factor <= 0:
        raise ValueError(f"factor must be a number > 0, got {factor!r}")
    return int(-(-factor * n_tokens * k // n_experts))


def swiglu(x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor) -> torch.Tensor:
    """One expert: down(silu(gate(x)) * up(x)). x (M, C); w_gate, w_up (N, C); w_down (C, N). -> (M, C)."""
    return (F.silu(x @ w_gate.T) * (x @ w_up.T)) @ w_down.T


def check_experts(x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor,
                  topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> None:
    """Shapes of an MoE layer's call, with the argument's name on a mistake."""
    if x.dim() != 2:
        raise ValueError(f"x must be (T, C), got {tuple(x.shape)}")
    T, C = x.shape
    if w_gate.dim() != 3 or w_gate.shape[2] != C or w_up.shape != w_gate.shape:
        raise ValueError(f"w_gate and w_up must both be (E, N, C={C}), got {tuple(w_gate.shape)} and {tuple(w_up.shape)}")
    E, N, _ = w_gate.shape
    if w_down.shape != (E, C, N):
        raise ValueError(f"w_down must be (E, C, N) = {(E, C, N)}, got {tuple(w_down.shape)}")
    _check_ids(topk_ids, E)
    if topk_ids.shape[0] != T or topk_weights.shape != topk_ids.shape:
        raise ValueError(f"topk_ids and topk_weights must both be (T={T}, k), got {tuple(topk_ids.shape)} and "
                         f"{tuple(topk_weights.shape)}")


def moe_sorted(x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor,
               topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
    """The MoE layer by dispatch: sort, one GEMM chain per expert on its contiguous group, combine.
    x (T, C); w_gate, w_up (E, N, C); w_down (E, C, N); topk_ids, topk_weights (T, k). -> (T, C) in x's dtype."""
    check_experts(x, w_gate, w_up, w_down, topk_ids, topk_weights)
    k, E = topk_ids.shape[1], w_gate.shape[0]
    s = sort_by_expert(topk_ids, E)
    xs = permute(x, s.order, k)                                              # (P, C), grouped by expert
    ys = torch.empty_like(xs)
    bounds = s.offsets.tolist()
    for e in range(E):
        lo, hi = bounds[e], bounds[e + 1]
        if hi > lo:                                                          # an expert nobody chose is skipped
            ys[lo:hi] = swiglu(xs[lo:hi], w_gate[e], w_up[e], w_down[e])
    return unpermute_combine(ys, s.order, topk_weights).to(x.dtype)


def moe_reference(x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor,
                  topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
    """The same layer the obvious way, no sorting: for each expert, find its tokens, run it, add.
    What `moe_sorted` and the kernels are checked against."""
    check_experts(x, w_gate, w_up, w_down, topk_ids, topk_weights)
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for e in range(w_gate.shape[0]):
        tokens, slots = torch.nonzero(topk_ids == e, as_tuple=True)          # who chose e, and in which slot
        if tokens.numel():
            y = swiglu(x[tokens], w_gate[e], w_up[e], w_down[e]).float()      # (n_e, C)
            out.index_add_(0, tokens, y * topk_weights[tokens, slots].float()[:, None])
    return out.to(x.dtype)
