"""Scheduler side: when to run a round, how many tokens a request keeps, and which blocks go back to the pool.

Lives in vLLM's engine-core process, next to the ``Scheduler``. The request's logical length
(``num_computed_tokens``) stays untouched: it drives input tokens, RoPE positions and stopping. What changes is
the cache length ``logical - evicted``, which allocation follows and which the worker uses for ``seq_lens`` and
the slot mapping.

A round runs whenever a request's cache reaches ``budget + divide_length`` tokens, in decode and inside a
prefill alike: :meth:`SchedulerSide.prefill_cap` cuts every prefill chunk (a long prompt, or the re-prefill of
a preempted request's logical sequence) where the cache reaches that trigger, so a compressed request never
holds more than ``ceil((budget + divide_length) / block_size)`` blocks, and its rounds fall at the same cache
lengths however vLLM splits the prefill (the transformers reference rounds at the same points).

Prefix caching: a round never writes into a block that another request holds or that the prefix cache may hand
out. Such a kept block is replaced by a private copy (copy on write: the worker copies it before the round's
moves), and the request drops its reference, so the shared block stays cached for the others; when the pool has
no free block for the copy, a block only the prefix cache knows loses its registration and is written in place
instead. A request compressed at least once registers no further block, and a compressed request's prefix-cache
hit is capped at its trigger, so its rounds fall where they would without the cache.

Ordering inside one engine step: ``before_schedule`` shrinks the block lists and frees the emptied tail blocks,
so the same ``schedule()`` call may hand those blocks to another request; the worker moves the survivors at the
very start of the step, before vLLM zeroes or writes any newly allocated block.

Budget mode ``pressure`` (:mod:`kvcompact.pressure`): a request's budget is its floor. It runs no round at its
trigger and keeps every token while the pool has room; ``before_schedule`` measures what this step needs (every
running request's next tokens, plus the waiting requests a fixed budget equal to the floor would admit now, at
their floor footprint) and, when the pool falls short, takes from every cache the same share of its excess over its
floor, just enough, in the same step, with ordinary rounds whose ``new_len`` is the chosen target. A prefill grows
past its floor footprint only into blocks this step leaves spare (:meth:`SchedulerSide.prefill_cap`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvcompact.config import ConfigError, KVCompactConfig, RequestOverrides
from kvcompact.evaluation import loops
from kvcompact.planner import blocks_held
from kvcompact.pressure import Candidate, footprint, proportional
from kvcompact.selection import effective_budget
from kvcompact.vllm.metrics import Metrics
from kvcompact.vllm.protocol import RoundCommand, StepPlan, WorkerReport

logger = logging.getLogger("vllm.kvcompact")  # formatted and levelled by vLLM's own logging


@dataclass
class RequestState:
    enabled: bool
    budget: int          # effective budget (tokens per KV head after a round)
    prompt_len: int
    evicted: int = 0     # physical: logical length - cache length
    counted: int = 0     # tokens counted as evicted (== evicted unless compaction is "none")
    rounds: int = 0
    pressure: bool = False  # budget mode "pressure": budget is the floor, rounds only when the pool is short


@dataclass
class RoundEvent:
    """One round as the scheduler saw it, handed to ``SchedulerSide.round_listeners`` (tests check the freed
    blocks and pool with it)."""

    req_id: str
    logical_len: int
    old_len: int
    new_len: int
    blocks_freed: int
    free_blocks_after: int
    pressure: bool = False  # a pressure round (budget mode "pressure"), new_len its target


class SchedulerSide:
    def __init__(self, config: KVCompactConfig, scheduler: Any, metrics: Metrics) -> None:
        self.config = config
        self.scheduler = scheduler
        self.metrics = metrics
        self.requests: dict[str, RequestState] = {}
        self.round_listeners: list[Callable[[RoundEvent], None]] = []
        # Budget mode "pressure": how the shortfall is spread over the running requests, and per pressure-mode
        # request the most tokens this step may schedule for it (its prefill grows only into spare blocks).
        self.allowance: dict[str, int] = {}
        kvm = scheduler.kv_cache_manager
        managers = kvm.coordinator.single_type_managers
        if len(managers) != 1:
            raise ConfigError("kvcompact supports models with one KV-cache group (plain full attention); "
                              f"this model has {len(managers)}")
        self.manager = managers[0]
        self.block_pool = kvm.block_pool
        self.block_size = self.manager.block_size
        usable = self.block_pool.num_gpu_blocks - 1  # block 0 is vLLM's null block
        floor_blocks = blocks_held(config.budget + config.divide_length, self.block_size)
        if config.enabled and config.compaction != "none" and floor_blocks > usable:
            raise ConfigError(f"kvcompact: 'budget' ({config.budget}) + divide_length ({config.divide_length}) needs "
                              f"{floor_blocks} blocks of {self.block_size} tokens per request, and the KV pool has "
                              f"only {usable}: no request could ever be admitted; lower budget or divide_length, or "
                              "give the pool more memory")
        if kvm.enable_caching:
            self._guard_prefix_cache(kvm)

    def _guard_prefix_cache(self, kvm: Any) -> None:
        """Wrap this engine's prefix-cache entry points (instance attributes: other engines are untouched).
        Registration: every path (allocation, the async scheduler's output update) goes through the
        coordinator. Hits: ``get_computed_blocks``."""
        register, lookup = kvm.coordinator.cache_blocks, kvm.get_computed_blocks

        def cache_blocks(request: Any, num_computed_tokens: int) -> Any:
            state = self.requests.get(request.request_id)
            if state is not None and state.counted:
                return None  # its blocks no longer hold the token-hash chain's content
            return register(request, num_computed_tokens)

        def get_computed_blocks(request: Any) -> Any:
            blocks, hit, *rest = lookup(request)
            cap = self.hit_cap(request)
            if cap is not None and hit > cap:
                blocks, hit = kvm.truncate_computed_blocks(blocks, cap), cap
            return (blocks, hit, *rest)

        kvm.coordinator.cache_blocks = cache_blocks
        kvm.get_computed_blocks = get_computed_blocks

    def _compacted(self, request: Any) -> RequestState | None:
        """The request's state when its rounds free blocks (compression on, compaction not "none"), else None:
        only such a request is bounded at its trigger, ``budget + divide_length`` tokens."""
        state = self.requests.get(request.request_id)
        if state is None or not state.enabled or self.config.compaction == "none":
            return None
        return state

    def hit_cap(self, request: Any) -> int | None:
        """The longest prefix-cache hit a compressed request may take: whole blocks short of its trigger, so its
        first prefill chunk still ends at the trigger and its rounds fall where they would without the cache.
        Under speculative decoding vLLM pads a hit that leaves one token to ``1 + num_spec_tokens`` tokens and
        asserts that count after :meth:`prefill_cap`, so the hit stops that many tokens short of the trigger.
        None: any hit."""
        state = self._compacted(request)
        if state is None:
            return None
        last = state.budget + self.config.divide_length - 1 - self.scheduler.num_spec_tokens
        return last // self.block_size * self.block_size

    def shared_blocks(self, blocks: list[Any]) -> list[int]:
        """Indices of the blocks a round may not write in place: held by another request too, or registered in
        the prefix cache (which may hand them out later)."""
        return [i for i, block in enumerate(blocks) if not self.block_pool.is_block_writable(block)]

    # -- request lifecycle -------------------------------------------------------------------------------
    def add_request(self, request: Any) -> None:
        params = request.sampling_params
        try:
            overrides = RequestOverrides.from_extra_args(getattr(params, "extra_args", None), self.config,
                                                         getattr(self.scheduler, "max_model_len", None))
        except ConfigError as e:
            # The front-end answers a bad override with HTTP 400; one that reaches the engine anyway (another
            # entry point) must not take it down: serve the request uncompressed.
            logger.warning("kvcompact: request %s runs uncompressed: %s", request.request_id, e)
            overrides = RequestOverrides(enabled=False)
        enabled = self.config.enabled if overrides.enabled is None else overrides.enabled
        budget = overrides.budget or self.config.budget
        mode = overrides.budget_mode or self.config.budget_mode
        prompt_len = request.num_prompt_tokens
        self.requests[request.request_id] = RequestState(
            enabled=enabled,
            budget=effective_budget(budget, prompt_len, self.config.window, self.config.protect_prompt),
            prompt_len=prompt_len,
            pressure=enabled and mode == "pressure" and self.config.compaction != "none",
        )
        request.kvc_evicted = 0

    def on_preempt(self, request: Any) -> None:
        """vLLM frees all blocks of a preempted request and later re-prefills prompt + generated tokens. The
        cache starts empty again, and the re-prefill is compressed as it goes (rounds at the trigger)."""
        state = self.requests.get(request.request_id)
        if state is not None:
            if state.counted:
                logger.info("kvcompact: compressed request %s preempted after %d output tokens (%d evicted); it "
                            "re-prefills its logical sequence with rounds at the same cache lengths",
                            request.request_id, request.num_output_tokens, state.counted)
            state.evicted = state.counted = 0
        request.kvc_evicted = 0

    def on_finish(self, request: Any) -> None:
        """A finished request: counted as uncompressed (no round ran) or, when its output ends in a loop after
        rounds, as looping: what a budget too small for the model looks like to an operator."""
        state = self.requests.pop(request.request_id, None)
        self.allowance.pop(request.request_id, None)
        if state is None or not state.enabled:
            return
        if not state.rounds:
            self.metrics.on_uncompressed_finish()
        elif loops(request.output_token_ids):
            self.metrics.on_looping_finish()

    # -- per step ----------------------------------------------------------------------------------------
    def before_schedule(self) -> list[RoundCommand]:
        due = []
        for request in self.scheduler.running:
            state = self.requests.get(request.request_id)
            if state is None or not state.enabled or state.pressure:
                continue
            logical = request.num_computed_tokens
            cache_len = logical - state.counted
            if cache_len >= state.budget + self.config.divide_length:
                due.append((request, state, logical, cache_len, state.budget))
        due += self._pressure_rounds(due)
        # Copy-on-write blocks are taken before any round of this step frees its tail: the worker's moves still
        # read a freed tail block, so no copy of this step may write into one.
        private = [self._private_blocks(request, state, new_len) for request, state, _, _, new_len in due]
        return [self._round(*args, blocks) for args, blocks in zip(due, private) if blocks is not None]

    def _pressure_rounds(self, fixed: list[tuple[Any, RequestState, int, int, int]]
                         ) -> list[tuple[Any, RequestState, int, int, int]]:
        """Budget mode ``pressure``: the rounds (request, state, logical, cache length, target) that make this
        step fit the pool, after this step's ``fixed`` rounds, and each pressure-mode request's allowance.

        What the step needs: every running request's footprint (a pressure-mode request: its cache plus the block
        its next token may open, at least its floor footprint; any other: its peak, as admission counts it) plus
        the waiting requests, in queue order, that a fixed budget equal to the floor would admit now (their floor
        footprint). The shortfall is reclaimed from what pressure-mode requests hold beyond their floor
        footprint (:func:`~kvcompact.pressure.proportional`); what is left over lets their prefills grow."""
        s = self.scheduler
        self.allowance = {}
        running = [(r, self.requests.get(r.request_id)) for r in s.running]
        if not any(state is not None and state.pressure for _, state in running):
            return []
        bs = self.block_size
        after = {request.request_id: blocks_held(new_len, bs) for request, _, _, _, new_len in fixed}
        held = {r.request_id: after.get(r.request_id, len(self.manager.req_to_blocks.get(r.request_id, ())))
                for r, _ in running}
        total = self.block_pool.get_num_free_blocks() + sum(held.values())
        need: dict[str, int] = {}
        floor_room = total  # what is left at every running request's floor footprint: a fixed budget's room
        candidates = []
        for request, state in running:
            rid, peak = request.request_id, self.peak_blocks(request)
            if state is not None and state.pressure:
                cache_len = request.num_computed_tokens - state.counted
                need[rid] = footprint(cache_len, peak, bs)
                candidates.append(Candidate(rid, cache_len, state.budget, peak))
                floor_room -= peak
            else:
                need[rid] = max(held[rid], peak)
                floor_room -= need[rid]
        admit, slots = 0, s.max_num_active_reqs - len(running)
        for request in s.waiting:
            growth = max(0, self._growth(request))
            if slots <= 0 or growth > floor_room:
                break
            floor_room -= growth
            admit += growth
            slots -= 1
        targets = proportional(candidates, sum(need.values()) + admit - total, bs, self.config.divide_length)
        spare = total - admit - sum(need.values())
        due = []
        for request, state in running:
            if state is None or not state.pressure:
                continue
            rid, peak = request.request_id, self.peak_blocks(request)
            logical = request.num_computed_tokens
            cache_len = logical - state.counted
            if rid in targets:
                due.append((request, state, logical, cache_len, targets[rid]))
                spare += need[rid] - footprint(targets[rid], peak, bs)
                cache_len = targets[rid]
                need[rid] = footprint(cache_len, peak, bs)
            # Tokens this request may schedule: up to the blocks it occupies, plus spare ones for a prefill.
            wanted = blocks_held(cache_len + max(1, request.num_tokens - logical), bs) - need[rid]
            extra = min(max(0, spare), max(0, wanted))
            spare -= extra
            self.allowance[rid] = max(1, (need[rid] + extra) * bs - cache_len)
        return due

    def _private_blocks(self, request: Any, state: RequestState, new_len: int) -> dict[int, Any] | None:
        """{index: new private block} for the kept blocks the round may not write in place. A block another
        request holds must be copied; a block only the prefix cache knows is copied while free blocks last (so
        the cache keeps it), else it loses its registration and is written in place, as vLLM would evict a
        cached block under pressure. A pressure round copies none of the latter: the pool is short, which is why
        it runs. None: too few free blocks to copy the blocks others hold (the round waits for a later step)."""
        if self.config.compaction == "none":
            return {}
        blocks = self.manager.req_to_blocks[request.request_id]
        shared = self.shared_blocks(blocks[:blocks_held(new_len, self.block_size)])
        held = [i for i in shared if blocks[i].ref_cnt > 1]
        cached = [i for i in shared if blocks[i].ref_cnt <= 1]
        free = self.block_pool.get_num_free_blocks() if not state.pressure else len(held)
        if len(held) > free:
            logger.warning("kvcompact: round of %s deferred: no free block to copy %d shared blocks into",
                           request.request_id, len(held))
            self.metrics.on_deferred_round()
            return None
        copied = held + cached[: free - len(held)]
        for i in cached[free - len(held):]:
            self.block_pool._maybe_evict_cached_block(blocks[i])
        return dict(zip(copied, self.block_pool.get_new_blocks(len(copied))))

    def prefill_cap(self, request: Any, num_computed_tokens: int) -> int | None:
        """The most tokens vLLM may schedule for ``request`` this step: up to its next trigger, so neither a
        prefill chunk nor a decode step's speculative tokens carry the cache past ``budget + divide_length``
        (None: no cap). vLLM drops the drafts beyond the cap, so a round falls at the same cache length as
        without speculation. At least 1, so vLLM never sees an unschedulable request: a decode step's sampled
        token is never cut."""
        state = self._compacted(request)
        if state is None:
            return None
        if state.pressure and request.request_id in self.allowance:
            return self.allowance[request.request_id]
        cache_len = num_computed_tokens - state.evicted
        return max(1, state.budget + self.config.divide_length - cache_len)

    def _round(self, request: Any, state: RequestState, logical: int, cache_len: int, new_len: int,
               private: dict[int, Any]) -> RoundCommand:
        start = time.perf_counter()
        evicted_before = state.evicted
        copies: list[tuple[int, int, int]] = []
        freed = 0
        if self.config.compaction != "none":
            blocks = self.manager.req_to_blocks[request.request_id]
            keep_blocks = blocks_held(new_len, self.block_size)
            tail = blocks[keep_blocks:]
            del blocks[keep_blocks:]
            # Tail blocks go back in reverse so the most recently used is reused last.
            self.block_pool.free_blocks(reversed(tail))
            freed = len(tail)
            for i, block in private.items():
                copies.append((i, blocks[i].block_id, block.block_id))
                self.block_pool.free_blocks([blocks[i]])  # our reference only: it stays cached for others
                blocks[i] = block
            state.evicted += cache_len - new_len
            request.kvc_evicted = state.evicted
        command = RoundCommand(req_id=request.request_id, old_len=cache_len, new_len=new_len, logical_len=logical,
                               evicted_before=evicted_before, prompt_len=state.prompt_len, copies=tuple(copies))
        state.counted += cache_len - new_len
        state.rounds += 1
        if self.round_listeners:
            event = RoundEvent(request.request_id, logical, cache_len, new_len, freed,
                               self.block_pool.get_num_free_blocks(), state.pressure)
            for listener in self.round_listeners:
                listener(event)
        self.metrics.on_round(tokens_evicted=cache_len - new_len, blocks_freed=freed,
                              seconds=time.perf_counter() - start, blocks_copied=len(copies), kept=new_len,
                              pressure=state.pressure)
        return command

    # -- admission -----------------------------------------------------------------------------------------
    def peak_blocks(self, request: Any) -> int:
        """The most blocks ``request`` can ever hold from now on. Compressed: ``budget + divide_length`` tokens,
        in its (re-)prefill as in decode (:meth:`prefill_cap`). Uncompressed: prompt + max_tokens, plus the
        speculative tokens its last step may schedule (vLLM does not stop drafts at max_tokens). Both capped by
        the context."""
        state = self._compacted(request)
        total = request.num_prompt_tokens + (request.max_tokens or 0) + self.scheduler.num_spec_tokens
        total = min(total, self.scheduler.max_model_len)
        if state is not None:
            total = min(total, state.budget + self.config.divide_length)
        return blocks_held(total, self.block_size)

    def _growth(self, request: Any) -> int:
        """Blocks ``request`` may still need beyond those it holds. A pressure-mode request that grew past its floor
        footprint may, this step, need what its allowance lets it schedule (:meth:`_pressure_rounds` made room)."""
        held = len(self.manager.req_to_blocks.get(request.request_id, ()))
        allowance = self.allowance.get(request.request_id)
        if allowance is None:
            return self.peak_blocks(request) - held
        state = self.requests[request.request_id]
        cache_len = request.num_computed_tokens - state.counted
        return max(self.peak_blocks(request), blocks_held(cache_len + allowance, self.block_size)) - held

    def admission_cap(self) -> int | None:
        """Under ``admission: guaranteed``, how many requests may be running after this step's admissions: the
        waiting requests, in queue order (no overtaking), whose peak footprint fits next to the growth every
        running request may still need. None: no cap (``greedy``: vLLM decides).

        Every request fits an empty pool (vLLM refuses at start-up a context longer than the pool, and a
        prompt longer than the context with HTTP 400), so a waiting request is delayed, never starved."""
        if self.config.admission != "guaranteed":
            return None
        s = self.scheduler
        available = self.block_pool.get_num_free_blocks() - sum(max(0, self._growth(r)) for r in s.running)
        admitted = 0
        for request in s.waiting:
            need = self._growth(request)
            if need > available:
                break
            available -= need
            admitted += 1
        return len(s.running) + admitted

    def plan(self, commands: list[RoundCommand]) -> StepPlan:
        evicted = {rid: s.evicted for rid, s in self.requests.items() if s.evicted}
        # Under compaction "none" nothing moves: the worker has nothing to do.
        rounds = commands if self.config.compaction != "none" else []
        return StepPlan(rounds=rounds, evicted=evicted)

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
            for req_id, error in report.failed.items():
                logger.warning("kvcompact: scoring failed for request %s, kept the most recent tokens: %s",
                               req_id, error)
        running = [r for r in self.scheduler.running if r.request_id in self.requests]
        compressed = [r for r in running if self.requests[r.request_id].counted > 0]
        self.metrics.set_running(
            compressed=len(compressed),
            logical=sum(r.num_computed_tokens for r in running),
            cached=sum(r.num_computed_tokens - self.requests[r.request_id].evicted for r in running),
        )
