"""A fleet worker: ties the desired sources, leases and placement to a :class:`Runtime`.

::

    vidpipe run pipeline.yaml --fleet cameras --nats nats://nats:4222

Three loops. The **watchers** keep local views of the three buckets. The
**renewer** (every ``lease_ttl / 4``) writes this worker's heartbeat and renews
each lease it holds; a lease it cannot renew in time is fenced (nothing more is
published for it) and its source stopped. The **placer** (every
``lease_ttl / 8``) computes the placement from the live workers and acts on it:

* a desired source with no lease is claimed by the worker placement picks, at
  once; by any other worker only after it stayed free for ``lease_ttl``;
* a lease whose revision has not changed for ``lease_ttl`` is taken over (CAS)
  by the worker placement picks, or by anyone after twice that;
* a source placement moves elsewhere is released by its holder only to a
  worker seen alive for a heartbeat or more, which then claims it: one move;
* a source no longer desired is stopped and released.

A drain (SIGTERM) deletes the heartbeat first, so the others stop placing
sources here, then stops each source (its frames in flight are published) and
releases its lease, so the new owner starts at once rather than after a TTL.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import socket
import time
from dataclasses import dataclass
from importlib import metadata
from typing import Any

import nats
from nats.aio.client import Client as NatsClient
from nats.js.kv import KeyValue

from pipeline.config import FleetConfig, SourceConfig, SourcePolicy
from pipeline.fleet.buckets import BucketView, open_bucket
from pipeline.fleet.desired import DesiredSources, decode_source
from pipeline.fleet.leases import Lease, LeaseTable, parse_lease
from pipeline.fleet.metrics import FleetMetrics
from pipeline.fleet.placement import place
from pipeline.ratelimit import RateLimitedLog
from pipeline.redact import redact_url
from pipeline.runtime import Runtime

log = logging.getLogger("vidpipe.fleet")


def default_worker_id() -> str:
    """``<hostname>-<pid>``, with characters a KV key cannot hold replaced."""
    host = "".join(c if c.isalnum() or c in "-_" else "-" for c in socket.gethostname()) or "host"
    return f"{host}-{os.getpid()}"


def vidpipe_version() -> str:
    try:
        return metadata.version("vidpipe")
    except metadata.PackageNotFoundError:
        return "unknown"


@dataclass
class WorkerInfo:
    """A worker as its heartbeat describes it."""

    id: str
    capacity: int
    load: int
    version: str
    ts: float  # the worker's own unix time at the heartbeat

    @classmethod
    def parse(cls, key: str, value: bytes) -> WorkerInfo:
        data = json.loads(value)
        return cls(
            id=key,
            capacity=int(data.get("capacity", 0)),
            load=int(data.get("load", 0)),
            version=str(data.get("version", "")),
            ts=float(data.get("ts", 0.0)),
        )


class FleetWorker:
    """One worker of a fleet; also the :class:`~pipeline.stages.publish.Fence` of its publisher."""

    def __init__(self, runtime: Runtime, config: FleetConfig, nats_url: str) -> None:
        self.runtime = runtime
        self.config = config
        self.name = config.name
        self.id = config.worker_id or default_worker_id()
        self.ttl = config.lease_ttl
        self.capacity = min(
            config.max_sources or runtime.config.runtime.max_sources, runtime.config.runtime.max_sources
        )
        self.nats_url = nats_url
        self.version = vidpipe_version()
        self.metrics = FleetMetrics(runtime.metrics.registry, self.name)
        self.owned: dict[str, Lease] = {}
        self._busy: dict[str, asyncio.Task[None]] = {}  # one claim or release per source at a time
        self._nc: NatsClient | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._draining = False
        self._started = 0.0
        self._errors = RateLimitedLog(logger=log)
        self.desired: DesiredSources | None = None
        self.leases: LeaseTable | None = None
        self._views: dict[str, BucketView] = {}
        self._workers_kv: KeyValue | None = None
        # When this worker first saw each never-leased source free.
        self._free_since: dict[str, float] = {}
        # Sources that failed to start here, and when to try again (others may meanwhile).
        self._retry_at: dict[str, float] = {}

    # -- the Fence the publisher asks ------------------------------------------------------

    def may_publish(self, source: str) -> bool:
        lease = self.owned.get(source)
        if lease is not None and lease.valid():
            return True
        self.metrics.fenced.labels(self.name).inc()
        return False

    def owner(self, source: str) -> tuple[str, int] | None:
        lease = self.owned.get(source)
        return (self.id, lease.number) if lease is not None else None

    # -- lifecycle -------------------------------------------------------------------------

    async def start(self) -> None:
        """Join: open the buckets, add the config's sources if absent, start the loops."""
        try:
            self._nc = await nats.connect(
                self.nats_url,
                connect_timeout=2,
                max_reconnect_attempts=-1,
                reconnect_time_wait=0.25,
                name=f"vidpipe-fleet-{self.id}",
            )
        except Exception as exc:
            raise RuntimeError(
                f"fleet {self.name}: cannot connect to NATS at {redact_url(self.nats_url)}: {exc}"
            ) from None
        js = self._nc.jetstream(timeout=max(1.0, self.ttl / 4))
        replicas = self.config.replicas
        try:
            sources = await open_bucket(js, self.name, "sources", replicas=replicas)
            leases = await open_bucket(js, self.name, "leases", replicas=replicas)
            # Heartbeats of workers that died unannounced are dropped by the server after a while.
            workers = await open_bucket(
                js, self.name, "workers", ttl=max(60.0, 10 * self.ttl), replicas=replicas
            )
        except Exception as exc:
            await self._nc.close()
            raise RuntimeError(
                f"fleet {self.name}: cannot open its JetStream KV buckets at {redact_url(self.nats_url)}: "
                f"{type(exc).__name__}: {exc}; the server needs JetStream (nats-server -js)"
                + (f" with {replicas} node(s) for fleet.replicas" if replicas > 1 else "")
            ) from None
        self.desired = DesiredSources(sources)
        self.leases = LeaseTable(leases, self.id, self.ttl)
        self._workers_kv = workers
        for src in self.runtime.config.sources:
            if await self.desired.add(src):
                log.info("fleet %s: source %s added to the desired set", self.name, src.source_id)
        self._views = {
            "sources": BucketView(sources, "sources"),
            "leases": BucketView(leases, "leases"),
            "workers": BucketView(workers, "workers"),
        }
        for view in self._views.values():
            await view.start()
        self._started = time.monotonic()
        await self._heartbeat()
        self.runtime.publisher.fence = self
        self.runtime.keep_running()
        self._tasks = [
            asyncio.create_task(self._renew_loop(), name="fleet-renew"),
            asyncio.create_task(self._place_loop(), name="fleet-place"),
        ]
        log.info(
            "fleet %s: worker %s joined (capacity %d, lease_ttl %gs)",
            self.name,
            self.id,
            self.capacity,
            self.ttl,
        )

    async def stop(self) -> None:
        """Drain: leave the placement, stop each source, release its lease, close."""
        self._draining = True
        placer = self._tasks[1] if len(self._tasks) > 1 else None
        if placer is not None:
            placer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await placer
        busy = list(self._busy.values())
        if busy:
            await asyncio.gather(*busy, return_exceptions=True)
        if self._workers_kv is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._workers_kv.delete(self.id), 2.0)
        owned = list(self.owned)
        await asyncio.gather(*(self._release(sid, "drain") for sid in owned), return_exceptions=True)
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for view in self._views.values():
            await view.stop()
        if self._nc is not None:
            with contextlib.suppress(Exception):
                await self._nc.close()
        log.info("fleet %s: worker %s left (%d source(s) handed over)", self.name, self.id, len(owned))

    # -- heartbeats and renewals -----------------------------------------------------------

    async def _heartbeat(self) -> None:
        if self._draining or self._workers_kv is None:
            return
        value = json.dumps(
            {
                "capacity": self.capacity,
                "load": len(self.owned),
                "version": self.version,
                "ts": time.time(),
                "lease_ttl": self.ttl,
            },
            separators=(",", ":"),
        ).encode()
        await asyncio.wait_for(self._workers_kv.put(self.id, value), max(0.5, self.ttl / 4))

    async def _renew_loop(self) -> None:
        while True:
            await asyncio.sleep(self.ttl / 4)
            try:
                await self._heartbeat()
            except Exception as exc:
                self._errors("heartbeat", f"fleet {self.name}: heartbeat failed: {type(exc).__name__}: {exc}")
            leases = [lease for lease in self.owned.values() if not lease.fenced]
            await asyncio.gather(*(self._renew(lease) for lease in leases))
            self.metrics.sources_owned.labels(self.name).set(len(self.owned))

    async def _renew(self, lease: Lease) -> None:
        assert self.leases is not None
        t0 = time.perf_counter()
        try:
            kept = await self.leases.renew(lease)
        except Exception as exc:
            self._errors(
                "renew", f"fleet {self.name}: renewing {lease.source} failed: {type(exc).__name__}: {exc}"
            )
            if time.monotonic() >= lease.deadline:
                self._lost(lease, "deadline")
            return
        self.metrics.renew_latency.labels(self.name).observe(time.perf_counter() - t0)
        if not kept:
            self._lost(lease, "taken")

    def _lost(self, lease: Lease, reason: str) -> None:
        """A lease that another worker may hold now: publish nothing more, stop the source."""
        if lease.fenced or self.owned.get(lease.source) is not lease:
            return
        lease.fenced = True  # the placer stops the source
        self.metrics.losses.labels(self.name, reason).inc()
        log.warning("fleet %s: lease on %s lost (%s); stopping the source", self.name, lease.source, reason)

    async def _stop_lost(self, lease: Lease) -> None:
        await self.runtime.remove_source(lease.source)
        if self.owned.get(lease.source) is lease:
            del self.owned[lease.source]
        self.metrics.sources_owned.labels(self.name).set(len(self.owned))

    # -- placement -------------------------------------------------------------------------

    def alive_workers(self, now: float) -> dict[str, WorkerInfo]:
        """Workers whose heartbeat changed within ``lease_ttl`` (this one included unless draining)."""
        out: dict[str, WorkerInfo] = {}
        for key, seen in self._views["workers"].entries.items():
            if now - seen.seen < self.ttl:
                with contextlib.suppress(ValueError):
                    out[key] = WorkerInfo.parse(key, seen.value)
        if self._draining:
            out.pop(self.id, None)
        else:
            out[self.id] = WorkerInfo(self.id, self.capacity, len(self.owned), self.version, time.time())
        return out

    def placement(self, now: float) -> dict[str, str]:
        workers = self.alive_workers(now)
        return place(self._views["sources"].entries, {w: info.capacity for w, info in workers.items()})

    async def _place_loop(self) -> None:
        # Let peers that start together see each other before anything is claimed.
        await asyncio.sleep(self.ttl / 4)
        while True:
            try:
                self._place_once()
            except Exception as exc:
                self._errors("place", f"fleet {self.name}: placement failed: {type(exc).__name__}: {exc}")
            await asyncio.sleep(self.ttl / 8)

    def _place_once(self) -> None:
        now = time.monotonic()
        desired = self._views["sources"].entries
        leases = self._views["leases"]
        workers = self._views["workers"]
        placed = self.placement(now)
        self.metrics.workers_alive.labels(self.name).set(len(self.alive_workers(now)))
        for sid, lease in list(self.owned.items()):
            if sid in self._busy:
                continue
            if lease.fenced or not lease.valid(now):
                self._lost(lease, "deadline")
                self._spawn(sid, self._stop_lost(lease))
            elif sid not in desired:
                self._spawn(sid, self._release(sid, "removed"))
        load = len(self.owned) + sum(1 for s in self._busy if s not in self.owned)
        for sid in sorted(desired):
            if sid in self._busy:
                continue
            target = placed.get(sid)
            if sid in self.owned:
                peer = workers.entries.get(target) if target is not None and target != self.id else None
                # Hand over only to a worker every peer has had time to see: one move.
                if peer is not None and now - peer.created >= self.ttl / 4 and not self.owned[sid].fenced:
                    self._spawn(sid, self._release(sid, "rebalance"))
                continue
            if load >= self.capacity or self._retry_at.get(sid, 0.0) > now:
                continue
            entry = leases.entries.get(sid)
            if entry is not None:
                age = now - entry.seen
                if age >= self.ttl and (target == self.id or age >= 2 * self.ttl):
                    self._spawn(sid, self._claim(sid, entry.revision, "expired"))
                    load += 1
                continue
            free_since = leases.deleted.get(sid)
            reason = "released" if free_since is not None else "new"
            if free_since is None:
                free_since = self._free_since.setdefault(sid, now)
            if target == self.id or now - free_since >= self.ttl:
                self._spawn(sid, self._claim(sid, None, reason))
                load += 1

    def _spawn(self, sid: str, work: Any) -> None:
        async def run() -> None:
            try:
                await work
            except Exception as exc:
                self._errors(f"act:{sid}", f"fleet {self.name}: {sid}: {type(exc).__name__}: {exc}")
            finally:
                self._busy.pop(sid, None)

        self._busy[sid] = asyncio.create_task(run(), name=f"fleet-{sid}")

    async def _claim(self, sid: str, last: int | None, reason: str) -> None:
        assert self.leases is not None
        view = self._views["sources"].entries.get(sid)
        if view is None:
            return
        lease = await self.leases.claim(sid, last)
        if lease is None:
            # Someone else was first: read the key so the view does not wait for the watcher.
            with contextlib.suppress(Exception):
                entry = await self.leases.kv.get(sid)
                self._views["leases"].note(sid, entry.value, entry.revision or 0)
            return
        self.owned[sid] = lease
        try:
            config = decode_source(sid, view.value, *self._source_policy())
            self.runtime.add_source(config)
        except Exception as exc:
            log.error("fleet %s: source %s cannot start here: %s; lease released", self.name, sid, exc)
            self._retry_at[sid] = time.monotonic() + 2 * self.ttl
            del self.owned[sid]
            await self.leases.release(lease)
            return
        self.metrics.takeovers.labels(self.name, reason).inc()
        self.metrics.sources_owned.labels(self.name).set(len(self.owned))
        log.info("fleet %s: took %s (%s, lease %d)", self.name, sid, reason, lease.number)

    async def _release(self, sid: str, reason: str) -> None:
        """Stop ``sid`` (its frames in flight are still published), then give the lease up."""
        assert self.leases is not None
        lease = self.owned.get(sid)
        if lease is None:
            return
        await self.runtime.remove_source(sid)
        lease.fenced = True
        if self.owned.get(sid) is lease:
            del self.owned[sid]
        with contextlib.suppress(Exception):
            await self.leases.release(lease)
        self.metrics.releases.labels(self.name, reason).inc()
        self.metrics.sources_owned.labels(self.name).set(len(self.owned))
        log.info("fleet %s: released %s (%s)", self.name, sid, reason)

    def _source_policy(self) -> tuple[SourcePolicy, str]:
        """What a stored source may be here: what this worker's API would accept, and where
        relative paths start."""
        cfg = self.runtime.config
        return SourcePolicy.from_http(cfg.http, cfg.base_dir), cfg.base_dir

    def desired_configs(self) -> list[SourceConfig]:
        """The desired sources as this worker last saw them."""
        out = []
        for sid, seen in sorted(self._views["sources"].entries.items()):
            with contextlib.suppress(Exception):
                out.append(decode_source(sid, seen.value, *self._source_policy()))
        return out

    # -- what /v1/fleet shows --------------------------------------------------------------

    def status(self) -> dict[str, Any]:
        now = time.monotonic()
        alive = self.alive_workers(now)
        workers = []
        for key, seen in sorted(self._views["workers"].entries.items()):
            if key == self.id:
                continue  # this worker's own line is current, not its last heartbeat
            try:
                info = WorkerInfo.parse(key, seen.value)
            except ValueError:
                continue
            workers.append(worker_json(info, key in alive))
        if self.id in alive:
            workers.append(worker_json(alive[self.id], True))
            workers.sort(key=lambda w: str(w["id"]))
        placed = self.placement(now)
        sources = []
        for sid in sorted(self._views["sources"].entries):
            entry = self._views["leases"].entries.get(sid)
            owner, since, number = parse_lease(entry.value) if entry is not None else ("", 0.0, 0)
            if sid in self.owned:
                own = self.owned[sid]
                owner, since, number = self.id, own.since, own.number
            sources.append(source_json(sid, owner or None, since or None, number or None, placed.get(sid)))
        return {
            "fleet": self.name,
            "worker": self.id,
            "lease_ttl": self.ttl,
            "workers": workers,
            "sources": sources,
        }


def worker_json(info: WorkerInfo, alive: bool) -> dict[str, Any]:
    return {
        "id": info.id,
        "alive": alive,
        "load": info.load,
        "capacity": info.capacity,
        "version": info.version,
    }


def source_json(
    sid: str, owner: str | None, since: float | None, lease: int | None, placed_on: str | None
) -> dict[str, Any]:
    return {"id": sid, "owner": owner, "owned_since": since, "lease": lease, "placed_on": placed_on}
