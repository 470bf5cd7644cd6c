"""The serving engine's parts (lab 11) on tiny random models: forward_extend, the prefix cache, the
schedulers, the sampler, LLMEngine (equal to an uncached greedy loop under both policies, with
preemption and prefix hits), and AsyncEngine (concurrent streams, cancellation, a bounded queue)."""
import asyncio
import random

import pytest
import torch

from course.engine import (BlockAllocator, OutOfBlocks, PagedKVCache, PrefixCache, SamplingParams, Seq,
                           block_table_tensor, forward_extend, sample, schedule_chunked, schedule_prefill_first)
from course.models import Decoder, init_weights
from course.serve import AsyncEngine, LLMEngine, QueueFull
from course.tolerance import assert_orders_close, for_decoder
from tiny_models import tiny_configs

CONFIGS = tiny_configs(vocab_size=61, max_seq_len=128, llama_d_ff=48)


@pytest.fixture(params=list(CONFIGS), scope="module")
def model(request):
    return init_weights(Decoder(CONFIGS[request.param]), std=0.3, seed=1).eval()


def greedy(model, prompt, n, eos=None):
    """The reference: no cache, the whole sequence through the model at every step."""
    out = []
    with torch.no_grad():
        for _ in range(n):
            ids = torch.tensor([prompt + out])
            out.append(int(model(ids, torch.arange(ids.shape[1])[None])[0, -1].argmax()))
            if out[-1] == eos:
                break
    return out


def test_forward_extend_mixes_chunks_and_decodes(model):
    g = torch.Generator().manual_seed(0)
    seqs = {s: torch.randint(0, 61, (n,), generator=g).tolist() for s, n in ((0, 11), (1, 7), (2, 3), (3, 17))}
    cache, alloc, done = PagedKVCache(model.cfg, 40, 4), BlockAllocator(40, 4), {s: 0 for s in seqs}
    for step in ({0: 5, 1: 7}, {0: 6, 2: 2, 3: 4}, {2: 1, 1: 0, 3: 13}, {3: 0, 0: 0, 2: 0}):
        ids, pos, slots, qlens, tables, ctx, order = [], [], [], [], [], [], []
        for s, n in step.items():
            if n == 0:
                continue
            a = done[s]
            slots += alloc.append(s, n)
            ids += seqs[s][a:a + n]
            pos += range(a, a + n)
            qlens.append(n)
            tables.append(alloc.block_tables[s])
            ctx.append(a + n)
            order.append(s)
            done[s] += n
        if not order:
            continue
        out = forward_extend(model, cache, torch.tensor(ids), torch.tensor(pos), torch.tensor(slots), qlens,
                             block_table_tensor(tables), torch.tensor(ctx, dtype=torch.int32))
        assert out.shape == (len(order), 61)
        for row, s in enumerate(order):
            with torch.no_grad():
                want = model(torch.tensor([seqs[s][:done[s]]]), torch.arange(done[s])[None])[0, -1]
            # chunks, pages and a mixed batch vs one uncached forward: the same sums in another order
            assert_orders_close(out[row], want, **for_decoder(model.cfg), what=f"sequence {s} after {done[s]} tokens")


def test_forward_extend_rejects_bad_shapes(model):
    cache = PagedKVCache(model.cfg, 4, 4)
    with pytest.raises(ValueError, match="query_lens"):
        forward_extend(model, cache, torch.tensor([1, 2]), torch.tensor([0, 1]), torch.tensor([0, 1]), [3],
                       torch.zeros(1, 1, dtype=torch.int32), torch.tensor([3], dtype=torch.int32))


def test_prefix_cache_shares_full_blocks_and_evicts_lru():
    pc = PrefixCache(n_blocks=6, block_size=2)
    assert pc.allocate("a", [1, 2, 3, 4, 5]) == (0, [0, 1, 2, 3, 4])
    pc.commit("a", [1, 2, 3, 4, 5])
    n, slots = pc.allocate("b", [1, 2, 3, 4, 9])
    assert n == 4 and pc.tables["b"][:2] == pc.tables["a"][:2] and len(slots) == 1
    assert pc.allocate("c", [1, 2, 3, 4])[0] == 2, "the last token is always computed"
    pc.free("a"), pc.free("b"), pc.free("c")
    assert pc.blocks_in_use == 0 and pc.pool.n_free == 6 and len(pc.pool.cached) == 2
    pc.allocate("d", [7] * 11)                         # 6 blocks: evicts everything cached
    assert len(pc.pool.cached) == 0 and pc.hit_rate == pytest.approx(6 / 25)
    with pytest.raises(OutOfBlocks):
        pc.allocate("e", [1])
    assert "e" not in pc.tables


def test_prefix_cache_never_hands_out_a_colliding_block():
    pc = PrefixCache(n_blocks=8, block_size=2, hash_fn=lambda parent, block: 0)   # every block collides
    pc.allocate("a", [1, 2, 3]), pc.commit("a", [1, 2, 3]), pc.free("a")
    assert pc.allocate("b", [5, 6, 7])[0] == 0, "same hash, other tokens: a miss"
    assert pc.allocate("c", [1, 2, 9])[0] == 2


def _seq(rid, n, done=0):
    s = Seq(rid, list(range(1, n + 1)), 4)
    s.num_computed = done
    return s


def test_schedule_chunked_budget_decodes_first_fcfs():
    a, b, doc, late = _seq("a", 3, 2), _seq("b", 3, 2), _seq("doc", 100), _seq("late", 5)
    plan = schedule_chunked([a, b], [doc, late], 16, 8, lambda s: True)
    assert [(s.rid, n) for s, n in plan] == [("a", 1), ("b", 1), ("doc", 14)]
    plan = schedule_chunked([a], [doc, late], 16, 8, lambda s: s.rid != "doc")
    assert [(s.rid, n) for s, n in plan] == [("a", 1)], "nobody overtakes a request that does not fit"
    with pytest.raises(ValueError, match="budget"):
        schedule_chunked([], [], 0, 1, lambda s: True)


def test_schedule_prefill_first_runs_whole_prompts_alone():
    a, doc = _seq("a", 3, 2), _seq("doc", 100)
    assert [(s.rid, n) for s, n in schedule_prefill_first([a], [doc], 16, 8, lambda s: True)] == [("doc", 100)]
    assert [(s.rid, n) for s, n in schedule_prefill_first([a], [doc], 16, 8, lambda s: False)] == [("a", 1)]


def test_sampler_greedy_seeded_and_checked():
    z = torch.randn(4, 30, generator=torch.Generator().manual_seed(0))
    assert sample(z, [SamplingParams(temperature=0.0)] * 4).tolist() == z.argmax(-1).tolist()
    assert sample(z, [SamplingParams(top_k=1)] * 4).tolist() == z.argmax(-1).tolist(), "top_k=1 keeps the argmax"
    p = SamplingParams(temperature=1.0, seed=5)
    alone = [sample(z[1:2], [p], [g]).item() for g in [p.generator()] for _ in range(5)]
    g = p.generator()
    crowd = [sample(z, [SamplingParams(), p, SamplingParams(), SamplingParams()], [None, g, None, None])[1].item()
             for _ in range(5)]
    assert alone == crowd, "a seeded row draws the same tokens alone and in a batch"
    with pytest.raises(ValueError, match="one SamplingParams"):
        sample(z, [p])
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0.0)


@pytest.mark.parametrize("policy,budget", [("prefill_first", 1000), ("chunked", 8), ("chunked", 5)])
def test_engine_equals_greedy_under_both_policies_with_preemption(model, policy, budget):
    g = random.Random(3)
    stem = [g.randrange(61) for _ in range(9)]
    prompts = [stem + [g.randrange(61) for _ in range(k)] for k in (0, 3, 11, 1, 20, 6)]
    news = [16, 12, 9, 14, 4, 8]
    core = LLMEngine(model, n_blocks=10, block_size=4, max_running=4, budget=budget, policy=policy)
    for i, (p, n) in enumerate(zip(prompts, news)):
        core.add_request(i, p, SamplingParams(temperature=0.0), max_tokens=n)
    out = {i: [] for i in range(len(prompts))}
    for _ in range(500):
        if not core.has_work():
            break
        for o in core.step():
            out[o.rid].append(o.token)
            assert o.index == len(out[o.rid]) - 1
    assert not core.has_work(), "the engine never finished"
    assert [out[i] for i in range(len(prompts))] == [greedy(model, p, n) for p, n in zip(prompts, news)]
    assert core.pc.blocks_in_use == 0
    assert core.stats.preemptions > 0, "10 blocks of 4 for 4 growing requests: some must be preempted"
    assert core.pc.hit_tokens > 0, "the shared stem must hit the prefix cache"


def test_engine_abort_frees_blocks_and_checks_requests(model):
    core = LLMEngine(model, n_blocks=16, block_size=4, max_running=2, budget=8)
    core.add_request("x", list(range(10)), max_tokens=50)
    core.step(), core.step()
    assert core.pc.blocks_in_use > 0
    assert core.abort("x") and not core.abort("x") and core.pc.blocks_in_use == 0 and not core.has_work()
    with pytest.raises(ValueError, match="exceeds max_model_len"):
        core.add_request("y", [1] * 60, max_tokens=10)     # 16 blocks of 4 hold 64 tokens
    with pytest.raises(ValueError, match="token ids"):
        core.add_request("z", [1, 99], max_tokens=1)
    with pytest.raises(ValueError, match="budget"):
        LLMEngine(model, max_running=8, budget=4)


def test_engine_records_a_trace_for_the_timeline(model):
    from course.widgets.batch_timeline import timeline_stats
    core = LLMEngine(model, n_blocks=32, block_size=4, max_running=4, budget=6, policy="chunked")
    core.record_trace()
    core.add_request(0, list(range(3)), max_tokens=6)
    core.add_request(1, list(range(1, 20)), max_tokens=3)
    while core.has_work():
        core.step()
    states = [set(s.values()) for s in core.trace]
    assert any("chunk" in s for s in states) and len(core.step_times) == len(core.trace)
    stats = timeline_stats(core.trace, core.step_times)
    assert stats[0].tokens == 6 and stats[1].tokens == 3


def _drain_all(engine, prompts, n, leave=None):
    async def one(i, p):
        got = []
        rid = engine.add(p, SamplingParams(temperature=0.0), n)
        async for o in engine.stream(rid):
            got.append(o.token)
            if leave is not None and i in leave and len(got) == 2:
                break
        return got

    async def main():
        res = await asyncio.gather(*[one(i, p) for i, p in enumerate(prompts)])
        for _ in range(2000):
            if not engine.core.has_work():
                break
            await asyncio.sleep(0.005)
        await engine.stop()
        return res
    return asyncio.run(asyncio.wait_for(main(), 60))


def test_async_engine_streams_concurrently_and_aborts(model):
    g = random.Random(4)
    prompts = [[g.randrange(61) for _ in range(g.randint(2, 12))] for _ in range(7)]
    eng = AsyncEngine(LLMEngine(model, n_blocks=64, block_size=4, max_running=3, budget=8), max_waiting=100)
    got = _drain_all(eng, prompts, 6, leave={1, 4})
    for i, p in enumerate(prompts):
        want = greedy(model, p, 6)
        assert got[i] == (want[:2] if i in {1, 4} else want), f"request {i}"
    assert eng.core.pc.blocks_in_use == 0 and eng.core.stats.aborted == 2 and not eng.streams


def test_async_engine_bounded_queue(model):
    async def main():
        eng = AsyncEngine(LLMEngine(model, n_blocks=64, block_size=4, max_running=1, budget=8), max_waiting=2)
        greedy_params = SamplingParams(temperature=0.0)
        a, b = eng.add([1, 2], greedy_params, max_tokens=2), eng.add([3], greedy_params, max_tokens=2)
        with pytest.raises(QueueFull):
            eng.add([4])
        outs = [[o.token async for o in eng.stream(r)] for r in (a, b)]
        await eng.stop()
        return outs
    outs = asyncio.run(asyncio.wait_for(main(), 30))
    assert outs == [greedy(model, [1, 2], 2), greedy(model, [3], 2)]


def test_engine_with_decode_graphs_gives_the_same_tokens(model):
    """graphs=True captures the decode step (a stand-in with CUDA-graph semantics on a CPU): same tokens."""
    pytest.importorskip("course.engine.graphs")
    prompts, outs, cores = [[1, 2, 3], [4, 5, 6, 7, 8, 9, 10], [11]], {}, {}
    for graphs, graph_max_len in ((False, 1024), (True, 1024), (True, 8)):
        core = LLMEngine(model, n_blocks=32, block_size=4, max_running=4, budget=16, graphs=graphs,
                         graph_max_len=graph_max_len)
        for i, p in enumerate(prompts):
            core.add_request(i, p, SamplingParams(temperature=0.0), max_tokens=6)
        got = {i: [] for i in range(len(prompts))}
        while core.has_work():
            for o in core.step():
                got[o.rid].append(o.token)
        outs[graphs, graph_max_len], cores[graphs, graph_max_len] = got, core
    assert outs[True, 1024] == outs[True, 8] == outs[False, 1024] == {i: greedy(model, p, 6) for i, p in enumerate(prompts)}
    wide, narrow = cores[True, 1024].kv.graphs, cores[True, 8].kv.graphs
    assert wide.replays > 0 and wide.eager_calls == 0, "every decode step fits graphs 1024 tokens wide"
    assert narrow.max_blocks == 2 and narrow.replays > 0 and narrow.eager_calls > 0, \
        "graphs 8 tokens wide: batches whose longest sequence (7 + 6 tokens) outgrows them run eagerly"
    with pytest.raises(ValueError, match="graph_max_len"):
        LLMEngine(model, n_blocks=32, block_size=4, max_running=4, budget=16, graphs=True, graph_max_len=0)
