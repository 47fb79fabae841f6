"""``vidpipe models add`` and ``models list`` through the real CLI, with ultralytics-style exports.

The exports are the sample square detector (samples/build_models.py) carrying the
metadata Ultralytics writes, so a run on the test pattern has a known answer.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import onnx
import pytest

from pipeline.nats_server import EmbeddedNats
from pipeline.sources.pattern import pattern_square_box
from samples.build_models import square_detector
from tests.conftest import Collector, run_cli
from tests.pipeline.test_end_to_end import assert_box, run_async


def ultralytics_export(path: Path, layout: str, *, batch: int | None = None) -> Path:
    """The square detector as an ultralytics export: metadata_props, and a fixed batch when asked."""
    model = square_detector(320, 320, layout=layout)  # type: ignore[arg-type]
    if batch is not None:
        for value in (*model.graph.input, *model.graph.output):
            value.type.tensor_type.shape.dim[0].dim_value = batch
    meta = {"stride": "32", "names": "{0: 'square'}"}
    if layout == "yolov8":
        meta |= {"task": "detect", "imgsz": "[320, 320]", "batch": str(batch or 1), "author": "Ultralytics"}
    onnx.helper.set_model_props(model, meta)
    onnx.save(model, str(path))
    return path


V8_CONFIG = """\
# Written by `vidpipe models add` from yolov8-squares.onnx (ultralytics detect export).
# Input: images[?, 3, 320, 320] float32. Output: output0[?, 5, 1] float32.
# Layout: YOLOv8 [N, 4+C, A] (boxes and class scores, no objectness).
name: squares8
backend: openvino
model_file: {path: model.onnx}
max_batch_size: 8
input: {name: images, shape: [3, 320, 320], dtype: float32, resize: letterbox}
task: {kind: yolo, layout: yolov8, confidence: 0.25, iou: 0.45}
labels: [square]
dynamic_batching: {max_queue_delay_microseconds: 2000}
instance_group: [{count: 1, kind: KIND_CPU}]
"""

V5_CONFIG = """\
# Written by `vidpipe models add` from yolov5-squares.onnx (no task metadata).
# Input: images[1, 3, 320, 320] float32. Output: output0[1, 1, 6] float32.
# Layout: YOLOv5 [N, A, 5+C] (boxes, objectness and class scores).
# A fixed batch of 1: re-export with a dynamic batch axis to batch images.
name: yolov5-squares
backend: openvino
model_file: {path: model.onnx}
max_batch_size: 1
input: {name: images, shape: [3, 320, 320], dtype: float32, resize: letterbox}
task: {kind: yolo, layout: yolov5, confidence: 0.25, iou: 0.45}
labels: [square]
instance_group: [{count: 1, kind: KIND_CPU}]
"""

PIPELINE = """\
pipeline: added
models: {repo}
stages:
  - {{name: objects, type: infer, model: {model}}}
"""


async def run_on_pattern(tmp_path: Path, repo: Path, model: str, nats: EmbeddedNats) -> list[dict]:  # type: ignore[type-arg]
    config = tmp_path / f"{model}.yaml"
    config.write_text(PIPELINE.format(repo=repo, model=model))
    collector = await Collector().start(nats.url, "vidpipe.added.>")
    try:
        code, _, err = await run_async(
            "run", str(config), "--source", "test://?width=320&height=240&fps=20&frames=6", "--nats", nats.url
        )
        assert code == 0, err
        await collector.wait_for(6)
        return collector.messages
    finally:
        await collector.close()


@pytest.mark.parametrize(
    ("layout", "batch", "name", "expected"),
    [("yolov8", None, "squares8", V8_CONFIG), ("yolov5", 1, None, V5_CONFIG)],
)
async def test_models_add_writes_the_config_from_the_export_and_the_model_runs(
    tmp_path: Path, nats_server: EmbeddedNats, layout: str, batch: int | None, name: str | None, expected: str
) -> None:
    export = ultralytics_export(tmp_path / f"{layout}-squares.onnx", layout, batch=batch)
    repo = tmp_path / "models"
    proc = run_cli(
        "models", "add", str(export), "--repo", str(repo), "--instances", "1",
        *(["--name", name] if name else []),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    added = name or export.stem
    config = repo / added / "config.yaml"
    assert config.read_text() == expected
    assert (repo / added / "1" / "model.onnx").read_bytes() == export.read_bytes()
    batch_line = (
        "batch: the model was exported with a fixed batch of 1, so each instance runs one image at a time; "
        "suggested instances: 1. Re-export with a dynamic batch axis (ultralytics: dynamic=True) to batch "
        "images from several cameras\n"
    )
    assert proc.stdout == (
        f"wrote {config}:\n{expected}model file: {repo / added / '1' / 'model.onnx'}\n"
        f"model {added} loads: ready on openvino\n" + (batch_line if batch == 1 else "")
    )

    messages = await run_on_pattern(tmp_path, repo, added, nats_server)
    assert [m["frame"] for m in messages] == list(range(6))
    for m in messages:
        (obj,) = m["objects"]
        assert (obj["label"], obj["class_id"]) == ("square", 0)
        assert_box(obj["bbox"], pattern_square_box(m["frame"], 320, 240))


@pytest.mark.parametrize("batch", [None, 1])
def test_models_add_measures_the_instance_count_writes_the_fastest_and_says_so(
    tmp_path: Path, batch: int | None
) -> None:
    export = ultralytics_export(tmp_path / "sq.onnx", "yolov8", batch=batch)
    repo = tmp_path / "models"
    proc = run_cli("models", "add", str(export), "--repo", str(repo))
    assert proc.returncode == 0, proc.stderr
    # One count per line of measurement: 1, 2 and one per CPU (this machine's CPUs decide the last).
    found = re.search(r"^instances: (\d+) \(measured (.*)\)$", proc.stdout, re.M)
    assert found, proc.stdout
    measured = [tuple(item.split(" -> ")) for item in found.group(2).split(", ")]
    counts = [int(c) for c, _ in measured]
    rates = [float(r.removesuffix("/s")) for _, r in measured]
    assert counts[:2] == [1, 2] and counts == sorted(set(counts))
    # A count is chosen over a smaller one only when it is more than 3% faster.
    chosen = 0
    for k in range(1, len(rates)):
        if rates[k] > rates[chosen] * 1.03:
            chosen = k
    assert int(found.group(1)) == counts[chosen]
    config = (repo / "sq" / "config.yaml").read_text()
    assert f"instance_group: [{{count: {counts[chosen]}, kind: KIND_CPU}}]" in config
    assert "backend: openvino\n" in config
    if batch == 1:
        assert f"suggested instances: {counts[chosen]}. Re-export with a dynamic batch axis" in proc.stdout
        assert "max_batch_size: 1\n" in config
    else:
        assert "batch: the model was exported with a fixed batch of 1" not in proc.stdout


def test_models_add_takes_the_backend_it_is_given(tmp_path: Path) -> None:
    export = ultralytics_export(tmp_path / "sq.onnx", "yolov8")
    repo = tmp_path / "models"
    proc = run_cli(
        "models", "add", str(export), "--repo", str(repo), "--backend", "onnxruntime", "--instances", "2"
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    config = (repo / "sq" / "config.yaml").read_text()
    assert "backend: onnxruntime\n" in config
    assert "instance_group: [{count: 2, kind: KIND_CPU}]\n" in config
    assert "model sq loads: ready on onnxruntime\n" in proc.stdout
    assert "instances: " not in proc.stdout  # given, not measured
    bad = run_cli("models", "add", str(export), "--repo", str(repo), "--name", "x", "--instances", "0")
    assert (bad.returncode, bad.stderr.strip()) == (2, "--instances: must be at least 1")
    help_text = " ".join(run_cli("models", "add", "--help").stdout.split())
    assert help_text.count("default: openvino where installed, else onnxruntime") == 1
    assert help_text.count("(default: models)") == 1


def test_models_add_refuses_what_it_cannot_serve_and_writes_nothing(tmp_path: Path) -> None:
    export = ultralytics_export(tmp_path / "seg.onnx", "yolov8")
    model = onnx.load(str(export))
    for prop in model.metadata_props:
        if prop.key == "task":
            prop.value = "segment"
    onnx.save(model, str(export))
    repo = tmp_path / "models"
    proc = run_cli("models", "add", str(export), "--repo", str(repo))
    assert proc.returncode == 2
    assert proc.stderr == (
        "vidpipe: seg.onnx: an ultralytics 'segment' export; vidpipe serves detect and classify models, "
        "so export the detect or classify variant\n"
    )
    assert not repo.exists() or not any(repo.iterdir())


def test_models_add_never_overwrites_a_model(tmp_path: Path) -> None:
    export = ultralytics_export(tmp_path / "sq.onnx", "yolov8")
    repo = tmp_path / "models"
    assert run_cli("models", "add", str(export), "--repo", str(repo)).returncode == 0
    again = run_cli("models", "add", str(export), "--repo", str(repo))
    assert again.returncode == 2
    assert again.stderr == f"vidpipe: {repo / 'sq'} already exists; pass --name or remove it first\n"
    for name in ("bad name", "../escape", ".hidden", "a:b"):
        refused = run_cli("models", "add", str(export), "--repo", str(repo), "--name", name)
        assert refused.returncode == 2
        assert refused.stderr == (
            f"vidpipe: {name!r} is not a usable model name (1-64 letters, digits, '_', '-' or '.', "
            "not starting with '.' or '-'); pass --name\n"
        )
    assert sorted(p.name for p in repo.iterdir()) == ["sq"]


def test_models_list_shows_task_and_labels_and_exits_1_when_a_model_is_unavailable(tmp_path: Path) -> None:
    repo = tmp_path / "models"
    export = ultralytics_export(tmp_path / "sq.onnx", "yolov8")
    assert run_cli("models", "add", str(export), "--repo", str(repo)).returncode == 0
    proc = run_cli("models", "list", str(repo))
    assert proc.returncode == 0, proc.stdout
    header, row = proc.stdout.splitlines()
    assert header.split()[-2:] == ["TASK", "LABELS"]
    assert row.split()[:3] == ["sq", "1", "ready"] and row.endswith("yolo/yolov8  1 (square)")

    (repo / "sq" / "1" / "model.onnx").unlink()
    proc = run_cli("models", "list", str(repo))
    assert proc.returncode == 1
    assert proc.stdout.splitlines()[1].split()[:3] == ["sq", "1", "unavailable"]
    assert f"sq: {repo / 'sq' / 'config.yaml'}:" in proc.stdout and "model file not found" in proc.stdout


def test_models_add_and_list_say_which_path_is_of_the_wrong_kind(tmp_path: Path) -> None:
    export = ultralytics_export(tmp_path / "sq.onnx", "yolov8")
    a_file = tmp_path / "notes.txt"
    a_file.write_text("")
    cases = [
        (("models", "add", str(tmp_path), "--repo", str(tmp_path / "m")),
         f"{tmp_path}: is a folder, not a model file (hint: give the .onnx file)"),
        (("models", "add", str(export), "--repo", str(a_file)),
         f"{a_file}: --repo is a file, not a folder (hint: give the model repository folder)"),
        (("models", "add", str(export), "--repo", str(a_file / "m")),
         f"{a_file / 'm'}: cannot create the model repository folder: Not a directory"),
        (("models", "list", str(a_file)),
         f"{a_file}: is a file, not a model repository folder (hint: give the folder)"),
    ]  # fmt: skip
    for args, message in cases:
        proc = run_cli(*args)
        assert (proc.returncode, proc.stderr.strip()) == (2, message), args
    assert not (tmp_path / "m").exists()


def test_models_list_says_how_to_make_a_model_of_a_folder_without_config(
    tmp_path: Path, sample_models: Path
) -> None:
    repo = tmp_path / "models"
    shutil.copytree(sample_models / "squares", repo / "squares")
    (repo / "stray" / "1").mkdir(parents=True)
    shutil.copy(sample_models / "squares" / "model.onnx", repo / "stray" / "1" / "model.onnx")
    proc = run_cli("models", "list", str(repo))
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[1].startswith("squares ")
    assert lines[-1] == (
        f"stray: a model folder (stray/1/model.onnx) but no config.yaml, so not a model; "
        f"vidpipe models add {repo / 'stray'} --repo {repo} writes one"
    )
    # The command it names writes the config beside the version folder, and copies nothing.
    (repo / "stray" / "config.pbtxt").write_text('name: "stray"\nmax_batch_size: 8\n')
    added = run_cli("models", "add", str(repo / "stray"), "--repo", str(repo), "--instances", "1")
    assert added.returncode == 0, added.stderr
    assert added.stdout.splitlines()[0] == (
        f"note: {repo / 'stray' / 'config.pbtxt'} is not read: config.yaml is written from the ONNX file "
        "(carry max_batch_size, dynamic_batching and instance_group over by hand where they differ)"
    )
    assert f"model file: {repo / 'stray' / '1' / 'model.onnx'}" in added.stdout
    assert sorted(p.relative_to(repo).as_posix() for p in (repo / "stray").rglob("*")) == [
        "stray/1", "stray/1/model.onnx", "stray/config.pbtxt", "stray/config.yaml",
    ]  # fmt: skip
    listed = run_cli("models", "list", str(repo))
    assert listed.returncode == 0, listed.stdout
    assert [line.split()[:3] for line in listed.stdout.splitlines()[1:]] == [
        ["squares", "-", "ready"], ["stray", "1", "ready"],
    ]  # fmt: skip


def test_models_add_takes_a_triton_model_folder_from_outside_the_repository(tmp_path: Path) -> None:
    triton = tmp_path / "export" / "gate_detector"
    (triton / "3").mkdir(parents=True)
    ultralytics_export(triton / "3" / "model.onnx", "yolov8")
    (triton / "1").mkdir()  # an older version, left empty: the highest with a model is taken
    repo = tmp_path / "models"
    added = run_cli("models", "add", str(triton), "--repo", str(repo), "--instances", "1")
    assert added.returncode == 0, added.stderr
    # Its version keeps its number: Triton's version 3 is the version served and listed.
    assert f"model file: {repo / 'gate_detector' / '3' / 'model.onnx'}" in added.stdout
    assert "model gate_detector loads: ready" in added.stdout
    assert (repo / "gate_detector" / "3" / "model.onnx").read_bytes() == (
        triton / "3" / "model.onnx"
    ).read_bytes()
    assert sorted(p.name for p in (repo / "gate_detector").iterdir()) == ["3", "config.yaml"]


def test_models_add_link_names_the_model_after_the_file_given_and_a_moved_target_is_named(
    tmp_path: Path,
) -> None:
    runs = tmp_path / "runs"
    runs.mkdir()
    export = ultralytics_export(runs / "run-42.onnx", "yolov8")
    current = tmp_path / "current.onnx"
    current.symlink_to(Path("runs") / "run-42.onnx")  # relative, as `ln -s` is mostly used
    repo = tmp_path / "models"
    added = run_cli("models", "add", str(current), "--repo", str(repo), "--link", "--instances", "1")
    assert added.returncode == 0, added.stderr
    link = repo / "current" / "1" / "model.onnx"
    assert f"model file: {link}" in added.stdout
    assert sorted(p.name for p in repo.iterdir()) == ["current"]
    # The training output is moved away: the error names what is missing, not the link.
    export.rename(tmp_path / "elsewhere.onnx")
    proc = run_cli("models", "list", str(repo))
    assert proc.returncode == 1
    assert proc.stdout.splitlines()[-1] == (
        f"current: {repo / 'current' / 'config.yaml'}:6: model_file.path: {link} is a link to {export}, "
        f"which does not exist (moved or deleted) (hint: put the model file back at {export}, or point "
        f"the link at where it is now: ln -sfn FILE {link})"
    )
