"""The models users serve, as tiny random-weight models built from transformers configs (no hub, support.models):
the engine equals the transformers reference on Qwen3 (q/k-norm, head_dim 128: the TriAttention paper's family),
Qwen2 (QKV bias) and Gemma 3 (sliding-window layers interleaved with global ones). What start-up refuses on such
models: tests/unit/test_model_refusals.py."""

from __future__ import annotations

import pytest
import torch

from kvcompact import reference
from kvcompact.config import KVCompactConfig
from kvcompact.tools.local_engine import set_compaction
from support.engine import engine, greedy, round_events, worker_rounds
from support.models import SMALL, WINDOWED, stats_for
from support.mutants import generate_rope_at_slot_index, generate_window_by_slot

PROMPT = list(range(3, 3 + 24))
NEW_TOKENS = 80


@pytest.mark.engine
@pytest.mark.parametrize("arch, policy", [("qwen3", "triattention"), ("qwen2", "knorm")])
def test_engine_equals_reference(arch, policy, request, tmp_path):
    """fp32, >= 3 rounds, repack then holefill in one engine: the tokens and every keep set equal the
    transformers reference path's (which scores on its own); the control: RoPE at the slot index is caught."""
    model_dir = request.getfixturevalue(arch)
    cfg = dict(SMALL, policy=policy)
    if policy == "triattention":
        cfg["stats_path"] = stats_for(model_dir, tmp_path)
    ref_model = reference.load_model(model_dir)
    with engine(cfg, model=model_dir, skip_tokenizer_init=True, max_model_len=256) as llm:
        for compaction in ("repack", "holefill"):
            set_compaction(llm, compaction)
            first = len(worker_rounds(llm))
            out = llm.generate([{"prompt_token_ids": PROMPT}], greedy(NEW_TOKENS, detokenize=False), use_tqdm=False)
            tokens = list(out[0].outputs[0].token_ids)
            rounds = worker_rounds(llm)[first:]
            config = KVCompactConfig(**dict(cfg, compaction=compaction))
            ref, ref_rounds = reference.generate(ref_model, PROMPT, NEW_TOKENS, config)
            assert len(rounds) >= 3 and len(rounds) == len(ref_rounds)
            for a, b in zip(rounds, ref_rounds):
                assert torch.equal(a.keep_mask, b.keep_mask)
            assert tokens == ref, (arch, compaction)
            bad, _ = generate_rope_at_slot_index(ref_model, PROMPT, NEW_TOKENS, config,
                                                 keep_sets=[r.keep_mask for r in rounds])
            assert bad != tokens


@pytest.mark.engine
def test_interleaved_sliding_window_engine_equals_reference(gemma3):
    """Gemma 3 in miniature, fp32, one KV-cache group (hybrid manager off), repack with window >= the layers'
    window: >= 3 rounds, the keep sets and tokens equal the transformers reference, whose windowed layers mask
    by logical position, and every round frees the block above the budget (the cache stays bounded). The
    control runs the engine with holefill (start-up refuses it; switched on the live engine, as a bug would):
    its tokens differ from the reference's on the same keep sets and equal a reference that windows over cache
    slots, which is what vLLM's kernel does and why holefill is refused."""
    cfg = dict(WINDOWED, policy="knorm")
    ref_model = reference.load_model(gemma3)
    with engine(cfg, model=gemma3, skip_tokenizer_init=True) as llm:  # one KV-cache group: the helper's default
        runs = {}
        for compaction in ("repack", "holefill"):
            set_compaction(llm, compaction)
            first, seen = len(worker_rounds(llm)), len(round_events(llm))
            out = llm.generate([{"prompt_token_ids": PROMPT}], greedy(220, detokenize=False), use_tqdm=False)
            runs[compaction] = list(out[0].outputs[0].token_ids), worker_rounds(llm)[first:]
            if compaction == "repack":
                events = round_events(llm)[seen:]
    # 96 + 32 tokens = 4 blocks of 32 at each trigger, 3 after: one block back to the pool per round
    assert events and all((e.cache_len, e.kept_len, e.blocks_freed) == (128, 96, 1) for e in events)
    tokens, rounds = runs["repack"]
    ref, ref_rounds = reference.generate(ref_model, PROMPT, 220, KVCompactConfig(**cfg))
    assert len(rounds) >= 3 and len(rounds) == len(ref_rounds)
    for a, b in zip(rounds, ref_rounds):
        assert torch.equal(a.keep_mask, b.keep_mask)
    assert tokens == ref and len(set(tokens[-100:])) > 20  # not a model that repeats one token

    holefill = KVCompactConfig(**dict(cfg, compaction="holefill"))
    tokens, rounds = runs["holefill"]
    keep = [r.keep_mask for r in rounds]
    assert len(rounds) >= 3
    assert tokens != reference.generate(ref_model, PROMPT, 220, holefill, keep_sets=keep)[0]
    assert tokens == generate_window_by_slot(ref_model, PROMPT, 220, holefill, keep_sets=keep)[0]
