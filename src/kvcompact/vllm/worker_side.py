"""Worker side: a round's lifecycle on one worker. Pick the survivors in this worker's KV heads and layers, move
them inside the request's own blocks through the paged-KV adapter (:class:`kvcompact.vllm.paged_kv.PagedKV`),
keep each request's position tags, and report back (a :class:`~kvcompact.vllm.protocol.WorkerReport`).

Runs in every worker process at the very start of a step (before vLLM removes finished requests or zeroes
newly allocated blocks), because the scheduler may already have handed this request's freed tail blocks to
another request in the same step (docs/DESIGN.md, section 2.1). The position tags, kept on each request's
:class:`~kvcompact.vllm.requests.WorkerRequest`: section 2.3. vLLM reaches this class through the worker's hooks
(:mod:`kvcompact.vllm.hooks.worker`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import numpy as np
import torch

from kvcompact.config import KVCompactConfig
from kvcompact.moves import apply_plan
from kvcompact.policies.base import Policy
from kvcompact.recall import Recall
from kvcompact.round import Round, RoundBatch, RoundCore
from kvcompact.vllm.capture import make_capture
from kvcompact.vllm.paged_kv import PagedKV
from kvcompact.vllm.protocol import MESSAGE_ATTR, StepMessage, WorkerReport
from kvcompact.vllm.recall_tier import LayerRecall, RecallTier
from kvcompact.vllm.requests import WorkerRequest

logger = logging.getLogger("vllm.kvcompact")  # formatted and levelled by vLLM's own logging


class WorkerSide:
    def __init__(self, config: KVCompactConfig, kv: PagedKV, num_q_heads: int, policy: Policy) -> None:
        self.config = config
        self.kv = kv
        self.core = RoundCore(config, policy, num_q_heads)
        # One per request this worker knows: made at its first round or first captured forward, dropped when it
        # finishes, leaves vLLM, or is no longer compressed (start_step).
        self.requests: dict[str, WorkerRequest] = {}
        self.message = StepMessage()                  # this step's, from the scheduler (the eviction offsets)
        # This step's eviction offset per batch row, for a draft model's slot mappings (None: no row compressed,
        # or no draft model).
        self.draft_evicted: torch.Tensor | None = None
        self.round_listeners: list[Callable[[Round], None]] = []  # e.g. tests replaying the keep sets
        self.recall_tier = RecallTier(config, kv, self._positions)
        self.recall_listeners: list[Callable[[Recall], None]] = self.recall_tier.listeners  # ... and the recalls
        self.layer_recall = (LayerRecall(self.recall_tier, self.requests)
                             if config.recall_tokens and config.recall_at == "layer" else None)
        self.store_bytes = 0  # the recall stores' bytes as last reported
        self.report = WorkerReport()
        # Query windows / decode attention for the policies that need them, the recall tier's queries (None: no
        # hook installed).
        self.capture = make_capture(policy, config, kv, num_q_heads, self.requests, self.layer_recall)
        # Under TP/PP (set by startup): ``(moved, flags) -> (moved, flags)`` summed over all ranks, so the one
        # worker whose report reaches the scheduler reports the moves of every layer and KV head, as a single
        # process would, and every request that failed on any rank.
        self.sum_over_ranks: Any = None

    # -- one engine step, in the order vLLM runs it: start_step, address_inputs, take_report -----------------
    def start_step(self, scheduler_output: Any) -> None:
        """The step's first call (before vLLM touches any block): drop the requests the message no longer names,
        then run its rounds."""
        # A fresh report each step: a worker whose output never reaches the scheduler (a pipeline stage before
        # the last) must not accumulate reports nobody takes.
        self.report = WorkerReport()
        self.message = getattr(scheduler_output, MESSAGE_ATTR, None) or StepMessage()
        round_ids = {r.req_id for r in self.message.rounds}
        if self.capture is not None:
            self.capture.begin_step(scheduler_output.finished_req_ids)
        for req_id in [r for r, state in self.requests.items()
                       if state.tags is not None and r not in self.message.evicted and r not in round_ids]:
            del self.requests[req_id]  # compressed before, not now: finished, preempted or reset, its cache is gone
        if self.message.rounds:
            self._execute_isolated(self.message.rounds)
            if self.sum_over_ranks is not None:  # once per such step on every rank, whatever failed
                self._combine_over_ranks(self.message.rounds)

    def _combine_over_ranks(self, rounds: list[Round]) -> None:
        """Under TP/PP: this step's moves summed over every rank's layers and KV heads, and the failures of
        every rank (a collective: every worker calls it once in each step that has rounds, so the calls match).
        A request whose round failed on another rank ends in an error here too: only one rank's report reaches
        the scheduler, and a request half compacted on any rank must not go on."""
        report = self.report
        flags = ([int(r.req_id in report.aborted) for r in rounds]
                 + [int(r.req_id in report.scoring_fallbacks) for r in rounds])
        moved, flags = self.sum_over_ranks(report.tokens_moved, flags)
        report.bytes_moved += (moved - report.tokens_moved) * self.kv.bytes_per_token
        report.tokens_moved = moved
        n = len(rounds)
        for r, aborted, failed in zip(rounds, flags[:n], flags[n:]):
            if aborted and r.req_id not in report.aborted:
                self._forget_tags(r.req_id)
                report.aborted[r.req_id] = "compaction failed on another tensor/pipeline-parallel rank"
            if failed and r.req_id not in report.scoring_fallbacks:
                report.scoring_fallbacks[r.req_id] = "scoring failed on another tensor/pipeline-parallel rank"

    def take_report(self) -> WorkerReport | None:
        held = sum(state.store.nbytes for state in self.requests.values() if state.store is not None)
        if held != self.store_bytes:
            self.report.store_bytes = self.store_bytes = held
        report = self.report
        if not (report.rounds or report.scoring_fallbacks or report.aborted or report.recalled_tokens
                or report.store_bytes is not None):
            return None
        self.report = WorkerReport()
        return report

    # -- one round for a batch of requests ---------------------------------------------------------------
    def _forget_tags(self, req_id: str) -> None:
        """A failed round: the request's slots no longer match its tags (it ends in an error)."""
        state = self.requests.get(req_id)
        if state is not None:
            state.tags = None

    def _positions(self, req_id: str, logical_len: int, cache_len: int) -> torch.Tensor:
        """The logical position each of the request's ``cache_len`` slots holds, per (layer, KV head)."""
        state = self.requests.get(req_id) or WorkerRequest()
        return state.positions(logical_len, cache_len, len(self.kv.caches), self.kv.layout.num_kv_heads,
                               self.kv.device)

    def _execute_isolated(self, rounds: list[Round], copy: bool = True) -> None:
        """Run a batch of rounds; an exception fails only the request(s) it comes from, never the engine.

        Until the first write (``self._writing``) nothing has changed, so the batch is retried one request at a
        time to find the culprit. A failure while writing fails every request of the batch: their caches may be
        half moved. A failed request keeps the block table the scheduler already shrank (its freed tail may
        belong to another request by now), so this step's forward pass stays inside its own blocks; the
        scheduler finishes it with an error before reading its output (``WorkerReport.aborted``).

        The step's copies on write all run first, once (a retry does not copy again): a block one round copies
        from may be written in place by another round of the step, whose last other holder it was.
        """
        self._writing = False
        try:
            self._execute(rounds, copy)
            return
        except Exception as e:  # noqa: BLE001 - any bug in a round must stay inside the request
            if self._writing or len(rounds) == 1:
                logger.exception("kvcompact: compaction failed for request(s) %s", [r.req_id for r in rounds])
                for r in rounds:
                    self._forget_tags(r.req_id)
                    if self.kv.holds(r.req_id):
                        self.kv.truncate(r.req_id, r.kept_len)
                    self.report.aborted[r.req_id] = f"compaction failed: {type(e).__name__}: {e}"
                return
        for r in rounds:
            self._execute_isolated([r], copy=False)

    def _execute(self, rounds: list[Round], copy: bool) -> None:
        """(copy on write ->) gather -> round core -> execute moves, for the whole batch."""
        start = time.perf_counter()
        kv = self.kv
        L, H = len(kv.caches), kv.layout.num_kv_heads
        if copy:
            self._writing = True  # a copy that fails half done fails the batch (block tables half switched)
            kv.copy_on_write([(r.req_id, entry) for r in rounds for entry in r.copies])
            self._writing = False
        block_tables = [kv.block_table(r.req_id) for r in rounds]
        cache_lens = [r.cache_len for r in rounds]
        keys = kv.gather_keys(block_tables, cache_lens)
        device = kv.device  # the whole round runs where the cache is
        positions = torch.full((len(rounds), L, H, max(cache_lens)), -1, dtype=torch.int64, device=device)
        for b, r in enumerate(rounds):
            positions[b, :, :, : r.cache_len] = self._positions(r.req_id, r.logical_len, r.cache_len)
        ids = [r.req_id for r in rounds]
        queries = attn_accum = None
        try:
            if self.capture is not None and self.core.policy.needs_queries:
                queries = self.capture.queries_for(ids, [r.logical_len for r in rounds])
            if self.capture is not None and self.core.policy.needs_attn_accum:
                attn_accum = self.capture.accum_for(ids, cache_lens, max(cache_lens))
        except RuntimeError as e:  # the capture cannot serve these requests: score each alone (falls back)
            if len(rounds) > 1:
                raise
            self.report.scoring_fallbacks[rounds[0].req_id] = f"{type(e).__name__}: {e}"
            queries = attn_accum = None
        out = self.core.run(RoundBatch(
            keys=keys, positions=positions, logical_len=torch.tensor([r.logical_len for r in rounds], device=device),
            kept_len=torch.tensor([r.kept_len for r in rounds], device=device),
            prompt_len=torch.tensor([r.prompt_len for r in rounds], device=device), cache_lens=cache_lens,
            queries=queries, attn_accum=attn_accum))
        for b, why in out.scoring_fallbacks.items():
            self.report.scoring_fallbacks.setdefault(rounds[b].req_id, why)
        self._writing = True  # from here on state and caches change (see _execute_isolated)
        for b, r in enumerate(rounds):
            plan = out.plans[b]
            state = self.requests.setdefault(r.req_id, WorkerRequest())
            if self.config.recall_tokens:
                self.report.store_dropped += self.recall_tier.store_evicted(
                    state, block_tables[b], out.keep_mask[b, :, :, : r.cache_len], positions[b, :, :, : r.cache_len])
            state.tags = apply_plan(positions[b, :, :, : r.cache_len], plan)
            state.prompt_len = r.prompt_len
            if self.capture is not None:
                self.capture.apply_plan(r.req_id, plan, r.cache_len)
            kv.truncate(r.req_id, r.kept_len)
            for listener in self.round_listeners:
                listener(replace(r, keep_mask=out.keep_mask[b, :, :, : r.cache_len],
                                 positions=positions[b, :, :, : r.cache_len]))
        kv.execute(block_tables, out.plans)  # the tables as they were: moves address the request's own blocks
        moved, nbytes = kv.moved(out.plans)
        report = self.report
        report.rounds += len(rounds)
        report.tokens_moved += moved
        report.bytes_moved += nbytes
        report.compaction_seconds.append(time.perf_counter() - start)
        report.scoring_seconds.append(out.scoring_seconds)

    # -- the recall tier (kvcompact.vllm.recall_tier): evicted tokens to the store at a round, back at a decode row
    def recall(self) -> None:
        """After a forward. ``recall_at`` step: each request whose decode row this forward computed, that has a
        store and is due (``recall_interval``), swaps in what that row's query attends to, for the next step.
        ``recall_at`` layer: the forward's layers already did; count it, and end any request whose recall failed
        half way."""
        if self.capture is None or not self.config.recall_tokens:
            return
        if self.layer_recall is not None:
            count, failed = self.layer_recall.end_forward()
            for req_id, why in failed.items():
                self.report.aborted.setdefault(req_id, why)
            self.report.recalled_tokens += count
        else:
            with self.recall_tier.timed():
                for req_id in self.capture.last.req_ids:
                    state = self.requests.get(req_id)
                    if (state is None or state.query is None or state.decoded_to is None
                            or req_id in self.report.aborted
                            or not self.recall_tier.due(req_id, state, state.decoded_to[0])):
                        continue
                    point = self.recall_tier.point(req_id, state, *state.decoded_to)
                    if point is not None:
                        self.recall_tier.swap(point, state.query, 0)
                        self.report.recalled_tokens += self.recall_tier.finish(point, in_forward=False)
        self.report.recall_seconds += self.recall_tier.seconds
        self.recall_tier.seconds = 0.0

    # -- input preparation: positions logical, cache addressing physical -----------------------------------
    def address_inputs(self, scheduler_output: Any, num_scheduled_tokens: np.ndarray) -> None:
        """After vLLM prepared the step's inputs: compressed requests' ``seq_lens`` and slots follow the cache."""
        if self.capture is not None:
            self.capture.begin_forward(num_scheduled_tokens, self.message.evicted)
        self.draft_evicted = None
        if not self.message.evicted:
            return
        evicted = self.kv.evicted_rows(self.message.evicted)
        if evicted.any():
            self.kv.address_cache(scheduler_output, num_scheduled_tokens, evicted)
            if self.kv.draft is not None:
                self.draft_evicted = torch.from_numpy(evicted).to(self.kv.device)

    def address_draft(self, attn_metadata: Any, positions: torch.Tensor) -> None:
        """A draft model's pass of this step (the first, over the target's tokens, or one of the next k - 1):
        its slots follow the cache as the target's do (:meth:`PagedKV.address_draft`); ``seq_lens`` and the
        block table it reads are the target's, already remapped."""
        if self.draft_evicted is not None:
            self.kv.address_draft(attn_metadata, positions, self.draft_evicted)
