"""The model repository over HTTP: ``GET /v1/models`` and ``POST /v1/models/{name}/reload``.

A reload re-reads the model's ``config.yaml`` and files and swaps the new copy in
once it is ready; the body is ``{}`` or ``{"force": true}`` (to reload a model the
pipeline does not use). docs/models.md.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from aiohttp import web

from inference.model import ModelState
from pipeline.api.answers import error, jsonable
from pipeline.api.bodies import parse_json, read_body
from pipeline.runtime import Runtime

log = logging.getLogger("vidpipe.api")

# A reload body holds at most {"force": true}.
MAX_RELOAD_BODY_BYTES = 64 * 1024


class ModelRoutes:
    """List the repository's models; reload one, at most one reload per model at a time."""

    def __init__(self, runtime: Runtime) -> None:
        self._runtime = runtime
        # One reload per model at a time: a second request waits for the first one's answer.
        self._reloads: dict[str, asyncio.Task[tuple[int, dict[str, Any]]]] = {}

    def add_to(self, router: web.UrlDispatcher) -> None:
        router.add_get("/v1/models", self.models)
        router.add_post("/v1/models/{name}/reload", self.reload_model)

    async def models(self, request: web.Request) -> web.Response:
        repo = self._runtime.models
        if repo is None:
            return web.json_response([])
        return web.json_response([jsonable(s) for s in repo.status()])

    async def reload_model(self, request: web.Request) -> web.Response:
        """Re-read a model's config.yaml and files and swap the new copy in once it is ready.

        Requests already queued on the old copy finish; if the new copy fails, the old
        one keeps serving and the answer (422) says why.
        """
        name = request.match_info["name"]
        raw = await read_body(request, "application/json", MAX_RELOAD_BODY_BYTES, "reload body")
        if isinstance(raw, web.Response):
            return raw
        try:
            data = parse_json(raw) if raw.strip() else {}
        except ValueError as exc:
            return error(400, f"body: {exc}")
        if not isinstance(data, dict) or set(data) - {"force"}:
            return error(400, 'body: expected {} or {"force": true}')
        force = data.get("force", False)
        if not isinstance(force, bool):
            return error(400, f"force: expected true or false, got {force!r}")
        force = force or request.query.get("force") in ("1", "true")
        repo = self._runtime.models
        if repo is None or name not in repo.names():
            return error(404, f"no model {name!r} in the repository")
        if name not in self._runtime.config.models_used() and not force:
            # Loading a model nobody uses costs memory and time for nothing; ask for it explicitly.
            return error(
                409,
                f'model {name!r} is not used by this pipeline; send {{"force": true}} to reload it anyway',
            )
        task = self._reloads.get(name)
        if task is None:
            task = self._reloads[name] = asyncio.create_task(self._reload(name), name=f"reload-{name}")
            task.add_done_callback(lambda _: self._reloads.pop(name, None))
        # shield: a client that hangs up must not cancel the reload others wait for.
        status, body = await asyncio.shield(task)
        return web.json_response(body, status=status)

    async def _reload(self, name: str) -> tuple[int, dict[str, Any]]:
        repo = self._runtime.models
        assert repo is not None
        # A copy the pipeline's stages cannot use is refused like one that fails to load.
        status = await repo.reload(name, fits=self._runtime.model_misfit)
        body = jsonable(status)
        if status.state is not ModelState.READY or status.reason:
            body["error"] = status.reason or f"model {name} is {status.state.value}"
            return 422, body
        return 200, body
