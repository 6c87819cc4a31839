"""``kvcompact doctor``: the runbook "KV compression enabled, no memory savings" as a command.

It works from the outside like an operator: ``/metrics``, the OpenAI API and optionally the server log
(:mod:`kvcompact.tools.doctor_io` reads them). The classification (:func:`diagnose`) is a pure function of what was
read, so every branch of the runbook is unit tested with constructed snapshots. Device memory (nvidia-smi) is
reserved at start-up and never moves, so the signals are pool occupancy, preemptions and freed blocks.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import NoReturn

from kvcompact.config import SHRINKING_MODES, KVCompactConfig
from kvcompact.ledger import trigger
from kvcompact.tools.doctor_io import (
    PROMPT_ALLOWANCE,
    DoctorError,
    LogFacts,
    ProbeResult,
    Snapshot,
    fetch_model,
    parse_log,
    read_log,
    run_probe,
    scrape,
    to_int,
    watch,
)

__all__ = ["CAPACITY", "FAULTS", "HEALTHY", "NO_COMPRESSION", "QUALITY", "WALL1", "WALL2", "Baseline", "Diagnosis",
           "DoctorError", "GateResult", "LogFacts", "ProbeResult", "Snapshot", "diagnose", "main", "parse_log"]

HEALTHY, NO_COMPRESSION, WALL1, WALL2, CAPACITY = "healthy", "no compression active", "wall 1", "wall 2", "capacity"
FAULTS, QUALITY = "faults", "quality"
EXIT_CODES = {HEALTHY: 0, NO_COMPRESSION: 2, WALL1: 3, WALL2: 4, CAPACITY: 5, FAULTS: 6, QUALITY: 7}
EXIT_TOOL_ERROR = 1
USAGE_CEILING = 0.98      # vLLM preempts when the pool is full; >= this means no headroom is left
QUEUE_USAGE = 0.75        # requests waiting while the pool is this full wait for KV blocks, not for a free seat
MIN_RECLAIM = 0.5         # freed slots / evicted tokens; compaction frees ~1, scattered holes ~0
DIVIDE_LENGTH = KVCompactConfig.divide_length  # the default: the one in the config
MIN_GROWTH_BLOCKS = 4     # the probe judges growth only over at least this many blocks' worth of tokens
PROBE_RUNS = 3            # probes run, at most, to get samples dense enough to judge growth
THROUGHPUT_DROP = 0.8     # probe tok/s below this fraction of the baseline counts as a drop
MEMORY_RISE = 1.1         # a memory signal 10% above the baseline counts as a rise
LOOPING_SHARE = 0.05      # looping answers above this share of finished requests: the budget is too small
MIN_FINISHED = 20         # ...judged only over at least this many finished requests (one loop in a probe is noise)
DEVICE_NOTE = ("device memory (nvidia-smi) is reserved for the KV pool at start-up and never moves: it is not the "
               "signal; pool occupancy (vllm:kv_cache_usage_perc), preemptions and freed blocks are")
FIXES = {
    NO_COMPRESSION: "enable kvcompact, e.g. `kvcompact serve --budget N` (plugin installed in the server's venv)",
    WALL1: "use a score-free policy that never needs attention weights, e.g. KVCOMPACT_POLICY=triattention, "
           "so the fused attention kernels stay in use",
    WALL2: "turn compaction on (KVCOMPACT_COMPACTION=repack or holefill): only moving survivors together "
           "empties whole blocks",
    CAPACITY: "size the pool (VLLM_CPU_KVCACHE_SPACE / --gpu-memory-utilization / --num-gpu-blocks-override), "
              "use an fp8 KV cache (--kv-cache-dtype fp8: it halves a bf16 request's footprint on top of "
              "compression, the two multiply), lower --max-num-seqs or --max-model-len, or lower the budget; "
              "`kvcompact capacity --kv-cache-dtype fp8 --budget B` does the arithmetic",
    FAULTS: "read the server log for 'kvcompact: request ... finished with an error' and its exception "
            "(RELIABILITY.md says what each failure means); the server kept serving the other requests",
    QUALITY: "raise the budget (or use budget_mode pressure, which compresses only when the pool is short); "
             "`kvcompact bench accuracy --gate --model DIR` measures the loss on your model",
    HEALTHY: "nothing to fix; keep this report (`--json > baseline.json`) and pass it as --baseline next time",
}


@dataclass(frozen=True)
class GateResult:
    """What ``--accuracy-gate`` measured: the accuracy gate (``kvcompact bench accuracy --gate``) at the server's
    policy and budget, on the served model's folder."""

    passed: bool
    summary: str


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
             baseline: Baseline | None = None, during: Sequence[Snapshot] = (), gate: GateResult | None = None
             ) -> Diagnosis:
    """Walk the runbook in order: no compression, faults, wall 1, wall 2, capacity, quality, healthy. First match
    wins. ``during`` are the scrapes taken between ``before`` and ``after`` while watching without a probe;
    ``gate`` the opt-in accuracy gate's result."""
    notes = [DEVICE_NOTE, *_log_notes(after, log)]
    bs, policy = after.block_size, after.policy
    budget = to_int((policy or {}).get("budget"))
    divide = _divide_length(policy, log)
    trigger = budget + divide if budget else 0  # a compressed request never holds more tokens than this
    growth = _probe_growth(after, probe, trigger)
    if probe:
        notes.append(f"probe: {probe.tokens} tokens in {probe.seconds:.1f} s ({probe.tokens_per_s:.1f} tok/s)"
                     + (", hit the time limit" if probe.timed_out else "") + (
                         f"; blocks held grew by {growth[0]:.1f} after token {trigger} where full attention adds "
                         f"{growth[1]:.1f}" if growth else "; too short to judge growth per token")
                     + (f" (probe run {probe.runs} times: the earlier samples were too sparse to judge growth)"
                        if probe.runs > 1 else ""))
        if probe.tokens == 0 and probe.timed_out:
            notes.append(f"the probe got no token in {probe.seconds:.0f} s: it queued behind other requests, or the "
                         "server is stalled")
        if budget and probe.requested and probe.requested < trigger + divide:
            notes.append(f"probe asked for only {probe.requested} tokens, short of two rounds (budget {budget} + "
                         f"2 x {divide}): raise --probe-tokens, or the server's --max-model-len")
    if policy is None:
        why = "no kvcompact:policy_info" if after.has_kvcompact else "no kvcompact: metrics"
        return Diagnosis(NO_COMPRESSION, [f"{why} on /metrics: the plugin is not loaded or not enabled"], notes)
    if after.compaction_failures > 0:
        return Diagnosis(FAULTS, [f"{after.compaction_failures:.0f} requests ended with an error because their "
                                  "compaction failed (kvcompact:compaction_failures_total, since start)"], notes)
    d_rounds = after.rounds - before.rounds
    # Budget mode "pressure" (and "latch" until its first round): the budget is a floor and rounds run only when
    # the pool is short, so a probe on a roomy pool rightly keeps every token: neither "no round" nor unbounded
    # growth is a fault there.
    pressure = policy.get("budget_mode") in SHRINKING_MODES
    if pressure:
        notes.append(f"budget_mode={policy.get('budget_mode')}: rounds run only when the pool cannot cover the "
                     "next step (budget is the floor); with room, requests keep full attention, so a probe alone "
                     "proves nothing about compaction: judge it under load")
    if probe and budget and probe.tokens >= trigger + divide and d_rounds == 0 and not pressure:
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
    if growth and budget and bs and growth[0] > max(0.5 * growth[1], divide / bs + 1) and not pressure:
        return Diagnosis(WALL2, [f"probe: blocks held grew by {growth[0]:.1f} after the cache passed budget "
                                 f"{budget} + {divide} tokens (full attention: {growth[1]:.1f}): not bounded"], notes)
    d_pre = after.preemptions - before.preemptions
    seen = [before, *during, after]
    peak = max([u for u in (*(s.usage for s in seen), probe.peak_usage if probe else None) if u is not None],
               default=None)
    evidence = [f"{counts}" + (f" (reclaim {reclaim:.2f})" if reclaim is not None else ""),
                f"preemptions +{d_pre:.0f} during the observation (total {after.preemptions:.0f})",
                f"peak pool usage {peak:.2f}" + _held(after, peak) if peak is not None else "pool usage not exported"]
    if after.usage is None:
        notes.append("vllm:kv_cache_usage_perc is not on /metrics yet: with multiprocess metrics (kvcompact serve) "
                     "vLLM exports its gauges only after the first request; send traffic or use --probe")
    if evicted == 0:
        notes.append("nothing evicted yet, so compaction is unproven: rerun with --probe")
    if d_pre == 0 and after.preemptions > 0:
        notes.append(f"{after.preemptions:.0f} preemptions since start but none while watching: rerun under load "
                     "(a longer --interval, or --probe) to see whether they still climb")
    queued, most = _queued(seen), max(seen, key=_waiting)
    if queued:
        evidence.append(queued)
    elif _waiting(most) > 0:
        notes.append(f"{_waiting(most):.0f} requests wait although the pool has room (usage {most.usage or 0:.2f}): "
                     "the limit is --max-num-seqs or --max-num-batched-tokens, not KV memory, unless this watch fell "
                     "between two waves of a full pool (vLLM's gauges lag while the next prompts prefill): watch "
                     "longer (--interval 30) under the same load")
    if d_pre > 0 or (peak is not None and peak >= USAGE_CEILING) or queued:
        return Diagnosis(CAPACITY, evidence, notes)
    quality = _quality(after, gate, notes)
    if quality:
        return Diagnosis(QUALITY, quality, notes)
    return Diagnosis(HEALTHY, evidence, notes)


def _quality(after: Snapshot, gate: GateResult | None, notes: list[str]) -> list[str]:
    """Answers lost to compression: looping answers above LOOPING_SHARE of at least MIN_FINISHED finished
    requests (since start), or a failed accuracy gate. Fewer finished requests only make a note."""
    evidence = []
    if after.looping and after.finished >= MIN_FINISHED and after.looping > LOOPING_SHARE * after.finished:
        evidence.append(f"{after.looping:.0f} of {after.finished:.0f} finished requests ended in a loop after "
                        f"compaction rounds (kvcompact:looping_requests_total), above {LOOPING_SHARE:.0%}")
    elif after.looping:
        notes.append(f"{after.looping:.0f} of {after.finished:.0f} finished requests ended in a loop after rounds: "
                     f"below {LOOPING_SHARE:.0%} of requests, or fewer than {MIN_FINISHED} finished to judge by")
    if gate is not None and not gate.passed:
        evidence.append(f"accuracy gate failed: {gate.summary}")
    elif gate is not None:
        notes.append(f"accuracy gate passed: {gate.summary}")
    return evidence


def _waiting(s: Snapshot) -> float:
    """Requests waiting for scheduling capacity (vLLM 0.32 splits off the deferred ones by label), else all."""
    return s.waiting_capacity if s.waiting_capacity is not None else s.waiting


def _queued(seen: Sequence[Snapshot]) -> str | None:
    """Capacity seen as a queue: with compression bounding every request, a small pool shows up as requests
    waiting for blocks, not as preemptions (a running request's footprint no longer grows). The latest scrape
    that shows one is the evidence."""
    for s in reversed(seen):
        if _waiting(s) > 0 and s.usage is not None and s.usage >= QUEUE_USAGE:
            free = "" if not s.num_blocks else f", ~{(s.num_blocks - 1) * (1 - s.usage):.0f} of {s.num_blocks - 1} " \
                                               "usable blocks free"
            return (f"{_waiting(s):.0f} requests waiting for capacity with {s.running:.0f} running and the pool "
                    f"{s.usage:.2f} full{free}")
    return None


def _held(after: Snapshot, usage: float) -> str:
    held = after.held_blocks(usage)
    return "" if held is None else f" (~{held:.0f} of {(after.num_blocks or 1) - 1} usable blocks held)"


def probe_length(before: Snapshot, log: LogFacts | None, cap: int, max_model_len: int | None) -> int:
    """max_tokens for the probe: past the first round (budget + divide_length) by the longer of another
    budget + divide_length and four times the blocks needed to tell growth from the sawtooth (a busy server on
    two cores answers /metrics slowly, and samples seconds apart must still span that many blocks); at most
    ``cap``, and short enough that the prompt still fits the server's max_model_len (vLLM refuses longer
    requests)."""
    budget = to_int((before.policy or {}).get("budget"))
    tokens = cap
    if budget:
        first = trigger(budget, _divide_length(before.policy, log))
        tokens = min(cap, first + max(first, 4 * MIN_GROWTH_BLOCKS * (before.block_size or 16)))
    if max_model_len:
        tokens = min(tokens, max_model_len - PROMPT_ALLOWANCE)
    return max(tokens, 1)


def _probe_growth(after: Snapshot, probe: ProbeResult | None, trigger: int) -> tuple[float, float] | None:
    """(blocks the probe added after ``trigger`` tokens, blocks full attention adds for those tokens), or None
    when the pool size is unknown or too few tokens followed the trigger to tell growth from the sawtooth."""
    if not probe or not after.block_size or not after.num_blocks:
        return None
    held = [(t, after.held_blocks(u)) for t, u in probe.samples if t >= trigger]
    points = [(t, h) for t, h in held if h is not None]
    if len(points) < 2 or (points[-1][0] - points[0][0]) / after.block_size < MIN_GROWTH_BLOCKS:
        return None
    return points[-1][1] - points[0][1], (points[-1][0] - points[0][0]) / after.block_size


def probe_until_judged(before: Snapshot, log: LogFacts | None, base: str, model: str, tokens: int,
                       seconds: float, timeout: float, api_key: str | None) -> ProbeResult:
    """Run the probe, and again (at most PROBE_RUNS in all, each within what is left of ``seconds``) while it ran
    to the end but its samples are too sparse past the first round to judge growth: a host that stalls the
    server's HTTP side for half a minute leaves a gap no single probe can fill, and a second probe usually
    does not meet the same stall. A probe too short to span MIN_GROWTH_BLOCKS blocks past the first round
    (``--probe-tokens``, or the server's context) runs once: no second run could judge growth either. The result
    counts its runs."""
    budget = to_int((before.policy or {}).get("budget"))
    first = trigger(budget, _divide_length(before.policy, log)) if budget else 0
    judgeable = not before.block_size or tokens - first >= MIN_GROWTH_BLOCKS * before.block_size
    deadline, runs = time.monotonic() + seconds, 0
    while True:
        runs += 1
        probe = run_probe(base, model, tokens, deadline - time.monotonic(), timeout, api_key=api_key)
        left = deadline - time.monotonic()
        if (not budget or not judgeable or runs == PROBE_RUNS or probe.timed_out or probe.error
                or left < probe.seconds or _probe_growth(before, probe, first) is not None):
            return replace(probe, runs=runs)


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
    backend = log.backend or "not logged"
    if log.backend_inferred:
        backend += " (vllm-cpu selects it without a log line: its only non-MLA backend)"
    notes = [f"log: attention backend {backend}, {log.device or ''} KV cache ".replace("  ", " ")
             + f"{log.kv_cache_tokens if log.kv_cache_tokens is not None else '?'} tokens"
             + (f" in {log.num_blocks} blocks" if log.num_blocks else "")
             + f", kvcompact {json.dumps(log.kvcompact_config) if log.kvcompact_enabled else 'not in log'}"]
    if log.metrics_unexported:
        notes.append("log: PROMETHEUS_MULTIPROC_DIR was not set, so kvcompact's metrics never reach /metrics "
                     "and doctor cannot see compression: start the server with `kvcompact serve`")
    elif log.kvcompact_enabled and after.policy is None:
        notes.append("log says 'kvcompact: enabled' but /metrics has no policy_info: a different server, "
                     "or the plugin's metrics are not exported")
    if log.num_blocks and after.num_blocks and log.num_blocks != after.num_blocks:
        notes.append(f"log pool {log.num_blocks} blocks != /metrics {after.num_blocks}: another server's log?")
    elif log.kv_cache_tokens and after.kv_cache_tokens and log.kv_cache_tokens != after.kv_cache_tokens:
        notes.append(f"log KV cache {log.kv_cache_tokens} tokens != /metrics {after.kv_cache_tokens}: another "
                     "server's log?")
    return notes


def _divide_length(policy: dict[str, str] | None, log: LogFacts | None) -> int:
    """Tokens per compaction round: policy_info's label, else the plugin's startup line, else the default."""
    from_log = ((log and log.kvcompact_config) or {}).get("divide_length")
    return to_int((policy or {}).get("divide_length")) or to_int(from_log) or DIVIDE_LENGTH


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
    def error(self, message: str) -> NoReturn:  # argparse would exit 2, which means "no compression" here
        raise DoctorError(message)


DEFAULT_URL = "http://127.0.0.1:8000"  # vLLM's default port, on the host kvcompact serve binds


def run_accuracy_gate(folder: str, policy: dict[str, str], log: LogFacts | None, tokens: int | None,
                      tolerance: float | None) -> GateResult:
    """``kvcompact bench accuracy --gate`` on ``folder`` (the served model's) at the server's policy and budget
    (``kvcompact:policy_info``) and its recent window (the start-up log's, else the default): perplexity through
    the transformers reference, full attention against compressed. Needs kvcompact[bench]; minutes on a CPU."""
    from kvcompact.tools.model import prepared_stats

    name, budget = policy.get("policy", ""), policy.get("budget", "")
    window = ((log.kvcompact_config if log else None) or {}).get("window") or KVCompactConfig.window
    command = [sys.executable, "-m", "kvcompact.tools.cli", "bench", "accuracy", "--gate", "--tests", "ppl",
               "--model", folder, "--policies", name, "--budgets", budget, "--window", str(window)]
    if name == "triattention":
        stats = prepared_stats(folder)
        if stats is None:
            raise DoctorError(f"--accuracy-gate {folder}: policy triattention scores with the statistics "
                              f"`kvcompact prepare --model {folder}` makes, and there are none")
        command += ["--stats", str(stats)]
    command += ["--tokens", str(tokens)] if tokens else []
    command += ["--tolerance", str(tolerance)] if tolerance is not None else []
    with tempfile.TemporaryDirectory(prefix="kvcompact-gate-") as out:
        r = subprocess.run([*command, "--out", out], capture_output=True, text=True)
        results = sorted(Path(out).glob("accuracy/*/result.json"))
        if r.returncode not in (0, 1) or not results:
            tail = " ".join(r.stderr.split())[-400:]
            raise DoctorError(f"--accuracy-gate {folder}: the gate did not run (exit {r.returncode}): {tail}")
        gate = json.loads(results[-1].read_text())["result"].get("gate") or {}
    checks = gate.get("checks") or []
    summary = "; ".join(f"{c['policy']} at budget {c['budget']}: perplexity {c['ppl']:.3f} vs {c['ppl_full']:.3f} "
                        f"with full attention ({c['rel_increase']:+.1%}, tolerance {c['tolerance']:.0%})"
                        for c in checks) or f"no cell for {name} at budget {budget}"
    return GateResult(bool(gate.get("pass")) and bool(checks), summary)


def base_url(text: str) -> str:
    """``--url`` as typed (``127.0.0.1:8000``, ``http://host:8000/``) -> ``scheme://host:port``; only
    http and https are spoken."""
    url = text.strip()
    scheme, _, rest = url.partition("://") if "://" in url else ("http", "", url)
    rest = rest.rstrip("/")
    if scheme.lower() not in ("http", "https") or not rest:
        raise DoctorError(f"--url {text!r}: expected http://HOST:PORT (vLLM's server speaks http or https)")
    return f"{scheme}://{rest}"


def main(argv: list[str] | None = None) -> int:
    """CLI entry; returns the exit code (0 healthy, 2-7 per verdict, 1 tool error) and never raises. With
    ``--json`` a tool error is a JSON object on stdout as well (``exit_code`` 1 and ``error``)."""
    argv = sys.argv[1:] if argv is None else argv
    p = _Parser(prog="kvcompact doctor", description="Diagnose 'KV compression enabled, no memory savings'.")
    p.add_argument("--url", default=DEFAULT_URL, help=f"vLLM OpenAI server (default {DEFAULT_URL}; http:// is "
                   "added when no scheme is given)")
    p.add_argument("--model", help="the served model to examine, for an endpoint (a router) that serves several: "
                   "its /v1/models id, and its model_name on /metrics (default: the only model served)")
    p.add_argument("--api-key", default=os.environ.get("VLLM_API_KEY"),
                   help="the key the server was started with (vLLM's --api-key; default: $VLLM_API_KEY)")
    p.add_argument("--probe", action="store_true", help="send one long streaming request and watch the pool")
    p.add_argument("--probe-tokens", type=int, default=2048,
                   help="cap on the probe's length; it asks for about 2 x (budget + divide_length), "
                        "within the server's max_model_len")
    p.add_argument("--probe-seconds", type=float, default=120.0, help="time limit of the probe")
    p.add_argument("--interval", type=float, default=1.0,
                   help="seconds to watch /metrics without --probe (a scrape every 0.5 s)")
    p.add_argument("--log", help="server log file to read start-up facts from")
    p.add_argument("--baseline", help="JSON written by an earlier `kvcompact doctor --json`")
    p.add_argument("--timeout", type=float, default=10.0, help="HTTP timeout in seconds (a /metrics scrape that "
                   "times out is tried once more)")
    p.add_argument("--accuracy-gate", metavar="DIR", help="also run the accuracy gate (`kvcompact bench accuracy "
                   "--gate`) on DIR, the served model's folder, at the server's policy and budget: perplexity lost "
                   "beyond the tolerance is verdict quality (opt-in: minutes on a CPU; needs kvcompact[bench])")
    p.add_argument("--gate-tokens", type=int, help="tokens of text the gate measures (default: the gate's, 4096)")
    p.add_argument("--gate-tolerance", type=float, help="relative perplexity increase the gate allows (default: "
                   "the gate's, 0.10)")
    p.add_argument("--json", action="store_true", help="print a machine-readable report")
    base = None
    try:
        args = p.parse_args(argv)
        base, key = base_url(args.url), args.api_key
        log = baseline = None
        if args.log:
            log = read_log(args.log)
        if args.baseline:
            with open(args.baseline, encoding="utf-8") as f:
                baseline = Baseline.from_report(json.load(f))
        model, max_model_len = fetch_model(base, args.timeout, key, args.model)
        before = scrape(base, args.timeout, key, args.model)
        probe, during = None, []
        if args.probe:
            tokens = probe_length(before, log, args.probe_tokens, max_model_len)
            probe = probe_until_judged(before, log, base, model, tokens, args.probe_seconds, args.timeout, key)
        else:
            during = watch(base, args.interval, args.timeout, api_key=key, model=args.model)
        after = during.pop() if during else scrape(base, args.timeout, key, args.model)
        if args.log:  # again: the plugin's worker logs its line at the first step, maybe during the probe
            log = read_log(args.log)
        gate = None
        if args.accuracy_gate and after.policy is not None:
            gate = run_accuracy_gate(args.accuracy_gate, after.policy, log, args.gate_tokens, args.gate_tolerance)
    except SystemExit as e:  # --help
        return int(e.code or 0)
    except (DoctorError, OSError, ValueError) as e:
        print(f"kvcompact doctor: error: {e}", file=sys.stderr)
        if "--json" in argv:  # also when parsing failed before --json was read
            print(json.dumps({"url": base, "verdict": None, "exit_code": EXIT_TOOL_ERROR, "error": str(e)}, indent=2))
        return EXIT_TOOL_ERROR
    d = diagnose(before, after, probe, log, baseline, during, gate)
    report = {"url": base, "model": model, "verdict": d.verdict, "exit_code": d.exit_code, "evidence": d.evidence,
              "fix": d.fix, "notes": d.notes, "before": asdict(before), "after": asdict(after),
              "probe": probe.to_dict() if probe else None, "log": asdict(log) if log else None,
              "accuracy_gate": asdict(gate) if gate else None}
    print(json.dumps(report, indent=2) if args.json else format_report(report))
    return d.exit_code
