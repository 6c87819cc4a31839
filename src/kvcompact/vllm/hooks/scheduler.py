"""The scheduler's rows of the plugin's hook table (:data:`kvcompact.vllm.plugin.HOOKS`), in the order vLLM calls
them in a step: adapters from vLLM's ``Scheduler`` and this engine's KV-cache manager onto
:class:`kvcompact.vllm.scheduler_side.SchedulerSide`.

Class rows are ``hook(original, scheduler, *args)``; the rows installed on one engine's KV-cache manager are
``hook(side, original, *args)``. kvcompact's part of each runs inside :meth:`SchedulerSide.contained` (fault
isolation); vLLM's own code is never inside the guard.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from typing import Any

from kvcompact.config import KVCompactConfig
from kvcompact.vllm.protocol import REPORT_ATTR
from kvcompact.vllm.scheduler_side import SchedulerSide
from kvcompact.vllm.startup import make_scheduler_side

logger = logging.getLogger("vllm.kvcompact")  # formatted and levelled by vLLM's own logging


def side_of(scheduler: Any) -> SchedulerSide | None:
    """The scheduler's kvcompact side (None: kvcompact is not configured for this engine)."""
    return getattr(scheduler, "kvcompact", None)


def init(install_instance_hooks: Callable[[Any, SchedulerSide], None], original: Callable[..., None],
         scheduler: Any, vllm_config: Any, *args: Any, **kwargs: Any) -> None:
    """Scheduler.__init__: build the side (checks the engine config and vLLM's objects) and install its hooks on
    this engine's KV-cache manager with ``install_instance_hooks``, which the plugin binds (it alone patches
    vLLM)."""
    original(scheduler, vllm_config, *args, **kwargs)
    scheduler.kvcompact = None
    config = KVCompactConfig.from_vllm(vllm_config)
    if config is not None:
        side = make_scheduler_side(config, scheduler, vllm_config)
        install_instance_hooks(scheduler, side)
        scheduler.kvcompact = side
        logger.info("kvcompact: enabled %s", json.dumps(config.to_dict(), sort_keys=True))


def add_request(original: Callable[..., Any], scheduler: Any, request: Any) -> Any:
    side = side_of(scheduler)
    if side is not None:
        with side.contained("new request", request.request_id):
            side.add_request(request)
    return original(scheduler, request)


def schedule(original: Callable[..., Any], scheduler: Any, *args: Any, **kwargs: Any) -> Any:
    side = side_of(scheduler)
    if side is None:
        return original(scheduler, *args, **kwargs)
    return side.schedule(lambda: original(scheduler, *args, **kwargs))


def reserve_prefill_lookahead(original: Callable[..., int], scheduler: Any, request: Any, num_computed_tokens: int,
                              num_new_tokens: int) -> int:
    """vLLM's last per-request cut of ``num_new_tokens`` (running and waiting loop alike), right before the blocks
    are allocated: cut it at the request's next round (:meth:`SchedulerSide.step_cap`)."""
    n = original(scheduler, request, num_computed_tokens, num_new_tokens)
    side = side_of(scheduler)
    cap = None
    if side is not None:
        with side.contained("step cap", request.request_id):
            cap = side.step_cap(request, num_computed_tokens)
    return n if cap is None else min(n, cap)


def preempt_request(original: Callable[..., Any], scheduler: Any, request: Any, *args: Any, **kwargs: Any) -> Any:
    out = original(scheduler, request, *args, **kwargs)
    side = side_of(scheduler)
    if side is not None:
        with side.contained("preemption", request.request_id):
            side.on_preempt(request)
    return out


def free_request(original: Callable[..., Any], scheduler: Any, request: Any, *args: Any, **kwargs: Any) -> Any:
    side = side_of(scheduler)
    if side is not None:
        with side.contained("finish", request.request_id):  # ending anyway: only its counters are lost
            side.on_finish(request)
        side.forget(request.request_id)
    return original(scheduler, request, *args, **kwargs)


def update_from_output(original: Callable[..., Any], scheduler: Any, scheduler_output: Any,
                       model_runner_output: Any) -> Any:
    side = side_of(scheduler)
    if side is None:
        return original(scheduler, scheduler_output, model_runner_output)
    return side.update_from_output(lambda: original(scheduler, scheduler_output, model_runner_output),
                                   getattr(model_runner_output, REPORT_ATTR, None))


# Instance hooks on this engine's KVCacheManager (other engines of the process are untouched).
def allocate_slots(side: SchedulerSide, original: Callable[..., Any], request: Any, num_new_tokens: int,
                   *args: Any, **kwargs: Any) -> Any:
    """Allocation follows the cache length, not the logical length; a compressed request's blocks are never
    registered in the prefix cache (they no longer hold the token-hash chain's content)."""
    evicted = 0
    with side.contained("allocation", request.request_id):
        evicted = side.evicted(request)
    if not evicted:
        return original(request, num_new_tokens, *args, **kwargs)
    logical_len = request.num_computed_tokens
    request.num_computed_tokens = logical_len - evicted
    kwargs["delay_cache_blocks"] = True
    try:
        return original(request, num_new_tokens, *args, **kwargs)
    finally:
        request.num_computed_tokens = logical_len


def cache_blocks(side: SchedulerSide, original: Callable[..., Any], request: Any, num_computed_tokens: int) -> Any:
    """Prefix-cache registration, on every path (allocation, the async scheduler's output update): none for a
    request compressed at least once."""
    registers = False  # a fault: no registration (a compressed request's blocks must never be handed out)
    with side.contained("prefix-cache registration", request.request_id):
        registers = side.registers(request)
    return original(request, num_computed_tokens) if registers else None


def get_computed_blocks(side: SchedulerSide, original: Callable[..., Any], request: Any,
                        max_cache_hit_length: int | None = None) -> Any:
    """Prefix-cache hits, capped for a compressed request (:meth:`SchedulerSide.hit_cap`). vLLM 0.33's scheduler
    bounds the hit itself (``max_cache_hit_length``, which 0.32's method does not take): the lookup gets the lower
    of the two bounds; a hit past the cap (a lookup without a bound) is cut after it."""
    cap = None
    with side.contained("prefix-cache hit", request.request_id):
        cap = side.hit_cap(request)
    if max_cache_hit_length is None:
        blocks, hit, *rest = original(request)
    else:
        blocks, hit, *rest = original(request, max_cache_hit_length if cap is None else min(max_cache_hit_length, cap))
    if cap is not None and hit > cap:
        blocks, hit = side.scheduler.kv_cache_manager.truncate_computed_blocks(blocks, cap), cap
    return (blocks, hit, *rest)
