"""The transformers reference path: a compressed KV cache that applies any kvcompact policy exactly as the
vLLM plugin does, so greedy outputs of the two can be compared token for token (and the accuracy harness can
measure what eviction costs without starting an engine).

It must mirror the engine (docs/DESIGN.md, sections 2 to 4): rounds fall at the same cache lengths (the ledger's
trigger, the prefill cut there), run the same :class:`~kvcompact.round.RoundCore` on a
:class:`~kvcompact.round.RoundBatch` gathered from :class:`DenseKV`, and move keys, values, position tags and the
H2O accumulator with :func:`kvcompact.moves.apply_plan`; RoPE positions stay logical; queries and attention go
into the same :mod:`kvcompact.attention_state` objects as the engine's. A request's rounds come from a *schedule*
(when, and how many tokens stay) and a *chooser* (which tokens stay): :func:`_round_sources`.
"""

from __future__ import annotations

import contextlib
from collections import deque
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from kvcompact import hf_attention
from kvcompact.attention_state import AttentionSums, QueryRing
from kvcompact.config import KVCompactConfig
from kvcompact.ledger import effective_budget, growth, trigger
from kvcompact.moves import MovePlan, apply_plan, ascending_slots, plan_moves
from kvcompact.recall import CODECS, Recall
from kvcompact.round import Round, RoundBatch, RoundCore, build_policy

# Longest chunk teacher_forced_nll feeds in one forward (prefill and decode): bounds the logits and eager
# attention memory; up to float rounding the same computation as one token at a time.
_MAX_CHUNK = 256
# Tokens before the next check when no round lies ahead.
_NEVER = 1 << 62


def load_model(model_dir: str | Path, dtype: torch.dtype = torch.float32) -> Any:
    """An ``AutoModelForCausalLM`` with eager attention, in eval mode (the reference needs plain eager attention;
    fp32 for exactness tests)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype, attn_implementation="eager").eval()


@torch.no_grad()
def generate(model: Any, prompt_ids: list[int], max_new_tokens: int, config: KVCompactConfig | None, *,
             stats: Any = None, keep_sets: list[Tensor] | None = None, eviction: bool = True,
             targets: Sequence[tuple[int, int]] | None = None, recalls: Sequence[Recall] | None = None,
             logprobs: list[float] | None = None) -> tuple[list[int], list[Round]]:
    """Greedy generation of ``max_new_tokens`` tokens (EOS is not a stop, like vLLM's ``ignore_eos``).

    ``config`` None, ``config.enabled`` False or ``eviction=False`` give full attention. ``keep_sets`` replays
    recorded keep masks instead of scoring. ``targets`` replays recorded rounds ``(logical length, tokens kept)``
    instead of the trigger (every one must be reached). ``recalls`` replays recorded recalls (each at its logical
    length, before that length's round or, ``in_forward``, after it): the reference keeps every token its rounds
    evict and swaps each recalled position back into its slot, so it checks the engine's store, slots and tags
    with its own bookkeeping.
    ``logprobs``: each generated token's log-probability is appended to it (a check finer than the argmax: a
    defect that moves the distribution without changing a greedy token shows there).
    Returns the generated token ids and one :class:`Round` per round.
    """
    if max_new_tokens <= 0:
        return [], []
    run = _Run(model, config, stats=stats, keep_sets=keep_sets, eviction=eviction, prompt_len=len(prompt_ids),
               targets=targets, recalls=recalls)
    with run.capturing():
        logits = _prefill(run, prompt_ids)
        tokens: list[int] = []
        while True:
            tokens.append(int(logits[-1].argmax()))
            if logprobs is not None:
                logprobs.append(float(logits[-1].float().log_softmax(-1)[tokens[-1]]))
            if len(tokens) == max_new_tokens:
                break
            run.maybe_recall(in_forward=False)
            run.maybe_round()
            run.maybe_recall(in_forward=True)
            logits = run.forward(tokens[-1:], prefill=False, logits_to_keep=1)
    run.maybe_recall(in_forward=False)  # a recall after the last forward: due, but no token reads it
    if run.recalls:
        raise ValueError(f"{len(run.recalls)} recalls were never reached (logical lengths "
                         f"{[r.logical_len for r in run.recalls]})")
    if targets is not None and len(run.rounds) != len(targets):
        raise ValueError(f"{len(targets)} rounds to replay, but the generation reached only {len(run.rounds)} "
                         f"(logical lengths {[at for at, _ in targets]})")
    return tokens, run.rounds


@torch.no_grad()
def teacher_forced_nll(model: Any, token_ids: list[int], config: KVCompactConfig | None, *, prefix_len: int,
                       stats: Any = None) -> Tensor:
    """Per-token NLL (float32, natural log) of ``token_ids[prefix_len:]``.

    ``token_ids[:prefix_len]`` is prefilled (it is the prompt for the budget), then the tokens are fed as decode
    steps with the same compression rounds as :func:`generate`. Between rounds the decode steps are fed as one
    causal chunk (at most ``_MAX_CHUNK`` tokens, never crossing a trigger point), which is the same computation
    up to float rounding; H2O (attention accumulated per step) is fed one token at a time.
    """
    if not 0 < prefix_len <= len(token_ids):
        raise ValueError(f"prefix_len must be in [1, {len(token_ids)}], got {prefix_len}")
    run = _Run(model, config, stats=stats, keep_sets=None, eviction=True, prompt_len=prefix_len)
    targets = torch.tensor(token_ids[prefix_len:], dtype=torch.long)
    nll = torch.empty(len(targets), dtype=torch.float32)
    if len(targets) == 0:
        return nll
    step_chunk = 1 if run.needs_attn_accum else _MAX_CHUNK
    with run.capturing():
        logits = _prefill(run, token_ids[:prefix_len])
        nll[0] = _nll(logits[-1:], targets[:1])[0]
        pos = prefix_len          # next token to feed; it predicts token_ids[pos + 1]
        end = len(token_ids) - 1  # the last token is only a target
        while pos < end:
            run.maybe_round()
            n = min(step_chunk, end - pos, run.steps_before_trigger())
            logits = run.forward(token_ids[pos:pos + n], prefill=False, logits_to_keep=n)
            i = pos - prefix_len + 1
            nll[i:i + n] = _nll(logits, targets[i:i + n])
            pos += n
    return nll


def _prefill(run: _Run, prompt_ids: list[int]) -> Tensor:
    """Chunked prefill with rounds inside the prompt: each chunk ends at the next trigger (or after
    ``_MAX_CHUNK`` tokens, which bounds the [heads, n, n] eager attention matrices of a long prompt; the same
    computation up to float rounding), and a round runs before the next chunk. Returns the logits of the
    prompt's last token."""
    start = 0
    while start < len(prompt_ids):
        run.maybe_recall(in_forward=False)
        run.maybe_round()
        run.maybe_recall(in_forward=True)
        n = min(_MAX_CHUNK, len(prompt_ids) - start, run.steps_before_trigger())
        logits = run.forward(prompt_ids[start:start + n], prefill=True, logits_to_keep=1)
        start += n
    return logits


def _nll(logits: Tensor, targets: Tensor) -> Tensor:
    logp = torch.log_softmax(logits.float(), dim=-1)
    return -logp.gather(-1, targets.to(logp.device).view(-1, 1)).squeeze(-1).cpu()


class DenseKV:
    """The reference's cache as a round reads and writes it: a transformers ``DynamicCache`` of one request,
    ``[1, H_kv, N, d]`` keys and values per layer. The dense counterpart of the engine's
    :class:`kvcompact.vllm.paged_kv.PagedKV`, so both engines run a round as gather -> round core -> execute."""

    def __init__(self, cache: Any) -> None:
        self.cache = cache

    def stacked(self, which: str) -> Tensor:
        """``"keys"`` or ``"values"`` of every layer, [L, H_kv, N, d] in the model's dtype."""
        return torch.stack([getattr(layer, which)[0] for layer in self.cache.layers])

    def gather_keys(self) -> Tensor:
        """float32 keys [1, L, H_kv, N, d], post-RoPE as stored."""
        return self.stacked("keys").unsqueeze(0).float()

    def execute(self, plan: MovePlan) -> None:
        """Move keys and values of every layer with the round's plan: slots ``0 .. kept_len - 1`` hold the kept
        tokens and the cache shrinks to them."""
        k = apply_plan(self.stacked("keys"), plan)
        v = apply_plan(self.stacked("values"), plan)
        for i, layer in enumerate(self.cache.layers):
            layer.keys = k[i].unsqueeze(0)
            layer.values = v[i].unsqueeze(0)


class _NoRounds:
    """Full attention: no config, compression disabled, ``eviction=False``, or compaction ``none`` (which moves
    nothing in the engine either, so every token stays attended)."""

    def tokens_before_check(self, logical_len: int, cache_len: int) -> int:
        return _NEVER

    def due(self, logical_len: int, cache_len: int) -> list[int]:
        return []


class _BudgetSchedule:
    """The engine's fixed budget: a round whenever the cache reaches the trigger, down to the effective budget,
    grown by ``budget_ratio`` as the answer lengthens (the same ledger arithmetic as the scheduler, so rounds fall
    at the same cache lengths)."""

    def __init__(self, config: KVCompactConfig, prompt_len: int) -> None:
        self.config = config
        self.prompt_len = prompt_len
        self.budget0 = effective_budget(config.budget, prompt_len, config.protect_prompt)

    def budget(self, logical_len: int) -> int:
        return self.budget0 + growth(self.config.budget, self.config.budget_ratio, logical_len - self.prompt_len)

    def tokens_before_check(self, logical_len: int, cache_len: int) -> int:
        return max(1, trigger(self.budget(logical_len), self.config.divide_length) - cache_len)

    def due(self, logical_len: int, cache_len: int) -> list[int]:
        budget = self.budget(logical_len)
        return [budget] if cache_len >= trigger(budget, self.config.divide_length) else []


class _ReplayedTargets:
    """Recorded rounds ``(logical length, kept_len)`` in order: pressure mode picks its rounds from the pool's
    state, which the reference does not have. Each is due once, when the logical length equals its own."""

    def __init__(self, targets: Sequence[tuple[int, int]]) -> None:
        self.pending = deque(targets)

    def tokens_before_check(self, logical_len: int, cache_len: int) -> int:
        return next((at - logical_len for at, _ in self.pending if at > logical_len), _NEVER)

    def due(self, logical_len: int, cache_len: int) -> list[int]:
        """The targets due now, taken off the pending ones."""
        due = []
        while self.pending and self.pending[0][0] == logical_len:
            due.append(self.pending.popleft()[1])
        return due


class _Scored:
    """Keeps what the policy scores highest, through the same :class:`RoundCore` as the vLLM worker."""

    def __init__(self, core: RoundCore) -> None:
        self.core = core
        self.needs_queries = core.policy.needs_queries
        self.needs_attn_accum = core.policy.needs_attn_accum

    def choose(self, run: _Run, kept_len: int) -> tuple[Tensor, MovePlan]:
        """The keep mask [L, H_kv, N] and move plan of a round of ``run`` down to ``kept_len`` tokens."""
        logical_len = run.logical_len
        out = self.core.run(RoundBatch(
            keys=run.kv.gather_keys(), positions=run.positions.unsqueeze(0), logical_len=torch.tensor([logical_len]),
            kept_len=torch.tensor([kept_len]), prompt_len=torch.tensor([run.prompt_len]), cache_lens=[run.cache_len],
            queries=run.ring.window_at(logical_len).unsqueeze(0) if self.needs_queries else None,
            attn_accum=run.accum.values().unsqueeze(0) if self.needs_attn_accum else None))
        if out.scoring_fallbacks:
            raise RuntimeError(f"scoring failed: {out.scoring_fallbacks[0]}")
        return out.keep_mask[0], out.plans[0]


class _Replayed:
    """Keeps recorded masks, one per round in order, instead of scoring: nothing to capture for them. With keep
    sets recorded from the plugin, an exactness test checks the engine hooks independently of score ties."""

    needs_queries = needs_attn_accum = False

    def __init__(self, keep_sets: list[Tensor], compaction: str) -> None:
        self.keep_sets = keep_sets
        self.compaction = compaction

    def choose(self, run: _Run, kept_len: int) -> tuple[Tensor, MovePlan]:
        """The next recorded mask, checked against ``run``'s cache and the round's ``kept_len``, and its plan."""
        i, N = len(run.rounds), run.cache_len
        if i >= len(self.keep_sets):
            raise ValueError(f"round {i} triggered at logical length {run.logical_len} (cache {N}) but only "
                             f"{len(self.keep_sets)} keep sets were given")
        keep_mask = torch.as_tensor(self.keep_sets[i]).to(run.device)
        want = (run.num_layers, run.num_kv_heads, N)
        if keep_mask.dtype != torch.bool or tuple(keep_mask.shape) != want:
            raise ValueError(f"keep set {i} must be a {list(want)} bool tensor, got {keep_mask.dtype} "
                             f"{list(keep_mask.shape)}")
        plan = plan_moves(keep_mask, self.compaction)
        if plan.kept_len != kept_len:
            raise ValueError(f"keep set {i} keeps {plan.kept_len} tokens, the round's target is {kept_len}")
        return keep_mask, plan


def _round_sources(model_config: Any, config: KVCompactConfig | None, *, stats: Any, keep_sets: list[Tensor] | None,
                   eviction: bool, prompt_len: int, targets: Sequence[tuple[int, int]] | None,
                   ) -> tuple[_NoRounds | _BudgetSchedule | _ReplayedTargets, _Scored | _Replayed | None]:
    """The schedule and the chooser of one request's rounds, from :func:`generate`'s arguments (no chooser
    without rounds: the policy is not even built)."""
    if config is None or not config.enabled or not eviction or config.compaction == "none":
        return _NoRounds(), None
    schedule = (_ReplayedTargets(targets) if targets is not None else
                _BudgetSchedule(config, prompt_len))
    if keep_sets is not None:
        return schedule, _Replayed(keep_sets, config.compaction)
    policy = build_policy(config, model_config, stats)
    return schedule, _Scored(RoundCore(config, policy, int(model_config.num_attention_heads)))


class _Run:
    """One request's compressed cache (:class:`DenseKV`) plus per-slot position tags, the query ring and the
    attention accumulator; its rounds fall where its schedule says and keep what its chooser picks."""

    def __init__(self, model: Any, config: KVCompactConfig | None, *, stats: Any, keep_sets: list[Tensor] | None,
                 eviction: bool, prompt_len: int, targets: Sequence[tuple[int, int]] | None = None,
                 recalls: Sequence[Recall] | None = None) -> None:
        from transformers import DynamicCache

        self.model = model
        self.device = next(model.parameters()).device
        mc = model.config
        self.num_layers = int(mc.num_hidden_layers)
        self.num_q_heads = int(mc.num_attention_heads)
        self.num_kv_heads = int(getattr(mc, "num_key_value_heads", None) or mc.num_attention_heads)
        # windowed models: a plain cache (its sliding layers would drop what the windowed mask below decides); it
        # keeps every token in every layer, as the engine's one KV-cache group does
        self.windowed = getattr(mc, "sliding_window", None) is not None
        self.kv = DenseKV(DynamicCache() if self.windowed else DynamicCache(config=mc))
        self.schedule, self.chooser = _round_sources(mc, config, stats=stats, keep_sets=keep_sets,
                                                     eviction=eviction, prompt_len=prompt_len, targets=targets)
        self.needs_queries = self.chooser is not None and self.chooser.needs_queries
        self.needs_attn_accum = self.chooser is not None and self.chooser.needs_attn_accum
        self.prompt_len = prompt_len
        self.logical_len = 0
        self.rounds: list[Round] = []
        self.positions = torch.empty(self.num_layers, self.num_kv_heads, 0, dtype=torch.long, device=self.device)
        self.ring = QueryRing(self.num_layers, config.query_window if config is not None else 0)
        self.ring_slots: tuple[int, Tensor] = (0, torch.empty(0, dtype=torch.int64))  # this forward's rows
        self.step_queries: list[Tensor | None] = [None] * self.num_layers
        self.accum = AttentionSums(self.num_layers, self.num_kv_heads, self.device)
        # Replayed recalls, and every token the rounds evicted: K, V [L, H_kv, S, d] and positions [L, H_kv, S],
        # K and V as the engine's store gives them back (rounded by its codecs, recall_dtype).
        self.recalls = deque(sorted(recalls or [], key=lambda r: (r.logical_len, r.in_forward)))
        self.evicted: tuple[Tensor, Tensor, Tensor] | None = None
        self.codecs = CODECS[config.recall_dtype if config is not None else "auto"]

    # ------------------------------------------------------------------ model calls
    @property
    def cache_len(self) -> int:
        return int(self.positions.shape[-1])

    def steps_before_trigger(self) -> int:
        """Tokens that can be fed before the next trigger check fires (at least 1)."""
        return self.schedule.tokens_before_check(self.logical_len, self.cache_len)

    @contextlib.contextmanager
    def capturing(self) -> Iterator[None]:
        if not (self.needs_queries or self.needs_attn_accum or self.windowed):
            yield
            return
        with hf_attention.intercept(self.model, self._on_attention):
            yield

    def _on_attention(self, layer: int, query: Tensor, mask: Tensor | None, window: int | None) -> Tensor | None:
        """Record the layer's post-RoPE query; return the attention mask it runs with (a windowed layer's,
        from the position tags)."""
        q = query[0].detach()                      # [H_q, n, d] post-RoPE, as the kernel sees it
        if self.needs_attn_accum:
            self.step_queries[layer] = q
        if self.needs_queries:
            take, slots = self.ring_slots
            self.ring.write(layer, slots, q[:, q.shape[1] - take:].transpose(0, 1))
        return mask if window is None else self._window_mask(layer, query, window)

    def _window_mask(self, layer: int, query: Tensor, window: int) -> Tensor:
        """[1, H_q, n, N] additive mask of a sliding-window layer for the ``n`` tokens being fed: a key is seen
        iff its position is at most the query's and less than ``window`` before it. Logical positions, from the
        position tags, as the model defines its window; the engine's kernel windows over slots, which kvcompact's
        start-up rules make equal."""
        n = query.shape[-2]
        q, keys = self.window_positions(layer, n)
        distance = q.view(1, n, 1) - keys.unsqueeze(1)                                          # [H_kv, n, N]
        seen = (distance >= 0) & (distance < window)
        seen = seen.repeat_interleave(self.num_q_heads // self.num_kv_heads, dim=0)
        mask = torch.zeros(seen.shape, dtype=query.dtype, device=self.device)
        return mask.masked_fill_(~seen, torch.finfo(query.dtype).min).unsqueeze(0)

    def window_positions(self, layer: int, n: int) -> tuple[Tensor, Tensor]:
        """What a sliding-window layer compares: the logical positions of the ``n`` tokens being fed [n] and of
        every key it sees [H_kv, N] (the cached ones from the position tags)."""
        q = torch.arange(self.logical_len, self.logical_len + n, device=self.device)
        return q, torch.cat([self.positions[layer], q.expand(self.num_kv_heads, n)], dim=-1)

    def rope_positions(self, n: int) -> Tensor:
        """RoPE positions of the next ``n`` tokens: logical, whatever the cache holds (fed as ``position_ids``;
        transformers derives the cache offset from the stored length). Each key keeps its own RoPE phase, so
        different token sets per KV head are fine."""
        return torch.arange(self.logical_len, self.logical_len + n, device=self.device)

    def forward(self, ids: list[int], *, prefill: bool, logits_to_keep: int) -> Tensor:
        """Feed ``ids`` (the next tokens, logically consecutive) and return their last ``logits_to_keep``
        logits rows [n, V]."""
        n = len(ids)
        fed = torch.arange(self.logical_len, self.logical_len + n, device=self.device)
        rope_pos = self.rope_positions(n)
        if self.needs_queries:
            self.ring_slots = self.ring.advance(self.logical_len, n)
        out = self.model(input_ids=torch.tensor([ids], device=self.device), past_key_values=self.kv.cache,
                         use_cache=True, position_ids=rope_pos.view(1, n), logits_to_keep=logits_to_keep)
        self.kv.cache = out.past_key_values
        tags = fed.view(1, 1, n).expand(self.num_layers, self.num_kv_heads, n)
        self.positions = torch.cat([self.positions, tags], dim=-1)
        self.logical_len += n
        if self.needs_attn_accum:
            self.accum.grow(self.cache_len)
            if not prefill:
                if n != 1:
                    raise RuntimeError("attention accumulation needs one decode token per forward")
                self._accumulate()
        return out.logits[0]

    def _accumulate(self) -> None:
        from kvcompact.policies.h2o import accumulate_attention

        q = torch.stack(self.step_queries).unsqueeze(0).float()           # [1, L, H_q, 1, d]
        valid = (self.positions >= 0).unsqueeze(0)
        accumulate_attention(self.accum.values().unsqueeze(0), q, self.kv.gather_keys(), valid)  # adds in place

    # ------------------------------------------------------------------ rounds
    def maybe_round(self) -> None:
        for kept_len in self.schedule.due(self.logical_len, self.cache_len):
            self._round(kept_len)

    def maybe_recall(self, in_forward: bool) -> None:
        """The recalls due now: at this logical length, before its round (``in_forward`` False) or after it."""
        while (self.recalls and self.recalls[0].logical_len == self.logical_len
               and self.recalls[0].in_forward == in_forward):
            self._recall(self.recalls.popleft())

    def _recall(self, r: Recall) -> None:
        """Swap each recalled position back from the evicted tokens into its slot; the slot's token is evicted."""
        if self.evicted is None:
            raise ValueError(f"recall at logical length {r.logical_len} before any round evicted a token")
        keys, values, stored = self.evicted
        L, H, M = r.slots.shape
        match = stored.unsqueeze(2) == r.positions.to(self.device).unsqueeze(-1)       # [L, H, M, S]
        if not bool(match.any(-1)[r.swapped].all()):
            raise ValueError(f"recall at logical length {r.logical_len} of positions no round evicted")
        swapped = r.swapped.to(self.device)
        rows = torch.arange(L * H, device=self.device).view(L, H, 1).expand(L, H, M)[swapped]
        slot, entry = r.slots.to(self.device)[swapped], match.to(torch.int8).argmax(-1)[swapped]
        for which, store, codec in (("keys", keys, self.codecs[0]), ("values", values, self.codecs[1])):
            cache = self.kv.stacked(which)
            flat_cache, flat_store = cache.view(L * H, -1, cache.shape[-1]), store.view(L * H, -1, store.shape[-1])
            out = flat_cache[rows, slot].clone()
            flat_cache[rows, slot] = flat_store[rows, entry]
            flat_store[rows, entry] = codec.round_trip(out)
            for i, layer in enumerate(self.kv.cache.layers):
                setattr(layer, which, cache[i].unsqueeze(0))
        out_positions = self.positions.view(L * H, -1)[rows, slot].clone()
        self.positions.view(L * H, -1)[rows, slot] = stored.view(L * H, -1)[rows, entry]
        stored.view(L * H, -1)[rows, entry] = out_positions

    def _keep_evicted(self, keep_mask: Tensor) -> None:
        """Before a round's moves (only when recalls are replayed): its evicted slots' K, V and positions."""
        evicted = keep_mask.shape[-1] - int(keep_mask[0, 0].sum())
        slots = ascending_slots(~keep_mask)[..., :evicted]
        index = slots.unsqueeze(-1).expand(-1, -1, -1, self.kv.cache.layers[0].keys.shape[-1])
        key_codec, value_codec = self.codecs
        parts = (key_codec.round_trip(self.kv.stacked("keys").gather(2, index)),
                 value_codec.round_trip(self.kv.stacked("values").gather(2, index)), self.positions.gather(-1, slots))
        self.evicted = parts if self.evicted is None else tuple(  # type: ignore[assignment]
            torch.cat([a, b], dim=2) for a, b in zip(self.evicted, parts))

    def _round(self, kept_len: int) -> None:
        assert self.chooser is not None  # a schedule that has rounds comes with a chooser
        cache_len, logical_len = self.cache_len, self.logical_len
        keep_mask, plan = self.chooser.choose(self, kept_len)
        if self.recalls:
            self._keep_evicted(keep_mask.to(self.device))
        self.kv.execute(plan)
        self.positions = apply_plan(self.positions, plan)
        if self.needs_attn_accum:
            self.accum.move(plan)
        self.rounds.append(Round("", logical_len=logical_len, cache_len=cache_len, kept_len=plan.kept_len,
                                 prompt_len=self.prompt_len, keep_mask=keep_mask.cpu().clone()))


__all__ = ["generate", "teacher_forced_nll", "load_model"]
