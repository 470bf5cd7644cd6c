"""Builds the lab 05 source notebook. Edit this file, then run from the repo root:

    .venv/bin/python -m autograder.lab_builders.lab05
"""
from autograder.authoring import answer, code, locked, md, solution, tests, write_notebook  # noqa: E402
from autograder.lab_builders.common_cells import CHECK_YOUR_WORK, COLAB_INSTALL, SETUP  # noqa: E402
# The hidden tests' independent references (autograder/lab_builders/hidden_refs.py, instructor-only):
# dense float64 attention and NaN-padded paged inputs (shared with lab 06), and an uncached greedy loop.
from autograder.lab_builders.hidden_refs import HIDDEN_ATTENTION, greedy_and_tiny  # noqa: E402

HIDDEN_GREEDY = greedy_and_tiny(max_seq_len=64)

cells = [
md(r"""
# Lab 05: The paged KV cache

In lab 04 every request got a **slot**: a stretch of cache memory with room for `max_len` tokens,
reserved when the request starts. Most requests never use most of it. A chat answer may stop after
40 tokens, but its slot holds 2,048. The unused rest cannot go to anyone else, so the server runs
fewer requests at once than its memory could hold, and batching (lab 04) gains less than it could.
**Paged attention** (vLLM, 2023) borrows the fix from operating systems: cut the cache into small
fixed-size **blocks**, give a request a new block only when it needs one, and keep a **block table**
that maps its logical blocks to wherever its physical blocks happen to be. Waste drops to part of
one block per request, and requests can even share blocks. This idea is the core of vLLM. Today you
build its memory manager and run an engine on it; lab 06 writes the GPU kernels that read it.

**You will**
- measure how much of a contiguous cache holds tokens on a realistic workload;
- build a block allocator: a free list, block tables, the slot of every new token, reference counts, fork and copy-on-write for parallel sampling, and a clear error when blocks run out;
- store keys and values in blocks and write attention that reads them through the block table, then run the lab 04 engine on it, token for token equal to the contiguous cache;
- decide what the engine does when blocks run out: hold requests back, and preempt and recompute;
- watch the blocks on a widget, and measure memory waste, requests that fit, and throughput.

**Time:** about 3 hours 25 minutes: 40 minutes of reading, four problems of 30-45 minutes each (the
allocator and the block policy take longest), 25 minutes for the written questions at the end, and
about half a minute of running on a laptop CPU (31 s measured on 2 cores; about 2 minutes on a GPU). **Hardware:** everything runs on a laptop CPU; on a GPU the same cells use it, with the model
in bf16, and the throughput measurement adds the engines with their decode steps in CUDA graphs (lab 02).
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
    """Continuous batching over sizes only. Each step: each running request writes one more token,
    then waiting requests join while there is room. `on_step(events, state)` sees every step:
    `events` lists ("grow", rid, 1) and ("join", rid, n_prompt_tokens); `state` maps each running
    rid to (its length now, its final length). There is no "leave" event: a request whose length
    has reached its final length leaves right after `on_step`, so `on_step` frees it then."""
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
  0 goes to the back of the free list, in table order) and forget `seq`. An unknown `seq` raises `KeyError`.

Graded case by case: each scenario of the tests earns its share of the 4 points, and the feedback lists the
cases that failed.
"""),
solution("block_allocator", r'''
from course.engine import OutOfBlocks   # RuntimeError: the pool has fewer free blocks than a request needs


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
from course.expect import Cases, expect_int, expect_ints

cases = Cases(points=4)        # one share of the 4 points per case: the feedback lists the cases that failed
def table(a, seq):  # a block table, checked to be a list of ints before it is compared
    return expect_ints(a.block_tables[seq], f"block_tables[{seq!r}]")
def appended(a, seq, n):
    return expect_ints(a.append(seq, n), f"append({seq!r}, {n})", length=n)
def two_sequences():  # 4 blocks of 4: sequence 0 takes 3 tokens, sequence 1 takes 5, sequence 0 two more
    a = BlockAllocator(n_blocks=4, block_size=4)
    appended(a, 0, 3); appended(a, 1, 5); appended(a, 0, 2)
    return a

with cases("blocks_for rounds up"):
    a = BlockAllocator(n_blocks=4, block_size=4)
    assert [expect_int(a.blocks_for(n), f"blocks_for({n})") for n in (0, 1, 4, 5)] == [0, 1, 1, 2], \
        "blocks_for(n) rounds up: 0 tokens need no block, 4 tokens fill one block of 4, the 5th needs a second"
with cases("the first sequence takes the front block"):
    a = BlockAllocator(n_blocks=4, block_size=4)
    assert appended(a, 0, 3) == [0, 1, 2] and table(a, 0) == [0], "sequence 0 takes block 0 (the front of the free list): slots 0, 1, 2"
with cases("5 tokens: a full block and one slot of the next"):
    a = BlockAllocator(n_blocks=4, block_size=4)
    appended(a, 0, 3)
    assert appended(a, 1, 5) == [4, 5, 6, 7, 8] and table(a, 1) == [1, 2], "5 tokens: block 1 full (slots 4-7), one token in block 2 (slot 8)"
with cases("growing a sequence: fill its last block, then a new one"):
    a = BlockAllocator(n_blocks=4, block_size=4)
    appended(a, 0, 3); appended(a, 1, 5)
    assert appended(a, 0, 2) == [3, 12], "slot 3 finishes block 0; the next token starts a new block (3), at offset 0: slot 12"
with cases("lengths and reference counts"):
    a = two_sequences()
    assert a.n_free == 0 and a.lengths == {0: 5, 1: 5}, f"lengths must count every token appended, got {a.lengths}"
    assert expect_ints(a.ref_count, "ref_count") == [1, 1, 1, 1], "every used block has one user"
with cases("out of blocks: OutOfBlocks, nothing changed"):
    a = two_sequences()
    try:
        a.append(1, 4)
    except OutOfBlocks:
        pass
    else:
        raise AssertionError("sequence 1 needs a 4th block for 4 more tokens and none is free: raise OutOfBlocks")
    assert a.lengths[1] == 5 and table(a, 1) == [1, 2], "a failed append must change nothing"
with cases("free gives the blocks back and forgets the sequence"):
    a = two_sequences()
    a.free(0)
    assert sorted(expect_ints(list(a.free_blocks), "free_blocks")) == [0, 3] and a.ref_count[0] == a.ref_count[3] == 0, \
        "freed blocks go back to the free list with a count of 0"
    assert 0 not in a.block_tables and 0 not in a.lengths, "free() forgets the sequence"
### BEGIN HIDDEN TESTS
import random
def one_at_a_time():  # 6 blocks of 3, 9 tokens appended one at a time
    a = BlockAllocator(n_blocks=6, block_size=3)
    got = [expect_ints(a.append("s", 1), "append('s', 1)", length=1)[0] for _ in range(9)]
    return a, got
with cases("one token at a time, across block boundaries"):
    a, got = one_at_a_time()
    assert got == list(range(9)), f"one token at a time in blocks 0, 1, 2: expected slots 0..8, got {got}"
    assert table(a, "s") == [0, 1, 2], "three full blocks of 3"
with cases("new_blocks_needed after a full block, and for a new sequence"):
    a, _ = one_at_a_time()
    assert expect_int(a.new_blocks_needed("s", 3), "new_blocks_needed('s', 3)") == 1 and \
        expect_int(a.new_blocks_needed("s", 4), "new_blocks_needed('s', 4)") == 2, "a full last block: every new token needs new blocks"
    assert expect_int(a.new_blocks_needed("new", 3), "new_blocks_needed") == 1 and a.new_blocks_needed("new", 7) == 3, \
        "a sequence the allocator has not seen starts empty"
with cases("exactly block_size tokens take one block; the next token a new one"):
    a, _ = one_at_a_time()
    assert appended(a, "t", 3) == [9, 10, 11] and table(a, "t") == [3], "exactly one block for block_size tokens"
    assert appended(a, "t", 1) == [12], "the token after a full block starts the next block at offset 0"
with cases("freed blocks go to the back of the free list, in table order"):
    a, _ = one_at_a_time()
    appended(a, "t", 3); appended(a, "t", 1)
    a.free("t")
    assert expect_ints(list(a.free_blocks), "free_blocks") == [5, 3, 4], \
        "freed blocks go to the BACK of the free list, in table order (new blocks come from the front)"
with cases("free of an unknown sequence raises KeyError"):
    a, _ = one_at_a_time()
    appended(a, "t", 3)
    a.free("t")
    try:
        a.free("t")
    except KeyError:
        pass
    else:
        raise AssertionError("freeing an unknown sequence (or one freed already) must raise KeyError")
with cases("OutOfBlocks names the blocks needed and free"):
    a = BlockAllocator(n_blocks=3, block_size=2)
    appended(a, 0, 3)
    try:
        a.append(1, 5)
    except OutOfBlocks as e:
        assert "3" in str(e) and "1" in str(e), f"the message must name the blocks needed (3) and free (1): {e}"
    else:
        raise AssertionError("5 tokens need 3 blocks, 1 is free: raise OutOfBlocks")
with cases("a failed append leaves no empty table and takes no block"):
    a = BlockAllocator(n_blocks=3, block_size=2)
    appended(a, 0, 3)
    try:
        a.append(1, 5)
    except OutOfBlocks:
        pass
    else:
        raise AssertionError("5 tokens need 3 blocks, 1 is free: raise OutOfBlocks")
    assert 1 not in a.block_tables and a.n_free == 1, "a failed append must not leave an empty table or take blocks"
# a long random run against an independent model of the pool: every token's slot holds that token
for bs in (1, 2, 4, 5):
    with cases(f"a random run of appends and frees, blocks of {bs}"):
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
            if expect_int(a.new_blocks_needed(seq, n), "new_blocks_needed") > a.n_free:
                try:
                    a.append(seq, n)
                except OutOfBlocks:
                    continue
                raise AssertionError("append succeeded with too few free blocks")
            before = list(a.block_tables.get(seq, []))
            slots = expect_ints(a.append(seq, n), f"append({seq}, {n})", length=n)
            assert table(a, seq)[:len(before)] == before, "append must never move earlier blocks"
            toks = [(seq, step, i) for i in range(n)]
            for s, t in zip(slots, toks):
                pool[s] = t
            want.setdefault(seq, []).extend(toks)
            for s2, toks2 in want.items():
                tab = table(a, s2)
                assert len(tab) == -(-len(toks2) // bs), f"block_size {bs}: a sequence holds exactly the blocks it needs"
                read = [pool.get(tab[p // bs] * bs + p % bs) for p in range(len(toks2))]
                assert read == toks2, f"block_size {bs}: a token's slot was overwritten or misplaced (check the slot at block boundaries)"
            used = [b for t in a.block_tables.values() for b in t]
            assert len(used) == len(set(used)), "two sequences share a block without fork"
            assert sorted(used + list(a.free_blocks)) == list(range(40)), \
                "every block is either used or free, once (a block whose count reaches 0 goes back to the free list)"
            assert all(a.ref_count[b] == (b in used) for b in range(40)), "ref_count: 1 for a used block, 0 for a free one"
        for seq in list(want):
            a.free(seq)
        assert a.n_free == 40 and not any(a.ref_count) and not a.block_tables, "after freeing everything, every block is free"
### END HIDDEN TESTS
cases.score()
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

Graded case by case: each scenario of the tests earns its share of the 3 points, and the feedback lists the
cases that failed.
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
from course.engine import BlockAllocator as CourseAllocator
from course.expect import Cases, expect_int, expect_ints, graded_alone

class Problem1(CourseAllocator):   # the course's answer to Problem 1 alone: no fork, no copy-on-write of its own
    copy_on_write = False
    fork = None

cases = Cases(points=3)        # one share of the 3 points per case: the feedback lists the cases that failed
def table(a, seq):
    return expect_ints(a.block_tables[seq], f"block_tables[{seq!r}]")
def forked():                  # a prompt of 6 tokens in blocks [0, 1] of 4, forked into sequence 1
    a = SharedBlockAllocator(n_blocks=6, block_size=4)
    a.append(0, 6)
    a.fork(0, 1)
    return a
def alone():                   # your SharedBlockAllocator on the course's Problem 1, for the length of a case
    return graded_alone(SharedBlockAllocator, Problem1)

# Graded on its own: your SharedBlockAllocator runs on the course's Problem 1 here, so a mistake in
# Problem 1 costs only Problem 1's points.
with cases("fork shares the table, the length and every block"), alone():
    a = forked()
    assert table(a, 1) == [0, 1] and a.lengths[1] == 6, "a fork copies the table and the length"
    assert expect_ints(a.ref_count, "ref_count")[:2] == [2, 2], "after a fork, both blocks have two users"
with cases("copy-on-write of a shared, partly full block"), alone():
    a = forked()
    assert expect_ints(a.append(1, 1), "append(1, 1)") == [2 * 4 + 2], \
        "block 1 is shared and partly full: sequence 1 copies it into free block 2 and writes at offset 2"
    assert table(a, 1) == [0, 2] and a.pending_copies == [(1, 2)], "the copy (old, new) is recorded for the engine"
    assert a.ref_count[:3] == [2, 1, 1], "the old block lost a user, the copy has one"
with cases("no copy once the block is the sequence's own"), alone():
    a = forked()
    expect_ints(a.append(1, 1), "append(1, 1)")
    assert expect_ints(a.append(0, 1), "append(0, 1)") == [1 * 4 + 2] and a.pending_copies == [(1, 2)], \
        "block 1 is sequence 0's alone now: no copy"
with cases("free after a fork"), alone():
    a = forked()
    expect_ints(a.append(1, 1), "append(1, 1)"); expect_ints(a.append(0, 1), "append(0, 1)")
    a.free(0)
    assert a.ref_count[:3] == [1, 0, 1] and table(a, 1) == [0, 2], "freeing the parent keeps the blocks the child uses"
    a.free(1)
    assert a.n_free == 6 and not any(a.ref_count), "when both are freed, every block is free"
### BEGIN HIDDEN TESTS
import random
def full_fork():               # 4 tokens in 2 full blocks of 2, forked, the child one token further
    a = SharedBlockAllocator(n_blocks=5, block_size=2)
    a.append("p", 4)
    a.fork("p", "c")
    return a, expect_ints(a.append("c", 1), "append('c', 1)")
with cases("a full shared block needs no copy"), alone():
    a, got = full_fork()
    assert got == [4] and a.pending_copies == [], "the last block is full: no copy, just a new block"
    assert table(a, "c") == [0, 1, 2] and a.ref_count[:3] == [2, 2, 1], "a fork shares the full blocks"
with cases("forks of forks, freed in any order"), alone():
    a, _ = full_fork()
    a.fork("c", "g")
    assert a.ref_count[:3] == [3, 3, 2], "a fork of a fork adds one user to every block it shares"
    a.free("c")
    assert a.ref_count[:3] == [2, 2, 1] and a.n_free == 2, "freeing a forked sequence takes away one user per block"
    a.free("p"); a.free("g")
    assert a.n_free == 5 and not any(a.ref_count), "reference counts must return to 0"
def no_room():                 # sequence 1 shares sequence 0's partly full block; no block is free
    a = SharedBlockAllocator(n_blocks=2, block_size=4)
    a.append(0, 3); a.fork(0, 1); a.append(2, 4)
    assert table(a, 1) == [0] and a.ref_count[0] == 2, "a fork shares the parent's blocks"
    return a
with cases("copy-on-write with no free block: OutOfBlocks, nothing changed"), alone():
    a = no_room()
    try:
        a.append(1, 1)
    except OutOfBlocks:
        pass
    else:
        raise AssertionError("copy-on-write needs a free block and none is left: OutOfBlocks")
    assert table(a, 1) == [0] and a.ref_count[0] == 2 and a.pending_copies == [] and a.lengths[1] == 3, \
        "a copy-on-write that does not fit must change nothing"
with cases("fork onto an existing sequence raises ValueError"), alone():
    a = no_room()
    try:
        a.fork(0, 1)
    except ValueError:
        pass
    else:
        raise AssertionError("forking onto an existing sequence must raise ValueError")
# random forks, appends and frees, checked against an independent pool that applies the copies
for bs in (1, 3, 4):
    with cases(f"random forks, appends and frees, blocks of {bs}"), alone():
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
                    slots = expect_ints(a.append(seq, n), "append", length=n)
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
                tab = table(a, seq)
                read = [pool.get(tab[p // bs] * bs + p % bs) for p in range(len(toks))]
                assert read == toks, f"block_size {bs}: sequence {seq} reads another sequence's token (copy-on-write missed)"
        for seq in list(want):
            a.free(seq)
        assert a.n_free == 30 and not any(a.ref_count), "reference counts leak: blocks stay used after every sequence is freed"
### END HIDDEN TESTS
cases.score()
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
  float32. Slots past a sequence's length may hold anything, even NaN: leave them out (masking their
  scores is not enough: 0 x NaN is NaN). This is the reference the Triton kernels will be checked
  against: clear beats fast.
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
model = course.load_model(device=env.device, dtype=env.dtype)
# Token-for-token checks run in float32: in bf16 two correct programs can round a near-tie differently.
model_fp32 = model if env.dtype == torch.float32 else course.load_model(device=env.device)
dev, cfg = env.device, model.cfg
print(f"SmolLM2 in {env.dtype} on {dev}: {cfg.n_layer} layers, {cfg.n_head} query heads, {cfg.n_kv_head} KV heads, "
      f"head_dim {cfg.head_dim}")


def compare_with_contiguous(prompt, n_steps, block_size=4, n_blocks=16, allocator=None, model=model_fp32):
    '''Largest logit difference between the paged and the contiguous cache, prefill then n_steps decodes,
    with your write_kv and paged_attention_ref, and your allocator unless another is given.'''
    alloc = (allocator or BlockAllocator)(n_blocks, block_size)
    paged = PagedKVCache(cfg, n_blocks, block_size, dtype=model.dtype, device=dev)
    slot = SlotKVCache(cfg, n_slots=1, max_len=len(prompt) + n_steps, dtype=model.dtype, device=dev)
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
from course.engine import BlockAllocator as CourseAllocator
from course.expect import expect_tensor

kc, vc = torch.zeros(3, 2, 1, 4, device=dev), torch.zeros(3, 2, 1, 4, device=dev)   # 3 blocks of 2 slots, 1 KV head, D = 4
k, v = torch.arange(12., device=dev).view(3, 1, 4), -torch.arange(12., device=dev).view(3, 1, 4)
write_kv(kc, vc, k, v, torch.tensor([5, 0, -1], device=dev))
assert torch.equal(kc[2, 1, 0], k[0, 0]) and torch.equal(vc[0, 0, 0], v[1, 0]), \
    "slot 5 is block 2, offset 1; slot 0 is block 0, offset 0"
assert kc.abs().sum() == k[:2].abs().sum(), "a slot of -1 is skipped: nothing else may change"
q = torch.randn(1, 2, 4, device=dev)
tables, lens = torch.tensor([[2, 0]], dtype=torch.int32, device=dev), torch.tensor([4], dtype=torch.int32, device=dev)
out = expect_tensor(paged_attention_ref(q, kc, vc, tables, lens, 0.5), "paged_attention_ref(q, ...)",
                    dtype=q.dtype, shape=(1, 2, 4), device=dev)
kk = torch.stack([kc[2, 0], kc[2, 1], kc[0, 0], kc[0, 1]])[:, 0]      # the sequence's 4 keys, in order
vv = torch.stack([vc[2, 0], vc[2, 1], vc[0, 0], vc[0, 1]])[:, 0]
expect = torch.softmax(q[0] @ kk.T * 0.5, dim=-1) @ vv                # both query heads read KV head 0
assert torch.allclose(out[0], expect, atol=1e-5), "attention over the sequence's tokens, gathered through its block table"
qg = torch.randn(1, 4, 4, device=dev)                                  # 4 query heads over 2 KV heads (GQA)
kg, vg = torch.randn(2, 2, 2, 4, device=dev), torch.randn(2, 2, 2, 4, device=dev)   # 2 blocks of 2 slots, 2 KV heads
outg = expect_tensor(paged_attention_ref(qg, kg, vg, torch.tensor([[1, 0]], dtype=torch.int32, device=dev),
                                         torch.tensor([3], dtype=torch.int32, device=dev), 0.5),
                     "paged_attention_ref(q with 4 heads, 2 KV heads, ...)", dtype=qg.dtype, shape=(1, 4, 4), device=dev)
kk, vv = torch.cat([kg[1], kg[0]])[:3], torch.cat([vg[1], vg[0]])[:3]           # the 3 tokens: block 1, then block 0
expect = torch.stack([torch.softmax(qg[0, h] @ kk[:, h // 2].T * 0.5, dim=-1) @ vv[:, h // 2] for h in range(4)])
assert torch.allclose(outg[0], expect, atol=1e-5), \
    "GQA: query heads 0 and 1 read KV head 0, heads 2 and 3 read KV head 1 (h // (H // Hkv)): repeat_interleave the KV heads, not repeat"
# your write_kv and attention in the real model, with the course's allocator (Problem 1 is graded on its own)
w, _, _ = compare_with_contiguous(tokenizer("The capital of France is").input_ids, 5, allocator=CourseAllocator)
assert w < 1e-3, f"paged and contiguous caches must give the same logits (float32), largest difference {w:.1e}"
### BEGIN HIDDEN TESTS
""" + HIDDEN_ATTENTION + r"""
for H, Hkv, bs, dtype in ((4, 4, 4, torch.float32), (6, 2, 8, torch.float32), (4, 1, 2, torch.float32),
                          (9, 3, 16, torch.float16), (4, 2, 1, torch.float32)):
    lens = [1, bs, 2 * bs + 1, 3 * bs, 5]
    q, kcache, vcache, bt, cl, ks, vs = _paged_case(lens, H, Hkv, 8, bs, dtype, seed=H * bs, pad_width=2)
    out = expect_tensor(paged_attention_ref(q, kcache, vcache, bt, cl, 0.3), "paged_attention_ref(...)",
                        dtype=dtype, shape=tuple(q.shape), device=dev)
    err = (out.cpu().double() - _dense(q, ks, vs, 0.3)).abs().max().item()
    tol = 1e-4 if dtype == torch.float32 else 4e-3
    assert err < tol, f"H={H}, Hkv={Hkv}, block_size={bs}, {dtype}: max |diff| {err:.1e} against dense attention " \
                      "(stale slots past context_len hold NaN: read only the sequence's tokens; GQA: head h reads h // group)"
# write_kv at block boundaries, fp16
kc = torch.full((4, 3, 2, 2), -7.0, dtype=torch.float16, device=dev)
vc = torch.full((4, 3, 2, 2), -7.0, dtype=torch.float16, device=dev)
k, v = torch.randn(6, 2, 2, device=dev).half(), torch.randn(6, 2, 2, device=dev).half()
slots = torch.tensor([2, 3, 11, -1, 9, 0], device=dev)
write_kv(kc, vc, k, v, slots)
flat_k, flat_v = kc.view(12, 2, 2), vc.view(12, 2, 2)
for i, s in enumerate(slots.tolist()):
    if s >= 0:
        assert torch.equal(flat_k[s], k[i]) and torch.equal(flat_v[s], v[i]), f"token {i} must land in slot {s}"
untouched = [s for s in range(12) if s not in slots.tolist()]
assert (flat_k[untouched] == -7).all() and (flat_v[untouched] == -7).all(), "write_kv wrote outside the given slots"
# the real model, longer, several block sizes
for bs in (1, 16):
    w, _, _ = compare_with_contiguous(tokenizer("My trip to Yosemite was").input_ids, n_steps=3, block_size=bs,
                                      n_blocks=40, allocator=CourseAllocator)
    assert w < 1e-3, f"block_size {bs}: paged logits differ from the contiguous cache by {w:.1e} (float32)"
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
  (The vLLM paper could also *swap* the blocks out to CPU memory; today's vLLM only recomputes.)

The newest request goes first: it is last in line (first come, first served), it usually has the
fewest tokens to recompute, and the oldest request then always makes progress, so the engine cannot
go round in circles.

Requests and the queues are given, as in lab 04 (`course/engine/paged_engine.py`). A `Request` has
`rid` (also its sequence id in the allocator), `prompt`, `max_new_tokens`, `arrival` (the step it
arrives at), `output` (its new tokens so far) and `preemptions`. `Queues(requests, max_batch_size)`
holds `waiting` (a deque in arrival order), `running` (a list, oldest first) and `finished`.
"""),
locked("requests", r'''
from course.engine.paged_engine import Queues, Request   # lab 04's Request without a slot, plus a count of preemptions
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

Graded case by case: each scenario of the tests earns its share of the 3 points, and the feedback lists the
cases that failed.
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
The engine loop is given (`paged_generate` in `course/engine/paged_engine.py`: about 60 lines, worth
reading) and runs on your pieces. One step: reserve decode slots (preempting if needed); admit
newcomers unless someone was just preempted (the pool is full: do not make it worse); copy any
copy-on-write blocks; prefill each newcomer (its first token, or its next one after a recompute);
decode all the others in one forward pass; retire finished requests and free their blocks. It
records a snapshot of every block table for the widget. `contiguous_generate` is lab 04's engine on
the slot cache, for comparison: the same schedule, with `max_len` slots reserved per request. Both
run their decode steps eagerly here; on a GPU, section 5 turns on CUDA graphs.
"""),
locked("engines", r'''
from course.engine import paged_engine
from course.engine.paged_engine import Run


def paged_generate(model, requests, max_batch_size, n_blocks, block_size, *, allocator=None, store=None,
                   attention=None, eos_token_id=None, graphs=False) -> Run:
    """The engine of course/engine/paged_engine.py with YOUR pieces: your SharedBlockAllocator (unless
    another allocator is given), your admit and reserve_decode, your write_kv and paged_attention_ref
    (unless a store or attention function is given). Decode steps eager unless `graphs` (section 5)."""
    return paged_engine.paged_generate(
        model, requests, max_batch_size, n_blocks, block_size,
        allocator=allocator if allocator is not None else SharedBlockAllocator(n_blocks, block_size),
        admit=admit, reserve_decode=reserve_decode, write_kv=store or write_kv,
        attention=attention or paged_attention_ref, eos_token_id=eos_token_id, graphs=graphs)


def contiguous_generate(model, requests, max_batch_size, max_len, eos_token_id=None, graphs=False) -> Run:
    """Lab 04's engine on the slot cache (course/engine/paged_engine.py); decode steps eager unless `graphs`."""
    return paged_engine.contiguous_generate(model, requests, max_batch_size, max_len, eos_token_id, graphs=graphs)
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
print("same tokens from both engines:", paged_run.outputs == slot_run.outputs,
      "" if env.dtype == torch.float32 else f"({env.dtype}: a near-tie can part them; the tests compare in float32)")
for i, out in enumerate(paged_run.outputs):
    print(f"  {texts6[i]!r:28} -> {tokenizer.decode(out)!r}")
"""),
tests("block_policy_tests", 3, r"""
from course.engine import BlockAllocator as CourseAllocator, paged_attention, write_kv as course_write_kv
from course.expect import Cases, expect_int, expect_ints, expect_tuple, expect_type

cases = Cases(points=3)        # one share of the 3 points per case: the feedback lists the cases that failed
def course_pieces(n_blocks, block_size):
    # Problems 1-3 as the course wrote them: this cell grades your admit and reserve_decode alone
    return dict(allocator=CourseAllocator(n_blocks, block_size), store=course_write_kv, attention=paged_attention)

def admitted(q, a, step):
    got = expect_type(admit(q, a, step), f"admit(queues, alloc, {step})", list)
    pairs = [expect_tuple(x, f"admit(...)[{i}]", 2) for i, x in enumerate(got)]
    return [(expect_type(r, f"admit(...)[{i}][0]", Request), expect_ints(s, f"admit(...)[{i}][1] (the slots)"))
            for i, (r, s) in enumerate(pairs)]

def reserved(q, a):
    decoding, preempted = expect_tuple(reserve_decode(q, a), "reserve_decode(queues, alloc)", 2)
    pairs = [expect_tuple(x, f"decoding[{i}]", 2) for i, x in enumerate(expect_type(decoding, "decoding", list))]
    return ([(expect_type(r, f"decoding[{i}][0]", Request), expect_int(s, f"decoding[{i}][1] (the slot)"))
             for i, (r, s) in enumerate(pairs)],
            [expect_type(r, f"preempted[{i}]", Request) for i, r in enumerate(expect_type(preempted, "preempted", list))])

def all_running(q, a):  # every waiting request admitted, as the course's admit does it: your reserve_decode alone
    while q.waiting:
        r = q.waiting.popleft()
        q.running.append(r)
        a.append(r.rid, len(r.prompt) + len(r.output))

with cases("preempt and recompute: the contiguous engine's tokens"):
    run = paged_generate(model_fp32, workload6(), max_batch_size=4, n_blocks=8, block_size=4, **course_pieces(8, 4))
    assert run.preemptions > 0, "8 blocks cannot hold 4 growing requests: the engine must have preempted"
    assert run.outputs == contiguous_generate(model_fp32, workload6(), max_batch_size=4, max_len=32).outputs, \
        "preempt-and-recompute must give exactly the contiguous engine's tokens (a recomputed request needs prompt + output)"
with cases("hold back: nobody overtakes"):
    q = Queues([Request(0, [1] * 9, 4), Request(1, [1] * 2, 4)], max_batch_size=4)
    a = CourseAllocator(n_blocks=2, block_size=4)
    assert admitted(q, a, step=0) == [] and len(q.waiting) == 2, \
        "9 tokens need 3 blocks, 2 are free: hold back, and let nobody overtake"
with cases("admit while the prompts fit"):
    q = Queues([Request(i, [1] * 4, 4) for i in range(3)], max_batch_size=4)
    a = CourseAllocator(n_blocks=4, block_size=4)
    assert [r.rid for r, _ in admitted(q, a, step=0)] == [0, 1, 2] and a.n_free == 1, "all three prompts fit in 3 blocks"
with cases("preempt the newest when blocks run out"):
    q = Queues([Request(i, [1] * 4, 4) for i in range(3)], max_batch_size=4)
    a = CourseAllocator(n_blocks=4, block_size=4)
    all_running(q, a)                              # three full blocks of 4, one block free
    decoding, preempted = reserved(q, a)
    assert [r.rid for r, _ in decoding] == [0, 1] and [r.rid for r in preempted] == [2], \
        "request 0 takes the last free block; request 1 needs one too: preempt the newest (2) and retry"
    assert q.waiting[0].rid == 2 and a.n_free == 0 and 2 not in a.block_tables, "the preempted request is freed and waits at the front"
### BEGIN HIDDEN TESTS
""" + HIDDEN_GREEDY + r"""
# admission: arrival, batch size, prompt + output for a recomputed request
with cases("admit only the requests that have arrived"):
    q = Queues([Request(0, [1] * 3, 4, arrival=2), Request(1, [1], 4)], max_batch_size=4)
    a = CourseAllocator(n_blocks=8, block_size=2)
    got = admitted(q, a, step=0)
    assert [r.rid for r, _ in got] == [1] and len(got[0][1]) == 1, "admit only arrived requests, with a slot per prompt token"
with cases("never more running requests than max_batch_size"):
    q = Queues([Request(i, [1] * 3, 9) for i in range(5)], max_batch_size=2)
    a = CourseAllocator(n_blocks=20, block_size=2)
    assert [r.rid for r, _ in admitted(q, a, 0)] == [0, 1], "never more running requests than max_batch_size"
with cases("a preempted request comes back with prompt + output"):
    q = Queues([Request(7, [1] * 3, 9)], max_batch_size=2)
    q.waiting[0].output = [5, 5, 5]
    a = CourseAllocator(n_blocks=20, block_size=2)
    (r, slots), = admitted(q, a, 0)
    assert len(slots) == 6 and a.lengths[7] == 6, "a preempted request comes back with prompt + output: reserve slots for all of them"
# preemption order: several victims, and the served request preempting itself
with cases("several preemptions: newest first, back to the front of waiting"):
    q = Queues([Request(i, [1] * 2, 9) for i in range(3)], max_batch_size=3)
    a = CourseAllocator(n_blocks=3, block_size=2)
    all_running(q, a)
    decoding, preempted = reserved(q, a)
    assert [r.rid for r, _ in decoding] == [0], "the oldest request keeps running"
    assert [r.rid for r in preempted] == [2, 1], "preempt the newest first, then the next newest"
    assert [r.rid for r in q.waiting] == [1, 2], "preempted requests go back to the front of waiting, oldest first"
    assert all(r.preemptions == 1 for r in preempted) and a.n_free == 3 - len(a.block_tables[0]), \
        "each preempted request counts one preemption and gives back its blocks"
with cases("the only request preempts itself"):
    q = Queues([Request(0, [1] * 4, 9)], max_batch_size=1)
    a = CourseAllocator(n_blocks=1, block_size=4)
    all_running(q, a)
    decoding, preempted = reserved(q, a)
    assert decoding == [] and [r.rid for r in preempted] == [0] and a.n_free == 1, "the only request preempts itself"
# whole runs on tiny models: every request's tokens equal the request alone, blocks all freed
for family, seed, kv in (("llama", 5, 2), ("gpt2", 6, 4), ("llama", 7, 1)):
    with cases(f"whole runs on a tiny {family} model, {kv} KV head{'s' * (kv > 1)}"):
        tiny = _tiny(family, seed, kv)
        g = torch.Generator().manual_seed(seed)
        specs = [(3, 7, 0), (6, 2, 0), (1, 9, 0), (4, 5, 1), (2, 8, 2), (5, 3, 6)]
        def reqs():
            g.manual_seed(seed)
            return [Request(i, torch.randint(1, 64, (n,), generator=g).tolist(), k, a) for i, (n, k, a) in enumerate(specs)]
        refs = [_ref_greedy(tiny, r.prompt, r.max_new_tokens) for r in reqs()]
        for B, n_blocks, bs in ((3, 40, 4), (4, 7, 2), (6, 6, 3), (2, 5, 4)):
            run = paged_generate(tiny, reqs(), B, n_blocks, bs, **course_pieces(n_blocks, bs))
            assert run.outputs == refs, \
                f"{family}, B={B}, {n_blocks} blocks of {bs}: outputs differ from each request alone (a recomputed request needs prompt + output)"
            assert max(run.reserved) <= n_blocks * bs, "the engine reserved more slots than the pool holds"
            assert all(u <= r for u, r in zip(run.used, run.reserved)), "a sequence holds more tokens than its blocks"
            assert run.reserved[-1] == 0, "blocks never freed: the pool is not empty after the last request finished"
        assert paged_generate(tiny, reqs(), 4, 7, 2, **course_pieces(7, 2)).preemptions > 0, "a small pool must force preemptions"
### END HIDDEN TESTS
cases.score()
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
(thick borders). At the first decode, the partly full last block is copied for the first two samples;
the third, by then its only user, writes into it in place. From then on each grows its own blocks. The prompt's full blocks stay shared to the end.
"""),
code(r'''
def parallel_samples(prompt, n, max_new_tokens, block_size=4, n_blocks=16, temperature=1.0, seed=0):
    """n sampled answers to one prompt that share its blocks. Returns (outputs, snapshots, labels)."""
    alloc, cache = SharedBlockAllocator(n_blocks, block_size), PagedKVCache(cfg, n_blocks, block_size, dtype=model.dtype, device=dev)
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
Larger blocks waste more. Smaller blocks mean more blocks per sequence: a longer block table, and
smaller pieces for the kernel to fetch. Engines pick 16 or 32 as a compromise.

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
the cost of the paging itself on this machine, with decode steps run eagerly in both. The paged
engine gathers each sequence's keys and values through its block table with your PyTorch
reference, one sequence at a time, into a new tensor, at every layer of every step; the contiguous
engine gathers all its rows' slots in one indexing operation per layer. Compare the two numbers you get. Lab 06 replaces the gather
with a kernel that reads the blocks in place.

On a GPU two more rows run the engines the way a server would, with their decode steps replayed
from CUDA graphs (lab 02): the contiguous engine, and the paged engine with the course's batched
PyTorch attention (`course.engine.paged_attention`: all sequences at once, lengths masked on the
device). Why not with your reference? See the cell after this one.
"""),
code(r"""
texts = ["The capital of France is", "Once upon a time, in a small village by the sea, there lived", "def fibonacci(n):",
         "The three primary colors are", "My trip to Yosemite was", "Explain why the sky is blue in one sentence:",
         "A haiku about autumn leaves:", "The quick brown fox"]
from course.report import record

n_req, new_tokens, B = env.pick((32, 64, 16), (3, 4, 3), cpu=(8, 24, 8))
def workload():
    return [Request(i, tokenizer(texts[i % len(texts)]).input_ids, new_tokens) for i in range(n_req)]
max_len = max(len(r.prompt) for r in workload()) + new_tokens
n_blocks = B * -(-max_len // 16)
contiguous_generate(model, workload()[:2], 2, max_len)                          # warm-up
runs = {"contiguous": contiguous_generate(model, workload(), B, max_len),
        "paged (your reference)": paged_generate(model, workload(), B, n_blocks=n_blocks, block_size=16)}
if env.gpu:
    runs["contiguous + CUDA graphs"] = contiguous_generate(model, workload(), B, max_len, graphs=True)
    runs["paged (batched attention) + CUDA graphs"] = paged_engine.paged_generate(model, workload(), B, n_blocks, 16,
                                                                                  graphs=True)
same = runs["contiguous"].outputs == runs["paged (your reference)"].outputs
print(f"{n_req} requests x {new_tokens} new tokens, batches of up to {B}, {env.dtype} on {dev}; same tokens: {same}",
      "" if env.dtype == torch.float32 else f"({env.dtype}: a near-tie can part them)")
for name, run in runs.items():
    print(f"{name:>40}: {run.throughput:7.1f} tokens/s  [{run.graphs}]")
ratio = runs["paged (your reference)"].throughput / runs["contiguous"].throughput
print(f"paged with your reference, eager: {ratio:.2f}x the contiguous engine's throughput")
record("paged_ref_vs_contiguous_eager", ratio, "x", "both engines eager: in full mode, paging with a per-sequence "
       "PyTorch gather costs throughput (below 1x); quick mode's few short requests are mostly prefill, where "
       "noise can hide the cost or reverse it", device=dev, dtype=env.dtype)
if env.gpu:
    r_graph = runs["paged (batched attention) + CUDA graphs"].throughput / runs["contiguous + CUDA graphs"].throughput
    print(f"with CUDA graphs: paged (batched attention) {r_graph:.2f}x the contiguous engine's throughput")
    record("paged_vs_contiguous_graphs", r_graph, "x", "paged (batched PyTorch attention) vs contiguous, both with "
           "CUDA-graph decode steps", device=dev, dtype=env.dtype)
"""),
md(r"""
Can your reference run inside a CUDA graph? Try to capture it: `course.engine.StepGraph` refuses, on
a GPU as on a CPU, anything a graph cannot replay.
"""),
code(r"""
from course.engine import GraphCaptureError, StepGraph, paged_attention

q = torch.randn(2, cfg.n_head, cfg.head_dim, device=dev)
kc = torch.randn(4, 16, cfg.n_kv_head, cfg.head_dim, device=dev)
vc = torch.randn(4, 16, cfg.n_kv_head, cfg.head_dim, device=dev)
tables = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32, device=dev)
lens = torch.tensor([20, 9], dtype=torch.int32, device=dev)
for name, fn in (("your paged_attention_ref", paged_attention_ref), ("course.engine.paged_attention", paged_attention)):
    try:
        StepGraph(dev).capture(lambda: fn(q, kc, vc, tables, lens, cfg.head_dim ** -0.5))
        print(f"{name}: captured")
    except GraphCaptureError as e:
        print(f"{name}: cannot be captured. {e}")
"""),
md(r"""
A reference that loops over the sequences and reads each one's length on the host (`int(...)`)
decides how much to gather in Python: a graph, which replays device work with fixed shapes, has no
Python to ask. The batched version gathers every sequence's full block table and masks what lies past
its length on the device, so its shapes never change. (It pays for that by reading up to the longest
table for every sequence; lab 06's kernels read exactly each sequence's blocks, and a graph captures
them too.)

Read your rows. Eager on a CPU, your ratio is the price of the per-sequence gather and its copies,
which are real work there (usually a loss of a few to a few tens of percent; with very few requests,
as in quick mode, the run is mostly prefill, and the noise of a busy machine can hide the cost or
even reverse it). On a GPU, the eager rows mostly measure kernel launches: a decode step of this
model is launch-bound (lab 02), and your reference adds a Python loop and a host read per sequence
and layer. With graphs, each engine's decode step is one replay, faster by the launches it
no longer pays (your rows say how much; in a short run the prefills, which stay eager, weigh more),
and what remains is the kernels' own cost.

## Summary

- A contiguous cache reserves `max_len` slots per request; on a realistic workload most of them never
  hold a token (you measured the share). Reserved memory is memory no other request can use.
- **Paged attention** stores keys and values in fixed-size blocks from a shared pool. A block table per
  sequence maps logical blocks to physical ones; a token's slot is `table[p // bs] * bs + p % bs`.
  Waste is at most one partly full block per sequence.
- **Reference counts** let sequences share blocks (parallel sampling, later prefix caching, lab 09);
  **copy-on-write** gives a sequence its own copy of a shared block just before it writes into it.
- When blocks run out the engine **holds back** new requests, and **preempts** the newest running one,
  **recomputing** its cache later; outputs do not change (in float32; in bf16 a near-tie can part
  them), only time does.
- Paging is memory management: it lets more requests run at once. Reading the blocks fast is a
  kernel's job: lab 06. So is reading them without asking the host: a reference that reads each
  sequence's length with `int(...)` cannot be captured in a CUDA graph, and on a GPU the decode
  step of a small model is launch-bound without one (lab 02).

**Questions**. Answer in the cell under each group, in a few sentences of your own, with the
arithmetic where a question asks for a number; a person grades them (4 points in all).
1. How much memory does a contiguous cache take for one request at 8k context on SmolLM2 (fp16)? At
   128k? How many such requests fit next to the weights on a 16 GB GPU?
2. In your measurement, which of the three parts of a contiguous slot (used, reserved for later, never
   used) was the largest? How would a tighter `max_len` change each, and at what price?
"""),
answer("contiguous_cost_answer", 1, "questions 1 and 2", model=r"""
1. Per token: `2 (K and V) x 30 layers x 3 KV heads x 64 x 2 bytes` = 23,040 bytes (22.5 KiB). At 8k
   (8,192 tokens): 188,743,680 bytes, 180 MiB (0.19 GB). At 128k (131,072 tokens): 3.02 GB (2.8 GiB).
   The fp16 weights take about 0.27 GB (134.5 M parameters). On a 16 GB GPU:
   `(16 - 0.27) / 0.189` = about 83 requests at 8k (89 if the GPU has 16 GiB), and
   `(16 - 0.27) / 3.02` = 5 requests at 128k, before activations and the CUDA context, which take a
   little more.
2. (With the lab's workload, `MAX_LEN` 2,048:) "never used" was by far the largest part, about two
   thirds of the reserved slot-steps (about 65%), against about 22% used and 12% reserved for later:
   most requests end far below 2,048 tokens. A tighter `max_len` shrinks "never used" (by the same
   number of slots for every request), leaves "used" and "reserved for later" as they are for every
   request that still fits, and lets more requests run at once. The price: a request whose prompt
   plus answer needs more than `max_len` is cut off or refused, and the limit must be chosen for the
   worst case the service accepts.
""", rubric=r"""
- 0.5: question 1: the per-token size (23,040 bytes or the formula), both totals (about 180 MiB and
  2.8-3 GiB) and the counts (about 83-89 and 5; a small slip in the arithmetic with the right method
  keeps half).
- 0.5: question 2: the largest part from the student's run (never used) with its share; a tighter
  max_len cuts "never used" only, and the price is truncated or refused long requests.
"""),
md(r"""
3. Why does the waste of a paged cache grow with the block size? Why not use a block size of 1?
4. Parallel sampling with `n = 4` answers of 200 tokens to a 1,000-token prompt: how many blocks of 16
   does it take with sharing, and without?
"""),
answer("block_size_sharing_answer", 1, "questions 3 and 4", model=r"""
3. Only each sequence's last block is partly empty: between 0 and `block_size - 1` slots, about
   `block_size / 2` on average, so the waste per sequence grows linearly with the block size. A
   block size of 1 wastes nothing but makes a block table as long as the sequence (one entry, one
   allocation and one free per token: more memory and bookkeeping on the host), and the attention
   kernel could no longer read a contiguous tile of keys per block: every token is its own
   indirection, loads are scattered and short, and tiles for `tl.dot` must be gathered token by
   token. Prefix caching (lab 09) would also hash every token. Engines use 16 or 32.
4. Each sequence ends with 1,200 tokens = 75 blocks. Without sharing: `4 x 75 = 300` blocks. With
   sharing: the prompt's 62 full blocks (992 tokens) are shared once; its last block (8 tokens) is
   partly full, so copy-on-write gives each sequence its own (the original plus 3 copies), and each
   then needs blocks 62 to 74: 13 blocks of its own. Total `62 + 4 x 13 = 114` blocks.
""", rubric=r"""
- 0.5: question 3: waste is the last block's empty part (up to block_size - 1, about half a block on
  average); block size 1 costs long tables and per-token bookkeeping and scattered, untiled kernel reads.
- 0.5: question 4: 300 without sharing and 114 with (62 shared + 4 x 13). 112 or 116 with the
  partial block handled explicitly but differently (e.g. counting the shared partial block once more)
  earns 0.25.
"""),
md(r"""
5. Why preempt the *newest* request? What could go wrong if the engine preempted the oldest?
6. Recompute or swap to CPU memory: which is cheaper for a short request, and for a very long one? (Think
   of prefill FLOPs against PCIe bandwidth.)
"""),
answer("preemption_answer", 1, "questions 5 and 6", model=r"""
5. The newest request is the last in line under first come, first served, so evicting it is fair; it
   usually holds the fewest tokens, so its recompute is cheapest; and the oldest request always keeps
   its blocks and makes progress, so every request eventually finishes. Evicting the oldest throws
   away the most work (the longest recompute), hurts the request that has waited longest, and can go
   round in circles: the evicted request goes back to the front of the queue, is admitted again,
   needs its blocks again and evicts or is evicted again (thrashing), with no guarantee that anyone
   finishes.
6. Recompute costs a prefill of the request's `n` tokens: about `2 x parameters x n` FLOPs plus
   attention, which grows with `n^2` (SmolLM2: 0.27 GFLOP per token plus about 69,000 x n FLOPs for
   attention), at the GPU's FLOP rate. Swap costs moving `n x 23,040` bytes (SmolLM2, bf16) out over
   PCIe and back (about 25 GB/s each way), linear in `n`, and the copies can overlap other work. A short
   request: recompute; its prefill is small and fast (compute the GPU has to spare), while a swap adds
   transfers, CPU memory and bookkeeping for little. A very long one: swap; at 100k tokens its prefill
   is about 370 TFLOP (roughly a second on an H100) and stalls the batch, while its 2.3 GB cross
   PCIe in about 0.1 s each way. The crossover depends on the model's FLOPs per KV byte and the GPU's
   FLOP rate against its PCIe link.
""", rubric=r"""
- 0.5: question 5: newest = fairness (last in line), least work lost, guaranteed progress for the
  oldest; preempting the oldest loses the most work and can thrash or livelock.
- 0.5: question 6: recompute costs prefill FLOPs (growing faster than linearly with length), swap costs
  bytes over PCIe (linear); short request -> recompute, very long -> swap, argued with a rough estimate
  or the scaling. A reasoned different conclusion with correct numbers for a named model earns it too.
"""),
md(r"""
7. Your `paged_attention_ref` copies each sequence's keys into a new tensor before attending. How many
   bytes does that copy move per decode step for 32 sequences of 1,000 tokens on SmolLM2 in bf16?
"""),
answer("gather_copy_answer", 1, "question 7", model=r"""
Per token and layer the keys take `3 KV heads x 64 x 2 bytes` = 384 bytes, and the values as much.
One decode step copies every sequence's keys and values at every layer:
`32 x 1,000 x 30 x 2 x 384` = 737,280,000 bytes, about 0.74 GB written, after reading as much (about
1.5 GB of memory traffic), on top of the 0.74 GB that attention must read anyway. The keys alone are
half of it: 369 MB. (The reference then converts the copies to float32 and repeats them to 9 heads,
which writes several times more.) At an H100's 3.35 TB/s the plain copy adds about 0.4 ms to every
step, more than the whole attention should cost: this is what lab 06's kernels remove by reading the
blocks in place.
""", rubric=r"""
- 0.5: the method: tokens x layers x KV heads x head_dim x 2 bytes, for keys (and values), per step.
- 0.5: the number: 369 MB for the keys alone or 737 MB (0.74 GB) for keys and values (either, if
  stated which; counting the read as well, about 1.5 GB, also earns it).
"""),
md(r"""

## Going further

- **vLLM** (Kwon et al., SOSP 2023, "Efficient Memory Management for Large Language Model Serving with
  PagedAttention"): the block manager, copy-on-write for parallel sampling and beam search, preemption
  by recompute or swap.
- **nano-vllm**'s `engine/block_manager.py`: blocks, ref counts and hashing in under 100 lines; compare it
  with your allocator. Its block hashes are the start of prefix caching (lab 09).
- **SGLang**'s RadixAttention keeps blocks after a request ends, in a radix tree of token prefixes, so
  later requests with the same prefix reuse them (lab 09).
- **vAttention** (Prabhu et al., 2024) gets paging from the GPU's own virtual memory instead, keeping
  each request's cache virtually contiguous so unmodified attention kernels can read it.
"""),
]

write_notebook("labs/05_paged_kv_cache/05_paged_kv_cache.ipynb", cells + [md(CHECK_YOUR_WORK)])
print("wrote labs/05_paged_kv_cache/05_paged_kv_cache.ipynb")
