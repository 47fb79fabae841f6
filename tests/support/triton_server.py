"""A loopback Triton Inference Server for tests: PyTriton serving ONNX Runtime functions.

Run it as a script (the ``tritonserver`` binary inside the ``nvidia-pytriton``
wheel does the serving)::

    python tests/support/triton_server.py --onnx samples/models/squares/model.onnx \
        --grpc-port 8001 --http-port 8000 --metrics-port 8002 --calls calls.txt

It serves, from that one ONNX file (one image input ``[N, 3, H, W]``, one output):

- ``<stem>``: float32 input, the model as is;
- ``<stem>_u8``: uint8 input (raw pixels); the function scales by 1/255 itself;
- ``<stem>_slow``: like ``<stem>`` but sleeps ``--slow-s`` seconds per call;
- ``<stem>_broken``: always answers with an error.

Every call appends ``<model> <batch size>`` to ``--calls``, so a test can count
server calls. It prints ``READY <grpc port>`` once the models are served and
exits on SIGINT.

:class:`TritonTestServer` drives the script from a test: free ports, the
``LD_LIBRARY_PATH`` the server needs (the running Python's ``LIBDIR``), start,
wait for READY, stop.

Triton's Python backend stub (which runs PyTriton's proxy) is built with a
pybind11 that predates NumPy 2: under NumPy 2 every tensor it passes arrives
empty or as zeros. Where the environment has NumPy 2, the stub is pointed at a
prefix whose ``site-packages`` puts a NumPy 1 first (``--stub-prefix``); that
NumPy 1 is installed once with::

    pip install --no-deps --target "$VIRTUAL_ENV/triton-stub-numpy" "numpy<2"

(or anywhere, named by ``VIDPIPE_TRITON_STUB_NUMPY``). The served functions
themselves run in this interpreter, with its own NumPy.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import tempfile
import time
import venv
from pathlib import Path
from typing import Any

# -- the server ---------------------------------------------------------------------------


def serve(args: argparse.Namespace) -> None:
    import numpy as np
    import onnxruntime as ort
    from pytriton.decorators import batch
    from pytriton.model_config import ModelConfig, Tensor
    from pytriton.triton import Triton, TritonConfig

    onnx = Path(args.onnx)
    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    session = ort.InferenceSession(str(onnx), sess_options=so, providers=["CPUExecutionProvider"])
    (inp,) = session.get_inputs()
    (out,) = session.get_outputs()
    item = tuple(int(d) for d in inp.shape[1:])
    out_item = tuple(d if isinstance(d, int) and d > 0 else -1 for d in out.shape[1:])
    calls = Path(args.calls)

    def record(model: str, n: int) -> None:
        with calls.open("a") as f:
            f.write(f"{model} {n}\n")

    def run(images: Any) -> Any:
        return {out.name: session.run([out.name], {inp.name: images})[0]}

    stem = onnx.stem if args.name is None else args.name

    @batch
    def plain(**inputs: Any) -> Any:
        images = inputs[inp.name]
        record(stem, len(images))
        return run(images)

    @batch
    def uint8(**inputs: Any) -> Any:
        images = inputs[inp.name]
        if images.dtype != np.uint8:
            raise ValueError(f"expected uint8, got {images.dtype}")
        record(f"{stem}_u8", len(images))
        return run(images.astype(np.float32) / np.float32(255.0))

    @batch
    def slow(**inputs: Any) -> Any:
        images = inputs[inp.name]
        record(f"{stem}_slow", len(images))
        time.sleep(args.slow_s)
        return run(images)

    @batch
    def broken(**inputs: Any) -> Any:
        record(f"{stem}_broken", len(inputs[inp.name]))
        raise ValueError("the served function failed on purpose")

    if args.stub_prefix:
        # PyTriton starts the stub with this prefix's bin/ first on PATH, and the stub
        # takes its sys.path (so its NumPy) from the python it finds there.
        sys.exec_prefix = args.stub_prefix
    config = TritonConfig(
        grpc_address="127.0.0.1",
        grpc_port=args.grpc_port,
        http_address="127.0.0.1",
        http_port=args.http_port,
        metrics_address="127.0.0.1",
        metrics_port=args.metrics_port,
        allow_gpu_metrics=False,
        exit_on_error=True,
        log_verbose=0,
    )
    outputs = [Tensor(name=out.name, dtype=np.float32, shape=out_item)]
    model_config = ModelConfig(max_batch_size=args.max_batch_size)
    with Triton(config=config, workspace=args.workspace) as triton:
        for name, func, dtype in (
            (stem, plain, np.float32),
            (f"{stem}_u8", uint8, np.uint8),
            (f"{stem}_slow", slow, np.float32),
            (f"{stem}_broken", broken, np.float32),
        ):
            triton.bind(
                model_name=name,
                infer_func=func,
                inputs=[Tensor(name=inp.name, dtype=dtype, shape=item)],
                outputs=outputs,
                config=model_config,
            )
        triton.run()  # returns once the models are loaded
        print(f"READY {args.grpc_port}", flush=True)
        with contextlib.suppress(KeyboardInterrupt):
            triton.serve()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--onnx", required=True)
    p.add_argument("--name", default=None, help="model name (default: the file's stem)")
    p.add_argument("--grpc-port", type=int, required=True)
    p.add_argument("--http-port", type=int, required=True)
    p.add_argument("--metrics-port", type=int, required=True)
    p.add_argument("--max-batch-size", type=int, default=8)
    p.add_argument("--slow-s", type=float, default=2.0)
    p.add_argument("--calls", required=True)
    p.add_argument("--workspace", required=True, help="PyTriton's sockets and temporary files")
    p.add_argument("--stub-prefix", default=None, help="a Python prefix for the backend stub")
    serve(p.parse_args(argv))


# -- the driver (used by the tests) -------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def library_path() -> str:
    """``LD_LIBRARY_PATH`` with the running Python's LIBDIR first (tritonserver's stubs load libpython)."""
    libdir = sysconfig.get_config_var("LIBDIR") or ""
    rest = os.environ.get("LD_LIBRARY_PATH", "")
    return ":".join(p for p in (libdir, rest) if p)


def stub_numpy() -> Path | None:
    """The NumPy 1 site for the backend stub, where this environment's NumPy is 2 or later."""
    import numpy

    if int(numpy.__version__.split(".")[0]) < 2:
        return None
    return Path(os.environ.get("VIDPIPE_TRITON_STUB_NUMPY") or Path(sys.prefix) / "triton-stub-numpy")


def make_stub_prefix(where: Path) -> Path | None:
    """A bare virtual environment whose site-packages reads the NumPy 1 site, then ours."""
    site = stub_numpy()
    if site is None:
        return None
    venv.create(where, with_pip=False, clear=True)
    purelib = Path(sysconfig.get_path("purelib", vars={"base": str(where), "platbase": str(where)}))
    ours = sysconfig.get_path("purelib")
    # .pth lines are added in file-name order: NumPy 1 before our site-packages.
    (purelib / "a_stub_numpy.pth").write_text(f"{site}\n")
    (purelib / "b_environment.pth").write_text(f"{ours}\n")
    return where


def unavailable_reason() -> str | None:
    """Why a Triton server cannot run here, or None."""
    try:
        import pytriton
        import pytriton.client  # pulls tritonclient's http and grpc parts
    except ImportError as exc:
        return f"nvidia-pytriton cannot be imported ({exc}); `make install` installs it and its dependencies"
    site = stub_numpy()
    if site is not None and not (site / "numpy").is_dir():
        return (
            f"Triton's Python backend stub needs NumPy < 2 and none is at {site}: "
            f'pip install --no-deps --target "{site}" "numpy<2"'
        )
    binary = Path(pytriton.__file__).parent / "tritonserver" / "bin" / "tritonserver"
    if not binary.is_file():
        return f"the nvidia-pytriton wheel has no tritonserver binary here ({binary})"
    try:
        subprocess.run(
            [str(binary), "--help"],
            env={**os.environ, "LD_LIBRARY_PATH": library_path()},
            capture_output=True,
            timeout=30,
            check=False,
        )
    except OSError as exc:
        return f"tritonserver cannot run on this machine: {exc}"
    return None


class TritonTestServer:
    """The script above in a subprocess on free loopback ports."""

    def __init__(self, onnx: Path, workdir: Path, *, name: str | None = None, slow_s: float = 2.0) -> None:
        self.onnx = Path(onnx).resolve()
        self.name = name or self.onnx.stem
        self.workdir = Path(workdir)
        self.slow_s = slow_s
        self.grpc_port = free_port()
        self.http_port = free_port()
        self.calls_file = self.workdir / "calls.txt"
        self.log_file = self.workdir / "triton.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self.workspace = self.workdir / "workspace"

    @property
    def url(self) -> str:
        return f"grpc://127.0.0.1:{self.grpc_port}"

    def start(self, timeout: float = 120.0) -> TritonTestServer:
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.calls_file.write_text("")
        stub_prefix = make_stub_prefix(self.workdir / "stub-prefix")
        # PyTriton's unix sockets live here: a short path (sun_path holds 107 bytes).
        self.workspace = Path(tempfile.mkdtemp(prefix="pytriton-")) / "w"  # PyTriton creates it
        env = {**os.environ, "LD_LIBRARY_PATH": library_path(), "PYTHONUNBUFFERED": "1"}
        cmd = [
            sys.executable,
            __file__,
            "--onnx",
            str(self.onnx),
            "--name",
            self.name,
            "--grpc-port",
            str(self.grpc_port),
            "--http-port",
            str(self.http_port),
            "--metrics-port",
            str(free_port()),
            "--slow-s",
            str(self.slow_s),
            "--calls",
            str(self.calls_file),
            "--workspace",
            str(self.workspace),
        ]
        if stub_prefix is not None:
            cmd += ["--stub-prefix", str(stub_prefix)]
        log = self.log_file.open("wb")
        self.proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=log, env=env, cwd=self.workdir, start_new_session=True
        )
        assert self.proc.stdout is not None
        deadline = time.monotonic() + timeout
        buffered = b""
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"triton server exited with {self.proc.returncode}:\n{self._log_tail()}")
            ready, _, _ = select.select([self.proc.stdout], [], [], 0.5)
            if ready:
                chunk = os.read(self.proc.stdout.fileno(), 4096)
                buffered += chunk
                if b"READY" in buffered:
                    return self
        self.stop()
        raise RuntimeError(f"triton server not ready after {timeout:.0f} s:\n{self._log_tail()}")

    def calls(self, model: str | None = None) -> list[int]:
        """Batch sizes of the server calls so far (of one model, or of the plain one)."""
        want = model or self.name
        sizes = []
        for line in self.calls_file.read_text().splitlines():
            name, n = line.split()
            if name == want:
                sizes.append(int(n))
        return sizes

    def stop(self, timeout: float = 20.0) -> None:
        """Stop the server (PyTriton shuts tritonserver down), then anything left of its group."""
        proc, self.proc = self.proc, None
        if proc is None:
            return
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=timeout)
        # The group is the script, tritonserver and its stubs: none may outlive the test.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()
        shutil.rmtree(self.workspace.parent, ignore_errors=True)

    def _log_tail(self) -> str:
        try:
            return self.log_file.read_text(errors="replace")[-4000:]
        except OSError:
            return ""


if __name__ == "__main__":
    main()
