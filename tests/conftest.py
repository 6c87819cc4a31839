"""Fixtures shared by tests/unit and tests/engine. Built once per session: the bundled model's test prompt in tokens
and the transformers reference model (fp32, eager attention) that replays what the engine did. Built once per
module that asks: the tiny random-weight models of :mod:`support.models`.

This file also puts tests/ on ``sys.path`` (pytest's rootdir-relative import of a conftest outside a package), so
every test imports the helpers as ``support.<module>``.

Under pytest-xdist (``scripts/test.sh`` runs one worker per core), each worker and every vLLM it starts runs one
OpenMP thread with vLLM's own core binding off: two engines then never pin their threads to the same cores, and
the kernel spreads the workers over the cores. A decode step of the bundled model takes about as long on one core as
on two (most of it in oneDNN's matrix products reading the ~540 MB of fp32 weights, whatever the batch). Two workers
still share the memory bus: on a 2-vCPU AVX2-only EPYC two in-process engine tests side by side each ran 1.4 to 2
times slower than alone, a vLLM server's test beside one 2.5 to 3 times (so those run alone, scripts/test.sh).
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


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The engine tests before the unit tests, each part in pytest-randomly's order. With ``--dist loadfile`` xdist
    hands out files in this order (``scripts/test.sh`` turns off its own reordering, which puts the files with the
    most tests first: the unit files, seconds each, leaving the engine files, minutes each, to the end), so the
    many short unit files come last and fill the time one worker's long engine file leaves the other."""
    items.sort(key=lambda item: not item.nodeid.startswith("tests/engine/"))


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
