"""``vidpipe validate`` (and ``run``'s config load) reports every independent problem of a file
at once: a wrong top-level value, or one wrong key of a ``zones`` stage or an output, hides
none of the others; a check that reads a wrong value is skipped instead of judging a default.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from inference.schema import ConfigError
from pipeline.config import load_config
from tests.conftest import run_cli

# A zone whose edges 1 and 3 cross: the corners go round in a bow tie.
BOW_TIE = "[[0, 0], [10, 10], [10, 0], [0, 10]]"
SQUARE = "[[0, 0], [10, 0], [10, 10], [0, 10]]"
CROSSING = "the polygon's edges 1 and 3 cross each other; list the corners in order around the zone"


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "pipeline.yaml"
    path.write_text(textwrap.dedent(text))
    return path


def problems(path: Path, *, check_resources: bool = False, require_sources: bool = False) -> list[str]:
    """Every problem ``load_config`` raises for ``path``, one rendered line each, in its order."""
    with pytest.raises(ConfigError) as info:
        load_config(path, check_resources=check_resources, require_sources=require_sources)
    return [e.render() for e in info.value.errors]


def test_validate_reports_a_wrong_pipeline_name_with_the_file_model_and_graph_problems(
    tmp_path: Path, sample_models: Path
) -> None:
    path = write(
        tmp_path,
        f"""\
        pipeline: shop.x
        models: {sample_models}
        sources:
          - url: missing.mp4
        stages:
          - {{name: detect, type: infer, model: squres}}
          - {{name: read, type: infer, model: ppocr_rec, on: text}}
        """,
    )
    proc = run_cli("validate", str(path))
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.splitlines() == [
        f"{path}:1: pipeline: 'shop.x' is not a valid name "
        "(hint: use 1-64 letters, digits, '_' or '-' (it becomes part of a NATS subject))",
        f"{path}:4: sources[0].url: file not found: {tmp_path / 'missing.mp4'} "
        "(hint: relative paths start at the folder of this file)",
        f"{path}:6: stages[0].model: model 'squres' is not in the repository {sample_models} "
        "(hint: did you mean 'squares'?)",
        f"{path}:7: stages[1].on: unknown stage 'text' (hint: name an earlier stage: detect)",
    ]


def test_a_missing_pipeline_name_hides_no_other_problem(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        """\
        nats: {url: 'http://broker:4222'}
        stages:
          - {name: t, type: track}
          - {name: t, type: track}
        """,
    )
    assert problems(path) == [
        f"{path}:1: missing required key 'pipeline' "
        "(hint: use 1-64 letters, digits, '_' or '-' (it becomes part of a NATS subject))",
        f"{path}:1: nats.url: 'http://broker:4222' is not a NATS server URL "
        "(hint: use nats://, tls://, ws://, wss://, e.g. nats://127.0.0.1:4222)",
        f"{path}:4: stages[1].name: duplicate stage name 't' (hint: stage names must be unique)",
    ]


def test_a_wrong_key_of_a_section_keeps_its_other_keys_checked(tmp_path: Path) -> None:
    # runtime.max_sources is still read: two sources are one too many.
    path = write(
        tmp_path,
        """\
        pipeline: shop
        runtime:
          max_sources: 1
          admision: eager
        sources:
          - url: test://
          - url: test://?fps=5
        """,
    )
    assert problems(path) == [
        f"{path}:4: runtime.admision: unknown key (hint: did you mean 'admission'?)",
        f"{path}:7: sources: 2 sources, more than runtime.max_sources (1) "
        "(hint: run fewer sources per process, or raise runtime.max_sources)",
    ]
    # A misspelt max_sources may have been meant: 65 sources are not counted against the default 64.
    many = "".join(f"  - url: test://?fps={n + 1}\n" for n in range(65))
    path.write_text(f"pipeline: shop\nruntime: {{max_source: 100}}\nsources:\n{many}")
    assert problems(path) == [
        f"{path}:2: runtime.max_source: unknown key (hint: did you mean 'max_sources'?)"
    ]


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        pytest.param(
            "pipeline: shop\nmodels: 5\nsources: [{url: 'test://'}]\nstages: [{name: d, type: infer, model: m}]\n",
            ['2: models: expected a string, got 5 (hint: write it in quotes: models: "5")'],
            id="wrong-models-is-not-also-no-models",
        ),
        pytest.param(
            "pipeline: shop\nmodel: samples\nsources: [{url: 'test://'}]\nstages: [{name: d, type: infer, model: m}]\n",
            ["2: model: unknown key (hint: did you mean 'models'?)"],
            id="misspelt-models-is-not-also-no-models",
        ),
        pytest.param(
            "pipeline: shop\nfleet: {name: cams.1}\n",
            [
                "2: fleet.name: 'cams.1' is not a valid name "
                "(hint: use 1-64 letters, digits, '_' or '-' (it becomes part of a NATS subject))"
            ],
            id="wrong-fleet-is-not-also-no-sources",
        ),
    ],
)
def test_a_check_that_reads_a_wrong_top_level_value_is_skipped(
    tmp_path: Path, text: str, expected: list[str]
) -> None:
    path = write(tmp_path, text)
    assert problems(path, require_sources=True) == [f"{path}:{line}" for line in expected]


def test_a_zone_with_two_wrong_keys_reports_both(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        f"""\
        pipeline: shop
        stages:
          - name: gate
            type: zones
            zones:
              - name: dock 1
                polygon: {BOW_TIE}
              - name: yard
                polygon: {SQUARE}
                hysteresis: 3
        """,
    )
    assert problems(path) == [
        f"{path}:6: stages[0].zones[0].name: 'dock 1' is not a valid name "
        "(hint: use 1-64 letters, digits, '_' or '-' (it becomes part of a NATS subject))",
        f"{path}:7: stages[0].zones[0].polygon: {CROSSING}",
        f"{path}:10: stages[0].zones[1].hysteresis: unknown key (hint: allowed keys: name, polygon)",
    ]


def test_a_zones_stage_with_wrong_keys_still_has_its_zones_and_its_place_checked(
    tmp_path: Path, sample_models: Path
) -> None:
    path = write(
        tmp_path,
        f"""\
        pipeline: shop
        models: {sample_models}
        stages:
          - name: gate
            type: zones
            hysteresis: -1
            anchor: feet
            lines:
              - {{name: door, points: [[0, 0], [0, 10]]}}
              - {{name: door, points: [[5, 0], [5, 10]]}}
          - {{name: read, type: infer, model: ppocr_rec, on: gate}}
          - name: dock
            type: zones
            hysteresis: -1
            zones:
              - {{name: bay, polygon: {BOW_TIE}}}
          - name: yard
            type: zones
            model: squares
            classes: car
            zones:
              - {{name: lot, polygon: {SQUARE}}}
          # Its lines may have been meant: it is not said to have none.
          - {{name: lane, type: zones, line: [{{name: a, points: [[0, 0], [1, 1]]}}], track_end_after: 0}}
        """,
    )
    assert problems(path) == [
        f"{path}:6: stages[0].hysteresis: must be at least 0, got -1.0 "
        "(hint: px: dead band along lines and zone edges)",
        f"{path}:7: stages[0].anchor: expected one of 'bottom_center', 'center', 'top_center', "
        "'bottom_left', 'bottom_right', 'top_left', 'top_right', got 'feet' "
        "(hint: the point of the box that counts)",
        f"{path}:10: stages[0].lines[1].name: duplicate name 'door'",
        f"{path}:11: stages[1].on: stage 'gate' is a zones stage and finds no objects (hint: an infer "
        "stage whose model finds objects (a detector); add one before this stage)",
        f"{path}:14: stages[2].hysteresis: must be at least 0, got -1.0 "
        "(hint: px: dead band along lines and zone edges)",
        f"{path}:16: stages[2].zones[0].polygon: {CROSSING}",
        f"{path}:19: stages[3].model: does not apply to a stage of type zones (hint: type zones takes: "
        "name, type, zones, lines, normalized, anchor, hysteresis, track_end_after, classes)",
        f"{path}:20: stages[3].classes: expected a list, got 'car' (hint: labels to follow; all when empty)",
        f"{path}:24: stages[4].line: unknown key (hint: did you mean 'lines'?)",
        f"{path}:24: stages[4].track_end_after: must be at least 1, got 0 "
        "(hint: frames unseen before a track ends; at least the tracker's)",
    ]


def test_an_output_with_two_wrong_keys_is_still_checked_where_it_writes(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        """\
        pipeline: shop
        sources:
          - url: test://
          - url: test://?fps=5
        outputs:
          - type: file
            path: out/all.txt
            crf: 99
            codec: nosuchcodec
          - {type: clips, dir: clips/, pre_s: -1, on: [bogus]}
          - {type: file, path: out/one.mp4, sorces: [test]}
        """,
    )
    video = ".mp4, .m4v, .mov, .mkv, .avi, .ts, .flv, .nut"
    assert problems(path, check_resources=True) == [
        f"{path}:7: outputs[0].path: 2 sources (test, test_2) would record to the one file 'out/all.txt' "
        "(hint: put {source} in the path, e.g. out/all-{source}.txt, or name one source in outputs[0].sources)",
        f"{path}:7: outputs[0].path: 'out/all.txt' does not end in a video file extension FFmpeg writes "
        f"(hint: end it in one of {video}, e.g. out/{{source}}.mp4)",
        f"{path}:8: outputs[0].crf: must be at most 51, got 99 (hint: quality: lower is better and bigger)",
        f"{path}:9: outputs[0].codec: FFmpeg has no video encoder 'nosuchcodec' "
        "(hint: e.g. libx264 (H.264), libx265, mpeg4 or libvpx-vp9)",
        f"{path}:10: outputs[1].pre_s: must be at least 0, got -1.0 (hint: seconds kept before the event)",
        f"{path}:10: outputs[1].on[0]: expected one of 'track_start', 'detection', 'zone_enter', "
        "'zone_exit', 'line_cross', got 'bogus'",
        # Its sources may have been meant: it is not said to record both.
        f"{path}:11: outputs[2].sorces: unknown key (hint: did you mean 'sources'?)",
    ]


def test_an_output_s_problem_names_its_own_entry_after_one_that_is_wrong(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        """\
        pipeline: shop
        outputs:
          - {type: file, path: out/a.mp4, sorces: [cam]}
          - {type: file, path: out/b.txt}
        """,
    )
    video = ".mp4, .m4v, .mov, .mkv, .avi, .ts, .flv, .nut"
    assert problems(path, check_resources=True) == [
        f"{path}:3: outputs[0].sorces: unknown key (hint: did you mean 'sources'?)",
        f"{path}:4: outputs[1].path: 'out/b.txt' does not end in a video file extension FFmpeg writes "
        f"(hint: end it in one of {video}, e.g. out/{{source}}.mp4)",
    ]


def test_a_wrong_key_of_an_infer_or_track_stage_hides_no_model_problem(
    tmp_path: Path, sample_models: Path
) -> None:
    import shutil

    repo = tmp_path / "models"
    shutil.copytree(sample_models / "squares", repo / "squares")
    shutil.copytree(sample_models / "squares", repo / "det")
    det = repo / "det" / "config.yaml"
    det.write_text(det.read_text().replace("name: squares", "name: det") + "task_kind: yolo\n")
    path = write(
        tmp_path,
        f"""\
        pipeline: shop
        models: {repo}
        stages:
          - {{name: a, type: infer, model: det, intervall: 2}}
          - {{name: b, type: infer, model: squares, confidance: 0.3, classes: [sqare]}}
          - {{name: t, type: track, tracker: bytetrak, classes: [sqare]}}
        """,
    )
    # A wrong interval stands in as 0 and a wrong confidence or tracker is read by no check:
    # every stage is checked, and the models' own configs too. The track stage's classes
    # are not judged: they may be labels of det, whose config does not load.
    assert problems(path, check_resources=True) == [
        f"{det}:23: task_kind: unknown key (hint: did you mean 'task'?)",
        f"{path}:4: stages[0].intervall: unknown key (hint: did you mean 'interval'?)",
        f"{path}:5: stages[1].confidance: unknown key (hint: did you mean 'confidence'?)",
        f"{path}:5: stages[1].classes: 'sqare' is not a label of model 'squares' (hint: did you mean 'square'?)",
        f"{path}:6: stages[2].tracker: expected one of 'bytetrack', 'iou', got 'bytetrak' "
        "(hint: did you mean 'bytetrack'?)",
    ]


def test_a_wrong_reinfer_interval_hides_no_graph_problem(tmp_path: Path, sample_models: Path) -> None:
    path = write(
        tmp_path,
        f"""\
        pipeline: ocr
        models: {sample_models}
        sources: [{{url: "test://?frames=3"}}]
        stages:
          - {{name: text, type: infer, model: ppocr_det}}
          - {{name: track, type: track}}
          - {{name: read, type: infer, model: ppocr_rec, on: text, reinfer_interval: -1}}
          - {{name: read, type: infer, model: ppocr_rec, on: txt}}
        """,
    )
    assert problems(path, check_resources=True) == [
        f"{path}:7: stages[2].reinfer_interval: must be at least 0, got -1 "
        "(hint: cascades after a track stage: re-run on a track every N frames)",
        f"{path}:8: stages[3].name: duplicate stage name 'read' (hint: stage names must be unique)",
        f"{path}:8: stages[3].on: unknown stage 'txt' (hint: name an earlier stage: text, track, read)",
    ]
