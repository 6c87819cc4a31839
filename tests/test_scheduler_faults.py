"""Fault isolation on the scheduler side, on the real engine (fp32, bundled model, prefix caching on so every hook
runs): an exception injected into kvcompact's part of each scheduler hook ends the request it concerns with an
error and nothing else, or, where it concerns no single request, turns compression off for new requests; the
engine serves on either way. One engine with vLLM's synchronous scheduler and one with async scheduling."""

from __future__ import annotations

import pytest

from engine import PROMPT, check_blocks, engine, greedy, round_events, scheduler, tokenize

pytestmark = pytest.mark.engine

CFG = {"policy": "streaming", "budget": 48, "divide_length": 24, "window": 16, "n_sink": 4, "admission": "greedy"}
NEW_TOKENS = 60  # a 30-token prompt reaches its first round (48 + 24) at 42 new tokens


@pytest.fixture(scope="module", params=["sync", "async"])
def llm(request):
    with engine(CFG, num_blocks=13, max_model_len=256, max_num_seqs=5, enable_prefix_caching=True,
                async_scheduling=request.param == "async") as llm:
        yield llm


@pytest.fixture(scope="module")
def ids():
    return tokenize(PROMPT * 8)


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


def assert_idle(llm) -> None:
    s = scheduler(llm)
    pool = s.kvcompact.block_pool
    assert pool.get_num_free_blocks() == pool.num_gpu_blocks - 1, "blocks leaked"
    assert not s.kvcompact.ledgers and not s.kvcompact.pending_errors and not s.requests


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


def is_bad(request, *_):
    return request.request_id.startswith("bad")


# (what fails, the side's method that raises): kvcompact's part of every scheduler hook that concerns one request
PINNED = [("new request", "add_request"), ("prefix-cache hit", "hit_cap"), ("prefill cap", "prefill_cap"),
          ("allocation", "evicted"), ("prefix-cache registration", "registers"), ("round", "_round"),
          ("copy on write", "_copy_held")]


@pytest.mark.parametrize("where,method", PINNED, ids=[m for _, m in PINNED])
def test_a_fault_for_one_request_ends_it_with_an_error_and_nothing_else(llm, ids, monkeypatch, where, method):
    """The bad request finishes with finish_reason 'error' (fewer tokens than asked), the good one beside it
    finishes with exactly the tokens it gets alone, compression stays on, the pool ends free. Control: the fault
    really fired (without the containment it would have ended the engine: seen failing)."""
    side = scheduler(llm).kvcompact
    good = (ids[:30], greedy(NEW_TOKENS))
    alone = run(llm, {"alone": good})["alone"][0]
    faults = side.metrics.totals.scheduler_faults
    raised = inject(monkeypatch, side, method, is_bad)
    out = run(llm, {"bad": (ids[40:70], greedy(NEW_TOKENS)), "good": good})
    monkeypatch.undo()
    assert raised and side.metrics.totals.scheduler_faults > faults
    assert out["bad"][1] == "error" and len(out["bad"][0]) < NEW_TOKENS
    assert out["good"] == (alone, "length")
    assert side.disabled is None
    assert_idle(llm)
    assert run(llm, {"after": good})["after"] == (alone, "length")  # the engine serves on


def test_a_fault_at_preemption_ends_the_preempted_requests_only(llm, ids, monkeypatch):
    """Five compressed requests in 12 blocks (greedy admission: vLLM preempts); the preemption hook raises for every
    preempted request: exactly those end with an error, the others finish."""
    side = scheduler(llm).kvcompact
    raised = inject(monkeypatch, side, "on_preempt", lambda request: True)
    out = run(llm, {f"p{i}": (ids[10 * i: 10 * i + 20], greedy(100)) for i in range(5)})
    monkeypatch.undo()
    errors = sum(reason == "error" for _, reason in out.values())
    assert 1 <= len(raised) == errors < 5  # each preempted request ended at its preemption, the others finished
    assert all(len(t) == 100 for t, reason in out.values() if reason == "length")
    assert_idle(llm)


def test_a_fault_when_a_request_finishes_loses_only_its_counters(llm, ids, monkeypatch):
    side = scheduler(llm).kvcompact
    raised = inject(monkeypatch, side, "on_finish", is_bad)
    out = run(llm, {"bad": (ids[:30], greedy(NEW_TOKENS))})
    monkeypatch.undo()
    assert raised and out["bad"][1] == "length" and side.disabled is None
    assert_idle(llm)


# (what fails, the object's path from the side, its method): faults that concern no single request
UNPINNED = [("admission", "admission", "cap"), ("step metrics", "", "after_step"),
            ("pressure planning", "admission", "pressure_rounds")]


@pytest.mark.parametrize("where,path,method", UNPINNED, ids=[m for _, _, m in UNPINNED])
def test_a_fault_of_no_one_request_turns_compression_off_for_new_requests(llm, ids, monkeypatch, where, path,
                                                                         method):
    """Every running request finishes; compression is off for the requests that come after (no round runs, their
    tokens are full attention's), and the kvcompact:compression_disabled gauge says so."""
    side = scheduler(llm).kvcompact
    off = run(llm, {"off": (ids[:30], greedy(NEW_TOKENS, extra_args={"kvcompact": "off"}))})["off"][0]
    target = getattr(side, path) if path else side
    raised = inject(monkeypatch, target, method, lambda *a: True)  # each is called in every step
    out = run(llm, {"first": (ids[40:70], greedy(NEW_TOKENS))})
    monkeypatch.undo()
    assert raised and side.disabled == where and out["first"][1] == "length"
    from prometheus_client import REGISTRY

    assert REGISTRY.get_sample_value("kvcompact:compression_disabled", side.metrics.labels) == 1
    rounds = len(round_events(llm))
    assert run(llm, {"next": (ids[:30], greedy(NEW_TOKENS))})["next"] == (off, "length")
    assert len(round_events(llm)) == rounds
    side.disabled = None  # this engine serves the next test compressed again
    assert_idle(llm)
