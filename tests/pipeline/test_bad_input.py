"""Bad input gets one clear line naming the thing and what to do; the rest keeps running."""

from __future__ import annotations

import shutil
from fractions import Fraction
from pathlib import Path

import av
import numpy as np
import pytest

from pipeline.nats_server import EmbeddedNats
from samples.make_clip import write_clip
from tests.conftest import SQUARES, run_cli


def error_lines(stderr: str, needle: str) -> list[str]:
    return [line for line in stderr.splitlines() if needle in line]


def test_truncated_file_publishes_what_decodes_and_says_so(
    tmp_path: Path, squares_config: Path, nats_server: EmbeddedNats
) -> None:
    clip = write_clip(tmp_path / "cut.mp4", frames=60, fps=15, codec="mpeg4")
    data = clip.read_bytes()
    # mpeg4 in MP4 keeps its index at the end: cut the tail off and the file cannot be opened.
    clip.write_bytes(data[: len(data) // 2])
    good = write_clip(tmp_path / "ok.mp4", frames=10, fps=10)
    proc = run_cli(
        "run", str(squares_config), "--source", str(clip), "--source", str(good), "--nats", nats_server.url
    )
    assert proc.returncode == 0, proc.stderr
    (line,) = error_lines(proc.stderr, "source cut:")
    assert f"cannot open {clip}" in line
    assert "done: 10 frame(s) published from 2 source(s); failed: cut" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_damaged_tail_of_a_stream_keeps_the_frames_before_it(
    tmp_path: Path, squares_config: Path, nats_server: EmbeddedNats
) -> None:
    # A raw H.264 elementary stream has no index: the decodable head still plays.
    raw = tmp_path / "cam.h264"
    with av.open(str(raw), mode="w", format="h264") as out:
        stream = out.add_stream("libx264", rate=10)
        stream.width, stream.height, stream.pix_fmt = 160, 120, "yuv420p"
        stream.time_base = Fraction(1, 10)
        for i in range(40):
            frame = av.VideoFrame.from_ndarray(np.full((120, 160, 3), i * 5, np.uint8), format="rgb24")
            frame.pts = i
            for packet in stream.encode(frame):
                out.mux(packet)
        for packet in stream.encode():
            out.mux(packet)
    data = raw.read_bytes()
    raw.write_bytes(data[: len(data) // 2] + bytes(range(256)) * 8)
    proc = run_cli("run", str(squares_config), "--source", str(raw), "--nats", nats_server.url)
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr
    published = int(proc.stderr.split("done: ")[1].split(" frame")[0])
    assert 5 <= published < 40


def test_a_file_without_video_is_named(
    tmp_path: Path, squares_config: Path, nats_server: EmbeddedNats
) -> None:
    audio = tmp_path / "voice.wav"
    with av.open(str(audio), mode="w") as out:
        stream = out.add_stream("pcm_s16le", rate=8000)
        frame = av.AudioFrame.from_ndarray(np.zeros((1, 800), np.int16), format="s16", layout="mono")
        frame.sample_rate = 8000
        for packet in stream.encode(frame):
            out.mux(packet)
        for packet in stream.encode():
            out.mux(packet)
    proc = run_cli("run", str(squares_config), "--source", str(audio), "--nats", nats_server.url)
    assert proc.returncode == 1
    (line,) = error_lines(proc.stderr, "source voice:")
    assert line.endswith(f"source voice: {audio} has no video stream")
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize(
    ("damage", "expected"),
    [
        ("missing", "model_file"),
        ("corrupt", "model.onnx"),
        ("shape", "input.shape"),
    ],
)
def test_a_broken_model_stops_the_run_with_the_model_named(
    tmp_path: Path, sample_models: Path, nats_server: EmbeddedNats, damage: str, expected: str
) -> None:
    repo = tmp_path / "models"
    shutil.copytree(sample_models / "squares", repo / "squares")
    model_dir = repo / "squares"
    if damage == "missing":
        (model_dir / "model.onnx").unlink()
    elif damage == "corrupt":
        (model_dir / "model.onnx").write_bytes(b"\x08\x01garbage" * 50)
    else:
        text = (model_dir / "config.yaml").read_text().replace("shape: [3, 320, 320]", "shape: [3, 256, 256]")
        (model_dir / "config.yaml").write_text(text)
    cfg = tmp_path / "p.yaml"
    cfg.write_text(SQUARES.format(models=repo))
    proc = run_cli("run", str(cfg), "--source", "test://?frames=3", "--nats", nats_server.url)
    # Refused before anything starts, as validate refuses it (exit 2, the config's problem).
    assert proc.returncode == 2, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if "squares" in line]
    assert lines, proc.stderr
    assert any(expected in line for line in lines), proc.stderr
    assert "Traceback" not in proc.stderr


def test_an_unknown_model_lists_what_the_repository_has(tmp_path: Path, sample_models: Path) -> None:
    cfg = tmp_path / "p.yaml"
    cfg.write_text(SQUARES.format(models=sample_models).replace("model: squares", "model: yolo9000"))
    proc = run_cli("run", str(cfg), "--source", "test://?frames=3")
    assert proc.returncode == 2
    assert proc.stdout == ""  # refused before the embedded NATS server starts
    assert "model 'yolo9000' is not in the repository" in proc.stderr
    assert "ppocr_cls, ppocr_det, ppocr_rec, squares" in proc.stderr


def test_device_auto_on_a_machine_without_a_gpu_says_why_and_runs_on_the_cpu(
    tmp_path: Path, squares_config: Path, nats_server: EmbeddedNats
) -> None:
    from inference.device import gpu_available

    ok, reason = gpu_available()
    if ok:
        pytest.skip("this machine has a GPU")
    auto_cfg = tmp_path / "auto.yaml"
    auto_cfg.write_text(squares_config.read_text() + "runtime: {device: auto}\n")
    proc = run_cli("run", str(auto_cfg), "--source", "test://?frames=3", "--nats", nats_server.url)
    assert proc.returncode == 0, proc.stderr
    assert f"runtime.device auto: using the CPU ({reason})" in proc.stderr


def test_gpu_device_or_decoder_on_a_machine_without_one_is_named(
    tmp_path: Path, squares_config: Path, nats_server: EmbeddedNats
) -> None:
    from inference.device import gpu_available

    ok, reason = gpu_available()
    if ok:
        pytest.skip("this machine has a GPU")
    gpu_cfg = tmp_path / "gpu.yaml"
    gpu_cfg.write_text(squares_config.read_text() + "runtime: {device: gpu}\n")
    proc = run_cli("run", str(gpu_cfg), "--source", "test://?frames=3", "--nats", nats_server.url)
    assert proc.returncode == 1
    assert f"runtime.device: gpu is not usable here ({reason}); use device: cpu or auto" in proc.stderr

    clip = write_clip(tmp_path / "nv.mp4", frames=5, fps=5)
    nv_cfg = tmp_path / "nv.yaml"
    nv_cfg.write_text(
        squares_config.read_text()
        + f"sources:\n  - {{url: {clip}, decode: cuda}}\n  - {{url: {clip}, id: soft, decode: auto}}\n"
    )
    proc = run_cli("run", str(nv_cfg), "--nats", nats_server.url)
    assert proc.returncode == 0, proc.stderr
    (line,) = error_lines(proc.stderr, "source nv:")
    assert "decode: cuda is not possible" in line
    # decode: auto falls back to software and publishes every frame.
    assert "done: 5 frame(s) published from 2 source(s); failed: nv" in proc.stderr
