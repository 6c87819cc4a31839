"""kvcompact capacity: the capacity arithmetic, checked against figures derived here by plain arithmetic, and every
input refused with a one-line message that names it."""

from __future__ import annotations

import json
import math
import typing

import pytest

from kvcompact.kv_bytes import VLLM_KV_CACHE_DTYPES, KVShape
from kvcompact.tools.capacity import PlanError, load_shape, main, make_plan, parse_size

# Qwen3-32B's published config.json (the fields plan reads) and its published parameter count.
QWEN3_32B = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "head_dim": 128, "hidden_size": 5120,
             "intermediate_size": 25600, "max_position_embeddings": 40960, "num_attention_heads": 64,
             "num_hidden_layers": 64, "num_key_value_heads": 8, "tie_word_embeddings": False,
             "vocab_size": 151936, "torch_dtype": "bfloat16"}
QWEN3_32B_PARAMS = 32.8e9
QWEN3_BPT = 2 * 64 * 8 * 128 * 2  # K and V, 64 layers, 8 KV heads, head_dim 128, 2 bytes
GiB = 2**30
LOW_TO_MID_20K = range(20_000, 26_001)  # "full attention runs out in the low-to-mid 20k tokens"


def model_dir(tmp_path, config, name="model"):
    path = tmp_path / name
    path.mkdir()
    (path / "config.json").write_text(json.dumps(config))
    return str(path)


@pytest.fixture
def qwen(tmp_path):
    return model_dir(tmp_path, QWEN3_32B)


@pytest.fixture
def shape(qwen):
    return load_shape(qwen)


def qwen_plan(shape, **kw):
    kw.setdefault("params", int(QWEN3_32B_PARAMS))
    kw.setdefault("weight_bits", 4)
    return make_plan(shape, 24 * GiB, **kw)


def test_kv_bytes_per_token_counts_k_and_v(shape):
    assert shape.kv == KVShape(layers=64, kv_heads=8, head_dim=128)
    bpt = shape.kv.bytes_per_token("bfloat16")
    assert bpt == QWEN3_BPT == 262_144
    assert bpt != 64 * 8 * 128 * 2  # negative control: forgetting V halves it
    assert shape.kv.bytes_per_token("bfloat16", "fp8") == shape.kv.bytes_per_token("bfloat16", "fp8_e4m3") == bpt // 2
    assert shape.kv.bytes_per_token("float32") == 2 * bpt


def test_the_kv_cache_dtypes_are_vllms():
    from vllm.config.cache import CacheDType

    assert set(VLLM_KV_CACHE_DTYPES) == set(typing.get_args(CacheDType))
    assert "fp8_e4m3" in VLLM_KV_CACHE_DTYPES and "fp8-e4m3" not in VLLM_KV_CACHE_DTYPES  # control: vLLM's spelling


def test_parameter_estimate_matches_published_count(tmp_path, shape):
    estimate = shape.estimate_params()
    assert abs(estimate - QWEN3_32B_PARAMS) / QWEN3_32B_PARAMS < 0.01
    # negative control: dropping the untied LM head (vocab * hidden = 0.78B) is outside the tolerance
    tied = load_shape(model_dir(tmp_path, {**QWEN3_32B, "tie_word_embeddings": True}, "tied")).estimate_params()
    assert abs(tied - QWEN3_32B_PARAMS) / QWEN3_32B_PARAMS > 0.01


def test_qwen3_32b_on_24gib_with_4bit_weights_runs_out_in_the_low_to_mid_20k(shape):
    plan = qwen_plan(shape)
    pool = int(24 * GiB * 0.9) - int(QWEN3_32B_PARAMS * 4 / 8) - 1 * GiB  # utilization 0.9, overhead 1 GiB
    blocks = pool // (16 * QWEN3_BPT) - 1  # vLLM's default block size 16; one block is vLLM's null block
    assert plan.pool_bytes == pool and plan.pool_blocks == blocks
    assert plan.pool_tokens == blocks * 16 == plan.longest_full
    assert plan.pool_tokens in LOW_TO_MID_20K
    # negative control: the same arithmetic without the factor 2 for K and V is detected by the range
    assert pool // (QWEN3_BPT // 2) not in LOW_TO_MID_20K
    # the estimated parameter count gives the same answer to within a few hundred tokens
    assert abs(qwen_plan(shape, params=None).pool_tokens - plan.pool_tokens) < 500


def test_fp8_kv_doubles_the_trace_and_16bit_weights_do_not_fit(shape):
    fp8 = qwen_plan(shape, kv_cache_dtype="fp8_e4m3")
    assert fp8.pool_blocks == qwen_plan(shape).pool_bytes // (16 * QWEN3_BPT // 2) - 1
    with pytest.raises(PlanError, match="no KV pool"):  # 65.6 GB of weights on a 24 GiB card
        qwen_plan(shape, weight_bits=16)
    assert qwen_plan(shape, weight_bits=4).pool_blocks > 0  # control: the same card with 4-bit weights


def test_compression_makes_the_trace_bounded_by_context_not_kv(shape):
    plan = qwen_plan(shape, budget=3072, divide_length=128)
    assert plan.compressed_blocks == math.ceil((3072 + 128) / 16) == 200
    assert plan.longest_full < 40960
    assert plan.longest_compressed == 40960  # the model's max context
    assert plan.compressed_at_once == 1  # make_plan's default max_num_seqs: one request
    assert qwen_plan(shape, budget=3072, divide_length=128, max_num_seqs=10**6).compressed_at_once \
        == plan.compressed_pool_fits == plan.pool_blocks // 200
    assert qwen_plan(shape, budget=3072, divide_length=128, max_model_len=16384).longest_compressed == 16384
    # many concurrent requests: each gets less than budget + divide_length, so the pool bounds them again
    crowded = qwen_plan(shape, budget=3072, divide_length=128, max_num_seqs=8)
    assert crowded.longest_full == crowded.pool_blocks // 8 * 16
    assert crowded.longest_compressed == crowded.pool_blocks // 8 * 16 < 3200


def test_block_size_rounds_what_a_compressed_request_holds(shape):
    plan = qwen_plan(shape, budget=1000, divide_length=100, block_size=64)
    assert plan.compressed_blocks == 18 and plan.compressed_tokens == 18 * 64  # ceil(1100 / 64)
    assert plan.compressed_tokens != 1100  # control: whole blocks, not tokens


def test_concurrency_at_a_given_length(shape):
    plan = qwen_plan(shape, budget=3072, length=32768, max_num_seqs=256)
    assert plan.fits_full == plan.pool_blocks // (32768 // 16) == 0
    assert plan.fits_compressed == plan.pool_blocks // 200 == 6
    short = qwen_plan(shape, budget=3072, length=1000, max_num_seqs=256)  # shorter than the budget: the same
    assert short.fits_compressed == short.fits_full == short.pool_blocks // math.ceil(1000 / 16) == 21
    # vLLM runs at most --max-num-seqs requests whatever the pool holds
    assert qwen_plan(shape, budget=3072, length=1000, max_num_seqs=8).fits_full == 8


def test_a_budget_that_grows_with_the_answer_is_sized_at_the_length_in_question(shape):
    """--budget-ratio r: a request of L tokens keeps up to r * L of them once that exceeds the budget, so what one
    holds is sized at the context limit (and at --length for how many fit). Expectations worked out by hand."""
    plan = qwen_plan(shape, budget=3072, divide_length=128, budget_ratio=0.25)
    assert plan.compressed_blocks == (40960 // 4 + 128) // 16 == 648  # 0.25 x the context, + divide_length
    assert qwen_plan(shape, budget=3072, divide_length=128).compressed_blocks == 200  # control: a fixed budget
    assert plan.longest_compressed == 40960 and plan.compressed_pool_fits == plan.pool_blocks // 648
    # four share the pool: each share (pool_blocks // 4 blocks of 16) holds a trace whose quarter + 128 fills it
    crowded = qwen_plan(shape, budget=3072, divide_length=128, budget_ratio=0.25, max_num_seqs=4)
    share = crowded.pool_blocks // 4 * 16
    assert 3200 <= share < 648 * 16 and crowded.longest_compressed == (share - 128) * 4
    long = qwen_plan(shape, budget=3072, divide_length=128, budget_ratio=0.25, length=32768, max_num_seqs=256)
    assert long.fits_compressed == long.pool_blocks // ((32768 // 4 + 128) // 16)  # 520 blocks each
    short = qwen_plan(shape, budget=3072, divide_length=128, budget_ratio=0.25, length=8000, max_num_seqs=256)
    assert short.fits_compressed == short.pool_blocks // 200  # a quarter of 8,000 is below the budget: 200 blocks


def test_head_dim_and_kv_heads_fall_back_like_hf(tmp_path):
    llama2_7b = {"model_type": "llama", "hidden_size": 4096, "num_attention_heads": 32, "num_hidden_layers": 32,
                 "intermediate_size": 11008, "vocab_size": 32000, "max_position_embeddings": 4096}
    shape = load_shape(model_dir(tmp_path, llama2_7b))
    assert shape.kv == KVShape(layers=32, kv_heads=32, head_dim=128)
    assert shape.kv.bytes_per_token("float16") == 512 * 1024  # the known 0.5 MiB per token
    assert abs(shape.estimate_params() - 6.74e9) / 6.74e9 < 0.01
    # an fp32 checkpoint (or one recording no dtype) is served in bf16 by --dtype auto, as vLLM does on a GPU
    assert shape.dtype == "bfloat16"
    assert make_plan(shape, 40 * GiB, dtype="float32").kv_bytes_per_token == 2 * 512 * 1024


@pytest.mark.parametrize("text,expected", [("24GiB", 24 * GiB), ("24GB", 24 * 10**9), ("512 MiB", 512 * 2**20),
                                           ("1.5e9B", 1_500_000_000), ("0.5gib", GiB // 2), ("0", 0),
                                           ("80G", 80 * GiB), ("80g", 80 * 10**9), ("512M", 512 * 2**20)])
def test_parse_size(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["24XB", "GiB", "", "-1GiB", "24 GiB extra", "80", "1.5e9"])
def test_parse_size_rejects(text):
    with pytest.raises(PlanError):
        parse_size(text)


@pytest.mark.parametrize("text", ["32k", "32K", "32768", "25.6k", "1m", "2M", "7"])
def test_max_model_len_reads_like_vllms(text):
    """The same count vLLM's own --max-model-len parser reads (vllm.utils.argparse_utils.human_readable_int)."""
    from vllm.utils.argparse_utils import human_readable_int

    from kvcompact.tools.capacity import parse_tokens

    assert parse_tokens(text) == human_readable_int(text)
    assert parse_tokens("32k") != parse_tokens("32K")  # control: decimal and binary suffixes differ, as in vLLM


def test_cli_reads_vllms_spellings(qwen, capsys):
    """Underscores, -tp, 32k and a size with vLLM's G: the same plan as the canonical spelling."""
    canonical = ["--model", qwen, "--memory", "80GiB", "--max-model-len", "32000", "--tensor-parallel-size", "2",
                 "--budget", "2048", "--json"]
    assert main(canonical) == 0
    want = json.loads(capsys.readouterr().out)
    assert main(["--model", qwen, "--memory", "80G", "--max_model_len", "32k", "-tp", "2", "--budget", "2048",
                 "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == want
    assert want["max_model_len"] == 32000 and want["tensor_parallel_size"] == 2
    assert want["max_num_seqs"] == 1024  # vLLM's default from 70 GiB of device memory
    assert main(canonical[:3] + ["24GiB", *canonical[4:], "--weight-bits", "4"]) == 0
    assert json.loads(capsys.readouterr().out)["max_num_seqs"] == 256  # vLLM's default below 70 GiB


def test_tensor_parallel_splits_kv_heads_and_weights(shape):
    one = qwen_plan(shape, weight_bits=4)
    two = qwen_plan(shape, weight_bits=4, tensor_parallel_size=2)
    # each device holds half the weights and 4 of the 8 KV heads: its pool is bigger, a token costs it half
    pool = int(24 * GiB * 0.9) - int(QWEN3_32B_PARAMS * 4 / 8) // 2 - GiB
    assert two.pool_bytes == pool and two.pool_blocks == pool // (16 * QWEN3_BPT // 2) - 1
    assert two.pool_tokens > 2 * one.pool_tokens
    assert two.kv_bytes_per_token == one.kv_bytes_per_token == QWEN3_BPT  # the whole model's figure
    # 16 ranks over 8 KV heads: each rank keeps a replica of one head, so a token costs 1/8, not 1/16
    sixteen = qwen_plan(shape, weight_bits=4, tensor_parallel_size=16)
    pool16 = int(24 * GiB * 0.9) - int(QWEN3_32B_PARAMS * 4 / 8) // 16 - GiB
    assert sixteen.pool_blocks == pool16 // (16 * QWEN3_BPT // 8) - 1
    with pytest.raises(PlanError, match="not divisible"):  # 64 attention heads over 3 ranks
        qwen_plan(shape, tensor_parallel_size=3)


def test_compressed_requests_at_once_are_capped_by_max_num_seqs(qwen, capsys):
    assert main(["--model", qwen, "--memory", "80GiB", "--weight-bits", "4", "--budget", "512",
                 "--max-num-seqs", "256"]) == 0
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if x.startswith("compressed requests that run at once"))
    assert "at once, whatever their length: 256 (--max-num-seqs caps it; the pool holds" in line
    # control: a cap above what the pool holds leaves the pool's count
    assert main(["--model", qwen, "--memory", "80GiB", "--weight-bits", "4", "--budget", "512",
                 "--max-num-seqs", "100000"]) == 0
    assert "none is ever preempted" in capsys.readouterr().out


def test_cli_prints_the_plan(qwen, shape, capsys):
    args = ["--model", qwen, "--memory", "24GiB", "--weight-bits", "4", "--params", "32.8e9"]
    assert main(args + ["--budget", "3072", "--max-num-seqs", "1"]) == 0
    out = capsys.readouterr().out
    assert "262,144 bytes per token" in out and f"{qwen_plan(shape).pool_tokens:,} tokens" in out
    assert "bounded by the context" in out and "unlimited" not in out
    assert main(args + ["--json", "--kv-cache-dtype", "fp8_e4m3", "--max-num-seqs", "2"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["pool_tokens"] == qwen_plan(shape, kv_cache_dtype="fp8").pool_tokens
    assert report["longest_full"] == report["pool_blocks"] // 2 * 16


def test_cli_budget_ratio(qwen, capsys):
    args = ["--model", qwen, "--memory", "24GiB", "--weight-bits", "4", "--params", "32.8e9", "--budget", "3072",
            "--divide-length", "128", "--max-num-seqs", "100000"]
    assert main([*args, "--budget-ratio", "0.25"]) == 0
    out = capsys.readouterr().out
    assert "growing to 0.25 of a long answer" in out and "holds <= 648 blocks" in out and "'greedy'" in out
    assert main(args) == 0  # control: a fixed budget
    out = capsys.readouterr().out
    assert "growing" not in out and "holds <= 200 blocks" in out and "'guaranteed'" in out
    assert main(["--model", qwen, "--memory", "24GiB", "--budget-ratio", "0.25"]) == 2  # no floor to grow from
    assert "--budget-ratio needs --budget" in capsys.readouterr().err


GOOD = ["--memory", "24GiB", "--weight-bits", "4", "--budget", "512"]


@pytest.mark.parametrize("args,message", [
    (["--budget", "0"], "argument --budget: must be a positive integer, got 0"),
    (["--divide-length", "-5"], "argument --divide-length: must be a positive integer, got -5"),
    (["--gpu-memory-utilization", "1.5"], "argument --gpu-memory-utilization: must be in (0, 1]"),
    (["--gpu-memory-utilization", "0"], "argument --gpu-memory-utilization: must be a positive number"),
    (["--memory", "lots"], "argument --memory: cannot read size 'lots'"),
    (["--memory", "0GiB"], "argument --memory: must be more than 0 bytes"),
    (["--max-num-seqs", "0"], "argument --max-num-seqs: must be a positive integer"),
    (["--block-size", "abc"], "argument --block-size: must be a positive integer, got 'abc'"),
    (["--weight-bits", "64"], "argument --weight-bits: must be in (0, 32]"),
    (["--params", "nan"], "argument --params: must be a positive number"),
    (["--kv-cache-dtype", "fp8-e4m3"], "argument --kv-cache-dtype: invalid choice: 'fp8-e4m3'"),
    (["--kv-cache-dtype", "nvfp4"], "--kv-cache-dtype nvfp4: kvcompact reads only"),
    (["--weight-bits", "16"], "no KV pool"),  # 65.6 GB of weights: it used to print 'longest trace unlimited'
    (["--max-model-len", "560"], "--budget 512 + --divide-length 64 exceeds the context (--max-model-len 560)"),
    (["--concurrency", "2"], "unrecognized arguments: --concurrency"),
    (["--memory", "80"], "did you mean 80GiB?"),
    (["--budget", "10"], "'budget' (10) must be larger than the protected tokens (36"),  # as serve refuses it
    (["--budget-ratio", "1"], "'budget_ratio' must be a number >= 0 and < 1"),  # as serve refuses it
    (["--max-model-len", "64k"], "--max-model-len 64000 exceeds the model's context (40960"),
    (["--max-model-len", "2.5K"], "argument --max-model-len: must be a positive integer"),
    (["-tp", "3"], "-tp 3: the model's 64 attention heads are not divisible by it"),
])
def test_cli_refuses_each_bad_input_naming_it(qwen, capsys, args, message):
    assert main(["--model", qwen, *GOOD]) == 0  # control: the same command without the bad value plans
    capsys.readouterr()
    assert main(["--model", qwen, *GOOD, *args]) == 2
    captured = capsys.readouterr()
    assert message in captured.err and "Traceback" not in captured.err and captured.err.count("\n") == 1
    assert captured.out == ""


@pytest.mark.parametrize("config,message", [
    ({k: v for k, v in QWEN3_32B.items() if k != "model_type"}, "Should have a `model_type` key"),
    (None, "--model"),
])
def test_cli_refuses_an_unreadable_model(tmp_path, capsys, config, message):
    model = model_dir(tmp_path, config) if config else str(tmp_path / "missing")
    assert main(["--model", model, *GOOD]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"kvcompact capacity: error: --model {model}: cannot read its config") and message in err
    assert err.count("\n") == 1
