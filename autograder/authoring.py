"""Write nbgrader source notebooks from Python, for lab authors.

A lab is a list of cells; these helpers attach the nbgrader metadata so nobody hand-edits JSON:

    cells = [md("# Lab 01"), locked("setup", "import course\\nenv = course.setup()"),
             solution("greedy", "def f():\\n    ### BEGIN SOLUTION\\n    ...\\n    ### END SOLUTION"),
             tests("greedy_tests", 3, "assert f() == 1, 'f should ...'"),
             answer("why_cache", 1, "question 1", model="Because ...", rubric="1 point for ...")]
    write_notebook("labs/01_inference/01_inference.ipynb", cells)
"""
from __future__ import annotations

import hashlib
from pathlib import Path

import nbformat

KERNEL = {"display_name": "Python 3", "language": "python", "name": "python3"}


def _nbgrader(grade_id: str, *, grade: bool, solution: bool, locked: bool, points: float | None = None,
              task: bool = False) -> dict:
    meta = {"grade": grade, "grade_id": grade_id, "locked": locked, "schema_version": 3,
            "solution": solution, "task": task}
    if points is not None:
        meta["points"] = points
    return {"nbgrader": meta}


def md(text: str) -> nbformat.NotebookNode:
    """Prose. Not locked: students may annotate."""
    return nbformat.v4.new_markdown_cell(text.strip("\n"))


def code(source: str) -> nbformat.NotebookNode:
    """An ordinary code cell the student runs (demos, plots, measurements)."""
    return nbformat.v4.new_code_cell(source.strip("\n"))


def locked(grade_id: str, source: str) -> nbformat.NotebookNode:
    """Given code the grader restores if edited (setup, helpers the tests rely on)."""
    return nbformat.v4.new_code_cell(source.strip("\n"), metadata=_nbgrader(grade_id, grade=False, solution=False, locked=True))


def solution(grade_id: str, source: str) -> nbformat.NotebookNode:
    """The student's answer: code between ### BEGIN SOLUTION / ### END SOLUTION becomes a stub."""
    if "### BEGIN SOLUTION" not in source:
        raise ValueError(f"solution cell {grade_id!r} needs ### BEGIN SOLUTION / ### END SOLUTION markers")
    return nbformat.v4.new_code_cell(source.strip("\n"), metadata=_nbgrader(grade_id, grade=False, solution=True, locked=False))


def tests(grade_id: str, points: float, source: str) -> nbformat.NotebookNode:
    """An autograded test cell: visible asserts, then ### BEGIN HIDDEN TESTS ... ### END HIDDEN TESTS."""
    if points <= 0:
        raise ValueError(f"test cell {grade_id!r}: points must be > 0, got {points}")
    return nbformat.v4.new_code_cell(source.strip("\n"), metadata=_nbgrader(grade_id, grade=True, solution=False, locked=True, points=points))


def answer(grade_id: str, points: float, questions: str, *, model: str, rubric: str) -> nbformat.NotebookNode:
    """A written answer, graded by hand (formgrader): a markdown cell the student writes in.

    `questions` names what it answers ("questions 1 and 2"); the student sees it, with the points,
    above the answer. `model` (a model answer) and `rubric` (how the points split, what earns them)
    are for the instructor: they go between ### BEGIN SOLUTION / ### END SOLUTION, which the
    release replaces with "YOUR ANSWER HERE".
    """
    if points <= 0:
        raise ValueError(f"answer cell {grade_id!r}: points must be > 0, got {points}")
    for name, text in (("questions", questions), ("model", model), ("rubric", rubric)):
        if not text.strip():
            raise ValueError(f"answer cell {grade_id!r}: {name} must not be empty")
        if "BEGIN SOLUTION" in text or "END SOLUTION" in text:
            raise ValueError(f"answer cell {grade_id!r}: {name} must not hold a solution marker")
    unit = "point" if points == 1 else "points"
    source = (f"**Your answer to {questions.strip()}** ({points:g} {unit}, graded by hand):\n\n"
              f"### BEGIN SOLUTION\n**Model answer.**\n\n{model.strip()}\n\n"
              f"**Rubric ({points:g} {unit}).**\n\n{rubric.strip()}\n### END SOLUTION")
    return nbformat.v4.new_markdown_cell(source, metadata=_nbgrader(grade_id, grade=True, solution=True, locked=False, points=points))


def _content_ids(cells: list) -> None:
    """Ids from content, not random: rebuilding an unchanged lab changes nothing."""
    seen: dict[str, int] = {}
    for cell in cells:
        digest = hashlib.sha1(cell.source.encode()).hexdigest()[:10]
        seen[digest] = seen.get(digest, 0) + 1
        cell.id = digest if seen[digest] == 1 else f"{digest}-{seen[digest]}"


def write_notebook(path: str | Path, cells: list) -> Path:
    """Write an nbgrader source notebook (no outputs, Python 3 kernel) and validate it."""
    from autograder.gpu_record import with_records

    nb = nbformat.v4.new_notebook(cells=cells, metadata={"kernelspec": KERNEL, "language_info": {"name": "python"}})
    _content_ids(nb.cells)
    path = Path(path)
    # what a GPU printed for its GPU-only cells, for readers without one (autograder/gpu_record.py)
    nb.cells, stale = with_records(path.parent.name, nb.cells)
    _content_ids(nb.cells)
    if stale:
        print(f"{path.parent.name}: {len(stale)} recorded GPU outputs left out, their cells changed since "
              f"(rerun the GPU proof with --keep, then python -m autograder.gpu_record): {', '.join(stale)}")
    ids = [c.metadata["nbgrader"]["grade_id"] for c in cells if "nbgrader" in c.metadata]
    dupes = {i for i in ids if ids.count(i) > 1}
    if dupes:
        raise ValueError(f"grade_id must be unique in a notebook; repeated: {sorted(dupes)}")
    nbformat.validate(nb)
    path.parent.mkdir(parents=True, exist_ok=True)
    nbformat.write(nb, path)
    return path
