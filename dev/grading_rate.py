"""How fast this machine grades: notebooks per minute with 1, 2, ... grading processes, on this
machine's pool (`make grade JOBS=N`) and on a Dask cluster of N local workers (`SCHEDULER=`), and what
that projects to for a class. A benchmark, not a test: run it on the machine you will grade on.

    python dev/grading_rate.py                                  # lab 02, 4 notebooks, 1 and 2 workers
    python dev/grading_rate.py --lab 05_paged_kv_cache --notebooks 8 --workers 1 2 4 --class-size 500

Each notebook is the lab's fixture student with every answer right (its demos included, as a student
submits it), graded in quick mode in the sandbox, as `make grade` grades. The rate counts the grading
only (from the first job sent to the last outcome recorded), not the set-up before it.
"""
from __future__ import annotations

import argparse
import re
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "tests")]

import nbformat  # noqa: E402

from autograder import lab_notebook  # noqa: E402
from autograder.fixtures import full_solution  # noqa: E402
from autograder.grade.pipeline import Config, grade_all  # noqa: E402
from autograder.release import generate_release  # noqa: E402


def rate(lab: str, notebooks: int, workers: int, dask: bool, tmp: Path) -> float:
    """Notebooks per minute: `notebooks` copies of the honest student, `workers` at a time."""
    source = nbformat.read(lab_notebook(lab), 4)
    release = nbformat.read(generate_release(lab, release_dir=tmp / "release", gradebook=None), 4)
    full = full_solution(release, source)
    for i in range(notebooks):
        path = tmp / "submitted" / f"student{i:03d}" / lab / f"{lab}.ipynb"
        path.parent.mkdir(parents=True, exist_ok=True)
        nbformat.write(full, path)
    said: list[str] = []
    cfg = dict(submitted=tmp / "submitted", autograded=tmp / "autograded", feedback=tmp / "feedback",
               gradebook=tmp / "gradebook.db", out=tmp / "out", labs=[lab], memory_gib=4)
    if dask:
        from dask_cluster import dask_cluster

        with dask_cluster(tmp / "cluster", workers=workers, broken=False) as address:
            grade_all(Config(scheduler=address, **cfg), log=said.append)
    else:
        grade_all(Config(jobs=workers, **cfg), log=said.append)
    done = next(line for line in said if line.startswith("done in "))
    seconds = float(re.match(r"done in (\d+) s", done).group(1))
    graded = int(re.search(r": (\d+) graded", done).group(1))
    assert graded == notebooks, said
    return 60 * notebooks / seconds


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--lab", default="02_prefill_decode")
    p.add_argument("--notebooks", type=int, default=4)
    p.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    p.add_argument("--class-size", type=int, default=500)
    a = p.parse_args()
    rows = []
    for workers in a.workers:
        for dask in (False, True):
            with tempfile.TemporaryDirectory() as tmp:
                r = rate(a.lab, a.notebooks, workers, dask, Path(tmp))
            where = f"{workers} Dask worker{'s' if workers > 1 else ''}" if dask else f"JOBS={workers}"
            rows.append((where, r))
            print(f"{a.lab}, {a.notebooks} notebooks, {where}: {r:.2f} notebooks per minute "
                  f"({a.class_size} students: {a.class_size / r / 60:.1f} h here)", flush=True)
    best = max(r / w for (where, r), w in zip(rows, [w for w in a.workers for _ in (0, 1)]))
    print(f"per grading process at best: {best:.2f} notebooks per minute; {a.class_size} students on N such "
          f"processes: {a.class_size / best / 60:.1f} h / N")
    return 0


if __name__ == "__main__":
    sys.exit(main())
