"""The one object per request on each side of the engine: what kvcompact keeps for a request between steps.

:class:`SchedulerRequest` lives in the engine-core process (:class:`kvcompact.vllm.scheduler_side.SchedulerSide`
creates it when vLLM adds the request and drops it when vLLM frees it); :class:`WorkerRequest` lives in every
worker (:class:`kvcompact.vllm.worker_side.WorkerSide` creates it at the request's first round and drops it when
the step message no longer names the request: finished, preempted or reset).
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from kvcompact.ledger import Ledger


@dataclass
class SchedulerRequest:
    """A request as the scheduler side sees it: its round arithmetic, this step's allowance and a pending error."""

    ledger: Ledger
    # Budget mode "pressure": the most tokens this step may schedule for it (its prefill grows only into spare
    # blocks); None outside pressure mode or before the step's pressure planning.
    allowance: int | None = None
    # A contained fault named this request: it ends with this error at the next point where vLLM is not walking
    # its queues (:meth:`kvcompact.vllm.scheduler_side.SchedulerSide.finish_pending`).
    error: str | None = None

    @staticmethod
    def failed(error: str) -> SchedulerRequest:
        """A request kvcompact could not even take on (its add_request failed): uncompressed, ending in ``error``."""
        return SchedulerRequest(Ledger(enabled=False, budget=0, divide_length=1, prompt_len=0, frees_blocks=False),
                                error=error)


@dataclass
class WorkerRequest:
    """A compressed request as one worker sees it: the logical position each of its first slots holds.

    ``tags`` [L, H_kv, K] int64: after a round, slot ``s < K`` of (layer, KV head) may hold any token; slots past
    ``K`` hold positions ``s + evicted`` by construction (tokens are appended in order). The policies' capture
    state (query windows, attention sums) is keyed by the same request id in :mod:`kvcompact.vllm.capture`.
    """

    tags: Tensor


__all__ = ["SchedulerRequest", "WorkerRequest"]
