"""Issue 45's checks of kvcompact inside GPU vLLM, on the lent GPU machine once install_on_device.sh is done.

    python3 scripts/gpu/device_checks.py --out $OUT             # the checks (about 7 minutes on an H100)
    python3 scripts/gpu/device_checks.py --dry-run              # the plan: every engine, its settings, time

What runs: vLLM's V1 runner (VLLM_USE_V2_MODEL_RUNNER=0; kvcompact refuses Model Runner V2 on a GPU), in-process
engines on the Qwen3-8B-shaped dummy model (device_common.py; token-id prompts, skip_tokenizer_init), bf16, block
size 16. For each compile mode (eager first, then CUDA graphs: vLLM's default compilation) and each attention
backend (FLASH_ATTN, TRITON_ATTN), three engines on the same requests and pool:

- stock: kvcompact's plugin not loaded (VLLM_PLUGINS=""), in a process of its own;
- passive: the plugin loaded, not configured; must equal stock token for token (greedy);
- kvcompact: configured (TriAttention, random statistics); must run rounds and free blocks (read from the
  scheduler's kvcompact counters), fail none, generate every token, and equal stock until its first round.

After the eager engines, a capacity figure on one small pool (``num_gpu_blocks_override``): more long requests
than stock can hold, stock against kvcompact: peak running requests, preemptions, generated tokens/s.

Each engine's result is appended to ``engines.jsonl`` as it finishes (a crash keeps what ran before it); the
verdicts go to ``checks.json`` and the output, one line per check. Exit 0 when every check passed.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from device_common import BLOCK_SIZE, DEST, TOKENIZER, model_config, run_env, tokenizer_vocab  # noqa: E402

BACKENDS = ("FLASH_ATTN", "TRITON_ATTN")
MODES = ("eager", "graphs")
# The checks' requests: prompts of several lengths (the last longer than the trigger: compressed in prefill),
# every request decoding MAX_TOKENS; budget 256 + divide_length 64 puts the first round at 320 cached tokens.
PROMPT_LENS = (64, 160, 300, 420)
MAX_TOKENS = 384
KVCOMPACT = {"budget": 256, "divide_length": 64, "policy": "triattention", "budget_mode": "fixed",
             "protect_prompt": False}
CHECK_BLOCKS = 1024
# The capacity figure: CAPACITY_REQUESTS requests of CAPACITY_PROMPT + CAPACITY_TOKENS in a pool that holds
# CAPACITY_POOL_REQUESTS of them at full length; kvcompact's guaranteed admission fits 4 at its 320-token peak.
CAPACITY_REQUESTS, CAPACITY_PROMPT, CAPACITY_TOKENS, CAPACITY_POOL_REQUESTS = 6, 128, 512, 2
CAPACITY_KVCOMPACT = {"budget": 256, "divide_length": 64, "policy": "triattention", "budget_mode": "fixed",
                      "protect_prompt": False}
# Time estimates for the plan, guesses until a first run replaces them (H100, 8B dummy, in-process engines): a
# process's start and imports, an engine's build, its first CUDA-graph build in a process (torch.compile and
# capture), later ones (vLLM's compile cache), a decode step.
EST = {"process": 20.0, "eager": 15.0, "graphs_first": 75.0, "graphs": 30.0, "step_eager": 0.020,
       "step_graphs": 0.008}
DEVICE_CALL_S = 600
DEADLINE_S = 540  # the checks stop here and still write their verdicts, inside one device call


def blocks_for(tokens: int) -> int:
    return -(-tokens // BLOCK_SIZE)


def prompts(lens: tuple[int, ...], vocab: int, seed: int) -> list[list[int]]:
    """Token ids above the tokenizer's special ids (0-16 for the bundled one), the same in every process."""
    rng = random.Random(seed)
    return [[rng.randrange(17, vocab) for _ in range(n)] for n in lens]


def engine_kwargs(model: Path, backend: str, mode: str, blocks: int, max_model_len: int,
                  max_num_seqs: int) -> dict[str, Any]:
    """vLLM's LLM arguments: the same for stock, passive and kvcompact, which is configured through its
    ``KVCOMPACT_*`` variables instead (:func:`kvcompact_env`), so that all three share one compiled graph (vLLM's
    compile cache is keyed by a hash that covers ``additional_config`` but not the environment)."""
    return {"model": str(model), "load_format": "dummy", "dtype": "bfloat16", "block_size": BLOCK_SIZE,
            "max_model_len": max_model_len, "num_gpu_blocks_override": blocks, "max_num_seqs": max_num_seqs,
            "enforce_eager": mode == "eager", "attention_backend": backend, "seed": 0,
            "enable_prefix_caching": False, "disable_hybrid_kv_cache_manager": True, "skip_tokenizer_init": True,
            # in-process engines run one after another in a process; each must start beside what the last left
            "gpu_memory_utilization": 0.5}


def kvcompact_env(config: dict[str, Any] | None) -> dict[str, str]:
    return {} if config is None else {f"KVCOMPACT_{k.upper()}": str(v) for k, v in config.items()}


def plan(args: argparse.Namespace, vocab: int, stats: Path, model: Path) -> list[dict[str, Any]]:
    """Every engine run, in order, with the process it runs in and its estimated seconds."""
    check_prompts = prompts(PROMPT_LENS, vocab, seed=1)
    cap_prompts = prompts((CAPACITY_PROMPT,) * CAPACITY_REQUESTS, vocab, seed=2)
    kvc = dict(KVCOMPACT, stats_path=str(stats))
    cap_kvc = dict(CAPACITY_KVCOMPACT, stats_path=str(stats))
    runs: list[dict[str, Any]] = []
    for mode in args.modes:
        for backend in args.backends:
            for role, config in (("stock", None), ("passive", None), ("kvcompact", kvc)):
                runs.append({"id": f"{mode}/{backend}/{role}", "process": "stock" if role == "stock" else "plugin",
                             "role": role, "mode": mode, "backend": backend, "prompts": check_prompts,
                             "max_tokens": MAX_TOKENS, "env": kvcompact_env(config),
                             "engine": engine_kwargs(model, backend, mode, CHECK_BLOCKS, 2048, 16)})
        if args.capacity and mode == args.capacity_mode:  # before the next mode: it must not be the one cut off
            pool = CAPACITY_POOL_REQUESTS * blocks_for(CAPACITY_PROMPT + CAPACITY_TOKENS)
            for role, config in (("stock", None), ("kvcompact", cap_kvc)):
                runs.append({"id": f"capacity/{mode}/FLASH_ATTN/{role}",
                             "process": "stock" if role == "stock" else "plugin",
                             "role": f"capacity-{role}", "mode": mode, "backend": "FLASH_ATTN",
                             "prompts": cap_prompts, "max_tokens": CAPACITY_TOKENS, "env": kvcompact_env(config),
                             "engine": engine_kwargs(model, "FLASH_ATTN", mode, pool, 2048, CAPACITY_REQUESTS)})
    compiled: set[str] = set()  # vLLM's compile cache is on disk: shared by both processes
    for run in runs:
        build = EST["eager"]
        if run["mode"] == "graphs":
            build = EST["graphs"] if run["backend"] in compiled else EST["graphs_first"]
            compiled.add(run["backend"])
        steps = run["max_tokens"]
        if run["role"] == "capacity-stock":  # stock holds CAPACITY_POOL_REQUESTS at a time
            steps = run["max_tokens"] * -(-CAPACITY_REQUESTS // CAPACITY_POOL_REQUESTS)
        run["estimate_s"] = round(build + steps * EST[f"step_{run['mode']}"])
    return runs


# ------------------------------------------------------------------------------------------------ child
def run_engine(run: dict[str, Any]) -> dict[str, Any]:
    """One engine: build it, drive its requests by hand (recording the running requests after every step), read
    kvcompact's counters, shut it down."""
    import torch
    from vllm import LLM

    from kvcompact.tools.local_engine import drive, greedy, scheduler

    os.environ.update(run["env"])  # read once, when the engine is built
    started = time.monotonic()
    try:
        llm = LLM(**run["engine"])
    finally:
        for k in run["env"]:
            del os.environ[k]
    built = time.monotonic() - started
    try:
        sched = scheduler(llm)
        peak = {"running": 0, "waiting": 0, "running_sum": 0, "steps": 0}

        def on_step(_: int, __: float) -> None:
            peak["running"] = max(peak["running"], len(sched.running))
            peak["waiting"] = max(peak["waiting"], len(sched.waiting))
            peak["running_sum"] += len(sched.running)
            peak["steps"] += 1

        params = greedy(run["max_tokens"], detokenize=False)
        out = drive(llm, [(f"r{i}", ids, params) for i, ids in enumerate(run["prompts"])], on_step=on_step,
                    desc=run["id"])
        side = getattr(sched, "kvcompact", None)
        totals = side.metrics.totals if side is not None else None
        generated = sum(len(t) for t in out["tokens"].values())
        return {"id": run["id"], "ok": True, "build_s": round(built, 1), "wall_s": round(out["wall_s"], 2),
                "tokens": {k: out["tokens"][k] for k in sorted(out["tokens"])}, "generated": generated,
                "tokens_per_s": round(generated / out["wall_s"], 1), "preemptions": out["preemptions"],
                "peak_running": peak["running"], "peak_waiting": peak["waiting"],
                "mean_running": round(peak["running_sum"] / max(1, peak["steps"]), 2), "steps": peak["steps"],
                "counters": None if totals is None else {
                    k: getattr(totals, k) for k in ("rounds", "tokens_evicted", "blocks_freed", "scoring_failures",
                                                    "compaction_failures", "pressure_rounds", "finished_requests")}}
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()
        torch.cuda.empty_cache()


def child(process: str, plan_path: Path, results: Path) -> int:
    """Run this process's engines in plan order, appending each result (or its error) as it ends."""
    import traceback

    runs = [r for r in json.loads(plan_path.read_text()) if r["process"] == process]
    for run in runs:
        try:
            result = run_engine(run)
        except Exception as e:
            result = {"id": run["id"], "ok": False, "error": f"{type(e).__name__}: {e}",
                      "traceback": traceback.format_exc()[-4000:]}
        with results.open("a") as f:
            f.write(json.dumps(result) + "\n")
        print(f"{run['id']}: {'ok' if result['ok'] else 'FAILED ' + result['error']}", flush=True)
    return 0


# ------------------------------------------------------------------------------------------------ verdicts
def verdicts(runs: list[dict[str, Any]], results: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """One verdict per check, from the engines' results (a missing or failed engine fails its checks)."""
    checks: list[dict[str, Any]] = []

    def check(name: str, ok: bool, **info: Any) -> None:
        checks.append({"check": name, "ok": bool(ok), **info})

    trigger = KVCOMPACT["budget"] + KVCOMPACT["divide_length"]
    for run in runs:
        r = results.get(run["id"])
        if r is None or not r["ok"]:
            check(f"{run['id']} ran", False, error=None if r is None else r["error"])
            continue
        mode, backend = run["mode"], run["backend"]
        stock = results.get(f"{mode}/{backend}/stock")
        if run["role"] == "passive":
            same = stock is not None and stock["ok"] and stock["tokens"] == r["tokens"]
            check(f"{mode}/{backend}: passive == stock token for token", same)
        elif run["role"] == "kvcompact":
            c = r["counters"] or {}
            check(f"{mode}/{backend}: kvcompact ran rounds and freed blocks",
                  c.get("rounds", 0) > 0 and c.get("blocks_freed", 0) > 0, **c)
            check(f"{mode}/{backend}: no scoring or compaction failures",
                  c.get("scoring_failures", 1) == 0 and c.get("compaction_failures", 1) == 0)
            check(f"{mode}/{backend}: every token generated",
                  r["generated"] == run["max_tokens"] * len(run["prompts"]), generated=r["generated"])
            if stock is not None and stock["ok"]:
                # before a request's first round its cache is full attention: the same tokens as stock
                diverged = [rid for i, (rid, toks) in enumerate(sorted(r["tokens"].items()))
                            if toks[:max(0, trigger - PROMPT_LENS[i] - 1)]
                            != stock["tokens"][rid][:max(0, trigger - PROMPT_LENS[i] - 1)]]
                check(f"{mode}/{backend}: kvcompact == stock until its first round", not diverged,
                      diverged=diverged)
    cap = {run["role"]: results.get(run["id"]) for run in runs if run["role"].startswith("capacity")}
    if cap.get("capacity-stock") and cap.get("capacity-kvcompact") and all(v["ok"] for v in cap.values() if v):
        s, k = cap["capacity-stock"], cap["capacity-kvcompact"]
        # vLLM admits greedily and preempts when the pool runs out, so stock's peak is not what it holds: its
        # mean over steps is, beside the preemptions that churn costs
        shown = ("mean_running", "peak_running", "preemptions", "tokens_per_s", "wall_s", "steps")
        check("capacity: kvcompact runs more requests at once than stock on the same pool, without preempting",
              k["mean_running"] > s["mean_running"] and k["preemptions"] == 0,
              stock={x: s[x] for x in shown}, kvcompact={x: k[x] for x in shown},
              tokens_per_s_ratio=round(k["tokens_per_s"] / s["tokens_per_s"], 3),
              counters=k["counters"])
    return checks


# ------------------------------------------------------------------------------------------------ main
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=DEST / "checks", help="results folder ($OUT on the machine)")
    p.add_argument("--dry-run", action="store_true", help="print the plan and exit: no vLLM, no torch")
    p.add_argument("--backends", type=lambda s: s.split(","), default=list(BACKENDS))
    p.add_argument("--modes", type=lambda s: s.split(","), default=list(MODES))
    p.add_argument("--no-capacity", dest="capacity", action="store_false")
    p.add_argument("--capacity-mode", choices=MODES, default="eager",
                   help="the capacity pair's compile mode (eager: it does not depend on CUDA graphs working)")
    p.add_argument("--deadline-s", type=float, default=DEADLINE_S,
                   help="stop the engines after this many seconds; what did not run fails as not run")
    p.add_argument("--child", choices=("stock", "plugin"), help=argparse.SUPPRESS)
    p.add_argument("--plan", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--results", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        return child(args.child, args.plan, args.results)

    work = DEST / "work"
    model, stats = work / "qwen3-8b-dummy", work / "triattention-random.pt"
    vocab = tokenizer_vocab(TOKENIZER) if (TOKENIZER / "tokenizer.json").exists() else 49152
    runs = plan(args, vocab, stats, model)
    total = sum(r["estimate_s"] for r in runs) + 2 * EST["process"]
    print(f"model {model}: {json.dumps(model_config(vocab))}")
    print(f"kvcompact: {json.dumps(dict(KVCOMPACT, stats_path=str(stats)))} (capacity: "
          f"{json.dumps(CAPACITY_KVCOMPACT)})")
    for process, extra in (("stock", {"VLLM_PLUGINS": ""}), ("plugin", {})):
        env = {k: v for k, v in run_env(VLLM_ENABLE_V1_MULTIPROCESSING="0", **extra).items()
               if k.startswith(("VLLM_", "PYTHONPATH", "HF_"))}
        print(f"process {process}: {' '.join(f'{k}={v!r}' for k, v in sorted(env.items()))} "
              f"{sys.executable} {Path(__file__).name} --child {process}")
    for r in runs:
        e = r["engine"]
        print(f"  [{r['process']:6s}] {r['id']:38s} ~{r['estimate_s']:4d} s  "
              f"{' '.join(f'{k}={v}' for k, v in r['env'].items()) or '(no KVCOMPACT_*)'} "
              f"LLM(enforce_eager={e['enforce_eager']}, attention_backend={e['attention_backend']}, "
              f"num_gpu_blocks_override={e['num_gpu_blocks_override']}, max_num_seqs={e['max_num_seqs']}) "
              f"{len(r['prompts'])} prompts of {sorted({len(x) for x in r['prompts']})} tokens, "
              f"{r['max_tokens']} new each")
    print(f"estimated {total:.0f} s (deadline {args.deadline_s:.0f} s, a device call {DEVICE_CALL_S} s)")
    if args.dry_run:
        return 0

    from device_common import write_model, write_stats

    args.out.mkdir(parents=True, exist_ok=True)
    write_model(model)
    write_stats(stats)
    plan_path, results_path = args.out / "plan.json", args.out / "engines.jsonl"
    plan_path.write_text(json.dumps(runs))
    results_path.unlink(missing_ok=True)
    deadline = time.monotonic() + args.deadline_s
    for process, extra in (("stock", {"VLLM_PLUGINS": ""}), ("plugin", {})):
        if not any(r["process"] == process for r in runs):
            continue
        try:
            subprocess.run([sys.executable, __file__, "--child", process, "--plan", str(plan_path), "--results",
                            str(results_path)], env=run_env(VLLM_ENABLE_V1_MULTIPROCESSING="0", **extra),
                           timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            print(f"process {process} stopped at the {args.deadline_s:.0f} s deadline")
    results = {}
    if results_path.exists():
        results = {r["id"]: r for r in map(json.loads, results_path.read_text().splitlines())}
    checks = verdicts(runs, results)
    (args.out / "checks.json").write_text(json.dumps(checks, indent=1))
    for c in checks:
        print(f"{'PASS' if c['ok'] else 'FAIL'} {c['check']}")
    print(f"{sum(c['ok'] for c in checks)} passed, {sum(not c['ok'] for c in checks)} failed")
    return 0 if checks and all(c["ok"] for c in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
