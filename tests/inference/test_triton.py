"""backend: triton against a real Triton Inference Server (PyTriton serving ONNX Runtime).

The server (tests/support/triton_server.py) serves the sample ``squares`` detector
as ``squares`` (float input), ``squares_u8`` (uint8 input), ``squares_slow`` and
``squares_broken``, and records every call with its batch size.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from inference.batcher import InferenceFailed
from inference.model import ModelState, ModelUnavailable
from inference.repository import ModelRepository
from inference.results import Detection
from tests.support.triton_server import TritonTestServer, unavailable_reason

pytestmark = pytest.mark.timeout(300)

SQUARES_ONNX = Path(__file__).resolve().parents[2] / "samples" / "models" / "squares" / "model.onnx"

REMOTE = """\
name: squares
backend: triton
max_batch_size: 8
input:
  name: images
  shape: [3, 320, 320]
  {normalise}
task:
  kind: yolo
  layout: yolov8
  confidence: 0.5
labels: [square]
dynamic_batching:
  preferred_batch_size: [{preferred}]
  max_queue_delay_microseconds: {delay_us}
instance_group: [{{count: 1, kind: KIND_CPU}}]
backend_options:
  url: {url}
  model_name: {model_name}
  timeout_ms: {timeout_ms}
"""


@pytest.fixture(scope="module")
def triton(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TritonTestServer]:
    reason = unavailable_reason()
    if reason:
        pytest.skip(reason)
    server = TritonTestServer(SQUARES_ONNX, tmp_path_factory.mktemp("triton"), name="squares", slow_s=3.0)
    server.start()
    try:
        yield server
    finally:
        server.stop()


def remote_repo(
    root: Path,
    url: str,
    *,
    model_name: str = "squares",
    timeout_ms: int = 5000,
    delay_us: int = 2000,
    raw_pixels: bool = False,
    preferred: int = 8,
) -> ModelRepository:
    folder = root / "squares"
    folder.mkdir(parents=True, exist_ok=True)
    normalise = "scale: 1" if raw_pixels else "scale: 0.00392156862745098"
    (folder / "config.yaml").write_text(
        REMOTE.format(
            url=url,
            model_name=model_name,
            timeout_ms=timeout_ms,
            delay_us=delay_us,
            normalise=normalise,
            preferred=preferred,
        )
    )
    return ModelRepository(root)


def square_image(x: int, y: int, size: int, shape: tuple[int, int] = (240, 320)) -> np.ndarray:
    img = np.full((*shape, 3), 20, np.uint8)
    img[y : y + size, x : x + size] = 235
    return img


IMAGES = [
    square_image(30, 40, 60),
    square_image(200, 100, 80),
    square_image(120, 20, 40, shape=(360, 480)),
    square_image(10, 150, 70),
    square_image(250, 10, 50),
    square_image(60, 60, 100, shape=(300, 300)),
]


def detections(results: list[Any]) -> list[list[Detection]]:
    return [list(r) for r in results]


def assert_same(remote: list[list[Detection]], local: list[list[Detection]]) -> None:
    assert [len(r) for r in remote] == [len(r) for r in local]
    for got, want in zip(remote, local, strict=True):
        for a, b in zip(got, want, strict=True):
            assert (a.label, a.class_id) == (b.label, b.class_id)
            assert a.box == pytest.approx(b.box, abs=1e-3)
            assert a.score == pytest.approx(b.score, abs=1e-5)


async def run_local(sample_models: Path) -> list[list[Detection]]:
    repo = ModelRepository(sample_models)
    status = await repo.load("squares")
    assert status.state is ModelState.READY, status.reason
    try:
        return detections([await repo.get("squares").infer(img) for img in IMAGES])
    finally:
        await repo.close()


async def test_served_model_gives_the_local_detections_in_one_call_per_batch(
    triton: TritonTestServer, sample_models: Path, tmp_path: Path
) -> None:
    local = await run_local(sample_models)
    assert all(len(d) == 1 for d in local)  # one square in every image
    # All six requests meet in one batch (preferred size 6), sent as one server call.
    repo = remote_repo(tmp_path, triton.url, delay_us=2_000_000, preferred=6)
    status = await repo.load("squares")
    assert status.state is ModelState.READY, status.reason
    assert [t.name for t in status.inputs] == ["images"]
    assert status.inputs[0].shape == (None, 3, 320, 320)
    before = len(triton.calls())
    try:
        model = repo.get("squares")
        remote = detections(await asyncio.gather(*(model.infer(img) for img in IMAGES)))
    finally:
        await repo.close()
    assert_same(remote, local)
    assert triton.calls()[before:] == [6]


async def test_uint8_model_gets_raw_pixels(
    triton: TritonTestServer, sample_models: Path, tmp_path: Path
) -> None:
    local = await run_local(sample_models)
    repo = remote_repo(
        tmp_path, triton.url, model_name="squares_u8", raw_pixels=True, delay_us=2_000_000, preferred=4
    )
    status = await repo.load("squares")
    assert status.state is ModelState.READY, status.reason
    try:
        model = repo.get("squares")
        remote = detections(await asyncio.gather(*(model.infer(img) for img in IMAGES[:4])))
    finally:
        await repo.close()
    # The served function refuses anything but uint8, so an answer means uint8 went over the wire.
    assert_same(remote, local[:4])
    assert triton.calls("squares_u8")[-1:] == [4]


async def test_uint8_model_with_local_normalisation_is_a_config_error(
    triton: TritonTestServer, tmp_path: Path
) -> None:
    repo = remote_repo(tmp_path, triton.url, model_name="squares_u8")
    status = await repo.load("squares")
    assert status.state is ModelState.UNAVAILABLE
    config = tmp_path / "squares" / "config.yaml"
    assert status.reason.startswith(f"{config}:7: input.scale: ")
    assert "takes 'images' as uint8 (raw pixels)" in status.reason
    await repo.close()


async def test_wrong_model_name_is_a_load_error_at_the_key(triton: TritonTestServer, tmp_path: Path) -> None:
    repo = remote_repo(tmp_path, triton.url, model_name="no_such_model")
    status = await repo.load("squares")
    assert status.state is ModelState.UNAVAILABLE
    config = tmp_path / "squares" / "config.yaml"
    assert status.reason.startswith(f"{config}:19: backend_options.model_name: ")
    assert f"the server at {triton.url} has no model 'no_such_model'" in status.reason
    await repo.close()


async def test_server_error_fails_the_batch_with_the_servers_reason(
    triton: TritonTestServer, tmp_path: Path
) -> None:
    repo = remote_repo(tmp_path, triton.url, model_name="squares_broken")
    assert (await repo.load("squares")).state is ModelState.READY
    try:
        with pytest.raises(InferenceFailed) as err:
            await repo.get("squares").infer(IMAGES[0])
    finally:
        await repo.close()
    message = str(err.value)
    assert "TritonServerError" in message
    assert f"squares on {triton.url}: the server failed on images[1, 3, 320, 320]" in message
    assert "ValueError: the served function failed on purpose" in message


async def test_a_batch_past_timeout_ms_fails_fast(triton: TritonTestServer, tmp_path: Path) -> None:
    repo = remote_repo(tmp_path, triton.url, model_name="squares_slow", timeout_ms=500)
    assert (await repo.load("squares")).state is ModelState.READY
    start = time.monotonic()
    try:
        with pytest.raises(InferenceFailed) as err:
            await repo.get("squares").infer(IMAGES[0])
        took = time.monotonic() - start
    finally:
        await repo.close()
    assert took < 2.5  # the server sleeps 3 s
    assert "TritonTimeout" in str(err.value)
    assert "no answer within timeout_ms 500" in str(err.value)


async def test_a_batch_that_cannot_reach_the_server_fails_fast_and_marks_the_model_unavailable(
    tmp_path: Path,
) -> None:
    reason = unavailable_reason()
    if reason:
        pytest.skip(reason)
    server = TritonTestServer(SQUARES_ONNX, tmp_path / "server", name="squares").start()
    try:
        repo = remote_repo(tmp_path / "models", server.url)
        assert (await repo.load("squares")).state is ModelState.READY
        model = repo.get("squares")
        assert len(await model.infer(IMAGES[0])) == 1  # type: ignore[arg-type]
    finally:
        server.stop()
    try:
        start = time.monotonic()
        # Before the next probe (every 2 s) notices: the batch itself finds the server gone.
        results = await asyncio.gather(*(model.infer(img) for img in IMAGES[:3]), return_exceptions=True)
        took = time.monotonic() - start
        state, why = model.state, model.reason
    finally:
        await repo.close()
    assert took < 3.0
    gone = f"squares on {server.url}: the server cannot be reached"
    for r in results:
        # Failed in the batch, or refused because an earlier failure or a probe marked it.
        assert isinstance(r, InferenceFailed | ModelUnavailable), r
        assert gone in str(r) or f"the model is unavailable: {gone}" in str(r), r
    assert state is ModelState.UNAVAILABLE and why.startswith(gone), why


READY_CONFIG = """\
pipeline: remote
sources: [{{id: cam, url: "test://?width=320&height=240&fps=10"}}]
nats: {{url: "{nats}"}}
http: {{listen: "127.0.0.1:0"}}
models: {models}
stages: [{{name: objects, type: infer, model: squares}}]
"""


async def test_readiness_and_model_ready_follow_the_remote_server(tmp_path: Path, nats_server: Any) -> None:
    from tests.pipeline.stack import Stack, until

    reason = unavailable_reason()
    if reason:
        pytest.skip(reason)
    server = TritonTestServer(SQUARES_ONNX, tmp_path / "server", name="squares").start()
    models = tmp_path / "models"
    remote_repo(models, server.url)
    stack = await Stack.start(
        tmp_path, READY_CONFIG.format(nats=nats_server.url, models=models), nats_server.url
    )
    registry = stack.runtime.metrics.registry

    def model_ready() -> float | None:
        return registry.get_sample_value("vidpipe_model_ready", {"model": "squares"})

    try:
        run = stack.runtime.sources["cam"]
        await until(lambda: run.source.state.value == "up", what="cam up")
        assert await stack.json("GET", "/readyz") == (200, {"ready": True, "reasons": []})
        assert model_ready() == 1.0

        model = stack.runtime.models.get("squares")
        server.stop()
        await until(lambda: model.state is ModelState.UNAVAILABLE, timeout=20, what="model unavailable")
        status, body = await stack.json("GET", "/readyz")
        why = f"squares on {server.url}: the server cannot be reached (StatusCode.UNAVAILABLE)"
        assert (status, body) == (503, {"ready": False, "reasons": [f"model squares is unavailable: {why}"]})
        assert model_ready() == 0.0
        # The frames that reach the stage meanwhile are refused, and counted as such.
        refused = {"model": "squares", "status": "unavailable"}
        await until(
            lambda: (registry.get_sample_value("vidpipe_inference_requests_total", refused) or 0) >= 3,
            what="refused requests counted",
        )

        server.start()
        # Probed every 0.5 s while away; the channel reconnects within 2 s.
        await until(lambda: model.state is ModelState.READY, timeout=30, what="model ready again")
        assert await stack.json("GET", "/readyz") == (200, {"ready": True, "reasons": []})
        assert model_ready() == 1.0
        assert len(await model.infer(IMAGES[0])) == 1  # type: ignore[arg-type]
    finally:
        await stack.close()
        server.stop()


async def test_unreachable_server_at_load_says_so(tmp_path: Path) -> None:
    from tests.support.triton_server import free_port

    url = f"grpc://127.0.0.1:{free_port()}"
    repo = remote_repo(tmp_path, url, timeout_ms=1000)
    status = await repo.load("squares")
    assert status.state is ModelState.UNAVAILABLE
    assert f"squares on {url}: cannot reach the server" in status.reason
    await repo.close()


async def test_url_must_be_grpc(tmp_path: Path) -> None:
    repo = remote_repo(tmp_path, "http://127.0.0.1:8000")
    status = await repo.load("squares")
    config = tmp_path / "squares" / "config.yaml"
    assert status.reason.startswith(f"{config}:18: backend_options.url: 'http://127.0.0.1:8000' is not")
    await repo.close()


async def test_url_with_credentials_is_refused_without_echoing_them(tmp_path: Path) -> None:
    repo = remote_repo(tmp_path, "grpc://admin:Secret9@127.0.0.1:8001")
    status = await repo.load("squares")
    config = tmp_path / "squares" / "config.yaml"
    assert status.reason == (
        f"{config}:18: backend_options.url: the URL has a user or password, which Triton's gRPC "
        "endpoint does not take (hint: write it as grpc://HOST:PORT)"
    )
    assert "Secret9" not in status.reason
    await repo.close()
