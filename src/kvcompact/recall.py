"""The recall tier: what a round evicts waits in a per-request store outside vLLM's pool, and comes back slot for slot
when the request's latest query says it beats the weakest tokens the cache kept (docs/DESIGN.md, section 9).

Engine-agnostic, like :mod:`kvcompact.round`: :class:`RecallStore` holds the evicted K and V with their logical
positions and a Quest digest per page (per-channel min and max of the keys), and :func:`plan_swaps` turns one
query into a :class:`SwapPlan`. A recall is a swap, never a growth: the cache length, its blocks and the
scheduler's arithmetic stay as the round left them, and the token swapped out goes to the store in turn.
The store keeps K and V in the cache's dtype, or (``recall_dtype: fp8``) as e4m3 codes with one float32 scale per
token and KV head, a quarter of fp32's bytes: a recalled token then comes back as :func:`fp8_round_trip` of what
was evicted, which the reference replays.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

PAGE = 16  # store entries per digest page, per (layer, KV head)
FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max


def to_fp8(x: Tensor) -> tuple[Tensor, Tensor]:
    """e4m3 codes of ``x`` [..., d] scaled per vector (its largest magnitude maps to e4m3's largest, 448) and the
    float32 scales [..., 1]. An all-zero vector gets the smallest positive scale (and zero codes)."""
    x = x.float()
    scale = x.abs().amax(dim=-1, keepdim=True).clamp(min=torch.finfo(torch.float32).tiny) / FP8_MAX
    return (x / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


def from_fp8(codes: Tensor, scale: Tensor, dtype: torch.dtype) -> Tensor:
    return (codes.float() * scale).to(dtype)


def fp8_round_trip(x: Tensor) -> Tensor:
    """What an fp8 store gives back for ``x``: encoded by :func:`to_fp8`, decoded in x's dtype."""
    return from_fp8(*to_fp8(x), x.dtype)


@dataclass(frozen=True)
class Recall:
    """One recall of one request, as every listener gets it: with the request at ``logical_len`` tokens, slot
    ``slots[l, h, i]`` of (layer l, KV head h) took the evicted token of logical position ``positions[l, h, i]``
    wherever ``swapped[l, h, i]``; the token the slot held went to the store. When: after the forward whose query
    decided it, before that length's round (``recall_at`` step); or, ``in_forward``, after that length's round,
    in the forward of the token at ``logical_len``, each layer's swaps before that layer's attention
    (``recall_at`` layer): as a layer's cache is read by its own attention only, that is the same as every
    layer's swaps before the forward."""

    req_id: str
    logical_len: int
    slots: Tensor      # [L, H_kv, M] int64 cache slots
    positions: Tensor  # [L, H_kv, M] int64 logical positions recalled into them
    swapped: Tensor    # [L, H_kv, M] bool
    in_forward: bool = False

    @property
    def num_tokens(self) -> int:
        return int(self.swapped.sum())


@dataclass
class SwapPlan:
    """Which kept slots give way to which store entries, per (layer, KV head): entry ``i`` of a row swaps the i-th
    weakest eligible slot with the i-th strongest candidate, where ``swapped`` (true for a prefix of each row)."""

    slots: Tensor    # [L, H, M] int64, weakest first
    entries: Tensor  # [L, H, M] int64 store entries, strongest first
    swapped: Tensor  # [L, H, M] bool
    pages: Tensor | None = None  # [L, H, k] the store pages every entry lies in (None: each entry's own page)


class RecallStore:
    """One request's evicted tokens on one worker: K and V ``[L, H, S, d]``, their logical positions ``[L, H, S]``
    (oldest entries first), and per page of :data:`PAGE` entries the float32 min and max of every key channel
    ``[L, H, P, d]`` (Quest's digest: ``sum_c max(q_c min_c, q_c max_c)`` bounds a query's logit to any key of the
    page, as the store gives the key back). Every (layer, KV head) holds the same number of entries, as every one
    evicts the same number of tokens in a round and a swap is one for one; under ``per_head`` selection they also
    hold the same positions in the same order across layers. ``fp8``: K and V held as :func:`to_fp8` codes and
    scales, read back in the cache's dtype; otherwise as the cache holds them, with scales of width 0, so every
    per-entry tensor is appended, dropped and written alike."""

    def __init__(self, keys: Tensor, values: Tensor, positions: Tensor, fp8: bool = False) -> None:
        self.fp8, self.dtype = fp8, keys.dtype
        (self.keys, self.key_scales), (self.values, self.value_scales) = self._encode(keys), self._encode(values)
        self.positions = positions
        self.dropped = 0
        self.mins, self.maxs = self._digest(self.read_keys())

    def layer(self, index: int) -> RecallStore:
        """Layer ``index`` alone, as a store of one layer whose tensors are views of this one's: its swaps write
        here (what ``recall_at`` layer decides inside the forward, layer by layer). Not for :meth:`add`."""
        view = object.__new__(RecallStore)
        view.fp8, view.dtype, view.dropped = self.fp8, self.dtype, 0
        for name in ("keys", "key_scales", "values", "value_scales", "positions", "mins", "maxs"):
            setattr(view, name, getattr(self, name)[index:index + 1])
        return view

    @property
    def size(self) -> int:
        """Entries per (layer, KV head)."""
        return int(self.positions.shape[-1])

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._rows() + (self.positions, self.mins, self.maxs))

    def _rows(self) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """What is held per entry with a last dimension [L, H, S, w]: K, V and their scales."""
        return self.keys, self.values, self.key_scales, self.value_scales

    def _encode(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """fp8 codes are held as their bytes (uint8): the CPU has no gather or cat for float8 tensors."""
        if not self.fp8:
            return x, x.new_empty(*x.shape[:-1], 0, dtype=torch.float32)
        codes, scales = to_fp8(x)
        return codes.view(torch.uint8), scales

    def _decode(self, codes: Tensor, scales: Tensor) -> Tensor:
        return from_fp8(codes.view(FP8), scales, self.dtype) if self.fp8 else codes

    def read_keys(self, entries: Tensor | None = None) -> Tensor:
        """The keys as a recall gives them back, in the cache's dtype: every entry's, or those of ``entries``
        [L, H, M] (what scoring reads: V is half the traffic)."""
        if entries is None:
            return self._decode(self.keys, self.key_scales)
        return self._decode(*self._take(entries, self.keys, self.key_scales))

    def read(self, entries: Tensor) -> tuple[Tensor, Tensor]:
        """The K and V ``[L, H, M, d]`` of ``entries`` [L, H, M] as a recall puts them in the cache."""
        return self.read_keys(entries), self._decode(*self._take(entries, self.values, self.value_scales))

    def _take(self, entries: Tensor, codes: Tensor, scales: Tensor) -> tuple[Tensor, Tensor]:
        """``codes`` and ``scales`` of ``entries`` [L, H, M]; the scales only where there are any (fp8): the
        recall's hot path runs once per layer and request, and a gather of nothing still costs a call."""
        index = entries.unsqueeze(-1)
        codes = codes.gather(2, index.expand(-1, -1, -1, codes.shape[-1]))
        return codes, scales.gather(2, index.expand(-1, -1, -1, scales.shape[-1])) if self.fp8 else scales

    def add(self, keys: Tensor, values: Tensor, positions: Tensor, limit: int) -> int:
        """Append a round's evicted tokens; past ``limit`` entries the oldest whole pages are dropped for good.
        Returns the entries dropped per (layer, KV head)."""
        full = self.size // PAGE  # pages whose digest stays valid (unless dropped)
        (k, ks), (v, vs) = self._encode(keys), self._encode(values)
        held = [torch.cat([old, new], dim=2) for old, new in zip(self._rows() + (self.positions,),
                                                                  (k, v, ks, vs, positions))]
        over = held[-1].shape[-1] - limit
        drop = 0 if over <= 0 else min(held[-1].shape[-1], -(-over // PAGE) * PAGE)
        if drop:
            held = [t[:, :, drop:].contiguous() for t in held]
            self.dropped += drop
        self.keys, self.values, self.key_scales, self.value_scales, self.positions = held
        kept = max(0, full - drop // PAGE)  # old full pages still here: their digests carry over
        mins, maxs = self._digest(self.read_keys()[:, :, kept * PAGE:])
        first = full - kept
        self.mins = torch.cat([self.mins[:, :, first:full], mins], dim=2)
        self.maxs = torch.cat([self.maxs[:, :, first:full], maxs], dim=2)
        return drop

    def swap(self, plan: SwapPlan, keys: Tensor, values: Tensor, positions: Tensor) -> None:
        """Store what ``plan``'s slots held (``keys``/``values`` [L, H, M, d], ``positions`` [L, H, M]) in the
        entries the plan recalls from, and refresh those pages' digests."""
        L, H, M = plan.entries.shape
        entries = torch.where(plan.swapped, plan.entries, -1)
        rows = torch.arange(L * H, device=entries.device).view(L, H, 1).expand(L, H, M)[plan.swapped]
        at = entries[plan.swapped]
        (k, ks), (v, vs) = self._encode(keys[plan.swapped]), self._encode(values[plan.swapped])
        for held, new in zip(self._rows(), (k, v, ks, vs)):
            if held.shape[-1]:  # scales have width 0 outside fp8
                held.view(L * H, self.size, held.shape[-1])[rows, at] = new.to(held.dtype)
        self.positions.view(L * H, -1)[rows, at] = positions[plan.swapped]
        self._refresh(plan.entries // PAGE if plan.pages is None else plan.pages)

    def _refresh(self, pages: Tensor) -> None:
        """Recompute the digests of ``pages`` [L, H, k] (repeats allowed) after their entries changed."""
        L, H, S, d = self.keys.shape
        entries = (pages.unsqueeze(-1) * PAGE + torch.arange(PAGE, device=pages.device)).flatten(2)
        live = (entries < S).view(L, H, -1, PAGE, 1)
        k = self.read_keys(entries.clamp_max(S - 1)).float().view(L, H, -1, PAGE, d)
        index = pages.unsqueeze(-1).expand(-1, -1, -1, d)
        self.mins.scatter_(2, index, k.masked_fill(~live, torch.inf).amin(dim=3))
        self.maxs.scatter_(2, index, k.masked_fill(~live, -torch.inf).amax(dim=3))

    def bounds(self, query: Tensor) -> Tensor:
        """Quest's bound of each page [L, H, G, P] for ``query`` [L, H, G, d] (float32, post-RoPE)."""
        return (query.clamp(min=0) @ self.maxs.transpose(-1, -2)) + (query.clamp(max=0) @ self.mins.transpose(-1, -2))

    @staticmethod
    def _digest(keys: Tensor) -> tuple[Tensor, Tensor]:
        """Per-page min and max of every key channel; a last, partial page only over its entries."""
        L, H, S, d = keys.shape
        pages = -(-S // PAGE)
        pad = pages * PAGE - S
        k = torch.nn.functional.pad(keys.float(), (0, 0, 0, pad)).view(L, H, pages, PAGE, d)
        live = (torch.arange(pages * PAGE, device=keys.device) < S).view(1, 1, pages, PAGE, 1)
        return (k.masked_fill(~live, torch.inf).amin(dim=3), k.masked_fill(~live, -torch.inf).amax(dim=3))


def plan_swaps(query: Tensor, store: RecallStore, kept_keys: Tensor, eligible: Tensor, pages: int,
               per_head: bool, margin: float) -> SwapPlan:
    """The swaps one query calls for: per (layer, KV head), the ``pages`` store pages with the highest bound are
    scored exactly, and their best entries replace the weakest ``eligible`` kept slots one for one while they
    score higher (the logit ``q . k``, max over the KV head's query group, averaged over layers under
    ``per_head`` so that every layer of a head swaps the same tokens) and no more than ``margin`` nats (the
    logit scaled by ``1 / sqrt(d)``, as attention scales it) below the strongest eligible kept slot: a token the
    query really attends to, not one that merely beats tokens it barely reads (those would swap back and forth).

    query [L, H_q, d] float32 post-RoPE; kept_keys [L, H, N, d] float32 of the cache's slots; eligible [L, H, N].
    """
    L, Hq, d = query.shape
    H, N = kept_keys.shape[1], kept_keys.shape[2]
    q = query.view(L, H, Hq // H, d)

    def logits(keys: Tensor) -> Tensor:  # [L, H, M, d] -> [L, H, M]
        x = (q @ keys.transpose(-1, -2)).amax(dim=2)
        return x.mean(dim=0, keepdim=True).expand_as(x) if per_head else x

    bound = store.bounds(q).amax(dim=2)
    if per_head:
        bound = bound.mean(dim=0, keepdim=True).expand_as(bound)
    top = bound.topk(min(pages, bound.shape[-1]), dim=-1).indices                         # [L, H, k]
    entries = (top.unsqueeze(-1) * PAGE + torch.arange(PAGE, device=top.device)).flatten(2)
    live = entries < store.size
    entries = entries.clamp_max(store.size - 1)
    candidates = store.read_keys(entries).float()
    best, order = logits(candidates).masked_fill(~live, -torch.inf).sort(dim=-1, descending=True, stable=True)
    kept = logits(kept_keys)
    weakest, slots = kept.masked_fill(~eligible, torch.inf).sort(dim=-1, stable=True)
    strongest = kept.masked_fill(~eligible, -torch.inf).amax(dim=-1, keepdim=True)
    m = min(best.shape[-1], N)
    best = best[..., :m]
    return SwapPlan(slots=slots[..., :m], entries=entries.gather(-1, order[..., :m]),
                    swapped=(best > weakest[..., :m]) & (best >= strongest - margin * d ** 0.5), pages=top)


__all__ = ["PAGE", "Recall", "RecallStore", "SwapPlan", "fp8_round_trip", "from_fp8", "plan_swaps", "to_fp8"]
