"""The models users serve, as tiny random-weight models built here from transformers configs (no hub): the
engine equals the transformers reference on Qwen3 (q/k-norm, head_dim 128: the TriAttention paper's family) and
Qwen2 (QKV bias), and the model features kvcompact cannot compact exactly are refused at start-up by name, each
next to the same model without the feature (the control)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from engine import engine, worker_rounds
from kvcompact import hf
from kvcompact.config import ConfigError, KVCompactConfig
from kvcompact.local_engine import set_compaction

BASE = dict(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=1024, tie_word_embeddings=False)
SMALL = {"budget": 40, "divide_length": 16, "window": 8}
PROMPT = list(range(3, 3 + 24))
NEW_TOKENS = 80


def build(tmp_path_factory, name: str, config_cls: str, **over) -> str:
    import transformers

    torch.manual_seed(0)
    config = getattr(transformers, config_cls)(**{**BASE, **over})
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # random weights at a scale that keeps logits decisive (no greedy near-ties)
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.08)
    path = tmp_path_factory.mktemp(name)
    model.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    return build(tmp_path_factory, "qwen3", "Qwen3Config", head_dim=128)


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory):
    return build(tmp_path_factory, "qwen2", "Qwen2Config")


def greedy(n):
    from vllm import SamplingParams

    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, detokenize=False)


def stats_for(model_dir, tmp_path):
    from kvcompact.calibrate import calibrate_model

    model = hf.load_model(model_dir)
    g = torch.Generator().manual_seed(1)
    stats = calibrate_model(model, [torch.randint(0, 512, (256,), generator=g)], chunk_len=64, progress=False)
    path = tmp_path / "stats.pt"
    stats.save(str(path))
    return str(path)


@pytest.mark.engine
@pytest.mark.parametrize("arch, policy", [("qwen3", "triattention"), ("qwen2", "knorm")])
def test_engine_equals_reference(arch, policy, request, tmp_path):
    """fp32, >= 3 rounds, repack then holefill in one engine: the tokens and every keep set equal the
    transformers reference path's (which scores on its own); the control: RoPE at the slot index is caught."""
    model_dir = request.getfixturevalue(arch)
    cfg = dict(SMALL, policy=policy)
    if policy == "triattention":
        cfg["stats_path"] = stats_for(model_dir, tmp_path)
    reference = hf.load_model(model_dir)
    with engine(cfg, model=model_dir, skip_tokenizer_init=True, max_model_len=256) as llm:
        for compaction in ("repack", "holefill"):
            set_compaction(llm, compaction)
            first = len(worker_rounds(llm))
            out = llm.generate([{"prompt_token_ids": PROMPT}], greedy(NEW_TOKENS), use_tqdm=False)
            tokens = list(out[0].outputs[0].token_ids)
            rounds = worker_rounds(llm)[first:]
            config = KVCompactConfig(**dict(cfg, compaction=compaction))
            ref, ref_rounds = hf.generate(reference, PROMPT, NEW_TOKENS, config)
            assert len(rounds) >= 3 and len(rounds) == len(ref_rounds)
            for a, b in zip(rounds, ref_rounds):
                assert torch.equal(a.keep, b.keep)
            assert tokens == ref, (arch, compaction)
            bad, _ = hf.generate(reference, PROMPT, NEW_TOKENS, config, keep_sets=[r.keep for r in rounds],
                                 rope_at_slot_index=True)
            assert bad != tokens


def engine_config(model_dir, **over):
    from vllm.engine.arg_utils import EngineArgs

    return EngineArgs(model=model_dir, skip_tokenizer_init=True, max_model_len=256, enable_prefix_caching=False,
                      **over).create_engine_config()


def test_sliding_window_refused_unless_it_never_masks(tmp_path_factory):
    """A tiny Mistral with a 64-token window: refused at start-up naming the feature (the worker would window
    over compacted slots). Controls: the same model without a window, and with a window no shorter than the
    context (it never masks), start."""
    from kvcompact.vllm.startup import check_engine_config

    config = KVCompactConfig(policy="streaming", **SMALL)
    windowed = build(tmp_path_factory, "mistral_w64", "MistralConfig", sliding_window=64)
    with pytest.raises(ConfigError, match="sliding-window layers \\(window 64 < max_model_len 256"):
        check_engine_config(config, engine_config(windowed))
    check_engine_config(config, engine_config(build(tmp_path_factory, "mistral", "MistralConfig",
                                                    sliding_window=None)))
    check_engine_config(config, engine_config(build(tmp_path_factory, "mistral_w4k", "MistralConfig",
                                                    sliding_window=4096)))


@pytest.mark.parametrize("feature, words", [
    ({"is_encoder_decoder": True}, "encoder-decoder"),
    ({"use_mla": True}, "multi-head latent attention"),
    ({"is_hybrid": True}, "several KV-cache groups"),
])
def test_model_features_refused_by_name(feature, words):
    from kvcompact.vllm.startup import check_model

    def model(**over):
        values = {**dict(is_encoder_decoder=False, use_mla=False, is_hybrid=False, max_model_len=256), **over}
        return SimpleNamespace(get_sliding_window=lambda: None, **values)

    check_model(model())  # the control: a plain decoder-only model
    with pytest.raises(ConfigError, match=words):
        check_model(model(**feature))


@pytest.mark.parametrize("impl, groups, words", [
    (SimpleNamespace(sliding_window=32, sinks=None), 1, "sliding-window attention in layer 0 \\(window 32\\)"),
    (SimpleNamespace(sliding_window=(31, 0), sinks=None), 1, "sliding-window attention in layer 0"),
    (SimpleNamespace(sliding_window=-1, sinks=torch.zeros(4)), 1, "attention sinks in layer 0"),
    (SimpleNamespace(sliding_window=-1, sinks=None), 2, "2 KV-cache groups"),
])
def test_worker_refuses_what_the_layers_really_do(impl, groups, words):
    """The built worker checks each attention layer's kernel settings (gpt-oss sinks, a window the config did
    not show) and vLLM's KV-cache groups; the control is a plain layer in one group."""
    from kvcompact.vllm.startup import check_attention_layers

    def runner(impl, groups):
        group = SimpleNamespace(layer_names=["model.layers.0.self_attn.attn"])
        return SimpleNamespace(
            kv_cache_config=SimpleNamespace(kv_cache_groups=[group] * groups),
            compilation_config=SimpleNamespace(static_forward_context={group.layer_names[0]: SimpleNamespace(
                impl=impl)}),
            model_config=SimpleNamespace(max_model_len=256))

    check_attention_layers(runner(SimpleNamespace(sliding_window=-1, sinks=None), 1))
    check_attention_layers(runner(SimpleNamespace(sliding_window=(-1, -1), sinks=None), 1))
    with pytest.raises(ConfigError, match=words):
        check_attention_layers(runner(impl, groups))


def test_stats_of_another_architecture_name_the_field(qwen3, qwen2, tmp_path):
    from kvcompact.compaction import build_policy
    from kvcompact.stats import StatsError

    path = stats_for(qwen3, tmp_path)
    qwen2_config = hf.load_model(qwen2).config
    with pytest.raises(StatsError, match="head_dim"):
        build_policy(KVCompactConfig(policy="triattention", stats_path=path, **SMALL), qwen2_config)
