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
for kernels written in a notebook cell, with the @triton.jit helpers they call. `compile_error_summary`
turns a compiler error into one line for a student (the message, the code it points at, what it
usually means). `start_compile_report` starts the same compilation in the background and returns
a job whose `result()` waits for the report. sm_75 is a T4 (no bf16), sm_80 an A100, sm_90 an H100.

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
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time
import weakref
from pathlib import Path

HEADER = "import math\nimport triton\nimport triton.language as tl\n\n"

_RUNNER = textwrap.dedent("""\
    import importlib.util, json, re, sys
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    path, jobs, aligned = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3] == "1"
    keep_ptx, keep_ttir = sys.argv[4] == "1", sys.argv[5] == "1"
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
            if keep_ttir:
                out[-1]["ttir"] = k.asm["ttir"]
        except Exception as e:  # report, do not stop: the next target may compile
            out.append({"error": f"{type(e).__name__}: {str(e).strip()[-1500:]}"})
    import shutil, os
    shutil.rmtree(os.path.dirname(path), ignore_errors=True)   # the source and the cache: nobody needs them now
    print("RESULTS" + json.dumps(out))
""")


def _jit_function(obj):
    """The Python function inside a @triton.jit kernel (compiled or interpreted), else None."""
    fn = getattr(obj, "fn", None)
    return fn if inspect.isfunction(fn) and hasattr(obj, "arg_names") else None


def _code_names(code) -> set[str]:
    """Global names a function's code reads, its nested code (lambdas, comprehensions) included."""
    names = set(code.co_names)
    for const in code.co_consts:
        if inspect.iscode(const):
            names |= _code_names(const)
    return names


def _as_jit(source: str) -> str:
    """A function's source with its decorators replaced by a plain @triton.jit: the compiling process
    runs only the definition Triton reads, never code a decorator line could hold."""
    import ast

    func = ast.parse(source).body[0]
    return "@triton.jit\n" + "\n".join(source.splitlines()[func.lineno - 1:]) + "\n"


def kernel_source(*kernels) -> str:
    """Python text defining the given @triton.jit kernels (interpreted or not), with the imports and
    the @triton.jit helpers they call by name (found in each kernel's globals, recursively), each
    under a plain @triton.jit (whatever decorated it)."""
    parts, seen, todo = [], set(), list(kernels)
    while todo:
        k = todo.pop(0)
        fn = _jit_function(k) or getattr(k, "fn", k)   # JITFunction and InterpretedFunction keep the Python function
        if fn in seen:
            continue
        seen.add(fn)
        parts.append(_as_jit(textwrap.dedent(inspect.getsource(fn))))
        for name in sorted(_code_names(fn.__code__)):
            helper = getattr(fn, "__globals__", {}).get(name)
            if _jit_function(helper) is not None and _jit_function(helper) not in seen:
                todo.append(helper)
    return HEADER + "\n\n".join(parts)


# What a compiler error usually means, for the errors the interpreter lets through (first match wins).
_HINTS = (
    ("AST node type: Break", "`break` inside a loop is not supported by Triton's compiler: give the loop the bound "
                             "it needs instead (for example range(0, tl.cdiv(n, BLOCK)))"),
    ("AST node type: Continue", "`continue` inside a loop is not supported by Triton's compiler: mask the work "
                                "of that iteration instead (tl.where)"),
    ("Loop-carried variable", "a variable changes dtype inside a loop: give it its final dtype before the loop "
                              "(0.0 rather than 0, tl.zeros(..., tl.float32))"),
    ("must be same dtype", "both operands of tl.dot need the same dtype: convert with .to(...) (on a GPU, "
                           "DOT_F32 is False and the queries keep the input's 16-bit dtype)"),
    ("math.", "the math module works on Python numbers only: use tl.sqrt, tl.exp, ... on runtime values"),
    ("out of resource", "a program needs more shared memory than this GPU gives one: smaller tiles or fewer stages"),
)


def compile_error_summary(error: str) -> str:
    """One line for a student from a compile error of `compile_report`: the compiler's message, the
    line of the kernel it points at, and what such an error usually means."""
    lines = [line for line in error.strip().splitlines() if line.strip()]
    if not lines:
        return "the compiler failed without a message"
    kind = lines[0].split(":", 1)[0]
    message = lines[-1].strip()
    where = ""
    for i, line in enumerate(lines):
        if set(line.strip()) == {"^"} and i > 0:           # the caret under the failing code
            where = f" (at `{lines[i - 1].strip()}`)"
            message = " ".join(x.strip() for x in lines[i + 1:]) or message
            break
    hint = next((h for key, h in _HINTS if key in error), None)
    return f"{kind}: {message}{where}" + (f"; {hint}" if hint else "")


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
                   ptx: bool = False, ttir: bool = False) -> list[dict]:
    """Like `compile_many`, with what each compiled kernel holds: a dict per job with `error`
    (None when it compiled) and, when it did, `mma` and `wgmma` (tensor-core instructions in the
    PTX), `cp_async` (asynchronous copies: pipelined loads), `gdc` (griddepcontrol: programmatic
    dependent launch), `gdc_wait_first` (None without a griddepcontrol.wait, else whether it precedes
    every global load) and `shared` (bytes of shared memory).

    A job is (kernel name, signature, constexprs, arch) or the same with a fifth item, compiler
    options such as {"num_warps": 4, "num_stages": 3}. `aligned`: compile pointer arguments as
    16-byte aligned, as a launch with PyTorch tensors does. `ptx`: also return each compiled
    kernel's PTX text under `ptx`, to read the code the GPU would run; `ttir`: its Triton IR under
    `ttir` (the kernel as Triton understood it, before any GPU-specific pass: the dtypes of each
    `tt.dot`'s operands, the integer width of each address computation)."""
    return start_compile_report(source, jobs, timeout, aligned, ptx, ttir).result()


def start_compile_report(source: str, jobs: list[tuple], timeout: float = 300, aligned: bool = True,
                         ptx: bool = False, ttir: bool = False) -> "CompileJob":
    """`compile_report` in the background: starts the compiling process and returns at once; the
    returned job's `result()` waits for it and returns the report. Meanwhile this process is free
    (a lab's tests run the interpreter while their kernel compiles)."""
    return CompileJob(source, jobs, timeout, aligned, ptx, ttir)


class CompileJob:
    """A `compile_report` running in its own process (see start_compile_report)."""

    def __init__(self, source: str, jobs: list[tuple], timeout: float, aligned: bool, ptx: bool, ttir: bool):
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
        self._tmp = Path(tempfile.mkdtemp(prefix="triton-compile-check-"))
        self._cleanup = weakref.finalize(self, shutil.rmtree, self._tmp, True)   # also if result() is never called
        path = self._tmp / "kernels_under_check.py"
        path.write_text(source)
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        env["TRITON_CACHE_DIR"] = str(self._tmp / "cache")       # a fresh compile every time, nothing left behind
        # output to unnamed files, not pipes: a report with PTX outgrows a pipe's buffer before anyone reads it.
        # The process deletes the folder itself when done, so nothing is left behind, whether or not the
        # report is ever read (a test that failed before waiting for it; a kernel that was killed).
        self._out, self._err = tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")
        self._proc = subprocess.Popen([sys.executable, "-c", _RUNNER, str(path), json.dumps(normal),
                                       "1" if aligned else "0", "1" if ptx else "0", "1" if ttir else "0"],
                                      env=env, stdout=self._out, stderr=self._err, stdin=subprocess.DEVNULL)
        self._deadline = time.monotonic() + timeout
        self._timeout = timeout
        self._report: list[dict] | None = None

    def result(self) -> list[dict]:
        """Wait for the compiler (until the timeout given at the start) and return its report."""
        if self._report is None:
            try:
                code = self._proc.wait(timeout=max(0.0, self._deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
                self._cleanup()
                self._out.close()
                self._err.close()
                raise subprocess.TimeoutExpired(self._proc.args, self._timeout) from None
            self._cleanup()
            stdout, stderr = (self._read(f) for f in (self._out, self._err))
            lines = [line for line in stdout.splitlines() if line.startswith("RESULTS")]
            if code != 0 or not lines:
                raise RuntimeError(f"the compile-check process failed (exit {code}):\n{stderr[-3000:]}")
            self._report = json.loads(lines[-1][len("RESULTS"):])
        return self._report

    @staticmethod
    def _read(f) -> str:
        f.seek(0)
        text = f.read()
        f.close()
        return text
