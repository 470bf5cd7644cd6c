"""Gradescope: the same grader, packed as Gradescope's autograder.

    make gradescope LAB=02_prefill_decode      # -> build/gradescope/02_prefill_decode/autograder.zip

Upload the zip as a Programming Assignment's autograder (Ubuntu base image). Gradescope unpacks it
into /autograder/source, runs `setup.sh` once when it builds the image (`make setup`: a virtual
environment, the course and its model; the network is there then), and for every submission runs
`run_autograder`, which calls `python -m autograder.gradescope run LAB`: the student's notebook from
/autograder/submission/ graded exactly as `make grade` grades it (repair, scan, the hidden tests,
partial credit), and /autograder/results/results.json written in Gradescope's format: the score,
one test per graded cell with the line the course's feedback shows for it, and the flags.

Gradescope runs each submission in a container of its own that it throws away afterwards. Where
bubblewrap can start in it, the kernel is sandboxed as on your machine; where it cannot (Docker
without user namespaces), the grader runs without the sandbox: the container is the sandbox, and
the `sandbox-off` flag is left out of what the student sees. The zip holds the lab's source notebook
(hidden tests included): Gradescope keeps autograders private to the course's staff.
CPU labs only: Gradescope's autograders have no GPU (10 minutes by default; quick mode takes 20-60 s).
"""
from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

import nbformat

from autograder import LABS, REPO, lab_names

SETUP = """#!/usr/bin/env bash
# Gradescope runs this once, when it builds the autograder's image (with the network).
set -euo pipefail
apt-get update -q && apt-get install -y -q make python3-venv python3-pip bubblewrap
cd /autograder/source
make setup
"""

RUN = """#!/usr/bin/env bash
# Gradescope runs this for every submission: /autograder/submission -> /autograder/results/results.json
cd "${{GRADESCOPE_ROOT:-/autograder}}/source"
exec .venv/bin/python -m autograder.gradescope run {lab}
"""


def build_zip(lab: str, out_dir: Path = REPO / "build" / "gradescope") -> Path:
    """Write `<out_dir>/<lab>/autograder.zip`: setup.sh, run_autograder and, under source/, the course as
    git sees it (files it tracks or would: no student work, no gradebook, no build output, no .venv)."""
    if lab not in lab_names():
        raise ValueError(f"LAB must be one of {', '.join(lab_names())}, got {lab!r}")
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=REPO,
                            capture_output=True, check=True).stdout.decode().split("\0")
    out = out_dir / lab / "autograder.zip"
    out.parent.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as z:
        for name, text in (("setup.sh", SETUP), ("run_autograder", RUN.format(lab=lab))):
            info = zipfile.ZipInfo(name)
            info.external_attr = 0o755 << 16
            z.writestr(info, text)
        for name in sorted(n for n in listed if n):
            path = REPO / name
            if path.is_file() and not path.is_symlink():
                z.write(path, f"source/{name}")
    return out


def _find_notebook(submission: Path, lab: str) -> Path | None:
    """The notebook to grade: the one named after the lab, else the only notebook there; None otherwise."""
    found = sorted(p for p in submission.rglob("*.ipynb") if ".ipynb_checkpoints" not in p.parts)
    named = [p for p in found if p.name == f"{lab}.ipynb"]
    if len(named) == 1:
        return named[0]
    return found[0] if not named and len(found) == 1 else None


def _grade(lab: str, notebook: Path, labs_dir: Path, sandboxed: bool, tmp: Path):
    """(outcome, {grade_id: graded cell}) for one notebook, graded as `make grade` grades it."""
    from autograder.grade.pipeline import Config, grade_all

    shutil.rmtree(tmp, ignore_errors=True)
    dest = tmp / "submitted" / "student" / lab / f"{lab}.ipynb"
    dest.parent.mkdir(parents=True)
    shutil.copyfile(notebook, dest)
    cfg = Config(submitted=tmp / "submitted", autograded=tmp / "autograded", feedback=tmp / "feedback",
                 gradebook=None, out=tmp / "out", labs_dir=labs_dir, labs=[lab], sandbox=sandboxed)
    (outcome,) = grade_all(cfg, log=lambda line: None)
    graded = tmp / "autograded" / "student" / lab / f"{lab}.ipynb"
    cells = {}
    if graded.is_file():
        cells = {c.metadata.get("nbgrader", {}).get("grade_id"): c for c in nbformat.read(graded, as_version=4).cells}
    return outcome, cells


def results(lab: str, submission: Path, labs_dir: Path = LABS) -> dict:
    """Grade the one notebook in `submission` as `make grade` does; Gradescope's results.json as a dict.
    Sandboxed where bubblewrap starts; otherwise (Gradescope's Docker) the container is the sandbox."""
    from autograder.grade import feedback
    from autograder.grade.sandbox import SandboxUnavailable

    notebook = _find_notebook(submission, lab)
    if notebook is None:
        names = sorted(p.name for p in submission.rglob("*.ipynb"))
        return {"score": 0, "output": f"Submit one notebook, {lab}.ipynb (found: {', '.join(names) or 'none'}).",
                "tests": []}
    with tempfile.TemporaryDirectory(prefix="gradescope-") as tmp:
        try:
            outcome, cells = _grade(lab, notebook, labs_dir, True, Path(tmp) / "run")
        except SandboxUnavailable:
            outcome, cells = _grade(lab, notebook, labs_dir, False, Path(tmp) / "run")
    tests = [{"name": c.grade_id, "score": c.score, "max_score": c.points, "visibility": "visible",
              "output": feedback.result_line(cells[c.grade_id], c) if c.grade_id in cells else f"{c.status}: {c.why}"}
             for c in outcome.cells]
    flags = [f for f in outcome.flags if f.code != "sandbox-off"]     # Gradescope's container is the sandbox
    lines = [f"{lab}: {outcome.score:g} / {outcome.max_score:g}"]
    if outcome.status != "graded":
        lines.append(f"Not graded: {outcome.reason}")
    lines += [f"Flag: {f.short()}{': ' + f.detail if f.detail else ''}" for f in flags]
    if any(m.answered for m in outcome.manual):
        lines.append("Your written answers are graded by hand: they are not in this score.")
    return {"score": outcome.score, "output": "\n".join(lines), "tests": tests}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m autograder.gradescope", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    zip_ = sub.add_parser("zip", help="write build/gradescope/LAB/autograder.zip")
    zip_.add_argument("lab")
    run = sub.add_parser("run", help="on Gradescope: grade /autograder/submission into results.json")
    run.add_argument("lab")
    run.add_argument("--root", type=Path, help="Gradescope's folder (default $GRADESCOPE_ROOT or /autograder)")
    args = parser.parse_args(argv)
    if args.command == "zip":
        try:
            print(f"Gradescope autograder: {build_zip(args.lab)}")
        except ValueError as e:
            print(f"make gradescope: {e}", file=sys.stderr)
            return 2
        return 0
    import os

    root = args.root or Path(os.environ.get("GRADESCOPE_ROOT", "/autograder"))
    found = results(args.lab, root / "submission")
    (root / "results").mkdir(parents=True, exist_ok=True)
    (root / "results" / "results.json").write_text(json.dumps(found, indent=1))
    print(found["output"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
