"""One validated configuration object for kvcompact.

Sources, later ones winning: defaults < ``KVCOMPACT_*`` environment variables < vLLM's
``--additional-config '{"kvcompact": {...}}'``. A request may then override ``budget`` or switch compression
off through vLLM's per-request extra args (``vllm_xargs`` in the OpenAI API): see :class:`RequestOverrides`.

Every invalid value raises :class:`ConfigError` naming the field and the allowed values, so a bad deployment
stops at startup instead of corrupting a live cache.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

POLICIES = ("streaming", "knorm", "random", "triattention", "snapkv", "h2o", "rkv")
SELECTIONS = ("per_head", "per_layer_per_head")
MOVE_MODES = ("repack", "holefill")   # compactions that move survivors (the planner's modes)
COMPACTIONS = (*MOVE_MODES, "none")
# guaranteed: admit a request only when the pool covers the peak footprint of every running request plus its own
# (TensorRT-LLM's GUARANTEED_NO_EVICT); greedy: vLLM's own admission, which preempts when the pool runs out
# (MAX_UTILIZATION).
ADMISSIONS = ("guaranteed", "greedy")
ENV_PREFIX = "KVCOMPACT_"
XARG_BUDGET = "kvcompact_budget"
XARG_ENABLE = "kvcompact"


class ConfigError(ValueError):
    """A configuration value is invalid; the message names the field and what is allowed."""


@dataclass(frozen=True)
class KVCompactConfig:
    """What kvcompact does to every request (unless the request overrides it).

    budget: KV tokens per KV head kept after a round. divide_length: a round runs when the cache holds
    ``budget + divide_length`` tokens, so one round per ``divide_length`` decoded tokens. window: the most
    recent tokens are never evicted. protect_prompt: prompt tokens are never evicted (a prompt longer than
    ``budget - window`` raises that request's budget to fit it). n_sink: tokens kept by ``streaming``.
    admission: ``guaranteed`` admits a waiting request only when the pool covers the peak footprint of every
    running request plus its own, so a pool sized for the compressed working set never preempts; ``greedy``
    is vLLM's own admission.
    """

    enabled: bool = True
    policy: str = "triattention"
    budget: int = 1024
    divide_length: int = 128
    window: int = 128
    protect_prompt: bool = False
    selection: str = "per_head"
    compaction: str = "repack"
    n_sink: int = 4
    stats_path: str | None = None
    seed: int = 0
    query_window: int = 8
    admission: str = "guaranteed"

    def __post_init__(self) -> None:
        _choice("policy", self.policy, POLICIES)
        _choice("selection", self.selection, SELECTIONS)
        _choice("compaction", self.compaction, COMPACTIONS)
        _choice("admission", self.admission, ADMISSIONS)
        for name in ("budget", "divide_length", "query_window"):
            _positive_int(name, getattr(self, name))
        for name in ("window", "n_sink", "seed"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ConfigError(f"kvcompact: '{name}' must be an integer >= 0, got {value!r}")
        protected = self.window + (self.n_sink if self.policy == "streaming" else 0)
        if self.budget <= protected:
            raise ConfigError(
                f"kvcompact: 'budget' ({self.budget}) must be larger than the protected tokens "
                f"({protected}: window {self.window}"
                + (f" + n_sink {self.n_sink}" if self.policy == "streaming" else "")
                + "); raise budget or lower window"
            )

    @property
    def needs_stats(self) -> bool:
        return self.policy == "triattention"

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def replace(self, **changes: Any) -> KVCompactConfig:
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_sources(
        cls, additional_config: Mapping[str, Any] | None = None, environ: Mapping[str, str] | None = None
    ) -> KVCompactConfig | None:
        """The config in force, or None when kvcompact is not configured at all (plain vLLM)."""
        environ = os.environ if environ is None else environ
        values: dict[str, Any] = {}
        known = {f.name: f for f in fields(cls)}
        for key, raw in environ.items():
            if not key.startswith(ENV_PREFIX):
                continue
            name = key[len(ENV_PREFIX):].lower()
            if name not in known:
                raise ConfigError(f"kvcompact: unknown variable {key}; known: "
                                  + ", ".join(ENV_PREFIX + n.upper() for n in known))
            values[name] = _parse_env(name, raw, str(known[name].type))
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


@dataclass(frozen=True)
class RequestOverrides:
    """Per-request settings from ``SamplingParams.extra_args``: ``kvcompact`` ("off"/"on") and
    ``kvcompact_budget`` (int)."""

    enabled: bool | None = None
    budget: int | None = None

    @classmethod
    def from_extra_args(cls, extra_args: Mapping[str, Any] | None, config: KVCompactConfig | None = None,
                        max_model_len: int | None = None) -> RequestOverrides:
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
            if config is not None and budget <= config.window:
                raise ConfigError(f"request extra arg '{XARG_BUDGET}' ({budget}) must be larger than the "
                                  f"protected window ({config.window})")
            if config is not None and max_model_len is not None and budget + config.divide_length > max_model_len:
                raise ConfigError(f"request extra arg '{XARG_BUDGET}' ({budget}) + divide_length "
                                  f"({config.divide_length}) exceeds the context (max_model_len {max_model_len}): "
                                  "the request would never reach a compaction round")
        return cls(enabled=enabled, budget=budget)


def _choice(name: str, value: Any, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ConfigError(f"kvcompact: '{name}' must be one of {', '.join(allowed)}; got {value!r}")


def _positive_int(name: str, value: Any) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ConfigError(f"kvcompact: '{name}' must be an integer > 0, got {value!r}")


def _check_type(name: str, value: Any, annotation: str) -> None:
    ok = {
        "bool": isinstance(value, bool),
        "int": isinstance(value, int) and not isinstance(value, bool),
        "str": isinstance(value, str),
        "str | None": value is None or isinstance(value, str),
    }[annotation]
    if not ok:
        raise ConfigError(f"kvcompact: '{name}' must be of type {annotation}, got {value!r}")


def _parse_env(name: str, raw: str, annotation: str) -> Any:
    if annotation == "bool":
        text = raw.strip().lower()
        if text in ("1", "true", "yes", "on"):
            return True
        if text in ("0", "false", "no", "off"):
            return False
        raise ConfigError(f"kvcompact: {ENV_PREFIX}{name.upper()} must be a boolean (1/0/true/false), got {raw!r}")
    if annotation == "int":
        try:
            return int(raw)
        except ValueError:
            raise ConfigError(f"kvcompact: {ENV_PREFIX}{name.upper()} must be an integer, got {raw!r}") from None
    if annotation == "str | None":
        return raw or None
    return raw


__all__ = ["KVCompactConfig", "RequestOverrides", "ConfigError", "POLICIES", "SELECTIONS", "COMPACTIONS",
           "MOVE_MODES", "ADMISSIONS", "XARG_BUDGET", "XARG_ENABLE"]
