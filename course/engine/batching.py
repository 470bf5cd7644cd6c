"""Lab 04's batching answers, released: left padding with positions from the mask, and the
continuous-batching scheduler (first come, first served, a cache slot per running request). Lab 04's
later problems are graded on them, so a mistake in an earlier problem costs only its own points.

    input_ids, mask = left_pad([[5, 6, 7], [8, 9]], pad_id=0)     # [[5, 6, 7], [0, 8, 9]], [[1, 1, 1], [0, 1, 1]]
    position_ids_from_mask(mask)                                  # [[0, 1, 2], [0, 0, 1]]
    sched = Scheduler(requests, max_batch_size=8, eos_token_id=2)
    newcomers = sched.admit(step); ...; done = sched.retire()
"""
from __future__ import annotations

from collections import deque

import torch


def left_pad(prompts: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-align the prompts in a (B, T) rectangle, pads on the left; the mask is 1 on real tokens.
    Both torch.long, on the CPU: callers move them where the model is."""
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("prompts must be a non-empty list of non-empty token lists")
    T = max(len(p) for p in prompts)
    input_ids = torch.full((len(prompts), T), pad_id, dtype=torch.long)      # (B, T)
    mask = torch.zeros((len(prompts), T), dtype=torch.long)                  # (B, T)
    for b, p in enumerate(prompts):
        input_ids[b, T - len(p):] = torch.tensor(p, dtype=torch.long)
        mask[b, T - len(p):] = 1
    return input_ids, mask


def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Each row's real tokens numbered 0, 1, 2, ... from its first real token; pads get 0. (B, T) long."""
    return (attention_mask.long().cumsum(dim=-1) - 1).clamp(min=0)


class Scheduler:
    """First come, first served: requests (objects with rid, arrival, output, max_new_tokens and a
    slot) enter free cache slots in arrival order and leave when done."""

    def __init__(self, requests: list, max_batch_size: int, eos_token_id: int | None = None):
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        self.waiting = deque(sorted(requests, key=lambda r: r.arrival))     # a stable sort keeps ties in order
        self.running: list = []
        self.finished: list = []
        self.free_slots: list[int] = list(range(max_batch_size))
        self.max_batch_size, self.eos_token_id = max_batch_size, eos_token_id

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def admit(self, step: int) -> list:
        """Arrived requests, oldest first, into free slots. Returns the newcomers."""
        newcomers = []
        while self.free_slots and self.waiting and self.waiting[0].arrival <= step:
            request = self.waiting.popleft()
            request.slot = self.free_slots.pop(0)
            self.running.append(request)
            newcomers.append(request)
        return newcomers

    def retire(self) -> list:
        """Done requests (EOS last, or max_new_tokens reached) leave and free their slots. Returns them."""
        eos = self.eos_token_id
        done = [r for r in self.running
                if len(r.output) >= r.max_new_tokens or (eos is not None and r.output[-1:] == [eos])]
        for r in done:
            self.running.remove(r)
            self.free_slots.append(r.slot)
            self.finished.append(r)
        return done
