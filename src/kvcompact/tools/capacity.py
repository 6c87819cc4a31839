"""``kvcompact plan``: capacity arithmetic for one model on one memory size, with and without compression.

Why: before rolling compression out an operator wants the numbers a senior engineer would do on a napkin:
how many KV bytes one token costs, what pool is left after the weights, how long a single trace can grow
with full attention, and what changes when every compressed request holds at most
``ceil((budget + divide_length) / block_size)`` blocks. With full attention the pool bounds the trace; with
compression only the context (``--max-model-len``) does. The options carry vLLM's names and meanings, so the
numbers are those of the server started with the same flags.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from dataclasses import asdict, dataclass
from typing import Any, NoReturn

from kvcompact.config import KVCompactConfig
from kvcompact.ledger import blocks_held, trigger
from kvcompact.tools.kv_bytes import MODEL_DTYPE_BYTES, VLLM_KV_CACHE_DTYPES, KVDtypeError, KVShape

# What vLLM keeps off the KV pool besides weights: CUDA context, the activation peak of its profiling run
# (max_num_batched_tokens), CUDA graphs and allocator slack. vLLM measures this at start-up; 1 GiB is a
# planning figure for a ~30B model at default settings (on CPU, pass --overhead 0 --gpu-memory-utilization 1
# and the VLLM_CPU_KVCACHE_SPACE size as --memory, since that pool is sized directly).
DEFAULT_OVERHEAD = 2**30
DEFAULT_UTILIZATION = 0.9  # vLLM's --gpu-memory-utilization default: 10% of the device is never used
DEFAULT_BLOCK_SIZE = 16    # vLLM's default --block-size (CacheConfig.DEFAULT_BLOCK_SIZE)
DIVIDE_LENGTH = KVCompactConfig.divide_length  # the default: the one in the config
DTYPES = ("auto", "half", "float16", "bfloat16", "float", "float32")  # vLLM's --dtype choices
_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


class PlanError(ValueError):
    """Bad input (a size, a flag's value, a model config): one clear line naming it, exit code 1."""


def parse_size(text: str) -> int:
    """'24GiB' -> 25769803776, '24GB' -> 24e9, '1.5e9' -> bytes. Binary and decimal units both exist in the
    wild (a '24 GB' card has 24 GiB), so the unit is explicit rather than guessed."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][0-9]+)?)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).lower() not in _UNITS:
        raise PlanError(f"cannot read size {text!r}; use e.g. 24GiB, 80GB, 512MiB")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


@dataclass(frozen=True)
class ModelShape:
    """The config fields that decide KV size and (when no count is given) the parameter count."""

    kv: KVShape
    heads: int
    hidden: int
    intermediate: int
    vocab: int
    tied_embeddings: bool
    max_context: int
    dtype: str  # what vLLM's --dtype auto serves this checkpoint in

    @classmethod
    def from_hf(cls, config: Any) -> ModelShape:
        """From a transformers config object (``AutoConfig``): the text config of a multimodal model."""
        text = config.get_text_config()
        hidden = int(text.hidden_size)
        # vLLM's --dtype auto keeps a 16-bit checkpoint's dtype and serves an fp32 one (or one that records
        # none) in the GPU's preferred 16-bit type, bf16
        dtype = str(getattr(config, "dtype", None) or "").removeprefix("torch.")
        return cls(kv=KVShape.of(config), heads=int(text.num_attention_heads), hidden=hidden,
                   intermediate=int(getattr(text, "intermediate_size", None) or 4 * hidden),
                   vocab=int(getattr(text, "vocab_size", None) or 0),
                   tied_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
                   max_context=int(getattr(text, "max_position_embeddings", None) or 0),
                   dtype=dtype if dtype in ("float16", "bfloat16") else "bfloat16")

    def estimate_params(self) -> int:
        """Dense decoder: q/o projections, k/v projections, a gated MLP (3 matrices) per layer, plus the
        embeddings and the LM head unless tied. Norms and biases are < 0.1% and left out. MoE configs need
        an explicit --params."""
        kv = self.kv
        attention = 2 * self.hidden * self.heads * kv.head_dim + 2 * self.hidden * kv.kv_heads * kv.head_dim
        mlp = 3 * self.hidden * self.intermediate
        embeddings = self.vocab * self.hidden * (1 if self.tied_embeddings else 2)
        return kv.layers * (attention + mlp) + embeddings


def load_shape(model: str) -> ModelShape:
    """The model's shape from its config.json (a folder, or a hub id when the hub is reachable)."""
    from transformers import AutoConfig

    try:
        return ModelShape.from_hf(AutoConfig.from_pretrained(model))
    except (OSError, ValueError, KeyError, AttributeError, TypeError) as e:
        raise PlanError(f"--model {model}: cannot read its config ({' '.join(str(e).split())[:300]})") from None


@dataclass(frozen=True)
class Plan:
    kv_bytes_per_token: int
    params: int
    weight_bytes: int
    overhead_bytes: int
    block_size: int
    pool_bytes: int
    pool_blocks: int             # usable blocks (vLLM keeps one as its null block)
    pool_tokens: int
    max_model_len: int
    budget: int | None
    compressed_blocks: int | None  # most blocks one compressed request holds: ceil((budget + divide) / block)
    compressed_tokens: int | None
    max_num_seqs: int
    longest_full: int
    longest_compressed: int | None
    compressed_at_once: int | None
    length: int | None
    fits_full: int | None
    fits_compressed: int | None


def make_plan(shape: ModelShape, memory: int, *, params: int | None = None, weight_bits: float | None = None,
              dtype: str = "auto", kv_cache_dtype: str = "auto", budget: int | None = None,
              max_num_seqs: int = 1, length: int | None = None, overhead: int = DEFAULT_OVERHEAD,
              gpu_memory_utilization: float = DEFAULT_UTILIZATION, divide_length: int = DIVIDE_LENGTH,
              block_size: int = DEFAULT_BLOCK_SIZE, max_model_len: int | None = None) -> Plan:
    """Pool = memory * utilization - weights - overhead, in whole blocks. The longest trace is per request when
    ``max_num_seqs`` requests share the pool; ``fits_*`` is how many requests of ``length`` tokens fit."""
    model_dtype = shape.dtype if dtype == "auto" else dtype
    try:
        bpt = shape.kv.bytes_per_token(model_dtype, kv_cache_dtype)
    except KVDtypeError as e:
        raise PlanError(str(e)) from None
    params = params or shape.estimate_params()
    weight_bytes = int(params * (weight_bits or 8 * MODEL_DTYPE_BYTES[model_dtype]) / 8)
    context = max_model_len or shape.max_context
    if not context:
        raise PlanError("the model's config records no max_position_embeddings: pass --max-model-len")
    if budget and trigger(budget, divide_length) > context:
        raise PlanError(f"--budget {budget} + --divide-length {divide_length} exceeds the context "
                        f"(--max-model-len {context}): no request would ever reach a compaction round")
    usable = int(memory * gpu_memory_utilization)
    pool = usable - weight_bytes - overhead
    blocks = pool // (block_size * bpt) - 1  # vLLM's block pool keeps one block as its null block
    if blocks < 1:
        gib = lambda n: f"{n / 2**30:.2f} GiB"  # noqa: E731
        raise PlanError(f"no KV pool: the weights ({gib(weight_bytes)}) and the overhead ({gib(overhead)}) fill "
                        f"--memory x --gpu-memory-utilization ({gib(usable)}); lower --weight-bits, --overhead, "
                        "or use a larger --memory")
    per_request = blocks // max_num_seqs * block_size
    held = blocks_held(trigger(budget, divide_length), block_size) if budget else None
    longest_compressed = at_once = None
    if held is not None:  # compression caps each request's cache; then only the context bounds the trace
        longest_compressed = context if blocks // max_num_seqs >= held else per_request
        at_once = blocks // held
    fits_full = blocks // math.ceil(length / block_size) if length else None
    fits_compressed = blocks // min(math.ceil(length / block_size), held) if length and held else None
    return Plan(bpt, params, weight_bytes, overhead, block_size, pool, blocks, blocks * block_size, context, budget,
                held, held * block_size if held else None, max_num_seqs, min(per_request, context),
                longest_compressed, at_once, length, fits_full, fits_compressed)


def format_plan(plan: Plan) -> str:
    gib = lambda n: f"{n / 2**30:.2f} GiB"  # noqa: E731
    lines = [f"KV cache: {plan.kv_bytes_per_token:,} bytes per token ({plan.kv_bytes_per_token / 2**10:.0f} KiB)",
             f"weights: {plan.params / 1e9:.1f}B params = {gib(plan.weight_bytes)}; "
             f"overhead {gib(plan.overhead_bytes)}",
             f"KV pool: {gib(plan.pool_bytes)} = {plan.pool_blocks:,} blocks of {plan.block_size} = "
             f"{plan.pool_tokens:,} tokens",
             f"full attention: longest trace {plan.longest_full:,} tokens"
             + (f" with {plan.max_num_seqs} concurrent" if plan.max_num_seqs > 1 else "")
             + (" (context limit)" if plan.longest_full == plan.max_model_len else " (pool runs out)")]
    if plan.budget and plan.compressed_tokens is not None and plan.longest_compressed is not None:
        bounded = plan.pool_blocks // plan.max_num_seqs >= (plan.compressed_blocks or 0)
        lines.append(f"compressed at budget {plan.budget}: each request holds <= {plan.compressed_blocks} blocks "
                     f"({plan.compressed_tokens:,} tokens); longest trace {plan.longest_compressed:,}"
                     + (" (bounded by the context, not by KV)" if bounded else " (pool runs out)"))
        lines.append(f"compressed requests that run at once, whatever their length: {plan.compressed_at_once:,} "
                     "(admission 'guaranteed' admits no more, so none is ever preempted)")
        lines.append(f"budget_mode pressure with floor {plan.budget}: the same admission and the same requests at "
                     "once; each keeps every token (the full-attention lines above) until the pool is short, then "
                     "shrinks, never below the floor")
    if plan.length:
        lines.append(f"requests of {plan.length:,} tokens that fit at once: {plan.fits_full} with full attention"
                     + (f", {plan.fits_compressed} compressed" if plan.fits_compressed is not None else ""))
    return "\n".join(lines)


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # one line and exit 1, like every other bad input
        raise PlanError(message)


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text!r}") from None
    if not 0 < value < math.inf:
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text}")
    return value


def _fraction(text: str) -> float:
    value = _positive_float(text)
    if value > 1:
        raise argparse.ArgumentTypeError(f"must be in (0, 1] (a fraction of --memory), got {text}")
    return value


def _weight_bits(text: str) -> float:
    value = _positive_float(text)
    if value > 32:
        raise argparse.ArgumentTypeError(f"must be in (0, 32], got {text}")
    return value


def _size(text: str) -> int:
    try:
        return parse_size(text)
    except PlanError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _positive_size(text: str) -> int:
    value = _size(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be more than 0 bytes, got {text!r}")
    return value


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="kvcompact plan", description="KV capacity with and without compression; the options that "
                "vLLM has too carry vLLM's names and defaults.")
    p.add_argument("--model", required=True, help="the model folder (or hub id): its config.json is read with "
                   "transformers' AutoConfig")
    p.add_argument("--memory", required=True, type=_positive_size, help="device memory, e.g. 24GiB")
    p.add_argument("--gpu-memory-utilization", type=_fraction, default=DEFAULT_UTILIZATION,
                   help="vLLM's fraction of --memory it may use")
    p.add_argument("--dtype", choices=DTYPES, default="auto",
                   help="model dtype; auto: the checkpoint's, an fp32 one in bfloat16 (as vLLM on a GPU)")
    p.add_argument("--kv-cache-dtype", choices=VLLM_KV_CACHE_DTYPES, default="auto",
                   help="vLLM's KV cache format (auto: the model dtype)")
    p.add_argument("--block-size", type=_positive_int, default=DEFAULT_BLOCK_SIZE, help="tokens per KV block")
    p.add_argument("--max-model-len", type=_positive_int, help="context length (default: the model's)")
    p.add_argument("--max-num-seqs", type=_positive_int, default=1, help="requests sharing the pool")
    p.add_argument("--params", type=_positive_float, help="parameter count (default: estimated from the config)")
    p.add_argument("--weight-bits", type=_weight_bits, help="bits per weight (default: the model dtype's; 4 for "
                   "AWQ/GPTQ)")
    p.add_argument("--budget", type=_positive_int, help="kvcompact budget (tokens kept per request)")
    p.add_argument("--divide-length", type=_positive_int, default=DIVIDE_LENGTH)
    p.add_argument("--length", type=_positive_int, help="tokens per request, to count how many fit at once")
    p.add_argument("--overhead", type=_size, default=DEFAULT_OVERHEAD,
                   help="non-KV memory besides weights (default 1GiB)")
    p.add_argument("--json", action="store_true")
    return p


def main(argv: list[str] | None = None) -> int:
    """CLI entry: print the plan; 0 on success, 1 with a one-line message on bad input."""
    try:
        args = build_parser().parse_args(argv)
        plan = make_plan(load_shape(args.model), args.memory, params=int(args.params) if args.params else None,
                         weight_bits=args.weight_bits, dtype=args.dtype, kv_cache_dtype=args.kv_cache_dtype,
                         budget=args.budget, max_num_seqs=args.max_num_seqs, length=args.length,
                         overhead=args.overhead, gpu_memory_utilization=args.gpu_memory_utilization,
                         divide_length=args.divide_length, block_size=args.block_size,
                         max_model_len=args.max_model_len)
    except SystemExit as e:  # --help
        return int(e.code or 0)
    except PlanError as e:
        print(f"kvcompact plan: error: {e}", file=sys.stderr)
        return 1
    print(json.dumps(asdict(plan), indent=2) if args.json else format_plan(plan))
    return 0
