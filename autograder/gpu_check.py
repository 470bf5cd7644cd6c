"""The GPU proof: run the course on a CUDA GPU and write what happened to `build/gpu-report.md`.

    python -m autograder.gpu_check                      # every lab, quick and full mode, kernels, the class
    python -m autograder.gpu_check --labs 05_paged_kv_cache 06_triton_kernels --modes quick

What `make test-gpu` runs, and what runs on a bare GPU machine where the Makefile cannot (torch,
transformers and triton already there, no network): it needs only nbclient, nbformat and ipykernel
beside the course. Each step that needs more says so in the report instead of failing:

1. every lab's SOURCE notebook (solutions and hidden tests) executed top to bottom, in quick and in
   full mode: each graded cell's score, every cell that raised, the lab's time, and what its Measure
   section recorded (`course.report.record`) beside the claim it supports;
2. every Triton kernel compiled (not interpreted) against its reference in fp32, fp16 and bf16:
   `tests/test_paged_kernels.py` under pytest, without TRITON_INTERPRET (needs pytest);
3. the simulated class graded with `--gpu` in the sandbox, each expected score checked (needs
   nbgrader and bubblewrap).

Without a CUDA device it says so and exits with status 2, claiming nothing. Exit 1 when anything
failed, 0 when everything ran and passed.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
LABS = REPO / "labs"
DEFAULT_OUT = REPO / "build" / "gpu-report.md"
FULL_MODE_TARGET_S = 180          # every lab's full mode on an H100-class GPU (issue: GPU proof)
MODES = ("quick", "full")


@dataclass
class Cell:
    grade_id: str
    points: float
    score: float
    why: str = ""


@dataclass
class LabRun:
    lab: str
    mode: str
    seconds: float = 0.0
    cells: list[Cell] = field(default_factory=list)
    errors: dict[str, str] = field(default_factory=dict)       # cell label -> 'Name: message'
    measurements: list[dict] = field(default_factory=list)
    failure: str = ""                                          # the run itself broke (timeout, kernel death)

    @property
    def score(self) -> float:
        return sum(c.score for c in self.cells)

    @property
    def points(self) -> float:
        return sum(c.points for c in self.cells)

    @property
    def ok(self) -> bool:
        return not self.failure and not self.errors and self.score == self.points and bool(self.cells)


@dataclass
class Step:
    name: str
    status: str        # "passed" | "failed" | "skipped"
    detail: str = ""


# --- the facts of this machine ----------------------------------------------------------------------

def device_facts() -> dict[str, str]:
    """Device, capability, memory and the versions that matter."""
    import torch

    facts = {"python": platform.python_version(), "torch": torch.__version__,
             "cuda (torch)": str(torch.version.cuda)}
    for name in ("triton", "transformers", "nbclient"):
        try:
            facts[name] = __import__(name).__version__
        except Exception:  # noqa: BLE001 - reported as missing, not a crash
            facts[name] = "not installed"
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        facts.update({"device": p.name, "capability": f"sm_{p.major}{p.minor}",
                      "memory": f"{p.total_memory / 2**30:.0f} GiB",
                      "bf16": "yes" if torch.cuda.is_bf16_supported(including_emulation=False) else "no (fp16 is used)"})
    return facts


# --- 1. the labs -------------------------------------------------------------------------------------

def _label(nb, i: int) -> str:
    gid = nb.cells[i].get("metadata", {}).get("nbgrader", {}).get("grade_id")
    return gid or f"cell {i + 1}"


def score_notebook(nb) -> tuple[list[Cell], dict[str, str]]:
    """nbgrader's rule for each executed test cell (an error or any stderr scores 0), without nbgrader;
    and every cell that raised."""
    cells, errors = [], {}
    for i, cell in enumerate(nb.cells):
        if cell.cell_type != "code":
            continue
        outs = cell.get("outputs", [])
        err = [f"{o.get('ename')}: {str(o.get('evalue', ''))[:300]}" for o in outs if o.get("output_type") == "error"]
        if err:
            errors[_label(nb, i)] = err[0]
        meta = cell.get("metadata", {}).get("nbgrader", {})
        if not meta.get("grade") or meta.get("solution"):
            continue
        points = float(meta.get("points", 0))
        stderr = [o.get("text", "") for o in outs if o.get("output_type") == "stream" and o.get("name") == "stderr"]
        why = err[0] if err else (f"stderr: {stderr[0].strip()[:200]}" if stderr else "")
        cells.append(Cell(meta.get("grade_id", _label(nb, i)), points, 0.0 if why else points, why))
    return cells, errors


def run_lab(lab: str, mode: str, timeout: int, keep: Path | None = None, labs_dir: Path = LABS) -> LabRun:
    """Execute a lab's source in `mode` in a fresh kernel (cwd: the lab's folder); score it."""
    import nbformat
    from nbclient import NotebookClient
    from nbclient.exceptions import CellTimeoutError, DeadKernelError

    path = labs_dir / lab / f"{lab}.ipynb"
    nb = nbformat.read(path, as_version=4)
    run = LabRun(lab, mode)
    with tempfile.TemporaryDirectory() as tmp:
        log = Path(tmp) / "measurements.jsonl"
        env = {**os.environ, "COURSE_QUICK": "1" if mode == "quick" else "0", "COURSE_MEASUREMENTS": str(log),
               "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)}
        env.pop("TRITON_INTERPRET", None)                     # a GPU compiles its kernels
        client = NotebookClient(nb, timeout=timeout, kernel_name="python3", allow_errors=True,
                                resources={"metadata": {"path": str(path.parent)}})
        start = time.perf_counter()
        try:
            client.execute(env=env)
        except (CellTimeoutError, DeadKernelError, RuntimeError) as e:
            run.failure = f"{type(e).__name__}: {str(e).strip().splitlines()[0][:300] if str(e).strip() else ''}"
        run.seconds = time.perf_counter() - start
        if log.exists():
            run.measurements = [json.loads(line) for line in log.read_text().splitlines() if line.strip()]
    run.cells, run.errors = score_notebook(nb)
    if keep is not None:
        keep.mkdir(parents=True, exist_ok=True)
        nbformat.write(nb, keep / f"{lab}.{mode}.ipynb")
    return run


# --- 2. kernels compiled -----------------------------------------------------------------------------

def run_kernel_checks(timeout: int) -> Step:
    """tests/test_paged_kernels.py under pytest with the interpreter off: on a GPU it compiles and
    checks every solution kernel in fp32, fp16 and bf16."""
    if importlib.util.find_spec("pytest") is None:
        return Step("Triton kernels compiled, against references", "skipped",
                    "pytest is not installed here (pip install pytest, then run again)")
    env = {**os.environ, "TRITON_INTERPRET": "0", "PYTHONPATH": os.pathsep.join(
        p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)}
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_paged_kernels.py", "-rA"]
    try:
        done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return Step("Triton kernels compiled, against references", "failed", f"pytest ran past {timeout} s")
    tail = "\n".join((done.stdout + done.stderr).strip().splitlines()[-25:])
    return Step("Triton kernels compiled, against references", "passed" if done.returncode == 0 else "failed", tail)


# --- 3. the class, graded on the GPU -----------------------------------------------------------------

def grade_class(labs: list[str]) -> Step:
    """The simulated class of every lab, graded in the sandbox with the GPU visible; every expected
    score and flag checked (as tests/test_grade.py does on CPU)."""
    name = "the simulated class, graded with --gpu"
    missing = [m for m in ("nbgrader", "pytest") if importlib.util.find_spec(m) is None]
    if missing or shutil.which("bwrap") is None:
        return Step(name, "skipped", "needs " + ", ".join(missing + (["bubblewrap (bwrap)"] if shutil.which("bwrap") is None else [])))
    sys.path[:0] = [str(REPO), str(REPO / "tests")]
    from autograder.fixtures import build_class
    from classroom import check_expectations, grade_class

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        subs = build_class(labs=labs, release_dir=root / "rel", hostile=False)
        try:
            graded = grade_class(root, subs, labs=labs, cell_timeout=600, budget=1800, gpu=True)
            check_expectations(graded)
        except AssertionError as e:
            return Step(name, "failed", str(e)[:3000])
    return Step(name, "passed", f"{len(subs)} submissions of {len(labs)} lab(s): every score and flag as expected")


# --- the report ----------------------------------------------------------------------------------------

def _fmt(v) -> str:
    if v is None:
        return "n/a"
    return f"{v:.3g}" if isinstance(v, float) else str(v)


def write_report(path: Path, facts: dict, runs: list[LabRun], steps: list[Step]) -> str:
    """The markdown report; returns its text (also written to `path`)."""
    lines = ["# GPU proof", "", "| | |", "|---|---|"]
    lines += [f"| {k} | {v} |" for k, v in facts.items()]
    lines += ["", "## Labs (source notebooks, hidden tests included)", "",
              "| lab | mode | time (s) | graded | cells that raised | result |", "|---|---|---|---|---|---|"]
    for r in runs:
        slow = r.mode == "full" and r.seconds > FULL_MODE_TARGET_S
        result = "ok" if r.ok and not slow else "FAILED" if not r.ok else f"over {FULL_MODE_TARGET_S} s"
        lines.append(f"| {r.lab} | {r.mode} | {r.seconds:.0f} | {r.score:g}/{r.points:g} | {len(r.errors)} | {result} |")
    bad = [r for r in runs if not r.ok]
    if bad:
        lines += ["", "### Failures", ""]
        for r in bad:
            lines.append(f"**{r.lab}, {r.mode} mode**" + (f": {r.failure}" if r.failure else ""))
            lines += [f"- `{c.grade_id}` {c.score:g}/{c.points:g}: {c.why}" for c in r.cells if c.score < c.points]
            lines += [f"- {label} raised {err}" for label, err in r.errors.items()
                      if label not in {c.grade_id for c in r.cells}]
            lines.append("")
    lines += ["", "## What each lab claims, and what this run measured", ""]
    by_lab: dict[str, dict[str, dict[str, dict]]] = {}
    for r in runs:
        for m in r.measurements:
            by_lab.setdefault(r.lab, {}).setdefault(m["key"], {})[r.mode] = m
    if not by_lab:
        lines.append("No lab recorded a measurement (course.report.record).")
    for lab, keys in by_lab.items():
        lines += [f"**{lab}**", "", "| claim | measurement | quick | full | where |", "|---|---|---|---|---|"]
        for key, modes in keys.items():
            any_m = next(iter(modes.values()))
            where = ", ".join(f"{k}={v}" for k, v in any_m.items() if k not in {"key", "value", "unit", "claim"})
            vals = [f"{_fmt(modes[m]['value'])} {any_m['unit']}" if m in modes else "" for m in MODES]
            lines.append(f"| {any_m['claim']} | {key} | {vals[0]} | {vals[1]} | {where} |")
        lines.append("")
    lines += ["## Other checks", ""]
    lines += [f"- **{s.name}**: {s.status}" + (f"\n\n```\n{s.detail}\n```\n" if s.detail else "") for s in steps]
    text = "\n".join(lines) + "\n"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    return text


def main(argv: list[str] | None = None) -> int:
    labs_known = sorted(p.name for p in LABS.iterdir() if p.is_dir() and not p.name.startswith(("_", ".")))
    parser = argparse.ArgumentParser(prog="python -m autograder.gpu_check", description=__doc__.splitlines()[0])
    parser.add_argument("--labs", nargs="*", default=labs_known, help=f"labs to run (default: all {len(labs_known)})")
    parser.add_argument("--modes", nargs="*", default=list(MODES), choices=MODES)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="the report (markdown)")
    parser.add_argument("--keep", type=Path, default=None, help="a folder for the executed notebooks")
    parser.add_argument("--timeout", type=int, default=900, help="seconds per cell")
    parser.add_argument("--no-kernels", action="store_true", help="skip the compiled kernel checks")
    parser.add_argument("--no-class", action="store_true", help="skip grading the simulated class")
    args = parser.parse_args(argv)
    unknown = sorted(set(args.labs) - set(labs_known))
    if unknown:
        parser.error(f"unknown lab(s) {', '.join(unknown)}; labs are: {', '.join(labs_known)}")

    import torch

    if not torch.cuda.is_available():
        print("no CUDA device here (torch.cuda.is_available() is False): the GPU proof checked nothing. "
              "Run it on a machine with an NVIDIA GPU.", file=sys.stderr)
        return 2
    facts = device_facts()
    print(" | ".join(f"{k} {v}" for k, v in facts.items()), flush=True)
    runs = []
    for lab in args.labs:
        for mode in args.modes:
            r = run_lab(lab, mode, args.timeout, args.keep)
            runs.append(r)
            print(f"{lab} {mode}: {r.score:g}/{r.points:g} in {r.seconds:.0f} s"
                  + ("" if r.ok else f"  FAILED {r.failure} {list(r.errors)}"), flush=True)
    steps = []
    if not args.no_kernels:
        steps.append(run_kernel_checks(timeout=1800))
    if not args.no_class:
        steps.append(grade_class(args.labs))
    write_report(args.out, facts, runs, steps)
    print(f"report: {args.out}")
    failed = any(not r.ok for r in runs) or any(s.status == "failed" for s in steps)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
