"""Overhead: where a compaction round spends its time, repack vs holefill, against the decode step.

One in-process engine (bundled model, bf16). For each budget, a prompt of ``budget + 64`` tokens of the
Britannica text and a greedy generation long enough for R rounds (one per 128 decoded tokens), once with
``repack`` and once with ``holefill`` (switched between requests in the same engine, so both see the same
machine load). The worker's own functions are timed in place (this process holds the worker):
gather (reading the keys out of the paged cache), scoring (the policy), selection (``select_keep``),
planning (``plan_moves``) and moving (``move_layers``), plus the tokens and bytes each round moves.
The decode step time of the same run is the median of the steps without a round.
"""

from __future__ import annotations

import time
from typing import Any

from kvcompact.config import MOVE_MODES
from kvcompact.tools.bench import FIXED_ROUNDS
from kvcompact.tools.local_engine import drive, greedy, set_compaction, tokenizer, worker_side


def add_arguments(p: Any) -> None:
    p.add_argument("--budgets", default=None, help="comma list (default 256,512,1024,2048; quick 256,512,1024)")
    p.add_argument("--rounds", type=int, default=None, help="rounds per run (default 6, quick 3)")
    p.add_argument("--divide-length", type=int, default=None, help="tokens per round (default 128, quick 32)")
    p.add_argument("--block-size", type=int, default=32)
    p.add_argument("--policy", default=None, help="default: triattention if its stats are ready, else streaming")
    p.add_argument("--calibrate", action="store_true", help="make the TriAttention stats if missing")


class _Timers:
    """Wraps the worker's steps; one record per round (one request per round here)."""

    def __init__(self, modules: dict[str, Any], worker: Any) -> None:
        self.mods = modules  # function name -> the module whose global the worker calls it through
        self.worker = worker
        self.records: list[dict[str, float]] = []
        self.cur: dict[str, float] | None = None
        self.round_in_step = False
        self._saved: dict[str, Any] = {}

    def _timed(self, key: str, fn: Any) -> Any:
        def f(*a: Any, **k: Any) -> Any:
            t0 = time.perf_counter()
            out = fn(*a, **k)
            if self.cur is not None:
                self.cur[key] = self.cur.get(key, 0.0) + time.perf_counter() - t0
                if key == "plan_s":
                    self.cur["moves"] = self.cur.get("moves", 0) + out.num_moves
            return out
        return f

    def install(self) -> None:
        for name, key in (("select_keep", "select_s"), ("plan_moves", "plan_s"), ("move_layers", "move_s")):
            self._saved[name] = getattr(self.mods[name], name)
            setattr(self.mods[name], name, self._timed(key, self._saved[name]))
        w = self.worker
        w.core.policy.score = self._timed("score_s", w.core.policy.score)
        run_rounds = w._execute

        def rounds(commands: Any) -> Any:
            self.cur = {"cache_len": float(commands[0].cache_len), "kept_len": float(commands[0].kept_len)}
            t0 = time.perf_counter()
            try:
                return run_rounds(commands)
            finally:
                self.cur["total_s"] = time.perf_counter() - t0
                self.records.append(self.cur)
                self.cur = None
                self.round_in_step = True
        w._execute = rounds

    def uninstall(self) -> None:
        for name, fn in self._saved.items():
            setattr(self.mods[name], name, fn)
        self.worker.__dict__.pop("_execute", None)
        self.worker.core.policy.__dict__.pop("score", None)


def run(ctx: Any) -> dict[str, Any]:
    import kvcompact.round as core_module
    import kvcompact.vllm.paged_kv as kv_module
    from kvcompact.tools.corpus import eval_text

    a = ctx.args
    budgets = [int(b) for b in (a.budgets or ("256,512,1024" if ctx.quick else "256,512,1024,2048")).split(",")]
    rounds = a.rounds or (3 if ctx.quick else 6)
    divide = a.divide_length or (32 if ctx.quick else 128)
    bs = a.block_size
    policy, stats_path, why = ctx.scoring_policy(a.policy)
    ctx.notes.append(f"policy: {why}")
    text_ids = tokenizer()(eval_text().read_text()[:60000])["input_ids"]
    longest = max(budgets) + 64 + divide * rounds + 32
    cfg = {**FIXED_ROUNDS, "policy": policy, "budget": max(budgets), "divide_length": divide, "compaction": "repack"}
    if stats_path:
        cfg["stats_path"] = stats_path
    rows: list[dict[str, Any]] = []
    with ctx.engine(cfg, block_size=bs, num_blocks=longest // bs + 16, max_model_len=longest + 64,
                    max_num_seqs=1) as llm:
        # warm-up: one short run so first-call costs (allocations, kernel setup) stay out of the table; the
        # worker side is built on the first step
        drive(llm, [("warm", text_ids[:256 + divide // 2],
                         greedy(divide + 8, extra_args={"kvcompact_budget": 256}))], desc="warm-up")
        worker = worker_side(llm)
        elsize = worker.kv.caches[0].element_size()
        head_dim = worker.kv.layout.head_dim
        timers = _Timers({"select_keep": core_module, "plan_moves": core_module, "move_layers": kv_module},
                         worker)
        timers.install()
        try:
            for budget in budgets:
                prompt = text_ids[: budget + divide // 2]
                n = divide // 2 + divide * (rounds - 1) + 8
                for mode in MOVE_MODES:
                    set_compaction(llm, mode)
                    first = len(timers.records)
                    plain: list[float] = []
                    with_round: list[float] = []

                    def on_step(i: int, dt: float) -> None:
                        if i == 0:
                            return  # the prefill step
                        (with_round if timers.round_in_step else plain).append(dt)  # noqa: B023 - this pass
                        timers.round_in_step = False

                    timers.round_in_step = False
                    drive(llm, [(f"ovh-{budget}-{mode}", prompt,
                                     greedy(n, extra_args={"kvcompact_budget": budget}))],
                              on_step=on_step, desc=f"overhead b={budget} {mode}")
                    for rec in timers.records[first:]:
                        rows.append(_row(rec, budget, mode, plain, with_round, head_dim, elsize))
        finally:
            timers.uninstall()
    return _report(ctx, rows, budgets=budgets, rounds=rounds, divide_length=divide, policy=policy, block_size=bs)


def _row(rec: dict[str, float], budget: int, mode: str, plain: list[float], with_round: list[float],
         head_dim: int, elsize: int) -> dict[str, Any]:
    from kvcompact.tools.bench import median

    parts = ("score_s", "select_s", "plan_s", "move_s")
    gather = rec["total_s"] - sum(rec.get(k, 0.0) for k in parts)
    moves = int(rec.get("moves", 0))
    return {"budget": budget, "mode": mode, "cache_len": int(rec["cache_len"]), "kept_len": int(rec["kept_len"]),
            "total_ms": 1e3 * rec["total_s"], "gather_ms": 1e3 * gather,
            "scoring_ms": 1e3 * rec.get("score_s", 0.0), "selection_ms": 1e3 * rec.get("select_s", 0.0),
            "plan_ms": 1e3 * rec.get("plan_s", 0.0), "move_ms": 1e3 * rec.get("move_s", 0.0),
            "tokens_moved": moves, "bytes_moved": moves * 2 * head_dim * elsize,
            "decode_step_ms_median": 1e3 * (median(plain) or 0.0),
            "round_step_ms_median": 1e3 * (median(with_round) or 0.0)}


def _report(ctx: Any, rows: list[dict[str, Any]], **setup: Any) -> dict[str, Any]:
    from kvcompact.tools.bench import median, ratio

    table: list[dict[str, Any]] = []
    for budget in setup["budgets"]:
        for mode in MOVE_MODES:
            rs = [r for r in rows if r["budget"] == budget and r["mode"] == mode]
            if not rs:
                continue
            m = {k: median(r[k] for r in rs) for k in ("total_ms", "gather_ms", "scoring_ms", "selection_ms",
                                                        "plan_ms", "move_ms", "tokens_moved", "bytes_moved")}
            step = rs[0]["decode_step_ms_median"]
            m.update(budget=budget, mode=mode, rounds=len(rs), decode_step_ms=step,
                     round_step_ms=rs[0]["round_step_ms_median"],
                     round_vs_step=ratio(m["total_ms"], step),
                     # one round per divide_length decoded tokens: its cost spread over those steps
                     amortized_share=(ratio(m["total_ms"], m["total_ms"] + setup["divide_length"] * step)
                                      if step else None))
            table.append(m)
            ctx.log(f"b={budget:5d} {mode:8s} round {m['total_ms']:7.1f} ms (gather {m['gather_ms']:.1f}, score "
                    f"{m['scoring_ms']:.1f}, select {m['selection_ms']:.1f}, plan {m['plan_ms']:.1f}, move "
                    f"{m['move_ms']:.1f}) moved {m['bytes_moved'] / 1e6:.2f} MB; decode step {step:.1f} ms; "
                    f"amortized {100 * (m['amortized_share'] or 0):.2f}%")
    headline = {f"b{r['budget']}_{r['mode']}": {k: (round(r[k], 3) if isinstance(r[k], float) else r[k])
                                                 for k in ("total_ms", "scoring_ms", "selection_ms", "move_ms",
                                                           "bytes_moved", "decode_step_ms", "amortized_share")}
                for r in table}
    for budget in setup["budgets"]:
        rp = next((r for r in table if r["budget"] == budget and r["mode"] == "repack"), None)
        hf = next((r for r in table if r["budget"] == budget and r["mode"] == "holefill"), None)
        if rp and hf:
            headline[f"b{budget}_bytes_repack_over_holefill"] = ratio(rp["bytes_moved"], hf["bytes_moved"])
            headline[f"b{budget}_move_ms_repack_over_holefill"] = ratio(rp["move_ms"], hf["move_ms"])
    _plot(ctx, table, setup)
    return {"setup": setup, "headline": headline, "table": table, "rounds": rows}


def _plot(ctx: Any, table: list[dict[str, Any]], setup: dict[str, Any]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    parts = [("gather_ms", "gather keys"), ("scoring_ms", "scoring"), ("selection_ms", "selection"),
             ("plan_ms", "plan moves"), ("move_ms", "move K/V")]
    colors = ["tab:gray", "tab:orange", "tab:purple", "tab:olive", "tab:blue"]
    labels = [f"{r['budget']}\n{r['mode']}" for r in table]
    x = np.arange(len(table))
    bottom = np.zeros(len(table))
    for (key, name), c in zip(parts, colors):
        vals = np.array([r[key] for r in table])
        ax1.bar(x, vals, bottom=bottom, color=c, label=name, width=0.7)
        bottom += vals
    ax1.plot(x, [r["decode_step_ms"] for r in table], "k_", markersize=22, mew=2,
             label="decode step (median, no round)")
    ax1.set_xticks(x, labels, fontsize=7)
    ax1.set_xlabel("budget (tokens per KV head) / compaction")
    ax1.set_ylabel("ms per round (median)")
    ax1.set_title(f"round cost by phase ({setup['policy']})", fontsize=10)
    ax1.legend(fontsize=7)
    ax1.grid(axis="y", alpha=0.3)
    for mode, c in (("repack", "tab:blue"), ("holefill", "tab:green")):
        rs = [r for r in table if r["mode"] == mode]
        ax2.plot([r["budget"] for r in rs], [r["bytes_moved"] / 1e6 for r in rs], "o-", color=c,
                 label=f"{mode}: bytes moved")
    ax2.set_xscale("log", base=2)
    ax2.set_xlabel("budget (tokens per KV head)")
    ax2.set_ylabel("MB moved per round (K+V, all layers and heads)")
    ax2.set_title("data moved per round", fontsize=10)
    ax2.legend(fontsize=8)
    ax2.grid(alpha=0.3)
    fig.tight_layout()
    ctx.savefig(fig)
