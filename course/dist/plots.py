"""Timelines of lab 12: which stage or worker was busy when, drawn from what the ranks recorded.

    plot_pipeline(timelines)          one row per pipeline stage, one bar per micro-batch
    plot_serving({"colocated": logs, "disaggregated": logs})   one row per worker: prefills, decode steps, transfers
"""
from __future__ import annotations

import matplotlib.pyplot as plt

KIND_COLORS = {"prefill": "tab:orange", "decode": "tab:blue", "send": "tab:green", "recv": "tab:green"}


def plot_pipeline(timelines: list[list[tuple[int, float, float]]], ax=None, title: str = ""):
    """Stages (rows, stage 0 on top) against time: a bar per (micro-batch j, start, end) that stage
    recorded, labelled with j. Gaps in a row are that stage's bubble. Returns the axes."""
    if not timelines or not all(isinstance(t, (list, tuple)) for t in timelines):
        raise TypeError("timelines must be a list (one per stage) of lists of (micro_batch, start, end)")
    t0 = min(start for tl in timelines for _, start, _ in tl)
    if ax is None:
        _, ax = plt.subplots(figsize=(9, 0.55 * len(timelines) + 1.2))
    cmap = plt.get_cmap("tab20")
    for s, tl in enumerate(timelines):
        for j, start, end in tl:
            ax.barh(s, end - start, left=start - t0, height=0.7, color=cmap(j % 20), edgecolor="black", linewidth=0.5)
            if end - start > 0:
                ax.text(start - t0 + (end - start) / 2, s, str(j), ha="center", va="center", fontsize=8)
    ax.set_yticks(range(len(timelines)), [f"stage {s}" for s in range(len(timelines))])
    ax.invert_yaxis()
    ax.set_xlabel("seconds since the first micro-batch started")
    if title:
        ax.set_title(title)
    return ax


def plot_serving(runs: dict[str, list], axes=None, until: float | None = None):
    """One panel per setup (e.g. "colocated", "disaggregated"), one row per worker: its prefills,
    decode steps and received KV transfers over time (`WorkerLog.events`). Returns the axes."""
    if not isinstance(runs, dict) or not runs:
        raise TypeError("runs must be a dict: setup name -> list of WorkerLog")
    if axes is None:
        rows = sum(len(logs) for logs in runs.values())
        _, axes = plt.subplots(len(runs), 1, figsize=(10, 0.6 * rows + 1.5 * len(runs)), sharex=True, squeeze=False)
        axes = axes[:, 0]
    for ax, (name, logs) in zip(axes, runs.items()):
        for row, log in enumerate(logs):
            for kind, start, end, _ in log.events:
                if kind == "send":      # the sender's side of a transfer (it may wait for pickup): shown as recv
                    continue
                ax.barh(row, end - start, left=start, height=0.6, color=KIND_COLORS.get(kind, "gray"),
                        edgecolor="black", linewidth=0.3)
        ax.set_yticks(range(len(logs)), [f"rank {g.rank}: {g.role}" for g in logs])
        ax.invert_yaxis()
        ax.set_title(name)
        if until is not None:
            ax.set_xlim(0, until)
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in ("tab:orange", "tab:blue", "tab:green")]
    axes[0].legend(handles, ["prefill", "decode step", "KV transfer (received)"], loc="upper right", fontsize=8)
    axes[-1].set_xlabel("seconds since the start")
    return axes
