"""Compression-aware admission on the real engine: a pool sized for N compressed requests runs them with no
preemption, where vLLM's greedy admission (the control) preempts; a request that can never fit is refused
with an error while the others finish."""

from __future__ import annotations

import math

import pytest

from support import FIXED
from support.engine import PROMPT, check_blocks, engine, greedy, preemptions, scheduler, tokenize

SMALL = {**FIXED, "policy": "streaming", "budget": 48, "divide_length": 24, "window": 16, "n_sink": 4}
BLOCK, NUM_BLOCKS = 32, 13            # 12 usable blocks: 4 x ceil((48 + 24) / 32) = 12
NEW_TOKENS = 160

pytestmark = pytest.mark.engine


def run(llm, prompts, params):
    """Step by hand: count preemptions and check the block invariant after every step."""
    s = scheduler(llm)
    peak_running = 0
    eng = llm.llm_engine
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        eng.add_request(f"r{i}", {"prompt_token_ids": prompt}, p)
    outs = {}
    with preemptions(llm) as preempted:
        while eng.has_unfinished_requests():
            for out in eng.step():
                if out.finished:
                    outs[out.request_id] = (list(out.outputs[0].token_ids), out.outputs[0].finish_reason)
            peak_running = max(peak_running, len(s.running))
            check_blocks(llm)
    return outs, len(preempted), peak_running


@pytest.mark.parametrize("admission", ["guaranteed", "greedy"])
def test_pool_sized_for_compressed_requests_never_preempts(admission):
    prompt = tokenize(PROMPT)[:20]
    with engine(dict(SMALL, admission=admission), num_blocks=NUM_BLOCKS, max_model_len=384, max_num_seqs=5,
                block_size=BLOCK) as llm:
        outs, preemptions, peak = run(llm, [prompt] * 5, [greedy(NEW_TOKENS)] * 5)
        pool = scheduler(llm).kv_cache_manager.block_pool
        assert pool.get_num_free_blocks() == pool.num_gpu_blocks - 1
    assert sorted(outs) == [f"r{i}" for i in range(5)]
    assert all(len(t) == NEW_TOKENS and reason == "length" for t, reason in outs.values())
    if admission == "guaranteed":
        # 4 fit at their peak (3 blocks each); the fifth waits for one to finish instead of preempting
        assert preemptions == 0 and peak == 4
    else:  # control: vLLM's greedy admission runs all five and runs out of blocks mid-way
        assert preemptions > 0 and peak == 5


def test_a_request_needing_the_whole_pool_waits_its_turn():
    """An uncompressed request (vllm_xargs kvcompact off) of 300 + 84 tokens needs all 12 blocks: it is admitted
    once the compressed request ahead of it finished, the one behind it waits (no overtaking), and nothing is
    preempted."""
    ids = tokenize(PROMPT * 8)
    big = greedy(84, extra_args={"kvcompact": "off"})
    with engine(SMALL, num_blocks=NUM_BLOCKS, max_model_len=384, max_num_seqs=4, block_size=BLOCK) as llm:
        outs, preemptions, peak = run(llm, [ids[:20], ids[:300], ids[:20]], [greedy(NEW_TOKENS), big,
                                                                          greedy(NEW_TOKENS)])
    assert math.ceil((300 + 84) / BLOCK) == NUM_BLOCKS - 1
    assert [len(outs[r][0]) for r in ("r0", "r1", "r2")] == [NEW_TOKENS, 84, NEW_TOKENS]
    assert preemptions == 0 and peak == 1


def test_shared_system_prompt_with_prefix_caching_never_preempts():
    """Prefix caching on (vLLM's and ``kvcompact serve``'s default): five requests share a 32-token system prompt
    (one block) in 12 usable blocks. The shared block is one block of the pool but, once each request compacts
    the blocks it keeps, a private copy per request (copy on write), so guaranteed admission counts it once per
    holder: four run, the fifth waits; no preemption, no round deferred for want of a block to copy into.
    Control: the same load with a shared block counted once (the accounting before copies were counted) admits
    the fifth and then runs out of blocks."""
    ids = tokenize(PROMPT * 8)
    prompts = [ids[:32] + ids[40 + 11 * i: 50 + 11 * i] for i in range(5)]
    with engine(SMALL, num_blocks=NUM_BLOCKS, max_model_len=384, max_num_seqs=5, block_size=BLOCK,
                enable_prefix_caching=True) as llm:
        side = scheduler(llm).kvcompact
        totals = side.metrics.totals
        outs, preemptions, peak = run(llm, prompts, [greedy(NEW_TOKENS)] * 5)
        copied, deferred = totals.blocks_copied, totals.deferred_rounds
        side.admission.duplicate_blocks = lambda running: 0
        _, control_preemptions, control_peak = run(llm, prompts, [greedy(NEW_TOKENS)] * 5)
        control_deferred = totals.deferred_rounds - deferred
    assert all(len(t) == NEW_TOKENS and reason == "length" for t, reason in outs.values())
    assert preemptions == 0 and deferred == 0 and peak == 4 and copied > 0
    assert control_peak == 5 and control_preemptions + control_deferred > 0
