"""The front-end's hooks (the API server or ``LLM`` process): a bad configuration stops start-up, a bad
per-request override is an HTTP 400, and an API server's ``/metrics`` gets the engine processes' series.
Rows of :data:`kvcompact.vllm.plugin.HOOKS`: ``hook(original, obj, *args)``."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from kvcompact.config import ConfigError, KVCompactConfig, RequestOverrides

logger = logging.getLogger("vllm.kvcompact")  # formatted and levelled by vLLM's own logging

# What the front-end's engine config said, for validating per-request overrides (a budget above the context
# is refused too). One process serves one engine in production.
_config: KVCompactConfig | None = None
_max_model_len: int | None = None
_lookahead = 0  # the KV slots a draft model reserves past each step's tokens (pressure mode refuses them)


def create_engine_config(original: Callable[..., Any], engine_args: Any, *args: Any, **kwargs: Any) -> Any:
    """EngineArgs.create_engine_config: validate the config once, so a bad one stops start-up; in an OpenAI API
    server, make sure the engine processes' metrics reach ``/metrics``."""
    global _config, _max_model_len, _lookahead
    vllm_config = original(engine_args, *args, **kwargs)
    _config = KVCompactConfig.from_vllm(vllm_config)
    _max_model_len = vllm_config.model_config.max_model_len
    _lookahead = 0 if _config is None else vllm_config.num_lookahead_tokens
    if _config is not None:
        from kvcompact.vllm.startup import check_engine_config

        check_engine_config(_config, vllm_config)
        _export_metrics(kwargs.get("usage_context", args[0] if args else None))
    return vllm_config


def verify_extra_args(original: Callable[..., Any], params: Any) -> None:
    """SamplingParams._verify_extra_args: a bad per-request override is an HTTP 400."""
    from vllm.exceptions import VLLMValidationError

    original(params)
    try:
        RequestOverrides.from_extra_args(params.extra_args, _config, _max_model_len, _lookahead)
    except ConfigError as e:
        raise VLLMValidationError(str(e), parameter="vllm_xargs") from None


def refuse_configured_engine(reason: str) -> Callable[..., Any]:
    """On a vLLM kvcompact cannot hook: the only hook installed, stopping any engine that asks for kvcompact."""
    def create(original: Callable[..., Any], engine_args: Any, *args: Any, **kwargs: Any) -> Any:
        vllm_config = original(engine_args, *args, **kwargs)
        if KVCompactConfig.from_vllm(vllm_config) is not None:
            raise ConfigError(reason)
        return vllm_config
    return create


def _export_metrics(usage_context: Any) -> None:
    """An OpenAI API server serves ``/metrics``, and kvcompact's series are recorded in its engine processes: without
    a multiprocess directory they would silently never reach it (a plain ``vllm serve``). Other users of the engine
    (the offline ``LLM`` class) have no ``/metrics`` and their process environment is left alone."""
    from vllm.usage.usage_lib import UsageContext

    if usage_context != UsageContext.OPENAI_API_SERVER:
        return
    from kvcompact.vllm.metrics import export_from_engine_processes

    made = export_from_engine_processes()
    if made is not None:
        logger.info("kvcompact: PROMETHEUS_MULTIPROC_DIR=%s (made for this server, removed at exit), so the engine "
                    "processes' kvcompact: series reach /metrics", made)
