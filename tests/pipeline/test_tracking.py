"""Tracking in a running pipeline: detector ``interval``, cascade ``reinfer_interval``, config order."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from inference.schema import ConfigError
from pipeline.config import load_config
from pipeline.nats_server import EmbeddedNats
from pipeline.runtime import Runtime
from pipeline.sources.pattern import pattern_square_box
from tests.conftest import Collector, validate_message

FRAMES = 12

PIPELINE = """\
pipeline: trk
models: {models}
sources:
  - {{id: a, url: "test://?fps=50&frames={frames}&width=320&height=240", queue_size: 64}}
stages:
{stages}
runtime:
  max_in_flight: 4
"""


async def run(
    tmp_path: Path, models: Path, nats: EmbeddedNats, collector: Collector, stages: str
) -> tuple[list[dict[str, Any]], dict[str, int]]:
    """Every message of one 12-frame pattern source, and the requests each model served."""
    path = tmp_path / "trk.yaml"
    path.write_text(PIPELINE.format(models=models, frames=FRAMES, stages=stages))
    await collector.start(nats.url)
    runtime = Runtime(load_config(path), nats_url=nats.url)
    await runtime.start()
    await runtime.wait(60)
    assert runtime.models is not None
    calls = {name: runtime.models.get(name).stats.batched_requests for name in runtime.config.models_used()}
    await runtime.stop()
    await collector.wait_for(FRAMES)
    messages = sorted(collector.messages, key=lambda m: m["frame"])
    assert [m["frame"] for m in messages] == list(range(FRAMES))
    for m in messages:
        validate_message(m)
    return messages, calls


def near(box: list[float], truth: tuple[int, ...], tolerance: float) -> bool:
    return all(abs(a - t) <= tolerance for a, t in zip(box, truth, strict=True))


async def test_interval_runs_the_detector_on_one_frame_in_three_and_publishes_predicted_boxes(
    tmp_path: Path, sample_models: Path, nats_server: EmbeddedNats, collector: Collector
) -> None:
    stages = "  - {name: objects, type: infer, model: squares, interval: 2}\n  - {name: track, type: track}\n"
    messages, calls = await run(tmp_path, sample_models, nats_server, collector, stages)

    assert calls == {"squares": 4}  # frames 0, 3, 6, 9
    predicted = [m["frame"] for m in messages if m["objects"][0].get("predicted")]
    assert predicted == [1, 2, 4, 5, 7, 8, 10, 11]
    for m in messages:
        (obj,) = m["objects"]
        assert obj["track_id"] == 1 and obj["label"] == "square"
        truth = pattern_square_box(m["frame"], 320, 240)
        if m["frame"] % 3 == 0:
            assert "predicted" not in obj and near(obj["bbox"], truth, 2), (m["frame"], obj)
        else:
            # The square moves 7 px a frame; the filter has learnt that by the third run.
            tolerance = 16 if m["frame"] < 7 else 6
            assert near(obj["bbox"], truth, tolerance), (m["frame"], obj["bbox"], truth)


CASCADE = """\
  - {{name: objects, type: infer, model: squares}}
  - {{name: track, type: track}}
  - {{name: upright, type: infer, model: ppocr_cls, on: objects{extra}}}
"""


@pytest.mark.parametrize(
    ("extra", "runs"),
    [
        pytest.param("", list(range(FRAMES)), id="every-frame"),
        # Only the new track and every 5th frame: 0, 5, 10.
        pytest.param(", reinfer_interval: 5, reinfer_iou: 0", [0, 5, 10], id="every-5th"),
        # The square moves 7 px a frame on a 40 px side: two frames on, its box overlaps
        # the last run's below 0.5, so it is classified again every second frame.
        pytest.param(", reinfer_interval: 5", [0, 2, 4, 6, 8, 10], id="moved"),
    ],
)
async def test_reinfer_interval_classifies_a_track_when_new_moved_or_every_n_frames(
    tmp_path: Path,
    sample_models: Path,
    nats_server: EmbeddedNats,
    collector: Collector,
    extra: str,
    runs: list[int],
) -> None:
    messages, calls = await run(tmp_path, sample_models, nats_server, collector, CASCADE.format(extra=extra))

    assert calls == {"squares": FRAMES, "ppocr_cls": len(runs)}
    fresh = [m["frame"] for m in messages if "carried" not in m["objects"][0]["attributes"][0]]
    assert fresh == runs
    last_run: dict[str, Any] = {}
    for m in messages:
        (obj,) = m["objects"]
        (attr,) = obj["attributes"]
        assert obj["track_id"] == 1 and attr["model"] == "ppocr_cls"
        if m["frame"] in runs:
            assert "carried" not in attr
            last_run = attr
        else:
            # Between runs the object gets the last run's attribute, score and all, flagged.
            assert attr == {**last_run, "carried": True}, (m["frame"], attr, last_run)


GOOD = """\
pipeline: p
models: {models}
sources: [{{id: a, url: "test://"}}]
stages:
"""


@pytest.mark.parametrize(
    ("stages", "line", "message"),
    [
        pytest.param(
            "  - {name: o, type: infer, model: squares}\n"
            "  - {name: c, type: infer, model: ppocr_cls, on: o,\n     reinfer_interval: 5}\n"
            "  - {name: t, type: track}\n",
            7,
            "stages[1].reinfer_interval: reinfer_interval needs a track stage before this stage (move it above)",
            id="reinfer-before-track",
        ),
        pytest.param(
            "  - {name: t, type: track}\n  - {name: o, type: infer, model: squares, interval: 2}\n",
            6,
            "stages[1].interval: a detector with interval must come before the track stage that predicts for it",
            id="interval-after-track",
        ),
        pytest.param(
            "  - {name: o, type: infer, model: squares}\n  - {name: c, type: infer, model: ppocr_cls, interval: 1, on: o}\n",
            6,
            "stages[1].interval: interval applies to a detector on whole frames; a cascade takes reinfer_interval",
            id="interval-on-cascade",
        ),
        pytest.param(
            "  - {name: t, type: track, high_score: 0.3, low_score: 0.4}\n",
            5,
            "stages[0].low_score: low_score 0.4 is above high_score 0.3",
            id="low-above-high",
        ),
    ],
)
def test_tracking_options_out_of_order_name_file_and_line(
    tmp_path: Path, sample_models: Path, stages: str, line: int, message: str
) -> None:
    path = tmp_path / "p.yaml"
    path.write_text(GOOD.format(models=sample_models) + stages)
    with pytest.raises(ConfigError) as info:
        load_config(path)
    rendered = str(info.value)
    assert rendered.startswith(f"{path}:{line}: "), rendered
    assert message in rendered, rendered
