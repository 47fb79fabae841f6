"""Cascades: a stage `on:` another runs on crops of its objects, from every source at once."""

from __future__ import annotations

import shutil
from pathlib import Path

from pipeline.config import load_config
from pipeline.nats_server import EmbeddedNats
from pipeline.runtime import Runtime
from pipeline.sources.pattern import pattern_square_box
from tests.conftest import Collector

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
