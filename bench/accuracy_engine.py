"""Accuracy through the engine users run: every problem a concurrent request, every cell switched per request.

``kvcompact bench accuracy`` runs this for the generation tasks (``--tasks``, default); ``--tests`` selects the
transformers reference path (teacher-forced perplexity and the older one-request-at-a-time tests).

One in-process vLLM engine per (policy, protect_prompt); inside it, full attention (``{"kvcompact": "off"}``) and
each budget (``{"kvcompact_budget": B}``) ride on the requests as a client's ``vllm_xargs`` would, greedy, in
the model's chat template, with a pool large enough that nothing waits for memory (this measures quality, not
capacity: that is ``kvcompact bench answers``). Full attention runs once, in the first engine, and every cell is
compared with it item by item (:mod:`kvcompact.tools.evaluation`).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from kvcompact.tools import evaluation as ev
from kvcompact.tools.bench import FIXED_ROUNDS
from kvcompact.tools.cli import UsageError
from kvcompact.tools.local_engine import drive, scheduler, worker_side


def add_arguments(p: Any) -> None:
    p.add_argument("--tasks", default=None, help=f"comma list of {','.join(ev.TASKS)} (default all)")
    p.add_argument("--problems", type=int, default=None, help="reasoning problems (default 200, quick 3)")
    p.add_argument("--passkeys", type=int, default=None, help="passkey items (default 48, quick 2)")
    p.add_argument("--recalls", type=int, default=None, help="recall items (default 48, quick 2)")
    p.add_argument("--max-tokens", type=int, default=None, help="reasoning/recall token cap (default 1024)")
    p.add_argument("--divide-length", type=int, default=64, help="tokens between rounds (default 64)")
    p.add_argument("--n-sink", type=int, default=4, help="first tokens never evicted (default 4)")
    p.add_argument("--concurrency", type=int, default=16, help="requests in flight (max_num_seqs, default 16)")
    p.add_argument("--explore", action="store_true",
                   help=f"use the exploration seed {ev.EXPLORE_SEED} instead of the report seed {ev.REPORT_SEED}")
    p.add_argument("--no-protect-prompt-passkey", action="store_true",
                   help="skip the passkey cells with protect_prompt on")


def run(ctx: Any) -> dict[str, Any]:
    from transformers import AutoTokenizer

    a = ctx.args
    model, stats = ctx.model_and_stats(a.model, a.stats)
    tok = AutoTokenizer.from_pretrained(model)
    seed = ev.EXPLORE_SEED if a.explore else ev.REPORT_SEED
    q = ctx.quick
    tasks_wanted = (a.tasks or ",".join(ev.TASKS)).split(",")
    unknown = set(tasks_wanted) - set(ev.TASKS)
    if unknown:
        raise UsageError(f"unknown task(s) {', '.join(sorted(unknown))}; known: {', '.join(ev.TASKS)}",
                         command="bench accuracy")
    max_tokens = a.max_tokens or (96 if q else 1024)
    tasks: list[ev.Task] = []
    for name in tasks_wanted:
        if name == "reasoning":
            tasks.append(ev.reasoning_task(a.problems or (3 if q else 200), seed, max_tokens))
        elif name == "passkey":
            from kvcompact.tools.corpus import eval_text

            words = eval_text().read_text().split()
            lo, hi = (250, 400) if q else (1500, 2600)
            tasks.append(ev.passkey_task(a.passkeys or (2 if q else 48), words, seed, lo, hi))
        else:
            tasks.append(ev.recall_task(a.recalls or (2 if q else 48), seed, 20 if q else 150, max_tokens))
    ids = {t.name: {i.id: ev.prompt_ids(tok, i) for i in t.items} for t in tasks}
    policies = (a.policies or ("triattention,streaming" if q else "triattention,streaming,knorm")).split(",")
    if "triattention" in policies and stats is None:
        policies.remove("triattention")
        ctx.notes.append("triattention skipped: no statistics for this model (`kvcompact prepare --model ...`)")
    budgets = [int(b) for b in (a.budgets or ("64,128" if q else "64,128,256,512")).split(",")]
    window = a.window if a.window is not None else 32
    engines = [(p, False) for p in policies]
    if "passkey" in tasks_wanted and not a.no_protect_prompt_passkey:
        engines += [(p, True) for p in policies]
    longest = max(len(v) for per in ids.values() for v in per.values())
    block = 32
    max_len = math.ceil((longest + max(max_tokens, 16)) / block) * block
    setup = {"model": model, "stats": stats, "seed": seed, "tasks": tasks_wanted, "policies": policies,
             "budgets": budgets, "window": window, "n_sink": a.n_sink, "divide_length": a.divide_length,
             "selection": a.selection,
             "max_tokens": max_tokens, "concurrency": a.concurrency, "dtype": ctx.engine_dtype,
             "items": {t.name: len(t.items) for t in tasks}, "prompt_tokens_max": longest}
    out: dict[str, Any] = {"setup": setup, "tasks": {t.name: {"cells": {}} for t in tasks}}
    full: dict[str, dict[str, tuple[bool, str | None]]] = {}
    for policy, protect in engines:
        cfg = {**FIXED_ROUNDS, "policy": policy, "budget": max(budgets), "divide_length": a.divide_length,
               "window": window, "n_sink": a.n_sink, "selection": a.selection, "protect_prompt": protect,
               "compaction": "repack"}
        if policy == "triattention":
            cfg["stats_path"] = stats
        # protect_prompt only changes prompt-heavy tasks: its engine runs the passkey task alone
        run_tasks = [t for t in tasks if not protect or t.name == "passkey"]
        cells: list[tuple[str, dict[str, Any]]] = [] if full else [("full", {"kvcompact": "off"})]
        suffix = "+protect_prompt" if protect else ""
        cells += [(f"{policy}{suffix}@{b}", {"kvcompact_budget": b}) for b in budgets]
        pool = a.concurrency * math.ceil(max_len / block) + 8
        ctx.log(f"engine: {policy}{suffix}, {len(cells)} cells x {sum(len(t.items) for t in run_tasks)} items")
        with ctx.engine(cfg, model=model, block_size=block, num_blocks=pool, max_model_len=max_len,
                        max_num_seqs=a.concurrency) as llm:
            results = _generate(ctx, llm, tok, run_tasks, ids, cells)
        for task in run_tasks:
            cells_out = out["tasks"][task.name]["cells"]
            for cell, _ in cells:
                texts, tokens, rounds, lost, early = results[task.name][cell]
                ref = full.get(task.name)
                summary = ev.summarize(task, cell, texts, tokens, rounds, ref)
                summary["first_token_evicted"] = len(lost)
                summary["completions"] = texts
                summary["first_round_evicted_early_positions"] = {
                    str(p): sum(p in v for v in early.values()) for p in range(8)}
                if cell == "full":
                    full[task.name] = {i.id: (summary["correct_by_item"][i.id], summary["answers"][i.id])
                                       for i in task.items}
                cells_out[cell] = summary
                ctx.log(_line(task.name, summary))
        ctx.checkpoint(out)
    out["headline"] = {t: {c: _short(s) for c, s in v["cells"].items()} for t, v in out["tasks"].items()}
    _plot(ctx, out)
    return out


def _generate(ctx: Any, llm: Any, tok: Any, tasks: list[ev.Task], ids: dict[str, dict[str, list[int]]],
              cells: list[tuple[str, dict[str, Any]]]) -> dict[str, dict[str, tuple[dict, dict, dict, set, dict]]]:
    """Every (task item, cell) as one concurrent request; per task and cell: texts, token ids and rounds per
    item, the items whose first token (the attention sink) a round evicted in some KV head, and which of the
    first 8 positions each item's first round evicted in some KV head."""
    from vllm import SamplingParams

    requests, where = [], {}
    for ti, task in enumerate(tasks):
        for ci, (cell, xargs) in enumerate(cells):
            for ii, item in enumerate(task.items):
                rid = f"t{ti}c{ci}i{ii}"  # no "-": vLLM's scheduler knows it as rid + "-" + a suffix
                params = SamplingParams(temperature=0, max_tokens=item.max_tokens, extra_args=dict(xargs))
                requests.append((rid, ids[task.name][item.id], params))
                where[rid] = (task, cell, item)
    rounds: dict[str, int] = {}
    sink_lost: set[str] = set()
    first_round: dict[str, list[int]] = {}

    def listener(event: Any) -> None:
        rid = event.req_id.split("-", 1)[0]
        rounds[rid] = rounds.get(rid, 0) + 1

    def keep_listener(log: Any) -> None:
        # repack keeps survivors in order, so slot 0 holds position 0 until a round evicts it in some KV head
        rid = log.req_id.split("-", 1)[0]
        if not bool(log.keep_mask[:, :, 0].all()):
            sink_lost.add(rid)
        if rid not in first_round:  # the first round sees slot i = position i: which early positions it evicts
            first_round[rid] = (~log.keep_mask[:, :, :8].all(dim=0).all(dim=0)).nonzero().flatten().tolist()

    side, worker = scheduler(llm).kvcompact, worker_side(llm)
    side.round_listeners.append(listener)
    worker.round_listeners.append(keep_listener)
    try:
        res = drive(llm, requests, desc="generate")
    finally:
        side.round_listeners.remove(listener)
        worker.round_listeners.remove(keep_listener)
    out: dict[str, dict[str, tuple[dict, dict, dict, set, dict]]] = {}
    for rid, (task, cell, item) in where.items():
        texts, tokens, rnds, lost, early = out.setdefault(task.name, {}).setdefault(cell, ({}, {}, {}, set(), {}))
        tokens[item.id] = res["tokens"].get(rid, [])
        texts[item.id] = tok.decode(tokens[item.id], skip_special_tokens=True)
        rnds[item.id] = rounds.get(rid, 0)
        lost.update({item.id} if rid in sink_lost else set())
        early[item.id] = first_round.get(rid, [])
    return out


def _short(s: dict[str, Any]) -> dict[str, Any]:
    keep = {k: s[k] for k in ("correct", "n", "accuracy", "ci95", "mean_tokens", "p95_tokens", "at_cap",
                              "looping", "rounds_per_request", "first_token_evicted")}
    if "paired" in s:
        keep["agreement"] = s["agreement"]
        keep["diff_vs_full"] = s["paired"]["diff"]
        keep["diff_ci95"] = s["paired"]["ci95"]
        keep["noninferior_2pt"] = s["paired"]["noninferior"]
    return keep


def _line(task: str, s: dict[str, Any]) -> str:
    lo, hi = s["ci95"]
    text = (f"{task:9s} {s['cell']:28s} {s['correct']:3d}/{s['n']:<3d} {s['accuracy']:.3f} [{lo:.2f},{hi:.2f}] "
            f"tokens mean {s['mean_tokens']:.0f} p95 {s['p95_tokens']} cap {s['at_cap']} loop {s['looping']} "
            f"rounds {s['rounds_per_request']:.1f} sink lost {s['first_token_evicted']}")
    if "paired" in s:
        d = s["paired"]
        text += f" | vs full {d['diff']:+.3f} [{d['ci95'][0]:+.3f},{d['ci95'][1]:+.3f}] agree {s['agreement']:.2f}"
    return text


def _plot(ctx: Any, out: dict[str, Any]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tasks = list(out["tasks"])
    budgets = out["setup"]["budgets"]
    fig, axes = plt.subplots(1, len(tasks), figsize=(4.6 * len(tasks), 3.6), squeeze=False)
    for ax, task in zip(axes[0], tasks):
        cells = out["tasks"][task]["cells"]
        full = cells.get("full")
        series: dict[str, list[tuple[int, dict[str, Any]]]] = {}
        for name, s in cells.items():
            if name != "full":
                label, b = name.rsplit("@", 1)
                series.setdefault(label, []).append((int(b), s))
        for label, pts in series.items():
            pts.sort(key=lambda x: x[0])
            xs = [b for b, _ in pts]
            ys = [s["accuracy"] for _, s in pts]
            err = [[max(0.0, s["accuracy"] - s["ci95"][0]) for _, s in pts],
                   [max(0.0, s["ci95"][1] - s["accuracy"]) for _, s in pts]]
            ax.errorbar(xs, ys, yerr=err, marker="o", capsize=3, label=label)
        if full:
            ax.axhspan(full["ci95"][0], full["ci95"][1], color="k", alpha=0.08)
            ax.axhline(full["accuracy"], color="k", ls="--", lw=1, label="full attention")
        ax.set_xscale("log", base=2)
        ax.set_xticks(budgets, [str(b) for b in budgets])
        ax.set_xlabel("budget (tokens per KV head)")
        ax.set_ylabel(f"{task}: accuracy (95% CI)")
        ax.set_ylim(-0.02, 1.02)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(f"{Path(out['setup']['model']).name}: accuracy through the engine (n per task: "
                 f"{out['setup']['items']})", fontsize=9)
    fig.tight_layout()
    ctx.savefig(fig)
