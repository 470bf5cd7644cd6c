"""Lab 06's Triton kernels, and the paged engine parts, on a CPU and on a GPU.

1. The solution kernels, taken from the lab's source notebook, compile for GPU targets: sm_75 in fp16
   (a T4, which has no bf16), sm_80 in fp32, fp16 and bf16, sm_90 in bf16, with every configuration the
   launchers autotune over on a GPU. GPU-only errors that the interpreter accepts fail here, in CPU CI;
   the compile check itself is shown to catch such an error.
2. The kernels run in the interpreter and match independent dense references (float64), through the
   lab's own launchers: edge cases of blocks, splits, chunks and GQA groups.
3. On a machine with CUDA, the same kernels run COMPILED against the same references in fp32, fp16
   and bf16, autotuned. conftest.py sets TRITON_INTERPRET=1 for the whole session (Triton reads it
   once), so that check runs this file as a script in a subprocess without it:
       python tests/test_paged_kernels.py --device cuda      (what the test runs; prints one line per check)
   Skipped on a machine without CUDA.
4. `course.engine.PagedKVCache` and `forward_paged` give the contiguous cache's logits.
5. `course.kernels.run_perf_report` sweeps a `triton.testing.perf_report` benchmark as Triton does,
   with pandas or without it.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest
import torch

from autograder.lab_kernels import lab_source, load_lab_module
from course.engine import PagedKVCache, SlotKVCache, block_table_tensor, forward_cached, forward_paged
from course.kernels import compile_for_gpu, compile_report
from course.kernels.compile_check import HEADER
from course.tolerance import assert_orders_close, for_decoder

# The GPU proof runs this file with TRITON_INTERPRET=0 on a CUDA machine: there the compiled check (3.)
# covers the kernels, and this session does not switch the interpreter on halfway (see conftest.py).
COMPILED_SESSION = torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET", "0") in ("", "0")
interpreter_only = pytest.mark.skipif(COMPILED_SESSION, reason="a compiled (GPU) session: see the compiled check")
REPO = Path(__file__).resolve().parents[1]


# --- 1. the compile check --------------------------------------------------------------------------

SMOLLM2 = dict(H=9, H_KV=3, BLOCK_SIZE=16, D=64)
TARGETS = ((75, "fp16"), (80, "fp32"), (80, "fp16"), (80, "bf16"), (90, "bf16"))
SHARED_LIMIT = {75: 64 * 1024, 80: 163 * 1024, 90: 227 * 1024}   # bytes of shared memory per block (CUDA guide: T4, A100, H100)


def _signature(kernel: str, dtype: str) -> dict:
    p, f32 = f"*{dtype}", "*fp32"
    paged = {"q_ptr": p, "k_cache_ptr": p, "v_cache_ptr": p, "block_tables_ptr": "*i32", "context_lens_ptr": "*i32",
             "scale": "fp32", "max_blocks": "i32"}
    sigs = {"store_kv_kernel": {"k_ptr": p, "v_ptr": p, "k_cache_ptr": p, "v_cache_ptr": p, "slot_ptr": "*i64"},
            "paged_attention_v1_kernel": {"out_ptr": p, **paged},
            "paged_attention_v2_kernel": {"out_ptr": p, **paged},
            "paged_decode_split_kernel": {"part_out_ptr": f32, "part_lse_ptr": f32, **paged, "split_len": "i32",
                                          "n_splits": "i32"},
            "split_reduce_kernel": {"out_ptr": p, "part_out_ptr": f32, "part_lse_ptr": f32, "n_splits": "i32"},
            "paged_prefill_kernel": {"out_ptr": p, "q_ptr": p, "k_cache_ptr": p, "v_cache_ptr": p,
                                     "block_table_ptr": "*i32", "scale": "fp32", "n_q": "i32", "ctx": "i32"}}
    return sigs[kernel]


def _jobs(configs_split, configs_prefill) -> list[tuple]:
    """(kernel, signature, constexprs, arch, options) for every kernel and target, and every autotuning
    configuration on the targets a GPU runs in the model's dtype (T4 fp16, A100 and H100 bf16)."""
    constexprs = {
        "store_kv_kernel": [dict(ROW=192, ROW_PAD=256)],
        "paged_attention_v1_kernel": [dict(SMOLLM2, GROUP=3, GROUP_PAD=4),
                                      dict(H=4, H_KV=4, BLOCK_SIZE=8, D=32, GROUP=1, GROUP_PAD=1)],   # a one-row tile
        "paged_attention_v2_kernel": [dict(SMOLLM2, GROUP=3, GROUP_PAD=4, BLOCKS_PER_ITER=4)],
        "split_reduce_kernel": [dict(H=9, D=64, SPLITS_PAD=8, USE_PDL=False), dict(H=9, D=64, SPLITS_PAD=1, USE_PDL=False)],
        "paged_decode_split_kernel": [dict(SMOLLM2, GROUP=3, GROUP_PAD=16, DOT_F32=False, USE_PDL=False, **configs_split[0]),
                                      dict(SMOLLM2, H=32, H_KV=1, GROUP=32, GROUP_PAD=32, DOT_F32=False, USE_PDL=False,
                                           **configs_split[0])],
        "paged_prefill_kernel": [dict(SMOLLM2, DOT_F32=False, **c) for c in configs_prefill[:1]],
    }
    jobs = []
    for kernel, variants in constexprs.items():
        for arch, dtype in TARGETS:
            for i, cx in enumerate(variants):
                if i and (arch, dtype) != (75, "fp16"):             # the odd shapes on one target are enough
                    continue
                cx = dict(cx)
                if "USE_PDL" in cx:
                    cx["USE_PDL"] = arch >= 90                          # Hopper: with programmatic dependent launch
                options = {"num_warps": cx.pop("num_warps", 4), "num_stages": cx.pop("num_stages", 3)}
                sig = {**_signature(kernel, dtype), **{name: "constexpr" for name in cx}}
                jobs.append((kernel, sig, cx, arch, options))
    for arch, dtype in ((75, "fp16"), (80, "bf16"), (90, "bf16")):
        for kernel, configs, base in (("paged_decode_split_kernel", configs_split, dict(SMOLLM2, GROUP=3, GROUP_PAD=16)),
                                      ("paged_prefill_kernel", configs_prefill, dict(SMOLLM2))):
            for c in configs[1:]:
                c = dict(c)
                options = {"num_warps": c.pop("num_warps"), "num_stages": c.pop("num_stages")}
                cx = {**base, **c, "DOT_F32": False}
                if kernel == "paged_decode_split_kernel":
                    cx["USE_PDL"] = arch >= 90
                jobs.append((kernel, {**_signature(kernel, dtype), **{n: "constexpr" for n in cx}}, cx, arch, options))
    return jobs


def _configs(tuned_configs) -> list[dict]:
    return [{**c.kwargs, "num_warps": c.num_warps, "num_stages": c.num_stages} for c in tuned_configs]


@pytest.mark.slow
def test_solution_kernels_compile_for_t4_a100_and_h100(kernels):
    jobs = _jobs([kernels.FIXED_SPLIT] + _configs(kernels.DECODE_CONFIGS),
                 [kernels.FIXED_PREFILL] + _configs(kernels.PREFILL_CONFIGS))
    report = compile_report(lab_source(gpu=False), jobs, timeout=1200)
    failed = [f"{name} sm_{arch} {sig.get('q_ptr', sig.get('k_ptr'))} {cx} {opt}: {r['error']}"
              for (name, sig, cx, arch, opt), r in zip(jobs, report) if r["error"] is not None]
    assert not failed, "solution kernels that a GPU compiler rejects:\n" + "\n".join(failed)
    # every configuration fits the shared memory one program may take (a launch over it fails with OutOfResources:
    # the autotuner would skip such a configuration, but the fixed ones have no fallback)
    too_big = [f"{name} sm_{arch} {cx} {opt}: {r['shared']} bytes > {SHARED_LIMIT[arch]}"
               for (name, sig, cx, arch, opt), r in zip(jobs, report) if r["shared"] > SHARED_LIMIT[arch]]
    assert not too_big, "configurations that need more shared memory than the GPU gives a program:\n" + "\n".join(too_big)
    # the split-KV and prefill kernels use tensor cores where Triton's tl.dot has them (sm_80 and later, 16-bit)
    for (name, sig, cx, arch, opt), r in zip(jobs, report):
        if name in ("paged_decode_split_kernel", "paged_prefill_kernel") and arch >= 80 and sig["q_ptr"] != "*fp32":
            assert r["mma"] + r["wgmma"] > 0, f"{name} sm_{arch} {sig['q_ptr']}: no tensor-core instruction in the PTX"
    # the split-KV pair holds griddepcontrol exactly where it is compiled with USE_PDL (sm_90), and nowhere else
    pdl = [(name, arch, cx["USE_PDL"], r["gdc"]) for (name, sig, cx, arch, opt), r in zip(jobs, report) if "USE_PDL" in cx]
    assert {(n, a) for n, a, use, _ in pdl if use} >= {("paged_decode_split_kernel", 90), ("split_reduce_kernel", 90)}
    wrong = [(n, a, use, gdc) for n, a, use, gdc in pdl if (gdc > 0) != use]
    assert not wrong, f"griddepcontrol in the PTX where USE_PDL is off, or missing where it is on: {wrong}"
    # stage 2 reads stage 1's results: its wait must come before every load (a Triton that hoisted a load
    # above it would read partial results; Triton issue 11905 reports such a hoist for a wait inside a loop)
    waits = [(arch, r["gdc_wait_first"]) for (name, sig, cx, arch, opt), r in zip(jobs, report)
             if name == "split_reduce_kernel" and cx.get("USE_PDL")]
    assert waits and all(first is True for _, first in waits), f"stage 2's gdc_wait is not before its loads: {waits}"


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
    with pytest.raises(ValueError, match="arch must be"):
        compile_report(source, [("first_negative", {}, {}, "sm_80")])


@pytest.mark.slow
def test_compile_report_says_whether_the_gdc_wait_comes_first():
    source = HEADER + textwrap.dedent("""\
        @triton.jit
        def load_then_wait(x_ptr, y_ptr):
            a = tl.load(x_ptr)
            tl.extra.cuda.gdc_wait()
            tl.store(y_ptr, a + tl.load(x_ptr + 1))

        @triton.jit
        def wait_then_load(x_ptr, y_ptr):
            tl.extra.cuda.gdc_wait()
            tl.store(y_ptr, tl.load(x_ptr))

        @triton.jit
        def no_wait(x_ptr, y_ptr):
            tl.store(y_ptr, tl.load(x_ptr))
    """)
    sig = {"x_ptr": "*fp32", "y_ptr": "*fp32"}
    names = ("load_then_wait", "wait_then_load", "no_wait")
    report = compile_report(source, [(n, sig, {}, 90) for n in names], ptx=True)
    assert [(r["error"], r["gdc_wait_first"]) for r in report] == [(None, False), (None, True), (None, None)], report
    assert ["griddepcontrol.wait" in r["ptx"] for r in report] == [True, True, False]
    assert "ptx" not in compile_report(source, [("no_wait", sig, {}, 90)])[0]


def test_compile_error_summary_names_the_mistake():
    from course.kernels import compile_error_summary

    brk = ("UnsupportedLanguageConstruct: at 6:12:\ndef f(x_ptr, n):\n    for i in range(0, n):\n        if i > 3:\n"
           "            break\n            ^\nunsupported AST node type: Break")
    said = compile_error_summary(brk)
    assert said.startswith("UnsupportedLanguageConstruct: unsupported AST node type: Break (at `break`); ")
    assert "`break` inside a loop is not supported by Triton's compiler" in said
    dot = ("CompilationError: at 5:53:\ndef g(a_ptr):\n    x = tl.dot(a, b)\n        ^\n"
           "Both operands must be same dtype. Got fp16 and fp32")
    assert "tl.dot need the same dtype" in compile_error_summary(dot) and "(at `x = tl.dot(a, b)`)" in compile_error_summary(dot)
    assert compile_error_summary("RuntimeError: something new") == "RuntimeError: RuntimeError: something new"
    assert compile_error_summary("") == "the compiler failed without a message"


def test_kernel_source_brings_the_jit_helpers_a_kernel_calls(tmp_path):
    """A student's kernel may call a @triton.jit helper of the same cell: the compile check needs its source too."""
    import importlib.util

    from course.kernels import kernel_source

    (tmp_path / "helpers_mod.py").write_text(HEADER + textwrap.dedent("""\
        @triton.jit
        def _twice(x):
            return _plus(x, x)

        @triton.jit
        def _plus(a, b):
            return a + b

        @triton.jit
        def kernel(x_ptr):
            tl.store(x_ptr, _twice(tl.load(x_ptr)))
    """))
    spec = importlib.util.spec_from_file_location("helpers_mod", tmp_path / "helpers_mod.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    source = kernel_source(mod.kernel)
    assert [line for line in source.splitlines() if line.startswith("def ")] == ["def kernel(x_ptr):", "def _twice(x):",
                                                                                 "def _plus(a, b):"]
    compile(source, "kernel_source", "exec")


@pytest.mark.slow
def test_the_hidden_tests_read_int32_slots_and_float32_dots_in_the_compiled_code(kernels):
    """Lab 06's hidden tests (autograder/lab_builders/lab06_refs.py) find, in the Triton IR of a kernel compiled for
    an A100, a slot multiplied in 32 bits (store_kv) and a tl.dot on float32 tiles with DOT_F32=False (split-KV),
    and only those: the lab's solutions pass, the usual ways of getting it wrong do not."""
    from autograder.lab_builders.lab06_refs import HIDDEN_TTIR
    from course.kernels import kernel_source

    checks = {}
    exec(HIDDEN_TTIR, checks)
    store = kernel_source(kernels.store_kv_kernel)
    cast = "    slot = tl.load(slot_ptr + token).to(tl.int64)"
    variants = {"store_kv_kernel": "",
                "store_int32": "    slot = tl.load(slot_ptr + token).to(tl.int32)",
                "store_uncast": "    slot = tl.load(slot_ptr + token)",
                "store_late": "    slot = tl.load(slot_ptr + token)\n    slot = (slot * ROW).to(tl.int64) // ROW"}
    assert cast in store
    source = store + "".join("\n\n" + store[len(HEADER):].replace("def store_kv_kernel(", f"def {name}(").replace(cast, new)
                             for name, new in variants.items() if new)
    split = kernel_source(kernels.paged_decode_split_kernel)
    conditional = "    if DOT_F32:\n        q = q.to(tl.float32)"
    assert conditional in split
    source += "\n\n" + split[len(HEADER):] + "\n\n" + split[len(HEADER):].replace(
        "def paged_decode_split_kernel(", "def split_always_f32(").replace(conditional, "    q = q.to(tl.float32)")
    store_cx = dict(ROW=192, ROW_PAD=256)
    store_sig = {**_signature("store_kv_kernel", "bf16"), "slot_ptr": "*i32", **{n: "constexpr" for n in store_cx}}
    split_cx = dict(SMOLLM2, D=32, GROUP=3, GROUP_PAD=16, TILE=32, DOT_F32=False, USE_PDL=False)
    split_sig = {**_signature("paged_decode_split_kernel", "bf16"), **{n: "constexpr" for n in split_cx}}
    jobs = ([(name, store_sig, store_cx, 80) for name in variants]
            + [(name, split_sig, split_cx, 80) for name in ("paged_decode_split_kernel", "split_always_f32")])
    report = compile_report(source, jobs, ttir=True)
    assert all(r["error"] is None for r in report), [r["error"] for r in report]
    narrow = {name: bool(checks["_slot_products_in_32_bits"](r["ttir"])) for (name, *_), r in zip(jobs, report)
              if name.startswith("store")}
    assert narrow == {"store_kv_kernel": False, "store_int32": True, "store_uncast": True, "store_late": True}, narrow
    dots = {name: checks["_tt_dots"](r["ttir"]) for (name, *_), r in zip(jobs, report) if name.startswith(("paged", "split"))}
    assert dots == {"paged_decode_split_kernel": [("bf16", "bf16")] * 2, "split_always_f32": [("f32", "f32")] * 2}, dots


def test_run_perf_report_sweeps_like_triton(monkeypatch):
    import matplotlib
    import triton

    from course.kernels import run_perf_report

    matplotlib.use("Agg")
    monkeypatch.setattr("matplotlib.pyplot.show", lambda *a, **k: None)
    bench = triton.testing.Benchmark(x_names=["ctx"], x_vals=[256, 1024], line_arg="provider", line_vals=["a", "b"],
                                     line_names=["mine", "theirs"], ylabel="GB/s", plot_name="test", args={"batch": 2})
    calls = []

    @triton.testing.perf_report([bench])
    def speed(ctx, batch, provider):
        calls.append((ctx, batch, provider))
        return (float(ctx * batch), ctx * batch * 0.9, ctx * batch * 1.1) if provider == "a" else 1.0

    rows = run_perf_report(speed, print_data=False)
    assert calls == [(256, 2, "a"), (256, 2, "b"), (1024, 2, "a"), (1024, 2, "b")], calls
    assert [{k: float(v) for k, v in r.items()} for r in rows[0]] == [{"ctx": 256.0, "mine": 512.0, "theirs": 1.0},
                                                                      {"ctx": 1024.0, "mine": 2048.0, "theirs": 1.0}]
    with pytest.raises(TypeError, match="perf_report"):
        run_perf_report(lambda: None)


# --- 2. the kernels in the interpreter -------------------------------------------------------------

@pytest.fixture(scope="module")
def kernels(tmp_path_factory):
    """The lab's kernels and launchers, imported with the interpreter on (read at @triton.jit); in a
    compiled session, imported as they are (only their configurations are read there)."""
    old = os.environ.get("TRITON_INTERPRET")
    if not COMPILED_SESSION:
        os.environ["TRITON_INTERPRET"] = "1"   # read at @triton.jit, and again by the first launch: keep it on
    try:
        yield load_lab_module(gpu=False, directory=tmp_path_factory.mktemp("lab06_kernels"))
    finally:
        sys.modules.pop("lab06_kernels_cpu", None)
        if old is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = old


def _case(lens, H, Hkv, D, bs, dtype, seed=0, device="cpu"):
    """Dense K/V per sequence scattered into shuffled blocks (unused slots NaN); q (B, H, D)."""
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
    args = (q, k_cache, v_cache, block_table_tensor(tables), torch.tensor(lens, dtype=torch.int32))
    return tuple(a.to(device) for a in args), ks, vs


def _dense(q, ks, vs, scale):
    out = []
    for b, (k, v) in enumerate(zip(ks, vs)):
        g = q.shape[1] // k.shape[1]
        s = torch.einsum("hd,lhd->hl", q[b].cpu().double(), k.double().repeat_interleave(g, 1)) * scale
        out.append(torch.einsum("hl,lhd->hd", s.softmax(-1), v.double().repeat_interleave(g, 1)))
    return torch.stack(out)


def _causal(q, k, v, scale):
    T, H, _ = q.shape
    L, g = k.shape[0], H // k.shape[1]
    s = torch.einsum("thd,lhd->htl", q.cpu().double(), k.double().repeat_interleave(g, 1)) * scale
    seen = torch.arange(L)[None, :] <= torch.arange(L - T, L)[:, None]
    return torch.einsum("htl,lhd->thd", s.masked_fill(~seen, float("-inf")).softmax(-1), v.double().repeat_interleave(g, 1))


# Kernels vs a float64 reference, outputs |o| <= ~4 (softmax-weighted randn values); a bug is off by ~1.
# float32: sums of up to 1024 terms in the kernel's order, tens of ulps of |o| (about 1e-5; course/tolerance.py);
# fp16/bf16: probabilities and outputs rounded to 11 or 8 bits, a few half-ulps at |o| ~ 4 (1e-3, 1e-2 each).
TOL = {torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 5e-2}


def _decode_checks(mod, dtypes, device, small: bool):
    """(name, max |diff|, tolerance) of every decode kernel over edge cases, each dtype."""
    results = []
    for dtype in dtypes:
        cases = [(9, 3, 4, [1, 4, 9, 22]), (8, 1, 8, [2, 8, 25])]       # the interpreter: a few small cases
        if not small:
            cases += [(4, 4, 2, [3, 17]), (9, 3, 16, [1, 16, 17, 300, 1024]), (32, 4, 16, [700, 33])]
        for H, Hkv, bs, lens in cases:
            args, ks, vs = _case(lens, H, Hkv, 16 if small else 64, bs, dtype, seed=H + bs, device=device)
            scale = args[0].shape[-1] ** -0.5
            ref = _dense(args[0], ks, vs, scale)
            what = f"H={H} Hkv={Hkv} bs={bs} {lens} {dtype}"
            outs = {"v1": mod.paged_attention_v1(*args, scale), "v2": mod.paged_attention_v2(*args, scale, blocks_per_iter=2)}
            # one block per split, splits of 3 tokens (inside blocks and tiles); long contexts: the launcher's choice, 40
            for split_len in ((bs, 3) if max(lens) <= 64 else (None, bs, 40)):
                outs[f"split-KV (split_len {split_len})"] = mod.paged_attention_split(*args, scale, split_len=split_len)
            if mod.PDL:                                                  # a Hopper GPU: the default launched stage 2 early
                outs["split-KV, stage 2 in order"] = mod.paged_attention_split(*args, scale, pdl=False)
            for name, out in outs.items():
                ok = out.dtype == dtype and out.shape == args[0].shape and out.device == args[0].device
                err = (out.cpu().double() - ref).abs().max().item() if ok else float("inf")
                results.append((f"{name}, {what}", err, TOL[dtype]))
    return results


def _prefill_checks(mod, dtypes, device, small: bool):
    results = []
    for dtype in dtypes:
        cases = [(1, 1, 4, 1, 4), (37, 37, 4, 2, 4), (50, 17, 6, 3, 4), (24, 2, 4, 2, 2)]
        if not small:
            cases += [(300, 200, 9, 3, 16), (1000, 1000, 9, 3, 16), (700, 1, 8, 1, 16)]
        for L, T, H, Hkv, bs in cases:
            args, ks, vs = _case([L], H, Hkv, 16 if small else 64, bs, dtype, seed=L + T, device=device)
            q = torch.randn(T, H, args[0].shape[-1], generator=torch.Generator().manual_seed(T)).to(dtype).to(device)
            scale = q.shape[-1] ** -0.5
            out = mod.paged_prefill(q, args[1], args[2], args[3][0], L, scale)
            ok = out.dtype == dtype and out.shape == q.shape
            err = (out.cpu().double() - _causal(q, ks[0], vs[0], scale)).abs().max().item() if ok else float("inf")
            results.append((f"prefill T={T} of {L} H={H} Hkv={Hkv} bs={bs} {dtype}", err, TOL[dtype]))
    return results


def _store_checks(mod, dtypes, device):
    results = []
    for dtype in dtypes:
        kc = torch.full((3, 4, 3, 64), -9.0, dtype=dtype, device=device)
        vc = kc.clone()
        k, v = torch.randn(4, 3, 64).to(dtype).to(device), torch.randn(4, 3, 64).to(dtype).to(device)
        mod.store_kv(kc, vc, k, v, torch.tensor([3, 4, -1, 11], device=device))
        fk, fv = kc.view(12, 3, 64).cpu(), vc.view(12, 3, 64).cpu()
        good = (torch.equal(fk[3], k[0].cpu()) and torch.equal(fk[4], k[1].cpu()) and torch.equal(fv[11], v[3].cpu())
                and bool((fk[[0, 1, 2, 5, 6, 7, 8, 9, 10]] == -9).all()))
        results.append((f"store_kv {dtype}", 0.0 if good else float("inf"), 0.5))
    return results


@interpreter_only
@pytest.mark.parametrize("part", ["store", "decode", "prefill"])
def test_solution_kernels_match_dense_references_in_the_interpreter(kernels, part):
    dtypes = (torch.float32, torch.float16)
    checks = {"store": lambda: _store_checks(kernels, dtypes, "cpu"),
              "decode": lambda: _decode_checks(kernels, dtypes, "cpu", small=True),
              "prefill": lambda: _prefill_checks(kernels, dtypes, "cpu", small=True)}[part]()
    failed = [f"{name}: max |diff| {err:.1e} > {tol}" for name, err, tol in checks if not err < tol]
    assert not failed, "\n".join(failed)


@interpreter_only
@pytest.mark.filterwarnings("ignore::RuntimeWarning")     # NumPy's overflow in the fp16 kernel: the point of it
def test_the_fp16_check_fails_a_decode_kernel_that_skips_the_float32_conversions(kernels, tmp_path):
    """Lab 06's hidden fp16 case for v1 and v2 (FP16_BIG in lab06_refs.py): q . k past fp16's range before the
    scale. The lab's v1 passes it; one that multiplies q and k in fp16 (no .to(tl.float32)) fails with NaN."""
    import importlib.util

    from autograder.lab_builders.lab06_refs import FP16_BIG, HIDDEN_ATTENTION, HIDDEN_BIG
    from course.expect import expect_tensor

    source = lab_source(gpu=False)
    loads = ("other=0.0).to(tl.float32)\n    m = tl.full([GROUP_PAD]", "other=0.0).to(tl.float32)   # (BLOCK_SIZE, D)")
    assert all(source.count(x) for x in loads)
    path = tmp_path / "lab06_fp16_scores.py"
    path.write_text(source.replace(loads[0], "other=0.0)\n    m = tl.full([GROUP_PAD]", 1)
                    .replace(loads[1], "other=0.0)   # (BLOCK_SIZE, D)", 1))
    spec = importlib.util.spec_from_file_location(path.stem, path)
    fp16_scores = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(fp16_scores)
    check = "\n".join([HIDDEN_ATTENTION, HIDDEN_BIG, FP16_BIG.replace("KERNEL", "paged_attention_v1").replace(
        "WHAT", "v1").replace("EXTRA", "")])
    for mod, fails in ((kernels, False), (fp16_scores, True)):
        scope = dict(torch=torch, env=kernels.env, dev="cpu", expect_tensor=expect_tensor,
                     paged_attention_v1=mod.paged_attention_v1)
        if not fails:
            exec(check, scope)
            continue
        with pytest.raises(AssertionError, match="NaN: your scores overflow to inf in fp16.*to.tl.float32"):
            exec(check, scope)


@interpreter_only
def test_launchers_catch_bad_input(kernels):
    args, _, _ = _case([5, 3], 4, 2, 16, 4, torch.float32)
    with pytest.raises(ValueError, match="split_len must be a positive int"):
        kernels.paged_attention_split(*args, 0.25, split_len=0)
    with pytest.raises(ValueError, match="tl.dot needs head_dim >= 16"):
        kernels.paged_attention_split(*_case([5], 4, 2, 8, 4, torch.float32)[0], 0.25)
    with pytest.raises(ValueError, match="context_len"):
        kernels.paged_prefill(torch.zeros(6, 4, 16), args[1], args[2], args[3][1], 5, 0.25)   # 6 queries, 5 tokens
    with pytest.raises(ValueError, match="one sequence's row"):
        kernels.paged_prefill(torch.zeros(2, 4, 16), args[1], args[2], args[3], 5, 0.25)
    with pytest.raises(ValueError, match="int32"):
        kernels.paged_attention_v1(args[0], args[1], args[2], args[3].long(), args[4], 0.25)
    with pytest.raises(ValueError, match="blocks_per_iter must be a power of two"):
        kernels.paged_attention_v2(*args, 0.25, blocks_per_iter=3)


@interpreter_only
def test_stage2_launches_in_order_when_the_early_launch_fails(kernels, monkeypatch, capsys):
    """Where programmatic dependent launch is refused (here the interpreter, which cannot run
    griddepcontrol), split_stage2 launches stage 2 in order, says so once, and keeps to that."""
    assert kernels.PDL is False, "no GPU here: the launchers must not ask for programmatic dependent launch"
    args, ks, vs = _case([5, 3, 9], 4, 2, 16, 4, torch.float32)
    part_out, part_lse = kernels.split_stage1(*args, 0.25, split_len=4)
    monkeypatch.setattr(kernels, "PDL", True)
    out = kernels.split_stage2(part_out, part_lse, torch.full_like(args[0], float("nan")))
    assert (out.double() - _dense(args[0], ks, vs, 0.25)).abs().max().item() < TOL[torch.float32]
    assert kernels.PDL is False and "stage 2 launches after stage 1 from now on" in capsys.readouterr().out
    with pytest.raises(ValueError, match="do not fit"):                  # an error of the call itself is not a PDL failure
        kernels.split_stage2(part_out, part_lse[:, :, :1], out, pdl=True)


def _dev_split_kv():
    """dev/split_kv.py as a module (it is a script, not a package)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("dev_split_kv", REPO / "dev" / "split_kv.py")
    dev = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(dev)
    return dev


def test_dev_lookahead_patch_still_applies():
    """dev/lab06_lookahead.patch (Problem 4 with a look-ahead, for a GPU session to apply if an H100 shows it
    reaches issue 16's target) applies to this tree, so that an edit of lab 06 cannot leave it behind."""
    proc = subprocess.run(["git", "apply", "--check", "dev/lab06_lookahead.patch"], cwd=REPO, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr


@pytest.mark.slow
def test_dev_split_kv_versions_compile_for_t4_a100_and_h100():
    """dev/split_kv.py's prefetching stage 1 compiles where the lab's does, with every configuration it
    times on sm_90, so a GPU session's minutes go to timing it, not to finding out that it fails."""
    from course.kernels import kernel_source

    dev = _dev_split_kv()
    base = dict(SMOLLM2, GROUP=3, GROUP_PAD=16, DOT_F32=False)
    jobs = []
    for arch, dtype in ((75, "fp16"), (80, "bf16"), (90, "bf16")):
        for tile, warps, stages in (dev.CONFIGS if arch == 90 else dev.CONFIGS[3:4]):
            cx = dict(base, TILE=tile, USE_PDL=arch >= 90)
            sig = {**_signature("paged_decode_split_kernel", dtype), **{n: "constexpr" for n in cx}}
            jobs.append(("split_prefetch_kernel", sig, cx, arch, {"num_warps": warps, "num_stages": stages}))
    report = compile_report(kernel_source(dev._kv_tile, dev.split_prefetch_kernel), jobs, timeout=900)
    failed = [f"sm_{arch} {cx} {opt}: {r['error']}" for (_, _, cx, arch, opt), r in zip(jobs, report) if r["error"]]
    assert not failed, "\n".join(failed)
    too_big = [f"sm_{arch} {cx} {opt}: {r['shared']}" for (_, _, cx, arch, opt), r in zip(jobs, report)
               if r["shared"] > SHARED_LIMIT[arch]]
    assert not too_big, too_big


@interpreter_only
def test_dev_split_kv_versions_match_the_reference():
    """dev/split_kv.py's versions of stage 1 (what a GPU session times against the lab's) compute the
    same attention: its own check, in the interpreter."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, "dev/split_kv.py", "--check"], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=600)
    found = re.search(r"(\d+) of (\d+) runs agree", proc.stdout)
    assert proc.returncode == 0 and found and found[1] == found[2] and int(found[2]) >= 20, proc.stdout + proc.stderr[-3000:]


@interpreter_only
def test_dev_split_kv_timing_sweep_keeps_to_its_budget(kernels):
    """dev/split_kv.py's timing path, dry (a stand-in timer and clock; kernels in the interpreter): every
    timed row agrees with the lab's launcher, the launcher's split length goes first with both versions
    side by side, a spent budget stops a shape's sweep and says how many rows it left out, and each shape
    is handed on when done, so a GPU run cut off at its limit keeps what it measured."""
    dev, lab = _dev_split_kv(), kernels
    ticks = iter(range(10**6))
    handed = []
    rows = dev.time_all(lab, [(2, 256), (1, 128)], torch.float32, device="cpu", bench=lambda fn, *a: (fn(*a), 0.01)[1],
                        peak=1e12, configs=[(16, 4, 1), (32, 4, 1)], budget_s=4, clock=lambda: next(ticks),
                        on_shape=lambda r: handed.append(len(r)))
    assert handed == [len([r for r in rows if r["shape"] == "2x256"]), len(rows)]
    swept = [r for r in rows if "config" in r and "us" in r]
    assert swept and all(r["max_diff_vs_lab"] < 1e-4 for r in swept), swept
    first = [r for r in swept if r["shape"] == "2x256"][:2]
    assert [r["version"] for r in first] == ["lab", "prefetch"]
    assert all(r["split_len"] == lab.choose_split_len(2, 3, 256) for r in first)
    cut = [r for r in rows if "left_out" in r]
    assert cut and cut[0]["shape"] == "2x256", rows
    n_sweep = 2 * 2 * 2                                   # (split lengths 128, 256) x configs x versions
    assert cut[0]["left_out"] + len([r for r in swept if r["shape"] == "2x256"]) == n_sweep
    assert any(r["shape"] == "1x128" for r in swept), "the second shape got no share of the budget"
    for shape in ("2x256", "1x128"):                       # whole groups: each version as often as the other
        got = [r["version"] for r in swept if r["shape"] == shape]
        assert got.count("lab") == got.count("prefetch"), (shape, got)
    assert {r["version"] for r in rows if "us" in r and "config" not in r} == {"sdpa (gathered)", "lab launcher"}


# --- 3. compiled on a GPU --------------------------------------------------------------------------

def run_checks(device: str) -> list[dict]:
    """Every kernel through the lab's launchers on `device` ("cuda": compiled and autotuned; "cpu": the
    interpreter, with small shapes), in fp32, fp16 and (where the GPU has it) bf16."""
    gpu = device == "cuda"
    dtypes = [torch.float32, torch.float16]
    if not gpu or torch.cuda.is_bf16_supported(including_emulation=False):     # a T4 (sm_75) has no bf16
        dtypes.append(torch.bfloat16)
    with tempfile.TemporaryDirectory(prefix="lab06-kernels-") as tmp:
        mod = load_lab_module(gpu=gpu, directory=Path(tmp))
        checks = (_store_checks(mod, dtypes, device) + _decode_checks(mod, dtypes, device, small=not gpu)
                  + _prefill_checks(mod, dtypes, device, small=not gpu))
    return [{"check": name, "err": err, "tol": tol, "ok": err < tol} for name, err, tol in checks]


@pytest.mark.slow
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU: compiled kernels run only there")
def test_solution_kernels_compiled_on_the_gpu():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, __file__, "--device", "cuda"], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=1800)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULTS")]
    assert proc.returncode == 0 and lines, f"the GPU check failed (exit {proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    results = json.loads(lines[-1][len("RESULTS"):])
    failed = [f"{r['check']}: max |diff| {r['err']:.1e} > {r['tol']}" for r in results if not r["ok"]]
    assert results and not failed, "compiled kernels that disagree with the references:\n" + "\n".join(failed)


# --- 4. the paged engine parts ---------------------------------------------------------------------

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


@interpreter_only
def test_the_paged_engine_runs_the_lab_kernels(kernels):
    """The paged engine on the lab's own store_kv and split-KV kernels (lab 06's last measurement, here
    in the interpreter on a tiny model) gives the contiguous engine's tokens. The kernels refuse what a
    GPU would read wrongly (k and v that are not contiguous rows): found on an H100, where the engine
    handed store_kv a view of its stacked q/k/v matmul."""
    import course
    from course.engine.paged_engine import Request, contiguous_generate, paged_generate

    cfg = course.ModelConfig(family="llama", vocab_size=50, n_layer=2, n_head=4, n_kv_head=2, d_model=64, d_ff=96,
                             max_seq_len=64)
    model = course.models.init_weights(course.Decoder(cfg), std=0.3, seed=3).eval()
    work = lambda: [Request(i, p, 4) for i, p in enumerate(([1, 2, 3, 4, 5], [6, 7], [8, 9, 10, 11, 12, 13, 14]))]
    want = contiguous_generate(model, work(), 2, 12).outputs
    got = paged_generate(model, work(), 2, 12, 4, write_kv=kernels.store_kv,
                         attention=lambda *a: kernels.paged_attention_split(*a, split_len=4)).outputs
    assert got == want


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
        assert_orders_close(lp, lc, **for_decoder(cfg), what="paged vs slot prefill")   # block order: sums reordered
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
        assert_orders_close(lp, lc, **for_decoder(cfg), what=f"decode step {step}")
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


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="Run lab 06's solution kernels against the references on one device.")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                        help="cuda: compiled and autotuned (run without TRITON_INTERPRET); cpu: the interpreter")
    device = parser.parse_args().device
    if device == "cuda" and os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        sys.exit("unset TRITON_INTERPRET to run the kernels compiled")
    if device == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"
    results = run_checks(device)
    for r in results:
        print(f"{'ok  ' if r['ok'] else 'FAIL'} {r['check']}: max |diff| {r['err']:.1e} (tolerance {r['tol']})")
    print("RESULTS" + json.dumps(results))
