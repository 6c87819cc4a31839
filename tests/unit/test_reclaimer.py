"""The scheduler side's block surgery (:class:`kvcompact.vllm.reclaimer.Reclaimer`) on vLLM's own ``BlockPool``, no
engine: the tail past the kept tokens goes back to the pool, a kept block another request holds is swapped for a
private copy (the other request keeps the shared one), and a round with no free block for its copies waits with
nothing changed. The engine tests (test_prefix_cache, test_pressure) run the same code with the worker's half."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from vllm.v1.core.block_pool import BlockPool

from kvcompact.vllm.reclaimer import Reclaimer

BS = 16


def setup(num_blocks: int = 12) -> tuple[BlockPool, Any, Reclaimer]:
    pool = BlockPool(num_blocks, enable_caching=True, hash_block_size=BS)
    manager = SimpleNamespace(req_to_blocks={})
    return pool, manager, Reclaimer(manager, pool, BS)


def share(blocks: list[Any]) -> None:
    """A second holder for each block, as a prefix-cache hit of another request makes one."""
    for block in blocks:
        block.ref_cnt += 1


def test_the_tail_past_the_kept_tokens_goes_back_to_the_pool() -> None:
    pool, manager, reclaimer = setup()
    manager.req_to_blocks["a"] = pool.get_new_blocks(5)
    free = pool.get_num_free_blocks()
    tail = [b.block_id for b in manager.req_to_blocks["a"][3:]]
    assert reclaimer.free_tail("a", 33) == 2  # 33 tokens occupy 3 blocks of 16
    assert len(manager.req_to_blocks["a"]) == 3 and pool.get_num_free_blocks() == free + 2
    assert {b.block_id for b in pool.get_new_blocks(2)} == set(tail)


def test_a_kept_block_another_request_holds_becomes_a_private_copy() -> None:
    """Request a keeps 40 tokens (3 blocks), the first two of which b holds too: a gets two private copies in their
    place, b keeps the shared blocks alone, and a's kept blocks are all writable. The tail block is not copied.
    Control: a reclaimer that takes every block for writable leaves the shared blocks in a's list."""
    for control in (False, True):
        pool, manager, reclaimer = setup()
        shared = pool.get_new_blocks(2)
        share(shared)
        manager.req_to_blocks["a"] = [*shared, *pool.get_new_blocks(2)]
        manager.req_to_blocks["b"] = list(shared)
        if control:
            reclaimer.unwritable = lambda blocks: []  # type: ignore[method-assign]
        copies = reclaimer.copy_held("a", 40)
        assert copies is not None
        kept = manager.req_to_blocks["a"][:3]
        if control:
            assert copies == [] and kept[:2] == shared and not pool.is_block_writable(kept[0])
            continue
        assert [(c.table_index, c.shared) for c in copies] == [(0, shared[0].block_id), (1, shared[1].block_id)]
        assert [c.private for c in copies] == [b.block_id for b in kept[:2]]
        assert all(pool.is_block_writable(b) for b in kept)
        assert manager.req_to_blocks["b"] == shared and [b.ref_cnt for b in shared] == [1, 1]


def test_no_free_block_for_the_copies_leaves_everything_as_it_was() -> None:
    pool, manager, reclaimer = setup(num_blocks=5)  # 4 usable blocks (block 0 is vLLM's null block)
    shared = pool.get_new_blocks(2)
    share(shared)
    manager.req_to_blocks["a"] = [*shared, *pool.get_new_blocks(2)]
    before = list(manager.req_to_blocks["a"])
    assert pool.get_num_free_blocks() == 0
    assert reclaimer.copy_held("a", 40) is None
    assert manager.req_to_blocks["a"] == before and [b.ref_cnt for b in shared] == [2, 2]
