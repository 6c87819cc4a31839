"""A draft model's layers on a fake runner, in milliseconds (the engine path is tests/engine/test_draft_model.py): which
draft shapes are accepted and with which plan, the moves and copies on write they get, and the drafter's slot
mapping readdressed by each row's eviction offset."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from kvcompact.config import ConfigError, KVCompactConfig
from kvcompact.moves import plan_moves
from kvcompact.round import BlockCopy
from kvcompact.vllm.kv_layout import CpuAttnVecLayout, phys_slots
from kvcompact.vllm.paged_kv import PagedKV
from kvcompact.vllm.startup import draft_layers
from support import FIXED

BS, H, D, BLOCKS = 4, 2, 8, 8


def fake_runner(target_layers: int, draft_shape: tuple[int, int, int], method: str = "draft_model") -> SimpleNamespace:
    """A runner whose KV-cache group interleaves ``target_layers`` target layers (H heads of D) with a draft of
    ``(layers, KV heads, head_dim)``, by layer index as vLLM's ``bind_kv_cache`` does."""
    dl, dh, dd = draft_shape
    context, names, caches = {}, [], []
    for i in range(max(target_layers, dl)):
        for prefix, n, heads, dim in (("", target_layers, H, D), ("draft_model.", dl, dh, dd)):
            if i < n:
                name = f"{prefix}model.layers.{i}.self_attn.attn"
                kv = torch.randn(CpuAttnVecLayout(BS, heads, dim).shape(BLOCKS))
                context[name] = SimpleNamespace(num_kv_heads=heads, head_size=dim, kv_cache=kv)
                names.append(name)
                caches.append(kv)
    drafts = {n for n in names if n.startswith("draft_model.")}
    return SimpleNamespace(
        vllm_config=SimpleNamespace(speculative_config=SimpleNamespace(method=method)),
        drafter=SimpleNamespace(_draft_attn_layer_names=drafts, positions=torch.zeros(8, dtype=torch.int64)),
        kv_cache_config=SimpleNamespace(kv_cache_groups=[SimpleNamespace(layer_names=names)]),
        compilation_config=SimpleNamespace(static_forward_context=context), kv_caches=caches,
        requests={"r": SimpleNamespace(block_ids=[[3, 5, 6]])},
        input_batch=SimpleNamespace(req_id_to_index={}, block_table=[None]))


def layout_of(_kv, heads: int, head_dim: int) -> CpuAttnVecLayout:
    return CpuAttnVecLayout(BS, heads, head_dim)


PER_HEAD = KVCompactConfig(**FIXED, selection="per_head")
PER_LAYER = KVCompactConfig(**FIXED, selection="per_layer_per_head")


@pytest.mark.parametrize("config", [PER_HEAD, PER_LAYER])
def test_a_draft_of_the_targets_shape_takes_the_targets_plan(config):
    runner = fake_runner(3, (3, H, D))
    draft = draft_layers(config, runner, layout_of)
    assert draft is not None and draft.same_plan and len(draft.caches) == 3
    targets = PagedKV(runner, layout_of(None, H, D), lambda _l, k: k.float(), draft).caches
    assert [id(t) for t in targets] == [id(runner.kv_caches[i]) for i in (0, 2, 4)]  # interleaved by index
    assert [id(d) for d in draft.caches] == [id(runner.kv_caches[i]) for i in (1, 3, 5)]


def test_per_head_selection_takes_any_draft_depth_and_head_dim():
    draft = draft_layers(PER_HEAD, fake_runner(3, (2, H, 16)), layout_of)
    assert draft is not None and not draft.same_plan and draft.layout.head_dim == 16


@pytest.mark.parametrize("config, shape, words", [
    (PER_LAYER, (2, H, D), ["2 layers", "'per_layer_per_head'"]),
    (PER_HEAD, (3, 1, D), ["1 KV heads", "as many KV heads"]),
    (PER_LAYER, (3, H, 16), ["head_dim 16"]),
])
def test_other_draft_shapes_are_refused_by_name(config, shape, words):
    with pytest.raises(ConfigError) as e:
        draft_layers(config, fake_runner(3, shape), layout_of)
    for word in words:
        assert word in str(e.value), (word, str(e.value))


def test_no_draft_without_draft_model_speculation():
    assert draft_layers(PER_HEAD, fake_runner(3, (0, H, D), method="ngram"), layout_of) is None


def keys(kv: PagedKV, caches: list[torch.Tensor], layout: CpuAttnVecLayout, n: int) -> torch.Tensor:
    """K and V [L, H, n, 2d] at the request's cache slots 0..n-1."""
    phys = phys_slots(kv.block_table("r"), torch.arange(n), BS).expand(layout.num_kv_heads, -1)
    return torch.stack([torch.cat(layout.gather(c, phys), -1) for c in caches])


@pytest.mark.parametrize("draft_shape", [(3, H, D), (2, H, 16)], ids=["same_shape", "per_head"])
def test_rounds_and_copies_move_the_draft_with_the_target(draft_shape):
    """A per_head keep set (the same tokens in every layer) moved on a fake cache: the draft's slots 0..kept_len-1
    then hold the tokens the target's hold, in the same order, in every layer and head; a copy on write copies
    the draft's half of the block too."""
    runner = fake_runner(3, draft_shape)
    draft = draft_layers(PER_HEAD, runner, layout_of)
    kv = PagedKV(runner, layout_of(None, H, D), lambda _l, k: k.float(), draft)
    n, kept_len = 10, 6
    keep = torch.zeros(H, n, dtype=torch.bool)
    keep[0, [0, 2, 3, 5, 8, 9]] = True
    keep[1, [1, 2, 4, 6, 7, 9]] = True
    before_t = keys(kv, kv.caches, kv.layout, n)
    before_d = keys(kv, draft.caches, draft.layout, n)
    plan = plan_moves(keep.expand(3, H, n).contiguous(), "repack")
    kv.execute([kv.block_table("r")], [plan])
    kept = keep.nonzero()[:, 1].view(H, kept_len)  # per head, ascending: repack keeps the order
    rows = torch.arange(H)[:, None]
    assert torch.equal(keys(kv, kv.caches, kv.layout, kept_len), before_t[:, rows, kept])
    assert torch.equal(keys(kv, draft.caches, draft.layout, kept_len), before_d[:, rows, kept])
    kv.copy_on_write([("r", BlockCopy(table_index=0, shared=3, private=7))])
    assert runner.requests["r"].block_ids[0] == [7, 5, 6]
    assert torch.equal(keys(kv, draft.caches, draft.layout, kept_len), before_d[:, rows, kept])


def test_drafter_slots_follow_the_cache():
    """Two rows (offsets 8 and 0) with 3 and 2 tokens: every slot vLLM did not pad is recomputed from
    ``position - offset`` through the row's block table; padded slots (-1: rejected drafts) stay padded."""
    runner = fake_runner(1, (1, H, D))
    kv = PagedKV(runner, layout_of(None, H, D), lambda _l, k: k.float(), draft_layers(PER_HEAD, runner, layout_of))
    table = torch.tensor([[3, 5, 6, 0], [2, 4, 0, 0]], dtype=torch.int32)
    positions = torch.tensor([17, 18, 19, 6, 7])
    metadata = SimpleNamespace(query_start_loc=torch.tensor([0, 3, 5], dtype=torch.int32), block_table_tensor=table,
                               slot_mapping=torch.tensor([99, 99, -1, 99, 99]))
    kv.address_draft(metadata, positions, torch.tensor([8, 0]))
    # row 0: cache positions 9, 10 (its third block, 6: offsets 1, 2); row 1: 6, 7 (its second, 4: offsets 2, 3)
    assert metadata.slot_mapping.tolist() == [6 * BS + 1, 6 * BS + 2, -1, 4 * BS + 2, 4 * BS + 3]
