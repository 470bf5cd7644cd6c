"""Lab 05's block allocator, released for the labs after it: blocks of a shared pool handed out as
sequences grow, a block table per sequence, reference counts so that sequences can share blocks
(fork), and copy-on-write before a sequence writes into a block it shares.

    alloc = BlockAllocator(n_blocks=64, block_size=16)
    slots = alloc.append(seq, len(prompt))     # the pool slot of each new token
    alloc.fork(seq, child)                     # child shares every block of seq
    alloc.append(child, 1)                     # copies the shared, partly full last block first
    cache.copy_block(*alloc.pending_copies.pop())
    alloc.free(seq)

A token at position p of a sequence lives in slot `table[p // block_size] * block_size + p % block_size`.
"""
from __future__ import annotations

from collections import deque
from collections.abc import Hashable


class OutOfBlocks(RuntimeError):
    """The pool has fewer free blocks than a request needs."""


class BlockAllocator:
    """Fixed-size blocks from a free list (taken from the front, returned to the back), one block
    table and one length per sequence, reference counts, fork and copy-on-write. A subclass with
    `copy_on_write = False` is lab 05's Problem 1 alone: appends never copy a shared block."""

    copy_on_write = True

    def __init__(self, n_blocks: int, block_size: int):
        for name, value in (("n_blocks", n_blocks), ("block_size", block_size)):
            if type(value) is not int or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        self.n_blocks, self.block_size = n_blocks, block_size
        self.free_blocks: deque[int] = deque(range(n_blocks))
        self.ref_count: list[int] = [0] * n_blocks
        self.block_tables: dict[Hashable, list[int]] = {}
        self.lengths: dict[Hashable, int] = {}
        self.pending_copies: list[tuple[int, int]] = []   # (from block, to block): the engine copies, then clears

    @property
    def n_free(self) -> int:
        return len(self.free_blocks)

    def blocks_for(self, n_tokens: int) -> int:
        """Blocks that hold n_tokens tokens."""
        return -(-n_tokens // self.block_size)

    def _needs_copy(self, seq: Hashable) -> bool:
        """The next token of `seq` goes into a partly full block that another sequence shares."""
        table, length = self.block_tables.get(seq), self.lengths.get(seq, 0)
        return (self.copy_on_write and bool(table) and length % self.block_size != 0
                and self.ref_count[table[-1]] > 1)

    def new_blocks_needed(self, seq: Hashable, n: int) -> int:
        """Free blocks `seq` takes to grow by n tokens (a copy-on-write block included)."""
        length = self.lengths.get(seq, 0)
        return self.blocks_for(length + n) - self.blocks_for(length) + self._needs_copy(seq)

    def append(self, seq: Hashable, n: int) -> list[int]:
        """Room for n more tokens of `seq` (new or existing): their slots, in order. Raises
        OutOfBlocks, changing nothing, when the free blocks do not suffice."""
        if type(n) is not int or n < 1:
            raise ValueError(f"n must be a positive int (new tokens), got {n!r}")
        need = self.new_blocks_needed(seq, n)
        if need > self.n_free:
            raise OutOfBlocks(f"sequence {seq!r} needs {need} more blocks for {n} tokens, but only {self.n_free} are free")
        table = self.block_tables.setdefault(seq, [])
        if self._needs_copy(seq):                        # copy-on-write: a private copy of the shared last block
            old, new = table[-1], self.free_blocks.popleft()
            self.ref_count[old] -= 1
            self.ref_count[new] = 1
            table[-1] = new
            self.pending_copies.append((old, new))
        length = self.lengths.get(seq, 0)
        for _ in range(self.blocks_for(length + n) - len(table)):
            block = self.free_blocks.popleft()
            self.ref_count[block] = 1
            table.append(block)
        self.lengths[seq] = length + n
        return [self.slot(seq, p) for p in range(length, length + n)]

    def slot(self, seq: Hashable, pos: int) -> int:
        """The pool slot of token `pos` of `seq`."""
        table = self.block_tables[seq]
        return table[pos // self.block_size] * self.block_size + pos % self.block_size

    def fork(self, parent: Hashable, child: Hashable) -> None:
        """`child` starts as a copy of `parent`, sharing every block (parallel sampling, beams)."""
        if parent not in self.block_tables:
            raise KeyError(f"sequence {parent!r} holds no blocks: nothing to fork")
        if child in self.block_tables:
            raise ValueError(f"sequence {child!r} already exists")
        self.block_tables[child] = list(self.block_tables[parent])
        self.lengths[child] = self.lengths[parent]
        for block in self.block_tables[child]:
            self.ref_count[block] += 1

    def free(self, seq: Hashable) -> None:
        """Give back the blocks of `seq`: a block is free again when no sequence uses it."""
        if seq not in self.block_tables:
            raise KeyError(f"sequence {seq!r} holds no blocks")
        for block in self.block_tables.pop(seq):
            self.ref_count[block] -= 1
            if self.ref_count[block] == 0:
                self.free_blocks.append(block)
        del self.lengths[seq]

    def __repr__(self) -> str:
        return (f"BlockAllocator(n_blocks={self.n_blocks}, block_size={self.block_size}, free={self.n_free}, "
                f"sequences={len(self.block_tables)})")
