"""RopeSpec against transformers' own RoPE, and calibration on tiny random models built here (no hub)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

transformers = pytest.importorskip("transformers")
from transformers import (  # noqa: E402
    GPTJConfig,
    LlamaConfig,
    LlamaForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
    StableLmConfig,
    StableLmForCausalLM,
)
from transformers.models.gptj import modeling_gptj  # noqa: E402
from transformers.models.llama import modeling_llama  # noqa: E402
from transformers.models.qwen3 import modeling_qwen3  # noqa: E402
from transformers.models.stablelm import modeling_stablelm  # noqa: E402

from kvcompact.rope import RopeSpec  # noqa: E402
from kvcompact.stats import ModelFingerprint, load_stats  # noqa: E402
from kvcompact.tools.calibrate import CalibrationError, _QueryAccumulator, calibrate, calibrate_model, main  # noqa: E402

BUNDLED = Path.home() / ".cache/kvcompact/models/SmolLM2-135M-Instruct"
SMALL = dict(vocab_size=64, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=512)


def tiny_llama(**over):
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**{**SMALL, "head_dim": 16, **over})).eval()


def tiny_qwen3(**over):
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(Qwen3Config(**{**SMALL, "head_dim": 16, **over})).eval()
    for layer in model.model.layers:  # non-trivial q-norm weights
        nn.init.uniform_(layer.self_attn.q_norm.weight, 0.5, 2.0)
    return model


def tiny_stablelm():
    torch.manual_seed(0)
    return StableLmForCausalLM(StableLmConfig(**SMALL, partial_rotary_factor=0.5)).eval()


def chunks(n_chunks=3, length=20, vocab=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (length,), generator=g) for _ in range(n_chunks)]


def set_constant_queries(model, seed=1):
    """q_proj := zero weight + bias b_l: every query of layer l is b_l, whatever the input."""
    g = torch.Generator().manual_seed(seed)
    biases = []
    for layer in model.model.layers:
        old = layer.self_attn.q_proj
        new = nn.Linear(old.in_features, old.out_features, bias=True)
        with torch.no_grad():
            new.weight.zero_()
            new.bias.copy_(torch.randn(old.out_features, generator=g))
        layer.self_attn.q_proj = new
        biases.append(new.bias.detach().clone())
    return biases


def np_bands(x: np.ndarray, style: str, rotary_dim: int) -> np.ndarray:
    """The band convention of docs/DESIGN.md, section 4.2, written independently of kvcompact.rope."""
    d = x.shape[-1]
    if style == "interleaved":
        return x[..., 0::2] + 1j * x[..., 1::2]
    fr, p = rotary_dim // 2, (d - rotary_dim) // 2
    rot = x[..., :fr] + 1j * x[..., fr:rotary_dim]
    pas = x[..., rotary_dim:rotary_dim + p] + 1j * x[..., rotary_dim + p:]
    return np.concatenate([rot, pas], axis=-1)


class RopeInputCapture:
    """Patch a modeling module's apply_rotary_pos_emb to record the query exactly as RoPE receives it."""

    def __init__(self, monkeypatch, module):
        self.queries: list[torch.Tensor] = []
        original = module.apply_rotary_pos_emb

        def spy(q, k, cos, sin, *args, **kwargs):
            self.queries.append(q.detach().float().clone())  # [B, H, T, d_rot]
            return original(q, k, cos, sin, *args, **kwargs)

        monkeypatch.setattr(module, "apply_rotary_pos_emb", spy)

    def per_layer(self, num_layers):
        # calls arrive layer by layer for every chunk: regroup as [L] lists of [B*T, H, d]
        out = [[] for _ in range(num_layers)]
        for i, q in enumerate(self.queries):
            out[i % num_layers].append(q.permute(0, 2, 1, 3).reshape(-1, q.shape[1], q.shape[3]))
        return [torch.cat(v).double().numpy() for v in out]


# ---------------------------------------------------------------------------------------------- RopeSpec
def test_bands_round_trip_and_convention():
    x = torch.randn(3, 5, 16, dtype=torch.float64)
    for style in ("neox", "interleaved"):
        for rot in (16, 8):
            spec = RopeSpec.default(16, 10000.0, rot, style)
            z = spec.bands(x)
            assert z.shape == (3, 5, 8)
            np.testing.assert_array_equal(z.numpy(), np_bands(x.numpy(), style, rot))
            torch.testing.assert_close(spec.unbands(z), x)


@pytest.mark.parametrize("rope_scaling", [
    None,
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 128},
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128},
    {"rope_type": "linear", "factor": 2.0},
])
def test_ropespec_matches_transformers_llama_rope(rope_scaling):
    cfg = LlamaConfig(**{**SMALL, "head_dim": 16, "rope_scaling": rope_scaling})
    spec = RopeSpec.from_hf_config(cfg)
    rotary = modeling_llama.LlamaRotaryEmbedding(cfg)
    torch.testing.assert_close(spec.inv_freq, rotary.inv_freq.float())
    assert spec.attention_scaling == pytest.approx(rotary.attention_scaling)
    if rope_scaling and rope_scaling["rope_type"] == "yarn":
        assert spec.attention_scaling > 1.0
    q = torch.randn(1, 4, 7, 16)
    pos = torch.tensor([[0, 1, 5, 100, 511, 3000, 77]])
    cos, sin = rotary(q, pos)
    want, _ = modeling_llama.apply_rotary_pos_emb(q, q, cos, sin)
    got = spec.apply(q, pos[:, None, :])
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_ropespec_partial_rotary_matches_stablelm():
    model = tiny_stablelm()
    spec = RopeSpec.from_model(model)
    assert (spec.style, spec.rotary_dim, spec.head_dim) == ("neox", 8, 16)
    assert spec == RopeSpec.from_hf_config(model.config)
    assert spec != RopeSpec.default(16, 10000.0)
    q = torch.randn(1, 4, 5, 16)
    pos = torch.tensor([[0, 3, 9, 200, 41]])
    cos, sin = model.model.rotary_emb(q, pos)
    rot, _ = modeling_stablelm.apply_rotary_pos_emb(q[..., :8], q[..., :8], cos, sin)
    want = torch.cat([rot, q[..., 8:]], dim=-1)
    torch.testing.assert_close(spec.apply(q, pos[:, None, :]), want, rtol=1e-4, atol=1e-4)


def test_ropespec_interleaved_partial_matches_gptj():
    cfg = GPTJConfig(vocab_size=64, n_embd=64, n_head=4, n_layer=2, rotary_dim=8, n_positions=512,
                     bos_token_id=0, eos_token_id=0)
    spec = RopeSpec.from_hf_config(cfg)
    assert (spec.style, spec.rotary_dim, spec.head_dim) == ("interleaved", 8, 16)
    q = torch.randn(1, 5, 4, 16)  # GPT-J layout [B, T, H, d]
    pos = torch.tensor([[0, 3, 9, 200, 41]])
    table = modeling_gptj.create_sinusoidal_positions(512, 8)[pos]  # [B, T, 8]
    sin, cos = torch.split(table, 4, dim=-1)
    rot = modeling_gptj.apply_rotary_pos_emb(q[..., :8], sin, cos)
    want = torch.cat([rot, q[..., 8:]], dim=-1)
    torch.testing.assert_close(spec.apply(q, pos[:, :, None]), want, rtol=1e-4, atol=1e-4)


@pytest.mark.skipif(not (BUNDLED / "config.json").is_file(), reason="bundled SmolLM2 checkpoint not built")
def test_ropespec_and_fingerprint_of_bundled_model():
    spec = RopeSpec.from_pretrained(str(BUNDLED))
    assert (spec.style, spec.head_dim, spec.rotary_dim, spec.attention_scaling) == ("neox", 64, 64, 1.0)
    torch.testing.assert_close(spec.inv_freq, RopeSpec.default(64, 1e5).inv_freq)
    cfg = json.loads((BUNDLED / "config.json").read_text())
    fp = ModelFingerprint.from_hf_config(transformers.AutoConfig.from_pretrained(str(BUNDLED)))
    assert (fp.num_layers, fp.num_attention_heads, fp.num_kv_heads, fp.head_dim) == (
        cfg["num_hidden_layers"], cfg["num_attention_heads"], cfg["num_key_value_heads"], 64)


# ---------------------------------------------------------------------------------------------- calibration
def test_llama_constant_queries_give_analytic_stats():
    model = tiny_llama()
    biases = set_constant_queries(model)
    stats = calibrate_model(model, chunks(), progress=False)
    assert stats.q_mean.shape == (2, 4, 8) and stats.num_tokens == 60
    for layer, b in enumerate(biases):
        z = np_bands(b.double().numpy().reshape(4, 16), "neox", 16)
        np.testing.assert_allclose(stats.q_mean[layer].numpy(), z, rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(stats.q_abs_mean[layer].numpy(), np.abs(z), rtol=1e-6, atol=1e-6)
    assert torch.allclose(stats.concentration, torch.ones(2, 4, 8))
    assert stats.fingerprint.num_kv_heads == 2 and stats.fingerprint.rope_style == "neox"


def test_qwen3_constant_queries_apply_the_q_norm():
    model = tiny_qwen3()
    biases = set_constant_queries(model)
    stats = calibrate_model(model, chunks(), progress=False)
    eps = model.config.rms_norm_eps
    for layer, b in enumerate(biases):
        q = b.double().numpy().reshape(4, 16)
        w = model.model.layers[layer].self_attn.q_norm.weight.detach().double().numpy()
        normed = q / np.sqrt(np.mean(q**2, axis=-1, keepdims=True) + eps) * w
        z = np_bands(normed, "neox", 16)
        np.testing.assert_allclose(stats.q_mean[layer].numpy(), z, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(stats.q_abs_mean[layer].numpy(), np.abs(z), rtol=1e-5, atol=1e-5)
        # negative control: stats of the raw projection (no q-norm) describe other queries
        raw = np_bands(q, "neox", 16)
        assert np.abs(raw - stats.q_mean[layer].numpy()).max() > 0.1


@pytest.mark.parametrize("build,module", [(tiny_llama, modeling_llama), (tiny_qwen3, modeling_qwen3)])
def test_random_model_stats_equal_the_queries_rope_receives(monkeypatch, build, module):
    model = build()
    cap = RopeInputCapture(monkeypatch, module)
    stats = calibrate_model(model, chunks(n_chunks=2, length=17), progress=False)
    per_layer = cap.per_layer(2)
    for layer, q in enumerate(per_layer):
        assert q.shape == (34, 4, 16)
        z = np_bands(q, "neox", 16)
        np.testing.assert_allclose(stats.q_mean[layer].numpy(), z.mean(0), rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(stats.q_abs_mean[layer].numpy(), np.abs(z).mean(0), rtol=1e-5, atol=1e-5)


def test_qwen3_calibration_without_q_norm_would_differ(monkeypatch):
    """Negative control on a random model: dropping the q-norm (the known trap) changes the statistics."""
    model = tiny_qwen3()
    good = calibrate_model(model, chunks(), progress=False)

    def skip_q_norm(self, attn, q):
        return q.reshape(*q.shape[:-1], self.num_heads, self.rope.head_dim).float()

    monkeypatch.setattr(_QueryAccumulator, "pre_rope_queries", skip_q_norm)
    bad = calibrate_model(model, chunks(), progress=False)
    assert (good.q_mean - bad.q_mean).abs().max() > 0.1


def test_partial_rotary_stablelm(monkeypatch):
    model = tiny_stablelm()
    biases = set_constant_queries(model)
    stats = calibrate_model(model, chunks(), progress=False)
    assert stats.q_mean.shape == (2, 4, 8) and stats.fingerprint.rotary_dim == 8
    for layer, b in enumerate(biases):
        z = np_bands(b.double().numpy().reshape(4, 16), "neox", 8)
        np.testing.assert_allclose(stats.q_mean[layer].numpy(), z, rtol=1e-6, atol=1e-6)
    # random weights: the rotated bands equal those of the queries RoPE receives
    model = tiny_stablelm()
    cap = RopeInputCapture(monkeypatch, modeling_stablelm)
    stats = calibrate_model(model, chunks(n_chunks=2), progress=False)
    for layer, q in enumerate(cap.per_layer(2)):
        assert q.shape[-1] == 8  # only the rotated dims go through RoPE
        z = np_bands(q, "neox", 8)
        np.testing.assert_allclose(stats.q_mean[layer, :, :4].numpy(), z.mean(0), rtol=1e-5, atol=1e-5)


def test_unsupported_attention_is_a_clear_error():
    model = tiny_llama()
    for layer in model.model.layers:
        layer.self_attn.q_proj = nn.Linear(64, 128)  # e.g. a gated query projection
    with pytest.raises(CalibrationError, match="q_proj produces 128 features"):
        calibrate_model(model, chunks(), progress=False)


def _char_tokenizer(text: str):
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    vocab = {ch: i for i, ch in enumerate(sorted(set(text)))}
    vocab["<unk>"] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>"), len(vocab)


def test_chunked_capture_equals_one_forward():
    """Chunks carry the KV cache, so a chunked run captures the same queries as one forward over the whole
    sequence (fp32); the control: independent chunks (each restarting without context) are caught."""
    model = tiny_llama()
    ids = chunks(1, length=96)[0]
    one = calibrate_model(model, [ids], progress=False)
    chunked = calibrate_model(model, [ids], chunk_len=32, progress=False)
    assert chunked.num_tokens == one.num_tokens == 96
    torch.testing.assert_close(chunked.q_mean, one.q_mean, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(chunked.q_abs_mean, one.q_abs_mean, rtol=1e-5, atol=1e-6)
    independent = calibrate_model(model, [ids[i:i + 32] for i in range(0, 96, 32)], progress=False)
    assert not torch.allclose(independent.q_mean, one.q_mean, rtol=1e-3, atol=1e-4)


def test_text_beyond_the_context_starts_a_new_sequence(tmp_path):
    text = "Long context calibration reads one sequence up to the model's context. " * 20
    (tmp_path / "text.txt").write_text(text)
    tok, vocab = _char_tokenizer(text)
    model = tiny_llama(vocab_size=vocab, max_position_embeddings=100)
    model.save_pretrained(tmp_path / "model")
    tok.save_pretrained(tmp_path / "model")
    stats = calibrate(tmp_path / "model", tmp_path / "text.txt", max_tokens=250, chunk_len=64, progress=False)
    assert (stats.info["sequence_len"], stats.info["sequences"]) == (100, 3)
    ids = tok(text, add_special_tokens=False)["input_ids"][:250]
    ref = calibrate_model(model, [ids[:100], ids[100:200], ids[200:]], progress=False)
    torch.testing.assert_close(stats.q_mean, ref.q_mean, rtol=1e-5, atol=1e-6)


def test_calibrate_from_directory_and_cli(tmp_path):
    text = "In the beginning was the word, and the word was with calibration. " * 20
    (tmp_path / "text.txt").write_text(text)
    tok, vocab = _char_tokenizer(text)
    model = tiny_llama(vocab_size=vocab)
    model.save_pretrained(tmp_path / "model")
    tok.save_pretrained(tmp_path / "model")
    stats = calibrate(tmp_path / "model", tmp_path / "text.txt", max_tokens=150, chunk_len=64, progress=False)
    assert stats.num_tokens == 150
    ids = tok(text, add_special_tokens=False)["input_ids"][:150]
    ref = calibrate_model(model, [ids], progress=False)  # one sequence: the chunks carry the KV cache
    assert stats.info["sequences"] == 1 and stats.info["chunk_len"] == 64
    torch.testing.assert_close(stats.q_mean, ref.q_mean, rtol=1e-5, atol=1e-5)
    assert main([str(tmp_path / "model"), "--text", str(tmp_path / "text.txt"),
                 "-o", str(tmp_path / "s.pt"), "--max-tokens", "150", "--chunk-len", "64",
                 "--no-progress"]) == 0
    fp = ModelFingerprint.from_hf_config(transformers.AutoConfig.from_pretrained(str(tmp_path / "model")))
    loaded = load_stats(tmp_path / "s.pt", fp)
    torch.testing.assert_close(loaded.q_mean, stats.q_mean)
