"""The desired sources of a fleet: what should run somewhere, whoever runs it.

One key per source id in ``vidpipe_fleet_<fleet>_sources``; the value is the
source's config as JSON, the same keys as in the YAML::

    {"url": "rtsp://cam-7/stream", "id": "cam-7", "transport": "tcp", ...}

The config file's sources seed the set once: only a set that was never seeded
(no ``=seeded`` key) and holds no source gets them, so a source removed since
stays removed whichever worker starts next. A wiped or deleted bucket has no
``=seeded`` key and is seeded again. ``POST``/``DELETE /v1/sources`` on any
worker and ``vidpipe fleet add|remove`` change the set; a removal purges the
key, and tombstones older than a few minutes are purged too, so removed ids
leave nothing behind. The set holds at most ``fleet.max_desired`` sources.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
from collections.abc import Container
from typing import Any

from nats.js import JetStreamContext
from nats.js.errors import KeyDeletedError, KeyNotFoundError, KeyWrongLastSequenceError
from nats.js.kv import KeyValue

from pipeline.config import SourceConfig, SourcePolicy, parse_source, source_keys
from pipeline.fleet.buckets import META_PREFIX, bucket_keys, bucket_name, purge_markers
from pipeline.sources.registry import create_source

# Written once, before the config's sources, by the worker that seeds the set.
SEEDED_KEY = "=seeded"


def encode_source(config: SourceConfig) -> bytes:
    return json.dumps(source_keys(dataclasses.asdict(config)), separators=(",", ":")).encode()


def decode_source(
    source_id: str, value: bytes, policy: SourcePolicy | None = None, base_dir: str = "."
) -> SourceConfig:
    """The config stored under ``source_id``; its id is the key, whatever the value says.

    The store is input like any other: the value gets the checks of ``POST /v1/sources``
    (``policy``; by default the API's defaults), keys at their default aside.
    """
    data: Any = json.loads(value)
    if not isinstance(data, dict):
        raise ValueError(f"desired source {source_id}: expected a JSON object")
    data = {**source_keys(data), "id": source_id}
    policy = policy or SourcePolicy.from_http(None, base_dir)
    return parse_source(data, base_dir=base_dir, policy=policy, file="fleet", path=f"sources.{source_id}")


def check_source(config: SourceConfig) -> None:
    """Raise what starting ``config`` would raise on its settings alone (a bad ``test://`` size...).

    Builds the source without starting it: nothing is opened.
    """
    create_source(config)


class DesiredCache:
    """Each desired entry decoded once per revision; an entry that does not decode is None.

    Entries get the checks ``policy`` gives (what this worker's API would accept).
    """

    def __init__(self, policy: SourcePolicy | None = None, base_dir: str = ".") -> None:
        self.policy, self.base_dir = policy, base_dir
        self._decoded: dict[str, tuple[int, SourceConfig | None, str]] = {}

    def get(self, sid: str, revision: int, value: bytes) -> tuple[SourceConfig | None, str]:
        """``(config, "")``, or ``(None, problem)`` for a value that is not a valid source."""
        hit = self._decoded.get(sid)
        if hit is not None and hit[0] == revision:
            return hit[1], hit[2]
        config: SourceConfig | None = None
        problem = ""
        try:
            config = decode_source(sid, value, self.policy, self.base_dir)
            check_source(config)
        except Exception as exc:
            config, problem = None, f"{type(exc).__name__}: {exc}"
        self._decoded[sid] = (revision, config, problem)
        return config, problem

    def forget(self, keep: Container[str]) -> None:
        for sid in [s for s in self._decoded if s not in keep]:
            del self._decoded[sid]


class DesiredSources:
    """Add and remove the fleet's desired sources; seed the set once; purge old removal markers."""

    def __init__(self, js: JetStreamContext, fleet: str, kv: KeyValue, timeout: float = 5.0) -> None:
        self.js = js
        self.bucket = bucket_name(fleet, "sources")
        self.kv = kv
        self.timeout = timeout

    async def keys(self) -> list[str]:
        """Every key in the bucket (removed ones' markers included), bounded by the timeout."""
        return await asyncio.wait_for(bucket_keys(self.js, self.bucket), self.timeout)

    async def seed(self, configs: list[SourceConfig]) -> list[str]:
        """Add ``configs`` if the set was never seeded and is empty; the ids added."""
        if not configs:
            return []
        try:
            await asyncio.wait_for(self.kv.create(SEEDED_KEY, b"1"), self.timeout)
        except KeyWrongLastSequenceError:
            return []  # seeded before (by this or another worker): the set is what it is now
        keys = await self.keys()
        if any(not k.startswith(META_PREFIX) for k in keys):
            return []  # sources added before seeding was recorded: leave the set alone
        try:
            return [c.source_id for c in configs if await self.add(c)]
        except Exception:
            # Half seeded: take the mark back so the next try (this worker's or another's) seeds.
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self.kv.delete(SEEDED_KEY), self.timeout)
            raise

    async def add(self, config: SourceConfig) -> bool:
        """Add ``config`` under its id; False when the id is taken (the stored one stays)."""
        try:
            await asyncio.wait_for(self.kv.create(config.source_id, encode_source(config)), self.timeout)
        except KeyWrongLastSequenceError:
            return False
        return True

    async def remove(self, source_id: str) -> bool:
        """Remove a source; its owner stops it and releases its lease. False if unknown."""
        try:
            entry = await asyncio.wait_for(self.kv.get(source_id), self.timeout)
        except (KeyNotFoundError, KeyDeletedError):
            return False
        if entry.value is None:
            return False
        # A purge keeps no old value behind (history 1); its marker is purged later.
        await asyncio.wait_for(self.kv.purge(source_id), self.timeout)
        return True

    async def purge_tombstones(self, older_than: float) -> None:
        """Drop the markers of removed sources older than ``older_than`` seconds."""
        await asyncio.wait_for(purge_markers(self.js, self.bucket, older_than), self.timeout)
