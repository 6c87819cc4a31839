"""The models users serve, as tiny random-weight models built here from transformers configs (no hub): the
engine equals the transformers reference on Qwen3 (q/k-norm, head_dim 128: the TriAttention paper's family),
Qwen2 (QKV bias) and Gemma 3 (sliding-window layers interleaved with global ones), and the model features
kvcompact cannot compact exactly are refused at start-up by name, each next to the same model without the
feature (the control)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from bugs import generate_rope_at_slot_index, generate_window_by_slot
from engine import engine, round_events, worker_rounds
from kvcompact import reference
from kvcompact.config import ConfigError, KVCompactConfig
from kvcompact.tools.local_engine import set_compaction

BASE = dict(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=1024, tie_word_embeddings=False)
SMALL = {"budget": 40, "divide_length": 16, "window": 8}
PROMPT = list(range(3, 3 + 24))
NEW_TOKENS = 80


def build(tmp_path_factory, name: str, config_cls: str, scales: tuple[float, float, float] | None = None,
          **over) -> str:
    """A random-weight model saved to a folder. ``scales``: the standard deviations of the (embedding, other
    matrices, norm weights), for a model whose default init (matrices 0.08, norms as built) loops on one token."""
    import transformers

    torch.manual_seed(0)
    config = getattr(transformers, config_cls)(**{**BASE, **over})
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # random weights at a scale that keeps logits decisive (no greedy near-ties)
        for n, p in model.named_parameters():
            if scales is not None:
                p.normal_(0, scales[0] if "embed" in n else scales[1] if p.dim() == 2 else scales[2])
            elif p.dim() == 2:
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


# Gemma 3's shape in miniature: three sliding-window layers (window 64) and a global one, tied embeddings (as
# vLLM loads every Gemma 3). Its scaled, tied embedding makes the default init repeat one token; these scales
# give varied greedy outputs.
GEMMA3 = dict(num_hidden_layers=4, head_dim=32, sliding_window=64, tie_word_embeddings=True,
              layer_types=["sliding_attention"] * 3 + ["full_attention"])
WINDOWED = {"budget": 96, "divide_length": 32, "window": 64, "compaction": "repack"}


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory):
    return build(tmp_path_factory, "gemma3", "Gemma3TextConfig", scales=(0.02, 0.3, 3.0), **GEMMA3)


def greedy(n):
    from vllm import SamplingParams

    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, detokenize=False)


def stats_for(model_dir, tmp_path):
    from kvcompact.tools.calibrate import calibrate_model

    model = reference.load_model(model_dir)
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
    ref_model = reference.load_model(model_dir)
    with engine(cfg, model=model_dir, skip_tokenizer_init=True, max_model_len=256) as llm:
        for compaction in ("repack", "holefill"):
            set_compaction(llm, compaction)
            first = len(worker_rounds(llm))
            out = llm.generate([{"prompt_token_ids": PROMPT}], greedy(NEW_TOKENS), use_tqdm=False)
            tokens = list(out[0].outputs[0].token_ids)
            rounds = worker_rounds(llm)[first:]
            config = KVCompactConfig(**dict(cfg, compaction=compaction))
            ref, ref_rounds = reference.generate(ref_model, PROMPT, NEW_TOKENS, config)
            assert len(rounds) >= 3 and len(rounds) == len(ref_rounds)
            for a, b in zip(rounds, ref_rounds):
                assert torch.equal(a.keep, b.keep)
            assert tokens == ref, (arch, compaction)
            bad, _ = generate_rope_at_slot_index(ref_model, PROMPT, NEW_TOKENS, config,
                                                 keep_sets=[r.keep for r in rounds])
            assert bad != tokens


def engine_config(model_dir, **over):
    from vllm.engine.arg_utils import EngineArgs

    return EngineArgs(model=model_dir, skip_tokenizer_init=True, max_model_len=256, enable_prefix_caching=False,
                      **over).create_engine_config()


@pytest.mark.engine
def test_interleaved_sliding_window_engine_equals_reference(gemma3):
    """Gemma 3 in miniature, fp32, one KV-cache group (hybrid manager off), repack with window >= the layers'
    window: >= 3 rounds, the keep sets and tokens equal the transformers reference, whose windowed layers mask
    by logical position, and every round frees the block above the budget (the cache stays bounded). The
    control runs the engine with holefill (start-up refuses it; switched on the live engine, as a bug would):
    its tokens differ from the reference's on the same keep sets and equal a reference that windows over cache
    slots, which is what vLLM's kernel does and why holefill is refused."""
    cfg = dict(WINDOWED, policy="knorm")
    ref_model = reference.load_model(gemma3)
    with engine(cfg, model=gemma3, skip_tokenizer_init=True) as llm:  # one KV-cache group: the helper's default
        runs = {}
        for compaction in ("repack", "holefill"):
            set_compaction(llm, compaction)
            first, seen = len(worker_rounds(llm)), len(round_events(llm))
            out = llm.generate([{"prompt_token_ids": PROMPT}], greedy(220), use_tqdm=False)
            runs[compaction] = list(out[0].outputs[0].token_ids), worker_rounds(llm)[first:]
            if compaction == "repack":
                events = round_events(llm)[seen:]
    # 96 + 32 tokens = 4 blocks of 32 at each trigger, 3 after: one block back to the pool per round
    assert events and all((e.old_len, e.new_len, e.blocks_freed) == (128, 96, 1) for e in events)
    tokens, rounds = runs["repack"]
    ref, ref_rounds = reference.generate(ref_model, PROMPT, 220, KVCompactConfig(**cfg))
    assert len(rounds) >= 3 and len(rounds) == len(ref_rounds)
    for a, b in zip(rounds, ref_rounds):
        assert torch.equal(a.keep, b.keep)
    assert tokens == ref and len(set(tokens[-100:])) > 20  # not a model that repeats one token

    holefill = KVCompactConfig(**dict(cfg, compaction="holefill"))
    tokens, rounds = runs["holefill"]
    keep = [r.keep for r in rounds]
    assert len(rounds) >= 3
    assert tokens != reference.generate(ref_model, PROMPT, 220, holefill, keep_sets=keep)[0]
    assert tokens == generate_window_by_slot(ref_model, PROMPT, 220, holefill, keep_sets=keep)[0]


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
