"""Block surgery on the scheduler side: which blocks a round gives back to vLLM's pool and which kept blocks it must
copy before the worker writes into them, done in vLLM's own block pool and block lists.

The twin of :class:`kvcompact.vllm.paged_kv.PagedKV`, both following the same :class:`~kvcompact.round.Round`:
here, before vLLM schedules, the block list shrinks to the blocks the kept tokens occupy (the tail goes back to the
pool at once) and a kept block the round may not write in place is swapped for a private copy
(:class:`~kvcompact.vllm.protocol.BlockCopy`); on the worker, at the very start of the step, the copies are filled,
the survivors move and the block tables shrink. When a block must be copied, and when a round waits instead:
docs/DESIGN.md, sections 2.1 and 2.5.
"""

from __future__ import annotations

from typing import Any

from kvcompact.ledger import blocks_held
from kvcompact.round import BlockCopy


class Reclaimer:
    """One engine's block surgery: its single KV-cache manager's block lists and its block pool."""

    def __init__(self, manager: Any, block_pool: Any, block_size: int) -> None:
        self.manager = manager
        self.block_pool = block_pool
        self.block_size = block_size

    def unwritable(self, blocks: list[Any]) -> list[int]:
        """Indices of the blocks a round may not write in place: held by another request too, or registered in
        the prefix cache."""
        return [i for i, block in enumerate(blocks) if not self.block_pool.is_block_writable(block)]

    def copy_held(self, request_id: str, kept_len: int) -> list[BlockCopy] | None:
        """Private copies of the kept blocks another request holds too; this request drops its reference to the
        shared ones (they stay with the others). None: too few free blocks (the round must wait)."""
        blocks, unwritable = self._kept(request_id, kept_len)
        held = [i for i in unwritable if blocks[i].ref_cnt > 1]
        if len(held) > self.block_pool.get_num_free_blocks():
            return None
        return self._replace(blocks, held)

    def copy_cached(self, request_id: str, kept_len: int, free: int) -> list[BlockCopy]:
        """The kept blocks only the prefix cache knows: the first ``free`` copied (the cache keeps them, and the
        cached block goes back to the free queue, so a copy costs the pool nothing), the rest unregistered and
        written in place, as vLLM evicts a cached block under pressure."""
        blocks, cached = self._kept(request_id, kept_len)
        for i in cached[free:]:
            self.block_pool._maybe_evict_cached_block(blocks[i])
        return self._replace(blocks, cached[:free])

    def free_tail(self, request_id: str, kept_len: int) -> int:
        """Give back the blocks past those ``kept_len`` occupy; returns how many."""
        blocks = self.manager.req_to_blocks[request_id]
        keep = blocks_held(kept_len, self.block_size)
        tail = blocks[keep:]
        del blocks[keep:]
        self.block_pool.free_blocks(reversed(tail))  # in reverse, so the most recently used is reused last
        return len(tail)

    def _kept(self, request_id: str, kept_len: int) -> tuple[list[Any], list[int]]:
        """The request's block list and the indices of the kept blocks it may not write in place."""
        blocks = self.manager.req_to_blocks[request_id]
        return blocks, self.unwritable(blocks[:blocks_held(kept_len, self.block_size)])

    def _replace(self, blocks: list[Any], indices: list[int]) -> list[BlockCopy]:
        """Put a new private block in place of each of ``blocks[indices]`` and drop this request's reference to
        the old one (another request's, or the prefix cache's, from then on)."""
        copies = []
        for i, block in zip(indices, self.block_pool.get_new_blocks(len(indices))):
            copies.append(BlockCopy(i, blocks[i].block_id, block.block_id))
            self.block_pool.free_blocks([blocks[i]])
            blocks[i] = block
        return copies


__all__ = ["Reclaimer"]
