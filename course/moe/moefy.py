"""MoEfication (Zhang et al., 2022): cut a dense MLP into E experts, then route each token to k of them.

A SwiGLU MLP is a sum over its d_ff intermediate neurons:

    mlp(x) = down(silu(gate(x)) * up(x)) = sum_i  silu(g_i . x) * (u_i . x) * d_i

where g_i, u_i are row i of gate and up, and d_i is column i of down. Group the neurons into E sets
of N = d_ff / E and the sum splits into E smaller MLPs, the experts:

    mlp(x) = sum_e expert_e(x),    expert_e = rows S_e of gate and up, columns S_e of down

With all E experts the layer is the dense MLP, only summed in another order. With k < E, each
token runs only the k experts its router picks: k / E of the MLP's FLOPs and weight reads.
How the neurons are grouped decides how much that costs in quality: neurons that are active on the
same tokens should share an expert. MoEfication clusters neurons by their weights; here a balanced
k-means on the normalized [gate row, up row] of each neuron (balanced: every expert gets exactly N
neurons, so every expert is one (N, C) GEMM of the same shape).

    model = course.load_model()
    moefy(model, n_experts=8)            # each block.mlp becomes an MoEMLP, all experts on: same logits
    load_moe(model)                      # the course's shipped split and fitted routers instead
    set_top_k(model, 2)                  # now a sparse model: 2 of 8 experts per token

The shipped split (assets/moe/fit_moe.py) clusters neurons by co-activation instead: |silu(g) * u|
on a calibration text (`activation_features`), which keeps more of each token's activation in its
top experts than the weights do (layer 29, top 2 of 8: 64% of the mass against 62%, random 32%).

The decoder calls `block.mlp(x)` with x (B, T, C), so swapping the submodule is enough: the
decoder's code and API do not change.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from course.moe.dispatch import capacity, capacity_keep, moe_reference, moe_sorted
from course.moe.router import topk_route

SHIPPED = "moe_experts.safetensors"          # course/data/: the course model's split and routers (assets/moe/)


# ---------------------------------------------------------------------------------------------
# Grouping the neurons: balanced k-means.
# ---------------------------------------------------------------------------------------------
def balanced_assign(scores: torch.Tensor, size: int) -> torch.Tensor:
    """Give each of N items one of E clusters, exactly `size` items per cluster (N = E * size),
    greedily: walk the (item, cluster) pairs from the highest score down and take a pair when the
    item is still free and the cluster still has room. scores: (N, E). Returns labels (N,) long.

    Not the optimal assignment (that is a min-cost flow), but close, simple, and deterministic
    (a stable sort: ties go to the lower index)."""
    N, E = scores.shape
    if N != E * size:
        raise ValueError(f"{N} items cannot fill {E} clusters of {size} exactly")
    order = torch.sort(-scores.reshape(-1), stable=True).indices.tolist()
    labels, room, left = [-1] * N, [size] * E, N
    for flat in order:
        item, c = divmod(flat, E)
        if labels[item] < 0 and room[c]:
            labels[item], room[c], left = c, room[c] - 1, left - 1
            if not left:
                break
    return torch.tensor(labels, dtype=torch.long)


def balanced_kmeans(features: torch.Tensor, n_clusters: int, iters: int = 20, seed: int = 0) -> torch.Tensor:
    """Spherical k-means whose clusters all have the same size. features: (N, F), N a multiple of
    n_clusters. Rows are compared by cosine similarity. Returns labels (N,) long in 0..n_clusters-1."""
    if features.dim() != 2:
        raise ValueError(f"features must be (N, F), got {tuple(features.shape)}")
    N = features.shape[0]
    if type(n_clusters) is not int or n_clusters < 1 or N % n_clusters:
        raise ValueError(f"n_clusters must be an int that divides the {N} items, got {n_clusters!r}")
    f = F.normalize(features.double(), dim=1)                                # (N, F), unit rows
    g = torch.Generator().manual_seed(seed)
    centroids = f[torch.randperm(N, generator=g)[:n_clusters]]               # (E, F): E random items
    labels = None
    for _ in range(iters):
        new = balanced_assign(f @ centroids.T, N // n_clusters)              # (N,)
        if labels is not None and torch.equal(new, labels):
            break                                                            # converged
        labels = new
        sums = torch.zeros_like(centroids).index_add_(0, labels, f)          # (E, F)
        centroids = F.normalize(sums, dim=1)
    return labels


def weight_features(mlp: nn.Module) -> torch.Tensor:
    """A neuron's description for clustering: its gate row and its up row, each normalized. (d_ff, 2C)."""
    return torch.cat([F.normalize(mlp.gate_proj.weight.detach().double(), dim=1),
                      F.normalize(mlp.up_proj.weight.detach().double(), dim=1)], dim=1)


@torch.no_grad()
def activation_features(mlp: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """A neuron's description for clustering by co-activation: |silu(g) * u| on every token of a text.
    x: (T, C) the MLP's inputs (router.mlp_inputs). Returns (d_ff, T): neurons that fire on the same
    tokens get similar rows, so clustering them puts neurons that work together in one expert."""
    x = x.to(mlp.gate_proj.weight.dtype)
    return (F.silu(mlp.gate_proj(x)) * mlp.up_proj(x)).abs().T.double()        # (F, T)


def group_neurons(labels: torch.Tensor, n_experts: int) -> torch.Tensor:
    """Cluster labels (d_ff,) -> neurons (E, N): expert e's neuron indices, ascending."""
    neurons = [torch.nonzero(labels == e).flatten() for e in range(n_experts)]
    if len({len(n) for n in neurons}) != 1:
        raise ValueError(f"every expert needs the same number of neurons, got {[len(n) for n in neurons]}")
    return torch.stack(neurons)


# ---------------------------------------------------------------------------------------------
# The layer.
# ---------------------------------------------------------------------------------------------
class MoEMLP(nn.Module):
    """A SwiGLU MLP as E experts and a router.

    Weights, stacked for one launch over all experts (vLLM's layout):
        w_gate, w_up: (E, N, C)      w_down: (E, C, N)      neurons: (E, N) which dense neurons each holds
    Knobs (plain attributes, change them between forwards):
        top_k      experts per token; E (the default) runs all of them, which is the dense MLP
        weighting  "ones": each chosen expert counts fully (right for MoEfied experts, whose plain sum is
                   the dense MLP); "softmax": the router's renormalized weights (Mixtral's rule)
        capacity_factor  None, or rows per expert = ceil(factor * T * k / E); pairs past it are dropped
        impl       "sorted" (dispatch.moe_sorted), "reference" (loop over experts), "triton" (grouped GEMM)
        record     keep the last forward's routing in `last_ids` (T, k) and `last_keep` (T, k)
    """

    def __init__(self, w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor, neurons: torch.Tensor,
                 router: nn.Linear | None = None):
        super().__init__()
        E, N, C = w_gate.shape
        if w_up.shape != (E, N, C) or w_down.shape != (E, C, N) or neurons.shape != (E, N):
            raise ValueError(f"need w_gate, w_up (E, N, C), w_down (E, C, N), neurons (E, N); got {tuple(w_gate.shape)}, "
                             f"{tuple(w_up.shape)}, {tuple(w_down.shape)}, {tuple(neurons.shape)}")
        self.w_gate, self.w_up, self.w_down = (nn.Parameter(w.detach().clone()) for w in (w_gate, w_up, w_down))
        self.register_buffer("neurons", neurons.long().clone())
        self.router = router
        self.n_experts, self.top_k = E, E
        self.weighting, self.capacity_factor, self.impl = "ones", None, "sorted"
        self.record, self.last_ids, self.last_keep = False, None, None

    @classmethod
    def from_dense(cls, mlp: nn.Module, neurons: torch.Tensor, router: nn.Linear | None = None) -> "MoEMLP":
        """Experts cut out of a dense SwiGLU MLP (the decoder's `MLP`): expert e = neurons[e]."""
        if getattr(mlp, "family", None) != "llama":
            raise ValueError("MoEfication here splits a SwiGLU MLP (the Llama family); this MLP is "
                             f"{getattr(mlp, 'family', type(mlp).__name__)!r}")
        d_ff = mlp.gate_proj.out_features
        if neurons.dim() != 2 or sorted(neurons.flatten().tolist()) != list(range(d_ff)):
            raise ValueError(f"neurons must be (E, N) holding each of the {d_ff} neurons exactly once")
        gate, up, down = mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight   # (F, C), (F, C), (C, F)
        return cls(gate[neurons], up[neurons], down[:, neurons].permute(1, 0, 2), neurons, router)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """ids (T, k), weights (T, k) for x (T, C), as this layer's knobs say."""
        T, E, k = x.shape[0], self.n_experts, self.top_k
        if k == E and (self.router is None or self.weighting == "ones"):
            ids = torch.arange(E, device=x.device).expand(T, E)                 # every expert: no router needed
            weights = torch.ones(T, E, device=x.device)
        else:
            if self.router is None:
                raise RuntimeError(f"top_k = {k} of {E} experts needs a router: fit one (router.fit_router) or load_moe()")
            ids, weights = topk_route(self.router(x.float()), k)
            if self.weighting == "ones":
                weights = torch.ones_like(weights)
            elif self.weighting != "softmax":
                raise ValueError(f"weighting must be 'ones' or 'softmax', got {self.weighting!r}")
        keep = None
        if self.capacity_factor is not None:
            keep = capacity_keep(ids, E, capacity(T, ids.shape[1], E, self.capacity_factor))
            weights = weights * keep                                             # a dropped pair adds nothing
        if self.record:
            self.last_ids, self.last_keep = ids.detach().clone(), None if keep is None else keep.clone()
        return ids, weights

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])                                             # (B*T, C)
        ids, weights = self.route(x)
        if self.impl == "sorted":
            y = moe_sorted(x, self.w_gate, self.w_up, self.w_down, ids, weights)
        elif self.impl == "reference":
            y = moe_reference(x, self.w_gate, self.w_up, self.w_down, ids, weights)
        elif self.impl == "triton":
            from course.moe.grouped_gemm import fused_moe
            y = fused_moe(x, self.w_gate, self.w_up, self.w_down, ids, weights)
        else:
            raise ValueError(f"impl must be 'sorted', 'reference' or 'triton', got {self.impl!r}")
        return y.reshape(shape)

    def extra_repr(self) -> str:
        E, N, C = self.w_gate.shape
        return f"experts={E}, neurons_per_expert={N}, d_model={C}, top_k={self.top_k}, weighting={self.weighting!r}"


# ---------------------------------------------------------------------------------------------
# The model.
# ---------------------------------------------------------------------------------------------
def moe_layers(model: nn.Module) -> list[MoEMLP]:
    """The MoEMLP of every block, in order (empty for a dense model)."""
    return [b.mlp for b in model.blocks if isinstance(b.mlp, MoEMLP)]


@torch.no_grad()
def moefy(model: nn.Module, n_experts: int = 8, neurons: list[torch.Tensor] | None = None,
          routers: list[nn.Linear] | None = None, seed: int = 0) -> nn.Module:
    """Replace every block's MLP by an MoEMLP, in place; returns the model. All experts stay on, so
    the logits do not change (up to the order of float sums). neurons: a (E, N) grouping per layer
    (default: balanced k-means on each layer's weights, seeded); routers: one per layer, or None."""
    blocks = list(model.blocks)
    if isinstance(blocks[0].mlp, MoEMLP):
        raise ValueError("this model is already split into experts")
    if getattr(blocks[0].mlp, "family", None) != "llama":
        raise ValueError("MoEfication here splits a SwiGLU MLP (the Llama family); this model's MLP is "
                         f"{getattr(blocks[0].mlp, 'family', type(blocks[0].mlp).__name__)!r}")
    d_ff = blocks[0].mlp.gate_proj.out_features
    if type(n_experts) is not int or n_experts < 1 or d_ff % n_experts:
        raise ValueError(f"n_experts must divide d_ff = {d_ff}, got {n_experts!r}")
    for name, given in (("neurons", neurons), ("routers", routers)):
        if given is not None and len(given) != len(blocks):
            raise ValueError(f"{name} must hold one entry per layer ({len(blocks)}), got {len(given)}")
    for i, block in enumerate(blocks):
        if neurons is None:
            groups = group_neurons(balanced_kmeans(weight_features(block.mlp), n_experts, seed=seed + i), n_experts)
        else:
            groups = neurons[i]
        router = None if routers is None else routers[i]
        moe = MoEMLP.from_dense(block.mlp, groups.to(block.mlp.gate_proj.weight.device), router)
        block.mlp = moe.to(block.mlp.gate_proj.weight.device)
    return model


def set_top_k(model: nn.Module, k: int, weighting: str | None = None, capacity_factor: float | None = None,
              impl: str | None = None, dense_layers: tuple[int, ...] = ()) -> None:
    """Set every MoE layer's knobs at once (see MoEMLP); None leaves weighting and impl as they are,
    while capacity_factor is always set (None: no capacity limit). The layers in `dense_layers` run
    all their experts, i.e. stay dense (DeepSeek-V3 keeps its first 3 layers dense: its
    `first_k_dense_replace`; here layer 0 is the one that suffers most from being made sparse)."""
    layers = moe_layers(model)
    if not layers:
        raise ValueError("the model has no MoE layers: moefy(model) or load_moe(model) first")
    E = layers[0].n_experts
    if type(k) is not int or not 1 <= k <= E:
        raise ValueError(f"k must be an int from 1 to {E}, got {k!r}")
    if not all(type(i) is int and 0 <= i < len(layers) for i in dense_layers):
        raise ValueError(f"dense_layers must be layer indices in 0..{len(layers) - 1}, got {dense_layers!r}")
    for i, layer in enumerate(layers):
        layer.top_k, layer.capacity_factor = (E if i in dense_layers else k), capacity_factor
        if weighting is not None:
            layer.weighting = weighting
        if impl is not None:
            layer.impl = impl


def save_moe(model: nn.Module, path, metadata: dict[str, str] | None = None) -> None:
    """The split and the routers (not the weights: they are the dense model's) to a safetensors file."""
    from safetensors.torch import save_file

    tensors = {}
    for i, layer in enumerate(moe_layers(model)):
        tensors[f"layers.{i}.neurons"] = layer.neurons.to(torch.int32).cpu().contiguous()
        if layer.router is not None:
            tensors[f"layers.{i}.router.weight"] = layer.router.weight.detach().float().cpu().contiguous()
            tensors[f"layers.{i}.router.bias"] = layer.router.bias.detach().float().cpu().contiguous()
    save_file(tensors, str(path), metadata=metadata)


@torch.no_grad()
def load_moe(model: nn.Module, path=None) -> nn.Module:
    """moefy(model) with a saved split and routers (default: the course's, in course/data/)."""
    from safetensors import safe_open

    if path is None:
        from course.assets import asset
        path = asset(SHIPPED)
    with safe_open(str(path), framework="pt") as f:
        keys, meta = set(f.keys()), f.metadata() or {}
        n = len(model.blocks)
        if f"layers.{n - 1}.neurons" not in keys or f"layers.{n}.neurons" in keys:
            raise ValueError(f"{path} does not hold a split for {n} layers")
        neurons = [f.get_tensor(f"layers.{i}.neurons").long() for i in range(n)]
        routers = []
        for i in range(n):
            w, b = f.get_tensor(f"layers.{i}.router.weight"), f.get_tensor(f"layers.{i}.router.bias")
            r = nn.Linear(w.shape[1], w.shape[0], bias=True)
            r.weight.copy_(w)
            r.bias.copy_(b)
            routers.append(r.to(model.device))
    if model.cfg.d_ff != neurons[0].numel() or model.cfg.d_model != routers[0].in_features:
        raise ValueError(f"{path} was made for d_ff {neurons[0].numel()}, d_model {routers[0].in_features} "
                         f"({meta.get('model', 'unknown model')}), not this model's {model.cfg.d_ff}, {model.cfg.d_model}")
    return moefy(model, neurons[0].shape[0], neurons, routers)
