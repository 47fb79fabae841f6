"""The compose topology as processes: nats-server, vidpipe running the demo graph with its
HTTP server on, and Debian's Prometheus with docker/prometheus/prometheus.yml (and its alert
rules) pointed at them. Every query of the Grafana dashboard, every variable query and every
alert expression is evaluated on that Prometheus, so a metric rename or a PromQL slip shows
up here instead of as an empty panel or an alert that can never fire.

The alert rules' own logic is tested by docker/prometheus/alerts.test.yml (`promtool test
rules`), with a firing and a quiet case for each alert.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from pipeline.nats_server import EmbeddedNats, free_port
from tests.conftest import ROOT
from tests.support.processes import stop_process

PROM_DIR = ROOT / "docker" / "prometheus"
ALERTS = PROM_DIR / "alerts.yml"
ALERT_TESTS = PROM_DIR / "alerts.test.yml"
DASHBOARDS = sorted((ROOT / "docker" / "grafana" / "dashboards").glob("*.json"))
DEMO_CLIP = ROOT / "samples" / "generated" / "demo.mp4"

# Stands in for Grafana's $__rate_interval and friends: the test scrapes every second, so
# ten seconds holds enough samples for rate().
RANGE = "10s"
METRIC_RE = re.compile(r"\b(vidpipe_[a-z0-9_]+|up)\b(?!\s*\()")
LABEL_VALUES_RE = re.compile(r"^label_values\((?:(?P<match>.+),\s*)?(?P<label>[a-zA-Z_][a-zA-Z0-9_]*)\)$")

# Metrics that have no series in a healthy run of the demo graph, and why. A query may come
# back empty only if every metric it reads is listed here.
ZERO_BY_NATURE = {
    "vidpipe_frames_dropped_total": "a file source read as fast as the graph goes drops nothing",
    "vidpipe_source_reconnects_total": "a file source never reconnects",
    "vidpipe_publish_errors_total": "publishing to a healthy nats-server does not fail",
    "vidpipe_zone_objects": "the demo graph has no zones stage",
    "vidpipe_line_crossings_total": "the demo graph has no lines",
    "vidpipe_active_tracks": "a zones stage counts the active tracks; the demo graph has none",
    "vidpipe_events_total": "events come from a zones stage; the demo graph has none",
}

needs_prometheus = pytest.mark.skipif(
    shutil.which("prometheus") is None or shutil.which("promtool") is None,
    reason="Prometheus is not installed (Debian: apt-get install prometheus)",
)


# --- promtool ----------------------------------------------------------------------------


@needs_prometheus
def test_alert_rules_and_their_unit_tests_pass_promtool() -> None:
    check = subprocess.run(["promtool", "check", "rules", str(ALERTS)], capture_output=True, text=True)
    assert check.returncode == 0, check.stdout + check.stderr
    tests = subprocess.run(
        ["promtool", "test", "rules", str(ALERT_TESTS)], capture_output=True, text=True, timeout=120
    )
    assert tests.returncode == 0, tests.stdout + tests.stderr
    assert "SUCCESS" in tests.stdout


def alert_names() -> list[str]:
    rules = yaml.safe_load(ALERTS.read_text(encoding="utf-8"))
    return [rule["alert"] for group in rules["groups"] for rule in group["rules"] if "alert" in rule]


@pytest.mark.parametrize("alert", alert_names())
def test_each_alert_has_a_firing_and_a_quiet_unit_test(alert: str) -> None:
    cases = [
        case
        for test in yaml.safe_load(ALERT_TESTS.read_text(encoding="utf-8"))["tests"]
        for case in test.get("alert_rule_test", [])
        if case["alertname"] == alert
    ]
    assert any(case.get("exp_alerts") for case in cases), f"no case where {alert} fires"
    assert any(not case.get("exp_alerts") for case in cases), f"no case where {alert} stays quiet"


def test_a_slow_camera_alert_reads_decoded_frames_not_processed_ones() -> None:
    # An overloaded graph accepts few frames from a healthy camera: a threshold on the
    # processed rate (vidpipe_frames_total) would page for the camera when the graph is
    # what is slow. The camera alert reads what the source decoded.
    rules = yaml.safe_load(ALERTS.read_text(encoding="utf-8"))
    exprs = {rule["alert"]: rule["expr"] for group in rules["groups"] for rule in group["rules"]}
    low_processed = re.compile(r"rate\(vidpipe_frames_total\[[^\]]*\]\)\s*\)?\s*<")
    assert [name for name, expr in exprs.items() if low_processed.search(expr)] == []
    assert "rate(vidpipe_frames_decoded_total[5m])) < 5" in exprs["VidpipeSourceFrameRateLow"]


# --- the running stack -------------------------------------------------------------------


@dataclass
class Stack:
    prometheus: str
    vidpipe: str

    def api(self, path: str, **params: str) -> Any:
        url = f"{self.prometheus}/api/v1/{path}?{urllib.parse.urlencode(params)}"
        with urllib.request.urlopen(url, timeout=10) as response:
            body = json.load(response)
        assert body["status"] == "success", body
        return body["data"]

    def query(self, expr: str) -> list[dict[str, Any]]:
        try:
            data = self.api("query", query=expr)
        except urllib.error.HTTPError as exc:
            pytest.fail(f"Prometheus rejects {expr!r}: {exc.read().decode()}")
        result: list[dict[str, Any]] = data["result"]
        return result


def wait_until(what: str, check: Any, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            if check():
                return
        except OSError:
            pass
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(0.5)


def http_ok(url: str, proc: subprocess.Popen[bytes], log: Path) -> bool:
    if proc.poll() is not None:
        pytest.fail(
            f"{proc.args[0]} exited with {proc.returncode}:\n{log.read_text(errors='replace')[-3000:]}"
        )
    with urllib.request.urlopen(url, timeout=2) as response:
        return bool(response.status == 200)


def demo_config(tmp_path: Path) -> Path:
    """configs/demo.yaml with absolute paths, its file source looping at the clip's frame rate
    so vidpipe keeps running (and being scraped) until the test stops it."""
    if not DEMO_CLIP.exists():
        # The Makefile's rule for the demo clip.
        subprocess.run([sys.executable, "samples/make_clip.py", str(DEMO_CLIP)], cwd=ROOT, check=True)
    # Edited as text: a YAML round trip through PyYAML would turn the `on:` keys into true.
    text = (ROOT / "configs" / "demo.yaml").read_text(encoding="utf-8")
    for old, new in [
        ("models: ../samples/models", f"models: {ROOT / 'samples' / 'models'}"),
        ("url: ../samples/generated/demo.mp4", f"url: {DEMO_CLIP}\n    loop: true"),
        ("realtime: false", "realtime: true"),
    ]:
        assert text.count(old) == 1, f"configs/demo.yaml no longer has {old!r}"
        text = text.replace(old, new)
    path = tmp_path / "demo.yaml"
    path.write_text(text)
    return path


def prometheus_config(tmp_path: Path, vidpipe: str, prometheus: str, token_file: Path) -> Path:
    """docker/prometheus/prometheus.yml with its targets moved to the test's ports."""
    config = yaml.safe_load((PROM_DIR / "prometheus.yml").read_text(encoding="utf-8"))
    config["global"].update(scrape_interval="1s", evaluation_interval="1s")
    config["rule_files"] = [str(ALERTS)]
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    vidpipe_job = jobs["vidpipe"]
    vidpipe_job.update(scrape_interval="1s", scrape_timeout="1s")
    vidpipe_job["authorization"]["credentials_file"] = str(token_file)
    (targets,) = vidpipe_job["static_configs"]
    targets["targets"] = [vidpipe]
    (targets,) = jobs["prometheus"]["static_configs"]
    targets["targets"] = [prometheus]
    path = tmp_path / "prometheus.yml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


@pytest.fixture
def stack(tmp_path: Path, nats_server: EmbeddedNats) -> Iterator[Stack]:
    vidpipe_addr = f"127.0.0.1:{free_port()}"
    prom_addr = f"127.0.0.1:{free_port()}"
    # As in compose: one token, given to vidpipe in the environment and to Prometheus in a file.
    token = secrets.token_hex(16)
    token_file = tmp_path / "vidpipe-token"
    token_file.write_text(token)
    prom_config = prometheus_config(tmp_path, vidpipe_addr, prom_addr, token_file)
    check = subprocess.run(["promtool", "check", "config", str(prom_config)], capture_output=True, text=True)
    assert check.returncode == 0, check.stdout + check.stderr

    logs = tmp_path / "logs"
    logs.mkdir()
    with (logs / "vidpipe.log").open("wb") as vidpipe_log, (logs / "prometheus.log").open("wb") as prom_log:
        vidpipe = subprocess.Popen(
            [sys.executable, "-m", "pipeline.cli", "run", str(demo_config(tmp_path)),
             "--nats", nats_server.url, "--http", vidpipe_addr],
            cwd=ROOT, stdout=vidpipe_log, stderr=subprocess.STDOUT,
            env={**os.environ, "VIDPIPE_HTTP_TOKEN": token},
        )  # fmt: skip
        prometheus = subprocess.Popen(
            ["prometheus", f"--config.file={prom_config}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
             f"--web.listen-address={prom_addr}"],
            stdout=prom_log, stderr=subprocess.STDOUT,
        )  # fmt: skip
        try:
            stack = Stack(prometheus=f"http://{prom_addr}", vidpipe=f"http://{vidpipe_addr}")
            wait_until(
                "Prometheus to be ready",
                lambda: http_ok(f"{stack.prometheus}/-/ready", prometheus, logs / "prometheus.log"),
            )
            wait_until(
                "vidpipe to be ready",
                lambda: http_ok(f"{stack.vidpipe}/readyz", vidpipe, logs / "vidpipe.log"),
                timeout=120,
            )
            yield stack
        finally:
            stop_process(vidpipe)
            stop_process(prometheus)
            if vidpipe.returncode not in (0, -15):
                print((logs / "vidpipe.log").read_text(errors="replace")[-5000:])


def dashboard_queries() -> Iterator[tuple[str, str]]:
    """(where, expression) for every panel target and variable of every dashboard."""

    def panels(items: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
        for panel in items:
            yield panel
            yield from panels(panel.get("panels", []))

    for path in DASHBOARDS:
        dashboard = json.loads(path.read_text(encoding="utf-8"))
        for panel in panels(dashboard.get("panels", [])):
            for target in panel.get("targets", []):
                if target.get("expr"):
                    yield (
                        f"{path.name}: panel {panel.get('title')!r} {target.get('refId', '')}",
                        target["expr"],
                    )
        for var in dashboard.get("templating", {}).get("list", []):
            if var.get("type") == "query":
                query = var["query"]["query"] if isinstance(var["query"], dict) else var["query"]
                yield f"{path.name}: variable {var['name']!r}", query


def substitute(expr: str, variables: dict[str, str]) -> str:
    """Grafana's variables replaced the way it does with every value selected."""
    expr = re.sub(r"\$__(rate_interval|interval|range)\b|\$\{__(rate_interval|interval|range)\}", RANGE, expr)
    for name, value in variables.items():
        expr = re.sub(rf"\$\{{{name}(:[a-z]+)?\}}|\${name}\b|\[\[{name}\]\]", value, expr)
    return expr


def dashboard_variables() -> dict[str, str]:
    values: dict[str, str] = {}
    for path in DASHBOARDS:
        for var in json.loads(path.read_text(encoding="utf-8")).get("templating", {}).get("list", []):
            if var.get("type") == "query":
                values[var["name"]] = var.get("allValue") or ".*"
    return values


def may_be_empty(expr: str) -> bool:
    metrics = set(METRIC_RE.findall(expr)) - {"up"}
    return bool(metrics) and metrics <= ZERO_BY_NATURE.keys()


def test_substitute_replaces_grafana_variables() -> None:
    expr = 'rate(x{a=~"$pipeline", b=~"${source}", c=~"[[model]]"}[$__rate_interval])'
    got = substitute(expr, {"pipeline": ".*", "source": "s.*", "model": "m"})
    assert got == f'rate(x{{a=~".*", b=~"s.*", c=~"m"}}[{RANGE}])'


@needs_prometheus
@pytest.mark.timeout(300)
def test_dashboard_and_alert_queries_on_a_live_prometheus(stack: Stack) -> None:
    # Data for every kind of metric: frames through the whole graph, histograms observed,
    # at least two scrapes inside the rate window, and the alert rules evaluated.
    wait_until(
        "two scrapes of a running pipeline",
        lambda: (
            stack.query(f"increase(vidpipe_published_messages_total[{RANGE}]) > 0")
            and stack.query(f"rate(vidpipe_inference_batch_size_count[{RANGE}]) > 0")
        ),
        timeout=120,
    )
    targets = stack.api("targets")["activeTargets"]
    assert {(t["labels"]["job"], t["health"]) for t in targets} == {("vidpipe", "up"), ("prometheus", "up")}

    variables = dashboard_variables()
    queries = list(dashboard_queries())
    assert len(queries) >= 17

    def empty_queries() -> list[str]:
        empty = []
        for where, raw in queries:
            expr = substitute(raw, variables)
            if m := LABEL_VALUES_RE.match(expr):
                params = {"match[]": m["match"]} if m["match"] else {}
                if not stack.api(f"label/{m['label']}/values", **params):
                    empty.append(f"{where}: {expr} lists no values")
            elif not stack.query(expr) and not may_be_empty(expr):
                empty.append(f"{where}: {expr}")
        return empty

    # A series that first appears at a label's first observation (a histogram's source, an
    # object's label) needs two scrapes after that before rate() has a value: on a busy
    # machine that can be after the published counter's first increase, so wait for it.
    deadline = time.monotonic() + 60
    while (empty := empty_queries()) and time.monotonic() < deadline:
        time.sleep(1)
    assert not empty, "queries with no series:\n" + "\n".join(empty)

    # Alert expressions: valid on real data; every series they read exists (an alert on a
    # renamed metric would stay quiet forever); and Prometheus itself evaluates them cleanly.
    rules = yaml.safe_load(ALERTS.read_text(encoding="utf-8"))
    for group in rules["groups"]:
        for rule in group["rules"]:
            stack.query(rule["expr"])
            for metric in set(METRIC_RE.findall(rule["expr"])) - ZERO_BY_NATURE.keys():
                selector = 'up{job="vidpipe"}' if metric == "up" else metric
                assert stack.query(selector), f"{rule['alert']}: no series for {selector}"
    wait_until(
        "every rule to be evaluated",
        lambda: all(
            not r["lastEvaluation"].startswith("0001")  # Go's zero time: not yet
            for g in stack.api("rules")["groups"]
            for r in g["rules"]
        ),
    )
    loaded = {r["name"]: r for g in stack.api("rules")["groups"] for r in g["rules"]}
    assert set(loaded) == set(alert_names())
    for name, rule in loaded.items():
        assert rule["health"] == "ok", f"{name}: {rule.get('lastError')}"
    # A healthy demo run fires nothing.
    firing = [a["labels"]["alertname"] for a in stack.api("alerts")["alerts"] if a["state"] == "firing"]
    assert firing == []
