"""Fixtures shared by tests/unit and tests/engine. Built once per session: the bundled model's test prompt in tokens
and the transformers reference model (fp32, eager attention) that replays what the engine did. Built once per
module that asks: the tiny random-weight models of :mod:`support.models`.

This file also puts tests/ on ``sys.path`` (pytest's rootdir-relative import of a conftest outside a package), so
every test imports the helpers as ``support.<module>``."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from kvcompact import reference
from support.engine import PROMPT, model_dir, tokenize
from support.models import GEMMA3, build


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
