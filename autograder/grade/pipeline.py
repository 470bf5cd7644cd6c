"""`make grade`, start to end: collect -> check the sandbox -> register labs -> grade in parallel ->
record, one at a time -> feedback -> grades CSV -> class report.

Parallel without corrupting the gradebook: each submission is graded by its own worker process
(worker.py) in its own temporary folder and sandbox; workers never open the gradebook. This
process waits for them (`jobs` at a time) and records each outcome as it arrives, so the
gradebook has exactly one writer. One bad submission never stops the run: a worker that fails
or runs past its budget becomes that student's `grader-error`, with the reason.
"""
from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import nbformat

from autograder import GRADEBOOK, LABS, REPO, ROOT, lab_names, lab_notebook, load_config
from autograder.grade import cluster, collect, feedback, gradebook, progress, report, sandbox, scratch
from autograder.grade.execute import RunLimits
from autograder.grade.outcome import CellResult, Outcome
from autograder.grade.repair import cell_kind, grade_id
from autograder.grade.worker import Job
from autograder.release import generate_release


@dataclass
class Config:
    """Where things are and how to grade. Defaults: the course's nbgrader folders and gradebook."""

    submitted: Path = ROOT / "submitted"
    autograded: Path = ROOT / "autograded"
    feedback: Path = ROOT / "feedback"
    gradebook: Path | None = GRADEBOOK
    out: Path = ROOT / "autograded"            # grades.csv, report.html and outcomes/<student>/<lab>.json
    labs_dir: Path = LABS
    labs: list[str] = field(default_factory=list)   # empty: every lab that has a submission
    only: list[str] = field(default_factory=list)   # grade only these students (re-grading one)
    students: Path | None = None
    zip: Path | None = None
    jobs: int = 1
    scheduler: str | None = None               # a Dask scheduler's address: grade on its workers (cluster.py)
    resume: bool = False                       # skip what an earlier run graded from the same submission file
    sandbox: bool = True
    gpu: bool = False
    cell_timeout: int = 0                      # 0: nbgrader_config.py's Execute.timeout
    budget: int = 3600
    memory_gib: float = 8.0
    processes: int = 256
    quick: bool = True
    keep: bool = False                         # keep the temporary folders (debugging)
    widget_state: bool = False                 # keep widget state in the graded notebooks (the test suite's site)
    hidden_messages: bool = True               # feedback shows a failed hidden test's message (never its code)


def _data_files(lab_dir: Path) -> list[Path]:
    return sorted(p for p in lab_dir.iterdir() if p.suffix != ".ipynb" and p.name not in
                  {".ipynb_checkpoints", "__pycache__"} and not p.name.startswith("."))


def _lab_cells(source: Path) -> list[tuple[str, float]]:
    nb = nbformat.read(source, as_version=4)
    return [(grade_id(c), float(c.metadata.nbgrader.get("points", 0))) for c in nb.cells if cell_kind(c) == "test"]


def _not_graded(student: str, lab: str, source: Path, code: str, reason: str) -> Outcome:
    cells = _lab_cells(source)
    out = Outcome(student, lab, 0.0, sum(p for _, p in cells), status="missing" if code == "missing" else "error",
                  reason=reason, cells=[CellResult(g, p, 0.0, "not-run", reason) for g, p in cells])
    out.flag(code, reason)
    return out


def grade_all(cfg: Config, log=print) -> list[Outcome]:
    """Grade everything `cfg` points at; returns every outcome (graded, missing, failed)."""
    known = lab_names(cfg.labs_dir)
    unknown = [lab for lab in cfg.labs if lab not in known]
    if unknown:
        raise ValueError(f"LABS: unknown lab(s) {', '.join(unknown)}; labs are: {', '.join(known)}")
    if cfg.jobs < 1:
        raise ValueError(f"JOBS must be >= 1, got {cfg.jobs}")
    if cfg.zip is not None:
        got, skipped = collect.extract_zip(cfg.zip, cfg.submitted, cfg.labs or known)
        log(f"zip: {len(got)} submission(s) extracted into {cfg.submitted}"
            + (f"; skipped {len(skipped)} other file(s): {', '.join(skipped[:5])}" if skipped else ""))
    students = collect.read_students(cfg.students) if cfg.students else []
    found = collect.find_submissions(cfg.submitted, cfg.labs or known)
    if cfg.only:
        unknown = sorted(set(cfg.only) - {student for student, _ in found} - {s.id for s in students})
        if unknown:
            raise ValueError(f"--student: no submission and no class-list entry for {', '.join(unknown)} in "
                             f"{cfg.submitted}; students there: {', '.join(sorted({s for s, _ in found})[:20]) or 'none'}")
        found = {k: v for k, v in found.items() if k[0] in cfg.only}
        students = [s for s in students if s.id in cfg.only]
    labs = cfg.labs or sorted({lab for _, lab in found})
    found = {k: v for k, v in found.items() if k[1] in labs}
    if not labs:
        log(f"no submissions in {cfg.submitted} (expected <student>/<lab>/<lab>.ipynb)")
        return []
    cell_timeout = cfg.cell_timeout or int(load_config().Execute.timeout)
    scratch.sweep()                       # what a killed grader left behind (a model copy is 0.5 GB)
    tmp = scratch.make("course-grade-")
    try:
        return _grade(cfg, log, students, found, labs, cell_timeout, tmp)
    finally:
        if not cfg.keep:
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            log(f"kept the work folders in {tmp}")


def model_cache(tmp: Path, sandboxed: bool) -> Path | None:
    """The converted model's folder for the kernels to read (None when it is not converted here): as it
    is, or, when the grader is root and sandboxes, a copy the kernels' own uid can read."""
    from course.models.store import cache_dir

    cache = cache_dir() / "SmolLM2-135M-Instruct"
    cache = cache.parent if cache.is_dir() else None
    if sandboxed and cache is not None and os.geteuid() == 0 and not sandbox.readable_by_others(cache):
        cache = sandbox.readable_copy(cache, tmp / "model-cache")
    return cache


def _sha256(path: Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def _already_graded(cfg: Config, found: dict) -> set:
    """(student, lab) pairs an earlier run graded from the same submission file (RESUME=1 skips them);
    a grader-error is graded again."""
    done = set()
    for key, path in found.items():
        kept = cfg.out / "outcomes" / key[0] / f"{key[1]}.json"
        if kept.is_file():
            o = Outcome.from_json(kept.read_text())
            if o.status == "graded" and o.submission_sha256 == _sha256(path):
                done.add(key)
    return done


def _grade(cfg, log, students, found, labs, cell_timeout, tmp) -> list[Outcome]:
    cache = model_cache(tmp, cfg.sandbox)
    if cfg.sandbox and not cfg.scheduler:   # a cluster's workers check their own sandboxes (cluster.py)
        canary = tmp / "canary"          # the grader's /tmp must not be the kernel's
        canary.write_text("not for students")
        hidden = [cfg.labs_dir.resolve(), ROOT, cfg.submitted.resolve(), Path.home() / ".cache", canary]
        if cfg.gradebook is not None:
            hidden.append(cfg.gradebook.resolve())
        log(sandbox.preflight(tmp / "preflight", hidden, cache))
    elif not cfg.sandbox:
        log("!" * 78 + "\n!!! SANDBOX=off: student code runs with YOUR rights, network and files. Only do this\n"
            "!!! inside a container or VM that exists for grading. Every result is flagged sandbox-off.\n" + "!" * 78)
    if cfg.gradebook is not None:  # SQLite creates the file, not its folder (else: a misleading "db upgrade" error)
        cfg.gradebook.parent.mkdir(parents=True, exist_ok=True)
    releases = {lab: generate_release(lab, cfg.labs_dir, tmp / "release", cfg.gradebook) for lab in labs}
    sources = {lab: lab_notebook(lab, cfg.labs_dir) for lab in labs}
    threads = os.environ.get("OMP_NUM_THREADS") or str(max(1, (os.cpu_count() or 1) // cfg.jobs))
    env = {"COURSE_QUICK": "1" if cfg.quick else "0"}
    if not cfg.scheduler:           # on a cluster each worker gives its kernels its own threads (cluster.py)
        env |= {"OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads}
    limits = {"memory_bytes": int(cfg.memory_gib * (1 << 30)), "cpu_seconds": cfg.budget, "processes": cfg.processes}
    if cfg.gpu and not cfg.scheduler:  # fail closed: a kernel whose CUDA cannot start would grade on the CPU without a word
        log(sandbox.preflight_gpu(tmp / "preflight-gpu", sandbox.Limits(**limits), cache, enabled=cfg.sandbox))
    run_limits = asdict(RunLimits(cell_timeout=cell_timeout, budget=cfg.budget, widget_state=cfg.widget_state))
    skip = _already_graded(cfg, found) if cfg.resume else set()
    if skip:
        log(f"RESUME: {len(skip)} submission(s) already graded from the same file, kept as they are")
    jobs = []
    for (student, lab), path in sorted(found.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        if (student, lab) in skip:
            continue
        work = tmp / "jobs" / lab / student
        work.mkdir(parents=True)
        jobs.append(Job(student, lab, str(path), str(sources[lab]), str(releases[lab]), str(work),
                        [str(p) for p in _data_files(sources[lab].parent)], str(cache) if cache else None,
                        cfg.sandbox, cfg.gpu, env, limits, run_limits))
    backend = (cluster.DaskCluster(cfg.scheduler, log, cfg.sandbox, cfg.gpu, limits) if cfg.scheduler
               else cluster.LocalPool(cfg.jobs))
    log(f"grading {len(jobs)} submission(s) of {', '.join(labs)} on {backend.where}, "
        f"cell timeout {cell_timeout} s, budget {cfg.budget} s per notebook")
    roster = {s.id: s for s in students}
    outcomes: list[Outcome] = []
    start = time.monotonic()
    lost = None
    try:
        with progress.Progress(len(jobs), log) as bar:
            for fut, job in backend.run(jobs, cfg.budget + 300):
                outcome = backend.outcome(fut, job)
                outcome.submission_sha256 = _sha256(job.submission)
                if roster and job.student not in roster:
                    outcome.flag("unlisted", "not on the student list")
                _record(cfg, outcome, job, roster.get(job.student))
                _keep(cfg, outcome)
                outcomes.append(outcome)
                bar.done(f"{job.student} {job.lab}: {outcome.score:g}/{outcome.max_score:g}"
                         f"{'  ' + outcome.flag_summary() if outcome.flags else ''} ({outcome.seconds:.0f} s)",
                         failed=outcome.status != "graded")
    except cluster.ClusterLost as e:
        lost = e
    finally:
        backend.close()
    for s in students:
        for lab in labs:
            if (s.id, lab) not in found:
                out = _not_graded(s.id, lab, sources[lab], "missing", "no submission")
                if cfg.gradebook is not None:
                    gradebook.record(cfg.gradebook, out, s)
                _keep(cfg, out)
                outcomes.append(out)
    every = _kept(cfg)   # this run's outcomes and the earlier ones it did not redo (re-grading one student)
    took = time.monotonic() - start
    ran = sum(1 for o in outcomes if o.submission_sha256)    # graded or failed here, not the absent
    run = (f"this run graded {ran} notebook(s) in {took:.0f} s on {backend.where}"
           + (f" ({60 * ran / took:.1f} per minute)" if ran and took > 0 else ""))
    csv_path = report.write_csv(every, cfg.out / "grades.csv")
    report.write_canvas_csv(every, cfg.out / "grades-canvas.csv", students)
    html_path = report.write_report(every, cfg.out / "report.html", run=run)
    if lost is not None:
        raise lost
    graded = sum(o.status == "graded" for o in outcomes)
    flagged = sum(any(f.severity != "info" for f in o.flags) for o in outcomes)
    log(f"done in {took:.0f} s on {backend.where}: {graded} graded, {len(outcomes) - graded} without a score, "
        f"{flagged} flagged (grades.csv and the report cover {len(every)}, earlier runs included)\n  grades:   {csv_path} (for Canvas: grades-canvas.csv)\n  report:   {html_path}\n  feedback: {cfg.feedback}/<student>/<lab>/")
    written = [o for o in outcomes if any(m.answered for m in o.manual)]
    if written:
        log(f"  needs manual grading: {sum(m.answered for o in written for m in o.manual)} written answers in "
            f"{len(written)} submission(s), not in these scores. Grade them in formgrader: `make formgrade`, then "
            f"Manual Grading (autograder/GUIDE.md, section 4)")
    return outcomes


def _keep(cfg: Config, outcome: Outcome) -> None:
    """Store an outcome under cfg.out/outcomes/, replacing the one of an earlier run for the same student and lab."""
    path = cfg.out / "outcomes" / outcome.student / f"{outcome.lab}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(outcome.to_json())


def _kept(cfg: Config) -> list[Outcome]:
    """Every stored outcome: what grades.csv and report.html are made from."""
    return [Outcome.from_json(p.read_text()) for p in sorted((cfg.out / "outcomes").glob("*/*.json"))]


def _die_with_parent() -> None:
    """In the grading process, before it starts: on Linux, SIGKILL it when the thread that started it
    goes (a Dask worker killed mid-job), so that no orphan goes on grading; its kernel follows it
    (bubblewrap's --die-with-parent). Elsewhere nothing."""
    if sys.platform.startswith("linux"):
        import ctypes
        import signal

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)   # PR_SET_PDEATHSIG


def _run_worker(job: Job, timeout: int) -> Outcome:
    """Grade one job in its own process; any failure becomes the student's stated `grader-error`."""
    work = Path(job.work)
    path = job.save(work / "job.json")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    start = time.monotonic()
    with open(work / "worker.log", "wb") as logf:
        try:
            subprocess.run([sys.executable, "-m", "autograder.grade.worker", str(path)], cwd=REPO, env=env,
                           stdout=logf, stderr=subprocess.STDOUT, timeout=timeout, check=False,
                           preexec_fn=_die_with_parent)
            reason = None
        except subprocess.TimeoutExpired:
            reason = f"the grading process ran past {timeout} s and was stopped"
    result = work / "outcome.json"
    if reason is None and result.is_file():
        return Outcome.from_json(result.read_text())
    tail = (work / "worker.log").read_bytes()[-500:].decode(errors="replace")
    out = _not_graded(job.student, job.lab, Path(job.source), "grader-error",
                      reason or f"the grading process failed: {tail.strip().splitlines()[-1:] or '?'}")
    out.seconds = round(time.monotonic() - start, 1)
    return out


def _record(cfg: Config, outcome: Outcome, job: Job, student) -> None:
    """Gradebook, autograded notebook and feedback page for one outcome (main process only)."""
    work = Path(job.work)
    stamp_file = Path(job.submission).parent / "timestamp.txt"
    stamp = stamp_file.read_text() if stamp_file.is_file() else None
    if cfg.gradebook is not None:
        gradebook.record(cfg.gradebook, outcome, student, stamp)
    page = cfg.feedback / job.student / job.lab / f"{job.lab}.html"
    graded = work / "autograded.ipynb"
    if outcome.status == "graded" and graded.is_file():
        dest = cfg.autograded / job.student / job.lab / f"{job.lab}.ipynb"
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(graded, dest)
        feedback.write_feedback(nbformat.read(graded, as_version=4), outcome,
                                nbformat.read(job.source, as_version=4), nbformat.read(job.release, as_version=4), page,
                                cfg.hidden_messages)
    else:
        feedback.write_missing(outcome, page)
    for name in ("timestamp.txt", "submission_secret.txt"):   # nbgrader release_feedback reads them beside the page
        src = Path(job.submission).parent / name
        if src.is_file():
            shutil.copy2(src, page.parent / name)
