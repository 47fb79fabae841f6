"""Fleet faults on a 3-node JetStream cluster, judged by an independent consumer.

::

    python bench/fleet.py [--scenarios all] [--workers 3] [--sources 9] [--ttl 12]

Each scenario starts a fresh 3-node ``nats-server`` cluster (routes, JetStream,
the fleet's buckets at ``replicas: 3``), ``--workers`` ``vidpipe run --fleet``
processes sharing ``--sources`` ``test://`` cameras, and a subscriber connected
to every node that reads every detections message. Each worker reaches NATS
only through a TCP proxy of this file's own, one per worker and node, that can
**cut** (reset every connection and refuse new ones), **stall** (hold every
byte, both ways, and deliver it later, as TCP does across a silent partition)
or **slow** (deliver every chunk a fixed time late) its links, all of them or
only the publishing connection (told apart by the name in its ``CONNECT``):
``tests/support/fault_proxy.py``, which the fleet tests use too.

Scenarios: ``leader_kill`` (kill -9 the node that leads the leases bucket,
restart it 10 s later), ``nonleader_kill``, ``partition`` (a worker's links
stalled for ``2 × lease_ttl``), ``cut`` (reset for 10 s), ``stall`` (stalled for
``lease_ttl / 2``), ``slow`` (1000 ms each way for 30 s), ``publisher_stall``
(only the publishing connection, for ``2 × lease_ttl``), ``leases_deleted``
(another client deletes the leases bucket), ``store_wiped`` (every node stopped,
its store removed, started again) and ``churn`` (two sources added, two
removed, one updated, a worker joins, one drains, one is killed).

Counted by the consumer, which applies the documented rule (keep the highest
``(epoch, lease)`` per source, drop anything below):

* ``double``: handovers where two fences of one source published at once (the
  old owner's last message later than the new owner's first, by ``publish_ts``);
* ``stale``: messages the rule accepted although a larger fence had already
  published earlier (the rule let a replaced owner through);
* ``dropped``: messages the rule dropped;
* ``dark_s``: the longest time any source went without an accepted message
  from the fault on; ``gaps``: silences over 1 s; ``moves``: owner changes of
  the source that moved most.

Churn also reports removed sources seen again (``resurrected``) and the
slowest update (``update_s``: from the change to the first message with the
new settings). Last line per scenario: ``scenario=... double=... stale=...``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import nats

from bench.common import ROOT, cpu_name, describe_load, utc_now
from pipeline.config import SourceConfig
from pipeline.fleet.buckets import open_bucket
from pipeline.fleet.desired import DesiredSources
from pipeline.nats_server import find_nats_server, free_port
from tests.support.fault_proxy import Faults, Proxy

SCENARIOS = (
    "leader_kill",
    "nonleader_kill",
    "partition",
    "cut",
    "stall",
    "slow",
    "publisher_stall",
    "leases_deleted",
    "store_wiped",
    "churn",
)
FLEET = "bench"


# -- a 3-node cluster ------------------------------------------------------------------------


class Node:
    def __init__(self, name: str, tmp: Path, port: int, cluster_port: int) -> None:
        self.name = name
        self.port = port
        self.cluster_port = cluster_port
        self.store = tmp / f"store-{name}"
        self.conf = tmp / f"{name}.conf"
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"

    def write(self, routes: list[int]) -> None:
        route_urls = ", ".join(f"nats-route://127.0.0.1:{p}" for p in routes if p != self.cluster_port)
        self.conf.write_text(
            f"server_name: {self.name}\nlisten: 127.0.0.1:{self.port}\n"
            f'jetstream {{ store_dir: "{self.store}", max_memory_store: 256MB, max_file_store: 1GB }}\n'
            # no_advertise: clients learn no node addresses, so workers stay behind their proxies.
            f"cluster {{ name: vp, listen: 127.0.0.1:{self.cluster_port}, no_advertise: true, "
            f"routes: [{route_urls}] }}\n"
        )

    def start(self) -> None:
        self.proc = subprocess.Popen(
            [find_nats_server(), "-c", str(self.conf)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.proc = None


class Cluster:
    def __init__(self, tmp: Path) -> None:
        self.nodes = [Node(f"n{i}", tmp, free_port(), free_port()) for i in range(1, 4)]
        for n in self.nodes:
            n.write([m.cluster_port for m in self.nodes])

    @property
    def urls(self) -> list[str]:
        return [n.url for n in self.nodes]

    def start(self) -> None:
        for n in self.nodes:
            n.start()

    def stop(self) -> None:
        for n in self.nodes:
            n.kill()

    async def ready(self, timeout: float = 30.0) -> None:
        """Until JetStream answers with a leader (a fresh cluster elects one first)."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                nc = await nats.connect(servers=self.urls, connect_timeout=1, max_reconnect_attempts=1)
                try:
                    await nc.jetstream().account_info()
                    return
                finally:
                    await nc.close()
            except Exception:
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.5)

    def by_name(self, name: str) -> Node:
        return next(n for n in self.nodes if n.name == name)


# -- workers ---------------------------------------------------------------------------------


@dataclass
class Worker:
    proc: subprocess.Popen[bytes]
    faults: Faults
    proxies: list[Proxy]

    @property
    def pid(self) -> int:
        return self.proc.pid


# -- the consumer ----------------------------------------------------------------------------


@dataclass
class Consumer:
    """Every detections message with its arrival time; the documented rule applied on arrival."""

    messages: list[tuple[float, dict[str, Any], bool]] = field(default_factory=list)
    highest: dict[str, tuple[int, int]] = field(default_factory=dict)

    def take(self, m: dict[str, Any]) -> None:
        fence = (m.get("epoch", 0), m.get("lease", 0))
        accepted = fence >= self.highest.get(m["source"], (0, 0))
        if accepted:
            self.highest[m["source"]] = fence
        self.messages.append((time.monotonic(), m, accepted))

    def handback(self, sources: list[str], suffix: str, after: float) -> float | None:
        """Seconds from ``after`` until the worker whose id ends in ``suffix`` publishes as many
        sources as ``sources`` (what it held before the fault) again, whichever they are:
        placement keeps a source where it runs, so its share comes back from the others'
        sources, not always its own. 0 if none of them moved; None if its share never came back."""
        mine = [m["worker"].endswith(suffix) for _, m, ok in self.messages if ok and m["source"] in sources]
        if all(mine):
            return 0.0  # never moved
        back: set[str] = set()
        for at, m, ok in self.messages:
            if ok and at >= after and m["worker"].endswith(suffix):
                back.add(m["source"])
                if len(back) >= len(sources):
                    return round(at - after, 2)
        return None

    def owners(self, window: float) -> dict[str, str]:
        cutoff = time.monotonic() - window
        return {m["source"]: m["worker"] for at, m, ok in self.messages if at >= cutoff and ok}

    def counts(self, t0: float, sources: list[str], until: float) -> dict[str, Any]:
        """The scenario's numbers, over the messages that arrived from ``t0`` on."""
        window = [(at, m, ok) for at, m, ok in self.messages if at >= t0]
        # Double publishing: two fences of one source publishing at once (publish_ts spans).
        spans: dict[str, dict[tuple[int, int], list[float]]] = defaultdict(dict)
        for _, m, _ in self.messages:
            fence = (m.get("epoch", 0), m.get("lease", 0))
            span = spans[m["source"]].setdefault(fence, [m["publish_ts"], m["publish_ts"]])
            span[0] = min(span[0], m["publish_ts"])
            span[1] = max(span[1], m["publish_ts"])
        double = 0
        first_of: dict[str, list[tuple[tuple[int, int], float]]] = {}
        for sid, fences in spans.items():
            ordered = sorted(fences.items())
            first_of[sid] = [(f, span[0]) for f, span in ordered]
            double += sum(1 for (_, a), (_, b) in itertools.pairwise(ordered) if a[1] > b[0])
        # Stale accepted: accepted although a larger fence had begun publishing before it.
        stale = 0
        for _, m, ok in window:
            if not ok:
                continue
            fence = (m.get("epoch", 0), m.get("lease", 0))
            if any(f > fence and start < m["publish_ts"] for f, start in first_of.get(m["source"], [])):
                stale += 1
        dropped = sum(1 for _, _, ok in window if not ok)
        # Owner changes of the source that moved most (a partition and its heal: 2 at best).
        moves = 0
        for sid in sources:
            # From the owner before the fault: its own messages after it may be held until a heal.
            before = [m["worker"] for at, m, ok in self.messages if ok and m["source"] == sid and at < t0]
            owners = before[-1:] + [m["worker"] for _, m, ok in window if ok and m["source"] == sid]
            moves = max(moves, sum(1 for a, b in itertools.pairwise(owners) if a != b))
        dark, gaps = 0.0, 0
        for sid in sources:
            times = [t0] + [at for at, m, ok in window if ok and m["source"] == sid] + [until]
            for a, b in itertools.pairwise(times):
                dark = max(dark, b - a)
                gaps += b - a > 1.0
        return {
            "messages": len(window),
            "double": double,
            "stale": stale,
            "dropped": dropped,
            "dark_s": round(dark, 2),
            "gaps": gaps,
            "moves": moves,
        }


# -- one scenario ----------------------------------------------------------------------------


class Run:
    def __init__(self, args: argparse.Namespace, tmp: Path) -> None:
        self.args = args
        self.tmp = tmp
        self.ttl = args.ttl
        self.cluster = Cluster(tmp)
        self.sources = [f"cam{i}" for i in range(1, args.sources + 1)]
        self.config = tmp / "fleet.yaml"
        lines = [
            "pipeline: bench",
            f"fleet: {{name: {FLEET}, lease_ttl: {self.ttl:g}, replicas: 3}}",
            "sources:",
        ]
        lines += [f"  - url: {self.url_for(s)}" for s in self.sources]
        self.config.write_text("\n".join(lines) + "\n")
        self.workers: list[Worker] = []
        self.consumer = Consumer()
        self.nc: Any = None

    def url_for(self, sid: str, width: int = 64) -> str:
        return f"test://?id={sid}&width={width}&height=48&fps={self.args.fps:g}"

    async def start(self) -> None:
        self.cluster.start()
        await self.cluster.ready()
        self.nc = await nats.connect(
            servers=self.cluster.urls, max_reconnect_attempts=-1, reconnect_time_wait=0.2
        )

        async def on_msg(msg: Any) -> None:
            self.consumer.take(json.loads(msg.data))

        await self.nc.subscribe("vidpipe.bench.*.detections", cb=on_msg)
        await self.nc.flush()
        # Three workers at once on a fresh R3 cluster: none may exit.
        await asyncio.gather(*(self.start_worker() for _ in range(self.args.workers)))

    async def start_worker(self) -> Worker:
        faults = Faults()
        proxies = [Proxy(faults, n.port) for n in self.cluster.nodes]
        for p in proxies:
            await p.start()
        url = ",".join(p.url for p in proxies)
        log = (self.tmp / f"worker-{len(self.workers)}.log").open("wb")
        proc = subprocess.Popen(
            [sys.executable, "-m", "pipeline.cli", "run", str(self.config), "--fleet", FLEET, "--nats", url,
             "--log-level", self.args.log_level],
            cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
        )  # fmt: skip
        worker = Worker(proc, faults, proxies)
        self.workers.append(worker)
        return worker

    def alive(self) -> list[Worker]:
        return [w for w in self.workers if w.proc.poll() is None]

    def exited(self) -> list[int]:
        return [w.proc.returncode for w in self.workers if w.proc.poll() is not None and w.proc.returncode]

    def worker_of(self, wid: str) -> Worker | None:
        return next((w for w in self.workers if wid.endswith(f"-{w.pid}")), None)

    async def settle(self, sources: list[str], timeout: float) -> dict[str, str]:
        """Until every source publishes (accepted) and owners held still for 2 s."""
        deadline = time.monotonic() + timeout
        last: dict[str, str] = {}
        still = time.monotonic()
        while time.monotonic() < deadline:
            await asyncio.sleep(0.25)
            owners = {s: w for s, w in self.consumer.owners(1.0).items() if s in sources}
            if owners != last:
                last, still = owners, time.monotonic()
            elif sorted(owners) == sorted(sources) and time.monotonic() - still >= 2.0:
                return owners
        raise RuntimeError(f"the fleet did not settle within {timeout:.0f}s: {last}")

    async def busiest(self) -> Worker:
        owners = self.consumer.owners(1.0)
        counts: dict[str, int] = defaultdict(int)
        for w in owners.values():
            counts[w] += 1
        wid = max(counts, key=lambda k: counts[k])
        worker = self.worker_of(wid)
        assert worker is not None
        return worker

    async def leader_of_leases(self) -> str:
        js = self.nc.jetstream()
        info = await js.stream_info(f"KV_vidpipe_fleet_{FLEET}_leases")
        return str(info.cluster.leader)

    async def stop(self) -> None:
        for w in self.workers:
            if w.proc.poll() is None:
                w.proc.send_signal(signal.SIGTERM)
        for w in self.workers:
            try:
                w.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                w.proc.kill()
                w.proc.wait()
            for p in w.proxies:
                await p.stop()
        if self.nc is not None:
            with contextlib.suppress(Exception):
                await self.nc.close()
        self.cluster.stop()


async def scenario(name: str, run: Run) -> dict[str, Any]:
    ttl = run.ttl
    extra: dict[str, Any] = {}
    await run.start()
    await run.settle(run.sources, timeout=30 + 4 * ttl)
    t0 = time.monotonic()
    observe = 2 * ttl + 10
    if name in ("leader_kill", "nonleader_kill"):
        leader = await run.leader_of_leases()
        node = (
            run.cluster.by_name(leader)
            if name == "leader_kill"
            else next(n for n in run.cluster.nodes if n.name != leader)
        )
        extra["node"] = node.name
        node.kill()
        await asyncio.sleep(10)
        node.start()
    elif name in ("partition", "cut", "stall", "slow", "publisher_stall"):
        victim = await run.busiest()
        held = sorted(s for s, w in run.consumer.owners(1.0).items() if run.worker_of(w) is victim)
        hold = {"partition": 2 * ttl, "cut": 10.0, "stall": ttl / 2, "slow": 30.0, "publisher_stall": 2 * ttl}
        if name == "partition":
            victim.faults.set("stall")
        elif name == "cut":
            victim.faults.set("cut")
        elif name == "stall":
            victim.faults.set("stall")
        elif name == "slow":
            victim.faults.set("slow", delay=1.0)
        else:
            victim.faults.set("stall", publisher_only=True)
        await asyncio.sleep(hold[name])
        victim.faults.set("ok")
        healed = time.monotonic()
        observe = 2 * ttl + 15  # hand-back after the heal included
        await asyncio.sleep(observe)
        extra["handback_s"] = run.consumer.handback(held, f"-{victim.pid}", healed)
        observe = 0
    elif name == "leases_deleted":
        await run.nc.jetstream().delete_key_value(f"vidpipe_fleet_{FLEET}_leases")
    elif name == "store_wiped":
        run.cluster.stop()
        for n in run.cluster.nodes:
            shutil.rmtree(n.store, ignore_errors=True)
        run.cluster.start()
        await run.cluster.ready()
        observe = 3 * ttl + 20
    elif name == "churn":
        extra = await churn(run)
    await asyncio.sleep(observe)
    until = time.monotonic()
    live = run.sources if name != "churn" else extra.pop("live")
    counts = run.consumer.counts(t0, live, until)
    counts.update(extra)
    counts["crashed"] = len(run.exited()) - extra.get("killed", 0)
    return counts


async def churn(run: Run) -> dict[str, Any]:
    """Adds, removes, an update, a join, a drain and a kill, within about 40 s."""
    nc = await nats.connect(servers=run.cluster.urls)
    js = nc.jetstream()
    desired = DesiredSources(js, FLEET, await open_bucket(js, FLEET, "sources"))
    ttl = run.ttl
    added = ["new1", "new2"]
    removed = run.sources[:2]
    updated = run.sources[2]
    for sid in added:
        await desired.add(SourceConfig(url=run.url_for(sid), id=sid))
    await asyncio.sleep(2)
    t_removed = time.monotonic()
    for sid in removed:
        await desired.remove(sid)
    await desired.remove(updated)
    t_update = time.monotonic()
    await desired.add(SourceConfig(url=run.url_for(updated, width=96), id=updated))
    await run.start_worker()
    await asyncio.sleep(ttl)
    drained = await run.busiest()
    drained.proc.send_signal(signal.SIGTERM)
    await asyncio.sleep(ttl)
    killed = await run.busiest()
    killed.proc.kill()
    await asyncio.sleep(2 * ttl + 5)
    await nc.close()
    # A removed source publishing after its removal plus one TTL came back.
    resurrected = sorted(
        {m["source"] for at, m, _ in run.consumer.messages if m["source"] in removed and at > t_removed + ttl}
    )
    first_new = next(
        (at for at, m, ok in run.consumer.messages if m["source"] == updated and m["width"] == 96 and ok),
        None,
    )
    live = [s for s in run.sources if s not in removed] + added
    return {
        "live": live,
        "resurrected": len(resurrected),
        "update_s": round(first_new - t_update, 2) if first_new is not None else None,
        "killed": 1,
    }


async def main_async(args: argparse.Namespace) -> int:
    names = SCENARIOS if args.scenarios == "all" else tuple(args.scenarios.split(","))
    print(
        f"{utc_now()} {cpu_name()}, {os.cpu_count()} CPU(s), {describe_load()}; 3-node JetStream cluster, "
        f"{args.workers} workers, {args.sources} sources at {args.fps:g} fps, lease_ttl {args.ttl:g}s",
        flush=True,
    )
    failed = 0
    for name in names:
        with tempfile.TemporaryDirectory(prefix="vidpipe-fleet-bench-") as tmpdir:
            run = Run(args, Path(tmpdir))
            try:
                counts = await scenario(name, run)
            except Exception as exc:
                print(f"scenario={name} error={type(exc).__name__}: {exc}", flush=True)
                failed += 1
                continue
            finally:
                await run.stop()
                if args.keep_logs:
                    for log in Path(tmpdir).glob("worker-*.log"):
                        shutil.copy(log, Path(args.keep_logs) / f"{name}-{log.name}")
        limit = args.ttl + 3
        single = name not in ("store_wiped", "churn")
        ok = counts["double"] == 0 and counts["stale"] == 0 and counts["crashed"] == 0
        ok = ok and (not single or counts["dark_s"] <= limit)
        if name == "churn":
            ok = ok and counts["resurrected"] == 0 and (counts["update_s"] or 1e9) <= args.ttl
        if "handback_s" in counts:
            # The worker's share comes back after the stable period; no source moves more than twice.
            ok = ok and counts["moves"] <= 2 and counts["handback_s"] is not None
        failed += not ok
        fields = " ".join(f"{k}={v}" for k, v in counts.items())
        print(f"scenario={name} {fields} target={'met' if ok else 'MISSED'}", flush=True)
    return 1 if failed else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scenarios", default="all", help="comma-separated: " + ",".join(SCENARIOS))
    parser.add_argument("--workers", type=int, default=3)
    parser.add_argument("--sources", type=int, default=9)
    parser.add_argument("--ttl", type=float, default=12.0, help="fleet.lease_ttl, seconds")
    parser.add_argument("--fps", type=float, default=10.0)
    parser.add_argument("--keep-logs", metavar="DIR", help="copy each worker's log here")
    parser.add_argument("--log-level", default="warning", help="the workers' --log-level")
    return asyncio.run(main_async(parser.parse_args()))


if __name__ == "__main__":
    sys.exit(main())
