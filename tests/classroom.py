"""The simulated class of autograder/fixtures, graded as `make grade JOBS=2` does, and what to check
of the result. Shared by test_grade.py (the class), test_labs.py (each lab's honest and blank
students are its source run and its release run) and conftest.py (the session's one grading).
"""
from __future__ import annotations

import html
import re
from pathlib import Path

import nbformat

from autograder import lab_notebook
from autograder.checks import _public_lines, secret_lines
from autograder.fixtures import cell_problems, write_class
from autograder.grade.pipeline import Config, grade_all


def grade_class(root: Path, subs, **cfg) -> dict:
    """Write `subs` as nbgrader submissions under `root` and grade them all (JOBS=2, 4 GiB each)."""
    write_class(subs, root / "submitted", root / "students.csv")
    config = Config(submitted=root / "submitted", autograded=root / "autograded", feedback=root / "feedback",
                    gradebook=root / "gradebook.db", out=root / "out", students=root / "students.csv",
                    jobs=2, memory_gib=4, **cfg)
    outcomes = grade_all(config, log=print)
    return {"subs": subs, "outcomes": {(o.student, o.lab): o for o in outcomes}, "root": root, "config": config}


def expectation_problems(graded: dict) -> list[str]:
    """Every submission whose score, status or flags differ from its expectation."""
    problems = []
    for sub in graded["subs"]:
        o = graded["outcomes"][(sub.student, sub.lab)]
        wrong = cell_problems(sub, o.cells)
        if wrong or o.status != sub.expect.status:
            problems.append(f"{sub.student}/{sub.lab} ({sub.why}): {o.status} {o.score:g}, expected {sub.expect.status}; "
                            f"{'; '.join(wrong)}; cells {[(c.grade_id, c.status, c.why[:80]) for c in o.cells]}")
        shorts, codes = {f.short() for f in o.flags}, {f.code for f in o.flags}
        missing = [e for e in sub.expect.flags if (e not in shorts if "(" in e else e not in codes)]
        extra = codes - {e.split("(")[0] for e in sub.expect.flags} - sub.expect.maybe
        if missing or extra:
            problems.append(f"{sub.student}/{sub.lab}: flags {sorted(shorts)}; missing {missing}, unexpected {sorted(extra)}: "
                            + "; ".join(f"{f.code}({f.cell}): {f.detail[:120]}" for f in o.flags))
    return problems


def check_expectations(graded: dict) -> None:
    problems = expectation_problems(graded)
    assert not problems, "\n".join(problems)


def feedback_leaks(graded: dict) -> list[str]:
    """Lines of a feedback page that are a hidden test line or a solution line the student did not write."""
    leaks = []
    secrets = {}
    for page in sorted((graded["root"] / "feedback").rglob("*.html")):
        student, lab = page.parent.parent.name, page.parent.name
        if lab not in secrets:
            src = nbformat.read(lab_notebook(lab), as_version=4)
            secrets[lab] = secret_lines(src) - _public_lines(src)
        sub = graded["root"] / "submitted" / student / lab / f"{lab}.ipynb"
        try:
            own = {line.strip() for c in nbformat.read(sub, as_version=4).cells for line in c.source.splitlines()}
        except Exception:  # noqa: BLE001 - an unreadable submission wrote nothing
            own = set()
        shown = {line.strip() for line in html.unescape(re.sub(r"<[^>]+>", "", page.read_text())).splitlines()}
        leaks += [f"{student}/{lab}: {s}" for s in sorted(secrets[lab] - own) if s in shown]
    return leaks
