"""fp8 KV cache: keys are dequantized before scoring, never scored as raw bytes (any CPU, no engine).

vLLM stores an fp8 cache as uint8. These tests build such a cache here and decode float8 with a bit-level decoder
of their own (support.fp8); the engine on a real fp8 cache is tests/engine/test_fp8.py.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvcompact.config import KVCompactConfig
from kvcompact.policies import make_policy
from kvcompact.policies.base import ScoreInput
from kvcompact.rope import RopeSpec
from kvcompact.selection import select_keep
from kvcompact.vllm.kv_layout import CpuAttnVecLayout, make_key_reader, phys_slots
from support import FIXED
from support.fp8 import decode_e4m3


def quantized_cache(keys: torch.Tensor, scale: float, layout: CpuAttnVecLayout, num_blocks: int) -> torch.Tensor:
    """A uint8 CPU_ATTN cache whose first ``keys.shape[1]`` slots hold ``keys / scale`` in float8 e4m3."""
    kv = torch.zeros(layout.shape(num_blocks), dtype=torch.uint8)
    n = keys.shape[1]
    phys = phys_slots(torch.arange(num_blocks), torch.arange(n), layout.block_size).expand(layout.num_kv_heads, -1)
    q = (keys / scale).to(torch.float8_e4m3fn).view(torch.uint8)
    layout.scatter(kv, phys, q, torch.zeros_like(q))
    return kv


def test_decoder_matches_torch_float8():
    """The test's own decoder agrees with torch's float8 on every byte (the bits the engine test decodes)."""
    every = np.arange(256, dtype=np.uint8)
    ours = decode_e4m3(every)
    theirs = torch.from_numpy(every).view(torch.float8_e4m3fn).double().numpy()
    assert np.array_equal(np.isnan(ours), np.isnan(theirs))
    assert np.array_equal(ours[~np.isnan(ours)], theirs[~np.isnan(theirs)])


@pytest.mark.parametrize("policy", ["knorm", "triattention"])
def test_keep_sets_from_an_fp8_cache_equal_those_on_dequantized_keys(policy, request):
    torch.manual_seed(0)
    H, d, bs, n, scale = 2, 64, 16, 90, 0.5
    layout = CpuAttnVecLayout(bs, H, d)
    keys = torch.randn(H, n, d) * torch.linspace(0.2, 3.0, n).view(1, n, 1)   # norms vary by token
    kv = quantized_cache(keys, scale, layout, num_blocks=8)
    phys = phys_slots(torch.arange(8), torch.arange(n), bs).expand(H, -1)
    raw = layout.gather_keys(kv, phys)
    assert raw.dtype == torch.uint8
    dequantized = torch.from_numpy(decode_e4m3(raw.numpy())).float() * scale      # independent of kvcompact

    cfg = KVCompactConfig(**FIXED, policy=policy, budget=40, window=8, selection="per_layer_per_head")
    if policy == "triattention":
        from test_policies import synthetic_stats

        stats, rope = synthetic_stats(1, H, H, RopeSpec.default(d, 10000.0))
        score = make_policy(cfg, stats=stats, rope=rope).score
    else:
        score = make_policy(cfg).score

    def keep(k: torch.Tensor) -> torch.Tensor:
        x = ScoreInput(keys=k.view(1, 1, H, n, d), positions=torch.arange(n).expand(1, 1, H, n),
                       logical_len=torch.tensor([n]), num_q_heads=H)
        return select_keep(score(x), x.positions, x.logical_len, torch.tensor([40]), torch.tensor([0]), window=8,
                           protect_prompt=False, mode="per_layer_per_head")

    reader = make_key_reader("fp8", torch.uint8, [scale])
    torch.testing.assert_close(reader(0, raw), dequantized)
    assert torch.equal(keep(reader(0, raw)), keep(dequantized))
    # Negative control: the raw bytes as numbers (what the worker scored before) keep other tokens.
    assert not torch.equal(keep(raw.float()), keep(dequantized))


def test_unknown_cache_formats_are_refused_by_name():
    make_key_reader("auto", torch.bfloat16, [1.0])          # a float cache is read as is
    make_key_reader("fp8_e5m2", torch.uint8, [1.0])
    for cache_dtype, storage in (("int8", torch.int8), ("fp8_inc", torch.uint8), ("auto", torch.uint8)):
        with pytest.raises(NotImplementedError, match=f"--kv-cache-dtype '{cache_dtype}'"):
            make_key_reader(cache_dtype, storage, [1.0])
