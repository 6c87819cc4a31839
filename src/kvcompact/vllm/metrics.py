"""kvcompact's Prometheus metrics, served on vLLM's own ``/metrics`` (the series: docs/metrics.md).

They are recorded in the engine-core process (by the scheduler, once per round, whatever the number of workers)
and reach the API server's ``/metrics`` through prometheus_client's multiprocess mode: ``kvcompact serve`` sets
``PROMETHEUS_MULTIPROC_DIR``, a plain ``vllm serve`` gets a fresh one from :func:`export_from_engine_processes`,
and an engine with none (the offline ``LLM`` class) keeps :attr:`Metrics.totals`. Every series carries vLLM's
``engine`` label, so data-parallel engines never overwrite each other's gauges. The headline figure is
``blocks_freed_total``, not ``tokens_evicted_total``: evicted tokens that leave survivors in every block free no
memory.
"""

from __future__ import annotations

import functools
import os
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from kvcompact.config import KVCompactConfig
from kvcompact.vllm.protocol import WorkerReport

_SECONDS_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
_TOKENS_BUCKETS = (32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072)
_RATIO_BUCKETS = (1.0, 1.1, 1.25, 1.5, 2.0, 3.0, 4.0, 6.0, 8.0, 12.0, 16.0, 32.0, 64.0)
_ROUNDS_BUCKETS = (0, 1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
_export_dir: tempfile.TemporaryDirectory | None = None  # made by export_from_engine_processes, removed at exit


@dataclass
class Totals:
    rounds: int = 0
    tokens_evicted: int = 0
    blocks_freed: int = 0
    blocks_copied: int = 0
    tokens_moved: int = 0
    bytes_moved: int = 0
    scoring_failures: int = 0
    compaction_failures: int = 0
    deferred_rounds: int = 0
    scheduler_faults: int = 0
    pressure_rounds: int = 0
    pressure_blocks_freed: int = 0
    uncompressed_requests: int = 0
    looping_requests: int = 0
    finished_requests: int = 0
    recalled_tokens: int = 0
    recall_dropped_tokens: int = 0
    recall_seconds: float = 0.0
    store_bytes: int = 0
    kept_tokens: list[int] = field(default_factory=list)  # tokens each round kept (its effective budget)
    compaction_seconds: list[float] = field(default_factory=list)


def multiprocess_enabled() -> bool:
    return bool(os.environ.get("PROMETHEUS_MULTIPROC_DIR"))


def export_from_engine_processes() -> str | None:
    """In the API server, before the engine starts: give the server a fresh ``PROMETHEUS_MULTIPROC_DIR``
    when none is set, so the engine-core processes (which inherit it) write kvcompact's series where ``/metrics``
    reads them. Returns that directory (removed when the server exits), or None when one was set already.

    prometheus_client picks file-backed values once, when it is imported, so it is told again here: vLLM creates
    its own front-end metrics after this point (with the engine), and vLLM's ``/metrics`` then reads every
    process's files, as with ``kvcompact serve``; a metric created earlier in this process would not show.
    (vLLM's own ``setup_multiprocess_prometheus`` is not used: its exit handler logs an error for the directory
    it made.)
    """
    global _export_dir
    if multiprocess_enabled():
        return None
    from prometheus_client import values

    _export_dir = tempfile.TemporaryDirectory(prefix="kvcompact-prom-")
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = _export_dir.name
    values.ValueClass = values.get_value_class()
    return _export_dir.name


@functools.cache
def _families() -> dict[str, Any]:
    """The metric families, registered once per process (an engine may be built several times in one)."""
    from prometheus_client import Counter, Gauge, Histogram

    names = ["model_name", "engine"]
    return {
        "rounds": Counter("kvcompact:compaction_rounds", "Compaction rounds run.", names),
        "evicted": Counter("kvcompact:tokens_evicted", "KV tokens evicted per KV head.", names),
        "freed": Counter("kvcompact:blocks_freed", "KV blocks returned to vLLM's block pool.", names),
        "copied": Counter("kvcompact:blocks_copied",
                          "Shared or prefix-cached blocks a round copied into private ones (copy on write).", names),
        "moved": Counter("kvcompact:tokens_moved",
                         "Token slots copied by compaction, summed over layers and KV heads (a draft "
                         "model's included).", names),
        "bytes": Counter("kvcompact:bytes_moved",
                         "KV-cache bytes copied by compaction (keys and values, summed over layers, KV heads and "
                         "ranks).", names),
        "failures": Counter("kvcompact:scoring_failures",
                            "Rounds whose scoring failed and fell back to keeping the most recent tokens.", names),
        "aborted": Counter("kvcompact:compaction_failures",
                           "Requests ended with an error because their compaction failed (their cache is lost).",
                           names),
        "deferred": Counter("kvcompact:deferred_rounds",
                            "Round postponements: a due round waited a step for free blocks to copy shared "
                            "blocks into (once per request and step).", names),
        "scheduler_faults": Counter("kvcompact:scheduler_faults",
                                    "Exceptions in kvcompact's scheduler-side code, contained: the request(s) they "
                                    "concern ended with an error, or, where none could be named, compression was "
                                    "turned off for new requests (kvcompact:compression_disabled).", names),
        "disabled": Gauge("kvcompact:compression_disabled",
                          "1 once a scheduler-side fault that concerns no one request turned compression off for "
                          "new requests of this engine (running ones go on); 0 otherwise.", names,
                          multiprocess_mode="mostrecent"),
        "pressure_rounds": Counter("kvcompact:pressure_rounds",
                                   "Rounds budget mode 'pressure' ran because the pool could not cover the next step.",
                                   names),
        "pressure_freed": Counter("kvcompact:pressure_blocks_freed",
                                  "KV blocks pressure rounds returned to vLLM's pool (part of blocks_freed).", names),
        "uncompressed": Counter("kvcompact:uncompressed_requests",
                                "Finished requests with compression on that never ran a round (full attention).",
                                names),
        "looping": Counter("kvcompact:looping_requests",
                           "Finished requests that ran rounds and whose output ends in a loop (one 16-token phrase "
                           "3 or more times in the last 256 tokens): a budget too small for the model.", names),
        "recalled": Counter("kvcompact:recalled_tokens",
                            "Evicted tokens the recall tier swapped back into the cache, summed over layers and KV "
                            "heads.", names),
        "recall_dropped": Counter("kvcompact:recall_dropped_tokens",
                                  "Evicted tokens dropped for good from the recall stores (past recall_tokens), "
                                  "summed over layers and KV heads.", names),
        "recall_s": Counter("kvcompact:recall_seconds",
                            "Worker time of the recall tier: recall points, decisions and swaps.", names),
        "store_bytes": Gauge("kvcompact:recall_store_bytes",
                             "Host bytes the recall stores hold (evicted K/V, positions, digests): the saving is "
                             "blocks freed less these.", names, multiprocess_mode="mostrecent"),
        "kept": Histogram("kvcompact:effective_budget_tokens",
                          "Tokens per KV head a round kept: the budget, or the target of a pressure round.", names,
                          buckets=_TOKENS_BUCKETS),
        "ratio": Histogram("kvcompact:request_compression_ratio",
                           "Per finished request with compression on: logical length / cached tokens at its end "
                           "(1: no token evicted).", names, buckets=_RATIO_BUCKETS),
        "request_rounds": Histogram("kvcompact:request_compaction_rounds",
                                    "Compaction rounds per finished request with compression on.", names,
                                    buckets=_ROUNDS_BUCKETS),
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
        "block_size": Gauge("kvcompact:block_size",
                            "Tokens per KV block of this engine's pool: reclaim efficiency is blocks_freed x "
                            "block_size / tokens_evicted (1.0: every evicted token's slot went back to the pool).",
                            names,
                            multiprocess_mode="mostrecent"),
        # blocks -> bytes, named with a _bytes unit as vLLM names its byte series
        "block_bytes": Gauge("kvcompact:block_bytes",
                             "Bytes one KV block of this engine's pool takes over all its layers, KV heads and "
                             "tensor/pipeline ranks: bytes freed = blocks_freed x block_bytes.", names,
                             multiprocess_mode="mostrecent"),
        "info": Gauge("kvcompact:policy_info", "The kvcompact configuration in force (value 1).",
                      names + ["policy", "needs_attention", "compaction", "selection", "budget", "divide_length",
                               "budget_mode", "budget_ratio", "admission", "recall_tokens"],
                      multiprocess_mode="mostrecent"),
    }


class Metrics:
    """Counters in memory plus, when prometheus_client is importable, the exported series."""

    def __init__(self, config: KVCompactConfig, needs_attention: bool, model_name: str, *, engine: int,
                 block_size: int, block_bytes: int = 0) -> None:
        """``engine``: vLLM's engine index, the data-parallel rank of this engine core; ``block_size``: tokens per
        block of its pool; ``block_bytes``: the bytes one of its blocks takes on all devices."""
        self.totals = Totals()
        f = _families()
        labels = {"model_name": model_name, "engine": str(engine)}
        self.labels = labels  # of every series this engine exports
        self._rounds = f["rounds"].labels(**labels)
        self._evicted = f["evicted"].labels(**labels)
        self._freed = f["freed"].labels(**labels)
        self._copied = f["copied"].labels(**labels)
        self._moved = f["moved"].labels(**labels)
        self._bytes = f["bytes"].labels(**labels)
        self._failures = f["failures"].labels(**labels)
        self._aborted = f["aborted"].labels(**labels)
        self._deferred = f["deferred"].labels(**labels)
        self._scheduler_faults = f["scheduler_faults"].labels(**labels)
        self._disabled = f["disabled"].labels(**labels)
        self._disabled.set(0)
        self._pressure_rounds = f["pressure_rounds"].labels(**labels)
        self._pressure_freed = f["pressure_freed"].labels(**labels)
        self._uncompressed = f["uncompressed"].labels(**labels)
        self._looping = f["looping"].labels(**labels)
        self._kept = f["kept"].labels(**labels)
        self._recalled = f["recalled"].labels(**labels)
        self._recall_dropped = f["recall_dropped"].labels(**labels)
        self._recall_s = f["recall_s"].labels(**labels)
        self._store_bytes = f["store_bytes"].labels(**labels)
        self._store_bytes.set(0)
        self._compaction_s = f["compaction_s"].labels(**labels)
        self._scoring_s = f["scoring_s"].labels(**labels)
        self._compressed = f["compressed"].labels(**labels)
        self._logical = f["logical"].labels(**labels)
        self._cached = f["cached"].labels(**labels)
        self._ratio = f["ratio"].labels(**labels)
        self._request_rounds = f["request_rounds"].labels(**labels)
        f["block_size"].labels(**labels).set(block_size)
        f["block_bytes"].labels(**labels).set(block_bytes)
        f["info"].clear()
        f["info"].labels(policy=config.policy, needs_attention=str(needs_attention).lower(),
                         compaction=config.compaction, selection=config.selection, budget=str(config.budget),
                         divide_length=str(config.divide_length), budget_mode=config.budget_mode,
                         budget_ratio=str(config.budget_ratio), admission=config.admission,
                         recall_tokens=str(config.recall_tokens), **labels).set(1)

    def on_round(self, tokens_evicted: int, blocks_freed: int, seconds: float, blocks_copied: int = 0,
                 kept: int | None = None, pressure: bool = False) -> None:
        """``kept``: tokens per KV head the round left (its effective budget); ``pressure``: a round of budget mode
        'pressure'."""
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
        if kept is not None:
            t.kept_tokens.append(kept)
            del t.kept_tokens[:-1024]
            self._kept.observe(kept)
        if pressure:
            t.pressure_rounds += 1
            t.pressure_blocks_freed += blocks_freed
            self._pressure_rounds.inc()
            self._pressure_freed.inc(blocks_freed)

    def on_request_finish(self, logical_len: int, cache_len: int, rounds: int) -> None:
        """A request with compression on finished holding ``cache_len`` of its ``logical_len`` tokens after
        ``rounds``."""
        self.totals.finished_requests += 1
        self._ratio.observe(logical_len / cache_len if cache_len > 0 else 1.0)
        self._request_rounds.observe(rounds)

    def on_uncompressed_finish(self) -> None:
        """A request with compression on finished without a round: it ran with full attention throughout."""
        self.totals.uncompressed_requests += 1
        self._uncompressed.inc()

    def on_looping_finish(self) -> None:
        """A request that ran rounds finished with its output in a loop (:func:`loops`)."""
        self.totals.looping_requests += 1
        self._looping.inc()

    def on_worker_report(self, report: WorkerReport) -> None:
        t = self.totals
        t.tokens_moved += report.tokens_moved
        t.bytes_moved += report.bytes_moved
        t.scoring_failures += len(report.scoring_fallbacks)
        t.compaction_failures += len(report.aborted)
        t.compaction_seconds.extend(report.compaction_seconds)
        del t.compaction_seconds[:-1024]
        self._moved.inc(report.tokens_moved)
        self._bytes.inc(report.bytes_moved)
        if report.scoring_fallbacks:
            self._failures.inc(len(report.scoring_fallbacks))
        if report.aborted:
            self._aborted.inc(len(report.aborted))
        for s in report.compaction_seconds:
            self._compaction_s.observe(s)
        for s in report.scoring_seconds:
            self._scoring_s.observe(s)
        t.recalled_tokens += report.recalled_tokens
        t.recall_dropped_tokens += report.store_dropped
        t.recall_seconds += report.recall_seconds
        self._recalled.inc(report.recalled_tokens)
        self._recall_dropped.inc(report.store_dropped)
        self._recall_s.inc(report.recall_seconds)
        if report.store_bytes is not None:
            t.store_bytes = report.store_bytes
            self._store_bytes.set(report.store_bytes)

    def on_deferred_round(self) -> None:
        self.totals.deferred_rounds += 1
        self._deferred.inc()

    def on_scheduler_fault(self, disabled: bool) -> None:
        """A contained exception in the scheduler-side code; ``disabled``: compression is now off for new
        requests."""
        self.totals.scheduler_faults += 1
        self._scheduler_faults.inc()
        if disabled:
            self._disabled.set(1)

    def set_running(self, compressed: int, logical_len: int, cache_len: int) -> None:
        self._compressed.set(compressed)
        self._logical.set(logical_len)
        self._cached.set(cache_len)


def loops(tokens: Sequence[int], tail: int = 256, ngram: int = 16) -> bool:
    """Whether a completion ends in a loop: among its last ``tail`` tokens one ``ngram`` occurs at least 3 times.
    What "the model degenerated" looks like from outside: the same phrase over and over until the cap. Used by the
    benches and, at every finish of a compressed request, by the ``kvcompact:looping_requests`` counter."""
    import torch

    t = torch.as_tensor(list(tokens[-tail:]), dtype=torch.long)
    if t.numel() < 3 * ngram:
        return False
    _, counts = torch.unique(t.unfold(0, ngram, 1), dim=0, return_counts=True)
    return bool(counts.max() >= 3)
