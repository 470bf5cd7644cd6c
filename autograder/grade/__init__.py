"""`make grade`: sandboxed, tamper-resistant grading of the labs, with feedback and a class report.

    python -m autograder.grade [LAB ...] [--zip Z] [--students CSV] [--jobs N] [--sandbox on|off]

The instructor's guide is autograder/GUIDE.md. The modules, in the order a submission meets them:

    collect.py    submissions (nbgrader's layout, or an LMS zip) and the class list
    pipeline.py   the run: check the sandbox, register the labs, grade in parallel, record, report
    worker.py     one submission, in its own process: repair, scan, run, score
    repair.py     duplicated, deleted, edited and re-flagged cells put back from the source
    tamper.py     the static scan, what tests rely on, and the design of the tamper defenses
    sandbox.py    bubblewrap: what a kernel sees, its limits, the pre-flight check (fails closed)
    launch.py     the kernelspec's launcher: sets the limits, then becomes bwrap
    execute.py    runs the cells over IPC, drives the guard between cells, timeouts, caps, deaths
    guard.py      runs INSIDE the kernel: snapshots, restores, write log, audit hook, signed reports
    outcome.py    per-cell results and flags (codes, severities, meanings)
    gradebook.py  nbgrader's gradebook, written by one process
    feedback.py   the student's HTML page, without hidden tests or others' solutions
    report.py     grades.csv and the class report

Why not `nbgrader autograde`: it runs student code with the grader's rights (a submission can read
the source notebook or rewrite the gradebook), fails on a duplicated grade_id, writes feedback
that shows hidden tests, exits 1 when any submission fails, and has no parallelism. Repair,
scoring (`nbgrader.utils.determine_grade`), the gradebook and the folder layout stay nbgrader's,
so formgrader, `nbgrader export` and the exchange's `release_feedback` keep working.
"""
