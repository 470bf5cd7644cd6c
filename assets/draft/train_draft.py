"""Train the small draft model of lab 08 (speculative decoding), offline, on a CPU.

The target is SmolLM2-135M-Instruct. No smaller model with its tokenizer can be had offline, so the
draft is cut out of the target itself: its embeddings and its first LAYERS blocks (shared, frozen),
then a small trained ADAPTER, then the target's final norm and an LM head restricted to the VOCAB
most common tokens (the rows of the target's own head, frozen). Only the adapter is trained: it
learns to map the hidden state after LAYERS blocks to what the full 30 blocks would predict.

    draft(x) = head_subset(norm(h + W2 silu(W1 rmsnorm(h)))),   h = blocks[:LAYERS](embed(x))

Data: the target's own continuations (greedy and sampled) of a few dozen prompt openings written
for this script, none of them used by the lab. Loss: cross-entropy against the target's next-token
distribution restricted to the subset vocabulary (distillation). Output: course/data/draft.safetensors
(adapter in float16 + the vocabulary subset, about 2.4 MB), and the time each stage took.

    .venv/bin/python assets/draft/train_draft.py

Measured when draft.safetensors was made (2 threads, a 2-core machine shared with other jobs, load
about 5): 22 min wall, 13 min CPU. Generating the data took 1,160 s (batched decoding, 96 rows x 128
tokens), the teacher pass 90 s, training 65 s (12 epochs over 11,234 tokens). Held-out top-1
agreement with the full target: 24% (the plain 4-block early exit: 10%); it peaked at 26% after
8 epochs, so more data, not more epochs, is what would help. The seeds are fixed, but the result
is not bit-for-bit reproducible across machines (thread counts change float sums).
"""
from __future__ import annotations

import json
import time
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F
from safetensors.torch import save_file

import course
from course.engine import SlotKVCache, forward_cached
from course.models.decoder import RMSNorm, rope_cos_sin

LAYERS, HIDDEN, VOCAB = 4, 1024, 8192
NEW_TOKENS, EPOCHS, BATCH, LR = 128, 12, 512, 2e-3
OUT = Path(__file__).resolve().parents[2] / "course" / "data" / "draft.safetensors"   # ships in the package
OPENINGS = [
    "Once upon a time, in a small village,", "The best way to learn a new language is", "Here is a recipe for",
    "Dear Sir or Madam, I am writing to", "The history of the Roman Empire", "In this tutorial, we will learn how to",
    "Photosynthesis is the process by which", "My favourite book is", "The meeting will start at",
    "Climate change affects", "To install the package, run", "The main causes of the First World War were",
    "A good night's sleep", "The stock market today", "Python is a programming language that",
    "The ocean covers", "When I was a child, I", "The first step in solving any problem is",
    "Artificial intelligence can help doctors", "The city was quiet that night.", "Water boils at",
    "Here are five tips for staying healthy:", "The difference between a virus and a bacterium is",
    "She opened the door and saw", "The solar system consists of", "How to write a good essay:",
    "The train to London leaves", "Exercise is important because", "The museum's new exhibit",
    "In mathematics, a prime number is", "The team won the championship after", "Coffee originated in",
    "The elephant is the largest", "To make a paper airplane,", "The internet has changed the way we",
    "The weather forecast for tomorrow", "Shakespeare wrote", "A healthy breakfast includes",
    "The moon orbits", "Volcanoes form when", "The company announced", "Learning to play the guitar",
    "The human heart pumps", "In the year 2050,", "The rules of chess are", "My grandmother used to say",
    "Bees are important for", "The bridge was built in",
]


class Adapter(nn.Module):
    """h + W2 silu(W1 rmsnorm(h)): starts as the identity (W2 = 0), i.e. as a plain early exit."""

    def __init__(self, d_model: int, hidden: int, eps: float):
        super().__init__()
        self.norm = RMSNorm(d_model, eps)
        self.w1 = nn.Linear(d_model, hidden, bias=False)
        self.w2 = nn.Linear(hidden, d_model, bias=False)
        nn.init.zeros_(self.w2.weight)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.w2(F.silu(self.w1(self.norm(h))))


@torch.no_grad()
def continuations(model, tok, prompts: list[str], sampled: bool, seed: int) -> list[list[int]]:
    """Prompt + NEW_TOKENS tokens of the target for every prompt, one left-padded batch, cached."""
    rows = [tok(p).input_ids for p in prompts]
    B, T = len(rows), max(map(len, rows))
    ids, mask = torch.zeros(B, T, dtype=torch.long), torch.zeros(B, T, dtype=torch.long)
    for b, r in enumerate(rows):
        ids[b, T - len(r):], mask[b, T - len(r):] = torch.tensor(r), 1
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    cache = SlotKVCache(model.cfg, n_slots=B, max_len=T + NEW_TOKENS)
    slots = torch.arange(B)
    logits = forward_cached(model, ids, pos, cache, slots, mask)[:, -1]
    nxt, g = pos[:, -1:] + 1, torch.Generator().manual_seed(seed)
    for _ in range(NEW_TOKENS):
        t = torch.multinomial(logits.softmax(-1), 1, generator=g)[:, 0] if sampled else logits.argmax(-1)
        for b in range(B):
            rows[b].append(int(t[b]))
        logits = forward_cached(model, t[:, None], nxt, cache, slots)[:, -1]
        nxt = nxt + 1
    return rows


@torch.no_grad()
def hidden_states(model, row: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(h after LAYERS blocks, h after all blocks), each (T, C), for one sequence."""
    x = model.embed(torch.tensor([row]))
    rope = rope_cos_sin(torch.arange(len(row))[None], model.cfg.head_dim, model.cfg.rope_theta)
    early = None
    for i, block in enumerate(model.blocks):
        x = block(x, rope)
        if i == LAYERS - 1:
            early = x[0].clone()
    return early, x[0]


def main() -> None:
    torch.manual_seed(0)
    times = {}
    t0 = time.perf_counter()
    tok, model = course.load_tokenizer(), course.load_model()
    model.requires_grad_(False)
    times["load"] = time.perf_counter() - t0

    t0 = time.perf_counter()
    rows = continuations(model, tok, OPENINGS, sampled=False, seed=0)
    rows += continuations(model, tok, OPENINGS, sampled=True, seed=1)
    times["generate"] = time.perf_counter() - t0

    t0 = time.perf_counter()
    early, final = zip(*(hidden_states(model, r) for r in rows))
    times["teacher"] = time.perf_counter() - t0
    # the subset vocabulary: every token of the data, then the lowest ids (BPE gives common tokens low ids)
    seen = torch.unique(torch.tensor([t for r in rows for t in r]))
    vocab = torch.cat([seen, torch.arange(model.cfg.vocab_size)])
    vocab = torch.tensor(list(dict.fromkeys(vocab.tolist()))[:VOCAB]).sort().values
    W = model.lm_head.weight[vocab]                                   # (VOCAB, C), frozen
    held = set(range(0, len(rows), 8))                                # every 8th row: held out for the report
    pick = lambda keep: (torch.cat([e for i, e in enumerate(early) if keep(i)]),   # noqa: E731
                         torch.cat([f for i, f in enumerate(final) if keep(i)]))
    (tr_e, tr_f), (te_e, te_f) = pick(lambda i: i not in held), pick(lambda i: i in held)

    adapter = Adapter(model.cfg.d_model, HIDDEN, model.cfg.norm_eps)
    opt = torch.optim.AdamW(adapter.parameters(), lr=LR, weight_decay=0.0)
    steps = EPOCHS * ((len(tr_e) + BATCH - 1) // BATCH)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=LR, total_steps=steps, pct_start=0.1)

    def agreement(e, f) -> tuple[float, float]:
        """Top-1 agreement with the full target (full vocabulary), before and after the adapter."""
        with torch.no_grad():
            want = model.lm_head(model.norm(f)).argmax(-1)
            plain = vocab[(model.norm(e) @ W.T).argmax(-1)]
            tuned = vocab[(model.norm(adapter(e)) @ W.T).argmax(-1)]
        return (plain == want).float().mean().item(), (tuned == want).float().mean().item()

    t0 = time.perf_counter()
    for epoch in range(EPOCHS):
        order, total = torch.randperm(len(tr_e)), 0.0
        for i in range(0, len(order), BATCH):
            idx = order[i:i + BATCH]
            with torch.no_grad():
                teacher = (model.norm(tr_f[idx]) @ W.T).softmax(-1)    # target, restricted to the subset
            student = (model.norm(adapter(tr_e[idx])) @ W.T).log_softmax(-1)
            loss = -(teacher * student).sum(-1).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()
            total += loss.item() * len(idx)
        print(f"epoch {epoch + 1}/{EPOCHS}: loss {total / len(tr_e):.3f}, held-out agreement "
              f"{agreement(te_e, te_f)[1]:.3f} ({time.perf_counter() - t0:.0f} s)", flush=True)
    times["train"] = time.perf_counter() - t0
    before, after = agreement(te_e, te_f)
    sd = {f"adapter.{k}": v.detach().to(torch.float16).contiguous() for k, v in adapter.state_dict().items()}
    sd["vocab"] = vocab.to(torch.int32)
    info = dict(layers=LAYERS, hidden=HIDDEN, vocab=VOCAB, train_tokens=len(tr_e), heldout_tokens=len(te_e),
                agreement_early_exit=round(before, 3), agreement_trained=round(after, 3),
                seconds={k: round(v, 1) for k, v in times.items()}, threads=torch.get_num_threads())
    save_file(sd, OUT, metadata={"info": json.dumps(info)})
    print(json.dumps(info, indent=1))
    print(f"wrote {OUT} ({OUT.stat().st_size / 2**20:.2f} MiB)")


if __name__ == "__main__":
    main()
