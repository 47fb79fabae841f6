"""The benchmarks still run against the current code (quick settings; numbers are not checked)."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from tests.conftest import ROOT


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=120, cwd=ROOT)


def test_scheduler_overhead_prints_its_summary_line() -> None:
    proc = run("bench/scheduler_overhead.py", "--requests", "300")
    assert proc.returncode == 0, proc.stderr
    assert re.search(
        r"^overhead_us_c1=[\d.]+ overhead_us_c8=[\d.]+ overhead_us_c64=[\d.]+$", proc.stdout, re.M
    )


def test_gpu_bench_says_why_it_cannot_run_here() -> None:
    from inference.device import gpu_available

    ok, reason = gpu_available()
    if ok:
        pytest.skip(f"a GPU is usable here ({reason}): the bench would run for minutes, not as a smoke test")
    proc = run("bench/gpu.py")
    assert proc.returncode == 0, proc.stderr
    assert f"no GPU: {reason}" in proc.stdout
