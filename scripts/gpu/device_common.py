"""What the GPU machine's scripts share: where the carried vLLM lives, the environment that runs it, the
Qwen3-8B-shaped dummy model they serve, random TriAttention statistics for it, and the import report.

The model: Qwen3-8B's attention and MLP shapes (36 layers, hidden 4096, MLP 12288, 32 query / 8 KV heads of 128,
RoPE theta 1e6, q/k-norm), loaded with ``--load-format dummy`` (no weights travel), bf16. Its vocabulary is the
carried tokenizer's (the bundled SmolLM2's, 49,152 ids; Qwen3's is 151,936): every id the model samples then has a
token, which ``vllm bench serve``'s random prompts and the server's detokenizer need. That shrinks only the
embedding and LM head (0.84 GB of weights fewer); a token's KV, the pool and every attention shape are Qwen3-8B's.

Nothing here imports vLLM or torch at module level, so ``--dry-run`` works on a machine without either.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
DEST = Path(os.environ.get("VLLM_GPU_DIR", "/tmp/vllm-gpu"))  # where install_on_device.sh unpacked the parts
SITE = DEST / "site"
TOKENIZER = DEST / "tokenizer"

QWEN3_8B = {
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 4096, "intermediate_size": 12288,
    "num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
    "hidden_act": "silu", "max_position_embeddings": 40960, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
    "rope_scaling": None, "attention_bias": False, "attention_dropout": 0.0, "tie_word_embeddings": False,
    "torch_dtype": "bfloat16", "use_sliding_window": False, "sliding_window": None, "max_window_layers": 36,
    "initializer_range": 0.02, "use_cache": True,
}
BLOCK_SIZE = 16
# KV bytes of one token: layers x KV heads x head_dim x (K and V) x 2 bytes (bf16).
KV_BYTES_PER_TOKEN = 36 * 8 * 128 * 2 * 2


def run_env(**extra: str) -> dict[str, str]:
    """The environment every engine and server runs in: the carried vLLM and its wheels first, this checkout's
    kvcompact (its dist-info is in SITE, its code in src/), the V1 runner (kvcompact refuses Model Runner V2 on a
    GPU), no network."""
    env = dict(os.environ)
    path = [str(SITE), str(ROOT / "src")] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])
    env.update(PYTHONPATH=os.pathsep.join(path), VLLM_USE_V2_MODEL_RUNNER="0", HF_HUB_OFFLINE="1",
               TRANSFORMERS_OFFLINE="1", VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1", PYTHONUNBUFFERED="1")
    env.update(extra)
    return env


def tokenizer_vocab(tokenizer: Path) -> int:
    """Ids the tokenizer can decode: its model's vocabulary plus added tokens (read from tokenizer.json, so no
    library is needed)."""
    data = json.loads((tokenizer / "tokenizer.json").read_text())
    ids = list(data["model"]["vocab"].values()) + [t["id"] for t in data.get("added_tokens", [])]
    return max(ids) + 1


def model_config(vocab: int, layers: int = 36) -> dict[str, Any]:
    return dict(QWEN3_8B, vocab_size=vocab, num_hidden_layers=layers, max_window_layers=layers,
                bos_token_id=1, eos_token_id=2)


def write_model(folder: Path, tokenizer: Path = TOKENIZER, layers: int = 36) -> dict[str, Any]:
    """A model folder vLLM can load with ``--load-format dummy``: config.json and the tokenizer's files."""
    folder.mkdir(parents=True, exist_ok=True)
    config = model_config(tokenizer_vocab(tokenizer), layers)
    (folder / "config.json").write_text(json.dumps(config, indent=1))
    for f in tokenizer.iterdir():
        shutil.copy(f, folder / f.name)
    return config


def write_stats(path: Path, layers: int = 36, seed: int = 0) -> None:
    """Random TriAttention query statistics of the model's shape (as `kvcompact bench gpu-round` uses): dummy
    weights have no real statistics to calibrate, and a round's work and its counters do not depend on them."""
    import torch

    if str(ROOT / "src") not in sys.path:  # the scripts run from the checkout, kvcompact not installed
        sys.path.insert(0, str(ROOT / "src"))
    from kvcompact.stats import ModelFingerprint, QueryStats

    hq, hkv, d = QWEN3_8B["num_attention_heads"], QWEN3_8B["num_key_value_heads"], QWEN3_8B["head_dim"]
    g = torch.Generator().manual_seed(seed)
    qbar = torch.complex(torch.randn(layers, hq, d // 2, generator=g), torch.randn(layers, hq, d // 2, generator=g))
    fp = ModelFingerprint(num_layers=layers, num_attention_heads=hq, num_kv_heads=hkv, head_dim=d,
                          rope_theta=QWEN3_8B["rope_theta"])
    QueryStats(qbar, qbar.abs() + torch.rand(layers, hq, d // 2, generator=g), fp).save(path)


REPORT = r'''
import importlib, importlib.metadata as md, sys, traceback
def step(name, fn):
    try:
        print(f"ok   {name}: {fn()}")
    except BaseException as e:
        tb = traceback.extract_tb(e.__traceback__)
        where = f" (at {tb[-1].filename}:{tb[-1].lineno})" if tb else ""
        print(f"FAIL {name}: {type(e).__name__}: {e}{where}")
step("torch", lambda: (lambda t: f"{t.__version__}, CUDA {t.version.cuda}, available {t.cuda.is_available()}")(
     importlib.import_module("torch")))
step("import vllm", lambda: (lambda v: f"{v.__version__} from {v.__file__}")(importlib.import_module("vllm")))
step("platform", lambda: type(importlib.import_module("vllm.platforms").current_platform).__name__)
step("vllm._C_stable_libtorch", lambda: importlib.import_module("vllm._C_stable_libtorch").__file__)
step("vllm._moe_C_stable_libtorch", lambda: importlib.import_module("vllm._moe_C_stable_libtorch").__file__)
step("FA3", lambda: (lambda m: f"available {m.FA3_AVAILABLE} ({m.FA3_UNAVAILABLE_REASON}); FA2 dropped: "
     f"{m.FA2_UNAVAILABLE_REASON}")(importlib.import_module("vllm.vllm_flash_attn.flash_attn_interface")))
step("triton", lambda: importlib.import_module("triton").__version__)
step("vllm.LLM", lambda: importlib.import_module("vllm").LLM)
step("V1 GPU model runner", lambda: importlib.import_module("vllm.v1.worker.gpu_model_runner").GPUModelRunner)
step("FLASH_ATTN backend", lambda: importlib.import_module("vllm.v1.attention.backends.flash_attn").__name__)
step("TRITON_ATTN backend", lambda: importlib.import_module("vllm.v1.attention.backends.triton_attn").__name__)
step("OpenAI server", lambda: importlib.import_module("vllm.entrypoints.openai.api_server").__name__)
step("vllm bench serve", lambda: importlib.import_module("vllm.benchmarks.serve").__name__)
step("import kvcompact", lambda: (lambda k: f"{md.version('kvcompact')} from {k.__file__}")(
     importlib.import_module("kvcompact")))
step("plugin entry point", lambda: [f"{e.name} = {e.value}" for e in md.entry_points(group="vllm.general_plugins")])
step("kvcompact hooks", lambda: importlib.import_module("kvcompact.vllm.plugin").register.__module__)
def pins():
    from pip._vendor.packaging.requirements import Requirement
    unmet = []
    for line in md.requires("vllm") or []:
        req = Requirement(line)
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        try:
            have = md.version(req.name)
        except md.PackageNotFoundError:
            continue
        if not req.specifier.contains(have, prereleases=True):
            unmet.append(f"{req.name} {have} (vLLM asks {req.specifier})")
    return "; ".join(unmet) or "all met"
step("vLLM pins the image does not meet", pins)
'''


def report(python: str = sys.executable) -> int:
    """Import, step by step, what the checks need, each failure with where it happened; returns the exit code."""
    return subprocess.run([python, "-c", REPORT], env=run_env()).returncode


if __name__ == "__main__":
    sys.exit(report())
