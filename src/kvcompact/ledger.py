"""Round arithmetic and the per-request ledger: the one home of "when does a round run, how long is the cache,
how many blocks can a request hold" (docs/DESIGN.md, "The ledger").

Pure integers, no vLLM: the scheduler side owns one :class:`Ledger` per request and carries each request's
eviction offset to the workers in the step message; the transformers reference path and the tools ask the same
functions, so the engine, the reference and ``kvcompact capacity`` cannot disagree on where a round falls.

A request has a *logical length* (tokens it has processed: RoPE positions, stopping, vLLM's
``num_computed_tokens``, ``logical_len``) and a *cache length* (slots its KV cache occupies, ``cache_len``),
``cache_len = logical_len - evicted``.
A round runs when the cache reaches the *trigger* ``budget + divide_length`` and leaves ``budget`` tokens, so a
request that frees blocks never holds more than ``blocks_held(trigger)`` blocks. With ``budget_ratio`` the budget
grows with the answer (:func:`growth`), so the bound is the trigger at the request's current length.
"""

from __future__ import annotations

from dataclasses import dataclass


def blocks_held(num_tokens: int, block_size: int) -> int:
    """Blocks a cache of ``num_tokens`` occupies (ceil division)."""
    if num_tokens < 0 or block_size <= 0:
        raise ValueError(f"need num_tokens >= 0 and block_size > 0, got {num_tokens}, {block_size}")
    return -(-num_tokens // block_size)


def trigger(budget: int, divide_length: int) -> int:
    """The cache length at which a round runs: one round per ``divide_length`` tokens once past the budget."""
    return budget + divide_length


def effective_budget(budget: int, prompt_len: int, protect_prompt: bool) -> int:
    """The budget actually enforced for one request (tokens per KV head after a round).

    With ``protect_prompt`` the prompt is kept whole and ``budget`` bounds what the request generated: the
    request keeps ``prompt_len + budget`` tokens. A long answer reads its question late (the second of several
    problems, the constraint stated once at the top), so a prompt squeezed into the same budget as the
    reasoning is lost exactly when it is needed; the generated tokens still get the whole budget (of which the
    recent window and the sinks are the part no score can evict).
    """
    return prompt_len + budget if protect_prompt else budget


def growth(base: int, ratio: float, generated: int) -> int:
    """Tokens ``budget_ratio`` adds to a request's budget once it generated ``generated`` tokens: the excess of
    ``ratio * generated`` over the configured budget ``base`` (0 before it). A fixed floor keeps a shorter and
    shorter share of a long answer, and the results an answer restates at its end are spread over all of it.
    Monotone in ``generated``, so the budget never shrinks."""
    return max(0, int(ratio * generated) - base)


@dataclass
class Ledger:
    """One request's compaction accounts, owned by the scheduler side (the workers get ``evicted`` in the step
    plan and keep no copy of their own).

    ``evicted``: the slots the rounds gave back (logical length - cache length), which allocation, ``seq_lens``
    and the slot mapping follow; ``dropped``: the tokens the rounds took out of attention, which triggers and
    metrics follow. They differ only under compaction ``none``, where dropped tokens are masked in place and no
    slot is given back.
    """

    enabled: bool
    budget: int               # effective budget (tokens per KV head after a round); the floor in pressure mode
    divide_length: int
    prompt_len: int
    frees_blocks: bool        # compression on and compaction not "none": bounded at the trigger
    base: int = 0             # the configured budget (before the protected prompt): what ``ratio`` competes with
    ratio: float = 0.0        # budget_ratio: the budget grows to this share of the generated tokens (0: it does not)
    grown: int = 0            # tokens ``ratio`` added to ``budget`` so far
    pressure: bool = False    # rounds only when the pool is short: budget mode "pressure", "latch" until a round
    latch: bool = False       # budget modes "latch", "pool_latch": its first round ends ``pressure`` (then fixed)
    pool_latch: bool = False  # "pool_latch": ``pressure`` also ends while another such request that latched runs
    evicted: int = 0
    dropped: int = 0
    rounds: int = 0

    @property
    def trigger(self) -> int:
        return trigger(self.budget, self.divide_length)

    def cache_len(self, logical_len: int) -> int:
        """Tokens the cache holds for attention at ``logical_len`` processed tokens (``dropped`` ones excluded)."""
        return logical_len - self.dropped

    def due(self, logical_len: int) -> bool:
        """Whether a fixed-budget round runs before the step that starts at ``logical_len`` processed tokens."""
        return self.enabled and not self.pressure and self.cache_len(logical_len) >= self.trigger

    def step_cap(self, computed: int) -> int:
        """The most tokens one step may schedule from ``computed``: up to the trigger, so neither a prefill chunk
        nor a step's speculative drafts carry the cache past it; at least 1 (a sampled token is never cut)."""
        return max(1, self.trigger - (computed - self.evicted))

    def hit_cap(self, block_size: int, spec_tokens: int) -> int:
        """The longest prefix-cache hit: whole blocks short of the trigger, so the first prefill chunk still ends
        at it. vLLM pads a hit that leaves one token to ``1 + spec_tokens`` tokens, so it stops that much sooner."""
        return (self.trigger - 1 - spec_tokens) // block_size * block_size

    def peak_tokens(self, total: int, lookahead: int = 0) -> int:
        """The most token slots the cache can hold from now on, for a request that may reach ``total`` tokens.
        ``lookahead``: the slots past its scheduled tokens that vLLM reserves for a draft model's KV (vLLM's
        ``num_lookahead_tokens``), so a request bounded at its trigger holds up to ``trigger + lookahead``."""
        return min(total, self.trigger + lookahead) if self.frees_blocks else total

    def grow(self, logical_len: int) -> None:
        """Raise the budget by :func:`growth` at ``logical_len`` processed tokens. Called at the start of each step,
        before its rounds are planned; a preempted request that re-prefills keeps the budget it reached."""
        extra = growth(self.base, self.ratio, logical_len - self.prompt_len)
        if extra > self.grown:
            self.budget += extra - self.grown
            self.grown = extra

    def record_round(self, cache_len: int, kept_len: int) -> None:
        """Account one round from ``cache_len`` to ``kept_len`` cached tokens."""
        if self.frees_blocks:
            self.evicted += cache_len - kept_len
        self.dropped += cache_len - kept_len
        self.rounds += 1
        if self.latch:
            self.pressure = False

    def restart(self) -> None:
        """A preempted request: its blocks are gone and it re-prefills from an empty cache."""
        self.evicted = self.dropped = 0


__all__ = ["Ledger", "blocks_held", "effective_budget", "growth", "trigger"]
