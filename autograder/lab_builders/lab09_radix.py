"""Lab 09, section 5 onwards: the radix tree (Problem 5), the measurements, the summary."""
from autograder.authoring import answer, code, md, solution, tests

CELLS = [
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
from course.expect import expect_int, expect_ints, expect_tuple, expect_type

# Your tree's answers and nodes, each checked first (type, then value).
def inserted(t, tokens, values):
    return expect_int(t.insert(tokens, values), f"insert({list(tokens)}, ...)", min=0)
def matched(t, tokens):
    values, node = expect_tuple(t.match_prefix(tokens), f"match_prefix({list(tokens)})", 2)
    return expect_ints(values, f"match_prefix({list(tokens)})[0] (slots)"), expect_type(node, f"match_prefix({list(tokens)})[1]", Node)
def stored(t):
    return [tuple(expect_ints(seq, "a stored sequence", container=tuple)) for seq in t.sequences()]
def key(n):
    return tuple(expect_ints(expect_type(n, "a node", Node).key, "node.key", container=tuple))
def value(n):
    return expect_ints(n.value, "node.value")
def child(n, tok):
    kids = expect_type(n.children, "node.children", dict)
    assert tok in kids, f"node {key(n) if n.key else 'root'} must have a child starting with token {tok}, has {sorted(kids)}"
    return expect_type(kids[tok], f"child {tok}", Node)

t = RadixTree()
assert inserted(t, [1, 2, 3, 4], [10, 11, 12, 13]) == 0 and stored(t) == [(1, 2, 3, 4)], "an empty tree stores the whole sequence"
assert inserted(t, [1, 2, 5], [20, 21, 22]) == 2, "tokens 1, 2 were already stored"
assert stored(t) == [(1, 2, 3, 4), (1, 2, 5)], "the split must keep the old suffix (3, 4) and add (5,)"
head = child(t.root, 1)
assert key(head) == (1, 2) and value(head) == [10, 11] and set(head.children) == {3, 5}, "the shared edge keeps the first slots"
assert key(child(head, 3)) == (3, 4) and value(child(head, 3)) == [12, 13] and child(head, 3).parent is head, \
    "the old node keeps its tail (3, 4) and its slots, under the new head"
values, node = matched(t, [1, 2, 3, 9])
assert values == [10, 11, 12] and node is child(child(t.root, 1), 3), \
    "a match ending inside an edge splits it: the returned node ends exactly at the match"
assert stored(t) == [(1, 2, 3, 4), (1, 2, 5)], "splitting on a match loses nothing"
values, node = matched(t, [7])
assert values == [] and node is t.root, "no match: no slots, the root"
assert inserted(t, [1, 2, 5], [0, 0, 0]) == 3 and matched(t, [1, 2, 5])[0] == [10, 11, 22], "stored slots are kept"
n = Node((1, 2, 3), [7, 8, 9]); r = RadixTree(); r.root.children[1] = n; n.parent = r.root
h = expect_type(r.split(n, 1), "split(node, 1)", Node)
assert key(h) == (1,) and key(n) == (2, 3) and child(h, 2) is n and len(h.children) == 1 and r.root.children[1] is h \
    and n.parent is h, \
    "split(node, 1): a new head (1,) takes node's place; node keeps (2, 3) as its only child"
### BEGIN HIDDEN TESTS
import random
# random inserts from a small alphabet: every inserted sequence stays fully stored with its first slots
for seed in range(6):
    rng = random.Random(seed)
    t, first_slot, inserted_seqs, slot = RadixTree(), {}, [], 0
    for _ in range(40):
        base = rng.choice(inserted_seqs) if inserted_seqs and rng.random() < 0.6 else ()
        seq = tuple(base[:rng.randint(0, len(base))]) + tuple(rng.randrange(3) for _ in range(rng.randint(0, 5)))
        if not seq:
            continue
        vals = list(range(slot, slot + len(seq))); slot += len(seq)
        known = max((common_length(seq, s) for s in inserted_seqs), default=0)
        got = inserted(t, seq, vals)
        assert got == known, (f"insert({list(seq)}) returned {got}: it must return how many of its first tokens the tree "
                              "already held (its longest common prefix with a stored sequence)")
        for i in range(len(seq)):
            first_slot.setdefault(seq[:i + 1], vals[i])
        inserted_seqs.append(seq)
        query = tuple(rng.randrange(3) for _ in range(rng.randint(1, 7)))
        for q in (query, seq, seq[:-1]):
            want = max((common_length(q, s) for s in inserted_seqs), default=0)
            values, node = matched(t, q)
            assert values == [first_slot[q[:i + 1]] for i in range(want)], \
                (f"match_prefix({list(q)}) gave the slots {values}: it must give the slots of the longest stored prefix of "
                 "the query, each token's slot as first inserted")
            depth, n = 0, node
            while n is not t.root:
                depth += len(key(n)); n = n.parent
            assert depth == want, "the returned node must end exactly where the match ends (split inside an edge)"
        now = stored(t)
        for s in inserted_seqs:
            assert any(x[:len(s)] == s for x in now), f"{s} was lost: a split dropped a suffix or children"
        for n in t.nodes():
            assert key(n) and len(key(n)) == len(value(n)) and n.parent.children[n.key[0]] is n, "broken links after a split"
            assert all(c.parent is n and key(c)[0] == k for k, c in n.children.items()), "a child's parent and first token must match its entry"
    assert expect_int(t.n_tokens(), "n_tokens()") == len(first_slot), "a stored token appears exactly once in the tree"
# touches: match and insert update last_access along the path
t = RadixTree()
inserted(t, [1, 2], [0, 1]); inserted(t, [1, 3], [2, 3])
a = child(child(t.root, 1), 2)
before = expect_int(a.last_access, "last_access")
matched(t, [1, 2])
assert expect_int(a.last_access, "last_access") == t.clock > before \
    and expect_int(child(t.root, 1).last_access, "last_access") == t.clock - 1, \
    "match touches the nodes on its path"
### END HIDDEN TESTS
"""),
tests("radix_evict_tests", 2, r"""
from course.expect import expect_int, expect_ints, expect_tuple, expect_type

# Your tree's answers and nodes, each checked first (type, then value).
def inserted(t, tokens, values):
    return expect_int(t.insert(tokens, values), f"insert({list(tokens)}, ...)", min=0)
def matched_node(t, tokens):
    values, node = expect_tuple(t.match_prefix(tokens), f"match_prefix({list(tokens)})", 2)
    expect_ints(values, f"match_prefix({list(tokens)})[0] (slots)")
    return expect_type(node, f"match_prefix({list(tokens)})[1]", Node)
def evicted(t, n):
    return sorted(expect_ints(t.evict(n), f"evict({n})"))
def stored(t):
    return [tuple(expect_ints(seq, "a stored sequence", container=tuple)) for seq in t.sequences()]
def locks(n):
    return expect_int(n.lock_ref, "lock_ref", min=0)

t = RadixTree()
inserted(t, [1, 2, 3], [0, 1, 2]); inserted(t, [1, 2, 4], [3, 4, 5]); inserted(t, [7, 8], [6, 7])
node = matched_node(t, [1, 2, 3])                  # now (1, 2, 3) is the most recently used
t.lock(node)
assert locks(node) == 1 and locks(expect_type(node.parent, "node.parent", Node)) == 1 and locks(t.root) == 0, \
    "lock the node and its ancestors, not the root"
assert evicted(t, 1) == [5], "the least recently used unlocked leaf goes first: (4,) under (1, 2)"
assert evicted(t, 100) == [6, 7] and stored(t) == [(1, 2, 3)], "locked nodes are never evicted"
t.unlock(node)
assert locks(node) == 0 and locks(node.parent) == 0, "unlock undoes lock, on the node and its ancestors"
assert evicted(t, 1) == [2] and evicted(t, 2) == [0, 1], "a parent whose last child went is a leaf too"
assert expect_int(t.n_tokens(), "n_tokens()") == 0 and evicted(t, 5) == [], "an empty tree has nothing to evict"
### BEGIN HIDDEN TESTS
# LRU across several leaves; eviction stops as soon as enough slots are freed
t = RadixTree()
for i, seq in enumerate([(1, 1), (2, 2), (3, 3), (4, 4)]):
    inserted(t, seq, [10 * i, 10 * i + 1])
matched_node(t, [2, 2]); matched_node(t, [1, 1])
assert evicted(t, 2) == [20, 21], "(3, 3) is the least recently used"
assert evicted(t, 3) == [10, 11, 30, 31], "then (4, 4), then (2, 2): eviction stops once 3 or more slots are freed"
assert stored(t) == [(1, 1)], "(1, 1) was used last: it stays"
# locks count: two locks need two unlocks; unlocking an unlocked node raises
t = RadixTree()
inserted(t, [5, 6, 7], [0, 1, 2])
a = matched_node(t, [5, 6])                        # splits: (5, 6) -> (7,)
b = matched_node(t, [5, 6, 7])
t.lock(a); t.lock(b)
assert locks(a) == 2 and locks(b) == 1, "a is locked by itself and by its child b"
assert evicted(t, 10) == [], "everything is locked"
t.unlock(b)
assert evicted(t, 10) == [2] and evicted(t, 10) == [], "(5, 6) is still locked once"
t.unlock(a)
assert evicted(t, 10) == [0, 1], "unlocked at last, (5, 6) goes"
try:
    t.unlock(a)
except ValueError:
    pass
else:
    raise AssertionError("unlocking a node with lock_ref 0 must raise ValueError")
# a split copies the lock: a locked prefix stays locked after another request splits it
t = RadixTree()
inserted(t, [1, 2, 3, 4], [0, 1, 2, 3])
leaf = matched_node(t, [1, 2, 3, 4])
t.lock(leaf)
inserted(t, [1, 2, 9], [4, 5, 6])
assert locks(expect_type(t.root.children[1], "the head node", Node)) == 1, "the new head node of a split keeps the lock count"
assert evicted(t, 10) == [6] and stored(t) == [(1, 2, 3, 4)], "only the new, unlocked leaf (9,) can go"
### END HIDDEN TESTS
"""),
md(r"""
## 6. Measure

### Prefill saved and time to first token: a shared system prompt

The run of section 4 already counted the prompt tokens each engine computed. Now the time a user
waits: the prefill of one new question, with the system prompt cached (from earlier questions) or not.
Each timed call asks a **different** question, so only the system prompt can come from the cache, as
on a real server. Every question runs once untimed first, in an engine of its own: on a GPU the
first pass at a new size loads the kernels it picks (lab 02), which a server has long since done.
`course.timing.benchmark` warms up once more and reports the median.
"""),
code(r'''
def ttft(caching: bool, questions) -> float:
    """Median prefill time of one new question after the system prompt, over different questions."""
    def session():
        """A fresh engine, and a function that asks it the next question."""
        engine = Engine(model, n_blocks=64, block_size=BLOCK, prefix_caching=caching)
        asked = iter(questions)
        def ask():
            q = next(asked)
            prefill(model, engine.kv, engine.pc, q, chat_prompt(system, q))
            engine.pc.free(q)
        return ask
    warm = session()
    for _ in questions:                                                 # untimed: no size below is new
        warm()
    repeats = len(questions) - 1                                        # one question for the warm-up
    return benchmark(session(), warmup=1, repeats=repeats, device=dev).median

asked = [f"Question {i}: " + q for i, q in enumerate(QUESTIONS[:env.pick(6, 3)])]
times = {name: ttft(caching, asked) for name, caching in (("no cache", False), ("prefix cache", True))}
saved = runs["no cache"].prefill_tokens - runs["prefix cache"].prefill_tokens
print(f"shared system prompt, {len(prompts)} requests: {runs['no cache'].prefill_tokens} prompt tokens computed "
      f"without the cache, {runs['prefix cache'].prefill_tokens} with it "
      f"({saved} saved, {100 * saved / runs['no cache'].prefill_tokens:.0f}%)")
for name, s in times.items():
    print(f"  time to first token, {name:>12}: {1e3 * s:6.0f} ms")
print(f"  speedup {times['no cache'] / times['prefix cache']:.1f}x")
from course.report import record
record("prefix_cache_ttft_speedup", times["no cache"] / times["prefix cache"], "x",
       "the prefix cache shortens the time to first token where prefill time grows with the prompt",
       device=dev, dtype=env.dtype, prompt_tokens=len(chat_prompt(system, asked[0])))
'''),
md(r"""
### When what is left fits a CUDA graph

Read the two times above against lab 02. On a CPU a prefill's time grows with its tokens, on top of
a fixed cost per pass: skipping most of the tokens saves much of the time, but less than their
share. On a GPU this model's forward pass is launch-bound: a prefill of a dozen tokens launches the
same kernels as one of a few hundred, and costs about as much. The cache saved the work, but not
yet the time. (On the H100 we tried, without the untimed first pass over the questions, this ratio
came out at 1.0x in one run and 0.5x in another: a first pass at a new size can include loading its
kernels.)

What the cache does change is the **size** of what is left: the question alone, a few dozen tokens,
every time. Engines replay passes of small, fixed sizes from CUDA graphs: vLLM captures passes of up
to a few hundred tokens, pads each pass up to the next captured size, and runs longer passes
eagerly. So a prefill that the cache made short fits a graph, while a long whole prompt does not.
Below, one sequence in a one-slot cache (labs 04 and 08) with a single graph
captured for passes of `W` tokens, `W` a multiple of 16 longer than any question. After the cached
system prompt, each question is sent as its last `W` prompt tokens: a question shorter than `W`
recomputes a few system-prompt tokens that were already cached, which costs nothing extra in a
graph of fixed size. Three times to first token, over the same questions (on a CPU the graph is
lab 02's stand-in, which reruns every op):
"""),
code(r'''
from course.engine.speculative import extend, rollback
from course.engine.width_graphs import SlotCachePool

sys_ids = encode(f"System: {system}\n")
asked_ids = [chat_prompt(system, q) for q in asked]
W = (max(len(p) - len(sys_ids) for p in asked_ids) // 16 + 1) * 16   # past the longest question, in whole 16s
assert W <= len(sys_ids), "the graph's window must start inside the cached system prompt"
one = SlotCachePool(graphs=True).get(model, max(len(p) for p in asked_ids), widths=(W,))   # graph of W tokens

def slot_ttft(mode: str) -> tuple[float, list[int]]:
    """Median time to the first token's logits over the questions, and each question's first token."""
    todo, firsts = iter(asked_ids * 2), []                               # every question untimed first (new shapes)
    one.reset(0)
    extend(model, one, sys_ids)                                          # the system prompt, cached once
    def ask():
        p = next(todo)
        if mode == "no cache":                                           # the whole prompt, eagerly
            one.reset(0)
            logits = extend(model, one, p)
        else:                                                            # only what the cache does not hold
            keep = len(sys_ids) if mode == "prefix cache, eager" else len(p) - W
            rollback(one, keep)
            logits = extend(model, one, p[keep:])                        # W tokens: replayed from the graph
        firsts.append(int(logits[-1].argmax()))
    for _ in asked_ids:
        ask()
    firsts.clear()
    seconds = benchmark(ask, warmup=1, repeats=len(asked_ids) - 1, device=dev).median
    return seconds, firsts

where = f"{dev}, {str(env.dtype).removeprefix('torch.')}"
slot_times, slot_firsts = {}, {}
graphed = f"prefix cache, {W} tokens from a graph"
for mode in ("no cache", "prefix cache, eager", graphed):
    slot_times[mode], slot_firsts[mode] = slot_ttft(mode)
    print(f"  time to first token, {mode:>34}: {1e3 * slot_times[mode]:7.1f} ms   "
          f"({slot_times['no cache'] / slot_times[mode]:.1f}x)")
same = sum(len(set(firsts)) == 1 for firsts in zip(*slot_firsts.values()))
print(f"same first token in all three: {same} of {len(asked_ids)} questions ({where}; {one.graphs.describe()})")
record("prefix_cache_ttft_speedup_slot_eager", slot_times["no cache"] / slot_times["prefix cache, eager"], "x",
       "the cached prefix, suffix run eagerly, in the one-slot cache", device=dev, dtype=env.dtype,
       prompt_tokens=len(asked_ids[0]))
record("prefix_cache_ttft_speedup_graph", slot_times["no cache"] / slot_times[graphed], "x",
       "with the prefix cached, what is left fits a CUDA graph: the time to first token drops on a GPU too",
       device=dev, dtype=env.dtype, prompt_tokens=len(asked_ids[0]), graph_tokens=W)
'''),
md(r"""
Read the three lines. On a CPU the eager line beats the whole prompt, though by less than the share
of the prompt the cache holds: each pass keeps its fixed cost. On a CPU the graph line comes out no
better than the eager one, and usually behind it: it computes all `W` tokens, more than the
question's, and the stand-in saves no launches (a CPU has none to save). On a GPU the eager line's
time comes out close to the whole prompt's (a ratio near 1x, a little above or below it with the
noise), and the graph line shows what the saved tokens are worth once the launches are gone: there,
prefix caching pays through the graph.
"""),
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
def run_chat():
    """One conversation through two fresh engines that both live across the turns. Returns a row per
    turn and the number of turns whose answer was the same with and without the cache."""
    chat = {name: Engine(model, n_blocks=128, block_size=BLOCK, prefix_caching=caching)
            for name, caching in (("no cache", False), ("prefix cache", True))}
    history, rows, same = encode(f"System: {system}\n"), [], 0
    for i, user in enumerate(turns):
        prompt = history + encode(f"User: {user}\nAssistant:")
        done = {name: eng.run([Request(i, prompt, env.pick(16, 4, cpu=10))]).requests[0] for name, eng in chat.items()}
        same += done["no cache"].output == done["prefix cache"].output
        answer = done["prefix cache"].output
        rows.append((i + 1, len(prompt), done["prefix cache"].n_cached, done["no cache"].prefill_s,
                     done["prefix cache"].prefill_s))
        history = prompt + answer + encode("\n")
    return rows, same

run_chat()                    # untimed: so that no time below is a first pass at its size
rows, same = run_chat()
print("turn  prompt  cached  prefill no cache  prefill cache")
for turn, n, hit, t0, t1 in rows:
    print(f"{turn:>4}  {n:>6}  {hit:>6}  {1e3 * t0:>13.0f} ms  {1e3 * t1:>10.0f} ms")
print(f"over the chat: {sum(r[2] for r in rows)} of {sum(r[1] for r in rows)} prompt tokens came from the cache; "
      f"the answers were the same with and without it in {same} of {len(rows)} turns"
      + (" (in bfloat16 a near-tie may round another way)" if env.dtype != torch.float32 else ""))

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
Without the cache, the prompt tokens computed grow with the whole conversation at every turn: the total
work grows with the square of the number of turns. With it, each turn computes only its new message,
the last token of the previous answer and the partial blocks around them. On a CPU the prefill time
grows with the tokens, on top of a fixed cost per pass, so the cache saves less time than tokens. On
a GPU, at these lengths, it follows them only loosely: an eager pass is launch-bound (lab 02), so the
cache saves far less time than it saves tokens. Each time in the table
is a single run, so read it with some noise in mind. The cell runs the whole chat twice, through
fresh engines each time, and shows only the second run's times. The reason is the one the
time-to-first-token cell gave: on a GPU, the first pass at a new size can include loading the kernels
it picks. (Turn 1 has nothing to reuse: its two times measure the same work.)

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

**Questions**. Answer in the cell under each group, in a few sentences of your own and with **your**
numbers where a question asks for them; a person grades them (4 points in all).
1. Why must the hash of a block include its parent's hash? Give two prompts that a hash of the block
   alone would confuse, and say what the model would then compute.
2. Why is the partial last block never shared? What would go wrong when two requests share it and both decode?
"""),
answer("hash_chain_answer", 1, "questions 1 and 2", model=r"""
1. A block's keys and values depend on its own tokens **and on every token before it**: from layer 1
   on, each hidden state mixes the whole prefix through attention, and RoPE rotates by the absolute
   position. A hash of the block alone names only its tokens. With blocks of 4, "The cat sat on | the
   mat and slept" and "A dog lay on | the mat and slept" have the same second block, and so does a
   prompt that starts with "the mat and slept" (the same tokens as block 0, at other positions). A
   hit there would hand the second request keys and values computed after "The cat sat on": the
   model would attend to a context the user never sent and continue as if the prompt had been the
   other one, a silently different answer from the uncached one. The chain makes the hash name the
   whole prefix.
2. The partial last block is still being written: the sequence's next token goes into its next free
   slot, and its content (and so any hash of it) is not final. If two requests shared it and both
   decoded, both would write their own next token's keys and values into the same slot, each
   overwriting the other's, and each would then attend to the other's token: both outputs would be
   wrong. (Lab 05's fork handles such a block with copy-on-write; the prefix cache simply shares only
   full blocks.)
""", rubric=r"""
- 0.5: question 1: keys and values depend on the whole prefix (and positions); two prompts with an
  identical block after different prefixes; the model would attend to the wrong context and give an
  answer different from the uncached one.
- 0.5: question 2: the last block is still written by its owner (not final, no stable hash); shared,
  two decoders overwrite each other's slot and read each other's keys.
"""),
md(r"""
3. A prompt is exactly 4 full blocks long and all of them are cached. How many tokens does the engine
   compute, and why not zero?
4. What would happen if `share` forgot to take a free block out of the LRU queue? Describe the first
   request that would see wrong keys.
"""),
answer("last_block_lru_answer", 1, "questions 3 and 4", model=r"""
3. A whole block: `block_size` tokens (16 here). `match` looks only at `tokens[:-1]`, whose full blocks
   are the first 3, so the 4th block is allocated fresh and computed again. Not zero, because the
   cache keeps keys and values, not logits: the first new token's logits come from a forward pass
   over the last prompt token, so at least that token must run, and at block granularity its whole
   block is recomputed (vLLM does the same).
4. The block would be in use (reference count 1) and still in `free_queue`. The next `take` that
   reaches it in LRU order would hand it out as a fresh block: evict its hash and give it to another
   request, whose prefill writes its own keys and values into it. Example: A finishes and its blocks
   stay cached; B shares A's first block P; C arrives and needs fresh blocks, and `take` pops P. The
   first request to see wrong keys is **B**: at its next step (a decode, or the rest of its prefill)
   its attention reads P, which now holds C's tokens, so B's output departs from the uncached one.
   (C is fine: it wrote P itself. The reference counts are wrong from then on too.)
""", rubric=r"""
- 0.5: question 3: block_size tokens (the last block), because the last token must run to give the
  first token's logits (match uses tokens[:-1]).
- 0.5: question 4: a shared block can be taken as free, evicted and overwritten by a newcomer; the
  request that shared it (still running) is the first to read wrong keys.
"""),
md(r"""
5. The token check costs a tuple comparison per hit. With 64-bit hashes, how many cached blocks would
   a server need before a collision becomes likely (the birthday bound)? Is the check worth it?
6. In your multi-turn measurement, how does the prefill time per turn grow with and without the cache?
   What happens to the total over a 50-turn chat?
"""),
answer("collisions_chat_answer", 1, "questions 5 and 6", model=r"""
5. Among `N` random 64-bit hashes a collision has probability about `N^2 / 2^65`; it reaches one half
   at `N = sqrt(2 ln 2 x 2^64)`, about 5 x 10^9 blocks (at 16 tokens and SmolLM2's 23 KB per token, some
   1.9 PB of keys and values: far beyond any server). Over a server's life the relevant count is
   lookups times cached blocks, still a tiny probability with a strong hash. The check is still worth
   it: it costs a comparison of 16 integers per hit, nothing next to a forward pass, and turns a
   silent wrong answer (and, with a weak or truncated hash, a collision an attacker could craft to
   read another tenant's context) into a plain miss.
6. Without the cache each turn's prompt is the whole conversation so far, so its prefill grows with
   every turn (on a CPU roughly linearly in the tokens, on top of a fixed cost; on a GPU, at these
   lengths, it stays near the launch-bound floor). With the cache each turn computes only its new
   message, the last token of the previous answer and the partial blocks around them: about the same
   small amount every turn (the student quotes their cached-token counts and times). Over 50 turns,
   with about `m` new tokens per exchange, the uncached total is about `50 S + 1,275 m` prompt tokens
   (quadratic in the number of turns), the cached one about `50 (m + block_size)`: linear. (With
   `m` = 60 and a 100-token system prompt: about 81,000 against 4,000 tokens.) The conversation's
   cache grows linearly and must stay cached between turns (LRU pressure can evict it).
""", rubric=r"""
- 0.5: question 5: the birthday bound (about 2^32, a few billion blocks) and a reasoned verdict that
  the check is worth its negligible cost (silent wrong answers, crafted collisions).
- 0.5: question 6: uncached per-turn prefill grows with the conversation (with the student's times),
  cached stays about constant; total quadratic against linear over 50 turns.
"""),
md(r"""
7. From your hit-rate plot: how much cache does this traffic need? Which requests still miss when the
   cache is large, and why can no cache help them?
8. Why can a radix tree evict only leaves, and why must a running request lock its path?
"""),
answer("hit_rate_radix_answer", 1, "questions 7 and 8", model=r"""
7. (Example: the lab's traffic, 400 requests, blocks of 16.) The hit rate climbs from about 43% at 24
   blocks (384 tokens) to 76% at 64 and levels off at 81-83% from about 96-128 blocks (1,500-2,000
   tokens): the six system prompts hold 740 tokens together, and the cache also needs room for the
   current request and for the questions and answers that pass through it. Beyond that more cache
   buys nothing. What still misses: every question (new text, 8-40 tokens per request), the block
   where the system prompt ends and the question begins (recomputed by every request with the
   hashes), and the first request of each system prompt (a cold miss). No cache can help them:
   their keys and values were never computed before, since no earlier request had those tokens at
   those positions after that prefix.
8. An inner node is a prefix of everything below it: its children's keys and values were computed
   after it and are reached only through it. Removing it would cut its descendants off (their slots
   unreachable, wasted) and free slots that their matches still rely on; a leaf is used by nothing
   else, so removing leaves, least recently used first, keeps every stored path a valid prefix. A
   running request reads the slots of its matched path at every step; unlocked, they could be
   evicted and handed to another request that overwrites them. `lock_ref` on its node and every
   ancestor keeps the whole path (which becomes a leaf as descendants go) out of eviction until it
   finishes.
""", rubric=r"""
- 0.5: question 7: a cache size read from the student's plot (where the hit rate levels off, about the
  popular prompts together plus working room) and the misses that remain: the questions (new tokens),
  the boundary block, cold first requests.
- 0.5: question 8: inner nodes are prefixes that descendants depend on (leaves only keeps paths valid);
  a running request's path must not be evicted and overwritten while it reads it (locks up the path).
"""),
md(r"""

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
