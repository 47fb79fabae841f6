"""``vidpipe run`` refuses what ``validate`` refuses about the models before it starts anything
(the embedded NATS server, a model, a source), and a stop while the models load starts no source."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import helper, numpy_helper

from pipeline.console import STOPPED_WHILE_STARTING
from samples.build_models import square_detector
from tests.conftest import ROOT, run_cli

# Each test runs vidpipe in a subprocess (the slow tier, as tests/conftest.py describes it).
pytestmark = pytest.mark.slow

# A log line's time and level: "12:00:01 warning ".
LOG_PREFIX = re.compile(r"^\d\d:\d\d:\d\d (\w+) +")


def _without_times(stderr: str) -> list[str]:
    """The lines of ``stderr`` with a log line's time taken off (its level stays)."""
    return [LOG_PREFIX.sub(r"\1 ", line) for line in stderr.splitlines()]


def _repo(tmp_path: Path, sample_models: Path) -> Path:
    """The sample models, a classifier of colours (not angles) and a squares detector whose
    config asks for an input its model file does not take."""
    repo = tmp_path / "models"
    shutil.copytree(sample_models, repo)
    shutil.copytree(repo / "ppocr_cls", repo / "colours")
    config = repo / "colours" / "config.yaml"
    text = config.read_text()
    assert 'labels: ["0", "180"]' in text
    config.write_text(text.replace("name: ppocr_cls", "name: colours").replace('["0", "180"]', "[red, blue]"))
    shutil.copytree(repo / "squares", repo / "squares_640")
    config = repo / "squares_640" / "config.yaml"
    text = config.read_text()
    assert "shape: [3, 320, 320]" in text
    config.write_text(
        text.replace("name: squares", "name: squares_640").replace("[3, 320, 320]", "[3, 640, 640]")
    )
    return repo


def test_run_refuses_the_model_checks_of_validate_with_its_messages_before_nats_starts(
    tmp_path: Path, sample_models: Path
) -> None:
    repo = _repo(tmp_path, sample_models)
    path = tmp_path / "shop.yaml"
    path.write_text(
        textwrap.dedent(
            f"""\
            pipeline: shop
            models: {repo}
            sources: [{{url: "test://?frames=3"}}]
            stages:
              - {{name: det, type: infer, model: squares, priority: 3}}
              - {{name: text, type: infer, model: ppocr_det}}
              - {{name: colour, type: infer, model: colours, on: text}}
              - {{name: read, type: infer, model: ppocr_rec, on: text, upright_by: colour}}
              - {{name: cls, type: infer, model: ppocr_cls, on: text}}
              - {{name: sub, type: infer, model: ppocr_rec, on: cls}}
              - {{name: big, type: infer, model: squares_640}}
              - {{name: t, type: track, classes: [sqare]}}
            """
        )
    )
    expected = [
        f"warning {path}:5: stages[0].priority: model 'squares' has no priority level 3 "
        "(dynamic_batching.priority_levels: 0), so the stage's requests join its default level "
        "(hint: set dynamic_batching.priority_levels in the model's config.yaml, or drop priority)",
        # Problems come in file order, then line order: the model's config.yaml first here.
        f"{repo / 'squares_640' / 'config.yaml'}:9: input.shape: model.onnx: input tensor 'images' expects "
        "items of shape [3, 320, 320] (C, H, W), but config.yaml has input.shape: [3, 640, 640] "
        "(wrong: H, W); set input.shape: [3, 320, 320]",
        f"{path}:8: stages[3].upright_by: model 'colours' of stage 'colour' has labels that are not angles: "
        "'red', 'blue' (hint: name a classifier stage on the same objects whose labels are 0, 90, 180, 270)",
        f"{path}:10: stages[5].on: stage 'cls' runs model 'ppocr_cls', a classify model: it finds no "
        "objects, so this stage has none to run on (hint: run it on the objects 'cls' runs on: on: text)",
        f"{path}:12: stages[7].classes: 'sqare' is not a label of models 'squares' or 'ppocr_det' or "
        "'squares_640' (hint: did you mean 'square'?)",
    ]
    validate = run_cli("validate", str(path))
    assert (validate.returncode, _without_times(validate.stderr)) == (2, expected)
    run = run_cli("run", str(path))
    # Refused before the embedded server started (it prints its URL first on stdout).
    assert (run.returncode, run.stdout, _without_times(run.stderr)) == (2, "", expected)


def test_run_logs_a_setting_the_model_ignores_once_and_runs(tmp_path: Path, sample_models: Path) -> None:
    path = tmp_path / "p.yaml"
    path.write_text(
        f"pipeline: p\nmodels: {sample_models}\nsources: [{{url: 'test://?frames=3'}}]\n"
        "stages:\n  - {name: det, type: infer, model: squares, timeout_ms: 50}\n"
    )
    run = run_cli("run", str(path))
    assert run.returncode == 0, run.stderr
    lines = _without_times(run.stderr)
    warning = (
        f"warning {path}:5: stages[0].timeout_ms: model 'squares' does not let a request set its own "
        "timeout, so timeout_ms is ignored (hint: set allow_timeout_override: true in the queue policy of "
        "its config.yaml, or drop timeout_ms)"
    )
    assert [line for line in lines if line.startswith("warning ")] == [warning]
    # Said before anything loads.
    assert lines.index(warning) < lines.index("info loading 1 model(s): squares")
    assert "info done: 3 frame(s) published from 1 source(s)" in lines


@pytest.mark.parametrize(
    ("models", "model", "problem"),
    [
        (
            "nowhere",
            "squares",
            "2: models: repository folder {tmp}/nowhere not found "
            "(hint: relative paths start at the folder of this file)",
        ),
        (
            "{samples}",
            "squres",
            "5: stages[0].model: model 'squres' is not in the repository {samples} "
            "(hint: did you mean 'squares'?)",
        ),
    ],
    ids=["no-repository", "no-such-model"],
)
def test_run_refuses_a_missing_repository_or_model_as_validate_does_before_nats_starts(
    tmp_path: Path, sample_models: Path, models: str, model: str, problem: str
) -> None:
    path = tmp_path / "p.yaml"
    path.write_text(
        f"pipeline: p\nmodels: {models.format(samples=sample_models)}\n"
        f"sources: [{{url: 'test://?frames=3'}}]\nstages:\n  - {{name: det, type: infer, model: {model}}}\n"
    )
    said = f"{path}:{problem.format(tmp=tmp_path, samples=sample_models)}\n"
    validate = run_cli("validate", str(path))
    assert (validate.returncode, validate.stderr) == (2, said)
    run = run_cli("run", str(path))
    assert (run.returncode, run.stdout, run.stderr) == (2, "", said)


def _slow_detector(links: int) -> onnx.ModelProto:
    """The squares detector with ``links`` multiplications by one after it: the same answers,
    and a graph OpenVINO takes seconds to compile (about 3 s for 2000 on an idle 2-core CPU)."""
    model = square_detector()
    graph = model.graph
    last = graph.node[-1]
    out = last.output[0]
    last.output[0] = prev = "link_0"
    for i in range(links):
        # Distinct constants, so that no pass merges the chain into one node.
        one = numpy_helper.from_array(np.array([1.0 + 1e-7 * (i % 3)], dtype=np.float32), f"one_{i}")
        graph.initializer.append(one)
        nxt = out if i == links - 1 else f"link_{i + 1}"
        graph.node.append(helper.make_node("Mul", [prev, one.name], [nxt]))
        prev = nxt
    onnx.checker.check_model(model)
    return model


@pytest.mark.parametrize(
    ("sig", "summary"),
    [(signal.SIGINT, False), (signal.SIGTERM, False), (signal.SIGINT, True)],
    ids=["sigint", "sigterm", "sigint-summary"],
)
def test_a_stop_while_the_models_load_starts_no_source_and_says_it_stopped_while_starting(
    tmp_path: Path, sample_models: Path, sig: signal.Signals, summary: bool
) -> None:
    repo = tmp_path / "models"
    shutil.copytree(sample_models / "squares", repo / "squares")
    (repo / "a_slow").mkdir()
    onnx.save(_slow_detector(2000), repo / "a_slow" / "model.onnx")
    config = (repo / "squares" / "config.yaml").read_text()
    (repo / "a_slow" / "config.yaml").write_text(config.replace("name: squares", "name: a_slow"))
    path = tmp_path / "p.yaml"
    # Models load in name order: the slow one first, squares only once it is ready.
    path.write_text(
        f"pipeline: p\nmodels: {repo}\nsources: [{{url: 'test://?frames=30'}}]\nstages:\n"
        "  - {name: slow, type: infer, model: a_slow}\n  - {name: det, type: infer, model: squares}\n"
    )
    proc = subprocess.Popen(
        [sys.executable, "-m", "pipeline.cli", "run", str(path), *(["--summary"] if summary else [])],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # a terminal's foreground job: the signal goes to the group
    )
    try:
        assert proc.stderr is not None
        seen = []
        while "loading 2 model(s): a_slow, squares" not in (line := proc.stderr.readline()):
            assert line, "vidpipe ended before it said it loads the models: " + "".join(seen)
            seen.append(line)
        os.killpg(proc.pid, sig)
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    lines = _without_times("".join(seen) + line + err)
    assert proc.returncode == 0, err
    first, *rest = out.splitlines()
    assert re.fullmatch(r"embedded NATS server at nats://127\.0\.0\.1:\d+", first), out
    # --summary: its seconds while the models load, and no totals of a run that never ran.
    assert all(re.fullmatch(r"\[ *\d+s\] waiting for frames", line) for line in rest), out
    assert summary or not rest, out
    assert lines == [
        "info loading 2 model(s): a_slow, squares",
        "info stopping: no source will start; model a_slow finishes loading first (signal again to force)",
        "info model a_slow ready",
        STOPPED_WHILE_STARTING,
    ]
