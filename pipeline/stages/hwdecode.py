"""Hardware decoding (NVDEC through FFmpeg's CUDA hwaccel) and frame upload for the GPU path.

A source chooses its decoder with one option::

    sources:
      - id: gate
        url: rtsp://10.0.0.5/stream1
        decode: auto        # auto: NVDEC when PyAV and FFmpeg support it, else software
                            # cpu: always software; cuda: NVDEC or fail

:func:`open_with_hwaccel` opens the container with PyAV's hardware
acceleration (PyAV ≥ 14: ``av.open(url, hwaccel=HWAccel("cuda"))``). FFmpeg
decodes on the GPU and falls back to software per stream when the codec or
profile is not supported; frames still arrive as ordinary ``VideoFrame``
objects, so ``frame.to_ndarray(format="rgb24")`` works either way.

:class:`PinnedUploader` takes the decoded RGB frames to the device for the
GPU pre-processing: page-locked staging, an asynchronous copy on the source's
own stream, and a :class:`~inference.gpu.memory.DeviceFrame` whose event the
consumer waits on.
"""

from __future__ import annotations

import logging
from typing import Any, Literal

import numpy as np

from pipeline.stages.source import ffmpeg_reason

log = logging.getLogger("vidpipe.source")

__all__ = ["DecodeMode", "PinnedUploader", "hwaccel_support", "open_with_hwaccel"]

DecodeMode = Literal["auto", "cpu", "cuda"]


def hwaccel_support() -> tuple[bool, str]:
    """Whether PyAV can decode with CUDA here: ``(True, "")`` or ``(False, reason)``."""
    try:
        import av
    except ImportError:
        return False, "PyAV is not installed"
    try:
        from av.codec import hwaccel
    except ImportError:
        return False, f"PyAV {getattr(av, '__version__', '?')} has no hardware acceleration (needs ≥ 14)"
    if not hasattr(hwaccel, "HWAccel"):
        return False, f"PyAV {getattr(av, '__version__', '?')} has no av.codec.hwaccel.HWAccel"
    available = getattr(hwaccel, "hwdevices_available", None)
    if callable(available):
        try:
            devices = list(available())
        except Exception as exc:
            return False, f"cannot list FFmpeg hardware devices: {exc}"
        if "cuda" not in devices:
            return False, f"this FFmpeg build has no CUDA hwaccel (it has: {', '.join(devices) or 'none'})"
    return True, ""


def open_with_hwaccel(
    url: str,
    options: dict[str, str] | None = None,
    timeout: float | tuple[float, float] | None = None,
    decode: DecodeMode = "auto",
) -> tuple[Any, str]:
    """Open ``url`` for decoding; returns ``(container, "cuda" | "software")``.

    ``auto`` tries the CUDA hwaccel and falls back to software with one log
    line; ``cuda`` raises ``RuntimeError`` instead of falling back; ``cpu``
    never tries. Errors opening the URL itself propagate unchanged (the
    caller's message names the source).
    """
    import av

    options = dict(options or {})
    if decode == "cpu":
        return av.open(url, options=options, timeout=timeout), "software"
    supported, reason = hwaccel_support()
    if not supported:
        if decode == "cuda":
            raise RuntimeError(f"decode: cuda is not possible: {reason}")
        log.info("hardware decoding unavailable (%s); decoding in software", reason)
        return av.open(url, options=options, timeout=timeout), "software"
    from av.codec.hwaccel import HWAccel

    global _hw_broken
    if _hw_broken is not None and decode == "auto":
        return av.open(url, options=options, timeout=timeout), "software"
    try:
        accel = HWAccel(device_type="cuda", allow_software_fallback=decode != "cuda")
        return av.open(url, options=options, timeout=timeout, hwaccel=accel), "cuda"
    except (FileNotFoundError, ConnectionError, TimeoutError):
        raise  # the URL itself is the problem; a software open would fail the same way
    except Exception as exc:
        # FFmpeg creates the CUDA device when the decoder opens, so a machine without a
        # usable GPU fails here (e.g. "Operation not permitted") -- but so does a bad URL,
        # a wrong password or a damaged file. A software open tells the two apart: if it
        # fails too, its error (about the stream) is the one to report.
        container = av.open(url, options=options, timeout=timeout)
        if decode == "cuda":
            container.close()
            raise RuntimeError(f"decode: cuda is not possible: {ffmpeg_reason(exc, url)}") from exc
        # The software open worked, so the hwaccel was at fault: stop trying it.
        _hw_broken = ffmpeg_reason(exc, url)
        log.info("hardware decoding failed to start (%s); decoding in software", _hw_broken)
        return container, "software"


_hw_broken: str | None = None


class PinnedUploader:
    """Uploads decoded H×W×3 uint8 frames to pooled device buffers, asynchronously.

    Sized once: ``slots`` pinned staging buffers and ``frames`` device buffers
    of ``(max_height, max_width, 3)``. ``upload`` blocks only when all device
    buffers are held downstream (backpressure) or all staging buffers are
    still being copied.
    """

    def __init__(
        self,
        max_height: int,
        max_width: int,
        *,
        slots: int = 3,
        frames: int = 8,
        name: str = "frames",
        device_frames: Any = None,
    ) -> None:
        from inference.device import new_stream
        from inference.gpu.memory import PinnedPool, device_pool

        shape = (max_height, max_width, 3)
        self.staging = PinnedPool(shape, np.uint8, slots, name=f"{name}/pinned")
        self.frames = (
            device_frames if device_frames is not None else device_pool(shape, np.uint8, frames, name=name)
        )
        self.stream = new_stream()
        self._pending: list[Any] = []

    def upload(self, image: np.ndarray, timeout: float | None = None, **info: Any) -> Any:
        """Start copying ``image`` to the device; returns a ``DeviceFrame`` (release it when done)."""
        from inference.gpu.memory import upload

        self._reap()
        if self.staging.in_use >= self.staging.capacity and self._pending:
            # Every staging buffer is mid-copy: wait for the oldest instead of the pool timeout.
            self._pending.pop(0).synchronize()
        frame = upload(image, self.staging, self.frames, self.stream, timeout=timeout)
        frame.info.update(info)
        self._pending.append(frame)
        return frame

    def _reap(self) -> None:
        # Staging buffers go back as soon as their copy has finished.
        self._pending = [f for f in self._pending if not f.ready()]

    def close(self) -> None:
        for frame in self._pending:
            frame.synchronize()
        self._pending.clear()
        self.stream.synchronize()
