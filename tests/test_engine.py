"""The slot KV cache and `forward_cached` against the plain decoder, on tiny random models.

The invariants every engine of labs 04+ relies on: prefill then decode through the cache gives the
logits of one uncached forward over the whole sequence; a left-padded row gives what it gives alone;
rows in different slots, at different lengths, decoding together give what each gives alone.
"""
import dataclasses

import pytest
import torch

from course.engine import SlotKVCache, forward_cached
from course.models import Decoder, ModelConfig, init_weights
from course.tolerance import assert_orders_close, for_decoder

CONFIGS = {
    "llama-gqa": ModelConfig(family="llama", vocab_size=61, n_layer=2, n_head=4, n_kv_head=2, d_model=32,
                             d_ff=48, max_seq_len=64),
    "gpt2": ModelConfig(family="gpt2", vocab_size=61, n_layer=2, n_head=4, n_kv_head=4, d_model=32,
                        d_ff=64, max_seq_len=64),
}


@pytest.fixture(params=list(CONFIGS), scope="module")
def model(request):
    return init_weights(Decoder(CONFIGS[request.param]), std=0.2, seed=1).eval()


def ids(n, seed):
    return torch.randint(0, 61, (n,), generator=torch.Generator().manual_seed(seed))


def full(model, seq):
    """Logits of one uncached forward over the whole sequence: (T, V)."""
    with torch.no_grad():
        return model(seq[None], torch.arange(len(seq))[None])[0]


def same_logits(got, want, model, what=""):
    """Cached and uncached logits: the same sums in another order (course/tolerance.py's budget)."""
    assert_orders_close(got, want, **for_decoder(model.cfg), what=what)


def test_prefill_then_decode_equals_one_forward(model):
    seq = ids(12, 0)
    cache = SlotKVCache(model.cfg, n_slots=3, max_len=16)
    slot = torch.tensor([2])
    got = [forward_cached(model, seq[None, :8], torch.arange(8)[None], cache, slot)[0]]
    for t in range(8, 12):  # decode one token at a time
        got.append(forward_cached(model, seq[None, t:t + 1], torch.tensor([[t]]), cache, slot)[0])
    same_logits(torch.cat(got), full(model, seq), model)
    assert cache.lengths.tolist() == [0, 0, 12]
    assert cache.valid[2, :12].all() and not cache.valid[2, 12:].any() and not cache.valid[:2].any()


def test_chunked_prefill_equals_one_forward(model):
    seq = ids(10, 1)
    cache = SlotKVCache(model.cfg, n_slots=1, max_len=10)
    a = forward_cached(model, seq[None, :4], torch.arange(4)[None], cache, torch.tensor([0]))
    b = forward_cached(model, seq[None, 4:], torch.arange(4, 10)[None], cache, torch.tensor([0]))
    same_logits(torch.cat([a[0], b[0]]), full(model, seq), model)


def test_left_padded_batch_equals_each_row_alone(model):
    prompts = [ids(7, 2), ids(3, 3), ids(5, 4)]
    T, pad = 7, 0
    input_ids = torch.stack([torch.cat([torch.full((T - len(p),), pad), p]) for p in prompts])
    mask = torch.stack([torch.cat([torch.zeros(T - len(p)), torch.ones(len(p))]) for p in prompts]).long()
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    cache = SlotKVCache(model.cfg, n_slots=3, max_len=12)
    slots = torch.tensor([0, 1, 2])
    logits = forward_cached(model, input_ids, pos, cache, slots, mask)
    nxt = logits[:, -1].argmax(-1)
    step = forward_cached(model, nxt[:, None], pos[:, -1:] + 1, cache, slots)  # one decode step, no mask
    for b, p in enumerate(prompts):
        ref = full(model, torch.cat([p, nxt[b:b + 1]]))
        same_logits(logits[b, T - len(p):], ref[:-1], model, f"row {b} prefill")
        same_logits(step[b, 0], ref[-1], model, f"row {b} decode")
    assert not torch.isnan(logits).any(), "pad rows must stay finite"
    assert cache.valid.sum().item() == sum(len(p) for p in prompts) + 3
    assert cache.lengths.tolist() == [8, 8, 8]


def test_slots_at_different_lengths_decode_together(model):
    """Continuous batching: three sequences, prefilled separately into slots 4, 0, 2, then decoded
    in one batch at different positions; each equals the sequence run alone."""
    seqs = [ids(9, 5), ids(4, 6), ids(6, 7)]
    cache = SlotKVCache(model.cfg, n_slots=5, max_len=20)
    slots = [4, 0, 2]
    for s, seq in zip(slots, seqs):
        forward_cached(model, seq[None, :-1], torch.arange(len(seq) - 1)[None], cache, torch.tensor([s]))
    last = torch.stack([seq[-1:] for seq in seqs])                      # (3, 1)
    pos = torch.tensor([[len(seq) - 1] for seq in seqs])
    out = forward_cached(model, last, pos, cache, torch.tensor(slots))
    for b, seq in enumerate(seqs):
        same_logits(out[b, 0], full(model, seq)[-1], model, f"row {b}")
    assert cache.lengths.tolist() == [4, 0, 6, 0, 9]
    # reset frees a slot for a new sequence, which then ignores the old one's keys
    cache.reset(4)
    new = ids(3, 8)
    got = forward_cached(model, new[None], torch.arange(3)[None], cache, torch.tensor([4]))
    same_logits(got[0], full(model, new), model)


def test_bytes_reserved_and_used():
    cfg = CONFIGS["llama-gqa"]
    cache = SlotKVCache(cfg, n_slots=4, max_len=10)
    per_token = 2 * cfg.n_layer * cfg.n_kv_head * cfg.head_dim * 4
    assert cache.bytes_per_token() == per_token
    assert cache.bytes_reserved() == 4 * 10 * per_token
    assert cache.bytes_used() == 0
    model = init_weights(Decoder(cfg))
    forward_cached(model, torch.ones(2, 3, dtype=torch.long), torch.zeros(2, 3, dtype=torch.long), cache,
                   torch.tensor([1, 3]), torch.tensor([[0, 1, 1], [1, 1, 1]]))
    assert cache.bytes_used() == 5 * per_token  # the pad is stored but not counted as used
    assert "lengths=[0, 3, 0, 3]" in repr(cache)
    assert SlotKVCache(cfg, 1, 4, dtype=torch.float16).bytes_per_token() == per_token // 2


def test_clear_errors(model):
    cache = SlotKVCache(model.cfg, n_slots=2, max_len=8)
    x, p = torch.ones(1, 3, dtype=torch.long), torch.arange(3)[None]
    with pytest.raises(ValueError, match=r"slot 2 is out of range"):
        forward_cached(model, x, p, cache, torch.tensor([2]))
    with pytest.raises(ValueError, match=r"slots must be an integer tensor of shape \(B,\)"):
        forward_cached(model, x, p, cache, torch.tensor([0, 1]))
    with pytest.raises(ValueError, match=r"slots must be distinct"):
        forward_cached(model, torch.ones(2, 3, dtype=torch.long), p.expand(2, 3), cache, torch.tensor([1, 1]))
    with pytest.raises(ValueError, match=r"attention_mask must have the shape of input_ids"):
        forward_cached(model, x, p, cache, torch.tensor([0]), torch.ones(1, 4))
    with pytest.raises(ValueError, match=r"position_ids \(1, 2\) must match input_ids \(1, 3\)"):
        forward_cached(model, x, p[:, :2], cache, torch.tensor([0]))
    forward_cached(model, x, p, cache, torch.tensor([1]))
    forward_cached(model, x, p + 3, cache, torch.tensor([1]))
    with pytest.raises(ValueError, match=r"slot 1 would hold 9 tokens, max_len is 8"):
        forward_cached(model, x, p + 6, cache, torch.tensor([1]))
    assert cache.lengths.tolist() == [0, 6], "a refused call must not change the cache"
    deeper = dataclasses.replace(model.cfg, n_layer=3)
    with pytest.raises(ValueError, match="another model"):
        forward_cached(model, x, p, SlotKVCache(deeper, 1, 8), torch.tensor([0]))
    with pytest.raises(ValueError, match="slot 5 is out of range"):
        cache.reset(5)
    with pytest.raises(ValueError, match="max_len must be a positive int"):
        SlotKVCache(model.cfg, 2, 0)
