"""Where submissions come from: nbgrader's folders, an LMS zip, and the class list.

- nbgrader's layout (what `nbgrader collect` and the exchange produce):
  `<submitted>/<student>/<lab>/<lab>.ipynb` (an optional `timestamp.txt` next to it is kept).
- A zip (`make grade ZIP=...`), extracted into that layout. Two namings are understood:
  1. folders per student: `<student>/<lab>.ipynb` or `<student>/<lab>/<lab>.ipynb`, possibly all
     under one top folder (`class/alice/01_inference.ipynb`);
  2. nbgrader's `zip_collect` example naming, one flat file per submission:
     `<anything>_<student>_attempt_<timestamp>_<lab>.ipynb` (Blackboard); of several attempts
     the latest timestamp wins.
  Anything else in the zip is listed as skipped, never guessed at.
- A student list: CSV with a header, columns `id` (or `student_id`/`username`), optional `name`
  (or `first_name`/`last_name`) and `email`.
"""
from __future__ import annotations

import csv
import re
import zipfile
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

STUDENT_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._@+-]*$")
ATTEMPT = re.compile(r"^.*_(?P<student>[A-Za-z0-9.@+-]+)_attempt_(?P<timestamp>[0-9-]+)_(?P<lab>[\w.-]+)\.ipynb$")


@dataclass(frozen=True)
class Student:
    id: str
    name: str = ""
    email: str = ""


def find_submissions(submitted: Path, labs: list[str]) -> dict[tuple[str, str], Path]:
    """{(student, lab): notebook} for every `<submitted>/<student>/<lab>/<lab>.ipynb` of a known lab."""
    found = {}
    if not submitted.is_dir():
        return found
    for student_dir in sorted(p for p in submitted.iterdir() if p.is_dir() and not p.name.startswith(".")):
        for lab in labs:
            nb = student_dir / lab / f"{lab}.ipynb"
            if nb.is_file():
                found[(student_dir.name, lab)] = nb
    return found


def extract_zip(zip_path: Path, submitted: Path, labs: list[str]) -> tuple[list[tuple[str, str]], list[str]]:
    """Unpack an LMS zip into nbgrader's layout under `submitted`. Returns ([(student, lab)], [skipped names])."""
    if not zipfile.is_zipfile(zip_path):
        raise ValueError(f"ZIP must be a zip file of submissions, got {zip_path}")
    chosen: dict[tuple[str, str], tuple[str, zipfile.ZipInfo]] = {}   # (student, lab) -> (timestamp, entry)
    skipped = []
    with zipfile.ZipFile(zip_path) as zf:
        for info in zf.infolist():
            parts = PurePosixPath(info.filename).parts
            if info.is_dir() or any(p in {"__MACOSX", ".ipynb_checkpoints"} for p in parts):
                continue
            if info.filename.startswith("/") or any(p.startswith(".") for p in parts):
                skipped.append(info.filename)   # hidden files, and paths that climb out of the folder
                continue
            hit = _parse(parts, labs)
            if hit is None:
                skipped.append(info.filename)
                continue
            student, lab, stamp = hit
            if (student, lab) not in chosen or stamp > chosen[(student, lab)][0]:
                chosen[(student, lab)] = (stamp, info)
        for (student, lab), (stamp, info) in sorted(chosen.items()):
            dest = submitted / student / lab
            dest.mkdir(parents=True, exist_ok=True)
            (dest / f"{lab}.ipynb").write_bytes(zf.read(info))   # never extract by the entry's own path
            if stamp:
                (dest / "timestamp.txt").write_text(_timestamp(stamp))
    return sorted(chosen), skipped


def _parse(parts: tuple[str, ...], labs: list[str]) -> tuple[str, str, str] | None:
    """(student, lab, timestamp or '') for a zip entry, or None when it is not a submission."""
    name = parts[-1]
    m = ATTEMPT.match(name)
    if m and m["lab"] in labs and STUDENT_ID.match(m["student"]):
        return m["student"], m["lab"], m["timestamp"]
    lab = name[:-len(".ipynb")] if name.endswith(".ipynb") else None
    if lab not in labs or len(parts) < 2:
        return None
    student = parts[-3] if parts[-2] == lab and len(parts) >= 3 else parts[-2]
    return (student, lab, "") if STUDENT_ID.match(student) and student != lab else None


def _timestamp(stamp: str) -> str:
    """'2017-03-09-09-36-17' -> '2017-03-09 09:36:17' (nbgrader's timestamp.txt format)."""
    bits = stamp.split("-")
    if len(bits) == 6:
        return f"{bits[0]}-{bits[1]}-{bits[2]} {bits[3]}:{bits[4]}:{bits[5]}"
    return stamp


def read_students(path: Path) -> list[Student]:
    """The class list from a CSV with a header row (see the module docstring)."""
    with open(path, newline="", encoding="utf-8-sig") as f:
        rows = list(csv.DictReader(f))
    if not rows:
        return []
    cols = {c.strip().lower(): c for c in rows[0]}
    id_col = next((cols[c] for c in ("id", "student_id", "username") if c in cols), None)
    if id_col is None:
        raise ValueError(f"STUDENTS must be a CSV with a header naming an `id` column (id, name, email); "
                         f"{path} has columns {list(rows[0])}")
    students, seen = [], set()
    for row in rows:
        sid = (row.get(id_col) or "").strip()
        if not sid or sid in seen:
            continue
        if not STUDENT_ID.match(sid):
            raise ValueError(f"STUDENTS: {path}: student id {sid!r} must be letters, digits and . _ @ + -")
        seen.add(sid)
        name = (row.get(cols.get("name", ""), "") or " ".join(
            filter(None, [row.get(cols.get("first_name", ""), ""), row.get(cols.get("last_name", ""), "")]))).strip()
        students.append(Student(sid, name, (row.get(cols.get("email", ""), "") or "").strip()))
    return students
