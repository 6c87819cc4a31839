"""The vLLM plugin entry point: the hook table, and :func:`register`, which checks it against the installed vLLM
and installs it, with no fork.

vLLM calls :func:`register` (entry point group ``vllm.general_plugins``) in the front-end, the engine-core and
every worker process, possibly more than once. The hooks do nothing unless kvcompact is configured, so a plain
vLLM with the package installed behaves exactly as before. :data:`HOOKS` is the whole engine integration, one row
per vLLM method, in the order vLLM calls them in a step; :mod:`kvcompact.vllm.compat` checks every row before
anything is installed. Class rows, instance rows and their hook signatures: docs/DESIGN.md, section 5.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvcompact.config import ConfigError, env_settings
from kvcompact.vllm.hooks import frontend, worker
from kvcompact.vllm.hooks import scheduler as sched

logger = logging.getLogger("vllm.kvcompact")  # formatted and levelled by vLLM's own logging
_installed = False


@dataclass(frozen=True)
class Hook:
    """vLLM's ``module.cls.method`` runs through ``hook``. ``instance``: the dotted path from a scheduler to the
    object whose method is replaced for that engine only ("" for a class row); ``hook`` None: installed by the
    named kvcompact module itself (it needs per-object state)."""

    module: str
    cls: str
    method: str
    hook: Callable[..., Any] | None
    instance: str = ""
    installed_by: str = ""


def install_instance_hooks(scheduler: Any, side: Any) -> None:
    """Install the instance rows on this engine's objects (other engines of the process keep vLLM's methods)."""
    for row in HOOKS:
        if row.hook is None or not row.instance:
            continue
        obj = functools.reduce(getattr, row.instance.split("."), scheduler)
        original = getattr(obj, row.method)
        hook = functools.partial(row.hook, side, original)
        setattr(obj, row.method, functools.update_wrapper(hook, original))


HOOKS: tuple[Hook, ...] = (
    # front-end
    Hook("vllm.engine.arg_utils", "EngineArgs", "create_engine_config", frontend.create_engine_config),
    Hook("vllm.sampling_params", "SamplingParams", "_verify_extra_args", frontend.verify_extra_args),
    # engine core: the scheduler
    Hook("vllm.v1.core.sched.scheduler", "Scheduler", "__init__",
         functools.partial(sched.init, install_instance_hooks)),
    Hook("vllm.v1.core.sched.scheduler", "Scheduler", "add_request", sched.add_request),
    Hook("vllm.v1.core.sched.scheduler", "Scheduler", "schedule", sched.schedule),
    Hook("vllm.v1.core.sched.scheduler", "Scheduler", "_reserve_prefill_lookahead",
         sched.reserve_prefill_lookahead),
    Hook("vllm.v1.core.kv_cache_manager", "KVCacheManager", "get_computed_blocks",
         sched.get_computed_blocks, instance="kv_cache_manager"),
    Hook("vllm.v1.core.kv_cache_manager", "KVCacheManager", "allocate_slots", sched.allocate_slots,
         instance="kv_cache_manager"),
    Hook("vllm.v1.core.kv_cache_coordinator", "KVCacheCoordinator", "cache_blocks", sched.cache_blocks,
         instance="kv_cache_manager.coordinator"),
    Hook("vllm.v1.core.sched.scheduler", "Scheduler", "_preempt_request", sched.preempt_request),
    Hook("vllm.v1.core.sched.scheduler", "Scheduler", "update_from_output", sched.update_from_output),
    Hook("vllm.v1.core.sched.scheduler", "Scheduler", "_free_request", sched.free_request),
    # workers
    Hook("vllm.v1.worker.gpu_model_runner", "GPUModelRunner", "initialize_kv_cache", worker.initialize_kv_cache),
    Hook("vllm.v1.worker.gpu_worker", "Worker", "execute_model", worker.worker_execute_model),
    Hook("vllm.v1.worker.gpu_model_runner", "GPUModelRunner", "_update_states", worker.update_states),
    Hook("vllm.v1.worker.gpu_model_runner", "GPUModelRunner", "_prepare_inputs", worker.prepare_inputs),
    Hook("vllm.v1.worker.gpu_model_runner", "GPUModelRunner", "sync_and_gather_intermediate_tensors",
         worker.sync_and_gather_intermediate_tensors),
    Hook("vllm.v1.attention.backend", "AttentionImpl", "forward", None, instance="each attention layer's impl",
         installed_by="kvcompact.vllm.capture"),
    Hook("vllm.v1.worker.gpu_model_runner", "GPUModelRunner", "execute_model", worker.execute_model),
    Hook("vllm.v1.worker.gpu_model_runner", "GPUModelRunner", "sample_tokens", worker.sample_tokens),
    # workers on Model Runner V2 (vllm/v1/worker/gpu/; CPU only, see startup.check_runner)
    Hook("vllm.v1.worker.gpu.model_runner", "GPUModelRunner", "initialize_kv_cache", worker.initialize_kv_cache),
    Hook("vllm.v1.worker.gpu.model_runner", "GPUModelRunner", "update_requests", worker.update_states),
    Hook("vllm.v1.worker.gpu.model_runner", "GPUModelRunner", "prepare_attn", worker.prepare_attn),
    Hook("vllm.v1.worker.gpu.model_runner", "GPUModelRunner", "execute_model", worker.execute_model),
    Hook("vllm.v1.worker.gpu.model_runner", "GPUModelRunner", "sample_tokens", worker.sample_tokens_v2),
    # workers, draft-model speculation: the drafter runs after the target's sampling
    Hook("vllm.v1.spec_decode.llm_base_proposer", "SpecDecodeBaseProposer", "set_inputs_first_pass",
         worker.drafter_first_pass),
    Hook("vllm.v1.spec_decode.llm_base_proposer", "SpecDecodeBaseProposer", "_update_positions_dependent_metadata",
         worker.drafter_next_positions),
)


def register() -> None:
    """vLLM general-plugin entry point; idempotent.

    The whole vLLM surface is checked before anything is wrapped (:mod:`kvcompact.vllm.compat`). On a vLLM
    that fails the check nothing is patched: an engine configured for kvcompact is refused at start-up with
    the list of what is missing, and a plain vLLM (no kvcompact configuration) runs untouched.
    """
    global _installed
    if _installed:
        return
    _installed = True
    from kvcompact.vllm.compat import check_surface

    try:
        check_surface(HOOKS)
    except ConfigError as e:
        if env_settings():  # configured from the environment: stop here rather than run uncompressed
            raise
        logger.warning("%s", e)
        _refuse_configured_engines(str(e))
        return
    for row in HOOKS:
        if row.hook is not None and not row.instance:
            _install(_owner(row), row.method, row.hook)


def _owner(row: Hook) -> type:
    import importlib

    return getattr(importlib.import_module(row.module), row.cls)


def _install(cls: type, name: str, hook: Callable[..., Any]) -> None:
    original = getattr(cls, name)

    @functools.wraps(original)
    def wrapper(obj: Any, *args: Any, **kwargs: Any) -> Any:
        return hook(original, obj, *args, **kwargs)

    wrapper.kvcompact_hook = hook  # type: ignore[attr-defined]  # what compat's tests find installed
    setattr(cls, name, wrapper)


def _refuse_configured_engines(reason: str) -> None:
    """On an unsupported vLLM: stop any engine that asks for kvcompact, patch nothing else."""
    try:
        from vllm.engine.arg_utils import EngineArgs
    except ImportError:
        return
    if getattr(EngineArgs, "create_engine_config", None) is not None:
        _install(EngineArgs, "create_engine_config", frontend.refuse_configured_engine(reason))
