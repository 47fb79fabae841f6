"""The GPU path: kernels pinned to the CPU pre-processing, device helpers, TensorRT plan cache.

Tolerances (one "level" is one uint8 step after normalisation, ``|scale / std|``):

* resize (reference or kernel) vs ``cv2.resize`` INTER_LINEAR: max 1 level, ≥ 98 % of pixels identical;
* normalised tensors vs :class:`ImagePreprocessor`: float32 max ``level + 1e-6``, float16
  ``level + 2⁻¹⁰·max|x|`` (one fp16 step), ≥ 98 % of elements identical;
* kernel vs its NumPy reference: max 1 level (the arithmetic is the same; only the
  hardware's float division may round differently).

Tests marked ``gpu`` need CuPy and a CUDA device (TensorRT for the engine tests, two
devices for the multi-GPU test) and are skipped with the reason otherwise; the rest run
anywhere.
"""

from __future__ import annotations

import ctypes
import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import cv2
import numpy as np
import pytest

from inference.config import InputConfig
from inference.device import gpu_available, is_device_array
from inference.gpu import kernels
from inference.processing.resize import ImagePreprocessor
from tests.conftest import ROOT

GPU_OK, GPU_REASON = gpu_available()
needs_gpu = pytest.mark.skipif(not GPU_OK, reason=f"no GPU: {GPU_REASON}")
needs_trt = pytest.mark.skipif(
    not GPU_OK or importlib.util.find_spec("tensorrt") is None,
    reason=f"no GPU: {GPU_REASON}" if not GPU_OK else "tensorrt is not installed",
)

SIZES = [(37, 101), (360, 640), (481, 333), (48, 500), (1, 1), (3, 900), (720, 1280)]
MODES = ["letterbox", "stretch", "keep_height"]


def _config(mode: str, color: str = "rgb", dtype: str = "float32") -> InputConfig:
    shape = [3, 48, 192] if mode == "keep_height" else [3, 320, 320]
    return InputConfig(
        shape=shape, color=color, resize=mode, dtype=dtype,  # type: ignore[arg-type]
        mean=[0.5, 0.4, 0.3], std=[0.2, 0.3, 0.5], pad_value=114,
    )  # fmt: skip


def _images(seed: int = 0, smooth: bool = True) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    out = []
    for h, w in SIZES:
        img = rng.integers(0, 256, (h, w, 3), dtype=np.uint8)
        out.append(cv2.GaussianBlur(img, (0, 0), 1.0) if smooth else img)
    return out


def _level(config: InputConfig) -> float:
    return float(np.max(np.abs(kernels.normalisation(config)[:3])))


def _assert_close(got: np.ndarray, want: np.ndarray, config: InputConfig, min_equal: float = 0.98) -> None:
    g, w = got.astype(np.float64), want.astype(np.float64)
    diff = np.abs(g - w)
    tol = _level(config) + (2.0**-10 * float(np.abs(w).max()) if got.dtype == np.float16 else 1e-6)
    assert diff.max() <= tol, f"max diff {diff.max():.6g} > {tol:.6g}"
    assert np.mean(diff == 0) >= min_equal, f"only {np.mean(diff == 0):.4f} of elements identical"


# -- CPU: the references pin the algorithm -----------------------------------------


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("color", ["rgb", "bgr"])
@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_reference_preprocess_matches_image_preprocessor(mode: str, color: str, dtype: str) -> None:
    config = _config(mode, color, dtype)
    images = _images()
    want = np.empty((len(images), *config.shape), dtype=dtype)
    got = np.empty_like(want)
    metas_cpu = ImagePreprocessor(config)(images, want)
    metas_ref = kernels.reference_preprocess(images, config, got)
    assert metas_ref == metas_cpu
    _assert_close(got, want, config)


@pytest.mark.parametrize(("src", "dst"), [((37, 101), (211, 77)), ((360, 640), (320, 180)), ((33, 200), (291, 48)), ((100, 100), (320, 320)), ((1080, 1920), (640, 360))])  # fmt: skip
def test_reference_resize_matches_cv2(src: tuple[int, int], dst: tuple[int, int]) -> None:
    img = np.random.default_rng(1).integers(0, 256, (*src, 3), dtype=np.uint8)
    want = cv2.resize(img, dst, interpolation=cv2.INTER_LINEAR).astype(int)
    got = kernels.reference_resize(img, *dst).astype(int)
    diff = np.abs(got - want)
    assert diff.max() <= 1
    assert np.mean(diff == 0) >= 0.98


# The kernel source itself, compiled as C++ and run on the CPU: catches indexing,
# item-table and channel-order mistakes without a GPU.
_HOST_PRELUDE = r"""
#include <cmath>
#include <cstring>
#include <algorithm>
using std::min; using std::max;
struct vp_dim3 { int x, y, z; };
static vp_dim3 blockIdx, blockDim, threadIdx;
#define __global__
#define __device__
#define __forceinline__ inline
#define VP_HOST_EMULATION 1
static inline float __fadd_rn(float a, float b) { return a + b; }
static inline float __fsub_rn(float a, float b) { return a - b; }
static inline float __fmul_rn(float a, float b) { return a * b; }
static inline float __fdiv_rn(float a, float b) { return a / b; }
static inline float __fmaf_rn(float a, float b, float c) { return std::fma(a, b, c); }
static inline int __float2int_rn(float a) { return (int)std::nearbyint(a); }
static inline unsigned short vp_host_f32_to_f16(float v) {
    _Float16 h = (_Float16)v; unsigned short bits; std::memcpy(&bits, &h, 2); return bits;
}
"""

_HOST_DRIVER = r"""
static void vp_grid(int w, int h, int n, void (*body)()) {
    blockDim = {32, 8, 1};
    for (int z = 0; z < n; ++z)
      for (int by = 0; by < (h + 7) / 8; ++by)
        for (int bx = 0; bx < (w + 31) / 32; ++bx)
          for (int ty = 0; ty < 8; ++ty)
            for (int tx = 0; tx < 32; ++tx) {
                blockIdx = {bx, by, z}; threadIdx = {tx, ty, 0}; body();
            }
}
static const long long* g_items; static const float* g_f; static void* g_out;
static int g_h, g_w, g_mode, g_m0, g_m1, g_m2, g_fill;
static void pre_body() { vp_preprocess(g_items, g_out, g_h, g_w, g_mode, g_f, g_m0, g_m1, g_m2, g_fill); }
extern "C" void host_preprocess(const long long* items, int n, void* out, int h, int w, int mode,
                                const float* norm, int m0, int m1, int m2, int fill) {
    g_items = items; g_out = out; g_h = h; g_w = w; g_mode = mode; g_f = norm;
    g_m0 = m0; g_m1 = m1; g_m2 = m2; g_fill = fill;
    vp_grid(w, h, n, pre_body);
}
"""


@pytest.fixture(scope="module")
def host_kernels(tmp_path_factory: pytest.TempPathFactory) -> Any:
    compiler = shutil.which("g++")
    if compiler is None:
        pytest.skip("g++ is not installed (needed to run the CUDA source on the CPU)")
    folder = tmp_path_factory.mktemp("kernels")
    src = folder / "kernels.cpp"
    src.write_text(_HOST_PRELUDE + kernels.CUDA_SOURCE + _HOST_DRIVER)
    lib = folder / "kernels.so"
    result = subprocess.run(
        [compiler, "-O1", "-std=c++17", "-shared", "-fPIC", "-ffp-contract=off", "-o", str(lib), str(src)],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stderr
    return ctypes.CDLL(str(lib))


def _host_items(images: list[np.ndarray], config: InputConfig) -> tuple[np.ndarray, list[Any]]:
    _, h, w = config.shape
    metas = [kernels.geometry(config.resize, im.shape[1], im.shape[0], w, h) for im in images]
    sources = [(im.ctypes.data, im.strides[0]) for im in images]
    rois = [(0, 0, im.shape[1], im.shape[0]) for im in images]
    return kernels.pack_items(sources, rois, metas), metas


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(("color", "dtype"), [("rgb", "float32"), ("bgr", "float16")])
def test_cuda_source_run_on_cpu_matches_reference(
    host_kernels: Any, mode: str, color: str, dtype: str
) -> None:
    config = _config(mode, color, dtype)
    big = _images(4)[-1]
    # A view into a larger frame: the kernel must honour the row pitch.
    images = [*_images(4)[:-1], big[100:300, 200:555]]
    table, _ = _host_items(images, config)
    norm = kernels.normalisation(config)
    got = np.full((len(images), *config.shape), np.nan, dtype=dtype)
    mode_id = kernels.MODE_F16 if dtype == "float16" else kernels.MODE_F32
    c0, c1, c2 = kernels.source_channels(config)
    host_kernels.host_preprocess(
        ctypes.c_void_p(table.ctypes.data), len(images), ctypes.c_void_p(got.ctypes.data),
        config.shape[1], config.shape[2], mode_id, ctypes.c_void_p(norm.ctypes.data), c0, c1, c2,
        config.pad_value,
    )  # fmt: skip
    want = np.empty_like(got)
    kernels.reference_preprocess(images, config, want)
    np.testing.assert_array_equal(got, want)
    cpu = np.empty_like(got)
    ImagePreprocessor(config)(images, cpu)
    _assert_close(got, cpu, config)


# -- CPU: GPU probe, device arrays, imports, backend errors, plan-cache key ------------------------


@pytest.mark.skipif(importlib.util.find_spec("cupy") is not None, reason="cupy is installed here")
def test_gpu_available_says_why_not() -> None:
    ok, reason = gpu_available()
    assert ok is False
    assert reason.startswith("cupy is not installed")


class _FakeCuda:
    def __init__(self) -> None:
        self.__cuda_array_interface__ = {
            "shape": (2, 3, 3),
            "typestr": "|u1",
            "data": (1, False),
            "version": 3,
        }


class _FakeDlpack:
    def __init__(self, device: int) -> None:
        self.device = device

    def __dlpack__(self, stream: Any = None) -> Any:
        raise NotImplementedError

    def __dlpack_device__(self) -> tuple[int, int]:
        return (self.device, 0)


def test_device_arrays_are_recognised_by_protocol() -> None:
    assert is_device_array(_FakeCuda())
    assert is_device_array(_FakeDlpack(2))
    assert not is_device_array(_FakeDlpack(1))  # a CPU DLPack tensor
    assert not is_device_array(np.zeros(3))


def test_gpu_modules_import_without_cupy_or_tensorrt() -> None:
    code = (
        "import sys\n"
        "sys.modules['cupy'] = None\n"
        "sys.modules['tensorrt'] = None\n"
        "import inference.device, inference.gpu, inference.gpu.kernels, inference.gpu.memory\n"
        "import inference.gpu.preprocess, inference.backends.tensorrt, pipeline.sources.decode\n"
        "from inference.device import gpu_available\n"
        "print(gpu_available()[0])\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=60
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "False"


def _trt_config(**options: Any) -> Any:
    from inference.config import DynamicBatching, ModelConfig, ModelFile, TaskConfig, TensorRTOptions

    return ModelConfig(
        name="squares",
        model_file=ModelFile(path="model.onnx"),
        input=InputConfig(shape=[3, 320, 320], name="images"),
        task=TaskConfig(kind="yolo"),
        backend="tensorrt",
        max_batch_size=8,
        dynamic_batching=DynamicBatching(preferred_batch_size=[4, 8]),
        backend_options=TensorRTOptions(**options),
    )


@pytest.mark.skipif(GPU_OK and importlib.util.find_spec("tensorrt") is not None, reason="TensorRT works here")
def test_tensorrt_backend_without_gpu_is_a_clear_error(
    sample_models: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from inference.backends import BackendError, create_backend

    model = sample_models / "squares" / "model.onnx"
    with pytest.raises(BackendError, match="TensorRT backend needs an NVIDIA GPU") as info:
        create_backend(_trt_config(), model, 0)
    assert "backend: onnxruntime" in str(info.value)
    # The backend module itself says the same when either package is missing.
    from inference.backends.tensorrt import TensorRTBackend

    monkeypatch.setitem(sys.modules, "tensorrt", None)
    with pytest.raises(
        BackendError, match=r"\(pip install 'vidpipe\[gpu\]'\); use backend: onnxruntime on CPU"
    ):
        TensorRTBackend(_trt_config(), model, 0)


def test_plan_cache_key_changes_with_every_input(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from inference.backends.tensorrt import batch_profile, plan_cache_dir, plan_cache_key

    base = {
        "model_sha256": "a" * 64, "tensorrt_version": "10.3.0", "gpu_name": "NVIDIA H100 (sm_90)",
        "fp16": False, "profile": (1, 8, 8), "item_shape": (3, 320, 320),
    }  # fmt: skip
    changed = {
        "model_sha256": "b" * 64, "tensorrt_version": "10.4.0", "gpu_name": "NVIDIA L4 (sm_89)",
        "fp16": True, "profile": (1, 4, 8), "item_shape": (3, 640, 640),
    }  # fmt: skip
    key = plan_cache_key(**base)  # type: ignore[arg-type]
    assert key == plan_cache_key(**base)  # type: ignore[arg-type]
    for field, value in changed.items():
        assert plan_cache_key(**{**base, field: value}) != key, field  # type: ignore[arg-type]
    assert batch_profile(_trt_config()) == (1, 8, 8)
    monkeypatch.setenv("VIDPIPE_CACHE_DIR", str(tmp_path))
    assert plan_cache_dir() == tmp_path
    monkeypatch.delenv("VIDPIPE_CACHE_DIR")
    assert plan_cache_dir() == Path.home() / ".cache" / "vidpipe" / "trt"


def test_open_with_hwaccel_falls_back_to_software(demo_clip: Path) -> None:
    from pipeline.sources.decode import open_with_hwaccel

    container, how = open_with_hwaccel(str(demo_clip), decode="cpu")
    with container:
        assert how == "software"
    container, how = open_with_hwaccel(str(demo_clip), decode="auto")
    with container:
        frame = next(container.decode(video=0))
        assert frame.to_ndarray(format="rgb24").shape == (360, 640, 3)
    if not GPU_OK:
        assert how == "software"


def test_gpu_bench_without_gpu_says_so(capsys: pytest.CaptureFixture[str]) -> None:
    if GPU_OK:
        pytest.skip("a GPU is present; the bench would run for minutes")
    spec = importlib.util.spec_from_file_location("bench_gpu", ROOT / "bench" / "gpu.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.main([]) == 0
    assert capsys.readouterr().out.startswith("no GPU: ")


# -- GPU ------------------------------------------------------------------------------


@pytest.fixture
def cp() -> Any:
    if not GPU_OK:
        pytest.skip(f"no GPU: {GPU_REASON}")
    import cupy

    return cupy


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("color", ["rgb", "bgr"])
@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("where", ["device", "host"])
def test_fused_kernel_matches_image_preprocessor(
    cp: Any, mode: str, color: str, dtype: str, where: str
) -> None:
    from inference.gpu.preprocess import GpuPreprocessor

    config = _config(mode, color, dtype)
    images = _images(5)
    big = cp.asarray(images[-1])
    inputs: list[Any] = [cp.asarray(im) for im in images] if where == "device" else list(images)
    inputs.append(big[100:300, 200:555] if where == "device" else images[-1][100:300, 200:555])
    host_images = [*images, images[-1][100:300, 200:555]]
    out = cp.full((len(inputs), *config.shape), np.nan, dtype=dtype)
    pre = GpuPreprocessor(config, max_batch=len(inputs))
    metas = pre(inputs, out)
    cp.cuda.get_current_stream().synchronize()
    got = out.get()
    want = np.empty_like(got)
    assert metas == ImagePreprocessor(config)(host_images, want)
    _assert_close(got, want, config)
    ref = np.empty_like(got)
    kernels.reference_preprocess(host_images, config, ref)
    assert np.abs(got.astype(np.float64) - ref).max() <= _level(config) + 1e-3


def _gpu_count() -> int:
    if not GPU_OK:
        return 0
    import cupy

    return int(cupy.cuda.runtime.getDeviceCount())


@pytest.mark.gpu
@pytest.mark.skipif(_gpu_count() < 2, reason=f"needs two CUDA devices (found {_gpu_count()})")
def test_an_instance_on_the_second_gpu_keeps_its_pool_and_preprocessing_there(cp: Any) -> None:
    from inference.config import ModelConfig, ModelFile, TaskConfig
    from inference.gpu import device_batch_pool, gpu_preprocessor

    config = ModelConfig(
        name="m", model_file=ModelFile(path="m.onnx"), input=_config("letterbox"),
        task=TaskConfig(kind="yolo"), max_batch_size=4,
    )  # fmt: skip
    images = _images(8)[:4]
    with cp.cuda.Device(0):  # the worker thread's current device is not the instance's
        pool = device_batch_pool(config, device=1)
        pre = gpu_preprocessor(config, device=1)
        with pool.acquire() as buf:
            assert buf.array.device.id == 1
            metas = pre(images, buf.array)
            pre.done.synchronize()
            got = buf.array[:4].get()
    want = np.empty_like(got)
    assert metas == ImagePreprocessor(config.input)(images, want)
    _assert_close(got, want, config.input)


@pytest.fixture
def plan_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("VIDPIPE_CACHE_DIR", str(tmp_path / "plans"))
    return tmp_path / "plans"


def _squares_batch(n: int) -> np.ndarray:
    x = np.zeros((n, 3, 320, 320), np.float32)
    for i in range(n):
        x[i, :, 20 + 10 * i : 60 + 10 * i, 30 + 7 * i : 90 + 7 * i] = 1.0
    return x


@pytest.mark.gpu
@needs_trt
def test_tensorrt_plan_cache_and_outputs_match_onnxruntime(
    cp: Any, plan_cache: Path, sample_models: Path
) -> None:
    from inference.backends.onnxruntime import OnnxRuntimeBackend
    from inference.backends.tensorrt import TensorRTBackend

    model = sample_models / "squares" / "model.onnx"
    first = TensorRTBackend(_trt_config(), model, 0)
    assert not first.cache_hit and first.plan_path.is_file()
    first.close()
    second = TensorRTBackend(_trt_config(), model, 0)
    assert second.cache_hit and second.plan_path == first.plan_path
    fp16 = TensorRTBackend(_trt_config(fp16=True), model, 0)
    assert fp16.cache_key != second.cache_key and not fp16.cache_hit
    ort = OnnxRuntimeBackend(_trt_config(), model, 0)
    for n in (1, 3, 8):
        x = _squares_batch(n)
        want = ort.run({"images": x})["output0"]
        np.testing.assert_allclose(second.run({"images": x})["output0"], want, atol=1e-3)
        device = second.run_device({"images": cp.asarray(x)})["output0"]
        second.stream.synchronize()
        np.testing.assert_allclose(device.get(), want, atol=1e-3)
        np.testing.assert_allclose(fp16.run({"images": x})["output0"], want, atol=0.5)
    for backend in (second, fp16, ort):
        backend.close()


@pytest.mark.gpu
@needs_trt
def test_cuda_graphs_give_identical_outputs_and_memory_stays_fixed(
    cp: Any, plan_cache: Path, sample_models: Path
) -> None:
    from inference.backends.tensorrt import TensorRTBackend

    model = sample_models / "squares" / "model.onnx"
    eager = TensorRTBackend(_trt_config(), model, 0)
    graphs = TensorRTBackend(_trt_config(cuda_graphs=True), model, 0)
    pool = cp.get_default_memory_pool()
    used = None
    for round_ in range(30):
        for n in (1, 4, 8, 4):
            x = cp.asarray(_squares_batch(n))
            a = eager.run({"images": x})["output0"]
            b = graphs.run({"images": x})["output0"]
            np.testing.assert_array_equal(a, b)
            del x
        if round_ == 2:
            used = pool.used_bytes()
    assert set(graphs._graphs) | graphs._graphs_failed == {1, 4, 8}
    assert pool.used_bytes() == used
    eager.close()
    graphs.close()
