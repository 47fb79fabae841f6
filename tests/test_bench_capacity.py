"""bench/capacity.py and bench/tracking.py: they run against the current code and say what they need."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys

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
        # The accuracy table and the summary line: counts, ids and detector runs, no timings.
        return [line for line in stdout.splitlines() if line.startswith(("|", "cameras_per_core="))]

    assert counts(first.stdout) == counts(second.stdout)
    last = first.stdout.strip().splitlines()[-1]
    match = re.fullmatch(
        r"cameras_per_core=nan cameras_every_frame=nan cameras_auto=nan auto_capacity_ratio=nan "
        r"auto_detector_share=([\d.]+) auto_count_ratio=([\d.]+) auto_ids_ratio=([\d.]+)",
        last,
    )
    assert match, last
    assert 0 < float(match.group(1)) < 1  # the auto schedule skipped some frames and ran on others
