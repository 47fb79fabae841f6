"""The Triton backend: a model served by a remote KServe v2 server over gRPC.

Batches still form in vidpipe's own dynamic batcher and pre- and post-processing
stay local; each batch is one ``infer`` call to a Triton Inference Server (or any
KServe v2 gRPC server, such as OpenVINO Model Server)::

    name: squares
    backend: triton                     # no model_file: the server holds the model
    max_batch_size: 8                   # at most the server model's max_batch_size
    input: {shape: [3, 320, 320], name: images}
    task: {kind: yolo}
    instance_group: [{count: 2}]        # batches in flight to the server at once
    backend_options:
      url: grpc://triton.example:8001
      model_name: squares               # the name on the server
      timeout_ms: 5000                  # a batch that takes longer fails its requests

Tensor names, types and shapes come from the server's model metadata and are
checked once at load against ``input`` (as for a local file). A model whose
input is UINT8 gets raw pixels (0..255): the config must then leave the
normalisation to the server (``input: {scale: 1}``, default mean and std), and
each batch goes over the wire as uint8, a quarter of the bytes.

A server that cannot be reached, a batch that passes ``timeout_ms`` and an error
the server answers with each fail that batch's requests with a
:class:`TritonError` subclass naming the server, the model and the reason.

While the server is away the gRPC channel tries to reconnect with a backoff that
starts at 250 ms and is bounded at 2 s (gRPC's own grows to 120 s, so after a long
outage batches would resume up to two minutes after the server is back).

The model's state follows the server's health (:class:`ServerHealth`): every
``HEALTH_INTERVAL`` (2 s) a probe asks whether the server is live and ready and
the model ready, every ``RECOVERY_INTERVAL`` (0.5 s) while it is not; a batch
that cannot reach the server or passes ``timeout_ms`` makes the model
``unavailable`` at once, until a probe succeeds. So ``/readyz`` answers 503 and
``vidpipe_model_ready`` drops to 0 while the server is away, frames are refused
instead of failing one batch after another, and the model is ready again within
about half a second of the server (plus the channel's reconnect, at most 2 s).
"""

from __future__ import annotations

import re
import threading
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, ClassVar
from urllib.parse import urlsplit

import numpy as np

from inference.backends.base import Backend, BackendError, TensorSpec
from inference.backends.inputs import check_input
from inference.config import ModelConfig, TritonOptions
from inference.errors import WholeBatchFailure

# KServe v2 datatypes and their NumPy names.
_DTYPES = {
    "FP32": "float32",
    "FP16": "float16",
    "FP64": "float64",
    "UINT8": "uint8",
    "INT8": "int8",
    "INT16": "int16",
    "INT32": "int32",
    "INT64": "int64",
    "BOOL": "bool",
    "BYTES": "str",
}
_WIRE = {numpy: wire for wire, numpy in _DTYPES.items()}

# The channel's options. Passing any replaces the client's defaults, so its unlimited
# message sizes are restated; the reconnect backoff is bounded (module docstring).
_LARGEST_MESSAGE = 2**31 - 1
CHANNEL_ARGS = [
    ("grpc.max_send_message_length", _LARGEST_MESSAGE),
    ("grpc.max_receive_message_length", _LARGEST_MESSAGE),
    ("grpc.initial_reconnect_backoff_ms", 250),
    ("grpc.min_reconnect_backoff_ms", 250),
    ("grpc.max_reconnect_backoff_ms", 2000),
]


# Seconds between health probes while the server serves, and while it does not.
HEALTH_INTERVAL = 2.0
RECOVERY_INTERVAL = 0.5


class ServerHealth:
    """Whether a remote model can serve now, from probes and from batches that fail.

    One per server and model in a process, shared by the model's instances (each
    instance's client would otherwise ask the same question). A probe thread asks
    the server; listeners hear each change: a reason, or None when it serves again.
    """

    _shared: ClassVar[dict[tuple[str, str], ServerHealth]] = {}
    _shared_lock = threading.Lock()

    def __init__(
        self, client: Any, exception: type[Exception], model: str, model_name: str, url: str
    ) -> None:
        self._client = client
        self._exception = exception
        self.model = model
        self.model_name = model_name
        self.url = url
        self.problem: str | None = None
        self._listeners: list[Callable[[str | None], None]] = []
        self._lock = threading.Lock()
        self._users = 0
        self._poke = threading.Event()
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"triton-health-{model}", daemon=True)

    @classmethod
    def share(cls, address: str, model_name: str, make: Callable[[], ServerHealth]) -> ServerHealth:
        """The health of ``model_name`` at ``address``, made (and its probe started) by the first user."""
        with cls._shared_lock:
            health = cls._shared.get((address, model_name))
            if health is None:
                health = cls._shared[(address, model_name)] = make()
                health._thread.start()
            health._users += 1
            return health

    def release(self, address: str) -> None:
        """One user fewer; the last one stops the probe."""
        with self._shared_lock:
            self._users -= 1
            if self._users > 0:
                return
            self._shared.pop((address, self.model_name), None)
        self._stopping.set()
        self._poke.set()
        self._thread.join(timeout=5)
        self._client.close()

    def watch(self, listener: Callable[[str | None], None]) -> None:
        with self._lock:
            if listener not in self._listeners:
                self._listeners.append(listener)
            problem = self.problem
        if problem is not None:
            listener(problem)

    def failed(self, reason: str) -> None:
        """A batch could not reach the server: not ready until a probe says otherwise."""
        self._set(reason)
        self._poke.set()

    def probe(self) -> str | None:
        """Ask the server once; the reason it cannot serve the model, or None."""
        timeout = min(2.0, RECOVERY_INTERVAL * 4)
        where = f"{self.model} on {self.url}"
        try:
            if not self._client.is_server_live(client_timeout=timeout):
                return f"{where}: the server is not live"
            if not self._client.is_server_ready(client_timeout=timeout):
                return f"{where}: the server is not ready"
            if not self._client.is_model_ready(self.model_name, client_timeout=timeout):
                return f"{where}: the server has no ready model {self.model_name!r}"
        except self._exception as exc:
            return f"{where}: the server cannot be reached ({_status(exc) or type(exc).__name__})"
        return None

    def _run(self) -> None:
        while not self._stopping.is_set():
            self._set(self.probe())
            self._poke.wait(HEALTH_INTERVAL if self.problem is None else RECOVERY_INTERVAL)
            self._poke.clear()

    def _set(self, problem: str | None) -> None:
        with self._lock:
            if problem == self.problem:
                return
            self.problem = problem
            listeners = list(self._listeners)
        for listener in listeners:
            listener(problem)


class TritonError(BackendError):
    """A remote model could not answer a batch; ``url`` and ``model`` say which."""

    def __init__(self, model: str, url: str, message: str) -> None:
        self.url = url
        self.model = model
        super().__init__(f"{model} on {url}: {message}")


class TritonUnavailable(TritonError, WholeBatchFailure):
    """The server cannot be reached (not started, stopped, connection lost)."""


class TritonTimeout(TritonError, WholeBatchFailure):
    """The server did not answer within ``backend_options.timeout_ms``."""


class TritonServerError(TritonError):
    """The server answered with an error (the model failed, a wrong tensor, ...)."""


def parse_url(config: ModelConfig) -> str:
    """``HOST:PORT`` from ``backend_options.url`` (``grpc://HOST:PORT``), or a config error at it."""
    url = config.backend_options_as(TritonOptions).url
    if not url:
        raise config.error(
            "backend_options", "backend triton needs backend_options.url", "add url: grpc://HOST:PORT"
        )
    parts = urlsplit(url)
    if "@" in parts.netloc:
        # gRPC to Triton carries no user info; one here is a password that would end up
        # in every error message that names the server.
        raise config.error(
            "backend_options.url",
            "the URL has a user or password, which Triton's gRPC endpoint does not take",
            "write it as grpc://HOST:PORT",
        )
    try:
        port = parts.port
    except ValueError:
        port = None
    if parts.scheme != "grpc" or not parts.hostname or port is None or parts.path not in ("", "/"):
        raise config.error(
            "backend_options.url",
            f"{url!r} is not a KServe gRPC address",
            "write it as grpc://HOST:PORT (Triton's gRPC port is 8001 by default)",
        )
    host = f"[{parts.hostname}]" if ":" in parts.hostname else parts.hostname
    return f"{host}:{port}"


def _status(exc: Exception) -> str:
    status = getattr(exc, "status", None)
    return str(status() if callable(status) else status or "")


def _summary(message: str) -> str:
    """A server's error in one line: its first line and the exception a traceback ends with."""
    lines = [line.strip() for line in message.splitlines() if line.strip()]
    if len(lines) <= 1:
        return message.strip()
    raised = [line for line in lines if re.match(r"^[\w.]+(Error|Exception)\b.*:", line)]
    tail = raised[-1] if raised else lines[-1]
    return lines[0] if tail == lines[0] else f"{lines[0]} ... {tail}"


def _spec(tensor: Mapping[str, Any]) -> TensorSpec:
    shape = tuple(int(d) if int(d) > 0 else None for d in tensor.get("shape", []))
    datatype = str(tensor.get("datatype", ""))
    return TensorSpec(str(tensor["name"]), shape, _DTYPES.get(datatype, datatype))


class TritonBackend(Backend):
    """One gRPC client to the server; one instance runs one batch at a time."""

    kind = "triton"
    options_type = TritonOptions

    def __init__(self, config: ModelConfig, model_path: Path, instance: int = 0) -> None:
        try:
            import tritonclient.grpc as grpcclient
        except ImportError as exc:
            raise BackendError(
                f"{config.name}: backend triton needs the `tritonclient[grpc]` package "
                f"(pip install 'vidpipe[triton]')"
            ) from exc
        self.config = config
        self.instance = instance
        opts = config.backend_options_as(TritonOptions)
        address = parse_url(config)
        if not opts.model_name:
            raise config.error(
                "backend_options",
                "backend triton needs backend_options.model_name",
                "add model_name: the model's name on the server",
            )
        self.url = opts.url or ""
        self.model_name = opts.model_name
        self.timeout_s = opts.timeout_ms / 1000.0
        self._exception: type[Exception] = grpcclient.InferenceServerException
        self._grpc = grpcclient
        self._client = grpcclient.InferenceServerClient(url=address, channel_args=CHANNEL_ARGS)
        self._address = address
        self._health: ServerHealth | None = None
        try:
            self._load(config, address)
        except BaseException:
            self.close()
            raise
        self._health = ServerHealth.share(
            address,
            self.model_name,
            lambda: ServerHealth(
                grpcclient.InferenceServerClient(url=address, channel_args=CHANNEL_ARGS),
                self._exception,
                config.name,
                self.model_name,
                self.url,
            ),
        )

    def watch_health(self, changed: Callable[[str | None], None]) -> None:
        if self._health is not None:
            self._health.watch(changed)

    def _load(self, config: ModelConfig, address: str) -> None:
        try:
            meta = self._client.get_model_metadata(
                self.model_name, as_json=True, client_timeout=self.timeout_s
            )
        except self._exception as exc:
            raise self._load_error(config, exc) from exc
        self.inputs = [_spec(t) for t in meta.get("inputs", [])]
        self.outputs = [_spec(t) for t in meta.get("outputs", [])]
        self.metadata = {}
        server_batch: int | None = None
        try:
            model_config = self._client.get_model_config(
                self.model_name, as_json=True, client_timeout=self.timeout_s
            ).get("config", {})
        except self._exception:
            model_config = {}  # not every KServe v2 server has Triton's model configuration
        if model_config:
            server_batch = int(model_config.get("max_batch_size", 0))
            # A model's string parameters stand in for a model file's metadata
            # (e.g. a text recogniser's `character` dictionary).
            for key, value in (model_config.get("parameters") or {}).items():
                if isinstance(value, Mapping) and "string_value" in value:
                    self.metadata[str(key)] = str(value["string_value"])
        where = Path(f"{self.model_name}@{address}")
        declared = self.inputs
        self.wire_dtype = ""
        named = [t for t in declared if t.name == (config.input.name or t.name)][:1]
        if named and named[0].dtype == "uint8":
            self._check_raw_pixels(config, named[0])
            # The server takes raw pixels; the local tensor stays float and is sent as uint8.
            declared = [
                TensorSpec(t.name, t.shape, config.input.dtype) if t is named[0] else t for t in declared
            ]
            self.wire_dtype = "uint8"
        self.input = check_input(config, where, declared)
        if not self.wire_dtype:
            self.wire_dtype = self.input.dtype
        if server_batch is not None and config.max_batch_size > max(server_batch, 0):
            raise config.error(
                "max_batch_size",
                f"the server's model {self.model_name!r} takes batches of at most {server_batch}, "
                f"but max_batch_size is {config.max_batch_size}",
                f"set max_batch_size to {server_batch} or less",
            )
        self._output_names = [o.name for o in self.outputs]

    def _check_raw_pixels(self, config: ModelConfig, spec: TensorSpec) -> None:
        inp = config.input
        if inp.scale != 1.0 or any(m != 0 for m in inp.mean) or any(s != 1 for s in inp.std):
            raise config.error(
                "input.scale",
                f"the server's model {self.model_name!r} takes {spec.name!r} as uint8 (raw pixels), "
                f"so the image cannot be normalised here",
                "set input: {scale: 1} and leave mean and std at their defaults; the server normalises",
            )

    def _load_error(self, config: ModelConfig, exc: Exception) -> Exception:
        status = _status(exc)
        if "UNAVAILABLE" in status or "DEADLINE_EXCEEDED" in status:
            return TritonUnavailable(
                config.name,
                self.url,
                f"cannot reach the server ({exc.__class__.__name__}: {status}); "
                f"is it running, and is {self.url} its gRPC port?",
            )
        if "NOT_FOUND" in status or "INVALID_ARGUMENT" in status or "unknown model" in str(exc).lower():
            served = self._served_models()
            return config.error(
                "backend_options.model_name",
                f"the server at {self.url} has no model {self.model_name!r}"
                + (f" (it serves: {', '.join(served)})" if served else ""),
                "set model_name to a model the server has loaded",
            )
        return TritonServerError(config.name, self.url, f"model metadata failed: {exc}")

    def _served_models(self) -> list[str]:
        try:
            index = self._client.get_model_repository_index(as_json=True, client_timeout=self.timeout_s)
        except self._exception:
            return []
        return sorted({str(m["name"]) for m in index.get("models", []) if "name" in m})

    def run(self, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        grpc = self._grpc
        requests = []
        for name, array in inputs.items():
            if name == self.input.name and self.wire_dtype == "uint8":
                array = np.clip(np.rint(array), 0, 255).astype(np.uint8)
            array = np.ascontiguousarray(array)
            wire = grpc.InferInput(name, list(array.shape), _WIRE.get(str(array.dtype), "FP32"))
            wire.set_data_from_numpy(array)
            requests.append(wire)
        wanted = [grpc.InferRequestedOutput(n) for n in self._output_names]
        try:
            result = self._client.infer(
                self.model_name, requests, outputs=wanted, client_timeout=self.timeout_s
            )
        except self._exception as exc:
            error = self._run_error(exc, inputs)
            if self._health is not None and isinstance(error, TritonUnavailable | TritonTimeout):
                self._health.failed(str(error))
            raise error from exc
        outputs: dict[str, np.ndarray] = {}
        for name in self._output_names:
            array = result.as_numpy(name)
            if array is None:
                raise TritonServerError(self.config.name, self.url, f"the answer has no output {name!r}")
            outputs[name] = array
        return outputs

    def _run_error(self, exc: Exception, inputs: Mapping[str, np.ndarray]) -> TritonError:
        status = _status(exc)
        name, url = self.config.name, self.url
        message = _summary(str(exc.message()) if callable(getattr(exc, "message", None)) else str(exc))  # type: ignore[attr-defined]
        if "DEADLINE_EXCEEDED" in status:
            return TritonTimeout(name, url, f"no answer within timeout_ms {self.timeout_s * 1000:.0f}")
        if "UNAVAILABLE" in status:
            return TritonUnavailable(name, url, f"the server cannot be reached: {message}")
        shapes = ", ".join(f"{k}{list(v.shape)}" for k, v in inputs.items())
        return TritonServerError(name, url, f"the server failed on {shapes}: {message}")

    def close(self) -> None:
        health = self.__dict__.pop("_health", None)
        if health is not None:
            health.release(self._address)
        client = self.__dict__.pop("_client", None)
        if client is not None:
            client.close()
