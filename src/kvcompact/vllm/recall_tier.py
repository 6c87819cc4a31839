"""The recall tier on one worker (docs/DESIGN.md, section 9): what a round evicts goes to the request's store
(:class:`kvcompact.recall.RecallStore`), and comes back slot for slot when a decode row's query attends to it.

Two decision points (``recall_at``). ``step``: after the forward, from the row's query in every layer
(:class:`kvcompact.vllm.capture.DecodeQueries` keeps it); the next token is the first to read what comes back.
``layer``: inside the forward, each layer from its own query just before its attention (:class:`LayerRecall`, a
capture feature that runs before the kernel, one decision per layer for every request of the forward); the token
whose query asked reads it. Both are swaps, never growth: the cache length, the block table and the step's
metadata stay as they are. A :class:`RecallPoint` is one request's decision at one row; :meth:`RecallTier.swap`
runs it for all layers at once, :meth:`RecallTier.plan_layer` for one layer of every point, and
:meth:`RecallTier.apply` carries out a plan.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch
from torch import Tensor

from kvcompact.config import KVCompactConfig
from kvcompact.moves import ascending_slots
from kvcompact.recall import (
    Recall,
    RecallStore,
    StackedDigests,
    SwapPlan,
    exact_cuts,
    plan_layer_exact,
    plan_layer_swaps,
    plan_swaps,
)
from kvcompact.selection import protected_slots
from kvcompact.vllm.paged_kv import PagedKV
from kvcompact.vllm.requests import WorkerRequest

logger = logging.getLogger("vllm.kvcompact")  # formatted and levelled by vLLM's own logging
Positions = Callable[[str, int, int], Tensor]  # (request, logical_len, cache_len) -> [L, H, cache_len] positions


@dataclass
class RecallPoint:
    """One request's recall decision at one decode row, with the request at ``logical_len`` tokens and its cache at
    ``positions.shape[-1]`` slots: the slots its query may swap out (``order`` [L, H, C], the eligible ones
    ascending, padded with ineligible ones where a row has fewer), and what the swaps did so far, layer by layer."""

    req_id: str
    state: WorkerRequest
    table: Tensor
    logical_len: int
    positions: Tensor  # [L, H, N] the slots' logical positions; swaps update it, then it is the request's tags
    order: Tensor      # [L, H, C] int64
    eligible: Tensor   # [L, H, C] bool
    # the swaps that recalled anything, per layer or step: (first layer, slots, positions swapped in, swapped)
    # [n, H, M]; a decision that swaps nothing leaves no entry (most decisions: the no-swap path costs no cut)
    done: list[tuple[int, Tensor, Tensor, Tensor]] = field(default_factory=list)


class RecallTier:
    """Store at a round (:meth:`store_evicted`), decide and swap at a row (:meth:`point`, :meth:`swap`), report and
    hand the recall to the listeners (:meth:`finish`)."""

    def __init__(self, config: KVCompactConfig, kv: PagedKV, positions: Positions) -> None:
        self.config, self.kv, self.positions = config, kv, positions
        self.listeners: list[Callable[[Recall], None]] = []  # e.g. tests replaying the recalls
        self.seconds = 0.0  # the points, decisions and swaps of the forwards since last taken (timed())

    @contextmanager
    def timed(self) -> Iterator[None]:
        """Add the block's wall time to :attr:`seconds` (``kvcompact:recall_seconds``)."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds += time.perf_counter() - start

    def store_evicted(self, state: WorkerRequest, block_table: Tensor, keep_mask: Tensor, positions: Tensor) -> int:
        """Before a round's moves: its evicted slots' K and V (every layer, every KV head, in slot order) and
        their positions go to the request's store. Returns the stored tokens dropped for good, over layers and
        KV heads (past ``recall_tokens``)."""
        L, H, N = keep_mask.shape
        evicted = N - int(keep_mask[0, 0].sum())
        if evicted <= 0:
            return 0
        slots = ascending_slots(~keep_mask)[..., :evicted]
        keys, values = self.kv.gather_kv(block_table, slots)
        at = positions.gather(-1, slots)
        if state.store is None:
            state.store = RecallStore(keys[:, :, :0], values[:, :, :0], at[:, :, :0], self.config.recall_dtype,
                                      digests=self.config.recall_search == "quest")
        return state.store.add(keys, values, at, self.config.recall_tokens) * L * H

    def due(self, req_id: str, state: WorkerRequest | None, logical_len: int) -> bool:
        """Whether a request's decode row at ``logical_len`` is a recall point: compressed (tags), something
        stored, still in vLLM, and every ``recall_interval`` tokens."""
        return (state is not None and state.tags is not None and state.store is not None and state.store.size > 0
                and self.kv.holds(req_id) and logical_len % self.config.recall_interval == 0)

    def point(self, req_id: str, state: WorkerRequest, logical_len: int, cache_len: int) -> RecallPoint | None:
        """The decision to make for a request at ``logical_len`` tokens over its first ``cache_len`` slots; None
        when no slot may give way (all protected)."""
        cfg, kv = self.config, self.kv
        positions = self.positions(req_id, logical_len, cache_len).clone()
        lengths = torch.tensor([logical_len, state.prompt_len], device=kv.device)
        eligible = ~protected_slots(positions, positions >= 0, lengths[:1], lengths[1:], cfg.window,
                                    cfg.protect_prompt, cfg.n_sink)
        # only the eligible slots are read and scored (a protected prompt is most of a long request's cache)
        count = int(eligible.sum(dim=-1).max())
        if not count:
            return None
        order = ascending_slots(eligible)[..., :count]
        return RecallPoint(req_id, state, kv.block_table(req_id), logical_len, positions, order,
                           eligible.gather(-1, order))

    def swap(self, p: RecallPoint, query: Tensor, first: int) -> None:
        """Swap in what ``query`` [n, H_q, d] (post-RoPE, float32: layers ``first .. first + n - 1``) attends to
        (:func:`kvcompact.recall.plan_swaps`), slot for slot, in those layers' caches, the store and
        ``p.positions``."""
        cfg, kv = self.config, self.kv
        store = p.state.store
        assert store is not None  # a point is made only for a request with a store
        layers = slice(first, first + query.shape[0])
        order = p.order[layers]
        plan = plan_swaps(query, store, kv.gather_slot_keys(p.table, order, first), p.eligible[layers],
                          cfg.recall_pages, cfg.selection == "per_head", cfg.recall_margin, cfg.recall_search)
        if bool(plan.swapped.any()):  # most plans swap nothing at recall_margin 0: one host check, no reads
            plan.slots = order.gather(-1, plan.slots)
            self.apply(p, plan, first)

    def apply(self, p: RecallPoint, plan: SwapPlan, first: int) -> None:
        """Carry out ``plan`` (its slots cache slots; it swaps something) in layers ``first ..`` of the cache, the
        store and ``p.positions``. Its callers skip the plans that swap nothing (most of them at ``recall_margin``
        0) before any read or write, with one host check, free on the CPU where the tier runs
        (``startup.check_recall``): :meth:`swap` per request, :class:`LayerRecall` once for a whole layer of
        requests inside the forward, where such a plan is not even cut out."""
        kv = self.kv
        store = p.state.store
        assert store is not None
        n = plan.slots.shape[0]
        if n != store.keys.shape[0]:
            store = store.layer(first)  # n == 1: one layer, inside the forward
        plan = plan.spanned(store.positions, self.config.recall_span)
        keys, values = kv.gather_kv(p.table, plan.slots, first)
        stored_keys, stored_values = store.read(plan.entries)
        mask = plan.swapped.unsqueeze(-1)
        kv.scatter_kv(p.table, plan.slots, torch.where(mask, stored_keys, keys),
                      torch.where(mask, stored_values, values), first)
        recalled = store.positions.gather(-1, plan.entries)
        positions = p.positions[first: first + n]
        out = positions.gather(-1, plan.slots)
        positions.scatter_(-1, plan.slots, torch.where(plan.swapped, recalled, out))
        store.swap(plan, keys, values, out)
        p.done.append((first, plan.slots, recalled, plan.swapped))

    def plan_layer(self, batch: _LayerBatch, queries: Tensor, index: int) -> SwapPlan:
        """Every point's plan in layer ``index`` from its row of ``queries`` [B, H_q, d], side by side, slots in
        cache slots (point i's: ``plan.cut(i, *batch.cuts[i])``)."""
        cfg = self.config
        kept_keys = self.kv.layer_keys(index, batch.phys[index])
        if batch.digests is None:
            plan = plan_layer_exact(queries, batch.stores, index, kept_keys, batch.eligible[index], cfg.recall_pages,
                                    cfg.recall_margin)
        else:
            plan = plan_layer_swaps(queries, batch.digests, batch.stores, index, kept_keys, batch.eligible[index],
                                    cfg.recall_pages, cfg.recall_margin)
        plan.slots = batch.order[index].gather(-1, plan.slots)
        return plan

    def finish(self, p: RecallPoint, in_forward: bool) -> int:
        """The point's swaps are all done: its positions become the request's tags and the listeners get the
        recall, over every layer (slot -1 and nothing swapped in the layers that swapped nothing). Returns the
        tokens swapped in, over layers and KV heads."""
        if not p.done:
            return 0  # nothing swapped: the positions are still the tags
        p.state.tags = p.positions
        count = sum(int(w.sum()) for _, _, _, w in p.done)
        if self.listeners:
            L, H = p.positions.shape[:2]
            M = max(s.shape[-1] for _, s, _, _ in p.done)
            slots = p.positions.new_full((L, H, M), -1)
            positions = p.positions.new_full((L, H, M), -1)
            swapped = torch.zeros(L, H, M, dtype=torch.bool, device=slots.device)
            for first, s, r, w in p.done:
                at = (slice(first, first + s.shape[0]), slice(None), slice(0, s.shape[-1]))
                slots[at], positions[at], swapped[at] = s, r, w
            for listener in self.listeners:
                listener(Recall(p.req_id, p.logical_len, slots, positions, swapped, in_forward=in_forward))
        return count


@dataclass
class _LayerBatch:
    """A forward's recall points (``recall_at`` layer) side by side, with what every layer's decision reads: each
    point's eligible slots [L, B, H, C] (padded with ineligible slot 0 past a point's width) and their physical
    slots, and the stores' digests stacked (:class:`kvcompact.recall.StackedDigests`; None under ``recall_search``
    exact, which reads the stores' keys)."""

    rows: Tensor              # [B] int64 row indices into the step's query
    points: list[RecallPoint]
    stores: list[RecallStore]  # the points' stores
    order: Tensor             # [L, B, H, C] int64
    eligible: Tensor          # [L, B, H, C] bool
    phys: Tensor              # [L, B, H, C] int64
    digests: StackedDigests | None
    cuts: list[tuple[int, int]]  # each point's slots and pages in a plan of the batch

    @classmethod
    def of(cls, kv: PagedKV, rows: list[int], points: list[RecallPoint], pages: int, search: str) -> _LayerBatch:
        width = max(p.order.shape[-1] for p in points)

        def padded(t: Tensor) -> Tensor:
            return torch.nn.functional.pad(t, (0, width - t.shape[-1]))

        stores: list[RecallStore] = [p.state.store for p in points]  # type: ignore[misc]  # a point has a store
        widths = [p.order.shape[-1] for p in points]
        digests = StackedDigests.of(stores) if search == "quest" else None
        return cls(torch.tensor(rows, dtype=torch.int64), points, stores,
                   torch.stack([padded(p.order) for p in points], dim=1),
                   torch.stack([padded(p.eligible) for p in points], dim=1),
                   torch.stack([padded(kv.physical(p.table, p.order)) for p in points], dim=1), digests,
                   exact_cuts(stores, pages, widths) if digests is None else digests.cuts(pages, widths))


class LayerRecall:
    """``recall_at`` layer, a capture feature whose work runs in each attention layer before the kernel: every
    decode row of a request with a store (and due, ``recall_interval``) swaps in what that layer's query attends
    to, so that the row's own attention reads it. One decision per layer covers every such row of the forward
    (:func:`kvcompact.recall.plan_layer_swaps`); only the requests it swaps anything for are then written one by
    one. A point whose work fails mid-forward is dropped and named in :attr:`failed` (its layers disagree with its
    tags: the worker ends the request)."""

    def __init__(self, tier: RecallTier, requests: dict[str, WorkerRequest]) -> None:
        self.tier, self.requests = tier, requests
        self.points: list[RecallPoint] = []  # this forward's
        self.failed: dict[str, str] = {}     # request -> why, this forward's

    def begin_forward(self, segments: list[Any]) -> Callable[[int, Tensor], None] | None:
        with self.tier.timed():
            rows: list[int] = []
            self.points, self.failed = [], {}
            for s in segments:
                state = self.requests.get(s.req_id)
                if s.count != 1 or state is None or not self.tier.due(s.req_id, state, s.logical_len):
                    continue
                point = self.tier.point(s.req_id, state, s.logical_len, s.cache_start)
                if point is not None:
                    rows.append(s.first)
                    self.points.append(point)
            cfg = self.tier.config
            return (partial(self._on_layer, _LayerBatch.of(self.tier.kv, rows, self.points, cfg.recall_pages,
                                                           cfg.recall_search)) if rows else None)

    def _on_layer(self, batch: _LayerBatch, index: int, q: Tensor) -> None:
        with self.tier.timed():
            try:
                queries = q.index_select(0, batch.rows.to(q.device)).float()  # [B, H_q, d]
                plan = self.tier.plan_layer(batch, queries, index)
                swaps = plan.swapped.flatten(1).any(dim=1).tolist()
            except Exception as e:  # noqa: BLE001 - a bug in the recall must not stop the forward
                logger.exception("kvcompact: recall failed in layer %d", index)
                for point in batch.points:
                    self.failed.setdefault(point.req_id, f"recall failed in layer {index}: {type(e).__name__}: {e}")
                swaps = []
            for i, (point, any_swap) in enumerate(zip(batch.points, swaps)):
                if not any_swap or point.req_id in self.failed:
                    continue
                try:
                    self.tier.apply(point, plan.cut(i, *batch.cuts[i]), index)
                except Exception as e:  # noqa: BLE001 - a bug in one request's recall must not stop the forward
                    logger.exception("kvcompact: recall failed for request %s in layer %d", point.req_id, index)
                    self.failed[point.req_id] = f"recall failed in layer {index}: {type(e).__name__}: {e}"

    def end_forward(self) -> tuple[int, dict[str, str]]:
        """After the forward: the tokens swapped in, and the requests whose recall failed (their tags forgotten)."""
        with self.tier.timed():
            count = 0
            for point in self.points:
                if point.req_id in self.failed:
                    point.state.tags = None
                else:
                    count += self.tier.finish(point, in_forward=True)
            failed, self.points, self.failed = self.failed, [], {}
            return count, failed


__all__ = ["LayerRecall", "RecallPoint", "RecallTier"]
