"""An operator's first hour: the CLI catches mistakes at once and behaves in a terminal.

Every test runs the real ``vidpipe`` command in a subprocess, against real
nats-server processes and real model repositories.
"""

from __future__ import annotations

import shutil
import textwrap
from pathlib import Path

from tests.conftest import run_cli


def test_validate_reports_every_error_at_once_with_file_and_line(tmp_path: Path, sample_models: Path) -> None:
    path = tmp_path / "p.yaml"
    path.write_text(
        textwrap.dedent(
            f"""\
            pipeline: shop
            models: {sample_models}
            sources:
              - url: missing.mp4
                transport: udp
            stages:
              - {{name: det, type: infer, model: squres}}
              - {{name: text, type: infer, model: ppocr_det, classes: [txt]}}
              - {{name: t, type: track, on: det}}
            """
        )
    )
    proc = run_cli("validate", str(path))
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.splitlines() == [
        f"{path}:4: sources[0].url: file not found: {tmp_path / 'missing.mp4'} "
        "(hint: relative paths start at the folder of this file)",
        f"{path}:5: sources[0].transport: does not apply to a file source (hint: a file source takes: "
        "url, id, max_fps, queue_size, max_pixels, loop, realtime, decode)",
        f"{path}:7: stages[0].model: model 'squres' is not in the repository {sample_models} "
        "(hint: did you mean 'squares'?)",
        f"{path}:8: stages[1].classes: 'txt' is not a label of model 'ppocr_det' (hint: did you mean 'text'?)",
        f"{path}:9: stages[2].on: does not apply to a stage of type track "
        "(hint: type track takes: name, type, classes, iou, max_age)",
    ]


def test_validate_refuses_what_run_refuses(tmp_path: Path, sample_models: Path) -> None:
    # No sources, and a repository folder that does not exist.
    path = tmp_path / "p.yaml"
    path.write_text("pipeline: shop\nmodels: nowhere\nstages:\n  - {name: d, type: infer, model: squares}\n")
    proc = run_cli("validate", str(path))
    assert proc.returncode == 2
    assert proc.stderr.splitlines() == [
        f"{path}:1: sources: no sources (hint: add sources: in the file, or pass --source URL to vidpipe run)",
        f"{path}:2: models: repository folder {tmp_path / 'nowhere'} not found "
        "(hint: relative paths start at the folder of this file)",
    ]


def test_validate_checks_the_model_configs_the_pipeline_uses(tmp_path: Path, sample_models: Path) -> None:
    repo = tmp_path / "models"
    shutil.copytree(sample_models / "squares", repo / "squares")
    model_cfg = repo / "squares" / "config.yaml"
    text = model_cfg.read_text()
    text = text.replace("max_batch_size: 8", "max_batch_size: -1").replace("task:", "tsak:")
    model_cfg.write_text(text)
    path = tmp_path / "p.yaml"
    path.write_text(
        f"pipeline: shop\nmodels: {repo}\nsources: [{{url: 'test://'}}]\n"
        "stages:\n  - {name: d, type: infer, model: squares}\n"
    )
    proc = run_cli("validate", str(path))
    assert proc.returncode == 2
    lines = proc.stderr.splitlines()
    number = {line: i + 1 for i, line in enumerate(text.splitlines())}
    tsak = next(n for line, n in number.items() if line.startswith("tsak:"))
    batch = next(n for line, n in number.items() if line.startswith("max_batch_size:"))
    assert lines == [
        f"{model_cfg}:{batch}: max_batch_size: must be at least 0, got -1",
        f"{model_cfg}:{tsak}: tsak: unknown key (hint: did you mean 'task'?)",
    ]
