"""Builds the lab 03 source notebook. Edit this file, then run from the repo root:

    .venv/bin/python -m autograder.lab_builders.lab03
"""
from autograder.authoring import answer, code, locked, md, solution, tests, write_notebook  # noqa: E402
from autograder.lab_builders.common_cells import CHECK_YOUR_WORK, COLAB_INSTALL, SETUP  # noqa: E402

cells = [
md(r"""
# Lab 03: The KV cache

Your greedy loop from lab 01 feeds the **whole** sequence to the model at every step. To write token
100 it runs tokens 1 to 99 through all 30 layers again, although step 99 had just done exactly that.
Nothing about those tokens changed: in causal attention a token never looks at the tokens after it.
So the fix is to keep what later tokens need from earlier ones, the **keys and values** of every
layer, and to feed the model only the newest token. That is the **KV cache**. Every inference engine
has one, and it soon becomes the largest thing in GPU memory, which is what labs 04, 05, 09 and 10 manage.

**You will**
- watch your lab 01 loop recompute the same numbers, by printing one entry of layer 0's keys at every step;
- add a KV cache to the from-scratch decoder: the prompt fills it (*prefill*), each step appends one token (*decode*), with the right position ids and the right causal mask, for multi-head and grouped-query attention;
- prove that cached generation gives exactly the tokens of uncached generation and of Hugging Face `generate`;
- compute the size of the cache, and see it outgrow the model at long contexts;
- measure the speedup, and weigh the compute saved against the memory spent, on your machine: on a
  GPU, also with the decode step in a CUDA graph (lab 02), the way engines run it.

**Time:** about 2 hours 20 minutes: 30 minutes of reading, four problems (cached attention about 35
minutes, threading the cache through the model 20, the generate loop 20, the cache size 10), 20
minutes for the written questions at the end, and about 3.5 minutes of running on a laptop CPU (measured on 2
cores; the last measurement, up to 256 new tokens without a cache, takes most of it; with `COURSE_QUICK=1` it stops at 16 tokens), about 2 minutes on a GPU (up to 2 more if
you turn on the `torch.compile` comparison). **Hardware:** everything runs on a CPU. On a GPU the model
runs in bf16 (fp16 on a T4) and the last section adds the cache with its decode step in a CUDA graph,
a measurement only a GPU can make, and, in full mode, Hugging Face's generate beside it and, if you
turn it on, Hugging Face's static cache with `torch.compile`.
"""),
locked("colab_install", COLAB_INSTALL),
locked("setup", SETUP),
md(r"""
## 1. The model, and lab 01's loop

The same model as in labs 01 and 02: SmolLM2-135M in our from-scratch decoder (`model`), and the
same weights in Hugging Face `transformers` (`hf_model`), whose `generate` has a KV cache.
"""),
code(r"""
import dataclasses

import matplotlib.pyplot as plt
import torch
import torch.nn.functional as F
from matplotlib.colors import ListedColormap
from matplotlib.patches import Patch
from torch import nn

from course.models.decoder import Attention, Block, Decoder, apply_rope, check_ids, rope_cos_sin

tokenizer = course.load_tokenizer()
model = course.load_model(device=env.device, dtype=env.dtype)   # from scratch, no KV cache (yet)
hf_model = course.load_hf_model(device=env.device)              # transformers (float32): the reference
# Token-for-token checks run in float32: in bf16 two correct programs can round a near-tie differently.
model_fp32 = model if env.dtype == torch.float32 else course.load_model(device=env.device)
cfg = model.cfg
print(f"{cfg.n_layer} layers, {cfg.n_head} query heads sharing {cfg.n_kv_head} key/value heads "
      f"(head_dim {cfg.head_dim}), {model.num_parameters() / 1e6:.1f} M parameters")
"""),
md(r"""
Here is the greedy loop you wrote in lab 01 (its answer, released). Every step builds position ids
`0 .. T-1` and runs the model on **all** `T` tokens so far.
"""),
locked("greedy_generate", r"""
def greedy_generate(model, input_ids: torch.Tensor, max_new_tokens: int, eos_token_id: int | None = None) -> torch.Tensor:
    # Lab 01's answer: greedy decoding with no cache. Returns the prompt followed by the new tokens, (1, T + n).
    if input_ids.dim() != 2 or input_ids.shape[0] != 1 or input_ids.shape[1] < 1:
        raise ValueError(f"input_ids must have shape (1, T) with T >= 1, got {tuple(input_ids.shape)}")
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    ids = input_ids
    with torch.no_grad():
        for _ in range(max_new_tokens):
            position_ids = torch.arange(ids.shape[1], device=ids.device)[None]  # (1, T)
            logits = model(ids, position_ids)                                     # (1, T, V): the whole sequence, again
            next_id = logits[0, -1].argmax()
            ids = torch.cat([ids, next_id.view(1, 1)], dim=1)                     # (1, T + 1)
            if eos_token_id is not None and next_id.item() == eos_token_id:
                break
    return ids
"""),
md(r"""
## 2. See the repetition

A **forward hook** is a function PyTorch calls each time a module runs, with the module's output.
We hang one on the key projection of layer 0 (`model.blocks[0].attn.k_proj`) and record what it
computes while the loop writes 8 tokens. Its output has one row per input token; reshaped into heads
it is the key tensor `(batch, kv_heads, tokens, head_dim)`. At each step we print its shape and one
fixed entry: head 1, **position 3**, dimension 5.
"""),
code(r"""
prompt_ids = tokenizer("The quick brown fox", return_tensors="pt").input_ids.to(env.device)   # (1, 4)
T0 = prompt_ids.shape[1]
seen_keys = []   # one (B, Hkv, T, D) tensor per call of layer 0's k_proj


def record_keys(module, inputs, output):
    B, T, _ = output.shape
    seen_keys.append(output.detach().view(B, T, cfg.n_kv_head, cfg.head_dim).transpose(1, 2).clone())


hook = model.blocks[0].attn.k_proj.register_forward_hook(record_keys)
out_uncached = greedy_generate(model, prompt_ids, max_new_tokens=8)
hook.remove()

print(repr(tokenizer.decode(out_uncached[0])))
for step, keys in enumerate(seen_keys):
    line = f"step {step}: layer-0 keys {str(tuple(keys.shape)):15}  keys[0, 1, 3, 5] = {keys[0, 1, 3, 5].item():+.6f}"
    if step > 0:
        change = (keys[:, :, :-1] - seen_keys[step - 1]).abs().max().item()   # rows that existed at the last step
        line += f"   earlier rows changed by at most {change:.1e}"
    print(line)
"""),
md(r"""
The token axis (the third) grows by one per step, and the entry at position 3 does not change. The
loop recomputes it, and every other earlier row, at every step, and gets the same numbers again. (If a
step shows a tiny change, that is rounding: $10^{-6}$ or less in float32, up to about $10^{-2}$ in 16-bit
floats on a GPU. A matrix product with a different number of rows may add up its terms in a different
order. No new information.) Count the rows computed
against the rows that were new:
"""),
code(r"""
rows_uncached = [k.shape[2] for k in seen_keys]          # rows of keys computed at each step
total_len = T0 + len(rows_uncached) - 1                  # positions that exist by the last step
print(f"layer 0 computed {sum(rows_uncached)} key rows; only {total_len} distinct positions exist: "
      f"{sum(rows_uncached) - total_len} rows were recomputations")


def draw_work(ax, rows_per_step, prompt_len, title):
    # One row per forward call, one column per position: was this position's key new, or computed before?
    n_steps = len(rows_per_step)
    grid = torch.zeros(n_steps, prompt_len + n_steps - 1)           # cpu: a picture for matplotlib; 0 = not computed
    done = 0                                                        # positions computed in earlier calls
    for step, rows in enumerate(rows_per_step):
        end = prompt_len + step                                     # this call covers positions [end - rows, end)
        grid[step, end - rows:end] = 1                              # recomputed
        grid[step, max(done, end - rows):end] = 2                   # new this step
        done = max(done, end)
    ax.imshow(grid, cmap=ListedColormap(["white", "#d62728", "#1f77b4"]), vmin=0, vmax=2)
    ax.set_xticks(range(grid.shape[1])); ax.set_yticks(range(n_steps))
    ax.set_xticks([x - 0.5 for x in range(grid.shape[1] + 1)], minor=True)
    ax.set_yticks([y - 0.5 for y in range(n_steps + 1)], minor=True)
    ax.grid(which="minor", color="white", lw=1.5); ax.tick_params(which="minor", length=0)
    ax.set_xlabel("position"); ax.set_ylabel("forward call (step)")
    recomputed = int((grid == 1).sum())
    ax.set_title(f"{title}\n{int(grid.bool().sum())} key rows computed, {recomputed} of them recomputed", fontsize=10)


fig, ax = plt.subplots(figsize=(5, 3.8), layout="constrained")
draw_work(ax, rows_uncached, T0, "lab 01 loop, layer 0")
ax.legend(handles=[Patch(color="#1f77b4", label="new"),
                   Patch(color="#d62728", label="recomputed")],
          loc="upper left", bbox_to_anchor=(1, 1))
plt.show()
"""),
md(r"""
The same picture holds for the values, for every one of the 30 layers, and in fact for everything the
model computes about an old token (its query, its MLP, its norms): all of it is recomputed each step.
The red area grows with the square of the length; the blue diagonal is all the work that is needed.

## 3. What to keep, and why it is enough

Look at what attention at one layer needs to compute the output of the newest token $t$:

- its own **query** $q_t$,
- the **keys** $k_0 \dots k_t$ and **values** $v_0 \dots v_t$ of this layer, for itself and every earlier token.

Attention is causal, so the key and value of token $j$ depend only on tokens $0 \dots j$. Once
token $j$ has gone through the model, its keys and values in every layer are final. Keep them, and
a later step never needs token $j$ again: not its query (a query only serves its own token's output,
which we already used), not its MLP, nothing else. That store, one `(K, V)` pair per layer, is the
**KV cache**. Generation now has two phases:

- **Prefill**: one forward pass over the whole prompt. It fills the cache and predicts the first new token.
- **Decode**: one forward pass per new token, fed **only that token**. Each layer computes its q, k, v,
  appends k and v to the cache, and lets q attend over the whole cache.

One layer during a decode step, with `n` tokens already cached (SmolLM2: H = 9 query heads,
Hkv = 3 KV heads, D = 64 numbers per head):

```
 x (B, 1, C): the newest token only
   ├── q_proj, rope ──► q      (B, H,   1,   D)
   ├── k_proj, rope ──► k_new  (B, Hkv, 1,   D) ──┐
   └── v_proj ────────► v_new  (B, Hkv, 1,   D) ──┤ torch.cat on the token axis
                                                  │
   cache in:            k, v   (B, Hkv, n,   D) ──┤
   cache out:           k, v   (B, Hkv, n+1, D) ◄─┘ ──► returned, passed to the next step
                          │
                          │ repeat each KV head for its group of query heads
                          ▼
                        k, v   (B, H,   n+1, D)
   y = softmax(q kᵀ / √D) v ──► (B, H, 1, D) ──► merge heads, o_proj ──► (B, 1, C)
```

Three details decide whether the numbers come out right.

**Positions.** The new token sits at position `n`, the number of tokens already cached. Llama rotates
its query and key by the angle of position `n` (RoPE); GPT-2 adds the position-`n` embedding. Since
the model only sees the new token, the position id is the only way it learns where that token is.

**Grouped-query attention (GQA).** SmolLM2 has 9 query heads but only 3 key/value heads: query head
`h` reads KV head `h // 3`. Cache the 3 KV heads, and repeat them to 9 (`repeat_interleave` on the head
axis: 0, 0, 0, 1, 1, 1, 2, 2, 2) only for the attention product. A cache of the repeated heads would be
3 times larger for the same information: GQA exists to make the cache small.

**The causal mask.** A query may attend to the keys at its own position and before. Which entries of
the score matrix (one row per query, one column per key) that allows depends on how many keys were
cached before. PyTorch's
`scaled_dot_product_attention(..., is_causal=True)` assumes query $i$ sits at key position $i$: right
when there is no cache, wrong as soon as there is. Let's measure what it does. With every score equal
and the values set to the identity matrix, the attention output *is* the attention matrix.
"""),
code(r"""
def attention_pattern(n_queries: int, n_keys: int, **sdpa_kwargs) -> torch.Tensor:
    # Which keys each query reads (True = weight > 0), as SDPA computes it.
    q = torch.zeros(1, 1, n_queries, 8)              # cpu: a picture of SDPA's masks; equal scores everywhere
    k = torch.zeros(1, 1, n_keys, 8)                 # cpu: (as above)
    v = torch.eye(n_keys)[None, None]                # cpu: (1, 1, n_keys, n_keys): output row = attention row
    return F.scaled_dot_product_attention(q, k, v, **sdpa_kwargs)[0, 0] > 0


def allowed(n_queries: int, n_past: int) -> torch.Tensor:
    # The rule: query i sits at position n_past + i and may read keys 0 .. n_past + i.
    return torch.tensor([[j <= n_past + i for j in range(n_past + n_queries)] for i in range(n_queries)])  # cpu: as above


panels = [
    ("prefill, 5 tokens\nis_causal=True", attention_pattern(5, 5, is_causal=True), allowed(5, 0)),
    ("decode, 1 token after 5\nis_causal=True", attention_pattern(1, 6, is_causal=True), allowed(1, 5)),
    ("decode, 1 token after 5\nno mask", attention_pattern(1, 6), allowed(1, 5)),
    ("3 tokens after 4\nis_causal=True", attention_pattern(3, 7, is_causal=True), allowed(3, 4)),
    ("3 tokens after 4\nthe rule you need", allowed(3, 4), allowed(3, 4)),
]
fig, axes = plt.subplots(1, len(panels), figsize=(14, 2.6), layout="constrained",
                         gridspec_kw={"width_ratios": [p[1].shape[1] for p in panels]})
for ax, (title, got, want) in zip(axes, panels):
    ok = torch.equal(got, want)
    ax.imshow(got, cmap=ListedColormap(["#f2f2f2", "#1f77b4" if ok else "#d62728"]), vmin=0, vmax=1)
    ax.set_title(f"{title}\n{'right' if ok else 'WRONG'}", fontsize=9, color="black" if ok else "#d62728")
    ax.set_xticks(range(got.shape[1])); ax.set_yticks(range(got.shape[0]))
    ax.set_xticks([x - 0.5 for x in range(got.shape[1] + 1)], minor=True)
    ax.set_yticks([y - 0.5 for y in range(got.shape[0] + 1)], minor=True)
    ax.grid(which="minor", color="white", lw=1.5); ax.tick_params(which="minor", length=0)
    ax.set_xlabel("key position"); ax.set_ylabel("query")
plt.show()
print("is_causal=True, 1 query, 6 keys: the query reads keys", attention_pattern(1, 6, is_causal=True)[0].nonzero().flatten().tolist())
"""),
md(r"""
With a cache, `is_causal=True` aligns the triangle to the **top-left**: a single decode query reads
only key 0, and a chunk of new tokens loses most of its past. The rule is a triangle aligned to the
**bottom-right**: query $i$ of $T$ new tokens, after $n$ cached ones, reads keys $0 \dots n + i$.
Three cases follow:

| case | queries | keys | mask |
|---|---|---|---|
| prefill (nothing cached) | $T$ | $T$ | causal: `is_causal=True` is right here |
| decode (one new token) | 1 | $n + 1$ | none: the newest token may read every key |
| $T > 1$ new tokens after $n$ cached (a chunk appended) | $T$ | $n + T$ | bottom-right: build it yourself as a boolean `attn_mask` (True = may attend) |

The third case is not exotic: a chat appends the user's next message to a conversation already in the
cache, chunked prefill feeds a long prompt in pieces, and speculative decoding (lab 08) checks several
drafted tokens in one pass.

## Problem 1: Attention with a KV cache (3 points)

`CachedAttention` is the model's `Attention` (same projections, same weights) with a new `forward`.
It receives only the **new** tokens `x`, the rope tables of **their** positions (`None` in the GPT-2
family), and the cache of this layer from the last call. Steps:

1. Project `x` to `q`, `k`, `v` and split heads, as `Attention.forward` does (open
   `course/models/decoder.py`); rotate `q` and `k` with `apply_rope` when `rope` is not `None`.
2. If `kv_cache` holds `(past_k, past_v)`, put them **in front** of `k` and `v` with `torch.cat` on the
   token axis. Which axis is that in `(B, Hkv, T, D)`?
3. `(k, v)` with their `Hkv` heads are the new cache of this layer: keep them before any repeat.
4. Repeat each KV head for its group of query heads (`repeat_interleave` on the head axis).
5. Attention with the mask of the table above: `is_causal=True` when there is no past, no mask for a
   single new token, an explicit boolean `attn_mask` of shape `(T, n + T)` otherwise.
6. Merge the heads and apply `o_proj`, as before.

**Deliverable:** `CachedAttention.forward(x, rope, kv_cache=None)` returns `(y, (k, v))`: `y` of shape
`(B, T, C)` equal to what the uncached `Attention` gives for these tokens when run on the whole
sequence, and the extended cache, `k` and `v` of shape `(B, n_kv_head, n + T, head_dim)`.
"""),
solution("cached_attention", r"""
class CachedAttention(Attention):
    # Attention that reads the keys and values of earlier tokens from a cache and returns the extended cache.

    def forward(self, x: torch.Tensor, rope, kv_cache: tuple[torch.Tensor, torch.Tensor] | None = None):
        # x: (B, T, C), the T new tokens. rope: cos, sin of their positions, or None (GPT-2).
        # kv_cache: None, or (k, v) of the n earlier tokens, each (B, Hkv, n, D).
        # Returns y (B, T, C) and the new cache (k, v), each (B, Hkv, n + T, D).
        ### BEGIN SOLUTION
        B, T, _ = x.shape
        H, Hkv, D = self.cfg.n_head, self.cfg.n_kv_head, self.cfg.head_dim
        q = self.q_proj(x).view(B, T, H, D).transpose(1, 2)       # (B, H, T, D)
        k = self.k_proj(x).view(B, T, Hkv, D).transpose(1, 2)     # (B, Hkv, T, D)
        v = self.v_proj(x).view(B, T, Hkv, D).transpose(1, 2)     # (B, Hkv, T, D)
        if rope is not None:
            q, k = apply_rope(q, *rope), apply_rope(k, *rope)     # rotated by the NEW tokens' positions
        if kv_cache is not None:
            past_k, past_v = kv_cache
            k = torch.cat([past_k, k], dim=2)                     # (B, Hkv, n + T, D): the token axis
            v = torch.cat([past_v, v], dim=2)
        new_cache = (k, v)                                        # Hkv heads: the GQA saving
        k = k.repeat_interleave(self.cfg.group_size, dim=1)       # (B, H, n + T, D)
        v = v.repeat_interleave(self.cfg.group_size, dim=1)
        n_keys = k.shape[2]
        if n_keys == T:                                           # no past: plain causal attention
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        elif T == 1:                                              # one new token reads every key
            y = F.scaled_dot_product_attention(q, k, v)
        else:                                                     # T new tokens after n: bottom-right causal
            mask = torch.ones(T, n_keys, dtype=torch.bool, device=x.device).tril(diagonal=n_keys - T)
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        y = y.transpose(1, 2).reshape(B, T, H * D)                # (B, T, C)
        return self.o_proj(y), new_cache
        ### END SOLUTION
"""),
md(r"""
The test builds a small attention layer with random weights (4 query heads, 2 KV heads), runs the
uncached `Attention` on 7 tokens at once, and asks your layer for the same outputs in three calls:
a prefill of 4 tokens, one decode step, then 2 tokens appended at once.
"""),
tests("cached_attention_tests", 3, r"""
from course.expect import expect_tensor, expect_tuple

def attend(layer, x, rope, cache=None):   # your layer's answer, (y, (k, v)), checked before it is compared
    try:
        out = layer(x, rope, cache)
    except RuntimeError as e:               # a shape mismatch that appears only once there is a cache
        if cache is None:
            raise
        raise AssertionError(f"CachedAttention.forward with a cache of {cache[0].shape[2]} tokens raised RuntimeError: "
                             f"{str(e).splitlines()[0]} Do you append the new keys and values on the token axis, "
                             f"dim=2 of (B, n_kv_head, tokens, head_dim)?") from None
    y, kv = expect_tuple(out, "CachedAttention.forward(...)", 2)
    k, v = expect_tuple(kv, "the cache it returns", 2)
    B, T, C = x.shape
    return (expect_tensor(y, "y", dtype=x.dtype, shape=(B, T, C), device=x.device),
            (expect_tensor(k, "the cached k", dtype=x.dtype, ndim=4, device=x.device),
             expect_tensor(v, "the cached v", dtype=x.dtype, ndim=4, device=x.device)))

dev = env.device
torch.manual_seed(0)
tiny_cfg = course.ModelConfig(family="llama", vocab_size=64, n_layer=1, n_head=4, n_kv_head=2, d_model=32, d_ff=64, max_seq_len=64)
ref_attn = Attention(tiny_cfg, 0).eval().to(dev)          # the uncached layer: our reference
attn = CachedAttention(tiny_cfg, 0).eval().to(dev)
attn.load_state_dict(ref_attn.state_dict())              # the same weights
x = torch.randn(1, 7, tiny_cfg.d_model, device=dev)
cos, sin = rope_cos_sin(torch.arange(7, device=dev)[None], tiny_cfg.head_dim, tiny_cfg.rope_theta)
rope_of = lambda a, b: (cos[:, a:b], sin[:, a:b])        # rope tables of positions a .. b-1
with torch.no_grad():
    full = ref_attn(x, rope_of(0, 7))                    # (1, 7, C): all 7 tokens in one uncached call
    y, (k, v) = attend(attn, x[:, :4], rope_of(0, 4))    # prefill: positions 0-3
    assert k.shape == v.shape == (1, 2, 4, 8), \
        f"the cache holds (B, n_kv_head, tokens, head_dim) = (1, 2, 4, 8); got {tuple(k.shape)}. Cache the KV heads BEFORE repeating them"
    assert torch.allclose(y, full[:, :4], atol=1e-5), \
        "prefill differs from uncached attention: check the causal mask, and that query head h reads KV head h // group_size (repeat_interleave)"
    y, (k, v) = attend(attn, x[:, 4:5], rope_of(4, 5), (k, v))   # decode: one token at position 4
    assert k.shape == (1, 2, 5, 8), f"after one decode step the cache holds 5 tokens: (1, 2, 5, 8); got {tuple(k.shape)}"
    assert torch.allclose(y, full[:, 4:5], atol=1e-5), \
        "one-token decode differs: the new token may attend to EVERY cached key (is_causal=True lets it see only key 0)"
    y, (k, v) = attend(attn, x[:, 5:7], rope_of(5, 7), (k, v))   # 2 tokens appended at once
    assert torch.allclose(y, full[:, 5:7], atol=1e-5), \
        "2 tokens after 5 cached: query i may read keys 0 .. 5 + i (a bottom-right causal mask, not is_causal=True)"
### BEGIN HIDDEN TESTS
def _check_attention(family, n_head, n_kv_head, batch, chunks, seed):
    # chunks: sizes of the successive calls, e.g. (3, 1, 1, 4, 1): a prefill, decode steps, an appended chunk
    torch.manual_seed(seed)
    c = course.ModelConfig(family=family, vocab_size=64, n_layer=1, n_head=n_head, n_kv_head=n_kv_head,
                           d_model=8 * n_head, d_ff=64, max_seq_len=64)
    ref = Attention(c, 0).eval().to(dev)
    mine = CachedAttention(c, 0).eval().to(dev)
    mine.load_state_dict(ref.state_dict())
    total = sum(chunks)
    x = torch.randn(batch, total, c.d_model, device=dev)
    pos = torch.arange(total, device=dev)[None].expand(batch, total)
    if family == "llama":
        co, si = rope_cos_sin(pos, c.head_dim, c.rope_theta)
        rope = lambda a, b: (co[:, a:b], si[:, a:b])
    else:
        rope = lambda a, b: None
    with torch.no_grad():
        want = ref(x, rope(0, total))
        cache, start = None, 0
        for size in chunks:
            before = None if cache is None else (cache[0].clone(), cache[1].clone())
            y, cache = attend(mine, x[:, start:start + size], rope(start, start + size), cache)
            tag = f"{family}, {n_head} query / {n_kv_head} KV heads, batch {batch}, {size} token(s) after {start}"
            assert cache[0].shape == cache[1].shape == (batch, n_kv_head, start + size, 8), \
                f"{tag}: the cache must be (B, n_kv_head, n + T, head_dim), here {(batch, n_kv_head, start + size, 8)}; " \
                f"got {tuple(cache[0].shape)}"
            if before is not None:
                assert torch.equal(cache[0][:, :, :start], before[0]) and torch.equal(cache[1][:, :, :start], before[1]), \
                    f"{tag}: the new cache must start with the old one"
            assert torch.allclose(y, want[:, start:start + size], atol=1e-5), f"{tag}: output differs from uncached attention"
            start += size


_check_attention("llama", 4, 2, 1, (3, 1, 1, 4, 1, 2), seed=1)   # GQA, groups of 2: repeat vs repeat_interleave
_check_attention("llama", 6, 3, 2, (5, 1, 3, 1), seed=2)         # GQA, batch of 2
_check_attention("llama", 4, 1, 1, (1, 1, 1, 5, 1), seed=3)      # MQA, a one-token prompt
_check_attention("gpt2", 4, 4, 2, (4, 1, 1, 3), seed=4)          # MHA, no rope
_check_attention("llama", 4, 4, 1, (6, 2, 1), seed=5)            # MHA with rope
# an empty cache (0 tokens) behaves like no cache
torch.manual_seed(6)
ref = Attention(tiny_cfg, 0).eval().to(dev)
mine = CachedAttention(tiny_cfg, 0).eval().to(dev)
mine.load_state_dict(ref.state_dict())
x6 = torch.randn(1, 3, tiny_cfg.d_model, device=dev)
co, si = rope_cos_sin(torch.arange(3, device=dev)[None], tiny_cfg.head_dim, tiny_cfg.rope_theta)
empty = (torch.zeros(1, 2, 0, 8, device=dev), torch.zeros(1, 2, 0, 8, device=dev))
with torch.no_grad():
    y, (k, v) = attend(mine, x6, (co, si), empty)
    assert k.shape == (1, 2, 3, 8) and torch.allclose(y, ref(x6, (co, si)), atol=1e-5), "an empty cache acts as no cache"
### END HIDDEN TESTS
"""),
md(r"""
## Problem 2: Thread the cache through the model (2 points)

Each layer has its own cache, so the model's cache is a **list** with one `(k, v)` per layer. The
block and the decoder only pass it along:

- `CachedBlock.forward(x, rope, kv_cache=None)` hands its layer's cache to its attention and returns
  `(x, new_kv)`; the residual connections, norms and MLP are as in `Block.forward`.
- `CachedDecoder.forward(input_ids, position_ids, kv_cache=None)` embeds the new tokens at their
  positions (as `Decoder.forward` does), gives block `i` the entry `kv_cache[i]` (all `None` when
  `kv_cache` is `None`: a prefill), collects each block's new cache in a **new list**, and returns
  `(logits, new_kv_cache)`.

The decoder never computes positions itself: the caller passes `position_ids` for the new tokens
(`n, n+1, ...`), and they drive both RoPE and GPT-2's position embedding.

**Deliverable:** the two `forward` methods below. `__init__` is given: it builds the same modules as
`Block` and `Decoder`, with your cached classes inside, so the weights of a loaded model fit as they are.
"""),
solution("cached_block", r"""
class CachedBlock(Block):
    def __init__(self, cfg, layer_idx: int):
        super().__init__(cfg, layer_idx)
        self.attn = CachedAttention(cfg, layer_idx)          # same weights' shapes, your forward

    def forward(self, x: torch.Tensor, rope, kv_cache=None):
        # x: (B, T, C) for the new tokens. Returns (x, new_kv) where new_kv = (k, v) of this layer.
        ### BEGIN SOLUTION
        h, new_kv = self.attn(self.attn_norm(x), rope, kv_cache)
        x = x + h
        x = x + self.mlp(self.mlp_norm(x))
        return x, new_kv
        ### END SOLUTION
"""),
solution("cached_decoder", r"""
class CachedDecoder(Decoder):
    def __init__(self, cfg):
        super().__init__(cfg)
        self.blocks = nn.ModuleList(CachedBlock(cfg, i) for i in range(cfg.n_layer))

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, kv_cache: list | None = None):
        # input_ids, position_ids: (B, T) for the NEW tokens. kv_cache: None (prefill) or one (k, v) per layer.
        # Returns logits (B, T, V) and the new cache: a list of n_layer (k, v) pairs, each (B, Hkv, n + T, D).
        ### BEGIN SOLUTION
        check_ids(input_ids, position_ids, self.cfg)
        x = self.embed(input_ids)                                 # (B, T, C)
        rope = None
        if self.cfg.family == "gpt2":
            x = x + self.pos_embed(position_ids)                  # positions n, n+1, ...: given by the caller
        else:
            rope = rope_cos_sin(position_ids, self.cfg.head_dim, self.cfg.rope_theta, x.dtype)   # as Decoder.forward
        if kv_cache is None:
            kv_cache = [None] * len(self.blocks)                  # prefill: nothing cached yet
        new_cache = []
        for block, layer_cache in zip(self.blocks, kv_cache):
            x, layer_cache = block(x, rope, layer_cache)          # each layer reads and extends ITS cache
            new_cache.append(layer_cache)
        return self.lm_head(self.norm(x)), new_cache              # (B, T, V), n_layer x (k, v)
        ### END SOLUTION
"""),
md(r"""
Two given helpers. `with_kv_cache(model)` turns a loaded `Decoder` into your `CachedDecoder` with the
**same** weight tensors (no copy: the modules are built on PyTorch's `meta` device, which allocates
nothing, and then take the model's tensors). `random_decoder(...)` builds a tiny model with random
weights, for tests that must be fast. Each test grades its own problem: the test of Problem 2 runs
your decoder on the course's `CachedAttention` (`course/engine/kv_cache.py`, lab 03's answers
released), and the tests of Problem 3 run your loop on the course's `CachedDecoder`, so one mistake
costs the points of one problem only.
"""),
locked("helpers", r"""
from course.engine import kv_cache as course_kv   # lab 03's answers, released: the tests grade each problem on its own


def with_kv_cache(model: Decoder) -> CachedDecoder:
    # A CachedDecoder (yours) sharing model's weight tensors: same numbers, your cached forward.
    return course_kv.with_kv_cache(model, CachedDecoder)


def random_decoder(family: str = "llama", n_head: int = 4, n_kv_head: int = 2, n_layer: int = 3, seed: int = 0) -> Decoder:
    # A tiny Decoder with random weights, large enough that every layer and head changes the output.
    c = course.ModelConfig(family=family, vocab_size=97, n_layer=n_layer, n_head=n_head, n_kv_head=n_kv_head,
                           d_model=8 * n_head, d_ff=64, max_seq_len=64,
                           tie_embeddings=False)   # a tied random model mostly repeats its last token
    g = torch.Generator().manual_seed(seed)
    m = Decoder(c).eval()
    with torch.no_grad():
        for name, p in m.named_parameters():
            noise = torch.randn(p.shape, generator=g)              # cpu: a seeded draw; the model moves to env.device below
            if p.dim() == 2:                                   # matrices and embeddings
                p.copy_(0.3 * noise)
            elif "norm" in name and name.endswith("weight"):   # norm scales around 1
                p.copy_(1 + 0.1 * noise)
            else:                                              # biases
                p.copy_(0.1 * noise)
    return m.to(env.device)
"""),
md(r"""
The test runs a tiny 3-layer GQA model without a cache on 9 tokens, then yours: a prefill of 6 tokens
and 3 decode steps. The logits of each new token must be those of the uncached model at that position.
Then the same on SmolLM2 itself.
"""),
tests("cached_decoder_tests", 2, r"""
from course.expect import expect_tensor, expect_tuple, expect_type, substituted

def step(m, ids, pos, cache=None):   # your decoder's answer, (logits, cache), checked before it is compared
    logits, new = expect_tuple(m(ids, pos, cache), "CachedDecoder.forward(...)", 2)
    B, T = ids.shape
    logits = expect_tensor(logits, "the logits", shape=(B, T, m.cfg.vocab_size), device=ids.device)
    new = expect_type(new, "the cache CachedDecoder returns (a list of (k, v), one per layer)", list)
    assert len(new) == m.cfg.n_layer, f"return one (k, v) per layer: a list of {m.cfg.n_layer}, got {len(new)}"
    for i, kv in enumerate(new):
        k, v = expect_tuple(kv, f"cache[{i}]", 2)
        expect_tensor(k, f"cache[{i}][0] (k)", ndim=4, device=ids.device), expect_tensor(v, f"cache[{i}][1] (v)", ndim=4, device=ids.device)
    return logits, new

dev = env.device
with substituted(globals(), CachedAttention=course_kv.CachedAttention):   # Problem 2 graded on its own
    tiny = random_decoder("llama", n_head=4, n_kv_head=2, n_layer=3, seed=0)
    ctiny = with_kv_cache(tiny)
    cmodel = with_kv_cache(model_fp32)
seq = torch.randint(0, 97, (1, 9), generator=torch.Generator().manual_seed(0)).to(dev)
pos = torch.arange(9, device=dev)[None]
with torch.no_grad():
    full = tiny(seq, pos)                                             # uncached: logits at all 9 positions
    logits, cache = step(ctiny, seq[:, :6], pos[:, :6])               # prefill 6 tokens
    assert all(k.shape == v.shape == (1, 2, 6, 8) for k, v in cache), "each layer caches (B, n_kv_head, 6, head_dim) after a 6-token prefill"
    assert torch.allclose(logits, full[:, :6], atol=1e-4), "prefill logits differ from the uncached model"
    for t in (6, 7, 8):                                               # decode: feed ONLY token t, at position t
        logits, cache = step(ctiny, seq[:, t:t + 1], pos[:, t:t + 1], cache)
        assert torch.allclose(logits, full[:, t:t + 1], atol=1e-4), \
            f"decode at position {t} differs from the uncached model: does block i get kv_cache[i], and does the list you return hold each block's NEW cache?"
# the real model (float32): prefill, then two decode steps
ids = tokenizer("The cache keeps the keys", return_tensors="pt").input_ids.to(dev)
T = ids.shape[1]
positions = torch.arange(T, device=dev)[None]
with torch.no_grad():
    full = model_fp32(ids, positions)
    logits, cache = step(cmodel, ids[:, :T - 2], positions[:, :T - 2])
    for t in (T - 2, T - 1):
        logits, cache = step(cmodel, ids[:, t:t + 1], positions[:, t:t + 1], cache)
        assert torch.allclose(logits, full[:, t:t + 1], atol=1e-3), f"SmolLM2: decode logits at position {t} differ from the uncached model"
assert cache[0][0].shape == (1, cfg.n_kv_head, T, cfg.head_dim), \
    f"SmolLM2's cache holds (1, {cfg.n_kv_head}, {T}, {cfg.head_dim}) per layer after {T} tokens; got {tuple(cache[0][0].shape)}"
### BEGIN HIDDEN TESTS
def _check_decoder(family, n_head, n_kv_head, n_layer, batch, chunks, seed):
    ref = random_decoder(family, n_head=n_head, n_kv_head=n_kv_head, n_layer=n_layer, seed=seed)
    with substituted(globals(), CachedAttention=course_kv.CachedAttention):
        mine = with_kv_cache(ref)
    total = sum(chunks)
    g = torch.Generator().manual_seed(seed)
    ids_ = torch.randint(0, 97, (batch, total), generator=g).to(dev)
    pos_ = torch.arange(total, device=dev)[None].expand(batch, total).contiguous()
    with torch.no_grad():
        want = ref(ids_, pos_)
        cache, start = None, 0
        for size in chunks:
            got, cache = step(mine, ids_[:, start:start + size], pos_[:, start:start + size], cache)
            tag = f"{family}, {n_head}/{n_kv_head} heads, {n_layer} layers, batch {batch}, {size} token(s) after {start}"
            for i, (k, v) in enumerate(cache):
                assert k.shape == v.shape == (batch, n_kv_head, start + size, 8), f"{tag}: layer {i} cache shape {tuple(k.shape)}"
            assert torch.allclose(got, want[:, start:start + size], atol=1e-4), f"{tag}: logits differ from the uncached model"
            start += size
        # every layer has its own keys: no two layers may hold the same tensor
        assert all(not torch.equal(cache[i][0], cache[j][0]) for i in range(n_layer) for j in range(i)), \
            "each layer must return its own cache"


for _args in (("llama", 4, 2, 3, 1, (4, 1, 1, 1, 1), 10),
              ("gpt2", 4, 4, 2, 2, (5, 1, 1, 3, 1), 11),      # MHA, learned positions, batch 2, a chunk
              ("llama", 6, 2, 4, 2, (3, 2, 1, 1), 12),
              ("llama", 4, 1, 2, 1, (1, 1, 1, 1, 1, 1), 13)):  # MQA from a one-token prompt
    _check_decoder(*_args)
### END HIDDEN TESTS
"""),
md(r"""
## Problem 3: Generate with the cache (3 points)

Now the loop. Compared with lab 01 it splits in two:

1. **Prefill, once:** run the whole prompt with position ids `0 .. T-1` and no cache. The last row of
   the logits gives the first new token; keep the returned cache.
2. **Decode, in a loop:** feed the model **only the token just chosen**, shape `(1, 1)`, with its
   position id (how many tokens are already cached?) and the cache from the previous call. The
   logits `(1, 1, V)` give the next token; the returned cache replaces the old one.
3. Stop after `max_new_tokens` tokens, or right after appending `eos_token_id` (kept in the output).
   The last token needs no forward pass of its own: `n` new tokens take exactly `n` calls of the model
   (fewer when EOS stops it early), as in `generate`.

**Deliverable:** `cached_generate(model, input_ids, max_new_tokens, eos_token_id=None)` for a
`CachedDecoder`, returning `(1, T + n)` token ids equal to `greedy_generate` and to Hugging Face's
greedy `generate`, token for token. Raise `ValueError` as `greedy_generate` does (input not `(1, T)`
with `T >= 1`, negative `max_new_tokens`).
"""),
solution("cached_generate", r"""
def cached_generate(model: CachedDecoder, input_ids: torch.Tensor, max_new_tokens: int,
                    eos_token_id: int | None = None) -> torch.Tensor:
    ### BEGIN SOLUTION
    if input_ids.dim() != 2 or input_ids.shape[0] != 1 or input_ids.shape[1] < 1:
        raise ValueError(f"input_ids must have shape (1, T) with T >= 1, got {tuple(input_ids.shape)}")
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    ids = input_ids
    if max_new_tokens == 0:
        return ids
    with torch.no_grad():
        T = ids.shape[1]
        logits, cache = model(ids, torch.arange(T, device=ids.device)[None])   # prefill: (1, T, V), cache of T tokens
        for step in range(max_new_tokens):
            next_id = logits[0, -1].argmax().view(1, 1)                         # (1, 1)
            ids = torch.cat([ids, next_id], dim=1)
            if step == max_new_tokens - 1 or (eos_token_id is not None and next_id.item() == eos_token_id):
                break                                                           # done: no forward for the last token
            position = torch.tensor([[ids.shape[1] - 1]], device=ids.device)    # = tokens already cached
            logits, cache = model(next_id, position, cache)                     # decode: (1, 1, V)
    return ids
    ### END SOLUTION
"""),
code(r"""
cmodel = with_kv_cache(model)
text_ids = cached_generate(cmodel, prompt_ids, max_new_tokens=20, eos_token_id=tokenizer.eos_token_id)
print(repr(tokenizer.decode(text_ids[0])))
"""),
tests("cached_generate_matches", 2, r"""
from course.expect import expect_tensor

def generated(m, ids, n, **kwargs):   # your loop's answer, checked before it is compared
    return expect_tensor(cached_generate(m, ids, n, **kwargs), f"cached_generate(..., {n})", dtype=torch.long, ndim=2,
                         device=ids.device)

course_cached = course_kv.with_kv_cache(model_fp32)           # the course's CachedDecoder: Problem 3 graded on its own
ids = tokenizer("My trip to Yosemite was", return_tensors="pt").input_ids.to(env.device)
fast = generated(course_cached, ids, 16)
slow = greedy_generate(model_fp32, ids, max_new_tokens=16)
assert fast.shape == slow.shape, f"expected the prompt + 16 tokens, shape {tuple(slow.shape)}; got {tuple(fast.shape)}"
assert torch.equal(fast[:, :ids.shape[1]], ids), "the output starts with the prompt"
assert torch.equal(fast, slow), \
    "cached and uncached generation differ: check the decode position id (tokens already cached) and that you pass the cache back"
### BEGIN HIDDEN TESTS
ids_ = tokenizer("def add(a, b):", return_tensors="pt").input_ids.to(env.device)
want = hf_model.generate(ids_, max_new_tokens=16, do_sample=False)
got = generated(course_cached, ids_, 16)
assert torch.equal(got, want), "differs from hf generate for 'def add(a, b):'"
chat = tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France? Answer in one word."}],
                                     add_generation_prompt=True, return_tensors="pt")
chat = (chat if isinstance(chat, torch.Tensor) else chat["input_ids"]).to(env.device)
want = hf_model.generate(chat, max_new_tokens=24, do_sample=False, eos_token_id=tokenizer.eos_token_id)
assert want[0, -1].item() == tokenizer.eos_token_id and want.shape[1] < chat.shape[1] + 24, "the reference must stop at EOS"
got = generated(course_cached, chat, 24, eos_token_id=tokenizer.eos_token_id)
assert torch.equal(got, want), "stop right after appending eos_token_id, and keep it"


def _ref_greedy(m, x, n, eos=None):
    # uncached greedy loop: the whole sequence at every step
    with torch.no_grad():
        for _ in range(n):
            nxt = m(x, torch.arange(x.shape[1], device=x.device)[None])[0, -1].argmax().view(1, 1)
            x = torch.cat([x, nxt], 1)
            if eos is not None and nxt.item() == eos:
                break
    return x


for fam, h, hkv, seed in (("llama", 4, 2, 20), ("gpt2", 4, 4, 21), ("llama", 6, 3, 22)):
    ref = random_decoder(fam, n_head=h, n_kv_head=hkv, n_layer=2, seed=seed)
    start_ = torch.tensor([[3, 14, 15, 92]], device=env.device)
    want = _ref_greedy(ref, start_, 20)
    got = generated(course_kv.with_kv_cache(ref), start_, 20)
    assert torch.equal(got, want), f"tiny {fam} model ({h}/{hkv} heads): cached generation differs from the uncached loop"
    one = torch.tensor([[7]], device=env.device)
    assert torch.equal(generated(course_kv.with_kv_cache(ref), one, 12), _ref_greedy(ref, one, 12)), f"tiny {fam}: a one-token prompt"
### END HIDDEN TESTS
"""),
md(r"""
The next test watches the calls your loop makes: it wraps the model in a `Recorder` that writes down
what each call receives.
"""),
tests("cached_generate_calls", 1, r"""
class Recorder:
    # Wraps a CachedDecoder; records (input_ids, position_ids, tokens in the cache passed in) per call.
    def __init__(self, inner):
        self.inner, self.calls = inner, []

    def __call__(self, input_ids, position_ids, kv_cache=None):
        n_cached = None if kv_cache is None else kv_cache[0][0].shape[2]
        self.calls.append((input_ids.clone(), position_ids.clone(), n_cached))
        return self.inner(input_ids, position_ids, kv_cache)

    forward = __call__

    def __getattr__(self, name):
        return getattr(self.inner, name)


from course.expect import expect_tensor

rec = Recorder(course_kv.with_kv_cache(random_decoder("llama", seed=1)))   # the course's CachedDecoder: Problem 3 alone
prompt = torch.tensor([[5, 6, 7, 8, 9]], device=env.device)
out = expect_tensor(cached_generate(rec, prompt, max_new_tokens=6), "cached_generate(rec, prompt, 6)", dtype=torch.long,
                    device=env.device)
assert out.shape == (1, 11), f"prompt (5) + 6 new tokens: (1, 11); got {tuple(out.shape)}"
assert len(rec.calls) == 6, f"6 new tokens take 6 calls (1 prefill + 5 decode steps); you made {len(rec.calls)}"
first_ids, first_pos, first_cache = rec.calls[0]
assert torch.equal(first_ids, prompt) and torch.equal(first_pos, torch.arange(5, device=env.device)[None]) \
    and first_cache is None, \
    "call 1 is the prefill: the whole prompt, positions 0..4, no cache"
for i, (x, p, n_cached) in enumerate(rec.calls[1:], start=1):
    assert x.shape == (1, 1), f"decode call {i + 1} must feed only the newest token, shape (1, 1); got {tuple(x.shape)}"
    assert x.item() == out[0, 4 + i].item(), f"decode call {i + 1} must feed the token chosen at the previous step"
    assert n_cached == 4 + i, f"decode call {i + 1} must pass the cache returned by the previous call ({4 + i} tokens); it held {n_cached}"
    assert p.tolist() == [[4 + i]], f"decode call {i + 1}: the new token sits at position {4 + i} (tokens already cached); you passed {p.tolist()}"
same = expect_tensor(cached_generate(rec, prompt, max_new_tokens=0), "cached_generate(rec, prompt, 0)", dtype=torch.long)
assert torch.equal(same, prompt), "max_new_tokens=0 returns the prompt unchanged"
### BEGIN HIDDEN TESTS
ref = random_decoder("gpt2", n_head=4, n_kv_head=4, n_layer=2, seed=30)
with torch.no_grad():   # find an EOS the model emits mid-way: the 4th token of a free run
    x = torch.tensor([[1, 2, 3]], device=env.device)
    for _ in range(10):
        x = torch.cat([x, ref(x, torch.arange(x.shape[1], device=env.device)[None])[0, -1].argmax().view(1, 1)], 1)
eos = x[0, 6].item()
first = (x[0, 3:] == eos).nonzero()[0, 0].item() + 3
rec = Recorder(course_kv.with_kv_cache(ref))
got = expect_tensor(cached_generate(rec, x[:, :3], max_new_tokens=10, eos_token_id=eos), "cached_generate(..., eos_token_id)",
                    dtype=torch.long, device=env.device)
assert torch.equal(got, x[:, :first + 1]), "stop right after the first EOS, keeping it"
assert len(rec.calls) == first + 1 - 3, (f"stopping at EOS: {got.shape[1] - 3} new tokens take {got.shape[1] - 3} calls "
                                         f"(the prefill, then one decode per token but the last); you made {len(rec.calls)}")
assert [c[1].tolist() for c in rec.calls[1:]] == [[[p]] for p in range(3, first)], "position ids of the decode calls"
for bad_ids, bad_n in ((prompt[0], 3), (prompt, -1), (prompt[:, :0], 2)):
    try:
        cached_generate(rec, bad_ids, max_new_tokens=bad_n)
    except ValueError:
        pass
    else:
        raise AssertionError(f"input_ids of shape {tuple(bad_ids.shape)} with max_new_tokens={bad_n} must raise ValueError")
### END HIDDEN TESTS
"""),
md(r"""
### See it: the work per step, with and without your cache

The same hook on layer 0's key projection, now on your cached model, while it writes the same 8
tokens. Compare with the picture from section 2.
"""),
code(r"""
seen_keys = []
hook = cmodel.blocks[0].attn.k_proj.register_forward_hook(record_keys)
out_cached = cached_generate(cmodel, prompt_ids, max_new_tokens=8)
hook.remove()
rows_cached = [k.shape[2] for k in seen_keys]
print("same tokens as the uncached loop:", torch.equal(out_cached, out_uncached))
print("key rows computed per call, uncached:", rows_uncached)
print("key rows computed per call, cached:  ", rows_cached)
print(f"position 3's key entry, computed once in the prefill: keys[0, 1, 3, 5] = {seen_keys[0][0, 1, 3, 5].item():+.6f}")

fig, axes = plt.subplots(1, 2, figsize=(9.5, 3.8), layout="constrained")
draw_work(axes[0], rows_uncached, T0, "lab 01 loop (no cache)")
draw_work(axes[1], rows_cached, T0, "your cached_generate")
axes[1].legend(handles=[Patch(color="#1f77b4", label="new"),
                        Patch(color="#d62728", label="recomputed")],
               loc="upper left", bbox_to_anchor=(1, 1))
plt.show()
"""),
md(r"""
The prefill computes the 4 prompt positions once; each decode call computes one row. Nothing is red:
every key is computed exactly once. The price is memory: all those keys and values now stay alive.

## Problem 4: How big is the cache? (2 points)

The cache holds, for every layer, a key and a value vector of `head_dim` numbers for every KV head,
every cached token and every sequence in the batch:

$$\text{bytes} = \text{n\_layer} \times 2 \times \text{n\_kv\_head} \times \text{head\_dim} \times \text{tokens} \times \text{batch} \times \text{bytes per value}$$

The 2 counts K and V. Note `n_kv_head`, not `n_head`: with GQA the cache shrinks by the group size.
Servers keep the cache in 16-bit floats (2 bytes per value), and so does this lab on a GPU (bf16, or
fp16 on a T4); on a CPU it runs in float32 (4 bytes).
Lab 02's memory budget used the same count; here you check it against real tensors.

**Deliverable:** `kv_cache_bytes(cfg, n_tokens, batch=1, bytes_per_value=2)` returns the bytes of the
KV cache of `batch` sequences of `n_tokens` tokens each. Raise `ValueError` if `n_tokens < 0`,
`batch < 1` or `bytes_per_value <= 0`.
"""),
solution("kv_cache_bytes", r"""
def kv_cache_bytes(cfg, n_tokens: int, batch: int = 1, bytes_per_value: float = 2) -> float:
    ### BEGIN SOLUTION
    if n_tokens < 0 or batch < 1 or not bytes_per_value > 0:
        raise ValueError(f"need n_tokens >= 0, batch >= 1, bytes_per_value > 0; got {n_tokens}, {batch}, {bytes_per_value}")
    return cfg.n_layer * 2 * cfg.n_kv_head * cfg.head_dim * n_tokens * batch * bytes_per_value
    ### END SOLUTION
"""),
md(r"""
The test measures the real thing without your cache: during one forward pass of the uncached model,
hooks on every layer's `k_proj` and `v_proj` catch the keys and values a cache would have to keep.
"""),
tests("kv_cache_bytes_tests", 2, r"""
from course.expect import expect_float

def nbytes(*args, **kwargs):   # kv_cache_bytes(...), a number, checked before it is compared
    return expect_float(kv_cache_bytes(*args, **kwargs), "kv_cache_bytes(...)")

ids = tokenizer("How large does the cache grow?", return_tensors="pt").input_ids.to(env.device)
caught = []
hooks = [proj.register_forward_hook(lambda m, i, o: caught.append(o))
         for blk in model_fp32.blocks for proj in (blk.attn.k_proj, blk.attn.v_proj)]
with torch.no_grad():
    model_fp32(ids, torch.arange(ids.shape[1], device=env.device)[None])
for h in hooks:
    h.remove()
real_bytes = sum(t.numel() * t.element_size() for t in caught)     # K and V of every layer, float32
assert len(caught) == 2 * cfg.n_layer, "the hooks must catch a key and a value per layer"
got = nbytes(cfg, ids.shape[1], bytes_per_value=4)
assert got == real_bytes, (f"{ids.shape[1]} tokens of SmolLM2 in float32: the keys and values take {real_bytes:,} bytes; you "
                           f"have {got:,}. Count n_layer x 2 (K and V) x n_kv_head (the KV heads, not n_head: GQA) x head_dim "
                           f"x tokens x batch x bytes per value")
assert nbytes(cfg, 1000, batch=4) == 4 * nbytes(cfg, 1000), "every sequence in the batch has its own cache"
mha = dataclasses.replace(cfg, n_kv_head=cfg.n_head)                 # the same model with one KV head per query head
assert nbytes(mha, 1000) == 3 * nbytes(cfg, 1000), \
    "with 9 KV heads instead of 3 the cache is 3 times larger: count n_kv_head, not n_head"
### BEGIN HIDDEN TESTS
_C = course.ModelConfig
for c in (
    _C(family="gpt2", vocab_size=50257, n_layer=12, n_head=12, n_kv_head=12, d_model=768, d_ff=3072, max_seq_len=1024),
    _C(family="llama", vocab_size=128256, n_layer=32, n_head=32, n_kv_head=8, d_model=4096, d_ff=14336, max_seq_len=8192),
    _C(family="llama", vocab_size=32000, n_layer=24, n_head=16, n_kv_head=1, d_model=2048, d_ff=8192, max_seq_len=4096),
):
    hd = c.d_model // c.n_head
    for n, b, bpv in ((0, 1, 2), (1, 1, 2), (4096, 8, 2), (777, 3, 1), (131072, 1, 0.5)):
        want = c.n_layer * 2 * c.n_kv_head * hd * n * b * bpv
        assert abs(nbytes(c, n, batch=b, bytes_per_value=bpv) - want) < 1e-6, \
            f"{c.n_layer} layers, {c.n_kv_head} KV heads (of {c.n_head}), {n} tokens, batch {b}, {bpv} bytes per value: " \
            f"your {nbytes(c, n, batch=b, bytes_per_value=bpv):.6g} is too " \
            f"{'high' if nbytes(c, n, batch=b, bytes_per_value=bpv) > want else 'low'}: n_layer x 2 x n_kv_head x " \
            f"head_dim x tokens x batch x bytes per value (head_dim = d_model // n_head; fractional bytes allowed)"
for bad in (dict(n_tokens=-1), dict(n_tokens=10, batch=0), dict(n_tokens=10, bytes_per_value=0)):
    try:
        kv_cache_bytes(cfg, **bad)
    except ValueError:
        pass
    else:
        raise AssertionError(f"{bad} must raise ValueError")
### END HIDDEN TESTS
"""),
md(r"""
Your own cache, from a prefill of your `CachedDecoder`, against your formula:
"""),
code(r"""
with torch.no_grad():
    _, cache = cmodel(prompt_ids, torch.arange(T0, device=env.device)[None])
held = sum(t.numel() * t.element_size() for kv in cache for t in kv)
print(f"your cache after a {T0}-token prefill: {len(cache)} layers x (k, v) of shape {tuple(cache[0][0].shape)} "
      f"= {held:,} bytes; formula: {kv_cache_bytes(cfg, T0, bytes_per_value=cache[0][0].element_size()):,} bytes")
print(f"per token: {kv_cache_bytes(cfg, 1, bytes_per_value=2) / 1024:.1f} KiB in fp16 "
      f"({kv_cache_bytes(dataclasses.replace(cfg, n_kv_head=cfg.n_head), 1) / 1024:.1f} KiB if every query head had its own K and V)")
"""),
md(r"""
### How large does it get?

The workshop this course grew from asks: how much memory does the cache take for a long context?
Your function, in fp16,
for SmolLM2 and two 7-8 B models of the same family: Llama-2-7B (32 KV heads, one per query head) and
Llama-3-8B (8 KV heads, GQA). The weights' size (fp16) is counted by building each model on the
`meta` device, which allocates nothing.
"""),
code(r"""
big = {
    "SmolLM2-135M": cfg,
    "Llama-2-7B": course.ModelConfig(family="llama", vocab_size=32000, n_layer=32, n_head=32, n_kv_head=32,
                                     d_model=4096, d_ff=11008, max_seq_len=4096, tie_embeddings=False),
    "Llama-3-8B": course.ModelConfig(family="llama", vocab_size=128256, n_layer=32, n_head=32, n_kv_head=8,
                                     d_model=4096, d_ff=14336, max_seq_len=8192, tie_embeddings=False),
}
GiB = 2**30
contexts = [4096, 32768, 131072]
print(f"{'model (fp16)':14} {'KV heads':>8} {'per token':>10} " + " ".join(f"{f'{n // 1024}k tokens':>11}" for n in contexts)
      + f" {'weights':>9} {'cache = weights at':>19}")
weights_bytes = {}
for name, c in big.items():
    with torch.device("meta"):
        weights_bytes[name] = Decoder(c).num_parameters() * 2
    per_token = kv_cache_bytes(c, 1)
    print(f"{name:14} {c.n_kv_head:8} {per_token / 1024:7.1f} KiB "
          + " ".join(f"{kv_cache_bytes(c, n) / GiB:7.2f} GiB" for n in contexts)
          + f" {weights_bytes[name] / GiB:5.2f} GiB {weights_bytes[name] / per_token:12,.0f} tokens")

fig, ax = plt.subplots(figsize=(9, 3.8), layout="constrained")
xs = [2**k for k in range(10, 18)]
for (name, c), color in zip(big.items(), ("C0", "C1", "C2")):
    ax.plot(xs, [kv_cache_bytes(c, n) / GiB for n in xs], "o-", color=color, label=f"{name}: KV cache, 1 sequence")
    ax.axhline(weights_bytes[name] / GiB, color=color, ls="--", lw=1, label=f"{name}: weights")
ax.set_xscale("log", base=2); ax.set_yscale("log")
ax.set_xticks(xs, [f"{n // 1024}k" for n in xs])
ax.set_xlabel("tokens in the cache (context length)"); ax.set_ylabel("GiB (fp16)")
ax.set_title("The KV cache grows with every token; the weights do not", fontsize=10)
ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1)); ax.grid(alpha=0.3, which="both")
plt.show()
"""),
md(r"""
Read the last column. One Llama-2-7B sequence of about 26k tokens holds as much cache as the whole
model (Llama-2 itself was trained for 4k tokens; only its shapes matter here). At 128k tokens the cache
is five times the model: 64 GiB of cache beside 12.5 GiB of weights, nearly all of an 80 GB GPU for
a single request. Llama-3-8B, with
4 query heads per KV head, keeps a cache 4 times smaller per token. And a server holds one cache per
request: 8 requests of 4k tokens on Llama-2-7B need 16 GiB of cache. This is why the cache, not the
model, decides how many requests an engine can serve at once (labs 04 and 05).

## 4. Measure: what the cache buys

Time both loops on the same prompt for a growing number of new tokens: one timed run per length (the
uncached loop takes minutes at 256 tokens on a CPU). Each loop first runs once untimed, at the longest
length on a GPU, where an eager step is slow the first time it meets a new length, and over 4 tokens
on a CPU. In float32 both loops produce the same tokens; in 16-bit floats on a GPU they can part after a
near-tie. The work per token is what differs.

On a GPU a third loop runs beside them: the same cache the way engines run it, with its decode
step captured in a CUDA graph (lab 02). `course.engine.graphs.GreedyEngine` preallocates the cache
(lab 04's slot cache: room for `max_len` tokens, no `torch.cat`), runs the prompt eagerly, then
replays one captured decode step per token. Its step also runs fewer ops than yours: one matmul for
q, k and v together and one for gate and up (their weights stacked; they read the same input), q and
k rotated together, GQA without repeating K/V, the mask, where one is needed, built once per step
instead of once per layer (a one-token decode of yours needs none; `course/engine/runner.py`). It
pays for its preallocated cache with a write and a read by index (`index_put_`, `index`) where yours
concatenates (`cat`). Count them first:
`course.timing.count_ops` runs one decode step of each and counts the ops that compute something
(each at least one kernel on a GPU; views, which only relabel memory, cost none). Then time the
loops. The engine needs a GPU to be worth timing: on a CPU its graph is lab 02's stand-in, which
saves nothing.
"""),
code(r"""
from course.engine import SlotKVCache
from course.engine.runner import forward_cached_eager
from course.timing import count_ops

one, at = prompt_ids[:, -1:], torch.full((1, 1), T0, device=env.device)     # one new token, after the prompt
with torch.no_grad():
    _, prompt_cache = cmodel(prompt_ids, torch.arange(T0, device=env.device)[None])
    slot_cache = SlotKVCache(cfg, n_slots=1, max_len=T0 + 1, dtype=model.dtype, device=env.device)
    slot = torch.zeros(1, dtype=torch.long, device=env.device)
    forward_cached_eager(model, prompt_ids, torch.arange(T0, device=env.device)[None], slot_cache, slot)
yours = count_ops(lambda: cmodel(one, at, prompt_cache))
engines = count_ops(lambda: forward_cached_eager(model, one, at, slot_cache, slot))
n_yours, n_engine = sum(yours.values()), sum(engines.values())
print(f"one decode step ({env.device}): your cache runs {n_yours} ops that compute, the engine's {n_engine} "
      f"({n_engine / n_yours:.0%} of yours)")
for name in sorted(set(yours) | set(engines), key=lambda n: engines[n] - yours[n]):
    if abs(engines[name] - yours[name]) >= cfg.n_layer:                     # what differs in every layer
        print(f"  {name:20} yours {yours[name]:4}   engine {engines[name]:4}")
"""),
code(r"""
from course.engine.graphs import GreedyEngine
from course.report import record
from course.timing import benchmark, clock

WHERE = f"{env.device}, {str(env.dtype).removeprefix('torch.')}"
lengths = env.pick([16, 64, 256], [8, 16], cpu=[16, 32, 64, 128, 256])
repeats = 1                                      # the uncached loop at 256 tokens takes minutes on a CPU: one run
loops = {"no cache": lambda n: greedy_generate(model, prompt_ids, n),
         "your cache": lambda n: cached_generate(cmodel, prompt_ids, n)}
if env.gpu:
    engine = GreedyEngine(model, max_len=T0 + max(lengths))                     # captures its decode graph once
    loops["cache + CUDA graph"] = lambda n: engine(prompt_ids, n)
for run in loops.values():   # warm-up; on a GPU an eager step is slow the first time it meets a length: meet them all
    run(max(lengths) if env.gpu else 4)
times = {name: [] for name in loops}
for n in lengths:
    for name, run in loops.items():
        times[name].append(benchmark(lambda: run(n), warmup=0, repeats=repeats, device=env.device).median)
    print(f"{n:4} new tokens ({WHERE}): " + ", ".join(f"{name} {t[-1]:6.2f} s" for name, t in times.items())
          + f"; your cache {times['no cache'][-1] / times['your cache'][-1]:4.1f}x as fast as no cache")
t_plain, t_cached = times["no cache"], times["your cache"]
record("kv_cache_speedup_eager", t_plain[-1] / t_cached[-1], "x", "your cache vs no cache, eager steps: several x on a "
       "CPU, growing with the new tokens; about 1x or below on a GPU (launch-bound)", device=env.device, dtype=env.dtype, new_tokens=lengths[-1])
if env.gpu:
    t_graph = times["cache + CUDA graph"]
    print(f"with the decode step in a CUDA graph: {t_plain[-1] / t_graph[-1]:.1f}x faster than no cache, "
          f"{t_cached[-1] / t_graph[-1]:.1f}x faster than your eager cache ({engine.describe()})")
    record("kv_cache_speedup_graph", t_plain[-1] / t_graph[-1], "x", "the cache with a CUDA-graph decode step vs no "
           "cache: >= 5x on a GPU", device=env.device, dtype=env.dtype, new_tokens=lengths[-1])
"""),
md(r"""
How much work did the cache remove? Nearly all FLOPs of a forward pass are matrix products, about
$2 \times \text{parameters}$ per token processed (lab 02). The uncached loop processes the whole
sequence at each of the $n$ steps, $\sum_{t=0}^{n-1} (T_0 + t)$ tokens; the cached loop processes
the prompt once and then one token per step, $T_0 + n - 1$ tokens. (This leaves out the attention
scores, which grow with the length, so it understates the uncached cost.)
"""),
code(r"""
N = model.num_parameters()
plain_tokens = [sum(T0 + t for t in range(n)) for n in lengths]      # the whole sequence, every step
cached_tokens = [T0 + n - 1 for n in lengths]                        # prompt once, then one token per step
flop_ratio = [p / c for p, c in zip(plain_tokens, cached_tokens)]
speedups = {name: [a / b for a, b in zip(t_plain, t)] for name, t in times.items() if name != "no cache"}

fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4), layout="constrained")
styles = {"no cache": ("o-", "#d62728"), "your cache": ("s-", "#1f77b4"), "cache + CUDA graph": ("^-", "C2")}
for name, t in times.items():
    ax1.plot(lengths, t, styles[name][0], color=styles[name][1], label=name)
ax1.set_xlabel("new tokens"); ax1.set_ylabel("seconds"); ax1.set_yscale("log")
ax1.set_title(f"Generation time, prompt of {T0} tokens ({WHERE})", fontsize=10)
ax2.plot(lengths, flop_ratio, "^--", color="gray", label="FLOPs saved: uncached / cached")
for name, sp in speedups.items():
    ax2.plot(lengths, sp, styles[name][0], color=styles[name][1], label=f"measured speedup: {name}")
for y, color in [(flop_ratio[-1], "gray")] + [(sp[-1], styles[name][1]) for name, sp in speedups.items()]:
    ax2.annotate(f"{y:.1f}x", (lengths[-1], y), textcoords="offset points", xytext=(6, 0), va="center", color=color)
ax2.set_yscale("log", base=2); ax2.yaxis.set_major_formatter(plt.FuncFormatter(lambda y, _: f"{y:g}x"))
ax2.set_xlabel("new tokens"); ax2.set_title("What the cache saves (log scale)", fontsize=10)
for ax in (ax1, ax2):
    ax.set_xscale("log", base=2); ax.set_xticks(lengths, [str(n) for n in lengths]); ax.grid(alpha=0.3); ax.legend(fontsize=8)
ax2.set_xlim(right=lengths[-1] * 1.4)
plt.show()

n = lengths[-1]
saved = 2 * N * (plain_tokens[-1] - cached_tokens[-1])
cache_mb = kv_cache_bytes(cfg, cached_tokens[-1], bytes_per_value=model.embed.weight.element_size()) / 1e6
weights_mb = N * model.embed.weight.element_size() / 1e6
print(f"{n} new tokens after a {T0}-token prompt ({WHERE}):")
print(f"  tokens processed: {plain_tokens[-1]:,} without the cache, {cached_tokens[-1]:,} with it "
      f"-> {2 * N * plain_tokens[-1] / 1e12:.2f} vs {2 * N * cached_tokens[-1] / 1e12:.3f} TFLOP ({flop_ratio[-1]:.0f}x less compute)")
print(f"  measured: {t_plain[-1]:.2f} s vs {t_cached[-1]:.2f} s -> your cache {speedups['your cache'][-1]:.1f}x as fast; "
      f"from {speedups['your cache'][0]:.1f}x at {lengths[0]} new tokens")
print(f"  memory spent: the final cache holds {cached_tokens[-1]} tokens = {cache_mb:.1f} MB, "
      f"{cache_mb / weights_mb:.1%} of the weights; {saved / (cache_mb * 1e6) / 1e3:,.0f} kFLOP saved per byte of cache")
"""),
md(r"""
Read your numbers against the gray line: the compute the cache removes grows with the number of new
tokens, because the uncached loop's passes get longer at every step while the cached loop's stay at
one token. Whether that compute was what took the time depends on your machine:

- **On a CPU** it was. Your measured speedup grows with the new tokens (several-fold at 256). It
  stays far below the FLOP ratio, though: a decode step does the arithmetic of one token, yet it
  still reads every weight from memory, so it costs much more than its FLOPs suggest, while a pass
  over a few dozen tokens reads the same weights once for all of them (lab 02: decode is memory-bound).
- **On a GPU**, with eager steps, your cache saves far less time than compute, and its gain does not
  grow with the new tokens: it stays near 1x or shrinks toward it (over a few hundred tokens the
  cache may even lose a little). A step over one token and a step over a few hundred launch about
  the same thousand kernels, and lab 02 showed that the launches are the step. The saving is real
  but hidden. Capture the decode step in a CUDA graph and it appears: the green line, several
  times faster than no cache (your line "with the decode step in a CUDA graph" says how many). What
  is left of each graph step is hundreds of tiny kernels, still far above the roofline.

The cache removes compute that grows with the **square** of the length, and pays with memory that
grows **linearly** with it. Try a prompt of a few hundred tokens: every uncached step becomes a long
prefill.

### Against Hugging Face (GPU)

`transformers` offers both kinds of cache: its default dynamic cache grows like yours, and a static
cache allocated once for the whole generation, with fixed shapes, so that the forward pass can be
compiled and captured in CUDA graphs. With `HF_COMPILE = True` the cell runs the second the way
`transformers` does by default: `generate` compiles the model for the decode step
(`mode="reduce-overhead"`, CUDA graphs) and runs the prefill eagerly. One sequence, batch 1, same
model and dtype, in tokens per second:
"""),
code(r"""
import os
HF_COMPILE = os.environ.get("COURSE_HF_COMPILE") == "1"   # True: also compile HF's static cache (tens of seconds to minutes)

if env.gpu and not env.quick:
    hf_bf = course.load_hf_model(device=env.device, dtype=env.dtype)      # the same weights, in the engine's dtype
    n_hf = 128

    def hf_generate(**kwargs):
        return hf_bf.generate(prompt_ids, max_new_tokens=n_hf, min_new_tokens=n_hf, do_sample=False, **kwargs)

    per_s = {}
    per_s["HF generate (dynamic cache)"] = n_hf / benchmark(hf_generate, warmup=1, repeats=1, device=env.device).median
    # transformers' own recipe: a static cache makes generate compile the model for the decode step
    # (mode="reduce-overhead": CUDA graphs) and run the prefill eagerly. The eager prefill allocates the
    # cache outside the compiler, so transformers can mark its tensors as fixed addresses for the graphs.
    if HF_COMPILE:
        from torch._dynamo.utils import counters    # what the compiler did: graphs compiled, CUDA graphs skipped
        counters.clear()                              # process-wide: count this run's graphs only
        optional_start = clock(env.device)
        try:
            start = clock(env.device)
            for _ in range(3):                        # compile, then record the CUDA graphs
                hf_generate(cache_implementation="static")
            print(f"HF static cache + torch.compile: {clock(env.device) - start:.0f} s before its first fast run; "
                  f"graphs compiled {counters['stats']['unique_graphs']}, CUDA graphs skipped "
                  f"{counters['inductor']['cudagraph_skips']} (a skip leaves that graph's launches in)")
            per_s["HF static cache + torch.compile"] = n_hf / benchmark(lambda: hf_generate(cache_implementation="static"),
                                                                          warmup=0, repeats=3, device=env.device).median
        except Exception as e:  # noqa: BLE001 - a GPU without a working compiler still gets the rest
            print(f"HF static cache + torch.compile: did not run here ({type(e).__name__}: {str(e)[:120]})")
        record("optional_hf_compile_s", clock(env.device) - optional_start, "s",
               "the optional HF static cache + torch.compile comparison (COURSE_HF_COMPILE=1)", device=env.device)
    else:
        print("HF static cache + torch.compile: not run (it compiles for tens of seconds or more; set HF_COMPILE = True at the top of this cell)")
    per_s["your cache, eager"] = n_hf / benchmark(lambda: cached_generate(cmodel, prompt_ids, n_hf), warmup=0,
                                                  repeats=1, device=env.device).median
    per_s["course engine: cache + CUDA graph"] = n_hf / benchmark(lambda: engine(prompt_ids, n_hf), warmup=1, repeats=2,
                                                                  device=env.device).median
    for name, v in per_s.items():
        print(f"  {name:36} {v:7.0f} tokens/s  ({WHERE}, batch 1, {n_hf} new tokens)")
    record("engine_batch1_tokens_per_s", per_s["course engine: cache + CUDA graph"], "tokens/s",
           "the course engine's batch-1 decode (CUDA graph) >= HF static cache + torch.compile", device=env.device,
           dtype=env.dtype)
    for key, name in (("hf_dynamic_tokens_per_s", "HF generate (dynamic cache)"),
                      ("hf_static_compile_tokens_per_s", "HF static cache + torch.compile")):
        if name in per_s:
            record(key, per_s[name], "tokens/s", name + ", batch 1", device=env.device, dtype=env.dtype)
elif env.gpu:
    print("Full mode only: compiling Hugging Face's static-cache generate takes tens of seconds.")
else:
    print("GPU only: a CPU has no CUDA graphs, and transformers does not compile generate there.")
"""),
md(r"""
On a GPU, the line "HF generate (dynamic cache)" is your cache in someone else's code: a dynamic
cache, run eagerly, is launch-bound like yours. The second idea, a static cache with fixed shapes
that a compiler can fuse and capture in CUDA graphs, is behind `HF_COMPILE` because compiling takes
tens of seconds on a fast machine, minutes on a slow one. Turned on, it prints how many graphs were
compiled and how many CUDA graphs the compiler skipped: each skip leaves that graph's launches in,
and the speed shows it. Skips have the cause you met in lab 02: a graph replays fixed addresses.
Compile the whole forward yourself (`model.forward = torch.compile(...)`, the recipe older guides
give) and the prefill runs compiled too, so the static cache is allocated inside the compiler and is
never marked as a fixed address, which `transformers` does only outside it ("Without this, we cannot
use cudagraphs", says its source). To see it, put `hf_bf.forward = torch.compile(hf_bf.forward,
mode="reduce-overhead")` at the top of the `HF_COMPILE` branch and run the cell again: compare the
count of skipped CUDA graphs and the speed with the first run's. The course's engine takes a plainer
road: no compiler, a CUDA graph over a preallocated cache, and fewer kernels per step by hand. Your
lines above say where it stands against HF's dynamic cache and, with `HF_COMPILE` on, its static
cache. Labs 04-06 build their engines on the graph path.

## Summary

- Causal attention never lets a token see later tokens, so each token's **keys and values**, in every
  layer, are final once computed. The **KV cache** keeps them; nothing else about old tokens is needed.
- **Prefill** runs the prompt once and fills the cache. **Decode** feeds only the newest token, at
  position id = tokens already cached, appends its k and v on the token axis, and attends over the cache.
- The mask: causal for a prefill, none for a one-token decode, a **bottom-right** causal mask for
  several new tokens after a past (`is_causal=True` is top-left: wrong with a cache).
- With GQA, cache the `n_kv_head` heads and repeat them only for the product.
- Size: `n_layer × 2 × n_kv_head × head_dim × tokens × batch × bytes`; at long contexts it outgrows the model.
- Cached generation gives the same tokens; it trades memory for compute. Whether the compute saved
  shows up as time depends on what limits a step: on a CPU it does at once; on a GPU, a small model's
  step is bound by kernel launches until a CUDA graph removes them (lab 02).

**Questions** (from the workshop this course grew from). Answer in the cell under each group, in a
few sentences of your own and with **your** numbers where a question asks for them; a person grades
them (3 points in all).
1. Why do we cache K and V? Why not the queries, or the outputs of each layer?
2. What do we save, compute or memory? What do we spend? Use your measured numbers. On your machine, did the saving show up as time with eager steps? With a graph (GPU only)?
"""),
answer("why_kv_answer", 1, "questions 1 and 2", model=r"""
1. Every later token's attention, in every layer, reads the keys and values of all earlier tokens,
   and they are final once computed (causal attention: token `j`'s k and v depend only on tokens
   `0..j`). A query serves only its own token's output, which was used at that token's step and is
   never needed again. The outputs (hidden states) of each layer are not what later tokens read: a
   new token needs the old tokens' k and v at each layer, so caching hidden states would mean
   re-running `k_proj`, `v_proj` and RoPE over the whole past at every step, the compute the cache
   exists to save. (With GQA it would not even save memory: SmolLM2's K and V take `2 x 3 x 64 = 384`
   numbers per token per layer, its hidden state 576.)
2. The cache saves **compute** and spends **memory**. (An example, CPU, float32, the 4-token prompt:)
   for 256 new tokens the uncached loop processes 33,664 token positions against 259 with the cache,
   about 130x fewer FLOPs; the measured speedup was several-fold and grew with the number of new
   tokens, far below the FLOP ratio because a one-token decode step still reads every weight
   (memory-bound). The memory: 46,080 bytes per token in float32 (23,040 in bf16), about 12 MB for
   259 tokens, about 2% of the weights here, growing linearly with context and batch. On a CPU the
   saving showed as time with eager steps; on a GPU eager steps gained about 1x (launch-bound: a
   one-token pass and a few-hundred-token pass launch the same kernels), and with the decode step in
   a CUDA graph the cache ran several times (5x or more) faster than no cache.
""", rubric=r"""
- 0.5: question 1: K and V are read by every later token and are final (causal); a query serves only
  its own step; cached layer outputs would need the projections recomputed at every step.
- 0.5: question 2: compute saved, memory spent, with the student's own measured speedup and a size of
  the cache (per token or in total), and whether the saving showed as time on their device and why
  (memory-bound decode on a CPU; launch-bound eager steps on a GPU, and the graph's gain). No fixed
  numbers are expected; the reasoning must match the numbers quoted.
"""),
md(r"""
3. How are the prefill and decode phases different once there is a cache? What shape do Q, K and V have in each?
4. What can we do if we run out of memory for the cache? List at least three options, and what each costs.
"""),
answer("phases_memory_answer", 1, "questions 3 and 4", model=r"""
3. Prefill runs all `T` prompt tokens in one pass with no cache and a causal mask; it fills the cache
   and gives the first token (many FLOPs per weight read: compute-bound). Decode feeds one token at
   position `n` (the cache length), with no mask, appends its k and v and attends over the whole
   cache (memory-bound: it reads every weight and the whole cache for one token). Shapes for
   SmolLM2, batch `B`: prefill Q `(B, 9, T, 64)`, K and V `(B, 3, T, 64)`; decode Q `(B, 9, 1, 64)`,
   K and V `(B, 3, n + 1, 64)` (repeated to 9 heads only for the product, never in the cache).
4. Any three, with their price: quantize the cache to int8/fp8 (half the bytes of bf16; a little
   accuracy, and scales to store); keep a sliding window or evict old tokens (memory stops growing;
   the model forgets what left the window); store it in pages to stop reserving unused space (lab 05;
   an indirection in the kernels); share common prefixes (lab 09; only helps shared text); cap the
   batch or the context, or queue requests (throughput, latency); preempt a request and recompute or
   swap its cache to CPU memory later (FLOPs or PCIe time); offload to CPU memory (bandwidth); split
   the cache over GPUs with tensor parallelism (more GPUs, communication); an architecture with fewer
   KV heads (GQA, MQA, MLA: retraining).
""", rubric=r"""
- 0.5: question 3: prefill = whole prompt, causal mask, fills the cache; decode = one token at position
  n, no mask, reads the cache; the Q and K/V shapes with the query and KV head counts (9 and 3) and
  the token axis (T, or 1 against n + 1).
- 0.5: question 4: three distinct options, each with a cost. Two with costs, or three without: 0.25.
"""),
md(r"""
5. Your cache grows with `torch.cat`, which allocates a new tensor and copies the whole old cache at every step. How many bytes does that copy in total for $n$ tokens? How would you avoid it?
"""),
answer("cat_copy_answer", 1, "question 5", model=r"""
One token's keys and values in all layers take `b = 2 x 30 x 3 x 64 x bytes` = 23,040 bytes in bf16
(46,080 in float32). A decode step that starts with `m` cached tokens copies all `m` into the new
tensor. After a prompt of `T0` tokens, the `n - 1` decode calls copy
`T0 + (T0 + 1) + ... + (T0 + n - 2) = (n - 1) T0 + (n - 1)(n - 2) / 2` tokens, about
`(n T0 + n^2 / 2) x b` bytes: quadratic in `n` (each is read once and written once). For 1,000
tokens from an empty cache in bf16 that is about 500,000 x 23 KB = 11.5 GB copied to hold a final
cache of 23 MB. Avoid it by allocating the cache once for the maximum length (a static cache,
lab 04's slots) and writing each new token's k and v in place at its position (`index_put_`, a
slot mapping), or by allocating fixed-size blocks as the sequence grows (paged cache, lab 05); then
each step writes only the new token.
""", rubric=r"""
- 0.5: the total: a sum over steps of the cache size, quadratic in n (order n^2/2 tokens, plus n T0),
  times the bytes per token (23,040 in bf16 for SmolLM2, or the formula).
- 0.5: a way to avoid it: preallocate for the maximum length and write in place by index, or blocks
  allocated as needed (paging), or capacity doubling (amortized).
"""),
md(r"""

## Going further

- **Preallocate instead of concatenating.** Hugging Face `transformers` offers both: a dynamic cache
  that grows like yours, and a static cache allocated once for a maximum length, whose fixed shapes
  let `torch.compile` and CUDA graphs capture the decode step. nano-vllm allocates one large KV tensor
  for all requests at start-up and writes each new token's k and v into a slot given by a slot mapping.
- **Waste less of it.** A contiguous cache reserved for the maximum length wastes most of itself
  (60-80% of KV memory in the systems the vLLM paper measured). vLLM's PagedAttention stores the cache
  in fixed-size blocks, like pages of virtual memory (lab 05). SGLang's RadixAttention and vLLM's
  prefix caching let requests that share a prefix share its cache (lab 09).
- **Make it smaller.** Multi-query attention (Shazeer, 2019) and grouped-query attention (Ainslie et
  al., 2023) share KV heads; DeepSeek-V2's multi-head latent attention caches a compressed latent
  instead of K and V; KV quantization (fp8 in vLLM, 2-bit in KIVI) shrinks each value; sliding-window
  attention (Mistral) keeps only the last W tokens; StreamingLLM keeps the first few tokens and a
  recent window; H2O keeps the tokens that received the most attention.
- **When memory runs out**, engines preempt a request and later either recompute its cache (a new
  prefill) or swap it to CPU memory (vLLM has supported both).
"""),
]

write_notebook("labs/03_kv_cache/03_kv_cache.ipynb", cells + [md(CHECK_YOUR_WORK)])
print("wrote labs/03_kv_cache/03_kv_cache.ipynb")
