"""Lab 08's speculative decoding pieces, released: a one-slot KV cache that appends several tokens
and rolls back, two drafters (a draft model, prompt lookup), and the target's two checks (greedy
acceptance, rejection sampling). Lab 08's tests of its later problems run on these, so a mistake in
one piece costs only that problem's points; later labs may use them as they are.

    cache = SlotKVCache(model.cfg, n_slots=1, max_len=256, device=model.device)   # one sequence, slot 0
    logits = extend(model, cache, tokens)          # (T, V): T new tokens in one pass, after what slot 0 holds
    rollback(cache, length)                        # keep only the first `length` positions
    drafted, q = propose(draft, dcache, seq, gamma, temperature, generator)   # gamma guesses, their rows q
    drafted = ngram_propose(seq, gamma)            # prompt lookup: no model
    n, token = verify_greedy(rows, drafted)        # rows (g + 1, V): accepted drafts, then the target's token
    n, token = verify_sample(p, q, drafted, generator)   # the same, exact in distribution (p, q on the CPU)

Random draws use the generator passed in; it lives on the CPU (drafts are drawn from `q.cpu()`).
"""
from __future__ import annotations

import torch

from course.engine.runner import forward_cached
from course.engine.slot_cache import SlotKVCache
from course.models.decoder import Decoder

__all__ = ["probs", "extend", "rollback", "propose", "ngram_propose", "verify_greedy", "verify_sample"]


def probs(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """Next-token probabilities (..., V) in float32 at a temperature; 0 means greedy: one-hot on the argmax."""
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0 (0 means greedy), got {temperature}")
    if temperature == 0:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    return torch.softmax(logits.float() / temperature, dim=-1)


def extend(model: Decoder, cache: SlotKVCache, tokens: list[int]) -> torch.Tensor:
    """Append `tokens` to slot 0 of `cache` in one forward pass, at the positions after what it holds;
    their logits (T, V)."""
    if len(tokens) == 0:
        raise ValueError("tokens must hold at least one token id")
    start = int(cache.lengths[0])
    ids = torch.tensor([list(tokens)], dtype=torch.long, device=model.device)            # (1, T)
    pos = start + torch.arange(len(tokens), device=model.device)[None]                   # (1, T)
    slot0 = torch.zeros(1, dtype=torch.long, device=model.device)
    return forward_cached(model, ids, pos, cache, slot0)[0]                              # (T, V)


def rollback(cache: SlotKVCache, length: int) -> None:
    """Keep only the first `length` positions of slot 0: nothing moves, the length goes back and later
    positions are marked invalid (the next pass overwrites them)."""
    held = int(cache.lengths[0])
    if not 0 <= length <= held:
        raise ValueError(f"length must be in 0..{held} (what slot 0 holds), got {length}")
    cache.lengths[0] = length
    cache.valid[0, length:] = False


@torch.no_grad()
def propose(draft: Decoder, cache: SlotKVCache, seq: list[int], gamma: int, temperature: float = 0.0,
            generator: torch.Generator | None = None) -> tuple[list[int], torch.Tensor]:
    """gamma draft tokens after `seq` and the rows q (gamma, V) they were drawn from. The draft's cache
    first catches up on the tokens of seq it lacks; the last guess is not fed back, so the cache ends
    holding len(seq) + gamma - 1 positions."""
    start = int(cache.lengths[0])
    if gamma < 1:
        raise ValueError(f"gamma must be >= 1, got {gamma}")
    if not start < len(seq):
        raise ValueError(f"the draft cache holds {start} tokens; it must hold fewer than len(seq) = {len(seq)} "
                         "(after a step, roll the draft's cache back to the kept text: drafter.keep(len(seq) - 1))")
    logits = extend(draft, cache, seq[start:])[-1]
    tokens, rows = [], []
    for i in range(gamma):
        q = probs(logits, temperature)                                                   # (V,)
        t = int(q.argmax()) if temperature == 0 else int(torch.multinomial(q.cpu(), 1, generator=generator))
        tokens.append(t)
        rows.append(q)
        if i + 1 < gamma:
            logits = extend(draft, cache, [t])[-1]
    return tokens, torch.stack(rows)                                                     # (gamma, V)


def ngram_propose(seq: list[int], gamma: int, max_n: int = 3) -> list[int]:
    """Prompt lookup: up to gamma tokens that followed the most recent earlier occurrence of seq's last
    n tokens, for the longest n <= max_n that occurred before (followed by at least one token); [] if none."""
    for n in range(min(max_n, len(seq) - 1), 0, -1):
        suffix = list(seq[-n:])
        for start in range(len(seq) - n - 1, -1, -1):                                    # latest first
            if list(seq[start:start + n]) == suffix:
                return list(seq[start + n:start + n + gamma])
    return []


def verify_greedy(logits: torch.Tensor, drafted: list[int]) -> tuple[int, int]:
    """(n, token): the drafts accepted (the longest prefix equal to the target's argmax rows) and the
    argmax of row n (the correction, or the bonus when every draft passed). logits: (g + 1, V)."""
    if logits.dim() != 2 or logits.shape[0] != len(drafted) + 1:
        raise ValueError(f"logits must have len(drafted) + 1 = {len(drafted) + 1} rows, got shape {tuple(logits.shape)}")
    best = logits.argmax(dim=-1).tolist()
    n = 0
    while n < len(drafted) and drafted[n] == best[n]:
        n += 1
    return n, best[n]


def verify_sample(p: torch.Tensor, q: torch.Tensor, drafted: list[int],
                  generator: torch.Generator | None = None) -> tuple[int, int]:
    """Speculative sampling (Leviathan et al., Chen et al., 2023): accept draft i with probability
    min(1, p/q); at the first rejection draw from max(0, p - q) normalized (from p if that is all 0);
    if every draft passed, the bonus token from p[g]. p (g + 1, V) and q (g, V) on the CPU."""
    g = len(drafted)
    if p.dim() != 2 or q.dim() != 2 or p.shape[0] != g + 1 or q.shape[0] != g or (g and q.shape[1] != p.shape[1]):
        raise ValueError(f"need p (g + 1, V) and q (g, V) for g = {g} drafts, got p {tuple(p.shape)} and q {tuple(q.shape)}")
    for i, x in enumerate(drafted):
        if torch.rand(1, generator=generator).item() * q[i, x] < p[i, x]:               # r < p/q, no division
            continue
        residual = (p[i] - q[i]).clamp(min=0)
        if residual.sum() <= 0:
            residual = p[i]
        return i, int(torch.multinomial(residual / residual.sum(), 1, generator=generator))
    return g, int(torch.multinomial(p[g], 1, generator=generator))
