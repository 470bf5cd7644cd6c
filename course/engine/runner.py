"""`forward_cached`: the from-scratch `Decoder`, run over a `SlotKVCache`, for a batch of rows
that may each sit in a different slot at a different length.

It reuses the model's own modules (embeddings, norms, projections, MLPs) layer by layer, with one
matmul where the model has several on the same input (q, k and v; gate and up: fused.py). Attention
changes: new keys and values go into the cache first, then every query attends to the keys of its
own slot. Row b writes its T new tokens at positions lengths[slot] .. lengths[slot] + T of its slot,
and its query t (at slot position p = lengths[slot] + t) may see slot position j when

    j <= p  (causal)   and   (j holds a real token  or  j == p).

The `j == p` part lets a pad query see itself, so its (ignored) output stays finite instead of
becoming the NaN of a softmax over nothing. Pads are written but marked invalid, so no real token
ever attends to them.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from course.engine.fused import stacked, unhooked
from course.engine.slot_cache import SlotKVCache
from course.models.decoder import MLP, Decoder, apply_rope, check_ids, rope_cos_sin


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
    slots = slots.to(cache.device, torch.long)
    real = torch.ones(B, T, dtype=torch.bool, device=cache.device) if attention_mask is None \
        else attention_mask.to(cache.device).bool()
    pos = start[:, None] + torch.arange(T, device=cache.device)           # (B, T): slot position of each new token
    cache.valid[slots[:, None], pos] = real
    L = int(pos.max()) + 1                                                # attend over slot positions 0 .. L-1 only
    j = torch.arange(L, device=cache.device)
    seen = (j <= pos[..., None]) & (cache.valid[slots, None, :L] | (j == pos[..., None]))  # (B, T, L)

    x, rope = embed(model, input_ids, position_ids)                       # (B, T, C)
    bias = mask_bias(seen, cfg.group_size, x.dtype)                       # (B, 1, G*T, L): built once, read by every layer
    for i, block in enumerate(model.blocks):
        q, k, v = project_qkv(model, block, x, rope)                      # (B, H, T, D), (B, Hkv, T, D) x 2
        # write: cache.k[i] is (n_slots, Hkv, max_len, D); indexing slot and position gives (B, T, Hkv, D)
        cache.k[i][slots[:, None], :, pos] = k.transpose(1, 2).to(cache.k.dtype)
        cache.v[i][slots[:, None], :, pos] = v.transpose(1, 2).to(cache.v.dtype)
        # read: every row's whole slot so far, new tokens included
        keys = cache.k[i][slots, :, :L].to(q.dtype)                      # (B, Hkv, L, D)
        values = cache.v[i][slots, :, :L].to(q.dtype)                    # (B, Hkv, L, D)
        x = x + block.attn.o_proj(attend(q, keys, values, bias))         # (B, T, C)
        x = x + mlp(block, x)
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
    qkv = stacked((attn.q_proj, attn.k_proj, attn.v_proj))                # one matmul for all three, if it can
    if qkv is not None:
        qkv = F.linear(h, *qkv).view(B, T, H + 2 * Hkv, D)                # (B, T, H + 2 Hkv, D)
        qk, v = qkv[:, :, :H + Hkv], qkv[:, :, H + Hkv:]
    else:
        qk = torch.cat([attn.q_proj(h).view(B, T, H, D), attn.k_proj(h).view(B, T, Hkv, D)], dim=2)
        v = attn.v_proj(h).view(B, T, Hkv, D)
    qk, v = qk.transpose(1, 2), v.transpose(1, 2)                         # (B, H + Hkv, T, D), (B, Hkv, T, D)
    if rope is not None:                                                  # q and k turn by the same angles:
        qk = apply_rope(qk, *rope)                                        # one set of kernels for both
    return qk[:, :H], qk[:, H:], v


def mlp(block, x: torch.Tensor) -> torch.Tensor:
    """block.mlp(block.mlp_norm(x)), with Llama's gate and up computed by one matmul when they can be."""
    h = block.mlp_norm(x)
    m = block.mlp
    gate_up = stacked((m.gate_proj, m.up_proj)) if type(m) is MLP and m.family == "llama" and unhooked(m) else None
    if gate_up is None:
        return m(h)
    gate, up = F.linear(h, *gate_up).chunk(2, dim=-1)                     # (B, T, d_ff) each
    return m.down_proj(F.silu(gate) * up)


def mask_bias(seen: torch.Tensor, group: int, dtype: torch.dtype) -> torch.Tensor:
    """The mask `attend` takes, built once per forward: seen (B, T, L) bool -> (B, 1, group*T, L) in
    `dtype`, 0 where a query may look and -inf where not, row g*T + t for query t of the g-th head of
    every group. Handing attention this bias, rather than a boolean mask, spares every layer the
    conversion. Its rows lie a multiple of 16 elements apart: PyTorch's memory-efficient attention
    kernel wants 8, and pads a copy of a mask on every call when they do not."""
    B, T, L = seen.shape
    padded = -(-L // 16) * 16
    bias = torch.full((B, group * T, padded), float("-inf"), dtype=dtype, device=seen.device)
    bias[..., :L].masked_fill_(seen.repeat(1, group, 1), 0.0)
    return bias[:, None, :, :L]


def attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """Attention of queries q (B, H, T, D) over keys and values (B, Hkv, L, D) with `mask_bias`'s bias;
    returns (B, T, H * D), ready for o_proj. GQA without copying K/V: the G query heads that share a
    KV head become G x T query rows of that head, so each KV head is read once, not repeated G times."""
    B, H, T, D = q.shape
    Hkv = keys.shape[1]
    y = F.scaled_dot_product_attention(q.reshape(B, Hkv, H // Hkv * T, D), keys, values, attn_mask=bias)
    return y.view(B, Hkv, H // Hkv, T, D).permute(0, 3, 1, 2, 4).reshape(B, T, H * D)   # head h = kv * G + g
