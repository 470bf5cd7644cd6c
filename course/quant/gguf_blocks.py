"""What the default model's GGUF file stores, block by block (lab 10).

The course's SmolLM2-135M ships as `SmolLM2-135M-Instruct.Q4_1.gguf`: every linear layer of every
block in Q4_1, the embedding (tied with the output layer) in Q8_0, the norms in float32. A Q4_1
tensor is a list of 20-byte blocks, one per 32 consecutive weights of a row:

    bytes 0-1   d   float16   the step between two codes
    bytes 2-3   m   float16   the smallest weight of the group
    bytes 4-19  qs  16 bytes  32 codes of 4 bits: byte j holds code j (low nibble) and code j + 16 (high)
    weight i = d * code_i + m

This module reads tensors from the file and cuts their bytes into (d, m, qs), or glues them back;
what the codes mean (quantizing and dequantizing) is the lab's to write. `dequantize_reference`
is the `gguf` package's own dequantizer, for checking.

GGUF lists a shape fastest axis first ([cols, rows]); here shapes are PyTorch's (rows, cols).
The converter permutes the rows of `attn_q` and `attn_k` (llama.cpp stores RoPE pairs side by
side); transformers undoes that when loading, so compare those two with the model row-permuted.
"""
from __future__ import annotations

import struct
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

import numpy as np
import torch

Q4_1_GROUP = 32          # weights per block
Q4_1_BYTES = 20          # 2 (d) + 2 (m) + 16 (codes)
Q8_0_BYTES = 34          # 2 (d, float16) + 32 int8 codes


@dataclass(frozen=True)
class GGUFTensor:
    """One tensor of a GGUF file: its name, storage type ('Q4_1', 'Q8_0', 'F32', ...), shape
    (rows, cols) in PyTorch's order, and its bytes as stored (uint8, one row of blocks per row)."""

    name: str
    kind: str
    shape: tuple[int, ...]
    raw: np.ndarray = field(repr=False)

    @property
    def nbytes(self) -> int:
        return int(self.raw.nbytes)

    @property
    def numel(self) -> int:
        return int(np.prod(self.shape))

    @property
    def bits_per_weight(self) -> float:
        return 8 * self.nbytes / self.numel

    def raw_tensor(self) -> torch.Tensor:
        """The stored bytes as a uint8 tensor (rows, bytes per row), a copy the caller may change."""
        return torch.from_numpy(np.ascontiguousarray(self.raw).view(np.uint8).copy())


@lru_cache(maxsize=2)
def _read_gguf(path: Path) -> tuple[GGUFTensor, ...]:
    return tuple(_tensor_index(path))


def read_gguf(path: str | Path | None = None) -> tuple[GGUFTensor, ...]:
    """Every tensor of a GGUF file (default: the course model's), in file order. The bytes are
    mapped from the file, not read, until used."""
    if path is None:
        from course.models.convert import gguf_path
        path = gguf_path()
    path = Path(path).resolve()
    if not path.is_file():
        raise FileNotFoundError(f"path must be a GGUF file, got {path}")
    return _read_gguf(path)


# GGUF metadata value types (the file format's numbering) and the sizes of the fixed-size ones.
_SCALAR = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9


def _tensor_index(path: Path) -> list[GGUFTensor]:
    """The tensors of a GGUF file (v2 or v3), from its header. `gguf.GGUFReader` does this too, but
    first builds a NumPy view of every metadata string (49,152 tokenizer entries here): tens of
    seconds on a small CPU. Only the alignment is read from the metadata; the rest is skipped."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    buf = np.memmap(path, dtype=np.uint8, mode="r")
    mv = memoryview(buf)
    pos = 0

    def take(fmt: str):
        nonlocal pos
        value = struct.unpack_from(fmt, mv, pos)[0]
        pos += struct.calcsize(fmt)
        return value

    def string() -> str:
        nonlocal pos
        n = take("<Q")
        pos += n
        return bytes(mv[pos - n:pos]).decode("utf-8", errors="replace")

    def skip(kind: int) -> None:
        nonlocal pos
        if kind in _SCALAR:
            pos += struct.calcsize(_SCALAR[kind])
        elif kind == _STRING:
            n = take("<Q")                      # (not `pos += take(...)`: take moves pos first)
            pos += n
        elif kind == _ARRAY:
            inner, count = take("<I"), take("<Q")
            if inner in _SCALAR:
                pos += count * struct.calcsize(_SCALAR[inner])
            else:
                for _ in range(count):
                    skip(inner)
        else:
            raise ValueError(f"{path}: unknown GGUF metadata type {kind}")

    if bytes(mv[:4]) != b"GGUF":
        raise ValueError(f"{path} is not a GGUF file (it does not start with b'GGUF')")
    pos = 4
    version = take("<I")
    if version not in (2, 3):
        raise ValueError(f"{path}: GGUF version {version} is not supported (2 or 3)")
    n_tensors, n_kv = take("<Q"), take("<Q")
    alignment = 32
    for _ in range(n_kv):
        key, kind = string(), take("<I")
        if key == "general.alignment" and kind in _SCALAR:
            alignment = take(_SCALAR[kind])
        else:
            skip(kind)
    infos = []
    for _ in range(n_tensors):
        name = string()
        dims = [take("<Q") for _ in range(take("<I"))]
        kind, offset = take("<I"), take("<Q")
        infos.append((name, dims, GGMLQuantizationType(kind), offset))
    start = -(-pos // alignment) * alignment
    out = []
    for name, dims, kind, offset in infos:
        block, type_size = GGML_QUANT_SIZES[kind]
        shape = tuple(int(d) for d in reversed(dims))                  # PyTorch order: (rows, cols)
        rows = int(np.prod(shape[:-1])) if len(shape) > 1 else 1
        row_bytes = shape[-1] // block * type_size
        raw = buf[start + offset:start + offset + rows * row_bytes].reshape(rows, row_bytes)
        if kind.name in ("F32", "F16", "BF16"):
            raw = raw.view({"F32": np.float32, "F16": np.float16, "BF16": np.uint16}[kind.name]).reshape(shape)
        out.append(GGUFTensor(name=name, kind=kind.name, shape=shape, raw=raw))
    return out


def gguf_tensor(name: str, path: str | Path | None = None) -> GGUFTensor:
    """The tensor called `name` (e.g. 'blk.0.attn_v.weight')."""
    tensors = read_gguf(path)
    for t in tensors:
        if t.name == name:
            return t
    examples = ", ".join(t.name for t in tensors[:4])
    raise KeyError(f"no tensor {name!r} in the GGUF file; names look like {examples}, ...")


def dequantize_reference(t: GGUFTensor) -> torch.Tensor:
    """The `gguf` package's own dequantization of `t`: float32 (rows, cols)."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    values = dequantize(np.asarray(t.raw), GGMLQuantizationType[t.kind])
    return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32)).reshape(t.shape)


def split_q4_1(raw: torch.Tensor, group_size: int = Q4_1_GROUP) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Cut Q4_1 bytes (rows, G * (4 + group_size / 2)) uint8 into d (rows, G) float16, m (rows, G)
    float16 and the packed codes qs (rows, G, group_size / 2) uint8."""
    width = 4 + group_size // 2
    if not isinstance(raw, torch.Tensor) or raw.dtype != torch.uint8 or raw.dim() != 2 or raw.shape[1] % width:
        got = f"{tuple(raw.shape)} {raw.dtype}" if isinstance(raw, torch.Tensor) else type(raw).__name__
        raise ValueError(f"raw must be a uint8 tensor (rows, groups * {width}), got {got}")
    rows = raw.shape[0]
    blocks = raw.reshape(rows, -1, width)                                  # (rows, G, 20)
    d = blocks[..., 0:2].contiguous().view(torch.float16)[..., 0]          # (rows, G)
    m = blocks[..., 2:4].contiguous().view(torch.float16)[..., 0]          # (rows, G)
    return d, m, blocks[..., 4:].contiguous()


def join_q4_1(d: torch.Tensor, m: torch.Tensor, qs: torch.Tensor) -> torch.Tensor:
    """The inverse of `split_q4_1`: the bytes a GGUF file stores for (d, m, qs), uint8 (rows, G * bytes)."""
    if d.dtype != torch.float16 or m.dtype != torch.float16 or qs.dtype != torch.uint8:
        raise ValueError(f"d and m must be float16 and qs uint8, got {d.dtype}, {m.dtype}, {qs.dtype}")
    if d.shape != m.shape or d.dim() != 2 or qs.dim() != 3 or qs.shape[:2] != d.shape:
        raise ValueError(f"d and m must be (rows, G) and qs (rows, G, bytes); got {tuple(d.shape)}, "
                         f"{tuple(m.shape)}, {tuple(qs.shape)}")
    d8 = d.contiguous().view(torch.uint8).reshape(*d.shape, 2)             # (rows, G, 2)
    m8 = m.contiguous().view(torch.uint8).reshape(*m.shape, 2)
    return torch.cat([d8, m8, qs], dim=-1).reshape(d.shape[0], -1)


def model_param(gguf_name: str) -> str:
    """The course Decoder's parameter for a GGUF tensor name: 'blk.3.ffn_up.weight' -> 'blocks.3.mlp.up_proj.weight'."""
    names = {"attn_q": "attn.q_proj", "attn_k": "attn.k_proj", "attn_v": "attn.v_proj", "attn_output": "attn.o_proj",
             "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
             "attn_norm": "attn_norm", "ffn_norm": "mlp_norm"}
    parts = gguf_name.split(".")
    if gguf_name == "token_embd.weight":
        return "embed.weight"
    if gguf_name == "output_norm.weight":
        return "norm.weight"
    if len(parts) == 4 and parts[0] == "blk" and parts[2] in names:
        return f"blocks.{parts[1]}.{names[parts[2]]}.{parts[3]}"
    raise KeyError(f"no Decoder parameter for GGUF tensor {gguf_name!r}")
