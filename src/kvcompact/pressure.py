"""Budget mode ``pressure``: which running requests shrink, and to how many tokens, when the pool runs short.

Pure arithmetic over block counts, so it is tested without an engine; the scheduler side
(:mod:`kvcompact.vllm.admission`) measures the shortfall and turns the targets into ordinary rounds. The accounting,
and why there are three spreads (:func:`fewest`, the default, ``even``, :func:`proportional`, and ``all``,
:func:`every`): docs/DESIGN.md, section 4.7. The invariant: only what a request holds beyond its floor footprint
can be reclaimed, and a request never goes below its floor, so shrinking every request to its floor always covers
a shortfall and the mode never preempts. A request that shrinks drops at least ``min_drop`` (``divide_length``)
tokens unless its floor stops it.
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
    compressed: bool = False  # a round already evicted some of its tokens


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


def fewest(candidates: Sequence[Candidate], deficit: int, block_size: int, min_drop: int) -> dict[str, int]:
    """The shortfall from as few requests as possible: the compressed ones first, then the largest excess; each
    shrinks only as far as what is still missing needs (by at least ``min_drop`` tokens, never below its floor).
    Returns {key: target}; when even every floor falls short, every request shrinks to its floor."""
    if deficit <= 0:
        return {}
    order = sorted((c for c in candidates if c.cache_len > c.floor),
                   key=lambda c: (not c.compressed, c.floor - c.cache_len, c.key))
    out: dict[str, int] = {}
    for c in order:
        if deficit <= 0:
            break
        def alone(t: int, key: str = c.key) -> dict[str, int]:
            return {key: t}

        # the highest target in [floor, cache_len - min_drop] that covers what is missing, else the floor
        target = _search([c], deficit, block_size, alone, lo=c.floor, hi=max(c.floor, c.cache_len - min_drop))
        out.update(target)
        deficit -= sum(gain(c, t, block_size) for t in target.values())
    return out


def every(candidates: Sequence[Candidate], deficit: int, block_size: int, min_drop: int) -> dict[str, int]:
    """Any shortfall takes every request that holds a block beyond its floor footprint to its floor. Under budget
    mode ``latch`` this latches every such request at the pool's first shortfall instead of only as many as it
    needs, so none of them grows into the room the others' rounds just gave back. Returns {key: floor}."""
    if deficit <= 0:
        return {}
    return {c.key: c.floor for c in candidates if gain(c, c.floor, block_size) > 0}


SPREADS: dict[str, Callable[[Sequence[Candidate], int, int, int], dict[str, int]]] = {
    "fewest": fewest, "even": proportional, "all": every}


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


__all__ = ["Candidate", "SPREADS", "every", "fewest", "footprint", "gain", "proportional"]
