"""One compaction round, engine-agnostic: score -> keep set -> move plan, for a batch of requests.

The vLLM worker (:mod:`kvcompact.vllm.worker_side`) and the transformers reference path (:mod:`kvcompact.reference`)
both call :class:`RoundCore`; each engine only gathers the keys (and position tags, queries, attention
accumulators) into a :class:`RoundBatch` and executes the returned :class:`~kvcompact.moves.MovePlan`s on its
own storage. So an exactness test between the two checks the engine hooks, never two copies of the algorithm.

Also here: :func:`build_policy`, the one way both engines turn a config and a model's transformers config into a
policy (statistics checked against the model's fingerprint, RoPE rebuilt from the model's config).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
from torch import Tensor

from kvcompact.config import ConfigError, KVCompactConfig
from kvcompact.moves import MovePlan, plan_moves
from kvcompact.policies import make_policy
from kvcompact.policies.base import Policy, ScoreInput
from kvcompact.selection import select_keep


def build_policy(config: KVCompactConfig, hf_config: Any, stats: Any = None) -> Policy:
    """The configured policy for a model. TriAttention's statistics (``stats``, else ``config.stats_path``) must
    match ``hf_config``'s fingerprint: statistics made for another model are refused naming the field."""
    if not config.needs_stats:
        return make_policy(config)
    from kvcompact.rope import RopeSpec
    from kvcompact.stats import ModelFingerprint, QueryStats

    fingerprint = ModelFingerprint.from_hf_config(hf_config)
    if stats is None:
        if config.stats_path is None:
            raise ConfigError("kvcompact: policy 'triattention' needs calibration statistics: set 'stats_path' "
                              "(make them with `kvcompact calibrate MODEL --text FILE -o STATS`)")
        stats = QueryStats.load(config.stats_path, fingerprint)
    else:
        stats.check_compatible(fingerprint)
    return make_policy(config, stats=stats, rope=RopeSpec.from_hf_config(hf_config))


class BlockCopy(NamedTuple):
    """A copy-on-write replacement: block ``shared``'s content goes into block ``private``, which takes its place
    at ``table_index`` of the request's block table (:class:`kvcompact.vllm.reclaimer.Reclaimer`)."""

    table_index: int
    shared: int
    private: int


@dataclass(frozen=True)
class Round:
    """One round of one request, the one record of it from where it is decided to every listener.

    The scheduler side makes it (the vLLM engine's, or the reference's schedule): at logical length
    ``logical_len`` the cache of ``cache_len`` slots keeps ``kept_len`` tokens per KV head, with the copy-on-write
    ``copies`` made first; it also fills the blocks it freed and the pool's free blocks after. The step message
    carries it to every worker; a worker (and the transformers reference) completes it with the ``keep_mask``
    ``[L, H_kv, cache_len]`` over the slots as they were before the moves and the logical ``positions`` those
    slots held, and hands it to its round listeners.
    """

    req_id: str
    logical_len: int
    cache_len: int
    kept_len: int
    prompt_len: int = 0
    pressure: bool = False
    copies: tuple[BlockCopy, ...] = ()
    blocks_freed: int = 0
    free_blocks_after: int = 0
    keep_mask: Tensor | None = None
    positions: Tensor | None = None

    @property
    def evicted(self) -> int:
        """The eviction offset before this round: slot ``s`` past the request's position tags holds the token at
        logical position ``s + evicted`` (tokens are appended in order)."""
        return self.logical_len - self.cache_len


@dataclass
class RoundBatch:
    """One step's rounds for the round core: B requests' caches, padded to N slots (see
    :class:`~kvcompact.policies.base.ScoreInput`). ``cache_lens[b]`` slots of request b hold tokens
    (``positions`` is -1 beyond); it keeps ``kept_len[b]`` per (layer, KV head)."""

    keys: Tensor          # [B, L, H_kv, N, d] float32
    positions: Tensor     # [B, L, H_kv, N] int64
    logical_len: Tensor   # [B] int64
    kept_len: Tensor      # [B] int64
    prompt_len: Tensor    # [B] int64
    cache_lens: list[int]
    queries: Tensor | None = None
    attn_accum: Tensor | None = None


@dataclass
class RoundResult:
    keep_mask: Tensor             # [B, L, H_kv, N] bool
    plans: list[MovePlan]         # per request, over its own cache_lens[b] slots
    scoring_fallbacks: dict[int, str] = field(default_factory=dict)  # batch index -> why scoring fell back to recency
    scoring_seconds: float = 0.0


class RoundCore:
    """Scores, selects and plans one round for a batch, as configured (never built into a round under
    compaction "none": the engine moves nothing then, and the planner refuses that mode)."""

    def __init__(self, config: KVCompactConfig, policy: Policy, num_q_heads: int) -> None:
        self.config = config
        self.policy = policy
        self.num_q_heads = num_q_heads
        self.generator = torch.Generator().manual_seed(config.seed)

    def run(self, x: RoundBatch) -> RoundResult:
        start = time.perf_counter()
        failed: dict[int, str] = {}
        scores = self._score(x, list(range(len(x.cache_lens))), failed)
        keep_mask = self.select(scores, x.positions, x.logical_len, x.kept_len, x.prompt_len)
        seconds = time.perf_counter() - start
        return RoundResult(keep_mask=keep_mask, plans=self.plan(keep_mask, x.cache_lens), scoring_fallbacks=failed,
                           scoring_seconds=seconds)

    def select(self, scores: Tensor, positions: Tensor, logical_len: Tensor, kept_len: Tensor,
               prompt_len: Tensor) -> Tensor:
        """The keep mask [B, L, H_kv, N] for ``scores`` [B, L, G, N] (the rest as in :class:`RoundBatch`), as
        configured. Public so that scores made straight from a paged cache (the fused kernel of
        :mod:`kvcompact.vllm.paged_triton`, which needs no gathered keys) go through the same selection."""
        cfg = self.config
        return select_keep(scores, positions, logical_len, kept_len, prompt_len, window=cfg.window,
                           protect_prompt=cfg.protect_prompt, mode=cfg.selection, n_sink=cfg.n_sink)

    def plan(self, keep_mask: Tensor, cache_lens: list[int]) -> list[MovePlan]:
        """One move plan per request, over its own ``cache_lens[b]`` slots.

        Requests with the same length and kept count (in a round, usually all of them) are planned as one
        [g*L, H, N] batch, so a round costs a few host syncs per group rather than per request (it matters on a
        GPU). A request's plan may then carry more padding entries than it would alone: self-copies, no-ops."""
        kept = keep_mask[:, 0, 0].sum(dim=-1).tolist()
        groups: dict[tuple[int, int], list[int]] = {}
        for b, n in enumerate(cache_lens):
            groups.setdefault((n, int(kept[b])), []).append(b)
        plans: list[MovePlan | None] = [None] * len(cache_lens)
        L, H = keep_mask.shape[1:3]
        for (n, _), rows in groups.items():
            index = torch.tensor(rows, dtype=torch.int64, device=keep_mask.device)
            group = plan_moves(keep_mask.index_select(0, index)[..., :n].reshape(len(rows) * L, H, n),
                               self.config.compaction)
            shaped = [x.view(len(rows), L, H, -1) for x in (group.src, group.dst, group.valid)]
            for i, b in enumerate(rows):
                plans[b] = MovePlan(src=shaped[0][i], dst=shaped[1][i], valid=shaped[2][i], kept_len=group.kept_len)
        return [p for p in plans if p is not None]

    def _score(self, x: RoundBatch, rows: list[int], failed: dict[int, str]) -> Tensor:
        """Scores of the requests ``rows`` of ``x``. A policy error never fails the round: the batch is re-scored
        one request at a time, and a request that fails alone falls back to recency (its positions)."""
        index = torch.tensor(rows, dtype=torch.int64, device=x.keys.device)
        pick = (lambda v: None if v is None else v.index_select(0, index))  # noqa: E731
        positions = x.positions.index_select(0, index)
        try:
            return self.policy.score(ScoreInput(
                keys=x.keys.index_select(0, index), positions=positions,
                logical_len=x.logical_len.index_select(0, index), num_q_heads=self.num_q_heads,
                queries=pick(x.queries), attn_accum=pick(x.attn_accum), generator=self.generator))
        except Exception as e:  # noqa: BLE001 - one bad request must not take the engine down
            if len(rows) > 1:
                return torch.cat([self._per_query_head(self._score(x, [b], failed)) for b in rows])
            failed[rows[0]] = f"{type(e).__name__}: {e}"
            return positions.to(torch.float32)

    def _per_query_head(self, scores: Tensor) -> Tensor:
        """Scores [1, L, G, N] as G = H_q rows (a KV head's row repeated over its query group), so requests
        scored per KV head (a recency fallback) and per query head can be stacked; selection's z-score and group
        max give the same keep set either way."""
        return scores.repeat_interleave(self.num_q_heads // scores.shape[2], dim=2)


__all__ = ["BlockCopy", "Round", "RoundBatch", "RoundCore", "RoundResult", "build_policy"]
