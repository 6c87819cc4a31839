"""README, the Grafana dashboard and the Prometheus alert rules (deploy/) as the tests read them."""

from __future__ import annotations

import json

import yaml

from support import ROOT

README = ROOT / "README.md"
DASHBOARD = ROOT / "deploy" / "grafana" / "kvcompact-dashboard.json"
ALERTS = ROOT / "deploy" / "prometheus" / "kvcompact-alerts.yml"


def dashboard_queries() -> list[str]:
    """Every PromQL query of the dashboard: its panels' targets and its query variables."""
    board = json.loads(DASHBOARD.read_text())
    queries = [t["expr"] for p in board["panels"] for t in p.get("targets", [])]
    return queries + [v["query"]["query"] for v in board["templating"]["list"] if v["type"] == "query"]


def alert_rules() -> list[dict]:
    """Every alerting rule of deploy/prometheus/kvcompact-alerts.yml, over all its groups."""
    return [rule for group in yaml.safe_load(ALERTS.read_text())["groups"] for rule in group["rules"]]
