"""Calibrated query statistics for TriAttention scoring: format, fingerprint, load/save, TriAttention import.

:class:`QueryStats` holds the mean query and mean query magnitude per (layer, query head, band), the query taken as
RoPE sees it (docs/DESIGN.md, section 4.1). The file is a superset of TriAttention's published format, so
TriAttention's tools read ours and a published file loads here (:meth:`QueryStats.to_dict`,
:meth:`QueryStats.from_dict`). Statistics fit only the model they were made for: a :class:`ModelFingerprint` is
saved with them, and :meth:`QueryStats.check_compatible` refuses another model, naming the field.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from kvcompact.rope import head_dim_of, normalize_style, rope_parameters_of, rope_style_for, rotary_dim_of

FORMAT = "kvcompact.stats/1"
_KEY_RE = re.compile(r"^layer(\d+)_head(\d+)$")


class StatsError(ValueError):
    """A stats file is malformed, or does not belong to the model it is used with."""


def canonical_rope_scaling(params: dict[str, Any]) -> str:
    """A stable string for the RoPE scaling of a rope parameter dict: "none" for plain RoPE, else sorted JSON
    of every field except ``rope_theta`` and ``partial_rotary_factor`` (compared separately)."""
    rest = {k: v for k, v in params.items() if k not in ("rope_theta", "partial_rotary_factor", "type")}
    if rest.get("rope_type", "default") == "default" and set(rest) <= {"rope_type"}:
        return "none"
    return json.dumps(rest, sort_keys=True, default=str)


@dataclass(frozen=True)
class ModelFingerprint:
    """What must match between the model a stats file was calibrated on and the model it scores.

    ``None`` means "not recorded" (published TriAttention files lack some fields) and is not compared.
    ``model_name`` is informational and never compared.
    """

    num_layers: int | None
    num_attention_heads: int | None
    num_kv_heads: int | None
    head_dim: int | None
    rope_style: str | None = "neox"
    rope_theta: float | None = None
    rope_type: str | None = None
    rope_scaling: str | None = None
    rotary_dim: int | None = None
    model_name: str = ""

    COMPARED = ("num_layers", "num_attention_heads", "num_kv_heads", "head_dim", "rope_style", "rope_theta",
                "rope_type", "rope_scaling", "rotary_dim")

    def __post_init__(self) -> None:
        if self.rope_style is not None:
            object.__setattr__(self, "rope_style", normalize_style(self.rope_style))

    @classmethod
    def from_hf_config(cls, config: Any, model_name: str | None = None, style: str | None = None
                       ) -> ModelFingerprint:
        params = rope_parameters_of(config)
        head_dim = head_dim_of(config)
        rotary_dim = rotary_dim_of(config, head_dim, params)
        name = model_name or getattr(config, "_name_or_path", "") or getattr(config, "model_type", "")
        theta = params.get("rope_theta")
        return cls(
            num_layers=int(config.num_hidden_layers),
            num_attention_heads=int(config.num_attention_heads),
            num_kv_heads=int(getattr(config, "num_key_value_heads", None) or config.num_attention_heads),
            head_dim=head_dim,
            rope_style=style or rope_style_for(config),
            rope_theta=None if theta is None else float(theta),
            rope_type=str(params.get("rope_type", "default")),
            rope_scaling=canonical_rope_scaling(params),
            rotary_dim=rotary_dim,
            model_name=str(name),
        )

    def differences(self, other: ModelFingerprint) -> list[tuple[str, Any, Any]]:
        """(field, self's value, other's value) for every compared field both record and that differ."""
        out = []
        for name in self.COMPARED:
            mine, theirs = getattr(self, name), getattr(other, name)
            if mine is None or theirs is None:
                continue
            if name == "rope_theta":
                if math.isclose(float(mine), float(theirs), rel_tol=1e-6):
                    continue
            elif mine == theirs:
                continue
            out.append((name, mine, theirs))
        return out

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass
class QueryStats:
    """Per layer ``l``, query head ``h`` and band ``f`` (:mod:`kvcompact.rope`'s band convention): ``q_mean =
    E[q_f]`` (complex64 ``[L, H_q, F]``) and ``q_abs_mean = E[|q_f|]`` (float32 ``[L, H_q, F]``), where ``q`` is
    the query exactly as RoPE sees it (after bias and q-norm, before RoPE, fp32)."""

    q_mean: torch.Tensor
    q_abs_mean: torch.Tensor
    fingerprint: ModelFingerprint
    num_tokens: int = 0
    info: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        qm = torch.as_tensor(self.q_mean)
        if not qm.is_complex():
            raise StatsError("q_mean must be a complex tensor [L, H_q, F]")
        self.q_mean = qm.detach().to("cpu", torch.complex64).contiguous()
        self.q_abs_mean = torch.as_tensor(self.q_abs_mean).detach().to("cpu", torch.float32).contiguous()
        if self.q_mean.dim() != 3 or self.q_mean.shape != self.q_abs_mean.shape:
            raise StatsError(f"q_mean {tuple(self.q_mean.shape)} and q_abs_mean {tuple(self.q_abs_mean.shape)} "
                             "must both be [L, H_q, F]")
        L, H, F = self.q_mean.shape
        fp = self.fingerprint
        for name, have in (("num_layers", L), ("num_attention_heads", H)):
            want = getattr(fp, name)
            if want is not None and want != have:
                raise StatsError(f"stats tensors have {name}={have} but the fingerprint says {want}")
        if fp.head_dim is not None:
            allowed = {fp.head_dim // 2}
            if fp.rotary_dim is not None:
                allowed.add(fp.rotary_dim // 2)
            if F not in allowed:
                raise StatsError(f"stats have F={F} bands, head_dim={fp.head_dim} needs {fp.head_dim // 2}")

    # ------------------------------------------------------------------ shape helpers
    @property
    def num_layers(self) -> int:
        return self.q_mean.shape[0]

    @property
    def num_heads(self) -> int:
        return self.q_mean.shape[1]

    @property
    def num_bands(self) -> int:
        return self.q_mean.shape[2]

    @property
    def concentration(self) -> torch.Tensor:
        """``R_f = |qbar_f| / m_f`` [L, H_q, F] (0 where m_f = 0)."""
        m = self.q_abs_mean
        return torch.where(m > 0, self.q_mean.abs() / m.clamp_min(1e-30), torch.zeros_like(m))

    # ------------------------------------------------------------------ compatibility
    def check_compatible(self, fingerprint: ModelFingerprint) -> None:
        """Raise :class:`StatsError` naming the first field where these stats and ``fingerprint`` (the model
        they would score) differ, e.g. "stats were made for num_kv_heads=8, the model has 3"."""
        diffs = self.fingerprint.differences(fingerprint)
        if diffs:
            name, mine, theirs = diffs[0]
            more = "" if len(diffs) == 1 else " (also differs: " + ", ".join(d[0] for d in diffs[1:]) + ")"
            src = self.fingerprint.model_name or "?"
            raise StatsError(f"stats were made for {name}={mine!r}, the model has {theirs!r}{more}; "
                             f"stats model: {src}, model: {fingerprint.model_name or '?'}. Recalibrate with "
                             "`python -m kvcompact.tools.calibrate` for this model.")

    # ------------------------------------------------------------------ (de)serialization
    def to_dict(self) -> dict[str, Any]:
        """The on-disk dict (published TriAttention layout + our ``kvcompact`` metadata block), so TriAttention
        tools read ours::

            {"metadata": {"head_dim", "rope_style" ("half" | "interleaved"), "rope_type", "model_name", "num_layers",
                          "num_attention_heads", "num_kv_heads", "rope_theta", "sampled_heads", ...,
                          "format": "kvcompact.stats/1", "kvcompact": {<ModelFingerprint fields>, "num_tokens", ...}},
             "stats": {"layer{LL:02d}_head{HH:02d}": {"q_mean_real": [F], "q_mean_imag": [F], "q_abs_mean": [F]}}}
        """
        fp = self.fingerprint
        L, H, F = self.q_mean.shape
        stats: dict[str, dict[str, torch.Tensor]] = {}
        for layer in range(L):
            for head in range(H):
                z = self.q_mean[layer, head]
                stats[f"layer{layer:02d}_head{head:02d}"] = {
                    "q_mean_real": z.real.clone().float(),
                    "q_mean_imag": z.imag.clone().float(),
                    "q_abs_mean": self.q_abs_mean[layer, head].clone(),
                }
        metadata: dict[str, Any] = {
            "format": FORMAT,
            "head_dim": fp.head_dim,
            "rope_style": "half" if fp.rope_style == "neox" else fp.rope_style,
            "rope_type": fp.rope_type,
            "model_name": fp.model_name,
            "num_layers": L,
            "num_attention_heads": H,
            "num_kv_heads": fp.num_kv_heads,
            "rope_theta": fp.rope_theta,
            "dtype": "float32",
            "sampled_heads": [[layer, head] for layer in range(L) for head in range(H)],
            "num_tokens": int(self.num_tokens),
            "kvcompact": {**fp.to_dict(), "num_tokens": int(self.num_tokens),
                          "info": json.loads(json.dumps(self.info, default=str))},
        }
        return {"metadata": metadata, "stats": stats}

    def save(self, path: str | Path) -> None:
        """``torch.save`` of :meth:`to_dict`, a plain dict loadable with ``weights_only=True``."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save(self.to_dict(), path)

    @classmethod
    def from_dict(cls, payload: dict[str, Any], source: str = "<dict>") -> QueryStats:
        """Ours or the published TriAttention layout. A published file (no ``kvcompact`` block) leaves the
        fingerprint fields it does not record ``None``, and :meth:`check_compatible` does not compare them."""
        if not isinstance(payload, dict) or "stats" not in payload or not isinstance(payload["stats"], dict):
            raise StatsError(f"{source}: not a stats file (expected a dict with 'metadata' and 'stats')")
        metadata = dict(payload.get("metadata") or {})
        entries: dict[tuple[int, int], dict[str, Any]] = {}
        for key, value in payload["stats"].items():
            m = _KEY_RE.match(str(key))
            if m is None:
                raise StatsError(f"{source}: unexpected stats key {key!r} (expected 'layer{{LL:02d}}_head{{HH:02d}}')")
            missing = [n for n in ("q_mean_real", "q_mean_imag", "q_abs_mean") if n not in value]
            if missing:
                raise StatsError(f"{source}: stats[{key!r}] lacks {', '.join(missing)}")
            entries[(int(m.group(1)), int(m.group(2)))] = value
        if not entries:
            raise StatsError(f"{source}: 'stats' is empty")
        ours = metadata.get("kvcompact")
        try:
            L = int(metadata.get("num_layers") or max(k[0] for k in entries) + 1)
            H = int(metadata.get("num_attention_heads") or max(k[1] for k in entries) + 1)
        except (TypeError, ValueError) as e:
            raise StatsError(f"{source}: num_layers / num_attention_heads in its metadata are not integers: {e}") from e
        # The shape is checked against the entries before anything is sized by it: a file's metadata may claim any
        # number of layers, and only the entries it really holds bound the work.
        if L <= 0 or H <= 0 or L * H != len(entries):
            max_layer, max_head = (max(k[i] for k in entries) for i in (0, 1))
            absent = next((f"layer{layer:02d}_head{head:02d}" for layer in range(min(L, max_layer + 2))
                            for head in range(min(H, max_head + 2)) if (layer, head) not in entries), None)
            raise StatsError(f"{source}: stats cover {len(entries)} of {L}x{H} (layer, head) pairs (num_layers="
                             f"{L}, num_attention_heads={H}); missing e.g. {absent}. kvcompact needs every head of "
                             "every layer.")
        first = entries[(0, 0)]
        F = torch.as_tensor(first["q_mean_real"]).numel()
        real = torch.empty(L, H, F, dtype=torch.float32)
        imag = torch.empty(L, H, F, dtype=torch.float32)
        absm = torch.empty(L, H, F, dtype=torch.float32)
        for (layer, head), value in entries.items():
            if layer >= L or head >= H:
                raise StatsError(f"{source}: stats key layer{layer:02d}_head{head:02d} is outside "
                                 f"num_layers={L}, num_attention_heads={H}")
            for dst, name in ((real, "q_mean_real"), (imag, "q_mean_imag"), (absm, "q_abs_mean")):
                t = torch.as_tensor(value[name]).float().reshape(-1)
                if t.numel() != F:
                    raise StatsError(f"{source}: layer{layer:02d}_head{head:02d}.{name} has {t.numel()} "
                                     f"entries, expected {F}")
                if not torch.isfinite(t).all():
                    raise StatsError(f"{source}: layer{layer:02d}_head{head:02d}.{name} holds NaN or infinite "
                                     "values; recalibrate (kvcompact calibrate) or use another stats file")
                dst[layer, head] = t
        if isinstance(ours, dict):
            fields = {f.name for f in dataclasses.fields(ModelFingerprint)}
            fp = ModelFingerprint(**{k: v for k, v in ours.items() if k in fields})
            num_tokens = int(ours.get("num_tokens", 0))
            info = dict(ours.get("info") or {})
        else:
            theta = metadata.get("rope_theta")
            rope_type = metadata.get("rope_type")
            fp = ModelFingerprint(
                num_layers=L,
                num_attention_heads=H,
                num_kv_heads=_opt_int(metadata.get("num_kv_heads", metadata.get("num_key_value_heads"))),
                head_dim=_opt_int(metadata.get("head_dim")) or 2 * F,
                rope_style=metadata.get("rope_style") or None,
                rope_theta=None if theta is None else float(theta),
                rope_type=None if rope_type is None else str(rope_type),
                rope_scaling=None,
                rotary_dim=_opt_int(metadata.get("rotary_dim")),
                model_name=str(metadata.get("model_name") or ""),
            )
            num_tokens = int(metadata.get("num_tokens", 0) or 0)
            info = {"source_format": "triattention", "metadata": {k: v for k, v in metadata.items()
                                                                 if isinstance(v, (str, int, float, bool))}}
        return cls(torch.complex(real, imag), absm, fp, num_tokens=num_tokens, info=info)

    @classmethod
    def load(cls, path: str | Path, fingerprint: ModelFingerprint | None = None) -> QueryStats:
        """Load ours or a published TriAttention file; with ``fingerprint``, also :meth:`check_compatible`."""
        path = Path(path)
        if not path.is_file():
            raise StatsError(f"stats file not found: {path}")
        try:
            payload = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as e:  # noqa: BLE001 - report any unpickling failure with the path
            raise StatsError(f"{path}: cannot read stats file: {e}") from e
        stats = cls.from_dict(payload, source=str(path))
        if fingerprint is not None:
            stats.check_compatible(fingerprint)
        return stats


def _opt_int(value: Any) -> int | None:
    return None if value is None else int(value)


def save_stats(stats: QueryStats, path: str | Path) -> None:
    stats.save(path)


def load_stats(path: str | Path, fingerprint: ModelFingerprint | None = None) -> QueryStats:
    return QueryStats.load(path, fingerprint)


__all__ = ["QueryStats", "ModelFingerprint", "StatsError", "save_stats", "load_stats", "canonical_rope_scaling",
           "FORMAT"]
