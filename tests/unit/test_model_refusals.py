"""What start-up refuses on the models users serve, each by name next to the same model without the feature (the
control): windowed layers kvcompact cannot compact exactly, encoder-decoder / MLA / hybrid models, what the built
worker's attention layers really do, and statistics of another architecture. Tiny random-weight models from
transformers configs (support.models); the engine on those models: tests/engine/test_models.py."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from kvcompact import reference
from kvcompact.config import ConfigError, KVCompactConfig
from support.models import SMALL, WINDOWED, build, stats_for


def engine_config(model_dir, **over):
    from vllm.engine.arg_utils import EngineArgs

    return EngineArgs(model=model_dir, skip_tokenizer_init=True, max_model_len=256, enable_prefix_caching=False,
                      **over).create_engine_config()


def test_sliding_window_models_refused_by_rule(gemma3, tmp_path_factory):
    """What start-up refuses on a windowed model, each by name next to its control: every layer windowed
    (Mistral; controls: no window, and a window no shorter than the context), the hybrid manager's several
    groups, holefill and a recent window shorter than the layers' window (control: the Gemma 3 configuration
    the engine test runs), and TriAttention on per-layer-type RoPE."""
    from kvcompact.vllm.startup import check_engine_config

    config = KVCompactConfig(policy="streaming", **SMALL)
    windowed = build(tmp_path_factory, "mistral_w64", "MistralConfig", sliding_window=64)
    with pytest.raises(ConfigError, match="every layer has a sliding window \\(64 tokens\\).*--disable-sliding"):
        check_engine_config(config, engine_config(windowed))
    check_engine_config(config, engine_config(build(tmp_path_factory, "mistral", "MistralConfig",
                                                    sliding_window=None)))
    check_engine_config(config, engine_config(build(tmp_path_factory, "mistral_w4k", "MistralConfig",
                                                    sliding_window=4096)))

    good = KVCompactConfig(policy="streaming", **WINDOWED)
    one_group = engine_config(gemma3, disable_hybrid_kv_cache_manager=True)
    check_engine_config(good, one_group)
    with pytest.raises(ConfigError, match="--disable-hybrid-kv-cache-manager"):
        check_engine_config(good, engine_config(gemma3))
    with pytest.raises(ConfigError, match="'compaction' holefill"):
        check_engine_config(good.replace(compaction="holefill"), one_group)
    with pytest.raises(ConfigError, match="'window' \\(48\\) is shorter than this model's sliding window \\(64\\)"):
        check_engine_config(good.replace(window=48), one_group)
    from kvcompact.rope import RopeError

    with pytest.raises(RopeError, match="each layer type with its own RoPE"):
        check_engine_config(good.replace(policy="triattention", stats_path="unused.pt"), one_group)


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


PLAIN = SimpleNamespace(sliding_window=-1, sinks=None)
W32 = SimpleNamespace(sliding_window=32, sinks=None)


@pytest.mark.parametrize("impls, groups, over, words", [
    ([W32, W32], "sliding", {}, "a sliding-window KV-cache group \\(window 32"),
    ([SimpleNamespace(sliding_window=(31, 0), sinks=None), PLAIN], 1, {"compaction": "holefill"},
     "sliding-window layers \\(window 32\\) with compaction 'holefill'"),
    ([SimpleNamespace(sliding_window=64, sinks=None), PLAIN], 1, {}, "longer than 'window' \\(32\\)"),
    ([SimpleNamespace(sliding_window=-1, sinks=torch.zeros(4)), PLAIN], 1, {}, "attention sinks in layer 0"),
    ([PLAIN, PLAIN], 2, {}, "2 KV-cache groups"),
    # a backend whose impl has no sinks attribute (a rename in vLLM) stops start-up instead of skipping the check
    ([SimpleNamespace(sliding_window=-1), PLAIN], 1, {}, "attention layer 0: it has no impl.sinks"),
])
def test_worker_refuses_what_the_layers_really_do(impls, groups, over, words):
    """The built worker checks each attention layer's kernel settings (gpt-oss sinks, a window the config did
    not show) and vLLM's KV-cache groups; the controls are plain layers in one group, a windowed layer beside a
    global one with repack and a recent window covering it, and only windowed layers in a full-attention group
    (a pipeline stage of Gemma 3 may hold only local layers)."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec

    from kvcompact.vllm.startup import check_attention_layers

    def runner(impls, groups):
        names = [f"model.layers.{i}.self_attn.attn" for i in range(len(impls))]
        shape = dict(block_size=32, num_kv_heads=2, head_size=32, dtype=torch.float32)
        spec = SlidingWindowSpec(**shape, sliding_window=32) if groups == "sliding" else FullAttentionSpec(**shape)
        group = SimpleNamespace(layer_names=names, kv_cache_spec=spec)
        return SimpleNamespace(
            kv_cache_config=SimpleNamespace(kv_cache_groups=[group] * (1 if groups == "sliding" else groups)),
            compilation_config=SimpleNamespace(static_forward_context={
                n: SimpleNamespace(impl=impl, _k_scale_float=1.0) for n, impl in zip(names, impls)}),
            model_config=SimpleNamespace(max_model_len=256))

    config = KVCompactConfig(policy="streaming", **SMALL)
    check_attention_layers(config, runner([PLAIN, PLAIN], 1))
    check_attention_layers(config, runner([SimpleNamespace(sliding_window=(-1, -1), sinks=None), PLAIN], 1))
    check_attention_layers(config.replace(window=32), runner([W32, PLAIN], 1))
    check_attention_layers(config.replace(window=32), runner([W32, W32], 1))
    with pytest.raises(ConfigError, match=words):
        check_attention_layers(config.replace(window=32, **over), runner(impls, groups))


def test_stats_of_another_architecture_name_the_field(qwen3, qwen2, tmp_path):
    from kvcompact.round import build_policy
    from kvcompact.stats import StatsError

    path = stats_for(qwen3, tmp_path)
    qwen2_config = reference.load_model(qwen2).config
    with pytest.raises(StatsError, match="head_dim"):
        build_policy(KVCompactConfig(policy="triattention", stats_path=path, **SMALL), qwen2_config)
