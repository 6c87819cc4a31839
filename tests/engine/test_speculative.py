"""n-gram (prompt lookup) speculative decoding with compaction, on the real engine (fp32, bundled model).

The rule: a step never schedules past a request's trigger (``budget + divide_length`` cached tokens), drafts
included. vLLM drops the drafts beyond that cap, so the cache reaches the trigger exactly and every round falls
at the same cache length as without speculation. Greedy tokens, round lengths and keep sets with speculation
equal those without it, for every policy (the query-capturing ones hold back the rows of drafts until the
target accepts them: tests/unit/test_capture.py). Negative control: a cap that lets drafts overshoot the trigger
moves the rounds. vLLM's acceptance counters count exactly the drafts that were scheduled (those cut at a trigger
never count). Draft-model, EAGLE and other methods are refused at start-up (tests/unit/test_config.py).

One representative case per kind in CI (SnapKV, a policy that captures queries, with hole-filling; the other cases
repack); every policy x compaction with ``KVC_TEST_SPEC=full``.
"""

from __future__ import annotations

import os
from functools import partial
from typing import Any

import pytest
import torch

from support import FIXED
from support.engine import (
    PROMPT,
    check_blocks,
    engine,
    generate_stepwise,
    greedy,
    round_events,
    scheduler,
    tokenize,
    worker_rounds,
)

pytestmark = pytest.mark.engine

# A round whenever the cache reaches 48 + 24 = 72 tokens; 160 new tokens give 5 rounds.
SMALL = {**FIXED, "budget": 48, "divide_length": 24, "window": 16, "n_sink": 4, "selection": "per_head"}
TRIGGER = 72
NEW_TOKENS = 160
K = 3
NGRAM = {"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_min": 2, "prompt_lookup_max": 4}
POLICIES = ("streaming", "knorm", "random", "triattention", "snapkv", "h2o", "rkv")
FULL = os.environ.get("KVC_TEST_SPEC") == "full"
CI_CASES = {("snapkv", "holefill")}  # a policy that captures queries, hole-filling (the other cases repack)
CASES = [pytest.param(p, c, marks=() if (p, c) in CI_CASES or FULL else pytest.mark.skip(
    reason="opt-in: KVC_TEST_SPEC=full")) for p in POLICIES for c in ("repack", "holefill")]


def config(policy: str, compaction: str) -> dict[str, Any]:
    cfg = dict(SMALL, policy=policy, compaction=compaction)
    if policy == "triattention":
        from kvcompact.tools.serve import ensure_default_stats

        cfg["stats_path"] = ensure_default_stats()
    return cfg


def run(cfg: dict[str, Any], prompt_ids: list[int], speculative: dict[str, Any] | None,
        overshoot: bool = False) -> dict[str, Any]:
    """Generate greedily, stepping the engine by hand: check the blocks after every step and record, per step,
    the largest cache length a request was scheduled to reach (drafts included)."""
    kwargs = {"disable_log_stats": False}
    if speculative is not None:
        kwargs["speculative_config"] = speculative
    with engine(cfg, **kwargs) as llm:
        s = scheduler(llm)
        side = s.kvcompact
        if overshoot:  # the bug the cap guards against: drafts may carry the cache past the trigger
            cap = side.step_cap
            side.step_cap = lambda r, n: None if r.spec_token_ids else cap(r, n)
        reached: list[int] = []
        scheduled_drafts: list[int] = []
        proposed = [0]  # drafts the proposer offered, before the cap at the trigger
        schedule = s.schedule

        def recording_schedule(*args: Any, **kw: Any) -> Any:
            proposed[0] += sum(len(r.spec_token_ids) for r in s.running)
            out = schedule(*args, **kw)
            scheduled_drafts.extend(len(d) for d in out.scheduled_spec_decode_tokens.values())
            for r in s.running:  # vLLM has already advanced num_computed_tokens by the scheduled tokens
                if out.num_scheduled_tokens.get(r.request_id):
                    reached.append(r.num_computed_tokens - side.requests[r.request_id].ledger.evicted)
            return out

        s.schedule = recording_schedule
        tokens = generate_stepwise(llm, prompt_ids, NEW_TOKENS,
                                   check=partial(check_blocks, drafts=K if speculative else 0))
        metrics = {m.name: m for m in llm.get_metrics()}
        accepted = metrics["vllm:spec_decode_num_accepted_tokens"].value if speculative else 0
        if speculative:  # vLLM's counters count the drafts that ran: those cut at a trigger never did
            assert metrics["vllm:spec_decode_num_draft_tokens"].value == sum(scheduled_drafts)
            assert metrics["vllm:spec_decode_num_drafts"].value == sum(1 for n in scheduled_drafts if n)
            # Control: with the cap on, drafts were cut at a trigger, so a counter of proposed drafts would have
            # failed the check above; with the cap off (overshoot), none was.
            cut = proposed[0] - sum(scheduled_drafts)
            assert cut == 0 if overshoot else cut > 0
        return {"tokens": tokens, "keeps": [r.keep_mask for r in worker_rounds(llm)], "reached": reached,
                "rounds": [(e.logical_len, e.cache_len, e.kept_len, e.blocks_freed) for e in round_events(llm)],
                "accepted": accepted}


@pytest.mark.parametrize("policy, compaction", CASES)
def test_ngram_speculation_equals_plain_decoding(policy, compaction, prompt_ids):
    cfg = config(policy, compaction)
    plain = run(cfg, prompt_ids, None)
    spec = run(cfg, prompt_ids, NGRAM)
    assert len(plain["rounds"]) >= 3 and all(old == TRIGGER for _, old, _, _ in plain["rounds"])
    assert spec["accepted"] > 0, "no draft was ever accepted: the test would not exercise speculation"
    # The cap trimmed drafts: some step reached the trigger exactly with fewer than 1 + K tokens.
    assert max(spec["reached"]) == TRIGGER
    assert spec["rounds"] == plain["rounds"]
    assert len(spec["keeps"]) == len(plain["keeps"])
    for a, b in zip(spec["keeps"], plain["keeps"]):
        assert torch.equal(a, b)
    assert spec["tokens"] == plain["tokens"]


def test_drafts_past_the_trigger_move_the_rounds(prompt_ids):
    """Negative control for the cap: drafts allowed past the trigger make the cache overshoot it, so rounds
    fall at other cache lengths than without speculation."""
    cfg = config("knorm", "repack")
    spec = run(cfg, prompt_ids, NGRAM, overshoot=True)
    assert max(spec["reached"]) > TRIGGER
    assert any(old != TRIGGER for _, old, _, _ in spec["rounds"])


@pytest.mark.parametrize("hit_cap", ["spec_aware", "blind_to_drafts"])
def test_prefix_hit_that_leaves_one_token(hit_cap, monkeypatch):
    """A prefix-cache hit that leaves one token makes vLLM pad the request to 1 + K tokens and assert that count
    after the cap. The hit a compressed request may take stops K tokens short of the trigger (129 here), so the
    cap never cuts a padded request: B, with A's 129-token prompt, reuses 96 cached tokens and decodes A's tokens.
    Negative control: a hit cap blind to the drafts lets B take 128 cached tokens, and vLLM's assert fails."""
    from kvcompact.ledger import Ledger

    if hit_cap == "blind_to_drafts":
        monkeypatch.setattr(Ledger, "hit_cap",
                            lambda self, block_size, spec_tokens: (self.trigger - 1) // block_size * block_size)
    cfg = {**FIXED, "policy": "knorm", "budget": 97, "divide_length": 32, "window": 16, "n_sink": 4,
           "selection": "per_head", "compaction": "repack"}
    prompt = tokenize(PROMPT * 4)[:129]
    with engine(cfg, speculative_config=NGRAM, enable_prefix_caching=True) as llm:
        a = llm.generate([{"prompt_token_ids": prompt}], greedy(60), use_tqdm=False)[0]
        if hit_cap == "blind_to_drafts":
            with pytest.raises(AssertionError) as failed:
                llm.generate([{"prompt_token_ids": prompt}], greedy(60), use_tqdm=False)
            assert "num_new_tokens == 1 + self.num_spec_tokens" in str(failed.traceback[-1].statement)
            return
        b = llm.generate([{"prompt_token_ids": prompt}], greedy(60), use_tqdm=False)[0]
        assert len(round_events(llm)) >= 2
    assert b.num_cached_tokens == 96
    assert list(b.outputs[0].token_ids) == list(a.outputs[0].token_ids)


@pytest.mark.extended
def test_pressure_mode_with_ngram_shrinks_without_preempting_and_replays_exactly(reference_model):
    """Budget mode pressure under n-gram speculation: its rounds fall where the pool runs short, not at a fixed
    trigger, so the tokens are compared with the transformers reference replaying each request's recorded
    targets and keep sets (as tests/engine/test_pressure.py does without speculation). 16 usable blocks, 6 requests:
    0 preemptions, the block invariant after every step (drafts' blocks included), every request finishes, the
    target drafts were accepted, and the compressed request with the most rounds equals its replay (each replay is a
    transformers forward per token; tests/engine/test_pressure.py replays three without speculation).
    Negative control: the replay with RoPE at the slot index differs."""
    from kvcompact import reference
    from kvcompact.config import KVCompactConfig
    from support.engine import worker_rounds
    from support.mutants import generate_rope_at_slot_index
    from test_pressure import FLOOR, HEAVY_LENGTHS, _by_request, _drive, _heavy_load, _replay

    load, prompts = _heavy_load()
    with engine(FLOOR, num_blocks=17, max_model_len=256, max_num_seqs=6, speculative_config=NGRAM,
                disable_log_stats=False) as llm:
        run = _drive(llm, load, check=partial(check_blocks, drafts=K))
        events, logs = _by_request(round_events(llm)), _by_request(worker_rounds(llm))
        accepted = {m.name: m for m in llm.get_metrics()}["vllm:spec_decode_num_accepted_tokens"].value
    assert run.preempted == [] and accepted > 0
    assert [len(run.tokens[f"r{i}"]) for i in range(6)] == HEAVY_LENGTHS
    assert all(e.pressure for es in events.values() for e in es) and max(len(es) for es in events.values()) >= 3
    config = KVCompactConfig(**FLOOR)
    rid = max(events, key=lambda r: len(events[r]))
    assert _replay(reference.generate, reference_model, config, rid, prompts, events, logs) == run.tokens[rid], rid
    bad = _replay(generate_rope_at_slot_index, reference_model, config, rid, prompts, events, logs)
    assert bad != run.tokens[rid]
