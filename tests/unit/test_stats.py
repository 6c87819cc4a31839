"""QueryStats format: round trip, fingerprint checks, published TriAttention format in both directions."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from transformers import LlamaConfig, Qwen3Config

from kvcompact.stats import ModelFingerprint, QueryStats, StatsError, load_stats, save_stats


def fingerprint(**over):
    base = dict(num_layers=3, num_attention_heads=4, num_kv_heads=2, head_dim=16, rope_style="neox",
                rope_theta=10000.0, rope_type="default", rope_scaling="none", rotary_dim=16, model_name="tiny")
    base.update(over)
    return ModelFingerprint(**base)


def random_stats(seed=0, **over):
    g = torch.Generator().manual_seed(seed)
    fp = fingerprint(**over)
    shape = (fp.num_layers, fp.num_attention_heads, fp.head_dim // 2)
    qm = torch.complex(torch.randn(shape, generator=g), torch.randn(shape, generator=g))
    m = qm.abs() + torch.rand(shape, generator=g)
    return QueryStats(qm, m, fp, num_tokens=1234, info={"text": "x.txt"})


def test_round_trip(tmp_path):
    s = random_stats()
    save_stats(s, tmp_path / "a" / "s.pt")
    r = load_stats(tmp_path / "a" / "s.pt")
    assert torch.equal(r.q_mean, s.q_mean) and torch.equal(r.q_abs_mean, s.q_abs_mean)
    assert r.q_mean.dtype == torch.complex64 and r.q_abs_mean.dtype == torch.float32
    assert r.fingerprint == s.fingerprint
    assert r.num_tokens == 1234 and r.info["text"] == "x.txt"
    assert (r.concentration <= 1.0 + 1e-6).all() and (r.concentration >= 0).all()


@pytest.mark.parametrize("field,value,expect", [
    ("num_kv_heads", 3, "stats were made for num_kv_heads=2, the model has 3"),
    ("num_layers", 30, "num_layers=3, the model has 30"),
    ("head_dim", 64, "head_dim=16, the model has 64"),
    ("rope_theta", 1e5, "rope_theta=10000.0, the model has 100000.0"),
    ("rope_style", "interleaved", "rope_style='neox', the model has 'interleaved'"),
    ("rope_scaling", '{"factor": 8.0, "rope_type": "llama3"}', "rope_scaling="),
    ("rotary_dim", 8, "rotary_dim=16, the model has 8"),
])
def test_check_compatible_names_the_differing_field(tmp_path, field, value, expect):
    s = random_stats()
    s.save(tmp_path / "s.pt")
    model_fp = dataclasses.replace(s.fingerprint, **{field: value}, model_name="other")
    with pytest.raises(StatsError) as e:
        load_stats(tmp_path / "s.pt", model_fp)
    assert expect in str(e.value)
    # the same model (only the informational name differs) is accepted
    load_stats(tmp_path / "s.pt", dataclasses.replace(s.fingerprint, model_name="renamed"))


def test_fingerprint_from_hf_config():
    cfg = LlamaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=3,
                      head_dim=16, rope_theta=10000.0)
    fp = ModelFingerprint.from_hf_config(cfg, model_name="m")
    assert fp == fingerprint(model_name="m")
    scaled = LlamaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=3,
                         head_dim=16, max_position_embeddings=8192,
                         rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                       "high_freq_factor": 4.0, "original_max_position_embeddings": 1024})
    fps = ModelFingerprint.from_hf_config(scaled, model_name="m")
    assert fps.rope_type == "llama3" and '"factor": 8.0' in fps.rope_scaling
    assert [d[0] for d in fp.differences(fps)] == ["rope_type", "rope_scaling"]
    q3 = Qwen3Config(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2,
                     head_dim=32)
    assert ModelFingerprint.from_hf_config(q3).head_dim == 32


def test_stats_shape_must_match_fingerprint():
    s = random_stats()
    with pytest.raises(StatsError, match="num_attention_heads=4 but the fingerprint says 8"):
        QueryStats(s.q_mean, s.q_abs_mean, dataclasses.replace(s.fingerprint, num_attention_heads=8))
    with pytest.raises(StatsError, match="complex"):
        QueryStats(s.q_abs_mean, s.q_abs_mean, s.fingerprint)


def published_payload(seed=1, L=2, H=3, F=8, with_counts=True):
    """A file as TriAttention's calibration script writes it (independent of our writer)."""
    g = torch.Generator().manual_seed(seed)
    stats = {}
    for layer in range(L):
        for head in range(H):
            re, im = torch.randn(F, generator=g), torch.randn(F, generator=g)
            stats[f"layer{layer:02d}_head{head:02d}"] = {
                "q_mean_real": re, "q_mean_imag": im,
                "q_abs_mean": torch.sqrt(re**2 + im**2) + torch.rand(F, generator=g),
            }
    metadata = {"num_traces": 1, "head_dim": 2 * F, "dtype": "bfloat16", "rope_style": "half",
                "rope_type": "default", "model_name": "Qwen3-8B", "rope_theta": 1000000.0,
                "sampled_heads": [[layer, head] for layer in range(L) for head in range(H)]}
    if with_counts:
        metadata.update(num_layers=L, num_attention_heads=H, num_kv_heads=1)
    return {"metadata": metadata, "stats": stats}


@pytest.mark.parametrize("with_counts", [True, False])
def test_published_format_loads_to_the_same_numbers(tmp_path, with_counts):
    payload = published_payload(with_counts=with_counts)
    torch.save(payload, tmp_path / "tri.pt")
    s = load_stats(tmp_path / "tri.pt")
    assert s.q_mean.shape == (2, 3, 8)
    for key, v in payload["stats"].items():
        layer, head = int(key[5:7]), int(key[12:14])
        assert torch.equal(s.q_mean[layer, head].real, v["q_mean_real"])
        assert torch.equal(s.q_mean[layer, head].imag, v["q_mean_imag"])
        assert torch.equal(s.q_abs_mean[layer, head], v["q_abs_mean"])
    fp = s.fingerprint
    assert (fp.num_layers, fp.num_attention_heads, fp.head_dim, fp.rope_style) == (2, 3, 16, "neox")
    assert fp.num_kv_heads == (1 if with_counts else None) and fp.rope_scaling is None
    # unrecorded fields are not compared; recorded ones are
    model = ModelFingerprint(num_layers=2, num_attention_heads=3, num_kv_heads=1, head_dim=16, rope_style="neox",
                             rope_theta=1e6, rope_type="default", rope_scaling="none", rotary_dim=16)
    s.check_compatible(model)
    with pytest.raises(StatsError, match="rope_theta=1000000.0, the model has 10000.0"):
        s.check_compatible(dataclasses.replace(model, rope_theta=1e4))


def test_our_file_is_readable_as_the_published_format(tmp_path):
    s = random_stats(seed=3)
    s.save(tmp_path / "ours.pt")
    raw = torch.load(tmp_path / "ours.pt", weights_only=True)  # what a TriAttention reader does
    md = raw["metadata"]
    assert md["rope_style"] == "half" and md["head_dim"] == 16 and md["num_layers"] == 3
    assert md["num_attention_heads"] == 4 and md["num_kv_heads"] == 2 and md["rope_theta"] == 10000.0
    v = raw["stats"]["layer02_head03"]
    assert torch.equal(v["q_mean_real"], s.q_mean[2, 3].real)
    assert torch.equal(v["q_mean_imag"], s.q_mean[2, 3].imag)
    assert torch.equal(v["q_abs_mean"], s.q_abs_mean[2, 3])
    # and re-imported without our block, the numbers are the same
    del md["kvcompact"]
    torch.save(raw, tmp_path / "stripped.pt")
    r = load_stats(tmp_path / "stripped.pt")
    assert torch.equal(r.q_mean, s.q_mean) and torch.equal(r.q_abs_mean, s.q_abs_mean)


def test_malformed_files_fail_clearly(tmp_path):
    with pytest.raises(StatsError, match="not found"):
        load_stats(tmp_path / "missing.pt")
    torch.save({"foo": 1}, tmp_path / "bad.pt")
    with pytest.raises(StatsError, match="not a stats file"):
        load_stats(tmp_path / "bad.pt")
    payload = published_payload()
    del payload["stats"]["layer01_head02"]
    torch.save(payload, tmp_path / "partial.pt")
    with pytest.raises(StatsError, match="missing e.g. layer01_head02"):
        load_stats(tmp_path / "partial.pt")
    payload = published_payload()
    payload["stats"]["layer00_head00"]["q_abs_mean"] = torch.zeros(5)
    torch.save(payload, tmp_path / "short.pt")
    with pytest.raises(StatsError, match="has 5 entries, expected 8"):
        load_stats(tmp_path / "short.pt")
    (tmp_path / "garbage.pt").write_bytes(b"not a torch file")
    with pytest.raises(StatsError, match="cannot read"):
        load_stats(tmp_path / "garbage.pt")


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("field", ["q_mean_real", "q_abs_mean"])
def test_non_finite_values_are_refused_naming_the_file_and_head(tmp_path, bad, field):
    """A NaN would make every score NaN, which selection turns into z = 0: the rounds would silently keep the
    most recent tokens without counting a scoring failure. Control: the same file with the value finite loads."""
    payload = published_payload()
    payload["stats"]["layer01_head02"][field][3] = bad
    path = tmp_path / "nonfinite.pt"
    torch.save(payload, path)
    with pytest.raises(StatsError) as e:
        load_stats(path)
    assert str(path) in str(e.value) and "layer01_head02" in str(e.value) and "NaN or infinite" in str(e.value)
    payload["stats"]["layer01_head02"][field][3] = 0.5
    torch.save(payload, path)
    assert load_stats(path).num_layers == 2


@pytest.mark.parametrize("meta,words", [({"num_layers": 10**9}, ["6 of 1000000000x3", "layer02_head00"]),
                                        ({"num_attention_heads": 10**12}, ["of 2x1000000000000", "layer00_head03"]),
                                        ({"num_layers": -4}, ["of -4x3"]),
                                        ({"num_layers": "many"}, ["not integers", "many"])])
def test_absurd_shapes_are_refused_before_anything_is_sized_by_them(tmp_path, meta, words):
    """A metadata claiming a billion layers is refused at once (within a second, no allocation by it) with the
    file's name; control: the true counts load."""
    import time

    payload = published_payload()
    payload["metadata"].update(meta)
    path = tmp_path / "absurd.pt"
    torch.save(payload, path)
    start = time.monotonic()
    with pytest.raises(StatsError) as e:
        load_stats(path)
    assert time.monotonic() - start < 1.0
    assert str(path) in str(e.value) and all(w in str(e.value) for w in words), str(e.value)
    payload["metadata"].update(num_layers=2, num_attention_heads=3)
    torch.save(payload, path)
    assert load_stats(path).num_heads == 3
