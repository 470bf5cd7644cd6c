"""Student versions of the labs: `python -m autograder.release [lab ...]` (what `make release` runs).

For each lab: strip outputs and widget state from the SOURCE notebook in place (anything stored
there would leak into the release), run `nbgrader generate_assignment` (solutions become stubs,
hidden tests vanish, the lab folder's data files come along, the gradebook learns the cells),
then strip the release copy too, and write the course's install location into its first cell
(`install_source()`: the one setting an instructor makes, see README). No notebook is executed, so
this takes seconds.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys
from pathlib import Path

import nbformat
from nbgrader.converters import GenerateAssignment
from nbgrader.coursedir import CourseDirectory
from nbgrader.utils import capture_log

from autograder import GRADEBOOK, LABS, RELEASE, REPO, ROOT, lab_names, lab_notebook, load_config

INSTALL_ENV = "COURSE_INSTALL"            # overrides pyproject.toml's [tool.course] install, e.g. for a test
INSTALL_LINE = re.compile(r'^COURSE_INSTALL = ".*"', re.M)


def install_source(pyproject: Path = REPO / "pyproject.toml") -> str:
    """Where students' notebooks install the course from: $COURSE_INSTALL if set, else the `install`
    key of pyproject.toml's [tool.course] table (anything pip accepts: a git URL, a wheel's URL, a
    package name). Empty when the instructor has not set it."""
    if os.environ.get(INSTALL_ENV):
        return os.environ[INSTALL_ENV].strip()
    try:
        import tomllib
    except ImportError:  # Python 3.10: read the one line
        m = re.search(r'^\[tool\.course\][^\[]*?^install\s*=\s*"([^"]*)"', pyproject.read_text(), re.M | re.S)
        return m.group(1).strip() if m else ""
    return str(tomllib.loads(pyproject.read_text()).get("tool", {}).get("course", {}).get("install", "")).strip()


def set_install_source(path: Path | str, source: str) -> None:
    """Write `source` into the COURSE_INSTALL line of the notebook's install cell (grade id colab_install)."""
    path = Path(path)
    nb = nbformat.read(path, as_version=4)
    for cell in nb.cells:
        if cell.get("metadata", {}).get("nbgrader", {}).get("grade_id") == "colab_install":
            if not INSTALL_LINE.search(cell.source):
                raise ValueError(f"{path}: the colab_install cell has no COURSE_INSTALL line to fill in")
            cell.source = INSTALL_LINE.sub(lambda _: f"COURSE_INSTALL = {json.dumps(source)}", cell.source, count=1)
            nbformat.write(nb, path)
            return


def strip_notebook(path: Path | str) -> bool:
    """Remove outputs, execution counts, timing metadata and `metadata.widgets` from the notebook
    at `path`, in place. Writes only when something changed (no reformatting churn); returns that."""
    path = Path(path)
    nb = nbformat.read(path, as_version=4)
    changed = nb.metadata.pop("widgets", None) is not None
    for cell in nb.cells:
        if cell.cell_type != "code":
            continue
        if cell.outputs or cell.execution_count is not None or "execution" in cell.metadata:
            cell.outputs, cell.execution_count = [], None
            cell.metadata.pop("execution", None)
            changed = True
    if changed:
        nbformat.write(nb, path)
    return changed


def generate_release(
    lab: str,
    labs_dir: Path | str = LABS,
    release_dir: Path | str = RELEASE,
    gradebook: Path | str | None = GRADEBOOK,
) -> Path:
    """Run nbgrader's generate_assignment for `lab` into `<release_dir>/<lab>/`; return the notebook.

    `gradebook` is the SQLite file that learns the lab's cells and checksums (autograding needs
    them); None records nothing, for previews and tests (also faster: nbgrader spends ~2 s running
    `alembic` when it creates a gradebook). Defaults are the course's folders and gradebook.
    Raises RuntimeError with nbgrader's log when nbgrader refuses the notebook (bad metadata,
    markers outside solution or test cells, duplicate grade ids).
    """
    labs_dir, release_dir = Path(labs_dir).resolve(), Path(release_dir).resolve()
    lab_notebook(lab, labs_dir)  # a clear error before nbgrader's own
    cfg = load_config()
    # Relative to the course root: nbgrader does not regex-escape these parts (nbgrader_config.py).
    cfg.CourseDirectory.source_directory = os.path.relpath(labs_dir, ROOT)
    cfg.CourseDirectory.release_directory = os.path.relpath(release_dir, ROOT)
    if gradebook is None:  # what `nbgrader generate_assignment --no-db` sets
        cfg.GenerateAssignment.no_database = True
        cfg.SaveCells.enabled = False
    else:
        cfg.CourseDirectory.db_url = f"sqlite:///{Path(gradebook).resolve()}"
    coursedir = CourseDirectory(config=cfg)
    coursedir.assignment_id = lab
    app = GenerateAssignment(coursedir=coursedir, config=cfg)
    app.force = True  # replace an earlier release of this lab entirely
    result = capture_log(app)
    if not result["success"]:
        raise RuntimeError(
            f"nbgrader generate_assignment failed for lab {lab!r}:\n{result.get('log', '')}\n{result.get('error', '')}"
        )
    out = release_dir / lab / f"{lab}.ipynb"
    strip_notebook(out)
    set_install_source(out, install_source())
    return out


def release(labs: list[str], labs_dir: Path | str = LABS, release_dir: Path | str = RELEASE,
            gradebook: Path | str | None = GRADEBOOK) -> list[Path]:
    """Strip each lab's source in place, then generate its student version. Returns the notebooks."""
    outs = []
    for lab in labs:
        if strip_notebook(lab_notebook(lab, labs_dir)):
            print(f"stripped stored outputs / widget state from the source of {lab}")
        outs.append(generate_release(lab, labs_dir, release_dir, gradebook))
    return outs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m autograder.release", description=__doc__.splitlines()[0])
    parser.add_argument("labs", nargs="*", help="lab folder names, e.g. 01_inference (default: every lab)")
    args = parser.parse_args(argv)
    labs = args.labs or lab_names()
    if not labs:
        print(f"no labs found in {LABS}", file=sys.stderr)
        return 1
    unknown = [lab for lab in labs if lab not in lab_names()]
    if unknown:
        parser.error(f"unknown lab(s) {', '.join(unknown)}; labs are: {', '.join(lab_names()) or 'none'}")
    if not install_source():
        print("note: no install location is set ([tool.course] install in pyproject.toml): on Colab, the first "
              "cell of each lab will ask students for it", file=sys.stderr)
    for out in release(labs):
        print(f"student version: {os.path.relpath(out)}")
    print(f"hand out the lab folders in {os.path.relpath(RELEASE)}/ "
          f"(the gradebook {os.path.relpath(GRADEBOOK)} now knows their cells, for grading)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
