"""Startup: refuse engine settings kvcompact cannot honour, and build the scheduler and worker sides.

Everything here runs once per process at engine start, so a wrong combination stops the server with a message
that says what to change, instead of corrupting a live cache later.
"""

from __future__ import annotations

import logging
from typing import Any

from kvcompact.config import ConfigError, KVCompactConfig
from kvcompact.policies import POLICY_CLASSES, make_policy
from kvcompact.vllm.metrics import Metrics, multiprocess_enabled
from kvcompact.vllm.scheduler_side import SchedulerSide
from kvcompact.vllm.worker_side import WorkerSide

logger = logging.getLogger("kvcompact")


def check_engine_config(config: KVCompactConfig, vllm_config: Any) -> None:
    cache = vllm_config.cache_config
    if cache.enable_prefix_caching:
        raise ConfigError("kvcompact compacts a request's blocks in place, which would rewrite blocks the prefix "
                          "cache shares between requests: start vLLM with --no-enable-prefix-caching")
    if vllm_config.scheduler_config.async_scheduling:
        raise ConfigError("kvcompact needs the scheduler to see each step's output before the next step: "
                          "start vLLM with --no-async-scheduling")
    if vllm_config.speculative_config is not None:
        raise ConfigError("kvcompact does not support speculative decoding yet: remove --speculative-config")
    model = vllm_config.model_config
    if config.budget + config.divide_length > model.max_model_len and config.enabled:
        logger.warning("kvcompact: budget + divide_length (%d) exceeds max_model_len (%d): no round will run",
                       config.budget + config.divide_length, model.max_model_len)
    if vllm_config.parallel_config.pipeline_parallel_size > 1 and config.selection == "per_head":
        raise ConfigError("kvcompact: selection 'per_head' averages scores over all layers, which pipeline "
                          "parallelism splits over processes; use selection 'per_layer_per_head' with "
                          "--pipeline-parallel-size > 1")
    if config.needs_stats:
        load_stats(config, model.hf_config)


def load_stats(config: KVCompactConfig, hf_config: Any) -> Any:
    """The calibration statistics for this model; stats made for another model are refused by field."""
    from kvcompact.stats import ModelFingerprint, QueryStats

    path = config.stats_path
    if path is None:
        raise ConfigError("kvcompact: policy 'triattention' needs calibration statistics: set 'stats_path' "
                          "(make them with `kvcompact calibrate MODEL --text FILE -o STATS`)")
    stats = QueryStats.load(path)
    stats.check_compatible(ModelFingerprint.from_hf_config(hf_config))
    return stats


def make_scheduler_side(config: KVCompactConfig, scheduler: Any, vllm_config: Any) -> SchedulerSide:
    check_engine_config(config, vllm_config)
    metrics = Metrics(config, POLICY_CLASSES[config.policy].needs_attention,
                      vllm_config.model_config.served_model_name)
    if not multiprocess_enabled():
        logger.warning("kvcompact: PROMETHEUS_MULTIPROC_DIR is not set, so kvcompact's metrics stay in the "
                       "engine process and do not reach /metrics; `kvcompact serve` sets it for you")
    return SchedulerSide(config, scheduler, metrics)


def make_worker_side(config: KVCompactConfig, runner: Any) -> WorkerSide:
    from kvcompact.layouts import layout_for

    model = runner.model_config
    parallel = runner.parallel_config
    if not runner.kv_caches:
        raise RuntimeError("kvcompact: the worker has no KV cache tensors yet")
    backend = runner.attn_groups[0][0].backend.get_name()
    block_size = runner.cache_config.block_size
    head_dim = model.get_head_size()
    isa = None
    if backend == "CPU_ATTN":
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

        isa = _get_attn_isa(model.dtype, block_size, head_dim, runner.cache_config.cache_dtype)
    layout = layout_for(backend, runner.kv_caches[0], block_size, model.get_num_kv_heads(parallel), head_dim,
                        isa=isa)
    stats = rope = None
    if config.needs_stats:
        from kvcompact.rope import RopeSpec

        stats = load_stats(config, model.hf_config)
        rope = RopeSpec.from_hf_config(model.hf_config)
    num_q_heads = model.get_num_attention_heads(parallel)
    policy = make_policy(config, stats=stats, rope=rope)
    logger.info("kvcompact: worker ready: backend %s (isa %s), layout %s, %d layers", backend, isa, layout.name,
                len(runner.kv_caches))
    return WorkerSide(config, runner, layout, num_q_heads, policy)
