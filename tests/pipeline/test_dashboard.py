"""The dashboard in real headless Chromium, driven over the DevTools protocol."""

from __future__ import annotations

import asyncio
import base64
import itertools
import json
import subprocess
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from pipeline.nats_server import EmbeddedNats
from tests.conftest import ARTIFACTS
from tests.pipeline.stack import Stack, until
from tests.support.processes import stop_process

CHROMIUM = Path("/usr/bin/chromium")
pytestmark = pytest.mark.skipif(
    not CHROMIUM.exists(), reason="needs /usr/bin/chromium (make test installs it with apt)"
)

CONFIG = """\
pipeline: dash
sources:
  - {{id: lobby, url: "test://?width=320&height=180&fps=15"}}
  - {{id: gate, url: "test://?width=240&height=160&fps=15"}}
nats: {{url: "{nats}"}}
http: {{listen: "127.0.0.1:0"{token}}}
"""

# What the page shows for one source: the card, its numbers, and its snapshot's pixels
# (drawn into a canvas, so a new frame with the square elsewhere changes the hash).
READ_CARD = """
((id) => {
  const card = document.querySelector(`[data-source-id="${id}"]`);
  if (!card) return null;
  const img = card.querySelector("img");
  const out = {
    state: card.querySelector(".state").textContent,
    fps: card.querySelector('[data-field="fps"]').textContent,
    src: img.getAttribute("src"),
    width: img.naturalWidth,
    height: img.naturalHeight,
    hash: null,
  };
  if (img.complete && img.naturalWidth) {
    const canvas = document.createElement("canvas");
    canvas.width = img.naturalWidth;
    canvas.height = img.naturalHeight;
    const ctx = canvas.getContext("2d");
    ctx.drawImage(img, 0, 0);
    const data = ctx.getImageData(0, 0, canvas.width, canvas.height).data;
    let hash = 0;
    for (let i = 0; i < data.length; i += 4) hash = (Math.imul(hash, 31) + data[i]) >>> 0;
    out.hash = hash;
  }
  return out;
})
"""


class DevTools:
    """A headless Chromium and one page, over the Chrome DevTools Protocol."""

    def __init__(self, proc: subprocess.Popen[bytes], http: aiohttp.ClientSession, ws: Any) -> None:
        self.proc = proc
        self.http = http
        self.ws = ws
        self._ids = itertools.count(1)

    async def call(self, method: str, **params: Any) -> dict[str, Any]:
        msg_id = next(self._ids)
        await self.ws.send_json({"id": msg_id, "method": method, "params": params})
        while True:
            reply = await asyncio.wait_for(self.ws.receive_json(), 20)
            if reply.get("id") == msg_id:  # everything else is an event we did not ask for
                if "error" in reply:
                    raise AssertionError(f"{method}: {reply['error']}")
                result: dict[str, Any] = reply["result"]
                return result

    async def evaluate(self, expression: str) -> Any:
        result = await self.call("Runtime.evaluate", expression=expression, returnByValue=True)
        if "exceptionDetails" in result:
            raise AssertionError(f"page script failed: {result['exceptionDetails']}")
        return result["result"].get("value")

    async def poll(self, expression: str, accept: Any, timeout: float = 15.0) -> Any:
        """Evaluate until ``accept(value)``; the last value on timeout goes into the failure."""
        deadline = asyncio.get_running_loop().time() + timeout
        value = None
        while asyncio.get_running_loop().time() < deadline:
            value = await self.evaluate(expression)
            if accept(value):
                return value
            await asyncio.sleep(0.1)
        raise AssertionError(f"timed out; last value of {expression[:60]!r}...: {value!r}")

    async def screenshot(self, path: Path) -> None:
        shot = await self.call("Page.captureScreenshot", format="png")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(base64.b64decode(shot["data"]))


@pytest.fixture
async def chromium(tmp_path: Path) -> AsyncIterator[DevTools]:
    profile = tmp_path / "chromium-profile"
    profile.mkdir()
    log = (tmp_path / "chromium.log").open("wb")
    proc = subprocess.Popen(
        [
            str(CHROMIUM), "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
            "--no-first-run", "--disable-background-networking", "--disable-component-update",
            "--disable-sync", "--disable-extensions", f"--user-data-dir={profile}",
            "--remote-debugging-address=127.0.0.1", "--remote-debugging-port=0",
            "--window-size=1280,800",
            # Plain host candidates (not mDNS names) so the page's WebRTC reaches the server.
            "--disable-features=WebRtcHideLocalIpsWithMdns", "about:blank",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )  # fmt: skip
    http = aiohttp.ClientSession()
    try:
        # Chromium writes the port it picked into the profile once it listens.
        port_file = profile / "DevToolsActivePort"
        deadline = asyncio.get_running_loop().time() + 20
        while not (port_file.exists() and port_file.read_text().strip()):
            if proc.poll() is not None or asyncio.get_running_loop().time() > deadline:
                raise AssertionError(
                    f"chromium did not start: {(tmp_path / 'chromium.log').read_text()[-2000:]}"
                )
            await asyncio.sleep(0.05)
        port = int(port_file.read_text().split()[0])
        async with http.get(f"http://127.0.0.1:{port}/json/list") as resp:
            targets = await resp.json()
        page = next(t for t in targets if t["type"] == "page")
        ws = await http.ws_connect(page["webSocketDebuggerUrl"], max_msg_size=0)
        devtools = DevTools(proc, http, ws)
        await devtools.call("Runtime.enable")
        yield devtools
        await ws.close()
    finally:
        await http.close()
        stop_process(proc, timeout=10)
        log.close()


async def open_dashboard(chromium: DevTools, url: str) -> None:
    await chromium.call("Page.navigate", url=url)
    await chromium.poll("document.readyState", lambda v: v == "complete")


def card_reader(source: str) -> str:
    return f"{READ_CARD}({json.dumps(source)})"


async def test_dashboard_lists_sources_and_refreshes_snapshots(
    tmp_path: Path, nats_server: EmbeddedNats, chromium: DevTools
) -> None:
    stack = await Stack.start(tmp_path, CONFIG.format(nats=nats_server.url, token=""), nats_server.url)
    try:
        await open_dashboard(chromium, stack.api.url + "/")
        ids = await chromium.poll(
            "[...document.querySelectorAll('[data-source-id]')].map((e) => e.dataset.sourceId)",
            lambda v: v is not None and len(v) == 2,
        )
        assert sorted(ids) == ["gate", "lobby"]

        first = await chromium.poll(card_reader("lobby"), lambda v: v and v["hash"] is not None)
        assert (first["width"], first["height"]) == (320, 180)
        assert first["src"].startswith("/v1/sources/lobby/snapshot.jpg?t=")
        # The square moves every frame, so a later snapshot has other pixels (and URL).
        later = await chromium.poll(
            card_reader("lobby"), lambda v: v["hash"] is not None and v["hash"] != first["hash"]
        )
        assert later["src"] != first["src"]
        gate = await chromium.poll(card_reader("gate"), lambda v: v and v["width"] == 240)
        assert gate["height"] == 160
        # The rate comes from /v1/stats once two samples a second apart exist.
        card = await chromium.poll(card_reader("lobby"), lambda v: v["fps"] not in ("–", ""))
        assert card["state"] == "up"
        assert 5 <= float(card["fps"]) <= 25, card
        await chromium.screenshot(ARTIFACTS / "dashboard.png")

        # A source removed over the API disappears from the page.
        async with stack.http.delete("/v1/sources/gate") as resp:
            assert resp.status == 204
        await chromium.poll(
            "[...document.querySelectorAll('[data-source-id]')].map((e) => e.dataset.sourceId)",
            lambda v: v == ["lobby"],
        )
    finally:
        await stack.close()


async def test_dashboard_sends_the_token_from_the_url(
    tmp_path: Path, nats_server: EmbeddedNats, chromium: DevTools
) -> None:
    token = "dash-token-123"
    stack = await Stack.start(
        tmp_path, CONFIG.format(nats=nats_server.url, token=f", token: {token}"), nats_server.url, token=token
    )
    try:
        await open_dashboard(chromium, f"{stack.api.url}/?token={token}")
        card = await chromium.poll(card_reader("lobby"), lambda v: v and v["hash"] is not None)
        # Images came through fetch with the bearer header, shown via blob: URLs.
        assert card["src"].startswith("blob:")
        assert (card["width"], card["height"]) == (320, 180)
        # The token does not stay in the address bar (history, screenshots, shoulder-surfing).
        assert await chromium.evaluate("location.search") == ""

        await open_dashboard(chromium, f"{stack.api.url}/")  # a new tab session: no token
        await chromium.evaluate("sessionStorage.clear()")
        await open_dashboard(chromium, f"{stack.api.url}/")
        status = await chromium.poll(
            "document.getElementById('status').textContent", lambda v: v and "token" in v
        )
        assert status == "a token is required: open /?token=<token>"
    finally:
        await stack.close()


async def test_dashboard_watches_a_source_live_over_whep(
    tmp_path: Path, nats_server: EmbeddedNats, chromium: DevTools
) -> None:
    stack = await Stack.start(tmp_path, CONFIG.format(nats=nats_server.url, token=""), nats_server.url)
    try:
        await open_dashboard(chromium, stack.api.url + "/")
        await chromium.poll(card_reader("lobby"), lambda v: v and v["hash"] is not None)
        await chromium.evaluate("document.querySelector('button.live[data-live=\"lobby\"]').click()")
        # The video element plays the annotated frames: the source's size, time moving on.
        video = await chromium.poll(
            "(() => { const v = document.getElementById('live-lobby');"
            " const img = document.getElementById('snapshot-lobby');"
            " return {w: v.videoWidth, h: v.videoHeight, t: v.currentTime, hidden: v.hidden,"
            " img: getComputedStyle(img).display, other: getComputedStyle("
            "document.getElementById('live-gate')).display,"
            " label: document.querySelector('button.live[data-live=\"lobby\"]').textContent}; })()",
            lambda v: v["w"] > 0 and v["t"] > 0.5,
            timeout=30,
        )
        assert (video["w"], video["h"], video["hidden"], video["label"]) == (320, 180, False, "Stop live")
        # The live view replaces the snapshot in its card; other cards show no empty player.
        assert (video["img"], video["other"]) == ("none", "none")
        await chromium.screenshot(ARTIFACTS / "dashboard-live.png")
        assert stack.runtime.outputs.relay.viewers("lobby") == 1
        # Stopping ends the WHEP session on the server too.
        await chromium.evaluate("document.querySelector('button.live[data-live=\"lobby\"]').click()")
        await chromium.poll("document.getElementById('live-lobby').hidden", lambda v: v is True, timeout=10)
        for _ in range(50):
            if stack.runtime.outputs.relay.viewers("lobby") == 0:
                break
            await asyncio.sleep(0.1)
        assert stack.runtime.outputs.relay.viewers("lobby") == 0
        # Closing the page while watching gives the session's place back at once (a closed
        # tab held it until WebRTC found the connection gone, about 30 s).
        await chromium.evaluate("document.querySelector('button.live[data-live=\"lobby\"]').click()")
        await until(lambda: len(stack.api.whep.sessions) == 1, what="a second live session", timeout=20)
        # The page has the session's URL (the answer reached it): a page closed while its
        # offer is still out cannot end a session it never heard of; that one expires unconnected.
        await chromium.poll(
            "[...cards.values()].some((c) => c.whep !== null && Boolean(c.whep.location))",
            lambda v: v is True,
            timeout=20,
        )
        await chromium.evaluate("location.href = 'about:blank'")
        await until(lambda: stack.api.whep.sessions == {}, what="the session ended with the page", timeout=5)
    finally:
        await stack.close()
