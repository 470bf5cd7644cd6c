"""The live line `make grade` shows while it grades: done/total, failures so far, rate and time left
(tqdm's bar, on a terminal), above it one line per graded notebook. Without a terminal (a log file, a
test) only the lines, each numbered [done/total]."""
from __future__ import annotations

import sys

from tqdm import tqdm


class Progress:
    def __init__(self, total: int, log=print, live: bool | None = None):
        self.total, self.log, self.n, self.failed = total, log, 0, 0
        live = sys.stderr.isatty() if live is None else live
        self.bar = tqdm(total=total, unit="notebook", desc="grading", dynamic_ncols=True, file=sys.stderr,
                        disable=not live or total == 0)

    def __enter__(self) -> "Progress":
        return self

    def done(self, line: str, failed: bool = False) -> None:
        """One notebook finished: its line, and the bar moves on."""
        self.n += 1
        self.failed += failed
        text = f"[{self.n}/{self.total}] {line}"
        if self.bar.disable:
            self.log(text)
        else:
            self.bar.write(text)
            self.bar.set_postfix(failed=self.failed, refresh=False)
            self.bar.update(1)

    def __exit__(self, *exc) -> None:
        self.bar.close()
