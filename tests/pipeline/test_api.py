"""The HTTP API against a real Runtime, a real nats-server and a separate NATS subscriber."""

from __future__ import annotations

import json
from pathlib import Path

import cv2
import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from pipeline.annotate import annotate
from pipeline.api import ApiConfigError, ApiServer
from pipeline.config import HttpConfig
from pipeline.frames import DetectedObject, Frame
from pipeline.nats_server import EmbeddedNats
from tests.conftest import Collector, run_cli
from tests.pipeline.stack import Stack, until

CONFIG = """\
pipeline: apitest
sources:{sources}
nats: {{url: "{nats}"}}
http: {{listen: "127.0.0.1:0"{token}}}
"""


def config(nats: EmbeddedNats, *sources: str, token: str | None = None) -> str:
    block = "".join(f"\n  - {s}" for s in sources) or " []"
    return CONFIG.format(sources=block, nats=nats.url, token=f", token: {token}" if token else "")


async def test_add_and_remove_sources_while_running(
    tmp_path: Path, nats_server: EmbeddedNats, collector: Collector
) -> None:
    await collector.start(nats_server.url, "vidpipe.apitest.>")
    stack = await Stack.start(
        tmp_path, config(nats_server, '{id: a, url: "test://?width=160&height=120&fps=40"}'), nats_server.url
    )
    try:
        await until(lambda: len(collector.by_source("a")) >= 5, what="messages from a")
        status, listed = await stack.json("GET", "/v1/sources")
        assert status == 200
        assert [s["id"] for s in listed] == ["a"]
        assert listed[0]["state"] == "up"

        # No id: derived from the URL exactly as the YAML loader does (test://?id=b -> b).
        status, added = await stack.json(
            "POST", "/v1/sources", json={"url": "test://?id=b&width=200&height=100&fps=40"}
        )
        assert status == 201, added
        assert added["id"] == "b"
        assert added["url"] == "test://?id=b&width=200&height=100&fps=40"
        await until(lambda: len(collector.by_source("b")) >= 5, what="messages from b")
        assert {(m["width"], m["height"]) for m in collector.by_source("b")} == {(200, 100)}

        # The same URL again: the derived id gets the loader's _2 suffix instead of clashing.
        status, again = await stack.json("POST", "/v1/sources", json={"url": "test://?id=b&fps=40"})
        assert (status, again["id"]) == (201, "b_2")
        # An explicit id that is taken is a conflict.
        status, body = await stack.json("POST", "/v1/sources", json={"id": "b", "url": "test://"})
        assert status == 409
        assert body == {"error": "sources.id: source 'b' already exists; DELETE it first"}

        run_a = stack.runtime.sources["a"]
        async with stack.http.delete("/v1/sources/a") as resp:
            assert resp.status == 204
        published_a = run_a.published  # final: removal waited for a's frames in flight
        # One connection publishes both sources in order, so once b's later messages are
        # here every message a ever published is here too; then nothing more may come.
        b_at_delete = stack.runtime.sources["b"].published
        await until(lambda: len(collector.by_source("b")) >= b_at_delete + 10, what="b after delete")
        assert len(collector.by_source("a")) == published_a
        await until(lambda: len(collector.by_source("b")) >= b_at_delete + 20, what="more b")
        assert len(collector.by_source("a")) == published_a

        status, listed = await stack.json("GET", "/v1/sources")
        assert sorted(s["id"] for s in listed) == ["b", "b_2"]
        status, body = await stack.json("DELETE", "/v1/sources/a")
        assert (status, body) == (404, {"error": "no source 'a'"})
    finally:
        await stack.close()


@pytest.mark.parametrize(
    ("body", "status", "error"),
    [
        ({"url": "test://", "queue_size": "x"}, 400, "sources.queue_size: expected an integer, got 'x'"),
        (
            {"url": "test://", "queue_size": 10**12},
            400,
            "sources.queue_size: must be at most 1024, got 1000000000000",
        ),
        ({"url": "test://", "colour": "red"}, 400, "sources.colour: unknown key"),
        ({"url": "ftp://cam/x"}, 400, "sources.url: unsupported source scheme 'ftp' in 'ftp://cam/x'"),
        (
            {"url": "rtsp://cam/x", "stall_timeout": 1e300},
            400,
            "sources.stall_timeout: must be at most 3600, got 1e+300",
        ),
        ({"url": "test://", "id": "a b"}, 400, "sources.id: 'a b' is not a valid name"),
        (
            {"url": "rtsp://cam/x", "transport": "tcpp"},
            400,
            "sources.transport: expected one of 'tcp', 'udp', got 'tcpp' (hint: did you mean 'tcp'?)",
        ),
        (
            {"url": "test://?width=100000"},
            400,
            "sources.url: test:// parameter width=100000 is out of range (hint: use 16-7680)",
        ),
        (
            {"url": "rtsp://u:secret@[::1/x"},
            400,
            "sources.url: the URL's host and port '[::1' are malformed "
            "(hint: write HOST, HOST:PORT or [IPv6]:PORT with a port of 1-65535)",
        ),
        ({"url": "rtsp://u:secret@/x"}, 400, "sources.url: the rtsp:// URL names no host"),
        ({"queue_size": 4}, 400, "sources: missing required key 'url'"),
        ([1, 2], 400, "sources: expected a mapping at the top level, got a list"),
        ('{"url": "test://", "max_fps": NaN}', 400, "body: not valid JSON (NaN is not allowed, at max_fps)"),
        (
            '{"url": "test://", "x": [1, {"y": -Infinity}]}',
            400,
            "body: not valid JSON (-Infinity is not allowed, at x[1].y)",
        ),
        ("not json", 400, "body: not valid JSON (Expecting value: line 1 column 1 (char 0))"),
        ("[" * 100_000, 400, "body: not valid JSON"),
        ("x" * (1024 * 1024 + 1), 413, "Maximum request body size 1048576 exceeded"),
    ],
)
async def test_bad_bodies_name_the_field(
    tmp_path: Path, nats_server: EmbeddedNats, body: object, status: int, error: str
) -> None:
    stack = await Stack.start(tmp_path, config(nats_server), nats_server.url)
    try:
        data = body if isinstance(body, str) else json.dumps(body)
        got_status, got = await stack.json(
            "POST", "/v1/sources", data=data, headers={"Content-Type": "application/json"}
        )
        assert got_status == status, got
        assert got["error"].startswith(error), got
        assert stack.runtime.sources == {}
    finally:
        await stack.close()


async def test_cross_site_requests_are_refused(tmp_path: Path, nats_server: EmbeddedNats) -> None:
    stack = await Stack.start(tmp_path, config(nats_server), nats_server.url)
    try:
        # A form or no-cors fetch from another site can only send "simple" content types.
        status, body = await stack.json(
            "POST", "/v1/sources", data='{"url": "test://"}', headers={"Content-Type": "text/plain"}
        )
        assert (status, body) == (415, {"error": "Content-Type must be application/json, got 'text/plain'"})
        # A page on a domain rebound to 127.0.0.1 sends its own name as Host.
        status, body = await stack.json("GET", "/v1/sources", headers={"Host": "evil.example:8080"})
        assert (status, body) == (
            403,
            {"error": "Host 'evil.example:8080' is not allowed; use 127.0.0.1 or localhost"},
        )
        assert (await stack.json("GET", "/healthz", headers={"Host": "evil.example"}))[0] == 200
        for host in ("127.0.0.1", f"localhost:{stack.api.port}", "[::1]:8080"):
            assert (await stack.json("GET", "/v1/sources", headers={"Host": host}))[0] == 200, host
        assert stack.runtime.sources == {}
    finally:
        await stack.close()


async def test_urls_are_redacted_in_output(tmp_path: Path, nats_server: EmbeddedNats) -> None:
    stack = await Stack.start(tmp_path, config(nats_server), nats_server.url)
    try:
        async with stack.http.post(
            "/v1/sources", json={"url": "test://viewer:hunter2@cam/?id=c&fps=5"}
        ) as resp:
            assert resp.status == 201
            added = await resp.text()
        async with stack.http.get("/v1/sources") as resp:
            listed = await resp.text()
        for text in (added, listed):
            assert "hunter2" not in text and "viewer" not in text
        assert json.loads(added)["url"] == "test://***@cam/?id=c&fps=5"
        assert [s["url"] for s in json.loads(listed)] == ["test://***@cam/?id=c&fps=5"]
    finally:
        await stack.close()


async def test_bearer_token_is_enforced(tmp_path: Path, nats_server: EmbeddedNats) -> None:
    stack = await Stack.start(
        tmp_path,
        config(nats_server, '{id: a, url: "test://?fps=10"}', token="s3cret-token"),
        nats_server.url,
        token="s3cret-token",
    )
    try:
        import aiohttp

        async with aiohttp.ClientSession(base_url=stack.api.url) as anonymous:
            for path in (
                "/v1/sources",
                "/metrics",
                "/v1/stats",
                "/v1/models",
                "/v1/sources/a/snapshot.jpg",
                "/nope",
            ):
                async with anonymous.get(path) as resp:
                    assert resp.status == 401, path
                    assert resp.headers["WWW-Authenticate"].startswith("Bearer")
                    assert await resp.json() == {"error": "missing or wrong bearer token"}
            for header in (
                "Bearer s3cret-toke",
                "Bearer s3cret-token-",
                "Basic s3cret-token",
                "s3cret-token",
            ):
                async with anonymous.get("/v1/sources", headers={"Authorization": header}) as resp:
                    assert resp.status == 401, header
            # Rejected before the body is read: a stranger cannot make it buffer a megabyte.
            async with anonymous.post("/v1/sources", data=b"x" * (2 * 1024 * 1024)) as resp:
                assert resp.status == 401
            async with anonymous.delete("/v1/sources/a") as resp:
                assert resp.status == 401
            async with anonymous.delete("/v1/models/squares") as resp:
                assert resp.status == 401
            # Paths that normalise to an API route are still API routes.
            for path in (
                "/web/../v1/sources",
                "/healthz/../v1/sources",
                "/web/%2e%2e/v1/sources",
            ):
                async with anonymous.get(path) as resp:
                    assert resp.status in (401, 404), path
                    assert b'"id"' not in await resp.read(), path
            async with anonymous.get("/healthz") as resp:
                assert (resp.status, await resp.json()) == (200, {"status": "ok"})
            async with anonymous.get("/readyz") as resp:
                assert resp.status in (200, 503)
            async with anonymous.get("/") as resp:
                assert resp.status == 200  # the page itself holds no data
            async with anonymous.get("/web/dashboard.js") as resp:
                assert resp.status == 200 and resp.content_type in (
                    "application/javascript",
                    "text/javascript",
                )
            # A missing file is the API's JSON 404, not an empty octet-stream.
            for path, answer in (
                ("/web/nope.js", (404, {"error": "no such dashboard file: nope.js"})),
                ("/web/", (404, {"error": "Not Found"})),
            ):
                async with anonymous.get(path) as resp:
                    assert (resp.status, await resp.json()) == answer, path
        status, listed = await stack.json("GET", "/v1/sources")
        assert status == 200 and [s["id"] for s in listed] == ["a"]
        async with stack.http.get("/metrics") as resp:
            assert resp.status == 200
    finally:
        await stack.close()


async def test_refuses_to_listen_publicly_without_a_token(tmp_path: Path) -> None:
    with pytest.raises(
        ApiConfigError, match=r"http.listen 0.0.0.0:8080 is reachable from other machines.*token"
    ):
        ApiServer(object(), HttpConfig(listen="0.0.0.0:8080"))
    with pytest.raises(ApiConfigError, match=r"http.listen: expected HOST:PORT, got '127.0.0.1'"):
        ApiServer(object(), HttpConfig(listen="127.0.0.1"))
    with pytest.raises(ApiConfigError, match=r"http.token is empty"):
        ApiServer(object(), HttpConfig(listen="0.0.0.0:8080", token=" "))
    with pytest.raises(
        ApiConfigError, match=r"http.token is 15 characters; off loopback it must have at least 16"
    ):
        ApiServer(object(), HttpConfig(listen="0.0.0.0:8080", token="t" * 15))
    # Constructing with a long enough token is fine (nothing binds until start()).
    ApiServer(object(), HttpConfig(listen="0.0.0.0:8080", token="t" * 16))
    # On loopback a short token is the operator's business.
    ApiServer(object(), HttpConfig(listen="127.0.0.1:8080", token="t"))

    path = tmp_path / "p.yaml"
    path.write_text("pipeline: p\nsources:\n  - url: test://?fps=5\n")
    result = run_cli("run", str(path), "--http", "0.0.0.0:0", timeout=60, env={"VIDPIPE_HTTP_TOKEN": ""})
    # Refused as a usage error before anything starts.
    assert result.returncode == 2, result.stderr
    assert result.stderr.startswith("--http: http.listen 0.0.0.0:0 is reachable from other machines")


def sample(text: str, name: str, source: str) -> float:
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name and s.labels.get("source") == source:
                return s.value
    return 0.0


async def test_metrics_count_exactly_what_was_published(
    tmp_path: Path, nats_server: EmbeddedNats, collector: Collector
) -> None:
    await collector.start(nats_server.url, "vidpipe.apitest.>")
    stack = await Stack.start(
        tmp_path,
        config(nats_server, '{id: f, url: "test://?width=64&height=48&fps=30&frames=30"}'),
        nats_server.url,
    )
    try:
        await until(lambda: len(collector.by_source("f")) >= 1, what="the first message")
        async with stack.http.get("/metrics") as resp:
            assert resp.status == 200
            assert resp.headers["Content-Type"].startswith("text/plain; version=0.0.4")
            first = await resp.text()
        published_first = sample(first, "vidpipe_published_messages_total", "f")
        assert 1 <= published_first < 30  # scraped mid-run

        run = stack.runtime.sources["f"]
        await until(lambda: run.intake is not None and run.intake.done(), what="the source to end")
        async with stack.http.get("/metrics") as resp:
            second = await resp.text()
        await until(lambda: len(collector.by_source("f")) >= 30, what="30 messages")
        assert len(collector.by_source("f")) == 30
        for name in (
            "vidpipe_frames_total",
            "vidpipe_published_messages_total",
            "vidpipe_e2e_latency_seconds_count",
        ):
            assert sample(second, name, "f") == 30, name
        moved = sample(second, "vidpipe_published_messages_total", "f") - published_first
        assert moved == len([m for m in collector.by_source("f") if m["frame"] >= published_first])
        assert sample(second, "vidpipe_source_up", "f") == 0  # ended
    finally:
        await stack.close()


async def test_readyz_follows_nats_and_sources(tmp_path: Path, nats_server: EmbeddedNats) -> None:
    stack = await Stack.start(tmp_path, config(nats_server), nats_server.url)
    try:
        # Fed only through the API: ready with none (the POST that adds one must reach it).
        assert await stack.json("GET", "/readyz") == (200, {"ready": True, "reasons": []})
        status, _ = await stack.json("POST", "/v1/sources", json={"url": "whip://door"})
        assert status == 201
        # A second source publishers of whip://door would never reach.
        assert await stack.json("POST", "/v1/sources", json={"url": "whip://door", "id": "back"}) == (
            409,
            {"error": "sources.url: whip name 'door' is already used by source 'door'; "
                      "give this publisher another name"},
        )  # fmt: skip
        assert await stack.json("GET", "/readyz") == (
            503,
            {"ready": False, "reasons": ["no source is up (door connecting)"]},
        )
        await stack.json("POST", "/v1/sources", json={"id": "cam", "url": "test://?fps=20"})
        await until(lambda: stack.runtime.sources["cam"].source.state.value == "up", what="cam up")
        assert await stack.json("GET", "/readyz") == (200, {"ready": True, "reasons": []})

        nats_server.stop()
        await until(lambda: not stack.runtime.publisher.connected.is_set(), what="NATS disconnect")
        status, body = await stack.json("GET", "/readyz")
        assert (status, body["reasons"]) == (503, ["NATS is not connected"])
        assert await stack.json("GET", "/healthz") == (200, {"status": "ok"})
    finally:
        await stack.close()


async def test_snapshot_stats_and_models(tmp_path: Path, nats_server: EmbeddedNats) -> None:
    stack = await Stack.start(
        tmp_path,
        config(nats_server, '{id: s, url: "test://?width=320&height=180&fps=30"}', '{url: "whip://door"}'),
        nats_server.url,
    )
    try:
        assert await stack.json("GET", "/v1/sources/door/snapshot.jpg") == (
            404,
            {"error": "source 'door' has not published a frame yet"},
        )
        assert await stack.json("GET", "/v1/sources/nope/snapshot.jpg") == (
            404,
            {"error": "no source 'nope'"},
        )
        run = stack.runtime.sources["s"]
        await until(lambda: run.last_frame is not None, what="a published frame")
        async with stack.http.get("/v1/sources/s/snapshot.jpg") as resp:
            assert (resp.status, resp.content_type) == (200, "image/jpeg")
            image = cv2.imdecode(np.frombuffer(await resp.read(), np.uint8), cv2.IMREAD_COLOR)
        assert image is not None and image.shape == (180, 320, 3)

        status, stats = await stack.json("GET", "/v1/stats")
        assert status == 200
        by_id = {s["id"]: s for s in stats["sources"]}
        assert set(by_id) == {"s", "door"}
        assert by_id["s"]["published"] >= 1 and by_id["s"]["latency_ms"]["p50"] is not None
        assert by_id["door"]["latency_ms"] == {"p50": None, "p99": None}
        assert stats["models"] == []
        assert await stack.json("GET", "/v1/models") == (200, [])
    finally:
        await stack.close()


def test_snapshot_draws_boxes_labels_and_track_ids() -> None:
    image = np.zeros((120, 200, 3), np.uint8)
    frame = Frame(source="s", index=0, pts=0.0, capture_ts=0.0, image=image)
    frame.objects.append(
        DetectedObject(
            id=1, label="plate", class_id=0, score=0.9, bbox=(40, 50, 160, 100), stage="d", track_id=7
        )
    )
    drawn = annotate(frame)
    assert drawn.shape == (120, 200, 3)
    assert drawn[75, 40].max() > 100 and drawn[75, 160].max() > 100  # the box's left and right edges
    assert drawn[75, 100].max() == 0  # inside the box stays untouched
    assert drawn[30:50, 40:160].max() > 100  # the caption above the box
    assert image.max() == 0  # the published frame itself is not drawn on


async def test_models_batching_and_annotated_snapshot(
    tmp_path: Path, nats_server: EmbeddedNats, sample_models: Path
) -> None:
    text = config(nats_server, '{id: sq, url: "test://?width=320&height=240&fps=20"}')
    text += f"models: {sample_models}\nstages:\n  - {{name: objects, type: infer, model: squares}}\n"
    text += "  - {name: track, type: track}\n"
    stack = await Stack.start(tmp_path, text, nats_server.url)
    try:
        status, models = await stack.json("GET", "/v1/models")
        assert status == 200
        squares = next(m for m in models if m["name"] == "squares")
        assert squares["state"] == "ready" and squares["max_batch_size"] >= 1
        # The precision the backend computes in (OpenVINO's choice for this CPU).
        assert squares["backend"] == "openvino" and squares["precision"] in ("bf16", "f32")
        assert squares["precision"] == stack.runtime.models.get("squares").precision
        # Where images are normalised: inside the compiled model (OpenVINO, preprocess: auto).
        assert squares["preprocess"] == "model"
        run = stack.runtime.sources["sq"]
        await until(lambda: run.last_frame is not None and bool(run.last_frame.objects), what="a detection")
        assert await stack.json("GET", "/readyz") == (200, {"ready": True, "reasons": []})

        async with stack.http.get("/v1/sources/sq/snapshot.jpg") as resp:
            frame_index = int(resp.headers["X-Frame-Index"])
            image = cv2.imdecode(np.frombuffer(await resp.read(), np.uint8), cv2.IMREAD_COLOR)
        assert image is not None and image.shape == (240, 320, 3)
        # The test pattern is grey; the box and caption drawn around the square are not.
        bgr = image.astype(int)
        coloured = (bgr.max(axis=2) - bgr.min(axis=2)) > 80
        assert coloured.sum() > 100, frame_index

        await stack.json("DELETE", "/v1/sources/sq")
        status, stats = await stack.json("GET", "/v1/stats")
        (model,) = stats["models"]
        assert model["model"] == "squares" and model["batches"] >= 1
        assert model["mean_batch_size"] == round(model["requests"] / model["batches"], 2)
        assert sum(int(k) * n for k, n in model["batch_sizes"].items()) == model["requests"]
        assert 0 < model["queue_ms"]["p50"] <= model["queue_ms"]["p99"]
    finally:
        await stack.close()
