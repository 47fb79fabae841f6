"""Readiness when frames arrive but a stage fails on every one of them."""

from __future__ import annotations

from pathlib import Path

from pipeline.config import load_config
from pipeline.frames import Frame
from pipeline.health import FAILING_FRAMES, readiness_problems
from pipeline.runtime import Runtime
from pipeline.stages.base import Stage, StageContext, StageOptions
from tests.pipeline.stack import stage_kinds, until


class Flaky(Stage):
    """Fails on every frame while ``failing`` is set (a seam standing for a broken stage)."""

    kind = "flaky"
    failing = True

    def __init__(self, options: StageOptions, context: StageContext) -> None:
        super().__init__(options, context)

    async def process(self, frame: Frame) -> None:
        if Flaky.failing:
            raise RuntimeError("broken on purpose")


async def test_a_source_whose_frames_all_fail_in_a_stage_makes_the_pipeline_not_ready(tmp_path: Path) -> None:
    path = tmp_path / "p.yaml"
    path.write_text(
        "pipeline: r\nsources: [{id: cam, url: 'test://?fps=30&width=160&height=120'}]\n"
        "stages: [{name: f, type: flaky}]\n"
    )
    Flaky.failing = True
    published: list[int] = []
    with stage_kinds(Flaky):
        rt = Runtime(load_config(path), nats_url=None, on_published=lambda f: published.append(f.index))
        await rt.start()
    try:
        run = rt.sources["cam"]
        await until(lambda: run.counters.failing >= FAILING_FRAMES, 60, "frames failing")
        problems = readiness_problems(rt.report())
        assert len(problems) == 1, problems
        assert problems[0].startswith("no source delivers frames: a stage fails on every one (cam: its last ")
        assert problems[0].endswith(" frames; see the log)")
        assert published == []
        # The stage recovers: the next message clears it.
        Flaky.failing = False
        await until(lambda: len(published) >= 1, 60, "a frame published")
        assert run.counters.failing == 0
        assert readiness_problems(rt.report()) == []
    finally:
        Flaky.failing = True
        await rt.stop()
