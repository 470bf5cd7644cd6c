"""Run lab 12's tensor-parallel model under torchrun: several GPUs with NCCL, or CPU ranks with gloo.

From the notebook, write your answers to a file (their source, with the helpers and imports they need):

    from course.dist.torchrun_tp import answers_file, write_answers
    path = answers_file([column_parallel, row_parallel, shard_block, tp_attention, tp_mlp])   # a folder of your own
    write_answers("my_tp.py", [column_parallel, row_parallel, shard_block, tp_attention, tp_mlp])

then, in a terminal, one process per GPU (torchrun sets RANK, WORLD_SIZE, LOCAL_RANK, MASTER_*):

    torchrun --nproc-per-node=3 -m course.dist.torchrun_tp --answers my_tp.py
    torchrun --nnodes=2 --node-rank=0 --nproc-per-node=8 --rdzv-endpoint=HOST:29500 -m course.dist.torchrun_tp ...

Each rank loads the model on its own device (cuda:LOCAL_RANK with NCCL; CPU with gloo when the
machine has fewer GPUs than ranks), keeps its shard of every block, and runs `tp_forward` with
your `tp_attention` and `tp_mlp`. Rank 0 also runs the whole model alone and prints the largest
logit difference, the all-reduce bytes per token, and the time of one forward.
"""
from __future__ import annotations

import argparse
import importlib.util
import inspect
import time
from collections.abc import Callable
from pathlib import Path

import torch

HEADER = '''"""Lab 12 answers, written by course.dist.torchrun_tp.write_answers."""
import math
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

from course.dist.tp import TPBlock
from course.models.decoder import apply_rope
'''
NEEDED = ("shard_block", "tp_attention", "tp_mlp")
HEADER_NAMES = {"math", "time", "torch", "nn", "F", "TPBlock", "apply_rope"}


def write_answers(path: str | Path, functions: list[Callable], extra_source: str = "") -> Path:
    """Write the source of `functions` (defined in a notebook or a module) to `path`, after the
    imports lab 12's answers use, with what they need that the notebook defined: the source of
    the helper functions and classes they call (and of what those call), an import for each module
    or library function they use. Data (the model, a tensor, a dict) cannot go into a file: an
    answer that reads one as a global is refused, naming it. `extra_source`: anything else."""
    if not isinstance(functions, (list, tuple)) or not all(callable(f) for f in functions):
        raise TypeError("functions must be a list of functions, e.g. [column_parallel, row_parallel, shard_block, ...]")
    imports, sources = _needed(list(functions), HEADER_NAMES | _bound(extra_source))
    path = Path(path)
    path.write_text("\n\n\n".join(p for p in [HEADER, *imports, extra_source.strip(), *sources] if p) + "\n")
    return path


def answers_file(functions: list[Callable], extra_source: str = "") -> Path:
    """`write_answers` into `my_tp.py` in a new folder of this user's own (tempfile.mkdtemp): on a
    shared machine (a JupyterHub on one server) the temporary folder is everyone's, and a fixed path
    there would let one student's torchrun run another's answers."""
    import tempfile

    return write_answers(Path(tempfile.mkdtemp(prefix="lab12-answers-")) / "my_tp.py", functions, extra_source)


LIBRARIES = ("course", "torch", "numpy", "math", "functools", "itertools", "collections", "typing", "dataclasses")


def _needed(functions: list, defined: set[str]) -> tuple[list[str], list[str]]:
    """(import lines, sources) the answers file needs for `functions`: their sources and, through
    every global name they read, their helpers' sources (defined in the notebook or a local file) and
    imports of what libraries provide."""
    imports, sources, done = [], [], set(defined)
    todo = [(f.__name__, f) for f in functions]
    done |= {name for name, _ in todo}
    while todo:
        name, f = todo.pop(0)
        try:
            sources.append(inspect.getsource(f).rstrip())
        except (OSError, TypeError) as e:
            raise ValueError(f"cannot read the source of {name!r} ({e}): define it in a notebook cell or a file") from None
        readers = [f] if inspect.isfunction(f) else [v for v in vars(f).values() if inspect.isfunction(v)]
        for reader in readers:
            for ref in sorted(_globals_read(reader) - done):
                if not ref.isidentifier():              # a name a tool added (pytest's assert rewriting), not the source's
                    continue
                value = reader.__globals__[ref]
                done.add(ref)
                home = getattr(value, "__module__", None) or ""
                if inspect.ismodule(value):
                    imports.append(f"import {value.__name__}" + (f" as {ref}" if value.__name__ != ref else ""))
                elif (inspect.isfunction(value) or inspect.isclass(value)) and home.split(".")[0] in LIBRARIES:
                    imports.append(f"from {home} import {value.__qualname__}" + (f" as {ref}" if value.__qualname__ != ref else ""))
                elif (inspect.isfunction(value) or inspect.isclass(value)) and value.__name__ == ref:
                    todo.append((ref, value))                       # a helper of the notebook's: its source too
                else:
                    raise ValueError(f"{name} reads `{ref}` ({type(value).__name__}) as a global, which a file cannot "
                                     f"hold: pass it as an argument, or build it inside the function")
    return imports, sources


def _globals_read(f: Callable) -> set[str]:
    """Names `f` reads as globals (nested lambdas and comprehensions too) that its module defines:
    what the answers file must define as well. Builtins and attribute names are not globals."""
    import dis

    code = getattr(f, "__code__", None)
    if code is None:
        return set()
    names, todo = set(), [code]
    while todo:
        c = todo.pop()
        names |= {ins.argval for ins in dis.get_instructions(c) if ins.opname in ("LOAD_GLOBAL", "LOAD_NAME")}
        todo += [k for k in c.co_consts if hasattr(k, "co_code")]
    return {n for n in names if n in f.__globals__}


def _bound(source: str) -> set[str]:
    """Top-level names a piece of source defines (imports, assignments, functions, classes)."""
    import ast

    names: set[str] = set()
    for node in ast.parse(source or "").body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
        elif isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names |= {t.id for t in node.targets if isinstance(t, ast.Name)}
    return names


def import_answers(path: str | Path):
    """Import an answers file as a module, as a torchrun rank does (a fresh namespace: only what the
    file defines and imports)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"--answers {path}: no such file (write it with write_answers in the notebook)")
    spec = importlib.util.spec_from_file_location("lab12_answers", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def load_answers(path: str | Path):
    """Import the answers file as a module; it must define shard_block, tp_attention and tp_mlp."""
    module = import_answers(path)
    missing = [n for n in NEEDED if not callable(getattr(module, n, None))]
    if missing:
        raise AttributeError(f"{path} does not define {missing}")
    return module


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="torchrun ... -m course.dist.torchrun_tp", description=__doc__.split("\n")[0])
    parser.add_argument("--answers", required=True, help="file written by write_answers")
    parser.add_argument("--model", default=None, help="model name (default: the course's default model)")
    parser.add_argument("--prompt", default="The quick brown fox jumps over the lazy dog.")
    parser.add_argument("--backend", choices=["nccl", "gloo"], default=None, help="default: nccl with a GPU per rank")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)

    import course
    from course.dist.launch import init_from_env
    from course.dist.tp import tp_forward
    from course.environment import choose_dtype

    answers = load_answers(args.answers)
    comm = init_from_env(args.backend)
    device = f"cuda:{torch.cuda.current_device()}" if comm.backend == "nccl" else "cpu"
    if comm.backend == "gloo":
        torch.set_num_threads(max(1, (torch.get_num_threads() or 1) // comm.world_size))
    dtype = choose_dtype(device)                  # float32 on a CPU; bf16 on a GPU, fp16 where it has none (a T4)
    name = args.model or course.DEFAULT_MODEL
    model = course.load_model(name, device=device, dtype=dtype).eval()
    ids = torch.tensor([course.load_tokenizer(name)(args.prompt).input_ids], device=device)
    pos = torch.arange(ids.shape[1], device=device)[None]
    shards = [answers.shard_block(b, model.cfg, comm.rank, comm.world_size) for b in model.blocks]
    run = lambda: tp_forward(model, shards, ids, pos, comm, attention=answers.tp_attention, mlp=answers.tp_mlp)  # noqa: E731
    logits = run()                                                        # warm-up (and NCCL's first connection)
    comm.stats.reset()
    times = []
    for _ in range(max(1, args.repeats)):
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        start = time.perf_counter()
        logits = run()
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    per_token = comm.stats.all_reduce_bytes / max(1, args.repeats) / ids.shape[1]
    if comm.rank == 0:
        with torch.no_grad():
            ref = model(ids, pos)
        diff = (logits.float() - ref.float()).abs().max().item()
        print(f"{name}: {comm.world_size} ranks, backend {comm.backend}, {device}, {str(dtype).removeprefix('torch.')}")
        print(f"max |logits - single device| = {diff:.3g} (largest logit {ref.float().abs().max().item():.3g})")
        print(f"all-reduce: {comm.stats.all_reduce_calls // max(1, args.repeats)} calls per forward, "
              f"{per_token:,.0f} bytes per token per rank")
        print(f"one forward of {ids.shape[1]} tokens: {1e3 * sorted(times)[len(times) // 2]:.1f} ms (median of {len(times)})")
    comm.barrier()
    import torch.distributed as dist

    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
