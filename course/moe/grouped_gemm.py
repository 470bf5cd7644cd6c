"""Grouped GEMM: every expert's tokens in one Triton launch (the idea behind vLLM's fused_moe kernel).

A loop over experts launches E small GEMMs, most of them too small to fill a GPU, and waits on the
host for each expert's row count. Instead, `align_block_size` (dispatch.py) lays the pairs out so
that every BLOCK_M rows belong to one expert, and one launch runs a program per (row block, column
block). Each program:

    1. reads its BLOCK_M entries of sorted_ids (pair ids; the sentinel P marks padding) and its expert e
    2. gathers those rows of A (row of pair p: p // A_DIV; A_DIV = k for the tokens x, 1 for a per-pair buffer)
    3. multiplies them by expert e's weight, BLOCK_K columns at a time (tl.dot, float32 accumulator)
    4. scatters the rows to C[p], times the routing weight of p if asked

Nothing about the routing is read on the host: the grid covers the worst-case number of blocks and
programs past n_padded return at once. The SwiGLU expert MLP is two launches:

    h[p] = silu(x[p // k] @ w_gate[e]^T) * (x[p // k] @ w_up[e]^T)     swiglu_grouped_kernel: (P, N)
    y[p] = weight[p] * h[p] @ w_down[e]^T                              grouped_gemm_kernel:   (P, C)
    out[t] = sum_j y[t * k + j]                                        a sum over k, in PyTorch

    out = fused_moe(x, w_gate, w_up, w_down, topk_ids, topk_weights)   # (T, C), = dispatch.moe_reference

On a CPU the kernels run in the Triton interpreter (TRITON_INTERPRET=1), slowly: use small shapes.
Its tl.dot on bf16 tiles is wrong, so there the tiles become float32 first (DOT_F32, as in lab 06).
`tl.dot` needs tiles of at least 16 in every dimension to compile for a GPU. On a GPU, float32
inputs go through tensor cores as TF32 (10-bit mantissa): compare them at TF32's tolerance, or use
bf16/fp16 weights as an engine does.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from course.moe.dispatch import align_block_size, check_experts


@triton.jit
def grouped_gemm_kernel(a_ptr, b_ptr, c_ptr, weights_ptr, sorted_ids_ptr, expert_ids_ptr, n_padded_ptr,
                        n_pairs, N, K, stride_am, stride_be, stride_bn, stride_cm,
                        A_DIV: tl.constexpr, MUL_WEIGHT: tl.constexpr, DOT_F32: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """C[p, n] = (weight[p] *) sum_k A[p // A_DIV, k] * B[e, n, k] for the pairs p of one row block.
    A: (rows, K) row-major; B: (E, N, K), an expert's weight as nn.Linear stores it; C: (P, N)."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    if pid_m * BLOCK_M >= tl.load(n_padded_ptr):
        return                                                       # a block past the padded total
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pairs = tl.load(sorted_ids_ptr + rows).to(tl.int64)              # (BLOCK_M,): pair ids or the sentinel
    real = pairs < n_pairs                                           # padding rows load zeros, store nothing
    e = tl.load(expert_ids_ptr + pid_m).to(tl.int64)                 # the one expert of this block
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)                   # (BLOCK_N,)
    a_rows = a_ptr + (pairs // A_DIV)[:, None] * stride_am           # gather: each row from its own token
    b_cols = b_ptr + e * stride_be + cols[None, :] * stride_bn       # B[e]^T, a (K, BLOCK_N) view
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        a = tl.load(a_rows + ks[None, :], mask=real[:, None] & (ks[None, :] < K), other=0.0)    # (BLOCK_M, BLOCK_K)
        b = tl.load(b_cols + ks[:, None], mask=(ks[:, None] < K) & (cols[None, :] < N), other=0.0)  # (BLOCK_K, BLOCK_N)
        if DOT_F32:                                                  # the interpreter: its bf16 tl.dot is wrong
            a, b = a.to(tl.float32), b.to(tl.float32)
        acc = tl.dot(a, b, acc)
    if MUL_WEIGHT:
        acc = acc * tl.load(weights_ptr + pairs, mask=real, other=0.0).to(tl.float32)[:, None]
    c = c_ptr + pairs[:, None] * stride_cm + cols[None, :]           # scatter: row p of C
    tl.store(c, acc.to(c_ptr.dtype.element_ty), mask=real[:, None] & (cols[None, :] < N))


@triton.jit
def swiglu_grouped_kernel(x_ptr, wg_ptr, wu_ptr, h_ptr, sorted_ids_ptr, expert_ids_ptr, n_padded_ptr,
                          n_pairs, N, K, stride_xm, stride_we, stride_wn, stride_hm,
                          TOP_K: tl.constexpr, DOT_F32: tl.constexpr,
                          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """h[p] = silu(x[p // TOP_K] @ w_gate[e]^T) * (x[p // TOP_K] @ w_up[e]^T), columns of one block:
    the gate and up products share the gathered rows of x, and h never exists before the SwiGLU."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    if pid_m * BLOCK_M >= tl.load(n_padded_ptr):
        return
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pairs = tl.load(sorted_ids_ptr + rows).to(tl.int64)
    real = pairs < n_pairs
    e = tl.load(expert_ids_ptr + pid_m).to(tl.int64)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    x_rows = x_ptr + (pairs // TOP_K)[:, None] * stride_xm
    w_off = e * stride_we + cols[None, :] * stride_wn                # same layout for gate and up: (E, N, K)
    gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        a = tl.load(x_rows + ks[None, :], mask=real[:, None] & (ks[None, :] < K), other=0.0)
        w_mask = (ks[:, None] < K) & (cols[None, :] < N)
        wg = tl.load(wg_ptr + w_off + ks[:, None], mask=w_mask, other=0.0)                      # (BLOCK_K, BLOCK_N)
        wu = tl.load(wu_ptr + w_off + ks[:, None], mask=w_mask, other=0.0)
        if DOT_F32:
            a, wg, wu = a.to(tl.float32), wg.to(tl.float32), wu.to(tl.float32)
        gate = tl.dot(a, wg, gate)
        up = tl.dot(a, wu, up)
    h = gate * tl.sigmoid(gate) * up                                 # silu(gate) * up, in float32
    tl.store(h_ptr + pairs[:, None] * stride_hm + cols[None, :], h.to(h_ptr.dtype.element_ty),
             mask=real[:, None] & (cols[None, :] < N))


def _interpreted(t: torch.Tensor) -> bool:
    """CPU tensors run in the interpreter, whose tl.dot on bf16 tiles returns garbage (fp16 is right):
    there the kernels convert tiles to float32 first (DOT_F32, as lab 06's kernels do)."""
    return t.device.type == "cpu"


def _tile(block: int, name: str) -> None:
    if type(block) is not int or block < 16 or block & (block - 1):
        raise ValueError(f"{name} must be a power of two >= 16 (tl.dot's smallest tile), got {block!r}")


def grouped_gemm(a: torch.Tensor, w: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor | None = None,
                 a_per_pair: bool = False, block_m: int = 16, block_n: int = 32, block_k: int = 32) -> torch.Tensor:
    """One launch of grouped_gemm_kernel: out[p] = (weight[p] *) a[row of p] @ w[expert of p]^T.

    a: (T, K) token rows (a_per_pair False: pair p reads row p // k) or (P, K) one row per pair;
    w: (E, N, K); topk_ids: (T, k). Returns (P, N) in a's dtype, row p = pair p = t * k + j."""
    for b, name in ((block_m, "block_m"), (block_n, "block_n"), (block_k, "block_k")):
        _tile(b, name)
    T, k = topk_ids.shape
    E, N, K = w.shape
    if a.dim() != 2 or a.shape != ((T * k) if a_per_pair else T, K):
        raise ValueError(f"a must be ({T * k if a_per_pair else T}, {K}), got {tuple(a.shape)}")
    if topk_weights is not None and topk_weights.shape != topk_ids.shape:
        raise ValueError(f"topk_weights must be {tuple(topk_ids.shape)}, got {tuple(topk_weights.shape)}")
    a, w = a.contiguous(), w.contiguous()
    al = align_block_size(topk_ids, E, block_m)
    out = torch.empty(T * k, N, dtype=a.dtype, device=a.device)
    weights = (topk_weights if topk_weights is not None else torch.ones(T, k, device=a.device)).float().contiguous()
    grid = (al.expert_ids.numel(), triton.cdiv(N, block_n))
    grouped_gemm_kernel[grid](a, w, out, weights, al.sorted_ids, al.expert_ids, al.n_padded, T * k, N, K,
                              a.stride(0), w.stride(0), w.stride(1), out.stride(0),
                              A_DIV=1 if a_per_pair else k, MUL_WEIGHT=topk_weights is not None,
                              DOT_F32=_interpreted(a), BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k)
    return out


def fused_moe(x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor,
              topk_ids: torch.Tensor, topk_weights: torch.Tensor,
              block_m: int = 16, block_n: int = 32, block_k: int = 32) -> torch.Tensor:
    """The MoE layer in two grouped launches (see the module's docstring). x (T, C); w_gate, w_up
    (E, N, C); w_down (E, C, N); topk_ids, topk_weights (T, k). Returns (T, C) in x's dtype."""
    check_experts(x, w_gate, w_up, w_down, topk_ids, topk_weights)
    for b, name in ((block_m, "block_m"), (block_n, "block_n"), (block_k, "block_k")):
        _tile(b, name)
    T, C = x.shape
    E, N, _ = w_gate.shape
    k = topk_ids.shape[1]
    x, w_gate, w_up = x.contiguous(), w_gate.contiguous(), w_up.contiguous()
    al = align_block_size(topk_ids, E, block_m)                      # one alignment serves both launches
    h = torch.empty(T * k, N, dtype=x.dtype, device=x.device)        # (P, N): one row per pair
    swiglu_grouped_kernel[(al.expert_ids.numel(), triton.cdiv(N, block_n))](
        x, w_gate, w_up, h, al.sorted_ids, al.expert_ids, al.n_padded, T * k, N, C,
        x.stride(0), w_gate.stride(0), w_gate.stride(1), h.stride(0),
        TOP_K=k, DOT_F32=_interpreted(x), BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k)
    w_down = w_down.contiguous()
    y = torch.empty(T * k, C, dtype=x.dtype, device=x.device)        # (P, C)
    grouped_gemm_kernel[(al.expert_ids.numel(), triton.cdiv(C, block_n))](
        h, w_down, y, topk_weights.float().contiguous(), al.sorted_ids, al.expert_ids, al.n_padded, T * k, C, N,
        h.stride(0), w_down.stride(0), w_down.stride(1), y.stride(0),
        A_DIV=1, MUL_WEIGHT=True, DOT_F32=_interpreted(x), BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k)
    return y.view(T, k, C).float().sum(1).to(x.dtype)                # (T, C): each token's k results


# ---------------------------------------------------------------------------------------------
# Compiling for a GPU without one, and timing on a GPU.
# ---------------------------------------------------------------------------------------------
def compile_jobs(dtype: str = "bf16", archs: tuple[int, ...] = (80, 90), block_m: int = 64, block_n: int = 64,
                 block_k: int = 64) -> list[tuple]:
    """Jobs for course.kernels.compile_report: both kernels for each arch (80 = A100, 90 = H100)."""
    p = f"*{dtype}"
    common = {"sorted_ids_ptr": "*i32", "expert_ids_ptr": "*i32", "n_padded_ptr": "*i32", "n_pairs": "i32",
              "N": "i32", "K": "i32"}
    gemm = {"a_ptr": p, "b_ptr": p, "c_ptr": p, "weights_ptr": "*fp32", **common, "stride_am": "i32",
            "stride_be": "i32", "stride_bn": "i32", "stride_cm": "i32", "A_DIV": "constexpr", "MUL_WEIGHT": "constexpr", "DOT_F32": "constexpr",
            "BLOCK_M": "constexpr", "BLOCK_N": "constexpr", "BLOCK_K": "constexpr"}
    swiglu = {"x_ptr": p, "wg_ptr": p, "wu_ptr": p, "h_ptr": p, **common, "stride_xm": "i32", "stride_we": "i32",
              "stride_wn": "i32", "stride_hm": "i32", "TOP_K": "constexpr", "DOT_F32": "constexpr", "BLOCK_M": "constexpr",
              "BLOCK_N": "constexpr", "BLOCK_K": "constexpr"}
    tiles = dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k)
    jobs = []
    for arch in archs:
        jobs.append(("grouped_gemm_kernel", gemm, dict(A_DIV=1, MUL_WEIGHT=True, DOT_F32=False, **tiles), arch))
        jobs.append(("swiglu_grouped_kernel", swiglu, dict(TOP_K=2, DOT_F32=False, **tiles), arch))
    return jobs


def moe_loop(x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor,
             topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
    """The baseline a grouped GEMM replaces: dispatch.moe_sorted, one PyTorch GEMM chain per expert."""
    from course.moe.dispatch import moe_sorted
    return moe_sorted(x, w_gate, w_up, w_down, topk_ids, topk_weights)


def make_benchmark(E: int = 8, N: int = 192, C: int = 576, k: int = 2, dtype: torch.dtype = torch.bfloat16,
                   tokens=(16, 64, 256, 1024, 4096), block_m: int = 64, block_n: int = 64, block_k: int = 64):
    """A triton.testing.perf_report benchmark (for a GPU): ms per MoE layer against the number of
    tokens, for the fused kernels, the per-expert loop, and the dense MLP of the same total width
    (E * N neurons, every token through all of them). Run it with course.kernels.run_perf_report(bench)."""
    import triton.testing as tt

    @tt.perf_report([tt.Benchmark(x_names=["T"], x_vals=list(tokens), x_log=True, line_arg="provider",
                                  line_vals=["fused", "loop", "dense"], line_names=["fused (Triton)", "loop over experts", "dense MLP"],
                                  ylabel="ms", plot_name=f"MoE layer: E={E}, k={k}, N={N}, C={C}, {str(dtype)[6:]}", args={})])
    def bench(T, provider):
        g = torch.Generator(device="cuda").manual_seed(0)
        x = torch.randn(T, C, device="cuda", generator=g).to(dtype)
        wg, wu = (torch.randn(E, N, C, device="cuda", generator=g).to(dtype) * C ** -0.5 for _ in range(2))
        wd = torch.randn(E, C, N, device="cuda", generator=g).to(dtype) * N ** -0.5
        logits = torch.randn(T, E, device="cuda", generator=g)
        from course.moe.router import topk_route
        ids, w = topk_route(logits, k)
        if provider == "fused":
            fn = lambda: fused_moe(x, wg, wu, wd, ids, w, block_m, block_n, block_k)   # noqa: E731
        elif provider == "loop":
            fn = lambda: moe_loop(x, wg, wu, wd, ids, w)                                # noqa: E731
        else:
            dg, du, dd = wg.reshape(E * N, C), wu.reshape(E * N, C), wd.permute(1, 0, 2).reshape(C, E * N)
            fn = lambda: (torch.nn.functional.silu(x @ dg.T) * (x @ du.T)) @ dd.T        # noqa: E731
        ms, lo, hi = tt.do_bench(fn, quantiles=[0.5, 0.2, 0.8])
        return ms, lo, hi

    return bench
