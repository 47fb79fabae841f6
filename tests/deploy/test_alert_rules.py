"""The shipped alert rules, dashboard and probes, read as files (no Prometheus needed).

Several vidpipe hosts report to one Prometheus, often with the same pipeline and source
names: an alert must judge each host on its own series and say which host it is, and the
dashboard must be able to show one host. The rules' numbers are tested by promtool
(docker/prometheus/alerts.test.yml, run in tests/deploy/test_ops_stack.py).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

import pytest
import yaml

from tests.conftest import ROOT

ALERTS = ROOT / "docker" / "prometheus" / "alerts.yml"
DASHBOARD = ROOT / "docker" / "grafana" / "dashboards" / "vidpipe.json"
DEPLOYMENT = ROOT / "docker" / "k8s" / "deployment.yaml"
OPERATIONS = ROOT / "docs" / "operations.md"

HOST_LABELS = {"job", "instance"}
# `sum by (a, b)`, `sum(...) by (a, b)`, `and on (a, b)`, `== on(a) group_left(b)`: the
# label lists that decide which series are kept apart.
GROUPING_RE = re.compile(r"\b(by|on)\s*\(([^)]*)\)")
AGGREGATION_RE = re.compile(r"\b(sum|avg|min|max|count|topk|bottomk|quantile|stddev|stdvar|group)\s*\(")


def rules() -> list[dict[str, Any]]:
    groups = yaml.safe_load(ALERTS.read_text(encoding="utf-8"))["groups"]
    return [rule for group in groups for rule in group["rules"] if "alert" in rule]


@pytest.mark.parametrize("rule", rules(), ids=lambda rule: rule["alert"])
def test_every_aggregation_and_join_keeps_the_host(rule: dict[str, Any]) -> None:
    # `sum by (model)` adds up every host: one failing host of four is averaged away, and
    # the alert cannot say which host it is.
    expr = rule["expr"]
    # Written `sum by (...) (...)`, so the labels kept are next to the operator.
    assert not AGGREGATION_RE.search(expr), f"{rule['alert']}: an aggregation without `by (...)`"
    for keyword, labels in GROUPING_RE.findall(expr):
        kept = {label.strip() for label in labels.split(",")}
        assert kept >= HOST_LABELS, f"{rule['alert']}: `{keyword} ({labels})` drops {HOST_LABELS - kept}"


@pytest.mark.parametrize("rule", rules(), ids=lambda rule: rule["alert"])
def test_every_alert_summary_names_the_host(rule: dict[str, Any]) -> None:
    assert "$labels.instance" in rule["annotations"]["summary"], rule["alert"]


def test_the_grouping_check_sees_a_fleet_wide_sum() -> None:
    expr = "sum by (model) (rate(x[5m])) / sum by (job, instance, model) (rate(y[5m]))"
    dropped = [
        labels for _, labels in GROUPING_RE.findall(expr) if not set(labels.split(", ")) >= HOST_LABELS
    ]
    assert dropped == ["model"]


def test_frames_dropped_counts_a_failed_frame_once() -> None:
    # stage_error and publish_failed frames are already in vidpipe_frames_total (frames the
    # graph took): adding them to it again makes every frame failing read 50%.
    expr = next(rule["expr"] for rule in rules() if rule["alert"] == "VidpipeFramesDroppedHigh")
    numerator, denominator = expr.split("\n/\n", 1)
    assert "stage_error" in numerator and "publish_failed" in numerator
    assert "stage_error" not in denominator and "publish_failed" not in denominator


# --- dashboard ---------------------------------------------------------------------------


def dashboard() -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads(DASHBOARD.read_text(encoding="utf-8"))
    return loaded


def panel_exprs() -> Iterator[tuple[str, str]]:
    def panels(items: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
        for panel in items:
            yield panel
            yield from panels(panel.get("panels", []))

    for panel in panels(dashboard()["panels"]):
        for target in panel.get("targets", []):
            if target.get("expr"):
                yield str(panel.get("title")), target["expr"]


def test_dashboard_has_an_instance_variable() -> None:
    variables = {v["name"]: v for v in dashboard()["templating"]["list"]}
    instance = variables["instance"]
    query = instance["query"]["query"] if isinstance(instance["query"], dict) else instance["query"]
    assert re.fullmatch(r"label_values\(vidpipe_\w+, instance\)", query), query
    assert instance["includeAll"] and instance["multi"]
    # The variables after it list only what the chosen hosts have.
    for name in ("pipeline", "model"):
        query = variables[name]["query"]["query"]
        assert 'instance=~"$instance"' in query, f"variable {name}: {query}"


@pytest.mark.parametrize(("title", "expr"), list(panel_exprs()), ids=[title for title, _ in panel_exprs()])
def test_every_dashboard_query_filters_by_instance(title: str, expr: str) -> None:
    selectors = re.findall(r"\bvidpipe_\w+(\{[^}]*\})?", expr)
    assert selectors, f"{title}: no vidpipe_ metric"
    for selector in selectors:
        assert 'instance=~"$instance"' in selector, f"{title}: {expr}"


# --- probes ------------------------------------------------------------------------------


def documented_probes() -> dict[str, dict[str, Any]]:
    text = OPERATIONS.read_text(encoding="utf-8")
    section = text[text.index("## Health probes") :]
    block = re.search(r"```yaml\n(livenessProbe:.*?)```", section, re.S)
    assert block, "docs/operations.md: no probe block under Health probes"
    probes: dict[str, dict[str, Any]] = yaml.safe_load(block[1])
    return probes


def manifest_probes() -> dict[str, dict[str, Any]]:
    docs = [d for d in yaml.safe_load_all(DEPLOYMENT.read_text(encoding="utf-8")) if d]
    deployment = next(d for d in docs if d.get("kind") == "Deployment")
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    return {name: container[name] for name in ("livenessProbe", "readinessProbe", "startupProbe")}


def test_manifest_probes_are_the_documented_ones() -> None:
    # A pod copied from the manifest must get the startup budget the docs reason for (a
    # TensorRT build), not a shorter one that kills it mid-build.
    documented, shipped = documented_probes(), manifest_probes()
    assert documented.keys() == shipped.keys()
    for name, probe in documented.items():
        settings = {key: value for key, value in shipped[name].items() if key != "httpGet"}
        assert settings == {key: value for key, value in probe.items() if key != "httpGet"}, name
        assert shipped[name]["httpGet"]["path"] == probe["httpGet"]["path"], name


def test_startup_probe_allows_ten_minutes() -> None:
    startup = manifest_probes()["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 600
