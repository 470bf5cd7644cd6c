"""The GPU proof: run the course on a CUDA GPU and write what happened to `build/gpu-report.md`.

    python -m autograder.gpu_check                      # every lab, quick and full mode, kernels, the class
    python -m autograder.gpu_check --labs 05_paged_kv_cache 06_triton_kernels --modes quick

What `make test-gpu` runs, and what runs on a bare GPU machine where the Makefile cannot (torch,
transformers and triton already there, no network): it needs nbclient, nbformat and ipykernel beside
the course, and lab 11 its server stack (starlette, uvicorn, openai with pydantic, jiter and distro;
wheels can travel). Each step that needs more says so in the report instead of failing:

1. every lab's SOURCE notebook (solutions and hidden tests) executed top to bottom, in quick and in
   full mode: each graded cell's score, every cell that raised, the lab's time, and what its Measure
   section recorded (`course.report.record`) beside the claim it supports;
2. every Triton kernel compiled (not interpreted) against its reference in fp32, fp16 and bf16:
   `tests/test_paged_kernels.py` under pytest, without TRITON_INTERPRET (needs pytest);
3. CUDA started under a grading kernel's limits, as `make grade --gpu` checks before it grades
   (sandboxed where bubblewrap is installed, else the limits alone);
4. the simulated class graded with `--gpu` in the sandbox, each expected score checked (needs
   nbgrader and bubblewrap).

Then the targets the issues set for an H100 (TARGETS below), each read from a full-mode measurement
and marked met or missed. They are benchmarks: a missed target is reported, never a failed test.

Without a CUDA device it says so and exits with status 2, claiming nothing. Exit 1 when anything
failed, 0 when everything ran and passed (targets aside).

The report is rewritten after every lab and step, so a run cut off at a time limit still leaves what
it finished. In a short lease (a 10-minute command, a few minutes of set-up), split the proof:

    python -m autograder.gpu_check --modes quick --jobs 4 --deadline 300 --out $OUT/quick.md
    python -m autograder.gpu_check --labs 01_inference 04_batching 05_paged_kv_cache 07_sampling \
        10_smaller_kv_cache 11_serving 12_distributed --modes full --jobs 7 --no-kernels --no-class
    python -m autograder.gpu_check --targets-only --modes full --no-kernels --deadline 420 --out $OUT/full.md

`--jobs N` runs N labs at a time on the one GPU, each with its share of the CPU cores
(OMP_NUM_THREADS). Their times are then upper bounds: a lab that stays within the 3 minutes beside
six others stays within them alone, and one that does not is marked to be rerun alone. Such runs
count toward no target; the targets need a lab alone on the GPU, so the last line runs, one at a
time, only the labs that hold one. `--deadline` starts nothing new past that many seconds and lists
what it left out; what already runs finishes (a lab, or the kernel check: a cell cut short would
read as a failure), so leave a 10-minute command a few minutes beyond it.

Seen on an H100 (2026-11-26): all 12 labs in quick mode with --jobs 4 in about 140 s (7 of them with
--jobs 7: 82 s); the kernel check about 140 s (on 16 cores; it compiles for three targets); full
mode, one at a time, at a2d5495: 02 98 s, 03 227 s, 06 77 s, 08 121 s, 09 34 s. The targets alone
take about 560 s: more than one 10-minute command. A 15-minute lease that worked: the machine started
in 34 s; the third set-up call installed (47 s) and ran the quick labs and lab 06 in full mode
(250 s); a fourth ran 08, 09 and 03 in full mode, a fifth 02. Pass `--keep $OUT/nb` for a lab whose
printed lines you need (the report holds only what `record` kept). Again on 2026-11-27 (e898baa): the
machine started in 29 s, the install took 46 s, all 12 labs in quick mode with --jobs 6 about 110 s;
full mode, one at a time: 03 175 s, 06 64 s, 09 50 s.

Issue 16's split-KV target has its own experiment beside this proof: `python dev/split_kv.py
--budget-s 180 --out $OUT/split.json` checks and times versions of the kernel's stage 1 (the lab's
and one that issues its loads a tile ahead) over split lengths and configurations, its sweep cut off
after 180 s, the JSON rewritten after each shape; run it in the same command after lab 06 in full
mode (`--no-kernels --no-class`), whose new cell measures what programmatic dependent launch saves.
If only the look-ahead version reaches the target, `dev/lab06_lookahead.patch` makes it the lab's
solution (its header says how to apply it); then run lab 06 again.
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
OPTIONAL_ON = {"COURSE_HF_COMPILE": "1"}  # optional parts a student turns on; the proof runs them for their targets
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
    concurrent: int = 1                                        # labs running at once on the one GPU, this one included

    @property
    def score(self) -> float:
        return sum(c.score for c in self.cells)

    @property
    def points(self) -> float:
        return sum(c.points for c in self.cells)

    @property
    def optional_seconds(self) -> float:
        """Seconds spent in parts a student turns on (OPTIONAL_ON): measurements keyed `optional_*` in s."""
        return sum(m["value"] or 0.0 for m in self.measurements if m["key"].startswith("optional_") and m["unit"] == "s")

    @property
    def ok(self) -> bool:
        return not self.failure and not self.errors and self.score == self.points and bool(self.cells)


@dataclass(frozen=True)
class Target:
    """A number an issue asks an H100 to reach: `key` (a prefix when it ends in '*': the best of those
    keys) compared with `bound`, a number or another key of the same lab."""
    lab: str
    key: str
    bound: float | str
    what: str

    def measured(self, values: dict[str, float | None]) -> tuple[float | None, float | None, str | None]:
        """(value, bound, key) from one lab's {key: value}: key is the measurement that gave the value (for a
        prefix, the best one); None where it was not measured."""
        if self.key.endswith("*"):
            found = [(v, k) for k, v in values.items() if k.startswith(self.key[:-1]) and v is not None]
            value, key = max(found) if found else (None, None)
        else:
            value, key = values.get(self.key), self.key
        bound = values.get(self.bound) if isinstance(self.bound, str) else self.bound
        return value, bound, key


TARGETS = (
    Target("02_prefill_decode", "graph_speedup", 8.0, "issue 15: a CUDA-graph decode step >= 8x eager"),
    Target("03_kv_cache", "kv_cache_speedup_graph", 5.0, "issue 15: cached (graph decode) vs uncached >= 5x"),
    Target("03_kv_cache", "engine_batch1_tokens_per_s", "hf_static_compile_tokens_per_s",
           "issue 15: the engine's batch-1 decode >= HF static cache + torch.compile"),
    Target("06_triton_kernels", "split_kv_vs_sdpa_32x1024", 0.8, "issue 16: split-KV decode >= 0.8x SDPA, 32 x 1k"),
    Target("06_triton_kernels", "split_kv_vs_sdpa_8x8192", 0.8, "issue 16: split-KV decode >= 0.8x SDPA, 8 x 8k"),
    Target("06_triton_kernels", "split_kv_roofline_32x1024", 0.5, "issue 16: split-KV >= 50% of HBM bandwidth, 32 x 1k"),
    Target("06_triton_kernels", "split_kv_roofline_8x8192", 0.5, "issue 16: split-KV >= 50% of HBM bandwidth, 8 x 8k"),
    Target("06_triton_kernels", "split_kv_roofline_best_split_32x1024", 0.5,
           "issue 16: split-KV at its fastest split length >= 50% of HBM bandwidth, 32 x 1k"),
    Target("06_triton_kernels", "prefill_vs_sdpa_4096", 0.5, "issue 16: paged prefill >= 0.5x SDPA flash, 4k tokens"),
    Target("06_triton_kernels", "engine_paged_triton_vs_contiguous", 0.9,
           "issues 15, 16: the paged engine with the Triton kernel >= 0.9x the contiguous engine"),
    Target("08_speculative_decoding", "spec_best_speedup_*", 1.5,
           "issue 15: the best drafter >= 1.5x wall clock (on fresh or repeating text: the verdict names which)"),
    Target("09_prefix_caching", "prefix_cache_ttft_speedup*", 3.0,
           "issue 15: prefix-cache TTFT >= 3x (eager, or the cached suffix from a graph)"),
)
TARGET_LABS = tuple(dict.fromkeys(t.lab for t in TARGETS))


def target_rows(runs: list[LabRun]) -> list[tuple[Target, float | None, float | None, str]]:
    """(target, value, bound, verdict) for every target, read from full-mode runs that had the GPU to
    themselves: quick mode shrinks the workloads the targets are set for, and a lab running beside
    others measures their contention."""
    full: dict[str, dict[str, float | None]] = {}
    shared = {r.lab for r in runs if r.mode == "full" and r.concurrent > 1}
    for r in runs:
        if r.mode == "full" and r.concurrent == 1:
            full.setdefault(r.lab, {}).update({m["key"]: m["value"] for m in r.measurements})
    rows = []
    for t in TARGETS:
        if t.lab not in full:
            rows.append((t, None, None, "ran beside other labs: run it alone" if t.lab in shared else "not run in full mode"))
            continue
        value, bound, key = t.measured(full[t.lab])
        verdict = ("not measured" if value is None or bound is None else "met" if value >= bound else "MISSED")
        if t.key.endswith("*") and value is not None:
            verdict += f" ({key})"                      # which of the measurements under the prefix it was
        rows.append((t, value, bound, verdict))
    return rows


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


def run_lab(lab: str, mode: str, timeout: int, keep: Path | None = None, labs_dir: Path = LABS,
            threads: int | None = None, concurrent: int = 1) -> LabRun:
    """Execute a lab's source in `mode` in a fresh kernel (cwd: the lab's folder); score it. `threads`:
    the kernel's CPU threads (OMP_NUM_THREADS), for a lab that shares the machine with others. A kept
    notebook carries the run's facts (`gpu_record.RUN_KEY`), so that its GPU-only outputs can be shown
    to readers without a GPU (`python -m autograder.gpu_record`)."""
    import nbformat
    from nbclient import NotebookClient
    from nbclient.exceptions import CellTimeoutError, DeadKernelError

    path = labs_dir / lab / f"{lab}.ipynb"
    nb = nbformat.read(path, as_version=4)
    run = LabRun(lab, mode)
    with tempfile.TemporaryDirectory() as tmp:
        log = Path(tmp) / "measurements.jsonl"
        env = {**os.environ, **OPTIONAL_ON, "COURSE_QUICK": "1" if mode == "quick" else "0", "COURSE_MEASUREMENTS": str(log),
               "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)}
        env.pop("TRITON_INTERPRET", None)                     # a GPU compiles its kernels
        if threads is not None:
            env["OMP_NUM_THREADS"] = str(threads)
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
        from autograder.gpu_record import RUN_KEY, commit_label

        facts = device_facts()
        nb.metadata[RUN_KEY] = {
            "device": facts.get("device", "no GPU"), "torch": facts["torch"], "triton": facts["triton"],
            "dtype": "bfloat16" if facts.get("bf16") == "yes" else "float16", "mode": mode,
            "concurrent": concurrent, "commit": commit_label(), "date": time.strftime("%Y-%m-%d")}
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

def grading_cuda_check() -> Step:
    """CUDA started under the limits a grading kernel gets with `--gpu` (sandboxed where bubblewrap is
    installed): the check `make grade --gpu` makes before it grades anything."""
    from autograder.grade import sandbox

    name = "CUDA starts under a grading kernel's limits (--gpu)"
    enabled = shutil.which("bwrap") is not None
    with tempfile.TemporaryDirectory() as tmp:
        try:
            said = sandbox.preflight_gpu(Path(tmp) / "run", sandbox.Limits(), enabled=enabled)
        except sandbox.SandboxUnavailable as e:
            return Step(name, "failed", str(e)[:1500])
    return Step(name, "passed", said + ("" if enabled else "; no bubblewrap here: the limits alone, unsandboxed"))


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


def write_report(path: Path, facts: dict, runs: list[LabRun], steps: list[Step], left_out: list[str] = ()) -> str:
    """The markdown report; returns its text (also written to `path`). `left_out`: what the deadline
    kept from running."""
    lines = ["# GPU proof", "", "| | |", "|---|---|"]
    lines += [f"| {k} | {v} |" for k, v in facts.items()]
    lines += ["", "## Labs (source notebooks, hidden tests included)", ""]
    if any(r.concurrent > 1 for r in runs):
        lines += ["A lab marked 'N at a time' shared the one GPU with others: its time is an upper bound (within "
                  f"{FULL_MODE_TARGET_S} s, the lab alone is too), and it counts toward no target.", ""]
    lines += ["| lab | mode | time (s) | graded | cells that raised | result |", "|---|---|---|---|---|---|"]
    for r in runs:
        slow = r.mode == "full" and r.seconds - r.optional_seconds > FULL_MODE_TARGET_S
        result = ("ok" if r.ok and not slow else "FAILED" if not r.ok else f"over {FULL_MODE_TARGET_S} s"
                  + (": run it alone" if r.concurrent > 1 else ""))
        took = (f"{r.seconds:.0f}" + (f" ({r.seconds - r.optional_seconds:.0f} without its optional parts)" if r.optional_seconds else "")
                + (f", {r.concurrent} at a time" if r.concurrent > 1 else ""))
        lines.append(f"| {r.lab} | {r.mode} | {took} | {r.score:g}/{r.points:g} | {len(r.errors)} | {result} |")
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
        lines += ["No lab recorded a measurement (course.report.record).", ""]
    for lab, keys in by_lab.items():
        lines += [f"**{lab}**", "", "| claim | measurement | quick | full | where |", "|---|---|---|---|---|"]
        for key, modes in keys.items():
            any_m = next(iter(modes.values()))
            where = ", ".join(f"{k}={v}" for k, v in any_m.items() if k not in {"key", "value", "unit", "claim"})
            vals = [f"{_fmt(modes[m]['value'])} {any_m['unit']}" if m in modes else "" for m in MODES]
            lines.append(f"| {any_m['claim']} | {key} | {vals[0]} | {vals[1]} | {where} |")
        lines.append("")
    lines += ["## Targets (full mode; benchmarks, not tests)", "", "| target | measured | bound | verdict |", "|---|---|---|---|"]
    for t, value, bound, verdict in target_rows(runs):
        lines.append(f"| {t.what} | {_fmt(value)} | {_fmt(bound)} | {verdict} |")
    lines += ["", "## Other checks", ""]
    lines += [f"- **{s.name}**: {s.status}" + (f"\n\n```\n{s.detail}\n```\n" if s.detail else "") for s in steps]
    if left_out:
        lines += ["", "## Left out (the --deadline was reached first)", ""] + [f"- {x}" for x in left_out]
    text = "\n".join(lines) + "\n"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    return text


def _run_lab_job(job: tuple) -> LabRun | None:
    """run_lab in a worker process (spawned: the parent has touched CUDA); None when the wall-clock
    `stop_at` (time.time(), or None) passed before it could start; `threads`: its share of the CPU cores."""
    lab, mode, timeout, keep, stop_at, threads, concurrent = job
    if stop_at is not None and time.time() >= stop_at:
        return None
    return run_lab(lab, mode, timeout, keep, threads=threads, concurrent=concurrent)


def main(argv: list[str] | None = None) -> int:
    labs_known = sorted(p.name for p in LABS.iterdir() if p.is_dir() and not p.name.startswith(("_", ".")))
    parser = argparse.ArgumentParser(prog="python -m autograder.gpu_check", description=__doc__.splitlines()[0])
    parser.add_argument("--labs", nargs="*", default=labs_known, help=f"labs to run (default: all {len(labs_known)})")
    parser.add_argument("--targets-only", action="store_true",
                        help=f"only the labs that hold a target: {', '.join(TARGET_LABS)}")
    parser.add_argument("--modes", nargs="*", default=list(MODES), choices=MODES)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="the report (markdown)")
    parser.add_argument("--keep", type=Path, default=None, help="a folder for the executed notebooks")
    parser.add_argument("--timeout", type=int, default=900, help="seconds per cell")
    parser.add_argument("--deadline", type=float, default=None,
                        help="seconds from the start after which no lab or check starts (what is left out is listed)")
    parser.add_argument("--jobs", type=int, default=1,
                        help="labs run this many at a time; then their times are upper bounds and full mode counts "
                             "toward no target")
    parser.add_argument("--no-kernels", action="store_true", help="skip the compiled kernel checks")
    parser.add_argument("--no-class", action="store_true", help="skip grading the simulated class")
    args = parser.parse_args(argv)
    unknown = sorted(set(args.labs) - set(labs_known))
    if unknown:
        parser.error(f"unknown lab(s) {', '.join(unknown)}; labs are: {', '.join(labs_known)}")
    if args.jobs < 1:
        parser.error(f"--jobs must be a whole number >= 1, got {args.jobs}")
    if args.deadline is not None and args.deadline <= 0:
        parser.error(f"--deadline must be a number of seconds > 0, got {args.deadline:g}")
    labs = [lab for lab in args.labs if lab in TARGET_LABS] if args.targets_only else args.labs

    import torch

    if not torch.cuda.is_available():
        print("no CUDA device here (torch.cuda.is_available() is False): the GPU proof checked nothing. "
              "Run it on a machine with an NVIDIA GPU.", file=sys.stderr)
        return 2
    start = time.perf_counter()
    left = lambda: float("inf") if args.deadline is None else args.deadline - (time.perf_counter() - start)
    facts = device_facts()
    print(" | ".join(f"{k} {v}" for k, v in facts.items()), flush=True)
    runs: list[LabRun] = []
    steps: list[Step] = []
    left_out: list[str] = []
    jobs = max(1, min(args.jobs, len(labs)))
    report = lambda: write_report(args.out, facts, runs, steps, left_out)

    def done(r: LabRun | None, lab: str, mode: str) -> None:
        if r is None:
            left_out.append(f"{lab}, {mode} mode")
            return
        r.concurrent = jobs
        runs.append(r)
        print(f"{r.lab} {r.mode}: {r.score:g}/{r.points:g} in {r.seconds:.0f} s"
              + ("" if r.ok else f"  FAILED {r.failure} {list(r.errors)}"), flush=True)
        report()

    for mode in args.modes:
        if jobs == 1:
            for lab in labs:
                done(run_lab(lab, mode, args.timeout, args.keep) if left() > 0 else None, lab, mode)
            continue
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor

        stop_at = None if args.deadline is None else time.time() + left()
        with ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
            share = max(1, (os.cpu_count() or 1) // jobs)    # each lab its share of the cores, not all of them each
            for lab, r in zip(labs, pool.map(_run_lab_job, [(lab, mode, args.timeout, args.keep, stop_at, share, jobs)
                                                            for lab in labs])):
                done(r, lab, mode)
    for name, wanted, run in (("CUDA under the grading limits", True, grading_cuda_check),
                              ("Triton kernels compiled", not args.no_kernels, lambda: run_kernel_checks(timeout=1800)),
                              ("the simulated class", not args.no_class, lambda: grade_class(labs))):
        if not wanted:
            continue
        if left() <= 0:
            left_out.append(name)
        else:
            steps.append(run())
        report()
    text = report()
    print(f"report: {args.out}")
    print(text[text.index("## Targets"):].split("## Other checks")[0].strip())
    if left_out:
        print("left out (deadline):", "; ".join(left_out))
    failed = any(not r.ok for r in runs) or any(s.status == "failed" for s in steps)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
