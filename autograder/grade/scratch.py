"""Temporary folders that outlive a killed grader get removed by the next one.

A grader's temporary folder can hold a copy of the model (about 0.5 GB, readable by the kernels'
own uid). Python removes it at exit, but a process that is killed (a Dask worker restarted by its
nanny, `make grade` stopped with SIGKILL, a machine's OOM killer) never runs that clean-up, and a
cluster that restarts its workers a few times a night fills its disk. So every such folder carries
its owner's process id in its name,

    course-worker-model-4711-x8k2p1/

and `sweep()`, run when a grader or a worker starts, removes those whose owner no longer runs.
A process id that is in use again by another process keeps its folder: the sweep errs on the side
of keeping (the next sweep after that process ends removes it).
"""
from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

# longest first: "course-grade-remote-" must not be read as "course-grade-" with the pid "remote"
PREFIXES = ("course-worker-model-", "course-worker-check-", "course-grade-remote-", "course-grade-")


def make(prefix: str) -> Path:
    """A new temporary folder named PREFIX-PID-xxxx (`prefix` is one of PREFIXES)."""
    if prefix not in PREFIXES:
        raise ValueError(f"prefix must be one of {PREFIXES}, got {prefix!r}")
    return Path(tempfile.mkdtemp(prefix=f"{prefix}{os.getpid()}-"))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:      # another user's process: alive, and not ours to judge
        return True
    return True


def owner(name: str) -> int | None:
    """The process id in a scratch folder's name, or None if the name is not one of ours."""
    prefix = next((p for p in PREFIXES if name.startswith(p)), None)
    pid = name[len(prefix):].split("-", 1)[0] if prefix else ""
    return int(pid) if pid.isdigit() else None


def sweep(folder: str | os.PathLike | None = None) -> list[Path]:
    """Remove the scratch folders in `folder` (the temp folder) whose owner is gone; returns them."""
    removed = []
    for path in Path(folder or tempfile.gettempdir()).iterdir():
        pid = owner(path.name)
        if pid is not None and path.is_dir() and not path.is_symlink() and not _alive(pid):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed
