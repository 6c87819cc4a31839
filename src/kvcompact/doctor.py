"""``kvcompact doctor``: the runbook "KV compression enabled, no memory savings" as a command.

It works from the outside like an operator: ``/metrics``, the OpenAI API and optionally the server log. The
classification (:func:`diagnose`) is a pure function of what was read, so every branch of the runbook is unit
tested with constructed snapshots; everything else here is I/O around it. Device memory (nvidia-smi) is
reserved at start-up and never moves, so the signals are pool occupancy, preemptions and freed blocks.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass, field

from kvcompact.metrics_text import Metrics, MetricsParseError, parse_metrics

HEALTHY, NO_COMPRESSION, WALL1, WALL2, CAPACITY = "healthy", "no compression active", "wall 1", "wall 2", "capacity"
EXIT_CODES = {HEALTHY: 0, NO_COMPRESSION: 2, WALL1: 3, WALL2: 4, CAPACITY: 5}
EXIT_TOOL_ERROR = 1
USAGE_CEILING = 0.98      # vLLM preempts when the pool is full; >= this means no headroom is left
MIN_RECLAIM = 0.5         # freed slots / evicted tokens; compaction frees ~1, scattered holes ~0
DIVIDE_LENGTH = 128       # kvcompact's default; the log's startup config overrides it when given
MIN_GROWTH_BLOCKS = 4     # the probe judges growth only over at least this many blocks' worth of tokens
THROUGHPUT_DROP = 0.8     # probe tok/s below this fraction of the baseline counts as a drop
MEMORY_RISE = 1.1         # a memory signal 10% above the baseline counts as a rise
DEVICE_NOTE = ("device memory (nvidia-smi) is reserved for the KV pool at start-up and never moves: it is not the "
               "signal; pool occupancy (vllm:kv_cache_usage_perc), preemptions and freed blocks are")
FIXES = {
    NO_COMPRESSION: "enable kvcompact, e.g. `kvcompact serve --budget N` (plugin installed in the server's venv)",
    WALL1: "use a score-free policy that never needs attention weights, e.g. KVCOMPACT_POLICY=triattention, "
           "so the fused attention kernels stay in use",
    WALL2: "turn compaction on (KVCOMPACT_COMPACTION=repack or holefill): only moving survivors together "
           "empties whole blocks",
    CAPACITY: "size the pool (VLLM_CPU_KVCACHE_SPACE / --gpu-memory-utilization / --num-gpu-blocks-override), "
              "use an fp8 KV cache (--kv-cache-dtype fp8), lower --max-num-seqs or --max-model-len, or lower "
              "the budget; `kvcompact plan` does the arithmetic",
    HEALTHY: "nothing to fix; keep this report (`--json > baseline.json`) and pass it as --baseline next time",
}


class DoctorError(Exception):
    """A tool error (unreachable URL, not vLLM, malformed metrics): one clear line, exit code 1."""


class _HTTPStatusError(DoctorError):
    """The server answered, with an error status: reachable, but maybe not the server we expect."""


@dataclass(frozen=True)
class Snapshot:
    """The gauges and counters doctor reads from one /metrics scrape, aggregated over label sets."""

    usage: float | None = None
    preemptions: float = 0.0
    running: float = 0.0
    waiting: float = 0.0
    block_size: int | None = None
    num_blocks: int | None = None
    resident_bytes: float | None = None
    policy: dict[str, str] | None = None  # labels of kvcompact:policy_info
    has_kvcompact: bool = False
    rounds: float = 0.0
    evicted: float = 0.0
    freed: float = 0.0

    @classmethod
    def from_metrics(cls, m: Metrics) -> Snapshot:
        info = m.series("vllm:cache_config_info")
        labels = info[0].labels if info else {}
        policy = [s.labels for s in m.series("kvcompact:policy_info") if s.value == 1]
        count = lambda name: m.total(name) or 0.0  # noqa: E731 - absent counters read as zero
        return cls(
            usage=m.maximum("vllm:kv_cache_usage_perc"), preemptions=count("vllm:num_preemptions_total"),
            running=count("vllm:num_requests_running"), waiting=count("vllm:num_requests_waiting"),
            block_size=_int(labels.get("block_size")), num_blocks=_int(labels.get("num_gpu_blocks")),
            resident_bytes=m.total("process_resident_memory_bytes"), policy=policy[0] if policy else None,
            has_kvcompact=m.has_prefix("kvcompact:"), rounds=count("kvcompact:compaction_rounds_total"),
            evicted=count("kvcompact:tokens_evicted_total"), freed=count("kvcompact:blocks_freed_total"))

    def held_blocks(self, usage: float | None) -> float | None:
        """Blocks in use for a usage fraction: vLLM defines usage = 1 - free / (num_blocks - 1)."""
        return None if usage is None or not self.num_blocks else usage * (self.num_blocks - 1)


@dataclass(frozen=True)
class ProbeResult:
    """One bounded streaming request; ``samples`` pairs (tokens generated so far, kv_cache_usage_perc),
    taken before it starts and every ~0.5 s during it, so growth can be read per generated token."""

    tokens: int
    seconds: float
    samples: list[tuple[int, float]] = field(default_factory=list)
    timed_out: bool = False
    error: str | None = None

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0

    @property
    def peak_usage(self) -> float | None:
        return max((u for _, u in self.samples), default=None)

    def to_dict(self) -> dict:
        return {**asdict(self), "tokens_per_s": self.tokens_per_s, "peak_usage": self.peak_usage}


@dataclass(frozen=True)
class LogFacts:
    """What the server log said at start-up (the last start in the file wins)."""

    backend: str | None = None
    kv_cache_tokens: int | None = None
    num_blocks: int | None = None
    kvcompact_enabled: bool = False
    kvcompact_config: dict | None = None
    metrics_unexported: bool = False  # the plugin warned that its metrics cannot reach /metrics


@dataclass(frozen=True)
class Baseline:
    """The numbers of an earlier ``doctor --json`` report that the wall-1 comparison needs."""

    tokens_per_s: float | None = None
    peak_usage: float | None = None
    num_blocks: int | None = None
    resident_bytes: float | None = None

    @classmethod
    def from_report(cls, report: dict) -> Baseline:
        if not isinstance(report, dict) or "verdict" not in report or "after" not in report:
            raise DoctorError("baseline is not a report written by `kvcompact doctor --json`")
        probe, after = report.get("probe") or {}, report["after"]
        return cls(probe.get("tokens_per_s"), probe.get("peak_usage"), after.get("num_blocks"),
                   after.get("resident_bytes"))


@dataclass
class Diagnosis:
    verdict: str
    evidence: list[str]
    notes: list[str]

    @property
    def exit_code(self) -> int:
        return EXIT_CODES[self.verdict]

    @property
    def fix(self) -> str:
        return FIXES[self.verdict]


def diagnose(before: Snapshot, after: Snapshot, probe: ProbeResult | None = None, log: LogFacts | None = None,
             baseline: Baseline | None = None) -> Diagnosis:
    """Walk the runbook in order: no compression, wall 1, wall 2, capacity, healthy. First match wins."""
    notes = [DEVICE_NOTE, *_log_notes(after, log)]
    bs, policy = after.block_size, after.policy
    budget = _int((policy or {}).get("budget"))
    divide = _divide_length(policy, log)
    trigger = budget + divide if budget else 0  # a compressed request never holds more tokens than this
    growth = _probe_growth(after, probe, trigger)
    if probe:
        notes.append(f"probe: {probe.tokens} tokens in {probe.seconds:.1f} s ({probe.tokens_per_s:.1f} tok/s)"
                     + (", hit the time limit" if probe.timed_out else "") + (
                         f"; blocks held grew by {growth[0]:.1f} after token {trigger} where full attention adds "
                         f"{growth[1]:.1f}" if growth else "; too short to judge growth per token"))
    if policy is None:
        why = "no kvcompact:policy_info" if after.has_kvcompact else "no kvcompact: metrics"
        return Diagnosis(NO_COMPRESSION, [f"{why} on /metrics: the plugin is not loaded or not enabled"], notes)
    d_rounds = after.rounds - before.rounds
    if probe and budget and probe.tokens >= trigger + divide and d_rounds == 0:
        return Diagnosis(NO_COMPRESSION, [f"probe generated {probe.tokens} tokens, past budget {budget} + "
                                          f"{divide}, but no compaction round ran"], notes)
    if policy.get("needs_attention") == "true":
        return Diagnosis(WALL1, [f"policy {policy.get('policy')} needs attention weights (policy_info "
                                 "needs_attention=true): fused kernels never materialize them, so the engine "
                                 "falls back to eager attention"], notes)
    if baseline and not (probe and baseline.tokens_per_s):
        notes.append("--baseline compares probe throughput: both runs need --probe")
    regression = _baseline_regression(after, probe, baseline)
    if regression:
        return Diagnosis(WALL1, regression, notes)
    evicted, freed = after.evicted, after.freed  # since server start: counters reset with every restart
    counts = f"{after.rounds:.0f} rounds, {evicted:.0f} tokens evicted, {freed:.0f} blocks freed"
    if policy.get("compaction") == "none":
        return Diagnosis(WALL2, [f"compaction=none ({counts}): evicted tokens leave holes and a block returns "
                                 "to the pool only when every slot in it is empty"], notes)
    if evicted > 0 and freed == 0:
        return Diagnosis(WALL2, [f"{counts}: eviction scatters holes over every block"], notes)
    reclaim = freed * bs / evicted if evicted > 0 and bs else None
    if reclaim is not None and reclaim < MIN_RECLAIM:
        return Diagnosis(WALL2, [f"{counts}: reclaim {reclaim:.2f} of evicted slots (block size {bs}), "
                                 f"below {MIN_RECLAIM}"], notes)
    if growth and budget and growth[0] > max(0.5 * growth[1], divide / bs + 1):  # more than the sawtooth
        return Diagnosis(WALL2, [f"probe: blocks held grew by {growth[0]:.1f} after the cache passed budget "
                                 f"{budget} + {divide} tokens (full attention: {growth[1]:.1f}): not bounded"], notes)
    d_pre = after.preemptions - before.preemptions
    peak = max([u for u in (before.usage, after.usage, probe and probe.peak_usage) if u is not None], default=None)
    evidence = [f"{counts}" + (f" (reclaim {reclaim:.2f})" if reclaim is not None else ""),
                f"preemptions +{d_pre:.0f} during the observation (total {after.preemptions:.0f})",
                f"peak pool usage {peak:.2f}" if peak is not None else "pool usage not exported"]
    if evicted == 0:
        notes.append("nothing evicted yet, so compaction is unproven: rerun with --probe")
    if d_pre == 0 and after.preemptions > 0:
        notes.append(f"{after.preemptions:.0f} preemptions since start but none while watching: rerun under load "
                     "(a longer --interval, or --probe) to see whether they still climb")
    if d_pre > 0 or (peak is not None and peak >= USAGE_CEILING):
        return Diagnosis(CAPACITY, evidence, notes)
    return Diagnosis(HEALTHY, evidence, notes)


def _probe_growth(after: Snapshot, probe: ProbeResult | None, trigger: int) -> tuple[float, float] | None:
    """(blocks the probe added after ``trigger`` tokens, blocks full attention adds for those tokens), or None
    when the pool size is unknown or too few tokens followed the trigger to tell growth from the sawtooth."""
    if not probe or not after.block_size or not after.num_blocks:
        return None
    points = [(t, after.held_blocks(u)) for t, u in probe.samples if t >= trigger]
    if len(points) < 2 or (points[-1][0] - points[0][0]) / after.block_size < MIN_GROWTH_BLOCKS:
        return None
    return points[-1][1] - points[0][1], (points[-1][0] - points[0][0]) / after.block_size


def _baseline_regression(after: Snapshot, probe: ProbeResult | None, base: Baseline | None) -> list[str]:
    """Wall 1 seen from outside: throughput dropped and some memory signal rose against the baseline."""
    if not base or not probe or not base.tokens_per_s or probe.tokens_per_s >= THROUGHPUT_DROP * base.tokens_per_s:
        return []
    rises = []
    peak = probe.peak_usage
    if peak is not None and base.peak_usage and peak > MEMORY_RISE * base.peak_usage:
        rises.append(f"peak pool usage {peak:.2f} vs baseline {base.peak_usage:.2f}")
    if after.resident_bytes and base.resident_bytes and after.resident_bytes > MEMORY_RISE * base.resident_bytes:
        rises.append(f"resident memory {after.resident_bytes / 2**30:.2f} GiB vs {base.resident_bytes / 2**30:.2f}")
    if after.num_blocks and base.num_blocks and after.num_blocks * MEMORY_RISE < base.num_blocks:
        rises.append(f"pool shrank to {after.num_blocks} blocks from {base.num_blocks}: non-KV memory rose")
    if not rises:
        return []
    return [f"throughput {probe.tokens_per_s:.1f} tok/s vs baseline {base.tokens_per_s:.1f}", *rises]


def _log_notes(after: Snapshot, log: LogFacts | None) -> list[str]:
    if log is None:
        return []
    notes = [f"log: attention backend {log.backend or 'not logged'}, KV cache "
             f"{log.kv_cache_tokens if log.kv_cache_tokens is not None else '?'} tokens, "
             f"kvcompact {json.dumps(log.kvcompact_config) if log.kvcompact_enabled else 'not in log'}"]
    if log.metrics_unexported:
        notes.append("log: PROMETHEUS_MULTIPROC_DIR was not set, so kvcompact's metrics never reach /metrics "
                     "and doctor cannot see compression: start the server with `kvcompact serve`")
    elif log.kvcompact_enabled and after.policy is None:
        notes.append("log says 'kvcompact: enabled' but /metrics has no policy_info: a different server, "
                     "or the plugin's metrics are not exported")
    if log.num_blocks and after.num_blocks and log.num_blocks != after.num_blocks:
        notes.append(f"log pool {log.num_blocks} blocks != /metrics {after.num_blocks}: another server's log?")
    return notes


_BACKEND = re.compile(r"Using (\w+) (?:attention )?backend\b")  # GPU: "Using X attention backend", CPU MLA
_KV_TOKENS = re.compile(r"KV cache size: ([\d,]+) tokens")
_BLOCKS = re.compile(r"# [GC]PU blocks: ([1-9]\d*)|num_gpu_blocks is: (\d+)")
_KVCOMPACT = "kvcompact: enabled"


def parse_log(text: str) -> LogFacts:
    """Extract start-up facts; later lines overwrite earlier ones so the last (re)start wins."""
    facts: dict = {}
    for line in text.splitlines():
        if m := _BACKEND.search(line):
            facts["backend"] = m.group(1)
        if m := _KV_TOKENS.search(line):
            facts["kv_cache_tokens"] = int(m.group(1).replace(",", ""))
        if m := _BLOCKS.search(line):
            facts["num_blocks"] = int(m.group(1) or m.group(2))
        if "PROMETHEUS_MULTIPROC_DIR is not set" in line:
            facts["metrics_unexported"] = True
        if (i := line.find(_KVCOMPACT)) >= 0:
            facts["kvcompact_enabled"] = True
            try:
                facts["kvcompact_config"] = json.loads(line[i + len(_KVCOMPACT):])
            except ValueError:
                facts["kvcompact_config"] = None
    return LogFacts(**facts)


def _divide_length(policy: dict[str, str] | None, log: LogFacts | None) -> int:
    """Tokens per compaction round: policy_info's label, else the plugin's startup line, else the default."""
    from_log = ((log and log.kvcompact_config) or {}).get("divide_length")
    return _int((policy or {}).get("divide_length")) or _int(from_log) or DIVIDE_LENGTH


def _int(value: object) -> int | None:
    try:
        return int(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return None


def _get(url: str, timeout: float, data: bytes | None = None) -> urllib.request.addinfourl:
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        return urllib.request.urlopen(request, timeout=timeout)
    except urllib.error.HTTPError as e:
        raise _HTTPStatusError(f"{url}: HTTP {e.code} {e.reason}") from None
    except (urllib.error.URLError, OSError, ValueError) as e:
        raise DoctorError(f"cannot reach {url}: {getattr(e, 'reason', e)}") from None


def fetch_model(base: str, timeout: float) -> str:
    """The served model id; also proves the URL is an OpenAI-compatible server."""
    try:
        with _get(base + "/v1/models", timeout) as resp:
            return json.loads(resp.read())["data"][0]["id"]
    except (_HTTPStatusError, ValueError, KeyError, IndexError, TypeError, OSError) as e:
        why = e if isinstance(e, _HTTPStatusError) else "no model list"
        raise DoctorError(f"{base} is not an OpenAI-compatible endpoint ({why})") from None


def scrape(base: str, timeout: float) -> Snapshot:
    try:
        with _get(base + "/metrics", timeout) as resp:
            metrics = parse_metrics(resp.read().decode("utf-8", "replace"))
    except MetricsParseError as e:
        raise DoctorError(f"{base}/metrics is malformed: {e}") from None
    except OSError as e:
        raise DoctorError(f"cannot read {base}/metrics: {e}") from None
    if not metrics.has_prefix("vllm:"):
        raise DoctorError(f"{base}/metrics has no vllm: metrics: not a vLLM server")
    return Snapshot.from_metrics(metrics)


def run_probe(base: str, model: str, max_tokens: int, time_limit: float, timeout: float,
              interval: float = 0.5) -> ProbeResult:
    """Stream one long completion (EOS ignored so it runs to max_tokens) while sampling pool usage."""
    body = {"model": model, "prompt": "Write a long, detailed story about a lighthouse keeper.",
            "max_tokens": max_tokens, "stream": True, "ignore_eos": True, "temperature": 0.0,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    state: dict = {"tokens": 0, "error": None}
    stop = threading.Event()

    def read() -> None:
        try:
            with _get(base + "/v1/completions", timeout, json.dumps(body).encode()) as resp:
                for raw in resp:  # closing early makes vLLM abort the request
                    line = raw.decode("utf-8", "replace").strip()
                    if stop.is_set():
                        break
                    if line.startswith("data:") and line != "data: [DONE]":
                        usage = json.loads(line[5:]).get("usage")
                        state["tokens"] = usage["completion_tokens"] if usage else state["tokens"] + 1
        except (DoctorError, OSError, ValueError, KeyError) as e:
            state["error"] = str(e)

    samples = [(0, scrape(base, timeout).usage)]
    start = time.monotonic()
    thread = threading.Thread(target=read, daemon=True)
    thread.start()
    while thread.is_alive() and time.monotonic() - start < time_limit:
        thread.join(interval)
        samples.append((state["tokens"], scrape(base, timeout).usage))
    stop.set()
    seconds = time.monotonic() - start
    if state["error"] and not state["tokens"]:
        raise DoctorError(f"probe request failed: {state['error']}")
    return ProbeResult(state["tokens"], seconds, [(t, u) for t, u in samples if u is not None],
                       thread.is_alive(), state["error"])


_SERVER_LABELS = ("engine", "model_name")


def format_report(report: dict) -> str:
    a = report["after"]
    usage = "not exported" if a["usage"] is None else f"{a['usage']:.2f}"
    if a["num_blocks"] and a["usage"] is not None:
        usage += f", ~{(a['num_blocks'] - 1) * (1 - a['usage']):.0f} blocks free"
    policy = " ".join(f"{k}={v}" for k, v in (a["policy"] or {}).items() if k not in _SERVER_LABELS)
    lines = [f"kvcompact doctor: {report['url']} (model {report['model']})",
             f"pool: {a['num_blocks']} blocks x {a['block_size']} tokens, usage {usage}, running "
             f"{a['running']:.0f}, waiting {a['waiting']:.0f}, preemptions {a['preemptions']:.0f}",
             f"kvcompact: {policy or 'not active'}; rounds {a['rounds']:.0f}, evicted {a['evicted']:.0f} "
             f"tokens, freed {a['freed']:.0f} blocks",
             f"VERDICT: {report['verdict']} (exit {report['exit_code']})"]
    lines += [f"  evidence: {e}" for e in report["evidence"]]
    lines += [f"  next step: {report['fix']}"] + [f"  note: {n}" for n in report["notes"]]
    return "\n".join(lines)


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # argparse would exit 2, which means "no compression" here
        raise DoctorError(message)


def main(argv: list[str] | None = None) -> int:
    """CLI entry; returns the exit code (0 healthy, 2-5 per verdict, 1 tool error) and never raises."""
    p = _Parser(prog="kvcompact doctor", description="Diagnose 'KV compression enabled, no memory savings'.")
    p.add_argument("--url", required=True, help="vLLM OpenAI server, e.g. http://127.0.0.1:8000")
    p.add_argument("--probe", action="store_true", help="send one long streaming request and watch the pool")
    p.add_argument("--probe-tokens", type=int, default=2048,
                   help="cap on the probe's length; it asks for 2 x (budget + divide_length)")
    p.add_argument("--probe-seconds", type=float, default=120.0, help="time limit of the probe")
    p.add_argument("--interval", type=float, default=1.0, help="seconds between the two scrapes without --probe")
    p.add_argument("--log", help="server log file to read start-up facts from")
    p.add_argument("--baseline", help="JSON written by an earlier `kvcompact doctor --json`")
    p.add_argument("--timeout", type=float, default=10.0, help="HTTP timeout in seconds")
    p.add_argument("--json", action="store_true", help="print a machine-readable report")
    try:
        args = p.parse_args(argv)
        base = args.url.rstrip("/")
        log = baseline = None
        if args.log:
            with open(args.log, encoding="utf-8", errors="replace") as f:
                log = parse_log(f.read())
        if args.baseline:
            with open(args.baseline, encoding="utf-8") as f:
                baseline = Baseline.from_report(json.load(f))
        model = fetch_model(base, args.timeout)
        before = scrape(base, args.timeout)
        probe = None
        if args.probe:
            budget = _int((before.policy or {}).get("budget"))
            divide = _divide_length(before.policy, log)
            tokens = min(args.probe_tokens, 2 * (budget + divide)) if budget else args.probe_tokens
            probe = run_probe(base, model, tokens, args.probe_seconds, args.timeout)
        else:
            time.sleep(args.interval)
        after = scrape(base, args.timeout)
    except SystemExit as e:  # --help
        return int(e.code or 0)
    except (DoctorError, OSError, ValueError) as e:
        print(f"kvcompact doctor: error: {e}", file=sys.stderr)
        return EXIT_TOOL_ERROR
    d = diagnose(before, after, probe, log, baseline)
    report = {"url": base, "model": model, "verdict": d.verdict, "exit_code": d.exit_code, "evidence": d.evidence,
              "fix": d.fix, "notes": d.notes, "before": asdict(before), "after": asdict(after),
              "probe": probe.to_dict() if probe else None, "log": asdict(log) if log else None}
    print(json.dumps(report, indent=2) if args.json else format_report(report))
    return d.exit_code
