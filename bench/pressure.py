"""Budget mode pressure against full attention and a fixed budget, with the load swept at a fixed pool.

The reasoning task's problems (``kvcompact.tools.evaluation``, report seed) in a KV pool that holds ``--pool-requests``
full-length requests (prompt + ``--max-tokens``), guaranteed admission. For each load N in ``--loads`` (requests
in flight: a closed loop that adds the next problem whenever one finishes), one engine runs every cell on the same
problems one after another (the order alternates between loads): full attention, the fixed budget B, and budget
mode pressure with floor B. Per cell: accuracy with its Wilson interval, correct answers per minute, tokens/s,
preemptions, rounds, pressure rounds and the requests that never compressed. Goals: at light load pressure matches full
attention's accuracy and speed; at heavy load it matches or beats the fixed budget's answers per minute with
accuracy >= the fixed budget's. The plot: accuracy and correct answers per minute against load, one line per cell.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kvcompact.tools import evaluation as ev
from kvcompact.tools.bench import ratio


def _answers() -> Any:
    from kvcompact.tools.bench import load_benchmark

    return load_benchmark("answers")  # the fixed-pool setup both benchmarks share


def add_arguments(p: Any) -> None:
    _answers().add_pool_arguments(p)
    p.add_argument("--policy", default=None, help="default triattention when statistics exist (quick: streaming)")
    p.add_argument("--budget", type=int, default=None, help="fixed budget and pressure floor B (default 256, quick 64)")
    p.add_argument("--loads", default=None, help="requests in flight, comma list (default 4,16; quick 1,4)")


def run(ctx: Any) -> dict[str, Any]:
    a = ctx.args
    r = _answers().pool_run(ctx)
    model, stats, tok, task, ids, block, max_len, pool = (r.model, r.stats, r.tok, r.task, r.ids, r.block,
                                                          r.max_len, r.pool)
    policy = a.policy or ("streaming" if ctx.quick or stats is None else "triattention")
    if policy == "triattention" and stats is None:
        raise SystemExit("kvcompact bench pressure: triattention needs statistics for this model (--stats)")
    budget = a.budget or (64 if ctx.quick else 256)
    loads = [int(n) for n in (a.loads or ("1,4" if ctx.quick else "4,16")).split(",")]
    setup = {**r.setup(a, ctx), "policy": policy, "budget": budget, "loads": loads}
    cells: list[tuple[str, dict[str, Any]]] = [("full", {"kvcompact": "off"}),
                                                (f"fixed@{budget}", {"kvcompact_budget_mode": "fixed"}),
                                                (f"pressure@{budget}", {"kvcompact_budget_mode": "pressure"})]
    cfg = {"policy": policy, "budget": budget, "divide_length": a.divide_length, "window": a.window,
           "n_sink": a.n_sink, "compaction": "repack", "admission": "guaranteed", "budget_mode": "pressure"}
    if policy == "triattention":
        cfg["stats_path"] = stats
    results: dict[str, dict[str, Any]] = {}
    with ctx.engine(cfg, model=model, block_size=block, num_blocks=pool, max_model_len=max_len,
                    max_num_seqs=max(loads)) as llm:
        for n, load in enumerate(loads):
            results[str(load)] = {}
            for cell, xargs in cells if n % 2 == 0 else cells[::-1]:
                r = _one(ctx, llm, tok, task, ids, load, cell, xargs)
                results[str(load)][cell] = r
                ctx.log(_line(load, cell, r))
            ctx.checkpoint({"setup": setup, "results": results})
    out: dict[str, Any] = {"setup": setup, "loads": {}}
    for load, by_cell in results.items():
        full, fixed = by_cell["full"], by_cell[f"fixed@{budget}"]
        out["loads"][load] = {cell: _summary(task, r, full, fixed) for cell, r in by_cell.items()}
    out["headline"] = {f"{load} in flight": {c: {k: v[k] for k in ("accuracy", "answers_per_min",
                                                                  "answers_per_min_vs_fixed", "preemptions",
                                                                  "pressure_rounds", "uncompressed")}
                                              for c, v in cells_.items()} for load, cells_ in out["loads"].items()}
    _plot(ctx, out)
    return out


def _one(ctx: Any, llm: Any, tok: Any, task: ev.Task, ids: dict[str, list[int]], load: int, cell: str,
         xargs: dict[str, Any]) -> dict[str, Any]:
    """The task's problems through the engine with ``load`` of them in flight (closed loop)."""
    from vllm import SamplingParams

    sched = ctx.scheduler(llm)
    totals = sched.kvcompact.metrics.totals
    before = (totals.rounds, totals.pressure_rounds, totals.uncompressed_requests)
    tag = f"{cell}-{load}-"
    requests = [(f"{tag}{n}", ids[item.id], SamplingParams(temperature=0, max_tokens=item.max_tokens,
                                                          extra_args=dict(xargs)))
                for n, item in enumerate(task.items)]
    queue = list(requests[load:])
    peak = [0]

    def on_step(_i: int, _dt: float) -> None:
        peak[0] = max(peak[0], len(sched.running))
        while queue and len(sched.requests) < load:
            rid, prompt, params = queue.pop(0)
            llm.llm_engine.add_request(rid, {"prompt_token_ids": prompt}, params)

    res = ctx.drive(llm, requests[:load], on_step=on_step, desc=f"{cell} x{load}")
    tokens = {item.id: res["tokens"].get(f"{tag}{n}", []) for n, item in enumerate(task.items)}
    texts = {k: tok.decode(v, skip_special_tokens=True) for k, v in tokens.items()}
    return {"wall_s": res["wall_s"], "generated": sum(len(v) for v in tokens.values()),
            "preemptions": res["preemptions"], "peak_running": peak[0], "tokens": tokens, "texts": texts,
            "correct_by_item": {item.id: task.grade(item, texts[item.id])[0] for item in task.items},
            "rounds": totals.rounds - before[0], "pressure_rounds": totals.pressure_rounds - before[1],
            "uncompressed": totals.uncompressed_requests - before[2]}


def _summary(task: ev.Task, r: dict[str, Any], full: dict[str, Any], fixed: dict[str, Any]) -> dict[str, Any]:
    s = ev.summarize(task, "", r["texts"], r["tokens"], {}, {
        i.id: (full["correct_by_item"][i.id], task.grade(i, full["texts"][i.id])[1]) for i in task.items})
    per_min = s["correct"] / (r["wall_s"] / 60)
    fixed_per_min = sum(fixed["correct_by_item"].values()) / (fixed["wall_s"] / 60)
    return {"accuracy": s["accuracy"], "ci95": s["ci95"], "correct": s["correct"], "n": s["n"],
            "paired_vs_full": s["paired"], "agreement_with_full": s["agreement"], "wall_s": r["wall_s"],
            "tokens_per_s": r["generated"] / r["wall_s"], "answers_per_min": per_min,
            "answers_per_min_vs_fixed": ratio(per_min, fixed_per_min), "preemptions": r["preemptions"],
            "peak_running": r["peak_running"], "rounds": r["rounds"], "pressure_rounds": r["pressure_rounds"],
            "uncompressed": r["uncompressed"], "same_tokens_as_full": r["tokens"] == full["tokens"]}


def _line(load: int, cell: str, r: dict[str, Any]) -> str:
    k = sum(r["correct_by_item"].values())
    return (f"x{load:<3d} {cell:28s} {k:3d}/{len(r['correct_by_item'])} correct in {r['wall_s']:.0f} s "
            f"({k / (r['wall_s'] / 60):.2f}/min), {r['generated'] / r['wall_s']:.1f} tok/s, {r['preemptions']} "
            f"preemptions, {r['rounds']} rounds ({r['pressure_rounds']} pressure), {r['uncompressed']} never "
            f"compressed, peak {r['peak_running']} running")


def _plot(ctx: Any, out: dict[str, Any]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (acc, speed) = plt.subplots(1, 2, figsize=(10, 4.2))
    loads = [int(x) for x in out["loads"]]
    cells = list(next(iter(out["loads"].values())))
    for cell in cells:
        rows = [out["loads"][str(n)][cell] for n in loads]
        acc.errorbar(loads, [r["accuracy"] for r in rows], marker="o", capsize=3, label=cell,
                     yerr=[[max(0.0, r["accuracy"] - r["ci95"][0]) for r in rows],
                           [max(0.0, r["ci95"][1] - r["accuracy"]) for r in rows]])
        speed.plot(loads, [r["answers_per_min"] for r in rows], marker="o", label=cell)
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
