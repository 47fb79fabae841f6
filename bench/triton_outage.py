"""A remote model through a Triton server outage: how soon its state shows it, and comes back.

::

    python bench/triton_outage.py [--down 76] [--outages 2]

Starts the loopback Triton server of the tests (PyTriton serving the sample
``squares`` detector), loads it as a ``backend: triton`` model, keeps sending it
one image every 50 ms, stops the server for ``--down`` seconds, then starts it
again. Per outage: ``unready_s``, from the server's exit to the model's state
``unavailable`` (what ``/readyz`` and ``vidpipe_model_ready`` follow);
``ready_s``, from the server printing READY again to the model's state
``ready``; ``stopping_s``, how long the server took to stop (the model may
already be unavailable by then: ``unready_s`` 0); ``answered_s``, from READY to the first answered image;
``failed_batches``, batches that failed while it was down (the rest were refused
without a batch). Needs what ``tests/inference/test_triton.py`` needs.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import SAMPLE_MODELS, cpu_name, describe_load, utc_now
from inference.batcher import InferenceFailed
from inference.model import Model, ModelState, ModelUnavailable
from tests.inference.test_triton import IMAGES, remote_repo
from tests.support.triton_server import TritonTestServer, unavailable_reason


async def outage(server: TritonTestServer, model: Model, down: float) -> dict[str, float | int]:
    failed = 0
    began = time.monotonic()
    server.stop()  # blocks while the server shuts down (seconds, for PyTriton)
    stop = time.monotonic()
    unready = 0.0 if model.state is ModelState.UNAVAILABLE else None
    while time.monotonic() - stop < down:
        if unready is None and model.state is ModelState.UNAVAILABLE:
            unready = time.monotonic() - stop
        try:
            await model.infer(IMAGES[0])
        except InferenceFailed:
            failed += 1
        except ModelUnavailable:
            pass
        await asyncio.sleep(0.05)
    server.start()
    back = time.monotonic()
    ready = answered = None
    while answered is None:
        if ready is None and model.state is ModelState.READY:
            ready = time.monotonic() - back
        try:
            await model.infer(IMAGES[0])
            answered = time.monotonic() - back
        except (InferenceFailed, ModelUnavailable):
            await asyncio.sleep(0.05)
        if time.monotonic() - back > 300:
            raise RuntimeError("the model never answered again")
    return {
        "stopping_s": round(stop - began, 2),
        "unready_s": round(unready if unready is not None else -1, 2),
        "ready_s": round(ready if ready is not None else answered, 2),
        "answered_s": round(answered, 2),
        "failed_batches": failed,
    }


async def main_async(args: argparse.Namespace) -> int:
    reason = unavailable_reason()
    if reason:
        print(f"skipped: {reason}")
        return 1
    print(f"{utc_now()} {cpu_name()}, {describe_load()}; down {args.down:g}s", flush=True)
    with tempfile.TemporaryDirectory(prefix="vidpipe-triton-outage-") as tmp:
        onnx = SAMPLE_MODELS / "squares" / "model.onnx"
        server = TritonTestServer(onnx, Path(tmp) / "server", name="squares").start()
        repo = remote_repo(Path(tmp) / "models", server.url)
        try:
            status = await repo.load("squares")
            assert status.state is ModelState.READY, status.reason
            model = repo.get("squares")
            for i in range(args.outages):
                counts = await outage(server, model, args.down)
                print(f"outage={i + 1} " + " ".join(f"{k}={v}" for k, v in counts.items()), flush=True)
        finally:
            await repo.close()
            server.stop()
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--down", type=float, default=76.0, help="seconds the server stays stopped")
    parser.add_argument("--outages", type=int, default=2)
    return asyncio.run(main_async(parser.parse_args()))


if __name__ == "__main__":
    sys.exit(main())
