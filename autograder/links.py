"""`make links`: one nbgitpuller link per lab, for a JupyterHub (Markdown and CSV, into build/links/).

A student clicks the link, logs in to the hub, and nbgitpuller clones (or, the next time, merges)
the repository of student versions into their home, then opens the lab in JupyterLab:

    HUB/hub/user-redirect/git-pull?repo=REPO&branch=BRANCH&targetpath=FOLDER&urlpath=lab/tree/FOLDER/LAB/LAB.ipynb

REPO is a git repository holding `make release`'s folders at its top (`01_inference/01_inference.ipynb`,
...): push `autograder/release/` there. `urlpath` must start with the clone's folder, FOLDER, which the
link also sets with `targetpath`. Keep FOLDER equal to nbgrader's course id when students submit through
nbgrader's exchange: with `path_includes_course` (deploy/hub/nbgrader_config.py), nbgrader looks for the
lab in `~/COURSE_ID/LAB/`, which is then exactly where nbgitpuller put it, and the Assignments tab
offers "Submit" for it.
"""
from __future__ import annotations

import argparse
import csv
import sys
from pathlib import Path
from urllib.parse import quote, urlencode, urlsplit

from autograder import REPO, lab_names, lab_notebook
from autograder.site import lab_info

OUT = REPO / "build" / "links"
DEFAULT_FOLDER = "llm-inference"   # = c.CourseDirectory.course_id in deploy/hub/nbgrader_config.py


def _check_url(value: str, what: str, schemes: tuple[str, ...]) -> str:
    parts = urlsplit(value)
    if parts.scheme not in schemes or not (parts.netloc or parts.scheme == "file"):
        raise ValueError(f"{what} must be a URL starting with {' or '.join(s + '://' for s in schemes)}, got {value!r}")
    return value.rstrip("/")


def lab_link(hub: str, repo: str, lab: str, branch: str = "main", folder: str = DEFAULT_FOLDER) -> str:
    """The nbgitpuller link that opens `lab` in JupyterLab on `hub`, cloned from `repo` into ~/`folder`."""
    hub = _check_url(hub, "HUB", ("https", "http"))
    repo = _check_url(repo, "REPO", ("https", "http", "file"))
    if not folder or "/" in folder or folder in {".", ".."}:
        raise ValueError(f"FOLDER must be one folder name (the clone's folder in the student's home), got {folder!r}")
    if not branch:
        raise ValueError("BRANCH must not be empty")
    query = urlencode({"repo": repo, "branch": branch, "targetpath": folder,
                       "urlpath": f"lab/tree/{folder}/{lab}/{lab}.ipynb"}, quote_via=quote, safe="")
    return f"{hub}/hub/user-redirect/git-pull?{query}"


def lab_title(lab: str) -> str:
    """The lab's title as its first heading gives it, e.g. "Lab 01: Inference, one token at a time"."""
    info = lab_info(lab_notebook(lab), lab)
    return f"Lab {info.number}: {info.title}"


def write_links(hub: str, repo: str, branch: str = "main", folder: str = DEFAULT_FOLDER,
                labs: list[str] | None = None, out: Path = OUT) -> tuple[Path, Path]:
    """links.md (a table to paste into a course page) and links.csv (lab, title, url); returns both paths."""
    rows = [(lab, lab_title(lab), lab_link(hub, repo, lab, branch, folder)) for lab in (labs or lab_names())]
    out.mkdir(parents=True, exist_ok=True)
    md, table = out / "links.md", out / "links.csv"
    md.write_text("| lab | open on the hub |\n|---|---|\n"
                  + "".join(f"| {title} | [open {lab}]({url}) |\n" for lab, title, url in rows))
    with table.open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["lab", "title", "url"])
        writer.writerows(rows)
    return md, table


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m autograder.links", description=__doc__.splitlines()[0])
    parser.add_argument("--hub", required=True, help="the hub's address, e.g. https://hub.example.edu")
    parser.add_argument("--repo", required=True, help="git repository of the student versions (https:// or file://)")
    parser.add_argument("--branch", default="main")
    parser.add_argument("--folder", default=DEFAULT_FOLDER, help="clone folder in each student's home "
                        "(= nbgrader's course id if students submit through the exchange)")
    parser.add_argument("labs", nargs="*", help="labs (default: every lab)")
    args = parser.parse_args(argv)
    unknown = [lab for lab in args.labs if lab not in lab_names()]
    if unknown:
        parser.error(f"unknown lab(s) {', '.join(unknown)}; labs are: {', '.join(lab_names())}")
    try:
        md, table = write_links(args.hub, args.repo, args.branch, args.folder, args.labs or None)
    except ValueError as e:
        parser.error(str(e))
    print(md.read_text(), end="")
    print(f"written: {md.relative_to(REPO) if md.is_relative_to(REPO) else md} and {table.name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
