"""Lab 06, Problem 6: a FlashAttention-style causal prefill kernel over the paged cache (also for a chunk
of queries after cached tokens); then the compile check of every kernel for sm_75, sm_80 and sm_90."""
from autograder.authoring import code, locked, md, solution, tests
from autograder.lab_builders.lab06_refs import HIDDEN_ATTENTION, HIDDEN_CAUSAL, HIDDEN_TTIR

CELLS = [
md(r"""
## 4. Prefill: FlashAttention over the paged cache

Prefill is the other half of attention: a prompt of `T` tokens, every query attending to every key up
to its own position (causal). The scores form a `T x T` matrix per head; at 4k tokens that is 16 M
numbers per head, too many to write to memory and read back. **FlashAttention** (Dao et al., 2022)
never writes them: each program takes a tile of `BLOCK_M` queries and walks tiles of `BLOCK_N` keys
with the same online softmax as your decode kernels, so the scores live only in registers. With
`BLOCK_M` queries against each key tile, each key loaded serves `BLOCK_M` rows of `tl.dot`: prefill is
compute-bound, the opposite of decode.

Your kernel reads keys and values through the block table (the new tokens' keys and values were
stored there first, by `store_kv`), and its queries need not start at position 0: they are the **last**
`T` tokens of a sequence of `context_len` tokens, so `start = context_len - T` tokens come before them
in the cache. That is a chunk of a long prompt (chunked prefill, lab 11) or the rest of a prompt after
a prefix-cache hit (lab 09); `start = 0` is a plain prefill. Query `i` sits at position `start + i`
and sees keys `0 .. start + i`:

```
 keys:        0 .................... start-1 | start ................................ context_len-1
 query tile 0 (rows 0..BLOCK_M-1)     #######|####\
 query tile 1                         #######|########\
 query tile 2 (the last, part full)   #######|############\     # = keys a row sees (all the cache, then causal)
```

Program `(tile, head)` needs keys only up to `hi = min(start + (tile + 1) * BLOCK_M, context_len)`: the
last position any of its rows can see. Stopping there skips the tiles above the diagonal (at
`start = 0`, about half of all the work).
"""),
md(r"""
## Problem 6: FlashAttention-style causal prefill through the block table (5 points)

Grid `(cdiv(T, BLOCK_M), H)`: one program per tile of queries and query head; it reads the keys of
KV head `head // (H // H_KV)`. Layout: `q` and `out` are `(T, H, D)`; `block_table` one sequence's row
of block ids, int32. In the kernel, `T` is `n_q` and `context_len` is `ctx`; `start = ctx - n_q` is
given. The program:

1. loads its query rows `i = tile * BLOCK_M + tl.arange(0, BLOCK_M)` of this head, `(BLOCK_M, D)`,
   masked past `T` (zeros); converts them to `tl.float32` if `DOT_F32`; positions `start + i`;
2. for `n0 in range(0, hi, BLOCK_N)`: key positions `n0 + tl.arange(0, BLOCK_N)`, loaded while `< hi`
   through the block table as in v2; scores `tl.dot(q, tl.trans(k), input_precision="ieee") * scale`;
   `-inf` where the key is past `hi` or past the row's own position; the online softmax and
   `tl.dot(p.to(q.dtype), v, input_precision="ieee")` of Problem 4;
3. stores `acc / l` in the output's dtype, for the rows `< T` only.

Every real row sees key 0 in the first tile, so its running maximum is finite after it: a later tile
whose keys are all in the row's future adds `exp(-inf) = 0`, not NaN. Rows past `T` compute garbage
that is never stored. As for Problem 4, the tests also run the path a GPU takes (`DOT_F32=False`,
fp16), bf16 in the interpreter, and read the `tl.dot`s of your kernel compiled for an A100.

**Deliverable:** the body of `paged_prefill_kernel`; `paged_prefill` (given) launches it, with
`BLOCK_M`, `BLOCK_N`, `num_warps` and `num_stages` autotuned on a GPU for long prompts.
"""),
solution("paged_prefill", r'''
@triton.jit
def paged_prefill_kernel(out_ptr, q_ptr, k_cache_ptr, v_cache_ptr, block_table_ptr, scale, n_q, ctx,
                         H: tl.constexpr, H_KV: tl.constexpr, BLOCK_SIZE: tl.constexpr, D: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DOT_F32: tl.constexpr):
    """Program (tile, head): queries tile * BLOCK_M .. + BLOCK_M - 1 of the n_q new tokens (positions ctx - n_q + i)
    attend causally to the sequence's first ctx tokens, read through its block table, BLOCK_N keys per iteration."""
    tile = tl.program_id(0)
    head = tl.program_id(1)
    kv_head = head // (H // H_KV)
    start = ctx - n_q                                                  # tokens cached before the first query
    ### BEGIN SOLUTION
    i = tile * BLOCK_M + tl.arange(0, BLOCK_M)                         # (BLOCK_M,): query rows
    row_ok = i < n_q
    qpos = start + i                                                   # their positions in the sequence
    d = tl.arange(0, D)
    j = tl.arange(0, BLOCK_N)
    q = tl.load(q_ptr + i[:, None] * (H * D) + head * D + d[None, :], mask=row_ok[:, None], other=0.0)
    if DOT_F32:
        q = q.to(tl.float32)
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    hi = tl.minimum(start + (tile + 1) * BLOCK_M, ctx)                 # keys past hi are in every row's future
    for n0 in range(0, hi, BLOCK_N):
        kpos = n0 + j                                                  # (BLOCK_N,): key positions
        k_ok = kpos < hi
        block = tl.load(block_table_ptr + kpos // BLOCK_SIZE, mask=k_ok, other=0).to(tl.int64)
        offs = (block * BLOCK_SIZE + kpos % BLOCK_SIZE)[:, None] * (H_KV * D) + kv_head * D + d[None, :]
        k = tl.load(k_cache_ptr + offs, mask=k_ok[:, None], other=0.0).to(q.dtype)   # (BLOCK_N, D)
        v = tl.load(v_cache_ptr + offs, mask=k_ok[:, None], other=0.0).to(q.dtype)
        s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale     # (BLOCK_M, BLOCK_N), float32
        s = tl.where(k_ok[None, :] & (kpos[None, :] <= qpos[:, None]), s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        alpha = tl.exp(m - m_new)
        p = tl.exp(s - m_new[:, None])
        l = l * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v, input_precision="ieee")
        m = m_new
    tl.store(out_ptr + i[:, None] * (H * D) + head * D + d[None, :], (acc / l[:, None]).to(out_ptr.dtype.element_ty),
             mask=row_ok[:, None])
    ### END SOLUTION
'''),
locked("prefill_launch", r'''
# As for split-KV: autotuned on a GPU for prompts of TUNE_FROM tokens or more, one fixed configuration otherwise.
FIXED_PREFILL = dict(BLOCK_M=64, BLOCK_N=32, num_warps=4, num_stages=2)
PREFILL_CONFIGS = [triton.Config({"BLOCK_M": m, "BLOCK_N": n}, num_warps=warps, num_stages=stages)
                   for m, n, warps, stages in ((64, 32, 4, 2), (64, 64, 4, 3), (128, 64, 8, 3), (128, 32, 4, 3))]
PREFILL_TUNE_KEY = ["H", "H_KV", "D", "BLOCK_SIZE", "n_q"]   # for autotuned(), defined beside the split-KV launcher


def paged_prefill(q, k_cache, v_cache, block_table, context_len, scale, out=None):
    """Causal attention of the last T = q.shape[0] tokens of one sequence (positions context_len - T ..
    context_len - 1) over its first context_len tokens, whose keys and values are in the paged cache.
    q: (T, H, D); block_table: (max_blocks,) int32; context_len: an int. Returns (T, H, D) (or fills `out`)."""
    T, H, D = q.shape
    _, block_size, Hkv, Dk = k_cache.shape
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache), ("block_table", block_table)):
        if not t.is_contiguous() or t.device != q.device:
            raise ValueError(f"{name} must be contiguous and on q's device ({q.device})")
    if Dk != D or v_cache.shape != k_cache.shape or H % Hkv or q.dtype != k_cache.dtype or D < 16 or D & (D - 1):
        raise ValueError(f"q {tuple(q.shape)} {q.dtype} does not fit the caches {tuple(k_cache.shape)} {k_cache.dtype} "
                         "(head_dim: a power of two >= 16, for tl.dot)")
    if block_table.dtype != torch.int32 or block_table.dim() != 1:
        raise ValueError("block_table must be one sequence's row of block ids, (max_blocks,) int32")
    if not isinstance(context_len, int) or not 1 <= T <= context_len <= block_table.shape[0] * block_size:
        raise ValueError(f"need 1 <= T ({T}) <= context_len ({context_len}) <= the table's {block_table.shape[0] * block_size} slots")
    out = torch.empty_like(q) if out is None else out
    if out.shape != q.shape or out.dtype != q.dtype or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous {q.dtype} tensor of shape {tuple(q.shape)}")
    if env.gpu and T >= TUNE_FROM:
        kernel, meta = autotuned(paged_prefill_kernel, PREFILL_CONFIGS, PREFILL_TUNE_KEY), {}
    else:
        kernel, meta = paged_prefill_kernel, (FIXED_PREFILL if env.gpu else dict(BLOCK_M=16, BLOCK_N=16))
    grid = lambda meta: (triton.cdiv(T, meta["BLOCK_M"]), H)
    kernel[grid](out, q, k_cache, v_cache, block_table, scale, T, context_len, H=H, H_KV=Hkv,
                 BLOCK_SIZE=block_size, D=D, DOT_F32=not q.is_cuda, **meta)
    return out


def causal_reference(q, k_cache, v_cache, block_table, context_len, scale):
    """paged_prefill in PyTorch: gather the sequence's keys and values, then SDPA with the causal mask of a chunk."""
    T, H, D = q.shape
    Hkv = k_cache.shape[2]
    blocks = block_table[: -(-context_len // k_cache.shape[1])].long()
    k = k_cache[blocks].reshape(-1, Hkv, D)[:context_len].transpose(0, 1).repeat_interleave(H // Hkv, 0)   # (H, L, D)
    v = v_cache[blocks].reshape(-1, Hkv, D)[:context_len].transpose(0, 1).repeat_interleave(H // Hkv, 0)
    seen = torch.arange(context_len, device=q.device)[None, :] <= torch.arange(context_len - T, context_len, device=q.device)[:, None]
    return F.scaled_dot_product_attention(q.transpose(0, 1), k, v, attn_mask=seen, scale=scale).transpose(0, 1)   # (T, H, D)
'''),
locked("paged_prefill_build", r'''
# Given: your kernel compiled for an A100 and an H100 (bf16, DOT_F32=False as on a GPU) in the background; the
# tests wait for the compiler
paged_prefill_build = gpu_compile(paged_prefill_kernel, dict(H=9, H_KV=3, BLOCK_SIZE=16, D=32, BLOCK_M=32, BLOCK_N=32,
                                                             DOT_F32=False))
'''),
tests("paged_prefill_tests", 5, r"""
from course.expect import expect_tensor
for L, T, H, Hkv, bs in ((37, 37, 4, 2, 4), (45, 20, 9, 3, 8), (16, 1, 4, 4, 4)):   # a prefill, a chunk, one query
    _, k_cache, v_cache, tables, _ = paged_case([L], H=H, Hkv=Hkv, D=16, block_size=bs, seed=L)
    q = torch.randn(T, H, 16, generator=torch.Generator().manual_seed(T)).to(dev)   # drawn on the CPU generator, then moved
    big = torch.full((T + 16, H, 16), float("nan"), device=dev)
    out = expect_tensor(paged_prefill(q, k_cache, v_cache, tables[0], L, 0.25, out=big[:T]), f"paged_prefill (T={T}, context {L})",
                        dtype=torch.float32, shape=(T, H, 16), device=dev)
    assert big[T:].isnan().all(), f"T={T}: rows past T were stored: mask the query rows"
    diff = (out - causal_reference(q, k_cache, v_cache, tables[0], L, 0.25)).abs().max().item()
    assert diff < 1e-4, f"T={T} queries after {L - T} cached tokens, H={H}, Hkv={Hkv}: max |diff| {diff:.1e} from SDPA " \
                        "(the causal mask kpos <= start + i, the stop at hi, the KV head of a query head)"
prefill_compiled = gpu_compiled(paged_prefill_build, "paged_prefill_kernel")   # waits for the compiler started above
### BEGIN HIDDEN TESTS
""" + HIDDEN_ATTENTION + "\n" + HIDDEN_CAUSAL + "\n" + HIDDEN_TTIR + r"""
cases = [(1, 1, 4, 1, 4, torch.float32),      # one token
         (8, 8, 4, 4, 4, torch.float32),      # exact blocks, MHA
         (50, 17, 6, 3, 4, torch.float32),    # a chunk ending inside a block, T not a multiple of the tile
         (33, 33, 8, 1, 16, torch.float16),   # MQA, fp16, a context one past a block
         (40, 24, 9, 3, 8, torch.float16),    # the chunk starts on a block boundary (16 cached), GQA 9/3
         (24, 2, 4, 2, 2, torch.float32)]     # two queries after 22 cached tokens
if not env.gpu or env.dtype == torch.bfloat16:               # the interpreter (DOT_F32=True), or a GPU with bf16 (not a T4)
    cases.append((70, 40, 9, 3, 16, torch.bfloat16))
for L, T, H, Hkv, bs, dtype in cases:
    _, kcache, vcache, bt, _, ks, vs = _paged_case([L], H, Hkv, 16, bs, dtype, seed=L + T, pad_width=1)
    q = torch.randn(T, H, 16, generator=torch.Generator().manual_seed(L), device="cpu").to(dtype).to(dev)
    big = torch.full((T + 16, H, 16), float("nan"), dtype=dtype, device=dev)
    what = f"T={T} after {L - T} cached, H={H}, Hkv={Hkv}, block_size={bs}, {dtype}"
    out = expect_tensor(paged_prefill(q, kcache, vcache, bt[0], L, 0.25, out=big[:T]), f"paged_prefill ({what})",
                        dtype=dtype, shape=(T, H, 16), device=dev)
    assert big[T:].isnan().all(), f"{what}: rows past T were stored"
    tol = {torch.float32: 1e-4, torch.float16: 4e-3, torch.bfloat16: 5e-2}[dtype]
    err = (out.cpu().double() - _causal_ref(q, ks[0], vs[0], 0.25)).abs().max().item()
    assert err < tol, f"{what}: max |diff| {err:.1e} from causal attention " + (
        "(the fp32 and fp16 cases passed: in the interpreter bf16 arithmetic, tl.dot included, is garbage, so the launcher "
        "passes DOT_F32=True here: convert q to float32 if DOT_F32, then load keys and values .to(q.dtype))"
        if dtype == torch.bfloat16 and not env.gpu else "(the chunk's offset, the causal mask, the keys up to hi, the GQA head mapping)")
# the path a GPU takes, called as the launcher calls it there: DOT_F32=False, so q, the tiles and p stay fp16
_, kcache, vcache, bt, _, ks, vs = _paged_case([40], 9, 3, 16, 8, torch.float16, seed=22)
q = torch.randn(24, 9, 16, generator=torch.Generator().manual_seed(22), device="cpu").to(torch.float16).to(dev)
big = torch.full((24 + 16, 9, 16), float("nan"), dtype=torch.float16, device=dev)
what = "prefill with DOT_F32=False (what a GPU runs), fp16, T=24 after 16 cached, H=9, Hkv=3"
try:
    paged_prefill_kernel[(2, 9)](big, q, kcache, vcache, bt[0], 0.25, 24, 40, H=9, H_KV=3, BLOCK_SIZE=8, D=16,
                                 BLOCK_M=16, BLOCK_N=16, DOT_F32=False)
except Exception as error:
    raise AssertionError(f"{what} fails: {type(error).__name__}: {str(error).strip().splitlines()[-1][:300]}. With DOT_F32 "
                         "False, q stays fp16: load keys and values .to(q.dtype), and give tl.dot p.to(q.dtype)") from None
err = (big[:24].cpu().double() - _causal_ref(q, ks[0], vs[0], 0.25)).abs().max().item()
assert err < 4e-3, f"{what}: max |diff| {err:.1e} from causal attention (with DOT_F32 True it was right: what changes is " \
                   "only the dtype of q, of the key and value tiles, and of p)"
_f32 = [pair for pair in _tt_dots(prefill_compiled[0]["ttir"]) if "f32" in pair]
assert not _f32, f"compiled for an A100 in bf16 with DOT_F32=False, your tl.dot multiplies float32 tiles {_f32}: on a GPU " \
    "that means no tensor cores (an A100 multiplies bf16 tiles at 312 TFLOP/s on them, float32 at 19.5 without). " \
    "Convert q to float32 only if DOT_F32, and load keys and values .to(q.dtype)"
### END HIDDEN TESTS
"""),
md(r"""
Your kernel on a chunk of 20 queries after 25 cached tokens, next to SDPA:
"""),
code(r'''
_, k_cache, v_cache, tables, _ = paged_case([45], H=9, Hkv=3, D=16, block_size=8, seed=1)
q = torch.randn(20, 9, 16, generator=torch.Generator().manual_seed(0)).to(dev)   # the last 20 of 45 tokens
diff = (paged_prefill(q, k_cache, v_cache, tables[0], 45, 0.25) - causal_reference(q, k_cache, v_cache, tables[0], 45, 0.25)).abs().max().item()
print(f"a chunk of 20 queries after 25 cached tokens: max |diff| = {diff:.1e} from SDPA")
'''),
md(r"""
### Will it compile for a GPU?

The interpreter accepted your kernels; a GPU compiler is stricter. `course.kernels.compile_report`
compiles each kernel for GPU targets that this machine does not need to have, in a separate process
without the interpreter, and reads the compiled code (PTX): how many **tensor-core** instructions it
holds (`mma` on sm_80 and later, Hopper's `wgmma` on sm_90), how many **asynchronous copies**
(`cp.async`: the loads Triton pipelines across loop iterations when `num_stages > 1`), and how much
shared memory a program takes (a T4 gives a program at most 64 KB). sm_75 is a T4 (fp16: it has no
bf16), sm_80 an A100, sm_90 an H100. Each compilation takes a few seconds.
"""),
code(r"""
from course.kernels import compile_error_summary, compile_report, kernel_source

def signature(kernel, dtype):
    p, f32 = f"*{dtype}", "*fp32"
    paged = {"q_ptr": p, "k_cache_ptr": p, "v_cache_ptr": p, "block_tables_ptr": "*i32", "context_lens_ptr": "*i32",
             "scale": "fp32", "max_blocks": "i32"}
    sigs = {"store_kv_kernel": {"k_ptr": p, "v_ptr": p, "k_cache_ptr": p, "v_cache_ptr": p, "slot_ptr": "*i64"},
            "paged_attention_v1_kernel": {"out_ptr": p, **paged}, "paged_attention_v2_kernel": {"out_ptr": p, **paged},
            "paged_decode_split_kernel": {"part_out_ptr": f32, "part_lse_ptr": f32, **paged, "split_len": "i32", "n_splits": "i32"},
            "split_reduce_kernel": {"out_ptr": p, "part_out_ptr": f32, "part_lse_ptr": f32, "n_splits": "i32"},
            "paged_prefill_kernel": {"out_ptr": p, "q_ptr": p, "k_cache_ptr": p, "v_cache_ptr": p, "block_table_ptr": "*i32",
                                     "scale": "fp32", "n_q": "i32", "ctx": "i32"}}
    return {**sigs[kernel], **{name: "constexpr" for name in CONSTEXPRS[kernel]}}

smollm2 = dict(H=9, H_KV=3, BLOCK_SIZE=16, D=64)
CONSTEXPRS = {"store_kv_kernel": dict(ROW=192, ROW_PAD=256),
              "paged_attention_v1_kernel": dict(**smollm2, GROUP=3, GROUP_PAD=4),
              "paged_attention_v2_kernel": dict(**smollm2, GROUP=3, GROUP_PAD=4, BLOCKS_PER_ITER=4),
              "paged_decode_split_kernel": dict(**smollm2, GROUP=3, GROUP_PAD=16, TILE=64, DOT_F32=False, USE_PDL=False),
              "split_reduce_kernel": dict(H=9, D=64, SPLITS_PAD=4, USE_PDL=False),
              "paged_prefill_kernel": dict(**smollm2, BLOCK_M=64, BLOCK_N=64, DOT_F32=False)}
kernels = (store_kv_kernel, paged_attention_v1_kernel, paged_attention_v2_kernel, paged_decode_split_kernel,
           split_reduce_kernel, paged_prefill_kernel)
name_of = lambda kernel: getattr(kernel, "fn", kernel).__name__       # the Python function inside @triton.jit
targets = env.pick([(75, "fp16"), (80, "bf16"), (90, "bf16")], [])
if not targets:
    print("skipped in quick mode: each compilation takes seconds (tests/test_paged_kernels.py compiles the solutions)")
else:
    with_pdl = lambda name, arch: {"USE_PDL": arch >= 90} if "USE_PDL" in CONSTEXPRS[name] else {}   # sm_90 (section 5)
    jobs = [(name_of(k), signature(name_of(k), dt), {**CONSTEXPRS[name_of(k)], **with_pdl(name_of(k), arch)}, arch,
             {"num_warps": 4, "num_stages": 3}) for k in kernels for arch, dt in targets]
    report = compile_report(kernel_source(*kernels), jobs)
    print(f"{'kernel':<28}" + "".join(f"{f'sm_{a} {dt}':>36}" for a, dt in targets))
    for k in kernels:
        cells = []
        for (name, _, _, arch, _), r in zip(jobs, report):
            if name == name_of(k):
                cores = f"{r['mma']} mma" if r.get("mma") else f"{r['wgmma']} wgmma" if r.get("wgmma") else "no mma"
                gdc = f", {r['gdc']} gdc" if r.get("gdc") else ""
                cells.append("FAILS (below)" if r["error"] else f"{cores}, {r['cp_async']} cp.async{gdc}, {r['shared'] // 1024} KB")
        print(f"{name_of(k):<28}" + "".join(f"{c:>36}" for c in cells))
    for (name, _, _, arch, _), r in zip(jobs, report):
        if r["error"]:
            print(f"\n{name} for sm_{arch}: {compile_error_summary(r['error'])}\n{r['error']}")
"""),
md(r"""
Read your table (each cell: tensor-core instructions, asynchronous copies, shared memory per
program). With Triton 3.6 or 3.7 the v1 and v2 kernels hold no tensor-core instruction (their
`tl.sum` of products runs on ordinary cores), while the split-KV and prefill kernels use `mma` on
sm_80, and on sm_90 the prefill's tiles of 64 queries get Hopper's `wgmma`; on sm_75 neither does:
there Triton's `tl.dot` runs on ordinary cores too. The `cp.async` counts show which kernels' loads
are pipelined across iterations. On sm_90 the split-KV pair is compiled with `USE_PDL=True`
(section 5), and `gdc` counts the `griddepcontrol` instructions its two given lines become. Another
Triton version may compile differently: the table is your compiler's.
"""),
]
