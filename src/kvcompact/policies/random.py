"""Uniform random eviction (a floor every other policy must beat).

The score of a cached token is a deterministic pseudo-random function of ``(config.seed, layer, KV head,
logical position)``: a 32-bit integer hash (Chris Wellons' "lowbias32" mix, applied once per input word),
scaled to ``[0, 1)`` with 24 bits so every value is exact in float32. So the keep set does not depend on
batching, on slot order, on how many rounds ran before or on which process scores it: the vLLM worker and the
transformers reference keep the same tokens, and a token keeps its priority from round to round (a uniform
random subset, drawn once per seed). ``ScoreInput.generator`` is ignored.

Under pipeline or tensor parallelism a worker sees only some layers / KV heads: :meth:`RandomPolicy.restrict`
maps its local indices back to the model's global ones, so every rank hashes the same integers.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvcompact.config import KVCompactConfig
from kvcompact.policies.base import Policy, ScoreInput

MASK32 = 0xFFFFFFFF
# lowbias32 (https://nullprogram.com/blog/2018/07/31/): x ^= x >> 16; x *= C1; x ^= x >> 15; x *= C2; x ^= x >> 16
C1 = 0x7FEB352D
C2 = 0x846CA68B


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """``(x * c) mod 2^32`` for int64 ``x`` in ``[0, 2^32)`` without int64 overflow (16-bit halves of ``c``)."""
    lo, hi = c & 0xFFFF, c >> 16
    return (x * lo + (((x * hi) & 0xFFFF) << 16)) & MASK32


def mix32(x: torch.Tensor) -> torch.Tensor:
    """lowbias32 on int64 tensors holding values in ``[0, 2^32)``."""
    x = x ^ (x >> 16)
    x = _mul32(x, C1)
    x = x ^ (x >> 15)
    x = _mul32(x, C2)
    return x ^ (x >> 16)


def hash_scores(seed: int, layers: torch.Tensor, heads: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Uniform ``[0, 1)`` float32 from the integers (broadcast together). Positions may be negative (padding)
    or >= 2^32: both 32-bit halves of the int64 value enter the hash."""
    pos = positions.to(torch.int64)
    h = mix32(torch.full((), seed & MASK32, dtype=torch.int64, device=pos.device) ^ ((seed >> 32) & MASK32))
    h = mix32(h ^ (layers.to(torch.int64, copy=False).to(pos.device) & MASK32))
    h = mix32(h ^ (heads.to(torch.int64, copy=False).to(pos.device) & MASK32))
    h = mix32(h ^ (pos & MASK32))
    h = mix32(h ^ ((pos >> 32) & MASK32))
    return (h >> 8).to(torch.float32) * (1.0 / (1 << 24))


class RandomPolicy(Policy):
    """One score per KV head: :func:`hash_scores` of ``(seed, layer, KV head, position)``."""

    name = "random"

    def __init__(self, config: KVCompactConfig) -> None:
        super().__init__(config)
        self.layer_ids: torch.Tensor | None = None  # global index of local layer i (None: identity)
        self.kv_head_ids: torch.Tensor | None = None

    def restrict(self, layers: Sequence[int] | None = None, kv_heads: Sequence[int] | None = None
                 ) -> RandomPolicy:
        """A policy for a pipeline stage (its global layer indices) and/or a tensor-parallel rank (its global
        KV head indices, in order): local index i of ScoreInput then hashes as ``layers[i]`` / ``kv_heads[i]``."""
        new = RandomPolicy(self.config)
        new.layer_ids = self.layer_ids if layers is None else torch.as_tensor(list(layers), dtype=torch.int64)
        new.kv_head_ids = self.kv_head_ids if kv_heads is None else torch.as_tensor(list(kv_heads),
                                                                                    dtype=torch.int64)
        return new

    def score(self, x: ScoreInput) -> torch.Tensor:
        B, L, H, N = x.positions.shape
        layers = torch.arange(L) if self.layer_ids is None else self.layer_ids
        heads = torch.arange(H) if self.kv_head_ids is None else self.kv_head_ids
        if layers.numel() != L or heads.numel() != H:
            raise ValueError(f"ScoreInput has {L} layers x {H} KV heads, the restricted random policy expects "
                             f"{layers.numel()} x {heads.numel()}")
        return hash_scores(self.config.seed, layers.view(1, L, 1, 1), heads.view(1, 1, H, 1), x.positions)
