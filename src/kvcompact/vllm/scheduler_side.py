"""Scheduler side: when to run a round, how many tokens a request keeps, and which blocks go back to the pool.

Lives in vLLM's engine-core process next to the ``Scheduler``, reached through its hooks
(:mod:`kvcompact.vllm.hooks.scheduler`). A request's logical_len (``num_computed_tokens``) stays untouched; allocation,
``seq_lens`` and the slot mapping follow its cache_len, ``logical_len - evicted`` (docs/DESIGN.md, section 3). A round
falls where the cache reaches the trigger, in decode and prefill alike (section 2.4). ``schedule_rounds`` frees a
round's tail blocks before vLLM's ``schedule()``, which may hand them to another request in the same step; the workers
move first (section 2.1). Every hook's kvcompact part runs in :meth:`SchedulerSide.contained`: a fault ends a request or
turns compression off, never the engine (section 2.7). Block surgery and copy on write: :mod:`kvcompact.vllm.reclaimer`;
admission, pressure: :mod:`kvcompact.vllm.admission`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import replace
from typing import Any

from kvcompact.config import LATCH_MODES, SHRINKING_MODES, ConfigError, KVCompactConfig, RequestOverrides
from kvcompact.ledger import Ledger, blocks_held, effective_budget, trigger
from kvcompact.round import BlockCopy, Round
from kvcompact.vllm.admission import Admission
from kvcompact.vllm.metrics import Metrics, loops
from kvcompact.vllm.protocol import MESSAGE_ATTR, StepMessage, WorkerReport
from kvcompact.vllm.reclaimer import Reclaimer
from kvcompact.vllm.requests import SchedulerRequest, ledger_of

logger = logging.getLogger("vllm.kvcompact")  # formatted and levelled by vLLM's own logging


class SchedulerSide:
    def __init__(self, config: KVCompactConfig, scheduler: Any, metrics: Metrics) -> None:
        self.config = config
        self.scheduler = scheduler
        self.metrics = metrics
        self.requests: dict[str, SchedulerRequest] = {}  # created in add_request, dropped in forget
        self.round_listeners: list[Callable[[Round], None]] = []
        # Fault isolation (:meth:`contained`): requests finished with an error whose clients are told at the next
        # update_from_output, and why compression is off for new requests (None: it is not).
        self.error_outputs: list[Any] = []
        self.disabled: str | None = None
        kvm = scheduler.kv_cache_manager
        managers = kvm.coordinator.single_type_managers
        if len(managers) != 1:
            raise ConfigError("kvcompact supports models with one KV-cache group (plain full attention); "
                              f"this model has {len(managers)}")
        self.manager = managers[0]
        self.block_pool = kvm.block_pool
        self.block_size = self.manager.block_size
        self.admission = Admission(config, scheduler, self.requests, self.manager, self.block_pool, self.block_size)
        self.reclaimer = Reclaimer(self.manager, self.block_pool, self.block_size)
        usable = self.block_pool.num_gpu_blocks - 1  # block 0 is vLLM's null block
        # A draft model's lookahead slots sit past the trigger (vLLM reserves them with the step's tokens).
        lookahead = scheduler.num_lookahead_tokens
        floor_blocks = blocks_held(trigger(config.budget, config.divide_length) + lookahead, self.block_size)
        if config.enabled and config.compaction != "none" and floor_blocks > usable:
            drafted = f" (+ {lookahead} lookahead slots for the draft model)" if lookahead else ""
            raise ConfigError(f"kvcompact: 'budget' ({config.budget}) + divide_length ({config.divide_length})"
                              f"{drafted} needs {floor_blocks} blocks of {self.block_size} tokens per request, and "
                              f"the KV pool has only {usable}: no request could ever be admitted; lower budget or "
                              "divide_length, or give the pool more memory")

    def ledger(self, request_id: str) -> Ledger | None:
        return ledger_of(self.requests, request_id)

    def _bounded(self, request: Any) -> Ledger | None:
        """The request's ledger when its rounds free blocks (it is bounded at its trigger), else None."""
        ledger = self.ledger(request.request_id)
        return ledger if ledger is not None and ledger.frees_blocks else None

    def evicted(self, request: Any) -> int:
        """Tokens the request's rounds moved out of its cache: allocation follows ``logical_len - evicted``."""
        ledger = self.ledger(request.request_id)
        return 0 if ledger is None else ledger.evicted

    def registers(self, request: Any) -> bool:
        """Whether the request's blocks may enter the prefix cache: not once it was compressed (they no longer
        hold the token-hash chain's content)."""
        ledger = self.ledger(request.request_id)
        return ledger is None or not ledger.dropped

    def failing(self, request_id: str) -> bool:
        """Whether a contained fault named the request: it ends with an error at the next safe point."""
        state = self.requests.get(request_id)
        return state is not None and state.error is not None

    def hit_cap(self, request: Any) -> int | None:
        """The longest prefix-cache hit a compressed request may take (None: any), so its rounds fall where they
        would without the cache (:meth:`Ledger.hit_cap`)."""
        ledger = self._bounded(request)
        return None if ledger is None else ledger.hit_cap(self.block_size, self.scheduler.num_spec_tokens)

    # -- fault isolation ---------------------------------------------------------------------------------
    @contextmanager
    def contained(self, where: str, *request_ids: str) -> Iterator[None]:
        """Run kvcompact's part of a hook; an exception ends ``request_ids`` with an error (at the next
        :meth:`finish_pending`), or, with none named, turns compression off for new requests. Never re-raised:
        a fault in kvcompact's bookkeeping must not end every request on the server."""
        try:
            yield
        except Exception as e:  # noqa: BLE001 - contained by design, logged with its traceback
            if request_ids:
                logger.exception("kvcompact: %s failed for request(s) %s: they end with an error", where,
                                 list(request_ids))
                for rid in request_ids:
                    state = self.requests.setdefault(rid, SchedulerRequest.untracked())
                    if state.error is None:  # the first fault says why
                        state.error = f"kvcompact {where} failed: {type(e).__name__}: {e}"
            else:
                logger.exception("kvcompact: %s failed: compression is off for new requests of this engine from "
                                 "now on (running requests go on); restart the server to turn it back on", where)
                self.disabled = self.disabled or where
            self.metrics.on_scheduler_fault(disabled=not request_ids)

    def finish_pending(self) -> None:
        """Finish, with an error, the requests a contained fault named. Called where vLLM is not walking its
        queues (the start of ``schedule`` and of ``update_from_output``); their clients are told at the next
        ``update_from_output`` (:meth:`take_error_outputs`)."""
        failing = [rid for rid, state in self.requests.items() if state.error is not None]
        if not failing:
            return
        from vllm.v1.request import RequestStatus

        live = [rid for rid in failing if rid in self.scheduler.requests]
        for rid in failing:
            if rid in self.scheduler.requests:
                self.requests[rid].error = None  # finished below; vLLM's free_request then forgets it
            else:
                del self.requests[rid]  # already gone from vLLM: nothing left to finish
        self.error_outputs += self.scheduler.finish_requests(live, RequestStatus.FINISHED_ERROR)

    def take_error_outputs(self) -> list[Any]:
        out, self.error_outputs = self.error_outputs, []
        return out

    # -- request lifecycle -------------------------------------------------------------------------------
    def add_request(self, request: Any) -> None:
        params = request.sampling_params
        try:
            overrides = RequestOverrides.from_extra_args(None if params is None else params.extra_args, self.config,
                                                         self.scheduler.max_model_len,
                                                         self.scheduler.num_lookahead_tokens)
        except ConfigError as e:
            # The front-end answers a bad override with HTTP 400; one that reaches the engine anyway (another
            # entry point) must not take it down: serve the request uncompressed.
            logger.warning("kvcompact: request %s runs uncompressed: %s", request.request_id, e)
            overrides = RequestOverrides(enabled=False)
        cfg = self.config
        enabled = cfg.enabled if overrides.enabled is None else overrides.enabled
        enabled = enabled and self.disabled is None
        budget = overrides.budget or cfg.budget
        mode = overrides.budget_mode or cfg.budget_mode
        prompt_len = request.num_prompt_tokens
        frees = enabled and cfg.compaction != "none"
        self.requests[request.request_id] = SchedulerRequest(Ledger(
            enabled=enabled, budget=effective_budget(budget, prompt_len, cfg.protect_prompt),
            divide_length=cfg.divide_length, prompt_len=prompt_len, frees_blocks=frees, base=budget,
            ratio=cfg.budget_ratio,
            pressure=frees and mode in SHRINKING_MODES, latch=frees and mode in LATCH_MODES,
            pool_latch=frees and mode == "pool_latch"))

    def on_preempt(self, request: Any) -> None:
        """vLLM frees all blocks of a preempted request and later re-prefills prompt + generated tokens. The
        cache starts empty again, and the re-prefill is compressed as it goes (rounds at the trigger)."""
        ledger = self.ledger(request.request_id)
        if ledger is None:
            return
        if ledger.dropped:
            logger.info("kvcompact: compressed request %s preempted after %d output tokens (%d evicted); it "
                        "re-prefills its logical sequence with rounds at the same cache lengths",
                        request.request_id, request.num_output_tokens, ledger.dropped)
        ledger.restart()

    def on_finish(self, request: Any) -> None:
        """A finished request: its compression ratio and rounds observed; counted as uncompressed (no round ran)
        or, when its output ends in a loop after rounds, as looping: what a budget too small for the model looks
        like to an operator."""
        ledger = self.ledger(request.request_id)
        if ledger is None or not ledger.enabled:
            return
        logical_len = request.num_computed_tokens
        self.metrics.on_request_finish(logical_len, ledger.cache_len(logical_len), ledger.rounds)
        if not ledger.rounds:
            self.metrics.on_uncompressed_finish()
        elif loops(request.output_token_ids):
            self.metrics.on_looping_finish()

    def forget(self, request_id: str) -> None:
        """Drop everything kept for a request that ends (after :meth:`on_finish`, which may have failed): it ends
        with the reason it was ending with, not a pending kvcompact error."""
        self.requests.pop(request_id, None)

    # -- one engine step, in the order vLLM runs it -------------------------------------------------------
    def schedule(self, vllm_schedule: Callable[[], Any]) -> Any:
        """vLLM's ``Scheduler.schedule`` with kvcompact around it: this step's rounds first (their tail blocks go
        back to the pool before vLLM allocates), admission capped while vLLM schedules, and the step message for
        the workers attached to vLLM's output."""
        rounds = self.schedule_rounds()
        cap, limit = None, self.scheduler.max_num_active_reqs
        if self.disabled is None:
            with self.contained("admission"):
                cap = self.admission.max_running()
        if cap is not None:
            self.scheduler.max_num_active_reqs = min(limit, cap)
        try:
            output = vllm_schedule()
        finally:
            self.scheduler.max_num_active_reqs = limit
        setattr(output, MESSAGE_ATTR, self.step_message(rounds))
        return output

    def update_from_output(self, vllm_update: Callable[[], Any], report: WorkerReport | None) -> Any:
        """vLLM's ``Scheduler.update_from_output`` with the worker's report: requests whose compaction failed end
        in an error before vLLM reads their outputs; their clients are told, and the step's metrics set, after."""
        failed: list[Any] = []
        with self.contained("worker report", *(report.aborted if report is not None else ())):
            failed = self.finish_failed(report)  # before vLLM reads the outputs computed on their broken caches
        self.finish_pending()
        result = vllm_update()
        with self.contained("error outputs"):
            self.add_error_outputs(result, failed + self.take_error_outputs())
        with self.contained("step metrics"):
            self.after_step(report)
        return result

    # -- per step ----------------------------------------------------------------------------------------
    def schedule_rounds(self) -> list[Round]:
        """This step's rounds, each contained to its request; requests whose round failed are finished before vLLM
        schedules (their block lists may be half shrunk)."""
        self.finish_pending()
        if self.disabled is None:
            with self.contained("pool latch"):
                self.admission.latch_pool()
        due: list[Round] = []
        for request in self.scheduler.running:
            with self.contained("round check", request.request_id):
                ledger = self.ledger(request.request_id)
                logical_len = request.num_computed_tokens
                if ledger is not None:
                    ledger.grow(logical_len)  # before this step's rounds and pressure plan read its budget
                    if ledger.due(logical_len):
                        due.append(Round(request.request_id, logical_len, ledger.cache_len(logical_len),
                                         ledger.budget, prompt_len=ledger.prompt_len, pressure=ledger.pressure))
        due = [r for r in due if not self.failing(r.req_id)]
        if self.disabled is None:
            with self.contained("pressure planning"):
                due += self.admission.pressure_rounds(due)
        # Every copy-on-write block of the step is taken before any round of the step frees its tail: the
        # worker runs all the step's copies before its moves, and the moves still read the freed tail blocks, so
        # a copy that got one of them would overwrite what a move reads. Blocks another request holds come first,
        # round by round (each round lets go of its reference at once, so a block the next round then holds alone
        # needs no copy); blocks only the prefix cache knows after, while free blocks last.
        copies: list[list[BlockCopy] | None] = []
        for r in due:
            held = None
            with self.contained("copy on write", r.req_id):
                held = self._copy_held(r)
            copies.append(held)
        for r, held in zip(due, copies):
            if held is not None and not self.failing(r.req_id):
                with self.contained("copy on write", r.req_id):
                    held.extend(self._copy_cached(r))
        rounds = []
        for r, step_copies in zip(due, copies):
            if step_copies is None or self.failing(r.req_id):
                continue
            with self.contained("round", r.req_id):
                rounds.append(self._round(r, step_copies))
        self.finish_pending()
        return rounds

    def _frees_blocks(self, r: Round) -> bool:
        return self.requests[r.req_id].ledger.frees_blocks

    def _copy_held(self, r: Round) -> list[BlockCopy] | None:
        """The round's private copies of the kept blocks another request holds too (:meth:`Reclaimer.copy_held`);
        None: too few free blocks, the round waits for a later step (counted as deferred). The footprints of
        :mod:`kvcompact.vllm.admission` keep a free block for every such copy, so under guaranteed admission a
        round never waits."""
        if not self._frees_blocks(r):
            return []
        held = self.reclaimer.copy_held(r.req_id, r.kept_len)
        if held is None:
            logger.warning("kvcompact: round of %s deferred: no free block to copy the shared blocks it keeps into",
                           r.req_id)
            self.metrics.on_deferred_round()
        return held

    def _copy_cached(self, r: Round) -> list[BlockCopy]:
        """The kept blocks only the prefix cache knows (:meth:`Reclaimer.copy_cached`), copied while free blocks
        last. A pressure round copies none of them: the pool is short, which is why it runs."""
        if not self._frees_blocks(r):
            return []
        free = 0 if r.pressure else self.block_pool.get_num_free_blocks()
        return self.reclaimer.copy_cached(r.req_id, r.kept_len, free)

    def step_cap(self, request: Any, num_computed_tokens: int) -> int | None:
        """The most tokens vLLM may schedule for ``request`` this step (None: no cap): up to its trigger
        (:meth:`Ledger.step_cap`), or in pressure mode what this step's allowance leaves room for. vLLM drops
        the speculative drafts beyond the cap, so a round falls at the same cache length as without them."""
        ledger = self._bounded(request)
        if ledger is None:
            return None
        allowance = self.requests[request.request_id].allowance
        if ledger.pressure and allowance is not None:
            return allowance
        return ledger.step_cap(num_computed_tokens)

    def _round(self, r: Round, copies: list[BlockCopy]) -> Round:
        """Free the round's tail blocks and account it: the round as the workers and listeners get it."""
        start = time.perf_counter()
        ledger = self.requests[r.req_id].ledger
        freed = self.reclaimer.free_tail(r.req_id, r.kept_len) if ledger.frees_blocks else 0
        ledger.record_round(r.cache_len, r.kept_len)
        r = replace(r, copies=tuple(copies), blocks_freed=freed,
                    free_blocks_after=self.block_pool.get_num_free_blocks())
        for listener in self.round_listeners:
            listener(r)
        self.metrics.on_round(tokens_evicted=r.cache_len - r.kept_len, blocks_freed=freed,
                              seconds=time.perf_counter() - start, blocks_copied=len(copies), kept=r.kept_len,
                              pressure=r.pressure)
        return r

    def step_message(self, rounds: list[Round]) -> StepMessage:
        """What the workers get this step: the rounds that move tokens (none under compaction "none") and every
        compressed request's eviction offset, straight from its ledger."""
        evicted = {rid: state.ledger.evicted for rid, state in self.requests.items() if state.ledger.evicted}
        return StepMessage(rounds=rounds if self.config.compaction != "none" else [], evicted=evicted)

    def finish_failed(self, report: WorkerReport | None) -> list[Any]:
        """Finish, with an error, the requests whose compaction failed on the worker (``report.aborted``): their
        cache can no longer be trusted. Runs before vLLM reads this step's outputs, so the token computed on
        that cache is never delivered; the other requests are untouched."""
        if report is None or not report.aborted:
            return []
        from vllm.v1.request import RequestStatus

        for req_id, error in report.aborted.items():
            logger.error("kvcompact: request %s finished with an error: %s", req_id, error)
        live = [r for r in report.aborted if r in self.scheduler.requests]
        return self.scheduler.finish_requests(live, RequestStatus.FINISHED_ERROR)

    @staticmethod
    def add_error_outputs(outputs: dict[int, Any], requests: list[Any]) -> None:
        """Tell each client that its request ended in an error (vLLM answers it with HTTP 500 / an error event)."""
        if not requests:
            return
        from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs

        for request in requests:
            out = EngineCoreOutput(request_id=request.request_id, new_token_ids=[],
                                   finish_reason=request.get_finished_reason(), events=request.take_events(),
                                   trace_headers=request.trace_headers)
            if request.client_index in outputs:
                outputs[request.client_index].outputs.append(out)
            else:
                outputs[request.client_index] = EngineCoreOutputs(outputs=[out])

    def after_step(self, report: WorkerReport | None) -> None:
        if report is not None:
            self.metrics.on_worker_report(report)
            for req_id, error in report.scoring_fallbacks.items():
                logger.warning("kvcompact: scoring failed for request %s, kept the most recent tokens: %s",
                               req_id, error)
        running = [(r, self.requests[r.request_id].ledger) for r in self.scheduler.running
                   if r.request_id in self.requests]
        self.metrics.set_running(
            compressed=sum(1 for _, ledger in running if ledger.dropped > 0),
            logical_len=sum(r.num_computed_tokens for r, _ in running),
            cache_len=sum(r.num_computed_tokens - ledger.evicted for r, ledger in running),
        )
