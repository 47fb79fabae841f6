"""Pipeline config validation: every error names FILE:LINE, the key and the problem."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from inference.schema import ConfigError
from pipeline.config import load_config
from pipeline.redact import redact_url
from tests.conftest import ROOT, run_cli

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
                 "stages[2].on: stage 't' is a track stage and finds no objects", id="on-a-track-stage"),
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


def test_validate_good_file_exits_0(tmp_path: Path, sample_models: Path) -> None:
    (tmp_path / "models").symlink_to(sample_models)
    proc = run_cli("validate", str(write(tmp_path, GOOD)))
    assert proc.returncode == 0, proc.stderr
    assert "ok (pipeline shop: 1 source(s), 1 stage(s))" in proc.stdout


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
    from pipeline.sources.schemes import derive_id

    assert not any(secret in derive_id(url) for secret in ("pa", "ab", "cd", "ss", "pw", "user"))
