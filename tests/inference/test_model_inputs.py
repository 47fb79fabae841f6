"""A model fills its batches where its backend says it reads them, whatever the backend is called.

The backend here is a stand-in at the backend seam (it records what it was handed);
the model, its table of input plans, the real task and preprocessors are the product's.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import numpy as np
import pytest

from inference.backends.base import Backend, InputLocation, TensorSpec
from inference.config import InputConfig, InstanceGroup, ModelConfig, ModelFile, TaskConfig
from inference.device import gpu_available
from inference.model import INPUT_PLANS, Model, ModelState
from inference.processing.resize import ImagePreprocessor, ImageResizer
from inference.results import Classification

# What the fake backends are given as a model file: they read none of it, and the loader
# refuses an empty one (a copy cut short).
FAKE_MODEL_FILE = b"not read: the backend is a fake"

H, W = 4, 6


class RecordingBackend(Backend):
    """Reads its batch from ``location``; answers class 1 for every item and keeps what it got."""

    def __init__(self, location: InputLocation) -> None:
        self.input_location = location
        self.input = TensorSpec("x", (None, 3, H, W), "float32")
        self.inputs = [self.input]
        self.outputs = [TensorSpec("y", (None, 2), "float32")]
        self.metadata = {}
        self.batches: list[np.ndarray] = []

    def run(self, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        x = inputs["x"]
        self.batches.append(x.copy())
        return {"y": np.tile(np.array([[0.0, 9.0]], np.float32), (x.shape[0], 1))}


def model_on(
    tmp_path: Path, location: InputLocation, backend: str = "tensorrt"
) -> tuple[Model, list[RecordingBackend]]:
    """A one-instance classifier served by a :class:`RecordingBackend`; ``backend`` is only its name."""
    (tmp_path / "m.onnx").write_bytes(FAKE_MODEL_FILE)
    config = ModelConfig(
        name="m",
        backend=backend,
        model_file=ModelFile(path="m.onnx"),
        input=InputConfig(shape=[3, H, W], resize="stretch"),
        task=TaskConfig(kind="classify"),
        labels=["no", "yes"],
        max_batch_size=4,
        instance_group=[InstanceGroup(count=1)],
    )
    built: list[RecordingBackend] = []

    def factory(config: ModelConfig, path: Path, index: int) -> Backend:
        built.append(RecordingBackend(location))
        return built[-1]

    return Model(config, tmp_path, backend_factory=factory), built


def test_every_input_location_has_a_plan() -> None:
    assert set(INPUT_PLANS) == set(InputLocation)
    assert {loc: plan.site for loc, plan in INPUT_PLANS.items()} == {
        InputLocation.HOST_FLOAT: "cpu",
        InputLocation.HOST_UINT8: "model",
        InputLocation.DEVICE: "gpu",
    }


async def test_a_host_float_backend_named_tensorrt_gets_normalised_host_tensors(tmp_path: Path) -> None:
    # The backend's declared input location decides, not its name: a "tensorrt" backend
    # that reads host floats gets a host pool and the host normaliser, no GPU involved.
    model, built = model_on(tmp_path, InputLocation.HOST_FLOAT)
    assert model.load() is ModelState.READY, model.reason
    (backend,) = built
    try:
        (inst,) = model.instances
        assert (inst.pool.shape, inst.pool.dtype) == ((4, 3, H, W), "float32")
        assert type(inst.task.preprocessor) is ImagePreprocessor
        assert model.preprocess == "cpu"
        result = await model.infer(np.full((H, W, 3), 255, np.uint8))
        assert isinstance(result, Classification) and result.label == "yes"
        (batch,) = backend.batches
        assert batch.shape == (1, 3, H, W) and batch.dtype == np.float32
        np.testing.assert_allclose(batch, 1.0)  # 255 scaled by the default 1/255
    finally:
        model.stop()


async def test_a_host_uint8_backend_gets_resized_images_it_normalises_itself(tmp_path: Path) -> None:
    model, built = model_on(tmp_path, InputLocation.HOST_UINT8)
    assert model.load() is ModelState.READY, model.reason
    (backend,) = built
    try:
        (inst,) = model.instances
        assert (inst.pool.shape, inst.pool.dtype) == ((4, H, W, 3), "uint8")
        assert type(inst.task.preprocessor) is ImageResizer
        assert model.preprocess == "model"
        image = np.zeros((2 * H, 2 * W, 3), np.uint8)
        image[..., 0] = 200
        await model.infer(image)
        (batch,) = backend.batches
        assert batch.shape == (1, H, W, 3) and batch.dtype == np.uint8
        assert batch[..., 0].min() == batch[..., 0].max() == 200 and batch[..., 1:].max() == 0
    finally:
        model.stop()


def test_a_device_backend_without_a_gpu_is_unavailable_saying_why(tmp_path: Path) -> None:
    ok, why = gpu_available()
    if ok:
        pytest.skip(f"this machine has a usable GPU ({why}); the device plan would load")
    # Any backend name: reading from the device is what needs the GPU path.
    model, built = model_on(tmp_path, InputLocation.DEVICE, backend="onnxruntime")
    assert model.load() is ModelState.UNAVAILABLE
    assert model.reason == f"the GPU path is not available: {why}"
    assert len(built) == 1 and model.instances == []
