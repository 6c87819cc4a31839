"""Scores -> keep set: budget, protection, GQA and layer aggregation (docs/DESIGN.md, section 4.3).

Policies only score tokens; this module decides which survive, so the vLLM worker and the transformers
reference path keep exactly the same tokens. Everything is one batch of tensor ops over (request, layer,
head, slot); the only host syncs are the budget check and the per_head position check, one each per call.

The mask is a pure function of (position, score) per slot: ties in the aggregated score are broken toward the
later logical position, never by slot index, so two engines that store the same tokens in different slots (or
the same engine before and after a hole-filling round) keep the same tokens.
"""

from __future__ import annotations

import torch
from torch import Tensor

from kvcompact.config import SELECTIONS


def select_keep(scores: Tensor, positions: Tensor, logical_len: Tensor, budget: Tensor, prompt_len: Tensor, *,
                window: int, protect_prompt: bool, mode: str, n_sink: int = 0) -> Tensor:
    """Return the [B, L, H_kv, N] bool keep mask; every (b, l, h) keeps exactly min(budget[b], #valid) slots.

    scores [B, L, G, N] (G = H_q or H_kv), positions [B, L, H_kv, N] int64 (-1 = padding), logical_len, budget and
    prompt_len [B] int64. Padding is never kept; neither padding nor protected slots take part in the z-score
    statistics; protected slots (the first ``n_sink`` positions, the recent window, and the prompt when
    ``protect_prompt``) are always kept and count toward the budget.
    "per_head" keeps one set per (request, KV head), shared by all layers (the paper); "per_layer_per_head"
    lets every layer choose on its own. Raises ValueError when the protected tokens exceed the budget.
    """
    if mode not in SELECTIONS:
        raise ValueError(f"selection mode must be one of {', '.join(SELECTIONS)}; got {mode!r}")
    B, L, H, N = positions.shape
    G = scores.shape[2]
    if scores.shape != (B, L, G, N) or G % H != 0:
        raise ValueError(f"scores {tuple(scores.shape)} do not match positions {tuple(positions.shape)}: "
                         f"expected [B, L, G, N] with G a multiple of H_kv={H}")
    valid = positions >= 0
    protected = protected_slots(positions, valid, logical_len, prompt_len, window, protect_prompt, n_sink)
    # Standardize over the candidates only: protected slots are kept whatever they score, and a protected
    # outlier (an attention sink in the window, a prompt token) would inflate its head's spread.
    candidates = (valid & ~protected).repeat_interleave(G // H, dim=2)
    agg = _group_max(_zscore(scores.float(), candidates), H)                                # [B, L, H, N]
    if mode == "per_head":
        # All layers were moved identically in this mode, so a (b, h) has one position per slot; a mismatch
        # means the caller mixed modes between rounds and the shared mask would keep different tokens per layer.
        if not torch.equal(positions, positions[:, :1].expand_as(positions)):
            raise ValueError("per_head selection needs the same positions in every layer of a KV head")
        positions, valid, protected, agg = positions[:, 0], valid[:, 0], protected[:, 0], agg.mean(dim=1)
    _check_budget(protected, budget)
    key = torch.where(protected, torch.inf, agg).masked_fill(~valid, -torch.inf)
    count = torch.minimum(_per_request(budget, key.dim() - 1), valid.sum(dim=-1))
    keep_mask = _top_count(key, positions, count)
    if mode == "per_head":
        keep_mask = keep_mask.unsqueeze(1).expand(B, L, H, N).contiguous()
    return keep_mask


def _zscore(scores: Tensor, valid: Tensor) -> Tensor:
    """Standardize each (b, l, g) row over its valid slots, so heads with different score scales are comparable
    before the group max and layer mean.

    A row whose spread is below float32 resolution of its mean (a constant row) gets z = 0 instead of the
    +-1 that rounding noise would produce, so a degenerate head cannot dominate its group's max.
    """
    n = valid.sum(dim=-1, keepdim=True).clamp_min(1)
    x = scores.masked_fill(~valid, 0.0)
    mean = x.sum(dim=-1, keepdim=True) / n
    centered = (x - mean).masked_fill(~valid, 0.0)
    std = (centered.square().sum(dim=-1, keepdim=True) / n).sqrt()
    z = centered / std.clamp_min(torch.finfo(torch.float32).tiny)
    return torch.where(std > 1e-6 * mean.abs(), z, 0.0)


def _group_max(z: Tensor, num_kv_heads: int) -> Tensor:
    """Max over each GQA group: query head g belongs to KV head g // (G // H_kv), as in HF's repeat_kv."""
    B, L, G, N = z.shape
    return z.view(B, L, num_kv_heads, G // num_kv_heads, N).amax(dim=3)


def _per_request(x: Tensor, ndim: int) -> Tensor:
    """View a [B] tensor so it broadcasts against a [B, ...] tensor of ``ndim`` dims."""
    return x.view(-1, *([1] * (ndim - 1)))


def protected_slots(positions: Tensor, valid: Tensor, logical_len: Tensor, prompt_len: Tensor, window: int,
               protect_prompt: bool, n_sink: int) -> Tensor:
    """The slots no score can evict. The first ``n_sink`` positions are attention sinks: most heads park their
    attention there (StreamingLLM), and a model whose sink was evicted spreads that mass over whatever is left
    and degenerates. A score computed from keys alone (TriAttention, K-norm) cannot see that role."""
    nd = positions.dim()
    protected = (positions >= _per_request(logical_len, nd) - window) | (positions < n_sink)
    if protect_prompt:
        protected |= positions < _per_request(prompt_len, nd)
    return protected & valid


def _check_budget(protected: Tensor, budget: Tensor) -> None:
    """Fail loudly rather than evict a protected token: callers size budgets with
    :func:`kvcompact.ledger.effective_budget`."""
    count = protected.sum(dim=-1)
    over = count > _per_request(budget, count.dim())
    if bool(over.any()):
        where = over.nonzero()[0].tolist()
        b = where[0]
        raise ValueError(f"request {b}: {int(count[tuple(where)])} protected tokens exceed its budget "
                         f"{int(budget[b])}; size the budget with effective_budget()")


def _top_count(key: Tensor, positions: Tensor, count: Tensor) -> Tensor:
    """Mark the ``count`` best slots of each row by (key desc, position desc).

    Two stable sorts give the lexicographic order without per-row Python: first by position (later first),
    then by key; a stable sort keeps the position order among equal keys. Padding (key -inf, position -1)
    sorts after every valid slot, even a valid one scored -inf.
    """
    by_pos = positions.argsort(dim=-1, descending=True, stable=True)
    by_key = key.gather(-1, by_pos).argsort(dim=-1, descending=True, stable=True)
    order = by_pos.gather(-1, by_key)
    rank_kept = torch.arange(key.shape[-1], device=key.device) < count.unsqueeze(-1)
    return torch.zeros_like(rank_kept).scatter(-1, order, rank_kept)


__all__ = ["protected_slots", "select_keep"]
