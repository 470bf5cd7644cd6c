"""Engine parts that no lab grades, and earlier labs' answers released for the labs after them.

    cache = SlotKVCache(model.cfg, n_slots=8, max_len=512)
    logits = forward_cached(model, input_ids, position_ids, cache, slots, attention_mask)

Labs 04 and later build their engines (batching, scheduling, sampling) on these. Lab 05 adds a
paged cache (`PagedKVCache`, blocks shared by all sequences) and `forward_paged`, which calls a
function to write keys and values and one to attend through block tables: lab 05's answers to
those (`write_kv`, `paged_attention`) and its allocator (`BlockAllocator`) are released here for
the labs after it (06 Triton kernels, 09 prefix caching, 10 a smaller KV cache, 11 serving).
For lab 11 (serving): lab 04's scheduler at token granularity (`Seq`, `schedule_prefill_first`,
`schedule_chunked`), lab 07's batched sampler (`SamplingParams`, `sample`, with the server's logit
bias and penalties from `penalties.py`), lab 09's prefix cache (`PrefixCache`), and
`forward_extend`, the forward pass of a step that mixes prefill chunks and decodes.
Lab 02's CUDA graphs (`StepGraph`, a CPU stand-in with the same semantics) power the decode path of
every engine: `capture_decode_graphs(model, cache, ...)` makes `forward_cached` / `forward_paged`
replay a captured step for each batch bucket (`batch_buckets`). Lab 08 gets its one-slot caches from
`width_graphs.SlotCachePool`: on a GPU each keeps graphs for its call widths (1, and gamma + 1 to verify).
"""
from course.engine.block_manager import BlockAllocator, OutOfBlocks
from course.engine.extend import forward_extend
from course.engine.graphs import (GraphCaptureError, PagedDecodeGraphs, SlotDecodeGraphs, StepGraph, batch_buckets,
                                  capture_decode_graphs)
from course.engine.paged import PagedKVCache, block_table_tensor, forward_paged
from course.engine.paged_ops import paged_attention, write_kv
from course.engine.prefix_cache import BlockPool, PrefixCache, block_hashes, hash_block
from course.engine.runner import forward_cached
from course.engine.sampler import SamplingParams, sample
from course.engine.scheduler import Seq, schedule_chunked, schedule_prefill_first
from course.engine.slot_cache import SlotKVCache

__all__ = ["BlockAllocator", "BlockPool", "GraphCaptureError", "OutOfBlocks", "PagedDecodeGraphs", "PagedKVCache",
           "PrefixCache", "SamplingParams", "Seq", "SlotDecodeGraphs", "SlotKVCache", "StepGraph", "batch_buckets",
           "block_hashes", "block_table_tensor", "capture_decode_graphs", "forward_cached", "forward_extend",
           "forward_paged", "hash_block", "paged_attention", "sample", "schedule_chunked", "schedule_prefill_first",
           "write_kv"]
