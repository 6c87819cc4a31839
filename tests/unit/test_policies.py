"""Policies against direct NumPy references written independently here (loops, explicit positions)."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import torch

from kvcompact.config import ConfigError, KVCompactConfig
from kvcompact.policies import POLICY_CLASSES, make_policy, policy_class
from kvcompact.policies.base import ScoreInput
from kvcompact.policies.h2o import accumulate_attention
from kvcompact.policies.triattention import OFFSETS, TriAttentionPolicy
from kvcompact.rope import RopeSpec
from kvcompact.stats import ModelFingerprint, QueryStats
from support import FIXED

CFG = KVCompactConfig(**FIXED, budget=64, window=8)


# ---------------------------------------------------------------------------------------------- fixtures
def make_input(B=2, L=2, Hkv=2, Hq=4, N=24, d=16, w=4, seed=0, pad=(0, 5), shuffle=True, dtype=torch.float32):
    """Random keys; per (b, l, h) distinct positions in random slot order; request b has pad[b] padding slots."""
    rng = np.random.default_rng(seed)
    keys = rng.standard_normal((B, L, Hkv, N, d))
    positions = np.full((B, L, Hkv, N), -1, dtype=np.int64)
    t = np.zeros(B, dtype=np.int64)
    for b in range(B):
        n = N - pad[b]
        T = n + 40 + 13 * b  # logical length: some tokens were already evicted
        t[b] = T
        for l in range(L):
            for h in range(Hkv):
                pos = np.sort(rng.choice(T - w, size=n - w, replace=False))
                pos = np.concatenate([pos, np.arange(T - w, T)])  # the last w tokens are in the cache
                slots = rng.permutation(N)[:n] if shuffle else np.arange(n)
                positions[b, l, h, slots] = pos
    queries = rng.standard_normal((B, L, Hq, w, d))
    return ScoreInput(
        keys=torch.tensor(keys, dtype=dtype),
        positions=torch.tensor(positions),
        logical_len=torch.tensor(t),
        num_q_heads=Hq,
        queries=torch.tensor(queries, dtype=dtype),
    )


def np_inputs(x: ScoreInput):
    return (x.keys.double().numpy(), x.positions.numpy(), x.logical_len.numpy(),
            None if x.queries is None else x.queries.double().numpy())


def assert_close_on_valid(got: torch.Tensor, ref: np.ndarray, valid: np.ndarray, rtol=1e-5, atol=1e-6):
    got = got.double().numpy()
    assert got.shape == ref.shape
    np.testing.assert_allclose(got[valid], ref[valid], rtol=rtol, atol=atol)


# ---------------------------------------------------------------------------------------------- registry
def test_registry_covers_every_configured_policy_and_flags():
    assert set(POLICY_CLASSES) == {"streaming", "knorm", "random", "triattention", "snapkv", "h2o", "rkv"}
    for name, cls in POLICY_CLASSES.items():
        assert cls.name == name
    assert not any(POLICY_CLASSES[n].needs_attention for n in ("streaming", "knorm", "random", "triattention"))
    assert all(POLICY_CLASSES[n].needs_attention for n in ("snapkv", "h2o", "rkv"))
    assert POLICY_CLASSES["snapkv"].needs_queries and POLICY_CLASSES["rkv"].needs_queries
    assert POLICY_CLASSES["h2o"].needs_attn_accum and not POLICY_CLASSES["snapkv"].needs_attn_accum


def test_make_policy_unknown_name_lists_allowed():
    with pytest.raises(ConfigError, match="unknown policy 'nope'.*streaming.*triattention"):
        policy_class("nope")
    cfg = KVCompactConfig(**FIXED, budget=64, window=8)
    object.__setattr__(cfg, "policy", "nope")  # bypass validation, as a corrupted config would
    with pytest.raises(ConfigError, match="allowed: streaming, knorm"):
        make_policy(cfg)


def test_make_policy_triattention_without_stats_is_a_clear_error():
    with pytest.raises(ConfigError, match="triattention' needs calibrated query statistics.*stats_path"):
        make_policy(KVCompactConfig(**FIXED, policy="triattention", budget=64, window=8))


def test_make_policy_builds_each_policy():
    stats, rope = synthetic_stats(L=2, Hq=4, Hkv=2, rope=RopeSpec.default(16, 10000.0))
    for name in POLICY_CLASSES:
        pol = make_policy(CFG.replace(policy=name), stats=stats, rope=rope)
        assert pol.name == name
    # triattention with plain RoPE: the RopeSpec can be rebuilt from the stats' fingerprint
    pol = make_policy(CFG.replace(policy="triattention"), stats=stats)
    torch.testing.assert_close(pol.rope.inv_freq, rope.inv_freq)


def test_make_policy_loads_stats_path(tmp_path):
    stats, rope = synthetic_stats(L=2, Hq=4, Hkv=2, rope=RopeSpec.default(16, 10000.0))
    stats.save(tmp_path / "s.pt")
    pol = make_policy(CFG.replace(policy="triattention", stats_path=str(tmp_path / "s.pt")), rope=rope)
    x = make_input()
    ref = TriAttentionPolicy(CFG, stats, rope).score(x)
    torch.testing.assert_close(pol.score(x), ref)


# ---------------------------------------------------------------------------------------------- simple policies
def test_streaming_scores_recency_and_keeps_sinks_plus_recent():
    """StreamingLLM's keep set: the sinks (protected by selection for every policy) plus the most recent
    tokens; the score alone is the position."""
    from kvcompact.selection import select_keep

    x = make_input(seed=1)
    keys, pos, t, _ = np_inputs(x)
    pos = pos.copy()
    pos[0, 0, 0, 3] = 0
    pos[0, 0, 0, 7] = 2
    x = dataclasses.replace(x, positions=torch.tensor(pos))
    got = make_policy(CFG.replace(policy="streaming", n_sink=4)).score(x)
    assert_close_on_valid(got, pos.astype(np.float32), pos >= 0, rtol=0, atol=0)
    k = 10
    keep = select_keep(got[:1, :1, :1], x.positions[:1, :1, :1], x.logical_len[:1], torch.tensor([k]),
                       torch.tensor([0]), window=2, protect_prompt=False, mode="per_head", n_sink=4)[0, 0, 0]
    valid_pos = pos[0, 0, 0][pos[0, 0, 0] >= 0]
    sinks = [p for p in valid_pos if p < 4]
    recent = sorted([p for p in valid_pos if p >= 4])[-(k - len(sinks)):]
    assert set(pos[0, 0, 0][keep.numpy()].tolist()) == set(sinks) | set(recent)


def test_knorm_matches_reference():
    x = make_input(seed=2)
    got = make_policy(CFG.replace(policy="knorm")).score(x)
    keys, pos, _, _ = np_inputs(x)
    ref = np.zeros(pos.shape)
    for idx in np.ndindex(*pos.shape):
        ref[idx] = -math.sqrt(float(np.sum(keys[idx] ** 2)))
    assert_close_on_valid(got, ref, pos >= 0)
    # negative control: +norm would rank the other way
    assert not np.allclose(got.numpy()[pos >= 0], -ref[pos >= 0])


def np_lowbias32(x):
    """Wellons' lowbias32 in NumPy uint32 (wrapping arithmetic), written independently of the torch version."""
    x = np.asarray(x, dtype=np.uint32)
    with np.errstate(over="ignore"):
        x = x ^ (x >> np.uint32(16))
        x = x * np.uint32(0x7FEB352D)
        x = x ^ (x >> np.uint32(15))
        x = x * np.uint32(0x846CA68B)
        x = x ^ (x >> np.uint32(16))
    return x


def np_random_score(seed, layer, head, pos):
    p = np.uint64(np.int64(pos).astype(np.uint64))
    h = np_lowbias32(np.uint32(seed & 0xFFFFFFFF) ^ np.uint32(seed >> 32))
    h = np_lowbias32(h ^ np.uint32(layer))
    h = np_lowbias32(h ^ np.uint32(head))
    h = np_lowbias32(h ^ np.uint32(p & np.uint64(0xFFFFFFFF)))
    h = np_lowbias32(h ^ np.uint32(p >> np.uint64(32)))
    return np.float32(int(h >> np.uint32(8)) / float(1 << 24))


def test_random_is_a_hash_of_seed_layer_head_position():
    x = make_input(seed=3, N=512, pad=(0, 7))
    pol = make_policy(CFG.replace(policy="random", seed=7))
    a = pol.score(x)
    assert a.shape == x.positions.shape and a.dtype == torch.float32
    # NumPy reference, slot by slot (padding slots are masked by selection: not compared)
    _, pos, _, _ = np_inputs(x)
    valid = pos >= 0
    ref = np.zeros(pos.shape, dtype=np.float32)
    for idx in zip(*np.nonzero(valid)):
        b, l, h, n = idx
        ref[idx] = np_random_score(7, l, h, pos[idx])
    assert_close_on_valid(a, ref, valid, rtol=0, atol=0)
    # uniform on [0, 1)
    v = a[x.positions >= 0]
    assert float(v.min()) >= 0.0 and float(v.max()) < 1.0 and abs(float(v.mean()) - 0.5) < 0.02
    # the generator is ignored, repeated rounds agree, a different seed differs
    g = dataclasses.replace(x, generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(pol.score(g), a, rtol=0, atol=0)
    torch.testing.assert_close(pol.score(x), a, rtol=0, atol=0)
    other = make_policy(CFG.replace(policy="random", seed=8)).score(x)
    assert (other[x.positions >= 0] != v).float().mean() > 0.99
    # layers and KV heads draw independently
    assert not torch.equal(a[0, 0, 0], a[0, 1, 0]) and not torch.equal(a[0, 0, 0], a[0, 0, 1])
    # positions beyond 2^32 use their high word too
    big = torch.tensor([[[[5, 5 + (1 << 32)]]]])
    s = pol.score(ScoreInput(keys=torch.zeros(1, 1, 1, 2, 4), positions=big, logical_len=torch.tensor([1 << 33]),
                             num_q_heads=1))
    assert s[0, 0, 0, 0] != s[0, 0, 0, 1]


def test_random_does_not_depend_on_batching_or_slot_order():
    """The engine batches requests and moves slots; the reference runs one request with its own slot order.
    Each token must get the same score either way, so the keep sets agree."""
    pol = make_policy(CFG.replace(policy="random", seed=3))
    x = make_input(seed=4, B=2, pad=(0, 5))
    batched = pol.score(x)
    for b in range(2):
        alone = dataclasses.replace(x, keys=x.keys[b:b + 1], positions=x.positions[b:b + 1],
                                    logical_len=x.logical_len[b:b + 1], queries=None)
        torch.testing.assert_close(pol.score(alone)[0], batched[b], rtol=0, atol=0)
        perm = torch.randperm(x.positions.shape[-1], generator=torch.Generator().manual_seed(b))
        shuffled = dataclasses.replace(alone, positions=alone.positions[..., perm])
        torch.testing.assert_close(pol.score(shuffled)[0], batched[b][..., perm], rtol=0, atol=0)


def test_random_restrict_maps_local_to_global_layers_and_heads():
    pol = make_policy(CFG.replace(policy="random"))
    x = make_input(seed=5, L=4, Hkv=4, Hq=8, pad=(0, 0))
    full = pol.score(x)
    part = pol.restrict(layers=[1, 3], kv_heads=[2, 3])
    y = dataclasses.replace(x, keys=x.keys[:, [1, 3]][:, :, [2, 3]], positions=x.positions[:, [1, 3]][:, :, [2, 3]],
                            queries=None, num_q_heads=4)
    torch.testing.assert_close(part.score(y), full[:, [1, 3]][:, :, [2, 3]], rtol=0, atol=0)
    with pytest.raises(ValueError, match="restricted random policy"):
        part.score(x)


# ---------------------------------------------------------------------------------------------- triattention
def synthetic_stats(L, Hq, Hkv, rope: RopeSpec, seed=0, F=None):
    rng = np.random.default_rng(seed)
    F = F or rope.num_bands
    qbar = rng.standard_normal((L, Hq, F)) + 1j * rng.standard_normal((L, Hq, F))
    m = np.abs(qbar) + rng.uniform(0.1, 2.0, size=(L, Hq, F))
    fp = ModelFingerprint(num_layers=L, num_attention_heads=Hq, num_kv_heads=Hkv, head_dim=rope.head_dim,
                          rope_style=rope.style, rope_theta=rope.rope_theta, rope_type="default",
                          rope_scaling="none", rotary_dim=rope.rotary_dim, model_name="synthetic")
    return QueryStats(torch.tensor(qbar, dtype=torch.complex64), torch.tensor(m, dtype=torch.float32), fp), rope


def np_rope(x, p, inv_freq, s, style, rotary_dim):
    """Explicit RoPE of one real vector x at position p, as transformers applies it (cos/sin carry s)."""
    x = np.asarray(x, dtype=np.float64)
    r = rotary_dim
    xr, xp = x[:r], x[r:]
    ang = p * np.asarray(inv_freq, dtype=np.float64)
    cos, sin = s * np.cos(ang), s * np.sin(ang)
    if style == "neox":
        h = r // 2
        cos2, sin2 = np.concatenate([cos, cos]), np.concatenate([sin, sin])
        rot_half = np.concatenate([-xr[h:], xr[:h]])
        out = xr * cos2 + rot_half * sin2
    else:
        out = np.empty_like(xr)
        out[0::2] = xr[0::2] * cos - xr[1::2] * sin
        out[1::2] = xr[1::2] * cos + xr[0::2] * sin
    return np.concatenate([out, xp])


def np_band_vector(z, style, rotary_dim, head_dim):
    """Complex bands [F] -> real head vector, per docs/DESIGN.md, section 4.2 (rotated bands first)."""
    _F, Fr = head_dim // 2, rotary_dim // 2
    x = np.zeros(head_dim)
    if style == "interleaved":
        x[0::2], x[1::2] = z.real, z.imag
        return x
    x[:Fr], x[Fr:rotary_dim] = z[:Fr].real, z[:Fr].imag
    P = (head_dim - rotary_dim) // 2
    x[rotary_dim:rotary_dim + P], x[rotary_dim + P:] = z[Fr:].real, z[Fr:].imag
    return x


def np_bands(x, style, rotary_dim, head_dim):
    _F, Fr = head_dim // 2, rotary_dim // 2
    if style == "interleaved":
        return x[0::2] + 1j * x[1::2]
    P = (head_dim - rotary_dim) // 2
    rot = x[:Fr] + 1j * x[Fr:rotary_dim]
    pas = x[rotary_dim:rotary_dim + P] + 1j * x[rotary_dim + P:]
    return np.concatenate([rot, pas])


def direct_triattention(stats: QueryStats, rope: RopeSpec, pre_keys, positions, t, Hq):
    """Direct cosine series: key j RoPE'd at its position p_j, the mean query RoPE'd at t+o for every offset,
    the logit is their dot product; norm term from the stored key's band magnitudes."""
    B, L, Hkv, N, d = pre_keys.shape
    g = Hq // Hkv
    inv, s, style, r = rope.inv_freq.double().numpy(), rope.attention_scaling, rope.style, rope.rotary_dim
    qbar = stats.q_mean.numpy().astype(np.complex128)
    m = stats.q_abs_mean.numpy().astype(np.float64)
    s_f = np.where(np.arange(d // 2) < r // 2, s, 1.0)
    stored = np.zeros_like(pre_keys)
    out = np.zeros((B, L, Hq, N))
    for b in range(B):
        for l in range(L):
            for hk in range(Hkv):
                for j in range(N):
                    stored[b, l, hk, j] = np_rope(pre_keys[b, l, hk, j], positions[b, l, hk, j], inv, s, style, r)
            for h in range(Hq):
                hk = h // g
                qvec = np_band_vector(qbar[l, h], style, r, d)
                q_at = [np_rope(qvec, t[b] + o, inv, s, style, r) for o in OFFSETS]
                for j in range(N):
                    K = stored[b, l, hk, j]
                    trig = np.mean([qo @ K for qo in q_at])
                    Kf = np_bands(K, style, r, d)
                    # the stored key carries one factor s already: E|q_rot_f| = s_f m_f
                    norm = np.sum(s_f * (m[l, h] - np.abs(qbar[l, h])) * np.abs(Kf))
                    out[b, l, h, j] = trig + norm
    return stored, out


TRI_CASES = {
    "neox": dict(style="neox", rotary_dim=16, s=1.0),
    "interleaved": dict(style="interleaved", rotary_dim=16, s=1.0),
    "neox_partial_yarn_scale": dict(style="neox", rotary_dim=8, s=1.3),
    "interleaved_partial": dict(style="interleaved", rotary_dim=12, s=1.0),
}


def tri_setup(case, seed=0, B=2, L=2, Hkv=2, Hq=4, N=12, d=16):
    c = TRI_CASES[case]
    rope = RopeSpec.default(d, 10000.0, c["rotary_dim"], c["style"], attention_scaling=c["s"])
    stats, _ = synthetic_stats(L, Hq, Hkv, rope, seed=seed)
    rng = np.random.default_rng(seed + 100)
    pre = rng.standard_normal((B, L, Hkv, N, d))
    t = np.array([5000, 123457][:B])  # large t: phases need float64
    positions = np.stack([rng.choice(int(tb), size=(L, Hkv, N), replace=True) for tb in t])
    stored, ref = direct_triattention(stats, rope, pre, positions, t, Hq)
    x = ScoreInput(keys=torch.tensor(stored, dtype=torch.float32), positions=torch.tensor(positions),
                   logical_len=torch.tensor(t), num_q_heads=Hq)
    return stats, rope, x, ref


@pytest.mark.parametrize("case", list(TRI_CASES))
def test_triattention_fold_equals_direct_cosine_series(case):
    stats, rope, x, ref = tri_setup(case)
    got = TriAttentionPolicy(CFG, stats, rope).score(x).double().numpy()
    assert got.shape == ref.shape
    scale = np.abs(ref).max()
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5 * scale)


@pytest.mark.parametrize("case", ["neox", "neox_partial_yarn_scale"])
def test_triattention_negative_control_wrong_rotation_sign(case):
    stats, rope, x, ref = tri_setup(case)
    pol = TriAttentionPolicy(CFG, stats, rope)
    pol._freqs = -pol._freqs  # exp(-i t w) instead of exp(+i t w)
    pol._device_cache = {}
    got = pol.score(x).double().numpy()
    assert np.abs(got - ref).max() > 1e-2 * np.abs(ref).max()


def test_triattention_negative_control_wrong_band_pairing():
    stats, rope, x, ref = tri_setup("neox")
    wrong = RopeSpec.default(16, 10000.0, 16, "interleaved")
    fp = dataclasses.replace(stats.fingerprint, rope_style="interleaved")
    got = TriAttentionPolicy(CFG, dataclasses.replace(stats, fingerprint=fp), wrong).score(x).double().numpy()
    assert np.abs(got - ref).max() > 1e-2 * np.abs(ref).max()


def test_triattention_rejects_mismatched_rope_and_shapes():
    stats, rope, x, _ = tri_setup("neox")
    with pytest.raises(ValueError, match="rope_style"):
        TriAttentionPolicy(CFG, stats, RopeSpec.default(16, 10000.0, 16, "interleaved"))
    with pytest.raises(ValueError, match="head_dim"):
        TriAttentionPolicy(CFG, stats, RopeSpec.default(32, 10000.0))
    pol = TriAttentionPolicy(CFG, stats, rope)
    with pytest.raises(ValueError, match="restrict"):
        pol.score(dataclasses.replace(x, keys=x.keys[:, :1], positions=x.positions[:, :1]))


def test_triattention_restrict_to_pipeline_stage_and_tp_rank():
    stats, rope, x, _ = tri_setup("neox")
    full = TriAttentionPolicy(CFG, stats, rope).score(x)
    # PP stage holding layer 1 only
    pp = TriAttentionPolicy(CFG, stats, rope).restrict(layers=[1])
    x1 = dataclasses.replace(x, keys=x.keys[:, 1:], positions=x.positions[:, 1:])
    torch.testing.assert_close(pp.score(x1), full[:, 1:])
    # TP rank holding KV head 1 -> query heads 2, 3
    tp = TriAttentionPolicy(CFG, stats, rope).restrict(q_heads=[2, 3])
    x2 = dataclasses.replace(x, keys=x.keys[:, :, 1:], positions=x.positions[:, :, 1:], num_q_heads=2)
    torch.testing.assert_close(tp.score(x2), full[:, :, 2:])


def test_triattention_pass_through_bands_are_frequency_zero():
    """Partial rotary: the pass-through part of the score is exactly qbar . k on those dims, for any t."""
    d, r = 16, 8
    rope = RopeSpec.default(d, 10000.0, r, "neox")
    stats, _ = synthetic_stats(1, 1, 1, rope, seed=4)
    qm = stats.q_mean.clone()
    qm[..., : r // 2] = 0  # rotated bands off
    st = QueryStats(qm, qm.abs(), stats.fingerprint)  # m = |qbar|: no norm term
    keys = torch.randn(1, 1, 1, 5, d)
    qvec = np_band_vector(qm[0, 0].numpy().astype(np.complex128), "neox", r, d)
    for t in (0, 77, 10**6):
        x = ScoreInput(keys=keys, positions=torch.zeros(1, 1, 1, 5, dtype=torch.long), logical_len=torch.tensor([t]),
                       num_q_heads=1)
        got = TriAttentionPolicy(CFG, st, rope).score(x)[0, 0, 0].double().numpy()
        np.testing.assert_allclose(got, keys[0, 0, 0].double().numpy() @ qvec, rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------------------------------- attention-based
def np_window_attention(keys, pos, t, queries, b, l, h_q, Hkv):
    """mean over the window of softmax(q k / sqrt d) over valid, causal slots of KV head h_q // g."""
    Hq, w, d = queries.shape[2], queries.shape[3], queries.shape[4]
    hk = h_q // (Hq // Hkv)
    N = keys.shape[3]
    acc = np.zeros(N)
    for i in range(w):
        qpos = t[b] - w + i
        ok = [(pos[b, l, hk, j] >= 0) and (pos[b, l, hk, j] <= qpos) for j in range(N)]
        logits = np.array([queries[b, l, h_q, i] @ keys[b, l, hk, j] / math.sqrt(d) if ok[j] else -np.inf
                           for j in range(N)])
        e = np.exp(logits - logits[np.isfinite(logits)].max())
        acc += e / e.sum()
    return acc / w


def np_pool_in_position_order(vals, positions, kernel=7):
    order = np.argsort(positions, kind="stable")
    v = vals[order]
    n, half = len(v), kernel // 2
    pooled = np.array([v[max(0, i - half):min(n, i + half + 1)].max() for i in range(n)])
    out = np.empty(n)
    out[order] = pooled
    return out


def ref_snapkv(x: ScoreInput):
    keys, pos, t, q = np_inputs(x)
    B, L, Hkv, N, _ = keys.shape
    Hq = q.shape[2]
    g = Hq // Hkv
    out = np.zeros((B, L, Hkv, N))
    for b in range(B):
        for l in range(L):
            for hk in range(Hkv):
                per_q = [np_window_attention(keys, pos, t, q, b, l, hk * g + i, Hkv) for i in range(g)]
                out[b, l, hk] = np_pool_in_position_order(np.max(per_q, axis=0), pos[b, l, hk])
    return out


def test_snapkv_matches_reference():
    x = make_input(seed=5)
    got = make_policy(CFG.replace(policy="snapkv")).score(x)
    ref = ref_snapkv(x)
    assert_close_on_valid(got, ref, x.positions.numpy() >= 0)


def test_snapkv_slot_permutation_equivariant_and_causal_mask_matters():
    x = make_input(seed=6, shuffle=False)
    pol = make_policy(CFG.replace(policy="snapkv"))
    base = pol.score(x)
    perm = torch.randperm(x.keys.shape[3], generator=torch.Generator().manual_seed(0))
    xp = dataclasses.replace(x, keys=x.keys[:, :, :, perm], positions=x.positions[:, :, :, perm])
    valid = xp.positions >= 0  # padding slots may hold anything
    torch.testing.assert_close(pol.score(xp)[valid], base[..., perm][valid])
    # negative control: without the causal mask the window queries would see "future" window keys
    from kvcompact.policies.snapkv import window_attention
    a = window_attention(x.queries, x.keys, x.positions, x.logical_len, causal=True)
    b = window_attention(x.queries, x.keys, x.positions, x.logical_len, causal=False)
    assert not torch.allclose(a, b)


def test_snapkv_requires_queries():
    x = make_input()
    with pytest.raises(ValueError, match="needs ScoreInput.queries"):
        make_policy(CFG.replace(policy="snapkv")).score(dataclasses.replace(x, queries=None))


def test_h2o_accumulate_attention_matches_reference():
    x = make_input(seed=7)
    keys, pos, _, _ = np_inputs(x)
    B, L, Hkv, N, d = keys.shape
    Hq = 4
    rng = np.random.default_rng(1)
    acc = torch.zeros(B, L, Hkv, N)
    ref = np.zeros((B, L, Hkv, N))
    for _step in range(3):
        q = rng.standard_normal((B, L, Hq, 1, d))
        accumulate_attention(acc, torch.tensor(q, dtype=torch.float32), x.keys, x.positions >= 0)
        for b in range(B):
            for l in range(L):
                for h in range(Hq):
                    hk = h // (Hq // Hkv)
                    valid = pos[b, l, hk] >= 0
                    logits = np.where(valid, keys[b, l, hk] @ q[b, l, h, 0] / math.sqrt(d), -np.inf)
                    e = np.exp(logits - logits[valid].max())
                    ref[b, l, hk] += e / e.sum()
    assert_close_on_valid(acc, ref, pos >= 0)
    assert float(acc[pos < 0].abs().max()) == 0.0
    got = make_policy(CFG.replace(policy="h2o")).score(dataclasses.replace(x, attn_accum=acc))
    torch.testing.assert_close(got, acc)
    with pytest.raises(ValueError, match="attn_accum"):
        make_policy(CFG.replace(policy="h2o")).score(x)


def ref_rkv(x: ScoreInput, lam=0.1, thr=0.5):
    keys, pos, t, q = np_inputs(x)
    B, L, Hkv, N, _ = keys.shape
    Hq = q.shape[2]
    g = Hq // Hkv
    out = np.zeros((B, L, Hkv, N))
    for b in range(B):
        for l in range(L):
            for hk in range(Hkv):
                p = pos[b, l, hk]
                attn = np.mean([np_window_attention(keys, pos, t, q, b, l, hk * g + i, Hkv) for i in range(g)], 0)
                imp = np_pool_in_position_order(attn, p)
                valid = np.where(p >= 0)[0]
                red_raw = np.full(N, -np.inf)
                for i in valid:
                    sims = {}
                    for j in valid:
                        if j == i:
                            continue
                        ki, kj = keys[b, l, hk, i], keys[b, l, hk, j]
                        sims[j] = ki @ kj / ((np.linalg.norm(ki) + 1e-8) * (np.linalg.norm(kj) + 1e-8))
                    similar = [j for j in sims if sims[j] > thr]
                    if similar:
                        sims[max(similar, key=lambda j: p[j])] = 0.0
                    red_raw[i] = sum(sims.values()) / len(valid)
                e = np.exp(red_raw - red_raw[valid].max())
                red = e / e.sum()
                out[b, l, hk] = lam * imp - (1 - lam) * red
    return out


def test_rkv_matches_reference():
    x = make_input(seed=8, d=4)  # small d: many key pairs above the 0.5 similarity threshold
    got = make_policy(CFG.replace(policy="rkv")).score(x)
    ref = ref_rkv(x)
    assert_close_on_valid(got, ref, x.positions.numpy() >= 0, rtol=1e-4, atol=1e-6)
    # negative control: the retention rule matters on this data
    ref_no_retain = ref_rkv(x, thr=2.0)
    assert not np.allclose(ref_no_retain[x.positions.numpy() >= 0], ref[x.positions.numpy() >= 0], atol=1e-6)


def test_rkv_penalizes_duplicates():
    x = make_input(seed=9, B=1, L=1, Hkv=1, Hq=2, N=16, pad=(0,))
    keys = x.keys.clone()
    dups = [3, 5, 9, 12]
    for i, scale in zip(dups[1:], (2.0, 0.5, 1.5)):
        keys[0, 0, 0, i] = keys[0, 0, 0, 3] * scale  # same direction, different norm
    from kvcompact.policies.rkv import redundancy
    red = redundancy(keys, x.positions)[0, 0, 0]
    others = [i for i in range(16) if i not in dups]
    assert float(red[dups].min()) > float(red[others].max())
    torch.testing.assert_close(red.sum(), torch.tensor(1.0))


def test_needs_attention_label_per_policy():
    """Exported as kvcompact:policy_info{needs_attention=...}: true exactly for the attention-based baselines."""
    from prometheus_client import REGISTRY

    from kvcompact.vllm.metrics import Metrics

    expected = {"h2o": True, "snapkv": True, "rkv": True, "streaming": False, "knorm": False, "random": False,
                "triattention": False}
    assert {name: cls.needs_attention for name, cls in POLICY_CLASSES.items()} == expected
    for name, needs in expected.items():
        Metrics(KVCompactConfig(**FIXED, policy=name, budget=48, window=16), POLICY_CLASSES[name].needs_attention, "m",
                engine=0, block_size=32)
        labels = [s.labels for f in REGISTRY.collect() if f.name == "kvcompact:policy_info" for s in f.samples]
        assert [lab["needs_attention"] for lab in labels if lab["policy"] == name] == [str(needs).lower()]


def test_policy_info_says_whether_the_budget_grows_with_the_answer():
    """kvcompact:policy_info{budget_ratio=...}: an operator reading the budget label must know whether long answers
    keep more than it (control: the field's default exports 0.0)."""
    from prometheus_client import REGISTRY

    from kvcompact.vllm.metrics import Metrics

    def label(**fields) -> list[str]:
        Metrics(KVCompactConfig(**FIXED, budget=48, window=16, **fields), False, "m", engine=0, block_size=32)
        return [s.labels["budget_ratio"] for f in REGISTRY.collect() if f.name == "kvcompact:policy_info"
                for s in f.samples]

    assert label(budget_ratio=0.2, admission="greedy") == ["0.2"]
    assert label() == ["0.0"]
