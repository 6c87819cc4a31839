"""Throughput at a fixed pool: full attention vs compression at two budgets, side by side in one engine.

Part A: N concurrent long greedy generations (ignore_eos) in a KV pool that holds only about two of them at full
length. Full attention runs out of blocks and vLLM preempts (frees a request's blocks and later re-prefills
it); compressed requests hold a bounded number of blocks. Per configuration: generated tokens/s, preemptions,
median and last completion time. Configurations run one after the other in the same engine (the budget is a
per-request override, full attention is ``"kvcompact": "off"``), repeated and interleaved, medians reported.

Part B: one long sequence, decode step time with the full cache vs the compressed cache at the same logical
length (second engine with a pool large enough for the full sequence).
"""

from __future__ import annotations

import math
from typing import Any


def add_arguments(p: Any) -> None:
    p.add_argument("--requests", type=int, default=None, help="concurrent requests (default 8, quick 4)")
    p.add_argument("--tokens", type=int, default=None, help="tokens per request (default 1024, quick 160)")
    p.add_argument("--budgets", default=None, help="two budgets (default 256,512; quick 48,96)")
    p.add_argument("--window", type=int, default=None, help="recent window (default 128, quick 16)")
    p.add_argument("--pool-sequences", type=float, default=2.0,
                   help="pool size in full-length sequences (default 2.0)")
    p.add_argument("--reps", type=int, default=None, help="repetitions of part A (default 2, quick 1)")
    p.add_argument("--long-tokens", type=int, default=None, help="part B length (default 3072, quick 192)")
    p.add_argument("--divide-length", type=int, default=None, help="tokens per round (default 128, quick 32)")
    p.add_argument("--block-size", type=int, default=32)
    p.add_argument("--dtype", default=None, help="model dtype (default: the one that scales on this CPU)")
    p.add_argument("--policy", default=None, help="default: triattention if its stats are ready, else streaming")
    p.add_argument("--calibrate", action="store_true", help="make the TriAttention stats if missing")


def run(ctx: Any) -> dict[str, Any]:
    from kvcompact.bench import median, ratio
    from kvcompact.corpus import eval_text

    a = ctx.args
    n_req = a.requests or (4 if ctx.quick else 8)
    tokens = a.tokens or (160 if ctx.quick else 1024)
    budgets = [int(b) for b in (a.budgets or ("48,96" if ctx.quick else "256,512")).split(",")]
    window = a.window if a.window is not None else (16 if ctx.quick else 128)
    divide = a.divide_length or (32 if ctx.quick else 128)
    reps = a.reps or (1 if ctx.quick else 2)
    long_tokens = a.long_tokens or (192 if ctx.quick else 3072)
    bs = a.block_size
    policy, stats_path, why = ctx.scoring_policy(a.policy)
    ctx.notes.append(f"policy: {why}")
    text = ctx.tokenizer()(eval_text().read_text()[:40000])["input_ids"]
    prompt_len = 32
    prompts = [text[i * 97: i * 97 + prompt_len] for i in range(n_req)]
    seq_blocks = math.ceil((prompt_len + tokens) / bs)
    pool = int(a.pool_sequences * seq_blocks) + 1
    cfg = {"policy": policy, "budget": budgets[0], "window": window, "divide_length": divide,
           "compaction": "repack"}
    if stats_path:
        cfg["stats_path"] = stats_path
    configs = [("full", {"kvcompact": "off"})] + [(f"budget {b}", {"kvcompact_budget": b}) for b in budgets]

    runs: list[dict[str, Any]] = []
    with ctx.engine(cfg, dtype=a.dtype, block_size=bs, num_blocks=pool, max_model_len=prompt_len + tokens + 64,
                    max_num_seqs=n_req) as llm:
        ctx.drive(llm, [("warm", prompts[0], ctx.greedy(16))], desc="warm-up")
        for rep in range(reps):
            order = configs if rep % 2 == 0 else configs[::-1]
            for name, xargs in order:
                reqs = [(f"tp-{rep}-{name}-{i}", p, ctx.greedy(tokens, extra_args=dict(xargs)))
                        for i, p in enumerate(prompts)]
                out = ctx.drive(llm, reqs, desc=f"throughput {name} rep {rep}")
                gen = sum(len(t) for t in out["tokens"].values())
                finish = sorted(out["finish_s"].values())
                runs.append({"config": name, "rep": rep, "wall_s": out["wall_s"], "generated": gen,
                             "tokens_per_s": gen / out["wall_s"], "preemptions": out["preemptions"],
                             "completion_s_median": median(finish), "completion_s_last": finish[-1],
                             "steps": len(out["step_s"])})
                ctx.log(f"{name:12s} rep {rep}: {gen / out['wall_s']:.1f} tok/s, {out['preemptions']} preemptions, "
                        f"last done {finish[-1]:.1f} s")
    pressure: dict[str, Any] = {}
    for name, _ in configs:
        rs = [r for r in runs if r["config"] == name]
        pressure[name] = {k: median(r[k] for r in rs) for k in ("tokens_per_s", "preemptions",
                                                                 "completion_s_median", "completion_s_last",
                                                                 "wall_s")}
    for name, _ in configs[1:]:
        pressure[name]["tokens_per_s_vs_full"] = ratio(pressure[name]["tokens_per_s"], pressure["full"]["tokens_per_s"])
        pressure[name]["completion_last_vs_full"] = ratio(pressure[name]["completion_s_last"],
                                                          pressure["full"]["completion_s_last"])

    ctx.checkpoint({"runs": runs, "pressure": pressure})

    # Part B: decode step time at the same logical length, full vs compressed.
    long_prompt = text[:prompt_len]
    long_blocks = math.ceil((prompt_len + long_tokens) / bs) + 4
    series: dict[str, list[tuple[int, float]]] = {}
    with ctx.engine(cfg, dtype=a.dtype, block_size=bs, num_blocks=long_blocks,
                    max_model_len=prompt_len + long_tokens + 64, max_num_seqs=1) as llm:
        ctx.drive(llm, [("warm", long_prompt, ctx.greedy(16))], desc="warm-up")
        for name, xargs in (("full", {"kvcompact": "off"}), (f"budget {budgets[0]}", {"kvcompact_budget": budgets[0]})):
            rid = f"long-{name}"
            pts: list[tuple[int, float]] = []

            def on_step(i: int, dt: float, pts: list = pts) -> None:
                if i > 0:  # step 0 is the prefill; decode step i feeds the token at position prompt_len + i - 1
                    pts.append((prompt_len + i - 1, dt))

            ctx.drive(llm, [(rid, long_prompt, ctx.greedy(long_tokens, extra_args=dict(xargs)))],
                      on_step=on_step, desc=f"decode step {name}")
            series[name] = pts
    full_name, comp_name = "full", f"budget {budgets[0]}"
    lo = prompt_len + 0.75 * long_tokens
    full_tail = [dt for L, dt in series[full_name] if L >= lo]
    comp_tail = [dt for L, dt in series[comp_name] if L >= lo]
    decode = {"logical_len_from": int(lo), "logical_len_to": prompt_len + long_tokens,
              "full_step_ms_median": 1e3 * (median(full_tail) or 0),
              "compressed_step_ms_median": 1e3 * (median(comp_tail) or 0),
              "compressed_budget": budgets[0]}
    decode["step_time_ratio_compressed_over_full"] = ratio(decode["compressed_step_ms_median"],
                                                           decode["full_step_ms_median"])
    ctx.log(f"decode step at logical {int(lo)}..{prompt_len + long_tokens}: "
            f"full {decode['full_step_ms_median']:.1f} ms, "
            f"budget {budgets[0]} {decode['compressed_step_ms_median']:.1f} ms")
    setup = {"requests": n_req, "tokens": tokens, "prompt_len": prompt_len, "budgets": budgets, "window": window,
             "divide_length": divide,
             "pool_blocks": pool, "block_size": bs, "blocks_per_full_sequence": seq_blocks, "reps": reps,
             "policy": policy, "dtype": a.dtype or ctx.engine_dtype, "long_tokens": long_tokens}
    _plot(ctx, pressure, series, setup)
    headline = {"pressure": {k: {kk: (round(vv, 3) if isinstance(vv, float) else vv) for kk, vv in v.items()}
                             for k, v in pressure.items()}, "decode_step": decode}
    return {"setup": setup, "headline": headline, "runs": runs, "decode_series": series}


def _plot(ctx: Any, pressure: dict[str, Any], series: dict[str, list], setup: dict[str, Any]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    names = list(pressure)
    x = np.arange(len(names))
    colors = ["k", "tab:blue", "tab:green", "tab:orange"][: len(names)]
    bars = ax1.bar(x, [pressure[n]["tokens_per_s"] for n in names], color=colors, width=0.6)
    for b, n in zip(bars, names):
        ax1.annotate(f"{pressure[n]['preemptions']:.0f} preempt.\nlast done {pressure[n]['completion_s_last']:.0f} s",
                     (b.get_x() + b.get_width() / 2, b.get_height()), ha="center", va="bottom", fontsize=7)
    ax1.set_xticks(x, names)
    ax1.set_ylabel("generated tokens/s (all requests)")
    ax1.set_xlabel("configuration")
    ax1.set_title(f"{setup['requests']} x {setup['tokens']} tokens, pool {setup['pool_blocks']} blocks "
                  f"(~{setup['pool_blocks'] / setup['blocks_per_full_sequence']:.1f} full sequences)", fontsize=9)
    ax1.margins(y=0.25)
    ax1.grid(axis="y", alpha=0.3)
    for (name, pts), c in zip(series.items(), ["k", "tab:blue"]):
        if not pts:
            continue
        L = np.array([p[0] for p in pts])
        dt = np.array([p[1] for p in pts]) * 1e3
        w = 33
        smooth = np.array([np.median(dt[max(0, i - w): i + 1]) for i in range(len(dt))])
        ax2.plot(L, dt, ".", color=c, alpha=0.15, markersize=2)
        ax2.plot(L, smooth, "-", color=c, label=f"{name} (running median of {w} steps)")
    ax2.set_xlabel("logical sequence length (tokens)")
    ax2.set_ylabel("decode step time (ms)")
    ax2.set_title("single sequence decode step", fontsize=9)
    ax2.legend(fontsize=8)
    ax2.grid(alpha=0.3)
    ymax = max((np.percentile([p[1] for p in pts], 98) * 1e3 for pts in series.values() if pts), default=None)
    if ymax:
        ax2.set_ylim(0, ymax * 1.2)
    fig.tight_layout()
    ctx.savefig(fig)
