"""SnapKV, decode variant: importance = attention of the last ``w`` queries, pooled along the sequence.

The engine keeps the last ``w = config.query_window`` post-RoPE queries per layer (``ScoreInput.queries``,
``[B, L, H_q, w, d]``); query ``i`` of the window is taken to sit at logical position ``t - w + i`` (the last
``w`` tokens before ``t``), so it only sees keys at positions ``<= t - w + i`` (causal, as in SnapKV's window).

score = max-pool_7( mean_window softmax(Q_w K^T / sqrt(d)) ), softmax over the valid slots of the KV head, pooled
along *logical position order* (identical to slot order after an order-preserving repack; still right after
hole-filling), then the max over the query heads of each GQA group: one score per KV head. The last ``w`` tokens
themselves are protected by selection's recent window.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from kvcompact.policies.base import Policy, ScoreInput

POOL_KERNEL = 7


def group_queries(queries: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """[B, L, H_q, w, d] -> [B, L, H_kv, g, w, d]: query head h belongs to KV head h // g."""
    B, L, Hq, w, d = queries.shape
    if Hq % num_kv_heads:
        raise ValueError(f"{Hq} query heads do not split into {num_kv_heads} KV heads")
    return queries.reshape(B, L, num_kv_heads, Hq // num_kv_heads, w, d)


def window_attention(queries: torch.Tensor, keys: torch.Tensor, positions: torch.Tensor, logical_len: torch.Tensor,
                     causal: bool = True) -> torch.Tensor:
    """Softmax attention of the window queries over the cached slots, averaged over the window.

    queries [B, L, H_q, w, d], keys [B, L, H_kv, N, d], positions [B, L, H_kv, N], logical_len [B].
    Returns [B, L, H_kv, g, N] float32 (zero on padding slots).
    """
    B, L, Hkv, N, d = keys.shape
    q = group_queries(queries.float(), Hkv)
    w = q.shape[-2]
    logits = torch.einsum("blkgwd,blknd->blkgwn", q, keys.float()) / math.sqrt(d)
    mask = (positions >= 0)[:, :, :, None, None, :]  # [B, L, Hkv, 1, 1, N]
    if causal:
        window = torch.arange(w, device=positions.device).view(1, 1, 1, 1, w, 1)
        qpos = logical_len.to(positions.device).view(B, 1, 1, 1, 1, 1) - w + window
        mask = mask & (positions[:, :, :, None, None, :] <= qpos)
    logits = logits.masked_fill(~mask, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    probs = torch.nan_to_num(probs, nan=0.0)  # a query that sees no slot at all contributes nothing
    return probs.mean(dim=-2)


def pool_along_positions(scores: torch.Tensor, positions: torch.Tensor, kernel: int = POOL_KERNEL) -> torch.Tensor:
    """Max-pool ``scores [B, L, H_kv, ..., N]`` with ``kernel`` (stride 1, same padding) along the logical
    position order of each KV head's slots (``positions [B, L, H_kv, N]``); result in slot order."""
    N = scores.shape[-1]
    extra = scores.dim() - positions.dim()
    order = positions.argsort(dim=-1)  # padding (-1) first, then increasing position
    order = order.view(*order.shape[:3], *([1] * extra), N).expand_as(scores)
    ordered = scores.gather(-1, order)
    pooled = F.max_pool1d(ordered.reshape(-1, 1, N), kernel_size=kernel, stride=1, padding=kernel // 2)
    pooled = pooled.reshape(scores.shape)
    return torch.empty_like(scores).scatter_(-1, order, pooled)


def require_queries(x: ScoreInput, policy: str) -> torch.Tensor:
    if x.queries is None:
        raise ValueError(f"policy '{policy}' needs ScoreInput.queries (the last query_window post-RoPE queries "
                         "per layer); the engine did not provide them")
    B, L, Hkv, N, d = x.keys.shape
    q = x.queries
    if q.dim() != 5 or q.shape[0] != B or q.shape[1] != L or q.shape[-1] != d or q.shape[2] != x.num_q_heads:
        raise ValueError(f"queries have shape {tuple(q.shape)}, expected [B={B}, L={L}, H_q={x.num_q_heads}, w, "
                         f"d={d}]")
    return q


class SnapKVPolicy(Policy):
    name = "snapkv"
    needs_attention = True
    needs_queries = True

    kernel = POOL_KERNEL

    def score(self, x: ScoreInput) -> torch.Tensor:
        q = require_queries(x, self.name)
        attn = window_attention(q, x.keys, x.positions, x.logical_len)  # [B, L, Hkv, g, N]
        attn = attn.amax(dim=3)  # GQA max (commutes with max-pooling)
        return pool_along_positions(attn, x.positions, self.kernel)
