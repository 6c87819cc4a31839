"""Throughput at a fixed pool: stock vLLM vs kvcompact's admission vs compression at two budgets.

Part A: N concurrent long greedy generations (ignore_eos) in a KV pool that holds only about two of them at full
length. Cells, read as an ablation (stock -> + admission -> + compression): ``stock`` (vLLM with kvcompact
installed and not configured: greedy admission, preemption by recompute; its own engine at the same pool),
``admission`` (kvcompact configured with ``--admission``, every request ``{"kvcompact": "off"}``: full attention,
no eviction) and ``budget B`` for each budget (a per-request override); the last two share one kvcompact engine
per ``--kv-cache-dtypes`` entry (an fp8 pool holds as many bytes as the model-dtype one; stock vLLM runs in the
model dtype only). Per cell: generated tokens/s, requests/s, preemptions, peak concurrency, median and last
completion time, and the blocks held over time. Every repetition starts each engine afresh (a warm-up request
first) and runs its cells with vLLM's prefix cache on (its default) and emptied between cells; engines and
cells run in the reverse order every other repetition. Medians are reported, and the ratios ``x_stock`` (to stock
vLLM) and ``x_admission`` (to the admission cell of the same KV dtype) as the median and range of per-repetition
ratios.

Part B: the ceiling: stock vLLM's tokens/s at concurrency 1..16 in a pool large enough for all of them (a
second engine), so a reader sees how much concurrency the machine turns into throughput in this dtype.
"""

from __future__ import annotations

import math
from typing import Any

from kvcompact.tools.bench import FIXED_ROUNDS
from kvcompact.tools.cli import UsageError
from kvcompact.tools.local_engine import drive, forget_prefixes, greedy, scheduler, tokenizer, warm_up


def add_arguments(p: Any) -> None:
    p.add_argument("--requests", type=int, default=None, help="concurrent requests (default 16, quick 4)")
    p.add_argument("--tokens", type=int, default=None, help="tokens per request (default 2048, quick 160)")
    p.add_argument("--prompt-tokens", type=int, default=32,
                   help="prompt tokens per request (a long prompt is compressed during its prefill)")
    p.add_argument("--budgets", default=None, help="two budgets (default 128,256; quick 48,96)")
    p.add_argument("--window", type=int, default=None, help="recent window (default 64, quick 16)")
    p.add_argument("--pool-sequences", type=float, default=2.0,
                   help="pool size in full-length sequences (default 2.0)")
    p.add_argument("--reps", type=int, default=None, help="repetitions of part A (default 2, quick 1)")
    p.add_argument("--divide-length", type=int, default=None, help="tokens per round (default 128, quick 32)")
    p.add_argument("--admission", default="guaranteed", choices=("guaranteed", "greedy"))
    p.add_argument("--kv-cache-dtypes", default="auto",
                   help="KV cache dtypes to compare at the same pool size in bytes, e.g. auto,fp8 (default auto: the "
                        "model dtype); each gets its own engine")
    p.add_argument("--sweep", default=None, help="part B concurrencies (default 1,2,4,8,16; quick 1,2,4)")
    p.add_argument("--sweep-tokens", type=int, default=None, help="part B tokens per request (default 256)")
    p.add_argument("--block-size", type=int, default=32)
    p.add_argument("--dtype", default=None, help="model dtype (default: the one that scales on this CPU)")
    p.add_argument("--policy", default=None, help="default: triattention if its stats are ready, else streaming")
    p.add_argument("--calibrate", action="store_true", help="make the TriAttention stats if missing")


def run(ctx: Any) -> dict[str, Any]:
    from kvcompact.tools.bench import median, paired_ratio, times
    from kvcompact.tools.corpus import eval_text

    a = ctx.args
    n_req = a.requests or (4 if ctx.quick else 16)
    tokens = a.tokens or (160 if ctx.quick else 2048)
    budgets = [int(b) for b in (a.budgets or ("48,96" if ctx.quick else "128,256")).split(",")]
    window = a.window if a.window is not None else (16 if ctx.quick else 64)
    divide = a.divide_length or (32 if ctx.quick else 128)
    reps = a.reps or (1 if ctx.quick else 2)
    sweep = [int(c) for c in (a.sweep or ("1,2,4" if ctx.quick else "1,2,4,8,16")).split(",")]
    sweep_tokens = a.sweep_tokens or (64 if ctx.quick else 256)
    bs = a.block_size
    policy, stats_path, why = ctx.scoring_policy(a.policy)
    ctx.notes.append(f"policy: {why}")
    text = tokenizer()(eval_text().read_text()[:40000])["input_ids"]
    prompt_len, n_prompts = a.prompt_tokens, max(n_req, max(sweep))
    longest = len(text) - 97 * n_prompts  # prompt i starts at token 97 * i
    if not 0 < prompt_len <= longest:
        raise UsageError(f"--prompt-tokens: 1 .. {longest} on this corpus", command="bench throughput")
    prompts = [text[i * 97: i * 97 + prompt_len] for i in range(n_prompts)]
    seq_blocks = math.ceil((prompt_len + tokens) / bs)
    pool = int(a.pool_sequences * seq_blocks) + 1
    cfg = {"policy": policy, "budget": budgets[0], "window": window, "divide_length": divide,
           "compaction": "repack", "admission": a.admission, **FIXED_ROUNDS}
    if stats_path:
        cfg["stats_path"] = stats_path
    kv_dtypes = ["auto"] + [k for k in a.kv_cache_dtypes.split(",") if k != "auto"]  # the baseline first
    if any(not k.startswith("fp8") for k in kv_dtypes[1:]):
        raise UsageError("--kv-cache-dtypes: auto and fp8 / fp8_e4m3 / fp8_e5m2 only", command="bench throughput")
    from kvcompact.kv_bytes import kv_bytes_per_token
    from kvcompact.tools.model import ensure_default_model

    model_dir, dtype = ensure_default_model(), a.dtype or ctx.engine_dtype
    configs: list[str] = ["stock"]
    admission_of: dict[str, str] = {}  # cell -> the admission cell of its KV dtype (the x_admission denominator)
    runs: list[dict[str, Any]] = []
    timelines: dict[str, list[tuple[float, int, int]]] = {}
    kv_pools = {}
    # (kvcompact config or None for stock vLLM, KV dtype, pool in blocks, cells)
    engines: list[tuple[dict[str, Any] | None, str, int, list[tuple[str, dict]]]] = [(None, "auto", pool,
                                                                                      [("stock", {})])]
    for kvd in kv_dtypes:
        prefix = "" if kvd == "auto" else f"{kvd} "
        # the same pool in bytes: an fp8 block is smaller than a block in the model dtype
        ratio_kv = kv_bytes_per_token(model_dir, dtype) // kv_bytes_per_token(model_dir, dtype, kvd)
        kv_pools[kvd] = (pool - 1) * ratio_kv + 1
        group = [(f"{prefix}admission", {"kvcompact": "off"})] + [(f"{prefix}budget {b}", {"kvcompact_budget": b})
                                                                   for b in budgets]
        configs += [name for name, _ in group]
        admission_of.update({name: f"{prefix}admission" for name, _ in group})
        engines.append((cfg, kvd, kv_pools[kvd], group))
    for rep in range(reps):
        for kvc, kvd, kv_pool, group in engines if rep % 2 == 0 else engines[::-1]:
            _part_a(ctx, kvc, kvd, kv_pool, group if rep % 2 == 0 else group[::-1], prompts[:n_req], tokens,
                    prompt_len, rep, runs, timelines)
    pressure: dict[str, Any] = {}
    by_config = {name: sorted((r for r in runs if r["config"] == name), key=lambda r: r["rep"]) for name in configs}
    for name in configs:
        rs = by_config[name]
        pressure[name] = {k: median(r[k] for r in rs) for k in (
            "tokens_per_s", "requests_per_s", "preemptions", "peak_running", "peak_blocks", "completion_s_median",
            "completion_s_last", "wall_s")}
        for k in ("tokens_per_s", "requests_per_s"):
            pressure[name][f"{k}_x_stock"] = paired_ratio((r[k] for r in rs), (r[k] for r in by_config["stock"]))
            if name in admission_of:
                pressure[name][f"{k}_x_admission"] = paired_ratio((r[k] for r in rs),
                                                                  (r[k] for r in by_config[admission_of[name]]))
        ctx.log(f"{name:16s} {times(pressure[name]['tokens_per_s_x_stock'])} stock tokens/s, "
                f"{pressure[name]['preemptions']:.0f} preemptions, peak {pressure[name]['peak_running']:.0f} running")
    ctx.checkpoint({"runs": runs, "pressure": pressure})
    return _part_b_and_report(ctx, a, prompts, prompt_len, sweep, sweep_tokens, bs, pressure, timelines, runs,
                              dict(requests=n_req, tokens=tokens, budgets=budgets, window=window, divide_length=divide,
                                   pool_blocks=pool, kv_pools=kv_pools, prefix_caching=True,
                                   blocks_per_full_sequence=seq_blocks, reps=reps, policy=policy))


def _part_a(ctx: Any, cfg: dict[str, Any] | None, kv_dtype: str, pool: int, configs: list[tuple[str, dict]],
            prompts: list[list[int]], tokens: int, prompt_len: int, rep: int, runs: list[dict[str, Any]],
            timelines: dict[str, list[tuple[float, int, int]]]) -> None:
    """One fresh engine (``cfg`` None: stock vLLM) with a ``pool``-block KV cache of ``kv_dtype``: repetition
    ``rep`` of each of its configurations, in the order given."""
    from kvcompact.tools.bench import median

    a = ctx.args
    n_req = len(prompts)
    extra = {} if kv_dtype == "auto" else {"kv_cache_dtype": kv_dtype}
    with ctx.engine(cfg, dtype=a.dtype, block_size=a.block_size, num_blocks=pool,
                    max_model_len=prompt_len + tokens + 64, max_num_seqs=n_req, enable_prefix_caching=True,
                    **extra) as llm:
        sched = scheduler(llm)
        kvm = sched.kv_cache_manager
        warm_up(llm, prompts[0])
        for name, xargs in configs:
            forget_prefixes(llm)
            reqs = [(f"tp-{rep}-{name}-{i}", p, greedy(tokens, extra_args=dict(xargs) or None))
                    for i, p in enumerate(prompts[:n_req])]
            line: list[tuple[float, int, int]] = []
            elapsed = [0.0]

            def on_step(_i: int, dt: float, line: list = line, elapsed: list = elapsed) -> None:
                elapsed[0] += dt
                held = kvm.block_pool.num_gpu_blocks - 1 - kvm.block_pool.get_num_free_blocks()
                line.append((elapsed[0], len(sched.running), held))

            out = drive(llm, reqs, on_step=on_step, desc=f"throughput {name} rep {rep}")
            gen = sum(len(t) for t in out["tokens"].values())
            finish = sorted(out["finish_s"].values())
            runs.append({"config": name, "rep": rep, "wall_s": out["wall_s"], "generated": gen,
                         "tokens_per_s": gen / out["wall_s"], "requests_per_s": n_req / out["wall_s"],
                         "preemptions": out["preemptions"], "peak_running": max(r for _, r, _ in line),
                         "peak_blocks": max(h for _, _, h in line),
                         "completion_s_median": median(finish), "completion_s_last": finish[-1],
                         "steps": len(out["step_s"])})
            timelines.setdefault(name, line)
            ctx.log(f"{name:16s} rep {rep}: {gen / out['wall_s']:.1f} tok/s, {out['preemptions']} preemptions, "
                    f"peak {runs[-1]['peak_running']} running, last done {finish[-1]:.1f} s")


def _part_b_and_report(ctx: Any, a: Any, prompts: list[list[int]], prompt_len: int,
                       sweep: list[int], sweep_tokens: int, bs: int, pressure: dict[str, Any],
                       timelines: dict[str, list], runs: list[dict[str, Any]], setup: dict[str, Any]) -> dict:
    # Part B: stock vLLM's ceiling at each concurrency, in a pool that holds them all.
    ceiling: dict[int, float] = {}
    sweep_blocks = max(sweep) * math.ceil((prompt_len + sweep_tokens) / bs) + 1
    with ctx.engine(None, dtype=a.dtype, block_size=bs, num_blocks=sweep_blocks,
                    max_model_len=prompt_len + sweep_tokens + 64, max_num_seqs=max(sweep),
                    enable_prefix_caching=True) as llm:
        warm_up(llm, prompts[0])
        for c in sweep:
            forget_prefixes(llm)
            out = drive(llm, [(f"sweep-{c}-{i}", prompts[i], greedy(sweep_tokens)) for i in range(c)],
                            desc=f"concurrency {c}")
            ceiling[c] = sum(len(t) for t in out["tokens"].values()) / out["wall_s"]
            ctx.log(f"stock vLLM, {c} concurrent, pool fits all: {ceiling[c]:.1f} tok/s")
    setup.update(prompt_len=prompt_len, admission=a.admission, block_size=bs, dtype=a.dtype or ctx.engine_dtype,
                 sweep_tokens=sweep_tokens)
    _plot(ctx, pressure, timelines, ceiling, setup)
    headline = {"pressure": {k: {kk: _rounded(vv) for kk, vv in v.items()} for k, v in pressure.items()},
                "stock_tokens_per_s_by_concurrency": {str(c): round(v, 2) for c, v in ceiling.items()}}
    return {"setup": setup, "headline": headline, "runs": runs, "timelines": timelines}


def _rounded(v: Any) -> Any:
    if isinstance(v, dict):
        return {k: _rounded(x) for k, x in v.items()}
    return round(v, 3) if isinstance(v, float) else v


def _plot(ctx: Any, pressure: dict[str, Any], timelines: dict[str, list], ceiling: dict[int, float],
          setup: dict[str, Any]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    from kvcompact.tools.bench import times

    fig, (ax1, ax2, ax3) = plt.subplots(1, 3, figsize=(15, 4))
    names = list(pressure)
    colors = dict(zip(names, ["k", "tab:gray", "tab:blue", "tab:green", "tab:purple", "tab:orange", "tab:red",
                              "tab:brown", "tab:pink", "tab:olive"]))
    x = np.arange(len(names))
    bars = ax1.bar(x, [pressure[n]["tokens_per_s"] for n in names], color=[colors[n] for n in names], width=0.6)
    for b, n in zip(bars, names):
        p = pressure[n]
        ax1.annotate(f"{p['preemptions']:.0f} preempt., peak {p['peak_running']:.0f} running\n"
                     f"{times(p['tokens_per_s_x_stock'])} stock",
                     (b.get_x() + b.get_width() / 2, b.get_height()), ha="center", va="bottom",
                     fontsize=7 if len(names) <= 3 else 5)
    ax1.set_xticks(x, names, rotation=20, ha="right")
    ax1.set_ylabel("generated tokens/s (all requests)")
    ax1.set_title(f"{setup['requests']} x ({setup['prompt_len']} prompt + {setup['tokens']}) tokens, pool "
                  f"{setup['pool_blocks']} blocks "
                  f"(~{setup['pool_blocks'] / setup['blocks_per_full_sequence']:.1f} full sequences), "
                  f"{setup['dtype']}", fontsize=9)
    ax1.margins(y=0.3)
    ax1.grid(axis="y", alpha=0.3)
    for n, line in timelines.items():
        ax2.plot([t for t, _, _ in line], [h for _, _, h in line], "-", color=colors[n], label=n)
    ax2.axhline(setup["pool_blocks"] - 1, color="gray", ls=":", label="usable blocks")
    ax2.set_xlabel("seconds since the run started (first repetition)")
    ax2.set_ylabel("KV blocks held")
    ax2.set_title("blocks held over time", fontsize=9)
    ax2.legend(fontsize=8)
    ax2.grid(alpha=0.3)
    cs = sorted(ceiling)
    ax3.plot(cs, [ceiling[c] for c in cs], "o-k", label=f"stock vLLM, pool fits all ({setup['sweep_tokens']} tok)")
    for n in names[1:]:
        ax3.axhline(pressure[n]["tokens_per_s"], color=colors[n], ls="--", label=f"{n} (part A)")
    ax3.axhline(pressure["stock"]["tokens_per_s"], color="k", ls=":", label="stock vLLM (part A, small pool)")
    ax3.set_xscale("log", base=2)
    ax3.set_xlabel("concurrent requests")
    ax3.set_ylabel("generated tokens/s")
    ax3.set_title("the ceiling: what concurrency buys on this machine", fontsize=9)
    ax3.legend(fontsize=7)
    ax3.grid(alpha=0.3)
    fig.tight_layout()
    ctx.savefig(fig)
