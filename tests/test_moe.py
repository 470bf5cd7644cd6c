"""course.moe (lab 14's engine core): MoEfication, routing, dispatch, the grouped-GEMM Triton kernels,
expert parallelism and the load statistics.

Each part is checked against a reference written here, independently of the package: a dense
float64 einsum over every expert (then pick the chosen ones), a loop-by-loop block alignment,
hand-counted capacity drops, and the single-process model for expert parallelism. Tiny random
shapes keep the file fast; the Triton kernels run in the interpreter (conftest sets
TRITON_INTERPRET=1) and compile for sm_80 and sm_90 in a background process meanwhile. Tests that
load the real model are marked slow.
"""
from __future__ import annotations

import hashlib
import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from course.models import Decoder, ModelConfig, init_weights
from course.moe import (EPStats, MoEMLP, align_block_size, balanced_assign, balanced_kmeans, bytes_formula, capacity,
                        capacity_keep, ep_moe, expert_counts, expert_mass, expert_parallel, expert_range,
                        experts_touched, fit_router, fit_routers, group_neurons, imbalance, max_padded, moe_layers,
                        moe_reference, moe_sorted, moefy, perplexity_vs_capacity, perplexity_vs_k, rank_counts,
                        record_routing, set_top_k, sort_by_expert, topk_recall, topk_route, touched_uniform,
                        unpermute_combine, permute, windowed_nll, dropped_share)
from course.tolerance import assert_orders_close, for_decoder, order_tol

LLAMA = ModelConfig(family="llama", vocab_size=61, n_layer=2, n_head=4, n_kv_head=2, d_model=32, d_ff=64, max_seq_len=64)


def tiny(seed: int = 1) -> Decoder:
    return init_weights(Decoder(LLAMA), std=0.3, seed=seed).eval()


def weights(E=4, N=16, C=32, seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    wg = torch.randn(E, N, C, generator=g) * scale / math.sqrt(C)
    wu = torch.randn(E, N, C, generator=g) * scale / math.sqrt(C)
    wd = torch.randn(E, C, N, generator=g) * scale / math.sqrt(N)
    return wg, wu, wd


def routing(T, E, k, seed=0):
    g = torch.Generator().manual_seed(seed + 100)
    return topk_route(torch.randn(T, E, generator=g), k)


def dense_reference(x, wg, wu, wd, ids, w):
    """Every expert on every token in float64, then the chosen ones picked and weighted."""
    x, wg, wu, wd = (t.double() for t in (x, wg, wu, wd))
    h = F.silu(torch.einsum("tc,enc->ten", x, wg)) * torch.einsum("tc,enc->ten", x, wu)   # (T, E, N)
    y = torch.einsum("ten,ecn->tec", h, wd)                                              # (T, E, C)
    picked = y.gather(1, ids.long()[:, :, None].expand(-1, -1, y.shape[2]))              # (T, k, C)
    return (picked * w.double()[:, :, None]).sum(1)


def close(got, want64, terms, stages=2, what=""):
    want = want64.float()
    torch.testing.assert_close(got.float(), want, **order_tol(want, terms=terms, stages=stages),
                               msg=lambda m: f"{what}: {m}")


# --- router ---------------------------------------------------------------------------------------

def test_topk_route_renormalizes_softmax_over_the_chosen_experts():
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.0], [0.5, 0.5, 0.5, 4.0]])
    ids, w = topk_route(logits, 2)
    assert ids.tolist() == [[1, 2], [3, 0]], "best first; a tie goes to the lower expert id"
    full = logits.softmax(-1)
    want = full.gather(1, ids) / full.gather(1, ids).sum(-1, keepdim=True)    # Mixtral: softmax all, keep k, renormalize
    torch.testing.assert_close(w, want)
    torch.testing.assert_close(w.sum(-1), torch.ones(2))
    ids1, w1 = topk_route(logits, 1)
    assert ids1.tolist() == [[1], [3]] and torch.equal(w1, torch.ones(2, 1)), "k = 1: the one expert gets weight 1"
    with pytest.raises(ValueError, match="k must be"):
        topk_route(logits, 5)
    with pytest.raises(ValueError, match=r"\(T, E\)"):
        topk_route(logits[0], 1)


def test_fit_router_recovers_a_linear_map_and_recall_scores_it():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(400, 12, generator=g)
    W, b = torch.randn(5, 12, generator=g), torch.randn(5, generator=g)
    target = x @ W.T + b
    r = fit_router(x, target, ridge=0.0)
    torch.testing.assert_close(r.weight.data, W, atol=1e-4, rtol=0)
    torch.testing.assert_close(r.bias.data, b, atol=1e-4, rtol=0)
    assert topk_recall(r(x), target, 2) == 1.0
    assert topk_recall(-target, target, 2) == 0.0, "the worst router picks none of the best experts"
    shrunk = fit_router(x, target, ridge=10.0)
    assert shrunk.weight.norm() < 0.5 * W.norm(), "a large ridge must shrink the weights"


def test_expert_mass_is_the_sum_of_each_experts_activations():
    wg, wu, _ = weights(E=3, N=4, C=8)
    x = torch.randn(5, 8)
    mass = expert_mass(x, wg, wu)
    for e in range(3):
        h = F.silu(x @ wg[e].T) * (x @ wu[e].T)
        torch.testing.assert_close(mass[:, e], h.abs().sum(-1))


# --- moefy ----------------------------------------------------------------------------------------

def test_balanced_kmeans_gives_equal_clusters_and_finds_planted_ones():
    g = torch.Generator().manual_seed(0)
    centers = F.normalize(torch.randn(4, 16, generator=g), dim=1)
    truth = torch.arange(4).repeat_interleave(6)[torch.randperm(24, generator=g)]
    feats = centers[truth] + 0.05 * torch.randn(24, 16, generator=g)
    labels = balanced_kmeans(feats, 4, seed=3)
    assert torch.bincount(labels, minlength=4).tolist() == [6] * 4, "balanced: every cluster the same size"
    same = truth[:, None] == truth[None, :]
    assert torch.equal(labels[:, None] == labels[None, :], same), "planted clusters must be found up to relabeling"
    assert torch.equal(balanced_kmeans(feats, 4, seed=3), labels), "seeded: the same answer twice"
    # greedy assignment respects the room left even when every item prefers cluster 0
    scores = torch.tensor([[9.0, 1.0], [8.0, 2.0], [7.0, 3.0], [6.0, 0.0]])
    assert balanced_assign(scores, 2).tolist() == [0, 0, 1, 1]
    with pytest.raises(ValueError, match="divides"):
        balanced_kmeans(feats, 5)


def test_moe_mlp_with_all_experts_is_the_dense_mlp():
    model = tiny()
    mlp = model.blocks[0].mlp
    labels = balanced_kmeans(torch.randn(64, 8), 4)
    moe = MoEMLP.from_dense(mlp, group_neurons(labels, 4))
    assert moe.w_gate.shape == (4, 16, 32) and moe.w_down.shape == (4, 32, 16)
    assert sorted(moe.neurons.flatten().tolist()) == list(range(64)), "every neuron in exactly one expert"
    x = torch.randn(3, 5, 32)
    with torch.no_grad():
        want = mlp(x)
        for impl in ("sorted", "reference"):
            moe.impl = impl
            # float32, the same d_ff = 64 terms summed as 4 groups of 16: order_tol's ulps budget for 64 terms
            assert_orders_close(moe(x), want, terms=64, what=f"all experts ({impl}) vs dense")
    with pytest.raises(RuntimeError, match="needs a router"):
        moe.top_k = 2
        moe(x)


def test_moefy_keeps_the_logits_and_topk_equals_masked_dense_neurons():
    model = tiny()
    ids = torch.randint(0, 61, (2, 9), generator=torch.Generator().manual_seed(0))
    pos = torch.arange(9)[None].expand(2, -1)
    with torch.no_grad():
        dense = model(ids, pos)
        dense_mlp = [b.mlp for b in model.blocks]
        moefy(model, n_experts=4)
        assert all(isinstance(b.mlp, MoEMLP) for b in model.blocks) and type(model).forward is Decoder.forward
        assert_orders_close(model(ids, pos), dense, **for_decoder(model.cfg), what="moefied model, all experts")
        # top-2 of 4 with a router: the same as the dense MLP with the other experts' neurons zeroed
        layer = model.blocks[1].mlp
        layer.router = nn.Linear(32, 4)
        layer.top_k = 2
        x = torch.randn(6, 32)
        chosen, _ = topk_route(layer.router(x), 2)
        mask = torch.zeros(6, 64)
        for t in range(6):
            for e in chosen[t].tolist():
                mask[t, layer.neurons[e]] = 1.0
        m = dense_mlp[1]
        want = (F.silu(m.gate_proj(x)) * m.up_proj(x) * mask) @ m.down_proj.weight.T
        assert_orders_close(layer(x), want, terms=64, what="top-2 MoE vs masked dense")
    with pytest.raises(ValueError, match="already split"):
        moefy(model)
    gpt2 = ModelConfig(family="gpt2", vocab_size=61, n_layer=1, n_head=4, n_kv_head=4, d_model=32, d_ff=64, max_seq_len=64)
    with pytest.raises(ValueError, match="SwiGLU"):
        moefy(Decoder(gpt2), 4)
    with pytest.raises(ValueError, match="divide d_ff"):
        moefy(tiny(), 5)


def test_routers_fit_save_load_and_set_top_k(tmp_path):
    model = moefy(tiny(), 4)
    text = torch.randint(0, 61, (120,), generator=torch.Generator().manual_seed(1)).tolist()
    recalls = fit_routers(model, text, window=40)
    assert len(recalls) == 2 and all(0.5 < r <= 1.0 for r in recalls), f"top-2 recall on its own text: {recalls}"
    path = tmp_path / "moe.safetensors"
    from course.moe import load_moe, save_moe
    save_moe(model, path, {"model": "tiny"})
    again = load_moe(tiny(), path)
    for a, b in zip(moe_layers(model), moe_layers(again)):
        assert torch.equal(a.neurons, b.neurons) and torch.equal(a.router.weight, b.router.weight)
    set_top_k(again, 1, dense_layers=(0,))
    assert [m.top_k for m in moe_layers(again)] == [4, 1]
    with pytest.raises(ValueError, match="k must be"):
        set_top_k(again, 0)
    big = ModelConfig(family="llama", vocab_size=61, n_layer=2, n_head=4, n_kv_head=2, d_model=32, d_ff=128, max_seq_len=64)
    with pytest.raises(ValueError, match="made for d_ff 64"):
        load_moe(Decoder(big), path)


# --- dispatch -------------------------------------------------------------------------------------

def align_reference(ids: torch.Tensor, E: int, bm: int):
    """vLLM's moe_align_block_size, one pair at a time."""
    T, k = ids.shape
    groups = [[] for _ in range(E)]
    for p, e in enumerate(ids.reshape(-1).tolist()):
        groups[e].append(p)
    sorted_ids, blocks = [], []
    for e, g in enumerate(groups):
        n = -(-len(g) // bm) * bm
        sorted_ids += g + [T * k] * (n - len(g))
        blocks += [e] * (n // bm)
    return sorted_ids, blocks


@pytest.mark.parametrize("T,E,k,bm", [(13, 4, 2, 4), (8, 4, 1, 4), (1, 8, 2, 16), (6, 3, 3, 2), (0, 4, 2, 4)])
def test_align_block_size_matches_the_loop(T, E, k, bm):
    ids = routing(T, E, k)[0] if T else torch.empty(0, k, dtype=torch.long)
    al = align_block_size(ids, E, bm)
    want_ids, want_blocks = align_reference(ids, E, bm)
    n = int(al.n_padded)
    assert n == len(want_ids) and n % bm == 0
    assert al.sorted_ids[:n].tolist() == want_ids, "pairs by expert, token order inside, groups padded with T*k"
    assert al.expert_ids[:n // bm].tolist() == want_blocks
    assert al.sorted_ids.numel() == max_padded(T * k, E, bm) >= n, "a fixed size: the worst case"
    assert (al.sorted_ids[n:] == T * k).all() and (al.expert_ids[n // bm:] == -1).all()


def test_align_exact_multiples_and_an_idle_expert():
    ids = torch.tensor([[0], [0], [0], [0], [2], [2]])           # expert 0: exactly one block of 4; expert 1: none
    al = align_block_size(ids, 3, 4)
    assert int(al.n_padded) == 8
    assert al.sorted_ids[:8].tolist() == [0, 1, 2, 3, 4, 5, 6, 6]
    assert al.expert_ids[:2].tolist() == [0, 2], "an expert nobody chose gets no block"
    with pytest.raises(ValueError, match="expert ids in 0..2"):
        align_block_size(torch.tensor([[3]]), 3, 4)
    with pytest.raises(ValueError, match="block_m"):
        align_block_size(ids, 3, 0)


def test_sort_permute_combine_round_trip():
    T, E, k = 9, 4, 3
    ids, w = routing(T, E, k)
    s = sort_by_expert(ids, E)
    assert s.counts.tolist() == torch.bincount(ids.reshape(-1), minlength=E).tolist()
    assert s.offsets.tolist() == [0] + s.counts.cumsum(0).tolist()
    assert (ids.reshape(-1)[s.order].diff() >= 0).all(), "sorted by expert"
    x = torch.randn(T, 5)
    xs = permute(x, s.order, k)
    assert torch.equal(xs, x[s.order // k])
    torch.testing.assert_close(unpermute_combine(xs, s.order, w), x * w.sum(1, keepdim=True))
    torch.testing.assert_close(unpermute_combine(xs, s.order, torch.ones(T, k)), k * x)


@pytest.mark.parametrize("T,k", [(11, 2), (1, 1), (5, 4)])
def test_moe_sorted_and_reference_match_the_dense_einsum(T, k):
    wg, wu, wd = weights()
    x = torch.randn(T, 32, generator=torch.Generator().manual_seed(T))
    ids, w = routing(T, 4, k, seed=T)
    want = dense_reference(x, wg, wu, wd, ids, w)
    close(moe_sorted(x, wg, wu, wd, ids, w), want, terms=32, what="moe_sorted")
    close(moe_reference(x, wg, wu, wd, ids, w), want, terms=32, what="moe_reference")
    with pytest.raises(ValueError, match="w_down must be"):
        moe_sorted(x, wg, wu, wd.transpose(1, 2), ids, w)


def test_capacity_keeps_first_choices_first():
    ids = torch.tensor([[0, 1], [0, 2], [1, 0], [0, 3]])         # expert 0: first choice of t0, t1, t3; second of t2
    keep = capacity_keep(ids, 4, 2)
    assert keep.tolist() == [[True, True], [True, True], [True, False], [False, True]], \
        "expert 0 keeps the first choices of t0 and t1; t3's first choice and t2's second are dropped"
    assert capacity_keep(ids, 4, 0).sum() == 0 and capacity_keep(ids, 4, 8).all()
    assert capacity(10, 2, 8, 1.25) == 4 and capacity(8, 2, 8, 1.0) == 2     # ceil(1.25 * 20 / 8) = ceil(3.125)
    assert dropped_share(ids, 4, 0.5) == 0.5                                 # room for 1 row each: 4 of 8 pairs dropped


# --- the grouped-GEMM kernels (Triton interpreter on a CPU) --------------------------------------

@pytest.fixture(scope="module")
def compile_job():
    """Both kernels compiled for sm_80 (A100) and sm_90 (H100) in bf16, started once in the background."""
    from course.kernels import kernel_source, start_compile_report
    from course.moe.grouped_gemm import compile_jobs, grouped_gemm_kernel, swiglu_grouped_kernel
    return start_compile_report(kernel_source(grouped_gemm_kernel, swiglu_grouped_kernel), compile_jobs("bf16", (80, 90)))


@pytest.mark.parametrize("T,E,k", [(7, 4, 2), (1, 4, 1), (20, 2, 2)])
def test_fused_moe_kernels_match_the_reference(compile_job, T, E, k):
    from course.moe.grouped_gemm import fused_moe
    wg, wu, wd = weights(E=E, N=32, C=48)                        # C = 48: not a multiple of BLOCK_K = 32
    x = torch.randn(T, 48, generator=torch.Generator().manual_seed(T))
    ids, w = routing(T, E, k, seed=T)
    if T == 20:
        ids = torch.zeros_like(ids)                              # every pair on expert 0 ...
        ids[:, 1] = 1 if E > 1 else 0                            # ... and expert 1: 20 rows each, 2 blocks of 16
    close(fused_moe(x, wg, wu, wd, ids, w), dense_reference(x, wg, wu, wd, ids, w), terms=48, what="fused_moe")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_fused_moe_in_half_precision(compile_job, dtype):
    from course.moe.grouped_gemm import fused_moe
    wg, wu, wd = (w.to(dtype) for w in weights(E=4, N=32, C=32))
    x = torch.randn(9, 32, generator=torch.Generator().manual_seed(1)).to(dtype)
    ids, w = routing(9, 4, 2)
    got = fused_moe(x, wg, wu, wd, ids, w)
    want = dense_reference(x, wg, wu, wd, ids, w)                # float64 from the same (rounded) inputs
    # what is left: h rounded to the dtype between the launches, and the output rounded; each within
    # half an ulp, a few ulps at the scale of the output after the sums (bf16 ulp 2^-7, fp16 2^-10)
    assert got.dtype == dtype
    err = float((got.double() - want).abs().max() / want.abs().max())
    assert err < 4 * torch.finfo(dtype).eps, f"{dtype}: relative error {err:.2e}"


def test_grouped_gemm_gathers_scatters_and_weights(compile_job):
    from course.moe.grouped_gemm import grouped_gemm
    T, E, k, K, N = 9, 3, 2, 40, 24
    g = torch.Generator().manual_seed(0)
    a, w = torch.randn(T, K, generator=g), torch.randn(E, N, K, generator=g)
    ids, rw = routing(T, E, k)
    want = torch.stack([a[p // k].double() @ w[ids.reshape(-1)[p]].double().T for p in range(T * k)])   # (P, N)
    close(grouped_gemm(a, w, ids), want, terms=K, stages=1, what="gather by token")
    close(grouped_gemm(a, w, ids, rw), want * rw.reshape(-1, 1).double(), terms=K, stages=1, what="weighted")
    per_pair = torch.randn(T * k, K, generator=g)
    want = torch.stack([per_pair[p].double() @ w[ids.reshape(-1)[p]].double().T for p in range(T * k)])
    close(grouped_gemm(per_pair, w, ids, a_per_pair=True), want, terms=K, stages=1, what="one row per pair")
    with pytest.raises(ValueError, match="power of two >= 16"):
        grouped_gemm(a, w, ids, block_m=8)


def test_moe_layer_runs_on_the_triton_impl(compile_job):
    model = moefy(tiny(), 2)                                     # N = 32 neurons per expert
    layer = model.blocks[0].mlp
    layer.router, layer.top_k = nn.Linear(32, 2), 1
    x = torch.randn(5, 32)
    with torch.no_grad():
        want = layer(x)
        layer.impl = "triton"
        assert_orders_close(layer(x), want, terms=64, stages=2, what="impl='triton' vs 'sorted'")


def test_the_gpu_benchmark_is_a_perf_report():
    from course.moe.grouped_gemm import make_benchmark
    bench = make_benchmark(tokens=(8, 64))                       # built here, run only on a GPU (dev/moe_bench.py)
    b = bench.benchmarks[0] if isinstance(bench.benchmarks, list) else bench.benchmarks
    assert b.line_vals == ["fused", "loop", "dense"] and b.x_vals == [8, 64]


def test_kernels_compile_for_a100_and_h100_with_tensor_cores(compile_job):
    report = compile_job.result()
    assert all(r["error"] is None for r in report), [r["error"] for r in report if r["error"]]
    sm80, sm90 = report[:2], report[2:]
    assert all(r["mma"] > 0 for r in sm80), "tl.dot on sm_80 must compile to tensor-core mma.sync"
    assert all(r["wgmma"] > 0 for r in sm90), "tl.dot on sm_90 must compile to wgmma"


# --- expert parallelism ---------------------------------------------------------------------------

def _ep_layer(comm, xs, routes, wg, wu, wd, E):
    mine = expert_range(E, comm.world_size, comm.rank)
    sl = slice(mine.start, mine.stop)
    stats = EPStats()
    y = ep_moe(xs[comm.rank], *routes[comm.rank], wg[sl], wu[sl], wd[sl], E, stats=stats)
    return y, stats


def _ep_model(comm, model, prompts):
    stats = expert_parallel(model, comm.rank, comm.world_size)
    ids = prompts[comm.rank]
    with torch.no_grad():
        logits = model(ids[None], torch.arange(ids.numel())[None])[0]
    return logits, stats


def test_expert_parallel_equals_one_process_and_bytes_match_the_formula():
    from course.dist import launch
    E, C, k = 4, 32, 2
    wg, wu, wd = weights(E=E, C=C)
    g = torch.Generator().manual_seed(5)
    xs = [torch.randn(6, C, generator=g), torch.randn(3, C, generator=g)]     # uneven token counts
    routes = [routing(6, E, k, seed=1), routing(3, E, k, seed=2)]
    routes[1] = (torch.tensor([[3, 2]] * 3), routes[1][1])                     # rank 1 (experts 2, 3) keeps its pairs at home
    out = launch(_ep_layer, 2, xs, routes, wg, wu, wd, E, quiet=True)
    for r in range(2):
        close(out[r][0], dense_reference(xs[r], wg, wu, wd, *routes[r]), terms=C, what=f"rank {r}")
    want_bytes = bytes_formula([ids for ids, _ in routes], E, C, 4)
    assert [o[1].bytes_sent for o in out] == want_bytes, "bytes sent = C * b * (pairs out + rows returned) + 8 (E - E/W)"
    assert out[1][1].pairs_out == 0 and out[0][1].pairs_in == 0
    assert out[0][1].pairs_out == int((routes[0][0] >= 2).sum())

    # the whole (tiny) model, one prompt per rank, top-2 of 4 experts: the logits of one process
    model = moefy(tiny(), 4)
    for m in moe_layers(model):
        m.router = nn.Linear(32, 4)
    set_top_k(model, 2, weighting="softmax")
    prompts = [torch.tensor([3, 14, 15, 9, 2, 6]), torch.tensor([27, 18, 28])]
    got = launch(_ep_model, 2, model, prompts, quiet=True)
    for r, ids in enumerate(prompts):
        with torch.no_grad():
            want = model(ids[None], torch.arange(ids.numel())[None])[0]
        assert_orders_close(got[r][0], want, **for_decoder(model.cfg), what=f"expert-parallel logits, rank {r}")
        assert got[r][1].calls == 2


# --- statistics and quality -----------------------------------------------------------------------

def test_load_statistics():
    ids = torch.tensor([[0, 1], [0, 2], [0, 3], [0, 1]])
    c = expert_counts(ids, 4)
    assert c.tolist() == [4, 2, 1, 1]
    assert imbalance(c) == 2.0 and imbalance(torch.tensor([3, 3])) == 1.0
    assert rank_counts(c, 2).tolist() == [6, 2]
    keep = torch.tensor([[True, True], [True, False], [False, True], [True, True]])
    assert expert_counts(ids, 4, keep).tolist() == [3, 2, 0, 1]
    with pytest.raises(ValueError, match="divide"):
        rank_counts(c, 3)


def test_experts_touched_against_the_uniform_formula():
    assert touched_uniform(1, 2, 8) == 0.25 and abs(touched_uniform(8, 2, 8) - (1 - 0.75 ** 8)) < 1e-12
    g = torch.Generator().manual_seed(0)
    uniform = [torch.stack([torch.randperm(8, generator=g)[:2] for _ in range(2000)]) for _ in range(2)]
    got = experts_touched(uniform, [1, 4, 16], 8, trials=100)
    for B, share in got.items():
        assert abs(share - touched_uniform(B, 2, 8)) < 0.03, f"B={B}: {share} vs {touched_uniform(B, 2, 8)}"
    same = [torch.tensor([[3, 5]] * 50)]
    assert experts_touched(same, [1, 32], 8, trials=5) == {1: 0.25, 32: 0.25}, "one route for all: always k/E"


def test_flow_plot_draws_tokens_experts_and_ranks():
    import matplotlib
    matplotlib.use("Agg")
    from course.moe.plots import plot_flow
    ids = torch.tensor([[0, 5], [3, 5], [5, 1]])
    keep = torch.tensor([[True, True], [True, False], [True, True]])
    fig = plot_flow(["a", "b", "c"], ids, torch.full((3, 2), 0.5), 8, world_size=2, keep=keep)
    ax = fig.axes[0]
    texts = [t.get_text() for t in ax.texts]
    assert "expert 5: 2" in texts and "rank 0: 3 pairs" in texts and "rank 1: 2 pairs" in texts, texts
    assert "1 pairs dropped" in ax.get_title()
    dashed = [ln for ln in ax.lines if ln.get_linestyle() == "--"]
    assert len(dashed) == 1, "one dropped pair: one dashed line"
    with pytest.raises(ValueError, match="len\\(tokens\\)"):
        plot_flow(["a"], ids, None, 8)
    with pytest.raises(ValueError, match="divide"):
        plot_flow(["a", "b", "c"], ids, None, 8, world_size=3)
    import matplotlib.pyplot as plt
    plt.close(fig)


def test_record_routing_and_quality_on_a_tiny_model():
    model = moefy(tiny(), 4)
    text = torch.randint(0, 61, (80,), generator=torch.Generator().manual_seed(2)).tolist()
    fit_routers(model, text, window=40)
    dense = perplexity_vs_k(model, text, ks=(4,), window=40)[4]
    full = math.exp(float(windowed_nll(tiny(), text, window=40).double().mean()))
    assert abs(dense - full) < 1e-4 * full, "k = E is the dense model"
    set_top_k(model, 2)
    routes = record_routing(model, text, window=40)
    assert [r.shape for r in routes] == [(80, 2), (80, 2)] and all(r.max() < 4 for r in routes)
    table = perplexity_vs_capacity(model, text, k=2, factors=(None, 0.5), window=40)
    assert table[None][1] == 0.0 and 0.4 < table[0.5][1] <= 0.75, f"half the room drops at least half: {table}"
    assert [m.top_k for m in moe_layers(model)] == [2, 2] and all(m.capacity_factor is None for m in moe_layers(model)), \
        "knobs restored"


# --- the real model (slow) ------------------------------------------------------------------------

@pytest.fixture(scope="module")
def real():
    import course
    from course.moe import load_moe
    model, tok = course.load_model(), course.load_tokenizer()
    return model, load_moe(course.load_model()), tok


@pytest.mark.slow
def test_shipped_split_keeps_the_real_model_and_its_routers_beat_chance(real):
    from course.moe import calibration_ids, mlp_inputs
    from course.moe.router import CALIBRATION
    from course.assets import asset
    from course.quant import heldout_ids
    from safetensors import safe_open
    dense, moe, tok = real
    with safe_open(str(asset("moe_experts.safetensors")), framework="pt") as f:
        meta = f.metadata()
    assert meta["calibration_sha256"] == hashlib.sha256(CALIBRATION.read_bytes()).hexdigest(), \
        "the shipped routers were fit on another calibration text: rerun assets/moe/fit_moe.py"
    ids = torch.tensor(heldout_ids(tok)[:64])[None]
    pos = torch.arange(64)[None]
    with torch.no_grad():
        assert_orders_close(moe(ids, pos), dense(ids, pos), **for_decoder(dense.cfg), what="real model, all 8 experts")
    # the routers, on held-out text they never saw, find the experts with the most activation
    xs = mlp_inputs(dense, heldout_ids(tok)[:256])
    recall = sum(topk_recall(m.router(x), expert_mass(x, m.w_gate, m.w_up), 2) for m, x in zip(moe_layers(moe), xs)) / 30
    assert recall > 0.6, f"top-2 recall {recall:.2f} (random routing: 0.25)"
    assert len(calibration_ids(tok)) > 3000


@pytest.mark.slow
def test_real_perplexity_falls_with_k_and_fitted_routers_beat_random_ones(real):
    from course.quant import heldout_ids
    dense, moe, tok = real
    ids = heldout_ids(tok)[:256]
    table = perplexity_vs_k(moe, ids, ks=(2, 4, 8), dense_layers=(0,))
    want = math.exp(float(windowed_nll(dense, ids).double().mean()))
    assert abs(table[8] - want) < 1e-3 * want, "k = 8 of 8 is the dense model"
    assert table[2] > table[4] > table[8], table
    saved = [m.router for m in moe_layers(moe)]
    try:
        g = torch.Generator().manual_seed(0)
        for m in moe_layers(moe):
            m.router = nn.Linear(576, 8)
            nn.init.normal_(m.router.weight, generator=g)
        random = perplexity_vs_k(moe, ids, ks=(4,), dense_layers=(0,))[4]
    finally:
        for m, r in zip(moe_layers(moe), saved):
            m.router = r
    assert random > 1.5 * table[4], f"fitted routers {table[4]:.0f} vs random {random:.0f}"
