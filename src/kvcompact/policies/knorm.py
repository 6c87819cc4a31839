"""K-norm: keep the keys with the lowest L2 norm (low-norm keys draw the most attention)."""

from __future__ import annotations

import torch

from kvcompact.policies.base import Policy, ScoreInput


class KNormPolicy(Policy):
    """score = -||k||_2, one score per KV head."""

    name = "knorm"

    def score(self, x: ScoreInput) -> torch.Tensor:
        return -torch.linalg.vector_norm(x.keys.float(), dim=-1)
