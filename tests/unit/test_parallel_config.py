"""Tensor and pipeline parallelism without an engine: what start-up refuses under PP and what ``kvcompact serve``
sets for several CPU ranks. The parallel engines against a single process: tests/engine/test_parallel.py."""

from __future__ import annotations

import json

import pytest


def test_per_head_selection_is_refused_under_pp():
    """per_head averages over all layers, which PP splits over processes: refused at startup, with the fix."""
    from types import SimpleNamespace

    from kvcompact.config import ConfigError, KVCompactConfig
    from kvcompact.vllm.startup import check_engine_config

    vllm_config = SimpleNamespace(
        use_v2_model_runner=False, cache_config=SimpleNamespace(enable_prefix_caching=False),
        scheduler_config=SimpleNamespace(async_scheduling=False), speculative_config=None, kv_transfer_config=None,
        model_config=SimpleNamespace(max_model_len=4096, hf_config=None, is_encoder_decoder=False, use_mla=False,
                                     is_hybrid=False),
        parallel_config=SimpleNamespace(pipeline_parallel_size=2, tensor_parallel_size=1))
    with pytest.raises(ConfigError, match="per_layer_per_head"):
        check_engine_config(KVCompactConfig(policy="knorm", selection="per_head"), vllm_config)
    check_engine_config(KVCompactConfig(policy="knorm", selection="per_layer_per_head"), vllm_config)
    vllm_config.parallel_config = SimpleNamespace(pipeline_parallel_size=1, tensor_parallel_size=3)
    check_engine_config(KVCompactConfig(policy="knorm", selection="per_head"), vllm_config)


def test_serve_sets_what_several_cpu_ranks_need(monkeypatch):
    """`kvcompact serve` with only the parallel sizes: one OpenMP thread per rank without core binding, and
    per_layer_per_head under PP unless a selection is given (then per_head is refused by the plugin)."""
    import shutil

    import kvcompact.tools.serve as serve

    monkeypatch.setattr(serve, "_is_cpu", lambda: True)
    for key in ("VLLM_CPU_OMP_THREADS_BIND", "OMP_NUM_THREADS", "KVCOMPACT_SELECTION", "PROMETHEUS_MULTIPROC_DIR"):
        monkeypatch.delenv(key, raising=False)

    def section(argv):
        command, env, prom = serve.server_command(["/some/model", "--policy", "knorm", *argv])
        if prom:
            shutil.rmtree(prom, ignore_errors=True)
        return json.loads(command[command.index("--additional-config") + 1])["kvcompact"], env

    cfg, env = section(["--pipeline-parallel-size", "2"])
    assert cfg["selection"] == "per_layer_per_head"
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "nobind" and env["OMP_NUM_THREADS"] == "1"
    cfg, env = section(["-tp", "3"])
    assert "selection" not in cfg and env["VLLM_CPU_OMP_THREADS_BIND"] == "nobind"
    cfg, _ = section(["-pp", "2", "--selection", "per_head"])
    assert cfg["selection"] == "per_head"  # explicit: left to the plugin, which refuses it with the fix
    _, env = section([])
    assert "VLLM_CPU_OMP_THREADS_BIND" not in env and "OMP_NUM_THREADS" not in env
