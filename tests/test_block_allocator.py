"""Allocator properties under random reserve / commit / rollback / free / share sequences."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from eagle_serve.scheduler.block_allocator import BlockAllocator, OutOfBlocks

OPS = st.lists(st.tuples(st.sampled_from(["reserve", "commit", "rollback", "free", "share"]),
                         st.integers(0, 5), st.integers(0, 40)), max_size=120)


@settings(max_examples=300, deadline=None)
@given(ops=OPS, num_blocks=st.integers(1, 24), block_size=st.sampled_from([1, 2, 4, 16]))
def test_blocks_are_never_double_handed_and_all_come_back(ops, num_blocks, block_size):
    alloc = BlockAllocator(num_blocks, block_size)
    tables = [alloc.new_table() for _ in range(6)]
    shared: list[int] = []  # extra references taken with incref
    for op, which, n in ops:
        t = tables[which]
        if op == "reserve":
            before = list(t.blocks)
            try:
                alloc.reserve(t, n)
                assert t.capacity >= t.num_committed + n
            except OutOfBlocks:
                assert t.blocks == before  # all or nothing
        elif op == "commit":
            k = min(n, t.capacity - t.num_committed)
            alloc.commit(t, k)
            assert len(t.blocks) == t.blocks_needed(t.num_committed)  # scratch returned at once
        elif op == "rollback":
            alloc.rollback(t)
            assert t.capacity - t.num_committed < block_size
        elif op == "free":
            alloc.free(t)
        elif op == "share" and t.blocks:
            alloc.incref(t.blocks[0])
            shared.append(t.blocks[0])
        held = [b for tb in tables for b in tb.blocks]
        assert len(held) == len(set(held)), "a block is held by two tables"
        assert all(alloc.refcount(b) >= 1 for b in held)
        assert all(alloc.refcount(b) >= 0 for b in range(num_blocks))
        in_use = sum(1 for b in range(num_blocks) if alloc.refcount(b) > 0)
        assert alloc.num_free_blocks + in_use == num_blocks  # every block free xor referenced
        assert len(set(alloc._free)) == len(alloc._free)
    for t in tables:
        alloc.free(t)
    for b in shared:
        alloc._release(b)
    assert alloc.num_free_blocks == num_blocks
    assert all(alloc.refcount(b) == 0 for b in range(num_blocks))


def test_double_free_is_an_error():
    alloc = BlockAllocator(4, 2)
    t = alloc.new_table()
    alloc.reserve(t, 3)
    block = t.blocks[0]
    alloc.free(t)
    with pytest.raises(ValueError, match="freed twice"):
        alloc._release(block)


def test_commit_past_the_reservation_is_an_error():
    alloc = BlockAllocator(4, 2)
    t = alloc.new_table()
    alloc.reserve(t, 3)  # capacity 4
    with pytest.raises(ValueError, match="cannot commit"):
        alloc.commit(t, 5)


def test_slots_follow_the_block_table():
    alloc = BlockAllocator(8, 4)
    t = alloc.new_table()
    t.blocks = [5, 2]
    assert t.slots(0, 8) == [20, 21, 22, 23, 8, 9, 10, 11]


def test_take_uncached_leaves_cached_prefixes_and_held_blocks_alone():
    from eagle_serve.scheduler.block_allocator import block_hashes
    a = BlockAllocator(8, 4, enable_prefix_caching=True)
    held, cached = a.new_table(), a.new_table()
    a.reserve(held, 4)
    a.reserve(cached, 8)
    a.commit(cached, 8)
    hashes = block_hashes(list(range(8)), 4)
    a.register(cached, hashes)
    cached_blocks = list(cached.blocks)
    a.free(cached)  # unheld but cached: evictable, counted free
    borrowed = a.take_uncached()
    assert sorted(borrowed.blocks) == sorted(set(range(8)) - set(held.blocks) - set(cached_blocks))
    assert a.num_free_blocks == 2  # only the cached ones remain takeable
    # the KV usage metric's count: what sequences hold, not what an idle profile borrowed
    assert a.num_used_blocks == 6 and a.num_held_blocks == 1
    a.free(borrowed)
    assert a.num_free_blocks == 7 and all(a.cached(h) for h in hashes)
    assert a.num_used_blocks == a.num_held_blocks == 1 and a.num_borrowed == 0
    again = a.new_table()
    assert a.match_prefix(again, hashes) == 8 and again.blocks == cached_blocks


def test_blocks_are_handed_out_lowest_id_first():
    """Live blocks stay packed at the start of the cache: a freed block is the next one taken
    when it is the lowest free, whatever was freed after it (scattered blocks make a speculative
    engine's plain rounds slower)."""
    alloc = BlockAllocator(8, 2)
    a, b, c = alloc.new_table(), alloc.new_table(), alloc.new_table()
    for t in (a, b, c):
        alloc.reserve(t, 2)
    assert (a.blocks, b.blocks, c.blocks) == ([0], [1], [2])
    alloc.free(a)
    alloc.free(c)  # freed last, but 0 is lower
    d = alloc.new_table()
    alloc.reserve(d, 4)
    assert d.blocks == [0, 2]
    alloc.reserve(b, 6)  # b's scratch past its committed length: the lowest free blocks
    assert b.blocks == [1, 3, 4]
    alloc.commit(b, 2)
    assert b.blocks == [1] and alloc._take() == 3
    lifo = BlockAllocator(8, 2, lowest_first=False)  # the block freed last comes back first
    a, c = lifo.new_table(), lifo.new_table()
    lifo.reserve(a, 4)
    lifo.reserve(c, 2)
    lifo.free(a)
    lifo.reserve(c, 4)
    assert c.blocks == [2, 0]
    lifo.set_order(lowest_first=True)
    lifo.reserve(c, 6)
    assert c.blocks == [2, 0, 1]


def test_block_hashes_are_digests_of_the_tokens_not_pythons_hash():
    """Equal hashes must mean equal tokens, whoever sent them: Python's hash() of the token tuple
    maps an int and that int plus 2^61 - 1 to the same value, and a 64-bit unseeded hash can be
    collided on purpose (a crafted block would be served another client's KV)."""
    from eagle_serve.scheduler.block_allocator import block_hashes
    m = (1 << 61) - 1
    a, b = block_hashes([5, 6, 7, 8], 4), block_hashes([5 + m, 6, 7, 8], 4)
    assert a != b and len(a[0]) == 16
    assert block_hashes([5, 6, 7, 8, 9, 10, 11, 12], 4) == a + block_hashes([9, 10, 11, 12], 4, parent=a[0])
    assert block_hashes([9, 10, 11, 12], 4) != block_hashes([9, 10, 11, 12], 4, parent=a[0])  # chained
