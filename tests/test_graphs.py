"""course.engine.graphs on a CPU: the stand-in keeps CUDA-graph semantics, and the engine's graph
decode path gives eager's tokens.

The stand-in must fail the way a CUDA graph fails: a new tensor handed to Python code is not seen
(inputs must be copied into the static buffers), an output is overwritten by the next replay, a
static buffer resized after capture is an error, and a host read or a value-dependent shape inside
the captured function cannot be captured. The engines (slot cache, paged cache) must give the
tokens of their eager runs: batches padded to a bucket, batches beyond the largest bucket (eager),
preemption and recompute, both model families.
"""
import pytest
import torch

from course.engine import (GraphCaptureError, PagedKVCache, SlotKVCache, StepGraph, batch_buckets, block_table_tensor,
                           capture_decode_graphs, forward_cached, forward_paged, paged_attention, write_kv)
from course.engine.graphs import PagedDecodeGraphs, SlotDecodeGraphs, greedy_generate
from course.engine.paged_engine import Request, contiguous_generate, paged_generate
from course.models import Decoder, init_weights
from course.tolerance import assert_orders_close, for_decoder
from tiny_models import tiny_configs

CONFIGS = tiny_configs(vocab_size=64, max_seq_len=64)


@pytest.fixture(params=list(CONFIGS), scope="module")
def model(request):
    # large weights: decisive top tokens, so eager and graph runs cannot part on a near-tie
    return init_weights(Decoder(CONFIGS[request.param]), std=0.5, seed=3).eval()


@pytest.fixture(scope="module")
def llama():
    return init_weights(Decoder(CONFIGS["llama-gqa"]), std=0.5, seed=4).eval()


def step_of(m, ids, pos):
    """One forward of the plain decoder (checks included: llama only, GPT-2's check reads a value)."""
    return lambda: m(ids, pos)


# --- the stand-in's semantics ----------------------------------------------------------------------

def test_buckets():
    assert batch_buckets(1) == [1]
    assert batch_buckets(8) == [1, 2, 4, 8]
    assert batch_buckets(12) == [1, 2, 4, 8, 12]
    for bad in (0, -1, 2.0, None):
        with pytest.raises(ValueError, match="max_batch"):
            batch_buckets(bad)


def test_replay_sees_what_is_copied_into_the_static_buffers(llama):
    ids, pos = torch.zeros(3, 1, dtype=torch.long), torch.zeros(3, 1, dtype=torch.long)
    g = StepGraph("cpu")
    out = g.capture(step_of(llama, ids, pos))
    assert g.n_ops > 50 and out.shape == (3, 1, 64)
    new = torch.tensor([[5], [7], [9]])
    ids.copy_(new)
    pos.fill_(2)
    g.replay()
    with torch.no_grad():
        assert torch.equal(out, llama(new, torch.full((3, 1), 2)))


def test_a_new_tensor_is_not_seen_and_outputs_are_overwritten(llama):
    ids, pos = torch.zeros(2, 1, dtype=torch.long), torch.zeros(2, 1, dtype=torch.long)
    static = ids
    g = StepGraph("cpu")
    out = g.capture(step_of(llama, ids, pos))
    before = out.clone()
    ids = torch.tensor([[11], [12]])             # rebinding the name: the graph still reads the old buffer
    g.replay()
    assert torch.equal(out, before), "a new tensor handed to Python code must not reach a replay"
    kept = out                                   # the static output itself, not a copy
    static.copy_(ids)
    g.replay()
    assert kept is out and not torch.equal(kept, before), "the next replay overwrites the outputs in place"
    with torch.no_grad():
        assert torch.equal(kept, llama(ids, pos))


def test_resized_static_input_is_an_error(llama):
    ids, pos = torch.zeros(2, 1, dtype=torch.long), torch.zeros(2, 1, dtype=torch.long)
    g = StepGraph("cpu")
    g.capture(step_of(llama, ids, pos))
    ids.resize_(4, 1)
    with pytest.raises(RuntimeError, match="changed since capture"):
        g.replay()


@pytest.mark.parametrize("body, why", [
    (lambda x: x * int(x.sum()), "host"),
    (lambda x: x * x.sum().item(), "host"),
    (lambda x: x[x > 0], "boolean mask"),
    (lambda x: x.nonzero(), "shape"),
    (lambda x: x + torch.tensor([1.0, 2.0, 3.0]), "Python data"),
])
def test_what_a_graph_cannot_hold(body, why):
    x = torch.arange(3.0)
    with pytest.raises(GraphCaptureError, match=why):
        StepGraph("cpu").capture(lambda: body(x))


def test_capture_and_replay_misuse():
    g = StepGraph("cpu")
    with pytest.raises(RuntimeError, match="before capture"):
        g.replay()
    x = torch.ones(2)
    g.capture(lambda: x * 2)
    with pytest.raises(RuntimeError, match="already captured"):
        g.capture(lambda: x * 3)
    with pytest.raises(TypeError, match="function"):
        StepGraph("cpu").capture(3)


def test_in_place_ops_rerun_on_replay():
    acc, x = torch.zeros(3), torch.ones(3)
    g = StepGraph("cpu")
    g.capture(lambda: acc.add_(x))
    x.fill_(2.0)
    g.replay()
    g.replay()
    assert acc.tolist() == [5.0, 5.0, 5.0], "capture ran once (+1), each replay adds the new x (+2 +2)"


# --- the engine's decode path ----------------------------------------------------------------------

def test_greedy_generate_graphs_equal_eager(model):
    for prompt in ([3, 14, 15, 9], [7]):
        ids = torch.tensor([prompt])
        eager = greedy_generate(model, ids, 20, graphs=False)
        assert torch.equal(greedy_generate(model, ids, 20, graphs=True), eager)
        with torch.no_grad():
            x = ids
            for _ in range(20):
                x = torch.cat([x, model(x, torch.arange(x.shape[1])[None])[:, -1:].argmax(-1)], 1)
        assert torch.equal(eager, x), "the engine's greedy loop equals the uncached loop"
    eos = int(eager[0, 5])
    stopped = greedy_generate(model, torch.tensor([[7]]), 20, graphs=True, eos_token_id=eos)
    assert stopped[0, -1].item() == eos and stopped.shape[1] <= eager.shape[1]


def test_slot_graphs_batches_pads_and_overflow(model):
    """Rows in scattered slots, batches that shrink (pads), and a batch above the largest bucket."""
    prompts = [[1, 2, 3], [4, 5], [6, 7, 8, 9], [10], [11, 12], [13, 14, 15]]
    slots = [3, 0, 5, 1, 2, 4]
    schedule = [6, 6, 5, 3, 3, 2, 1, 1, 1, 1]                  # rows decoding at each step
    runs = []
    for graphs in (False, True):
        cache = SlotKVCache(model.cfg, n_slots=6, max_len=32)
        g = capture_decode_graphs(model, cache, buckets=[1, 2, 4]) if graphs else None
        outs = []
        for s, p in zip(slots, prompts):
            lg = forward_cached(model, torch.tensor([p]), torch.arange(len(p))[None], cache, torch.tensor([s]))
            outs.append([int(lg[0, -1].argmax())])
        for B in schedule:
            ids = torch.tensor([[o[-1]] for o in outs[:B]])
            pos = torch.tensor([[len(p) + len(o) - 1] for p, o in zip(prompts, outs)][:B])
            lg = forward_cached(model, ids, pos, cache, torch.tensor(slots[:B]))
            assert lg.shape == (B, 1, 64)
            for o, t in zip(outs, lg[:, -1].argmax(-1).tolist()):
                o.append(t)
        runs.append(outs)
        if graphs:
            # 5 prefills and 3 batches above the largest bucket run eagerly; the 1-token prompt and 7 decodes replay
            assert g.off is None and g.replays == 8 and g.eager_calls == 8, g.describe()
            assert cache.lengths[slots].tolist() == [len(p) + sum(B > i for B in schedule) for i, p in enumerate(prompts)]
    assert runs[0] == runs[1]


def test_capture_leaves_the_cache_as_it_was(llama):
    cache = SlotKVCache(llama.cfg, n_slots=2, max_len=8)
    forward_cached(llama, torch.tensor([[1, 2, 3]]), torch.arange(3)[None], cache, torch.tensor([0]))
    before = cache.lengths.clone(), cache.valid.clone(), cache.k.clone()
    SlotDecodeGraphs(llama, cache, 2)
    assert torch.equal(cache.lengths, before[0]) and torch.equal(cache.valid, before[1])
    assert torch.equal(cache.k, before[2])
    paged = PagedKVCache(llama.cfg, n_blocks=4, block_size=2)
    paged.k.normal_()
    k = paged.k.clone()
    PagedDecodeGraphs(llama, paged, 2, 2)
    assert torch.equal(paged.k, k)


def test_a_step_that_reads_the_host_runs_eagerly(llama):
    """An attention function with a host read (int()) cannot be captured: the engine says so and
    runs that step eagerly, with the same tokens."""
    def host_reading_attention(q, k_cache, v_cache, block_tables, context_lens, scale):
        int(context_lens.max())
        return paged_attention(q, k_cache, v_cache, block_tables, context_lens, scale)

    def reqs():
        return [Request(i, [1 + i, 5, 9][: 1 + i % 3], 5) for i in range(4)]

    eager = paged_generate(llama, reqs(), 4, 16, 4, attention=host_reading_attention, graphs=False)
    run = paged_generate(llama, reqs(), 4, 16, 4, attention=host_reading_attention, graphs=True)
    assert run.outputs == eager.outputs
    assert run.graphs.startswith("eager") and "host" in run.graphs


@pytest.mark.parametrize("n_blocks", [40, 7])
def test_engines_with_graphs_give_eager_tokens(model, n_blocks):
    """7 blocks of 2 tokens force preemptions (recompute prefills) between graph decode steps."""
    def reqs():
        return [Request(i, [1 + i, 5, 9, 2 + i][: 1 + i % 4], 6 + i % 5, arrival=i // 2) for i in range(7)]

    eager, graphed = (paged_generate(model, reqs(), 4, n_blocks, 2, graphs=g) for g in (False, True))
    assert graphed.outputs == eager.outputs and graphed.preemptions == eager.preemptions
    assert eager.graphs == "eager" and "batch sizes [1, 2, 4]" in graphed.graphs
    if n_blocks == 40:
        c_eager, c_graphed = (contiguous_generate(model, reqs(), 3, 20, graphs=g) for g in (False, True))
        assert c_graphed.outputs == c_eager.outputs == eager.outputs
        assert "batch sizes [1, 2, 3]" in c_graphed.graphs


def test_paged_graphs_direct_calls(llama):
    """forward_paged with graphs attached: decode calls replay, prefill and foreign functions run eagerly."""
    cache = PagedKVCache(llama.cfg, n_blocks=8, block_size=2)
    g = capture_decode_graphs(llama, cache, 2, max_blocks=4)
    fns = dict(write_kv=write_kv, attention=paged_attention)
    forward_paged(llama, torch.tensor([[1, 2, 3]]), torch.arange(3)[None], cache, torch.tensor([0, 1, 2]), None, None, **fns)
    tables, lens = block_table_tensor([[0, 1]]), torch.tensor([4], dtype=torch.int32)
    a = forward_paged(llama, torch.tensor([[4]]), torch.tensor([[3]]), cache, torch.tensor([3]), tables, lens, **fns).clone()
    assert g.replays == 1 and g.eager_calls == 1
    b = forward_paged(llama, torch.tensor([[4]]), torch.tensor([[3]]), cache, torch.tensor([3]), tables, lens,
                      write_kv=write_kv, attention=lambda *args: paged_attention(*args))
    assert g.eager_calls == 2, "another attention function runs eagerly"
    # the replay attends over its static 4-block table, the eager call over 2 blocks: the same sums, reordered
    assert_orders_close(a, b, **for_decoder(llama.cfg), what="graph replay vs eager")
    with pytest.raises(ValueError, match="needs max_batch"):
        capture_decode_graphs(llama, cache)
    with pytest.raises(ValueError, match="max_blocks"):
        PagedDecodeGraphs(llama, cache, 2, 9)
    with pytest.raises(TypeError, match="SlotKVCache or a PagedKVCache"):
        capture_decode_graphs(llama, object(), 2)
    with pytest.raises(TypeError, match="graphs"):
        paged_generate(llama, [Request(0, [1], 2)], 1, 4, 2, graphs="yes")


def test_greedy_engine_reuses_its_graph(llama):
    from course.engine.graphs import GreedyEngine

    engine = GreedyEngine(llama, max_len=24, graphs=True)
    for prompt, n in (([3, 14, 15], 12), ([7], 20), ([1, 2, 3, 4, 5, 6], 18)):
        ids = torch.tensor([prompt])
        assert torch.equal(engine(ids, n), greedy_generate(llama, ids, n, graphs=False)), "a reused engine = a fresh one"
    assert engine.graphs.off is None and engine.graphs.replays == 11 + 19 + 17
    with pytest.raises(ValueError, match="max_len"):
        engine(torch.tensor([[1, 2, 3]]), 22)
    with pytest.raises(ValueError, match=r"\(1, T\)"):
        engine(torch.tensor([1, 2, 3]), 2)


def test_verify_graphs_for_several_tokens_per_row(model):
    """n_tokens > 1: a speculative verify pass (drafted tokens + one) replayed from a graph = forward_cached."""
    runs = []
    for graphs in (False, True):
        cache = SlotKVCache(model.cfg, n_slots=2, max_len=40)
        g = SlotDecodeGraphs(model, cache, 2, n_tokens=4) if graphs else None
        forward_cached(model, torch.tensor([[5, 6, 7], [9, 3, 1]]), torch.arange(3).expand(2, 3), cache, torch.tensor([1, 0]))
        out = []
        for step in range(5):
            ids = torch.tensor([[(step * 7 + i) % 64 for i in range(4)], [(step * 5 + i) % 64 for i in range(4)]])
            pos = 3 + 4 * step + torch.arange(4).expand(2, 4)
            call = g if graphs else forward_cached
            out.append(call(model, ids, pos, cache, torch.tensor([1, 0])).clone())
        runs.append((torch.stack(out), cache.lengths.clone()))
        if graphs:
            assert g.replays == 5 and g.off is None
    # the graph attends over its static buffers (max_len 40), forward_cached over what is filled: sums reordered
    assert_orders_close(runs[1][0], runs[0][0], **for_decoder(model.cfg, context=40), what="graph vs forward_cached")
    assert torch.equal(runs[0][1], runs[1][1])


# --- the same rules on a GPU (skipped without one): real CUDA graphs behind the same interface -------

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU: real CUDA graphs")


@cuda
def test_cuda_graph_semantics():
    x = torch.zeros(3, device="cuda")
    g = StepGraph("cuda")
    y = g.capture(lambda: x * 2 + 1)
    x.copy_(torch.tensor([1.0, 2.0, 3.0], device="cuda"))
    g.replay()
    assert y.tolist() == [3.0, 5.0, 7.0]
    x = torch.tensor([10.0, 20.0, 30.0], device="cuda")
    g.replay()
    assert y.tolist() == [3.0, 5.0, 7.0], "a new tensor is not seen by a CUDA graph either"
    z = torch.arange(3.0, device="cuda")
    with pytest.raises(GraphCaptureError, match="host"):
        StepGraph("cuda").capture(lambda: z * z.sum().item())       # refused before any CUDA capture starts
    assert (z + 1).tolist() == [1.0, 2.0, 3.0], "the GPU still works after a refused capture"


@cuda
@pytest.mark.parametrize("name", list(CONFIGS))
def test_cuda_engines_give_eager_tokens(name):
    m = init_weights(Decoder(CONFIGS[name]), std=0.5, seed=3).eval().cuda()

    def reqs():
        return [Request(i, [1 + i, 5, 9, 2 + i][: 1 + i % 4], 6 + i % 5, arrival=i // 2) for i in range(7)]

    for n_blocks in (40, 7):
        eager, graphed = (paged_generate(m, reqs(), 4, n_blocks, 2, graphs=g) for g in (False, True))
        assert graphed.outputs == eager.outputs and graphed.graphs.startswith("CUDA graphs"), graphed.graphs
    c_eager, c_graphed = (contiguous_generate(m, reqs(), 3, 20, graphs=g) for g in (False, True))
    assert c_graphed.outputs == c_eager.outputs and c_graphed.graphs.startswith("CUDA graphs"), c_graphed.graphs
    ids = torch.tensor([[3, 14, 15, 9]], device="cuda")
    assert torch.equal(greedy_generate(m, ids, 20, graphs=True), greedy_generate(m, ids, 20, graphs=False))
