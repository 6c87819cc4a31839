"""Budget mode pressure against stock vLLM, full attention and a fixed budget, with the load swept at a fixed pool.

The reasoning task's problems (``kvcompact.tools.evaluation``, report seed) in a KV pool that holds ``--pool-requests``
full-length requests (prompt + ``--max-tokens``), prefix caching on (vLLM's default) in every engine. For each
load N in ``--loads`` (requests in flight: a closed loop that adds the next problem whenever one finishes), two
engines run the same problems, their order alternating between loads: stock vLLM (kvcompact installed and not
configured: greedy admission, preemption by recompute), and one kvcompact engine (guaranteed admission) that runs,
one after another with the prefix cache emptied between them: ``admission`` (every request ``{"kvcompact": "off"}``:
full attention, no eviction), the fixed budget B, and budget mode pressure with floor B. Per cell: accuracy with
its Wilson interval and the paired difference to stock on the same problems, correct answers per minute and
tokens/s with their ratios to stock at the same load (``x_stock``; one sample each), answers per minute
``x_fixed``, preemptions, rounds, pressure rounds and the requests that never compressed (stock vLLM has no
kvcompact scheduler: 0 rounds, ``uncompressed`` None). Goals: at light load pressure matches stock's accuracy and
speed; at heavy load it matches or beats the fixed budget's answers per minute with accuracy >= the fixed
budget's. The plot: accuracy and correct answers per minute against load, one line per cell.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kvcompact.tools import evaluation as ev
from kvcompact.tools.bench import ratio, times
from kvcompact.tools.cli import UsageError
from kvcompact.tools.local_engine import drive, forget_prefixes, scheduler, warm_up


def _answers() -> Any:
    from kvcompact.tools.bench import load_benchmark

    return load_benchmark("answers")  # the fixed-pool setup both benchmarks share


def add_arguments(p: Any) -> None:
    _answers().add_pool_arguments(p)
    p.add_argument("--policy", default=None, help="default triattention when statistics exist (quick: streaming)")
    p.add_argument("--budget", type=int, default=None, help="fixed budget and pressure floor B (default 256, quick 64)")
    p.add_argument("--loads", default=None, help="requests in flight, comma list (default 4,16; quick 2,4)")


def run(ctx: Any) -> dict[str, Any]:
    a = ctx.args
    r = _answers().pool_run(ctx)
    stats, task = r.stats, r.task
    policy = a.policy or ("streaming" if ctx.quick or stats is None else "triattention")
    if policy == "triattention" and stats is None:
        raise UsageError("triattention needs statistics for this model (--stats)", command="bench pressure")
    budget = a.budget or (64 if ctx.quick else 256)
    loads = [int(n) for n in (a.loads or ("2,4" if ctx.quick else "4,16")).split(",")]
    setup = {**r.setup(a, ctx), "policy": policy, "budget": budget, "loads": loads}
    cells: list[tuple[str, dict[str, Any]]] = [("admission", {"kvcompact": "off"}),
                                                (f"fixed@{budget}", {"kvcompact_budget_mode": "fixed"}),
                                                (f"pressure@{budget}", {"kvcompact_budget_mode": "pressure"})]
    cfg = {"policy": policy, "budget": budget, "divide_length": a.divide_length, "window": a.window,
           "n_sink": a.n_sink, "compaction": "repack", "admission": "guaranteed", "budget_mode": "pressure",
           "protect_prompt": False}
    if policy == "triattention":
        cfg["stats_path"] = stats
    engines: list[tuple[dict[str, Any] | None, list[tuple[str, dict[str, Any]]]]] = [(None, [("stock", {})]),
                                                                                   (cfg, cells)]
    results: dict[str, dict[str, Any]] = {}
    for n, load in enumerate(loads):
        results[str(load)] = {}
        for kvc, mine in engines if n % 2 == 0 else engines[::-1]:
            with r.engine(ctx, kvc, max(loads)) as llm:
                warm_up(llm, r.ids[task.items[0].id])
                for cell, xargs in mine if n % 2 == 0 else mine[::-1]:
                    forget_prefixes(llm)
                    res = _one(ctx, llm, r, load, cell, xargs)
                    results[str(load)][cell] = res
                    ctx.log(_line(load, cell, res))
            ctx.checkpoint({"setup": setup, "results": results})
    out: dict[str, Any] = {"setup": setup, "loads": {}}
    for key, by_cell in results.items():
        out["loads"][key] = {cell: _summary(task, by_cell[cell], by_cell, budget)
                             for cell in ["stock"] + [c for c, _ in cells]}
        for cell, v in out["loads"][key].items():
            ctx.log(f"x{key:<3s} {cell:20s} {times(v['answers_per_min_x_stock'])} stock correct answers/min, "
                    f"{times(v['tokens_per_s_x_stock'])} stock tokens/s, {times(v['answers_per_min_x_fixed'])} "
                    "fixed correct answers/min")
    out["headline"] = {f"{load} in flight": {c: {k: v[k] for k in ("accuracy", "answers_per_min",
                                                                  "answers_per_min_x_stock", "tokens_per_s_x_stock",
                                                                  "answers_per_min_x_fixed", "preemptions",
                                                                  "pressure_rounds", "uncompressed")}
                                              for c, v in cells_.items()} for load, cells_ in out["loads"].items()}
    _plot(ctx, out)
    return out


def _one(ctx: Any, llm: Any, r: Any, load: int, cell: str, xargs: dict[str, Any]) -> dict[str, Any]:
    """The task's problems through the engine with ``load`` of them in flight (closed loop)."""
    from vllm import SamplingParams

    task = r.task
    sched = scheduler(llm)
    side = sched.kvcompact  # None: stock vLLM

    def counts() -> tuple[int, int, int | None]:
        if side is None:
            return 0, 0, None
        totals = side.metrics.totals
        return totals.rounds, totals.pressure_rounds, totals.uncompressed_requests

    before = counts()
    tag = f"{cell}-{load}-"
    requests = [(f"{tag}{n}", r.ids[item.id], SamplingParams(temperature=0, max_tokens=item.max_tokens,
                                                            extra_args=dict(xargs) or None))
                for n, item in enumerate(task.items)]
    queue = list(requests[load:])
    peak = [0]

    def on_step(_i: int, _dt: float) -> None:
        peak[0] = max(peak[0], len(sched.running))
        while queue and len(sched.requests) < load:
            rid, prompt, params = queue.pop(0)
            llm.llm_engine.add_request(rid, {"prompt_token_ids": prompt}, params)

    res = drive(llm, requests[:load], on_step=on_step, desc=f"{cell} x{load}")
    tokens = {item.id: res["tokens"].get(f"{tag}{n}", []) for n, item in enumerate(task.items)}
    texts = {k: r.tok.decode(v, skip_special_tokens=True) for k, v in tokens.items()}
    after = counts()
    rounds, pressure_rounds = after[0] - before[0], after[1] - before[1]
    uncompressed = None if after[2] is None or before[2] is None else after[2] - before[2]
    return {"wall_s": res["wall_s"], "generated": sum(len(v) for v in tokens.values()),
            "preemptions": res["preemptions"], "peak_running": peak[0], "tokens": tokens, "texts": texts,
            "correct_by_item": {item.id: task.grade(item, texts[item.id])[0] for item in task.items},
            "rounds": rounds, "pressure_rounds": pressure_rounds, "uncompressed": uncompressed}


def _per_min(r: dict[str, Any]) -> float:
    return sum(r["correct_by_item"].values()) / (r["wall_s"] / 60)


def _summary(task: ev.Task, r: dict[str, Any], at_load: dict[str, dict[str, Any]], budget: int) -> dict[str, Any]:
    """One cell at one load, against that load's stock vLLM run (accuracy paired on the same problems, speed
    ratios) and fixed-budget run; ``same_tokens_as_admission``: the cell generated exactly what full attention
    did on the same engine (pressure at a light load should never compress)."""
    stock, fixed, admission = at_load["stock"], at_load[f"fixed@{budget}"], at_load["admission"]
    s = ev.summarize(task, "", r["texts"], r["tokens"], {}, {
        i.id: (stock["correct_by_item"][i.id], task.grade(i, stock["texts"][i.id])[1]) for i in task.items})
    tok_s = r["generated"] / r["wall_s"]
    return {"accuracy": s["accuracy"], "ci95": s["ci95"], "correct": s["correct"], "n": s["n"],
            "paired_vs_stock": s["paired"], "agreement_with_stock": s["agreement"], "wall_s": r["wall_s"],
            "tokens_per_s": tok_s, "tokens_per_s_x_stock": ratio(tok_s, stock["generated"] / stock["wall_s"]),
            "answers_per_min": _per_min(r), "answers_per_min_x_stock": ratio(_per_min(r), _per_min(stock)),
            "answers_per_min_x_fixed": ratio(_per_min(r), _per_min(fixed)), "preemptions": r["preemptions"],
            "peak_running": r["peak_running"], "rounds": r["rounds"], "pressure_rounds": r["pressure_rounds"],
            "uncompressed": r["uncompressed"], "same_tokens_as_admission": r["tokens"] == admission["tokens"]}


def _line(load: int, cell: str, r: dict[str, Any]) -> str:
    k = sum(r["correct_by_item"].values())
    return (f"x{load:<3d} {cell:28s} {k:3d}/{len(r['correct_by_item'])} correct in {r['wall_s']:.0f} s "
            f"({k / (r['wall_s'] / 60):.2f}/min), {r['generated'] / r['wall_s']:.1f} tok/s, {r['preemptions']} "
            f"preemptions, {r['rounds']} rounds ({r['pressure_rounds']} pressure), "
            f"{'-' if r['uncompressed'] is None else r['uncompressed']} never compressed, "
            f"peak {r['peak_running']} running")


def _plot(ctx: Any, out: dict[str, Any]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (acc, speed) = plt.subplots(1, 2, figsize=(10, 4.2))
    loads = [int(x) for x in out["loads"]]
    cells = list(next(iter(out["loads"].values())))
    for cell in cells:
        rows = [out["loads"][str(n)][cell] for n in loads]
        label = {"stock": "stock vLLM", "admission": "+ admission (full attention)"}.get(cell, f"+ compression: {cell}")
        marker = "*" if cell == "stock" else "o"
        acc.errorbar(loads, [r["accuracy"] for r in rows], marker=marker, capsize=3, label=label,
                     yerr=[[max(0.0, r["accuracy"] - r["ci95"][0]) for r in rows],
                           [max(0.0, r["ci95"][1] - r["accuracy"]) for r in rows]])
        speed.plot(loads, [r["answers_per_min"] for r in rows], marker=marker, label=label)
    s = out["setup"]
    for ax, label in ((acc, "accuracy (95% Wilson CI)"), (speed, "correct answers per minute")):
        ax.set_xscale("log", base=2)
        ax.set_xticks(loads, [str(n) for n in loads])
        ax.set_xlabel("requests in flight")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    speed.legend(fontsize=7)
    fig.suptitle(f"{Path(s['model']).name}, {s['policy']}: pool of {s['pool_requests']} full requests "
                 f"({s['pool_blocks']} blocks), {s['problems']} problems, budget / floor {s['budget']}", fontsize=8)
    fig.tight_layout()
    ctx.savefig(fig)
