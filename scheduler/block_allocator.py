"""Paged KV bookkeeping: a pool of fixed-size blocks and per-sequence block tables.

The engine owns the KV tensors; this module only decides which slots a sequence may write.
A slot is `block_id * block_size + offset`. A sequence's blocks need not be contiguous.

A round may add several tokens at once (a speculative tree), so the API is reserve / commit /
roll back: `reserve(table, n)` makes room for `n` tokens past the committed length,
`commit(table, n)` keeps the first `n` of them, and any block no longer needed is returned to the
pool at once.

Prefix caching (optional): a full, committed block is registered under a hash of its tokens and
of every token before it (`block_hashes`). A new sequence whose leading blocks hash the same
takes them by reference instead of recomputing them. A block nobody holds any more keeps its KV
and its hash, on an LRU list; it is reused from there, or evicted (its hash forgotten) when the
free list is empty.
"""
from __future__ import annotations

import hashlib
import heapq
from array import array
from collections import OrderedDict
from dataclasses import dataclass, field


class OutOfBlocks(RuntimeError):
    """Raised when a reservation needs more free blocks than the pool has."""


@dataclass
class BlockTable:
    """The blocks of one sequence and how many of its tokens hold committed KV."""

    block_size: int
    blocks: list[int] = field(default_factory=list)
    num_committed: int = 0  # tokens whose KV is final
    num_registered: int = 0  # leading blocks registered in (or taken from) the prefix cache
    borrowed: bool = False  # taken by `BlockAllocator.take_uncached`, not a sequence's

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


BlockHash = bytes


def block_hashes(tokens: list[int], block_size: int, parent: BlockHash | None = None) -> list[BlockHash]:
    """Hash of every full block of `tokens`, each chained to all tokens before it: a 128-bit
    BLAKE2b digest of the parent's digest and the block's token ids. Python's hash() of the
    token tuple (as this was) is 64 bits, unseeded for ints and invertible step by step, so
    one client could craft a block that collides with another's (a system prompt's) and have
    its KV served to them (vLLM's CVE-2025-25183 was this kind of prefix-cache poisoning)."""
    out, h = [], parent or b""
    for i in range(len(tokens) // block_size):
        h = hashlib.blake2b(h + array("q", tokens[i * block_size:(i + 1) * block_size]).tobytes(),
                            digest_size=16).digest()
        out.append(h)
    return out


class BlockAllocator:
    """Free list plus reference counts over `num_blocks` blocks of `block_size` tokens."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = False,
                 lowest_first: bool = True):
        """lowest_first: hand out the lowest free block id (False: the one freed last). On the
        CPU where a block sits matters: the last-freed order lets a speculative engine's scratch
        reservations scatter its sequences' blocks, which slows every round. Lowest first keeps the free blocks that cache no
        prefix packed at the start of the cache; blocks that do cache one keep their ids on the
        LRU list until they are reused or evicted."""
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError(f"need positive num_blocks and block_size, got {num_blocks}, {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._free: list[int] = list(range(num_blocks))  # a min-heap of the free block ids (lowest_first)
        self.num_borrowed = 0  # blocks in tables from `take_uncached` not yet freed
        self.set_order(lowest_first)
        self._refcount = [0] * num_blocks
        self._by_hash: dict[BlockHash, int] = {}
        self._hash_of: dict[int, BlockHash] = {}
        self._evictable: OrderedDict[int, None] = OrderedDict()  # unheld cached blocks, LRU first
        self.prefix_queried_tokens = 0  # tokens looked up in the prefix cache
        self.prefix_hit_tokens = 0  # of those, found (KV reused, not recomputed)

    def set_order(self, lowest_first: bool) -> None:
        """Hand out the lowest free block id from now on, or (False) the one freed last, the
        lowest first among those free now."""
        self.lowest_first = lowest_first
        if lowest_first:
            heapq.heapify(self._free)
        else:
            self._free.sort(reverse=True)

    @property
    def num_free_blocks(self) -> int:
        """Blocks a reservation can take: free ones and unheld cached ones."""
        return len(self._free) + len(self._evictable)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    @property
    def num_held_blocks(self) -> int:
        """Blocks sequences hold (and shared prefixes they hold): used blocks less those an
        idle-time profile has borrowed for a moment (`take_uncached`), which the KV usage metric
        would otherwise report as a full cache while the server is idle."""
        return self.num_used_blocks - self.num_borrowed

    def match_prefix(self, table: BlockTable, hashes: list[BlockHash]) -> int:
        """Take the longest run of cached blocks matching `hashes` into an empty table; returns
        the number of tokens now committed from the cache."""
        if table.blocks:
            raise ValueError("match_prefix needs an empty block table")
        if not self.enable_prefix_caching:
            return 0
        for h in hashes:
            block = self._by_hash.get(h)
            if block is None:
                break
            if self._refcount[block] == 0:
                del self._evictable[block]
            self._refcount[block] += 1
            table.blocks.append(block)
        table.num_committed = table.num_registered = len(table.blocks)
        table.num_committed *= self.block_size
        return table.num_committed

    def count_lookup(self, queried: int, hit: int) -> None:
        """A sequence admitted with a prefix lookup of `queried` tokens, `hit` of them cached (the
        counters behind the prefix-cache metrics; the scheduler counts admissions, not attempts)."""
        self.prefix_queried_tokens += queried
        self.prefix_hit_tokens += hit

    def cached(self, h: BlockHash) -> bool:
        return h in self._by_hash

    def register(self, table: BlockTable, hashes: list[BlockHash]) -> None:
        """Publish the table's full committed blocks (hashes[i] belongs to block i)."""
        if not self.enable_prefix_caching:
            return
        full = min(table.num_committed // self.block_size, len(hashes), len(table.blocks))
        for i in range(table.num_registered, full):
            block, h = table.blocks[i], hashes[i]
            if h not in self._by_hash and block not in self._hash_of:
                self._by_hash[h] = block
                self._hash_of[block] = h
        table.num_registered = max(table.num_registered, full)

    def refcount(self, block_id: int) -> int:
        return self._refcount[block_id]

    def new_table(self) -> BlockTable:
        return BlockTable(self.block_size)

    def can_reserve(self, table: BlockTable, num_tokens: int) -> bool:
        extra = table.blocks_needed(table.num_committed + num_tokens) - len(table.blocks)
        return extra <= self.num_free_blocks

    def reserve(self, table: BlockTable, num_tokens: int) -> None:
        """Make room for `num_tokens` tokens past the committed length (all or nothing)."""
        if num_tokens < 0:
            raise ValueError("num_tokens must be >= 0")
        extra = table.blocks_needed(table.num_committed + num_tokens) - len(table.blocks)
        if extra > self.num_free_blocks:
            raise OutOfBlocks(f"need {extra} blocks, {self.num_free_blocks} free")
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
        if table.borrowed:
            self.num_borrowed -= len(table.blocks)
            table.borrowed = False
        table.blocks.clear()
        table.num_committed = table.num_registered = 0

    def take_uncached(self) -> BlockTable:
        """A table holding every free block that caches no prefix, for work that overwrites KV
        slots outside any sequence (an idle-time cost profile); `free` gives them back."""
        table = self.new_table()
        while self._free:
            table.blocks.append(self._take())
        table.borrowed = True
        self.num_borrowed += len(table.blocks)
        return table

    def _trim(self, table: BlockTable) -> None:
        keep = table.blocks_needed(table.num_committed)
        while len(table.blocks) > keep:
            self._release(table.blocks.pop())

    def _take(self) -> int:
        if self._free:
            block_id = heapq.heappop(self._free) if self.lowest_first else self._free.pop()
        else:  # evict the least recently released cached block
            block_id, _ = self._evictable.popitem(last=False)
            del self._by_hash[self._hash_of.pop(block_id)]
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
            if block_id in self._hash_of:
                self._evictable[block_id] = None
            elif self.lowest_first:
                heapq.heappush(self._free, block_id)
            else:
                self._free.append(block_id)
