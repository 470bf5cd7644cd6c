"""Expert parallelism (EP): the experts are spread over W ranks, and tokens travel to them and back.

With E experts and W ranks, rank r holds experts r * E/W ... (r + 1) * E/W - 1 (E/W of the weights),
while every rank keeps its own tokens (attention runs data-parallel) and a copy of the router. In
each MoE layer, each rank:

    route        ids, weights (T, k) for its own tokens
    sort         pairs by expert, so they are grouped by the rank that owns the expert: one chunk per rank
    counts       all_to_all_single of the per-expert counts (E ints): each rank learns how many rows
                 it will receive from every rank, for every one of its experts
    dispatch     all_to_all_single of the rows, with those split sizes (uneven: the load is uneven)
    experts      run its E/W experts on what it received
    return       all_to_all_single back, the split sizes swapped
    combine      un-permute and weight, as on one process (dispatch.unpermute_combine)

Bytes one rank sends in one layer, payload only (b = bytes per element, C = d_model):

    bytes_sent = C * b * (pairs it sends to other ranks + rows it returns to other ranks)
                 + 8 * (E - E/W)                       (its counts for the other ranks' experts, int64)

Under a uniform router a pair lands on another rank with probability (W - 1)/W, so a token costs
2 * k * (W - 1)/W * C * b bytes per layer, both directions: 2 * 2 * 1/2 * 576 * 2 = 2,304 bytes for
the course model in bf16 with k = 2 on W = 2. A real router is not uniform: what counts is how many
pairs leave the rank, and the busiest rank sets the time. (DeepEP sends a token once per destination
rank rather than once per pair, and its low-latency kernels use fixed-size buffers so that no count
needs to reach the host; this file keeps the plain version, whose split sizes are read on the host.)

    from course.dist import launch
    def rank_fn(comm, model, prompts):            # model: MoEfied, the same on every rank
        stats = expert_parallel(model, comm.rank, comm.world_size)
        return model(prompts[comm.rank], ...)     # each rank its own tokens
    launch(rank_fn, 2, model, prompts)
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn

from course.moe.dispatch import moe_sorted, permute, sort_by_expert, unpermute_combine
from course.moe.router import topk_route


def expert_range(n_experts: int, world_size: int, rank: int) -> range:
    """The experts rank `rank` owns: a contiguous run of E / W."""
    if type(world_size) is not int or world_size < 1 or type(n_experts) is not int or n_experts % world_size:
        raise ValueError(f"world_size must divide n_experts ({n_experts}), got {world_size!r}")
    if type(rank) is not int or not 0 <= rank < world_size:
        raise ValueError(f"rank must be in 0..{world_size - 1}, got {rank!r}")
    per = n_experts // world_size
    return range(rank * per, (rank + 1) * per)


@dataclass
class EPStats:
    """What one rank sent and received over its MoE layers: payload bytes to and from OTHER ranks
    (the chunk a rank "sends" itself is a local copy), and the pairs behind them."""

    bytes_sent: int = 0
    bytes_received: int = 0
    pairs_out: int = 0           # its own pairs that went to another rank's expert
    pairs_in: int = 0            # other ranks' pairs that came to its experts
    calls: int = 0               # MoE layer forwards

    def reset(self) -> None:
        self.__init__()


def _all_to_all(out: torch.Tensor, inp: torch.Tensor, out_splits: list[int], in_splits: list[int], group) -> None:
    """all_to_all_single with split sizes in rows (torch.distributed's, gloo or NCCL)."""
    dist.all_to_all_single(out, inp, output_split_sizes=out_splits, input_split_sizes=in_splits, group=group)


def ep_moe(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, w_gate: torch.Tensor,
           w_up: torch.Tensor, w_down: torch.Tensor, n_experts: int, group=None, stats: EPStats | None = None) -> torch.Tensor:
    """One MoE layer under expert parallelism, called by every rank of `group` (default: the world).

    x: (T, C) this rank's tokens (T may differ between ranks, 0 included); topk_ids, topk_weights:
    (T, k) their routing over all n_experts; w_gate, w_up: (E/W, N, C), w_down: (E/W, C, N): this
    rank's experts only. Returns (T, C), what one process holding every expert would return."""
    W, r = dist.get_world_size(group), dist.get_rank(group)
    mine = expert_range(n_experts, W, r)
    E_local = len(mine)
    if w_gate.shape[0] != E_local:
        raise ValueError(f"rank {r} must hold {E_local} experts (E / W), got w_gate {tuple(w_gate.shape)}")
    T, C = x.shape
    k = topk_ids.shape[1]
    s = sort_by_expert(topk_ids, n_experts)                          # pairs grouped by expert, hence by rank
    xs = permute(x, s.order, k).contiguous()                         # (P, C)
    # 1. counts: chunk q of my (E,) counts holds my pairs for rank q's experts
    recv_counts = torch.empty(n_experts, dtype=torch.int64)
    _all_to_all(recv_counts, s.counts.cpu().contiguous(), [E_local] * W, [E_local] * W, group)
    recv_counts = recv_counts.view(W, E_local)                       # [q, e]: rows rank q sends for my expert e
    send_splits = s.counts.view(W, E_local).sum(1).tolist()          # rows to each rank
    recv_splits = recv_counts.sum(1).tolist()                        # rows from each rank
    # 2. dispatch: my rows to their experts' ranks; rows arrive by source rank, then by local expert
    xr = x.new_empty(sum(recv_splits), C)
    _all_to_all(xr, xs, recv_splits, send_splits, group)
    local_ids = torch.repeat_interleave(torch.arange(E_local).repeat(W), recv_counts.reshape(-1)).to(x.device)
    # 3. my experts on what came in: each row one pair, weight 1 (weights are applied at home)
    ones = torch.ones(xr.shape[0], 1, device=x.device)
    yr = moe_sorted(xr, w_gate, w_up, w_down, local_ids[:, None], ones).contiguous() if xr.shape[0] else xr
    # 4. return: the results travel back the way they came
    ys = x.new_empty(T * k, C)
    _all_to_all(ys, yr, send_splits, recv_splits, group)
    if stats is not None:
        row = C * x.element_size()
        out_remote = sum(send_splits) - send_splits[r]
        in_remote = sum(recv_splits) - recv_splits[r]
        stats.bytes_sent += row * (out_remote + in_remote) + 8 * (n_experts - E_local)
        stats.bytes_received += row * (in_remote + out_remote) + 8 * (n_experts - E_local)
        stats.pairs_out += out_remote
        stats.pairs_in += in_remote
        stats.calls += 1
    return unpermute_combine(ys, s.order, topk_weights).to(x.dtype)


class ExpertParallelMLP(nn.Module):
    """An MoEMLP's place in a block, on one rank: the router and knobs of the MoEMLP it is made from,
    and only this rank's E/W experts. Capacity limits are not applied here."""

    def __init__(self, moe: nn.Module, rank: int, world_size: int, group=None, stats: EPStats | None = None):
        super().__init__()
        mine = expert_range(moe.n_experts, world_size, rank)
        sl = slice(mine.start, mine.stop)
        self.w_gate, self.w_up, self.w_down = (nn.Parameter(w.detach()[sl].clone()) for w in (moe.w_gate, moe.w_up, moe.w_down))
        self.router, self.n_experts, self.top_k, self.weighting = moe.router, moe.n_experts, moe.top_k, moe.weighting
        self.group, self.stats = group, stats if stats is not None else EPStats()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])                                 # (T, C)
        T, E, k = x.shape[0], self.n_experts, self.top_k
        if k == E and (self.router is None or self.weighting == "ones"):
            ids, weights = torch.arange(E, device=x.device).expand(T, E), torch.ones(T, E, device=x.device)
        else:
            ids, weights = topk_route(self.router(x.float()), k)
            if self.weighting == "ones":
                weights = torch.ones_like(weights)
        y = ep_moe(x, ids, weights, self.w_gate, self.w_up, self.w_down, E, self.group, self.stats)
        return y.reshape(shape)


def expert_parallel(model: nn.Module, rank: int, world_size: int, group=None) -> EPStats:
    """In place, on one rank: every MoEMLP of the model becomes an ExpertParallelMLP holding this
    rank's experts. Returns the EPStats all its layers add to."""
    from course.moe.moefy import MoEMLP

    stats, n = EPStats(), 0
    for block in model.blocks:
        if isinstance(block.mlp, MoEMLP):
            block.mlp = ExpertParallelMLP(block.mlp, rank, world_size, group, stats)
            n += 1
    if not n:
        raise ValueError("the model has no MoE layers: moefy(model) or load_moe(model) first")
    return stats


def bytes_formula(topk_ids_per_rank: list[torch.Tensor], n_experts: int, d_model: int, elem_bytes: int) -> list[int]:
    """Bytes each rank sends in one MoE layer, from everyone's routing alone (the formula in the
    module's docstring): C * b * (its pairs for other ranks + other ranks' pairs for its experts)
    + 8 * (E - E/W)."""
    W = len(topk_ids_per_rank)
    per = n_experts // W
    owners = [ids.reshape(-1) // per for ids in topk_ids_per_rank]   # (P_q,): the rank of each pair's expert
    out = []
    for r in range(W):
        leaving = int((owners[r] != r).sum())
        arriving = sum(int((owners[q] == r).sum()) for q in range(W) if q != r)
        out.append(d_model * elem_bytes * (leaving + arriving) + 8 * (n_experts - per))
    return out
