"""The paged-KV adapter on vLLM's Model Runner V2 (``vllm/v1/worker/gpu/``): the same round reads and writes as
:class:`kvcompact.vllm.paged_kv.PagedKV`, through V2's structures. V2 keeps a request's block ids only in
``BlockTables``: per KV-cache group a device table indexed by the request's slot
(``req_states.req_id_to_index``), written through staged writes, and a count ``num_blocks`` (host numpy, copied to
the device when the staged writes apply). Positions, ``seq_lens`` and slot mappings are computed on the device
from ``num_computed_tokens``, the logical length; kvcompact rewrites the slot mappings and ``seq_lens`` after
vLLM computed them (docs/DESIGN.md, "Model Runner V2").
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch import Tensor

from kvcompact.ledger import blocks_held
from kvcompact.vllm.paged_kv import PagedKV, cache_positions, evicted_per_row


class PagedKVV2(PagedKV):
    """A round runs at the start of ``update_requests``, before vLLM appends the step's new blocks and zeroes
    them: the tables of the requests it compacts hold last step's entries, already applied to the device."""

    logical_seq_lens: Tensor | None = None  # the step's own ``seq_lens`` while attention reads the cache's

    def _slot(self, req_id: str) -> int:
        return self.runner.req_states.req_id_to_index[req_id]

    def holds(self, req_id: str) -> bool:
        return req_id in self.runner.req_states.req_id_to_index

    def block_table(self, req_id: str) -> Tensor:
        tables, slot = self.runner.block_tables, self._slot(req_id)
        return tables.block_tables[0].gpu[slot, : int(tables.num_blocks.np[0, slot])].to(torch.int64)

    def replace_block(self, req_id: str, index: int, block: int) -> None:
        """Written to the device table at once: the round reads it in this step, before any staged write
        applies (a staged write pending for this row would come from ``add_requests``, which a request that has
        a round never goes through in the same step)."""
        self.runner.block_tables.block_tables[0].gpu[self._slot(req_id), index] = block

    def truncate(self, req_id: str, num_tokens: int) -> None:
        """The count is the table's length: vLLM appends the step's new blocks after it, and copies it to the
        device with the staged writes (entries past it are never read)."""
        self.runner.block_tables.num_blocks.np[0, self._slot(req_id)] = blocks_held(num_tokens,
                                                                                   self.layout.block_size)

    def address_batch(self, input_batch: Any, evicted_by_request: dict[str, int]) -> Tensor | None:
        """After vLLM's ``prepare_attn`` computed the step's slot mappings from logical positions (RoPE stays
        logical): each compressed request's cache positions (position minus its eviction offset) give its slot
        mappings again, through vLLM's own ``compute_slot_mappings``, and the batch's ``seq_lens`` become a copy
        moved down by the eviction offsets, which the attention metadata is built from. The sampler reads ``seq_lens``
        too (a request whose ``seq_len`` is short of its prompt is still prefilling and samples nothing), so
        :meth:`logical_for_sampling` puts vLLM's back before it runs. The host upper bound (the metadata's
        ``max_seq_len``) stays logical: an upper bound still. None when no request of the batch is compressed."""
        n = input_batch.num_reqs
        evicted = evicted_per_row(input_batch.req_ids[:n], evicted_by_request)
        if not evicted.any():
            return None
        moved = cache_positions(input_batch.positions, evicted, np.diff(input_batch.query_start_loc_np[: n + 1]))
        cache_pos = input_batch.positions.clone()  # the padded rows as vLLM left them
        cache_pos[: moved.shape[0]] = moved
        self.logical_seq_lens = input_batch.seq_lens
        input_batch.seq_lens = input_batch.seq_lens.clone()
        seq_lens = input_batch.seq_lens
        seq_lens[:n] -= torch.from_numpy(evicted).to(seq_lens.device, seq_lens.dtype)
        return self.runner.block_tables.compute_slot_mappings(
            input_batch.idx_mapping, input_batch.query_start_loc, cache_pos,
            num_tokens_padded=input_batch.num_tokens_after_padding)

    def logical_for_sampling(self, input_batch: Any) -> None:
        """Before the step's sampling: the batch's ``seq_lens`` are vLLM's logical ones again."""
        if self.logical_seq_lens is not None:
            input_batch.seq_lens, self.logical_seq_lens = self.logical_seq_lens, None
