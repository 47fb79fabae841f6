"""The model repository over HTTP: ``GET /v1/models``, ``POST /v1/models/{name}/reload``
and ``DELETE /v1/models/{name}``.

A reload re-reads the model's ``config.yaml`` and files and swaps the new copy in
once it is ready; the body is ``{}`` or ``{"force": true}`` (to reload a model the
pipeline does not use). A model no stage uses, loaded that way, is unloaded with
``DELETE``; one whose forced load fails is unloaded at once. docs/api.md.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from aiohttp import web

from inference.model import ModelState
from inference.repository import ModelRepository, ModelStatus
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
        router.add_delete("/v1/models/{name}", self.unload_model)

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
            serving = _serving(repo, name)
            if serving is not None:
                # Its folder went away while it serves: as every failed reload, the log says so.
                log.warning(
                    "model %s: reload failed, still serving %s: no model %r in the repository %s",
                    name, serving, name, repo.root if repo is not None else "",
                )  # fmt: skip
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
            if status.state is not ModelState.READY and name not in self._runtime.config.models_used():
                # A forced load no stage needs that failed: nothing serves, so nothing is kept
                # (a vidpipe_model_ready of 0 would page for a model nobody uses).
                await repo.unload(name)
                log.info("model %s unloaded: its forced load failed and no stage uses it", name)
            return 422, body
        return 200, body

    async def unload_model(self, request: web.Request) -> web.Response:
        """Unload a model no stage uses (one loaded with a forced reload): 204.

        409 while a stage uses it, 404 when no copy of it is loaded.
        """
        name = request.match_info["name"]
        cfg = self._runtime.config
        users = [s.name for s in cfg.stages if name in s.models()]
        if users:
            return error(
                409,
                f"model {name!r} is used by stage {users[0]!r} of this pipeline; only a model no stage "
                "uses can be unloaded",
            )
        repo = self._runtime.models
        running = self._reloads.get(name)
        if running is not None:
            # A reload of it under way ends first: its answer is for the copy unloaded here.
            await asyncio.shield(running)
        if repo is None or not repo.holds(name):
            return error(404, f"model {name!r} is not loaded")
        was = _serving(repo, name) or "a copy that did not load"
        await repo.unload(name)
        log.info("model %s unloaded: %s (no stage uses it)", name, was)
        return web.Response(status=204)


def _serving(repo: ModelRepository | None, name: str) -> str | None:
    """``version 2 on openvino``: the copy of ``name`` that serves, as the reload log names it;
    None when none does."""
    if repo is None or not repo.holds(name):
        return None
    status: ModelStatus | None = next((s for s in repo.status() if s.name == name), None)
    if status is None or status.state is not ModelState.READY:
        return None
    version = f"version {status.version}" if status.version is not None else "the model file"
    return f"{version} on {status.backend}"
