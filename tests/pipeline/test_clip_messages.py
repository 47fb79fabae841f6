"""Clips messages go the way events go: queued while NATS is away, acknowledged in JetStream
mode with their own ``Nats-Msg-Id``, and counted when lost; they match their schema."""

from __future__ import annotations

import asyncio
import json
import re
import threading
from pathlib import Path
from typing import Any, Literal

import jsonschema
import nats
import pytest

from pipeline.config import NatsConfig, load_config
from pipeline.frames import Frame
from pipeline.metrics import Metrics
from pipeline.nats_server import EmbeddedNats
from pipeline.outputs.manager import clips_schema
from pipeline.runtime import Runtime
from pipeline.stages.publish import Publisher
from tests.conftest import ROOT
from tests.pipeline.stack import until
from tests.pipeline.test_outputs import FPS, write_pattern_clip

# The square appears in frame 15 (1.0 s): its track starts there and opens the clip.
EVENT_FRAME = 15
CLIPS = """\
pipeline: {name}
models: {models}
nats: {{publish: {mode}}}
sources: [{{url: {clip}, id: cam}}]
stages: [{{name: objects, type: infer, model: squares}}, {{name: track, type: track}}]
outputs: [{{type: clips, dir: clips, pre_s: 0.5, post_s: 1.0, on: [track_start]}}]
runtime: {{drain_timeout: 30}}
"""


def clips_runtime(tmp_path: Path, models: Path, mode: str, nats_server: EmbeddedNats) -> Runtime:
    """A file whose one track starts at ``EVENT_FRAME``; the broker is killed once that frame is
    published (its clip is open then, and written later)."""
    clip = write_pattern_clip(tmp_path / "in.mp4", frames=4 * FPS, gop=FPS, square_from=EVENT_FRAME)
    config = tmp_path / "p.yaml"
    config.write_text(CLIPS.format(name=f"clip{mode}", models=models, mode=mode, clip=clip))

    def published(frame: Frame) -> None:
        if frame.index == EVENT_FRAME:
            nats_server.stop(kill=True)

    return Runtime(load_config(config), nats_url=nats_server.url, on_published=published)


def hold_clips(runtime: Runtime) -> threading.Event:
    """Hold the clip writer (one thread) until the returned event is set: no clip is written,
    so none is announced, before the test says so."""
    gate = threading.Event()
    runtime.outputs._clip_writer.submit(gate.wait)
    return gate


async def clip_written_while_nats_is_down(runtime: Runtime, gate: threading.Event) -> None:
    """Once the publisher has seen the broker go, let the clip be written and announced."""
    await until(lambda: not runtime.publisher.connected.is_set(), 30, "the publisher to see NATS go")
    assert not runtime.outputs.clips
    gate.set()
    await until(lambda: bool(runtime.outputs.clips), 30, "the clip to be written")


async def test_a_clip_written_while_nats_is_down_is_sent_once_it_is_back_in_core_mode(
    tmp_path: Path, nats_server: EmbeddedNats, sample_models: Path
) -> None:
    runtime = clips_runtime(tmp_path, sample_models, "core", nats_server)
    gate = hold_clips(runtime)
    received: asyncio.Queue[tuple[str, dict[str, Any]]] = asyncio.Queue()

    async def on_msg(msg: Any) -> None:
        received.put_nowait((msg.subject, json.loads(msg.data)))

    try:
        await runtime.start()
        assert runtime.publisher.nc is not None
        # On the publisher's own connection: the client subscribes again on reconnect before
        # the outbox is sent, so it sees every message sent then.
        await runtime.publisher.nc.subscribe("vidpipe.clipcore.cam.clips", cb=on_msg)
        await clip_written_while_nats_is_down(runtime, gate)
        nats_server.start()
        subject, message = await asyncio.wait_for(received.get(), 30)
        await runtime.wait(60)
    finally:
        gate.set()
        await runtime.stop()
    assert received.empty(), "the clip was announced once"
    assert subject == "vidpipe.clipcore.cam.clips"
    jsonschema.validate(message, clips_schema())
    assert message["event"]["frame"] == EVENT_FRAME and message["event"]["type"] == "track_start"
    assert Path(message["path"]) == runtime.outputs.clips[0].path
    assert runtime.publisher.unsent == {} and runtime.publisher.overflowed == {}


async def test_a_clip_is_acknowledged_in_jetstream_mode_with_its_own_msg_id(
    tmp_path: Path, nats_server: EmbeddedNats, sample_models: Path
) -> None:
    runtime = clips_runtime(tmp_path, sample_models, "jetstream", nats_server)
    gate = hold_clips(runtime)
    try:
        await runtime.start()
        stream_id = runtime.sources["cam"].stream_id
        # Retried until the broker is back and acknowledges it.
        await clip_written_while_nats_is_down(runtime, gate)
        nats_server.start()
        await runtime.wait(60)
    finally:
        gate.set()
        await runtime.stop()
    subject = "vidpipe.clipjetstream.cam.clips"
    nc = await nats.connect(nats_server.url)
    try:
        js = nc.jetstream()
        info = await js.stream_info("VIDPIPE", subjects_filter=subject)
        last = await js.get_last_msg("VIDPIPE", subject)
    finally:
        await nc.close()
    assert info.state.subjects == {subject: 1}
    # The run's stream id, as in its detections' and events' ids: a consumer ties the clip to
    # its run, and JetStream drops a retry of it.
    assert last.headers == {"Nats-Msg-Id": f"clipjetstream/cam/{stream_id}/{EVENT_FRAME}/clip-0"}
    assert last.data is not None
    message = json.loads(last.data)
    jsonschema.validate(message, clips_schema())
    assert message["event"]["frame"] == EVENT_FRAME
    assert runtime.publisher.unsent == {}


@pytest.mark.parametrize("mode", ["core", "jetstream"])
async def test_a_clip_nats_never_takes_before_the_stop_is_counted_and_said_as_not_sent(
    mode: Literal["core", "jetstream"], nats_server: EmbeddedNats, caplog: pytest.LogCaptureFixture
) -> None:
    metrics = Metrics()
    publisher = Publisher(NatsConfig(publish=mode), nats_server.url, "p", metrics)
    await publisher.connect()
    nats_server.stop(kill=True)
    await until(lambda: not publisher.connected.is_set(), 30, "the publisher to see NATS go")
    publisher.publish_clip("vidpipe.p.cam.clips", "cam", {"schema": "vidpipe.clips/v1"}, "run1", "15/clip-0")
    with caplog.at_level("WARNING", logger="vidpipe"):
        await publisher.close(timeout=0.5)
    # As any message the stop gave up on: in the done line (and exit 1), the metric and the log.
    assert publisher.unsent == {"cam": 1}
    labels = {"pipeline": "p", "source": "cam", "reason": "shutdown"}
    assert metrics.registry.get_sample_value("vidpipe_publish_errors_total", labels) == 1
    said = [r.getMessage() for r in caplog.records if "not sent" in r.getMessage()]
    assert said == [
        f"1 message(s) not sent: NATS at {nats_server.url} did not take them before the stop (cam 1)"
    ]


def test_the_docs_name_the_clips_schema_and_every_field_of_it() -> None:
    outputs = (ROOT / "docs" / "outputs.md").read_text()
    messages = (ROOT / "docs" / "messages.md").read_text()
    for doc in (outputs, messages):
        assert "vidpipe.clips/v1" in doc and "pipeline/schemas/clips.v1.json" in doc
    schema = clips_schema()
    fields = set(schema["properties"]) | set(schema["properties"]["event"]["properties"])
    named = set(re.findall(r'"(\w+)":', outputs))  # the keys of the documented example
    assert fields - {"zone"} <= named, fields - named
    assert "`zone`" in outputs
