"""kvcompact plan: the capacity arithmetic, checked against figures derived here by plain arithmetic."""

from __future__ import annotations

import json

import pytest

from kvcompact.plan import ModelShape, PlanError, kv_bytes_per_token, main, make_plan, parse_size

# Qwen3-32B's published config.json (the fields plan reads) and its published parameter count.
QWEN3_32B = {"architectures": ["Qwen3ForCausalLM"], "head_dim": 128, "hidden_size": 5120,
             "intermediate_size": 25600, "max_position_embeddings": 40960, "num_attention_heads": 64,
             "num_hidden_layers": 64, "num_key_value_heads": 8, "tie_word_embeddings": False,
             "vocab_size": 151936}
QWEN3_32B_PARAMS = 32.8e9
GiB = 2**30
LOW_TO_MID_20K = range(20_000, 26_001)  # "full attention runs out in the low-to-mid 20k tokens"


def qwen_plan(**kw):
    kw.setdefault("params", int(QWEN3_32B_PARAMS))
    kw.setdefault("weight_bits", 4)
    return make_plan(ModelShape.from_config(QWEN3_32B), 24 * GiB, **kw)


def test_kv_bytes_per_token_counts_k_and_v():
    bpt = kv_bytes_per_token(ModelShape.from_config(QWEN3_32B), "bf16")
    assert bpt == 2 * 64 * 8 * 128 * 2 == 262_144
    assert bpt != 64 * 8 * 128 * 2  # negative control: forgetting V halves it
    assert kv_bytes_per_token(ModelShape.from_config(QWEN3_32B), "fp8") == bpt // 2


def test_parameter_estimate_matches_published_count():
    estimate = ModelShape.from_config(QWEN3_32B).estimate_params()
    assert abs(estimate - QWEN3_32B_PARAMS) / QWEN3_32B_PARAMS < 0.01
    # negative control: dropping the untied LM head (vocab * hidden = 0.78B) is outside the tolerance
    tied = ModelShape.from_config({**QWEN3_32B, "tie_word_embeddings": True}).estimate_params()
    assert abs(tied - QWEN3_32B_PARAMS) / QWEN3_32B_PARAMS > 0.01


def test_qwen3_32b_on_24gib_with_4bit_weights_runs_out_in_the_low_to_mid_20k():
    plan = qwen_plan()
    pool = int(24 * GiB * 0.9) - int(QWEN3_32B_PARAMS * 4 / 8) - 1 * GiB  # utilization 0.9, overhead 1 GiB
    expected = pool // (2 * 64 * 8 * 128 * 2)
    assert plan.pool_bytes == pool
    assert plan.pool_tokens == expected == plan.longest_full
    assert expected in LOW_TO_MID_20K
    # negative control: the same arithmetic without the factor 2 for K and V is detected by the range
    assert pool // (64 * 8 * 128 * 2) not in LOW_TO_MID_20K
    # the estimated parameter count gives the same answer to within a few hundred tokens
    assert abs(qwen_plan(params=None).pool_tokens - expected) < 500


def test_fp8_kv_doubles_the_trace_and_16bit_weights_do_not_fit():
    assert qwen_plan(kv_dtype="fp8").pool_tokens == qwen_plan().pool_bytes // (2 * 64 * 8 * 128 * 1)
    unfit = qwen_plan(weight_bits=16)  # 65.6 GB of weights on a 24 GiB card
    assert unfit.pool_bytes == 0 and unfit.longest_full == 0


def test_compression_makes_the_trace_bounded_by_context_not_kv():
    plan = qwen_plan(budget=3072)
    assert plan.compressed_tokens == 3072 + 128
    assert plan.longest_full < 40960
    assert plan.longest_compressed == 40960  # the model's max context
    # many concurrent requests: each gets less than budget + divide_length, so the pool bounds them again
    crowded = qwen_plan(budget=3072, concurrency=8)
    assert crowded.longest_full == crowded.pool_tokens // 8
    assert crowded.longest_compressed == crowded.pool_tokens // 8 < 3200


def test_concurrency_at_a_given_length():
    plan = qwen_plan(budget=3072, length=32768)
    assert plan.fits_full == plan.pool_tokens // 32768 == 0
    assert plan.fits_compressed == plan.pool_tokens // 3200 == 6
    short = qwen_plan(budget=3072, length=1000)  # shorter than the budget: compression changes nothing
    assert short.fits_compressed == short.fits_full == short.pool_tokens // 1000


def test_head_dim_and_kv_heads_fall_back_like_hf():
    llama2_7b = {"hidden_size": 4096, "num_attention_heads": 32, "num_hidden_layers": 32,
                 "intermediate_size": 11008, "vocab_size": 32000, "max_position_embeddings": 4096}
    shape = ModelShape.from_config(llama2_7b)
    assert (shape.head_dim, shape.kv_heads) == (128, 32)
    assert kv_bytes_per_token(shape) == 2 * 32 * 32 * 128 * 2 == 512 * 1024  # the known 0.5 MiB per token
    assert abs(shape.estimate_params() - 6.74e9) / 6.74e9 < 0.01


@pytest.mark.parametrize("text,expected", [("24GiB", 24 * GiB), ("24GB", 24 * 10**9), ("512 MiB", 512 * 2**20),
                                           ("1.5e9", 1_500_000_000), ("0.5gib", GiB // 2)])
def test_parse_size(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["24XB", "GiB", "", "-1GiB", "24 GiB extra"])
def test_parse_size_rejects(text):
    with pytest.raises(PlanError):
        parse_size(text)


def test_cli_prints_the_plan(tmp_path, capsys):
    config = tmp_path / "config.json"
    config.write_text(json.dumps(QWEN3_32B))
    args = ["--config", str(config), "--memory", "24GiB", "--weight-bits", "4", "--params", "32.8e9"]
    assert main(args + ["--budget", "3072"]) == 0
    out = capsys.readouterr().out
    assert "262,144 bytes per token" in out and f"{qwen_plan().pool_tokens:,} tokens" in out
    assert "bounded by the model context" in out
    assert main(args + ["--json"]) == 0
    assert json.loads(capsys.readouterr().out)["pool_tokens"] == qwen_plan().pool_tokens


@pytest.mark.parametrize("config,args,message", [
    ({k: v for k, v in QWEN3_32B.items() if k != "num_hidden_layers"}, [], "num_hidden_layers"),
    (QWEN3_32B, ["--memory", "lots"], "cannot read size"),
    (QWEN3_32B, ["--concurrency", "0"], "must be positive"),
    ([1, 2], [], "not a JSON object"),
])
def test_cli_errors_are_one_line(tmp_path, capsys, config, args, message):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    assert main(["--config", str(path), "--memory", "24GiB", *args]) == 1
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err and err.count("\n") == 1
