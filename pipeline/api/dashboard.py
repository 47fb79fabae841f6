"""The dashboard: ``GET /`` and its static files under ``/web/``.

The page and its files hold no data, so they need no token; the page sends the
token (from ``/?token=...``, kept for the tab) with every API call it makes.
"""

from __future__ import annotations

from pathlib import Path

from aiohttp import web

WEB_DIR = Path(__file__).resolve().parent.parent / "web"


async def dashboard(request: web.Request) -> web.FileResponse:
    return web.FileResponse(WEB_DIR / "index.html", headers={"Content-Type": "text/html"})


def add_dashboard(router: web.UrlDispatcher) -> None:
    router.add_get("/", dashboard)
    router.add_static("/web/", WEB_DIR, show_index=False, follow_symlinks=False)
