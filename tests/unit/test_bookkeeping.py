"""Property-based tests of the block bookkeeping: vLLM's real ``KVCacheManager``/``BlockPool`` (tiny fake KV-cache
config), kvcompact's real ``SchedulerSide`` and allocation hook, and the real planner, driven by random programs
of admit / decode / compact / preempt / resume / abort / finish with random keep sets and block sizes.

The engine around them is a miniature of vLLM's step that calls kvcompact's own scheduler hooks
(:mod:`kvcompact.vllm.scheduler_side`: ``schedule``, ``_reserve_prefill_lookahead``, the KV-cache manager's
``allocate_slots``, ``_preempt_request``, ``_free_request``, ``update_from_output``) around a small stand-in for
vLLM's own scheduling loop, so the hook order under test is the plugin's, not a copy of it: kvcompact's rounds
free tail blocks *before* vLLM allocates in the same step (so another request may receive them at once), the
worker moves survivors reading the old block table, then newly allocated blocks are zeroed, then the forward pass
writes each scheduled token at its cache slot.
A simulated paged KV store holds, per (block, KV head, offset), which request's token at which logical position
is there, so every step checks the real contents, not only the counters:

- no physical slot / block is owned by two requests; no block is both free and held; the null block is never
  handed out; reference counts are 1 for held blocks and 0 for free ones; free + held == pool size;
- every running request holds exactly ceil(cache_len / block_size) blocks, and the worker's copy of its block
  table equals the scheduler's;
- every (request, KV head) cache slot below cache_len holds exactly that request's token the keep sets say
  (per-head keep sets differ), and compaction never writes outside the request's own remaining blocks;
- preempted requests hold nothing and re-prefill compressed; finished and aborted requests leave no trace.

Programs with the recall tier (``recall_tokens`` > 0) also run the worker's real :class:`RecallTier` on a real
:class:`PagedKV` (CPU_ATTN's layout, one layer, float64) whose values carry each slot's token code and whose keys
are a fixed random vector per logical position: every round stores what it evicts, and after every forward each
decode row that is due swaps in what a random query scores highest. Then, for every running request and KV head:
the position tags are exactly what the slots hold; every evicted token is in the store or counted as dropped, never
also in the cache; the store's K, V and digests are those of the positions it names.
"""

from __future__ import annotations

import itertools
import math
from collections import Counter
from dataclasses import dataclass, field
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvcompact.config import BUDGET_MODES, PRESSURE_SPREADS, RECALL_SEARCHES, KVCompactConfig
from kvcompact.ledger import blocks_held
from kvcompact.moves import apply_plan, plan_moves
from kvcompact.recall import Recall, RecallStore
from kvcompact.vllm.hooks import frontend
from kvcompact.vllm.hooks import scheduler as hooks
from kvcompact.vllm.kv_layout import CpuAttnVecLayout
from kvcompact.vllm.metrics import Metrics
from kvcompact.vllm.paged_kv import PagedKV
from kvcompact.vllm.plugin import install_instance_hooks
from kvcompact.vllm.protocol import MESSAGE_ATTR
from kvcompact.vllm.recall_tier import LayerRecall, RecallTier
from kvcompact.vllm.requests import WorkerRequest
from kvcompact.vllm.scheduler_side import SchedulerSide
from support import FIXED

vllm_core = pytest.importorskip("vllm.v1.core.kv_cache_manager")
from vllm.sampling_params import SamplingParams  # noqa: E402
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec  # noqa: E402
from vllm.v1.request import Request, RequestStatus  # noqa: E402

EMPTY = -1
HEAD_DIM = 8  # of the recall tier's cache
GROUP = 2     # query heads per KV head
# The key of the token at each logical position (a slot's value carries the token's code).
KEYS = torch.randn(1024, HEAD_DIM, generator=torch.Generator().manual_seed(0), dtype=torch.float64)


@pytest.fixture(scope="module", autouse=True)
def _no_frontend_config():
    """SamplingParams run the front-end's override check whenever the plugin is installed (an earlier test of this
    process may have installed it). The config an earlier engine left there would judge these requests'
    overrides against its own window: set it aside (one process serves one engine in production)."""
    saved = frontend._config, frontend._max_model_len
    frontend._config = frontend._max_model_len = None
    yield
    frontend._config, frontend._max_model_len = saved


def encode(uid: int, position: int) -> int:
    return uid * 1_000_000 + position


@dataclass
class FakeScheduler:
    """What SchedulerSide reads from vLLM's Scheduler."""

    kv_cache_manager: object
    max_model_len: int
    running: list = field(default_factory=list)
    waiting: list = field(default_factory=list)   # budget mode "pressure" counts the queue's floor footprints
    max_num_active_reqs: int = 6
    num_spec_tokens: int = 0  # no speculative decoding
    num_lookahead_tokens: int = 0  # no draft model
    kvcompact: SchedulerSide | None = None


@dataclass
class _Tables:
    """What PagedKV reads of vLLM's runner.requests: each request's block table (the worker's copy)."""

    tables: dict[str, list[int]]

    def __contains__(self, req_id: object) -> bool:
        return req_id in self.tables

    def __getitem__(self, req_id: str) -> SimpleNamespace:
        return SimpleNamespace(block_ids=[self.tables[req_id]])


class RecallWorker:
    """The worker's recall tier (the real :class:`RecallTier`) over a real :class:`PagedKV` whose cache mirrors the
    simulated store: a slot's V carries its token's code, its K the key of the token's position. The cache is
    made from the store before the tier reads and read back into it after the tier wrote."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.layout = CpuAttnVecLayout(engine.bs, engine.heads, HEAD_DIM)
        self.cache = torch.zeros(self.layout.shape(engine.num_blocks), dtype=torch.float64)
        runner = SimpleNamespace(kv_caches=[self.cache], requests=_Tables(engine.table))
        self.tier = RecallTier(engine.config, PagedKV(runner, self.layout, lambda layer, keys: keys.float()),
                               self.positions)
        self.tier.listeners.append(self._recalled)
        self.requests: dict[str, WorkerRequest] = {}
        self.layer = LayerRecall(self.tier, self.requests) if engine.config.recall_at == "layer" else None

    def positions(self, req_id: str, logical_len: int, cache_len: int) -> torch.Tensor:
        return self.requests[req_id].positions(logical_len, cache_len, 1, self.engine.heads, self.cache.device)

    def materialize(self) -> None:
        k, v = self.layout.views(self.cache)                      # [blocks, block_size, H, d]
        codes = torch.from_numpy(self.engine.store).permute(0, 2, 1)
        k.copy_(self._keys(codes))
        v.zero_()
        v[..., 0] = codes.double()

    def read_back(self) -> None:
        k, v = self.layout.views(self.cache)
        codes = v[..., 0].round().long()
        assert torch.equal(k, self._keys(codes)), "a slot's key is not its token's"
        self.engine.store[:] = codes.permute(0, 2, 1).numpy()

    @staticmethod
    def _keys(codes: torch.Tensor) -> torch.Tensor:
        live = codes >= 0
        return torch.where(live.unsqueeze(-1), KEYS[torch.where(live, codes % 1_000_000, 0)], 0.0)

    def round(self, cmd, table: list[int], keep: torch.Tensor, move) -> None:
        """What the worker's round does for the tier, before the moves: the evicted slots to the store (read from
        the cache as it was made before the step's rounds), then the tags moved with the plan."""
        state = self.requests.setdefault(cmd.req_id, WorkerRequest())
        positions = self.positions(cmd.req_id, cmd.logical_len, cmd.cache_len)
        self.engine.counts["store_dropped"] += self.tier.store_evicted(state, torch.as_tensor(table), keep, positions)
        state.tags = apply_plan(positions, move)
        state.prompt_len = cmd.prompt_len

    def after_forward(self, scheduled: dict[str, int]) -> None:
        """recall_at step: every decode row that is due swaps in what a random query of it attends to."""
        e = self.engine
        due = [(r.request_id, r.num_computed_tokens + 1) for r in e.sched.running
               if scheduled.get(r.request_id) == 1
               and self.tier.due(r.request_id, self.requests.get(r.request_id), r.num_computed_tokens + 1)]
        if not due:
            return
        self.materialize()
        for rid, logical in due:
            point = self.tier.point(rid, self.requests[rid], logical, logical - e.side.requests[rid].ledger.evicted)
            if point is None:
                continue
            query = torch.from_numpy(e.rng.standard_normal((1, e.heads * GROUP, HEAD_DIM))).float()
            self.tier.swap(point, query, 0)
            e.counts["recalled"] += self.tier.finish(point, in_forward=False)
        self.read_back()

    def in_forward(self, scheduled: dict[str, int], evicted: dict[str, int]) -> None:
        """recall_at layer: before the forward writes its tokens, every due decode row swaps in what a random query
        of it attends to, all of them in one decision (:class:`LayerRecall`, as in each layer of the forward)."""
        e, rows = self.engine, 0
        segments = []
        for r in e.sched.running:
            if r.request_id in scheduled:
                segments.append(SimpleNamespace(req_id=r.request_id, first=rows, count=scheduled[r.request_id],
                                                logical_len=r.num_computed_tokens,
                                                cache_start=r.num_computed_tokens - evicted.get(r.request_id, 0)))
                rows += scheduled[r.request_id]
        work = self.layer.begin_forward(segments)
        if work is not None:
            self.materialize()
            work(0, torch.from_numpy(e.rng.standard_normal((rows, e.heads * GROUP, HEAD_DIM))).float())
            self.read_back()
        count, failed = self.layer.end_forward()
        assert not failed, failed
        e.counts["recalled"] += count

    def _recalled(self, recall: Recall) -> None:
        """The test's own account of the cache follows what the recall says it did."""
        want = self.engine.expected[recall.req_id]
        for h, m in torch.nonzero(recall.swapped[0]).tolist():
            want[h][int(recall.slots[0, h, m])] = int(recall.positions[0, h, m])

    def check(self, request: Request, cache_len: int, evicted: int) -> None:
        """Tags are what the slots hold; every evicted token is in the store or dropped, never also in the cache;
        the store's K, V and page digests (under ``recall_search`` quest) are those of the positions it names."""
        rid = request.request_id
        e = self.engine
        want = e.expected[rid]
        assert self.positions(rid, request.num_computed_tokens, cache_len)[0].tolist() == want, \
            f"position tags of {rid} differ from what its slots hold"
        store = self.requests[rid].store
        if store is None:
            assert evicted == 0, "a round evicted without storing"
            return
        assert store.size + store.dropped == evicted, "an evicted token is neither stored nor counted dropped"
        held = store.positions[0]
        for h in range(e.heads):
            stored = held[h].tolist()
            assert len(set(stored)) == len(stored) and not set(stored) & set(want[h]), \
                f"a token of {rid} is held twice (store and cache)"
        assert torch.equal(store.values[0, :, :, 0], (e.uid[rid] * 1_000_000 + held).double()), \
            "the store's values are not its positions' tokens"
        assert torch.equal(store.keys[0], KEYS[held]), "the store's keys are not its positions' keys"
        if store.digests:  # recall_search quest; exact keeps none (an empty digest)
            mins, maxs = RecallStore._digest(store.read_keys())
            assert torch.equal(store.mins, mins) and torch.equal(store.maxs, maxs), "a page digest is stale"
        else:
            assert store.mins.shape[2] == store.maxs.shape[2] == 0, "a store without digests holds some"


class Engine:
    def __init__(self, config: KVCompactConfig, block_size: int, num_blocks: int, heads: int, max_model_len: int,
                 rng: np.random.Generator) -> None:
        spec = FullAttentionSpec(block_size=block_size, num_kv_heads=heads, head_size=8, dtype=torch.float32)
        kv_config = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[],
                                  kv_cache_groups=[KVCacheGroupSpec(["layer.0"], spec)])
        self.kvm = vllm_core.KVCacheManager(kv_config, max_model_len=max_model_len, scheduler_block_size=block_size,
                                            hash_block_size=block_size, enable_caching=False)
        self.sched = FakeScheduler(self.kvm, max_model_len)
        metrics = Metrics(config, False, "bookkeeping", engine=0, block_size=block_size)
        self.side = self.sched.kvcompact = SchedulerSide(config, self.sched, metrics)
        install_instance_hooks(self.sched, self.side)  # allocate_slots follows the cache length
        self.config = config
        self.bs = block_size
        self.heads = heads
        self.num_blocks = num_blocks
        self.rng = rng
        self.store = np.full((num_blocks, heads, block_size), EMPTY, dtype=np.int64)
        self.waiting: list[Request] = self.sched.waiting
        self.table: dict[str, list[int]] = {}          # the worker's copy of each request's block table
        self.expected: dict[str, list[list[int]]] = {}  # per request, per KV head: position held by each slot
        self.uid: dict[str, int] = {}
        self.finished: set[str] = set()
        self.counts = {"rounds": 0, "preemptions": 0, "freed": 0, "aborted_in_flight": 0, "resumed": 0,
                       "round_then_preempted": 0, "pressure_preempted": 0, "recalled": 0, "store_dropped": 0,
                       "preempted_with_store": 0, "latched_fixed_rounds": 0, "grown_rounds": 0}
        self._ids = itertools.count()
        self.token = lambda n: 7  # the n-th output token a request samples
        self.recall = RecallWorker(self) if config.recall_tokens else None

    # -- requests ------------------------------------------------------------------------------------------
    def add(self, prompt_len: int, max_tokens: int, budget: int | None, off: bool) -> None:
        extra = {}
        if budget is not None:
            extra["kvcompact_budget"] = budget
        if off:
            extra["kvcompact"] = "off"
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, extra_args=extra or None)
        n = next(self._ids)
        request = Request(f"r{n}", list(range(1, prompt_len + 1)), params, None)
        self.uid[request.request_id] = n + 1
        hooks.add_request(lambda _, r: self.waiting.append(r), self.sched, request)

    def _all(self) -> list[Request]:
        return self.sched.running + self.waiting

    def abort(self, request: Request) -> None:
        """What Scheduler.finish_requests does (kvcompact's _free_request hook runs first)."""
        request.status = RequestStatus.FINISHED_ABORTED
        if request in self.sched.running:
            self.sched.running.remove(request)
        if request in self.waiting:
            self.waiting.remove(request)
        self._free(request)

    def _free(self, request: Request) -> None:
        hooks.free_request(lambda _, r: self.kvm.free(r), self.sched, request)
        self.finished.add(request.request_id)
        self.table.pop(request.request_id, None)   # the worker drops it at the next step (finished_req_ids)
        self.expected.pop(request.request_id, None)
        if self.recall is not None:
            self.recall.requests.pop(request.request_id, None)

    def _preempt(self, request: Request) -> None:
        """Scheduler._preempt_request, through kvcompact's hook."""
        def vllm_preempt(_, r: Request) -> None:
            self.kvm.free(r)
            r.status = RequestStatus.PREEMPTED
            r.num_computed_tokens = 0
            self.waiting.insert(0, r)

        ledger = self.side.ledger(request.request_id)
        state = None if self.recall is None else self.recall.requests.get(request.request_id)
        self.counts["preempted_with_store"] += bool(state is not None and state.store is not None)
        hooks.preempt_request(vllm_preempt, self.sched, request)
        self.counts["preemptions"] += 1
        self.counts["pressure_preempted"] += bool(ledger and ledger.pressure)

    # -- one engine step -------------------------------------------------------------------------------------
    def step(self, abort_in_flight: bool = False) -> None:
        scheduled: dict[str, int] = {}
        new_blocks: dict[str, list[int]] = {}
        resumed: set[str] = set()
        output = hooks.schedule(lambda _: self._vllm_schedule(scheduled, new_blocks, resumed), self.sched)
        plan = getattr(output, MESSAGE_ATTR)
        self.counts["rounds"] += len(plan.rounds)
        self.counts["latched_fixed_rounds"] += sum(
            1 for r in plan.rounds if not r.pressure and self.side.requests[r.req_id].ledger.latch)
        self.counts["grown_rounds"] += sum(1 for r in plan.rounds if self.side.requests[r.req_id].ledger.grown)
        self._check_pool()
        self._run_step(plan, scheduled, new_blocks, resumed, abort_in_flight)
        # update_from_output: advance, sample, finish.
        hooks.update_from_output(lambda *_: self._advance(scheduled), self.sched, output, None)
        self.check()

    def _vllm_schedule(self, scheduled: dict[str, int], new_blocks: dict[str, list[int]],
                       resumed: set[str]) -> object:
        """vLLM's scheduling loop in miniature: running requests first (preempting from the back when the pool is
        short), then waiting ones while nothing was preempted."""
        kvm = self.kvm
        preempted = False
        i = 0
        while i < len(self.sched.running):
            request = self.sched.running[i]
            num_new = self._num_new(request)
            while True:
                blocks = kvm.allocate_slots(request, num_new)
                if blocks is not None:
                    break
                victim = self.sched.running.pop()
                self._preempt(victim)
                preempted = True
                scheduled.pop(victim.request_id, None)
                new_blocks.pop(victim.request_id, None)
                if victim is request:
                    break
            if blocks is None:
                break
            scheduled[request.request_id] = num_new
            new_blocks[request.request_id] = blocks.get_block_ids()[0]
            i += 1
        if not preempted:
            while self.waiting and len(self.sched.running) < self.sched.max_num_active_reqs:
                request = self.waiting[0]
                num_new = self._num_new(request)
                blocks = kvm.allocate_slots(request, num_new)
                if blocks is None:
                    break
                self.waiting.pop(0)
                if request.status == RequestStatus.PREEMPTED:
                    self.counts["resumed"] += 1
                request.status = RequestStatus.RUNNING
                self.sched.running.append(request)
                scheduled[request.request_id] = num_new
                new_blocks[request.request_id] = blocks.get_block_ids()[0]
                resumed.add(request.request_id)
        return SimpleNamespace()

    def _run_step(self, plan, scheduled: dict[str, int], new_blocks: dict[str, list[int]], resumed: set[str],
                  abort_in_flight: bool) -> None:
        """The worker's step and the forward pass."""
        # Worker, start_step: the rounds, on the block tables as they were (freed tails are still readable:
        # nothing has been zeroed or written yet in this step).
        fresh = {b for blocks in new_blocks.values() for b in blocks}
        if self.recall is not None and plan.rounds:
            self.recall.materialize()
        for cmd in plan.rounds:
            self._compact(cmd, fresh)
        # _update_states: zero every newly allocated block, then extend / replace the tables.
        for blocks in new_blocks.values():
            self.store[blocks] = EMPTY
        for rid, blocks in new_blocks.items():
            if rid in resumed:
                self.table[rid] = list(blocks)
                self.expected[rid] = [[] for _ in range(self.heads)]
                if self.recall is not None:  # a new cache (first prefill, or re-prefill): what was stored is gone
                    self.recall.requests[rid] = WorkerRequest()
            else:
                self.table[rid].extend(blocks)
        if self.recall is not None and self.recall.layer is not None:
            self.recall.in_forward(scheduled, plan.evicted)
        # Forward pass: write every scheduled token at its cache slot, through the worker's table.
        for request in self.sched.running:
            rid = request.request_id
            if rid not in scheduled:
                continue
            assert self.table[rid] == self._held(rid), f"worker and scheduler block tables differ for {rid}"
            evicted = plan.evicted.get(rid, 0)
            assert evicted == self.side.requests[rid].ledger.evicted
            for pos in range(request.num_computed_tokens, request.num_computed_tokens + scheduled[rid]):
                slot = pos - evicted
                block = self.table[rid][slot // self.bs]
                self.store[block, :, slot % self.bs] = encode(self.uid[rid], pos)
                for h in range(self.heads):
                    assert len(self.expected[rid][h]) == slot
                    self.expected[rid][h].append(pos)
        if self.recall is not None and self.recall.layer is None:
            self.recall.after_forward(scheduled)
        if abort_in_flight and plan.rounds:
            # An abort processed while the step runs (EngineCore._process_aborts_queue, before
            # update_from_output): the request whose round is in flight goes away.
            victim = next((r for r in self._all() if r.request_id == plan.rounds[0].req_id), None)
            if victim is not None:
                self.abort(victim)
                scheduled.pop(victim.request_id, None)
                self.counts["aborted_in_flight"] += 1

    def _advance(self, scheduled: dict[str, int]) -> dict:
        """vLLM's update_from_output: advance, sample, finish."""
        for request in list(self.sched.running):
            n = scheduled.get(request.request_id)
            if n is None:
                continue
            request.num_computed_tokens += n
            if request.num_computed_tokens == request.num_tokens:
                request.append_output_token_ids(self.token(request.num_output_tokens))
                if request.num_output_tokens >= request.max_tokens:
                    request.status = RequestStatus.FINISHED_LENGTH_CAPPED
                    self.sched.running.remove(request)
                    self._free(request)
        return {}

    def _num_new(self, request) -> int:
        """vLLM's tokens to schedule, through kvcompact's hook on ``Scheduler._reserve_prefill_lookahead``, which
        cuts them where the cache reaches the trigger: a (re-)prefill is compressed chunk by chunk."""
        return hooks.reserve_prefill_lookahead(lambda _, r, c, n: n, self.sched, request, request.num_computed_tokens,
                                               request.num_tokens - request.num_computed_tokens)

    def _held(self, rid: str) -> list[int]:
        return [b.block_id for b in self.side.manager.req_to_blocks.get(rid, [])]

    def _compact(self, cmd, fresh: set[int]) -> None:
        """The worker's round for one request, with a random per-KV-head keep set of exactly kept_len slots."""
        rid = cmd.req_id
        table = self.table[rid]
        held_after = set(self._held(rid))   # the scheduler already truncated (and may have preempted/aborted)
        N, K = cmd.cache_len, cmd.kept_len
        assert len(table) >= blocks_held(N, self.bs)
        keep = torch.zeros(1, self.heads, N, dtype=torch.bool)
        for h in range(self.heads):
            keep[0, h, torch.from_numpy(self.rng.choice(N, size=K, replace=False))] = True
        move = plan_moves(keep, self.config.compaction)
        if self.recall is not None and rid in self.expected:
            self.recall.round(cmd, table, keep, move)
        bt = np.asarray(table)
        phys_block = lambda s: bt[s // self.bs]  # noqa: E731
        src, dst, valid = move.src[0].numpy(), move.dst[0].numpy(), move.valid[0].numpy()
        for h in range(self.heads):
            gathered = [self.store[phys_block(s), h, s % self.bs] for s in src[h]]
            for s, d, ok, value in zip(src[h], dst[h], valid[h], gathered):
                if not ok:  # padding: a self-copy (a no-op, even in a block already handed to another request)
                    assert s == d
                    continue
                assert d < K, "a move writes past the kept length"
                if rid in self._running_ids():
                    assert phys_block(d) in held_after, "compaction writes into a block the request gave back"
                else:  # preempted in this very step: only blocks nobody holds yet, or that are zeroed next
                    self.counts["round_then_preempted"] += 1
                    owner = {b.block_id for bl in self.side.manager.req_to_blocks.values() for b in bl}
                    assert phys_block(d) not in owner or phys_block(d) in fresh, "compaction corrupts a block"
                self.store[phys_block(d), h, d % self.bs] = value
            if rid in self.expected:
                old = self.expected[rid][h]
                assert len(old) == N
                new = list(old)
                for s, d, ok in zip(src[h], dst[h], valid[h]):
                    if ok:
                        new[d] = old[s]
                new = new[:K]
                kept = sorted(old[s] for s in np.flatnonzero(keep[0, h].numpy()))
                assert sorted(new) == kept, "keep set not honoured"
                self.expected[rid][h] = new
        if rid in self._running_ids():
            del table[blocks_held(K, self.bs):]
        self.counts["freed"] = self.side.metrics.totals.blocks_freed

    def _running_ids(self) -> set[str]:
        return {r.request_id for r in self.sched.running}

    # -- invariants --------------------------------------------------------------------------------------------
    def _check_pool(self) -> None:
        pool = self.kvm.block_pool
        free = [b.block_id for b in pool.free_block_queue.get_all_free_blocks()]
        assert len(free) == len(set(free)) == pool.get_num_free_blocks(), "free queue corrupt"
        owners: dict[int, str] = {}
        for rid, blocks in self.side.manager.req_to_blocks.items():
            for b in blocks:
                assert b.block_id != 0 and not b.is_null, "the null block was handed out"
                assert b.block_id not in owners, f"block {b.block_id} owned by {owners.get(b.block_id)} and {rid}"
                owners[b.block_id] = rid
        assert not set(free) & set(owners), "a block is both free and held"
        for b in pool.blocks[1:]:
            assert b.ref_cnt == (1 if b.block_id in owners else 0), (b.block_id, b.ref_cnt)
        assert len(free) + len(owners) == self.num_blocks - 1, "a block leaked"

    def check(self) -> None:
        self._check_pool()
        side = self.side
        live = {r.request_id for r in self._all()}
        assert set(side.requests) == live, "scheduler side state for a request that is gone (or missing)"
        for request in self.waiting:
            assert not self._held(request.request_id), "a waiting/preempted request holds blocks"
            assert side.requests[request.request_id].ledger.evicted == 0
        for request in self.sched.running:
            rid = request.request_id
            state = side.requests[rid].ledger
            cache_len = request.num_computed_tokens - state.evicted
            held = self._held(rid)
            assert len(held) == math.ceil(cache_len / self.bs), (rid, len(held), cache_len)
            assert self.table[rid] == held
            for h in range(self.heads):
                want = self.expected[rid][h]
                assert len(want) == cache_len
                assert len(set(want)) == cache_len, "a token is held twice"
                got = [self.store[held[s // self.bs], h, s % self.bs] for s in range(cache_len)]
                assert got == [encode(self.uid[rid], p) for p in want], f"cache contents of {rid} head {h}"
                if self.config.compaction == "repack" and self.recall is None:  # a recall puts old tokens anywhere
                    assert want == sorted(want), "repack must preserve order"
            if self.recall is not None:
                self.recall.check(request, cache_len, state.evicted)


@st.composite
def programs(draw):
    block_size = draw(st.sampled_from([1, 2, 3, 4, 8, 16]))
    heads = draw(st.integers(1, 3))
    window = draw(st.integers(0, 6))
    budget = draw(st.integers(window + 1, window + 40))
    divide = draw(st.integers(1, 24))
    compaction = draw(st.sampled_from(["repack", "holefill"]))
    budget_mode = draw(st.sampled_from(BUDGET_MODES))
    # A fixed budget under vLLM's own admission, which preempts when the pool runs short; the pressure modes under
    # guaranteed admission (which never preempts) or vLLM's own (which preempts once the floors no longer fit).
    admission = draw(st.sampled_from(["guaranteed", "greedy"])) if budget_mode != "fixed" else "greedy"
    spread = draw(st.sampled_from(PRESSURE_SPREADS))
    # A budget that grows with the answer (budget_ratio; vLLM's own admission only), often or not at all.
    ratio = draw(st.sampled_from([0.0, 0.0, 0.5, 0.9])) if admission == "greedy" else 0.0
    max_model_len = draw(st.integers(budget + divide + 1, budget + divide + 120))
    # Enough blocks for one request at max_model_len (vLLM refuses smaller pools), sometimes barely.
    num_blocks = blocks_held(max_model_len, block_size) + 1 + draw(st.integers(0, 6))
    # The recall tier: a store that drops pages for good (8, 48) or never (4096), a decision every row or less
    # often, over one page or more (or every entry scored, recall_search exact), swapping only what beats the kept
    # tokens' best (margin 0) or any weaker one.
    # Decided after the forward (step) or inside it, one decision for every due row (layer); with or without the
    # following positions recalled too (recall_span).
    recall = dict(recall_tokens=draw(st.sampled_from([0, 0, 8, 48, 4096])), recall_interval=draw(st.integers(1, 3)),
                  recall_pages=draw(st.integers(1, 4)), recall_margin=draw(st.sampled_from([0.0, 1e6])),
                  recall_span=draw(st.sampled_from([0, 0, 3])), recall_search=draw(st.sampled_from(RECALL_SEARCHES)))
    if not recall["recall_tokens"]:
        recall.update(recall_span=0, recall_search="quest")
    if recall["recall_tokens"] and draw(st.booleans()):
        recall.update(recall_at="layer", selection="per_layer_per_head")
    # A reserved share of the pool in the shrinking modes (pressure_reserve), often or not at all.
    reserve = draw(st.sampled_from([0.0, 0.0, 0.3])) if budget_mode != "fixed" else 0.0
    config = KVCompactConfig(policy="streaming", budget=budget, divide_length=divide, window=window, n_sink=0,
                             compaction=compaction, budget_mode=budget_mode, admission=admission,
                             pressure_spread=spread, protect_prompt=False, budget_ratio=ratio,
                             pressure_reserve=reserve, **recall)
    add = st.tuples(st.just("add"), st.integers(1, max_model_len - 1), st.integers(1, 120),
                    st.one_of(st.none(), st.integers(window + 1, budget + 30)), st.booleans())
    actions = draw(st.lists(st.one_of(
        add, add, st.lists(add, min_size=2, max_size=6).map(lambda adds: ("burst", adds)),
        st.tuples(st.just("step"), st.integers(1, 6), st.booleans()),
        st.tuples(st.just("abort"), st.integers(0, 20)),
    ), min_size=1, max_size=25))
    return config, block_size, heads, max_model_len, num_blocks, actions


def run_program(program, seed: int) -> Engine:
    config, block_size, heads, max_model_len, num_blocks, actions = program
    engine = Engine(config, block_size, num_blocks, heads, max_model_len, np.random.default_rng(seed))
    for action in actions:
        for add in ([action] if action[0] == "add" else action[1] if action[0] == "burst" else []):
            _, prompt_len, max_tokens, budget, off = add
            max_tokens = min(max_tokens, max_model_len - prompt_len)
            engine.add(prompt_len, max_tokens, budget, off and budget is None)
        if action[0] in ("add", "burst"):
            continue
        if action[0] == "step":
            for _ in range(action[1]):
                engine.step(abort_in_flight=action[2])
        else:
            live = engine._all()
            if live:
                engine.abort(live[action[1] % len(live)])
    # Drain: every request finishes and the pool is entirely free.
    for _ in range(20_000):
        if not engine._all():
            break
        engine.step()
    assert not engine._all(), "requests never finished"
    assert engine.kvm.block_pool.get_num_free_blocks() == num_blocks - 1
    assert not engine.side.requests and not engine.side.manager.req_to_blocks
    engine.counts["pressure_rounds"] = engine.side.metrics.totals.pressure_rounds
    return engine


PROGRAMS = settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@PROGRAMS
@given(program=programs(), seed=st.integers(0, 2**32 - 1))
def test_random_programs_keep_blocks_and_slots_consistent(program, seed):
    run_program(program, seed)


def test_programs_exercised_preemption_rounds_and_aborts():
    """Random programs really reach the interesting paths. This test runs its own 120 programs, the same ones
    every run (derandomized: the property test above draws new ones each time), and counts what they did."""
    totals: Counter[str] = Counter()

    @settings(PROGRAMS, derandomize=True, database=None)
    @given(program=programs(), seed=st.integers(0, 2**32 - 1))
    def count(program, seed):
        totals.update(run_program(program, seed).counts)

    count()
    print("bookkeeping totals:", dict(totals))
    assert totals["rounds"] > 100 and totals["freed"] > 50
    # Aborts during a round are rarer in random programs (5 in 373 preemptions seen): require them reached.
    assert totals["preemptions"] > 5 and totals["resumed"] > 5 and totals["aborted_in_flight"] >= 1, totals
    assert totals["pressure_rounds"] > 20, totals  # budget mode "pressure" shrank requests to chosen targets
    assert totals["pressure_preempted"] >= 1, totals  # ... and, under greedy admission, was preempted and resumed
    # budget mode latch: requests the pool shrank once went on with fixed rounds
    assert totals["latched_fixed_rounds"] > 10, totals
    assert totals["grown_rounds"] > 10, totals  # rounds of requests whose budget budget_ratio had grown
    # The recall tier swapped tokens in, dropped stored ones past its limit, and was preempted holding a store.
    assert totals["recalled"] > 100 and totals["store_dropped"] > 0 and totals["preempted_with_store"] > 0, totals


def test_preempted_compressed_request_resumes_compressed():
    """A fixed program: one compressed request is preempted after rounds; its re-prefill of the whole logical
    sequence is cut at the trigger (12 tokens) and compressed chunk by chunk, never holding more than 3 blocks."""
    config = KVCompactConfig(**FIXED, policy="streaming", budget=8, divide_length=4, window=2, n_sink=0)
    engine = Engine(config, block_size=4, num_blocks=12, heads=2, max_model_len=40, rng=np.random.default_rng(0))
    engine.add(prompt_len=6, max_tokens=30, budget=None, off=False)
    for _ in range(12):
        engine.step()
    request = engine.sched.running[0]
    state = engine.side.requests[request.request_id].ledger
    assert state.rounds >= 2 and state.evicted > 0
    logical = request.num_tokens
    assert logical > 12
    engine.sched.running.remove(request)
    engine._preempt(request)
    assert state.evicted == 0 and not engine._held(request.request_id)
    rounds_before = state.rounds
    while request.num_computed_tokens < logical:   # the re-prefill, one chunk per step
        engine.step()
        assert request.status == RequestStatus.RUNNING
        assert len(engine._held(request.request_id)) <= math.ceil((8 + 4) / 4)
    assert state.rounds - rounds_before >= 2 and state.evicted > 0  # rounds inside the re-prefill


def test_negative_control_freeing_too_much_is_caught():
    """The checker catches a scheduler side that frees one block too many (the worker then writes into a
    block that another request may own)."""
    config = KVCompactConfig(**FIXED, policy="streaming", budget=8, divide_length=4, window=2, n_sink=0)
    engine = Engine(config, block_size=4, num_blocks=12, heads=2, max_model_len=40, rng=np.random.default_rng(0))
    original = engine.side._round

    def greedy_round(due, copies):
        cmd = original(due, copies)
        blocks = engine.side.manager.req_to_blocks[due.req_id]
        engine.side.block_pool.free_blocks([blocks.pop()])
        return cmd

    engine.side._round = greedy_round
    engine.add(prompt_len=6, max_tokens=30, budget=None, off=False)
    with pytest.raises(AssertionError):
        for _ in range(30):
            engine.step()


def test_round_and_preemption_of_the_same_request_in_one_step():
    """The sharpest interleaving: a request's round frees its tail in schedule_rounds, then the same schedule()
    preempts it (all its blocks free, some handed to others at once) while the worker still runs its round.
    Random tight pools until it happens; every invariant is checked at every step on the way."""
    hits = 0
    for seed in range(400):
        rng = np.random.default_rng(seed)
        bs = int(rng.choice([2, 4]))
        config = KVCompactConfig(**FIXED, policy="streaming", budget=8, divide_length=4, window=2, n_sink=0,
                                 compaction=str(rng.choice(["repack", "holefill"])), admission="greedy")
        engine = Engine(config, block_size=bs, num_blocks=blocks_held(40, bs) + 1 + int(rng.integers(0, 3)),
                        heads=2, max_model_len=40, rng=rng)
        for _ in range(int(rng.integers(3, 6))):
            engine.add(prompt_len=int(rng.integers(1, 14)), max_tokens=int(rng.integers(10, 26)), budget=None,
                       off=bool(rng.random() < 0.2))
        while engine._all():
            engine.step()
        hits += engine.counts["round_then_preempted"] > 0
        if hits >= 3:
            break
    assert hits >= 3


def test_a_round_that_cannot_copy_a_shared_block_waits_and_is_counted():
    """A due round whose kept block another request also holds must first copy that block into a free one; with
    no free block it waits for a later step, and kvcompact:deferred_rounds_total counts every such wait.
    Control: with one free block the round runs and the count stays."""
    config = KVCompactConfig(**FIXED, policy="streaming", budget=8, divide_length=4, window=2, n_sink=0)
    engine = Engine(config, block_size=4, num_blocks=12, heads=1, max_model_len=40, rng=np.random.default_rng(0))
    engine.add(prompt_len=12, max_tokens=8, budget=None, off=False)
    engine.step()  # the prefill stops at the trigger, budget + divide_length = 12 tokens: a round is due
    side, pool = engine.side, engine.kvm.block_pool
    pool.touch(side.manager.req_to_blocks["r0"][:1])  # another request holds the first kept block too
    taken = pool.get_new_blocks(pool.get_num_free_blocks())
    assert side.schedule_rounds() == [] and side.schedule_rounds() == []
    assert side.metrics.totals.deferred_rounds == 2
    pool.free_blocks(taken[:1])
    [command] = side.schedule_rounds()
    assert command.copies and side.metrics.totals.deferred_rounds == 2


def test_a_compressed_request_that_finishes_in_a_loop_is_counted():
    """kvcompact:looping_requests counts a request that ran rounds and whose output ends in a loop; the same
    output from an uncompressed request is the model's own (not counted), and a compressed output that never
    repeats is not counted (controls)."""
    config = KVCompactConfig(**FIXED, policy="streaming", budget=8, divide_length=4, window=2, n_sink=0)

    def finish(off: bool, token, budget: int | None = None) -> tuple[int, int]:
        engine = Engine(config, block_size=4, num_blocks=40, heads=1, max_model_len=120, rng=np.random.default_rng(0))
        engine.token = token
        engine.add(prompt_len=6, max_tokens=100, budget=budget, off=off)
        while engine._all():
            engine.step()
        return engine.counts["rounds"], engine.side.metrics.totals.looping_requests

    rounds, looping = finish(False, lambda n: n % 5)  # five tokens over and over
    assert rounds > 3 and looping == 1
    assert finish(False, lambda n: n) == (rounds, 0)  # control: an output that never repeats
    assert finish(True, lambda n: n % 5) == (0, 0)  # control: compression off, the loop is the model's own
    assert finish(False, lambda n: n % 5, budget=110) == (0, 0)  # control: on, but 106 tokens never reach a round


def _four_answers(mode: str, reserve: float = 0.0, num_blocks: int = 16) -> Engine:
    """Four requests (6-token prompts, 50 tokens each, 14 blocks of 4 at full length; trigger footprint 3 blocks) in
    budget mode ``mode`` under vLLM's own admission, added and not yet stepped."""
    config = KVCompactConfig(policy="streaming", budget=8, divide_length=4, window=2, n_sink=0, budget_mode=mode,
                             admission="greedy", protect_prompt=False, pressure_reserve=reserve)
    engine = Engine(config, block_size=4, num_blocks=num_blocks, heads=1, max_model_len=60,
                    rng=np.random.default_rng(0))
    for _ in range(4):
        engine.add(prompt_len=6, max_tokens=50, budget=None, off=False)
    return engine


def _grown_past_the_trigger(mode: str) -> tuple[int, list[str]]:
    """The four answers in budget mode ``mode`` on a pool that holds fewer than their trigger footprints: the steps
    at which some request had latched, and the requests that then held more blocks than their trigger's (each at
    the end of a step that began with a latched request running)."""
    engine = _four_answers(mode)
    latched_steps, grown = 0, []
    while engine._all():
        ledgers = {r.request_id: engine.side.ledger(r.request_id) for r in engine.sched.running}
        latched = any(ledger.latch and not ledger.pressure for ledger in ledgers.values())
        engine.step()
        if latched:
            latched_steps += 1
            grown += [rid for rid, ledger in ledgers.items() if ledger.latch and rid in engine.side.requests
                      and len(engine._held(rid)) > blocks_held(ledger.trigger, engine.bs)]
    return latched_steps, grown


def test_pool_latch_holds_every_running_request_at_its_trigger_while_one_is_latched():
    """Budget mode pool_latch: from the step after a request first latched, while a latched request runs, no running
    request holds more blocks than its trigger (budget + divide_length) needs. Control: under latch the requests
    the shortfall did not pick go on growing past their trigger into the room the latched one gave back."""
    steps, grown = _grown_past_the_trigger("pool_latch")
    assert steps > 10 and grown == []
    steps, grown = _grown_past_the_trigger("latch")
    assert steps > 10 and grown


def _peaks_past_the_trigger(reserve: float) -> tuple[int, dict[str, int]]:
    """The four answers in budget mode latch on a pool of 16 blocks, which holds their four trigger footprints
    (3 blocks each) with 4 to spare: the rounds, and per request the most blocks it held beyond its trigger's while
    it had not latched."""
    engine = _four_answers("latch", reserve)
    past: dict[str, int] = {}
    while engine._all():
        engine.step()
        for request in engine.sched.running:
            ledger = engine.side.ledger(request.request_id)
            if ledger.pressure:
                over = len(engine._held(request.request_id)) - blocks_held(ledger.trigger, engine.bs)
                past[request.request_id] = max(past.get(request.request_id, 0), over)
    return engine.counts["rounds"], past


def test_pressure_reserve_latches_requests_at_their_trigger():
    """pressure_reserve 0.25 (4 of 16 blocks) under budget mode latch: no request that has not latched holds a
    block beyond its trigger's (budget + divide_length), because from there a step that leaves fewer than 4 free
    blocks counts as short and latches it. Control: without the reserve the same load grows requests past their
    trigger into the pool's spare blocks before the pool first runs short."""
    rounds, past = _peaks_past_the_trigger(0.25)
    assert rounds > 10 and len(past) == 4 and max(past.values()) <= 0, past
    rounds, past = _peaks_past_the_trigger(0.0)
    assert rounds > 10 and max(past.values()) > 0, past


def test_a_pool_that_keeps_its_reserve_runs_no_round():
    """The large-pool side of pressure_reserve: where the requests' whole answers leave more than the reserve free,
    no round runs and nothing is evicted, as without it. Control: the same requests in a pool that cannot keep the
    reserve free run rounds."""
    def rounds(num_blocks: int) -> int:
        engine = _four_answers("latch", 0.25, num_blocks)
        while engine._all():
            engine.step()
        return engine.counts["rounds"]

    assert rounds(4 * 14 * 2) == 0  # 4 answers of 56 tokens (14 blocks each) fill under half of it
    assert rounds(4 * 14 + 4) > 0    # control: they fit it whole, but not with a quarter of it free


def run_recall_program(compaction: str, recall_at: str = "step", recall_span: int = 0) -> Engine:
    """Three compressed requests with a store that drops pages and a margin that lets most decisions swap; after 20
    steps the first is preempted holding a store (as vLLM's scheduler does when the pool runs short), resumes and
    stores again."""
    config = KVCompactConfig(**FIXED, policy="streaming", budget=8, divide_length=4, window=2, n_sink=0,
                             compaction=compaction, recall_tokens=16, recall_margin=1e6, recall_at=recall_at,
                             recall_span=recall_span,
                             selection="per_layer_per_head" if recall_at == "layer" else "per_head")
    engine = Engine(config, block_size=4, num_blocks=16, heads=2, max_model_len=60, rng=np.random.default_rng(0))
    for prompt_len in (6, 9, 13):
        engine.add(prompt_len=prompt_len, max_tokens=40, budget=None, off=False)
    for _ in range(20):
        engine.step()
    engine._preempt(engine.sched.running.pop(0))
    while engine._all():
        engine.step()
    return engine


def _stale_tags(finish):
    def stale(self, point, in_forward):
        tags = point.state.tags
        count = finish(self, point, in_forward)
        point.state.tags = tags  # the swaps happened, the tags still name what the slots held before
        return count
    return stale


def _wrong_slots(scatter_kv):
    def wrong(self, table, slots, keys, values, first=0):
        return scatter_kv(self, table, slots.roll(1, dims=-1), keys, values, first)  # each row's writes rotated
    return wrong


@pytest.mark.parametrize("recall_span", [0, 3])
@pytest.mark.parametrize("recall_at", ["step", "layer"])
@pytest.mark.parametrize("compaction", ["repack", "holefill"])
@pytest.mark.parametrize("bug, target, name, words", [
    ("stale tags", RecallTier, "finish", "position tags"),
    ("wrong slots", PagedKV, "scatter_kv", "cache contents"),
    ("stale digest", RecallStore, "_refresh", "digest is stale"),
])
def test_recall_controls_are_caught(monkeypatch, recall_span, recall_at, compaction, bug, target, name, words):
    """The recall checks catch a recall whose tags stay stale, one that writes into the wrong slots, and a store
    whose page digests are not refreshed after a swap, with and without spans (``recall_span``: the following
    positions recalled too, from pages the query did not score). Control: the same program without the bug swaps
    tokens in (more of them with spans), drops stored ones and is preempted holding a store, and passes every
    check."""
    engine = run_recall_program(compaction, recall_at, recall_span)
    assert engine.counts["recalled"] > 20 and engine.counts["store_dropped"] > 0, engine.counts
    if recall_span:
        assert engine.counts["recalled"] > run_recall_program(compaction, recall_at).counts["recalled"]
    assert engine.counts["preempted_with_store"] > 0, engine.counts
    bugs = {"stale tags": _stale_tags, "wrong slots": _wrong_slots, "stale digest": lambda _: lambda *a, **k: None}
    monkeypatch.setattr(target, name, bugs[bug](getattr(target, name)))
    with pytest.raises(AssertionError, match=words):
        run_recall_program(compaction, recall_at, recall_span)
