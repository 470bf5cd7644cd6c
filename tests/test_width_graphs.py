"""course.engine.width_graphs on a CPU (the graph stand-in): speculative decoding on pooled one-slot
caches whose verify and draft passes replay graphs gives eager's tokens; calls of a width nobody
captured run eagerly; the pool captures once per key and hands the same cache out emptied."""
import pytest
import torch

from course.engine import SlotKVCache
from course.engine.speculative import extend, ngram_propose, propose, rollback, verify_greedy
from course.engine.width_graphs import SlotCachePool, WidthGraphs
from course.models import Decoder, init_weights
from course.tolerance import assert_orders_close, for_decoder
from tiny_models import tiny_configs

CONFIGS = tiny_configs(vocab_size=48, max_seq_len=128)


@pytest.fixture(params=list(CONFIGS), scope="module")
def pair(request):
    """(target, draft): the draft is the target with its weights nudged, so it agrees often, not always."""
    target = init_weights(Decoder(CONFIGS[request.param]), std=0.5, seed=5).eval()
    draft = init_weights(Decoder(CONFIGS[request.param]), std=0.5, seed=5).eval()
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
    return target, draft


def speculative(target, draft, prompt, n, gamma, caches, lookup=False):
    """Greedy speculative decoding on the course's released pieces, caches from `caches`."""
    max_len = len(prompt) + n + gamma + 1
    tcache = caches.get(target, max_len, widths=(1, gamma + 1))
    dcache = caches.get(draft, max_len, widths=(1, 2))
    seq = list(prompt)
    while len(seq) < len(prompt) + n:
        start = int(tcache.lengths[0])
        drafted = ngram_propose(seq, gamma) if lookup else propose(draft, dcache, seq, gamma)[0]
        rows = extend(target, tcache, seq[start:] + drafted)[-(len(drafted) + 1):]
        k, token = verify_greedy(rows, drafted)
        seq += drafted[:k] + [token]
        rollback(tcache, len(seq) - 1)
        rollback(dcache, min(len(seq) - 1, int(dcache.lengths[0])))
    return seq[len(prompt):len(prompt) + n], tcache, dcache


def plain(target, prompt, n, caches):
    cache = caches.get(target, len(prompt) + n)
    logits = extend(target, cache, prompt)[-1]
    out = []
    for i in range(n):
        out.append(int(logits.argmax()))
        if i + 1 < n:
            logits = extend(target, cache, [out[-1]])[-1]
    return out, cache


@pytest.mark.parametrize("gamma, lookup", [(3, False), (1, False), (4, True)])
def test_speculative_decoding_on_graphed_caches_gives_eager_tokens(pair, gamma, lookup):
    target, draft = pair
    prompt = [3, 1, 4, 1, 5, 9, 2, 6, 3, 1, 4]
    want, _ = plain(target, prompt, 24, SlotCachePool(graphs=False))
    eager, _, _ = speculative(target, draft, prompt, 24, gamma, SlotCachePool(graphs=False), lookup)
    pool = SlotCachePool(graphs=True)
    got, tcache, dcache = speculative(target, draft, prompt, 24, gamma, pool, lookup)
    assert eager == want and got == want, "speculative greedy decoding = plain greedy decoding, graphs or not"
    assert tcache.graphs.off is None and tcache.graphs.replays > 0, tcache.graphs.describe()
    assert tcache.graphs.eager_calls >= 1, "the prefill (its own width) runs eagerly"
    if not lookup:
        assert dcache.graphs.replays > 0, "the draft's one-token passes replay a graph"
    again, plain_cache = plain(target, prompt, 24, pool)
    assert again == want and plain_cache.graphs.replays == 23, "a plain decode replays its one-token graph each step"


def test_a_cache_first_asked_for_inside_inference_mode_still_captures(pair):
    target, draft = pair
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    want, _, _ = speculative(target, draft, prompt, 12, 2, SlotCachePool(graphs=False))
    with torch.inference_mode():                      # as course.timing.benchmark runs its calls
        got, tcache, _ = speculative(target, draft, prompt, 12, 2, SlotCachePool(graphs=True))
    assert got == want and tcache.graphs.off is None and tcache.graphs.replays > 0, tcache.graphs.describe()


def test_a_width_nobody_captured_runs_eagerly_with_eager_logits(pair):
    target, _ = pair
    cache = SlotKVCache(target.cfg, n_slots=1, max_len=32)
    cache.graphs = WidthGraphs(target, cache, [1, 4])
    ref = SlotKVCache(target.cfg, n_slots=1, max_len=32)
    for tokens in ([5, 6, 7], [8, 9, 10, 11], [12], [13, 14]):      # widths 3 (eager), 4, 1, 2 (eager)
        got = extend(target, cache, tokens).clone()
        want = extend(target, ref, tokens)
        # a replay attends over the static cache (max_len 32), an eager call over what is filled: sums reordered
        assert_orders_close(got, want, **for_decoder(target.cfg, context=32), what=f"width {len(tokens)}")
    assert cache.graphs.replays == 2 and cache.graphs.eager_calls == 2


def test_the_pool_captures_once_per_key_and_hands_the_cache_out_empty(pair):
    target, draft = pair
    pool = SlotCachePool(graphs=True, round_to=32)
    a = pool.get(target, 20, widths=(1, 3))
    extend(target, a, [1, 2, 3])
    b = pool.get(target, 30, widths=[3, 1])
    assert b is a and int(b.lengths[0]) == 0 and not bool(b.valid.any()), "same key (30 -> 32): the same cache, emptied"
    assert b.max_len == 32
    assert pool.get(target, 40, widths=(1, 3)) is not a, "max_len 40 rounds to 64: another cache"
    assert pool.get(target, 20, widths=(1,)) is not a and pool.get(draft, 20, widths=(1, 3)) is not a
    fresh = SlotCachePool(graphs=False)
    c, d = fresh.get(target, 20), fresh.get(target, 20)
    assert c is not d and c.max_len == 20 and getattr(c, "graphs", None) is None, "without graphs: plain caches"


def test_bad_arguments_name_themselves(pair):
    target, _ = pair
    pool = SlotCachePool(graphs=True)
    for kwargs, word in (({"widths": ()}, "widths"), ({"widths": (0,)}, "widths"), ({"widths": 2}, "widths"),
                         ({"max_len": 0}, "max_len"), ({"max_len": 2.5}, "max_len")):
        args = {"max_len": 16, **kwargs}
        with pytest.raises(ValueError, match=word):
            pool.get(target, **args)
    with pytest.raises(TypeError, match="model"):
        pool.get("smollm2", 16)
    with pytest.raises(TypeError, match="graphs"):
        SlotCachePool(graphs="yes")
    with pytest.raises(ValueError, match="round_to"):
        SlotCachePool(round_to=0)
