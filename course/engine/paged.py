"""A paged KV cache (lab 05): keys and values live in fixed-size blocks, not in one slot per sequence.

The storage is one pool of `n_blocks` physical blocks of `block_size` token slots each, shared by
all sequences. Which blocks a sequence owns, and in which order, is its *block table*: logical
block i of the sequence (its tokens i*block_size .. (i+1)*block_size - 1) sits in physical block
table[i]. Token slot s = block * block_size + offset names one row of the pool.

    k, v: (n_layer, n_blocks, block_size, n_kv_head, head_dim)

Who gets which block is not decided here: that is the block allocator the lab builds. This file
only holds the memory and runs the model over it, calling two functions the lab writes:

    write_kv(k_cache, v_cache, k, v, slot_mapping)        store new keys/values (N, Hkv, D), handed contiguous
    attention(q, k_cache, v_cache, block_tables, context_lens, scale) -> (B, H, D)   decode attention
"""
from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F

from course.models.config import ModelConfig
from course.engine.runner import embed, mlp, project_qkv
from course.models.decoder import Decoder, check_ids


class PagedKVCache:
    """The block pool of every layer. `layer(i)` gives that layer's (k, v), each (n_blocks, block_size, Hkv, D)."""

    def __init__(self, cfg: ModelConfig, n_blocks: int, block_size: int, dtype: torch.dtype = torch.float32,
                 device: str | torch.device = "cpu"):
        if not isinstance(cfg, ModelConfig):
            raise TypeError(f"cfg must be a ModelConfig (model.cfg), got {type(cfg).__name__}")
        for name, value in (("n_blocks", n_blocks), ("block_size", block_size)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        self.cfg, self.n_blocks, self.block_size = cfg, n_blocks, block_size
        shape = (cfg.n_layer, n_blocks, block_size, cfg.n_kv_head, cfg.head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)

    @property
    def device(self) -> torch.device:
        return self.k.device

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k[i], self.v[i]

    def copy_block(self, src: int, dst: int) -> None:
        """Copy-on-write: physical block `src` into `dst`, in every layer (keys and values)."""
        for name, b in (("src", src), ("dst", dst)):
            if not 0 <= int(b) < self.n_blocks:
                raise ValueError(f"{name} block {b} is out of range 0..{self.n_blocks - 1}")
        self.k[:, dst] = self.k[:, src]
        self.v[:, dst] = self.v[:, src]

    def bytes_per_token(self) -> int:
        """Keys and values of one token in every layer."""
        return 2 * self.cfg.n_layer * self.cfg.n_kv_head * self.cfg.head_dim * self.k.element_size()

    def bytes_per_block(self) -> int:
        return self.block_size * self.bytes_per_token()

    def bytes_reserved(self) -> int:
        return self.k.nbytes + self.v.nbytes

    def __repr__(self) -> str:
        return (f"PagedKVCache(n_blocks={self.n_blocks}, block_size={self.block_size}, "
                f"{self.bytes_reserved() / 2**20:.1f} MiB)")


def block_table_tensor(tables: list[list[int]], device: str | torch.device = "cpu") -> torch.Tensor:
    """Block tables of a batch as one (B, max_blocks) int32 tensor; short rows are padded with 0
    (a real block id: the attention must never read past a sequence's length)."""
    width = max(1, max(len(t) for t in tables))
    out = torch.zeros(len(tables), width, dtype=torch.int32)
    for b, t in enumerate(tables):
        out[b, :len(t)] = torch.tensor(t, dtype=torch.int32)
    return out.to(device)


@torch.no_grad()
def forward_paged(model: Decoder, input_ids: torch.Tensor, position_ids: torch.Tensor, cache: PagedKVCache,
                  slot_mapping: torch.Tensor, block_tables: torch.Tensor | None, context_lens: torch.Tensor | None,
                  *, write_kv: Callable, attention: Callable) -> torch.Tensor:
    """Logits (B, T, V). Two kinds of call, as engines make them:

    prefill (block_tables and context_lens None), (1, T): one sequence's whole context; its T
        keys/values go to `slot_mapping` (T,), and attention is plain causal attention over those
        T tokens (nothing else is cached yet).
    decode, (B, 1): one new token per sequence; its key/value goes to slot_mapping[b], then its
        query attends to its first context_lens[b] tokens through block_tables[b] (B, max_blocks).

    When the cache carries CUDA graphs of the decode step (`course.engine.graphs.capture_decode_graphs`,
    captured with these write_kv and attention), a decode call replays one instead; its logits are
    then a static buffer, overwritten by the next call: read them before that.
    """
    graphs = getattr(cache, "graphs", None)
    if graphs is not None:
        return graphs(model, input_ids, position_ids, cache, slot_mapping, block_tables, context_lens,
                      write_kv=write_kv, attention=attention)
    return forward_paged_eager(model, input_ids, position_ids, cache, slot_mapping, block_tables, context_lens,
                               write_kv=write_kv, attention=attention)


@torch.no_grad()
def forward_paged_eager(model: Decoder, input_ids: torch.Tensor, position_ids: torch.Tensor, cache: PagedKVCache,
                        slot_mapping: torch.Tensor, block_tables: torch.Tensor | None, context_lens: torch.Tensor | None,
                        *, write_kv: Callable, attention: Callable) -> torch.Tensor:
    """forward_paged, op by op (no graph): what every call does when the cache has no graphs."""
    cfg = model.cfg
    check_ids(input_ids, position_ids, cfg)
    B, T = input_ids.shape
    H, Hkv, D = cfg.n_head, cfg.n_kv_head, cfg.head_dim
    prefill = block_tables is None and context_lens is None
    if prefill and B != 1:
        raise ValueError(f"prefill takes one sequence at a time: input_ids must be (1, T), got {(B, T)}")
    if slot_mapping.shape != (B * T,):
        raise ValueError(f"slot_mapping must hold one slot per new token, shape ({B * T},), got {tuple(slot_mapping.shape)}")
    if not prefill and (T != 1 or block_tables is None or context_lens is None or block_tables.shape[0] != B
                        or context_lens.shape != (B,)):
        raise ValueError(f"decode takes one token per sequence, input_ids (B, 1), with block_tables (B, max_blocks) "
                         f"and context_lens (B,); got input_ids {(B, T)}")
    scale = 1.0 / math.sqrt(D)
    x, rope = embed(model, input_ids, position_ids)                       # (B, T, C)
    for i, block in enumerate(model.blocks):
        attn = block.attn
        q, k, v = project_qkv(model, block, x, rope)                      # (B, H, T, D), (B, Hkv, T, D) x 2
        k_cache, v_cache = cache.layer(i)                                 # (n_blocks, block_size, Hkv, D) each
        # (B*T, Hkv, D), row after row in memory: a Triton store (lab 06) reads them so; k and v are views of one matmul
        write_kv(k_cache, v_cache, k.transpose(1, 2).reshape(B * T, Hkv, D).to(k_cache.dtype).contiguous(),
                 v.transpose(1, 2).reshape(B * T, Hkv, D).to(v_cache.dtype).contiguous(), slot_mapping)
        if prefill:                                                       # the new tokens are the whole context
            kk = k.repeat_interleave(cfg.group_size, dim=1)               # (1, H, T, D)
            vv = v.repeat_interleave(cfg.group_size, dim=1)
            y = F.scaled_dot_product_attention(q, kk, vv, is_causal=True)  # (1, H, T, D)
        else:                                                             # decode: read the cache through the tables
            y = attention(q[:, :, 0].contiguous(), k_cache, v_cache, block_tables, context_lens, scale)  # (B, H, D)
            y = y.to(q.dtype)[:, :, None]                                 # (B, H, 1, D)
        x = x + attn.o_proj(y.transpose(1, 2).reshape(B, T, H * D))      # (B, T, C)
        x = x + mlp(block, x)
    return model.lm_head(model.norm(x))                                   # (B, T, V)
