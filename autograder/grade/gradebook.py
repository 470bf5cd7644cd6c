"""Write grading results into nbgrader's gradebook (SQLite), from ONE process, one submission at a time.

Parallel workers never open the gradebook: SQLite and nbgrader's session handling are not made
for several writers. The main process records each outcome as it arrives, so `nbgrader export`,
formgrader and the exchange's feedback release see what `make grade` graded:
- every student (on the list or with a submission) exists, with name and email when known;
- a graded submission gets nbgrader's rows; each test cell's `auto_score` is the grader's score
  (tampering and timeouts already zeroed), and cells with a `zero` or `review` flag are marked
  `needs_manual_grade` so formgrader lists them for a person to look at;
- each written answer (a manually graded cell) is marked `needs_manual_grade` for formgrader, or
  scores 0 when the student left the release's stub.
"""
from __future__ import annotations

import warnings
from pathlib import Path

from nbgrader.api import Gradebook, MissingEntry
from nbgrader.utils import parse_utc

from autograder.grade.collect import Student
from autograder.grade.outcome import Outcome


def record(gradebook: Path, outcome: Outcome, student: Student | None = None, timestamp: str | None = None) -> None:
    """Record `outcome` (graded or not) in the gradebook at `gradebook`."""
    with warnings.catch_warnings():   # nbgrader's own session use makes SQLAlchemy warn; harmless
        warnings.simplefilter("ignore")
        _record(gradebook, outcome, student, timestamp)


def _record(gradebook: Path, outcome: Outcome, student: Student | None, timestamp: str | None) -> None:
    with Gradebook(f"sqlite:///{gradebook}") as gb:
        info = {}
        if student is not None:
            first, _, last = student.name.partition(" ")
            info = {k: v for k, v in (("first_name", first), ("last_name", last), ("email", student.email)) if v}
        gb.update_or_create_student(outcome.student, **info)
        if outcome.status != "graded":
            return
        try:
            gb.find_assignment(outcome.lab)
        except MissingEntry:
            raise RuntimeError(f"the gradebook {gradebook} does not know lab {outcome.lab!r}; "
                               f"grading registers it first (generate_release)") from None
        kwargs = {"timestamp": _parse_time(timestamp)} if timestamp else {}
        gb.update_or_create_submission(outcome.lab, outcome.student, **kwargs)
        review = {f.cell for f in outcome.flags if f.severity in {"zero", "review"}}
        for cell in outcome.cells:
            grade = gb.find_grade(cell.grade_id, outcome.lab, outcome.lab, outcome.student)
            grade.auto_score = cell.score
            grade.needs_manual_grade = cell.grade_id in review or cell.status in {"zeroed", "not-run", "timeout", "kernel-died"}
        for answer in outcome.manual:      # formgrader lists what a person must grade; a blank answer is 0
            grade = gb.find_grade(answer.grade_id, outcome.lab, outcome.lab, outcome.student)
            grade.auto_score = None if answer.answered else 0.0
            grade.needs_manual_grade = answer.answered
        gb.db.commit()


def _parse_time(text: str):
    """nbgrader's own timestamp.txt format ('2026-03-09 09:36:17.123456 UTC') or ISO; None when unreadable."""
    try:
        return parse_utc(text.strip())
    except (ValueError, OverflowError):
        return None
