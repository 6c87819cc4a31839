"""Calibrate TriAttention query statistics through transformers.

Forward hooks on each attention module's ``q_proj`` capture every query exactly as RoPE sees it (bias and q-norm
applied, float32, before RoPE: :meth:`_QueryAccumulator.pre_rope_queries`); no attention internals are
reimplemented. The text is read as one long sequence, since the statistics must describe queries deep into a long
context; chunks only bound memory (docs/DESIGN.md, section 4.1).

CLI (or ``python -m kvcompact.tools.calibrate``, the same)::

    kvcompact calibrate DIR --text FILE -o stats.pt [--max-tokens 32768] [--chunk-len 2048] [--sequence-len N]
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import torch

from kvcompact.rope import RopeSpec
from kvcompact.stats import ModelFingerprint, QueryStats


class CalibrationError(RuntimeError):
    """The model's attention modules cannot be hooked the way calibration needs."""


def find_attention_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The attention module of every decoder layer, in layer order (``model.model.layers[i].self_attn``)."""
    backbone = getattr(model, "model", model)
    layers = getattr(backbone, "layers", None)
    if layers is None:
        raise CalibrationError("cannot find the decoder layers (expected model.model.layers)")
    out = []
    for i, layer in enumerate(layers):
        attn = getattr(layer, "self_attn", None)
        if attn is None or not isinstance(getattr(attn, "q_proj", None), torch.nn.Module):
            raise CalibrationError(f"layer {i} has no self_attn.q_proj (fused qkv projections are not supported)")
        if getattr(attn, "q_layernorm", None) is not None:
            raise CalibrationError(f"layer {i}: per-head q_layernorm (StableLM/Phi qk_layernorm) is not supported")
        out.append(attn)
    return out


class _QueryAccumulator:
    """Forward hooks on every layer's q_proj that add band sums into float64 accumulators."""

    def __init__(self, model: torch.nn.Module, rope: RopeSpec, num_heads: int) -> None:
        self.rope = rope
        self.num_heads = num_heads
        self.attn = find_attention_modules(model)
        L, H, F = len(self.attn), num_heads, rope.num_bands
        self.sum_q = torch.zeros(L, H, F, dtype=torch.complex128)
        self.sum_abs = torch.zeros(L, H, F, dtype=torch.float64)
        self.count = torch.zeros(L, dtype=torch.int64)
        self._handles: list[Any] = []

    def pre_rope_queries(self, attn: torch.nn.Module, q: torch.Tensor) -> torch.Tensor:
        """q_proj output [..., H*d] -> [..., H, d] float32, with the module's q-norm applied: after the reshape
        for norms over ``head_dim`` (Qwen3, Gemma), before it for norms over the whole projection (OLMo2)."""
        H, d = self.num_heads, self.rope.head_dim
        if q.shape[-1] != H * d:
            raise CalibrationError(f"q_proj produces {q.shape[-1]} features, expected num_heads*head_dim = "
                                   f"{H}*{d} (gated or fused query projections are not supported)")
        q_norm = getattr(attn, "q_norm", None)
        if q_norm is not None:
            weight = getattr(q_norm, "weight", None)
            if weight is not None and weight.numel() == H * d:  # OLMo2-style: norm over the full projection
                q = q_norm(q)
                return q.reshape(*q.shape[:-1], H, d).float()
            q = q.reshape(*q.shape[:-1], H, d)
            return q_norm(q).float()
        return q.reshape(*q.shape[:-1], H, d).float()

    def _hook(self, layer: int):
        attn = self.attn[layer]

        def hook(_module: torch.nn.Module, _inputs: Any, output: torch.Tensor) -> None:
            with torch.no_grad():
                q = self.pre_rope_queries(attn, output)  # [B, T, H, d]
                z = self.rope.bands(q.double()).reshape(-1, self.num_heads, self.rope.num_bands)
                self.sum_q[layer] += z.sum(dim=0).cpu()
                self.sum_abs[layer] += z.abs().sum(dim=0).cpu()
                self.count[layer] += z.shape[0]

        return hook

    def __enter__(self) -> _QueryAccumulator:
        for i, attn in enumerate(self.attn):
            self._handles.append(attn.q_proj.register_forward_hook(self._hook(i)))
        return self

    def __exit__(self, *exc: Any) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()


def calibrate_model(
    model: torch.nn.Module,
    sequences: Iterable[torch.Tensor] | Sequence[Sequence[int]],
    rope: RopeSpec | None = None,
    model_name: str | None = None,
    progress: bool = True,
    total_tokens: int | None = None,
    info: dict[str, Any] | None = None,
    chunk_len: int | None = None,
) -> QueryStats:
    """Run ``model`` over token-id ``sequences`` (each a 1-D sequence, or [B, T] tensor, starting at position 0)
    and return the stats. A sequence longer than ``chunk_len`` is fed in chunks with its KV cache carried over,
    which computes the same queries as one forward (up to float rounding).

    ``rope`` defaults to :meth:`RopeSpec.from_model` (the model's own rotary module).
    """
    from tqdm.auto import tqdm
    from transformers import DynamicCache

    config = model.config
    rope = rope or RopeSpec.from_model(model)
    fingerprint = ModelFingerprint.from_hf_config(config, model_name=model_name, style=rope.style)
    if fingerprint.rotary_dim != rope.rotary_dim:
        fingerprint = ModelFingerprint(**{**fingerprint.to_dict(), "rotary_dim": rope.rotary_dim})
    device = next(model.parameters()).device
    # the decoder stack alone: queries are all we need, the LM head's logits are not
    backbone = getattr(model, "model", None)
    backbone = backbone if isinstance(backbone, torch.nn.Module) else model
    was_training = model.training
    model.eval()
    bar = tqdm(total=total_tokens, unit="tok", desc="calibrate", disable=not progress, file=sys.stderr)
    try:
        with _QueryAccumulator(model, rope, int(config.num_attention_heads)) as acc, torch.no_grad():
            for sequence in sequences:
                ids = torch.as_tensor(sequence, dtype=torch.long)
                if ids.dim() == 1:
                    ids = ids.unsqueeze(0)
                if ids.numel() == 0:
                    continue
                step = chunk_len or ids.shape[1]
                cache = DynamicCache(config=config) if step < ids.shape[1] else None
                for start in range(0, ids.shape[1], step):
                    chunk = ids[:, start:start + step].to(device)
                    backbone(input_ids=chunk, past_key_values=cache, use_cache=cache is not None)
                    bar.update(chunk.numel())
    finally:
        bar.close()
        model.train(was_training)
    if int(acc.count.min()) == 0:
        raise CalibrationError("no query was captured (empty input, or q_proj never ran)")
    if not bool((acc.count == acc.count[0]).all()):
        raise CalibrationError(f"layers saw different token counts: {acc.count.tolist()}")
    n = int(acc.count[0])
    q_mean = (acc.sum_q / n).to(torch.complex64)
    q_abs = (acc.sum_abs / n).to(torch.float32)
    meta = {"rope": rope.describe(), "attention_scaling": rope.attention_scaling}
    meta.update(info or {})
    return QueryStats(q_mean, q_abs, fingerprint, num_tokens=n, info=meta)


def _read_tokens(tokenizer: Any, text_path: str | Path, max_tokens: int) -> list[int]:
    """The first ``max_tokens`` tokens of the text file, no special tokens added."""
    text = Path(text_path).read_text(encoding="utf-8", errors="replace")
    if not text.strip():
        raise CalibrationError(f"{text_path}: no text")
    # English runs ~4 characters per token: tokenize a generous prefix first, the whole text only if needed.
    prefix = text[: max(4096, max_tokens * 12)]
    ids = tokenizer(prefix, add_special_tokens=False)["input_ids"]
    if len(ids) < max_tokens and len(prefix) < len(text):
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    return list(ids[:max_tokens])


def calibrate(
    model_dir: str | Path,
    text_path: str | Path,
    max_tokens: int = 32768,
    chunk_len: int = 2048,
    device: str = "cpu",
    progress: bool = True,
    sequence_len: int | None = None,
) -> QueryStats:
    """Load the transformers checkpoint in ``model_dir`` in float32 and calibrate on ``text_path``, read as
    sequences of ``sequence_len`` tokens (default: the model's context) fed ``chunk_len`` tokens at a time. Only a
    text longer than that starts a new sequence, and the metadata says so (``sequence_len``, ``sequences``)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if max_tokens <= 0 or chunk_len <= 0 or (sequence_len is not None and sequence_len <= 0):
        raise ValueError("max_tokens, chunk_len and sequence_len must be positive")
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    ids = _read_tokens(tokenizer, text_path, max_tokens)
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    model.to(device)
    context = getattr(model.config, "max_position_embeddings", None) or len(ids)
    sequence_len = min(sequence_len or context, context)
    sequences = [ids[i:i + sequence_len] for i in range(0, len(ids), sequence_len)]
    if len(sequences) > 1:
        print(f"calibrate: {len(ids)} tokens exceed the sequence length {sequence_len}: {len(sequences)} "
              "independent sequences", file=sys.stderr)
    return calibrate_model(
        model, sequences, model_name=str(model_dir), progress=progress, total_tokens=len(ids), chunk_len=chunk_len,
        info={"text": str(text_path), "chunk_len": chunk_len, "max_tokens": max_tokens,
              "sequence_len": sequence_len, "sequences": len(sequences)},
    )


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="kvcompact calibrate", description=__doc__.split("\n\n")[0])
    p.add_argument("model_dir", nargs="?", help="transformers model directory (same as --model)")
    p.add_argument("--model", help="transformers model directory (e.g. the bundled SmolLM2)")
    p.add_argument("--text", required=True, help="plain-text calibration file")
    p.add_argument("-o", "--out", required=True, help="output stats file (.pt)")
    p.add_argument("--max-tokens", type=int, default=32768)
    p.add_argument("--chunk-len", type=int, default=2048, help="tokens per forward (memory only: the KV cache is "
                   "carried from chunk to chunk)")
    p.add_argument("--sequence-len", type=int, default=None, help="tokens per independent sequence (default and "
                   "maximum: the model's context)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--no-progress", action="store_true")
    args = p.parse_args(argv)
    model = args.model or args.model_dir
    if not model:
        p.error("give the model directory (positional or --model)")
    t0 = time.time()
    stats = calibrate(model, args.text, args.max_tokens, args.chunk_len, device=args.device,
                      progress=not args.no_progress, sequence_len=args.sequence_len)
    stats.save(args.out)
    R = stats.concentration
    print(f"wrote {args.out}: {stats.num_tokens} tokens, {stats.num_layers} layers x {stats.num_heads} heads x "
          f"{stats.num_bands} bands, mean concentration R={float(R.mean()):.3f}, {time.time() - t0:.1f}s",
          file=sys.stderr)
    return 0


if __name__ == "__main__":  # pragma: no cover
    with contextlib.suppress(KeyboardInterrupt):
        sys.exit(main())
