"""What the attention-based policies need from inside vLLM's forward pass, captured on the worker.

SnapKV and R-KV (``needs_queries``) score with the last ``config.query_window`` post-RoPE queries of every layer;
H2O (``needs_attn_accum``) with the softmax attention of every decode step, accumulated per cached slot. vLLM's
kernels never hand either out, so this module hooks the attention backend of every layer of the worker's model:
the backend's ``impl.forward(layer, query, key, value, kv_cache, attn_metadata, ...)`` sees the query exactly as
the kernel does (post-RoPE, before the softmax scale) and, on every vLLM backend, runs after this step's keys
were written into the paged cache. The hook is installed on the impl *instances* of one engine, and only when
the policy asks for it, so streaming / knorm / random / triattention engines run vLLM's forward untouched.

Semantics (identical to the transformers reference, :mod:`kvcompact.reference`; both engines keep this state in
:mod:`kvcompact.attention_state`'s ``QueryRing`` and ``AttentionSums``):

* **Query window.** Per request, a ring of the query rows the model computed, prefill rows included, per layer
  (``[L, w + s, H_q, d]``), indexed by logical position. At a round (which runs before the step's forward) the
  ring holds the queries of logical positions ``t - w .. t - 1``, which is where SnapKV's causal window mask
  puts them. ``s`` is the number of speculative tokens: the rows of drafts the target then rejects sit at
  positions ``>= t`` and, with the ``s`` extra slots, never overwrite a position the window still reads.
* **Attention accumulator** ``[L, H_kv, cache_len]`` per request. Every forward appends zeros for the new
  slots; a *decode* row (a row at a logical position past the tokens its cache was prefilled with: the step's
  one row, or under speculative decoding the sampled token's row and its drafts') adds
  ``softmax(q K^T / sqrt(d))`` over the request's cached slots up to its own, summed over the query heads of each
  GQA group, with :func:`kvcompact.policies.h2o.accumulate_attention`. A step's decode rows are held apart and
  added once the next step (or a round) shows how many of them the target accepted (:meth:`_settle`): a
  rejected draft's attention never counts, and its slots leave the accumulator as they leave the cache.
  Prompt rows (prefill, chunked or not, and the re-prefill after a preemption) are not accumulated. The keys
  are gathered from the paged cache through the KV layout adapter, one indexed read per layer per step: this
  extra attention computation is the eager-fallback cost H2O's ``needs_attention`` label warns about (:attr:`seconds`).
* **Moves and resets.** A round moves the accumulator with the same plan as the cache (:meth:`apply_plan`). A
  request whose rows in a step start at cache slot 0 is a new cache (first prefill, or the re-prefill after a
  preemption): its ring and accumulator start over. Finished requests are dropped.

Row -> request mapping: the runner's persistent batch order (``input_batch.req_ids``) with the step's
``num_scheduled_tokens``, i.e. the same ``query_start_loc`` the kernel uses.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from kvcompact.attention_state import AttentionSums, QueryRing
from kvcompact.moves import MovePlan
from kvcompact.policies.h2o import accumulate_attention
from kvcompact.vllm.kv_layout import phys_slots
from kvcompact.vllm.paged_kv import PagedKV

logger = logging.getLogger("vllm.kvcompact")  # formatted and levelled by vLLM's own logging


@dataclass
class _Step:
    """Row bookkeeping of one forward pass, built once after vLLM prepared the step's inputs."""

    num_tokens: int
    # query window: rows to copy, and where (request ring, ring slot)
    q_rows: torch.Tensor | None = None      # [M] int64 row indices into the step's query
    q_reqs: list[str] | None = None         # request of each segment
    q_segments: list[tuple[int, int, torch.Tensor]] | None = None  # (start, stop) into q_rows, ring slots
    # decode rows for H2O: R_b consecutive rows per decode request b, the first at cache slot start_b
    d_reqs: list[str] | None = None
    d_rows: torch.Tensor | None = None      # [D] int64, D = sum R_b, grouped by request
    d_spans: list[tuple[int, int, int, int]] | None = None  # per request: (first row, R_b, start_b, certain rows)
    d_phys: torch.Tensor | None = None      # [sum (start_b + R_b)] physical slots of their cached tokens
    d_pad_index: torch.Tensor | None = None  # [D, N_max] index into d_phys (0 where invalid)
    d_valid: torch.Tensor | None = None     # [D, N_max] bool: slots up to the row's own


class AttentionCapture:
    """Per-request query windows and/or H2O attention accumulators of one worker (its layers and heads)."""

    def __init__(self, *, kv: PagedKV, num_layers: int, num_q_heads: int, query_window: int, queries: bool,
                 attn_accum: bool, spec_tokens: int = 0) -> None:
        self.kv = kv
        self.runner = kv.runner
        self.layout = kv.layout
        self.device = kv.caches[0].device
        self.num_layers = num_layers
        self.num_q_heads = num_q_heads
        self.w = query_window
        self.ring_size = query_window + spec_tokens
        self.want_queries = queries
        self.want_accum = attn_accum
        self.rings: dict[str, QueryRing] = {}          # the last w + s query rows, by logical position
        self.accum: dict[str, AttentionSums] = {}      # H2O's attention per cached slot
        self.drafts: dict[str, tuple[int, int]] = {}   # cache slots [a, b) of the last step's draft rows
        self.pending: dict[str, torch.Tensor] = {}     # their attention [L, H_kv, b - a, b] (decode rows only)
        self.prefill_end: dict[str, int] = {}          # logical length the current cache was prefilled to
        self.broken: dict[str, str] = {}               # request -> why its state cannot be trusted
        self._step: _Step | None = None
        self.seconds = 0.0                             # time spent inside the hook (the eager-fallback cost)
        self.decode_rows = 0                           # decode rows whose attention was accumulated

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
            out = original(layer, query, key, value, kv_cache, attn_metadata, *args, **kwargs)
            if attn_metadata is not None and self._step is not None:
                self._on_layer(index, query)
            return out

        forward._kvcompact_capture = self  # type: ignore[attr-defined]
        forward._kvcompact_original = original  # type: ignore[attr-defined]
        return forward

    # ------------------------------------------------------------------ per step
    def begin_step(self, finished: Iterable[str]) -> None:
        """Start of a worker step (before any round): forget finished requests and the previous forward."""
        self._step = None
        for req_id in finished:
            self.drop(req_id)

    def drop(self, req_id: str) -> None:
        for d in (self.rings, self.accum, self.drafts, self.pending, self.prefill_end, self.broken):
            d.pop(req_id, None)

    def begin_forward(self, num_scheduled_tokens: np.ndarray, evicted: dict[str, int]) -> None:
        """After vLLM prepared the step's inputs: map query rows to requests and cache slots."""
        runner = self.runner
        n = runner.input_batch.num_reqs
        req_ids = list(runner.input_batch.req_ids[:n])
        live = set(runner.requests)
        for req_id in [r for r in set(self.rings) | set(self.accum) if r not in live]:
            self.drop(req_id)
        counts = np.asarray(num_scheduled_tokens[:n], dtype=np.int64)
        starts = np.concatenate([[0], np.cumsum(counts)])
        computed = np.asarray(runner.input_batch.num_computed_tokens_cpu[:n], dtype=np.int64)
        step = _Step(num_tokens=int(starts[-1]))
        q_rows: list[int] = []
        q_segments: list[tuple[int, int, torch.Tensor]] = []
        q_reqs: list[str] = []
        d_reqs: list[str] = []
        d_rows: list[int] = []
        d_spans: list[tuple[int, int, int, int]] = []
        d_phys: list[torch.Tensor] = []
        for b, req_id in enumerate(req_ids):
            k = int(counts[b])
            if k == 0:
                continue
            logical = int(computed[b])
            cache_start = logical - evicted.get(req_id, 0)
            if cache_start == 0:  # a new cache: first prefill, or the re-prefill after a preemption
                self.drop(req_id)
            if self.want_queries:
                ring = self.rings.get(req_id)
                if ring is None:
                    ring = self.rings[req_id] = QueryRing(self.num_layers, self.w, self.ring_size - self.w)
                take, slots = ring.advance(logical, k)
                q_segments.append((len(q_rows), len(q_rows) + take, slots))
                q_rows.extend(range(int(starts[b]) + k - take, int(starts[b]) + k))
                q_reqs.append(req_id)
            if self.want_accum:
                self._settle(req_id, cache_start)
                sums = self.accum.get(req_id)
                if sums is None:
                    sums = self.accum[req_id] = AttentionSums(self.num_layers, self.layout.num_kv_heads, self.device)
                if sums.length != cache_start and req_id not in self.broken:
                    self.broken[req_id] = (f"attention accumulator holds {sums.length} slots, the cache "
                                           f"{cache_start} (request seen mid-way)")
                sums.grow(cache_start + k)
                # Rows past the request's known tokens are speculative drafts the target may reject.
                certain = min(k, runner.requests[req_id].num_tokens - logical)
                if certain < k:
                    self.drafts[req_id] = (cache_start + certain, cache_start + k)
                if cache_start == 0:  # the tokens this cache is prefilled with: prompt (+ outputs, resumed)
                    self.prefill_end[req_id] = runner.requests[req_id].num_tokens
                prefill_end = self.prefill_end.get(req_id, runner.requests[req_id].num_prompt_tokens)
                if logical >= prefill_end:
                    block_ids = torch.as_tensor(runner.requests[req_id].block_ids[0], dtype=torch.int64)
                    d_reqs.append(req_id)
                    d_spans.append((len(d_rows), k, cache_start, certain))
                    d_rows.extend(range(int(starts[b]), int(starts[b]) + k))
                    d_phys.append(phys_slots(block_ids, torch.arange(cache_start + k), self.layout.block_size))
                    if certain < k:
                        self.pending[req_id] = torch.zeros(self.num_layers, self.layout.num_kv_heads, k - certain,
                                                           cache_start + k, dtype=torch.float32, device=self.device)
        if q_reqs:
            step.q_rows = torch.tensor(q_rows, dtype=torch.int64)
            step.q_reqs = q_reqs
            step.q_segments = q_segments
        if d_reqs:
            step.d_reqs, step.d_rows, step.d_spans = d_reqs, torch.tensor(d_rows, dtype=torch.int64), d_spans
            step.d_phys = torch.cat(d_phys)
            # row i of a request whose rows start at cache slot c attends to slots 0 .. c + i
            lengths = torch.tensor([c + i + 1 for _, r, c, _ in d_spans for i in range(r)], dtype=torch.int64)
            offsets = np.concatenate([[0], np.cumsum([c + r for _, r, c, _ in d_spans])[:-1]])
            row_offsets = torch.tensor(np.repeat(offsets, [r for _, r, _, _ in d_spans]), dtype=torch.int64)
            ar = torch.arange(int(lengths.max()), dtype=torch.int64)
            step.d_valid = ar[None, :] < lengths[:, None]
            step.d_pad_index = torch.where(step.d_valid, row_offsets[:, None] + ar[None, :], 0)
            self.decode_rows += len(d_rows)
        self._step = step if (q_reqs or d_reqs) else None

    def _settle(self, req_id: str, cache_len: int) -> None:
        """The request's cache now holds ``cache_len`` slots: add the attention of the last step's draft rows the
        target accepted (those below ``cache_len``) and drop the slots of the rejected ones, as vLLM rolls back
        its ``num_computed_tokens``. A length no rejection explains is left for the callers to flag."""
        first, end = self.drafts.pop(req_id, (0, 0))
        sums = self.accum.get(req_id)
        if sums is not None and first <= cache_len < end and sums.length == end:
            sums.truncate(cache_len)
        rows = self.pending.pop(req_id, None)  # row j sits at cache slot first + j
        accepted = min(max(cache_len - first, 0), end - first)
        if sums is not None and rows is not None and accepted:
            sums.values()[:, :, : first + accepted] += rows[:, :, :accepted, : first + accepted].sum(2)

    # ------------------------------------------------------------------ inside the forward pass
    def _on_layer(self, index: int, query: torch.Tensor) -> None:
        step = self._step
        assert step is not None
        if query.shape[0] < step.num_tokens:
            raise RuntimeError(f"kvcompact: layer {index} saw {query.shape[0]} query rows, the step scheduled "
                               f"{step.num_tokens}")
        start = time.perf_counter()
        q = query.view(query.shape[0], self.num_q_heads, -1)
        if step.q_rows is not None:
            assert step.q_reqs is not None and step.q_segments is not None  # set together with q_rows
            rows = q.index_select(0, step.q_rows.to(q.device)).float()  # [M, H_q, d]
            for req_id, (a, b, slots) in zip(step.q_reqs, step.q_segments):
                self.rings[req_id].write(index, slots, rows[a:b])
        if step.d_rows is not None:
            self._accumulate(index, q, step)
        self.seconds += time.perf_counter() - start

    def _accumulate(self, index: int, q: torch.Tensor, step: _Step) -> None:
        assert (step.d_reqs is not None and step.d_rows is not None and step.d_spans is not None
                and step.d_phys is not None and step.d_pad_index is not None and step.d_valid is not None)
        kv = self.runner.kv_caches[index]
        H = self.layout.num_kv_heads
        dev = kv.device
        flat = self.kv.key_reader(index, self.layout.gather_keys(kv, step.d_phys.to(dev).expand(H, -1)))  # [H,S,d]
        keys = flat[:, step.d_pad_index.to(dev)]                 # [H, D, N_max, d]
        keys = keys.permute(1, 0, 2, 3).unsqueeze(1)             # [D, 1, H, N_max, d]
        qd = q.index_select(0, step.d_rows.to(q.device)).float().to(dev)  # [D, H_q, d]
        qd = qd[:, None, :, None, :]                             # [D, 1, H_q, 1, d]
        D, n_max = step.d_valid.shape
        valid = step.d_valid.to(dev)[:, None, None, :].expand(D, 1, H, n_max)
        acc = accumulate_attention(torch.zeros(D, 1, H, n_max, dtype=torch.float32, device=dev), qd, keys, valid)
        for req_id, (row, count, start, certain) in zip(step.d_reqs, step.d_spans):
            n = start + count
            rows = acc[row: row + count, 0, :, :n]               # [R, H, n]
            if certain:
                self.accum[req_id].values()[index, :, :n] += rows[:certain].sum(0)
            if certain < count:  # drafts: held until the target's verdict (_settle)
                self.pending[req_id][index] = rows[certain:].transpose(0, 1)

    # ------------------------------------------------------------------ what a round reads and moves
    def queries_for(self, req_ids: list[str], ends: list[int]) -> torch.Tensor:
        """[B, L, H_q, w, d]: the queries of logical positions ``ends[b] - w .. ends[b] - 1``, oldest first."""
        out = []
        for req_id, end in zip(req_ids, ends):
            ring = self.rings.get(req_id)
            try:
                if ring is None:
                    raise RuntimeError(f"0 captured query rows, the window needs {self.w}")
                out.append(ring.window_at(end).cpu())  # [L, H_q, w, d]
            except RuntimeError as e:
                raise RuntimeError(f"request {req_id}: {e}") from None
        return torch.stack(out)

    def accum_for(self, req_ids: list[str], lengths: list[int], n_max: int) -> torch.Tensor:
        """[B, L, H_kv, n_max]: each request's accumulator over its ``lengths[b]`` cached slots (0 padding)."""
        out = torch.zeros(len(req_ids), self.num_layers, self.layout.num_kv_heads, n_max, dtype=torch.float32)
        for b, (req_id, n) in enumerate(zip(req_ids, lengths)):
            self._settle(req_id, n)
            if req_id in self.broken:
                raise RuntimeError(f"request {req_id}: {self.broken[req_id]}")
            sums = self.accum.get(req_id)
            have = 0 if sums is None else sums.length
            if sums is None or have != n:
                raise RuntimeError(f"request {req_id}: attention accumulator holds {have} slots, the cache {n}")
            out[b, :, :, :n] = sums.values().cpu()
        return out

    def apply_plan(self, req_id: str, plan: MovePlan, old_len: int) -> None:
        """Move the accumulator with the round's plan (slots 0..new_len-1 hold what the cache holds)."""
        self._settle(req_id, old_len)
        sums = self.accum.get(req_id)
        if sums is not None and sums.length == old_len:
            sums.move(plan)


def attention_layers(runner: Any) -> list[tuple[int, Any]]:
    """``(local layer index, attention layer)`` in the order of ``runner.kv_caches`` (vLLM's ``bind_kv_cache``
    sorts by the layer index in the name)."""
    from vllm.model_executor.models.utils import extract_layer_index

    names = list(runner.kv_cache_config.kv_cache_groups[0].layer_names)
    names.sort(key=extract_layer_index)
    context = runner.compilation_config.static_forward_context
    return [(i, context[name]) for i, name in enumerate(names)]


def make_capture(policy: Any, config: Any, kv: PagedKV, num_q_heads: int) -> AttentionCapture | None:
    """The capture the policy asks for, installed on the runner's attention layers, or None (no hook at all)."""
    queries = bool(getattr(policy, "needs_queries", False))
    accum = bool(getattr(policy, "needs_attn_accum", False))
    if not (queries or accum):
        return None
    runner = kv.runner
    layers = attention_layers(runner)
    if len(layers) != len(runner.kv_caches):
        raise RuntimeError(f"kvcompact: found {len(layers)} attention layers for {len(runner.kv_caches)} KV "
                           "caches; cannot map queries to layers")
    capture = AttentionCapture(kv=kv, num_layers=len(layers), num_q_heads=num_q_heads,
                               query_window=config.query_window, queries=queries, attn_accum=accum,
                               spec_tokens=runner.vllm_config.num_speculative_tokens)
    n = capture.install(layers)
    logger.warning("kvcompact: policy %s captures %s in %d attention layers (extra work every step)",
                   policy.name, " and ".join(x for x, on in (("query windows", queries),
                                                            ("decode attention", accum)) if on), n)
    return capture


__all__ = ["AttentionCapture", "make_capture", "attention_layers"]
