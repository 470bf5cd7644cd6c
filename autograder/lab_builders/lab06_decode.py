"""Lab 06, Problems 2 and 3: paged decode attention, one block per iteration (v1), then several (v2)."""
from autograder.authoring import code, locked, md, solution, tests
from autograder.lab_builders.lab06_refs import FP16_BIG, HIDDEN_ATTENTION, HIDDEN_BIG

CELLS = [
md(r"""
## Problem 2: Paged decode attention, v1: one block per iteration (4 points)

One program per **(sequence, KV head)**: grid `(B, Hkv)`. The program handles all `GROUP = H // Hkv`
query heads that share its KV head (GQA), so it reads each key once for all of them: query heads
`kv_head * GROUP .. kv_head * GROUP + GROUP - 1`. Its query tile is `(GROUP_PAD, D)`, padded to a
power of two and masked (SmolLM2's group of 3 becomes 4 rows). The layout, all contiguous:
`q` and `out` are `(B, H, D)`, the caches `(n_blocks, BLOCK_SIZE, H_KV, D)`, `block_tables`
`(B, max_blocks)` int32, `context_lens` `(B,)` int32.

The program walks the sequence's blocks, `i = 0 .. cdiv(context_len, BLOCK_SIZE) - 1`, and keeps an
**online softmax** (as in FlashAttention) instead of storing all the scores: a running maximum `m`
per head, a running sum `l` of `exp(score - m)`, and a running weighted sum `acc` of values. For each block:

1. read its physical block id from the table; load its keys and values `(BLOCK_SIZE, D)` for this
   KV head, with a mask for the positions `>= context_len` (the last block may be partly full, and its
   other slots hold stale data from earlier owners: never read them);
2. scores `s = (q . k) * scale`, `(GROUP_PAD, BLOCK_SIZE)`; masked positions get `-inf`;
3. `m_new = max(m, rowmax(s))`; rescale the old sums by `alpha = exp(m - m_new)`:
   `l = l * alpha + rowsum(exp(s - m_new))`, `acc = acc * alpha + exp(s - m_new) @ v`; `m = m_new`.

At the end `out = acc / l`, stored for the real heads only. Compute in float32 whatever the input
dtype: convert each tile right after loading it (`.to(tl.float32)`; fp16 holds numbers up to 65,504,
and `q . k` before the scale can pass that), and store in the output's dtype (`out_ptr.dtype.element_ty`).
Without `tl.dot`, `q . k` for all heads and positions is `tl.sum(q[:, None, :] * k[None, :, :], axis=2)`.

**Deliverable:** the body of `paged_attention_v1_kernel`; `paged_attention_v1` (given) launches it.
"""),
locked("kernel_launch", r'''
def check_paged_args(q, k_cache, v_cache, block_tables, context_lens):
    """Fail with a clear message before a kernel reads memory it should not."""
    B, H, D = q.shape
    n_blocks, block_size, Hkv, Dk = k_cache.shape
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache), ("block_tables", block_tables), ("context_lens", context_lens)):
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous")
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device} and q on {q.device}: a kernel reads all of them on one device")
    if Dk != D or v_cache.shape != k_cache.shape or H % Hkv or q.dtype != k_cache.dtype:
        raise ValueError(f"q {tuple(q.shape)} {q.dtype} does not fit the caches {tuple(k_cache.shape)} {k_cache.dtype}")
    if block_tables.dtype != torch.int32 or context_lens.dtype != torch.int32 or block_tables.shape[0] != B or context_lens.shape != (B,):
        raise ValueError("block_tables must be (B, max_blocks) int32 and context_lens (B,) int32")
    for name, n in (("head_dim", D), ("block_size", block_size)):
        if n & (n - 1):
            raise ValueError(f"{name} must be a power of two for tl.arange, got {n}")
    # Reading the lengths back from a GPU would make the CPU wait for every queued kernel (a sync per
    # call, per layer): only the interpreter, where a bad length could crash the process, checks them.
    if not q.is_cuda and (int(context_lens.min()) < 1 or int(context_lens.max()) > block_tables.shape[1] * block_size):
        raise ValueError("every context_len must be >= 1 and fit in its block table")


def launch_paged(kernel, q, k_cache, v_cache, block_tables, context_lens, scale, **extra):
    """Grid (B, Hkv): one program per sequence and KV head."""
    check_paged_args(q, k_cache, v_cache, block_tables, context_lens)
    B, H, D = q.shape
    _, block_size, Hkv, _ = k_cache.shape
    out = torch.empty_like(q)
    kernel[(B, Hkv)](out, q, k_cache, v_cache, block_tables, context_lens, scale, block_tables.shape[1],
                     H=H, H_KV=Hkv, GROUP=H // Hkv, GROUP_PAD=triton.next_power_of_2(H // Hkv),
                     BLOCK_SIZE=block_size, D=D, **extra)
    return out
'''),
solution("paged_attention_v1", r'''
@triton.jit
def paged_attention_v1_kernel(out_ptr, q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, context_lens_ptr,
                              scale, max_blocks,
                              H: tl.constexpr, H_KV: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
                              BLOCK_SIZE: tl.constexpr, D: tl.constexpr):
    """Program (seq, kv_head): the GROUP query heads of kv_head attend to the sequence, one block at a time."""
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    ### BEGIN SOLUTION
    ctx = tl.load(context_lens_ptr + seq)
    g = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, D)
    t = tl.arange(0, BLOCK_SIZE)
    head = kv_head * GROUP + g                                        # (G,): this KV head's query heads
    head_ok = g < GROUP
    q = tl.load(q_ptr + seq * H * D + head[:, None] * D + d[None, :], mask=head_ok[:, None], other=0.0).to(tl.float32)
    m = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, D], tl.float32)
    for i in range(0, tl.cdiv(ctx, BLOCK_SIZE)):
        block = tl.load(block_tables_ptr + seq * max_blocks + i).to(tl.int64)
        pos = i * BLOCK_SIZE + t                                      # (BLOCK_SIZE,): token positions
        valid = pos < ctx
        offs = (block * BLOCK_SIZE + t[:, None]) * (H_KV * D) + kv_head * D + d[None, :]
        k = tl.load(k_cache_ptr + offs, mask=valid[:, None], other=0.0).to(tl.float32)   # (BLOCK_SIZE, D)
        v = tl.load(v_cache_ptr + offs, mask=valid[:, None], other=0.0).to(tl.float32)
        s = tl.sum(q[:, None, :] * k[None, :, :], axis=2) * scale    # (G, BLOCK_SIZE)
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        alpha = tl.exp(m - m_new)
        p = tl.exp(s - m_new[:, None])
        l = l * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
        m = m_new
    out = acc / l[:, None]
    tl.store(out_ptr + seq * H * D + head[:, None] * D + d[None, :], out.to(out_ptr.dtype.element_ty),
             mask=head_ok[:, None])
    ### END SOLUTION


def paged_attention_v1(q, k_cache, v_cache, block_tables, context_lens, scale):
    return launch_paged(paged_attention_v1_kernel, q, k_cache, v_cache, block_tables, context_lens, scale)
'''),
locked("paged_case", r'''
def paged_case(lens, H, Hkv, D, block_size, dtype=torch.float32, seed=0):
    """Random K/V for sequences of the given lengths, in shuffled blocks of a pool, on the lab's device.
    Unused slots hold NaN, like stale memory: a kernel that reads past a sequence's end gives NaN, not
    a silent error. The blocks come from the course's allocator (lab 05), shuffled."""
    g = torch.Generator().manual_seed(seed)
    alloc = BlockAllocator(n_blocks=sum(-(-L // block_size) for L in lens) + 2, block_size=block_size)
    alloc.free_blocks = deque(torch.randperm(alloc.n_blocks, generator=g).tolist())
    k_cache = torch.full((alloc.n_blocks, block_size, Hkv, D), float("nan"), dtype=dtype, device=dev)
    v_cache = k_cache.clone()
    for seq, L in enumerate(lens):
        k = torch.randn(L, Hkv, D, generator=g).to(dev, dtype)   # drawn on the CPU generator, then moved
        v = torch.randn(L, Hkv, D, generator=g).to(dev, dtype)
        write_kv(k_cache, v_cache, k, v, torch.tensor(alloc.append(seq, L), device=dev))
    tables = block_table_tensor([alloc.block_tables[s] for s in range(len(lens))], dev)
    q = torch.randn(len(lens), H, D, generator=g).to(dev, dtype)
    return q, k_cache, v_cache, tables, torch.tensor(lens, dtype=torch.int32, device=dev)


def decode_hint(out, ref, lens, per_iter, tol):
    """What a wrong decode output (B, H, D) most likely comes from, judged by where it is wrong: the tests'
    messages. per_iter: the tokens one loop iteration covers (v1: a block; v2: a tile)."""
    if out.isnan().any():
        return "NaN: a load past context_len is not masked (other=0.0), or a score there is not -inf"
    err = (out.cpu().double() - ref.cpu().double()).abs().amax(dim=(1, 2))          # (B,): per sequence
    short = torch.tensor([L <= per_iter for L in lens])                             # cpu: beside err
    if short.any() and err[short].max() < tol:
        return (f"right for the sequences of at most {per_iter} tokens (one iteration), wrong for the longer ones: the "
                "online softmax across iterations (when the maximum grows, rescale l and acc by alpha = exp(m - m_new))")
    return ("wrong already within one iteration: the scale, -inf for the positions >= context_len, or the query heads "
            "of this KV head (kv_head * GROUP + g)")
'''),
locked("paged_attention_v1_build", r'''
# Given: your kernel compiled for an A100 and an H100 (bf16) in the background; the tests wait for the compiler
paged_attention_v1_build = gpu_compile(paged_attention_v1_kernel, dict(H=9, H_KV=3, GROUP=3, GROUP_PAD=4, BLOCK_SIZE=16, D=32))
'''),
tests("paged_attention_v1_tests", 4, r"""
from course.expect import expect_tensor
for lens, H, Hkv, bs in (([5, 8, 1, 13], 9, 3, 4), ([4, 7], 4, 4, 4), ([16, 3], 4, 1, 8)):
    case = paged_case(lens, H=H, Hkv=Hkv, D=16, block_size=bs, seed=H)
    out = expect_tensor(paged_attention_v1(*case, 0.25), "paged_attention_v1(...)", dtype=torch.float32,
                        shape=(len(lens), H, 16), device=dev)
    ref = paged_attention(*case, 0.25)
    diff = (out - ref).abs().max().item()
    assert diff < 1e-4, f"lengths {lens}, H={H}, Hkv={Hkv}, block_size={bs}: max |diff| {diff:.1e} from the reference: " \
                        + decode_hint(out, ref, lens, bs, 1e-4)
v1_compiled = gpu_compiled(paged_attention_v1_build, "paged_attention_v1_kernel")   # waits for the compiler started above
### BEGIN HIDDEN TESTS
""" + HIDDEN_ATTENTION + "\n" + HIDDEN_BIG + r"""
for H, Hkv, bs, dtype, seed in ((4, 4, 4, torch.float32, 1), (8, 2, 8, torch.float16, 2), (4, 1, 16, torch.float32, 3),
                                (9, 3, 2, torch.float16, 4), (6, 3, 1, torch.float32, 5)):
    lens = [1, bs, 2 * bs + 1, 3 * bs]
    q, kcache, vcache, bt, cl, ks, vs = _paged_case(lens, H, Hkv, 16, bs, dtype, seed, pad_width=1)
    out = expect_tensor(paged_attention_v1(q, kcache, vcache, bt, cl, 0.25), f"paged_attention_v1 ({dtype})",
                        dtype=dtype, shape=tuple(q.shape), device=dev)
    ref = _dense(q, ks, vs, 0.25)
    what = f"v1, H={H}, Hkv={Hkv}, block_size={bs}, {dtype}, lengths {lens} (length 1, exact block multiples, a last block part full)"
    assert not out.isnan().any(), f"{what}: " + decode_hint(out, ref, lens, bs, 0)
    err = (out.cpu().double() - ref).abs().max().item()
    tol = 1e-4 if dtype == torch.float32 else 4e-3
    assert err < tol, f"{what}: max |diff| {err:.1e} against dense attention: " + decode_hint(out, ref, lens, bs, tol)
""" + FP16_BIG.replace("KERNEL", "paged_attention_v1").replace("WHAT", "v1").replace("EXTRA", "") + r"""
### END HIDDEN TESTS
"""),
md(r"""
Your v1 on the first case of the tests, next to the reference:
"""),
code(r'''
case = paged_case([5, 8, 1, 13], H=9, Hkv=3, D=16, block_size=4)
diff = (paged_attention_v1(*case, 0.25) - paged_attention(*case, 0.25)).abs().max().item()
print(f"v1 against the reference: max |diff| = {diff:.1e}")
'''),
md(r"""
## Problem 3: v2: several blocks per iteration (2 points)

v1 runs one loop iteration per block. A GPU program that loads only `BLOCK_SIZE` (16) keys per
iteration keeps too little data in flight to hide memory latency; the interpreter, which pays a fixed
cost per iteration, is even slower. v2 covers `BLOCKS_PER_ITER` blocks per iteration: a tile of
`TILE = BLOCKS_PER_ITER * BLOCK_SIZE` token positions. Each position `pos` of the tile has its own
logical block `pos // BLOCK_SIZE` and offset `pos % BLOCK_SIZE`, so the tile first loads a vector of
`TILE` block ids from the table (masked: past the sequence's last block the table holds padding, or
the next row), then gathers keys and values through them. The online softmax is unchanged.
`BLOCKS_PER_ITER` must be a power of two, as `BLOCK_SIZE` is: `TILE` is the length of a `tl.arange`
(the launcher refuses other values).

**Deliverable:** the body of `paged_attention_v2_kernel`; `paged_attention_v2` (given) launches it
with `BLOCKS_PER_ITER = 4` by default.
"""),
solution("paged_attention_v2", r'''
@triton.jit
def paged_attention_v2_kernel(out_ptr, q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, context_lens_ptr,
                              scale, max_blocks,
                              H: tl.constexpr, H_KV: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
                              BLOCK_SIZE: tl.constexpr, D: tl.constexpr, BLOCKS_PER_ITER: tl.constexpr):
    """Like v1, over BLOCKS_PER_ITER blocks (a tile of BLOCKS_PER_ITER * BLOCK_SIZE positions) per iteration."""
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    TILE: tl.constexpr = BLOCKS_PER_ITER * BLOCK_SIZE
    ### BEGIN SOLUTION
    ctx = tl.load(context_lens_ptr + seq)
    g = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, D)
    j = tl.arange(0, TILE)
    head = kv_head * GROUP + g
    head_ok = g < GROUP
    q = tl.load(q_ptr + seq * H * D + head[:, None] * D + d[None, :], mask=head_ok[:, None], other=0.0).to(tl.float32)
    m = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, D], tl.float32)
    for it in range(0, tl.cdiv(ctx, TILE)):
        pos = it * TILE + j                                           # (TILE,): token positions
        valid = pos < ctx
        block = tl.load(block_tables_ptr + seq * max_blocks + pos // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
        offs = (block * BLOCK_SIZE + pos % BLOCK_SIZE)[:, None] * (H_KV * D) + kv_head * D + d[None, :]
        k = tl.load(k_cache_ptr + offs, mask=valid[:, None], other=0.0).to(tl.float32)   # (TILE, D)
        v = tl.load(v_cache_ptr + offs, mask=valid[:, None], other=0.0).to(tl.float32)
        s = tl.sum(q[:, None, :] * k[None, :, :], axis=2) * scale    # (G, TILE)
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        alpha = tl.exp(m - m_new)
        p = tl.exp(s - m_new[:, None])
        l = l * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
        m = m_new
    out = acc / l[:, None]
    tl.store(out_ptr + seq * H * D + head[:, None] * D + d[None, :], out.to(out_ptr.dtype.element_ty),
             mask=head_ok[:, None])
    ### END SOLUTION


def paged_attention_v2(q, k_cache, v_cache, block_tables, context_lens, scale, blocks_per_iter=4):
    if type(blocks_per_iter) is not int or blocks_per_iter < 1 or blocks_per_iter & (blocks_per_iter - 1):
        raise ValueError(f"blocks_per_iter must be a power of two (1, 2, 4, 8, ...): a tile of blocks_per_iter * block_size "
                         f"positions is a tl.arange, whose length must be a power of two; got {blocks_per_iter!r}")
    return launch_paged(paged_attention_v2_kernel, q, k_cache, v_cache, block_tables, context_lens, scale,
                        BLOCKS_PER_ITER=blocks_per_iter)
'''),
locked("paged_attention_v2_build", r'''
# Given: your kernel compiled for an A100 and an H100 (bf16) in the background; the tests wait for the compiler
paged_attention_v2_build = gpu_compile(paged_attention_v2_kernel, dict(H=9, H_KV=3, GROUP=3, GROUP_PAD=4, BLOCK_SIZE=16, D=32,
                                                                     BLOCKS_PER_ITER=2))
'''),
tests("paged_attention_v2_tests", 2, r"""
from course.expect import expect_tensor
case = paged_case([5, 8, 1, 30], H=9, Hkv=3, D=16, block_size=4, seed=7)
for n in (1, 2, 4):
    out = expect_tensor(paged_attention_v2(*case, 0.25, blocks_per_iter=n), f"paged_attention_v2(..., blocks_per_iter={n})",
                        dtype=torch.float32, shape=(4, 9, 16), device=dev)
    ref = paged_attention(*case, 0.25)
    diff = (out - ref).abs().max().item()
    assert diff < 1e-4, f"blocks_per_iter={n} (tiles of {4 * n} positions), lengths [5, 8, 1, 30]: max |diff| {diff:.1e} " \
                        "from the reference: " + decode_hint(out, ref, [5, 8, 1, 30], 4 * n, 1e-4)
v2_compiled = gpu_compiled(paged_attention_v2_build, "paged_attention_v2_kernel")   # waits for the compiler started above
### BEGIN HIDDEN TESTS
""" + HIDDEN_ATTENTION + "\n" + HIDDEN_BIG + r"""
for H, Hkv, bs, n, dtype, seed in ((4, 4, 4, 2, torch.float32, 1), (8, 2, 8, 4, torch.float16, 2), (4, 1, 2, 8, torch.float32, 3),
                                   (9, 3, 16, 2, torch.float16, 4), (6, 3, 4, 4, torch.float32, 5)):
    lens = [1, bs, 2 * bs + 1, n * bs, n * bs + 1, 3 * n * bs - 1]
    q, kcache, vcache, bt, cl, ks, vs = _paged_case(lens, H, Hkv, 16, bs, dtype, seed)
    out = expect_tensor(paged_attention_v2(q, kcache, vcache, bt, cl, 0.25, blocks_per_iter=n), f"paged_attention_v2 ({dtype})",
                        dtype=dtype, shape=tuple(q.shape), device=dev)
    ref = _dense(q, ks, vs, 0.25)
    what = f"v2, H={H}, Hkv={Hkv}, block_size={bs}, blocks_per_iter={n}, {dtype}, lengths {lens}"
    assert not out.isnan().any(), f"{what}: " + decode_hint(out, ref, lens, n * bs, 0)
    err = (out.cpu().double() - ref).abs().max().item()
    tol = 1e-4 if dtype == torch.float32 else 4e-3
    assert err < tol, f"{what}: max |diff| {err:.1e} against dense attention: " + decode_hint(out, ref, lens, n * bs, tol)
""" + FP16_BIG.replace("KERNEL", "paged_attention_v2").replace("WHAT", "v2").replace("EXTRA", ", blocks_per_iter=2") + r"""
### END HIDDEN TESTS
"""),
]
