"""The round core on its own (no engine, no model): a batch of requests of different lengths scored, selected and
planned by :class:`kvcompact.round.RoundCore` as both engines call it. Checked against what a round must leave:
exactly ``kept_len`` tokens per (layer, KV head), the sinks and the recent window among them, the rest the
policy's best (K-norm: the smallest keys), and plans that put the survivors in slots ``0 .. kept_len - 1``."""

from __future__ import annotations

import pytest
import torch

from kvcompact.config import KVCompactConfig
from kvcompact.moves import apply_plan
from kvcompact.policies import make_policy
from kvcompact.policies.base import Policy, ScoreInput
from kvcompact.round import RoundBatch, RoundCore
from support import FIXED

L, H, HQ, D = 2, 2, 4, 8
LENGTHS = [40, 29]
NEW_LEN = 16
CFG = dict(**FIXED, policy="knorm", budget=NEW_LEN, divide_length=8, window=4, n_sink=2, selection="per_layer_per_head")


def batch(seed: int = 0) -> RoundBatch:
    """Two requests, cache lengths 40 and 29 (padded to 40), each slot holding the token at its own position."""
    g = torch.Generator().manual_seed(seed)
    n = max(LENGTHS)
    keys = torch.randn(len(LENGTHS), L, H, n, D, generator=g)
    positions = torch.arange(n).expand(len(LENGTHS), L, H, n).clone()
    for b, length in enumerate(LENGTHS):
        keys[b, ..., length:, :] = 0
        positions[b, ..., length:] = -1
    return RoundBatch(keys=keys, positions=positions, logical_len=torch.tensor(LENGTHS),
                      kept_len=torch.tensor([NEW_LEN] * 2), prompt_len=torch.tensor([0, 0]), cache_lens=list(LENGTHS))


def expected_keep(x: RoundBatch, b: int, window: int, n_sink: int) -> torch.Tensor:
    """K-norm by hand: the sinks, the window, and the smallest-norm keys of the rest, per (layer, KV head)."""
    n = x.cache_lens[b]
    keep = torch.zeros(L, H, n, dtype=torch.bool)
    keep[..., :n_sink] = True
    keep[..., n - window:] = True
    norms = torch.linalg.vector_norm(x.keys[b, ..., :n, :], dim=-1).masked_fill(keep, float("inf"))
    free = NEW_LEN - n_sink - window
    keep.scatter_(-1, norms.topk(free, dim=-1, largest=False).indices, True)
    return keep


@pytest.mark.parametrize("compaction", ["repack", "holefill"])
def test_a_batch_keeps_the_sinks_the_window_and_the_policys_best(compaction: str) -> None:
    config = KVCompactConfig(**CFG, compaction=compaction)
    core = RoundCore(config, make_policy(config), HQ)
    x = batch()
    out = core.run(x)
    assert out.scoring_fallbacks == {}
    for b, n in enumerate(LENGTHS):
        keep = out.keep_mask[b, ..., :n]
        assert torch.equal(keep, expected_keep(x, b, config.window, config.n_sink)), b
        assert not out.keep_mask[b, ..., n:].any()  # padding is never kept
        moved = apply_plan(x.positions[b, ..., :n], out.plans[b])
        assert out.plans[b].kept_len == NEW_LEN and moved.shape[-1] == NEW_LEN
        survivors = [torch.sort(moved[layer, head]).values for layer in range(L) for head in range(H)]
        wanted = [torch.arange(n)[keep[layer, head]] for layer in range(L) for head in range(H)]
        assert all(torch.equal(s, w) for s, w in zip(survivors, wanted))
        if compaction == "repack":  # order-preserving: slot i holds the i-th survivor
            assert all(torch.equal(m, w) for m, w in zip((moved[i, j] for i in range(L) for j in range(H)), wanted))
    # Control: a policy with the sign flipped (the largest keys kept) fails the same check.
    flipped = RoundCore(config, _Largest(config), HQ).run(x)
    assert not torch.equal(flipped.keep_mask[0, ..., : LENGTHS[0]], expected_keep(x, 0, config.window, config.n_sink))


class _Largest(Policy):
    """K-norm with its sign flipped: keeps the largest keys."""

    name = "largest"

    def score(self, x: ScoreInput) -> torch.Tensor:
        return torch.linalg.vector_norm(x.keys.float(), dim=-1)


def test_each_request_keeps_what_it_keeps_alone() -> None:
    """Batching requests of different lengths changes no keep set (padding never competes)."""
    config = KVCompactConfig(**CFG)
    core = RoundCore(config, make_policy(config), HQ)
    x = batch(seed=1)
    together = core.run(x).keep_mask
    for b, n in enumerate(LENGTHS):
        alone = RoundBatch(keys=x.keys[b:b + 1, ..., :n, :], positions=x.positions[b:b + 1, ..., :n],
                           logical_len=x.logical_len[b:b + 1], kept_len=x.kept_len[b:b + 1],
                           prompt_len=x.prompt_len[b:b + 1], cache_lens=[n])
        assert torch.equal(core.run(alone).keep_mask[0], together[b, ..., :n])


class _FailsOnLong(Policy):
    """K-norm, except that scoring a request longer than 35 slots raises (a policy bug that hits one request)."""

    name = "fails_on_long"

    def score(self, x: ScoreInput) -> torch.Tensor:
        if x.keys.shape[-2] > 35 and bool((x.positions[:, 0, 0] == 35).any()):
            raise RuntimeError("boom")
        return -torch.linalg.vector_norm(x.keys.float(), dim=-1)


def test_a_policy_error_falls_back_to_recency_for_its_request_only() -> None:
    """The failing request keeps the sinks, the window and the most recent tokens and is reported; the other keeps
    exactly what K-norm keeps. Control: the same batch without the failure reports nothing."""
    config = KVCompactConfig(**CFG)
    core = RoundCore(config, _FailsOnLong(config), HQ)
    x = batch(seed=2)
    out = core.run(x)
    assert list(out.scoring_fallbacks) == [0] and "boom" in out.scoring_fallbacks[0]
    n = LENGTHS[0]
    recent = torch.zeros(n, dtype=torch.bool)
    recent[: config.n_sink] = True
    recent[n - (NEW_LEN - config.n_sink):] = True
    assert all(torch.equal(out.keep_mask[0, layer, head, :n], recent) for layer in range(L) for head in range(H))
    assert torch.equal(out.keep_mask[1, ..., : LENGTHS[1]], expected_keep(x, 1, config.window, config.n_sink))
    assert RoundCore(config, make_policy(config), HQ).run(x).scoring_fallbacks == {}
