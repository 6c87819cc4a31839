"""Planner properties against plain-loop references, each check paired with a mutant it must reject."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcompact.config import MOVE_MODES as MODES
from kvcompact.config import KVCompactConfig
from kvcompact.ledger import blocks_held
from kvcompact.moves import MovePlan, apply_plan, plan_moves
from kvcompact.round import RoundCore
from support import FIXED


@st.composite
def keep_masks(draw) -> torch.Tensor:
    """[L, H, N] keep masks with the same count K per (l, h); each row keeps a random K-subset."""
    L, H = draw(st.integers(1, 3)), draw(st.integers(1, 4))
    N = draw(st.integers(0, 40))
    K = draw(st.integers(0, N))
    keep = torch.zeros(L, H, N, dtype=torch.bool)
    for l in range(L):
        for h in range(H):
            perm = draw(st.permutations(range(N)))
            keep[l, h, list(perm[:K])] = True
    return keep


def reference_layout(row: list[bool], mode: str) -> list[int]:
    """Which original slot each of slots 0..K-1 holds after compaction, written from the spec."""
    K = sum(row)
    if mode == "repack":
        return [j for j, kept in enumerate(row) if kept]
    out = list(range(K))
    holes = [j for j in range(K) if not row[j]]
    tails = [j for j in range(K, len(row)) if row[j]]
    for hole, tail in zip(holes, tails):
        out[hole] = tail
    return out


def execute(plan: MovePlan, N: int) -> list[list[list[int]]]:
    """Run the plan on slot ids with plain loops: read every valid source, then write every destination."""
    L, H, M = plan.src.shape
    result = []
    for l in range(L):
        rows = []
        for h in range(H):
            state = list(range(N))
            moves = [(int(plan.src[l, h, m]), int(plan.dst[l, h, m])) for m in range(M) if plan.valid[l, h, m]]
            read = [state[s] for s, _ in moves]
            for (_, d), value in zip(moves, read):
                state[d] = value
            rows.append(state[:plan.kept_len])
        result.append(rows)
    return result


def plan_violations(keep: torch.Tensor, plan: MovePlan, mode: str) -> list[str]:
    """Every way ``plan`` departs from the spec for ``keep``; empty when it is correct."""
    L, H, N = keep.shape
    K = int(keep[0, 0].sum()) if L * H else 0
    if plan.kept_len != K:
        return [f"kept_len {plan.kept_len} != K {K}"]
    bad = []
    done = execute(plan, N)
    for l in range(L):
        for h in range(H):
            row = keep[l, h].tolist()
            valid = plan.valid[l, h].tolist()
            src = [s for s, v in zip(plan.src[l, h].tolist(), valid) if v]
            dst = [d for d, v in zip(plan.dst[l, h].tolist(), valid) if v]
            if done[l][h] != reference_layout(row, mode):
                bad.append(f"({l},{h}) holds {done[l][h]}, expected {reference_layout(row, mode)}")
            if len(set(dst)) != len(dst) or any(d >= K for d in dst):
                bad.append(f"({l},{h}) destinations {dst} repeat or reach beyond {K}")
            if any(s == d for s, d in zip(src, dst)):
                bad.append(f"({l},{h}) moves a slot onto itself")
            tails = sum(row[K:])
            if mode == "holefill" and len(src) != tails:
                bad.append(f"({l},{h}) {len(src)} moves for {tails} tail survivors")
            if mode == "repack" and len(src) != sum(j != i for i, j in enumerate(reference_layout(row, mode))):
                bad.append(f"({l},{h}) repack moves a slot already in place")
            pads = [(s, d) for s, d, v in zip(plan.src[l, h].tolist(), plan.dst[l, h].tolist(), valid) if not v]
            if any(s != d or d in dst for s, d in pads):
                bad.append(f"({l},{h}) padding {pads} is not a harmless self-copy")
    return bad


def loop_plan(keep: torch.Tensor, pair) -> MovePlan:
    """Build a plan from per-row move lists ``pair(row) -> [(src, dst), ...]`` (for mutants)."""
    L, H, N = keep.shape
    lists = [[pair(keep[l, h].tolist()) for h in range(H)] for l in range(L)]
    M = max((len(x) for rows in lists for x in rows), default=0)
    src = torch.full((L, H, M), N - 1)
    dst = torch.full((L, H, M), N - 1)
    valid = torch.zeros(L, H, M, dtype=torch.bool)
    for l in range(L):
        for h in range(H):
            for m, (s, d) in enumerate(lists[l][h]):
                src[l, h, m], dst[l, h, m], valid[l, h, m] = s, d, True
    return MovePlan(src, dst, valid, int(keep[0, 0].sum()))


def _holes_tails(row):
    K = sum(row)
    return [j for j in range(K) if not row[j]], [j for j in range(K, len(row)) if row[j]]


def holefill_desc(row):
    holes, tails = _holes_tails(row)
    return list(zip(tails, reversed(holes)))


def holefill_forgets_last(row):
    holes, tails = _holes_tails(row)
    return list(zip(tails, holes))[:-1]


def holefill_right(row):
    holes, tails = _holes_tails(row)
    return list(zip(tails, holes))


def repack_moves_all(row):
    return [(j, i) for i, j in enumerate(j for j, kept in enumerate(row) if kept)]


def repack_right(row):
    return [(j, i) for i, j in enumerate(j for j, kept in enumerate(row) if kept) if i != j]


@settings(max_examples=150, deadline=None)
@given(keep=keep_masks(), mode=st.sampled_from(MODES))
def test_plan_meets_spec(keep, mode):
    assert plan_violations(keep, plan_moves(keep, mode), mode) == []


@settings(max_examples=100, deadline=None)
@given(keep=keep_masks())
def test_holefill_moves_only_tail_survivors(keep):
    plan = plan_moves(keep, "holefill")
    K = plan.kept_len
    assert plan.num_moves == int(keep[..., K:].sum())
    assert plan.num_moves <= plan_moves(keep, "repack").num_moves


@settings(max_examples=100, deadline=None)
@given(keep=keep_masks(), mode=st.sampled_from(MODES), data=st.data())
def test_apply_plan_matches_loop_execution(keep, mode, data):
    L, H, N = keep.shape
    plan = plan_moves(keep, mode)
    x = torch.randn(L, H, N, 2)
    out = apply_plan(x, plan)
    done = execute(plan, N)
    expected = torch.stack([torch.stack([x[l, h, done[l][h]] for h in range(H)]) for l in range(L)]) \
        if plan.kept_len else x[:, :, :0]
    assert torch.equal(out, expected)
    ids = torch.arange(N).expand(L, H, N)
    assert apply_plan(ids, plan).tolist() == done


def test_apply_plan_is_gather_then_scatter_and_ignores_padding():
    # a swap: a sequential executor would write slot 0 into both slots
    plan = MovePlan(src=torch.tensor([[[0, 1, 3]]]), dst=torch.tensor([[[1, 0, 0]]]),
                    valid=torch.tensor([[[True, True, False]]]), kept_len=2)
    assert apply_plan(torch.tensor([[[10, 11, 12, 13]]]), plan).tolist() == [[[11, 10]]]


@pytest.mark.parametrize("mutant, mode", [(holefill_desc, "holefill"), (holefill_forgets_last, "holefill"),
                                          (repack_moves_all, "repack")])
def test_mutant_planners_are_caught(mutant, mode):
    keep = torch.tensor([[[True, True, False, True, False, True, True, False, True]]])   # K=6: holes 2, 4; tails 6, 8
    right = repack_right if mode == "repack" else holefill_right
    assert plan_violations(keep, loop_plan(keep, right), mode) == []
    assert plan_violations(keep, loop_plan(keep, mutant), mode) != []


@settings(max_examples=60, deadline=None)
@given(keep=keep_masks())
def test_mutants_caught_whenever_they_differ(keep):
    """On random masks the checker rejects each mutant exactly when its moves differ from the spec."""
    rows = [row for layer in keep.tolist() for row in layer]
    tails = [len(_holes_tails(r)[1]) for r in rows]
    in_place = any(r[i] for r in rows for i in range(sum(r)) if all(r[:i + 1]))
    assert bool(plan_violations(keep, loop_plan(keep, holefill_desc), "holefill")) == any(n >= 2 for n in tails)
    assert bool(plan_violations(keep, loop_plan(keep, holefill_forgets_last), "holefill")) == any(tails)
    assert bool(plan_violations(keep, loop_plan(keep, repack_moves_all), "repack")) == in_place


def order_violations(plan: MovePlan) -> list[str]:
    """Valid entries that read a slot an earlier valid entry of their row wrote. An executor that runs the entries
    in order, chunk by chunk (the one-launch GPU mover), equals gather-then-scatter only when there are none."""
    bad = []
    L, H, M = plan.src.shape
    for l in range(L):
        for h in range(H):
            written: set[int] = set()
            for m in range(M):
                if plan.valid[l, h, m]:
                    if int(plan.src[l, h, m]) in written:
                        bad.append(f"({l},{h}) entry {m} reads slot {int(plan.src[l, h, m])} after it was written")
                    written.add(int(plan.dst[l, h, m]))
    return bad


@settings(max_examples=100, deadline=None)
@given(keep=keep_masks(), mode=st.sampled_from(MODES))
def test_planned_entries_never_read_a_slot_an_earlier_entry_wrote(keep, mode):
    assert order_violations(plan_moves(keep, mode)) == []


def test_order_check_catches_a_reversed_repack():
    keep = torch.tensor([[[False, True, True, False, True]]])  # repack: 1 -> 0, 2 -> 1, 4 -> 2
    plan = plan_moves(keep, "repack")
    assert order_violations(plan) == []
    backwards = MovePlan(plan.src.flip(-1), plan.dst.flip(-1), plan.valid.flip(-1), plan.kept_len)
    assert torch.equal(apply_plan(torch.arange(5).view(1, 1, 5), backwards),
                       apply_plan(torch.arange(5).view(1, 1, 5), plan))  # same moves for gather-then-scatter
    assert order_violations(backwards) != []


@pytest.mark.parametrize("mode", MODES)
def test_round_plans_grouped_requests_like_each_alone(mode):
    """RoundCore.plan plans requests of equal length and kept count as one batch; each request's plan must move
    its cache exactly as plan_moves on that request alone does (more padding entries allowed)."""
    g = torch.Generator().manual_seed(0)
    L, H, N = 2, 3, 24
    lengths, kept = [24, 24, 20, 24], [10, 10, 10, 12]
    keep = torch.zeros(len(lengths), L, H, N, dtype=torch.bool)
    for b, (n, k) in enumerate(zip(lengths, kept)):
        for l in range(L):
            for h in range(H):
                keep[b, l, h, torch.randperm(n, generator=g)[:k]] = True
    plans = RoundCore(KVCompactConfig(**FIXED, compaction=mode), None, H).plan(keep, lengths)
    x = torch.randn(len(lengths), L, H, N, 2, generator=g)
    for b, n in enumerate(lengths):
        alone = plan_moves(keep[b, :, :, :n], mode)
        assert plans[b].num_moves == alone.num_moves
        assert torch.equal(apply_plan(x[b, :, :, :n], plans[b]), apply_plan(x[b, :, :, :n], alone))
    # negative control: the check tells two requests' plans apart
    assert not torch.equal(apply_plan(x[0], plans[1]), apply_plan(x[0], plan_moves(keep[0], mode)))


def test_plan_rejects_unequal_counts_and_unknown_mode():
    keep = torch.tensor([[[True, False], [True, True]]])
    with pytest.raises(ValueError, match="same number"):
        plan_moves(keep, "repack")
    with pytest.raises(ValueError, match="repack, holefill"):
        plan_moves(keep[:, :1], "shuffle")


def loop_blocks(n: int, bs: int) -> int:
    count, covered = 0, 0
    while covered < n:
        count, covered = count + 1, covered + bs
    return count


@settings(max_examples=200, deadline=None)
@given(old=st.integers(0, 5000), shrink=st.integers(0, 5000), bs=st.integers(1, 300))
def test_blocks_held_matches_loop(old, shrink, bs):
    new = max(0, old - shrink)
    assert blocks_held(old, bs) == loop_blocks(old, bs)
    assert blocks_held(new, bs) == loop_blocks(new, bs)


def test_blocks_held_negative_control_and_errors():
    floor_variant = 15 // 16          # holding floor(n / bs) blocks would drop a block still in use
    assert blocks_held(15, 16) == loop_blocks(15, 16) == 1 != floor_variant
    with pytest.raises(ValueError, match="num_tokens >= 0"):
        blocks_held(-1, 4)
