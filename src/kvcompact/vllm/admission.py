"""Admission and pool pressure on the scheduler side: how many blocks each request may still need, how many
waiting requests may start this step, and, in budget mode ``pressure``, which running requests shrink so that
the step fits the pool.

Footprints are in blocks, from each request's ledger (:meth:`kvcompact.ledger.Ledger.peak_tokens`), and count a
block shared through the prefix cache once per holder (:meth:`Admission.duplicate_blocks`): that keeps
``admission: guaranteed`` free of preemptions and every copy on write of a step covered by a free block
(docs/DESIGN.md, sections 2.4 and 2.5; docs/usage.md, "Admission: no preemption storms"). Pressure rounds are
ordinary rounds whose ``kept_len`` is a target from :mod:`kvcompact.pressure` (section 4.7).
"""

from __future__ import annotations

import math
from typing import Any

from kvcompact.config import KVCompactConfig
from kvcompact.ledger import blocks_held
from kvcompact.pressure import SPREADS, Candidate, footprint
from kvcompact.round import Round
from kvcompact.vllm.requests import SchedulerRequest, ledger_of


class Admission:
    """Footprints and admission over one engine's running and waiting requests, reading the scheduler side's
    requests (the same dict object) and vLLM's block pool. Budget mode "pressure" sets each pressure-mode
    request's :attr:`SchedulerRequest.allowance` in every :meth:`pressure_rounds` call."""

    def __init__(self, config: KVCompactConfig, scheduler: Any, requests: dict[str, SchedulerRequest], manager: Any,
                 block_pool: Any, block_size: int) -> None:
        self.config = config
        self.scheduler = scheduler
        self.requests = requests
        self.manager = manager
        self.block_pool = block_pool
        self.block_size = block_size
        # pressure_reserve in blocks: a step counts as short while it would leave fewer free
        self.reserve = math.ceil(config.pressure_reserve * block_pool.num_gpu_blocks)


    def peak_blocks(self, request: Any) -> int:
        """The most blocks ``request`` can ever hold from now on. Uncompressed: prompt + max_tokens, plus the
        speculative tokens its last step may schedule (vLLM does not stop drafts at max_tokens) and the lookahead
        slots vLLM reserves past them for a draft model's KV (``num_lookahead_tokens``), capped by the context; a
        request that frees blocks holds at most its trigger plus those lookahead slots (:meth:`Ledger.peak_tokens`),
        in its (re-)prefill as in decode."""
        s = self.scheduler
        total = min(request.num_prompt_tokens + (request.max_tokens or 0) + s.num_spec_tokens
                    + s.num_lookahead_tokens, s.max_model_len)
        ledger = ledger_of(self.requests, request.request_id)
        peak = total if ledger is None else ledger.peak_tokens(total, s.num_lookahead_tokens)
        return blocks_held(peak, self.block_size)

    def growth(self, request: Any) -> int:
        """Blocks ``request`` may still need beyond those it holds. A pressure-mode request that grew past its floor
        footprint may, this step, need what its allowance lets it schedule (:meth:`pressure_rounds` made room)."""
        held = len(self.manager.req_to_blocks.get(request.request_id, ()))
        state = self.requests.get(request.request_id)
        if state is None or state.allowance is None:
            return self.peak_blocks(request) - held
        cache_len = state.ledger.cache_len(request.num_computed_tokens)
        return max(self.peak_blocks(request), blocks_held(cache_len + state.allowance, self.block_size)) - held

    def duplicate_blocks(self, running: list[Any]) -> int:
        """How many more blocks the running requests hold, each counting its own, than the pool holds for them:
        blocks shared through the prefix cache, once per extra holder (0 without prefix caching). Footprints count
        a request's blocks as its own, as they will be once its rounds copied the shared ones it keeps, so they are
        measured against the free blocks plus the distinct blocks held: then the pool has a free block for every
        copy a round may need before any round of the step frees its tail."""
        if not self.block_pool.enable_caching:
            return 0
        lists = [self.manager.req_to_blocks.get(r.request_id, ()) for r in running]
        return sum(map(len, lists)) - len({b.block_id for blocks in lists for b in blocks})

    def max_running(self) -> int | None:
        """Under ``admission: guaranteed``, how many requests may be running after this step's admissions: the
        waiting requests, in queue order (no overtaking), whose peak footprint fits next to the growth every
        running request may still need. None: no cap (``greedy``: vLLM decides).

        Every request fits an empty pool (vLLM refuses at start-up a context longer than the pool, and a
        prompt longer than the context with HTTP 400), so a waiting request is delayed, never starved."""
        if self.config.admission != "guaranteed":
            return None
        s = self.scheduler
        available = (self.block_pool.get_num_free_blocks() - self.duplicate_blocks(s.running)
                     - sum(max(0, self.growth(r)) for r in s.running))
        admitted = 0
        for request in s.waiting:
            need = self.growth(request)
            if need > available:
                break
            available -= need
            admitted += 1
        return len(s.running) + admitted

    def latch_pool(self) -> None:
        """Budget mode ``pool_latch``: while a running request of that mode has latched, every running one latches
        too, without a round of its own now: it is pruned as under ``fixed`` from this step on (a round this step
        if it already holds its trigger). Under ``latch`` the requests the pool's shortfall did not pick, and those
        admitted after it, keep every token and grow into the room the latched ones gave back until the next
        shortfall; here they stop at their trigger. Called before the step's fixed rounds are planned."""
        ledgers = [ledger_of(self.requests, r.request_id) for r in self.scheduler.running]
        pool = [ledger for ledger in ledgers if ledger is not None and ledger.pool_latch]
        if any(not ledger.pressure for ledger in pool):
            for ledger in pool:
                ledger.pressure = False

    def pressure_rounds(self, fixed: list[Round]) -> list[Round]:
        """Budget mode ``pressure``: the rounds that make this step fit the pool, after this step's ``fixed``
        rounds, and each pressure-mode request's allowance.

        What the step needs: every running request's footprint (a pressure-mode request: its cache plus the block
        its next token may open, at least its floor footprint; any other: its peak, as admission counts it) plus
        the waiting requests, in queue order, that a fixed budget equal to the floor would admit now (their floor
        footprint). The shortfall is reclaimed from what pressure-mode requests hold beyond their floor
        footprint (``pressure_spread``: :mod:`kvcompact.pressure`), and with ``pressure_reserve`` also what the step
        would take of the reserved share of the pool; what is left over lets their prefills grow. A
        budget mode ``latch`` request the spread picks goes to its floor, and its ledger leaves pressure mode."""
        s = self.scheduler
        for state in self.requests.values():
            state.allowance = None
        running = [(r, ledger_of(self.requests, r.request_id)) for r in s.running]
        if not any(ledger is not None and ledger.pressure for _, ledger in running):
            return []
        bs = self.block_size
        after = {r.req_id: blocks_held(r.kept_len, bs) for r in fixed}
        held = {r.request_id: after.get(r.request_id, len(self.manager.req_to_blocks.get(r.request_id, ())))
                for r, _ in running}
        total = self.block_pool.get_num_free_blocks() + sum(held.values()) - self.duplicate_blocks(s.running)
        need: dict[str, int] = {}
        floor_room = total  # what is left at every running request's floor footprint: a fixed budget's room
        candidates = []
        for request, ledger in running:
            rid, peak = request.request_id, self.peak_blocks(request)
            if ledger is not None and ledger.pressure:
                cache_len = ledger.cache_len(request.num_computed_tokens)
                need[rid] = footprint(cache_len, peak, bs)
                candidates.append(Candidate(rid, cache_len, ledger.budget, peak, compressed=ledger.evicted > 0))
                floor_room -= peak
            else:
                need[rid] = max(held[rid], peak)
                floor_room -= need[rid]
        admit, slots = 0, s.max_num_active_reqs - len(running)
        for request in s.waiting:
            growth = max(0, self.growth(request))
            if slots <= 0 or growth > floor_room:
                break
            floor_room -= growth
            admit += growth
            slots -= 1
        spread = SPREADS[self.config.pressure_spread]
        targets = spread(candidates, sum(need.values()) + admit + self.reserve - total, bs, self.config.divide_length)
        spare = total - admit - self.reserve - sum(need.values())
        due: list[Round] = []
        for request, ledger in running:
            if ledger is None or not ledger.pressure:
                continue
            rid, peak = request.request_id, self.peak_blocks(request)
            logical_len = request.num_computed_tokens
            cache_len = ledger.cache_len(logical_len)
            if rid in targets:
                # budget mode latch: the first shortfall takes the request to its floor (fixed rounds from then on)
                target = ledger.budget if ledger.latch else targets[rid]
                due.append(Round(rid, logical_len, cache_len, target, prompt_len=ledger.prompt_len, pressure=True))
                spare += need[rid] - footprint(target, peak, bs)
                cache_len = target
                need[rid] = footprint(cache_len, peak, bs)
            # Tokens this request may schedule: up to the blocks it occupies, plus spare ones for a prefill.
            wanted = blocks_held(cache_len + max(1, request.num_tokens - logical_len), bs) - need[rid]
            extra = min(max(0, spare), max(0, wanted))
            spare -= extra
            self.requests[rid].allowance = max(1, (need[rid] + extra) * bs - cache_len)
        return due


__all__ = ["Admission"]
