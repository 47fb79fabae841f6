"""The fleet's three JetStream KV buckets and a watched, local view of each.

For a fleet named ``cameras``:

=================================  ==========================================
``vidpipe_fleet_cameras_sources``  the desired sources: id -> source config (JSON)
``vidpipe_fleet_cameras_leases``   who runs each source: id -> lease (JSON)
``vidpipe_fleet_cameras_workers``  heartbeats: worker id -> capacity, load, version
=================================  ==========================================

Keys that start with ``=`` are the fleet's own bookkeeping (``=epoch`` in the
leases bucket, ``=seeded`` in the sources bucket), never a source id or worker
id; a view keeps them apart in ``meta``.

A :class:`BucketView` keeps every key's latest value with the local monotonic
time its revision was first seen. Lease and heartbeat expiry is judged on that
clock alone ("this revision has not changed for ``lease_ttl``"), never by
comparing clocks of different hosts.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import datetime
import logging
import re
import time
from collections.abc import Callable
from dataclasses import dataclass

from nats.errors import NoRespondersError
from nats.js import JetStreamContext
from nats.js.api import KeyValueConfig
from nats.js.errors import (
    BucketNotFoundError,
    KeyDeletedError,
    KeyNotFoundError,
    NotFoundError,
    ServerError,
    ServiceUnavailableError,
)
from nats.js.kv import KV_DEL, KV_OP, KV_PURGE, KeyValue

from pipeline.cancel import cancel_and_wait
from pipeline.names import check_name

log = logging.getLogger("vidpipe.fleet")

# The first character of the fleet's bookkeeping keys; not allowed in source or worker ids.
META_PREFIX = "="


def bucket_name(fleet: str, kind: str) -> str:
    """``vidpipe_fleet_<fleet>_<kind>``; ``kind`` is sources, leases or workers."""
    return f"vidpipe_fleet_{fleet}_{kind}"


# JetStream's answer to ``replicas > 1`` on a server that runs without a cluster.
NOT_CLUSTERED = 10074


class NotClustered(Exception):
    """More copies of a bucket were asked for than a server without a cluster keeps (one)."""

    def __init__(self, replicas: int) -> None:
        super().__init__(f"replicas {replicas} asked of a JetStream server without a cluster")
        self.replicas = replicas


async def open_bucket(
    js: JetStreamContext, fleet: str, kind: str, *, ttl: float | None = None, replicas: int = 1
) -> KeyValue:
    """The bucket, created when missing (history 1: one value per key, no old revisions kept).

    An existing bucket keeps its own settings, except that one with fewer copies
    than ``replicas`` (made by ``vidpipe fleet add``, or by workers with a lower
    ``fleet.replicas``) is given more: a fleet on a cluster must survive a node.
    """
    name = bucket_name(fleet, kind)
    try:
        kv = await js.key_value(name)
    except BucketNotFoundError:
        pass
    else:
        if replicas > 1:
            await _raise_copies(js, name, replicas)
        return kv
    try:
        return await js.create_key_value(KeyValueConfig(bucket=name, history=1, ttl=ttl, replicas=replicas))
    except ServerError as exc:
        if exc.err_code == NOT_CLUSTERED:
            raise NotClustered(replicas) from None  # a retry cannot help: the server has one copy
        # Another worker created it first with other settings: use theirs.
        return await js.key_value(name)
    except Exception:
        return await js.key_value(name)


async def _raise_copies(js: JetStreamContext, bucket: str, replicas: int) -> None:
    """Give ``bucket`` ``replicas`` copies if it has fewer (JetStream copies the data over)."""
    stream = bucket_stream(bucket)
    config = (await js.stream_info(stream)).config
    had = config.num_replicas or 1
    if had >= replicas:
        return
    try:
        await js.update_stream(dataclasses.replace(config, num_replicas=replicas))
    except ServerError as exc:
        if exc.err_code == NOT_CLUSTERED:
            raise NotClustered(replicas) from None
        log.warning(
            "fleet bucket %s keeps %d cop%s, fewer than fleet.replicas (%d), and could not be given more: %s",
            bucket, had, "y" if had == 1 else "ies", replicas, exc.description or exc,
        )  # fmt: skip
        return
    log.info("fleet bucket %s: copies raised from %d to %d (fleet.replicas)", bucket, had, replicas)


class NoJetStream(Exception):
    """The NATS server does not run JetStream, where a fleet keeps its state."""


async def fleet_names(js: JetStreamContext) -> list[str]:
    """The fleets on the server: those with any of their buckets (sources, leases, workers)."""
    streams: list[str] = []
    try:
        while page := await js.streams_info(offset=len(streams)):
            streams += [info.config.name or "" for info in page]
    except (NoRespondersError, ServiceUnavailableError):
        raise NoJetStream from None
    # A bucket's stream name read back: KV_vidpipe_fleet_<fleet>_<kind>.
    pattern = re.compile(
        re.escape(bucket_stream(bucket_name("FLEET", "KIND")))
        .replace("FLEET", "(?P<fleet>[A-Za-z0-9_-]+)")
        .replace("KIND", "(?:sources|leases|workers)")
    )
    fleets = set()
    for stream in streams:
        match = pattern.fullmatch(stream)
        if match and check_name(match["fleet"]) is None:
            fleets.add(match["fleet"])
    return sorted(fleets)


def bucket_stream(bucket: str) -> str:
    """The JetStream stream that holds ``bucket``; one subject per key, ``$KV.<bucket>.<key>``."""
    return f"KV_{bucket}"


def key_prefix(bucket: str) -> str:
    """``$KV.<bucket>.``: a key's subject in the bucket's stream is this and the key."""
    return f"$KV.{bucket}."


async def bucket_keys(js: JetStreamContext, bucket: str) -> list[str]:
    """Every key of ``bucket`` that holds a message, removed keys' markers included, sorted.

    Read from the stream's subject counts in one request. nats-py's ``KeyValue.keys()``
    reads through a watcher whose "initial values done" marker races the first
    delivery: on a busy host it answered "no keys" for a full bucket, or never answered.
    """
    prefix = key_prefix(bucket)
    info = await js.stream_info(bucket_stream(bucket), subjects_filter=f"{prefix}>")
    return sorted(s[len(prefix) :] for s in (info.state.subjects or {}) if s.startswith(prefix))


async def bucket_items(js: JetStreamContext, kv: KeyValue, bucket: str) -> dict[str, bytes]:
    """Every key of ``bucket`` (``kv``) that holds a value, with the value; removed keys left out."""
    out: dict[str, bytes] = {}
    for key in await bucket_keys(js, bucket):
        try:
            entry = await kv.get(key)
        except (KeyNotFoundError, KeyDeletedError):
            continue
        if entry.value:
            out[key] = entry.value
    return out


async def purge_markers(js: JetStreamContext, bucket: str, older_than: float) -> list[str]:
    """Drop the delete and purge markers of ``bucket`` older than ``older_than`` seconds; the keys.

    Each purge stops at the marker's own sequence, so a value written to the key after
    the marker was read stays (nats-py's ``purge_deletes`` would drop it).
    """
    stream, prefix = bucket_stream(bucket), key_prefix(bucket)
    now = datetime.datetime.now(datetime.UTC)
    purged = []
    for key in await bucket_keys(js, bucket):
        try:
            msg = await js.get_last_msg(stream, prefix + key)
        except NotFoundError:
            continue  # gone since the listing
        op = (msg.headers or {}).get(KV_OP)
        if op not in (KV_DEL, KV_PURGE) or msg.seq is None or msg.time is None:
            continue
        if (now - msg.time).total_seconds() < older_than:
            continue
        await js.purge_stream(stream, subject=prefix + key, seq=msg.seq + 1)
        purged.append(key)
    return purged


@dataclass
class Seen:
    """A key's latest value, its revision and when this process first saw that revision."""

    value: bytes
    revision: int
    seen: float
    created: float  # when the key (not this revision) appeared here


class BucketView:
    """Every key of a bucket as this process last saw it, kept current by a watcher.

    Ready once it holds the whole bucket: the watcher has delivered the stream's last
    message as of the start (or a later one). nats-py's own "initial values done" marker
    comes after the first pending batch, not the last: with 1500 keys, a view that
    trusted it held 512, and a worker then released the owned sources it did not see.
    """

    def __init__(self, js: JetStreamContext, kv: KeyValue, bucket: str) -> None:
        self.js = js
        self.kv = kv
        self.bucket = bucket
        self.entries: dict[str, Seen] = {}
        self.meta: dict[str, Seen] = {}  # the ``=`` keys
        # Grows whenever a key appears or goes: what was computed from the key set is stale.
        self.version = 0
        # When each key was last seen deleted (a released lease, a departed worker).
        self.deleted: dict[str, float] = {}
        self.ready = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._watcher: KeyValue.KeyWatcher | None = None
        self._last = 0  # the highest stream sequence (revision) delivered so far
        self._until: int | None = None  # ready once a revision this high has been delivered
        self._settling: asyncio.Task[None] | None = None
        self.started_at = 0.0  # monotonic, when the watcher last (re)started

    async def start(self, timeout: float | None = 30.0) -> None:
        """Watch the bucket; with a ``timeout``, return once the view holds all of it.

        ``TimeoutError`` past ``timeout``. Without one it returns at once and :attr:`ready`
        says when the view is whole (a view watching again must not hold up renewals).
        """
        self.started_at = time.monotonic()
        self._watcher = await self.kv.watchall()
        self._task = asyncio.create_task(self._run(), name=f"watch-{self.bucket}")
        # Started after the watcher exists: whatever it finds is delivered, as an initial
        # value or as an update.
        self._settling = asyncio.create_task(self._settle(), name=f"settle-{self.bucket}")
        if timeout is not None:
            async with asyncio.timeout(timeout):
                await self.ready.wait()

    async def _settle(self) -> None:
        """Find the message the view is whole at; look again if it leaves the stream undelivered."""
        while not self.ready.is_set():
            try:
                # That message can leave the stream before the watcher delivers it (a
                # heartbeat past its TTL, a purged marker): then wait for the last one now.
                if self._until is None or not await self._has(self._until):
                    self._until = await self._last_sequence()
                    self._check_ready()
            except Exception as exc:  # a timeout or a reconnect: ask again
                log.debug("bucket %s: reading its last message failed: %s", self.bucket, exc)
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(0.5):
                    await self.ready.wait()

    async def _last_sequence(self) -> int:
        """The sequence of the stream's last message still held; 0 for an empty bucket.

        Not the stream's ``last_seq``: that stays on a purged message (a removed key's
        marker, purged), which no watcher will ever deliver.
        """
        try:
            msg = await self.js.get_last_msg(bucket_stream(self.bucket), key_prefix(self.bucket) + ">")
        except NotFoundError:
            return 0
        return int(msg.seq or 0)

    async def _has(self, seq: int) -> bool:
        try:
            await self.js.get_msg(bucket_stream(self.bucket), seq)
        except NotFoundError:
            return False
        return True

    def _check_ready(self) -> None:
        if self._until is not None and self._last >= self._until:
            self.ready.set()

    async def _run(self) -> None:
        assert self._watcher is not None
        async for entry in self._watcher:
            if entry is None:  # nats-py's marker: too early to trust (see the class)
                continue
            self.note(entry.key, entry.value, entry.revision, deleted=entry.operation in (KV_DEL, KV_PURGE))
            self._last = max(self._last, entry.revision or 0)
            self._check_ready()

    def note(self, key: str, value: bytes | None, revision: int, *, deleted: bool = False) -> None:
        """Record what the watcher (or a direct read) says about ``key``."""
        now = time.monotonic()
        if key.startswith(META_PREFIX):
            if deleted or value is None:
                self.meta.pop(key, None)
            elif key not in self.meta or self.meta[key].revision < revision:
                self.meta[key] = Seen(value=value, revision=revision, seen=now, created=now)
            return
        old = self.entries.get(key)
        if old is not None and revision < old.revision:
            return  # an older answer than the one kept
        if deleted or value is None:
            if old is not None or key not in self.deleted:
                self.deleted[key] = now
            if self.entries.pop(key, None) is not None:
                self.version += 1
            return
        if old is not None and old.revision == revision:
            return
        created = old.created if old is not None else now
        if old is None:
            self.version += 1
        self.entries[key] = Seen(value=value, revision=revision, seen=now, created=created)
        self.deleted.pop(key, None)

    def age(self, key: str, now: float) -> float | None:
        """Seconds since the key's current revision was first seen here; None when absent."""
        entry = self.entries.get(key)
        return None if entry is None else now - entry.seen

    async def restart(self, kv: KeyValue) -> None:
        """Watch ``kv`` (a re-created bucket) from scratch; what the old one held is forgotten."""
        await self.stop()
        self.kv = kv
        self.entries.clear()
        self.version += 1
        self.meta.clear()
        self.deleted.clear()
        self.ready = asyncio.Event()
        self._last, self._until = 0, None
        await self.start(timeout=None)

    async def stop(self) -> None:
        if self._watcher is not None:
            # Bounded: unsubscribing waits on the connection, which may be stalled or gone.
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._watcher.stop(), 2.0)
        await cancel_and_wait(self._task, self._settling)


class BadEntries:
    """Stored values that do not parse: each skipped, counted once per revision, logged once per key.

    The buckets are shared with every client of the NATS server, so a value is input
    to check like a request body: one bad heartbeat or lease never stops placement.
    """

    def __init__(self, fleet: str, count: Callable[[str], None]) -> None:
        self.fleet = fleet
        self._count = count
        self._seen: dict[tuple[str, str], int] = {}  # (bucket, key) -> revision last counted

    def bad(self, bucket: str, key: str, revision: int, problem: object) -> None:
        last = self._seen.get((bucket, key))
        if last == revision:
            return
        self._count(bucket)
        if last is None:
            log.warning(
                "fleet %s: skipping %s entry %r (revision %d): %s; fix or delete the key",
                self.fleet,
                bucket,
                key[:80],
                revision,
                str(problem)[:200],
            )
        self._seen[(bucket, key)] = revision

    def good(self, bucket: str, key: str) -> None:
        self._seen.pop((bucket, key), None)
