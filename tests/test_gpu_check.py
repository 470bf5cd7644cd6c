"""The GPU proof's CPU side: it refuses to claim anything without a GPU, scores executed notebooks
as nbgrader would, runs a lab and collects what it recorded, and writes its report."""
import subprocess
import sys

import nbformat
from nbformat.v4 import new_code_cell, new_notebook, new_output

from autograder import REPO, authoring
from autograder.gpu_check import TARGETS, Cell, LabRun, Step, run_lab, score_notebook, target_rows, write_report


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


def test_a_lab_run_collects_scores_and_measurements(tmp_path, monkeypatch):
    authoring.write_notebook(tmp_path / "00_tiny" / "00_tiny.ipynb", [
        authoring.locked("setup", "import course\nenv = course.setup(verbose=False)"),
        authoring.solution("f", "def f():\n    ### BEGIN SOLUTION\n    return 2\n    ### END SOLUTION"),
        authoring.tests("f_tests", 1, "assert f() == 2, 'f() is 2'"),
        authoring.code("from course.report import record\nrecord('twice', 2 * f(), 'x', 'f doubles', device=env.device)\n"
                       "import os\nrecord('optional_on', os.environ.get('COURSE_HF_COMPILE') == '1', '', 'the proof turns it on')\n"
                       "import torch\nrecord('threads', torch.get_num_threads(), '', 'its share of the cores')"),
    ])
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    run = run_lab("00_tiny", "quick", timeout=120, labs_dir=tmp_path, threads=1, keep=tmp_path / "kept", concurrent=3)
    assert run.ok and run.score == 1, (run.failure, run.errors, run.cells)
    kept = nbformat.read(tmp_path / "kept" / "00_tiny.quick.ipynb", 4)       # what gpu_record reads: the run's facts
    facts = kept.metadata["course_gpu_run"]
    assert (facts["mode"], facts["concurrent"], facts["device"]) == ("quick", 3, "no GPU") and facts["commit"] and facts["torch"]
    assert run.measurements == [{"key": "twice", "value": 4.0, "unit": "x", "claim": "f doubles", "device": "cpu"},
                                {"key": "optional_on", "value": 1.0, "unit": "", "claim": "the proof turns it on"},
                                {"key": "threads", "value": 1.0, "unit": "", "claim": "its share of the cores"}]


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


def _full(lab, **values):
    return LabRun(lab, "full", 60.0, [Cell("a", 1, 1)],
                  measurements=[{"key": k, "value": v, "unit": "x", "claim": "c"} for k, v in values.items()])


def test_targets_read_full_mode_only_and_say_met_missed_or_not_measured():
    runs = [_full("02_prefill_decode", graph_speedup=12.0),
            _full("03_kv_cache", kv_cache_speedup_graph=3.1, engine_batch1_tokens_per_s=350.0,
                  hf_static_compile_tokens_per_s=301.0),
            _full("08_speculative_decoding", spec_best_speedup_draft=0.8, spec_best_speedup_prompt_lookup=1.7,
                  spec_best_speedup_repeating_draft=1.2),
            LabRun("09_prefix_caching", "quick", 9.0, [Cell("a", 1, 1)],
                   measurements=[{"key": "prefix_cache_ttft_speedup", "value": 9.0, "unit": "x", "claim": "c"}])]
    verdicts = {(t.lab, t.key): (value, bound, verdict) for t, value, bound, verdict in target_rows(runs)}
    assert len(verdicts) == len(TARGETS)
    assert verdicts["02_prefill_decode", "graph_speedup"] == (12.0, 8.0, "met")
    assert verdicts["03_kv_cache", "kv_cache_speedup_graph"][2] == "MISSED"
    assert verdicts["03_kv_cache", "engine_batch1_tokens_per_s"] == (350.0, 301.0, "met"), "a bound read from another key"
    assert verdicts["08_speculative_decoding", "spec_best_speedup_*"] == (1.7, 1.5, "met (spec_best_speedup_prompt_lookup)"), \
        "the best drafter counts, and the verdict names it"
    assert verdicts["09_prefix_caching", "prefix_cache_ttft_speedup*"][2] == "not run in full mode", "quick mode never counts"
    assert verdicts["06_triton_kernels", "prefill_vs_sdpa_4096"][2] == "not run in full mode"
    runs.append(_full("06_triton_kernels", split_kv_vs_sdpa_32x1024=0.9))
    verdicts = {(t.lab, t.key): v for t, *_, v in target_rows(runs)}
    assert verdicts["06_triton_kernels", "prefill_vs_sdpa_4096"] == "not measured"


def test_a_deadline_leaves_out_what_would_start_late_and_the_report_keeps_what_ran(tmp_path, monkeypatch):
    """Each fake lab takes 100 s of a fake clock; with --deadline 150 the second lab starts at 100 s
    and runs to 200 s, the third lab and the kernel check never start, and the report written after
    each lab holds what finished."""
    import torch

    from autograder import gpu_check

    clock = [0.0]
    monkeypatch.setattr(gpu_check.time, "perf_counter", lambda: clock[0])
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(gpu_check, "device_facts", lambda: {"device": "a fake GPU"})
    reports = []

    def fake_run(lab, mode, timeout, keep=None):
        assert timeout == 900, "a cell keeps its whole time: cut short, it would read as a failure"
        reports.append(out.read_text() if out.exists() else "")
        clock[0] += 100
        return _full(lab, graph_speedup=9.0) if lab == "02_prefill_decode" else LabRun(lab, mode, 100.0, [Cell("a", 1, 1)])

    monkeypatch.setattr(gpu_check, "run_lab", fake_run)
    out = tmp_path / "report.md"
    code = gpu_check.main(["--labs", "01_inference", "02_prefill_decode", "03_kv_cache", "--modes", "full",
                           "--deadline", "150", "--no-class", "--out", str(out)])
    text = out.read_text()
    assert code == 0 and len(reports) == 2 and "| 01_inference | full |" in reports[1], "rewritten after each lab"
    assert "| 02_prefill_decode | full | 60 | 1/1 | 0 | ok |" in text and "| 03_kv_cache | full |" not in text
    assert "- 03_kv_cache, full mode" in text and "- Triton kernels compiled" in text
    assert "| issue 15: a CUDA-graph decode step >= 8x eager | 9 | 8 | met |" in text


def test_bad_arguments_name_the_argument(tmp_path):
    for args, word in ((["--jobs", "0"], "--jobs"), (["--deadline", "-5"], "--deadline"), (["--labs", "99_x"], "99_x")):
        done = subprocess.run([sys.executable, "-m", "autograder.gpu_check", *args, "--out", str(tmp_path / "r.md")],
                              cwd=REPO, capture_output=True, text=True, timeout=120)
        assert done.returncode == 2 and word in done.stderr, (args, done.stderr[-300:])


def test_a_quick_job_past_its_wall_clock_stop_does_not_start():
    import time

    from autograder.gpu_check import _run_lab_job
    assert _run_lab_job(("01_inference", "quick", 900, None, time.time() - 1, 4, 2)) is None


def test_the_grading_cuda_check_fails_on_a_machine_where_cuda_cannot_start():
    """The step that tries what `make grade --gpu` checks first; on this CPU machine it must fail, saying why."""
    from pathlib import Path

    import pytest

    from autograder.gpu_check import grading_cuda_check
    if list(Path("/dev").glob("nvidia*")):
        pytest.skip("NVIDIA devices here")
    step = grading_cuda_check()
    assert step.status == "failed" and ("/dev/nvidia" in step.detail or "CUDA does not start" in step.detail), step


def test_a_labs_time_limit_leaves_out_the_optional_parts_the_proof_turns_on(tmp_path):
    """Lab 03's HF compile comparison is off for students; the proof turns it on for its target and
    judges the 3-minute limit on the rest (the seconds the lab recorded as `optional_*`)."""
    optional = {"key": "optional_hf_compile_s", "value": 100.0, "unit": "s", "claim": "c"}
    fits = LabRun("03_kv_cache", "full", 250.0, [Cell("a", 1, 1)], measurements=[optional])
    slow = LabRun("02_prefill_decode", "full", 250.0, [Cell("a", 1, 1)])
    text = write_report(tmp_path / "r.md", {}, [fits, slow], [])
    assert "| 03_kv_cache | full | 250 (150 without its optional parts) | 1/1 | 0 | ok |" in text
    assert "| 02_prefill_decode | full | 250 | 1/1 | 0 | over 180 s |" in text


def test_labs_that_shared_the_gpu_give_an_upper_bound_of_time_and_no_target(tmp_path):
    """--jobs in full mode: within 3 minutes beside others is within them alone; over is 'run it alone',
    and the measurements of a lab that shared the GPU never decide a target."""
    shared = _full("02_prefill_decode", graph_speedup=12.0)
    shared.concurrent = 7
    slow = LabRun("01_inference", "full", 200.0, [Cell("a", 1, 1)], concurrent=7)
    text = write_report(tmp_path / "r.md", {}, [shared, slow], [])
    assert "| 02_prefill_decode | full | 60, 7 at a time | 1/1 | 0 | ok |" in text
    assert "| 01_inference | full | 200, 7 at a time | 1/1 | 0 | over 180 s: run it alone |" in text
    assert "upper bound" in text
    verdicts = {(t.lab, t.key): v for t, *_, v in target_rows([shared])}
    assert verdicts["02_prefill_decode", "graph_speedup"] == "ran beside other labs: run it alone"
    alone = _full("02_prefill_decode", graph_speedup=12.0)
    verdicts = {(t.lab, t.key): v for t, *_, v in target_rows([shared, alone])}
    assert verdicts["02_prefill_decode", "graph_speedup"] == "met", "the lone run decides"


def test_no_labs_to_run_with_jobs_is_not_an_error(tmp_path, monkeypatch):
    """--labs with nothing in it and --jobs 4: no pool of zero workers, just the steps and a report."""
    import torch

    from autograder import gpu_check
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(gpu_check, "device_facts", lambda: {"device": "a fake GPU"})
    monkeypatch.setattr(gpu_check, "grading_cuda_check", lambda: Step("CUDA under the grading limits", "passed"))
    out = tmp_path / "r.md"
    assert gpu_check.main(["--labs", "--jobs", "4", "--no-kernels", "--no-class", "--out", str(out)]) == 0
    assert "**CUDA under the grading limits**: passed" in out.read_text()
