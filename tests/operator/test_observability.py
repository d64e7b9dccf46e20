"""The chart's Grafana dashboard and alert rules read only metrics the project exports (issue 16): every
PromQL expression parses (promql-parser, a PromQL grammar), and every `weightsync_*` series it reads is
one the operator or the agent defines (histograms as `_bucket` / `_sum` / `_count`)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import promql_parser
import pytest
from test_helm_chart import by_kind, docs
from test_metrics_documented import agent_metric_names, operator_metric_names

from weightsync.e2e.binaries import find_binary

METRIC = re.compile(r"\bweightsync_[a-z0-9_]+")
REQUIRED_ALERTS = {"WeightSyncSyncFailing", "WeightSyncTrainerStalled", "WeightSyncReplicaStale"}


@pytest.fixture(scope="module")
def helm() -> Path:
    return find_binary("helm")  # built by `make setup`; CI has it


def exported() -> set[str]:
    names = operator_metric_names() | agent_metric_names()
    return names | {f"{n}{suffix}" for n in names for suffix in ("_bucket", "_sum", "_count")}


def check_expr(expr: str, where: str) -> set[str]:
    promql_parser.parse(expr)  # raises on a syntax error
    used = set(METRIC.findall(expr))
    assert used, f"{where}: reads no weightsync metric: {expr}"
    unknown = used - exported()
    assert not unknown, f"{where}: reads metrics nobody exports: {sorted(unknown)}"
    return used


def test_the_parser_catches_what_it_must() -> None:
    with pytest.raises(ValueError):
        promql_parser.parse("sum by (le (rate(x[5m]))")
    with pytest.raises(AssertionError, match="nobody exports"):
        check_expr("weightsync_job_no_such_series > 1", "probe")


def test_dashboard_configmap_panels_read_exported_metrics(helm: Any) -> None:
    assert not [c for c in by_kind(docs(helm), "ConfigMap") if c["metadata"]["name"].endswith("-dashboard")]
    (cm,) = [c for c in by_kind(docs(helm, "dashboards.enabled=true"), "ConfigMap")
             if c["metadata"]["name"].endswith("-dashboard")]
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    dash = json.loads(cm["data"]["weightsync.json"])
    assert dash["uid"] and dash["title"] and len(dash["panels"]) >= 10
    used: set[str] = set()
    for panel in dash["panels"]:
        assert panel["title"] and panel["targets"], panel
        for t in panel["targets"]:
            used |= check_expr(t["expr"], f"panel {panel['title']!r}")
    # the panels cover the job series, the agents' syncs and the operator
    for needed in ("weightsync_job_trainer_version", "weightsync_job_degraded", "weightsync_agent_sync_seconds_bucket",
                   "weightsync_agent_sync_progress_bytes", "weightsync_operator_reconciles_total"):
        assert needed in used, needed
    for var in dash["templating"]["list"]:
        if var["type"] == "query":
            check_expr(var["query"]["query"].replace("label_values(", "count(").replace(", wsj_namespace)", ")")
                       .replace(", wsj)", ")"), f"variable {var['name']}")


def test_alert_rules_parse_and_read_exported_metrics(helm: Any) -> None:
    objs = docs(helm, "prometheusRule.enabled=true", "prometheusRule.trainerStalledFor=45m")
    (rule,) = by_kind(objs, "PrometheusRule")
    rules = {r["alert"]: r for g in rule["spec"]["groups"] for r in g["rules"]}
    assert set(rules) >= REQUIRED_ALERTS, sorted(rules)
    for name, r in rules.items():
        if name == "WeightSyncOperatorDown":
            promql_parser.parse(r["expr"])  # reads `up`, Prometheus' own series
            continue
        check_expr(r["expr"], f"alert {name}")
        assert "wsj" in r["annotations"]["description"] or name.startswith("WeightSyncOperator"), name
    assert "[45m]" in rules["WeightSyncTrainerStalled"]["expr"]
    assert 'reason=~"SyncFailed|EngineUnreachable"' in rules["WeightSyncSyncFailing"]["expr"]
