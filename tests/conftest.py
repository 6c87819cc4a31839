"""Fixtures shared by the engine tests, each built once per session: the bundled model's test prompt in tokens and
the transformers reference model (fp32, eager attention) that replays what the engine did."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from engine import PROMPT, model_dir, tokenize
from kvcompact import reference


@pytest.fixture(scope="session")
def prompt_ids() -> list[int]:
    return tokenize(PROMPT)


@pytest.fixture(scope="session")
def reference_model() -> Any:
    return reference.load_model(model_dir(), dtype=torch.float32)
