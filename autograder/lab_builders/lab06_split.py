"""Lab 06, Problems 4 and 5: split-KV decode attention (Flash-Decoding): stage 1 with tl.dot over a GQA
group's padded rows, stage 2 the log-sum-exp merge; then the check table of every decode version."""
from autograder.authoring import code, locked, md, solution, tests
from autograder.lab_builders.lab06_refs import HIDDEN_ATTENTION, HIDDEN_SPLIT, HIDDEN_TTIR

CELLS = [
md(r"""
## 3. Too few programs: split the context

Each program of v1 and v2 walks a whole sequence for one KV head, so the grid has `B * Hkv` programs.
A GPU spreads programs over its streaming multiprocessors (SMs), and one program runs on one SM: with
fewer programs than SMs, the rest sit idle, and the memory they could be reading from waits. Decode
attention is slowest exactly where this bites: long contexts (much to read) with few sequences.
Count for SmolLM2 (3 KV heads):
"""),
code(r"""
SMS = {"T4": 40, "A100": 108, "H100": 132}      # streaming multiprocessors, from NVIDIA's datasheets
if env.gpu:
    SMS[torch.cuda.get_device_name(0)] = torch.cuda.get_device_properties(0).multi_processor_count
w = max(len(name) for name in SMS) + 17                # each column as wide as its heading, and two spaces
print(f"{'sequences x context':>20} {'v2 programs':>12}" + "".join(f"{'SMs with work, ' + n:>{w}}" for n in SMS))
for B, ctx in ((32, 1024), (8, 8192), (1, 8192)):
    programs = B * cfg.n_kv_head
    print(f"{f'{B} x {ctx}':>20} {programs:>12}" + "".join(f"{min(programs, n) / n:>{w}.0%}" for n in SMS.values()))
"""),
md(r"""
With 8 sequences of 8k tokens, v2 gives work to 24 of an H100's 132 SMs, however fast each program
is. **Split-KV** (Flash-Decoding, Dao et al. 2023; vLLM's "PagedAttention v2"; SGLang's Triton decode
kernel) adds a third grid axis: the context of each sequence is cut into **splits** of `split_len`
tokens, and each split gets its own program. Each program computes attention over its split only, so
its softmax is not the whole softmax; it writes what the merge needs:

```
sequence b, KV head h:  token 0 ............................................................ ctx-1
                        |  split 0   |  split 1   |  split 2   | split 3  |   (split 4: empty)
stage 1, one program    (o_0, lse_0) (o_1, lse_1) (o_2, lse_2) (o_3, lse_3)   (0, -inf)
per split:              o_i: the split's softmax-weighted values, lse_i = log sum_j exp(score_j) over its tokens
stage 2, one program    out = sum_i w_i o_i  with  w = softmax(lse_0, lse_1, ...)   (= exp(lse_i - max) / sum)
per (b, query head):
```

Why the merge is exact: the full softmax over all tokens weights split `i`'s values by
`exp(lse_i) / sum_k exp(lse_k)`, and within the split by exactly `o_i`'s weights. Subtracting the
largest `lse` first (a softmax) keeps `exp` from overflowing. A split that starts past the end of its
sequence (the grid is sized for the longest sequence) is **empty**: `lse = -inf`, weight 0.

**`tl.dot` on the group's rows.** Decode has one query per head, so `q . k` is a matrix-vector product:
no tensor cores. But the `GROUP` query heads of one KV head read the same keys: stack them as the
rows of a tile and a whole tile of keys becomes one matrix product, with each key loaded once for the
group. Some Triton versions refuse a `tl.dot` with fewer than 16 rows, and a tensor-core instruction
covers 16 rows anyway, so the tile has `GROUP_PAD = max(16, next power of 2)` rows, the real heads first and zeros after (SmolLM2: 3 of 16 rows; the padding costs arithmetic,
which decode has to spare, and no memory traffic):

```
   q tile (GROUP_PAD, D)             k tile, transposed (D, TILE)      scores (GROUP_PAD, TILE)
 row 0   query head 3 (KV head 1)   TILE keys of KV head 1, loaded    rows 0-2: real
 row 1   query head 4               once through the block table      rows 3-15: computed, never stored
 row 2   query head 5
 rows 3-15  zeros (masked load)
```

`tl.dot(q, tl.trans(k))` gives the scores and `tl.dot(p, v)` the weighted values, both accumulated in
float32. Give both operands the same dtype: on a GPU the input's (fp16 or bf16, so tensor cores do
the work); in the interpreter float32, because its bf16 `tl.dot` is garbage (the launcher passes
`DOT_F32=True` there). Pass `input_precision="ieee"` so an fp32 `tl.dot` is exact on a GPU too (fp16
and bf16 ignore it).

The reference for both stages, in PyTorch (yours to read; the tests compare your kernels with it):
"""),
locked("split_reference", r'''
def split_reference(q, k_cache, v_cache, block_tables, context_lens, scale, split_len):
    """What stage 1 writes, in PyTorch: for each (sequence, query head, split) the split's softmax-weighted
    values part_out (B, H, n_splits, D) and log-sum-exp part_lse (B, H, n_splits), float32. A split past
    the sequence's end: zeros and -inf. n_splits covers every position the block tables can hold."""
    B, H, D = q.shape
    _, block_size, Hkv, _ = k_cache.shape
    L = block_tables.shape[1] * block_size
    n_splits = -(-L // split_len)
    pos = torch.arange(L, device=q.device)
    valid = pos[None, :] < context_lens[:, None]                                          # (B, L)
    k = k_cache[block_tables.long()].reshape(B, L, Hkv, D).float().repeat_interleave(H // Hkv, 2)   # (B, L, H, D)
    v = v_cache[block_tables.long()].reshape(B, L, Hkv, D).float().repeat_interleave(H // Hkv, 2)
    v = torch.where(valid[:, :, None, None], v, 0.0)                                      # stale slots may hold NaN
    scores = torch.einsum("bhd,blhd->bhl", q.float(), k) * scale                          # (B, H, L)
    part_out = torch.zeros(B, H, n_splits, D, device=q.device)
    part_lse = torch.full((B, H, n_splits), float("-inf"), device=q.device)
    for i in range(n_splits):
        mine = (valid & (pos[None, :] // split_len == i))[:, None, :]                     # (B, 1, L): split i's tokens
        s = scores.masked_fill(~mine, float("-inf"))
        part_lse[:, :, i] = torch.logsumexp(s, dim=-1)                                    # -inf when the split is empty
        w = torch.where(mine, torch.exp(s - part_lse[:, :, i, None]), 0.0)               # (B, H, L)
        part_out[:, :, i] = torch.einsum("bhl,blhd->bhd", w, v)
    return part_out, part_lse


def merge_reference(part_out, part_lse):
    """What stage 2 computes: a softmax over the splits' log-sum-exps weights their outputs. (B, H, D)"""
    return torch.einsum("bhs,bhsd->bhd", torch.softmax(part_lse, dim=-1), part_out)


case = paged_case([5, 8, 1, 30], H=9, Hkv=3, D=16, block_size=4, seed=7)
part_out, part_lse = split_reference(*case, 0.25, split_len=8)
print(f"{part_lse.shape[-1]} splits of 8 tokens; sequence 2 (1 token) has lse {part_lse[2, 0].tolist()}")
print("merged against paged_attention: max |diff|", f"{(merge_reference(part_out, part_lse) - paged_attention(*case, 0.25)).abs().max().item():.1e}")
'''),
md(r"""
## Problem 4: Split-KV decode, stage 1: one program per split, with `tl.dot` (5 points)

Program `(seq, kv_head, split)` covers tokens `start = split * split_len` up to
`end = min(start + split_len, context_len)` (exclusive) of sequence `seq`, `TILE` positions per loop
iteration, for the `GROUP` query heads of `kv_head`. Step by step:

1. the group's query tile `(GROUP_PAD, D)` as in v1 (rows past `GROUP` masked to zeros); if `DOT_F32`,
   convert it to `tl.float32`; from then on load keys and values `.to(q.dtype)`;
2. `for t0 in range(start, end, TILE)`: positions `t0 + tl.arange(0, TILE)`, valid while `< end` (the
   split's end, which may fall inside a block, inside a tile, or be the sequence's end); block ids and
   the gather as in v2; scores `tl.dot(q, tl.trans(k), input_precision="ieee") * scale`, `-inf` where
   not valid; the online softmax of v1, with `acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v, input_precision="ieee")`;
3. after the loop, `lse = m + log(l)` and `o = acc / l`. An empty split (`start >= end`: the loop ran
   zero times) has `m = -inf` and `l = 0`: it must write `o = 0` and `lse = -inf`, never NaN. Divide
   and take the log of `l_safe = tl.where(l > 0, l, 1.0)` instead;
4. store `o` (float32) at row `(seq * H + head) * n_splits + split` of `part_out` (rows of `D`) and `lse` at the
   same index of `part_lse`, **for the real heads only**: the padded rows would land on another KV
   head's queries, or past the end of the buffers.

On a GPU the launcher passes `DOT_F32=False`: then `q`, the key and value tiles and `p` stay in the
input's 16-bit dtype, so that tensor cores multiply them (`tl.dot` still adds up in float32). The tests
take that path too (fp16 in the interpreter, whose fp16 `tl.dot` adds up in float32 as a GPU does),
run bf16 with `DOT_F32=True` (only the conversion saves the interpreter's bf16 arithmetic), and read
the `tl.dot`s of your kernel compiled for an A100.

**Deliverable:** the body of `paged_decode_split_kernel`; `split_stage1` (given) launches it and picks
`split_len`; on a GPU it autotunes `TILE`, `num_warps` and `num_stages` for long contexts. (The two
lines under `if USE_PDL:` at the top of this kernel and the next are given: section 5 explains them.)
"""),
solution("paged_decode_split", r'''
@triton.jit
def paged_decode_split_kernel(part_out_ptr, part_lse_ptr, q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr,
                              context_lens_ptr, scale, max_blocks, split_len, n_splits,
                              H: tl.constexpr, H_KV: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
                              BLOCK_SIZE: tl.constexpr, D: tl.constexpr, TILE: tl.constexpr, DOT_F32: tl.constexpr,
                              USE_PDL: tl.constexpr):
    """Program (seq, kv_head, split): the GROUP query heads of kv_head attend to tokens
    split * split_len .. min((split + 1) * split_len, context_len) - 1 of seq, TILE per iteration, with tl.dot.
    Writes each head's partial output (D,) and log-sum-exp; an empty split writes zeros and -inf."""
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    if USE_PDL:                                  # given (section 5): stage 2 may launch now; it waits for our stores
        tl.extra.cuda.gdc_launch_dependents()
    ### BEGIN SOLUTION
    ctx = tl.load(context_lens_ptr + seq)
    start = split * split_len
    end = tl.minimum(start + split_len, ctx)
    g = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, D)
    j = tl.arange(0, TILE)
    head = kv_head * GROUP + g                                         # (GROUP_PAD,): rows past GROUP are padding
    head_ok = g < GROUP
    q = tl.load(q_ptr + seq * H * D + head[:, None] * D + d[None, :], mask=head_ok[:, None], other=0.0)
    if DOT_F32:
        q = q.to(tl.float32)
    m = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, D], tl.float32)
    for t0 in range(start, end, TILE):
        pos = t0 + j                                                   # (TILE,): token positions
        valid = pos < end
        block = tl.load(block_tables_ptr + seq * max_blocks + pos // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
        offs = (block * BLOCK_SIZE + pos % BLOCK_SIZE)[:, None] * (H_KV * D) + kv_head * D + d[None, :]
        k = tl.load(k_cache_ptr + offs, mask=valid[:, None], other=0.0).to(q.dtype)     # (TILE, D)
        v = tl.load(v_cache_ptr + offs, mask=valid[:, None], other=0.0).to(q.dtype)
        s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale     # (GROUP_PAD, TILE), float32
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        alpha = tl.exp(m - m_new)
        p = tl.exp(s - m_new[:, None])
        l = l * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v, input_precision="ieee")
        m = m_new
    l_safe = tl.where(l > 0, l, 1.0)                                   # an empty split: l = 0, m = -inf
    lse = m + tl.log(l_safe)
    row = (seq * H + head) * n_splits + split
    tl.store(part_out_ptr + row[:, None] * D + d[None, :], acc / l_safe[:, None], mask=head_ok[:, None])
    tl.store(part_lse_ptr + row, lse, mask=head_ok)
    ### END SOLUTION
'''),
locked("split_launch", r'''
# On a GPU, the autotuned kernel times every configuration on its first call for each new key (shapes,
# tokens per split, dtypes) and keeps the fastest; a new shape also compiles each one. That costs
# seconds, so the launchers autotune only contexts of TUNE_FROM tokens or more; shorter ones (the tests,
# short chats) get one fixed configuration. Without a GPU there is nothing to time (autotune fails):
# the interpreter gets TILE = 16.
TUNE_FROM = 512
FIXED_SPLIT = dict(TILE=32, num_warps=4, num_stages=2)              # GPU, shorter contexts
DECODE_CONFIGS = [triton.Config({"TILE": tile}, num_warps=warps, num_stages=stages)
                  for tile, warps, stages in ((32, 2, 2), (64, 4, 2), (64, 4, 3), (128, 4, 3))]
SPLIT_TUNE_KEY = ["H", "H_KV", "GROUP_PAD", "D", "BLOCK_SIZE", "split_len"]
_tuned = {}


def autotuned(kernel, configs, key):
    """`kernel` wrapped in triton.autotune, made on its first use. Running a kernel's cell again makes a new
    kernel, and so a new wrapper here; a wrapper made once up front would go on running the old kernel."""
    if id(kernel) not in _tuned:                  # the wrapper holds the kernel, so its id stays its own
        _tuned[id(kernel)] = triton.autotune(configs, key=key)(kernel)
    return _tuned[id(kernel)]

N_SM = torch.cuda.get_device_properties(0).multi_processor_count if env.gpu else 4


def pdl_available():
    """Programmatic dependent launch (section 5): a GPU of compute capability 9.0 or later (H100, H200) and a
    Triton that has it. Elsewhere, the interpreter included, stage 2 launches after stage 1 as usual."""
    return bool(env.gpu and torch.cuda.get_device_capability(0) >= (9, 0) and hasattr(tl.extra.cuda, "gdc_wait"))

PDL = pdl_available()                          # the launchers' default; pdl=False turns it off for one call


def choose_split_len(batch, n_kv_head, max_ctx, n_sm=N_SM):
    """Tokens per split: enough splits that batch * n_kv_head * n_splits programs give every SM at least two,
    in whole tiles of 128 tokens, never shorter than 128. Rounded down to whole tiles, so there are at
    least that many programs; rounding up gave fewer, longer ones (at 32 x 1k on an H100: 288 programs
    of up to 384 tokens, where rounding down gives 384 programs of 256)."""
    splits = max(1, -(-2 * n_sm // (batch * n_kv_head)))
    per_split = max_ctx // splits
    return max(128, per_split // 128 * 128)


def split_stage1(q, k_cache, v_cache, block_tables, context_lens, scale, split_len=None, out=None, pdl=None):
    """Stage 1: (part_out (B, H, n_splits, D), part_lse (B, H, n_splits)), float32. The splits cover the
    longest context the block tables hold (their width, known without asking the GPU); a shorter
    sequence's last splits are empty. `out`: preallocated (part_out, part_lse) to write into. `pdl`: let
    the next kernel launch early (default PDL)."""
    check_paged_args(q, k_cache, v_cache, block_tables, context_lens)
    B, H, D = q.shape
    _, block_size, Hkv, _ = k_cache.shape
    if D < 16:
        raise ValueError(f"tl.dot needs head_dim >= 16, got {D}")
    max_ctx = block_tables.shape[1] * block_size
    if split_len is None:
        split_len = choose_split_len(B, Hkv, max_ctx)
    if not isinstance(split_len, int) or split_len < 1:
        raise ValueError(f"split_len must be a positive int (tokens per split), got {split_len!r}")
    n_splits = -(-max_ctx // split_len)
    if out is None:
        out = (torch.empty(B, H, n_splits, D, dtype=torch.float32, device=q.device),
               torch.empty(B, H, n_splits, dtype=torch.float32, device=q.device))
    part_out, part_lse = out
    if (part_out.shape != (B, H, n_splits, D) or part_lse.shape != (B, H, n_splits) or not part_out.is_contiguous()
            or not part_lse.is_contiguous() or part_out.dtype != torch.float32 or part_lse.dtype != torch.float32):
        raise ValueError(f"out must be contiguous float32 buffers of shapes {(B, H, n_splits, D)} and {(B, H, n_splits)}")
    group = H // Hkv
    if env.gpu and max_ctx >= TUNE_FROM:
        kernel, meta = autotuned(paged_decode_split_kernel, DECODE_CONFIGS, SPLIT_TUNE_KEY), {}
    else:
        kernel, meta = paged_decode_split_kernel, (FIXED_SPLIT if env.gpu else dict(TILE=16))
    kernel[(B, Hkv, n_splits)](part_out, part_lse, q, k_cache, v_cache, block_tables, context_lens, scale,
                               block_tables.shape[1], split_len, n_splits, H=H, H_KV=Hkv, GROUP=group,
                               GROUP_PAD=max(16, triton.next_power_of_2(group)), BLOCK_SIZE=block_size, D=D,
                               DOT_F32=not q.is_cuda, USE_PDL=PDL if pdl is None else pdl, **meta)
    return part_out, part_lse
'''),
locked("paged_decode_split_build", r'''
# Given: your kernel compiled for an A100 and an H100 (bf16, DOT_F32=False as on a GPU) in the background; the
# tests wait for the compiler
paged_decode_split_build = gpu_compile(paged_decode_split_kernel, dict(H=9, H_KV=3, GROUP=3, GROUP_PAD=16, BLOCK_SIZE=16,
                                                                     D=32, TILE=32, DOT_F32=False, USE_PDL=False))
'''),
tests("paged_decode_split_tests", 5, r"""
from course.expect import expect_tensor

def _check_partials(case, split_len, what, tol=1e-4):
    B, H, D = case[0].shape
    n_splits = -(-case[3].shape[1] * case[1].shape[1] // split_len)
    slack = -(-16 // H) + 1                                   # room for padded rows written past the end
    big_out = torch.full((B + slack, H, n_splits, D), float("nan"), device=dev)
    big_lse = torch.full((B + slack, H, n_splits), float("nan"), device=dev)
    got = split_stage1(*case, 0.25, split_len=split_len, out=(big_out[:B], big_lse[:B]))
    o = expect_tensor(got[0], f"{what}: part_out", dtype=torch.float32, shape=(B, H, n_splits, D), device=dev)
    lse = expect_tensor(got[1], f"{what}: part_lse", dtype=torch.float32, shape=(B, H, n_splits), device=dev)
    assert big_out[B:].isnan().all() and big_lse[B:].isnan().all(), \
        f"{what}: stage 1 wrote past the last sequence: store only the real heads' rows (mask the padded rows)"
    ref_o, ref_lse = split_reference(*case, 0.25, split_len=split_len)
    empty = torch.isinf(ref_lse)
    assert not o.isnan().any(), f"{what}: NaN in part_out (an empty split divides 0 by 0? a load past the split is not masked?)"
    assert (lse[empty] == float("-inf")).all() and (o[empty] == 0).all(), \
        f"{what}: an empty split (it starts past the sequence's end) must write lse = -inf and zeros"
    err_lse = (lse[~empty] - ref_lse[~empty]).abs().max().item()
    err_o = (o - ref_o).abs().max().item()
    assert err_lse < tol and err_o < tol, f"{what}: max |diff| {err_o:.1e} in part_out, {err_lse:.1e} in part_lse " \
                                          "(the split's range start..end, the -inf mask, the online softmax, the row index)"

_check_partials(paged_case([5, 8, 1, 30], H=9, Hkv=3, D=16, block_size=4, seed=7), 8, "GQA 9/3, splits of 8 tokens")
_check_partials(paged_case([3, 17], H=4, Hkv=4, D=16, block_size=4, seed=2), 4, "MHA, a split of one block")
split_compiled = gpu_compiled(paged_decode_split_build, "stage 1 (paged_decode_split_kernel)")   # waits for the compiler
### BEGIN HIDDEN TESTS
""" + HIDDEN_ATTENTION + "\n" + HIDDEN_SPLIT + "\n" + HIDDEN_TTIR + r"""
cases = [(9, 3, 4, 4, torch.float32, [1, 5, 13, 22]),     # a split of one block; contexts ending inside a block
         (8, 1, 8, 3, torch.float16, [2, 8, 25]),         # MQA: a group of 8; splits of 3 tokens, inside blocks and tiles
         (4, 4, 2, 40, torch.float32, [3, 17]),           # MHA (GROUP_PAD 16 for 1 head); one split longer than any context
         (32, 2, 4, 20, torch.float32, [9, 21]),          # a group of 16 rows, no padding; a split that is not whole blocks
         (6, 3, 16, 16, torch.float16, [16, 32, 33])]     # exact block multiples; 3 splits, the last with 1 token
if not env.gpu or env.dtype == torch.bfloat16:               # the interpreter (DOT_F32=True), or a GPU with bf16 (not a T4)
    cases.append((9, 3, 16, 32, torch.bfloat16, [1, 40, 100]))
for H, Hkv, bs, split_len, dtype, lens in cases:
    q, kcache, vcache, bt, cl, ks, vs = _paged_case(lens, H, Hkv, 16, bs, dtype, seed=H + bs)
    n_splits = -(-bt.shape[1] * bs // split_len)
    slack = -(-16 // H) + 1
    big_out = torch.full((len(lens) + slack, H, n_splits, 16), float("nan"), device=dev)
    big_lse = torch.full((len(lens) + slack, H, n_splits), float("nan"), device=dev)
    what = f"H={H}, Hkv={Hkv}, block_size={bs}, split_len={split_len}, {dtype}, lengths {lens}"
    got = split_stage1(q, kcache, vcache, bt, cl, 0.25, split_len=split_len, out=(big_out[:len(lens)], big_lse[:len(lens)]))
    o = expect_tensor(got[0], f"part_out ({what})", dtype=torch.float32, shape=(len(lens), H, n_splits, 16), device=dev)
    lse = expect_tensor(got[1], f"part_lse ({what})", dtype=torch.float32, shape=(len(lens), H, n_splits), device=dev)
    assert big_out[len(lens):].isnan().all() and big_lse[len(lens):].isnan().all(), f"{what}: rows written past the last sequence"
    ref_o, ref_lse = _split_ref(q, ks, vs, 0.25, split_len, n_splits)
    empty = torch.isinf(ref_lse)
    o, lse = o.cpu().double(), lse.cpu().double()
    assert not o.isnan().any() and (lse[empty] == float("-inf")).all() and (o[empty] == 0).all(), \
        f"{what}: empty splits (more splits than the sequence has tokens) must write zeros and -inf, no NaN"
    tol = {torch.float32: 1e-4, torch.float16: 4e-3, torch.bfloat16: 5e-2}[dtype]
    err = max((lse[~empty] - ref_lse[~empty]).abs().max().item(), (o - ref_o).abs().max().item())
    assert err < tol, f"{what}: max |diff| {err:.1e} from the per-split attention " + (
        "(the fp32 and fp16 cases passed: in the interpreter bf16 arithmetic, tl.dot included, is garbage, so the launcher "
        "passes DOT_F32=True here: convert q to float32 if DOT_F32, then load keys and values .to(q.dtype))"
        if dtype == torch.bfloat16 and not env.gpu else "(split boundaries, masks, GQA rows)")
# the path a GPU takes, called as the launcher calls it there: DOT_F32=False, so q, the tiles and p stay fp16 and
# tl.dot multiplies fp16 tiles (adding up in float32, in the interpreter as on a GPU)
q, kcache, vcache, bt, cl, ks, vs = _paged_case([3, 17, 30], 8, 2, 16, 4, torch.float16, seed=21)
n_splits = -(-bt.shape[1] * 4 // 8)
o = torch.full((5, 8, n_splits, 16), float("nan"), device=dev)          # 2 sequences of room for padded rows
lse = torch.full((5, 8, n_splits), float("nan"), device=dev)
what = "stage 1 with DOT_F32=False (what a GPU runs), fp16, H=8, Hkv=2, splits of 8 tokens"
try:
    paged_decode_split_kernel[(3, 2, n_splits)](o, lse, q, kcache, vcache, bt, cl, 0.25, bt.shape[1], 8, n_splits, H=8, H_KV=2,
                                                GROUP=4, GROUP_PAD=16, BLOCK_SIZE=4, D=16, TILE=16, DOT_F32=False, USE_PDL=False)
except Exception as error:
    raise AssertionError(f"{what} fails: {type(error).__name__}: {str(error).strip().splitlines()[-1][:300]}. With DOT_F32 "
                         "False, q stays fp16: load keys and values .to(q.dtype), and give tl.dot p.to(q.dtype)") from None
ref_o, ref_lse = _split_ref(q, ks, vs, 0.25, 8, n_splits)
o, lse = o[:3].cpu().double(), lse[:3].cpu().double()
empty = torch.isinf(ref_lse)
err = max((lse[~empty] - ref_lse[~empty]).abs().max().item(), (o - ref_o).abs().max().item())
assert err < 4e-3 and (lse[empty] == float("-inf")).all() and (o[empty] == 0).all(), \
    f"{what}: max |diff| {err:.1e} from the per-split attention (with DOT_F32 True it was right: what changes is only " \
    "the dtype of q, of the key and value tiles, and of p)"
_f32 = [pair for pair in _tt_dots(split_compiled[0]["ttir"]) if "f32" in pair]
assert not _f32, f"compiled for an A100 in bf16 with DOT_F32=False, your tl.dot multiplies float32 tiles {_f32}: on a GPU " \
    "that means no tensor cores (an A100 multiplies bf16 tiles at 312 TFLOP/s on them, float32 at 19.5 without). " \
    "Convert q to float32 only if DOT_F32, and load keys and values .to(q.dtype)"
### END HIDDEN TESTS
"""),
md(r"""
What your stage 1 wrote for the first case of the tests (splits of 8 tokens), next to the reference:
"""),
code(r'''
case = paged_case([5, 8, 1, 30], H=9, Hkv=3, D=16, block_size=4, seed=7)
part_out, part_lse = split_stage1(*case, 0.25, split_len=8)
ref_out, ref_lse = split_reference(*case, 0.25, split_len=8)
print("lse, sequence 0 (5 tokens), query head 0:", [round(x, 3) for x in part_lse[0, 0].tolist()])
print("reference                               :", [round(x, 3) for x in ref_lse[0, 0].tolist()])
print(f"max |diff| of the partial outputs: {(part_out - ref_out).abs().max().item():.1e}")
'''),
md(r"""
## Problem 5: Split-KV decode, stage 2: merge the splits (2 points)

One program per `(seq, head)`: grid `(B, H)`. It loads the head's `n_splits` log-sum-exps and partial
outputs at once, as a tile of `SPLITS_PAD` rows (the next power of two; the rows past `n_splits` masked:
`-inf` for the lse, 0 for the outputs), then computes the merge of `merge_reference`:

```
M = max_i lse_i        w_i = exp(lse_i - M)        out = sum_i w_i * o_i / sum_i w_i
```

and stores `out` (D,) in the output's dtype at `out_ptr + (seq * H + head) * D`. Empty splits have
`lse = -inf`, so `w = 0`; split 0 is never empty (every context holds at least one token), so `M` is finite.

**Deliverable:** the body of `split_reduce_kernel`; `split_stage2` and `paged_attention_split` (given)
launch it.
"""),
solution("split_reduce", r'''
@triton.jit
def split_reduce_kernel(out_ptr, part_out_ptr, part_lse_ptr, n_splits,
                        H: tl.constexpr, D: tl.constexpr, SPLITS_PAD: tl.constexpr, USE_PDL: tl.constexpr):
    """Program (seq, head): merge the head's n_splits partial outputs by their log-sum-exps into out[seq, head]."""
    seq = tl.program_id(0)
    head = tl.program_id(1)
    if USE_PDL:                                  # given (section 5): launched early, wait until stage 1's stores are done
        tl.extra.cuda.gdc_wait()
    ### BEGIN SOLUTION
    s = tl.arange(0, SPLITS_PAD)
    d = tl.arange(0, D)
    ok = s < n_splits
    row = (seq * H + head) * n_splits + s                              # (SPLITS_PAD,)
    lse = tl.load(part_lse_ptr + row, mask=ok, other=float("-inf"))
    o = tl.load(part_out_ptr + row[:, None] * D + d[None, :], mask=ok[:, None], other=0.0)   # (SPLITS_PAD, D)
    w = tl.exp(lse - tl.max(lse, axis=0))                              # 0 for empty and masked splits
    out = tl.sum(w[:, None] * o, axis=0) / tl.sum(w, axis=0)
    tl.store(out_ptr + (seq * H + head) * D + d, out.to(out_ptr.dtype.element_ty))
    ### END SOLUTION
'''),
locked("split_merge_launch", r'''
def split_stage2(part_out, part_lse, out, pdl=None):
    """Stage 2: merge (B, H, n_splits, D) partial outputs into out (B, H, D), in out's dtype. `pdl`: launch
    it with programmatic dependent launch (default PDL), so it starts while the kernel before it ends."""
    global PDL
    B, H, n_splits, D = part_out.shape
    if part_lse.shape != (B, H, n_splits) or out.shape != (B, H, D) or not (part_out.is_contiguous() and out.is_contiguous()):
        raise ValueError(f"part_out {tuple(part_out.shape)}, part_lse {tuple(part_lse.shape)} and out {tuple(out.shape)} do not fit")
    pdl = PDL if pdl is None else pdl
    launch = lambda pdl: split_reduce_kernel[(B, H)](out, part_out, part_lse, n_splits, H=H, D=D,
                                                     SPLITS_PAD=triton.next_power_of_2(n_splits), USE_PDL=pdl,
                                                     **({"launch_pdl": True} if pdl else {}))   # (an older Triton lacks it)
    try:
        launch(pdl)
    except Exception as error:                 # a driver or Triton that refuses the early launch?
        if not pdl:
            raise
        launch(False)                          # fails too (and raises its error) when the kernel itself is at fault
        PDL = False
        print(f"programmatic dependent launch failed here ({type(error).__name__}: {str(error)[:200]}); "
              "stage 2 launches after stage 1 from now on")
    return out


def paged_attention_split(q, k_cache, v_cache, block_tables, context_lens, scale, split_len=None, pdl=None):
    """Split-KV decode attention (Flash-Decoding): same arguments and result as paged_attention. `pdl`:
    launch stage 2 early where the GPU can (default PDL; section 5)."""
    part_out, part_lse = split_stage1(q, k_cache, v_cache, block_tables, context_lens, scale, split_len, pdl=pdl)
    return split_stage2(part_out, part_lse, torch.empty_like(q), pdl=pdl)
'''),
locked("split_reduce_build", r'''
# Given: your kernel compiled for an A100 and an H100 (bf16 output) in the background; the tests wait for the compiler
split_reduce_build = gpu_compile(split_reduce_kernel, dict(H=9, D=32, SPLITS_PAD=4, USE_PDL=False))
'''),
tests("split_reduce_tests", 2, r"""
from course.expect import expect_tensor
for lens, split_len in (([5, 8, 1, 30], 8), ([7, 2], 3)):            # 4 splits; 3 splits in a tile of 4 rows
    case = paged_case(lens, H=9, Hkv=3, D=16, block_size=4, seed=len(lens))
    part_out, part_lse = split_reference(*case, 0.25, split_len=split_len)     # stage 1 from the reference
    out = expect_tensor(split_stage2(part_out, part_lse, torch.full_like(case[0], float("nan"))), "split_stage2(...)",
                        dtype=torch.float32, shape=(len(lens), 9, 16), device=dev)
    diff = (out - paged_attention(*case, 0.25)).abs().max().item()
    hint = ("NaN: load the rows past n_splits masked (lse other=float('-inf'), o other=0.0), and subtract the largest lse "
            "before exp (it is finite: split 0 always has tokens), so that an empty split weighs exp(-inf) = 0"
            if out.isnan().any() else
            "each split weighs w = exp(lse - max lse), out = sum(w * o) / sum(w); the rows past n_splits must weigh "
            "nothing: load their lse as -inf (other=float('-inf')) and their o as 0")
    assert diff < 1e-4, f"lengths {lens}, {part_lse.shape[-1]} splits of {split_len} tokens: max |diff| {diff:.1e} " \
                        f"from paged_attention: {hint}"
merge_compiled = gpu_compiled(split_reduce_build, "stage 2 (split_reduce_kernel)")   # waits for the compiler started above
### BEGIN HIDDEN TESTS
g = torch.Generator().manual_seed(11)
merge_cases = [(2, 3, 3, 16, torch.float32, 150.0), (3, 2, 5, 32, torch.float16, 0.0), (1, 4, 1, 16, torch.float32, 0.0),
               (2, 2, 8, 16, torch.float32, 150.0), (2, 3, 6, 16, torch.float32, 0.0), (2, 3, 4, 16, torch.float16, 150.0)]
if not env.gpu or env.dtype == torch.bfloat16:               # the interpreter, or a GPU with bf16 (not a T4)
    merge_cases.append((2, 3, 5, 16, torch.bfloat16, 150.0))
for B, H, S, D, dtype, shift in merge_cases:
    o = torch.randn(B, H, S, D, generator=g, dtype=torch.float64, device="cpu")
    lse = torch.randn(B, H, S, generator=g, dtype=torch.float64, device="cpu") * 3 + shift   # exp(150) overflows float32
    if S > 1:
        lse[:, :, -1] = float("-inf"); o[:, :, -1] = 0                                   # an empty split
        lse[0, 0, 1:] = float("-inf"); o[0, 0, 1:] = 0                                   # only split 0 has tokens
    want = torch.einsum("bhs,bhsd->bhd", torch.softmax(lse, dim=-1), o)
    part_out, part_lse = o.float().to(dev).contiguous(), lse.float().to(dev).contiguous()
    got = expect_tensor(split_stage2(part_out, part_lse, torch.full((B, H, D), float("nan"), dtype=dtype, device=dev)),
                        f"split_stage2 ({dtype}, {S} splits)", dtype=dtype, shape=(B, H, D), device=dev)
    err = (got.cpu().double() - want).abs().max().item()
    tol = {torch.float32: 1e-4, torch.float16: 4e-3, torch.bfloat16: 5e-2}[dtype]       # 2 to 4 half-ulps of |out| < 4
    assert err < tol, f"B={B}, H={H}, {S} splits, lse around {shift:g}, {dtype}: max |diff| {err:.1e} from the merge (subtract the largest lse " \
                      "before exp; weight 0 for -inf; mask the rows past n_splits; compute in float32, store in out's dtype)"
### END HIDDEN TESTS
"""),
md(r"""
### The check: every version against the reference

As in llm.c's `dev/cuda` files: run each version on the same inputs and print its largest difference
from the reference, over fp32 and fp16, MHA (`Hkv = H`), GQA and MQA (`Hkv = 1`), ragged lengths
including 1 and exact multiples of the block size. (In the interpreter every version computes in
float32 and rounds to fp16 once at the end, as the reference does, so a difference of 0 in fp16 is no
accident; on a GPU the split-KV kernel multiplies fp16 tiles on tensor cores and differs a little.)
"""),
code(r"""
versions = {"v1": paged_attention_v1, "v2 (4 blocks/iter)": paged_attention_v2,
            "split-KV (splits of 8)": lambda *a: paged_attention_split(*a, split_len=8)}
print(f"{'case':<30}" + "".join(f"{name:>24}" for name in versions))
table = env.pick([(4, 4, 8, torch.float32), (9, 3, 4, torch.float32), (8, 1, 16, torch.float32),
                   (9, 3, 4, torch.float16), (8, 1, 16, torch.float16)], [(9, 3, 4, torch.float32), (8, 1, 16, torch.float16)])
for H, Hkv, bs, dtype in table:
    lens = [1, bs, 2 * bs + 3, 3 * bs]
    case = paged_case(lens, H, Hkv, D=16, block_size=bs, dtype=dtype, seed=bs)
    ref = paged_attention(*case, 0.25).float()
    name = f"H={H} Hkv={Hkv} bs={bs} {str(dtype)[6:]}"
    print(f"{name:<30}" + "".join(f"{(fn(*case, 0.25).float() - ref).abs().max().item():>24.1e}" for fn in versions.values()))
"""),
]
