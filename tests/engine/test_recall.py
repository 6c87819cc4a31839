"""The recall tier on the real engine (fp32, bundled model, prefix caching on): evicted tokens go to the request's
store at each round and come back slot for slot when a query rates them above the weakest kept tokens, after the
forward (``recall_at`` step) or inside it, each layer before its attention (``recall_at`` layer). Exactness: the
engine's tokens equal the transformers reference replaying the worker's keep sets and recalls (repack and holefill,
>= 3 rounds, recalls between every two of them), including a request that resumes after vLLM preempted it while it
held a store. Negative controls are defects injected into the engine itself: a store that forgets to update the
position tags of what it swapped, a recall that writes into the wrong slots, and (``layer``) a layer's recall run
after its attention instead of before."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest

from kvcompact import reference
from kvcompact.config import KVCompactConfig
from kvcompact.recall import RecallStore, SwapPlan
from kvcompact.tools.local_engine import set_compaction
from kvcompact.vllm.capture import AttentionCapture
from kvcompact.vllm.paged_kv import PagedKV
from kvcompact.vllm.recall_tier import RecallTier
from support import FIXED
from support.engine import (
    PROMPT,
    assert_idle,
    check_blocks,
    corpus_ids,
    engine,
    external_id,
    greedy,
    preemptions,
    scheduler,
    tokenize,
    worker_rounds,
    worker_side,
)

pytestmark = pytest.mark.engine
# recall_margin wide open: every stored token that beats the weakest kept one comes back, the swap mechanics at their
# busiest (the margin's own decision: tests/unit/test_recall_store.py).
RECALL = {**FIXED, "policy": "knorm", "budget": 48, "divide_length": 24, "window": 16, "n_sink": 4,
          "selection": "per_head", "recall_tokens": 256, "recall_margin": 1e9}
# recall_at layer: each layer decides for itself, so each layer keeps its own token set
IN_FORWARD = {"recall_at": "layer", "selection": "per_layer_per_head"}
# fp32 engine against fp32 reference: a token's log-probability agrees to this (the kernels' rounding) when the
# replay is exact; a defect that leaves every greedy token in place still moves it by more
DRIFT = 1e-3
NEW_TOKENS = 80


def recalls_of(llm: Any) -> list[Any]:
    """Every recall the (in-process) worker makes from now on."""
    events: list[Any] = []
    worker_side(llm).recall_listeners.append(events.append)
    return events


def replay(model: Any, prompt: list[int], tokens: int, compaction: str, rounds: list[Any], recalls: list[Any],
           logprobs: list[float] | None = None, **config: Any) -> list[int] | None:
    """The reference's tokens replaying the engine's keep sets and recalls; None where the replay itself refuses
    them (a recall of a position the reference never evicted)."""
    try:
        out, _ = reference.generate(model, prompt, tokens,
                                    KVCompactConfig(**{**RECALL, "compaction": compaction, **config}),
                                    keep_sets=[r.keep_mask for r in rounds], recalls=recalls, logprobs=logprobs)
    except ValueError:
        return None
    return out


def one_request(llm: Any, events: list[Any], prompt: list[int], request_id: str,
                logprobs: list[float] | None = None) -> tuple[list[int], list, list, int]:
    """Generate alone, stepping by hand with the block invariant checked after every step: the tokens, the
    worker's rounds and recalls, and the prompt tokens the prefix cache served (``logprobs``: each token's
    log-probability appended to it)."""
    start_rounds, start_recalls = len(worker_rounds(llm)), len(events)
    eng, tokens, cached, out = llm.llm_engine, [], 0, None
    eng.add_request(request_id, {"prompt_token_ids": prompt}, greedy(NEW_TOKENS, logprobs=0))
    while eng.has_unfinished_requests():
        for out in eng.step():
            tokens, cached = list(out.outputs[0].token_ids), out.num_cached_tokens or 0
        check_blocks(llm)
    if logprobs is not None and out is not None:
        logprobs.extend(step[t].logprob for step, t in zip(out.outputs[0].logprobs, tokens))
    return tokens, worker_rounds(llm)[start_rounds:], events[start_recalls:], cached


def drift(engine_logprobs: list[float], reference_logprobs: list[float]) -> float:
    """The largest difference between the engine's and the reference's log-probability of the same token."""
    assert len(engine_logprobs) == len(reference_logprobs) == NEW_TOKENS
    return max(abs(a - b) for a, b in zip(engine_logprobs, reference_logprobs))


@contextmanager
def patched(owner: type, name: str, method: Any) -> Iterator[None]:
    original = getattr(owner, name)
    setattr(owner, name, method)
    try:
        yield
    finally:
        setattr(owner, name, original)


_swap, _scatter, _begin = RecallStore.swap, PagedKV.scatter_kv, AttentionCapture.begin_forward
_spanned = SwapPlan.spanned
_tier_apply = RecallTier.apply


def stale_tags(store: RecallStore, plan: Any, keys: Any, values: Any, positions: Any) -> None:
    """Defect: the swapped-out tokens' K and V go to the store, their positions do not (the store keeps the
    recalled tokens' positions, so a later recall of those entries reports stale tags)."""
    kept = store.positions.clone()
    _swap(store, plan, keys, values, positions)
    store.positions.copy_(kept)


def wrong_slots(kv: PagedKV, block_table: Any, slots: Any, keys: Any, values: Any, first: int = 0) -> None:
    """Defect: each head's recalled tokens land in its candidate slots in reverse order."""
    _scatter(kv, block_table, slots.flip(-1), keys, values, first)


def after_attention(capture: AttentionCapture, *args: Any) -> None:
    """Defect (``recall_at`` layer): each layer's recall runs after its attention, so the token whose query asked is
    computed without what comes back (the lag of ``recall_at`` step, with the recall reported as in time)."""
    _begin(capture, *args)
    if capture._before is not None:
        capture._work.append(capture._before)
        capture._before = None


DEFECTS = [("stale tags", RecallStore, "swap", stale_tags), ("wrong slots", PagedKV, "scatter_kv", wrong_slots)]


@pytest.mark.parametrize("recall_at", ["step", "layer"])
def test_recalls_replay_exactly_and_the_controls_fail(reference_model, recall_at):
    """``layer`` runs with ``recall_span`` (serve's decision point, the following positions recalled too): the
    spans' swaps replay exactly like the query's own, and they happen."""
    prompt = tokenize(PROMPT)
    config = {**IN_FORWARD, "recall_span": 2} if recall_at == "layer" else {}
    defects = DEFECTS + ([("late", AttentionCapture, "begin_forward", after_attention)] if config else [])
    spanned: list[int] = []

    def counted(plan: SwapPlan, positions: Any, span: int) -> SwapPlan:
        wide = _spanned(plan, positions, span)
        spanned.append(int(wide.swapped.sum() - plan.swapped.sum()))
        return wide

    with engine({**RECALL, **config}, enable_prefix_caching=True) as llm, patched(SwapPlan, "spanned", counted):
        events = recalls_of(llm)
        tokens_of = {}
        for compaction in ("repack", "holefill"):
            set_compaction(llm, compaction)
            # twice the same prompt: the second request starts from the first one's prefix-cached blocks
            for request in ("a", "b"):
                mine: list[float] = []
                tokens, rounds, recalls, cached = one_request(llm, events, prompt, f"{compaction}-{request}", mine)
                tokens_of[f"{compaction}-{request}"] = tokens
                assert len(rounds) >= 3 and len(tokens) == NEW_TOKENS
                assert request == "a" or cached > 0
                between = {sum(r.logical_len > e.logical_len for r in rounds) for e in recalls if e.num_tokens}
                assert len(between) >= 3, between  # recalls after each of >= 3 rounds
                assert all(e.in_forward == bool(config) for e in recalls)
                theirs: list[float] = []
                assert tokens == replay(reference_model, prompt, NEW_TOKENS, compaction, rounds, recalls, theirs,
                                        **config), compaction
                print(f"\n{recall_at} {compaction}-{request}: log-probability drift {drift(mine, theirs):.2e}")
                assert drift(mine, theirs) < DRIFT
        totals = scheduler(llm).kvcompact.metrics.totals
        assert totals.recalled_tokens == sum(e.num_tokens for e in events) > 0  # reported through vLLM's outputs
        assert (sum(spanned) > 0) == bool(config), sum(spanned)
        assert totals.store_bytes > 0
        for name, owner, attr, defect in defects:
            mine, theirs = [], []
            with patched(owner, attr, defect):
                tokens, rounds, recalls, _ = one_request(llm, events, prompt, name, mine)
            same = tokens == replay(reference_model, prompt, NEW_TOKENS, "holefill", rounds, recalls, theirs, **config)
            print(f"{recall_at} control {name}: tokens {'equal' if same else 'differ'}, drift "
                  f"{drift(mine, theirs) if same else float('nan'):.2e}")
            assert not same or drift(mine, theirs) > DRIFT, name
        if config:
            two_prompts_in_the_same_forwards_replay_exactly(llm, events, reference_model, prompt)
            a_recall_that_fails_ends_its_request_alone(llm, prompt, alone=tokens_of["holefill-b"])
        assert_idle(llm)


def two_prompts_in_the_same_forwards_replay_exactly(llm: Any, events: list[Any], model: Any,
                                                    prompt: list[int]) -> None:
    """``recall_at`` layer makes one decision per layer for every request of the forward: two requests of different
    prompts (stores and kept slots of different sizes, padded side by side) decoded together each equal the
    reference replaying their own rounds and recalls, and both recall."""
    prompts = {"pair-alice": prompt, "pair-corpus": corpus_ids()[:64]}
    eng, tokens, start = llm.llm_engine, {}, (len(worker_rounds(llm)), len(events))
    for rid, ids in prompts.items():
        eng.add_request(rid, {"prompt_token_ids": ids}, greedy(NEW_TOKENS))
    while eng.has_unfinished_requests():
        for o in eng.step():
            tokens[o.request_id] = list(o.outputs[0].token_ids)
        check_blocks(llm)
    for rid, ids in prompts.items():
        rounds = [r for r in worker_rounds(llm)[start[0]:] if external_id(r.req_id) == rid]
        recalls = [e for e in events[start[1]:] if external_id(e.req_id) == rid]
        assert len(rounds) >= 3 and sum(e.num_tokens for e in recalls) > 0, rid
        assert tokens[rid] == replay(model, ids, NEW_TOKENS, "holefill", rounds, recalls, **IN_FORWARD), rid


def a_recall_that_fails_ends_its_request_alone(llm: Any, prompt: list[int], alone: list[int]) -> None:
    """``recall_at`` layer: an exception inside a layer's recall (mid-forward, that request's layers half swapped)
    ends that request with finish_reason 'error'; the other request of the same forwards finishes with the tokens
    it makes alone, and the engine goes on. Control: without the fault both finish."""
    def failing(tier: RecallTier, point: Any, plan: Any, first: int) -> None:
        if point.req_id.startswith("crash") and first == 3:
            raise RuntimeError("injected recall failure")
        _tier_apply(tier, point, plan, first)

    for fault in (True, False):
        eng, out = llm.llm_engine, {}
        with patched(RecallTier, "apply", failing if fault else _tier_apply):
            for rid in ("crash", "other"):
                eng.add_request(rid, {"prompt_token_ids": prompt}, greedy(NEW_TOKENS))
            while eng.has_unfinished_requests():
                for o in eng.step():
                    if o.finished:
                        out[o.request_id] = (list(o.outputs[0].token_ids), o.outputs[0].finish_reason)
                check_blocks(llm)
        assert out["other"] == (alone, "length")
        tokens, reason = out["crash"]
        assert (reason, len(tokens) < NEW_TOKENS) == (("error", True) if fault else ("length", False))


def test_an_exact_search_inside_the_forward_replays_exactly(reference_model):
    """``recall_search`` exact inside the forward (its candidates the best entries of the whole store, plans without
    pages, stores of two requests padded side by side in one product): two prompts decoded in the same forwards
    each equal the reference replaying their rounds and recalls, and both recall. Control: the recall writing into
    the wrong slots differs from the replay."""
    prompt = tokenize(PROMPT)
    config = {**IN_FORWARD, "recall_span": 2, "recall_search": "exact"}
    with engine({**RECALL, **config}, enable_prefix_caching=True) as llm:
        events = recalls_of(llm)
        set_compaction(llm, "holefill")
        two_prompts_in_the_same_forwards_replay_exactly(llm, events, reference_model, prompt)
        mine, theirs = [], []
        with patched(PagedKV, "scatter_kv", wrong_slots):
            tokens, rounds, recalls, _ = one_request(llm, events, prompt, "control", mine)
        assert sum(e.num_tokens for e in recalls) > 0
        same = tokens == replay(reference_model, prompt, NEW_TOKENS, "holefill", rounds, recalls, theirs, **config)
        print(f"\nexact search control wrong slots: tokens {'equal' if same else 'differ'}")
        assert not same or drift(mine, theirs) > DRIFT
        assert_idle(llm)


def store_sizes(side: Any) -> list[int]:
    """The bytes of the rounding request's store after each round from now on."""
    sizes: list[int] = []
    side.round_listeners.append(lambda r: sizes.append(side.requests[r.req_id].store.nbytes))
    return sizes


def test_a_coded_store_replays_exactly_with_its_round_trip(reference_model):
    """``recall_dtype`` fp8 (K and V as e4m3 codes) and int8_values (keys exact, values as int8), each with a scale
    per token and KV head: a recalled token comes back rounded, and the engine equals the reference that rounds
    what its rounds evict and its swaps take out the same way (>= 3 rounds, recalls after each, prefix caching on;
    tokens equal, log-probabilities within DRIFT), in fewer store bytes than a store in the cache's dtype for the
    same request. Control: the reference that recalls the exact values differs, in tokens or by ten times the
    drift of the rounding replay (int8's rounding of a value moves a log-probability by less than DRIFT, the
    kernels' tolerance, here 8.7e-4 against 1.2e-5 for the replay that rounds as the store does)."""
    prompt = tokenize(PROMPT)
    held: dict[str, list[int]] = {}
    for dtype in ("fp8", "int8_values", "auto"):
        with engine(dict(RECALL, recall_dtype=dtype, recall_pages=1), enable_prefix_caching=True) as llm:
            held[dtype] = store_sizes(worker_side(llm))
            mine: list[float] = []
            tokens, rounds, recalls, _ = one_request(llm, recalls_of(llm), prompt, dtype, mine)
        if dtype == "auto":
            continue
        assert len(rounds) >= 3 and len(tokens) == NEW_TOKENS
        between = {sum(r.logical_len > e.logical_len for r in rounds) for e in recalls if e.num_tokens}
        assert len(between) >= 3, between
        theirs: list[float] = []
        assert tokens == replay(reference_model, prompt, NEW_TOKENS, "repack", rounds, recalls, theirs,
                                recall_dtype=dtype)
        assert drift(mine, theirs) < DRIFT
        exact: list[float] = []
        same = tokens == replay(reference_model, prompt, NEW_TOKENS, "repack", rounds, recalls, exact)
        print(f"\n{dtype}: drift {drift(mine, theirs):.2e}; control (exact values) tokens "
              f"{'equal' if same else 'differ'}, drift {drift(mine, exact) if same else float('nan'):.2e}")
        assert not same or drift(mine, exact) > 10 * drift(mine, theirs)  # control
    auto = max(held["auto"])
    print(f"store bytes after the last round: fp8 {max(held['fp8'])}, int8_values {max(held['int8_values'])}, "
          f"auto (fp32) {auto}")
    assert 0 < max(held["fp8"]) < auto / 2 and 0 < max(held["int8_values"]) < auto * 0.7


# 11 usable blocks of 32: three compressed requests fit (3 blocks each at most), the others preempt.
TIGHT = {"num_blocks": 12, "max_model_len": 320, "max_num_seqs": 6, "enable_prefix_caching": True}


def test_a_request_preempted_while_holding_a_store_resumes_exactly(reference_model):
    """Greedy admission over a pool too small for every request: vLLM preempts requests that hold a store. The
    store dies with the cache (the worker forgets the request); the resumed request re-prefills prompt + the k
    tokens it had, and its rounds and recalls from then on replay exactly on that sequence. An aborted request's
    store goes too: nothing of either is left once the engine is idle (stores, tags, the store-bytes gauge)."""
    ids = corpus_ids()
    config = dict(RECALL, admission="greedy", compaction="repack")
    log: list[tuple[str, Any]] = []
    with engine(config, **TIGHT) as llm:
        side = worker_side(llm)
        side.round_listeners.append(lambda r: log.append(("round", r)))
        side.recall_listeners.append(lambda e: log.append(("recall", e)))
        eng = llm.llm_engine
        prompts = {f"p{i}": ids[100 + 120 * i: 140 + 120 * i + 5 * i] for i in range(6)}
        for rid, p in prompts.items():
            eng.add_request(rid, {"prompt_token_ids": p}, greedy(130))
        out: dict[str, list[int]] = {}
        steps = 0
        with preemptions(llm) as preempted:
            while eng.has_unfinished_requests():
                seen = len(preempted)
                for o in eng.step():
                    out[o.request_id] = list(o.outputs[0].token_ids)
                for event in preempted[seen:]:
                    log.append(("preempt", event))
                check_blocks(llm)
                steps += 1
                if steps == 100:  # abort one that is compressed and holds a store by now
                    held = [external_id(r) for r, s in side.requests.items() if s.store is not None]
                    assert held
                    eng.abort_request([held[0]])
                    aborted = held[0]
        resumed = {e.request_id for kind, e in log if kind == "preempt" and e.compressed}
        assert resumed - {aborted}, preempted
        stored = {external_id(e.req_id) for kind, e in log if kind == "recall"}
        assert resumed & stored  # a preempted request had recalled (so held a store) before
        assert_idle(llm)
        assert not any(s.store is not None for s in side.requests.values())
        assert scheduler(llm).kvcompact.metrics.totals.store_bytes == 0
    for rid in sorted(resumed - {aborted}):
        cut, rounds, recalls = 0, [], []
        for kind, e in log:
            owner = external_id(e.request_id if kind == "preempt" else e.req_id)
            if owner != rid:
                continue
            if kind == "preempt":
                cut, rounds, recalls = e.output_tokens, [], []
            else:
                (rounds if kind == "round" else recalls).append(e)
        tokens = out[rid]
        ref, _ = reference.generate(reference_model, prompts[rid] + tokens[:cut], len(tokens) - cut,
                                    KVCompactConfig(**config), keep_sets=[r.keep_mask for r in rounds],
                                    recalls=recalls)
        assert tokens[cut:] == ref, rid
