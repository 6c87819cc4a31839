"""StreamingLLM: keep the most recent tokens (and the first ``n_sink``, which selection protects for every
policy)."""

from __future__ import annotations

import torch

from kvcompact.policies.base import Policy, ScoreInput


class StreamingPolicy(Policy):
    """score = position (newer is better). One score per KV head."""

    name = "streaming"

    def score(self, x: ScoreInput) -> torch.Tensor:
        return x.positions.to(torch.float32)
