"""The one object per request on each side of the engine: what kvcompact keeps for a request between steps.

:class:`SchedulerRequest` lives in the engine-core process (:class:`kvcompact.vllm.scheduler_side.SchedulerSide`
creates it when vLLM adds the request and drops it when vLLM frees it); :class:`WorkerRequest` lives in every
worker (:class:`kvcompact.vllm.worker_side.WorkerSide` holds them; it or its capture hook makes one when a request
is first seen, and drops it when the request finishes, leaves vLLM, or is no longer compressed).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from kvcompact.attention_state import AttentionSums, QueryRing
from kvcompact.ledger import Ledger
from kvcompact.recall import RecallStore


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
    def untracked() -> SchedulerRequest:
        """A request kvcompact never took on (a fault in its add_request): uncompressed, only to carry an error."""
        return SchedulerRequest(Ledger(enabled=False, budget=0, divide_length=1, prompt_len=0, frees_blocks=False))


def ledger_of(requests: dict[str, SchedulerRequest], request_id: str) -> Ledger | None:
    """The request's ledger, or None for a request the scheduler side does not track."""
    state = requests.get(request_id)
    return None if state is None else state.ledger


@dataclass
class WorkerRequest:
    """A request as one worker sees it: the logical position each of its first slots holds, and what the capture
    hook (:mod:`kvcompact.vllm.capture`) has gathered for its policy.

    ``tags`` [L, H_kv, K] int64 (None until its first round): after a round, slot ``s < K`` of (layer, KV head)
    may hold any token; slots past ``K`` hold positions ``s + evicted`` by construction (tokens are appended in
    order). The capture fields start over with every new cache (first prefill, or the re-prefill after a
    preemption): SnapKV's and R-KV's query ring, and H2O's attention sums with the last step's draft rows.
    """

    tags: Tensor | None = None
    ring: QueryRing | None = None            # the last window + slack query rows, by logical position
    sums: AttentionSums | None = None        # H2O's attention per cached slot
    drafts: tuple[int, int] | None = None    # cache slots [a, b) of the last step's draft rows
    pending: Tensor | None = None            # their attention [L, H_kv, b - a, b] (decode rows only)
    prefill_end: int | None = None           # logical length the current cache was prefilled to
    broken: str | None = None                # why its H2O state cannot be trusted
    store: RecallStore | None = None         # the recall tier's evicted tokens (None: nothing evicted yet)
    prompt_len: int = 0                      # the prompt length its last round protected (protect_prompt)
    query: Tensor | None = None              # [L, H_q, d] post-RoPE query of its last decode row
    decoded_to: tuple[int, int] | None = None  # (logical_len, cache_len) after that row's forward

    def positions(self, logical_len: int, cache_len: int, layers: int, heads: int, device: torch.device) -> Tensor:
        """The logical position each of the first ``cache_len`` slots holds, per (layer, KV head) [L, H, cache_len],
        with the request at ``logical_len`` tokens: the tags, then the slots appended in order since."""
        tagged = 0 if self.tags is None else self.tags.shape[-1]
        tail = torch.arange(tagged, cache_len, dtype=torch.int64, device=device) + logical_len - cache_len
        tail = tail.expand(layers, heads, -1)
        return tail if self.tags is None else torch.cat([self.tags, tail], dim=-1)

    def new_cache(self) -> None:
        """The request's cache starts over: what the capture gathered for the old one is gone."""
        self.ring = self.sums = self.drafts = self.pending = self.prefill_end = self.broken = None
        self.store = self.query = self.decoded_to = None


__all__ = ["SchedulerRequest", "WorkerRequest", "ledger_of"]
