"""Layouts against caches packed element by element with index math written here from each backend's
description; moves against a loop reference; broken layouts and movers shown to be caught."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvcompact.vllm.kv_layout import (
    CpuAttnVecLayout,
    FlashLayout,
    HeadSplitLayout,
    KVLayout,
    PagedNB2Layout,
    layout_for,
    move_layers,
    padded_slots,
    phys_slots,
    plan_slots,
)
from support.mutants import one_at_a_time

NB, H, BS, D = 5, 3, 4, 6


def offset(name: str, blk: int, h: int, off: int, c: int, which: int) -> int:
    """Flat element index of component c of K (which=0) or V (1) of (block, head, offset) in a contiguous cache."""
    if name == "cpu_attn_vec":    # [nb, H, bs, 2d]; per (block, head): K as [d, bs], then V as [bs, d]
        base = (blk * H + h) * 2 * BS * D
        return base + (c * BS + off if which == 0 else BS * D + off * D + c)
    if name == "flash":           # [2, nb, bs, H, d]
        return (((which * NB + blk) * BS + off) * H + h) * D + c
    if name == "paged_nb2":       # [nb, 2, bs, H, d]
        return (((blk * 2 + which) * BS + off) * H + h) * D + c
    assert name == "head_split"   # [nb, H, bs, 2d]; K = first d, V = last d
    return ((blk * H + h) * BS + off) * 2 * D + which * D + c


SHAPES = {"cpu_attn_vec": (NB, H, BS, 2 * D), "flash": (2, NB, BS, H, D), "paged_nb2": (NB, 2, BS, H, D),
          "head_split": (NB, H, BS, 2 * D)}
CLASSES = {"cpu_attn_vec": CpuAttnVecLayout, "flash": FlashLayout, "paged_nb2": PagedNB2Layout,
           "head_split": HeadSplitLayout}


def pack(name: str, k: np.ndarray, v: np.ndarray) -> torch.Tensor:
    """k, v [nb, H, bs, d] -> the backend's cache tensor, one element at a time."""
    flat = np.zeros(2 * NB * H * BS * D, dtype=np.float32)
    for blk in range(NB):
        for h in range(H):
            for off in range(BS):
                for c in range(D):
                    flat[offset(name, blk, h, off, c, 0)] = k[blk, h, off, c]
                    flat[offset(name, blk, h, off, c, 1)] = v[blk, h, off, c]
    return torch.from_numpy(flat).view(SHAPES[name])


def random_kv(seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return (rng.normal(size=(NB, H, BS, D)).astype(np.float32), rng.normal(size=(NB, H, BS, D)).astype(np.float32))


def loop_move(k: np.ndarray, v: np.ndarray, src: np.ndarray, dst: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Reference move on per-(block, head, offset) arrays: read all sources, then write all destinations."""
    k, v = k.copy(), v.copy()
    for h in range(src.shape[0]):
        read = [(k[s // BS, h, s % BS].copy(), v[s // BS, h, s % BS].copy()) for s in src[h]]
        for d, (kk, vv) in zip(dst[h], read):
            k[d // BS, h, d % BS], v[d // BS, h, d % BS] = kk, vv
    return k, v


def gather_ok(layout: KVLayout, name: str, seed: int = 0) -> bool:
    k, v = random_kv(seed)
    phys = torch.from_numpy(np.random.default_rng(seed).integers(0, NB * BS, size=(H, 7)))
    gk, gv = layout.gather(pack(name, k, v), phys)
    want_k = np.stack([[k[p // BS, h, p % BS] for p in phys[h].tolist()] for h in range(H)])
    want_v = np.stack([[v[p // BS, h, p % BS] for p in phys[h].tolist()] for h in range(H)])
    return np.array_equal(gk.numpy(), want_k) and np.array_equal(gv.numpy(), want_v)


def repack_moves(seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Physical src/dst [H, M] of an order-preserving repack through a scrambled block table: chains where a
    destination is another move's source, padded with a self-copy of an untouched slot."""
    rng = np.random.default_rng(seed)
    table = torch.from_numpy(rng.permutation(NB))
    N, K = NB * BS, 9
    src = np.stack([np.sort(rng.permutation(N)[:K]) for _ in range(H)])
    dst = np.broadcast_to(np.arange(K), (H, K))
    src, dst = np.concatenate([src, np.full((H, 1), N - 1)], 1), np.concatenate([dst, np.full((H, 1), N - 1)], 1)
    return (phys_slots(table, torch.from_numpy(src), BS).numpy(), phys_slots(table, torch.from_numpy(dst), BS).numpy())


def cycle_moves() -> tuple[np.ndarray, np.ndarray]:
    """A 3-cycle per head (a -> b -> c -> a): one-at-a-time copying loses a value, gather-then-scatter does not."""
    src = np.array([[0, 5, 17], [3, 4, 9], [19, 1, 10]])
    return src, np.roll(src, 1, axis=1)


def move_ok(layout: KVLayout, name: str, src: np.ndarray, dst: np.ndarray, restride=lambda kv: kv) -> bool:
    """Move on a packed cache (optionally re-strided to another physical order) and compare to the reference."""
    k, v = random_kv(1)
    kv = restride(pack(name, k, v))
    layout.move(kv, torch.from_numpy(src), torch.from_numpy(dst))
    return torch.equal(kv, pack(name, *loop_move(k, v, src, dst)))


@pytest.mark.parametrize("name", list(SHAPES))
def test_gather_and_move_match_independent_packing(name):
    layout = CLASSES[name](BS, H, D)
    assert layout.name == name
    assert gather_ok(layout, name)
    k, v = random_kv(2)
    phys = torch.tensor([[0, 7, 19], [4, 4, 11], [13, 2, 1]])
    assert torch.equal(layout.gather_keys(pack(name, k, v), phys), layout.gather(pack(name, k, v), phys)[0])
    assert move_ok(layout, name, *repack_moves(3))
    assert move_ok(layout, name, *cycle_moves())


@pytest.mark.parametrize("name", list(SHAPES))
def test_scatter_writes_where_independent_packing_reads(name):
    layout = CLASSES[name](BS, H, D)
    kv = torch.zeros(SHAPES[name])
    phys = torch.tensor([[0, 19], [6, 7], [12, 3]])
    k, v = torch.randn(H, 2, D), torch.randn(H, 2, D)
    layout.scatter(kv, phys, k, v)
    flat = kv.reshape(-1)
    for h in range(H):
        for m, p in enumerate(phys[h].tolist()):
            for c in range(D):
                assert flat[offset(name, p // BS, h, p % BS, c, 0)] == k[h, m, c]
                assert flat[offset(name, p // BS, h, p % BS, c, 1)] == v[h, m, c]
    assert int((flat != 0).sum()) == 2 * H * 2 * D


class UntransposedK(CpuAttnVecLayout):
    """Mutant: reads the CPU K half as [bs, d] like V."""

    def _views(self, kv):
        nb = kv.shape[0]
        halves = kv.view(nb, H, 2, BS, D)
        return halves[:, :, 0].permute(0, 2, 1, 3), halves[:, :, 1].permute(0, 2, 1, 3)


def test_broken_layouts_are_caught():
    assert not gather_ok(UntransposedK(BS, H, D), "cpu_attn_vec")
    assert not move_ok(UntransposedK(BS, H, D), "cpu_attn_vec", *repack_moves(3))
    assert not move_ok(one_at_a_time(CpuAttnVecLayout)(BS, H, D), "cpu_attn_vec", *cycle_moves())


def test_move_on_strided_layer_views():
    """vLLM may hand out each layer as a view into a block-outermost pool: moves must land in the pool."""
    k, v = random_kv(4)
    pool = torch.stack([pack("cpu_attn_vec", *random_kv(9)), pack("cpu_attn_vec", k, v)], dim=1)  # [nb, 2, ...]
    untouched = pool[:, 0].clone()
    src, dst = repack_moves(5)
    CpuAttnVecLayout(BS, H, D).move(pool[:, 1], torch.from_numpy(src), torch.from_numpy(dst))
    assert torch.equal(pool[:, 1], pack("cpu_attn_vec", *loop_move(k, v, src, dst)))
    assert torch.equal(pool[:, 0], untouched)
    token_major = lambda kv: kv.transpose(1, 2).contiguous().transpose(1, 2)   # noqa: E731  [nb, bs, H, 2d] memory
    assert not token_major(pack("head_split", k, v)).is_contiguous()
    assert move_ok(HeadSplitLayout(BS, H, D), "head_split", src, dst, restride=token_major)


def test_phys_slots_follow_the_block_table():
    table = torch.tensor([7, 2, 9])
    slots = torch.tensor([[0, 3, 4, 11], [5, 8, 1, 10]])
    flat_table = [b * 4 + o for b in table.tolist() for o in range(4)]
    assert phys_slots(table, slots, 4).tolist() == [[flat_table[s] for s in row] for row in slots.tolist()]


def test_plan_slots_map_each_request_through_its_own_table():
    """Plans of one width are mapped in one batch, others one request at a time: both as phys_slots per request,
    requests one after the other."""
    from kvcompact.moves import MovePlan

    g = torch.Generator().manual_seed(0)
    tables = [torch.tensor([7, 2, 9]), torch.tensor([4, 0])]

    def plan(width: int, n: int) -> MovePlan:
        src, dst = torch.randint(0, n, (2, 3, width), generator=g), torch.randint(0, n, (2, 3, width), generator=g)
        return MovePlan(src, dst, torch.ones(2, 3, width, dtype=torch.bool), 0)

    for plans in ([plan(5, 8), plan(5, 8)], [plan(5, 8), plan(2, 8)]):
        src, dst = plan_slots(tables, plans, 4)
        assert torch.equal(src, torch.cat([phys_slots(t, p.src, 4) for t, p in zip(tables, plans)], dim=-1))
        assert torch.equal(dst, torch.cat([phys_slots(t, p.dst, 4) for t, p in zip(tables, plans)], dim=-1))
        swapped = plan_slots(tables[::-1], plans, 4)[0]  # negative control: another request's table
        assert not torch.equal(swapped, src)


def test_padded_slots_mark_what_each_request_holds():
    phys, live = padded_slots([torch.tensor([7, 2]), torch.tensor([4])], [6, 3], 4)
    assert phys.tolist() == [[28, 29, 30, 31, 8, 9], [16, 17, 18, 0, 0, 0]]
    assert live.tolist() == [[True] * 6, [True] * 3 + [False] * 3]


def test_move_layers_moves_a_shared_cache_once():
    k0, v0 = random_kv(6)
    k1, v1 = random_kv(7)
    shared, own = pack("flash", k0, v0), pack("flash", k1, v1)
    src0, dst0 = cycle_moves()
    src1, dst1 = repack_moves(8)
    src1, dst1 = src1[:, :3], dst1[:, :3]
    src = torch.from_numpy(np.stack([src0, src1, src0]))
    dst = torch.from_numpy(np.stack([dst0, dst1, dst0]))
    caches = [shared, own, shared]
    move_layers(FlashLayout(BS, H, D), caches, src, dst)
    assert torch.equal(shared, pack("flash", *loop_move(k0, v0, src0, dst0)))
    assert torch.equal(own, pack("flash", *loop_move(k1, v1, src1, dst1)))
    twice = pack("flash", k0, v0)                     # negative control: moving the shared tensor per layer
    for _ in range(2):
        FlashLayout(BS, H, D).move(twice, src[0], dst[0])
    assert not torch.equal(twice, shared)


def test_layout_for_picks_and_refuses():
    cpu = pack("cpu_attn_vec", *random_kv(0))
    assert isinstance(layout_for("CPU_ATTN", cpu, BS, H, D, isa="vec"), CpuAttnVecLayout)
    assert isinstance(layout_for("CPU_ATTN", cpu, BS, H, D, isa="vec16"), CpuAttnVecLayout)
    assert isinstance(layout_for("FLASH_ATTN", cpu, BS, H, D), HeadSplitLayout)     # same shape, other packing
    assert isinstance(layout_for("FLASH_ATTN", torch.zeros(SHAPES["flash"]), BS, H, D), FlashLayout)
    assert isinstance(layout_for("FLASHINFER", torch.zeros(SHAPES["paged_nb2"]), BS, H, D), PagedNB2Layout)
    with pytest.raises(NotImplementedError, match="ISA 'neon'"):      # amx: tests/unit/test_amx_layout.py
        layout_for("CPU_ATTN", cpu, BS, H, D, isa="neon")
    with pytest.raises(NotImplementedError, match="ISA None"):
        layout_for("CPU_ATTN", cpu, BS, H, D)
    with pytest.raises(NotImplementedError, match="backend 'XFORMERS'"):
        layout_for("XFORMERS", cpu, BS, H, D)
    with pytest.raises(ValueError, match=r"shape \(5, 3, 4, 12\) matches none"):
        layout_for("CPU_ATTN", cpu, BS, H, D + 1, isa="vec")
    with pytest.raises(ValueError, match="expects a cache of shape"):
        FlashLayout(BS, H, D).gather(cpu, torch.zeros(H, 1, dtype=torch.int64))
