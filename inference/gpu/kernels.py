"""CUDA kernels for pre-processing, and NumPy references that do exactly the same arithmetic.

One launch per batch, one thread per output pixel, for every item at once::

    input: {shape: [3, 640, 640], color: bgr, resize: letterbox, pad_value: 114,
            mean: [0.5, 0.5, 0.5], std: [0.5, 0.5, 0.5], dtype: float16}

``vp_preprocess`` reads each item's uint8 HWC source straight from device
memory (a table of pointers, row pitches and regions of interest), places it
with the same geometry as :class:`~inference.processing.resize.ImagePreprocessor`
(letterbox / stretch / keep_height), resizes bilinearly, pads, normalises,
swaps RGB→BGR if asked and writes planar ``N×C×H×W`` float32 or float16.

Agreement with OpenCV (what the tests pin):

* The resize reproduces ``cv2.resize(..., INTER_LINEAR)`` for uint8 images:
  half-pixel centres, edge clamping, 11-bit fixed-point weights and OpenCV's
  vectorised vertical rounding. It is bit-exact for most sizes; where OpenCV
  finishes a row with its scalar tail (other rounding), a pixel may differ by
  one level. So the normalised output is within ``|scale / std|`` (one uint8
  level) of the CPU path everywhere, and equal to float32 rounding on ≥ 99 % of
  elements; float16 adds its own rounding (≤ 2⁻¹¹ relative).

The NumPy ``reference_*`` functions implement the same formulas step by step
in float32/int arithmetic; tests compare them with OpenCV on any machine and
the kernels with them on a GPU.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

import numpy as np

from inference.config import InputConfig
from inference.processing.resize import ResizeMeta, geometry

__all__ = [
    "CUDA_SOURCE",
    "ITEM_FIELDS",
    "MODE_F16",
    "MODE_F32",
    "get_module",
    "launch_preprocess",
    "normalisation",
    "pack_items",
    "reference_preprocess",
    "reference_resize",
    "source_channels",
]

# Item table of vp_preprocess, int64 per field:
# source pointer, row pitch in bytes, roi x, roi y, roi w, roi h, pad x, pad y, content w, content h.
ITEM_FIELDS = 10

MODE_F32 = 0
MODE_F16 = 1

# The _rn intrinsics keep nvcc from fusing multiply-adds, so the kernels round
# exactly like the NumPy references (float32, one rounding per operation).
CUDA_SOURCE = r"""
#define ITEM_FIELDS 10

__device__ __forceinline__ void linear_tap(int d, int dsize, int ssize,
                                           int* s0, int* s1, int* w0, int* w1) {
    // cv2.resize INTER_LINEAR: half-pixel centres, clamped at the edges,
    // weights in 11-bit fixed point.
    float scale = __fdiv_rn((float)ssize, (float)dsize);
    float f = __fsub_rn(__fmul_rn(__fadd_rn((float)d, 0.5f), scale), 0.5f);
    float fl = floorf(f);
    int s = (int)fl;
    float fr = __fsub_rn(f, fl);
    if (s < 0) { s = 0; fr = 0.0f; }
    if (s >= ssize - 1) { s = ssize - 1; fr = 0.0f; }
    *s0 = s;
    *s1 = min(s + 1, ssize - 1);
    *w1 = __float2int_rn(__fmul_rn(fr, 2048.0f));
    *w0 = __float2int_rn(__fmul_rn(__fsub_rn(1.0f, fr), 2048.0f));
}

__device__ __forceinline__ int sample_linear(const unsigned char* roi, long long pitch,
                                             int x0, int x1, int a0, int a1,
                                             int y0, int y1, int b0, int b1, int ch) {
    const unsigned char* r0 = roi + (long long)y0 * pitch;
    const unsigned char* r1 = roi + (long long)y1 * pitch;
    int d0 = (int)r0[x0 * 3 + ch] * a0 + (int)r0[x1 * 3 + ch] * a1;
    int d1 = (int)r1[x0 * 3 + ch] * a0 + (int)r1[x1 * 3 + ch] * a1;
    // OpenCV's vectorised vertical pass: 16-bit high multiplies, then +2 >> 2.
    int v = ((((d0 >> 4) * b0) >> 16) + (((d1 >> 4) * b1) >> 16) + 2) >> 2;
    return min(max(v, 0), 255);
}

__device__ __forceinline__ unsigned short f32_to_f16(float v) {
#ifdef VP_HOST_EMULATION
    return vp_host_f32_to_f16(v);  // tests compile this source as C++ and run it on the CPU
#else
    unsigned short h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(v));
    return h;
#endif
}

extern "C" __global__ void vp_preprocess(const long long* items, void* out,
                                         int out_h, int out_w, int mode,
                                         const float* norm, int m0, int m1, int m2,
                                         int fill) {
    // norm = [alpha0..2, beta0..2, pad0..2]; model channel c reads source channel m[c].
    int x = blockIdx.x * blockDim.x + threadIdx.x;
    int y = blockIdx.y * blockDim.y + threadIdx.y;
    int n = blockIdx.z;
    if (x >= out_w || y >= out_h) return;
    const long long* it = items + (long long)n * ITEM_FIELDS;
    const unsigned char* src = (const unsigned char*)it[0];
    long long pitch = it[1];
    int rx = (int)it[2], ry = (int)it[3], rw = (int)it[4], rh = (int)it[5];
    int px = (int)it[6], py = (int)it[7], cw = (int)it[8], chh = (int)it[9];
    int cx = x - px, cy = y - py;
    bool inside = cx >= 0 && cy >= 0 && cx < cw && cy < chh;
    int v[3] = {fill, fill, fill};
    if (inside) {
        int x0, x1, a0, a1, y0, y1, b0, b1;
        linear_tap(cx, cw, rw, &x0, &x1, &a0, &a1);
        linear_tap(cy, chh, rh, &y0, &y1, &b0, &b1);
        const unsigned char* roi = src + (long long)ry * pitch + (long long)rx * 3;
        for (int c = 0; c < 3; ++c) v[c] = sample_linear(roi, pitch, x0, x1, a0, a1, y0, y1, b0, b1, c);
    }
    int map[3] = {m0, m1, m2};
    long long plane = (long long)out_h * out_w;
    long long base = (long long)n * 3 * plane + (long long)y * out_w + x;
    for (int c = 0; c < 3; ++c) {
        // One rounding (fused multiply-add), as OpenCV's addWeighted does on the CPU path.
        float r = inside ? __fmaf_rn((float)v[map[c]], norm[c], norm[3 + c]) : norm[6 + c];
        if (mode == 1) ((unsigned short*)out)[base + c * plane] = f32_to_f16(r);
        else ((float*)out)[base + c * plane] = r;
    }
}

"""

_BLOCK = (32, 8, 1)


# -- shared parameter helpers (host side, no GPU needed) ----------------------


def normalisation(config: InputConfig) -> np.ndarray:
    """``[alpha0..2, beta0..2, pad0..2]`` as float32, computed like ImagePreprocessor (in float64)."""
    std = np.asarray(config.std, dtype=np.float64)
    mean = np.asarray(config.mean, dtype=np.float64)
    alpha = config.scale / std
    beta = -mean / std
    pad = config.pad_value * alpha + beta
    return np.concatenate([alpha, beta, pad]).astype(np.float32)


def source_channels(config: InputConfig) -> tuple[int, int, int]:
    """Which RGB source channel each model channel reads."""
    return (0, 1, 2) if config.color == "rgb" else (2, 1, 0)


def pack_items(
    sources: Sequence[tuple[int, int]],
    rois: Sequence[tuple[int, int, int, int]],
    metas: Sequence[ResizeMeta],
    out: np.ndarray | None = None,
) -> np.ndarray:
    """The ``vp_preprocess`` item table: one row per item from ``(pointer, pitch)``, roi and placement."""
    n = len(sources)
    table = np.empty((n, ITEM_FIELDS), dtype=np.int64) if out is None else out[:n]
    for i, ((ptr, pitch), (rx, ry, rw, rh), m) in enumerate(zip(sources, rois, metas, strict=True)):
        table[i] = (ptr, pitch, rx, ry, rw, rh, m.pad_x, m.pad_y, m.content_w, m.content_h)
    return table


# -- NumPy references -----------------------------------------------------------


def _linear_taps(dst: int, src: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    f32 = np.float32
    scale = f32(src) / f32(dst)
    f = (np.arange(dst, dtype=f32) + f32(0.5)) * scale - f32(0.5)
    fl = np.floor(f)
    s = fl.astype(np.int64)
    fr = f - fl
    low = s < 0
    s[low] = 0
    fr[low] = 0
    high = s >= src - 1
    s[high] = src - 1
    fr[high] = 0
    w1 = np.rint(fr * f32(2048)).astype(np.int64)
    w0 = np.rint((f32(1) - fr) * f32(2048)).astype(np.int64)
    return s, np.minimum(s + 1, src - 1), w0, w1


def reference_resize(image: np.ndarray, width: int, height: int) -> np.ndarray:
    """The kernel's bilinear resize of an H×W×3 uint8 image (≈ ``cv2.resize`` INTER_LINEAR)."""
    src_h, src_w = image.shape[:2]
    x0, x1, a0, a1 = _linear_taps(width, src_w)
    y0, y1, b0, b1 = _linear_taps(height, src_h)
    s = image.astype(np.int64)
    d = s[:, x0] * a0[None, :, None] + s[:, x1] * a1[None, :, None]
    v = (((d[y0] >> 4) * b0[:, None, None]) >> 16) + (((d[y1] >> 4) * b1[:, None, None]) >> 16)
    return np.clip((v + 2) >> 2, 0, 255).astype(np.uint8)


def reference_preprocess(
    images: Sequence[np.ndarray],
    config: InputConfig,
    out: np.ndarray,
    rois: Sequence[tuple[int, int, int, int] | None] | None = None,
) -> list[ResizeMeta]:
    """What ``vp_preprocess`` writes into ``out`` (N×C×H×W float32/float16) for host ``images``.

    ``rois`` (``x, y, w, h`` per image, ``None`` = whole image) select the
    region each item is cut from; geometry is computed on the region.
    """
    _, height, width = config.shape
    norm = normalisation(config)
    alpha, beta, pad = norm[0:3], norm[3:6], norm[6:9]
    channels = source_channels(config)
    metas = []
    for i, image in enumerate(images):
        roi = rois[i] if rois is not None else None
        if roi is not None:
            rx, ry, rw, rh = roi
            image = image[ry : ry + rh, rx : rx + rw]
        meta = geometry(config.resize, image.shape[1], image.shape[0], width, height)
        content = reference_resize(image, meta.content_w, meta.content_h).astype(np.float64)
        item = np.empty((3, height, width), dtype=np.float32)
        for c in range(3):
            item[c] = pad[c]
            region = item[
                c, meta.pad_y : meta.pad_y + meta.content_h, meta.pad_x : meta.pad_x + meta.content_w
            ]
            # float64 of float32 operands: exact product, so one rounding to float32 like an FMA.
            region[...] = content[:, :, channels[c]] * np.float64(alpha[c]) + np.float64(beta[c])
        out[i] = item.astype(out.dtype)
        metas.append(meta)
    return metas


# -- kernel launches (need CuPy and a GPU) ------------------------------------------

_modules: dict[int, Any] = {}
_modules_lock = threading.Lock()


def get_module() -> Any:
    """The compiled kernels for the current device (compiled once per device, cached by CuPy on disk)."""
    from inference.device import require_cupy

    cp = require_cupy()
    device = int(cp.cuda.Device().id)
    with _modules_lock:
        module = _modules.get(device)
        if module is None:
            module = cp.RawModule(code=CUDA_SOURCE, options=("--std=c++14",))
            _modules[device] = module
        return module


def _grid(width: int, height: int, depth: int) -> tuple[int, int, int]:
    return (-(-width // _BLOCK[0]), -(-height // _BLOCK[1]), depth)


def launch_preprocess(
    items: Any,
    count: int,
    out: Any,
    mode: int,
    norm: Any,
    channels: tuple[int, int, int],
    fill: int,
    stream: Any,
) -> None:
    """Launch ``vp_preprocess`` for the first ``count`` rows of the device item table ``items``.

    ``out`` is ``N×3×H×W`` (float32 / float16), C-contiguous on the current
    device; ``norm`` a float32 device array of 9.
    """
    if count == 0:
        return
    out_h, out_w = int(out.shape[2]), int(out.shape[3])
    kernel = get_module().get_function("vp_preprocess")
    i32 = np.int32
    args = (items, out, i32(out_h), i32(out_w), i32(mode), norm, *(i32(c) for c in channels), i32(fill))
    with stream:
        kernel(_grid(out_w, out_h, count), _BLOCK, args)
