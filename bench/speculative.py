"""Speculative decoding x {stock vLLM, kvcompact at two budgets} at a fixed pool.

The reasoning task's problems (``kvcompact.tools.evaluation``, report seed), all in flight, in a KV pool that holds
``--pool-requests`` full-length requests, greedy, prefix caching on (vLLM's default) in every engine. The
speculative config is engine-wide, so every speculation has two engines: ``stock`` (vLLM with kvcompact installed
and not configured: greedy admission, preemption by recompute) and a kvcompact engine (guaranteed admission,
``--policy``) that runs one compressed cell per ``--budgets`` entry (a per-request ``kvcompact_budget``), one after
the other with the prefix cache emptied between them. Speculations: ``none``, ``ngram`` (prompt lookup,
``--spec-tokens`` drafts per step) and, with ``--draft-model``, ``draft`` (that model drafts ``--spec-tokens``
tokens per step; its KV cache is compacted with the target's). ``--reps`` repetitions run every engine again, in
the reverse order every other repetition, each engine after a warm-up request.

Per cell: accuracy (first repetition; per problem, so a chain answer counts each problem restated right) with its
Wilson interval and the paired difference to stock vLLM with the same speculation on the same problems; medians
over repetitions of correct answers per minute and tokens/s; ratios per repetition (median and range):
``x_stock`` against stock vLLM without speculation, ``x_no_spec`` against the same attention cell without
speculation; preemptions, kvcompact rounds (0 on stock vLLM), and vLLM's own acceptance counters summed over
repetitions: acceptance rate = accepted / draft tokens, mean acceptance length = 1 + accepted / drafts.
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

from kvcompact.config import XARG_BUDGET
from kvcompact.tools import evaluation as ev
from kvcompact.tools.bench import FIXED_ROUNDS, paired_ratio, times
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
    p.add_argument("--budgets", default=None, help="comma list of compressed cells' budgets (default 512,768: "
                   "the default budget and a lighter one; quick 64)")
    p.add_argument("--spec-tokens", type=int, default=3, help="tokens drafted per step (default 3)")
    p.add_argument("--prompt-lookup-max", type=int, default=4, help="longest n-gram matched (default 4)")
    p.add_argument("--draft-model", default=None, help="a known model name or folder: add draft-model speculation "
                   "(quick: the model drafts for itself), e.g. qwen2.5-coder-0.5b-instruct for the 1.5B")
    p.add_argument("--reps", type=int, default=None, help="repetitions, order alternating (default 3, quick 1)")
    p.add_argument("--per-answer", type=int, default=None, help="long answers: the chain task, this many problems "
                   "solved in one answer and restated at its end (`bench longgen`); --problems answers; correct "
                   "answers count the problems restated right (default: the reasoning task, one problem each)")


def run(ctx: Any) -> dict[str, Any]:
    a = ctx.args
    r = _answers().pool_run(ctx)
    if a.per_answer:
        r = r.on(ev.chain_task(a.problems or (2 if ctx.quick else 4), a.per_answer, r.seed, r.max_tokens),
                 a.pool_requests)
    policy = a.policy or ("streaming" if ctx.quick or r.stats is None else "triattention")
    if policy == "triattention" and r.stats is None:
        raise UsageError("triattention needs statistics for this model (--stats)", command="bench speculative")
    budgets = [int(b) for b in (a.budgets or ("64" if ctx.quick else "512,768")).split(",")]
    reps = a.reps or (1 if ctx.quick else 3)
    specs: dict[str, dict[str, Any] | None] = {
        "none": None, "ngram": {"method": "ngram", "num_speculative_tokens": a.spec_tokens, "prompt_lookup_min": 2,
                                "prompt_lookup_max": a.prompt_lookup_max}}
    draft_model = a.draft_model or (r.model if ctx.quick else None)
    if draft_model:
        specs["draft"] = {"method": "draft_model", "model": ctx.model_and_stats(draft_model, None)[0],
                          "num_speculative_tokens": a.spec_tokens}
    setup = {**r.setup(a, ctx), "task": r.task.name, "per_answer": a.per_answer, "policy": policy,
             "budgets": budgets, "reps": reps, "speculative_configs": specs}
    cfg = {**FIXED_ROUNDS, "policy": policy, "budget": min(budgets), "divide_length": a.divide_length,
           "window": a.window, "n_sink": a.n_sink, "compaction": "repack", "admission": "guaranteed"}
    if policy == "triattention":
        cfg["stats_path"] = r.stats
    compressed = [(f"{policy}@{b}", {XARG_BUDGET: b}) for b in budgets]
    # (speculation, kvcompact config or None for stock vLLM, that engine's cells), one engine each
    engines = [(s, kvc, cells) for s in specs for kvc, cells in ((None, [("stock", {})]), (cfg, compressed))]
    runs: dict[str, list[dict[str, Any]]] = {f"{c} / {s}": [] for s, _, cells in engines for c, _ in cells}
    for rep in range(reps):
        for spec_name, kvc, cells in engines if rep % 2 == 0 else engines[::-1]:
            extra = {} if specs[spec_name] is None else {"speculative_config": specs[spec_name]}
            with r.engine(ctx, kvc, len(r.task.items), disable_log_stats=False, **extra) as llm:
                warm_up(llm, r.ids[r.task.items[0].id])
                for cell, xargs in cells if rep % 2 == 0 else cells[::-1]:
                    name = f"{cell} / {spec_name}"
                    forget_prefixes(llm)
                    runs[name].append(_one(llm, r, name, xargs))
                    ctx.log(f"rep {rep}: {_line(name, runs[name][-1])}")
            ctx.checkpoint({"setup": setup, "runs": runs})
    out: dict[str, Any] = {"setup": setup, "cells": {}}
    for name, mine in runs.items():
        cell, spec_name = name.split(" / ")
        out["cells"][name] = _summary(r.task, mine, runs["stock / none"], runs[f"{cell} / none"],
                                      runs[f"stock / {spec_name}"])
        v = out["cells"][name]
        ctx.log(f"{name:28s} {times(v['answers_per_min_x_stock'])} stock correct answers/min, "
                f"{times(v['tokens_per_s_x_stock'])} stock tokens/s, {times(v['tokens_per_s_x_no_spec'])} no-spec "
                f"tokens/s, acceptance {_rate(v['acceptance_rate'])}")
    out["headline"] = {c: {k: v[k] for k in ("accuracy", "answers_per_min", "answers_per_min_x_stock",
                                            "tokens_per_s_x_stock", "tokens_per_s_x_no_spec", "acceptance_rate",
                                            "mean_acceptance_length", "rounds", "preemptions")}
                       for c, v in out["cells"].items()}
    _plot(ctx, out)
    return out


def _graded(task: ev.Task, item: ev.Item, text: str) -> list[bool]:
    """One completion's correct answers, a flag per problem: restated right on a chain item's final line (one per
    problem), else the item's grade."""
    if task.name == "chain":
        return [restated for restated, _ in ev.chain_units(item, text)]
    return [task.grade(item, text)[0]]


def _flat(task: ev.Task, r: dict[str, Any]) -> list[bool]:
    return [ok for item in task.items for ok in r["correct_by_item"][item.id]]


def _counters(llm: Any) -> dict[str, float]:
    values = {m.name: m.value for m in llm.get_metrics() if m.name in SPEC_COUNTERS}
    return {name: float(values.get(name, 0.0)) for name in SPEC_COUNTERS}


def _one(llm: Any, r: Any, name: str, xargs: dict[str, Any]) -> dict[str, Any]:
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
            "correct_by_item": {item.id: _graded(task, item, texts[item.id]) for item in task.items},
            "rounds": totals.rounds - rounds if totals else 0, "drafts": drafts, "draft_tokens": draft_tokens,
            "accepted": accepted}


def _per_min(r: dict[str, Any]) -> float:
    return sum(map(sum, r["correct_by_item"].values())) / (r["wall_s"] / 60)


def _tok_s(r: dict[str, Any]) -> float:
    return r["generated"] / r["wall_s"]


def _summary(task: ev.Task, runs: list[dict[str, Any]], stock: list[dict[str, Any]], base: list[dict[str, Any]],
             same_spec: list[dict[str, Any]]) -> dict[str, Any]:
    """``runs``: the cell's repetitions; ``stock``: stock vLLM without speculation (the ``x_stock`` denominator, the
    same repetition's); ``base``: the same attention cell without speculation (``x_no_spec``); ``same_spec``: stock
    vLLM with the same speculation (the paired accuracy comparison, first repetitions: greedy answers repeat unless
    batching changes the arithmetic, which ``reps_same_answers`` shows)."""
    first, other = runs[0], same_spec[0]
    correct, k = _flat(task, first), sum(_flat(task, first))
    drafts, draft_tokens, accepted = (sum(r[k] for r in runs) for k in ("drafts", "draft_tokens", "accepted"))
    return {"accuracy": k / len(correct), "ci95": list(ev.wilson(k, len(correct))), "correct": k, "n": len(correct),
            "paired_vs_stock": ev.paired_difference(_flat(task, other), correct),
            "mean_tokens": statistics.mean(len(t) for t in first["tokens"].values()),
            "wall_s": statistics.median(r["wall_s"] for r in runs), "wall_s_reps": [r["wall_s"] for r in runs],
            "tokens_per_s": statistics.median(map(_tok_s, runs)),
            "tokens_per_s_x_stock": paired_ratio(map(_tok_s, runs), map(_tok_s, stock)),
            "tokens_per_s_x_no_spec": paired_ratio(map(_tok_s, runs), map(_tok_s, base)),
            "answers_per_min": statistics.median(map(_per_min, runs)),
            "answers_per_min_x_stock": paired_ratio(map(_per_min, runs), map(_per_min, stock)),
            "answers_per_min_x_no_spec": paired_ratio(map(_per_min, runs), map(_per_min, base)),
            "preemptions": [r["preemptions"] for r in runs], "rounds": statistics.median(r["rounds"] for r in runs),
            "drafts": drafts, "draft_tokens": draft_tokens, "accepted_tokens": accepted,
            "acceptance_rate": accepted / draft_tokens if draft_tokens else None,
            "mean_acceptance_length": 1 + accepted / drafts if drafts else None,
            "reps_same_answers": all(r["correct_by_item"] == first["correct_by_item"] for r in runs),
            "same_tokens_as_no_spec": first["tokens"] == base[0]["tokens"]}


def _rate(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def _line(name: str, r: dict[str, Any]) -> str:
    k = sum(map(sum, r["correct_by_item"].values()))
    rate = _rate(r["accepted"] / r["draft_tokens"] if r["draft_tokens"] else None)
    return (f"{name:28s} {k:3d} correct in {r['wall_s']:.0f} s "
            f"({k / (r['wall_s'] / 60):.2f}/min), {_tok_s(r):.1f} tok/s, {r['preemptions']} "
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
    k = s["speculative_configs"]["ngram"]["num_speculative_tokens"]
    what = f"{s['problems']} problems"
    if s.get("per_answer"):
        what = f"{s['problems']} answers of {s['per_answer']} problems"
    fig.suptitle(f"{Path(s['model']).name}: {what}, pool of {s['pool_requests']} full requests "
                 f"({s['pool_blocks']} blocks), {s['reps']} repetitions (medians), {k} drafts per step", fontsize=8)
    fig.tight_layout()
    ctx.savefig(fig)
