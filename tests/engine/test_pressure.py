"""Budget mode ``pressure`` (issue 25): the budget is a floor, and rounds run only when the pool cannot cover the
next step. The shrink arithmetic on its own, then the real engine (fp32, bundled model): full attention at light
load, no preemption and exact replay at heavy load, a lone long request that shrinks only when others arrive, and
a floor the pool cannot hold refused at start-up."""

from __future__ import annotations

import pytest

from bugs import generate_rope_at_slot_index
from kvcompact.config import ConfigError, KVCompactConfig, RequestOverrides
from kvcompact.ledger import blocks_held
from kvcompact.pressure import SPREADS, Candidate, fewest, footprint, gain, proportional

BS = 32


def _cands(*lens: int, floor: int = 48, divide: int = 24) -> list[Candidate]:
    peak = blocks_held(floor + divide, BS)
    return [Candidate(f"r{i}", n, floor, peak) for i, n in enumerate(lens)]


@pytest.mark.parametrize("spread", sorted(SPREADS))
@pytest.mark.parametrize("deficit", [1, 3, 6, 12])
def test_targets_cover_the_shortfall_and_respect_the_floor(deficit, spread):
    cands = _cands(400, 300, 100, 60)
    targets = SPREADS[spread](cands, deficit, BS, 24)
    by_key = {c.key: c for c in cands}
    assert sum(gain(by_key[k], t, BS) for k, t in targets.items()) >= deficit
    assert all(by_key[k].floor <= t <= by_key[k].cache_len - 24 for k, t in targets.items())
    assert all(gain(by_key[k], t, BS) > 0 for k, t in targets.items())  # no round that frees nothing


def test_every_request_gives_up_the_same_share_of_its_excess():
    """A shortfall of 6 blocks is taken from all three requests above their floor footprint, the longer ones
    giving up more tokens (each at least divide_length), not the whole of it from the largest cache, which
    alone could cover it."""
    cands = _cands(400, 300, 100)
    targets = proportional(cands, 6, BS, 24)
    assert set(targets) == {"r0", "r1", "r2"}
    dropped = [c.cache_len - targets[c.key] for c in cands]
    assert dropped[0] > dropped[1] > dropped[2] >= 24
    assert gain(cands[0], 48, BS) >= 6


def test_fewest_takes_the_shortfall_from_as_few_requests_as_possible():
    """The shortfall of 6 blocks that ``even`` takes from all three (above) comes from one request: the largest
    cache, which alone covers it, shrunk only as far as needed. Control: ``even`` on the same input rounds all three."""
    cands = _cands(400, 300, 100)
    targets = fewest(cands, 6, BS, 24)
    assert list(targets) == ["r0"]
    t = targets["r0"]
    assert gain(cands[0], t, BS) >= 6 and gain(cands[0], t + 1, BS) < 6  # no deeper than the shortfall needs
    assert len(proportional(cands, 6, BS, 24)) == 3


def test_fewest_takes_from_the_already_compressed_first():
    """A request a round already compressed gives first, even when an intact one holds more; the next request is
    touched only for what the first cannot give. Control: without the flag the larger intact cache is chosen."""
    peak = blocks_held(48 + 24, BS)
    cands = [Candidate("intact", 400, 48, peak), Candidate("compressed", 200, 48, peak, compressed=True)]
    assert list(fewest(cands, 2, BS, 24)) == ["compressed"]
    reclaimable = gain(cands[1], 48, BS)
    both = fewest(cands, reclaimable + 2, BS, 24)
    assert both["compressed"] == 48 and "intact" in both
    unflagged = [Candidate("intact", 400, 48, peak), Candidate("compressed", 200, 48, peak)]
    assert list(fewest(unflagged, 2, BS, 24)) == ["intact"]


def test_fewest_drops_at_least_divide_length():
    """A shortfall of one block still costs the chosen request divide_length tokens (no round per token)."""
    cands = _cands(400)
    assert fewest(cands, 1, BS, 24)["r0"] <= 400 - 24


@pytest.mark.parametrize("spread", sorted(SPREADS))
def test_a_shortfall_beyond_what_is_reclaimable_takes_everything_to_the_floor(spread):
    cands = _cands(400, 300)
    most = sum(footprint(c.cache_len, c.peak, BS) - c.peak for c in cands)
    assert SPREADS[spread](cands, most + 5, BS, 24) == {"r0": 48, "r1": 48}
    assert SPREADS[spread](cands, 0, BS, 24) == {}
    # Requests at or below their floor footprint hold nothing to reclaim.
    assert SPREADS[spread](_cands(48, 60, 95), 1, BS, 24) == {}


def test_budget_mode_is_validated_naming_the_field():
    assert KVCompactConfig(budget_mode="pressure").budget_mode == "pressure"
    assert KVCompactConfig(budget_mode="pressure", pressure_spread="fewest").pressure_spread == "fewest"
    for bad, words in [({"budget_mode": "elastic"}, ["'budget_mode'", "fixed, pressure"]),
                       ({"pressure_spread": "largest"}, ["'pressure_spread'", "fewest, even"]),
                       ({"budget_mode": "pressure", "admission": "greedy"}, ["'budget_mode'", "guaranteed"]),
                       ({"budget_mode": "pressure", "compaction": "none"}, ["'budget_mode'", "repack"])]:
        with pytest.raises(ConfigError) as e:
            KVCompactConfig(**bad)
        assert all(w in str(e.value) for w in words), str(e.value)
    assert RequestOverrides.from_extra_args({"kvcompact_budget_mode": "pressure"}).budget_mode == "pressure"
    with pytest.raises(ConfigError, match="kvcompact_budget_mode"):
        RequestOverrides.from_extra_args({"kvcompact_budget_mode": "sometimes"})
    with pytest.raises(ConfigError, match="kvcompact_budget_mode"):
        RequestOverrides.from_extra_args({"kvcompact_budget_mode": "pressure"},
                                         KVCompactConfig(admission="greedy"))
    # A server drafting with a model (lookahead KV slots) refuses a pressure-mode request, names it.
    with pytest.raises(ConfigError, match="draft-model speculative decoding"):
        RequestOverrides.from_extra_args({"kvcompact_budget_mode": "pressure"}, lookahead=3)


# ------------------------------------------------------------------------------------------------ real engine
# A request's floor footprint: ceil((48 + 24) / 32) = 3 blocks. knorm keeps different tokens per KV head, so the
# replay exercises per-head moves (and holefill's order).
FLOOR = {"policy": "knorm", "budget": 48, "divide_length": 24, "window": 16, "n_sink": 4, "selection": "per_head",
         "budget_mode": "pressure"}


def _prompts(n: int, length: int = 20) -> list[list[int]]:
    from engine import PROMPT, tokenize

    ids = tokenize(PROMPT * 8)
    return [ids[7 * i: 7 * i + length] for i in range(n)]


def _drive(llm, requests, *, arrive=None, check=None):
    """Step the engine by hand: ``requests`` are (id, prompt, params) added at once, ``arrive`` (step, requests)
    more added after that step. Returns the tokens per id, the step at which each id first ran, and the
    preemptions."""
    from engine import external_id, preemptions, scheduler

    s, eng = scheduler(llm), llm.llm_engine
    for rid, ids, params in requests:
        eng.add_request(rid, {"prompt_token_ids": ids}, params)
    tokens, first_ran, step = {}, {}, 0
    with preemptions(llm) as preempted:
        while eng.has_unfinished_requests():
            for out in eng.step():
                tokens[out.request_id] = list(out.outputs[0].token_ids)
            for r in s.running:
                first_ran.setdefault(external_id(r.request_id), step)
            if check is not None:
                check(llm)
            if arrive is not None and step == arrive[0]:
                for rid, ids, params in arrive[1]:
                    eng.add_request(rid, {"prompt_token_ids": ids}, params)
            step += 1
    return tokens, first_ran, len(preempted)


def _by_request(items):
    from engine import external_id

    out: dict[str, list] = {}
    for item in items:
        out.setdefault(external_id(item.req_id), []).append(item)
    return out


@pytest.mark.engine
def test_light_load_keeps_full_attention_where_a_fixed_budget_prunes():
    """Pool of 63 blocks, 4 requests of 20 + 160 tokens (6 blocks each): no round runs and every request's tokens
    equal full attention's (the same batch, compression off). Control: a fixed budget at the same floor prunes
    and changes the tokens."""
    from engine import engine, greedy, round_events, scheduler

    prompts = _prompts(4)
    with engine(FLOOR) as llm:
        def run(xargs):
            start = len(round_events(llm))
            tokens, _, _ = _drive(llm, [(f"{xargs}{i}", p, greedy(160, extra_args=dict(xargs)))
                                        for i, p in enumerate(prompts)])
            return [tokens[f"{xargs}{i}"] for i in range(4)], round_events(llm)[start:]

        pressure, pressure_rounds = run({})
        full, _ = run({"kvcompact": "off"})
        fixed, fixed_rounds = run({"kvcompact_budget_mode": "fixed"})
        totals = scheduler(llm).kvcompact.metrics.totals
    assert pressure_rounds == [] and totals.pressure_rounds == 0
    assert pressure == full
    assert totals.uncompressed_requests == 4  # the pressure requests (off ones do not count, fixed ones ran rounds)
    assert len(fixed_rounds) >= 4 * 5 and fixed != full  # negative control


@pytest.mark.engine
@pytest.mark.parametrize(("compaction", "spread"), [("repack", "even"), ("holefill", "even"), ("repack", "fewest")])
def test_heavy_load_shrinks_instead_of_preempting_and_replays_exactly(compaction, spread):
    """16 usable blocks, 6 requests of different lengths (5 fit at their floor footprint): 0 preemptions, the block
    invariant after every step, every request finishes, and each compressed request's tokens equal the
    transformers reference replaying its recorded targets and keep sets."""
    import torch

    from engine import check_blocks, engine, greedy, model_dir, round_events, worker_rounds
    from kvcompact import reference

    prompts = _prompts(6)
    lengths = [200, 170, 140, 190, 120, 160]
    cfg = dict(FLOOR, compaction=compaction, pressure_spread=spread)
    with engine(cfg, num_blocks=17, max_model_len=256, max_num_seqs=6) as llm:
        tokens, _, preemptions = _drive(llm, [(f"r{i}", p, greedy(n)) for i, (p, n) in
                                              enumerate(zip(prompts, lengths))], check=check_blocks)
        events, logs = _by_request(round_events(llm)), _by_request(worker_rounds(llm))
    assert preemptions == 0
    assert [len(tokens[f"r{i}"]) for i in range(6)] == lengths
    assert all(e.pressure for es in events.values() for e in es)
    kept = {e.new_len for es in events.values() for e in es}
    assert max(kept) > cfg["budget"] and min(kept) >= cfg["budget"]  # targets above the floor, never below
    # several rounds on one request (fewest shrinks a request only as far as the step's shortfall needs, so its
    # victims can reach the floor in fewer, deeper rounds)
    assert max(len(es) for es in events.values()) >= (3 if spread == "even" else 2)
    model = reference.load_model(model_dir(), dtype=torch.float32)
    config = KVCompactConfig(**cfg)
    for rid, es in events.items():
        i = int(rid[1:])
        targets = [(e.logical_len, e.new_len) for e in es]
        keep_sets = [log.keep for log in logs[rid]]
        ref, _ = reference.generate(model, prompts[i], lengths[i], config, keep_sets=keep_sets, targets=targets)
        assert ref == tokens[rid], rid
    # Negative controls on the request with the most rounds: RoPE at the slot index changes the tokens, and the
    # keep sets do not fit the fixed budget's trigger (the targets are what the replay needs).
    rid = max(events, key=lambda r: len(events[r]))
    i, keep_sets = int(rid[1:]), [log.keep for log in logs[rid]]
    targets = [(e.logical_len, e.new_len) for e in events[rid]]
    bad, _ = generate_rope_at_slot_index(model, prompts[i], lengths[i], config, keep_sets=keep_sets, targets=targets)
    assert bad != tokens[rid]
    with pytest.raises(ValueError):
        reference.generate(model, prompts[i], lengths[i], config.replace(budget_mode="fixed"), keep_sets=keep_sets)


@pytest.mark.engine
def test_a_lone_long_request_keeps_full_attention_until_others_arrive():
    """One request (20 + 300 tokens) runs alone in 28 usable blocks; after 200 steps 8 more arrive. Until then it
    runs no round and its tokens are full attention's; then it shrinks in that very step, and the 8 are admitted in
    the same steps as with a fixed budget at the floor. Control: a long request that never shrinks (compression
    off) delays some of them."""
    from engine import engine, greedy, round_events

    long_prompt, *short = _prompts(9)

    with engine(FLOOR, num_blocks=29, max_model_len=512, max_num_seqs=9) as llm:
        def run(long_xargs, xargs):
            start = len(round_events(llm))
            arrivals = [(f"s{i}", p, greedy(60, extra_args=dict(xargs))) for i, p in enumerate(short)]
            tokens, first_ran, preemptions = _drive(llm, [("long", long_prompt, greedy(300, extra_args=long_xargs))],
                                                    arrive=(199, arrivals))
            assert preemptions == 0
            return tokens, first_ran, [e for e in round_events(llm)[start:] if e.req_id.startswith("long")]

        tokens, first_ran, long_rounds = run({}, {})
        full, full_first_ran, _ = run({"kvcompact": "off"}, {"kvcompact": "off"})
        fixed = {"kvcompact_budget_mode": "fixed"}
        fixed_tokens, fixed_first_ran, _ = run(fixed, fixed)
        _, unshrunk_first_ran, _ = run({"kvcompact": "off"}, fixed)
    prompt_len = len(long_prompt)
    # After step k (0-based) the long request has computed prompt_len + k tokens: the others arrived after step 199.
    assert long_rounds and long_rounds[0].logical_len == prompt_len + 199
    assert long_rounds[0].pressure and long_rounds[0].new_len > FLOOR["budget"]
    assert tokens["long"][:200] == full["long"][:200]
    assert fixed_tokens["long"][:200] != full["long"][:200]  # control: the fixed budget pruned meanwhile
    assert first_ran == fixed_first_ran and min(first_ran[f"s{i}"] for i in range(8)) == 200
    assert unshrunk_first_ran != fixed_first_ran  # control: without shrinking, some wait longer


def test_a_floor_the_pool_cannot_hold_is_refused_at_start_up():
    """budget 200 + divide_length 24 needs 7 blocks of 32; the scheduler side vLLM's Scheduler builds at start-up
    refuses a pool of 5 usable blocks naming 'budget' (vLLM's real KVCacheManager; a live engine that fails to
    start in-process would leave its process group behind for the tests after it). Control: 7 usable blocks."""
    from types import SimpleNamespace

    import torch
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

    from kvcompact.vllm.metrics import Metrics
    from kvcompact.vllm.scheduler_side import SchedulerSide

    config = KVCompactConfig(**dict(FLOOR, budget=200))

    def side(num_blocks: int) -> SchedulerSide:
        spec = FullAttentionSpec(block_size=BS, num_kv_heads=1, head_size=8, dtype=torch.float32)
        kvm = KVCacheManager(KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[],
                                           kv_cache_groups=[KVCacheGroupSpec(["layer.0"], spec)]),
                             max_model_len=256, scheduler_block_size=BS, hash_block_size=BS, enable_caching=False)
        metrics = Metrics(config, False, "pressure", engine=0, block_size=BS)
        return SchedulerSide(config, SimpleNamespace(kv_cache_manager=kvm, max_model_len=256, num_lookahead_tokens=0),
                             metrics)

    with pytest.raises(ConfigError, match="'budget' \\(200\\)") as e:
        side(6)
    assert "7 blocks" in str(e.value) and "only 5" in str(e.value)
    assert side(8).block_size == BS  # control: 7 usable blocks hold the floor footprint


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
    from engine import PROMPT, check_blocks, engine, greedy, round_events, scheduler, tokenize

    ids = tokenize(PROMPT * 8)
    system = ids[:64]
    prompts = [system + ids[100 + 11 * i: 110 + 11 * i] for i in range(6)]
    lengths = [150, 130, 110, 140, 100, 120]
    with engine(FLOOR, num_blocks=17, max_model_len=320, max_num_seqs=6, enable_prefix_caching=True) as llm:
        side = scheduler(llm).kvcompact

        def run(tag: str):
            before, start = side.metrics.totals.deferred_rounds, len(round_events(llm))
            tokens, _, preemptions = _drive(llm, [(f"{tag}{i}", p, greedy(n)) for i, (p, n) in
                                                  enumerate(zip(prompts, lengths))], check=check_blocks)
            copies = sum(1 for e in round_events(llm)[start:] if e.pressure)
            return tokens, preemptions, side.metrics.totals.deferred_rounds - before, copies

        copied_before = side.metrics.totals.blocks_copied
        tokens, preemptions, deferred, pressure_rounds = run("r")
        copied = side.metrics.totals.blocks_copied - copied_before
        side.admission.duplicate_blocks = lambda running: 0  # control: a shared block counted once per holder
        control_tokens, control_preemptions, control_deferred, _ = run("c")
    print(f"\nshared system prompt, pressure: {pressure_rounds} pressure rounds, {copied} blocks copied, "
          f"{preemptions} preemptions, {deferred} deferred; control: {control_preemptions} preemptions, "
          f"{control_deferred} deferred")
    assert [len(tokens[f"r{i}"]) for i in range(6)] == lengths
    assert preemptions == 0 and deferred == 0
    assert pressure_rounds >= 6 and copied > 0
    assert control_preemptions + control_deferred > 0
