"""Engine parts that no lab grades: a preallocated KV cache with one slot per sequence, and a
forward pass of the from-scratch `Decoder` that reads and writes it.

    cache = SlotKVCache(model.cfg, n_slots=8, max_len=512)
    logits = forward_cached(model, input_ids, position_ids, cache, slots, attention_mask)

Labs 04 and later build their engines (batching, scheduling, sampling) on these two. Lab 05 adds
a paged cache (`PagedKVCache`, blocks shared by all sequences) and `forward_paged`, which calls
the lab's own functions to write keys and values and to attend through block tables.
"""
from course.engine.paged import PagedKVCache, block_table_tensor, forward_paged
from course.engine.runner import forward_cached
from course.engine.slot_cache import SlotKVCache

__all__ = ["PagedKVCache", "SlotKVCache", "block_table_tensor", "forward_cached", "forward_paged"]
