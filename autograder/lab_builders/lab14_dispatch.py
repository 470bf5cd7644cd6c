"""Lab 14, sections 4-5: the dispatch (problem 3) and the grouped-GEMM Triton kernel (problem 4), with
its compile check and the GPU benchmark. Assembled by lab14.py."""
from autograder.authoring import code, locked, md, solution, tests

# Hidden references: the MoE layer as a dense einsum over every expert with a 0/weight mask (no
# sorting, no grouping), and routings with idle experts and skew, made from a seeded generator.
REF_MOE = r'''
def _ref_moe(x, wg, wu, wd, ids, w):
    # every token through every expert, in float64, then a (T, E) mask of routing weights
    x64 = x.double().cpu()
    h = F.silu(torch.einsum("tc,enc->ten", x64, wg.double().cpu())) * torch.einsum("tc,enc->ten", x64, wu.double().cpu())
    y = torch.einsum("ten,ecn->tec", h, wd.double().cpu())                       # (T, E, C)
    mask = torch.zeros(x.shape[0], wg.shape[0], dtype=torch.float64)   # cpu: the reference
    for t in range(ids.shape[0]):
        for j in range(ids.shape[1]):
            mask[t, int(ids[t, j])] += float(w[t, j])
    return torch.einsum("tec,te->tc", y, mask)
def _routing(T, Ex, k, seed, skew=False):
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(Ex, generator=g)[:k] for _ in range(T)]) if T else torch.zeros(0, k, dtype=torch.long)   # cpu: moved below
    if skew:                                   # everyone's first choice is expert 0: one long group, idle experts
        ids[:, 0] = 0
        if k > 1:
            ids[:, 1:] = torch.where(ids[:, 1:] == 0, 1, ids[:, 1:])
    w = torch.rand(T, k, generator=g)   # cpu: moved below
    return ids.to(env.device), (w / w.sum(-1, keepdim=True)).to(env.device)
'''.strip("\n")

CELLS = [
md(r"""
## 4. Dispatch: regroup the tokens by expert

After routing, token t goes to experts `ids[t, 0..k-1]`. Call each (token, slot) a **pair**:
pair p = t·k + j, so a batch of T tokens makes P = T·k pairs. Running the experts one pair at a time
would be hopeless; an engine **sorts the pairs by expert**, so each expert sees one contiguous group
of rows, one matrix product:

    ids (T, k) --flatten--> (P,) --stable sort--> order (P,): pair ids, expert 0's first
    counts (E,): pairs per expert      offsets (E + 1,): expert e's pairs are order[offsets[e]:offsets[e + 1]]
    rows:      xs = x[order // k]                   (P, C): the token of each sorted pair
    experts:   ys[offsets[e]:offsets[e + 1]] = expert_e(xs[offsets[e]:offsets[e + 1]])
    combine:   out[t] = sum_j weights[t, j] · (the row of ys that holds pair t·k + j)

A GPU kernel works in tiles of BLOCK_M rows, and one tile must belong to one expert (it multiplies
by one expert's weight). So each group is **padded** to a multiple of BLOCK_M with a sentinel pair id
P that means "no row here" (vLLM's `moe_align_block_size`):

```
block_m = 4, counts = [3, 0, 6, 1]      pairs of expert 0 | expert 2          | expert 3
sorted_ids  = [ a a a P | c c c c | c c P P | d P P P | P P P P ...]     P = the sentinel
expert_ids  = [    0    |    2    |    2    |    3    |   -1    ...]     one per block; -1: unused
n_padded    = 16                                                         rows in use
```

The arrays have a **fixed length**, the worst case `max_padded(P, E, block_m)` = P + E·(block_m - 1)
rounded up to a block, whatever the routing. Why? On a GPU, a length that depends on the routing
would have to be read back to the host before launching the kernel (a synchronization), and a CUDA
graph could not capture the step. The kernel's grid covers every block, and blocks past `n_padded`
exit at once.

## Problem 3: Sort, align, combine (4 points)

**Deliverable:**
- `sort_pairs(topk_ids, n_experts)` returns `(order, counts, offsets)`: `order` (P,) `long`, the pair
  ids grouped by expert, in pair order inside a group (a *stable* sort); `counts` (E,) `long`;
  `offsets` (E + 1,) `long`, starting at 0. Raise `ValueError` if an id is outside 0..E-1.
- `align_blocks(topk_ids, n_experts, block_m)` returns `(sorted_ids, expert_ids, n_padded)`:
  `sorted_ids` (max_padded,) `int32`, each expert's pairs padded with the sentinel P to a multiple of
  `block_m` (an expert with no pairs gets no block), the sentinel everywhere after; `expert_ids`
  (max_padded // block_m,) `int32`, the expert of each block, -1 after the last used block;
  `n_padded` an `int`. (`max_padded` is given: `course.moe.max_padded(P, E, block_m)`.)
- `combine(ys, order, topk_weights)` returns (T, C) `float32`: row i of `ys` (P, C) is the output of
  sorted pair `order[i]`; each token gets the weighted sum of its k rows.

A loop over the E experts on the host is fine here (E is small); `course.moe.align_block_size` shows
how to do it without one.
"""),
solution("dispatch", r'''
def sort_pairs(topk_ids: torch.Tensor, n_experts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Pairs p = t * k + j grouped by expert: order (P,), counts (E,), offsets (E + 1,), all long."""
    ### BEGIN SOLUTION
    flat = topk_ids.reshape(-1).long()                                      # (P,): the expert of each pair
    if flat.numel() and (int(flat.min()) < 0 or int(flat.max()) >= n_experts):
        raise ValueError(f"topk_ids must be expert ids in 0..{n_experts - 1}, got {int(flat.min())}..{int(flat.max())}")
    order = torch.sort(flat, stable=True).indices                           # (P,): expert 0's pairs first, in pair order
    counts = torch.bincount(flat, minlength=n_experts)                       # (E,)
    offsets = torch.zeros(n_experts + 1, dtype=torch.long, device=flat.device)
    offsets[1:] = counts.cumsum(0)                                          # group e: offsets[e] .. offsets[e + 1]
    return order, counts, offsets
    ### END SOLUTION


def align_blocks(topk_ids: torch.Tensor, n_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """sorted_ids (max_padded,) int32 with each expert's group padded to block_m by the sentinel P;
    expert_ids (max_padded // block_m,) int32, -1 past the used blocks; n_padded."""
    ### BEGIN SOLUTION
    order, counts, offsets = sort_pairs(topk_ids, n_experts)
    P, dev = topk_ids.numel(), topk_ids.device
    length = max_padded(P, n_experts, block_m)
    sorted_ids = torch.full((length,), P, dtype=torch.int32, device=dev)   # the sentinel everywhere ...
    expert_ids = torch.full((length // block_m,), -1, dtype=torch.int32, device=dev)
    pos = 0
    for e, n in enumerate(counts.tolist()):
        if n == 0:
            continue                                                        # an idle expert gets no block
        sorted_ids[pos:pos + n] = order[offsets[e]:offsets[e + 1]].to(torch.int32)   # ... but the real pairs
        blocks = -(-n // block_m)                                           # padded up to whole blocks
        expert_ids[pos // block_m:pos // block_m + blocks] = e
        pos += blocks * block_m
    return sorted_ids, expert_ids, pos
    ### END SOLUTION


def combine(ys: torch.Tensor, order: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
    """Un-permute and weight: out[t] = sum_j topk_weights[t, j] * (row of ys holding pair t * k + j)."""
    ### BEGIN SOLUTION
    T, k = topk_weights.shape
    w = topk_weights.reshape(-1)[order].float()                             # (P,): the weight of each sorted pair
    out = torch.zeros(T, ys.shape[1], dtype=torch.float32, device=ys.device)
    out.index_add_(0, order // k, ys.float() * w[:, None])                  # each row back to its token, weighted
    return out
    ### END SOLUTION
'''),
tests("dispatch_tests", 4, r"""
ids_v = torch.tensor([[2, 0], [0, 3], [2, 0]], device=env.device)        # pairs 0..5 choose experts 2 0 0 3 2 0
out = expect_tuple(sort_pairs(ids_v, 4), "sort_pairs(ids, 4)", 3)
order = expect_tensor(out[0], "order", shape=(6,), dtype=torch.long, device=env.device)
counts = expect_tensor(out[1], "counts", shape=(4,), dtype=torch.long, device=env.device)
offsets = expect_tensor(out[2], "offsets", shape=(5,), dtype=torch.long, device=env.device)
assert counts.tolist() == [3, 0, 2, 1], f"pairs per expert: [3, 0, 2, 1], got {counts.tolist()}"
assert offsets.tolist() == [0, 3, 3, 5, 6], \
    f"offsets[e] is where expert e's group starts: offsets[0] must be 0 and offsets[e + 1] = offsets[e] + counts[e]: want [0, 3, 3, 5, 6], got {offsets.tolist()}"
assert order.tolist() == [1, 2, 5, 0, 4, 3], f"pairs by expert, in pair order inside a group (a stable sort): [1, 2, 5, 0, 4, 3], got {order.tolist()}"
out = expect_tuple(align_blocks(ids_v, 4, 2), "align_blocks(ids, 4, block_m=2)", 3)
sid = expect_tensor(out[0], "sorted_ids", shape=(max_padded(6, 4, 2),), dtype=torch.int32, device=env.device)
eid = expect_tensor(out[1], "expert_ids", shape=(max_padded(6, 4, 2) // 2,), dtype=torch.int32, device=env.device)
n_pad = expect_int(out[2], "n_padded")
assert sid.tolist()[:8] == [1, 2, 5, 6, 0, 4, 3, 6], \
    f"each group padded to a multiple of block_m=2 with the sentinel P=6: [1, 2, 5, 6 | 0, 4 | 3, 6], got {sid.tolist()[:8]}"
assert n_pad == 8 and eid.tolist() == [0, 0, 2, 3, -1], f"expert_ids: one per block, -1 past the used ones: [0, 0, 2, 3, -1]; n_padded 8"
assert sid.tolist()[8:] == [6, 6], "past n_padded, sorted_ids holds the sentinel"
ys_v = torch.arange(6, dtype=torch.float32, device=env.device)[:, None].repeat(1, 2)   # row i holds i
w_v = torch.tensor([[0.5, 0.5], [0.25, 0.75], [1.0, 2.0]], device=env.device)
got = expect_tensor(combine(ys_v, order, w_v), "combine(ys, order, weights)", shape=(3, 2), dtype=torch.float32, device=env.device)
# token 0: pair 0 (sorted row 3) and pair 1 (row 0); token 1: pairs 2 (row 1) and 3 (row 5); token 2: pairs 4 (row 4), 5 (row 2)
assert got[:, 0].tolist() == [0.5 * 3 + 0.5 * 0, 0.25 * 1 + 0.75 * 5, 1.0 * 4 + 2.0 * 2], \
    "row i of ys belongs to pair order[i], which is token order[i] // k: un-permute, then weight each pair by its routing weight"
### BEGIN HIDDEN TESTS
""" + REF_MOE + r"""
def _ref_sort(ids, Ex):
    flat = ids.reshape(-1).tolist()
    order = [p for e in range(Ex) for p in range(len(flat)) if flat[p] == e]
    counts = [flat.count(e) for e in range(Ex)]
    return order, counts, [sum(counts[:e]) for e in range(Ex + 1)]
def _ref_align(ids, Ex, bm):
    order, counts, _ = _ref_sort(ids, Ex)
    P = len(order)
    sid, eid, pos = [], [], 0
    for e in range(Ex):
        grp = [p for p in order if ids.reshape(-1).tolist()[p] == e]
        if not grp:
            continue
        n_blk = -(-len(grp) // bm)
        sid += grp + [P] * (n_blk * bm - len(grp))
        eid += [e] * n_blk
    return sid, eid
cases_ = [(7, 8, 2, 4, False), (1, 4, 1, 16, False), (12, 4, 2, 3, True), (8, 2, 2, 4, False), (5, 6, 3, 1, False),
          (16, 4, 1, 4, True), (0, 4, 2, 4, False), (9, 3, 3, 2, False)]
for n, (T, Ex, k, bm, skew) in enumerate(cases_):
    ids_h, w_h = _routing(T, Ex, k, seed=n, skew=skew)
    o, c, off = expect_tuple(sort_pairs(ids_h, Ex), "sort_pairs", 3)
    want_o, want_c, want_off = _ref_sort(ids_h, Ex)
    assert expect_tensor(c, "counts", shape=(Ex,), dtype=torch.long, device=env.device).tolist() == want_c, f"T={T} E={Ex}: counts"
    assert expect_tensor(off, "offsets", shape=(Ex + 1,), dtype=torch.long, device=env.device).tolist() == want_off, \
        f"T={T} E={Ex}: offsets[0] must be 0 and offsets[e + 1] = offsets[e] + counts[e]"
    assert expect_tensor(o, "order", shape=(T * k,), dtype=torch.long, device=env.device).tolist() == want_o, \
        f"T={T} E={Ex}: order must group pairs by expert, in pair order inside a group (stable)"
    s, eids, npad = expect_tuple(align_blocks(ids_h, Ex, bm), "align_blocks", 3)
    L = max_padded(T * k, Ex, bm)
    s = expect_tensor(s, "sorted_ids", shape=(L,), dtype=torch.int32, device=env.device).tolist()
    eids = expect_tensor(eids, "expert_ids", shape=(L // bm,), dtype=torch.int32, device=env.device).tolist()
    want_s, want_e = _ref_align(ids_h, Ex, bm)
    assert expect_int(npad, "n_padded") == len(want_s), f"T={T} E={Ex} block_m={bm}: n_padded is the padded total, {len(want_s)}"
    assert s == want_s + [T * k] * (L - len(want_s)), \
        f"T={T} E={Ex} block_m={bm}: each expert's group padded with the sentinel P to a multiple of block_m, no block for an idle expert"
    assert eids == want_e + [-1] * (L // bm - len(want_e)), f"T={T} E={Ex} block_m={bm}: the expert of each block, then -1"
    if T:
        ys_h = torch.randn(T * k, 5, device=env.device)
        got = expect_tensor(combine(ys_h, o, w_h), "combine", shape=(T, 5), dtype=torch.float32, device=env.device)
        want = torch.zeros(T, 5, dtype=torch.float64)   # cpu: the reference
        for i, p in enumerate(want_o):
            want[p // k] += float(w_h.reshape(-1)[p]) * ys_h[i].double().cpu()
        assert torch.allclose(got.double().cpu(), want, atol=1e-5), f"T={T} k={k}: combine must un-permute and weight each pair"
try:
    sort_pairs(torch.tensor([[0, 4]], device=env.device), 4)
except ValueError:
    pass
else:
    raise AssertionError("an expert id outside 0..E-1 must raise ValueError")
### END HIDDEN TESTS
"""),
md(r"""
With your three functions, an MoE layer is a loop over experts on contiguous groups. Below it runs
one real layer of `moe` at top-2 and is compared with `course.moe`'s loop-over-experts reference
(for each expert: find its tokens, run it, add). Then the padding: how many rows does aligning to
`block_m` add for the real routing of a short text? An idle row costs a GPU as much as a real one.
"""),
code(r'''
def moe_dispatch(x, w_gate, w_up, w_down, topk_ids, topk_weights):
    """The MoE layer by dispatch: your sort, one expert GEMM chain per contiguous group, your combine."""
    k = topk_ids.shape[1]
    order, counts, offsets = sort_pairs(topk_ids, w_gate.shape[0])
    xs = x[order // k]                                                   # (P, C): rows grouped by expert
    ys = torch.empty_like(xs)
    bounds = offsets.tolist()
    for e in range(w_gate.shape[0]):
        lo, hi = bounds[e], bounds[e + 1]
        if hi > lo:
            ys[lo:hi] = swiglu(xs[lo:hi], w_gate[e], w_up[e], w_down[e])
    return combine(ys, order, topk_weights).to(x.dtype)


from course.moe import moe_reference

layer = moe_layers(moe)[LAYER]
xl = X[LAYER].to(env.dtype)
ids2, w2 = topk_route(layer.router(xl.float()), 2)
with torch.no_grad():
    mine = moe_dispatch(xl, layer.w_gate, layer.w_up, layer.w_down, ids2, w2)
    ref = moe_reference(xl, layer.w_gate, layer.w_up, layer.w_down, ids2, w2)
print(f"layer {LAYER}, {xl.shape[0]} tokens, top-2: max |dispatch - loop reference| = {(mine - ref).abs().max().item():.2e}")
_, counts2, _ = sort_pairs(ids2, E)
print(f"pairs per expert: {counts2.tolist()}")
for bm in (16, 64, 128):
    _, _, n_pad = align_blocks(ids2, E, bm)
    print(f"  block_m {bm:>3}: {n_pad:>4} rows for {ids2.numel()} pairs ({n_pad / ids2.numel() - 1:.0%} padding); "
          f"fixed length {max_padded(ids2.numel(), E, bm)}")
'''),
md(r"""
Small batches pay the most padding: at decode, a batch of 8 tokens with top-2 makes 16 pairs, and 8
experts with one or two pairs each become 8 blocks of 64 rows: 512 rows of work for 16. That is one
reason engines tune BLOCK_M by batch size (vLLM ships tuned configurations per GPU and per expert
shape) and why decode-time MoE kernels are memory-bound: what costs is reading the experts'
weights, not the arithmetic.

## 5. A grouped GEMM in Triton: every expert in one launch

The loop above launches E separate GEMM chains, each waiting on the host for its row count, each too
small to fill a GPU at decode. A **grouped GEMM** runs all experts in one launch. The grid has one
program per (row block, column block); the aligned layout tells each program everything:

    1. rows = its BLOCK_M entries of sorted_ids: pair ids, or the sentinel (padding)
    2. e = expert_ids[its row block]: the ONE expert of these rows
    3. gather: row of pair p is A[p // A_DIV]   (A_DIV = k when A holds tokens, 1 when it holds one row per pair)
    4. acc = A_rows @ B[e]^T, BLOCK_K columns at a time (tl.dot, float32 accumulator)
    5. times the routing weight of each pair; scatter row p to C[p]; padding rows store nothing

Blocks past `n_padded` return at once. The SwiGLU MoE layer is then three launches of the same
kernel (gate, up, then down on one row per pair, weighted) and a sum over each token's k rows.
vLLM's `fused_moe` kernel and SGLang's are this idea, with the SwiGLU fused and tuned tiles.

On a CPU the kernel runs in Triton's interpreter (NumPy). Its `tl.dot` on bf16 tiles is wrong, so
with `DOT_F32` the tiles are converted to float32 first (lab 06 did the same). On a GPU, float32
tiles go through the tensor cores as TF32 (a 10-bit mantissa), so the tests compare at that tolerance.

## Problem 4: The grouped-GEMM kernel (4 points)

**Deliverable:** the body of `grouped_gemm_kernel`: for the program's row block `pid_m = program_id(0)`
and column block `pid_n = program_id(1)`, compute `C[p, n] = weight[p] · sum_k A[p // A_DIV, k] ·
B[e, n, k]` for the real pairs p of the block (e = the block's expert), for columns n < N, and store
nothing for padding rows or columns past N. A: (rows, K) with row stride `stride_am`; B: (E, N, K),
strides `stride_be`, `stride_bn` (and 1); C: (P, N), row stride `stride_cm`; weights: (P,) float32.
The launcher `grouped_gemm` is given; your kernel must also compile for sm_80 and sm_90 (the tests
compile it, a few seconds, in a separate process).
"""),
solution("grouped_gemm_kernel", r'''
@triton.jit
def grouped_gemm_kernel(a_ptr, b_ptr, c_ptr, weights_ptr, sorted_ids_ptr, expert_ids_ptr, n_padded_ptr,
                        n_pairs, N, K, stride_am, stride_be, stride_bn, stride_cm,
                        A_DIV: tl.constexpr, DOT_F32: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """C[p, :] = weight[p] * A[p // A_DIV] @ B[e]^T for the pairs p of one row block of expert e.
    Steps: return if this row block starts at or past n_padded; load its BLOCK_M pair ids (the sentinel
    n_pairs marks padding) and its expert; gather the rows of A; accumulate tl.dot over K in float32
    (with DOT_F32, convert both tiles to float32 first); multiply by the pairs' weights; store the real
    rows and the columns < N of C."""
    ### BEGIN SOLUTION
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    if pid_m * BLOCK_M >= tl.load(n_padded_ptr):
        return                                                           # a block past the padded total
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pairs = tl.load(sorted_ids_ptr + rows).to(tl.int64)                  # (BLOCK_M,): pair ids, or the sentinel
    real = pairs < n_pairs                                               # padding rows: load zeros, store nothing
    e = tl.load(expert_ids_ptr + pid_m).to(tl.int64)                     # the one expert of this block
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)                       # (BLOCK_N,)
    a_rows = a_ptr + (pairs // A_DIV)[:, None] * stride_am               # gather each row from its token
    b_cols = b_ptr + e * stride_be + cols[None, :] * stride_bn           # B[e]^T as a (K, BLOCK_N) view
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        a = tl.load(a_rows + ks[None, :], mask=real[:, None] & (ks[None, :] < K), other=0.0)        # (BLOCK_M, BLOCK_K)
        b = tl.load(b_cols + ks[:, None], mask=(ks[:, None] < K) & (cols[None, :] < N), other=0.0)  # (BLOCK_K, BLOCK_N)
        if DOT_F32:                                                      # the interpreter: its bf16 tl.dot is wrong
            a, b = a.to(tl.float32), b.to(tl.float32)
        acc = tl.dot(a, b, acc)
    acc = acc * tl.load(weights_ptr + pairs, mask=real, other=0.0)[:, None]    # the routing weight of each pair
    c = c_ptr + pairs[:, None] * stride_cm + cols[None, :]               # scatter: row p of C
    tl.store(c, acc.to(c_ptr.dtype.element_ty), mask=real[:, None] & (cols[None, :] < N))
    ### END SOLUTION
'''),
locked("grouped_gemm_build", r'''
# Given: your kernel compiled for an A100 (sm_80) and an H100 (sm_90), bf16, in the background; the tests wait for it
from course.kernels import compile_error_summary, kernel_source, start_compile_report

GEMM_TYPES = {"a_ptr": "*bf16", "b_ptr": "*bf16", "c_ptr": "*bf16", "weights_ptr": "*fp32", "sorted_ids_ptr": "*i32",
              "expert_ids_ptr": "*i32", "n_padded_ptr": "*i32", "n_pairs": "i32", "N": "i32", "K": "i32", "stride_am": "i32",
              "stride_be": "i32", "stride_bn": "i32", "stride_cm": "i32", "A_DIV": "constexpr", "DOT_F32": "constexpr",
              "BLOCK_M": "constexpr", "BLOCK_N": "constexpr", "BLOCK_K": "constexpr"}
grouped_gemm_build = start_compile_report(
    kernel_source(grouped_gemm_kernel),
    [("grouped_gemm_kernel", GEMM_TYPES, dict(A_DIV=1, DOT_F32=False, BLOCK_M=64, BLOCK_N=64, BLOCK_K=64), arch,
      {"num_warps": 4, "num_stages": 3}) for arch in (80, 90)])
'''),
code(r'''
def grouped_gemm(a, w, topk_ids, topk_weights=None, a_per_pair=False, block_m=16, block_n=32, block_k=32):
    """One launch of your kernel: out[p] = weight[p] * a[row of p] @ w[expert of p]^T, (P, N) in a's dtype.
    a: (T, K) token rows (pair p reads row p // k), or (P, K) with a_per_pair; w: (E, N, K)."""
    T, k = topk_ids.shape
    E_, N, K = w.shape
    a, w = a.contiguous(), w.contiguous()
    al = align_block_size(topk_ids, E_, block_m)                     # the course's alignment (Problem 3's, on the device)
    out = torch.empty(T * k, N, dtype=a.dtype, device=a.device)
    weights = (torch.ones(T, k, device=a.device) if topk_weights is None else topk_weights).float().contiguous()
    grid = (al.expert_ids.numel(), triton.cdiv(N, block_n))
    grouped_gemm_kernel[grid](a, w, out, weights, al.sorted_ids, al.expert_ids, al.n_padded, T * k, N, K,
                              a.stride(0), w.stride(0), w.stride(1), out.stride(0),
                              A_DIV=1 if a_per_pair else k, DOT_F32=a.device.type == "cpu",
                              BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k)
    return out


def moe_grouped(x, w_gate, w_up, w_down, topk_ids, topk_weights, **tiles):
    """The SwiGLU MoE layer in three launches of your kernel: (T, C) in x's dtype."""
    T, k = topk_ids.shape
    h = F.silu(grouped_gemm(x, w_gate, topk_ids, **tiles)) * grouped_gemm(x, w_up, topk_ids, **tiles)   # (P, N)
    y = grouped_gemm(h, w_down, topk_ids, topk_weights, a_per_pair=True, **tiles)                        # (P, C), weighted
    return y.view(T, k, -1).float().sum(1).to(x.dtype)


# one real layer, a few tokens (the interpreter runs every program in NumPy: slow)
n_tok = env.pick(64, 6, cpu=8)
xk = X[LAYER][:n_tok].to(env.dtype)
ids_k, w_k = ids2[:n_tok], w2[:n_tok]
start = time.perf_counter()
with torch.no_grad():
    got = moe_grouped(xk, layer.w_gate, layer.w_up, layer.w_down, ids_k, w_k)
    want = moe_reference(xk, layer.w_gate, layer.w_up, layer.w_down, ids_k, w_k)
where = "Triton interpreter on the CPU" if env.triton_interpreted else f"compiled, {env.device}"
print(f"layer {LAYER}, {n_tok} tokens, top-2, {str(env.dtype)[6:]}: max |grouped GEMM - loop reference| = "
      f"{(got.float() - want.float()).abs().max().item():.2e} (outputs up to {want.abs().max().item():.2f}); "
      f"{time.perf_counter() - start:.1f} s ({where})")
'''),
tests("grouped_gemm_kernel_tests", 4, REF_MOE + r"""
_tol = (lambda want: 1e-2 * want.abs().max().item()) if env.gpu else (lambda want: 1e-4 * max(1.0, want.abs().max().item()))
g = torch.Generator().manual_seed(0)
a_v = torch.randn(5, 24, generator=g).to(env.device)                   # 5 tokens, K = 24: not a multiple of BLOCK_K
w_v = torch.randn(3, 20, 24, generator=g).to(env.device)               # 3 experts, N = 20: not a multiple of BLOCK_N
ids_v, rw_v = _routing(5, 3, 2, seed=1)
got = expect_tensor(grouped_gemm(a_v, w_v, ids_v, rw_v, block_n=16, block_k=16), "grouped_gemm(a, w, ids, weights)",
                    shape=(10, 20), dtype=torch.float32, device=env.device)
want = torch.stack([a_v[p // 2].double().cpu() @ w_v[int(ids_v.reshape(-1)[p])].double().cpu().T for p in range(10)])
unweighted = (got.double().cpu() - want).abs().max().item() < _tol(want)
want = want * rw_v.reshape(-1, 1).double().cpu()
assert not unweighted, "row p of C must be multiplied by its pair's routing weight (weights_ptr + pair), masked for padding rows"
assert (got.double().cpu() - want).abs().max().item() < _tol(want), \
    "row p of C is weight[p] * A[p // A_DIV] @ B[e]^T with e = expert_ids[row block]: gather the token's row, use the block's expert"
xm = torch.randn(6, 16, generator=g).to(env.device)
wg_, wu_ = torch.randn(4, 32, 16, generator=g).to(env.device) * 0.3, torch.randn(4, 32, 16, generator=g).to(env.device) * 0.3
wd_ = torch.randn(4, 16, 32, generator=g).to(env.device) * 0.3
ids_m, w_m = _routing(6, 4, 2, seed=2, skew=True)
got = expect_tensor(moe_grouped(xm, wg_, wu_, wd_, ids_m, w_m), "moe_grouped(...)", shape=(6, 16), device=env.device)
want = _ref_moe(xm, wg_, wu_, wd_, ids_m, w_m)
assert (got.double().cpu() - want).abs().max().item() < _tol(want), "the MoE layer from three launches of your kernel must match the loop reference"
report = grouped_gemm_build.result()
for arch, r in zip((80, 90), report):
    assert r["error"] is None, f"your kernel does not compile for sm_{arch}: {compile_error_summary(r['error'])}"
assert report[0]["mma"] > 0 and report[1]["wgmma"] > 0, "tl.dot must compile to tensor-core instructions (mma on sm_80, wgmma on sm_90)"
### BEGIN HIDDEN TESTS
for n, (T, Ex, k, K, N, bm, skew, dtype) in enumerate([(1, 4, 1, 16, 16, 16, False, torch.float32),
                                                     (16, 2, 2, 40, 24, 16, True, torch.float32),    # 16 rows of expert 0: exact blocks
                                                     (9, 8, 2, 32, 48, 32, False, torch.float32),    # idle experts
                                                     (7, 3, 3, 16, 32, 16, False, torch.bfloat16),
                                                     (5, 4, 2, 24, 16, 16, False, torch.float16)]):
    g = torch.Generator().manual_seed(10 + n)
    a_h = torch.randn(T, K, generator=g).to(device=env.device, dtype=dtype)
    w_h = torch.randn(Ex, N, K, generator=g).to(device=env.device, dtype=dtype) * 0.5
    ids_h, rw_h = _routing(T, Ex, k, seed=20 + n, skew=skew)
    for per_pair in (False, True):
        a_in = torch.randn(T * k, K, generator=g).to(device=env.device, dtype=dtype) if per_pair else a_h
        got = expect_tensor(grouped_gemm(a_in, w_h, ids_h, rw_h, a_per_pair=per_pair, block_m=bm, block_n=16, block_k=16),
                            "grouped_gemm", shape=(T * k, N), dtype=dtype, device=env.device, finite=True)
        rows = [a_in[p] if per_pair else a_in[p // k] for p in range(T * k)]
        want = torch.stack([float(rw_h.reshape(-1)[p]) * (rows[p].double().cpu() @ w_h[int(ids_h.reshape(-1)[p])].double().cpu().T)
                            for p in range(T * k)])
        tol = _tol(want) if dtype == torch.float32 else 4 * torch.finfo(dtype).eps * want.abs().max().item()
        err = (got.double().cpu() - want).abs().max().item()
        assert err < tol, f"T={T} E={Ex} k={k} K={K} N={N} block_m={bm} {dtype} per_pair={per_pair}: error {err:.2e}"
ids_h, rw_h = _routing(11, 4, 2, seed=3)
xh = torch.randn(11, 32, generator=g).to(env.device)
wgh, wuh = torch.randn(4, 16, 32, generator=g).to(env.device) * 0.3, torch.randn(4, 16, 32, generator=g).to(env.device) * 0.3
wdh = torch.randn(4, 32, 16, generator=g).to(env.device) * 0.3
want = _ref_moe(xh, wgh, wuh, wdh, ids_h, rw_h)
got = expect_tensor(moe_grouped(xh, wgh, wuh, wdh, ids_h, rw_h), "moe_grouped", shape=(11, 32), device=env.device)
assert (got.double().cpu() - want).abs().max().item() < _tol(want), "the MoE layer of your kernel against the dense einsum"
### END HIDDEN TESTS
"""),
md(r"""
Your kernel compiled for an A100 and an H100 (the tests did it). What does it cost against the loop
over experts and against the dense MLP? On a GPU the benchmark below times the three for the course
model's layer shape after MoEfication (E = 8 experts of N = 192, C = 576, top-2, bf16) against the
number of tokens, as a Triton `perf_report` (median of many runs after warm-up, `do_bench`). On a CPU
it is skipped: the interpreter measures NumPy, not the kernel.
"""),
code(r'''
def moe_loop(x, w_gate, w_up, w_down, topk_ids, topk_weights):
    return moe_dispatch(x, w_gate, w_up, w_down, topk_ids, topk_weights)


if not env.gpu:
    print("skipped on the CPU: the Triton interpreter runs the kernel in NumPy, its time says nothing about a GPU")
else:
    import triton.testing as tt
    from course.kernels import run_perf_report
    Eb, Nb, Cb, kb, dt = 8, cfg.d_ff // 8, cfg.d_model, 2, torch.bfloat16
    tiles = dict(block_m=64, block_n=64, block_k=64)

    @tt.perf_report([tt.Benchmark(x_names=["T"], x_vals=env.pick([16, 64, 256, 1024, 4096], [64, 1024]), x_log=True,
                                  line_arg="provider", line_vals=["grouped", "loop", "dense"],
                                  line_names=["grouped GEMM (yours)", "loop over experts", "dense MLP"], ylabel="ms",
                                  plot_name=f"MoE layer, E={Eb} k={kb} N={Nb} C={Cb}, bf16, {torch.cuda.get_device_name()}", args={})])
    def moe_bench(T, provider):
        gb = torch.Generator(device=env.device).manual_seed(0)
        x_b = torch.randn(T, Cb, device=env.device, generator=gb).to(dt)
        wg_b, wu_b = ((torch.randn(Eb, Nb, Cb, device=env.device, generator=gb) * Cb ** -0.5).to(dt) for _ in range(2))
        wd_b = (torch.randn(Eb, Cb, Nb, device=env.device, generator=gb) * Nb ** -0.5).to(dt)
        ids_b, w_b = topk_route(torch.randn(T, Eb, device=env.device, generator=gb), kb)
        if provider == "grouped":
            fn = lambda: moe_grouped(x_b, wg_b, wu_b, wd_b, ids_b, w_b, **tiles)                  # noqa: E731
        elif provider == "loop":
            fn = lambda: moe_loop(x_b, wg_b, wu_b, wd_b, ids_b, w_b)                              # noqa: E731
        else:
            dg, du = wg_b.reshape(Eb * Nb, Cb), wu_b.reshape(Eb * Nb, Cb)
            dd = wd_b.permute(1, 0, 2).reshape(Cb, Eb * Nb)
            fn = lambda: (F.silu(x_b @ dg.T) * (x_b @ du.T)) @ dd.T                                # noqa: E731
        return tt.do_bench(fn, quantiles=[0.5, 0.2, 0.8])

    run_perf_report(moe_bench)
'''),
md(r"""
What to look for on a GPU: at a handful of tokens the loop pays E launches and a host
synchronization for the counts, while your kernel pays one launch per projection; the dense MLP reads
all the weights, which the MoE also does once its tokens touch every expert (section 7). At thousands
of tokens the work is large enough that the dense MLP's 4x more FLOPs show, and the MoE's advantage
appears. Your kernel is a plain version: vLLM's fuses the gate and up projections (one gather of x
for both, as `course.moe.grouped_gemm.swiglu_grouped_kernel` does), tunes tiles per batch size, and
uses FP8 weights.
"""),
]
