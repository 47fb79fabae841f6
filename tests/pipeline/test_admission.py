"""``runtime.admission: paced``: a frame enters the graph as the detector is about to be free.

The pacer runs here against a real :class:`DynamicBatcher` whose instance is a plain
function held at a gate, on a fake clock: the seam where batcher timing is pinned.
"""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path
from typing import Any

import pytest

import pipeline.admission as admission
from inference.batch_policy import BatchPolicy
from inference.batcher import DynamicBatcher
from inference.repository import read_source
from pipeline.admission import LEAD_MIN_S, LEAD_SHARE, STALE_S, AdmissionPacer, PacedModel, paced_models
from pipeline.config import load_config
from pipeline.frames import Frame
from pipeline.runtime import Runtime
from samples.make_clip import Plate, write_clip

WAIT = 10.0  # seconds; only ever reached when something is broken


class Clock:
    def __init__(self) -> None:
        self.now = 500.0

    def __call__(self) -> float:
        return self.now


class Instance:
    """One instance: a batch of n costs ``cost × n`` seconds on the clock, spent once ``gate`` opens."""

    def __init__(self, clock: Clock, cost: float) -> None:
        self.clock = clock
        self.cost = cost
        self.gate = threading.Event()
        self.started = threading.Semaphore(0)

    def __call__(self, items: list[Any]) -> list[Any]:
        self.started.release()
        assert self.gate.wait(WAIT)
        self.clock.now += self.cost * len(items)
        return items


@pytest.fixture
def held() -> Any:
    """A started batcher with one instance that has run one batch (its estimate: 0.1 s)."""
    clock = Clock()
    instance = Instance(clock, 0.1)
    batcher = DynamicBatcher("detector", BatchPolicy(max_batch_size=8), [instance], clock=clock)
    batcher.start()
    instance.gate.set()
    assert batcher.submit("warm").result(timeout=WAIT) == "warm"
    assert instance.started.acquire(timeout=WAIT)
    instance.gate.clear()
    yield clock, instance, batcher
    instance.gate.set()
    batcher.stop()


def lead(batch_seconds: float) -> float:
    return max(LEAD_MIN_S, LEAD_SHARE * batch_seconds)


def test_a_frame_waits_for_the_running_batch_and_the_next_one_for_the_frame_before_it(held: Any) -> None:
    clock, instance, batcher = held
    pacer = AdmissionPacer(lambda name: batcher, {"detector": PacedModel(1)}, clock=clock)
    assert pacer.wait_seconds() == 0.0  # an idle instance: in at once
    # That frame reaches the batcher and runs; 30 ms of its 100 have passed.
    running = batcher.submit("a")
    assert instance.started.acquire(timeout=WAIT)
    clock.now += 0.03
    # The next frame enters as the running batch is about to end; one deciding in the
    # same instant counts the first as ahead and waits for its batch too.
    assert pacer.wait_seconds() == pytest.approx(0.07 - lead(0.1))
    assert pacer.wait_seconds() == pytest.approx(0.17 - lead(0.1))
    # The first of them reaches the batcher: it is queued now and no longer "on its way".
    queued = batcher.submit("b")
    assert pacer.wait_seconds() == pytest.approx(0.27 - lead(0.1))
    # Frames admitted but never seen by the model (dropped on the way) stop counting
    # STALE_S after they were due in.
    clock.now += 0.3 + STALE_S
    assert pacer.wait_seconds() == pytest.approx(0.1 - lead(0.1))  # the queued one, its batch overdue
    instance.gate.set()
    assert running.result(timeout=WAIT) == "a" and queued.result(timeout=WAIT) == "b"


def test_a_batch_of_the_preferred_size_fills_before_the_next_frame_waits_for_another_instance(
    held: Any,
) -> None:
    clock, instance, batcher = held
    pacer = AdmissionPacer(lambda name: batcher, {"detector": PacedModel(4)}, clock=clock)
    running = batcher.submit("a")
    assert instance.started.acquire(timeout=WAIT)
    # Four frames deciding together make one batch of four at the end of the running one;
    # the fifth waits for that batch as well (0.4 s: four times the size seen).
    waits = [pacer.wait_seconds() for _ in range(5)]
    assert waits[:4] == [pytest.approx(0.1 - lead(0.4))] * 4
    assert waits[4] == pytest.approx(0.5 - lead(0.4))
    instance.gate.set()
    assert running.result(timeout=WAIT) == "a"


def test_with_an_interval_only_the_frames_the_detector_runs_on_wait(held: Any) -> None:
    clock, instance, batcher = held
    # interval: 2, frames 0, 3, 6, ... of each source run the detector.
    pacer = AdmissionPacer(lambda name: batcher, {"detector": PacedModel(1, every=(3,))}, clock=clock)
    running = batcher.submit("a")
    assert instance.started.acquire(timeout=WAIT)
    clock.now += 0.03
    # Frames 1 and 2 skip the detector: in at once, and they take no place in its queue.
    assert pacer.wait_seconds(1) == 0.0
    assert pacer.wait_seconds(2) == 0.0
    assert pacer.wait_seconds(3) == pytest.approx(0.07 - lead(0.1))
    assert pacer.wait_seconds(6) == pytest.approx(0.17 - lead(0.1))  # behind frame 3
    instance.gate.set()
    assert running.result(timeout=WAIT) == "a"


def test_nothing_to_pace_on_means_no_wait() -> None:
    clock = Clock()
    instance = Instance(clock, 0.1)
    batcher = DynamicBatcher("detector", BatchPolicy(max_batch_size=8), [instance], clock=clock)
    batcher.start()
    try:
        paced = {"detector": PacedModel(1)}
        assert AdmissionPacer(lambda name: batcher, paced, clock=clock).wait_seconds() == 0.0
        assert AdmissionPacer(lambda name: None, paced, clock=clock).wait_seconds() == 0.0
    finally:
        batcher.stop()


async def test_an_instance_that_comes_free_early_lets_the_held_frame_in(
    held: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    clock, instance, batcher = held
    # A batch that took 1000 s: the estimate is now so long that only the instance coming
    # free can end the wait.
    instance.cost = 1000.0
    instance.gate.set()
    assert batcher.submit("slow").result(timeout=WAIT) == "slow"
    assert instance.started.acquire(timeout=WAIT)
    instance.gate.clear()
    monkeypatch.setattr(admission, "MAX_WAIT_S", 3600.0)
    pacer = AdmissionPacer(lambda name: batcher, {"detector": PacedModel(1)}, clock=clock)
    await pacer.wait()  # idle: in at once, and the pacer now hears the instance
    running = batcher.submit("a")
    assert instance.started.acquire(timeout=WAIT)
    waiting = asyncio.create_task(pacer.wait())
    await asyncio.sleep(0)
    assert not waiting.done() and pacer.paced == 1
    instance.gate.set()  # the batch ends (the instance finds its queue empty)
    await asyncio.wait_for(waiting, WAIT)
    assert pacer.woken == 1
    assert await asyncio.wrap_future(running) == "a"


PIPELINE = """\
pipeline: paced
models: {models}
sources:
  - {{id: cam, url: {clip}}}
stages:
  - {{name: objects, type: infer, model: {model}{interval}}}
{runtime}"""


def config(
    tmp_path: Path, models: Path, clip: Path, runtime: str = "", interval: str = "", model: str = "squares"
) -> Any:
    path = tmp_path / "p.yaml"
    path.write_text(
        PIPELINE.format(models=models, clip=clip, runtime=runtime, interval=interval, model=model)
    )
    return load_config(path)


@pytest.mark.parametrize(
    ("runtime", "interval", "expected"),
    [
        ("", "", {"squares": PacedModel(8)}),  # the default; the sample's preferred batch is [4, 8]
        ("runtime: {admission: eager}\n", "", {}),
        ("runtime: {max_in_flight: 2}\n", "", {}),  # a limit set by hand is kept as it is
        ("", ", interval: 2", {"squares": PacedModel(8, every=(3,))}),  # frames 0, 3, 6, ... only
        ("", ", interval: auto", {}),  # decided on the tracks in the stage, after admission
    ],
)
def test_which_pipelines_are_paced(
    tmp_path: Path, sample_models: Path, runtime: str, interval: str, expected: dict[str, PacedModel]
) -> None:
    cfg = config(tmp_path, sample_models, tmp_path / "c.mp4", runtime, interval)
    models = {"squares": read_source(sample_models, "squares").config}
    assert paced_models(cfg, models) == expected


def one_instance_text_detector(tmp_path: Path, sample_models: Path) -> Path:
    """A repository holding the sample PP-OCR text detector on one instance, taking single frames."""
    repo = tmp_path / "models"
    (repo / "ppocr_det").mkdir(parents=True)
    conf = (sample_models / "ppocr_det" / "config.yaml").read_text()
    conf = conf.replace("preferred_batch_size: [16]", "preferred_batch_size: []")
    conf = conf.replace(
        "instance_group: [{count: 2, kind: KIND_CPU}]", "instance_group: [{count: 1, kind: KIND_CPU}]"
    )
    (repo / "ppocr_det" / "config.yaml").write_text(conf)
    return repo


async def test_a_paced_pipeline_holds_frames_and_publishes_what_an_eager_one_does(
    tmp_path: Path, sample_models: Path
) -> None:
    # The real text detector with one instance taking single frames (the graph holds
    # two): it takes tens of milliseconds a frame on any CPU, so the frame behind the
    # running one is held until that one is about to end, from the first batch on.
    repo = one_instance_text_detector(tmp_path, sample_models)
    plates = (Plate("KA05 MX2231", start=0, y=70, x=100), Plate("GATE B7", start=0, y=200, x=300))
    clip = write_clip(tmp_path / "c.mp4", frames=10, fps=10, plates=plates)
    published: dict[str, list[tuple[int, list[Any]]]] = {}
    runtimes: dict[str, Runtime] = {}
    for mode in ("paced", "eager"):
        out = published[mode] = []

        def keep(frame: Frame, out: list[tuple[int, list[Any]]] = out) -> None:
            boxes = [(o.label, [round(v) for v in o.bbox]) for o in frame.objects]
            out.append((frame.index, boxes))

        cfg = config(tmp_path, repo, clip, f"runtime: {{admission: {mode}}}\n", model="ppocr_det")
        rt = runtimes[mode] = Runtime(cfg, nats_url=None, on_published=keep)
        await rt.start()
        await rt.wait(120)
        await rt.stop()
    assert [i for i, _ in published["paced"]] == list(range(10))
    assert published["paced"] == published["eager"]
    assert [len(boxes) for _, boxes in published["paced"]] == [2] * 10  # both plates, every frame
    paced, eager = runtimes["paced"], runtimes["eager"]
    assert paced.pacer.names == ["ppocr_det"] and eager.pacer.names == []
    # Frames 3-10 each decided while another frame was running (the first two went in
    # before any batch had run: nothing to estimate from).
    assert paced.pacer.paced >= 1 and eager.pacer.paced == 0
    held = paced.metrics.registry.get_sample_value("vidpipe_admission_held_total", {"pipeline": "paced"})
    assert held == paced.pacer.paced


async def test_with_an_interval_the_pipeline_holds_only_frames_the_detector_runs_on(
    tmp_path: Path, sample_models: Path
) -> None:
    # Three sources on one instance of the real text detector, two frames each in the
    # graph (the derived six, for a detector on one frame in three): frame 3 of the
    # first source decides as soon as its frame 0 is out, while the others' frames 0 run.
    repo = one_instance_text_detector(tmp_path, sample_models)
    plates = (Plate("GATE B7", start=0, y=200, x=300),)
    clip = write_clip(tmp_path / "c.mp4", frames=9, fps=10, plates=plates)
    path = tmp_path / "p.yaml"
    path.write_text(
        f"""\
pipeline: interval
models: {repo}
sources: [{{id: a, url: {clip}}}, {{id: b, url: {clip}}}, {{id: c, url: {clip}}}]
stages:
  - {{name: text, type: infer, model: ppocr_det, interval: 2}}
"""
    )
    published: list[tuple[str, int, int]] = []
    rt = Runtime(
        load_config(path),
        nats_url=None,
        on_published=lambda f: published.append((f.source, f.index, len(f.objects))),
    )
    await rt.prepare()
    # A spy on the pacer: which frame numbers it was asked about, and which it held.
    asked: list[tuple[int, bool]] = []  # (-1: no frame number given)
    wait = rt.pacer.wait

    async def spy(index: int | None = None) -> float:
        held = await wait(index)
        asked.append((-1 if index is None else index, held > 0))
        return held

    rt.pacer.wait = spy  # type: ignore[method-assign]
    rt.start_sources()
    await rt.wait(120)
    await rt.stop()
    for source in "abc":
        # Every frame published in order; the plate on the frames the detector ran on.
        assert [(i, n) for s, i, n in published if s == source] == [
            (i, 1 if i % 3 == 0 else 0) for i in range(9)
        ]
    assert sorted(i for i, _ in asked) == sorted(list(range(9)) * 3)
    held = [i for i, was_held in asked if was_held]
    assert held and all(i % 3 == 0 for i in held), asked
    assert rt.pacer.paced == len(held)
