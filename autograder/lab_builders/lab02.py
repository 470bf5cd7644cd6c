"""Builds the lab 02 source notebook. Edit this file, then run from the repo root:

    .venv/bin/python -m autograder.lab_builders.lab02
"""
from autograder.authoring import answer, code, locked, md, solution, tests, write_notebook  # noqa: E402

from autograder.lab_builders.common_cells import CHECK_YOUR_WORK, COLAB_INSTALL as INSTALL  # noqa: E402
from autograder.lab_builders.lab02_graphs import GRAPH_CELLS  # noqa: E402

cells = []
add = cells.append

# =============================================================================================
add(md(r'''
# Lab 02: Prefill and decode

Every request to a language model runs in two phases. **Prefill** pushes the whole prompt through
the model in one forward pass and produces the first new token. **Decode** produces every later
token, one forward pass per token. The two phases load the hardware in opposite ways: prefill gives
the arithmetic units many FLOPs for each byte it reads, while decode gives them two per weight and
spends its time waiting for the weights to arrive from memory. Nearly every trick of an inference engine (the KV cache, batching, chunked prefill,
running the two phases on separate GPUs) follows from this one asymmetry. In this lab you count
it, measure it, and see it on a plot of your own machine. Then you find the limit the count leaves
out: on a GPU, a small model's decode step is a thousand tiny kernels, and launching them one by
one can cost far more than running them. Engines capture the step in a **CUDA graph**; so will you.

**You will**
- count the FLOPs and the bytes of one forward pass, for prefill and for decode, and divide them: *arithmetic intensity*;
- place both phases on the *roofline* of this machine, in the dtype the model runs in, and see why batching helps decode;
- profile one decode step (how many ops or kernels, how long the device computes, how long it waits), and capture it in a CUDA graph (a CPU stand-in with the same rules where there is no GPU);
- write a streaming generator and measure what a user feels: time to first token, time per output token, throughput;
- budget memory: weights, KV cache and activations, and find when the cache outgrows the model.

**Time:** about 2 hours 25 minutes: 35 minutes of reading, four problems (the FLOP and byte count
about 30 minutes, the graph 20, the streaming generator and its metrics 25, the memory budget 15),
25 minutes for the written questions at the end, and about a minute of running on a laptop CPU (54 s
measured on 2 cores; about 1-1.5 minutes on a GPU). **Hardware:** everything
runs on a CPU. On a GPU the same cells use it, with the model in bf16 (fp16 on a T4), the roofline
from the GPU's datasheet for that dtype, and two measurements only a GPU can make (real CUDA graphs,
`torch.compile`). Timings depend on your machine and on what else runs on it: read your own
numbers, not ours.
'''))

add(locked("colab_install", INSTALL))
add(locked("setup", "import course\nenv = course.setup()"))

add(md(r'''
## 1. The model, and two ways to run it

The same model as in lab 01: SmolLM2-135M in our from-scratch decoder (`model`) and in Hugging Face
`transformers` (`hf_model`), both in `env.dtype`: float32 on a CPU, bfloat16 on a GPU (float16 on a
GPU without bf16). Every timing and every roofline below names that dtype: a datacenter GPU (A100,
H100) does about 15x more bf16 arithmetic per second than fp32, a smaller one 2-8x (section 2 lists
them). Our decoder has no KV cache yet (lab 03 adds it): every call
recomputes the whole sequence it is given. `make_prompt(n)` builds a prompt of exactly `n` tokens
from a paragraph of text.
'''))

add(locked("load", r'''
import math
import matplotlib.pyplot as plt
import numpy as np
import torch
from course.timing import TokenTimer, benchmark, clock

tokenizer = course.load_tokenizer()
model = course.load_model(device=env.device, dtype=env.dtype)        # from scratch, no KV cache
hf_model = course.load_hf_model(device=env.device, dtype=env.dtype)  # transformers, with a KV cache in generate()
cfg = model.cfg
BYTES = torch.finfo(env.dtype).bits // 8                            # bytes per weight: 4 in fp32, 2 in bf16/fp16
DTYPE = str(env.dtype).removeprefix("torch.")                        # "float32", "bfloat16", ...
WHERE = f"{env.device}, {DTYPE}"                                      # every timing says where it ran

TEXT = ("Inference engines serve language models to many users at once. A request arrives with a prompt, "
        "the engine reads the prompt, and then it writes the answer one token at a time until it is done. ")


def make_prompt(n_tokens: int) -> torch.Tensor:
    """A (1, n_tokens) prompt: TEXT repeated as often as needed, cut to length."""
    ids = tokenizer(TEXT, return_tensors="pt").input_ids
    ids = ids.repeat(1, -(-n_tokens // ids.shape[1]))[:, :n_tokens]
    return ids.to(env.device)


def positions(n_tokens: int) -> torch.Tensor:
    """Position ids 0 .. n_tokens-1, shape (1, n_tokens)."""
    return torch.arange(n_tokens, device=env.device)[None]


n_params = model.num_parameters()
print(f"{n_params / 1e6:.1f} M parameters = {n_params * BYTES / 1e6:.0f} MB in {DTYPE}; {cfg.n_layer} layers, "
      f"d_model {cfg.d_model}, {cfg.n_head} query heads sharing {cfg.n_kv_head} KV heads (head_dim {cfg.head_dim}), "
      f"d_ff {cfg.d_ff}, vocabulary {cfg.vocab_size:,}")
'''))

add(md(r'''
One request, drawn along time. Prefill is one forward pass over all $T$ prompt tokens; it ends with
the first new token. Each decode step is one forward pass that yields one more token.

```
 time ───────────────────────────────────────────────────────────────────────────▶
 │◀──────────── prefill ─────────────▶│◀── decode ──▶│◀── decode ──▶│◀── decode ──▶│
 │ one forward over all T prompt      │ one forward, │ one forward, │ one forward, │
 │ tokens at once                     │ one token    │ one token    │ one token    │
                                      ▲              ▲              ▲              ▲
 request starts                    token 1        token 2        token 3        token 4
 │◀───── time to first token ────────▶│◀─ between ──▶│
                                         tokens
```

### Measure first: one big forward against one small one

We time a forward pass over a prompt of `P` tokens and a forward pass over a single token, and
divide each by the tokens it processed. A decode step is the second kind: one new token per pass.
(With a KV cache a decode step also reads the cached keys and values of the earlier tokens;
Problem 1 shows that this is small next to the weights at these lengths.)
'''))

add(code(r'''
P = env.pick(256, 64)                # prompt length for this lab's measurements (smaller in quick mode)
repeats = env.pick(5, 3)
prompt = make_prompt(P)              # (1, P)

t_prefill = benchmark(lambda: model(prompt, positions(P)), warmup=1, repeats=repeats, device=env.device).median
t_step = benchmark(lambda: model(prompt[:, :1], positions(1)), warmup=1, repeats=repeats, device=env.device).median

print(f"on {WHERE}:")
print(f"one forward over {P} tokens: {t_prefill * 1e3:8.1f} ms = {t_prefill / P * 1e3:7.2f} ms per token")
print(f"one forward over   1 token : {t_step * 1e3:8.1f} ms = {t_step * 1e3:7.2f} ms per token")
print(f"per token, the {P}-token forward is {t_step / (t_prefill / P):.0f}x cheaper, "
      f"though it does {P}x the arithmetic for {t_prefill / t_step:.1f}x the time")
'''))

add(md(r'''
Why is a token so much cheaper in a big forward pass? To process a token, the model multiplies it
by every weight matrix, so every weight must travel from memory to the arithmetic units. In the big
forward pass each weight makes that trip once and is then used for all `P` tokens. In the one-token
pass each weight makes the same trip to be used once: two FLOPs (a multiply and an add) per weight.
Decode produces one token per pass, so it always pays that second price. (That is the story on a
CPU. On a GPU the two passes may take nearly the same time for a reason that has nothing to do
with weights: section 3 finds it.)

"Compute is cheap, moving bytes is expensive" is only a slogan until you count. Let's count.

## Problem 1: FLOPs and bytes of one forward pass (4 points)

A forward pass processes `n_new` new tokens per sequence, for `batch` sequences, while `n_past`
earlier tokens per sequence sit in a KV cache. Prefill of a $T$-token prompt is `n_new = T, n_past = 0`;
a decode step at context length $L$ is `n_new = 1, n_past = L`.

**Count FLOPs like this** (one multiply plus one add = 2 FLOPs):
- **Linear layers.** Multiplying one token's vector by a $k \times m$ weight matrix costs $2km$ FLOPs.
  Per layer: `q_proj` maps `d_model` to `n_head * head_dim`; `k_proj` and `v_proj` map `d_model` to
  `n_kv_head * head_dim` (with grouped-query attention, GQA, they are smaller: SmolLM2 has 9 query
  heads but only 3 key/value heads); `o_proj` maps `n_head * head_dim` back to `d_model`; the MLP has three
  `d_model`-by-`d_ff` matrices in the Llama family (gate, up, down) and two in the GPT-2 family
  (`cfg.family == "gpt2"`). After the last layer, the `lm_head` maps `d_model` to `vocab_size`.
- **Attention.** For each query head and each position a token attends to: a dot product of length
  `head_dim` for the score, and adding `head_dim` values weighted by it: $4 \cdot$ `head_dim` FLOPs.
  It uses the **query** heads: GQA shares K and V between heads, it does not skip work.
  Attention is causal, and we count exactly: new token $i$ ($i = 0, \dots,$ `n_new`$-1$) attends to
  `n_past` $+ i + 1$ positions (every cached token, the new tokens before it, and itself).
- **Ignore** the rest: norms, RoPE, softmax, activations, residual adds and the embedding lookup
  cost $O(\text{d\_model})$ per token against $O(\text{d\_model}^2)$ for the matmuls.

**Count bytes moved to and from memory like this:**
- **Weights:** every weight matrix above is read **once per forward pass**, whatever `n_new` and
  `batch` are: that is the whole point of processing many tokens at once. `bytes_per_param` each.
- **KV cache:** each sequence reads the K and V vectors of its `n_past` cached tokens, in every layer
  (`n_kv_head * head_dim` numbers each for K and V), and writes those of its `n_new` new tokens.
  `bytes_per_kv` each.
- **Ignore** activations (they are small for decode, and a fused engine keeps most of them on chip),
  norm weights, biases and the embedding rows looked up.

**Deliverable:** `forward_cost(cfg, n_new, n_past=0, *, batch=1, bytes_per_param=4, bytes_per_kv=4)`
returns `{"flops": ..., "bytes": ..., "intensity": flops / bytes}`. Raise `ValueError` if `n_new < 1`,
`n_past < 0`, `batch < 1` or a byte size is not positive. Use `cfg.n_layer, cfg.n_head, cfg.n_kv_head,
cfg.head_dim, cfg.d_model, cfg.d_ff, cfg.vocab_size, cfg.family`.
'''))

add(solution("forward_cost", r'''
def forward_cost(cfg, n_new: int, n_past: int = 0, *, batch: int = 1,
                 bytes_per_param: float = 4, bytes_per_kv: float = 4) -> dict:
    """FLOPs and bytes moved by one forward pass over n_new new tokens per sequence, with n_past
    tokens per sequence already in the KV cache, for `batch` sequences."""
    ### BEGIN SOLUTION
    if n_new < 1 or n_past < 0 or batch < 1:
        raise ValueError(f"need n_new >= 1, n_past >= 0, batch >= 1; got n_new={n_new}, n_past={n_past}, batch={batch}")
    if not (bytes_per_param > 0 and bytes_per_kv > 0):
        raise ValueError(f"byte sizes must be > 0, got bytes_per_param={bytes_per_param}, bytes_per_kv={bytes_per_kv}")
    d, L = cfg.d_model, cfg.n_layer
    q_dim = cfg.n_head * cfg.head_dim            # width of all query heads together
    kv_dim = cfg.n_kv_head * cfg.head_dim        # width of all key (or value) heads: smaller with GQA
    n_mlp = 3 if cfg.family == "llama" else 2    # gate, up, down | fc, proj
    per_layer = d * q_dim + 2 * d * kv_dim + q_dim * d + n_mlp * d * cfg.d_ff
    matmul_params = L * per_layer + d * cfg.vocab_size   # + lm_head

    # token i of the new ones attends to n_past + i + 1 positions: sum over i
    attended = n_new * n_past + n_new * (n_new + 1) // 2
    flops = batch * (2 * matmul_params * n_new + 4 * L * q_dim * attended)

    kv_bytes_per_token = 2 * L * kv_dim * bytes_per_kv          # K and V, every layer
    weight_bytes = matmul_params * bytes_per_param              # once per forward, shared by the batch
    kv_bytes = batch * kv_bytes_per_token * (n_past + n_new)    # read the cache, write the new tokens
    total = weight_bytes + kv_bytes
    return {"flops": flops, "bytes": total, "intensity": flops / total}
    ### END SOLUTION
'''))

add(md(r'''
The tests below check your counts on SmolLM2 and, hidden, on other shapes: GPT-2 (every head has its
own K and V: multi-head attention), Llama-3-8B (GQA, 4 query heads per KV head), a model with a single
KV head (multi-query attention), and a tiny model with a long prompt, where attention dominates.
'''))

add(tests("forward_cost_flops", 2, r'''
from course.expect import expect_float, expect_type

def cost(*args, **kwargs):   # forward_cost(...), its answer checked before it is compared
    out = expect_type(forward_cost(*args, **kwargs), "forward_cost(...)", dict)
    assert {"flops", "bytes", "intensity"} <= set(out), \
        f"forward_cost must return a dict with 'flops', 'bytes' and 'intensity'; got keys {sorted(map(str, out))}"
    return {k: expect_float(out[k], f"forward_cost(...)[{k!r}]") for k in ("flops", "bytes", "intensity")}

pre = cost(cfg, n_new=16, n_past=0)
rule = 2 * model.num_parameters() * 16
assert abs(pre["flops"] / rule - 1) < 0.01, \
    f"for a short prompt FLOPs are about 2 x parameters x tokens = {rule:.4g}; you have {pre['flops']:.4g}"
dec0, dec4k = cost(cfg, 1, 0), cost(cfg, 1, 4096)
assert dec4k["flops"] > dec0["flops"] * 1.5, "a decode step at context 4096 also attends over 4096 cached tokens: count attention"
assert abs(cost(cfg, 1, 100, batch=4)["flops"] / cost(cfg, 1, 100)["flops"] - 4) < 1e-9, "FLOPs scale with the batch"
### BEGIN HIDDEN TESTS
_C = type(cfg)
_cfgs = {
    "smollm2": cfg,
    "gpt2": _C(family="gpt2", vocab_size=50257, n_layer=12, n_head=12, n_kv_head=12, d_model=768, d_ff=3072, max_seq_len=1024),
    "llama3-8b": _C(family="llama", vocab_size=128256, n_layer=32, n_head=32, n_kv_head=8, d_model=4096, d_ff=14336,
                    max_seq_len=8192, tie_embeddings=False),
    "mqa": _C(family="llama", vocab_size=32000, n_layer=24, n_head=16, n_kv_head=1, d_model=2048, d_ff=8192,
              max_seq_len=4096, tie_embeddings=False),
    "tiny": _C(family="llama", vocab_size=64, n_layer=2, n_head=4, n_kv_head=2, d_model=32, d_ff=64, max_seq_len=4096),
}


def _ref_flops(c, n_new, n_past, batch):
    d, hd, nl = c.d_model, c.d_model // c.n_head, c.n_layer
    mats = nl * (2 * d * c.n_head * hd + 2 * d * c.n_kv_head * hd + (3 if c.family == "llama" else 2) * d * c.d_ff) \
        + d * c.vocab_size
    seen = sum(n_past + i + 1 for i in range(n_new))
    return batch * (2 * mats * n_new + 4 * nl * c.n_head * hd * seen)


# In order: the linear layers alone (one token, nothing cached), then attention over a long cache, then
# causal prompts, then batches. The first check that fails names the likely mistake.
for stage, cases, why in [
    ("linear layers", [(n, 1, 0, 1) for n in _cfgs],
     "2 FLOPs per weight per token; k_proj/v_proj are d_model x (n_kv_head * head_dim); "
     "3 MLP matrices for Llama, 2 for GPT-2; count the lm_head"),
    ("attention over the cache", [("gpt2", 1, 1023, 1), ("llama3-8b", 1, 8191, 1), ("mqa", 1, 4000, 1), ("smollm2", 1, 256, 1)],
     "attention costs 4 * head_dim FLOPs per QUERY head (n_head, not n_kv_head) per attended position, in every layer"),
    ("causal prompts", [("tiny", 1024, 0, 1), ("tiny", 7, 5, 1), ("mqa", 100, 3000, 1), ("gpt2", 1024, 0, 1),
                        ("smollm2", 256, 0, 1), ("llama3-8b", 2048, 0, 1)],
     "new token i attends to n_past + i + 1 positions (not to all n_past + n_new); linear FLOPs scale with n_new; "
     "count only matmul FLOPs (no softmax, norms or activations)"),
    ("batches", [("llama3-8b", 1, 8191, 16), ("mqa", 1, 4000, 64), ("tiny", 7, 5, 3), ("mqa", 100, 3000, 2)],
     "every sequence of the batch does the same work"),
]:
    for name, n_new, n_past, batch in cases:
        got = cost(_cfgs[name], n_new, n_past, batch=batch)["flops"]
        ref = _ref_flops(_cfgs[name], n_new, n_past, batch)
        assert abs(got / ref - 1) < 0.01, (f"{stage}: {name}, n_new={n_new}, n_past={n_past}, batch={batch}: "
                                           f"your FLOPs, {got:.4g}, are too {'high' if got > ref else 'low'}. Check: {why}")
for bad in [dict(n_new=0), dict(n_new=1, n_past=-1), dict(n_new=1, batch=0)]:
    try:
        forward_cost(cfg, **bad)
    except ValueError:
        pass
    else:
        raise AssertionError(f"forward_cost(cfg, **{bad}) must raise ValueError")
### END HIDDEN TESTS
'''))

add(tests("forward_cost_bytes", 2, r'''
from course.expect import expect_float, expect_type

def cost(*args, **kwargs):   # forward_cost(...), its answer checked before it is compared
    out = expect_type(forward_cost(*args, **kwargs), "forward_cost(...)", dict)
    assert {"flops", "bytes", "intensity"} <= set(out), \
        f"forward_cost must return a dict with 'flops', 'bytes' and 'intensity'; got keys {sorted(map(str, out))}"
    return {k: expect_float(out[k], f"forward_cost(...)[{k!r}]") for k in ("flops", "bytes", "intensity")}

dec = cost(cfg, n_new=1, n_past=256)                   # a decode step, fp32, batch 1
pre = cost(cfg, n_new=256, n_past=0)                   # prefill of 256 tokens
weights_fp32 = 4 * model.num_parameters()
assert abs(cost(cfg, 1, 0)["bytes"] / weights_fp32 - 1) < 0.01, \
    f"one token, no cache: the bytes are the weights, about 4 x parameters = {weights_fp32:.4g}"
assert abs(pre["bytes"] / weights_fp32 - 1) < 0.05, "prefill reads each weight ONCE for all its tokens, not once per token"
assert 0.3 < dec["intensity"] < 1.0, f"decode at batch 1 in fp32 does about 0.5 FLOP per byte; you have {dec['intensity']:.3g}"
assert pre["intensity"] > 50 * dec["intensity"], "prefill reuses every weight for all 256 tokens: its intensity is far higher"
assert abs(pre["intensity"] - pre["flops"] / pre["bytes"]) < 1e-9 * pre["intensity"], "intensity = flops / bytes"
### BEGIN HIDDEN TESTS
_C = type(cfg)
_cfgs = {
    "smollm2": cfg,
    "gpt2": _C(family="gpt2", vocab_size=50257, n_layer=12, n_head=12, n_kv_head=12, d_model=768, d_ff=3072, max_seq_len=1024),
    "llama3-8b": _C(family="llama", vocab_size=128256, n_layer=32, n_head=32, n_kv_head=8, d_model=4096, d_ff=14336,
                    max_seq_len=8192, tie_embeddings=False),
    "mqa": _C(family="llama", vocab_size=32000, n_layer=24, n_head=16, n_kv_head=1, d_model=2048, d_ff=8192,
              max_seq_len=4096, tie_embeddings=False),
    "tiny": _C(family="llama", vocab_size=64, n_layer=2, n_head=4, n_kv_head=2, d_model=32, d_ff=64, max_seq_len=4096),
}


def _ref_bytes(c, n_new, n_past, batch, bp, bk):
    d, hd, nl = c.d_model, c.d_model // c.n_head, c.n_layer
    mats = nl * (2 * d * c.n_head * hd + 2 * d * c.n_kv_head * hd + (3 if c.family == "llama" else 2) * d * c.d_ff) \
        + d * c.vocab_size
    return mats * bp + batch * 2 * nl * c.n_kv_head * hd * bk * (n_past + n_new)


# In order: weights alone, then prefills, then reads of the cache, then batches and byte sizes.
for stage, cases, why in [
    ("weights", [(n, 1, 0, 1, 4, 4) for n in _cfgs] + [(n, 1, 0, 1, 2, 4) for n in _cfgs],
     "every weight matrix (GQA-sized k/v, the lm_head) once, bytes_per_param each"),
    ("prefill", [("smollm2", 256, 0, 1, 4, 4), ("gpt2", 1024, 0, 1, 4, 4), ("llama3-8b", 2048, 0, 1, 2, 2), ("tiny", 1024, 0, 1, 4, 4)],
     "weights are read ONCE per forward pass, not once per token; the new tokens' K and V are written once"),
    ("reading the cache", [("gpt2", 1, 1023, 1, 2, 2), ("llama3-8b", 1, 8191, 1, 2, 2), ("mqa", 1, 4000, 1, 2, 2),
                           ("mqa", 100, 3000, 1, 2, 2), ("tiny", 7, 5, 1, 4, 4)],
     "each sequence reads the K and V of its n_past cached tokens (2 x n_layer x n_kv_head x head_dim numbers per token)"),
    ("batches and byte sizes", [("llama3-8b", 1, 8191, 16, 2, 2), ("mqa", 1, 4000, 64, 2, 2), ("tiny", 7, 5, 3, 4, 4),
                                ("llama3-8b", 2048, 0, 1, 2, 1), ("mqa", 100, 3000, 2, 1, 2), ("smollm2", 1, 4096, 32, 2, 1)],
     "the batch shares one read of the weights but each sequence has its own cache; K/V use bytes_per_kv, weights bytes_per_param"),
]:
    for name, n_new, n_past, batch, bp, bk in cases:
        got = cost(_cfgs[name], n_new, n_past, batch=batch, bytes_per_param=bp, bytes_per_kv=bk)
        ref = _ref_bytes(_cfgs[name], n_new, n_past, batch, bp, bk)
        assert abs(got["bytes"] / ref - 1) < 0.01, (
            f"{stage}: {name}, n_new={n_new}, n_past={n_past}, batch={batch}, bytes_per_param={bp}, bytes_per_kv={bk}: "
            f"your bytes, {got['bytes']:.4g}, are too {'high' if got['bytes'] > ref else 'low'}. Check: {why}")
        assert abs(got["intensity"] * got["bytes"] / got["flops"] - 1) < 1e-9, "intensity = flops / bytes"
# the batch shares the weights, not the KV cache
c = _cfgs["llama3-8b"]
one, eight = (cost(c, 1, 1000, batch=b, bytes_per_param=2, bytes_per_kv=2)["bytes"] for b in (1, 8))
kv_one_seq = 2 * c.n_layer * c.n_kv_head * c.head_dim * 2 * 1001
assert abs((eight - one) / (7 * kv_one_seq) - 1) < 1e-6, "a batch of 8 reads the weights once but 8 KV caches"
for bad in [dict(n_new=1, bytes_per_param=0), dict(n_new=1, bytes_per_kv=-2)]:
    try:
        forward_cost(cfg, **bad)
    except ValueError:
        pass
    else:
        raise AssertionError(f"forward_cost(cfg, **{bad}) must raise ValueError")
### END HIDDEN TESTS
'''))

add(md(r'''
### What your counts say

Your function, on SmolLM2 (fp32, as a CPU runs it, and fp16, as a GPU or a server runs it) and on Llama-2-7B in
fp16. Look at three columns: how many FLOPs each phase does per byte it moves, and how that changes
(or does not) with the model and the precision.
'''))

add(code(r'''
llama2_7b = course.ModelConfig(family="llama", vocab_size=32000, n_layer=32, n_head=32, n_kv_head=32,
                               d_model=4096, d_ff=11008, max_seq_len=4096, tie_embeddings=False)
rows = [("SmolLM2-135M fp32", cfg, 4), ("SmolLM2-135M fp16", cfg, 2), ("Llama-2-7B fp16", llama2_7b, 2)]
print(f"{'model':18} {'phase':22} {'GFLOP':>9} {'MB moved':>9} {'FLOP/byte':>10}")
for label, c, nbytes in rows:
    for phase, n_new, n_past in ((f"prefill {P} tokens", P, 0), (f"decode at context {P}", 1, P)):
        cost = forward_cost(c, n_new, n_past, bytes_per_param=nbytes, bytes_per_kv=nbytes)
        print(f"{label:18} {phase:22} {cost['flops'] / 1e9:9.2f} {cost['bytes'] / 1e6:9.0f} {cost['intensity']:10.2f}")
'''))

add(md(r'''
Decode at batch 1 does about **2 FLOPs per weight while moving `bytes_per_param` bytes per weight**:
its intensity is about $2 / \text{bytes\_per\_param}$, for a 135 M model as for a 7 B one. Prefill
reuses each weight for every prompt token, so its intensity grows with the prompt length.

## 2. The roofline: which limit does each phase hit?

A processor has two speed limits: how many FLOPs per second its arithmetic units can do
(`peak.flops`) and how many bytes per second its memory can deliver (`peak.bytes_per_s`). A pass that
does $F$ FLOPs and moves $B$ bytes takes at least

$$t \;\ge\; \max\!\left(\frac{F}{\text{peak FLOP/s}},\; \frac{B}{\text{bandwidth}}\right),
\qquad\text{so it reaches at most}\qquad
\min\!\left(\text{peak FLOP/s},\; \text{bandwidth} \times \frac{F}{B}\right)\ \text{FLOP/s}.$$

Plot that bound against the intensity $F/B$ on log axes and you get a roof: a slope (memory-bound),
then a flat top (compute-bound). They meet at the **ridge point**, peak FLOP/s ÷ bandwidth. A
workload left of the ridge cannot use all the compute, however good its code.

`course.hardware.device_peak(env)` gives the two limits of this machine. On a CPU it measures them
(a large fp32 matmul, a large memory copy); on a GPU in its table (`course.hardware.GPUS`) it reads
the datasheet, and on any other GPU it measures them too. We place your prefill and decode points on
the roof, at the FLOP/s they **achieved** in the timings above: your FLOP count divided by the
measured time.
'''))

add(code(r'''
from course.hardware import GPUS, device_peak, plot_roofline

peak = device_peak(env, env.dtype)    # the ceilings for the dtype the model runs in (fp32 on a CPU)
print(peak)

prefill_cost = forward_cost(cfg, n_new=P, n_past=0, bytes_per_param=BYTES, bytes_per_kv=BYTES)
step_cost = forward_cost(cfg, n_new=1, n_past=0, bytes_per_param=BYTES, bytes_per_kv=BYTES)  # what we timed
bound = {}
for name, cost, seconds in (("prefill", prefill_cost, t_prefill), ("decode step", step_cost, t_step)):
    bound[name] = max(cost["flops"] / peak.flops, cost["bytes"] / peak.bytes_per_s)
    limit = "compute" if cost["intensity"] > peak.ridge else "memory"
    print(f"{name:12} intensity {cost['intensity']:7.2f} FLOP/B -> {limit}-bound here; roofline bound "
          f"{bound[name] * 1e3:7.2f} ms, measured {seconds * 1e3:7.1f} ms ({seconds / bound[name]:.1f}x the bound); "
          f"achieved {cost['flops'] / seconds / 1e9:6.1f} GFLOP/s")

ax = plot_roofline(peak, {
    f"prefill ({P} tokens)": (prefill_cost["intensity"], prefill_cost["flops"] / t_prefill),
    "decode step (1 token)": (step_cost["intensity"], step_cost["flops"] / t_step),
})
ax.set_title(f"SmolLM2-135M on {WHERE}: where each phase sits", fontsize=10)
plt.show()
'''))

add(md(r'''
Read the plot. Decode sits far left of the ridge: even perfect code could only reach bandwidth ×
intensity FLOP/s there, a small fraction of the peak, because each weight that arrives feeds just
2 FLOPs. Prefill sits to the right of decode by about the prompt length; on a CPU that is right of
the ridge, where the arithmetic is the limit (a GPU's ridge is much higher: see below). (The measured ceilings are
what a plain matmul and a plain copy achieve; a busy machine lowers both. The "x the bound" you
printed says how close each phase came.)

Now read how far below its roof your decode step landed: the "x the bound" you printed. On a CPU it
is typically a small factor: the roofline explains most of the step. On a GPU the bound for this
model is a fraction of a millisecond (its weights over the memory bandwidth), and the measured step
can be a hundred times that or more. A roof that is off by a factor of a hundred leaves something
out. Section 3 finds what.

### The same phases on datacenter GPUs

GPUs have far more compute than bandwidth: in fp16 their ridge points are in the hundreds of FLOP/byte. Here
are the datasheet figures (dense, no sparsity), and where Llama-2-7B in fp16 would sit on an H100
(the A100's roof is drawn below it). Hollow dots sit on the roof: the best each pass could reach.
Notice that on such a GPU even a short prefill is memory-bound.
'''))

add(code(r'''
print(f"{'GPU':16} {'fp16 TFLOP/s':>12} {'fp32 TFLOP/s':>12} {'GB/s':>7} {'GiB':>5} {'ridge fp16':>10}")
for g in GPUS.values():
    print(f"{g.name:16} {g.fp16_tflops:12.1f} {g.fp32_tflops:12.1f} {g.bandwidth_gbs:7.0f} {g.memory_gib:5.0f} "
          f"{g.peak('fp16').ridge:10.0f}")

fp16 = dict(bytes_per_param=2, bytes_per_kv=2)
gpu_points = {                                           # Llama-2-7B in fp16: (intensity, None = on the roof)
    "decode, batch 1": (forward_cost(llama2_7b, 1, P, **fp16)["intensity"], None),
    "decode, batch 32": (forward_cost(llama2_7b, 1, P, batch=32, **fp16)["intensity"], None),
    "prefill, 64 tokens": (forward_cost(llama2_7b, 64, 0, **fp16)["intensity"], None),
    "prefill, 2048 tokens": (forward_cost(llama2_7b, 2048, 0, **fp16)["intensity"], None),
}
h100 = GPUS["H100 SXM"].peak("fp16")
ax = plot_roofline(h100, gpu_points)
plot_roofline(GPUS["A100-80GB SXM"].peak("fp16"), None, ax=ax)
ax.set_title("Llama-2-7B in fp16 on datacenter GPUs (hollow: the best each could reach)", fontsize=10)
plt.show()
for name, (intensity, _) in gpu_points.items():
    print(f"{name:22} {intensity:7.1f} FLOP/byte: at most {h100.attainable(intensity) / h100.flops:6.1%} of an H100's compute")
ceiling = forward_cost(llama2_7b, 1, 128, batch=10**6, **fp16)["intensity"]   # a million sequences: as if unlimited
print(f"An H100 needs about {h100.ridge:.0f} FLOPs per byte: a prefill of about that many tokens. For a decode batch "
      f"the per-sequence KV reads get in the way: with this model's 32 KV heads, even a million sequences at a context "
      f"of 128 reach only {ceiling:.0f} FLOP/byte (next plot).")
'''))

add(md(r'''
### Batching: how decode climbs the roof

If decode wastes compute because each weight serves one token, let each weight serve many: decode
`batch` sequences in the same forward pass. The weights are read once for the whole batch (your
`forward_cost` counts them once), so the intensity grows with the batch. But every sequence brings its
own KV cache, which is read for that sequence alone. With a long context the cache reads catch up
with the weights, and the intensity stops growing. Your function shows both effects, for Llama-2-7B
(multi-head attention: 32 KV heads) and the same model with GQA (8 KV heads):
'''))

add(code(r'''
import dataclasses

batches = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512]
gqa_7b = dataclasses.replace(llama2_7b, n_kv_head=8)
fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True, layout="constrained")
for ax, (title, c) in zip(axes, (("Llama-2-7B, MHA (32 KV heads)", llama2_7b), ("same, with GQA (8 KV heads)", gqa_7b))):
    for context in (128, 1024, 4096):
        ys = [forward_cost(c, 1, context, batch=b, bytes_per_param=2, bytes_per_kv=2)["intensity"] for b in batches]
        ax.plot(batches, ys, "o-", ms=3, label=f"decode at context {context}")
    for name, ls in (("H100 SXM", "--"), ("A100-80GB SXM", ":")):
        ax.axhline(GPUS[name].peak("fp16").ridge, color="gray", ls=ls, label=f"{name} ridge (fp16)")
    ax.set_xscale("log", base=2); ax.set_yscale("log")
    ax.set_xlabel("batch size (sequences decoded together)"); ax.set_title(title, fontsize=10); ax.grid(alpha=0.3)
axes[0].set_ylabel("arithmetic intensity (FLOP/byte)"); axes[1].legend(fontsize=8)
plt.show()
'''))

add(md(r'''
At short contexts the intensity first grows about linearly with the batch. It cannot grow forever:
every sequence brings its own cache reads. Read the ridge lines: with full multi-head attention, even
at a context of 128, no batch in the plot reaches either GPU's ridge; with GQA, a context of 128
reaches the H100's near batch 512. At long contexts the curves flatten early: the attention part of
decode reads a cache that no other sequence shares, so no batch size makes it compute-bound. GQA
raises that ceiling by about the number of query heads per KV head (4 here), one reason modern
models use it.

Does batching pay off on this machine? Time one decode step (one token per sequence, no cache) at
growing batch sizes. As long as something other than the batch's arithmetic dominates the step, a
step for several sequences costs far less than that many steps for one, and the tokens per second
climb with the batch. On a CPU that something is mostly the weights' trip from memory: the step
still grows with the batch, but much more slowly than the batch, until the intensity reaches the
ridge (your last line says how much it grew). On a GPU it is something else again, for this model
(section 3).
'''))

add(code(r'''
batch_sizes = env.pick([1, 2, 4, 8, 16, 32, 64], [1, 4, 16])
step_ms, tokens_per_s, batch_points = [], [], {}
for b in batch_sizes:
    ids = prompt[:, :1].repeat(b, 1)                       # (b, 1): one new token for each of b sequences
    pos = torch.zeros_like(ids)
    t = benchmark(lambda: model(ids, pos), warmup=1, repeats=repeats, device=env.device).median
    cost = forward_cost(cfg, 1, 0, batch=b, bytes_per_param=BYTES, bytes_per_kv=BYTES)
    step_ms.append(t * 1e3); tokens_per_s.append(b / t)
    batch_points[f"B={b}"] = (cost["intensity"], cost["flops"] / t)
    print(f"batch {b:3}: {t * 1e3:7.1f} ms per step, {b / t:7.1f} tokens/s, intensity {cost['intensity']:5.1f} FLOP/B")

fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.2), layout="constrained")
ax1.plot(batch_sizes, tokens_per_s, "o-", label="tokens per second")
ax1.set_xscale("log", base=2); ax1.set_xlabel("batch size"); ax1.set_ylabel("decode tokens per second")
ax1b = ax1.twinx(); ax1b.plot(batch_sizes, step_ms, "s--", color="C1", label="ms per step"); ax1b.set_ylabel("ms per step")
ax1.set_title(f"One decode step at growing batch sizes ({WHERE})", fontsize=10); ax1.grid(alpha=0.3)
ax1.legend(loc="upper left", fontsize=8); ax1b.legend(loc="lower right", fontsize=8)
plot_roofline(peak, batch_points, ax=ax2)
plt.show()
print(f"batch {batch_sizes[-1]} took {step_ms[-1] / step_ms[0]:.1f}x the time of batch 1 per step, "
      f"for {tokens_per_s[-1] / tokens_per_s[0]:.1f}x the tokens per second")
'''))

add(md(r'''
That is the bargain every serving engine strikes: a bigger batch gives more tokens per second in
total, while each sequence waits longer for each of its tokens (as long as the step takes longer:
on a CPU, your last line says how much). Lab 04 builds the batcher.
'''))

cells.extend(GRAPH_CELLS)   # section 3: where a decode step's time goes, and Problem 2 (lab02_graphs.py)

add(md(r'''
## Problem 3: A streaming generator, and the numbers a user feels (3.5 points)

Users do not wait for the whole answer: chat interfaces show each token as soon as it exists. An
engine therefore **streams**, and it is judged by timings of that stream. For one request that starts
at time `start` and whose tokens arrive at times $t_1 \le t_2 \le \dots \le t_n$:

- **TTFT**, time to first token: $t_1 - \text{start}$. Dominated by prefill (plus queueing, in a server).
- **ITL**, inter-token latencies: $t_{k+1} - t_k$ for $k = 1, \dots, n-1$. One decode step each.
- **TPOT**, time per output token: the mean ITL, $(t_n - t_1)/(n-1)$: the decode speed a reader sees.
  With a single token there is no gap to average: TPOT is **undefined**, and we return `float("nan")`,
  not 0 (a zero would claim infinitely fast decoding and drag averages down).
- **Throughput** of the request: $n / (t_n - \text{start})$ tokens per second, prefill included.

**Deliverable 1:** `stream_generate(model, input_ids, max_new_tokens, eos_token_id=None)`, a Python
**generator** (use `yield`) that runs the greedy loop of lab 01 on our cache-less model: each step
calls `model(ids, position_ids)` on the **whole** sequence so far with position ids `0 .. T-1`, takes the
argmax of the last row, and **yields it at once as a Python `int`**, before computing the next one.
Stop after `max_new_tokens` tokens, or right after yielding `eos_token_id` (it is yielded, like
`generate` keeps it). One forward pass per token, never more. Raise `ValueError` (when iteration
starts is fine) unless `input_ids` has shape `(1, T)` with `T >= 1` and `max_new_tokens >= 0`.

**Deliverable 2:** `request_metrics(start, token_times)` returns `{"ttft": float, "itl": list of floats,
"tpot": float, "throughput": float}` as defined above, from timestamps in seconds. `token_times` may be
any sequence of numbers (a list, a tuple or a NumPy array): convert each with `float(t)` first, and
return Python floats. Raise `ValueError` if there are no token times, if they decrease, or if the
first one is not after `start`.
'''))

add(solution("stream_generate", r'''
def stream_generate(model, input_ids: torch.Tensor, max_new_tokens: int, eos_token_id: int | None = None):
    """Yield greedy next-token ids one at a time, each as soon as it is computed. No KV cache."""
    ### BEGIN SOLUTION
    if input_ids.dim() != 2 or input_ids.shape[0] != 1 or input_ids.shape[1] < 1:
        raise ValueError(f"input_ids must have shape (1, T) with T >= 1, got {tuple(input_ids.shape)}")
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    ids = input_ids
    for _ in range(max_new_tokens):
        position_ids = torch.arange(ids.shape[1], device=ids.device)[None]   # (1, T)
        with torch.no_grad():
            logits = model(ids, position_ids)                                # (1, T, V): the whole sequence again
        next_id = int(logits[0, -1].argmax())                                # int(): the token is on the host now
        yield next_id
        if eos_token_id is not None and next_id == eos_token_id:
            return
        ids = torch.cat([ids, torch.tensor([[next_id]], dtype=ids.dtype, device=ids.device)], dim=1)  # (1, T + 1)
    ### END SOLUTION
'''))

add(solution("request_metrics", r'''
def request_metrics(start: float, token_times) -> dict:
    """TTFT, inter-token latencies, TPOT and throughput of one request, from timestamps in seconds."""
    ### BEGIN SOLUTION
    times = [float(t) for t in token_times]
    if not times:
        raise ValueError("token_times is empty: a request that produced no token has no TTFT")
    if times[0] <= start:
        raise ValueError(f"the first token ({times[0]}) must come after start ({start})")
    if any(b < a for a, b in zip(times, times[1:])):
        raise ValueError("token_times must not decrease")
    itl = [b - a for a, b in zip(times, times[1:])]
    return {
        "ttft": times[0] - start,
        "itl": itl,
        "tpot": sum(itl) / len(itl) if itl else float("nan"),
        "throughput": len(times) / (times[-1] - start),
    }
    ### END SOLUTION
'''))

add(tests("stream_generate_tests", 2, r'''
import inspect
from course.expect import expect_int, expect_ints

def streamed(*args, **kwargs):   # every token stream_generate yields, each checked to be a Python int
    gen = stream_generate(*args, **kwargs)
    assert inspect.isgenerator(gen), "stream_generate must be a generator function: use `yield`, do not return a list"
    return expect_ints(list(gen), "the tokens stream_generate yields (Python ints: int(tensor))")

ids = make_prompt(6)
gen = stream_generate(model, ids, 2)
assert inspect.isgenerator(gen), "stream_generate must be a generator function: use `yield`, do not return a list"
first = expect_int(next(gen), "the first token stream_generate yields (a Python int: int(tensor))")
with torch.no_grad():
    expected_first = int(model(ids, positions(6))[0, -1].argmax())
assert first == expected_first, "the first token is the argmax of the LAST row of the logits for the prompt"
rest = expect_ints(list(gen), "the tokens after the first")
assert len(rest) == 1, f"max_new_tokens=2 gives 2 tokens; got {1 + len(rest)}"
assert streamed(model, ids, 0) == [], "max_new_tokens=0 yields nothing"
### BEGIN HIDDEN TESTS
class _Succ(torch.nn.Module):
    """A fake model: the next token is (last token + 1) % vocab. Earlier rows point at token 0, so using
    the wrong row shows. It checks the position ids and that each call gets the whole sequence."""
    def __init__(self, prompt_len, vocab=50):
        super().__init__()
        self.vocab, self.prompt_len, self.calls = vocab, prompt_len, 0
        self.dummy = torch.nn.Parameter(torch.zeros(1, device=env.device))

    @property
    def device(self):
        return self.dummy.device

    def forward(self, input_ids, position_ids):
        B, T = input_ids.shape
        assert T == self.prompt_len + self.calls, \
            f"call {self.calls + 1}: expected the whole sequence ({self.prompt_len + self.calls} tokens), got {T}"
        assert torch.equal(position_ids, torch.arange(T, device=position_ids.device)[None]), f"position ids must be 0..{T - 1}"
        self.calls += 1
        logits = torch.zeros(B, T, self.vocab, device=input_ids.device)
        logits[:, :, 0] = 5.0
        logits[:, -1, 0] = 0.0
        logits[0, -1, (int(input_ids[0, -1]) + 1) % self.vocab] = 10.0
        return logits


dev = env.device
fake = _Succ(3)
p = torch.tensor([[7, 8, 3]], device=dev)
gen = stream_generate(fake, p, 10)
assert fake.calls == 0, "nothing may run before the first next(): a generator is lazy"
assert expect_int(next(gen), "a yielded token") == 4 and fake.calls == 1, \
    "the first token needs exactly one forward pass, and must be yielded right away"
assert expect_int(next(gen), "a yielded token") == 5 and fake.calls == 2, "one forward pass per token"
assert expect_int(next(gen), "a yielded token") == 6 and fake.calls == 3, "one forward pass per token"
fake = _Succ(3)
assert streamed(fake, p, 10, eos_token_id=6) == [4, 5, 6], "yield EOS, then stop"
assert fake.calls == 3, f"stop right after EOS: 3 forward passes, not {fake.calls}"
fake = _Succ(1)
assert streamed(fake, torch.tensor([[5]], device=dev), 4, eos_token_id=6) == [6] and fake.calls == 1, "EOS as the first token"
fake = _Succ(1)
assert streamed(fake, torch.tensor([[48]], device=dev), 4) == [49, 0, 1, 2], "without eos_token_id, run to max_new_tokens"
fake = _Succ(3)
assert streamed(fake, p, 0) == [] and fake.calls == 0, "max_new_tokens=0: no forward pass"
assert torch.equal(p, torch.tensor([[7, 8, 3]], device=dev)), "do not modify input_ids in place"
for bad_ids, bad_n in ((torch.tensor([[1, 2], [3, 4]], device=dev), 2), (torch.zeros(1, 0, dtype=torch.long, device=dev), 2),
                       (torch.tensor([1, 2], device=dev), 2), (torch.tensor([[1, 2]], device=dev), -1)):
    try:
        list(stream_generate(_Succ(bad_ids.shape[-1]), bad_ids, bad_n))
    except ValueError:
        pass
    else:
        raise AssertionError(f"input_ids of shape {tuple(bad_ids.shape)} with max_new_tokens={bad_n} must raise ValueError")
# real decoders against a plain greedy loop: a tiny random one (fast, many tokens), then SmolLM2 itself
def _greedy(m, ids, n):
    out, seq = [], ids
    with torch.no_grad():
        for _ in range(n):
            nxt = m(seq, torch.arange(seq.shape[1], device=seq.device)[None])[0, -1].argmax()
            out.append(int(nxt))
            seq = torch.cat([seq, nxt.view(1, 1)], dim=1)
    return out


from course.models import Decoder, init_weights
tiny_cfg = type(cfg)(family="llama", vocab_size=97, n_layer=2, n_head=4, n_kv_head=2, d_model=32, d_ff=64, max_seq_len=64)
tiny = init_weights(Decoder(tiny_cfg), std=0.5, seed=1).eval().to(dev)
tiny_ids = torch.tensor([[5, 17, 42, 8]], device=dev)
ref = _greedy(tiny, tiny_ids, 20)
assert streamed(tiny, tiny_ids, 20) == ref, "differs from a greedy loop on a tiny random decoder"
eos = ref[7]
assert streamed(tiny, tiny_ids, 20, eos_token_id=eos) == ref[:ref.index(eos) + 1], "stop right after the first EOS, keeping it"
ids = tokenizer("def add(a, b):", return_tensors="pt").input_ids.to(env.device)
assert streamed(model, ids, 3) == _greedy(model, ids, 3), "differs from a greedy loop on SmolLM2"
### END HIDDEN TESTS
'''))

add(tests("request_metrics_tests", 1.5, r'''
from course.expect import expect_float, expect_floats, expect_type

def metrics(start, times):   # request_metrics(...), its answer checked before it is compared
    m = expect_type(request_metrics(start, times), "request_metrics(...)", dict)
    assert {"ttft", "itl", "tpot", "throughput"} <= set(m), \
        f"return a dict with ttft, itl, tpot, throughput; got keys {sorted(map(str, m))}"
    return {"ttft": expect_float(m["ttft"], "ttft"), "itl": expect_floats(m["itl"], "itl"),
            "tpot": expect_float(m["tpot"], "tpot", finite=False), "throughput": expect_float(m["throughput"], "throughput")}

m = metrics(10.0, [10.5, 10.7, 10.9, 11.3])
assert abs(m["ttft"] - 0.5) < 1e-9, f"TTFT = first token time - start = 0.5 s, got {m['ttft']}"
assert len(m["itl"]) == 3, "ITL: one gap between each pair of consecutive tokens (n - 1 of them), not from start"
assert all(abs(a - b) < 1e-9 for a, b in zip(m["itl"], [0.2, 0.2, 0.4])), f"ITL should be [0.2, 0.2, 0.4], got {m['itl']}"
assert abs(m["tpot"] - 0.8 / 3) < 1e-9, f"TPOT = mean ITL = 0.8 s / 3, got {m['tpot']}"
assert abs(m["throughput"] - 4 / 1.3) < 1e-9, f"throughput = 4 tokens / 1.3 s since start, got {m['throughput']}"
m = metrics(10.0, np.array([10.5, 10.7, 10.9, 11.3]))   # a NumPy array: float(t) each time, return Python floats
assert abs(m["tpot"] - 0.8 / 3) < 1e-9, f"the same times as a NumPy array give the same TPOT, 0.8 s / 3; got {m['tpot']}"
### BEGIN HIDDEN TESTS
one = metrics(2.0, [2.25])
assert abs(one["ttft"] - 0.25) < 1e-12 and list(one["itl"]) == [], "one token: TTFT only, no gaps"
assert math.isnan(one["tpot"]), "one token: TPOT is undefined: return float('nan')"
assert abs(one["throughput"] - 4.0) < 1e-9, "one token in 0.25 s is 4 tokens/s"
rng = np.random.default_rng(0)
start = 100.0
times = start + 0.3 + np.cumsum(rng.uniform(0.01, 0.2, size=50))
m = metrics(start, times)                           # a numpy array works as well as a list
gaps = np.diff(times)
assert abs(m["ttft"] - (times[0] - start)) < 1e-9, "TTFT = first token time - start"
assert np.allclose(list(m["itl"]), gaps, atol=1e-9), "ITL are the differences of consecutive token times"
assert abs(m["tpot"] - gaps.mean()) < 1e-9, "TPOT is the mean ITL"
assert abs(m["throughput"] - 50 / (times[-1] - start)) < 1e-9, "throughput counts every token over the time since start"
assert abs(metrics(0.0, (0.5, 0.5, 1.0))["tpot"] - 0.25) < 1e-12, "equal timestamps are allowed (gap 0)"
for bad_start, bad in ((0.0, []), (0.0, [0.5, 0.4]), (1.0, [0.5, 1.5]), (1.0, [1.0, 1.5])):
    try:
        request_metrics(bad_start, bad)
    except ValueError:
        pass
    else:
        raise AssertionError(f"request_metrics({bad_start}, {bad}) must raise ValueError")
### END HIDDEN TESTS
'''))

add(md(r'''
### See it: the timeline of one request

Your generator streams tokens from our cache-less model; `hf_model.generate` streams greedy tokens
too, using its KV cache (`TokenTimer` records when each token arrives). They are the same tokens in
float32; in bf16 a near-tie can make the two programs part (your first line says). Same prompt, same number
of tokens, timestamps taken as each token is handed over.
'''))

add(code(r'''
prompt_len, n_new = env.pick((256, 32), (32, 6))
request = make_prompt(prompt_len)
hf_model.generate(request, max_new_tokens=2, min_new_tokens=2, do_sample=False)   # warm-up at this request's shapes:
# a GPU loads each kernel on its first use, tens of ms, and a new shape can pick new kernels (seen: 337 ms at token 2)

start = clock(env.device)
ours_times, ours_tokens = [], []
for token in stream_generate(model, request, n_new):                   # no eos: always n_new tokens
    ours_times.append(clock(env.device))
    ours_tokens.append(token)
ours = request_metrics(start, ours_times)

timer = TokenTimer(env.device)                                         # its clock starts now
hf_model.generate(request, streamer=timer, max_new_tokens=n_new, min_new_tokens=n_new, do_sample=False)
cached = request_metrics(0.0, timer.times)

print(f"prompt of {prompt_len} tokens, {n_new} new tokens, {WHERE}; same tokens: {ours_tokens == timer.tokens}")
print(f"{'':22} {'TTFT ms':>8} {'TPOT ms':>8} {'tokens/s':>9}")
for name, m in (("stream_generate (no cache)", ours), ("generate (KV cache)", cached)):
    print(f"{name:26} {m['ttft'] * 1e3:8.1f} {m['tpot'] * 1e3:8.1f} {m['throughput']:9.1f}")

fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4), layout="constrained")
for name, m, t0, times in (("stream_generate, no cache", ours, start, ours_times), ("hf generate, KV cache", cached, 0.0, timer.times)):
    rel = [t - t0 for t in times]
    line, = ax1.step([0.0] + rel, range(len(rel) + 1), where="post", label=name)
    ax1.axvline(m["ttft"], color=line.get_color(), ls=":", lw=1)
    ax2.plot(range(2, len(rel) + 1), [x * 1e3 for x in m["itl"]], "o-", ms=3, color=line.get_color(), label=name)
ax1.set_xlabel("seconds since the request started"); ax1.set_ylabel("tokens received")
ax1.set_title("Timeline of one request (dotted: TTFT)", fontsize=10); ax1.legend(fontsize=8); ax1.grid(alpha=0.3)
ax2.set_xlabel("token number"); ax2.set_ylabel("ms since the previous token (ITL)"); ax2.set_ylim(bottom=0)
ax2.set_title("Inter-token latency", fontsize=10); ax2.legend(fontsize=8); ax2.grid(alpha=0.3)
plt.show()
print("generated:", repr(tokenizer.decode(ours_tokens)))
for name, m in (("no cache (yours)", ours), ("KV cache (generate)", cached)):
    print(f"{name:20}: ITL from {m['itl'][0] * 1e3:6.1f} ms (token 2) to {m['itl'][-1] * 1e3:6.1f} ms (token {n_new}), "
          f"x{m['itl'][-1] / m['itl'][0]:.2f}; TTFT {m['ttft'] * 1e3:.1f} ms ({WHERE})")
'''))

add(md(r'''
Both loops start the same way: the first token needs a forward pass over the whole prompt. After
that they part, or should. `generate` keeps the keys and values of every earlier token, so each
decode step feeds the model one token. Your loop has no cache: every decode step is a new prefill of
the whole sequence so far.

On a CPU, where the work sets the pace, that is what your table shows: the two TTFTs are
close, the cached ITL stays flat and well below yours, and each of your ITLs costs about a TTFT.
Yours also grows with the text, but each step adds one token to a prompt of dozens or hundreds: over
a short run the growth can hide in the noise. On a GPU, at this model size, both loops are
launch-bound (section 3): a forward pass over a few hundred tokens launches the same thousand
kernels as a pass over one. Then the Python around the kernels decides. `generate` runs more of it
per step than our lean model (attention masks, its cache object, logits processors), and an eager
GPU step can also be slow the first time it meets a new sequence length, so generate's TTFT, and
even its ITL, can come out above your loop's. Your table says which case you are in. Either way, the
decode phase is cheap only because of the KV cache, once the work (not the launches) sets the pace.
**Lab 03: you add it to the from-scratch model.**

## Problem 4: The memory budget (2.5 points)

A GPU must hold three things while it serves: the **weights**, the **KV cache** of every sequence in
the batch, and the **activations** of the step it is running. The cache grows with each token and
each sequence; when it no longer fits, the engine must refuse, queue or evict requests.

- **weights**: every parameter the model stores, times `bytes_per_param`: the token embedding
  (`vocab_size × d_model`), per layer the attention and MLP matrices and the two norms (`d_model`
  each), the final norm, the `lm_head` only if it is not tied to the embedding
  (`cfg.tie_embeddings`), and for the GPT-2 family its position table (`max_seq_len × d_model`).
  Biases and norm weights are under 0.5% of any model here; the tests allow 1%.
- **kv_cache**: K and V, for every layer, KV head, position and sequence:
  $2 \cdot \text{n\_layer} \cdot \text{n\_kv\_head} \cdot \text{head\_dim} \cdot \text{context\_len} \cdot \text{batch} \cdot \text{bytes\_per\_kv}$.
- **activations**: a peak estimate for one forward step over `step_tokens` tokens per sequence (1 for
  a decode step, the prompt length for a prefill), in the weights' precision: the residual stream
  (`d_model` numbers per token) stays alive throughout, plus the widest temporaries, which are either the
  MLP's two `d_ff`-wide outputs (gate and up, alive together) or the logits (`vocab_size` per token),
  whichever is larger:
  `bytes_per_param × batch × step_tokens × (d_model + max(2 × d_ff, vocab_size))`.
- **total**: the sum of the three.

**Deliverable:** `memory_budget(cfg, batch, context_len, bytes_per_param=2, bytes_per_kv=2, step_tokens=1)`
returns `{"weights", "kv_cache", "activations", "total"}` in bytes. Raise `ValueError` if `batch < 1`,
`context_len < 0` or `step_tokens < 1`.
'''))

add(solution("memory_budget", r'''
def memory_budget(cfg, batch: int, context_len: int, bytes_per_param: float = 2, bytes_per_kv: float = 2,
                  step_tokens: int = 1) -> dict:
    """Bytes of weights, KV cache and peak activations to serve `batch` sequences of `context_len` tokens."""
    ### BEGIN SOLUTION
    if batch < 1 or context_len < 0 or step_tokens < 1:
        raise ValueError(f"need batch >= 1, context_len >= 0, step_tokens >= 1; got {batch}, {context_len}, {step_tokens}")
    d = cfg.d_model
    q_dim, kv_dim = cfg.n_head * cfg.head_dim, cfg.n_kv_head * cfg.head_dim
    n_mlp = 3 if cfg.family == "llama" else 2
    per_layer = d * q_dim + 2 * d * kv_dim + q_dim * d + n_mlp * d * cfg.d_ff + 2 * d   # + two norms
    params = cfg.n_layer * per_layer + cfg.vocab_size * d + d                          # + embedding, final norm
    if not cfg.tie_embeddings:
        params += cfg.vocab_size * d                                                   # its own lm_head
    if cfg.family == "gpt2":
        params += cfg.max_seq_len * d                                                  # learned positions
    weights = params * bytes_per_param
    kv_cache = 2 * cfg.n_layer * kv_dim * context_len * batch * bytes_per_kv
    activations = bytes_per_param * batch * step_tokens * (d + max(2 * cfg.d_ff, cfg.vocab_size))
    return {"weights": weights, "kv_cache": kv_cache, "activations": activations,
            "total": weights + kv_cache + activations}
    ### END SOLUTION
'''))

add(tests("memory_budget_tests", 2.5, r'''
from course.expect import expect_float, expect_type

def budget_of(*args, **kwargs):   # memory_budget(...), its answer checked before it is compared
    b = expect_type(memory_budget(*args, **kwargs), "memory_budget(...)", dict)
    keys = ("weights", "kv_cache", "activations", "total")
    assert set(keys) <= set(b), f"return a dict with {', '.join(keys)}; got keys {sorted(map(str, b))}"
    return {k: expect_float(b[k], f"memory_budget(...)[{k!r}]") for k in keys}

budget = budget_of(cfg, batch=1, context_len=20, bytes_per_param=4, bytes_per_kv=4)
param_bytes = 4 * sum(p.numel() for p in model.parameters())                   # the real model's parameters, in fp32
assert abs(budget["weights"] / param_bytes - 1) < 0.01, \
    f"weights: the model holds {param_bytes:,} bytes of parameters; you have {budget['weights']:,} (tied lm_head counts once)"
with torch.no_grad():
    cache = hf_model(make_prompt(20), use_cache=True).past_key_values           # transformers' own KV cache
hf_kv_bytes = 4 * sum(layer.keys.numel() + layer.values.numel() for layer in cache.layers)   # in fp32
assert budget["kv_cache"] == hf_kv_bytes, \
    f"KV cache: transformers holds {hf_kv_bytes:,} bytes after a 20-token prefill; you have {budget['kv_cache']:,} (K and V, n_kv_head heads)"
assert budget["total"] == budget["weights"] + budget["kv_cache"] + budget["activations"], "total is the sum"
assert budget_of(cfg, 8, 20, bytes_per_param=4, bytes_per_kv=4)["kv_cache"] == 8 * hf_kv_bytes, "every sequence has its own cache"
### BEGIN HIDDEN TESTS
_C = type(cfg)


def _ref_budget(c, batch, ctx, bp, bk, steps):
    d, hd = c.d_model, c.d_model // c.n_head
    attn = 2 * d * c.n_head * hd + 2 * d * c.n_kv_head * hd
    if c.family == "llama":
        n = c.n_layer * (attn + 3 * d * c.d_ff + 2 * d) + d
    else:
        n = c.n_layer * (attn + 2 * d * c.d_ff + (c.n_head * hd + 2 * c.n_kv_head * hd + d) + c.d_ff + d + 4 * d) \
            + 2 * d + c.max_seq_len * d
    n += c.vocab_size * d * (1 if c.tie_embeddings else 2)
    kv = 2 * c.n_layer * c.n_kv_head * hd * ctx * batch * bk
    act = bp * batch * steps * (d + max(2 * c.d_ff, c.vocab_size))
    return n * bp, kv, act


_cfgs = {
    "smollm2": cfg,
    "gpt2": _C(family="gpt2", vocab_size=50257, n_layer=12, n_head=12, n_kv_head=12, d_model=768, d_ff=3072, max_seq_len=1024),
    "llama2-7b": _C(family="llama", vocab_size=32000, n_layer=32, n_head=32, n_kv_head=32, d_model=4096, d_ff=11008,
                    max_seq_len=4096, tie_embeddings=False),
    "llama3-8b": _C(family="llama", vocab_size=128256, n_layer=32, n_head=32, n_kv_head=8, d_model=4096, d_ff=14336,
                    max_seq_len=8192, tie_embeddings=False),
    "mqa": _C(family="llama", vocab_size=32000, n_layer=24, n_head=16, n_kv_head=1, d_model=2048, d_ff=8192,
              max_seq_len=4096, tie_embeddings=False),
    "tiny": _C(family="llama", vocab_size=256, n_layer=2, n_head=4, n_kv_head=2, d_model=64, d_ff=128, max_seq_len=512),
    "tiny-untied": _C(family="llama", vocab_size=256, n_layer=2, n_head=4, n_kv_head=2, d_model=64, d_ff=128,
                      max_seq_len=512, tie_embeddings=False),
}
for name, batch, ctx, bp, bk, steps in [
    ("smollm2", 32, 8192, 2, 2, 1), ("gpt2", 4, 1024, 4, 4, 1024), ("llama2-7b", 1, 4096, 2, 2, 1),
    ("llama2-7b", 32, 4096, 2, 2, 4096), ("llama3-8b", 16, 8192, 2, 1, 1), ("mqa", 64, 2048, 1, 2, 512),
    ("tiny", 3, 100, 4, 4, 7), ("tiny-untied", 2, 0, 2, 2, 1),
]:
    got = budget_of(_cfgs[name], batch, ctx, bytes_per_param=bp, bytes_per_kv=bk, step_tokens=steps)
    w, kv, act = _ref_budget(_cfgs[name], batch, ctx, bp, bk, steps)
    where = f"{name}, batch={batch}, context_len={ctx}, bytes_per_param={bp}, bytes_per_kv={bk}, step_tokens={steps}"
    assert abs(got["weights"] / w - 1) < 0.01, f"{where}: weights {got['weights']:.4g} are too " \
        f"{'high' if got['weights'] > w else 'low'}: count the embedding once, the lm_head again only if untied " \
        f"(tie_embeddings), GQA-sized k/v, and GPT-2's position table"
    assert got["kv_cache"] == kv, f"{where}: kv_cache {got['kv_cache']:.4g} is too {'high' if got['kv_cache'] > kv else 'low'}: " \
        f"2 (K and V) x n_layer x n_kv_head x head_dim x context_len x batch x bytes_per_kv"
    assert got["activations"] == act, f"{where}: activations {got['activations']:.4g} are too " \
        f"{'high' if got['activations'] > act else 'low'}: bytes_per_param x batch x step_tokens x " \
        f"(d_model + max(2 x d_ff, vocab_size)), in the weights' precision"
    assert abs(got["total"] - (got["weights"] + got["kv_cache"] + got["activations"])) < 1e-6 * got["total"], \
        f"{where}: total must be weights + kv_cache + activations"
for bad in [dict(batch=0, context_len=10), dict(batch=1, context_len=-1), dict(batch=1, context_len=10, step_tokens=0)]:
    try:
        memory_budget(cfg, **bad)
    except ValueError:
        pass
    else:
        raise AssertionError(f"memory_budget(cfg, **{bad}) must raise ValueError")
### END HIDDEN TESTS
'''))

add(md(r'''
### Check the budget against real tensors

Three measurements, three terms: the parameters of our model, the cache transformers builds during a
real prefill, and the logits tensor of that prefill (the widest activation of SmolLM2).
'''))

add(code(r'''
T_check = 32
budget = memory_budget(cfg, batch=1, context_len=T_check, bytes_per_param=BYTES, bytes_per_kv=BYTES, step_tokens=T_check)
print(f"the model and transformers' cache in {DTYPE}: {BYTES} bytes per number")
ids = make_prompt(T_check)
with torch.no_grad():
    out = hf_model(ids, use_cache=True)          # logits (1, T, V) and transformers' KV cache
layer0 = out.past_key_values.layers[0]
print(f"transformers' cache: {len(out.past_key_values.layers)} layers, keys and values of shape {tuple(layer0.keys.shape)} "
      f"= (batch, n_kv_head, tokens, head_dim)")
measured = {
    "weights": sum(p.numel() * p.element_size() for p in model.parameters()),
    "kv_cache": sum(layer.keys.nbytes + layer.values.nbytes for layer in out.past_key_values.layers),
    "logits": out.logits.nbytes,
}
print(f"weights:     formula {budget['weights'] / 1e6:9.2f} MB, parameters of the model {measured['weights'] / 1e6:9.2f} MB")
print(f"KV cache:    formula {budget['kv_cache'] / 1e6:9.2f} MB, transformers' cache    {measured['kv_cache'] / 1e6:9.2f} MB")
print(f"activations: formula {budget['activations'] / 1e6:9.2f} MB, of which logits      {measured['logits'] / 1e6:9.2f} MB "
      f"(a {tuple(out.logits.shape)} tensor)")
if env.gpu:
    torch.cuda.synchronize(); torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    with torch.no_grad():
        model(ids, positions(T_check))
    print(f"GPU: the forward pass allocated at most {(torch.cuda.max_memory_allocated() - base) / 1e6:.2f} MB above the weights")
else:
    print("(On a GPU this cell also measures the peak memory of the forward pass; a CPU has no such counter.)")
'''))

add(md(r'''
### When does the cache outgrow the model?

The workshop this course grew from asks: for a long-context model, how much memory does the KV cache take? Your budget, in fp16,
for SmolLM2 (GQA, 3 KV heads) and for Llama-2-7B (32 KV heads) on an 80 GB GPU. Dots mark where the
cache alone equals the weights.
'''))

add(code(r'''
GiB = 2**30
gpu = GPUS["A100-80GB SXM"]
fig, axes = plt.subplots(1, 2, figsize=(11, 4), layout="constrained")
for ax, (name, c) in zip(axes, (("SmolLM2-135M", cfg), ("Llama-2-7B", llama2_7b))):
    contexts = np.linspace(0, c.max_seq_len, 65).astype(int)
    weights = memory_budget(c, 1, 0)["weights"]
    kv_per_token = memory_budget(c, 1, 1)["kv_cache"]                 # one token of one sequence
    print(f"{name}: weights {weights / GiB:.2f} GiB, KV cache {kv_per_token / 2**10:.1f} KiB per token per sequence")
    for b in (1, 8, 32):
        line, = ax.plot(contexts, [memory_budget(c, b, int(L))["total"] / GiB for L in contexts], label=f"batch {b}")
        equal = weights / (kv_per_token * b)                           # context where the cache = the weights
        where = f"at context {equal:,.0f}" if equal <= c.max_seq_len else f"never within {c.max_seq_len:,} tokens"
        if equal <= c.max_seq_len:
            ax.plot([equal], [memory_budget(c, b, round(equal))["total"] / GiB], "o", color=line.get_color())
        fits = (gpu.memory_gib * GiB - weights - memory_budget(c, b, 0)["activations"]) / (kv_per_token * b)
        print(f"  batch {b:2}: cache = weights {where}; an {gpu.memory_gib} GiB GPU has room for {fits:,.0f} tokens per sequence")
    ax.axhline(weights / GiB, color="gray", ls="--", label="weights")
    if name == "Llama-2-7B":
        ax.axhline(gpu.memory_gib, color="red", ls=":", label=f"{gpu.name} memory")
    ax.set_ylim(0, ax.get_ylim()[1] * 1.1)
    ax.set_xlabel("context length (tokens per sequence)"); ax.set_ylabel("GiB (fp16)")
    ax.set_title(f"{name}: weights + KV cache + activations", fontsize=10)
    ax.legend(fontsize=8, loc="center left"); ax.grid(alpha=0.3)
plt.show()

prefill_act = memory_budget(llama2_7b, 32, 4096, step_tokens=4096)["activations"]
print(f"Llama-2-7B, a prefill of 32 x 4096 tokens in one step: activations alone {prefill_act / GiB:.1f} GiB")
'''))

add(md(r'''
The cache is tiny for one short request and dominant for many long ones. Read the Llama-2-7B lines
you printed: at batch 32 an 80 GB GPU has room for just over 4,096 tokens per sequence, the model's
full context, and by then the cache is about five times the size of the weights. The batch size a
server can run is set by KV memory, and the batch size sets decode throughput. Hence the engine features of later labs: a cache allocated in pages instead of one
maximum-length slab per request (lab 05), shared prefixes (lab 09), smaller caches (8-bit keys and
values: lab 10), and prefills split into chunks, which bound the activation peak (lab 11).

## Summary

- A request is one **prefill** (the whole prompt in one forward pass, ending in the first token) and
  many **decode** steps (one token per forward pass).
- Per forward pass the weights are read once. Prefill spreads that read over every prompt token; a
  decode step spends it on one token per sequence. At batch 1, decode does about 2 FLOPs per weight
  for `bytes_per_param` bytes per weight: an intensity near 1 FLOP/byte in fp16, far left of any
  GPU's ridge. **On the roofline, decode is memory-bound; a prefill becomes compute-bound once its
  intensity (about the prompt length in bf16/fp16, half of it in fp32) passes the ridge point: a few
  tens of tokens on a CPU, a few hundred on a GPU.**
- **Batching** decode shares each weight read across sequences and raises the intensity, until
  the per-sequence KV reads dominate at long contexts.
- The roofline leaves out the cost of **handing out the work**. A decode step of a small model is
  about a thousand small ops; on a GPU each is a kernel launch that costs the CPU more than the
  GPU's run of it, so the step is **launch-bound**, far above its roofline. A **CUDA graph**
  captures the step once (static input buffers, static outputs, fixed shapes) and replays all its
  kernels with one launch; engines keep one graph per batch-size bucket. On a CPU, where the ops
  themselves take the time, there is nothing comparable to win.
- Users feel **TTFT** (prefill, plus queueing) and **TPOT** (decode speed); operators care about
  **throughput**. A larger batch raises throughput and, once the step's own work grows (at once on a
  CPU, only at large batches on a GPU), each request's TPOT: the throughput-latency trade-off every
  scheduler tunes.
- Memory holds weights, a KV cache that grows with batch × context, and activations that peak
  during prefill. The KV cache, not the weights, limits the batch size.

**Questions** (from the workshop and notes this course grew from). Answer in the cell under each
group, in a few sentences of your own and with **your** numbers where a question asks for them; a
person grades them (4 points in all).
1. Where do your prefill and your decode step sit against the ridge point of this machine? Use your two intensities. On a GPU, what did your measured times show instead?
2. What does time to first token measure, and what does time per output token measure? Which phase sets each?
3. What do we gain by batching decode, and what do we lose? Use your batch measurement.
'''))
add(answer("phases_answer", 2, "questions 1 to 3", model=r'''
(The numbers are an example; each student quotes their own.)

1. Decode's intensity is about 2 FLOPs per weight over `bytes_per_param` bytes: about 0.5 FLOP/byte
   in fp32 (about 1 in bf16). Prefill's is about half the prompt length in fp32 (about 128 for the
   256-token prompt, 32 for 64 tokens in quick mode) and the prompt length in bf16. A CPU's ridge
   is a few to a few tens of FLOP/byte (its measured peak FLOP/s over its copy bandwidth), so on a
   CPU decode sits far left of the ridge (memory-bound: the weights' trip from memory sets its
   time) and the prefill right of it (compute-bound), each within a small factor of its roofline
   bound. On a GPU (ridge about 300 FLOP/byte in bf16 on an H100) decode is still far left and a
   few-hundred-token prefill near or left of the ridge, but the measured times did not follow the
   roof: both passes took about the same time, tens to hundreds of times their bounds (bound about
   0.1 ms for 270 MB of bf16 weights on an H100), because the step is launch-bound (section 3).
2. TTFT is the time from the request's start (arrival) to its first token: queueing plus the
   prefill of the whole prompt, so the prefill sets it (it grows with the prompt). TPOT is the mean
   gap between the later tokens, `(t_n - t_1) / (n - 1)`: one decode step per token, so decode sets
   it (and whatever shares the step with it: the batch, a prefill that stalls it).
3. Gain: one read of the weights (on a GPU, one set of launches) serves every sequence of the batch,
   so a step for B sequences costs far less than B steps: tokens per second grow nearly with B at
   first (for example, batch 16 at about 2-3x the step time of batch 1 gives 5-8x the tokens per
   second on a CPU). Loss: each step takes longer, so every request's TPOT grows (at once on a CPU,
   only at large batches on a GPU); each sequence also needs its own KV cache memory, requests may
   wait for a batch, and the gain stops once the intensity reaches the ridge or the per-sequence
   cache reads dominate at long contexts.
''', rubric=r'''
- 1 point: question 1. Both intensities quoted from the student's run with their order of magnitude
  (decode about 0.5-1 FLOP/byte, prefill about the prompt length or half of it) and placed correctly
  against the machine's ridge (decode memory-bound; on a CPU the prefill compute-bound); on a GPU (or
  what they expect there), that the measured times sit far above the roof and barely differ between
  the two passes, i.e. launch-bound. Half for a correct placement without the student's numbers.
- 0.5: question 2. TTFT = queueing + prefill (first token), TPOT = mean time between later tokens
  (decode steps); each tied to its phase.
- 0.5: question 3. Gain: throughput from sharing weight reads (or launches), argued with the student's
  measured step times or tokens/s; loss: per-token latency grows with the step (and memory per
  sequence). Both sides needed for the half point.
'''))
add(md(r'''
4. Without a KV cache, did your inter-token latency grow with every token? Why (or why not, on a GPU)? What will a cache save: compute or memory, and at what price?
5. How are prefill and decode different enough that some systems run them on different GPUs?
6. What can an engine do when the KV cache no longer fits in memory?
'''))
add(answer("cache_memory_answer", 1, "questions 4 to 6", model=r'''
4. On a CPU, yes (slowly, and noisily over a short run): without a cache each decode step is a new
   prefill of the whole sequence so far, so its work grows with every token, and each ITL costs
   about a TTFT. On a GPU, hardly: a pass over a few hundred tokens launches the same thousand or so
   kernels as a pass over one, and the launches, not the work, set its time. A cache saves
   **compute** (recomputing every earlier token's keys and values at every step) and spends
   **memory**: `2 x 30 layers x 3 KV heads x 64 x bytes` per token, 23,040 bytes (22.5 KiB) in bf16,
   for every token of every sequence, which also has to be read at every step.
5. Prefill processes many tokens per pass and is compute-bound (intensity about the prompt length);
   it sets TTFT and comes in bursts with large activations. Decode produces one token per sequence
   per step, is memory-bound (weights and KV reads), runs for many steps and needs KV memory and large
   batches; it sets TPOT. On one GPU a long prefill stalls every running decode, and one batch size
   or parallelism cannot suit both. Separate GPUs let each pool be sized and parallelized for its own
   phase and latency target (DistServe, Splitwise), at the price of shipping each request's KV cache
   from the prefill GPU to the decode GPU.
6. Refuse or queue new requests (hold them back until memory frees); preempt running requests and
   free their cache, then recompute it later or swap it to CPU memory; waste less (a paged cache, lab
   05), share common prefixes (lab 09), shrink it (int8/fp8 keys and values, a sliding window, lab
   10), cap the context or the batch, or spread the cache over more GPUs (tensor parallelism splits
   the KV heads, lab 12).
''', rubric=r'''
- 0.5: question 4: the no-cache ITL grows on a CPU because each step recomputes the whole sequence
  (and barely on a GPU, launch-bound); a cache saves compute and costs memory (per-token size, or
  "grows with context x batch").
- 0.25: question 5: compute-bound prefill (TTFT) against memory-bound decode (TPOT), and what
  separating them buys (no interference, each pool tuned) or costs (KV transfer).
- 0.25: question 6: at least two distinct remedies (queue/refuse, preempt with recompute or swap,
  paging, prefix sharing, quantization, offload, more GPUs).
'''))
add(md(r'''
7. Your profile counted the ops of one decode step. Which limit did your step hit: the work or the launches? What did your graph gain, and why that much and no more?
8. Why do engines capture graphs for decode steps but run prefills eagerly? What do they do with a decode batch of 5 when they captured graphs for 4 and 8?
'''))
add(answer("graphs_answer", 1, "questions 7 and 8", model=r'''
7. On a CPU, the work: each op runs on the thread that dispatched it, the matrix products take far
   longer than dispatching, the device computes through most of the step, and the graph stand-in
   gains nothing (a ratio near 1, within the run-to-run noise). On a GPU, the launches: about a
   thousand kernels, each handed out by Python, PyTorch and the driver in 5-20 us, while the GPU is
   busy for only a small share of the step. The graph removed the launches, so the step dropped
   several-fold, down to about the profile's "device busy" time; no further, because what is left is
   the thousand small kernels themselves, each a microsecond or a few, still far above the roofline
   bound. Going below that takes fewer, fused kernels (`torch.compile`) or more work per kernel (a
   larger batch).
8. A decode step has small, fixed shapes (one token per sequence), runs thousands of times and is
   launch-bound, so a graph per batch-size bucket pays off; a prefill's shapes change with every
   prompt (a graph per length is impossible, and each graph holds memory), and its kernels are big
   enough that launching them costs little next to running them. For a batch of 5 with graphs for 4
   and 8, the engine pads up to 8: it copies the 5 rows into the 8-row graph's static inputs, replays
   it, and reads only the first 5 rows of the logits. The 3 padded rows cost almost nothing in a step
   bound by launches and weight reads.
''', rubric=r'''
- 0.5: question 7: the limit named from the student's own profile (work on a CPU, launches on a GPU)
  with a number from it (ops or kernels per step, device-busy share, graph speedup); why the gain
  stops (remaining kernel time, or on a CPU nothing to remove). A CPU-only student who says what they
  expect on a GPU, correctly, earns it.
- 0.5: question 8: decode = small fixed shapes, launch-bound, replayed often; prefill = variable
  shapes, big kernels; batch of 5 padded to the 8 bucket (5 rows read back).
'''))
add(md(r'''
## Going further

- **vLLM** (Kwon et al., SOSP 2023) stores the KV cache in fixed-size blocks (PagedAttention) so many
  more sequences fit, and batches at every step, mixing new prefills with running decodes.
- **SGLang** (Zheng et al., 2024) reuses the KV cache of shared prompt prefixes across requests with
  a radix tree (RadixAttention), cutting the prefill work of chat and agent workloads.
- **Sarathi-Serve** (Agrawal et al., OSDI 2024) splits long prefills into chunks and runs each chunk
  in the same step as the ongoing decodes (*chunked prefill*, *stall-free batching*): decodes no longer
  stall behind a long prompt, and the compute-bound chunks fill the idle arithmetic of the
  memory-bound decodes. The paper reports 2.6x higher serving capacity than vLLM for Mistral-7B on one A100.
- **DistServe** (Zhong et al., OSDI 2024) goes the other way: it *disaggregates* the phases onto
  different GPUs, each sized and parallelized for its own phase and its own latency target (TTFT for
  prefill, TPOT for decode), and ships the KV cache from the prefill GPU to the decode GPU.
- **TGI** (Hugging Face) and **nano-vllm** (about 1,200 lines) are readable engines that make the same
  choices; in nano-vllm, find where the scheduler decides between a prefill step and a decode step.
- **CUDA graphs in engines**: nano-vllm (`engine/model_runner.py`) captures batch sizes 1, 2, 4, 8, then
  every 16 up to its maximum, largest first into one shared memory pool; vLLM and SGLang do the same
  with finer buckets and also capture pieces around attention (*piecewise* graphs) so that prefills
  benefit too. PyTorch's own guide, "CUDA Graphs" in the CUDA semantics notes, lists the rules you
  met (static buffers, side-stream warm-up, no synchronization inside).
- **torch.compile** (`mode="reduce-overhead"`) fuses small ops into Triton kernels and replays them
  from CUDA graphs; Hugging Face `transformers` pairs it with a *static* KV cache (fixed shapes) and
  reports up to 4x faster decoding.
- The roofline model itself: Williams, Waterman and Patterson, *Roofline: an insightful visual
  performance model for multicore architectures*, Communications of the ACM, 2009.
'''))

path = write_notebook("labs/02_prefill_decode/02_prefill_decode.ipynb", cells + [md(CHECK_YOUR_WORK)])
print("wrote", path)
