"""The embedding API: results in Python from a real pipeline, with and without NATS."""

from __future__ import annotations

import ast
import asyncio
import builtins
import json
import logging
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from inference.schema import ConfigError
from pipeline import Pipeline
from pipeline.nats_server import EmbeddedNats, free_port
from pipeline.sources.pattern import pattern_square_box
from pipeline.stages.publish import PublishError
from tests.conftest import ROOT, Collector


def squares(models: Path) -> dict[str, Any]:
    return {
        "pipeline": "embedded",
        "models": str(models),
        "stages": [{"name": "objects", "type": "infer", "model": "squares"}],
    }


def child_nats_servers() -> list[int]:
    """nats-server processes started by this test process."""
    found = []
    for status in Path("/proc").glob("[0-9]*/status"):
        try:
            fields = dict(line.split(":\t", 1) for line in status.read_text().splitlines() if ":\t" in line)
        except OSError:
            continue
        if fields.get("Name", "").strip() == "nats-server" and int(fields["PPid"]) == os.getpid():
            found.append(int(status.parent.name))
    return found


def boxes_of(messages: list[dict[str, Any]]) -> list[tuple[int, str, list[float]]]:
    return [(m["frame"], o["label"], o["bbox"]) for m in messages for o in m["objects"]]


def truth(frames: int, width: int = 320, height: int = 240) -> list[tuple[int, str, list[float]]]:
    return [(i, "square", [float(v) for v in pattern_square_box(i, width, height)]) for i in range(frames)]


async def test_results_without_nats_come_only_to_the_caller(sample_models: Path) -> None:
    async with Pipeline.from_dict(squares(sample_models)) as pipe:
        assert pipe.runtime.publisher.mode == "local" and pipe.runtime.publisher.nc is None
        assert child_nats_servers() == []
        sid = pipe.add_source("test://?width=320&height=240&fps=50&frames=12", queue_size=64)
        assert sid == "test"
        messages = [m async for m in pipe.results()]
    assert pipe.finished
    assert [m["frame"] for m in messages] == list(range(12))
    assert {m["source"] for m in messages} == {"test"}
    assert {m["schema"] for m in messages} == {"vidpipe.detections/v1"}
    assert boxes_of(messages) == truth(12)
    assert pipe.report().published == 12


async def test_with_nats_the_caller_and_subscribers_get_the_same_messages(
    squares_config: Path, nats_server: EmbeddedNats, collector: Collector
) -> None:
    await collector.start(nats_server.url, "vidpipe.demo.>")
    seen: list[dict[str, Any]] = []
    pipe = Pipeline.from_file(
        squares_config, sources=["test://?width=320&height=240&fps=50&frames=10"], nats_url=nats_server.url
    )
    pipe.on_result(seen.append)
    stream = None
    async with pipe:
        stream = pipe.results()
        await pipe.wait()
    iterated = [m async for m in stream]
    await collector.wait_for(10)
    assert collector.messages == seen == iterated
    assert boxes_of(seen) == truth(10)


async def test_async_callbacks_are_awaited_in_frame_order_and_a_failing_one_does_not_stop_the_run(
    sample_models: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger="vidpipe.embed")
    order: list[int] = []
    pipe = Pipeline.from_dict(squares(sample_models))

    @pipe.on_result
    async def slow(message: dict[str, Any]) -> None:
        await asyncio.sleep(0.01 if message["frame"] % 2 == 0 else 0)
        order.append(message["frame"])

    @pipe.on_result
    def broken(message: dict[str, Any]) -> None:
        raise RuntimeError("consumer bug")

    async with pipe:
        pipe.add_source("test://?width=320&height=240&fps=100&frames=8", queue_size=64)
        await pipe.wait()
    assert order == list(range(8))
    line = broken.__code__.co_firstlineno + 2  # its raise
    errors = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    assert errors == [
        "result callback 'broken' failed on frame 0 of test: RuntimeError: consumer bug "
        f"(at {__file__}:{line} in broken)"
    ]


async def test_a_reader_that_breaks_out_never_holds_the_pipeline(sample_models: Path) -> None:
    async with Pipeline.from_dict(squares(sample_models), keep_running=True) as pipe:
        pipe.add_source("test://?width=320&height=240&fps=100", id="endless")
        async for message in pipe.results(max_queue=1):
            if message["frame"] >= 2:
                break
        # The abandoned reader's queue is full; the pipeline must go on publishing.
        before = pipe.report().published
        deadline = time.monotonic() + 10
        while pipe.report().published < before + 20:
            assert time.monotonic() < deadline, "publishing stalled behind an abandoned reader"
            await asyncio.sleep(0.05)
        started = time.monotonic()
    assert time.monotonic() - started < 5  # stop() drained without waiting for anybody


async def test_stop_inside_the_loop_finishes_and_the_iterator_ends(sample_models: Path) -> None:
    pipe = await Pipeline.from_dict(squares(sample_models), keep_running=True).start()
    pipe.add_source("test://?width=320&height=240&fps=100", id="endless")
    frames = []
    stream = pipe.results(max_queue=2)
    async for message in stream:
        frames.append(message["frame"])
        if len(frames) == 3:
            await asyncio.wait_for(pipe.stop(), 10)
    # Frames still in flight at the stop were delivered in order, then the iterator ended.
    # This reader waits inside stop(), so its queue of two fills: older messages make room
    # for newer ones, each counted (how many depends on how busy the machine is).
    assert frames[:3] == [0, 1, 2] and frames == sorted(set(frames))
    published = next(s.published for s in pipe.report().sources if s.id == "endless")
    assert len(frames) + stream.dropped == published
    with pytest.raises(RuntimeError, match="started pipeline that has not finished"):
        pipe.add_source("test://")


def test_a_bad_dict_is_a_config_error_naming_the_key(sample_models: Path) -> None:
    data = squares(sample_models) | {"stages": [{"name": "objects", "type": "infer", "modle": "squares"}]}
    with pytest.raises(ConfigError) as err:
        Pipeline.from_dict(data)
    assert str(err.value) == "<config>:1: stages[0].modle: unknown key (hint: did you mean 'model'?)"


def test_what_validate_refuses_is_a_config_error_before_start(sample_models: Path, tmp_path: Path) -> None:
    data = squares(sample_models) | {"stages": [{"name": "objects", "type": "infer", "model": "sqares"}]}
    with pytest.raises(ConfigError) as err:
        Pipeline.from_dict(data)
    assert str(err.value) == (
        "<config>: stages[0].model: model 'sqares' is not in the repository "
        f"{sample_models} (hint: did you mean 'squares'?)"
    )
    data = squares(tmp_path / "nowhere")
    with pytest.raises(ConfigError) as err:
        Pipeline.from_dict(data)
    assert str(err.value) == (
        f"<config>: models: repository folder {tmp_path / 'nowhere'} not found "
        "(hint: relative paths start at the folder of this file)"
    )


async def test_nats_servers_in_the_config_are_used_and_a_failed_connect_says_what_to_check(
    sample_models: Path, nats_server: EmbeddedNats, collector: Collector
) -> None:
    await collector.start(nats_server.url, "vidpipe.embedded.>")
    data = squares(sample_models) | {"nats": {"servers": [nats_server.url]}}
    async with Pipeline.from_dict(data, max_frames=5) as pipe:
        pipe.add_source("test://?width=160&height=120&fps=50")
        await pipe.wait()
    await collector.wait_for(5)
    assert [m["frame"] for m in collector.messages] == list(range(5))

    closed = f"nats://127.0.0.1:{free_port()}"
    pipe = Pipeline.from_dict(squares(sample_models), nats_url=closed)
    with pytest.raises(PublishError) as err:
        await pipe.start()
    assert str(err.value).endswith("; check nats_url= or nats.url / nats.servers in the config")


async def test_waiting_for_a_pipeline_never_started_is_an_error_and_a_fleet_section_is_named(
    sample_models: Path, caplog: pytest.LogCaptureFixture
) -> None:
    pipe = Pipeline.from_dict(squares(sample_models) | {"fleet": {"name": "cams"}})
    assert [r.getMessage() for r in caplog.records if r.levelname == "WARNING"] == [
        "pipeline embedded: its fleet: section is for vidpipe run --fleet; an embedded pipeline runs "
        "the sources it is given (the config's, and add_source) itself"
    ]
    with pytest.raises(RuntimeError, match=r"wait\(\) needs a started pipeline"):
        await pipe.wait()


def test_the_documented_example_runs_as_written() -> None:
    text = (ROOT / "docs" / "embedding.md").read_text()
    example = re.findall(r"```python\n(.*?)```", text, re.S)[0]
    proc = subprocess.run(
        [sys.executable, "-c", example], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    lines = [line.split(" ", 3) for line in proc.stdout.splitlines()]
    assert [(int(f), label, json.loads(box)) for source, f, label, box in lines if source == "door"] == truth(
        10
    )
    assert len(lines) == 10


async def test_the_whole_traceback_of_a_failing_callback_is_logged_at_debug(
    sample_models: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger="vidpipe.embed")
    pipe = Pipeline.from_dict(squares(sample_models))

    @pipe.on_result
    def broken(message: dict[str, Any]) -> None:
        raise RuntimeError("consumer bug")

    async with pipe:
        pipe.add_source("test://?width=160&height=120&fps=100&frames=3", queue_size=64)
        await pipe.wait()
    [debug] = [
        r.getMessage() for r in caplog.records if r.levelname == "DEBUG" and "consumer bug" in r.getMessage()
    ]
    assert debug.splitlines()[:2] == [
        "result callback 'broken' failed on frame 0 of test: RuntimeError: consumer bug",
        "Traceback (most recent call last):",
    ]
    assert debug.splitlines()[-2:] == ['    raise RuntimeError("consumer bug")', "RuntimeError: consumer bug"]


async def test_a_callback_whose_await_is_cancelled_is_logged_and_the_source_goes_on(
    sample_models: Path, caplog: pytest.LogCaptureFixture
) -> None:
    pipe = Pipeline.from_dict(squares(sample_models))

    @pipe.on_result
    async def store(message: dict[str, Any]) -> None:
        if message["frame"] == 2:
            cancelled = asyncio.get_running_loop().create_future()
            cancelled.cancel()
            await cancelled  # a client call cancelled under the callback

    async with pipe:
        stream = pipe.results()
        pipe.add_source("test://?width=160&height=120&fps=100&frames=6", queue_size=64)
        # Bounded so that a regression fails rather than hangs.
        frames = await asyncio.wait_for(_frames(stream), 30)
    assert frames == list(range(6))
    line = store.__code__.co_firstlineno + 5  # its await
    assert [r.getMessage() for r in caplog.records if r.levelname == "ERROR"] == [
        f"result callback 'store' failed on frame 2 of test: CancelledError (at {__file__}:{line} in store)"
    ]


async def _frames(stream: Any) -> list[int]:
    return [m["frame"] async for m in stream]


async def test_a_missing_file_source_is_refused_when_added(sample_models: Path, tmp_path: Path) -> None:
    (tmp_path / "clips").mkdir()
    async with Pipeline.from_dict(squares(sample_models), base_dir=tmp_path, keep_running=True) as pipe:
        with pytest.raises(ConfigError) as err:
            pipe.add_source("/nonexistent.mp4")
        assert str(err.value) == (
            "add_source: sources.url: file not found: /nonexistent.mp4 "
            "(hint: relative paths start at the config's folder, base_dir for a dict)"
        )
        with pytest.raises(ConfigError) as err:
            pipe.add_source("clips", id="folder")
        assert str(err.value) == (
            f"add_source: sources.url: {tmp_path / 'clips'} is a folder, not a video file (hint: name a file in it)"
        )
        assert pipe.report().sources == []
        # A camera is not tried: it is retried in the background, as in a config file.
        assert pipe.add_source("rtsp://127.0.0.1:9/stream", id="cam") == "cam"


def test_a_missing_file_given_to_from_file_is_refused_and_one_url_is_one_source(
    squares_config: Path, demo_clip: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(demo_clip.parent)
    with pytest.raises(ConfigError) as err:
        Pipeline.from_file(squares_config, sources=["nope.mp4", demo_clip.name])
    assert str(err.value) == (
        f"from_file: sources[0]: file not found: {demo_clip.parent / 'nope.mp4'} "
        "(hint: relative paths start at the working folder)"
    )
    pipe = Pipeline.from_file(squares_config, sources=demo_clip.name)
    assert [s.url for s in pipe.config.sources] == [str(demo_clip)]


@pytest.mark.parametrize("value", [0, -1, "5", 2.5, True])
def test_max_frames_must_be_a_whole_number_of_at_least_one(sample_models: Path, value: Any) -> None:
    with pytest.raises(ValueError) as err:
        Pipeline.from_dict(squares(sample_models), max_frames=value)
    assert str(err.value) == f"max_frames must be a whole number of at least 1 (or None), got {value!r}"


def test_a_nats_url_that_is_not_one_is_refused_when_the_pipeline_is_made(sample_models: Path) -> None:
    with pytest.raises(ConfigError) as err:
        Pipeline.from_dict(squares(sample_models), nats_url="nats://127.0.0.1:4222,http://127.0.0.1:4222")
    assert str(err.value) == (
        "nats_url: 'http://127.0.0.1:4222' is not a NATS server URL "
        "(hint: use nats://, tls://, ws://, wss://, e.g. nats://127.0.0.1:4222)"
    )


async def test_an_http_section_is_named_and_metrics_and_readiness_are_the_programs_to_serve(
    sample_models: Path, caplog: pytest.LogCaptureFixture
) -> None:
    pipe = Pipeline.from_dict(
        squares(sample_models) | {"http": {"listen": "127.0.0.1:8080"}}, keep_running=True
    )
    assert [r.getMessage() for r in caplog.records if r.levelname == "WARNING"] == [
        "pipeline embedded: its http: section is for vidpipe run; an embedded pipeline starts no HTTP "
        "server: the program serves its own (metrics_text() and readiness() give /metrics and /readyz)"
    ]
    assert pipe.readiness() == ["models are not loaded yet", "NATS is not connected"]
    async with pipe:
        stream = pipe.results()
        pipe.add_source("test://?width=160&height=120&fps=50", id="cam", queue_size=64)
        async for message in stream:
            if message["frame"] >= 2:
                break
        assert pipe.readiness() == []
        metrics = pipe.metrics_text().decode()
    published = [
        line for line in metrics.splitlines() if line.startswith("vidpipe_published_messages_total{")
    ]
    assert len(published) == 1 and 'source="cam"' in published[0] and float(published[0].split()[-1]) >= 3


async def test_a_stopped_pipeline_removes_nothing_and_cannot_be_started_again(sample_models: Path) -> None:
    pipe = await Pipeline.from_dict(squares(sample_models), keep_running=True).start()
    pipe.add_source("test://?width=160&height=120&fps=50", id="cam")
    await pipe.stop()
    assert await pipe.remove_source("cam") is False
    with pytest.raises(RuntimeError) as err:
        await pipe.start()
    assert str(err.value) == "a stopped pipeline cannot be started again: make a new Pipeline"


async def test_wait_returns_once_the_stop_has_finished(sample_models: Path) -> None:
    pipe = await Pipeline.from_dict(squares(sample_models)).start()
    pipe.add_source("test://?width=160&height=120&fps=100&frames=3", queue_size=64)
    await pipe.wait()
    assert pipe.finished
    # Nothing of the pipeline is left on the loop: a program may stop it now.
    assert [t.get_name() for t in asyncio.all_tasks() if t is not asyncio.current_task()] == []


def test_a_synchronous_program_drives_the_pipeline_from_a_loop_in_a_thread(sample_models: Path) -> None:
    # The pattern docs/embedding.md gives for a program without asyncio.
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()

    def call(coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, loop).result(60)

    pipe = Pipeline.from_dict(squares(sample_models), keep_running=True)
    seen: list[int] = []
    third = threading.Event()

    def record(message: dict[str, Any]) -> None:
        seen.append(message["frame"])
        if len(seen) == 3:
            third.set()

    pipe.on_result(record)

    async def add(url: str, id: str) -> str:
        return pipe.add_source(url, id=id, queue_size=64)

    call(pipe.start())
    assert call(add("test://?width=160&height=120&fps=50&frames=3", "cam")) == "cam"
    assert third.wait(60)
    call(pipe.stop())
    assert pipe.finished and seen == [0, 1, 2]
    loop.call_soon_threadsafe(loop.stop)
    thread.join(10)
    loop.close()
    assert not thread.is_alive()


def test_every_example_in_the_embedding_doc_is_a_program_as_written() -> None:
    # No top-level await (a SyntaxError outside a coroutine) and no name the reader must guess.
    text = (ROOT / "docs" / "embedding.md").read_text()
    examples = re.findall(r"```python\n(.*?)```", text, re.S)
    assert len(examples) == 3
    for example in examples:
        tree = ast.parse(example)
        assigned = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
        defined = {n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)}
        imported = {
            a.asname or a.name
            for n in ast.walk(tree)
            if isinstance(n, ast.ImportFrom | ast.Import)
            for a in n.names
        }
        params = {n.arg for n in ast.walk(tree) if isinstance(n, ast.arg)}
        used = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}
        assert used - assigned - defined - imported - params - set(dir(builtins)) == set(), example
