"""H2O (heavy hitters): keep the tokens with the largest attention accumulated over every decode step.

This is the policy that forces the eager fallback: every decode step must materialize attention weights and add
them into ``attn_accum``. :func:`accumulate_attention` is that per-step computation (its cost is what the
benchmarks charge H2O for); the engine calls it once per decode step with the step's post-RoPE queries.
"""

from __future__ import annotations

import math

import torch

from kvcompact.policies.base import Policy, ScoreInput
from kvcompact.policies.snapkv import group_queries


def accumulate_attention(acc: torch.Tensor, q: torch.Tensor, k: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Add one decode step's attention into ``acc`` and return it (in place).

    acc [B, L, H_kv, N] float32; q [B, L, H_q, s, d] post-RoPE queries of this step (s = 1 in decode);
    k [B, L, H_kv, N, d] post-RoPE cached keys (including this step's); valid [B, L, H_kv, N] bool.
    Adds softmax(q k^T / sqrt(d)) over the valid slots, summed over the query heads of each GQA group and over
    the s query rows. Slots that are not valid receive 0.
    """
    B, L, Hkv, N, d = k.shape
    qg = group_queries(q.to(k.dtype), Hkv)  # [B, L, Hkv, g, s, d]
    logits = torch.einsum("blkgsd,blknd->blkgsn", qg, k) / math.sqrt(d)
    logits = logits.masked_fill(~valid[:, :, :, None, None, :], float("-inf"))
    probs = torch.nan_to_num(torch.softmax(logits.float(), dim=-1), nan=0.0)
    acc += probs.sum(dim=(3, 4)).to(acc.dtype)
    return acc


class H2OPolicy(Policy):
    """score = accumulated attention (summed over the GQA group), one score per KV head."""

    name = "h2o"
    needs_attention = True
    needs_attn_accum = True

    def score(self, x: ScoreInput) -> torch.Tensor:
        if x.attn_accum is None:
            raise ValueError("policy 'h2o' needs ScoreInput.attn_accum (attention accumulated every decode step "
                             "with kvcompact.policies.h2o.accumulate_attention); the engine did not provide it")
        if tuple(x.attn_accum.shape) != tuple(x.positions.shape):
            raise ValueError(f"attn_accum has shape {tuple(x.attn_accum.shape)}, expected "
                             f"{tuple(x.positions.shape)} [B, L, H_kv, N]")
        return x.attn_accum.float()
