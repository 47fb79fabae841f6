"""Hot reload: a model's config changes while cameras keep running; a bad change is refused."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import pytest

from pipeline.nats_server import EmbeddedNats
from tests.conftest import Collector
from tests.pipeline.stack import Stack, until

PIPELINE = """\
pipeline: hot
models: {models}
http: {{listen: "127.0.0.1:0"}}
sources:
  - {{id: cam, url: "test://?fps=20&width=320&height=240"}}
stages:
  - {{name: objects, type: infer, model: squares,
      classes: [square]}}
"""


async def test_reload_swaps_a_model_without_stopping_the_stream(
    tmp_path: Path,
    sample_models: Path,
    nats_server: EmbeddedNats,
    collector: Collector,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="vidpipe")
    repo = tmp_path / "models"
    shutil.copytree(sample_models / "squares", repo / "squares")
    config = repo / "squares" / "config.yaml"
    await collector.start(nats_server.url)
    stack = await Stack.start(tmp_path, PIPELINE.format(models=repo), nats_server.url)
    try:
        await until(lambda: len(collector.messages) >= 5, what="first messages")
        assert all(len(m["objects"]) == 1 for m in collector.messages)

        # The square scores exactly 1.0 and a score must beat the threshold: nothing passes now.
        config.write_text(config.read_text().replace("confidence: 0.5", "confidence: 1.0"))
        status, body = await stack.json("POST", "/v1/models/squares/reload", json={})
        assert status == 200, body
        assert (body["name"], body["state"], body["reason"]) == ("squares", "ready", "")
        seen = len(collector.messages)
        await until(lambda: len(collector.messages) >= seen + 10, what="messages after the reload")
        assert [r.getMessage() for r in caplog.records if "reload" in r.getMessage()] == [
            "model squares reloaded: the model file on openvino (was the model file on openvino)"
        ]
        caplog.clear()
        assert collector.messages[-1]["objects"] == []

        # A broken config is refused with its FILE:LINE reason; the loaded copy keeps serving.
        config.write_text(config.read_text().replace("max_batch_size: 8", "max_batch_size: lots"))
        status, body = await stack.json("POST", "/v1/models/squares/reload", json={})
        assert status == 422
        assert body["state"] == "ready"
        assert body["error"].startswith("reload failed, still serving the previous load: ")
        assert (
            f"{config}:" in body["error"]
            and "max_batch_size: expected an integer, got 'lots'" in body["error"]
        )
        seen = len(collector.messages)
        await until(lambda: len(collector.messages) >= seen + 5, what="messages after the refused reload")

        # Copies that load but that the pipeline's stages cannot use are refused alike, with
        # the pipeline's FILE:LINE: a classifier under a whole-frame stage would drop every
        # frame; a renamed label would leave `classes: [square]` matching nothing.
        good = config.read_text().replace("max_batch_size: lots", "max_batch_size: 8")
        pipeline_file = str(stack.runtime.config.file)
        for change, problem in [
            (
                # Five labels for the five output values: the class count is checked at load.
                good.replace(
                    "  kind: yolo\n  layout: yolov8\n  confidence: 1.0\n", "  kind: classify\n"
                ).replace("labels: [square]", "labels: [square, a, b, c, d]"),
                f"{pipeline_file}:7: stages[0].model: model 'squares' is a classify model: it finds no "
                "objects, so it cannot run on whole frames (hint: run it on the objects of a detector "
                "stage: on: <that stage's name>)",
            ),
            (
                good.replace("labels: [square]", "labels: [box]"),
                f"{pipeline_file}:8: stages[0].classes: 'square' is not a label of model 'squares' "
                "(hint: its labels: box)",
            ),
            (
                # Without labels its objects are labelled "0": classes: [square] would match none.
                good.replace("labels: [square]\n", ""),
                f"{pipeline_file}:8: stages[0].classes: 'square' is not a class of model 'squares': the "
                "model has no labels, so its objects are labelled by class number (0, its only class) "
                "(hint: name its classes with labels: [...] in squares/config.yaml (one per class, in "
                "class order), or filter by number: classes: ['0'])",
            ),
        ]:
            assert change != good
            config.write_text(change)
            status, body = await stack.json("POST", "/v1/models/squares/reload", json={})
            assert (status, body["state"]) == (422, "ready"), body
            assert body["error"] == f"reload failed, still serving the previous load: {problem}"
        # A copy whose output its task: cannot decode is refused at load, not on every batch.
        config.write_text(good.replace("layout: yolov8", "layout: yolov5"))
        status, body = await stack.json("POST", "/v1/models/squares/reload", json={})
        assert (status, body["state"]) == (422, "ready"), body
        assert body["error"] == (
            f"reload failed, still serving the previous load: {config}:14: task.layout: output [1, 5, 1] "
            "is not yolov5 [N, A, 5+C]: needs at least 6 channels (hint: the output fits yolov8: set "
            "task.layout: yolov8)"
        )
        seen = len(collector.messages)
        await until(lambda: len(collector.messages) >= seen + 5, what="messages after the refused reloads")

        # Each refusal is one warning that says what still serves; no "unavailable" for a
        # model that never stopped serving.
        logged = [(r.levelname, r.getMessage()) for r in caplog.records if r.name.startswith("vidpipe")]
        warnings = [m for level, m in logged if level == "WARNING"]
        assert len(warnings) == 5 and all(
            m.startswith("model squares: reload failed, still serving the model file on openvino: ")
            for m in warnings
        ), warnings
        assert "max_batch_size: expected an integer, got 'lots'" in warnings[0]
        assert not any("unavailable" in m for _, m in logged), logged
        frames = [m["frame"] for m in collector.messages]
        assert frames == sorted(frames) and len(set(frames)) == len(frames)
        assert stack.runtime.report().sources[0].dropped.get("stage_error", 0) == 0

        status, body = await stack.json("POST", "/v1/models/nope/reload", json={})
        assert (status, body) == (404, {"error": "no model 'nope' in the repository"})
    finally:
        await stack.close()


async def test_a_model_no_stage_uses_is_unloaded_and_leaves_no_ready_series(
    tmp_path: Path, sample_models: Path, nats_server: EmbeddedNats, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="vidpipe")
    repo = tmp_path / "models"
    shutil.copytree(sample_models / "squares", repo / "squares")
    shutil.copytree(sample_models / "squares", repo / "spare")
    spare = repo / "spare" / "config.yaml"
    good = spare.read_text().replace("name: squares", "name: spare")
    stack = await Stack.start(tmp_path, PIPELINE.format(models=repo), nats_server.url)
    registry = stack.runtime.metrics.registry

    def ready(model: str) -> float | None:
        return registry.get_sample_value("vidpipe_model_ready", {"model": model})

    def logged(start: str) -> list[str]:
        return [r.getMessage() for r in caplog.records if r.getMessage().startswith(start)]

    try:
        assert ready("squares") == 1.0
        # A forced load that fails keeps nothing: no copy, and no ready series at 0 that the
        # `vidpipe_model_ready == 0` alert would page for.
        spare.write_text(good.replace("max_batch_size: 8", "max_batch_size: lots"))
        status, body = await stack.json("POST", "/v1/models/spare/reload", json={"force": True})
        assert (status, body["state"]) == (422, "unavailable"), body
        assert "max_batch_size: expected an integer, got 'lots'" in body["error"]
        assert ready("spare") is None
        assert logged("model spare unloaded: ") == [
            "model spare unloaded: its forced load failed and no stage uses it"
        ]
        status, models = await stack.json("GET", "/v1/models")
        assert [(m["name"], m["state"]) for m in models] == [("spare", "unloaded"), ("squares", "ready")]
        assert (await stack.json("DELETE", "/v1/models/spare")) == (
            404,
            {"error": "model 'spare' is not loaded"},
        )

        # One that loads serves until it is unloaded; a model a stage uses cannot be.
        spare.write_text(good)
        status, body = await stack.json("POST", "/v1/models/spare/reload", json={"force": True})
        assert (status, body["state"]) == (200, "ready"), body
        assert ready("spare") == 1.0
        assert (await stack.json("DELETE", "/v1/models/squares")) == (
            409,
            {
                "error": "model 'squares' is used by stage 'objects' of this pipeline; only a model no "
                "stage uses can be unloaded"
            },
        )
        assert (await stack.json("DELETE", "/v1/models/spare"))[0] == 204
        assert ready("spare") is None and ready("squares") == 1.0
        assert logged("model spare unloaded: ")[-1] == (
            "model spare unloaded: the model file on openvino (no stage uses it)"
        )
        status, models = await stack.json("GET", "/v1/models")
        assert [(m["name"], m["state"]) for m in models] == [("spare", "unloaded"), ("squares", "ready")]
        assert (await stack.json("DELETE", "/v1/models/spare"))[0] == 404
        assert (await stack.json("DELETE", "/v1/models/nope")) == (
            404,
            {"error": "model 'nope' is not loaded"},
        )

        # A model whose folder went away while it serves: 404, and the log says it still serves.
        (repo / "squares").rename(tmp_path / "squares.moved")
        status, body = await stack.json("POST", "/v1/models/squares/reload", json={})
        assert (status, body) == (404, {"error": "no model 'squares' in the repository"})
        assert logged("model squares: reload failed") == [
            f"model squares: reload failed, still serving the model file on openvino: no model 'squares' "
            f"in the repository {repo}"
        ]
        assert ready("squares") == 1.0
    finally:
        await stack.close()
