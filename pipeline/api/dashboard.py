"""The dashboard: ``GET /`` and its static files under ``/web/``.

The page and its files hold no data, so they need no token; the page sends the
token (from ``/?token=...``, kept for the tab) with every API call it makes.
"""

from __future__ import annotations

from pathlib import Path

from aiohttp import web

WEB_DIR = Path(__file__).resolve().parent.parent / "web"


# The page's own files, by name: nothing else under the folder is served, and a missing
# name is the API's JSON 404 (aiohttp's static route answered an empty octet-stream).
WEB_FILES = {p.name: p for p in WEB_DIR.iterdir() if p.suffix in (".css", ".js")}


async def dashboard(request: web.Request) -> web.FileResponse:
    return web.FileResponse(WEB_DIR / "index.html", headers={"Content-Type": "text/html"})


async def web_file(request: web.Request) -> web.FileResponse:
    path = WEB_FILES.get(request.match_info["name"])
    if path is None:
        raise web.HTTPNotFound(text=f"no such dashboard file: {request.match_info['name']}")
    return web.FileResponse(path)


def add_dashboard(router: web.UrlDispatcher) -> None:
    router.add_get("/", dashboard)
    router.add_get("/web/{name}", web_file)
