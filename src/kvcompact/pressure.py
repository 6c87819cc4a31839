"""Budget mode ``pressure``: which running requests shrink, and to how many tokens, when the pool runs short.

Pure arithmetic over block counts, so it is tested without an engine; the scheduler side
(:mod:`kvcompact.vllm.admission`) measures the shortfall and turns the targets into ordinary rounds.

Accounting. Admission reserves every request's *floor footprint*, ``peak = ceil((floor + divide_length) /
block_size)`` blocks (capped at its own end), as a fixed budget equal to the floor would. A request in
pressure mode may grow past its floor footprint while the pool has room; in the next step it then occupies
``max(ceil((cache_len + 1) / block_size), peak)`` blocks (held, plus the block its next token may open). A
round to ``target`` tokens lowers that to ``max(ceil((target + 1) / block_size), peak)``: only what a request
holds beyond its floor footprint can be reclaimed, which is why shrinking every request to its floor always
covers any shortfall (the floor footprints fit by admission), so the pressure mode never has to preempt.

Spreading a shortfall: every request above its floor gives up the same share of its excess. It was measured
against the largest caches shrinking first (``kvcompact bench pressure``, real model, BENCHMARKS.md): at 16
requests in flight 21 vs 19 of 32 correct and 5.5 vs 4.7 correct answers per minute (a small sample, within its
noise), and the same at light load, where neither ran a round. The other way was deleted.

Hysteresis: a request that shrinks drops at least ``min_drop`` tokens (``divide_length``) unless its floor
stops it first, so under sustained pressure a request runs no more rounds than with a fixed budget.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvcompact.ledger import blocks_held


@dataclass(frozen=True)
class Candidate:
    """A running request in pressure mode: its cache length, its floor (budget) and floor footprint (blocks)."""

    key: str
    cache_len: int
    floor: int
    peak: int


def footprint(cache_len: int, peak: int, block_size: int) -> int:
    """Blocks a pressure-mode request occupies in the next step at ``cache_len`` cached tokens: what it holds
    plus the block its next token may open, and never less than its reserved floor footprint."""
    return max(blocks_held(cache_len + 1, block_size), peak)


def gain(c: Candidate, target: int, block_size: int) -> int:
    """Blocks a round of ``c`` down to ``target`` tokens returns to the step's budget."""
    return footprint(c.cache_len, c.peak, block_size) - footprint(target, c.peak, block_size)


def proportional(candidates: Sequence[Candidate], deficit: int, block_size: int, min_drop: int) -> dict[str, int]:
    """Every request above its floor gives up the same share of its excess (``cache_len - floor``): the
    smallest share, in tokens per 1024 of excess, that reclaims ``deficit`` blocks. Returns {key: target}."""
    if deficit <= 0:
        return {}
    shrinkable = [c for c in candidates if c.cache_len > c.floor]
    if not shrinkable:
        return {}
    scale = 1024

    def targets(keep: int) -> dict[str, int]:
        out = {}
        for c in shrinkable:
            t = c.floor + (c.cache_len - c.floor) * keep // scale
            if t < c.cache_len:
                out[c.key] = max(c.floor, min(t, c.cache_len - min_drop))
        return out

    return _search(shrinkable, deficit, block_size, targets, lo=0, hi=scale)


def _search(candidates: Sequence[Candidate], deficit: int, block_size: int, targets: Callable[[int], dict[str, int]],
            lo: int, hi: int) -> dict[str, int]:
    """The targets at the highest parameter in [lo, hi] whose reclaimed blocks cover ``deficit`` (the gain only
    grows as the parameter falls), or those at ``lo`` (the most that can be reclaimed) when none does. A round
    that would reclaim nothing is left out: it would cost a round and free no block."""
    by_key = {c.key: c for c in candidates}

    def useful(p: int) -> dict[str, int]:
        return {k: t for k, t in targets(p).items() if gain(by_key[k], t, block_size) > 0}

    def reclaimed(p: int) -> int:
        return sum(gain(by_key[k], t, block_size) for k, t in useful(p).items())

    if reclaimed(lo) < deficit:
        return useful(lo)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if reclaimed(mid) >= deficit:
            lo = mid
        else:
            hi = mid - 1
    return useful(lo)


__all__ = ["Candidate", "footprint", "gain", "proportional"]
