"""An operator's first hour: the CLI catches mistakes at once and behaves in a terminal.

Every test runs the real ``vidpipe`` command in a subprocess, against real
nats-server processes and real model repositories.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import http.server
import io
import json
import os
import pty
import re
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

import pipeline
from pipeline.nats_server import DEFAULT_PORT, EmbeddedNats, free_port, port_is_free
from pipeline.summary import Summary
from samples.make_clip import write_clip
from tests.conftest import ARTIFACTS, ROOT, SQUARES, Collector, run_cli
from tests.pipeline.stack import Stack, until
from tests.pipeline.test_dashboard import CHROMIUM, DevTools, chromium, open_dashboard
from tests.pipeline.test_zones import PIPELINE as ZONES

__all__ = ["chromium"]  # the fixture, used by name


def test_validate_reports_every_error_at_once_with_file_and_line(tmp_path: Path, sample_models: Path) -> None:
    path = tmp_path / "p.yaml"
    path.write_text(
        textwrap.dedent(
            f"""\
            pipeline: shop
            models: {sample_models}
            sources:
              - url: missing.mp4
                transport: udp
            stages:
              - {{name: det, type: infer, model: squres}}
              - {{name: text, type: infer, model: ppocr_det, classes: [txt]}}
              - {{name: t, type: track, on: det}}
              - {{name: read, type: infer, model: ppocr_rec}}
            """
        )
    )
    proc = run_cli("validate", str(path))
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.splitlines() == [
        f"{path}:4: sources[0].url: file not found: {tmp_path / 'missing.mp4'} "
        "(hint: relative paths start at the folder of this file)",
        f"{path}:5: sources[0].transport: does not apply to a file source (hint: a file source takes: "
        "url, id, max_fps, queue_size, max_pixels, loop, realtime, decode)",
        f"{path}:7: stages[0].model: model 'squres' is not in the repository {sample_models} "
        "(hint: did you mean 'squares'?)",
        f"{path}:8: stages[1].classes: 'txt' is not a label of model 'ppocr_det' (hint: did you mean 'text'?)",
        f"{path}:9: stages[2].on: does not apply to a stage of type track "
        "(hint: type track takes: name, type, tracker, classes, match, iou, low_iou, high_score, low_score, new_score, min_hits, max_age)",
        # The wrong key hides none of the stage's other problems.
        f"{path}:9: stages[2].type: the track stage comes before detector 'read', whose objects it cannot "
        "track; stages run in order: move the track stage below the detectors",
        f"{path}:10: stages[3].model: model 'ppocr_rec' is a text_recognize model: it finds no objects, so it "
        "cannot run on whole frames (hint: run it on the objects of a detector stage: on: <that stage's name>)",
    ]


def test_validate_refuses_a_track_before_its_detector_and_stage_options_out_of_range(
    tmp_path: Path, sample_models: Path
) -> None:
    path = tmp_path / "p.yaml"
    path.write_text(
        textwrap.dedent(
            f"""\
            pipeline: shop
            models: {sample_models}
            sources: [{{url: "test://"}}]
            stages:
              - {{name: track, type: track, max_age: 10}}
              - {{name: det, type: infer, model: squares}}
              - {{name: gate, type: zones, hysteresis: -1, track_end_after: 0,
                  lines: [{{name: door, points: [[0, 0], [1, 1]]}}]}}
            """
        )
    )
    proc = run_cli("validate", str(path))
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.splitlines() == [
        f"{path}:5: stages[0].type: the track stage comes before detector 'det', whose objects it cannot "
        "track; stages run in order: move the track stage below the detectors",
        f"{path}:7: stages[2].hysteresis: must be at least 0, got -1.0 (hint: px: dead band along lines "
        "and zone edges)",
        f"{path}:7: stages[2].track_end_after: must be at least 1, got 0 (hint: frames unseen before a track "
        "ends; at least the tracker's)",
    ]
    path.write_text(path.read_text().replace("max_age: 10", "max_age: -3, min_hits: 5000"))
    proc = run_cli("validate", str(path))
    assert proc.returncode == 2, proc.stderr
    # Same line: in the order the keys are checked.
    assert sorted(proc.stderr.splitlines()[:2]) == [
        f"{path}:5: stages[0].max_age: must be at least 1, got -3 (hint: frames a lost track is kept)",
        f"{path}:5: stages[0].min_hits: must be at most 1000, got 5000 (hint: bytetrack: hits before a "
        "track gets an id)",
    ]


def test_validate_refuses_what_run_refuses(tmp_path: Path, sample_models: Path) -> None:
    # No sources, and a repository folder that does not exist.
    path = tmp_path / "p.yaml"
    path.write_text("pipeline: shop\nmodels: nowhere\nstages:\n  - {name: d, type: infer, model: squares}\n")
    proc = run_cli("validate", str(path))
    assert proc.returncode == 2
    assert proc.stderr.splitlines() == [
        f"{path}:1: sources: no sources (hint: add sources: in the file, or pass --source URL)",
        f"{path}:2: models: repository folder {tmp_path / 'nowhere'} not found "
        "(hint: relative paths start at the folder of this file)",
    ]
    # A file meant for `run --source` is checked the same way.
    path.write_text(path.read_text().replace("models: nowhere", f"models: {sample_models}"))
    proc = run_cli("validate", str(path), "--source", "test://?frames=3", "--source", "rstp://cam/x")
    assert proc.returncode == 2
    assert proc.stderr.splitlines() == [
        "--source: unsupported source scheme 'rstp' in 'rstp://cam/x' (hint: did you mean rtsp://?)"
    ]
    proc = run_cli("validate", str(path), "--source", "test://?frames=3")
    assert (proc.returncode, proc.stdout) == (0, f"{path}: ok (pipeline shop: 1 source(s), 1 stage(s))\n")
    # A --source file that is not there: run would fail it; validate said ok.
    proc = run_cli("validate", str(path), "--source", str(tmp_path / "gone.mp4"), "--source", str(tmp_path))
    assert (proc.returncode, proc.stderr.splitlines()) == (2, [
        f"--source: file not found: {tmp_path / 'gone.mp4'} (hint: relative paths start at the working folder)",
        f"--source: {tmp_path} is a folder, not a video file (hint: name a file in it)",
    ])  # fmt: skip


def test_validate_checks_the_model_configs_the_pipeline_uses(tmp_path: Path, sample_models: Path) -> None:
    repo = tmp_path / "models"
    shutil.copytree(sample_models / "squares", repo / "squares")
    model_cfg = repo / "squares" / "config.yaml"
    text = model_cfg.read_text()
    text = text.replace("max_batch_size: 8", "max_batch_size: -1").replace("task:", "tsak:")
    model_cfg.write_text(text)
    path = tmp_path / "p.yaml"
    path.write_text(
        f"pipeline: shop\nmodels: {repo}\nsources: [{{url: 'test://'}}]\n"
        "stages:\n  - {name: d, type: infer, model: squares}\n"
    )
    proc = run_cli("validate", str(path))
    assert proc.returncode == 2
    lines = proc.stderr.splitlines()
    number = {line: i + 1 for i, line in enumerate(text.splitlines())}
    tsak = next(n for line, n in number.items() if line.startswith("tsak:"))
    batch = next(n for line, n in number.items() if line.startswith("max_batch_size:"))
    assert lines == [
        f"{model_cfg}:{batch}: max_batch_size: must be at least 0, got -1",
        f"{model_cfg}:{tsak}: tsak: unknown key (hint: did you mean 'task'?)",
    ]


# -- the embedded NATS server ------------------------------------------------------------


def _start(*args: str, **kwargs: Any) -> subprocess.Popen[str]:
    """``vidpipe`` in its own session, as a terminal runs a foreground job."""
    return subprocess.Popen(
        [sys.executable, "-m", "pipeline.cli", *args],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=kwargs.pop("stderr", subprocess.PIPE),
        text=True,
        start_new_session=True,
        **kwargs,
    )


def _embedded_url(proc: subprocess.Popen[str]) -> str:
    assert proc.stdout is not None
    line = proc.stdout.readline()
    match = re.search(r"embedded NATS server at (nats://127\.0\.0\.1:\d+)", line)
    assert match, line
    return match.group(1)


def _nats_child(pid: int) -> tuple[int, Path]:
    """The nats-server child of ``pid`` and its store folder (from its command line)."""
    children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    for child in children:
        argv = Path(f"/proc/{child}/cmdline").read_bytes().split(b"\0")
        if argv[0].endswith(b"nats-server"):
            return int(child), Path(argv[argv.index(b"-sd") + 1].decode())
    raise AssertionError(f"no nats-server among the children of {pid}: {children}")


def _gone(pid: int, within: float) -> bool:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except FileNotFoundError:
            return True
        if state in ("Z", "X"):  # exited; whoever adopted it has not reaped it yet
            return True
        time.sleep(0.05)
    return False


async def test_ctrl_c_drains_into_the_embedded_server_then_stops_it(squares_config: Path) -> None:
    proc = _start("run", str(squares_config), "--source", "test://?fps=30")
    try:
        url = _embedded_url(proc)
        server_pid, store = _nats_child(proc.pid)
        assert store.is_dir()
        collector = await Collector().start(url)
        await collector.wait_for(10, timeout=60)
        # Ctrl-C in a terminal signals the whole foreground process group.
        os.killpg(proc.pid, signal.SIGINT)
        _, err = await asyncio.to_thread(proc.communicate, timeout=60)
        await collector.close()
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err
    published = int(re.findall(r"done: (\d+) frame\(s\) published", err)[0])
    # The server outlived the signal: every frame the drain published reached a subscriber.
    assert len(collector.messages) == published, err
    assert [m["frame"] for m in collector.messages] == list(range(published))
    assert _gone(server_pid, within=5) and not store.exists()


async def test_a_second_ctrl_c_exits_130_and_still_stops_the_server(
    tmp_path: Path, sample_models: Path
) -> None:
    # Frames wait 30 s in the batcher for a batch of 8 that 2 frames in flight never make:
    # the drain after the first Ctrl-C is slow, so the second one forces the exit.
    repo = tmp_path / "models"
    shutil.copytree(sample_models / "squares", repo / "squares")
    model_cfg = repo / "squares" / "config.yaml"
    text = model_cfg.read_text().replace(
        "max_queue_delay_microseconds: 2000", "max_queue_delay_microseconds: 30000000"
    )
    model_cfg.write_text(text.replace("preferred_batch_size: [4, 8]", "preferred_batch_size: [8]"))
    cfg = tmp_path / "p.yaml"
    cfg.write_text(SQUARES.format(models=repo) + "runtime: {max_in_flight: 2, drain_timeout: 60}\n")
    proc = _start("run", str(cfg), "--source", "test://?fps=30")
    try:
        _embedded_url(proc)
        server_pid, store = _nats_child(proc.pid)
        assert proc.stderr is not None
        while "source test: up" not in (line := proc.stderr.readline()):
            assert line, "vidpipe ended before its source came up"
        os.killpg(proc.pid, signal.SIGINT)
        while "stopping: finishing frames in flight" not in (line := proc.stderr.readline()):
            assert line, "vidpipe ended before it said it was stopping"
        t0 = time.monotonic()
        os.killpg(proc.pid, signal.SIGINT)
        _, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert time.monotonic() - t0 < 10
    assert "forced exit" in err
    assert proc.returncode == 130
    assert _gone(server_pid, within=5) and not store.exists()


def test_a_killed_vidpipe_takes_its_server_along(squares_config: Path) -> None:
    proc = _start("run", str(squares_config), "--source", "test://?fps=10")
    try:
        _embedded_url(proc)
        server_pid, store = _nats_child(proc.pid)
        proc.kill()
        proc.wait(timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert _gone(server_pid, within=5)
    # Nothing ran vidpipe's cleanup; the next embedded server removes the store left behind.
    assert store.exists()
    EmbeddedNats().cleanup()
    assert not store.exists()


def _console_script() -> Path:
    """The ``vidpipe`` script pip wrote into this environment (what a terminal runs)."""
    script = Path(sys.executable).with_name("vidpipe")
    assert "from pipeline.entry import main" in script.read_text(), f"{script} is stale: run make install"
    return script


def _until_loaded(proc: subprocess.Popen[str], library: str) -> None:
    """Until ``proc`` has mapped a shared library whose path holds ``library``: an import reached."""
    maps = Path(f"/proc/{proc.pid}/maps")
    deadline = time.monotonic() + 60
    while library not in maps.read_text():
        assert proc.poll() is None, f"vidpipe ended before it loaded {library}"
        assert time.monotonic() < deadline, f"vidpipe did not load {library} in 60 s"
        time.sleep(0.002)


def _signal_while_loading(args: list[str], loaded: str, sig: signal.Signals) -> tuple[int, str, str]:
    """``vidpipe ARGS`` sent ``sig`` once it has loaded ``loaded``: exit code, stdout, stderr."""
    proc = subprocess.Popen(
        [_console_script(), *args],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        _until_loaded(proc, loaded)
        os.killpg(proc.pid, sig)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    return proc.returncode, out, err


# Three moments of the second the CLI spends importing the runtime, in the order they come:
# a library of NumPy, of OpenCV and of SciPy mapped.
# SIGTERM too: a pod deleted, or `docker stop`, while vidpipe starts (it used to end silently, 143).
@pytest.mark.parametrize(
    ("loaded", "log_format", "sig"),
    [
        ("_multiarray_umath", "plain", signal.SIGINT),
        ("/cv2/", "plain", signal.SIGINT),
        ("/scipy/linalg/", "plain", signal.SIGINT),
        ("/cv2/", "json", signal.SIGINT),
        ("_multiarray_umath", "plain", signal.SIGTERM),
        ("/scipy/linalg/", "plain", signal.SIGTERM),
    ],
)
def test_ctrl_c_while_vidpipe_loads_is_one_line_and_exit_0(
    squares_config: Path, loaded: str, log_format: str, sig: signal.Signals
) -> None:
    args = ["run", str(squares_config), "--source", "test://", "--log-format", log_format]
    code, out, err = _signal_while_loading(args, loaded, sig)
    assert code == 0, err
    assert out == ""
    if log_format == "json":
        (line,) = err.splitlines()
        record = json.loads(line)
        assert {k: record[k] for k in ("level", "logger", "msg")} == {
            "level": "info",
            "logger": "vidpipe",
            "msg": "vidpipe: stopped while starting; nothing was processed",
        }
    else:
        assert err == "vidpipe: stopped while starting; nothing was processed\n"


@pytest.mark.parametrize(
    ("command", "said"),
    [
        (("tune", "{models}", "squares"), "tune"),
        (("models", "add", "{models}/squares/model.onnx"), "models add"),
    ],
    ids=["tune", "models-add"],
)
def test_ctrl_c_while_another_command_loads_says_interrupted_and_exits_130(
    sample_models: Path, command: tuple[str, ...], said: str
) -> None:
    args = [arg.format(models=sample_models) for arg in command]
    result = _signal_while_loading(args, "/cv2/", signal.SIGINT)
    assert result == (130, "", f"vidpipe {said}: interrupted; nothing was written\n")


def test_the_done_line_counts_the_frames_dropped_by_reason(tmp_path: Path, sample_models: Path) -> None:
    # 100 fps offered, 5 kept: the others are dropped for max_fps, and the done line says so.
    cfg = tmp_path / "p.yaml"
    cfg.write_text(
        SQUARES.format(models=sample_models)
        + "sources:\n  - {url: 'test://?fps=100&frames=60', max_fps: 5}\n"
    )
    proc = run_cli("run", str(cfg), "--nats-port", str(free_port()))
    assert proc.returncode == 0, proc.stderr
    done = next(line for line in proc.stderr.splitlines() if "done: " in line)
    found = re.search(
        r"done: (\d+) frame\(s\) published from 1 source\(s\); dropped (\d+) \(max_fps\)$", done
    )
    assert found, done
    published, dropped = map(int, found.groups())
    assert published + dropped == 60 and dropped > 0, done


async def test_summary_says_frames_were_dropped_and_why_in_a_second_without_frames() -> None:
    out = io.StringIO()
    dropped = {"stage_error": 0}
    summary = Summary("nats://127.0.0.1:9", "vidpipe.>", out, dropped=lambda: dict(dropped))
    dropped["stage_error"] = 25
    summary.print_line()
    summary._window["cam"].append({"source": "cam", "objects": []})
    dropped.update(stage_error=40, queue_full=5)
    summary.print_line()
    summary.print_line()  # nothing published, nothing dropped
    lines = [re.sub(r"^\[ *\d+s\] ", "", line) for line in out.getvalue().splitlines()]
    assert lines[0] == "no frames published: 25 dropped this second (stage_error)"
    assert lines[1].startswith("cam:   1.0 fps")
    assert lines[1].endswith("; dropped 20 (stage_error 15, queue_full 5)")
    assert lines[2] == "no frames this second"


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["sigint", "sigterm"])
def test_a_stop_before_the_first_frame_exits_0_and_names_the_sources_never_up(
    squares_config: Path, sig: signal.Signals
) -> None:
    # A camera that accepts the connection and never answers: the source stays connecting.
    with socket.create_server(("127.0.0.1", 0)) as silent:
        port = silent.getsockname()[1]
        proc = _start("run", str(squares_config), "--source", f"rtsp://user:pw@127.0.0.1:{port}/stream1")
        try:
            _embedded_url(proc)
            assert proc.stderr is not None
            while "source stream1: connecting" not in (line := proc.stderr.readline()):
                assert line, "vidpipe ended before its source was connecting"
            os.killpg(proc.pid, sig)
            _, err = proc.communicate(timeout=60)
        finally:
            if proc.poll() is None:
                proc.kill()
    assert proc.returncode == 0, err
    assert [line.split(" done: ", 1)[1] for line in err.splitlines() if " done: " in line] == [
        f"0 frame(s) published from 1 source(s); stream1 never up (connecting: rtsp://***@127.0.0.1:{port}/stream1)"
    ]
    assert "pw" not in err


def test_a_stop_before_the_first_frame_still_exits_1_when_a_source_failed(
    tmp_path: Path, squares_config: Path
) -> None:
    with socket.create_server(("127.0.0.1", 0)) as silent:
        port = silent.getsockname()[1]
        missing = tmp_path / "missing.mp4"
        proc = _start(
            "run", str(squares_config), "--source", str(missing),
            "--source", f"rtsp://127.0.0.1:{port}/stream1",
        )  # fmt: skip
        try:
            _embedded_url(proc)
            assert proc.stderr is not None
            waiting = {"source missing: file not found", "source stream1: connecting"}
            while waiting:
                line = proc.stderr.readline()
                assert line, f"vidpipe ended before it logged {waiting}"
                waiting = {w for w in waiting if w not in line}
            os.killpg(proc.pid, signal.SIGINT)
            _, err = proc.communicate(timeout=60)
        finally:
            if proc.poll() is None:
                proc.kill()
    assert proc.returncode == 1, err
    assert [line.split(" done: ", 1)[1] for line in err.splitlines() if " done: " in line] == [
        "0 frame(s) published from 2 source(s); failed: missing; "
        f"stream1 never up (connecting: rtsp://127.0.0.1:{port}/stream1)"
    ]


@pytest.mark.parametrize("second", [signal.SIGINT, signal.SIGTERM], ids=["sigint", "sigterm"])
def test_a_second_stop_signal_after_the_done_line_still_exits_0(
    squares_config: Path, second: signal.Signals
) -> None:
    # A supervisor that signals again (systemd, Kubernetes) once the run has said it is done,
    # while the interpreter tears down: the run finished, so its exit code stands.
    proc = _start("run", str(squares_config), "--source", "test://?fps=25", "--source", "test://?fps=25")
    try:
        _embedded_url(proc)
        assert proc.stderr is not None
        while "source test_2: up" not in (line := proc.stderr.readline()):
            assert line, "vidpipe ended before its sources were up"
        os.killpg(proc.pid, signal.SIGTERM)
        while " done: " not in (line := proc.stderr.readline()):
            assert line, "vidpipe ended without its done line"
        os.killpg(proc.pid, second)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, line + err
    assert "forced exit" not in err


def test_the_embedded_server_takes_4222_so_subscribe_needs_no_flags(squares_config: Path) -> None:
    if not port_is_free(DEFAULT_PORT):
        pytest.skip("port 4222 is taken on this machine")
    # Fast enough that more messages are on their way when the third arrives: --count is exact.
    proc = _start("run", str(squares_config), "--source", "test://?fps=100", "--duration", "20")
    try:
        assert _embedded_url(proc) == "nats://127.0.0.1:4222"
        sub = run_cli("subscribe", "--count", "3", "--timeout", "15")
    finally:
        os.killpg(proc.pid, signal.SIGINT)
        proc.communicate(timeout=30)
    assert sub.returncode == 0, sub.stderr
    frames = [json.loads(line) for line in sub.stdout.splitlines()]
    assert len(frames) == 3 and all(f["source"] == "test" for f in frames)


def test_the_embedded_server_port_is_chosen_by_flag_or_file(tmp_path: Path, squares_config: Path) -> None:
    port = free_port()
    proc = run_cli(
        "run", str(squares_config), "--source", "test://?fps=50&frames=3", "--nats-port", str(port)
    )
    assert proc.returncode == 0, proc.stderr
    assert f"embedded NATS server at nats://127.0.0.1:{port}" in proc.stdout

    in_file = tmp_path / "port.yaml"
    in_file.write_text(squares_config.read_text() + f"nats:\n  port: {port}\n")
    proc = run_cli("run", str(in_file), "--source", "test://?fps=50&frames=3")
    assert proc.returncode == 0, proc.stderr
    assert f"embedded NATS server at nats://127.0.0.1:{port}" in proc.stdout


def test_a_chosen_nats_port_that_cannot_be_used_is_a_usage_error(
    tmp_path: Path, squares_config: Path, nats_server: EmbeddedNats
) -> None:
    taken = run_cli("run", str(squares_config), "--source", "test://", "--nats-port", str(nats_server.port))
    assert taken.returncode == 2
    assert taken.stderr == (
        f"--nats-port: port {nats_server.port} on 127.0.0.1 is in use (hint: stop what listens there, "
        "choose another port, or pass --nats URL to use that server)\n"
    )
    both = tmp_path / "both.yaml"
    both.write_text(squares_config.read_text() + f"nats:\n  url: {nats_server.url}\n  port: 4333\n")
    proc = run_cli("run", str(both), "--source", "test://")
    assert proc.returncode == 2
    assert proc.stderr == (
        f"{both}:7: nats.port: applies to the embedded NATS server only, and nats.url names a server "
        "(hint: drop one of them)\n"
    )


def test_an_http_port_in_use_is_a_usage_error_before_anything_starts(squares_config: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = run_cli("run", str(squares_config), "--source", "test://", "--http", f"127.0.0.1:{port}")
    assert proc.returncode == 2
    assert proc.stderr == (
        f"--http: 127.0.0.1:{port}: cannot bind: Address already in use "
        "(hint: stop what listens there or choose another port)\n"
    )


def test_a_whip_source_without_the_http_server_is_refused_by_run_and_warned_by_validate(
    tmp_path: Path,
) -> None:
    config = tmp_path / "door.yaml"
    config.write_text("pipeline: shop\nsources:\n  - url: whip://door\n")
    problem = (
        "a whip:// source needs the HTTP server, which takes its publisher's offer "
        "(hint: add http: {listen: 127.0.0.1:8080} to the file, or run with --http 127.0.0.1:8080)"
    )
    proc = run_cli("run", str(config))
    assert (proc.returncode, proc.stderr) == (2, f"{config}:3: sources[0].url: {problem}\n")
    proc = run_cli("run", str(config), "--source", "whip://yard")
    assert (proc.returncode, proc.stderr) == (2, f"--source: whip://yard: {problem}\n")
    # validate cannot see a --http the run may be given: it says so, and passes.
    proc = run_cli("validate", str(config))
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == f"warning: {config}:3: sources[0].url: {problem}\n"


def test_validate_refuses_the_settings_run_refuses(tmp_path: Path, squares_config: Path) -> None:
    # Each of these passed validate and was refused only by run (exit 2) or, for an
    # http:// NATS URL, only timed out there.
    settings = tmp_path / "settings.yaml"
    settings.write_text(
        squares_config.read_text()
        + "http: {listen: '10.255.255.1:18082', token: short}\n"
        + "nats: {url: 'http://user:pw@127.0.0.1:9', port: 4333}\n"
    )
    proc = run_cli("validate", str(settings))
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.splitlines() == [
        f"{settings}:6: nats.url: 'http://***@127.0.0.1:9' is not a NATS server URL "
        "(hint: use nats://, tls://, ws://, wss://, e.g. nats://127.0.0.1:4222)",
    ]
    settings.write_text(settings.read_text().replace("http://user:pw@", "nats://user:pw@"))
    proc = run_cli("validate", str(settings))
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.splitlines() == [
        f"{settings}:5: http.token is 5 characters; off loopback it must have at least 16 "
        "(e.g. python3 -c 'import secrets; print(secrets.token_urlsafe(24))')",
        f"{settings}:6: nats.port: applies to the embedded NATS server only, and nats.url names a server "
        "(hint: drop one of them)",
    ]
    assert "pw" not in proc.stderr


# -- feedback ------------------------------------------------------------------------------


def _on_a_terminal(*args: str) -> tuple[int, str]:
    """``vidpipe ARGS`` with its stderr on a pseudo-terminal (as a person, or `docker run -t`,
    has it); the exit code and everything written there."""
    master, slave = pty.openpty()
    try:
        proc = _start(*args, stderr=slave)
        os.close(slave)
        chunks = []
        while True:
            try:
                data = os.read(master, 4096)
            except OSError:  # EIO: the last writer closed the terminal
                break
            if not data:
                break
            chunks.append(data)
        proc.wait(timeout=60)
    finally:
        os.close(master)
    return proc.returncode, b"".join(chunks).decode(errors="replace")


def test_a_file_run_on_a_terminal_shows_progress(
    tmp_path: Path, squares_config: Path, nats_server: EmbeddedNats
) -> None:
    clip = write_clip(tmp_path / "clip.mp4", frames=30, fps=15, width=160, height=120)
    code, shown = _on_a_terminal("run", str(squares_config), "--source", str(clip), "--nats", nats_server.url)
    assert code == 0, shown
    assert re.search(r"\r30/30 frames \(100%\)  [\d.]+ fps  ETA 0:00", shown), shown
    # A log line wipes the progress line first: it was appended to the progress text.
    assert "source clip: stopped (end of stream)" in shown
    assert not re.search(r"(fps|ETA [^\r\n ]+)\x1b\[K[^\r\n]*\d\d:\d\d:\d\d (info|warning)", shown), shown
    # JSON logs on a terminal (a container run with a TTY): every line parses, no progress.
    code, shown = _on_a_terminal(
        "run", str(squares_config), "--source", str(clip), "--nats", nats_server.url, "--log-format", "json"
    )
    assert code == 0, shown
    lines = shown.replace("\r\n", "\n").strip().split("\n")
    assert [json.loads(line)["level"] for line in lines][-1] == "info" and " frames (" not in shown
    # Not on a pipe, and not when asked not to.
    piped = run_cli("run", str(squares_config), "--source", str(clip), "--nats", nats_server.url)
    assert piped.returncode == 0 and " frames (" not in piped.stderr


def test_debug_log_names_the_models_a_pipeline_leaves_unloaded(
    squares_config: Path, nats_server: EmbeddedNats
) -> None:
    proc = run_cli("run", str(squares_config), "--source", "test://?fps=50&frames=2", "--nats", nats_server.url,
                   "--log-level", "debug")  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    lines = [line.split("debug", 1)[1].strip() for line in proc.stderr.splitlines() if " debug " in line]
    models = sorted(line for line in lines if line.startswith("model ") and ": " in line)
    unused = [f"model {m}: in the repository, not used by this pipeline (not loaded)" for m in
              ("ppocr_cls", "ppocr_det", "ppocr_rec")]  # fmt: skip
    assert models[:3] == unused, models
    assert models[3].startswith("model squares: version -, openvino ") and models[3].endswith(", state ready")


def test_summary_counts_objects_per_label(squares_config: Path, nats_server: EmbeddedNats) -> None:
    proc = run_cli("run", str(squares_config), "--source", "test://?fps=50&frames=10", "--summary",
                   "--nats", nats_server.url)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "received 10 messages from 1 source(s); objects: square x10" in proc.stdout


async def test_summary_lines_say_waiting_only_before_the_first_frame_and_stop_adds_no_empty_second() -> None:
    out = io.StringIO()
    summary = Summary("nats://127.0.0.1:9", "vidpipe.>", out)  # never connected: fed by hand
    summary.print_line()
    summary._window["cam"].append({"source": "cam", "objects": []})
    summary.print_line()
    summary.print_line()
    await summary.stop()  # nothing new since the last line: no line for it
    lines = [re.sub(r"^\[ *\d+s\] ", "", line) for line in out.getvalue().splitlines()]
    assert lines[0] == "waiting for frames"
    assert lines[1].startswith("cam:   1.0 fps")
    assert lines[2:] == ["no frames this second", "received 1 messages from 1 source(s)"]


def test_summary_counts_events_and_line_crossings(
    tmp_path: Path, sample_models: Path, nats_server: EmbeddedNats
) -> None:
    # The pattern's square walks right, then back: across the door once each way, into the dock and out.
    path = tmp_path / "zones.yaml"
    path.write_text(ZONES.format(models=sample_models))
    proc = run_cli("run", str(path), "--summary", "--nats", nats_server.url)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[-1] == (
        "received 90 messages from 1 source(s); objects: square x90; events: track_start x1, "
        "track_end x1, zone_enter x1, zone_exit x1, line_cross x2; crossings: door in x1, door out x1"
    )


def test_fleet_flag_names_a_fleet_section_that_has_no_name(
    squares_config: Path, nats_server: EmbeddedNats
) -> None:
    config = squares_config.with_name("unnamed.yaml")
    config.write_text(squares_config.read_text() + "fleet: {lease_ttl: 4}\n")
    unnamed = run_cli("validate", str(config))  # without --fleet the section needs its name
    assert unnamed.returncode == 2
    assert f"{config}:5: fleet: missing required key 'name'" in unnamed.stderr, unnamed.stderr
    proc = run_cli("run", str(config), "--fleet", "shop", "--nats", nats_server.url, "--duration", "2")
    assert proc.returncode == 0, proc.stderr
    assert "fleet shop" in proc.stderr


def test_the_fleet_worker_lines_are_log_lines_with_their_time(
    squares_config: Path, nats_server: EmbeddedNats
) -> None:
    proc = run_cli(
        "run", str(squares_config), "--fleet", "shop", "--nats", nats_server.url, "--duration", "2"
    )
    assert proc.returncode == 0, proc.stderr
    # On stderr with the time like every other line; nothing of the fleet on stdout.
    assert "fleet" not in proc.stdout
    lines = [line for line in proc.stderr.splitlines() if "fleet shop" in line]
    assert len(lines) == 2, lines
    assert re.fullmatch(r"\d\d:\d\d:\d\d info    fleet shop: worker \S+ joined \(.*\)", lines[0]), lines
    assert re.fullmatch(r"\d\d:\d\d:\d\d info    fleet shop: worker \S+ left \(.*\)", lines[1]), lines


def test_version_and_help_with_examples_and_defaults() -> None:
    version = run_cli("--version")
    assert version.returncode == 0 and version.stdout.strip() == f"vidpipe {pipeline.__version__}"
    top = run_cli("--help").stdout
    assert "examples:" in top and "vidpipe validate configs/demo.yaml" in top
    run_help = " ".join(run_cli("run", "--help").stdout.split())
    for expected in ("(default: info)", "(default: plain)", "(default: no limit)", "(default: off)",
                     "(default: when the sources end)", "examples:"):  # fmt: skip
        assert expected in run_help, run_help
    assert "(default: None)" not in run_help and "(default: False)" not in run_help


@pytest.mark.parametrize(
    "command", [("run",), ("validate",), ("subscribe",), ("models", "add"), ("models", "list"), ("tune",),
                ("serve-rtsp",), ("fleet", "add")],
)  # fmt: skip
def test_help_says_each_default_once(command: tuple[str, ...]) -> None:
    shown = run_cli(*command, "--help").stdout
    # One block per option: from its "  -x, --xyz" line to the next one.
    for option in re.split(r"\n(?=  -)", shown):
        text = " ".join(option.split())
        assert text.count("default") <= 1, text
    if command == ("models", "add"):
        assert " ".join(shown.split()).count("(default: models)") == 1


def test_debug_log_names_config_sources_and_model_instances(
    squares_config: Path, nats_server: EmbeddedNats
) -> None:
    proc = run_cli(
        "run", str(squares_config), "--source", "test://?fps=50&frames=3",
        "--source", "rtsp://admin:s3cret@127.0.0.1:9/cam", "--nats", nats_server.url,
        "--duration", "3", "--log-level", "debug",
    )  # fmt: skip
    assert "s3cret" not in proc.stderr
    assert f"config {squares_config}: pipeline demo, 2 source(s), stages objects (infer)" in proc.stderr
    # Each source with the keys its scheme takes: a test pattern has no transport.
    (test,) = [line for line in proc.stderr.splitlines() if "source test: test://" in line]
    assert test.endswith(
        "source test: test://?fps=50&frames=3 (test, live) max_fps=None queue_size=8 max_pixels=33177600"
    )
    assert "source cam: rtsp://***@127.0.0.1:9/cam (rtsp, live) max_fps=None queue_size=8" in proc.stderr
    assert " transport=tcp open_timeout=10.0 read_timeout=5.0" in proc.stderr
    assert re.search(
        r"model squares: version \S+, openvino \S*, preprocess model, 1 instance\(s\), max_batch_size 8",
        proc.stderr,
    )


def test_json_format_makes_every_line_json_with_the_server_url(squares_config: Path) -> None:
    proc = run_cli("run", str(squares_config), "--source", "test://?fps=50&frames=5", "--summary",
                   "--log-format", "json")  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    out = [json.loads(line) for line in proc.stdout.splitlines()]
    err = [json.loads(line) for line in proc.stderr.splitlines()]
    assert out[0]["msg"].startswith("embedded NATS server at nats://127.0.0.1:")
    assert out[0]["url"] == out[0]["msg"].rsplit(" ", 1)[1]
    assert out[-1]["messages"] == 5 and out[-1]["labels"] == {"square": 5}
    assert any(r["msg"].startswith("done: 5 frame(s)") for r in err)
    bad = run_cli("validate", "/nonexistent.yaml", "--log-format", "json")
    assert bad.returncode == 2
    assert json.loads(bad.stderr) | {"ts": 0} == {
        "ts": 0, "level": "error", "logger": "vidpipe", "file": "/nonexistent.yaml",
        "msg": "/nonexistent.yaml: file not found (hint: check the path)",
    }  # fmt: skip


def test_subscribe_that_received_nothing_says_so(nats_server: EmbeddedNats) -> None:
    # 4 s: the timeout counts from the start, connecting included (slow on a busy machine).
    proc = run_cli("subscribe", "--nats", nats_server.url, "--timeout", "4")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == ""
    assert re.match(
        rf"vidpipe: no messages on vidpipe\.> at {re.escape(nats_server.url)} in [45]s", proc.stderr
    )


def test_subscribe_speaks_json_with_log_format_json(nats_server: EmbeddedNats) -> None:
    # Its own lines were plain text whatever --log-format said.
    quiet = run_cli("subscribe", "--nats", nats_server.url, "--timeout", "4", "--log-format", "json")
    assert quiet.returncode == 0, quiet.stderr
    (line,) = [json.loads(text) for text in quiet.stderr.splitlines()]
    assert (line["level"], line["logger"]) == ("warning", "vidpipe")
    assert line["msg"].startswith(f"vidpipe: no messages on vidpipe.> at {nats_server.url} in ")
    url = f"nats://127.0.0.1:{free_port()}"  # nothing listens there
    down = run_cli("subscribe", "--nats", url, "--timeout", "3", "--log-format", "json")
    assert down.returncode == 1
    lines = [json.loads(text) for text in down.stderr.splitlines()]
    assert [(r["level"], r["msg"].split(" (")[0].split(" in ")[0]) for r in lines] == [
        ("warning", f"vidpipe: waiting for NATS at {url}"),
        ("error", f"vidpipe: cannot connect to NATS at {url}"),
    ]


def test_debug_with_json_logs_gives_the_traceback_as_a_json_field(squares_config: Path) -> None:
    # --debug raised the failure, and Python printed its traceback as text among the JSON lines.
    url = f"nats://127.0.0.1:{free_port()}"  # nothing listens there
    proc = run_cli("run", str(squares_config), "--debug", "--log-format", "json", "--source", "test://?frames=3",
                   "--nats", url)  # fmt: skip
    assert proc.returncode == 1
    lines = [json.loads(text) for text in proc.stderr.splitlines()]  # every line is JSON
    last = lines[-1]
    assert (last["level"], last["msg"].split(":")[0]) == ("error", "vidpipe")
    assert f"cannot connect to NATS at {url}" in last["msg"]
    assert last["exc"].startswith("Traceback (most recent call last):")


def _wait_for_api(url: str, timeout: float = 30.0) -> None:
    """Poll ``url`` until the run's API answers (the process was started a moment ago)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            urllib.request.urlopen(url, timeout=1).close()
            return
        except OSError:
            assert time.monotonic() < deadline, "the API did not come up"
            time.sleep(0.1)


def test_done_line_counts_sources_added_and_removed_through_the_api(
    tmp_path: Path, squares_config: Path, nats_server: EmbeddedNats
) -> None:
    port = free_port()
    proc = _start("run", str(squares_config), "--http", f"127.0.0.1:{port}", "--nats", nats_server.url,
                  "--duration", "8")  # fmt: skip
    try:
        api = f"http://127.0.0.1:{port}/v1/sources"
        _wait_for_api(api)
        body = json.dumps({"url": "test://?fps=50&frames=5&id=once"}).encode()
        post = urllib.request.Request(api, body, {"Content-Type": "application/json"}, method="POST")
        urllib.request.urlopen(post, timeout=5).close()
        while True:
            sources = json.load(urllib.request.urlopen(api, timeout=5))
            if sources and sources[0]["state"] in ("stopped", "failed"):
                break
            time.sleep(0.1)
        urllib.request.urlopen(urllib.request.Request(f"{api}/once", method="DELETE"), timeout=5).close()
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err
    assert "done: 5 frame(s) published from 1 source(s)" in err


def test_removing_the_last_source_over_the_api_keeps_the_run_up_for_the_next(
    squares_config: Path, nats_server: EmbeddedNats
) -> None:
    # Swapping a camera (DELETE, then POST) ended the whole run at the DELETE.
    port = free_port()
    proc = _start("run", str(squares_config), "--source", "test://?fps=20&id=cam", "--http",
                  f"127.0.0.1:{port}", "--nats", nats_server.url)  # fmt: skip
    try:
        api = f"http://127.0.0.1:{port}/v1/sources"
        _wait_for_api(api)
        urllib.request.urlopen(urllib.request.Request(f"{api}/cam", method="DELETE"), timeout=5).close()
        body = json.dumps({"url": "test://?fps=50&frames=5&id=next"}).encode()
        post = urllib.request.Request(api, body, {"Content-Type": "application/json"}, method="POST")
        urllib.request.urlopen(post, timeout=5).close()
        while json.load(urllib.request.urlopen(api, timeout=5))[0]["state"] != "stopped":
            time.sleep(0.1)
        assert proc.poll() is None  # its last source ended, and the run is still up
        os.killpg(proc.pid, signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err
    assert "source cam removed over the API; no sources left, the run stays up" in err
    assert re.search(r"done: \d+ frame\(s\) published from 2 source\(s\)", err), err


# -- embedding the live view ---------------------------------------------------------------

EMBED = """\
pipeline: shop
sources: [{{id: cam, url: "test://?fps=10&width=160&height=120"}}]
http: {{listen: "127.0.0.1:0", token: "{token}"{extra}}}
"""
TOKEN = "a-token-of-enough-characters"
PAGE = "https://intranet.example"


async def test_an_allowed_origin_may_embed_the_mjpeg_view_and_snapshots_and_nothing_else(
    tmp_path: Path, nats_server: EmbeddedNats
) -> None:
    text = EMBED.format(token=TOKEN, extra=f', allowed_origins: ["{PAGE}/"]')
    stack = await Stack.start(tmp_path, text, nats_server.url, token=TOKEN)
    try:
        await until(lambda: stack.runtime.sources["cam"].last_frame is not None, 30, "a published frame")
        snapshot = "/v1/sources/cam/snapshot.jpg"
        mjpeg = "/v1/sources/cam/stream.mjpeg"

        async def headers(method: str, path: str, **extra: str) -> tuple[int, dict[str, str]]:
            async with stack.http.request(method, path, headers=extra) as resp:
                return resp.status, {
                    k: v for k, v in resp.headers.items() if k.startswith(("Access-", "Cross-"))
                }

        embedded = {"Cross-Origin-Resource-Policy": "cross-origin", "Access-Control-Allow-Origin": PAGE}
        # An <img> on the page sends its address as Referer; fetch() sends Origin.
        assert await headers("GET", snapshot, Referer=f"{PAGE}/store/42") == (200, embedded)
        assert await headers("GET", mjpeg, Origin=PAGE) == (200, embedded)
        # fetch() with the token first asks without it (the preflight).
        preflight = await stack.http.options(mjpeg, headers={"Origin": PAGE, "Authorization": ""})
        assert preflight.status == 204
        assert preflight.headers["Access-Control-Allow-Origin"] == PAGE
        assert preflight.headers["Access-Control-Allow-Headers"] == "Authorization"
        # Another site, or the API's data: as before.
        same_origin = {"Cross-Origin-Resource-Policy": "same-origin"}
        assert await headers("GET", snapshot, Origin="https://elsewhere.example") == (200, same_origin)
        assert await headers("GET", "/v1/stats", Origin=PAGE) == (200, same_origin)
        async with aiohttp.ClientSession(base_url=stack.api.url) as anonymous:
            other = await anonymous.options(mjpeg, headers={"Origin": "https://elsewhere.example"})
            assert other.status == 401
            # The token is still needed for the images themselves.
            async with anonymous.get(snapshot, headers={"Origin": PAGE}) as resp:
                assert resp.status == 401
    finally:
        await stack.close()

    (tmp_path / "default").mkdir()
    stack = await Stack.start(
        tmp_path / "default", EMBED.format(token=TOKEN, extra=""), nats_server.url, TOKEN
    )
    try:
        await until(lambda: stack.runtime.sources["cam"].last_frame is not None, 30, "a published frame")
        async with stack.http.get("/v1/sources/cam/snapshot.jpg", headers={"Origin": PAGE}) as resp:
            assert resp.headers["Cross-Origin-Resource-Policy"] == "same-origin"
            assert "Access-Control-Allow-Origin" not in resp.headers
    finally:
        await stack.close()


def test_allowed_origins_must_be_web_origins(tmp_path: Path) -> None:
    path = tmp_path / "p.yaml"
    path.write_text(EMBED.format(token=TOKEN, extra=', allowed_origins: ["intranet.example"]'))
    proc = run_cli("validate", str(path))
    assert proc.returncode == 2
    assert proc.stderr == (
        f"{path}:3: http.allowed_origins: 'intranet.example' is not a web origin (scheme://host[:port], "
        "e.g. https://intranet.example) (hint: pages (scheme://host[:port]) that may embed MJPEG views "
        "and snapshots)\n"
    )


@contextlib.contextmanager
def page_server(folder: Path) -> Iterator[str]:
    """A web site on its own loopback port (another origin than the API), serving ``folder``."""
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(folder))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


IMAGE_SIZES = """
[...document.images].map((img) => img.complete ? img.naturalWidth : -1)
"""


@pytest.mark.skipif(not CHROMIUM.exists(), reason="needs /usr/bin/chromium (make test installs it with apt)")
async def test_a_page_of_an_allowed_origin_shows_the_live_view_in_chromium_and_another_does_not(
    tmp_path: Path, nats_server: EmbeddedNats, chromium: DevTools
) -> None:
    site = tmp_path / "site"
    site.mkdir()
    with page_server(site) as allowed, page_server(site) as other:
        text = (
            'pipeline: shop\nsources: [{id: cam, url: "test://?fps=10&width=160&height=120"}]\n'
            f'http: {{listen: "127.0.0.1:0", allowed_origins: ["{allowed}"]}}\n'
        )
        stack = await Stack.start(tmp_path, text, nats_server.url)
        try:
            await until(lambda: stack.runtime.sources["cam"].last_frame is not None, 30, "a published frame")
            views = f"{stack.api.url}/v1/sources/cam"
            (site / "embed.html").write_text(
                f'<img src="{views}/stream.mjpeg?fps=5"><img src="{views}/snapshot.jpg">'
            )
            await open_dashboard(chromium, f"{allowed}/embed.html")
            sizes = await chromium.poll(IMAGE_SIZES, lambda v: v == [160, 160], timeout=30)
            assert sizes == [160, 160]
            await chromium.screenshot(ARTIFACTS / "embedded-live-view.png")
            # The same page from an origin not in the list: the browser refuses both images.
            await open_dashboard(chromium, f"{other}/embed.html")
            refused = await chromium.poll(
                "[...document.images].map((img) => img.complete && img.naturalWidth === 0)",
                lambda v: v == [True, True],
                timeout=30,
            )
            assert refused == [True, True]
        finally:
            await stack.close()
