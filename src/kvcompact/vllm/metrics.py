"""kvcompact's Prometheus metrics, served on vLLM's own ``/metrics``.

They are recorded in the engine-core process (by the scheduler, once per round, whatever the number of
workers) and reach the API server's ``/metrics`` through prometheus_client's multiprocess mode, the mechanism
vLLM itself uses with several API servers: ``kvcompact serve`` points ``PROMETHEUS_MULTIPROC_DIR`` at a fresh
directory before vLLM starts. Without it (a plain ``vllm serve`` with the plugin configured) the values are
still kept in :attr:`Metrics.totals` and the startup log says where the metrics went.

The headline figure is ``blocks_freed_total``, not ``tokens_evicted_total``: evicted tokens that leave
survivors in every block free no memory.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass, field
from typing import Any

from kvcompact.config import KVCompactConfig
from kvcompact.vllm.protocol import WorkerReport

_SECONDS_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


@dataclass
class Totals:
    rounds: int = 0
    tokens_evicted: int = 0
    blocks_freed: int = 0
    blocks_copied: int = 0
    tokens_moved: int = 0
    bytes_moved: int = 0
    scoring_failures: int = 0
    compaction_seconds: list[float] = field(default_factory=list)


def multiprocess_enabled() -> bool:
    return bool(os.environ.get("PROMETHEUS_MULTIPROC_DIR"))


@functools.cache
def _families() -> dict[str, Any]:
    """The metric families, registered once per process (an engine may be built several times in one)."""
    from prometheus_client import Counter, Gauge, Histogram

    names = ["model_name"]
    return {
        "rounds": Counter("kvcompact:compaction_rounds", "Compaction rounds run.", names),
        "evicted": Counter("kvcompact:tokens_evicted", "KV tokens evicted per KV head.", names),
        "freed": Counter("kvcompact:blocks_freed", "KV blocks returned to vLLM's block pool.", names),
        "copied": Counter("kvcompact:blocks_copied",
                          "Shared or prefix-cached blocks a round copied into private ones (copy on write).", names),
        "moved": Counter("kvcompact:tokens_moved",
                         "Token slots copied by compaction, summed over layers and KV heads.", names),
        "failures": Counter("kvcompact:scoring_failures",
                            "Rounds whose scoring failed and fell back to keeping the most recent tokens.", names),
        "compaction_s": Histogram("kvcompact:compaction_seconds",
                                  "Worker time of one round: gather, score, select, move.", names,
                                  buckets=_SECONDS_BUCKETS),
        "scoring_s": Histogram("kvcompact:scoring_seconds", "Scoring and selection time of one round.", names,
                               buckets=_SECONDS_BUCKETS),
        "compressed": Gauge("kvcompact:compressed_requests", "Running requests with evicted tokens.", names,
                            multiprocess_mode="mostrecent"),
        "logical": Gauge("kvcompact:logical_tokens", "Logical length summed over running requests.", names,
                         multiprocess_mode="mostrecent"),
        "cached": Gauge("kvcompact:cached_tokens", "Cached KV tokens summed over running requests.", names,
                        multiprocess_mode="mostrecent"),
        "info": Gauge("kvcompact:policy_info", "The kvcompact configuration in force (value 1).",
                      names + ["policy", "needs_attention", "compaction", "selection", "budget", "divide_length"],
                      multiprocess_mode="mostrecent"),
    }


class Metrics:
    """Counters in memory plus, when prometheus_client is importable, the exported series."""

    def __init__(self, config: KVCompactConfig, needs_attention: bool, model_name: str) -> None:
        self.totals = Totals()
        f = _families()
        labels = {"model_name": model_name}
        self._rounds = f["rounds"].labels(**labels)
        self._evicted = f["evicted"].labels(**labels)
        self._freed = f["freed"].labels(**labels)
        self._copied = f["copied"].labels(**labels)
        self._moved = f["moved"].labels(**labels)
        self._failures = f["failures"].labels(**labels)
        self._compaction_s = f["compaction_s"].labels(**labels)
        self._scoring_s = f["scoring_s"].labels(**labels)
        self._compressed = f["compressed"].labels(**labels)
        self._logical = f["logical"].labels(**labels)
        self._cached = f["cached"].labels(**labels)
        f["info"].clear()
        f["info"].labels(policy=config.policy, needs_attention=str(needs_attention).lower(),
                         compaction=config.compaction, selection=config.selection, budget=str(config.budget),
                         divide_length=str(config.divide_length), **labels).set(1)

    def on_round(self, tokens_evicted: int, blocks_freed: int, seconds: float, blocks_copied: int = 0) -> None:
        t = self.totals
        t.rounds += 1
        t.tokens_evicted += tokens_evicted
        t.blocks_freed += blocks_freed
        t.blocks_copied += blocks_copied
        self._rounds.inc()
        self._evicted.inc(tokens_evicted)
        self._freed.inc(blocks_freed)
        if blocks_copied:
            self._copied.inc(blocks_copied)

    def on_worker_report(self, report: WorkerReport) -> None:
        t = self.totals
        t.tokens_moved += report.tokens_moved
        t.bytes_moved += report.bytes_moved
        t.scoring_failures += len(report.failed)
        t.compaction_seconds.extend(report.compaction_seconds)
        del t.compaction_seconds[:-1024]
        self._moved.inc(report.tokens_moved)
        if report.failed:
            self._failures.inc(len(report.failed))
        for s in report.compaction_seconds:
            self._compaction_s.observe(s)
        for s in report.scoring_seconds:
            self._scoring_s.observe(s)

    def set_running(self, compressed: int, logical: int, cached: int) -> None:
        self._compressed.set(compressed)
        self._logical.set(logical)
        self._cached.set(cached)
