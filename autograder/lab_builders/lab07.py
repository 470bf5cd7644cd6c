"""Builds the lab 07 source notebook. Edit this file (or its section, lab07_penalties.py), then run
from the repo root:

    .venv/bin/python -m autograder.lab_builders.lab07

Sections: this file (greedy, Problems 1-5, then Problems 7-8, the measurements, the summary) and
lab07_penalties.py (section 5: penalties and logit bias, Problem 6, a greedy loop broken by them).
"""
from autograder.authoring import answer, code, locked, md, solution, tests, write_notebook  # noqa: E402
from autograder.lab_builders.common_cells import CHECK_YOUR_WORK, COLAB_INSTALL, SETUP  # noqa: E402
from autograder.lab_builders.lab07_penalties import CELLS as PENALTIES  # noqa: E402

# The independent reference of the hidden tests: the kept set and final probabilities of one row,
# in float64 with plain Python loops, following vLLM's order (temperature, min-p, top-k, top-p).
HIDDEN_REFERENCE = r'''
import math as _math
def _ref_probs(z, t=1.0, k=0, p=1.0, m=0.0):
    # z: one row of logits (list of floats) -> {token: probability} over the survivors
    V = len(z)
    if t == 0:
        best = max(range(V), key=lambda i: z[i])
        return {best: 1.0}
    x = [v / t for v in z]
    def soft(keep):
        top = max(x[i] for i in keep)
        e = {i: _math.exp(x[i] - top) for i in keep}
        s = sum(e.values())
        return {i: e[i] / s for i in keep}
    keep = set(range(V))
    if m > 0:
        pr = soft(keep)
        keep = {i for i in keep if pr[i] >= m * max(pr.values())}
    if 0 < k < len(keep):
        kth = sorted((x[i] for i in keep), reverse=True)[k - 1]
        keep = {i for i in keep if x[i] >= kth}
    if p < 1:
        pr = soft(keep)
        above, kept = 0.0, set()
        for i in sorted(keep, key=lambda i: -pr[i]):
            if above < p:
                kept.add(i)
            above += pr[i]
        keep = kept
    return soft(keep)
def _kept(row):
    # the surviving (finite) token ids of one row, (V,) or (1, V)
    return set(torch.nonzero(torch.isfinite(row.reshape(-1))).flatten().tolist())
'''.strip("\n")

# Tiny Llama models in transformers, and the same weights in the course's Decoder: HF generate is
# the reference for beam search, with an EOS token the model really emits.
HIDDEN_TINY = r'''
from transformers import LlamaConfig as _LlamaConfig, LlamaForCausalLM as _LlamaForCausalLM
from course.models import decoder_from_hf_state as _from_hf
def _tiny_pair(seed, V=48):
    torch.manual_seed(seed)
    cfg = _LlamaConfig(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=True,
                       bos_token_id=None, eos_token_id=None, pad_token_id=None)
    hf = _LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for prm in hf.parameters():
            prm.copy_(torch.randn_like(prm) * 0.3)              # drawn on the CPU: the same weights on every device
    hf = hf.to(dev)
    return hf, _from_hf(course.ModelConfig.from_hf(hf.config), hf.state_dict(), device=dev)
'''.strip("\n")

cells = [
md(r"""
# Lab 07: Sampling, from scores to text

The model gives a score to every token of its vocabulary; something else must pick one. That choice
is the **sampler**, the last step of every decode iteration, and it shapes the text as much as the
model does. Pick the top token every time (**greedy**) and the text is safe, and often loops.
Pick at random from the whole distribution and it drifts into nonsense, because thousands of
unlikely tokens together hold real probability. Between the two sit the knobs every serving API
exposes: **temperature**, **top-k**, **top-p** and **min-p**, and the **penalties** that push down
tokens the text already holds, against loops. A server applies them per request, in one batch, in a
fixed order, and a seed's random draws must not depend on whoever else is in the batch. **Beam
search** takes another path: it keeps several candidate texts and returns the most likely one it finds.

**You will**
- see greedy decoding repeat itself, and measure it (repetition and distinct-n);
- write temperature, top-k, top-p and min-p as logits processors that work on a whole batch, each row with its own settings;
- combine them into one batched sampler, in the order vLLM applies them, with greedy rows and one random generator per request (like vLLM's `SamplingParams(seed=...)`);
- write the repetition, frequency and presence penalties and the logit bias of the OpenAI/vLLM request, in vLLM's order, and break a greedy loop with them;
- write beam search with a length penalty whose output equals Hugging Face `generate(num_beams=...)` on the real model;
- explore the next-token distribution in a widget, and measure repetition and diversity of greedy, beam and sampled text, and what temperature does.

**Time:** about 3 hours 55 minutes: 40 minutes of reading, eight problems (temperature, top-k, top-p
and min-p 10-15 minutes each, the batched sampler and seeded generation about 45 minutes together,
penalties about 25, beam search about 50), 25 minutes for the written questions at the end, and about
2 minutes of running on a laptop CPU (1.8 minutes measured on 2 cores). **Hardware:** everything runs on a laptop CPU; a GPU
is used when there is one.
"""),
locked("colab_install", COLAB_INSTALL),
locked("setup", SETUP),
md(r"""
## 1. Greedy decoding, and what goes wrong with it

The model and tokenizer of the earlier labs, and the engine loop of lab 04 as given code: a static
batch (left padding, mask-derived positions, one KV-cache slot per row). One thing is new. The loop
does not choose tokens itself: it calls `pick(logits)` with the last logits of every row, `(B, V)`,
and appends the `(B,)` token ids it returns. `pick` is the **sampler**, the part you write today.

On a GPU the model runs in bfloat16 (`env.dtype`). The tests that compare tokens one for one (your
beam search against Hugging Face, a seed's text alone and in a batch) run `model_fp32`, a float32
copy: in bfloat16 two correct programs can round a near-tie differently. On a CPU both are the same model.
"""),
locked("engine", r'''
import torch
from course.engine import SlotKVCache, forward_cached

tokenizer = course.load_tokenizer()
model = course.load_model(device=env.device, dtype=env.dtype)
model_fp32 = model if env.dtype == torch.float32 else course.load_model(device=env.device)   # for exact comparisons
dev = env.device
EOS = tokenizer.eos_token_id


@torch.no_grad()
def generate(model, prompts: list[list[int]], max_new_tokens: int, pick, eos_token_id: int | None = None,
             pad_id: int = 0) -> list[list[int]]:
    """Static batch (lab 04): left-pad, prefill once, then decode in lockstep. `pick(logits)` maps the
    last logits of every row (B, V) to one new token per row (B,). A row stops after its EOS (kept)."""
    B, T, d = len(prompts), max(len(p) for p in prompts), model.device
    ids = torch.full((B, T), pad_id, dtype=torch.long, device=d)
    mask = torch.zeros((B, T), dtype=torch.long, device=d)
    for b, p in enumerate(prompts):
        ids[b, T - len(p):], mask[b, T - len(p):] = torch.tensor(p, device=d), 1
    pos = (mask.cumsum(-1) - 1).clamp(min=0)                               # (B, T): positions skip the pads
    cache = SlotKVCache(model.cfg, n_slots=B, max_len=T + max_new_tokens, dtype=model.dtype, device=d)
    slots = torch.arange(B, device=d)
    logits = forward_cached(model, ids, pos, cache, slots, mask)[:, -1]    # (B, V)
    next_pos = pos[:, -1:] + 1                                             # (B, 1)
    out, done = [[] for _ in prompts], [False] * B
    for step in range(max_new_tokens):
        tokens = pick(logits)                                              # (B,): the sampler's choice
        for b, t in enumerate(tokens.tolist()):
            if not done[b]:
                out[b].append(t)
                done[b] = t == eos_token_id
        if all(done) or step + 1 == max_new_tokens:
            return out
        logits = forward_cached(model, tokens.view(B, 1).to(d), next_pos, cache, slots)[:, -1]
        next_pos = next_pos + 1
    return out


def greedy_pick(logits: torch.Tensor) -> torch.Tensor:
    return logits.argmax(dim=-1)                                           # (B, V) -> (B,)
'''),
md(r"""
Greedy decoding of a short text about food. Read it to the end.
"""),
code(r"""
story = tokenizer("I like to eat").input_ids
greedy_story = generate(model, [story], 64, greedy_pick)[0]
print(tokenizer.decode(story + greedy_story))
"""),
md(r"""
Greedy text tends to fall into a loop: once a phrase has been written, writing it again becomes the
most likely continuation. Two numbers make that measurable, for any list of token ids:

- **repetition**: the share of its 3-grams (runs of 3 tokens) that already appeared earlier in the same text;
- **distinct-n** (Li et al., 2016): the number of *different* n-grams divided by the number of n-grams.
  1.0 means no n-gram repeats; a text stuck in a loop scores low. Pooled over several texts written
  for the same prompt, it also says how different those texts are from each other.
"""),
code(r"""
def ngrams(tokens, n):
    return [tuple(tokens[i:i + n]) for i in range(len(tokens) - n + 1)]

def distinct_n(texts: list[list[int]], n: int) -> float:
    '''Different n-grams / all n-grams, pooled over the texts.'''
    grams = [g for t in texts for g in ngrams(t, n)]
    return len(set(grams)) / max(len(grams), 1)

def repetition(tokens: list[int], n: int = 3) -> float:
    '''Share of the n-grams of one text that already appeared earlier in it.'''
    grams = ngrams(tokens, n)
    return sum(g in set(grams[:i]) for i, g in enumerate(grams)) / max(len(grams), 1)

half = len(greedy_story) // 2
for name, part in (("first half", greedy_story[:half]), ("second half", greedy_story[half:]), ("whole", greedy_story)):
    print(f"{name:>11}: repetition {repetition(part):.2f}, distinct-1 {distinct_n([part], 1):.2f}, "
          f"distinct-2 {distinct_n([part], 2):.2f}")
"""),
md(r"""
Compare the two halves: if the text loops, the second half repeats more than the first. The cure the
workshop proposes is **randomness**: draw the next token from the model's distribution instead of
always taking its top. But a raw draw from all 49,152 tokens gives the long tail of unlikely tokens
a say, and one bad draw derails the text. The next sections build the tools that control the draw.

## 2. Temperature

The model's distribution for the next token is $p_i = \mathrm{softmax}(z)_i$ over its logits $z$.
Dividing the logits by a **temperature** $\tau$ before the softmax reshapes it (lab 01):
$\tau < 1$ widens the gaps between scores, so the top tokens gain; $\tau > 1$ narrows them, so
the tail gains; $\tau \to 0$ puts all the mass on the top token, which is greedy decoding.
Engines accept $\tau = 0$ and treat it as greedy; dividing by 0 itself would give `inf - inf = nan`.

A server works on a **batch**: one row of logits per request, and each request asks for its own
temperature. So every function you write in this lab takes `logits` of shape `(B, V)` and one
setting per row, a `(B,)` tensor. They are **logits processors**: logits in, logits out, like HF's
`LogitsProcessor` classes and the functions in vLLM's sampler.

## Problem 1: Temperature (2 points)

**Deliverable:** `apply_temperature(logits, temperature)` takes `logits` `(B, V)` and `temperature`
`(B,)` and returns new logits `(B, V)`: row `b` divided by `temperature[b]`, except rows whose
temperature is 0, which are returned unchanged (they are greedy: the sampler takes their argmax).
It raises `ValueError` if a temperature is negative, and never modifies its input.

**Grading.** The tests of Problems 1-6 check many independent settings (a temperature, a `k`, a `p`, a
`min_p`, one request's parameters in a batch, a penalty). Each setting is a *case* worth its share of the
problem's points: a mistake that breaks some settings costs only their share, and the feedback lists
the cases you lost. Problems 7 and 8 test one property each, all or nothing.
"""),
solution("temperature", r'''
def apply_temperature(logits: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    """Row b divided by temperature[b]; rows at temperature 0 (greedy) unchanged."""
    ### BEGIN SOLUTION
    t = torch.as_tensor(temperature, dtype=logits.dtype, device=logits.device)
    if (t < 0).any():
        raise ValueError(f"temperature must be >= 0 (0 means greedy), got {t.tolist()}")
    t = torch.where(t == 0, torch.ones_like(t), t)       # greedy rows: divide by 1
    return logits / t[:, None]                           # (B, V) / (B, 1)
    ### END SOLUTION
'''),
tests("temperature_tests", 2, r"""
from course.expect import Cases, expect_tensor

def tempered(z, t):
    '''Your apply_temperature, its answer checked first: new (B, V) logits of z's dtype, on z's device.'''
    return expect_tensor(apply_temperature(z, t), f"apply_temperature(logits, {[round(v, 4) for v in t.tolist()]})", dtype=z.dtype,
                         shape=tuple(z.shape), device=dev)

cases = Cases(points=2)        # partial credit: each case below is worth its share of the points
z = torch.tensor([[1.0, 2.0, 4.0], [1.0, 2.0, 4.0], [0.0, -3.0, 3.0]], device=dev)
t = torch.tensor([0.5, 2.0, 0.0], device=dev)
with cases("temperature 0.5"):
    assert torch.allclose(tempered(z.clone(), t)[0], torch.tensor([2.0, 4.0, 8.0], device=dev)), \
        "row 0 at temperature 0.5: every logit doubles"
with cases("temperature 2"):
    assert torch.allclose(tempered(z.clone(), t)[1], torch.tensor([0.5, 1.0, 2.0], device=dev)), \
        "row 1 at temperature 2: every logit halves"
with cases("temperature 0 (greedy)"):
    assert torch.equal(tempered(z.clone(), t)[2], z[2]), "temperature 0 means greedy: the row stays as it is (no division by 0)"
with cases("the input is left alone"):
    given = z.clone()
    tempered(given, t)
    assert torch.equal(given, z), "do not modify the input logits"
### BEGIN HIDDEN TESTS
g = torch.Generator().manual_seed(1)                         # test data drawn on the CPU: the same numbers on every device
Z = torch.randn(6, 50, generator=g).to(dev) * 4
T = torch.tensor([0.3, 1.0, 0.0, 1.7, 0.0, 2.5], device=dev)
for b in range(6):
    with cases(f"row {b} of a batch, temperature {T[b].item():g}"):
        got = tempered(Z.clone(), T)
        want = Z[b] if T[b] == 0 else Z[b] / T[b]
        assert torch.isfinite(got[b]).all(), f"row {b}, temperature {T[b].item():g}: no inf or nan (a temperature-0 row is not divided)"
        assert torch.allclose(got[b], want, atol=1e-6), \
            f"row {b}, temperature {T[b].item():g}: wrong logits (row b is divided by temperature[b]; a temperature-0 row stays)"
with cases("a batch: the input is left alone"):
    given = Z.clone()
    tempered(given, T)
    assert torch.equal(given, Z), "apply_temperature must not modify its input"
with cases("low temperature sharpens, high flattens"):
    p_cold = torch.softmax(tempered(Z[:1].clone(), torch.tensor([0.2], device=dev)), -1)
    p_hot = torch.softmax(tempered(Z[:1].clone(), torch.tensor([5.0], device=dev)), -1)
    assert p_cold.max() > torch.softmax(Z[:1], -1).max() > p_hot.max(), "a low temperature sharpens, a high one flattens"
with cases("a negative temperature"):
    try:
        tempered(Z[:2].clone(), torch.tensor([1.0, -0.5], device=dev))
    except ValueError:
        pass
    else:
        raise AssertionError("a negative temperature must raise ValueError")
### END HIDDEN TESTS
cases.score()
"""),
md(r"""
## 3. Truncation: top-k, top-p, min-p

Temperature alone cannot silence the tail: at $\tau = 1$ the thousands of unlikely tokens of a
49,152-token vocabulary may together hold a fair share of the probability, so a long text will
sooner or later draw one of them. **Truncation** removes tokens before the draw: a removed token
gets the logit $-\infty$, so the softmax gives it probability 0 and the survivors share the rest
(they are *renormalized*). Three rules decide who survives:

- **top-k** (Fan et al., 2018): the `k` highest-scoring tokens. Simple, but one `k` fits no context:
  after "The capital of France is" a few tokens deserve nearly all the mass, after "I like to eat"
  hundreds are reasonable.
- **top-p**, or nucleus sampling (Holtzman et al., 2020): the smallest set of top tokens whose
  probabilities add up to at least `p`. It adapts: few survivors when the model is sure, many when
  it is not.
- **min-p** (Nguyen et al., 2024): every token at least `min_p` times as likely as the top token.

Three details matter, and the tests check all of them:

1. **Top-k and ties.** Keep every token whose logit is at least the `k`-th largest logit. When
   several tokens tie with the `k`-th, all of them survive (more than `k` tokens), as in HF's
   `TopKLogitsWarper` and vLLM. Keeping exactly `k` would make the survivors depend on the order
   of the vocabulary, an accident of the tokenizer. `top_k = 0` means off, and so does any `k >= V`.
2. **Top-p keeps the token that crosses `p`.** Sort by probability, largest first. A token
   survives if the tokens ranked **above** it hold less than `p` in total. With probabilities 0.5,
   0.3, 0.2 and `p = 0.6`, the first two survive: 0.5 alone is short of 0.6, and the second token is
   the one that takes the sum past it. (Dropping every token where the running sum including itself
   exceeds `p` is a common bug: it keeps only 0.5, less mass than asked for.) The top token always
   survives. `top_p = 1` means off: nothing is removed, even tokens of tiny probability. (Careful:
   a float32 running sum can reach 1.0 before the last token.)
3. **Kept logits stay as they are**: a processor only writes $-\infty$ over removed tokens. It never
   modifies its input.

## Problem 2: Top-k (3 points)

**Deliverable:** `apply_top_k(logits, top_k)` takes `logits` `(B, V)` (some may already be
$-\infty$) and `top_k` `(B,)` integers, and returns logits where, in each row `b` with
`0 < top_k[b] < V`, every token whose logit is below the row's `top_k[b]`-th largest logit is set to
$-\infty$. Other rows are unchanged.
"""),
solution("top_k", r'''
def apply_top_k(logits: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
    """Per row, remove the tokens below the k-th largest logit (ties with it survive); k = 0 or k >= V: off."""
    ### BEGIN SOLUTION
    V = logits.shape[-1]
    k = torch.as_tensor(top_k, dtype=torch.long, device=logits.device)
    k = torch.where((k <= 0) | (k > V), torch.full_like(k, V), k)          # off: keep all V
    kth = logits.sort(dim=-1, descending=True).values.gather(1, (k - 1)[:, None])   # (B, 1)
    return logits.masked_fill(logits < kth, float("-inf"))
    ### END SOLUTION
'''),
tests("top_k_tests", 3, r"""
from course.expect import Cases, expect_tensor

def top_k_of(z, k):
    '''Your apply_top_k, its answer checked first: new (B, V) logits of z's dtype, on z's device.'''
    return expect_tensor(apply_top_k(z, k), f"apply_top_k(logits, {k.tolist()})", dtype=z.dtype, shape=tuple(z.shape),
                         device=dev)

cases = Cases(points=3)        # partial credit: each case below is worth its share of the points
z = torch.tensor([[3.0, 1.0, 2.0, 0.5], [3.0, 1.0, 2.0, 0.5]], device=dev)
k = torch.tensor([2, 0], device=dev)
with cases("top_k=2"):
    out = top_k_of(z.clone(), k)
    assert torch.isinf(out[0]).tolist() == [False, True, False, True], "top_k=2 keeps the two largest logits (3.0 and 2.0)"
    assert torch.equal(out[0, [0, 2]], z[0, [0, 2]]), "kept logits stay unchanged"
with cases("top_k=0 (off)"):
    assert torch.equal(top_k_of(z.clone(), k)[1], z[1]), "top_k=0 means off: the row is unchanged"
with cases("ties with the k-th largest"):
    tied = top_k_of(torch.tensor([[1.0, 2.0, 2.0, 2.0, 0.0]], device=dev), torch.tensor([2], device=dev))
    assert torch.isinf(tied[0]).tolist() == [True, False, False, False, True], \
        "ties: every token equal to the k-th largest logit survives (here three tokens tie at 2.0)"
### BEGIN HIDDEN TESTS
""" + HIDDEN_REFERENCE + r"""
g = torch.Generator().manual_seed(2)                         # test data drawn on the CPU: the same numbers on every device
Z = torch.randn(5, 40, generator=g).to(dev) * 3
ks = torch.tensor([1, 7, 0, 40, 55], device=dev)
for b, kb in enumerate(ks.tolist()):
    with cases(f"row {b} of a batch, top_k={kb}" + (" (off: k >= V)" if kb >= 40 else " (off)" if kb == 0 else "")):
        got = top_k_of(Z.clone(), ks)
        want = set(range(40)) if kb <= 0 or kb >= 40 else set(torch.argsort(Z[b], descending=True)[:kb].tolist())
        assert _kept(got[b]) == want, (f"row {b}, top_k={kb}: wrong survivors: you keep {len(_kept(got[b]))} tokens"
                                       + ("; k = 0 or k >= V means off" if kb == 0 or kb >= 40 else "; keep the k largest logits of row b"))
        assert torch.equal(got[b][list(want)], Z[b][list(want)]), "kept logits must stay unchanged"
with cases("a batch: the input is left alone"):
    given = Z.clone()
    top_k_of(given, ks)
    assert torch.equal(given, Z), "apply_top_k must not modify its input"
ties = torch.tensor([[5.0, 1.0, 5.0, 3.0, 3.0, 3.0, 0.0], [5.0, 1.0, 5.0, 3.0, 3.0, 3.0, 0.0],
                     [5.0, 1.0, 5.0, 3.0, 3.0, 3.0, 0.0], [2.0, 2.0, 2.0, 2.0, 2.0, 2.0, 2.0]], device=dev)
tie_ks = torch.tensor([1, 3, 5, 2], device=dev)
for row, want, why in ((0, {0, 2}, "top_k=1 with two tokens tied at the top: both survive"),
                       (1, {0, 2, 3, 4, 5}, "top_k=3: the 3rd largest is 3.0, and every token at 3.0 survives"),
                       (2, {0, 2, 3, 4, 5}, "top_k=5: exactly the tokens down to the 5th largest"),
                       (3, set(range(7)), "all logits equal: every token ties with the k-th and survives")):
    with cases(f"ties, top_k={tie_ks[row].item()}" + (" (all logits equal)" if row == 3 else "")):
        assert _kept(top_k_of(ties.clone(), tie_ks)[row]) == want, why
masked = torch.tensor([[0.0, float("-inf"), 1.0, float("-inf"), 2.0]], device=dev)
with cases("a row with -inf already, top_k=4"):
    assert _kept(top_k_of(masked.clone(), torch.tensor([4], device=dev))) == {0, 2, 4}, "tokens already at -inf stay removed"
with cases("a row with -inf already, top_k=2"):
    assert _kept(top_k_of(masked.clone(), torch.tensor([2], device=dev))) == {2, 4}, "top_k=2 over a row with two tokens at -inf"
### END HIDDEN TESTS
cases.score()
"""),
md(r"""
## Problem 3: Top-p (3 points)

**Deliverable:** `apply_top_p(logits, top_p)` takes `logits` `(B, V)` (some may already be
$-\infty$) and `top_p` `(B,)` in `(0, 1]`, and returns logits where, in each row with
`top_p[b] < 1`, every token is set to $-\infty$ unless the tokens more probable than it (by the
softmax of that row) hold less than `top_p[b]` in total. Rows with `top_p[b] == 1` are unchanged.
Raise `ValueError` for a `top_p` outside `(0, 1]`.
"""),
solution("top_p", r'''
def apply_top_p(logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Per row, keep the most probable tokens until their mass reaches top_p (the crossing token too)."""
    ### BEGIN SOLUTION
    p = torch.as_tensor(top_p, dtype=torch.float32, device=logits.device)
    if ((p <= 0) | (p > 1)).any():
        raise ValueError(f"top_p must be in (0, 1], got {p.tolist()}")
    probs = logits.float().softmax(dim=-1)                                # (B, V)
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    above = sorted_probs.cumsum(dim=-1) - sorted_probs                    # mass ranked above each token
    drop_sorted = (above >= p[:, None]) & (p[:, None] < 1)                # top_p = 1: drop nothing
    drop_sorted[:, 0] = False                                             # the top token always survives
    drop = torch.zeros_like(drop_sorted).scatter(1, order, drop_sorted)   # back to vocabulary order
    return logits.masked_fill(drop, float("-inf"))
    ### END SOLUTION
'''),
tests("top_p_tests", 3, r"""
from course.expect import Cases, expect_tensor

def top_p_of(z, p):
    '''Your apply_top_p, its answer checked first: new (B, V) logits of z's dtype, on z's device.'''
    return expect_tensor(apply_top_p(z, p), f"apply_top_p(logits, {[round(v, 4) for v in p.tolist()]})", dtype=z.dtype, shape=tuple(z.shape),
                         device=dev)

cases = Cases(points=3)        # partial credit: each case below is worth its share of the points
z = torch.tensor([0.5, 0.3, 0.2], device=dev).log().expand(4, 3)
p = torch.tensor([0.6, 0.45, 0.9, 1.0], device=dev)
with cases("top_p=0.6"):
    out = top_p_of(z, p)
    assert torch.isinf(out[0]).tolist() == [False, False, True], \
        "top_p=0.6 over (0.5, 0.3, 0.2): 0.5 alone is short of 0.6, so the token that crosses it (0.3) is kept too"
    assert torch.equal(out[0, :2], z[0, :2]), "kept logits stay unchanged"
with cases("top_p=0.45"):
    assert torch.isinf(top_p_of(z, p)[1]).tolist() == [False, True, True], "top_p=0.45: the top token alone reaches it"
with cases("top_p=0.9"):
    assert torch.isinf(top_p_of(z, p)[2]).tolist() == [False, False, False], \
        "top_p=0.9: 0.5 + 0.3 = 0.8 < 0.9, so 0.2 is needed too"
with cases("top_p=1 (off)"):
    assert torch.equal(top_p_of(z, p)[3], z[3]), "top_p=1 is off: the row is unchanged"
    wide = torch.linspace(30.0, -30.0, 200, device=dev)[None]
    assert torch.equal(top_p_of(wide.clone(), torch.tensor([1.0], device=dev)), wide), \
        "top_p=1 is off: nothing is removed, not even tokens whose probability is tiny (a float32 running sum reaches 1.0 early)"
### BEGIN HIDDEN TESTS
""" + HIDDEN_REFERENCE + r"""
g = torch.Generator().manual_seed(3)                         # test data drawn on the CPU: the same numbers on every device
Z = torch.randn(6, 30, generator=g).to(dev) * 2.5
ps = [0.05, 0.3, 0.62, 0.9, 0.97, 1.0]
for b, pb in enumerate(ps):                                  # self-check of the data, before any case
    srt = torch.softmax(Z[b].double(), -1).sort(descending=True).values
    assert pb == 1.0 or ((srt.cumsum(0) - srt - pb).abs() > 1e-4).all(), "self-check: no token sits on the boundary"
for b, pb in enumerate(ps):
    with cases(f"row {b} of a batch, top_p={pb:g}"):
        got = top_p_of(Z.clone(), torch.tensor(ps, device=dev))
        ref, kept = set(_ref_probs(Z[b].double().tolist(), p=pb)), _kept(got[b])
        assert kept == ref, (f"row {b}, top_p={pb:g}: you keep {len(kept)} tokens, "
                             + ("too many" if kept > ref else "too few" if kept < ref else "not the right ones")
                             + ": sort by probability; a token survives when the tokens ranked above it hold less than "
                               "top_p (the token that crosses top_p is kept)" + ("; top_p = 1 removes nothing" if pb == 1 else ""))
        assert torch.equal(got[b][sorted(ref)], Z[b][sorted(ref)]), "kept logits must stay unchanged"
with cases("a batch: the input is left alone"):
    given = Z.clone()
    top_p_of(given, torch.tensor(ps, device=dev))
    assert torch.equal(given, Z), "apply_top_p must not modify its input"
with cases("a tiny top_p"):
    two = torch.tensor([[4.0, 0.0, -1.0, -2.0]], device=dev)
    assert _kept(top_p_of(two, torch.tensor([0.01], device=dev))) == {0}, "the top token always survives"
masked = torch.tensor([[2.0, float("-inf"), 1.0, 0.0, float("-inf")]], device=dev)      # probabilities 0.665, 0.245, 0.090
with cases("a row with -inf already, top_p=0.8"):
    assert _kept(top_p_of(masked.clone(), torch.tensor([0.8], device=dev))) == {0, 2}, \
        "probabilities come from the softmax over the row as given; the token that crosses top_p is kept"
with cases("a row with -inf already, top_p=1"):
    assert _kept(top_p_of(masked.clone(), torch.tensor([1.0], device=dev))) == {0, 2, 3}, "top_p = 1 keeps every token not already at -inf"
with cases("top_p=1 over a wide row"):
    wide = torch.linspace(40.0, -40.0, 500, device=dev).expand(2, 500)
    assert torch.equal(top_p_of(wide.clone(), torch.tensor([1.0, 1.0], device=dev)), wide), "top_p = 1 removes nothing"
for bad in (0.0, 1.5, -0.2):
    with cases(f"top_p={bad} is refused"):
        try:
            top_p_of(Z[:1].clone(), torch.tensor([bad], device=dev))
        except ValueError:
            pass
        else:
            raise AssertionError(f"top_p={bad} must raise ValueError (top_p is in (0, 1])")
### END HIDDEN TESTS
cases.score()
"""),
md(r"""
### See it: which tokens survive?

The real model's distribution for the next token after a prompt, reshaped by your three functions.
Each row is one of the 12 most likely tokens: the light bar is its probability at the chosen
temperature before truncation, the dark bar its probability after truncation and renormalization,
and a struck-out grey row is a token that was cut. The last row gathers the rest of the vocabulary.
Every combination of the sliders is computed ahead of time from your functions, so the widget also
works in a static page.
"""),
code(r"""
from course.widgets import sampling_explorer

def truncate(z, temperature, top_k, top_p):
    '''One row (V,) through your processors: temperature, then top-k, then top-p.'''
    row = apply_temperature(z[None], torch.tensor([float(temperature)], device=z.device))
    row = apply_top_k(row, torch.tensor([int(top_k)], device=z.device))
    return apply_top_p(row, torch.tensor([float(top_p)], device=z.device))[0]

explore_prompt = "My favourite food is"
with torch.no_grad():
    ids = torch.tensor([tokenizer(explore_prompt).input_ids], device=dev)
    explore_logits = model(ids, torch.arange(ids.shape[1], device=dev)[None])[0, -1].float().cpu()
sampling_explorer(explore_logits, lambda i: tokenizer.decode([i]), truncate, prompt=explore_prompt)
"""),
md(r"""
Try: at temperature 1 with top-k and top-p off, how much probability sits outside the 12 rows?
Move top-p to 0.8, then raise the temperature: more tokens survive, because a flatter distribution
needs more tokens to reach 80%. Top-k does not react to temperature at all (the ranking does not
change). Now compare a prompt where the model is sure of itself:
"""),
code(r"""
def survivors_at(prompt, temperature=1.0, top_k=0, top_p=1.0):
    with torch.no_grad():
        ids = torch.tensor([tokenizer(prompt).input_ids], device=dev)
        z = model(ids, torch.arange(ids.shape[1], device=dev)[None])[0, -1].float()
    return int(torch.isfinite(truncate(z, temperature, top_k, top_p)).sum())

for prompt in ("The capital of France is", "The weather today is", "I like to eat"):
    print(f"{prompt!r:28}: top-p 0.9 keeps {survivors_at(prompt, top_p=0.9):5d} tokens, "
          f"top-p 0.5 keeps {survivors_at(prompt, top_p=0.5):4d}, top-k 50 keeps {survivors_at(prompt, top_k=50)}")
"""),
md(r"""
Top-k keeps k tokens whatever the context (a few more where logits tie with the k-th, which bf16's
coarse steps make common on a GPU). Top-p keeps a handful where the model is
sure and many more where it is not. That adaptivity is why top-p became the default knob of most APIs.

## Problem 4: Min-p (2 points)

Min-p also adapts, with a rule that is cheaper (no sort) and reads differently: a token survives if
it is at least `min_p` times as probable as the top token. With `min_p = 0.1` and a top token at
0.6, the bar is 0.06; with a top token at 0.05, it is 0.005.

**Deliverable:** `apply_min_p(logits, min_p)` takes `logits` `(B, V)` and `min_p` `(B,)` in `[0, 1]`
and returns logits where every token whose probability (softmax of its row) is below `min_p[b]`
times the row's largest probability is set to $-\infty$. `min_p = 0` changes nothing.
"""),
solution("min_p", r'''
def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Per row, remove the tokens less than min_p times as probable as the top token."""
    ### BEGIN SOLUTION
    m = torch.as_tensor(min_p, dtype=torch.float32, device=logits.device)
    probs = logits.float().softmax(dim=-1)                                # (B, V)
    bar = m[:, None] * probs.max(dim=-1, keepdim=True).values             # (B, 1)
    return logits.masked_fill(probs < bar, float("-inf"))
    ### END SOLUTION
'''),
tests("min_p_tests", 2, r"""
from course.expect import Cases, expect_tensor

def min_p_of(z, m):
    '''Your apply_min_p, its answer checked first: new (B, V) logits of z's dtype, on z's device.'''
    return expect_tensor(apply_min_p(z, m), f"apply_min_p(logits, {[round(v, 4) for v in m.tolist()]})", dtype=z.dtype, shape=tuple(z.shape),
                         device=dev)

cases = Cases(points=2)        # partial credit: each case below is worth its share of the points
z = torch.tensor([0.6, 0.3, 0.07, 0.03], device=dev).log().expand(3, 4)
m = torch.tensor([0.1, 0.4, 0.0], device=dev)
with cases("min_p=0.1"):
    assert torch.isinf(min_p_of(z, m)[0]).tolist() == [False, False, False, True], "min_p=0.1, top 0.6: the bar is 0.06, so 0.03 is cut"
with cases("min_p=0.4"):
    assert torch.isinf(min_p_of(z, m)[1]).tolist() == [False, False, True, True], "min_p=0.4: the bar is 0.24"
with cases("min_p=0 (off)"):
    assert torch.equal(min_p_of(z, m)[2], z[2]), "min_p=0 changes nothing"
### BEGIN HIDDEN TESTS
""" + HIDDEN_REFERENCE + r"""
g = torch.Generator().manual_seed(4)                         # test data drawn on the CPU: the same numbers on every device
Z = torch.randn(5, 30, generator=g).to(dev) * 2
ms = [0.0, 0.02, 0.13, 0.5, 1.0]
for b, mb in enumerate(ms):
    with cases(f"row {b} of a batch, min_p={mb:g}"):
        got = min_p_of(Z.clone(), torch.tensor(ms, device=dev))
        ref, kept = set(_ref_probs(Z[b].double().tolist(), m=mb)), _kept(got[b])
        assert kept == ref, (f"row {b}, min_p={mb:g}: you keep {len(kept)} tokens, "
                             + ("too many" if kept > ref else "too few" if kept < ref else "not the right ones")
                             + ": a token survives when its probability (softmax of its row) is at least min_p times the "
                               "row's largest probability")
        assert torch.equal(got[b][sorted(ref)], Z[b][sorted(ref)]), "kept logits must stay unchanged"
with cases("a batch: the input is left alone"):
    given = Z.clone()
    min_p_of(given, torch.tensor(ms, device=dev))
    assert torch.equal(given, Z), "apply_min_p must not modify its input"
with cases("the bar is relative"):
    hot = torch.tensor([[8.0, 7.0, 0.0, -1.0]], device=dev)
    assert _kept(min_p_of(hot, torch.tensor([0.3], device=dev))) == {0, 1}, "the bar is relative to the top probability"
### END HIDDEN TESTS
cases.score()
"""),
md(r"""
## 4. One sampler for a whole batch

An engine samples all the rows of a batch at once, and every row belongs to a different request with
its own settings. vLLM collects them in a `SamplingParams` per request; ours is a small version of it:
"""),
locked("sampling_params", r'''
from dataclasses import dataclass


@dataclass(frozen=True)
class SamplingParams:
    """One request's sampling settings (a small version of vLLM's SamplingParams)."""
    temperature: float = 1.0     # 0: greedy
    top_k: int = 0               # 0: off
    top_p: float = 1.0           # 1: off
    min_p: float = 0.0           # 0: off
    seed: int | None = None      # None: draw from torch's global generator

    def __post_init__(self):
        if not self.temperature >= 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not (isinstance(self.top_k, int) and self.top_k >= 0):
            raise ValueError(f"top_k must be an int >= 0 (0 = off), got {self.top_k!r}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
'''),
md(r"""
**The order.** The processors do not commute. Temperature must come first: top-p and min-p read
probabilities, and a user who lowers the temperature expects a narrower choice; were top-p applied
to the raw distribution, the survivors would not depend on the temperature at all. Top-k comes
before top-p, so top-p measures its mass over the top-k survivors (and only has to sort `k` tokens,
which fast GPU samplers exploit). Engines differ on min-p: vLLM's V1 sampler applies it right after
temperature, before top-k and top-p; HF `generate` applies temperature, top-k, top-p, then min-p.
We follow vLLM:

```
greedy rows (temperature 0):  argmax of the raw logits
other rows:  temperature -> min-p -> top-k -> top-p -> softmax -> draw one token
```

Top-k and min-p commute (both keep a top slice of the same ranking), but min-p and top-p do not: a
top-p applied after min-p measures `p` over fewer, renormalized tokens, and may keep fewer of them.
The cell after the sampler measures how often that changes the survivors on the real model.

**Random generators, one per request.** A request with a `seed` must get the same random draws every
time it is sent, whoever shares its batch (the batch changes at every step under continuous batching,
lab 04). So each seeded request owns a `torch.Generator`, seeded once when the request arrives and
advanced only by its own draws. Drawing a whole batch from one generator would tie every
request's randomness to its neighbours. Rows without a generator draw from torch's global one.

## Problem 5: The batched sampler (4 points)

**Deliverable:** `sample(logits, params, generators=None)` takes `logits` `(B, V)`, one
`SamplingParams` per row and, optionally, one `torch.Generator` or `None` per row (`generators=None`
means none at all), and returns `(B,)` `torch.long` token ids: the argmax of the raw logits for
rows at temperature 0, and for the other rows one token drawn from the distribution left by your
processors in the order above, each row with its own settings, a row with a generator drawing with
that generator only. Raise `ValueError` if `params` or `generators` does not have `B` entries. Do not
modify `logits`. (`torch.multinomial(probs, 1, generator=g)` draws one token from each row of `probs`;
on a GPU, `g` must live on the device of `probs`.) The tests run your sampler on the course's
processors (`course.engine.logits`), so a mistake in Problems 1-4 costs only their own points.
"""),
solution("sampler", r'''
def sample(logits: torch.Tensor, params: list[SamplingParams],
           generators: list[torch.Generator | None] | None = None) -> torch.Tensor:
    """One token per row: greedy rows take the argmax; the others are processed, then drawn."""
    B = logits.shape[0]
    if generators is None:
        generators = [None] * B
    if len(params) != B or len(generators) != B:
        raise ValueError(f"need one SamplingParams and one generator (or None) per row: B={B}, "
                         f"got {len(params)} params and {len(generators)} generators")
    ### BEGIN SOLUTION
    d = logits.device
    z = logits.float()
    greedy = z.argmax(dim=-1)                                             # (B,) from the raw logits
    z = apply_temperature(z, torch.tensor([q.temperature for q in params], device=d))
    z = apply_min_p(z, torch.tensor([q.min_p for q in params], device=d))
    z = apply_top_k(z, torch.tensor([q.top_k for q in params], device=d))
    z = apply_top_p(z, torch.tensor([q.top_p for q in params], device=d))
    probs = z.softmax(dim=-1)                                             # (B, V)
    out = greedy.clone()
    shared = [b for b in range(B) if params[b].temperature > 0 and generators[b] is None]
    if shared:                                                            # one draw for all of them
        out[shared] = torch.multinomial(probs[shared], 1).squeeze(1)
    for b in range(B):                                                    # each seeded row on its own
        if params[b].temperature > 0 and generators[b] is not None:
            out[b] = torch.multinomial(probs[b], 1, generator=generators[b])[0]
    return out
    ### END SOLUTION
'''),
tests("sampler_tests", 4, r"""
from course.engine import logits as course_logits
from course.expect import Cases, expect_tensor, substituted

# Graded on its own: here your sampler runs on the course's processors (Problems 1-4, released in
# course.engine.logits), so a mistake in one of them costs only that problem's points.
course_processors = dict(apply_temperature=course_logits.apply_temperature, apply_top_k=course_logits.apply_top_k,
                         apply_top_p=course_logits.apply_top_p, apply_min_p=course_logits.apply_min_p)

def sampled(z, params, generators=None):
    '''Your sample, its answer checked first: (B,) torch.long token ids on the logits' device.'''
    return expect_tensor(sample(z, params, generators), "sample(logits, params, generators)", dtype=torch.long,
                         shape=(z.shape[0],), device=dev)

cases = Cases(points=4)        # partial credit: each case below is worth its share of the points
with substituted(globals(), **course_processors):
    z = torch.tensor([[0.0, 3.0, 1.0, 2.0]], device=dev).repeat(3, 1)
    three = [SamplingParams(temperature=0.0), SamplingParams(top_k=1), SamplingParams(temperature=0.7, top_p=0.5)]
    with cases("temperature 0"):
        assert sampled(z.clone(), three)[0] == 1, "temperature 0 is greedy: the argmax of the raw logits"
    with cases("top_k=1"):
        assert sampled(z.clone(), three)[1] == 1, "top_k=1 leaves only the top token"
    with cases("temperature 0.7, top_p=0.5"):
        assert sampled(z.clone(), three)[2] == 1, "top_p=0.5 keeps only the top token here (p = 0.76 at temperature 0.7)"
    with cases("the logits are left alone"):
        given = z.clone()
        sampled(given, three)
        assert torch.equal(given, z), "do not modify the logits"
    flat = torch.zeros(1, 50, device=dev)
    with cases("a seeded row, drawn twice"):
        runs = [[sampled(flat, [SamplingParams(seed=7)], [g]).item() for _ in range(30)] for g in
                (torch.Generator(device=dev).manual_seed(7), torch.Generator(device=dev).manual_seed(7))]
        assert runs[0] == runs[1], "the same seed must give the same tokens: draw seeded rows with their own generator"
        assert len(set(runs[0])) > 5, "a generator must advance from draw to draw: 30 draws from 50 equal tokens cannot all agree"
    # Frequencies: 20,000 draws of a known distribution. By Hoeffding's inequality, a correct sampler's
    # frequency of a token misses its probability by 0.03 or more with chance at most
    # 2 exp(-2 * 20000 * 0.03**2) = 4.6e-16, so this check fails a correct sampler less than once in 10^15 runs.
    with cases("temperature 1, no truncation: frequencies"):
        N = 20000
        freq = torch.bincount(sampled(torch.tensor([0.5, 0.3, 0.2], device=dev).log().expand(N, 3), [SamplingParams()] * N),
                              minlength=3) / N
        assert (freq - torch.tensor([0.5, 0.3, 0.2], device=dev)).abs().max() < 0.03, \
            f"temperature 1, no truncation: frequencies {freq.tolist()} should be close to (0.5, 0.3, 0.2)"
### BEGIN HIDDEN TESTS
""" + HIDDEN_REFERENCE + r"""
# Frequencies against the float64 reference. Each check below fails a correct sampler with chance at
# most 2 exp(-2 N eps^2) = 2 exp(-18) = 3.1e-8 (Hoeffding, N = 10,000 draws, eps = 0.03); there are
# 6 tokens x 5 settings = 30 checks, so a false failure has chance below 30 x 3.1e-8 = 1e-6 by the
# union bound. Seeds are fixed, so the outcome is also the same on every run.
q = [0.35, 0.25, 0.15, 0.12, 0.08, 0.05]
z6 = torch.tensor(q, device=dev).log()
N, eps = 10000, 0.03
settings = [dict(temperature=0.5, top_p=0.7),                 # temperature before top-p; the crossing token
            dict(temperature=0.8, top_p=0.7, min_p=0.25),     # min-p before top-p (vLLM's order)
            dict(temperature=0.6, top_k=3, top_p=0.85, min_p=0.1),   # top-k before top-p
            dict(temperature=1.5, top_k=3)]
def _check(draws, s):
    ref = _ref_probs(z6.double().tolist(), t=s.get("temperature", 1.0), k=s.get("top_k", 0),
                     p=s.get("top_p", 1.0), m=s.get("min_p", 0.0))
    freq = torch.bincount(draws, minlength=6).double() / len(draws)
    for i in range(6):
        if i not in ref:
            assert freq[i] == 0, f"{s}: token {i} must be cut, but was drawn {int(freq[i] * len(draws))} times"
        else:
            assert abs(freq[i] - ref[i]) < eps, (f"{s}: token {i} drawn with frequency {freq[i]:.3f}, too "
                                                 f"{'high' if freq[i] > ref[i] else 'low'}: apply temperature, min-p, top-k, "
                                                 f"top-p in that order, then draw from the softmax of what survives")
_mixed = {}
def mixed_draws():
    '''One batch of 40,000 rows, the four settings side by side (drawn once, then reused by each case).'''
    if "draws" not in _mixed:
        torch.manual_seed(123)
        params = [SamplingParams(**s) for s in settings for _ in range(N)]
        _mixed["draws"] = sampled(z6.expand(len(params), 6).clone(), params).cpu()
    return _mixed["draws"]
with substituted(globals(), **course_processors):
    for j, s in enumerate(settings):
        with cases(f"{s}, in a batch of mixed settings: frequencies"):
            _check(mixed_draws()[j * N:(j + 1) * N], s)
    with cases("seeded rows, temperature=1.3, top_p=0.8: frequencies"):
        seeded = dict(temperature=1.3, top_p=0.8)
        gens = [torch.Generator(device=dev).manual_seed(1000 + i) for i in range(N)]
        _check(sampled(z6.expand(N, 6).clone(), [SamplingParams(**seeded)] * N, gens).cpu(), seeded)
    # greedy rows: argmax of the raw logits, whatever else is set, with or without a generator
    g = torch.Generator().manual_seed(5)                     # test data drawn on the CPU: the same numbers on every device
    z = torch.randn(4, 30, generator=g).to(dev) * 3
    with cases("temperature 0 with other settings and a generator"):
        ps = [SamplingParams(temperature=0.0, top_p=0.3), SamplingParams(temperature=0.0, top_k=2, seed=1),
              SamplingParams(temperature=0.0, min_p=0.9), SamplingParams(temperature=0.0)]
        got = sampled(z.clone(), ps, [None, torch.Generator(device=dev).manual_seed(1), None, None])
        assert got.tolist() == z.argmax(-1).tolist(), "temperature 0 rows must return the argmax of the raw logits"
    with cases("every setting at once: the logits are left alone"):
        given = z.clone()
        sampled(given, [SamplingParams(temperature=0.9, top_k=5, top_p=0.8, min_p=0.05)] * 4)
        assert torch.equal(given, z), "sample must not modify the logits"
    # one generator per row: same seed, same draws, whatever the neighbours or the position in the batch
    flat = torch.zeros(4, 40, device=dev)
    def _seq(rows_gens, row, calls=25):
        return [sampled(flat[:len(rows_gens)], [SamplingParams()] * len(rows_gens), rows_gens)[row].item() for _ in range(calls)]
    with cases("a seeded row alone and in a batch"):
        alone = _seq([torch.Generator(device=dev).manual_seed(11)], 0)
        torch.manual_seed(0)
        crowd = _seq([None, torch.Generator(device=dev).manual_seed(3), torch.Generator(device=dev).manual_seed(11), None], 2)
        assert alone == crowd, "a seeded row must draw the same tokens alone and in a batch: use only its own generator"
    with cases("two rows with equally seeded generators"):
        twins = [torch.Generator(device=dev).manual_seed(9), torch.Generator(device=dev).manual_seed(9)]
        pairs = [sampled(flat[:2], [SamplingParams()] * 2, twins).tolist() for _ in range(25)]
        assert all(a == b for a, b in pairs), \
            "two rows with equally seeded generators must draw equal tokens: each row draws with its own generator"
        assert len({a for a, _ in pairs}) > 5, "each generator must advance with every draw"
    with cases("rows without a generator"):
        torch.manual_seed(42)
        a = [sampled(flat, [SamplingParams()] * 4).tolist() for _ in range(5)]
        torch.manual_seed(42)
        b = [sampled(flat, [SamplingParams()] * 4).tolist() for _ in range(5)]
        assert a == b, "rows without a generator draw from torch's global generator"
    with cases("one SamplingParams and one generator per row"):
        sampled(flat, [SamplingParams()] * 4, [None] * 4)
        for bad in (dict(params=[SamplingParams()] * 3), dict(params=[SamplingParams()] * 4, generators=[None] * 2)):
            try:
                sample(flat, **bad)
            except ValueError:
                pass
            else:
                raise AssertionError("params and generators must have one entry per row: raise ValueError")
### END HIDDEN TESTS
cases.score()
"""),
md(r"""
Does the order of min-p and top-p matter on real text? For a few prompts, the survivors of
`top_p = 0.9, min_p = 0.05` at temperature 1, in vLLM's order (min-p first) and in HF's (top-p first):
"""),
code(r"""
for prompt in ("The capital of France is", "The weather today is", "My favourite food is", "I think that"):
    with torch.no_grad():
        ids = torch.tensor([tokenizer(prompt).input_ids], device=dev)
        z = model(ids, torch.arange(ids.shape[1], device=dev)[None])[:, -1].float()     # (1, V)
    p, m = torch.tensor([0.9], device=dev), torch.tensor([0.05], device=dev)
    vllm = torch.isfinite(apply_top_p(apply_min_p(z, m), p)).sum().item()
    hf = torch.isfinite(apply_min_p(apply_top_p(z, p), m)).sum().item()
    print(f"{prompt!r:40}: min-p then top-p keeps {vllm:3d} tokens, top-p then min-p keeps {hf:3d}")
"""),
md(r"""
When min-p removes a long tail, top-p then measures its 90% over the few survivors and may cut some
of them too, so the first order tends to keep fewer tokens. A server and a library given the same
settings can therefore sample from different sets. When you compare engines, compare their orders too.
"""),
*PENALTIES,
md(r"""
## 6. Seeded generation

The sampler takes generators; a request's `seed` has to become one. Each request gets its own
generator when it starts, and keeps it for all its tokens: its random draws then never depend on
the batch. (Its logits still can: in bf16 on a GPU the batch changes how they round, and engines
that promise the same text in any batch need batch-invariant kernels. In float32, as in the tests,
the text is the same.)

## Problem 7: Seeded, per-request generation (2 points)

**Deliverable:** `sampled_generate(model, prompts, params, max_new_tokens, eos_token_id=None)` returns
the new tokens of every prompt (a list of lists), generated in one batch with the given `generate`
loop, where row `b` is sampled with `params[b]`: a request with a `seed` gets its own
`torch.Generator` (on the model's device), seeded with that seed once, before the first token;
a request without a seed uses torch's global generator. (The tests run it on the course's sampler,
`course.engine.sampler.sample`, so that a mistake in Problem 5 costs only Problem 5's points.)
"""),
solution("sampled_generate", r'''
def sampled_generate(model, prompts: list[list[int]], params: list[SamplingParams], max_new_tokens: int,
                     eos_token_id: int | None = None) -> list[list[int]]:
    """Generate every prompt in one batch, each with its own sampling settings and generator."""
    if len(params) != len(prompts):
        raise ValueError(f"need one SamplingParams per prompt: {len(prompts)} prompts, {len(params)} params")
    ### BEGIN SOLUTION
    generators = [None if q.seed is None else torch.Generator(device=model.device).manual_seed(q.seed)
                  for q in params]                                       # once per request, not per step
    return generate(model, prompts, max_new_tokens, lambda logits: sample(logits, params, generators), eos_token_id)
    ### END SOLUTION
'''),
code(r"""
fox = tokenizer("The quick brown fox jumps over the").input_ids
for q in (SamplingParams(temperature=0.8, seed=1), SamplingParams(temperature=0.8, seed=1), SamplingParams(temperature=0.8, seed=2)):
    print(q.seed, repr(tokenizer.decode(sampled_generate(model, [fox], [q], 12, eos_token_id=EOS)[0])))   # stops at EOS
"""),
tests("sampled_generate_tests", 2, r"""
from course.engine.sampler import sample as course_sample
from course.expect import expect_ints, expect_type, substituted

def texts(m, prompts, params, n, eos=None):
    '''Your sampled_generate, its answer checked first: one list of int token ids per prompt.'''
    out = expect_type(sampled_generate(m, prompts, params, n, eos_token_id=eos), "sampled_generate(model, prompts, params, n)", list)
    assert len(out) == len(prompts), f"one list of new tokens per prompt: {len(prompts)} prompts, got {len(out)} lists"
    return [expect_ints(o, f"sampled_generate(...)[{i}]") for i, o in enumerate(out)]

# Graded on its own: here your sampled_generate runs on the course's sampler (Problem 5, released in
# course.engine.sampler), so a mistake in Problem 5 costs only Problem 5's points. The real model runs
# in float32 (model_fp32): a seed's tokens alone and in a batch must agree exactly.
with substituted(globals(), sample=course_sample):
    fox = tokenizer("The quick brown fox jumps over the").input_ids
    q = SamplingParams(temperature=1.0, seed=1234)
    one = texts(model_fp32, [fox], [q], 8)[0]
    assert len(one) == 8, f"expected 8 new tokens, got {len(one)}"
    assert texts(model_fp32, [fox], [q], 8)[0] == one, "the same seed must give the same text"
    other = tokenizer("Water boils at").input_ids
    batch = texts(model_fp32, [other, fox], [SamplingParams(temperature=1.3), q], 8)
    assert batch[1] == one, "a seeded request must give the same text when it shares the batch with another request"
    greedy = generate(model_fp32, [fox], 8, greedy_pick)[0]
    assert texts(model_fp32, [fox], [SamplingParams(temperature=0.0)], 8)[0] == greedy, "temperature 0 is greedy"
### BEGIN HIDDEN TESTS
torch.manual_seed(0)
cfg = course.ModelConfig(family="llama", vocab_size=64, n_layer=1, n_head=2, n_kv_head=1, d_model=16, d_ff=32, max_seq_len=64)
flat = course.Decoder(cfg).eval().to(dev)
with torch.no_grad():
    for prm in flat.parameters():
        prm.zero_()                                         # every logit 0: a uniform next token, at every step
ps = [[1, 2, 3], [4], [5, 6]]
seeded = [SamplingParams(seed=21), SamplingParams(seed=8), SamplingParams(seed=21)]
with substituted(globals(), sample=course_sample):
    out = texts(flat, ps, seeded, 30)
    assert [len(o) for o in out] == [30, 30, 30], f"30 new tokens per prompt, got {[len(o) for o in out]}"
    assert out[0] == out[2], "two requests with the same seed must give the same tokens, even in one batch"
    assert out[0] != out[1], "different seeds must give different tokens"
    assert len(set(out[0])) > 10, "the generator must be created once and keep advancing (30 uniform draws from 64 tokens)"
    alone = texts(flat, [[5, 6]], [SamplingParams(seed=21)], 30)[0]
    assert alone == out[2], "a seeded request's tokens must not depend on the batch"
    shuffled = texts(flat, [ps[2], [9, 9, 9, 9], ps[0]], [seeded[2], SamplingParams(), seeded[0]], 30)
    assert shuffled[0] == out[2] and shuffled[2] == out[0], "nor on its position in the batch"
    torch.manual_seed(5)
    u1 = texts(flat, ps, [SamplingParams()] * 3, 10)
    torch.manual_seed(5)
    assert texts(flat, ps, [SamplingParams()] * 3, 10) == u1, "requests without a seed use torch's global generator"
    eos_run = texts(flat, [[1]], [SamplingParams(seed=3)], 60, eos=out[1][4])[0]
    assert len(eos_run) <= 60 and (eos_run[-1] == out[1][4] or len(eos_run) == 60), "stop after EOS (kept)"
### END HIDDEN TESTS
"""),
md(r"""
## 7. Beam search

Greedy decoding commits to the best token at every step. The workshop names its second flaw: it
"misses high-probability words hidden behind low-probability words". A sequence whose first token
is only second best may be far more likely as a whole. **Beam search** keeps the `num_beams` best
partial sequences (the *beams*) instead of one, scores each by the sum of its tokens'
log-probabilities, and returns the best finished sequence it found.

Sums of log-probabilities favour short sequences, since every token adds a negative number. A
**length penalty** corrects that when finished sequences are compared: a finished sequence of
`L` new tokens (EOS included) with sum of log-probabilities `s` scores

$$\text{score} = \frac{s}{L^{\alpha}}, \qquad \alpha = \texttt{length\_penalty}.$$

$\alpha = 1$ compares the mean log-probability per token; $\alpha > 1$ favours longer sequences, and
$\alpha < 0$ shorter ones. (GNMT, Wu et al. 2016, proposed $((5 + L)/6)^\alpha$; HF uses $L^\alpha$.)

The exact rules decide which sequence comes out, and we want yours to equal Hugging Face
`generate(num_beams=K, length_penalty=alpha, do_sample=False)` token for token. Its algorithm, with
`K = num_beams`:

1. Start with one running beam: no new tokens, score 0.
2. Each step, every running beam proposes every next token: the beam's score plus the token's
   log-probability (`log_softmax` of that beam's logits). Take the best `2K` proposals over all beams,
   best first. (Twice `K`, so that enough remain when some end in EOS.)
3. Walk them in that order. A proposal whose token is EOS is **finished**, if it is among the first
   `K` proposals (otherwise it is dropped), and is scored with the length penalty. Any other
   proposal becomes a running beam of the next step, until there are `K` of them.
4. At the last step (`max_new_tokens` new tokens), the first `K` proposals are all finished, EOS or not.
5. Keep only the best `K` finished sequences. Stop early when `K` finished sequences exist and the
   best running beam, scored with the length penalty as if it ended now (`L` = tokens so far), is not
   better than the worst of them. (HF's default `early_stopping=False`; this check is a heuristic.)
6. Return the new tokens of the best finished sequence, EOS included if it ended with one.

The running beams live in the slots of a `SlotKVCache`, one per beam. When beam `i` of the next step
continues beam `j` of this step, slot `i` must hold the keys and values of beam `j`. The given
`reorder_beams` copies them, like HF's `cache.reorder_cache`. (vLLM does it without copying:
the beams share their common prefix's blocks, with copy-on-write, the fork of lab 05.)
"""),
locked("reorder_beams", r'''
def reorder_beams(cache: SlotKVCache, parents: list[int]) -> None:
    """Slot i becomes a copy of slot parents[i], for i < len(parents): each new beam gets its parent's K/V."""
    src = torch.as_tensor(parents, dtype=torch.long, device=cache.device)
    n = src.shape[0]
    cache.k[:, :n] = cache.k[:, src]
    cache.v[:, :n] = cache.v[:, src]
    cache.lengths[:n] = cache.lengths[src].clone()
    cache.valid[:n] = cache.valid[src].clone()
'''),
md(r"""
## Problem 8: Beam search with a length penalty (4 points)

**Deliverable:** `beam_search(model, prompt, num_beams, max_new_tokens, length_penalty=1.0,
eos_token_id=None)` runs the algorithm above on our model (with `forward_cached`, one cache slot per
beam, and `reorder_beams`) and returns the new tokens of the best finished sequence as a list of
ints. Its output equals HF `generate` with the same settings.
"""),
solution("beam_search", r'''
@torch.no_grad()
def beam_search(model, prompt: list[int], num_beams: int, max_new_tokens: int, length_penalty: float = 1.0,
                eos_token_id: int | None = None) -> list[int]:
    """The most likely continuation HF-style beam search finds, scored sum(log p) / length**length_penalty."""
    if num_beams < 1 or max_new_tokens < 1 or not prompt:
        raise ValueError("need a non-empty prompt, num_beams >= 1 and max_new_tokens >= 1")
    d, K, T = model.device, num_beams, len(prompt)
    cache = SlotKVCache(model.cfg, n_slots=K, max_len=T + max_new_tokens, dtype=model.dtype, device=d)
    ### BEGIN SOLUTION
    logits = forward_cached(model, torch.tensor([prompt], device=d), torch.arange(T, device=d)[None],
                            cache, torch.tensor([0], device=d))[:, -1]     # (1, V): the prompt, in slot 0
    beams = [(0.0, [])]                                                   # running: (sum of log p, tokens)
    finished = []                                                         # (penalized score, tokens)
    for step in range(max_new_tokens):
        scores = torch.tensor([s for s, _ in beams], device=d)[:, None] + torch.log_softmax(logits.float(), dim=-1)
        V = scores.shape[1]
        top = scores.flatten().topk(2 * K)                                # best 2K proposals, best first
        last = step + 1 == max_new_tokens
        running = []
        for rank, (s, flat) in enumerate(zip(top.values.tolist(), top.indices.tolist())):
            parent, tok = divmod(flat, V)
            if tok == eos_token_id or last:
                if rank < K:
                    finished.append((s / (step + 1) ** length_penalty, beams[parent][1] + [tok]))
            else:
                running.append((s, parent, tok))
            if len(running) == K:
                break
        finished = sorted(finished, key=lambda f: f[0], reverse=True)[:K]
        if last or (len(finished) == K and running[0][0] / (step + 1) ** length_penalty <= finished[-1][0]):
            break
        reorder_beams(cache, [parent for _, parent, _ in running])
        beams = [(s, beams[parent][1] + [tok]) for s, parent, tok in running]
        ids = torch.tensor([[tok] for _, _, tok in running], device=d)    # (K, 1)
        pos = torch.full((len(running), 1), T + step, device=d)           # (K, 1): all beams at one position
        logits = forward_cached(model, ids, pos, cache, torch.arange(len(running), device=d))[:, -1]   # (K, V)
    return finished[0][1]
    ### END SOLUTION
'''),
locked("hf_beam", r"""
hf_model = course.load_hf_model(device=env.device)

def hf_beam(prompt, num_beams, max_new_tokens, length_penalty=1.0):
    '''HF generate's beam search: the new tokens of the best sequence, EOS included if it has one.'''
    ids = torch.tensor([prompt], device=dev)
    out = hf_model.generate(ids, attention_mask=torch.ones_like(ids), num_beams=num_beams, do_sample=False,
                            max_new_tokens=max_new_tokens, length_penalty=length_penalty,
                            eos_token_id=EOS, pad_token_id=EOS)[0, len(prompt):].tolist()
    return out[:out.index(EOS) + 1] if EOS in out else out
"""),
code(r"""
beam_cases = env.pick([("The quick brown fox jumps over the", 4, 20, 1.0), ("My trip to Yosemite was", 3, 16, 2.0),
                       ("def fibonacci(n):", 5, 12, -1.0), ("The capital of France is", 2, 24, 0.5)],
                      [("def fibonacci(n):", 2, 8, -1.0)])
for text, K, n, lp in beam_cases:                     # both in float32: bf16 may round a near-tie another way
    p = tokenizer(text).input_ids
    ours, theirs = beam_search(model_fp32, p, K, n, lp, eos_token_id=EOS), hf_beam(p, K, n, lp)
    print(f"num_beams={K}, length_penalty={lp:4}: equal to HF: {ours == theirs}  {tokenizer.decode(ours)!r}")
"""),
tests("beam_search_tests", 4, r"""
from course.expect import expect_ints

def beams(m, prompt, *args, **kwargs):
    '''Your beam_search, its answer checked first: a list of int token ids.'''
    return expect_ints(beam_search(m, prompt, *args, **kwargs), "beam_search(...)")

# In float32 (model_fp32), like the Hugging Face model: token for token, a near-tie must round the same way.
p = tokenizer("The quick brown fox jumps over the").input_ids
ours = beams(model_fp32, p, num_beams=3, max_new_tokens=10, length_penalty=1.0, eos_token_id=EOS)
assert ours == hf_beam(p, 3, 10, 1.0), f"differs from HF generate: {tokenizer.decode(ours)!r} vs {tokenizer.decode(hf_beam(p, 3, 10, 1.0))!r}"
assert beams(model_fp32, p, num_beams=1, max_new_tokens=6, eos_token_id=EOS) == generate(model_fp32, [p], 6, greedy_pick)[0], \
    "one beam is greedy decoding"
### BEGIN HIDDEN TESTS
""" + HIDDEN_TINY + r"""
n_eos, runs = 0, []
for seed in range(4):
    hf_tiny, ours_tiny = _tiny_pair(seed)
    g = torch.Generator().manual_seed(seed)
    for trial in range(3):
        prompt = torch.randint(0, 48, (torch.randint(1, 6, (1,), generator=g).item(),), generator=g).tolist()
        with torch.no_grad():
            path = hf_tiny.generate(torch.tensor([prompt], device=dev), do_sample=False, max_new_tokens=8,
                                    pad_token_id=0)[0, len(prompt):].tolist()
        eos = path[torch.randint(0, 8, (1,), generator=g).item()]          # a token the model does emit
        runs.append((seed, hf_tiny, ours_tiny, prompt, eos))
def _hf_beams(hf_tiny, prompt, K, lp, eos):
    with torch.no_grad():
        out = hf_tiny.generate(torch.tensor([prompt], device=dev), num_beams=K, length_penalty=lp, do_sample=False,
                               max_new_tokens=10, eos_token_id=eos, pad_token_id=eos)[0, len(prompt):].tolist()
    return out[:out.index(eos) + 1] if eos in out else out
# First without a length penalty (length_penalty=0: a finished sequence scores its sum of log-probabilities),
# which tests the search itself; then with one: a failure there, after these passed, points at the penalty.
for seed, hf_tiny, ours_tiny, prompt, eos in runs:
    for K in (2, 3, 4):
        want = _hf_beams(hf_tiny, prompt, K, 0.0, eos)
        n_eos += eos in want
        got = beams(ours_tiny, prompt, K, 10, 0.0, eos_token_id=eos)
        assert got == want, (f"tiny model {seed}, prompt {prompt}, num_beams={K}, length_penalty=0, eos={eos}: your tokens {got} "
                             f"differ from HF generate's beam search. Check the search: the best 2K proposals over all beams, "
                             f"best first; an EOS proposal finishes only if it is among the first K; at the last step the first K "
                             f"proposals all finish; keep the best K finished; the early stop")
for seed, hf_tiny, ours_tiny, prompt, eos in runs:
    for K, lp in ((2, 1.0), (3, 2.0), (4, -0.5)):
        want = _hf_beams(hf_tiny, prompt, K, lp, eos)
        n_eos += eos in want
        got = beams(ours_tiny, prompt, K, 10, lp, eos_token_id=eos)
        assert got == want, (f"tiny model {seed}, prompt {prompt}, num_beams={K}, length_penalty={lp}, eos={eos}: your tokens {got} "
                             f"differ from HF generate's beam search, though every case without a length penalty agreed: check "
                             f"the length penalty. A finished sequence scores s / L**length_penalty with L its new tokens, EOS "
                             f"included (the prompt does not count); the early stop scores the best running beam the same way, "
                             f"L = its new tokens so far")
assert n_eos > 10, "self-check: the cases must include sequences that end with EOS"
p = tokenizer("My trip to Yosemite was").input_ids
assert beams(model_fp32, p, 2, 8, 2.0, eos_token_id=EOS) == hf_beam(p, 2, 8, 2.0), "real model, length_penalty=2"
### END HIDDEN TESTS
"""),
md(r"""
## 8. Measure: repetition and diversity

Now the four ways to choose a token, on the same prompts, with the same number of new tokens:
greedy, beam search (4 beams), nucleus sampling (temperature 0.7, top-p 0.9) and pure sampling
(temperature 1, no truncation). Sampling runs several times per prompt (seeded, so you can rerun it).
For every text: repetition and distinct-2 within it. For each prompt: distinct-2 pooled over its
texts (how much the texts differ from each other; greedy and beam give the same text every time),
and the model's mean log-probability of the tokens it produced (how likely it finds its own text).
"""),
code(r"""
import numpy as np
import matplotlib.pyplot as plt

measure_texts = ["Once upon a time there was a little girl who", "I like to eat", "My trip to Yosemite was",
                 "The best way to learn a language is"]
n_prompts, new_tokens, n_samples = env.pick((4, 64, 8), (1, 12, 2), cpu=(4, 48, 4))
measure_prompts = [tokenizer(t).input_ids for t in measure_texts[:n_prompts]]

@torch.no_grad()
def mean_logprob(prompt, new):
    '''The model's mean log-probability of the new tokens, given the prompt (temperature 1).'''
    ids = torch.tensor([prompt + new], device=dev)
    logp = torch.log_softmax(model(ids, torch.arange(ids.shape[1], device=dev)[None])[0].float(), -1)
    return logp[len(prompt) - 1:-1].gather(1, torch.tensor(new, device=dev)[:, None]).mean().item()

strategies = {
    "greedy": lambda ps: [[o] for o in generate(model, ps, new_tokens, greedy_pick)],
    "beam (4)": lambda ps: [[beam_search(model, p, 4, new_tokens, 1.0)] for p in ps],
    "T=0.7, top-p 0.9": lambda ps: sampled(ps, SamplingParams(temperature=0.7, top_p=0.9)),
    "T=1.0, pure": lambda ps: sampled(ps, SamplingParams(temperature=1.0)),
}
def sampled(ps, q):
    '''n_samples seeded texts per prompt, all in one batch.'''
    rows = [p for p in ps for _ in range(n_samples)]
    qs = [SamplingParams(q.temperature, q.top_k, q.top_p, q.min_p, seed=i) for i in range(len(rows))]
    outs = sampled_generate(model, rows, qs, new_tokens)
    return [outs[i * n_samples:(i + 1) * n_samples] for i in range(len(ps))]

results = {}
for name, run in strategies.items():
    texts = run(measure_prompts)                              # texts[prompt] = list of token lists
    flat = [t for per_prompt in texts for t in per_prompt]
    results[name] = dict(
        repetition=np.mean([repetition(t) for t in flat]), distinct2=np.mean([distinct_n([t], 2) for t in flat]),
        pooled2=np.mean([distinct_n(per_prompt, 2) for per_prompt in texts]),
        logprob=np.mean([mean_logprob(p, t) for p, per_prompt in zip(measure_prompts, texts) for t in per_prompt]),
        example=tokenizer.decode(texts[0][0]))
print(f"{len(measure_prompts)} prompts, {new_tokens} new tokens, {n_samples} samples per prompt when sampling\n")
print(f"{'':18} {'repetition':>10} {'distinct-2':>10} {'distinct-2 across':>18} {'mean log p':>10}")
for name, r in results.items():
    print(f"{name:18} {r['repetition']:10.2f} {r['distinct2']:10.2f} {r['pooled2']:18.2f} {r['logprob']:10.2f}")
print()
for name, r in results.items():
    print(f"{name:>18}: {measure_texts[0]}{r['example']!r}"[:220])

fig, axes = plt.subplots(1, 3, figsize=(12, 3.2))
for ax, key, title in zip(axes, ("repetition", "distinct2", "logprob"),
                          ("repeated 3-grams (lower: less looping)", "distinct-2 within a text", "mean log-prob per token")):
    ax.bar(range(len(results)), [r[key] for r in results.values()], color=["C3", "C1", "C0", "C2"])
    ax.set_xticks(range(len(results)), list(results), rotation=20, fontsize=8)
    ax.set_title(title, fontsize=10); ax.grid(alpha=0.3, axis="y")
plt.tight_layout(); plt.show()
"""),
md(r"""
Read the table row by row. Which strategy repeats itself most? Beam search looks for the *most
likely* text: compare its mean log-probability with greedy's. Keeping 4 candidates does not
guarantee a likelier text than greedy's (a loop, once entered, is very likely, token after token),
and the workshop warns that beam search "can still get stuck in a loop"; it is rarely used for
open-ended chat. Sampling trades likelihood for variety: the "across" column says how much its texts
differ from each other, while greedy and beam give one text per prompt. Pure sampling reaches
further into tokens the model itself finds unlikely; truncation with top-p is the compromise most
APIs default to.

### The temperature experiment

The workshop's experiment: the same prompt at temperatures 0.7, 1.5 and 0.00001. Thanks to
per-request parameters, all of it runs as **one batch**: each row has its own temperature and seed,
and stops at the end-of-text token if it draws one (what follows it would be a new document).
"""),
code(r"""
fox = tokenizer("The quick brown fox jumps over the").input_ids
temps = [0.7, 1.5, 0.00001]
reps, fox_new = env.pick((3, 20), (1, 10))          # samples per temperature, new tokens each
qs = [SamplingParams(temperature=t, seed=s) for t in temps for s in range(reps)]
outs = sampled_generate(model_fp32, [fox] * len(qs), qs, fox_new, eos_token_id=EOS)   # float32, as the tests
for q, out in zip(qs, outs):
    print(f"T={q.temperature:<7g} seed {q.seed}: {tokenizer.decode(out)!r}")
greedy_fox = generate(model_fp32, [fox], fox_new, greedy_pick, EOS)[0]          # stops at EOS too
print("\nT=0.00001 equals greedy:", all(out == greedy_fox for q, out in zip(qs, outs) if q.temperature < 1e-3))
"""),
md(r"""
A temperature of 0.00001 multiplies every logit by 100,000: the gap between the top two tokens becomes
so large that the top one gets all of the probability, and sampling turns into greedy decoding. (This
cell runs in float32, like the tests: in bf16 a batch of 9 and a batch of 1 round differently, and a
near-tie can part them.) At 1.5 the tail gains, and the text drifts. Sweep the temperature and measure both sides of the trade:
"""),
code(r"""
sweep = env.pick([0.25, 0.5, 0.75, 1.0, 1.25, 1.5, 2.0], [0.5, 1.5], cpu=[0.25, 0.5, 0.75, 1.0, 1.5, 2.0])
per_t = env.pick(8, 2, cpu=4)
qs = [SamplingParams(temperature=t, seed=s) for t in sweep for s in range(per_t)]
outs = sampled_generate(model, [fox] * len(qs), qs, fox_new, eos_token_id=EOS)   # one batch, every temperature
pooled, logps = [], []
for i, t in enumerate(sweep):
    texts = outs[i * per_t:(i + 1) * per_t]
    pooled.append(distinct_n(texts, 2))
    logps.append(np.mean([mean_logprob(fox, o) for o in texts]))
    print(f"T={t:4}: distinct-2 across {per_t} samples {pooled[-1]:.2f}, mean log-prob per token {logps[-1]:6.2f}")
fig, ax1 = plt.subplots(figsize=(6, 3.2))
ax1.plot(sweep, pooled, "o-", color="C0"); ax1.set_ylabel("distinct-2 across samples", color="C0")
ax2 = ax1.twinx(); ax2.plot(sweep, logps, "s-", color="C3"); ax2.set_ylabel("mean log-prob per token", color="C3")
ax1.set_xlabel("temperature"); ax1.grid(alpha=0.3); ax1.set_title("Temperature: diversity against likelihood")
plt.tight_layout(); plt.show()
"""),
md(r"""
Diversity climbs with the temperature and the model's own confidence in the text falls: there is
no free setting, only a choice of where to sit on this curve.

## Summary

- The sampler turns the last logits of every row into one token per row, and it is where a
  request's sampling settings take effect.
- **Temperature** divides the logits: below 1 it sharpens, above 1 it flattens; 0 means greedy.
- **Truncation** removes tokens before the draw: **top-k** keeps the `k` best logits (ties included),
  **top-p** the smallest top set reaching mass `p` (the crossing token included), **min-p** every token
  at least `min_p` times as likely as the top one. Survivors are renormalized.
- The **order** matters: temperature first, then truncation (vLLM: min-p, top-k, top-p; HF: top-k, top-p, min-p).
- **Penalties** push down tokens the text already holds: repetition divides (or, for a negative logit,
  multiplies) every token of the prompt and output, frequency subtracts per occurrence in the output,
  presence once. With the logit bias they come first, before the greedy argmax and the temperature,
  so they change greedy text too.
- A batch holds **per-request settings** and **one generator per seeded request**, so a seed's draws
  never depend on the batch.
- **Beam search** keeps `K` beams, ranks finished sequences by `sum log p / L^alpha`, and often, not
  always, finds likelier text than greedy (a greedy loop can be very likely: compare your table); likely text is not the same as good, varied text.

**Questions** (from the workshop's decoding strategies, and a few more). Answer in the cell under
each group, in a few sentences of your own and with **your** numbers where a question asks for them;
a person grades them (4 points in all).
1. Why does greedy decoding start repeating itself? Use your repetition numbers for its two halves.
2. "Greedy misses high-probability words hidden behind low-probability words." Compare the mean
   log-probability of your greedy and beam texts. When can beam search beat greedy on likelihood?
"""),
answer("greedy_beam_answer", 1, "questions 1 and 2", model=r"""
1. Greedy is deterministic: the same context always gives the same token. Once a phrase has been
   written, the model (which learned to continue a text consistently, copying from its context) rates
   writing it again as the most likely continuation, greedy takes it, and every repeat makes the next
   one likelier still: a loop it cannot leave. (Example, CPU, float32: "I like to eat a burger with a
   side of fries. I'm not sure what to do with it. I'm not sure what to do with it. ..."; 3-gram
   repetition 0.40 in the first half, 0.67 in the second.)
2. Beam search ranks finished sequences by `sum log p / L^alpha`, so its text's mean log-probability
   is usually at least greedy's, but not always: a greedy loop is very likely token after token, and
   the length penalty compares sequences of different lengths (the student compares their two numbers
   from the table and says which was higher). Beam search beats greedy when a token that is not the
   top choice at some step leads to a continuation so much likelier that the whole sequence wins
   (the "hidden" high-probability words), and that path stays among the `K` best partial sequences
   at every step until it pays off. When greedy's path is itself the best, or the better path falls
   out of the beam early, beam search finds nothing better.
""", rubric=r"""
- 0.5: question 1: determinism plus self-reinforcement (a repeat makes itself likelier), with the
  student's two halves quoted (the second repeating more, or an honest remark if it did not).
- 0.5: question 2: the two mean log-probabilities compared; beam wins when a lower-ranked early token
  leads to a likelier whole sequence that survives in the beam (not guaranteed: loops are likely, the
  beam is finite, the length penalty).
"""),
md(r"""
3. Top-k: how would you decide `k`? Use the survivor counts of top-p 0.9 on the three prompts to say
   why top-p adapts and top-k does not.
4. Why must temperature come before top-p? What would a temperature slider do to the survivors if
   top-p read the temperature-1 distribution?
"""),
answer("truncation_answer", 1, "questions 3 and 4", model=r"""
3. `k` is chosen empirically: generate with a few values on prompts like the service's and trade
   quality (no junk tokens) against variety (distinct-n, human judgement); 40-50 are common defaults.
   But one `k` fits no context. (Example, CPU, float32:) top-p 0.9 keeps 10 tokens after "The capital
   of France is" (the top token alone has 0.77), 403 after "The weather today is" and 359 after "I like
   to eat", while top-k 50 keeps 50 in all three: too many where the model is sure (it lets 40 junk
   tokens in), too few where it is not (it cuts hundreds of reasonable ones). Top-p is defined on
   the probability mass, so a peaked distribution reaches 90% in a few tokens and a flat one needs
   many: it adapts to the model's confidence; top-k only counts ranks.
4. Top-p reads probabilities, and a user who lowers the temperature expects a narrower choice: with
   temperature first, a low temperature concentrates the mass and fewer tokens reach `p`, a high one
   spreads it and more survive. If top-p read the temperature-1 distribution, the survivors would not
   depend on the temperature at all: the slider would only reweight the same fixed set (at a high
   temperature, flattening it over the same survivors; never admitting or cutting a token).
""", rubric=r"""
- 0.5: question 3: k set by experiment (quality against diversity), and why one k fails, argued with
  the student's three survivor counts (few where the model is sure, hundreds where it is not).
- 0.5: question 4: temperature changes the probabilities that top-p thresholds; applied after top-p,
  the survivor set would be fixed whatever the temperature.
"""),
md(r"""
5. Top-p with (0.5, 0.3, 0.2) and `p = 0.6`: which tokens survive, and why is the crossing token kept?
6. Why does each seeded request need its own generator? What goes wrong under continuous batching
   (lab 04) if a whole batch draws from one?
"""),
answer("top_p_seeds_answer", 1, "questions 5 and 6", model=r"""
5. The first two, 0.5 and 0.3 (renormalized to 0.625 and 0.375): the mass ranked above 0.5 is 0 and
   above 0.3 is 0.5, both below 0.6; above 0.2 it is 0.8, so 0.2 is cut. The crossing token (0.3) is
   kept because top-p is the *smallest set whose mass reaches at least p*: without it the survivors
   hold 0.5, less than the 0.6 asked for. (The same rule always keeps the top token.)
6. A seed promises the same draws every time the request is sent. A generator of its own, seeded once
   and advanced only by its own draws, makes its k-th token depend only on its seed and its own
   logits. With one generator for the whole batch, row `b` gets whatever number comes after the draws
   of the rows before it and of every earlier step; under continuous batching the batch changes at
   every step (requests arrive, finish, are preempted), so the same seed gives a different text
   depending on the traffic, and neighbours' randomness is coupled: seeds cannot be honoured.
""", rubric=r"""
- 0.5: question 5: 0.5 and 0.3 survive, 0.2 is cut; the crossing token is kept so the kept mass reaches
  at least p (the smallest such set).
- 0.5: question 6: reproducibility per request independent of the batch; with one shared generator
  the draws depend on batch membership and order, which change every step under continuous batching.
"""),
md(r"""
7. Temperature 0.00001 gave the greedy text. Why does vLLM treat temperature 0 as a separate,
   greedy path instead of dividing by a tiny number?
8. How would you run beam search inside a server that batches many requests? What does each beam
   cost in KV-cache memory, and how do shared prefix blocks (lab 05) reduce that cost?
"""),
answer("greedy_path_beams_answer", 1, "questions 7 and 8", model=r"""
7. Dividing by 0 itself gives `inf - inf = NaN`, and dividing by a tiny number is fragile: logits times
   100,000 overflow fp16 (max 65,504); tokens whose logits tie (common after bf16 rounding) are then
   picked by a random draw instead of deterministically; and the row still pays for a softmax, a sort
   for top-p and a random draw, and advances its generator, for a result known in advance. A
   separate greedy path (an argmax of the raw logits) is exact, deterministic, cheaper and safe;
   vLLM takes the greedy rows' argmax first and samples only the others.
8. Each request's `K` beams become `K` rows of the batch: one forward pass gives logits for every beam
   of every request, then each request selects its own best `2K` proposals, keeps `K` running beams
   and its finished list, and stops on its own rule; it occupies `K` slots of the batch. Each beam
   holds a full KV cache, so a request costs `K` times the memory of one sequence (SmolLM2 in bf16:
   `K x (prompt + new tokens) x 23,040` bytes), and reordering beams copies caches (HF's
   `reorder_cache`). With shared blocks the beams fork from each other: the prompt's blocks and every
   common prefix are stored once (reference counts), reordering copies only block tables, and a
   partly full last block is copied on write: the cost is the prompt once plus each beam's own tail
   since it diverged.
""", rubric=r"""
- 0.5: question 7: numerical danger (division by 0 is NaN; overflow or lost gaps in 16-bit), random
  tie-breaking, and wasted work (softmax, sort, draw); a greedy argmax path is exact and cheap.
- 0.5: question 8: beams as batch rows with per-request selection; K full caches per request without
  sharing; with ref-counted blocks, shared prefix stored once, fork = copy the block table, COW on the
  last block.
"""),
md(r"""

## Going further

- **vLLM**'s V1 sampler (`vllm/v1/sample/`) takes the greedy rows' argmax first, then applies
  temperature, min-p, top-k and top-p on tensors that hold every request's settings. For the draw it
  divides the probabilities by exponential noise and takes the argmax (the exponential race, same
  distribution as `multinomial`), with per-request generators for seeded requests. Before all of it
  come the logit bias and the penalties of section 5; its newer GPU runner keeps each request's token
  counts (prompt and output, `V` counts each) in GPU tensors, and one Triton kernel applies all three
  penalties to the batch. It also returns logprobs.
- **FlashInfer**'s sampling kernels find top-k and top-p survivors by rejection sampling, without
  sorting the vocabulary, a large saving for vocabularies of 100k+ tokens.
- **Structured output** (xgrammar, Outlines, llguidance) is a logits processor too: a grammar masks
  every token that would break the JSON schema before the draw.
- **Beam search** in engines: vLLM runs it as a loop over its engine (`LLM.beam_search`), sharing
  prefix blocks between beams; HF `generate` implements the algorithm you matched, with
  `early_stopping` variants and diverse and constrained beam search.
- Papers: Holtzman et al., *The Curious Case of Neural Text Degeneration* (top-p, repetition of
  likely text); Fan et al., *Hierarchical Neural Story Generation* (top-k); Nguyen et al., *Turning
  Up the Heat: Min-p Sampling for Creative and Coherent LLM Outputs*; Li et al., *A
  Diversity-Promoting Objective Function for Neural Conversation Models* (distinct-n); Wu et al.,
  *Google's Neural Machine Translation System* (the length penalty). Speculative decoding (lab 08)
  adds one more sampler: it must draw from exactly the target model's distribution.
"""),
]

write_notebook("labs/07_sampling/07_sampling.ipynb", cells + [md(CHECK_YOUR_WORK)])
print("wrote labs/07_sampling/07_sampling.ipynb")
