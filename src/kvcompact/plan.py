"""``kvcompact plan``: capacity arithmetic for one model on one memory size, with and without compression.

Why: before rolling compression out an operator wants the numbers a senior engineer would do on a napkin:
how many KV bytes one token costs, what pool is left after the weights, how long a single trace can grow
with full attention, and what changes when every compressed request holds at most ``budget + divide_length``
tokens. With full attention the pool bounds the trace; with compression only the model's context does.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from dataclasses import asdict, dataclass

from kvcompact.config import KVCompactConfig

KV_DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2, "fp8": 1}
# What vLLM keeps off the KV pool besides weights: CUDA context, the activation peak of its profiling run
# (max_num_batched_tokens), CUDA graphs and allocator slack. vLLM measures this at start-up; 1 GiB is a
# planning figure for a ~30B model at default settings (on CPU, pass --overhead 0 --utilization 1 and the
# VLLM_CPU_KVCACHE_SPACE size as --memory, since that pool is sized directly).
DEFAULT_OVERHEAD = 2**30
DEFAULT_UTILIZATION = 0.9  # vLLM's --gpu-memory-utilization default: 10% of the device is never used
DIVIDE_LENGTH = KVCompactConfig.divide_length  # the default: the one in the config
_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


class PlanError(ValueError):
    """Bad input (size string, config.json missing a field): one clear line, exit code 1."""


def parse_size(text: str) -> int:
    """'24GiB' -> 25769803776, '24GB' -> 24e9, '1.5e9' -> bytes. Binary and decimal units both exist in the
    wild (a '24 GB' card has 24 GiB), so the unit is explicit rather than guessed."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][0-9]+)?)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).lower() not in _UNITS:
        raise PlanError(f"cannot read size {text!r}; use e.g. 24GiB, 80GB, 512MiB")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


@dataclass(frozen=True)
class ModelShape:
    """The config.json fields that decide KV size and (when no count is given) the parameter count."""

    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    hidden: int
    intermediate: int
    vocab: int
    tied_embeddings: bool
    max_context: int

    @classmethod
    def from_config(cls, config: dict) -> ModelShape:
        if not isinstance(config, dict):
            raise PlanError("config.json is not a JSON object")
        config = config.get("text_config", config)  # multimodal configs nest the language model
        try:
            heads, hidden = int(config["num_attention_heads"]), int(config["hidden_size"])
            return cls(layers=int(config["num_hidden_layers"]), heads=heads,
                       kv_heads=int(config.get("num_key_value_heads") or heads),  # HF: absent means MHA
                       head_dim=int(config.get("head_dim") or hidden // heads), hidden=hidden,
                       intermediate=int(config.get("intermediate_size", 4 * hidden)),
                       vocab=int(config.get("vocab_size", 0)),
                       tied_embeddings=bool(config.get("tie_word_embeddings", False)),
                       max_context=int(config.get("max_position_embeddings", 0)))
        except KeyError as e:
            raise PlanError(f"config.json has no {e.args[0]!r}: not a decoder-only transformer config?") from None

    def estimate_params(self) -> int:
        """Dense decoder: q/o projections, k/v projections, a gated MLP (3 matrices) per layer, plus the
        embeddings and the LM head unless tied. Norms and biases are < 0.1% and left out. MoE configs need
        an explicit --params."""
        attention = 2 * self.hidden * self.heads * self.head_dim + 2 * self.hidden * self.kv_heads * self.head_dim
        mlp = 3 * self.hidden * self.intermediate
        embeddings = self.vocab * self.hidden * (1 if self.tied_embeddings else 2)
        return self.layers * (attention + mlp) + embeddings


def kv_bytes_per_token(shape: ModelShape, kv_dtype: str = "bf16") -> int:
    """One K row and one V row per layer per KV head: 2 * layers * kv_heads * head_dim * dtype bytes."""
    return 2 * shape.layers * shape.kv_heads * shape.head_dim * KV_DTYPE_BYTES[kv_dtype]


@dataclass(frozen=True)
class Plan:
    kv_bytes_per_token: int
    params: int
    weight_bytes: int
    overhead_bytes: int
    pool_bytes: int
    pool_tokens: int
    max_context: int
    budget: int | None
    compressed_tokens: int | None  # most tokens one compressed request holds: budget + divide_length
    concurrency: int
    longest_full: int
    longest_compressed: int | None
    length: int | None
    fits_full: int | None
    fits_compressed: int | None


def make_plan(shape: ModelShape, memory: int, *, params: int | None = None, weight_bits: float = 16,
              kv_dtype: str = "bf16", budget: int | None = None, concurrency: int = 1, length: int | None = None,
              overhead: int = DEFAULT_OVERHEAD, utilization: float = DEFAULT_UTILIZATION,
              divide_length: int = DIVIDE_LENGTH) -> Plan:
    """Pool = memory * utilization - weights - overhead. The longest trace is per request when
    ``concurrency`` requests share the pool; ``fits_*`` is how many requests of ``length`` tokens fit."""
    bpt = kv_bytes_per_token(shape, kv_dtype)
    params = params or shape.estimate_params()
    weight_bytes = int(params * weight_bits / 8)
    pool = max(0, int(memory * utilization) - weight_bytes - overhead)
    tokens = pool // bpt
    per_request = tokens // concurrency
    held = budget + divide_length if budget else None
    longest_compressed = None
    if held is not None:  # compression caps each request's cache; then only the context bounds the trace
        longest_compressed = shape.max_context if per_request >= held else per_request
    fits_full = tokens // length if length else None
    fits_compressed = tokens // min(length, held) if length and held else None
    return Plan(bpt, params, weight_bytes, overhead, pool, tokens, shape.max_context, budget, held, concurrency,
                min(per_request, shape.max_context or per_request), longest_compressed, length, fits_full,
                fits_compressed)


def format_plan(plan: Plan) -> str:
    gib = lambda n: f"{n / 2**30:.2f} GiB"  # noqa: E731
    lines = [f"KV cache: {plan.kv_bytes_per_token:,} bytes per token ({plan.kv_bytes_per_token / 2**10:.0f} KiB)",
             f"weights: {plan.params / 1e9:.1f}B params = {gib(plan.weight_bytes)}; "
             f"overhead {gib(plan.overhead_bytes)}",
             f"KV pool: {gib(plan.pool_bytes)} = {plan.pool_tokens:,} tokens",
             f"full attention: longest trace {plan.longest_full:,} tokens"
             + (f" with {plan.concurrency} concurrent" if plan.concurrency > 1 else "")
             + (" (context limit)" if plan.longest_full == plan.max_context else " (pool runs out)")]
    if plan.budget and plan.compressed_tokens is not None:
        bounded = plan.pool_tokens // plan.concurrency >= plan.compressed_tokens
        longest = f"{plan.longest_compressed:,}" if plan.longest_compressed else "unlimited"
        lines.append(f"compressed at budget {plan.budget}: each request holds <= {plan.compressed_tokens:,} "
                     f"tokens; longest trace {longest}"
                     + (" (bounded by the model context, not by KV)" if bounded else " (pool runs out)"))
        lines.append(f"compressed requests that run at once, whatever their length: "
                     f"{plan.pool_tokens // plan.compressed_tokens:,} (admission 'guaranteed' admits no more, "
                     "so none is ever preempted)")
    if plan.length:
        lines.append(f"requests of {plan.length:,} tokens that fit at once: {plan.fits_full} with full attention"
                     + (f", {plan.fits_compressed} compressed" if plan.fits_compressed is not None else ""))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """CLI entry: print the plan; 0 on success, 1 with a one-line message on bad input."""
    p = argparse.ArgumentParser(prog="kvcompact plan", description="KV capacity with and without compression.")
    p.add_argument("--config", required=True, help="the model's HF config.json")
    p.add_argument("--memory", required=True, help="device memory, e.g. 24GiB")
    p.add_argument("--params", type=float, help="parameter count (default: estimated from config.json)")
    p.add_argument("--weight-bits", type=float, default=16, help="bits per weight (4 for AWQ/GPTQ)")
    p.add_argument("--kv-dtype", choices=sorted(KV_DTYPE_BYTES), default="bf16")
    p.add_argument("--budget", type=int, help="kvcompact budget (tokens kept per request)")
    p.add_argument("--divide-length", type=int, default=DIVIDE_LENGTH)
    p.add_argument("--concurrency", type=int, default=1, help="requests sharing the pool")
    p.add_argument("--length", type=int, help="tokens per request, to count how many fit at once")
    p.add_argument("--overhead", default=str(DEFAULT_OVERHEAD), help="non-KV memory besides weights (1GiB)")
    p.add_argument("--utilization", type=float, default=DEFAULT_UTILIZATION, help="vLLM's memory fraction")
    p.add_argument("--json", action="store_true")
    try:
        args = p.parse_args(argv)
    except SystemExit as e:  # --help, or a usage error argparse already explained
        return int(e.code or 0)
    try:
        if args.concurrency < 1 or (args.length is not None and args.length < 1) or (args.budget or 1) < 1:
            raise PlanError("--concurrency, --length and --budget must be positive")
        with open(args.config, encoding="utf-8") as f:
            shape = ModelShape.from_config(json.load(f))
        plan = make_plan(shape, parse_size(args.memory), params=int(args.params) if args.params else None,
                         weight_bits=args.weight_bits, kv_dtype=args.kv_dtype, budget=args.budget,
                         concurrency=args.concurrency, length=args.length, overhead=parse_size(args.overhead),
                         utilization=args.utilization, divide_length=args.divide_length)
    except (PlanError, OSError, ValueError) as e:
        print(f"kvcompact plan: error: {e}", file=sys.stderr)
        return 1
    print(json.dumps(asdict(plan), indent=2) if args.json else format_plan(plan))
    return 0
