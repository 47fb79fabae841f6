"""The tuner: the search finds a known best on a synthetic cost model, the pick rule, --write edits."""

from __future__ import annotations

import asyncio
import dataclasses
import difflib
import math
import shutil
from pathlib import Path

import numpy as np
import onnx

from inference.repository import read_source
from inference.tuning import (
    MachineProbe,
    SearchSpace,
    TrialPoint,
    TrialResult,
    TrialRunner,
    choose_instances,
    coordinate_descent,
    fixed_batch_of,
    pick,
    sample_images,
    tune,
    tuned_config_text,
    write_tuned_config,
)
from samples.build_models import square_detector

SPACE = SearchSpace(
    backends=("openvino", "onnxruntime"),
    precisions=("auto", "f32"),
    instances=(1, 2, 4),
    threads=(0, 1, 2),
    batches=(1, 2, 4, 8, 16),
    delays_us=(0, 500, 2000, 5000),
)
START = TrialPoint("onnxruntime", "native", 1, 0, 8, (4, 8), 2000)
# Where the synthetic machine is fastest.
BEST = TrialPoint("openvino", "auto", 2, 1, 16, (8, 16), 500)


class CostModel:
    """A machine whose throughput and latency are known functions of the knobs.

    Each knob contributes a factor that peaks at :data:`BEST`; p99 grows with
    the batch and the queue delay, so a latency budget rules out big batches.
    Every measurement advances a fake clock by ``trial_s``.
    """

    def __init__(self, trial_s: float = 1.0) -> None:
        self.now = 0.0
        self.trial_s = trial_s
        self.measured: list[TrialPoint] = []

    def clock(self) -> float:
        return self.now

    async def __call__(self, p: TrialPoint) -> TrialResult:
        self.measured.append(p)
        self.now += self.trial_s
        rate = 1000.0
        rate *= {"openvino": 2.0, "onnxruntime": 1.0}[p.backend]
        rate *= {"auto": 1.5, "f32": 1.0, "native": 1.0}[p.precision]
        rate *= {1: 0.7, 2: 1.0, 4: 0.8}[p.instances]
        rate *= {0: 0.9, 1: 1.0, 2: 0.85}[p.threads]
        rate *= 1.0 + 0.1 * math.log2(p.max_batch_size)
        rate *= 1.1 if len(p.preferred) == 2 else 1.0
        rate *= {0: 0.9, 500: 1.0, 2000: 0.95, 5000: 0.9}[p.delay_us]
        p99 = 2.0 * p.max_batch_size + p.delay_us / 1000
        return TrialResult(
            p, throughput=rate, p50_ms=p99 / 2, p99_ms=p99, mean_batch=p.max_batch_size, requests=100
        )


async def test_coordinate_descent_finds_the_known_best_point_without_the_whole_grid() -> None:
    machine = CostModel()
    log = await coordinate_descent(START, SPACE, machine, budget_s=1000, clock=machine.clock)
    best = max(log.results, key=lambda r: r.throughput)
    assert best.point == BEST
    assert pick(log.results, None) is best
    # Each point once, far fewer than the grid, and the first is the model's own config.
    assert len(machine.measured) == len(set(machine.measured)) == len(log.results)
    assert len(log.results) < SPACE.size() / 10
    assert machine.measured[0] == START
    # The second pass changed nothing, so the search stopped by itself.
    assert log.passes == 2 and not log.stopped_by_budget


async def test_a_latency_budget_steers_the_search_to_the_best_point_within_it() -> None:
    machine = CostModel()
    # p99 = 2 ms per batch item + the delay: 10 ms allows batch 4 with 500 us at most.
    log = await coordinate_descent(
        START, SPACE, machine, budget_s=1000, latency_budget_ms=10, clock=machine.clock
    )
    chosen = pick(log.results, 10)
    assert chosen is not None
    assert chosen.point == dataclasses.replace(BEST, max_batch_size=4, preferred=(2, 4))
    assert chosen.p99_ms == 8.5


async def test_the_search_stops_at_its_time_budget_with_what_it_measured() -> None:
    machine = CostModel(trial_s=1.0)
    lines: list[int] = []
    log = await coordinate_descent(
        START, SPACE, machine, budget_s=5, clock=machine.clock, on_result=lambda n, r: lines.append(n)
    )
    # A trial starts only while elapsed + the longest trial fits: 5 trials of 1 s.
    assert len(log.results) == 5 and log.stopped_by_budget
    assert lines == [1, 2, 3, 4, 5]


def test_points_within_three_percent_are_a_tie_won_by_the_lower_p99() -> None:
    def result(rate: float, p99: float, **kw: object) -> TrialResult:
        point = dataclasses.replace(START, delay_us=int(p99 * 100))
        return TrialResult(point, throughput=rate, p50_ms=1, p99_ms=p99, requests=10, **kw)  # type: ignore[arg-type]

    fastest, close_but_calmer, slower = result(1000, 40), result(980, 12), result(950, 5)
    failed = result(5000, 1, error="OpenVINO cannot compile")
    rejecting = result(4000, 1, rejected=3)
    results = [fastest, close_but_calmer, slower, failed, rejecting]
    assert pick(results, None) is close_but_calmer
    assert pick(results, 10) is slower
    assert pick(results, 1) is None


def test_the_space_keeps_preferred_sizes_valid_when_the_max_batch_changes() -> None:
    neighbours = SPACE.neighbours(START, "max_batch_size")
    assert [(p.max_batch_size, p.preferred) for p in neighbours] == [
        (1, ()),
        (2, (2,)),
        (4, (2, 4)),
        (8, (4, 8)),
        (16, (8, 16)),
    ]
    to_ov = SPACE.neighbours(START, "backend")
    assert [(p.backend, p.precision) for p in to_ov] == [("openvino", "auto"), ("onnxruntime", "native")]
    assert SPACE.values("precision", START) == ["native"]


CLS_CONFIG = Path(__file__).resolve().parents[2] / "samples" / "models" / "ppocr_cls" / "config.yaml"


def test_writing_a_pick_changes_only_the_tuned_lines_and_keeps_comments(tmp_path: Path) -> None:
    src = read_source(CLS_CONFIG.parents[1], "ppocr_cls")
    original = CLS_CONFIG.read_text()
    point = dataclasses.replace(
        TrialPoint.from_config(src.config),
        instances=1,
        threads=2,
        max_batch_size=16,
        preferred=(8, 16),
        delay_us=500,
    )
    text, changes = tuned_config_text(original, src.config, point, str(CLS_CONFIG))
    diff = [
        line
        for line in difflib.unified_diff(original.splitlines(), text.splitlines(), lineterm="", n=0)
        if line[:1] in "+-" and not line.startswith(("+++", "---"))
    ]
    assert diff == [
        "-max_batch_size: 32",
        "+max_batch_size: 16",
        "-  preferred_batch_size: [16, 32]",
        "-  max_queue_delay_microseconds: 3000",
        "+  preferred_batch_size: [8, 16]",
        "+  max_queue_delay_microseconds: 500",
        "-instance_group: [{count: 2, kind: KIND_CPU}]",
        "-backend_options: {precision: auto}",
        "+instance_group: [{count: 1, kind: KIND_CPU}]",
        "+backend_options: {precision: auto, threads: 2}",
    ]
    assert changes == [
        "max_batch_size: 32 -> 16",
        "dynamic_batching.preferred_batch_size: [16, 32] -> [8, 16]",
        "dynamic_batching.max_queue_delay_microseconds: 3000 -> 500",
        "instance_group[0].count: 2 -> 1",
        "backend_options.threads: (unset) -> 2",
    ]
    # Written and read back, the file says exactly the pick; the rest of the config is unchanged.
    (tmp_path / "ppocr_cls").mkdir()
    target = tmp_path / "ppocr_cls" / "config.yaml"
    target.write_text(original)
    assert write_tuned_config(target, point) == changes
    again = read_source(tmp_path, "ppocr_cls").config
    assert TrialPoint.from_config(again) == point
    assert again.input == src.config.input and again.labels == src.config.labels
    assert again.dynamic_batching.default_queue_policy == src.config.dynamic_batching.default_queue_policy
    # The pick already in the file: nothing to write, not a byte changes.
    assert write_tuned_config(target, point) == []
    assert target.read_text() == text


def test_switching_backend_writes_the_runtime_s_own_thread_key() -> None:
    src = read_source(CLS_CONFIG.parents[1], "ppocr_cls")
    point = dataclasses.replace(
        TrialPoint.from_config(src.config), backend="onnxruntime", precision="native", threads=1
    )
    text, changes = tuned_config_text(CLS_CONFIG.read_text(), src.config, point, str(CLS_CONFIG))
    # OpenVINO's precision does not apply to ONNX Runtime: it goes, or the file would not load.
    assert changes == [
        "backend: openvino -> onnxruntime",
        "backend_options.precision: auto -> (unset)",
        "backend_options.intra_op_threads: (unset) -> 1",
    ]
    assert "backend: onnxruntime\n" in text
    assert "backend_options: {intra_op_threads: 1}\n" in text


def test_inputs_are_rendered_text_lines_or_scenes_at_the_model_s_size(sample_models: Path) -> None:
    cls = read_source(sample_models, "ppocr_cls").config
    crops = sample_images(cls, count=10)
    assert all(
        c.dtype == np.uint8 and c.ndim == 3 and c.shape[0] >= 40 and c.shape[1] > c.shape[0] for c in crops
    )
    # Every third crop is the same kind of line upside down, for the orientation classifier.
    # (7 words: crop 9 is crop 2's word the right way up.)
    assert crops[0].min() < 60 and crops[0].max() > 200
    assert np.array_equal(crops[2], crops[9][::-1, ::-1]) and not np.array_equal(crops[2], crops[9])
    squares = read_source(sample_models, "squares").config
    scenes = sample_images(squares, count=3)
    assert [s.shape for s in scenes] == [(320, 320, 3)] * 3
    # The bright square the squares model finds is there.
    assert all((s == 255).all(axis=2).sum() >= 32 * 32 for s in scenes)


async def test_a_real_trial_measures_a_number_of_answers_under_closed_loop_load(sample_models: Path) -> None:
    src = read_source(sample_models, "squares")
    runner = TrialRunner(src, concurrency=4, inferences=40, warmup=8)
    point = dataclasses.replace(TrialPoint.from_config(src.config), max_batch_size=4, preferred=(4,))
    result = await asyncio.wait_for(runner(point), timeout=60)
    assert result.error == "" and result.rejected == 0
    # Exactly the answers asked for are timed, however long they take on this machine.
    assert result.requests == 40 and result.throughput > 0
    assert 0 < result.p50_ms <= result.p99_ms
    # Four callers and a preferred size of 4: batches of up to 4.
    assert 1.0 <= result.mean_batch <= 4.0
    assert result.precision in ("bf16", "f32")
    # At least four answers per caller, whatever is asked.
    assert TrialRunner(src, concurrency=8, inferences=4).inferences == 32
    # A point the model cannot take is a failed trial with the loader's reason, not a crash.
    bad = await runner(dataclasses.replace(point, backend="tensorrt"))
    assert bad.requests == 0 and "tensorrt" in bad.error.lower()


async def test_a_trial_under_stream_load_decodes_a_video_per_caller(
    sample_models: Path, demo_clip: Path
) -> None:
    src = read_source(sample_models, "squares")
    # 45 frames in the clip, 3 streams x (warm-up + timed) answers: every stream loops past its end.
    runner = TrialRunner(src, concurrency=3, inferences=60, warmup=90, stream_file=str(demo_clip))
    result = await asyncio.wait_for(runner(TrialPoint.from_config(src.config)), timeout=120)
    assert result.error == "" and result.requests == 60 and result.throughput > 0


def batch_one_repo(tmp_path: Path, sample_models: Path) -> Path:
    """The squares model exported with a fixed batch of 1 (as ultralytics does by default)."""
    model = square_detector(320, 320)
    for value in (*model.graph.input, *model.graph.output):
        value.type.tensor_type.shape.dim[0].dim_value = 1
    folder = tmp_path / "squares"
    folder.mkdir()
    onnx.save(model, str(folder / "model.onnx"))
    text = (sample_models / "squares" / "config.yaml").read_text()
    (folder / "config.yaml").write_text(
        text.replace("max_batch_size: 8", "max_batch_size: 1").replace("preferred_batch_size: [4, 8]", "")
    )
    return tmp_path


def test_a_fixed_batch_model_is_searched_only_at_the_batches_it_takes(
    tmp_path: Path, sample_models: Path
) -> None:
    src = read_source(batch_one_repo(tmp_path, sample_models), "squares")
    assert fixed_batch_of(src) == 1
    assert fixed_batch_of(read_source(sample_models, "squares")) is None
    space = SearchSpace.for_model(src.config, concurrency=8, cpus=2, fixed_batch=1)
    assert space.batches == (1,)
    assert space.skipped_batches == (2, 4, 8)
    # OpenVINO running a batch as static pieces of one takes any batch.
    pieces = dataclasses.replace(
        src.config,
        backend_options=dataclasses.replace(src.config.backend_options, static_batch_sizes=[1]),
    )
    assert SearchSpace.for_model(pieces, concurrency=8, cpus=2, fixed_batch=1).batches == (1, 2, 4, 8)


class ShiftingMachine:
    """A machine whose speed is a function of the knobs times how busy it is at each call.

    ``busy[i]`` slows the i-th measurement (1.0 = quiet); points without an entry are quiet.
    """

    def __init__(self, rates: dict[int, float], busy: dict[int, float] | None = None) -> None:
        self.rates = rates  # instances -> answers per second on a quiet machine
        self.busy = busy or {}
        self.measured: list[TrialPoint] = []

    async def __call__(self, p: TrialPoint) -> TrialResult:
        n = len(self.measured)
        self.measured.append(p)
        rate = self.rates.get(p.instances, 1.0) * self.busy.get(n, 1.0)
        return TrialResult(p, throughput=rate, p50_ms=1.0, p99_ms=2.0, mean_batch=1.0, requests=64)


def quiet_probe() -> MachineProbe:
    return MachineProbe(loadavg=lambda: 0.1, cpu_times=lambda: (0, 1000), cpus=2)


async def test_a_pick_that_does_not_beat_the_current_config_in_interleaved_turns_is_not_written(
    sample_models: Path,
) -> None:
    # On a quiet machine 1 and 2 instances are equally fast; the first measurement (the current
    # config, 1 instance) happened while something else ran, so 2 instances looked 40% faster.
    machine = ShiftingMachine({1: 100.0, 2: 101.0}, busy={0: 0.6})
    report = await tune(
        sample_models, "squares", concurrency=4, budget_s=1000, measure=machine, probe=quiet_probe(),
        verify_rounds=3,
    )  # fmt: skip
    assert report.picked is not None and report.picked.point.instances != 1
    assert report.verification is not None and not report.verification.faster
    assert report.to_write is None
    summary = report.summary()
    assert (
        "the pick ran 101.0/s against the current 100.0/s (1.01x, median of 3 interleaved turn(s) each)"
        in (summary)
    )
    assert "not faster: the current configuration stays" in summary
    # The turns alternate: current, pick, pick, current, current, pick.
    turns = [p.instances for p in machine.measured[-6:]]
    assert turns[0] == turns[3] == turns[4] == 1 and 1 not in (turns[1], turns[2], turns[5])


async def test_a_pick_that_beats_the_current_config_in_interleaved_turns_is_written(
    sample_models: Path,
) -> None:
    machine = ShiftingMachine({1: 100.0, 2: 150.0})
    report = await tune(
        sample_models, "squares", concurrency=4, budget_s=1000, measure=machine, probe=quiet_probe()
    )
    assert report.verification is not None and report.verification.faster
    assert report.to_write == report.picked.point  # type: ignore[union-attr]
    assert report.machine is not None and report.machine.reasons() == []
    assert "busy machine" not in report.summary()


async def test_a_busy_machine_is_noticed_and_reported(sample_models: Path) -> None:
    machine = ShiftingMachine({1: 100.0, 2: 100.0})
    ticks = iter([(100, 1000), (300, 2000)])  # 200 of 1000 jiffies stolen during the search
    probe = MachineProbe(loadavg=lambda: 1.6, cpu_times=lambda: next(ticks), cpus=2)
    # The current config's second measurement (the last one before verification) runs at 70%.
    calls = 0

    async def slowing(p: TrialPoint) -> TrialResult:
        nonlocal calls
        calls += 1
        result = await machine(p)
        return dataclasses.replace(result, throughput=70.0) if calls > 1 and p == start else result

    start = TrialPoint.from_config(read_source(sample_models, "squares").config)
    report = await tune(
        sample_models, "squares", concurrency=4, budget_s=1000, measure=slowing, probe=probe, verify_rounds=0
    )
    assert report.machine is not None
    assert report.machine.reasons() == [
        "load average 1.6 on 2 CPU(s) before the search",
        "20% of CPU time stolen by other guests during the search",
        "the current configuration ran 100.0/s at the start and 70.0/s at the end (30% apart)",
    ]
    assert "busy machine: load average 1.6 on 2 CPU(s)" in report.summary()
    assert "tune again on a quiet machine" in report.summary()


async def test_models_add_chooses_the_instance_count_that_is_faster_by_more_than_noise(
    sample_models: Path,
) -> None:
    close = await choose_instances(
        sample_models, "squares", counts=[1, 2], measure=ShiftingMachine({1: 100.0, 2: 102.0})
    )
    assert close.chosen == 1
    assert close.describe() == "instances: 1 (measured 1 -> 100.0/s, 2 -> 102.0/s)"
    faster = await choose_instances(
        sample_models, "squares", counts=[1, 2, 4], measure=ShiftingMachine({1: 100.0, 2: 180.0, 4: 170.0})
    )
    assert faster.chosen == 2
    # The real measurement: a few answers per count, each count loaded once.
    real = await asyncio.wait_for(
        choose_instances(sample_models, "squares", counts=[1, 2], inferences=8), 120
    )
    assert [r.point.instances for r in real.results] == [1, 2]
    # Two callers per instance, at least four answers each: 8 and 16 answers.
    assert [r.requests for r in real.results] == [8, 16]
    assert all(r.throughput > 0 for r in real.results)
    assert real.chosen in (1, 2)


def test_an_openvino_ir_model_is_never_offered_to_onnx_runtime(tmp_path: Path, sample_models: Path) -> None:
    import openvino as ov

    folder = tmp_path / "squares"
    shutil.copytree(sample_models / "squares", folder)
    ov.save_model(ov.Core().read_model(str(folder / "model.onnx")), str(folder / "model.xml"))
    config = folder / "config.yaml"
    config.write_text(config.read_text().replace("path: model.onnx", "path: model.xml"))
    ir = read_source(tmp_path, "squares").config
    assert SearchSpace.for_model(ir, concurrency=8, cpus=2).backends == ("openvino",)
    onnx_file = read_source(sample_models, "squares").config
    assert SearchSpace.for_model(onnx_file, concurrency=8, cpus=2).backends == ("openvino", "onnxruntime")
