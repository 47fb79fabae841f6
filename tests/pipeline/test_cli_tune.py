"""`vidpipe tune`: a real short search of the squares model, its table, and --write."""

from __future__ import annotations

import difflib
import shutil
from pathlib import Path

from inference.repository import read_source
from inference.tuning import TrialPoint
from tests.conftest import run_cli
from tests.inference.test_tuning import batch_one_repo

COLUMNS = [
    "#",
    "backend",
    "precision",
    "instances",
    "threads",
    "max_batch",
    "preferred",
    "delay_us",
    "throughput/s",
    "p50_ms",
    "p99_ms",
    "mean_batch",
]
# Only these keys may change; each line of the file keeps its comment where it has one.
TUNED = ("backend:", "max_batch_size:", "  preferred_batch_size:", "  max_queue_delay_microseconds:",
         "instance_group:", "backend_options:")  # fmt: skip


def test_tune_searches_prints_the_table_and_writes_only_the_tuned_keys(
    tmp_path: Path, sample_models: Path
) -> None:
    shutil.copytree(sample_models / "squares", tmp_path / "squares")
    config = tmp_path / "squares" / "config.yaml"
    # A starting point the pick cannot be: 4 callers never fill a batch of 8, so every
    # batch waits the full 0.3 s delay, past the 200 ms budget.
    original = "# Tuned by hand before; the tuner must keep this line.\n" + config.read_text().replace(
        "labels: [square]", "labels: [square]   # one class"
    ).replace("max_queue_delay_microseconds: 2000", "max_queue_delay_microseconds: 300000").replace(
        "preferred_batch_size: [4, 8]", "preferred_batch_size: [8]"
    )
    config.write_text(original)
    # The search stops at --seconds: give it room to reach the short delays on a busy
    # machine too (each trial is counted in answers, so a slow machine takes longer).
    proc = run_cli(
        "tune", str(tmp_path), "squares", "--concurrency", "4", "--seconds", "60",
        "--trial-inferences", "16", "--latency-budget-ms", "200", "--write",
        timeout=240,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    assert [c.strip() for c in lines[0].strip("|").split("|")] == COLUMNS
    rows = [line for line in lines[2:] if line.startswith("| ")]
    # One progress line per trial on stderr, one row per trial in the table.
    progress = [line for line in proc.stderr.splitlines() if line.startswith("[")]
    assert len(rows) == len(progress) >= 2
    picked_rows = [r for r in rows if r.split("|")[1].strip().endswith("*")]
    assert len(picked_rows) == 1
    picked_line = next(line for line in lines if line.startswith("picked: "))
    assert "% of the best measured" in picked_line and "(budget 200 ms)" in picked_line
    assert any(line.startswith("best measured: ") for line in lines)
    assert any(line.startswith(f"searched {len(rows)} of ") for line in lines)
    # The file now says the pick, and only tuned lines changed.
    written = TrialPoint.from_config(read_source(tmp_path, "squares").config)
    assert picked_line.endswith(written.describe())
    new = config.read_text()
    changed = [
        line[1:]
        for line in difflib.unified_diff(original.splitlines(), new.splitlines(), lineterm="", n=0)
        if line[:1] in "+-" and not line.startswith(("+++", "---"))
    ]
    assert all(line.startswith(TUNED) for line in changed), changed
    assert new.startswith("# Tuned by hand before; the tuner must keep this line.\n")
    assert "labels: [square]   # one class\n" in new
    assert changed and "wrote " in proc.stdout
    # Before writing, the pick ran against the starting point in turns and beat it.
    verified = next(line for line in lines if line.startswith("verified: "))
    assert "median of 3 interleaved turn(s) each): faster" in verified
    start = "max_queue_delay_microseconds: 300000" in new and "preferred_batch_size: [8]" in new
    assert not start, "the slow starting point was kept"
    # A smaller max_batch_size than before is pointed out: it was measured with 4 callers.
    notes = [line for line in lines if line.startswith("note: max_batch_size")]
    expected = (
        f"note: max_batch_size went from 8 to {written.max_batch_size}: measured with 4 caller(s) "
        "(--concurrency 4); if more sources or crops reach this model at once, tune with as many"
    )
    assert notes == ([expected] if written.max_batch_size < 8 else [])


def test_tune_refuses_bad_arguments_as_usage_errors(tmp_path: Path, sample_models: Path) -> None:
    for seconds in ("0", "nan", "inf"):
        proc = run_cli("tune", str(sample_models), "squares", "--seconds", seconds)
        assert proc.returncode == 2
        assert proc.stderr.strip() == "--seconds: must be a finite number greater than 0"
    proc = run_cli("tune", str(tmp_path / "nope"), "squares")
    assert proc.returncode == 2
    assert (
        proc.stderr.strip()
        == f"{tmp_path / 'nope'}: model repository folder not found (hint: check the path)"
    )
    proc = run_cli("tune", str(sample_models), "sqares")
    assert proc.returncode == 2
    assert (
        proc.stderr.strip()
        == f"{sample_models}: no model 'sqares' in this repository (hint: did you mean 'squares'?)"
    )
    # Nothing close: the models the repository has (the hint `validate` gives for a stage's model).
    proc = run_cli("tune", str(sample_models), "yolo")
    assert proc.returncode == 2
    assert proc.stderr.strip() == (
        f"{sample_models}: no model 'yolo' in this repository "
        "(hint: it has: ppocr_cls, ppocr_det, ppocr_rec, squares)"
    )
    # A model whose config.yaml does not read is refused at its line, before any trial.
    broken = tmp_path / "repo" / "squares"
    shutil.copytree(sample_models / "squares", broken)
    config = broken / "config.yaml"
    config.write_text(config.read_text().replace("max_batch_size: 8", "max_batch_size: lots"))
    proc = run_cli("tune", str(tmp_path / "repo"), "squares")
    assert proc.returncode == 2
    assert proc.stderr.strip() == f"{config}:6: max_batch_size: expected an integer, got 'lots'"


def test_tune_skips_the_batches_a_fixed_batch_model_refuses_and_measures_under_stream_load(
    tmp_path: Path, sample_models: Path, demo_clip: Path
) -> None:
    repo = batch_one_repo(tmp_path, sample_models)
    proc = run_cli(
        "tune", str(repo), "squares", "--source", str(demo_clip), "--streams", "4", "--seconds", "10",
        "--trial-inferences", "16",
        timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert "skipped max_batch_size 2, 4: the model file fixes its batch at 1" in lines
    rows = [line.split("|") for line in lines[2:] if line.startswith("| ")]
    assert rows and {r[6].strip() for r in rows} == {"1"}
    assert "failed" not in proc.stderr


def test_tune_refuses_streams_without_a_source(sample_models: Path) -> None:
    proc = run_cli("tune", str(sample_models), "squares", "--streams", "2")
    assert proc.returncode == 2
    assert proc.stderr.strip() == "--streams: needs --source FILE (hint: --source clip.mp4 --streams 4)"


def test_tune_stops_at_once_when_the_current_configuration_does_not_run(
    tmp_path: Path, sample_models: Path
) -> None:
    repo = tmp_path / "repo"
    shutil.copytree(sample_models / "squares", repo / "squares")
    config = repo / "squares" / "config.yaml"
    config.write_text(config.read_text().replace("path: model.onnx", "path: gone.onnx"))
    proc = run_cli("tune", str(repo), "squares", "--seconds", "60")
    assert proc.returncode == 1
    assert proc.stdout == ""
    # The model's own warning when it fails to load, once, then the error: no trial went on.
    warning, last = proc.stderr.splitlines()
    assert "warning squares: unavailable: " in warning
    assert last.startswith(f"vidpipe: model squares: the current configuration ({config}) does not run: ")
    assert "model file not found" in last
    assert last.endswith("; fix it and tune again")
