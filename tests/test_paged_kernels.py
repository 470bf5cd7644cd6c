"""Lab 06's Triton kernels and the paged engine parts, without a GPU.

1. The solution kernels, taken from the lab's source notebook, compile for GPU targets (sm_75 in
   fp16, as on a T4 without bf16; sm_80 in fp32 and fp16): GPU-only errors that the interpreter
   accepts fail here, in CPU CI. The compile check itself is shown to catch such an error.
2. The same kernels run in the interpreter and match dense attention.
3. `course.engine.PagedKVCache` and `forward_paged` give the contiguous cache's logits.
"""
from __future__ import annotations

import os
import sys
import textwrap

import nbformat
import pytest
import torch

from autograder import lab_notebook
from autograder.checks import SOLUTION_MARKERS
from course.engine import PagedKVCache, SlotKVCache, block_table_tensor, forward_cached, forward_paged
from course.kernels import compile_for_gpu, compile_many
from course.kernels.compile_check import HEADER

LAB = "06_triton_kernels"
KERNEL_CELLS = ("store_kv_kernel", "paged_attention_v1", "paged_attention_v2")
SMOLLM2 = dict(H=9, H_KV=3, GROUP=3, GROUP_PAD=4, BLOCK_SIZE=16, D=64)
MHA = dict(H=4, H_KV=4, GROUP=1, GROUP_PAD=1, BLOCK_SIZE=8, D=32)


def lab_cells() -> dict[str, str]:
    """The lab's cells by nbgrader grade_id, as the instructor wrote them."""
    nb = nbformat.read(lab_notebook(LAB), as_version=4)
    return {c.metadata.get("nbgrader", {}).get("grade_id"): c.source for c in nb.cells}


def solution_source() -> str:
    """The lab's kernel cells as the instructor wrote them (markers removed), as one module."""
    cells = lab_cells()
    body = []
    for gid in KERNEL_CELLS:
        lines = [line for line in cells[gid].splitlines() if not any(m in line for m in SOLUTION_MARKERS)]
        body.append("\n".join(lines))
    return "import torch\n" + HEADER + "\n\n\n".join(body) + "\n"


def paged_signature(dtype: str, extra=()) -> dict:
    p = f"*{dtype}"
    sig = {"out_ptr": p, "q_ptr": p, "k_cache_ptr": p, "v_cache_ptr": p, "block_tables_ptr": "*i32",
           "context_lens_ptr": "*i32", "scale": "fp32", "max_blocks": "i32", "H": "constexpr", "H_KV": "constexpr",
           "GROUP": "constexpr", "GROUP_PAD": "constexpr", "BLOCK_SIZE": "constexpr", "D": "constexpr"}
    return {**sig, **{name: "constexpr" for name in extra}}


@pytest.mark.slow
def test_solution_kernels_compile_for_t4_and_a100():
    jobs = []
    for arch, dtype in ((75, "fp16"), (80, "fp32"), (80, "fp16")):
        jobs.append(("paged_attention_v1_kernel", paged_signature(dtype), SMOLLM2, arch))
        jobs.append(("paged_attention_v2_kernel", paged_signature(dtype, ["BLOCKS_PER_ITER"]),
                     {**SMOLLM2, "BLOCKS_PER_ITER": 4}, arch))
        p = f"*{dtype}"
        jobs.append(("store_kv_kernel", {"k_ptr": p, "v_ptr": p, "k_cache_ptr": p, "v_cache_ptr": p, "slot_ptr": "*i64",
                                         "ROW": "constexpr", "ROW_PAD": "constexpr"}, {"ROW": 192, "ROW_PAD": 256}, arch))
    jobs.append(("paged_attention_v1_kernel", paged_signature("fp16"), MHA, 75))   # GROUP_PAD = 1: a one-row tile
    results = compile_many(solution_source(), jobs)
    failed = [f"{name} sm_{arch} {sig['q_ptr'] if 'q_ptr' in sig else sig['k_ptr']}: {err}"
              for (name, sig, _, arch), err in zip(jobs, results) if err is not None]
    assert not failed, "solution kernels that a GPU compiler rejects:\n" + "\n".join(failed)


@pytest.mark.slow
def test_compile_check_catches_what_the_interpreter_accepts():
    # `break` in a loop runs in the interpreter but is not supported by the GPU compiler
    source = HEADER + textwrap.dedent("""\
        @triton.jit
        def first_negative(x_ptr, out_ptr, n):
            found = -1
            for i in range(0, n):
                if tl.load(x_ptr + i) < 0:
                    found = i
                    break
            tl.store(out_ptr, found)
    """)
    result = compile_for_gpu(source, "first_negative", {"x_ptr": "*fp32", "out_ptr": "*i32", "n": "i32"}, archs=(80,))
    assert list(result) == [80] and result[80] is not None, "a kernel with `break` must fail to compile"
    with pytest.raises(ValueError, match="@triton.jit"):
        compile_for_gpu("x = 1", "x", {})


# --- the kernels in the interpreter ----------------------------------------------------------------

@pytest.fixture(scope="module")
def kernels(tmp_path_factory):
    """The solution module, imported with the interpreter on (TRITON_INTERPRET is read at @triton.jit)."""
    import importlib.util

    path = tmp_path_factory.mktemp("lab06_kernels") / "lab06_kernels.py"
    path.write_text(solution_source() + "\n\n" + lab_cells()["kernel_launch"])   # the lab's own launch_paged
    old = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"       # read at @triton.jit, and again by the first launch: keep it on
    try:
        spec = importlib.util.spec_from_file_location("lab06_kernels", path)
        mod = importlib.util.module_from_spec(spec)
        sys.modules["lab06_kernels"] = mod
        spec.loader.exec_module(mod)
        yield mod
    finally:
        sys.modules.pop("lab06_kernels", None)
        if old is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = old


def _case(lens, H, Hkv, D, bs, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    n_blocks = sum(-(-L // bs) for L in lens) + 2
    k_cache = torch.full((n_blocks, bs, Hkv, D), float("nan"), dtype=dtype)
    v_cache = k_cache.clone()
    free = torch.randperm(n_blocks, generator=g).tolist()
    tables, ks, vs = [], [], []
    for L in lens:
        t = [free.pop() for _ in range(-(-L // bs))]
        k, v = torch.randn(L, Hkv, D, generator=g).to(dtype), torch.randn(L, Hkv, D, generator=g).to(dtype)
        for p in range(L):
            k_cache[t[p // bs], p % bs], v_cache[t[p // bs], p % bs] = k[p], v[p]
        tables.append(t), ks.append(k), vs.append(v)
    q = torch.randn(len(lens), H, D, generator=g).to(dtype)
    return (q, k_cache, v_cache, block_table_tensor(tables), torch.tensor(lens, dtype=torch.int32)), ks, vs


def _dense(q, ks, vs, scale):
    out = []
    for b, (k, v) in enumerate(zip(ks, vs)):
        g = q.shape[1] // k.shape[1]
        s = torch.einsum("hd,lhd->hl", q[b].double(), k.double().repeat_interleave(g, 1)) * scale
        out.append(torch.einsum("hl,lhd->hd", s.softmax(-1), v.double().repeat_interleave(g, 1)))
    return torch.stack(out)


@pytest.mark.parametrize("H, Hkv, bs, dtype", [(4, 4, 4, torch.float32), (9, 3, 8, torch.float16), (8, 1, 2, torch.float32)])
def test_solution_kernels_match_dense_attention_in_the_interpreter(kernels, H, Hkv, bs, dtype):
    args, ks, vs = _case([1, bs, 2 * bs + 1, 4 * bs], H, Hkv, 16, bs, dtype, seed=H)
    ref = _dense(args[0], ks, vs, 0.25)
    tol = 1e-4 if dtype == torch.float32 else 4e-3
    v1 = kernels.launch_paged(kernels.paged_attention_v1_kernel, *args, 0.25)
    v2 = kernels.launch_paged(kernels.paged_attention_v2_kernel, *args, 0.25, BLOCKS_PER_ITER=2)
    for name, out in (("v1", v1), ("v2", v2)):
        assert out.dtype == dtype and (out.double() - ref).abs().max().item() < tol, name


def test_store_kv_kernel_in_the_interpreter(kernels):
    kc, vc = torch.zeros(3, 4, 3, 8), torch.zeros(3, 4, 3, 8)
    k, v = torch.randn(4, 3, 8), torch.randn(4, 3, 8)
    kernels.store_kv(kc, vc, k, v, torch.tensor([3, 4, -1, 11]))
    flat = kc.view(12, 3, 8)
    assert torch.equal(flat[3], k[0]) and torch.equal(flat[4], k[1]) and torch.equal(flat[11], k[3])
    assert flat[[0, 1, 2, 5, 6, 7, 8, 9, 10]].abs().sum() == 0 and torch.equal(vc.view(12, 3, 8)[11], v[3])


# --- the paged engine parts ------------------------------------------------------------------------

def _write(k_cache, v_cache, k, v, slots):
    nb, bs, Hkv, D = k_cache.shape
    k_cache.view(nb * bs, Hkv, D)[slots.long()] = k
    v_cache.view(nb * bs, Hkv, D)[slots.long()] = v


def _attend(q, k_cache, v_cache, tables, lens, scale):
    nb, bs, Hkv, D = k_cache.shape
    out = []
    for b in range(q.shape[0]):
        blocks = tables[b, : -(-int(lens[b]) // bs)].long()
        k = k_cache[blocks].reshape(-1, Hkv, D)[: int(lens[b])].repeat_interleave(q.shape[1] // Hkv, 1)
        v = v_cache[blocks].reshape(-1, Hkv, D)[: int(lens[b])].repeat_interleave(q.shape[1] // Hkv, 1)
        out.append(torch.einsum("hl,lhd->hd", (torch.einsum("hd,lhd->hl", q[b], k) * scale).softmax(-1), v))
    return torch.stack(out)


@pytest.mark.parametrize("family, n_kv", [("llama", 2), ("gpt2", 4)])
def test_forward_paged_equals_the_slot_cache(family, n_kv):
    import course

    torch.manual_seed(0)
    cfg = course.ModelConfig(family=family, vocab_size=50, n_layer=2, n_head=4, n_kv_head=n_kv, d_model=32, d_ff=64,
                             max_seq_len=64)
    model = course.models.init_weights(course.Decoder(cfg), std=0.3)
    paged = PagedKVCache(cfg, n_blocks=8, block_size=3)
    slot = SlotKVCache(cfg, n_slots=2, max_len=20)
    prompts, tables = [[1, 2, 3, 4], [5, 6]], [[6, 2], [0]]          # blocks in no particular order
    fns = dict(write_kv=_write, attention=_attend)
    last = []
    for b, (p, t) in enumerate(zip(prompts, tables)):
        slots = torch.tensor([t[i // 3] * 3 + i % 3 for i in range(len(p))])
        lp = forward_paged(model, torch.tensor([p]), torch.arange(len(p))[None], paged, slots, None, None, **fns)
        lc = forward_cached(model, torch.tensor([p]), torch.arange(len(p))[None], slot, torch.tensor([b]))
        assert torch.allclose(lp, lc, atol=1e-5)
        last.append(int(lp[0, -1].argmax()))
    tables[0].append(5)
    tables[1].append(4)
    for step in range(3):                                            # batched decode, ragged lengths, block boundaries
        pos = [len(p) + step for p in prompts]
        slots = torch.tensor([t[q // 3] * 3 + q % 3 for t, q in zip(tables, pos)])
        ids, position = torch.tensor([[x] for x in last]), torch.tensor([[q] for q in pos])
        lp = forward_paged(model, ids, position, paged, slots, block_table_tensor(tables),
                           torch.tensor([q + 1 for q in pos], dtype=torch.int32), **fns)
        lc = forward_cached(model, ids, position, slot, torch.tensor([0, 1]))
        assert torch.allclose(lp, lc, atol=1e-5), f"decode step {step}"
        last = lp[:, -1].argmax(-1).tolist()


def test_paged_cache_checks_and_copies():
    import course

    cfg = course.ModelConfig(family="llama", vocab_size=50, n_layer=2, n_head=4, n_kv_head=2, d_model=32, d_ff=64,
                             max_seq_len=64)
    cache = PagedKVCache(cfg, n_blocks=4, block_size=2)
    assert cache.k.shape == (2, 4, 2, 2, 8) and cache.bytes_per_block() == 2 * 2 * 2 * 8 * 4 * 2
    cache.k[:, 1] = 3.0
    cache.copy_block(1, 2)
    assert (cache.k[:, 2] == 3).all()
    with pytest.raises(ValueError, match="dst block 7 is out of range"):
        cache.copy_block(1, 7)
    with pytest.raises(ValueError, match="block_size must be a positive int"):
        PagedKVCache(cfg, n_blocks=4, block_size=0)
    assert block_table_tensor([[3, 1], [2]]).tolist() == [[3, 1], [2, 0]]
    model = course.Decoder(cfg)
    with pytest.raises(ValueError, match="prefill takes one sequence at a time"):
        forward_paged(model, torch.zeros(2, 3, dtype=torch.long), torch.zeros(2, 3, dtype=torch.long), cache,
                      torch.zeros(6, dtype=torch.long), None, None, write_kv=_write, attention=_attend)
