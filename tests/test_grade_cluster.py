"""`make grade SCHEDULER=...`: grading on a real Dask cluster (a `dask scheduler` and `dask worker`
processes on loopback) gives the grades this machine gives, survives a worker killed mid-job, keeps
a worker that fails its sandbox check out of the work, and resumes what a lost scheduler left.
(The class of autograder/fixtures is graded on this machine's pool: test_grade.py.)"""
import csv
import io
import os
import signal
import sqlite3
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import nbformat
import pytest

from autograder import authoring
from autograder.grade import cluster, progress, scratch
from autograder.grade.pipeline import Config, grade_all
from autograder.grade.worker import Job
from dask_cluster import dask_cluster

LAB = "00_tiny"
SLOW = "s4"                 # sleeps in its answer: the worker grading it is killed mid-job
ANSWERS = {"s0": "return 2", "s1": "return 3", "s2": "raise ValueError('no')", "s3": "return 2",
           SLOW: "import time\n    time.sleep(5)\n    return 2", "s5": "return '2'", "s6": "pass", "s7": "return 1 + 1"}
SCORES = {"s0": 2, "s1": 0, "s2": 0, "s3": 2, SLOW: 2, "s5": 0, "s6": 0, "s7": 2}


def _class(root):
    """A two-point lab and eight students' notebooks (nbgrader's layout) under `root`."""
    source = authoring.write_notebook(root / "labs" / LAB / f"{LAB}.ipynb", [
        authoring.locked("setup", "import course\nenv = course.setup(verbose=False)"),
        authoring.solution("f", "def f():\n    ### BEGIN SOLUTION\n    return 2\n    ### END SOLUTION"),
        authoring.tests("f_tests", 2, "assert f() == 2, 'f() returns the number 2'")])
    for student, answer in ANSWERS.items():
        nb = nbformat.read(source, 4)
        nb.cells[1].source = f"def f():\n    {answer}"
        path = root / "submitted" / student / LAB / f"{LAB}.ipynb"
        path.parent.mkdir(parents=True)
        nbformat.write(nb, path)
    return root


def _config(root, out, **kw):
    return Config(submitted=root / "submitted", autograded=out / "autograded", feedback=out / "feedback",
                  gradebook=out / "gradebook.db", out=out, labs_dir=root / "labs", memory_gib=4, cell_timeout=120,
                  budget=600, **kw)


def _csv(out):
    return list(csv.reader(io.StringIO((out / "grades.csv").read_text())))


def _running(client, student: str) -> str | None:
    """The worker that is running `student`'s job now, if any."""
    running = client.run(lambda dask_worker: [str(t.key) for t in dask_worker.state.executing])
    return next((w for w, keys in running.items() if any(f"-{student}-" in k for k in keys)), None)


@pytest.mark.slow
def test_a_dask_cluster_grades_alike_survives_a_killed_worker_and_a_lost_scheduler(tmp_path):
    """Real `dask scheduler` and `dask worker` processes on loopback: two grading workers and one without
    bubblewrap. (1) The class's grades are the expected ones (what this machine's pool gives), each
    student once, though the worker running the slow student is killed mid-job and the broken worker
    never gets a job. (2) The scheduler dies mid-run: the run stops, keeping what it recorded, and
    RESUME=1 grades only what is missing (and a resubmitted notebook)."""
    import dask
    import sqlite3

    from distributed import Client

    root = _class(tmp_path)
    said, lost = [], []
    out, kept = tmp_path / "second", tmp_path / "second" / "outcomes"
    with dask.config.set({"distributed.comm.timeouts.connect": "5s"}), \
            dask_cluster(tmp_path / "first") as address, Client(address) as client:
        run = threading.Thread(target=lambda: grade_all(_config(root, tmp_path / "dask", scheduler=address),
                                                        log=lambda line: said.append(line) or print(line)))
        run.start()
        slow, deadline = None, time.monotonic() + 120
        while slow is None and time.monotonic() < deadline:
            slow = _running(client, SLOW)
            time.sleep(0.3)
        assert slow, "the slow student's job never started"
        time.sleep(2)
        killed = client.run(os.getpid, workers=[slow])[slow]
        os.kill(killed, signal.SIGKILL)                     # mid-job: the nanny restarts it
        run.join(timeout=300)
        assert not run.is_alive()
        while None in client.run(cluster.worker_check_result).values() and time.monotonic() < deadline + 60:
            time.sleep(0.3)                                 # the killed worker's replacement runs its check
        left = [p.name for p in Path(tempfile.gettempdir()).iterdir() if scratch.owner(p.name) == killed]
        assert not left, f"the killed worker's folders (its 0.5 GB model copy) outlived its replacement's check: {left}"
        names = {a: w["name"] for a, w in client.scheduler_info()["workers"].items()}
        taken = client.run(cluster.jobs_taken)

        def interrupted():
            try:
                grade_all(_config(root, out, scheduler=address), log=print)
            except cluster.ClusterLost as e:
                lost.append(e)
        run = threading.Thread(target=interrupted)
        run.start()
        while len(list(kept.glob("*/*.json"))) < 3 and time.monotonic() < deadline + 120:
            time.sleep(0.2)
        os.kill(int((tmp_path / "first" / "scheduler.pid").read_text()), signal.SIGKILL)
        run.join(timeout=120)

    assert {r[0]: int(r[2]) for r in _csv(tmp_path / "dask")[1:]} == SCORES, "the expected grades, each student once"
    with sqlite3.connect(tmp_path / "dask" / "gradebook.db") as db:
        rows = db.execute("select count(*), count(distinct student_id) from submitted_assignment").fetchone()
    assert rows == (len(ANSWERS), len(ANSWERS)), "one submission per student in the gradebook: nothing counted twice"
    broken = [a for a, n in names.items() if n == "no-bubblewrap"]
    assert broken and all(taken[a] == 0 for a in broken), "the worker without a sandbox took no job"
    assert any("takes no job: bubblewrap (`bwrap`) is not installed" in line for line in said), said
    assert any("2 Dask workers at" in line and "ready" in line for line in said), said

    assert lost and "rerun with RESUME=1" in str(lost[0]), "the run stops, saying what to do"
    done = sorted(p.parent.name for p in kept.glob("*/*.json"))
    assert 3 <= len(done) < len(ANSWERS), done
    assert sorted(r[0] for r in _csv(out)[1:]) == done, "grades.csv and the report hold what was graded before"
    changed = root / "submitted" / done[0] / LAB / f"{LAB}.ipynb"      # a student resubmits meanwhile
    nb = nbformat.read(changed, 4)
    nb.cells[1].source = "def f():\n    return 2  # fixed"
    nbformat.write(nb, changed)
    said.clear()
    # resumed on this machine's pool: RESUME=1 reads only the stored outcomes, whichever backend made them
    grade_all(_config(root, out, jobs=2, resume=True), log=lambda line: said.append(line) or print(line))
    assert f"RESUME: {len(done) - 1} submission(s) already graded from the same file, kept as they are" in said
    regraded = sorted(line.split()[1] for line in said if line.startswith("["))
    assert regraded == sorted({done[0]} | set(ANSWERS) - set(done)), said
    assert {r[0]: int(r[2]) for r in _csv(out)[1:]} == SCORES | {done[0]: 2}, "the resumed run finishes the class"


def test_a_worker_with_other_code_is_refused_naming_both_versions():
    mine = cluster.code_version()
    other = {"commit": "0badc0d", "code": "0123456789ab"}
    result = cluster.check_this_worker(other, sandbox=False, gpu=False, limits={})
    assert not result["ok"] and result["version"] == mine
    assert f"commit {mine['commit']} (code {mine['code']})" in result["why"]
    assert "the client commit 0badc0d (code 0123456789ab)" in result["why"] and "git checkout 0badc0d" in result["why"]
    assert cluster.check_this_worker(mine, sandbox=False, gpu=False, limits={})["ok"]


class _Failed:
    def __init__(self, error):
        self.error = error

    def result(self):
        raise self.error


def test_a_job_that_kills_every_worker_is_that_students_grader_error_and_a_lost_scheduler_stops_the_run(tmp_path):
    from distributed.client import FutureCancelledError
    from distributed.scheduler import KilledWorker

    root = _class(tmp_path)
    job = Job("s0", LAB, "x", str(root / "labs" / LAB / f"{LAB}.ipynb"), "x", str(tmp_path))
    backend = object.__new__(cluster.DaskCluster)
    backend.address = "tcp://127.0.0.1:1"
    out = backend.outcome(_Failed(KilledWorker("grade-00_tiny-s0", "tcp://127.0.0.1:2", 3)), job)
    assert (out.status, out.score, out.max_score) == ("error", 0, 2)
    assert out.flags[0].code == "grader-error" and "killed the Dask worker each of the 3 times" in out.reason
    with pytest.raises(cluster.ClusterLost, match="rerun with RESUME=1"):
        backend.outcome(_Failed(FutureCancelledError("grade-00_tiny-s0", "lost")), job)


def test_progress_shows_a_live_line_on_a_terminal_and_numbered_lines_in_a_log(capsys):
    lines = []
    with progress.Progress(2, lines.append, live=False) as bar:
        bar.done("a lab: 2/2")
        bar.done("b lab: 0/2", failed=True)
    assert lines == ["[1/2] a lab: 2/2", "[2/2] b lab: 0/2"]
    with progress.Progress(2, lines.append, live=True) as bar:
        bar.done("a lab: 2/2")
        bar.done("b lab: 0/2", failed=True)
    err = capsys.readouterr()
    assert "[2/2] b lab: 0/2" in err.out + err.err and "2/2" in err.err and "failed=1" in err.err


def test_a_killed_graders_scratch_folders_are_removed_by_the_next_and_no_others(tmp_path):
    gone = subprocess.Popen(["true"])
    gone.wait()                                                    # a process id that no longer runs
    folders = {"dead": f"course-worker-model-{gone.pid}-abc", "dead-remote": f"course-grade-remote-{gone.pid}-x",
               "dead-local": f"course-grade-{gone.pid}-y", "alive": f"course-worker-model-{os.getpid()}-abc",
               "old-style": "course-grade-remote-k2j4", "not-ours": f"other-{gone.pid}-z"}
    for name in folders.values():
        (tmp_path / name).mkdir()
        (tmp_path / name / "model.safetensors").write_bytes(b"0" * 1024)
    assert scratch.owner(folders["dead-remote"]) == gone.pid and scratch.owner(folders["old-style"]) is None
    removed = {p.name for p in scratch.sweep(tmp_path)}
    assert removed == {folders["dead"], folders["dead-remote"], folders["dead-local"]}
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted({folders["alive"], folders["old-style"], folders["not-ours"]})
    made = scratch.make("course-grade-")
    try:
        assert scratch.owner(made.name) == os.getpid() and made.parent == Path(tempfile.gettempdir())
    finally:
        made.rmdir()
    with pytest.raises(ValueError, match="prefix"):
        scratch.make("mine-")
