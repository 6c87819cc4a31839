"""Memory: "evict 90%, free nothing" replayed on vLLM's own block pool.

One long greedy generation (bundled model, bf16, ignore_eos) at a budget that evicts about 90% of the tokens,
in one in-process engine: full attention (the request switches compression off) together with compaction
``none`` (tokens counted as evicted, nothing moves: the bolt-on baseline) in one batch, then ``repack``, then
``holefill`` (the compaction mode is switched between requests).
After every engine step the scheduler is read directly: blocks the request holds and ``kv_cache_usage``
(what ``vllm:kv_cache_usage_perc`` exports). Headline: reclaim efficiency = blocks freed x block size / tokens
evicted (1.0 is the physical limit, ``none`` must be ~0) and steady-state blocks held vs full attention.
"""

from __future__ import annotations

import math
from typing import Any

from kvcompact.tools.bench import FIXED_ROUNDS
from kvcompact.tools.local_engine import drive, greedy, scheduler, set_compaction, tokenizer

MODES = ("full", "none", "repack", "holefill")


def add_arguments(p: Any) -> None:
    p.add_argument("--tokens", type=int, default=None, help="generated tokens (default 4096, quick 224)")
    p.add_argument("--budget", type=int, default=None, help="tokens kept per KV head (default 384, quick 32)")
    p.add_argument("--window", type=int, default=None, help="recent window (default 128, quick 8)")
    p.add_argument("--block-size", type=int, default=None, help="KV block size (CPU_ATTN needs a multiple of 32)")
    p.add_argument("--prompt-tokens", type=int, default=32)
    p.add_argument("--divide-length", type=int, default=None, help="tokens per round (default 128, quick 32)")
    p.add_argument("--dtype", default=None, help="model dtype (default: the one that scales on this CPU)")
    p.add_argument("--modes", default="full,none,repack,holefill",
                   help="subset to run (full and none hold the same blocks; each mode's numbers stand alone)")
    p.add_argument("--policy", default=None, help="default: triattention if its stats are ready, else streaming")
    p.add_argument("--calibrate", action="store_true", help="make the TriAttention stats if missing")


def run(ctx: Any) -> dict[str, Any]:
    a = ctx.args
    tokens = a.tokens or (224 if ctx.quick else 4096)
    budget = a.budget or (32 if ctx.quick else 384)
    divide = a.divide_length or (32 if ctx.quick else 128)
    window = a.window if a.window is not None else (8 if ctx.quick else 128)
    bs = a.block_size or 32
    policy, stats_path, why = ctx.scoring_policy(a.policy)
    ctx.notes.append(f"policy: {why}")
    from kvcompact.tools.corpus import eval_text

    tok = tokenizer()
    prompt = tok(eval_text().read_text()[:20000])["input_ids"][: a.prompt_tokens]
    total = len(prompt) + tokens
    num_blocks = 2 * math.ceil(total / bs) + 8  # full + none run together
    cfg = {**FIXED_ROUNDS, "policy": policy, "budget": budget, "window": window, "divide_length": divide,
           "compaction": "repack"}
    if stats_path:
        cfg["stats_path"] = stats_path
    runs: dict[str, Any] = {}
    with ctx.engine(cfg, dtype=a.dtype, block_size=bs, num_blocks=num_blocks, max_model_len=total + 64,
                    max_num_seqs=2) as llm:
        sched = scheduler(llm)
        side = sched.kvcompact
        manager = side.manager
        # full attention and compaction "none" hold the same blocks step for step (nothing is freed), so they
        # run together in one batch; repack and holefill each run alone.
        groups = (("none", ("full", "none")), ("repack", ("repack",)), ("holefill", ("holefill",)))
        wanted = set(a.modes.split(","))
        groups = tuple((e, tuple(m for m in ms if m in wanted)) for e, ms in groups if wanted & set(ms))
        for engine_mode, modes in groups:
            set_compaction(llm, engine_mode)
            before = _totals(side.metrics.totals)
            samples: dict[str, list[tuple[int, int, float]]] = {m: [] for m in modes}
            usable = side.block_pool.num_gpu_blocks - 1

            def on_step(_i: int, _dt: float, modes: tuple = modes, samples: dict = samples) -> None:
                pool_usage = float(sched.kv_cache_manager.usage)
                # vLLM appends a random suffix to the request id it was given: match on the prefix
                internal = {r.request_id.rsplit("-", 1)[0]: r for r in sched.requests.values()}
                for m in modes:
                    req = internal.get(f"mem-{m}")
                    if req is None:
                        continue
                    held = len(manager.req_to_blocks.get(req.request_id, []))
                    # alone in the pool, vllm:kv_cache_usage_perc = held / usable (block 0 is reserved)
                    usage = pool_usage if len(modes) == 1 else held / usable  # noqa: B023 - called in this pass
                    samples[m].append((len(req.output_token_ids), held, usage))

            reqs = [(f"mem-{m}", prompt, greedy(tokens, extra_args={"kvcompact": "off"}) if m == "full"
                     else greedy(tokens)) for m in modes]
            out = drive(llm, reqs, on_step=on_step, desc=f"memory {'+'.join(modes)}")
            after = _totals(side.metrics.totals)
            delta = {k: after[k] - before[k] for k in after}
            free_after = side.block_pool.get_num_free_blocks()
            for m in modes:
                runs[m] = {"samples": samples[m], "totals": delta if m != "full" else {k: 0 for k in delta},
                           "tokens": out["tokens"][f"mem-{m}"], "wall_s": out["wall_s"],
                           "free_blocks_after": free_after, "pool_blocks": side.block_pool.num_gpu_blocks,
                           "batched_with": [x for x in modes if x != m]}
    return _report(ctx, runs, policy=policy, budget=budget, window=window, divide_length=divide, bs=bs, tokens=tokens,
                   prompt_len=len(prompt))


def _totals(t: Any) -> dict[str, int]:
    return {"rounds": t.rounds, "tokens_evicted": t.tokens_evicted, "blocks_freed": t.blocks_freed,
            "tokens_moved": t.tokens_moved, "bytes_moved": t.bytes_moved}


def _report(ctx: Any, runs: dict[str, Any], **setup: Any) -> dict[str, Any]:
    from kvcompact.tools.bench import median, ratio

    bs = setup["bs"]
    # without a full-attention run, compaction "none" holds exactly the blocks full attention holds
    full = runs.get("full") or runs.get("none")
    full_final = max(b for _, b, _ in full["samples"]) if full and full["samples"] else None
    logical = setup["prompt_len"] + setup["tokens"]
    per_mode: dict[str, Any] = {}
    for mode, r in runs.items():
        s = r["samples"]
        tail = [b for g, b, _ in s if g >= 0.75 * setup["tokens"]]
        t = r["totals"]
        eff = ratio(t["blocks_freed"] * bs, t["tokens_evicted"]) if t["tokens_evicted"] else None
        steady = max(tail) if tail else None
        per_mode[mode] = {
            "rounds": t["rounds"], "tokens_evicted": t["tokens_evicted"], "blocks_freed": t["blocks_freed"],
            "tokens_moved": t["tokens_moved"], "bytes_moved": t["bytes_moved"],
            "evicted_share": t["tokens_evicted"] / logical,
            "reclaim_efficiency": eff,
            "blocks_held_final": s[-1][1] if s else None,
            "blocks_held_steady_max": steady,
            "blocks_held_steady_median": median(tail),
            "kv_usage_final": s[-1][2] if s else None,
            "kv_usage_peak": max(u for _, _, u in s) if s else None,
            "memory_reduction_vs_full": ratio(full_final, steady),
            "pool_entirely_free_after": r["free_blocks_after"] == r["pool_blocks"] - 1,
            "first_token_divergence_vs_full": _first_divergence(full["tokens"], r["tokens"]) if full else None,
            "wall_s": r["wall_s"], "batched_with": r["batched_with"],
        }
    _plot(ctx, runs, setup, full_final)
    headline = {
        "policy": setup["policy"], "budget": setup["budget"], "block_size": bs,
        "generated_tokens": setup["tokens"], "logical_len": logical,
        "full_blocks_held_final": full_final,
        **{f"{m}_reclaim_efficiency": per_mode[m]["reclaim_efficiency"] for m in per_mode if m != "full"},
        **{f"{m}_blocks_held_steady": per_mode[m]["blocks_held_steady_max"] for m in per_mode if m != "full"},
        **{f"{m}_memory_reduction": per_mode[m]["memory_reduction_vs_full"] for m in per_mode if m != "full"},
        "evicted_share": next((v["evicted_share"] for m, v in per_mode.items() if m != "full"), None),
    }
    for m, v in per_mode.items():
        ctx.log(f"{m:9s} rounds {v['rounds']:3d} evicted {v['tokens_evicted']:6d} freed {v['blocks_freed']:4d} "
                f"eff {v['reclaim_efficiency']} steady blocks {v['blocks_held_steady_max']} "
                f"(full {full_final}) usage peak {v['kv_usage_peak']}")
    return {"setup": setup, "headline": headline, "modes": per_mode,
            "series": {m: r["samples"] for m, r in runs.items()}}


def _first_divergence(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None


def _plot(ctx: Any, runs: dict[str, Any], setup: dict[str, Any], full_final: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.8))
    styles = {"full": ("k", "-"), "none": ("tab:red", "--"), "repack": ("tab:blue", "-"),
              "holefill": ("tab:green", ":")}
    labels = {"full": "full attention", "none": "evict, compaction=none", "repack": "evict + repack",
              "holefill": "evict + holefill"}
    for mode, r in runs.items():
        g = [x[0] for x in r["samples"]]
        c, ls = styles[mode]
        ax1.plot(g, [x[1] for x in r["samples"]], color=c, linestyle=ls, label=labels[mode], lw=1.6)
        ax2.plot(g, [100 * x[2] for x in r["samples"]], color=c, linestyle=ls, label=labels[mode], lw=1.6)
    ax1.set_xlabel("generated tokens")
    ax1.set_ylabel(f"KV blocks held by the request (block = {setup['bs']} tokens)")
    ax2.set_xlabel("generated tokens")
    ax2.set_ylabel("vllm:kv_cache_usage_perc (%)")
    ax1.set_title(f"{setup['policy']}, budget {setup['budget']}, round every {setup['divide_length']} tokens",
                  fontsize=10)
    ax2.set_title("vLLM pool occupancy", fontsize=10)
    for ax in (ax1, ax2):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    ctx.savefig(fig)
