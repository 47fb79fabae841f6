"""``runtime.max_in_flight``: derived from the models' instances and the sources unless set."""

from __future__ import annotations

import asyncio
import shutil
from dataclasses import replace
from pathlib import Path

import pytest

from inference.config import DynamicBatching, InstanceGroup, ModelConfig
from inference.repository import read_source
from pipeline.config import PipelineConfig, load_config
from pipeline.frames import Frame
from pipeline.runtime import Runtime, derive_graph_limit, derive_max_in_flight
from pipeline.stages.base import Stage, StageContext, StageOptions
from samples.make_clip import write_clip
from tests.pipeline.stack import stage_kinds, until

PIPELINE = """\
pipeline: flight
models: {models}
sources:
{sources}
stages:
  - {{name: objects, type: infer, model: squares}}
  - {{name: probe, type: flight_probe}}
{runtime}"""


def squares(sample_models: Path, count: int, preferred: list[int], max_batch: int = 8) -> ModelConfig:
    cfg = read_source(sample_models, "squares").config
    return replace(
        cfg,
        max_batch_size=max_batch,
        instance_group=[InstanceGroup(count=count)],
        dynamic_batching=DynamicBatching(preferred_batch_size=preferred),
    )


def pipeline(tmp_path: Path, sample_models: Path, runtime: str = "", sources: int = 1) -> PipelineConfig:
    lines = "".join(f"  - {{id: s{i}, url: 'test://?frames=1'}}\n" for i in range(sources))
    path = tmp_path / "p.yaml"
    path.write_text(PIPELINE.format(models=sample_models, sources=lines, runtime=runtime))
    with stage_kinds(FlightProbe):
        return load_config(path)


@pytest.mark.parametrize(
    ("count", "preferred", "max_batch", "sources", "expected"),
    [
        (1, [], 8, 1, 2),  # one instance, single requests: one frame at work, one ready
        (2, [], 8, 1, 4),  # two instances
        (2, [], 8, 4, 1),  # fewer slots than sources: one each, never zero (the graph limit holds)
        (1, [4, 8], 8, 1, 16),  # an instance takes batches of up to eight
        (1, [4, 8], 8, 3, 5),  # sixteen shared by three sources, rounded down
        (2, [], 0, 1, 4),  # no batch dimension: one frame per instance
        (4, [2], 8, 3, 5),
    ],
)
def test_max_in_flight_unset_is_twice_the_frames_the_instances_work_on_shared_over_sources(
    tmp_path: Path,
    sample_models: Path,
    count: int,
    preferred: list[int],
    max_batch: int,
    sources: int,
    expected: int,
) -> None:
    cfg = pipeline(tmp_path, sample_models)
    assert cfg.runtime.max_in_flight is None
    model = squares(sample_models, count, preferred, max_batch)
    assert derive_max_in_flight(cfg, {"squares": model}, sources) == expected
    work = count * (max(preferred, default=1) if max_batch else 1)
    assert derive_graph_limit(cfg, {"squares": model}) == 2 * work


@pytest.mark.parametrize(
    ("interval", "admission", "expected"), [("2", "paced", 12), ("2", "eager", 4), ("auto", "paced", 4)]
)
def test_a_paced_detector_with_an_interval_gets_room_for_the_frames_it_skips(
    tmp_path: Path, sample_models: Path, interval: str, admission: str, expected: int
) -> None:
    # Two instances of one frame each: four frames the detector runs on, and with
    # interval: 2 the two frames after each of them (paced: held detector frames leave
    # the room to frames it skips; eager, it would fill the detector's queue).
    path = tmp_path / "p.yaml"
    path.write_text(
        f"pipeline: p\nmodels: {sample_models}\nsources: [{{url: 'test://?frames=1'}}]\n"
        f"stages:\n  - {{name: objects, type: infer, model: squares, interval: {interval}}}\n"
        f"runtime: {{admission: {admission}}}\n"
    )
    model = squares(sample_models, 2, [])
    assert derive_graph_limit(load_config(path), {"squares": model}) == expected


def test_an_explicit_max_in_flight_wins_over_the_derived_one(tmp_path: Path, sample_models: Path) -> None:
    cfg = pipeline(tmp_path, sample_models, "runtime: {max_in_flight: 3}\n")
    assert derive_max_in_flight(cfg, {"squares": squares(sample_models, 4, [8], 8)}, 1) == 3
    assert derive_max_in_flight(cfg, {"squares": squares(sample_models, 1, [], 8)}, 16) == 3
    assert derive_graph_limit(cfg, {"squares": squares(sample_models, 1, [], 8)}) is None


def test_a_pipeline_without_models_keeps_two_frames_in_flight(tmp_path: Path) -> None:
    path = tmp_path / "p.yaml"
    path.write_text(
        "pipeline: p\nsources: [{url: 'test://?frames=1'}]\nstages:\n  - {name: t, type: track}\n"
    )
    assert derive_max_in_flight(load_config(path), {}, 1) == 2


class FlightProbe(Stage):
    """Holds each source's frames until ``hold`` of them are inside (a seam, not a model); records the peak."""

    kind = "flight_probe"
    hold = 1

    def __init__(self, options: StageOptions, context: StageContext) -> None:
        super().__init__(options, context)
        self.now: dict[str, int] = {}
        self.peak: dict[str, int] = {}
        self.changed = asyncio.Condition()

    async def process(self, frame: Frame) -> None:
        async with self.changed:
            self.now[frame.source] = self.now.get(frame.source, 0) + 1
            self.peak[frame.source] = max(self.peak.get(frame.source, 0), self.now[frame.source])
            self.changed.notify_all()
            # The timeout only frees a last group smaller than `hold` (none with these counts).
            await asyncio.wait_for(
                self.changed.wait_for(lambda: self.peak[frame.source] >= self.hold), timeout=30
            )
            self.now[frame.source] -= 1


@pytest.mark.parametrize(("runtime", "expected"), [("", 4), ("runtime: {max_in_flight: 3}\n", 3)])
async def test_running_sources_hold_the_derived_or_the_explicit_frames_in_flight_exactly(
    tmp_path: Path, sample_models: Path, runtime: str, expected: int
) -> None:
    # Four instances taking single frames, two sources: the graph holds 2 × 4 frames,
    # 8 // 2 = 4 per source.
    repo = tmp_path / "models"
    shutil.copytree(sample_models / "squares", repo / "squares")
    conf = repo / "squares" / "config.yaml"
    text = conf.read_text().replace("preferred_batch_size: [4, 8]", "preferred_batch_size: []")
    conf.write_text(text.replace("instance_group: [{count: 1,", "instance_group: [{count: 4,"))
    clip = write_clip(tmp_path / "c.mp4", frames=24, fps=30, width=160, height=120)
    path = tmp_path / "p.yaml"
    sources = f"  - {{id: a, url: {clip}}}\n  - {{id: b, url: {clip}}}\n"
    path.write_text(PIPELINE.format(models=repo, sources=sources, runtime=runtime))
    FlightProbe.hold = expected
    published: dict[str, int] = {}

    def count(frame: Frame) -> None:
        published[frame.source] = published.get(frame.source, 0) + 1

    with stage_kinds(FlightProbe):
        rt = Runtime(load_config(path), nats_url=None, on_published=count)
        await rt.start()
    probe = next(s for s in rt.stages if isinstance(s, FlightProbe))
    assert [run.max_in_flight for run in rt.sources.values()] == [expected, expected]
    await rt.wait(60)
    await rt.stop()
    assert probe.peak == {"a": expected, "b": expected}
    assert published == {"a": 24, "b": 24}


class GraphProbe(Stage):
    """Holds every frame until ``release`` is set (a seam, not a model); counts the frames inside."""

    kind = "graph_probe"

    def __init__(self, options: StageOptions, context: StageContext) -> None:
        super().__init__(options, context)
        self.now = 0
        self.release = asyncio.Event()

    async def process(self, frame: Frame) -> None:
        self.now += 1
        await self.release.wait()
        self.now -= 1


async def test_more_sources_than_graph_slots_share_them_and_never_exceed_the_graph_limit(
    tmp_path: Path, sample_models: Path
) -> None:
    # One instance taking single frames: the graph holds two frames, whatever the
    # number of sources. Four sources at one frame each would put four inside.
    repo = tmp_path / "models"
    shutil.copytree(sample_models / "squares", repo / "squares")
    conf = repo / "squares" / "config.yaml"
    conf.write_text(conf.read_text().replace("preferred_batch_size: [4, 8]", "preferred_batch_size: []"))
    clip = write_clip(tmp_path / "c.mp4", frames=12, fps=30, width=160, height=120)
    path = tmp_path / "p.yaml"
    sources = "".join(f"  - {{id: s{i}, url: {clip}}}\n" for i in range(4))
    # The probe comes first: from a source's queue to the probe everything happens on
    # the event loop, so a few loop turns are enough for any free intake to get there.
    path.write_text(
        "pipeline: graph\n"
        f"models: {repo}\n"
        f"sources:\n{sources}"
        "stages:\n"
        "  - {name: probe, type: graph_probe}\n"
        "  - {name: objects, type: infer, model: squares}\n"
    )
    published: dict[str, int] = {}

    def count(frame: Frame) -> None:
        published[frame.source] = published.get(frame.source, 0) + 1

    with stage_kinds(GraphProbe):
        rt = Runtime(load_config(path), nats_url=None, on_published=count)
        await rt.start()
    probe = next(s for s in rt.stages if isinstance(s, GraphProbe))
    runs = list(rt.sources.values())
    assert [run.max_in_flight for run in runs] == [1, 1, 1, 1]
    # Every source has a frame waiting, and two frames are inside.
    await until(lambda: probe.now == 2 and all(len(run.queue) for run in runs), what="two frames inside")
    for _ in range(50):
        await asyncio.sleep(0)
    assert probe.now == 2
    probe.release.set()
    await rt.wait(60)
    await rt.stop()
    assert published == {"s0": 12, "s1": 12, "s2": 12, "s3": 12}
