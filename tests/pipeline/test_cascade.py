"""Cascades: a stage `on:` another runs on crops of its objects, from every source at once."""

from __future__ import annotations

import shutil
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest

from pipeline.config import load_config
from pipeline.crops import cut_box, cut_polygon, map_box, rotate
from pipeline.frames import DetectedObject, Frame
from pipeline.nats_server import EmbeddedNats
from pipeline.runtime import Runtime
from pipeline.sources.pattern import pattern_square_box
from pipeline.stages.base import Stage, StageOptions
from pipeline.stats import PipelineReport
from tests.conftest import Collector
from tests.pipeline.stack import stage_kinds

PIPELINE = """\
pipeline: cas
models: {models}
sources:
  - {{id: a, url: "test://?fps=50&frames=12&width=320&height=240", queue_size: 64}}
  - {{id: b, url: "test://?fps=50&frames=12&width=480&height=270", queue_size: 64}}
stages:
  - {{name: objects, type: infer, model: squares}}
  - {{name: markers, type: infer, model: markers, on: objects, classes: [square], min_size: 8}}
"""


async def test_a_cascade_detector_adds_children_in_frame_coordinates(
    tmp_path: Path, sample_models: Path, nats_server: EmbeddedNats, collector: Collector
) -> None:
    repo = tmp_path / "models"
    shutil.copytree(sample_models / "squares", repo / "squares")
    # The same exact detector under another name and label, run on the crops.
    shutil.copytree(sample_models / "squares", repo / "markers")
    config = repo / "markers" / "config.yaml"
    config.write_text(
        config.read_text()
        .replace("name: squares", "name: markers")
        .replace("labels: [square]", "labels: [marker]")
    )
    path = tmp_path / "cas.yaml"
    path.write_text(PIPELINE.format(models=repo))
    await collector.start(nats_server.url)
    runtime = Runtime(load_config(path), nats_url=nats_server.url)
    await runtime.start()
    await runtime.wait(30)
    stats = runtime.models.get("markers").stats
    await runtime.stop()
    await collector.wait_for(24)

    sizes = {"a": (320, 240), "b": (480, 270)}
    for m in collector.messages:
        parent, child = m["objects"]
        assert (parent["label"], child["label"]) == ("square", "marker")
        truth = pattern_square_box(m["frame"], *sizes[m["source"]])
        # `classes` chose the parents to crop; it does not filter the children out.
        for obj in (parent, child):
            assert all(abs(a - t) <= 2 for a, t in zip(obj["bbox"], truth, strict=True)), (obj, truth)
    assert sorted({m["source"] for m in collector.messages}) == ["a", "b"]
    # Every crop of both sources went through the one batcher of the cascade model.
    assert stats.batched_requests == 24


def model_copy(sample_models: Path, repo: Path, name: str, label: str, **replacements: str) -> None:
    """The squares detector under another name and label, with config lines replaced."""
    shutil.copytree(sample_models / "squares", repo / name)
    config = repo / name / "config.yaml"
    text = config.read_text().replace("name: squares", f"name: {name}").replace("[square]", f"[{label}]")
    for old, new in replacements.items():
        assert old in text, old
        text = text.replace(old, new)
    config.write_text(text)


@dataclass(frozen=True)
class PlantOptions(StageOptions):
    scores: list[float] = field(default_factory=lambda: [0.9])
    margin: int = 4  # px around the test pattern's square
    tall: int = 0  # px more above and below, as a polygon: the crop comes back turned a quarter
    specks: bool = False  # a 1 px object, and one that is 1 px once clipped to the frame


class Plant(Stage):
    """Objects around the test pattern's square, as a detector would find them (a seam)."""

    kind = "plant"
    options_type = PlantOptions
    finds_objects = True

    async def process(self, frame: Frame) -> None:
        opts = self.options
        assert isinstance(opts, PlantOptions)
        x1, y1, x2, y2 = pattern_square_box(frame.index, frame.width, frame.height)
        m, t = opts.margin, opts.tall
        box = (max(0, x1 - m), max(0, y1 - m - t), min(frame.width, x2 + m), min(frame.height, y2 + m + t))
        bx1, by1, bx2, by2 = (float(v) for v in box)
        polygon = [(bx1, by1), (bx2, by1), (bx2, by2), (bx1, by2)] if t else None
        planted = [((bx1, by1, bx2, by2), score, polygon) for score in opts.scores]
        if opts.specks:
            planted += [((5.0, 5.0, 6.0, 6.0), 0.99, None), ((-10.0, -10.0, 1.0, 1.0), 0.98, None)]
        for bbox, score, poly in planted:
            frame.objects.append(
                DetectedObject(frame.next_object_id(), "square", 0, score, bbox, self.name, polygon=poly)
            )


CASCADE = """\
pipeline: cas
models: {models}
sources:
  - {{id: a, url: "test://?fps=50&frames={frames}&width=320&height=240", queue_size: 64}}
stages:
  - {{name: plant, type: plant, {plant}}}
  - {{name: markers, type: infer, model: markers, on: plant, {markers}}}
"""


async def run_cascade(
    tmp_path: Path, nats_url: str, repo: Path, frames: int, plant: str, markers: str
) -> tuple[Runtime, PipelineReport]:
    path = tmp_path / "cascade.yaml"
    path.write_text(CASCADE.format(models=repo, frames=frames, plant=plant, markers=markers))
    with stage_kinds(Plant):
        runtime = Runtime(load_config(path), nats_url=nats_url)
        await runtime.start()
    await runtime.wait(30)
    report = runtime.report()
    await runtime.stop()
    return runtime, report


def skipped(runtime: Runtime, reason: str) -> float:
    labels = {"pipeline": "cas", "source": "a", "stage": "markers", "reason": reason}
    return runtime.metrics.registry.get_sample_value("vidpipe_objects_skipped_total", labels) or 0.0


async def test_confidence_chooses_the_parents_of_a_cascade(
    tmp_path: Path, sample_models: Path, nats_server: EmbeddedNats, collector: Collector
) -> None:
    model_copy(sample_models, tmp_path / "models", "markers", "marker")
    await collector.start(nats_server.url)
    _, report = await run_cascade(
        tmp_path, nats_server.url, tmp_path / "models", 6, "scores: [0.9, 0.5, 0.3]", "confidence: 0.6"
    )
    await collector.wait_for(6)
    for m in collector.messages:
        # Only the parent scored 0.9 was cropped: one child, not three.
        assert [o["label"] for o in m["objects"]] == ["square"] * 3 + ["marker"], m
    (markers,) = report.models
    assert markers.requests == 6


async def test_objects_beyond_max_objects_and_below_min_size_are_counted_not_sent(
    tmp_path: Path, sample_models: Path, nats_server: EmbeddedNats, caplog: pytest.LogCaptureFixture
) -> None:
    model_copy(sample_models, tmp_path / "models", "markers", "marker")
    runtime, report = await run_cascade(
        tmp_path, nats_server.url, tmp_path / "models", 6,
        "scores: [0.9, 0.8, 0.7, 0.6, 0.5], specks: true", "max_objects: 2",
    )  # fmt: skip
    (markers,) = report.models
    # Per frame: the two best of five go to the model; three are left out, and neither
    # speck (1 px, and 1 px once clipped to the frame) is ever sent (min_size defaults to 2).
    assert markers.requests == 2 * 6
    assert skipped(runtime, "max_objects") == 3 * 6
    assert skipped(runtime, "min_size") == 2 * 6
    warnings = [r.getMessage() for r in caplog.records if "max_objects is 2" in r.getMessage()]
    assert warnings == [
        "stage markers: frame 0 of a has 5 objects to crop, max_objects is 2; the lowest-scored get "
        "no result (counted in vidpipe_objects_skipped_total, said once per source)"
    ]


async def test_a_detector_on_turned_polygon_crops_reports_boxes_in_source_pixels(
    tmp_path: Path, sample_models: Path, nats_server: EmbeddedNats, collector: Collector
) -> None:
    model_copy(sample_models, tmp_path / "models", "markers", "marker")
    await collector.start(nats_server.url)
    await run_cascade(
        tmp_path, nats_server.url, tmp_path / "models", 12, "margin: 10, tall: 40", "crop: polygon"
    )
    await collector.wait_for(12)
    for m in collector.messages:
        parent, child = m["objects"]
        x1, y1, x2, y2 = parent["bbox"]
        # Taller than wide: the warped crop came back turned a quarter, and the box the
        # detector found in it is turned back and moved to where the crop was cut.
        assert (y2 - y1) / (x2 - x1) >= 1.5, parent
        truth = pattern_square_box(m["frame"], 320, 240)
        assert child["label"] == "marker"
        assert all(abs(a - t) <= 2 for a, t in zip(child["bbox"], truth, strict=True)), (child, truth)


async def test_rejected_cascade_requests_are_counted_and_logged(
    tmp_path: Path, sample_models: Path, nats_server: EmbeddedNats, caplog: pytest.LogCaptureFixture
) -> None:
    model_copy(
        sample_models, tmp_path / "models", "markers", "marker",
        **{"max_queue_size: 64": "max_queue_size: 1", "max_queue_delay_microseconds: 2000":
           "max_queue_delay_microseconds: 50000"},
    )  # fmt: skip
    runtime, _ = await run_cascade(
        tmp_path,
        nats_server.url,
        tmp_path / "models",
        4,
        "scores: [0.9, 0.8, 0.7, 0.6, 0.5, 0.4]",
        "min_size: 2",
    )
    rejected = runtime.metrics.registry.get_sample_value(
        "vidpipe_inference_requests_total", {"model": "markers", "status": "rejected"}
    )
    assert rejected and skipped(runtime, "rejected") == rejected
    errors = [r for r in caplog.records if "stage markers failed on object" in r.getMessage()]
    # Rate-limited like whole-frame errors: one ERROR line, however many objects.
    assert len(errors) == 1 and errors[0].levelname == "ERROR", [r.getMessage() for r in errors]
    assert "InferenceRejected" in errors[0].getMessage()


async def test_one_batch_holds_requests_from_two_sources(
    tmp_path: Path, sample_models: Path, nats_server: EmbeddedNats
) -> None:
    # One frame in flight per source, so each source has at most one request in the
    # batcher: a batch of two can only be one request from each.
    model_copy(
        sample_models, tmp_path / "models", "pair", "square",
        **{"preferred_batch_size: [4, 8]": "preferred_batch_size: [2]",
           "max_queue_delay_microseconds: 2000": "max_queue_delay_microseconds: 500000"},
    )  # fmt: skip
    path = tmp_path / "pair.yaml"
    path.write_text(
        f"pipeline: pair\nmodels: {tmp_path / 'models'}\nruntime: {{max_in_flight: 1}}\n"
        "sources:\n"
        '  - {id: a, url: "test://?fps=20&frames=10&width=320&height=240"}\n'
        '  - {id: b, url: "test://?fps=20&frames=10&width=480&height=270"}\n'
        "stages:\n  - {name: objects, type: infer, model: pair}\n"
    )
    runtime = Runtime(load_config(path), nats_url=nats_server.url)
    await runtime.start()
    await runtime.wait(30)
    report = runtime.report()
    await runtime.stop()
    (pair,) = report.models
    assert pair.requests == 20
    assert max(pair.batch_sizes) == 2 and pair.batch_sizes[2] >= 1, pair.batch_sizes


@pytest.mark.parametrize("degrees", [0, 90, 180, 270])
@pytest.mark.parametrize("kind", ["box", "polygon"])
def test_a_box_found_in_a_turned_crop_maps_back_to_source_pixels(kind: str, degrees: int) -> None:
    image = np.full((120, 200, 3), 40, np.uint8)
    image[50:62, 90:110] = 255  # the object: x 90..110, y 50..62
    region = (70.0, 20.0, 130.0, 110.0)  # taller than wide: a polygon crop comes back turned
    x1, y1, x2, y2 = region
    if kind == "box":
        crop = cut_box(image, region)
    else:
        crop = cut_polygon(image, [(x1, y1), (x2, y1), (x2, y2), (x1, y2)])
    crop = rotate(crop, degrees) if degrees else crop
    # "Detect" the bright pixels in the crop, as the squares model does, and map them back.
    ys, xs = np.nonzero(crop.image.min(axis=2) > 200)
    found = (xs.min(), ys.min(), xs.max() + 1, ys.max() + 1)
    assert map_box(crop.to_source, found) == pytest.approx((90, 50, 110, 62), abs=1.0)
