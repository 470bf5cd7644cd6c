"""`forward_extend`: one forward pass that extends several sequences of a paged KV cache at once,
each by its own number of new tokens, whatever is already cached before them.

Lab 05's `forward_paged` knew two calls: a prefill of one sequence with nothing cached, and a decode
of one token per sequence. A serving engine needs the general case (lab 09's prefix caching and lab
11's chunked prefill): a sequence whose first tokens are in its blocks gets a run of new tokens (the
rest of its prompt, or a chunk of it), and decodes ride along in the same pass. The new tokens of
every sequence are laid end to end in one row, as vLLM does:

    input_ids, positions, slot_mapping: (N,)   N = sum(query_lens) new tokens, sequence after sequence
    query_lens: [q_0, q_1, ...]                 new tokens per sequence (1 for a decode)
    block_tables: (S, max_blocks), context_lens: (S,)   per sequence, its blocks and its length after this pass

Every linear layer runs once over all N tokens (one read of the weights for the whole step). Only
attention is per sequence: the one-token rows together through the paged decode attention, each
longer run with causal attention over its cached tokens and itself. Logits come back only for the
last new token of each sequence, (S, V): the only ones an engine samples from.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

from course.engine.paged import PagedKVCache
from course.engine.paged_ops import paged_attention, write_kv
from course.engine.runner import embed, mlp, project_qkv
from course.models.decoder import Decoder


@torch.no_grad()
def forward_extend(model: Decoder, cache: PagedKVCache, input_ids: torch.Tensor, positions: torch.Tensor,
                   slot_mapping: torch.Tensor, query_lens: Sequence[int], block_tables: torch.Tensor,
                   context_lens: torch.Tensor, *, write_kv: Callable = write_kv,
                   attention: Callable = paged_attention) -> torch.Tensor:
    """Logits (S, V) of the last new token of each of the S sequences (see the module docstring)."""
    cfg = model.cfg
    q_lens = [int(q) for q in query_lens]
    N, S = sum(q_lens), len(q_lens)
    _check(input_ids, positions, slot_mapping, q_lens, block_tables, context_lens, N, S)
    H, Hkv, D, bs = cfg.n_head, cfg.n_kv_head, cfg.head_dim, cache.block_size
    scale = 1.0 / math.sqrt(D)
    starts = [sum(q_lens[:i]) for i in range(S)]
    ctx = context_lens.tolist()
    one = [s for s in range(S) if q_lens[s] == 1]                            # decodes: one paged attention call
    one_rows = torch.tensor([starts[s] for s in one], device=input_ids.device)
    runs = [s for s in range(S) if q_lens[s] > 1]                            # prefill chunks: causal attention each
    masks = {s: torch.arange(ctx[s], device=input_ids.device)[None, :] <= positions[starts[s]:starts[s] + q_lens[s], None]
             for s in runs if ctx[s] != q_lens[s]}                           # (q, L); None: nothing cached before
    x, rope = embed(model, input_ids[None], positions[None])                 # (1, N, C)
    for i, block in enumerate(model.blocks):
        q, k, v = project_qkv(model, block, x, rope)                         # (1, H, N, D), (1, Hkv, N, D) x 2
        q = q[0].transpose(0, 1)                                             # (N, H, D)
        k_cache, v_cache = cache.layer(i)                                    # (n_blocks, block_size, Hkv, D)
        # (N, Hkv, D), row after row in memory: a Triton store (lab 06) reads them so; k and v are views of one matmul
        write_kv(k_cache, v_cache, k[0].transpose(0, 1).to(k_cache.dtype).contiguous(),
                 v[0].transpose(0, 1).to(v_cache.dtype).contiguous(), slot_mapping)
        y = torch.empty_like(q)                                              # (N, H, D)
        if one:
            y[one_rows] = attention(q[one_rows].contiguous(), k_cache, v_cache, block_tables[one],
                                    context_lens[one], scale).to(q.dtype)
        for s in runs:
            a, L = starts[s], ctx[s]
            blocks = block_tables[s, :-(-L // bs)].long()
            kk = k_cache[blocks].reshape(-1, Hkv, D)[:L].transpose(0, 1).to(q.dtype)   # (Hkv, L, D)
            vv = v_cache[blocks].reshape(-1, Hkv, D)[:L].transpose(0, 1).to(q.dtype)
            kk, vv = kk.repeat_interleave(cfg.group_size, 0), vv.repeat_interleave(cfg.group_size, 0)  # (H, L, D)
            qq = q[a:a + q_lens[s]].transpose(0, 1)                          # (H, q, D)
            out = F.scaled_dot_product_attention(qq, kk, vv, attn_mask=masks.get(s), is_causal=s not in masks)
            y[a:a + q_lens[s]] = out.transpose(0, 1)                         # (q, H, D)
        x = x + block.attn.o_proj(y.reshape(1, N, H * D))                   # (1, N, C)
        x = x + mlp(block, x)
    last = torch.tensor([a + q - 1 for a, q in zip(starts, q_lens)], device=x.device)
    return model.lm_head(model.norm(x[0, last]))                             # (S, V)


def _check(input_ids, positions, slot_mapping, q_lens, block_tables, context_lens, N, S) -> None:
    for name, t in (("input_ids", input_ids), ("positions", positions), ("slot_mapping", slot_mapping)):
        if not isinstance(t, torch.Tensor) or t.shape != (N,):
            got = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"{name} must be a (N,) tensor with N = sum(query_lens) = {N}, got {got}")
    if S == 0 or min(q_lens) < 1:
        raise ValueError(f"query_lens must list at least one sequence, each with >= 1 new token, got {q_lens}")
    if block_tables.dim() != 2 or block_tables.shape[0] != S or context_lens.shape != (S,):
        raise ValueError(f"block_tables must be (S, max_blocks) and context_lens (S,) with S = {S}; got "
                         f"{tuple(block_tables.shape)} and {tuple(context_lens.shape)}")
    if any(c < q for c, q in zip(context_lens.tolist(), q_lens)):
        raise ValueError(f"context_lens {context_lens.tolist()} must be at least query_lens {q_lens}")
