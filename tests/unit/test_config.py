"""Bad configuration, each refused with a message that names the problem, before anything runs.

Covers the three config sources (``KVCOMPACT_*`` environment, ``--additional-config``, ``kvcompact serve``
options), per-request overrides (``vllm_xargs``, front-end and engine side), engine settings that make
compression meaningless (a budget above the context), and calibration statistics made for another model.
The HTTP side of bad requests (400 and the server keeps serving) is in ``test_reliability.py``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import tempfile
from types import SimpleNamespace

import pytest
import torch

from kvcompact.config import ConfigError, KVCompactConfig, RequestOverrides
from support import FIXED

ENV: dict[str, str] = {}  # an empty environment: only the source under test counts


def from_additional(section, environ=None):
    return KVCompactConfig.from_sources({"kvcompact": section}, environ=environ or ENV)


# -- the config object and its sources ---------------------------------------------------------------------
@pytest.mark.parametrize("section, words", [
    ({"policy": "bogus"}, ["'policy'", "triattention", "'bogus'"]),
    ({"selection": "per_token"}, ["'selection'", "per_head"]),
    ({"compaction": "defrag"}, ["'compaction'", "repack", "holefill"]),
    ({"budget": 100, "window": 128}, ["'budget' (100)", "window 128"]),
    ({"budget": 128, "window": 128}, ["'budget' (128)", "protected"]),
    ({"policy": "streaming", "budget": 130, "window": 128, "n_sink": 4}, ["'budget' (130)", "n_sink 4"]),
    ({"budget": 0}, ["'budget'", "> 0"]),
    ({"budget": -5}, ["'budget'", "> 0"]),
    ({"divide_length": 0}, ["'divide_length'", "> 0"]),
    ({"window": -1}, ["'window'", ">= 0"]),
    ({"budget": "512"}, ["'budget'", "type int", "'512'"]),
    ({"budget": 512.0}, ["'budget'", "type int"]),
    ({"budget": True}, ["'budget'", "type int"]),
    ({"protect_prompt": "yes"}, ["'protect_prompt'", "type bool"]),
    ({"stats_path": 3}, ["'stats_path'"]),
    ({"policy": None}, ["'policy'"]),
    ({"budgett": 512}, ["unknown field 'budgett'", "budget"]),
    ({"recall_tokens": -1}, ["'recall_tokens'", ">= 0"]),
    ({"recall_interval": 0}, ["'recall_interval'", "> 0"]),
    ({"recall_pages": 0}, ["'recall_pages'", "> 0"]),
    ({"recall_margin": -0.5}, ["'recall_margin'", ">= 0"]),
    ({"recall_margin": float("nan")}, ["'recall_margin'", "finite"]),
    ({"recall_margin": "2"}, ["'recall_margin'", "type float"]),
    ({"recall_margin": True}, ["'recall_margin'", "type float"]),
    ({"budget_ratio": 1.0, "admission": "greedy"}, ["'budget_ratio'", "< 1"]),
    ({"budget_ratio": -0.1, "admission": "greedy"}, ["'budget_ratio'", ">= 0"]),
    ({"budget_ratio": 0.2}, ["'budget_ratio' 0.2", "admission 'greedy'"]),
    ({"recall_tokens": 256, "compaction": "none"}, ["'recall_tokens'", "repack or holefill"]),
    ({"recall_tokens": 256, "recall_dtype": "fp16"}, ["'recall_dtype'", "auto", "fp8"]),
    ({"recall_dtype": "fp8"}, ["'recall_dtype' fp8", "'recall_tokens' > 0"]),
    ({"recall_at": "token"}, ["'recall_at'", "step", "layer"]),
    ({"recall_tokens": 256, "recall_search": "all"}, ["'recall_search'", "quest", "exact"]),
    ({"recall_search": "exact"}, ["'recall_search' exact", "'recall_tokens' > 0"]),
    ({"recall_at": "layer"}, ["'recall_at' layer", "selection 'per_layer_per_head'"]),
])
def test_bad_additional_config_names_the_field(section, words):
    with pytest.raises(ConfigError) as e:
        from_additional(section)
    for word in words:
        assert word in str(e.value), (word, str(e.value))


@pytest.mark.parametrize("section, words", [
    ("{not json", ["not valid JSON"]),
    ("[1, 2]", ["must be an object"]),
    (["budget", 512], ["must be an object"]),
])
def test_bad_additional_config_shape(section, words):
    with pytest.raises(ConfigError) as e:
        from_additional(section)
    for word in words:
        assert word in str(e.value)


@pytest.mark.parametrize("environ, words", [
    ({"KVCOMPACT_BUDGET": "abc"}, ["KVCOMPACT_BUDGET", "integer", "'abc'"]),
    ({"KVCOMPACT_BUDGET": "1.5"}, ["KVCOMPACT_BUDGET", "integer"]),
    ({"KVCOMPACT_BUDGET": "36"}, ["'budget' (36)", "window 32 + n_sink 4"]),  # default window 32, n_sink 4
    ({"KVCOMPACT_POLICY": "bogus"}, ["'policy'", "'bogus'"]),
    ({"KVCOMPACT_PROTECT_PROMPT": "maybe"}, ["KVCOMPACT_PROTECT_PROMPT", "boolean"]),
    ({"KVCOMPACT_RECALL_MARGIN": "two"}, ["KVCOMPACT_RECALL_MARGIN", "a number", "'two'"]),
    ({"KVCOMPACT_RECALL_MARGIN": "inf"}, ["'recall_margin'", "finite"]),
])
def test_bad_environment_names_the_variable(environ, words):
    with pytest.raises(ConfigError) as e:
        KVCompactConfig.from_sources({}, environ=environ)
    for word in words:
        assert word in str(e.value), (word, str(e.value))


def test_float_fields_read_as_numbers_from_every_source():
    """The float fields (recall_margin, budget_ratio): from the environment, from --additional-config (an integer is
    a number too), and as `kvcompact serve --recall-margin` / `--budget-ratio`."""
    from kvcompact.tools.serve import build_parser

    assert KVCompactConfig.from_sources({}, environ={"KVCOMPACT_RECALL_MARGIN": "1.5"}).recall_margin == 1.5
    assert from_additional({"recall_margin": 2}).recall_margin == 2
    args = build_parser().parse_args(["--recall-margin", "0.25"])
    assert args.kvcompact_recall_margin == 0.25
    assert KVCompactConfig.from_sources({}, environ={"KVCOMPACT_BUDGET_RATIO": "0.2", "KVCOMPACT_ADMISSION": "greedy"}
                                        ).budget_ratio == 0.2
    assert build_parser().parse_args(["--budget-ratio", "0.2"]).kvcompact_budget_ratio == 0.2


# What kubelet injects into every pod of the namespace for a Service named kvcompact / kvcompact-api.
SERVICE_LINKS = {"KVCOMPACT_SERVICE_HOST": "10.96.0.12", "KVCOMPACT_SERVICE_PORT": "8000",
                 "KVCOMPACT_SERVICE_PORT_HTTP": "8000", "KVCOMPACT_PORT": "tcp://10.96.0.12:8000",
                 "KVCOMPACT_PORT_8000_TCP": "tcp://10.96.0.12:8000", "KVCOMPACT_PORT_8000_TCP_PROTO": "tcp",
                 "KVCOMPACT_PORT_8000_TCP_PORT": "8000", "KVCOMPACT_PORT_8000_TCP_ADDR": "10.96.0.12",
                 "KVCOMPACT_API_SERVICE_HOST": "10.96.0.13", "KVCOMPACT_API_PORT_443_UDP_ADDR": "10.96.0.13"}


@pytest.fixture
def warnings_logged(monkeypatch):
    """The warnings kvcompact logs (on vLLM's logger, which does not propagate to pytest's caplog), with the
    once-per-process memory of warned names reset."""
    import logging

    from kvcompact import config as config_module

    monkeypatch.setattr(config_module, "_warned", set())
    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())  # type: ignore[method-assign]
    logger = logging.getLogger("vllm.kvcompact")
    logger.addHandler(handler)
    yield records
    logger.removeHandler(handler)


def test_kubernetes_service_links_neither_fail_nor_switch_kvcompact_on(warnings_logged):
    assert KVCompactConfig.from_sources({}, environ=SERVICE_LINKS) is None  # plain vLLM stays plain
    c = KVCompactConfig.from_sources({"kvcompact": {"budget": 300}}, environ=SERVICE_LINKS)
    assert c is not None and c.budget == 300
    assert warnings_logged == []
    # control: a misspelled setting beside them is neither fatal nor silent, and switches nothing on
    assert KVCompactConfig.from_sources({}, environ={**SERVICE_LINKS, "KVCOMPACT_BUDJET": "256"}) is None
    assert len(warnings_logged) == 1 and "unknown environment variable KVCOMPACT_BUDJET" in warnings_logged[0]
    assert "KVCOMPACT_BUDGET" in warnings_logged[0]
    # and a known setting still switches it on
    c = KVCompactConfig.from_sources({}, environ={**SERVICE_LINKS, "KVCOMPACT_BUDGET": "256"})
    assert c is not None and c.budget == 256


def test_sources_layer_and_absent_config_is_passive():
    assert KVCompactConfig.from_sources({}, environ={"PATH": "/bin"}) is None
    c = KVCompactConfig.from_sources({"kvcompact": {"budget": 300}}, environ={"KVCOMPACT_BUDGET": "200",
                                                                             "KVCOMPACT_WINDOW": "16"})
    assert (c.budget, c.window) == (300, 16)
    # A bad value in the losing source is still an error: nothing is silently ignored.
    with pytest.raises(ConfigError, match="KVCOMPACT_BUDGET"):
        KVCompactConfig.from_sources({"kvcompact": {"budget": 300}}, environ={"KVCOMPACT_BUDGET": "x"})


# -- per-request overrides -----------------------------------------------------------------------------------
CONFIG = KVCompactConfig(**FIXED, policy="streaming", budget=256, divide_length=64, window=32)


@pytest.mark.parametrize("extra, words", [
    ({"kvcompact_budget": 0}, ["kvcompact_budget", "positive integer", "0"]),
    ({"kvcompact_budget": -1}, ["kvcompact_budget", "positive integer", "-1"]),
    ({"kvcompact_budget": "abc"}, ["kvcompact_budget", "positive integer", "'abc'"]),
    ({"kvcompact_budget": 2.5}, ["kvcompact_budget", "2.5"]),
    ({"kvcompact_budget": float("nan")}, ["kvcompact_budget", "nan"]),
    ({"kvcompact_budget": float("inf")}, ["kvcompact_budget", "inf"]),
    ({"kvcompact_budget": True}, ["kvcompact_budget"]),
    ({"kvcompact_budget": None}, ["kvcompact_budget"]),
    ({"kvcompact_budget": [300]}, ["kvcompact_budget"]),
    ({"kvcompact_budget": "9" * 5000}, ["kvcompact_budget"]),   # beyond Python's int-from-str limit
    ({"kvcompact_budget": 32}, ["(32)", "protected tokens (36: window 32 + n_sink 4)"]),
    ({"kvcompact_budget": 1e12}, ["1000000000000", "max_model_len 2048"]),
    ({"kvcompact_budget": 10 ** 400}, ["max_model_len 2048"]),
    ({"kvcompact_budget": 2000}, ["(2000) + divide_length (64)", "max_model_len 2048"]),
    ({"kvcompact": "maybe"}, ["'kvcompact'", "'on' or 'off'", "'maybe'"]),
])
def test_bad_request_override_names_the_problem(extra, words):
    with pytest.raises(ConfigError) as e:
        RequestOverrides.from_extra_args(extra, CONFIG, max_model_len=2048)
    for word in words:
        assert word in str(e.value), (word, str(e.value))


@pytest.mark.parametrize("extra, expected", [
    ({}, RequestOverrides()),
    (None, RequestOverrides()),
    ({"kvcompact_budget": 300}, RequestOverrides(budget=300)),
    ({"kvcompact_budget": "300"}, RequestOverrides(budget=300)),
    ({"kvcompact_budget": 1e3}, RequestOverrides(budget=1000)),
    ({"kvcompact_budget": 1984}, RequestOverrides(budget=1984)),  # 1984 + 64 == 2048: allowed
    ({"kvcompact": "off"}, RequestOverrides(enabled=False)),
    ({"kvcompact": "ON"}, RequestOverrides(enabled=True)),
    ({"other_plugin_arg": [1, 2]}, RequestOverrides()),
])
def test_good_request_overrides(extra, expected):
    assert RequestOverrides.from_extra_args(extra, CONFIG, max_model_len=2048) == expected


# -- engine settings -----------------------------------------------------------------------------------------
def fake_vllm_config(max_model_len=2048, **over):
    values = dict(enable_prefix_caching=False, async_scheduling=False, speculative_config=None, pp=1, v2=False,
                  kv_transfer=None)
    values.update(over)
    return SimpleNamespace(
        use_v2_model_runner=values["v2"],
        cache_config=SimpleNamespace(enable_prefix_caching=values["enable_prefix_caching"]),
        scheduler_config=SimpleNamespace(async_scheduling=values["async_scheduling"]),
        speculative_config=values["speculative_config"],
        kv_transfer_config=values["kv_transfer"],
        parallel_config=SimpleNamespace(pipeline_parallel_size=values["pp"], tensor_parallel_size=values.get("tp", 1)),
        model_config=SimpleNamespace(max_model_len=max_model_len, hf_config=None, is_encoder_decoder=False,
                                     use_mla=False, is_hybrid=False, hf_text_config=values.get("text_config"),
                                     get_sliding_window=lambda: values.get("window")),
    )


def draft_spec(disable_padded_drafter_batch=False, parallel_drafting=False, use_mla=False, window=None):
    """A draft-model speculative config as kvcompact's start-up check reads it."""
    draft = SimpleNamespace(use_mla=use_mla, is_hybrid=False, get_sliding_window=lambda: window)
    return SimpleNamespace(method="draft_model", disable_padded_drafter_batch=disable_padded_drafter_batch,
                           parallel_drafting=parallel_drafting, draft_model_config=draft)


def kv_transfer(connector):
    """vLLM's own KVTransferConfig, as ``--kv-transfer-config '{"kv_connector": ..., "kv_role": ...}'`` makes it."""
    from vllm.config import KVTransferConfig

    return KVTransferConfig(kv_connector=connector, kv_role="kv_both" if connector else None)


@pytest.mark.parametrize("over, words", [
    ({"v2": True, "pp": 2}, ["Model Runner V2", "tensor or pipeline parallelism", "VLLM_USE_V2_MODEL_RUNNER=0"]),
    ({"v2": True, "speculative_config": SimpleNamespace(method="ngram")}, ["Model Runner V2", "speculative"]),
    ({"v2": True, "window": 512}, ["Model Runner V2", "sliding-window layers"]),
    ({"v2": True, "text_config": SimpleNamespace(layer_types=["full_attention", "sliding_attention"])},
     ["Model Runner V2", "sliding-window layers"]),
    *(({"speculative_config": SimpleNamespace(method=m)}, [repr(m), "only 'ngram' and 'draft_model'"])
      for m in ("eagle", "eagle3", "mtp", "medusa", "suffix", "ngram_gpu", "custom_class")),
    ({"speculative_config": SimpleNamespace(method="ngram"), "async_scheduling": True}, ["--no-async-scheduling"]),
    ({"speculative_config": draft_spec(), "async_scheduling": True}, ["--no-async-scheduling"]),
    ({"speculative_config": draft_spec(disable_padded_drafter_batch=True)}, ["disable_padded_drafter_batch"]),
    ({"speculative_config": draft_spec(parallel_drafting=True)}, ["parallel_drafting"]),
    ({"speculative_config": draft_spec(), "tp": 2}, ["tensor or pipeline parallelism"]),
    ({"speculative_config": draft_spec(use_mla=True)}, ["draft model with latent (MLA)"]),
    ({"speculative_config": draft_spec(window=512)}, ["sliding-window attention"]),
    ({"pp": 2}, ["per_layer_per_head", "--pipeline-parallel-size"]),
    ({"max_model_len": 300}, ["budget (256) + divide_length (64) = 320", "max_model_len 300"]),
    *(({"kv_transfer": kv_transfer(c)}, [repr(c), "--kv-transfer-config", "not verified"])
      for c in ("LMCacheConnectorV1", "NixlConnector", "OffloadingConnector")),
])
def test_engine_settings_refused(over, words):
    from kvcompact.vllm.startup import check_engine_config

    with pytest.raises(ConfigError) as e:
        check_engine_config(CONFIG, fake_vllm_config(**over))
    for word in words:
        assert word in str(e.value), (word, str(e.value))


@pytest.mark.parametrize("spec", [SimpleNamespace(method="ngram"), draft_spec()], ids=["ngram", "draft_model"])
def test_verified_speculation_is_accepted(spec):
    """The control of the refusals above: the verified methods pass the same check."""
    from kvcompact.vllm.startup import check_engine_config

    check_engine_config(CONFIG, fake_vllm_config(speculative_config=spec))


def test_model_runner_v2_is_accepted_on_cpu_as_verified_and_refused_elsewhere(monkeypatch):
    """The control of the V2 refusals above: a score-free policy on one CPU process passes; the same engine on a
    GPU, or with a policy that captures attention, is refused."""
    import vllm.platforms

    from kvcompact.vllm.startup import check_engine_config

    check_engine_config(CONFIG, fake_vllm_config(v2=True))
    with pytest.raises(ConfigError, match="policy h2o"):
        check_engine_config(KVCompactConfig(policy="h2o", budget=256, window=32), fake_vllm_config(v2=True))
    monkeypatch.setattr(vllm.platforms, "current_platform", SimpleNamespace(is_cpu=lambda: False, device_name="cuda"))
    with pytest.raises(ConfigError, match="a cuda device"):
        check_engine_config(CONFIG, fake_vllm_config(v2=True))


@pytest.mark.parametrize("over, words", [
    ({"v2": True}, ["recall tier", "Model Runner V2"]),
    ({"tp": 2}, ["recall tier", "tensor or pipeline parallelism"]),
    ({"speculative_config": SimpleNamespace(method="ngram")}, ["recall tier", "speculative decoding"]),
    ({"cache_dtype": "fp8_e4m3"}, ["recall tier", "fp8 KV cache"]),
    ({"window": 512}, ["recall tier", "sliding-window layers"]),
])
def test_recall_tier_refused_where_it_was_not_verified(over, words):
    """Each unverified setting with recall_tokens > 0 stops the start-up by name. Control: the same engine
    without the recall tier passes, and the recall tier on a plain engine passes."""
    from kvcompact.vllm.startup import check_engine_config

    recall = CONFIG.replace(recall_tokens=256)
    vllm_config = fake_vllm_config(**over)
    if "cache_dtype" in over:
        vllm_config.cache_config.cache_dtype = over["cache_dtype"]
    with pytest.raises(ConfigError) as e:
        check_engine_config(recall, vllm_config)
    for word in words:
        assert word in str(e.value), (word, str(e.value))
    if not {"v2", "window"} & over.keys():  # those have refusals of their own; the plain engine is the control
        check_engine_config(CONFIG, vllm_config)
    check_engine_config(recall, fake_vllm_config())


def test_draft_model_in_pressure_mode_is_refused():
    from kvcompact.vllm.startup import check_engine_config

    with pytest.raises(ConfigError, match="budget_mode 'pressure'"):
        check_engine_config(KVCompactConfig(budget_mode="pressure"), fake_vllm_config(speculative_config=draft_spec()))
    with pytest.raises(ConfigError, match="budget_mode 'latch' \\(its rounds"):  # latch shrinks as pressure does
        check_engine_config(KVCompactConfig(budget_mode="latch"), fake_vllm_config(speculative_config=draft_spec()))
    # the shipped budget mode is pressure: refused too, naming the setting that runs (test_verified_speculation_is_
    # accepted, the control: the same check passes with budget_mode fixed)
    with pytest.raises(ConfigError, match="the default.*set budget_mode 'fixed'"):
        check_engine_config(KVCompactConfig(policy="streaming"), fake_vllm_config(speculative_config=draft_spec()))


@pytest.mark.parametrize("tp, heads_held", [(1, 8), (2, 8), (16, 16)])
def test_block_bytes_count_every_rank(tp, heads_held):
    """kvcompact:block_bytes' per-token figure: all layers and the KV heads every rank holds (16 ranks over 8 KV
    heads hold one replica each: 16 heads' worth, not 8; the control case)."""
    import torch

    from kvcompact.vllm.startup import device_bytes_per_token

    model = SimpleNamespace(get_total_num_kv_heads=lambda: 8, get_head_size=lambda: 128, dtype=torch.bfloat16,
                            hf_text_config=SimpleNamespace(num_hidden_layers=64))
    config = SimpleNamespace(model_config=model, parallel_config=SimpleNamespace(tensor_parallel_size=tp),
                             cache_config=SimpleNamespace(cache_dtype="auto"), speculative_config=None)
    assert device_bytes_per_token(config) == 2 * 64 * heads_held * 128 * 2  # K and V, 64 layers, 128 dims, bf16
    config.cache_config.cache_dtype = "fp8"
    assert device_bytes_per_token(config) == 2 * 64 * heads_held * 128


def test_block_bytes_count_the_draft_models_layers():
    """A draft model's layers keep their KV in the same blocks: a block's bytes are the target's plus the draft's
    (a 64-layer target, a 2-layer draft with 4 KV heads of 64 dims, bf16)."""
    import torch

    from kvcompact.vllm.startup import device_bytes_per_token

    def model(layers, heads, dim):
        return SimpleNamespace(get_total_num_kv_heads=lambda: heads, get_head_size=lambda: dim, dtype=torch.bfloat16,
                               hf_text_config=SimpleNamespace(num_hidden_layers=layers))

    spec = draft_spec()
    spec.draft_model_config = model(2, 4, 64)
    config = SimpleNamespace(model_config=model(64, 8, 128), parallel_config=SimpleNamespace(tensor_parallel_size=1),
                             cache_config=SimpleNamespace(cache_dtype="auto"), speculative_config=spec)
    assert device_bytes_per_token(config) == 2 * 64 * 8 * 128 * 2 + 2 * 2 * 4 * 64 * 2


def test_kv_transfer_config_without_a_connector_is_accepted():
    """The control of the connector refusals: vLLM's transfer config object with no connector named passes."""
    from kvcompact.vllm.startup import check_engine_config

    check_engine_config(CONFIG, fake_vllm_config(kv_transfer=kv_transfer(None)))


def test_budget_above_context_is_fine_when_compression_is_off():
    from kvcompact.vllm.startup import check_engine_config

    check_engine_config(CONFIG, fake_vllm_config(max_model_len=320))         # exactly fits
    check_engine_config(CONFIG.replace(enabled=False), fake_vllm_config(max_model_len=100))


# -- calibration statistics made for another model -------------------------------------------------------------
@pytest.fixture(scope="module")
def bundled_hf_config():
    from transformers import AutoConfig

    from kvcompact.tools.model import ensure_default_model

    return AutoConfig.from_pretrained(str(ensure_default_model()))


def stats_for(hf_config, **over):
    from kvcompact.stats import ModelFingerprint, QueryStats

    fp = dataclasses.replace(ModelFingerprint.from_hf_config(hf_config, model_name="other-model"), **over)
    g = torch.Generator().manual_seed(0)
    shape = (fp.num_layers, fp.num_attention_heads, fp.head_dim // 2)
    qm = torch.complex(torch.randn(shape, generator=g), torch.randn(shape, generator=g))
    return QueryStats(qm, qm.abs() + 0.1, fp, num_tokens=10)


@pytest.mark.parametrize("over, words", [
    ({"num_kv_heads": 8}, ["num_kv_heads=8", "the model has 3", "Recalibrate"]),
    ({"rope_theta": 10000.0}, ["rope_theta=10000.0", "100000.0"]),
    ({"num_layers": 2}, ["num_layers=2", "30"]),
])
def test_stats_for_another_model_refused(tmp_path, bundled_hf_config, over, words):
    from kvcompact.round import build_policy as load_stats
    from kvcompact.stats import StatsError

    path = tmp_path / "other.pt"
    stats_for(bundled_hf_config, **over).save(str(path))
    config = KVCompactConfig(policy="triattention", budget=256, window=32, stats_path=str(path))
    with pytest.raises(StatsError) as e:
        load_stats(config, bundled_hf_config)
    for word in words:
        assert word in str(e.value), (word, str(e.value))
    # The same file for the right model loads: the refusal is about the fingerprint, not the file.
    stats_for(bundled_hf_config).save(str(path))
    load_stats(config, bundled_hf_config)


def test_triattention_without_stats_refused(bundled_hf_config):
    from kvcompact.round import build_policy as load_stats

    with pytest.raises(ConfigError, match="stats_path"):
        load_stats(KVCompactConfig(policy="triattention", budget=256, window=32), bundled_hf_config)


# -- `kvcompact serve` refuses before starting vLLM ---------------------------------------------------------
class ServerStarted(Exception):
    """What the stand-in for the server's Popen raises: serve got as far as starting vLLM."""


def serve_in_process(args, monkeypatch, env_over=None) -> int:
    """``kvcompact serve MODEL ARGS --port 9`` through the CLI's own entry point, in this process (the command line is
    the same code as in a subprocess; vLLM's import alone costs a subprocess half a minute on a slow CPU), with
    ``KVCOMPACT_*`` taken from ``env_over`` only. Starting vLLM's server raises :class:`ServerStarted` instead."""
    from kvcompact.tools import cli, serve
    from kvcompact.tools.model import ensure_default_model

    for key in [k for k in os.environ if k.startswith("KVCOMPACT_")]:
        monkeypatch.delenv(key)
    for key, value in (env_over or {}).items():
        monkeypatch.setenv(key, value)
    real_popen = serve.subprocess.Popen

    def popen(command: list[str], *args: object, **kwargs: object) -> object:
        if "vllm.entrypoints.openai.api_server" in command:
            raise ServerStarted(command)
        return real_popen(command, *args, **kwargs)  # the rest (vLLM's platform probe runs `file -b python`)

    monkeypatch.setattr(serve.subprocess, "Popen", popen)
    try:
        return cli.main(["serve", str(ensure_default_model()), *args, "--port", "9"])
    except SystemExit as e:  # argparse's own refusals
        return int(e.code or 0)


@pytest.mark.parametrize("args, env_over, words", [
    (["--policy", "bogus"], None, ["--policy", "invalid choice", "'bogus'"]),
    (["--budget", "abc"], None, ["--budget", "invalid int value"]),
    (["--policy", "streaming", "--budget", "16", "--window", "32"], None, ["'budget' (16)", "window 32"]),
    (["--policy", "streaming", "--additional-config", json.dumps({"kvcompact": {"bugdet": 3}})], None,
     ["unknown field 'bugdet'"]),
    (["--policy", "streaming"], {"KVCOMPACT_DIVIDE_LENGTH": "-3"}, ["'divide_length'", "> 0"]),
])
def test_serve_refuses_bad_config_before_vllm_starts(args, env_over, words, monkeypatch, capsys):
    assert serve_in_process(args, monkeypatch, env_over) == 2  # EXIT_USAGE, as argparse exits
    stderr = capsys.readouterr().err
    for word in words:
        assert word in stderr, (word, stderr[-2000:])
    assert "vllm.entrypoints.openai.api_server" not in stderr  # the server command was never printed


def test_serve_in_process_reaches_the_server_with_a_good_config(monkeypatch, capsys, tmp_path):
    """Control for the refusals above: the same call with a valid configuration gets as far as starting vLLM's
    server, so a refusal there is serve's, not the stand-in's. The metrics directory serve makes for the server
    (removed when the server exits, which this one never does) goes under the test's own temporary directory."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    with pytest.raises(ServerStarted) as started:
        serve_in_process(["--policy", "streaming"], monkeypatch)
    assert "vllm.entrypoints.openai.api_server" in started.value.args[0]
    assert "vllm.entrypoints.openai.api_server" in capsys.readouterr().err


def test_serve_refuses_budget_above_context():
    """Caught by vLLM config creation (the front-end's check_engine_config) in the server's own process, started
    from the command line as a user would: the server never starts."""
    from kvcompact.tools.model import ensure_default_model

    env = {k: v for k, v in os.environ.items() if not k.startswith("KVCOMPACT_")}
    proc = subprocess.run([sys.executable, "-m", "kvcompact.tools.cli", "serve", str(ensure_default_model()),
                           "--policy", "streaming", "--budget", "1024", "--max-model-len", "512", "--dtype", "float32",
                           "--port", "9"], env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode != 0
    assert "exceeds the context (max_model_len 512)" in proc.stderr, proc.stderr[-3000:]
    assert "Application startup complete" not in proc.stderr + proc.stdout
