"""The desired sources of a fleet: what should run somewhere, whoever runs it.

One key per source id in ``vidpipe_fleet_<fleet>_sources``; the value is the
source's config as JSON, the same keys as in the YAML::

    {"url": "rtsp://cam-7/stream", "id": "cam-7", "transport": "tcp", ...}

The config file's sources are added when absent (a restart never overwrites a
change made since); ``POST``/``DELETE /v1/sources`` on any worker and
``vidpipe fleet add|remove`` change the set.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from nats.js.errors import KeyDeletedError, KeyNotFoundError, KeyWrongLastSequenceError, NoKeysError
from nats.js.kv import KeyValue

from pipeline.config import SourceConfig, SourcePolicy, parse_source, source_keys


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


class DesiredSources:
    """Add, remove and list the fleet's desired sources."""

    def __init__(self, kv: KeyValue) -> None:
        self.kv = kv

    async def add(self, config: SourceConfig) -> bool:
        """Add ``config`` under its id; False when the id is taken (the stored one stays)."""
        try:
            await self.kv.create(config.source_id, encode_source(config))
        except KeyWrongLastSequenceError:
            return False
        return True

    async def remove(self, source_id: str) -> bool:
        """Remove a source; its owner stops it and releases its lease. False if unknown."""
        try:
            entry = await self.kv.get(source_id)
        except (KeyNotFoundError, KeyDeletedError):
            return False
        await self.kv.delete(source_id, last=entry.revision)
        return True

    async def list(self) -> dict[str, SourceConfig]:
        out: dict[str, SourceConfig] = {}
        try:
            keys = await self.kv.keys()
        except NoKeysError:
            return out
        for key in sorted(keys):
            try:
                entry = await self.kv.get(key)
            except (KeyNotFoundError, KeyDeletedError):
                continue
            if entry.value:
                out[key] = decode_source(key, entry.value)
        return out
