"""Pipeline config validation: every error names FILE:LINE, the key and the problem."""

from __future__ import annotations

import dataclasses
import json
import math
import re
import textwrap
from pathlib import Path
from typing import Any

import nats
import pytest
import yaml

from inference.schema import ConfigError
from pipeline import Pipeline
from pipeline.config import SourcePolicy, SourceRefused, load_config, parse_source
from pipeline.fleet.buckets import open_bucket
from pipeline.fleet.desired import decode_source, encode_source
from pipeline.fleet.worker import FleetWorker
from pipeline.nats_server import EmbeddedNats
from pipeline.redact import redact_url
from pipeline.runtime import Runtime
from pipeline.urls import v4l2_device
from tests.conftest import ROOT, run_cli
from tests.pipeline.stack import Stack, until
from tests.support.raw_rtsp import RawListener

GOOD = """\
pipeline: shop
models: models
sources:
  - url: test://?frames=3
stages:
  - {name: det, type: infer, model: squares}
"""

BROKEN = [
    pytest.param("pipeline: [oops\n", 1, "invalid YAML", id="yaml-syntax"),
    pytest.param("pipeline: a\n  sources: 1\n", 2, "invalid YAML", id="bad-indent"),
    pytest.param(GOOD + "extra: 1\n", 7, "extra: unknown key", id="unknown-top-key"),
    pytest.param(GOOD.replace("url: test://?frames=3", "urll: test://x"), 4,
                 "sources[0].urll: unknown key (hint: did you mean 'url'?)", id="typo-key"),
    pytest.param(GOOD.replace("type: infer", "type: detect"), 6,
                 "stages[0].type: expected one of 'infer', 'track', 'zones', got 'detect'", id="unknown-stage-type"),
    pytest.param(GOOD.replace("- url: test://?frames=3", "- url: test://?frames=3\n    queue_size: lots"), 5,
                 "sources[0].queue_size: expected an integer, got 'lots'", id="wrong-type"),
    pytest.param(GOOD.replace("- url: test://?frames=3", "- url: test://?frames=3\n    queue_size: 0"), 5,
                 "sources[0].queue_size: must be at least 1, got 0", id="out-of-range"),
    pytest.param(GOOD.replace("test://?frames=3", "ftp://host/x.mp4"), 4,
                 "unsupported source scheme 'ftp'", id="bad-scheme"),
    pytest.param(GOOD.replace("pipeline: shop", "pipeline: my shop"), 1,
                 "pipeline: 'my shop' is not a valid name", id="bad-name"),
    pytest.param(GOOD + "  - {name: det, type: track}\n", 7,
                 "stages[1].name: duplicate stage name 'det'", id="duplicate-stage"),
    pytest.param(GOOD + "  - {name: cls, type: infer, model: c, on: nope}\n", 7,
                 "stages[1].on: unknown stage 'nope'", id="unknown-on"),
    pytest.param(GOOD.replace("  - {name: det, type: infer, model: squares}",
                              "  - {name: cls, type: infer, model: c, on: det}\n"
                              "  - {name: det, type: infer, model: squares}"), 6,
                 "move it after the stage it refers to", id="on-later-stage"),
    pytest.param(GOOD.replace("model: squares", "model: squares, confidence: 1.5"), 6,
                 "stages[0].confidence: must be at most 1, got 1.5", id="confidence-range"),
    pytest.param(GOOD.replace("{name: det, type: infer, model: squares}", "{name: det, type: infer}"), 6,
                 "stages[0].type: an infer stage needs 'model'", id="infer-without-model"),
    pytest.param(GOOD.replace("models: models\n", ""), 1,
                 "models: infer stages need a model repository", id="no-repository"),
    pytest.param("- just\n- a list\n", 1, "expected a mapping at the top level", id="top-level-list"),
    pytest.param(GOOD + "sources: []\n", 7, "duplicate key 'sources'", id="duplicate-key"),
    pytest.param(GOOD.replace("- url: test://?frames=3", "- {url: a.mp4, id: cam}\n  - {url: b.mp4, id: cam}"), 5,
                 "sources[1].id: duplicate source id 'cam'", id="duplicate-source-id"),
    pytest.param(GOOD.replace("- url: test://?frames=3", "- {url: 'whip://door'}\n  - {url: 'whip://door', id: back}"),
                 5, "sources[1].url: whip name 'door' is already used by sources[0] (hint: give each WHIP "
                 "source its own name: whip://door, whip://yard)", id="duplicate-whip-name"),
    pytest.param(GOOD + "outputs: [{type: file, path: out.mp4, codec: bogus264}]\n", 7,
                 "outputs[0].codec: FFmpeg has no video encoder 'bogus264' (hint: e.g. libx264 (H.264), "
                 "libx265, mpeg4 or libvpx-vp9)", id="unknown-encoder"),
    pytest.param(GOOD + "nats: {publish: jetstrem}\n", 7,
                 "nats.publish: expected one of 'core', 'jetstream', got 'jetstrem' (hint: did you mean 'jetstream'?)",
                 id="publish-typo"),
    pytest.param(GOOD.replace("pipeline: shop\n", ""), 1, "missing required key 'pipeline'", id="missing-key"),
    # Each stage kind takes its own keys: one that belongs to another kind is an error.
    pytest.param(GOOD + "  - {name: t, type: track,\n     on: det}\n", 8,
                 "stages[1].on: does not apply to a stage of type track (hint: type track takes: name, type, "
                 "tracker, classes, match, iou, low_iou, high_score, low_score, new_score, min_hits, max_age)",
                 id="on-on-track"),
    pytest.param(GOOD.replace("model: squares", "model: squares, iou: 0.5"), 6,
                 "stages[0].iou: does not apply to a stage of type infer", id="iou-on-infer"),
    pytest.param(GOOD.replace("model: squares", "model: squares, mdoel: x"), 6,
                 "stages[0].mdoel: unknown key (hint: did you mean 'model'?)", id="stage-key-typo"),
    pytest.param(GOOD + "  - {name: t, type: track, on: det}\n" + "  - {name: c, type: infer, model: c, on: t}\n",
                 7, "does not apply", id="first-error-wins"),
    pytest.param(GOOD + "  - {name: t, type: track}\n  - {name: c, type: infer, model: c, on: t}\n", 8,
                 "stages[2].on: stage 't' is a track stage and finds no objects (hint: an infer stage whose "
                 "model finds objects (a detector); name one of: det)", id="on-a-track-stage"),
    pytest.param(GOOD + "  - {name: t, type: track}\n  - {name: c, type: infer, model: c, on: det, upright_by: t}\n",
                 8, "stages[2].upright_by: stage 't' is a track stage: upright_by names the classifier stage whose "
                 "label says how to turn each crop (hint: a classifier stage with the same on: as this one; name "
                 "one of: det)", id="upright-by-a-track-stage"),
    pytest.param(GOOD.replace("sources:\n  - url: test://?frames=3", "sources: clip.mp4"), 3,
                 "sources: expected a list, got 'clip.mp4' (hint: e.g. sources: [{url: clip.mp4}], or one "
                 "'- url: ...' line per source)", id="sources-not-a-list"),
    pytest.param(GOOD.replace("  - {name: det, type: infer, model: squares}", "  name: det\n  type: track"), 6,
                 "stages: expected a list, got a mapping (hint: e.g. stages: [{name: detect, type: infer, "
                 "model: NAME}], or one '- name: ...' line per stage)", id="stages-not-a-list"),
    pytest.param(GOOD + 'outputs: [{type: file, path: "x/{sourc}.mp4"}]\n', 7,
                 "outputs[0].path: {sourc} is not a placeholder vidpipe fills in (hint: did you mean {source}?)",
                 id="path-placeholder-typo"),
    pytest.param(GOOD.replace("frames=3\n", "frames=3\n  - url: test://?id=b\n")
                 + "outputs:\n  - {type: file, path: rec/all.mp4, sources: [b]}\n  - {type: file, path: rec/all.mp4}\n",
                 10, "outputs[1].path: 2 sources (test, b) would record to the one file 'rec/all.mp4' (hint: put "
                 "{source} in the path, e.g. rec/all-{source}.mp4, or name one source in outputs[1].sources)",
                 id="one-recording-for-several-sources"),
    pytest.param(GOOD + "nats: {subject_prefix: _INBOX}\n", 7,
                 "nats.subject_prefix: _INBOX is where NATS clients receive replies; choose another prefix",
                 id="inbox-prefix"),
    pytest.param(GOOD + 'outputs: [{type: clips, dir: "c/{start}"}]\n', 7,
                 "outputs[0].dir: {start} is not a placeholder vidpipe fills in (hint: it takes {source})",
                 id="clips-dir-placeholder"),
    pytest.param(GOOD.replace("type: infer", "typ: infer"), 6,
                 "stages[0].typ: unknown key (hint: did you mean 'type'?)", id="type-key-typo"),
    pytest.param(GOOD + "outputs:\n  - {tpye: clips, dir: clips/}\n", 8,
                 "outputs[0].tpye: unknown key (hint: did you mean 'type'?)", id="output-type-key-typo"),
    # upright_by reads the classifier's label off the object being cropped: a stage on other objects never sets it.
    pytest.param(GOOD + "  - {name: cls, type: infer, model: c, on: det, upright_by: det}\n", 7,
                 "stages[1].upright_by: stage 'det' runs on whole frames, not on the objects of 'det' this stage "
                 "crops: upright_by needs a classifier stage with on: det", id="upright-by-a-detector"),
]  # fmt: skip


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "pipeline.yaml"
    path.write_text(text)
    return path


@pytest.mark.parametrize(("text", "line", "message"), BROKEN)
def test_broken_config_names_file_line_and_problem(
    tmp_path: Path, text: str, line: int, message: str
) -> None:
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as info:
        load_config(path)
    rendered = str(info.value)
    assert rendered.startswith(f"{path}:{line}: "), rendered
    assert message in rendered


@pytest.mark.parametrize(("text", "line", "message"), BROKEN[:12])
def test_validate_exits_2_with_file_line_errors_and_no_traceback(
    tmp_path: Path, sample_models: Path, text: str, line: int, message: str
) -> None:
    (tmp_path / "models").symlink_to(sample_models)
    path = write(tmp_path, text)
    proc = run_cli("validate", str(path))
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert any(ln.startswith(f"{path}:{line}: ") and message in ln for ln in lines), proc.stderr
    # Model `c` is not in the repository: validate says so too, on its own line.
    assert len(lines) == (2 if "model: c" in text else 1), proc.stderr
    assert all(ln.startswith(f"{path}:") for ln in lines)
    assert "Traceback" not in proc.stderr


def test_source_url_mistakes_each_get_their_own_words(tmp_path: Path, demo_clip: Path) -> None:
    path = tmp_path / "urls.yaml"
    path.write_text(
        "pipeline: shop\nsources:\n"
        '  - url: "test://?width=abc"\n'  # 3: the parameter's own problem, no unrelated example
        "  - url: whip://admin:x@door\n"  # 4
        '  - url: ""\n'  # 5
        f"  - url: {tmp_path}\n"  # 6: a folder
        "  - url: /dev/null\n"  # 7: there, but not a file
        f"  - url: file://localhost{demo_clip}\n"  # 8: RFC 8089: the local file, found
        "  - {url: test://, id: 7}\n"  # 9: YAML read the id as a number
    )
    proc = run_cli("validate", str(path))
    assert proc.returncode == 2
    assert proc.stderr.splitlines() == [
        f"{path}:3: sources[0].url: test:// parameter width='abc' is not a whole number",
        f"{path}:4: sources[1].url: a whip:// URL is whip://<name>: it takes no user or password",
        f"{path}:5: sources[2].url: the URL is empty (hint: e.g. samples/clip.mp4 or rtsp://cam/stream)",
        f"{path}:6: sources[3].url: {tmp_path} is a folder, not a video file (hint: name a file in it)",
        f"{path}:7: sources[4].url: /dev/null is not a regular file "
        "(hint: give a video file; a webcam is /dev/videoN)",
        f'{path}:9: sources[6].id: expected a string, got 7 (hint: write it in quotes: id: "7")',
    ]


def test_a_video_or_a_binary_file_given_as_the_pipeline_says_so(tmp_path: Path, demo_clip: Path) -> None:
    for command in ("run", "validate"):
        proc = run_cli(command, str(demo_clip))
        assert (proc.returncode, proc.stderr) == (
            2,
            f"{demo_clip}: is a video, not a pipeline file "
            f"(hint: run a pipeline on it: vidpipe run configs/demo.yaml --source {demo_clip})\n",
        )
    blob = tmp_path / "pipeline.yaml"
    blob.write_bytes(b"pipeline: x\n\xe0\x00\xff")
    proc = run_cli("validate", str(blob))
    assert (proc.returncode, proc.stderr) == (
        2,
        f"{blob}: not a YAML text file (byte 12 is not UTF-8 text) (hint: is this the right file?)\n",
    )


def test_validate_refuses_outputs_run_cannot_write(tmp_path: Path) -> None:
    (tmp_path / "afile").write_text("")
    path = tmp_path / "o.yaml"
    path.write_text(
        "pipeline: shop\nsources: [{url: test://}]\noutputs:\n"
        '  - {type: file, path: "afile/{source}.mp4"}\n'  # 4: a file where the folder goes
        '  - {type: file, path: "out/{source}"}\n'  # 5: no format to write
        "  - {type: clips, dir: afile/clips}\n"  # 6
        '  - {type: file, path: "out/{source}-{start}.mkv"}\n'  # 7: fine, made at start
    )
    proc = run_cli("validate", str(path))
    assert proc.returncode == 2
    assert proc.stderr.splitlines() == [
        f"{path}:4: outputs[0].path: {tmp_path / 'afile'} is a file, not a folder (hint: choose another folder)",
        f"{path}:5: outputs[1].path: 'out/{{source}}' does not end in a video file extension FFmpeg writes "
        "(hint: end it in one of .mp4, .m4v, .mov, .mkv, .avi, .ts, .flv, .nut, e.g. out/{source}.mp4)",
        f"{path}:6: outputs[2].dir: {tmp_path / 'afile'} is a file, not a folder (hint: choose another folder)",
    ]


def test_validate_good_file_exits_0(tmp_path: Path, sample_models: Path) -> None:
    (tmp_path / "models").symlink_to(sample_models)
    proc = run_cli("validate", str(write(tmp_path, GOOD)))
    assert proc.returncode == 0, proc.stderr
    assert "ok (pipeline shop: 1 source(s), 1 stage(s))" in proc.stdout


def test_a_model_whose_output_its_task_cannot_decode_is_refused_by_validate_and_models_list(
    tmp_path: Path, sample_models: Path
) -> None:
    import shutil

    from inference.repository import describe_repository

    repo = tmp_path / "models"
    shutil.copytree(sample_models / "squares", repo / "squares")
    config = repo / "squares" / "config.yaml"
    # The squares file answers [N, 5, 1] (yolov8); told it is yolov5, every batch would fail.
    config.write_text(config.read_text().replace("layout: yolov8", "layout: yolov5"))
    problem = (
        f"{config}:14: task.layout: output [1, 5, 1] is not yolov5 [N, A, 5+C]: needs at least 6 "
        "channels (hint: the output fits yolov8: set task.layout: yolov8)"
    )
    proc = run_cli("validate", str(write(tmp_path, GOOD)))
    assert (proc.returncode, proc.stderr.strip()) == (2, problem)
    table = describe_repository(repo)
    assert table.unavailable == ["squares"]
    assert table.text.splitlines()[1].split()[:3] == ["squares", "-", "unavailable"]
    assert table.text.strip().splitlines()[-1] == f"squares: {problem}"


def test_validate_refuses_a_model_file_that_is_not_onnx_or_an_input_it_does_not_fit(
    tmp_path: Path, sample_models: Path
) -> None:
    # Both passed validate, and run refused them.
    import shutil

    repo = tmp_path / "models"
    shutil.copytree(sample_models / "squares", repo / "squares")
    config = repo / "squares" / "config.yaml"
    good = config.read_text()
    config.write_text(good.replace("shape: [3, 320, 320]", "shape: [3, 640, 640]"))
    proc = run_cli("validate", str(write(tmp_path, GOOD)))
    assert (proc.returncode, proc.stderr.strip()) == (2, (
        f"{config}:9: input.shape: model.onnx: input tensor 'images' expects items of shape [3, 320, 320] "
        "(C, H, W), but config.yaml has input.shape: [3, 640, 640] (wrong: H, W); set input.shape: [3, 320, 320]"
    ))  # fmt: skip
    config.write_text(good)
    (repo / "squares" / "model.onnx").write_text("this is not ONNX")
    proc = run_cli("validate", str(write(tmp_path, GOOD)))
    assert proc.returncode == 2
    assert proc.stderr.startswith(
        f"{config}:5: model_file: {repo / 'squares' / 'model.onnx'}: not a readable ONNX model"
    )
    assert proc.stderr.strip().endswith("; re-export it")
    # An empty file is a copy cut short, not a model that "declares no inputs".
    (repo / "squares" / "model.onnx").write_bytes(b"")
    proc = run_cli("validate", str(write(tmp_path, GOOD)))
    assert (proc.returncode, proc.stderr.strip()) == (2, (
        f"{config}:5: model_file: {repo / 'squares' / 'model.onnx'}: the file is empty (0 bytes), likely a "
        "copy cut short; copy the model file again"
    ))  # fmt: skip


def test_validate_missing_file_exits_2(tmp_path: Path) -> None:
    proc = run_cli("validate", str(tmp_path / "nope.yaml"))
    assert proc.returncode == 2
    assert proc.stderr.strip() == f"{tmp_path / 'nope.yaml'}: file not found (hint: check the path)"


@pytest.mark.parametrize("path", sorted((ROOT / "configs").glob("*.yaml")), ids=lambda p: p.name)
def test_every_shipped_config_validates(path: Path, tmp_path: Path) -> None:
    # Validation opens what the config names: the model repository and the sample
    # clip `make demo` writes. Lay out a copy where both exist.
    from samples.make_clip import write_clip

    (tmp_path / "configs").mkdir()
    (tmp_path / "samples").mkdir()
    (tmp_path / "samples" / "models").symlink_to(ROOT / "samples" / "models")
    write_clip(tmp_path / "samples" / "generated" / "demo.mp4", frames=2, width=64, height=64)
    copy = tmp_path / "configs" / path.name
    copy.write_text(path.read_text())
    proc = run_cli("validate", str(copy))
    assert proc.returncode == 0, proc.stderr


def test_source_ids_derive_from_urls_and_stay_unique(tmp_path: Path) -> None:
    path = write(tmp_path, GOOD)
    cfg = load_config(
        path, sources=["clips/lobby.mp4", "file:///data/lobby.mp4", "rtsp://u:pw@cam:554/live/door"]
    )
    assert [s.source_id for s in cfg.sources] == ["lobby", "lobby_2", "live_door"]
    # --source paths are relative to the working directory, not to the config file.
    assert cfg.sources[0].url == str((Path.cwd() / "clips/lobby.mp4").resolve())
    assert cfg.sources[1].url == "/data/lobby.mp4"


def test_relative_source_paths_resolve_against_the_config_file(tmp_path: Path) -> None:
    path = write(tmp_path, GOOD.replace("test://?frames=3", "clips/a.mp4"))
    cfg = load_config(path)
    assert cfg.sources[0].url == str(tmp_path / "clips" / "a.mp4")
    assert cfg.sources[0].live is False
    assert cfg.models_path() == tmp_path / "models"


def test_bad_source_flag_is_a_usage_error(tmp_path: Path) -> None:
    proc = run_cli("run", str(write(tmp_path, GOOD)), "--source", "gopher://x")
    assert proc.returncode == 2
    assert proc.stderr.strip().startswith("--source: unsupported source scheme 'gopher'")


def test_credentials_are_redacted() -> None:
    assert redact_url("rtsp://admin:secret@10.0.0.5:554/h264") == "rtsp://***@10.0.0.5:554/h264"
    assert redact_url("rtsp://10.0.0.5/h264") == "rtsp://10.0.0.5/h264"


def test_docstring_example_in_config_module_is_valid(tmp_path: Path) -> None:
    import pipeline.config as module

    doc = module.__doc__ or ""
    example = textwrap.dedent(doc.split("::", 1)[1].split("See docs", 1)[0])
    cfg = load_config(write(tmp_path, example))
    assert cfg.pipeline == "demo" and cfg.stages[0].model == "squares"


def test_exposed_http_without_token_is_refused_before_start(tmp_path: Path) -> None:
    proc = run_cli("run", str(write(tmp_path, GOOD)), "--http", "0.0.0.0:0")
    assert proc.returncode == 2
    assert proc.stderr.strip().startswith("--http: http.listen 0.0.0.0:0 is reachable from other machines")
    assert "Traceback" not in proc.stderr


def test_yaml_1_1_booleans_are_plain_strings(tmp_path: Path) -> None:
    # `on:` is the cascade key; YAML 1.1 would read it (and yes/no/off) as a boolean.
    text = GOOD + "  - {name: cls, type: infer, model: c, on: det}\n"
    cfg = load_config(write(tmp_path, text))
    assert cfg.stages[1].on == "det"
    with pytest.raises(ConfigError, match=r"sources\[0\]\.loop: expected true or false, got 'yes'"):
        load_config(write(tmp_path, GOOD.replace("- url: test://?frames=3", "- {url: a.mp4, loop: yes}")))


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("rtsp://admin:pa#ss@10.0.0.7/stream1", "rtsp://***@10.0.0.7/stream1"),
        ("rtsp://admin:ab/cd@10.0.0.7:554/s", "rtsp://***@10.0.0.7:554/s"),
        ("rtsp://u:p@ss@[fe80::1]:554/x", "rtsp://***@[fe80::1]:554/x"),
        ("nats://user:pw@broker:4222", "nats://***@broker:4222"),
    ],
)
def test_passwords_with_url_delimiters_are_redacted_too(url: str, shown: str) -> None:
    assert redact_url(url) == shown
    # Nor does any part of them end up in a source id (a metric label).
    from pipeline.urls import derive_id

    assert not any(secret in derive_id(url) for secret in ("pa", "ab", "cd", "ss", "pw", "user"))


# -- one source parser behind every door -------------------------------------------------------

# A bad source, the key it is refused at, the problem and the hint, the same at every door.
BAD_SOURCES: list[tuple[dict[str, Any], str, str, str]] = [
    (
        {"url": "clips/a.mp4", "transport": "udp", "allow_redirects": True},
        "transport",
        "does not apply to a file source",
        "a file source takes: url, id, max_fps, queue_size, max_pixels, loop, realtime, decode",
    ),
    ({"url": "rtsp://cam/x", "reconnect": {"min_delay": math.nan}}, "reconnect.min_delay",
     "expected a finite number, got nan", "seconds, at least 0.1"),
    ({"url": "rtsp://cam/x", "reconnect": {"min_delay": math.inf}}, "reconnect.min_delay",
     "expected a finite number, got inf", "seconds, at least 0.1"),
    ({"url": "rtsp://cam/x", "open_timeout": 10**400}, "open_timeout",
     "out of range: an integer of 401 digits (at most ±9,223,372,036,854,775,807)", ""),
    ({"url": "rtsp://cam/x", "stall_timeout": 7200}, "stall_timeout", "must be at most 3600, got 7200.0", ""),
    ({"url": "rstp://cam/x"}, "url", "unsupported source scheme 'rstp' in 'rstp://cam/x'", "did you mean rtsp://?"),
    (
        {"url": "rtsp://admin:p@ss@cam/x"},
        "url",
        "the URL's user or password contains a raw '@'; percent-encode it as %40",
        "e.g. the password p@ss/1 is written rtsp://user:p%40ss%2F1@cam/stream",
    ),
    (
        {"url": "rtsp://admin:secret@[::1/x"},
        "url",
        "the URL's host and port '[::1' are malformed",
        "write HOST, HOST:PORT or [IPv6]:PORT with a port of 1-65535",
    ),
    (
        {"url": "rtsp://admin:secret@cam:554554/x"},
        "url",
        "the URL's host and port 'cam:554554' are malformed",
        "write HOST, HOST:PORT or [IPv6]:PORT with a port of 1-65535",
    ),
    ({"url": "http://admin:secret@/x.mjpg"}, "url", "the http:// URL names no host",
     "e.g. http://192.168.1.20/video.mjpg"),
    ({"url": "test://?width=3"}, "url", "test:// parameter width=3 is out of range", "use 16-7680"),
    ({"url": "test://?fps=nan"}, "url", "test:// parameter fps='nan' is out of range",
     "use a number in (0, 240]"),
    ({"url": "test://?widht=64"}, "url", "unknown test:// parameter 'widht'", "did you mean width?"),
    ({"url": "test://?fps=5&width=64&fps=10"}, "url", "test:// parameter 'fps' is given twice", "keep one"),
    (
        {"url": "udp://127.0.0.1:14620?fifo_size=5000000"},
        "url",
        "udp:// URL option 'fifo_size' is not allowed",
        "a udp:// URL takes localaddr, sources, block; vidpipe sets FFmpeg's buffers and timeouts itself",
    ),
]  # fmt: skip

_API_ERROR = re.compile(r"sources\.(?P<key>\S+): (?P<problem>.*?)(?: \(hint: (?P<hint>.*)\))?")


def _json(data: dict[str, Any]) -> str:
    # JSON has no infinity; 1e999 is how one arrives (Python reads it as inf).
    return json.dumps(data).replace("Infinity", "1e999")


def _first(exc: ConfigError, prefix: str) -> tuple[str, str, str]:
    first = exc.errors[0]
    assert first.path.startswith(prefix), first
    return first.path.removeprefix(prefix), first.problem, first.hint


async def test_a_bad_source_is_refused_alike_at_every_door(tmp_path: Path, nats_server: EmbeddedNats) -> None:
    """A config file, POST /v1/sources on a live server, embedding and the fleet's store."""
    http = "{listen: '127.0.0.1:0', file_roots: [clips]}"
    stack = await Stack.start(
        tmp_path, f"pipeline: doors\nnats: {{url: '{nats_server.url}'}}\nhttp: {http}\n", nats_server.url
    )
    nc = await nats.connect(nats_server.url)
    try:
        kv = await open_bucket(nc.jetstream(), "doors", "sources")
        async with Pipeline.from_dict({"pipeline": "embedded"}, keep_running=True) as pipe:
            for i, (data, key, problem, hint) in enumerate(BAD_SOURCES):
                seen: dict[str, tuple[str, str, str]] = {}
                text = yaml.safe_dump({"pipeline": "doors", "sources": [data]}, sort_keys=False)
                with pytest.raises(ConfigError) as info:
                    load_config(write(tmp_path, text))
                seen["yaml"] = _first(info.value, "sources[0].")
                # FILE:LINE names the key's own line.
                leaf = key.rsplit(".", 1)[-1]
                lines = text.splitlines()
                line = next(n for n, t in enumerate(lines, 1) if t.strip(" -").startswith(f"{leaf}:"))
                assert info.value.errors[0].line == line, text

                status, body = await stack.json(
                    "POST", "/v1/sources", data=_json(data), headers={"Content-Type": "application/json"}
                )
                if "NaN" in _json(data):
                    # JSON has no NaN: the API's JSON reader refuses it before any source is parsed.
                    refused = f"body: not valid JSON (NaN is not allowed, at {key})"
                    assert (status, body) == (400, {"error": refused})
                else:
                    assert status == 400, body
                    match = _API_ERROR.fullmatch(body["error"])
                    assert match is not None, body
                    seen["api"] = (match["key"], match["problem"], match["hint"] or "")

                with pytest.raises(ConfigError) as info:
                    pipe.add_source(**data)
                seen["embedding"] = _first(info.value, "sources.")

                await kv.put(f"bad{i}", _json(data).encode())
                entry = await kv.get(f"bad{i}")
                assert entry.value is not None
                with pytest.raises(ConfigError) as info:
                    decode_source(f"bad{i}", entry.value)
                seen["fleet"] = _first(info.value, f"sources.bad{i}.")

                assert seen == dict.fromkeys(seen, (key, problem, hint)), data
            assert pipe.runtime.sources == {}
        assert stack.runtime.sources == {}
    finally:
        await nc.close()
        await stack.close()


async def test_api_and_fleet_store_keep_files_to_the_file_roots(
    tmp_path: Path, nats_server: EmbeddedNats
) -> None:
    (tmp_path / "clips").mkdir()
    inside, outside = tmp_path / "clips" / "a.mp4", tmp_path / "b.mp4"
    http = "{listen: '127.0.0.1:0', file_roots: [clips], source_schemes: [file, rtsp]}"
    stack = await Stack.start(
        tmp_path, f"pipeline: roots\nnats: {{url: '{nats_server.url}'}}\nhttp: {http}\n", nats_server.url
    )
    nc = await nats.connect(nats_server.url)
    try:
        kv = await open_bucket(nc.jetstream(), "roots", "sources")
        policy = SourcePolicy.from_http(stack.runtime.config.http, stack.runtime.config.base_dir)
        refused = "files can be added over the API only from the folders in http.file_roots"
        for data, problem in [
            ({"url": str(outside)}, refused),
            ({"url": "clips/../b.mp4"}, refused),
            ({"url": "test://"}, "test:// sources cannot be added over the API (http.source_schemes allows: file, rtsp)"),
        ]:  # fmt: skip
            status, body = await stack.json("POST", "/v1/sources", json=data)
            assert (status, body) == (403, {"error": f"sources.url: {problem}"})
            await kv.put("src", json.dumps(data).encode())
            entry = await kv.get("src")
            assert entry.value is not None
            with pytest.raises(SourceRefused) as info:
                decode_source("src", entry.value, policy, stack.runtime.config.base_dir)
            assert (info.value.path, info.value.problem) == ("sources.src.url", problem)
        # Inside the roots, both doors take the file, resolved against the config's folder.
        await kv.put("a", json.dumps({"url": "clips/a.mp4"}).encode())
        entry = await kv.get("a")
        assert entry.value is not None
        stored = decode_source("a", entry.value, policy, stack.runtime.config.base_dir)
        assert (stored.url, stored.id, stored.live) == (str(inside), "a", False)
        # A config file is trusted with any path.
        cfg = load_config(write(tmp_path, f"pipeline: p\nsources:\n  - url: {outside}\n"))
        assert cfg.sources[0].url == str(outside)
    finally:
        await nc.close()
        await stack.close()


def test_stored_sources_round_trip_without_keys_of_other_schemes(tmp_path: Path) -> None:
    # The store kept every field; a file source came back with transport: tcp, a key of RTSP.
    file_source = parse_source({"url": "clips/a.mp4", "loop": True}, base_dir=tmp_path)
    camera = parse_source(
        {"url": "rtsp://cam/x", "transport": "udp", "reconnect": {"min_delay": 2}}, base_dir=tmp_path
    )
    stream = parse_source({"url": "https://cdn/live.mp4", "live": True}, base_dir=tmp_path)
    for config in (file_source, camera, stream):
        encoded = encode_source(config)
        assert decode_source(config.source_id, encoded, SourcePolicy(), str(tmp_path)) == config
    assert json.loads(encode_source(file_source)) == {
        "url": str(tmp_path / "clips" / "a.mp4"),
        "id": "a",
        "loop": True,
    }
    # What older workers stored (every field) still reads back.
    old = json.dumps(dataclasses.asdict(file_source)).encode()
    assert decode_source("a", old, SourcePolicy(), str(tmp_path)) == file_source


def test_source_ids_avoid_the_taken_ones_and_ids_the_file_gives_later(tmp_path: Path) -> None:
    text = "pipeline: p\nsources:\n  - url: clips/lobby.mp4\n  - {url: test://, id: lobby}\n  - url: other/lobby.mp4\n"
    cfg = load_config(write(tmp_path, text))
    assert [s.source_id for s in cfg.sources] == ["lobby_2", "lobby", "lobby_3"]
    assert (
        parse_source({"url": "rtsp://cam/door"}, base_dir=tmp_path, taken_ids={"door", "door_2"}).id
        == "door_3"
    )


def test_webcam_paths_are_normalised_before_the_scheme_check(tmp_path: Path) -> None:
    for written in ("/dev/./video0", "/dev/video0/", "/dev//video0", "v4l2:///dev/./video0"):
        text = f"pipeline: p\nsources:\n  - url: {written}\n"
        try:
            cfg = load_config(write(tmp_path, text))
        except ConfigError as exc:
            # Without libavdevice the webcam is refused as such, in one line, not as a file.
            assert str(exc).startswith(
                f"{tmp_path / 'pipeline.yaml'}:3: sources[0].url: v4l2:// sources are not available"
            )
            assert "\n" not in str(exc) and "Traceback" not in str(exc)
            continue
        assert (cfg.sources[0].scheme, cfg.sources[0].id, cfg.sources[0].live) == ("v4l2", "video0", True)
        assert v4l2_device(cfg.sources[0].url) == "/dev/video0"


async def test_a_fleet_worker_never_starts_a_stored_source_with_nan(
    tmp_path: Path, nats_server: EmbeddedNats, caplog: pytest.LogCaptureFixture
) -> None:
    # NaN in the store made 11,224 connection attempts in 10 s: NaN passes every bound.
    path = write(tmp_path, "pipeline: fleet\nfleet: {name: nan, lease_ttl: 2, worker_id: only}\n")
    cfg = load_config(path)
    assert cfg.fleet is not None
    runtime = Runtime(cfg, nats_url=nats_server.url)
    await runtime.prepare()
    nc = await nats.connect(nats_server.url)
    with RawListener() as camera:
        kv = await open_bucket(nc.jetstream(), "nan", "sources")
        bad = f'{{"url": "rtsp://127.0.0.1:{camera.port}/x", "reconnect": {{"min_delay": NaN}}}}'
        await kv.put("bad", bad.encode())
        await kv.put("good", b'{"url": "test://?width=64&height=48&fps=20"}')
        fleet = FleetWorker(runtime, cfg.fleet, nats_server.url)
        await fleet.start()
        try:
            await until(lambda: "good" in runtime.sources, what="the good source to start")
            await until(
                lambda: any("expected a finite number, got nan" in r.getMessage() for r in caplog.records),
                what="the refusal in the log",
            )
            assert set(runtime.sources) == {"good"}
            refusal = next(r.getMessage() for r in caplog.records if "got nan" in r.getMessage())
            assert "sources.bad.reconnect.min_delay: expected a finite number, got nan" in refusal
        finally:
            await fleet.stop()
            await runtime.stop()
            await nc.close()
        assert camera.connections == 0


# -- what a stage's model can serve: track classes, cascades on classifiers, upright_by ---------


def _model_repo(tmp_path: Path, sample_models: Path) -> Path:
    """The sample models, and made-up ones on their files: ``grid`` (a detector of [cell]),
    ``color_cls`` (a classifier of [red, green]), ``blank`` (a detector with no labels, in its
    config or its model file), ``named`` (one whose labels are in its model file only) and
    ``urgent`` (squares with two priority levels and timeouts a request may set)."""
    import onnx

    repo = tmp_path / "models"
    repo.mkdir()
    for name in ("squares", "ppocr_cls"):
        (repo / name).symlink_to(sample_models / name)
    squares = (sample_models / "squares" / "config.yaml").read_text()
    squares = squares.replace("{path: model.onnx}", f"{{path: {sample_models / 'squares' / 'model.onnx'}}}")
    classifier = (sample_models / "ppocr_cls" / "config.yaml").read_text()
    for name, text in {
        "grid": squares.replace("labels: [square]", "labels: [cell]"),
        "blank": squares.replace("labels: [square]\n", ""),
        "color_cls": classifier.replace('labels: ["0", "180"]', "labels: [red, green]"),
        "urgent": squares.replace(
            "default_queue_policy: {",
            "priority_levels: 2\n  default_priority_level: 2\n"
            "  default_queue_policy: {allow_timeout_override: true, ",
        ),
    }.items():
        (repo / name).mkdir()
        first = "squares" if "squares" in text else "ppocr_cls"
        (repo / name / "config.yaml").write_text(text.replace(f"name: {first}", f"name: {name}", 1))
    # The squares file with an Ultralytics export's class names in its metadata.
    (repo / "named").mkdir()
    graph = onnx.load(str(sample_models / "squares" / "model.onnx"))
    onnx.helper.set_model_props(graph, {"names": "{0: 'square'}"})
    onnx.save(graph, str(repo / "named" / "model.onnx"))
    text = (sample_models / "squares" / "config.yaml").read_text().replace("labels: [square]\n", "")
    (repo / "named" / "config.yaml").write_text(text.replace("name: squares", "name: named", 1))
    return repo


def _pipeline(tmp_path: Path, stages: str) -> Path:
    text = f"pipeline: shop\nmodels: models\nsources: [{{url: 'test://'}}]\nstages:\n{stages}"
    return write(tmp_path, text)


MODEL_MISFITS = [
    pytest.param("  - {name: cells, type: infer, model: grid}\n  - {name: track, type: track, classes: [cel]}\n",
                 ["6: stages[1].classes: 'cel' is not a label of model 'grid' (hint: did you mean 'cell'?)"],
                 id="track-classes-typo"),
    pytest.param("  - {name: sq, type: infer, model: squares}\n  - {name: cells, type: infer, model: grid}\n"
                 "  - {name: track, type: track, classes: [cell, square, sqare]}\n",
                 ["7: stages[2].classes: 'sqare' is not a label of models 'squares' or 'grid' "
                  "(hint: did you mean 'square'?)"], id="track-classes-of-several-detectors"),
    # A classifier adds attributes, not objects: its labels are none the track stage could see.
    pytest.param("  - {name: cells, type: infer, model: grid}\n"
                 "  - {name: colour, type: infer, model: color_cls, on: cells}\n"
                 "  - {name: track, type: track, classes: [red]}\n",
                 ["7: stages[2].classes: 'red' is not a label of model 'grid' (hint: the detectors' labels: cell)"],
                 id="track-classes-of-a-classifier"),
    pytest.param("  - {name: cells, type: infer, model: grid}\n"
                 "  - {name: colour, type: infer, model: color_cls, on: cells}\n"
                 "  - {name: colour2, type: infer, model: color_cls, on: colour}\n",
                 ["7: stages[2].on: stage 'colour' runs model 'color_cls', a classify model: it finds no objects, "
                  "so this stage has none to run on (hint: run it on the objects 'colour' runs on: on: cells)"],
                 id="cascade-on-a-classifier"),
    pytest.param("  - {name: cells, type: infer, model: grid}\n"
                 "  - {name: colour, type: infer, model: color_cls, on: cells}\n"
                 "  - {name: turned, type: infer, model: squares, on: cells, upright_by: colour}\n",
                 ["7: stages[2].upright_by: model 'color_cls' of stage 'colour' has labels that are not angles: "
                  "'red', 'green' (hint: name a classifier stage on the same objects whose labels are 0, 90, 180, "
                  "270)"], id="upright-by-a-colour-classifier"),
    pytest.param("  - {name: cells, type: infer, model: grid}\n"
                 "  - {name: inner, type: infer, model: squares, on: cells}\n"
                 "  - {name: turned, type: infer, model: ppocr_cls, on: cells, upright_by: inner}\n",
                 ["7: stages[2].upright_by: stage 'inner' runs model 'squares', a yolo model, not a classifier of "
                  "angles (hint: name a classifier stage on the same objects whose labels are 0, 90, 180, 270)"],
                 id="upright-by-a-detector-on-the-same-objects"),
    pytest.param("  - {name: cells, type: infer, model: grid}\n  - {name: sq, type: infer, model: squares}\n"
                 "  - {name: orient, type: infer, model: ppocr_cls, on: sq}\n"
                 "  - {name: turned, type: infer, model: ppocr_cls, on: cells, upright_by: orient}\n",
                 ["8: stages[3].upright_by: stage 'orient' runs on the objects of 'sq', not on the objects of "
                  "'cells' this stage crops: upright_by needs a classifier stage with on: cells"],
                 id="upright-by-a-classifier-of-other-objects"),
    # Fine: what each check must let through.
    pytest.param("  - {name: cells, type: infer, model: grid}\n  - {name: sq, type: infer, model: squares}\n"
                 "  - {name: orient, type: infer, model: ppocr_cls, on: cells}\n"
                 "  - {name: turned, type: infer, model: color_cls, on: cells, upright_by: orient}\n"
                 "  - {name: colour, type: infer, model: color_cls, on: sq}\n"
                 "  - {name: track, type: track, classes: [cell, square]}\n", [], id="fine"),
    # Labels only in the model file are not read by validate: not checked.
    pytest.param("  - {name: cells, type: infer, model: grid}\n  - {name: any, type: infer, model: named}\n"
                 "  - {name: track, type: track, classes: [cel]}\n", [], id="track-classes-labels-unknown"),
    # A detector with no labels labels its objects by class number: a name would track none.
    pytest.param("  - {name: any, type: infer, model: blank}\n  - {name: track, type: track, classes: [square, '0']}\n",
                 ["6: stages[1].classes: 'square' is not a class of model 'blank': the model has no labels, so "
                  "its objects are labelled by class number (0, its only class) (hint: name its classes with "
                  "labels: [...] in blank/config.yaml (one per class, in class order), or filter by number: "
                  "classes: ['0'])"],
                 id="track-classes-of-a-model-without-labels"),
    pytest.param("  - {name: cells, type: infer, model: grid}\n  - {name: any, type: infer, model: blank}\n"
                 "  - {name: track, type: track, classes: [cel, cell, '0']}\n",
                 ["7: stages[2].classes: 'cel' is not a label of models 'grid' or 'blank' (hint: did you mean "
                  "'cell'?)"], id="track-classes-of-a-model-without-labels-and-another"),
    # A model with no labels at all labels its objects by class number: a name would drop them all.
    pytest.param("  - {name: any, type: infer, model: blank, classes: [square, '0']}\n"
                 "  - {name: kind, type: infer, model: color_cls, on: any, classes: ['0', '1']}\n",
                 ["5: stages[0].classes: 'square' is not a class of model 'blank': the model has no labels, so "
                  "its objects are labelled by class number (0, its only class) (hint: name its classes with "
                  "labels: [...] in blank/config.yaml (one per class, in class order), or filter by number: "
                  "classes: ['0'])",
                  "6: stages[1].classes: '1' is not a class of model 'blank': the model has no labels, so "
                  "its objects are labelled by class number (0, its only class) (hint: name its classes with "
                  "labels: [...] in blank/config.yaml (one per class, in class order), or filter by number: "
                  "classes: ['0'])"],
                 id="classes-of-a-model-without-labels"),
]  # fmt: skip


@pytest.mark.parametrize(("stages", "expected"), MODEL_MISFITS)
def test_validate_refuses_stages_their_models_cannot_serve(
    tmp_path: Path, sample_models: Path, stages: str, expected: list[str]
) -> None:
    _model_repo(tmp_path, sample_models)
    path = _pipeline(tmp_path, stages)
    try:
        load_config(path, check_resources=True)
        found = []
    except ConfigError as exc:
        found = [e.render() for e in exc.errors]
    assert found == [f"{path}:{line}" for line in expected]


def test_validate_refuses_a_cascade_on_a_classifier_with_exit_2(tmp_path: Path, sample_models: Path) -> None:
    _model_repo(tmp_path, sample_models)
    path = _pipeline(tmp_path, MODEL_MISFITS[3].values[0])
    proc = run_cli("validate", str(path))
    assert (proc.returncode, proc.stderr) == (2, f"{path}:{MODEL_MISFITS[3].values[1][0]}\n")


def test_classes_a_model_without_labels_never_gives_are_refused_by_validate_and_run(
    tmp_path: Path, sample_models: Path
) -> None:
    _model_repo(tmp_path, sample_models)
    path = _pipeline(tmp_path, "  - {name: any, type: infer, model: blank, classes: [square]}\n")
    expected = f"{path}:{MODEL_MISFITS[-1].values[1][0]}"  # the same words, at the stage's line
    for command in ("validate", "run"):
        proc = run_cli(command, str(path))
        assert (proc.returncode, proc.stderr.splitlines()[-1]) == (2, expected), command


def test_validate_warns_of_stage_settings_the_model_ignores(tmp_path: Path, sample_models: Path) -> None:
    _model_repo(tmp_path, sample_models)
    stages = "  - {name: det, type: infer, model: MODEL, priority: 1, timeout_ms: 40}\n"
    path = _pipeline(tmp_path, stages.replace("MODEL", "squares"))
    proc = run_cli("validate", str(path))
    assert proc.returncode == 0, proc.stderr
    warnings = [ln.split(" ", 1)[1].split(None, 1)[1] for ln in proc.stderr.splitlines() if " warning " in ln]
    assert warnings == [
        f"{path}:5: stages[0].priority: model 'squares' has no priority level 1 (dynamic_batching.priority_levels: "
        "0), so the stage's requests join its default level (hint: set dynamic_batching.priority_levels in the "
        "model's config.yaml, or drop priority)",
        f"{path}:5: stages[0].timeout_ms: model 'squares' does not let a request set its own timeout, so "
        "timeout_ms is ignored (hint: set allow_timeout_override: true in the queue policy of its config.yaml, "
        "or drop timeout_ms)",
    ]
    # A model whose batcher takes both: nothing to say.
    path = _pipeline(tmp_path, stages.replace("MODEL", "urgent"))
    proc = run_cli("validate", str(path))
    assert (proc.returncode, proc.stderr) == (0, ""), proc.stderr
    # A priority beyond its levels joins the default level, and so does the timeout.
    path = _pipeline(tmp_path, stages.replace("MODEL", "urgent").replace("priority: 1", "priority: 3"))
    proc = run_cli("validate", str(path))
    assert proc.returncode == 0, proc.stderr
    assert "stages[0].priority: model 'urgent' has no priority level 3" in proc.stderr
    assert "timeout_ms" not in proc.stderr


def test_an_output_source_that_is_a_typo_is_refused_and_one_no_source_resembles_is_warned(
    tmp_path: Path,
) -> None:
    path = tmp_path / "ids.yaml"
    path.write_text(
        "pipeline: shop\nsources:\n  - {url: 'test://?frames=3', id: cam}\n  - {url: 'test://?frames=3', id: gate1}\n"
        "outputs:\n"
        '  - {type: file, path: "rec/{source}.mp4", sources: [Cam]}\n'  # 6: another case
        "  - {type: clips, dir: clips, sources: [cma, nope, gate2]}\n"  # 7: a typo; two a later source may have
    )
    proc = run_cli("validate", str(path))
    assert proc.returncode == 2
    errors = [ln for ln in proc.stderr.splitlines() if " warning " not in ln]
    assert errors == [
        f"{path}:6: outputs[0].sources: no source 'Cam' (hint: did you mean 'cam'?)",
        f"{path}:7: outputs[1].sources: no source 'cma' (hint: did you mean 'cam'?)",
    ]
    warnings = [ln.split(" ", 1)[1].split(None, 1)[1] for ln in proc.stderr.splitlines() if " warning " in ln]
    assert warnings == [
        f"{path}:7: outputs[1].sources: no source {name!r} in this file: the output applies only to a source "
        "added later with that id (through the HTTP API or a fleet) (hint: the file's sources: cam, gate1)"
        for name in ("nope", "gate2")
    ]
    # Without the typos the file is fine; the ids no source has are still said by validate and by run.
    path.write_text(path.read_text().replace("[Cam]", "[cam]").replace("cma, ", ""))
    for command in ("validate", "run"):
        proc = run_cli(command, str(path))
        assert proc.returncode == 0, proc.stderr
        assert sum("no source 'nope' in this file" in ln for ln in proc.stderr.splitlines()) == 1, command


def test_validate_refuses_a_recording_whose_format_cannot_hold_its_codec(tmp_path: Path) -> None:
    path = tmp_path / "rec.yaml"
    path.write_text(
        "pipeline: shop\nsources: [{url: 'test://?frames=3'}]\noutputs:\n"
        '  - {type: file, path: "out/{source}.webm"}\n'  # 4: libx264, which WebM cannot hold
        '  - {type: file, path: "out/{source}.m4v", codec: libx265}\n'  # 5: nor can .m4v H.265
        '  - {type: file, path: "out/{source}-vp9.webm", codec: libvpx-vp9}\n'  # 6: fine
        '  - {type: file, path: "out/{source}.mkv"}\n'  # 7: fine
    )
    proc = run_cli("validate", str(path))
    assert proc.returncode == 2
    x264 = ".mp4, .m4v, .mov, .mkv, .avi, .ts, .flv, .nut"
    assert proc.stderr.splitlines() == [
        f"{path}:4: outputs[0].path: a .webm file cannot hold libx264 video: 'webm' format does not support "
        f"'libx264' codec (hint: with codec libx264, end it in one of {x264}, e.g. out/{{source}}.mp4, or use "
        "codec: libvpx-vp9 (WebM holds VP8, VP9 and AV1 only))",
        f"{path}:5: outputs[1].path: a .m4v file cannot hold libx265 video: 'ipod' format does not support "
        "'libx265' codec (hint: with codec libx265, end it in one of .mp4, .mov, .mkv, .ts, .flv, .nut, "
        "e.g. out/{source}.mp4)",
    ]
    # What validate lets through, run records: the WebM with VP9 and the Matroska file play.
    import av

    path.write_text(
        "pipeline: shop\nsources: [{url: 'test://?frames=5', id: cam}]\noutputs:\n"
        '  - {type: file, path: "out/{source}-vp9.webm", codec: libvpx-vp9}\n'
        '  - {type: file, path: "out/{source}.mkv"}\n'
    )
    proc = run_cli("run", str(path))
    assert proc.returncode == 0, proc.stderr
    for name in ("cam-vp9.webm", "cam.mkv"):
        with av.open(str(tmp_path / "out" / name)) as f:
            assert sum(1 for _ in f.decode(video=0)) == 5, name
