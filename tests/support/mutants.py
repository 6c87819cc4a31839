"""Deliberate defects that the negative controls inject, kept out of the product: into the transformers reference
path (each patches one method of the reference's per-request run for the duration of a ``with`` block), and into a
KV-cache layout (:func:`one_at_a_time`)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from kvcompact import reference


@contextmanager
def _patched(name: str, method: Any) -> Iterator[None]:
    original = getattr(reference._Run, name)
    setattr(reference._Run, name, method)
    try:
        yield
    finally:
        setattr(reference._Run, name, original)


def rope_at_slot_index() -> Any:
    """The new token's RoPE position is its cache slot index instead of its logical position: what an engine that
    let positions follow the compacted cache would compute."""
    return _patched("rope_positions",
                    lambda run, n: torch.arange(run.cache_len, run.cache_len + n, device=run.device))


def window_by_slot() -> Any:
    """Sliding-window layers window over cache slots instead of logical positions (what vLLM's CPU kernel does;
    equal to the model's definition only after an order-preserving repack)."""
    def positions(run: Any, layer: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        keys = torch.arange(run.cache_len + n, device=run.device).expand(run.num_kv_heads, -1)
        return torch.arange(run.cache_len, run.cache_len + n, device=run.device), keys

    return _patched("window_positions", positions)


def generate_rope_at_slot_index(*args: Any, **kwargs: Any) -> Any:
    """``reference.generate`` with :func:`rope_at_slot_index`."""
    with rope_at_slot_index():
        return reference.generate(*args, **kwargs)


def generate_window_by_slot(*args: Any, **kwargs: Any) -> Any:
    """``reference.generate`` with :func:`window_by_slot`."""
    with window_by_slot():
        return reference.generate(*args, **kwargs)


def one_at_a_time(layout: type[Any]) -> type[Any]:
    """``layout`` (a KV-cache layout class) whose ``move`` copies the moves one by one, so a chain reads a slot after
    it was overwritten: the mutant a layout's move tests must catch."""

    class OneAtATime(layout):  # type: ignore[misc, valid-type]
        def move(self, kv: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
            for m in range(src.shape[1]):
                k, v = self.gather(kv, src[:, m:m + 1])
                self.scatter(kv, dst[:, m:m + 1], k, v)

    OneAtATime.__name__ = OneAtATime.__qualname__ = f"OneAtATime{layout.__name__}"
    return OneAtATime
