"""The wheel as a user installs it: built from this checkout, installed into a fresh Python 3.12 virtual
environment with nothing but its declared dependencies (from the package index), then run.

No torch and no vLLM in that environment: ``kvcompact --version``, ``kvcompact capacity`` with vLLM's spellings and the
accuracy gate's ``--help`` must work there, and a tool that needs an extra must name it. Skipped, saying why, only
when pip cannot reach a package index.
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from support import ROOT

pytestmark = [pytest.mark.wheel, pytest.mark.extended]

# Qwen3-32B's published config.json: 64 attention heads, 8 KV heads, 64 layers, context 40960
QWEN3_32B = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "head_dim": 128, "hidden_size": 5120,
             "intermediate_size": 25600, "max_position_embeddings": 40960, "num_attention_heads": 64,
             "num_hidden_layers": 64, "num_key_value_heads": 8, "tie_word_embeddings": False,
             "vocab_size": 151936, "torch_dtype": "bfloat16"}
NO_INDEX = ("Could not find a version", "No matching distribution", "Failed to establish a new connection",
            "Network is unreachable", "Temporary failure in name resolution")


def clean_env() -> dict[str, str]:
    """This process's environment without what points Python at the checkout (PYTHONPATH=src) or its venv."""
    return {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}


def python312() -> str:
    """A Python 3.12 interpreter: on PATH, or one pyenv installed."""
    home = os.path.expanduser("~/.pyenv/versions")
    for candidate in (shutil.which("python3.12"), *sorted(glob.glob(f"{home}/3.12*/bin/python3.12"))):
        if candidate and subprocess.run([candidate, "-c", "import sys; assert sys.version_info[:2] == (3, 12)"],
                                        capture_output=True).returncode == 0:
            return candidate
    pytest.fail("no Python 3.12 interpreter (pyproject.toml lists 3.12; pyenv install 3.12)")


@pytest.fixture(scope="module")
def venv(tmp_path_factory) -> Path:
    """A fresh 3.12 venv holding the wheel and what it declares, built from a copy of the sources (the checkout
    gets no build/ or egg-info)."""
    tmp = tmp_path_factory.mktemp("wheel")
    source = tmp / "source"
    source.mkdir()
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(ROOT / name, source)
    ignore = shutil.ignore_patterns("__pycache__", "*.egg-info")
    for name in ("src", "bench"):
        shutil.copytree(ROOT / name, source / name, ignore=ignore)
    # the build backend of this environment (setuptools >= 77, pyproject's build requirement), no isolation
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                        str(tmp / "dist"), str(source)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    wheel = next((tmp / "dist").glob("kvcompact-*.whl"))
    env = tmp / "venv"
    subprocess.run([python312(), "-m", "venv", str(env)], check=True, timeout=120, env=clean_env())
    r = subprocess.run([str(env / "bin" / "python"), "-m", "pip", "install", "-q", "--disable-pip-version-check",
                        str(wheel)], capture_output=True, text=True, timeout=600, env=clean_env())
    if r.returncode != 0 and any(s in r.stderr for s in NO_INDEX):
        pytest.skip(f"pip cannot reach a package index for the wheel's dependencies: {r.stderr.strip()[-300:]}")
    assert r.returncode == 0, r.stderr[-3000:]
    return env


def run(env: Path, *args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([str(env / "bin" / "kvcompact"), *args], capture_output=True, text=True, timeout=300,
                          cwd=cwd, env={**clean_env(), "HF_HUB_OFFLINE": "1"})


def test_the_environment_holds_only_the_declared_dependencies(venv):
    """What makes the tests below mean something: neither torch nor vLLM came with the wheel."""
    r = subprocess.run([str(venv / "bin" / "python"), "-c", "import importlib.util as u; "
                        "print([m for m in ('torch', 'vllm', 'kvcompact') if u.find_spec(m)])"],
                       capture_output=True, text=True, timeout=120, cwd=venv, env=clean_env())
    assert r.stdout.strip() == "['kvcompact']", r.stderr


def test_version_is_the_projects(venv, tmp_path):
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    r = run(venv, "--version", cwd=tmp_path)
    assert r.returncode == 0 and r.stdout.strip() == f"kvcompact {version}", r.stderr


def test_plan_with_vllms_flags(venv, tmp_path):
    model = tmp_path / "qwen3-32b"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(QWEN3_32B))
    r = run(venv, "capacity", "--model", str(model), "--memory", "80G", "--max_model_len", "32k", "-tp", "2",
            "--budget", "2048", "--weight-bits", "4", "--json", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    plan = json.loads(r.stdout)
    assert (plan["max_model_len"], plan["tensor_parallel_size"], plan["max_num_seqs"]) == (32000, 2, 1024)
    assert plan["kv_bytes_per_token"] == 2 * 64 * 8 * 128 * 2  # K and V, 64 layers, 8 KV heads, 128 dims, bf16
    # a usage error exits 2 with one line naming it (control: the same command with a budget serve refuses)
    r = run(venv, "capacity", "--model", str(model), "--memory", "80G", "--max-model-len", "32k", "-tp", "2",
            "--budget", "10", cwd=tmp_path)
    assert r.returncode == 2 and "'budget' (10)" in r.stderr and "Traceback" not in r.stderr


def test_the_accuracy_gate_runs_from_the_wheel(venv, tmp_path):
    r = run(venv, "bench", "accuracy", "--help", cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    text = " ".join(r.stdout.split())
    assert "usage: kvcompact bench accuracy" in text and "--gate" in text and "--tolerance" in text


def test_a_tool_that_needs_an_extra_names_it(venv, tmp_path):
    r = run(venv, "calibrate", "--help", cwd=tmp_path)
    assert r.returncode == 1 and "needs torch" in r.stderr and "kvcompact[tools]" in r.stderr, r.stderr[-2000:]
    assert "Traceback" not in r.stderr


def test_the_wheel_lists_every_package():
    """pyproject.toml lists the packages by hand (bench/ is mapped into kvcompact.bench): every package under
    src/ must be on that list, or the wheel would ship without it."""
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {".".join(p.parent.relative_to(ROOT / "src").parts) for p in (ROOT / "src").rglob("__init__.py")}
    assert found | {"kvcompact.bench"} == listed
