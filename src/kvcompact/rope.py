"""The model's own rotary position embedding, as kvcompact needs it: a :class:`RopeSpec`.

Band convention (docs/DESIGN.md, section 4.2, which has the pass-through pairing and the scaling): a head vector of
``head_dim = d`` reals is read as ``F = d // 2`` complex *bands*; the first ``F_rot = rotary_dim // 2`` are rotated,
the rest (partial rotary) are pass-through bands with frequency 0. ``neox`` ("half", HF ``rotate_half``) pairs
rotated band ``f`` as ``x[f] + i*x[f + F_rot]``, ``interleaved`` (GPT-J) as ``x[2f] + i*x[2f + 1]``. Frequencies
and ``attention_scaling`` are the model's own rotary module's, scaling included. Build a spec with
:meth:`RopeSpec.from_hf_config` (any transformers config object, e.g. vLLM's ``model_config.hf_config``),
:meth:`RopeSpec.from_pretrained` (a model directory) or :meth:`RopeSpec.from_model` (a loaded transformers model).
"""

from __future__ import annotations

import importlib
import inspect
import math
from dataclasses import dataclass
from typing import Any

import torch

from kvcompact.kv_bytes import head_dim_of

STYLES = ("neox", "interleaved")
_STYLE_ALIASES = {"neox": "neox", "half": "neox", "rotate_half": "neox",
                  "interleaved": "interleaved", "gptj": "interleaved", "gpt-j": "interleaved"}
# transformers model types whose rotary embedding rotates adjacent pairs (GPT-J style). Everything else in
# transformers uses rotate_half (neox); GGUF Llama weights are permuted to neox on load.
INTERLEAVED_MODEL_TYPES = frozenset({"gptj", "codegen", "cohere", "cohere2", "glm", "glm4", "chatglm"})


class RopeError(ValueError):
    """The model's rotary embedding cannot be described (unknown style, no rotary module, bad shapes)."""


def normalize_style(style: str) -> str:
    """Canonical style name ("neox" or "interleaved"); accepts TriAttention's "half"."""
    key = str(style).strip().lower()
    if key not in _STYLE_ALIASES:
        raise RopeError(f"unknown RoPE style {style!r}; allowed: neox (alias half), interleaved (alias gptj)")
    return _STYLE_ALIASES[key]


def rope_style_for(config: Any) -> str:
    """The RoPE pairing a transformers config's model uses."""
    return "interleaved" if getattr(config, "model_type", "") in INTERLEAVED_MODEL_TYPES else "neox"


def rotary_dim_of(config: Any, head_dim: int | None = None, params: dict[str, Any] | None = None) -> int:
    """Rotated dims per head: ``partial_rotary_factor * head_dim``, or a config's explicit ``rotary_dim``."""
    head_dim = head_dim or head_dim_of(config)
    explicit = getattr(config, "rotary_dim", None)
    if isinstance(explicit, int) and not isinstance(explicit, bool) and 0 < explicit <= head_dim:
        return explicit
    params = rope_parameters_of(config) if params is None else params
    return int(head_dim * float(params.get("partial_rotary_factor", 1.0) or 1.0))


def rope_parameters_of(config: Any) -> dict[str, Any]:
    """The rope dict of a config, transformers v5 (``rope_parameters``) or v4 (``rope_theta`` + ``rope_scaling``)."""
    params = getattr(config, "rope_parameters", None)
    if isinstance(params, dict) and any(isinstance(v, dict) for v in params.values()):
        raise RopeError(f"this model rotates each layer type with its own RoPE ({', '.join(params)}: Gemma 3's "
                        "local and global layers); kvcompact's RoPE-aware scoring (triattention) assumes one for "
                        "every layer: use a policy that does not model RoPE (streaming, knorm, snapkv, h2o, rkv)")
    if isinstance(params, dict) and params:
        out = dict(params)
    else:
        out = dict(getattr(config, "rope_scaling", None) or {})
        theta = getattr(config, "rope_theta", None)
        if theta is not None:
            out.setdefault("rope_theta", theta)
    if "rope_type" not in out:
        out["rope_type"] = out.pop("type", "default")
    if "partial_rotary_factor" not in out and getattr(config, "partial_rotary_factor", None) is not None:
        out["partial_rotary_factor"] = config.partial_rotary_factor
    return out


@dataclass(frozen=True, eq=False)
class RopeSpec:
    """What RoPE does to one head of a model.

    inv_freq:          [F_rot] float32 angular frequency of each rotated band (the model's own, scaling included).
    attention_scaling: ``s``, multiplies cos and sin of the rotated dims (so a rotated logit carries ``s^2``).
    style:             "neox" or "interleaved" (see module docstring for the band pairing).
    rotary_dim:        rotated dims per head (= head_dim unless partial rotary).
    head_dim:          ``d``.
    rope_theta / rope_type: informational (the fingerprint records them).
    """

    inv_freq: torch.Tensor
    attention_scaling: float
    style: str
    rotary_dim: int
    head_dim: int
    rope_theta: float | None = None
    rope_type: str = "default"

    def __post_init__(self) -> None:
        object.__setattr__(self, "style", normalize_style(self.style))
        inv = torch.as_tensor(self.inv_freq).detach().to("cpu", torch.float32).reshape(-1).contiguous()
        object.__setattr__(self, "inv_freq", inv)
        if self.head_dim <= 0 or self.head_dim % 2:
            raise RopeError(f"head_dim must be a positive even number, got {self.head_dim}")
        if self.rotary_dim <= 0 or self.rotary_dim % 2 or self.rotary_dim > self.head_dim:
            raise RopeError(f"rotary_dim must be even and in (0, head_dim={self.head_dim}], got {self.rotary_dim}")
        if (self.head_dim - self.rotary_dim) % 2:
            raise RopeError("head_dim - rotary_dim must be even")
        if inv.numel() != self.rotary_dim // 2:
            raise RopeError(f"inv_freq has {inv.numel()} entries, rotary_dim={self.rotary_dim} needs "
                            f"{self.rotary_dim // 2}")

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, RopeSpec):
            return NotImplemented
        return (self.style, self.rotary_dim, self.head_dim, self.attention_scaling) == (
            other.style, other.rotary_dim, other.head_dim, other.attention_scaling) and torch.equal(
            self.inv_freq, other.inv_freq)

    __hash__ = None  # type: ignore[assignment]

    # ------------------------------------------------------------------ construction
    @classmethod
    def default(cls, head_dim: int, rope_theta: float, rotary_dim: int | None = None, style: str = "neox",
                attention_scaling: float = 1.0) -> RopeSpec:
        """Plain (unscaled) RoPE: ``w_f = theta^(-2f/rotary_dim)``."""
        rotary_dim = int(rotary_dim or head_dim)
        inv = 1.0 / (float(rope_theta) ** (torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim))
        return cls(inv, float(attention_scaling), style, rotary_dim, int(head_dim), float(rope_theta), "default")

    @classmethod
    def from_hf_config(cls, config: Any, style: str | None = None) -> RopeSpec:
        """From a transformers config, through the model's own rotary embedding module (so llama3 / yarn /
        linear / partial-rotary handling is exactly the model's). ``style`` overrides the pairing, which is
        otherwise taken from the model type (neox for every model kvcompact targets: Llama, Qwen2/3, Mistral)."""
        head_dim = head_dim_of(config)
        params = rope_parameters_of(config)
        rotary = _build_rotary_module(config)
        if rotary is not None:
            inv_freq = getattr(rotary, "original_inv_freq", None)
            if inv_freq is None:
                inv_freq = rotary.inv_freq
            scaling = float(getattr(rotary, "attention_scaling", 1.0))
        else:
            inv_freq, scaling = _init_from_functions(config, params, head_dim)
        inv_freq = torch.as_tensor(inv_freq).float().reshape(-1)
        return cls(inv_freq, scaling, style or rope_style_for(config), 2 * inv_freq.numel(), head_dim,
                   params.get("rope_theta"), str(params.get("rope_type", "default")))

    @classmethod
    def from_pretrained(cls, model_dir: str, style: str | None = None) -> RopeSpec:
        from transformers import AutoConfig

        return cls.from_hf_config(AutoConfig.from_pretrained(model_dir), style=style)

    @classmethod
    def from_model(cls, model: Any, style: str | None = None) -> RopeSpec:
        """From a loaded transformers model: reads its live rotary module (``model.model.rotary_emb``)."""
        config = model.config
        rotary = None
        for owner in (getattr(model, "model", None), model):
            if owner is not None and getattr(owner, "rotary_emb", None) is not None:
                rotary = owner.rotary_emb
                break
        if rotary is None or not hasattr(rotary, "inv_freq"):
            return cls.from_hf_config(config, style=style)
        inv_freq = getattr(rotary, "original_inv_freq", None)
        inv_freq = (inv_freq if inv_freq is not None else rotary.inv_freq).float().reshape(-1)
        params = rope_parameters_of(config)
        return cls(inv_freq, float(getattr(rotary, "attention_scaling", 1.0)), style or rope_style_for(config),
                   2 * inv_freq.numel(), head_dim_of(config), params.get("rope_theta"),
                   str(params.get("rope_type", "default")))

    # ------------------------------------------------------------------ band geometry
    @property
    def num_bands(self) -> int:
        """F = head_dim // 2 (rotated + pass-through bands)."""
        return self.head_dim // 2

    @property
    def num_rot_bands(self) -> int:
        """F_rot = rotary_dim // 2."""
        return self.rotary_dim // 2

    def band_freqs(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """[F] frequency of every band: inv_freq for rotated bands, 0 for pass-through bands."""
        out = torch.zeros(self.num_bands, dtype=dtype)
        out[: self.num_rot_bands] = self.inv_freq.to(dtype)
        return out

    def band_scales(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """[F] ``s_f``: attention_scaling on rotated bands, 1 on pass-through bands."""
        out = torch.ones(self.num_bands, dtype=dtype)
        out[: self.num_rot_bands] = self.attention_scaling
        return out

    def band_index(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(re_idx, im_idx) [F] int64: dims holding the real and imaginary part of each band."""
        F, Fr, d, r = self.num_bands, self.num_rot_bands, self.head_dim, self.rotary_dim
        if self.style == "interleaved":
            re = torch.arange(F) * 2
            return re, re + 1
        P = (d - r) // 2
        re = torch.cat([torch.arange(Fr), r + torch.arange(P)])
        im = torch.cat([Fr + torch.arange(Fr), r + P + torch.arange(P)])
        return re, im

    def bands(self, x: torch.Tensor) -> torch.Tensor:
        """Real ``[..., head_dim]`` -> complex ``[..., F]`` (complex64 for float32 input, complex128 for
        float64)."""
        if x.shape[-1] != self.head_dim:
            raise RopeError(f"bands(): last dim is {x.shape[-1]}, head_dim is {self.head_dim}")
        if not x.is_floating_point():
            x = x.float()
        if x.dtype not in (torch.float32, torch.float64):
            x = x.float()
        re, im = self.band_index()
        re, im = re.to(x.device), im.to(x.device)
        return torch.complex(x.index_select(-1, re), x.index_select(-1, im))

    def unbands(self, z: torch.Tensor) -> torch.Tensor:
        """Inverse of :meth:`bands`: complex ``[..., F]`` -> real ``[..., head_dim]``."""
        if z.shape[-1] != self.num_bands:
            raise RopeError(f"unbands(): last dim is {z.shape[-1]}, expected F={self.num_bands}")
        re, im = self.band_index()
        out = torch.empty(*z.shape[:-1], self.head_dim, dtype=z.real.dtype, device=z.device)
        out[..., re.to(z.device)] = z.real
        out[..., im.to(z.device)] = z.imag
        return out

    def real_layout(self, re_part: torch.Tensor, im_part: torch.Tensor) -> torch.Tensor:
        """Place band real / imaginary parts ``[..., F]`` into a real ``[..., head_dim]`` vector such that
        ``real_layout(a.real, a.imag) . x == Re sum_f a_f * conj(bands(x)_f)``."""
        return self.unbands(torch.complex(re_part, im_part))

    def apply(self, x: torch.Tensor, positions: torch.Tensor, scaled: bool = True) -> torch.Tensor:
        """Apply RoPE: ``x [..., head_dim]`` at ``positions`` (broadcastable to ``x.shape[:-1]``), exactly as the
        model does (rotated bands times ``s*exp(i*p*w)``, pass-through dims untouched). Computed in float64."""
        z = self.bands(x.double())
        ang = positions.double().unsqueeze(-1) * self.band_freqs(torch.float64).to(x.device)
        rot = torch.polar(torch.ones_like(ang), ang)
        if scaled:
            rot = rot * self.band_scales(torch.float64).to(x.device)
        return self.unbands(z * rot).to(x.dtype)

    def describe(self) -> str:
        return (f"RopeSpec(style={self.style}, head_dim={self.head_dim}, rotary_dim={self.rotary_dim}, "
                f"rope_type={self.rope_type}, theta={self.rope_theta}, s={self.attention_scaling:g})")


def _build_rotary_module(config: Any) -> Any | None:
    """Instantiate the model's own ``*RotaryEmbedding`` class for ``config`` (cheap: buffers only)."""
    model_type = getattr(config, "model_type", None)
    if not model_type:
        return None
    try:
        from transformers.models.auto.configuration_auto import model_type_to_module_name

        module_name = model_type_to_module_name(model_type)
        module = importlib.import_module(f"transformers.models.{module_name}.modeling_{module_name}")
    except Exception:
        return None
    candidates: list[Any] = [obj for name, obj in vars(module).items()
                  if inspect.isclass(obj) and name.endswith("RotaryEmbedding") and "Vision" not in name]
    if not candidates:
        return None
    prefix = type(config).__name__.removesuffix("Config").lower()
    candidates.sort(key=lambda c: (c.__name__.removesuffix("RotaryEmbedding").lower() != prefix, c.__name__))
    for cls in candidates:
        try:
            rotary = cls(config=config)
        except TypeError:
            try:
                rotary = cls(config)
            except Exception:
                continue
        except Exception:
            continue
        if hasattr(rotary, "inv_freq"):
            return rotary
    return None


def _init_from_functions(config: Any, params: dict[str, Any], head_dim: int) -> tuple[torch.Tensor, float]:
    rope_type = params.get("rope_type", "default")
    if rope_type != "default":
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        if rope_type not in ROPE_INIT_FUNCTIONS:
            raise RopeError(f"rope_type {rope_type!r} is not known to transformers' ROPE_INIT_FUNCTIONS")
        inv, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, "cpu")
        return torch.as_tensor(inv).float(), float(scaling)
    theta: Any = params.get("rope_theta")
    if theta is None:
        theta = getattr(config, "default_theta", 10000.0)  # e.g. GPT-J hard-codes 10000
    rotary_dim = rotary_dim_of(config, head_dim, params)
    spec = RopeSpec.default(head_dim, float(theta), rotary_dim)
    return spec.inv_freq, 1.0


def offsets_mean_phasor(inv_freq: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """``c_f = mean_o exp(i*o*w_f)`` in complex128."""
    ang = offsets.double().unsqueeze(-1) * inv_freq.double().unsqueeze(0)
    return torch.polar(torch.ones_like(ang), torch.remainder(ang, 2 * math.pi)).mean(dim=0)


__all__ = ["RopeSpec", "RopeError", "STYLES", "normalize_style", "rope_style_for", "head_dim_of", "rotary_dim_of",
           "rope_parameters_of", "offsets_mean_phasor", "INTERLEAVED_MODEL_TYPES"]
