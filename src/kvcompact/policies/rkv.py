"""R-KV: importance from the query window minus redundancy among the cached keys.

score = LAMBDA * importance - (1 - LAMBDA) * redundancy, LAMBDA = 0.1 (docs/DESIGN.md, section 4.4).

* importance: like SnapKV (window attention averaged over the window, max-pooled with kernel 7 along position
  order), but the GQA group is reduced by its *mean*, as R-KV does.
* redundancy (R-KV's ``cal_similarity``): cosine similarity of every key to every other valid key of the same
  KV head, diagonal zeroed; for each key the similarity to its most recent (largest position) other key with
  similarity > 0.5 is zeroed too (R-KV keeps that newest near-duplicate out of the penalty); the row mean over
  the valid slots is normalized with a softmax over the valid slots. Unlike R-KV, a key with no similar
  partner zeroes nothing (R-KV would zero its similarity to slot 0 by accident).
Both terms sum to 1 over the valid slots of a head, which is what makes LAMBDA meaningful.
"""

from __future__ import annotations

import torch

from kvcompact.policies.base import Policy, ScoreInput
from kvcompact.policies.snapkv import POOL_KERNEL, pool_along_positions, require_queries, window_attention

LAMBDA = 0.1
SIMILARITY_THRESHOLD = 0.5


def redundancy(keys: torch.Tensor, positions: torch.Tensor, threshold: float = SIMILARITY_THRESHOLD
               ) -> torch.Tensor:
    """R-KV redundancy [B, L, H_kv, N] (softmax-normalized over valid slots; 0 on padding).

    Loops over layers only, to bound the N x N similarity memory to one layer at a time.
    """
    out = torch.zeros(positions.shape, dtype=torch.float32, device=keys.device)
    N = keys.shape[-2]
    eye = torch.eye(N, dtype=torch.bool, device=keys.device)
    for layer in range(keys.shape[1]):
        k = keys[:, layer].float()  # [B, Hkv, N, d]
        pos = positions[:, layer]  # [B, Hkv, N]
        valid = pos >= 0
        kn = k / (torch.linalg.vector_norm(k, dim=-1, keepdim=True) + 1e-8)
        cos = kn @ kn.transpose(-1, -2)  # [B, Hkv, N, N]
        pair = valid[..., :, None] & valid[..., None, :] & ~eye
        cos = torch.where(pair, cos, torch.zeros_like(cos))
        similar = pair & (cos > threshold)
        cand = torch.where(similar, pos[..., None, :].expand_as(cos), torch.full_like(cos, -1, dtype=pos.dtype))
        newest = cand.argmax(dim=-1, keepdim=True)  # slot of the most recent similar key per row
        has = similar.any(dim=-1, keepdim=True)
        cos = cos.scatter(-1, newest, torch.where(has, torch.zeros_like(newest, dtype=cos.dtype),
                                                  cos.gather(-1, newest)))
        n_valid = valid.sum(dim=-1, keepdim=True).clamp_min(1).to(cos.dtype)
        mean_sim = cos.sum(dim=-1) / n_valid
        mean_sim = mean_sim.masked_fill(~valid, float("-inf"))
        out[:, layer] = torch.nan_to_num(torch.softmax(mean_sim, dim=-1), nan=0.0)
    return out


class RKVPolicy(Policy):
    """One score per KV head."""

    name = "rkv"
    needs_attention = True
    needs_queries = True

    mix_lambda = LAMBDA
    kernel = POOL_KERNEL

    def score(self, x: ScoreInput) -> torch.Tensor:
        q = require_queries(x, self.name)
        attn = window_attention(q, x.keys, x.positions, x.logical_len).mean(dim=3)  # GQA mean -> [B, L, Hkv, N]
        importance = pool_along_positions(attn, x.positions, self.kernel)
        red = redundancy(x.keys, x.positions)
        return self.mix_lambda * importance - (1.0 - self.mix_lambda) * red
