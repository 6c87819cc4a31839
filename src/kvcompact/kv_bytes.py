"""How many bytes one token's K and V take: the one formula ``kvcompact capacity``, the ``kvcompact:block_bytes``
gauge, the local engine and the benchmarks share, so a pool sized in one place is the pool counted in another.
Torch-free, so ``kvcompact capacity`` runs in an install without torch.

The model's shape comes from its transformers config (``AutoConfig``), read the way vLLM reads it: the text
config of a multimodal model, ``num_key_value_heads`` absent meaning one KV head per query head, ``head_dim``
absent meaning ``hidden_size / num_attention_heads``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

# vLLM's --dtype names for the model's float types (``auto`` is resolved by the caller: it depends on the config).
MODEL_DTYPE_BYTES = {"float32": 4, "float": 4, "bfloat16": 2, "float16": 2, "half": 2}
# Every --kv-cache-dtype vLLM 0.32 accepts (vllm.config.cache.CacheDType; tests/unit/test_capacity.py checks the
# two agree).
VLLM_KV_CACHE_DTYPES = ("auto", "float16", "bfloat16", "fp8", "fp8_e4m3", "fp8_e5m2", "fp8_inc", "fp8_ds_mla",
                        "nvfp4_ds_mla", "turboquant_k8v4", "turboquant_4bit_nc", "turboquant_k3v4_nc",
                        "turboquant_3bit_nc", "ultraquant_4bit", "int4_per_token_head", "int8_per_token_head",
                        "fp8_per_token_head", "nvfp4", "nvfp4_4over6")
# The KV cache formats kvcompact reads (kvcompact.vllm.kv_layout.make_key_reader; "auto" is the model dtype), with their
# bytes per element. vLLM's other formats pack sub-byte values with scales in backend-specific layouts, and
# kvcompact refuses them at start-up.
KV_CACHE_DTYPE_BYTES = {"float16": 2, "bfloat16": 2, "fp8": 1, "fp8_e4m3": 1, "fp8_e5m2": 1}


class KVDtypeError(ValueError):
    """A KV cache dtype kvcompact cannot size (and refuses to run on)."""


def kv_element_bytes(model_dtype: str, kv_cache_dtype: str = "auto") -> int:
    """Bytes of one cached K or V element: the model dtype for ``auto``, else the cache format's own size."""
    if kv_cache_dtype == "auto":
        return MODEL_DTYPE_BYTES[model_dtype]
    if kv_cache_dtype not in KV_CACHE_DTYPE_BYTES:
        raise KVDtypeError(f"--kv-cache-dtype {kv_cache_dtype}: kvcompact reads only a cache in the model dtype "
                           f"(auto) or {', '.join(KV_CACHE_DTYPE_BYTES)}, and refuses any other format at start-up")
    return KV_CACHE_DTYPE_BYTES[kv_cache_dtype]


@dataclass(frozen=True)
class KVShape:
    """What decides a token's KV size: layers, KV heads per layer and the head dimension."""

    layers: int
    kv_heads: int
    head_dim: int

    @classmethod
    def of(cls, config: Any) -> KVShape:
        """From a transformers config object (its text config, for a multimodal model)."""
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        kv_heads = getattr(text, "num_key_value_heads", None) or text.num_attention_heads  # absent: MHA
        return cls(int(text.num_hidden_layers), int(kv_heads), head_dim_of(text))

    def bytes_per_token(self, model_dtype: str, kv_cache_dtype: str = "auto") -> int:
        """One K row and one V row per layer per KV head."""
        return 2 * self.layers * self.kv_heads * self.head_dim * kv_element_bytes(model_dtype, kv_cache_dtype)


def head_dim_of(config: Any) -> int:
    """A config's head dimension: ``head_dim``, or ``hidden_size / num_attention_heads`` when absent."""
    head_dim = getattr(config, "head_dim", None)
    if not head_dim:
        head_dim = config.hidden_size // config.num_attention_heads
    return int(head_dim)


def kv_bytes_per_token(model: str | Path, dtype: str, kv_cache_dtype: str = "auto") -> int:
    """Bytes one token's K and V take over all layers of ``model`` (a transformers folder or hub id)."""
    from transformers import AutoConfig

    return KVShape.of(AutoConfig.from_pretrained(str(model))).bytes_per_token(dtype, kv_cache_dtype)


__all__ = ["KVShape", "KVDtypeError", "head_dim_of", "KV_CACHE_DTYPE_BYTES", "MODEL_DTYPE_BYTES",
           "VLLM_KV_CACHE_DTYPES", "kv_bytes_per_token", "kv_element_bytes"]
