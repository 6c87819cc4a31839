"""Policy registry: one class per name in :data:`kvcompact.config.POLICIES`.

``make_policy(config, stats, rope)`` builds the configured policy. Only ``triattention`` needs ``stats`` (a
:class:`kvcompact.stats.QueryStats`; when None, ``config.stats_path`` is loaded) and ``rope`` (a
:class:`kvcompact.rope.RopeSpec`; when None and the stats record plain, unscaled RoPE, it is rebuilt from the
stats' fingerprint). Check the stats against the served model with
``stats.check_compatible(ModelFingerprint.from_hf_config(hf_config))`` before scoring.
"""

from __future__ import annotations

from kvcompact.config import POLICIES, ConfigError, KVCompactConfig
from kvcompact.policies.base import Policy, ScoreInput
from kvcompact.policies.h2o import H2OPolicy, accumulate_attention
from kvcompact.policies.knorm import KNormPolicy
from kvcompact.policies.random import RandomPolicy
from kvcompact.policies.rkv import RKVPolicy
from kvcompact.policies.snapkv import SnapKVPolicy
from kvcompact.policies.streaming import StreamingPolicy
from kvcompact.policies.triattention import TriAttentionPolicy
from kvcompact.rope import RopeSpec
from kvcompact.stats import QueryStats

POLICY_CLASSES: dict[str, type[Policy]] = {
    cls.name: cls
    for cls in (StreamingPolicy, KNormPolicy, RandomPolicy, TriAttentionPolicy, SnapKVPolicy, H2OPolicy, RKVPolicy)
}
assert set(POLICY_CLASSES) == set(POLICIES), "registry and config.POLICIES disagree"


def policy_class(name: str) -> type[Policy]:
    try:
        return POLICY_CLASSES[name]
    except KeyError:
        raise ConfigError(f"kvcompact: unknown policy {name!r}; allowed: {', '.join(POLICY_CLASSES)}") from None


def make_policy(config: KVCompactConfig, stats: QueryStats | None = None, rope: RopeSpec | None = None) -> Policy:
    cls = policy_class(config.policy)
    if cls is not TriAttentionPolicy:
        return cls(config)
    if stats is None:
        if not config.stats_path:
            raise ConfigError(
                "kvcompact: policy 'triattention' needs calibrated query statistics: pass stats, or set "
                "'stats_path' (KVCOMPACT_STATS_PATH) to a file made by `kvcompact calibrate MODEL_DIR "
                "--text FILE -o stats.pt`")
        from kvcompact.stats import load_stats

        stats = load_stats(config.stats_path)
    if rope is None:
        fp = stats.fingerprint
        if fp.rope_scaling not in ("none", None) or fp.rope_type not in ("default", None) or \
                fp.rope_theta is None or fp.head_dim is None:
            raise ConfigError(
                "kvcompact: policy 'triattention' needs the model's RopeSpec (RopeSpec.from_hf_config(hf_config)); "
                f"it cannot be rebuilt from the stats alone (rope_type={fp.rope_type}, theta={fp.rope_theta})")
        rope = RopeSpec.default(fp.head_dim, fp.rope_theta, fp.rotary_dim, fp.rope_style or "neox")
    return TriAttentionPolicy(config, stats, rope)


__all__ = ["POLICY_CLASSES", "make_policy", "policy_class", "Policy", "ScoreInput", "accumulate_attention",
           "StreamingPolicy", "KNormPolicy", "RandomPolicy", "TriAttentionPolicy", "SnapKVPolicy", "H2OPolicy",
           "RKVPolicy"]
