"""Builds the lab 10 source notebook (a smaller KV cache). Edit this file or its sections, then run
from the repo root:

    .venv/bin/python -m autograder.lab_builders.lab10

The lab is long, so its cells live in four modules, in the order the notebook shows them:
lab10.py (title, setup, the size of the cache, Problem 1), lab10_window.py (sliding window and
attention sinks, Problems 2-3), lab10_kv.py (int8 and fp8 KV cache, Problems 4-5) and
lab10_weights.py (the GGUF file, 4-bit groups, Problem 6, the final measurement and summary).
"""
from autograder.authoring import code, locked, md, solution, tests, write_notebook  # noqa: E402
from autograder.lab_builders.common_cells import CHECK_YOUR_WORK, COLAB_INSTALL, SETUP  # noqa: E402
from autograder.lab_builders.lab10_kv import cells as kv_cells  # noqa: E402
from autograder.lab_builders.lab10_weights import cells as weight_cells  # noqa: E402
from autograder.lab_builders.lab10_window import cells as window_cells  # noqa: E402

PATH = "labs/10_smaller_kv_cache/10_smaller_kv_cache.ipynb"

intro_cells = [
md(r"""
# Lab 10: A smaller KV cache

Every token a server keeps in flight costs memory in every layer: one key and one value vector per
KV head. Weights are paid once; the cache grows with every token of every request. At long contexts
and large batches it becomes the biggest thing in GPU memory, several times the model, and memory
decides how many requests run together (lab 05). This lab shrinks it three ways. **Keep fewer
tokens**: a sliding window over the last N tokens, whose blocks are freed as they leave it, then
*attention sinks* (StreamingLLM), the first tokens kept for good, which repair what a plain window
breaks. **Store each token in fewer bits**: int8 with per-token or per-head scales, and fp8.
**Shrink the weights** that share the memory: int8 per channel and 4-bit groups. The course's model
itself ships as a 4-bit file; you will take it apart and rebuild it byte for byte. Every saving
costs some quality, so each one is measured: perplexity on a held-out text, next to the memory saved.

**You will**
- compute the cache's bytes per token for any number format, scales included, and see when it outgrows the model;
- build a sliding window over the paged cache of lab 05 (which tokens each query sees, which blocks
  to free), then attention sinks, and measure where a plain window breaks down and what sinks repair;
- quantize keys and values to int8 with per-token and per-head scales (a zero row, an outlier) and to
  fp8 e4m3, and measure memory, perplexity and attention time;
- read the Q4_1 blocks of the model's GGUF file, write the 4-bit group-wise quantizer that rebuilds
  them, and fill a table of memory and perplexity for fp32, bf16, int8 and 4-bit weights.

**Time:** about 3 hours 25 minutes: 45 minutes of reading, six problems (about 10, 20, 30, 25, 15
and 40 minutes), 25 minutes for the written questions at the end, and about a minute and a half of
running on a laptop CPU (80 s measured on 2 cores). **Hardware:** everything runs on a laptop CPU, with a text of
a few hundred tokens in quick mode and about a thousand otherwise. A GPU runs longer texts; an
Ada or Hopper GPU (sm_89 or newer) also has native fp8 math, which the lab reports but does not need.
"""),
locked("colab_install", COLAB_INSTALL),
locked("setup", SETUP),
md(r"""
## 1. How big is the KV cache?

Lab 03 counted the cache: for every token, every layer stores a key and a value for each KV head,
`head_dim` numbers each. Here is that count for the course model and for a typical production
model (Llama-3-8B's published shape), next to the weights. The cache grows with
the number of tokens in flight (all running requests together); the weights do not.
"""),
code(r'''
import dataclasses
import math
import time

import matplotlib.pyplot as plt
from matplotlib.ticker import FormatStrFormatter, NullFormatter
import numpy as np
import torch

from course.engine import BlockAllocator, OutOfBlocks, PagedKVCache, block_table_tensor, forward_paged, paged_attention, write_kv
from course.expect import expect_int, expect_ints, expect_tensor, expect_tuple, expect_type
from course.models import ModelConfig
from course.quant import (QuantKVPool, attention_to_first, dequantize, dequantize_reference, forward_logits, fp8_native,
                          gguf_tensor, heldout_ids, join_q4_1, linear_bytes, linear_params, max_weight_change,
                          perplexity, quantize_linears, read_gguf, rolling_mean, split_q4_1, token_nll)
from course.timing import benchmark
from course.widgets import window_blocks

dev = env.device
tokenizer = course.load_tokenizer()
model = course.load_model(device=dev, dtype=env.dtype)          # decode and timings: the lab's dtype
# Perplexity is measured in float32 everywhere, so that the only thing that changes is the format under test.
model32 = model if env.dtype == torch.float32 else course.load_model(device=dev, dtype=torch.float32)
cfg = model.cfg
text_ids = heldout_ids(tokenizer)
print(f"held-out text: {len(text_ids)} tokens of English prose written for the course (course/data/README_heldout.md)")


def n_params(c: ModelConfig) -> int:
    """Weights of a Llama-family decoder of this shape (q, k, v, o, a gated MLP, two norms a block)."""
    attn = 2 * c.d_model * c.n_head * c.head_dim + 2 * c.d_model * c.n_kv_head * c.head_dim
    embed = c.vocab_size * c.d_model * (1 if c.tie_embeddings else 2)
    return embed + c.n_layer * (attn + 3 * c.d_model * c.d_ff + 2 * c.d_model) + c.d_model


llama8b = ModelConfig(family="llama", vocab_size=128256, n_layer=32, n_head=32, n_kv_head=8, d_model=4096,
                      d_ff=14336, max_seq_len=8192, rope_theta=500000.0, tie_embeddings=False)
assert n_params(cfg) == model.num_parameters(), "the count must match the model's own"
for name, c in (("SmolLM2-135M (this lab)", cfg), ("Llama-3-8B (shape only)", llama8b)):
    per_token = PagedKVCache(c, n_blocks=1, block_size=1, dtype=torch.bfloat16, device=dev).bytes_per_token()
    weights = 2 * n_params(c)
    print(f"{name}: {n_params(c) / 1e9:.2f} B weights = {weights / 2**30:.2f} GiB in bf16; "
          f"KV cache {per_token / 2**10:.1f} KiB per token in bf16")
    print(f"   the cache outgrows the weights at {weights / per_token:,.0f} tokens in flight, "
          f"e.g. {weights / per_token / 2048:.1f} requests of 2,048 tokens; "
          f"32 requests of 8,192 tokens take {32 * 8192 * per_token / 2**30:.1f} GiB")

tokens = np.logspace(2, 6, 50)
plt.figure(figsize=(6.5, 3.2))
for name, c, color in (("SmolLM2-135M", cfg, "C0"), ("Llama-3-8B", llama8b, "C1")):
    per_token = PagedKVCache(c, n_blocks=1, block_size=1, dtype=torch.bfloat16, device=dev).bytes_per_token()
    plt.plot(tokens, tokens * per_token / 2**30, color=color, label=f"{name}: KV cache")
    plt.axhline(2 * n_params(c) / 2**30, color=color, ls="--", label=f"{name}: weights")
plt.xscale("log"); plt.yscale("log"); plt.xlabel("tokens in flight (all requests)"); plt.ylabel("GiB (bf16)")
plt.grid(alpha=0.3); plt.legend(fontsize=8); plt.tight_layout(); plt.show()
'''),
md(r"""
Read the crossing points: about 6 requests of 2,048 tokens for the course model, about 60 for
Llama-3-8B (15 of 8,192 tokens), and the cache is bigger than the model. (Llama-3-8B
already shares each KV head among 4 query heads, GQA; with a KV head per query head it would be 4x
worse.) Three levers shrink it: fewer **tokens** (section 2), fewer **bits per number** (section 5),
and fewer bytes of **weights**, which leaves more of the same memory to the cache (section 6).

Before pulling any lever, a formula for what one token costs in any format. A quantized format stores
each number in fewer bits plus **scales**: one float that says what the small integers mean, shared by
a group of numbers. How big the group is decides what the scales cost:

| `scales` | one float32 scale for | scales per token (keys, in one layer) |
|---|---|---|
| `None` | no scales (plain fp32, bf16) | 0 |
| `"tensor"` | the whole cache of a layer (set once) | 0 (shared by all tokens) |
| `"token"` | each token: all its KV heads together | 1 |
| `"head"` | each token and KV head | `n_kv_head` |

Values have scales of their own, just like keys.

## Problem 1: Bytes per token, any format (2 points)

**Deliverable:** `kv_bytes_per_token(cfg, bits, scales=None, scale_bytes=4)`: the bytes one token
adds to the cache, over all layers, keys and values, with numbers of `bits` bits and scales of
`scale_bytes` bytes placed as in the table above. Return an `int`; raise `ValueError` for any
other `scales`.
"""),
solution("kv_bytes", r'''
def kv_bytes_per_token(cfg: ModelConfig, bits: int, scales: str | None = None, scale_bytes: int = 4) -> int:
    """Bytes of keys and values (and their scales) that one token adds to the cache, all layers."""
    ### BEGIN SOLUTION
    per_token_scales = {None: 0, "tensor": 0, "token": 1, "head": cfg.n_kv_head}
    if scales not in per_token_scales:
        raise ValueError(f"scales must be None, 'tensor', 'token' or 'head', got {scales!r}")
    numbers = cfg.n_kv_head * cfg.head_dim * bits // 8
    return 2 * cfg.n_layer * (numbers + per_token_scales[scales] * scale_bytes)
    ### END SOLUTION
'''),
code(r'''
formats = [("fp32", 32, None), ("bf16", 16, None), ("int8, a scale per token", 8, "token"),
           ("int8, a scale per head", 8, "head"), ("fp8, a scale per layer", 8, "tensor"), ("int4, a scale per head", 4, "head")]
bf16 = kv_bytes_per_token(cfg, 16)
print(f"{'format':<26} {'bytes/token':>11} {'vs bf16':>8} {'tokens in 1 GiB':>16}")
for name, bits, scales in formats:
    b = kv_bytes_per_token(cfg, bits, scales)
    print(f"{name:<26} {b:>11,} {b / bf16:>7.2f}x {2**30 // b:>16,}")
'''),
tests("kv_bytes_tests", 2, r"""
got = expect_int(kv_bytes_per_token(cfg, 16), "kv_bytes_per_token(cfg, 16)", min=1)
assert got == 23040, f"bf16, no scales: 2 (k and v) x 30 layers x 3 KV heads x 64 x 2 bytes = 23,040; got {got}"
assert got == PagedKVCache(cfg, 1, 1, dtype=torch.bfloat16, device=dev).bytes_per_token(), "the paged cache of lab 05 agrees"
assert expect_int(kv_bytes_per_token(cfg, 32), "kv_bytes_per_token(cfg, 32)") == 46080, "fp32 is twice bf16"
got = expect_int(kv_bytes_per_token(cfg, 8, "head"), "kv_bytes_per_token(cfg, 8, 'head')")
assert got == 12240, f"int8 with a float32 scale per (token, KV head): 2 x 30 x (192 + 3 x 4) = 12,240; got {got}"
got = expect_int(kv_bytes_per_token(cfg, 8, "token"), "kv_bytes_per_token(cfg, 8, 'token')")
assert got == 11760, f"one scale per token for its keys (and one for its values) in each layer: 2 x 30 x (192 + 4); got {got}"
assert expect_int(kv_bytes_per_token(cfg, 8, "tensor"), "kv_bytes_per_token(cfg, 8, 'tensor')") == 11520, \
    "a per-layer scale is shared by every token: it adds nothing per token"
try:
    kv_bytes_per_token(cfg, 8, "channel")
except ValueError:
    pass
else:
    raise AssertionError("scales='channel' is not one of None, 'tensor', 'token', 'head': raise ValueError")
### BEGIN HIDDEN TESTS
def _ref_kv_bytes(n_layer, n_kv_head, head_dim, bits, per_token_scales, scale_bytes):
    return 2 * n_layer * (n_kv_head * head_dim * bits // 8 + per_token_scales * scale_bytes)
for family, n_head, n_kv, d_model, n_layer in (("llama", 8, 8, 256, 3), ("llama", 8, 1, 512, 5), ("gpt2", 4, 4, 128, 2),
                                               ("llama", 32, 8, 4096, 32)):
    c = ModelConfig(family=family, vocab_size=64, n_layer=n_layer, n_head=n_head, n_kv_head=n_kv, d_model=d_model,
                    d_ff=4 * d_model, max_seq_len=64)
    for bits, scales, per in ((16, None, 0), (32, "tensor", 0), (8, "token", 1), (8, "head", n_kv), (4, "head", n_kv),
                              (4, "token", 1)):
        for sb in (4, 2):
            got = expect_int(kv_bytes_per_token(c, bits, scales, sb), f"kv_bytes_per_token(cfg, {bits}, {scales!r}, {sb})")
            want = _ref_kv_bytes(n_layer, n_kv, d_model // n_head, bits, per, sb)
            assert got == want, (f"{n_layer} layers, {n_kv} KV heads of {d_model // n_head}, {bits} bits, scales={scales!r}, "
                                 f"scale_bytes={sb}: got {got}, which is wrong: K and V both count, in every layer; scales "
                                 f"follow the KV heads (not the query heads), scale_bytes each")
for bad in ("row", "heads", ""):
    try:
        kv_bytes_per_token(cfg, 8, bad)
    except ValueError:
        continue
    raise AssertionError(f"scales={bad!r} must raise ValueError")
### END HIDDEN TESTS
"""),
]

cells = intro_cells + window_cells + kv_cells + weight_cells

if __name__ == "__main__":
    write_notebook(PATH, cells + [md(CHECK_YOUR_WORK)])
    print(f"wrote {PATH}")
