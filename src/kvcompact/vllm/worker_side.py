"""Worker side: pick the survivors in this worker's KV heads and layers and move them inside the request's
own blocks, then keep RoPE positions logical while ``seq_lens`` and the slot mapping follow the cache.

Runs in every worker process at the very start of a step (before vLLM removes finished requests or zeroes
newly allocated blocks), because the scheduler may already have handed this request's freed tail blocks to
another request in the same step.

Per-slot position tags: after a round, slot ``s`` of (layer, KV head) may hold any token, so each request keeps
an int64 tag per (layer, head, slot) below the length of its last round; slots past it hold positions
``s + evicted`` by construction (tokens are appended in order).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from kvcompact.compaction import RoundCore, RoundInput
from kvcompact.config import KVCompactConfig
from kvcompact.layouts import KVLayout, move_layers, phys_slots
from kvcompact.planner import apply_plan, blocks_held
from kvcompact.policies.base import Policy
from kvcompact.vllm.capture import make_capture
from kvcompact.vllm.protocol import PLAN_ATTR, RoundCommand, StepPlan, WorkerReport

logger = logging.getLogger("vllm.kvcompact")  # formatted and levelled by vLLM's own logging


@dataclass
class Tags:
    positions: torch.Tensor  # [L, H, K] int64 positions of slots 0..K-1
    evicted: int             # slots >= K hold position s + evicted


@dataclass
class RoundLog:
    """The keep set of one round, handed to ``WorkerSide.round_listeners``: lets a reference replay exactly
    what the engine did."""

    req_id: str
    logical_len: int
    old_len: int
    new_len: int
    keep: torch.Tensor  # [L, H, old_len] bool


class WorkerSide:
    def __init__(self, config: KVCompactConfig, runner: Any, layout: KVLayout, num_q_heads: int,
                 policy: Policy, key_reader: Callable[[int, torch.Tensor], torch.Tensor]) -> None:
        self.config = config
        self.runner = runner
        self.layout = layout
        self.core = RoundCore(config, policy, num_q_heads)
        # (local layer, raw keys as stored) -> float32 keys (layouts.make_key_reader: fp8 dequantized)
        self.key_reader = key_reader
        self.tags: dict[str, Tags] = {}
        self.evicted: dict[str, int] = {}
        self.round_listeners: list[Callable[[RoundLog], None]] = []  # e.g. tests replaying the keep sets
        self.report = WorkerReport()
        # Query windows / decode attention for the policies that need them (None: no hook installed).
        self.capture = make_capture(policy, config, runner, layout, num_q_heads, self.key_reader)
        # Under TP/PP (set by startup): ``(moved, flags) -> (moved, flags)`` summed over all ranks, so the one
        # worker whose report reaches the scheduler reports the moves of every layer and KV head, as a single
        # process would, and every request that failed on any rank.
        self.sum_over_ranks: Any = None

    @property
    def kv_caches(self) -> list[torch.Tensor]:
        return self.runner.kv_caches

    # -- step start ------------------------------------------------------------------------------------
    def begin_step(self, scheduler_output: Any) -> None:
        # A fresh report each step: a worker whose output never reaches the scheduler (a pipeline stage before
        # the last) must not accumulate reports nobody takes.
        self.report = WorkerReport()
        plan: StepPlan | None = getattr(scheduler_output, PLAN_ATTR, None)
        self.evicted = dict(plan.evicted) if plan is not None else {}
        round_ids = {c.req_id for c in plan.rounds} if plan is not None else set()
        if self.capture is not None:
            self.capture.begin_step(getattr(scheduler_output, "finished_req_ids", ()))
        for req_id in [r for r in self.tags if r not in self.evicted and r not in round_ids]:
            del self.tags[req_id]  # finished, preempted or reset: its cache is gone
            if self.capture is not None:
                self.capture.drop(req_id)
        if plan is not None and plan.rounds:
            self._run_rounds_isolated(plan.rounds)
            if self.sum_over_ranks is not None:  # once per such step on every rank, whatever failed
                self._combine_over_ranks(plan.rounds)

    def _combine_over_ranks(self, commands: list[RoundCommand]) -> None:
        """Under TP/PP: this step's moves summed over every rank's layers and KV heads, and the failures of
        every rank (a collective: every worker calls it once in each step that has rounds, so the calls match).
        A request whose round failed on another rank ends in an error here too: only one rank's report reaches
        the scheduler, and a request half compacted on any rank must not go on."""
        r = self.report
        flags = [int(c.req_id in r.aborted) for c in commands] + [int(c.req_id in r.failed) for c in commands]
        moved, flags = self.sum_over_ranks(r.tokens_moved, flags)
        r.bytes_moved += (moved - r.tokens_moved) * 2 * self.layout.head_dim * self.kv_caches[0].element_size()
        r.tokens_moved = moved
        n = len(commands)
        for cmd, aborted, failed in zip(commands, flags[:n], flags[n:]):
            if aborted and cmd.req_id not in r.aborted:
                self.tags.pop(cmd.req_id, None)
                r.aborted[cmd.req_id] = "compaction failed on another tensor/pipeline-parallel rank"
            if failed and cmd.req_id not in r.failed:
                r.failed[cmd.req_id] = "scoring failed on another tensor/pipeline-parallel rank"

    def take_report(self) -> WorkerReport | None:
        if not self.report.rounds and not self.report.failed and not self.report.aborted:
            return None
        report, self.report = self.report, WorkerReport()
        return report

    # -- one round for a batch of requests ---------------------------------------------------------------
    def _positions(self, cmd: RoundCommand, num_layers: int, num_heads: int) -> torch.Tensor:
        tags = self.tags.get(cmd.req_id)
        tagged = 0 if tags is None else tags.positions.shape[-1]
        if tags is not None and tags.evicted != cmd.evicted_before:
            raise RuntimeError(f"kvcompact: request {cmd.req_id} position tags are stale "
                               f"(worker evicted {tags.evicted}, scheduler {cmd.evicted_before})")
        tail = torch.arange(tagged, cmd.old_len, dtype=torch.int64) + cmd.evicted_before
        tail = tail.expand(num_layers, num_heads, -1)
        return tail if tags is None else torch.cat([tags.positions, tail], dim=-1)

    def _run_rounds_isolated(self, commands: list[RoundCommand]) -> None:
        """Run a batch of rounds; an exception fails only the request(s) it comes from, never the engine.

        Until the first write (``self._writing``) nothing has changed, so the batch is retried one request at a
        time to find the culprit. A failure while writing fails every request of the batch: their caches may be
        half moved. A failed request keeps the block table the scheduler already shrank (its freed tail may
        belong to another request by now), so this step's forward pass stays inside its own blocks; the
        scheduler finishes it with an error before reading its output (``WorkerReport.aborted``).
        """
        self._writing = False
        try:
            self._run_rounds(commands)
            return
        except Exception as e:  # noqa: BLE001 - any bug in a round must stay inside the request
            if self._writing or len(commands) == 1:
                logger.exception("kvcompact: compaction failed for request(s) %s", [c.req_id for c in commands])
                for cmd in commands:
                    self.tags.pop(cmd.req_id, None)
                    if cmd.req_id in self.runner.requests:
                        self._truncate_block_table(cmd.req_id, blocks_held(cmd.new_len, self.layout.block_size))
                    self.report.aborted[cmd.req_id] = f"compaction failed: {type(e).__name__}: {e}"
                return
        for cmd in commands:
            self._run_rounds_isolated([cmd])

    def _run_rounds(self, commands: list[RoundCommand]) -> None:
        start = time.perf_counter()
        caches = self.kv_caches
        L, H = len(caches), self.layout.num_kv_heads
        self._copy_on_write(commands)
        block_tables = [torch.as_tensor(self.runner.requests[c.req_id].block_ids[0], dtype=torch.int64)
                        for c in commands]
        lengths = [c.old_len for c in commands]
        n_max = max(lengths)
        # Gather the keys of every commanded request, one indexed read per layer.
        phys = torch.cat([phys_slots(bt, torch.arange(n), self.layout.block_size)
                          for bt, n in zip(block_tables, lengths)])
        keys = torch.zeros(len(commands), L, H, n_max, self.layout.head_dim, dtype=torch.float32)
        offsets = np.cumsum([0] + lengths)
        for layer, kv in enumerate(caches):
            k = self.key_reader(layer, self.layout.gather_keys(kv, phys.expand(H, -1)))
            for b in range(len(commands)):
                keys[b, layer, :, : lengths[b]] = k[:, offsets[b]: offsets[b + 1]]
        positions = torch.full((len(commands), L, H, n_max), -1, dtype=torch.int64)
        for b, cmd in enumerate(commands):
            positions[b, :, :, : cmd.old_len] = self._positions(cmd, L, H)
        ids = [c.req_id for c in commands]
        queries = attn_accum = None
        try:
            if self.capture is not None and self.core.policy.needs_queries:
                queries = self.capture.queries_for(ids, [c.logical_len for c in commands])
            if self.capture is not None and self.core.policy.needs_attn_accum:
                attn_accum = self.capture.accum_for(ids, lengths, n_max)
        except RuntimeError as e:  # the capture cannot serve these requests: score each alone (falls back)
            if len(commands) > 1:
                raise
            self.report.failed[commands[0].req_id] = f"{type(e).__name__}: {e}"
            queries = attn_accum = None
        out = self.core.run(RoundInput(
            keys=keys, positions=positions, t=torch.tensor([c.logical_len for c in commands]),
            new_len=torch.tensor([c.new_len for c in commands]),
            prompt_len=torch.tensor([c.prompt_len for c in commands]), lengths=lengths, queries=queries,
            attn_accum=attn_accum))
        for b, why in out.failed.items():
            self.report.failed.setdefault(commands[b].req_id, why)
        moves_src, moves_dst, moved = [], [], 0
        self._writing = True  # from here on state and caches change (see _run_rounds_isolated)
        for b, cmd in enumerate(commands):
            plan = out.plans[b]
            # The plan pads ragged move lists with self-copies of a slot no move writes: safe to execute as is.
            moves_src.append(phys_slots(block_tables[b], plan.src, self.layout.block_size))
            moves_dst.append(phys_slots(block_tables[b], plan.dst, self.layout.block_size))
            moved += plan.num_moves
            self.tags[cmd.req_id] = Tags(apply_plan(positions[b, :, :, : cmd.old_len], plan),
                                         cmd.logical_len - cmd.new_len)
            if self.capture is not None:
                self.capture.apply_plan(cmd.req_id, plan, cmd.old_len)
            self._truncate_block_table(cmd.req_id, blocks_held(cmd.new_len, self.layout.block_size))
            for listener in self.round_listeners:
                listener(RoundLog(cmd.req_id, cmd.logical_len, cmd.old_len, cmd.new_len,
                                  out.keep[b, :, :, : cmd.old_len]))
        move_layers(self.layout, caches, torch.cat(moves_src, dim=-1), torch.cat(moves_dst, dim=-1))
        elapsed = time.perf_counter() - start
        r = self.report
        r.rounds += len(commands)
        r.tokens_moved += moved
        r.bytes_moved += moved * 2 * self.layout.head_dim * caches[0].element_size()
        r.compaction_seconds.append(elapsed)
        r.scoring_seconds.append(out.scoring_seconds)

    def _copy_on_write(self, commands: list[RoundCommand]) -> None:
        """Apply the scheduler's copy-on-write replacements before any move: a shared (or prefix-cached) block's
        content goes into the request's private block, which takes its place in both copies of the block table.
        Idempotent (the shared block is never written), so a retried batch may run it again."""
        src: list[int] = []
        dst: list[int] = []
        table = self.runner.input_batch.block_table[0]
        for cmd in commands:
            block_ids = self.runner.requests[cmd.req_id].block_ids[0]
            row = self.runner.input_batch.req_id_to_index.get(cmd.req_id)
            for index, shared, private in cmd.copies:
                block_ids[index] = private
                if row is not None:
                    table.block_table.np[row, index] = private
                src.append(shared)
                dst.append(private)
        if src:
            slots, bs = torch.arange(len(src) * self.layout.block_size), self.layout.block_size
            s = phys_slots(torch.tensor(src, dtype=torch.int64), slots, bs)
            d = phys_slots(torch.tensor(dst, dtype=torch.int64), slots, bs)
            L, H = len(self.kv_caches), self.layout.num_kv_heads
            move_layers(self.layout, self.kv_caches, s.expand(L, H, -1), d.expand(L, H, -1))

    def _truncate_block_table(self, req_id: str, num_blocks: int) -> None:
        """Shrink both copies vLLM keeps of the request's block list: the request state and the batch row."""
        block_ids = self.runner.requests[req_id].block_ids[0]
        del block_ids[num_blocks:]
        batch = self.runner.input_batch
        row = batch.req_id_to_index.get(req_id)
        if row is None:
            return
        table = batch.block_table[0]
        table.block_table.np[row, num_blocks: table.num_blocks_per_row[row]] = 0
        table.num_blocks_per_row[row] = num_blocks

    # -- input preparation: positions logical, cache addressing physical -----------------------------------
    def adjust_inputs(self, runner: Any, scheduler_output: Any, num_scheduled_tokens: np.ndarray) -> None:
        if self.capture is not None:
            self.capture.begin_forward(runner, num_scheduled_tokens, self.evicted)
        if not self.evicted:
            return
        n = runner.input_batch.num_reqs
        deltas = np.array([self.evicted.get(r, 0) for r in runner.input_batch.req_ids[:n]], dtype=np.int64)
        if not deltas.any():
            return
        total = scheduler_output.total_num_scheduled_tokens
        token_req = np.repeat(np.arange(n), num_scheduled_tokens)
        cache_pos = runner.positions[:total] - torch.from_numpy(deltas[token_req]).to(runner.positions.device)
        d = torch.from_numpy(deltas)
        runner.seq_lens[:n] -= d.to(runner.seq_lens.dtype).to(runner.seq_lens.device)
        runner.optimistic_seq_lens_cpu[:n] -= d.to(runner.optimistic_seq_lens_cpu.dtype)
        runner.input_batch.block_table.compute_slot_mapping(n, runner.query_start_loc.gpu[: n + 1], cache_pos)

