"""CUDA graphs: a decode step captured once and replayed (lab 02), and the engine's decode path on them.

On a GPU a small model's decode step is about a thousand small kernels. The GPU runs each in a few
microseconds, but the CPU launches them one at a time (Python, PyTorch's dispatcher, the driver),
so the step takes as long as the launches, far above its roofline. A CUDA graph records the
kernels of one call, with their arguments, and `replay()` launches all of them with one call.

A graph freezes what it recorded, and everything below follows from that:

- memory: every kernel reads and writes the addresses it had at capture. New inputs must be
  *copied into* the static input buffers before `replay()`; a new tensor handed to Python code is
  never seen by the graph.
- outputs: the output tensors are static too; the next replay overwrites them.
- shapes and control flow: one graph per shape (engines capture one per batch-size *bucket* and pad
  a batch up to its bucket); nothing inside may read a value back to the host (`.item()`, `int()`,
  `bool()`, `.tolist()`) or produce a shape that depends on values (`nonzero`, boolean masks). The
  stand-in refuses these too, except `.tolist()` and `.numpy()` of a CPU tensor, which read memory
  without an op it could see: their values stay frozen at capture.

`StepGraph(device)` is one interface for both devices: `capture(fn)` returns `fn()`'s outputs as
static tensors, `replay()` reruns the work on the same buffers. On CUDA it is `torch.cuda.CUDAGraph`
(warmed up on a side stream, captured into a memory pool that graphs may share). On a CPU it is a
stand-in with the same semantics: capture records the aten ops of one call of `fn` (through a
`TorchDispatchMode`) with the tensors they touched, and replay reruns those ops on those tensors,
writing each result into the tensor recorded at capture. It shows the semantics, not a speedup: a
CPU runs every op synchronously and has no launches to remove.

The engine's decode path (labs 03-06): `SlotDecodeGraphs` (lab 04's slot cache) and
`PagedDecodeGraphs` (lab 05's paged cache) capture the decode step for each batch bucket
(`batch_buckets`: 1, 2, 4, 8, ...), largest first into one shared pool, with static input ids,
positions, slots, block tables and context lengths, over the cache's preallocated K/V. A batch is
padded up to its bucket by repeating its first row (same token, same slot, same keys written: the
pads change nothing). Prefill, other shapes and batches beyond the largest bucket run eagerly.
`capture_decode_graphs(model, cache, ...)` attaches one to a cache, and `forward_cached` /
`forward_paged` then replay it for every decode call on that cache: same calls, same tokens.
A graph removes the launches but not the kernels, so the step launches few (runner.py): one matmul
for q, k and v and one for gate and up (weights stacked, fused.py), q and k rotated together, GQA
without repeating K/V, and the attention mask built once per step instead of once per layer.
"""
from __future__ import annotations

import gc
import math
from collections.abc import Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from course.engine import paged_ops
from course.engine.fused import stack_model
from course.engine.paged import PagedKVCache, forward_paged_eager
from course.engine.runner import attend, embed, forward_cached_eager, mask_bias, mlp, project_qkv
from course.engine.slot_cache import SlotKVCache
from course.models.decoder import Decoder
from course.timing import op_writes, storages

__all__ = ["GraphCaptureError", "StepGraph", "batch_buckets", "SlotDecodeGraphs", "PagedDecodeGraphs",
           "capture_decode_graphs", "GreedyEngine", "greedy_generate"]


class GraphCaptureError(RuntimeError):
    """The captured function did something a graph cannot replay (a host read, a value-dependent shape)."""


def batch_buckets(max_batch: int) -> list[int]:
    """The batch sizes an engine captures: powers of two up to `max_batch`, and `max_batch` itself.
    A batch of B runs in the graph of the smallest bucket >= B (padded): at most 2x the rows."""
    if type(max_batch) is not int or max_batch < 1:
        raise ValueError(f"max_batch must be a positive int, got {max_batch!r}")
    sizes, b = [], 1
    while b < max_batch:
        sizes.append(b)
        b *= 2
    return sizes + [max_batch]


# --- what a graph cannot hold -----------------------------------------------------------------------

_HOST_READS = {"_local_scalar_dense", "equal", "is_nonzero"}
_VALUE_SHAPES = {"nonzero", "masked_select", "masked_scatter", "_unique", "_unique2", "unique_consecutive",
                 "unique_dim"}


def _forbidden(func, args, kwargs, device: torch.device) -> str | None:
    """Why `func(*args, **kwargs)` cannot be part of a graph, or None when it can."""
    name = func.overloadpacket.__name__
    if name in _HOST_READS:
        return (f"{name} reads a value back to the host (.item(), int(), float(), bool(), torch.equal): "
                "a graph has no host code to hand it to, so nothing may depend on it")
    if name in _VALUE_SHAPES:
        return f"{name} returns a shape that depends on the values: a graph's shapes are fixed at capture"
    if name in ("index", "index_put", "index_put_", "_index_put_impl_"):
        indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
        if any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in indices or ()):
            return "indexing with a boolean mask finds its True entries (nonzero): a value-dependent shape"
    if name == "repeat_interleave" and any(isinstance(a, torch.Tensor) for a in args[1:2]) \
            and kwargs.get("output_size") is None:
        return "repeat_interleave with tensor repeats has a value-dependent shape (pass output_size)"
    if name == "lift_fresh" and args and isinstance(args[0], torch.Tensor) and args[0].dim() > 0:
        return ("torch.tensor(...) builds a tensor from Python data: a graph replays device work only; keep "
                "such data in a static buffer and copy into it before replay()")
    if device.type == "cuda" and name in ("_to_copy", "copy_") and args:
        src, dst = (args[1], args[0]) if name == "copy_" else (args[0], None)
        to_host = (dst is not None and dst.device.type == "cpu") or \
            (dst is None and kwargs.get("device") is not None and torch.device(kwargs["device"]).type == "cpu")
        if isinstance(src, torch.Tensor) and src.device.type == "cpu" and src.dim() > 0:
            return "copies host memory to the GPU: a graph replays device work only"
        if isinstance(src, torch.Tensor) and src.device.type == "cuda" and to_host:
            return "copies GPU memory to the host (.cpu(), .tolist(), .numpy()): nothing may read values during a graph"
    return None


class _Recorder(TorchDispatchMode):
    """Sees every aten op of a call. Raises GraphCaptureError on what a graph cannot hold; when
    `record`, keeps the ops that do work (in place, or into a fresh output) with their tensors."""

    def __init__(self, device: torch.device, record: bool):
        super().__init__()
        self.device, self.record = device, record
        self.ops: list[tuple] = []            # (func, args, kwargs, outputs to write into, or None: in place)
        self.made: set[int] = set()           # storages created during the call

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        why = _forbidden(func, args, kwargs, self.device)
        if why is not None:
            raise GraphCaptureError(f"cannot capture {func}: {why}")
        out = func(*args, **kwargs)
        if not self.record:
            return out
        wrote = op_writes(func, args, kwargs, out)
        if wrote == "in place":
            self.ops.append((func, args, kwargs, None))                        # run it again
        elif wrote == "new":                                                   # (a view costs nothing: it stays valid)
            outs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
            self.ops.append((func, args, kwargs, outs))
            self.made |= storages(outs)
        return out


class StepGraph:
    """One step captured once and replayed: `out = g.capture(fn)` then, after copying new inputs into
    the buffers `fn` reads, `g.replay()` updates `out` in place. CUDA graph on a GPU, stand-in on a CPU."""

    def __init__(self, device: str | torch.device, *, pool=None, warmup: int = 1):
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.pool, self.warmup = pool, warmup
        self.outputs = None
        self._graph = None                   # torch.cuda.CUDAGraph
        self._ops: list[tuple] | None = None  # the stand-in's recorded ops
        self._inputs: list[tuple] = []       # the stand-in's external tensors and their layout at capture

    @property
    def captured(self) -> bool:
        return self.outputs is not None

    @property
    def n_ops(self) -> int | None:
        """How many ops the stand-in replays (None on CUDA: the graph holds kernels, not ops)."""
        return None if self._ops is None else len(self._ops)

    def capture(self, fn: Callable[[], object]):
        """Run `fn` on its static inputs and keep its work; return its outputs (static tensors)."""
        if self.captured:
            raise RuntimeError("this StepGraph is already captured: make a new one for another shape")
        if not callable(fn):
            raise TypeError(f"fn must be a function of no arguments, got {type(fn).__name__}")
        with torch.inference_mode(False), torch.no_grad():
            if self.device.type == "cuda":
                self.outputs = self._capture_cuda(fn)
            else:
                self.outputs = self._capture_standin(fn)
        return self.outputs

    def _capture_cuda(self, fn):
        with _Recorder(self.device, record=False):      # check first: a failed capture is hard to undo
            fn()
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):                 # warm up on a side stream (lazy inits, workspaces)
            for _ in range(self.warmup):
                fn()
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        gc.collect()            # an old graph that Python's garbage collector frees mid-capture would end this capture
        was_enabled = gc.isenabled()
        gc.disable()
        try:
            with torch.cuda.graph(graph, pool=self.pool):
                out = fn()
        finally:
            if was_enabled:
                gc.enable()
        self._graph, self.pool = graph, graph.pool()
        return out

    def _capture_standin(self, fn):
        rec = _Recorder(self.device, record=True)
        with rec:                               # (.tolist() and .numpy() of a CPU tensor read memory without an op:
            out = fn()                          # the stand-in cannot see them; a GPU graph refuses them)
        seen: dict[int, torch.Tensor] = {}
        for _, args, kwargs, _ in rec.ops:
            for t in tree_flatten((args, kwargs))[0]:
                if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in rec.made:
                    seen[id(t)] = t
        self._inputs = [(t, t.data_ptr(), tuple(t.shape), t.stride()) for t in seen.values()]
        self._ops = rec.ops
        return out

    def replay(self) -> None:
        """Rerun the captured work on the captured buffers; the outputs of `capture` now hold the new results."""
        if not self.captured:
            raise RuntimeError("replay() before capture(): capture the step first")
        if self._graph is not None:
            self._graph.replay()
            return
        for t, ptr, shape, stride in self._inputs:
            if t.data_ptr() != ptr or tuple(t.shape) != shape or t.stride() != stride:
                raise RuntimeError(f"a tensor the graph reads changed since capture (shape {shape} -> {tuple(t.shape)} "
                                   "or new memory): a graph keeps the shapes and addresses it captured; copy new "
                                   "values into the static buffers instead of resizing or replacing them")
        with torch.inference_mode(False), torch.no_grad():
            for func, args, kwargs, outs in self._ops:
                result = func(*args, **kwargs)
                if outs is None:
                    continue
                if type(result) is torch.Tensor:
                    outs[0].copy_(result)
                else:
                    for dst, src in zip(outs, (t for t in tree_flatten(result)[0] if isinstance(t, torch.Tensor))):
                        dst.copy_(src)


# --- the engine's decode step, written so that it can be captured -----------------------------------

def _slot_decode(model: Decoder, cache: SlotKVCache, ids, pos, slots, src) -> torch.Tensor:
    """forward_cached for T new tokens per row (T = 1 for decode, more to verify drafted tokens) with
    static shapes: attends over all max_len positions of each row's slot (masked), reads the write
    positions from cache.lengths on the device. Row b writes row src[b]'s keys (pads repeat row 0:
    the same values into the same places)."""
    cfg = model.cfg
    (B, T), L = ids.shape, cache.max_len
    start = cache.lengths[slots].clamp(max=L - T)                         # (B,): slot position of the first new token
    at = start[:, None] + torch.arange(T, device=ids.device)              # (B, T): slot positions of the new tokens
    cache.valid.index_put_((slots[:, None].expand(B, T), at), torch.ones_like(at, dtype=torch.bool))
    j = torch.arange(L, device=ids.device)
    seen = (j <= at[..., None]) & cache.valid[slots][:, None, :]          # (B, T, L)
    x, rope = embed(model, ids, pos)                                      # (B, T, C)
    bias = mask_bias(seen, cfg.group_size, x.dtype)                       # (B, 1, G*T, L)
    for i, block in enumerate(model.blocks):
        q, k, v = project_qkv(model, block, x, rope)                      # (B, H, T, D), (B, Hkv, T, D) x 2
        cache.k[i][slots[:, None], :, at] = k.transpose(1, 2)[src].to(cache.k.dtype)   # (B, T, Hkv, D)
        cache.v[i][slots[:, None], :, at] = v.transpose(1, 2)[src].to(cache.v.dtype)
        keys = cache.k[i][slots].to(q.dtype)                              # (B, Hkv, L, D)
        values = cache.v[i][slots].to(q.dtype)
        x = x + block.attn.o_proj(attend(q, keys, values, bias))          # (B, T, C)
        x = x + mlp(block, x)
    cache.lengths[slots] = start + T
    return model.lm_head(model.norm(x))                                   # (B, T, V)


def write_kv_static(k_cache, v_cache, k, v, slot_mapping) -> None:
    """write_kv without a boolean mask (a graph cannot hold one): every slot must be >= 0."""
    n_blocks, block_size, Hkv, D = k_cache.shape
    slots = slot_mapping.long()
    k_cache.view(n_blocks * block_size, Hkv, D).index_copy_(0, slots, k.to(k_cache.dtype))
    v_cache.view(n_blocks * block_size, Hkv, D).index_copy_(0, slots, v.to(v_cache.dtype))


def _paged_decode(model: Decoder, cache: PagedKVCache, ids, pos, slot_mapping, block_tables, context_lens, src,
                  write_kv: Callable, attention: Callable) -> torch.Tensor:
    """forward_paged's decode call (one token per row), every row's keys taken from row src[b]."""
    cfg = model.cfg
    B, H, D = ids.shape[0], cfg.n_head, cfg.head_dim
    scale = 1.0 / math.sqrt(D)
    x, rope = embed(model, ids, pos)                                      # (B, 1, C)
    for i, block in enumerate(model.blocks):
        q, k, v = project_qkv(model, block, x, rope)                      # (B, H, 1, D), (B, Hkv, 1, D) x 2
        k_cache, v_cache = cache.layer(i)
        write_kv(k_cache, v_cache, k[:, :, 0][src].to(k_cache.dtype), v[:, :, 0][src].to(v_cache.dtype), slot_mapping)
        y = attention(q[:, :, 0].contiguous(), k_cache, v_cache, block_tables, context_lens, scale)  # (B, H, D)
        x = x + block.attn.o_proj(y.to(q.dtype).reshape(B, 1, H * D))
        x = x + mlp(block, x)
    return model.lm_head(model.norm(x))                                   # (B, 1, V)


# --- one graph per batch bucket ---------------------------------------------------------------------

class _BucketGraphs:
    """Static buffers at the largest bucket, one StepGraph per bucket (largest captured first, one
    pool), the graph of the smallest bucket that holds a batch, and an eager path for the rest."""

    def __init__(self, model: Decoder, max_batch: int, buckets: list[int] | None):
        if not isinstance(model, Decoder):
            raise TypeError(f"model must be a course Decoder, got {type(model).__name__}")
        self.model, self.device = model, model.device
        self.buckets = sorted(set(buckets)) if buckets is not None else batch_buckets(max_batch)
        if not self.buckets or any(type(b) is not int or b < 1 for b in self.buckets):
            raise ValueError(f"buckets must be positive ints, got {buckets!r}")
        self.max_batch = self.buckets[-1]
        self.graphs: dict[int, StepGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.off: str | None = None           # why graphs are off (the step could not be captured)
        self.replays = self.eager_calls = 0
        self.src = torch.arange(self.max_batch, device=self.device)
        self._arange = torch.arange(self.max_batch, device=self.device)

    def _capture_all(self, step_for: Callable[[int], Callable]) -> None:
        pool = None
        with torch.no_grad():
            stack_model(self.model)           # one-off copies stay out of the graphs
        try:
            for bs in reversed(self.buckets):
                g = StepGraph(self.device, pool=pool)
                self.outputs[bs] = g.capture(step_for(bs))
                self.graphs[bs], pool = g, g.pool
        except Exception as e:  # noqa: BLE001 - any failure to capture leaves the eager path, with the reason
            self.graphs.clear()
            self.outputs.clear()
            self.off = f"{type(e).__name__}: {e}"

    def bucket(self, B: int) -> int | None:
        """The captured batch size a batch of B runs in, or None (eager)."""
        if self.off is not None:
            return None
        return next((b for b in self.buckets if b >= B), None)

    def _pad(self, B: int, bs: int, buffers: list[torch.Tensor]) -> None:
        """Rows B..bs-1 repeat row 0 (same inputs, same slot); src sends every pad row to row 0's keys."""
        self.src[:B].copy_(self._arange[:B])
        if bs > B:
            self.src[B:bs].zero_()
            for buf in buffers:
                buf[B:bs] = buf[0]

    def describe(self) -> str:
        if self.off is not None:
            return f"eager (the decode step could not be captured: {self.off})"
        kind = "CUDA graphs" if self.device.type == "cuda" else "graph stand-in (CPU)"
        return f"{kind} for batch sizes {self.buckets}: {self.replays} replays, {self.eager_calls} eager calls"

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.describe()})"


class SlotDecodeGraphs(_BucketGraphs):
    """forward_cached for decode calls (B, 1) on one SlotKVCache, replayed from graphs; a drop-in:
    `g(model, input_ids, position_ids, cache, slots)`. The logits it returns are the static output:
    read them before the next call. `n_tokens` > 1 captures calls of that many new tokens per row
    instead (a speculative verify pass: the drafted tokens and one more)."""

    def __init__(self, model: Decoder, cache: SlotKVCache, max_batch: int | None = None, *,
                 buckets: list[int] | None = None, n_tokens: int = 1):
        if not isinstance(cache, SlotKVCache):
            raise TypeError(f"cache must be a SlotKVCache, got {type(cache).__name__}")
        super().__init__(model, max_batch or cache.n_slots, buckets)
        if self.max_batch > cache.n_slots:
            raise ValueError(f"max_batch {self.max_batch} exceeds the cache's {cache.n_slots} slots")
        if cache.device != self.device:
            raise ValueError(f"cache ({cache.device}) and model ({self.device}) must be on the same device")
        if type(n_tokens) is not int or not 1 <= n_tokens <= cache.max_len:
            raise ValueError(f"n_tokens must be an int in 1..{cache.max_len} (new tokens per row), got {n_tokens!r}")
        self.cache, self.n_tokens = cache, n_tokens
        dev, n = self.device, self.max_batch
        self.ids = torch.zeros(n, n_tokens, dtype=torch.long, device=dev)    # static inputs
        self.pos = torch.zeros(n, n_tokens, dtype=torch.long, device=dev)
        self.slots = torch.zeros(n, dtype=torch.long, device=dev)
        saved = cache.lengths.clone(), cache.valid.clone(), cache.k[:, 0].clone(), cache.v[:, 0].clone()
        try:                                                             # capture writes into slot 0: undo it
            self._capture_all(lambda bs: lambda: _slot_decode(model, cache, self.ids[:bs], self.pos[:bs],
                                                              self.slots[:bs], self.src[:bs]))
        finally:
            cache.lengths.copy_(saved[0]); cache.valid.copy_(saved[1])
            cache.k[:, 0] = saved[2]; cache.v[:, 0] = saved[3]

    def __call__(self, model: Decoder, input_ids: torch.Tensor, position_ids: torch.Tensor, cache: SlotKVCache,
                 slots: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        B = input_ids.shape[0] if isinstance(input_ids, torch.Tensor) and input_ids.dim() == 2 else 0
        bs = self.bucket(B) if B else None
        if (bs is None or model is not self.model or cache is not self.cache or attention_mask is not None
                or input_ids.shape[1] != self.n_tokens or position_ids.shape != input_ids.shape
                or not isinstance(slots, torch.Tensor) or slots.shape != (B,)):
            self.eager_calls += 1
            return forward_cached_eager(model, input_ids, position_ids, cache, slots, attention_mask)
        self._check(slots)
        return self.replay(input_ids, position_ids, slots)

    def _check(self, slots: torch.Tensor) -> None:
        rows = slots.tolist()
        if len(set(rows)) != len(rows) or not all(0 <= s < self.cache.n_slots for s in rows):
            raise ValueError(f"slots must be distinct slots of the cache (0..{self.cache.n_slots - 1}), got {rows}")
        full = int(self.cache.lengths[slots.to(self.device, torch.long)].max()) + self.n_tokens
        if full > self.cache.max_len:
            raise ValueError(f"a slot would hold {full} tokens, max_len is {self.cache.max_len}")

    def replay(self, input_ids: torch.Tensor, position_ids: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """Copy one batch (B <= max_batch rows of n_tokens, checked by the caller) into the static buffers, pad, replay."""
        B = input_ids.shape[0]
        bs = self.bucket(B)
        self.ids[:B].copy_(input_ids)
        self.pos[:B].copy_(position_ids)
        self.slots[:B].copy_(slots)
        self._pad(B, bs, [self.ids, self.pos, self.slots])
        self.graphs[bs].replay()
        self.replays += 1
        return self.outputs[bs][:B]                                      # (B, T, V): overwritten by the next replay


class PagedDecodeGraphs(_BucketGraphs):
    """forward_paged's decode call (B, 1) on one PagedKVCache, replayed from graphs; a drop-in:
    `g(model, input_ids, position_ids, cache, slot_mapping, block_tables, context_lens, write_kv=, attention=)`.
    Block tables up to `max_blocks` wide. The course's write_kv (a boolean mask skips padding slots)
    is replaced in the graph by `write_kv_static` (pads repeat a real slot instead)."""

    def __init__(self, model: Decoder, cache: PagedKVCache, max_batch: int, max_blocks: int, *,
                 write_kv: Callable = paged_ops.write_kv, attention: Callable = paged_ops.paged_attention,
                 buckets: list[int] | None = None):
        if not isinstance(cache, PagedKVCache):
            raise TypeError(f"cache must be a PagedKVCache, got {type(cache).__name__}")
        if type(max_blocks) is not int or not 1 <= max_blocks <= cache.n_blocks:
            raise ValueError(f"max_blocks must be an int in 1..{cache.n_blocks} (blocks per sequence), got {max_blocks!r}")
        super().__init__(model, max_batch, buckets)
        if cache.device != self.device:
            raise ValueError(f"cache ({cache.device}) and model ({self.device}) must be on the same device")
        self.cache, self.max_blocks = cache, max_blocks
        self.write_kv, self.attention = write_kv, attention
        graph_write = write_kv_static if write_kv is paged_ops.write_kv else write_kv
        dev, n = self.device, self.max_batch
        self.ids = torch.zeros(n, 1, dtype=torch.long, device=dev)       # static inputs
        self.pos = torch.zeros(n, 1, dtype=torch.long, device=dev)
        self.slot_mapping = torch.zeros(n, dtype=torch.long, device=dev)
        self.block_tables = torch.zeros(n, max_blocks, dtype=torch.int32, device=dev)
        self.context_lens = torch.ones(n, dtype=torch.int32, device=dev)
        saved = cache.k[:, 0, 0].clone(), cache.v[:, 0, 0].clone()
        try:                                                             # capture writes slot 0 of block 0: undo it
            self._capture_all(lambda bs: lambda: _paged_decode(
                model, cache, self.ids[:bs], self.pos[:bs], self.slot_mapping[:bs], self.block_tables[:bs],
                self.context_lens[:bs], self.src[:bs], graph_write, attention))
        finally:
            cache.k[:, 0, 0] = saved[0]; cache.v[:, 0, 0] = saved[1]

    def __call__(self, model: Decoder, input_ids: torch.Tensor, position_ids: torch.Tensor, cache: PagedKVCache,
                 slot_mapping: torch.Tensor, block_tables: torch.Tensor | None, context_lens: torch.Tensor | None, *,
                 write_kv: Callable, attention: Callable) -> torch.Tensor:
        B = input_ids.shape[0] if isinstance(input_ids, torch.Tensor) and input_ids.dim() == 2 else 0
        bs = self.bucket(B) if B else None
        if (bs is None or model is not self.model or cache is not self.cache or block_tables is None
                or context_lens is None or write_kv is not self.write_kv or attention is not self.attention
                or input_ids.shape[1] != 1 or position_ids.shape != input_ids.shape
                or slot_mapping.shape != (B,) or block_tables.dim() != 2 or block_tables.shape[0] != B
                or block_tables.shape[1] > self.max_blocks or context_lens.shape != (B,)):
            self.eager_calls += 1
            return forward_paged_eager(model, input_ids, position_ids, cache, slot_mapping, block_tables, context_lens,
                                       write_kv=write_kv, attention=attention)
        return self.replay(input_ids, position_ids, slot_mapping, block_tables, context_lens)

    def replay(self, input_ids, position_ids, slot_mapping, block_tables, context_lens) -> torch.Tensor:
        """Copy one decode batch into the static buffers (tables padded with block 0), pad rows, replay."""
        B, w = block_tables.shape
        bs = self.bucket(B)
        self.ids[:B].copy_(input_ids)
        self.pos[:B].copy_(position_ids)
        self.slot_mapping[:B].copy_(slot_mapping)
        self.block_tables[:B, :w].copy_(block_tables)
        if w < self.max_blocks:
            self.block_tables[:B, w:].zero_()
        self.context_lens[:B].copy_(context_lens)
        self._pad(B, bs, [self.ids, self.pos, self.slot_mapping, self.block_tables, self.context_lens])
        self.graphs[bs].replay()
        self.replays += 1
        return self.outputs[bs][:B]                                      # (B, 1, V): overwritten by the next replay


def capture_decode_graphs(model: Decoder, cache: SlotKVCache | PagedKVCache, max_batch: int | None = None, *,
                          max_blocks: int | None = None, write_kv: Callable = paged_ops.write_kv,
                          attention: Callable = paged_ops.paged_attention,
                          buckets: list[int] | None = None) -> SlotDecodeGraphs | PagedDecodeGraphs:
    """Capture `model`'s decode step over `cache` for each batch bucket and attach the graphs to the
    cache (`cache.graphs`): from then on `forward_cached` / `forward_paged` replay them for every
    decode call on this cache (with this model, and for the paged cache these write_kv/attention).
    Capture before the cache holds sequences you care about in slot 0 / block 0 (it restores them)."""
    if isinstance(cache, SlotKVCache):
        g = SlotDecodeGraphs(model, cache, max_batch, buckets=buckets)
    elif isinstance(cache, PagedKVCache):
        if max_batch is None or max_blocks is None:
            raise ValueError("a PagedKVCache needs max_batch (sequences per step) and max_blocks (blocks per sequence)")
        g = PagedDecodeGraphs(model, cache, max_batch, max_blocks, write_kv=write_kv, attention=attention,
                              buckets=buckets)
    else:
        raise TypeError(f"cache must be a SlotKVCache or a PagedKVCache, got {type(cache).__name__}")
    cache.graphs = g
    return g


class GreedyEngine:
    """Greedy decoding of one prompt at a time, the way an engine runs it: a preallocated slot cache of
    `max_len` tokens, one eager prefill, then decode steps replayed from a graph (`graphs`: default on
    a GPU) or run eagerly. Capture happens once, here; every call reuses it. The token stays on the
    device between steps (no host read per step unless `eos_token_id` is given).

        engine = GreedyEngine(model, max_len=512)
        out = engine(prompt_ids, 64)          # (1, T + 64), like lab 01's greedy loop
    """

    def __init__(self, model: Decoder, max_len: int, *, graphs: bool | None = None):
        if not isinstance(model, Decoder):
            raise TypeError(f"model must be a course Decoder, got {type(model).__name__}")
        if type(max_len) is not int or max_len < 2:
            raise ValueError(f"max_len must be an int >= 2 (prompt + new tokens), got {max_len!r}")
        if graphs is not None and not isinstance(graphs, bool):
            raise TypeError(f"graphs must be True, False or None (None: on a GPU), got {graphs!r}")
        self.model, self.max_len = model, max_len
        dev = model.device
        self.cache = SlotKVCache(model.cfg, n_slots=1, max_len=max_len, dtype=model.dtype, device=dev)
        self.slot = torch.zeros(1, dtype=torch.long, device=dev)
        self.graphs = SlotDecodeGraphs(model, self.cache, 1) if (dev.type == "cuda" if graphs is None else graphs) else None

    def describe(self) -> str:
        return "eager" if self.graphs is None else self.graphs.describe()

    @torch.no_grad()
    def __call__(self, input_ids: torch.Tensor, max_new_tokens: int, eos_token_id: int | None = None) -> torch.Tensor:
        if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.shape[0] != 1 \
                or input_ids.shape[1] < 1:
            got = tuple(input_ids.shape) if isinstance(input_ids, torch.Tensor) else type(input_ids).__name__
            raise ValueError(f"input_ids must be a (1, T) tensor with T >= 1, got {got}")
        T = input_ids.shape[1]
        if type(max_new_tokens) is not int or max_new_tokens < 0 or T + max_new_tokens > self.max_len:
            raise ValueError(f"max_new_tokens must be an int >= 0 with prompt + new tokens <= max_len "
                             f"({T} + {max_new_tokens} > {self.max_len}?)")
        if max_new_tokens == 0:
            return input_ids
        model, dev = self.model, self.model.device
        self.cache.reset(0)
        logits = forward_cached_eager(model, input_ids.to(dev), torch.arange(T, device=dev)[None], self.cache, self.slot)
        out = torch.empty(1, max_new_tokens, dtype=torch.long, device=dev)
        out[:, 0] = logits[:, -1].argmax(-1)
        pos = torch.full((1, 1), T, dtype=torch.long, device=dev)
        n = 1
        while n < max_new_tokens and not (eos_token_id is not None and int(out[0, n - 1]) == eos_token_id):
            if self.graphs is not None and self.graphs.off is None:
                logits = self.graphs.replay(out[:, n - 1:n], pos, self.slot)
            else:
                logits = forward_cached_eager(model, out[:, n - 1:n], pos, self.cache, self.slot)
            out[:, n] = logits[:, -1].argmax(-1)
            pos += 1
            n += 1
        return torch.cat([input_ids.to(dev), out[:, :n]], dim=1)


def greedy_generate(model: Decoder, input_ids: torch.Tensor, max_new_tokens: int, *, graphs: bool | None = None,
                    eos_token_id: int | None = None) -> torch.Tensor:
    """One call of a fresh GreedyEngine sized for this prompt: (1, T + n) tokens."""
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2:
        raise ValueError(f"input_ids must be a (1, T) tensor, got {type(input_ids).__name__}")
    engine = GreedyEngine(model, max(2, input_ids.shape[1] + max(0, max_new_tokens)), graphs=graphs)
    return engine(input_ids, max_new_tokens, eos_token_id)
