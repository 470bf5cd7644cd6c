"""Perplexity of the model on a text, under a changed attention or a changed KV cache (lab 10).

    nll = token_nll(model, ids)                                  # (T - 1,) per-token loss, full attention
    nll = token_nll(model, ids, attn_mask=mask)                  # each query sees only what mask allows
    nll = token_nll(model, ids, kv_transform=lambda x: ...)      # keys and values pass through x -> x'
    perplexity(nll)                                              # exp(mean loss)

One parallel forward over the whole text gives what a token-by-token decode would give, as long
as each query sees the same keys: row t of `attn_mask` says which tokens query t sees (a decode
that evicted the others from its cache), and `kv_transform` is applied to each new key and value
as it would be on its way into the cache (quantize, then dequantize when read). Keys carry their
true positions (RoPE applied before the transform), as in the engine's paged cache.
"""
from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F

from course.engine.runner import embed, project_qkv
from course.models.decoder import Decoder


def _ids(model: Decoder, ids) -> torch.Tensor:
    if isinstance(ids, (list, tuple)):
        ids = torch.tensor(ids, dtype=torch.long, device=model.device)
    if not isinstance(ids, torch.Tensor) or ids.is_floating_point() or ids.dim() not in (1, 2) \
            or (ids.dim() == 2 and ids.shape[0] != 1):
        got = f"{tuple(ids.shape)} {ids.dtype}" if isinstance(ids, torch.Tensor) else type(ids).__name__
        raise ValueError(f"ids must be token ids, a list or a long tensor (T,) or (1, T), got {got}")
    ids = ids.reshape(1, -1).to(model.device, torch.long)
    if ids.shape[1] < 2:
        raise ValueError("ids must hold at least 2 tokens (a loss needs a next token)")
    return ids


@torch.no_grad()
def forward_logits(model: Decoder, ids, attn_mask: torch.Tensor | None = None,
                   kv_transform: Callable[[torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
    """Logits (T, V) of one sequence in one pass. attn_mask: (T, T) bool, True where query t may
    see key j (None: causal); kv_transform: applied to keys and to values of every layer, each
    (T, Hkv, D) in the cache's layout, returning the same shape."""
    ids = _ids(model, ids)
    cfg, T = model.cfg, ids.shape[1]
    if attn_mask is not None:
        if not isinstance(attn_mask, torch.Tensor) or attn_mask.dtype != torch.bool or attn_mask.shape != (T, T):
            got = f"{tuple(attn_mask.shape)} {attn_mask.dtype}" if isinstance(attn_mask, torch.Tensor) else type(attn_mask).__name__
            raise ValueError(f"attn_mask must be a bool tensor ({T}, {T}), got {got}")
        if not bool(attn_mask.diagonal().all()):
            raise ValueError("attn_mask must let every token see itself (its diagonal must be True)")
        attn_mask = attn_mask.to(model.device)
    x, rope = embed(model, ids, torch.arange(T, device=model.device)[None])  # (1, T, C)
    for block in model.blocks:
        q, k, v = project_qkv(model, block, x, rope)                    # (1, H, T, D), (1, Hkv, T, D) x 2
        if kv_transform is not None:
            k = _through(kv_transform, k)
            v = _through(kv_transform, v)
        k = k.repeat_interleave(cfg.group_size, dim=1)                  # (1, H, T, D): GQA
        v = v.repeat_interleave(cfg.group_size, dim=1)
        if attn_mask is None:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask)
        x = x + block.attn.o_proj(y.transpose(1, 2).reshape(1, T, -1))  # (1, T, C)
        x = x + block.mlp(block.mlp_norm(x))
    return model.lm_head(model.norm(x))[0].float()                      # (T, V)


def _through(fn: Callable, x: torch.Tensor) -> torch.Tensor:
    """x (1, Hkv, T, D) -> fn on (T, Hkv, D) -> back, checked."""
    rows = x[0].transpose(0, 1)                                         # (T, Hkv, D)
    out = fn(rows)
    if not isinstance(out, torch.Tensor) or out.shape != rows.shape:
        got = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
        raise ValueError(f"kv_transform must return a tensor of shape {tuple(rows.shape)}, got {got}")
    return out.to(x.dtype).transpose(0, 1)[None]


def token_nll(model: Decoder, ids, attn_mask: torch.Tensor | None = None,
              kv_transform: Callable[[torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
    """Loss of every next token, (T - 1,) float32 on the CPU: entry t is -log p(ids[t + 1] | what
    query t sees)."""
    ids = _ids(model, ids)
    logits = forward_logits(model, ids, attn_mask, kv_transform)
    return F.cross_entropy(logits[:-1], ids[0, 1:], reduction="none").cpu()


def perplexity(nll: torch.Tensor, start: int = 0) -> float:
    """exp(mean loss) of nll[start:]: the number of equally likely tokens the model is, on average,
    choosing between."""
    if not isinstance(nll, torch.Tensor) or nll.dim() != 1 or not 0 <= start < nll.numel():
        raise ValueError(f"nll must be a 1-D tensor of losses and start within it, got start={start}")
    return math.exp(float(nll[start:].double().mean()))


def rolling_mean(x: torch.Tensor, n: int) -> torch.Tensor:
    """Mean of each run of n consecutive values (len(x) - n + 1 of them), for plots of loss by position."""
    if not 1 <= n <= x.numel():
        raise ValueError(f"n must be between 1 and len(x) = {x.numel()}, got {n}")
    c = torch.cat([x.new_zeros(1), x.double().cumsum(0)])
    return ((c[n:] - c[:-n]) / n).float()


@torch.no_grad()
def attention_to_first(model: Decoder, ids, n_first: int = 1, from_pos: int | None = None) -> list[float]:
    """For each layer, the share of attention that queries at positions >= from_pos (default T/2)
    give to the first n_first tokens, averaged over heads and queries (full causal attention)."""
    ids = _ids(model, ids)
    cfg, T = model.cfg, ids.shape[1]
    from_pos = T // 2 if from_pos is None else from_pos
    if not 0 < n_first <= from_pos < T:
        raise ValueError(f"need 0 < n_first <= from_pos < T = {T}, got n_first={n_first}, from_pos={from_pos}")
    x, rope = embed(model, ids, torch.arange(T, device=model.device)[None])
    causal = torch.ones(T, T, dtype=torch.bool, device=model.device).tril()
    shares = []
    for block in model.blocks:
        q, k, v = project_qkv(model, block, x, rope)
        k = k.repeat_interleave(cfg.group_size, dim=1)
        v = v.repeat_interleave(cfg.group_size, dim=1)
        scores = (q.float() @ k.float().transpose(-1, -2)) / math.sqrt(cfg.head_dim)   # (1, H, T, T)
        probs = scores.masked_fill(~causal, float("-inf")).softmax(-1)
        shares.append(float(probs[0, :, from_pos:, :n_first].sum(-1).mean()))
        y = (probs.to(v.dtype) @ v)                                              # (1, H, T, D)
        x = x + block.attn.o_proj(y.transpose(1, 2).reshape(1, T, -1))
        x = x + block.mlp(block.mlp_norm(x))
    return shares
