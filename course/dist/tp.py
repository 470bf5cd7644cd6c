"""Tensor parallelism, the given parts: what one rank holds of a block (`TPBlock`), and the forward
pass of the whole model on one rank (`tp_forward`), which calls the lab's attention and MLP.

    shards = [shard_block(b, cfg, comm.rank, comm.world_size) for b in model.blocks]   # the lab's
    logits = tp_forward(model, shards, ids, pos, comm, attention=tp_attention, mlp=tp_mlp)

Each rank keeps its own share of every block (a slice of the attention heads and of the MLP's
hidden units) and a full copy of what is small or shared: the embedding, the norms, the output
head. Every rank runs every layer on the same input; inside a layer the ranks' partial results
are summed by an all-reduce, so every rank leaves the layer with the same full activation.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn as nn

from course.dist.comm import Comm
from course.engine.runner import embed
from course.models.decoder import Decoder, check_ids


@dataclass(eq=False)
class TPBlock:
    """One block's share on one rank. Linear layers are `nn.Linear` modules holding only this rank's
    rows (column-parallel) or columns (row-parallel); n_head and n_kv_head count this rank's heads.

    attention: q, k, v (column-parallel by heads), o (row-parallel by heads)
    MLP:       gate, up (column-parallel), down (row-parallel). GPT-2 has no gate: up is its `fc`,
               down its `proj`, and the activation is GELU instead of SiLU(gate) * up.
    """

    rank: int
    world_size: int
    family: str                  # "llama" or "gpt2"
    n_head: int                  # query heads on this rank
    n_kv_head: int               # key/value heads on this rank
    head_dim: int
    attn_norm: nn.Module         # replicated (every rank has the whole norm)
    mlp_norm: nn.Module
    q: nn.Module
    k: nn.Module
    v: nn.Module
    o: nn.Module
    up: nn.Module
    down: nn.Module
    gate: nn.Module | None = None

    def parameter_bytes(self) -> int:
        """Bytes of the weights this rank holds for the block (norms included)."""
        mods = [self.attn_norm, self.mlp_norm, self.q, self.k, self.v, self.o, self.up, self.down, self.gate]
        return sum(p.nbytes for m in mods if isinstance(m, nn.Module) for p in m.parameters())


def whole_block(block, cfg) -> TPBlock:
    """A block as "rank 0 of 1" holds it: every head, every weight (tensor parallelism with W = 1)."""
    llama = cfg.family == "llama"
    return TPBlock(rank=0, world_size=1, family=cfg.family, n_head=cfg.n_head, n_kv_head=cfg.n_kv_head,
                   head_dim=cfg.head_dim, attn_norm=block.attn_norm, mlp_norm=block.mlp_norm,
                   q=block.attn.q_proj, k=block.attn.k_proj, v=block.attn.v_proj, o=block.attn.o_proj,
                   up=block.mlp.up_proj if llama else block.mlp.fc, down=block.mlp.down_proj if llama else block.mlp.proj,
                   gate=block.mlp.gate_proj if llama else None)


@torch.no_grad()
def tp_forward(model: Decoder, shards: list[TPBlock], input_ids: torch.Tensor, position_ids: torch.Tensor,
               comm: Comm, *, attention: Callable, mlp: Callable) -> torch.Tensor:
    """Logits (B, T, V) on this rank: embedding (replicated), then for each block

        x = x + attention(attn_norm(x), shard, rope, comm)     # one all-reduce inside
        x = x + mlp(mlp_norm(x), shard, comm)                  # one all-reduce inside

    then the final norm and output head (replicated). `attention` and `mlp` are the lab's."""
    if not isinstance(model, Decoder):
        raise TypeError(f"model must be a course Decoder, got {type(model).__name__}")
    if not isinstance(shards, (list, tuple)) or len(shards) != model.cfg.n_layer:
        got = len(shards) if isinstance(shards, (list, tuple)) else type(shards).__name__
        raise ValueError(f"shards must be a list of {model.cfg.n_layer} TPBlocks (one per layer), got {got}")
    for i, s in enumerate(shards):
        if not isinstance(s, TPBlock):
            raise TypeError(f"shards[{i}] must be a TPBlock, got {type(s).__name__}")
        if s.world_size != comm.world_size or s.rank != comm.rank:
            raise ValueError(f"shards[{i}] was cut for rank {s.rank} of {s.world_size}, but this is rank "
                             f"{comm.rank} of {comm.world_size}")
    check_ids(input_ids, position_ids, model.cfg)
    x, rope = embed(model, input_ids, position_ids)                       # (B, T, C), the same on every rank
    for shard in shards:
        x = x + attention(shard.attn_norm(x), shard, rope, comm)          # (B, T, C)
        x = x + mlp(shard.mlp_norm(x), shard, comm)                       # (B, T, C)
    return model.lm_head(model.norm(x))                                   # (B, T, V)

