"""Fixtures shared by tests/unit and tests/engine. Built once per session: the bundled model's test prompt in tokens
and the transformers reference model (fp32, eager attention) that replays what the engine did. Built once per
module that asks: the tiny random-weight models of :mod:`support.models`.

This file also puts tests/ on ``sys.path`` (pytest's rootdir-relative import of a conftest outside a package), so
every test imports the helpers as ``support.<module>``.

Under pytest-xdist (``scripts/test.sh`` runs one worker per core), each worker and every vLLM it starts runs one
OpenMP thread with vLLM's own core binding off: two engines then never pin their threads to the same cores, and
the kernel spreads the workers over the cores. A decode step of the bundled model is Python rather than arithmetic
(on two cores a test takes as long on one core as on both), so two workers finish the suite in about half the time.
Not pinned to a core each: a vLLM server's engine core spins while its worker computes, and one core shared by the
two stalls them (the mixed-load soak ran past 10 minutes)."""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch

from kvcompact import reference
from support.engine import PROMPT, model_dir, tokenize
from support.models import GEMMA3, build


def pytest_configure(config: pytest.Config) -> None:
    worker = os.environ.get("PYTEST_XDIST_WORKER")  # "gw0", "gw1", ... in a worker; absent without xdist
    if worker is None:
        return
    os.environ.update(VLLM_CPU_OMP_THREADS_BIND="nobind", OMP_NUM_THREADS="1")  # inherited by every server
    torch.set_num_threads(1)


@pytest.fixture(scope="session")
def prompt_ids() -> list[int]:
    return tokenize(PROMPT)


@pytest.fixture(scope="session")
def reference_model() -> Any:
    return reference.load_model(model_dir(), dtype=torch.float32)


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory: pytest.TempPathFactory) -> str:
    return build(tmp_path_factory, "qwen3", "Qwen3Config", head_dim=128)


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory: pytest.TempPathFactory) -> str:
    return build(tmp_path_factory, "qwen2", "Qwen2Config")


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory: pytest.TempPathFactory) -> str:
    return build(tmp_path_factory, "gemma3", "Gemma3TextConfig", scales=(0.02, 0.3, 3.0), **GEMMA3)
