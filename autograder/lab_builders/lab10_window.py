"""Lab 10, sections 2-4: a sliding window over the paged cache, attention sinks, and what they cost
in perplexity (Problems 2 and 3). Assembled by lab10.py."""
from autograder.authoring import code, md, solution, tests

# Independent references of the hidden tests: the window rule written position by position, and a
# "pool content" model of the allocator (every appended token writes its value into its slot; every
# kept position of every sequence must read its own value back).
HIDDEN_MASK_REF = r'''
def _ref_mask(n, window, sink, bs):
    # query t sees key j <= t when j's block holds a sink position or a position of the last `window`
    # of the t + 1 tokens so far: block b holds b*bs .. (b+1)*bs - 1
    sink_end = -(-sink // bs) * bs
    rows = []
    for t in range(n):
        length = t + 1
        row = []
        for j in range(n):
            b = j // bs
            row.append(j <= t and (j < sink_end or (b + 1) * bs > length - window))
        rows.append(row)
    return torch.tensor(rows, dtype=torch.bool, device=dev)
'''.strip("\n")

HIDDEN_ALLOC_REF = r'''
def _ref_kept(length, window, sink, bs):
    # logical blocks a sequence of `length` tokens keeps
    n = -(-length // bs)
    return [b for b in range(n) if b * bs < sink or (b + 1) * bs > length - window]
def _alloc_stress(window, sink, bs, n_blocks, n_ops, seed):
    rng = random.Random(seed)
    a = WindowAllocator(n_blocks, bs, window, sink)
    content, tokens, nxt = {}, {}, 0
    for _ in range(n_ops):
        r = rng.random()
        live = sorted(tokens)
        if live and r < 0.15:
            s = rng.choice(live); a.free(s); del tokens[s]
        elif live and r < 0.3:
            parent = rng.choice(live)
            a.fork(parent, nxt); tokens[nxt] = list(tokens[parent]); nxt += 1
        elif live and r < 0.85:
            s = rng.choice(live)
            n = rng.randint(1, 2 * bs)
            try:
                slots = a.append(s, n)
            except OutOfBlocks:
                continue
            for src, dst in a.pending_copies:                   # copy-on-write: the engine copies the block
                for off in range(bs):
                    if src * bs + off in content:
                        content[dst * bs + off] = content[src * bs + off]
            a.pending_copies.clear()
            for slot in slots:
                tokens[s].append(rng.randrange(10 ** 6)); content[slot] = tokens[s][-1]
        else:
            try:
                slots = a.append(nxt, rng.randint(1, 3 * bs))
            except OutOfBlocks:
                continue
            tokens[nxt] = []
            for slot in slots:
                tokens[nxt].append(rng.randrange(10 ** 6)); content[slot] = tokens[nxt][-1]
            nxt += 1
        users = {}
        for s, toks in tokens.items():
            table = expect_type(a.block_tables[s], f"block_tables[{s}]", list)
            assert a.lengths[s] == len(toks) and len(table) == -(-len(toks) // bs), \
                "a table keeps one entry per logical block (None for an evicted one): never delete entries"
            kept = _ref_kept(len(toks), window, sink, bs)
            got = [i for i, b in enumerate(table) if b is not None]
            assert got == kept, (f"window {window}, sink {sink}, blocks of {bs}, {len(toks)} tokens: the table keeps logical "
                                 f"blocks {got}, which is wrong: keep block b while it holds a sink position "
                                 "(b * block_size < sink) or one of the last `window` positions")
            for b in table:
                if b is not None:
                    users[b] = users.get(b, 0) + 1
            for p in range(len(toks)):
                if table[p // bs] is not None:
                    assert content.get(a.slot(s, p)) == toks[p], \
                        "a kept token was overwritten: a block still in use (by this sequence or a fork) went back to the pool"
        assert all(a.ref_count[b] == users.get(b, 0) for b in range(n_blocks)), \
            "ref_count must equal the number of tables that still hold each block"
        assert sorted(a.free_blocks) == [b for b in range(n_blocks) if b not in users], \
            "the free list must hold exactly the blocks no table holds, each once"
    return a
'''.strip("\n")

cells = [
md(r"""
## 2. Keep fewer tokens: a sliding window

The workshop's first idea: not every token matters equally, so attend only to the **last N tokens**.
Mistral 7B was trained that way (a window of 4,096), and any model can be run that way. The cache
then stops growing: each sequence keeps at most about N tokens, however long it runs.

On the paged cache of lab 05 memory comes in blocks, so the window frees whole blocks: a block is
freed once **none** of its tokens is in the window. The window therefore keeps between N and
N + block_size - 1 tokens. Blocks of 4, a window of 6, after 14 tokens (positions 0 to 13):

```
position    0  1  2  3 |  4  5  6  7 |  8  9 10 11 | 12 13  .  .
window                                [ 8 ..................... 13 ]   the last 6 tokens
block       L0 evicted |  L1 evicted |  L2 kept    |  L3 kept (partly full)
```

Later we will also keep the first `sink` tokens for good, in whole blocks (section 4 shows why).
The rule, for a sequence of L tokens: logical block `i` is kept when

- it holds a sink token: `i < ceil(sink / block_size)`, or
- it holds a window token: `i >= max(0, L - window) // block_size`;

every other block has been evicted. Attention must follow the cache: when token t is processed
the sequence holds t + 1 tokens, so **query t sees key j when j <= t and j sits in a block kept at
length t + 1**. Write it as a mask: one forward pass with that mask scores every position of a text
as a token-by-token decode with the window would (section 3 proves it).

## Problem 2: What each query sees (3 points)

**Deliverable:** `window_mask(n, window, sink, block_size, device)`: a bool tensor (n, n) on
`device`, True at [t, j] when query t sees key j under the rule above. (With `window >= n` it is
the plain causal mask.)
"""),
solution("window_mask", r'''
def window_mask(n: int, window: int, sink: int, block_size: int, device="cpu") -> torch.Tensor:
    """(n, n) bool: [t, j] is True when query t sees key j (a sliding window of blocks plus sink blocks)."""
    ### BEGIN SOLUTION
    t = torch.arange(n, device=device)[:, None]                # (n, 1): the query's position
    j = torch.arange(n, device=device)[None, :]                # (1, n): the key's position
    first_kept = (t + 1 - window).clamp(min=0) // block_size   # first window block at length t + 1
    sink_blocks = -(-sink // block_size)
    block = j // block_size
    return (j <= t) & ((block >= first_kept) | (block < sink_blocks))
    ### END SOLUTION
'''),
code(r'''
fig, axes = plt.subplots(1, 2, figsize=(8, 4))
for ax, sink in zip(axes, (0, 4)):
    ax.imshow(window_mask(48, 12, sink, 4, device=dev).cpu(), cmap="Blues", interpolation="nearest")
    ax.set_title(f"window 12, blocks of 4, sink {sink}"); ax.set_xlabel("key position j"); ax.set_ylabel("query position t")
plt.tight_layout(); plt.show()
'''),
md(r"""
The staircase is the block granularity: a query sees between 12 and 15 recent tokens, and the window
jumps forward by a whole block when the oldest block leaves. On the right, the first block stays
visible to every query.
"""),
tests("window_mask_tests", 3, r"""
def picture(rows):
    return torch.tensor([[ch == "x" for ch in r] for r in rows], dtype=torch.bool, device=dev)
got = expect_tensor(window_mask(8, 3, 1, 2, device=dev), "window_mask(8, 3, 1, 2)", dtype=torch.bool, shape=(8, 8), device=dev)
want = picture(["x.......",
                "xx......",
                "xxx.....",
                "xxxx....",
                "xxxxx...",     # length 5: the window (2, 3, 4) still reaches block 1 (2, 3)
                "xxxxxx..",
                "xx..xxx.",     # length 7: the window is 4, 5, 6; block 1 (2, 3) is out; block 0 is the sink
                "xx..xxxx"])
bad = [(t, j) for t in range(8) for j in range(8) if bool(got[t, j]) != bool(want[t, j])]
assert not bad, (f"window 3, sink 1, blocks of 2: wrong at (query, key) {bad[:6]}; row t is the cache at length t + 1, whose "
                 "window starts at position t + 1 - window: a block is kept while it holds a position >= t + 1 - window, or a sink")
got = expect_tensor(window_mask(8, 3, 0, 2, device=dev), "window_mask(8, 3, 0, 2)", dtype=torch.bool, shape=(8, 8), device=dev)
assert got[7].tolist() == [False] * 4 + [True] * 4 and got[6].tolist() == [False] * 4 + [True] * 3 + [False], \
    "no sink: the first blocks leave like any other; query 6 sees 4, 5, 6 and never a later key"
got = expect_tensor(window_mask(6, 10, 0, 4, device=dev), "window_mask(6, 10, 0, 4)", dtype=torch.bool, shape=(6, 6), device=dev)
assert torch.equal(got, torch.ones(6, 6, dtype=torch.bool, device=dev).tril()), "a window longer than the text is the causal mask"
### BEGIN HIDDEN TESTS
""" + HIDDEN_MASK_REF + r"""
for n, window, sink, bs in ((40, 7, 0, 4), (40, 8, 0, 4), (40, 9, 3, 4), (33, 5, 4, 4), (33, 5, 5, 4), (30, 1, 0, 1),
                            (30, 1, 2, 3), (25, 6, 0, 1), (64, 16, 1, 16), (64, 17, 16, 16), (20, 3, 30, 4), (12, 100, 0, 5)):
    got = expect_tensor(window_mask(n, window, sink, bs, device=dev), f"window_mask({n}, {window}, {sink}, {bs})",
                        dtype=torch.bool, shape=(n, n), device=dev)
    want = _ref_mask(n, window, sink, bs)
    bad = (got != want).nonzero().tolist()
    assert not bad, (f"window {window}, sink {sink}, blocks of {bs}: wrong at (query, key) {bad[:5]}; a block is "
                     f"kept while it holds one of the last `window` positions of the t + 1 tokens, or a sink position")
    assert bool(got.diagonal().all()) and not bool(got.triu(1).any()), "every query sees itself and never a later token"
### END HIDDEN TESTS
"""),
md(r"""
## Problem 3: Free the blocks that left the window (4 points)

Now the memory. `WindowAllocator` is lab 05's `BlockAllocator` (released in `course.engine`: free
list, block tables, reference counts, fork and copy-on-write) for sequences that keep only their
window and their sinks. After every `append` it calls `evict(seq)`, which you write: it drops from
the sequence's table every block the rule of section 2 no longer keeps.

- An evicted entry becomes `None` in the table: the table keeps one entry per logical block, so
  `slot(seq, pos)` still finds every kept token (vLLM puts a "null block" in the same place).
- Dropping a block releases one reference. A block returns to the free list only when no table
  holds it any more: after a `fork`, the parent may still need a block the child has dropped.
- `evict` returns the physical blocks it dropped, in logical order (an empty list when there is nothing to drop).

The engine below appends one token at a time, so `evict` never drops the block just written to. (A
real engine computes a prompt longer than the window first, and drops its early blocks afterwards.)

The rest is given: `kept_table(seq)` lists the kept blocks in order and `kept_len(seq)` counts their
tokens; they are what attention reads (section 3). `fork` and `free` skip the `None` entries.

**Deliverable:** `WindowAllocator.evict(seq)`.

Graded case by case: each scenario of the tests earns its share of the 4 points, and the feedback lists the
cases that failed.
"""),
solution("window_allocator", r'''
class WindowAllocator(BlockAllocator):
    """Lab 05's allocator for sequences that keep their last `window` tokens and their first `sink`
    tokens: blocks that hold neither are freed as the sequence grows."""

    def __init__(self, n_blocks: int, block_size: int, window: int, sink: int = 0):
        super().__init__(n_blocks, block_size)
        if type(window) is not int or window < 1 or type(sink) is not int or sink < 0:
            raise ValueError(f"window must be an int >= 1 and sink an int >= 0, got {window!r} and {sink!r}")
        self.window, self.sink = window, sink

    def append(self, seq, n: int) -> list[int]:
        """Room for n more tokens of seq (their slots), then evict what left the window."""
        slots = super().append(seq, n)
        self.evict(seq)
        return slots

    def evict(self, seq) -> list[int]:
        """Drop the blocks of seq that hold neither a sink token nor a window token: their table
        entries become None; a block with no user left goes back to the free list. Returns the
        dropped physical blocks, in logical order."""
        ### BEGIN SOLUTION
        table, length = self.block_tables[seq], self.lengths[seq]
        first_kept = max(0, length - self.window) // self.block_size
        sink_blocks = -(-self.sink // self.block_size)
        dropped = []
        for i in range(sink_blocks, first_kept):
            block = table[i]
            if block is None:                       # evicted earlier
                continue
            table[i] = None
            self.ref_count[block] -= 1
            if self.ref_count[block] == 0:
                self.free_blocks.append(block)
            dropped.append(block)
        return dropped
        ### END SOLUTION

    def kept_table(self, seq) -> list[int]:
        """The physical blocks attention reads, in order: sinks, then the window."""
        return [b for b in self.block_tables[seq] if b is not None]

    def kept_len(self, seq) -> int:
        """Tokens in the kept blocks (evicted blocks are always full)."""
        return self.lengths[seq] - self.block_size * sum(b is None for b in self.block_tables[seq])

    def fork(self, parent, child) -> None:
        if parent not in self.block_tables:
            raise KeyError(f"sequence {parent!r} holds no blocks: nothing to fork")
        if child in self.block_tables:
            raise ValueError(f"sequence {child!r} already exists")
        self.block_tables[child] = list(self.block_tables[parent])
        self.lengths[child] = self.lengths[parent]
        for block in self.block_tables[child]:
            if block is not None:
                self.ref_count[block] += 1

    def free(self, seq) -> None:
        if seq not in self.block_tables:
            raise KeyError(f"sequence {seq!r} holds no blocks")
        for block in self.block_tables.pop(seq):
            if block is not None:
                self.ref_count[block] -= 1
                if self.ref_count[block] == 0:
                    self.free_blocks.append(block)
        del self.lengths[seq]
'''),
code(r'''
BS_DEMO, WINDOW_DEMO, SINK_DEMO = 8, 16, 4                 # blocks of 8 tokens, a window of 16, 4 sink tokens (1 block)
demo_ids = text_ids[:env.pick(128, 40)]
pieces = [tokenizer.decode([i]) for i in demo_ids]


def window_run(window, sink, every=BS_DEMO):
    """Feed the demo tokens one at a time through a WindowAllocator with a small pool; a snapshot every `every` tokens."""
    n_blocks = -(-sink // BS_DEMO) + window // BS_DEMO + 3
    alloc = WindowAllocator(n_blocks, BS_DEMO, window, sink)
    snaps, peak = [], 0
    for p in range(len(demo_ids)):
        alloc.append("seq", 1)
        peak = max(peak, n_blocks - alloc.n_free)
        if (p + 1) % every == 0 or p + 1 == len(demo_ids):
            snaps.append((list(alloc.block_tables["seq"]), pieces[:p + 1], -(-sink // BS_DEMO)))
    return snaps, peak, n_blocks


runs = {"window": window_run(WINDOW_DEMO, 0), "window + sinks": window_run(WINDOW_DEMO, SINK_DEMO)}
for name, (snaps, peak, n_blocks) in runs.items():
    print(f"{name:>15}: {len(demo_ids)} tokens through a pool of {n_blocks} blocks of {BS_DEMO}; at most {peak} in use at once")
steps = [{name: snaps[i] for name, (snaps, _, _) in runs.items()} for i in range(len(runs["window"][0]))]
window_blocks(steps, BS_DEMO, labels=[f"after {len(s['window'][1])} tokens" for s in steps],
              title=f"Window of {WINDOW_DEMO} tokens, blocks of {BS_DEMO}: kept and evicted blocks")
'''),
md(r"""
Move the slider. Once the window has passed a block, the block turns grey and its physical block
goes back to the pool; a few steps later the same physical id (`P...`) comes back holding newer
tokens. The sequence runs forever on a handful of blocks. With sinks the first block never leaves.
"""),
tests("window_allocator_tests", 4, r"""
from course.expect import Cases
cases = Cases(points=4)        # one share of the 4 points per case: the feedback lists the cases that failed
def grown(n_tokens, window=6, sink=0, one_at_a_time=True):   # a sequence "s" in 8 blocks of 4
    a = WindowAllocator(n_blocks=8, block_size=4, window=window, sink=sink)
    for _ in range(n_tokens if one_at_a_time else 1):
        a.append("s", 1 if one_at_a_time else n_tokens)
    expect_type(a.block_tables["s"], "block_tables['s']", list)
    return a
with cases("14 tokens, window 6: the first two blocks are evicted"):
    a = grown(14)
    t = a.block_tables["s"]
    assert len(t) == 4 and t[:2] == [None, None] and None not in t[2:], \
        f"after 14 tokens with a window of 6 (positions 8..13), blocks L0 (0-3) and L1 (4-7) are evicted, L2 and L3 kept: got {t}"
    assert a.n_free == 6 and sorted(a.free_blocks) == [0, 1, 4, 5, 6, 7], "the two evicted blocks are back in the free list"
with cases("what attention reads after an eviction"):
    a = grown(14)
    assert a.block_tables["s"][:2] == [None, None], "after 14 tokens with a window of 6, blocks L0 and L1 are evicted (None)"
    assert a.kept_table("s") == [2, 3] and a.kept_len("s") == 6 and a.slot("s", 13) == 3 * 4 + 1, "kept: L2 and L3"
def unevicted():               # 14 tokens appended with no eviction yet
    b = WindowAllocator(n_blocks=8, block_size=4, window=6)
    BlockAllocator.append(b, "p", 14)
    return b
with cases("evict returns the dropped blocks in logical order"):
    b = unevicted()
    dropped = expect_ints(b.evict("p"), "evict('p')", length=2)
    assert dropped == [0, 1] and b.block_tables["p"] == [None, None, 2, 3], "evict returns the dropped blocks in logical order"
with cases("evict with nothing to drop returns an empty list"):
    b = unevicted()
    expect_ints(b.evict("p"), "evict('p')", length=2)
    assert expect_ints(b.evict("p"), "evict('p') again", length=0) == [], "nothing left to drop: an empty list"
with cases("a sink keeps its whole block for good"):
    c = grown(14, sink=2, one_at_a_time=False)
    assert c.block_tables["s"] == [0, None, 2, 3], "sink 2 keeps block L0 (a whole block) for good; L1 is evicted"
    assert c.kept_len("s") == 10 and c.n_free == 5, "kept: L0 (the sink), L2, L3: 10 tokens; 5 blocks free"
with cases("a block stays while any of its tokens is in the window"):
    c = grown(14, sink=2, one_at_a_time=False)
    c.append("s", 1)                                       # 15 tokens: the window is 9..14, L2 (8..11) still holds 9, 10, 11
    assert c.block_tables["s"] == [0, None, 2, 3], "a block stays while any of its tokens is in the window"
    c.append("s", 2)                                       # 17 tokens: window 11..16, L2 still holds 11
    assert c.block_tables["s"][:3] == [0, None, 2], "at 17 tokens the window is 11..16: L2 still holds 11"
with cases("a block leaves with its last token"):
    c = grown(14, sink=2, one_at_a_time=False)
    c.append("s", 1); c.append("s", 2); c.append("s", 1)   # 18 tokens: window 12..17, L2 (8..11) is out
    assert c.block_tables["s"][:3] == [0, None, None], "at 18 tokens the window starts at 12: L2 leaves"
### BEGIN HIDDEN TESTS
import random
""" + HIDDEN_ALLOC_REF + r"""
# forks: a block the child drops stays allocated while the parent holds it
def forked_and_grown():
    a = WindowAllocator(n_blocks=10, block_size=4, window=4)
    a.append("p", 8)                                       # window 4..7: L0 already evicted
    a.fork("p", "c")
    before = list(a.block_tables["p"])
    a.append("c", 4)                                       # the child's window moves to 8..11: it drops L1
    assert a.block_tables["c"][1] is None, "at 12 tokens with a window of 4, the child drops L1"
    return a, before
with cases("a fork's eviction leaves the parent's table and blocks"):
    a, before = forked_and_grown()
    assert a.block_tables["p"] == before, "the child's eviction leaves the parent's table alone"
    shared = before[1]
    assert a.ref_count[shared] == 1 and shared not in a.free_blocks, \
        "the parent still holds the block the child dropped: one reference released, not freed"
with cases("a block dropped by a fork is freed with its last user"):
    a, before = forked_and_grown()
    shared = before[1]
    a.free("p")
    assert shared in a.free_blocks and a.ref_count[shared] == 0, "freed once its last user is gone"
    a.free("c")
    assert a.n_free == 10 and sorted(a.free_blocks) == list(range(10)), "every block free once, no double free"
# exact boundaries, with and without sinks, appends of any size; random traffic with forks and frees
for window, sink, bs, n_blocks, seed in ((4, 0, 4, 14, 1), (5, 0, 4, 14, 2), (7, 3, 4, 16, 3), (6, 8, 4, 16, 4),
                                         (1, 0, 1, 12, 5), (3, 1, 2, 14, 6), (16, 16, 8, 20, 7), (9, 2, 3, 16, 8)):
    with cases(f"random traffic with forks: window {window}, sink {sink}, blocks of {bs}"):
        _alloc_stress(window, sink, bs, n_blocks, 200, seed)
with cases("a long sequence on a tiny pool: constant memory"):
    a = WindowAllocator(n_blocks=5, block_size=4, window=8, sink=1)
    for _ in range(200):
        a.append("s", 1)
    assert a.kept_len("s") == 4 + 8 and len(a.kept_table("s")) == 3, "after 200 tokens: the sink block and the 2 blocks of the window"
### END HIDDEN TESTS
cases.score()
"""),
md(r"""
## 3. Prove it: a paged decode with a window

The engine of lab 05 reads a sequence through its block table and its length. With a window it reads
the **kept** blocks in order (`kept_table`) and their number of tokens (`kept_len`). That works
because evicted blocks are always full and lie between the sinks and the window: every kept block but
the last is full, so the kept tokens line up as one shorter sequence. Nothing else changes:
`forward_paged`, `write_kv` and `paged_attention` are lab 05's.

Below, the text goes through the model one token at a time (a decode with the true next token fed
in), with your allocator evicting as it goes. Then the same text goes through once, in one pass,
with your mask. The two must agree on every position. A full cache must not: its logits part from
the decode's once the first tokens leave the window (the top token may still agree).
"""),
code(r'''
def decode_with_window(m, ids, window, sink, block_size):
    """Logits (T, V) of feeding ids one at a time through the paged engine with a WindowAllocator,
    and the most blocks it held at once."""
    n_blocks = -(-sink // block_size) + window // block_size + 3
    alloc = WindowAllocator(n_blocks, block_size, window, sink)
    kv = PagedKVCache(m.cfg, n_blocks, block_size, dtype=next(m.parameters()).dtype, device=dev)
    rows, peak = [], 0
    for p, tok in enumerate(ids):
        slots = alloc.append("seq", 1)
        peak = max(peak, n_blocks - alloc.n_free)
        logits = forward_paged(m, torch.tensor([[tok]], device=dev), torch.tensor([[p]], device=dev), kv,
                               slot_mapping=torch.tensor(slots, device=dev),
                               block_tables=block_table_tensor([alloc.kept_table("seq")], device=dev),
                               context_lens=torch.tensor([alloc.kept_len("seq")], device=dev),
                               write_kv=write_kv, attention=paged_attention)
        rows.append(logits[0, 0].float())
    return torch.stack(rows), peak


start = time.perf_counter()
decoded, peak = decode_with_window(model, demo_ids, WINDOW_DEMO, SINK_DEMO, BS_DEMO)
seconds = time.perf_counter() - start
one_pass = forward_logits(model, demo_ids, attn_mask=window_mask(len(demo_ids), WINDOW_DEMO, SINK_DEMO, BS_DEMO, device=dev))
full = forward_logits(model, demo_ids)
print(f"{len(demo_ids)} tokens decoded one by one in {seconds:.1f} s, never more than {peak} blocks of {BS_DEMO} in use "
      f"(a full cache ends with {-(-len(demo_ids) // BS_DEMO)}, and keeps growing)")
for name, other in (("one pass with your mask", one_pass), ("one pass, full attention", full)):
    diff = (decoded - other).abs().max().item()
    same_top = (decoded.argmax(-1) == other.argmax(-1)).float().mean().item()
    print(f"  decode vs {name:<25}: max |logit difference| {diff:8.4f}, same top token at {100 * same_top:5.1f}% of positions")
'''),
md(r"""
The decode and the masked pass agree up to rounding (float32 on a CPU gives differences around 1e-4;
bf16 on a GPU more), while full attention gives other logits once the first tokens have left the window. From now on
the lab scores texts in one masked pass: the same numbers as a decode, at a fraction of the time.

## 4. Measure: where a plain window breaks, and what sinks repair

Perplexity is the exponential of the average loss per token: the number of equally likely tokens
the model is, in effect, choosing between. Lower is better. The text is the course's held-out text:
original prose written for the course, which the model has never seen. Below, the loss at every
position for full attention, a window, and the same window plus a sink block, smoothed over a
few dozen positions. The dashed line is where the first token leaves the window. With blocks of 16,
its block, and with it the first token, leaves the cache up to 15 tokens later.
"""),
code(r'''
T = env.pick(4096, 256, cpu=1024)              # tokens of the held-out text to score
BS, W, SINK = 16, env.pick(128, 32, cpu=64), 4  # blocks of 16, a window of W tokens, 4 sink tokens (one block)
ids = text_ids[:T]
start = time.perf_counter()
nll = {"full cache": token_nll(model32, ids),
       f"window {W}": token_nll(model32, ids, attn_mask=window_mask(T, W, 0, BS, device=dev)),
       f"window {W} + sinks": token_nll(model32, ids, attn_mask=window_mask(T, W, SINK, BS, device=dev))}
print(f"{T} tokens scored three ways in {time.perf_counter() - start:.1f} s")
late = W + BS                                     # positions every query of which has lost the first tokens
for name, x in nll.items():
    print(f"  {name:<22} perplexity {perplexity(x):7.2f}   after position {late}: {perplexity(x, late):7.2f}")

smooth = env.pick(64, 16, cpu=32)
plt.figure(figsize=(7, 3.2))
for name, x in nll.items():
    plt.plot(np.arange(smooth, T), rolling_mean(x, smooth).numpy(), label=name)
plt.axvline(W, color="k", ls="--", lw=1)
plt.xlabel("position in the text"); plt.ylabel(f"loss, mean over {smooth} tokens"); plt.legend(); plt.grid(alpha=0.3)
plt.tight_layout(); plt.show()
'''),
md(r"""
Read your plot. Until shortly after the dashed line the three curves are one: every query still sees
the whole text. Once the first block is gone, the plain window jumps up and stays up, and it does not recover as the text
goes on. Keep one block from the start, 16 tokens out of hundreds, and most of the loss comes back.
Those 16 tokens are only the title and the first words of the text. Why do they matter so much?

Softmax must give out a total attention of 1. When a head has nothing useful to look at, trained
models park that attention on the first tokens, which every query has always been able to see
(Xiao et al. call them **attention sinks**). Measure it: the share of attention that late queries
give to the very first token, layer by layer, with full attention. Spread evenly, a query at position
t would give it 1/(t + 1) of its attention: about 1% at position 100, less further on.
"""),
code(r'''
n_share = env.pick(512, 128, cpu=256)
share = attention_to_first(model32, text_ids[:n_share], n_first=1)
plt.figure(figsize=(7, 2.6))
plt.bar(range(len(share)), [100 * s for s in share])
plt.xlabel("layer"); plt.ylabel("% of attention on token 0"); plt.grid(alpha=0.3, axis="y"); plt.tight_layout(); plt.show()
uniform = np.mean([1 / (t + 1) for t in range(n_share // 2, n_share)])
print(f"queries at positions {n_share // 2}..{n_share - 1}: layers give token 0 on average {100 * np.mean(share):.0f}% "
      f"of their attention (up to {100 * max(share):.0f}%); an even spread would give it {100 * uniform:.2f}%")
'''),
md(r"""
A plain window evicts exactly the tokens the model uses as its resting place. Their keys are gone, the
softmax has to put that mass on recent tokens instead, and every layer's output shifts. Keeping them is
cheap and restores the model's habit. The first token is not special because of what it says:
StreamingLLM found that four line breaks at the start serve as sinks almost as well as the real first tokens.
What matters is that every query has always been able to see them.

**Memory against quality.** Now over several windows, with and without sinks. The x axis is what one
sequence's cache holds at the end of the text (bf16, blocks included); the full cache holds the whole text.
"""),
code(r'''
windows = env.pick([32, 64, 128, 256, 512, 1024], [W], cpu=[32, 64, 128, 256])
block_bytes = BS * PagedKVCache(cfg, n_blocks=1, block_size=1, dtype=torch.bfloat16, device=dev).bytes_per_token()
sweep, kept_tokens = {}, {}
for w in windows:
    for sink in (0, SINK):
        key = (w, sink)
        name = f"window {w}" + (" + sinks" if sink else "")
        x = nll[name] if name in nll else token_nll(model32, ids, attn_mask=window_mask(T, w, sink, BS, device=dev))
        kept = window_mask(T, w, sink, BS, device=dev)[-1].sum().item()   # tokens the cache holds at the end
        kept_tokens[key] = -(-kept // BS) * BS                             # in whole blocks
        sweep[key] = (kept_tokens[key] // BS * block_bytes, perplexity(x, late))
full_point = (-(-T // BS) * block_bytes, perplexity(nll["full cache"], late))

plt.figure(figsize=(6.5, 3.4))
for sink, style in ((0, "o-"), (SINK, "s-")):
    pts = [sweep[(w, sink)] for w in windows]
    plt.plot([p[0] / 2**20 for p in pts], [p[1] for p in pts], style, label="window + sinks" if sink else "window")
    for w, p in zip(windows, pts):
        plt.annotate(str(w), (p[0] / 2**20, p[1]), textcoords="offset points", xytext=(4, 4), fontsize=8)
plt.plot([full_point[0] / 2**20], [full_point[1]], "k*", ms=12, label=f"full cache ({T} tokens)")
plt.xscale("log"); plt.gca().xaxis.set_major_formatter(FormatStrFormatter("%g")); plt.gca().xaxis.set_minor_formatter(NullFormatter())
plt.xlabel("KV cache of one sequence (MiB, bf16)"); plt.ylabel(f"perplexity after position {late}")
plt.legend(); plt.grid(alpha=0.3); plt.tight_layout(); plt.show()
for w in windows:
    print(f"window {w:>5}: {sweep[(w, 0)][0] / 2**20:6.2f} MiB, perplexity {sweep[(w, 0)][1]:7.2f} | "
          f"with sinks {sweep[(w, SINK)][0] / 2**20:6.2f} MiB, perplexity {sweep[(w, SINK)][1]:7.2f} | "
          f"full cache {full_point[0] / 2**20:.2f} MiB, {full_point[1]:.2f}")
'''),
md(r"""
The sinks cost one block and move the whole curve down; the window size then trades memory for the
rest of the gap. (A wider window keeps more of the text's long-range context: names, the topic.)

**Positions.** The keys in our cache carry their true positions: RoPE was applied before they were
stored. RoPE scores depend only on the distance between query and key, so window tokens keep their
true distances, and sinks sit at their true, growing distance. That is fine while the text stays
inside the context the model was trained on (8,192 tokens for SmolLM2). StreamingLLM targets endless
streams, past any trained length: it stores keys **before** RoPE and rotates them at their position
*in the cache* (sinks 0..3, the window right after), so that no distance ever exceeds the cache size.
The price is rotating every cached key at every step; this lab does not need it.
"""),
]
