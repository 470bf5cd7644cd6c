"""course.engine's released lab-05 pieces: the block allocator (ref counts, fork, copy-on-write) and
the PyTorch paged-attention reference, each against an independent model of what it must do."""
import random

import pytest
import torch

from course.engine import BlockAllocator, OutOfBlocks, paged_attention, write_kv
from course.tolerance import assert_orders_close


def _scatter(lens, H, Hkv, D, bs, seed):
    """Dense K/V per sequence scattered into shuffled blocks of a pool whose other slots hold NaN."""
    g = torch.Generator().manual_seed(seed)
    n_blocks = sum(-(-L // bs) for L in lens) + 2
    kc = torch.full((n_blocks, bs, Hkv, D), float("nan"))
    vc = kc.clone()
    free = torch.randperm(n_blocks, generator=g).tolist()
    tables, ks, vs = [], [], []
    for L in lens:
        t = [free.pop() for _ in range(-(-L // bs))]
        k, v = torch.randn(L, Hkv, D, generator=g), torch.randn(L, Hkv, D, generator=g)
        write_kv(kc, vc, k, v, torch.tensor([t[p // bs] * bs + p % bs for p in range(L)]))
        tables.append(t), ks.append(k), vs.append(v)
    bt = torch.zeros(len(lens), max(map(len, tables)) + 1, dtype=torch.int32)
    for i, t in enumerate(tables):
        bt[i, :len(t)] = torch.tensor(t)
    return torch.randn(len(lens), H, D, generator=g), kc, vc, bt, torch.tensor(lens, dtype=torch.int32), ks, vs


@pytest.mark.parametrize("H, Hkv, bs", [(4, 4, 4), (9, 3, 16), (8, 1, 2)])
def test_paged_attention_equals_dense_attention_and_ignores_stale_slots(H, Hkv, bs):
    q, kc, vc, bt, lens, ks, vs = _scatter([1, bs, 2 * bs + 1, 3 * bs, 5], H, Hkv, 8, bs, seed=H + bs)
    out = paged_attention(q, kc, vc, bt, lens, 0.3)
    assert out.shape == q.shape and torch.isfinite(out).all()
    for b, (k, v) in enumerate(zip(ks, vs)):
        kk, vv = k.repeat_interleave(H // Hkv, 1), v.repeat_interleave(H // Hkv, 1)
        ref = torch.einsum("hl,lhd->hd", (torch.einsum("hd,lhd->hl", q[b], kk) * 0.3).softmax(-1), vv)
        # the same attention summed in another order: two reductions (scores over D, values over the context)
        assert_orders_close(out[b], ref, terms=max(k.shape[-1], len(k)), stages=2, what=f"row {b}")


def test_write_kv_skips_negative_slots_and_checks_shapes():
    kc, vc = torch.zeros(2, 2, 1, 2), torch.zeros(2, 2, 1, 2)
    write_kv(kc, vc, torch.ones(2, 1, 2), torch.ones(2, 1, 2), torch.tensor([3, -1]))
    assert kc.view(4, 1, 2)[3].sum() == 2 and kc.sum() == 2
    with pytest.raises(ValueError, match="slot_mapping"):
        write_kv(kc, vc, torch.ones(2, 1, 2), torch.ones(2, 1, 2), torch.tensor([0]))


@pytest.mark.parametrize("bs", [1, 3, 4])
def test_allocator_with_forks_keeps_every_sequence_reading_its_own_tokens(bs):
    rng, a = random.Random(bs), BlockAllocator(30, bs)
    pool, want, nxt = {}, {}, 0
    for step in range(400):
        r = rng.random()
        if want and r < 0.15:
            parent = rng.choice(sorted(want))
            a.fork(parent, nxt)
            want[nxt] = list(want[parent])
            nxt += 1
        elif want and r < 0.3:
            seq = rng.choice(sorted(want))
            a.free(seq)
            del want[seq]
        else:
            seq = rng.choice(sorted(want)) if want and r < 0.85 else nxt
            nxt += seq == nxt
            n = rng.randint(1, 5)
            before = (dict(a.lengths), {s: list(t) for s, t in a.block_tables.items()}, a.n_free)
            try:
                slots = a.append(seq, n)
            except OutOfBlocks:
                assert before == (a.lengths, a.block_tables, a.n_free), "a failed append changes nothing"
                continue
            for old, new in a.pending_copies:       # the engine's copy-on-write
                for o in range(bs):
                    pool[new * bs + o] = pool.get(old * bs + o)
            a.pending_copies.clear()
            toks = [(seq, step, i) for i in range(n)]
            pool.update(zip(slots, toks))
            want.setdefault(seq, []).extend(toks)
        for seq, toks in want.items():
            assert [pool.get(a.slot(seq, p)) for p in range(len(toks))] == toks
        users = {}
        for t in a.block_tables.values():
            for b in t:
                users[b] = users.get(b, 0) + 1
        assert all(a.ref_count[b] == users.get(b, 0) for b in range(30))
        assert sorted(list(users) + list(a.free_blocks)) == list(range(30))
    for seq in list(want):
        a.free(seq)
    assert a.n_free == 30 and not any(a.ref_count)


def test_allocator_errors_name_the_argument():
    with pytest.raises(ValueError, match="block_size"):
        BlockAllocator(4, 0)
    a = BlockAllocator(2, 4)
    with pytest.raises(OutOfBlocks, match="needs 3 more blocks"):
        a.append("s", 9)
    with pytest.raises(KeyError):
        a.free("s")
    with pytest.raises(ValueError, match="positive int"):
        a.append("s", 0)
