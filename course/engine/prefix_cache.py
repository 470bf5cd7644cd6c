"""Lab 09's prefix cache, released for the labs after it: KV blocks that outlive their requests and
are found again by a chained hash of the tokens they hold.

    pc = PrefixCache(n_blocks=256, block_size=16)
    n_cached, slots = pc.allocate(seq, prompt)   # shares the cached full blocks of prompt[:-1]
    ...                                          # the model writes keys/values for prompt[n_cached:] into `slots`
    pc.commit(seq, prompt)                       # its computed full blocks become findable
    slot, = pc.append(seq, 1)                    # room for each decoded token
    pc.free(seq)                                 # its blocks stay cached until evicted (LRU)

Block i of a sequence is named hash(hash of block i - 1, tokens of block i): one name covers the whole
prefix. Only full blocks are shared. A freed block keeps its contents with reference count 0 in an LRU
queue; taking a fresh block evicts the least recently used one. Every hit checks the block's tokens
and its parent block, so a hash collision can never hand out the wrong keys and values.
"""
from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence

from course.engine.block_manager import OutOfBlocks


def hash_block(parent: int | None, block: tuple[int, ...]) -> int:
    """64-bit hash of (the previous block's hash, this block's token ids); parent None for block 0."""
    data = repr((parent, tuple(int(t) for t in block))).encode()
    return int.from_bytes(hashlib.sha256(data).digest()[:8], "little")


def block_hashes(tokens: Sequence[int], block_size: int, hash_fn: Callable = hash_block) -> list:
    """Chained hashes of the full blocks of `tokens`: hash i covers tokens[: (i + 1) * block_size]."""
    hashes, parent = [], None
    for i in range(len(tokens) // block_size):
        parent = hash_fn(parent, tuple(tokens[i * block_size:(i + 1) * block_size]))
        hashes.append(parent)
    return hashes


class BlockPool:
    """Physical blocks with reference counts, a hash -> block map, and an LRU queue of unused blocks."""

    def __init__(self, n_blocks: int, block_size: int):
        for name, value in (("n_blocks", n_blocks), ("block_size", block_size)):
            if type(value) is not int or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        self.n_blocks, self.block_size = n_blocks, block_size
        self.ref_count = [0] * n_blocks
        self.free_queue: OrderedDict[int, None] = OrderedDict.fromkeys(range(n_blocks))   # count 0, LRU first
        self.cached: dict[int, int] = {}                        # hash -> block
        self.meta: list[tuple | None] = [None] * n_blocks       # block -> (hash, parent block, tokens)

    @property
    def n_free(self) -> int:
        """Blocks no sequence uses (some may still hold cached tokens)."""
        return len(self.free_queue)

    def take(self, n: int) -> list[int]:
        """n blocks for new content, least recently used first, each with one user; evicts cached content."""
        if n > self.n_free:
            raise OutOfBlocks(f"need {n} free blocks, but only {self.n_free} are free")
        out = []
        for _ in range(n):
            block, _ = self.free_queue.popitem(last=False)
            if self.meta[block] is not None:
                del self.cached[self.meta[block][0]]
                self.meta[block] = None
            self.ref_count[block] = 1
            out.append(block)
        return out

    def share(self, block: int) -> None:
        if self.ref_count[block] == 0:
            del self.free_queue[block]                          # in use: never evicted
        self.ref_count[block] += 1

    def release(self, block: int) -> None:
        if self.ref_count[block] < 1:
            raise ValueError(f"block {block} has no user to release")
        self.ref_count[block] -= 1
        if self.ref_count[block] == 0:
            self.free_queue[block] = None                       # back of the queue: evicted last

    def register(self, block: int, h: int, parent: int | None, tokens: Sequence[int]) -> None:
        if h not in self.cached and self.meta[block] is None:
            self.cached[h] = block
            self.meta[block] = (h, parent, tuple(tokens))

    def lookup(self, h: int, parent: int | None, tokens: Sequence[int]) -> int | None:
        block = self.cached.get(h)
        if block is None or self.meta[block][1:] != (parent, tuple(tokens)):
            return None                                         # a miss, or a collision caught by the check
        return block


class PrefixCache:
    """Block tables of sequences over a BlockPool whose full blocks are found again by their hash."""

    def __init__(self, n_blocks: int, block_size: int, enabled: bool = True, hash_fn: Callable = hash_block):
        self.pool, self.block_size, self.enabled, self.hash_fn = BlockPool(n_blocks, block_size), block_size, enabled, hash_fn
        self.tables: dict[Hashable, list[int]] = {}
        self.lengths: dict[Hashable, int] = {}
        self.hashes: dict[Hashable, list[int]] = {}
        self.queried_tokens = 0                                 # prompt tokens looked up (allocate)
        self.hit_tokens = 0                                     # of which came from the cache

    def slot(self, seq: Hashable, pos: int) -> int:
        return self.tables[seq][pos // self.block_size] * self.block_size + pos % self.block_size

    def match(self, tokens: Sequence[int]) -> list[int]:
        """Cached blocks of the longest cached run of full blocks of tokens[:-1] (the last token is always computed)."""
        bs, blocks, parent = self.block_size, [], None
        for i, h in enumerate(block_hashes(tokens[:-1], bs, self.hash_fn) if self.enabled else []):
            block = self.pool.lookup(h, parent, tokens[i * bs:(i + 1) * bs])
            if block is None:
                break
            blocks.append(block)
            parent = block
        return blocks

    def allocate(self, seq: Hashable, tokens: Sequence[int]) -> tuple[int, list[int]]:
        """Blocks for a new sequence: (tokens found in the cache, slots of the tokens to compute).
        Raises OutOfBlocks, changing nothing, when the free blocks do not suffice."""
        if seq in self.tables:
            raise ValueError(f"sequence {seq!r} already has blocks")
        if len(tokens) == 0:
            raise ValueError("tokens must hold at least one token")
        hits = self.match(tokens)
        need = -(-len(tokens) // self.block_size) - len(hits)
        free_after = self.pool.n_free - sum(self.pool.ref_count[b] == 0 for b in hits)
        if need > free_after:
            raise OutOfBlocks(f"sequence {seq!r} needs {need} new blocks, but only {free_after} are free")
        for b in hits:
            self.pool.share(b)
        self.tables[seq] = hits + self.pool.take(need)
        self.lengths[seq] = len(tokens)
        n_cached = len(hits) * self.block_size
        self.hashes[seq] = block_hashes(tokens[:n_cached], self.block_size, self.hash_fn)
        self.queried_tokens += len(tokens)
        self.hit_tokens += n_cached
        return n_cached, [self.slot(seq, p) for p in range(n_cached, len(tokens))]

    def blocks_needed(self, seq: Hashable, n: int) -> int:
        """Fresh blocks `seq` takes to grow by n tokens."""
        return -(-(self.lengths[seq] + n) // self.block_size) - len(self.tables[seq])

    def append(self, seq: Hashable, n: int) -> list[int]:
        """Slots for n more tokens of seq; OutOfBlocks (changing nothing) when the pool is empty."""
        table, length = self.tables[seq], self.lengths[seq]
        table.extend(self.pool.take(self.blocks_needed(seq, n)))
        self.lengths[seq] = length + n
        return [self.slot(seq, p) for p in range(length, length + n)]

    def commit(self, seq: Hashable, tokens: Sequence[int]) -> None:
        """Register seq's full blocks among `tokens` (those whose keys and values are written) not registered yet."""
        bs, table, known = self.block_size, self.tables[seq], self.hashes[seq]
        for i in range(len(known), min(self.lengths[seq], len(tokens)) // bs):
            block = tuple(tokens[i * bs:(i + 1) * bs])
            h = self.hash_fn(known[-1] if known else None, block)
            self.pool.register(table[i], h, table[i - 1] if i else None, block)
            known.append(h)

    def free(self, seq: Hashable) -> None:
        """Release seq's blocks, last block first: its first blocks, the most shareable, are evicted last."""
        if seq not in self.tables:
            raise KeyError(f"sequence {seq!r} holds no blocks")
        for b in reversed(self.tables.pop(seq)):
            self.pool.release(b)
        del self.lengths[seq], self.hashes[seq]

    @property
    def blocks_in_use(self) -> int:
        return self.pool.n_blocks - self.pool.n_free

    @property
    def hit_rate(self) -> float:
        """Share of the prompt tokens looked up so far that came from the cache."""
        return self.hit_tokens / self.queried_tokens if self.queried_tokens else 0.0
