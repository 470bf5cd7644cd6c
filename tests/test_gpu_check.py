"""The GPU proof's CPU side: it refuses to claim anything without a GPU, scores executed notebooks
as nbgrader would, runs a lab and collects what it recorded, and writes its report."""
import subprocess
import sys

from nbformat.v4 import new_code_cell, new_notebook, new_output

from autograder import REPO, authoring
from autograder.gpu_check import Cell, LabRun, Step, run_lab, score_notebook, write_report


def test_without_a_gpu_it_says_so_and_fails(tmp_path):
    out = tmp_path / "report.md"
    done = subprocess.run([sys.executable, "-m", "autograder.gpu_check", "--labs", "01_inference", "--out", str(out)],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "no CUDA device" in done.stderr and "checked nothing" in done.stderr
    assert not out.exists(), "without a GPU no report may claim anything"


def test_scoring_follows_nbgrader_errors_and_stderr_score_zero():
    meta = lambda gid: {"nbgrader": {"grade": True, "solution": False, "locked": True, "grade_id": gid, "points": 2}}
    nb = new_notebook(cells=[new_code_cell("x = 1"), new_code_cell("assert x", metadata=meta("ok")),
                             new_code_cell("assert 0, 'no'", metadata=meta("bad")),
                             new_code_cell("import sys", metadata=meta("warn"))])
    nb.cells[2].outputs = [new_output("error", ename="AssertionError", evalue="no", traceback=[])]
    nb.cells[3].outputs = [new_output("stream", name="stderr", text="UserWarning: careful")]
    cells, errors = score_notebook(nb)
    assert [(c.grade_id, c.score) for c in cells] == [("ok", 2), ("bad", 0), ("warn", 0)]
    assert errors == {"bad": "AssertionError: no"} and "stderr" in cells[2].why


def test_a_lab_run_collects_scores_and_measurements(tmp_path):
    authoring.write_notebook(tmp_path / "00_tiny" / "00_tiny.ipynb", [
        authoring.locked("setup", "import course\nenv = course.setup(verbose=False)"),
        authoring.solution("f", "def f():\n    ### BEGIN SOLUTION\n    return 2\n    ### END SOLUTION"),
        authoring.tests("f_tests", 1, "assert f() == 2, 'f() is 2'"),
        authoring.code("from course.report import record\nrecord('twice', 2 * f(), 'x', 'f doubles', device=env.device)"),
    ])
    run = run_lab("00_tiny", "quick", timeout=120, labs_dir=tmp_path)
    assert run.ok and run.score == 1, (run.failure, run.errors, run.cells)
    assert run.measurements == [{"key": "twice", "value": 4.0, "unit": "x", "claim": "f doubles", "device": "cpu"}]


def test_report_shows_failures_times_and_claims(tmp_path):
    runs = [LabRun("03_kv_cache", "quick", 20.0, [Cell("a", 2, 2)], measurements=[
                {"key": "speedup", "value": 6.4, "unit": "x", "claim": "the cache is faster", "dtype": "bf16"}]),
            LabRun("03_kv_cache", "full", 250.0, [Cell("a", 2, 2)], measurements=[
                {"key": "speedup", "value": 7.1, "unit": "x", "claim": "the cache is faster", "dtype": "bf16"}]),
            LabRun("06_triton_kernels", "quick", 30.0, [Cell("v1", 4, 0, "AssertionError: max diff")],
                   errors={"v1": "AssertionError: max diff"})]
    text = write_report(tmp_path / "r.md", {"device": "NVIDIA H100", "torch": "2.11"},
                        runs, [Step("kernels", "skipped", "pytest is not installed here")])
    assert (tmp_path / "r.md").read_text() == text
    assert "| 03_kv_cache | full | 250 | 2/2 | 0 | over 180 s |" in text, "a full run past 3 minutes is called out"
    assert "| 06_triton_kernels | quick | 30 | 0/4 | 1 | FAILED |" in text and "`v1` 0/4: AssertionError: max diff" in text
    assert "| the cache is faster | speedup | 6.4 x | 7.1 x | dtype=bf16 |" in text
    assert "NVIDIA H100" in text and "**kernels**: skipped" in text
