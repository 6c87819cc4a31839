"""``kvcompact``'s exit codes: a usage error (a bad argument or value the user typed) exits 2 with one line on
stderr, ``kvcompact COMMAND: message``, from any subcommand; runtime failures exit 1. Engine-free: the benchmark
runs below stop at the tokenizer, which a valid invocation reaches and a refused one never does."""

from __future__ import annotations

import pytest

import kvcompact.tools.bench as bench
from kvcompact.tools.cli import EXIT_USAGE, UsageError, main


class Reached(Exception):
    """The run got past argument checking (to the tokenizer): no usage error."""


@pytest.fixture
def bench_run(monkeypatch, tmp_path):
    """``kvcompact bench ...`` up to the tokenizer: no vLLM import for the machine record, the bundled model never
    built, the environment bench sets restored afterwards."""
    for key, value in {"HF_HUB_OFFLINE": "1", "VLLM_HOST_IP": "127.0.0.1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
                       "VLLM_LOGGING_LEVEL": "WARNING", "TOKENIZERS_PARALLELISM": "false"}.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setattr(bench, "machine_info", lambda: {})
    monkeypatch.setattr("kvcompact.tools.model.ensure_default_model",
                        lambda: pytest.fail("a usage check built the bundled model"))

    def tokenizer(*_a, **_k):
        raise Reached

    transformers = pytest.importorskip("transformers")
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", tokenizer)
    return lambda *args: main(["bench", *args, "--out", str(tmp_path / "results")])


def test_unknown_variant_exits_2_and_a_known_one_runs(bench_run, tmp_path, capsys):
    model = tmp_path / "model"
    model.mkdir()
    assert bench_run("longgen", "--model", str(model), "--variants", "prompt,nope") == EXIT_USAGE
    err = capsys.readouterr().err.splitlines()
    assert err[-1] == "kvcompact bench longgen: unknown variant nope; known: default, serve, fixed, prompt, " \
                      "pressure, prompt_pressure, prompt_fewest, recall, random, greedy, recall_greedy, recall_fp8, " \
                      "per_layer, recall_per_layer, recall_layer"
    with pytest.raises(Reached):  # control: the same command with known variants gets past every check
        bench_run("longgen", "--model", str(model), "--variants", "prompt,default")


@pytest.mark.parametrize("variant, message", [
    ("recall_layer:recall_pages=x", "'recall_pages' in variant 'recall_layer:recall_pages=x' must be an integer, "
                                    "got 'x'"),
    ("recall_layer:nope=1", "unknown field 'nope'; known: "),
    ("recall_layer:recall_pages", "'recall_pages' is not field=value"),
    ("recall_layer:recall_pages=0", "variant 'recall_layer:recall_pages=0': kvcompact: 'recall_pages' must be"),
    ("recall_layer:selection=per_head", "variant 'recall_layer:selection=per_head': kvcompact: 'recall_at' layer"),
])
def test_a_variant_setting_that_is_not_a_valid_field_exits_2(bench_run, tmp_path, capsys, variant, message):
    """Every setting is refused before any engine starts: its type, its field, and the whole config it makes
    (a value only the config's own checks catch, and a combination of fields that is refused)."""
    model = tmp_path / "model"
    model.mkdir()
    assert bench_run("longgen", "--model", str(model), "--policy", "streaming", "--variants",
                     f"prompt,{variant}") == EXIT_USAGE
    assert message in capsys.readouterr().err.splitlines()[-1]
    with pytest.raises(Reached):  # control: valid settings of the same fields get past every check
        bench_run("longgen", "--model", str(model), "--policy", "streaming", "--variants",
                  "prompt,recall_layer:recall_pages=8:recall_margin=0.5")


def test_model_folder_that_is_not_there_exits_2(bench_run, tmp_path, capsys):
    assert bench_run("longgen", "--model", str(tmp_path / "nope")) == EXIT_USAGE
    err = capsys.readouterr().err.splitlines()
    assert err[-1].startswith(f"kvcompact bench: --model {tmp_path / 'nope'}: no such folder, and not a known model")


def test_triattention_without_statistics_exits_2(bench_run, tmp_path, capsys):
    model = tmp_path / "model"
    model.mkdir()
    assert bench_run("longgen", "--model", str(model), "--policy", "triattention") == EXIT_USAGE
    assert capsys.readouterr().err.splitlines()[-1] == ("kvcompact bench longgen: triattention needs statistics "
                                                        "for this model (--stats)")
    with pytest.raises(Reached):  # control: the same model under a policy that needs no statistics
        bench_run("longgen", "--model", str(model), "--policy", "streaming")


def test_unknown_benchmark_and_command_exit_2(capsys):
    assert main(["bench", "nope"]) == EXIT_USAGE
    assert "kvcompact bench: unknown benchmark 'nope'" in capsys.readouterr().err
    assert main(["nope"]) == EXIT_USAGE
    assert main(["bench", "--help"]) == 0  # control


def test_a_runtime_failure_is_not_a_usage_error(monkeypatch, capsys):
    """Only UsageError maps to 2: anything else a command raises is not swallowed into a usage exit."""
    import kvcompact.tools.capacity as capacity

    def boom(_argv):
        raise RuntimeError("server unreachable")

    monkeypatch.setattr(capacity, "main", boom)
    with pytest.raises(RuntimeError):
        main(["capacity"])

    def usage(_argv):
        raise UsageError("--memory: needs a unit")

    monkeypatch.setattr(capacity, "main", usage)
    assert main(["capacity"]) == EXIT_USAGE
    assert capsys.readouterr().err == "kvcompact capacity: --memory: needs a unit\n"
