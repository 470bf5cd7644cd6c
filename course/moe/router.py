"""The router: which k of the E experts each token goes to, and with what weight.

A router is one linear layer: logits = x W^T + b, one score per expert. A token goes to the k experts
with the largest scores. Their weights are a softmax over those k scores only, so they sum to 1
(Mixtral and Qwen-MoE do this: softmax over all E, keep the top k, renormalize; it is the same thing).

    ids, weights = topk_route(router(x), k)        # x (T, C) -> ids (T, k) long, weights (T, k) float

MoEfication makes experts out of a dense model that was never trained with a router, so the router
must be fit afterwards. Its target is each expert's activation mass: the sum of |silu(g) * u| over
the expert's neurons, measured on the dense model. An expert with little mass adds little to the
output, so leaving it out costs little. The fit is ridge least squares (one linear solve per layer,
a fraction of a second on a CPU), on the MLP inputs of a calibration text that is not the held-out text.

    mass = expert_mass(x, w_gate, w_up)            # (T, E)
    router = fit_router(x, mass)                   # nn.Linear(C, E), bias included
"""
from __future__ import annotations

from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

CALIBRATION = Path(__file__).resolve().parents[1] / "data" / "calibration.txt"   # ships in the wheel


def calibration_ids(tokenizer) -> list[int]:
    """Token ids of the calibration text routers are fit on (course/data/README_calibration.md):
    original prose, not the held-out text that perplexity is measured on. No special tokens."""
    if not CALIBRATION.is_file():
        raise FileNotFoundError(f"the calibration text is missing: expected {CALIBRATION} (reinstall the course)")
    return tokenizer(CALIBRATION.read_text(encoding="utf-8"), add_special_tokens=False).input_ids


def topk_route(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k experts of each token and their renormalized softmax weights.

    logits: (T, E). Returns ids (T, k) long, best first, and weights (T, k) float32 that sum to 1
    per token. Ties go to the lower expert id (torch.topk's order on CPU is not promised: we sort)."""
    if not isinstance(logits, torch.Tensor) or logits.dim() != 2 or not logits.is_floating_point():
        got = f"{tuple(logits.shape)} {logits.dtype}" if isinstance(logits, torch.Tensor) else type(logits).__name__
        raise ValueError(f"logits must be a float tensor (T, E), got {got}")
    E = logits.shape[1]
    if type(k) is not int or not 1 <= k <= E:
        raise ValueError(f"k must be an int from 1 to the number of experts ({E}), got {k!r}")
    scores = logits.float()
    # a stable sort on -score keeps equal scores in expert order: the same choice on every machine
    order = torch.sort(-scores, dim=-1, stable=True).indices[:, :k]          # (T, k)
    top = scores.gather(-1, order)                                           # (T, k)
    return order, F.softmax(top, dim=-1)                                     # renormalized over the k chosen


def expert_mass(x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor) -> torch.Tensor:
    """How much each expert contributes for each token: sum over its neurons of |silu(g) * u|.

    x: (T, C); w_gate, w_up: (E, N, C), expert e's rows. Returns (T, E) float32."""
    x = x.float()
    g = torch.einsum("tc,enc->ten", x, w_gate.float())                      # (T, E, N)
    u = torch.einsum("tc,enc->ten", x, w_up.float())                        # (T, E, N)
    return (F.silu(g) * u).abs().sum(-1)                                     # (T, E)


def fit_router(x: torch.Tensor, target: torch.Tensor, ridge: float = 1e-3) -> nn.Linear:
    """A linear router (with bias) fit by ridge least squares: x W^T + b ~ target.

    x: (T, C) MLP inputs; target: (T, E) what the scores should track (expert_mass). Solved in
    float64 with the normal equations: (A^T A + ridge * tr(A^T A)/C * I) [W b]^T = A^T target, A = [x 1].
    The ridge is relative to the data's scale, so it means the same for any layer."""
    if x.dim() != 2 or target.dim() != 2 or x.shape[0] != target.shape[0]:
        raise ValueError(f"x must be (T, C) and target (T, E) with the same T, got {tuple(x.shape)} and {tuple(target.shape)}")
    if x.shape[0] < 2:
        raise ValueError("fitting a router needs at least 2 tokens")
    T, C = x.shape
    E = target.shape[1]
    A = torch.cat([x.double(), torch.ones(T, 1, dtype=torch.float64)], dim=1)   # (T, C + 1)
    gram = A.T @ A                                                            # (C + 1, C + 1)
    reg = ridge * gram.diagonal()[:C].mean() * torch.eye(C + 1, dtype=torch.float64)
    reg[C, C] = 0.0                                                           # the bias is not shrunk
    sol = torch.linalg.solve(gram + reg, A.T @ target.double())              # (C + 1, E)
    router = nn.Linear(C, E, bias=True)
    with torch.no_grad():
        router.weight.copy_(sol[:C].T.float())                                # (E, C)
        router.bias.copy_(sol[C].float())                                     # (E,)
    return router


def topk_recall(logits: torch.Tensor, target: torch.Tensor, k: int) -> float:
    """Share of the k experts with the most mass (the oracle's choice) that the router also picks,
    averaged over tokens: 1.0 is a perfect router, k/E a random one."""
    if logits.shape != target.shape:
        raise ValueError(f"logits {tuple(logits.shape)} and target {tuple(target.shape)} must have the same shape")
    chosen = F.one_hot(topk_route(logits, k)[0], logits.shape[1]).sum(1)        # (T, E) 0/1
    best = F.one_hot(topk_route(target, k)[0], logits.shape[1]).sum(1)
    return float((chosen * best).sum() / best.sum())


@torch.no_grad()
def mlp_inputs(model: nn.Module, ids: list[int], window: int = 1024) -> list[torch.Tensor]:
    """What every block's MLP receives (its normed input) on a text, one (T, C) float32 tensor per
    layer, read with forward pre-hooks while the model runs over the text in windows of `window`
    tokens (each window its own sequence, positions from 0)."""
    if len(ids) < 2 or type(window) is not int or window < 2:
        raise ValueError(f"need at least 2 ids and an int window >= 2, got {len(ids)} ids, window {window!r}")
    seen: list[list[torch.Tensor]] = [[] for _ in model.blocks]
    hooks = [b.mlp.register_forward_pre_hook(lambda m, args, i=i: seen[i].append(args[0].reshape(-1, args[0].shape[-1]).float().cpu()))
             for i, b in enumerate(model.blocks)]
    try:
        run_windows(model, ids, window)
    finally:
        for h in hooks:
            h.remove()
    return [torch.cat(s) for s in seen]


@torch.no_grad()
def run_windows(model: nn.Module, ids: list[int], window: int) -> None:
    """Run the model over a text in windows of `window` tokens, each its own sequence (positions from
    0), for what hooks read on the way; the logits are thrown away."""
    for start in range(0, len(ids), window):
        chunk = torch.tensor(ids[start:start + window], device=model.device)[None]   # (1, W)
        model(chunk, torch.arange(chunk.shape[1], device=model.device)[None])


@torch.no_grad()
def fit_routers(model: nn.Module, ids: list[int], ridge: float = 1e-3, window: int = 1024) -> list[float]:
    """Fit every MoE layer's router on a text, in place: inputs from the model with all experts on
    (= the dense model), targets each expert's activation mass. Returns each layer's top-2 recall
    on that same text (how often the router finds the two experts with the most mass)."""
    from course.moe.moefy import moe_layers

    layers = moe_layers(model)
    if not layers:
        raise ValueError("the model has no MoE layers: moefy(model) first")
    saved = [(m.top_k, m.capacity_factor) for m in layers]
    for m in layers:
        m.top_k, m.capacity_factor = m.n_experts, None                      # the dense model's activations
    try:
        xs = mlp_inputs(model, ids, window)
    finally:
        for m, (k, cf) in zip(layers, saved):
            m.top_k, m.capacity_factor = k, cf
    recalls = []
    for m, x in zip(layers, xs):
        mass = expert_mass(x, m.w_gate.cpu(), m.w_up.cpu())                 # (T, E), on the CPU like x
        router = fit_router(x, mass, ridge)
        recalls.append(topk_recall(router(x), mass, min(2, m.n_experts)))
        m.router = router.to(m.w_gate.device)
    return recalls
