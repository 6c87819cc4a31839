"""The one interface every eviction policy implements.

A policy only *scores* cached tokens; which tokens survive (budget, protected window and prompt, GQA and layer
aggregation) is decided by :mod:`kvcompact.selection`, and where survivors go by :mod:`kvcompact.moves`.
The vLLM worker and the transformers reference path (:mod:`kvcompact.reference`) build the same :class:`ScoreInput`
and call the same policy, so an exactness test between them checks the engine hooks, not two algorithms.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar

import torch

from kvcompact.config import KVCompactConfig


@dataclass
class ScoreInput:
    """Everything a policy may look at for one compaction round of B requests, batched and padded.

    keys:       [B, L, H_kv, N, d] post-RoPE cached keys, float32. Slots beyond a request's length are padding.
    positions:  [B, L, H_kv, N] int64 logical (RoPE) position of the token in each slot; -1 marks padding.
    logical_len: [B] int64 logical position of the next token to be decoded (= logical length).
    num_q_heads: query heads per layer (GQA group = num_q_heads // H_kv).
    queries:    [B, L, H_q, w, d] the last w post-RoPE queries per layer (policies with needs_queries), or None.
    attn_accum: [B, L, H_kv, N] attention accumulated over decode steps (h2o), or None.
    generator:  the seeded generator for stochastic policies.
    """

    keys: torch.Tensor
    positions: torch.Tensor
    logical_len: torch.Tensor
    num_q_heads: int
    queries: torch.Tensor | None = None
    attn_accum: torch.Tensor | None = None
    generator: torch.Generator | None = None

    @property
    def valid(self) -> torch.Tensor:
        """[B, L, H_kv, N] bool: slots that hold a token."""
        return self.positions >= 0


class Policy(ABC):
    """Scores cached tokens; higher means more worth keeping.

    ``needs_attention`` is exported on the ``kvcompact:policy_info`` metric: a policy that needs attention
    weights cannot run from fused-kernel outputs alone (wall 1). ``needs_queries`` asks the engine to keep the
    last ``config.query_window`` post-RoPE queries per layer; ``needs_attn_accum`` asks it to accumulate
    attention every decode step (the eager-fallback cost of H2O).
    """

    name: ClassVar[str]
    needs_attention: ClassVar[bool] = False
    needs_queries: ClassVar[bool] = False
    needs_attn_accum: ClassVar[bool] = False

    def __init__(self, config: KVCompactConfig) -> None:
        self.config = config

    @abstractmethod
    def score(self, x: ScoreInput) -> torch.Tensor:
        """Return [B, L, G, N] float32 scores, G = H_q (per query head) or H_kv (per KV head).

        Padding slots may hold any value: selection masks them out.
        """
