"""``kvcompact capacity``: capacity arithmetic for one model on one memory size, with and without compression.

Why: before rolling compression out an operator wants the numbers a senior engineer would do on a napkin:
how many KV bytes one token costs, what pool is left after the weights, how long a single trace can grow
with full attention, and what changes when every compressed request holds at most
``ceil((budget + divide_length) / block_size)`` blocks. With full attention the pool bounds the trace; with
compression only the context (``--max-model-len``) does. The options carry vLLM's names, spellings and defaults
(``--max_model_len``, ``32k``, ``-tp 2``, ``80G``, ``--max-num-seqs`` 256 or 1024 by device memory), and the
kvcompact settings are validated by :class:`~kvcompact.config.KVCompactConfig`, so the numbers are those of the
server started with the same flags, and a setting the server refuses is refused here. Every bad input exits 2 with
one line naming it, as ``kvcompact serve`` does.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from dataclasses import asdict, dataclass
from typing import Any, NoReturn

from kvcompact.config import ConfigError, KVCompactConfig
from kvcompact.kv_bytes import MODEL_DTYPE_BYTES, VLLM_KV_CACHE_DTYPES, KVDtypeError, KVShape
from kvcompact.ledger import blocks_held, growth, trigger
from kvcompact.tools.cli import EXIT_USAGE, UsageError

# What vLLM keeps off the KV pool besides weights: CUDA context, the activation peak of its profiling run
# (max_num_batched_tokens), CUDA graphs and allocator slack. vLLM measures this at start-up; 1 GiB is a
# planning figure for a ~30B model at default settings (on CPU, pass --overhead 0 --gpu-memory-utilization 1
# and the VLLM_CPU_KVCACHE_SPACE size as --memory, since that pool is sized directly).
DEFAULT_OVERHEAD = 2**30
DEFAULT_UTILIZATION = 0.9  # vLLM's --gpu-memory-utilization default: 10% of the device is never used
DEFAULT_BLOCK_SIZE = 16    # vLLM's default --block-size (CacheConfig.DEFAULT_BLOCK_SIZE)
DIVIDE_LENGTH = KVCompactConfig.divide_length  # the default: the one in the config
DTYPES = ("auto", "half", "float16", "bfloat16", "float", "float32")  # vLLM's --dtype choices
# Units of a size: written out (case-insensitive), and vLLM's one-letter suffixes (vllm.utils.argparse_utils.
# human_readable_int, case-sensitive: k/m/g/t decimal, K/M/G/T binary; "80G" is 80 GiB, as in vLLM's
# --kv-cache-memory-bytes 80G).
_UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
_SUFFIXES = {"k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}
# vLLM 0.32's --max-num-seqs default for its OpenAI server on a GPU (EngineArgs._get_default_max_num_seqs...):
# 1024 from 70 GiB of device memory (H100, H200, B200; an A100-80GB keeps 256), else 256.
DEFAULT_MAX_NUM_SEQS, LARGE_GPU_MAX_NUM_SEQS, LARGE_GPU_MEMORY = 256, 1024, 70 * 2**30


class PlanError(UsageError):
    """Bad input (a size, a flag's value, a model config): one clear line naming it, exit code 2."""


def parse_size(text: str) -> int:
    """'24GiB' -> 25769803776, '24GB' -> 24e9, '80G' -> 80 GiB (vLLM's suffix), '0' -> 0. Binary and decimal
    units both exist in the wild (a '24 GB' card has 24 GiB), so a size other than 0 needs its unit: a bare 80
    would be 80 bytes."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][0-9]+)?)\s*([a-zA-Z]*)\s*", text)
    unit = m.group(2) if m else ""
    scale = _SUFFIXES.get(unit) or _UNITS.get(unit.lower()) if m else None
    if m and not unit and float(m.group(1)) == 0:
        return 0
    if not m or scale is None:
        hint = f"; a bare number is bytes nowhere here: did you mean {text.strip()}GiB?" if m and not unit else ""
        raise PlanError(f"cannot read size {text!r}; use e.g. 24GiB, 80GB, 80G (vLLM's GiB), 512MiB{hint}")
    return int(float(m.group(1)) * scale)


def parse_tokens(text: str) -> int:
    """A token count as vLLM's ``--max-model-len`` reads it (human_readable_int): 32768, '32k' (32,000) or
    '32K' (32,768); decimals only with a decimal suffix ('25.6k')."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)([kKmMgGtT]?)\s*", text)
    if not m or ("." in m.group(1) and (not m.group(2) or m.group(2).isupper())):
        raise PlanError(f"must be a positive integer, optionally with k/m (x1000) or K/M (x1024), got {text!r}")
    value = int(float(m.group(1)) * _SUFFIXES.get(m.group(2), 1)) if m.group(2) else int(m.group(1))
    if value < 1:
        raise PlanError(f"must be a positive integer, got {text!r}")
    return value


def default_max_num_seqs(memory: int) -> int:
    """vLLM's --max-num-seqs default for a GPU with ``memory`` bytes (its OpenAI server)."""
    return LARGE_GPU_MAX_NUM_SEQS if memory >= LARGE_GPU_MEMORY else DEFAULT_MAX_NUM_SEQS


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
    context_factor: float = 1.0  # a RoPE scaling factor vLLM multiplies max_position_embeddings by (YaRN, linear)

    @classmethod
    def from_hf(cls, config: Any) -> ModelShape:
        """From a transformers config object (``AutoConfig``): the text config of a multimodal model."""
        text = config.get_text_config()
        hidden = int(text.hidden_size)
        # vLLM's --dtype auto keeps a 16-bit checkpoint's dtype and serves an fp32 one (or one that records
        # none) in the GPU's preferred 16-bit type, bf16
        dtype = str(getattr(config, "dtype", None) or "").removeprefix("torch.")
        rope = getattr(text, "rope_parameters", None) or getattr(text, "rope_scaling", None) or {}
        kind = rope.get("rope_type", rope.get("type")) if isinstance(rope, dict) else None
        # vLLM's _get_and_verify_max_len: these RoPE types stretch the context by their factor
        factor = float(rope.get("factor") or 1.0) if kind in ("yarn", "linear", "dynamic") else 1.0
        return cls(kv=KVShape.of(config), heads=int(text.num_attention_heads), hidden=hidden,
                   intermediate=int(getattr(text, "intermediate_size", None) or 4 * hidden),
                   vocab=int(getattr(text, "vocab_size", None) or 0),
                   tied_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
                   max_context=int(getattr(text, "max_position_embeddings", None) or 0),
                   dtype=dtype if dtype in ("float16", "bfloat16") else "bfloat16", context_factor=factor)

    @property
    def context_limit(self) -> int:
        """The longest --max-model-len vLLM accepts for this model (without VLLM_ALLOW_LONG_MAX_MODEL_LEN)."""
        return int(self.max_context * self.context_factor)

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
    compressed_at_once: int | None  # min(the pool's count, max_num_seqs): vLLM never runs more than its cap
    compressed_pool_fits: int | None  # compressed requests the pool alone would hold at once
    tensor_parallel_size: int
    pipeline_parallel_size: int
    length: int | None
    fits_full: int | None
    fits_compressed: int | None
    budget_ratio: float = 0.0  # the budget grows to this share of a long answer (0: a fixed budget)


def make_plan(shape: ModelShape, memory: int, *, params: int | None = None, weight_bits: float | None = None,
              dtype: str = "auto", kv_cache_dtype: str = "auto", budget: int | None = None,
              max_num_seqs: int = 1, length: int | None = None, overhead: int = DEFAULT_OVERHEAD,
              gpu_memory_utilization: float = DEFAULT_UTILIZATION, divide_length: int = DIVIDE_LENGTH,
              block_size: int = DEFAULT_BLOCK_SIZE, max_model_len: int | None = None,
              tensor_parallel_size: int = 1, pipeline_parallel_size: int = 1, budget_ratio: float = 0.0) -> Plan:
    """Pool = memory * utilization - weights - overhead, in whole blocks, on each of the
    ``tensor_parallel_size x pipeline_parallel_size`` devices (``memory`` is one device's): each holds its share
    of the weights and, per token, its stage's layers and its rank's KV heads (vLLM replicates a KV head over
    ranks when there are fewer heads than ranks). The longest trace is per request when ``max_num_seqs`` requests
    share the pool; ``fits_*`` is how many requests of ``length`` tokens fit. With ``budget_ratio`` a request of
    L tokens keeps up to ``budget_ratio * L`` of them (``ledger.growth``, counting all L as generated: an upper
    bound), so what one holds is sized at the length in question, the context limit when none is given."""
    model_dtype = shape.dtype if dtype == "auto" else dtype
    tp, pp = tensor_parallel_size, pipeline_parallel_size
    kv = shape.kv
    if shape.heads % tp:
        raise PlanError(f"-tp {tp}: the model's {shape.heads} attention heads are not divisible by it (vLLM "
                        "refuses it too)")
    if kv.kv_heads % tp and tp % kv.kv_heads:
        raise PlanError(f"-tp {tp}: the model's {kv.kv_heads} KV heads neither divide nor are divided by it")
    if pp > kv.layers:
        raise PlanError(f"-pp {pp}: more pipeline stages than the model's {kv.layers} layers")
    rank_kv = KVShape(-(-kv.layers // pp), max(1, kv.kv_heads // tp), kv.head_dim)  # the fullest device's share
    try:
        bpt = kv.bytes_per_token(model_dtype, kv_cache_dtype)
        rank_bpt = rank_kv.bytes_per_token(model_dtype, kv_cache_dtype)
    except KVDtypeError as e:
        raise PlanError(str(e)) from None
    params = params or shape.estimate_params()
    weight_bytes = int(params * (weight_bits or 8 * MODEL_DTYPE_BYTES[model_dtype]) / 8)
    context = max_model_len or shape.context_limit
    if not context:
        raise PlanError("the model's config records no max_position_embeddings: pass --max-model-len")
    if shape.context_limit and context > shape.context_limit:
        raise PlanError(f"--max-model-len {context} exceeds the model's context ({shape.context_limit}: "
                        "max_position_embeddings" + (f" x RoPE factor {shape.context_factor:g}"
                                                     if shape.context_factor != 1 else "")
                        + "); vLLM refuses it too")
    if budget and trigger(budget, divide_length) > context:
        raise PlanError(f"--budget {budget} + --divide-length {divide_length} exceeds the context "
                        f"(--max-model-len {context}): no request would ever reach a compaction round")
    usable = int(memory * gpu_memory_utilization)
    device_weights = weight_bytes // (tp * pp)
    pool = usable - device_weights - overhead
    blocks = pool // (block_size * rank_bpt) - 1  # vLLM's block pool keeps one block as its null block
    if blocks < 1:
        gib = lambda n: f"{n / 2**30:.2f} GiB"  # noqa: E731
        raise PlanError(f"no KV pool: the weights ({gib(device_weights)} per device) and the overhead "
                        f"({gib(overhead)}) fill --memory x --gpu-memory-utilization ({gib(usable)}); lower "
                        "--weight-bits or --overhead, use a larger --memory, or more devices (-tp)")
    per_request = blocks // max_num_seqs * block_size

    base = budget or 0

    def held_at(tokens: int) -> int:  # the most blocks one compressed request of ``tokens`` tokens holds
        return blocks_held(trigger(base + growth(base, budget_ratio, tokens), divide_length), block_size)

    held = held_at(context) if budget else None
    longest_compressed = at_once = pool_fits = None
    if held is not None:  # compression caps each request's cache; then only the context bounds the trace
        share = blocks // max_num_seqs
        longest_compressed = context if share >= held else per_request
        if share < held and budget_ratio and share * block_size >= trigger(base, divide_length):
            # a growing budget fills the share at ratio * L + divide_length = the share's tokens
            longest_compressed = max(per_request, math.floor((share * block_size - divide_length) / budget_ratio))
        pool_fits = blocks // held
        at_once = min(pool_fits, max_num_seqs)
    fits_full = min(blocks // math.ceil(length / block_size), max_num_seqs) if length else None
    fits_compressed = (min(blocks // min(math.ceil(length / block_size), held_at(length)), max_num_seqs)
                       if length and held else None)
    return Plan(bpt, params, weight_bytes, overhead, block_size, pool, blocks, blocks * block_size, context, budget,
                held, held * block_size if held else None, max_num_seqs, min(per_request, context),
                longest_compressed, at_once, pool_fits, tp, pp, length, fits_full, fits_compressed, budget_ratio)


def format_plan(plan: Plan) -> str:
    gib = lambda n: f"{n / 2**30:.2f} GiB"  # noqa: E731
    devices = plan.tensor_parallel_size * plan.pipeline_parallel_size
    each = f" per device ({plan.tensor_parallel_size} TP x {plan.pipeline_parallel_size} PP)" if devices > 1 else ""
    lines = [f"KV cache: {plan.kv_bytes_per_token:,} bytes per token ({plan.kv_bytes_per_token / 2**10:.0f} KiB)"
             + (f", split over {devices} devices" if devices > 1 else ""),
             f"weights: {plan.params / 1e9:.1f}B params = {gib(plan.weight_bytes)}; "
             f"overhead {gib(plan.overhead_bytes)}" + (" per device" if devices > 1 else ""),
             f"KV pool{each}: {gib(plan.pool_bytes)} = {plan.pool_blocks:,} blocks of {plan.block_size} = "
             f"{plan.pool_tokens:,} tokens",
             f"full attention: longest trace {plan.longest_full:,} tokens"
             + (f" each with {plan.max_num_seqs} running (--max-num-seqs)" if plan.max_num_seqs > 1 else "")
             + (" (context limit)" if plan.longest_full == plan.max_model_len else " (pool runs out)")]
    if plan.max_num_seqs > 1:
        alone = min(plan.pool_tokens, plan.max_model_len)
        lines.append(f"full attention, one request alone: {alone:,} tokens"
                     + (" (context limit)" if alone == plan.max_model_len else " (pool runs out)"))
    if plan.budget and plan.compressed_tokens is not None and plan.longest_compressed is not None:
        bounded = plan.pool_blocks // plan.max_num_seqs >= (plan.compressed_blocks or 0)
        grows = (f" growing to {plan.budget_ratio:g} of a long answer (--budget-ratio; sized at the context limit)"
                 if plan.budget_ratio else "")
        lines.append(f"compressed at budget {plan.budget}{grows}: each request holds <= {plan.compressed_blocks} "
                     "blocks "
                     f"({plan.compressed_tokens:,} tokens); longest trace {plan.longest_compressed:,}"
                     + (" (bounded by the context, not by KV)" if bounded else " (pool runs out)"))
        capped = plan.compressed_pool_fits is not None and plan.compressed_pool_fits > plan.max_num_seqs
        lines.append(f"compressed requests that run at once, whatever their length: {plan.compressed_at_once:,} "
                     + (f"(--max-num-seqs caps it; the pool holds {plan.compressed_pool_fits:,})" if capped else
                        "(admission 'greedy', which --budget-ratio needs, admits more while they are short; vLLM "
                        "preempts one when they grow)" if plan.budget_ratio else
                        "(admission 'guaranteed' admits no more, so none is ever preempted)"))
        lines.append(f"budget_mode pressure with floor {plan.budget}: the same admission and the same requests at "
                     "once; each keeps every token (the full-attention lines above) until the pool is short, then "
                     "shrinks, never below the floor")
    if plan.length:
        lines.append(f"requests of {plan.length:,} tokens that fit at once: {plan.fits_full} with full attention"
                     + (f", {plan.fits_compressed} compressed" if plan.fits_compressed is not None else "")
                     + f" (at most --max-num-seqs {plan.max_num_seqs})")
    return "\n".join(lines)


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # one line and exit 2, like every other bad input
        raise PlanError(message)


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value


def _tokens(text: str) -> int:
    try:
        return parse_tokens(text)
    except PlanError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


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
    p = _Parser(prog="kvcompact capacity", description="KV capacity with and without compression; the options that "
                "vLLM has too carry vLLM's names, spellings (--max_model_len, -tp, 32k) and defaults.")
    p.add_argument("--model", required=True, help="the model folder (or hub id): its config.json is read with "
                   "transformers' AutoConfig")
    p.add_argument("--memory", required=True, type=_positive_size,
                   help="one device's memory, with its unit: 80GiB, 80G (vLLM's GiB), 80GB (10^9 bytes)")
    p.add_argument("--gpu-memory-utilization", type=_fraction, default=DEFAULT_UTILIZATION,
                   help="vLLM's fraction of --memory it may use (default 0.9)")
    p.add_argument("--tensor-parallel-size", "-tp", type=_positive_int, default=1,
                   help="devices each layer is split over (their KV heads and weights too)")
    p.add_argument("--pipeline-parallel-size", "-pp", type=_positive_int, default=1,
                   help="devices the layers are split over")
    p.add_argument("--dtype", choices=DTYPES, default="auto",
                   help="model dtype; auto: the checkpoint's, an fp32 one in bfloat16 (as vLLM on a GPU)")
    p.add_argument("--kv-cache-dtype", choices=VLLM_KV_CACHE_DTYPES, default="auto",
                   help="vLLM's KV cache format (auto: the model dtype)")
    p.add_argument("--block-size", type=_positive_int, default=DEFAULT_BLOCK_SIZE,
                   help="tokens per KV block (default 16)")
    p.add_argument("--max-model-len", type=_tokens, help="context length, e.g. 32768, 32k or 32K (default: the "
                   "model's; a longer one is refused, as vLLM refuses it)")
    p.add_argument("--max-num-seqs", type=_positive_int, help="vLLM's cap on running requests (default: vLLM's "
                   f"on a GPU: {LARGE_GPU_MAX_NUM_SEQS} from 70 GiB of --memory, else {DEFAULT_MAX_NUM_SEQS})")
    p.add_argument("--params", type=_positive_float, help="parameter count (default: estimated from the config)")
    p.add_argument("--weight-bits", type=_weight_bits, help="bits per weight (default: the model dtype's; 4 for "
                   "AWQ/GPTQ)")
    p.add_argument("--budget", type=_positive_int, help="kvcompact budget (tokens kept per request and KV head)")
    p.add_argument("--budget-ratio", type=float, default=0.0, help="the budget grows to this share of a long "
                   "answer (kvcompact serve --budget-ratio; default 0: a fixed budget)")
    p.add_argument("--divide-length", type=_positive_int, default=DIVIDE_LENGTH,
                   help=f"tokens between compaction rounds (default {DIVIDE_LENGTH})")
    p.add_argument("--window", type=int, default=KVCompactConfig.window,
                   help=f"recent tokens never evicted (default {KVCompactConfig.window}); checked with --budget")
    p.add_argument("--length", type=_positive_int, help="tokens per request, to count how many fit at once")
    p.add_argument("--overhead", type=_size, default=DEFAULT_OVERHEAD,
                   help="non-KV memory per device besides weights (default 1GiB; 0 on CPU)")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    return p


def vllm_spelling(argv: list[str]) -> list[str]:
    """Long options as vLLM's FlexibleArgumentParser reads them: ``--max_model_len`` is ``--max-model-len``."""
    out = []
    for token in argv:
        if token.startswith("--") and "_" in token.partition("=")[0]:
            name, eq, value = token.partition("=")
            token = name.replace("_", "-") + eq + value
        out.append(token)
    return out


def main(argv: list[str] | None = None) -> int:
    """CLI entry: print the plan; 0 on success, 2 with a one-line message on bad input."""
    try:
        args = build_parser().parse_args(vllm_spelling(sys.argv[1:] if argv is None else list(argv)))
        if args.budget_ratio and args.budget is None:
            raise PlanError("--budget-ratio needs --budget (the floor the budget grows from)")
        if args.budget is not None:  # the server's own validation: a budget it would refuse is refused here
            KVCompactConfig(budget=args.budget, divide_length=args.divide_length, window=args.window,
                            budget_ratio=args.budget_ratio, admission="greedy" if args.budget_ratio else "guaranteed")
        seqs = args.max_num_seqs or default_max_num_seqs(args.memory)
        plan = make_plan(load_shape(args.model), args.memory, params=int(args.params) if args.params else None,
                         weight_bits=args.weight_bits, dtype=args.dtype, kv_cache_dtype=args.kv_cache_dtype,
                         budget=args.budget, max_num_seqs=seqs, length=args.length,
                         overhead=args.overhead, gpu_memory_utilization=args.gpu_memory_utilization,
                         divide_length=args.divide_length, block_size=args.block_size,
                         max_model_len=args.max_model_len, tensor_parallel_size=args.tensor_parallel_size,
                         pipeline_parallel_size=args.pipeline_parallel_size, budget_ratio=args.budget_ratio)
    except SystemExit as e:  # --help
        return int(e.code or 0)
    except (PlanError, ConfigError) as e:
        print(f"kvcompact capacity: error: {str(e).removeprefix('kvcompact: ')}", file=sys.stderr)
        return EXIT_USAGE
    print(json.dumps(asdict(plan), indent=2) if args.json else format_plan(plan))
    return 0
