"""Files the labs read at run time, shipped inside the package (`course/data/`), so that a course
installed from its wheel (Colab, a JupyterHub) finds them as a checkout does, from any folder.

    from course.assets import asset
    weights = asset("draft.safetensors")      # lab 08's trained draft (made by assets/draft/train_draft.py)
"""
from __future__ import annotations

from importlib.resources import as_file, files
from pathlib import Path


def asset(name: str) -> Path:
    """The path of `course/data/<name>`; FileNotFoundError, naming what is there, when it is missing."""
    if not isinstance(name, str) or not name or "/" in name or name.startswith("."):
        raise ValueError(f"name must be a file name in course/data/, got {name!r}")
    data = files("course") / "data"
    entry = data / name
    if not entry.is_file():
        present = sorted(p.name for p in data.iterdir() if p.is_file()) if data.is_dir() else []
        raise FileNotFoundError(f"course/data/{name} is not installed (course/data holds: {', '.join(present) or 'nothing'})")
    with as_file(entry) as path:      # a real file for a normal install; extracted for a zipped one
        return Path(path)
