"""What a production operator expects of ``kvcompact serve`` under load and faults, measured (not a CI test).

One ``kvcompact serve`` (the bundled model, fp32, prefix caching on as ``serve`` defaults, guaranteed admission, a
pool that ``--concurrency`` compressed requests fill) gets, in order:

- **soak** (``--minutes``, default 20): ``--concurrency`` clients in a closed loop, each request drawn at random:
  prompt 20-300 tokens, half of them behind one of two shared system prompts (64 and 96 tokens: whole blocks the
  prefix cache shares), output 16-200 tokens (``ignore_eos``), budget mode fixed or pressure, per-request budgets
  80/128, some with compression off, streaming or not; 15% aborted mid-stream by the client, 10% disconnected
  (non-streaming, the client gives up before the answer). Counted: requests, tokens, errors (any HTTP status but
  200, an error event, a finish reason other than "length", or fewer tokens than asked, for a request the client
  did not drop), vLLM's preemptions, kvcompact's scheduler faults and compaction failures; the server's resident
  memory (every process of its group) sampled every 5 s; at the end, with the server idle, the blocks still held
  (``vllm:kv_cache_usage_perc`` x pool; the prefix cache's free blocks count as free) and kvcompact's gauges.
- **storm**: ``--storm-requests`` streamed requests at full concurrency, ``--drop-fraction`` of them (at least half)
  dropped by the client after 1-20 tokens; the others must finish whole; then the same idle checks.
- **SIGTERM**: ``--concurrency`` streamed requests in flight, then SIGTERM to the ``kvcompact serve`` process (what
  systemd or Kubernetes send): what each client saw (finished, stream cut, connection error), how long the server
  took to exit and its exit status, and the processes of its group still alive 10 s after it exited (they are
  then killed, and counted).

``--quick``: a 1-minute soak, a 16-request storm. The goal: 0 errors, 0 blocks leaked, 0 preemptions (guaranteed
admission, prefix caching and pressure mode together), memory flat after warm-up, 0 processes left.
"""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

BLOCK, MAX_LEN = 32, 512
# The SIGTERM clients' read timeout: unlike any other wait here, so the server's exit time shows whether it waited
# for them (uvicorn waits for open connections to close; vLLM's aborted streams send nothing more).
CLIENT_TIMEOUT = 45
KV_BYTES_PER_TOKEN = 46080  # SmolLM2-135M in fp32: 30 layers x 3 KV heads x 64 x (K, V) x 4 bytes


def add_arguments(p: Any) -> None:
    p.add_argument("--minutes", type=float, default=None, help="soak duration (default 20, quick 1)")
    p.add_argument("--concurrency", type=int, default=8, help="clients in flight = vLLM's max_num_seqs (default 8)")
    p.add_argument("--storm-requests", type=int, default=None, help="storm size (default 200, quick 16)")
    p.add_argument("--drop-fraction", type=float, default=0.6, help="share of storm requests dropped mid-stream")
    p.add_argument("--seed", type=int, default=0)


def run(ctx: Any) -> dict[str, Any]:
    a = ctx.args
    if a.drop_fraction < 0.5:
        raise SystemExit("kvcompact bench reliability: --drop-fraction must be at least 0.5")
    minutes = a.minutes if a.minutes is not None else (1.0 if ctx.quick else 20.0)
    storm_n = a.storm_requests or (16 if ctx.quick else 200)
    blocks = 3 * a.concurrency + 1  # a compressed request holds at most ceil((64 + 32) / 32) = 3 blocks
    args = ["--budget", "64", "--divide-length", "32", "--window", "16", "--budget-mode", "fixed",
            "--no-protect-prompt", "--block-size", str(BLOCK),
            "--num-gpu-blocks-override", str(blocks), "--kv-cache-memory-bytes",
            str((blocks + 8) * BLOCK * KV_BYTES_PER_TOKEN * 2), "--max-num-seqs", str(a.concurrency),
            "--max-model-len", str(MAX_LEN), "--dtype", "float32", "--enforce-eager", "--seed", "0"]
    ids = _corpus_ids()
    rng = random.Random(a.seed)
    systems = [ids[5000:5064], ids[6000:6096]]
    setup = {"server_args": args, "minutes": minutes, "concurrency": a.concurrency, "storm_requests": storm_n,
             "drop_fraction": a.drop_fraction, "pool_blocks": blocks - 1, "seed": a.seed}
    ctx.log("reliability: starting kvcompact serve", " ".join(args))
    with _Server(args, ctx.path("server.log")) as srv:
        soak = _soak(ctx, srv, ids, systems, rng, minutes, a.concurrency)
        ctx.checkpoint({"setup": setup, "soak": soak})
        storm = _storm(ctx, srv, ids, systems, rng, storm_n, a.concurrency, a.drop_fraction)
        ctx.checkpoint({"setup": setup, "soak": soak, "storm": storm})
        sigterm = _sigterm(ctx, srv, ids, a.concurrency)
    _plot(ctx, soak)
    ok = (soak["errors"] == 0 and soak["blocks_leaked"] == 0 and storm["errors"] == 0 and storm["blocks_leaked"] == 0
          and storm["counters"]["vllm:num_preemptions_total"] == 0 and sigterm["processes_left"] == 0)
    ctx.log("reliability:", json.dumps({"soak": {k: soak[k] for k in ("requests", "errors", "blocks_leaked",
                                                                         "rss_growth_mb")},
                                        "storm": {k: storm[k] for k in ("requests", "dropped", "errors",
                                                                          "blocks_leaked")},
                                        "sigterm": sigterm["clients"]}))
    return {"setup": setup, "soak": soak, "storm": storm, "sigterm": sigterm, "goals_met": ok}


# -- the server -----------------------------------------------------------------------------------------------------
class _Server:
    """``kvcompact serve ARGS`` on a free port of 127.0.0.1, in its own process group; on exit whatever of the
    group is still alive is killed."""

    def __init__(self, args: list[str], log: Path) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.args, self.log = args, log
        self.process: subprocess.Popen | None = None

    def __enter__(self) -> _Server:
        env = {k: v for k, v in os.environ.items() if k != "VLLM_ENABLE_V1_MULTIPROCESSING"}
        env.update(HF_HUB_OFFLINE="1", VLLM_HOST_IP="127.0.0.1", PROMETHEUS_MULTIPROC_DIR=tempfile.mkdtemp())
        self._log = self.log.open("ab")
        self.process = subprocess.Popen([sys.executable, "-m", "kvcompact.tools.cli", "serve", *self.args, "--port",
                                         str(self.port)], stdout=self._log, stderr=subprocess.STDOUT,
                                        stdin=subprocess.DEVNULL, env=env, start_new_session=True)
        deadline = time.monotonic() + 900
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise SystemExit(f"kvcompact serve exited with {self.process.returncode}; see {self.log}")
            try:
                import requests

                if requests.get(self.url + "/v1/models", timeout=5).ok:
                    self.model = requests.get(self.url + "/v1/models", timeout=5).json()["data"][0]["id"]
                    return self
            except OSError:
                pass
            time.sleep(2)
        raise SystemExit("kvcompact serve did not come up within 15 minutes")

    def group(self) -> list[int]:
        assert self.process is not None
        out = []
        for entry in os.listdir("/proc"):
            if entry.isdigit():
                try:
                    if os.getpgid(int(entry)) == self.process.pid:
                        out.append(int(entry))
                except OSError:
                    pass
        return out

    def rss_mb(self) -> float:
        total = 0
        for pid in self.group():
            try:
                for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                    if line.startswith("VmRSS:"):
                        total += int(line.split()[1])
            except OSError:
                pass
        return total / 1024

    def __exit__(self, *exc: Any) -> None:
        assert self.process is not None
        for pid in self.group():
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        self.process.wait(timeout=30)
        self._log.close()


# -- clients ----------------------------------------------------------------------------------------------------------
def _corpus_ids() -> list[int]:
    from transformers import AutoTokenizer

    from kvcompact.tools.corpus import eval_text
    from kvcompact.tools.model import ensure_default_model

    tok = AutoTokenizer.from_pretrained(str(ensure_default_model()))
    return tok(eval_text().read_text()[:120000])["input_ids"]


def _draw(rng: random.Random, ids: list[int], systems: list[list[int]]) -> dict[str, Any]:
    """One request of the mixed load: its body and what the client does with it."""
    system = rng.choice([[], [], *systems])
    n = rng.randint(20, 300 - len(system))
    start = rng.randrange(0, len(ids) - n)
    prompt = system + ids[start:start + n]
    max_tokens = min(rng.randint(16, 200), MAX_LEN - len(prompt))
    xargs = rng.choice([None, {"kvcompact_budget_mode": "pressure"}, {"kvcompact_budget_mode": "pressure"},
                        {"kvcompact_budget": 80}, {"kvcompact_budget": 128}, {"kvcompact": "off"}])
    action = rng.choices(["finish", "abort", "disconnect"], weights=[75, 15, 10])[0]
    stream = action == "abort" or (action == "finish" and rng.random() < 0.5)
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": rng.choice([0.0, 0.8]), "ignore_eos": True,
            "stream": stream}
    if xargs:
        body["vllm_xargs"] = xargs
    return {"body": body, "action": action, "drop_after": rng.randint(1, 20)}


def _send(srv: _Server, job: dict[str, Any]) -> dict[str, Any]:
    """Send one request and do what ``job['action']`` says; returns its outcome."""
    import requests

    body = {"model": srv.model, **job["body"]}
    want, action = body["max_tokens"], job["action"]
    out: dict[str, Any] = {"action": action, "tokens": 0, "error": None}
    try:
        if action == "disconnect":
            try:
                requests.post(srv.url + "/v1/completions", json=body, timeout=(10, 0.3))
            except requests.exceptions.ReadTimeout:
                pass  # the client gave up: the server sees the connection close
            return out
        with requests.post(srv.url + "/v1/completions", json=body, stream=body["stream"], timeout=600) as r:
            if r.status_code != 200:
                out["error"] = f"HTTP {r.status_code}: {r.text[:200]}"
                return out
            if not body["stream"]:
                choice = r.json()["choices"][0]
                out["tokens"] = r.json()["usage"]["completion_tokens"]
                reason = choice["finish_reason"]
            else:
                reason = None
                for line in r.iter_lines():
                    if not line.startswith(b"data: {"):
                        continue
                    chunk = json.loads(line[6:])
                    if "error" in chunk:
                        out["error"] = f"error event: {chunk['error']}"
                        return out
                    for c in chunk.get("choices", []):
                        out["tokens"] += 1 if c.get("text") is not None else 0
                        reason = c.get("finish_reason") or reason
                    if action == "abort" and out["tokens"] >= job["drop_after"]:
                        return out  # leaving the with-block closes the connection mid-stream
            if reason != "length" or (not body["stream"] and out["tokens"] != want):
                out["error"] = f"finish_reason {reason}, {out['tokens']} of {want} tokens"
    except requests.RequestException as e:
        out["error"] = f"{type(e).__name__}: {e}"
    return out


def _metrics(srv: _Server) -> Any:
    import requests

    from kvcompact.tools.metrics_text import parse_metrics

    return parse_metrics(requests.get(srv.url + "/metrics", timeout=30).text)


def _idle(srv: _Server, pool: int, timeout: float = 120) -> dict[str, Any]:
    """Wait until nothing runs or waits; then the blocks still held and kvcompact's gauges."""
    deadline = time.monotonic() + timeout
    while True:
        m = _metrics(srv)
        busy = (m.total("vllm:num_requests_running") or 0) + (m.total("vllm:num_requests_waiting") or 0)
        if (busy == 0 and not m.maximum("vllm:kv_cache_usage_perc")) or time.monotonic() > deadline:
            break
        time.sleep(1)
    return {"blocks_leaked": round((m.maximum("vllm:kv_cache_usage_perc") or 0) * pool),
            "requests_left": busy,
            "gauges_left": {g: m.total(g) for g in ("kvcompact:compressed_requests", "kvcompact:logical_tokens",
                                                     "kvcompact:cached_tokens") if m.total(g)},
            "counters": {c: m.total(c) or 0 for c in (
                "vllm:num_preemptions_total", "kvcompact:compaction_rounds_total", "kvcompact:pressure_rounds_total",
                "kvcompact:blocks_copied_total", "kvcompact:deferred_rounds_total",
                "kvcompact:scheduler_faults_total", "kvcompact:compaction_failures_total")},
            "compression_disabled": m.maximum("kvcompact:compression_disabled")}


def _soak(ctx: Any, srv: _Server, ids: list[int], systems: list[list[int]], rng: random.Random, minutes: float,
          concurrency: int) -> dict[str, Any]:
    deadline = time.monotonic() + minutes * 60
    results: list[dict[str, Any]] = []
    lock = threading.Lock()
    seeds = [rng.randrange(2**32) for _ in range(concurrency)]
    samples: list[tuple[float, float, float]] = []
    start = time.monotonic()

    def client(seed: int) -> None:
        r = random.Random(seed)
        while time.monotonic() < deadline:
            out = _send(srv, _draw(r, ids, systems))
            with lock:
                results.append(out)

    threads = [threading.Thread(target=client, args=(s,), daemon=True) for s in seeds]
    for t in threads:
        t.start()
    bar = ctx.progress(total=int(minutes * 60), desc="soak s")
    while any(t.is_alive() for t in threads):
        try:
            usage = _metrics(srv).maximum("vllm:kv_cache_usage_perc") or 0
        except OSError:
            usage = float("nan")
        samples.append((time.monotonic() - start, srv.rss_mb(), usage))
        bar.update(5)
        time.sleep(5)
    bar.close()
    for t in threads:
        t.join()
    idle = _idle(srv, 3 * concurrency)
    warm = [rss for t, rss, _ in samples if t >= min(60.0, minutes * 60 / 4)] or [samples[-1][1]]
    errors = [r["error"] for r in results if r["error"]]
    return {"seconds": round(time.monotonic() - start), "requests": len(results),
            "finished": sum(r["action"] == "finish" for r in results),
            "aborted": sum(r["action"] == "abort" for r in results),
            "disconnected": sum(r["action"] == "disconnect" for r in results),
            "errors": len(errors), "first_errors": errors[:5],
            "rss_mb_after_warmup": round(warm[0], 1), "rss_mb_end": round(samples[-1][1], 1),
            "rss_mb_max": round(max(s[1] for s in samples), 1), "rss_growth_mb": round(samples[-1][1] - warm[0], 1),
            "kv_usage_max": max(s[2] for s in samples), **idle, "samples": samples}


def _storm(ctx: Any, srv: _Server, ids: list[int], systems: list[list[int]], rng: random.Random, n: int,
           concurrency: int, drop: float) -> dict[str, Any]:
    import concurrent.futures

    jobs = []
    for i in range(n):
        job = _draw(rng, ids, systems)
        job["action"] = "abort" if i < round(n * drop) else "finish"
        job["body"]["stream"] = True
        jobs.append(job)
    rng.shuffle(jobs)
    start = time.monotonic()
    with concurrent.futures.ThreadPoolExecutor(concurrency * 2) as pool:
        results = list(ctx.progress(pool.map(lambda j: _send(srv, j), jobs), total=n, desc="storm"))
    idle = _idle(srv, 3 * concurrency)
    errors = [r["error"] for r in results if r["error"]]
    return {"seconds": round(time.monotonic() - start), "requests": n,
            "dropped": sum(r["action"] == "abort" for r in results), "errors": len(errors),
            "first_errors": errors[:5], **idle}


def _sigterm(ctx: Any, srv: _Server, ids: list[int], concurrency: int) -> dict[str, Any]:
    """Streams in flight, then SIGTERM to ``kvcompact serve``: what the clients saw and what was left running."""
    import requests

    assert srv.process is not None
    seen: list[dict[str, Any]] = [{"tokens": 0, "outcome": None, "at": None} for _ in range(concurrency)]

    def client(i: int) -> None:
        body = {"model": srv.model, "prompt": ids[100 * i: 100 * i + 40], "max_tokens": 400, "temperature": 0.0,
                "ignore_eos": True, "stream": True}
        try:
            with requests.post(srv.url + "/v1/completions", json=body, stream=True, timeout=CLIENT_TIMEOUT) as r:
                if r.status_code != 200:
                    seen[i]["outcome"] = f"HTTP {r.status_code}"
                    return
                for line in r.iter_lines():
                    if line == b"data: [DONE]":
                        seen[i]["outcome"] = "finished"
                        return
                    if line.startswith(b"data: {"):
                        chunk = json.loads(line[6:])
                        if "error" in chunk:
                            seen[i]["outcome"] = "error event"
                            return
                        seen[i]["tokens"] += 1
                seen[i]["outcome"] = "stream ended without [DONE]"
        except requests.RequestException as e:
            seen[i]["outcome"] = f"connection error ({type(e).__name__})"
        finally:
            seen[i]["at"] = time.monotonic()

    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(concurrency)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 120
    while min(s["tokens"] for s in seen) < 5 and time.monotonic() < deadline:
        time.sleep(0.2)
    group = srv.group()
    sent = time.monotonic()
    srv.process.send_signal(signal.SIGTERM)
    try:
        code: int | None = srv.process.wait(timeout=120)
    except subprocess.TimeoutExpired:
        code = None
    exit_seconds = round(time.monotonic() - sent, 1)
    for t in threads:
        t.join(timeout=60)
    time.sleep(10)
    left = [pid for pid in group if _alive(pid)]
    outcomes: dict[str, int] = {}
    for s in seen:
        outcomes[str(s["outcome"])] = outcomes.get(str(s["outcome"]), 0) + 1
    ended = [round(s["at"] - sent, 1) for s in seen if s["at"] is not None]
    return {"in_flight": concurrency, "tokens_before_signal_min": min(s["tokens"] for s in seen),
            "clients": outcomes, "client_seconds_after_signal": ended, "client_read_timeout_s": CLIENT_TIMEOUT,
            "exit_status": code, "exit_seconds": exit_seconds,
            "processes_in_group_before": len(group), "processes_left": len(left)}


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split()[2]
    except OSError:
        return False
    return state != "Z"


def _plot(ctx: Any, soak: dict[str, Any]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t, rss, usage = zip(*soak["samples"]) if soak["samples"] else ((), (), ())
    fig, ax = plt.subplots(figsize=(8, 4))
    ax.plot([x / 60 for x in t], rss, label="server RSS (MB)")
    ax.set_xlabel("minutes")
    ax.set_ylabel("MB")
    ax2 = ax.twinx()
    ax2.plot([x / 60 for x in t], usage, color="tab:orange", alpha=0.6, label="KV usage")
    ax2.set_ylabel("KV usage")
    ax.set_title(f"soak: {soak['requests']} requests, {soak['errors']} errors, {soak['blocks_leaked']} blocks leaked")
    ctx.savefig(fig)
