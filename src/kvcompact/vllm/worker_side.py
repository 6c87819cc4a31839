"""Worker side: a round's lifecycle on one worker. Pick the survivors in this worker's KV heads and layers, move
them inside the request's own blocks through the paged-KV adapter (:class:`kvcompact.vllm.paged_kv.PagedKV`),
keep each request's position tags, and report back.

Runs in every worker process at the very start of a step (before vLLM removes finished requests or zeroes
newly allocated blocks), because the scheduler may already have handed this request's freed tail blocks to
another request in the same step (docs/DESIGN.md, "Invariants").

Per-slot position tags: after a round, slot ``s`` of (layer, KV head) may hold any token, so each request keeps
an int64 tag per (layer, head, slot) below the length of its last round; slots past it hold positions
``s + evicted`` by construction (tokens are appended in order).

vLLM reaches this class through the worker's hooks (:mod:`kvcompact.vllm.hooks.worker`), one adapter per row
of the plugin's hook table.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from kvcompact.config import KVCompactConfig
from kvcompact.moves import apply_plan
from kvcompact.policies.base import Policy
from kvcompact.round import RoundCore, RoundInput, RoundRecord
from kvcompact.vllm.capture import make_capture
from kvcompact.vllm.paged_kv import PagedKV
from kvcompact.vllm.protocol import PLAN_ATTR, RoundCommand, StepPlan, WorkerReport

logger = logging.getLogger("vllm.kvcompact")  # formatted and levelled by vLLM's own logging


class WorkerSide:
    def __init__(self, config: KVCompactConfig, kv: PagedKV, num_q_heads: int, policy: Policy) -> None:
        self.config = config
        self.kv = kv
        self.core = RoundCore(config, policy, num_q_heads)
        self.tags: dict[str, torch.Tensor] = {}  # [L, H, K] int64 positions of slots 0..K-1 after the last round
        self.plan = StepPlan()                    # this step's, from the scheduler (the eviction offsets)
        # This step's eviction offset per batch row, for a draft model's slot mappings (None: no row compressed,
        # or no draft model).
        self.draft_offsets: torch.Tensor | None = None
        self.round_listeners: list[Callable[[RoundRecord], None]] = []  # e.g. tests replaying the keep sets
        self.report = WorkerReport()
        # Query windows / decode attention for the policies that need them (None: no hook installed).
        self.capture = make_capture(policy, config, kv, num_q_heads)
        # Under TP/PP (set by startup): ``(moved, flags) -> (moved, flags)`` summed over all ranks, so the one
        # worker whose report reaches the scheduler reports the moves of every layer and KV head, as a single
        # process would, and every request that failed on any rank.
        self.sum_over_ranks: Any = None

    # -- step start ------------------------------------------------------------------------------------
    def execute_rounds(self, scheduler_output: Any) -> None:
        # A fresh report each step: a worker whose output never reaches the scheduler (a pipeline stage before
        # the last) must not accumulate reports nobody takes.
        self.report = WorkerReport()
        self.plan = getattr(scheduler_output, PLAN_ATTR, None) or StepPlan()
        round_ids = {c.req_id for c in self.plan.rounds}
        if self.capture is not None:
            self.capture.begin_step(scheduler_output.finished_req_ids)
        for req_id in [r for r in self.tags if r not in self.plan.evicted and r not in round_ids]:
            del self.tags[req_id]  # finished, preempted or reset: its cache is gone
            if self.capture is not None:
                self.capture.drop(req_id)
        if self.plan.rounds:
            self._execute_isolated(self.plan.rounds)
            if self.sum_over_ranks is not None:  # once per such step on every rank, whatever failed
                self._combine_over_ranks(self.plan.rounds)

    def _combine_over_ranks(self, commands: list[RoundCommand]) -> None:
        """Under TP/PP: this step's moves summed over every rank's layers and KV heads, and the failures of
        every rank (a collective: every worker calls it once in each step that has rounds, so the calls match).
        A request whose round failed on another rank ends in an error here too: only one rank's report reaches
        the scheduler, and a request half compacted on any rank must not go on."""
        r = self.report
        flags = ([int(c.req_id in r.aborted) for c in commands]
                 + [int(c.req_id in r.scoring_fallbacks) for c in commands])
        moved, flags = self.sum_over_ranks(r.tokens_moved, flags)
        r.bytes_moved += (moved - r.tokens_moved) * self.kv.bytes_per_token
        r.tokens_moved = moved
        n = len(commands)
        for cmd, aborted, failed in zip(commands, flags[:n], flags[n:]):
            if aborted and cmd.req_id not in r.aborted:
                self.tags.pop(cmd.req_id, None)
                r.aborted[cmd.req_id] = "compaction failed on another tensor/pipeline-parallel rank"
            if failed and cmd.req_id not in r.scoring_fallbacks:
                r.scoring_fallbacks[cmd.req_id] = "scoring failed on another tensor/pipeline-parallel rank"

    def take_report(self) -> WorkerReport | None:
        if not self.report.rounds and not self.report.scoring_fallbacks and not self.report.aborted:
            return None
        report, self.report = self.report, WorkerReport()
        return report

    # -- one round for a batch of requests ---------------------------------------------------------------
    def _positions(self, cmd: RoundCommand, num_layers: int, num_heads: int) -> torch.Tensor:
        tags = self.tags.get(cmd.req_id)
        tagged = 0 if tags is None else tags.shape[-1]
        tail = torch.arange(tagged, cmd.old_len, dtype=torch.int64, device=self.kv.device) + cmd.evicted_before
        tail = tail.expand(num_layers, num_heads, -1)
        return tail if tags is None else torch.cat([tags, tail], dim=-1)

    def _execute_isolated(self, commands: list[RoundCommand], copy: bool = True) -> None:
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
            self._execute(commands, copy)
            return
        except Exception as e:  # noqa: BLE001 - any bug in a round must stay inside the request
            if self._writing or len(commands) == 1:
                logger.exception("kvcompact: compaction failed for request(s) %s", [c.req_id for c in commands])
                for cmd in commands:
                    self.tags.pop(cmd.req_id, None)
                    if self.kv.holds(cmd.req_id):
                        self.kv.truncate(cmd.req_id, cmd.new_len)
                    self.report.aborted[cmd.req_id] = f"compaction failed: {type(e).__name__}: {e}"
                return
        for cmd in commands:
            self._execute_isolated([cmd], copy=False)

    def _execute(self, commands: list[RoundCommand], copy: bool) -> None:
        """(copy on write ->) gather -> round core -> execute moves, for the whole batch."""
        start = time.perf_counter()
        kv = self.kv
        L, H = len(kv.caches), kv.layout.num_kv_heads
        if copy:
            self._writing = True  # a copy that fails half done fails the batch (block tables half switched)
            kv.copy_on_write([(c.req_id, entry) for c in commands for entry in c.copies])
            self._writing = False
        block_tables = [kv.block_table(c.req_id) for c in commands]
        lengths = [c.old_len for c in commands]
        keys = kv.gather_keys(block_tables, lengths)
        device = kv.device  # the whole round runs where the cache is
        positions = torch.full((len(commands), L, H, max(lengths)), -1, dtype=torch.int64, device=device)
        for b, cmd in enumerate(commands):
            positions[b, :, :, : cmd.old_len] = self._positions(cmd, L, H)
        ids = [c.req_id for c in commands]
        queries = attn_accum = None
        try:
            if self.capture is not None and self.core.policy.needs_queries:
                queries = self.capture.queries_for(ids, [c.logical_len for c in commands])
            if self.capture is not None and self.core.policy.needs_attn_accum:
                attn_accum = self.capture.accum_for(ids, lengths, max(lengths))
        except RuntimeError as e:  # the capture cannot serve these requests: score each alone (falls back)
            if len(commands) > 1:
                raise
            self.report.scoring_fallbacks[commands[0].req_id] = f"{type(e).__name__}: {e}"
            queries = attn_accum = None
        out = self.core.run(RoundInput(
            keys=keys, positions=positions, t=torch.tensor([c.logical_len for c in commands], device=device),
            new_len=torch.tensor([c.new_len for c in commands], device=device),
            prompt_len=torch.tensor([c.prompt_len for c in commands], device=device), lengths=lengths, queries=queries,
            attn_accum=attn_accum))
        for b, why in out.scoring_fallbacks.items():
            self.report.scoring_fallbacks.setdefault(commands[b].req_id, why)
        self._writing = True  # from here on state and caches change (see _execute_isolated)
        for b, cmd in enumerate(commands):
            plan = out.plans[b]
            self.tags[cmd.req_id] = apply_plan(positions[b, :, :, : cmd.old_len], plan)
            if self.capture is not None:
                self.capture.apply_plan(cmd.req_id, plan, cmd.old_len)
            kv.truncate(cmd.req_id, cmd.new_len)
            for listener in self.round_listeners:
                listener(RoundRecord(cmd.req_id, cmd.logical_len, cmd.old_len, cmd.new_len,
                                     keep=out.keep[b, :, :, : cmd.old_len],
                                     positions=positions[b, :, :, : cmd.old_len]))
        kv.execute(block_tables, out.plans)  # the tables as they were: moves address the request's own blocks
        moved, nbytes = kv.moved(out.plans)
        r = self.report
        r.rounds += len(commands)
        r.tokens_moved += moved
        r.bytes_moved += nbytes
        r.compaction_seconds.append(time.perf_counter() - start)
        r.scoring_seconds.append(out.scoring_seconds)

    # -- input preparation: positions logical, cache addressing physical -----------------------------------
    def remap_inputs(self, scheduler_output: Any, num_scheduled_tokens: np.ndarray) -> None:
        if self.capture is not None:
            self.capture.begin_forward(num_scheduled_tokens, self.plan.evicted)
        self.draft_offsets = None
        if not self.plan.evicted:
            return
        deltas = self.kv.row_offsets(self.plan.evicted)
        if deltas.any():
            self.kv.address_cache(scheduler_output, num_scheduled_tokens, deltas)
            if self.kv.draft is not None:
                self.draft_offsets = torch.from_numpy(deltas).to(self.kv.device)

    def address_draft(self, attn_metadata: Any, positions: torch.Tensor) -> None:
        """A draft model's pass of this step (the first, over the target's tokens, or one of the next k - 1):
        its slots follow the cache as the target's do (:meth:`PagedKV.address_draft`); ``seq_lens`` and the
        block table it reads are the target's, already remapped."""
        if self.draft_offsets is not None:
            self.kv.address_draft(attn_metadata, positions, self.draft_offsets)
