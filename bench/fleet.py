"""Fleet failover: kill -9 a worker, time until its sources publish again elsewhere.

::

    python bench/fleet.py [--kills 10] [--workers 3] [--sources 6] [--ttl 3]

Starts a nats-server with JetStream, ``--workers`` ``vidpipe run --fleet``
processes sharing ``--sources`` ``test://`` cameras, and a subscriber that reads
every message. Then ``--kills`` times: kill -9 a worker that owns sources, time
each of its sources from the kill to the first message from another worker,
start a replacement and wait for the fleet to settle again (the replacement
takes its share: handovers by release, checked too).

Counted over the whole run, from the subscriber's side:

* ``stale_publishes``: messages that arrived after a message of the same
  source with a larger ``lease`` (an old owner still publishing);
* ``double_owned``: handovers where the old owner's last message was
  published after the new owner's first (two owners at once).

Last line: ``failover_p99_s=… stale_publishes=… double_owned=…``.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import nats

from bench.common import ROOT, cpu_name, describe_load, percentile, utc_now
from pipeline.nats_server import EmbeddedNats

Message = tuple[float, dict[str, Any]]


class Bench:
    def __init__(self, args: argparse.Namespace, url: str, tmp: Path) -> None:
        self.args = args
        self.url = url
        self.tmp = tmp
        self.sources = [f"cam{i}" for i in range(1, args.sources + 1)]
        self.messages: list[Message] = []
        self.config = tmp / "fleet.yaml"
        lines = ["pipeline: bench", f"fleet: {{name: bench, lease_ttl: {args.ttl:g}}}", "sources:"]
        lines += [f"  - url: test://?id={s}&width=64&height=48&fps={args.fps:g}" for s in self.sources]
        self.config.write_text("\n".join(lines) + "\n")

    def owners(self, window: float) -> dict[str, str]:
        cutoff = time.monotonic() - window
        return {m["source"]: m["worker"] for at, m in self.messages if at >= cutoff}

    async def settle(self, workers: int, timeout: float = 60.0) -> dict[str, str]:
        """Until every source publishes, spread evenly over ``workers`` workers, unchanged for 1.5 s."""
        deadline = time.monotonic() + timeout
        last: dict[str, str] = {}
        still = time.monotonic()
        while time.monotonic() < deadline:
            await asyncio.sleep(0.25)
            owners = self.owners(0.6)
            if owners != last:
                last, still = owners, time.monotonic()
                continue
            counts = [list(owners.values()).count(w) for w in set(owners.values())]
            even = counts and max(counts) - min(counts) <= 1
            if (
                sorted(owners) == self.sources
                and len(counts) == workers
                and even
                and time.monotonic() - still >= 1.5
            ):
                return owners
        raise RuntimeError(f"the fleet did not settle within {timeout:.0f}s: {last}")

    def first_from_other(self, source: str, worker: str, after: float) -> float | None:
        for at, m in self.messages:
            if at >= after and m["source"] == source and m["worker"] != worker:
                return at
        return None

    def stale_publishes(self) -> int:
        top: dict[str, int] = {}
        stale = 0
        for _, m in self.messages:
            if m["lease"] < top.get(m["source"], 0):
                stale += 1
            top[m["source"]] = max(top.get(m["source"], 0), m["lease"])
        return stale

    def double_owned(self) -> int:
        spans: dict[str, dict[int, list[float]]] = defaultdict(dict)
        for _, m in self.messages:
            span = spans[m["source"]].setdefault(m["lease"], [m["publish_ts"], m["publish_ts"]])
            span[0] = min(span[0], m["publish_ts"])
            span[1] = max(span[1], m["publish_ts"])
        overlaps = 0
        for leases in spans.values():
            ordered = [leases[k] for k in sorted(leases)]
            overlaps += sum(1 for old, new in itertools.pairwise(ordered) if old[1] > new[0])
        return overlaps


def pid_of(worker_id: str) -> int:
    """Worker ids default to ``<hostname>-<pid>``."""
    return int(worker_id.rsplit("-", 1)[1])


def spawn(config: Path, url: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-m", "pipeline.cli", "run", str(config), "--fleet", "bench", "--nats", url,
         "--log-level", "warning"],
        cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip


async def run(args: argparse.Namespace) -> int:
    with (
        tempfile.TemporaryDirectory(prefix="vidpipe-fleet-bench-") as tmpdir,
        EmbeddedNats(store_dir=str(Path(tmpdir) / "js")) as server,
    ):
        tmp = Path(tmpdir)
        bench = Bench(args, server.url, tmp)
        nc = await nats.connect(server.url)

        async def on_msg(msg: Any) -> None:
            bench.messages.append((time.monotonic(), json.loads(msg.data)))

        await nc.subscribe("vidpipe.bench.*.detections", cb=on_msg)
        await nc.flush()
        procs: dict[int, subprocess.Popen[bytes]] = {}
        try:
            for _ in range(args.workers):
                proc = spawn(bench.config, server.url)
                procs[proc.pid] = proc
            owners = await bench.settle(args.workers)
            failovers: list[float] = []
            for i in range(args.kills):
                victim = sorted(set(owners.values()))[i % len(set(owners.values()))]
                lost = [s for s, w in owners.items() if w == victim]
                t_kill = time.monotonic()
                procs.pop(pid_of(victim)).kill()
                deadline = t_kill + args.ttl + 15
                resumed: dict[str, float] = {}
                while len(resumed) < len(lost) and time.monotonic() < deadline:
                    await asyncio.sleep(0.05)
                    for s in lost:
                        at = bench.first_from_other(s, victim, t_kill)
                        if at is not None:
                            resumed[s] = at - t_kill
                if len(resumed) < len(lost):
                    raise RuntimeError(f"kill {i + 1}: {set(lost) - set(resumed)} never resumed")
                failovers += resumed.values()
                print(
                    f"kill {i + 1}: {len(lost)} source(s), failover max {max(resumed.values()):.2f}s",
                    flush=True,
                )
                proc = spawn(bench.config, server.url)
                procs[proc.pid] = proc
                owners = await bench.settle(args.workers)
        finally:
            for proc in procs.values():
                proc.send_signal(signal.SIGTERM)
            for proc in procs.values():
                try:
                    proc.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    proc.kill()
            await nc.close()
    p50 = percentile(failovers, 50)
    p99 = percentile(failovers, 99)
    print(
        f"{utc_now()} {cpu_name()}, {os.cpu_count()} CPU(s), {describe_load()}; "
        f"{args.workers} workers, {args.sources} sources at {args.fps:g} fps, lease_ttl {args.ttl:g}s"
    )
    print(
        f"failovers: {len(failovers)} source moves over {args.kills} kills; "
        f"p50 {p50:.2f}s, p99 {p99:.2f}s, max {max(failovers):.2f}s"
    )
    print(f"messages: {len(bench.messages)}")
    print(
        f"failover_p99_s={p99:.2f} stale_publishes={bench.stale_publishes()} "
        f"double_owned={bench.double_owned()}"
    )
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kills", type=int, default=10)
    parser.add_argument("--workers", type=int, default=3)
    parser.add_argument("--sources", type=int, default=6)
    parser.add_argument("--ttl", type=float, default=3.0, help="fleet.lease_ttl, seconds")
    parser.add_argument("--fps", type=float, default=20.0)
    return asyncio.run(run(parser.parse_args()))


if __name__ == "__main__":
    sys.exit(main())
