"""Session-wide settings and the session's one grading of the simulated class.

TRITON_INTERPRET=1 from the start, as `course.setup()` does in a lab on a CPU: Triton reads it
when it is first imported (its own library functions, `tl.zeros` among them, are @triton.jit
too), and loading a transformers model imports Triton. Set later, a test's kernels would be
interpreted but `tl.zeros` not ("Cannot call @triton.jit'd outside of the scope of a kernel").
The GPU compile check runs in a subprocess without it (course.kernels.compile_check).

`graded_class`: every selected lab's simulated class graded ONCE per session. Each lab runs four
times there (honest, blank, yes-man, patcher with planted mistakes), and those runs serve everything
else: the honest student's graded notebook is the lab's source run (test_labs.py) and the site's
executed copy (build/executed/), the blank student's is its release run.

At the end, a table of the run's 10 slowest steps (tests, graded submissions, the make set-up),
and every step in build/test-steps.tsv.
"""
import os
import shutil
import time
from pathlib import Path

import pytest

os.environ.setdefault("TRITON_INTERPRET", "1")

REPO = Path(__file__).resolve().parent.parent
EXECUTED = REPO / "build" / "executed"
MAKE_STEPS = REPO / "build" / "make-steps.tsv"     # written by the Makefile's test target
_pending: list[tuple[str, float]] = []             # steps this process timed, not yet on a report
_steps: list[tuple[str, float]] = []               # every step, where the summary is printed


def record_step(name: str, seconds: float) -> None:
    _pending.append((name, float(seconds)))


def _selected_labs(session) -> list[str]:
    from autograder import lab_names

    labs, every = set(), False
    for item in session.items:
        if "graded_class" in getattr(item, "fixturenames", ()):
            lab = getattr(getattr(item, "callspec", None), "params", {}).get("lab")
            every |= lab is None
            labs.add(lab)
    return lab_names() if every or not labs else sorted(labs - {None})


@pytest.fixture(scope="session")
def graded_class(request, tmp_path_factory):
    """{"subs", "outcomes": {(student, lab): Outcome}, "root", "config"} for the labs this session
    tests (all of them unless -k narrows it), graded as `make grade JOBS=2` does."""
    from autograder.fixtures import build_class
    from classroom import grade_class

    labs = _selected_labs(request.session)
    root = tmp_path_factory.mktemp("class")
    subs = build_class(labs=labs, release_dir=root / "fixture-release", hostile=False)
    graded = grade_class(root, subs, labs=labs, cell_timeout=300, budget=1200, widget_state=True)
    EXECUTED.mkdir(parents=True, exist_ok=True)
    for (student, lab), o in graded["outcomes"].items():
        if o.status == "graded":
            record_step(f"grade {lab} / {student}", o.seconds)
        executed = root / "autograded" / student / lab / f"{lab}.ipynb"
        if student == "full" and executed.is_file():         # the site's executed copy of the lab
            tmp = EXECUTED / f".{lab}.{time.time_ns()}.ipynb"
            shutil.copyfile(executed, tmp)
            tmp.replace(EXECUTED / f"{lab}.ipynb")
    return graded


# Modules holding the longest single tests (a Dask cluster, a JupyterHub, a wheel in a fresh venv,
# lm-eval): collected first, so that `--dist loadgroup` hands them out early (after its groups, which it
# sends largest first: the class, then the rest). Left for the end, one of them keeps one worker busy
# while the other has nothing left to do. Each module keeps its own order (module fixtures set up once),
# and a test in an xdist group is not moved (a group runs in collection order: the class's grading first).
LONG_FIRST = ("test_grade_cluster.py", "test_hub.py", "test_install.py", "test_serve_openai.py")


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(LONG_FIRST)}
    items.sort(key=lambda item: len(LONG_FIRST) if item.get_closest_marker("xdist_group")
               else rank.get(item.path.name, len(LONG_FIRST)))     # stable


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if _pending:
        report.user_properties.append(("steps", list(_pending)))
        _pending.clear()


def pytest_configure(config):
    global _in_worker
    _in_worker = hasattr(config, "workerinput")      # an xdist worker: its reports reach the controller


_in_worker = False


def pytest_runtest_logreport(report):
    if _in_worker:
        return
    for key, value in getattr(report, "user_properties", []):
        if key == "steps":
            _steps.extend(tuple(s) for s in value)
    if report.when in ("setup", "call") and report.duration >= 1:
        _steps.append((f"{report.nodeid} ({report.when})", report.duration))


def pytest_terminal_summary(terminalreporter, config):
    if hasattr(config, "workerinput"):
        return
    steps = list(_steps)
    if MAKE_STEPS.is_file():
        for line in MAKE_STEPS.read_text().splitlines():
            name, _, seconds = line.rpartition("\t")
            if name and seconds.strip():
                steps.append((name, float(seconds)))
    if not steps:
        return
    terminalreporter.write_sep("=", "the 10 slowest steps of this run")
    steps.sort(key=lambda s: -s[1])
    for name, seconds in steps[:10]:
        terminalreporter.write_line(f"{seconds:8.1f} s  {name}")
    if MAKE_STEPS.parent.is_dir():      # every step, for whoever makes the run faster
        (MAKE_STEPS.parent / "test-steps.tsv").write_text("".join(f"{s:.1f}\t{n}\n" for n, s in steps))
        terminalreporter.write_line(f"(all {len(steps)} steps: {MAKE_STEPS.parent / 'test-steps.tsv'})")
