"""A KV cache as serving engines without paging keep it: one preallocated slot per sequence.

Each slot reserves room for `max_len` tokens up front, whatever the sequence will really use.
That makes writing and reading trivial (a sequence's keys sit side by side in its slot) and
wastes memory: the unused tail of every slot, and the pads of a padded batch. Lab 05 measures
that waste with `bytes_reserved()` and `bytes_used()` and replaces the slots with pages.

    k, v:    (n_layer, n_slots, n_kv_head, max_len, head_dim)   the stored keys and values
    lengths: (n_slots,)            how many positions of each slot are written (pads included)
    valid:   (n_slots, max_len)    which written positions hold a real token (pads are False)
"""
from __future__ import annotations

import torch

from course.models.config import ModelConfig


class SlotKVCache:
    def __init__(self, cfg: ModelConfig, n_slots: int, max_len: int, dtype: torch.dtype = torch.float32,
                 device: str | torch.device = "cpu"):
        if not isinstance(cfg, ModelConfig):
            raise TypeError(f"cfg must be a ModelConfig (model.cfg), got {type(cfg).__name__}")
        for name, value in (("n_slots", n_slots), ("max_len", max_len)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        self.cfg, self.n_slots, self.max_len = cfg, n_slots, max_len
        shape = (cfg.n_layer, n_slots, cfg.n_kv_head, max_len, cfg.head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.lengths = torch.zeros(n_slots, dtype=torch.long, device=device)
        self.valid = torch.zeros(n_slots, max_len, dtype=torch.bool, device=device)

    @property
    def device(self) -> torch.device:
        return self.k.device

    def check_slot(self, slot: int) -> int:
        if not 0 <= int(slot) < self.n_slots:
            raise ValueError(f"slot {int(slot)} is out of range: this cache has slots 0..{self.n_slots - 1}")
        return int(slot)

    def reset(self, slot: int) -> None:
        """Empty one slot for a new sequence. The old keys stay in memory but are never read again."""
        slot = self.check_slot(slot)
        self.lengths[slot] = 0
        self.valid[slot] = False

    def bytes_per_token(self) -> int:
        """Keys and values of one token in every layer."""
        return 2 * self.cfg.n_layer * self.cfg.n_kv_head * self.cfg.head_dim * self.k.element_size()

    def bytes_reserved(self) -> int:
        """Memory held by the cache: every slot at full length, used or not."""
        return self.k.nbytes + self.v.nbytes

    def bytes_used(self) -> int:
        """Memory that holds a real token's keys and values (pads and unwritten tails excluded)."""
        return int(self.valid.sum()) * self.bytes_per_token()

    def __repr__(self) -> str:
        return (f"SlotKVCache(n_slots={self.n_slots}, max_len={self.max_len}, lengths={self.lengths.tolist()}, "
                f"{self.bytes_used() / 2**20:.1f} of {self.bytes_reserved() / 2**20:.1f} MiB used)")
