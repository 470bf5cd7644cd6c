"""One batch's tokens flowing to experts and ranks, drawn with matplotlib (lab 14).

    fig = plot_flow(["The", " cat", ...], ids, weights, n_experts=8, world_size=2, keep=keep)

Three columns: the tokens on the left, the experts in the middle (coloured by the rank that holds
them under expert parallelism), the ranks on the right. A line from a token to an expert is one
(token, slot) pair, as thick as its routing weight; a dropped pair (capacity) is dashed and red. A
line from an expert to its rank is as thick as the expert's load, and each expert and rank is
labelled with its number of pairs: the busiest one sets the layer's time.
"""
from __future__ import annotations

import torch


def plot_flow(tokens: list[str], topk_ids: torch.Tensor, topk_weights: torch.Tensor | None, n_experts: int,
              world_size: int = 2, keep: torch.Tensor | None = None, title: str | None = None, ax=None):
    """Draw the routing of one batch: tokens -> experts -> ranks. Returns the matplotlib figure."""
    import matplotlib.pyplot as plt

    ids = topk_ids.detach().cpu().long()
    if ids.dim() != 2 or ids.shape[0] != len(tokens):
        raise ValueError(f"topk_ids must be (T, k) with T = len(tokens) = {len(tokens)}, got {tuple(ids.shape)}")
    if type(n_experts) is not int or type(world_size) is not int or world_size < 1 or n_experts % world_size:
        raise ValueError(f"world_size must divide n_experts, got {world_size!r} and {n_experts!r}")
    T, k = ids.shape
    w = torch.ones(T, k) if topk_weights is None else topk_weights.detach().float().cpu()
    kept = torch.ones(T, k, dtype=torch.bool) if keep is None else keep.detach().cpu().bool()
    per = n_experts // world_size
    load = torch.zeros(n_experts, dtype=torch.long)
    for e in ids[kept].tolist():
        load[e] += 1
    colors = plt.get_cmap("tab10")
    if ax is None:
        fig, ax = plt.subplots(figsize=(8, max(3.0, 0.32 * max(T, n_experts) + 1)))
    else:
        fig = ax.figure

    def spread(n):                      # n points from top (1) to bottom (0)
        return [0.5] if n == 1 else [1 - i / (n - 1) for i in range(n)]

    ty, ey, ry = spread(T), spread(n_experts), spread(world_size)
    for t in range(T):
        for j in range(k):
            e = int(ids[t, j])
            ok = bool(kept[t, j])
            ax.plot([0, 1], [ty[t], ey[e]], color=colors(e // per) if ok else "red", ls="-" if ok else "--",
                    lw=0.5 + 3 * float(w[t, j]) if ok else 1.0, alpha=0.7 if ok else 0.9)
    top = max(1, int(load.max()))
    for e in range(n_experts):
        r = e // per
        ax.plot([1, 2], [ey[e], ry[r]], color=colors(r), lw=0.5 + 6 * int(load[e]) / top, alpha=0.5)
        ax.scatter([1], [ey[e]], s=120, color=colors(r), zorder=3)
        ax.annotate(f"expert {e}: {int(load[e])}", (1, ey[e]), xytext=(6, 6), textcoords="offset points", fontsize=8)
    for r in range(world_size):
        n = int(load[r * per:(r + 1) * per].sum())
        ax.scatter([2], [ry[r]], s=300, marker="s", color=colors(r), zorder=3)
        ax.annotate(f"rank {r}: {n} pairs", (2, ry[r]), xytext=(10, -3), textcoords="offset points", fontsize=9)
    for t, tok in enumerate(tokens):
        ax.annotate(repr(tok)[1:-1][:14], (0, ty[t]), xytext=(-6, -3), textcoords="offset points", ha="right", fontsize=8)
    ax.set_xlim(-0.6, 2.7)
    ax.set_ylim(-0.08, 1.08)
    ax.axis("off")
    dropped = int((~kept).sum())
    ax.set_title(title or f"{T} tokens, top-{k} of {n_experts} experts, {world_size} ranks"
                 + (f"; {dropped} pairs dropped (dashed)" if dropped else ""), fontsize=10)
    return fig
