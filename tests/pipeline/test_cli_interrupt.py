"""Ctrl-C during the commands that have a result (``tune``, ``models add``): one line saying
what was written, exit 130, and nothing half-made left behind."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from tests.conftest import ROOT, run_cli


def _start(*args: str) -> subprocess.Popen[str]:
    """``vidpipe`` in its own session, as a terminal runs a foreground job (Ctrl-C: the group)."""
    return subprocess.Popen(
        [sys.executable, "-m", "pipeline.cli", *args],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )


def test_ctrl_c_during_tune_prints_the_trials_finished_writes_nothing_and_exits_130(
    tmp_path: Path, sample_models: Path
) -> None:
    repo = tmp_path / "repo"
    shutil.copytree(sample_models / "squares", repo / "squares")
    config = repo / "squares" / "config.yaml"
    before = config.read_bytes()
    proc = _start("tune", str(repo), "squares", "--seconds", "120", "--trial-inferences", "16", "--write")
    try:
        assert proc.stderr is not None
        seen = []
        while not (line := proc.stderr.readline()).startswith("[ 1 "):
            assert line, "tune ended before its first trial"
            seen.append(line)
        os.killpg(proc.pid, signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    err = "".join(seen) + line + err
    assert proc.returncode == 130, err
    trials = len(re.findall(r"^\[ *\d+ ", err, flags=re.MULTILINE))
    assert err.splitlines()[-1] == (
        f"vidpipe tune: interrupted; {trials} trial(s) finished; nothing was written ({config} unchanged)"
    )
    lines = out.splitlines()
    assert lines[0].startswith("| # ") and "| backend " in lines[0]
    assert len([row for row in lines[2:] if row.startswith("| ")]) == trials
    assert not any(line.startswith("picked:") for line in lines)
    assert config.read_bytes() == before


def test_ctrl_c_during_models_add_removes_the_model_folder_so_a_retry_works(
    tmp_path: Path, sample_models: Path
) -> None:
    repo = tmp_path / "repo"
    folder = repo / "sq"
    args = (
        "models",
        "add",
        str(sample_models / "squares" / "model.onnx"),
        "--repo",
        str(repo),
        "--name",
        "sq",
    )
    proc = _start(*args)
    try:
        # The folder is written before the model is loaded and its instances measured.
        deadline = time.monotonic() + 60
        while not (folder / "config.yaml").is_file():
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "models add wrote no config.yaml in 60 s"
            time.sleep(0.005)
        os.killpg(proc.pid, signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, err
    assert err.splitlines()[-1] == (
        f"vidpipe models add: interrupted; the model was not added; nothing is left at {folder}, "
        "so the command can be run again"
    )
    assert not folder.exists()
    again = run_cli(*args)
    assert again.returncode == 0, again.stderr
    assert "model sq loads: ready on" in again.stdout
