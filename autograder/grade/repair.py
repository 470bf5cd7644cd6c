"""Put a submitted notebook back into the shape the source says, before anything runs.

Students (or their editors) delete, duplicate, retype and re-flag cells. nbgrader restores edited
locked cells but fails on a duplicated grade_id and, by default, does not re-add deleted tests.
Here, against the SOURCE notebook (the truth, hidden tests included) and its RELEASE (what the
student was given: stubs, no hidden tests):

- locked and test cells: source, type and metadata restored from the source by grade_id
  (`restored-locked` when the student's copy differed from what they were given);
- answer cells: the student's text is kept, the grading metadata is restored (`repaired-metadata`);
- a grade_id seen twice (`dropped-duplicate`): for an answer, the first copy flagged as a solution
  keeps the id and later copies stay as ordinary cells (their code still runs, in order, as the
  student wrote it); extra copies of locked or test cells are removed;
- a deleted locked or test cell is re-added from the source after the cell that precedes it
  there; a deleted answer cell is re-added as the release's stub, never the solution (`readded-cell`);
- every output and execution count is cleared: stored outputs are never trusted; which tests
  they claimed passed is kept to compare with the graded result (`outputs-disagree`).

Each code cell of the result gets a kind for the executor: test, locked, solution, given (an
unedited cell the lab hands out) or student (added or edited by the student).
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, field

from nbformat import NotebookNode
from nbgrader.utils import is_grade, is_locked, is_solution, is_task

from autograder.grade.outcome import Flag


def grade_id(cell: NotebookNode) -> str | None:
    return cell.get("metadata", {}).get("nbgrader", {}).get("grade_id")


def cell_kind(cell: NotebookNode) -> str:
    """test | locked | solution | manual (a graded answer) | task | plain, from nbgrader metadata."""
    if "nbgrader" not in cell.get("metadata", {}):
        return "plain"
    if is_task(cell):
        return "task"
    if is_solution(cell):
        return "manual" if is_grade(cell) else "solution"
    if is_grade(cell):
        return "test" if cell.cell_type == "code" else "manual"
    return "locked" if is_locked(cell) else "plain"


def _norm(source: str) -> str:
    return "\n".join(line.rstrip() for line in source.strip().splitlines())


def _passed(cell: NotebookNode) -> bool | None:
    """What a stored test cell output claims: True (ran, no error), False (error), None (not run)."""
    if cell.cell_type != "code" or cell.get("execution_count") is None:
        return None
    return not any(o.get("output_type") == "error" or (o.get("output_type") == "stream" and o.get("name") == "stderr")
                   for o in cell.get("outputs", []))


@dataclass
class Repaired:
    nb: NotebookNode
    kinds: list[str]                      # per cell: test | locked | solution | manual | task | given | student | markdown
    flags: list[Flag] = field(default_factory=list)
    claimed: dict[str, bool] = field(default_factory=dict)   # test grade_id -> what stored outputs claimed
    known_ids: int = 0                    # how many of the lab's answer and test cells the submission had


def repair(submitted: NotebookNode, source: NotebookNode, release: NotebookNode) -> Repaired:
    """The submission, repaired against `source` and `release` (see the module docstring)."""
    src_cells = {grade_id(c): c for c in source.cells if grade_id(c)}
    rel_cells = {grade_id(c): c for c in release.cells if grade_id(c)}
    src_order = [grade_id(c) for c in source.cells if grade_id(c)]
    given = {_norm(c.source) for c in source.cells if c.cell_type == "code" and cell_kind(c) == "plain"}
    flags: list[Flag] = []
    claimed: dict[str, bool] = {}
    out: list[NotebookNode] = []
    seen: set[str] = set()

    # an answer id's keeper: the first copy that still says it is a solution cell
    keeper: dict[str, int] = {}
    for i, cell in enumerate(submitted.cells):
        gid = grade_id(cell)
        if gid in src_cells and cell_kind(src_cells[gid]) in {"solution", "manual", "task"}:
            if gid not in keeper or (not is_solution(submitted.cells[keeper[gid]]) and is_solution(cell)):
                keeper[gid] = i

    for i, cell in enumerate(submitted.cells):
        cell = copy.deepcopy(cell)
        gid = grade_id(cell)
        if gid is not None and gid not in src_cells:
            flags.append(Flag("repaired-metadata", f"unknown grade_id {gid!r}: graded as an ordinary cell", gid))
            cell.metadata.pop("nbgrader", None)
            gid = None
        if gid is None:
            out.append(cell)
            continue
        src = src_cells[gid]
        kind = cell_kind(src)
        if kind in {"test", "locked"}:
            if gid in seen:
                flags.append(Flag("dropped-duplicate", "an extra copy of a locked or test cell was removed", gid))
                continue
            if kind == "test":
                claim = _passed(cell)
                if claim is not None:
                    claimed[gid] = claim
            given_source = rel_cells[gid].source if gid in rel_cells else src.source
            if _norm(cell.get("source", "")) != _norm(given_source) or cell.cell_type != src.cell_type:
                flags.append(Flag("restored-locked", "edited; restored from the source", gid))
            elif _meta_changed(cell, src):
                flags.append(Flag("repaired-metadata", "grading metadata restored", gid))
            out.append(copy.deepcopy(src))
        else:
            if i != keeper.get(gid):
                flags.append(Flag("dropped-duplicate", "a second copy of this answer cell: kept as an ordinary cell", gid))
                cell.metadata.pop("nbgrader", None)
                out.append(cell)
                continue
            if _meta_changed(cell, src) or cell.cell_type != src.cell_type:
                flags.append(Flag("repaired-metadata", "grading metadata restored", gid))
            fixed = copy.deepcopy(src)
            fixed.source = cell.get("source", "")
            if cell.cell_type != src.cell_type:
                fixed.source = cell.get("source", "") if src.cell_type == "markdown" else rel_cells.get(gid, src).source
            out.append(fixed)
        seen.add(gid)

    known = sum(cell_kind(src_cells[g]) in {"test", "solution", "manual"} for g in seen)
    for gid in src_order:                                   # re-add what is missing, in source order
        if gid in seen:
            continue
        kind = cell_kind(src_cells[gid])
        cell = copy.deepcopy(src_cells[gid] if kind in {"test", "locked"} else rel_cells.get(gid, src_cells[gid]))
        prev = src_order[: src_order.index(gid)]
        at = 0
        for p in reversed(prev):
            idx = next((j for j, c in enumerate(out) if grade_id(c) == p), None)
            if idx is not None:
                at = idx + 1
                break
        out.insert(at, cell)
        seen.add(gid)
        what = "re-added from the source" if kind in {"test", "locked"} else "re-added as the stub"
        flags.append(Flag("readded-cell", f"deleted; {what}", gid))

    kinds = []
    for cell in out:
        if cell.cell_type == "code":
            cell.outputs, cell.execution_count = [], None
            cell.metadata.pop("execution", None)
        kind = cell_kind(cell)
        if kind == "plain":
            if cell.cell_type != "code":
                kind = "markdown"
            else:
                kind = "given" if _norm(cell.source) in given else "student"
        kinds.append(kind)
    _unique_ids(out)
    nb = copy.deepcopy(submitted)
    nb.cells = out
    nb.metadata.pop("widgets", None)
    nb.metadata["kernelspec"] = copy.deepcopy(source.metadata.get("kernelspec", {}))
    return Repaired(nb=nb, kinds=kinds, flags=flags, claimed=claimed, known_ids=known)


def _meta_changed(cell: NotebookNode, src: NotebookNode) -> bool:
    """Did the student change what grading reads (flags and points; checksums and versions aside)?"""
    mine, theirs = cell.get("metadata", {}).get("nbgrader", {}), src.metadata.get("nbgrader", {})
    flags_changed = any(bool(mine.get(k)) != bool(theirs.get(k)) for k in ("grade", "solution", "locked", "task"))
    return flags_changed or float(mine.get("points", 0) or 0) != float(theirs.get("points", 0) or 0)


def _unique_ids(cells: list[NotebookNode]) -> None:
    """nbformat 4.5 cell ids must be unique; a copy keeps its original's, so give later copies new ones."""
    seen: set[str] = set()
    for i, cell in enumerate(cells):
        cid = cell.get("id")
        if cid is None:
            continue
        if cid in seen:
            cell["id"] = f"{cid[:40]}-{i}"
        seen.add(cell["id"])
