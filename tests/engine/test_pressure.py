"""Budget mode ``pressure`` (issue 25) on the real engine (fp32, bundled model): full attention at light load,
no preemption and exact replay at heavy load (under greedy admission: stock vLLM's concurrency, fewer
preemptions than stock), a lone long request that shrinks only when others arrive, and a
shared system prompt with prefix caching that fills the pool without preempting. The shrink arithmetic and the
start-up refusal without an engine: tests/unit/test_pressure_targets.py."""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import pytest

from kvcompact.config import RECALL_DEFAULTS, KVCompactConfig
from support import FIXED
from support.mutants import generate_rope_at_slot_index

# A request's floor footprint: ceil((48 + 24) / 32) = 3 blocks. knorm keeps different tokens per KV head, so the
# replay exercises per-head moves (and holefill's order).
FLOOR = {"policy": "knorm", "budget": 48, "divide_length": 24, "window": 16, "n_sink": 4, "selection": "per_head",
         "budget_mode": "pressure", "protect_prompt": False}
# The same with budget_mode and protect_prompt left to the shipped defaults (`kvcompact serve` with no option).
SHIPPED = {k: v for k, v in FLOOR.items() if k not in FIXED}


def _prompts(n: int, length: int = 20) -> list[list[int]]:
    from support.engine import PROMPT, tokenize

    ids = tokenize(PROMPT * 8)
    return [ids[7 * i: 7 * i + length] for i in range(n)]


class Drive(NamedTuple):
    tokens: dict[str, list[int]]    # per request id
    first_ran: dict[str, int]       # the step at which each request first ran
    preempted: list[Any]            # support.engine.Preemption, in order
    peak_running: int               # the most requests running in one step


def _drive(llm, requests, *, arrive=None, check=None) -> Drive:
    """Step the engine by hand: ``requests`` are (id, prompt, params) added at once, ``arrive`` (step, requests)
    more added after that step."""
    from support.engine import external_id, preemptions, scheduler

    s, eng = scheduler(llm), llm.llm_engine
    for rid, ids, params in requests:
        eng.add_request(rid, {"prompt_token_ids": ids}, params)
    tokens, first_ran, step, peak = {}, {}, 0, 0
    with preemptions(llm) as preempted:
        while eng.has_unfinished_requests():
            for out in eng.step():
                tokens[out.request_id] = list(out.outputs[0].token_ids)
            peak = max(peak, len(s.running))
            for r in s.running:
                first_ran.setdefault(external_id(r.request_id), step)
            if check is not None:
                check(llm)
            if arrive is not None and step == arrive[0]:
                for rid, ids, params in arrive[1]:
                    eng.add_request(rid, {"prompt_token_ids": ids}, params)
            step += 1
    return Drive(tokens, first_ran, preempted, peak)


HEAVY_LENGTHS = [200, 170, 140, 190, 120, 160]  # six requests of 20 + these tokens, 3-block floors in 16 blocks
SHARED_LENGTHS = [150, 130, 110, 140, 100, 120]  # six requests sharing a 64-token system prompt


def _load(tag: str, prompts: list[list[int]], lengths: list[int]):
    """Requests (id, prompt, params): ``{tag}{i}`` generating ``lengths[i]`` tokens after ``prompts[i]``."""
    from support.engine import greedy

    return [(f"{tag}{i}", p, greedy(n)) for i, (p, n) in enumerate(zip(prompts, lengths))]


def _heavy_load():
    """The heavy load's requests (id, prompt, params) and their prompts."""
    prompts = _prompts(6)
    return _load("r", prompts, HEAVY_LENGTHS), prompts


def _shared_prompts() -> list[list[int]]:
    """Six prompts: the same 64-token system prompt (two blocks), then 10 tokens of their own."""
    from support.engine import PROMPT, tokenize

    ids = tokenize(PROMPT * 8)
    return [ids[:64] + ids[100 + 11 * i: 110 + 11 * i] for i in range(6)]


def _replay(generate, model, config, rid, prompts, events, logs, lengths=HEAVY_LENGTHS, recalls=None):
    """Request ``rid``'s tokens (``{tag}{i}``, ``lengths[i]`` tokens after ``prompts[i]``) as ``generate`` (the
    transformers reference, or a mutant of it) gives them, replaying its recorded targets and keep sets (and
    ``recalls``, the recall tier's swaps, where given)."""
    i = int(rid[1:])
    targets = [(e.logical_len, e.kept_len) for e in events[rid]]
    keep_sets = [log.keep_mask for log in logs[rid]]
    return generate(model, prompts[i], lengths[i], config, keep_sets=keep_sets, targets=targets, recalls=recalls)[0]


def _replay_unpreempted(run: Drive, events, logs, cfg, model, prompts, lengths, n: int) -> list[str]:
    """Replay the ``n`` requests of ``run`` never preempted with the most rounds (each replay costs a transformers
    forward per token) and assert each equals the engine's tokens; returns their ids."""
    from kvcompact import reference

    preempted = {p.request_id for p in run.preempted}
    replayed = sorted((rid for rid in events if rid not in preempted), key=lambda r: -len(events[r]))[:n]
    assert len(replayed) == n, (sorted(events), preempted)
    config = KVCompactConfig(**cfg)
    for rid in replayed:
        ref = _replay(reference.generate, model, config, rid, prompts, events, logs, lengths)
        assert ref == run.tokens[rid], rid
    return replayed


def _by_request(items):
    from support.engine import external_id

    out: dict[str, list] = {}
    for item in items:
        out.setdefault(external_id(item.req_id), []).append(item)
    return out


@pytest.mark.engine
@pytest.mark.parametrize("config", [pytest.param(FLOOR, marks=pytest.mark.extended), SHIPPED],
                         ids=["pressure", "shipped_defaults"])
def test_light_load_keeps_full_attention_where_a_fixed_budget_prunes(config):
    """Pool of 63 blocks, 4 requests of 20 + 160 tokens (6 blocks each): no round runs and every request's tokens
    equal full attention's (the same batch, compression off), in budget mode pressure and under the shipped
    defaults. Control: a fixed budget at the same floor prunes and changes the tokens."""
    from support.engine import engine, greedy, round_events, scheduler

    prompts = _prompts(4)
    with engine(config) as llm:
        def run(xargs):
            start = len(round_events(llm))
            tokens = _drive(llm, [(f"{xargs}{i}", p, greedy(160, extra_args=dict(xargs)))
                                  for i, p in enumerate(prompts)]).tokens
            return [tokens[f"{xargs}{i}"] for i in range(4)], round_events(llm)[start:]

        pressure, pressure_rounds = run({})
        full, _ = run({"kvcompact": "off"})
        fixed, fixed_rounds = run({"kvcompact_budget_mode": "fixed"})
        totals = scheduler(llm).kvcompact.metrics.totals
    assert pressure_rounds == [] and totals.pressure_rounds == 0
    assert pressure == full
    assert totals.uncompressed_requests == 4  # the pressure requests (off ones do not count, fixed ones ran rounds)
    # negative control: rounds every 24 tokens from the trigger, 48 + 24 (5 per request), or 20 + 48 + 24 with the
    # 20-token prompt kept (4 per request)
    per_request = 4 if config.get("protect_prompt", KVCompactConfig.protect_prompt) else 5
    assert len(fixed_rounds) >= 4 * per_request and fixed != full


@pytest.mark.engine
# holefill with the even spread; repack with the fewest spread (the default) replays below, under greedy admission
@pytest.mark.parametrize(("compaction", "spread"), [("holefill", "even")])
def test_heavy_load_shrinks_instead_of_preempting_and_replays_exactly(compaction, spread, reference_model):
    """16 usable blocks, 6 requests of different lengths (5 fit at their floor footprint): 0 preemptions, the block
    invariant after every step, every request finishes, and the three compressed requests with the most rounds
    equal the transformers reference replaying their recorded targets and keep sets."""
    from kvcompact import reference
    from support.engine import check_blocks, engine, round_events, worker_rounds

    load, prompts = _heavy_load()
    cfg = dict(FLOOR, compaction=compaction, pressure_spread=spread)
    with engine(cfg, num_blocks=17, max_model_len=256, max_num_seqs=6) as llm:
        run = _drive(llm, load, check=check_blocks)
        events, logs = _by_request(round_events(llm)), _by_request(worker_rounds(llm))
    tokens = run.tokens
    assert not run.preempted and run.peak_running == 5  # guaranteed admission: the sixth waits for the first to finish
    assert [len(tokens[f"r{i}"]) for i in range(6)] == HEAVY_LENGTHS
    assert all(e.pressure for es in events.values() for e in es)
    kept = {e.kept_len for es in events.values() for e in es}
    assert max(kept) > cfg["budget"] and min(kept) >= cfg["budget"]  # targets above the floor, never below
    # several rounds on one request (fewest shrinks a request only as far as the step's shortfall needs, so its
    # victims can reach the floor in fewer, deeper rounds)
    assert max(len(es) for es in events.values()) >= (3 if spread == "even" else 2)
    model = reference_model
    config = KVCompactConfig(**cfg)
    _replay_unpreempted(run, events, logs, cfg, model, prompts, HEAVY_LENGTHS, 3)
    # Negative controls on the request with the most rounds: RoPE at the slot index changes the tokens, and the
    # keep sets do not fit the fixed budget's trigger (the targets are what the replay needs).
    rid = max(events, key=lambda r: len(events[r]))
    assert _replay(generate_rope_at_slot_index, model, config, rid, prompts, events, logs) != tokens[rid]
    i, keep_sets = int(rid[1:]), [log.keep_mask for log in logs[rid]]
    with pytest.raises(ValueError):
        reference.generate(model, prompts[i], HEAVY_LENGTHS[i], config.replace(budget_mode="fixed"),
                           keep_sets=keep_sets)


@pytest.mark.engine
def test_greedy_admission_runs_stocks_concurrency_and_shrinks_before_vllm_preempts(reference_model):
    """Under ``admission: greedy`` budget mode pressure admits as vLLM does. The heavy load above (6 requests, 16
    usable blocks, floors of 3 blocks of which only 5 fit) runs as many requests at once as stock vLLM (kvcompact
    not configured, the same pool and max_num_seqs: 6, where guaranteed admission runs 5) and is preempted less
    often than stock, every request finishing, the block invariant after every step; three requests never
    preempted equal the transformers reference replaying their targets and keep sets."""
    from support.engine import check_blocks, engine, round_events, worker_rounds

    with engine(None, num_blocks=17, max_model_len=256, max_num_seqs=6) as llm:
        stock = _drive(llm, _heavy_load()[0])
    cfg = dict(FLOOR, compaction="repack", admission="greedy")
    load, prompts = _heavy_load()  # fresh sampling parameters for each engine
    with engine(cfg, num_blocks=17, max_model_len=256, max_num_seqs=6) as llm:
        run = _drive(llm, load, check=check_blocks)
        events, logs = _by_request(round_events(llm)), _by_request(worker_rounds(llm))
    print(f"\ngreedy admission, pressure: peak running {run.peak_running}, {len(run.preempted)} preemptions; stock "
          f"vLLM: peak running {stock.peak_running}, {len(stock.preempted)} preemptions")
    assert run.peak_running == stock.peak_running == 6
    assert len(run.preempted) < len(stock.preempted)
    assert [len(run.tokens[f"r{i}"]) for i in range(6)] == HEAVY_LENGTHS
    assert all(e.pressure for es in events.values() for e in es)
    _replay_unpreempted(run, events, logs, cfg, reference_model, prompts, HEAVY_LENGTHS, 3)


@pytest.mark.engine
def test_a_lone_long_request_keeps_full_attention_until_others_arrive():
    """One request (20 + 300 tokens) runs alone in 28 usable blocks; after 200 steps 8 more arrive. Until then it
    runs no round and its tokens are full attention's; then it shrinks in that very step, and the 8 are admitted in
    the same steps as with a fixed budget at the floor. Control: a long request that never shrinks (compression
    off) delays some of them."""
    from support.engine import engine, greedy, round_events

    long_prompt, *short = _prompts(9)

    with engine(FLOOR, num_blocks=29, max_model_len=512, max_num_seqs=9) as llm:
        def run(long_xargs, xargs):
            start = len(round_events(llm))
            arrivals = [(f"s{i}", p, greedy(60, extra_args=dict(xargs))) for i, p in enumerate(short)]
            tokens, first_ran, preempted, _ = _drive(llm, [("long", long_prompt, greedy(300, extra_args=long_xargs))],
                                                    arrive=(199, arrivals))
            assert not preempted
            return tokens, first_ran, [e for e in round_events(llm)[start:] if e.req_id.startswith("long")]

        tokens, first_ran, long_rounds = run({}, {})
        full, full_first_ran, _ = run({"kvcompact": "off"}, {"kvcompact": "off"})
        fixed = {"kvcompact_budget_mode": "fixed"}
        fixed_tokens, fixed_first_ran, _ = run(fixed, fixed)
        _, unshrunk_first_ran, _ = run({"kvcompact": "off"}, fixed)
    prompt_len = len(long_prompt)
    # After step k (0-based) the long request has computed prompt_len + k tokens: the others arrived after step 199.
    assert long_rounds and long_rounds[0].logical_len == prompt_len + 199
    assert long_rounds[0].pressure and long_rounds[0].kept_len > FLOOR["budget"]
    assert tokens["long"][:200] == full["long"][:200]
    assert fixed_tokens["long"][:200] != full["long"][:200]  # control: the fixed budget pruned meanwhile
    assert first_ran == fixed_first_ran and min(first_ran[f"s{i}"] for i in range(8)) == 200
    assert unshrunk_first_ran != fixed_first_ran  # control: without shrinking, some wait longer


@pytest.mark.engine
def test_shared_system_prompt_with_prefix_caching_fills_the_pool_without_preempting():
    """Prefix caching on (vLLM's and ``kvcompact serve``'s default): six requests share a 64-token system prompt
    (two blocks) in 16 usable blocks, far less than their full lengths need. A pressure round keeps
    the shared blocks, so it must copy them first (copy on write), and the pool is short exactly when it runs: the
    copies are counted in every footprint (a block shared by n requests is one block of the pool, and up to n - 1
    copies of it). 0 preemptions, no deferred round, every request finishes, the block invariant (reference
    counts = holders, a compressed request holds no shared block) after every step. Control: the same load with
    the footprints counting a shared block once per holder (the accounting before copies were counted) runs
    short of blocks for its copies."""
    from support.engine import check_blocks, engine, round_events, scheduler

    prompts = _shared_prompts()
    with engine(FLOOR, num_blocks=17, max_model_len=320, max_num_seqs=6, enable_prefix_caching=True) as llm:
        side = scheduler(llm).kvcompact

        def run(tag: str):
            before, start = side.metrics.totals.deferred_rounds, len(round_events(llm))
            tokens, _, preempted, _ = _drive(llm, _load(tag, prompts, SHARED_LENGTHS), check=check_blocks)
            copies = sum(1 for e in round_events(llm)[start:] if e.pressure)
            return tokens, len(preempted), side.metrics.totals.deferred_rounds - before, copies

        copied_before = side.metrics.totals.blocks_copied
        tokens, preemptions, deferred, pressure_rounds = run("r")
        copied = side.metrics.totals.blocks_copied - copied_before
        side.admission.duplicate_blocks = lambda running: 0  # control: a shared block counted once per holder
        control_tokens, control_preemptions, control_deferred, _ = run("c")
    print(f"\nshared system prompt, pressure: {pressure_rounds} pressure rounds, {copied} blocks copied, "
          f"{preemptions} preemptions, {deferred} deferred; control: {control_preemptions} preemptions, "
          f"{control_deferred} deferred")
    assert [len(tokens[f"r{i}"]) for i in range(6)] == SHARED_LENGTHS
    assert preemptions == 0 and deferred == 0
    assert pressure_rounds >= 6 and copied > 0
    assert control_preemptions + control_deferred > 0


@pytest.mark.engine
@pytest.mark.extended
def test_greedy_admission_with_a_shared_prompt_and_prefix_caching(reference_model):
    """Greedy admission with prefix caching on and a shared system prompt: the load above, where vLLM admits as
    it would without kvcompact, so it may also preempt a request whose prefix blocks are shared and resume it from
    the prefix cache. As many running at once as stock vLLM (kvcompact not configured, the same pool, prefix
    caching on), preempted less often than stock, every request finishing, the block invariant (reference counts =
    holders, a compressed request holds no shared block) after every step; two requests never preempted equal the
    transformers reference replaying their targets and keep sets. Negative control: rounds without the copy on
    write break the invariant."""
    from support.engine import check_blocks, engine, round_events, scheduler, worker_rounds

    prompts = _shared_prompts()

    pool = dict(num_blocks=17, max_model_len=320, max_num_seqs=6, enable_prefix_caching=True)
    with engine(None, **pool) as llm:
        stock = _drive(llm, _load("s", prompts, SHARED_LENGTHS))
    cfg = dict(FLOOR, admission="greedy")
    with engine(cfg, **pool) as llm:
        run = _drive(llm, _load("r", prompts, SHARED_LENGTHS), check=check_blocks)
        events, logs = _by_request(round_events(llm)), _by_request(worker_rounds(llm))
        copied = scheduler(llm).kvcompact.metrics.totals.blocks_copied
    print(f"\ngreedy admission, shared prompt: peak running {run.peak_running}, {len(run.preempted)} preemptions, "
          f"{copied} blocks copied; stock vLLM: peak running {stock.peak_running}, {len(stock.preempted)} preemptions")
    assert run.peak_running == stock.peak_running
    assert len(run.preempted) < len(stock.preempted)
    assert [len(run.tokens[f"r{i}"]) for i in range(6)] == SHARED_LENGTHS
    assert all(e.pressure for es in events.values() for e in es) and copied > 0
    _replay_unpreempted(run, events, logs, cfg, reference_model, prompts, SHARED_LENGTHS, 2)
    # Negative control: rounds that skip the copy on write compact the shared blocks in place; the invariant
    # (a compressed request holds no shared block) catches it in the step of the first round.
    with engine(cfg, **pool) as llm:
        scheduler(llm).kvcompact.reclaimer.unwritable = lambda blocks: []
        with pytest.raises(AssertionError, match="compressed, shared block"):
            _drive(llm, _load("c", prompts, SHARED_LENGTHS), check=check_blocks)


def _latch_breaches(events: dict[str, list[Any]], budget: int, divide_length: int) -> list[str]:
    """What breaks budget mode latch's shape in a run's rounds (empty: none): a request's first round is a pressure
    round straight to the floor, every later one a fixed round from the trigger back to the floor."""
    out = []
    for rid, es in events.items():
        first, *later = es
        if not first.pressure or first.kept_len != budget:
            out.append(f"{rid}: first round pressure={first.pressure} kept {first.kept_len}")
        out += [f"{rid}: later round pressure={e.pressure} {e.cache_len} -> {e.kept_len}" for e in later
                if e.pressure or (e.cache_len, e.kept_len) != (budget + divide_length, budget)]
    return out


@pytest.mark.engine
def test_latch_holds_a_request_the_pool_shrank_at_its_budget_and_replays_exactly(reference_model):
    """Budget mode latch under greedy admission (``kvcompact serve``'s admission) with prefix caching on and a
    shared system prompt: a request keeps every token until the pool first runs short for it; that round takes it
    to its floor and every later one is a fixed round from the trigger (budget + divide_length) back to it. Every
    request finishes, the block invariant after every step, and two requests never preempted equal the transformers
    reference replaying their targets and keep sets. Controls: the same load in budget mode pressure (a
    per-request override on the same engine) breaks the latch's shape, and a fixed-budget replay of the latched
    keep sets does not fit them."""
    from kvcompact import reference
    from kvcompact.tools.local_engine import forget_prefixes
    from support.engine import check_blocks, engine, greedy, round_events, worker_rounds

    prompts = _shared_prompts()
    cfg = dict(FLOOR, budget_mode="latch", admission="greedy")
    budget, divide = cfg["budget"], cfg["divide_length"]
    with engine(cfg, num_blocks=17, max_model_len=320, max_num_seqs=6, enable_prefix_caching=True) as llm:
        run = _drive(llm, _load("r", prompts, SHARED_LENGTHS), check=check_blocks)
        events, logs = _by_request(round_events(llm)), _by_request(worker_rounds(llm))
        forget_prefixes(llm)
        start = len(round_events(llm))
        control = [(f"p{i}", p, greedy(n, extra_args={"kvcompact_budget_mode": "pressure"}))
                   for i, (p, n) in enumerate(zip(prompts, SHARED_LENGTHS))]
        _drive(llm, control, check=check_blocks)
        control_events = _by_request(round_events(llm)[start:])
    assert [len(run.tokens[f"r{i}"]) for i in range(6)] == SHARED_LENGTHS
    assert events and max(len(es) for es in events.values()) >= 2  # latched requests went on with fixed rounds
    assert _latch_breaches(events, budget, divide) == []
    assert _latch_breaches(control_events, budget, divide) != []  # control: pressure rounds stop above the floor
    rid = _replay_unpreempted(run, events, logs, cfg, reference_model, prompts, SHARED_LENGTHS, 2)[0]
    # control: the latched keep sets do not fit a fixed budget's schedule (the first round fell off the trigger)
    config = KVCompactConfig(**cfg)
    i, keep_sets = int(rid[1:]), [log.keep_mask for log in logs[rid]]
    with pytest.raises(ValueError):
        reference.generate(reference_model, prompts[i], SHARED_LENGTHS[i], config.replace(budget_mode="fixed"),
                           keep_sets=keep_sets)


def _latch_run_into_the_reserve(reserve: float) -> tuple[dict[str, list[Any]], list[str], Drive]:
    """Four requests of the latch test's load (greedy admission, prefix caching on, the shared system prompt; the
    pool holds their trigger footprints with blocks to spare) in budget mode latch with ``pressure_reserve``
    ``reserve``: the rounds per request, and every step that ended with fewer free blocks than a reserve of 0.3
    while a request that had not latched held a block beyond its trigger's (budget + divide_length)."""
    from kvcompact.ledger import blocks_held
    from support.engine import check_blocks, engine, external_id, round_events, scheduler

    cfg = dict(FLOOR, budget_mode="latch", admission="greedy", pressure_reserve=reserve)
    num_blocks, into, steps = 17, [], [0]
    reserved = math.ceil(0.3 * num_blocks)

    def check(llm: Any) -> None:
        check_blocks(llm)
        side, steps[0] = scheduler(llm).kvcompact, steps[0] + 1
        held = side.manager.req_to_blocks
        grown = [external_id(r.request_id) for r in scheduler(llm).running
                 if (ledger := side.ledger(r.request_id)) is not None and ledger.pressure
                 and len(held.get(r.request_id, ())) > blocks_held(ledger.trigger, side.block_size)]
        free = side.block_pool.get_num_free_blocks()
        if grown and free < reserved:
            into.append(f"step {steps[0]}: {grown} past their trigger, {free} blocks free")

    with engine(cfg, num_blocks=num_blocks, max_model_len=320, max_num_seqs=6, enable_prefix_caching=True) as llm:
        run = _drive(llm, _load("r", _shared_prompts()[:4], SHARED_LENGTHS[:4]), check=check)
        events = _by_request(round_events(llm))
    return events, into, run


@pytest.mark.engine
def test_pressure_reserve_latches_requests_before_the_pools_last_blocks_with_prefix_caching():
    """``pressure_reserve`` 0.3 on the real engine under budget mode latch (greedy admission, prefix caching on, a
    shared system prompt): every request finishes, the block invariant holds after every step, the latch's shape
    holds (a first pressure round to the floor, fixed rounds after), and no step leaves fewer than the reserved
    blocks free while a request that has not latched holds a block beyond its trigger's: it latches there instead.
    Control: without the reserve the same load grows requests past their trigger into the pool's last blocks
    before the pool first runs short."""
    events, into, run = _latch_run_into_the_reserve(0.3)
    assert [len(run.tokens[f"r{i}"]) for i in range(4)] == SHARED_LENGTHS[:4]
    assert len(events) == 4 and _latch_breaches(events, FLOOR["budget"], FLOOR["divide_length"]) == []
    assert into == []
    _, into, _ = _latch_run_into_the_reserve(0.0)
    assert into


@pytest.mark.engine
def test_latch_with_the_recall_tier_as_serve_runs_it_replays_exactly(reference_model):
    """``kvcompact serve``'s default shape (``config.RECALL_DEFAULTS``: budget mode latch under greedy admission with a
    tenth of the pool reserved, the recall tier deciding inside the forward from every stored key, with spans and
    its values in int8) at this model's scale, on the latch test's tight pool with a shared system prompt and prefix
    caching on (the prompt evictable as there, so the rounds reach the shared blocks): every request finishes, the
    block invariant holds after every step, the latch's shape holds with the recall tier swapping between rounds,
    and the two requests never preempted with the most rounds equal the transformers reference replaying their
    targets, keep sets and recalls. Control: the same replays without the recalls do not give the engine's tokens."""
    from kvcompact import reference
    from support.engine import check_blocks, engine, round_events, worker_rounds, worker_side

    prompts = _shared_prompts()
    shape = ("budget_mode", "admission", "selection", "recall_at", "recall_dtype", "recall_search",
             "pressure_reserve")  # serve's own
    cfg = dict(FLOOR, **{k: RECALL_DEFAULTS[k] for k in shape}, recall_tokens=256, recall_span=2, recall_margin=1e9)
    with engine(cfg, num_blocks=17, max_model_len=320, max_num_seqs=6, enable_prefix_caching=True) as llm:
        recalls: list[Any] = []
        worker_side(llm).recall_listeners.append(recalls.append)
        run = _drive(llm, _load("r", prompts, SHARED_LENGTHS), check=check_blocks)
        events, logs = _by_request(round_events(llm)), _by_request(worker_rounds(llm))
    assert [len(run.tokens[f"r{i}"]) for i in range(6)] == SHARED_LENGTHS
    assert _latch_breaches(events, cfg["budget"], cfg["divide_length"]) == []
    swapped, every = _by_request(e for e in recalls if e.num_tokens), _by_request(recalls)
    preempted = {p.request_id for p in run.preempted}
    replayed = sorted((rid for rid in events if rid not in preempted and rid in swapped),
                      key=lambda r: -len(events[r]))[:2]
    assert len(replayed) == 2 and all(len(events[rid]) >= 2 for rid in replayed), (sorted(swapped), preempted)
    config = KVCompactConfig(**cfg)
    for rid in replayed:
        replay = (reference.generate, reference_model, config, rid, prompts, events, logs, SHARED_LENGTHS)
        assert _replay(*replay, recalls=every[rid]) == run.tokens[rid], rid
        try:  # control: the rounds alone, the recalls left out
            alone = _replay(*replay)
        except ValueError:  # a keep set names a slot only a recall filled: refused, which also catches it
            alone = None
        assert alone != run.tokens[rid], rid


def _ratio_breaches(events: dict[str, list[Any]], budget: int, divide_length: int, ratio: float,
                    prompt_len: int) -> list[str]:
    """What breaks budget_ratio's shape under budget mode latch (empty: none): every round keeps the budget grown
    to ``ratio`` of what the request generated before its step, ``budget + max(0, int(ratio * generated) -
    budget)``, and every round after the first falls where the cache reaches that budget plus ``divide_length``."""
    out = []
    for rid, es in events.items():
        for n, e in enumerate(es):
            want = budget + max(0, int(ratio * (e.logical_len - prompt_len)) - budget)
            if e.kept_len != want or (n and e.cache_len != want + divide_length):
                out.append(f"{rid}: round {n} at {e.logical_len}: {e.cache_len} -> {e.kept_len}, want {want}")
    return out


@pytest.mark.engine
def test_budget_ratio_grows_the_latched_budget_with_the_answer_and_replays_exactly(reference_model):
    """budget_ratio 0.6 over the latch test's floor of 48 (greedy admission, prefix caching on, the shared system
    prompt, a pool where vLLM preempts once the budgets grow): past 80 generated tokens each round keeps 0.6 of what
    the request generated. Every request finishes, the block invariant holds after every step, every round keeps
    the grown budget and falls at its trigger, and the two requests never preempted with the most rounds equal the
    transformers reference replaying their targets and keep sets. Control: the same rounds checked against a
    budget that does not grow breach it."""
    from support.engine import check_blocks, engine, round_events, worker_rounds

    prompts = _shared_prompts()
    ratio = 0.6
    cfg = dict(FLOOR, budget_mode="latch", admission="greedy", budget_ratio=ratio)
    budget, divide = cfg["budget"], cfg["divide_length"]
    with engine(cfg, num_blocks=17, max_model_len=320, max_num_seqs=6, enable_prefix_caching=True) as llm:
        run = _drive(llm, _load("r", prompts, SHARED_LENGTHS), check=check_blocks)
        events, logs = _by_request(round_events(llm)), _by_request(worker_rounds(llm))
    assert [len(run.tokens[f"r{i}"]) for i in range(6)] == SHARED_LENGTHS
    assert max(e.kept_len for es in events.values() for e in es) > budget  # the budgets grew
    prompt_len = len(prompts[0])
    assert _ratio_breaches(events, budget, divide, ratio, prompt_len) == []
    assert _ratio_breaches(events, budget, divide, 0.0, prompt_len) != []  # control: a budget that does not grow
    _replay_unpreempted(run, events, logs, cfg, reference_model, prompts, SHARED_LENGTHS, 2)
