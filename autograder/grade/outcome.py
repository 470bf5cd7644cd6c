"""What grading one submission produces: per-cell results, flags, the score. Plain data, JSON both ways
(a worker process writes it, the main process reads it to fill the gradebook, CSV and report).

Flags say why a score is what it is, or what a person should look at. Each has a severity:
- "zero":   the cell it names scored 0 because of it (timeout, kernel died, tampering caught);
- "review": the score stands, but someone should look (a patch that was undone before the tests,
            suspicious code, outputs that disagree, a submission from someone not on the list);
- "info":   what the grader repaired (restored locked cells, re-added deleted ones, duplicates).
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field

# code -> (severity, what it means), for the report and GUIDE.md
FLAGS: dict[str, tuple[str, str]] = {
    "missing": ("zero", "on the student list, but no submission was found"),
    "unreadable": ("zero", "the file is not a notebook nbformat can read"),
    "grader-error": ("zero", "the grader itself failed on this submission (see the reason; re-run or grade by hand)"),
    "not-this-lab": ("review", "none of the lab's graded cells were found: probably the wrong notebook"),
    "unlisted": ("review", "graded, but the student is not on the student list"),
    "sandbox-off": ("review", "graded WITHOUT the sandbox (SANDBOX=off)"),
    "timeout": ("zero", "a test cell ran past the time limit and was interrupted: it scores 0"),
    "slow-cell": ("info", "a cell that is not a test ran past the time limit and was interrupted; it costs no points "
                          "itself (a test that needs what it would have made can fail)"),
    "kernel-died": ("zero", "the kernel died in this cell (crash, os._exit, limits): a test cell scores 0; a new kernel "
                            "ran the cells above it again and grading went on (after 5 deaths, or a second one while "
                            "running cells again, the rest scores 0)"),
    "budget": ("zero", "the notebook ran past its total time budget; the rest was not run and scores 0"),
    "tampered": ("zero", "code the tests rely on was replaced while this test cell ran: the cell scores 0"),
    "guard-broken": ("zero", "the grader's in-kernel guard stopped answering or was forged: the rest scores 0"),
    "patched": ("review", "student code replaced something tests use; it was put back before the tests ran"),
    "suspicious": ("review", "student code uses tools that can tamper with grading (see the detail)"),
    "package-answer": ("review", "student code calls the course package's copy of one of this lab's graded answers "
                                 "instead of its own (the package holds them for later labs)"),
    "events": ("review", "student code did something grading never needs (subprocess, network, fork, ctypes, ...)"),
    "threads": ("review", "student code left background threads running"),
    "outputs-disagree": ("review", "the submitted notebook claims this test passed; graded, it failed"),
    "output-capped": ("review", "a cell printed more than the output cap; the rest was dropped"),
    "leftover-processes": ("review", "processes still ran in the sandbox after the kernel stopped; they were killed"),
    "restored-locked": ("info", "a locked or test cell was edited; it was restored from the source"),
    "readded-cell": ("info", "a graded cell was deleted; it was re-added (answer cells as the stub)"),
    "dropped-duplicate": ("info", "a graded cell appeared twice; the copy was dropped or made an ordinary cell"),
    "repaired-metadata": ("info", "a cell's grading metadata was altered; it was restored from the source"),
    "needs-manual-grading": ("review", "the lab has written answers, graded by a person in formgrader (`make formgrade`): "
                                       "their points are not in this score"),
}


@dataclass
class Flag:
    code: str
    detail: str = ""
    cell: str | None = None

    @property
    def severity(self) -> str:
        return FLAGS[self.code][0]

    def short(self) -> str:
        return f"{self.code}({self.cell})" if self.cell else self.code

    def __post_init__(self) -> None:
        if self.code not in FLAGS:
            raise ValueError(f"unknown flag code {self.code!r}; known: {', '.join(FLAGS)}")


@dataclass
class CellResult:
    grade_id: str
    points: float
    score: float
    status: str          # passed | failed | partial | timeout | kernel-died | not-run | zeroed
    why: str = ""


@dataclass
class ManualAnswer:
    grade_id: str
    points: float
    answered: bool       # False: the release's stub, untouched (0 without a person)


@dataclass
class Outcome:
    student: str
    lab: str
    score: float = 0.0
    max_score: float = 0.0
    status: str = "graded"   # graded | missing | unreadable | error
    reason: str = ""
    cells: list[CellResult] = field(default_factory=list)
    flags: list[Flag] = field(default_factory=list)
    errors: dict[str, str] = field(default_factory=dict)   # cell label -> 'Name: message' (any cell)
    manual: list[ManualAnswer] = field(default_factory=list)   # written answers, graded by a person (not in score)
    seconds: float = 0.0
    submission_sha256: str = ""   # what was graded: a rerun with RESUME=1 skips it while the file is unchanged

    def flag(self, code: str, detail: str = "", cell: str | None = None) -> None:
        """Add a flag once (same code, cell and detail)."""
        new = Flag(code, detail, cell)
        if all((f.code, f.cell, f.detail) != (new.code, new.cell, new.detail) for f in self.flags):
            self.flags.append(new)

    def flag_summary(self) -> str:
        """Flags as the CSV shows them: 'code(cell)' in order, each once."""
        seen: list[str] = []
        for f in self.flags:
            if f.short() not in seen:
                seen.append(f.short())
        return "; ".join(seen)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1)

    @classmethod
    def from_json(cls, text: str) -> "Outcome":
        data = json.loads(text)
        data["cells"] = [CellResult(**c) for c in data["cells"]]
        data["flags"] = [Flag(**f) for f in data["flags"]]
        data["manual"] = [ManualAnswer(**m) for m in data.get("manual", [])]
        return cls(**data)
