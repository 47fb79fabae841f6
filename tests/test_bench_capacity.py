"""bench/capacity.py, bench/defaults.py and bench/tracking.py: they run against the current code and say what they need."""

from __future__ import annotations

import asyncio
import importlib.util
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT


def run(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=timeout, cwd=ROOT)


@pytest.mark.skipif(importlib.util.find_spec("motmetrics") is not None, reason="the bench extra is installed")
def test_tracking_bench_without_the_bench_extra_says_what_to_install() -> None:
    proc = run("bench/tracking.py", "--quick", timeout=60)
    assert proc.returncode == 2
    assert proc.stderr.strip() == (
        "bench/tracking.py scores trackers with motmetrics, which is not installed: install the bench "
        "extra (pip install -e '.[bench]': motmetrics, norfair, supervision)"
    )


@pytest.mark.slow
def test_capacity_bench_counts_a_file_the_same_on_every_run() -> None:
    first, second = run("bench/capacity.py", "--quick"), run("bench/capacity.py", "--quick")
    assert first.returncode == second.returncode == 0, first.stderr + second.stderr

    def counts(stdout: str) -> list[str]:
        # The accuracy table and the summary line: counts, ids and detector runs, no timings
        # (the table's last column, frames per second, is cut off).
        return [
            line.rsplit("|", 2)[0] if line.startswith("|") else line
            for line in stdout.splitlines()
            if line.startswith(("|", "cameras_per_core="))
        ]

    assert counts(first.stdout) == counts(second.stdout)
    last = first.stdout.strip().splitlines()[-1]
    match = re.fullmatch(
        r"cameras_per_core=nan cameras_every_frame=nan cameras_auto=nan auto_capacity_ratio=nan "
        r"auto_detector_share=([\d.]+) auto_count_ratio=([\d.]+) auto_ids_ratio=([\d.]+)",
        last,
    )
    assert match, last
    assert 0 < float(match.group(1)) < 1  # the auto schedule skipped some frames and ran on others


@pytest.mark.parametrize("backend", ["openvino", "onnxruntime"])
async def test_lane_detector_gives_a_frame_the_same_boxes_in_a_mixed_batch_as_alone(
    tmp_path: Path, backend: str
) -> None:
    # Frames of two different scenes (two sources) in one batch: each must get the boxes it
    # gets alone, which are the walkers' rendered pixels. OpenVINO once gave every lane of
    # the n-th frame in a batch the n-th lane's vertical offset.
    from bench.capacity import WIDTH, make_scene, render, write_repo
    from inference.model import ModelState
    from inference.repository import ModelRepository

    repo = write_repo(tmp_path, 0.0, backend, 1)
    # The same model again, as "batched": preferred_batch_size 4 and a long delay make the
    # four requests below one batch; "walkers" answers each request alone.
    shutil.copytree(repo / "walkers", repo / "batched")
    config = repo / "batched" / "config.yaml"
    text = config.read_text().replace("name: walkers", "name: batched")
    config.write_text(
        text.replace(
            "dynamic_batching: {max_queue_delay_microseconds: 2000}",
            "dynamic_batching: {preferred_batch_size: [4], max_queue_delay_microseconds: 600000000}",
        )
    )
    scenes = [make_scene(40, seed=7), make_scene(40, seed=8)]
    # Two frames of each scene with walkers in two or more lanes.
    picked = [(s, i) for s in scenes for i in [j for j in range(40) if len(s.boxes[j]) >= 2][:2]]
    assert len(picked) == 4

    def truth(walkers: list[tuple[float, float, float, float]]) -> list[tuple[float, float, float, float]]:
        # The rendered pixels: int() of each corner, cut at the frame's edges.
        boxes = []
        for x1, y1, x2, y2 in walkers:
            left, right = max(0, int(x1)), min(WIDTH, max(0, int(x2)))
            if right > left:
                boxes.append((float(left), float(int(y1)), float(right), float(int(y2))))
        return sorted(boxes, key=lambda b: b[1])

    models = ModelRepository(repo)
    for name in ("walkers", "batched"):
        status = await models.load(name)
        assert status.state is ModelState.READY, status
    try:
        images = [render(s.boxes[i]) for s, i in picked]
        alone = [await models.get("walkers").infer(image) for image in images]
        together = await asyncio.gather(*(models.get("batched").infer(image) for image in images))
        assert models.get("walkers").stats.batch_sizes == {1: 4}
        assert models.get("batched").stats.batch_sizes == {4: 1}

        def boxes(result: object) -> list[tuple[float, float, float, float]]:
            return sorted((tuple(d.box) for d in result), key=lambda b: b[1])  # type: ignore[attr-defined]

        for (scene, i), one, batched in zip(picked, alone, together, strict=True):
            assert boxes(one) == truth(scene.boxes[i])
            assert boxes(batched) == boxes(one)
    finally:
        await models.close()


@pytest.mark.slow
def test_defaults_bench_adds_the_model_with_models_add_and_prints_ratios_against_the_ceiling() -> None:
    proc = run("bench/defaults.py", "--quick")
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "# vidpipe models add lanes.onnx:" in out
    assert "#   backend: openvino" in out  # what models add writes where OpenVINO is installed
    assert re.search(r"^#   instances: \d \(measured 1 -> [\d.]+/s", out, re.M), out
    rows = [line for line in out.splitlines() if re.match(r"\| [12] +\|", line)]
    # Each stream count paced (the default) and eager, one after the other.
    assert [[cell.strip() for cell in row.split("|")[1:3]] for row in rows] == [
        ["1", "paced"], ["1", "eager"], ["2", "paced"], ["2", "eager"]
    ]  # fmt: skip
    assert "| p50 / request |" in out  # the graph's p50 against a request's latency at the ceiling
    assert re.search(r"^#   1 streams eager: .* 0% of frames paced;", out, re.M), out
    # A share of the frames the graph took in the measured window: never over all of them.
    shares = [int(share) for share in re.findall(r"(\d+)% of frames paced;", out)]
    assert len(shares) == 4 and all(share <= 100 for share in shares), shares
    last = out.strip().splitlines()[-2:]
    assert [line.split(":")[0] for line in last] == ["paced", "eager"]
    for line in last:
        assert re.fullmatch(r"\w+: defaults_ratio_min=[\d.]+ defaults_latency_max=[\d.]+", line), line
