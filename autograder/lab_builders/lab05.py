"""Builds the lab 05 source notebook. Edit this file, then run from the repo root:

    .venv/bin/python -m autograder.lab_builders.lab05
"""
from autograder.authoring import code, locked, md, solution, tests, write_notebook  # noqa: E402
from autograder.lab_builders.hidden_refs import greedy_and_tiny  # noqa: E402
from autograder.lab_builders.common_cells import CHECK_YOUR_WORK, COLAB_INSTALL, SETUP  # noqa: E402

# Independent references of the hidden tests (they live only here, in the instructor's source):
# dense attention over per-sequence K/V in float64, paged inputs built by scattering dense K/V into
# shuffled blocks whose unused slots hold NaN (stale memory), and an uncached greedy loop.
HIDDEN_ATTENTION = r'''
def _dense(q, ks, vs, scale):
    # q (B, H, D); ks[b], vs[b]: (L_b, Hkv, D) -> (B, H, D), float64, no paging at all
    out = []
    for b, (k, v) in enumerate(zip(ks, vs)):
        g = q.shape[1] // k.shape[1]
        kk, vv = k.double().repeat_interleave(g, 1), v.double().repeat_interleave(g, 1)
        s = torch.einsum("hd,lhd->hl", q[b].double(), kk) * scale
        out.append(torch.einsum("hl,lhd->hd", s.softmax(-1), vv))
    return torch.stack(out)
def _paged_case(lens, H, Hkv, D, bs, dtype, seed, pad_width=0):
    # dense K/V per sequence, scattered into shuffled physical blocks; every other slot is NaN
    g = torch.Generator().manual_seed(seed)
    n_blocks = sum(-(-L // bs) for L in lens) + 2
    k_cache = torch.full((n_blocks, bs, Hkv, D), float("nan"), dtype=dtype)
    v_cache = torch.full((n_blocks, bs, Hkv, D), float("nan"), dtype=dtype)
    free = torch.randperm(n_blocks, generator=g).tolist()
    tables, ks, vs = [], [], []
    for L in lens:
        t = [free.pop() for _ in range(-(-L // bs))]
        k = torch.randn(L, Hkv, D, generator=g).to(dtype)
        v = torch.randn(L, Hkv, D, generator=g).to(dtype)
        for p in range(L):
            k_cache[t[p // bs], p % bs] = k[p]
            v_cache[t[p // bs], p % bs] = v[p]
        tables.append(t); ks.append(k); vs.append(v)
    width = max(len(t) for t in tables) + pad_width
    bt = torch.zeros(len(lens), width, dtype=torch.int32)
    for i, t in enumerate(tables):
        bt[i, :len(t)] = torch.tensor(t, dtype=torch.int32)
    q = torch.randn(len(lens), H, D, generator=g).to(dtype)
    return q, k_cache, v_cache, bt, torch.tensor(lens, dtype=torch.int32), ks, vs
'''.strip("\n")

HIDDEN_GREEDY = greedy_and_tiny(max_seq_len=64)

cells = [
md(r"""
# Lab 05: Paged attention

In lab 04 every request got a **slot**: a stretch of cache memory with room for `max_len` tokens,
reserved when the request starts. Most requests never use most of it. A chat answer may stop after
40 tokens, but its slot holds 2,048. The unused rest cannot go to anyone else, so the server runs
fewer requests at once than its memory could hold, and batching (lab 04) gains less than it could.
**Paged attention** (vLLM, 2023) borrows the fix from operating systems: cut the cache into small
fixed-size **blocks**, give a request a new block only when it needs one, and keep a **block table**
that maps its logical blocks to wherever its physical blocks happen to be. Waste drops to part of
one block per request, and requests can even share blocks. This idea is the core of vLLM, and you
will build it today, down to the GPU kernel.

**You will**
- measure how much of a contiguous cache holds tokens on a realistic workload;
- build a block allocator: a free list, block tables, the slot of every new token, reference counts, fork and copy-on-write for parallel sampling, and a clear error when blocks run out;
- store keys and values in blocks and write attention that reads them through the block table, then run the lab 04 engine on it, token for token equal to the contiguous cache;
- decide what the engine does when blocks run out: hold requests back, and preempt and recompute;
- watch the blocks on a widget, and measure memory waste, requests that fit, and throughput;
- write the paged decode kernel in Triton: a warm-up kernel, then two versions of paged attention, checked against your PyTorch reference.

**Time:** about 2 hours. **Hardware:** everything runs on a laptop CPU. There, Triton kernels run in
Triton's *interpreter* (NumPy on the CPU): correct, and slow. On a GPU they are compiled, and the
last section times them.
"""),
locked("colab_install", COLAB_INSTALL),
locked("setup", SETUP),
md(r"""
## 1. How much of a contiguous cache holds tokens?

Take the cache of lab 04 at its most common setting: each running request reserves `max_len` slots
(here 2,048, a common context limit). At any moment a slot has three parts:

```
 one request's slot: max_len = 2048 token slots, reserved when it starts
 [ tokens so far ][ reserved for tokens it will still write ][ never used: it stops before max_len ]
   used             reserved                                   internal fragmentation
```

Only the first part holds anything. The second is reserved ahead of time. The third is never used:
the server cannot know when a request will stop, so it has to plan for the worst case. (Engines that
reserve a different length per request also suffer *external* fragmentation: free gaps between
slots too small for the next request.)

To measure it we need a workload. Real chat traffic has prompts and answers of a few hundred tokens
with a long tail. The lengths below are drawn to look like that; they are made up, not a real trace.
A small simulation then runs them through continuous batching (sizes only, no model: one token per
running request per step) and adds up the three parts at every step.
"""),
code(r'''
import math
import time
from collections import deque
from dataclasses import dataclass, field

import matplotlib.pyplot as plt
import numpy as np
import torch

MAX_LEN = 2048
n_requests, max_batch = env.pick((512, 64), (64, 16), cpu=(256, 32))
rng = np.random.default_rng(0)
prompt_lens = np.clip(rng.lognormal(5.0, 0.9, n_requests), 4, 1024).astype(int).tolist()   # median ~150 tokens
output_lens = np.clip(rng.lognormal(5.2, 1.0, n_requests), 1, 1024).astype(int).tolist()   # median ~180 tokens
print(f"{n_requests} requests; prompt tokens: median {np.median(prompt_lens):.0f}, max {max(prompt_lens)}; "
      f"output tokens: median {np.median(output_lens):.0f}, max {max(output_lens)}")


def simulate(prompt_lens, output_lens, max_batch, on_step):
    """Continuous batching over sizes only. Each step: waiting requests join while there is room,
    each running request writes one more token, finished ones leave. `on_step(events)` sees every
    step's events: ("join", rid, n_tokens), ("grow", rid, 1) and ("leave", rid, 0), and the running
    requests' current and final lengths."""
    waiting, running, step = deque(range(len(prompt_lens))), {}, 0
    while waiting or running:
        events = []
        for rid in running:
            running[rid] += 1
            events.append(("grow", rid, 1))
        while waiting and len(running) < max_batch:
            rid = waiting.popleft()
            running[rid] = prompt_lens[rid]
            events.append(("join", rid, prompt_lens[rid]))
        state = {rid: (n, prompt_lens[rid] + output_lens[rid]) for rid, n in running.items()}
        on_step(events, state)
        for rid, (n, final) in state.items():
            if n >= final:
                del running[rid]
        step += 1
    return step


contiguous = {"used": 0, "reserved": 0, "never used": 0}
def count_contiguous(events, state):
    for n, final in state.values():
        contiguous["used"] += n
        contiguous["reserved"] += final - n
        contiguous["never used"] += MAX_LEN - final

steps = simulate(prompt_lens, output_lens, max_batch, count_contiguous)
total = sum(contiguous.values())
for part, slots in contiguous.items():
    print(f"{part:>11}: {100 * slots / total:5.1f}% of the reserved slot-steps")
print(f"{steps} steps; on average {100 * contiguous['used'] / total:.1f}% of the contiguous cache holds a token")
'''),
md(r"""
Those are your numbers: averaged over the run, the share of the reserved memory that holds a token.
The vLLM paper measured 20-38% for the serving systems of its day. A slot with a tight `max_len`
would waste less, but then a long answer gets cut off.

## 2. Blocks and block tables

Paging cuts the cache into **blocks** of `block_size` token slots (vLLM's default is 16). The pool of
blocks is shared by all requests. Each request owns a list of blocks, its **block table**: entry `i`
says which physical block holds its tokens `i * block_size` to `(i + 1) * block_size - 1`. The blocks
need not be next to each other or in order. A request gets a new block only when its last one is
full, so at most `block_size - 1` slots per request are empty.

```
request A: "Four score and seven years ago our fathers brought"      block_size = 4
  logical block 0: Four | score | and | seven      -> physical block 7
  logical block 1: years | ago | our | fathers     -> physical block 1
  logical block 2: brought | · | · | ·             -> physical block 3    (3 free slots: the only waste)

physical pool:  0: free   1: A[1]   2: free   3: A[2]   4: free   5: free   6: free   7: A[0]
```

Every token lives in one **slot** of the pool, numbered `block * block_size + offset`. The slot of
token position `p` of a request is `table[p // block_size] * block_size + p % block_size`. An engine
computes the slots of all new tokens before a forward pass (the *slot mapping*); the model writes each
new key and value into its slot, and attention finds them through the block table.

## Problem 1: The block allocator (4 points)

The allocator owns the pool's bookkeeping (the keys and values themselves live in a tensor, next
section). Its state, set up for you in `__init__`:

- `free_blocks`: the ids of the free blocks, a deque. Take new blocks from the **front**, return freed
  blocks to the **back**.
- `ref_count[b]`: how many sequences use block `b` (0 for a free block, 1 for now; Problem 2 shares blocks).
- `block_tables[seq]`: the blocks of sequence `seq`, in logical order; `lengths[seq]`: its tokens.

**Deliverable:**
- `blocks_for(n_tokens)`: the blocks that hold `n_tokens` tokens (0 for 0 tokens).
- `new_blocks_needed(seq, n)`: the blocks `seq` must add to grow by `n` tokens (a new sequence starts empty).
- `append(seq, n)`: grow `seq` (new or existing) by `n` tokens and return the slot of each new token, in
  order. Allocate blocks only when the last one is full. If there are not enough free blocks, raise
  `OutOfBlocks` with a message that says how many are needed and how many are free, and change nothing.
- `free(seq)`: give back the blocks of `seq` (decrement each block's count; a block whose count reaches
  0 goes back to the free list) and forget `seq`. An unknown `seq` raises `KeyError`.
"""),
solution("block_allocator", r'''
class OutOfBlocks(RuntimeError):
    """The pool has fewer free blocks than a request needs."""


class BlockAllocator:
    """Fixed-size blocks from a free list; one block table and one length per sequence."""

    def __init__(self, n_blocks: int, block_size: int):
        if n_blocks < 1 or block_size < 1:
            raise ValueError(f"n_blocks and block_size must be >= 1, got {n_blocks} and {block_size}")
        self.n_blocks, self.block_size = n_blocks, block_size
        self.free_blocks: deque[int] = deque(range(n_blocks))
        self.ref_count: list[int] = [0] * n_blocks
        self.block_tables: dict[int, list[int]] = {}
        self.lengths: dict[int, int] = {}
        self.pending_copies: list[tuple[int, int]] = []   # Problem 2: (from block, to block) to copy

    @property
    def n_free(self) -> int:
        return len(self.free_blocks)

    def blocks_for(self, n_tokens: int) -> int:
        """Blocks that hold n_tokens tokens."""
        ### BEGIN SOLUTION
        return -(-n_tokens // self.block_size)
        ### END SOLUTION

    def new_blocks_needed(self, seq: int, n: int) -> int:
        """Blocks that sequence `seq` must add to grow by n tokens."""
        ### BEGIN SOLUTION
        length = self.lengths.get(seq, 0)
        return self.blocks_for(length + n) - self.blocks_for(length)
        ### END SOLUTION

    def append(self, seq: int, n: int) -> list[int]:
        """Room for n more tokens of `seq`: their slots, in order. Raises OutOfBlocks, changing nothing."""
        if n < 1:
            raise ValueError(f"n must be at least 1 new token, got {n}")
        ### BEGIN SOLUTION
        need = self.new_blocks_needed(seq, n)
        if need > self.n_free:
            raise OutOfBlocks(f"sequence {seq} needs {need} more blocks for {n} tokens, but only {self.n_free} are free")
        table = self.block_tables.setdefault(seq, [])
        length = self.lengths.get(seq, 0)
        for _ in range(need):
            block = self.free_blocks.popleft()
            self.ref_count[block] = 1
            table.append(block)
        self.lengths[seq] = length + n
        return [table[p // self.block_size] * self.block_size + p % self.block_size for p in range(length, length + n)]
        ### END SOLUTION

    def free(self, seq: int) -> None:
        """Give back the blocks of `seq`: a block is free again when no sequence uses it."""
        ### BEGIN SOLUTION
        if seq not in self.block_tables:
            raise KeyError(f"sequence {seq} holds no blocks")
        for block in self.block_tables.pop(seq):
            self.ref_count[block] -= 1
            if self.ref_count[block] == 0:
                self.free_blocks.append(block)
        del self.lengths[seq]
        ### END SOLUTION
'''),
code(r"""
alloc = BlockAllocator(n_blocks=8, block_size=4)
print("A, 10 tokens ->", alloc.append("A", 10), "table", alloc.block_tables["A"])
print("B,  3 tokens ->", alloc.append("B", 3), "table", alloc.block_tables["B"])
print("A, +3 tokens ->", alloc.append("A", 3), "table", alloc.block_tables["A"])
print("free blocks:", list(alloc.free_blocks))
try:
    alloc.append("C", 20)
except OutOfBlocks as e:
    print("OutOfBlocks:", e)
"""),
tests("allocator_tests", 4, r"""
a = BlockAllocator(n_blocks=4, block_size=4)
assert a.blocks_for(0) == 0 and a.blocks_for(1) == 1 and a.blocks_for(4) == 1 and a.blocks_for(5) == 2, \
    "blocks_for(n) rounds up: 4 tokens fill one block of 4, the 5th needs a second"
assert a.append(0, 3) == [0, 1, 2] and a.block_tables[0] == [0], "sequence 0 takes block 0 (the front of the free list)"
assert a.append(1, 5) == [4, 5, 6, 7, 8] and a.block_tables[1] == [1, 2], "5 tokens: block 1 full, one token in block 2"
assert a.append(0, 2) == [3, 12], "slot 3 finishes block 0; the next token starts a new block (3), at offset 0"
assert a.n_free == 0 and a.lengths == {0: 5, 1: 5}
assert a.ref_count == [1, 1, 1, 1], "every used block has one user"
try:
    a.append(1, 4)
except OutOfBlocks:
    pass
else:
    raise AssertionError("sequence 1 needs a 4th block for 4 more tokens and none is free: raise OutOfBlocks")
assert a.lengths[1] == 5 and a.block_tables[1] == [1, 2], "a failed append must change nothing"
a.free(0)
assert sorted(a.free_blocks) == [0, 3] and a.ref_count[0] == a.ref_count[3] == 0, "freed blocks go back to the free list"
assert 0 not in a.block_tables and 0 not in a.lengths, "free() forgets the sequence"
### BEGIN HIDDEN TESTS
import random
# exact block multiples and boundaries, one token at a time
a = BlockAllocator(n_blocks=6, block_size=3)
got = [a.append("s", 1)[0] for _ in range(9)]
assert got == list(range(9)), f"one token at a time in blocks 0, 1, 2: expected slots 0..8, got {got}"
assert a.block_tables["s"] == [0, 1, 2] and a.new_blocks_needed("s", 3) == 1 and a.new_blocks_needed("s", 4) == 2
assert a.new_blocks_needed("new", 3) == 1 and a.new_blocks_needed("new", 7) == 3
assert a.append("t", 3) == [9, 10, 11] and a.block_tables["t"] == [3], "exactly one block for block_size tokens"
assert a.append("t", 1) == [12], "the token after a full block starts the next block at offset 0"
a.free("t")
assert list(a.free_blocks) == [5, 3, 4], "freed blocks go to the BACK of the free list, in table order"
try:
    a.free("t")
except KeyError:
    pass
else:
    raise AssertionError("freeing an unknown sequence must raise KeyError")
# the message says what was needed and what is free
a = BlockAllocator(n_blocks=3, block_size=2)
a.append(0, 3)
try:
    a.append(1, 5)
except OutOfBlocks as e:
    assert "3" in str(e) and "1" in str(e), f"the message must name the blocks needed (3) and free (1): {e}"
else:
    raise AssertionError("5 tokens need 3 blocks, 1 is free")
assert 1 not in a.block_tables and a.n_free == 1, "a failed append must not leave an empty table or take blocks"
# a long random run against an independent model of the pool: every token's slot holds that token
for bs in (1, 2, 4, 5):
    rng = random.Random(bs)
    a = BlockAllocator(n_blocks=40, block_size=bs)
    pool, want = {}, {}
    for step in range(300):
        seq = rng.randrange(8)
        if seq in want and rng.random() < 0.2:
            a.free(seq)
            del want[seq]
            continue
        n = rng.randint(1, 7)
        if a.new_blocks_needed(seq, n) > a.n_free:
            try:
                a.append(seq, n)
            except OutOfBlocks:
                continue
            raise AssertionError("append succeeded with too few free blocks")
        before = list(a.block_tables.get(seq, []))
        slots = a.append(seq, n)
        assert a.block_tables[seq][:len(before)] == before, "append must never move earlier blocks"
        toks = [(seq, step, i) for i in range(n)]
        for s, t in zip(slots, toks):
            pool[s] = t
        want.setdefault(seq, []).extend(toks)
        for s2, toks2 in want.items():
            tab = a.block_tables[s2]
            assert len(tab) == -(-len(toks2) // bs), f"block_size {bs}: a sequence holds exactly the blocks it needs"
            read = [pool.get(tab[p // bs] * bs + p % bs) for p in range(len(toks2))]
            assert read == toks2, f"block_size {bs}: a token's slot was overwritten or misplaced (check the slot at block boundaries)"
        used = [b for t in a.block_tables.values() for b in t]
        assert len(used) == len(set(used)), "two sequences share a block without fork"
        assert sorted(used + list(a.free_blocks)) == list(range(40)), "every block is either used or free, once"
        assert all(a.ref_count[b] == (b in used) for b in range(40)), "ref_count: 1 for a used block, 0 for a free one"
    for seq in list(want):
        a.free(seq)
    assert a.n_free == 40 and not any(a.ref_count) and not a.block_tables, "after freeing everything, every block is free"
### END HIDDEN TESTS
"""),
md(r"""
## Problem 2: Sharing blocks: fork and copy-on-write (3 points)

A request that asks for several answers to one prompt (*parallel sampling*, `n > 1` in the OpenAI API)
has several sequences with the same prompt. Storing that prompt's keys and values once per answer
wastes memory and time. Instead, the first sequence is **forked**: the child gets a copy of the
parent's block *table*, and each block's reference count goes up by one. Both now read the same
physical blocks.

They differ from the first new token on. A full shared block never changes, so sharing it is safe.
The last block may be only partly full, and both sequences want to write their own next token into
it. So, before a sequence writes into a shared block, it gets a block of its own: **copy-on-write**.
The allocator takes a free block, puts it in place of the shared one in that sequence's table,
decrements the old block's count, and records the pair `(old, new)` in `pending_copies`, so that the
engine copies the old block's keys and values into the new one before the forward pass writes.

```
after fork:     seq 0: [7, 1, 3]   seq 1: [7, 1, 3]      ref counts: 7 -> 2, 1 -> 2, 3 -> 2
seq 1 appends:  block 3 is shared and partly full -> copy it into free block 5
                seq 0: [7, 1, 3]   seq 1: [7, 1, 5]      ref counts: 3 -> 1, 5 -> 1; pending_copies [(3, 5)]
seq 0 appends:  block 3 is its own now: write in place, no copy
```

**Deliverable:** `SharedBlockAllocator`, a `BlockAllocator` with
- `fork(parent, child)`: `child` gets the parent's blocks and length; each of those blocks' counts goes up by one;
- `append(seq, n)`: when the block that the next token goes into is shared (its count is above 1), copy
  on write as above, then append as before. Raise `OutOfBlocks` and change nothing when the copy and
  the new blocks do not all fit.

`free` needs no change if you wrote it with reference counts.
"""),
solution("shared_allocator", r'''
class SharedBlockAllocator(BlockAllocator):
    """A BlockAllocator whose sequences can share blocks: fork, and copy-on-write before a write."""

    def fork(self, parent: int, child: int) -> None:
        """`child` starts as a copy of `parent`, sharing every block."""
        if parent not in self.block_tables:
            raise KeyError(f"sequence {parent} holds no blocks: nothing to fork")
        if child in self.block_tables:
            raise ValueError(f"sequence {child} already exists")
        ### BEGIN SOLUTION
        self.block_tables[child] = list(self.block_tables[parent])
        self.lengths[child] = self.lengths[parent]
        for block in self.block_tables[child]:
            self.ref_count[block] += 1
        ### END SOLUTION

    def append(self, seq: int, n: int) -> list[int]:
        """Like BlockAllocator.append, after copying a shared, partly full last block."""
        ### BEGIN SOLUTION
        table, length = self.block_tables.get(seq), self.lengths.get(seq, 0)
        if table and length % self.block_size and self.ref_count[table[-1]] > 1:
            need = self.new_blocks_needed(seq, n) + 1
            if need > self.n_free:
                raise OutOfBlocks(f"sequence {seq} needs {need} blocks (a copy of its shared last block and "
                                  f"{need - 1} more), but only {self.n_free} are free")
            old, new = table[-1], self.free_blocks.popleft()
            self.ref_count[old] -= 1
            self.ref_count[new] = 1
            table[-1] = new
            self.pending_copies.append((old, new))
        ### END SOLUTION
        return super().append(seq, n)
'''),
tests("shared_allocator_tests", 3, r"""
a = SharedBlockAllocator(n_blocks=6, block_size=4)
a.append(0, 6)                                            # a prompt of 6 tokens: blocks [0, 1]
a.fork(0, 1)
assert a.block_tables[1] == [0, 1] and a.lengths[1] == 6, "a fork copies the table and the length"
assert a.ref_count[:2] == [2, 2], "after a fork, both blocks have two users"
assert a.append(1, 1) == [2 * 4 + 2], "block 1 is shared and partly full: sequence 1 copies it into free block 2"
assert a.block_tables[1] == [0, 2] and a.pending_copies == [(1, 2)], "the copy (old, new) is recorded for the engine"
assert a.ref_count[:3] == [2, 1, 1]
assert a.append(0, 1) == [1 * 4 + 2] and a.pending_copies == [(1, 2)], "block 1 is sequence 0's alone now: no copy"
a.free(0)
assert a.ref_count[:3] == [1, 0, 1] and a.block_tables[1] == [0, 2], "freeing the parent keeps the blocks the child uses"
a.free(1)
assert a.n_free == 6 and not any(a.ref_count), "when both are freed, every block is free"
### BEGIN HIDDEN TESTS
import random
# a full shared block needs no copy: the next token goes into a new block
a = SharedBlockAllocator(n_blocks=5, block_size=2)
a.append("p", 4)
a.fork("p", "c")
assert a.append("c", 1) == [4] and a.pending_copies == [], "the last block is full: no copy, just a new block"
assert a.block_tables["c"] == [0, 1, 2] and a.ref_count[:3] == [2, 2, 1]
# forks of forks, and frees in any order
a.fork("c", "g")
assert a.ref_count[:3] == [3, 3, 2]
a.free("c")
assert a.ref_count[:3] == [2, 2, 1] and a.n_free == 2
a.free("p"); a.free("g")
assert a.n_free == 5 and not any(a.ref_count), "reference counts must return to 0"
# copy-on-write with no free block: OutOfBlocks, nothing changed
a = SharedBlockAllocator(n_blocks=2, block_size=4)
a.append(0, 3); a.fork(0, 1); a.append(2, 4)
try:
    a.append(1, 1)
except OutOfBlocks:
    pass
else:
    raise AssertionError("copy-on-write needs a free block and none is left: OutOfBlocks")
assert a.block_tables[1] == [0] and a.ref_count[0] == 2 and a.pending_copies == [] and a.lengths[1] == 3
try:
    a.fork(0, 1)
except ValueError:
    pass
else:
    raise AssertionError("forking onto an existing sequence must raise ValueError")
# random forks, appends and frees, checked against an independent pool that applies the copies
for bs in (1, 3, 4):
    rng = random.Random(10 + bs)
    a = SharedBlockAllocator(n_blocks=30, block_size=bs)
    pool, want, next_id = {}, {}, 0
    for step in range(400):
        r = rng.random()
        if want and r < 0.15:
            parent = rng.choice(sorted(want))
            a.fork(parent, next_id)
            want[next_id] = list(want[parent])
            next_id += 1
        elif want and r < 0.3:
            seq = rng.choice(sorted(want))
            a.free(seq)
            del want[seq]
        else:
            seq = rng.choice(sorted(want)) if want and r < 0.85 else next_id
            next_id += seq == next_id
            n = rng.randint(1, 5)
            try:
                slots = a.append(seq, n)
            except OutOfBlocks:
                continue
            for old, new in a.pending_copies:
                for o in range(bs):
                    pool[new * bs + o] = pool.get(old * bs + o)
            a.pending_copies.clear()
            toks = [(seq, step, i) for i in range(n)]
            for s, t in zip(slots, toks):
                pool[s] = t
            want.setdefault(seq, []).extend(toks)
        users = {}
        for seq, tab in a.block_tables.items():
            for b in tab:
                users[b] = users.get(b, 0) + 1
        assert all(a.ref_count[b] == users.get(b, 0) for b in range(30)), \
            f"block_size {bs}: ref_count must equal the number of tables holding each block"
        assert sorted(list(users) + list(a.free_blocks)) == list(range(30)), "a block is either used or free, once"
        for seq, toks in want.items():
            tab = a.block_tables[seq]
            read = [pool.get(tab[p // bs] * bs + p % bs) for p in range(len(toks))]
            assert read == toks, f"block_size {bs}: sequence {seq} reads another sequence's token (copy-on-write missed)"
    for seq in list(want):
        a.free(seq)
    assert a.n_free == 30 and not any(a.ref_count), "reference counts leak: blocks stay used after every sequence is freed"
### END HIDDEN TESTS
"""),
md(r"""
## 3. Keys and values in blocks

The pool itself is a tensor per layer, given in `course.engine` (`PagedKVCache`):

```
k_cache, v_cache: (n_blocks, block_size, n_kv_head, head_dim)     one layer
```

Seen as `(n_blocks * block_size, n_kv_head, head_dim)`, the first index is exactly the slot. So
writing the new tokens' keys is one indexed assignment, and a sequence's keys are found by gathering
its blocks (in table order) and keeping its first `context_len` rows.

`forward_paged(model, input_ids, position_ids, cache, slot_mapping, block_tables, context_lens,
write_kv=..., attention=...)` runs our decoder over the pool and calls two functions you write now.
A **prefill** call `(1, T)` writes a whole prompt and attends over it as usual (nothing else is
cached yet). A **decode** call `(B, 1)` writes one token per sequence, then calls your `attention`
with one query per sequence.

## Problem 3: Paged storage and reference attention (4 points)

**Deliverable:**
- `write_kv(k_cache, v_cache, k, v, slot_mapping)`: store `k[i]` and `v[i]` (each `(N, Hkv, D)`) in slot
  `slot_mapping[i]`, in place. A negative slot means "no slot" (a padding token): skip it.
- `paged_attention_ref(q, k_cache, v_cache, block_tables, context_lens, scale)`: for each sequence `b`,
  gather its first `context_lens[b]` keys and values through `block_tables[b]` (a row of block ids,
  padded at the end), then return softmax attention of `q[b]` `(H, D)` over them, `(B, H, D)` in the
  dtype of `q`. Query head `h` reads key/value head `h // (H // Hkv)` (GQA, as in lab 03). Compute in
  float32. This is the reference the Triton kernels will be checked against: clear beats fast.
"""),
solution("paged_storage", r'''
def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """k_cache, v_cache: (n_blocks, block_size, Hkv, D); k, v: (N, Hkv, D); slot_mapping: (N,), -1 = skip."""
    ### BEGIN SOLUTION
    n_blocks, block_size, Hkv, D = k_cache.shape
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    k_cache.view(n_blocks * block_size, Hkv, D)[slots] = k[keep]
    v_cache.view(n_blocks * block_size, Hkv, D)[slots] = v[keep]
    ### END SOLUTION


def paged_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                        context_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """q: (B, H, D); block_tables: (B, max_blocks); context_lens: (B,). Returns (B, H, D)."""
    ### BEGIN SOLUTION
    B, H, D = q.shape
    _, block_size, Hkv, _ = k_cache.shape
    out = torch.empty_like(q)
    for b in range(B):
        L = int(context_lens[b])
        blocks = block_tables[b, :-(-L // block_size)].long()
        k = k_cache[blocks].reshape(-1, Hkv, D)[:L].float()             # (L, Hkv, D)
        v = v_cache[blocks].reshape(-1, Hkv, D)[:L].float()
        k = k.repeat_interleave(H // Hkv, dim=1)                        # (L, H, D)
        v = v.repeat_interleave(H // Hkv, dim=1)
        scores = torch.einsum("hd,lhd->hl", q[b].float(), k) * scale    # (H, L)
        out[b] = torch.einsum("hl,lhd->hd", scores.softmax(dim=-1), v).to(q.dtype)
    return out
    ### END SOLUTION
'''),
md(r"""
Check it on the real model: prefill a prompt into the paged pool, then decode a few tokens, and
compare every step's logits with lab 04's contiguous cache (`SlotKVCache` and `forward_cached`).
The prompt's blocks come from your allocator.
"""),
code(r"""
from course.engine import PagedKVCache, SlotKVCache, block_table_tensor, forward_cached, forward_paged

tokenizer = course.load_tokenizer()
model = course.load_model(device=env.device)
dev, cfg = env.device, model.cfg
print(f"SmolLM2: {cfg.n_layer} layers, {cfg.n_head} query heads, {cfg.n_kv_head} KV heads, head_dim {cfg.head_dim}")


def compare_with_contiguous(prompt, n_steps, block_size=4, n_blocks=16):
    '''Largest logit difference between the paged and the contiguous cache, prefill then n_steps decodes.'''
    alloc = BlockAllocator(n_blocks, block_size)
    paged = PagedKVCache(cfg, n_blocks, block_size, device=dev)
    slot = SlotKVCache(cfg, n_slots=1, max_len=len(prompt) + n_steps, device=dev)
    ids, pos = torch.tensor([prompt], device=dev), torch.arange(len(prompt), device=dev)[None]
    fns = dict(write_kv=write_kv, attention=paged_attention_ref)
    lp = forward_paged(model, ids, pos, paged, torch.tensor(alloc.append(0, len(prompt)), device=dev), None, None, **fns)
    lc = forward_cached(model, ids, pos, slot, torch.tensor([0], device=dev))
    worst, tokens = (lp[0, -1] - lc[0, -1]).abs().max().item(), []
    for _ in range(n_steps):
        tok = int(lc[0, -1].argmax())
        tokens.append(tok)
        ids, pos = torch.tensor([[tok]], device=dev), torch.tensor([[len(prompt) + len(tokens) - 1]], device=dev)
        slots = torch.tensor(alloc.append(0, 1), device=dev)
        lp = forward_paged(model, ids, pos, paged, slots, block_table_tensor([alloc.block_tables[0]], dev),
                           torch.tensor([alloc.lengths[0]], device=dev), **fns)
        lc = forward_cached(model, ids, pos, slot, torch.tensor([0], device=dev))
        worst = max(worst, (lp[0, -1] - lc[0, -1]).abs().max().item())
    return worst, tokens, alloc.block_tables[0]

worst, tokens, table = compare_with_contiguous(tokenizer("The capital of France is").input_ids, n_steps=5)
print(f"generated {tokenizer.decode(tokens)!r} in blocks {table}; largest logit difference {worst:.1e}")
"""),
tests("paged_storage_tests", 4, r"""
kc, vc = torch.zeros(3, 2, 1, 4), torch.zeros(3, 2, 1, 4)            # 3 blocks of 2 slots, 1 KV head, D = 4
k, v = torch.arange(12.).view(3, 1, 4), -torch.arange(12.).view(3, 1, 4)
write_kv(kc, vc, k, v, torch.tensor([5, 0, -1]))
assert torch.equal(kc[2, 1, 0], k[0, 0]) and torch.equal(vc[0, 0, 0], v[1, 0]), "slot 5 is block 2, offset 1; slot 0 is block 0, offset 0"
assert kc.abs().sum() == k[:2].abs().sum(), "a slot of -1 is skipped: nothing else may change"
q = torch.randn(1, 2, 4)
out = paged_attention_ref(q, kc, vc, torch.tensor([[2, 0]], dtype=torch.int32), torch.tensor([4], dtype=torch.int32), 0.5)
assert out.shape == (1, 2, 4), "one output row per query head: (B, H, D)"
kk = torch.stack([kc[2, 0], kc[2, 1], kc[0, 0], kc[0, 1]])[:, 0]      # the sequence's 4 keys, in order
vv = torch.stack([vc[2, 0], vc[2, 1], vc[0, 0], vc[0, 1]])[:, 0]
expect = torch.softmax(q[0] @ kk.T * 0.5, dim=-1) @ vv                # both query heads read KV head 0
assert torch.allclose(out[0], expect, atol=1e-5), "attention over the sequence's tokens, gathered through its block table"
assert worst < 1e-3, f"paged and contiguous caches must give the same logits, largest difference {worst:.1e}"
### BEGIN HIDDEN TESTS
""" + HIDDEN_ATTENTION + r"""
for H, Hkv, bs, dtype in ((4, 4, 4, torch.float32), (6, 2, 8, torch.float32), (4, 1, 2, torch.float32),
                          (9, 3, 16, torch.float16), (4, 2, 1, torch.float32)):
    lens = [1, bs, 2 * bs + 1, 3 * bs, 5]
    q, kcache, vcache, bt, cl, ks, vs = _paged_case(lens, H, Hkv, 8, bs, dtype, seed=H * bs, pad_width=2)
    out = paged_attention_ref(q, kcache, vcache, bt, cl, 0.3)
    assert out.dtype == dtype and out.shape == q.shape, "the output has q's shape and dtype"
    err = (out.double() - _dense(q, ks, vs, 0.3)).abs().max().item()
    tol = 1e-4 if dtype == torch.float32 else 4e-3
    assert err < tol, f"H={H}, Hkv={Hkv}, block_size={bs}, {dtype}: max |diff| {err:.1e} against dense attention " \
                      "(stale slots past context_len hold NaN: read only the sequence's tokens; GQA: head h reads h // group)"
# write_kv at block boundaries, fp16, several layers' worth of calls
kc, vc = torch.full((4, 3, 2, 2), -7.0, dtype=torch.float16), torch.full((4, 3, 2, 2), -7.0, dtype=torch.float16)
k = torch.randn(6, 2, 2).half(); v = torch.randn(6, 2, 2).half()
slots = torch.tensor([2, 3, 11, -1, 9, 0])
write_kv(kc, vc, k, v, slots)
flat_k, flat_v = kc.view(12, 2, 2), vc.view(12, 2, 2)
for i, s in enumerate(slots.tolist()):
    if s >= 0:
        assert torch.equal(flat_k[s], k[i]) and torch.equal(flat_v[s], v[i]), f"token {i} must land in slot {s}"
untouched = [s for s in range(12) if s not in slots.tolist()]
assert (flat_k[untouched] == -7).all() and (flat_v[untouched] == -7).all(), "write_kv wrote outside the given slots"
# the real model, longer, several block sizes
for bs in (1, 16):
    w, _, _ = compare_with_contiguous(tokenizer("My trip to Yosemite was").input_ids, n_steps=3, block_size=bs, n_blocks=40)
    assert w < 1e-3, f"block_size {bs}: paged logits differ from the contiguous cache by {w:.1e}"
### END HIDDEN TESTS
"""),
md(r"""
## 4. The engine, and what it does when blocks run out

Now the lab 04 engine on the paged cache. Memory changes the scheduler's job: a contiguous engine
knows at admission that a request fits for its whole life (its slot is reserved). A paged engine
hands out blocks as requests grow, so it can run out in the middle of a run. Two answers, both in vLLM:

- **Hold back** at admission: admit the oldest waiting request only if its prompt's blocks are free.
  If it does not fit, nobody behind it is admitted either (first come, first served: otherwise a long
  prompt could wait forever behind a stream of short ones).
- **Preempt** while decoding: every running request needs a slot for its newest token at every step.
  When no block is free, evict the **newest** running request: free all its blocks and put it back at
  the **front** of the waiting queue. It keeps the tokens it generated; when it is admitted again, one
  prefill over prompt + output so far rebuilds its cache (**recompute**) and gives its next token.
  (vLLM can also *swap* the blocks out to CPU memory instead; recomputing is its default.)

The newest request goes first because it has the least work to redo, and because the oldest
request then always makes progress, so the engine cannot go round in circles.

Requests and the queues (given, like lab 04's):
"""),
locked("requests", r'''
@dataclass(eq=False)  # eq=False: two requests are the same only if they are the same object
class Request:
    rid: int                              # request id; also its sequence id in the allocator
    prompt: list[int]
    max_new_tokens: int
    arrival: int = 0                      # the engine step at which it arrives
    output: list[int] = field(default_factory=list)   # the new tokens so far
    preemptions: int = 0                  # how many times it was evicted

    def __post_init__(self):
        if not self.prompt or self.max_new_tokens < 1:
            raise ValueError(f"request {self.rid}: needs a non-empty prompt and max_new_tokens >= 1")


class Queues:
    """waiting (arrival order, preempted requests back at the front), running (oldest first), finished."""

    def __init__(self, requests: list[Request], max_batch_size: int):
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        self.waiting: deque[Request] = deque(sorted(requests, key=lambda r: r.arrival))
        self.running: list[Request] = []
        self.finished: list[Request] = []
        self.max_batch_size = max_batch_size

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)
'''),
md(r"""
## Problem 4: Hold back and preempt (3 points)

**Deliverable:**
- `admit(queues, alloc, step)`: while the batch has room (`len(running) < max_batch_size`) and the
  oldest waiting request has arrived (`arrival <= step`): if its tokens (prompt **and** any output it
  already has) fit in the free blocks, move it to the end of `running` and reserve their slots with
  `alloc.append(r.rid, n)`; otherwise stop. Return `[(request, slots), ...]` for the admitted requests.
- `reserve_decode(queues, alloc)`: for every running request, oldest first, reserve the slot of its
  newest token (`alloc.append(r.rid, 1)`). On `OutOfBlocks`, preempt the newest running request (remove
  it from `running`, free its blocks, increment its `preemptions`, put it at the front of `waiting`)
  and try again; if the request being served was itself the newest, it is the one preempted. Return
  `(decoding, preempted)`: `[(request, slot), ...]` for the requests that got a slot, in order, and the
  list of preempted requests.
"""),
solution("block_policy", r'''
def admit(queues: Queues, alloc: BlockAllocator, step: int) -> list[tuple[Request, list[int]]]:
    """Arrived requests, oldest first, while the batch has room and their tokens fit in free blocks."""
    ### BEGIN SOLUTION
    admitted = []
    while queues.waiting and len(queues.running) < queues.max_batch_size and queues.waiting[0].arrival <= step:
        r = queues.waiting[0]
        n = len(r.prompt) + len(r.output)
        if alloc.blocks_for(n) > alloc.n_free:
            break                                  # hold back: nobody overtakes the oldest request
        queues.waiting.popleft()
        queues.running.append(r)
        admitted.append((r, alloc.append(r.rid, n)))
    return admitted
    ### END SOLUTION


def reserve_decode(queues: Queues, alloc: BlockAllocator) -> tuple[list[tuple[Request, int]], list[Request]]:
    """A slot for every running request's newest token; when blocks run out, preempt the newest request."""
    ### BEGIN SOLUTION
    decoding, preempted = [], []
    i = 0
    while i < len(queues.running):
        r = queues.running[i]
        try:
            slot = alloc.append(r.rid, 1)[0]
        except OutOfBlocks:
            victim = queues.running.pop()           # the newest; may be r itself
            alloc.free(victim.rid)
            victim.preemptions += 1
            queues.waiting.appendleft(victim)
            preempted.append(victim)
            continue
        decoding.append((r, slot))
        i += 1
    return decoding, preempted
    ### END SOLUTION
'''),
md(r"""
The engine loop uses your pieces (given). One step: reserve decode slots (preempting if needed);
admit newcomers unless someone was just preempted (the pool is full: do not make it worse); copy
any copy-on-write blocks; prefill each newcomer (its first token, or its next one after a recompute);
decode all the others in one forward pass; retire finished requests and free their blocks. It
records a snapshot of every block table for the widget. `contiguous_generate` is lab 04's engine on
the slot cache, for comparison: the same schedule, with `max_len` slots reserved per request.
"""),
locked("engines", r'''
from course.timing import clock


@dataclass
class Run:
    outputs: list[list[int]]          # new tokens per request, in the order the requests were given
    times: list[float]                # seconds from the start to the end of each step
    used: list[int]                   # token slots holding a token, after each step
    reserved: list[int]               # token slots reserved, after each step
    snapshots: list[dict] = field(default_factory=list)   # per step: rid -> (block table, token ids)
    events: list[str] = field(default_factory=list)       # per step: what happened
    preemptions: int = 0

    @property
    def throughput(self) -> float:
        return sum(len(o) for o in self.outputs) / self.times[-1]

    @property
    def waste(self) -> float:
        """Share of the reserved token slots that held no token, over the whole run."""
        return 1 - sum(self.used) / sum(self.reserved)


def _check_requests(requests):
    if not requests or len({r.rid for r in requests}) != len(requests) or any(r.output for r in requests):
        raise ValueError("requests must be fresh Request objects with distinct rids (make new ones for each run)")


def paged_generate(model, requests: list[Request], max_batch_size: int, n_blocks: int, block_size: int,
                   attention=None, store=None, eos_token_id: int | None = None) -> Run:
    """Greedy continuous batching over a paged cache, with your allocator, policy and attention."""
    _check_requests(requests)
    attention, store = attention or paged_attention_ref, store or write_kv
    dev, fns = model.device, dict(write_kv=store or write_kv, attention=attention)
    alloc, queues = SharedBlockAllocator(n_blocks, block_size), Queues(requests, max_batch_size)
    cache = PagedKVCache(model.cfg, n_blocks, block_size, device=dev)
    run, start, step = Run([], [], [], []), clock(dev), 0
    while queues.has_work():
        decoding, preempted = reserve_decode(queues, alloc)
        newcomers = [] if preempted else admit(queues, alloc, step)
        if not queues.running and queues.waiting and queues.waiting[0].arrival <= step:
            r = queues.waiting[0]
            raise OutOfBlocks(f"request {r.rid} needs {alloc.blocks_for(len(r.prompt) + len(r.output))} blocks "
                              f"and the whole pool has {n_blocks}: it can never run")
        for src, dst in alloc.pending_copies:
            cache.copy_block(src, dst)
        alloc.pending_copies.clear()
        for r, slots in newcomers:                      # prefill: prompt (+ output so far, after a preemption)
            tokens = r.prompt + r.output
            logits = forward_paged(model, torch.tensor([tokens], device=dev), torch.arange(len(tokens), device=dev)[None],
                                   cache, torch.tensor(slots, device=dev), None, None, **fns)
            r.output.append(int(logits[0, -1].argmax()))
        if decoding:                                    # decode: one token for every other running request
            ids = torch.tensor([[r.output[-1]] for r, _ in decoding], device=dev)                       # (B, 1)
            pos = torch.tensor([[len(r.prompt) + len(r.output) - 1] for r, _ in decoding], device=dev)  # (B, 1)
            tables = block_table_tensor([alloc.block_tables[r.rid] for r, _ in decoding], dev)           # (B, max_blocks)
            lens = torch.tensor([alloc.lengths[r.rid] for r, _ in decoding], dtype=torch.int32, device=dev)
            logits = forward_paged(model, ids, pos, cache, torch.tensor([s for _, s in decoding], device=dev),
                                   tables, lens, **fns)
            for (r, _), tok in zip(decoding, logits[:, -1].argmax(dim=-1).tolist()):
                r.output.append(tok)
        done = [r for r in queues.running if len(r.output) >= r.max_new_tokens or r.output[-1] == eos_token_id]
        for r in done:
            queues.running.remove(r)
            alloc.free(r.rid)
            queues.finished.append(r)
        run.times.append(clock(dev) - start)
        run.used.append(sum(alloc.lengths.values()))
        run.reserved.append((n_blocks - alloc.n_free) * block_size)
        run.snapshots.append({r.rid: (list(alloc.block_tables[r.rid]), (r.prompt + r.output)[:alloc.lengths[r.rid]])
                              for r in queues.running})
        said = [f"admitted {[r.rid for r, _ in newcomers]}" if newcomers else "",
                f"preempted {[r.rid for r in preempted]}" if preempted else "",
                f"finished {[r.rid for r in done]}" if done else ""]
        run.events.append(", ".join(s for s in said if s) or "decode")
        run.preemptions += len(preempted)
        step += 1
    run.outputs = [r.output for r in requests]
    return run


def contiguous_generate(model, requests: list[Request], max_batch_size: int, max_len: int,
                        eos_token_id: int | None = None) -> Run:
    """Lab 04's continuous batching on the slot cache: each running request holds a slot of max_len."""
    _check_requests(requests)
    dev, queues = model.device, Queues(requests, max_batch_size)
    cache = SlotKVCache(model.cfg, n_slots=max_batch_size, max_len=max_len, device=dev)
    free_slots, slot_of = list(range(max_batch_size)), {}
    run, start, step = Run([], [], [], []), clock(dev), 0
    while queues.has_work():
        newcomers = []
        while free_slots and queues.waiting and queues.waiting[0].arrival <= step:
            r = queues.waiting.popleft()
            slot_of[r.rid] = free_slots.pop(0)
            newcomers.append(r)
        others = list(queues.running)
        queues.running += newcomers
        for r in newcomers:
            cache.reset(slot_of[r.rid])
            logits = forward_cached(model, torch.tensor([r.prompt], device=dev), torch.arange(len(r.prompt), device=dev)[None],
                                    cache, torch.tensor([slot_of[r.rid]], device=dev))
            r.output.append(int(logits[0, -1].argmax()))
        if others:
            logits = forward_cached(model, torch.tensor([[r.output[-1]] for r in others], device=dev),
                                    torch.tensor([[len(r.prompt) + len(r.output) - 1] for r in others], device=dev),
                                    cache, torch.tensor([slot_of[r.rid] for r in others], device=dev))
            for r, tok in zip(others, logits[:, -1].argmax(dim=-1).tolist()):
                r.output.append(tok)
        for r in [r for r in queues.running if len(r.output) >= r.max_new_tokens or r.output[-1] == eos_token_id]:
            queues.running.remove(r)
            free_slots.append(slot_of.pop(r.rid))
            queues.finished.append(r)
        run.times.append(clock(dev) - start)
        run.used.append(int(cache.valid.sum()))
        run.reserved.append(len(queues.running) * max_len)
        step += 1
    run.outputs = [r.output for r in requests]
    return run
'''),
code(r"""
# 6 requests, at most 4 at a time, and a pool of only 8 blocks of 4 tokens: too small for all of them.
texts6 = ["The capital of France is", "Hello, my name is", "def fibonacci(n):", "My trip to Yosemite was",
          "Water boils at", "Once upon a time"]
lengths6 = [8, 4, 9, 6, 3, 7]
def workload6():
    return [Request(i, tokenizer(t).input_ids, n) for i, (t, n) in enumerate(zip(texts6, lengths6))]

paged_run = paged_generate(model, workload6(), max_batch_size=4, n_blocks=8, block_size=4)
slot_run = contiguous_generate(model, workload6(), max_batch_size=4, max_len=32)
print(f"paged: {len(paged_run.times)} steps, {paged_run.preemptions} preemptions; contiguous: {len(slot_run.times)} steps")
print("same tokens from both engines:", paged_run.outputs == slot_run.outputs)
for i, out in enumerate(paged_run.outputs):
    print(f"  {texts6[i]!r:28} -> {tokenizer.decode(out)!r}")
"""),
tests("block_policy_tests", 3, r"""
assert paged_run.preemptions > 0, "8 blocks cannot hold 4 growing requests: the engine must have preempted"
assert paged_run.outputs == slot_run.outputs, "preempt-and-recompute must give exactly the contiguous engine's tokens"
q = Queues([Request(0, [1] * 9, 4), Request(1, [1] * 2, 4)], max_batch_size=4)
a = SharedBlockAllocator(n_blocks=2, block_size=4)
assert admit(q, a, step=0) == [] and len(q.waiting) == 2, "9 tokens need 3 blocks, 2 are free: hold back, and let nobody overtake"
q = Queues([Request(i, [1] * 4, 4) for i in range(3)], max_batch_size=4)
a = SharedBlockAllocator(n_blocks=4, block_size=4)
assert [r.rid for r, _ in admit(q, a, step=0)] == [0, 1, 2] and a.n_free == 1
decoding, preempted = reserve_decode(q, a)
assert [r.rid for r, _ in decoding] == [0, 1] and [r.rid for r in preempted] == [2], \
    "request 0 takes the last free block; request 1 needs one too: preempt the newest (2) and retry"
assert q.waiting[0].rid == 2 and a.n_free == 0 and 2 not in a.block_tables, "the preempted request is freed and waits at the front"
### BEGIN HIDDEN TESTS
""" + HIDDEN_GREEDY + r"""
# admission: arrival, batch size, prompt + output for a recomputed request
q = Queues([Request(0, [1] * 3, 4, arrival=2), Request(1, [1], 4)], max_batch_size=4)
a = SharedBlockAllocator(n_blocks=8, block_size=2)
got = admit(q, a, step=0)
assert [r.rid for r, _ in got] == [1] and len(got[0][1]) == 1, "admit only arrived requests, with a slot per prompt token"
q = Queues([Request(i, [1] * 3, 9) for i in range(5)], max_batch_size=2)
a = SharedBlockAllocator(n_blocks=20, block_size=2)
assert [r.rid for r, _ in admit(q, a, 0)] == [0, 1], "never more running requests than max_batch_size"
q = Queues([Request(7, [1] * 3, 9)], max_batch_size=2)
q.waiting[0].output = [5, 5, 5]
a = SharedBlockAllocator(n_blocks=20, block_size=2)
(r, slots), = admit(q, a, 0)
assert len(slots) == 6 and a.lengths[7] == 6, "a preempted request comes back with prompt + output: reserve slots for all of them"
# preemption order: several victims, and the served request preempting itself
q = Queues([Request(i, [1] * 2, 9) for i in range(3)], max_batch_size=3)
a = SharedBlockAllocator(n_blocks=3, block_size=2)
admit(q, a, 0)
decoding, preempted = reserve_decode(q, a)
assert [r.rid for r, _ in decoding] == [0], "the oldest request keeps running"
assert [r.rid for r in preempted] == [2, 1], "preempt the newest first, then the next newest"
assert [r.rid for r in q.waiting] == [1, 2], "preempted requests go back to the front of waiting, oldest first"
assert all(r.preemptions == 1 for r in preempted) and a.n_free == 3 - len(a.block_tables[0])
q = Queues([Request(0, [1] * 4, 9)], max_batch_size=1)
a = SharedBlockAllocator(n_blocks=1, block_size=4)
admit(q, a, 0)
decoding, preempted = reserve_decode(q, a)
assert decoding == [] and [r.rid for r in preempted] == [0] and a.n_free == 1, "the only request preempts itself"
# whole runs on tiny models: every request's tokens equal the request alone, blocks all freed
for family, seed, kv in (("llama", 5, 2), ("gpt2", 6, 4), ("llama", 7, 1)):
    tiny = _tiny(family, seed, kv)
    g = torch.Generator().manual_seed(seed)
    specs = [(3, 7, 0), (6, 2, 0), (1, 9, 0), (4, 5, 1), (2, 8, 2), (5, 3, 6)]
    def reqs():
        g.manual_seed(seed)
        return [Request(i, torch.randint(1, 64, (n,), generator=g).tolist(), k, a) for i, (n, k, a) in enumerate(specs)]
    refs = [_ref_greedy(tiny, r.prompt, r.max_new_tokens) for r in reqs()]
    for B, n_blocks, bs in ((3, 40, 4), (4, 7, 2), (6, 6, 3), (2, 5, 4)):
        run = paged_generate(tiny, reqs(), max_batch_size=B, n_blocks=n_blocks, block_size=bs)
        assert run.outputs == refs, f"{family}, B={B}, {n_blocks} blocks of {bs}: outputs differ from each request alone"
        assert max(run.reserved) <= n_blocks * bs
        assert all(u <= r for u, r in zip(run.used, run.reserved)), "a sequence holds more tokens than its blocks"
        assert run.reserved[-1] == 0, "blocks never freed: the pool is not empty after the last request finished"
    assert paged_generate(tiny, reqs(), 4, 7, 2).preemptions > 0, "a small pool must force preemptions"
### END HIDDEN TESTS
"""),
md(r"""
### See it: the blocks of your engine

Your engine's run above, step by step. Left, each running request's logical blocks, the physical
block each one maps to (`L1 -> P7`) and the tokens it holds. Right, the pool. Move the slider and
watch blocks being taken as requests grow, freed when they finish, and the newest request evicted
when the pool runs dry. The line at the top says what happened at that step.
"""),
code(r"""
from course.widgets.cache_blocks import cache_blocks

def token_text(ids):
    return [tokenizer.decode([t]) for t in ids]

def widget_snapshots(run):
    return [{f"req {rid}": (table, token_text(toks)) for rid, (table, toks) in snap.items()} for snap in run.snapshots]

cache_blocks(widget_snapshots(paged_run), block_size=4, n_blocks=8, labels=paged_run.events,
             title="6 requests, 8 blocks of 4 tokens")
"""),
md(r"""
### Shared blocks: parallel sampling

Now three answers to one prompt, sampled at temperature 1. The prompt is prefilled once, then the
sequence is forked twice with your `SharedBlockAllocator`. At step 0 all three share every block
(thick borders). At the first decode, the partly full last block is copied for the sequences that
write into it, and from then on each grows its own blocks. The prompt's full blocks stay shared to the end.
"""),
code(r'''
def parallel_samples(prompt, n, max_new_tokens, block_size=4, n_blocks=16, temperature=1.0, seed=0):
    """n sampled answers to one prompt that share its blocks. Returns (outputs, snapshots, labels)."""
    alloc, cache = SharedBlockAllocator(n_blocks, block_size), PagedKVCache(cfg, n_blocks, block_size, device=dev)
    fns, gen = dict(write_kv=write_kv, attention=paged_attention_ref), torch.Generator().manual_seed(seed)
    def sample(logits):                                     # (n, V) -> n token ids
        return torch.multinomial(torch.softmax(logits.float().cpu() / temperature, -1), 1, generator=gen)[:, 0].tolist()
    slots = alloc.append(0, len(prompt))
    logits = forward_paged(model, torch.tensor([prompt], device=dev), torch.arange(len(prompt), device=dev)[None],
                           cache, torch.tensor(slots, device=dev), None, None, **fns)
    for child in range(1, n):
        alloc.fork(0, child)
    outs = [[t] for t in sample(logits[0, -1:].expand(n, -1))]
    snapshots, labels = [], []
    def snap(label):
        snapshots.append({f"sample {i}": (list(alloc.block_tables[i]), token_text((prompt + outs[i])[:alloc.lengths[i]]))
                          for i in range(n)})
        labels.append(label)
    snap(f"prompt prefilled once, forked into {n}")
    for _ in range(max_new_tokens - 1):
        slots = [alloc.append(i, 1)[0] for i in range(n)]
        copies = list(alloc.pending_copies)
        for src, dst in alloc.pending_copies:
            cache.copy_block(src, dst)
        alloc.pending_copies.clear()
        pos = torch.tensor([[len(prompt) + len(o) - 1] for o in outs], device=dev)
        logits = forward_paged(model, torch.tensor([[o[-1]] for o in outs], device=dev), pos, cache,
                               torch.tensor(slots, device=dev), block_table_tensor([alloc.block_tables[i] for i in range(n)], dev),
                               torch.tensor([alloc.lengths[i] for i in range(n)], dtype=torch.int32, device=dev), **fns)
        for o, t in zip(outs, sample(logits[:, -1])):
            o.append(t)
        snap(f"decode; copy-on-write {copies}" if copies else "decode")
    return outs, snapshots, labels

four_score = tokenizer("Four score and seven years ago our fathers brought forth").input_ids
samples, snaps, labels = parallel_samples(four_score, n=3, max_new_tokens=env.pick(10, 6))
for i, s in enumerate(samples):
    print(f"sample {i}: {tokenizer.decode(four_score + s)!r}")
cache_blocks(snaps, block_size=4, n_blocks=16, labels=labels, title="3 samples of one prompt, sharing its blocks")
'''),
md(r"""
## 5. Measure: memory and throughput

### Waste, paged against contiguous

Back to the workload of section 1. The same simulation, now feeding your allocator: a request that
joins appends its prompt, each step appends one token, a request that leaves is freed. What the pool
reserves is its used blocks times `block_size`.
"""),
code(r"""
def paged_usage(block_size):
    alloc, used, reserved = BlockAllocator(n_blocks=max_batch * (MAX_LEN // block_size), block_size=block_size), [0], [0]
    def on_step(events, state):
        for kind, rid, n in events:
            alloc.append(rid, n)
        used[0] += sum(alloc.lengths.values())
        reserved[0] += (alloc.n_blocks - alloc.n_free) * block_size
        for rid, (n, final) in state.items():
            if n >= final:
                alloc.free(rid)
    simulate(prompt_lens, output_lens, max_batch, on_step)
    assert alloc.n_free == alloc.n_blocks, "the simulation must end with every block free"
    return used[0], reserved[0]

waste = {"contiguous, max_len 2048": 1 - contiguous["used"] / sum(contiguous.values())}
for bs in (8, 16, 32, 128):
    used, reserved = paged_usage(bs)
    waste[f"paged, block_size {bs}"] = 1 - used / reserved
for name, w in waste.items():
    print(f"{name:>26}: {100 * w:5.1f}% of reserved KV memory holds no token")

plt.figure(figsize=(7, 2.6))
plt.barh(list(waste), [100 * w for w in waste.values()], color=["C3"] + ["C0"] * (len(waste) - 1))
plt.xlabel("% of reserved KV memory wasted (averaged over the run)"); plt.gca().invert_yaxis()
plt.grid(alpha=0.3, axis="x"); plt.tight_layout(); plt.show()
"""),
md(r"""
With paging, only the empty part of each request's last block is wasted: at most `block_size - 1`
slots per request, against hundreds or thousands for a contiguous slot. vLLM reports under 4% waste.
Larger blocks waste more, but each block is one more piece for the kernel to fetch, so engines pick
16 or 32 as a compromise.

### Requests that fit in a fixed budget

Give the KV cache a fixed budget: say 4 GiB on a GPU, in fp16, for SmolLM2 (its 30 layers x 3 KV
heads x 64 dims x 2 (keys and values) x 2 bytes per token). How many requests of our workload can be in
flight **to completion** at once? Contiguous: every request takes a `MAX_LEN` slot. Paged: fill your
allocator with the requests' full lengths until it raises `OutOfBlocks`.
"""),
code(r"""
BUDGET = 4 * 2**30
bytes_per_token = 2 * cfg.n_layer * cfg.n_kv_head * cfg.head_dim * 2           # keys + values, fp16
fit_contiguous = BUDGET // (MAX_LEN * bytes_per_token)
alloc = BlockAllocator(n_blocks=BUDGET // (16 * bytes_per_token), block_size=16)
fit_paged = 0
for rid, (p, o) in enumerate(zip(prompt_lens * 20, output_lens * 20)):         # the workload, repeated as needed
    try:
        alloc.append(rid, p + o)
    except OutOfBlocks:
        break
    fit_paged += 1
print(f"{bytes_per_token / 1024:.1f} KiB of KV per token; a {BUDGET / 2**30:.0f} GiB budget holds "
      f"{BUDGET // bytes_per_token:,} tokens")
print(f"contiguous (max_len {MAX_LEN}): {fit_contiguous} requests; paged (blocks of 16): {fit_paged} requests "
      f"({fit_paged / fit_contiguous:.1f}x)")
"""),
md(r"""
More requests in flight means larger decode batches, and lab 04 showed what a larger batch does to
throughput. That, more than anything in the kernel, is where vLLM's 2-4x over earlier servers came from.

### Throughput of the paged engine

The same requests through both engines, with room for all of them (no preemption): this measures
the cost of the paging itself on this machine. The paged engine gathers keys through block tables
with your PyTorch reference, one sequence at a time, so expect it to be slower here; the next
section writes the kernel that removes that cost on a GPU.
"""),
code(r"""
texts = ["The capital of France is", "Once upon a time, in a small village by the sea, there lived", "def fibonacci(n):",
         "The three primary colors are", "My trip to Yosemite was", "Explain why the sky is blue in one sentence:",
         "A haiku about autumn leaves:", "The quick brown fox"]
n_req, new_tokens, B = env.pick((16, 48, 8), (3, 4, 3), cpu=(8, 24, 8))
def workload():
    return [Request(i, tokenizer(texts[i % len(texts)]).input_ids, new_tokens) for i in range(n_req)]
max_len = max(len(r.prompt) for r in workload()) + new_tokens
contiguous_generate(model, workload()[:2], 2, max_len)                          # warm-up
runs = {"contiguous": contiguous_generate(model, workload(), B, max_len),
        "paged (PyTorch reference)": paged_generate(model, workload(), B, n_blocks=B * -(-max_len // 16), block_size=16)}
assert runs["contiguous"].outputs == runs["paged (PyTorch reference)"].outputs
for name, run in runs.items():
    print(f"{name:>26}: {run.throughput:6.1f} tokens/s")
"""),
md(r"""
## 6. Triton: the paged decode kernel

`paged_attention_ref` loops over sequences in Python and gathers each one's keys into a new tensor
before attending: on a GPU that is many small kernel launches and a copy of the whole context per
step. A real engine runs one kernel that reads the blocks where they are. You will write it in
**Triton**, which compiles Python-like code into GPU kernels. Like llm.c's `dev/cuda` files, this
section has a reference (yours), numbered versions, a check of each version's maximum difference
from the reference, and then timing.

The Triton model in four lines: you write the work of one **program**; a **grid** of programs runs in
parallel (`kernel[grid](...)`), each finding its share of the work from `tl.program_id(axis)`; a
program loads and stores whole tiles with `tl.load(pointers, mask=...)` and `tl.store`; tile sizes
are `tl.constexpr` powers of two, and **masks** switch off the lanes that fall outside the data.

**On a CPU**, `course.setup()` set `TRITON_INTERPRET=1` before anything imported Triton, so every
`@triton.jit` below runs in the interpreter: NumPy executes each program one after the other.
It is how you can write kernels on a laptop, but it has traps:

- it is slow: about a few milliseconds per program per loop iteration, whatever the tile size. Keep
  grids and loops small, and read its times as interpreter time, not performance;
- it accepts code that a GPU compiler rejects: `break` or `continue` in a loop, a loop variable whose
  dtype changes between iterations, `math.sqrt` of a runtime argument. The compile check below catches these;
- a load without a mask that reads far outside a tensor can crash the whole kernel process (Jupyter
  then restarts it); near misses silently read garbage. Mask every load whose lanes can fall outside;
- `tl.device_assert` does nothing, and bf16 arithmetic gives silent garbage (load, then `.to(tl.float32)`);
  fp16 and fp32 are fine;
- `tl.dot` works on any tile size here, but GPUs need at least 16 in every dimension; and fp32 `tl.dot`
  is exact here but TF32 (about 3 decimal digits) on recent GPUs. The kernels below avoid `tl.dot`
  (their tiles are small) with elementwise products and `tl.sum`.
- `TRITON_INTERPRET` is read when `@triton.jit` runs: setting it after the kernels are defined does nothing.
"""),
code(r"""
import triton
import triton.language as tl

print(f"triton {triton.__version__}: {'interpreter (CPU)' if env.triton_interpreted else 'compiled for ' + torch.cuda.get_device_name(0)}")
"""),
md(r"""
## Problem 5: Warm-up: a kernel that writes K/V into slots (2 points)

The first kernel replaces `write_kv`. One program per new token: it reads the token's slot, then
copies the token's `Hkv * D` key values and value values into that slot's row of the caches. Seen
flat, token `i`'s keys start at `k_ptr + i * ROW` and slot `s` starts at `k_cache_ptr + s * ROW`, with
`ROW = Hkv * D`. `tl.arange` needs a power of two, and SmolLM2's row is 192 values, so the tile is
`ROW_PAD = 256` lanes and a mask switches off the last 64. The same mask switches off a token whose
slot is negative. Convert the slot to `tl.int64` before multiplying: a big pool overflows 32 bits.

**Deliverable:** the body of `store_kv_kernel`; `store_kv` (given) launches it.
"""),
solution("store_kv_kernel", r'''
@triton.jit
def store_kv_kernel(k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, ROW: tl.constexpr, ROW_PAD: tl.constexpr):
    """Program i: copy row i of k and v (ROW values each) into row slot_mapping[i] of the caches."""
    ### BEGIN SOLUTION
    token = tl.program_id(0)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    cols = tl.arange(0, ROW_PAD)
    mask = (cols < ROW) & (slot >= 0)
    k = tl.load(k_ptr + token * ROW + cols, mask=mask)
    v = tl.load(v_ptr + token * ROW + cols, mask=mask)
    tl.store(k_cache_ptr + slot * ROW + cols, k, mask=mask)
    tl.store(v_cache_ptr + slot * ROW + cols, v, mask=mask)
    ### END SOLUTION


def store_kv(k_cache, v_cache, k, v, slot_mapping):
    """Triton version of write_kv: same arguments, same result."""
    N, Hkv, D = k.shape
    if not (k.is_contiguous() and v.is_contiguous() and k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("store_kv needs contiguous k, v and caches")
    if k_cache.shape[2:] != (Hkv, D) or k.dtype != k_cache.dtype:
        raise ValueError(f"k {tuple(k.shape)} {k.dtype} does not match the cache {tuple(k_cache.shape)} {k_cache.dtype}")
    store_kv_kernel[(N,)](k, v, k_cache, v_cache, slot_mapping, ROW=Hkv * D, ROW_PAD=triton.next_power_of_2(Hkv * D))
'''),
tests("store_kv_tests", 2, r"""
kc, vc = torch.zeros(4, 4, 3, 8), torch.zeros(4, 4, 3, 8)                # 4 blocks of 4 slots, Hkv=3, D=8: ROW=24
k, v = torch.randn(5, 3, 8), torch.randn(5, 3, 8)
slots = torch.tensor([3, 4, 15, -1, 0])                                  # 3 | 4: a block boundary; -1: skip
store_kv(kc, vc, k, v, slots)
ref_k, ref_v = torch.zeros(4, 4, 3, 8), torch.zeros(4, 4, 3, 8)
write_kv(ref_k, ref_v, k, v, slots)
assert torch.equal(kc, ref_k) and torch.equal(vc, ref_v), "store_kv must write exactly what write_kv writes (rows, slots, the -1 skip)"
### BEGIN HIDDEN TESTS
for Hkv, D, dtype in ((1, 16, torch.float16), (2, 4, torch.float32), (4, 8, torch.float32)):
    kc = torch.full((3, 2, Hkv, D), -9.0, dtype=dtype); vc = kc.clone()
    k = torch.randn(6, Hkv, D).to(dtype); v = torch.randn(6, Hkv, D).to(dtype)
    slots = torch.tensor([1, 2, -1, 5, 0, 4])
    store_kv(kc, vc, k, v, slots)
    fk, fv = kc.view(6, Hkv, D), vc.view(6, Hkv, D)
    for i, s in enumerate(slots.tolist()):
        if s >= 0:
            assert torch.equal(fk[s], k[i]) and torch.equal(fv[s], v[i]), f"Hkv={Hkv}, D={D}: token {i} belongs in slot {s}"
    assert (fk[3] == -9).all() and (fv[3] == -9).all(), "slot 3 was given to no token: it must not change (mask the padded lanes)"
### END HIDDEN TESTS
"""),
md(r"""
## Problem 6: Paged decode attention, v1: one block per iteration (4 points)

One program per **(sequence, KV head)**: grid `(B, Hkv)`. The program handles all `GROUP = H // Hkv`
query heads that share its KV head (GQA), so it reads each key once for all of them: query heads
`kv_head * GROUP .. kv_head * GROUP + GROUP - 1`. Its query tile is `(GROUP_PAD, D)`, padded to a
power of two and masked (SmolLM2's group of 3 becomes 4 rows). The layout, all contiguous:
`q` and `out` are `(B, H, D)`, the caches `(n_blocks, BLOCK_SIZE, H_KV, D)`, `block_tables`
`(B, max_blocks)` int32, `context_lens` `(B,)` int32.

The program walks the sequence's blocks, `i = 0 .. cdiv(context_len, BLOCK_SIZE) - 1`, and keeps an
**online softmax** (as in FlashAttention) instead of storing all the scores: a running maximum `m`
per head, a running sum `l` of `exp(score - m)`, and a running weighted sum `acc` of values. For each block:

1. read its physical block id from the table; load its keys and values `(BLOCK_SIZE, D)` for this
   KV head, with a mask for the positions `>= context_len` (the last block may be partly full, and its
   other slots hold stale data from earlier owners: never read them);
2. scores `s = (q . k) * scale`, `(GROUP_PAD, BLOCK_SIZE)`; masked positions get `-inf`;
3. `m_new = max(m, rowmax(s))`; rescale the old sums by `alpha = exp(m - m_new)`:
   `l = l * alpha + rowsum(exp(s - m_new))`, `acc = acc * alpha + exp(s - m_new) @ v`; `m = m_new`.

At the end `out = acc / l`, stored for the real heads only. Compute in float32 whatever the input
dtype, and store in the output's dtype (`out_ptr.dtype.element_ty`). Without `tl.dot`, `q . k` for
all heads and positions is `tl.sum(q[:, None, :] * k[None, :, :], axis=2)`.

**Deliverable:** the body of `paged_attention_v1_kernel`; `paged_attention_v1` (given) launches it.
"""),
locked("kernel_launch", r'''
def check_paged_args(q, k_cache, v_cache, block_tables, context_lens):
    """Fail with a clear message before a kernel reads memory it should not."""
    B, H, D = q.shape
    n_blocks, block_size, Hkv, Dk = k_cache.shape
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache), ("block_tables", block_tables), ("context_lens", context_lens)):
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous")
    if Dk != D or v_cache.shape != k_cache.shape or H % Hkv or q.dtype != k_cache.dtype:
        raise ValueError(f"q {tuple(q.shape)} {q.dtype} does not fit the caches {tuple(k_cache.shape)} {k_cache.dtype}")
    if block_tables.dtype != torch.int32 or context_lens.dtype != torch.int32 or block_tables.shape[0] != B or context_lens.shape != (B,):
        raise ValueError("block_tables must be (B, max_blocks) int32 and context_lens (B,) int32")
    for name, n in (("head_dim", D), ("block_size", block_size)):
        if n & (n - 1):
            raise ValueError(f"{name} must be a power of two for tl.arange, got {n}")
    if int(context_lens.min()) < 1 or int(context_lens.max()) > block_tables.shape[1] * block_size:
        raise ValueError("every context_len must be >= 1 and fit in its block table")


def launch_paged(kernel, q, k_cache, v_cache, block_tables, context_lens, scale, **extra):
    """Grid (B, Hkv): one program per sequence and KV head."""
    check_paged_args(q, k_cache, v_cache, block_tables, context_lens)
    B, H, D = q.shape
    _, block_size, Hkv, _ = k_cache.shape
    out = torch.empty_like(q)
    kernel[(B, Hkv)](out, q, k_cache, v_cache, block_tables, context_lens, scale, block_tables.shape[1],
                     H=H, H_KV=Hkv, GROUP=H // Hkv, GROUP_PAD=triton.next_power_of_2(H // Hkv),
                     BLOCK_SIZE=block_size, D=D, **extra)
    return out
'''),
solution("paged_attention_v1", r'''
@triton.jit
def paged_attention_v1_kernel(out_ptr, q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, context_lens_ptr,
                              scale, max_blocks,
                              H: tl.constexpr, H_KV: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
                              BLOCK_SIZE: tl.constexpr, D: tl.constexpr):
    """Program (seq, kv_head): the GROUP query heads of kv_head attend to the sequence, one block at a time."""
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    ### BEGIN SOLUTION
    ctx = tl.load(context_lens_ptr + seq)
    g = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, D)
    t = tl.arange(0, BLOCK_SIZE)
    head = kv_head * GROUP + g                                        # (G,): this KV head's query heads
    head_ok = g < GROUP
    q = tl.load(q_ptr + seq * H * D + head[:, None] * D + d[None, :], mask=head_ok[:, None], other=0.0).to(tl.float32)
    m = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, D], tl.float32)
    for i in range(0, tl.cdiv(ctx, BLOCK_SIZE)):
        block = tl.load(block_tables_ptr + seq * max_blocks + i).to(tl.int64)
        pos = i * BLOCK_SIZE + t                                      # (BLOCK_SIZE,): token positions
        valid = pos < ctx
        offs = (block * BLOCK_SIZE + t[:, None]) * (H_KV * D) + kv_head * D + d[None, :]
        k = tl.load(k_cache_ptr + offs, mask=valid[:, None], other=0.0).to(tl.float32)   # (BLOCK_SIZE, D)
        v = tl.load(v_cache_ptr + offs, mask=valid[:, None], other=0.0).to(tl.float32)
        s = tl.sum(q[:, None, :] * k[None, :, :], axis=2) * scale    # (G, BLOCK_SIZE)
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        alpha = tl.exp(m - m_new)
        p = tl.exp(s - m_new[:, None])
        l = l * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
        m = m_new
    out = acc / l[:, None]
    tl.store(out_ptr + seq * H * D + head[:, None] * D + d[None, :], out.to(out_ptr.dtype.element_ty),
             mask=head_ok[:, None])
    ### END SOLUTION


def paged_attention_v1(q, k_cache, v_cache, block_tables, context_lens, scale):
    return launch_paged(paged_attention_v1_kernel, q, k_cache, v_cache, block_tables, context_lens, scale)
'''),
code(r'''
def paged_case(lens, H, Hkv, D, block_size, dtype=torch.float32, seed=0):
    """Random K/V for sequences of the given lengths, in shuffled blocks of a pool. Unused slots hold
    NaN, like stale memory: a kernel that reads past a sequence's end gives NaN, not a silent error."""
    g = torch.Generator().manual_seed(seed)
    alloc = BlockAllocator(n_blocks=sum(-(-L // block_size) for L in lens) + 2, block_size=block_size)
    alloc.free_blocks = deque(torch.randperm(alloc.n_blocks, generator=g).tolist())
    k_cache = torch.full((alloc.n_blocks, block_size, Hkv, D), float("nan"), dtype=dtype)
    v_cache = k_cache.clone()
    for seq, L in enumerate(lens):
        slots = torch.tensor(alloc.append(seq, L))
        write_kv(k_cache, v_cache, torch.randn(L, Hkv, D, generator=g).to(dtype), torch.randn(L, Hkv, D, generator=g).to(dtype), slots)
    tables = block_table_tensor([alloc.block_tables[s] for s in range(len(lens))])
    q = torch.randn(len(lens), H, D, generator=g).to(dtype)
    return q, k_cache, v_cache, tables, torch.tensor(lens, dtype=torch.int32)

case = paged_case([5, 8, 1, 13], H=9, Hkv=3, D=16, block_size=4)
diff = (paged_attention_v1(*case, 0.25) - paged_attention_ref(*case, 0.25)).abs().max().item()
print(f"v1 against your reference: max |diff| = {diff:.1e}")
'''),
tests("paged_attention_v1_tests", 4, r"""
for lens, H, Hkv, bs in (([5, 8, 1, 13], 9, 3, 4), ([4, 7], 4, 4, 4), ([16, 3], 4, 1, 8)):
    case = paged_case(lens, H=H, Hkv=Hkv, D=16, block_size=bs, seed=H)
    out = paged_attention_v1(*case, 0.25)
    diff = (out - paged_attention_ref(*case, 0.25)).abs().max().item()
    assert diff < 1e-4, f"lengths {lens}, H={H}, Hkv={Hkv}, block_size={bs}: max |diff| {diff:.1e} from the reference " \
                        "(NaN: a load or a score past context_len is not masked)"
### BEGIN HIDDEN TESTS
""" + HIDDEN_ATTENTION + r"""
for H, Hkv, bs, dtype, seed in ((4, 4, 4, torch.float32, 1), (8, 2, 8, torch.float16, 2), (4, 1, 16, torch.float32, 3),
                                (9, 3, 2, torch.float16, 4), (6, 3, 1, torch.float32, 5)):
    lens = [1, bs, 2 * bs + 1, 3 * bs]
    q, kcache, vcache, bt, cl, ks, vs = _paged_case(lens, H, Hkv, 16, bs, dtype, seed, pad_width=1)
    out = paged_attention_v1(q, kcache, vcache, bt, cl, 0.25)
    assert out.dtype == dtype, "store in the output's dtype"
    err = (out.double() - _dense(q, ks, vs, 0.25)).abs().max().item()
    tol = 1e-4 if dtype == torch.float32 else 4e-3
    assert err < tol, f"v1, H={H}, Hkv={Hkv}, block_size={bs}, {dtype}, lengths {lens}: max |diff| {err:.1e} against " \
                      "dense attention (length 1, exact block multiples, the partly full last block, GQA head mapping)"
### END HIDDEN TESTS
"""),
md(r"""
## Problem 7: v2: several blocks per iteration (3 points)

v1 runs one loop iteration per block. A GPU program that loads only `BLOCK_SIZE` (16) keys per
iteration keeps too little data in flight to hide memory latency; the interpreter, which pays a fixed
cost per iteration, is even slower. v2 covers `BLOCKS_PER_ITER` blocks per iteration: a tile of
`TILE = BLOCKS_PER_ITER * BLOCK_SIZE` token positions. Each position `pos` of the tile has its own
logical block `pos // BLOCK_SIZE` and offset `pos % BLOCK_SIZE`, so the tile first loads a vector of
`TILE` block ids from the table (masked: past the sequence's last block the table holds padding, or
the next row), then gathers keys and values through them. The online softmax is unchanged.

**Deliverable:** the body of `paged_attention_v2_kernel`; `paged_attention_v2` (given) launches it
with `BLOCKS_PER_ITER = 4` by default.
"""),
solution("paged_attention_v2", r'''
@triton.jit
def paged_attention_v2_kernel(out_ptr, q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, context_lens_ptr,
                              scale, max_blocks,
                              H: tl.constexpr, H_KV: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
                              BLOCK_SIZE: tl.constexpr, D: tl.constexpr, BLOCKS_PER_ITER: tl.constexpr):
    """Like v1, over BLOCKS_PER_ITER blocks (a tile of BLOCKS_PER_ITER * BLOCK_SIZE positions) per iteration."""
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    TILE: tl.constexpr = BLOCKS_PER_ITER * BLOCK_SIZE
    ### BEGIN SOLUTION
    ctx = tl.load(context_lens_ptr + seq)
    g = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, D)
    j = tl.arange(0, TILE)
    head = kv_head * GROUP + g
    head_ok = g < GROUP
    q = tl.load(q_ptr + seq * H * D + head[:, None] * D + d[None, :], mask=head_ok[:, None], other=0.0).to(tl.float32)
    m = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, D], tl.float32)
    for it in range(0, tl.cdiv(ctx, TILE)):
        pos = it * TILE + j                                           # (TILE,): token positions
        valid = pos < ctx
        block = tl.load(block_tables_ptr + seq * max_blocks + pos // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
        offs = (block * BLOCK_SIZE + pos % BLOCK_SIZE)[:, None] * (H_KV * D) + kv_head * D + d[None, :]
        k = tl.load(k_cache_ptr + offs, mask=valid[:, None], other=0.0).to(tl.float32)   # (TILE, D)
        v = tl.load(v_cache_ptr + offs, mask=valid[:, None], other=0.0).to(tl.float32)
        s = tl.sum(q[:, None, :] * k[None, :, :], axis=2) * scale    # (G, TILE)
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        alpha = tl.exp(m - m_new)
        p = tl.exp(s - m_new[:, None])
        l = l * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
        m = m_new
    out = acc / l[:, None]
    tl.store(out_ptr + seq * H * D + head[:, None] * D + d[None, :], out.to(out_ptr.dtype.element_ty),
             mask=head_ok[:, None])
    ### END SOLUTION


def paged_attention_v2(q, k_cache, v_cache, block_tables, context_lens, scale, blocks_per_iter=4):
    return launch_paged(paged_attention_v2_kernel, q, k_cache, v_cache, block_tables, context_lens, scale,
                        BLOCKS_PER_ITER=blocks_per_iter)
'''),
tests("paged_attention_v2_tests", 3, r"""
case = paged_case([5, 8, 1, 30], H=9, Hkv=3, D=16, block_size=4, seed=7)
for n in (1, 2, 4):
    diff = (paged_attention_v2(*case, 0.25, blocks_per_iter=n) - paged_attention_ref(*case, 0.25)).abs().max().item()
    assert diff < 1e-4, f"blocks_per_iter={n}: max |diff| {diff:.1e} from the reference"
### BEGIN HIDDEN TESTS
""" + HIDDEN_ATTENTION + r"""
for H, Hkv, bs, n, dtype, seed in ((4, 4, 4, 2, torch.float32, 1), (8, 2, 8, 4, torch.float16, 2), (4, 1, 2, 8, torch.float32, 3),
                                   (9, 3, 16, 2, torch.float16, 4), (6, 3, 4, 4, torch.float32, 5)):
    lens = [1, bs, 2 * bs + 1, n * bs, n * bs + 1, 3 * n * bs - 1]
    q, kcache, vcache, bt, cl, ks, vs = _paged_case(lens, H, Hkv, 16, bs, dtype, seed)
    out = paged_attention_v2(q, kcache, vcache, bt, cl, 0.25, blocks_per_iter=n)
    err = (out.double() - _dense(q, ks, vs, 0.25)).abs().max().item()
    tol = 1e-4 if dtype == torch.float32 else 4e-3
    assert err < tol, f"v2, H={H}, Hkv={Hkv}, block_size={bs}, blocks_per_iter={n}, {dtype}: max |diff| {err:.1e} " \
                      "against dense attention (mask the block-table load and the positions past context_len)"
### END HIDDEN TESTS
"""),
md(r"""
### The check: every version against the reference

As in llm.c's `dev/cuda` files: run each version on the same inputs and print its largest difference
from the reference, over fp32 and fp16, MHA (`Hkv = H`), GQA and MQA (`Hkv = 1`), ragged lengths
including 1 and exact multiples of the block size.
"""),
code(r"""
versions = {"v1": paged_attention_v1, "v2 (2 blocks/iter)": lambda *a: paged_attention_v2(*a, blocks_per_iter=2),
            "v2 (4 blocks/iter)": paged_attention_v2}
print(f"{'case':<34}" + "".join(f"{name:>20}" for name in versions))
table = env.pick([(4, 4, 8, torch.float32), (9, 3, 4, torch.float32), (8, 1, 16, torch.float32),
                   (9, 3, 4, torch.float16), (8, 1, 16, torch.float16)], [(9, 3, 4, torch.float32), (8, 1, 16, torch.float16)])
for H, Hkv, bs, dtype in table:
    lens = [1, bs, 2 * bs + 3, 3 * bs]
    case = paged_case(lens, H, Hkv, D=16, block_size=bs, dtype=dtype, seed=bs)
    ref = paged_attention_ref(*case, 0.25).float()
    name = f"H={H} Hkv={Hkv} bs={bs} {str(dtype)[6:]}"
    print(f"{name:<34}" + "".join(f"{(fn(*case, 0.25).float() - ref).abs().max().item():>20.1e}" for fn in versions.values()))
"""),
md(r"""
### Will it compile for a GPU?

The interpreter accepted your kernels; a GPU compiler is stricter. `course.kernels.compile_for_gpu`
compiles a kernel for a GPU target that this machine does not need to have (sm_75 is a T4, sm_80 an
A100), in a separate process without the interpreter. On a T4 use fp16: it has no bf16. Each
compilation takes a few seconds.
"""),
code(r"""
from course.kernels import compile_for_gpu, kernel_source

def paged_signature(dtype, extra=()):
    p = f"*{dtype}"
    sig = {"out_ptr": p, "q_ptr": p, "k_cache_ptr": p, "v_cache_ptr": p, "block_tables_ptr": "*i32",
           "context_lens_ptr": "*i32", "scale": "fp32", "max_blocks": "i32", "H": "constexpr", "H_KV": "constexpr",
           "GROUP": "constexpr", "GROUP_PAD": "constexpr", "BLOCK_SIZE": "constexpr", "D": "constexpr"}
    return {**sig, **{name: "constexpr" for name in extra}}

smollm2 = dict(H=9, H_KV=3, GROUP=3, GROUP_PAD=4, BLOCK_SIZE=16, D=64)
source = kernel_source(paged_attention_v1_kernel, paged_attention_v2_kernel)
checks = env.pick([("v1", 75, "fp16"), ("v1", 80, "fp32"), ("v2", 75, "fp16"), ("v2", 80, "fp32")], [])
if not checks:
    print("skipped in quick mode: each compilation takes seconds (tests/test_paged_kernels.py compiles the solutions)")
for version, arch, dtype in checks:
    name = f"paged_attention_{version}_kernel"
    extra = {"BLOCKS_PER_ITER": 4} if version == "v2" else {}
    error = compile_for_gpu(source, name, paged_signature(dtype, extra), {**smollm2, **extra}, archs=(arch,))[arch]
    print(f"{version} for sm_{arch} ({dtype}):", "compiles" if error is None else f"FAILS\n{error}")
"""),
md(r"""
### Timing

On a GPU: `triton.testing.do_bench` (it warms up, synchronizes and takes the median) for your
PyTorch reference, v1, v2, and, for scale, PyTorch's fused SDPA on keys and values that were
already gathered into a contiguous tensor (the gather itself not counted, so this is a floor for the
attention math, not an equal competitor). On a CPU: one `time.perf_counter` run of each version in
the interpreter, on a small case. **Interpreter time is not performance**: it counts program-iterations
(each costs milliseconds in NumPy), which is why fewer, larger iterations win there.
"""),
code(r"""
import torch.nn.functional as F

if env.gpu:
    lens = [1024] * 32
    case = paged_case(lens, H=cfg.n_head, Hkv=cfg.n_kv_head, D=cfg.head_dim, block_size=16, dtype=torch.float16)
    case = tuple(t.to(dev) for t in case)
    q, k_cache, v_cache, tables, lengths = case
    kd = torch.stack([k_cache[tables[b].long()].reshape(-1, cfg.n_kv_head, cfg.head_dim)[:1024] for b in range(len(lens))])
    vd = torch.stack([v_cache[tables[b].long()].reshape(-1, cfg.n_kv_head, cfg.head_dim)[:1024] for b in range(len(lens))])
    kd = kd.transpose(1, 2).repeat_interleave(cfg.group_size, 1); vd = vd.transpose(1, 2).repeat_interleave(cfg.group_size, 1)
    scale = cfg.head_dim ** -0.5
    timed = {"PyTorch reference (gather)": lambda: paged_attention_ref(*case, scale),
             "Triton v1": lambda: paged_attention_v1(*case, scale),
             "Triton v2 (4 blocks/iter)": lambda: paged_attention_v2(*case, scale),
             "SDPA on pre-gathered K/V": lambda: F.scaled_dot_product_attention(q[:, :, None], kd, vd, scale=scale)}
    ms = {name: triton.testing.do_bench(fn) for name, fn in timed.items()}
    kv_bytes = 2 * sum(lens) * cfg.n_kv_head * cfg.head_dim * 2
    for name, t in ms.items():
        print(f"{name:>28}: {t * 1e3:8.1f} us   ({kv_bytes / (t * 1e-3) / 1e9:6.0f} GB/s of K/V read)")
else:
    lens = env.pick([256] * 4, [32, 32], cpu=[256] * 4)
    case = paged_case(lens, H=cfg.n_head, Hkv=cfg.n_kv_head, D=cfg.head_dim, block_size=16)
    timed = {"PyTorch reference": lambda: paged_attention_ref(*case, 0.125), "Triton v1 (interpreter)": lambda: paged_attention_v1(*case, 0.125),
             "Triton v2 (interpreter)": lambda: paged_attention_v2(*case, 0.125)}
    interp = {}
    for name, fn in timed.items():
        start = time.perf_counter(); fn(); interp[name] = time.perf_counter() - start
        print(f"{name:>26}: {interp[name] * 1e3:8.1f} ms   (interpreter time, not performance)")
    print(f"{len(lens)} sequences x {cfg.n_kv_head} KV heads = {len(lens) * cfg.n_kv_head} programs; "
          f"v1 runs {len(lens) * cfg.n_kv_head * (lens[0] // 16)} program-iterations, v2 {len(lens) * cfg.n_kv_head * -(-lens[0] // 64)}")
"""),
md(r"""
### Your kernels in the engine

On a GPU, the engine runs with your Triton kernels in place of the PyTorch functions, and must give
the same tokens. In the interpreter a forward pass would launch one slow program per token, layer
and head, so on a CPU this cell only says so.
"""),
code(r"""
if env.gpu:
    triton_run = paged_generate(model, workload(), B, n_blocks=B * -(-max_len // 16), block_size=16,
                                attention=paged_attention_v2, store=store_kv)
    print("same tokens as the contiguous engine:", triton_run.outputs == runs["contiguous"].outputs)
    for name, run in {**runs, "paged (Triton v2)": triton_run}.items():
        print(f"{name:>26}: {run.throughput:6.1f} tokens/s")
else:
    print("skipped: no GPU here. In the interpreter the engine would take minutes per step; the kernels were checked above.")
"""),
md(r"""
## Summary

- A contiguous cache reserves `max_len` slots per request; on a realistic workload most of them never
  hold a token (you measured the share). Reserved memory is memory no other request can use.
- **Paged attention** stores keys and values in fixed-size blocks from a shared pool. A block table per
  sequence maps logical blocks to physical ones; a token's slot is `table[p // bs] * bs + p % bs`.
  Waste is at most one partly full block per sequence.
- **Reference counts** let sequences share blocks (parallel sampling, later prefix caching, lab 08);
  **copy-on-write** gives a sequence its own copy of a shared block just before it writes into it.
- When blocks run out the engine **holds back** new requests, and **preempts** the newest running one,
  **recomputing** its cache later; outputs do not change, only time does.
- The paged decode kernel runs one program per (sequence, KV head), serves a whole GQA group with one
  read of each key, keeps an online softmax across blocks, and masks everything past the context.
  Covering several blocks per iteration keeps more memory traffic in flight.

**Questions**
1. How much memory does a contiguous cache take for one request at 8k context on SmolLM2 (fp16)? At
   128k? How many such requests fit next to the weights on a 16 GB GPU?
2. In your measurement, which of the three parts of a contiguous slot (used, reserved for later, never
   used) was the largest? How would a tighter `max_len` change each, and at what price?
3. Why does the waste of a paged cache grow with the block size? Why not use a block size of 1?
4. Parallel sampling with `n = 4` answers of 200 tokens to a 1,000-token prompt: how many blocks of 16
   does it take with sharing, and without?
5. Why preempt the *newest* request? What could go wrong if the engine preempted the oldest?
6. Recompute or swap to CPU memory: which is cheaper for a short request, and for a very long one? (Think
   of prefill FLOPs against PCIe bandwidth.)
7. Your v1 kernel loads each key once per KV head, not once per query head. By how much does that cut
   the bytes read for SmolLM2 (9 query heads, 3 KV heads)?
8. What does each mask in your kernel protect against? Remove one at a time and rerun the check.

## Going further

- **vLLM** (Kwon et al., SOSP 2023, "Efficient Memory Management for Large Language Model Serving with
  PagedAttention"): the block manager, copy-on-write for parallel sampling and beam search, preemption
  by recompute or swap. Its first CUDA kernel, like your v1, gave each thread group a block at a time;
  its V1 engine moved to a single *unified* Triton/CUDA attention over mixed prefill and decode batches.
- **FlashDecoding / split-KV**: for long contexts and few sequences, `(sequence, head)` programs are too
  few to fill a GPU; splitting the context across programs and merging their partial softmaxes fixes it
  (vLLM's "PagedAttention v2" kernel does this).
- **FlashInfer** and **FlashAttention**'s paged KV support: the kernels most engines now call.
- **nano-vllm**'s `engine/block_manager.py`: blocks, ref counts and hashing in under 100 lines; compare it
  with your allocator. Its block hashes are the start of prefix caching (lab 08).
- **SGLang**'s RadixAttention keeps blocks after a request ends, in a radix tree of token prefixes, so
  later requests with the same prefix reuse them (lab 08).
- **vAttention** (Prabhu et al., 2024) gets paging from the GPU's own virtual memory instead, keeping
  each request's cache virtually contiguous so unmodified attention kernels can read it.
"""),
]

write_notebook("labs/05_paged_attention/05_paged_attention.ipynb", cells + [md(CHECK_YOUR_WORK)])
print("wrote labs/05_paged_attention/05_paged_attention.ipynb")
