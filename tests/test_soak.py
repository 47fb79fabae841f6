"""A one-minute soak with source churn: resources must not trend upwards."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.conftest import ROOT


def test_one_minute_soak_with_churn_shows_no_growth_trend() -> None:
    proc = subprocess.run(
        [sys.executable, "bench/soak.py", "--minutes", "1", "--sources", "4", "--churn-every", "3", "--json", "--check"],
        capture_output=True, text=True, timeout=240, cwd=ROOT,
    )  # fmt: skip
    result = json.loads(proc.stdout.splitlines()[0])
    assert proc.returncode == 0, f"{result['slope_per_min']} {result['settled']}\n{proc.stderr[-2000:]}"
    # Churn really happened and frames flowed through every generation of sources.
    assert result["churned"] >= 15
    assert result["published"] > 100
    # Removed sources leave nothing behind: the same number of threads as sources + workers.
    assert result["last"]["threads"] == result["first"]["threads"]
    assert result["last"]["fds"] <= result["first"]["fds"] + 2
    # Once every source is removed, nothing stays queued or held, and no task outlives
    # its source (judged with the load gone, so a busy machine cannot fake a trend).
    assert result["settled"]["queued"] == 0
    assert result["settled"]["pool_in_use"] == 0
    assert result["settled"]["tasks"] <= result["baseline_tasks"]
