"""Builds the lab 06 source notebook. Edit this file (or its sections, lab06_*.py), then run from the repo root:

    .venv/bin/python -m autograder.lab_builders.lab06

Sections: this file (introduction, the Triton model, Problem 1), lab06_decode.py (Problems 2-3),
lab06_split.py (Problems 4-5, the check table), lab06_prefill.py (Problem 6, the compile check),
lab06_measure.py (Problem 7, measurements, the engine, summary). Hidden-test references: lab06_refs.py.
"""
from autograder.authoring import code, locked, md, solution, tests, write_notebook  # noqa: E402
from autograder.lab_builders.common_cells import CHECK_YOUR_WORK, COLAB_INSTALL, SETUP  # noqa: E402
from autograder.lab_builders.lab06_decode import CELLS as DECODE  # noqa: E402
from autograder.lab_builders.lab06_measure import CELLS as MEASURE  # noqa: E402
from autograder.lab_builders.lab06_prefill import CELLS as PREFILL  # noqa: E402
from autograder.lab_builders.lab06_refs import HIDDEN_TTIR  # noqa: E402
from autograder.lab_builders.lab06_split import CELLS as SPLIT  # noqa: E402

INTRO = [
md(r"""
# Lab 06: Triton kernels for paged attention

Lab 05 put the KV cache in blocks and read them back with PyTorch: for every sequence, gather its
blocks into a new tensor, then attend. On a GPU that copies the whole context at every layer of every
decode step, in many small operations. Decode attention does little arithmetic per byte it reads
(one multiply-add per key or value element for each query head that shares it), so its speed limit is
the GPU's **memory bandwidth**: the best kernel reads every cached key and value exactly once, at the rate the memory
delivers them. A real engine gets close with one **kernel** that reads the blocks where they are.
In this lab you write those kernels in **Triton**, which compiles Python-like code into GPU kernels,
check each one against a reference, compile them for GPUs you may not have, and measure how close
they come to the bandwidth limit and to PyTorch's own attention.

**You will**
- learn Triton's model (programs, tiles, masks) with a kernel that stores keys and values into their slots;
- write paged decode attention with an online softmax, one block per loop iteration (v1), then several (v2);
- split long contexts across programs (split-KV, "Flash-Decoding"): `tl.dot` on a tile of a GQA group's
  query heads, one load of each key for the whole group, and a second kernel that merges the parts;
- write a FlashAttention-style causal prefill kernel that reads keys and values through the block
  table, also for a chunk of queries after cached tokens;
- count the bytes a kernel must move, time it against the HBM roofline and `scaled_dot_product_attention`,
  and explain the gap with your own numbers.

**Time:** about 4 hours 50 minutes: 45 minutes of reading, seven problems (the split-KV and prefill
kernels take about 50 minutes each, the others 10-40), 20 minutes to write up "Explain the gap", 20
for the Summary questions, and about a minute of running the whole notebook on a laptop CPU (the
interpreter is slow: the tests and demos are sized for it). **Hardware:** any CPU runs every problem in Triton's
interpreter; a GPU (T4, A100, H100) compiles the kernels and times them. In detail:

| | laptop CPU | GPU (T4, A100, H100) |
|---|---|---|
| your kernels | Triton's *interpreter* (NumPy): correct, slow; fp32, fp16, and bf16 once converted to float32 | compiled; fp32, fp16, bf16 (a T4 has no bf16) |
| compile check | each kernel's tests: sm_80 (A100) and sm_90 (H100); the table after Problem 6 adds sm_75 (T4); in a separate process | the same |
| the whole notebook | about a minute on 2 cores (35 s of CPU time, a third of it compiling for GPUs) | 1-2 minutes on an H200, with the engine |
| timing | interpreter time (not performance) and a bytes model | `perf_report` of CUDA-graph replays (`do_bench_cudagraph`) next to SDPA and the memory roofline |
| engine | skipped (minutes per step in the interpreter) | your kernels inside the lab 05 engine |

One caveat for a T4: Triton's README lists NVIDIA GPUs of compute capability 8.0 and up (A100 and
later) as supported, and a T4 is 7.5. Your kernels compile for it (the compile check at the end of
section 4), and PyTorch's own compiler still generates Triton kernels for it, but Triton's
developers do not test it, and this lab has not been run on one: an A100, L4 or H100 is the safer
choice.
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
import torch.nn.functional as F

from course.engine import BlockAllocator, block_table_tensor, paged_attention, write_kv
from course.engine.paged_engine import Request, contiguous_generate, paged_generate

tokenizer = course.load_tokenizer()
model = course.load_model(device=env.device, dtype=env.dtype)
dev, cfg = env.device, model.cfg
print(f"SmolLM2 in {env.dtype} on {dev}: {cfg.n_head} query heads, {cfg.n_kv_head} KV heads, head_dim {cfg.head_dim}")
'''),
md(r"""
## 2. Triton: the programming model

`paged_attention` gathers the blocks of every sequence, padded to the longest block table, into new
float32 tensors, then attends: it copies the whole context at every layer. A real engine runs one kernel that reads the blocks where they are. Like llm.c's
`dev/cuda` files and Triton's own tutorials, this lab has a reference for each kernel, numbered
versions, a check of each version's largest difference from the reference, and then timing.

The Triton model in four lines: you write the work of one **program**; a **grid** of programs runs in
parallel (`kernel[grid](...)`), each finding its share of the work from `tl.program_id(axis)`; a
program loads and stores whole tiles with `tl.load(pointers, mask=...)` and `tl.store`; tile sizes
are `tl.constexpr` powers of two, and **masks** switch off the lanes that fall outside the data.
On a GPU, programs run on the **streaming multiprocessors** (SMs): an H100 SXM has 132 (the PCIe
card 114), an A100 108, a T4 40.

**On a CPU**, `course.setup()` set `TRITON_INTERPRET=1` before anything imported Triton, so every
`@triton.jit` below runs in the interpreter: NumPy executes each program one after the other.
It is how you can write kernels on a laptop, but it has traps:

- it is slow: milliseconds per program per loop iteration (each `tl.sum` or `tl.max` costs a few),
  whatever the tile size. Keep grids and loops small, and read its times as interpreter time, not performance;
- it accepts code that a GPU compiler rejects: `break` or `continue` in a loop, a loop variable whose
  dtype changes between iterations, `math.sqrt` of a runtime argument. Each kernel's tests compile it for
  an A100 and an H100 and catch these, and so does the compile check at the end of section 4;
- a load or store without a mask that falls outside a tensor reads or writes someone else's memory
  without any error (far outside, it crashes the kernel process). Mask every lane that can fall outside;
- `tl.device_assert` does nothing, and bf16 arithmetic (`tl.dot` included) gives silent garbage: load,
  then `.to(tl.float32)`. fp16 and fp32 are fine;
- `tl.dot` works on any tile here, but a GPU needs a depth (the shared dimension) of at least 16, and
  some Triton versions also need 16 rows and columns; and fp32
  `tl.dot` is exact here but TF32 (about 3 decimal digits) on Ampere and later GPUs unless you ask
  for `input_precision="ieee"`;
- `@triton.autotune` (try several configurations, keep the fastest) and `triton.testing.do_bench`
  need a GPU to time on: the launchers below autotune only on a GPU;
- `TRITON_INTERPRET` is read when `@triton.jit` runs: setting it after the kernels are defined does nothing.
"""),
code(r"""
import triton
import triton.language as tl

print(f"triton {triton.__version__}: {'interpreter (CPU)' if env.triton_interpreted else 'compiled for ' + torch.cuda.get_device_name(0)}")
"""),
md(r"""
The tests of each kernel below also compile it for GPUs, whatever machine you are on: the cell after
each kernel starts `gpu_compile` (given here) in the background, and its test waits for the compiler's
verdict with `gpu_compiled` while it checks the kernel in the interpreter.
"""),
locked("gpu_compile", r'''
from course.kernels import compile_error_summary, kernel_source, start_compile_report

# each kernel argument as a GPU compile sees it, by name: bf16 tensors (what an A100 or an H100 runs)
GPU_TYPES = {"k_ptr": "*bf16", "v_ptr": "*bf16", "k_cache_ptr": "*bf16", "v_cache_ptr": "*bf16", "slot_ptr": "*i64",
             "out_ptr": "*bf16", "q_ptr": "*bf16", "block_tables_ptr": "*i32", "block_table_ptr": "*i32",
             "context_lens_ptr": "*i32", "scale": "fp32", "max_blocks": "i32", "part_out_ptr": "*fp32",
             "part_lse_ptr": "*fp32", "split_len": "i32", "n_splits": "i32", "n_q": "i32", "ctx": "i32"}


def gpu_compile(kernel, constexprs, archs=(80, 90), also=()):
    """Start compiling `kernel` for GPUs (sm_80: an A100, sm_90: an H100), its arguments typed as in GPU_TYPES,
    in a separate process without the interpreter; `also`: more sm_80 compilations, each with some of the
    types changed ({"slot_ptr": "*i32"}). Returns at once; gpu_compiled waits for the compiler."""
    name = getattr(kernel, "fn", kernel).__name__
    typed = lambda types: {a: "constexpr" if a in constexprs else {**GPU_TYPES, **types}[a] for a in kernel.arg_names}
    jobs = [(name, typed(types), constexprs, arch, {"num_warps": 4, "num_stages": 3})
            for arch, types in [(arch, {}) for arch in archs] + [(80, types) for types in also]]
    return jobs, start_compile_report(kernel_source(kernel), jobs, ttir=True)


def gpu_compiled(build, what):
    """Wait for a gpu_compile; fail with the compiler's message where a GPU rejects the kernel. Returns the
    report of each target (course.kernels.compile_report's)."""
    jobs, job = build
    reports = job.result()
    for (_, sig, _, arch, _), r in zip(jobs, reports):
        dtype = next((t[1:] for t in sig.values() if t in ("*bf16", "*fp16")), "")
        gpu = {75: "a T4", 80: "an A100", 90: "an H100"}.get(arch, "a GPU")
        assert r["error"] is None, f"the interpreter runs your {what}, but it does not compile for sm_{arch} ({gpu}, " \
                                   f"{dtype}): {compile_error_summary(r['error'])}"
    return reports
'''),
md(r"""
## Problem 1: Warm-up: a kernel that writes K/V into slots (2 points)

The first kernel replaces `write_kv`. One program per new token: it reads the token's slot, then
copies the token's `Hkv * D` key values and value values into that slot's row of the caches. Seen
flat, token `i`'s keys start at `k_ptr + i * ROW` and slot `s` starts at `k_cache_ptr + s * ROW`, with
`ROW = Hkv * D`. `tl.arange` needs a power of two, and SmolLM2's row is 192 values, so the tile is
`ROW_PAD = 256` lanes and a mask switches off the last 64. The same mask switches off a token whose
slot is negative. Convert the slot to `tl.int64` before multiplying: a big pool overflows 32 bits
(engines may hand you the slots as int32, and the tests compile your kernel for that too).

From here on, each kernel's tests also compile it for an A100 (sm_80) and an H100 (sm_90) in bf16, in a
separate process without the interpreter (a few seconds): the interpreter runs code that a GPU
compiler rejects (section 2 lists what), and a kernel that runs only in the interpreter is not done.

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
locked("store_kv_build", r'''
# Given: your kernel compiled for an A100 and an H100 (bf16), and once more for slots handed over as int32 (as
# some engines do), in the background; the tests wait for the compiler
store_kv_build = gpu_compile(store_kv_kernel, dict(ROW=192, ROW_PAD=256), also=[{"slot_ptr": "*i32"}])
'''),
tests("store_kv_tests", 2, r"""
kc, vc = torch.zeros(4, 4, 3, 8, device=dev), torch.zeros(4, 4, 3, 8, device=dev)   # 4 blocks of 4 slots, Hkv=3, D=8: ROW=24
k, v = torch.randn(5, 3, 8, device=dev), torch.randn(5, 3, 8, device=dev)
slots = torch.tensor([3, 4, 15, -1, 0], device=dev)                                 # 3 | 4: a block boundary; -1: skip
store_kv(kc, vc, k, v, slots)
ref_k, ref_v = torch.zeros_like(kc), torch.zeros_like(vc)
write_kv(ref_k, ref_v, k, v, slots)
for name, got, want in (("key cache", kc, ref_k), ("value cache", vc, ref_v)):
    assert torch.equal(got, want), f"the {name} differs from what write_kv writes: each token's row of " \
        f"{'k' if name == 'key cache' else 'v'} into its slot's row, all ROW values (mask only the padding), nothing for slot -1"
store_kv_compiled = gpu_compiled(store_kv_build, "store_kv_kernel")   # waits for the compiler started above
### BEGIN HIDDEN TESTS
""" + HIDDEN_TTIR + r"""
store_cases = [(1, 16, torch.float16), (2, 4, torch.float32), (4, 8, torch.float32)]
if not env.gpu or env.dtype == torch.bfloat16:               # the interpreter, or a GPU with bf16 (not a T4)
    store_cases.append((3, 8, torch.bfloat16))
for Hkv, D, dtype in store_cases:
    kc = torch.full((3, 2, Hkv, D), -9.0, dtype=dtype, device=dev); vc = kc.clone()
    k = torch.randn(6, Hkv, D, device=dev).to(dtype); v = torch.randn(6, Hkv, D, device=dev).to(dtype)
    slots = torch.tensor([1, 2, -1, 5, 0, 4], device=dev)
    store_kv(kc, vc, k, v, slots)
    fk, fv = kc.view(6, Hkv, D), vc.view(6, Hkv, D)
    for i, s in enumerate(slots.tolist()):
        if s >= 0:
            assert torch.equal(fk[s], k[i]) and torch.equal(fv[s], v[i]), f"Hkv={Hkv}, D={D}: token {i} belongs in slot {s}"
    assert (fk[3] == -9).all() and (fv[3] == -9).all(), "slot 3 was given to no token: it must not change (mask the padded lanes)"
# compiled for int32 slots (the third compilation), its Triton IR shows whether the slot is multiplied by ROW in 32 bits
assert not _slot_products_in_32_bits(store_kv_compiled[2]["ttir"]), \
    "compiled for an int32 slot mapping, your kernel multiplies the slot by ROW in 32 bits: past 2**31 values " \
    "(11 million slots of SmolLM2's 192-value rows, 4 GiB of bf16 cache) the address wraps around and the store lands " \
    "in another slot. Convert the slot with .to(tl.int64) right after loading it, before multiplying"
### END HIDDEN TESTS
"""),
]

cells = INTRO + DECODE + SPLIT + PREFILL + MEASURE

if __name__ == "__main__":
    write_notebook("labs/06_triton_kernels/06_triton_kernels.ipynb", cells + [md(CHECK_YOUR_WORK)])
    print("wrote labs/06_triton_kernels/06_triton_kernels.ipynb")
