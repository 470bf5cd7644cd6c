"""Compile Triton kernels for a GPU on a machine without one, to catch GPU-only errors early.

The Triton interpreter (TRITON_INTERPRET=1, what a CPU runs) executes kernels with NumPy and
accepts code that no GPU compiler would: a `break` in a loop, a loop variable that changes dtype,
`math.sqrt` of a runtime argument, `tl.dot` on tiles smaller than 16. Triton can still compile for
a GPU target it does not have (ptxas ships with it), but only in a process where the interpreter
is off. So the check runs in a fresh subprocess without TRITON_INTERPRET:

    results = compile_for_gpu(source, "my_kernel", {"x_ptr": "*fp32", "n": "i32", "BLOCK": "constexpr"},
                              {"BLOCK": 64}, archs=(75, 80, 90))
    # {75: None, 80: None, 90: None} on success, else {arch: "the compiler's error"}

`source` is Python text that defines the kernel (imports included); `kernel_source(fn)` gets it
for kernels written in a notebook cell. sm_75 is a T4 (no bf16), sm_80 an A100, sm_90 an H100.

`compile_report` also reads the compiled code: how many tensor-core instructions it holds
(`mma.sync` on sm_80 and later, `wgmma` on sm_90), how many asynchronous copies (`cp.async`,
the loads Triton pipelines across loop iterations when `num_stages` > 1), how many
`griddepcontrol` instructions (programmatic dependent launch, sm_90 and later) and whether the
`griddepcontrol.wait` comes before every global load (a load hoisted above it would read what the
kernel before has not finished writing), and how much shared memory a program needs. Pointer
arguments are compiled as 16-byte aligned, as PyTorch allocates them and as Triton specializes a
real launch (without it, loads are not vectorized).
"""
from __future__ import annotations

import inspect
import json
import os
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

HEADER = "import math\nimport triton\nimport triton.language as tl\n\n"

_RUNNER = textwrap.dedent("""\
    import importlib.util, json, re, sys
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    path, jobs, aligned, keep_ptx = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3] == "1", sys.argv[4] == "1"
    spec = importlib.util.spec_from_file_location("kernels_under_check", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    def _wait_first(ptx):     # None: no griddepcontrol.wait; else whether it comes before every global load
        wait = ptx.find("griddepcontrol.wait")
        loads = [m.start() for m in re.finditer(r"\\b(ld\\.global|cp\\.async\\.c[ag]|cp\\.async\\.bulk)", ptx)]
        return None if wait < 0 else all(wait < i for i in loads)
    out = []
    for name, signature, constexprs, arch, options in jobs:
        attrs = {(i,): [["tt.divisibility", 16]] for i, t in enumerate(signature.values()) if aligned and t.startswith("*")}
        try:
            k = triton.compile(ASTSource(getattr(mod, name), signature, constexprs, attrs),
                               target=GPUTarget("cuda", arch, 32), options=options)
            ptx = k.asm["ptx"]
            out.append({"error": None, "mma": len(re.findall(r"\\bmma\\.sync", ptx)),
                        "wgmma": len(re.findall(r"\\bwgmma\\.mma_async", ptx)),
                        "cp_async": len(re.findall(r"\\bcp\\.async\\.c[ag]\\.", ptx)),
                        "gdc": len(re.findall(r"\\bgriddepcontrol\\.", ptx)),
                        "gdc_wait_first": _wait_first(ptx), "shared": int(k.metadata.shared)})
            if keep_ptx:
                out[-1]["ptx"] = ptx
        except Exception as e:  # report, do not stop: the next target may compile
            out.append({"error": f"{type(e).__name__}: {str(e).strip()[-1500:]}"})
    print("RESULTS" + json.dumps(out))
""")


def kernel_source(*kernels) -> str:
    """Python text defining the given @triton.jit kernels (interpreted or not), with the imports."""
    parts = []
    for k in kernels:
        fn = getattr(k, "fn", k)                  # JITFunction and InterpretedFunction keep the Python function
        parts.append(textwrap.dedent(inspect.getsource(fn)))
    return HEADER + "\n\n".join(parts)


def compile_for_gpu(source: str, kernel: str, signature: dict[str, str], constexprs: dict[str, object] | None = None,
                    archs: tuple[int, ...] = (75, 80), timeout: float = 300) -> dict[int, str | None]:
    """Compile `kernel` (a name defined by `source`) for each CUDA compute capability in `archs`
    (75 = T4, 80 = A100, 90 = H100). Returns {arch: None if it compiled, else the error text}.

    `signature` maps every argument to a Triton type ("*fp16", "*bf16", "*fp32", "*i32", "i32", "fp32")
    or "constexpr"; `constexprs` gives the constexpr values."""
    results = compile_many(source, [(kernel, signature, constexprs or {}, arch) for arch in archs], timeout)
    return dict(zip(archs, results))


def compile_many(source: str, jobs: list[tuple], timeout: float = 300) -> list[str | None]:
    """Several (kernel, signature, constexprs, arch[, options]) compilations of one source in one
    subprocess: None for each that compiled, else the compiler's error."""
    return [r["error"] for r in compile_report(source, jobs, timeout)]


def compile_report(source: str, jobs: list[tuple], timeout: float = 300, aligned: bool = True,
                   ptx: bool = False) -> list[dict]:
    """Like `compile_many`, with what each compiled kernel holds: a dict per job with `error`
    (None when it compiled) and, when it did, `mma` and `wgmma` (tensor-core instructions in the
    PTX), `cp_async` (asynchronous copies: pipelined loads), `gdc` (griddepcontrol: programmatic
    dependent launch), `gdc_wait_first` (None without a griddepcontrol.wait, else whether it precedes
    every global load) and `shared` (bytes of shared memory).

    A job is (kernel name, signature, constexprs, arch) or the same with a fifth item, compiler
    options such as {"num_warps": 4, "num_stages": 3}. `aligned`: compile pointer arguments as
    16-byte aligned, as a launch with PyTorch tensors does. `ptx`: also return each compiled
    kernel's PTX text under `ptx`, to read the code the GPU would run."""
    if not isinstance(source, str) or "@triton.jit" not in source:
        raise ValueError("source must be Python text defining @triton.jit kernels (see kernel_source)")
    normal = []
    for job in jobs:
        if not isinstance(job, (tuple, list)) or len(job) not in (4, 5):
            raise ValueError(f"each job must be (kernel, signature, constexprs, arch[, options]), got {job!r}")
        name, signature, constexprs, arch = job[:4]
        options = dict(job[4]) if len(job) == 5 else {}
        if not isinstance(arch, int) or arch < 70:
            raise ValueError(f"arch must be a CUDA compute capability such as 75, 80 or 90, got {arch!r}")
        normal.append([name, dict(signature), dict(constexprs or {}), arch, options])
    with tempfile.TemporaryDirectory(prefix="triton-compile-check-") as tmp:
        path = Path(tmp) / "kernels_under_check.py"
        path.write_text(source)
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        env["TRITON_CACHE_DIR"] = str(Path(tmp) / "cache")      # a fresh compile every time, nothing left behind
        proc = subprocess.run([sys.executable, "-c", _RUNNER, str(path), json.dumps(normal), "1" if aligned else "0",
                               "1" if ptx else "0"],
                              env=env, capture_output=True, text=True, timeout=timeout)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULTS")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"the compile-check process failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(lines[-1][len("RESULTS"):])
