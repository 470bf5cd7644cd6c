"""Grade ONE submission: repair, scan, run in the sandbox, score. `python -m autograder.grade.worker JOB.json`.

Each submission is graded in its own process (started by pipeline.py), so nothing one notebook
does to the grader (a flood of output, a crash in a library) can stop the others; the process
writes `outcome.json` and the executed notebook into the job's folder and never touches the
gradebook (the main process does, one submission at a time).
"""
from __future__ import annotations

import asyncio
import importlib.util
import json
import sys
import time
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path

if __name__ == "__main__" and "nbgrader" not in sys.modules:
    # A grading process needs nbgrader.utils only. nbgrader's package __init__ imports its Jupyter
    # server extensions (tornado handlers, jupyter_server): 1 s in each of a class's processes. So the
    # package is registered here without running its __init__; its modules import as usual.
    sys.modules["nbgrader"] = importlib.util.module_from_spec(importlib.util.find_spec("nbgrader"))

import nbformat
from nbformat import NotebookNode
from nbgrader.utils import determine_grade

from autograder.grade import tamper
from autograder.grade.execute import Run, RunLimits, run_notebook
from autograder.grade.outcome import CellResult, ManualAnswer, Outcome
from autograder.grade.repair import cell_kind, grade_id, repair
from autograder.grade.sandbox import Limits, Sandbox

STUDENT_KINDS = {"solution", "student", "manual"}   # code the student wrote (scanned, events attributed)


@dataclass
class Job:
    student: str
    lab: str
    submission: str
    source: str
    release: str
    work: str                     # this job's private folder
    data: list[str] = field(default_factory=list)
    cache: str | None = None
    sandbox: bool = True
    gpu: bool = False
    env: dict = field(default_factory=dict)
    limits: dict = field(default_factory=dict)       # sandbox.Limits fields
    run_limits: dict = field(default_factory=dict)   # execute.RunLimits fields

    def save(self, path: Path) -> Path:
        path.write_text(json.dumps(asdict(self), indent=1))
        return path

    @classmethod
    def load(cls, path: Path) -> "Job":
        return cls(**json.loads(Path(path).read_text()))


def label(nb: NotebookNode, index: int) -> str:
    """How flags and the report name a cell: its grade_id, else 'cell N' (1-based, as Jupyter shows)."""
    return grade_id(nb.cells[index]) or f"cell {index + 1}"


def checkpoints(nb: NotebookNode, kinds: list[str], source: NotebookNode) -> dict[int, dict]:
    """What the guard remembers after a cell, to put back before each test:
    - locked cell: every name it binds ("names"), unless one of the lab's given or answer cells rebinds it;
    - test cell: the functions and classes it defines ("callables"), same exception;
    - given or locked cell: the objects it alone defines ("objects": model, hf_model, ...), whose
      identity and methods tests rely on (`hf_model.generate = my_loop` is put back);
    - test or locked cell: every name it binds ("bound"): redefining its own helpers is not tampering."""
    bound_by: dict[str, list[str]] = {}
    for cell in source.cells:
        if cell.cell_type == "code":
            for name in tamper.bound_names(cell.source):
                bound_by.setdefault(name, []).append(cell_kind(cell))
    rebound = {n for n, kinds_ in bound_by.items() if {"plain", "solution"} & set(kinds_)}
    once = {n for n, kinds_ in bound_by.items() if len(kinds_) == 1 and kinds_[0] in {"plain", "locked"}}
    points = {}
    for i, (cell, kind) in enumerate(zip(nb.cells, kinds)):
        names = tamper.bound_names(cell.source) if kind in {"locked", "test", "given"} else set()
        entry = {"bound": sorted(names)} if kind in {"locked", "test"} and names else {}
        if kind == "locked":
            entry["names"] = sorted(names - rebound)
        elif kind == "test":
            entry["callables"] = sorted(names - rebound)
        if kind in {"locked", "given"} and names & once:
            entry["objects"] = sorted(names & once)
        if entry:
            points[i] = entry
    return points


def grade(job: Job) -> Outcome:
    """Grade one submission; the executed notebook goes to `<work>/autograded.ipynb`."""
    start = time.monotonic()
    out = Outcome(job.student, job.lab)
    work = Path(job.work)
    source = nbformat.read(job.source, as_version=4)
    release = nbformat.read(job.release, as_version=4)
    tests = [c for c in source.cells if cell_kind(c) == "test"]
    out.max_score = float(sum(float(c.metadata.nbgrader.get("points", 0)) for c in tests))
    try:
        submitted = nbformat.read(job.submission, as_version=4)
    except Exception as e:  # noqa: BLE001 - any unreadable file is the student's, and stated
        out.status, out.reason = "unreadable", f"{type(e).__name__}: {str(e)[:300]}"
        out.flag("unreadable", out.reason)
        out.cells = [CellResult(grade_id(c), float(c.metadata.nbgrader["points"]), 0.0, "not-run", "unreadable")
                     for c in tests]
        return out

    fixed = repair(submitted, source, release)
    out.flags.extend(fixed.flags)
    written(out, fixed.nb, release)
    if fixed.known_ids == 0:
        out.flag("not-this-lab", f"no cell of {job.lab} found in the submission")
    aliases = tamper.import_aliases([c.source for c in source.cells if c.cell_type == "code"])
    module_names = {a for a, (mod, _) in aliases.items() if mod.split(".")[0] in tamper.GUARDED_ROOTS}
    given = tamper.given_objects(source) - module_names   # hf_model.generate = ... is patching too
    answers = tamper.graded_answers(source)
    submitted_aliases = tamper.import_aliases([c.source for c in fixed.nb.cells if c.cell_type == "code"])
    for i, (cell, kind) in enumerate(zip(fixed.nb.cells, fixed.kinds)):
        if kind in STUDENT_KINDS and cell.cell_type == "code":
            for f in tamper.scan(cell.source, module_names, given):
                out.flag("suspicious", f"line {f.line}: {f.what}", label(fixed.nb, i))
            for f in tamper.package_answers(cell.source, answers, submitted_aliases):
                out.flag("package-answer", f"line {f.line}: {f.what}", label(fixed.nb, i))

    if not job.sandbox:
        out.flag("sandbox-off", "graded without the sandbox (SANDBOX=off)")
    sandbox = Sandbox(run_dir=work / "run", lab=job.lab, cache=Path(job.cache) if job.cache else None,
                      data=[Path(p) for p in job.data], limits=Limits(**job.limits), env=dict(job.env),
                      gpu=job.gpu, enabled=job.sandbox)
    run = asyncio.run(run_notebook(fixed.nb, fixed.kinds, sandbox, RunLimits(**job.run_limits),
                                   checkpoints(fixed.nb, fixed.kinds, source),
                                   {k: list(v) for k, v in aliases.items()}))
    score(out, run, fixed.kinds, fixed.claimed)
    nbformat.write(run.nb, work / "autograded.ipynb")
    (work / "timing.json").write_text(json.dumps({label(run.nb, i): s for i, s in run.cell_seconds.items()}))
    out.seconds = round(time.monotonic() - start, 1)
    return out


def written(out: Outcome, nb: NotebookNode, release: NotebookNode) -> None:
    """The written answers (manually graded cells): which were answered, for a person to grade in
    formgrader; an answer left as the release's stub scores 0 without one."""
    given = {grade_id(c): {line.strip() for line in c.source.splitlines()} for c in release.cells if cell_kind(c) == "manual"}
    for cell in nb.cells:
        gid = grade_id(cell)
        if cell_kind(cell) == "manual" and gid is not None:   # anything beyond the stub's heading and "YOUR ANSWER HERE"
            own = [line for line in cell.source.splitlines() if line.strip() and line.strip() not in given.get(gid, set())]
            out.manual.append(ManualAnswer(gid, float(cell.metadata.nbgrader.get("points", 0)), bool(own)))
    if out.manual:
        todo = [m for m in out.manual if m.answered]
        out.flag("needs-manual-grading", f"{len(todo)} of {len(out.manual)} written answers to grade "
                                         f"({sum(m.points for m in out.manual):g} points in all; left blank: 0)")


def score(out: Outcome, run: Run, kinds: list[str], claimed: dict[str, bool]) -> None:
    """Per test cell: nbgrader's own rule (errors or stderr: 0; a numeric last value: partial),
    then the grader's zeroes (not run, timed out, tampered). Adds the run's flags."""
    nb = run.nb
    stop = run.stopped[0] if run.stopped else len(nb.cells)
    if run.stopped:
        code, why = run.stopped[1], run.stopped[2]
        where = label(nb, min(run.stopped[0], len(nb.cells) - 1)) if nb.cells else None
        out.flag(code, why, where)
    died = dict(run.deaths)
    for i, why in run.deaths:
        out.flag("kernel-died", f"{why}; a new kernel ran the cells above it again and grading went on", label(nb, i))
    zeroed = _guard_flags(out, run, kinds)
    for i in run.timeouts:
        out.flag("timeout" if kinds[i] == "test" else "slow-cell", "interrupted at the time limit", label(nb, i))
    for i in run.capped:
        out.flag("output-capped", "output beyond the cap was dropped", label(nb, i))
    if run.leftovers:
        out.flag("leftover-processes", f"{len(run.leftovers)} process(es) killed after the kernel stopped")
    for i, cell in enumerate(nb.cells):
        if kinds[i] != "test":
            if any(o.output_type == "error" for o in cell.get("outputs", [])):
                out.errors[label(nb, i)] = _first_error(cell)
            continue
        gid, points = grade_id(cell), float(cell.metadata.nbgrader.get("points", 0))
        if i in died:
            result = CellResult(gid, points, 0.0, "kernel-died", died[i])
        elif i >= stop:
            result = CellResult(gid, points, 0.0, "not-run", run.stopped[2] or run.stopped[1])
        elif i in run.timeouts:
            result = CellResult(gid, points, 0.0, "timeout", "interrupted at the time limit")
        elif i in zeroed:
            result = CellResult(gid, points, 0.0, "zeroed", zeroed[i])
        else:
            got, _ = determine_grade(cell)
            got = float(got or 0)
            status = "passed" if got == points else "partial" if got > 0 else "failed"
            result = CellResult(gid, points, got, status, "" if status == "passed" else _first_error(cell))
        if result.status != "passed" and any(o.output_type == "error" for o in cell.outputs):
            out.errors[gid] = _first_error(cell)
        if claimed.get(gid) and result.status != "passed":
            out.flag("outputs-disagree", "the submitted notebook shows this test passing", gid)
        out.cells.append(result)
    out.score = round(sum(c.score for c in out.cells), 4)


def _guard_flags(out: Outcome, run: Run, kinds: list[str]) -> dict[int, str]:
    """Flags from the guard's reports; returns {test cell index: why it is zeroed}."""
    nb, zeroed, first_seen = run.nb, {}, {}
    for rep in run.reports:
        i, op = rep["index"], rep["op"]
        where = label(nb, i) if i >= 0 else "kernel start"
        writes = [e.split(": ", 1)[1] for e in rep.get("log", []) if e.startswith("write: ")]
        events = [e.split(": ", 1)[1] for e in rep.get("log", []) if e.startswith("event: ")]
        if op == "config":
            for what in rep.get("found", []):
                out.flag("patched", f"{what} was already replaced when the grader first looked", where)
            continue
        kind = kinds[i]
        if op == "post" and kind == "test" and (rep["found"] or writes):
            zeroed[i] = "replaced while this test ran: " + ", ".join(sorted(set(rep["found"]) | set(writes)))
            out.flag("tampered", zeroed[i], where)
        elif op == "post":
            for what in rep["found"] + writes:
                first_seen.setdefault(what, where)
        elif op == "pre":
            for what in rep["found"]:
                out.flag("patched", f"{what} replaced (in {first_seen.get(what, 'student code')}); put back before the test",
                         first_seen.get(what, where))
        if events and kind in STUDENT_KINDS | {"test"}:
            out.flag("events", ", ".join(sorted(set(events))), where)
        if rep.get("threads") and kind in STUDENT_KINDS | {"test"}:
            out.flag("threads", f"started: {', '.join(rep['threads'])}", where)
    for what, where in first_seen.items():   # replaced and undone again before any test looked
        if not any(what in f.detail for f in out.flags if f.code in {"patched", "tampered"}):
            out.flag("patched", f"{what} replaced; no test ran while it was", where)
    return zeroed


def _first_error(cell: NotebookNode) -> str:
    for o in cell.get("outputs", []):
        if o.output_type == "error":
            return f"{o.ename}: {o.evalue}"[:300]
    for o in cell.get("outputs", []):
        if o.output_type == "stream" and o.name == "stderr":
            return f"wrote to stderr: {o.text.strip()[:200]}"
    return ""


def main(argv: list[str]) -> int:
    job = Job.load(Path(argv[0]))
    work = Path(job.work)
    try:
        outcome = grade(job)
    except Exception as e:  # noqa: BLE001 - a grader bug on one submission is stated, not fatal
        outcome = Outcome(job.student, job.lab, status="error", reason=f"{type(e).__name__}: {e}")
        outcome.flag("grader-error", outcome.reason[:300])
        (work / "traceback.txt").write_text(traceback.format_exc())
    (work / "outcome.json").write_text(outcome.to_json())
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
