"""Build the course site: `python assets/site/build.py [--full] [--rerun] [--out build/html] [lab ...]`.

What `make html` runs. For every lab in labs/: reuse its executed copy in build/executed/ when it
ran the source as it is now (`make test` writes them there: the graded copy of the simulated class's
honest student), else execute the source with its
solutions (quick mode, as `make test` does, unless --full) and save it there; make the student
version to download (nbgrader, no gradebook); then `autograder.site.build_site` writes the pages.
Lives here, not in `course`, because it drives `autograder` (the package imports neither).
"""
from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path

import nbformat

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))  # run as a script from anywhere: `autograder` is not installed

from autograder import checks  # noqa: E402
from autograder.release import generate_release  # noqa: E402
from autograder import site  # noqa: E402

EXECUTED = REPO / "build" / "executed"
OUT = REPO / "build" / "html"


def is_fresh(executed: Path, source: Path, quick: bool = True) -> bool:
    """True when `executed` is an execution of the source as it is now (same cells, same code,
    solution markers aside: `make test` keeps the honest student's graded copy; mtimes lie, since
    tools rewrite sources unchanged) and, for a full build, not a quick one."""
    if not executed.is_file():
        return False
    now = nbformat.read(source, as_version=4)
    try:
        ran = nbformat.read(executed, as_version=4)
    except Exception:  # noqa: BLE001 (half written by another process, or not a notebook)
        return False
    if site.fingerprint(ran) != site.fingerprint(now):
        return False
    return quick or "quick mode" not in site.measured_on(ran)


def ensure_executed(sources: list[Path], executed_dir: Path = EXECUTED, quick: bool = True,
                    rerun: bool = False, log=print) -> dict[str, Path]:
    """{lab: executed notebook}, executing each lab that has no fresh copy in `executed_dir`.
    A copy is written to a temporary name and renamed, so a reader never sees half a file."""
    executed_dir.mkdir(parents=True, exist_ok=True)
    done = {}
    for source in sources:
        out = executed_dir / f"{source.stem}.ipynb"
        if rerun or not is_fresh(out, source, quick):
            start = time.perf_counter()
            log(f"{source.stem}: executing ({'quick' if quick else 'full'} mode) ...")
            tmp = out.with_name(f".{out.stem}.{time.time_ns()}.ipynb")
            checks.execute_notebook(source, tmp, quick=quick)
            tmp.replace(out)
            log(f"{source.stem}: executed in {time.perf_counter() - start:.0f} s")
        else:
            log(f"{source.stem}: reusing {out.relative_to(REPO) if out.is_relative_to(REPO) else out}")
        done[source.stem] = out
    return done


def student_versions(sources: list[Path], out_dir: Path) -> dict[str, str]:
    """Release each lab (stubs in, hidden tests out) into `<out_dir>/student/`; {lab: href}.
    A lab with data files next to its notebook is also zipped whole."""
    links = {}
    with tempfile.TemporaryDirectory() as tmp:
        for source in sources:
            release = generate_release(source.stem, source.parent.parent, Path(tmp), gradebook=None)
            dest = out_dir / "student" / source.stem
            shutil.rmtree(dest, ignore_errors=True)
            shutil.copytree(release.parent, dest, ignore=shutil.ignore_patterns(".ipynb_checkpoints", "__pycache__"))
            links[source.stem] = f"student/{source.stem}/{release.name}"
            if any(p.name != release.name for p in dest.iterdir()):
                shutil.make_archive(str(dest), "zip", dest.parent, source.stem)
                links[source.stem] = f"student/{source.stem}.zip"
    return links


def build(out_dir: Path = OUT, labs_dir: Path = REPO / "labs", executed_dir: Path = EXECUTED,
          quick: bool = True, rerun: bool = False, only: list[str] | None = None, log=print) -> list[Path]:
    """Execute what is missing, then write the site; returns the pages written.
    `only` limits the lab pages (and executions) to those labs; the map and nav list every lab."""
    sources = site.find_labs(labs_dir)
    if not sources:
        raise FileNotFoundError(f"no labs found in {labs_dir} (expected NN_name/NN_name.ipynb)")
    unknown = sorted(set(only or ()) - {s.stem for s in sources})
    if unknown:
        raise ValueError(f"only: no lab named {', '.join(unknown)}; labs are: {', '.join(s.stem for s in sources)}")
    chosen = [s for s in sources if only is None or s.stem in only]
    executed = ensure_executed(chosen, executed_dir, quick=quick, rerun=rerun, log=log)
    out_dir.mkdir(parents=True, exist_ok=True)
    student = student_versions(chosen, out_dir)
    infos = [site.lab_info(s) for s in sources]
    return site.build_site(executed, infos, out_dir, student)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=OUT, help="output folder (default build/html)")
    parser.add_argument("--full", action="store_true",
                        help="execute labs in full mode (COURSE_QUICK=0): full-size demos, much slower on a CPU")
    parser.add_argument("--rerun", action="store_true", help="execute every lab again, even with a fresh copy")
    parser.add_argument("labs", nargs="*", help="only these labs (default: all)")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    try:
        pages = build(args.out, quick=not args.full, rerun=args.rerun, only=args.labs or None)
    except ValueError as e:
        print(f"make html: {e}", file=sys.stderr)
        return 2
    index = (args.out / "index.html").resolve()
    print(f"site: {len(pages)} pages in {args.out} in {time.perf_counter() - start:.0f} s; open {index.as_uri()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
