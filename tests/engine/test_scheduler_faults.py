"""Fault isolation on the scheduler side, on the real engine (fp32, bundled model, prefix caching on so every hook
runs): an exception injected into kvcompact's part of each scheduler hook ends the request it concerns with an
error and nothing else, or, where it concerns no single request, turns compression off for new requests; the
engine serves on either way. One engine with vLLM's synchronous scheduler (CI) and one with async scheduling
(``KVC_TEST_FAULTS=full``)."""

from __future__ import annotations

import os

import pytest

from kvcompact.round import Round
from support import FIXED
from support.engine import PROMPT, assert_idle, check_blocks, engine, greedy, round_events, scheduler, tokenize

pytestmark = pytest.mark.engine

CFG = {**FIXED, "policy": "streaming", "budget": 48, "divide_length": 24, "window": 16, "n_sink": 4,
       "admission": "greedy"}
NEW_TOKENS = 45  # a 30-token prompt reaches its first round (48 + 24) at 42 new tokens


@pytest.fixture(scope="module", params=["sync", pytest.param("async", marks=() if os.environ.get(
    "KVC_TEST_FAULTS") == "full" else pytest.mark.skip(reason="opt-in: KVC_TEST_FAULTS=full"))])
def llm(request):
    """24 usable blocks of 32: eight compressed requests fit (3 blocks each at most), ten must preempt."""
    with engine(CFG, num_blocks=25, max_model_len=256, max_num_seqs=10, enable_prefix_caching=True,
                async_scheduling=request.param == "async") as llm:
        yield llm


@pytest.fixture(scope="module")
def ids():
    return tokenize(PROMPT * 8)


@pytest.fixture(scope="module")
def alone(llm, ids):
    """The good request's tokens alone, compressed and with compression off."""
    return {xargs: run(llm, {"alone": (ids[:30], greedy(NEW_TOKENS, **({"extra_args": {"kvcompact": "off"}}
                                                                        if xargs == "off" else {})))})["alone"][0]
            for xargs in ("on", "off")}


def run(llm, requests: dict) -> dict:
    """Add every request, step until all finish (block invariant after every step); {id: (tokens, reason)}."""
    eng = llm.llm_engine
    for rid, (prompt_ids, params) in requests.items():
        eng.add_request(rid, {"prompt_token_ids": prompt_ids}, params)
    out: dict = {}
    for _ in range(2000):
        if not eng.has_unfinished_requests():
            break
        for o in eng.step():
            if o.finished:
                out[o.request_id] = (list(o.outputs[0].token_ids), o.outputs[0].finish_reason)
        check_blocks(llm)
    return out


def inject(monkeypatch, obj, name: str, when) -> list[int]:
    """``obj.name`` raises whenever ``when(*args)``; returns the list its raises are counted in."""
    original, raised = getattr(obj, name), []

    def failing(*args, **kwargs):
        if when(*args):
            raised.append(1)
            raise RuntimeError(f"injected fault in {name}")
        return original(*args, **kwargs)

    monkeypatch.setattr(obj, name, failing)
    return raised


# The side's method behind kvcompact's part of every scheduler hook that concerns one request (new request,
# prefix-cache hit, prefill cap, allocation, prefix-cache registration, copy on write, the round itself).
PINNED = ["add_request", "hit_cap", "step_cap", "evicted", "registers", "_copy_held", "_round"]


def _rid(arg) -> str:
    """The request id of what a pinned method takes: vLLM's Request, or a Round (``_copy_held``, ``_round``)."""
    return arg.req_id if isinstance(arg, Round) else arg.request_id


def test_a_fault_for_one_request_ends_it_with_an_error_and_nothing_else(llm, ids, alone, monkeypatch):
    """One bad request per hook, all in one batch with a good one: each hook raises for its own bad request only.
    Every bad request finishes with finish_reason 'error' (fewer tokens than asked), the good one finishes with
    exactly the tokens it gets alone, compression stays on, the pool ends free. Control: every injected fault
    really fired (without the containment the first would have ended the engine: seen failing)."""
    side = scheduler(llm).kvcompact
    faults = side.metrics.totals.scheduler_faults
    raised = {m: inject(monkeypatch, side, m, lambda request, *_, m=m: _rid(request).startswith(f"bad{m}-"))
              for m in PINNED}
    out = run(llm, {**{f"bad{m}": (ids[40 + 9 * i: 70 + 9 * i], greedy(NEW_TOKENS)) for i, m in enumerate(PINNED)},
                    "good": (ids[:30], greedy(NEW_TOKENS))})
    monkeypatch.undo()
    assert [m for m in PINNED if not raised[m]] == []
    assert side.metrics.totals.scheduler_faults - faults >= len(PINNED)
    for m in PINNED:
        assert out[f"bad{m}"][1] == "error" and len(out[f"bad{m}"][0]) < NEW_TOKENS, m
    assert out["good"] == (alone["on"], "length")
    assert side.disabled is None
    assert_idle(llm)


def test_a_fault_at_preemption_ends_the_preempted_requests_only(llm, ids, monkeypatch):
    """Ten compressed requests in 24 blocks (greedy admission: vLLM preempts); the preemption hook raises for every
    preempted request: exactly those end with an error, the others finish whole."""
    side = scheduler(llm).kvcompact
    raised = inject(monkeypatch, side, "on_preempt", lambda request: True)
    out = run(llm, {f"p{i}": (ids[10 * i: 10 * i + 20], greedy(100)) for i in range(10)})
    monkeypatch.undo()
    errors = sum(reason == "error" for _, reason in out.values())
    assert 1 <= len(raised) == errors < 10  # each preempted request ended at its preemption, the others finished
    assert all(len(t) == 100 for t, reason in out.values() if reason == "length")
    assert side.disabled is None
    assert_idle(llm)


def test_a_fault_when_a_request_finishes_loses_only_its_counters(llm, ids, alone, monkeypatch):
    side = scheduler(llm).kvcompact
    raised = inject(monkeypatch, side, "on_finish", lambda request: True)
    out = run(llm, {"bad": (ids[:30], greedy(NEW_TOKENS))})
    monkeypatch.undo()
    assert raised and out["bad"] == (alone["on"], "length") and side.disabled is None
    assert_idle(llm)


# (what fails, the object's path from the side, its method): faults that concern no single request
UNPINNED = [("admission", "admission", "max_running"), ("step metrics", "", "after_step"),
            ("pressure planning", "admission", "pressure_rounds")]


def test_a_fault_of_no_one_request_turns_compression_off_for_new_requests(llm, ids, alone, monkeypatch):
    """Each of these runs in every step, so the request running when it raises sees it: that request finishes
    whole; compression is off for the requests that come after (no round runs, their tokens are full attention's),
    and the kvcompact:compression_disabled gauge says so. Control: the fault really fired."""
    from prometheus_client import REGISTRY

    side = scheduler(llm).kvcompact
    for i, (where, path, method) in enumerate(UNPINNED):
        raised = inject(monkeypatch, getattr(side, path) if path else side, method, lambda *a: True)
        out = run(llm, {f"first{i}": (ids[40:70], greedy(8))})
        monkeypatch.undo()
        assert raised and side.disabled == where and out[f"first{i}"][1] == "length", where
        assert REGISTRY.get_sample_value("kvcompact:compression_disabled", side.metrics.labels) == 1
        if i == 0:
            rounds = len(round_events(llm))
            assert run(llm, {"next": (ids[:30], greedy(NEW_TOKENS))})["next"] == (alone["off"], "length")
            assert len(round_events(llm)) == rounds
        side.disabled = None  # compressed again for what follows
        assert_idle(llm)
