"""The nbgrader side of the course: where things live, which labs exist, the loaded nbgrader config.

`autograder/` is the nbgrader course root. The instructor's source notebooks are NOT under
`autograder/source/` as nbgrader expects by default but in `labs/` (see `nbgrader_config.py`),
so that the labs students and readers see are the same files the releases are made from.
"""
from __future__ import annotations

import sys
from pathlib import Path

# Every grading process reads notebooks with nbformat, which validates with jsonschema, which imports
# rfc3987_syntax where it is installed (jupyter-events asks for it): that builds an IRI grammar at
# import time, 1.4 s in each of a class's worker processes. No notebook schema has an IRI field.
sys.modules.setdefault("rfc3987_syntax", None)

from traitlets.config import Config
from traitlets.config.loader import PyFileConfigLoader

ROOT = Path(__file__).resolve().parent          # the nbgrader course root
REPO = ROOT.parent
LABS = REPO / "labs"                            # one folder per lab: labs/01_inference/01_inference.ipynb
RELEASE = ROOT / "release"                      # student versions: autograder/release/<lab>/
GRADEBOOK = ROOT / "gradebook.db"               # as in nbgrader_config.py
CONFIG_FILE = ROOT / "nbgrader_config.py"
# The lines nbgrader's source notebooks mark regions with (here, not in checks.py, so that code that
# reads notebooks without grading them, such as the GPU machine's kernel tests, needs no nbgrader)
SOLUTION_MARKERS = ("### BEGIN SOLUTION", "### END SOLUTION")
HIDDEN_MARKERS = ("### BEGIN HIDDEN TESTS", "### END HIDDEN TESTS")


def lab_names(labs_dir: Path | str = LABS) -> list[str]:
    """The labs, sorted: every folder of `labs_dir` not starting with '_' or '.'. Each is one assignment."""
    labs_dir = Path(labs_dir)
    if not labs_dir.is_dir():
        raise FileNotFoundError(f"labs_dir must be a folder of lab folders, got {labs_dir} (missing)")
    return sorted(p.name for p in labs_dir.iterdir() if p.is_dir() and not p.name.startswith(("_", ".")))


def lab_notebook(lab: str, labs_dir: Path | str = LABS) -> Path:
    """The source notebook of `lab`: `<labs_dir>/<lab>/<lab>.ipynb` (a lab holds exactly this notebook)."""
    path = Path(labs_dir) / lab / f"{lab}.ipynb"
    if not path.is_file():
        known = ", ".join(lab_names(labs_dir)) or "none"
        raise FileNotFoundError(f"lab {lab!r} must be a folder holding {lab}.ipynb; no {path} (labs: {known})")
    return path


def load_config() -> Config:
    """The course's nbgrader configuration, as `nbgrader` itself reads it from `nbgrader_config.py`.

    Loading it also sets, in this process, COURSE_QUICK=1 unless already set (kernels started from
    here run in quick mode, as under `nbgrader autograde`) and puts the venv's bin folder on PATH
    (nbgrader runs `alembic` from PATH to open a gradebook). Run nbgrader commands from `autograder/`.
    """
    return PyFileConfigLoader(CONFIG_FILE.name, path=str(ROOT)).load_config()
