"""Correct answers per minute at a fixed pool: what a user of a memory-bound server buys.

The reasoning task's problems (``kvcompact.tools.evaluation``, report seed), ``--problems`` of them in flight at once,
in a KV pool that holds ``--pool-requests`` full-length requests (prompt + ``--max-tokens``), prefix caching on
(vLLM's default) in every engine. Cells, read as an ablation (stock -> + admission -> + compression):
- ``stock``: vLLM with kvcompact installed and not configured (greedy admission, preemption by recompute), its
  own engine;
- ``admission``: kvcompact configured (guaranteed admission), every request ``{"kvcompact": "off"}``: full
  attention, no eviction;
- one cell per (policy, budget) of ``--policies`` x ``--budgets``.
Each cell runs the same problems alone on an engine (one engine for stock, one per policy; ``admission`` rides in
the first policy's), after a warm-up request and with the prefix cache emptied, so no cell reuses another's
prefill. ``--reps`` > 1 runs every engine again, in the reverse order every other repetition. Per cell: wall time,
generated tokens/s, correct answers per minute, preemptions, peak concurrency, and the accuracy of that very run
with its Wilson interval and the paired difference to stock on the same problems. Speed ratios are ``x_stock``
(and ``x_admission``): the median and range over repetitions of the per-repetition ratio. The plot is the Pareto
front: accuracy (y, 95% CI) against correct answers per minute (x), one line per policy, stock and admission as
points.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from kvcompact.tools import evaluation as ev
from kvcompact.tools.bench import FIXED_ROUNDS, paired_ratio, times
from kvcompact.tools.local_engine import drive, forget_prefixes, scheduler, warm_up


@dataclass
class PoolRun:
    """What a fixed-pool benchmark on the reasoning task runs with (``bench/answers.py``, ``bench/pressure.py``,
    ``bench/speculative.py``): the model and its statistics, the problems as prompt ids, and a pool of
    ``--pool-requests`` full-length requests (the longest prompt + ``--max-tokens``) plus vLLM's null block."""

    model: str
    stats: str | None
    tok: Any
    seed: int
    task: ev.Task
    ids: dict[str, list[int]]
    max_tokens: int
    block: int
    max_len: int
    pool: int

    def on(self, task: ev.Task, pool_requests: int) -> PoolRun:
        """This run on ``task``: its prompts as ids, and a pool of ``pool_requests`` full-length requests (the
        longest prompt + ``max_tokens``) plus vLLM's reserved null block."""
        ids = {i.id: ev.prompt_ids(self.tok, i) for i in task.items}
        blocks = math.ceil((max(len(v) for v in ids.values()) + self.max_tokens) / self.block)
        return replace(self, task=task, ids=ids, max_len=blocks * self.block, pool=pool_requests * blocks + 1)

    def engine(self, ctx: Any, kvcompact: dict[str, Any] | None, max_num_seqs: int, **extra: Any) -> Any:
        """An engine on this pool (``kvcompact`` None: stock vLLM). Every engine of a fixed-pool benchmark comes
        from here, so stock vLLM and the kvcompact cells get the same pool, lengths, dtype and prefix caching (on,
        vLLM's default; cells sharing an engine empty it between them, ``forget_prefixes``)."""
        return ctx.engine(kvcompact, model=self.model, block_size=self.block, num_blocks=self.pool,
                          max_model_len=self.max_len, max_num_seqs=max_num_seqs, enable_prefix_caching=True, **extra)

    def setup(self, a: Any, ctx: Any) -> dict[str, Any]:
        return {"model": self.model, "stats": self.stats, "seed": self.seed, "problems": len(self.task.items),
                "max_tokens": self.max_tokens, "pool_blocks": self.pool, "block_size": self.block,
                "pool_requests": a.pool_requests, "window": a.window, "divide_length": a.divide_length,
                "n_sink": a.n_sink, "dtype": ctx.engine_dtype, "admission": "guaranteed", "prefix_caching": True}


def add_pool_arguments(p: Any) -> None:
    """The options every fixed-pool reasoning benchmark shares."""
    p.add_argument("--model", default=None, help="a known model name or a model folder (default: bundled)")
    p.add_argument("--stats", default=None, help="TriAttention statistics (default: those `prepare` made)")
    p.add_argument("--problems", type=int, default=None, help="reasoning problems (default 32, quick 4)")
    p.add_argument("--max-tokens", type=int, default=None, help="completion cap (default 1024, quick 96)")
    p.add_argument("--pool-requests", type=int, default=2, help="full-length requests the pool holds (default 2)")
    p.add_argument("--window", type=int, default=32, help="recent window (default 32)")
    p.add_argument("--divide-length", type=int, default=64, help="tokens between rounds (default 64)")
    p.add_argument("--n-sink", type=int, default=4, help="first tokens never evicted (default 4)")
    p.add_argument("--explore", action="store_true", help=f"exploration seed {ev.EXPLORE_SEED}")


def pool_run(ctx: Any) -> PoolRun:
    from transformers import AutoTokenizer

    a = ctx.args
    model, stats = ctx.model_and_stats(a.model, a.stats)
    tok = AutoTokenizer.from_pretrained(model)
    seed = ev.EXPLORE_SEED if a.explore else ev.REPORT_SEED
    max_tokens = a.max_tokens or (96 if ctx.quick else 1024)
    task = ev.reasoning_task(a.problems or (4 if ctx.quick else 32), seed, max_tokens)
    return PoolRun(model, stats, tok, seed, task, {}, max_tokens, 32, 0, 0).on(task, a.pool_requests)


def add_arguments(p: Any) -> None:
    add_pool_arguments(p)
    p.add_argument("--policies", default=None, help="comma list (default triattention,streaming,knorm)")
    p.add_argument("--budgets", default=None, help="comma list (default 64,128,256,512; quick 64)")
    p.add_argument("--selection", choices=("per_head", "per_layer_per_head"), default="per_head")
    p.add_argument("--reps", type=int, default=1, help="repetitions, order alternating (default 1)")


def run(ctx: Any) -> dict[str, Any]:
    a = ctx.args
    r = pool_run(ctx)
    stats, tok, task, ids = r.stats, r.tok, r.task, r.ids
    policies = (a.policies or ("streaming" if ctx.quick else "triattention,streaming,knorm")).split(",")
    if "triattention" in policies and stats is None:
        policies.remove("triattention")
        ctx.notes.append("triattention skipped: no statistics for this model")
    budgets = [int(b) for b in (a.budgets or ("64" if ctx.quick else "64,128,256,512")).split(",")]
    setup = {**r.setup(a, ctx), "policies": policies, "budgets": budgets, "selection": a.selection, "reps": a.reps}
    # (cell, engine: None for stock vLLM, else the policy its kvcompact engine runs, per-request extra args)
    cells: list[tuple[str, str | None, dict[str, Any]]] = [("stock", None, {}),
                                                           ("admission", policies[0], {"kvcompact": "off"})]
    cells += [(f"{p}@{b}", p, {"kvcompact_budget": b}) for p in policies for b in budgets]
    runs: dict[str, list[dict[str, Any]]] = {c: [] for c, _, _ in cells}
    first = ids[task.items[0].id]
    for rep in range(a.reps):
        order = cells if rep % 2 == 0 else cells[::-1]
        for engine in dict.fromkeys(p for _, p, _ in order):  # one engine each, in this rep's order
            cfg = None if engine is None else _config(a, engine, max(budgets), stats)
            mine = [(c, x) for c, p, x in order if p == engine]
            with r.engine(ctx, cfg, len(task.items)) as llm:
                warm_up(llm, first)
                for cell, xargs in mine:
                    forget_prefixes(llm)
                    runs[cell].append(_one(ctx, llm, tok, task, ids, cell, xargs))
                    ctx.log(f"rep {rep}: {_line(cell, runs[cell][-1])}")
            ctx.checkpoint({"setup": setup, "runs": runs})
    out = {"setup": setup, "cells": {c: _combine(task, runs[c], runs["stock"], runs["admission"]) for c in runs}}
    out["headline"] = {c: {k: v[k] for k in ("accuracy", "ci95", "answers_per_min", "answers_per_min_x_stock",
                                             "tokens_per_s_x_stock", "answers_per_min_x_admission", "preemptions",
                                             "peak_running")}
                       for c, v in out["cells"].items()}
    for c, v in out["cells"].items():
        ctx.log(f"{c:20s} {times(v['answers_per_min_x_stock'])} stock correct answers/min, "
                f"{times(v['tokens_per_s_x_stock'])} stock tokens/s, {times(v['tokens_per_s_x_admission'])} "
                "admission tokens/s")
    _plot(ctx, out)
    return out


def _config(a: Any, policy: str, budget: int, stats: str | None) -> dict[str, Any]:
    cfg = {**FIXED_ROUNDS, "policy": policy, "budget": budget, "divide_length": a.divide_length, "window": a.window,
           "n_sink": a.n_sink, "selection": a.selection, "compaction": "repack", "admission": "guaranteed"}
    if policy == "triattention":
        cfg["stats_path"] = stats
    return cfg


def _one(ctx: Any, llm: Any, tok: Any, task: ev.Task, ids: dict[str, list[int]], cell: str,
         xargs: dict[str, Any]) -> dict[str, Any]:
    from vllm import SamplingParams

    sched = scheduler(llm)
    peak = [0]

    def on_step(_i: int, _dt: float) -> None:
        peak[0] = max(peak[0], len(sched.running))

    requests = [(f"i{n}", ids[item.id], SamplingParams(temperature=0, max_tokens=item.max_tokens,
                                                       extra_args=dict(xargs) or None))
                for n, item in enumerate(task.items)]
    res = drive(llm, requests, on_step=on_step, desc=cell)
    tokens = {item.id: res["tokens"].get(f"i{n}", []) for n, item in enumerate(task.items)}
    texts = {k: tok.decode(v, skip_special_tokens=True) for k, v in tokens.items()}
    correct = {item.id: task.grade(item, texts[item.id])[0] for item in task.items}
    generated = sum(len(v) for v in tokens.values())
    return {"wall_s": res["wall_s"], "generated": generated, "preemptions": res["preemptions"],
            "peak_running": peak[0], "correct_by_item": correct, "tokens": tokens, "texts": texts}


def _per_min(r: dict[str, Any]) -> float:
    return sum(r["correct_by_item"].values()) / (r["wall_s"] / 60)


def _combine(task: ev.Task, runs: list[dict[str, Any]], stock: list[dict[str, Any]],
             admission: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians over repetitions for speed, and its ratios to stock vLLM (and to admission) in the same repetition;
    accuracy of the first repetition (greedy: the same answers each time unless batching changes the arithmetic,
    which the agreement between repetitions shows), paired with stock vLLM's on the same problems."""
    import statistics

    first = runs[0]
    summary = ev.summarize(task, "", first["texts"], first["tokens"], {}, {
        i.id: (stock[0]["correct_by_item"][i.id], task.grade(i, stock[0]["texts"][i.id])[1]) for i in task.items})
    tok_s = lambda rs: [r["generated"] / r["wall_s"] for r in rs]  # noqa: E731
    return {
        "accuracy": summary["accuracy"], "ci95": summary["ci95"], "correct": summary["correct"], "n": summary["n"],
        "paired_vs_stock": summary["paired"], "mean_tokens": summary["mean_tokens"],
        "p95_tokens": summary["p95_tokens"], "looping": summary["looping"], "at_cap": summary["at_cap"],
        "wall_s": statistics.median(r["wall_s"] for r in runs), "wall_s_reps": [r["wall_s"] for r in runs],
        "tokens_per_s": statistics.median(tok_s(runs)),
        "tokens_per_s_x_stock": paired_ratio(tok_s(runs), tok_s(stock)),
        "tokens_per_s_x_admission": paired_ratio(tok_s(runs), tok_s(admission)),
        "answers_per_min": statistics.median(_per_min(r) for r in runs),
        "answers_per_min_x_stock": paired_ratio(map(_per_min, runs), map(_per_min, stock)),
        "answers_per_min_x_admission": paired_ratio(map(_per_min, runs), map(_per_min, admission)),
        "preemptions": max(r["preemptions"] for r in runs),
        "peak_running": max(r["peak_running"] for r in runs),
        "reps_same_answers": all(r["correct_by_item"] == first["correct_by_item"] for r in runs),
    }


def _line(cell: str, r: dict[str, Any]) -> str:
    k = sum(r["correct_by_item"].values())
    return (f"{cell:20s} {k:3d}/{len(r['correct_by_item'])} correct in {r['wall_s']:.0f} s "
            f"({k / (r['wall_s'] / 60):.2f}/min), {r['generated'] / r['wall_s']:.1f} tok/s, "
            f"{r['preemptions']} preemptions, peak {r['peak_running']} running")


def _plot(ctx: Any, out: dict[str, Any]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.4))
    for cell, marker, color, label in (("stock", "*", "k", "stock vLLM"),
                                       ("admission", "D", "tab:gray", "+ admission (full attention)")):
        v = out["cells"][cell]
        ax.errorbar([v["answers_per_min"]], [v["accuracy"]],
                    yerr=[[v["accuracy"] - v["ci95"][0]], [v["ci95"][1] - v["accuracy"]]],
                    marker=marker, ms=12 if cell == "stock" else 7, color=color, capsize=3, label=label)
    for policy in out["setup"]["policies"]:
        pts = [(int(c.rsplit("@", 1)[1]), v) for c, v in out["cells"].items() if c.startswith(policy + "@")]
        pts.sort(key=lambda x: x[0])
        xs = [v["answers_per_min"] for _, v in pts]
        ys = [v["accuracy"] for _, v in pts]
        err = [[max(0.0, v["accuracy"] - v["ci95"][0]) for _, v in pts],
               [max(0.0, v["ci95"][1] - v["accuracy"]) for _, v in pts]]
        ax.errorbar(xs, ys, yerr=err, marker="o", capsize=3, label=f"+ compression: {policy}")
        for (b, _), x, y in zip(pts, xs, ys):
            ax.annotate(str(b), (x, y), textcoords="offset points", xytext=(4, 4), fontsize=7)
    s = out["setup"]
    ax.set_xlabel("correct answers per minute")
    ax.set_ylabel("accuracy (95% Wilson CI)")
    ax.set_title(f"{Path(s['model']).name}: {s['problems']} problems in flight, pool of {s['pool_requests']} "
                 f"full requests ({s['pool_blocks']} blocks)", fontsize=8)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    ctx.savefig(fig)
