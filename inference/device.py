"""Where arrays live: GPU detection, device arrays by protocol, CUDA stream/event helpers.

Code that needs CuPy asks for it instead of importing it itself::

    cp = require_cupy()      # raises GpuUnavailableError saying why the GPU cannot be used

Which work runs on a GPU is decided where the work is: a backend declares where
it reads its batch (:class:`~inference.backends.base.InputLocation`) and the
model fills it there; ``runtime.device`` in a pipeline only checks at start
(``gpu`` refuses to start without a usable GPU, ``auto`` logs why there is none).

Arrays are recognised by protocol, never by class: anything with
``__cuda_array_interface__`` or a CUDA ``__dlpack__`` (CuPy, PyTorch, PyAV's
hardware frames, Numba, ...) is a device array; anything else is host memory.

Importing this module never imports CuPy; the first call that needs it does.
"""

from __future__ import annotations

import importlib
import importlib.util
import threading
from types import ModuleType
from typing import Any

from inference.errors import VidpipeError

__all__ = [
    "DLPACK_CUDA_DEVICES",
    "GpuUnavailableError",
    "current_stream",
    "gpu_available",
    "is_device_array",
    "new_stream",
    "record_event",
    "require_cupy",
    "reset_gpu_probe",
    "wait_event",
]

# DLPack device types that are CUDA device memory (kDLCUDA, kDLCUDAManaged).
DLPACK_CUDA_DEVICES = (2, 13)


class GpuUnavailableError(VidpipeError, RuntimeError):
    """The GPU path was asked for but CuPy or a CUDA device is not usable; the message says why."""


_probe_lock = threading.Lock()
_probe: tuple[bool, str] | None = None


def gpu_available() -> tuple[bool, str]:
    """``(True, "<device description>")`` when CuPy works on a CUDA device, else ``(False, reason)``.

    The answer is cached for the process (the probe initialises the CUDA driver);
    :func:`reset_gpu_probe` forgets it.
    """
    global _probe
    with _probe_lock:
        if _probe is None:
            _probe = _probe_gpu()
        return _probe


def reset_gpu_probe() -> None:
    """Forget the cached :func:`gpu_available` answer."""
    global _probe
    with _probe_lock:
        _probe = None


def _probe_gpu() -> tuple[bool, str]:
    if importlib.util.find_spec("cupy") is None:
        return False, "cupy is not installed (pip install 'vidpipe[gpu]')"
    try:
        cp = importlib.import_module("cupy")
    except Exception as exc:  # a broken install raises all sorts of errors at import
        return False, f"cupy cannot be imported: {exc.__class__.__name__}: {exc}"
    try:
        count = int(cp.cuda.runtime.getDeviceCount())
    except Exception as exc:
        return False, f"no CUDA device ({exc.__class__.__name__}: {exc})"
    if count < 1:
        return False, "no CUDA device"
    try:
        props = cp.cuda.runtime.getDeviceProperties(0)
        name = props["name"]
        name = name.decode() if isinstance(name, bytes) else str(name)
        # One tiny allocation proves the context can be created (a busy or
        # exclusive-mode GPU fails here, not at the first real batch).
        cp.zeros(1, dtype=cp.uint8)
    except Exception as exc:
        return False, f"CUDA device 0 is not usable ({exc.__class__.__name__}: {exc})"
    return True, f"{count} CUDA device(s), device 0: {name}"


def require_cupy() -> ModuleType:
    """Import CuPy or raise :class:`GpuUnavailableError` saying why the GPU cannot be used."""
    ok, reason = gpu_available()
    if not ok:
        raise GpuUnavailableError(f"the GPU path is not available: {reason}")
    return importlib.import_module("cupy")


def _dlpack_device_type(x: Any) -> int | None:
    fn = getattr(x, "__dlpack_device__", None)
    if fn is None:
        return None
    try:
        return int(fn()[0])
    except Exception:
        return None


def is_device_array(x: Any) -> bool:
    """Whether ``x`` is CUDA device memory, judged by ``__cuda_array_interface__`` or DLPack."""
    if hasattr(x, "__cuda_array_interface__"):
        return True
    return hasattr(x, "__dlpack__") and _dlpack_device_type(x) in DLPACK_CUDA_DEVICES


# -- streams and events -------------------------------------------------------


def new_stream() -> Any:
    """A CUDA stream that does not synchronise with the legacy default stream."""
    cp = require_cupy()
    return cp.cuda.Stream(non_blocking=True)


def current_stream() -> Any:
    """The calling thread's current CuPy stream."""
    cp = require_cupy()
    return cp.cuda.get_current_stream()


def record_event(stream: Any) -> Any:
    """Record a timing-free event on ``stream`` (cheaper than a timed one) and return it."""
    cp = require_cupy()
    event = cp.cuda.Event(disable_timing=True)
    event.record(stream)
    return event


def wait_event(stream: Any, event: Any) -> None:
    """Make ``stream`` wait for ``event`` on the device; the host does not block."""
    if event is not None:
        stream.wait_event(event)
