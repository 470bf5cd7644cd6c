"""A decoder-only transformer from scratch, small enough to read in one sitting.

One file covers two families: Llama (SmolLM2, the course's default) and GPT-2 (the seeds' model).
The labs change this model: lab 03 threads a KV cache through `Attention`, `Block` and `Decoder`.

    input_ids (B, T) --embed--> x (B, T, C) --[Block] x n_layer--> norm --> lm_head --> logits (B, T, V)

B = batch, T = tokens, C = d_model, H = query heads, Hkv = key/value heads, D = head_dim, V = vocab.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from course.models.config import ModelConfig


# ---------------------------------------------------------------------------------------------
# Positions: Llama rotates queries and keys by an angle that grows with the position (RoPE).
# ---------------------------------------------------------------------------------------------
def rope_cos_sin(position_ids: torch.Tensor, head_dim: int, theta: float,
                 dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables for the given positions, each (B, T, D), computed in float32 and returned in
    `dtype` (the model's: then every layer uses them as they are, with no cast of its own)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=position_ids.device).float() / head_dim))
    angles = position_ids[..., None].float() * inv_freq           # (B, T, D/2)
    angles = torch.cat([angles, angles], dim=-1)                  # (B, T, D)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (x[i], x[i + D/2]) of every head by its position's angle. x: (B, H, T, D)."""
    cos, sin = cos[:, None].to(x.dtype), sin[:, None].to(x.dtype)  # (B, 1, T, D): same for every head
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


class RMSNorm(nn.Module):
    """Llama's norm: divide by the root mean square, then scale. No mean subtraction, no bias."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x / sqrt(mean(x^2) + eps) in one call (one fused kernel on CUDA; five ops on a CPU). PyTorch
        # computes it in float32 whatever x's dtype and rounds the result once, to x's dtype.
        return self.weight * F.rms_norm(x, (x.shape[-1],), eps=self.eps)


def make_norm(cfg: ModelConfig) -> nn.Module:
    return RMSNorm(cfg.d_model, cfg.norm_eps) if cfg.family == "llama" else nn.LayerNorm(cfg.d_model, eps=cfg.norm_eps)


# ---------------------------------------------------------------------------------------------
# Attention: every token looks at itself and the tokens before it.
# ---------------------------------------------------------------------------------------------
class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.cfg, self.layer_idx = cfg, layer_idx
        bias = cfg.family == "gpt2"
        D = cfg.head_dim
        self.q_proj = nn.Linear(cfg.d_model, cfg.n_head * D, bias=bias)
        self.k_proj = nn.Linear(cfg.d_model, cfg.n_kv_head * D, bias=bias)
        self.v_proj = nn.Linear(cfg.d_model, cfg.n_kv_head * D, bias=bias)
        self.o_proj = nn.Linear(cfg.n_head * D, cfg.d_model, bias=bias)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
        B, T, _ = x.shape
        H, Hkv, D = self.cfg.n_head, self.cfg.n_kv_head, self.cfg.head_dim
        q = self.q_proj(x).view(B, T, H, D).transpose(1, 2)       # (B, H, T, D)
        k = self.k_proj(x).view(B, T, Hkv, D).transpose(1, 2)     # (B, Hkv, T, D)
        v = self.v_proj(x).view(B, T, Hkv, D).transpose(1, 2)     # (B, Hkv, T, D)
        if rope is not None:
            q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        # GQA: query head h reads key/value head h // group_size, so repeat each KV head.
        k = k.repeat_interleave(self.cfg.group_size, dim=1)       # (B, H, T, D)
        v = v.repeat_interleave(self.cfg.group_size, dim=1)       # (B, H, T, D)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, H, T, D)
        y = y.transpose(1, 2).reshape(B, T, H * D)                # (B, T, C)
        return self.o_proj(y)


class MLP(nn.Module):
    """Llama: down(silu(gate(x)) * up(x)), a gated MLP (SwiGLU). GPT-2: proj(gelu(fc(x)))."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.family = cfg.family
        if cfg.family == "llama":
            self.gate_proj = nn.Linear(cfg.d_model, cfg.d_ff, bias=False)
            self.up_proj = nn.Linear(cfg.d_model, cfg.d_ff, bias=False)
            self.down_proj = nn.Linear(cfg.d_ff, cfg.d_model, bias=False)
        else:
            self.fc = nn.Linear(cfg.d_model, cfg.d_ff)
            self.proj = nn.Linear(cfg.d_ff, cfg.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.family == "llama":
            return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        return self.proj(F.gelu(self.fc(x), approximate="tanh"))


class Block(nn.Module):
    """Pre-norm residual block: x + attention(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.attn_norm = make_norm(cfg)
        self.attn = Attention(cfg, layer_idx)
        self.mlp_norm = make_norm(cfg)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor, rope) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), rope)
        x = x + self.mlp(self.mlp_norm(x))
        return x


class Decoder(nn.Module):
    """The whole model: `forward(input_ids, position_ids) -> logits`."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos_embed = nn.Embedding(cfg.max_seq_len, cfg.d_model) if cfg.family == "gpt2" else None
        self.blocks = nn.ModuleList(Block(cfg, i) for i in range(cfg.n_layer))
        self.norm = make_norm(cfg)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.embed.weight

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        """input_ids, position_ids: (B, T) integer tensors. Returns logits (B, T, V), one row per
        input token: row t scores every vocabulary entry as the token that follows token t."""
        check_ids(input_ids, position_ids, self.cfg)
        x = self.embed(input_ids)                                 # (B, T, C)
        rope = None
        if self.cfg.family == "gpt2":
            x = x + self.pos_embed(position_ids)                  # learned absolute positions
        else:
            rope = rope_cos_sin(position_ids, self.cfg.head_dim, self.cfg.rope_theta, x.dtype)
        for block in self.blocks:
            x = block(x, rope)
        return self.lm_head(self.norm(x))                         # (B, T, V)

    @property
    def device(self) -> torch.device:
        return self.embed.weight.device

    @property
    def dtype(self) -> torch.dtype:
        """The weights' dtype: caches built for this model store keys and values in it."""
        return self.embed.weight.dtype

    def num_parameters(self) -> int:
        """Distinct parameters (a tied lm_head counts once)."""
        return sum(p.numel() for p in self.parameters())


def check_ids(input_ids: torch.Tensor, position_ids: torch.Tensor, cfg: ModelConfig) -> None:
    """Fail early, with the argument's name, on the mistakes that otherwise give cryptic errors."""
    for name, t in (("input_ids", input_ids), ("position_ids", position_ids)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor of shape (B, T), got {type(t).__name__}")
        if t.dim() != 2:
            raise ValueError(f"{name} must have shape (B, T) (use ids[None] for one sequence), got {tuple(t.shape)}")
        if t.dtype not in (torch.long, torch.int32, torch.int64):
            raise TypeError(f"{name} must hold integers (torch.long), got {t.dtype}")
    if input_ids.shape != position_ids.shape:
        raise ValueError(f"position_ids {tuple(position_ids.shape)} must match input_ids {tuple(input_ids.shape)}")
    if cfg.family == "gpt2" and position_ids.numel() and int(position_ids.max()) >= cfg.max_seq_len:
        raise ValueError(f"position_ids go up to {int(position_ids.max())}, past the {cfg.max_seq_len} positions GPT-2 learned")


def init_weights(model: Decoder, std: float = 0.02, seed: int = 0) -> Decoder:
    """Random weights (for tests of shapes and mechanisms without a real checkpoint)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("weight") and p.dim() == 2:
                p.copy_(torch.randn(p.shape, generator=g) * std)
            elif "norm" in name and name.endswith("weight"):
                p.fill_(1.0)
            else:
                p.zero_()
    return model

