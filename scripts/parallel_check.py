"""TP/PP functional check: ``kvcompact serve`` with vLLM's tensor / pipeline parallelism, compression off and on.

For each layout (``TPxPP``, e.g. ``1x1,3x1,1x2``) this starts the real server exactly as a user would
(``kvcompact serve --tensor-parallel-size T --pipeline-parallel-size P`` plus small-model settings), then runs the
same greedy batch with compression switched off per request (``"vllm_xargs": {"kvcompact": "off"}``) and on,
in that server, and records per phase: generated tokens/s, the completions, and the deltas of kvcompact's
counters on ``/metrics``. It checks that the completions and the counters (rounds, tokens evicted, blocks freed,
tokens moved summed over every rank) equal the first layout's: rounds are counted once, not once per worker.

This is a functional check, not a speed claim: on a 2-core machine several ranks only add overhead.

    .venv/bin/python scripts/parallel_check.py [--layouts 1x1,3x1,1x2] [--requests 2] [--tokens 96]

Writes ``results/parallel/<UTC stamp>/result.json`` and prints a Markdown table.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import datetime as dt
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from kvcompact.tools.metrics_text import parse_metrics

ROOT = Path(__file__).resolve().parents[1]
COUNTERS = ("kvcompact:compaction_rounds_total", "kvcompact:tokens_evicted_total", "kvcompact:blocks_freed_total",
            "kvcompact:tokens_moved_total")
PROMPTS = [
    "Alice was beginning to get very tired of sitting by her sister on the bank, and of having nothing to do: "
    "once or twice she had peeped into the book her sister was reading",
    "In the beginning God created the heaven and the earth. And the earth was without form, and void; and "
    "darkness was upon the face of the deep",
    "It is a truth universally acknowledged, that a single man in possession of a good fortune, must be in want "
    "of a wife. However little known the feelings or views of such a man",
    "Call me Ishmael. Some years ago, never mind how long precisely, having little or no money in my purse, and "
    "nothing particular to interest me on shore",
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http(url: str, body: dict | None = None, timeout: float = 1800) -> str:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return r.read().decode()


def counters(base: str) -> dict[str, float]:
    metrics = parse_metrics(http(base + "/metrics"))
    return {name: metrics.total(name) or 0.0 for name in COUNTERS}


def batch(base: str, model: str, n: int, tokens: int, compression: bool) -> tuple[float, int, list[str]]:
    def one(i: int) -> dict:
        body = {"model": model, "prompt": PROMPTS[i % len(PROMPTS)], "max_tokens": tokens, "temperature": 0,
                "ignore_eos": True}
        if not compression:
            body["vllm_xargs"] = {"kvcompact": "off"}
        return json.loads(http(base + "/v1/completions", body))

    start = time.perf_counter()
    with cf.ThreadPoolExecutor(n) as pool:
        outs = list(pool.map(one, range(n)))
    wall = time.perf_counter() - start
    generated = sum(o["usage"]["completion_tokens"] for o in outs)
    return wall, generated, [o["choices"][0]["text"] for o in outs]


def run_layout(tp: int, pp: int, args: argparse.Namespace, log) -> dict:
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    command = [str(ROOT / ".venv/bin/kvcompact"), "serve", "--port", str(port),
               "--tensor-parallel-size", str(tp), "--pipeline-parallel-size", str(pp),
               "--dtype", "float32", "--enforce-eager", "--max-model-len", "512", "--block-size", "32",
               "--max-num-seqs", "4", "--policy", args.policy, "--selection", args.selection,
               "--budget", "48", "--divide-length", "24", "--window", "16", "--compaction", args.compaction,
               "--budget-mode", "fixed", "--no-protect-prompt"]  # rounds every 24 tokens whatever the pool
    env = dict(os.environ, HF_HUB_OFFLINE="1", VLLM_HOST_IP="127.0.0.1", VLLM_CPU_KVCACHE_SPACE="1")
    log_path = args.out / f"server-{tp}x{pp}.log"
    shm_before = set(os.listdir("/dev/shm"))
    t0 = time.perf_counter()
    with open(log_path, "w") as log_file:
        server = subprocess.Popen(command, env=env, stdout=log_file, stderr=subprocess.STDOUT,
                                  start_new_session=True)
    result: dict = {"tp": tp, "pp": pp, "command": " ".join(command[1:]), "phases": []}
    try:
        while True:
            if server.poll() is not None:
                raise RuntimeError(f"server {tp}x{pp} exited with {server.returncode}: see {log_path}")
            try:
                http(base + "/health", timeout=5)
                break
            except OSError:
                time.sleep(2)
            if time.perf_counter() - t0 > args.start_timeout:
                raise RuntimeError(f"server {tp}x{pp} not ready after {args.start_timeout} s: see {log_path}")
        result["start_s"] = round(time.perf_counter() - t0, 1)
        model = json.loads(http(base + "/v1/models"))["data"][0]["id"]
        log(f"{tp}x{pp}: ready after {result['start_s']} s")
        for rep in range(args.reps):
            for compression in (False, True):
                before = counters(base)
                load = os.getloadavg()[0]
                wall, generated, texts = batch(base, model, args.requests, args.tokens, compression)
                after = counters(base)
                phase = {"compression": compression, "rep": rep, "wall_s": round(wall, 2),
                         "generated_tokens": generated, "tokens_per_s": round(generated / wall, 2),
                         "load_avg_1m": round(load, 1), "texts": texts,
                         "counters": {k.split(":")[1]: after[k] - before[k] for k in COUNTERS}}
                result["phases"].append(phase)
                log(f"{tp}x{pp} compression={'on' if compression else 'off'}: {phase['tokens_per_s']} tok/s, "
                    f"counters {phase['counters']}, load {phase['load_avg_1m']}")
    finally:
        if server.poll() is None:
            os.killpg(server.pid, signal.SIGTERM)  # the server's own session: its API server, core, workers
            try:
                server.wait(120)
            except subprocess.TimeoutExpired:
                os.killpg(server.pid, signal.SIGKILL)
                server.wait()
        result["shm_left"] = sorted(set(os.listdir("/dev/shm")) - shm_before)
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layouts", default="1x1,3x1,1x2", help="TPxPP list (default 1x1,3x1,1x2)")
    p.add_argument("--requests", type=int, default=2)
    p.add_argument("--tokens", type=int, default=96)
    p.add_argument("--reps", type=int, default=1)
    p.add_argument("--policy", default="triattention")
    p.add_argument("--selection", default="per_layer_per_head", help="per_head is refused under PP")
    p.add_argument("--compaction", default="repack")
    p.add_argument("--start-timeout", type=float, default=1200)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    stamp = dt.datetime.now(dt.UTC).strftime("%Y%m%dT%H%M%SZ")
    args.out = args.out or ROOT / "results" / "parallel" / stamp
    args.out.mkdir(parents=True, exist_ok=True)

    def log(msg: str) -> None:
        print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)

    layouts = []
    for spec in args.layouts.split(","):
        tp, pp = (int(x) for x in spec.lower().split("x"))
        layouts.append(run_layout(tp, pp, args, log))
    ref = layouts[0]
    checks = []
    for lay in layouts[1:]:
        for a, b in zip(ref["phases"], lay["phases"]):
            checks.append({"layout": f"{lay['tp']}x{lay['pp']}", "compression": b["compression"],
                           "same_texts": a["texts"] == b["texts"], "same_counters": a["counters"] == b["counters"]})
    out = {"what": "TP/PP functional check (not a speed claim)", "command": " ".join(sys.argv),
           "machine": {"cpus": os.cpu_count(), "load_avg_end": list(os.getloadavg())},
           "layouts": layouts, "checks": checks}
    (args.out / "result.json").write_text(json.dumps(out, indent=2))
    print("| layout | compression | tokens/s | rounds | blocks freed | tokens moved | same output as 1st layout |")
    print("|---|---|---|---|---|---|---|")
    for lay in layouts:
        for ph in lay["phases"]:
            same = next((c["same_texts"] and c["same_counters"] for c in checks
                         if c["layout"] == f"{lay['tp']}x{lay['pp']}" and c["compression"] == ph["compression"]),
                        "(reference)")
            c = ph["counters"]
            print(f"| TP={lay['tp']} PP={lay['pp']} | {'on' if ph['compression'] else 'off'} | {ph['tokens_per_s']} "
                  f"| {c['compaction_rounds_total']:g} | {c['blocks_freed_total']:g} | {c['tokens_moved_total']:g} "
                  f"| {same} |")
    print(f"\nresult: {args.out / 'result.json'}", file=sys.stderr)
    return 0 if all(c["same_texts"] and c["same_counters"] for c in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
