"""Pipeline parallelism, the given parts: which layers each stage holds, and one stage's forward.

    stage = Stage(model, s, p)        # stage s of p: layers stage_layers(n_layer, p)[s]
    y = stage(x, position_ids)        # stage 0 takes token ids; the last stage returns logits

A stage is a contiguous run of layers. Stage 0 also holds the embedding, the last stage the final
norm and the output head; each passes its activation (B, T, C) to the next. How the stages take
turns over micro-batches is the lab's (`pipeline_stage`).
"""
from __future__ import annotations

import torch

from course.engine.runner import embed
from course.models.decoder import Decoder, rope_cos_sin


def stage_layers(n_layer: int, n_stages: int) -> list[range]:
    """Contiguous layer ranges, one per stage, as even as possible (the first stages take one more)."""
    if type(n_stages) is not int or not 1 <= n_stages <= n_layer:
        raise ValueError(f"n_stages must be an int in 1..n_layer ({n_layer}): each stage needs a layer, got {n_stages!r}")
    per, extra = divmod(n_layer, n_stages)
    out, start = [], 0
    for s in range(n_stages):
        stop = start + per + (s < extra)
        out.append(range(start, stop))
        start = stop
    return out


class Stage:
    """Stage `stage` of `n_stages` of a course Decoder (shares the model's weights; copies nothing)."""

    def __init__(self, model: Decoder, stage: int, n_stages: int):
        if not isinstance(model, Decoder):
            raise TypeError(f"model must be a course Decoder, got {type(model).__name__}")
        if type(stage) is not int or not 0 <= stage < n_stages:
            raise ValueError(f"stage must be an int in 0..{n_stages - 1}, got {stage!r}")
        self.model, self.stage, self.n_stages = model, stage, n_stages
        self.layers = stage_layers(model.cfg.n_layer, n_stages)[stage]
        self.first, self.last = stage == 0, stage == n_stages - 1

    @torch.no_grad()
    def __call__(self, x: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        """First stage: x = token ids (B, T). Others: x = the previous stage's activation (B, T, C).
        Returns the activation (B, T, C) for the next stage, or on the last stage the logits of
        each sequence's last position (B, V)."""
        cfg = self.model.cfg
        if self.first:
            x, rope = embed(self.model, x, position_ids)                  # (B, T, C)
        else:
            rope = None if cfg.family == "gpt2" else rope_cos_sin(position_ids, cfg.head_dim, cfg.rope_theta, x.dtype)
        for i in self.layers:
            x = self.model.blocks[i](x, rope)                             # (B, T, C)
        if self.last:
            return self.model.lm_head(self.model.norm(x[:, -1]))          # (B, V)
        return x

    def parameter_bytes(self) -> int:
        """Bytes of the weights this stage uses (the tied embedding counted where it is used)."""
        mods = [self.model.blocks[i] for i in self.layers]
        if self.first:
            mods += [self.model.embed] + ([self.model.pos_embed] if self.model.pos_embed is not None else [])
        if self.last:
            mods += [self.model.norm, self.model.lm_head]
        seen, total = set(), 0
        for m in mods:
            for p in m.parameters():
                if id(p) not in seen:
                    seen.add(id(p))
                    total += p.nbytes
        return total

    def __repr__(self) -> str:
        extra = (" + embedding" if self.first else "") + (" + norm and head" if self.last else "")
        return f"Stage({self.stage} of {self.n_stages}: layers {self.layers.start}..{self.layers.stop - 1}{extra})"
