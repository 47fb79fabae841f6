"""CLI behaviour not covered elsewhere: model listing and structured logs."""

from __future__ import annotations

import json
from pathlib import Path

from pipeline.nats_server import EmbeddedNats
from tests.conftest import ROOT, run_cli


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
    # Events, not frames: a few lines for a whole run.
    assert len(records) < 30
