"""The recall tier: what a round evicts waits in a per-request store outside vLLM's pool, and comes back slot for slot
when the request's latest query says it beats the weakest tokens the cache kept (docs/DESIGN.md, section 9).

Engine-agnostic, like :mod:`kvcompact.round`: :class:`RecallStore` holds the evicted K and V with their logical
positions and a Quest digest per page (per-channel min and max of the keys), and :func:`plan_swaps` turns one
query into a :class:`SwapPlan`. A recall is a swap, never a growth: the cache length, its blocks and the
scheduler's arithmetic stay as the round left them, and the token swapped out goes to the store in turn.
The store keeps K and V in the cache's dtype, or as one-byte codes with one float32 scale per token and KV head
(:data:`CODECS`, by ``recall_dtype``): ``fp8`` holds both as e4m3, ``int8_values`` keeps the keys exact (the
recall's decisions and every attention logit read them) and holds the values as int8. A recalled token then comes
back as its codec's :meth:`Codec.round_trip` of what was evicted, which the reference replays.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

PAGE = 16  # store entries per digest page, per (layer, KV head)
FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max
INT8_MAX = 127


def _scales(x: Tensor, top: float) -> Tensor:
    """float32 scales [..., 1] that map each vector's largest magnitude to ``top`` (an all-zero vector gets the
    smallest positive scale, and zero codes)."""
    return x.abs().amax(dim=-1, keepdim=True).clamp(min=torch.finfo(torch.float32).tiny) / top


def to_fp8(x: Tensor) -> tuple[Tensor, Tensor]:
    """e4m3 codes of ``x`` [..., d] scaled per vector (its largest magnitude maps to e4m3's largest, 448) and the
    float32 scales [..., 1]."""
    x = x.float()
    scale = _scales(x, FP8_MAX)
    return (x / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


def to_int8(x: Tensor) -> tuple[Tensor, Tensor]:
    """Symmetric int8 codes of ``x`` [..., d] per vector (its largest magnitude maps to 127: every element within
    half a step, 1/254 of that magnitude, where e4m3 rounds the large ones by up to 1/16 of theirs) and the float32
    scales [..., 1]."""
    x = x.float()
    scale = _scales(x, INT8_MAX)
    return (x / scale).round().clamp(-INT8_MAX, INT8_MAX).to(torch.int8), scale


@dataclass(frozen=True)
class Codec:
    """How the store holds one of K and V: ``exact`` as the cache holds it (no scales), ``fp8`` as e4m3 codes
    held as their bytes (the CPU has no gather or cat for float8 tensors) or ``int8``, each with one float32
    scale per token and KV head."""

    name: str

    def encode(self, x: Tensor) -> tuple[Tensor, Tensor]:
        if self.name == "fp8":
            codes, scales = to_fp8(x)
            return codes.view(torch.uint8), scales
        if self.name == "int8":
            return to_int8(x)
        return x, x.new_empty(*x.shape[:-1], 0, dtype=torch.float32)

    def decode(self, codes: Tensor, scales: Tensor, dtype: torch.dtype) -> Tensor:
        if self.name == "exact":
            return codes
        return ((codes.view(FP8) if self.name == "fp8" else codes).float() * scales).to(dtype)

    def round_trip(self, x: Tensor) -> Tensor:
        """What the store gives back for ``x``, in x's dtype."""
        return self.decode(*self.encode(x), x.dtype)


EXACT, FP8_CODEC, INT8_CODEC = Codec("exact"), Codec("fp8"), Codec("int8")
# recall_dtype -> (codec of K, codec of V)
CODECS = {"auto": (EXACT, EXACT), "fp8": (FP8_CODEC, FP8_CODEC), "int8_values": (EXACT, INT8_CODEC)}


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
    eligible: Tensor | None = None  # [L, H, M] bool: the slot may give way (a prefix of each row; None: every one)

    def cut(self, i: int, slots: int, pages: int) -> SwapPlan:
        """Row i of plans made side by side (:func:`plan_layer_swaps`), its first ``slots`` slots and ``pages``
        pages: views, as the plan for that request alone [1, H, slots]."""
        assert self.eligible is not None
        return SwapPlan(self.slots[i: i + 1, :, :slots], self.entries[i: i + 1, :, :slots],
                        self.swapped[i: i + 1, :, :slots],
                        None if self.pages is None else self.pages[i: i + 1, :, :pages],
                        self.eligible[i: i + 1, :, :slots])

    def spanned(self, positions: Tensor, span: int) -> SwapPlan:
        """The plan with the ``span`` positions after each token it recalls recalled too (``recall_span``), from
        ``positions`` [L, H, S] (the store's, before the swap), into the next weakest eligible slots (in the
        store's order where there are fewer slots than such positions): a far-back result is copied token after
        token, and the query that recalls its first token does not ask for the rest yet. A following position that
        is not in the store (kept in the cache, or dropped for good) is skipped; one the plan already recalls is
        not taken twice."""
        swapped = self.swapped
        n = int(swapped.sum(dim=-1).max())
        if not n or span <= 0:
            return self
        anchors = positions.gather(-1, self.entries[..., :n]).masked_fill(~swapped[..., :n], -span - 1)
        after = positions.unsqueeze(-2) - anchors.unsqueeze(-1)                          # [L, H, n, S]
        want = ((after > 0) & (after <= span)).any(dim=-2)
        taken = torch.zeros_like(want, dtype=torch.int8).scatter_reduce(
            -1, self.entries[..., :n], swapped[..., :n].to(torch.int8), "amax").bool()
        want &= ~taken
        count = want.sum(dim=-1, keepdim=True)
        order = torch.argsort((~want).to(torch.int8), dim=-1, stable=True)                # wanted entries first
        column = torch.arange(swapped.shape[-1], device=swapped.device) - swapped.sum(dim=-1, keepdim=True)
        take = (column >= 0) & (column < count)
        if self.eligible is not None:
            take &= self.eligible
        if not take.any():
            return self
        entries = torch.where(take, order.gather(-1, column.clamp(0, order.shape[-1] - 1)), self.entries)
        pages = None if self.pages is None else torch.cat(
            [self.pages, torch.where(take, entries // PAGE, self.pages[..., :1])], dim=-1)
        return SwapPlan(self.slots, entries, swapped | take, pages, self.eligible)


class RecallStore:
    """One request's evicted tokens on one worker: K and V ``[L, H, S, d]``, their logical positions ``[L, H, S]``
    (oldest entries first), and per page of :data:`PAGE` entries the min and max of every key channel
    ``[L, H, P, d]`` (Quest's digest: ``sum_c max(q_c min_c, q_c max_c)`` bounds a query's logit to any key of the
    page, as the store gives the key back). The digest is held in the dtype keys come back in: the min and max of
    such keys are such numbers, so it is exact at half of float32's bytes for a bf16 cache. Every (layer, KV head)
    holds the same number of entries, as every one evicts the same number of tokens in a round and a swap is one
    for one; under ``per_head`` selection they also hold the same positions in the same order across layers.
    ``dtype`` (``recall_dtype``) picks the :data:`CODECS` of K and V; an exact one holds them as the cache does,
    with scales of width 0, so every per-entry tensor is appended, dropped and written alike. Without ``digests``
    (``recall_search`` exact, which scores the keys themselves) no page digest is built, held or refreshed: the
    digests are then empty, and neither their bytes nor their upkeep at every add and swap is spent."""

    def __init__(self, keys: Tensor, values: Tensor, positions: Tensor, dtype: str = "auto",
                 digests: bool = True) -> None:
        self.codecs, self.dtype = CODECS[dtype], keys.dtype
        self.keys, self.key_scales = self.codecs[0].encode(keys)
        self.values, self.value_scales = self.codecs[1].encode(values)
        self.positions = positions
        self.dropped = 0
        self.digests = digests
        self.mins, self.maxs = self._digest(self.read_keys() if digests else keys[:, :, :0])

    def layer(self, index: int) -> RecallStore:
        """Layer ``index`` alone, as a store of one layer whose tensors are views of this one's: its swaps write
        here (what ``recall_at`` layer decides inside the forward, layer by layer). Not for :meth:`add`."""
        view = object.__new__(RecallStore)
        view.codecs, view.dtype, view.dropped, view.digests = self.codecs, self.dtype, 0, self.digests
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

    def read_keys(self, entries: Tensor | None = None) -> Tensor:
        """The keys as a recall gives them back, in the cache's dtype: every entry's, or those of ``entries``
        [L, H, M] (what scoring reads: V is half the traffic)."""
        if entries is None:
            return self.codecs[0].decode(self.keys, self.key_scales, self.dtype)
        return self.codecs[0].decode(*self._take(entries, self.keys, self.key_scales), self.dtype)

    def read(self, entries: Tensor) -> tuple[Tensor, Tensor]:
        """The K and V ``[L, H, M, d]`` of ``entries`` [L, H, M] as a recall puts them in the cache."""
        values = self.codecs[1].decode(*self._take(entries, self.values, self.value_scales), self.dtype)
        return self.read_keys(entries), values

    @staticmethod
    def _take(entries: Tensor, codes: Tensor, scales: Tensor) -> tuple[Tensor, Tensor]:
        """``codes`` and ``scales`` of ``entries`` [L, H, M]; the scales only where there are any: the recall's
        hot path runs once per layer and request, and a read of nothing still costs a call."""
        at = (*_rows(entries), entries)
        return codes[at], scales[at] if scales.shape[-1] else scales

    def add(self, keys: Tensor, values: Tensor, positions: Tensor, limit: int) -> int:
        """Append a round's evicted tokens; past ``limit`` entries the oldest whole pages are dropped for good.
        Returns the entries dropped per (layer, KV head)."""
        full = self.size // PAGE  # pages whose digest stays valid (unless dropped)
        (k, ks), (v, vs) = self.codecs[0].encode(keys), self.codecs[1].encode(values)
        held = [torch.cat([old, new], dim=2) for old, new in zip(self._rows() + (self.positions,),
                                                                  (k, v, ks, vs, positions))]
        over = held[-1].shape[-1] - limit
        drop = 0 if over <= 0 else min(held[-1].shape[-1], -(-over // PAGE) * PAGE)
        if drop:
            held = [t[:, :, drop:].contiguous() for t in held]
            self.dropped += drop
        self.keys, self.values, self.key_scales, self.value_scales, self.positions = held
        if not self.digests:
            return drop
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
        (k, ks), (v, vs) = self.codecs[0].encode(keys[plan.swapped]), self.codecs[1].encode(values[plan.swapped])
        for held, new in zip(self._rows(), (k, v, ks, vs)):
            if held.shape[-1]:  # an exact codec's scales have width 0
                held.view(L * H, self.size, held.shape[-1])[rows, at] = new.to(held.dtype)
        self.positions.view(L * H, -1)[rows, at] = positions[plan.swapped]
        if self.digests:
            self._refresh(plan.entries // PAGE if plan.pages is None else plan.pages)

    def _refresh(self, pages: Tensor) -> None:
        """Recompute the digests of ``pages`` [L, H, k] (repeats allowed) after their entries changed."""
        L, H, S, d = self.keys.shape
        entries = (pages.unsqueeze(-1) * PAGE + torch.arange(PAGE, device=pages.device)).flatten(2)
        live = (entries < S).view(L, H, -1, PAGE, 1)
        k = self.read_keys(entries.clamp_max(S - 1)).float().view(L, H, -1, PAGE, d)
        index = pages.unsqueeze(-1).expand(-1, -1, -1, d)
        self.mins.scatter_(2, index, k.masked_fill(~live, torch.inf).amin(dim=3).to(self.mins.dtype))
        self.maxs.scatter_(2, index, k.masked_fill(~live, -torch.inf).amax(dim=3).to(self.maxs.dtype))

    def bounds(self, query: Tensor) -> Tensor:
        """Quest's bound of each page [L, H, G, P] for ``query`` [L, H, G, d] (float32, post-RoPE)."""
        assert self.digests, "a store without digests has no page bound"
        return quest_bound(query, self.mins.float(), self.maxs.float())

    def layer_all_keys(self, index: int) -> Tensor:
        """Every key [H, S, d] of layer ``index`` as :meth:`read_keys` gives them (a view where the keys are held
        exact)."""
        return self.codecs[0].decode(self.keys[index], self.key_scales[index], self.dtype)

    def layer_keys(self, index: int, entries: Tensor) -> Tensor:
        """The keys [1, H, M, d] of layer ``index``'s ``entries`` [1, H, M], as :meth:`read_keys` gives them (a
        layer's decision reads one layer of each request's store)."""
        layer = slice(index, index + 1)
        return self.codecs[0].decode(*self._take(entries, self.keys[layer], self.key_scales[layer]), self.dtype)

    @staticmethod
    def _digest(keys: Tensor) -> tuple[Tensor, Tensor]:
        """Per-page min and max of every key channel, in the keys' dtype; a last, partial page only over its
        entries."""
        L, H, S, d = keys.shape
        pages = -(-S // PAGE)
        pad = pages * PAGE - S
        k = torch.nn.functional.pad(keys.float(), (0, 0, 0, pad)).view(L, H, pages, PAGE, d)
        live = (torch.arange(pages * PAGE, device=keys.device) < S).view(1, 1, pages, PAGE, 1)
        return (k.masked_fill(~live, torch.inf).amin(dim=3).to(keys.dtype),
                k.masked_fill(~live, -torch.inf).amax(dim=3).to(keys.dtype))


def _rows(entries: Tensor) -> tuple[Tensor, Tensor]:
    """The (layer, KV head) indices that, with ``entries`` [L, H, M], read ``x[l, h, entries[l, h, m]]`` of a
    tensor [L, H, S, w] whole rows at a time: 2.5x faster on the CPU than ``gather`` with the index expanded
    over w, which reads element by element."""
    L, H = entries.shape[:2]
    return (torch.arange(L, device=entries.device).view(L, 1, 1), torch.arange(H, device=entries.device).view(1, H, 1))


def quest_bound(query: Tensor, mins: Tensor, maxs: Tensor) -> Tensor:
    """``sum_c max(q_c min_c, q_c max_c)`` [..., G, P] for ``query`` [..., G, d] and page digests [..., P, d]."""
    return (query.clamp(min=0) @ maxs.transpose(-1, -2)) + (query.clamp(max=0) @ mins.transpose(-1, -2))


@dataclass
class StackedDigests:
    """The digests of several requests' stores side by side, so that one layer's decision scores every request's
    pages in one product (``recall_at`` layer: a forward's decode rows, one decision per layer for all of them
    rather than one per layer and request, whose fixed cost per call made most of the recall's time). Request i's
    page p is column ``columns[i, p]`` of the concatenated pages, where ``valid[i, p]``."""

    mins: Tensor     # [L, H, sum of pages, d] float32 (a store's digest in its keys' dtype, widened once here)
    maxs: Tensor
    columns: Tensor  # [B, P] int64, P the most pages of any store (0 past a store's pages)
    valid: Tensor    # [B, P] bool
    sizes: Tensor    # [B, 1, 1] int64 entries per (layer, KV head) of each store

    @classmethod
    def of(cls, stores: list[RecallStore]) -> StackedDigests:
        """A snapshot: valid for a layer until that layer's swaps (each layer decides once a forward)."""
        pages = torch.tensor([s.mins.shape[2] for s in stores])
        starts = pages.cumsum(0) - pages
        span = torch.arange(int(pages.max()))
        valid = span < pages.unsqueeze(1)
        device = stores[0].mins.device
        return cls(torch.cat([s.mins for s in stores], dim=2).float(),
                   torch.cat([s.maxs for s in stores], dim=2).float(),
                   torch.where(valid, starts.unsqueeze(1) + span, 0).to(device), valid.to(device),
                   torch.tensor([s.size for s in stores], device=device).view(-1, 1, 1))

    def cuts(self, pages: int, widths: list[int]) -> list[tuple[int, int]]:
        """Per request, the slots and pages of its own plan in a batched one (:meth:`SwapPlan.cut`): ``pages``
        pages or as many as its store has, and as many slots as their entries or its ``widths`` slots allow."""
        counts = self.valid.sum(dim=-1).tolist()
        return [(min(min(pages, p) * PAGE, w), min(pages, p)) for p, w in zip(counts, widths)]

    def bounds(self, query: Tensor, layer: int) -> Tensor:
        """The bound of each request's pages [B, H, P] in ``layer`` for its query [B, H, G, d] (max over the
        group; -inf past its pages). Every query meets every request's pages: a few MFLOP, one call."""
        every = quest_bound(query, self.mins[layer], self.maxs[layer]).amax(dim=2)  # [B, H, sum of pages]
        own = every.gather(-1, self.columns.unsqueeze(1).expand(-1, every.shape[1], -1))
        return own.masked_fill(~self.valid.unsqueeze(1), -torch.inf)


def _page_entries(top: Tensor, size: int | Tensor) -> tuple[Tensor, Tensor]:
    """The store entries [.., k * PAGE] of pages ``top`` [.., k], where they exist (``size`` entries), and entry 0
    (read, never swapped) where they do not."""
    entries = (top.unsqueeze(-1) * PAGE + torch.arange(PAGE, device=top.device)).flatten(2)
    live = entries < size
    return torch.where(live, entries, 0), live


def _decide(q: Tensor, candidates: Tensor, entries: Tensor, live: Tensor, top: Tensor | None, kept_keys: Tensor,
            eligible: Tensor, per_head: bool, margin: float) -> SwapPlan:
    """The swaps from the scored candidates' keys [L, H, E, d] (``live`` where they exist) and the kept slots'."""
    d = q.shape[-1]

    def logits(keys: Tensor) -> Tensor:  # [L, H, M, d] -> [L, H, M]
        x = (q @ keys.transpose(-1, -2)).amax(dim=2)
        return x.mean(dim=0, keepdim=True).expand_as(x) if per_head else x

    best, order = logits(candidates).masked_fill(~live, -torch.inf).sort(dim=-1, descending=True, stable=True)
    kept = logits(kept_keys)
    weakest, slots = kept.masked_fill(~eligible, torch.inf).sort(dim=-1, stable=True)
    strongest = kept.masked_fill(~eligible, -torch.inf).amax(dim=-1, keepdim=True)
    m = min(best.shape[-1], kept.shape[-1])
    best, weakest = best[..., :m], weakest[..., :m]
    return SwapPlan(slots=slots[..., :m], entries=entries.gather(-1, order[..., :m]),
                    swapped=(best > weakest) & (best >= strongest - margin * d ** 0.5), pages=top,
                    eligible=weakest < torch.inf)


def _top_entries(q: Tensor, keys: Tensor, sizes: Tensor | int, count: int, per_head: bool) -> tuple[Tensor, Tensor]:
    """``recall_search`` exact: the ``count`` entries [L, H, count] of ``keys`` [L, H, S, d] (held as the store
    gives them back, past ``sizes`` padding) with the highest logit ``q . k`` for ``q`` [L, H, G, d] (max over the
    group, averaged over layers under ``per_head``), and where they exist. One product in the keys' dtype (bf16
    on AMX: converting every stored key to float32 would cost more than the product); the decision then rescores
    the candidates in float32, so its rounding only decides which entries are candidates near the last one."""
    scores = (q.to(keys.dtype) @ keys.transpose(-1, -2)).amax(dim=2).float()              # [L, H, S]
    if per_head:
        scores = scores.mean(dim=0, keepdim=True).expand_as(scores)
    S = keys.shape[2]
    live = torch.arange(S, device=keys.device) < sizes
    best, entries = scores.masked_fill(~live, -torch.inf).topk(min(count, S), dim=-1)
    live = best > -torch.inf
    return torch.where(live, entries, 0), live


def _plan_exact(q: Tensor, keys: Tensor, sizes: Tensor | int, count: int, kept_keys: Tensor, eligible: Tensor,
                per_head: bool, margin: float) -> SwapPlan:
    """``recall_search`` exact's plan: the :func:`_top_entries` of ``keys`` [L, H, S, d], read from those same keys
    (no second decode of the store), decided as every search's candidates are (:func:`_decide`)."""
    entries, live = _top_entries(q, keys, sizes, count, per_head)
    candidates = keys[(*_rows(entries), entries)].float()
    return _decide(q, candidates, entries, live, None, kept_keys, eligible, per_head, margin)


def plan_swaps(query: Tensor, store: RecallStore, kept_keys: Tensor, eligible: Tensor, pages: int,
               per_head: bool, margin: float, search: str = "quest") -> SwapPlan:
    """The swaps one query calls for: per (layer, KV head), the candidates are the entries of the ``pages`` store
    pages with the highest bound (``search`` quest) or the ``pages * PAGE`` entries with the highest logit of
    all (``search`` exact: every stored key scored), each scored exactly, and the best replace the weakest
    ``eligible`` kept slots one for one while they score higher (the logit ``q . k``, max over the KV head's
    query group, averaged over layers under ``per_head`` so that every layer of a head swaps the same tokens)
    and no more than ``margin`` nats (the logit scaled by ``1 / sqrt(d)``, as attention scales it) below the
    strongest eligible kept slot: a token the query really attends to, not one that merely beats tokens it barely
    reads (those would swap back and forth).

    query [L, H_q, d] float32 post-RoPE; kept_keys [L, H, N, d] float32 of the cache's slots; eligible [L, H, N].
    """
    L, Hq, d = query.shape
    H = kept_keys.shape[1]
    q = query.view(L, H, Hq // H, d)
    if search == "exact":
        return _plan_exact(q, store.read_keys(), store.size, pages * PAGE, kept_keys, eligible, per_head, margin)
    bound = store.bounds(q).amax(dim=2)
    if per_head:
        bound = bound.mean(dim=0, keepdim=True).expand_as(bound)
    top = bound.topk(min(pages, bound.shape[-1]), dim=-1).indices                         # [L, H, k]
    entries, live = _page_entries(top, store.size)
    return _decide(q, store.read_keys(entries).float(), entries, live, top, kept_keys, eligible, per_head, margin)


def plan_layer_swaps(query: Tensor, digests: StackedDigests, stores: list[RecallStore], layer: int,
                     kept_keys: Tensor, eligible: Tensor, pages: int, margin: float) -> SwapPlan:
    """:func:`plan_swaps` for one layer of B requests at once (``per_layer_per_head`` selection): request i's
    query ``query[i]`` [H_q, d], its store ``stores[i]`` (``digests`` stacks theirs), its kept slots' keys
    ``kept_keys[i]`` [H, N, d] with ``eligible[i]``, padded with ineligible slots past its own. Returns the plans
    side by side [B, H, m]: request i's, as :func:`plan_swaps` makes it for that layer alone, is
    ``plan.cut(i, *digests.cuts(pages, widths)[i])``; the padding (pages past a store's, slots past a request's)
    only adds candidates and slots that never swap and sort after every one that may."""
    B, Hq, d = query.shape
    H = kept_keys.shape[1]
    q = query.view(B, H, Hq // H, d)
    bound = digests.bounds(q, layer)
    top = bound.topk(min(pages, bound.shape[-1]), dim=-1).indices                         # [B, H, k]
    entries, live = _page_entries(top, digests.sizes)
    candidates = torch.cat([s.layer_keys(layer, entries[i: i + 1]) for i, s in enumerate(stores)]).float()
    return _decide(q, candidates, entries, live, top, kept_keys, eligible, False, margin)


def plan_layer_exact(query: Tensor, stores: list[RecallStore], layer: int, kept_keys: Tensor, eligible: Tensor,
                     pages: int, margin: float) -> SwapPlan:
    """:func:`plan_layer_swaps` under ``search`` exact: every stored key of the layer, each request's padded to
    the largest store, in one product. Request i's plan, as :func:`plan_swaps` makes it for that layer alone, is
    ``plan.cut(i, *exact_cuts(stores, pages, widths)[i])``."""
    B, Hq, d = query.shape
    H = kept_keys.shape[1]
    q = query.view(B, H, Hq // H, d)
    sizes = [s.size for s in stores]
    S = max(sizes)
    keys = query.new_empty(B, H, S, d, dtype=stores[0].dtype)  # one copy of each store's keys, padded with zeros
    for i, store in enumerate(stores):                           # (scored, then masked)
        keys[i, :, :store.size] = store.layer_all_keys(layer)
        keys[i, :, store.size:] = 0
    return _plan_exact(q, keys, torch.tensor(sizes, device=keys.device).view(-1, 1, 1), pages * PAGE, kept_keys,
                       eligible, False, margin)


def exact_cuts(stores: list[RecallStore], pages: int, widths: list[int]) -> list[tuple[int, int]]:
    """:meth:`StackedDigests.cuts` for :func:`plan_layer_exact`: per request as many slots as its candidates
    (``pages * PAGE`` or its store's entries) or its ``widths`` slots allow; no pages."""
    return [(min(pages * PAGE, s.size, w), 0) for s, w in zip(stores, widths)]


__all__ = ["CODECS", "PAGE", "Codec", "Recall", "RecallStore", "StackedDigests", "SwapPlan", "exact_cuts",
           "plan_layer_exact", "plan_layer_swaps", "plan_swaps", "quest_bound", "to_fp8", "to_int8"]
