"""Engine parts that no lab grades, and earlier labs' answers released for the labs after them.

    cache = SlotKVCache(model.cfg, n_slots=8, max_len=512)
    logits = forward_cached(model, input_ids, position_ids, cache, slots, attention_mask)

Labs 04 and later build their engines (batching, scheduling, sampling) on these. Lab 05 adds a
paged cache (`PagedKVCache`, blocks shared by all sequences) and `forward_paged`, which calls a
function to write keys and values and one to attend through block tables: lab 05's answers to
those (`write_kv`, `paged_attention`) and its allocator (`BlockAllocator`) are released here for
the labs after it (06 Triton kernels, 09 prefix caching, 10 a smaller KV cache, 11 serving).
"""
from course.engine.block_manager import BlockAllocator, OutOfBlocks
from course.engine.paged import PagedKVCache, block_table_tensor, forward_paged
from course.engine.paged_ops import paged_attention, write_kv
from course.engine.runner import forward_cached
from course.engine.slot_cache import SlotKVCache

__all__ = ["BlockAllocator", "OutOfBlocks", "PagedKVCache", "SlotKVCache", "block_table_tensor", "forward_cached",
           "forward_paged", "paged_attention", "write_kv"]
