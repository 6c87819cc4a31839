"""StreamingLLM: keep the first ``n_sink`` tokens (attention sinks) and the most recent ones."""

from __future__ import annotations

import torch

from kvcompact.policies.base import Policy, ScoreInput

# Added to the score of sink tokens. Exactly representable in float32 and far above any position (< 2^24 is
# exact; RoPE contexts stay well below 2^30), so sinks always rank first; not +inf, which would turn z-scores
# into NaN in selection.
SINK_BONUS = float(2**30)


class StreamingPolicy(Policy):
    """score = position (newer is better) + SINK_BONUS for position < n_sink. One score per KV head."""

    name = "streaming"

    def score(self, x: ScoreInput) -> torch.Tensor:
        pos = x.positions
        s = pos.to(torch.float32)
        sink = (pos >= 0) & (pos < self.config.n_sink)
        return torch.where(sink, s + SINK_BONUS, s)
