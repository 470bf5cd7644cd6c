"""What sets an MoE layer's speed: how evenly the router spreads the tokens, and how many experts a batch wakes.

    routes = record_routing(model, ids)               # one (T, k) tensor of expert ids per MoE layer
    counts = expert_counts(routes[5], E)              # (E,): pairs per expert in layer 5
    imbalance(counts)                                 # max / mean: 1.0 is perfectly even
    rank_counts(counts, W)                            # (W,): pairs per rank under expert parallelism
    dropped_share(routes[5], E, factor=1.25)          # share of pairs a capacity factor drops
    experts_touched(routes, batch_sizes=[1, 8, 64])   # {B: share of the experts a decode batch of B uses}

Why they matter. Experts run in parallel (one grouped GEMM, or one rank each), so a layer takes as
long as its busiest expert or rank: an imbalance of 2 halves the throughput the FLOPs promise. A
capacity limit caps the busiest expert, at the price of dropping what exceeds it. And at decode,
a batch of B tokens reads the weights of every expert any of them chose: with k of E experts per
token, a uniform router touches 1 - (1 - k/E)^B of them (B = 8, k = 2, E = 8: 90%), so a decode step
reads nearly all the weights while computing with only k/E of them: MoE decode is memory-bound on
its total parameters, not its active ones, once the batch is more than a few tokens.
"""
from __future__ import annotations

import torch
import torch.nn as nn

from course.moe.dispatch import capacity, capacity_keep


def expert_counts(topk_ids: torch.Tensor, n_experts: int, keep: torch.Tensor | None = None) -> torch.Tensor:
    """Pairs routed to each expert: (E,) long. keep: (T, k) bool, count only the kept pairs."""
    if topk_ids.dim() != 2:
        raise ValueError(f"topk_ids must be (T, k), got {tuple(topk_ids.shape)}")
    ids = topk_ids.reshape(-1) if keep is None else topk_ids[keep]
    return torch.bincount(ids.long(), minlength=n_experts)


def rank_counts(counts: torch.Tensor, world_size: int) -> torch.Tensor:
    """Pairs per rank when rank r holds experts r * E/W ... (r + 1) * E/W - 1: (W,)."""
    if counts.dim() != 1 or type(world_size) is not int or world_size < 1 or counts.numel() % world_size:
        raise ValueError(f"world_size must divide the {counts.numel()} experts, got {world_size!r}")
    return counts.view(world_size, -1).sum(1)


def imbalance(counts: torch.Tensor) -> float:
    """max / mean of the load: the busiest expert's (or rank's) work over an even share. 1.0 is even;
    E (every pair on one expert) is the worst."""
    if counts.numel() == 0 or int(counts.sum()) == 0:
        raise ValueError("imbalance needs a non-empty load with at least one pair")
    c = counts.double()
    return float(c.max() / c.mean())


def dropped_share(topk_ids: torch.Tensor, n_experts: int, factor: float) -> float:
    """Share of the pairs that experts with room for ceil(factor * T * k / E) rows each would drop."""
    T, k = topk_ids.shape
    keep = capacity_keep(topk_ids, n_experts, capacity(T, k, n_experts, factor))
    return float((~keep).double().mean())


def touched_uniform(batch: int, k: int, n_experts: int) -> float:
    """Expected share of experts a batch of `batch` tokens touches if every token picked k distinct
    experts uniformly at random: 1 - (1 - k/E)^B."""
    return 1.0 - (1.0 - k / n_experts) ** batch


def experts_touched(routes: list[torch.Tensor], batch_sizes, n_experts: int, trials: int = 200,
                    seed: int = 0) -> dict[int, float]:
    """{B: share of the experts used by a decode batch of B tokens}, averaged over layers and over
    `trials` batches of B tokens drawn at random (without replacement) from the recorded routing.
    routes: (T, k) expert ids per layer, as record_routing returns them."""
    g = torch.Generator().manual_seed(seed)
    T = routes[0].shape[0]
    out = {}
    for B in batch_sizes:
        if type(B) is not int or not 1 <= B <= T:
            raise ValueError(f"batch sizes must be ints from 1 to the {T} recorded tokens, got {B!r}")
        shares = []
        for _ in range(trials):
            rows = torch.randperm(T, generator=g)[:B]                       # B tokens of a decode step
            for ids in routes:
                shares.append(torch.unique(ids[rows]).numel() / n_experts)
        out[B] = sum(shares) / len(shares)
    return out


@torch.no_grad()
def record_routing(model: nn.Module, ids: list[int], window: int = 1024) -> list[torch.Tensor]:
    """Run the model over a text (windows of `window` tokens) and return each MoE layer's routing:
    a (T, k) long tensor of expert ids per layer, under the layers' current knobs."""
    from course.moe.moefy import moe_layers
    from course.moe.router import run_windows

    layers = moe_layers(model)
    if not layers:
        raise ValueError("the model has no MoE layers: moefy(model) or load_moe(model) first")
    seen: list[list[torch.Tensor]] = [[] for _ in layers]
    hooks = [m.register_forward_hook(lambda mod, a, o, i=i: seen[i].append(mod.last_ids.cpu())) for i, m in enumerate(layers)]
    saved = [m.record for m in layers]
    for m in layers:
        m.record = True
    try:
        run_windows(model, ids, window)
    finally:
        for h in hooks:
            h.remove()
        for m, r in zip(layers, saved):
            m.record = r
    return [torch.cat(s) for s in seen]


def load_report(routes: list[torch.Tensor], n_experts: int, world_size: int = 2) -> dict:
    """Per layer: expert counts, expert imbalance, rank counts and rank imbalance; and their means."""
    rows = []
    for i, ids in enumerate(routes):
        c = expert_counts(ids, n_experts)
        rc = rank_counts(c, world_size)
        rows.append({"layer": i, "counts": c.tolist(), "imbalance": imbalance(c), "rank_counts": rc.tolist(),
                     "rank_imbalance": imbalance(rc)})
    return {"layers": rows, "mean_imbalance": sum(r["imbalance"] for r in rows) / len(rows),
            "max_imbalance": max(r["imbalance"] for r in rows),
            "mean_rank_imbalance": sum(r["rank_imbalance"] for r in rows) / len(rows)}
