"""Builds the lab 09 source notebook. Edit this file, then run from the repo root:

    .venv/bin/python -m autograder.lab_builders.lab09
"""
from autograder.authoring import code, locked, md, solution, tests, write_notebook  # noqa: E402
from autograder.lab_builders.common_cells import CHECK_YOUR_WORK, COLAB_INSTALL, SETUP  # noqa: E402

# Independent references of the hidden tests (they live only here, in the instructor's source):
# a greedy loop with no cache at all, tiny random models, and a "pool content" model that writes
# each token's id into its slot and reads every live sequence back through its table.

HIDDEN_STRESS = r'''
def _stress(hash_fn, n_blocks, bs, n_ops, seed):
    # random allocate / append / commit / free on a small pool; an independent "pool content" model:
    # every computed token writes its id into its slot; every live sequence must read its own tokens back
    rng = random.Random(seed)
    pc = PrefixCache(n_blocks, bs, hash_fn=hash_fn)
    content, live, nxt = {}, {}, 0
    stems = [[rng.randrange(4) for _ in range(rng.randint(1, 3 * bs))] for _ in range(3)]
    for _ in range(n_ops):
        r = rng.random()
        if live and r < 0.3:
            seq = rng.choice(sorted(live)); pc.free(seq); del live[seq]
        elif live and r < 0.6:
            seq = rng.choice(sorted(live))
            try:
                slots = expect_ints(pc.append(seq, 1), "append(seq, 1)", length=1)
            except OutOfBlocks:
                continue
            tok = rng.randrange(4)
            content[slots[0]] = tok
            live[seq].append(tok)
            pc.commit(seq, live[seq])
        else:
            toks = rng.choice(stems) + [rng.randrange(4) for _ in range(rng.randint(0, 2 * bs))]
            try:
                n_cached, slots = expect_tuple(pc.allocate(nxt, toks), "allocate(seq, tokens)", 2)
                n_cached, slots = expect_int(n_cached, "n_cached"), expect_ints(slots, "slots")
            except OutOfBlocks:
                continue
            assert n_cached % bs == 0 and n_cached < len(toks), "only full blocks, and never the last token, come from the cache"
            assert len(slots) == len(toks) - n_cached, "one slot per token that is not cached"
            for s, t in zip(slots, toks[n_cached:]):
                content[s] = t
            pc.commit(nxt, toks)
            live[nxt] = list(toks); nxt += 1
        users = {}
        for seq, tab in pc.tables.items():
            tab = expect_ints(tab, f"tables[{seq}]")
            for b in tab:
                users[b] = users.get(b, 0) + 1
            read = [content.get(tab[p // bs] * bs + p % bs) for p in range(len(live[seq]))]
            assert read == live[seq], f"sequence {seq} reads tokens that are not its own: a block was shared " \
                "wrongly (no token check on a hit? a partial block shared?) or taken while in use"
        assert all(pc.pool.ref_count[b] == users.get(b, 0) for b in range(n_blocks)), \
            "ref_count must equal the number of tables that hold each block"
        assert sorted(list(users) + list(pc.pool.free_queue)) == list(range(n_blocks)), \
            "every block is either in use or in the free queue, never both"
        for h, b in pc.pool.cached.items():
            assert pc.pool.hash_of[b] == h, "cached[h] == b must agree with hash_of[b] == h"
    for seq in list(live):
        pc.free(seq)
    assert pc.pool.n_free == n_blocks and not any(pc.pool.ref_count), "every block must be free at the end"
    return pc
'''.strip("\n")

INTRO = [
md(r"""
# Lab 09: Prefix caching

Most requests to a chat server start the same way. A product's assistant sends the same system
prompt (its instructions) in front of every question. A chat sends the whole conversation again at
every turn. Few-shot prompts repeat the same examples. In each case the server computes the keys and
values of the same tokens over and over, and prefill is the part of a request the user waits for.
**Prefix caching** keeps the KV blocks of finished requests and hands them to later requests that
start with the same tokens, which then skip prefill for that part. vLLM does it with a hash per
block; SGLang (*RadixAttention*) with a radix tree of token sequences. You will build both, on top
of the paged blocks of lab 05.

**You will**
- count how many prefill tokens a server has already computed before, and what they cost;
- give every full block a *chained* hash, keep a map from hash to block with reference counts,
  evict unused blocks least recently used first, and check the tokens of every hit;
- make the lab 05 engine skip prefill for a request's cached blocks, with outputs identical to no cache;
- build a radix tree with insert, longest-prefix match, node splits and LRU eviction of unlocked leaves;
- watch which blocks each request reuses, and measure prefill tokens saved, time to first token and
  hit rate against cache size, on a shared system prompt and on a multi-turn chat.

**Time:** about 3 hours 35 minutes: 35 minutes of reading, five problems (block hashes 15 minutes,
the block pool 35, the prefix cache 30, the prefill 25, the radix tree 45), 25 minutes for the
written questions at the end, and about a minute of running on a laptop CPU (66 s measured on 2 cores). **Hardware:** everything runs on a laptop CPU (small workloads there);
on a GPU the workloads grow, and section 6 shows what the cache is worth there.
"""),
locked("colab_install", COLAB_INSTALL),
locked("setup", SETUP),
md(r"""
## 1. How much prefill has the server done before?

Take a help-desk assistant: a fixed system prompt, then one customer question per request. Below,
each prompt is the system prompt's tokens followed by the question's tokens. We tokenize the two
parts separately and join the ids, as chat templates do: the cache works on **token ids**, and a
prefix is only shared if its ids are identical (text that tokenizes differently at a seam shares nothing).
"""),
code(r'''
import hashlib
import random
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field

import matplotlib.pyplot as plt
import numpy as np
import torch
import torch.nn.functional as F

from course.engine import PagedKVCache, block_table_tensor, forward_paged
from course.engine.runner import embed, project_qkv   # lab 03's layer input and q/k/v (with RoPE), shared by every forward
from course.models.decoder import check_ids
from course.timing import benchmark, clock

tokenizer = course.load_tokenizer()
model = course.load_model(device=env.device, dtype=env.dtype)
# Token-for-token checks (cached = uncached outputs) run in float32: in bf16 two correct programs can
# round a near-tie differently. On a CPU this is the same model.
model_fp32 = model if env.dtype == torch.float32 else course.load_model(device=env.device)
dev, cfg = env.device, model.cfg

SYSTEM = ("You are Quill, the help desk assistant of Northwind Books, an online bookshop. Answer in two or three "
          "short sentences. Be friendly and exact. If you do not know an answer, say so and suggest writing to "
          "help@northwind.example. Orders ship within two working days; delivery takes three to five days. "
          "Returns are free within 30 days if the book is unread. We sell paper books and e-books; e-books "
          "cannot be returned once downloaded. Never share a customer's personal data, and never promise a discount.")
QUESTIONS = ["When will my order arrive?", "Can I return an e-book?", "Do you sell audiobooks?",
             "My book came damaged. What now?", "Is there a discount for students?", "How do I change my address?",
             "Can I pay with a gift card?", "Where is my refund?"]
system = SYSTEM if not env.quick else SYSTEM[:SYSTEM.index(" If you")]     # a shorter one in quick mode


def encode(text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False).input_ids


def chat_prompt(system_text: str, question: str) -> list[int]:
    """System part and user part tokenized separately, then joined: the system ids never change."""
    return encode(f"System: {system_text}\n") + encode(f"User: {question}\nAssistant:")


prompts = [chat_prompt(system, q) for q in QUESTIONS[:env.pick(8, 4)]]
sys_len = len(encode(f"System: {system}\n"))
total = sum(len(p) for p in prompts)
repeated = sys_len * (len(prompts) - 1)
print(f"{len(prompts)} prompts, {total} prompt tokens; the system prompt is {sys_len} of them in each")
print(f"{repeated} prompt tokens ({100 * repeated / total:.0f}%) were computed before, by an earlier request")

question_only = prompts[0][sys_len:]

def uncached_pass(ids):
    """One forward pass over ids with no cache: the prefill of a prompt that shares nothing."""
    return lambda: model(torch.tensor([ids], device=dev), torch.arange(len(ids), device=dev)[None])

times = {"whole": [], "question": []}
for i in range(env.pick(10, 6)):          # alternated: a busy moment of the machine hits both alike
    for key, ids in (("whole", prompts[0]), ("question", question_only)):
        times[key].append(benchmark(uncached_pass(ids), warmup=int(i == 0), repeats=1, device=dev).median)
t_full, t_question = min(times["whole"]), min(times["question"])   # the fastest run: the least disturbed
print(f"prefill of the whole prompt ({len(prompts[0])} tokens): {1e3 * t_full:.0f} ms; "
      f"of the question alone ({len(question_only)} tokens): {1e3 * t_question:.0f} ms")
print(f"the system prompt's share of this prompt's prefill time: {1 - t_question / t_full:.0%} "
      f"({dev}, {str(model.dtype).removeprefix('torch.')})")
'''),
md(r"""
Those are your numbers, each the fastest of a few alternated runs. On a CPU the prefill's time
grows with its tokens, but not in proportion: every pass also pays a fixed cost, because it reads
all the weights however few the tokens are. The last line is the share of this prompt's prefill time
spent on tokens that an earlier request already computed: roughly the most the cache can save here
(the time-to-first-token cells below measure the real saving). On a GPU a prompt of a few hundred
tokens may take about as long as a short one: this small model's forward pass is bound by launching
its kernels (lab 02), not by the tokens, so the cache saves work there but little time until prompts
are long or many requests share the GPU. Read your share before you expect a speedup below.

The keys and values of a token depend only on the tokens before it (causal attention), so the same prefix gives the same keys and values, whoever sends it.
Keeping them is all prefix caching does. The hard parts are finding them fast, sharing them safely,
and deciding what to throw away when memory runs out.

## 2. A name for every block: chained hashes

Lab 05 cut a sequence's cache into blocks of `block_size` tokens. To reuse a block we need to find
it from the tokens of a new request. A block's keys and values depend on its own tokens **and on
every token before it**. So the name of block `i` must cover the whole prefix up to its end. vLLM
gets that cheaply with a **chain**: the hash of block `i` is the hash of (hash of block `i - 1`,
tokens of block `i`).

```
tokens:  [The cat sat on] [the mat and slept] [.          ]        block_size = 4
hash 0 = H(None,   (The, cat, sat, on))
hash 1 = H(hash 0, (the, mat, and, slept))      <- covers all 8 tokens, through hash 0
(no hash for the last block: it is not full yet, and its keys and values will still grow)
```

Only **full** blocks get a hash. A partly filled block belongs to its sequence alone: the next
token will be written into it, so no one else may read it as "the prefix".

`hash_block` (given) is `H`: 64 bits of SHA-256. Two different prefixes give the same hash with
probability about 2^-64 per pair, which is why vLLM uses a strong hash. Python's built-in `hash`
is faster but easier to collide; we will also defend against collisions with a token check.
"""),
locked("hash_block", r'''
from course.engine import OutOfBlocks   # lab 05's: the pool has fewer free blocks than a request needs


def hash_block(parent: int | None, block: tuple[int, ...]) -> int:
    """64-bit hash of (the previous block's hash, this block's token ids). parent is None for block 0."""
    data = repr((parent, tuple(int(t) for t in block))).encode()
    return int.from_bytes(hashlib.sha256(data).digest()[:8], "little")
'''),
md(r"""
## Problem 1: Chained block hashes (2 points)

**Deliverable:** `block_hashes(tokens, block_size, hash_fn=hash_block)`: one hash per **full** block of
`tokens`, in order. Block `i` holds `tokens[i * block_size:(i + 1) * block_size]`; its hash is
`hash_fn(parent, block)` with `parent` the hash of block `i - 1` (`None` for block 0) and `block` a
**tuple** of its token ids. A partly filled last block gets no hash.
"""),
solution("block_hashes", r'''
def block_hashes(tokens: list[int], block_size: int, hash_fn=hash_block) -> list:
    """Chained hashes of the full blocks of `tokens`: hash i covers tokens[0 : (i + 1) * block_size]."""
    ### BEGIN SOLUTION
    hashes, parent = [], None
    for i in range(len(tokens) // block_size):
        parent = hash_fn(parent, tuple(tokens[i * block_size:(i + 1) * block_size]))
        hashes.append(parent)
    return hashes
    ### END SOLUTION
'''),
code(r'''
a, b = prompts[0], prompts[1]
ha, hb = block_hashes(a, 16), block_hashes(b, 16)
same = next((i for i, (x, y) in enumerate(zip(ha, hb)) if x != y), min(len(ha), len(hb)))
print(f"prompt 0: {len(a)} tokens -> {len(ha)} full blocks of 16; prompt 1: {len(b)} tokens -> {len(hb)} full blocks")
print(f"their first {same} block hashes agree: those blocks can be shared")
print("with a hash_fn that shows its input:", block_hashes([7, 8, 9, 10, 11], 2, hash_fn=lambda p, t: (p, t)))
'''),
tests("block_hashes_tests", 2, r"""
from course.expect import expect_type

def hashes(tokens, bs, hash_fn=hash_block):
    '''Your block_hashes, its answer checked first: a list of what hash_fn returns (ints for hash_block).'''
    out = expect_type(block_hashes(tokens, bs, hash_fn=hash_fn), f"block_hashes({list(tokens)}, {bs})", list)
    kind = int if hash_fn is hash_block else tuple
    return [expect_type(h, f"block_hashes(...)[{i}]", kind) for i, h in enumerate(out)]

show = lambda p, t: (p, t)                                    # a "hash" that shows what it was given
assert hashes([1, 2, 3, 4], 2, hash_fn=show) == [(None, (1, 2)), ((None, (1, 2)), (3, 4))], \
    "hash 1 = hash_fn(hash 0, (3, 4)): each hash takes the previous block's hash as its parent, and a tuple of the block's tokens"
assert hashes([1, 2, 3, 4, 5], 2, hash_fn=show)[-1] == ((None, (1, 2)), (3, 4)), "the partial block [5] gets no hash"
assert len(hashes(list(range(10)), 4)) == 2 and hashes([1, 2, 3], 4) == [], "only full blocks"
h1, h2 = hashes([1, 2, 9, 9], 2), hashes([3, 4, 9, 9], 2)
assert h1[1] != h2[1], "the same block (9, 9) after different prefixes must get different hashes: chain the parent"
assert hashes([1, 2, 3, 4], 2) == [hash_block(None, (1, 2)), hash_block(hash_block(None, (1, 2)), (3, 4))], \
    "with hash_block: hash 0 = hash_block(None, (1, 2)), hash 1 = hash_block(hash 0, (3, 4))"
### BEGIN HIDDEN TESTS
assert hashes([], 3) == [] and hashes([5], 1) == [hash_block(None, (5,))], "no tokens: no hash; one token in blocks of 1: one hash"
for bs in (1, 3, 4, 16):
    rng = random.Random(bs)
    toks = [rng.randrange(50) for _ in range(5 * bs + bs // 2)]
    got = hashes(toks, bs)
    want, parent = [], None
    for i in range(len(toks) // bs):
        parent = hash_block(parent, tuple(toks[i * bs:(i + 1) * bs]))
        want.append(parent)
    assert got == want, f"block_size {bs}: hashes differ from the chain hash_block(previous hash, block)"
    assert hashes(toks[:3 * bs], bs) == want[:3], "exact block multiples: every block is full and hashed"
    other = [toks[0] + 1] + toks[1:]
    assert all(x != y for x, y in zip(hashes(other, bs), want)), \
        "changing the first token must change every later hash (the chain)"
assert hashes((1, 2, 3, 4), 2, hash_fn=show) == [(None, (1, 2)), ((None, (1, 2)), (3, 4))], "tuples of tokens too"
### END HIDDEN TESTS
"""),
md(r"""
## 3. The block pool: shared blocks, reference counts, LRU eviction

Now the memory. As in lab 05, a pool of `n_blocks` physical blocks, a reference count per block,
and free blocks handed out from a queue. Three changes make it a cache:

- **A freed block keeps its contents.** When a request ends, its full blocks stay in the map
  `cached` (hash -> block), with reference count 0. A later request with the same prefix finds them
  there and **shares** them (count up by one): it skips their prefill.
- **Eviction is least recently used (LRU).** Blocks with count 0 wait in `free_queue`, oldest
  release first. A request that needs fresh blocks takes them from the **front** (the least recently
  used); if such a block still holds cached tokens, they are **evicted**: its hash leaves the map.
  A block whose count drops to 0 goes to the **back**. A cached block that gets a new user leaves
  the queue: a block in use must never be evicted, or another request would overwrite its keys.
- **Every hit is checked.** Two different prefixes can collide on one hash. So the pool stores, for
  each cached block, its tokens and its **parent**: the block that holds the previous block of the
  prefix (None for a first block). A lookup is a hit only if both match. Walking from the first
  block, that proves the whole prefix is equal, one block at a time.

```
free_queue (LRU first):  [P5] [P2] [P7]        P2, P7 hold cached blocks (evictable); P5 is empty
take(2)      -> P5, P2: P2's hash leaves `cached` (evicted)      free_queue: [P7]
share(P7)    -> ref 1, leaves the queue (now safe from eviction)  free_queue: []
release(P5)  -> ref 0, to the back                                free_queue: [P5]
```

## Problem 2: The block pool (4 points)

**Deliverable:** the methods of `BlockPool`:
- `take(n)`: `n` blocks for new tokens from the front of `free_queue`, each with count 1. Evict the
  ones that hold cached content (remove their hash from `cached`, set their `hash_of`, `tokens_of`,
  `parent_of` to None, count `evictions`). Fewer than `n` free: raise `OutOfBlocks`, changing nothing.
- `share(block)`: one more user of a cached block; at the first user it leaves `free_queue`.
- `release(block)`: one user fewer (ValueError if it had none); at 0 it goes to the back of
  `free_queue`, keeping its content and its entry in `cached`.
- `register(block, h, parent, tokens)`: the block now holds `tokens` (store them as a tuple) after block
  `parent` and is found under hash `h`. If `h` is already in `cached`, or the block is already registered, do nothing (the
  block stays private and is freed like any block).
- `lookup(h, parent, tokens)`: the block cached under `h` if its tokens and its parent match, else
  None. A block found under `h` that fails the check is a collision: count it in `collisions`.

Graded case by case: each scenario of the tests earns its share of the 4 points, and the feedback lists the
cases that failed.
"""),
solution("block_pool", r'''
class BlockPool:
    """Physical KV blocks that outlive their requests: reference counts, a hash map, an LRU free queue."""

    def __init__(self, n_blocks: int, block_size: int):
        if n_blocks < 1 or block_size < 1:
            raise ValueError(f"n_blocks and block_size must be >= 1, got {n_blocks} and {block_size}")
        self.n_blocks, self.block_size = n_blocks, block_size
        self.ref_count: list[int] = [0] * n_blocks
        self.free_queue: OrderedDict[int, None] = OrderedDict.fromkeys(range(n_blocks))  # count 0, LRU first
        self.cached: dict[int, int] = {}                       # hash -> block
        self.hash_of: list[int | None] = [None] * n_blocks     # the hash a block is cached under
        self.tokens_of: list[tuple | None] = [None] * n_blocks
        self.parent_of: list[int | None] = [None] * n_blocks   # the block before it in its prefix
        self.evictions = 0
        self.collisions = 0

    @property
    def n_free(self) -> int:
        return len(self.free_queue)

    def take(self, n: int) -> list[int]:
        """n blocks for new content, least recently used first, each with one user."""
        ### BEGIN SOLUTION
        if n > self.n_free:
            raise OutOfBlocks(f"need {n} free blocks, but only {self.n_free} are free")
        out = []
        for _ in range(n):
            block, _ = self.free_queue.popitem(last=False)
            if self.hash_of[block] is not None:
                del self.cached[self.hash_of[block]]
                self.hash_of[block] = self.tokens_of[block] = self.parent_of[block] = None
                self.evictions += 1
            self.ref_count[block] = 1
            out.append(block)
        return out
        ### END SOLUTION

    def share(self, block: int) -> None:
        """One more user of a cached block; a block in use is never evicted."""
        ### BEGIN SOLUTION
        if self.ref_count[block] == 0:
            del self.free_queue[block]
        self.ref_count[block] += 1
        ### END SOLUTION

    def release(self, block: int) -> None:
        """One user fewer; unused blocks join the back of the free queue, still cached."""
        ### BEGIN SOLUTION
        if self.ref_count[block] < 1:
            raise ValueError(f"block {block} has no user to release")
        self.ref_count[block] -= 1
        if self.ref_count[block] == 0:
            self.free_queue[block] = None
        ### END SOLUTION

    def register(self, block: int, h: int, parent: int | None, tokens) -> None:
        """Make a computed full block findable under hash h (unless h or the block is taken)."""
        ### BEGIN SOLUTION
        if h in self.cached or self.hash_of[block] is not None:
            return
        self.cached[h] = block
        self.hash_of[block], self.tokens_of[block], self.parent_of[block] = h, tuple(tokens), parent
        ### END SOLUTION

    def lookup(self, h: int, parent: int | None, tokens) -> int | None:
        """The block cached under h, if it really holds `tokens` after block `parent`."""
        ### BEGIN SOLUTION
        block = self.cached.get(h)
        if block is None:
            return None
        if self.tokens_of[block] != tuple(tokens) or self.parent_of[block] != parent:
            self.collisions += 1
            return None
        return block
        ### END SOLUTION
'''),
code(r'''
pool = BlockPool(n_blocks=4, block_size=2)
a, b = pool.take(2)
pool.register(a, hash_block(None, (1, 2)), None, (1, 2))                     # a holds tokens (1, 2)
pool.register(b, hash_block(hash_block(None, (1, 2)), (3, 4)), a, (3, 4))     # b holds (3, 4) after block a
print("took", [a, b], "| free queue", list(pool.free_queue))
pool.release(b); pool.release(a)
print("released both | free queue (LRU first)", list(pool.free_queue), "| cached", len(pool.cached))
print("lookup (1, 2):", pool.lookup(hash_block(None, (1, 2)), None, (1, 2)),
      "| same hash, other tokens:", pool.lookup(hash_block(None, (1, 2)), None, (1, 3)), "| collisions", pool.collisions)
pool.share(a)
print("shared block", a, "| free queue", list(pool.free_queue), "| take(3) evicts:", pool.take(3), "| evictions", pool.evictions)
'''),
tests("block_pool_tests", 4, r"""
from course.expect import Cases, expect_int, expect_ints, expect_type

cases = Cases(points=4)        # one share of the 4 points per case: the feedback lists the cases that failed
# Your pool's answers and state, each checked first (type, then value).
def taken(p, n):
    return expect_ints(p.take(n), f"take({n})", length=n)
def found(p, h, parent, tokens):
    return expect_type(p.lookup(h, parent, tokens), f"lookup({h}, {parent}, {tokens})", int, type(None))
def queue(p):
    return expect_ints(list(expect_type(p.free_queue, "free_queue", OrderedDict)), "free_queue")
def refs(p):
    return expect_ints(p.ref_count, "ref_count")
def cached(p):
    d = expect_type(p.cached, "cached", dict)
    return dict(zip(expect_ints(list(d), "the hashes in cached"), expect_ints(list(d.values()), "the blocks in cached")))
def count(p, name):
    return expect_int(getattr(p, name), name, min=0)
def registered():              # 4 blocks of 2: block 0 holds (5, 6) under hash 111, block 1 holds (7, 8) after it, under 222
    p = BlockPool(n_blocks=4, block_size=2)
    taken(p, 2)
    p.register(0, 111, None, (5, 6)); p.register(1, 222, 0, [7, 8])
    return p
def released():                # the same, both released: cached, with no user
    p = registered()
    p.release(1); p.release(0)
    return p

with cases("take from the front"):
    p = BlockPool(n_blocks=4, block_size=2)
    assert taken(p, 2) == [0, 1] and refs(p) == [1, 1, 0, 0] and queue(p) == [2, 3], "take from the front"
with cases("register records the hash, the tokens and the parent"):
    p = registered()
    assert cached(p) == {111: 0, 222: 1} and tuple(expect_ints(p.tokens_of[1], "tokens_of[1]", container=tuple)) == (7, 8) \
        and expect_int(p.parent_of[1], "parent_of[1]") == 0, "register records the block under its hash, with its tokens (a tuple) and parent"
with cases("released blocks go to the back, still cached"):
    p = released()
    assert queue(p) == [2, 3, 1, 0], "released blocks go to the back, in the order they were released"
    assert cached(p) == {111: 0, 222: 1}, "a released block stays cached"
with cases("lookup: a hit"):
    p = released()
    assert found(p, 111, None, (5, 6)) == 0 and found(p, 222, 0, (7, 8)) == 1, "a hash whose tokens and parent match is a hit"
    assert count(p, "collisions") == 0, "a hit is not a collision"
with cases("lookup: the tokens differ: a collision"):
    p = released()
    assert found(p, 222, 0, (7, 9)) is None and count(p, "collisions") == 1, "a hit whose tokens differ is a collision: no hit"
with cases("lookup: the parent differs: a collision"):
    p = released()
    assert found(p, 222, 3, (7, 8)) is None and count(p, "collisions") == 1, "a hit whose parent differs is a collision too"
with cases("lookup: an unknown hash is a plain miss"):
    p = released()
    assert found(p, 333, None, (1, 2)) is None and count(p, "collisions") == 0, "an unknown hash is a plain miss"
with cases("share takes a cached block out of the free queue"):
    p = released()
    p.share(0)
    assert refs(p)[0] == 1 and 0 not in queue(p), "a shared block leaves the free queue: it must not be evicted"
with cases("take evicts the least recently used cached block"):
    p = released()
    p.share(0)
    assert taken(p, 3) == [2, 3, 1] and count(p, "evictions") == 1 and 222 not in cached(p) and p.hash_of[1] is None, \
        "taking block 1 evicts its cached content"
with cases("a block in use is never evicted: OutOfBlocks"):
    p = released()
    p.share(0)
    taken(p, 3)
    try:
        p.take(1)
    except OutOfBlocks:
        pass
    else:
        raise AssertionError("no free block left (block 0 is in use): take must raise OutOfBlocks")
    assert refs(p) == [1, 1, 1, 1] and 111 in cached(p), "the block in use was not evicted"
### BEGIN HIDDEN TESTS
with cases("a failed take changes nothing"):
    p = BlockPool(n_blocks=3, block_size=2)
    taken(p, 1)
    try:
        p.take(3)
    except OutOfBlocks:
        pass
    else:
        raise AssertionError("3 blocks asked, 2 free: OutOfBlocks")
    assert queue(p) == [1, 2] and refs(p) == [1, 0, 0], "a failed take must change nothing"
with cases("releasing a block with no user raises ValueError"):
    p = BlockPool(n_blocks=3, block_size=2)
    taken(p, 1)
    try:
        p.release(2)
    except ValueError:
        pass
    else:
        raise AssertionError("releasing a block with no user must raise ValueError")
with cases("register never replaces an entry"):
    # register never replaces an entry; a registered block is not registered twice
    p = BlockPool(n_blocks=3, block_size=2)
    taken(p, 1)
    p.register(0, 5, None, (1, 1)); p.register(0, 6, None, (2, 2))
    b, = taken(p, 1)
    p.register(b, 5, None, (1, 1))
    assert cached(p) == {5: 0} and p.hash_of[b] is None, "a hash already in the map keeps its block; a registered block keeps its hash"
def released_five():           # LRU: 5 blocks of 1, registered, released in the order 3, 1, 4, 0, 2
    p = BlockPool(n_blocks=5, block_size=1)
    for i, blk in enumerate(taken(p, 5)):
        p.register(blk, 100 + i, None, (i,))
    for blk in (3, 1, 4, 0, 2):
        p.release(blk)
    return p
with cases("released blocks join the back of the queue, in release order"):
    assert queue(released_five()) == [3, 1, 4, 0, 2], "released blocks join the back of the queue, in release order"
with cases("a cached block used again goes to the back of the queue"):
    p = released_five()
    p.share(1); p.share(1); p.release(1)
    assert 1 not in queue(p) and refs(p)[1] == 1, "two shares, one release: still in use (one user left)"
    p.release(1)
    assert queue(p) == [3, 4, 0, 2, 1], "block 1 was used last: it goes to the back, evicted last"
with cases("evict the least recently used first"):
    p = released_five()
    p.share(1); p.release(1)
    assert taken(p, 2) == [3, 4] and set(cached(p)) == {100, 101, 102}, "evict the least recently used first"
with cases("sharing a block in use counts one more user"):
    # the share of a block in use does not touch the queue
    p = BlockPool(n_blocks=3, block_size=1)
    x, = taken(p, 1); p.register(x, 9, None, (4,)); p.share(x)
    assert refs(p)[x] == 2 and queue(p) == [1, 2], "sharing a block in use only counts one more user"
    for _ in range(2):
        p.release(x)
    assert queue(p) == [1, 2, 0] and refs(p)[x] == 0, "its last release puts it at the back of the queue"
### END HIDDEN TESTS
cases.score()
"""),
md(r"""
## Problem 3: The prefix cache (4 points)

`PrefixCache` puts the pool to work for sequences, like lab 05's allocator: a block table and a length
per sequence. What changes is how a sequence starts:

1. **match**: walk the prompt's full blocks from the first one: compute the chained hashes, and look
   each block up (with its parent, the block matched just before). Stop at the first miss: a block
   after a miss cannot be used, because its keys depend on the block that missed.
2. **allocate**: share the matched blocks, take fresh blocks for the rest, and return how many tokens
   came from the cache and the slots of the others (the engine computes only those).
3. **commit**, after the forward pass: register every full block whose keys and values are now
   written. Not before: a block registered before it is computed could be read half-empty.

One trap: the model must still run on **at least the last prompt token**, because the logits of the
first new token come from it. So match only looks at `tokens[:-1]`. A prompt of exactly 8 tokens,
fully cached in blocks of 4, still recomputes its second block (vLLM does the same).

**Deliverable:** the methods of `PrefixCache`:
- `match(tokens)`: the cached blocks of the longest cached prefix of full blocks of `tokens[:-1]`.
- `allocate(seq, tokens)`: a new sequence: share the matched blocks, `take` the others (first check
  that they fit: a matched block that is free now will stop being free; raise `OutOfBlocks` and change
  nothing if not). Record its table, its length (`len(tokens)`) and `hashes[seq]`, the chained hashes
  of its registered blocks so far (those of the hits). Add `len(tokens)` to `prompt_tokens` and the
  cached tokens to `cached_tokens`. Return `(n_cached, slots)`: the number of tokens that came from the
  cache and the slots of the other tokens, in order (slot = `block * block_size + offset`).
- `append(seq, n)`: `n` more tokens (decoding): new blocks only when the last one is full; their slots.
- `commit(seq, tokens)`: register each full block among the first `lengths[seq]` tokens that is not
  registered yet, with its chained hash and its parent block, extending `hashes[seq]`.
- `free(seq)`: release the sequence's blocks **last block first**, so that its first blocks, the ones
  other requests are most likely to share, are the last to be evicted. Unknown `seq`: `KeyError`.

Graded case by case: each scenario of the tests earns its share of the 4 points, and the feedback lists the
cases that failed.
"""),
solution("prefix_cache", r'''
class PrefixCache:
    """Sequences over a BlockPool whose full blocks are found again by their chained hash."""

    def __init__(self, n_blocks: int, block_size: int, hash_fn=hash_block, enabled: bool = True):
        self.pool = BlockPool(n_blocks, block_size)
        self.block_size, self.hash_fn, self.enabled = block_size, hash_fn, enabled
        self.tables: dict = {}          # seq -> physical blocks, in logical order
        self.lengths: dict = {}         # seq -> tokens that have a slot
        self.hashes: dict = {}          # seq -> chained hashes of its first registered blocks
        self.prompt_tokens = 0          # over all allocate() calls
        self.cached_tokens = 0          # of which came from the cache

    @property
    def hit_rate(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    def slot(self, seq, p: int) -> int:
        return self.tables[seq][p // self.block_size] * self.block_size + p % self.block_size

    def match(self, tokens: list[int]) -> list[int]:
        """Cached blocks of the longest cached run of full blocks of tokens[:-1]."""
        if not self.enabled:
            return []
        ### BEGIN SOLUTION
        bs, blocks, parent = self.block_size, [], None
        for i, h in enumerate(block_hashes(tokens[:len(tokens) - 1], bs, self.hash_fn)):
            block = self.pool.lookup(h, parent, tokens[i * bs:(i + 1) * bs])
            if block is None:
                break
            blocks.append(block)
            parent = block
        return blocks
        ### END SOLUTION

    def allocate(self, seq, tokens: list[int]) -> tuple[int, list[int]]:
        """Blocks for a new sequence: (tokens found in the cache, slots of the tokens to compute)."""
        if seq in self.tables:
            raise ValueError(f"sequence {seq} already has blocks")
        if len(tokens) == 0:
            raise ValueError("tokens must hold at least one token")
        ### BEGIN SOLUTION
        bs = self.block_size
        hits = self.match(tokens)
        need = -(-len(tokens) // bs) - len(hits)
        free_after = self.pool.n_free - sum(self.pool.ref_count[b] == 0 for b in hits)
        if need > free_after:
            raise OutOfBlocks(f"sequence {seq} needs {need} new blocks, but only {free_after} are free")
        for b in hits:
            self.pool.share(b)
        self.tables[seq] = hits + self.pool.take(need)
        self.lengths[seq] = len(tokens)
        n_cached = len(hits) * bs
        self.hashes[seq] = block_hashes(tokens[:n_cached], bs, self.hash_fn)
        self.prompt_tokens += len(tokens)
        self.cached_tokens += n_cached
        return n_cached, [self.slot(seq, p) for p in range(n_cached, len(tokens))]
        ### END SOLUTION

    def append(self, seq, n: int) -> list[int]:
        """Slots for n more tokens of seq."""
        ### BEGIN SOLUTION
        bs, table, length = self.block_size, self.tables[seq], self.lengths[seq]
        table.extend(self.pool.take(-(-(length + n) // bs) - len(table)))
        self.lengths[seq] = length + n
        return [self.slot(seq, p) for p in range(length, length + n)]
        ### END SOLUTION

    def commit(self, seq, tokens: list[int]) -> None:
        """Register seq's computed full blocks (tokens: at least its first lengths[seq] tokens)."""
        ### BEGIN SOLUTION
        bs, table, known = self.block_size, self.tables[seq], self.hashes[seq]
        for i in range(len(known), min(self.lengths[seq], len(tokens)) // bs):
            block = tuple(tokens[i * bs:(i + 1) * bs])
            h = self.hash_fn(known[-1] if known else None, block)
            self.pool.register(table[i], h, table[i - 1] if i else None, block)
            known.append(h)
        ### END SOLUTION

    def free(self, seq) -> None:
        """Release seq's blocks, last block first."""
        ### BEGIN SOLUTION
        if seq not in self.tables:
            raise KeyError(f"sequence {seq} holds no blocks")
        for b in reversed(self.tables.pop(seq)):
            self.pool.release(b)
        del self.lengths[seq], self.hashes[seq]
        ### END SOLUTION
'''),
code(r'''
pc = PrefixCache(n_blocks=32, block_size=16)
for seq, p in enumerate(prompts[:3]):
    n_cached, slots = pc.allocate(seq, p)
    pc.commit(seq, p)                       # (here nothing is computed: we only watch the bookkeeping)
    print(f"request {seq}: {len(p)} prompt tokens, {n_cached} from the cache, table {pc.tables[seq]}")
    pc.free(seq)
print(f"hit rate {pc.hit_rate:.0%}; blocks in the map: {len(pc.pool.cached)}; free queue: {list(pc.pool.free_queue)}")
'''),
md(r"""
The tests of this problem and the next run your code on the course's answers to the problems before
it (`course.engine.prefix_cache`, where this lab is released for the labs after it): a mistake in an
earlier problem then costs only that problem's points. The course's pool keeps a block's hash,
parent and tokens in one `meta` entry, and its cache counts `queried_tokens` and `hit_tokens`; the
cell below gives them this lab's names.
"""),
locked("course_answers", r'''
from course.engine import prefix_cache as course_prefix_cache


class CourseBlockPool(course_prefix_cache.BlockPool):
    """The course's answer to Problem 2, with this lab's names: hash_of, parent_of, tokens_of, collisions."""

    def __init__(self, n_blocks: int, block_size: int):
        super().__init__(n_blocks, block_size)
        self.collisions = 0

    hash_of = property(lambda self: [None if m is None else m[0] for m in self.meta])
    parent_of = property(lambda self: [None if m is None else m[1] for m in self.meta])
    tokens_of = property(lambda self: [None if m is None else m[2] for m in self.meta])

    def lookup(self, h, parent, tokens):
        block = super().lookup(h, parent, tokens)
        self.collisions += block is None and h in self.cached          # found under h, but the check failed
        return block


class CoursePrefixCache(course_prefix_cache.PrefixCache):
    """The course's answer to Problem 3 on CourseBlockPool, with this lab's names: prompt_tokens, cached_tokens."""

    def __init__(self, n_blocks: int, block_size: int, hash_fn=hash_block, enabled: bool = True):
        super().__init__(n_blocks, block_size, enabled=enabled, hash_fn=hash_fn)
        self.pool = CourseBlockPool(n_blocks, block_size)

    prompt_tokens = property(lambda self: self.queried_tokens)
    cached_tokens = property(lambda self: self.hit_tokens)
'''),
tests("prefix_cache_tests", 4, r"""
from course.expect import Cases, expect_float, expect_int, expect_ints, expect_tuple, substituted

cases = Cases(points=4)        # one share of the 4 points per case: the feedback lists the cases that failed
# Your cache's answers and state, each checked first (type, then value).
def allocated(pc, seq, tokens):
    n, slots = expect_tuple(pc.allocate(seq, tokens), f"allocate({seq!r}, {tokens})", 2)
    return expect_int(n, f"allocate({seq!r}, ...)[0] (tokens from the cache)", min=0), expect_ints(slots, f"allocate({seq!r}, ...)[1] (slots)")
def appended(pc, seq, n):
    return expect_ints(pc.append(seq, n), f"append({seq!r}, {n})", length=n)
def table(pc, seq):
    return expect_ints(pc.tables[seq], f"tables[{seq!r}]")
def counted(pc, name):
    return expect_int(getattr(pc, name), name, min=0)
def course_parts():
    # Graded on its own: in each case your PrefixCache runs on the course's block_hashes and BlockPool
    # (Problems 1 and 2), so a mistake there costs only their points.
    return substituted(globals(), block_hashes=course_prefix_cache.block_hashes, BlockPool=CourseBlockPool)
def warm():                    # sequence "a" = [1, 2, 3, 4, 5] allocated and committed, in blocks of 2
    pc = PrefixCache(n_blocks=8, block_size=2)
    allocated(pc, "a", [1, 2, 3, 4, 5])
    pc.commit("a", [1, 2, 3, 4, 5])
    return pc
def four():                    # then "b" = a's prompt, "c" = its first 4 tokens, "d" another prefix
    pc = warm()
    allocated(pc, "b", [1, 2, 3, 4, 5]); allocated(pc, "c", [1, 2, 3, 4]); allocated(pc, "d", [9, 9, 3, 4, 5])
    return pc

with cases("a cold cache: no hit"), course_parts():
    pc = PrefixCache(n_blocks=8, block_size=2)
    assert allocated(pc, "a", [1, 2, 3, 4, 5]) == (0, [0, 1, 2, 3, 4]) and table(pc, "a") == [0, 1, 2], "a cold cache: no hit"
with cases("commit registers the full blocks"), course_parts():
    pc = warm()
    assert sorted(pc.pool.cached.values()) == [0, 1], "blocks (1, 2) and (3, 4) are registered; the partial block [5] is not"
    assert expect_ints(pc.hashes["a"], "hashes['a']") == block_hashes([1, 2, 3, 4], 2), "hashes[seq]: the chained hashes of its registered blocks"
with cases("the same prompt again shares the full blocks"), course_parts():
    pc = warm()
    n, slots = allocated(pc, "b", [1, 2, 3, 4, 5])
    assert n == 4 and table(pc, "b")[:2] == [0, 1] and table(pc, "b")[2] != 2, \
        "b shares the two full blocks; the partial last block is never shared"
    assert slots == [table(pc, "b")[2] * 2] and pc.pool.ref_count[:2] == [2, 2], "b computes only its last token, in a block of its own"
with cases("a fully cached prompt still computes its last block"), course_parts():
    assert allocated(warm(), "c", [1, 2, 3, 4])[0] == 2, \
        "4 tokens, fully cached: still compute the last block (its logits are needed): match only tokens[:-1]"
with cases("the same block after another prefix: no hit"), course_parts():
    assert allocated(warm(), "d", [9, 9, 3, 4, 5])[0] == 0, "(3, 4) after (9, 9) is another prefix: no hit"
with cases("prompt_tokens and cached_tokens"), course_parts():
    pc = four()
    assert counted(pc, "prompt_tokens") == 19 and counted(pc, "cached_tokens") == 6, \
        "prompt_tokens counts every prompt token (5 + 5 + 4 + 5), cached_tokens the tokens (not blocks) that came from the cache (4 + 2)"
with cases("free releases the blocks"), course_parts():
    pc = four()
    pc.free("a")
    assert pc.pool.ref_count[:3] == [2, 1, 0] and list(pc.pool.free_queue)[-1] == 2, \
        "free('a') releases one user of each of a's blocks: block 0 (shared by a, b, c) keeps 2, block 1 (a, b) keeps 1, " \
        "block 2 (a's own) has none left and joins the back of the free queue"
with cases("append fills the last block, then takes a new one"), course_parts():
    pc = four()
    pc.free("a")
    assert appended(pc, "b", 1) == [table(pc, "b")[2] * 2 + 1] and appended(pc, "b", 1) == [table(pc, "b")[3] * 2], \
        "append fills the last block, then takes a new one"
with cases("a block filled while decoding is registered too"), course_parts():
    pc = four()
    pc.free("a")
    appended(pc, "b", 1); appended(pc, "b", 1)
    pc.commit("b", [1, 2, 3, 4, 5, 6, 7])
    assert pc.pool.hash_of[table(pc, "b")[2]] == block_hashes([1, 2, 3, 4, 5, 6], 2)[2], "a block filled while decoding is registered too"
    for s in ("b", "c", "d"):
        pc.free(s)
    assert pc.pool.n_free == 8 and not any(pc.pool.ref_count), "after every free, every block is free"
# LRU: the oldest released blocks go first; a request's last block is released first
def released_one():
    pc = PrefixCache(n_blocks=6, block_size=2)
    allocated(pc, 0, [1, 2, 3, 4, 5]); pc.commit(0, [1, 2, 3, 4, 5]); pc.free(0)
    return pc
with cases("free releases the last block first"), course_parts():
    assert list(released_one().pool.free_queue) == [3, 4, 5, 2, 1, 0], "released blocks go to the back, the last block first"
with cases("LRU: the oldest released blocks are evicted first"), course_parts():
    pc = released_one()
    allocated(pc, 1, [7] * 10); pc.free(1)
    assert allocated(pc, 2, [1, 2, 3, 4, 5])[0] == 2, "LRU: block (3, 4) must be evicted before block (1, 2)"
### BEGIN HIDDEN TESTS
import random
# eviction never frees a referenced block; contents stay right under random traffic (strong hash)
""" + HIDDEN_STRESS + r"""
for bs, n_blocks, seed in ((1, 12, 1), (2, 10, 2), (3, 16, 3), (4, 9, 4)):
    with cases(f"random traffic on {n_blocks} blocks of {bs}"), course_parts():
        _stress(hash_block, n_blocks, bs, 300, seed)
# collisions: weak hashes must never give a wrong hit (the token check)
for bs, seed in ((2, 5), (3, 6)):
    with cases(f"hashes that collide, blocks of {bs}: never a wrong hit"), course_parts():
        pc = _stress(lambda p, t: 0, 12, bs, 250, seed)
        assert pc.pool.collisions > 0, "with a constant hash every lookup collides; the check must count it"
        _stress(lambda p, t: (sum(t) + (p or 0)) % 3, 12, bs, 250, seed + 10)
        _stress(lambda p, t: hash(t) % 5, 12, bs, 250, seed + 20)
# OutOfBlocks changes nothing, and matched free blocks count against what is free
def crowded():                 # block (1, 2) cached with no user; 2 blocks free, one of them block (1, 2)
    pc = PrefixCache(n_blocks=3, block_size=2)
    allocated(pc, 0, [1, 2, 3]); pc.commit(0, [1, 2, 3]); pc.free(0)
    allocated(pc, 1, [5, 5])
    return pc
with cases("a matched block that is free now counts against the free blocks"), course_parts():
    pc = crowded()
    try:
        pc.allocate(2, [1, 2, 3, 4, 5])
    except OutOfBlocks:
        pass
    else:
        raise AssertionError("block (1, 2) is a hit but is one of the 2 free blocks: 2 more are needed, only 1 is left: OutOfBlocks")
with cases("a failed allocate changes nothing"), course_parts():
    pc = crowded()
    try:
        pc.allocate(2, [1, 2, 3, 4, 5])
    except OutOfBlocks:
        pass
    assert 2 not in pc.tables and pc.pool.ref_count == [0, 0, 1] and list(pc.pool.free_queue) == [1, 0], \
        "a failed allocate changes nothing: check that everything fits before you share or take a block"
    assert counted(pc, "prompt_tokens") == 5 and counted(pc, "cached_tokens") == 0, "a failed allocate counts nothing"
    assert allocated(pc, 3, [1, 2, 9])[0] == 2, "the failed allocate must not have shared or evicted block (1, 2)"
with cases("free of an unknown sequence raises KeyError"), course_parts():
    pc = crowded()
    try:
        pc.free("nobody")
    except KeyError:
        pass
    else:
        raise AssertionError("free of an unknown sequence must raise KeyError")
with cases("the cache switched off: no hits"), course_parts():
    pc = PrefixCache(n_blocks=6, block_size=2, enabled=False)
    allocated(pc, 0, [1, 2, 3]); pc.commit(0, [1, 2, 3]); pc.free(0)
    assert allocated(pc, 1, [1, 2, 3])[0] == 0 and expect_float(pc.hit_rate, "hit_rate") == 0, "enabled=False: never a hit"
# exact multiples and one-token prompts
def multiples():               # blocks of 3: [4, 5, 6, 7, 8, 9] committed
    pc = PrefixCache(n_blocks=10, block_size=3)
    allocated(pc, 0, [4, 5, 6, 7, 8, 9]); pc.commit(0, [4, 5, 6, 7, 8, 9])
    return pc
with cases("exact block multiples and one-token prompts"), course_parts():
    pc = multiples()
    assert len(pc.pool.cached) == 2, "6 tokens in blocks of 3: both blocks are full and registered"
    assert allocated(pc, 1, [4, 5, 6, 7, 8, 9, 1])[0] == 6 and allocated(pc, 2, [4])[0] == 0, \
        "7 tokens: both full blocks from the cache; a one-token prompt: nothing"
    assert allocated(pc, 3, [4, 5, 6, 7, 8, 9])[0] == 3, "6 tokens, fully cached: the last block is recomputed"
with cases("commit is incremental and idempotent"), course_parts():
    pc = multiples()
    allocated(pc, 1, [4, 5, 6, 7, 8, 9, 1])
    before = dict(pc.pool.cached)
    pc.commit(1, [4, 5, 6, 7, 8, 9, 1]); pc.commit(1, [4, 5, 6, 7, 8, 9, 1])
    assert pc.pool.cached == before and expect_ints(pc.hashes[1], "hashes[1]") == block_hashes([4, 5, 6, 7, 8, 9], 3), \
        "committing blocks that are already registered changes nothing"
with cases("a block filled by append is registered by the next commit"), course_parts():
    pc = multiples()
    allocated(pc, 1, [4, 5, 6, 7, 8, 9, 1]); pc.commit(1, [4, 5, 6, 7, 8, 9, 1])
    appended(pc, 1, 2); pc.commit(1, [4, 5, 6, 7, 8, 9, 1, 2, 3])
    assert expect_ints(pc.hashes[1], "hashes[1]") == block_hashes([4, 5, 6, 7, 8, 9, 1, 2, 3], 3) and len(pc.pool.cached) == 3, \
        "a block filled by append is registered by the next commit"
    assert pc.pool.parent_of[table(pc, 1)[2]] == table(pc, 1)[1], "the parent of a block is the block before it in the table"
### END HIDDEN TESTS
cases.score()
"""),
]

from autograder.lab_builders.lab09_engine import CELLS as ENGINE  # noqa: E402
from autograder.lab_builders.lab09_radix import CELLS as RADIX  # noqa: E402

cells = INTRO + ENGINE + RADIX

if __name__ == "__main__":
    write_notebook("labs/09_prefix_caching/09_prefix_caching.ipynb", cells + [md(CHECK_YOUR_WORK)])
    print("wrote labs/09_prefix_caching/09_prefix_caching.ipynb")
