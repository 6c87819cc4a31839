"""Prefix caching composes with compaction, on the real engine (fp32, bundled model).

A round never writes into a block another request holds or that the prefix cache may hand out: such a block
among those the request keeps is replaced by a private copy first (copy on write), and the shared block stays
cached for others. Three requests share a 600-token prefix: A and C arrive together (C reuses the blocks A's
first prefill chunk registered, while A compacts), B arrives after A's rounds. Every request's tokens equal
its run on an engine without prefix caching, and vLLM reports the reused prefix. After every step: blocks held =
ceil(cache_len / block_size), reference counts = the requests holding each block, free + held = the pool, and
a request compressed at least once holds only private blocks. Negative control: without the copy, A's rounds
rewrite the cached blocks in place and B, which reuses them, goes wrong. The GPU default, prefix caching with
async scheduling (vLLM's AsyncScheduler, one step in flight), gives the same tokens and hits.
"""

from __future__ import annotations

import math
from collections import Counter

import pytest

from support import FIXED
from support.engine import engine, greedy, overlapped_schedules, scheduler, tokenize

pytestmark = pytest.mark.engine
BLOCK = 32
# a round whenever a cache reaches 128 + 64 = 192 tokens: A's 620-token prompt is compressed during its prefill
CFG = {**FIXED, "policy": "knorm", "budget": 128, "divide_length": 64, "window": 32, "n_sink": 4,
       "selection": "per_head", "compaction": "holefill"}
NEW_TOKENS = 40
HIT = 160  # the hit a compressed request may take: whole blocks short of its trigger (192)


def shared_prefix_prompts() -> dict[str, list[int]]:
    """A, C and B: the same 600-token prefix, then 20 tokens of their own."""
    from kvcompact.tools.corpus import eval_text

    ids = tokenize(eval_text().read_text()[:30000])
    prefix = ids[:600]
    return {name: prefix + ids[1000 + 50 * i: 1020 + 50 * i] for i, name in enumerate("ACB")}


@pytest.fixture(scope="module")
def prompts() -> dict[str, list[int]]:
    return shared_prefix_prompts()


def check_pool(llm) -> None:
    s = scheduler(llm)
    side, pool = s.kvcompact, s.kv_cache_manager.block_pool
    holders: Counter = Counter()
    for request in s.running:
        state = side.requests[request.request_id].ledger
        blocks = side.manager.req_to_blocks[request.request_id]
        cache_len = request.num_computed_tokens - state.evicted
        assert len(blocks) == math.ceil(cache_len / BLOCK), (request.request_id, len(blocks), cache_len)
        if state.dropped:  # compressed: its rounds write into these blocks, so nobody else may see them
            assert all(pool.is_block_writable(b) for b in blocks), request.request_id
        holders.update(b.block_id for b in blocks)
    by_id = {b.block_id: b for r in s.running for b in side.manager.req_to_blocks[r.request_id]}
    assert all(by_id[i].ref_cnt == n for i, n in holders.items())
    assert pool.get_num_free_blocks() == pool.num_gpu_blocks - 1 - len(holders)


def serve(prompts: dict[str, list[int]], *, prefix_caching: bool, without_copy: bool = False,
          async_scheduling: bool = False, check: bool = True):
    """A and C together, B once A has run 3 rounds; the tokens and prefix-cache hits of each, and the blocks
    copied on write. ``check``: the pool's bookkeeping after every step (a control that breaks it turns off)."""
    with engine(CFG, enable_prefix_caching=prefix_caching, max_model_len=768,
                async_scheduling=async_scheduling) as llm:
        side = scheduler(llm).kvcompact
        overlapped = overlapped_schedules(llm)
        if without_copy:
            side.reclaimer.unwritable = lambda blocks: []
        eng, outs, hits = llm.llm_engine, {}, {}
        eng.add_request("A", {"prompt_token_ids": prompts["A"]}, greedy(NEW_TOKENS))
        eng.add_request("C", {"prompt_token_ids": prompts["C"]}, greedy(NEW_TOKENS))
        added_b = False
        while eng.has_unfinished_requests():
            for out in eng.step():
                outs[out.request_id] = list(out.outputs[0].token_ids)
                hits[out.request_id] = out.num_cached_tokens
            if check and not without_copy:
                check_pool(llm)
            if not added_b and side.metrics.totals.rounds >= 6:
                eng.add_request("B", {"prompt_token_ids": prompts["B"]}, greedy(NEW_TOKENS))
                added_b = True
        pool = scheduler(llm).kv_cache_manager.block_pool
        assert pool.get_num_free_blocks() == pool.num_gpu_blocks - 1  # cached blocks aside, all free
        # with async scheduling, most steps were planned with the previous one in flight
        assert (sum(overlapped) > NEW_TOKENS) == async_scheduling
        return outs, hits, side.metrics.totals


@pytest.fixture(scope="module")
def without_prefix_caching(prompts):
    return serve(prompts, prefix_caching=False)


def test_shared_prefix_is_reused_and_never_rewritten(prompts, without_prefix_caching):
    plain, plain_hits, plain_totals = without_prefix_caching
    cached, cached_hits, totals = serve(prompts, prefix_caching=True)
    assert all(len(plain[r]) == NEW_TOKENS for r in "ACB")
    assert plain_totals.rounds >= 3 * 3 and plain_totals.blocks_copied == 0
    assert cached == plain
    assert plain_hits == {"A": 0, "C": 0, "B": 0}
    assert cached_hits["A"] == 0 and cached_hits["C"] == HIT and cached_hits["B"] == HIT, cached_hits
    assert totals.blocks_copied > 0  # A (and C) copied the blocks the cache shares before compacting them
    # negative control: A's rounds compact the registered blocks in place; B reuses them and goes wrong
    broken, broken_hits, _ = serve(prompts, prefix_caching=True, without_copy=True)
    assert broken_hits["B"] == HIT and broken["B"] != plain["B"]


def test_prefix_caching_with_async_scheduling(prompts, without_prefix_caching):
    plain = without_prefix_caching[0]
    cached, hits, totals = serve(prompts, prefix_caching=True, async_scheduling=True)
    assert all(len(plain[r]) == NEW_TOKENS for r in "ACB") and totals.rounds >= 3 * 3
    assert cached == plain and hits == {"A": 0, "C": HIT, "B": HIT} and totals.blocks_copied > 0
