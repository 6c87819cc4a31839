"""Budget mode ``pressure`` (issue 25) without an engine: the shrink arithmetic (targets per spread), the
budget mode's validation, and a floor the pool cannot hold refused by the scheduler side vLLM builds at start-up.
The real engine under pressure: tests/engine/test_pressure.py."""

from __future__ import annotations

import pytest

from kvcompact.config import ConfigError, KVCompactConfig, RequestOverrides
from kvcompact.ledger import blocks_held
from kvcompact.pressure import SPREADS, Candidate, every, fewest, footprint, gain, proportional

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


def test_all_takes_every_request_holding_a_block_beyond_its_floor_to_its_floor():
    """A shortfall of one block takes each of the three requests above their floor footprint to the floor (under
    budget mode latch: all three latch at once); the one at 60 tokens, within its floor footprint, has nothing to
    give and is left alone. Control: ``fewest`` covers the same block from the largest request alone."""
    cands = _cands(400, 300, 100, 60)
    assert every(cands, 1, BS, 24) == {"r0": 48, "r1": 48, "r2": 48}
    assert list(fewest(cands, 1, BS, 24)) == ["r0"]


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
    assert KVCompactConfig(budget_mode="latch", pressure_reserve=0.1).pressure_reserve == 0.1
    config = KVCompactConfig.from_sources({"kvcompact": {"budget_mode": "latch"}},
                                          {"KVCOMPACT_PRESSURE_RESERVE": "0.1"})
    assert config is not None and config.pressure_reserve == 0.1
    for bad, words in [({"budget_mode": "elastic"}, ["'budget_mode'", "fixed, pressure"]),
                       ({"pressure_spread": "largest"}, ["'pressure_spread'", "fewest, even, all"]),
                       ({"budget_mode": "pressure", "compaction": "none"}, ["'budget_mode'", "repack"]),
                       ({"budget_mode": "latch", "compaction": "none"}, ["'budget_mode' latch", "repack"]),
                       ({"pressure_reserve": 1.0}, ["'pressure_reserve'", ">= 0 and < 1"]),
                       ({"pressure_reserve": -0.1}, ["'pressure_reserve'", ">= 0 and < 1"]),
                       ({"pressure_reserve": True}, ["'pressure_reserve'", "got True"]),
                       ({"pressure_reserve": 0.1, "budget_mode": "fixed"}, ["'pressure_reserve' 0.1", "'fixed'"])]:
        with pytest.raises(ConfigError) as e:
            KVCompactConfig(**bad)
        assert all(w in str(e.value) for w in words), str(e.value)
    assert RequestOverrides.from_extra_args({"kvcompact_budget_mode": "pressure"}).budget_mode == "pressure"
    with pytest.raises(ConfigError, match="kvcompact_budget_mode"):
        RequestOverrides.from_extra_args({"kvcompact_budget_mode": "sometimes"})
    assert KVCompactConfig(budget_mode="pressure", admission="greedy").admission == "greedy"
    assert RequestOverrides.from_extra_args({"kvcompact_budget_mode": "pressure"},
                                            KVCompactConfig(admission="greedy")).budget_mode == "pressure"
    with pytest.raises(ConfigError, match="kvcompact_budget_mode"):
        RequestOverrides.from_extra_args({"kvcompact_budget_mode": "pressure"},
                                         KVCompactConfig(compaction="none", budget_mode="fixed"))
    # A server drafting with a model (lookahead KV slots) refuses a pressure-mode request, names it.
    with pytest.raises(ConfigError, match="draft-model speculative decoding"):
        RequestOverrides.from_extra_args({"kvcompact_budget_mode": "pressure"}, lookahead=3)
    # budget mode latch shrinks through the same pressure rounds: the same two refusals, and accepted otherwise
    assert RequestOverrides.from_extra_args({"kvcompact_budget_mode": "latch"}).budget_mode == "latch"
    with pytest.raises(ConfigError, match="latch needs the server's compaction"):
        RequestOverrides.from_extra_args({"kvcompact_budget_mode": "latch"},
                                         KVCompactConfig(compaction="none", budget_mode="fixed"))
    with pytest.raises(ConfigError, match="latch is not verified"):
        RequestOverrides.from_extra_args({"kvcompact_budget_mode": "latch"}, lookahead=3)
    # control: a fixed-budget request on the same drafting server is accepted
    assert RequestOverrides.from_extra_args({"kvcompact_budget_mode": "fixed"}, lookahead=3).budget_mode == "fixed"


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

    config = KVCompactConfig(policy="knorm", budget=200, divide_length=24, window=16, n_sink=4, selection="per_head",
                             budget_mode="pressure")

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
