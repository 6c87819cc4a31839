"""keep_mask -> slot moves (a :class:`MovePlan`) that compact a request's cache, so that its tail blocks empty out.

Pure and engine-agnostic: slots are indices 0..N-1 within one request's cache (the engine maps them to physical
slots through its block table). After the moves, slots 0..K-1 of every (layer, KV head) hold that head's K kept
tokens, so the whole tail beyond K can be returned to the block allocator. ``repack`` keeps position order;
``holefill`` moves the fewest slots but not in position order, so the engine must carry per-slot position tags
(the plan moves them too). Plans run gather-all-then-scatter, and the one-launch executor relies on the order of a
plan's entries (docs/DESIGN.md, section 4.6); :func:`apply_plan` is the reference executor.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from kvcompact.config import MOVE_MODES


@dataclass
class MovePlan:
    """Slot moves per (layer, KV head), padded to the longest list M.

    Padding entries (``valid`` False) are self-copies of slot N-1, which is >= kept_len and never a
    destination, so a backend may execute the padded lists as they are (a no-op) instead of masking them.
    """

    src: Tensor    # [L, H, M] int64
    dst: Tensor    # [L, H, M] int64
    valid: Tensor  # [L, H, M] bool
    kept_len: int

    @property
    def num_moves(self) -> int:
        return int(self.valid.sum())


def plan_moves(keep: Tensor, mode: str) -> MovePlan:
    """Plan the moves that bring each (l, h)'s kept slots into slots 0..K-1.

    keep: [L, H, N] bool with the same count K in every (l, h) (the block table is shared by all heads).
    """
    if mode not in MOVE_MODES:
        raise ValueError(f"compaction mode must be one of {', '.join(MOVE_MODES)}; got {mode!r}")
    if keep.dim() != 3 or keep.dtype != torch.bool:
        raise ValueError(f"keep must be a [L, H, N] bool tensor, got {keep.dtype} {tuple(keep.shape)}")
    L, H, N = keep.shape
    counts = keep.sum(dim=-1)
    K = int(counts.max()) if counts.numel() else 0
    if not bool((counts == K).all()):
        raise ValueError(f"every (layer, KV head) must keep the same number of slots; got counts from "
                         f"{int(counts.min())} to {K}")
    slot = torch.arange(N, device=keep.device)
    if mode == "repack":
        src = ascending_slots(keep)[..., :K]
        dst = slot[:K].expand(L, H, K)
        moved = src != dst
    else:
        tails = keep & (slot >= K)
        src = ascending_slots(tails)[..., :K]
        dst = ascending_slots(~keep & (slot < K))[..., :K]
        moved = slot[:K] < tails.sum(dim=-1, keepdim=True)
    return _pack(src, dst, moved, N, K)


def apply_plan(x: Tensor, plan: MovePlan) -> Tensor:
    """What slots 0..kept_len-1 hold after executing ``plan`` on x [L, H, N, *rest] (gather, then scatter).

    The reference every engine must reproduce; also how position tags and the transformers cache are moved.
    Invalid entries are ignored, so a hand-built plan with arbitrary padding is executed faithfully.
    """
    L, H, N = x.shape[:3]
    rest = x.shape[3:]
    base = (torch.arange(L * H, device=x.device) * N).view(L, H, 1)
    flat_src = (base + plan.src)[plan.valid]
    flat_dst = (base + plan.dst)[plan.valid]
    flat = x.reshape(L * H * N, *rest)
    out = flat.clone()
    out[flat_dst] = flat[flat_src]
    return out.view(L, H, N, *rest)[:, :, :plan.kept_len].contiguous()


def ascending_slots(mask: Tensor) -> Tensor:
    """Per row, the indices of True slots in ascending order, followed by the False ones."""
    return torch.argsort((~mask).to(torch.int8), dim=-1, stable=True)


def _pack(src: Tensor, dst: Tensor, moved: Tensor, N: int, K: int) -> MovePlan:
    """Bring each row's real moves to the front, cut to the longest row and pad with self-copies of N-1."""
    M = int(moved.sum(dim=-1).max()) if moved.numel() else 0
    idx = ascending_slots(moved)[..., :M]
    valid = moved.gather(-1, idx)
    pad = torch.full_like(idx, N - 1)
    return MovePlan(src=torch.where(valid, src.gather(-1, idx), pad),
                    dst=torch.where(valid, dst.gather(-1, idx), pad),
                    valid=valid, kept_len=K)


__all__ = ["ascending_slots", "MovePlan", "plan_moves", "apply_plan"]
