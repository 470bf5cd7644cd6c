"""Builds the lab 09 source notebook. Edit this file, then run from the repo root:

    .venv/bin/python -m autograder.lab_builders.lab09
"""
from autograder.authoring import code, locked, md, solution, tests, write_notebook  # noqa: E402
from autograder.lab_builders.hidden_refs import greedy_and_tiny  # noqa: E402
from autograder.lab_builders.common_cells import CHECK_YOUR_WORK, COLAB_INSTALL, SETUP  # noqa: E402

# Independent references of the hidden tests (they live only here, in the instructor's source):
# a greedy loop with no cache at all, tiny random models, and a "pool content" model that writes
# each token's id into its slot and reads every live sequence back through its table.
HIDDEN_REF = greedy_and_tiny(max_seq_len=128)

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
                slots = pc.append(seq, 1)
            except OutOfBlocks:
                continue
            tok = rng.randrange(4)
            content[slots[0]] = tok
            live[seq].append(tok)
            pc.commit(seq, live[seq])
        else:
            toks = rng.choice(stems) + [rng.randrange(4) for _ in range(rng.randint(0, 2 * bs))]
            try:
                n_cached, slots = pc.allocate(nxt, toks)
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

cells = [
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

**Time:** about 2 hours. **Hardware:** everything runs on a laptop CPU (small workloads there);
a GPU only makes the measurements bigger.
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
model = course.load_model(device=env.device)
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
with torch.inference_mode():
    t_full = benchmark(lambda: model(torch.tensor([prompts[0]], device=dev), torch.arange(len(prompts[0]), device=dev)[None]),
                       repeats=env.pick(5, 2), device=dev)
    t_question = benchmark(lambda: model(torch.tensor([question_only], device=dev), torch.arange(len(question_only), device=dev)[None]),
                           repeats=env.pick(5, 2), device=dev)
print(f"prefill of the whole prompt ({len(prompts[0])} tokens): {1e3 * t_full.median:.0f} ms; "
      f"of the question alone ({len(question_only)} tokens): {1e3 * t_question.median:.0f} ms")
'''),
md(r"""
Those are your numbers. Most of the time to first token goes to tokens whose keys and values some
earlier request already computed. The keys and values of a token depend only on the tokens before it
(causal attention), so the same prefix gives the same keys and values, whoever sends it.
Keeping them is all prefix caching does. The hard parts are finding them fast, sharing them safely,
and deciding what to throw away when memory runs out.

## 2. A name for every block: chained hashes

Lab 05 cut a sequence's cache into blocks of `block_size` tokens. To reuse a block we need to find
it from the tokens of a new request. A block's keys and values depend on its own tokens **and on
every token before it**. So the name of block `i` must cover the whole prefix up to its end. vLLM
gets that cheaply with a **chain**: the hash of block `i` is the hash of (hash of block `i - 1`,
tokens of block `i`).

```
tokens:  [The cat sat on] [the mat and  ] [slept  .   ]        block_size = 4
hash 0 = H(None,   (The, cat, sat, on))
hash 1 = H(hash 0, (the, mat, and, ...))      <- covers all 8 tokens, through hash 0
(no hash for the last block: it is not full yet, and its keys and values will still grow)
```

Only **full** blocks get a hash. A partly filled block belongs to its sequence alone: the next
token will be written into it, so no one else may read it as "the prefix".

`hash_block` (given) is `H`: 64 bits of SHA-256. Two different prefixes give the same hash with
probability about 2^-64 per pair, which is why vLLM uses a strong hash. Python's built-in `hash`
is faster but easier to collide; we will also defend against collisions with a token check.
"""),
locked("hash_block", r'''
class OutOfBlocks(RuntimeError):
    """The pool has fewer free blocks than a request needs."""


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
show = lambda p, t: (p, t)                                    # a "hash" that shows what it was given
assert block_hashes([1, 2, 3, 4], 2, hash_fn=show) == [(None, (1, 2)), ((None, (1, 2)), (3, 4))], \
    "hash 1 = hash_fn(hash 0, (3, 4)): each hash takes the previous one and a tuple of the block's tokens"
assert block_hashes([1, 2, 3, 4, 5], 2, hash_fn=show)[-1] == ((None, (1, 2)), (3, 4)), "the partial block [5] gets no hash"
assert len(block_hashes(list(range(10)), 4)) == 2 and block_hashes([1, 2, 3], 4) == [], "only full blocks"
h1, h2 = block_hashes([1, 2, 9, 9], 2), block_hashes([3, 4, 9, 9], 2)
assert h1[1] != h2[1], "the same block (9, 9) after different prefixes must get different hashes: chain the parent"
assert block_hashes([1, 2, 3, 4], 2) == [hash_block(None, (1, 2)), hash_block(hash_block(None, (1, 2)), (3, 4))]
### BEGIN HIDDEN TESTS
assert block_hashes([], 3) == [] and block_hashes([5], 1) == [hash_block(None, (5,))]
for bs in (1, 3, 4, 16):
    rng = random.Random(bs)
    toks = [rng.randrange(50) for _ in range(5 * bs + bs // 2)]
    got = block_hashes(toks, bs)
    want, parent = [], None
    for i in range(len(toks) // bs):
        parent = hash_block(parent, tuple(toks[i * bs:(i + 1) * bs]))
        want.append(parent)
    assert got == want, f"block_size {bs}: hashes differ from the chain hash_block(previous hash, block)"
    assert block_hashes(toks[:3 * bs], bs) == want[:3], "exact block multiples: every block is full and hashed"
    other = [toks[0] + 1] + toks[1:]
    assert all(x != y for x, y in zip(block_hashes(other, bs), want)), \
        "changing the first token must change every later hash (the chain)"
assert block_hashes((1, 2, 3, 4), 2, hash_fn=show) == [(None, (1, 2)), ((None, (1, 2)), (3, 4))], "tuples of tokens too"
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
- `register(block, h, parent, tokens)`: the block now holds `tokens` after block `parent` and is found
  under hash `h`. If `h` is already in `cached`, or the block is already registered, do nothing (the
  block stays private and is freed like any block).
- `lookup(h, parent, tokens)`: the block cached under `h` if its tokens and its parent match, else
  None. A block found under `h` that fails the check is a collision: count it in `collisions`.
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
p = BlockPool(n_blocks=4, block_size=2)
assert p.take(2) == [0, 1] and p.ref_count == [1, 1, 0, 0] and list(p.free_queue) == [2, 3], "take from the front"
p.register(0, 111, None, (5, 6)); p.register(1, 222, 0, [7, 8])
assert p.cached == {111: 0, 222: 1} and p.tokens_of[1] == (7, 8) and p.parent_of[1] == 0
p.release(1); p.release(0)
assert list(p.free_queue) == [2, 3, 1, 0], "released blocks go to the back, in the order they were released"
assert p.cached == {111: 0, 222: 1}, "a released block stays cached"
assert p.lookup(111, None, (5, 6)) == 0 and p.lookup(222, 0, (7, 8)) == 1
assert p.lookup(222, 0, (7, 9)) is None and p.collisions == 1, "a hit whose tokens differ is a collision: no hit"
assert p.lookup(222, 3, (7, 8)) is None and p.collisions == 2, "a hit whose parent differs is a collision too"
assert p.lookup(333, None, (1, 2)) is None and p.collisions == 2, "an unknown hash is a plain miss"
p.share(0)
assert p.ref_count[0] == 1 and 0 not in p.free_queue, "a shared block leaves the free queue: it must not be evicted"
assert p.take(3) == [2, 3, 1] and p.evictions == 1 and 222 not in p.cached and p.hash_of[1] is None, \
    "taking block 1 evicts its cached content"
try:
    p.take(1)
except OutOfBlocks:
    pass
else:
    raise AssertionError("no free block left (block 0 is in use): take must raise OutOfBlocks")
assert p.ref_count == [1, 1, 1, 1] and 111 in p.cached, "the block in use was not evicted"
### BEGIN HIDDEN TESTS
# OutOfBlocks changes nothing
p = BlockPool(n_blocks=3, block_size=2)
p.take(1)
try:
    p.take(3)
except OutOfBlocks:
    pass
else:
    raise AssertionError("3 blocks asked, 2 free: OutOfBlocks")
assert list(p.free_queue) == [1, 2] and p.ref_count == [1, 0, 0], "a failed take must change nothing"
try:
    p.release(2)
except ValueError:
    pass
else:
    raise AssertionError("releasing a block with no user must raise ValueError")
# register never replaces an entry; a registered block is not registered twice
p.register(0, 5, None, (1, 1)); p.register(0, 6, None, (2, 2))
b, = p.take(1)
p.register(b, 5, None, (1, 1))
assert p.cached == {5: 0} and p.hash_of[b] is None, "a hash already in the map keeps its block"
# LRU: a block reused and released again moves to the back
p = BlockPool(n_blocks=5, block_size=1)
blocks = p.take(5)
for i, blk in enumerate(blocks):
    p.register(blk, 100 + i, None, (i,))
for blk in (3, 1, 4, 0, 2):
    p.release(blk)
assert list(p.free_queue) == [3, 1, 4, 0, 2]
p.share(1); p.share(1); p.release(1)
assert 1 not in p.free_queue and p.ref_count[1] == 1, "two shares, one release: still in use"
p.release(1)
assert list(p.free_queue) == [3, 4, 0, 2, 1], "block 1 was used last: it goes to the back, evicted last"
assert p.take(2) == [3, 4] and set(p.cached) == {100, 101, 102}, "evict the least recently used first"
# the share of a block in use does not touch the queue
p = BlockPool(n_blocks=3, block_size=1)
x, = p.take(1); p.register(x, 9, None, (4,)); p.share(x)
assert p.ref_count[x] == 2 and list(p.free_queue) == [1, 2]
for _ in range(2):
    p.release(x)
assert list(p.free_queue) == [1, 2, 0] and p.ref_count[x] == 0
### END HIDDEN TESTS
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
tests("prefix_cache_tests", 4, r"""
pc = PrefixCache(n_blocks=8, block_size=2)
assert pc.allocate("a", [1, 2, 3, 4, 5]) == (0, [0, 1, 2, 3, 4]) and pc.tables["a"] == [0, 1, 2], "a cold cache: no hit"
pc.commit("a", [1, 2, 3, 4, 5])
assert sorted(pc.pool.cached.values()) == [0, 1], "blocks (1, 2) and (3, 4) are registered; the partial block [5] is not"
assert pc.hashes["a"] == block_hashes([1, 2, 3, 4], 2)
n, slots = pc.allocate("b", [1, 2, 3, 4, 5])
assert n == 4 and pc.tables["b"][:2] == [0, 1] and pc.tables["b"][2] != 2, \
    "b shares the two full blocks; the partial last block is never shared"
assert slots == [pc.tables["b"][2] * 2] and pc.pool.ref_count[:2] == [2, 2]
assert pc.allocate("c", [1, 2, 3, 4])[0] == 2, "4 tokens, fully cached: still compute the last block (its logits are needed)"
assert pc.allocate("d", [9, 9, 3, 4, 5])[0] == 0, "(3, 4) after (9, 9) is another prefix: no hit"
assert pc.prompt_tokens == 19 and pc.cached_tokens == 6
pc.free("a")
assert pc.pool.ref_count[:3] == [2, 1, 0] and list(pc.pool.free_queue)[-1] == 2, "free releases the blocks"
assert pc.append("b", 1) == [pc.tables["b"][2] * 2 + 1] and pc.append("b", 1) == [pc.tables["b"][3] * 2]
pc.commit("b", [1, 2, 3, 4, 5, 6, 7])
assert pc.pool.hash_of[pc.tables["b"][2]] == block_hashes([1, 2, 3, 4, 5, 6], 2)[2], "a block filled while decoding is registered too"
for s in ("b", "c", "d"):
    pc.free(s)
assert pc.pool.n_free == 8 and not any(pc.pool.ref_count)
# LRU: the oldest released blocks go first; a request's last block is released first
pc = PrefixCache(n_blocks=6, block_size=2)
pc.allocate(0, [1, 2, 3, 4, 5]); pc.commit(0, [1, 2, 3, 4, 5]); pc.free(0)
assert list(pc.pool.free_queue) == [3, 4, 5, 2, 1, 0], "released blocks go to the back, the last block first"
pc.allocate(1, [7] * 10); pc.free(1)
assert pc.allocate(2, [1, 2, 3, 4, 5])[0] == 2, "LRU: block (3, 4) must be evicted before block (1, 2)"
### BEGIN HIDDEN TESTS
import random
# eviction never frees a referenced block; contents stay right under random traffic (strong hash)
""" + HIDDEN_STRESS + r"""
for bs, n_blocks, seed in ((1, 12, 1), (2, 10, 2), (3, 16, 3), (4, 9, 4)):
    _stress(hash_block, n_blocks, bs, 300, seed)
# collisions: weak hashes must never give a wrong hit (the token check)
for bs, seed in ((2, 5), (3, 6)):
    pc = _stress(lambda p, t: 0, 12, bs, 250, seed)
    assert pc.pool.collisions > 0, "with a constant hash every lookup collides; the check must count it"
    _stress(lambda p, t: (sum(t) + (p or 0)) % 3, 12, bs, 250, seed + 10)
    _stress(lambda p, t: hash(t) % 5, 12, bs, 250, seed + 20)
# OutOfBlocks changes nothing, and matched free blocks count against what is free
pc = PrefixCache(n_blocks=3, block_size=2)
pc.allocate(0, [1, 2, 3]); pc.commit(0, [1, 2, 3]); pc.free(0)
pc.allocate(1, [5, 5])
try:
    pc.allocate(2, [1, 2, 3, 4, 5])
except OutOfBlocks:
    pass
else:
    raise AssertionError("block (1, 2) is a hit but is one of the 2 free blocks: 2 more are needed, only 1 is left")
assert 2 not in pc.tables and pc.pool.ref_count == [0, 0, 1] and list(pc.pool.free_queue) == [1, 0], \
    "a failed allocate changes nothing"
assert pc.prompt_tokens == 5 and pc.cached_tokens == 0, "a failed allocate counts nothing"
assert pc.allocate(3, [1, 2, 9])[0] == 2, "the failed allocate must not have shared or evicted block (1, 2)"
try:
    pc.free("nobody")
except KeyError:
    pass
else:
    raise AssertionError("free of an unknown sequence must raise KeyError")
# the cache can be switched off: no hits, same bookkeeping
pc = PrefixCache(n_blocks=6, block_size=2, enabled=False)
pc.allocate(0, [1, 2, 3]); pc.commit(0, [1, 2, 3]); pc.free(0)
assert pc.allocate(1, [1, 2, 3])[0] == 0 and pc.hit_rate == 0
# exact multiples and one-token prompts
pc = PrefixCache(n_blocks=10, block_size=3)
pc.allocate(0, [4, 5, 6, 7, 8, 9]); pc.commit(0, [4, 5, 6, 7, 8, 9])
assert len(pc.pool.cached) == 2, "6 tokens in blocks of 3: both blocks are full and registered"
assert pc.allocate(1, [4, 5, 6, 7, 8, 9, 1])[0] == 6 and pc.allocate(2, [4])[0] == 0
assert pc.allocate(3, [4, 5, 6, 7, 8, 9])[0] == 3
# commit is incremental and idempotent
before = dict(pc.pool.cached)
pc.commit(1, [4, 5, 6, 7, 8, 9, 1]); pc.commit(1, [4, 5, 6, 7, 8, 9, 1])
assert pc.pool.cached == before and pc.hashes[1] == block_hashes([4, 5, 6, 7, 8, 9], 3)
pc.append(1, 2); pc.commit(1, [4, 5, 6, 7, 8, 9, 1, 2, 3])
assert pc.hashes[1] == block_hashes([4, 5, 6, 7, 8, 9, 1, 2, 3], 3) and len(pc.pool.cached) == 3
assert pc.pool.parent_of[pc.tables[1][2]] == pc.tables[1][1], "the parent of a block is the block before it in the table"
### END HIDDEN TESTS
"""),
md(r"""
## 4. The engine skips what is cached

The engine of lab 05, now on the prefix cache. Lab 05's answers come given below (`write_kv` and the
reference paged attention), and one new piece: `forward_extend`, a prefill that starts in the middle.
Lab 05's prefill assumed nothing was cached, so its new tokens attended only to each other. Here the
new tokens (positions `n_cached` onwards) must also attend to the cached tokens before them. So each
layer writes the new keys and values into their slots, gathers the first `n_cached + T` keys and values
of the sequence through its block table, and runs causal attention with the new tokens as queries.
"""),
locked("given_paged", r'''
def write_kv(k_cache, v_cache, k, v, slot_mapping):
    """Lab 05: store k[i], v[i] (N, Hkv, D) into slot slot_mapping[i]; a negative slot is skipped."""
    n_blocks, block_size, Hkv, D = k_cache.shape
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    k_cache.view(n_blocks * block_size, Hkv, D)[slots] = k[keep]
    v_cache.view(n_blocks * block_size, Hkv, D)[slots] = v[keep]


def paged_attention_ref(q, k_cache, v_cache, block_tables, context_lens, scale):
    """Lab 05: decode attention, q (B, H, D) over each sequence's context_lens[b] tokens through its block table."""
    B, H, D = q.shape
    _, block_size, Hkv, _ = k_cache.shape
    out = torch.empty_like(q)
    for b in range(B):
        L = int(context_lens[b])
        blocks = block_tables[b, :-(-L // block_size)].long()
        k = k_cache[blocks].reshape(-1, Hkv, D)[:L].float().repeat_interleave(H // Hkv, dim=1)   # (L, H, D)
        v = v_cache[blocks].reshape(-1, Hkv, D)[:L].float().repeat_interleave(H // Hkv, dim=1)
        scores = torch.einsum("hd,lhd->hl", q[b].float(), k) * scale                             # (H, L)
        out[b] = torch.einsum("hl,lhd->hd", scores.softmax(dim=-1), v).to(q.dtype)
    return out


@torch.no_grad()
def forward_extend(model, input_ids, position_ids, cache: PagedKVCache, slot_mapping, block_table: list[int]):
    """Prefill of one sequence whose first position_ids[0, 0] tokens are already in its blocks.
    input_ids, position_ids: (1, T), the new tokens; slot_mapping: (T,); returns logits (1, T, V)."""
    cfg = model.cfg
    check_ids(input_ids, position_ids, cfg)
    B, T = input_ids.shape
    if B != 1 or slot_mapping.shape != (T,):
        raise ValueError(f"forward_extend takes one sequence: input_ids (1, T) and slot_mapping (T,); "
                         f"got {(B, T)} and {tuple(slot_mapping.shape)}")
    H, Hkv, D, bs = cfg.n_head, cfg.n_kv_head, cfg.head_dim, cache.block_size
    L = int(position_ids[0, -1]) + 1                                        # context: cached + new tokens
    if len(block_table) * bs < L:
        raise ValueError(f"the block table holds {len(block_table) * bs} slots; the context needs {L}")
    blocks = torch.tensor(block_table[:-(-L // bs)], device=cache.device)
    mask = torch.arange(L, device=cache.device)[None, :] <= position_ids[0, :, None]   # (T, L): causal
    x, rope = embed(model, input_ids, position_ids)                         # (1, T, C)
    for i, block in enumerate(model.blocks):
        q, k, v = project_qkv(model, block, x, rope)                        # (1, H, T, D), (1, Hkv, T, D) x 2
        k_cache, v_cache = cache.layer(i)
        write_kv(k_cache, v_cache, k[0].transpose(0, 1).to(k_cache.dtype), v[0].transpose(0, 1).to(v_cache.dtype), slot_mapping)
        kk = k_cache[blocks].reshape(-1, Hkv, D)[:L].transpose(0, 1)[None].to(q.dtype)   # (1, Hkv, L, D)
        vv = v_cache[blocks].reshape(-1, Hkv, D)[:L].transpose(0, 1)[None].to(q.dtype)
        kk, vv = kk.repeat_interleave(cfg.group_size, dim=1), vv.repeat_interleave(cfg.group_size, dim=1)
        y = F.scaled_dot_product_attention(q, kk, vv, attn_mask=mask)      # (1, H, T, D)
        x = x + block.attn.o_proj(y.transpose(1, 2).reshape(1, T, H * D))
        x = x + block.mlp(block.mlp_norm(x))
    return model.lm_head(model.norm(x))                                     # (1, T, V)
'''),
md(r"""
## Problem 4: Prefill only what is not cached (3 points)

**Deliverable:** `prefill(model, kv, pc, seq, tokens)`: allocate the sequence in the prefix cache `pc`,
run `forward_extend` over the tokens that did not come from the cache only (with their true positions:
they start at `n_cached`, not 0), register the new full blocks with `pc.commit`, and return the
logits of the last token, shape `(V,)`. `kv` is the `PagedKVCache` that holds the keys and values.
"""),
solution("prefill", r'''
def prefill(model, kv: PagedKVCache, pc: PrefixCache, seq, tokens: list[int]) -> torch.Tensor:
    """Prefill of a new sequence that skips its cached blocks; logits of its last token (V,)."""
    ### BEGIN SOLUTION
    dev = kv.device
    n_cached, slots = pc.allocate(seq, tokens)
    ids = torch.tensor([tokens[n_cached:]], device=dev)                     # (1, T)
    pos = torch.arange(n_cached, len(tokens), device=dev)[None]             # (1, T)
    logits = forward_extend(model, ids, pos, kv, torch.tensor(slots, device=dev), pc.tables[seq])
    pc.commit(seq, tokens)
    return logits[0, -1]
    ### END SOLUTION
'''),
md(r"""
The engine (given) is lab 05's continuous batching with your prefill: every step, running requests
get a slot for their newest token and are decoded together; waiting requests are admitted while the
batch has room, each prefilled on its own (so the next newcomer already finds the blocks of the one
before); finished requests release their blocks, which stay cached. It records, per request, the
prompt tokens that came from the cache and how long its prefill took, and a snapshot of the blocks
after every step for the widget. `Engine(model, n_blocks, block_size, prefix_caching=False)` is the
same engine with no cache hits: the baseline.
"""),
locked("engine", r'''
@dataclass(eq=False)
class Request:
    rid: int
    prompt: list[int]
    max_new_tokens: int
    output: list[int] = field(default_factory=list)
    n_cached: int = 0          # prompt tokens that came from the cache
    prefill_s: float = 0.0     # seconds its prefill took: its time to first token once admitted


@dataclass
class Run:
    outputs: list[list[int]]
    requests: list[Request]
    seconds: float
    steps: list[dict] = field(default_factory=list)     # per step: the widget's snapshot
    labels: list[str] = field(default_factory=list)

    @property
    def prefill_tokens(self) -> int:
        """Prompt tokens actually run through the model."""
        return sum(len(r.prompt) - r.n_cached for r in self.requests)


class Engine:
    """Greedy continuous batching on a paged KV cache with prefix caching. The cache lives as long as
    the engine: call run() again (the next turn of a chat) and it still holds the earlier blocks."""

    def __init__(self, model, n_blocks: int, block_size: int, prefix_caching: bool = True, hash_fn=hash_block):
        self.model = model
        self.pc = PrefixCache(n_blocks, block_size, hash_fn=hash_fn, enabled=prefix_caching)
        self.kv = PagedKVCache(model.cfg, n_blocks, block_size, device=model.device)

    def snapshot(self, running) -> dict:
        pool, bs = self.pc.pool, self.pc.block_size
        reqs = {r.rid: (list(self.pc.tables[r.rid]), (r.prompt + r.output)[:self.pc.lengths[r.rid]], r.n_cached // bs)
                for r in running}
        return {"requests": reqs, "cached": [b for b in pool.free_queue if pool.hash_of[b] is not None]}

    def run(self, requests: list[Request], max_batch_size: int = 4, eos_token_id: int | None = None) -> Run:
        if not requests or len({r.rid for r in requests}) != len(requests) or any(r.output for r in requests):
            raise ValueError("requests must be fresh Request objects with distinct rids")
        dev, pc = self.model.device, self.pc
        waiting, running, run = deque(requests), [], Run([], list(requests), 0.0)
        start = clock(dev)
        while waiting or running:
            try:
                decoding = [(r, pc.append(r.rid, 1)[0]) for r in running]
            except OutOfBlocks as e:
                raise OutOfBlocks(f"the pool of {pc.pool.n_blocks} blocks is too small for the running requests "
                                  f"(this engine does not preempt): {e}") from None
            admitted = []
            while waiting and len(running) < max_batch_size:
                r, before, t0 = waiting[0], pc.cached_tokens, clock(dev)
                try:
                    logits = prefill(self.model, self.kv, pc, r.rid, r.prompt)
                except OutOfBlocks:
                    if running:
                        break                                   # wait for blocks to be released
                    raise
                r.prefill_s, r.n_cached = clock(dev) - t0, pc.cached_tokens - before
                r.output.append(int(logits.argmax()))
                waiting.popleft(); running.append(r); admitted.append(r)
            if decoding:
                ids = torch.tensor([[r.output[-1]] for r, _ in decoding], device=dev)                        # (B, 1)
                pos = torch.tensor([[len(r.prompt) + len(r.output) - 1] for r, _ in decoding], device=dev)   # (B, 1)
                tables = block_table_tensor([pc.tables[r.rid] for r, _ in decoding], dev)
                lens = torch.tensor([pc.lengths[r.rid] for r, _ in decoding], dtype=torch.int32, device=dev)
                logits = forward_paged(self.model, ids, pos, self.kv, torch.tensor([s for _, s in decoding], device=dev),
                                       tables, lens, write_kv=write_kv, attention=paged_attention_ref)
                for (r, _), tok in zip(decoding, logits[:, -1].argmax(dim=-1).tolist()):
                    r.output.append(tok)
                    pc.commit(r.rid, r.prompt + r.output)
            done = [r for r in running if len(r.output) >= r.max_new_tokens or r.output[-1] == eos_token_id]
            for r in done:
                running.remove(r)
                pc.free(r.rid)
            run.steps.append(self.snapshot(running))
            said = [f"admitted {[(r.rid, f'{r.n_cached} of {len(r.prompt)} cached') for r in admitted]}" if admitted else "",
                    f"finished {[r.rid for r in done]}" if done else ""]
            run.labels.append(", ".join(s for s in said if s) or "decode")
        run.seconds = clock(dev) - start
        run.outputs = [r.output for r in requests]
        return run
'''),
code(r'''
BLOCK = 16
new_tokens = env.pick(12, 4, cpu=8)
def workload(prompts):
    return [Request(i, p, new_tokens) for i, p in enumerate(prompts)]

runs = {}
for name, caching in (("no cache", False), ("prefix cache", True)):
    engine = Engine(model, n_blocks=64, block_size=BLOCK, prefix_caching=caching)
    runs[name] = engine.run(workload(prompts), max_batch_size=4)
for name, run in runs.items():
    print(f"{name:>12}: {run.prefill_tokens} prompt tokens computed, cached per request "
          f"{[r.n_cached for r in run.requests]}, {run.seconds:.1f} s in all")
print("same tokens with and without the cache:", runs["no cache"].outputs == runs["prefix cache"].outputs)
for p, out in list(zip(QUESTIONS, runs["prefix cache"].outputs))[:3]:
    print(f"  {p!r} -> {tokenizer.decode(out)!r}")
'''),
tests("prefill_tests", 3, r"""
assert runs["no cache"].outputs == runs["prefix cache"].outputs, \
    "the prefix cache must not change a single token (positions of the new tokens start at n_cached)"
done = runs["prefix cache"].requests
def shared_blocks(i):                 # full blocks of prompt i[:-1] that an earlier request computed
    best = max((common for j in range(i) for common in [next((k for k, (x, y) in enumerate(
        zip(done[i].prompt[:-1], done[j].prompt + done[j].output[:-1])) if x != y),
        min(len(done[i].prompt) - 1, len(done[j].prompt) + len(done[j].output) - 1))]), default=0)
    return best // BLOCK
assert done[0].n_cached == 0, "the first request finds an empty cache"
assert all(r.n_cached == shared_blocks(i) * BLOCK for i, r in enumerate(done)), \
    f"each request must reuse every full block an earlier one computed (the system prompt has {sys_len // BLOCK})"
assert runs["prefix cache"].prefill_tokens < runs["no cache"].prefill_tokens
### BEGIN HIDDEN TESTS
""" + HIDDEN_REF + r"""
# tiny models, several block sizes and pool sizes (small pools evict), shared prefixes of every length
for family, seed, kv in (("llama", 3, 2), ("gpt2", 4, 4), ("llama", 5, 1)):
    tiny = _tiny(family, seed, kv)
    g = random.Random(seed)
    stem = [g.randrange(1, 64) for _ in range(13)]
    prompts_t = [stem[:n] + [g.randrange(1, 64) for _ in range(k)] for n, k in ((13, 3), (13, 0), (9, 2), (4, 5), (13, 7), (1, 1), (8, 0))]
    news = [5, 3, 6, 2, 4, 7, 3]
    refs = [_ref_greedy(tiny, p, n) for p, n in zip(prompts_t, news)]
    for bs, n_blocks, B in ((4, 64, 1), (1, 80, 3), (3, 14, 2), (2, 40, 4)):
        eng = Engine(tiny, n_blocks, bs)
        run = eng.run([Request(i, p, n) for i, (p, n) in enumerate(zip(prompts_t, news))], max_batch_size=B)
        assert run.outputs == refs, f"{family}, block_size {bs}, {n_blocks} blocks: outputs differ from the request alone"
        assert sum(r.n_cached for r in run.requests) > 0, "shared prefixes must give cache hits"
        assert eng.pc.pool.n_free == n_blocks, "every block must be released when the requests are done"
        run2 = eng.run([Request(i, p, n) for i, (p, n) in enumerate(zip(prompts_t, news))], max_batch_size=B)
        assert run2.outputs == refs, f"{family}, block_size {bs}: a second pass over a warm cache changes the outputs"
        if n_blocks >= 40:
            assert all(r.n_cached == (len(r.prompt) - 1) // bs * bs for r in run2.requests), \
                "a big warm cache holds every full block of tokens[:-1]"
    # a prompt that is an exact block multiple, fully cached: the last block is recomputed
    eng = Engine(tiny, 20, 4)
    p = stem[:12]
    a = eng.run([Request(0, p, 3)]).outputs[0]
    r = Request(1, p, 3)
    b = eng.run([r]).outputs[0]
    assert a == b == _ref_greedy(tiny, p, 3) and r.n_cached == 8
    # prefill returns the last token's logits for a partly cached prompt
    eng = Engine(tiny, 20, 4)
    prefill(tiny, eng.kv, eng.pc, "x", stem); eng.pc.free("x")
    logits = prefill(tiny, eng.kv, eng.pc, "y", stem[:10] + [7, 7])
    with torch.no_grad():
        want = tiny(torch.tensor([stem[:10] + [7, 7]]), torch.arange(12)[None])[0, -1]
    assert logits.shape == want.shape and (logits - want).abs().max() < 1e-4, "logits of the last token, shape (V,)"
    assert eng.pc.lengths["y"] == 12 and eng.pc.pool.ref_count[eng.pc.tables["y"][0]] == 1
# with a colliding hash the outputs stay right (the token check)
tiny = _tiny("llama", 9, 2)
g = random.Random(9)
stem = [g.randrange(1, 64) for _ in range(10)]
ps = [stem + [g.randrange(1, 64) for _ in range(3)] for _ in range(3)] + [[g.randrange(1, 64) for _ in range(12)] for _ in range(3)]
refs = [_ref_greedy(tiny, p, 3) for p in ps]
eng = Engine(tiny, 40, 2, hash_fn=lambda parent, block: 1)
assert eng.run([Request(i, p, 3) for i, p in enumerate(ps)], max_batch_size=2).outputs == refs, \
    "with a hash where everything collides, outputs must not change"
### END HIDDEN TESTS
"""),
md(r"""
### See it: which blocks each request reuses

Your engine's run with the cache, step by step. Each row is a running request: green blocks came
from the cache (their tokens skipped prefill), blue ones it computed itself, the dashed last block is
its own partial block. In the pool, blocks in use show their reference count (thick border: shared
by several requests), and blocks that hold cached tokens but have no user wait in LRU order. Note
which blocks the first request computes and every later one reuses, and that the partial block at
the end of the system prompt is recomputed by everyone.
"""),
code(r'''
from course.widgets import prefix_blocks

def token_texts(ids):
    return [tokenizer.decode([t]) for t in ids]

def widget_steps(run):
    return [{"requests": {f"req {rid}": (tab, token_texts(toks), hits) for rid, (tab, toks, hits) in s["requests"].items()},
             "cached": s["cached"]} for s in run.steps]

run = runs["prefix cache"]
prefix_blocks(widget_steps(run), block_size=BLOCK, n_blocks=64, labels=run.labels,
              title=f"{len(prompts)} requests sharing a system prompt, blocks of {BLOCK}")
'''),
md(r"""
## 5. A radix tree: SGLang's RadixAttention

The hash map finds whole blocks, one lookup each. SGLang keeps a **radix tree** instead: a tree of
token sequences in which each edge holds a run of tokens (with the KV slot of each), and every path
from the root spells a cached prefix. A new request walks down from the root as far as its tokens
match; everything on the way is cached.

```
insert "the cat sat", then "the cat ran", then "the dog":

root -- "the cat " --+-- "sat"            a node stores its edge: tokens and their slots
                     +-- "ran"            inserting "the cat ran" SPLIT the edge "the cat sat"
root -- "the " --+-- "cat " --+-- "sat"   inserting "the dog" splits "the cat " in turn
                 |            +-- "ran"
                 +-- "dog"
```

Three operations carry it:
- **match**: follow the child whose edge starts with the next token; compare as many tokens as
  match. If the match ends inside an edge, **split** the edge there, so that the matched prefix ends
  exactly at a node (the request can then lock it).
- **insert**: match, then hang the rest as a new leaf (splitting where it diverges). A split must
  keep everything: the old node keeps its tail and its children, under a new node for the head.
- **evict**: memory runs out, so remove **leaves**, least recently used first (a tree only shrinks
  from its leaves: an inner node is a prefix that others still extend). A running request **locks**
  its matched node: `lock_ref` goes up on it and on every ancestor, and a locked node is never evicted.
  When a leaf goes, its parent may become a leaf, and may go next.

## Problem 5: The radix tree (5 points)

`Node` and the helpers are given. Each node has `key` (tuple of tokens on the edge into it), `value`
(list of slots, one per token of `key`), `children` (first token of a child's key -> child), `parent`,
`lock_ref` and `last_access` (a tick of the tree's clock; `self.touch(node)` sets it to a new tick).

**Deliverable:** the methods of `RadixTree`:
- `split(node, k)`: cut `node`'s edge after its first `k` tokens (`0 < k < len(node.key)`): a new node
  takes the first `k` tokens and values and `node`'s place under its parent (same `lock_ref` and
  `last_access`); `node` keeps the rest and becomes the new node's only child. Return the new node.
- `match_prefix(tokens)`: `(values, node)`: the slots of the longest stored prefix of `tokens`, and the
  node where it ends (the root when nothing matches), splitting an edge the match ends inside.
  Touch every node on the way.
- `insert(tokens, values)`: store `tokens` with one slot each. Returns how many leading tokens were
  already stored: those keep their old slots (the caller frees the duplicates). Touch every node on
  the path, the new leaf included.
- `lock(node)` / `unlock(node)`: `lock_ref` of `node` and each ancestor (not the root) up / down by one.
- `evict(n_tokens)`: remove unlocked leaves, least recently used first (smallest `last_access`),
  until at least `n_tokens` slots are freed or no unlocked leaf is left. Return the freed slots.
"""),
solution("radix_tree", r'''
class Node:
    def __init__(self, key=(), value=(), parent=None):
        self.key: tuple[int, ...] = tuple(key)     # tokens on the edge into this node
        self.value: list[int] = list(value)       # one KV slot per token of key
        self.children: dict[int, "Node"] = {}     # first token of the child's key -> child
        self.parent: Node | None = parent
        self.lock_ref = 0                         # running requests using this node (or a descendant)
        self.last_access = 0

    def __repr__(self):
        return f"Node(key={self.key}, {len(self.children)} children, lock_ref={self.lock_ref})"


def common_length(a, b) -> int:
    """How many leading items a and b share."""
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


class RadixTree:
    """Token sequences with one KV slot per token, sharing their common prefixes (SGLang's RadixCache)."""

    def __init__(self):
        self.root = Node()
        self.clock = 0

    def touch(self, node: Node) -> None:
        self.clock += 1
        node.last_access = self.clock

    def nodes(self):
        """Every node but the root."""
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def n_tokens(self) -> int:
        return sum(len(n.key) for n in self.nodes())

    def sequences(self) -> list[tuple[int, ...]]:
        """The token sequence of every leaf: each stored prefix is a prefix of one of them."""
        out = []
        for node in self.nodes():
            if not node.children:
                toks, n = [], node
                while n is not self.root:
                    toks[:0] = n.key
                    n = n.parent
                out.append(tuple(toks))
        return sorted(out)

    def split(self, node: Node, k: int) -> Node:
        """A new node for the first k tokens of node's edge, between node and its parent."""
        if not 0 < k < len(node.key):
            raise ValueError(f"split needs 0 < k < {len(node.key)}, got {k}")
        ### BEGIN SOLUTION
        head = Node(node.key[:k], node.value[:k], node.parent)
        head.lock_ref, head.last_access = node.lock_ref, node.last_access
        node.parent.children[node.key[0]] = head
        node.key, node.value, node.parent = node.key[k:], node.value[k:], head
        head.children[node.key[0]] = node
        return head
        ### END SOLUTION

    def match_prefix(self, tokens) -> tuple[list[int], Node]:
        """(slots of the longest stored prefix of tokens, the node it ends at)."""
        tokens = tuple(tokens)
        ### BEGIN SOLUTION
        node, i, values = self.root, 0, []
        while i < len(tokens) and tokens[i] in node.children:
            child = node.children[tokens[i]]
            n = common_length(child.key, tokens[i:])
            if n < len(child.key):
                child = self.split(child, n)
            values += child.value
            i += n
            node = child
            self.touch(node)
        return values, node
        ### END SOLUTION

    def insert(self, tokens, values) -> int:
        """Store tokens with their slots; returns how many leading tokens were already stored."""
        tokens, values = tuple(tokens), list(values)
        if len(tokens) != len(values):
            raise ValueError(f"one slot per token: {len(tokens)} tokens, {len(values)} values")
        ### BEGIN SOLUTION
        node, i = self.root, 0
        while i < len(tokens):
            child = node.children.get(tokens[i])
            if child is None:
                leaf = Node(tokens[i:], values[i:], node)
                node.children[tokens[i]] = leaf
                self.touch(leaf)
                return i
            n = common_length(child.key, tokens[i:])
            if n < len(child.key):
                child = self.split(child, n)
            i += n
            node = child
            self.touch(node)
        return i
        ### END SOLUTION

    def lock(self, node: Node) -> None:
        ### BEGIN SOLUTION
        while node is not self.root:
            node.lock_ref += 1
            node = node.parent
        ### END SOLUTION

    def unlock(self, node: Node) -> None:
        ### BEGIN SOLUTION
        while node is not self.root:
            if node.lock_ref < 1:
                raise ValueError(f"{node} is not locked")
            node.lock_ref -= 1
            node = node.parent
        ### END SOLUTION

    def evict(self, n_tokens: int) -> list[int]:
        """Free at least n_tokens slots from unlocked leaves, least recently used first."""
        ### BEGIN SOLUTION
        freed = []
        while len(freed) < n_tokens:
            leaves = [n for n in self.nodes() if not n.children and n.lock_ref == 0]
            if not leaves:
                break
            victim = min(leaves, key=lambda n: n.last_access)
            del victim.parent.children[victim.key[0]]
            freed += victim.value
        return freed
        ### END SOLUTION
'''),
code(r'''
tree = RadixTree()
words = {w: encode(" " + w) for w in ["the cat sat", "the cat ran", "the dog"]}
next_slot = 0
for text, toks in words.items():
    already = tree.insert(toks, list(range(next_slot, next_slot + len(toks))))
    next_slot += len(toks)
    print(f"insert {text!r}: {len(toks)} tokens, {already} already stored")
values, end = tree.match_prefix(encode(" the cat sat down"))
print(f"match ' the cat sat down': {len(values)} tokens cached, slots {values}")
print("stored sequences:", [tokenizer.decode(list(s)) for s in tree.sequences()])
'''),
tests("radix_match_tests", 3, r"""
t = RadixTree()
assert t.insert([1, 2, 3, 4], [10, 11, 12, 13]) == 0 and t.sequences() == [(1, 2, 3, 4)]
assert t.insert([1, 2, 5], [20, 21, 22]) == 2, "tokens 1, 2 were already stored"
assert t.sequences() == [(1, 2, 3, 4), (1, 2, 5)], "the split must keep the old suffix (3, 4) and add (5,)"
head = t.root.children[1]
assert head.key == (1, 2) and head.value == [10, 11] and set(head.children) == {3, 5}, "the shared edge keeps the first slots"
assert head.children[3].key == (3, 4) and head.children[3].value == [12, 13] and head.children[3].parent is head
assert t.match_prefix([1, 2, 3, 9]) == ([10, 11, 12], t.root.children[1].children[3]), \
    "a match ending inside an edge splits it: the returned node ends exactly at the match"
assert t.sequences() == [(1, 2, 3, 4), (1, 2, 5)], "splitting on a match loses nothing"
assert t.match_prefix([7]) == ([], t.root), "no match: no slots, the root"
assert t.insert([1, 2, 5], [0, 0, 0]) == 3 and t.match_prefix([1, 2, 5])[0] == [10, 11, 22], "stored slots are kept"
n = Node((1, 2, 3), [7, 8, 9]); r = RadixTree(); r.root.children[1] = n; n.parent = r.root
h = r.split(n, 1)
assert h.key == (1,) and n.key == (2, 3) and h.children == {2: n} and r.root.children[1] is h and n.parent is h
### BEGIN HIDDEN TESTS
import random
# random inserts from a small alphabet: every inserted sequence stays fully stored with its first slots
for seed in range(6):
    rng = random.Random(seed)
    t, first_slot, inserted, slot = RadixTree(), {}, [], 0
    for _ in range(40):
        base = rng.choice(inserted) if inserted and rng.random() < 0.6 else ()
        seq = tuple(base[:rng.randint(0, len(base))]) + tuple(rng.randrange(3) for _ in range(rng.randint(0, 5)))
        if not seq:
            continue
        vals = list(range(slot, slot + len(seq))); slot += len(seq)
        known = max((common_length(seq, s) for s in inserted), default=0)
        assert t.insert(seq, vals) == known, f"insert must return the stored prefix length {known}"
        for i in range(len(seq)):
            first_slot.setdefault(seq[:i + 1], vals[i])
        inserted.append(seq)
        query = tuple(rng.randrange(3) for _ in range(rng.randint(1, 7)))
        for q in (query, seq, seq[:-1]):
            want = max((common_length(q, s) for s in inserted), default=0)
            values, node = t.match_prefix(q)
            assert values == [first_slot[q[:i + 1]] for i in range(want)], \
                f"match_prefix({q}) must give the slots of the {want} stored tokens"
            depth, n = 0, node
            while n is not t.root:
                depth += len(n.key); n = n.parent
            assert depth == want, "the returned node must end exactly where the match ends (split inside an edge)"
        stored = t.sequences()
        for s in inserted:
            assert any(x[:len(s)] == s for x in stored), f"{s} was lost: a split dropped a suffix or children"
        for n in t.nodes():
            assert n.key and len(n.key) == len(n.value) and n.parent.children[n.key[0]] is n, "broken links after a split"
            assert all(c.parent is n and c.key[0] == k for k, c in n.children.items())
    assert t.n_tokens() == len(first_slot), "a stored token appears exactly once in the tree"
# touches: match and insert update last_access along the path
t = RadixTree()
t.insert([1, 2], [0, 1]); t.insert([1, 3], [2, 3])
a = t.root.children[1].children[2]
before = a.last_access
t.match_prefix([1, 2])
assert a.last_access == t.clock > before and t.root.children[1].last_access == t.clock - 1, "match touches the nodes on its path"
### END HIDDEN TESTS
"""),
tests("radix_evict_tests", 2, r"""
t = RadixTree()
t.insert([1, 2, 3], [0, 1, 2]); t.insert([1, 2, 4], [3, 4, 5]); t.insert([7, 8], [6, 7])
_, node = t.match_prefix([1, 2, 3])                  # now (1, 2, 3) is the most recently used
t.lock(node)
assert node.lock_ref == 1 and node.parent.lock_ref == 1 and t.root.lock_ref == 0, "lock the node and its ancestors, not the root"
assert sorted(t.evict(1)) == [5], "the least recently used unlocked leaf goes first: (4,) under (1, 2)"
assert sorted(t.evict(100)) == [6, 7] and t.sequences() == [(1, 2, 3)], "locked nodes are never evicted"
t.unlock(node)
assert node.lock_ref == 0 and node.parent.lock_ref == 0
assert sorted(t.evict(1)) == [2] and sorted(t.evict(2)) == [0, 1], "a parent whose last child went is a leaf too"
assert t.n_tokens() == 0 and t.evict(5) == []
### BEGIN HIDDEN TESTS
# LRU across several leaves; eviction stops as soon as enough slots are freed
t = RadixTree()
for i, seq in enumerate([(1, 1), (2, 2), (3, 3), (4, 4)]):
    t.insert(seq, [10 * i, 10 * i + 1])
t.match_prefix([2, 2]); t.match_prefix([1, 1])
assert sorted(t.evict(2)) == [20, 21], "(3, 3) is the least recently used"
assert sorted(t.evict(3)) == [10, 11, 30, 31], "then (4, 4), then (2, 2): eviction stops once 3 or more slots are freed"
assert t.sequences() == [(1, 1)], "(1, 1) was used last: it stays"
# locks count: two locks need two unlocks; unlocking an unlocked node raises
t = RadixTree()
t.insert([5, 6, 7], [0, 1, 2])
_, a = t.match_prefix([5, 6])                        # splits: (5, 6) -> (7,)
_, b = t.match_prefix([5, 6, 7])
t.lock(a); t.lock(b)
assert a.lock_ref == 2 and b.lock_ref == 1
assert t.evict(10) == []
t.unlock(b)
assert t.evict(10) == [2] and t.evict(10) == [], "(5, 6) is still locked once"
t.unlock(a)
assert sorted(t.evict(10)) == [0, 1]
try:
    t.unlock(a)
except ValueError:
    pass
else:
    raise AssertionError("unlocking a node with lock_ref 0 must raise ValueError")
# a split copies the lock: a locked prefix stays locked after another request splits it
t = RadixTree()
t.insert([1, 2, 3, 4], [0, 1, 2, 3])
_, leaf = t.match_prefix([1, 2, 3, 4])
t.lock(leaf)
t.insert([1, 2, 9], [4, 5, 6])
assert t.root.children[1].lock_ref == 1, "the new head node of a split keeps the lock count"
assert t.evict(10) == [6] and t.sequences() == [(1, 2, 3, 4)]
### END HIDDEN TESTS
"""),
md(r"""
## 6. Measure

### Prefill saved and time to first token: a shared system prompt

The run of section 4 already counted the prompt tokens each engine computed. Now the time a user
waits: the prefill of one new question, with the system prompt cached (from earlier questions) or not.
Each timed call asks a **different** question, so only the system prompt can come from the cache, as
on a real server. `course.timing.benchmark` warms up first and reports the median.
"""),
code(r'''
def ttft(caching: bool, questions) -> float:
    """Median prefill time of one new question after the system prompt, over different questions."""
    engine = Engine(model, n_blocks=64, block_size=BLOCK, prefix_caching=caching)
    asked = iter(questions)
    def ask():
        q = next(asked)
        prefill(model, engine.kv, engine.pc, q, chat_prompt(system, q))
        engine.pc.free(q)
    repeats = len(questions) - 1                                        # one question for the warm-up
    return benchmark(ask, warmup=1, repeats=repeats, device=dev).median

asked = [f"Question {i}: " + q for i, q in enumerate(QUESTIONS[:env.pick(6, 3)])]
times = {name: ttft(caching, asked) for name, caching in (("no cache", False), ("prefix cache", True))}
saved = runs["no cache"].prefill_tokens - runs["prefix cache"].prefill_tokens
print(f"shared system prompt, {len(prompts)} requests: {runs['no cache'].prefill_tokens} prompt tokens computed "
      f"without the cache, {runs['prefix cache'].prefill_tokens} with it "
      f"({saved} saved, {100 * saved / runs['no cache'].prefill_tokens:.0f}%)")
for name, s in times.items():
    print(f"  time to first token, {name:>12}: {1e3 * s:6.0f} ms")
print(f"  speedup {times['no cache'] / times['prefix cache']:.1f}x")
'''),
md(r"""
### A multi-turn chat

In a chat, every turn sends the whole conversation again: system prompt, earlier questions and
earlier **answers**. The engine registered the blocks it filled while decoding, so the previous
answer is in the cache too. Below, one conversation through two engines that both live across the
turns: per turn, the prompt's length, how much of it came from the cache, and the prefill time.
"""),
code(r'''
turns = ["Hi! I ordered a book on Monday.", "When will it arrive?", "Can I still change the address?",
         "And if I do not like it, can I return it?", "Thanks. Do you also sell e-books?"][:env.pick(5, 3)]
chat = {name: Engine(model, n_blocks=128, block_size=BLOCK, prefix_caching=caching)
        for name, caching in (("no cache", False), ("prefix cache", True))}
history, rows = encode(f"System: {system}\n"), []
for i, user in enumerate(turns):
    prompt = history + encode(f"User: {user}\nAssistant:")
    done = {name: eng.run([Request(i, prompt, env.pick(16, 4, cpu=10))]).requests[0] for name, eng in chat.items()}
    assert done["no cache"].output == done["prefix cache"].output, "the cache changed an answer"
    answer = done["prefix cache"].output
    rows.append((i + 1, len(prompt), done["prefix cache"].n_cached, done["no cache"].prefill_s, done["prefix cache"].prefill_s))
    history = prompt + answer + encode("\n")
print("turn  prompt  cached  prefill no cache  prefill cache")
for turn, n, hit, t0, t1 in rows:
    print(f"{turn:>4}  {n:>6}  {hit:>6}  {1e3 * t0:>13.0f} ms  {1e3 * t1:>10.0f} ms")
print(f"over the chat: {sum(r[2] for r in rows)} of {sum(r[1] for r in rows)} prompt tokens came from the cache")

fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3))
x = np.arange(len(rows))
ax1.bar(x - 0.2, [r[1] for r in rows], 0.4, label="no cache"); ax1.bar(x + 0.2, [r[1] - r[2] for r in rows], 0.4, label="prefix cache")
ax1.set_xticks(x, [f"turn {r[0]}" for r in rows]); ax1.set_ylabel("prompt tokens computed"); ax1.legend()
ax2.plot(x + 1, [1e3 * r[3] for r in rows], "o-", label="no cache"); ax2.plot(x + 1, [1e3 * r[4] for r in rows], "o-", label="prefix cache")
ax2.set_xlabel("turn"); ax2.set_ylabel("prefill time (ms)"); ax2.legend()
for ax in (ax1, ax2):
    ax.grid(alpha=0.3)
plt.tight_layout(); plt.show()
'''),
md(r"""
Without the cache, prefill grows with the whole conversation at every turn: the total work grows with
the square of the number of turns. With it, each turn computes only its new message, the last token
of the previous answer and the partial blocks around them. (Turn 1 has nothing to reuse: there the two
times differ only by noise.)

### Hit rate against cache size, and the radix tree against the hashes

How big must the cache be? That depends on the traffic. Below, a simulated server (token ids only, no
model, so it runs in a second): a few system prompts of different lengths, some far more popular than
others, each request one of them plus its own question, then an answer. Requests come one at a time;
after each, the blocks are released and stay cached until evicted. The hit rate is the share of prompt
tokens found in the cache.

The same traffic also goes through your radix tree, with the same number of token slots: match,
lock, compute the rest, insert the request's tokens, unlock, and evict leaves when the slots run out.
"""),
code(r'''
def traffic(n_requests, seed=0):
    rng = np.random.default_rng(seed)
    systems = [rng.integers(0, 5000, n).tolist() for n in (250, 180, 120, 90, 60, 40)]
    popularity = 1 / np.arange(1, len(systems) + 1)                  # Zipf-like: a few prompts dominate
    picks = rng.choice(len(systems), n_requests, p=popularity / popularity.sum())
    return [(systems[k] + rng.integers(0, 5000, rng.integers(8, 40)).tolist(), rng.integers(0, 5000, 16).tolist())
            for k in picks]

def hash_hit_rate(reqs, n_blocks, block_size):
    pc = PrefixCache(n_blocks, block_size)
    for i, (prompt, answer) in enumerate(reqs):
        pc.allocate(i, prompt); pc.commit(i, prompt)
        pc.append(i, len(answer)); pc.commit(i, prompt + answer)
        pc.free(i)
    return pc.hit_rate

def radix_hit_rate(reqs, n_slots):
    tree, free, hit, total = RadixTree(), list(range(n_slots)), 0, 0
    for prompt, answer in reqs:
        values, last = tree.match_prefix(prompt[:-1])
        tree.lock(last)
        hit, total = hit + len(values), total + len(prompt)
        tokens = prompt + answer
        need = len(tokens) - len(values)
        if need > len(free):
            free += tree.evict(need - len(free))
        new, free = free[:need], free[need:]
        tree.unlock(last)
        already = tree.insert(tokens, values + new)
        free += (values + new)[len(values):already]                 # slots of tokens that were stored already
    return hit / total

reqs = traffic(env.pick(400, 120))
sizes = [24, 32, 48, 64, 96, 128, 256]
hash_rates = [hash_hit_rate(reqs, n, 16) for n in sizes]
radix_rates = [radix_hit_rate(reqs, n * 16) for n in sizes]
for n, h, r in zip(sizes, hash_rates, radix_rates):
    print(f"{n:>4} blocks of 16 ({n * 16:>5} tokens): hash {100 * h:5.1f}%   radix tree {100 * r:5.1f}%")
plt.figure(figsize=(6, 3))
plt.plot([n * 16 for n in sizes], [100 * h for h in hash_rates], "o-", label="hashed blocks of 16")
plt.plot([n * 16 for n in sizes], [100 * r for r in radix_rates], "s--", label="radix tree (per token)")
plt.xscale("log", base=2); plt.xlabel("cache size (tokens)"); plt.ylabel("prompt tokens from the cache (%)")
plt.grid(alpha=0.3); plt.legend(); plt.tight_layout(); plt.show()
'''),
md(r"""
Read your plot. When the cache is smaller than the popular prompts together, requests evict what the
next ones need, and the hit rate is low. Once it holds them, the hit rate levels off at what the
traffic allows: the questions themselves are new, so no cache can serve them. With a large cache the
radix tree reuses a little more of every prompt: it matches token by token, while the hashes stop at
the last full block and recompute the partial one (up to `block_size - 1` tokens per request). With a
small cache the two differ in what they evict (whole leaves against single blocks), and which does
better depends on the traffic: look at what your run shows.

What each scheme is good at:

| | hashed blocks (vLLM) | radix tree (SGLang) |
|---|---|---|
| lookup | one dict lookup per block, independent of everything else in the cache | a walk down the tree, comparing tokens |
| granularity | whole blocks only; the partial last block is never shared | any token; edges split where prompts diverge |
| structure | flat: blocks and a map, the allocator of lab 05 barely changes | a tree to keep consistent (splits, parents, locks) |
| eviction | any unused block, LRU; a block whose parent is gone is simply never reached | leaves only, LRU, with locks up the path |
| also gives | a stable name per block: easy to share across processes and machines (KV offloading, disaggregation) | the structure of the traffic: schedulers that run requests with a common prefix together (SGLang's cache-aware scheduling) |

## Summary

- Requests often start with the same tokens (system prompts, chat history, few-shot examples). Their
  keys and values depend only on those tokens, so they can be computed once and shared.
- **Chained hashes** name a full block by its whole prefix: hash(parent hash, block tokens). Only full
  blocks are hashed and shared; the partial last block belongs to its sequence.
- A **pool** keeps freed blocks cached with reference count 0 in an **LRU queue**; sharing removes a block
  from it (a block in use is never evicted); a lookup **checks the tokens and the parent** against collisions.
- The engine computes only the tokens after the cached blocks, with their true positions, and at least
  the last prompt token; outputs are identical with and without the cache.
- A **radix tree** stores token sequences with shared prefixes: match, insert with **splits** that keep
  every suffix, and LRU eviction of **unlocked leaves**.
- You measured the prefill tokens saved, the time to first token with and without the cache, and the
  hit rate against cache size.

**Questions**
1. Why must the hash of a block include its parent's hash? Give two prompts that a hash of the block
   alone would confuse, and say what the model would then compute.
2. Why is the partial last block never shared? What would go wrong when two requests share it and both decode?
3. A prompt is exactly 4 full blocks long and all of them are cached. How many tokens does the engine
   compute, and why not zero?
4. What would happen if `share` forgot to take a free block out of the LRU queue? Describe the first
   request that would see wrong keys.
5. The token check costs a tuple comparison per hit. With 64-bit hashes, how many cached blocks would
   a server need before a collision becomes likely (the birthday bound)? Is the check worth it?
6. In your multi-turn measurement, how does the prefill time per turn grow with and without the cache?
   What happens to the total over a 50-turn chat?
7. From your hit-rate plot: how much cache does this traffic need? Which requests still miss when the
   cache is large, and why can no cache help them?
8. Why can a radix tree evict only leaves, and why must a running request lock its path?

## Going further

- **vLLM** automatic prefix caching (`enable_prefix_caching`, on by default in the V1 engine): block hashes
  chained from the parent, with extra keys (LoRA adapter, multimodal inputs, a per-request salt for
  tenant isolation), a free queue that doubles as the LRU eviction order, and SHA-256 hashing as an option.
- **SGLang** RadixAttention (Zheng et al., 2024, "SGLang: Efficient Execution of Structured Language Model
  Programs"): the radix tree, cache-aware scheduling (longest shared prefix first), and up to 5-6x
  throughput on workloads with shared prefixes.
- **nano-vllm**'s `engine/block_manager.py`: hashing and reference counts in a few dozen lines; compare
  with your `PrefixCache`.
- **Prompt caching** in hosted APIs (Anthropic, OpenAI, Gemini): the same idea sold as a discount on
  cached input tokens, with explicit cache breakpoints and a time to live.
- **LMCache**, **Mooncake** and other KV stores: cached blocks moved to CPU memory, disk or other
  machines, found again by their hashes; the basis of prefill-decode disaggregation.
"""),
]

if __name__ == "__main__":
    write_notebook("labs/09_prefix_caching/09_prefix_caching.ipynb", cells + [md(CHECK_YOUR_WORK)])
    print("wrote labs/09_prefix_caching/09_prefix_caching.ipynb")
