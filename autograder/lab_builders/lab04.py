"""Builds the lab 04 source notebook. Edit this file, then run from the repo root:

    .venv/bin/python -m autograder.lab_builders.lab04
"""
from autograder.authoring import answer, code, locked, md, solution, tests, write_notebook  # noqa: E402
from autograder.lab_builders.hidden_refs import greedy_and_tiny  # noqa: E402
from autograder.lab_builders.common_cells import CHECK_YOUR_WORK, COLAB_INSTALL, SETUP  # noqa: E402

# The independent reference of the hidden tests: an uncached greedy loop over the plain decoder,
# and tiny random models with decisive logits (large weights: no near-ties between top tokens).
HIDDEN_REFERENCE = greedy_and_tiny(max_seq_len=64)

cells = [
md(r"""
# Lab 04: Batching, static and continuous

A decode step reads every weight of the model to produce **one** token for **one** request (lab 02).
If a server ran one request at a time, it would pay that whole read for every token of every user.
**Batching** lets many requests share each read: one forward pass, one token for each of them. But
requests are not alike. Their prompts differ in length, and so do their answers, which end whenever
the model emits its end-of-sequence token. How a server groups them decides how much of each step
does useful work. **Static batching** groups requests and runs the group until its longest member
is done. **Continuous batching** (Orca, 2022) decides who is in the batch at *every* step: a
finished request leaves at once and a waiting one takes its place. It is the core of the scheduler
in every serving engine (vLLM, SGLang, TGI), and you will build it today.

**You will**
- measure what a batch costs: the time of one decode step at batch 1 and batch 8;
- build a static batch: left padding, the attention mask, position ids that skip the pads, and a generate loop for many prompts at once that equals generating each prompt alone;
- build continuous batching: a first-come-first-served scheduler that admits waiting requests into free cache slots and retires finished ones, and the engine step that runs them;
- watch both schedules on a batch timeline, and measure their throughput and latency, against each other, against the batch size, and against Hugging Face `generate`; on a GPU, also with the decode steps in CUDA graphs (lab 02).

**Time:** about 2 hours 50 minutes: 35 minutes of reading, four problems (left padding about 20
minutes, static batching 30, the scheduler 25, the engine step 30), 25 minutes for the written
questions at the end, and about 5 minutes of running on a laptop CPU (measured on 2 cores: the batch-size
sweep takes most of it; 2-3 minutes on a GPU). **Hardware:** everything runs on a CPU, with the measurements
sized down there; on a GPU the model runs in bf16 (fp16 on a T4), the workloads are larger, and the
engine's decode steps can run from CUDA graphs.
"""),
locked("colab_install", COLAB_INSTALL),
locked("setup", SETUP),
md(r"""
## 1. The engine parts you are given

A server keeps one KV cache per request. Lab 03's cache grows a list of tensors with `torch.cat`:
fine for one sequence, awkward for many, since every request would have its own tensors of its own
length. Engines without paging (lab 05 adds paging) do something simpler: they reserve one big
tensor up front and give each request a **slot** in it, a row with room for `max_len` tokens.

`course.engine` holds that cache and a forward pass that uses it (given code; nothing in it is graded):

- `SlotKVCache(cfg, n_slots, max_len, dtype=model.dtype, device=dev)`: keys and values of shape
  `(n_layer, n_slots, n_kv_head, max_len, head_dim)`, plus `lengths[slot]` (how many positions of
  each slot are written) and `valid[slot, position]` (which of them hold a real token; more on that
  soon). Give it the model's dtype: the default, float32, would add a cast at every layer of every
  step on a GPU, where the model runs in 16-bit floats.
- `forward_cached(model, input_ids, position_ids, cache, slots, attention_mask=None)`: runs the
  model on `B` rows of new tokens `(B, T)`. Row `b` appends its keys and values to slot `slots[b]`,
  attends to everything in that slot so far, and gets its logits `(B, T, V)`. Rows may sit in any
  slots, at different lengths: that is what continuous batching will need.

It is our from-scratch decoder (`course/models/decoder.py`) with the cache threaded through
attention; `course/engine/runner.py` is about 160 lines, worth a look. Here it generates a few
tokens for one prompt in slot 2: one **prefill** call over the prompt, then one **decode** call per token.
"""),
code(r"""
import torch
from course.engine import SlotKVCache, forward_cached

tokenizer = course.load_tokenizer()
model = course.load_model(device=env.device, dtype=env.dtype)
# Token-for-token checks run in float32: in bf16 two correct programs can round a near-tie differently.
model_fp32 = model if env.dtype == torch.float32 else course.load_model(device=env.device)
dev = env.device

prompt = tokenizer("The capital of France is").input_ids            # list[int]
cache = SlotKVCache(model.cfg, n_slots=4, max_len=64, dtype=model.dtype, device=dev)
slot = torch.tensor([2], device=dev)                                  # this request lives in slot 2
logits = forward_cached(model, torch.tensor([prompt], device=dev),    # prefill: (1, T) -> logits (1, T, V)
                        torch.arange(len(prompt), device=dev)[None], cache, slot)
new = []
for _ in range(8):
    new.append(logits[0, -1].argmax().item())                         # greedy: the top token
    position = len(prompt) + len(new) - 1                             # where the new token sits
    logits = forward_cached(model, torch.tensor([[new[-1]]], device=dev),  # decode: (1, 1) -> (1, 1, V)
                            torch.tensor([[position]], device=dev), cache, slot)
print(repr(tokenizer.decode(prompt + new)))
print(cache)

# The cache changes the cost, not the answer: one plain forward over the whole text agrees.
full = torch.tensor([prompt + new], device=dev)
with torch.no_grad():
    plain = model(full, torch.arange(full.shape[1], device=dev)[None])[0, -1]
print(f"largest logit difference, cached vs plain forward: {(plain - logits[0, -1]).abs().max().item():.1e}")
"""),
md(r"""
## 2. Why batch: one request at a time leaves the machine idle

Time one decode step for `B` requests at once: fill `B` slots with a prompt, then run one step that
gives each of them one token. Lab 02 predicts the outcome. On a CPU a decode step is memory-bound:
its time goes into reading the weights, and a batch reads them once for all its rows. On a GPU this
model's eager step is bound by kernel launches (lab 02, section 3), and a batch launches the same
kernels once for all its rows.
"""),
code(r"""
import matplotlib.pyplot as plt
from course.engine import capture_decode_graphs
from course.report import record
from course.timing import benchmark

WHERE = f"{dev}, {str(env.dtype).removeprefix('torch.')}"

def decode_step_seconds(B, prompt, repeats, graphs=False):
    '''Median seconds of one decode step for B requests, each in its own slot after the same prompt;
    with `graphs`, the step replays a CUDA graph captured for batch B (lab 02).'''
    cache = SlotKVCache(model.cfg, n_slots=B, max_len=len(prompt) + 64, dtype=model.dtype, device=dev)
    slots = torch.arange(B, device=dev)
    T = len(prompt)
    forward_cached(model, torch.tensor([prompt] * B, device=dev), torch.arange(T, device=dev).expand(B, T), cache, slots)
    if graphs:
        captured = capture_decode_graphs(model, cache, B, buckets=[B])  # forward_cached now replays it for (B, 1) calls
        if captured.off:                                                # the capture failed: this batch runs eagerly
            print(f"batch {B}: {captured.describe()}")
    ids, pos = torch.full((B, 1), prompt[-1], device=dev), torch.full((B, 1), T, device=dev)
    def step():
        forward_cached(model, ids, pos, cache, slots)
        cache.lengths[slots] = T          # rewind, so every timed step sees the same context length
    return benchmark(step, warmup=1, repeats=repeats, device=dev).median

batch_sizes = env.pick([1, 2, 4, 8, 16, 32, 64], [1, 2, 4, 8], cpu=[1, 2, 4, 8, 16, 32])
modes = {"eager": False, "CUDA graph": True} if env.gpu else {"eager": False}   # a CPU has no launches to remove
step_s = {mode: [decode_step_seconds(B, prompt, repeats=env.pick(7, 2), graphs=g) for B in batch_sizes]
          for mode, g in modes.items()}
for i, B in enumerate(batch_sizes):
    print(f"batch {B:>2} ({WHERE}): " + " | ".join(f"{mode} {s[i] * 1e3:6.1f} ms per step, {B / s[i]:8.1f} tokens/s"
                                                  for mode, s in step_s.items()))

fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(9, 3.2))
for mode, s in step_s.items():
    ax1.plot(batch_sizes, [x * 1e3 for x in s], "o-", label=mode)
    ax2.plot(batch_sizes, [B / x for B, x in zip(batch_sizes, s)], "o-", label=mode)
ax1.set_ylim(bottom=0); ax1.set_xlabel("batch size"); ax1.set_ylabel("ms per decode step"); ax1.set_title(f"One step ({WHERE})")
ax2.set_ylim(bottom=0); ax2.set_xlabel("batch size"); ax2.set_ylabel("tokens / s"); ax2.set_title("Throughput")
for ax in (ax1, ax2):
    ax.grid(alpha=0.3); ax.legend(fontsize=8)
plt.tight_layout(); plt.show()
i8 = batch_sizes.index(8)
for mode, s in step_s.items():
    print(f"{mode}: batch 8 costs {s[i8] / s[0]:.1f}x the time of batch 1 per step, "
          f"for {(8 / s[i8]) / (1 / s[0]):.1f}x the tokens per second")
    record(f"batch8_throughput_gain_{mode.split()[0].lower()}", (8 / s[i8]) / (1 / s[0]), "x",
           "a decode step for 8 requests costs far less than 8 steps for one", device=dev, dtype=env.dtype)
"""),
md(r"""
The step time grows far more slowly than the batch, so tokens per second climb with it. Serving one
request at a time would leave most of that on the table. How far does it go? Until the arithmetic
of the batch catches up with whatever else dominates a step. On a CPU that is the weight reads
(lab 02's ridge point). On a GPU, for this small model, it is first the kernel launches (lab 02,
section 3): the eager step costs about the same at batch 1 and batch 32 because launching its
kernels takes longer than running them. With the decode step in a CUDA graph (the "CUDA graph"
curve, drawn on a GPU only) the launches are gone, and the step stays flat until the batch's own work grows. Either way
the lesson holds, and your numbers say by how much.

So: batch. The rest of the lab is about *which* requests share a batch, and when.

## 3. Static batching

The simplest plan: take `B` requests, run them together from their first token to their last, then
take the next `B`. The first obstacle is that a batch is a rectangle, `(B, T)`, and prompts have
different lengths. Short prompts get **padded** with a filler token, and the model must be told
which entries are real. Where the pads go matters:

```
            right padding                          left padding
        t=0   t=1   t=2   t=3                  t=0   t=1   t=2   t=3
row 0   The   cat   sat   on   -> next?        The   cat   sat   on   -> next
row 1   Hi    !     PAD   PAD  -> next?        PAD   PAD   Hi    !    -> next
```

With **left padding** the newest token of every row sits in the last column. So `logits[:, -1]` is
every row's next-token prediction, and each decode step appends one column to all rows alike. With
right padding, row 1's prediction is hidden at `t=1`, and its next token would have to go into the
middle of the rectangle. Servers and `generate` therefore pad on the left.

Two more things make a padded row behave exactly like the same prompt alone:

- an **attention mask** (1 = real token, 0 = pad), so that no real token attends to a pad.
  `forward_cached` writes the pads into the cache like any token, but marks them as not `valid`;
- **position ids that skip the pads**: "Hi" is the first token of its prompt, so it must sit at
  position 0, not at position 2. Pads get position 0 (any value would do; they are never attended to).

```
input_ids       attention_mask      position_ids
The cat sat on    1  1  1  1          0  1  2  3
PAD PAD Hi  !     0  0  1  1          0  0  0  1
```

## Problem 1: Left padding and position ids (3 points)

**Deliverable:** `left_pad(prompts, pad_id)` returns `(input_ids, attention_mask)`, both `(B, T)`
`torch.long` on the CPU, where `T` is the longest prompt's length, each prompt is right-aligned and
preceded by `pad_id`, and the mask is 1 on real tokens and 0 on pads; it raises `ValueError` for an
empty list or an empty prompt. `position_ids_from_mask(attention_mask)` returns `(B, T)` `torch.long`
positions, on the mask's device, that count each row's real tokens from 0, with 0 on every pad.
"""),
solution("left_pad", r'''
def left_pad(prompts: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-align the prompts in a (B, T) rectangle, pads on the left; 1 marks a real token in the mask."""
    ### BEGIN SOLUTION
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("prompts must be a non-empty list of non-empty token lists")
    T = max(len(p) for p in prompts)
    input_ids = torch.full((len(prompts), T), pad_id, dtype=torch.long)   # cpu: (B, T), as the deliverable says
    attention_mask = torch.zeros((len(prompts), T), dtype=torch.long)     # cpu: (B, T)
    for b, p in enumerate(prompts):
        input_ids[b, T - len(p):] = torch.tensor(p, dtype=torch.long)       # cpu: into the CPU rectangle
        attention_mask[b, T - len(p):] = 1
    return input_ids, attention_mask
    ### END SOLUTION


def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Each row's real tokens numbered 0, 1, 2, ... from its first real token; pads get 0."""
    ### BEGIN SOLUTION
    return (attention_mask.long().cumsum(dim=-1) - 1).clamp(min=0)       # (B, T)
    ### END SOLUTION
'''),
code(r"""
texts = ["The capital of France is", "Hello", "def fibonacci(n):"]
demo_ids, demo_mask = left_pad([tokenizer(t).input_ids for t in texts], pad_id=0)
print(demo_ids)
print(demo_mask)
print(position_ids_from_mask(demo_mask))
"""),
tests("left_pad_tests", 3, r"""
from course.expect import expect_tensor, expect_tuple

def padded(prompts, pad_id):   # left_pad's answer, checked before it is compared
    ids, mask = expect_tuple(left_pad(prompts, pad_id), "left_pad(...)", 2)
    shape = (len(prompts), max(map(len, prompts)))
    return (expect_tensor(ids, "input_ids", dtype=torch.long, shape=shape, device="cpu"),
            expect_tensor(mask, "attention_mask", dtype=torch.long, shape=shape, device="cpu"))

def positions(mask):
    return expect_tensor(position_ids_from_mask(mask), "position_ids_from_mask(mask)", dtype=torch.long,
                         shape=tuple(mask.shape), device=mask.device)

ids, mask = padded([[5, 6, 7], [8, 9]], pad_id=0)
assert ids.tolist() == [[5, 6, 7], [0, 8, 9]], "pads go on the LEFT: every row's newest token ends up in the last column"
assert mask.tolist() == [[1, 1, 1], [0, 1, 1]], "the mask is 1 on a real token and 0 on a pad"
pos = positions(mask.to(dev))
assert pos.tolist() == [[0, 1, 2], [0, 0, 1]], "positions count real tokens only: a row's first real token is at position 0"
### BEGIN HIDDEN TESTS
ids, mask = padded([[3], [4, 5, 6, 7], [9, 9]], pad_id=42)
assert ids.tolist() == [[42, 42, 42, 3], [4, 5, 6, 7], [42, 42, 9, 9]], "pad with pad_id, on the left"
assert mask.tolist() == [[0, 0, 0, 1], [1, 1, 1, 1], [0, 0, 1, 1]], "the mask marks the real tokens, right-aligned"
ids, mask = padded([[1, 2, 3]], pad_id=0)
assert ids.tolist() == [[1, 2, 3]] and mask.tolist() == [[1, 1, 1]], "one prompt: nothing to pad"
for bad in ([], [[1, 2], []]):
    try:
        left_pad(bad, pad_id=0)
    except ValueError:
        pass
    else:
        raise AssertionError(f"left_pad({bad}) must raise ValueError")
m = torch.tensor([[0, 0, 0, 1, 1], [1, 1, 1, 1, 1], [0, 1, 1, 1, 1], [0, 0, 0, 0, 1]], device=dev)
expect = [[0, 0, 0, 0, 1], [0, 1, 2, 3, 4], [0, 0, 1, 2, 3], [0, 0, 0, 0, 0]]
for given in (m, m.bool(), m.int()):
    got = positions(given)
    assert got.tolist() == expect, (f"positions from a {given.dtype} mask {m.tolist()}: got {got.tolist()}; each row's real "
                                    f"tokens count 0, 1, 2, ... from its first real token, pads get 0 (a bool or int mask too)")
assert positions(torch.ones(2, 6, dtype=torch.long, device=dev)).tolist() == [list(range(6))] * 2, \
    "a row with no pads is numbered 0, 1, 2, ..."
### END HIDDEN TESTS
"""),
md(r"""
Do positions really matter? SmolLM2 uses RoPE, which rotates queries and keys by their position.
A query and a key interact through the *difference* of their positions, so shifting a whole row by
a constant changes nothing (up to rounding). GPT-2 instead *adds* a learned vector for each absolute
position: there, a prompt read from position 2 onward is a different input. Check both: the same
padded prompt with correct positions and with positions counted over the pads, on SmolLM2 and on a
small GPT-2-style model with random weights.
"""),
code(r"""
def last_logits(m, ids, mask, pos):
    cache = SlotKVCache(m.cfg, n_slots=ids.shape[0], max_len=ids.shape[1], device=m.device)
    slots = torch.arange(ids.shape[0], device=m.device)
    return forward_cached(m, ids.to(m.device), pos.to(m.device), cache, slots, mask.to(m.device))[:, -1]

gpt2_cfg = course.ModelConfig(family="gpt2", vocab_size=model.cfg.vocab_size, n_layer=2, n_head=4, n_kv_head=4,
                              d_model=64, d_ff=128, max_seq_len=64)
gpt2_like = course.models.init_weights(course.Decoder(gpt2_cfg), std=0.5).to(dev)
for name, m in (("SmolLM2 (RoPE)", model_fp32), ("GPT-2-style (learned positions)", gpt2_like)):   # both float32
    right = last_logits(m, demo_ids, demo_mask, position_ids_from_mask(demo_mask))
    wrong = last_logits(m, demo_ids, demo_mask, torch.arange(demo_ids.shape[1], device=dev).expand_as(demo_ids))  # counted over the pads
    print(f"{name:32s} largest logit change when positions count the pads: {(right - wrong).abs().max().item():.1e}")
"""),
md(r"""
A difference at the level of rounding for RoPE, a large one for learned positions. Engines compute
positions from the mask for every model, and so do we.

## Problem 2: Static batching (3 points)

Now a generate loop for a whole batch. Every request gets a slot of one `SlotKVCache`, and the
batch moves in lockstep:

1. **prefill**: one `forward_cached` over the left-padded prompts, with their mask and positions;
   the last column of the logits gives each row its first new token;
2. **decode**: one `forward_cached` per step over a `(B, 1)` column holding each row's latest token,
   at position = the number of real tokens before it (`len(prompt) + len(output) - 1` for the token
   being fed, which is already in `output`); no mask needed, every new token is real;
3. a row is **done** after `max_new_tokens` tokens or right after it emits `eos_token_id` (keep the
   EOS, as `generate` does). A done row stays in the batch: it keeps its slot and is still computed
   each step (its extra tokens are thrown away) until **every** row is done. That is static
   batching's waste, and you will see it soon.

**Deliverable:** `static_generate(model, prompts, max_new_tokens, eos_token_id=None, pad_id=0)`
returns the new tokens of each prompt, greedy, as a list of lists in prompt order, following the
steps above; each list equals what the prompt alone would generate. `max_new_tokens` is one limit
for all or one per prompt (the given first lines turn it into `limits`).
"""),
solution("static_generate", r'''
def static_generate(model, prompts: list[list[int]], max_new_tokens: int | list[int],
                    eos_token_id: int | None = None, pad_id: int = 0) -> list[list[int]]:
    """Greedy generation for prompts that start together and advance together, step by step."""
    limits = [max_new_tokens] * len(prompts) if isinstance(max_new_tokens, int) else list(max_new_tokens)
    if len(limits) != len(prompts) or any(n < 1 for n in limits):
        raise ValueError(f"max_new_tokens must be an int >= 1, or one per prompt, got {max_new_tokens}")
    dev = model.device
    ### BEGIN SOLUTION
    input_ids, mask = left_pad(prompts, pad_id)                          # (B, T) each
    positions = position_ids_from_mask(mask)                             # (B, T)
    B, T = input_ids.shape
    cache = SlotKVCache(model.cfg, n_slots=B, max_len=T + max(limits), dtype=model.dtype, device=dev)
    slots = torch.arange(B, device=dev)                                  # row b lives in slot b
    logits = forward_cached(model, input_ids.to(dev), positions.to(dev), cache, slots, mask.to(dev))  # prefill
    next_pos = positions[:, -1:].to(dev) + 1                             # (B, 1): where each row's next token sits
    outputs: list[list[int]] = [[] for _ in prompts]
    done = [False] * B
    while True:
        next_ids = logits[:, -1].argmax(dim=-1)                          # (B,): every row's newest token
        for b, tok in enumerate(next_ids.tolist()):
            if not done[b]:
                outputs[b].append(tok)
                done[b] = len(outputs[b]) == limits[b] or tok == eos_token_id
        if all(done):
            return outputs
        logits = forward_cached(model, next_ids[:, None], next_pos, cache, slots)  # decode: all B rows, done or not
        next_pos = next_pos + 1
    ### END SOLUTION
'''),
code(r"""
prompts = [tokenizer(t).input_ids for t in texts]
for text, out in zip(texts, static_generate(model, prompts, max_new_tokens=[12, 4, 8])):
    print(f"{text!r:28} -> {tokenizer.decode(out)!r}")
"""),
tests("static_generate_tests", 3, r"""
from course.engine import batching as course_batching   # lab 04's answers, released
from course.expect import expect_ints, expect_type, substituted

def static(m, prompts, n, **kwargs):   # your static_generate, on the course's padding (Problem 2 graded on its own)
    with substituted(globals(), left_pad=course_batching.left_pad,
                     position_ids_from_mask=course_batching.position_ids_from_mask):
        out = expect_type(static_generate(m, prompts, n, **kwargs), "static_generate(...)", list)
    assert len(out) == len(prompts), f"one list of new tokens per prompt: expected {len(prompts)}, got {len(out)}"
    return [expect_ints(o, f"static_generate(...)[{i}]") for i, o in enumerate(out)]

prompts = [tokenizer(t).input_ids for t in ("The capital of France is", "Hello", "def fibonacci(n):")]
batched = static(model_fp32, prompts, 6)
assert [len(o) for o in batched] == [6, 6, 6], f"expected 6 new tokens per prompt, got lengths {[len(o) for o in batched]}"
alone = [static(model_fp32, [p], 6)[0] for p in prompts]
assert batched == alone, "each row of the batch must equal its prompt generated alone: check the padding side, mask and positions"
from course.engine.graphs import greedy_generate as course_greedy   # the course's one-request greedy loop (lab 03)
for name, m in (("SmolLM2", model_fp32), ("the GPT-2-style model (learned positions)", gpt2_like)):
    want = [course_greedy(m, torch.tensor([p], device=dev), 6, graphs=False)[0, len(p):].tolist() for p in prompts]
    assert static(m, prompts, 6) == want, \
        f"{name}: differs from the course's greedy loop: feed each new token at position len(prompt) + len(output) - 1"
assert [len(o) for o in static(model_fp32, prompts, [1, 3, 2])] == [1, 3, 2], "one limit per prompt"
### BEGIN HIDDEN TESTS
""" + HIDDEN_REFERENCE + r"""
for family, seed in (("gpt2", 1), ("llama", 2)):
    tiny = _tiny(family, seed)
    g = torch.Generator().manual_seed(seed)
    ps = [torch.randint(1, 64, (n,), generator=g).tolist() for n in (1, 7, 3, 5)]
    refs = [_ref_greedy(tiny, p, 9) for p in ps]
    got = static(tiny, ps, 9)
    assert got == refs, f"{family}: batched output differs from each prompt alone (padding side, mask or positions)"
    # per-prompt limits, and EOS in the middle of the batch: the row stops, keeps its EOS, the others go on
    eos = refs[1][2]
    stop = [r[: r.index(eos) + 1] if eos in r[:n] else r[:n] for r, n in zip(refs, (9, 9, 4, 6))]
    assert any(len(s) < n for s, n in zip(stop, (9, 9, 4, 6)) if s[-1] == eos), "the reference must stop a row at EOS"
    got = static(tiny, ps, [9, 9, 4, 6], eos_token_id=eos, pad_id=63)
    assert got == stop, (f"{family}: stop each row right after its EOS (kept) or at its own limit, while the other rows "
                         f"go on; you returned lengths {[len(o) for o in got]} for limits [9, 9, 4, 6]")
    assert static(tiny, ps[:1], 1) == [refs[0][:1]], "max_new_tokens=1: the prefill's token only"
real = [tokenizer(t).input_ids for t in ("My trip to Yosemite was", "Water boils at")]
assert static(model_fp32, real, 5) == [_ref_greedy(model_fp32, p, 5) for p in real], "differs from each prompt alone on SmolLM2"
try:
    static_generate(model, real, max_new_tokens=0)
except ValueError:
    pass
else:
    raise AssertionError("max_new_tokens=0 must raise ValueError")
### END HIDDEN TESTS
"""),
md(r"""
## 4. Continuous batching

Static batching has two costs, both visible in this picture of five requests and a batch of four:

```
static batching: a batch runs until its longest request ends
step      0  1  2  3  4  5  6  7  8  9 10 11
req 0     P  D  D  ·  ·  ·  ·  ·                   P  prefill: the prompt, and the first token
req 1     P  D  D  D  D  D  D  D                   D  decode: one more token
req 2     P  ·  ·  ·  ·  ·  ·  ·                   ·  padding: finished, but still holds its slot
req 3     P  D  D  D  D  ·  ·  ·                      and is computed each step
req 4     w  w  w  w  w  w  w  w  P  D  D  D       w  waiting: arrived, no room
```

- **Padding waste**: a finished request keeps its slot until the whole batch ends. Its slot does
  no useful work, while request 4 waits outside.
- **Head-of-line blocking**: request 4 waits for the *longest* request of the batch before it even
  starts, however short it is.

Orca's answer is **iteration-level scheduling**: the scheduler runs at every step, not once per
batch. A request that finishes leaves the batch right away, and a waiting request takes its slot at
the next step:

```
continuous batching: slots are refilled at every step
step      0  1  2  3  4  5  6  7
req 0     P  D  D                       request 0 leaves after step 2 ...
req 1     P  D  D  D  D  D  D  D
req 2     P                             ... request 2 after step 0
req 3     P  D  D  D  D
req 4     w  P  D  D  D                 ... and request 4 starts at step 1
```

Our engine loop, one iteration per step:

```
while there is work:
    admit:   arrived waiting requests take the free slots, oldest first     Scheduler.admit
    prefill: the newcomers' prompts go through the model, into their slots  -> first token each
    decode:  every request that was already running gets one more token, in ONE forward pass
    retire:  requests that emitted EOS or reached max_new_tokens leave and free their slot    Scheduler.retire
```

The decode batch mixes requests of different ages: each row is at its own position, in its own
slot. `forward_cached` was built for exactly that. A request is a small record:
"""),
locked("request", r'''
from collections import deque
from dataclasses import dataclass, field


@dataclass(eq=False)  # eq=False: two requests are the same only if they are the same object
class Request:
    rid: int                              # request id
    prompt: list[int]
    max_new_tokens: int
    arrival: int = 0                      # the engine step at which it arrives
    output: list[int] = field(default_factory=list)   # the new tokens so far
    slot: int | None = None               # its cache slot while it runs

    def __post_init__(self):
        if not self.prompt or self.max_new_tokens < 1:
            raise ValueError(f"request {self.rid}: needs a non-empty prompt and max_new_tokens >= 1")
'''),
md(r"""
## Problem 3: The scheduler (3 points)

The scheduler owns three lists. `waiting` holds the requests not yet admitted, in arrival order
(ties keep the order they were given in); `running` holds the admitted ones; `finished` the retired
ones. `free_slots` lists the cache slots nobody holds; there are `max_batch_size` slots in all.

- `admit(step)`: while there is a free slot and the **oldest** waiting request has arrived
  (`arrival <= step`), move it from `waiting` to the end of `running` and give it a free slot.
  Return the newly admitted requests, in order. Oldest first is what makes the scheduler fair:
  a request can only be overtaken by requests that arrived before it, so none waits forever.
- `retire()`: move every running request that is done (its last token is `eos_token_id`, or it has
  `max_new_tokens` tokens) from `running` to the end of `finished`, and give its slot back.
  Return the retired requests. (Careful: removing items from a list while looping over that same
  list skips elements.)

**Deliverable:** `Scheduler.admit(step)` and `Scheduler.retire()` as described.
"""),
solution("scheduler", r'''
class Scheduler:
    """First come, first served: requests enter free cache slots in arrival order and leave when done."""

    def __init__(self, requests: list[Request], max_batch_size: int, eos_token_id: int | None = None):
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        self.waiting: deque[Request] = deque(sorted(requests, key=lambda r: r.arrival))  # stable sort
        self.running: list[Request] = []
        self.finished: list[Request] = []
        self.free_slots: list[int] = list(range(max_batch_size))
        self.max_batch_size, self.eos_token_id = max_batch_size, eos_token_id

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def admit(self, step: int) -> list[Request]:
        """Arrived requests, oldest first, into free slots. Returns the newcomers."""
        ### BEGIN SOLUTION
        newcomers = []
        while self.free_slots and self.waiting and self.waiting[0].arrival <= step:
            request = self.waiting.popleft()
            request.slot = self.free_slots.pop(0)
            self.running.append(request)
            newcomers.append(request)
        return newcomers
        ### END SOLUTION

    def retire(self) -> list[Request]:
        """Done requests (EOS last, or max_new_tokens reached) leave and free their slots. Returns them."""
        ### BEGIN SOLUTION
        eos = self.eos_token_id
        done = [r for r in self.running
                if len(r.output) >= r.max_new_tokens or (eos is not None and r.output[-1:] == [eos])]
        for r in done:
            self.running.remove(r)
            self.free_slots.append(r.slot)
            self.finished.append(r)
        return done
        ### END SOLUTION
'''),
tests("scheduler_tests", 3, r"""
from course.expect import expect_int, expect_type

def requests(got, what):   # a list of Request objects, checked before it is compared
    got = expect_type(got, what, list)
    for i, r in enumerate(got):
        expect_type(r, f"{what}[{i}]", Request)
        if r.slot is not None:
            expect_int(r.slot, f"{what}[{i}].slot")
    return got

reqs = [Request(i, [1, 2], max_new_tokens=2) for i in range(3)]
sched = Scheduler(reqs, max_batch_size=2)
first = requests(sched.admit(step=0), "admit(0)")
assert [r.rid for r in first] == [0, 1], "admit the oldest requests first, as many as there are free slots"
assert sorted(r.slot for r in first) == [0, 1], "each admitted request gets its own free slot"
assert [r.rid for r in sched.waiting] == [2] and requests(sched.admit(step=1), "admit(1)") == [], "no free slot: request 2 waits"
reqs[0].output = [7, 7]                                  # request 0 has its 2 tokens
assert [r.rid for r in requests(sched.retire(), "retire()")] == [0], \
    "a request with max_new_tokens tokens is done: retire it as soon as len(output) >= max_new_tokens, not a step later"
assert [r.rid for r in sched.running] == [1], "a retired request leaves running"
third = requests(sched.admit(step=2), "admit(2)")
assert [r.rid for r in third] == [2] and third[0].slot == reqs[0].slot, "the freed slot goes to the next waiting request"
### BEGIN HIDDEN TESTS
# arrivals: nobody is admitted before arriving; ties keep the given order
reqs = [Request(i, [1], max_new_tokens=3, arrival=a) for i, a in enumerate([4, 0, 2, 0, 9])]
sched = Scheduler(reqs, max_batch_size=3)
assert [r.rid for r in requests(sched.admit(0), "admit(0)")] == [1, 3], "only arrived requests, in arrival order"
assert [r.rid for r in requests(sched.admit(1), "admit(1)")] == [], "request 2 arrives at step 2"
assert [r.rid for r in requests(sched.admit(2), "admit(2)")] == [2], "request 2 has arrived and a slot is free"
assert [r.rid for r in requests(sched.admit(5), "admit(5)")] == [], "full: request 0 must wait for a slot"
assert len({r.slot for r in sched.running}) == 3 and {r.slot for r in sched.running} <= {0, 1, 2}, \
    "three running requests, each in its own slot among 0, 1, 2"
# EOS ends a request early; without eos_token_id only the length counts; adjacent finished requests all leave
sched = Scheduler([Request(i, [1], max_new_tokens=5) for i in range(4)], max_batch_size=4, eos_token_id=9)
a, b, c, d = requests(sched.admit(0), "admit(0)")
a.output, b.output, c.output, d.output = [3, 9], [9], [3, 4], [1, 2, 3, 4, 5]
assert sorted(r.rid for r in requests(sched.retire(), "retire()")) == [0, 1, 3], "retire EOS-ended and full requests, every one of them"
assert [r.rid for r in sched.running] == [2] and sorted(sched.free_slots) == sorted({0, 1, 2, 3} - {c.slot}), \
    "retired requests give their slots back; the one still running keeps its own"
assert sorted(r.rid for r in sched.finished) == [0, 1, 3] and requests(sched.retire(), "retire()") == [], \
    "retired requests go to finished, once"
sched = Scheduler([Request(0, [1], max_new_tokens=5)], max_batch_size=1)
r0, = requests(sched.admit(0), "admit(0)")
r0.output = [9, 9]
assert requests(sched.retire(), "retire()") == [], "with eos_token_id=None only max_new_tokens ends a request"
# a long simulation: FIFO admission, never more than max_batch_size, no idle slot while someone waits, all finish
import random
rng = random.Random(0)
for B in (1, 2, 3):
    reqs = [Request(i, [1], max_new_tokens=rng.randint(1, 6), arrival=rng.randint(0, 12)) for i in range(14)]
    order = [r.rid for r in sorted(reqs, key=lambda r: r.arrival)]
    sched, admitted = Scheduler(reqs, max_batch_size=B), []
    for step in range(200):
        if not sched.has_work():
            break
        admitted += [r.rid for r in requests(sched.admit(step), f"admit({step})")]
        assert len(sched.running) <= B, "never more running requests than max_batch_size"
        assert len({r.slot for r in sched.running}) == len(sched.running), "two running requests share a slot"
        assert not (len(sched.running) < B and sched.waiting and sched.waiting[0].arrival <= step), \
            f"step {step}: a slot is free and request {sched.waiting[0].rid} has arrived, but it was not admitted"
        for r in sched.running:
            r.output.append(5)
        before = {r.rid for r in sched.running}
        gone = requests(sched.retire(), "retire()")
        assert all(len(r.output) == r.max_new_tokens for r in gone), "retire only requests that are done"
        assert all(len(r.output) < r.max_new_tokens for r in sched.running), "a finished request was left running"
        assert {r.rid for r in gone} | {r.rid for r in sched.running} == before, "a request left running without being retired"
    assert admitted == order, (f"max_batch_size={B}: admission must follow arrival order (the earliest arrival first, ties "
                               f"in the order given); you admitted {admitted}")
    assert not sched.has_work() and len(sched.finished) == len(reqs), "every request must finish"
### END HIDDEN TESTS
"""),
md(r"""
## Problem 4: One engine step (3 points)

Now the step that uses the scheduler. `engine_step(model, cache, sched, step)`:

1. `sched.admit(step)`: the newcomers. Reset each newcomer's slot (`cache.reset(slot)`) and
   **prefill** their prompts, each into its own slot. One left-padded `forward_cached` for all
   newcomers is the efficient way (your `left_pad` and `position_ids_from_mask` work unchanged);
   one call per newcomer is also correct. Each newcomer's first token comes from its last logits.
2. **Decode** all the other running requests in **one** `forward_cached`: a `(B, 1)` column of their
   latest tokens, each at its own position (`len(prompt) + len(output) - 1`), each in its own
   `slot`. Append each row's greedy token to its request's `output`.
3. `sched.retire()`.
4. Return what each request did this step: `{rid: "prefill"}` for newcomers and `{rid: "decode"}`
   for the others. The engine loop below records it for the timeline.

**Deliverable:** `engine_step(model, cache, sched, step, pad_id=0)` as described. A request's
tokens must not depend on which other requests share its batch: every request gets exactly what it
would get alone.
"""),
solution("engine_step", r'''
def engine_step(model, cache: SlotKVCache, sched: Scheduler, step: int, pad_id: int = 0) -> dict[int, str]:
    """One iteration of continuous batching: admit, prefill the newcomers, decode the others, retire."""
    dev = model.device
    ### BEGIN SOLUTION
    newcomers = sched.admit(step)
    others = [r for r in sched.running if r not in newcomers]
    if newcomers:                                   # prefill: every newcomer in one left-padded forward
        for r in newcomers:
            cache.reset(r.slot)
        input_ids, mask = left_pad([r.prompt for r in newcomers], pad_id)        # (N, T)
        slots = torch.tensor([r.slot for r in newcomers], device=dev)            # (N,)
        logits = forward_cached(model, input_ids.to(dev), position_ids_from_mask(mask).to(dev), cache, slots, mask.to(dev))
        for r, tok in zip(newcomers, logits[:, -1].argmax(dim=-1).tolist()):
            r.output.append(tok)
    if others:                                      # decode: one token for every other running request
        input_ids = torch.tensor([[r.output[-1]] for r in others], device=dev)                   # (B, 1)
        positions = torch.tensor([[len(r.prompt) + len(r.output) - 1] for r in others], device=dev)  # (B, 1)
        slots = torch.tensor([r.slot for r in others], device=dev)                                # (B,)
        logits = forward_cached(model, input_ids, positions, cache, slots)                        # (B, 1, V)
        for r, tok in zip(others, logits[:, -1].argmax(dim=-1).tolist()):
            r.output.append(tok)
    sched.retire()
    return {**{r.rid: "prefill" for r in newcomers}, **{r.rid: "decode" for r in others}}
    ### END SOLUTION
'''),
md(r"""
The two engines, ready to serve a list of requests. Both return a `Run`: the outputs (in request
order), a **trace**, and the time at the end of each step. The trace is what the batch timeline
draws: one dict per engine step, `{request id: state}`, with the states `"waiting"`, `"prefill"`,
`"decode"` and `"padding"` (a request is left out before it arrives and after it leaves).

- `continuous_generate` drives your `engine_step` until no work is left. With `graphs=True` it first
  captures the decode step in CUDA graphs, one per batch bucket (1, 2, 4, 8, ...: lab 02) over the
  cache's slots; your `engine_step` does not change: its decode call to `forward_cached` then
  replays the graph of the smallest bucket that holds the batch, padded, and its prefills run as before.
- `static_serve` is static batching as a server would run it: whenever the engine is free, it takes
  up to `max_batch_size` requests that have arrived, in arrival order, and runs them to the end with
  your `static_generate`. Its trace is rebuilt from the outputs (every row is prefilled at the batch's
  first step and decodes until it has its tokens, then pads until the batch ends), and its step
  times come from a hook on the model's last layer, which runs once per forward pass.
"""),
locked("engines", r'''
from course.engine import capture_decode_graphs
from course.timing import clock
from course.widgets.batch_timeline import timeline_stats


@dataclass
class Run:
    outputs: list[list[int]]        # new tokens per request, in the order the requests were given
    trace: list[dict[int, str]]     # trace[step][rid] = "waiting" | "prefill" | "decode" | "padding"
    times: list[float]              # seconds from the start to the end of each step

    @property
    def tokens(self) -> int:
        return sum(len(o) for o in self.outputs)

    @property
    def throughput(self) -> float:
        """Generated tokens per second."""
        return self.tokens / self.times[-1]

    def stats(self):
        """Per request: arrival, first token, finish (steps) and latency (steps and seconds)."""
        return timeline_stats(self.trace, self.times)


def _check_requests(requests):
    if not requests or len({r.rid for r in requests}) != len(requests) or any(r.output for r in requests):
        raise ValueError("requests must be fresh Request objects with distinct rids (make new ones for each run)")


def continuous_generate(model, requests: list[Request], max_batch_size: int, eos_token_id: int | None = None,
                        graphs: bool = False) -> Run:
    _check_requests(requests)
    sched = Scheduler(requests, max_batch_size, eos_token_id)
    max_len = max(len(r.prompt) for r in requests) + max(r.max_new_tokens for r in requests)
    cache = SlotKVCache(model.cfg, n_slots=max_batch_size, max_len=max_len, dtype=model.dtype, device=model.device)
    if graphs:                                  # decode steps (B, 1) replay CUDA graphs, one per batch bucket (lab 02)
        capture_decode_graphs(model, cache, max_batch_size)
    trace, times, start, step = [], [], clock(model.device), 0
    # Every step either waits for an arrival or gives a running request a token: more steps than this is a bug
    limit = max(r.arrival for r in requests) + sum(r.max_new_tokens for r in requests) + len(requests) + 1
    while sched.has_work():
        if step >= limit:
            raise RuntimeError(f"the engine ran {step} steps without finishing {len(requests)} requests: "
                               "does has_work() turn False, and does every step give running requests a token?")
        states = engine_step(model, cache, sched, step)
        states.update({r.rid: "waiting" for r in sched.waiting if r.arrival <= step})
        trace.append(states)
        times.append(clock(model.device) - start)
        step += 1
    return Run([r.output for r in requests], trace, times)


def static_serve(model, requests: list[Request], max_batch_size: int, eos_token_id: int | None = None) -> Run:
    _check_requests(requests)
    waiting = deque(sorted(requests, key=lambda r: r.arrival))
    trace, times, stamps, step = [], [], [], 0
    hook = model.lm_head.register_forward_hook(lambda *args: stamps.append(clock(model.device)))
    start = clock(model.device)
    try:
        while waiting:
            batch = []
            while waiting and waiting[0].arrival <= step and len(batch) < max_batch_size:
                batch.append(waiting.popleft())
            if not batch:                       # nothing has arrived yet: an idle step
                trace.append({})
                times.append(clock(model.device) - start)
                step += 1
                continue
            stamps.clear()
            outs = static_generate(model, [r.prompt for r in batch], [r.max_new_tokens for r in batch], eos_token_id)
            for i, stamp in enumerate(stamps):  # one engine step per forward pass of the batch
                states = {r.rid: "prefill" if i == 0 else "decode" if i < len(out) else "padding"
                          for r, out in zip(batch, outs)}
                states.update({r.rid: "waiting" for r in waiting if r.arrival <= step})
                trace.append(states)
                times.append(stamp - start)
                step += 1
            for r, out in zip(batch, outs):
                r.output = out
    finally:
        hook.remove()
    return Run([r.output for r in requests], trace, times)
'''),
code(r"""
# A small workload: 8 requests arrive over 10 steps; at most 3 run at once.
texts8 = ["The capital of France is", "Hello", "def fibonacci(n):", "My trip to Yosemite was",
          "The three primary colors are", "Water boils at", "Once upon a time", "A haiku about autumn:"]
lengths8 = [12, 3, 6, 2, 9, 4, 3, 5]
arrivals8 = [0, 0, 0, 1, 2, 4, 6, 9]
def workload8():
    return [Request(i, tokenizer(t).input_ids, n, a) for i, (t, n, a) in enumerate(zip(texts8, lengths8, arrivals8))]

static_run = static_serve(model, workload8(), max_batch_size=3)
continuous_run = continuous_generate(model, workload8(), max_batch_size=3)
for name, run in (("static", static_run), ("continuous", continuous_run)):
    print(f"{name:>10}: {len(run.trace)} steps, {run.tokens} tokens, {run.times[-1]:.2f} s")
print("same tokens from both engines:", static_run.outputs == continuous_run.outputs)
"""),
tests("engine_step_tests", 3, r"""
from course.engine import batching as course_batching   # lab 04's answers, released
from course.expect import expect_ints, expect_type, substituted

def course_parts():   # your engine_step runs on the course's scheduler and padding: Problem 4 graded on its own
    return substituted(globals(), Scheduler=course_batching.Scheduler, left_pad=course_batching.left_pad,
                       position_ids_from_mask=course_batching.position_ids_from_mask)

def checked(run):   # the outputs and each step's states, checked before they are compared
    for i, o in enumerate(run.outputs):
        expect_ints(o, f"request {i}'s output")
    for t, states in enumerate(run.trace):
        for rid, state in expect_type(states, f"step {t}: what engine_step returned (a dict rid -> state)", dict).items():
            expect_type(state, f"step {t}: the state of request {rid}", str)
    return run

with course_parts():
    run = checked(continuous_generate(model_fp32, workload8(), max_batch_size=3))
assert [len(o) for o in run.outputs] == lengths8, f"each request gets max_new_tokens tokens: expected {lengths8}, got {[len(o) for o in run.outputs]}"
def alone(prompt, n):  # the request by itself: greedy, no cache, no batch
    ids = torch.tensor([prompt], device=dev)
    with torch.no_grad():
        for _ in range(n):
            ids = torch.cat([ids, model_fp32(ids, torch.arange(ids.shape[1], device=dev)[None])[:, -1:].argmax(-1)], dim=1)
    return ids[0, len(prompt):].tolist()
for rid, (t, n) in enumerate(zip(texts8, lengths8)):
    assert run.outputs[rid] == alone(tokenizer(t).input_ids, n), \
        f"request {rid}: its tokens must not depend on who shares its batch (check slots and positions)"
assert run.trace[0] == {0: "prefill", 1: "prefill", 2: "prefill"}, "step 0: three slots, three newcomers, all prefilled"
assert run.trace[1][3] == "waiting" and run.trace[1][0] == "decode", "step 1: request 3 arrived but the batch is full"
assert 1 not in run.trace[3], "request 1 (3 tokens: steps 0, 1, 2) must have left the batch by step 3"
### BEGIN HIDDEN TESTS
""" + HIDDEN_REFERENCE + r"""
def _serve(m, reqs, B, eos=None):
    # a loop written here, so only the student's engine_step and Scheduler are under test
    for r in reqs:
        r.output, r.slot = [], None
    sched = course_batching.Scheduler(reqs, B, eos)
    cache = SlotKVCache(m.cfg, n_slots=B, max_len=40, device=m.device)
    calls, trace = [], []
    hook = m.lm_head.register_forward_hook(lambda mod, inp, out: calls.append(tuple(inp[0].shape[:2])))
    try:
        for step in range(120):
            if not sched.has_work():
                break
            calls.clear()
            running_before = {r.rid for r in sched.running}
            with course_parts():
                states = expect_type(engine_step(m, cache, sched, step), "engine_step(...)", dict)
            assert all(type(v) is str for v in states.values()) and set(states.values()) <= {"prefill", "decode"}, \
                f"states are 'prefill' or 'decode', got {states}"
            decoding = [rid for rid, s in states.items() if s == "decode"]
            assert set(decoding) == running_before, f"step {step}: decode exactly the requests running before this step"
            decode_calls = [c for c in calls if c[1] == 1 and c[0] == len(decoding)]
            if decoding:
                assert len(decode_calls) >= 1 and len(calls) <= 1 + sum(s == "prefill" for s in states.values()), \
                    f"step {step}: decode all {len(decoding)} running requests in ONE forward pass, got passes {calls}"
            trace.append(states)
        else:
            raise AssertionError("the engine never ran out of work: are finished requests retired?")
    finally:
        hook.remove()
    return trace
for family, seed in (("llama", 3), ("gpt2", 4)):
    tiny = _tiny(family, seed)
    g = torch.Generator().manual_seed(seed)
    specs = [(n, k, a) for n, k, a in zip((3, 6, 1, 4, 2, 5, 3), (7, 2, 5, 1, 9, 3, 4), (0, 0, 0, 1, 1, 3, 8))]
    reqs = [Request(i, torch.randint(1, 64, (n,), generator=g).tolist(), k, a) for i, (n, k, a) in enumerate(specs)]
    refs = [_ref_greedy(tiny, r.prompt, r.max_new_tokens) for r in reqs]
    for B in (1, 2, 3, 7):
        trace = _serve(tiny, reqs, B)
        assert [expect_ints(r.output, f"request {r.rid}'s output") for r in reqs] == refs, \
            f"{family}, max_batch_size={B}: outputs differ from each request alone"
        for r in reqs:  # one state per step from its prefill until its last token, then gone
            steps = [t for t, st in enumerate(trace) if r.rid in st]
            assert trace[steps[0]][r.rid] == "prefill" and steps == list(range(steps[0], steps[0] + r.max_new_tokens)), \
                f"{family}, B={B}: request {r.rid} must be prefilled once, then decode until done, then leave"
            assert steps[0] >= r.arrival, f"{family}, B={B}: request {r.rid} was admitted at step {steps[0]}, before it arrived"
    # EOS ends requests early, and their slots are reused
    eos = refs[0][1]
    trace = _serve(tiny, reqs, 2, eos=eos)
    want = [ref[: ref.index(eos) + 1] if eos in ref else ref for ref in refs]
    assert [r.output for r in reqs] == want, f"{family}: stop each request right after its EOS, keeping it"
    for r in reqs:
        last = max(t for t, st in enumerate(trace) if r.rid in st)
        assert len(r.output) == last - min(t for t, st in enumerate(trace) if r.rid in st) + 1, \
            f"{family}: request {r.rid} must leave the batch right after its EOS"
### END HIDDEN TESTS
"""),
md(r"""
### See it: the batch timeline

Both schedules of the small workload, from your two engines, on one step axis. Each row is a
request, each column an engine step (one forward pass of the batch; a continuous step may hold a
prefill pass as well). Under each grid, a bar per step shows how many slots were busy (red: padding)
and how many of them produced a token (dark). Move the slider to replay the schedules step by step;
hover a cell for its details.
"""),
code(r"""
from course.widgets.batch_timeline import batch_timeline

batch_timeline({"static batching": static_run.trace, "continuous batching": continuous_run.trace},
               times={"static batching": static_run.times, "continuous batching": continuous_run.times},
               title="8 requests, at most 3 at a time")
"""),
md(r"""
Read the static grid. The red cells are slots that compute tokens nobody will use, and the orange
ones are requests that have arrived but wait for the whole batch to end. In the continuous grid a
slot is refilled the step after its request leaves: there is no red at all, and the orange
stretches are shorter. The numbers at the right of each row are latencies: steps from arrival to leaving the
batch (a static request leaves with its batch: `static_generate` returns all outputs at once).

## 5. Measure: static against continuous

A workload like a server's: `n` requests arriving together, with prompts from a small set and
answer lengths drawn from a **long-tailed** distribution (most answers short, a few long, as in
real chat traffic). EOS is ignored (`eos_token_id=None`) so each request generates exactly its
drawn length, and both engines do the same useful work: every difference is scheduling. We count
**throughput** (generated tokens per second of the whole run) and **latency** per request (from its
arrival to the end of its last step, in steps and in seconds), mean and 90th percentile.
"""),
code(r"""
import numpy as np

TEXTS = ["The capital of France is", "Once upon a time, in a small village by the sea, there lived",
         "def fibonacci(n):", "The three primary colors are", "My trip to Yosemite was",
         "Explain why the sky is blue in one sentence:", "A haiku about autumn leaves:", "The quick brown fox",
         "In 1969, the first humans to walk on the Moon were", "Water boils at",
         "Here is a recipe for pancakes. Ingredients:", "The best way to learn a language is"]
n_requests, longest, B = env.pick((48, 128, 8), (8, 12, 4), cpu=(32, 64, 8))
rng = np.random.default_rng(0)
lengths = np.clip(np.round(2 + 4 * rng.pareto(1.2, n_requests)), 2, longest).astype(int).tolist()  # long tail
prompts = [tokenizer(TEXTS[i % len(TEXTS)]).input_ids for i in range(n_requests)]
def workload():
    return [Request(i, p, n) for i, (p, n) in enumerate(zip(prompts, lengths))]
print(f"{n_requests} requests, {sum(lengths)} tokens to generate; lengths: {sorted(lengths)}")

def summary(run):
    st = run.stats().values()
    steps, secs = [s.latency_steps for s in st], [s.latency_s for s in st]
    return dict(steps=len(run.trace), seconds=run.times[-1], tok_s=run.throughput,
                lat_steps=np.mean(steps), p90_steps=np.percentile(steps, 90), lat_s=np.mean(secs), p90_s=np.percentile(secs, 90),
                tpot_ms=1e3 * np.mean([s.tpot_s for s in st if s.tpot_s is not None]))  # time between a request's tokens

continuous_generate(model, workload()[:2], 2)   # warm-up
runs = {"static": static_serve(model, workload(), B), "continuous": continuous_generate(model, workload(), B)}
same = sum(a == b for a, b in zip(runs["static"].outputs, runs["continuous"].outputs))
assert same == n_requests or env.dtype != torch.float32, "in float32 both engines must generate the same tokens"
print(f"same tokens from both engines: {same}/{n_requests} requests"
      + ("" if env.dtype == torch.float32 else f" ({env.dtype}: a near-tie can part them; the tests compare in float32)"))
results = {name: summary(run) for name, run in runs.items()}
print(f"max_batch_size {B}")
print(f"{'':>11} {'steps':>6} {'seconds':>8} {'tokens/s':>9} {'mean latency':>19} {'p90 latency':>19}")
for name, r in results.items():
    print(f"{name:>11} {r['steps']:6d} {r['seconds']:8.2f} {r['tok_s']:9.1f} "
          f"{r['lat_steps']:7.1f} st {r['lat_s']:6.2f} s {r['p90_steps']:7.1f} st {r['p90_s']:6.2f} s")
s, c = results["static"], results["continuous"]
print(f"continuous vs static: {s['steps'] / c['steps']:.2f}x fewer steps, {c['tok_s'] / s['tok_s']:.2f}x the throughput, "
      f"mean latency {s['lat_s'] / c['lat_s']:.2f}x lower, p90 latency {s['p90_s'] / c['p90_s']:.2f}x lower")

def step_ms(run, with_prefill):  # mean duration of the steps that hold (or do not hold) a prefill, in ms
    ends = [0.0] + run.times
    d = [ends[t + 1] - ends[t] for t, st in enumerate(run.trace) if st and ("prefill" in st.values()) == with_prefill]
    return 1e3 * np.mean(d) if d else float("nan")
print(f"continuous steps with a prefill took {step_ms(runs['continuous'], True):.0f} ms on average, "
      f"steps with decodes only {step_ms(runs['continuous'], False):.0f} ms ({WHERE})")
record("continuous_vs_static_throughput", c["tok_s"] / s["tok_s"], "x", "continuous batching: more throughput than "
       "static batching on the same requests", device=dev, dtype=env.dtype, max_batch_size=B)
record("continuous_vs_static_mean_latency", s["lat_s"] / c["lat_s"], "x", "continuous batching: lower mean latency",
       device=dev, dtype=env.dtype, max_batch_size=B)
if env.gpu:                                      # the same engine, its decode steps replayed from CUDA graphs
    graphed = continuous_generate(model, workload(), B, graphs=True)
    gs = summary(graphed)
    print(f"continuous, decode steps in CUDA graphs: {gs['seconds']:.2f} s, {gs['tok_s']:.1f} tokens/s "
          f"({gs['tok_s'] / c['tok_s']:.1f}x eager continuous); same tokens as eager: "
          f"{sum(a == b for a, b in zip(graphed.outputs, runs['continuous'].outputs))}/{n_requests} requests")
    record("continuous_graphs_vs_eager_throughput", gs["tok_s"] / c["tok_s"], "x",
           "the continuous engine with CUDA-graph decode steps vs eager", device=dev, dtype=env.dtype, max_batch_size=B)
"""),
md(r"""
The step counts are exact (they depend only on the lengths and the schedule); the seconds carry the
noise of your machine. Two effects make up the gap. **Fewer steps**: continuous batching keeps its
slots full, so the same tokens take fewer forward passes. **Shorter waits**: a request no longer
waits for the longest request of the batch ahead of it. One cost goes the other way, and the line
"continuous steps with a prefill took ..." shows its size: a continuous step that admits a newcomer
also runs its prefill, and every running request waits for it. Static batching pays for all prefills
of a batch in one pass. (Chunked prefill, below, bounds that cost.) On a GPU the last line compares
the same continuous engine with its decode steps in CUDA graphs: the schedule is the same, and so
are the tokens, up to 16-bit near-ties (the graph pads the batch and reads the whole slot, so it
rounds differently: the line counts the requests that match). Each decode step is several times
cheaper, and the prefills, which stay eager, become a larger share of the time.

### Throughput against latency, as the batch grows

`max_batch_size` is the knob every engine exposes. A bigger batch gives more tokens per forward
pass, so throughput goes up. But every request in the batch waits for the whole step. On a CPU a
bigger step takes longer, so each user's tokens arrive more slowly: the **time per output token**
(from a request's first token to its last, divided by the gaps) goes up. On a GPU it is less simple
(section 2's decode step cost about the same at every batch size, but an engine step does more): we
read it after the sweep, from your own columns. Sweep the batch size:
"""),
code(r"""
sweep = env.pick([4, 8, 16], [2, 8], cpu=[1, 2, 4, 8])   # small batches run the slowest (serial) eager steps
curves = {"static": [], "continuous": []} | ({"continuous + CUDA graphs": []} if env.gpu else {})
engines = {"static": static_serve, "continuous": continuous_generate,
           "continuous + CUDA graphs": lambda m, w, b: continuous_generate(m, w, b, graphs=True)}
for b in sweep:
    for name in curves:
        curves[name].append(summary(engines[name](model, workload(), b)))   # every point measured here
    print(f"max_batch_size {b:>2}: " + " | ".join(
        f"{n} {curves[n][-1]['tok_s']:5.1f} tok/s, {curves[n][-1]['tpot_ms']:4.0f} ms per token, "
        f"mean latency {curves[n][-1]['lat_s']:5.2f} s" for n in curves))

fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.4))
for name, color in (("static", "C3"), ("continuous", "C0"), ("continuous + CUDA graphs", "C2")):
    if name in curves:
        ax1.plot(sweep, [r["tok_s"] for r in curves[name]], "o-", color=color, label=name)
        ax2.plot(sweep, [r["tpot_ms"] for r in curves[name]], "o-", color=color, label=name)
ax1.set_ylabel("tokens / s (all requests)"); ax1.set_title(f"Throughput: what the server gets ({WHERE})")
ax2.set_ylabel("ms between two tokens of a request"); ax2.set_title("Time per output token: what a user feels")
for ax in (ax1, ax2):
    ax.set_xscale("log", base=2); ax.set_xticks(sweep, [str(b) for b in sweep]); ax.set_xlabel("max batch size")
    ax.grid(alpha=0.3); ax.legend(); ax.set_ylim(bottom=0)
plt.tight_layout(); plt.show()
"""),
md(r"""
Left: continuous batching turns a bigger batch into more tokens per second, as long as a step grows
more slowly than the batch. Static batching gains less, and can even lose: each of its batches runs as
long as its longest request, and the bigger the batch, the likelier it holds one from the long tail.
Right: the price. On a CPU bigger steps take longer, so each user's tokens come more slowly as the
batch grows; with decode steps in CUDA graphs on a GPU, what slows a continuous engine's users is
mostly the prefills of the newcomers it admits. That is the trade-off `max_batch_size` sets, and
engines expose it because the right point depends on the service: a chat needs tokens faster than
people read, an offline job only cares about the total. Compare the two "ms per token" columns too: a
continuous step may carry a newcomer's prefill, a static step carries rows that have already finished,
and which costs more depends on your workload and machine. (The mean request latency printed above
behaves differently. All requests arrive at once, so much of their latency is queueing for a slot.
For continuous batching, more slots cut it. For static batching they may not: every request leaves
with its batch's longest member, and when one batch holds every request, each one waits for the whole
run.) On a busy machine the seconds jump around from run to run; if a curve zigzags, run the cell
again. The step counts never change.

On a GPU, set the eager curves beside section 2's sweep, where one decode step of the model cost
about the same at every batch size. An eager engine step does more than that forward pass: it runs
the newcomers' prefills, eagerly too, and the engine's own bookkeeping, on a machine where launches,
not arithmetic, set the time. Your "ms per token" columns show whether those steps grow with the
batch; where they grow as fast as the batch, the eager curves stay flat. The CUDA-graph curve replays
each decode step in one launch: it is the one that shows what a bigger batch buys, and it is where a
server would run. (In full mode the GPU sweep starts at batch 4, to keep the lab's GPU run within
2-3 minutes.)

### Against Hugging Face `generate`

`generate` does static batching: pass it a left-padded batch and it runs until every row is done.
Give it the same requests in the same batches of `B` (EOS ignored, each batch run to its longest
request), and count only the tokens each request asked for.
"""),
code(r"""
hf_model = course.load_hf_model(device=env.device, dtype=env.dtype)   # the dtype your engines run in
tokenizer.padding_side = "left"                  # the tokenizer pads for generate, on the left

def hf_static(requests, b):
    start, outputs = clock(dev), []
    for i in range(0, len(requests), b):
        batch = requests[i:i + b]
        enc = tokenizer.pad({"input_ids": [r.prompt for r in batch]}, padding=True, return_tensors="pt").to(dev)
        T, n = enc.input_ids.shape[1], max(r.max_new_tokens for r in batch)
        out = hf_model.generate(**enc, max_new_tokens=n, min_new_tokens=n, do_sample=False,   # min: ignore EOS
                                pad_token_id=tokenizer.pad_token_id)
        outputs += [row[T:T + r.max_new_tokens].tolist() for r, row in zip(batch, out)]
    return outputs, clock(dev) - start

hf_outputs, hf_seconds = hf_static(workload(), B)
hf_tok_s = sum(lengths) / hf_seconds
same = sum(a == b for a, b in zip(hf_outputs, runs["static"].outputs))
print(f"HF generate, batches of {B}: {hf_seconds:.2f} s, {hf_tok_s:.1f} tokens/s; "
      f"{same}/{n_requests} requests with exactly your tokens")
print(f"your static batching:     {results['static']['tok_s'] / hf_tok_s:.2f}x HF generate's throughput")
print(f"your continuous batching: {results['continuous']['tok_s'] / hf_tok_s:.2f}x HF generate's throughput")
"""),
md(r"""
`generate` runs the same schedule as your static engine, with a cache of its own: the same steps
over the same rows. A few requests may differ in a late token where two candidates score almost the
same and the two implementations round differently. Your two engines share the model and the forward
pass, so the lead of continuous over static is scheduling alone. `generate` runs other code (HF's
model and cache), so the gap between it and your static engine is the implementation's. With only a
few short requests, as in quick mode, `generate` can even come out ahead. Production engines add fast
attention kernels, CUDA graphs and paged memory on top; vLLM's announcement reported up to 24x the
throughput of Hugging Face transformers, much of it from fitting more requests into the same memory
(lab 05).

## Summary

- **Batching** shares each pass of the model among many requests (its weight reads on a CPU, its
  kernel launches on a GPU): a decode step for 8 requests
  costs far less than 8 steps for one (you measured it).
- **Static batching** (request-level) pads prompts on the left, masks the pads and numbers positions
  from each row's first real token, then runs the batch until its longest request ends. Finished
  requests keep their slots (padding waste) and newcomers wait for the whole batch (head-of-line blocking).
- **Continuous batching** (iteration-level, Orca) schedules at every step: retire what is done, admit
  what has arrived into the freed slots, first come first served, and decode all running requests
  in one forward pass, each at its own position in its own cache slot.
- In float32 both give every request exactly the tokens it would get alone (in 16-bit floats a
  near-tie can part a few); only time changes.
- `max_batch_size` trades latency for throughput; continuous batching moves the whole curve.
- On a GPU, a small model's eager decode step is bound by kernel launches (lab 02); engines replay
  their decode steps from CUDA graphs, one per batch bucket, and the scheduling gains above remain.

**Questions** (the workshop's "let's summarize batching", and a few more). Answer in the cell under
each group, in a few sentences of your own and with **your** numbers where a question asks for them;
a person grades them (4 points in all).
1. What are the two types of batching? What decides the batch in each, and how often?
2. What do we gain by batching? Use your measurement of one decode step at batch 1 and batch 8.
3. What do we lose? Think of the latency of each token when the batch grows, of the memory each
   request's cache slot reserves, and of the time a continuous engine spends scheduling every step
   (why do vLLM's *multi-step scheduling* and SGLang's overlapped scheduler exist?).
"""),
answer("batching_tradeoff_answer", 2, "questions 1 to 3", model=r"""
1. **Static** (request-level) batching: the batch is chosen once, from the requests that have arrived
   (up to `max_batch_size`, in arrival order), and kept until its longest request ends; it is decided
   once per batch. **Continuous** (iteration-level, Orca) batching: the scheduler decides at every
   step: finished requests leave, arrived requests take the freed slots (first come, first served),
   and all running requests decode together.
2. Throughput: one decode step serves the whole batch with one read of the weights (on a CPU) or one
   set of kernel launches (on a GPU). For example, on a CPU a step at batch 8 took a small multiple
   of batch 1's (1.5-3x), so 3-5x the tokens per second; on a GPU the eager step cost about the same
   at 1 and 8, so about 8x the tokens per second.
3. Latency per token: when the step grows with the batch (at once on a CPU; on a GPU once launches
   are gone or the batch is large), every request's tokens come more slowly, and in a continuous
   engine each newcomer's prefill stalls all running requests. Memory: each slot reserves room for
   `max_len` tokens of KV cache for the request's whole life, used or not, so fewer requests fit
   (lab 05 fixes it with pages). Static batching also wastes finished rows (padding) and makes
   newcomers wait for the longest request (head-of-line blocking). Scheduling time: a continuous
   engine runs Python at every step (admit, retire, build the inputs and positions, sample) while the
   GPU waits; at a few milliseconds per GPU step that is a real share. vLLM's multi-step scheduling
   schedules once for several decode steps, and SGLang's overlapped scheduler prepares step `t + 1`
   on the CPU while the GPU runs step `t`, to hide it.
""", rubric=r"""
- 0.5: question 1: static = fixed batch run to its longest request, decided per batch; continuous =
  membership decided at every step (retire, admit FCFS).
- 0.5: question 2: the gain (throughput from shared weight reads or launches), argued with the
  student's own batch-1 and batch-8 step times (their ratio against 8).
- 1: question 3: per-token latency grows with the step (0.25), slot memory reserved for max_len
  (0.25), padding / head-of-line blocking or prefill stalls (0.25), per-step scheduling overhead and
  why multi-step or overlapped scheduling hides it (0.25).
"""),
md(r"""
4. Why pad on the left? What would `logits[:, -1]` mean for a right-padded row?
5. Your measurement showed that positions counted over the pads barely change SmolLM2's logits.
   Why, and why do engines compute them from the mask anyway?
"""),
answer("padding_positions_answer", 1, "questions 4 and 5", model=r"""
4. With left padding every row's newest token is in the last column, so `logits[:, -1]` is every
   row's next-token prediction and each decode step appends one column to all rows alike. For a
   right-padded row, `logits[:, -1]` is the model's output at a pad position: a prediction after a
   pad, meaningless for the request. Its real prediction sits at column `len(prompt) - 1`, and its
   next token would have to be written into the middle of the rectangle.
5. SmolLM2 uses RoPE: a query and a key interact through the difference of their positions. Counting
   over the pads shifts every real token of the row by the same constant (the number of pads), so
   every difference, and every score, is unchanged up to rounding. Engines compute positions from
   the mask anyway because not every model is relative: GPT-2's learned absolute positions (your
   random GPT-2-style check changed a lot) and other absolute schemes change with the shift; a row's
   tokens must not depend on who shares its batch (the same tokens as alone, even at a near-tie);
   the shifted positions can pass the model's trained or supported length (`max_seq_len`); and later
   decode steps need the true position (the number of real tokens) for each new token.
""", rubric=r"""
- 0.5: question 4: the last column holds every row's newest token; for a right-padded row the last
  logits are the output at a pad (meaningless), its real one is at its last real token.
- 0.5: question 5: a constant shift keeps RoPE's relative distances; one good reason to use the mask
  anyway (absolute-position models such as GPT-2, batch invariance, length limits, correct positions
  for decode).
"""),
md(r"""
6. In your timeline, a prefill step of a newcomer delays the tokens of every running request. How
   could an engine bound that delay? (Hint: Sarathi-Serve.)
7. Change the scheduler to admit the *shortest* waiting request first. What happens to the mean
   latency, and what can happen to a long request under a steady stream of short ones?
"""),
answer("prefill_stall_order_answer", 1, "questions 6 and 7", model=r"""
6. Chunked prefill (Sarathi-Serve's stall-free batching): give every step a token budget (vLLM's
   `max_num_batched_tokens`), put the running decodes in first, and fill the rest with a **chunk**
   of the newcomer's prompt; a long prompt is prefilled over several steps, each in the same pass as
   the decodes. No step is longer than the budget allows, so the running requests' inter-token
   latency is bounded; the price is a later first token for the newcomer, and a little throughput.
   (Other ways: limit the prefills per step, or run prefills on other GPUs: disaggregation, lab 12.)
7. Shortest first is shortest-job-first: short requests no longer wait behind long ones, so the mean
   latency (and mean waiting time) goes down. But a long request can be overtaken again and again:
   under a steady stream of short requests it may wait without bound (starvation). First come, first
   served can only be overtaken by requests that arrived earlier, so none waits forever. A fix keeps
   some fairness: aging (a waiting request's priority grows with its wait), or a cap on how often a
   request may be passed.
""", rubric=r"""
- 0.5: question 6: chunked prefill with a per-step token budget, decodes riding in the same step (or
  another bounding mechanism, explained), and its cost (the newcomer's TTFT).
- 0.5: question 7: mean latency falls (SJF), long requests can starve under a stream of short ones;
  a remedy (aging) is a plus.
"""),
md(r"""

## Going further

- **Orca** (Yu et al., OSDI 2022) introduced iteration-level scheduling, and *selective batching*:
  the matrix multiplies of all requests run as one batch of tokens, while attention runs per request.
  That removes padding even inside a step.
- **vLLM**'s scheduler gives each step a token budget (`max_num_batched_tokens`) and a sequence
  budget (`max_num_seqs`), fills it with decodes and (chunks of) prefills, and **preempts** requests
  when the KV cache runs out of blocks, recomputing them later.
- **nano-vllm**'s `engine/scheduler.py` is the same idea in under 100 lines: a waiting and a running
  deque, prefill-first steps under a token budget, and preemption when no block is free. Compare it
  with your `Scheduler`.
- **SGLang** overlaps the CPU work of scheduling the next step with the GPU work of the current one,
  and orders waiting requests to reuse cached prefixes (lab 09).
- **TGI**'s router (Rust) batches continuously under `max_batch_total_tokens`, and decides when to
  pause decodes to prefill newcomers with `waiting_served_ratio` and `max_waiting_tokens`.
- **Sarathi-Serve** (Agrawal et al., OSDI 2024) splits long prompts into chunks that ride along with
  decode steps (*chunked prefill*), so a newcomer never stalls the running requests for long.
"""),
]

write_notebook("labs/04_batching/04_batching.ipynb", cells + [md(CHECK_YOUR_WORK)])
print("wrote labs/04_batching/04_batching.ipynb")
