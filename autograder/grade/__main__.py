"""`python -m autograder.grade` (what `make grade` runs): grade every submission, sandboxed.

    make grade                                  # autograder/submitted/<student>/<lab>/<lab>.ipynb
    make grade ZIP=downloads.zip STUDENTS=class.csv JOBS=2
    make grade SANDBOX=off                      # only inside a container that exists for grading
    make grade SCHEDULER=tcp://HOST:8786        # on a Dask cluster's workers (autograder/grade/cluster.py)
    make grade RESUME=1                         # only what an earlier, interrupted run left ungraded

See autograder/GUIDE.md. Exit status: 0 when the run finished (whatever the scores), 2 when it
could not start (no sandbox, bad arguments), 3 when the Dask scheduler went away mid-run (what was
graded is kept: rerun with RESUME=1).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from autograder.grade.cluster import ClusterLost
from autograder.grade.pipeline import Config, grade_all
from autograder.grade.sandbox import SandboxUnavailable


def parse(argv: list[str] | None = None) -> Config:
    d = Config()
    p = argparse.ArgumentParser(prog="python -m autograder.grade", description=__doc__.splitlines()[0])
    p.add_argument("labs", nargs="*", help="labs to grade, e.g. 01_inference (default: every lab with a submission)")
    p.add_argument("--zip", type=Path, help="an LMS download to unpack into --submitted first")
    p.add_argument("--students", type=Path, help="class list CSV (id, name, email): the missing get 0")
    p.add_argument("--student", action="append", default=[], help="grade only this student (repeatable)")
    p.add_argument("--jobs", type=int, default=d.jobs, help="submissions graded at once (default 1)")
    p.add_argument("--scheduler", help="a Dask scheduler's address (tcp://HOST:8786): grade on its workers; "
                   "--jobs is then ignored (each worker process grades one notebook at a time)")
    p.add_argument("--resume", action="store_true", help="skip submissions an earlier run graded from the same file")
    p.add_argument("--sandbox", choices=["on", "off"], default="on", help="off: no bubblewrap (loudly flagged)")
    p.add_argument("--gpu", action="store_true", help="give the sandbox the NVIDIA devices (GPU machines)")
    p.add_argument("--timeout", type=int, default=0, help="seconds per cell (default: nbgrader_config.py)")
    p.add_argument("--budget", type=int, default=d.budget, help="seconds per notebook, and its CPU-time limit")
    p.add_argument("--memory", type=float, default=d.memory_gib, help="GiB per kernel: of address space, or with --gpu of private memory "
                        "(CUDA reserves more address space than it uses)")
    p.add_argument("--full", action="store_true", help="COURSE_QUICK=0: demo workloads at full size")
    p.add_argument("--submitted", type=Path, default=d.submitted)
    p.add_argument("--autograded", type=Path, default=d.autograded)
    p.add_argument("--feedback", type=Path, default=d.feedback)
    p.add_argument("--out", type=Path, default=d.out, help="where grades.csv and report.html go")
    p.add_argument("--gradebook", type=Path, default=d.gradebook, help="nbgrader's SQLite gradebook")
    p.add_argument("--labs-dir", type=Path, default=d.labs_dir)
    p.add_argument("--keep", action="store_true", help="keep the temporary work folders")
    p.add_argument("--no-hidden-messages", action="store_true",
                   help="feedback says only that a hidden test failed, not its assert's message")
    a = p.parse_args(argv)
    if a.zip is not None and not a.zip.is_file():
        p.error(f"--zip must be an existing zip file, got {a.zip}")
    if a.students is not None and not a.students.is_file():
        p.error(f"--students must be an existing CSV file, got {a.students}")
    if a.timeout < 0:
        p.error(f"--timeout must be seconds per cell >= 1 (0: nbgrader_config.py's), got {a.timeout}")
    if a.budget < 1:
        p.error(f"--budget must be seconds per notebook >= 1, got {a.budget}")
    if a.memory <= 0:
        p.error(f"--memory must be GiB per kernel > 0 (e.g. 8), got {a.memory}")
    return Config(submitted=a.submitted, autograded=a.autograded, feedback=a.feedback, gradebook=a.gradebook,
                  out=a.out, labs_dir=a.labs_dir, labs=a.labs, only=a.student, students=a.students, zip=a.zip, jobs=a.jobs,
                  scheduler=a.scheduler or None, resume=a.resume,
                  sandbox=a.sandbox == "on", gpu=a.gpu, cell_timeout=a.timeout, budget=a.budget,
                  memory_gib=a.memory, quick=not a.full, keep=a.keep,
                  hidden_messages=not a.no_hidden_messages)


def main(argv: list[str] | None = None) -> int:
    cfg = parse(argv)
    try:
        grade_all(cfg)
    except SandboxUnavailable as e:
        print(f"make grade: STOPPED, the sandbox is not available: {e}\n"
              f"Fix it, or (only inside a container made for grading) run `make grade SANDBOX=off`.", file=sys.stderr)
        return 2
    except ValueError as e:
        print(f"make grade: {e}", file=sys.stderr)
        return 2
    except ClusterLost as e:
        print(f"make grade: STOPPED: {e}", file=sys.stderr)
        return 3
    return 0


if __name__ == "__main__":
    sys.exit(main())
