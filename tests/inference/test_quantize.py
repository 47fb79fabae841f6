"""INT8 with NNCF: the shipped PP-OCR text detector calibrated on a rendered clip, checked, written or refused."""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
from pathlib import Path

import av
import numpy as np
import pytest

from inference.model import ModelState
from inference.quantize import (
    Agreement,
    QuantizeRefused,
    compare_results,
    crops_from,
    quantize_model,
    read_frames,
    split_frames,
)
from inference.repository import ModelRepository
from inference.results import Detection, Recognition
from samples.make_clip import Plate, write_clip
from tests.conftest import run_cli

pytest.importorskip("nncf")

ROOT = Path(__file__).resolve().parents[2]
PLATES = (
    Plate("KA05 MX2231", start=0, y=70, x=60),
    Plate("GATE B7", start=0, y=200, x=300),
    Plate("VIDPIPE 42", start=0, y=130, speed=9.0),
)


WHEEL_FILES = {
    "ppocr_det": "ch_PP-OCRv4_det_infer.onnx",
    "ppocr_cls": "ch_ppocr_mobile_v2.0_cls_infer.onnx",
    "ppocr_rec": "ch_PP-OCRv4_rec_infer.onnx",
}


def det_repo(tmp_path: Path, *names: str) -> Path:
    """A repository with PP-OCR det (and ``names``) as version 1 (ONNX files from the rapidocr wheel)."""
    import rapidocr_onnxruntime

    repo = tmp_path / "models"
    for name in ("ppocr_det", *names):
        wheel = Path(rapidocr_onnxruntime.__file__).parent / "models" / WHEEL_FILES[name]
        (repo / name / "1").mkdir(parents=True)
        shutil.copyfile(wheel, repo / name / "1" / "model.onnx")
        text = (ROOT / "samples" / "models" / name / "config.yaml").read_text()
        text = text.replace(
            f"{{package: rapidocr_onnxruntime, path: models/{WHEEL_FILES[name]}}}", "{path: model.onnx}"
        )
        (repo / name / "config.yaml").write_text(text)
    return repo


def plate_clip(tmp_path: Path, frames: int = 12) -> Path:
    return write_clip(tmp_path / "plates.mp4", frames=frames, fps=15, plates=PLATES)


def decoded(path: Path) -> list[np.ndarray]:
    with av.open(str(path)) as container:
        return [f.to_ndarray(format="rgb24") for f in container.decode(video=0)]


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def box(x1: float, y1: float, x2: float, y2: float, class_id: int = 0) -> Detection:
    return Detection((x1, y1, x2, y2), 0.9, class_id, "text")


def test_agreement_pairs_boxes_at_iou_0_7_of_the_same_class_and_counts_frames() -> None:
    reference = [[box(0, 0, 10, 10), box(20, 20, 30, 30)], [box(0, 0, 10, 10)]]
    # Frame 1: one box moved a little (IoU 0.81), one moved too far (IoU 0.54); frame 2: an extra box.
    candidate = [[box(1, 0, 11, 10), box(23, 23, 33, 33)], [box(0, 0, 10, 10), box(50, 50, 60, 60)]]
    a = compare_results(reference, candidate)
    assert (a.boxes_float, a.boxes_int8, a.boxes_matched) == (3, 4, 2)
    assert a.box_agreement == pytest.approx(4 / 7)
    assert a.count_agreement == 0.5
    assert a.score == 0.5
    other_class = compare_results([[box(0, 0, 10, 10)]], [[box(0, 0, 10, 10, class_id=1)]])
    assert other_class.boxes_matched == 0
    text = compare_results(
        [Recognition("GATE B7", 0.9), Recognition("EXIT 12", 0.9)],
        [Recognition("GATE B7", 0.8), Recognition("EXIT 1Z", 0.9)],
    )
    assert (text.kind, text.equal, text.score) == ("text", 1, 0.5)


def test_every_fourth_frame_is_held_out() -> None:
    frames = [np.full((2, 2, 3), i, np.uint8) for i in range(8)]
    calib, held = split_frames(frames)
    assert [int(f[0, 0, 0]) for f in held] == [3, 7]
    assert [int(f[0, 0, 0]) for f in calib] == [0, 1, 2, 4, 5, 6]


def test_frames_come_from_every_source_in_turn_every_kth_and_scaled_down(demo_clip: Path) -> None:
    frames = read_frames([str(demo_clip), str(demo_clip)], 10, every=3, max_side=320)
    assert len(frames) == 10
    assert {f.shape for f in frames} == {(180, 320, 3)}
    # Five from each source, the 0th, 3rd, 6th, ... frame: the two halves are the same frames.
    assert all(np.array_equal(a, b) for a, b in zip(frames[:5], frames[5:], strict=True))
    assert not np.array_equal(frames[0], frames[1])


def test_quantize_refuses_bad_arguments_and_unreadable_sources(tmp_path: Path) -> None:
    repo = det_repo(tmp_path)
    proc = run_cli(
        "models", "quantize", "ppocr_det", "--repo", str(repo), "--from", "x.mp4", "--min-agreement", "0"
    )
    assert (proc.returncode, proc.stderr.strip()) == (2, "--min-agreement: must be in (0, 1]")
    # A file is opened before anything runs: missing, or not a video, is a usage error (exit 2)
    # naming --from and the file, with FFmpeg's words but not its error code.
    missing = tmp_path / "missing.mp4"
    text = tmp_path / "notes.mp4"
    text.write_text("not a video\n")
    video = "give a video file (mp4, mkv, ...)"
    for source, problem, hint in (
        (missing, "file not found", "check the path; relative paths start at the current folder"),
        (text, "not a video file FFmpeg can read (Invalid data found when processing input)", video),
        (tmp_path, "is a folder, not a video file", video),
    ):
        proc = run_cli("models", "quantize", "ppocr_det", "--repo", str(repo), "--from", str(source))
        assert (proc.returncode, proc.stdout) == (2, "")
        assert proc.stderr == f"--from: {source}: {problem} (hint: {hint})\n"
    assert sorted(p.name for p in (repo / "ppocr_det").iterdir()) == ["1", "config.yaml"]


def test_quantize_checks_the_model_and_the_sources_before_reading_a_frame(
    tmp_path: Path, sample_models: Path, demo_clip: Path
) -> None:
    repo = tmp_path / "repo"
    shutil.copytree(sample_models / "squares", repo / "squares")
    proc = run_cli("models", "quantize", "squres", "--repo", str(repo), "--from", str(demo_clip))
    assert (proc.returncode, proc.stdout) == (2, "")
    assert proc.stderr == f"{repo}: no model 'squres' in this repository (hint: did you mean 'squares'?)\n"
    for url, scheme in (("test://?width=640&height=360&fps=25", "test"), ("whip://cam1", "whip")):
        proc = run_cli("models", "quantize", "squares", "--repo", str(repo), "--from", url)
        assert (proc.returncode, proc.stdout) == (2, "")
        assert proc.stderr == (
            f"--from: {url}: quantize reads video files and rtsp, http, udp, rtp and srt streams; "
            f"{scheme}:// is not supported (hint: record a clip from it and give the file)\n"
        )
    # A served version that is INT8 already (quantize.txt beside its file) is refused before any frame.
    (repo / "squares" / "quantize.txt").write_text("to roll back: set model_file: {path: float.onnx}\n")
    proc = run_cli("models", "quantize", "squares", "--repo", str(repo), "--from", "udp://127.0.0.1:9")
    assert (proc.returncode, proc.stdout) == (1, "")
    assert proc.stderr == (
        f"vidpipe: model squares: version None is already INT8 ({repo / 'squares' / 'quantize.txt'}); "
        "quantize the float model: set model_file: {path: float.onnx}\n"
    )


def test_quantize_warns_when_the_sources_end_before_the_frames_asked(
    tmp_path: Path, sample_models: Path
) -> None:
    repo = tmp_path / "repo"
    shutil.copytree(sample_models / "squares", repo / "squares")
    clip = write_clip(tmp_path / "short.mp4", frames=2, width=320, height=180)
    proc = run_cli("models", "quantize", "squares", "--repo", str(repo), "--from", str(clip), "--every", "1")
    assert proc.stdout == "2 frame(s) from 1 source(s)\n"
    warning, error = proc.stderr.splitlines()
    assert warning == (
        "vidpipe: warning: read 2 of 300 frames: the source ended; the check rests on 0 frame(s) "
        "(give a longer clip, more sources or a smaller --every)"
    )
    assert error.startswith("vidpipe: model squares: 2 frame(s) are too few")
    assert proc.returncode == 1


def test_crops_of_must_name_a_detector_and_a_crop_reader_is_told_to_give_one(tmp_path: Path) -> None:
    repo = det_repo(tmp_path, "ppocr_cls")
    clip = write_clip(tmp_path / "short.mp4", frames=2, width=320, height=180)
    args = ("models", "quantize", "ppocr_cls", "--repo", str(repo), "--from", str(clip))
    proc = run_cli(*args, "--crops-of", "ppocr_cls")
    assert (proc.returncode, proc.stdout) == (2, "")
    assert proc.stderr == (
        "--crops-of: ppocr_cls: a classify model finds no objects to crop "
        "(hint: name a detector: a model of task kind yolo or text_detect)\n"
    )
    proc = run_cli(*args, "--crops-of", "ppocr_dt")
    assert (proc.returncode, proc.stdout) == (2, "")
    assert (
        proc.stderr == f"{repo}: no model 'ppocr_dt' in this repository (hint: did you mean 'ppocr_det'?)\n"
    )
    # Without --crops-of, a classifier is quantized on whole frames, with a warning first.
    proc = run_cli(*args, "--every", "1")
    assert proc.stderr.splitlines()[0] == (
        "vidpipe: warning: ppocr_cls is a classify model: in a pipeline it reads crops of a detector's "
        "objects, not whole frames; calibrated on whole frames, its INT8 ranges and its check are not "
        "those of the crops (give --crops-of DETECTOR)"
    )
    assert proc.returncode == 1  # two frames are too few


def test_the_way_back_names_every_key_the_int8_config_changes(tmp_path: Path) -> None:
    from inference.quantize import _rewrite_config
    from inference.repository import read_source

    repo = det_repo(tmp_path)
    config = repo / "ppocr_det" / "config.yaml"
    # As `vidpipe tune` may leave it: another runtime, with its own options.
    config.write_text(
        config.read_text()
        .replace("backend: openvino", "backend: onnxruntime")
        .replace(
            "backend_options: {precision: auto, static_batch_sizes: [1]}",
            "backend_options: {intra_op_threads: 1}",
        )
    )
    text, changes, rollback = _rewrite_config(read_source(repo, "ppocr_det"), 2)
    assert rollback == (
        "set version: 1 and model_file: {path: model.onnx}, backend: onnxruntime and its backend_options; "
        "or copy 2/config.before.yaml (the previous config with version: 1 pinned) over config.yaml"
    )
    assert changes[:2] == [
        "backend: onnxruntime -> openvino",
        "backend_options: removed (they were the previous runtime's)",
    ]
    assert text.splitlines()[1:3] == config.read_text().splitlines()[:2]  # its own comments stay


def test_the_saved_config_serves_the_float_model_again_when_copied_back(
    tmp_path: Path, sample_models: Path
) -> None:
    """The rollback the header names (copy N/config.before.yaml over config.yaml) serves the float
    model although the INT8 version folder is now the highest: as `models add` writes a config,
    no version is pinned, and a model file beside config.yaml is looked for in the INT8 folder."""
    from inference.model import resolve_model_file
    from inference.quantize import BEFORE_FILE, _before_text
    from inference.repository import read_source

    repo = det_repo(tmp_path)
    shutil.copytree(sample_models / "squares", repo / "squares")
    # A config that pins its version is kept as it was.
    pinned = repo / "ppocr_cls"
    shutil.copytree(repo / "ppocr_det", pinned)
    (pinned / "config.yaml").write_text(
        (pinned / "config.yaml").read_text().replace("name: ppocr_det", "name: ppocr_cls\nversion: 1")
    )
    assert _before_text(read_source(repo, "ppocr_cls"), 2) == (pinned / "config.yaml").read_text()
    for name, version, float_file in (
        ("ppocr_det", 2, repo / "ppocr_det" / "1" / "model.onnx"),
        ("squares", 1, repo / "squares" / "model.onnx"),
    ):
        source = read_source(repo, name)
        text = _before_text(source, version)
        int8 = repo / name / str(version)
        int8.mkdir()
        (int8 / "model.xml").write_text("<net/>")
        (int8 / BEFORE_FILE).write_text(text)
        # The INT8 config.yaml serves version N; copied back, the saved one serves the float file.
        shutil.copyfile(int8 / BEFORE_FILE, repo / name / "config.yaml")
        back = read_source(repo, name)
        assert resolve_model_file(back.config, back.model_dir, back.version_dir).resolve() == float_file
        assert text.startswith(f"# The config.yaml that INT8 version {version} replaced, with ")


@pytest.mark.slow
def test_quantize_writes_the_int8_detector_as_the_next_version_and_keeps_the_float_one(
    tmp_path: Path,
) -> None:
    repo = det_repo(tmp_path)
    clip = plate_clip(tmp_path)
    float_file = repo / "ppocr_det" / "1" / "model.onnx"
    before = digest(float_file)
    original = (repo / "ppocr_det" / "config.yaml").read_text()
    # --repo relative to the working directory, as a user types it.
    proc = run_cli(
        "models", "quantize", "ppocr_det", "--repo", os.path.relpath(repo, ROOT), "--from", str(clip),
        "--frames", "12", "--every", "1", timeout=170,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "12 frame(s) from 1 source(s)" in proc.stdout
    assert "INT8 version 2 written" in proc.stdout
    assert "calibrated on 9 frame(s)" in proc.stdout
    # Three held-out frames, each with the two standing plates (and the moving one once it is in).
    assert "per-frame counts equal on 1.000 of 3 frames" in proc.stdout
    assert "box agreement 1.000" in proc.stdout
    assert (
        "to roll back: set version: 1 and model_file: {path: model.onnx}; or copy 2/config.before.yaml "
        "(the previous config with version: 1 pinned) over config.yaml"
    ) in proc.stdout
    v2 = repo / "ppocr_det" / "2"
    assert sorted(p.name for p in v2.iterdir()) == [
        "config.before.yaml", "model.bin", "model.xml", "quantize.txt",
    ]  # fmt: skip
    # The whole way back: the file as it was, with the float version it served pinned.
    kept = (v2 / "config.before.yaml").read_text().splitlines()
    assert [line for line in kept if not line.startswith(("# The config.yaml", "version: 1 "))] == (
        original.splitlines()
    )
    assert digest(float_file) == before
    config = (repo / "ppocr_det" / "config.yaml").read_text()
    assert "model_file: {path: model.xml}" in config
    assert config.startswith("# INT8 version 2 written by `vidpipe models quantize`")
    # The file's own header comments stay, under the new first line.
    header = [line for line in original.splitlines() if line.startswith("#")][:2]
    assert config.splitlines()[1 : 1 + len(header)] == header
    # The rest of the file is as it was: comments and options kept.
    assert "# pixel probability threshold" in config
    assert "backend_options: {precision: auto, static_batch_sizes: [1]}" in config

    # The repository serves version 2 and it finds the plates' text.
    async def load() -> tuple[ModelState, int | None, int]:
        models = ModelRepository(repo)
        status = await models.load("ppocr_det")
        found = await models.get("ppocr_det").infer(decoded(clip)[5])
        await models.close()
        return status.state, status.version, len(found)  # type: ignore[arg-type]

    import asyncio

    state, version, boxes = asyncio.run(load())
    assert (state, version) == (ModelState.READY, 2)
    assert boxes >= 2

    # Quantizing the INT8 version again is refused: it says how to get back to the float one.
    again = run_cli(
        "models", "quantize", "ppocr_det", "--repo", str(repo), "--from", str(clip), "--frames", "8"
    )
    assert again.returncode == 1
    assert "version 2 is already INT8" in again.stderr
    assert "set version: 1 and model_file: {path: model.onnx}" in again.stderr


@pytest.mark.slow
def test_quantize_refuses_a_model_that_fails_its_check_and_writes_nothing(tmp_path: Path) -> None:
    repo = det_repo(tmp_path)
    clip = plate_clip(tmp_path, frames=8)
    frames = decoded(clip)
    config_before = (repo / "ppocr_det" / "config.yaml").read_text()
    # Calibrated on black frames, the INT8 ranges cannot hold what text frames produce.
    black = [np.zeros_like(frames[0]) for _ in range(4)]
    handlers = {h: h.level for h in logging.getLogger().handlers}
    with pytest.raises(QuantizeRefused) as refused:
        quantize_model(repo, "ppocr_det", black, held_out=frames[::3])
    # NNCF quiets its own logger, never the application's handlers.
    assert {h: h.level for h in logging.getLogger().handlers} == handlers
    agreement: Agreement = refused.value.agreement
    assert agreement.score < 0.95
    assert agreement.boxes_float >= 6
    message = str(refused.value)
    assert f"agrees with the float model at {agreement.score:.3f}, below the threshold 0.95" in message
    assert "nothing was written" in message
    assert sorted(p.name for p in (repo / "ppocr_det").iterdir()) == ["1", "config.yaml"]
    assert (repo / "ppocr_det" / "config.yaml").read_text() == config_before


@pytest.mark.slow
def test_a_classifier_is_calibrated_and_checked_on_the_crops_of_its_detector(tmp_path: Path) -> None:
    repo = det_repo(tmp_path, "ppocr_cls")
    clip = plate_clip(tmp_path)
    frames = decoded(clip)
    calib, held = split_frames(frames)
    # What the pipeline would feed the classifier: each plate's text line, warped upright.
    crops = crops_from(repo, "ppocr_det", calib)
    assert len(crops) >= 2 * len(calib)  # two standing plates a frame, and the moving one once in
    assert all(c.shape[0] < 60 and c.shape[1] < 320 for c in crops)  # text lines, not frames
    proc = run_cli(
        "models", "quantize", "ppocr_cls", "--repo", str(repo), "--from", str(clip),
        "--frames", "12", "--every", "1", "--crops-of", "ppocr_det", timeout=170,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "warning" not in proc.stderr
    held_crops = len(crops_from(repo, "ppocr_det", held))
    assert f"(calibrated on {len(crops)} crop(s) of ppocr_det's objects)" in proc.stdout
    assert f"check: label equal on {held_crops} of {held_crops} crops (1.000)" in proc.stdout
    report = (repo / "ppocr_cls" / "2" / "quantize.txt").read_text().splitlines()
    assert (
        report[0]
        == f"INT8 by NNCF from model.onnx, calibrated on {len(crops)} crop(s) of ppocr_det's objects"
    )
    assert report[1].startswith(f"checked on {held_crops} held-out crop(s) of ppocr_det's objects: ")


@pytest.mark.slow
def test_ctrl_c_while_calibrating_writes_nothing_and_exits_130(tmp_path: Path) -> None:
    import signal

    from tests.pipeline.test_cli_interrupt import _start

    repo = det_repo(tmp_path, "ppocr_cls")
    config = repo / "ppocr_cls" / "config.yaml"
    before = config.read_bytes()
    clip = plate_clip(tmp_path)
    proc = _start(
        "models", "quantize", "ppocr_cls", "--repo", str(repo), "--from", str(clip),
        "--frames", "12", "--every", "1", "--crops-of", "ppocr_det",
    )  # fmt: skip
    try:
        assert proc.stderr is not None
        while "ppocr_cls: calibrating on" not in (line := proc.stderr.readline()):
            assert line, "quantize ended before it calibrated"
        os.killpg(proc.pid, signal.SIGINT)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, err
    assert err.splitlines()[-1] == (
        f"vidpipe models quantize: interrupted; nothing was written ({config} unchanged)"
    )
    assert config.read_bytes() == before
    assert sorted(p.name for p in (repo / "ppocr_cls").iterdir()) == ["1", "config.yaml"]
