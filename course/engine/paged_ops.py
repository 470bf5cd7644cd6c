"""Lab 05's two operations on a paged KV pool, released for the labs after it, in PyTorch:
store new keys and values into their slots, and decode attention that reads each sequence's
keys and values through its block table. They are the reference the Triton kernels of lab 06 are
checked against, and what `forward_paged` calls when no kernel is given.

    k_cache, v_cache: (n_blocks, block_size, Hkv, D)     one layer of the pool
    write_kv(k_cache, v_cache, k, v, slot_mapping)       k, v: (N, Hkv, D); slot -1 = skip
    paged_attention(q, k_cache, v_cache, block_tables, context_lens, scale) -> (B, H, D)
"""
from __future__ import annotations

import torch


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Store k[i], v[i] (each (N, Hkv, D)) in slot slot_mapping[i] of the pool, in place; a
    negative slot means "no slot" (a padding token) and is skipped."""
    n_blocks, block_size, Hkv, D = k_cache.shape
    if k.shape != v.shape or k.shape[1:] != (Hkv, D) or slot_mapping.shape != k.shape[:1]:
        raise ValueError(f"k and v must be (N, {Hkv}, {D}) with slot_mapping (N,); got k {tuple(k.shape)}, "
                         f"v {tuple(v.shape)}, slot_mapping {tuple(slot_mapping.shape)}")
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    k_cache.view(n_blocks * block_size, Hkv, D)[slots] = k[keep].to(k_cache.dtype)
    v_cache.view(n_blocks * block_size, Hkv, D)[slots] = v[keep].to(v_cache.dtype)


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                    context_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """Decode attention: query b (H, D) attends to the first context_lens[b] tokens of sequence b,
    found through block_tables[b] (a row of block ids, padded at the end). Query head h reads KV
    head h // (H // Hkv) (GQA). Computed in float32 for the whole batch at once; returns (B, H, D)
    in q's dtype. Slots past a sequence's length may hold anything (NaN included): they are masked."""
    B, H, D = q.shape
    _, block_size, Hkv, _ = k_cache.shape
    if H % Hkv:
        raise ValueError(f"q has {H} heads, not a multiple of the cache's {Hkv} KV heads")
    if block_tables.dim() != 2 or block_tables.shape[0] != B or context_lens.shape != (B,):
        raise ValueError(f"block_tables must be (B, max_blocks) and context_lens (B,) with B = {B}; got "
                         f"{tuple(block_tables.shape)} and {tuple(context_lens.shape)}")
    L = block_tables.shape[1] * block_size
    k = k_cache[block_tables.long()].reshape(B, L, Hkv, D)                 # (B, L, Hkv, D): every block of the row
    v = v_cache[block_tables.long()].reshape(B, L, Hkv, D)
    valid = torch.arange(L, device=q.device)[None, :] < context_lens[:, None].to(q.device)   # (B, L)
    k = torch.where(valid[:, :, None, None], k.float(), 0.0)              # stale slots may hold NaN: zero them
    v = torch.where(valid[:, :, None, None], v.float(), 0.0)
    qg = q.float().view(B, Hkv, H // Hkv, D)                               # (B, Hkv, G, D): a group per KV head
    scores = torch.einsum("bkgd,blkd->bkgl", qg, k) * scale                # (B, Hkv, G, L)
    scores = scores.masked_fill(~valid[:, None, None, :], float("-inf"))
    out = torch.einsum("bkgl,blkd->bkgd", scores.softmax(dim=-1), v)       # (B, Hkv, G, D)
    return out.reshape(B, H, D).to(q.dtype)
