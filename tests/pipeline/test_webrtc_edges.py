"""WebRTC edges: a publisher that changes its video size, offers with no usable ICE
candidate, PATCH (trickle ICE) on a session, and the dashboard's live view refused.

Real parts: the runtime and API on a real socket, aiortc peers over loopback, a NATS
subscriber, and headless Chromium for the dashboard.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterator
from fractions import Fraction
from pathlib import Path

import aioice.ice
import numpy as np
import pytest
from aiortc import RTCConfiguration, RTCPeerConnection, RTCSessionDescription, VideoStreamTrack
from av import VideoFrame

from pipeline.api.webrtc import NO_PATCH
from pipeline.nats_server import EmbeddedNats
from pipeline.sources.base import SourceState
from pipeline.sources.whip import WhipSource
from pipeline.webrtc_guard import PENDING_TIMEOUT
from tests.conftest import Collector
from tests.pipeline.stack import Stack, until
from tests.pipeline.test_dashboard import CHROMIUM, DevTools, chromium, open_dashboard
from tests.pipeline.test_whip import Publisher, SolidColour

__all__ = ["chromium"]  # the fixture, used by name

CONFIG = """\
pipeline: edges
sources:
  - url: whip://cam
    open_timeout: 60       # only the pending-session expiry may end a silent publisher
  - {{url: "test://?width=64&height=48&fps=10", id: pattern}}
nats: {{url: "{nats}"}}
http: {{listen: "127.0.0.1:0"}}
"""

SDP = {"Content-Type": "application/sdp"}

# What an offer that named no usable candidate is told when its session never connects.
NO_CANDIDATE_HINT = (
    f"not connected within {PENDING_TIMEOUT:g}s; its offer named no ICE candidate this server "
    "could use, so only the peer's own checks could connect it (candidates sent later by PATCH "
    "are not taken: send the offer once ICE gathering is complete)"
)


@pytest.fixture
def loopback_ice(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    # ICE gathers candidates on every interface except loopback; keep aiortc peers on 127.0.0.1.
    # Not for the Chromium test: the browser does not offer loopback, the server must not only.
    monkeypatch.setattr(aioice.ice, "get_host_addresses", lambda use_ipv4, use_ipv6: ["127.0.0.1"])
    yield


async def start(tmp_path: Path, nats: EmbeddedNats) -> Stack:
    return await Stack.start(tmp_path, CONFIG.format(nats=nats.url), nats.url)


def whip(stack: Stack) -> WhipSource:
    source = stack.runtime.sources["cam"].source
    assert isinstance(source, WhipSource)
    return source


def without_candidates(sdp: str, keep_end: bool = False) -> str:
    """``sdp`` with its ``a=candidate`` lines (and ``a=end-of-candidates`` unless ``keep_end``)
    removed: the offer of a client that sends it before gathering and trickles the rest."""
    drop = ("a=candidate:",) if keep_end else ("a=candidate:", "a=end-of-candidates")
    return "\r\n".join(line for line in sdp.splitlines() if not line.startswith(drop)) + "\r\n"


def mdns_only(sdp: str) -> str:
    """``sdp`` with every candidate address an mDNS name, as a browser hides its host addresses,
    and its ``a=end-of-candidates`` kept, as a browser that waited for gathering may send it."""
    name = "0f3c9d1e-5b7a-4c2e-9d6f-1a2b3c4d5e6f.local"
    return re.sub(r"^(a=candidate:\S+ \d+ \S+ \d+ )\S+ ", rf"\g<1>{name} ", sdp, flags=re.MULTILINE)


class Turning(VideoStreamTrack):
    """30 fps: ``first`` frames of 320x240, ``turned`` of 240x320 (a phone on its side), then
    320x240 again. The sender's own clock paces the frames, so ``turned`` frames last
    ``turned / 30`` seconds."""

    def __init__(self, first: int, turned: int) -> None:
        super().__init__()
        self.first, self.turned, self.sent = first, turned, 0
        self.landscape = np.full((240, 320, 3), (200, 40, 40), np.uint8)
        self.portrait = np.full((320, 240, 3), (40, 40, 200), np.uint8)

    async def recv(self) -> VideoFrame:
        pts, time_base = await self.next_timestamp()
        turned = self.first <= self.sent < self.first + self.turned
        self.sent += 1
        frame = VideoFrame.from_ndarray(self.portrait if turned else self.landscape, format="rgb24")
        frame.pts = pts
        frame.time_base = Fraction(time_base)
        return frame


def size_runs(messages: list[dict[str, object]]) -> list[tuple[object, object]]:
    """The (width, height) of the messages in order, each run of equal sizes once."""
    runs: list[tuple[object, object]] = []
    for m in messages:
        size = (m["width"], m["height"])
        if not runs or runs[-1] != size:
            runs.append(size)
    return runs


# -- a publisher that changes its video size --------------------------------------------------


@pytest.mark.usefixtures("loopback_ice")
async def test_a_publisher_that_turns_its_video_is_logged_once_per_change(
    tmp_path: Path, nats_server: EmbeddedNats, collector: Collector, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="vidpipe.whip")
    await collector.start(nats_server.url, "vidpipe.edges.cam.detections")
    stack = await start(tmp_path, nats_server)
    # 3 s turned: longer than the one-line-a-second limit, so both changes are logged.
    publisher = Publisher(stack.http, Turning(first=15, turned=90))
    try:
        assert (await publisher.publish())[0] == 201
        session = whip(stack).session
        assert session is not None
        turned_back = [(320, 240), (240, 320), (320, 240)]
        await until(
            lambda: size_runs(collector.by_source("cam"))[:3] == turned_back,
            timeout=30,
            what="messages of 320x240, then 240x320, then 320x240 again",
        )
        # Some more frames of the last size: a steady size logs nothing more.
        seen = len(collector.by_source("cam"))
        await until(lambda: len(collector.by_source("cam")) >= seen + 10, what="10 more messages")
        assert size_runs(collector.by_source("cam")) == turned_back
        changes = [r.getMessage() for r in caplog.records if "changed its video" in r.getMessage()]
        tail = "messages carry the new width and height from here on"
        assert changes == [
            f"source cam: the publisher changed its video from 320x240 to 240x320 (session {session.id}); {tail}",
            f"source cam: the publisher changed its video from 240x320 to 320x240 (session {session.id}); {tail}",
        ]
        # The frame pool followed the size (rows, columns, channels).
        pool = whip(stack).frame_pool
        assert pool is not None and pool.shape == (240, 320, 3)
        assert whip(stack).state is SourceState.UP
        assert await publisher.leave() == 200
    finally:
        await publisher.pc.close()
        await stack.close()


TRACKED = """\
pipeline: edges
models: {models}
sources:
  - url: whip://cam
    open_timeout: 60
nats: {{url: "{nats}"}}
http: {{listen: "127.0.0.1:0"}}
stages:
  - {{name: objects, type: infer, model: squares}}
  - {{name: track, type: track}}
  - {{name: gate, type: zones, lines: [{{name: top, points: [[0, 1], [4, 1]]}}]}}
"""


class TurningSquare(Turning):
    """:class:`Turning`, with a white square in the middle of every frame: one object to track."""

    def __init__(self, first: int, turned: int) -> None:
        super().__init__(first, turned)
        for image in (self.landscape, self.portrait):
            h, w = image.shape[:2]
            image[h // 2 - 30 : h // 2 + 30, w // 2 - 30 : w // 2 + 30] = 255


@pytest.mark.usefixtures("loopback_ice")
async def test_a_publisher_that_turns_its_video_starts_new_tracks(
    tmp_path: Path, nats_server: EmbeddedNats, collector: Collector, sample_models: Path
) -> None:
    await collector.start(nats_server.url, "vidpipe.edges.cam.events")
    text = TRACKED.format(models=sample_models, nats=nats_server.url)
    stack = await Stack.start(tmp_path, text, nats_server.url)
    publisher = Publisher(stack.http, TurningSquare(first=30, turned=30))
    try:
        assert (await publisher.publish())[0] == 201
        # Three pictures (landscape, portrait, landscape): one track each, the first two ended
        # at the change of size, not when the square was no longer matched frames later.
        await until(
            lambda: [e["type"] for e in collector.messages].count("track_start") >= 3,
            timeout=30,
            what="three track starts",
        )
        events = [(e["type"], e["track_id"]) for e in collector.messages]
        assert events[:5] == [
            ("track_start", 1), ("track_end", 1), ("track_start", 2), ("track_end", 2), ("track_start", 3),
        ]  # fmt: skip
        # Each track ended with its own picture's square: the middle of 320x240, then of 240x320.
        ends = [e["bbox"] for e in collector.messages if e["type"] == "track_end"]
        assert ends[:2] == [
            pytest.approx([130, 90, 190, 150], abs=3),
            pytest.approx([90, 130, 150, 190], abs=3),
        ]
        assert await publisher.leave() == 200
    finally:
        await publisher.pc.close()
        await stack.close()


# -- PATCH (trickle ICE, ICE restart) ---------------------------------------------------------


@pytest.mark.usefixtures("loopback_ice")
async def test_patch_on_a_session_is_405_saying_trickle_ice_is_not_taken(
    tmp_path: Path, nats_server: EmbeddedNats
) -> None:
    stack = await start(tmp_path, nats_server)
    publisher = Publisher(stack.http, SolidColour((0, 200, 0)))
    viewer = RTCPeerConnection(RTCConfiguration(iceServers=[]))
    try:
        assert (await publisher.publish())[0] == 201
        await until(lambda: whip(stack).state is SourceState.UP, what="publisher up")
        viewer.addTransceiver("video", direction="recvonly")
        await viewer.setLocalDescription(await viewer.createOffer())
        async with stack.http.post("/whep/pattern", data=viewer.localDescription.sdp, headers=SDP) as resp:
            assert resp.status == 201
            whep_location = resp.headers["Location"]
        assert publisher.location is not None
        trickle = {"Content-Type": "application/trickle-ice-sdpfrag", "If-Match": "*"}
        candidate = "a=candidate:1 1 udp 2130706431 127.0.0.1 40000 typ host\r\na=end-of-candidates\r\n"
        # The same answer for a live session, one that does not exist, WHIP and WHEP alike.
        for url in (publisher.location, "/whip/cam/no-such-session", whep_location, "/whep/pattern/nope"):
            async with stack.http.patch(url, data=candidate, headers=trickle) as resp:
                assert (resp.status, resp.headers.get("Allow"), await resp.json()) == (
                    405,
                    "DELETE",
                    {"error": NO_PATCH},
                ), url
        assert NO_PATCH == (
            "PATCH is not supported: this server takes no trickle ICE or ICE restart; put the ICE "
            "candidates in the offer (send it once ICE gathering is complete), and DELETE this URL "
            "to end the session"
        )
        # Other methods stay a plain 405; the sessions are untouched.
        async with stack.http.get(publisher.location) as resp:
            assert (resp.status, resp.headers.get("Allow"), await resp.json()) == (
                405,
                "DELETE",
                {"error": "Method Not Allowed"},
            )
        assert whip(stack).state is SourceState.UP
        assert len(stack.api.whep.sessions) == 1
        async with stack.http.delete(whep_location) as resp:
            assert resp.status == 200
        assert await publisher.leave() == 200
    finally:
        await viewer.close()
        await publisher.pc.close()
        await stack.close()


# -- offers with no usable ICE candidate -----------------------------------------------------


@pytest.mark.usefixtures("loopback_ice")
@pytest.mark.parametrize(
    "rewrite",
    [
        pytest.param(mdns_only, id="mdns-names-and-end-of-candidates"),
        pytest.param(without_candidates, id="no-candidates-trickle-style"),
    ],
)
async def test_an_offer_with_no_usable_candidate_connects_from_the_publishers_checks(
    tmp_path: Path, nats_server: EmbeddedNats, rewrite: object
) -> None:
    assert callable(rewrite)
    stack = await start(tmp_path, nats_server)
    publisher = Publisher(stack.http, SolidColour((0, 200, 0)))
    try:
        await publisher.pc.setLocalDescription(await publisher.pc.createOffer())
        offer = rewrite(publisher.pc.localDescription.sdp)
        async with stack.http.post("/whip/cam", data=offer, headers=SDP) as resp:
            assert resp.status == 201, await resp.text()
            publisher.location = resp.headers["Location"]
            answer = await resp.text()
        await publisher.pc.setRemoteDescription(RTCSessionDescription(sdp=answer, type="answer"))
        # Well within the pending-session expiry: the server learns the publisher's address
        # from the checks it sends (aiortc gave up at once on "no candidates, no more to come").
        await until(
            lambda: whip(stack).state is SourceState.UP,
            timeout=PENDING_TIMEOUT - 2,
            what=f"the publisher up (state {whip(stack).state.value}: {whip(stack).reason})",
        )
        assert publisher.pc.connectionState == "connected"
        assert await publisher.leave() == 200
    finally:
        await publisher.pc.close()
        await stack.close()


@pytest.mark.usefixtures("loopback_ice")
async def test_a_session_whose_offer_named_no_candidate_ends_saying_why(
    tmp_path: Path, nats_server: EmbeddedNats, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="vidpipe.whep")
    stack = await start(tmp_path, nats_server)
    peers = [RTCPeerConnection(RTCConfiguration(iceServers=[])) for _ in range(2)]
    try:
        # Offers sent before gathering, by peers that never take their answers.
        peers[0].addTrack(SolidColour((0, 0, 0)))
        peers[1].addTransceiver("video", direction="recvonly")
        offers = []
        for pc in peers:
            await pc.setLocalDescription(await pc.createOffer())
            offers.append(without_candidates(pc.localDescription.sdp))
        status, _ = await stack.json("POST", "/whip/cam", data=offers[0], headers=SDP)
        assert status == 201
        status, _ = await stack.json("POST", "/whep/pattern", data=offers[1], headers=SDP)
        assert status == 201
        (whep_session,) = stack.api.whep.sessions
        await until(
            lambda: whip(stack).session is None and not stack.api.whep.sessions,
            timeout=PENDING_TIMEOUT + 5,
            what="both pending sessions to expire",
        )
        assert (whip(stack).state, whip(stack).reason) == (
            SourceState.BACKOFF,
            f"publisher lost: {NO_CANDIDATE_HINT}",
        )
        ended = [r.getMessage() for r in caplog.records if r.getMessage().startswith("source pattern: WHEP")]
        assert f"source pattern: WHEP session {whep_session} ended: {NO_CANDIDATE_HINT}" in ended
    finally:
        for pc in peers:
            await pc.close()
        await stack.close()


# -- the dashboard's live view, refused --------------------------------------------------------

DASH_CONFIG = """\
pipeline: dashedges
sources:
  - {{id: lobby, url: "test://?width=320&height=180&fps=15"}}
nats: {{url: "{nats}"}}
http: {{listen: "127.0.0.1:0", max_pending_webrtc_per_client: 1}}
"""

# What the page shows: the status line, lobby's live button, whether its video is shown,
# and all the page's visible text (an error shown anywhere is in it).
READ_PAGE = """(() => ({
  status: document.getElementById('status').textContent,
  statusError: document.getElementById('status').classList.contains('error'),
  label: document.querySelector('button.live[data-live="lobby"]').textContent,
  videoHidden: document.getElementById('live-lobby').hidden,
  videoWidth: document.getElementById('live-lobby').videoWidth,
  text: document.body.innerText,
}))()"""

CLICK_LIVE = "document.querySelector('button.live[data-live=\"lobby\"]').click()"


@pytest.mark.skipif(not CHROMIUM.exists(), reason="needs /usr/bin/chromium (make test installs it with apt)")
async def test_dashboard_live_view_refusal_stays_shown_until_the_user_acts(
    tmp_path: Path, nats_server: EmbeddedNats, chromium: DevTools
) -> None:
    stack = await Stack.start(tmp_path, DASH_CONFIG.format(nats=nats_server.url), nats_server.url)
    holder = RTCPeerConnection(RTCConfiguration(iceServers=[]))
    try:
        await open_dashboard(chromium, stack.api.url + "/")
        await chromium.poll(
            "document.querySelector('button.live[data-live=\"lobby\"]')", lambda v: v is not None
        )
        # Another viewer on this address that has not connected takes the one pending place.
        holder.addTransceiver("video", direction="recvonly")
        await holder.setLocalDescription(await holder.createOffer())
        async with stack.http.post("/whep/lobby", data=holder.localDescription.sdp, headers=SDP) as resp:
            assert resp.status == 201, await resp.text()
            held = resp.headers["Location"]

        await chromium.evaluate(CLICK_LIVE)
        refused = (
            "live view refused: 1 WebRTC session(s) from this address have not connected yet "
            f"(http.max_pending_webrtc_per_client=1); each expires after {PENDING_TIMEOUT:g}s (HTTP 429)"
        )
        page = await chromium.poll(READ_PAGE, lambda v: refused in v["text"], timeout=10)
        # Two polls later (the status line shows each), the reason is still there.
        for _ in range(2):
            before = page["status"]
            page = await chromium.poll(READ_PAGE, lambda v, before=before: v["status"] != before)
        assert refused in page["text"], page["text"]
        assert (page["label"], page["videoHidden"], page["statusError"]) == ("Watch live", True, False)
        assert stack.api.whep.sessions.keys() == {held.rsplit("/", 1)[1]}

        # The place is given back; the user clicks again: the error goes, the video plays.
        async with stack.http.delete(held) as resp:
            assert resp.status == 200
        await chromium.evaluate(CLICK_LIVE)
        page = await chromium.poll(READ_PAGE, lambda v: v["videoWidth"] > 0, timeout=30)
        assert refused not in page["text"]
        assert (page["label"], page["videoHidden"]) == ("Stop live", False)
        await chromium.evaluate(CLICK_LIVE)
        await until(lambda: stack.api.whep.sessions == {}, what="the live session ended", timeout=10)
    finally:
        await holder.close()
        await stack.close()
