"""`forward_cached`: the from-scratch `Decoder`, run over a `SlotKVCache`, for a batch of rows
that may each sit in a different slot at a different length.

It reuses the model's own modules (embeddings, norms, projections, MLPs) layer by layer; only
attention changes: new keys and values go into the cache first, then every query attends to the
keys of its own slot. Row b writes its T new tokens at positions lengths[slot] .. lengths[slot] + T
of its slot, and its query t (at slot position p = lengths[slot] + t) may see slot position j when

    j <= p  (causal)   and   (j holds a real token  or  j == p).

The `j == p` part lets a pad query see itself, so its (ignored) output stays finite instead of
becoming the NaN of a softmax over nothing. Pads are written but marked invalid, so no real token
ever attends to them.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from course.engine.slot_cache import SlotKVCache
from course.models.decoder import Decoder, apply_rope, check_ids, rope_cos_sin


@torch.no_grad()
def forward_cached(model: Decoder, input_ids: torch.Tensor, position_ids: torch.Tensor, cache: SlotKVCache,
                   slots: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Logits (B, T, V) for input_ids (B, T); row b's keys and values are stored in slot slots[b].

    position_ids (B, T) say where each token sits in its own sequence (RoPE or learned positions).
    attention_mask (B, T), 1 for a real token and 0 for a pad, or None for all real.
    Advances cache.lengths[slots] by T. When the cache carries CUDA graphs of the decode step
    (`course.engine.graphs.capture_decode_graphs`), a decode call (B, 1) replays one instead; its
    logits are then a static buffer, overwritten by the next call: read them before that.
    """
    graphs = getattr(cache, "graphs", None)
    if graphs is not None:
        return graphs(model, input_ids, position_ids, cache, slots, attention_mask)
    return forward_cached_eager(model, input_ids, position_ids, cache, slots, attention_mask)


@torch.no_grad()
def forward_cached_eager(model: Decoder, input_ids: torch.Tensor, position_ids: torch.Tensor, cache: SlotKVCache,
                         slots: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
    """forward_cached, op by op (no graph): what every call does when the cache has no graphs."""
    cfg = model.cfg
    B, T, start = _check(model, input_ids, position_ids, cache, slots, attention_mask)
    H, Hkv, D = cfg.n_head, cfg.n_kv_head, cfg.head_dim
    slots = slots.to(cache.device, torch.long)
    real = torch.ones(B, T, dtype=torch.bool, device=cache.device) if attention_mask is None \
        else attention_mask.to(cache.device).bool()
    pos = start[:, None] + torch.arange(T, device=cache.device)           # (B, T): slot position of each new token
    cache.valid[slots[:, None], pos] = real
    L = int(pos.max()) + 1                                                # attend over slot positions 0 .. L-1 only
    j = torch.arange(L, device=cache.device)
    seen = (j <= pos[..., None]) & (cache.valid[slots, None, :L] | (j == pos[..., None]))  # (B, T, L)
    seen = seen[:, None]                                                  # (B, 1, T, L): same for every head

    x, rope = embed(model, input_ids, position_ids)                       # (B, T, C)
    for i, block in enumerate(model.blocks):
        attn = block.attn
        q, k, v = project_qkv(model, block, x, rope)                      # (B, H, T, D), (B, Hkv, T, D) x 2
        # write: cache.k[i] is (n_slots, Hkv, max_len, D); indexing slot and position gives (B, T, Hkv, D)
        cache.k[i][slots[:, None], :, pos] = k.transpose(1, 2).to(cache.k.dtype)
        cache.v[i][slots[:, None], :, pos] = v.transpose(1, 2).to(cache.v.dtype)
        # read: every row's whole slot so far, new tokens included
        keys = cache.k[i][slots, :, :L].to(q.dtype)                      # (B, Hkv, L, D)
        values = cache.v[i][slots, :, :L].to(q.dtype)                    # (B, Hkv, L, D)
        keys = keys.repeat_interleave(cfg.group_size, dim=1)             # (B, H, L, D): GQA
        values = values.repeat_interleave(cfg.group_size, dim=1)         # (B, H, L, D)
        y = F.scaled_dot_product_attention(q, keys, values, attn_mask=seen)  # (B, H, T, D)
        x = x + attn.o_proj(y.transpose(1, 2).reshape(B, T, H * D))      # (B, T, C)
        x = x + block.mlp(block.mlp_norm(x))
    cache.lengths[slots] += T
    return model.lm_head(model.norm(x))                                   # (B, T, V)


def _check(model, input_ids, position_ids, cache, slots, attention_mask) -> tuple[int, int, torch.Tensor]:
    """Fail early, naming the argument. Returns B, T and the slots' current lengths (B,)."""
    if not isinstance(cache, SlotKVCache):
        raise TypeError(f"cache must be a SlotKVCache, got {type(cache).__name__}")
    cfg = model.cfg
    if (cache.cfg.n_layer, cache.cfg.n_kv_head, cache.cfg.head_dim) != (cfg.n_layer, cfg.n_kv_head, cfg.head_dim):
        raise ValueError("cache was built for another model: make it with SlotKVCache(model.cfg, ...)")
    check_ids(input_ids, position_ids, cfg)
    B, T = input_ids.shape
    if T < 1:
        raise ValueError(f"input_ids must hold at least one token per row, got shape {tuple(input_ids.shape)}")
    if input_ids.device != model.device or cache.device != model.device:
        raise ValueError(f"input_ids ({input_ids.device}), cache ({cache.device}) and model ({model.device}) "
                         "must be on the same device")
    if not isinstance(slots, torch.Tensor) or slots.shape != (B,) or slots.is_floating_point():
        got = tuple(slots.shape) if isinstance(slots, torch.Tensor) else type(slots).__name__
        raise ValueError(f"slots must be an integer tensor of shape (B,) = ({B},), one slot per row, got {got}")
    for s in slots.tolist():
        cache.check_slot(s)
    if len(set(slots.tolist())) != B:
        raise ValueError(f"slots must be distinct (two rows cannot share a slot), got {slots.tolist()}")
    if attention_mask is not None and (not isinstance(attention_mask, torch.Tensor) or attention_mask.shape != (B, T)):
        got = tuple(attention_mask.shape) if isinstance(attention_mask, torch.Tensor) else type(attention_mask).__name__
        raise ValueError(f"attention_mask must have the shape of input_ids {(B, T)}, got {got}")
    start = cache.lengths[slots.to(cache.device, torch.long)]
    for s, n in zip(slots.tolist(), (start + T).tolist()):
        if n > cache.max_len:
            raise ValueError(f"slot {s} would hold {n} tokens, max_len is {cache.max_len}")
    return B, T, start


def embed(model: Decoder, input_ids: torch.Tensor, position_ids: torch.Tensor):
    """The input of layer 0, (B, T, C), and the RoPE tables (None for GPT-2's learned positions)."""
    cfg = model.cfg
    x = model.embed(input_ids)                                            # (B, T, C)
    if cfg.family == "gpt2":
        return x + model.pos_embed(position_ids), None
    return x, rope_cos_sin(position_ids, cfg.head_dim, cfg.rope_theta, x.dtype)


def project_qkv(model: Decoder, block, x: torch.Tensor, rope):
    """One layer's queries (B, H, T, D) and new keys and values (B, Hkv, T, D), positions applied:
    what every cached forward (slots here, blocks in paged.py) computes before it touches a cache."""
    cfg, attn = model.cfg, block.attn
    B, T, _ = x.shape
    H, Hkv, D = cfg.n_head, cfg.n_kv_head, cfg.head_dim
    h = block.attn_norm(x)
    q = attn.q_proj(h).view(B, T, H, D).transpose(1, 2)                   # (B, H, T, D)
    k = attn.k_proj(h).view(B, T, Hkv, D).transpose(1, 2)                 # (B, Hkv, T, D)
    v = attn.v_proj(h).view(B, T, Hkv, D).transpose(1, 2)                 # (B, Hkv, T, D)
    if rope is not None:
        q, k = apply_rope(q, *rope), apply_rope(k, *rope)
    return q, k, v
