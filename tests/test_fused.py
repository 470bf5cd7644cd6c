"""course.engine.fused: q/k/v and gate/up as one matmul each, without a second copy of the weights.

The stack must give what the modules give, share their memory, follow every later change of a
weight (in place, replaced, cast), and step aside for what it cannot stand in for (a hook, a
subclass, training). The engine's captured decode step must then hold one matmul for q, k and v,
one for gate and up, and no per-layer mask conversion or K/V repeat.
"""
import collections
import contextlib
import gc

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from course.engine import PagedKVCache, SlotKVCache, block_table_tensor, forward_extend, forward_paged, paged_ops
from course.engine.fused import stack_model, stacked
from course.engine.graphs import SlotDecodeGraphs, StepGraph, write_kv_static
from course.engine.paged_engine import Request, paged_generate
from course.engine.runner import mlp, project_qkv
from course.models import Decoder, init_weights
from course.tolerance import assert_orders_close
from tiny_models import tiny_configs

CONFIGS = tiny_configs(vocab_size=64, max_seq_len=64)


def fresh(name="llama-gqa"):
    return init_weights(Decoder(CONFIGS[name]), std=0.3, seed=5).eval()


@pytest.mark.parametrize("name", list(CONFIGS))
def test_stack_gives_each_modules_output_and_shares_their_memory(name):
    m = fresh(name)
    a = m.blocks[0].attn
    h = torch.randn(2, 3, m.cfg.d_model)
    with torch.no_grad():
        want = torch.cat([a.q_proj(h), a.k_proj(h), a.v_proj(h)], dim=-1)
        weight, bias = stacked((a.q_proj, a.k_proj, a.v_proj))
        # one matmul of 64 output columns vs three narrower ones: other kernels, the d_model sums in another order
        assert_orders_close(F.linear(h, weight, bias), want, terms=m.cfg.d_model)
        # the modules' own matmuls, their weights now views into the stack (alignment may pick another kernel)
        assert_orders_close(torch.cat([a.q_proj(h), a.k_proj(h), a.v_proj(h)], dim=-1), want, terms=m.cfg.d_model)
    rows = a.q_proj.weight.shape[0]
    assert a.q_proj.weight.data_ptr() == weight.data_ptr(), "q_proj's weight is the stack's first rows"
    assert a.k_proj.weight.data_ptr() == weight[rows:].data_ptr(), "k_proj's weight follows it, no copy"
    assert (bias is None) == (name == "llama-gqa")
    with torch.no_grad():
        assert stacked((a.q_proj, a.k_proj, a.v_proj))[0] is weight, "stacked once, then reused"
    assert isinstance(a.q_proj.weight, nn.Parameter) and set(dict(m.named_parameters())) == \
        set(dict(fresh(name).named_parameters())), "the model keeps its parameters and their names"


def test_stack_follows_changes_of_the_weights():
    m = fresh()
    a = m.blocks[1].attn
    mods = (a.q_proj, a.k_proj, a.v_proj)
    h = torch.randn(1, 2, m.cfg.d_model)
    with torch.no_grad():
        stacked(mods)
        a.k_proj.weight.mul_(2.0)                                     # in place (a load, an optimizer step)
        assert_orders_close(F.linear(h, *stacked(mods))[..., 32:48], a.k_proj(h), terms=m.cfg.d_model)
        a.v_proj.weight = nn.Parameter(torch.randn_like(a.v_proj.weight))   # replaced: stacked again
        assert_orders_close(F.linear(h, *stacked(mods))[..., 48:], a.v_proj(h), terms=m.cfg.d_model)
        m.double()                                                    # cast: every weight is new memory
        weight, _ = stacked(mods)
        assert weight.dtype == torch.float64
        assert_orders_close(F.linear(h.double(), weight)[..., :32], a.q_proj(h.double()), terms=m.cfg.d_model)


def test_what_cannot_be_stacked_runs_module_by_module():
    m = fresh()
    block = m.blocks[0]
    a = block.attn
    calls = []
    handle = a.k_proj.register_forward_hook(lambda mod, args, out: calls.append(out.shape))
    x = torch.randn(1, 4, m.cfg.d_model)
    with torch.no_grad():
        assert stacked((a.q_proj, a.k_proj, a.v_proj)) is None, "a hook must still run"
        project_qkv(m, block, x, None)
    assert calls == [(1, 4, 16)]
    handle.remove()
    passes = []
    handle = block.mlp.register_forward_hook(lambda *args: passes.append(1))
    with torch.no_grad():
        mlp(block, x)
    assert passes == [1], "a hook on the MLP (lab 08 counts passes with one) must still run"
    handle.remove()

    class Scaled(nn.Linear):                                          # a subclass may compute anything
        def forward(self, x):
            return 2 * super().forward(x)

    up = Scaled(m.cfg.d_model, m.cfg.d_ff, bias=False)
    up.weight = block.mlp.up_proj.weight
    block.mlp.up_proj = up
    with torch.no_grad():
        assert stacked((block.mlp.gate_proj, block.mlp.up_proj)) is None
        g = block.mlp.gate_proj(block.mlp_norm(x))
        want = x + block.mlp.down_proj(F.silu(g) * up(block.mlp_norm(x)))
        assert_orders_close(x + mlp(block, x), want, terms=m.cfg.d_ff, stages=2)   # gate/up, then down
    a.k_proj.double()
    with torch.no_grad():
        assert stacked((a.q_proj, a.k_proj, a.v_proj)) is None, "mixed dtypes"

    # training: gradients must reach each module's own weight, so nothing is stacked
    m2 = fresh()
    q, k, v = project_qkv(m2, m2.blocks[0], torch.randn(1, 3, m2.cfg.d_model), None)
    (q.sum() + k.sum() + v.sum()).backward()
    assert all(p.grad is not None for p in (m2.blocks[0].attn.q_proj.weight, m2.blocks[0].attn.k_proj.weight,
                                            m2.blocks[0].attn.v_proj.weight))


def test_the_captured_decode_step_counts_few_ops():
    m = fresh()
    cache = SlotKVCache(m.cfg, n_slots=2, max_len=24)
    g = SlotDecodeGraphs(m, cache, 2)
    ops = collections.Counter(op[0].overloadpacket.__name__ for op in g.graphs[2]._ops)
    n = m.cfg.n_layer
    assert ops["mm"] == 4 * n + 1, f"q/k/v one matmul, o, gate/up one, down, per layer, and lm_head; got {ops['mm']}"
    assert ops["cat"] == n + 1, "one rotation of q and k together per layer (and the RoPE table's cat)"
    assert ops["where"] == 0 and ops["clone"] == 0, "no per-layer mask conversion, no K/V repeated for GQA"
    assert ops["masked_fill_"] == 1, "the mask is built once per step"


def test_stack_model_stacks_every_layer_before_a_capture():
    m = fresh()
    with torch.no_grad():
        stack_model(m)
        stacks = [(stacked((b.attn.q_proj, b.attn.k_proj, b.attn.v_proj))[0], stacked((b.mlp.gate_proj, b.mlp.up_proj))[0])
                  for b in m.blocks]
    for block, (qkv, gate_up) in zip(m.blocks, stacks):
        assert block.attn.v_proj.weight.data_ptr() == qkv[-block.attn.v_proj.weight.shape[0]:].data_ptr()
        assert block.mlp.up_proj.weight.data_ptr() == gate_up[m.cfg.d_ff:].data_ptr()
    assert stacked((m.blocks[0].attn.q_proj, m.blocks[0].attn.k_proj, m.blocks[0].attn.v_proj)) is None, \
        "with gradients on, nothing is stacked: they must reach each module's weight"


def test_write_kv_is_handed_contiguous_rows():
    """A Triton store (lab 06's store_kv) reads k and v as rows laid end to end, and refuses anything
    else. With q, k and v from one stacked matmul, k and v are views with gaps between their rows:
    every engine path must hand write_kv contiguous tensors (found on an H100, where lab 06 runs the
    paged engine on the student's kernels)."""
    m = fresh()
    handed = []

    def checking(store):
        """`store`, recording first whether it was handed contiguous k and v."""
        def write_kv(k_cache, v_cache, k, v, slot_mapping):
            handed.append((k.is_contiguous(), v.is_contiguous()))
            store(k_cache, v_cache, k, v, slot_mapping)
        return write_kv

    strict, cache, attn = checking(paged_ops.write_kv), PagedKVCache(m.cfg, 8, 4), paged_ops.paged_attention
    with torch.no_grad():
        forward_paged(m, torch.tensor([[3, 5, 7, 9, 11]]), torch.arange(5)[None], cache, torch.arange(5), None, None,
                      write_kv=strict, attention=attn)                                           # prefill
        forward_paged(m, torch.tensor([[4], [6]]), torch.tensor([[5], [5]]), cache, torch.tensor([5, 6]),
                      block_table_tensor([[0, 1], [0, 1]]), torch.tensor([6, 7], dtype=torch.int32),
                      write_kv=strict, attention=attn)                                           # decode, 2 rows
        forward_extend(m, cache, torch.tensor([1, 2, 3]), torch.tensor([7, 8, 9]), torch.tensor([8, 9, 10]), [3],
                       block_table_tensor([[0, 1, 2]]), torch.tensor([10], dtype=torch.int32), write_kv=strict)
    assert len(handed) == 3 * m.cfg.n_layer and all(k and v for k, v in handed), \
        f"(k, v) contiguous, per write_kv call: {handed}"
    # the captured decode step (lab 06 runs the student's kernels inside the engine's graphs), here in the
    # stand-in; write_kv_static, as a Triton store, takes no boolean mask, so the step can be captured
    handed.clear()
    run = paged_generate(m, [Request(0, [1, 2, 3], 3), Request(1, [4, 5], 3)], 2, 8, 4,
                         write_kv=checking(write_kv_static), graphs=True)
    assert "replays" in run.graphs and handed and all(k and v for k, v in handed), \
        f"captured decode: (k, v) contiguous, per write_kv call: {handed} ({run.graphs})"


def test_a_cuda_capture_holds_the_garbage_collector_off(monkeypatch):
    """An old CUDA graph that lives in a reference cycle (a cache and its graphs) is freed whenever
    Python's collector runs; if that falls inside a capture, freeing it ends the capture (seen on an
    H100: lab 04's fourth capture failed and left CUDA's random generator unusable). StepGraph
    collects first and keeps the collector off until the capture ends, even when it fails.
    The CUDA calls are stand-ins here; what is checked is the collector's state around them."""
    seen = []

    class Stream:
        def wait_stream(self, other):
            pass

    class Graph:
        def pool(self):
            return "pool"

    @contextlib.contextmanager
    def capturing(graph, pool=None):
        seen.append(gc.isenabled())
        yield

    monkeypatch.setattr(torch.cuda, "Stream", lambda device=None: Stream())
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: Stream())
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "CUDAGraph", Graph)
    monkeypatch.setattr(torch.cuda, "graph", capturing)
    x = torch.ones(3)
    assert gc.isenabled()
    out = StepGraph("cpu")._capture_cuda(lambda: x * 2)
    assert seen == [False] and gc.isenabled(), "the collector is off during the capture, and on again after it"
    torch.testing.assert_close(out, x * 2)

    def fails():
        if not gc.isenabled():
            raise RuntimeError("an op the graph cannot hold")
        return x

    with pytest.raises(RuntimeError, match="cannot hold"):
        StepGraph("cpu")._capture_cuda(fails)
    assert gc.isenabled(), "a failed capture turns the collector back on"
    gc.disable()
    try:
        StepGraph("cpu")._capture_cuda(lambda: x * 2)
        assert not gc.isenabled(), "a collector that was off stays off"
    finally:
        gc.enable()
