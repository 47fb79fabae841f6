"""CLI behaviour not covered elsewhere: model listing, structured logs, trial RTSP cameras, fleet commands."""

from __future__ import annotations

import itertools
import json
import os
import select
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline.nats_server import EmbeddedNats
from pipeline.sources.registry import create_source
from pipeline.sources.rtsp import RtspSource
from tests.conftest import ROOT, run_cli
from tests.pipeline.test_inputs import take, timed_config
from tests.support.media_servers import level, level_clip
from tests.support.rtsp_server import free_port, gstreamer_available


def test_models_list_shows_each_model_its_io_and_state(sample_models: Path) -> None:
    proc = run_cli("models", "list", str(sample_models))
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0].split() == [
        "NAME",
        "VERSION",
        "STATE",
        "BACKEND",
        "PRECISION",
        "PREPROCESS",
        "INPUTS",
        "OUTPUTS",
        "BATCH",
        "TASK",
        "LABELS",
    ]
    rows = {line.split()[0]: line for line in lines[1:]}
    assert rows["squares"].endswith("  yolo/yolov8     1 (square)")
    assert rows["ppocr_cls"].endswith("  classify        2 (0, 180)")
    assert sorted(rows) == ["ppocr_cls", "ppocr_det", "ppocr_rec", "squares"]
    # The compiled model takes uint8 RGB images and normalises them itself (preprocess: auto).
    assert "images:uint8[?,320,320,3]" in rows["squares"] and "output0:float32[?,5,1]" in rows["squares"]
    assert all(" ready " in row for row in rows.values())
    # OpenVINO compiles for the configured input, so the recogniser's sequence length is known.
    assert "softmax_11.tmp_0:float32[?,40,6625]" in rows["ppocr_rec"]
    # The shipped configs run on OpenVINO at its own precision for this CPU, normalising in the model.
    assert all(
        row.split()[3:6] in (["openvino", p, "model"] for p in ("bf16", "f32")) for row in rows.values()
    )


def test_models_list_of_a_missing_folder_is_a_usage_error(tmp_path: Path) -> None:
    proc = run_cli("models", "list", str(tmp_path / "nope"))
    assert proc.returncode == 2
    assert (
        proc.stderr.strip()
        == f"{tmp_path / 'nope'}: model repository folder not found (hint: check the path)"
    )


def test_json_logs_are_one_object_per_line_without_credentials(
    tmp_path: Path, nats_server: EmbeddedNats
) -> None:
    proc = run_cli(
        "run", str(ROOT / "configs" / "demo.yaml"),
        "--source", "test://?fps=50&frames=5",
        "--source", "rtsp://admin:s3cret@127.0.0.1:9/cam",
        "--nats", nats_server.url, "--duration", "3", "--log-format", "json",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "s3cret" not in proc.stderr and "s3cret" not in proc.stdout
    records = [json.loads(line) for line in proc.stderr.splitlines()]
    assert all(set(r) >= {"ts", "level", "logger", "msg"} for r in records)
    messages = [r["msg"] for r in records]
    assert "source test: up" in messages
    cam = [m for m in messages if m.startswith("source cam:")]
    assert cam and all("rtsp://***@127.0.0.1:9/cam" in m for m in cam if "rtsp://" in m)
    # A source's lines name it in a field of their own, for filtering without parsing.
    assert {r.get("source") for r in records if r["msg"].startswith("source cam:")} == {"cam"}
    assert {r.get("source") for r in records if r["msg"] == "source test: up"} == {"test"}
    # Events, not frames: a few lines for a whole run.
    assert len(records) < 30


def step_of(shown: int) -> int:
    """The clip frame (0-9) whose level a decoded frame shows, within the codec's rounding."""
    index = min(range(10), key=lambda i: abs(level(i) - shown))
    assert abs(level(index) - shown) <= 3, shown
    return index


def _serve_rtsp(clip: Path) -> tuple[subprocess.Popen[str], str]:
    """``vidpipe serve-rtsp CLIP`` in its own session, and the URL it printed."""
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "pipeline.cli", "serve-rtsp", str(clip), "--port", str(port)],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
    )  # fmt: skip
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], 60)
    if not ready:
        proc.kill()
        proc.communicate()
        raise AssertionError("no URL within 60 s")
    url = proc.stdout.readline().strip()
    assert url == f"rtsp://127.0.0.1:{port}/{clip.stem}"
    return proc, url


@pytest.mark.skipif(not gstreamer_available(), reason="needs /usr/bin/python3 with gst-rtsp-server")
async def test_serve_rtsp_loops_a_file_as_a_live_camera_until_ctrl_c(tmp_path: Path) -> None:
    clip = level_clip(tmp_path / "door.mp4", frames=10, fps=10)  # one second, frame i at level(i)
    proc, url = _serve_rtsp(clip)
    try:
        source = create_source(timed_config(url))
        assert isinstance(source, RtspSource)
        frames = await take(source, 35, timeout=60)  # three and a half clip lengths
        # Ctrl-C in a terminal signals the whole foreground process group.
        os.killpg(proc.pid, signal.SIGINT)
        _, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, err
    # One unbroken stream: no reconnect, time runs on, and the picture wraps from the
    # clip's last frame to its first again and again.
    assert source.stats.reconnects == 0
    assert all(b.pts > a.pts for a, b in itertools.pairwise(frames))
    indices = [step_of(f.level) for f in frames]
    assert all(b == (a + 1) % 10 for a, b in itertools.pairwise(indices)), indices
    assert sum(1 for a, b in itertools.pairwise(indices) if b < a) >= 2


@pytest.mark.skipif(not gstreamer_available(), reason="needs /usr/bin/python3 with gst-rtsp-server")
def test_serve_rtsp_sends_a_keyframe_a_second_at_the_files_own_frame_rate(tmp_path: Path) -> None:
    import av

    clip = level_clip(tmp_path / "door.mp4", frames=10, fps=12)
    proc, url = _serve_rtsp(clip)
    try:
        with av.open(url, options={"rtsp_transport": "tcp"}, timeout=30) as container:
            packets = list(itertools.islice((p for p in container.demux(video=0) if p.size), 40))
    finally:
        os.killpg(proc.pid, signal.SIGINT)
        proc.communicate(timeout=30)
    # One keyframe every 12 frames: a second at 12 fps (the default of 30 frames was 2.5 s).
    keys = [i for i, p in enumerate(packets) if p.is_keyframe]
    assert len(keys) >= 3 and {b - a for a, b in itertools.pairwise(keys)} == {12}, keys


def test_serve_rtsp_of_a_missing_file_is_a_usage_error(tmp_path: Path) -> None:
    proc = run_cli("serve-rtsp", str(tmp_path / "nope.mp4"))
    assert (proc.returncode, proc.stderr) == (2, f"{tmp_path / 'nope.mp4'}: file not found\n")


def fleet_cli(server: EmbeddedNats, fleet: str, *args: str) -> subprocess.CompletedProcess[str]:
    """``vidpipe fleet ARGS --nats <server> --fleet FLEET``."""
    return run_cli("fleet", *args, "--nats", server.url, "--fleet", fleet)


def test_a_fleet_the_server_does_not_have_is_named_with_the_fleets_it_has(nats_server: EmbeddedNats) -> None:
    url = nats_server.url
    listed = fleet_cli(nats_server, "cams", "list")
    assert (listed.returncode, listed.stdout) == (2, "")
    assert listed.stderr == (
        f"--fleet: no fleet 'cams' on {url} (hint: the server has no fleet yet; workers make theirs as "
        "they start: vidpipe run CONFIG --fleet NAME)\n"
    )

    # A desired set may be prepared before any worker starts: added, with a note that says so.
    added = fleet_cli(nats_server, "cams", "add", "test://", "--id", "door")
    assert (added.returncode, added.stdout) == (0, "fleet cams: source door added\n")
    assert added.stderr == (
        f"vidpipe: note: fleet cams is new on {url} (no other fleet there): no worker runs it yet, and "
        "workers that join it will run this set, not their file's sources\n"
    )
    added = fleet_cli(nats_server, "lobby", "add", "test://", "--id", "desk")
    assert (added.returncode, added.stdout) == (0, "fleet lobby: source desk added\n")
    assert added.stderr == (
        f"vidpipe: note: fleet lobby is new on {url} (fleets there: cams): no worker runs it yet, and "
        "workers that join it will run this set, not their file's sources\n"
    )
    added = fleet_cli(nats_server, "cams", "add", "test://", "--id", "yard")
    assert (added.returncode, added.stdout, added.stderr) == (0, "fleet cams: source yard added\n", "")

    # A misspelt name: nothing listed, nothing removed, no bucket made for it.
    for command in (("list",), ("remove", "door")):
        proc = fleet_cli(nats_server, "camz", *command)
        assert (proc.returncode, proc.stdout) == (2, "")
        assert proc.stderr == (
            f"--fleet: no fleet 'camz' on {url} (hint: did you mean 'cams'? fleets there: cams, lobby)\n"
        )
    proc = fleet_cli(nats_server, "zzz", "list")
    assert (proc.returncode, proc.stderr) == (
        2,
        f"--fleet: no fleet 'zzz' on {url} (hint: fleets there: cams, lobby)\n",
    )

    listed = fleet_cli(nats_server, "cams", "list", "--json")
    assert listed.returncode == 0, listed.stderr
    assert [s["id"] for s in json.loads(listed.stdout)["sources"]] == ["door", "yard"]


def test_fleet_add_refuses_a_whip_name_another_desired_source_uses(nats_server: EmbeddedNats) -> None:
    added = fleet_cli(nats_server, "cams", "add", "whip://door", "--id", "front")
    assert (added.returncode, added.stdout) == (0, "fleet cams: source front added\n")
    taken = fleet_cli(nats_server, "cams", "add", "whip://door", "--id", "back")
    assert (taken.returncode, taken.stdout) == (2, "")
    assert taken.stderr == (
        "url: whip name 'door' is already used by source 'front' in fleet cams "
        "(hint: give this publisher another name, whip://<name>, or remove 'front' first)\n"
    )
    # The same id is the id's own refusal; another name, or the same name in another fleet, is fine.
    again = fleet_cli(nats_server, "cams", "add", "whip://door", "--id", "front")
    assert (again.returncode, again.stderr) == (2, "vidpipe: fleet cams already has a source front\n")
    other = fleet_cli(nats_server, "cams", "add", "whip://yard", "--id", "back")
    assert (other.returncode, other.stdout, other.stderr) == (0, "fleet cams: source back added\n", "")
    elsewhere = fleet_cli(nats_server, "lobby", "add", "whip://door", "--id", "back")
    assert (elsewhere.returncode, elsewhere.stdout) == (0, "fleet lobby: source back added\n")
    listed = fleet_cli(nats_server, "cams", "list", "--json")
    assert [s["id"] for s in json.loads(listed.stdout)["sources"]] == ["back", "front"]
