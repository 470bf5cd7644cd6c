"""Where the course's models live, and the one error for a model that cannot be had.

`loading` (reads models) and `convert` (makes the default model's float32 copy) both import this
module, and neither imports the other at import time.
"""
from __future__ import annotations

import os
from pathlib import Path

DEFAULT_MODEL = "SmolLM2-135M-Instruct"


class ModelUnavailableError(RuntimeError):
    """A model was asked for that cannot be had here (offline, or not a supported family)."""


def cache_dir() -> Path:
    """Where converted weights live: $COURSE_CACHE, else ~/.cache/llm-inference-course."""
    root = os.environ.get("COURSE_CACHE") or Path.home() / ".cache" / "llm-inference-course"
    return Path(root)
