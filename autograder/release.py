"""Student versions of the labs: `python -m autograder.release [lab ...]` (what `make release` runs).

For each lab: strip outputs and widget state from the SOURCE notebook in place (anything stored
there would leak into the release), run `nbgrader generate_assignment` (solutions become stubs,
hidden tests vanish, the lab folder's data files come along, the gradebook learns the cells),
then strip the release copy too. No notebook is executed, so this takes seconds.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import nbformat
from nbgrader.converters import GenerateAssignment
from nbgrader.coursedir import CourseDirectory
from nbgrader.utils import capture_log

from autograder import GRADEBOOK, LABS, RELEASE, ROOT, lab_names, lab_notebook, load_config


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
    for out in release(labs):
        print(f"student version: {os.path.relpath(out)}")
    print(f"hand out the lab folders in {os.path.relpath(RELEASE)}/ "
          f"(the gradebook {os.path.relpath(GRADEBOOK)} now knows their cells, for grading)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
