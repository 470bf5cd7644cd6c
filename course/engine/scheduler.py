"""Continuous batching (lab 04) at the granularity serving engines use: tokens, not whole prompts.

Every request is a `Seq`: its tokens so far (prompt, then output) and how many of them already have
keys and values in the cache (`num_computed`). A step gives each scheduled sequence some new tokens
to compute: a decoding sequence has exactly one (its newest token), a prefilling one has many (its
prompt, or what is left of it). A scheduler returns the step's plan, `[(seq, n_tokens), ...]`, and
never changes its inputs: the engine admits the waiting sequences the plan names (they are the ones
`admit(seq)` accepted, in arrival order), runs the plan, and retires finished sequences.

Two policies with one signature, `policy(running, waiting, budget, max_running, admit) -> plan`:

    schedule_prefill_first   vLLM's original default: when requests wait and fit, the step runs their
                             whole prompts and nothing else; otherwise every running sequence decodes.
    schedule_chunked         Sarathi-Serve's: decodes first, then prefill chunks fill what is left of a
                             per-step token budget; a long prompt is cut into chunks over several steps.

`admit(seq)` reserves the cache blocks of a waiting sequence (and sets its `num_computed` to the
tokens found in a prefix cache); it returns False when they do not fit, and then nobody behind it is
admitted either (first come, first served: no request is overtaken, so none waits forever).
"""
from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field

Plan = list[tuple["Seq", int]]
Admit = Callable[["Seq"], bool]


@dataclass(eq=False)   # two sequences are the same only if they are the same object
class Seq:
    """One request inside the engine."""

    rid: Hashable
    prompt: list[int]
    max_tokens: int
    output: list[int] = field(default_factory=list)
    num_computed: int = 0          # tokens whose keys and values are in the cache
    arrival: float = 0.0           # seconds (engine clock) when it was added
    preemptions: int = 0

    def __post_init__(self):
        if not self.prompt or type(self.max_tokens) is not int or self.max_tokens < 1:
            raise ValueError(f"request {self.rid!r}: needs a non-empty prompt and max_tokens >= 1")

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.output

    @property
    def num_tokens(self) -> int:
        return len(self.prompt) + len(self.output)

    @property
    def remaining(self) -> int:
        """Tokens to compute before the next token can be sampled: 1 for a decode, more while prefilling."""
        return self.num_tokens - self.num_computed


def _check(budget: int, max_running: int) -> None:
    for name, value in (("budget", budget), ("max_running", max_running)):
        if type(value) is not int or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")


def schedule_prefill_first(running: Sequence[Seq], waiting: Sequence[Seq], budget: int, max_running: int,
                           admit: Admit) -> Plan:
    """Whole prompts of arrived requests first (as many as fit the budget and max_running); a step with
    a prefill runs nothing else. Without one, every running sequence decodes."""
    _check(budget, max_running)
    plan, left = [], budget
    for seq in waiting:
        if len(running) + len(plan) >= max_running or (plan and seq.remaining > left) or not admit(seq):
            break
        plan.append((seq, seq.remaining))          # the whole prompt (a first one may exceed the budget)
        left -= seq.remaining
    return plan or [(seq, seq.remaining) for seq in running]


def schedule_chunked(running: Sequence[Seq], waiting: Sequence[Seq], budget: int, max_running: int,
                     admit: Admit) -> Plan:
    """At most `budget` tokens per step: every decode first (one token each), then running prefills,
    oldest first, then newly admitted ones, each taking as much of what is left as it needs."""
    _check(budget, max_running)
    plan, left = [], budget
    for seq in running:                            # decodes: one token each, never held back by a prefill
        if seq.remaining == 1 and left > 0:
            plan.append((seq, 1))
            left -= 1
    for seq in running:                            # prefills already under way: the next chunk
        if seq.remaining > 1 and left > 0:
            plan.append((seq, min(seq.remaining, left)))
            left -= plan[-1][1]
    admitted = 0
    for seq in waiting:                            # newcomers, first come first served
        if left == 0 or len(running) + admitted >= max_running or not admit(seq):
            break
        admitted += 1
        plan.append((seq, min(seq.remaining, left)))
        left -= plan[-1][1]
    return plan


POLICIES = {"prefill_first": schedule_prefill_first, "chunked": schedule_chunked}
