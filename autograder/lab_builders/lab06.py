"""Builds the lab 06 source notebook. Edit this file, then run from the repo root:

    .venv/bin/python -m autograder.lab_builders.lab06
"""
from autograder.authoring import code, locked, md, solution, tests, write_notebook  # noqa: E402
from autograder.lab_builders.common_cells import CHECK_YOUR_WORK, COLAB_INSTALL, SETUP  # noqa: E402

# Independent references of the hidden tests (they live only here, in the instructor's source):
# dense attention over per-sequence K/V in float64, and paged inputs built by scattering dense K/V
# into shuffled blocks whose unused slots hold NaN (stale memory).
HIDDEN_ATTENTION = r"""
def _dense(q, ks, vs, scale):
    # q (B, H, D); ks[b], vs[b]: (L_b, Hkv, D) -> (B, H, D): float64 on the CPU, no paging at all
    out = []
    for b, (k, v) in enumerate(zip(ks, vs)):
        g = q.shape[1] // k.shape[1]
        kk, vv = k.cpu().double().repeat_interleave(g, 1), v.cpu().double().repeat_interleave(g, 1)
        s = torch.einsum("hd,lhd->hl", q[b].cpu().double(), kk) * scale
        out.append(torch.einsum("hl,lhd->hd", s.softmax(-1), vv))
    return torch.stack(out)
def _paged_case(lens, H, Hkv, D, bs, dtype, seed, pad_width=0):
    # dense K/V per sequence, scattered into shuffled physical blocks whose other slots hold NaN
    # (stale memory); built on the CPU from a seeded generator, then moved to the lab's device
    g = torch.Generator().manual_seed(seed)
    n_blocks = sum(-(-L // bs) for L in lens) + 2
    k_cache = torch.full((n_blocks, bs, Hkv, D), float("nan"), dtype=dtype)  # cpu: moved below
    v_cache = torch.full((n_blocks, bs, Hkv, D), float("nan"), dtype=dtype)  # cpu: moved below
    free = torch.randperm(n_blocks, generator=g).tolist()
    tables, ks, vs = [], [], []
    for L in lens:
        t = [free.pop() for _ in range(-(-L // bs))]
        k = torch.randn(L, Hkv, D, generator=g).to(dtype)  # cpu: reference input, moved below
        v = torch.randn(L, Hkv, D, generator=g).to(dtype)  # cpu: reference input, moved below
        for p in range(L):
            k_cache[t[p // bs], p % bs] = k[p]
            v_cache[t[p // bs], p % bs] = v[p]
        tables.append(t); ks.append(k); vs.append(v)
    width = max(len(t) for t in tables) + pad_width
    bt = torch.zeros(len(lens), width, dtype=torch.int32)  # cpu: moved below
    for i, t in enumerate(tables):
        bt[i, :len(t)] = torch.tensor(t, dtype=torch.int32)  # cpu: written into bt
    q = torch.randn(len(lens), H, D, generator=g).to(dtype)  # cpu: moved below
    dev = env.device
    return (q.to(dev), k_cache.to(dev), v_cache.to(dev), bt.to(dev),
            torch.tensor(lens, dtype=torch.int32, device=dev), ks, vs)
""".strip("\n")

cells = [
md(r"""
# Lab 06: Triton kernels for paged attention

Lab 05 put the KV cache in blocks and read them back with PyTorch: for every sequence, gather its
blocks into a new tensor, then attend. That copies the whole context at every layer of every decode
step, in many small operations. A real engine runs one **kernel** that reads the blocks where they
are. In this lab you write those kernels in **Triton**, which compiles Python-like code into GPU
kernels, check each one against a reference, and time them against the hardware's limit.

**You will**
- write a first kernel (store new keys and values into their slots) and learn Triton's model: programs, tiles, masks;
- write paged decode attention with an online softmax, one block per iteration (v1), then several (v2);
- check every version against a reference, in fp32 and fp16, MHA, GQA and MQA, ragged lengths;
- compile your kernels for GPUs this machine does not have, and time them where there is one.

**Time:** about 2 hours: 30 minutes of reading, three kernels of 20-40 minutes each, a few minutes
of running. **Hardware:** on a laptop CPU the kernels run in Triton's *interpreter* (NumPy on the
CPU): correct, and slow. On a GPU they are compiled, and the timing section compares them with the
hardware's memory bandwidth.
"""),
locked("colab_install", COLAB_INSTALL),
locked("setup", SETUP),
md(r"""
## 1. What lab 05 left us

Lab 05's answers come given (`course.engine`): the block allocator, `write_kv` (store keys and values
into their slots) and `paged_attention` (decode attention through block tables, in PyTorch). They
are the references every kernel below is checked against. The pool of one layer is
`(n_blocks, block_size, n_kv_head, head_dim)`; a token at position `p` of a sequence lives in slot
`table[p // block_size] * block_size + p % block_size`.
"""),
locked("given", r'''
import time
from collections import deque

import torch

from course.engine import BlockAllocator, block_table_tensor, paged_attention, write_kv
from course.engine.paged_engine import Request, contiguous_generate, paged_generate

tokenizer = course.load_tokenizer()
model = course.load_model(device=env.device, dtype=env.dtype)
dev, cfg = env.device, model.cfg
print(f"SmolLM2 in {env.dtype} on {dev}: {cfg.n_head} query heads, {cfg.n_kv_head} KV heads, head_dim {cfg.head_dim}")
'''),
md(r"""
## 2. Triton: the programming model

`paged_attention` loops over sequences in Python and gathers each one's keys into a new tensor
before attending: on a GPU that is many small kernel launches and a copy of the whole context per
step. A real engine runs one kernel that reads the blocks where they are. You will write it in
**Triton**, which compiles Python-like code into GPU kernels. Like llm.c's `dev/cuda` files, this
section has a reference (yours), numbered versions, a check of each version's maximum difference
from the reference, and then timing.

The Triton model in four lines: you write the work of one **program**; a **grid** of programs runs in
parallel (`kernel[grid](...)`), each finding its share of the work from `tl.program_id(axis)`; a
program loads and stores whole tiles with `tl.load(pointers, mask=...)` and `tl.store`; tile sizes
are `tl.constexpr` powers of two, and **masks** switch off the lanes that fall outside the data.

**On a CPU**, `course.setup()` set `TRITON_INTERPRET=1` before anything imported Triton, so every
`@triton.jit` below runs in the interpreter: NumPy executes each program one after the other.
It is how you can write kernels on a laptop, but it has traps:

- it is slow: about a few milliseconds per program per loop iteration, whatever the tile size. Keep
  grids and loops small, and read its times as interpreter time, not performance;
- it accepts code that a GPU compiler rejects: `break` or `continue` in a loop, a loop variable whose
  dtype changes between iterations, `math.sqrt` of a runtime argument. The compile check below catches these;
- a load without a mask that reads far outside a tensor can crash the whole kernel process (Jupyter
  then restarts it); near misses silently read garbage. Mask every load whose lanes can fall outside;
- `tl.device_assert` does nothing, and bf16 arithmetic gives silent garbage (load, then `.to(tl.float32)`);
  fp16 and fp32 are fine;
- `tl.dot` works on any tile size here, but GPUs need at least 16 in every dimension; and fp32 `tl.dot`
  is exact here but TF32 (about 3 decimal digits) on recent GPUs. The kernels below avoid `tl.dot`
  (their tiles are small) with elementwise products and `tl.sum`.
- `TRITON_INTERPRET` is read when `@triton.jit` runs: setting it after the kernels are defined does nothing.
"""),
code(r"""
import triton
import triton.language as tl

print(f"triton {triton.__version__}: {'interpreter (CPU)' if env.triton_interpreted else 'compiled for ' + torch.cuda.get_device_name(0)}")
"""),
md(r"""
## Problem 1: Warm-up: a kernel that writes K/V into slots (2 points)

The first kernel replaces `write_kv`. One program per new token: it reads the token's slot, then
copies the token's `Hkv * D` key values and value values into that slot's row of the caches. Seen
flat, token `i`'s keys start at `k_ptr + i * ROW` and slot `s` starts at `k_cache_ptr + s * ROW`, with
`ROW = Hkv * D`. `tl.arange` needs a power of two, and SmolLM2's row is 192 values, so the tile is
`ROW_PAD = 256` lanes and a mask switches off the last 64. The same mask switches off a token whose
slot is negative. Convert the slot to `tl.int64` before multiplying: a big pool overflows 32 bits.

**Deliverable:** the body of `store_kv_kernel`; `store_kv` (given) launches it.
"""),
solution("store_kv_kernel", r'''
@triton.jit
def store_kv_kernel(k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, ROW: tl.constexpr, ROW_PAD: tl.constexpr):
    """Program i: copy row i of k and v (ROW values each) into row slot_mapping[i] of the caches."""
    ### BEGIN SOLUTION
    token = tl.program_id(0)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    cols = tl.arange(0, ROW_PAD)
    mask = (cols < ROW) & (slot >= 0)
    k = tl.load(k_ptr + token * ROW + cols, mask=mask)
    v = tl.load(v_ptr + token * ROW + cols, mask=mask)
    tl.store(k_cache_ptr + slot * ROW + cols, k, mask=mask)
    tl.store(v_cache_ptr + slot * ROW + cols, v, mask=mask)
    ### END SOLUTION


def store_kv(k_cache, v_cache, k, v, slot_mapping):
    """Triton version of write_kv: same arguments, same result."""
    N, Hkv, D = k.shape
    if not (k.is_contiguous() and v.is_contiguous() and k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("store_kv needs contiguous k, v and caches")
    if k_cache.shape[2:] != (Hkv, D) or k.dtype != k_cache.dtype:
        raise ValueError(f"k {tuple(k.shape)} {k.dtype} does not match the cache {tuple(k_cache.shape)} {k_cache.dtype}")
    store_kv_kernel[(N,)](k, v, k_cache, v_cache, slot_mapping, ROW=Hkv * D, ROW_PAD=triton.next_power_of_2(Hkv * D))
'''),
tests("store_kv_tests", 2, r"""
kc, vc = torch.zeros(4, 4, 3, 8, device=dev), torch.zeros(4, 4, 3, 8, device=dev)   # 4 blocks of 4 slots, Hkv=3, D=8: ROW=24
k, v = torch.randn(5, 3, 8, device=dev), torch.randn(5, 3, 8, device=dev)
slots = torch.tensor([3, 4, 15, -1, 0], device=dev)                                 # 3 | 4: a block boundary; -1: skip
store_kv(kc, vc, k, v, slots)
ref_k, ref_v = torch.zeros_like(kc), torch.zeros_like(vc)
write_kv(ref_k, ref_v, k, v, slots)
assert torch.equal(kc, ref_k) and torch.equal(vc, ref_v), \
    "store_kv must write exactly what write_kv writes (the row of each token, its slot, the -1 skip)"
### BEGIN HIDDEN TESTS
for Hkv, D, dtype in ((1, 16, torch.float16), (2, 4, torch.float32), (4, 8, torch.float32)):
    kc = torch.full((3, 2, Hkv, D), -9.0, dtype=dtype, device=dev); vc = kc.clone()
    k = torch.randn(6, Hkv, D, device=dev).to(dtype); v = torch.randn(6, Hkv, D, device=dev).to(dtype)
    slots = torch.tensor([1, 2, -1, 5, 0, 4], device=dev)
    store_kv(kc, vc, k, v, slots)
    fk, fv = kc.view(6, Hkv, D), vc.view(6, Hkv, D)
    for i, s in enumerate(slots.tolist()):
        if s >= 0:
            assert torch.equal(fk[s], k[i]) and torch.equal(fv[s], v[i]), f"Hkv={Hkv}, D={D}: token {i} belongs in slot {s}"
    assert (fk[3] == -9).all() and (fv[3] == -9).all(), "slot 3 was given to no token: it must not change (mask the padded lanes)"
### END HIDDEN TESTS
"""),
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
dtype, and store in the output's dtype (`out_ptr.dtype.element_ty`). Without `tl.dot`, `q . k` for
all heads and positions is `tl.sum(q[:, None, :] * k[None, :, :], axis=2)`.

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
    if Dk != D or v_cache.shape != k_cache.shape or H % Hkv or q.dtype != k_cache.dtype:
        raise ValueError(f"q {tuple(q.shape)} {q.dtype} does not fit the caches {tuple(k_cache.shape)} {k_cache.dtype}")
    if block_tables.dtype != torch.int32 or context_lens.dtype != torch.int32 or block_tables.shape[0] != B or context_lens.shape != (B,):
        raise ValueError("block_tables must be (B, max_blocks) int32 and context_lens (B,) int32")
    for name, n in (("head_dim", D), ("block_size", block_size)):
        if n & (n - 1):
            raise ValueError(f"{name} must be a power of two for tl.arange, got {n}")
    if int(context_lens.min()) < 1 or int(context_lens.max()) > block_tables.shape[1] * block_size:
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
'''),
code(r'''
case = paged_case([5, 8, 1, 13], H=9, Hkv=3, D=16, block_size=4)
diff = (paged_attention_v1(*case, 0.25) - paged_attention(*case, 0.25)).abs().max().item()
print(f"v1 against the reference: max |diff| = {diff:.1e}")
'''),
tests("paged_attention_v1_tests", 4, r"""
from course.expect import expect_tensor
for lens, H, Hkv, bs in (([5, 8, 1, 13], 9, 3, 4), ([4, 7], 4, 4, 4), ([16, 3], 4, 1, 8)):
    case = paged_case(lens, H=H, Hkv=Hkv, D=16, block_size=bs, seed=H)
    out = expect_tensor(paged_attention_v1(*case, 0.25), "paged_attention_v1(...)", dtype=torch.float32,
                        shape=(len(lens), H, 16), device=dev)
    diff = (out - paged_attention(*case, 0.25)).abs().max().item()
    assert diff < 1e-4, f"lengths {lens}, H={H}, Hkv={Hkv}, block_size={bs}: max |diff| {diff:.1e} from the reference " \
                        "(NaN: a load or a score past context_len is not masked)"
### BEGIN HIDDEN TESTS
""" + HIDDEN_ATTENTION + r"""
for H, Hkv, bs, dtype, seed in ((4, 4, 4, torch.float32, 1), (8, 2, 8, torch.float16, 2), (4, 1, 16, torch.float32, 3),
                                (9, 3, 2, torch.float16, 4), (6, 3, 1, torch.float32, 5)):
    lens = [1, bs, 2 * bs + 1, 3 * bs]
    q, kcache, vcache, bt, cl, ks, vs = _paged_case(lens, H, Hkv, 16, bs, dtype, seed, pad_width=1)
    out = expect_tensor(paged_attention_v1(q, kcache, vcache, bt, cl, 0.25), f"paged_attention_v1 ({dtype})",
                        dtype=dtype, shape=tuple(q.shape), device=dev)
    err = (out.cpu().double() - _dense(q, ks, vs, 0.25)).abs().max().item()
    tol = 1e-4 if dtype == torch.float32 else 4e-3
    assert err < tol, f"v1, H={H}, Hkv={Hkv}, block_size={bs}, {dtype}, lengths {lens}: max |diff| {err:.1e} against " \
                      "dense attention (length 1, exact block multiples, the partly full last block, GQA head mapping)"
### END HIDDEN TESTS
"""),
md(r"""
## Problem 3: v2: several blocks per iteration (3 points)

v1 runs one loop iteration per block. A GPU program that loads only `BLOCK_SIZE` (16) keys per
iteration keeps too little data in flight to hide memory latency; the interpreter, which pays a fixed
cost per iteration, is even slower. v2 covers `BLOCKS_PER_ITER` blocks per iteration: a tile of
`TILE = BLOCKS_PER_ITER * BLOCK_SIZE` token positions. Each position `pos` of the tile has its own
logical block `pos // BLOCK_SIZE` and offset `pos % BLOCK_SIZE`, so the tile first loads a vector of
`TILE` block ids from the table (masked: past the sequence's last block the table holds padding, or
the next row), then gathers keys and values through them. The online softmax is unchanged.

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
    return launch_paged(paged_attention_v2_kernel, q, k_cache, v_cache, block_tables, context_lens, scale,
                        BLOCKS_PER_ITER=blocks_per_iter)
'''),
tests("paged_attention_v2_tests", 3, r"""
from course.expect import expect_tensor
case = paged_case([5, 8, 1, 30], H=9, Hkv=3, D=16, block_size=4, seed=7)
for n in (1, 2, 4):
    out = expect_tensor(paged_attention_v2(*case, 0.25, blocks_per_iter=n), f"paged_attention_v2(..., blocks_per_iter={n})",
                        dtype=torch.float32, shape=(4, 9, 16), device=dev)
    diff = (out - paged_attention(*case, 0.25)).abs().max().item()
    assert diff < 1e-4, f"blocks_per_iter={n}: max |diff| {diff:.1e} from the reference (mask the block-table load " \
                        "and the positions past context_len)"
### BEGIN HIDDEN TESTS
""" + HIDDEN_ATTENTION + r"""
for H, Hkv, bs, n, dtype, seed in ((4, 4, 4, 2, torch.float32, 1), (8, 2, 8, 4, torch.float16, 2), (4, 1, 2, 8, torch.float32, 3),
                                   (9, 3, 16, 2, torch.float16, 4), (6, 3, 4, 4, torch.float32, 5)):
    lens = [1, bs, 2 * bs + 1, n * bs, n * bs + 1, 3 * n * bs - 1]
    q, kcache, vcache, bt, cl, ks, vs = _paged_case(lens, H, Hkv, 16, bs, dtype, seed)
    out = expect_tensor(paged_attention_v2(q, kcache, vcache, bt, cl, 0.25, blocks_per_iter=n), f"paged_attention_v2 ({dtype})",
                        dtype=dtype, shape=tuple(q.shape), device=dev)
    err = (out.cpu().double() - _dense(q, ks, vs, 0.25)).abs().max().item()
    tol = 1e-4 if dtype == torch.float32 else 4e-3
    assert err < tol, f"v2, H={H}, Hkv={Hkv}, block_size={bs}, blocks_per_iter={n}, {dtype}: max |diff| {err:.1e} " \
                      "against dense attention (mask the block-table load and the positions past context_len)"
### END HIDDEN TESTS
"""),
md(r"""
### The check: every version against the reference

As in llm.c's `dev/cuda` files: run each version on the same inputs and print its largest difference
from the reference, over fp32 and fp16, MHA (`Hkv = H`), GQA and MQA (`Hkv = 1`), ragged lengths
including 1 and exact multiples of the block size.
"""),
code(r"""
versions = {"v1": paged_attention_v1, "v2 (2 blocks/iter)": lambda *a: paged_attention_v2(*a, blocks_per_iter=2),
            "v2 (4 blocks/iter)": paged_attention_v2}
print(f"{'case':<34}" + "".join(f"{name:>20}" for name in versions))
table = env.pick([(4, 4, 8, torch.float32), (9, 3, 4, torch.float32), (8, 1, 16, torch.float32),
                   (9, 3, 4, torch.float16), (8, 1, 16, torch.float16)], [(9, 3, 4, torch.float32), (8, 1, 16, torch.float16)])
for H, Hkv, bs, dtype in table:
    lens = [1, bs, 2 * bs + 3, 3 * bs]
    case = paged_case(lens, H, Hkv, D=16, block_size=bs, dtype=dtype, seed=bs)
    ref = paged_attention(*case, 0.25).float()
    name = f"H={H} Hkv={Hkv} bs={bs} {str(dtype)[6:]}"
    print(f"{name:<34}" + "".join(f"{(fn(*case, 0.25).float() - ref).abs().max().item():>20.1e}" for fn in versions.values()))
"""),
md(r"""
### Will it compile for a GPU?

The interpreter accepted your kernels; a GPU compiler is stricter. `course.kernels.compile_for_gpu`
compiles a kernel for a GPU target that this machine does not need to have (sm_75 is a T4, sm_80 an
A100), in a separate process without the interpreter. On a T4 use fp16: it has no bf16. Each
compilation takes a few seconds.
"""),
code(r"""
from course.kernels import compile_for_gpu, kernel_source

def paged_signature(dtype, extra=()):
    p = f"*{dtype}"
    sig = {"out_ptr": p, "q_ptr": p, "k_cache_ptr": p, "v_cache_ptr": p, "block_tables_ptr": "*i32",
           "context_lens_ptr": "*i32", "scale": "fp32", "max_blocks": "i32", "H": "constexpr", "H_KV": "constexpr",
           "GROUP": "constexpr", "GROUP_PAD": "constexpr", "BLOCK_SIZE": "constexpr", "D": "constexpr"}
    return {**sig, **{name: "constexpr" for name in extra}}

smollm2 = dict(H=9, H_KV=3, GROUP=3, GROUP_PAD=4, BLOCK_SIZE=16, D=64)
source = kernel_source(paged_attention_v1_kernel, paged_attention_v2_kernel)
checks = env.pick([("v1", 75, "fp16"), ("v1", 80, "fp32"), ("v2", 75, "fp16"), ("v2", 80, "fp32")], [])
if not checks:
    print("skipped in quick mode: each compilation takes seconds (tests/test_paged_kernels.py compiles the solutions)")
for version, arch, dtype in checks:
    name = f"paged_attention_{version}_kernel"
    extra = {"BLOCKS_PER_ITER": 4} if version == "v2" else {}
    error = compile_for_gpu(source, name, paged_signature(dtype, extra), {**smollm2, **extra}, archs=(arch,))[arch]
    print(f"{version} for sm_{arch} ({dtype}):", "compiles" if error is None else f"FAILS\n{error}")
"""),
md(r"""
### Timing

On a GPU: `triton.testing.do_bench` (it warms up, synchronizes and takes the median) for your
PyTorch reference, v1, v2, and, for scale, PyTorch's fused SDPA on keys and values that were
already gathered into a contiguous tensor (the gather itself not counted, so this is a floor for the
attention math, not an equal competitor). On a CPU: one `time.perf_counter` run of each version in
the interpreter, on a small case. **Interpreter time is not performance**: it counts program-iterations
(each costs milliseconds in NumPy), which is why fewer, larger iterations win there.
"""),
code(r"""
import torch.nn.functional as F

if env.gpu:
    lens = [1024] * 32
    case = paged_case(lens, H=cfg.n_head, Hkv=cfg.n_kv_head, D=cfg.head_dim, block_size=16, dtype=torch.float16)
    q, k_cache, v_cache, tables, lengths = case
    kd = torch.stack([k_cache[tables[b].long()].reshape(-1, cfg.n_kv_head, cfg.head_dim)[:1024] for b in range(len(lens))])
    vd = torch.stack([v_cache[tables[b].long()].reshape(-1, cfg.n_kv_head, cfg.head_dim)[:1024] for b in range(len(lens))])
    kd = kd.transpose(1, 2).repeat_interleave(cfg.group_size, 1); vd = vd.transpose(1, 2).repeat_interleave(cfg.group_size, 1)
    scale = cfg.head_dim ** -0.5
    timed = {"PyTorch reference (gather)": lambda: paged_attention(*case, scale),
             "Triton v1": lambda: paged_attention_v1(*case, scale),
             "Triton v2 (4 blocks/iter)": lambda: paged_attention_v2(*case, scale),
             "SDPA on pre-gathered K/V": lambda: F.scaled_dot_product_attention(q[:, :, None], kd, vd, scale=scale)}
    ms = {name: triton.testing.do_bench(fn) for name, fn in timed.items()}
    kv_bytes = 2 * sum(lens) * cfg.n_kv_head * cfg.head_dim * 2
    for name, t in ms.items():
        print(f"{name:>28}: {t * 1e3:8.1f} us   ({kv_bytes / (t * 1e-3) / 1e9:6.0f} GB/s of K/V read)")
else:
    lens = env.pick([256] * 4, [32, 32], cpu=[256] * 4)
    case = paged_case(lens, H=cfg.n_head, Hkv=cfg.n_kv_head, D=cfg.head_dim, block_size=16)
    timed = {"PyTorch reference": lambda: paged_attention(*case, 0.125), "Triton v1 (interpreter)": lambda: paged_attention_v1(*case, 0.125),
             "Triton v2 (interpreter)": lambda: paged_attention_v2(*case, 0.125)}
    interp = {}
    for name, fn in timed.items():
        start = time.perf_counter(); fn(); interp[name] = time.perf_counter() - start
        print(f"{name:>26}: {interp[name] * 1e3:8.1f} ms   (interpreter time, not performance)")
    print(f"{len(lens)} sequences x {cfg.n_kv_head} KV heads = {len(lens) * cfg.n_kv_head} programs; "
          f"v1 runs {len(lens) * cfg.n_kv_head * (lens[0] // 16)} program-iterations, v2 {len(lens) * cfg.n_kv_head * -(-lens[0] // 64)}")
"""),
md(r"""
### Your kernels in the engine

On a GPU, the engine runs with your Triton kernels in place of the PyTorch functions, and must give
the same tokens. In the interpreter a forward pass would launch one slow program per token, layer
and head, so on a CPU this cell only says so.
"""),
code(r"""
if env.gpu:
    texts = ["The capital of France is", "Once upon a time, in a small village by the sea, there lived",
             "def fibonacci(n):", "The three primary colors are", "My trip to Yosemite was", "The quick brown fox"]
    n_req, new_tokens, B = 16, 48, 8
    def workload():
        return [Request(i, tokenizer(texts[i % len(texts)]).input_ids, new_tokens) for i in range(n_req)]
    max_len = max(len(r.prompt) for r in workload()) + new_tokens
    n_blocks = B * -(-max_len // 16)
    contiguous_generate(model, workload()[:2], 2, max_len)                          # warm-up
    runs = {"contiguous (slots)": contiguous_generate(model, workload(), B, max_len),
            "paged (PyTorch reference)": paged_generate(model, workload(), B, n_blocks, 16),
            "paged (your Triton v2)": paged_generate(model, workload(), B, n_blocks, 16,
                                                     attention=paged_attention_v2, write_kv=store_kv)}
    print(f"{n_req} requests x {new_tokens} tokens, batches of {B}, {env.dtype} on {torch.cuda.get_device_name(0)}")
    print("same tokens as the contiguous engine:", runs["paged (your Triton v2)"].outputs == runs["contiguous (slots)"].outputs,
          "" if env.dtype == torch.float32 else f"({env.dtype}: a near-tie can part them)")
    for name, run in runs.items():
        print(f"{name:>28}: {run.throughput:6.1f} tokens/s")
else:
    print("skipped: no GPU here. In the interpreter the engine would take minutes per step; the kernels were checked above.")
"""),
md(r"""
## Summary

- A Triton kernel is the work of one **program**; a **grid** of programs runs in parallel, each finding
  its share from `tl.program_id`. Programs load and store tiles, and **masks** switch off the lanes
  outside the data: past a sequence's length, padded heads, a negative slot.
- The paged decode kernel runs one program per (sequence, KV head), serves a whole GQA group with one
  read of each key, keeps an **online softmax** across blocks, and masks everything past the context.
- Covering several blocks per iteration keeps more memory traffic in flight (and pays the interpreter's
  per-iteration cost fewer times).
- Check every version against a reference, over dtypes, head layouts and ragged lengths; compile for
  the GPUs you do not have; time with the GPU's clock, and compare bytes moved with the bandwidth.

**Questions**
1. Your v1 kernel loads each key once per KV head, not once per query head. By how much does that cut
   the bytes read for SmolLM2 (9 query heads, 3 KV heads)?
2. What does each mask in your kernels protect against? Remove one at a time and rerun the check.
3. How many programs does v1 launch for 32 sequences on SmolLM2? An H100 has 132 streaming
   multiprocessors: is that enough to keep them busy? What about 4 sequences of 8,000 tokens?

## Going further

- **FlashDecoding / split-KV**: for long contexts and few sequences, `(sequence, head)` programs are too
  few to fill a GPU; splitting the context across programs and merging their partial softmaxes fixes it
  (vLLM's "PagedAttention v2" kernel does this).
- **vLLM**'s first CUDA kernel, like your v1, gave each thread group a block at a time; its V1 engine
  moved to a single *unified* Triton attention over mixed prefill and decode batches.
- **FlashInfer** and **FlashAttention**'s paged KV support: the kernels most engines now call.
- Triton's tutorials (`06-fused-attention.py`): the same online softmax, with `tl.dot` on tiles.
"""),
]

write_notebook("labs/06_triton_kernels/06_triton_kernels.ipynb", cells + [md(CHECK_YOUR_WORK)])
print("wrote labs/06_triton_kernels/06_triton_kernels.ipynb")
