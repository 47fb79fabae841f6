"""Liveness and readiness through outages outside the process, and with sources from the API.

A real nats-server (stopped and started again on the same port and store), a real
fleet worker and runtime behind the HTTP API.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import aiohttp

from pipeline.nats_server import EmbeddedNats
from tests.pipeline.stack import Stack, until
from tests.pipeline.test_fleet import one_worker

# What /healthz answered 503 after, before: max(30 s, 5 × lease_ttl) without a heartbeat.
OLD_LIMIT = 30.0


async def get(http: aiohttp.ClientSession, path: str) -> tuple[int, Any]:
    async with http.get(path) as resp:
        return resp.status, await resp.json()


async def test_a_nats_outage_fails_readiness_not_liveness_of_a_fleet_worker(
    nats_server: EmbeddedNats, tmp_path: Path
) -> None:
    async with (
        one_worker(nats_server.url, tmp_path, ["cam1"], fleet="outage", worker_id="w1") as (worker, api),
        aiohttp.ClientSession(base_url=api.url) as http,
    ):
        assert worker.ttl == 2  # lease_ttl small: the old limit was its floor, 30 s
        await until(lambda: bool(worker.owned), what="never took its source")
        deadline = time.monotonic() + 15
        while await get(http, "/readyz") != (200, {"ready": True, "reasons": []}):
            assert time.monotonic() < deadline, await get(http, "/readyz")
        assert await get(http, "/healthz") == (200, {"status": "ok"})

        nats_server.stop()
        stopped = time.monotonic()
        last: tuple[int, Any] = (200, None)
        # Past the old limit with margin: liveness holds on every probe; readiness fails
        # as soon as the worker sees NATS gone, and stays failing.
        while time.monotonic() - stopped < OLD_LIMIT + 6:
            assert await get(http, "/healthz") == (200, {"status": "ok"}), time.monotonic() - stopped
            status = await get(http, "/readyz")
            if last[0] == 503:
                assert status[0] == 503, (time.monotonic() - stopped, status)
            last = status
            assert last[0] == 503 or time.monotonic() - stopped < 10, "readyz never failed"
            await asyncio.sleep(0.25)  # the pace of the probes, not a wait for anything
        assert worker.health_problem() is None
        body = last[1]
        quiet = body["reasons"][1].removeprefix(
            "fleet outage: NATS is not connected (no heartbeat written for "
        )
        assert body == {
            "ready": False,
            "reasons": [
                "NATS is not connected",
                f"fleet outage: NATS is not connected (no heartbeat written for {quiet}",
            ],
        }
        assert quiet.endswith("s)") and int(quiet[:-2]) >= OLD_LIMIT

        nats_server.start()
        deadline = time.monotonic() + 30
        while await get(http, "/readyz") != (200, {"ready": True, "reasons": []}):
            assert time.monotonic() < deadline, await get(http, "/readyz")
            assert await get(http, "/healthz") == (200, {"status": "ok"})
        assert worker.health_problem() is None
        assert worker.readiness_problem() is None


CONFIG = """\
pipeline: apionly
sources:{sources}
nats: {{url: "{nats}"}}
http: {{listen: "127.0.0.1:0"}}
"""


async def test_a_pipeline_fed_only_through_the_api_is_ready_with_no_sources(
    tmp_path: Path, nats_server: EmbeddedNats
) -> None:
    stack = await Stack.start(tmp_path, CONFIG.format(sources=" []", nats=nats_server.url), nats_server.url)
    try:
        assert await stack.json("GET", "/readyz") == (200, {"ready": True, "reasons": []})
        # A source added over the API must come up like any other.
        status, _ = await stack.json("POST", "/v1/sources", json={"url": "whip://door"})
        assert status == 201
        assert await stack.json("GET", "/readyz") == (
            503,
            {"ready": False, "reasons": ["no source is up (door connecting)"]},
        )
        # Removed again: none, and ready, waiting for the next one.
        assert (await stack.json("DELETE", "/v1/sources/door"))[0] == 204
        assert await stack.json("GET", "/readyz") == (200, {"ready": True, "reasons": []})

        nats_server.stop()
        await until(lambda: not stack.runtime.publisher.connected.is_set(), what="NATS disconnect")
        assert await stack.json("GET", "/readyz") == (
            503,
            {"ready": False, "reasons": ["NATS is not connected"]},
        )
        assert await stack.json("GET", "/healthz") == (200, {"status": "ok"})
    finally:
        await stack.close()


async def test_a_pipeline_whose_config_names_sources_is_not_ready_with_none_up(
    tmp_path: Path, nats_server: EmbeddedNats
) -> None:
    stack = await Stack.start(
        tmp_path,
        CONFIG.format(sources='\n  - {id: cam, url: "whip://cam"}', nats=nats_server.url),
        nats_server.url,
    )
    try:
        assert await stack.json("GET", "/readyz") == (
            503,
            {"ready": False, "reasons": ["no source is up (cam connecting)"]},
        )
        # Its named sources all removed over the API: still not ready (it runs nothing it was given).
        assert (await stack.json("DELETE", "/v1/sources/cam"))[0] == 204
        assert await stack.json("GET", "/readyz") == (503, {"ready": False, "reasons": ["no sources"]})
    finally:
        await stack.close()
