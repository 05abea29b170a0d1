"""Paged KV bookkeeping: a pool of fixed-size blocks and per-sequence block tables.

The engine owns the KV tensors; this module only decides which slots a sequence may write.
A slot is `block_id * block_size + offset`. A sequence's blocks need not be contiguous.

A round may add several tokens at once (a speculative tree), so the API is reserve / commit /
roll back: `reserve(table, n)` makes room for `n` tokens past the committed length,
`commit(table, n)` keeps the first `n` of them, and any block no longer needed is returned to the
pool at once.
"""
from __future__ import annotations

from dataclasses import dataclass, field


class OutOfBlocks(RuntimeError):
    """Raised when a reservation needs more free blocks than the pool has."""


@dataclass
class BlockTable:
    """The blocks of one sequence and how many of its tokens hold committed KV."""

    block_size: int
    blocks: list[int] = field(default_factory=list)
    num_committed: int = 0  # tokens whose KV is final

    @property
    def capacity(self) -> int:
        return len(self.blocks) * self.block_size

    def blocks_needed(self, num_tokens: int) -> int:
        """Blocks required to hold `num_tokens` tokens in total."""
        return -(-num_tokens // self.block_size)

    def slots(self, start: int, stop: int) -> list[int]:
        """Cache slots of storage positions [start, stop) (the engine computes the same map)."""
        bs = self.block_size
        return [self.blocks[p // bs] * bs + p % bs for p in range(start, stop)]


class BlockAllocator:
    """Free list plus reference counts over `num_blocks` blocks of `block_size` tokens."""

    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError(f"need positive num_blocks and block_size, got {num_blocks}, {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))  # pop() hands out 0 first
        self._refcount = [0] * num_blocks

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def refcount(self, block_id: int) -> int:
        return self._refcount[block_id]

    def new_table(self) -> BlockTable:
        return BlockTable(self.block_size)

    def can_reserve(self, table: BlockTable, num_tokens: int) -> bool:
        extra = table.blocks_needed(table.num_committed + num_tokens) - len(table.blocks)
        return extra <= len(self._free)

    def reserve(self, table: BlockTable, num_tokens: int) -> None:
        """Make room for `num_tokens` tokens past the committed length (all or nothing)."""
        if num_tokens < 0:
            raise ValueError("num_tokens must be >= 0")
        extra = table.blocks_needed(table.num_committed + num_tokens) - len(table.blocks)
        if extra > len(self._free):
            raise OutOfBlocks(f"need {extra} blocks, {len(self._free)} free")
        for _ in range(extra):
            table.blocks.append(self._take())

    def commit(self, table: BlockTable, num_tokens: int) -> None:
        """Keep `num_tokens` more tokens as committed; return blocks past them to the pool."""
        new_len = table.num_committed + num_tokens
        if num_tokens < 0 or new_len > table.capacity:
            raise ValueError(f"cannot commit {num_tokens} tokens: capacity {table.capacity}, "
                             f"committed {table.num_committed}")
        table.num_committed = new_len
        self._trim(table)

    def rollback(self, table: BlockTable) -> None:
        """Drop every reserved, uncommitted slot."""
        self._trim(table)

    def free(self, table: BlockTable) -> None:
        """Release all of a sequence's blocks (finish, abort, preemption)."""
        for block_id in reversed(table.blocks):
            self._release(block_id)
        table.blocks.clear()
        table.num_committed = 0

    def _trim(self, table: BlockTable) -> None:
        keep = table.blocks_needed(table.num_committed)
        while len(table.blocks) > keep:
            self._release(table.blocks.pop())

    def _take(self) -> int:
        block_id = self._free.pop()
        assert self._refcount[block_id] == 0, f"block {block_id} handed out twice"
        self._refcount[block_id] = 1
        return block_id

    def incref(self, block_id: int) -> None:
        """Share a block (prefix reuse); it returns to the pool when the last holder frees it."""
        if self._refcount[block_id] <= 0:
            raise ValueError(f"block {block_id} is free")
        self._refcount[block_id] += 1

    def _release(self, block_id: int) -> None:
        if self._refcount[block_id] <= 0:
            raise ValueError(f"block {block_id} freed twice")
        self._refcount[block_id] -= 1
        if self._refcount[block_id] == 0:
            self._free.append(block_id)
