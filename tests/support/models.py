"""Tiny random-weight models built from transformers configs (no hub), for the tests of the models users serve
(tests/engine/test_models.py on the engine, tests/unit/test_model_refusals.py for what start-up refuses); the
fixtures ``qwen3``, ``qwen2`` and ``gemma3`` (tests/conftest.py) build them once per module."""

from __future__ import annotations

from typing import Any

import torch

from kvcompact import reference
from support import FIXED

BASE = dict(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=1024, tie_word_embeddings=False)
SMALL = {**FIXED, "budget": 40, "divide_length": 16, "window": 8}


def build(tmp_path_factory: Any, name: str, config_cls: str, scales: tuple[float, float, float] | None = None,
          **over) -> str:
    """A random-weight model saved to a folder. ``scales``: the standard deviations of the (embedding, other
    matrices, norm weights), for a model whose default init (matrices 0.08, norms as built) loops on one token."""
    import transformers

    torch.manual_seed(0)
    config = getattr(transformers, config_cls)(**{**BASE, **over})
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # random weights at a scale that keeps logits decisive (no greedy near-ties)
        for n, p in model.named_parameters():
            if scales is not None:
                p.normal_(0, scales[0] if "embed" in n else scales[1] if p.dim() == 2 else scales[2])
            elif p.dim() == 2:
                p.normal_(0, 0.08)
    path = tmp_path_factory.mktemp(name)
    model.save_pretrained(path)
    return str(path)


# Gemma 3's shape in miniature: three sliding-window layers (window 64) and a global one, tied embeddings (as
# vLLM loads every Gemma 3). Its scaled, tied embedding makes the default init repeat one token; these scales
# give varied greedy outputs.
GEMMA3 = dict(num_hidden_layers=4, head_dim=32, sliding_window=64, tie_word_embeddings=True,
              layer_types=["sliding_attention"] * 3 + ["full_attention"])
WINDOWED = {**FIXED, "budget": 96, "divide_length": 32, "window": 64, "compaction": "repack"}


def stats_for(model_dir: str, tmp_path: Any) -> str:
    """TriAttention statistics of the model in ``model_dir``, calibrated on 256 random tokens and saved under
    ``tmp_path``: the file's path."""
    from kvcompact.tools.calibrate import calibrate_model

    model = reference.load_model(model_dir)
    g = torch.Generator().manual_seed(1)
    stats = calibrate_model(model, [torch.randint(0, 512, (256,), generator=g)], chunk_len=64, progress=False)
    path = tmp_path / "stats.pt"
    stats.save(str(path))
    return str(path)
