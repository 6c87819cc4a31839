"""Plain vLLM with the plugin, started as README's "Plain vLLM" section says, and what an operator reads from it.

One server for the module: README's block run as written (plus ``--port``, and ``FIXED_ARGS`` so that one request
runs a round), with neither ``PROMETHEUS_MULTIPROC_DIR`` nor any ``KVCOMPACT_*`` setting in the environment, but with
the variables Kubernetes injects for a Service named ``kvcompact`` and one misspelled setting (a pod's environment:
neither may stop vLLM).
Against it, vLLM's own client (``vllm bench serve``, the A/B recipe) sends one request with compression switched off
per request, then the same request with the server's configuration; the metrics after that must hold every series
README lists, with vLLM's ``engine`` label, and every series, label and label value the Grafana dashboard and the
Prometheus alert rules (``deploy/``) query. The checks that need no server (alert rules' scope, README's links, the
``vllm`` command fix, the engine process's series, the engine label): tests/unit/test_plain_vllm_no_server.py.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvcompact.tools.metrics_text import Metrics, parse_metrics
from support import FIXED, ROOT
from support.deploy import README, alert_rules, dashboard_queries
from support.server import Server, server

promql = pytest.importorskip("promql_parser")
pytestmark = [pytest.mark.engine, pytest.mark.alone]  # vLLM servers: scripts/test.sh runs the file alone

RECIPE = "### Plain vLLM: `vllm serve`, `vllm bench serve`"
VLLM = Path(sys.executable).parent / "kvcompact-vllm"  # vLLM's CLI, the package's own console script
MODEL = "SmolLM2-135M-Instruct"
# kubelet's service links for a Service named kvcompact (port 8000), and a misspelled KVCOMPACT_BUDGET
POD_ENV = {"KVCOMPACT_SERVICE_HOST": "10.96.0.12", "KVCOMPACT_SERVICE_PORT": "8000",
           "KVCOMPACT_PORT": "tcp://10.96.0.12:8000", "KVCOMPACT_PORT_8000_TCP": "tcp://10.96.0.12:8000",
           "KVCOMPACT_PORT_8000_TCP_PROTO": "tcp", "KVCOMPACT_PORT_8000_TCP_PORT": "8000",
           "KVCOMPACT_PORT_8000_TCP_ADDR": "10.96.0.12", "KVCOMPACT_BUDJET": "64"}
# README's recipe serves the default budget mode, pressure, which runs no round while the pool has room: with fixed
# rounds and the prompt compressed, the one 400-token request of each half of the A/B shows a round in its prefill.
FIXED_ARGS = ("--additional-config", json.dumps({"kvcompact": FIXED}))
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
    # "$@" receives FIXED_ARGS and the --port P that server() appends
    command = ["bash", "-c", f'cd {shlex.quote(str(ROOT))}\n{block} "$@"', "bash", *FIXED_ARGS]
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
