"""The recall tier's store and swap decisions (:mod:`kvcompact.recall`) against plain-loop references, each check
paired with the defect it must catch. The engine's recalls are checked token for token in
tests/engine/test_recall.py."""

from __future__ import annotations

import operator

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcompact import recall
from kvcompact.recall import (
    CODECS,
    PAGE,
    RecallStore,
    StackedDigests,
    SwapPlan,
    exact_cuts,
    plan_layer_exact,
    plan_layer_swaps,
    plan_swaps,
    quest_bound,
)

L, H, G, D = 3, 2, 2, 8


def store_of(size: int, seed: int = 0, dtype: torch.dtype = torch.float32) -> RecallStore:
    g = torch.Generator().manual_seed(seed)
    keys = torch.randn(L, H, size, D, generator=g).to(dtype)
    return RecallStore(keys, torch.randn(L, H, size, D, generator=g).to(dtype),
                       torch.arange(size).expand(L, H, size).clone())


def loop_digest(keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-page min and max written as loops over pages."""
    S = keys.shape[2]
    pages = [keys[:, :, p: p + PAGE] for p in range(0, S, PAGE)]
    if not pages:
        return keys[:, :, :0], keys[:, :, :0]
    return (torch.stack([k.amin(dim=2) for k in pages], dim=2), torch.stack([k.amax(dim=2) for k in pages], dim=2))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@settings(max_examples=40, deadline=None)
@given(st.integers(2, 70), st.integers(0, 2 ** 16))
def test_page_bound_is_never_below_any_entry_logit(dtype, size, seed):
    """Quest's bound: no key of a page scores above its page's bound for any query, with the digest held in the
    keys' dtype (bf16: half of float32's bytes, and exact, as the min and max of bf16 keys are bf16 numbers).
    Control: the bound with min and max swapped (a digest built the wrong way round) falls below some entry."""
    store = store_of(size, seed, dtype)
    assert store.mins.dtype == store.maxs.dtype == dtype
    keys = store.keys.float()
    assert all(torch.equal(a.float(), b) for a, b in zip((store.mins, store.maxs), loop_digest(keys)))
    q = torch.randn(L, H, G, D, generator=torch.Generator().manual_seed(seed + 1))
    bound = store.bounds(q)                                                    # [L, H, G, P]
    logits = torch.einsum("lhgd,lhsd->lhgs", q, keys)
    pages = torch.arange(size) // PAGE
    assert (logits <= bound[..., pages] + 1e-5).all()
    wrong = quest_bound(q, store.maxs.float(), store.mins.float())  # min and max swapped
    assert not (logits <= wrong[..., pages] + 1e-5).all()


@pytest.mark.parametrize("first, more, limit", [(20, 30, 1000), (40, 40, 48), (16, 100, 32), (5, 3, 4)])
def test_add_drops_oldest_whole_pages_and_keeps_digests_exact(first, more, limit):
    """Appending keeps the entries in order, drops the oldest whole pages past the limit (counted), and the
    digests carried over equal the loop recomputation. Control: the digest before the append no longer matches."""
    store, extra = store_of(first, 1), store_of(more, 2)
    extra.positions += first
    before = store.mins.clone()
    dropped = store.add(extra.keys, extra.values, extra.positions, limit)
    every = torch.cat([torch.arange(first), torch.arange(more) + first])
    want = max(0, -(-(first + more - limit) // PAGE) * PAGE) if first + more > limit else 0
    assert dropped == min(want, first + more) and store.dropped == dropped
    assert torch.equal(store.positions[0, 0], every[dropped:])
    assert torch.equal(store.keys, torch.cat([store_of(first, 1).keys, extra.keys], dim=2)[:, :, dropped:])
    mins, maxs = loop_digest(store.keys)
    assert torch.equal(store.mins, mins) and torch.equal(store.maxs, maxs)
    if dropped:  # control: the digests from before the append no longer describe the pages
        assert not torch.equal(before[:, :, :1], mins[:, :, :1])


def test_swap_stores_what_the_slots_held_and_refreshes_digests():
    store = store_of(40)
    plan = SwapPlan(slots=torch.tensor([3, 7]).expand(L, H, 2), entries=torch.tensor([33, 5]).expand(L, H, 2),
                    swapped=torch.tensor([True, False]).expand(L, H, 2))
    out_k, out_v = torch.full((L, H, 2, D), 50.0), torch.full((L, H, 2, D), -1.0)
    store.swap(plan, out_k, out_v, torch.full((L, H, 2), 999))
    assert (store.keys[:, :, 33] == 50.0).all() and (store.positions[:, :, 33] == 999).all()
    assert not (store.keys[:, :, 5] == 50.0).any()  # not swapped: untouched
    mins, maxs = loop_digest(store.keys)
    assert torch.equal(store.mins, mins) and torch.equal(store.maxs, maxs)
    assert (store.maxs[:, :, 33 // PAGE] == 50.0).all()


@pytest.mark.parametrize("dtype", ["auto", "int8_values"])
def test_a_store_without_digests_holds_and_swaps_the_same_entries_in_fewer_bytes(dtype):
    """``recall_search`` exact keeps no page digests: after the same adds (pages dropped past the limit included)
    and the same swap, a store without them holds the same keys, values and positions as one with them, and fewer
    bytes by exactly the digests'; an exact search over either gives the same plan. Control: the digested store's
    bytes, which the comparison tells apart."""
    g = torch.Generator().manual_seed(5)
    both = []
    for digests in (True, False):
        first, more = store_of(40, 1), store_of(30, 2)
        store = RecallStore(first.keys, first.values, first.positions, dtype, digests=digests)
        store.add(more.keys, more.values, more.positions + 40, 64)
        plan = SwapPlan(slots=torch.tensor([3, 7]).expand(L, H, 2), entries=torch.tensor([33, 5]).expand(L, H, 2),
                        swapped=torch.tensor([True, False]).expand(L, H, 2))
        store.swap(plan, torch.full((L, H, 2, D), 5.0), torch.full((L, H, 2, D), -1.0), torch.full((L, H, 2), 999))
        both.append(store)
    digested, bare = both
    for name in ("keys", "values", "key_scales", "value_scales", "positions"):
        assert torch.equal(getattr(digested, name), getattr(bare, name)), name
    assert bare.mins.shape[2] == bare.maxs.shape[2] == 0 < digested.mins.shape[2]
    digest_bytes = 2 * digested.mins.numel() * digested.mins.element_size()
    assert bare.nbytes == digested.nbytes - digest_bytes and bare.nbytes != digested.nbytes
    q, kept = torch.randn(L, H * G, D, generator=g), torch.randn(L, H, 24, D, generator=g)
    eligible = torch.ones(L, H, 24, dtype=torch.bool)
    plans = [plan_swaps(q, s, kept, eligible, pages=2, per_head=False, margin=100.0, search="exact") for s in both]
    assert swap_set(plans[0]) == swap_set(plans[1]) != set()


def test_a_layer_view_swaps_that_layer_of_the_store_and_no_other():
    """``RecallStore.layer`` (``recall_at`` layer: one layer decides inside the forward): a swap through the view of
    layer 1 changes the whole store exactly as the same swap on the whole store restricted to layer 1 does, digests
    included. Control: the same swap on a copy of the layer (not a view) leaves the store as it was."""
    whole, viewed = store_of(40), store_of(40)
    plan = SwapPlan(slots=torch.tensor([3, 7]).expand(L, H, 2), entries=torch.tensor([33, 5]).expand(L, H, 2),
                    swapped=torch.tensor([[True, False], [True, True]]).expand(L, H, 2))
    only = torch.zeros(L, H, 2, dtype=torch.bool)
    only[1] = plan.swapped[1]
    out_k, out_v, out_p = torch.full((L, H, 2, D), 50.0), torch.full((L, H, 2, D), -1.0), torch.full((L, H, 2), 999)
    whole.swap(SwapPlan(plan.slots, plan.entries, only), out_k, out_v, out_p)
    one = SwapPlan(plan.slots[1:2], plan.entries[1:2], plan.swapped[1:2])
    viewed.layer(1).swap(one, out_k[1:2], out_v[1:2], out_p[1:2])
    for name in ("keys", "values", "positions", "mins", "maxs"):
        assert torch.equal(getattr(viewed, name), getattr(whole, name)), name
    assert not torch.equal(whole.keys, store_of(40).keys)
    copied = store_of(40)
    alone = RecallStore(copied.keys[1:2].clone(), copied.values[1:2].clone(), copied.positions[1:2].clone())
    alone.swap(one, out_k[1:2], out_v[1:2], out_p[1:2])
    assert torch.equal(copied.keys, store_of(40).keys)  # control: a copy writes nowhere


def group_query(seed: int) -> torch.Tensor:
    """[L, H, G, D]: the same query for every query head of a KV head's group, so a key's logit is one number."""
    return torch.randn(L, H, 1, D, generator=torch.Generator().manual_seed(seed)).expand(L, H, G, D)


def aligned(q: torch.Tensor, scale: float) -> torch.Tensor:
    """A key [L, H, D] along each KV head's query."""
    return q[:, :, 0] * scale


def test_a_stored_key_the_query_wants_replaces_the_weakest_eligible_slot():
    """One stored key along the query (logit far above every kept key) is swapped for the weakest eligible kept
    slot; protected slots never give way, even when weaker; the same swap in every layer under per_head."""
    g = torch.Generator().manual_seed(3)
    q = group_query(3)
    store = store_of(40, 4)
    store.keys.mul_(0.01)
    store.keys[:, :, 21] = aligned(q, 10.0)
    store.mins, store.maxs = loop_digest(store.keys)
    N = 24
    kept = torch.randn(L, H, N, D, generator=g) * 0.1
    kept[:, :, 2] = -aligned(q, 5.0)   # the weakest of all, but protected
    kept[:, :, 9] = -aligned(q, 1.0)   # the weakest eligible
    eligible = torch.ones(L, H, N, dtype=torch.bool)
    eligible[:, :, 2] = False
    for per_head in (True, False):
        plan = plan_swaps(q.flatten(1, 2), store, kept, eligible, pages=1, per_head=per_head, margin=0.0)
        first = plan.swapped[..., 0]
        assert first.all()
        assert (plan.slots[..., 0] == 9).all() and (plan.entries[..., 0] == 21).all()
        assert not (plan.slots[plan.swapped] == 2).any()
        assert (plan.slots.unsqueeze(-1) != plan.slots.unsqueeze(-2)).sum() == L * H * (16 * 16 - 16)  # distinct
    plan = plan_swaps(q.flatten(1, 2), store, kept, eligible, pages=2, per_head=True, margin=0.0)
    assert torch.equal(plan.swapped, plan.swapped[:1].expand_as(plan.swapped))
    assert torch.equal(plan.slots, plan.slots[:1].expand_as(plan.slots))


def loop_span(plan: SwapPlan, positions: torch.Tensor, span: int) -> dict[tuple[int, int], list[int]]:
    """Per (layer, KV head), the store entries a span adds, as a loop: those not recalled already whose position
    follows a recalled one's by 1 .. span, in store order, as many as the row has eligible slots left."""
    assert plan.eligible is not None
    extra = {}
    for layer in range(positions.shape[0]):
        for h in range(positions.shape[1]):
            anchors = [int(e) for e, w in zip(plan.entries[layer, h], plan.swapped[layer, h]) if w]
            at = [int(positions[layer, h, a]) for a in anchors]
            want = [e for e in range(positions.shape[-1]) if e not in anchors
                    and any(0 < int(positions[layer, h, e]) - p <= span for p in at)]
            extra[layer, h] = want[:int(plan.eligible[layer, h].sum()) - len(anchors)]
    return extra


@pytest.mark.parametrize("seed", range(4))
def test_a_span_recalls_the_stored_positions_after_each_recalled_one(seed):
    """``recall_span``: with each token a decision recalls (position P), the stored tokens of positions P + 1 ..
    P + span come back too, into the next weakest eligible slots: positions the store does not hold are skipped,
    none is taken twice, a row with fewer eligible slots takes fewer, and the plan's own swaps and slots stay.
    Reference: :func:`loop_span`. Controls: span 0, and a plan that recalls nothing, give the plan back."""
    g = torch.Generator().manual_seed(seed)
    q = group_query(seed)
    store = store_of(40, seed)
    store.positions = torch.stack([torch.randperm(50, generator=g)[:40] for _ in range(L * H)]).view(L, H, 40)
    store.keys.mul_(0.01)
    for e in (21, 30):  # two tokens the query wants
        store.keys[:, :, e] = aligned(q, 10.0)
    store.positions[:, :, 30] = store.positions[:, :, 21] + 1  # one follows the other: not taken twice
    store.mins, store.maxs = loop_digest(store.keys)
    kept = torch.randn(L, H, 24, D, generator=g) * 0.1
    eligible = torch.ones(L, H, 24, dtype=torch.bool)
    eligible[0, 0, 4:] = False  # four eligible slots: two for the span
    plan = plan_swaps(q.flatten(1, 2), store, kept, eligible, pages=3, per_head=False, margin=0.0)
    assert plan.swapped.sum(dim=-1).min() >= 2
    wide = plan.spanned(store.positions, 3)
    extra = loop_span(plan, store.positions, 3)
    assert sum(map(len, extra.values())) > L * H  # the span adds more than one token a row
    assert len(extra[0, 0]) <= 2
    assert torch.equal(wide.slots, plan.slots) and torch.equal(wide.swapped & plan.swapped, plan.swapped)
    for (layer, h), want in extra.items():
        n = int(plan.swapped[layer, h].sum())
        assert wide.entries[layer, h, n: n + len(want)].tolist() == want
        assert int(wide.swapped[layer, h].sum()) == n + len(want)
        took = wide.entries[layer, h][wide.swapped[layer, h]].tolist()
        assert len(set(took)) == len(took)
    pages = (wide.entries // PAGE)[wide.swapped]  # the digests of every page swapped into are refreshed
    assert wide.pages is not None and set(pages.tolist()) <= set(wide.pages.flatten().tolist())
    assert plan.spanned(store.positions, 0) is plan
    none = SwapPlan(plan.slots, plan.entries, torch.zeros_like(plan.swapped), plan.pages, plan.eligible)
    assert none.spanned(store.positions, 3) is none


def test_nothing_swaps_when_the_store_scores_below_every_kept_token():
    """Control of the test above: the same store, scaled so that every stored logit is below every kept one."""
    q = group_query(5)
    store = store_of(40, 6)
    store.keys.copy_(-aligned(q, 3.0).unsqueeze(2).expand_as(store.keys))
    store.mins, store.maxs = loop_digest(store.keys)
    kept = aligned(q, 1.0).unsqueeze(2).expand(L, H, 24, D).clone()
    plan = plan_swaps(q.flatten(1, 2), store, kept, torch.ones(L, H, 24, dtype=torch.bool), pages=2, per_head=False,
                      margin=0.0)
    assert not plan.swapped.any()


@pytest.mark.parametrize("per_head", [True, False])
def test_a_stored_token_far_below_the_strongest_kept_one_stays_in_the_store(per_head):
    """``margin``: a stored token that beats the weakest eligible kept token, but whose logit scaled by 1/sqrt(d)
    is 3 nats below the strongest eligible kept token's, stays in the store at margins 0 and 2; the control, the
    same data at margin 4, swaps it in for the weakest."""
    q = group_query(7)
    store = store_of(40, 8)
    store.keys.mul_(0.01)
    store.keys[:, :, 21] = aligned(q, 1.0)
    store.mins, store.maxs = loop_digest(store.keys)
    g = torch.Generator().manual_seed(9)
    kept = torch.randn(L, H, 24, D, generator=g) * 0.01
    kept[:, :, 9] = -aligned(q, 1.0)  # the weakest
    norm = q[:, :, 0].square().sum(dim=-1, keepdim=True)
    kept[:, :, 4] = q[:, :, 0] * (1 + 3.0 * D ** 0.5 / norm)  # 3 nats above the stored token
    eligible = torch.ones(L, H, 24, dtype=torch.bool)
    swapped = {m: plan_swaps(q.flatten(1, 2), store, kept, eligible, pages=1, per_head=per_head, margin=m)
               for m in (0.0, 2.0, 4.0)}
    assert not swapped[0.0].swapped.any() and not swapped[2.0].swapped.any()
    plan = swapped[4.0]
    assert plan.swapped[..., 0].all() and not plan.swapped[..., 1:].any()
    assert (plan.slots[..., 0] == 9).all() and (plan.entries[..., 0] == 21).all()


@pytest.mark.parametrize("dtype, key_step, value_step, kv_bytes", [
    ("fp8", 1 / 8, 1 / 8, 2 * (D + 4)),            # e4m3: 3 mantissa bits, both as codes
    ("int8_values", 0, 1 / 254, 4 * D + D + 4),    # keys exact (float32 here), values within half an int8 step
])
def test_a_coded_store_gives_back_its_round_trip_in_fewer_bytes(dtype, key_step, value_step, kv_bytes):
    """``recall_dtype`` fp8 / int8_values: every entry reads back as its codecs' round trip of what went in (after
    an append and a swap), in the cache's dtype, each element within its codec's step of its vector's largest
    magnitude; the digests are those of the keys as read back, so Quest's bound holds for what a recall returns;
    K, V and their scales take the bytes the codecs promise per token. Control: each coded tensor's round trip is
    not the identity (a store that kept the original values would fail the first check)."""
    exact = store_of(40, 7)
    coded = RecallStore(exact.keys.clone(), exact.values.clone(), exact.positions.clone(), dtype)
    more = store_of(20, 8)
    more.positions += 40
    for store in (exact, coded):
        store.add(more.keys, more.values, more.positions, 1000)
    plan = SwapPlan(slots=torch.tensor([3, 7]).expand(L, H, 2), entries=torch.tensor([33, 5]).expand(L, H, 2),
                    swapped=torch.tensor([True, False]).expand(L, H, 2))
    out = torch.randn(L, H, 2, D, generator=torch.Generator().manual_seed(9))
    for store in (exact, coded):
        store.swap(plan, out * 3, out, torch.full((L, H, 2), 999))
    keys, values = coded.read(torch.arange(60).expand(L, H, 60))
    assert keys.dtype == values.dtype == torch.float32
    for got, original, codec, step in ((keys, exact.keys, CODECS[dtype][0], key_step),
                                       (values, exact.values, CODECS[dtype][1], value_step)):
        assert torch.equal(got, codec.round_trip(original))
        assert ((got - original).abs() <= step * original.abs().amax(dim=-1, keepdim=True) + 1e-7).all()
        assert torch.equal(got, original) == (codec.name == "exact")  # control
    mins, maxs = loop_digest(keys)
    assert torch.equal(coded.mins, mins) and torch.equal(coded.maxs, maxs)
    held = (coded.keys, coded.values, coded.key_scales, coded.value_scales)
    assert sum(t.numel() * t.element_size() for t in held) == L * H * 60 * kv_bytes
    assert coded.nbytes < exact.nbytes


def layer_case(seed: int, sizes: list[int], widths: list[int]):
    """B requests' stores of ``sizes`` entries and kept slots of ``widths`` (eligible at random), padded to the
    widest as a forward's batch pads them, with each request's query for one layer. The kept keys come from another
    stream than the stores' (from the same one, request 0's first kept key would equal its first stored key: a tie
    that float32 rounding breaks either way, batched or alone)."""
    g = torch.Generator().manual_seed(seed + 100)
    stores = [store_of(size, seed + i) for i, size in enumerate(sizes)]
    C = max(widths)
    kept = torch.randn(len(sizes), H, C, D, generator=g)
    eligible = torch.rand(len(sizes), H, C, generator=g) < 0.8
    for i, w in enumerate(widths):
        eligible[i, :, w:] = False
    return stores, kept, eligible, torch.randn(len(sizes), H * G, D, generator=g)


def disagreements(seed: int, sizes: list[int], widths: list[int], pages: int, margin: float,
                  search: str = "quest") -> list[str]:
    """Where one decision for the whole layer differs from :func:`plan_swaps` run for each request alone."""
    stores, kept, eligible, query = layer_case(seed, sizes, widths)
    layer = seed % L
    if search == "quest":
        digests = StackedDigests.of(stores)
        both = plan_layer_swaps(query, digests, stores, layer, kept, eligible, pages, margin)
        cuts = digests.cuts(pages, widths)
    else:
        both = plan_layer_exact(query, stores, layer, kept, eligible, pages, margin)
        cuts = exact_cuts(stores, pages, widths)
    wrong = []
    for i, (store, w, cut) in enumerate(zip(stores, widths, cuts)):
        plan = both.cut(i, *cut)
        alone = plan_swaps(query[i: i + 1], store.layer(layer), kept[i: i + 1, :, :w], eligible[i: i + 1, :, :w],
                           pages, False, margin, search)
        same = (plan.slots.shape == alone.slots.shape and torch.equal(plan.swapped, alone.swapped)
                and torch.equal(plan.slots[plan.swapped], alone.slots[alone.swapped])
                and torch.equal(plan.entries[plan.swapped], alone.entries[alone.swapped])
                and (search == "exact" or torch.equal(plan.pages, alone.pages)))
        if not same:
            wrong.append(f"request {i}")
    return wrong


@pytest.mark.parametrize("search", ["quest", "exact"])
@settings(max_examples=40, deadline=None)
@given(st.integers(0, 2 ** 16), st.lists(st.tuples(st.integers(1, 90), st.integers(1, 40)), min_size=1, max_size=4),
       st.integers(1, 4), st.sampled_from([0.0, 100.0]))
def test_one_decision_for_a_layer_of_requests_is_each_requests_own(search, seed, shapes, pages, margin):
    """``recall_at`` layer decides a layer for every request of the forward at once (stores of different sizes,
    fewer pages or entries than ``pages`` asks for included, kept slots of different widths): each request's plan
    is the one :func:`plan_swaps` makes for it alone, swap for swap (margin 100: many swaps to compare), under
    either ``recall_search``."""
    sizes, widths = [s for s, _ in shapes], [w for _, w in shapes]
    assert disagreements(seed, sizes, widths, pages, margin, search) == []


def test_a_layer_decision_that_scores_past_a_stores_pages_disagrees(monkeypatch):
    """Control of the test above: stacked bounds that leave the columns past a store's pages unmasked (they read
    another request's page) let those phantom pages crowd the store's own out of its ``pages`` best."""
    def unmasked(self, query, layer):
        every = quest_bound(query, self.mins[layer], self.maxs[layer]).amax(dim=2)
        return every.gather(-1, self.columns.unsqueeze(1).expand(-1, every.shape[1], -1))

    cases = [(seed, [20, 90, 40], [30, 12, 25]) for seed in range(10)]
    assert all(disagreements(*case, pages=4, margin=100.0) == [] for case in cases)
    monkeypatch.setattr(StackedDigests, "bounds", unmasked)
    assert any(disagreements(*case, pages=4, margin=100.0) for case in cases)


def test_an_exact_layer_decision_that_scores_past_a_stores_entries_disagrees(monkeypatch):
    """Control of the test above under ``recall_search`` exact: a batched search that leaves the padding past a
    smaller store's entries unmasked (zero keys, logit 0, above a small store's negative logits) takes entries
    the store does not have."""
    def unmasked(q, keys, sizes, count, per_head):
        return real(q, keys, keys.shape[2], count, per_head)

    real = recall._top_entries
    cases = [(seed, [3, 90, 5], [30, 12, 25]) for seed in range(10)]
    assert all(disagreements(*case, pages=4, margin=100.0, search="exact") == [] for case in cases)
    monkeypatch.setattr(recall, "_top_entries", unmasked)
    assert any(disagreements(*case, pages=4, margin=100.0, search="exact") for case in cases)


def swap_set(plan: SwapPlan) -> set[tuple[int, int, int, int]]:
    """(layer, KV head, slot, entry) of every swap."""
    at = plan.swapped.nonzero().tolist()
    return {(layer, h, int(plan.slots[layer, h, i]), int(plan.entries[layer, h, i])) for layer, h, i in at}


def search_case(seed: int, size: int, per_head: bool, margin: float, pages: int, search: str):
    """A plan over a random store whose strongest entries for the query lie on different pages, and the one that
    scores every page (quest over all of them): what an exact search of ``pages * PAGE`` entries must equal."""
    g = torch.Generator().manual_seed(seed + 7)
    store = store_of(size, seed)
    q = torch.randn(L, H * G, D, generator=g)
    N = 24
    kept, eligible = torch.randn(L, H, N, D, generator=g), torch.rand(L, H, N, generator=g) < 0.8
    every = plan_swaps(q, store, kept, eligible, pages=-(-size // PAGE), per_head=per_head, margin=margin)
    plan = plan_swaps(q, store, kept, eligible, pages=pages, per_head=per_head, margin=margin, search=search)
    width = plan.slots.shape[-1]
    assert width == min(N, pages * PAGE, size) or search == "quest"
    return swap_set(plan), swap_set(SwapPlan(every.slots[..., :width], every.entries[..., :width],
                                             every.swapped[..., :width]))


@pytest.mark.parametrize("per_head", [True, False])
@settings(max_examples=40, deadline=None)
@given(st.integers(0, 2 ** 16), st.integers(1, 120), st.integers(1, 3), st.sampled_from([0.0, 100.0]))
def test_an_exact_search_swaps_what_scoring_every_page_swaps(per_head, seed, size, pages, margin):
    """``recall_search`` exact: its candidates are the ``pages * PAGE`` stored entries with the highest logit of
    all, so its swaps are those of a decision that scores every page, cut to as many candidates, whichever
    pages the entries lie on."""
    got, want = search_case(seed, size, per_head, margin, pages, "exact")
    assert got == want


def test_a_page_search_misses_entries_an_exact_search_finds():
    """Control of the test above: the quest search with as many candidates (its ``pages`` best pages by bound)
    differs from scoring every page on random stores; the comparison catches a search that is not exhaustive."""
    cases = [(seed, 96, False, 100.0, 1) for seed in range(10)]
    assert all(operator.eq(*search_case(*case, "exact")) for case in cases)
    assert any(operator.ne(*search_case(*case, "quest")) for case in cases)
