"""Capacity on a GPU through vLLM's own client (issue 47): stock vLLM against kvcompact at Qwen3-8B's shape.

    python3 bench/gpu_capacity.py --out $OUT       # on the lent GPU machine, after scripts/gpu/install_on_device.sh
    python3 bench/gpu_capacity.py --dry-run        # the plan, each cell's estimated GPU time; no vLLM, no torch

A standalone script, not a ``kvcompact bench`` module: it runs on the GPU machine beside the carried vLLM
(scripts/gpu/), starts `vllm serve` and `vllm bench serve` as processes, and reads the servers' /metrics.

The model is device_common.py's Qwen3-8B-shaped dummy (``--load-format dummy``, bf16, block size 16, V1 runner).
The load: `vllm bench serve` with random prompts of ~1,000 tokens, 32 requests sent at once, ``ignore_eos``, and
outputs of 2,000-4,000 tokens by default: the issue's 4,000-8,000 (``--output-len 6000``) is estimated at 895 s for
the five cells, more than one 10-minute device call, so it runs as two calls (docs/gpu.md); the default fits one.
The small pool (``--num-gpu-blocks-override``) holds 8 requests at full length. Cells, in this order (one
repetition; cells that share a server run back to back on it):

- ``stock``: vLLM with kvcompact installed and not configured (passive);
- ``fixed``: kvcompact budget 2048, fixed mode (``KVCOMPACT_BUDGET=2048``);
- ``pressure``: the same server, each request in budget mode pressure with floor 2048
  (``vllm_xargs: {"kvcompact_budget_mode": "pressure"}``);
- ``large-stock`` and ``large-pressure``: a pool that holds every request at full length, stock against
  kvcompact in budget mode pressure (the no-harm pair: pressure compresses only when the pool runs short).

kvcompact is configured through ``KVCOMPACT_*`` variables, not ``--additional-config``: vLLM keys its compile
cache by a hash that covers ``additional_config``, so every server here reuses the first one's compiled graph.

Per cell: output tokens/s, preemptions (``vllm:num_preemptions`` on /metrics), TPOT p50/p99, TTFT p50, kvcompact's
rounds and blocks freed, and ratios against the stock cell of the same pool; ``result.json`` and ``plot.png``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts" / "gpu"))
from device_common import (  # noqa: E402
    BLOCK_SIZE,
    DEST,
    KV_BYTES_PER_TOKEN,
    TOKENIZER,
    model_config,
    run_env,
    tokenizer_vocab,
)

DEVICE_CALL_S = 600
DEADLINE_S = 560  # cells that would end past this are skipped, so result.json is written inside one call
# Estimates, guesses until a first run replaces them (H100): a server's start with torch.compile and CUDA-graph
# capture, a later one (vLLM's compile cache), bytes per second a decode step reads, a step's fixed cost, and a
# round's share of decode time (BENCHMARKS.md, "A round's hot path on a GPU": 1-3% at 8-64 requests).
EST = {"start_first": 110.0, "start": 45.0, "read_Bps": 2.5e12, "step_overhead_s": 0.0015, "round_share": 0.03}
STOCK_POOL_REQUESTS = 8  # the small pool holds this many requests at full length


def full_length(args: argparse.Namespace) -> int:
    """A request's longest prompt plus its longest output."""
    return math.ceil(args.input_len * (1 + args.input_ratio)) + math.ceil(args.output_len * (1 + args.output_ratio))


def weight_bytes(config: dict[str, Any]) -> int:
    """bf16 bytes a decode step reads from the weights: every layer's projections, the embedding and LM head."""
    h, m, layers = config["hidden_size"], config["intermediate_size"], config["num_hidden_layers"]
    q, kv = config["num_attention_heads"] * config["head_dim"], config["num_key_value_heads"] * config["head_dim"]
    per_layer = h * (q + 2 * kv) + q * h + 3 * h * m
    return 2 * (layers * per_layer + 2 * config["vocab_size"] * h)


def estimate_run_s(cell: dict[str, Any], args: argparse.Namespace, weights: int) -> float:
    """Decode time of the cell's load: steps x (bytes read / read rate + fixed cost), with as many requests
    running as the pool holds: stock at full length (it admits more, then preempts), kvcompact at its admission's
    peak footprint (budget + divide_length, the floor in pressure mode), each at about half its final length or
    its kept tokens, whichever is less."""
    n, out, prompt = args.requests, args.output_len, args.input_len
    longest = math.ceil(out * (1 + args.output_ratio))
    if cell["kvcompact"] is None:
        footprint = math.ceil(full_length(args) / BLOCK_SIZE)
    else:
        footprint = min(math.ceil(full_length(args) / BLOCK_SIZE), math.ceil((cell["budget"] + 64) / BLOCK_SIZE))
    running = max(1, min(n, cell["pool_blocks"] // footprint))
    steps = max(longest, n * out / running)
    cached = prompt + out / 2
    if cell["kvcompact"] is not None:
        kept = cell["budget"] + 32 if cell["mode"] == "fixed" else cell["pool_blocks"] * BLOCK_SIZE / running
        cached = min(cached, kept)
    step = (weights + running * cached * KV_BYTES_PER_TOKEN) / EST["read_Bps"] + EST["step_overhead_s"]
    if cell["kvcompact"] is not None and cached < prompt + out / 2:
        step *= 1 + EST["round_share"]
    return steps * step


def cells(args: argparse.Namespace, stats: Path) -> list[dict[str, Any]]:
    """The cells in run order, each with its server (cells with the same server share one start)."""
    full_blocks = math.ceil(full_length(args) / BLOCK_SIZE)
    small, large = STOCK_POOL_REQUESTS * full_blocks, args.requests * full_blocks
    kvc = {"KVCOMPACT_BUDGET": str(args.budget), "KVCOMPACT_STATS_PATH": str(stats), "KVCOMPACT_BUDGET_MODE": "fixed",
           "KVCOMPACT_PROTECT_PROMPT": "false"}
    pressure_env = dict(kvc, KVCOMPACT_BUDGET_MODE="pressure")
    pressure = {"vllm_xargs": {"kvcompact_budget_mode": "pressure"}}
    table = [("stock", "stock-small", small, None, "fixed", None),
             ("fixed", "kvcompact-small", small, kvc, "fixed", None),
             ("pressure", "kvcompact-small", small, kvc, "pressure", pressure),
             ("large-stock", "stock-large", large, None, "fixed", None),
             ("large-pressure", "kvcompact-large", large, pressure_env, "pressure", None)]
    return [{"name": name, "server": server, "pool_blocks": blocks, "kvcompact": env, "mode": mode,
             "budget": args.budget, "extra_body": extra,
             "baseline": "stock" if blocks == small else "large-stock"}
            for name, server, blocks, env, mode, extra in table if name in args.cells]


def serve_command(model: Path, cell: dict[str, Any], args: argparse.Namespace, port: int) -> list[str]:
    return [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", str(model), "--load-format", "dummy",
            "--dtype", "bfloat16", "--block-size", str(BLOCK_SIZE),
            "--max-model-len", str(math.ceil(full_length(args) / 1024) * 1024),
            "--num-gpu-blocks-override", str(cell["pool_blocks"]), "--max-num-seqs", str(args.requests),
            "--no-enable-prefix-caching", "--gpu-memory-utilization", "0.92", "--seed", "0",
            "--host", "127.0.0.1", "--port", str(port)]


def bench_command(model: Path, cell: dict[str, Any], args: argparse.Namespace, port: int, out: Path) -> list[str]:
    cmd = [sys.executable, "-m", "vllm.entrypoints.cli.main", "bench", "serve", "--backend", "vllm",
           "--base-url", f"http://127.0.0.1:{port}", "--model", str(model), "--tokenizer", str(model),
           "--dataset-name", "random", "--random-input-len", str(args.input_len),
           "--random-output-len", str(args.output_len),
           "--random-range-ratio", json.dumps({"input": args.input_ratio, "output": args.output_ratio}),
           "--num-prompts", str(args.requests), "--max-concurrency", str(args.requests), "--ignore-eos",
           "--seed", "0", "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99",
           "--save-result", "--result-dir", str(out), "--result-filename", f"{cell['name']}.json", "--disable-tqdm"]
    if cell["extra_body"] is not None:
        cmd += ["--extra-body", json.dumps(cell["extra_body"])]
    return cmd


def plan(args: argparse.Namespace, vocab: int) -> list[dict[str, Any]]:
    """The cells with their commands and estimated seconds (a server's start is charged to its first cell)."""
    model, stats = DEST / "work" / "qwen3-8b-dummy", DEST / "work" / "triattention-random.pt"
    weights = weight_bytes(model_config(vocab))
    out, started = [], set()
    for i, cell in enumerate(cells(args, stats)):
        port = 8100 + sorted({c["server"] for c in cells(args, stats)}).index(cell["server"])
        start = 0.0 if cell["server"] in started else (EST["start"] if started else EST["start_first"])
        started.add(cell["server"])
        run = estimate_run_s(cell, args, weights)
        out.append(dict(cell, index=i, port=port, start_s=round(start), run_s=round(run),
                        serve=serve_command(model, cell, args, port),
                        bench=bench_command(model, cell, args, port, args.work)))
    return out


# ------------------------------------------------------------------------------------------------ running
def metrics(port: int) -> dict[str, float]:
    """The counters this bench reads from a server's /metrics, summed over their labels."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    names = {"vllm:num_preemptions_total": "preemptions", "vllm:generation_tokens_total": "generated",
             "kvcompact:compaction_rounds_total": "rounds", "kvcompact:blocks_freed_total": "blocks_freed",
             "kvcompact:pressure_rounds_total": "pressure_rounds"}
    found = dict.fromkeys(names.values(), 0.0)
    for line in text.splitlines():
        m = re.match(r"([\w:]+)(\{[^}]*\})? ([0-9.eE+-]+)$", line)
        if m and m.group(1) in names:
            found[names[m.group(1)]] += float(m.group(3))
    return found


def wait_ready(proc: subprocess.Popen, port: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server on port {port} exited ({proc.returncode}) before it was ready")
        try:
            if urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5).status == 200:
                return
        except OSError:
            pass
        time.sleep(2)
    raise RuntimeError(f"the server on port {port} was not ready after {timeout:.0f} s")


def stop(proc: subprocess.Popen) -> None:
    """SIGINT to the server's process group (vLLM shuts its engine down), then SIGKILL if it lingers."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def run_cells(runs: list[dict[str, Any]], args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    """Each server once, its cells back to back; a cell that would end past the deadline is skipped."""
    results: dict[str, dict[str, Any]] = {}
    began = time.monotonic()
    server: subprocess.Popen | None = None
    current = None
    try:
        for cell in runs:
            left = args.deadline_s - (time.monotonic() - began)
            if (0 if cell["server"] == current else cell["start_s"]) + cell["run_s"] > left:
                results[cell["name"]] = {"skipped": f"estimated to end past the {args.deadline_s:.0f} s deadline"}
                continue
            if cell["server"] != current:
                if server is not None:
                    stop(server)
                log = open(args.work / f"serve-{cell['server']}.log", "w")
                env = run_env(**(cell["kvcompact"] or {}))
                server = subprocess.Popen(cell["serve"], env=env, stdout=log, stderr=subprocess.STDOUT,
                                          start_new_session=True)
                t0 = time.monotonic()
                wait_ready(server, cell["port"], timeout=max(60.0, left - cell["run_s"]))
                current = cell["server"]
                print(f"server {current} ready in {time.monotonic() - t0:.0f} s", flush=True)
            before = metrics(cell["port"])
            t0 = time.monotonic()
            done = subprocess.run(cell["bench"], env=run_env(), capture_output=True, text=True)
            wall = time.monotonic() - t0
            after = metrics(cell["port"])
            (args.work / f"bench-{cell['name']}.log").write_text(done.stdout + done.stderr)
            saved = args.work / f"{cell['name']}.json"
            if done.returncode != 0 or not saved.exists():
                results[cell["name"]] = {"error": f"vllm bench serve exited {done.returncode}",
                                         "tail": (done.stdout + done.stderr)[-2000:]}
                continue
            bench = json.loads(saved.read_text())
            results[cell["name"]] = {
                "output_tok_s": bench.get("output_throughput"), "completed": bench.get("completed"),
                "tpot_p50_ms": bench.get("median_tpot_ms"), "tpot_p99_ms": bench.get("p99_tpot_ms"),
                "ttft_p50_ms": bench.get("median_ttft_ms"), "duration_s": bench.get("duration"), "wall_s": wall,
                **{k: after[k] - before[k] for k in after}}
            print(f"{cell['name']}: {json.dumps(results[cell['name']])}", flush=True)
    finally:
        if server is not None:
            stop(server)
    return results


def with_ratios(runs: list[dict[str, Any]], results: dict[str, dict[str, Any]]) -> None:
    """Each cell's numbers over its pool's stock cell's."""
    for cell in runs:
        r, base = results.get(cell["name"], {}), results.get(cell["baseline"], {})
        if "output_tok_s" in r and "output_tok_s" in base and cell["name"] != cell["baseline"]:
            r["vs_stock"] = {k: round(r[k] / base[k], 3) for k in ("output_tok_s", "tpot_p50_ms", "tpot_p99_ms",
                                                                  "ttft_p50_ms") if r.get(k) and base.get(k)}


def plot(results: dict[str, dict[str, Any]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [n for n, r in results.items() if "output_tok_s" in r]
    fig, axes = plt.subplots(2, 2, figsize=(12, 8))
    panels = [("output_tok_s", "output tokens/s"), ("preemptions", "preemptions"),
              ("tpot_p50_ms", "TPOT p50 / p99 (ms)"), ("ttft_p50_ms", "TTFT p50 (ms)")]
    for ax, (key, title) in zip(axes.flat, panels):
        ax.bar(names, [results[n][key] or 0 for n in names], color="tab:blue")
        if key == "tpot_p50_ms":
            ax.scatter(names, [results[n]["tpot_p99_ms"] or 0 for n in names], color="tab:red", label="p99", zorder=3)
            ax.legend()
        ax.set_title(title)
        ax.tick_params(axis="x", rotation=20)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


# ------------------------------------------------------------------------------------------------ main
def main(argv: list[str] | None = None) -> int:
    names = ("stock", "fixed", "pressure", "large-stock", "large-pressure")
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=DEST / "gpu_capacity",
                   help="result.json, plot.png, logs.tar.gz (three files: the device tool returns at most eight)")
    p.add_argument("--work", type=Path, default=DEST / "gpu_capacity-work",
                   help="the servers' and clients' logs and vLLM's own result files, packed into logs.tar.gz")
    p.add_argument("--dry-run", action="store_true", help="print the plan and estimates, run nothing")
    p.add_argument("--cells", type=lambda s: s.split(","), default=list(names), help=f"subset of {','.join(names)}")
    p.add_argument("--requests", type=int, default=32, help="requests, all sent at once (the issue: 32-64)")
    p.add_argument("--input-len", type=int, default=1000)
    p.add_argument("--input-ratio", type=float, default=0.1, help="prompts within input-len x (1 +- this)")
    p.add_argument("--output-len", type=int, default=3000, help="the issue's 4,000-8,000: 6000 (two calls)")
    p.add_argument("--output-ratio", type=float, default=1 / 3, help="outputs within output-len x (1 +- this)")
    p.add_argument("--budget", type=int, default=2048, help="kvcompact's budget, and pressure mode's floor")
    p.add_argument("--deadline-s", type=float, default=DEADLINE_S)
    args = p.parse_args(argv)
    unknown = set(args.cells) - set(names)
    if unknown:
        p.error(f"unknown cells {', '.join(sorted(unknown))}")

    vocab = tokenizer_vocab(TOKENIZER) if (TOKENIZER / "tokenizer.json").exists() else 49152
    runs = plan(args, vocab)
    print(f"load: {args.requests} requests at once, prompts {args.input_len} +- {args.input_ratio:.0%}, outputs "
          f"{args.output_len} +- {args.output_ratio:.0%} (ignore_eos); a full-length request "
          f"{full_length(args)} tokens = {math.ceil(full_length(args) / BLOCK_SIZE)} blocks of {BLOCK_SIZE}")
    total = 0.0
    for r in runs:
        total += r["start_s"] + r["run_s"]
        env = " ".join(f"{k}={v}" for k, v in (r["kvcompact"] or {}).items()) or "(no KVCOMPACT_*)"
        gib = r["pool_blocks"] * BLOCK_SIZE * KV_BYTES_PER_TOKEN / 2**30
        print(f"  {r['name']:15s} pool {r['pool_blocks']:5d} blocks ({gib:.1f} GiB)  server {r['server']:15s} "
              f"start ~{r['start_s']:3d} s + run ~{r['run_s']:3d} s  (ends ~{total:.0f} s)  {env}")
        print(f"      serve: {' '.join(r['serve'][1:])}")
        print(f"      bench: {' '.join(r['bench'][1:])}")
    fits = "fits" if total <= args.deadline_s else "does NOT fit"
    print(f"estimated {total:.0f} s: {fits} the {args.deadline_s:.0f} s deadline (a device call is "
          f"{DEVICE_CALL_S} s); cells estimated to end past it are skipped")
    if args.dry_run:
        return 0

    from device_common import write_model, write_stats

    args.out.mkdir(parents=True, exist_ok=True)
    args.work.mkdir(parents=True, exist_ok=True)
    write_model(DEST / "work" / "qwen3-8b-dummy")
    write_stats(DEST / "work" / "triattention-random.pt")
    results = run_cells(runs, args)
    with_ratios(runs, results)
    (args.out / "result.json").write_text(json.dumps({"plan": runs, "results": results}, indent=1, default=str))
    shutil.make_archive(str(args.out / "logs"), "gztar", args.work)
    if any("output_tok_s" in r for r in results.values()):
        plot(results, args.out / "plot.png", f"Qwen3-8B shape (dummy weights), bf16, {args.requests} requests of "
             f"~{args.input_len} + {args.output_len} +- {args.output_ratio:.0%} tokens")
    return 0 if all("output_tok_s" in results.get(r["name"], {}) for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
