"""Gradescope's autograder (`make gradescope LAB=...`) and Canvas's gradebook CSV: the formats schools
use, fed by the same grader as `make grade`."""
import csv
import io
import json
import os
import subprocess
import zipfile

import nbformat
import pytest

from autograder import REPO, lab_notebook
from autograder.fixtures import full_solution, lab_spec, with_bug, without_demos
from autograder.grade import collect, report
from autograder.grade.outcome import Outcome
from autograder.gradescope import build_zip
from autograder.release import generate_release

LAB = "02_prefill_decode"


def test_the_zip_holds_setup_run_autograder_and_the_course_at_this_commit(tmp_path):
    path = build_zip(LAB, tmp_path)
    with zipfile.ZipFile(path) as z:
        names = set(z.namelist())
        modes = {i.filename: (i.external_attr >> 16) & 0o777 for i in z.infolist()}
        run = z.read("run_autograder").decode()
    assert {"setup.sh", "run_autograder", "source/Makefile", "source/autograder/gradescope.py",
            f"source/labs/{LAB}/{LAB}.ipynb"} <= names
    assert modes["run_autograder"] == modes["setup.sh"] == 0o755
    assert f"-m autograder.gradescope run {LAB}" in run
    assert not any(n.startswith(("source/autograder/submitted", "source/.venv", "source/build")) or
                   n.endswith("gradebook.db") for n in names), "no student work, gradebook or build output"
    with pytest.raises(ValueError, match="LAB must be one of"):
        build_zip("02_prefill", tmp_path)


@pytest.mark.slow
def test_run_autograder_writes_results_json_that_agrees_with_the_courses_grades(tmp_path):
    """The zip's run_autograder, in an /autograder-shaped folder, on an honest and a buggy submission."""
    source = nbformat.read(lab_notebook(LAB), 4)
    release = nbformat.read(generate_release(LAB, release_dir=tmp_path / "release", gradebook=None), 4)
    full = without_demos(full_solution(release, source), source)
    bug = lab_spec(LAB, source)[0]
    root = tmp_path / "autograder"
    with zipfile.ZipFile(build_zip(LAB, tmp_path / "zip")) as z:
        z.extract("run_autograder", root)
    (root / "source").symlink_to(REPO)                        # the unpacked course, set up (.venv)
    for name, nb, fails in (("honest", full, set()), ("buggy", with_bug(full, LAB, bug), set(bug.fails))):
        sub = root / "submission"
        sub.mkdir(parents=True, exist_ok=True)
        for old in sub.iterdir():
            old.unlink()
        nbformat.write(nb, sub / f"{LAB}.ipynb")
        done = subprocess.run(["bash", str(root / "run_autograder")], env={**os.environ, "GRADESCOPE_ROOT": str(root)},
                              capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-2000:]
        results = json.loads((root / "results" / "results.json").read_text())
        tests = {t["name"]: t for t in results["tests"]}
        assert tests and all(t["visibility"] == "visible" for t in tests.values())
        for gid, t in tests.items():
            if gid in fails:
                assert t["score"] < t["max_score"] and t["output"].startswith(("FAILED", "PARTIAL")), (name, t)
            else:
                assert t["score"] == t["max_score"] and t["output"].startswith("PASSED"), (name, t)
        assert results["score"] == pytest.approx(sum(t["score"] for t in tests.values()))
        assert "sandbox-off" not in results["output"]


def test_run_autograder_asks_for_the_right_notebook(tmp_path):
    from autograder.gradescope import results

    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "a.ipynb").write_text("{}")
    (tmp_path / "sub" / "b.ipynb").write_text("{}")
    said = results(LAB, tmp_path / "sub")
    assert said["score"] == 0 and said["tests"] == []
    assert f"Submit one notebook, {LAB}.ipynb (found: a.ipynb, b.ipynb)" in said["output"]


def test_canvas_csv_has_the_import_layout(tmp_path):
    outcomes = [Outcome("ada", "01_inference", 8, 10), Outcome("ada", LAB, 13, 13), Outcome("bob", "01_inference", 0, 10)]
    path = report.write_canvas_csv(outcomes, tmp_path / "canvas.csv",
                                   [collect.Student("ada", "Lovelace, Ada", "ada@uni.edu"), collect.Student("bob")])
    rows = list(csv.reader(io.StringIO(path.read_text())))
    assert rows[0] == ["Student", "ID", "SIS User ID", "SIS Login ID", "Section", "01_inference", LAB]
    assert rows[1] == ["    Points Possible", "", "", "", "", "10", "13"]
    assert rows[2] == ["Lovelace, Ada", "", "ada", "ada@uni.edu", "", "8", "13"]
    assert rows[3] == ["bob", "", "bob", "", "", "0", ""], "no submission: an empty cell, which Canvas leaves alone"
