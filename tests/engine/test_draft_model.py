"""Draft-model speculative decoding with compaction, on the real engine (fp32, the bundled model drafting for
itself, k = 3, prefix caching on as vLLM's default).

The draft model's layers sit in the target's KV-cache group: they share its block tables and each has a tensor
of its own. A round moves them with the target's plan (never scores them), copy on write copies them too, and
the drafter's slot mappings, which vLLM computes from logical positions, are readdressed by each request's
eviction offset. What that gives, checked here:

- the target's greedy tokens, round lengths and keep sets equal those of the same compression without
  speculation (the draft layers are not scored);
- after every step, every running request's draft cache holds at its live slots exactly what the target's holds
  (same weights, same tokens at the same positions give the same K and V), and the draft's every proposal is
  accepted, as with no compression;
- negative controls: a draft left unmoved by the rounds, one not copied on write, and a drafter whose slots
  ignore the eviction offset each break that equality and lose accepted drafts, while the target's tokens stay
  exact (a target never reads the draft's KV);
- a preempted request resumes exactly (its continuation equals the transformers reference) with its draft
  cache rebuilt by the re-prefill.

One case in CI; every policy x compaction, the negative controls and preemption with ``KVC_TEST_SPEC=full``.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch

from kvcompact.vllm.kv_layout import phys_slots
from support import FIXED
from support.engine import (
    PROMPT,
    check_blocks,
    engine,
    generate_stepwise,
    greedy,
    model_dir,
    preemptions,
    round_events,
    scheduler,
    tokenize,
    worker_rounds,
    worker_side,
)

pytestmark = pytest.mark.engine

# A round whenever the cache reaches 48 + 24 = 72 tokens: the 48-token prompt and 96 new tokens give 3 rounds.
SMALL = {**FIXED, "budget": 48, "divide_length": 24, "window": 16, "n_sink": 4, "selection": "per_head"}
TRIGGER = 72
NEW_TOKENS = 96
K = 3
FULL = os.environ.get("KVC_TEST_SPEC") == "full"
OPT_IN = pytest.mark.skipif(not FULL, reason="opt-in: KVC_TEST_SPEC=full")
POLICIES = ("knorm", "streaming", "triattention", "snapkv", "h2o")
CI_CASE = ("knorm", "repack")
CASES = [pytest.param(p, c, marks=() if (p, c) == CI_CASE else OPT_IN)
         for p in POLICIES for c in ("repack", "holefill")]


def config(policy: str, compaction: str) -> dict[str, Any]:
    cfg = dict(SMALL, policy=policy, compaction=compaction)
    if policy == "triattention":
        from kvcompact.tools.serve import ensure_default_stats

        cfg["stats_path"] = ensure_default_stats()
    return cfg


def speculation(num_blocks: int = 64) -> dict[str, Any]:
    """Engine arguments for the bundled model drafting for itself. The pool's bytes count the draft's layers,
    which hold their KV in the same blocks."""
    from kvcompact.kv_bytes import kv_bytes_per_token

    return {"speculative_config": {"method": "draft_model", "model": model_dir(), "num_speculative_tokens": K},
            "kv_cache_memory_bytes": 2 * (num_blocks + 8) * 32 * kv_bytes_per_token(model_dir(), "float32")}


def draft_mismatch(llm: Any) -> float:
    """The largest |draft - target| over K and V, every layer and KV head, at every running request's live
    cache slots. The draft is the target model: a draft cache that holds what the target's holds reads 0."""
    s, kv = scheduler(llm), worker_side(llm).kv
    worst = 0.0
    for request in s.running:
        cache_len = request.num_computed_tokens - s.kvcompact.requests[request.request_id].ledger.evicted
        if cache_len == 0:
            continue
        slots = phys_slots(kv.block_table(request.request_id), torch.arange(cache_len), kv.layout.block_size)
        phys = slots.expand(kv.layout.num_kv_heads, -1)
        for target, draft in zip(kv.caches, kv.draft.caches, strict=True):
            for a, b in zip(kv.layout.gather(target, phys), kv.draft.layout.gather(draft, phys), strict=True):
                worst = max(worst, (a - b).abs().max().item())
    return worst


def leave_draft_unmoved(side: Any) -> None:
    """Negative control: rounds move the target's layers only (the draft keeps its tokens in place)."""
    kv = side.kv
    execute = kv.execute

    def target_only(block_tables: list[Any], plans: list[Any]) -> None:
        draft, kv.draft = kv.draft, None
        try:
            execute(block_tables, plans)
        finally:
            kv.draft = draft

    kv.execute = target_only


def leave_draft_uncopied(side: Any) -> None:
    """Negative control: copy on write copies the target's half of a shared block only."""
    kv = side.kv
    copy_on_write = kv.copy_on_write

    def target_only(copies: list[Any]) -> None:
        draft, kv.draft = kv.draft, None
        try:
            copy_on_write(copies)
        finally:
            kv.draft = draft

    kv.copy_on_write = target_only


def logical_draft_slots(side: Any) -> None:
    """Negative control: the drafter keeps vLLM's slots, computed from logical positions."""
    side.address_draft = lambda attn_metadata, positions: None


SABOTAGE = {"unmoved": leave_draft_unmoved, "uncopied": leave_draft_uncopied, "logical_slots": logical_draft_slots}


def run(cfg: dict[str, Any], prompt_ids: list[int], speculative: bool, sabotage: str | None = None
        ) -> dict[str, Any]:
    """Generate greedily, stepping the engine by hand: the blocks are checked after every step, and with
    speculation the draft's cache against the target's."""
    kwargs: dict[str, Any] = {"disable_log_stats": False, "enable_prefix_caching": True}
    if speculative:
        kwargs.update(speculation())
    mismatch = [0.0]

    def check(llm: Any) -> None:
        # vLLM keeps the blocks of rejected drafts and reserves k lookahead slots for the drafter.
        check_blocks(llm, drafts=2 * K if speculative else 0)
        if speculative:
            mismatch[0] = max(mismatch[0], draft_mismatch(llm))

    with engine(cfg, **kwargs) as llm:
        if sabotage is not None:
            SABOTAGE[sabotage](worker_side(llm))
        tokens = generate_stepwise(llm, prompt_ids, NEW_TOKENS, check=check)
        metrics = {m.name: m.value for m in llm.get_metrics() if hasattr(m, "value")}
        return {"tokens": tokens, "keeps": [r.keep_mask for r in worker_rounds(llm)], "mismatch": mismatch[0],
                "rounds": [(e.logical_len, e.cache_len, e.kept_len, e.blocks_freed) for e in round_events(llm)],
                "drafted": metrics.get("vllm:spec_decode_num_draft_tokens", 0),
                "accepted": metrics.get("vllm:spec_decode_num_accepted_tokens", 0),
                "copied": scheduler(llm).kvcompact.metrics.totals.blocks_copied,
                "moved": (scheduler(llm).kvcompact.metrics.totals.tokens_moved,
                          scheduler(llm).kvcompact.metrics.totals.bytes_moved)}


@pytest.fixture(scope="module")
def plain_knorm(prompt_ids: list[int]) -> dict[str, Any]:
    return run(config("knorm", "repack"), prompt_ids, speculative=False)


@pytest.mark.parametrize("policy, compaction", CASES)
def test_draft_model_speculation_equals_plain_decoding(policy, compaction, prompt_ids):
    cfg = config(policy, compaction)
    plain = run(cfg, prompt_ids, speculative=False)
    spec = run(cfg, prompt_ids, speculative=True)
    assert len(plain["rounds"]) >= 3 and all(old == TRIGGER for _, old, _, _ in plain["rounds"])
    assert spec["rounds"] == plain["rounds"]
    assert len(spec["keeps"]) == len(plain["keeps"])
    for a, b in zip(spec["keeps"], plain["keeps"], strict=True):
        assert torch.equal(a, b)  # the draft's layers are never scored
    assert spec["tokens"] == plain["tokens"]
    # The same moves in the draft's layers (the same model: as many tokens and bytes again) count as moved
    assert plain["moved"][0] > 0 and spec["moved"] == (2 * plain["moved"][0], 2 * plain["moved"][1])
    # The draft's cache holds what the target's holds after every step (copies on write included: the prompt's
    # and the generated full blocks are in the prefix cache, so rounds copy them), and every draft is accepted.
    assert spec["copied"] > 0
    assert spec["mismatch"] < 1e-4, spec["mismatch"]
    assert spec["drafted"] > 0 and spec["accepted"] == spec["drafted"]


@OPT_IN
@pytest.mark.parametrize("sabotage", list(SABOTAGE))
def test_negative_control_draft_cache_not_following_the_target(sabotage, prompt_ids, plain_knorm):
    """Each part of the draft's handling, removed (its moves, its copies on write, its readdressed slots): the
    draft attends to other tokens than the target's cache holds, so its cache differs from the target's and
    drafts are rejected; the target's tokens stay exact."""
    spec = run(config("knorm", "repack"), prompt_ids, speculative=True, sabotage=sabotage)
    print(f"\n{sabotage}: max |draft - target| {spec['mismatch']:.3g}, accepted {spec['accepted']:.0f} of "
          f"{spec['drafted']:.0f} drafts")
    assert spec["mismatch"] > 1e-2
    assert spec["accepted"] < spec["drafted"]
    assert spec["tokens"] == plain_knorm["tokens"]


PREEMPT = {**FIXED, "policy": "streaming", "budget": 48, "divide_length": 24, "window": 16, "n_sink": 4,
           "admission": "greedy"}
C_TOKENS = 170


@OPT_IN
def test_preempted_request_resumes_exactly_with_its_draft_rebuilt(reference_model):
    """An uncompressed 200-token request grows until vLLM preempts the compressed one (the pool of 12 usable
    blocks runs out), which re-prefills its prompt and outputs, compressed as it goes. With the draft model:
    blocks and draft cache checked after every step, every draft accepted, and each stretch of the compressed
    request's tokens between preemptions equals the transformers reference continuing the same tokens
    (streaming: scored independently, as tests/engine/test_prefill.py checks without speculation)."""
    from kvcompact import reference
    from kvcompact.config import KVCompactConfig

    prompt = tokenize(PROMPT)
    with engine(PREEMPT, num_blocks=13, max_model_len=384, max_num_seqs=2, disable_log_stats=False,
                enable_prefix_caching=True, **speculation(13)) as llm:
        eng = llm.llm_engine
        mismatch = [0.0]

        def check(llm: Any) -> None:
            check_blocks(llm, drafts=2 * K)
            mismatch[0] = max(mismatch[0], draft_mismatch(llm))

        big = (prompt * 5)[:200]
        eng.add_request("big", {"prompt_token_ids": big}, greedy(110, extra_args={"kvcompact": "off"}))
        eng.add_request("c", {"prompt_token_ids": prompt}, greedy(C_TOKENS))
        outs: dict[str, list[int]] = {}
        with preemptions(llm) as seen:
            while eng.has_unfinished_requests():
                for out in eng.step():
                    outs[out.request_id] = list(out.outputs[0].token_ids)
                check(llm)
        preempted = [p.output_tokens for p in seen if p.request_id == "c"]
        metrics = {m.name: m.value for m in llm.get_metrics() if hasattr(m, "value")}
    tokens = outs["c"]
    assert len(tokens) == C_TOKENS and len(outs["big"]) == 110
    assert len(preempted) >= 1 and preempted[0] > 3 * PREEMPT["divide_length"], preempted
    assert mismatch[0] < 1e-4, mismatch[0]
    assert metrics["vllm:spec_decode_num_accepted_tokens"] == metrics["vllm:spec_decode_num_draft_tokens"] > 0
    config = KVCompactConfig(**PREEMPT)
    cuts = [0, *preempted, len(tokens)]
    for a, b in zip(cuts, cuts[1:]):
        ref, _ = reference.generate(reference_model, prompt + tokens[:a], b - a, config)
        assert tokens[a:b] == ref, (a, b)



QWEN = ("Qwen2.5-Coder-1.5B-Instruct", "Qwen2.5-Coder-0.5B-Instruct")  # 28 layers x 2 KV heads x 128; 24 x 2 x 64
# A round whenever the cache reaches 128 + 32 tokens: the ~110-token prompt and 192 new tokens give 4 or more.
SHAPED = {**FIXED, "policy": "triattention", "budget": 128, "divide_length": 32, "window": 16, "n_sink": 4,
          "selection": "per_head", "compaction": "repack"}


def _prepared(name: str) -> bool:
    from kvcompact.tools.model import is_built
    from kvcompact.tools.model import model_dir as folder

    return is_built(folder(name))


@OPT_IN
@pytest.mark.skipif(not all(map(_prepared, QWEN)), reason="needs `kvcompact prepare --model "
                    "qwen2.5-coder-1.5b-instruct` and `--model qwen2.5-coder-0.5b-instruct`")
def test_a_smaller_draft_of_another_shape_follows_the_target():
    """Qwen2.5-Coder-0.5B drafting for the 1.5B (another depth and head_dim, the same 2 KV heads): with selection
    per_head every draft layer's head h keeps the tokens the target's head h keeps. The draft is another model, so
    its cache cannot be compared with the target's; what shows that its rounds follow the target's is the
    acceptance rate: about what uncompressed speculation gets, and lower when the draft is left unmoved (the
    negative control). The target's greedy tokens and rounds equal the compressed run without speculation."""
    from transformers import AutoTokenizer

    from kvcompact.kv_bytes import kv_bytes_per_token
    from kvcompact.tools import evaluation as ev
    from kvcompact.tools.model import model_dir as folder
    from kvcompact.tools.model import stats_path_for

    target, draft = (str(folder(name)) for name in QWEN)
    item = ev.reasoning_task(1, ev.EXPLORE_SEED).items[0]
    prompt = ev.prompt_ids(AutoTokenizer.from_pretrained(target), item)
    cfg = dict(SHAPED, stats_path=str(stats_path_for(QWEN[0])))
    blocks = 64
    pool = (blocks + 8) * 32 * (kv_bytes_per_token(target, "float32") + kv_bytes_per_token(draft, "float32"))
    spec = {"speculative_config": {"method": "draft_model", "model": draft, "num_speculative_tokens": K}}

    def one(kvcompact: dict[str, Any] | None, speculative: bool, sabotage: str | None = None) -> dict[str, Any]:
        kwargs = {"model": target, "num_blocks": blocks, "max_model_len": 512, "kv_cache_memory_bytes": pool,
                  "disable_log_stats": False, "enable_prefix_caching": True, **(spec if speculative else {})}
        with engine(kvcompact, **kwargs) as llm:
            if sabotage is not None:
                SABOTAGE[sabotage](worker_side(llm))
            tokens = generate_stepwise(llm, prompt, 192)
            metrics = {m.name: m.value for m in llm.get_metrics() if hasattr(m, "value")}
            rounds = [(e.logical_len, e.cache_len, e.kept_len) for e in round_events(llm)] if kvcompact else []
        drafted = metrics.get("vllm:spec_decode_num_draft_tokens", 0)
        rate = metrics.get("vllm:spec_decode_num_accepted_tokens", 0) / drafted if drafted else None
        return {"tokens": tokens, "rounds": rounds, "rate": rate}

    plain, compressed, full = one(cfg, False), one(cfg, True), one(None, True)
    unmoved = one(cfg, True, sabotage="unmoved")
    print(f"\nacceptance: uncompressed {full['rate']:.3f}, compressed {compressed['rate']:.3f}, "
          f"draft unmoved {unmoved['rate']:.3f}; {len(plain['rounds'])} rounds")
    assert len(plain["rounds"]) >= 3
    assert compressed["rounds"] == plain["rounds"] and compressed["tokens"] == plain["tokens"]
    assert unmoved["tokens"] == plain["tokens"]
    assert compressed["rate"] >= full["rate"] - 0.05  # within a few points of uncompressed speculation
    assert unmoved["rate"] < compressed["rate"] - 0.05  # the control: a draft attending to stale slots misses
