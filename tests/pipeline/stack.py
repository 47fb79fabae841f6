"""A running pipeline with its HTTP server, in-process, for the API, WHIP and dashboard tests."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import aiohttp

from pipeline.api import ApiServer
from pipeline.config import load_config
from pipeline.runtime import Runtime
from pipeline.stages.base import Stage
from pipeline.stages.registry import register_stage, unregister_stage


@contextlib.contextmanager
def stage_kinds(*kinds: type[Stage]) -> Iterator[None]:
    """Test stage kinds usable as ``type:`` in a config while the block runs."""
    for kind in kinds:
        register_stage(kind)
    try:
        yield
    finally:
        for kind in kinds:
            unregister_stage(kind.kind)


class Stack:
    """Runtime + ApiServer from a YAML text, and an HTTP client for it."""

    def __init__(self, runtime: Runtime, api: ApiServer, token: str | None) -> None:
        self.runtime = runtime
        self.api = api
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.http = aiohttp.ClientSession(base_url=api.url, headers=headers)

    @classmethod
    async def start(cls, tmp_path: Path, yaml_text: str, nats_url: str, token: str | None = None) -> Stack:
        path = tmp_path / "pipeline.yaml"
        path.write_text(yaml_text)
        cfg = load_config(path)
        assert cfg.http is not None, "the test config needs an http: section"
        runtime = Runtime(cfg, nats_url=nats_url)
        await runtime.start()
        runtime.keep_running()
        try:
            api = ApiServer(runtime, cfg.http)
            await api.start()
        except BaseException:
            await runtime.stop()
            raise
        return cls(runtime, api, token)

    async def close(self) -> None:
        await self.http.close()
        await self.runtime.stop()
        await self.api.stop()

    async def json(self, method: str, path: str, **kwargs: Any) -> tuple[int, Any]:
        async with self.http.request(method, path, **kwargs) as resp:
            body = await resp.read()
            if resp.content_type == "application/json":
                return resp.status, await resp.json()
            return resp.status, body


async def until(condition: Callable[[], bool], timeout: float = 15.0, what: str = "condition") -> None:
    """Poll ``condition`` until it holds; fail with ``what`` after ``timeout`` seconds."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not condition():
        if loop.time() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        await asyncio.sleep(0.02)
