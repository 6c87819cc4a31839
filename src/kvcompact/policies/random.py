"""Uniform random eviction (a floor every other policy must beat)."""

from __future__ import annotations

import torch

from kvcompact.config import KVCompactConfig
from kvcompact.policies.base import Policy, ScoreInput


class RandomPolicy(Policy):
    """Uniform [0, 1) scores per KV head from ``x.generator`` (or, when the engine passes none, from this
    policy's own generator seeded with ``config.seed`` once, so successive rounds differ but runs repeat)."""

    name = "random"

    def __init__(self, config: KVCompactConfig) -> None:
        super().__init__(config)
        self._generator = torch.Generator(device="cpu").manual_seed(config.seed)

    def score(self, x: ScoreInput) -> torch.Tensor:
        g = x.generator if x.generator is not None else self._generator
        shape = tuple(x.positions.shape)
        return torch.rand(shape, generator=g, device=g.device, dtype=torch.float32).to(x.keys.device)
