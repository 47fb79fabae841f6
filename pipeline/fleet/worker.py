"""A fleet worker: ties the desired sources, leases and placement to a :class:`Runtime`.

::

    vidpipe run pipeline.yaml --fleet cameras --nats nats://n1:4222,nats://n2:4222,nats://n3:4222

Three loops. The **watchers** keep local views of the three buckets. The
**renewer** (every ``lease_ttl / 4``) writes this worker's heartbeat, renews
each lease it holds, checks that its publishing connection still answers and
that the buckets still exist; a lease it cannot renew in time is fenced
(nothing more is published for it) and its source stopped. The **placer**
(every ``lease_ttl / 8``) computes the placement from the live workers and acts
on it, once the set of live workers it sees (a heartbeat within three quarters
of ``lease_ttl``) has held still for ``lease_ttl / 8`` (a worker that briefly
sees no peers does not take every source):

* a desired source with no lease is claimed by the worker placement picks, at
  once; by any other worker only after it stayed free for ``lease_ttl``;
* a lease that has not been renewed for ``lease_ttl`` is taken over (CAS) by the
  worker placement picks, or by anyone after twice that. A claim that was never
  confirmed by its holder's renewal does not restart that clock when the same
  worker writes it again;
* a source placement moves elsewhere is released by its holder only to a
  worker seen alive, without a break, for ``lease_ttl``; it then claims it: one move;
* a source no longer desired is stopped and released; one whose desired entry
  changed is restarted with the new settings;
* a worker whose publishing connection does not answer a round trip within
  ``lease_ttl / 4`` deletes its heartbeat and releases its sources; past the
  lease's bound it publishes nothing more in any case.

A drain (SIGTERM) deletes the heartbeat first, so the others stop placing
sources here, then stops each source (its frames in flight are published) and
releases its lease, so the new owner starts at once rather than after a TTL.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import time
import uuid
from importlib import metadata
from pathlib import Path
from typing import Any

import nats
from nats.aio.client import Client as NatsClient
from nats.js import JetStreamContext
from nats.js.errors import NotFoundError
from nats.js.kv import KeyValue

from inference.ratelimit import RateLimitedLog
from pipeline.cancel import cancel_and_wait
from pipeline.config import FleetConfig, SourceConfig, SourcePolicy
from pipeline.fleet.buckets import (
    BadEntries,
    BucketView,
    NotClustered,
    bucket_name,
    bucket_stream,
    open_bucket,
)
from pipeline.fleet.desired import DesiredCache, DesiredSources
from pipeline.fleet.leases import EPOCH_KEY, Lease, LeaseTable, StoredLease, parse_epoch, parse_lease
from pipeline.fleet.placement import LiveSet, place
from pipeline.fleet.status import WorkerInfo, lease_owner, source_json, worker_json
from pipeline.redact import redact_url
from pipeline.runtime import Runtime
from pipeline.urls import whip_name

log = logging.getLogger("vidpipe.fleet")


def _described(exc: BaseException) -> str:
    """``TimeoutError: why``, or the type alone when the exception says nothing (nats' timeouts)."""
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


# How long a fresh JetStream cluster may take to answer for a bucket (a meta leader is elected).
OPEN_PATIENCE = 30.0
# How long a probe of the publishing connection waits for its PONG (see _probe_publisher).
PROBE_PATIENCE = 600
# Tombstones of removed sources and released leases older than this are purged.
TOMBSTONE_AGE = 300.0


# Seconds a stop waits for the NATS client to close (a stalled link never answers).
CLOSE_TIMEOUT = 5.0


def _retrieve(task: asyncio.Task[None]) -> None:
    """Read a finished probe's outcome, so an abandoned one is not reported as never retrieved."""
    if not task.cancelled():
        task.exception()


def vidpipe_version() -> str:
    try:
        return metadata.version("vidpipe")
    except metadata.PackageNotFoundError:
        return "unknown"


def nats_servers(url: str) -> list[str]:
    """``a,b,c`` (the ``--nats`` form) as a list of seed URLs."""
    return [u.strip() for u in url.split(",") if u.strip()]


def parse_servers_or_fail(url: str) -> list[str]:
    servers = nats_servers(url)
    if not servers:
        raise RuntimeError("fleet: no NATS URL; pass --nats URL[,URL...] or set nats.servers")
    return servers


class FleetWorker:
    """One worker of a fleet; it fills the `LeaseFence` its runtime's publisher asks (fleet.fence)."""

    def __init__(self, runtime: Runtime, config: FleetConfig, nats_url: str) -> None:
        if runtime.fence is None or runtime.fleet_metrics is None:
            raise ValueError("the runtime's config has no fleet: section; its publisher has no fence")
        self.runtime = runtime
        self.config = config
        self.name = config.name
        # What the runtime's publisher asks before every message; this worker fills it.
        self.fence = runtime.fence
        self.id = self.fence.worker_id
        self.ttl = config.lease_ttl
        self.capacity = min(
            config.max_sources or runtime.config.runtime.max_sources, runtime.config.runtime.max_sources
        )
        self.max_desired = config.max_desired
        self.nats_url = nats_url
        self.servers = parse_servers_or_fail(nats_url)
        self.version = vidpipe_version()
        self.metrics = runtime.fleet_metrics
        self.owned: dict[str, Lease] = self.fence.owned  # the fence's own table, not a copy
        # The desired entry's revision each owned source runs with: a newer one restarts it.
        self._running: dict[str, int] = {}
        self._busy: dict[str, asyncio.Task[None]] = {}  # one claim or release per source at a time
        self._nc: NatsClient | None = None
        self._js: JetStreamContext | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._draining = False
        self._started = 0.0
        self._errors = RateLimitedLog(logger=log)
        self.bad = BadEntries(self.name, lambda b: self.metrics.bad_entries.labels(self.name, b).inc())
        self.desired: DesiredSources | None = None
        self.leases: LeaseTable | None = None
        self.decoded = DesiredCache(*self._source_policy())
        self._views: dict[str, BucketView] = {}
        self._kvs: dict[str, KeyValue] = {}
        self._created: dict[str, str] = {}  # each bucket's creation time: a change is a re-creation
        self._opened: dict[str, str] = {}  # the creation time of the bucket last opened
        self._workers_kv: KeyValue | None = None
        # The highest epoch this worker has seen: a re-created lease bucket gets a larger one.
        self._epoch_floor = 0
        # When this worker first saw each never-leased source free.
        self._free_since: dict[str, float] = {}
        # Sources that failed to start here, and when to try again (others may meanwhile).
        self._retry_at: dict[str, float] = {}
        # Unconfirmed claims seen in the lease bucket: source -> (worker, first seen here).
        self._claim_clock: dict[str, tuple[str, float]] = {}
        # The live set as last seen: placement acts once it held still, hands over after a TTL.
        self.live = LiveSet(settle=self.ttl / 8, handback=self.ttl)
        self._placement_memo: tuple[Any, dict[str, str]] | None = None
        self._holder_cache: dict[str, tuple[int, str | None]] = {}  # lease revision and holder, per source
        self._publish_stalled = False  # the last probe got no answer in time
        self._probe: asyncio.Task[None] | None = None  # the outstanding PING on that connection
        self._probe_sent = 0.0
        self._probe_reconnects = 0
        self._left = False  # the heartbeat was deleted while the publishing connection is stuck
        self._last_heartbeat = 0.0  # monotonic time of the last heartbeat that landed
        self._last_round = 0.0  # monotonic time the renewer last finished a round (landed or not)
        self._last_purge = 0.0
        # (revision, monotonic time) of a heartbeat written and not yet seen by the watcher.
        self._own_heartbeat: tuple[int, float] | None = None
        # Written in every heartbeat: another process heartbeating under this worker's id
        # (two hosts given one fleet.worker_id) shows up as a heartbeat with another one.
        self._instance = uuid.uuid4().hex[:12]
        # No claims before this (monotonic): after a lost lease bucket, until every lease
        # recorded in it has run out on its holder's clock, whoever the holder was.
        self._claim_after = 0.0
        # Set on a reconnect: the renewer runs a round at once instead of at its next tick.
        self._wake = asyncio.Event()
        # Monotonic: the last moment this worker's NATS connection was seen down. While it is
        # down the views are frozen: a lease or a free key that "stood still" then was not
        # watched standing still, so ages count from no earlier than this (see _lease_age).
        self._blind_until = 0.0

    # -- lifecycle -------------------------------------------------------------------------

    async def start(self) -> None:
        """Join: open the buckets, seed the desired set if it never was, start the loops."""
        shown = ",".join(redact_url(u) for u in self.servers)

        async def on_error(exc: Exception) -> None:
            # Each reconnect attempt fails while NATS is down (four a second): one line per
            # interval says so, not nats-py's own line for every attempt.
            why = str(exc) or type(exc).__name__
            self._errors("nats", f"fleet {self.name}: NATS at {shown}: {why}")

        try:
            self._nc = await nats.connect(
                servers=self.servers,
                connect_timeout=2,
                max_reconnect_attempts=-1,
                reconnect_time_wait=0.25,
                reconnected_cb=self._on_reconnect,
                error_cb=on_error,
                name=f"vidpipe-fleet-{self.id}",
            )
        except Exception as exc:
            raise RuntimeError(f"fleet {self.name}: cannot connect to NATS at {shown}: {exc}") from None
        self._js = self._nc.jetstream(timeout=max(1.0, self.ttl / 4))
        deadline = time.monotonic() + OPEN_PATIENCE
        while True:
            try:
                await self._join()
                break
            except NotClustered as exc:
                await self._nc.close()
                raise RuntimeError(
                    f"fleet {self.name}: fleet.replicas is {exc.replicas}, but the NATS server at {shown} "
                    "runs JetStream without a cluster, which keeps one copy of each bucket: set "
                    f"fleet.replicas: 1, or give --nats the servers of a JetStream cluster of "
                    f"{exc.replicas} or more nodes"
                ) from None
            except Exception as exc:
                # A fresh cluster answers "no response from stream" until its leaders are up.
                if time.monotonic() < deadline:
                    for view in self._views.values():
                        await view.stop()
                    await asyncio.sleep(0.5)
                    continue
                await self._nc.close()
                replicas = self.config.replicas
                raise RuntimeError(
                    f"fleet {self.name}: cannot open its JetStream KV buckets at {shown}: "
                    f"{_described(exc)}; the server needs JetStream (nats-server -js)"
                    + (f" with {replicas} node(s) for fleet.replicas" if replicas > 1 else "")
                ) from None
        self._started = time.monotonic()
        await self._probe_publisher()
        with contextlib.suppress(Exception):  # the renewer writes the next one a moment later
            await self._heartbeat()
        self.runtime.keep_running()
        self._tasks = [
            asyncio.create_task(self._renew_loop(), name="fleet-renew"),
            asyncio.create_task(self._place_loop(), name="fleet-place"),
        ]
        log.info(
            "fleet %s: worker %s joined (capacity %d, lease_ttl %gs, epoch %d)",
            self.name,
            self.id,
            self.capacity,
            self.ttl,
            self._leases().epoch,
        )

    async def _join(self) -> None:
        """Open the buckets, learn the epoch, seed the desired set, start the watchers."""
        for kind in ("sources", "leases", "workers"):
            await self._open(kind)
            self._created[kind] = self._opened[kind]
        assert self._js is not None
        self.desired = DesiredSources(
            self._js, self.name, self._kvs["sources"], timeout=max(1.0, self.ttl / 2)
        )
        self.leases = LeaseTable(self._kvs["leases"], self.id, self.ttl)
        self._workers_kv = self._kvs["workers"]
        self._epoch_floor = await self.leases.load_epoch(self._epoch_floor)
        await self._seed()
        assert self._js is not None
        self._views = {
            kind: BucketView(self._js, kv, bucket_name(self.name, kind)) for kind, kv in self._kvs.items()
        }
        for view in self._views.values():
            await view.start()

    def _leases(self) -> LeaseTable:
        assert self.leases is not None
        return self.leases

    async def _open(self, kind: str) -> KeyValue:
        """Open (creating when missing) one bucket and remember which incarnation it is."""
        assert self._js is not None
        # Heartbeats of workers that died unannounced are dropped by the server after a while.
        ttl = max(60.0, 10 * self.ttl) if kind == "workers" else None
        kv = await open_bucket(self._js, self.name, kind, ttl=ttl, replicas=self.config.replicas)
        info = await self._js.stream_info(bucket_stream(bucket_name(self.name, kind)))
        self._opened[kind] = str(info.created)  # recorded in _created once all that follows is done
        self._kvs[kind] = kv
        return kv

    async def _seed(self) -> None:
        assert self.desired is not None
        added = await self.desired.seed(list(self.runtime.config.sources))
        for sid in added:
            log.info("fleet %s: source %s added to the desired set", self.name, sid)

    async def stop(self) -> None:
        """Drain: leave the placement, stop each source, release its lease, close."""
        self._draining = True
        placer = self._tasks[1] if len(self._tasks) > 1 else None
        if placer is not None:
            await cancel_and_wait(placer)
        busy = list(self._busy.values())
        if busy:
            # Each claim or release is bounded by its KV timeouts; this bounds them together.
            _, pending = await asyncio.wait(busy, timeout=2 * self.ttl)
            for task in pending:
                task.cancel()
        if self._workers_kv is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._workers_kv.delete(self.id), 2.0)
        owned = list(self.owned)
        await asyncio.gather(*(self._release(sid, "drain") for sid in owned), return_exceptions=True)
        await cancel_and_wait(*self._tasks)
        for view in self._views.values():
            await view.stop()
        if self._nc is not None:
            # Bounded: closing a connection whose link is stalled must not hold a stop up.
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._nc.close(), CLOSE_TIMEOUT)
        log.info("fleet %s: worker %s left (%d source(s) handed over)", self.name, self.id, len(owned))

    def health_problem(self) -> str | None:
        """Why this worker's own loops are stuck (``/healthz`` fails, restart it); None when fine.

        Only what a restart mends: the renewer or the placer ended (an error escaped it), or
        the renewer finished no round for ``max(30 s, 5 × lease_ttl)`` while NATS was
        connected (each call in a round is bounded, so a round that long is a stuck task).
        NATS out of reach, or JetStream refusing writes, is an outage outside this process:
        :meth:`readiness_problem` says so and every worker would restart for nothing.
        """
        if self._draining or not self._started:
            return None
        for task in self._tasks:
            if task.done() and not task.cancelled():
                error = task.exception()
                why = _described(error) if error is not None else "it returned"
                return f"fleet {self.name}: its {task.get_name()} loop ended: {why}"
        if not self.connected:
            return None  # not stuck: waiting for NATS (a round's clock starts again on reconnect)
        quiet = time.monotonic() - max(self._last_round, self._started, self._blind_until)
        limit = max(30.0, 5 * self.ttl)
        if quiet > limit:
            return (
                f"fleet {self.name}: its renewer finished no round for {quiet:.0f}s "
                f"(limit {limit:.0f}s) while NATS is connected"
            )
        return None

    def readiness_problem(self) -> str | None:
        """Why this worker cannot take part in the fleet now (``/readyz`` fails); None when fine.

        NATS is out of reach, or no heartbeat has landed for ``lease_ttl`` (the others
        count it gone after three quarters of that): the buckets are gone and cannot be
        made again, or JetStream refuses writes.
        """
        if self._draining or not self._started:
            return None
        quiet = time.monotonic() - max(self._last_heartbeat, self._started)
        if not self.connected:
            return f"fleet {self.name}: NATS is not connected (no heartbeat written for {quiet:.0f}s)"
        if quiet > self.ttl:
            return f"fleet {self.name}: no heartbeat written for {quiet:.0f}s (limit {self.ttl:g}s)"
        return None

    # -- heartbeats and renewals -----------------------------------------------------------

    async def _heartbeat(self) -> None:
        if self._draining or self._workers_kv is None:
            return
        if not self._publishing(time.monotonic()):
            # Cannot publish: leave the placement at once, so the others take the sources.
            if not self._left:
                await asyncio.wait_for(self._workers_kv.delete(self.id), max(0.5, self.ttl / 4))
                self._left = True
            return
        self._left = False
        value = json.dumps(
            {
                "capacity": self.capacity,
                "load": len(self.owned),
                "version": self.version,
                "ts": time.time(),
                "lease_ttl": self.ttl,
                "instance": self._instance,
            },
            separators=(",", ":"),
        ).encode()
        revision = await asyncio.wait_for(self._workers_kv.put(self.id, value), max(0.5, self.ttl / 4))
        self._last_heartbeat = time.monotonic()
        if self._own_heartbeat is None:
            self._own_heartbeat = (revision, self._last_heartbeat)

    async def _check_views(self) -> None:
        """Watch the buckets again when this worker's own heartbeat never showed up in its view.

        A watcher that missed a reconnect would leave a frozen picture of the fleet:
        peers that look dead and leases that look expired.
        """
        if self._own_heartbeat is None or not self._views or self._draining:
            return  # draining: the heartbeat was deleted on purpose, and the views are done with
        now = time.monotonic()
        if any(not v.ready.is_set() and now - v.started_at < self.ttl for v in self._views.values()):
            return  # a view still reading its bucket gets a TTL before it is judged
        revision, written = self._own_heartbeat
        seen = self._views["workers"].entries.get(self.id)
        if seen is not None:
            self._check_twin(seen.value)
        if seen is not None and seen.revision >= revision:
            self._own_heartbeat = None  # seen: check the next one
            return
        if time.monotonic() - written < self.ttl / 4:
            return
        log.warning("fleet %s: the bucket watchers fell behind; watching again", self.name)
        self._own_heartbeat = None
        for kind, view in self._views.items():
            await view.restart(self._kvs[kind])

    def _check_twin(self, value: bytes) -> None:
        """Say so when another process heartbeats under this worker's id: the two would
        overwrite each other's heartbeat and each other's leases' owner."""
        try:
            instance = json.loads(value).get("instance")
        except (ValueError, AttributeError):
            return
        if isinstance(instance, str) and instance != self._instance:
            self._errors(
                "twin",
                f"fleet {self.name}: another process runs as worker {self.id}; each worker needs its "
                "own id: give each host its own fleet.worker_id, or leave it out (host name and pid)",
            )

    async def _probe_publisher(self) -> None:
        """A round trip on the publishing connection; its bound fences every lease like a renewal.

        The bound is kept by waiting on the round trip, never by cancelling it: a PING
        whose answer the client stopped waiting for makes nats-py's read loop fail when
        the PONG does arrive (after a stall), and that connection then reads nothing more
        while its ``flush`` reports success. One PING is outstanding at a time; one sent
        before a reconnect is never answered, so a reconnect sends another.
        """
        nc = self.runtime.publisher.nc
        if nc is None:
            return  # messages stay in this process: nothing can stall
        bound = max(0.5, self.ttl / 4)
        deadline = time.monotonic() + bound
        while True:
            reconnects = nc.stats["reconnects"]
            if self._probe is None or self._probe.done() or reconnects != self._probe_reconnects:
                self._probe = asyncio.create_task(nc.flush(timeout=PROBE_PATIENCE), name="fleet-probe")
                self._probe.add_done_callback(_retrieve)
                self._probe_sent, self._probe_reconnects = time.monotonic(), reconnects
            probe, sent = self._probe, self._probe_sent
            await asyncio.wait({probe}, timeout=max(0.0, deadline - time.monotonic()))
            answered = probe.done() and not probe.cancelled() and probe.exception() is None
            if answered and sent + self.ttl * 0.75 <= time.monotonic() < deadline:
                continue  # the answer to a PING sent before a stall: ask again, now
            break
        if not answered:
            self._publish_stalled = True
            self._errors(
                "publisher",
                f"fleet {self.name}: the publishing connection did not answer within "
                f"{bound:g}s; handing its sources over",
            )
            return
        self._publish_stalled = False
        self.fence.publish_until = sent + self.ttl * 0.75

    def _publishing(self, now: float) -> bool:
        """Whether the publishing connection answered its last probe, within the fence's bound."""
        return now < self.fence.publish_until and not self._publish_stalled

    async def _on_reconnect(self) -> None:
        self._blind_until = time.monotonic()
        self._wake.set()

    async def _renew_loop(self) -> None:
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self.ttl / 4)
            self._wake.clear()
            await self._probe_publisher()
            try:
                await self._heartbeat()
            except Exception as exc:
                self._errors("heartbeat", f"fleet {self.name}: heartbeat failed: {_described(exc)}")
            try:
                # Before renewing: a compare-and-swap against a lease bucket made anew can
                # land on a key whose revision happens to match, and renew someone else's claim.
                await self._check_buckets()
            except Exception as exc:
                problem = f"{_described(exc)}"
                self._errors("buckets", f"fleet {self.name}: bucket check failed: {problem}")
            epoch = self._leases().epoch
            for lease in self.owned.values():
                if lease.epoch != epoch:
                    self._lost(lease, "taken")  # claimed in a lease bucket that is gone
            leases = [lease for lease in self.owned.values() if not lease.fenced]
            await asyncio.gather(*(self._renew(lease) for lease in leases))
            self.metrics.sources_owned.labels(self.name).set(len(self.owned))
            try:
                await self._resume_lapsed()
                await self._leases().withdraw_unconfirmed()
                await self._check_views()
                await self._purge_tombstones()
            except Exception as exc:
                problem = f"{_described(exc)}"
                self._errors("buckets", f"fleet {self.name}: bucket check failed: {problem}")
            self._last_round = time.monotonic()

    async def _renew(self, lease: Lease) -> None:
        t0 = time.perf_counter()
        try:
            kept = await self._leases().renew(lease)
        except Exception as exc:
            self._errors("renew", f"fleet {self.name}: renewing {lease.source} failed: {_described(exc)}")
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
        lease.lapsed = reason == "deadline"  # not taken: resumed if NATS answers and the key is ours
        self.metrics.losses.labels(self.name, reason).inc()
        log.warning("fleet %s: lease on %s lost (%s); stopping the source", self.name, lease.source, reason)

    async def _resume_lapsed(self) -> None:
        """Take back leases given up at their deadline (NATS was out of reach) that nobody took.

        After a cut shorter than ``lease_ttl`` the sources come back as soon as NATS
        answers, without waiting for the placement; a lease the worker cannot run now
        (no longer desired, draining, not publishing) is deleted instead.
        """
        if not self.connected:
            # Nothing can be resumed yet (a reconnect runs this at once), and the wait for
            # the publishing connection below starts only once NATS answers again.
            self._blind_until = time.monotonic()
            return
        leases = self._leases()
        desired = self.desired_sources()
        now = time.monotonic()
        for sid, lease in list(leases.abandoned.items()):
            if not lease.lapsed or sid in self._busy:
                continue
            entry = desired.get(sid)
            if entry is None or self._draining or sid in self.owned or lease.epoch != leases.epoch:
                lease.lapsed = False  # withdraw_unconfirmed deletes it
                continue
            if not self._publishing(now):
                # The publishing link went with the rest and may answer a moment after the
                # KV one: wait for it up to a TTL past the deadline. Waiting holds no one up:
                # a worker that takes the key over meanwhile makes the resume's CAS fail.
                if now - max(lease.deadline, self._blind_until) >= self.ttl:
                    lease.lapsed = False
                continue
            self._spawn(sid, self._resume(lease, *entry))

    async def _resume(self, lease: Lease, revision: int, config: SourceConfig) -> None:
        sid = lease.source
        if not await self._leases().resume(lease):
            return  # another worker holds it now
        self.owned[sid] = lease
        if not await self._run_owned(sid, config, revision, "cannot start here: {}; lease released"):
            return
        self.metrics.takeovers.labels(self.name, "resumed").inc()
        self.metrics.sources_owned.labels(self.name).set(len(self.owned))
        log.info("fleet %s: resumed %s (lease %d: no one took it meanwhile)", self.name, sid, lease.number)

    async def _stop_lost(self, lease: Lease) -> None:
        await self.runtime.remove_source(lease.source)
        # Resumed or deleted once NATS answers, if the key still names it: no one waits a TTL.
        self._leases().abandon(lease)
        with contextlib.suppress(Exception):  # now if NATS answers, else from the renewer
            await self._leases().withdraw_unconfirmed()
        if self.owned.get(lease.source) is lease:
            del self.owned[lease.source]
            self._running.pop(lease.source, None)
        self.metrics.sources_owned.labels(self.name).set(len(self.owned))

    # -- lost buckets ----------------------------------------------------------------------

    async def _check_buckets(self) -> None:
        """Open again a bucket that was deleted (or deleted and made anew by someone else)."""
        assert self._js is not None
        for kind in ("sources", "leases", "workers"):
            name = bucket_stream(bucket_name(self.name, kind))
            try:
                info = await self._js.stream_info(name)
                if str(info.created) == self._created.get(kind):
                    continue
            except NotFoundError:
                pass
            lost = bucket_name(self.name, kind)
            log.warning("fleet %s: bucket %s was lost; opening it again", self.name, lost)
            kv = await self._open(kind)
            self.metrics.buckets_recreated.labels(self.name, kind).inc()
            if kind == "sources":
                self.desired = DesiredSources(self._js, self.name, kv, timeout=max(1.0, self.ttl / 2))
                await self._seed()
            elif kind == "leases":
                self._leases().kv = kv
                self._claim_clock.clear()
                self._lost_lease_bucket()
                self._epoch_floor = await self._leases().load_epoch(self._epoch_floor)
            else:
                self._workers_kv = kv
            await self._views[kind].restart(kv)
            # Only now: a step that failed above (the epoch not loaded, the view not restarted)
            # is done again at the next check, not left half done for good.
            self._created[kind] = self._opened[kind]

    def _lost_lease_bucket(self) -> None:
        """Every lease recorded in a lost bucket: fence ours now, claim nothing for a TTL.

        Other holders learn of the loss only at their next renewal; their deadlines
        pass within ``lease_ttl`` of the loss, and no claim here comes before that.
        """
        for lease in list(self.owned.values()):
            self._lost(lease, "taken")
        self._claim_after = max(self._claim_after, time.monotonic() + self.ttl)

    async def _purge_tombstones(self) -> None:
        now = time.monotonic()
        if now - self._last_purge < TOMBSTONE_AGE / 2 or self.desired is None:
            return
        self._last_purge = now
        await self.desired.purge_tombstones(TOMBSTONE_AGE)

    # -- placement -------------------------------------------------------------------------

    def _heartbeats(self) -> dict[str, tuple[WorkerInfo, float]]:
        """Every peer heartbeat that parses, with the local time its revision was first seen."""
        out: dict[str, tuple[WorkerInfo, float]] = {}
        for key, seen in self._views["workers"].entries.items():
            try:
                info = WorkerInfo.parse(key, seen.value)
            except ValueError as exc:
                self.bad.bad("workers", key, seen.revision, exc)
                continue
            self.bad.good("workers", key)
            out[key] = (info, seen.seen)
        return out

    def alive_workers(self, now: float) -> dict[str, WorkerInfo]:
        """Workers whose heartbeat changed within ``lease_ttl`` (this one included unless draining)."""
        # Three missed heartbeats: gone from placement a quarter TTL before its leases
        # expire, so the view has held still by the time they do.
        window = 0.75 * self.ttl
        out = {k: info for k, (info, seen) in self._heartbeats().items() if now - seen < window}
        if self._draining or not self._publishing(now):
            out.pop(self.id, None)
        else:
            out[self.id] = WorkerInfo(self.id, self.capacity, len(self.owned), self.version, time.time())
        return out

    def desired_sources(self) -> dict[str, tuple[int, SourceConfig]]:
        """The desired sources that decode and pass the source checks: id -> (revision, config)."""
        out: dict[str, tuple[int, SourceConfig]] = {}
        entries = self._views["sources"].entries
        for sid, seen in entries.items():
            config, problem = self.decoded.get(sid, seen.revision, seen.value)
            if config is None:
                self.bad.bad("sources", sid, seen.revision, problem)
                continue
            out[sid] = (seen.revision, config)
        self.decoded.forget(entries)
        return out

    def whip_owner(self, config: SourceConfig) -> str | None:
        """The desired source (another id) whose ``whip://`` name ``config`` would take, if any."""
        if config.scheme != "whip":
            return None
        name = whip_name(config.url)
        for sid, (_, other) in self.desired_sources().items():
            if sid != config.source_id and other.scheme == "whip" and whip_name(other.url) == name:
                return sid
        return None

    def whip_runner(self, name: str) -> tuple[str, str | None] | None:
        """The desired source that takes ``whip://name``, and the worker holding it (None: none yet)."""
        for sid, (_, config) in self.desired_sources().items():
            if config.scheme == "whip" and whip_name(config.url) == name:
                return sid, self.holders().get(sid)
        return None

    @property
    def connected(self) -> bool:
        """Whether this worker's NATS connection is up (the desired set can be read and changed)."""
        return self._nc is not None and self._nc.is_connected

    async def desired_whole(self, timeout: float) -> bool:
        """Wait (at most ``timeout`` s) until the view of the desired set holds the whole bucket.

        A view being read again (a reconnect, a bucket made anew) holds part of the set
        until then: a cap or an id checked against it could be wrong.
        """
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            view = self._views.get("sources")
            if view is None:
                return False  # not started, or stopping
            if view.ready.is_set():
                return True
            left = deadline - loop.time()
            if left <= 0:
                return False
            # A restart replaces the view's event: look again at least twice a second.
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(view.ready.wait(), min(left, 0.5))

    def desired_ids(self) -> Any:
        """The ids in the desired set (a live view of the keys: no copy per request)."""
        return self._views["sources"].entries.keys() if self._views else {}.keys()

    def placement(self, now: float, sources: Any, workers: dict[str, WorkerInfo]) -> dict[str, str]:
        holders = self.holders()
        # Placement hashes every source-worker pair: compute it again only when an input changed.
        key = (
            frozenset(sources),
            frozenset((w, i.capacity) for w, i in workers.items()),
            frozenset(holders.items()),
        )
        if self._placement_memo is not None and self._placement_memo[0] == key:
            return self._placement_memo[1]
        placed = place(sources, {w: info.capacity for w, info in workers.items()}, holders)
        self._placement_memo = (key, placed)
        return placed

    def holders(self) -> dict[str, str]:
        """``{source: worker}`` for every lease in the bucket, claims included; this worker's own are current.

        Placement keeps a source where it runs while its holder's share allows: a source
        that moves loses its tracks and cuts its recordings.
        """
        found: dict[str, str] = {}
        cache = self._holder_cache
        for sid, entry in self._views["leases"].entries.items():
            hit = cache.get(sid)
            if hit is None or hit[0] != entry.revision:
                try:
                    hit = (entry.revision, parse_lease(entry.value).worker)
                except ValueError:
                    hit = (entry.revision, None)  # unreadable: it holds nothing
                cache[sid] = hit
            if hit[1] is not None:
                found[sid] = hit[1]
        for sid in [s for s in cache if s not in self._views["leases"].entries]:
            del cache[sid]
        for sid in self.owned:
            found[sid] = self.id
        return found

    def _lease_age(self, sid: str, seen_at: float, stored: StoredLease | None, now: float) -> float:
        """How long the lease has gone without a real renewal, on this worker's clock.

        A claim its holder never confirmed (lease number 0) and wrote again keeps the
        clock of its first write: rewriting claims is not renewing. Time this worker's
        NATS connection was down does not count: its view could not see renewals then
        (after a NATS restart every peer's lease would look expired at once).
        """
        if stored is None or stored.number > 0:
            self._claim_clock.pop(sid, None)
            return now - max(seen_at, self._blind_until)
        clock = self._claim_clock.get(sid)
        if clock is None or clock[0] != stored.worker:
            clock = (stored.worker, seen_at)
            self._claim_clock[sid] = clock
        return now - max(clock[1], self._blind_until)

    async def _place_loop(self) -> None:
        # Let peers that start together see each other before anything is claimed.
        await asyncio.sleep(self.ttl / 4)
        while True:
            try:
                self._place_once()
            except Exception as exc:
                self._errors("place", f"fleet {self.name}: placement failed: {_described(exc)}")
            await asyncio.sleep(self.ttl / 8)

    def _place_once(self) -> None:
        now = time.monotonic()
        desired = self.desired_sources()
        leases = self._views["leases"]
        alive = self.alive_workers(now)
        stable = self.live.note(now, alive)
        self.metrics.workers_alive.labels(self.name).set(len(alive))
        self._note_epoch()
        publishing = self._publishing(now)
        # A view watching its bucket again holds part of it until it is ready: a source
        # missing from it is not a removed one.
        views_ready = all(view.ready.is_set() for view in self._views.values())
        for sid, lease in list(self.owned.items()):
            if sid in self._busy:
                continue
            if lease.fenced or not lease.valid(now):
                self._lost(lease, "deadline")
                self._spawn(sid, self._stop_lost(lease))
            elif not views_ready:
                continue
            elif sid not in desired:
                self._spawn(sid, self._release(sid, "removed"))
            elif not publishing:
                self._spawn(sid, self._release(sid, "publish"))
            elif desired[sid][0] != self._running.get(sid):
                self._spawn(sid, self._restart(sid, desired[sid][0], desired[sid][1]))
        if not self.connected:
            # The views are frozen and a claim would wait in the client, to land at the
            # reconnect ahead of (and instead of) its holder's resume: claim nothing.
            self._blind_until = now
            return
        if not views_ready or not stable or not publishing or self._draining or now < self._claim_after:
            return  # act on a view of the fleet that has held still, never on a passing one
        placed = self.placement(now, desired, alive)
        load = len(self.owned) + sum(1 for s in self._busy if s not in self.owned)
        for sid in sorted(desired):
            if sid in self._busy:
                continue
            target = placed.get(sid)
            if sid in self.owned:
                # Hand over only to a worker alive without a break for a TTL: one move, not two.
                handover = target is not None and target != self.id and self.live.may_hand_to(target, now)
                if handover and not self.owned[sid].fenced:
                    self._spawn(sid, self._release(sid, "rebalance"))
                continue
            if load >= self.capacity or self._retry_at.get(sid, 0.0) > now:
                continue
            lapsed = self._leases().abandoned.get(sid)
            if lapsed is not None and lapsed.lapsed:
                continue  # this worker's own lease, given up at its deadline: resumed, not claimed anew
            entry = leases.entries.get(sid)
            if entry is not None:
                try:
                    stored: StoredLease | None = parse_lease(entry.value)
                    self.bad.good("leases", sid)
                except ValueError as exc:
                    self.bad.bad("leases", sid, entry.revision, exc)
                    stored = None  # unreadable: it ages like any lease nobody renews
                age = self._lease_age(sid, entry.seen, stored, now)
                if age >= self.ttl and (target == self.id or age >= 2 * self.ttl):
                    self._spawn(sid, self._claim(sid, entry.revision, "expired"))
                    load += 1
                continue
            free_since = leases.deleted.get(sid)
            reason = "released" if free_since is not None else "new"
            if free_since is None:
                free_since = self._free_since.setdefault(sid, now)
            if target == self.id or now - max(free_since, self._blind_until) >= self.ttl:
                self._spawn(sid, self._claim(sid, None, reason))
                load += 1

    def _note_epoch(self) -> None:
        """Follow the lease bucket's epoch (another worker may have re-created the bucket)."""
        seen = self._views["leases"].meta.get(EPOCH_KEY)
        if seen is None:
            return
        try:
            epoch = parse_epoch(seen.value)
        except ValueError as exc:
            self.bad.bad("leases", EPOCH_KEY, seen.revision, exc)
            return
        if epoch > self._epoch_floor and self._epoch_floor:
            self._lost_lease_bucket()  # another worker made the lease bucket again
        if epoch >= self._epoch_floor:
            self._epoch_floor = epoch
            self._leases().epoch = epoch

    def _spawn(self, sid: str, work: Any) -> None:
        async def run() -> None:
            try:
                await work
            except Exception as exc:
                self._errors(f"act:{sid}", f"fleet {self.name}: {sid}: {_described(exc)}")
            finally:
                self._busy.pop(sid, None)

        self._busy[sid] = asyncio.create_task(run(), name=f"fleet-{sid}")

    async def _claim(self, sid: str, last: int | None, reason: str) -> None:
        if not self.connected:
            return  # queued in the client, it would land at some moment after the reconnect
        leases = self._leases()
        seen = self._views["sources"].entries.get(sid)
        if seen is None:
            return
        config, _ = self.decoded.get(sid, seen.revision, seen.value)
        if config is None:
            return
        if not leases.epoch:
            leases.epoch = await leases.load_epoch(self._epoch_floor)
        lease = await leases.claim(sid, last)
        if lease is None:
            # Someone else was first: read the key so the view does not wait for the watcher.
            with contextlib.suppress(Exception):
                entry = await leases.kv.get(sid)
                self._views["leases"].note(sid, entry.value, entry.revision or 0)
            return
        self.owned[sid] = lease
        if not await self._run_owned(sid, config, seen.revision, "cannot start here: {}; lease released"):
            return
        self.metrics.takeovers.labels(self.name, reason).inc()
        self.metrics.sources_owned.labels(self.name).set(len(self.owned))
        log.info(
            "fleet %s: took %s (%s, epoch %d, lease %d)", self.name, sid, reason, lease.epoch, lease.number
        )

    async def _restart(self, sid: str, revision: int, config: SourceConfig) -> None:
        """The desired entry of an owned source changed: run the new settings under the same lease."""
        await self.runtime.remove_source(sid)
        lease = self.owned.get(sid)
        if lease is None or not lease.valid():
            return
        if not await self._run_owned(sid, config, revision, "cannot start with its new settings: {}"):
            return
        self.metrics.restarts.labels(self.name).inc()
        log.info("fleet %s: restarted %s with its changed settings", self.name, sid)

    async def _run_owned(self, sid: str, config: SourceConfig, revision: int, failure: str) -> bool:
        """Start an owned source; one that cannot start here is released and retried later."""
        try:
            self.runtime.add_source(config)
        except Exception as exc:
            log.error("fleet %s: source %s %s", self.name, sid, failure.format(exc))
            self._retry_at[sid] = time.monotonic() + 2 * self.ttl
            await self._release(sid, "failed")
            return False
        self._running[sid] = revision
        return True

    async def _release(self, sid: str, reason: str) -> None:
        """Stop ``sid`` (its frames in flight are still published), then give the lease up."""
        lease = self.owned.get(sid)
        if lease is None:
            return
        await self.runtime.remove_source(sid)
        lease.fenced = True
        if self.owned.get(sid) is lease:
            del self.owned[sid]
            self._running.pop(sid, None)
        # Counted and said the moment the source is no longer owned, so /metrics and the log
        # agree with `owned`; giving the key up in the bucket follows.
        self.metrics.releases.labels(self.name, reason).inc()
        self.metrics.sources_owned.labels(self.name).set(len(self.owned))
        if reason == "publish":
            log.warning(
                "fleet %s: released %s: the publishing connection has not answered for %.1fs",
                self.name,
                sid,
                self.ttl * 0.75,
            )
        else:
            log.info("fleet %s: released %s (%s)", self.name, sid, reason)
        with contextlib.suppress(Exception):
            await self._leases().release(lease)

    def _source_policy(self) -> tuple[SourcePolicy, str]:
        """What a stored source may be here: what this worker's API would accept, plus the
        files its own pipeline file names (it seeds them), and where relative paths start."""
        cfg = self.runtime.config
        policy = SourcePolicy.from_http(cfg.http, cfg.base_dir)
        # The operator's own file is trusted as `vidpipe run` trusts it: without this, a
        # file source the worker seeded was refused by the API's http.file_roots.
        own = tuple(Path(s.url).resolve() for s in cfg.sources if s.scheme == "file")
        if own and policy.file_roots is not None:
            policy = dataclasses.replace(policy, file_roots=(*policy.file_roots, *own))
        return policy, cfg.base_dir

    def desired_configs(self) -> list[SourceConfig]:
        """The desired sources as this worker last saw them (decoded once per revision)."""
        return [config for _, (_, config) in sorted(self.desired_sources().items())]

    # -- what /v1/fleet shows --------------------------------------------------------------

    def status(self) -> dict[str, Any]:
        now = time.monotonic()
        alive = self.alive_workers(now)
        workers = [
            worker_json(info, key in alive)
            for key, (info, _) in sorted(self._heartbeats().items())
            if key != self.id  # this worker's own line is current, not its last heartbeat
        ]
        if self.id in alive:
            workers.append(worker_json(alive[self.id], True))
            workers.sort(key=lambda w: str(w["id"]))
        desired = self.desired_sources()
        placed = self.placement(now, desired, alive)
        sources = []
        for sid in sorted(desired):
            owner, since, epoch, number, last = None, None, None, None, None
            entry = self._views["leases"].entries.get(sid)
            if entry is not None:
                with contextlib.suppress(ValueError):
                    stored = parse_lease(entry.value)
                    owns, last = lease_owner(stored, alive)
                    if owns:
                        owner, since, epoch, number = stored.worker, stored.since, stored.epoch, stored.number
            if sid in self.owned:
                own = self.owned[sid]
                owner, since, epoch, number, last = self.id, own.since, own.epoch, own.number, None
            sources.append(source_json(sid, owner, since, epoch, number, placed.get(sid), last))
        return {
            "fleet": self.name,
            "worker": self.id,
            "lease_ttl": self.ttl,
            "epoch": self._leases().epoch if self.leases is not None else None,
            "workers": workers,
            "sources": sources,
        }
