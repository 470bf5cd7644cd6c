"""Builds the lab 08 source notebook. Edit this file (sections 1-5: why guessing pays, the cache, the
drafters, the target's check, the speculative step) or lab08_measure.py (the trace, the
measurements, the summary), then run from the repo root:

    .venv/bin/python -m autograder.lab_builders.lab08
"""
from autograder.authoring import code, locked, md, solution, tests, write_notebook  # noqa: E402
from autograder.lab_builders.common_cells import CHECK_YOUR_WORK, COLAB_INSTALL, SETUP  # noqa: E402
from autograder.lab_builders.lab08_measure import CELLS as MEASURE  # noqa: E402

# Tiny Llama decoders for the hidden tests: fast, with peaked distributions (weights ~ N(0, 0.3^2)).
# `_perturbed` is a draft that agrees with its target part of the time.
HIDDEN_TINY = r'''
import dataclasses as _dc
from course.models import Decoder as _Decoder
def _tiny(seed, V=40, layers=2):
    cfg = course.ModelConfig(family="llama", vocab_size=V, n_layer=layers, n_head=4, n_kv_head=2, d_model=32,
                             d_ff=64, max_seq_len=256)
    g = torch.Generator().manual_seed(seed)                  # weights drawn on the CPU: the same on every device
    m = _Decoder(cfg).eval().to(env.device)
    with torch.no_grad():
        for prm in m.parameters():
            prm.copy_(torch.randn(prm.shape, generator=g).to(prm.device) * 0.3)
    return m
def _perturbed(m, seed, scale=0.08):
    d = _Decoder(m.cfg).eval().to(m.device)
    d.load_state_dict(m.state_dict())
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for prm in d.parameters():
            prm.add_(torch.randn(prm.shape, generator=g).to(prm.device) * scale)
    return d
@torch.no_grad()
def _full_logits(m, seq):
    # reference: the whole sequence through the plain model, no cache: (T, V)
    ids = torch.tensor([list(seq)], device=m.device)
    return m(ids, torch.arange(len(seq), device=m.device)[None])[0]
@torch.no_grad()
def _fresh_cache(m, seq, max_len=256):
    # reference: a cache built from seq alone, in one pass
    c = SlotKVCache(m.cfg, n_slots=1, max_len=max_len, device=m.device)
    if len(seq):
        forward_cached(m, torch.tensor([list(seq)], device=m.device), torch.arange(len(seq), device=m.device)[None],
                       c, torch.zeros(1, dtype=torch.long, device=m.device))
    return c
def _same_cache(c, seq_len, ref, what):
    # c must hold exactly the first seq_len positions, equal to the reference cache
    n = int(c.lengths[0])
    assert n == seq_len, f"{what}: the cache holds {n} positions, not {seq_len}"
    assert not c.valid[0, n:].any(), f"{what}: positions from {n} on must be marked invalid after a rollback"
    assert c.valid[0, :n].all(), f"{what}: the first {n} positions must be valid"
    assert torch.allclose(c.k[:, 0, :, :n], ref.k[:, 0, :, :n], atol=1e-4), f"{what}: stored keys differ from a cache built from the kept tokens alone"
    assert torch.allclose(c.v[:, 0, :, :n], ref.v[:, 0, :, :n], atol=1e-4), f"{what}: stored values differ"
'''.strip("\n")

# Chi-square with 4 degrees of freedom (5 categories): its tail has a closed form, so no scipy.
HIDDEN_CHI2 = r'''
import math as _math
def _chi2_pvalue(counts, probs):
    # Pearson's statistic for observed counts against probabilities; P(chi2_4 >= x) = exp(-x/2) (1 + x/2)
    counts = torch.as_tensor(counts, dtype=torch.float64)   # cpu: a float64 reference on the CPU
    probs = torch.as_tensor(probs, dtype=torch.float64)   # cpu: a float64 reference on the CPU
    assert len(counts) == 5, "self-check: the closed form below is for 5 categories"
    expected = counts.sum() * probs
    x = float(((counts - expected) ** 2 / expected).sum())
    return _math.exp(-x / 2) * (1 + x / 2)
'''.strip("\n")

cells = [
md(r"""
# Lab 08: Speculative decoding, several tokens per pass

A decode step of lab 02 runs the whole model to produce **one** token. On a GPU most of that step is
fixed cost (about a thousand kernel launches for this model; for a big model, reading every weight),
and the arithmetic units mostly wait. On a CPU the arithmetic does the work, but a pass over a few
tokens still costs less than a few passes (you measure how much less). Lab 04 filled that slack with
other requests (batching). **Speculative decoding** fills it with *guesses* for the same request: a
cheap **draft** proposes the next few tokens, and the expensive **target** model checks all of them
in **one** forward pass. Every guess the target agrees with is a token gained without a target pass
of its own. The trick is in the checking rule: done right, the text has exactly the target's
distribution (greedy: exactly the target's greedy text), however bad the draft. A bad draft only
costs speed, never quality.

**You will**
- measure what a forward pass over several tokens costs next to a pass over one (on a GPU about the
  same; on a CPU less than one pass per token, by a factor you read off);
- make the KV cache append several tokens at once and **roll back** the rejected ones;
- write two drafters: a small model (proposes tokens one at a time) and prompt lookup (copies from the text so far, no model at all);
- write greedy acceptance, and exact **rejection sampling** (accept with $\min(1, p/q)$, resample from $\max(0, p - q)$, and the bonus token);
- put them together in a speculative decoding step whose greedy output equals the target's;
- replay the steps in a trace widget, and measure acceptance rate, tokens per target pass against the formula, and the wall-time speedup for several draft lengths.

**Time:** about 3 hours 55 minutes: 40 minutes of reading, six problems (appending and rolling back about 25
minutes, the draft and prompt lookup about 20 each, greedy acceptance 15, rejection sampling and the
speculative step about 40 each), 25 minutes for the written questions at the end, and about 4 minutes of
running on a laptop CPU (measured on 2 cores). **Hardware:** everything runs on a laptop CPU; a GPU is
used when there is one.
"""),
locked("colab_install", COLAB_INSTALL),
locked("setup", SETUP),
md(r"""
## 1. Why guessing can pay

The target is SmolLM2-135M, the model of every lab so far. The cell below loads it and gives two
helpers from earlier labs: `probs(logits, temperature)` (lab 07's temperature, with 0 meaning greedy:
all the probability on the top token) and `plain_generate`, greedy decoding with a KV cache
(labs 03 and 04): one forward pass per new token. `plain_generate` is the baseline we must beat.
On a GPU the model runs in bfloat16 (`env.dtype`); the tests that compare tokens one for one use
`model_fp32`, a float32 copy (in bfloat16 two correct programs can round a near-tie differently).
On a CPU both names hold the same model.
"""),
locked("engine", r'''
import torch
from course.engine import SlotKVCache, forward_cached
from course.engine.width_graphs import SlotCachePool
from course.timing import benchmark   # median of several runs after a warm-up, GPU synchronized

tokenizer = course.load_tokenizer()
model = course.load_model(device=env.device, dtype=env.dtype)   # the target
# Token-for-token checks (speculative output = the target's greedy text) run in float32: in bf16 two
# correct programs can round a near-tie differently. On a CPU this is the same model.
model_fp32 = model if env.dtype == torch.float32 else course.load_model(device=env.device)
dev = env.device
SLOT0 = torch.zeros(1, dtype=torch.long, device=dev)   # every cache in this lab holds one sequence, in slot 0
# Where the generators below get their one-slot caches: plain new caches until section 6 turns on
# CUDA graphs on a GPU (a cache is then kept per model and size, its passes replayed from graphs, lab 02).
caches = SlotCachePool(graphs=False)


def probs(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """Next-token probabilities (..., V) at a temperature (lab 07); 0 means greedy: all mass on the argmax."""
    if temperature == 0:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    return torch.softmax(logits.float() / temperature, dim=-1)


@torch.no_grad()
def plain_generate(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    """Greedy decoding with a KV cache: prefill, then one forward pass per new token."""
    cache = caches.get(model, len(prompt) + max_new_tokens)          # an empty one-slot SlotKVCache
    ids = torch.tensor([prompt], device=model.device)
    logits = forward_cached(model, ids, torch.arange(len(prompt), device=model.device)[None], cache, SLOT0)[0, -1]
    out = []
    for i in range(max_new_tokens):
        out.append(int(logits.argmax()))
        if i + 1 < max_new_tokens:
            pos = torch.tensor([[len(prompt) + i]], device=model.device)
            logits = forward_cached(model, torch.tensor([[out[-1]]], device=model.device), pos, cache, SLOT0)[0, -1]
    return out

'''),
md(r"""
How much more does the target pay to process several new tokens in one pass instead of one? The
cell fills a cache with a prompt, then times one pass over `T` new tokens for a few `T`.
"""),
code(r"""
prompt_ids = tokenizer("The history of the printing press begins in").input_ids
sizes = env.pick([1, 2, 4, 8, 16], [1, 4], cpu=[1, 2, 4, 8])
cost = {}
with torch.no_grad():
    cache = SlotKVCache(model.cfg, n_slots=1, max_len=len(prompt_ids) + 32, dtype=model.dtype, device=dev)
    forward_cached(model, torch.tensor([prompt_ids], device=dev), torch.arange(len(prompt_ids), device=dev)[None], cache, SLOT0)
    def one_pass(T):
        cache.lengths[0] = len(prompt_ids)                    # forget the last pass: measure the same thing again
        ids = torch.full((1, T), 100, device=dev)
        forward_cached(model, ids, len(prompt_ids) + torch.arange(T, device=dev)[None], cache, SLOT0)
    for T in sizes:                                           # warm every size first: the first passes pay
        one_pass(T)                                           # one-time setup that is no part of the cost
    for T in sizes:
        cost[T] = benchmark(lambda: one_pass(T), repeats=env.pick(10, 2), device=dev).median
for T in sizes:
    print(f"{T:2d} new tokens in one pass: {1000 * cost[T]:6.1f} ms  ({cost[T] / cost[1]:.2f}x one token)")
"""),
md(r"""
Look at the last column. If `T` tokens cost far less than `T` times one token, a pass that checks
several guesses is cheap, and every accepted guess saves a whole pass. (On a GPU the curve is flatter
still: at batch 1 a pass of this small model is bound by kernel launches (lab 02), and a pass over 8
tokens launches the same kernels as a pass over 1, so the column stays near 1x; a value below 1 is
noise.) The plan, for draft length $\gamma$:

1. the draft proposes $\gamma$ tokens $d_1 \dots d_\gamma$, one at a time (it is small, so this is cheap);
2. the target runs **once** over the last accepted token and the $\gamma$ drafts: its $\gamma + 1$
   rows of logits give its own distribution at every drafted position, and one more after $d_\gamma$;
3. keep the longest prefix of drafts the target agrees with, then add **one token from the target**:
   a correction at the first disagreement, or a **bonus** token from the extra row when all agree.

So each target pass yields between 1 and $\gamma + 1$ tokens. Step 2 writes the drafts' keys and
values into the target's cache; the rejected ones must then be **removed**.

## 2. A cache that appends several tokens and rolls back

Our caches are lab 04's `SlotKVCache` with one slot (slot 0): `cache.lengths[0]` is how many
positions are written, `cache.valid[0]` marks them, and `forward_cached` writes a pass's new tokens
at positions `lengths[0], lengths[0] + 1, ...` and advances the length. Rolling back needs no data to
move: a position past the length is never read (the causal mask stops at the query's own position)
and is overwritten by the next pass. So forgetting the last positions is two assignments.

## Problem 1: Append and roll back (3 points)

**Deliverable:** `extend(model, cache, tokens)` runs `model` over the token ids `tokens` (a list)
in **one** `forward_cached` pass, at the positions that follow what slot 0 already holds, and returns
their logits `(T, V)`. `rollback(cache, length)` makes slot 0 hold only its first `length` positions:
the length goes back and the positions from `length` on are marked invalid. It raises `ValueError`
if `length` is negative or larger than what the slot holds (a cache cannot roll forward).
"""),
solution("cache_ops", r'''
def extend(model, cache: SlotKVCache, tokens: list[int]) -> torch.Tensor:
    """Append `tokens` to slot 0 in one forward pass; their logits (T, V)."""
    ### BEGIN SOLUTION
    start = int(cache.lengths[0])
    ids = torch.tensor([list(tokens)], dtype=torch.long, device=model.device)          # (1, T)
    pos = start + torch.arange(len(tokens), device=model.device)[None]                 # (1, T): after what is cached
    return forward_cached(model, ids, pos, cache, SLOT0.to(model.device))[0]            # (T, V)
    ### END SOLUTION


def rollback(cache: SlotKVCache, length: int) -> None:
    """Keep only the first `length` positions of slot 0."""
    ### BEGIN SOLUTION
    held = int(cache.lengths[0])
    if not 0 <= length <= held:
        raise ValueError(f"length must be in 0..{held} (what slot 0 holds), got {length}")
    cache.lengths[0] = length
    cache.valid[0, length:] = False
    ### END SOLUTION
'''),
tests("cache_ops_tests", 3, r"""
from course.expect import expect_tensor
from course.tolerance import for_decoder, order_tol

def extended(m, cache, tokens):
    '''Your extend, its answer checked first: one row of logits per token, (T, V), on the model's device.'''
    return expect_tensor(extend(m, cache, tokens), f"extend(model, cache, {len(tokens)} tokens)", dtype=m.dtype,
                         shape=(len(tokens), m.cfg.vocab_size), device=dev)

# In float32 (model_fp32): the cached and uncached logits must agree to 1e-3.
with torch.no_grad():
    seq = tokenizer("Speculative decoding checks many tokens at once").input_ids
    full = model_fp32(torch.tensor([seq], device=dev), torch.arange(len(seq), device=dev)[None])[0]   # (T, V), no cache
    c = SlotKVCache(model_fp32.cfg, n_slots=1, max_len=32, device=dev)
    a = extended(model_fp32, c, seq[:4])
    b = extended(model_fp32, c, seq[4:])
assert int(c.lengths[0]) == len(seq), "after two extends the slot holds every token"
assert torch.allclose(a, full[:4], atol=1e-3), "the first extend runs the tokens at positions 0..3: logits differ from the uncached model"
assert torch.allclose(b, full[4:], atol=1e-3), "the second extend must continue at position 4: logits differ from the uncached model"
rollback(c, 3)
assert int(c.lengths[0]) == 3 and c.valid[0].sum() == 3, \
    "after rollback(cache, 3) the slot holds exactly 3 valid positions: set its length to 3 and mark the positions from 3 on invalid"
with torch.no_grad():
    again = extended(model_fp32, c, seq[3:6])
    ref = SlotKVCache(model_fp32.cfg, n_slots=1, max_len=32, device=dev)
    ref_logits = model_fp32(torch.tensor([seq[:6]], device=dev), torch.arange(6, device=dev)[None])[0]
    forward_cached(model_fp32, torch.tensor([seq[:6]], device=dev), torch.arange(6, device=dev)[None], ref, SLOT0)
assert torch.allclose(again, ref_logits[3:], atol=1e-3), "after a rollback, new tokens must see only the kept ones"
# keys of all 30 layers (up to about 20): another order of the same sums, within float32's budget for this model
assert torch.allclose(c.k[:, 0, :, :6], ref.k[:, 0, :, :6], **order_tol(ref.k[:, 0, :, :6], **for_decoder(model_fp32.cfg))), \
    "the rolled-back cache must equal one built from the kept tokens"
for bad in (-1, 7):
    try:
        rollback(c, bad)
    except ValueError:
        pass
    else:
        raise AssertionError(f"rollback(cache, {bad}) with 6 positions held must raise ValueError")
### BEGIN HIDDEN TESTS
""" + HIDDEN_TINY + r"""
m = _tiny(1)
seq = [3, 17, 5, 22, 9, 31, 2, 8, 14, 27, 11]
full = _full_logits(m, seq)
c = SlotKVCache(m.cfg, n_slots=1, max_len=64, device=dev)
with torch.no_grad():
    out = [extended(m, c, seq[:5])] + [extended(m, c, [t]) for t in seq[5:8]] + [extended(m, c, seq[8:])]
assert torch.allclose(torch.cat(out), full, atol=1e-4), "extend in pieces must match the uncached model"
_same_cache(c, len(seq), _fresh_cache(m, seq), "after extends")
rollback(c, len(seq))
_same_cache(c, len(seq), _fresh_cache(m, seq), "rolling back to the current length changes nothing")
for keep, new in ((7, [4, 4, 19]), (2, [33]), (0, [1, 2, 3]), (3, [6, 7, 8, 9, 10, 12])):
    rollback(c, keep)
    _same_cache(c, keep, _fresh_cache(m, seq[:keep]), f"right after rollback(cache, {keep})")
    with torch.no_grad():
        got = extended(m, c, new)
    seq = seq[:keep] + new
    assert torch.allclose(got, _full_logits(m, seq)[keep:], atol=1e-4), f"after rollback to {keep}, extend gives wrong logits"
    _same_cache(c, len(seq), _fresh_cache(m, seq), f"after rollback to {keep} and extend")
held = int(c.lengths[0])
for bad in (-3, held + 1):
    try:
        rollback(c, bad)
    except ValueError:
        pass
    else:
        raise AssertionError(f"rollback to {bad} with {held} positions held must raise ValueError")
assert int(c.lengths[0]) == held, "a refused rollback must leave the cache as it was"
### END HIDDEN TESTS
"""),
md(r"""
## 3. Drafters

A draft must be **fast** and must **agree** with the target often. Two kinds, both offline:

**A small model.** The online classic is a smaller model of the same family, with the same tokenizer
(drafts are token ids, so the two must share a vocabulary): SmolLM2-135M drafting for SmolLM2-360M or
1.7B, or distilgpt2 for gpt2. Those come from the Hugging Face hub, and the course must work offline
(the grading machine has no network), so we cut a draft out of the target itself: its embeddings and its **first 4 of 30 blocks**, then the target's final norm and
LM head. Used as they are, 4 blocks agree with the full model on about one token in ten (the next
cell prints it): the last blocks turn the
hidden state into a prediction. So the course trained a small **adapter** (two matrices, 1.2 M
parameters) that maps the hidden state after block 4 to what block 30 would predict, and restricted
the LM head to the 8,192 most common tokens (the head over all 49,152 tokens would cost as much as
8 blocks). `assets/draft/train_draft.py` did the training (its weights ship in the course package), on the target's own text (it printed its
time and held-out agreement; both are in the file's metadata, shown below). The draft **shares** the
target's blocks and embeddings; its own memory is the adapter and a copy of 8,192 rows of the head.

The next cell builds that draft, and also the plain early exit (4 blocks, no adapter), for comparison
(and `draft_fp32`, the same draft cut out of `model_fp32`, for the tests).
"""),
locked("draft_model", r'''
import dataclasses
import json
from pathlib import Path

import torch.nn as nn
import torch.nn.functional as F
from course.models import Decoder
from course.models.decoder import RMSNorm


class Adapter(nn.Module):
    """h + W2 silu(W1 rmsnorm(h)), then the target's final norm: the draft's last layer."""

    def __init__(self, d_model: int, hidden: int, final_norm: nn.Module, eps: float):
        super().__init__()
        self.norm, self.final_norm = RMSNorm(d_model, eps), final_norm
        self.w1, self.w2 = nn.Linear(d_model, hidden, bias=False), nn.Linear(hidden, d_model, bias=False)

    def forward(self, h):
        return self.final_norm(h + self.w2(F.silu(self.w1(self.norm(h)))))


class SubsetHead(nn.Module):
    """The target's LM head over a subset of the vocabulary; every other token gets logit -inf."""

    def __init__(self, lm_head: nn.Linear, vocab: torch.Tensor):
        super().__init__()
        self.register_buffer("vocab", vocab.long())
        self.register_buffer("rows", lm_head.weight.detach()[vocab.long()].clone())   # (8192, C): the subset's rows
        self.V = lm_head.weight.shape[0]

    def forward(self, x):                                      # (B, T, C) -> (B, T, V)
        small = x @ self.rows.T                                # (B, T, 8192): 6x cheaper than the full head
        out = torch.full((*x.shape[:-1], self.V), float("-inf"), dtype=small.dtype, device=x.device)
        return out.index_copy_(-1, self.vocab, small)


def make_draft(target, n_layers: int = 4, weights: Path | None = None):
    """A Decoder that runs the target's first n_layers blocks (shared weights); with `weights`, the
    trained adapter and subset head of train_draft.py, else the target's own norm and head (early exit)."""
    draft = Decoder.__new__(Decoder)
    nn.Module.__init__(draft)
    draft.cfg = dataclasses.replace(target.cfg, n_layer=n_layers)
    draft.embed, draft.pos_embed = target.embed, target.pos_embed
    draft.blocks = nn.ModuleList(list(target.blocks[:n_layers]))
    draft.norm, draft.lm_head = target.norm, target.lm_head
    if weights is not None:
        from safetensors.torch import load_file
        sd = load_file(weights)
        hidden = sd["adapter.w1.weight"].shape[0]
        draft.norm = Adapter(target.cfg.d_model, hidden, target.norm, target.cfg.norm_eps)
        missing, unexpected = draft.norm.load_state_dict(
            {k.removeprefix("adapter."): v.float() for k, v in sd.items() if k.startswith("adapter.")}, strict=False)
        if unexpected or any(not k.startswith("final_norm.") for k in missing):   # final_norm is the target's own
            raise ValueError(f"{weights} does not hold this adapter: missing {missing}, unexpected {unexpected}")
        draft.lm_head = SubsetHead(target.lm_head, sd["vocab"])
    return draft.to(device=target.device, dtype=target.dtype).eval()   # the adapter in the target's dtype


from course.assets import asset

try:
    DRAFT_WEIGHTS = asset("draft.safetensors")          # shipped inside the course package
except FileNotFoundError as e:
    DRAFT_WEIGHTS = None
    print(f"{e}: the draft is the plain early exit, and the acceptance rates below are the early exit's (a few %), "
          "not the trained draft's that the text describes")
early_exit = make_draft(model, 4)
if DRAFT_WEIGHTS is None:
    draft, draft_name = early_exit, "early exit"
else:
    from safetensors import safe_open
    with safe_open(DRAFT_WEIGHTS, "pt") as f:
        draft_info = json.loads(f.metadata()["info"])
    draft, draft_name = make_draft(model, draft_info["layers"], DRAFT_WEIGHTS), "trained draft"
    print(f"trained draft: {draft_info['layers']} blocks + adapter, {draft_info['vocab']} token head; "
          f"trained in {draft_info['seconds']['train']:.0f} s on {draft_info['train_tokens']} tokens "
          f"(data {draft_info['seconds']['generate'] + draft_info['seconds']['teacher']:.0f} s); held-out agreement "
          f"with the target {draft_info['agreement_trained']:.0%} (early exit: {draft_info['agreement_early_exit']:.0%})")
# The tests' float32 draft, cut out of model_fp32 (on a CPU: the same draft).
draft_fp32 = draft if model_fp32 is model else make_draft(model_fp32, draft.cfg.n_layer, DRAFT_WEIGHTS)
'''),
md(r"""
The draft proposes tokens the way `plain_generate` does, one pass per token, with its own KV cache.
Two details make it fit the target's check:

- it returns, with each token, the **distribution** $q$ it drew the token from (one row per token,
  `probs(logits, temperature)`): rejection sampling needs $q$ (at temperature 0, a one-hot row);
- its cache may lag behind the text: after a step the text has grown by tokens the draft never saw
  (the target's correction or bonus). So `propose` first feeds the draft every token of `seq` its
  cache lacks, `seq[L:]` where `L = cache.lengths[0]`, in one pass, and reads the first guess from
  the last row.

## Problem 2: The draft proposes (3 points)

**Deliverable:** `propose(draft, cache, seq, gamma, temperature=0.0, generator=None)` takes a draft
model, its cache (holding the first `L` tokens of `seq`, `L < len(seq)`) and the token list `seq`,
and returns `(tokens, q)`: `gamma` new token ids (a list) and their distributions `q`, shape
`(gamma, V)`. Token `i` is the argmax of row `q[i]` at temperature 0, else one draw from `q[i]` with
`torch.multinomial(q[i].cpu(), 1, generator=generator)` (the generator lives on the CPU). Each token is fed back (`extend`) so the next one
sees it, except the last, which no one needs yet: the cache ends holding `len(seq) + gamma - 1`
positions. Raise `ValueError` if `gamma < 1` or the cache does not hold fewer tokens than `seq`.
(The tests run it with the course's `extend` and `rollback`, from `course.engine.speculative`, so a
mistake in Problem 1 costs only Problem 1's points.)
"""),
solution("propose", r'''
@torch.no_grad()
def propose(draft, cache: SlotKVCache, seq: list[int], gamma: int, temperature: float = 0.0,
            generator: torch.Generator | None = None) -> tuple[list[int], torch.Tensor]:
    """gamma draft tokens after seq, one pass each, and the distribution each came from (gamma, V)."""
    ### BEGIN SOLUTION
    start = int(cache.lengths[0])
    if gamma < 1:
        raise ValueError(f"gamma must be >= 1, got {gamma}")
    if not start < len(seq):
        raise ValueError(f"the draft cache holds {start} tokens; it must hold fewer than len(seq) = {len(seq)}")
    logits = extend(draft, cache, seq[start:])[-1]                  # catch up: every token the cache lacks
    tokens, qs = [], []
    for i in range(gamma):
        q = probs(logits, temperature)                              # (V,)
        t = int(q.argmax()) if temperature == 0 else int(torch.multinomial(q.cpu(), 1, generator=generator))
        tokens.append(t)
        qs.append(q)
        if i + 1 < gamma:                                           # the last guess is not fed back
            logits = extend(draft, cache, [t])[-1]
    return tokens, torch.stack(qs)                                  # (gamma, V)
    ### END SOLUTION
'''),
tests("propose_tests", 3, r"""
from course.engine import speculative as course_spec
from course.expect import expect_ints, expect_tensor, expect_tuple, substituted

def proposed(m, cache, seq, gamma, temperature=0.0, generator=None):
    '''Your propose, its answer checked first: (gamma token ids, q (gamma, V) float32 on the model's device).'''
    tokens, q = expect_tuple(propose(m, cache, seq, gamma, temperature, generator), "propose(...)", 2)
    tokens = expect_ints(tokens, "the drafted tokens (propose(...)[0])", length=gamma)
    q = expect_tensor(q, "q (propose(...)[1])", dtype=torch.float32, shape=(gamma, m.cfg.vocab_size), device=dev)
    return tokens, q

# Graded on its own: here propose runs on the course's extend and rollback (Problem 1, released in
# course.engine.speculative), so a mistake in Problem 1 costs only Problem 1's points. In float32
# (draft_fp32): greedy drafts must equal the draft's own argmax, token for token.
with substituted(globals(), extend=course_spec.extend, rollback=course_spec.rollback):
    seq = tokenizer("The capital of France is Paris. The capital of Italy is").input_ids
    dc = SlotKVCache(draft_fp32.cfg, n_slots=1, max_len=64, device=dev)
    tokens, q = proposed(draft_fp32, dc, seq, 4)
    with torch.no_grad():
        want, s = [], list(seq)
        for _ in range(4):                                   # the draft without a cache, one token at a time
            want.append(int(draft_fp32(torch.tensor([s], device=dev), torch.arange(len(s), device=dev)[None])[0, -1].argmax()))
            s.append(want[-1])
    assert tokens == want, f"greedy drafts must be the draft's argmax tokens {want}, got {tokens}"
    assert q.argmax(-1).tolist() == want and torch.allclose(q.sum(-1), torch.ones(4, device=dev)), \
        "at temperature 0 each row of q is one-hot on its token"
    assert int(dc.lengths[0]) == len(seq) + 3, f"the cache ends with len(seq) + gamma - 1 = {len(seq) + 3} positions, got {int(dc.lengths[0])}"
    rollback(dc, len(seq) + 1)                             # as after a step that kept the first draft
    proposed(draft_fp32, dc, seq + [tokens[0], 13], 2)
    assert int(dc.lengths[0]) == len(seq) + 3, "propose must first feed the tokens the cache lacks (here 1), then its drafts"
### BEGIN HIDDEN TESTS
""" + HIDDEN_TINY + r"""
with substituted(globals(), extend=course_spec.extend, rollback=course_spec.rollback):
    m = _tiny(2)
    seq = [5, 9, 1, 30, 12]
    for temperature, seed in ((0.0, None), (1.0, 3), (0.6, 4)):
        c = SlotKVCache(m.cfg, n_slots=1, max_len=64, device=dev)
        g = torch.Generator().manual_seed(seed) if seed is not None else None
        toks, q = proposed(m, c, seq, 5, temperature, g)
        for i in range(5):
            ref = probs(_full_logits(m, seq + toks[:i])[-1], temperature)
            assert torch.allclose(q[i].cpu(), ref.cpu(), atol=1e-4), f"temperature {temperature}: q[{i}] must be the draft's distribution after seq + tokens[:{i}]"
            assert q[i, toks[i]] > 0, "a drafted token must have probability > 0 under its q row"
        _same_cache(c, len(seq) + 4, _fresh_cache(m, seq + toks[:4]), f"temperature {temperature}: after propose")
        if seed is not None:
            g2 = torch.Generator().manual_seed(seed)
            toks2, _ = proposed(m, SlotKVCache(m.cfg, n_slots=1, max_len=64, device=dev), seq, 5, temperature, g2)
            assert toks2 == toks, "the same generator seed must give the same drafts: draw with the generator passed in"
    # sampled drafts vary: 60 one-token proposals from a flat row (temperature 5)
    m2 = _tiny(3)
    c = SlotKVCache(m2.cfg, n_slots=1, max_len=8, device=dev)
    g = torch.Generator().manual_seed(0)
    seen = set()
    for _ in range(60):
        rollback(c, 0)
        t, _ = proposed(m2, c, [1, 2], 1, 5.0, g)
        seen.add(t[0])
    assert len(seen) > 5, "at temperature 5 the drafts must vary: draw them, do not take the argmax"
    c = SlotKVCache(m.cfg, n_slots=1, max_len=64, device=dev)
    toks, _ = proposed(m, c, seq, 1)
    assert int(c.lengths[0]) == len(seq), "gamma = 1: the single guess is not fed back"
    for bad in (0, -1):
        try:
            propose(m, SlotKVCache(m.cfg, n_slots=1, max_len=64, device=dev), seq, bad)
        except ValueError:
            pass
        else:
            raise AssertionError(f"gamma={bad} must raise ValueError")
    full_c = _fresh_cache(m, seq)
    try:
        propose(m, full_c, seq, 2)
    except ValueError:
        pass
    else:
        raise AssertionError("a cache that already holds all of seq must raise ValueError (nothing to read the next token from)")
### END HIDDEN TESTS
"""),
md(r"""
**Prompt lookup** (Saxena, 2023; vLLM's `ngram` speculator) needs no model at all. Text often repeats
itself: code edits copy the code, summaries quote the document, answers reuse the question's words,
and small models loop. So: take the last few tokens of the text, find where they occurred before,
and propose the tokens that followed them there. It costs a search through a list, nothing more.

## Problem 3: Prompt lookup (2 points)

**Deliverable:** `ngram_propose(seq, gamma, max_n=3)` returns up to `gamma` proposed tokens (a list,
possibly empty). For `n = max_n, max_n - 1, ..., 1` (longest first, at most `len(seq) - 1`): look
for the **most recent** earlier occurrence of the last `n` tokens of `seq`, one that is followed by
at least one token (so not the suffix itself); at the first `n` that has one, return the up to
`gamma` tokens that follow that occurrence. No occurrence for any `n`: return `[]`.
"""),
solution("ngram", r'''
def ngram_propose(seq: list[int], gamma: int, max_n: int = 3) -> list[int]:
    """Up to gamma tokens that followed the most recent earlier occurrence of seq's last n tokens."""
    ### BEGIN SOLUTION
    for n in range(min(max_n, len(seq) - 1), 0, -1):
        suffix = seq[-n:]
        for start in range(len(seq) - n - 1, -1, -1):              # latest first; must be followed by a token
            if seq[start:start + n] == suffix:
                return list(seq[start + n:start + n + gamma])
    return []
    ### END SOLUTION
'''),
tests("ngram_tests", 2, r"""
from course.expect import expect_ints

def looked_up(seq, gamma, **kwargs):
    '''Your ngram_propose, its answer checked first: a list of int token ids.'''
    return expect_ints(ngram_propose(seq, gamma, **kwargs), f"ngram_propose({seq}, {gamma})")

assert looked_up([1, 2, 3, 4, 1, 2], 2) == [3, 4], "the last tokens (1, 2) occurred at the start, followed by 3, 4"
assert looked_up([1, 2, 3, 9, 2, 3, 7, 2, 3], 3) == [7, 2, 3], "use the most recent earlier occurrence of (2, 3)"
assert looked_up([5, 6, 7], 4) == [], "nothing repeats: no proposal"
assert looked_up([1, 2, 3, 4, 9, 3, 4], 5, max_n=3) == [9, 3, 4], "at most what follows the match, up to the end of seq"
### BEGIN HIDDEN TESTS
assert looked_up([8, 1, 2, 3, 5, 7, 2, 3, 6, 4, 1, 2, 3], 2) == [5, 7], \
    "the longest n first: (1, 2, 3) matches at index 1, though (2, 3) matches more recently"
assert looked_up([8, 1, 2, 3, 5, 7, 2, 3, 6, 4, 1, 2, 3], 2, max_n=2) == [6, 4], "max_n=2: the latest (2, 3)"
assert looked_up([4, 4, 4, 4], 3) == [4], "the match may overlap the suffix; it must be followed by at least one token"
assert looked_up([3, 9, 9, 5, 3], 2) == [9, 9], "fall back to n=1 when no longer n-gram repeats"
assert looked_up([7], 3) == [] and looked_up([], 3) == [], "too short to match"
assert looked_up([1, 2, 1, 2, 1, 2], 10, max_n=2) == [1, 2], "latest occurrence of (1, 2) is at index 2: followed by 1, 2"
assert looked_up([1, 2, 3, 1, 2, 3, 1], 1) == [2], "gamma limits the proposal"
assert looked_up([6, 2, 6], 3, max_n=1) == [2, 6], "n=1: the 6 at index 0 is followed by 2, 6"
seq = [11, 12, 13, 14, 15, 16, 11, 12, 13, 99]
assert looked_up(seq, 3) == [], "99 never occurred before: no n-gram ending with it"
### END HIDDEN TESTS
"""),
md(r"""
Both drafters get the same interface, so the loop does not care which one it has: `propose(seq,
gamma, temperature, generator)` returns `(tokens, q)`, and `keep(n)` tells the drafter that only the
first `n` tokens of the text are still valid (a model drafter rolls its cache back to at most `n`
positions; prompt lookup has nothing to forget). Prompt lookup is certain of its guesses: its `q`
rows are one-hot. It may also propose fewer than `gamma` tokens, or none.
"""),
locked("drafters", r'''
class ModelDrafter:
    """A draft model with its own KV cache (slot 0)."""

    def __init__(self, draft_model, name: str = "draft model"):
        self.model, self.name, self.cache = draft_model, name, None

    def start(self, max_len: int) -> None:
        self.cache = caches.get(self.model, max_len, widths=(1, 2))     # its calls: 1 token, or 2 after a full accept

    def propose(self, seq, gamma, temperature=0.0, generator=None):
        return propose(self.model, self.cache, seq, gamma, temperature, generator)

    def keep(self, n: int) -> None:
        rollback(self.cache, min(n, int(self.cache.lengths[0])))


class NgramDrafter:
    """Prompt lookup: no model, no cache."""

    def __init__(self, vocab_size: int, max_n: int = 3, name: str = "prompt lookup"):
        self.V, self.max_n, self.name = vocab_size, max_n, name

    def start(self, max_len: int) -> None:
        pass

    def propose(self, seq, gamma, temperature=0.0, generator=None):
        tokens = ngram_propose(seq, gamma, self.max_n)
        q = F.one_hot(torch.tensor(tokens, dtype=torch.long), self.V).float()   # cpu: certain, one-hot rows; read on the CPU
        return tokens, q

    def keep(self, n: int) -> None:
        pass
'''),
md(r"""
## 4. The target's check

The target's pass over `[last token, d_1, ..., d_γ]` gives `γ + 1` rows of logits. Row `i` is the
target's prediction for the position of `d_{i+1}`; the last row predicts the token after `d_γ`.

**Greedy.** The target would have written its argmax at every position. So `d_1` is right if it
equals row 0's argmax; if so, row 1 was computed on the right text and checks `d_2`; and so on. At
the first mismatch, the target's own argmax at that row replaces the draft, and everything after is
discarded (it was conditioned on a wrong token). If all `γ` match, row `γ` gives one more token: the
**bonus**. The output is the target's greedy text, token for token, whatever the draft proposed.

## Problem 4: Greedy acceptance (2 points)

**Deliverable:** `verify_greedy(logits, drafted)` takes the target's rows `logits` `(g + 1, V)` and
the `g` drafted tokens (`g` may be 0) and returns `(n, token)`: `n`, the number of drafts accepted
(the longest prefix where each draft equals its row's argmax), and `token`, the argmax of row `n`
(the correction, or the bonus when `n == g`). Raise `ValueError` unless `logits` has `g + 1` rows.
"""),
solution("verify_greedy", r'''
def verify_greedy(logits: torch.Tensor, drafted: list[int]) -> tuple[int, int]:
    """Accept the drafts that match the target's argmax; then the target's own token (correction or bonus)."""
    ### BEGIN SOLUTION
    if logits.dim() != 2 or logits.shape[0] != len(drafted) + 1:
        raise ValueError(f"logits must have len(drafted) + 1 = {len(drafted) + 1} rows, got shape {tuple(logits.shape)}")
    best = logits.argmax(dim=-1).tolist()                          # the target's choice at every position
    n = 0
    while n < len(drafted) and drafted[n] == best[n]:
        n += 1
    return n, best[n]
    ### END SOLUTION
'''),
tests("verify_greedy_tests", 2, r"""
from course.expect import expect_int, expect_tuple

def checked(rows, drafted):
    '''Your verify_greedy, its answer checked first: (n, token), two ints.'''
    n, token = expect_tuple(verify_greedy(rows, drafted), f"verify_greedy(rows, {drafted})", 2)
    return (expect_int(n, "n (drafts accepted)", min=0, max=len(drafted)),
            expect_int(token, "token (the target's own)", min=0, max=rows.shape[1] - 1))

rows = torch.tensor([[0.0, 5.0, 1.0], [3.0, 0.0, 1.0], [0.0, 0.0, 2.0], [4.0, 0.0, 0.0]], device=dev)   # argmax 1, 0, 2, 0
assert checked(rows, [1, 0, 2]) == (3, 0), "all three drafts match: keep them and take the bonus token from the last row"
assert checked(rows, [1, 2, 2]) == (1, 0), \
    "the second draft (2) differs from the target's 0: keep 1 draft, then the target's 0 (stop at the first draft that differs: " \
    "the drafts after it are discarded, even one that matches its row)"
assert checked(rows[:1], []) == (0, 1), "no drafts: the target's own next token, as in plain decoding"
### BEGIN HIDDEN TESTS
assert checked(rows, [2, 0, 2]) == (0, 1), "the first draft is wrong: nothing kept, the target's 1 replaces it"
assert checked(rows, [1, 0, 1]) == (2, 2), "the last draft is wrong: keep 2, correct the third"
assert checked(rows[:2], [1]) == (1, 0), "one draft accepted: the bonus comes from row 1"
assert checked(rows, [1, 1, 2]) == (1, 0), "a draft after a rejection is discarded even if it would match its row"
g = torch.Generator().manual_seed(5)                         # test data drawn on the CPU: the same numbers on every device
for trial in range(30):
    k = trial % 5
    z = torch.randn(k + 1, 12, generator=g).to(dev)
    best = z.argmax(-1).tolist()
    cut = torch.randint(0, k + 1, (1,), generator=g).item()
    d = best[:cut] + [(b + 1) % 12 for b in best[cut:k]]
    got = checked(z, d)
    assert got == (cut, best[cut]), (f"trial {trial}, {k} drafts: you returned (n, token) = {got}; n counts the drafts up to "
                                     f"the first one that differs from its row's argmax, token is the argmax of row n")
for bad_rows, d in ((rows, [1, 0]), (rows[:2], [1, 0, 2])):
    try:
        verify_greedy(bad_rows, d)
    except ValueError:
        pass
    else:
        raise AssertionError(f"{bad_rows.shape[0]} rows for {len(d)} drafts must raise ValueError")
### END HIDDEN TESTS
"""),
md(r"""
**Sampling.** At a temperature above 0 the target's text is random, so "the same text" becomes
"the same distribution". Draft token $x$ was drawn from the draft's row $q$; the target's row at the
same position is $p$. The rule of Leviathan et al. (2023) and Chen et al. (2023):

1. accept $x$ with probability $\min\left(1, \frac{p(x)}{q(x)}\right)$ (draw $r$ uniform in $[0, 1)$, accept if $r < p(x) / q(x)$);
2. on rejection, draw the replacement from the **residual** $\dfrac{\max(0,\ p - q)}{\sum_y \max(0,\ p(y) - q(y))}$ and stop;
3. if all $\gamma$ drafts are accepted, draw the bonus token from the last row, $p_{\gamma}$.

Why it is exact, for one position: $x$ is proposed with probability $q(x)$ and kept with
$\min(1, p(x)/q(x))$, so it comes out as an accepted draft with probability $\min(q(x), p(x))$.
The chance of a rejection is $1 - \sum_y \min(p(y), q(y)) = \sum_y \max(0, p(y) - q(y))$, and then $x$
comes out with its share of the residual. Adding the two: $\min(p(x), q(x)) + \max(0, p(x) - q(x)) = p(x)$.
Tokens the draft over-proposes ($q > p$) are thinned out; tokens it under-proposes ($p > q$) are
topped up by the residual. Both halves matter: resampling from $p$ itself would count the accepted
mass twice.

## Problem 5: Rejection sampling (4 points)

**Deliverable:** `verify_sample(p, q, drafted, generator=None)` takes the target's rows `p`
`(g + 1, V)` and the draft's rows `q` `(g, V)` (probabilities, on the CPU) and the `g` drafted tokens,
and returns `(n, token)`: the number of drafts accepted by the rule above, and the next token (drawn
from the normalized residual of row `n` after a rejection, or from `p[g]` when all were accepted).
Draw every random number with `generator` (`torch.rand(1, generator=generator)`,
`torch.multinomial(row, 1, generator=generator)`). If a residual sums to 0 (it can only happen by
rounding when `p` equals `q`), draw from `p` of that row. Raise `ValueError` on mismatched shapes.
"""),
solution("verify_sample", r'''
def verify_sample(p: torch.Tensor, q: torch.Tensor, drafted: list[int],
                  generator: torch.Generator | None = None) -> tuple[int, int]:
    """Speculative sampling: accept draft i with prob min(1, p/q); else resample from max(0, p - q); bonus from p[g]."""
    g = len(drafted)
    if p.dim() != 2 or q.dim() != 2 or p.shape[0] != g + 1 or q.shape[0] != g or (g and q.shape[1] != p.shape[1]):
        raise ValueError(f"need p (g + 1, V) and q (g, V) for g = {g} drafts, got p {tuple(p.shape)} and q {tuple(q.shape)}")
    ### BEGIN SOLUTION
    for i, x in enumerate(drafted):
        r = torch.rand(1, generator=generator).item()
        if r * q[i, x] < p[i, x]:                                 # r < p/q without dividing by q
            continue
        residual = (p[i] - q[i]).clamp(min=0)                     # what the draft under-proposed
        if residual.sum() <= 0:
            residual = p[i]
        return i, int(torch.multinomial(residual / residual.sum(), 1, generator=generator))
    return g, int(torch.multinomial(p[g], 1, generator=generator))  # every draft accepted: the bonus
    ### END SOLUTION
'''),
tests("verify_sample_tests", 4, r"""
import math
from course.expect import expect_int, expect_tuple

def checked(p, q, drafted, generator=None):
    '''Your verify_sample, its answer checked first: (n, token), two ints.'''
    n, token = expect_tuple(verify_sample(p, q, drafted, generator), f"verify_sample(p, q, {drafted})", 2)
    return (expect_int(n, "n (drafts accepted)", min=0, max=len(drafted)),
            expect_int(token, "the next token", min=0, max=p.shape[1] - 1))

# verify_sample takes its probabilities on the CPU, where its generator lives.
p1 = torch.tensor([[0.40, 0.25, 0.15, 0.10, 0.10], [0.2, 0.2, 0.2, 0.2, 0.2]])   # cpu: verify_sample reads p, q on the CPU
q1 = torch.tensor([[0.10, 0.15, 0.25, 0.40, 0.10]])   # cpu: verify_sample reads p, q on the CPU
checked(p1, q1, [3], torch.Generator().manual_seed(0))
assert checked(p1[1:].repeat(3, 1), p1[1:].repeat(2, 1), [0, 4])[0] == 2, "when q equals p every draft is accepted"
p0, q0 = torch.tensor([[0.0, 1.0], [0.5, 0.5]]), torch.tensor([[1.0, 0.0]])   # cpu: verify_sample reads p, q on the CPU
assert checked(p0, q0, [0]) == (0, 1), \
    "p(x) = 0: the draft x is always rejected (accepted with probability min(1, p(x)/q(x)) = 0), and the residual puts all its mass on token 1"
# The first token of a step must follow p[0] whatever q is. A chi-square test on 3,500 steps whose
# drafts are drawn from q, with fixed seeds. For a correct answer and a fresh seed, Pearson's statistic
# (5 categories, 4 degrees of freedom; every expected count >= 350, so the chi-square law applies)
# exceeds the threshold with probability P(chi2_4 >= x) = exp(-x/2) (1 + x/2) < 1e-7: the test
# fails a correct answer less than once in ten million runs.
g = torch.Generator().manual_seed(1)
first = [0] * 5
for x in torch.multinomial(q1[0], 3500, replacement=True, generator=g).tolist():   # the drafts, drawn from q
    n, t = checked(p1, q1, [x], g)
    first[x if n == 1 else t] += 1
expected = [3500 * v for v in p1[0].tolist()]
stat = sum((o - e) ** 2 / e for o, e in zip(first, expected))
pvalue = math.exp(-stat / 2) * (1 + stat / 2)
assert pvalue > 1e-7, (f"the first token's frequencies {[round(f / 3500, 3) for f in first]} do not follow p = {p1[0].tolist()} "
                       f"(chi-square {stat:.0f}): accept draft x with probability min(1, p(x)/q(x)); after a rejection draw from "
                       f"the normalized residual max(0, p - q), not from p itself (that counts the accepted mass twice)")
### BEGIN HIDDEN TESTS
""" + HIDDEN_CHI2 + r"""
# Each chi-square check below fails a correct answer with probability < 1e-7 (see the visible test);
# there are 6 of them in this cell, so by the union bound a false failure has probability < 6e-7.
# Every expected count is >= 350 (N * min p), where the chi-square approximation is accurate.
P = torch.tensor([[0.40, 0.25, 0.15, 0.10, 0.10], [0.10, 0.10, 0.20, 0.25, 0.35], [0.15, 0.35, 0.15, 0.20, 0.15]])  # cpu: p on the CPU
Q = torch.tensor([[0.10, 0.15, 0.25, 0.40, 0.10], [0.30, 0.05, 0.30, 0.05, 0.30]])  # cpu: q on the CPU
def _run(P, Q, N, seed):
    g = torch.Generator().manual_seed(seed)
    pos = [[0] * 5 for _ in range(P.shape[0])]
    kinds = {"bonus": 0, "rejected": 0}
    drafts = torch.stack([torch.multinomial(Q[i], N, replacement=True, generator=g) for i in range(Q.shape[0])], 1)
    for d in drafts.tolist():                                     # each row: the g drafts of one step, drawn from q
        n, t = checked(P, Q, d, g)
        out = d[:n] + [t]
        for i, tok in enumerate(out):
            pos[i][tok] += 1
        kinds["bonus" if n == len(d) else "rejected"] += 1
    return pos, kinds
def _share(counts):
    return [round(c / sum(counts), 3) for c in counts]
pos, kinds = _run(P, Q, 6000, 11)
assert kinds["bonus"] > 0, "when every draft is accepted, a bonus token must follow"
assert _chi2_pvalue(pos[0], P[0]) > 1e-7, f"token 1 of a step: frequencies {_share(pos[0])} must follow p[0] {P[0].tolist()}"
assert _chi2_pvalue(pos[1], P[1]) > 1e-7, f"token 2 of a step: frequencies {_share(pos[1])} must follow p[1] {P[1].tolist()}"
assert sum(pos[2]) >= 2000, "self-check: enough bonus tokens for the test"
assert _chi2_pvalue(pos[2], P[2]) > 1e-7, f"the bonus token must be drawn from the last row p[g] {P[2].tolist()}, got frequencies {_share(pos[2])}"
# a certain draft (prompt lookup): q is one-hot; the result must still follow p
Q1 = F.one_hot(torch.tensor([2]), 5).float()   # cpu: a one-hot q on the CPU
pos, _ = _run(P[:2], Q1, 3500, 12)
assert _chi2_pvalue(pos[0], P[0]) > 1e-7, f"a one-hot draft: token 1 must still follow p[0], got {_share(pos[0])}"
Q2 = F.one_hot(torch.tensor([0]), 5).float()   # cpu: a one-hot q on the CPU
pos, _ = _run(P[1:], Q2, 3500, 13)
assert _chi2_pvalue(pos[0], P[1]) > 1e-7, f"a one-hot draft on an unlikely token: frequencies {_share(pos[0])} must follow {P[1].tolist()}"
# a draft that over-proposes one token
Q3 = torch.tensor([[0.05, 0.05, 0.05, 0.05, 0.80]])   # cpu: q on the CPU
pos, _ = _run(P[1:], Q3, 3500, 14)
assert _chi2_pvalue(pos[0], P[1]) > 1e-7, f"a draft that over-proposes token 4: frequencies {_share(pos[0])} must follow {P[1].tolist()}"
# no drafts: a plain draw from p[0], reproducible with the generator
draws = [[checked(P[:1], Q[:0], [], g) for _ in range(20)] for g in (torch.Generator().manual_seed(3), torch.Generator().manual_seed(3))]
assert all(n == 0 for n, _ in draws[0]), "no drafts: nothing is accepted"
assert draws[0] == draws[1] and len({t for _, t in draws[0]}) > 1, "no drafts: one draw from p[0] per call, with the generator passed in"
runs = [[checked(P, Q, [0, 2], gg) for _ in range(50)] for gg in (torch.Generator().manual_seed(9), torch.Generator().manual_seed(9))]
assert runs[0] == runs[1], "the same generator seed must give the same results: draw every random number with the generator"
for bad in ((P, Q[:1], [1, 2]), (P[:2], Q, [1, 2])):
    try:
        verify_sample(*bad)
    except ValueError:
        pass
    else:
        raise AssertionError("mismatched p, q and drafts must raise ValueError")
### END HIDDEN TESTS
"""),
md(r"""
## 5. One speculative step

Now the whole step. The text is a list `seq` of token ids. Between steps, the target's cache holds
the first `L = len(seq) - 1` tokens (the last token has not been through the target yet: its
logits are what we need next). At the very first step the cache is empty (`L = 0`) and the pass is
also the prefill. A step:

1. `drafted, q = drafter.propose(seq, gamma, temperature, generator)`;
2. **one** target pass: `extend(target, tcache, seq[L:] + drafted)`, whose last `len(drafted) + 1` rows are the check;
3. `(n, token)` from `verify_greedy` (temperature 0) or `verify_sample` on `probs(rows, temperature).cpu()`
   and `q.cpu()` (it draws with the CPU generator);
4. `seq` grows by `drafted[:n] + [token]`;
5. both caches forget what was rejected: the target's cache is rolled back to `len(seq) - 1`
   positions, and `drafter.keep(len(seq) - 1)` does the same for the draft's.

Check the arithmetic of step 5 on an example: `seq` had 10 tokens, the target's cache 9, and 4 drafts
came in; the pass leaves 14 positions in the cache. With 2 accepted, `seq` has 13 tokens, and the
cache must keep 12: positions 12 and 13 hold the rejected drafts' keys.

## Problem 6: A speculative step (4 points)

**Deliverable:** `speculative_step(target, tcache, drafter, seq, gamma, temperature=0.0,
generator=None)` performs the step above: it appends the step's tokens to `seq` **in place**, leaves
both caches holding `len(seq) - 1` tokens at most (the target's exactly that many) and returns
`(drafted, n, token)`. It runs the target exactly once. It works when the drafter proposes fewer
than `gamma` tokens, or none. (The tests run your step on the course's answers to Problems 1-5, from
`course.engine.speculative`, so your step is graded on its own.)
"""),
solution("speculative_step", r'''
@torch.no_grad()
def speculative_step(target, tcache: SlotKVCache, drafter, seq: list[int], gamma: int, temperature: float = 0.0,
                     generator: torch.Generator | None = None) -> tuple[list[int], int, int]:
    """Draft, check in one target pass, keep the agreed prefix plus one target token, roll both caches back."""
    ### BEGIN SOLUTION
    start = int(tcache.lengths[0])
    drafted, q = drafter.propose(seq, gamma, temperature, generator)
    rows = extend(target, tcache, seq[start:] + drafted)[-(len(drafted) + 1):]     # (g + 1, V): the one pass
    if temperature == 0:
        n, token = verify_greedy(rows, drafted)
    else:
        n, token = verify_sample(probs(rows, temperature).cpu(), q.cpu(), drafted, generator)
    seq.extend(drafted[:n] + [token])
    rollback(tcache, len(seq) - 1)                                 # drop the rejected drafts' keys and values
    drafter.keep(len(seq) - 1)                                     # and the draft's
    return drafted, n, token
    ### END SOLUTION
'''),
md(r"""
The loop around it is given: it runs steps until `max_new_tokens` tokens are out (the last step may
overshoot; the extra tokens are cut) and records every step for the trace. It does not stop at the
end-of-sequence token, like `plain_generate`, so the two can be compared token for token.
"""),
locked("speculative_generate", r'''
def speculative_generate(target, drafter, prompt: list[int], max_new_tokens: int, gamma: int,
                         temperature: float = 0.0, seed: int | None = None):
    """New tokens and the steps [(drafted, n_accepted, token), ...]: one target pass per step."""
    max_len = len(prompt) + max_new_tokens + gamma + 1
    tcache = caches.get(target, max_len, widths=(1, gamma + 1))        # verify passes: gamma + 1 tokens, or 1
    drafter.start(max_len)
    generator = torch.Generator().manual_seed(seed) if seed is not None else None
    seq, steps = list(prompt), []
    while len(seq) < len(prompt) + max_new_tokens:
        before = len(seq)
        steps.append(speculative_step(target, tcache, drafter, seq, gamma, temperature, generator))
        if len(seq) <= before:
            raise RuntimeError("speculative_step added no token to seq: every step must add at least the target's token")
    return seq[len(prompt):len(prompt) + max_new_tokens], steps
'''),
tests("speculative_step_tests", 4, r"""
from course.engine import speculative as course_spec
from course.expect import expect_int, expect_ints, expect_tuple, substituted

# Graded on its own: here your step runs on the course's answers to Problems 1-5 (released in
# course.engine.speculative; the drafters call them too), so an earlier mistake costs only its own points.
course_parts = dict(extend=course_spec.extend, rollback=course_spec.rollback, propose=course_spec.propose,
                    ngram_propose=course_spec.ngram_propose, verify_greedy=course_spec.verify_greedy,
                    verify_sample=course_spec.verify_sample)

def step_checked(step, gamma):
    '''One step's (drafted, n, token), as your speculative_step returned it, checked first.'''
    drafted, n, token = expect_tuple(step, "speculative_step(...)", 3)
    drafted = expect_ints(drafted, "drafted (speculative_step(...)[0])")
    assert len(drafted) <= gamma, f"at most gamma = {gamma} drafts per step, got {len(drafted)}"
    return drafted, expect_int(n, "n (speculative_step(...)[1])", min=0, max=len(drafted)), expect_int(token, "token (speculative_step(...)[2])", min=0)

def generated(target, drafter, prompt, n, gamma, temperature=0.0, seed=None):
    '''The given speculative_generate around your step; its tokens and steps checked first.'''
    out, steps = speculative_generate(target, drafter, prompt, n, gamma, temperature, seed)
    return expect_ints(out, "the generated tokens", length=n), [step_checked(s, gamma) for s in steps]

# In float32 (model_fp32, draft_fp32): greedy speculative decoding must give the target's greedy text, token for token.
with substituted(globals(), **course_parts):
    passes = []
    hook = model_fp32.blocks[-1].mlp.register_forward_hook(lambda *a: passes.append(1))   # the draft has no block 30: counts target passes
    try:
        story = tokenizer("Once upon a time, a little robot").input_ids
        tcache, drafter = SlotKVCache(model_fp32.cfg, n_slots=1, max_len=64, device=dev), ModelDrafter(draft_fp32)
        drafter.start(64)
        seq = list(story)                                    # one step by hand: the text and both caches after it
        drafted, n, token = step_checked(speculative_step(model_fp32, tcache, drafter, seq, 4), 4)
        assert seq == story + drafted[:n] + [token], \
            "speculative_step appends to seq, in place, the n accepted drafts and then the target's token (a correction, " \
            "or the bonus when every draft was accepted)"
        assert int(tcache.lengths[0]) == len(seq) - 1, \
            (f"after a step the target's cache must hold len(seq) - 1 = {len(seq) - 1} tokens, it holds {int(tcache.lengths[0])}: "
             f"roll it back (rollback(tcache, len(seq) - 1)), dropping the rejected drafts' keys and values")
        assert int(drafter.cache.lengths[0]) <= len(seq) - 1, \
            (f"after a step the draft's cache holds {int(drafter.cache.lengths[0])} tokens: roll it back too, to at most "
             f"len(seq) - 1 = {len(seq) - 1} (drafter.keep(len(seq) - 1))")
        want = plain_generate(model_fp32, story, 20)
        for drafter in (ModelDrafter(draft_fp32), NgramDrafter(model_fp32.cfg.vocab_size)):
            passes.clear()
            got, steps = generated(model_fp32, drafter, story, 20, gamma=4)
            assert got == want, f"{drafter.name}: greedy speculative decoding must give the target's greedy text.\n" \
                                f"expected {tokenizer.decode(want)!r}\ngot      {tokenizer.decode(got)!r}"
            assert len(passes) == len(steps), f"{drafter.name}: one target pass per step: {len(steps)} steps, {len(passes)} passes"
            assert sum(n + 1 for _, n, _ in steps) >= 20, "each step adds its accepted drafts plus one target token"
    finally:
        hook.remove()
### BEGIN HIDDEN TESTS
""" + HIDDEN_TINY + r"""
with substituted(globals(), **course_parts):
    tgt = _tiny(7, V=40, layers=2)
    for dseed, scale in ((8, 0.05), (9, 0.15)):
        dm = _perturbed(tgt, dseed, scale)
        prompt = [3, 14, 15, 9, 26]
        ref = plain_generate(tgt, prompt, 30)                        # checked against the uncached model below
        assert ref[:8] == [int(_full_logits(tgt, prompt + ref[:i])[-1].argmax()) for i in range(8)], "self-check"
        ref = prompt + ref
        for gamma in (1, 4):
            drafter = ModelDrafter(dm)
            tcache = SlotKVCache(tgt.cfg, n_slots=1, max_len=64, device=dev)
            drafter.start(64)
            seq, accepted = list(prompt), 0
            while len(seq) < len(prompt) + 24:
                before = len(seq)
                drafted, n, tok = step_checked(speculative_step(tgt, tcache, drafter, seq, gamma), gamma)
                accepted += n
                assert len(drafted) == gamma, f"gamma={gamma}: the model drafter proposes gamma tokens"
                assert len(seq) == before + n + 1, (f"seq must grow by n + 1 = {n + 1} tokens (the accepted drafts, then the "
                                                    f"target's token: a correction, or the bonus when every draft was "
                                                    f"accepted), grew by {len(seq) - before}")
                assert expect_ints(seq[before:], "the tokens the step appended to seq") == drafted[:n] + [tok], \
                    "seq gains the accepted drafts, then the target's token"
                assert seq == ref[:len(seq)], f"gamma={gamma}: the text departs from the target's greedy text"
                _same_cache(tcache, len(seq) - 1, _fresh_cache(tgt, seq[:-1]),
                            f"gamma={gamma}, target cache after a step (it must hold len(seq) - 1 tokens)")
                held = int(drafter.cache.lengths[0])
                assert held <= len(seq) - 1, f"gamma={gamma}: the draft cache still holds {held} positions; roll it back to at most len(seq) - 1 = {len(seq) - 1}"
                _same_cache(drafter.cache, held, _fresh_cache(dm, seq[:held]), f"gamma={gamma}, draft cache after a step")
            assert 0 < accepted, "self-check: the perturbed draft agrees some of the time"
    # the target as its own draft: every draft is accepted and every step ends with a bonus token
    out, steps = generated(tgt, ModelDrafter(tgt), [1, 2, 3], 20, gamma=3)
    assert all(n == 3 for _, n, _ in steps), "a draft identical to the target must have every draft accepted"
    assert len(steps) == 5, f"20 tokens at 4 tokens per pass (3 drafts + the bonus) take 5 target passes, took {len(steps)}"
    assert out == plain_generate(tgt, [1, 2, 3], 20), "with the target as its own draft, the output must still be its greedy text"
    # sampling: reproducible; with the target as its own draft, everything is accepted
    a = generated(tgt, ModelDrafter(tgt), [1, 2, 3], 16, gamma=2, temperature=1.0, seed=4)
    b = generated(tgt, ModelDrafter(tgt), [1, 2, 3], 16, gamma=2, temperature=1.0, seed=4)
    assert a == b, "the same seed must give the same sampled text"
    assert all(n == len(d) for d, n, _ in a[1]), "at temperature 1 a draft equal to the target is always accepted (p = q)"
    dm = _perturbed(tgt, 10, 0.15)
    for temperature in (0.7, 1.0):
        drafter, tcache = ModelDrafter(dm), SlotKVCache(tgt.cfg, n_slots=1, max_len=64, device=dev)
        drafter.start(64)
        seq, g = [7, 8, 9], torch.Generator().manual_seed(1)
        while len(seq) < 30:
            step_checked(speculative_step(tgt, tcache, drafter, seq, 4, temperature, g), 4)
            _same_cache(tcache, len(seq) - 1, _fresh_cache(tgt, seq[:-1]),
                        f"temperature {temperature}: target cache (it must hold len(seq) - 1 tokens)")
            held = int(drafter.cache.lengths[0])
            assert held <= len(seq) - 1, f"temperature {temperature}: roll the draft cache back"
            _same_cache(drafter.cache, held, _fresh_cache(dm, seq[:held]), f"temperature {temperature}: draft cache")
    # prompt lookup: fewer than gamma drafts, or none
    looped = [5, 6, 7, 8, 5, 6, 7, 8, 5, 6]
    ng = NgramDrafter(40)
    tcache = SlotKVCache(tgt.cfg, n_slots=1, max_len=64, device=dev)
    seq = list(looped)
    drafted, n, tok = step_checked(speculative_step(tgt, tcache, ng, seq, 6), 6)
    assert drafted == [7, 8, 5, 6], "self-check"
    ref = list(looped)
    for _ in range(n + 1):
        ref.append(int(_full_logits(tgt, ref)[-1].argmax()))
    assert expect_ints(seq, "seq after the step") == ref, "prompt lookup step: the text must follow the target's greedy choice"
    _same_cache(tcache, len(seq) - 1, _fresh_cache(tgt, seq[:-1]), "after a prompt-lookup step")
    seq = [1, 2, 3]
    tcache = SlotKVCache(tgt.cfg, n_slots=1, max_len=64, device=dev)
    drafted, n, tok = step_checked(speculative_step(tgt, tcache, ng, seq, 4), 4)
    assert drafted == [] and n == 0 and expect_ints(seq, "seq after the step") == [1, 2, 3, int(_full_logits(tgt, [1, 2, 3])[-1].argmax())], \
        "no drafts: the step is a plain decoding step"
    _same_cache(tcache, 3, _fresh_cache(tgt, [1, 2, 3]), "after a step without drafts")
    assert len(seq) == 4, "a step without drafts adds exactly one token"
### END HIDDEN TESTS
"""),
] + MEASURE

write_notebook("labs/08_speculative_decoding/08_speculative_decoding.ipynb", cells + [md(CHECK_YOUR_WORK)])
print("wrote labs/08_speculative_decoding/08_speculative_decoding.ipynb")
