"""Builds the lab 01 source notebook. Edit this file, then run from the repo root:

    .venv/bin/python -m autograder.lab_builders.lab01
"""
from autograder.authoring import answer, code, locked, md, solution, tests, write_notebook  # noqa: E402
from autograder.lab_builders.common_cells import CHECK_YOUR_WORK, COLAB_INSTALL, SETUP  # noqa: E402

cells = [
md(r"""
# Lab 01: Inference, one token at a time

A language model does not write a sentence. It computes, for the text so far, a score for every
token in its vocabulary, and that is all. Picking a token, appending it and asking again is the job
of the **inference loop** around the model, and making that loop fast for many users at once is
the job of an **inference engine** (vLLM, SGLang, TGI). Every later lab speeds up or reorganizes
the loop you write today, so it pays to know exactly what it does.

**You will**
- tell a *forward pass* (one call of the model: scores for every position) from *generation* (a loop of forward passes);
- turn scores (logits) into probabilities, with a temperature, and read the model's top choices;
- write a greedy generation loop on a transformer built from scratch: position ids, appending, stopping;
- prove your loop equals Hugging Face's `generate`, token for token, and measure what it costs.

**Time:** about 1 hour 15 minutes: 20 minutes of reading, three problems (10, 10 and 20 minutes),
15 minutes for the written questions at the end, and about 2 minutes of running on a laptop CPU (2.1
minutes measured on 2 cores). **Hardware:** everything runs on a laptop CPU; a GPU is used when there is one.

The model is **SmolLM2-135M-Instruct**: 135 million parameters, 30 layers, the Llama architecture,
small enough for a laptop and good enough to write real sentences. It ships with the course, so
no download is needed.
"""),
locked("colab_install", COLAB_INSTALL),
locked("setup", SETUP),
md(r"""
## 1. The model and its tokenizer

Two objects do all the work. The **tokenizer** turns text into integers (token ids) and back. The
**model** maps token ids to scores. `course.load_model()` gives you a decoder written from scratch
in `course/models/decoder.py` (about 150 readable lines: open it in another tab). `course.load_hf_model()`
gives you the same weights inside Hugging Face `transformers`, the reference we check against.
"""),
code(r"""
import torch

tokenizer = course.load_tokenizer()
# float32 in this lab, even on a GPU: you will check your loop against transformers token for token,
# and in bf16 two correct programs can round a near-tie differently (later labs use bf16 on a GPU).
model = course.load_model(device=env.device)        # our from-scratch decoder
hf_model = course.load_hf_model(device=env.device)  # the same weights in transformers

cfg = model.cfg
print(f"{model.num_parameters() / 1e6:.1f} M parameters, {cfg.n_layer} layers, d_model {cfg.d_model}, "
      f"{cfg.n_head} query heads sharing {cfg.n_kv_head} key/value heads, vocabulary of {cfg.vocab_size:,} tokens")
"""),
md(r"""
Text becomes a list of token ids. A token is often a whole word with its leading space, sometimes a
piece of one. The model never sees letters, only these integers.
"""),
code(r"""
prompt = "A trained language model can"
input_ids = tokenizer(prompt, return_tensors="pt").input_ids.to(env.device)   # (1, T): a batch of one sequence
print(input_ids)
print([tokenizer.decode([i]) for i in input_ids[0].tolist()])
"""),
md(r"""
## 2. One forward pass

The model takes the token ids and their **position ids** (0, 1, 2, ...: where each token sits) and
returns **logits**: for every input position, one score per vocabulary entry. Row `t` scores the
candidates for the token that *follows* token `t`. So a single forward pass predicts the next token
for every prefix of the input at once, which is how models are trained. For generation, only the
last row matters.
"""),
code(r"""
T = input_ids.shape[1]
position_ids = torch.arange(T, device=env.device)[None]   # (1, T): 0, 1, ..., T-1
with torch.no_grad():
    logits = model(input_ids, position_ids)               # (1, T, V)
print("logits:", tuple(logits.shape), "= (batch, positions, vocabulary)")

last_logits = logits[0, -1]                               # (V,): scores for the token after the prompt
best = last_logits.argmax().item()
print(f"highest score: token {best} = {tokenizer.decode([best])!r} (logit {last_logits[best]:.2f})")
"""),
md(r"""
## Problem 1: From logits to probabilities (2 points)

Logits are unnormalized: any real number. The **softmax** turns them into probabilities that are
positive and sum to 1:

$$p_i = \frac{e^{z_i / \tau}}{\sum_j e^{z_j / \tau}}$$

The **temperature** $\tau$ divides the logits first. $\tau < 1$ stretches the gaps between scores, so
the top token takes more of the probability; $\tau > 1$ squeezes them, flattening the distribution.
$\tau \to 0$ becomes "always pick the top token" (greedy), so $\tau = 0$ itself is not a valid input.

One trap: $e^{z}$ overflows float32 for $z > 88$. Subtracting the largest logit first changes
nothing mathematically (the factor $e^{-\max}$ cancels) and keeps every exponent $\le 0$.

**Deliverable:** `next_token_probs(logits, temperature)` returns softmax(logits / temperature) over
the last dimension, for any leading shape, computed stably by hand (`exp`, `sum`; no `torch.softmax`).
Raise `ValueError` for a temperature that is not positive.
"""),
solution("next_token_probs", r"""
def next_token_probs(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    # logits: (..., V) -> probabilities (..., V) that sum to 1 over the last dimension
    ### BEGIN SOLUTION
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0 (use argmax for greedy), got {temperature}")
    z = logits.float() / temperature
    z = z - z.max(dim=-1, keepdim=True).values       # stability: every exponent <= 0
    e = torch.exp(z)
    return e / e.sum(dim=-1, keepdim=True)
    ### END SOLUTION
"""),
tests("next_token_probs_tests", 2, r"""
from course.expect import expect_tensor
p = expect_tensor(next_token_probs(last_logits), "next_token_probs(last_logits)", dtype=torch.float32,
                  shape=tuple(last_logits.shape), device=last_logits.device)
assert abs(p.sum().item() - 1) < 1e-4, f"probabilities must sum to 1, got {p.sum().item()}"
assert p.argmax() == last_logits.argmax(), "the most likely token must be the one with the highest logit"
big = expect_tensor(next_token_probs(torch.tensor([1000.0, 1001.0], device=env.device)), "next_token_probs([1000, 1001])",
                    dtype=torch.float32, shape=(2,))
assert torch.allclose(big, torch.tensor([0.2689, 0.7311], device=env.device), atol=1e-4), \
    "large logits overflow exp(): subtract the maximum first"
### BEGIN HIDDEN TESTS
g = torch.Generator().manual_seed(0)
z = torch.randn(3, 5, 11, generator=g).to(env.device) * 4
for tau in (0.3, 1.0, 2.5):
    ref = torch.exp(z / tau - (z / tau).max(-1, keepdim=True).values)
    ref = ref / ref.sum(-1, keepdim=True)
    got = expect_tensor(next_token_probs(z, tau), f"next_token_probs(z, {tau})", dtype=torch.float32, shape=tuple(z.shape),
                        device=z.device)
    assert torch.allclose(got, ref, atol=1e-5), f"wrong probabilities at temperature {tau} (softmax over the last dim?)"
cold = expect_tensor(next_token_probs(z[0, 0], 0.2), "next_token_probs(row, 0.2)", shape=(11,))
hot = expect_tensor(next_token_probs(z[0, 0], 5.0), "next_token_probs(row, 5.0)", shape=(11,))
assert cold.max() > hot.max(), "a low temperature must sharpen the distribution"
for bad in (0, -1.0):
    try:
        next_token_probs(z, bad)
    except ValueError:
        pass
    else:
        raise AssertionError(f"temperature={bad} must raise ValueError")
huge = expect_tensor(next_token_probs(torch.tensor([[3e4, -3e4, 0.0]], device=env.device)), "next_token_probs(huge)", shape=(1, 3))
assert not torch.isnan(huge).any(), "logits of +-3e4 give NaN: subtract the maximum before exp()"
### END HIDDEN TESTS
"""),
md(r"""
## Problem 2: The next-token table (3 points)

Now the view the workshop this course grew from shows: the few most likely next words and their probabilities. This table is
what sampling strategies (lab 07) choose from.

**Deliverable:** `top_k_table(logits, tokenizer, k, temperature)` takes one row of logits `(V,)` and
returns the `k` most likely tokens as `(text, probability)` pairs, most likely first, where the
probabilities come from `next_token_probs` over the **whole** vocabulary (so the `k` of them sum to
less than 1) and `text` is `tokenizer.decode([token_id])`. Raise `ValueError` unless `logits` is 1-D
and `1 <= k <= V`.
"""),
solution("top_k_table", r"""
def top_k_table(logits: torch.Tensor, tokenizer, k: int = 10, temperature: float = 1.0) -> list[tuple[str, float]]:
    ### BEGIN SOLUTION
    if logits.dim() != 1:
        raise ValueError(f"logits must be one row of shape (V,), got shape {tuple(logits.shape)}")
    if not 1 <= k <= logits.shape[0]:
        raise ValueError(f"k must be between 1 and the vocabulary size {logits.shape[0]}, got {k}")
    probs = next_token_probs(logits, temperature)
    top = torch.topk(probs, k)
    return [(tokenizer.decode([i]), p) for p, i in zip(top.values.tolist(), top.indices.tolist())]
    ### END SOLUTION
"""),
code(r"""
for text, p in top_k_table(last_logits, tokenizer, k=8):
    print(f"{text!r:>14}  {p:.3f}  " + "#" * round(p * 100))
"""),
tests("top_k_table_tests", 3, r"""
from course.expect import expect_float, expect_tuple, expect_type, substituted

def course_probs(logits, temperature=1.0):   # Problem 1, as torch computes it: this cell grades Problem 2 alone
    return torch.softmax(logits.float() / temperature, dim=-1)

def rows(table, what):
    pairs = [expect_tuple(r, f"{what}[{i}]", 2) for i, r in enumerate(expect_type(table, what, list))]
    return [(expect_type(t, f"{what}[{i}][0]", str), expect_float(p, f"{what}[{i}][1]")) for i, (t, p) in enumerate(pairs)]

with substituted(globals(), next_token_probs=course_probs):
    table = rows(top_k_table(last_logits, tokenizer, k=5), "top_k_table(last_logits, tokenizer, k=5)")
    assert len(table) == 5, f"expected 5 rows, got {len(table)}"
    probs = [p for _, p in table]
    assert probs == sorted(probs, reverse=True), "most likely first"
    assert sum(probs) < 1, "probabilities come from the whole vocabulary, so the top 5 sum to less than 1"
    assert table[0][0] == tokenizer.decode([last_logits.argmax().item()]), "the first row is the argmax token"
### BEGIN HIDDEN TESTS
    V = last_logits.shape[0]
    for k, tau in ((1, 1.0), (10, 0.5), (25, 2.0)):
        z = last_logits.float() / tau
        ref_p = torch.exp(z - z.max()) / torch.exp(z - z.max()).sum()
        vals, idx = torch.sort(ref_p, descending=True)
        got = rows(top_k_table(last_logits, tokenizer, k=k, temperature=tau), f"top_k_table(k={k}, temperature={tau})")
        assert len(got) == k, f"k={k}: expected {k} rows, got {len(got)}"
        assert [t for t, _ in got] == [tokenizer.decode([i]) for i in idx[:k].tolist()], f"wrong tokens for k={k}, temperature={tau}"
        assert all(abs(p - r) < 1e-5 for (_, p), r in zip(got, vals[:k].tolist())), \
            f"wrong probabilities for k={k}, temperature={tau} (pass the temperature on to next_token_probs)"
    for bad_k in (0, V + 1):
        try:
            top_k_table(last_logits, tokenizer, k=bad_k)
        except ValueError:
            pass
        else:
            raise AssertionError(f"k={bad_k} must raise ValueError")
    try:
        top_k_table(logits[0], tokenizer, k=3)
    except ValueError:
        pass
    else:
        raise AssertionError("2-D logits must raise ValueError")
### END HIDDEN TESTS
"""),
md(r"""
### See it: the next-token explorer

Your `top_k_table` draws the bars below. Move the temperature: at 0.1 nearly all the probability
sits on one token; at 2.0 it spreads across many, and less likely words get a real chance.
The widget keeps working in the rendered course site, with no Python behind it.
"""),
code(r"""
from course.widgets import next_token_explorer

next_token_explorer(lambda t: top_k_table(last_logits, tokenizer, k=10, temperature=t), prompt=prompt)
"""),
md(r"""
Append the most likely word and ask again: the table changes, because the model conditions on
everything before. That is all generation is.
"""),
code(r"""
longer = prompt + tokenizer.decode([last_logits.argmax().item()])
ids = tokenizer(longer, return_tensors="pt").input_ids.to(env.device)
with torch.no_grad():
    row = model(ids, torch.arange(ids.shape[1], device=env.device)[None])[0, -1]
print(repr(longer))
for text, p in top_k_table(row, tokenizer, k=5):
    print(f"{text!r:>14}  {p:.3f}")
"""),
md(r"""
## 3. Generation with Hugging Face

`generate` wraps that loop. Here is the workshop's example on our model, with greedy decoding (always the
top token). We also count how many times the model's forward runs: one per new token.
"""),
code(r"""
calls = []
hook = hf_model.register_forward_hook(lambda *args: calls.append(1))
ids = tokenizer("My trip to Yosemite was", return_tensors="pt").input_ids.to(env.device)
out = hf_model.generate(ids, max_new_tokens=20, do_sample=False)
hook.remove()
print(repr(tokenizer.decode(out[0])))
print(f"{out.shape[1] - ids.shape[1]} new tokens, {len(calls)} forward passes")
"""),
md(r"""
## Problem 3: Your own greedy generate (5 points)

Write the loop yourself, on the from-scratch model. Each step:

1. build the position ids `0 .. T-1` for the current sequence (shape `(1, T)`),
2. call `model(ids, position_ids)` to get logits `(1, T, V)`,
3. take the **last** row and its argmax: the next token,
4. append it to the sequence,
5. stop after `max_new_tokens` new tokens, or right after appending `eos_token_id` (the
   end-of-sequence token the model emits when it is done; keep it in the output, as `generate` does).

Run it under `torch.no_grad()`: inference needs no gradients, and keeping them costs memory.

**Deliverable:** `greedy_generate(model, input_ids, max_new_tokens, eos_token_id=None)` returns the
prompt followed by the new tokens, shape `(1, T + n)` with `n <= max_new_tokens`, equal token for
token to `hf_model.generate(input_ids, do_sample=False)`. Raise `ValueError` if `input_ids` is not
`(1, T)` with `T >= 1` or `max_new_tokens` is negative.
"""),
solution("greedy_generate", r"""
def greedy_generate(model, input_ids: torch.Tensor, max_new_tokens: int, eos_token_id: int | None = None) -> torch.Tensor:
    ### BEGIN SOLUTION
    if input_ids.dim() != 2 or input_ids.shape[0] != 1 or input_ids.shape[1] < 1:
        raise ValueError(f"input_ids must have shape (1, T) with T >= 1, got {tuple(input_ids.shape)}")
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    ids = input_ids
    with torch.no_grad():
        for _ in range(max_new_tokens):
            position_ids = torch.arange(ids.shape[1], device=ids.device)[None]  # (1, T)
            logits = model(ids, position_ids)                                     # (1, T, V)
            next_id = logits[0, -1].argmax()                                      # the last row predicts what comes next
            ids = torch.cat([ids, next_id.view(1, 1)], dim=1)                     # (1, T + 1)
            if eos_token_id is not None and next_id.item() == eos_token_id:
                break
    return ids
    ### END SOLUTION
"""),
code(r"""
ids = tokenizer("The quick brown fox", return_tensors="pt").input_ids.to(env.device)
mine = greedy_generate(model, ids, max_new_tokens=15, eos_token_id=tokenizer.eos_token_id)
print(repr(tokenizer.decode(mine[0])))
"""),
tests("greedy_generate_matches_hf", 3, r"""
from course.expect import expect_tensor
ids = tokenizer("The quick brown fox", return_tensors="pt").input_ids.to(env.device)
mine = expect_tensor(greedy_generate(model, ids, max_new_tokens=12, eos_token_id=tokenizer.eos_token_id),
                     "greedy_generate(model, ids, 12)", dtype=torch.long, ndim=2, device=env.device)
ref = hf_model.generate(ids, max_new_tokens=12, do_sample=False)
assert mine.shape == ref.shape, f"expected shape {tuple(ref.shape)} (prompt + 12 tokens), got {tuple(mine.shape)}"
assert torch.equal(mine[:, :ids.shape[1]], ids), "the output starts with the prompt"
assert torch.equal(mine, ref), "your tokens differ from hf_model.generate: check the position ids and that you take the LAST row"
### BEGIN HIDDEN TESTS
for text in ("My trip to Yosemite was", "def fibonacci(n):", "Paris"):
    ids = tokenizer(text, return_tensors="pt").input_ids.to(env.device)
    ref = hf_model.generate(ids, max_new_tokens=10, do_sample=False)
    got = expect_tensor(greedy_generate(model, ids, max_new_tokens=10), f"greedy_generate({text!r})", dtype=torch.long,
                        shape=tuple(ref.shape), device=env.device)
    assert torch.equal(got, ref), f"differs from hf generate for {text!r}"
# the instruct model ends its answer with EOS: stop right after it, keeping it
chat = tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France? Answer in one word."}],
                                     add_generation_prompt=True, return_tensors="pt")
chat = (chat if isinstance(chat, torch.Tensor) else chat["input_ids"]).to(env.device)
ref = hf_model.generate(chat, max_new_tokens=12, do_sample=False, eos_token_id=tokenizer.eos_token_id)
got = expect_tensor(greedy_generate(model, chat, max_new_tokens=12, eos_token_id=tokenizer.eos_token_id),
                    "greedy_generate(chat, eos_token_id=...)", dtype=torch.long, ndim=2, device=env.device)
assert ref[0, -1].item() == tokenizer.eos_token_id and ref.shape[1] < chat.shape[1] + 12, "the reference must end in EOS"
assert torch.equal(got, ref), "stop right after appending eos_token_id, and keep it in the output"
### END HIDDEN TESTS
"""),
tests("greedy_generate_loop", 2, r"""
from course.expect import expect_tensor
ids = tokenizer("Hello", return_tensors="pt").input_ids.to(env.device)
same = expect_tensor(greedy_generate(model, ids, max_new_tokens=0), "greedy_generate(ids, 0)", dtype=torch.long,
                     device=env.device)
assert torch.equal(same, ids), "max_new_tokens=0 returns the prompt unchanged"
one = expect_tensor(greedy_generate(model, ids, max_new_tokens=1), "greedy_generate(ids, 1)", dtype=torch.long, device=env.device)
assert one.shape == (1, ids.shape[1] + 1), f"one new token: expected shape {(1, ids.shape[1] + 1)}, got {tuple(one.shape)}"
for bad_ids, bad_n in ((ids[0], 3), (ids, -1)):
    try:
        greedy_generate(model, bad_ids, max_new_tokens=bad_n)
    except ValueError:
        pass
    else:
        raise AssertionError(f"input_ids of shape {tuple(bad_ids.shape)} with max_new_tokens={bad_n} must raise ValueError")
### BEGIN HIDDEN TESTS
class Recorder(torch.nn.Module):
    # wraps the model and records what the loop passes in
    def __init__(self, inner):
        super().__init__()
        self.inner, self.seen = inner, []
    def forward(self, input_ids, position_ids):
        self.seen.append((input_ids.clone(), position_ids.clone()))
        return self.inner(input_ids, position_ids)

rec = Recorder(model)
ids = tokenizer("One two three", return_tensors="pt").input_ids.to(env.device)
out = expect_tensor(greedy_generate(rec, ids, max_new_tokens=4), "greedy_generate(recorder, ids, 4)", dtype=torch.long,
                    shape=(1, ids.shape[1] + 4), device=env.device)
assert len(rec.seen) == 4, f"one forward per new token: expected 4 calls, got {len(rec.seen)}"
for step, (x, pos) in enumerate(rec.seen):
    T = ids.shape[1] + step
    assert x.shape == (1, T), f"step {step}: the model must see the whole sequence so far ({T} tokens)"
    assert torch.equal(pos, torch.arange(T, device=pos.device)[None]), f"step {step}: position ids must be 0..{T - 1}"
    assert torch.equal(x, out[:, :T]), f"step {step}: the model must see the prompt and the tokens generated so far"
# a tiny random model with a reference loop written here; EOS chosen so it stops mid-way
torch.manual_seed(3)
tiny_cfg = type(model.cfg)(family="gpt2", vocab_size=50, n_layer=2, n_head=2, n_kv_head=2, d_model=32, d_ff=64, max_seq_len=64)
tiny = type(model)(tiny_cfg).eval().to(env.device)
with torch.no_grad():
    for p in tiny.parameters():
        p.copy_(torch.randn_like(p) * 0.5)
def ref_loop(m, x, n, eos):
    with torch.no_grad():
        for _ in range(n):
            nxt = m(x, torch.arange(x.shape[1], device=x.device)[None])[0, -1].argmax().view(1, 1)
            x = torch.cat([x, nxt], 1)
            if eos is not None and nxt.item() == eos:
                break
    return x
start = torch.tensor([[5, 7, 9]], device=env.device)
free_run = ref_loop(tiny, start, 8, None)
eos = free_run[0, 5].item()  # the third generated token
first_eos = (free_run[0, 3:] == eos).nonzero()[0, 0].item() + 3
got = expect_tensor(greedy_generate(tiny, start, 8, eos_token_id=eos), "greedy_generate(tiny, eos)", dtype=torch.long,
                    device=env.device)
assert torch.equal(got, free_run[:, :first_eos + 1]), "stop at the first EOS, keeping it"
got = expect_tensor(greedy_generate(tiny, start, 8), "greedy_generate(tiny)", dtype=torch.long, device=env.device)
assert torch.equal(got, free_run), "without eos_token_id, generate exactly max_new_tokens"
### END HIDDEN TESTS
"""),
md(r"""
## 4. Measure: what does your loop cost?

Your loop and `generate` produce the same tokens. Are they equally fast? We time both for a growing
number of new tokens (median of a few runs after a warm-up, with `course.timing.benchmark`).
"""),
code(r"""
import matplotlib.pyplot as plt
from course.timing import benchmark

ids = tokenizer("The quick brown fox", return_tensors="pt").input_ids.to(env.device)
lengths = env.pick([8, 16, 32, 64], [1, 2, 4])
repeats = env.pick(3, 1)
mine_s = [benchmark(lambda: greedy_generate(model, ids, n), repeats=repeats, device=env.device).median for n in lengths]
hf_s = [benchmark(lambda: hf_model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False),
                  repeats=repeats, device=env.device).median for n in lengths]

fig, ax = plt.subplots(figsize=(6, 3.5))
ax.plot(lengths, mine_s, "o-", label="your greedy_generate")
ax.plot(lengths, hf_s, "s-", label="hf_model.generate")
ax.set_xlabel("new tokens"); ax.set_ylabel("seconds"); ax.set_title("Generation time"); ax.legend(); ax.grid(alpha=0.3)
plt.show()
n = lengths[-1]
print(f"{n} new tokens on {env.device} (float32): yours {mine_s[-1]:.2f} s ({n / mine_s[-1]:.1f} tokens/s), "
      f"generate {hf_s[-1]:.2f} s ({n / hf_s[-1]:.1f} tokens/s): {mine_s[-1] / hf_s[-1]:.1f}x")
"""),
md(r"""
Your loop gives the same answer, but at step `t` it runs the model over all `T + t` tokens again,
recomputing what it computed the step before. `generate` keeps each layer's keys and values from
earlier steps (the **KV cache**) and feeds the model only the newest token. On a CPU, where the time
follows the arithmetic, your plot shows it: your line bends upward as the text grows, `generate`'s
stays straight. (In quick mode, as when the tests run this notebook, the few new tokens add too
little text for the bend to show; the full run's do.) On a GPU, at this model size, it may not show
yet: a pass over a few dozen tokens costs about what a pass over one does, because launching its
kernels takes most of the time, and your lean loop can even beat `generate`, which does more
bookkeeping per step (the ratio you printed says). Lab 02 measures why, and the two phases the
cache creates (prefill and decode); lab 03 has you build the cache.

## Summary

- A **forward pass** maps `(1, T)` token ids and their positions to `(1, T, V)` logits: a score for
  every vocabulary entry after every prefix. Generation uses the last row.
- **Softmax with temperature** turns logits into probabilities; subtracting the maximum keeps it stable.
- **Generation** is a loop of forward passes: pick a token, append it, repeat until EOS or a length limit.
- **Greedy** decoding always picks the top token; it is deterministic, so your loop must equal `generate` exactly.

**Questions** (from the workshop this course grew from). Answer in the cell under each group, in a
few sentences of your own; a person grades them (3 points in all).
1. What is the output of a forward pass: a token, or something else? What is its shape, and why does it have a row per input position?
2. What are position ids for? Your loop rebuilds them from 0 at every step: why is that right here? Try starting them at 1 instead: do the tokens change? (Hint: a RoPE score depends on the distance between two positions.) What position id will the newest token need once the model keeps the earlier tokens (lab 03)?
"""),
answer("forward_pass_answer", 1, "questions 1 and 2", model=r"""
1. Not a token: **logits**, one score for each of the 49,152 vocabulary entries at every input
   position, shape `(1, T, 49152)` = (batch, positions, vocabulary). Row `t` scores the token that
   follows token `t`, computed from tokens `0..t` only (causal attention), so one pass predicts the
   next token after every prefix at once: that is how the model is trained. Generation reads the
   last row; picking a token from it is the loop's job, not the model's.
2. Attention by itself ignores order; position ids say where each token sits. SmolLM2 uses RoPE: it
   rotates each query and key by an angle proportional to its position. Rebuilding `0 .. T-1` at
   every step is right because the loop feeds the whole sequence again each step, so token `i` is at
   position `i`. Starting at 1 does not change the tokens (the logits move by about 1e-5, rounding):
   a rotated query-key product depends only on the difference of the two positions, and shifting
   every position by one keeps every difference. (A GPT-2 model, with learned absolute positions,
   would change.) Once the model keeps the keys and values of the earlier tokens, the newest token
   is fed alone and needs position id = the number of tokens before it (the cache length), not 0.
""", rubric=r"""
- 0.5: question 1: logits (scores, not a token) of shape (batch, positions, vocabulary), and a row per
  position because one pass scores the next token after every prefix (training; generation uses
  only the last row).
- 0.5: question 2: position ids encode order (RoPE rotates q and k); from 0 is right because the whole
  sequence is recomputed; a shift by one leaves the tokens unchanged because RoPE depends on relative
  distance; with a cache the new token's id is the number of tokens already cached. Any three of
  these four parts earn the 0.5.
"""),
md(r"""
3. What is the exit condition of the generation loop? Why keep the EOS token in the output?
4. How many forward passes does generating 100 tokens take? Which of them repeat work?
"""),
answer("generation_loop_answer", 1, "questions 3 and 4", model=r"""
3. The loop stops after `max_new_tokens` new tokens, or right after it appends `eos_token_id`,
   whichever comes first. EOS stays in the output because `generate` keeps it (the test compares
   token for token), and because it records why the text ended: the model finished (a server's
   `finish_reason: "stop"`) rather than being cut off by the length limit (`"length"`). In a chat,
   the end-of-turn token must also be in the history when the conversation continues.
4. 100 forward passes, one per new token: the first over the `T` prompt tokens, the k-th over
   `T + k - 1` tokens. Every pass after the first repeats work: it recomputes the hidden states,
   keys and values of all the earlier tokens, which have not changed (a token's keys and values
   depend only on it and the tokens before it). Only the last position is new. In all the model
   processes `100 T + 4,950` token positions where `T + 99` would do: the KV cache (lab 03) removes
   the repeats.
""", rubric=r"""
- 0.5: question 3: both exits (length limit, EOS appended, EOS kept) and one good reason to keep EOS
  (equal to `generate`; tells a finished answer from a truncated one; chat history).
- 0.5: question 4: 100 passes; the repeated work is recomputing every earlier token at each step
  (only the newest position is new). A total count is welcome, not required.
"""),
md(r"""
5. Greedy decoding tends to repeat itself. Try `greedy_generate` with 60 new tokens on a prompt of your own and look for a loop.
"""),
answer("greedy_repeats_answer", 1, "question 5", model=r"""
(An example; students use prompts of their own.) "My trip to Yosemite was" gives, greedily: "... I've
been fortunate enough to have had the opportunity to explore some of the most incredible landscapes
on the planet. I've been fortunate to have had the chance to work with ...": the same sentence frame
comes back within 60 tokens, and with more tokens whole sentences repeat. Greedy decoding is
deterministic: the same context always gives the same choice, and once a phrase has appeared, the
context makes the same continuation even more likely (the model copies from its context), so the
text falls into a loop it cannot leave. Sampling with a temperature, top-k/top-p and a repetition
penalty (lab 07) are the usual ways out.
""", rubric=r"""
- 0.5: an experiment was run: the prompt and what came out (an exact loop, or a repeated phrase or
  sentence frame; "no loop in 60 tokens" with the text shown is an honest answer too).
- 0.5: why greedy repeats: deterministic choice from the same context, and a repetition makes itself
  more likely (self-reinforcing); naming a remedy (sampling, repetition penalty) is a plus, not required.
"""),
md(r"""
## Going further

- The workshop's reference: *A Survey on Inference Engines for Large Language Models* (2025) maps which engine implements which optimization.
- nanoGPT's `model.py` and `generate` (Karpathy) is a short, readable GPT-2 with the same loop.
- Hugging Face `generate` adds logits processors (temperature, top-k, top-p, repetition penalty) between the forward pass and the argmax: lab 07 builds them.
- vLLM, SGLang and TGI run this loop for hundreds of requests at once: batching (lab 04), paged KV memory (lab 05) and a scheduler decide which requests advance each step.
"""),
]

write_notebook("labs/01_inference/01_inference.ipynb", cells + [md(CHECK_YOUR_WORK)])
print("wrote labs/01_inference/01_inference.ipynb")
