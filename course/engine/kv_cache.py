"""Lab 03's KV cache, released: the from-scratch decoder with a cache of each layer's keys and
values, as a list of (k, v) per layer that every call extends. Later problems of lab 03 and later
labs are graded on it, so that a mistake in an earlier problem costs only that problem's points.

    cached = with_kv_cache(model)                                    # same weight tensors, cached forward
    logits, cache = cached(ids, torch.arange(T)[None])               # prefill: cache of T tokens per layer
    logits, cache = cached(next_id, torch.tensor([[T]]), cache)       # decode: one token at position T
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from course.models.decoder import Attention, Block, Decoder, apply_rope, check_ids, rope_cos_sin
from course.models.weights import meta_model

KVCache = list[tuple[torch.Tensor, torch.Tensor]]   # one (k, v) per layer, each (B, Hkv, n, D)


class CachedAttention(Attention):
    """Attention over the new tokens x (B, T, C) and a cache (k, v) of n earlier tokens, each
    (B, Hkv, n, D). Returns y (B, T, C) and the extended cache, each (B, Hkv, n + T, D)."""

    def forward(self, x: torch.Tensor, rope, kv_cache: tuple[torch.Tensor, torch.Tensor] | None = None):
        B, T, _ = x.shape
        H, Hkv, D = self.cfg.n_head, self.cfg.n_kv_head, self.cfg.head_dim
        q = self.q_proj(x).view(B, T, H, D).transpose(1, 2)          # (B, H, T, D)
        k = self.k_proj(x).view(B, T, Hkv, D).transpose(1, 2)        # (B, Hkv, T, D)
        v = self.v_proj(x).view(B, T, Hkv, D).transpose(1, 2)
        if rope is not None:
            q, k = apply_rope(q, *rope), apply_rope(k, *rope)        # the new tokens' positions
        if kv_cache is not None:
            k = torch.cat([kv_cache[0], k], dim=2)                   # (B, Hkv, n + T, D)
            v = torch.cat([kv_cache[1], v], dim=2)
        cache = (k, v)
        k = k.repeat_interleave(self.cfg.group_size, dim=1)          # (B, H, n + T, D): GQA
        v = v.repeat_interleave(self.cfg.group_size, dim=1)
        n_keys = k.shape[2]
        if n_keys == T:                                              # nothing cached: causal
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        elif T == 1:                                                 # one new token reads every key
            y = F.scaled_dot_product_attention(q, k, v)
        else:                                                        # T new after n: bottom-right causal
            mask = torch.ones(T, n_keys, dtype=torch.bool, device=x.device).tril(diagonal=n_keys - T)
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, H * D)), cache


class CachedBlock(Block):
    def __init__(self, cfg, layer_idx: int):
        super().__init__(cfg, layer_idx)
        self.attn = CachedAttention(cfg, layer_idx)

    def forward(self, x: torch.Tensor, rope, kv_cache=None):
        h, cache = self.attn(self.attn_norm(x), rope, kv_cache)
        x = x + h
        return x + self.mlp(self.mlp_norm(x)), cache


class CachedDecoder(Decoder):
    """`Decoder` whose forward takes the new tokens and the cache, and returns (logits, new cache)."""

    def __init__(self, cfg):
        super().__init__(cfg)
        self.blocks = nn.ModuleList(CachedBlock(cfg, i) for i in range(cfg.n_layer))

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, kv_cache: KVCache | None = None):
        check_ids(input_ids, position_ids, self.cfg)
        x = self.embed(input_ids)                                    # (B, T, C)
        rope = None
        if self.cfg.family == "gpt2":
            x = x + self.pos_embed(position_ids)
        else:
            rope = rope_cos_sin(position_ids, self.cfg.head_dim, self.cfg.rope_theta, x.dtype)   # as Decoder.forward
        if kv_cache is None:
            kv_cache = [None] * len(self.blocks)
        if len(kv_cache) != len(self.blocks):
            raise ValueError(f"kv_cache must hold one (k, v) per layer ({len(self.blocks)}), got {len(kv_cache)}")
        new_cache = []
        for block, layer_cache in zip(self.blocks, kv_cache):
            x, layer_cache = block(x, rope, layer_cache)
            new_cache.append(layer_cache)
        return self.lm_head(self.norm(x)), new_cache                 # (B, T, V), n_layer x (k, v)


def with_kv_cache(model: Decoder, cls: type = CachedDecoder) -> Decoder:
    """A cached decoder (`cls`, built like CachedDecoder) sharing `model`'s weight tensors: built on the
    meta device (no memory), then given the model's tensors as they are."""
    cached = meta_model(model.cfg, cls)
    cached.load_state_dict(model.state_dict(), assign=True)
    if model.cfg.tie_embeddings:
        cached.lm_head.weight = cached.embed.weight                  # keep the output layer tied
    return cached.eval()
