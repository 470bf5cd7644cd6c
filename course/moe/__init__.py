"""Lab 14's engine core: the course model made sparse (MoEfication), its routers, and what an MoE layer
runs on, from a PyTorch reference to a grouped-GEMM Triton kernel and expert parallelism.

    model = course.load_model()
    load_moe(model)                                  # 8 experts per MLP and fitted routers (course/data/)
    set_top_k(model, 2)                              # 2 of 8 experts per token; set_top_k(model, 8): dense again
    perplexity_vs_k(model, heldout_ids(tok))         # {1: ..., 2: ..., 4: ..., 8: dense}

One mechanism per file:
    moefy.py            split a SwiGLU MLP into experts (balanced k-means), the MoEMLP layer, load/save
    router.py           top-k routing with renormalized softmax weights; routers fit by least squares
    dispatch.py         sort pairs by expert, counts, offsets, block alignment, un-permute and combine
    grouped_gemm.py     the Triton kernels: every expert's rows in one launch, SwiGLU fused
    expert_parallel.py  experts sharded over ranks, all-to-all there and back
    stats.py            load per expert and per rank, imbalance, capacity drops, experts touched
    quality.py          perplexity vs k and vs capacity factor
    plots.py            one batch's tokens flowing to experts and ranks (matplotlib; lab 14's plot)
"""
from course.moe.dispatch import (Aligned, Sorted, align_block_size, capacity, capacity_keep, max_padded, moe_reference,
                                 moe_sorted, permute, sort_by_expert, swiglu, unpermute_combine)
from course.moe.expert_parallel import EPStats, ExpertParallelMLP, bytes_formula, ep_moe, expert_parallel, expert_range
from course.moe.moefy import (MoEMLP, activation_features, balanced_assign, balanced_kmeans, group_neurons, load_moe,
                              moe_layers, moefy, save_moe, set_top_k, weight_features)
from course.moe.quality import perplexity_vs_capacity, perplexity_vs_k, windowed_nll
from course.moe.router import (calibration_ids, expert_mass, fit_router, fit_routers, mlp_inputs, topk_recall,
                               topk_route)
from course.moe.stats import (dropped_share, expert_counts, experts_touched, imbalance, load_report, rank_counts,
                              record_routing, touched_uniform)

__all__ = [
    "Aligned", "EPStats", "ExpertParallelMLP", "MoEMLP", "Sorted", "activation_features", "align_block_size",
    "balanced_assign", "balanced_kmeans", "bytes_formula", "calibration_ids", "capacity", "capacity_keep",
    "dropped_share", "ep_moe", "expert_counts", "expert_mass", "expert_parallel", "expert_range", "experts_touched",
    "fit_router", "fit_routers", "group_neurons", "imbalance", "load_moe", "load_report", "max_padded", "mlp_inputs",
    "moe_layers", "moe_reference", "moe_sorted", "moefy", "perplexity_vs_capacity", "perplexity_vs_k", "permute",
    "rank_counts", "record_routing", "save_moe", "set_top_k", "sort_by_expert", "swiglu", "topk_recall", "topk_route",
    "touched_uniform", "unpermute_combine", "weight_features", "windowed_nll",
]
