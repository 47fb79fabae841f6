"""The CPU image, built from docker/Dockerfile and run: the test a registry push would need.

buildah builds it with chroot isolation (no container daemon). Where the base image cannot
be pulled, docker/bootstrap-base.sh makes a Debian bookworm stand-in first. Both the base
and the build's layers stay in buildah's storage (and the base's root filesystem under
/var/tmp/vidpipe-images), so only the first run pays for them: see docs/operations.md.

The container shares the host's network (chroot isolation makes no network namespace), so
the vidpipe inside publishes to the test's nats-server on loopback.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from packaging.requirements import Requirement

from pipeline.nats_server import EmbeddedNats
from samples.make_clip import square_at, write_clip
from tests.conftest import ROOT, Collector, validate_message

IMAGE = "localhost/vidpipe:test"
BUILD_STAGE = "localhost/vidpipe:test-build"
BUILD_TIMEOUT = 1200
FRAMES = 24

# The first run bootstraps the base and downloads every wheel: minutes, not seconds.
pytestmark = pytest.mark.timeout(BUILD_TIMEOUT)

PIPELINE = """\
pipeline: image
models: /opt/vidpipe/samples/models
sources:
  - {id: clip, url: /data/clip.mp4}
stages:
  - {name: objects, type: infer, model: squares}
  - {name: track, type: track}
"""


def builder_problem() -> str | None:
    """Why no image can be built here, or None when buildah can build."""
    if shutil.which("buildah") is None:
        return "buildah is not installed (Debian: apt-get install buildah)"
    info = subprocess.run(["buildah", "info"], capture_output=True, text=True, timeout=60)
    if info.returncode != 0:
        return f"buildah cannot run here: {info.stderr.strip()[-300:]}"
    base = subprocess.run(
        ["buildah", "inspect", "--type", "image", "python:3.11-slim"], capture_output=True, timeout=60
    )
    if base.returncode != 0 and os.geteuid() != 0:
        return "the base image is not in local storage and bootstrapping one needs root"
    return None


def buildah(*args: str, timeout: float = 120) -> str:
    result = subprocess.run(["buildah", *args], capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, (
        f"buildah {' '.join(args)}:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    )
    return result.stdout


@pytest.fixture(scope="session")
def image() -> str:
    """docker/Dockerfile built from the working tree; unchanged layers come from the cache."""
    problem = builder_problem()
    if problem:
        pytest.skip(problem)
    base = subprocess.run(
        [str(ROOT / "docker" / "bootstrap-base.sh")], capture_output=True, text=True, timeout=BUILD_TIMEOUT
    )
    assert base.returncode == 0, base.stderr[-3000:]
    bud = ["bud", "--isolation", "chroot", "--layers", "--format", "docker", "-f", "docker/Dockerfile"]
    buildah(*bud, "-t", IMAGE, str(ROOT), timeout=BUILD_TIMEOUT)
    # The build stage is tagged too, so pruning below keeps its cached layers (pip install)
    # and only drops images left behind by earlier builds of other source trees.
    buildah(*bud, "--target", "build", "-t", BUILD_STAGE, str(ROOT), timeout=BUILD_TIMEOUT)
    subprocess.run(["buildah", "rmi", "--prune"], capture_output=True, timeout=300)
    return IMAGE


def locked(name: str, python: str) -> str:
    """The version constraints.txt pins ``name`` to on that Python."""
    for line in (ROOT / "constraints.txt").read_text(encoding="utf-8").splitlines():
        if line.startswith(f"{name}=="):
            req = Requirement(line)
            if req.marker is None or req.marker.evaluate({"python_full_version": python}):
                return str(req.specifier).removeprefix("==")
    raise AssertionError(f"{name} is not pinned in constraints.txt")


def image_config(image: str) -> dict[str, Any]:
    config: dict[str, Any] = json.loads(buildah("inspect", "--type", "image", image))["Docker"]["config"]
    return config


@pytest.fixture
def container(image: str) -> Iterator[str]:
    name = buildah("from", "--pull-never", image).strip()
    try:
        yield name
    finally:
        subprocess.run(["buildah", "rm", name], capture_output=True, timeout=60)


def test_image_runs_as_uid_10001_with_vidpipe_as_entrypoint(image: str, container: str) -> None:
    config = image_config(image)
    assert config["User"] == "10001:10001"
    assert config["Entrypoint"] == ["vidpipe"]
    assert config["Cmd"] == ["run", "/etc/vidpipe/pipeline.yaml", "--http", "0.0.0.0:8080"]
    assert config["Healthcheck"]["Test"][:2] == ["CMD", "python"]
    # The user the image declares is the one processes get.
    out = buildah(
        "run", "--isolation", "chroot", "--user", config["User"], container, "--", "sh", "-c", "id -u; id -g"
    )
    assert out.split() == ["10001", "10001"]
    # The locked versions are the ones installed.
    out = buildah(
        "run", "--isolation", "chroot", container, "--", "python", "-c",
        "import platform, av, numpy, onnxruntime;"
        "print(platform.python_version(), av.__version__, numpy.__version__, onnxruntime.__version__)",
    )  # fmt: skip
    python, *versions = out.split()
    assert versions == [locked(name, python) for name in ("av", "numpy", "onnxruntime")]


def test_image_holds_the_runtime_set_and_the_sample_models(container: str) -> None:
    """Headless OpenCV, the PP-OCR models' wheel without its dependencies, no test tools,
    no libGL; the sample models, those read from the wheel included, load."""
    out = buildah(
        "run", "--isolation", "chroot", container, "--", "python", "-c",
        "import importlib.metadata as m, cv2; print(*sorted(d.metadata['Name'].lower() for d in m.distributions()))",
    )  # fmt: skip
    names = set(out.split())
    assert {"opencv-python-headless", "rapidocr-onnxruntime", "vidpipe"} <= names, sorted(names)
    left_out = {"opencv-python", "jsonschema", "pytest", "mypy", "pillow", "shapely", "tqdm", "six"}
    assert names.isdisjoint(left_out), sorted(names & left_out)
    libs = buildah(
        "run", "--isolation", "chroot", container, "--", "sh", "-c", "ldconfig -p | grep -c libGL || true"
    )
    assert libs.strip() == "0", "the image holds libGL"
    table = buildah(
        "run", "--isolation", "chroot", container, "--", "vidpipe", "models", "list", "samples/models"
    )
    states = {line.split()[0]: line.split()[2] for line in table.splitlines()[1:] if line.strip()}
    assert states == {"ppocr_cls": "ready", "ppocr_det": "ready", "ppocr_rec": "ready", "squares": "ready"}, (
        table
    )


async def test_entrypoint_publishes_detections_to_nats_on_the_host(
    image: str, container: str, tmp_path: Path, nats_server: EmbeddedNats, collector: Collector
) -> None:
    data = tmp_path / "data"
    data.mkdir()
    write_clip(data / "clip.mp4", frames=FRAMES, fps=15)
    (data / "pipeline.yaml").write_text(PIPELINE)
    # The container runs as uid 10001, which must be able to read what is mounted.
    data.chmod(0o755)
    for path in data.iterdir():
        path.chmod(0o644)
    await collector.start(nats_server.url)

    config = image_config(image)
    # The image's own entrypoint and config path; only the NATS server replaces the HTTP
    # flag of the default command (a port on the host's network would be shared).
    proc = await asyncio.create_subprocess_exec(
        "buildah", "run", "--isolation", "chroot", "--user", config["User"],
        "-v", f"{data / 'pipeline.yaml'}:{config['Cmd'][1]}:ro", "-v", f"{data}:/data:ro",
        container, "--", *config["Entrypoint"], "run", config["Cmd"][1], "--nats", nats_server.url,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    out, err = await asyncio.wait_for(proc.communicate(), timeout=300)
    log = (out + err).decode(errors="replace")
    assert proc.returncode == 0, log
    assert f"done: {FRAMES} frame(s) published from 1 source(s)" in log

    await collector.wait_for(FRAMES)
    assert collector.subjects == ["vidpipe.image.clip.detections"] * FRAMES
    assert [m["frame"] for m in collector.messages] == list(range(FRAMES))
    for m in collector.messages:
        validate_message(m)
        (obj,) = m["objects"]
        assert obj["label"] == "square" and obj["track_id"] == 1
        truth = square_at(m["frame"], 640, 360)
        assert all(abs(a - t) <= 2.0 for a, t in zip(obj["bbox"], truth, strict=True)), (obj["bbox"], truth)
