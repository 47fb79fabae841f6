"""Shared fixtures: a real nats-server per test, sample clips, schema validation, CLI runs."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from pipeline.messages import detections_schema
from pipeline.nats_server import EmbeddedNats

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

ARTIFACTS = ROOT / "test-artifacts"


@pytest.fixture
def nats_server(tmp_path: Path) -> Iterator[EmbeddedNats]:
    """A real nats-server with JetStream on a free loopback port."""
    server = EmbeddedNats(store_dir=str(tmp_path / "js")).start()
    try:
        yield server
    finally:
        server.cleanup()


@pytest.fixture(scope="session")
def sample_models() -> Path:
    return ROOT / "samples" / "models"


# A light graph (the squares detector only): live test sources never fall behind it.
SQUARES = """\
pipeline: demo
models: {models}
stages:
  - {{name: objects, type: infer, model: squares}}
"""


@pytest.fixture
def squares_config(tmp_path: Path, sample_models: Path) -> Path:
    path = tmp_path / "squares.yaml"
    path.write_text(SQUARES.format(models=sample_models))
    return path


@pytest.fixture(scope="session")
def demo_clip(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from samples.make_clip import write_clip

    return write_clip(tmp_path_factory.mktemp("clips") / "demo.mp4", frames=45, fps=15)


def validate_message(message: dict[str, Any]) -> None:
    jsonschema.validate(message, detections_schema())


class Collector:
    """A separate nats-py subscriber that keeps every message it receives."""

    def __init__(self) -> None:
        self.messages: list[dict[str, Any]] = []
        self.subjects: list[str] = []
        self.nc: Any = None

    async def start(self, url: str, subject: str = "vidpipe.>") -> Collector:
        import nats

        self.nc = await nats.connect(url)

        async def on_msg(msg: Any) -> None:
            self.subjects.append(msg.subject)
            self.messages.append(json.loads(msg.data))

        await self.nc.subscribe(subject, cb=on_msg)
        await self.nc.flush()
        return self

    async def wait_for(self, count: int, timeout: float = 30.0) -> None:
        """Until at least ``count`` messages arrived; fails the test after ``timeout`` seconds."""
        deadline = asyncio.get_running_loop().time() + timeout
        while len(self.messages) < count:
            if asyncio.get_running_loop().time() > deadline:
                raise AssertionError(f"{len(self.messages)} of {count} messages after {timeout}s")
            await asyncio.sleep(0.05)

    def by_source(self, source: str) -> list[dict[str, Any]]:
        return [m for m in self.messages if m["source"] == source]

    async def close(self) -> None:
        if self.nc is not None:
            await self.nc.close()


@pytest.fixture
async def collector() -> AsyncIterator[Collector]:
    c = Collector()
    try:
        yield c
    finally:
        await c.close()


def run_cli(
    *args: str, timeout: float = 120, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """Run ``vidpipe`` as a user would, in a subprocess."""
    full_env = {**os.environ, **(env or {})}
    return subprocess.run(
        [sys.executable, "-m", "pipeline.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
        env=full_env,
    )
