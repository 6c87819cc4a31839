"""What the attention-based policies remember of one request between rounds, kept the same way by both engines:
the recent post-RoPE queries (SnapKV, R-KV) and the attention accumulated per cached slot (H2O).

The vLLM worker (:mod:`kvcompact.vllm.capture`) fills them from inside vLLM's forward pass, the transformers
reference (:mod:`kvcompact.reference`) from the model's eager attention; a round reads them and moves the
accumulator with the same plan as the cache (docs/DESIGN.md, section 4.4).
"""

from __future__ import annotations

import torch

from kvcompact.moves import MovePlan, apply_plan


class QueryRing:
    """The last ``window + slack`` query rows of one request, per layer, indexed by logical position: the row of
    position ``p`` sits at ``p % size``. A round at logical length ``t`` reads positions ``t - window .. t - 1``;
    the ``slack`` extra rows hold speculative drafts (positions ``>= t``) without overwriting them."""

    def __init__(self, num_layers: int, window: int, slack: int = 0) -> None:
        self.num_layers = num_layers
        self.window = window
        self.size = window + slack
        self.rows: torch.Tensor | None = None  # [L, size, H_q, d] float32, allocated by the first write
        self.first: int | None = None          # logical positions [first, end) written since the cache began
        self.end = 0

    def advance(self, start: int, n: int) -> tuple[int, torch.Tensor]:
        """Rows for positions ``start .. start + n - 1`` are about to be written (one call per forward, before any
        layer): how many of the last rows are kept (``take``) and the ring slots they go to [take]."""
        if self.first is None:
            self.first = start
        self.end = start + n
        take = min(n, self.size)
        return take, torch.arange(start + n - take, start + n, dtype=torch.int64) % self.size

    def write(self, layer: int, slots: torch.Tensor, rows: torch.Tensor) -> None:
        """Store ``rows`` [take, H_q, d] (the last rows of a forward) of ``layer`` at ring ``slots``."""
        if self.rows is None:
            self.rows = torch.zeros(self.num_layers, self.size, *rows.shape[1:], dtype=torch.float32,
                                    device=rows.device)
        self.rows[layer, slots.to(rows.device)] = rows.float()

    def window_at(self, end: int) -> torch.Tensor:
        """[L, H_q, window, d]: the queries of positions ``end - window .. end - 1``, oldest first."""
        first = self.first if self.first is not None else end
        if self.rows is None or first > end - self.window or end > self.end:
            have = max(0, min(end, self.end) - first) if self.rows is not None else 0
            raise RuntimeError(f"{have} captured query rows, the window needs {self.window}")
        order = torch.arange(end - self.window, end) % self.size
        return self.rows[:, order.to(self.rows.device)].transpose(1, 2)


class AttentionSums:
    """H2O's attention accumulated per cached slot of one request: [L, H_kv, length] float32 (capacity doubles as
    the cache grows)."""

    def __init__(self, num_layers: int, num_kv_heads: int, device: torch.device | str = "cpu") -> None:
        self.data = torch.zeros(num_layers, num_kv_heads, 0, dtype=torch.float32, device=device)
        self.length = 0

    def values(self) -> torch.Tensor:
        """[L, H_kv, length], a view: adding into it accumulates."""
        return self.data[:, :, : self.length]

    def grow(self, length: int) -> None:
        """The cache now holds ``length`` slots: the new ones (this forward's tokens) start at zero."""
        if self.data.shape[-1] < length:
            cap = max(length, 2 * self.data.shape[-1], 64)
            new = self.data.new_zeros(*self.data.shape[:2], cap)
            new[:, :, : self.length] = self.values()
            self.data = new
        elif self.length < length:
            self.data[:, :, self.length: length] = 0.0
        self.length = length

    def truncate(self, length: int) -> None:
        """Forget the slots from ``length`` on (rejected speculative drafts)."""
        self.length = min(self.length, length)

    def move(self, plan: MovePlan) -> None:
        """Slots ``0 .. plan.kept_len - 1`` hold what the cache holds after the round's moves."""
        on = MovePlan(src=plan.src.to(self.data.device), dst=plan.dst.to(self.data.device),
                      valid=plan.valid.to(self.data.device), kept_len=plan.kept_len)
        self.data = apply_plan(self.values(), on)
        self.length = plan.kept_len


__all__ = ["QueryRing", "AttentionSums"]
