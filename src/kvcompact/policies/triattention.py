"""TriAttention scoring (docs/DESIGN.md, section 4.1): importance from calibrated query statistics and the key alone.

For query head ``h`` with statistics ``qbar_f = E[q_f]``, ``m_f = E[|q_f|]`` and a cached post-RoPE key with bands
``K_f`` (:meth:`kvcompact.rope.RopeSpec.bands`), at logical length ``t``: ``S = T + N``, one score per query head
(G = H_q), with ``T = mean_o Re sum_f s_f * qbar_f * conj(K_f) * exp(i*(t+o)*w_f)``, ``o in {1, 2, 4, ..., 2^16}``,
and ``N = sum_f s_f * (m_f - |qbar_f|) * |K_f|``: ``s_f`` once, as a stored key already carries one factor.
The offset mean is folded into one synthetic query per head, precomputed from the statistics and RoPE, so a round
costs one rotation by ``t`` and ONE einsum over ``[keys | |K_f|]`` (``d + F`` features) for all requests, layers
and heads.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from kvcompact.config import KVCompactConfig
from kvcompact.policies.base import Policy, ScoreInput
from kvcompact.rope import RopeSpec, offsets_mean_phasor
from kvcompact.stats import QueryStats

OFFSETS = tuple(2**i for i in range(17))  # 1, 2, 4, ..., 65536


class TriAttentionPolicy(Policy):
    name = "triattention"

    def __init__(self, config: KVCompactConfig, stats: QueryStats, rope: RopeSpec,
                 offsets: Sequence[int] = OFFSETS) -> None:
        super().__init__(config)
        if stats is None:
            raise ValueError("policy 'triattention' needs calibrated query statistics (QueryStats)")
        if rope is None:
            raise ValueError("policy 'triattention' needs the model's RopeSpec")
        fp = stats.fingerprint
        if fp.head_dim is not None and fp.head_dim != rope.head_dim:
            raise ValueError(f"stats were made for head_dim={fp.head_dim}, the model's RoPE has {rope.head_dim}")
        if fp.rope_style is not None and fp.rope_style != rope.style:
            raise ValueError(f"stats were made for rope_style={fp.rope_style}, the model's RoPE is {rope.style}")
        F = rope.num_bands
        qbar = stats.q_mean.to(torch.complex128)
        m = stats.q_abs_mean.to(torch.float64)
        if qbar.shape[-1] == rope.num_rot_bands and rope.num_rot_bands < F:  # rotated bands only: pad
            pad = F - rope.num_rot_bands
            qbar = torch.cat([qbar, qbar.new_zeros(*qbar.shape[:-1], pad)], dim=-1)
            m = torch.cat([m, m.new_zeros(*m.shape[:-1], pad)], dim=-1)
        if qbar.shape[-1] != F:
            raise ValueError(f"stats have {qbar.shape[-1]} bands, the model's RoPE has F={F}")
        self.rope = rope
        self.stats = stats
        self.offsets = tuple(int(o) for o in offsets)
        w = rope.band_freqs(torch.float64)
        s = rope.band_scales(torch.float64)
        c = offsets_mean_phasor(w, torch.tensor(self.offsets, dtype=torch.float64))
        self._freqs = w  # [F]
        self._A = s * qbar * c  # [L, H_q, F] complex128: folded synthetic query at t = 0
        self._norm_w = s * (m - qbar.abs()).clamp_min(0.0)  # [L, H_q, F] (>= 0 up to rounding)
        re_idx, im_idx = rope.band_index()
        self._re_idx, self._im_idx = re_idx, im_idx
        self._device_cache: dict[torch.device, tuple[torch.Tensor, ...]] = {}

    # ------------------------------------------------------------------ views for PP / TP workers
    @property
    def num_layers(self) -> int:
        return self._A.shape[0]

    @property
    def num_q_heads(self) -> int:
        return self._A.shape[1]

    def restrict(self, layers: Sequence[int] | None = None, q_heads: Sequence[int] | None = None
                 ) -> TriAttentionPolicy:
        """A policy for a subset of layers (pipeline stage) and/or query heads (tensor-parallel rank: pass the
        query heads of this rank's KV heads, in order). ScoreInput then carries only those layers / heads."""
        new = object.__new__(TriAttentionPolicy)
        new.__dict__.update(self.__dict__)
        A, nw = self._A, self._norm_w
        if layers is not None:
            idx = torch.as_tensor(list(layers), dtype=torch.long)
            A, nw = A.index_select(0, idx), nw.index_select(0, idx)
        if q_heads is not None:
            idx = torch.as_tensor(list(q_heads), dtype=torch.long)
            A, nw = A.index_select(1, idx), nw.index_select(1, idx)
        new._A, new._norm_w = A, nw
        new._device_cache = {}
        return new

    # ------------------------------------------------------------------ scoring
    def _on(self, device: torch.device) -> tuple[torch.Tensor, ...]:
        if device not in self._device_cache:
            self._device_cache[device] = (self._A.to(device), self._norm_w.to(device), self._freqs.to(device),
                                          self._re_idx.to(device), self._im_idx.to(device))
        return self._device_cache[device]

    def synthetic_queries(self, logical_len: torch.Tensor, device: torch.device | None = None,
                          dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """``q_syn(t)`` as real ``[B, L, H_q, d]`` vectors in the model's layout (``K . q_syn = T``)."""
        device = device or logical_len.device
        A, _, w, re_idx, im_idx = self._on(device)
        ang = torch.remainder(logical_len.to(device, torch.float64)[:, None] * w[None, :], 2 * math.pi)  # [B, F]
        rot = torch.polar(torch.ones_like(ang), ang)[:, None, None, :]  # [B, 1, 1, F]
        z = A[None] * rot  # [B, L, H_q, F]
        d = self.rope.head_dim
        q = torch.empty(*z.shape[:-1], d, dtype=torch.float64, device=device)
        q[..., re_idx] = z.real
        q[..., im_idx] = z.imag
        return q.to(dtype)

    def score_weights(self, logical_len: torch.Tensor, device: torch.device, dtype: torch.dtype = torch.float32
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """What a round's scores are made of, on ``device``: ``q_syn(t)`` [B, L, H_q, d], the norm weights
        [L, H_q, F] and the key dims holding each band's real and imaginary part ([F] each), so that
        ``S = K . q_syn + sum_f norm_w_f * |K_f|`` with ``|K_f| = hypot(K[re_f], K[im_f])``. :meth:`score` and
        the fused paged-cache kernel (:mod:`kvcompact.vllm.paged_triton`) both read them here."""
        _, norm_w, _, re_idx, im_idx = self._on(device)
        return self.synthetic_queries(logical_len, device, dtype), norm_w.to(dtype), re_idx, im_idx

    def score(self, x: ScoreInput) -> torch.Tensor:
        keys = x.keys
        B, L, Hkv, N, d = keys.shape
        if d != self.rope.head_dim:
            raise ValueError(f"keys have head_dim {d}, the stats/RoPE have {self.rope.head_dim}")
        if L != self.num_layers or x.num_q_heads != self.num_q_heads:
            raise ValueError(f"ScoreInput has {L} layers x {x.num_q_heads} query heads, the stats have "
                             f"{self.num_layers} x {self.num_q_heads}; use restrict(layers=..., q_heads=...) "
                             "for a pipeline stage or tensor-parallel rank")
        if x.num_q_heads % Hkv:
            raise ValueError(f"{x.num_q_heads} query heads do not split into {Hkv} KV heads")
        g = x.num_q_heads // Hkv
        dtype = torch.float64 if keys.dtype == torch.float64 else torch.float32  # float64 only for tests
        q_syn, norm_w, re_idx, im_idx = self.score_weights(x.logical_len, keys.device, dtype)  # q_syn [B, L, H_q, d]
        kf = keys.to(dtype)
        k_abs = torch.sqrt(kf.index_select(-1, re_idx).square() + kf.index_select(-1, im_idx).square())
        feats = torch.cat([kf, k_abs], dim=-1)  # [B, L, Hkv, N, d + F]
        qvec = torch.cat([q_syn, norm_w[None].expand(B, -1, -1, -1)], dim=-1)
        qvec = qvec.view(B, L, Hkv, g, d + norm_w.shape[-1])
        scores = torch.einsum("blkge,blkne->blkgn", qvec, feats)
        return scores.reshape(B, L, Hkv * g, N).float()
