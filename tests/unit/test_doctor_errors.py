"""kvcompact doctor's tool errors and the CLI's help, through the real CLI, with no vLLM: an unreachable URL, an
HTTP server that is not vLLM and malformed metrics text (a tiny ``http.server`` stands in) each end in one line
and exit code 1. The verdicts against real servers: tests/engine/test_doctor_server.py."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from support.server import doctor, free_port

MODEL = "SmolLM2-135M-Instruct"


@pytest.fixture(scope="module")
def not_vllm(tmp_path_factory):
    """``python -m http.server`` on a directory: /nothing has no model list, /models-only has one but no
    /metrics, /broken serves a model list and metrics text with a bad line 3."""
    root = tmp_path_factory.mktemp("not_vllm")
    models = json.dumps({"object": "list", "data": [{"id": MODEL, "max_model_len": 512}]})
    for name, metrics in (("models-only", None), ("broken", 'vllm:ok 1\n# TYPE vllm:x gauge\nvllm:x{a="1" 2\n')):
        (root / name / "v1").mkdir(parents=True)
        (root / name / "v1" / "models").write_text(models)
        if metrics:
            (root / name / "metrics").write_text(metrics)
    (root / "nothing").mkdir()
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "http.server", "--bind", "127.0.0.1", str(port)], cwd=root,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        url = f"http://127.0.0.1:{port}"
        for _ in range(100):
            try:
                urllib.request.urlopen(url + "/broken/metrics", timeout=1).read()
                break
            except OSError:
                time.sleep(0.1)
        yield url
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.parametrize("where,message", [
    ("closed", "cannot reach http://127.0.0.1:"),
    ("/nothing", "is not an OpenAI-compatible endpoint (http://"),
    ("/models-only", "/models-only/metrics answers HTTP 404"),
    ("/broken", "/broken/metrics is malformed: line 3: expected ',' or '}' after label a"),
])
def test_tool_errors_are_one_line_and_exit_1(not_vllm, where, message):
    url = f"http://127.0.0.1:{free_port()}" if where == "closed" else not_vllm + where
    code, report, err = doctor("--url", url, "--interval", "0")
    assert err.startswith("kvcompact doctor: error: ") and err.count("\n") == 1 and message in err, err
    # --json: the error as the report a script reads (no verdict, exit code 1)
    assert code == report["exit_code"] == 1 and report["verdict"] is None and message in report["error"]


@pytest.mark.parametrize("command,expect", [("doctor", "--probe-tokens"), ("capacity", "--weight-bits")])
def test_cli_help(command, expect):
    kvcompact = Path(sys.executable).with_name("kvcompact")
    cli = [str(kvcompact)] if kvcompact.exists() else [sys.executable, "-m", "kvcompact.tools.cli"]
    r = subprocess.run([*cli, command, "--help"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and f"usage: kvcompact {command}" in r.stdout and expect in r.stdout, r.stderr
