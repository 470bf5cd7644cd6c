"""What a lab measured, next to what its prose claims: `record(...)` in a lab's Measure section.

    from course.report import record
    record("speedup", fast / slow, "x", "the cache makes decoding faster, more so as the text grows")

Nothing happens in a student's notebook. When the GPU proof (`python -m autograder.gpu_check`) runs
a lab, it sets COURSE_MEASUREMENTS to a file, and every record becomes a line of it; its report then
shows, per lab, each claim beside the number this machine measured, with the device and dtype.
"""
from __future__ import annotations

import json
import math
import os

ENV = "COURSE_MEASUREMENTS"


def record(key: str, value: float, unit: str, claim: str, **context) -> None:
    """Note one measurement (a finite number) and the claim of the prose it supports."""
    if not isinstance(key, str) or not key:
        raise ValueError(f"key must be a non-empty string naming the measurement, got {key!r}")
    value = float(value)
    path = os.environ.get(ENV)
    if not path:
        return
    entry = {"key": key, "value": value if math.isfinite(value) else None, "unit": unit, "claim": claim,
             **{k: v if isinstance(v, (int, float, str, bool)) or v is None else str(v) for k, v in context.items()}}
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(entry) + "\n")
