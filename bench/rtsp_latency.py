"""Latency and reconnect time of one RTSP camera, end to end through NATS.

Starts the GStreamer test server (tests/support/rtsp_server.py, 320x240 at 15 fps,
keyframe every second) and an embedded nats-server, runs the pipeline in-process
on the stream with no inference stages, and subscribes to its messages.

* latency: ``publish_ts - capture_ts`` (decoded to published) and receive time at
  the subscriber minus ``capture_ts``, p50/p99 over ``--seconds`` of streaming;
* reconnect: the server is killed, restarted ``--down`` seconds later on the same
  port, and the time from its return to the first message of a frame decoded
  after it is taken; ``--repeats`` times, median reported.

::

    python bench/rtsp_latency.py [--seconds 20] [--repeats 3] [--down 2]
                                 [--min-delay 0.5] [--max-delay 10] [--transport tcp]

The last line is machine-readable:
``rtsp_latency_p50_ms=.. p99_ms=.. reconnect_s_median=..``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
import yaml  # noqa: E402

from pipeline.config import load_config  # noqa: E402
from pipeline.nats_server import EmbeddedNats  # noqa: E402
from pipeline.runtime import Runtime  # noqa: E402
from tests.support.rtsp_server import RtspTestServer  # noqa: E402


class Received:
    """Messages as the subscriber saw them: (receive wall time, message)."""

    def __init__(self) -> None:
        self.items: list[tuple[float, dict[str, Any]]] = []

    async def start(self, url: str) -> Any:
        import nats

        nc = await nats.connect(url)

        async def on_msg(msg: Any) -> None:
            self.items.append((time.time(), json.loads(msg.data)))

        await nc.subscribe("vidpipe.>", cb=on_msg)
        await nc.flush()
        return nc

    def first_after(self, wall: float) -> float | None:
        """Receive time of the first message whose frame was decoded after ``wall``."""
        return next((t for t, m in self.items if m["capture_ts"] > wall), None)


def percentiles_ms(values: list[float]) -> tuple[float, float]:
    p50, p99 = np.percentile(np.asarray(values) * 1000.0, [50, 99])
    return float(p50), float(p99)


async def bench(args: argparse.Namespace) -> int:
    tmp = Path(tempfile.mkdtemp(prefix="vidpipe-bench-"))
    server = RtspTestServer({"/live": "live"}).start()
    nats_server = EmbeddedNats(store_dir=str(tmp / "js")).start()
    source = {
        "id": "cam",
        "url": server.url(),
        "transport": args.transport,
        "reconnect": {"min_delay": args.min_delay, "max_delay": args.max_delay, "jitter": 0.2},
    }
    cfg_path = tmp / "bench.yaml"
    cfg_path.write_text(yaml.safe_dump({"pipeline": "bench", "sources": [source]}))
    runtime = Runtime(load_config(cfg_path), nats_url=nats_server.url)
    received = Received()
    nc = await received.start(nats_server.url)
    reconnects: list[float] = []
    try:
        await runtime.start()
        started = time.time()
        deadline = time.monotonic() + 15
        while not received.items and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        if not received.items:
            print("no message from the camera within 15 s", file=sys.stderr)
            return 1
        first_message = received.items[0][0] - started
        await asyncio.sleep(args.seconds)
        steady = list(received.items)
        for _ in range(args.repeats):
            server.kill()
            await asyncio.sleep(args.down)
            server.start()
            back = time.time()
            limit = time.monotonic() + args.max_delay * 1.3 + 15
            seen = None
            while seen is None and time.monotonic() < limit:
                await asyncio.sleep(0.005)
                seen = received.first_after(back)
            if seen is None:
                print("the camera did not come back", file=sys.stderr)
                return 1
            reconnects.append(seen - back)
            await asyncio.sleep(1.0)  # settle before the next outage
    finally:
        await runtime.stop()
        await nc.close()
        server.stop()
        nats_server.cleanup()

    publish = [m["publish_ts"] - m["capture_ts"] for _, m in steady]
    receive = [t - m["capture_ts"] for t, m in steady]
    pub50, pub99 = percentiles_ms(publish)
    rcv50, rcv99 = percentiles_ms(receive)
    frames = [m["frame"] for _, m in steady]
    rate = len(steady) / max(1e-9, steady[-1][0] - steady[0][0])
    median = statistics.median(reconnects)
    print(f"RTSP {args.transport} 320x240 15 fps, {len(steady)} messages ({rate:.1f}/s), "
          f"frames {frames[0]}..{frames[-1]}, first message {first_message:.2f}s after start")  # fmt: skip
    print(f"{'measure':<34}{'p50':>10}{'p99':>10}")
    print(f"{'capture -> publish (ms)':<34}{pub50:>10.2f}{pub99:>10.2f}")
    print(f"{'capture -> subscriber (ms)':<34}{rcv50:>10.2f}{rcv99:>10.2f}")
    print(f"reconnect after {args.down:g}s down, backoff {args.min_delay:g}..{args.max_delay:g}s (s): "
          + ", ".join(f"{r:.2f}" for r in reconnects) + f"  median {median:.2f}")  # fmt: skip
    print(f"rtsp_latency_p50_ms={rcv50:.2f} p99_ms={rcv99:.2f} reconnect_s_median={median:.2f}")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--seconds", type=float, default=20.0, help="steady streaming to measure")
    parser.add_argument("--repeats", type=int, default=3, help="server outages")
    parser.add_argument("--down", type=float, default=2.0, help="seconds the server stays away")
    parser.add_argument("--min-delay", type=float, default=0.5, help="reconnect.min_delay")
    parser.add_argument("--max-delay", type=float, default=10.0, help="reconnect.max_delay")
    parser.add_argument("--transport", choices=["tcp", "udp"], default="tcp")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(message)s")
    return asyncio.run(bench(args))


if __name__ == "__main__":
    sys.exit(main())
