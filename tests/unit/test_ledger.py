"""The ledger on its own: where a round falls, how long the cache is, how many tokens a step may schedule and how
long a prefix-cache hit may be, for one request, in plain integers (docs/DESIGN.md, "The ledger"). Each expectation
is worked out from the definitions, not read back from the code."""

from __future__ import annotations

import pytest

from kvcompact.ledger import Ledger, blocks_held, effective_budget, trigger

BUDGET, DIVIDE, BS = 64, 16, 16


def ledger(**kw: object) -> Ledger:
    args: dict[str, object] = dict(enabled=True, budget=BUDGET, divide_length=DIVIDE, prompt_len=30,
                                   frees_blocks=True)
    args.update(kw)
    return Ledger(**args)  # type: ignore[arg-type]


def test_blocks_held_and_the_trigger() -> None:
    assert [blocks_held(n, BS) for n in (0, 1, 16, 17, 32)] == [0, 1, 1, 2, 2]
    assert trigger(BUDGET, DIVIDE) == 80
    assert effective_budget(64, 30, protect_prompt=True) == 94 and effective_budget(64, 30, False) == 64
    with pytest.raises(ValueError):
        blocks_held(-1, BS)


def test_rounds_fall_every_divide_length_tokens_once_past_the_budget() -> None:
    """Driving a request token by token and running each due round: rounds at logical lengths 80, 96, 112, ...
    (the cache back to 64 after each), and the cache never above the trigger."""
    x = ledger()
    rounds = []
    for logical in range(0, 200):
        if x.due(logical):
            rounds.append(logical)
            x.record_round(x.cache_len(logical), BUDGET)
        assert x.cache_len(logical) <= 80
    assert rounds == list(range(80, 200, DIVIDE))
    assert x.rounds == len(rounds) and x.evicted == x.dropped == 199 - 64 - (199 - rounds[-1])


def test_under_compaction_none_tokens_drop_but_no_slot_is_given_back() -> None:
    """``dropped`` drives the triggers, ``evicted`` the slots: under compaction none only the first moves, and the
    next round still falls 16 tokens later. Control: a request that frees blocks moves both."""
    x = ledger(frees_blocks=False)
    x.record_round(80, 64)
    assert (x.dropped, x.evicted) == (16, 0)
    assert x.cache_len(96) == 80 and x.due(96) and not x.due(95)
    y = ledger()
    y.record_round(80, 64)
    assert (y.dropped, y.evicted) == (16, 16)


def test_pressure_mode_and_disabled_requests_never_run_a_fixed_round() -> None:
    assert not ledger(pressure=True).due(500)
    assert not ledger(enabled=False).due(500)
    assert ledger().due(80) and not ledger().due(79)


def test_budget_mode_latch_runs_fixed_rounds_after_its_first_round() -> None:
    """A latch ledger starts in pressure mode (no fixed round however long its cache); its first round (a pressure
    round to the floor) ends that, so the next falls at the trigger, 80 cached tokens, as under a fixed budget; a
    preemption does not bring pressure mode back. Control: a pressure ledger stays in pressure mode."""
    x = ledger(pressure=True, latch=True)
    assert not x.due(500)
    x.record_round(300, 64)  # logical 300 -> cache 64
    assert not x.pressure and not x.due(300 + 15) and x.due(300 + 16)
    x.restart()
    assert not x.pressure and x.due(80)
    y = ledger(pressure=True)
    y.record_round(300, 64)
    assert y.pressure and not y.due(300 + 16)


def test_a_step_may_schedule_tokens_up_to_the_trigger_and_at_least_one() -> None:
    """From 50 computed tokens (nothing evicted) a step may take 30 (to the trigger at 80); after a round that
    evicted 16, from 90 computed it may take 80 - (90 - 16) = 6; at the trigger, 1 (a sampled token is never cut)."""
    x = ledger()
    assert x.step_cap(50) == 30
    x.record_round(80, 64)
    assert x.step_cap(90) == 6
    assert x.step_cap(96) == 1


def test_a_prefix_cache_hit_stops_in_whole_blocks_short_of_the_trigger() -> None:
    """Trigger 80, blocks of 16: a hit of at most 64 tokens (79 rounded down), 48 with 16 speculative tokens (vLLM
    pads a hit that leaves one token by the drafts)."""
    assert ledger().hit_cap(BS, 0) == 64
    assert ledger().hit_cap(BS, 16) == 48


def test_peak_tokens_and_restart() -> None:
    assert ledger().peak_tokens(1000) == 80 and ledger().peak_tokens(50) == 50
    assert ledger(frees_blocks=False).peak_tokens(1000) == 1000
    # A draft model's lookahead slots sit past the trigger; an uncompressed request's total already counts them.
    assert ledger().peak_tokens(1000, lookahead=3) == 83 and ledger().peak_tokens(50, lookahead=3) == 50
    assert ledger(frees_blocks=False).peak_tokens(1000, lookahead=3) == 1000
    x = ledger()
    x.record_round(80, 64)
    x.restart()
    assert (x.evicted, x.dropped, x.cache_len(40)) == (0, 0, 40)


def _drive(x: Ledger, until: int) -> list[tuple[int, int]]:
    """The rounds ``(logical length, kept)`` of a request driven token by token, its budget grown at every step
    as the scheduler side grows it, each due round run to the budget."""
    rounds = []
    for logical in range(until):
        x.grow(logical)
        if x.due(logical):
            rounds.append((logical, x.budget))
            x.record_round(x.cache_len(logical), x.budget)
        assert x.cache_len(logical) <= x.trigger
    return rounds


def test_budget_ratio_keeps_that_share_of_a_long_answer() -> None:
    """budget_ratio 1/4 over a budget of 64, prompt 30 (not protected): until the request generated 256 tokens
    (logical 286) the rounds fall every 16 tokens down to 64 as without it; from then on each round keeps a quarter
    of what was generated, (logical - 30) // 4 tokens, and the rounds come every 16 / (1 - 1/4) tokens or so.
    Control: without the ratio the last round keeps 64."""
    x = ledger(base=BUDGET, ratio=0.25)
    rounds = _drive(x, 1000)
    assert [r for r in rounds if r[0] < 286] == [(n, 64) for n in range(80, 286, DIVIDE)]
    late = [r for r in rounds if r[0] >= 300]
    assert late and all(kept == (logical - 30) // 4 for logical, kept in late)
    assert x.budget == 64 + (999 - 30) // 4 - 64 and x.grown == x.budget - 64
    x.restart()  # a preempted request keeps the budget it reached
    x.grow(40)
    assert x.budget == 242
    assert _drive(ledger(base=BUDGET), 1000)[-1][1] == 64


@pytest.mark.parametrize("protect_prompt", [False, True])
def test_the_reference_grows_the_budget_where_the_scheduler_does(protect_prompt: bool) -> None:
    """The transformers reference (its own schedule, no replayed targets) and the ledger put the rounds of a
    request with budget_ratio at the same logical lengths with the same targets, the prompt protected or not.
    Control: a reference config without the ratio disagrees past the point where the ratio takes over."""
    from kvcompact.config import KVCompactConfig
    from kvcompact.reference import _BudgetSchedule

    def reference_rounds(config: KVCompactConfig, until: int) -> list[tuple[int, int]]:
        schedule, cache, rounds = _BudgetSchedule(config, prompt_len=30), 0, []
        for logical in range(until):
            for kept in schedule.due(logical, cache):
                rounds.append((logical, kept))
                cache = kept
            cache += 1
        return rounds

    config = KVCompactConfig(policy="streaming", budget=BUDGET, divide_length=DIVIDE, window=8, n_sink=0,
                             protect_prompt=protect_prompt, budget_ratio=0.25, admission="greedy")
    budget = effective_budget(BUDGET, 30, protect_prompt)
    engine = _drive(ledger(budget=budget, base=BUDGET, ratio=0.25), 1000)
    assert reference_rounds(config, 1000) == engine and engine[-1][1] > budget
    assert reference_rounds(config.replace(budget_ratio=0.0), 1000) != engine
