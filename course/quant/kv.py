"""A paged KV pool stored in 8 bits (lab 10): int8 or float8 codes plus one float32 scale per
token, per (token, head), or per layer.

    pool = QuantKVPool(cfg, n_blocks=64, block_size=16, storage=torch.int8, scales="head")
    pool.write(layer, k, v, slot_mapping, quantize)        # k, v: (N, Hkv, D); quantize(x) -> (codes, scale)
    out = pool.attention(layer, q, block_tables, context_lens, scale)   # (B, H, D), like paged_attention

How to quantize is the lab's to write: `quantize(x)` returns codes in the pool's storage dtype and
a float32 scale that broadcasts against x. Reading dequantizes what it gathered (codes * scale,
in float32) and runs the same decode attention as `course.engine.paged_attention`. That is the
reference: a fused GPU kernel converts codes to floats in registers instead of writing a float32
copy of the gathered blocks first.
"""
from __future__ import annotations

from collections.abc import Callable

import torch

from course.models.config import ModelConfig

STORAGE = (torch.int8, torch.float8_e4m3fn)
SCALES = ("tensor", "token", "head")


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """codes * scale, in float32, then cast to `dtype`. Works for int8 and float8 codes alike."""
    if not isinstance(q, torch.Tensor) or not isinstance(scale, torch.Tensor):
        raise TypeError(f"q and scale must be tensors, got {type(q).__name__} and {type(scale).__name__}")
    return (q.to(torch.float32) * scale.to(torch.float32)).to(dtype)


def fp8_native(device: str | torch.device) -> bool:
    """True where the device does float8 matrix math in hardware (NVIDIA sm_89 Ada and sm_90 Hopper
    or newer: `torch._scaled_mm`). Elsewhere float8 is a storage format: cast to float to compute."""
    dev = torch.device(device)
    return dev.type == "cuda" and torch.cuda.is_available() and torch.cuda.get_device_capability(dev) >= (8, 9)


def _bytes_view(x: torch.Tensor) -> torch.Tensor:
    """float8 tensors as uint8 for indexing (gather and scatter of float8 are not implemented on every device)."""
    return x.view(torch.uint8) if x.dtype == torch.float8_e4m3fn else x


class QuantKVPool:
    """Keys and values of every layer as 8-bit codes, (n_layer, n_blocks, block_size, Hkv, D), and
    float32 scales, (n_layer, n_blocks, block_size, S, 1) with S = Hkv ('head') or 1 ('token');
    'tensor' keeps one scale per layer, (n_layer,), set from the first write."""

    def __init__(self, cfg: ModelConfig, n_blocks: int, block_size: int, storage: torch.dtype = torch.int8,
                 scales: str = "head", device: str | torch.device = "cpu"):
        if not isinstance(cfg, ModelConfig):
            raise TypeError(f"cfg must be a ModelConfig (model.cfg), got {type(cfg).__name__}")
        for name, value in (("n_blocks", n_blocks), ("block_size", block_size)):
            if type(value) is not int or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if storage not in STORAGE:
            raise ValueError(f"storage must be torch.int8 or torch.float8_e4m3fn, got {storage}")
        if scales not in SCALES:
            raise ValueError(f"scales must be one of {SCALES}, got {scales!r}")
        self.cfg, self.n_blocks, self.block_size, self.storage, self.scales = cfg, n_blocks, block_size, storage, scales
        Hkv, D = cfg.n_kv_head, cfg.head_dim
        shape = (cfg.n_layer, n_blocks, block_size, Hkv, D)
        self.k = torch.zeros(shape, dtype=storage, device=device)
        self.v = torch.zeros(shape, dtype=storage, device=device)
        if scales == "tensor":
            s_shape = (cfg.n_layer,)
        else:
            s_shape = (cfg.n_layer, n_blocks, block_size, Hkv if scales == "head" else 1, 1)
        self.k_scale = torch.ones(s_shape, dtype=torch.float32, device=device)
        self.v_scale = torch.ones(s_shape, dtype=torch.float32, device=device)
        self._tensor_scale_set = [False] * cfg.n_layer

    @property
    def device(self) -> torch.device:
        return self.k.device

    def bytes_reserved(self) -> int:
        """Codes and scales of the whole pool."""
        return self.k.nbytes + self.v.nbytes + self.k_scale.nbytes + self.v_scale.nbytes

    def bytes_per_token(self) -> int:
        """What one token costs in every layer, scales included (a per-layer scale counts as 0)."""
        cfg = self.cfg
        codes = 2 * cfg.n_layer * cfg.n_kv_head * cfg.head_dim * self.k.element_size()
        per = {"tensor": 0, "token": 1, "head": cfg.n_kv_head}[self.scales]
        return codes + 2 * cfg.n_layer * per * 4

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor,
              quantize: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Quantize k and v (N, Hkv, D) and store codes and scales in slot_mapping's slots (-1: skip)."""
        n_slots = self.n_blocks * self.block_size
        Hkv, D = self.cfg.n_kv_head, self.cfg.head_dim
        if k.shape != v.shape or k.shape[1:] != (Hkv, D) or slot_mapping.shape != k.shape[:1]:
            raise ValueError(f"k and v must be (N, {Hkv}, {D}) with slot_mapping (N,); got {tuple(k.shape)}, "
                             f"{tuple(v.shape)}, {tuple(slot_mapping.shape)}")
        keep = slot_mapping >= 0
        slots = slot_mapping[keep].long()
        for x, codes, scales in ((k[keep], self.k, self.k_scale), (v[keep], self.v, self.v_scale)):
            q, s = quantize(x.float())
            if not isinstance(q, torch.Tensor) or q.dtype != self.storage or q.shape != x.shape:
                got = f"{tuple(q.shape)} {q.dtype}" if isinstance(q, torch.Tensor) else type(q).__name__
                raise ValueError(f"quantize must return codes {tuple(x.shape)} {self.storage}, got {got}")
            flat = _bytes_view(codes[layer]).view(n_slots, Hkv, D)
            flat[slots] = _bytes_view(q)
            s = s.float().expand(*x.shape[:1], *s.shape[1:]) if s.dim() == 3 else s.float()
            if self.scales == "tensor":
                if s.numel() != 1 and not bool((s == s.reshape(-1)[0]).all()):
                    raise ValueError("a per-layer ('tensor') pool needs one scale for everything quantize returns")
                scales[layer] = s.reshape(-1)[0]
                self._tensor_scale_set[layer] = True
            else:
                want = (x.shape[0], Hkv if self.scales == "head" else 1, 1)
                if s.shape != want:
                    raise ValueError(f"quantize must return scales of shape {want} for scales={self.scales!r}, "
                                     f"got {tuple(s.shape)}")
                scales[layer].view(n_slots, *want[1:])[slots] = s

    def gather(self, layer: int, block_tables: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Dequantized keys and values of every block of every row: each (B, L, Hkv, D) float32."""
        B, width = block_tables.shape
        L = width * self.block_size
        Hkv, D = self.cfg.n_kv_head, self.cfg.head_dim
        idx = block_tables.long()
        out = []
        for codes, scales in ((self.k, self.k_scale), (self.v, self.v_scale)):
            q = _bytes_view(codes[layer])[idx]                          # (B, width, bs, Hkv, D) codes
            if codes.dtype == torch.float8_e4m3fn:
                q = q.view(torch.float8_e4m3fn)
            s = scales[layer] if self.scales == "tensor" else scales[layer][idx]
            out.append(dequantize(q, s).reshape(B, L, Hkv, D))
        return out[0], out[1]

    def attention(self, layer: int, q: torch.Tensor, block_tables: torch.Tensor, context_lens: torch.Tensor,
                  scale: float) -> torch.Tensor:
        """Decode attention of q (B, H, D) over each row's first context_lens[b] tokens: (B, H, D) in q's dtype."""
        B, H, D = q.shape
        Hkv = self.cfg.n_kv_head
        if block_tables.dim() != 2 or block_tables.shape[0] != B or context_lens.shape != (B,):
            raise ValueError(f"block_tables must be (B, max_blocks) and context_lens (B,) with B = {B}; got "
                             f"{tuple(block_tables.shape)} and {tuple(context_lens.shape)}")
        k, v = self.gather(layer, block_tables)                         # (B, L, Hkv, D) each
        L = k.shape[1]
        valid = torch.arange(L, device=q.device)[None, :] < context_lens[:, None].to(q.device)   # (B, L)
        qg = q.float().view(B, Hkv, H // Hkv, D)                        # (B, Hkv, G, D)
        scores = torch.einsum("bkgd,blkd->bkgl", qg, k) * scale         # (B, Hkv, G, L)
        scores = scores.masked_fill(~valid[:, None, None, :], float("-inf"))
        out = torch.einsum("bkgl,blkd->bkgd", scores.softmax(dim=-1), torch.where(valid[:, :, None, None], v, 0.0))
        return out.reshape(B, H, D).to(q.dtype)

    def __repr__(self) -> str:
        return (f"QuantKVPool({self.storage}, scales={self.scales!r}, n_blocks={self.n_blocks}, "
                f"block_size={self.block_size}, {self.bytes_reserved() / 2**20:.1f} MiB)")
