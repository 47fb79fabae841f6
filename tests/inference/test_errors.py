"""One root for every error the inference layer raises, and messages that point at FILE:LINE."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from inference.backends.base import BackendError
from inference.backends.inputs import InputMismatchError
from inference.batcher import InferenceError, InferenceFailed, InferenceRejected, InferenceTimeout
from inference.config import DynamicBatching, ModelConfig, ModelConfigError, QueuePolicy
from inference.device import GpuUnavailableError
from inference.errors import VidpipeError, WholeBatchFailure
from inference.memory import BufferPool, PoolExhausted
from inference.model import ModelState, ModelUnavailable
from inference.repository import ModelNotFoundError, ModelRepository
from inference.results import NonFiniteOutput
from inference.schema import ConfigError, build, load_yaml_text
from tests.inference.test_repository import CONFIG, make_onnx, write_config


def test_every_error_class_derives_from_the_root_through_what_it_is() -> None:
    parents = {
        ConfigError: (VidpipeError, ValueError),
        ModelConfigError: (ConfigError,),
        InputMismatchError: (ModelConfigError,),
        BackendError: (VidpipeError, RuntimeError),
        InferenceError: (VidpipeError, RuntimeError),
        InferenceRejected: (InferenceError,),
        InferenceTimeout: (InferenceRejected,),
        InferenceFailed: (InferenceError,),
        ModelUnavailable: (InferenceRejected,),
        ModelNotFoundError: (VidpipeError, LookupError),
        PoolExhausted: (WholeBatchFailure, TimeoutError),
        GpuUnavailableError: (VidpipeError, RuntimeError),
        WholeBatchFailure: (VidpipeError,),
        NonFiniteOutput: (VidpipeError, ValueError),
    }
    for cls, bases in parents.items():
        assert cls.__bases__ == bases, cls
    # A config that disagrees with its model is something to fix in config.yaml, not a
    # model file that cannot run.
    assert not issubclass(ModelConfigError, BackendError)
    assert not issubclass(BackendError, ConfigError)


def _reason(root: Path, text: str) -> tuple[Path, str]:
    import asyncio

    path = write_config(root, "cls", text)
    if not (root / "cls" / "model.onnx").exists():
        make_onnx(root / "cls" / "model.onnx")
    status = asyncio.run(ModelRepository(root).load("cls"))
    assert status.state is ModelState.UNAVAILABLE
    return path, status.reason


def test_a_yaml_problem_is_a_config_error_at_its_line() -> None:
    data = load_yaml_text(
        CONFIG.format(name="cls") + "dynamic_batching: {priority_queue_policy: {'2': {}}}\n", "c.yaml"
    )
    with pytest.raises(ConfigError) as err:
        build(data, ModelConfig, "c.yaml")
    assert (err.value.file, err.value.line, err.value.path) == ("c.yaml", 7, "dynamic_batching")
    assert str(err.value) == (
        "c.yaml:7: dynamic_batching: dynamic_batching.priority_queue_policy key '2' is not a priority "
        "level in 1..1 (set priority_levels to cover it)"
    )


def test_a_file_the_config_names_is_a_model_config_error_at_the_key(tmp_path: Path) -> None:
    text = CONFIG.format(name="cls").replace("labels: [red, green, blue]", "labels_file: missing.txt")
    path, reason = _reason(tmp_path, text)
    assert reason == (
        f"{path}:6: labels_file: cannot read {tmp_path / 'cls' / 'missing.txt'}: No such file or directory"
    )


def test_a_model_that_disagrees_with_input_is_an_input_mismatch_at_the_key(tmp_path: Path) -> None:
    path, reason = _reason(
        tmp_path,
        CONFIG.format(name="cls").replace("{shape: [3, 8, 8]}", "{shape: [3, 8, 8], dtype: float16}"),
    )
    assert reason == (
        f"{path}:4: input.dtype: model.onnx: input tensor 'x' is float32, config.yaml says input.dtype: "
        "float16; set input.dtype: float32"
    )


def test_a_task_problem_points_at_the_task_key(tmp_path: Path) -> None:
    # A recogniser whose model carries no dictionary under the configured metadata key;
    # the key is not in the file, so the error points at its parent's line.
    text = CONFIG.format(name="cls").replace("{kind: classify}", "{kind: text_recognize}")
    path, reason = _reason(tmp_path, text)
    assert reason == (
        f"{path}:5: task.dictionary_key: the model's metadata has no 'character' entry holding the "
        "recogniser's dictionary (one character per line); keys present: none "
        "(hint: set task.dictionary_key to the key the model uses)"
    )


def test_a_provider_this_machine_lacks_points_at_backend_options(tmp_path: Path) -> None:
    text = CONFIG.format(name="cls") + "backend_options:\n  execution_providers: [no_such_provider]\n"
    path, reason = _reason(tmp_path, text)
    assert reason.startswith(
        f"{path}:8: backend_options.execution_providers: execution provider 'no_such_provider' is not "
        "available in this ONNX Runtime (available: "
    )


def test_a_model_file_that_cannot_load_is_a_backend_error_at_the_file(tmp_path: Path) -> None:
    (tmp_path / "cls").mkdir()
    (tmp_path / "cls" / "model.onnx").write_bytes(b"not onnx")
    path, reason = _reason(tmp_path, CONFIG.format(name="cls"))
    assert reason.startswith(f"{path}: cls: cannot load model file {tmp_path / 'cls' / 'model.onnx'}: ")


def test_runtime_errors_say_what_and_what_to_do() -> None:
    pool = BufferPool((2,), np.uint8, count=1, name="cam1/frames")
    held = pool.acquire()
    with pytest.raises(PoolExhausted) as exhausted:
        pool.acquire(timeout=0.001)
    held.release()
    assert str(exhausted.value) == (
        "cam1/frames: all 1 buffers of shape (2,) stayed in use for 0.001s; a consumer is holding "
        "them (release() or a larger pool)"
    )
    rejected = ModelUnavailable("det", ModelState.UNAVAILABLE, "no file")
    assert str(rejected) == "det: request rejected (unavailable): the model is unavailable: no file"
    assert (rejected.model, rejected.reason) == ("det", "unavailable")
    with pytest.raises(ValueError, match=r"key '0' is not a priority level in 1\.\.2"):
        DynamicBatching(
            priority_levels=2, default_priority_level=1, priority_queue_policy={"0": QueuePolicy()}
        )


def test_origin_is_set_by_the_loader_and_refused_in_yaml() -> None:
    data = load_yaml_text(CONFIG.format(name="cls") + "origin: here\n", "c.yaml")
    with pytest.raises(ConfigError) as err:
        build(data, ModelConfig, "c.yaml")
    assert (err.value.line, err.value.path, err.value.problem) == (7, "origin", "unknown key")


NON_FINITE = [
    (".nan", "expected a finite number, got nan"),
    (".inf", "expected a finite number, got inf"),
    ("-.inf", "expected a finite number, got -inf"),
    ("9" * 400, "out of range: an integer of 400 digits (at most ±9,223,372,036,854,775,807)"),
]


@pytest.mark.parametrize(("value", "problem"), NON_FINITE)
def test_a_number_that_is_not_finite_is_refused_in_a_model_config(
    tmp_path: Path, value: str, problem: str
) -> None:
    text = CONFIG.format(name="cls").replace("{shape: [3, 8, 8]}", f"{{shape: [3, 8, 8], scale: {value}}}")
    path, reason = _reason(tmp_path, text)
    assert reason == f"{path}:4: input.scale: {problem}"


def test_a_400_digit_integer_is_refused_in_a_model_config(tmp_path: Path) -> None:
    path, reason = _reason(
        tmp_path, CONFIG.format(name="cls").replace("max_batch_size: 4", "max_batch_size: " + "4" * 400)
    )
    assert (
        reason
        == f"{path}:3: max_batch_size: out of range: an integer of 400 digits (at most ±9,223,372,036,854,775,807)"
    )


@pytest.mark.parametrize(("value", "problem"), NON_FINITE)
def test_a_number_that_is_not_finite_is_refused_in_a_pipeline_config(
    tmp_path: Path, value: str, problem: str
) -> None:
    from pipeline.config import load_config

    path = tmp_path / "p.yaml"
    path.write_text(
        "pipeline: p\nsources:\n  - url: rtsp://cam/stream\n    reconnect: {min_delay: " + value + "}\n"
        "stages: []\nruntime: {max_in_flight: 2}\n"
    )
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert (
        str(err.value) == f"{path}:4: sources[0].reconnect.min_delay: {problem} (hint: seconds, at least 0.1)"
    )


def test_a_400_digit_integer_is_refused_in_a_pipeline_config(tmp_path: Path) -> None:
    from pipeline.config import load_config

    path = tmp_path / "p.yaml"
    path.write_text("pipeline: p\nsources: [{url: test://}]\nruntime:\n  max_in_flight: " + "7" * 400 + "\n")
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert str(err.value) == (
        f"{path}:4: runtime.max_in_flight: out of range: an integer of 400 digits "
        "(at most ±9,223,372,036,854,775,807) (hint: frames of one source processed at once; unset: from instances and sources)"
    )


def test_an_integer_past_what_python_converts_is_a_config_error_at_its_line() -> None:
    with pytest.raises(ConfigError) as err:
        load_yaml_text("name: cls\nmax_batch_size: " + "1" * 5000 + "\n", "c.yaml")
    assert str(err.value) == "c.yaml:2: out of range: an integer of 5000 digits"


def test_json_nan_and_infinity_are_refused_by_the_same_converters() -> None:
    import json

    from pipeline.config import SourceConfig

    data = json.loads('{"url": "test://", "max_fps": NaN, "reconnect": {"jitter": Infinity}}')
    with pytest.raises(ConfigError) as err:
        build(data, SourceConfig, "request", path="sources")
    assert str(err.value) == (
        "request:1: sources.max_fps: expected a finite number, got nan (hint: drop frames above this rate)\n"
        "request:1: sources.reconnect.jitter: expected a finite number, got inf"
    )


def test_thousands_of_unknown_keys_are_counted_not_each_matched() -> None:
    import time

    from pipeline.config import SourceConfig

    data = {"url": "rtsp://cam/stream", **{f"key{i}": 1 for i in range(60_000)}}
    start = time.process_time()
    with pytest.raises(ConfigError) as err:
        build(data, SourceConfig, "request", path="sources")
    lines = str(err.value).splitlines()
    assert len(err.value.errors) == 20 and len(lines) == 20
    assert lines[0].startswith("request:1: sources.key0: unknown key (hint: allowed keys: url, id, ")
    assert lines[18].startswith("request:1: sources.key18: unknown key")
    assert lines[-1].startswith(
        "request:1: sources: 59981 more unknown key(s) (hint: allowed keys: url, id, "
    )
    # Matching each key against the allowed ones took seconds of the event loop's time.
    assert time.process_time() - start < 1.0
