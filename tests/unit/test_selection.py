"""Selection against a plain NumPy/loop reference written from docs/DESIGN.md, section 4.3, with broken variants of
that reference (wrong GQA grouping, no z-score, wrong tie-break) shown to be caught by the same comparison."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from kvcompact.ledger import effective_budget
from kvcompact.selection import select_keep


def make_case(seed: int, mode: str, B=2, L=3, H=2, group=2, N=16, max_window=5, tight=False) -> dict:
    """Random requests: evicted tokens missing from the positions, padding scattered over the slots, slot order
    unrelated to position order; budgets at least the protected count (``tight``: 4 more than that, with at
    least 3/4 of the slots filled and a short prompt, so that real choices are made)."""
    rng = np.random.default_rng(seed)
    G = H * group
    positions = np.full((B, L, H, N), -1, dtype=np.int64)
    t, prompt_len = np.zeros(B, np.int64), np.zeros(B, np.int64)
    window, protect = int(rng.integers(0, max_window + 1)), bool(rng.integers(0, 2))
    for b in range(B):
        n = int(rng.integers(3 * N // 4 if tight else 1, N + 1))
        t[b] = n + int(rng.integers(0, 10))
        prompt_len[b] = int(rng.integers(0, (t[b] // 4 if tight else t[b]) + 1))
        for h in range(H):
            for l in range(L):
                if mode == "per_layer_per_head" or l == 0:
                    slots = rng.permutation(N)[:n]
                    tokens = rng.permutation(t[b])[:n]
                positions[b, l, h, slots] = tokens
    scale = rng.choice([0.01, 1.0, 100.0], size=(1, L, G, 1))
    scores = (rng.normal(size=(B, L, G, N)) * scale + rng.normal(size=(1, L, G, 1)) * 50).astype(np.float32)
    scores[np.repeat(positions, group, axis=2) < 0] = np.nan      # padding may hold anything
    prot = reference_protected(positions, t, prompt_len, window, protect)
    budget = prot.sum(-1).reshape(B, -1).max(-1) + (4 if tight else rng.integers(0, N, size=B))
    return dict(scores=scores, positions=positions, t=t, budget=budget.astype(np.int64), prompt_len=prompt_len,
                window=window, protect_prompt=protect)


def reference_protected(positions, t, prompt_len, window, protect):
    B = positions.shape[0]
    p = positions
    tb = t.reshape(B, *[1] * (p.ndim - 1))
    pl = prompt_len.reshape(B, *[1] * (p.ndim - 1))
    return (p >= 0) & ((p >= tb - window) | ((p < pl) if protect else False))


def reference(case: dict, mode: str, *, zscore=True, gqa="block", tie="later", gap=False, zscore_over="candidates"):
    """Loop reference. Returns the keep mask, or with ``gap`` the smallest score gap at any cut-off (to skip
    cases whose float32 vs float64 rounding could legitimately flip a near-tie). The z-score statistics are
    taken over the candidates (valid, unprotected slots); ``zscore_over="valid"`` is the broken variant that
    lets protected slots into them."""
    s, p = case["scores"].astype(np.float64), case["positions"]
    B, L, G, N = s.shape
    H = p.shape[2]
    group = G // H
    prot = reference_protected(p, case["t"], case["prompt_len"], case["window"], case["protect_prompt"])
    z = np.full((B, L, G, N), -np.inf)
    for b in range(B):
        for l in range(L):
            for g in range(G):
                h = g // group if gqa == "block" else g % H
                v = (p[b, l, h] >= 0) & (~prot[b, l, h] if zscore_over == "candidates" else True)
                x = s[b, l, g, v]
                if not zscore:
                    z[b, l, g, v] = x
                elif x.size == 0 or np.ptp(x) == 0:
                    z[b, l, g, v] = 0.0
                else:
                    z[b, l, g, v] = (x - x.mean()) / x.std()
    agg = np.full((B, L, H, N), -np.inf)
    for g in range(G):
        h = g // group if gqa == "block" else g % H
        agg[:, :, h] = np.maximum(agg[:, :, h], z[:, :, g])
    if mode == "per_head":
        agg = np.repeat(agg.mean(axis=1, keepdims=True), L, axis=1)
    keep = np.zeros((B, L, H, N), dtype=bool)
    min_gap = np.inf
    for b in range(B):
        for l in range(L):
            for h in range(H):
                cand = [(np.inf if prot[b, l, h, n] else agg[b, l, h, n], p[b, l, h, n], n)
                        for n in range(N) if p[b, l, h, n] >= 0]
                sign = -1 if tie == "later" else 1
                cand.sort(key=lambda c: (-c[0], sign * c[1]))
                k = min(int(case["budget"][b]), len(cand))
                for c in cand[:k]:
                    keep[b, l, h, c[2]] = True
                if 0 < k < len(cand) and np.isfinite(cand[k - 1][0]):
                    min_gap = min(min_gap, cand[k - 1][0] - cand[k][0])
    return min_gap if gap else keep


def run(case: dict, mode: str) -> np.ndarray:
    T = {k: torch.from_numpy(v) for k, v in case.items() if isinstance(v, np.ndarray)}
    return select_keep(T["scores"], T["positions"], T["t"], T["budget"], T["prompt_len"], window=case["window"],
                       protect_prompt=case["protect_prompt"], mode=mode).numpy()


def invariant_violations(case: dict, keep: np.ndarray, mode: str) -> list[str]:
    p = case["positions"]
    valid = p >= 0
    prot = reference_protected(p, case["t"], case["prompt_len"], case["window"], case["protect_prompt"])
    want = np.minimum(case["budget"][:, None, None], valid.sum(-1))
    bad = []
    if (keep & ~valid).any():
        bad.append("keeps padding")
    if (prot & ~keep).any():
        bad.append("evicts a protected token")
    if (keep.sum(-1) != want).any():
        bad.append(f"keep counts {keep.sum(-1).tolist()} != {want.tolist()}")
    if mode == "per_head" and (keep != keep[:, :1]).any():
        bad.append("per_head mask differs between layers")
    return bad


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), mode=st.sampled_from(["per_head", "per_layer_per_head"]),
       group=st.integers(1, 3), tight=st.booleans())
def test_matches_reference(seed, mode, group, tight):
    case = make_case(seed, mode, group=group, tight=tight)
    assume(reference(case, mode, gap=True) > 1e-4)
    keep = run(case, mode)
    assert invariant_violations(case, keep, mode) == []
    assert (keep == reference(case, mode)).all()


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), mode=st.sampled_from(["per_head", "per_layer_per_head"]))
def test_mask_follows_tokens_not_slots(seed, mode):
    """Shuffling which slot holds which token (as holefill does) keeps the same tokens."""
    case = make_case(seed, mode)
    assume(reference(case, mode, gap=True) > 1e-4)
    B, L, H, N = case["positions"].shape
    group = case["scores"].shape[2] // H
    rng = np.random.default_rng(seed + 1)
    perm = np.stack([rng.permutation(N) for _ in range(B * H)]).reshape(B, 1, H, N).repeat(L, 1)
    if mode == "per_layer_per_head":
        perm = np.stack([rng.permutation(N) for _ in range(B * L * H)]).reshape(B, L, H, N)
    shuffled = dict(case, positions=np.take_along_axis(case["positions"], perm, -1),
                    scores=np.take_along_axis(case["scores"], perm.repeat(group, 2), -1))
    kept = np.take_along_axis(run(case, mode), perm, -1)
    assert (run(shuffled, mode) == kept).all()


def test_broken_references_are_caught():
    """The comparison has power: each broken variant of the rule disagrees with select_keep on a case."""
    case = make_case(7, "per_head", B=1, L=2, H=2, group=3, N=24, max_window=0, tight=True)
    assert reference(case, "per_head", gap=True) > 1e-4
    keep = run(case, "per_head")
    assert (keep == reference(case, "per_head")).all()
    assert not (keep == reference(case, "per_head", gqa="interleave")).all()
    assert not (keep == reference(case, "per_head", zscore=False)).all()
    assert not (keep == reference(case, "per_layer_per_head")).all()


def test_protected_outlier_does_not_enter_the_zscore():
    """A protected slot with an outlier score (a sink in the window) would inflate its head's spread and shrink
    that head's say in the group max; the statistics are taken over the candidates only."""
    rng = np.random.default_rng(11)
    N = 24
    scores = rng.normal(size=(1, 1, 2, N)).astype(np.float32)
    positions = np.arange(N).reshape(1, 1, 1, N)
    scores[0, 0, 0, N - 1] = 1e4        # head 0's outlier sits in the protected window
    case = dict(scores=scores, positions=positions, t=np.array([N]), budget=np.array([8]),
                prompt_len=np.array([0]), window=2, protect_prompt=False)
    keep = run(case, "per_layer_per_head")
    assert (keep == reference(case, "per_layer_per_head")).all()
    assert not (keep == reference(case, "per_layer_per_head", zscore_over="valid")).all()


def test_ties_go_to_the_later_position():
    positions = torch.tensor([5, 2, 9, 0, 7, 3, -1, 8]).view(1, 1, 1, 8)
    scores = torch.tensor([1.0, 1.0, 1.0, 3.0, 1.0, 1.0, 9.0, 1.0]).view(1, 1, 1, 8)
    case = dict(scores=scores.numpy(), positions=positions.numpy(), t=np.array([10]), budget=np.array([3]),
                prompt_len=np.array([0]), window=0, protect_prompt=False)
    keep = run(case, "per_layer_per_head")
    assert sorted(positions[keep].tolist()) == [0, 8, 9]          # the best score, then the two latest ties
    assert (keep == reference(case, "per_layer_per_head")).all()
    assert not (keep == reference(case, "per_layer_per_head", tie="earlier")).all()


def test_constant_head_does_not_dominate_its_group():
    # one query head scores every key 0.7: float32 rounding of its mean must not turn that into z = +1, which
    # would tie most keys of the group at 1 and hand the choice to the position tie-break
    rng = np.random.default_rng(3)
    scores = np.stack([np.full(20, 0.7), rng.normal(size=20)]).astype(np.float32).reshape(1, 1, 2, 20)
    case = dict(scores=scores, positions=rng.permutation(20).reshape(1, 1, 1, 20), t=np.array([20]),
                budget=np.array([6]), prompt_len=np.array([0]), window=0, protect_prompt=False)
    assert reference(case, "per_layer_per_head", gap=True) > 1e-4
    assert (run(case, "per_layer_per_head") == reference(case, "per_layer_per_head")).all()


def test_ignoring_protection_is_caught():
    # 20 tokens in scrambled slots, prompt 0..2 and window 16..19 protected but scored lowest
    rng = np.random.default_rng(0)
    positions = rng.permutation(20).reshape(1, 1, 1, 20)
    scores = np.where((positions < 3) | (positions >= 16), -5.0, rng.normal(size=positions.shape))
    case = dict(scores=scores.astype(np.float32), positions=positions, t=np.array([20]), budget=np.array([9]),
                prompt_len=np.array([3]), window=4, protect_prompt=True)
    assert invariant_violations(case, run(case, "per_head"), "per_head") == []
    unprotected = run(dict(case, window=0, protect_prompt=False), "per_head")
    assert "evicts a protected token" in invariant_violations(case, unprotected, "per_head")


def test_sinks_are_kept_whatever_they_score():
    """The first n_sink positions survive every round even when scored lowest (as TriAttention scores a sink
    token whose key looks unremarkable); with n_sink 0 the same scores evict them (the check has power)."""
    rng = np.random.default_rng(3)
    positions = rng.permutation(40).reshape(1, 1, 1, 40)
    scores = np.where(positions < 4, -9.0, rng.normal(size=positions.shape)).astype(np.float32)
    T = {"scores": torch.from_numpy(scores), "positions": torch.from_numpy(positions), "t": torch.tensor([40]),
         "budget": torch.tensor([12]), "prompt_len": torch.tensor([0])}
    kept = lambda n_sink: set(positions[select_keep(*T.values(), window=4, protect_prompt=False,  # noqa: E731
                                                    mode="per_head", n_sink=n_sink).numpy()].tolist())
    assert {0, 1, 2, 3} <= kept(4) and {36, 37, 38, 39} <= kept(4) and len(kept(4)) == 12
    assert not {0, 1, 2, 3} & kept(0)


def test_per_layer_mask_is_caught_by_per_head_invariant():
    case = make_case(5, "per_head", tight=True)
    assert "per_head mask differs between layers" in invariant_violations(case, run(case, "per_layer_per_head"),
                                                                         "per_head")


def test_protected_over_budget_raises_with_numbers():
    positions = torch.arange(6).view(1, 1, 1, 6)
    args = (torch.zeros(1, 1, 1, 6), positions, torch.tensor([6]), torch.tensor([3]), torch.tensor([3]))
    with pytest.raises(ValueError, match="request 0: 5 protected tokens exceed its budget 3"):
        select_keep(*args, window=2, protect_prompt=True, mode="per_head")


def test_input_errors():
    positions = torch.arange(8).view(1, 2, 1, 4)
    args = (torch.zeros(1, 2, 1, 4), positions, torch.tensor([8]), torch.tensor([2]), torch.tensor([0]))
    with pytest.raises(ValueError, match="same positions in every layer"):
        select_keep(*args, window=0, protect_prompt=False, mode="per_head")
    with pytest.raises(ValueError, match="per_head, per_layer_per_head"):
        select_keep(*args, window=0, protect_prompt=False, mode="global")
    with pytest.raises(ValueError, match="multiple of H_kv"):
        select_keep(torch.zeros(1, 2, 3, 4), positions.repeat(1, 1, 2, 1), *args[2:], window=0,
                    protect_prompt=False, mode="per_layer_per_head")


def test_effective_budget_table():
    """protect_prompt keeps the prompt on top of the budget: the generated tokens keep the whole budget."""
    assert effective_budget(1024, 100, True) == 1124
    assert effective_budget(100, 50, True) == 150
    assert effective_budget(100, 50, False) == 100


@settings(max_examples=50, deadline=None)
@given(prompt=st.integers(0, 60), gen=st.integers(0, 60), window=st.integers(0, 20), extra=st.integers(1, 30),
       evicted=st.integers(0, 40))
def test_effective_budget_always_fits_protection(prompt, gen, window, extra, evicted):
    """With the effective budget a protected prompt never makes selection fail, whatever was evicted."""
    t = prompt + gen
    budget = effective_budget(window + extra, prompt, True)
    held = [p for p in range(t) if p < prompt or p >= t - window or p % 41 >= evicted]
    positions = torch.tensor(held + [-1] * 3, dtype=torch.int64).view(1, 1, 1, -1)
    keep = select_keep(torch.randn(positions.shape), positions, torch.tensor([t]), torch.tensor([budget]),
                       torch.tensor([prompt]), window=window, protect_prompt=True, mode="per_head")
    assert int(keep.sum()) == min(budget, len(held))
