"""Speculative decoding x {stock vLLM, kvcompact} at a fixed pool.

The reasoning task's problems (``kvcompact.tools.evaluation``, report seed), all in flight, in a KV pool that holds
``--pool-requests`` full-length requests, greedy, prefix caching on (vLLM's default) in every engine. The
speculative config is engine-wide, so every (speculation, attention) pair below has its own engine:
speculation ``none`` and ``ngram`` (prompt lookup, ``--spec-tokens`` drafts per step), each with
- ``stock``: vLLM with kvcompact installed and not configured (greedy admission, preemption by recompute);
- a kvcompact engine (guaranteed admission) that runs ``admission`` (every request ``{"kvcompact": "off"}``: full
  attention, no eviction) and the compressed cell (``--policy`` at ``--budget``), one after the other with the
  prefix cache emptied between them.
Draft-model speculation is refused with compression (``kvcompact.vllm.startup.check_speculative``):
``--draft-model`` adds ``stock`` with that draft model, to show what an operator gives up by choosing compression.
The engines run in an interleaved order (stock, kvcompact, kvcompact, stock, ...), each after a warm-up request.
Per cell: accuracy with its Wilson interval and the paired difference to stock with the same speculation,
correct answers per minute, tokens/s, preemptions, kvcompact rounds (0 on stock vLLM), and vLLM's own acceptance
counters (drafts, draft tokens, accepted tokens) for the cell: acceptance rate = accepted / draft tokens, mean
acceptance length = 1 + accepted / drafts. Speed ratios: ``x_stock`` against stock vLLM without speculation,
``x_no_spec`` against the same attention cell without speculation (one sample each).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kvcompact.tools import evaluation as ev
from kvcompact.tools.bench import ratio, times
from kvcompact.tools.cli import UsageError
from kvcompact.tools.local_engine import drive, forget_prefixes, scheduler, warm_up

SPEC_COUNTERS = ("vllm:spec_decode_num_drafts", "vllm:spec_decode_num_draft_tokens",
                 "vllm:spec_decode_num_accepted_tokens")


def _answers() -> Any:
    from kvcompact.tools.bench import load_benchmark

    return load_benchmark("answers")  # the fixed-pool setup the reasoning benchmarks share


def add_arguments(p: Any) -> None:
    _answers().add_pool_arguments(p)
    p.add_argument("--policy", default=None, help="default triattention when statistics exist (quick: streaming)")
    p.add_argument("--budget", type=int, default=None, help="compressed cell's budget (default 512, quick 64)")
    p.add_argument("--spec-tokens", type=int, default=3, help="n-gram drafts per step (default 3)")
    p.add_argument("--prompt-lookup-max", type=int, default=4, help="longest n-gram matched (default 4)")
    p.add_argument("--draft-model", default=None, help="a known model name or folder: also run full attention "
                   "with draft-model speculation (no kvcompact), e.g. qwen2.5-coder-0.5b-instruct")


def run(ctx: Any) -> dict[str, Any]:
    a = ctx.args
    r = _answers().pool_run(ctx)
    policy = a.policy or ("streaming" if ctx.quick or r.stats is None else "triattention")
    if policy == "triattention" and r.stats is None:
        raise UsageError("triattention needs statistics for this model (--stats)", command="bench speculative")
    budget = a.budget or (64 if ctx.quick else 512)
    ngram = {"method": "ngram", "num_speculative_tokens": a.spec_tokens, "prompt_lookup_min": 2,
             "prompt_lookup_max": a.prompt_lookup_max}
    setup = {**r.setup(a, ctx), "policy": policy, "budget": budget, "speculative_config": ngram}
    cfg = {"policy": policy, "budget": budget, "divide_length": a.divide_length, "window": a.window,
           "n_sink": a.n_sink, "compaction": "repack", "admission": "guaranteed"}
    if policy == "triattention":
        cfg["stats_path"] = r.stats
    stock: list[tuple[str, dict[str, Any]]] = [("stock", {})]
    kvc_cells: list[tuple[str, dict[str, Any]]] = [("admission", {"kvcompact": "off"}), (f"{policy}@{budget}", {})]
    # (speculation name, speculative config, kvcompact config or None for stock vLLM, cells), in run order
    engines: list[tuple[str, dict[str, Any] | None, dict[str, Any] | None, list[tuple[str, dict[str, Any]]]]] = [
        ("none", None, None, stock), ("none", None, cfg, kvc_cells), ("ngram", ngram, cfg, kvc_cells),
        ("ngram", ngram, None, stock)]
    if a.draft_model:
        draft = {"method": "draft_model", "model": ctx.model_and_stats(a.draft_model, None)[0],
                 "num_speculative_tokens": a.spec_tokens}
        setup["draft_speculative_config"] = draft
        engines.append(("draft", draft, None, stock))
    results: dict[str, dict[str, Any]] = {}
    for n, (spec_name, spec, kvc, mine) in enumerate(engines):
        extra = {} if spec is None else {"speculative_config": spec}
        with r.engine(ctx, kvc, len(r.task.items), disable_log_stats=False, **extra) as llm:
            warm_up(llm, r.ids[r.task.items[0].id])
            for cell, xargs in mine if n % 2 == 0 else mine[::-1]:
                name = f"{cell} / {spec_name}"
                forget_prefixes(llm)
                results[name] = _one(ctx, llm, r, name, xargs)
                ctx.log(_line(name, results[name]))
        ctx.checkpoint({"setup": setup, "results": results})
    out: dict[str, Any] = {"setup": setup, "cells": {}}
    for name, res in results.items():
        cell, spec_name = name.split(" / ")
        out["cells"][name] = _summary(r.task, res, results["stock / none"], results[f"{cell} / none"],
                                      results[f"stock / {spec_name}"])
        v = out["cells"][name]
        ctx.log(f"{name:28s} {times(v['answers_per_min_x_stock'])} stock correct answers/min, "
                f"{times(v['tokens_per_s_x_stock'])} stock tokens/s, {times(v['tokens_per_s_x_no_spec'])} no-spec "
                "tokens/s")
    out["headline"] = {c: {k: v[k] for k in ("accuracy", "answers_per_min", "answers_per_min_x_stock",
                                            "tokens_per_s_x_stock", "tokens_per_s_x_no_spec", "acceptance_rate",
                                            "mean_acceptance_length", "rounds", "preemptions")}
                       for c, v in out["cells"].items()}
    _plot(ctx, out)
    return out


def _counters(llm: Any) -> dict[str, float]:
    values = {m.name: m.value for m in llm.get_metrics() if m.name in SPEC_COUNTERS}
    return {name: float(values.get(name, 0.0)) for name in SPEC_COUNTERS}


def _one(ctx: Any, llm: Any, r: Any, name: str, xargs: dict[str, Any]) -> dict[str, Any]:
    from vllm import SamplingParams

    side = scheduler(llm).kvcompact
    totals = side.metrics.totals if side is not None else None
    rounds, before = totals.rounds if totals else 0, _counters(llm)
    task = r.task
    requests = [(f"{name}-{n}", r.ids[item.id], SamplingParams(temperature=0, max_tokens=item.max_tokens,
                                                               extra_args=dict(xargs) or None))
                for n, item in enumerate(task.items)]
    res = drive(llm, requests, desc=name)
    tokens = {item.id: res["tokens"].get(f"{name}-{n}", []) for n, item in enumerate(task.items)}
    texts = {k: r.tok.decode(v, skip_special_tokens=True) for k, v in tokens.items()}
    after = _counters(llm)
    drafts, draft_tokens, accepted = (after[k] - before[k] for k in SPEC_COUNTERS)
    return {"wall_s": res["wall_s"], "generated": sum(len(v) for v in tokens.values()),
            "preemptions": res["preemptions"], "tokens": tokens, "texts": texts,
            "correct_by_item": {item.id: task.grade(item, texts[item.id])[0] for item in task.items},
            "rounds": totals.rounds - rounds if totals else 0, "drafts": drafts, "draft_tokens": draft_tokens,
            "accepted": accepted}


def _summary(task: ev.Task, r: dict[str, Any], stock: dict[str, Any], base: dict[str, Any],
             same_spec: dict[str, Any]) -> dict[str, Any]:
    """``stock``: stock vLLM without speculation (the ``x_stock`` denominator); ``base``: the same attention cell
    without speculation (``x_no_spec``); ``same_spec``: stock vLLM with the same speculation (the paired accuracy
    comparison)."""
    s = ev.summarize(task, "", r["texts"], r["tokens"], {}, {
        i.id: (same_spec["correct_by_item"][i.id], task.grade(i, same_spec["texts"][i.id])[1]) for i in task.items})
    per_min = lambda x: sum(x["correct_by_item"].values()) / (x["wall_s"] / 60)  # noqa: E731
    tok_s = lambda x: x["generated"] / x["wall_s"]  # noqa: E731
    return {"accuracy": s["accuracy"], "ci95": s["ci95"], "correct": s["correct"], "n": s["n"],
            "paired_vs_stock": s["paired"], "wall_s": r["wall_s"], "tokens_per_s": tok_s(r),
            "tokens_per_s_x_stock": ratio(tok_s(r), tok_s(stock)),
            "tokens_per_s_x_no_spec": ratio(tok_s(r), tok_s(base)),
            "answers_per_min": per_min(r), "answers_per_min_x_stock": ratio(per_min(r), per_min(stock)),
            "answers_per_min_x_no_spec": ratio(per_min(r), per_min(base)),
            "preemptions": r["preemptions"], "rounds": r["rounds"], "drafts": r["drafts"],
            "draft_tokens": r["draft_tokens"], "accepted_tokens": r["accepted"],
            "acceptance_rate": r["accepted"] / r["draft_tokens"] if r["draft_tokens"] else None,
            "mean_acceptance_length": 1 + r["accepted"] / r["drafts"] if r["drafts"] else None,
            "same_tokens_as_no_spec": r["tokens"] == base["tokens"]}


def _line(name: str, r: dict[str, Any]) -> str:
    k = sum(r["correct_by_item"].values())
    rate = f"{r['accepted'] / r['draft_tokens']:.2f}" if r["draft_tokens"] else "-"
    return (f"{name:28s} {k:3d}/{len(r['correct_by_item'])} correct in {r['wall_s']:.0f} s "
            f"({k / (r['wall_s'] / 60):.2f}/min), {r['generated'] / r['wall_s']:.1f} tok/s, {r['preemptions']} "
            f"preemptions, {r['rounds']} rounds, acceptance {rate}")


def _plot(ctx: Any, out: dict[str, Any]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (speed, answers) = plt.subplots(1, 2, figsize=(10, 4.2))
    names = list(out["cells"])
    cells = list(dict.fromkeys(n.split(" / ")[0] for n in names))
    specs = list(dict.fromkeys(n.split(" / ")[1] for n in names))
    width = 0.8 / len(specs)
    for i, spec_name in enumerate(specs):
        present = [(j, out["cells"][f"{c} / {spec_name}"]) for j, c in enumerate(cells)
                   if f"{c} / {spec_name}" in out["cells"]]
        rows = [v for _, v in present]
        xs = [j + (i - (len(specs) - 1) / 2) * width for j, _ in present]
        speed.bar(xs, [v["tokens_per_s"] for v in rows], width, label=f"speculation: {spec_name}")
        for x, v in zip(xs, rows):
            answers.annotate(times(v["answers_per_min_x_stock"]), (x, v["answers_per_min"]), ha="center",
                             textcoords="offset points", xytext=(0, 3), fontsize=7)
        answers.bar(xs, [v["answers_per_min"] for v in rows], width, label=f"speculation: {spec_name}")
        for x, v in zip(xs, rows):
            if v["acceptance_rate"] is not None:
                speed.annotate(f"acc. {v['acceptance_rate']:.2f}", (x, v["tokens_per_s"]), ha="center",
                               textcoords="offset points", xytext=(0, 3), fontsize=7)
    for ax, label in ((speed, "generated tokens/s"), (answers, "correct answers per minute (x stock, no spec.)")):
        ax.set_xticks(range(len(cells)), cells)
        ax.set_ylabel(label)
        ax.grid(alpha=0.3, axis="y")
    answers.legend(fontsize=7)
    s = out["setup"]
    fig.suptitle(f"{Path(s['model']).name}: {s['problems']} problems, pool of {s['pool_requests']} full requests "
                 f"({s['pool_blocks']} blocks), n-gram k={s['speculative_config']['num_speculative_tokens']}",
                 fontsize=8)
    fig.tight_layout()
    ctx.savefig(fig)
