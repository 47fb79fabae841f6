"""The fleet as ``vidpipe fleet list`` shows it, read straight from the buckets.

A one-shot reader cannot watch a heartbeat change, so it calls a worker alive
when its last heartbeat (the worker's own clock) is younger than its
``lease_ttl``; a running worker's ``/v1/fleet`` judges on its own clock instead.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

from nats.js import JetStreamContext
from nats.js.errors import BucketNotFoundError
from nats.js.kv import KeyValue

from pipeline.fleet.buckets import META_PREFIX, bucket_items, bucket_name
from pipeline.fleet.leases import StoredLease, parse_lease
from pipeline.fleet.placement import place


def _number(data: dict[str, Any], key: str, default: float) -> float:
    value = data.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ValueError(f"{key} must be a finite number, got {str(value)[:40]!r}")
    return float(value)


def _count(data: dict[str, Any], key: str) -> int:
    value = data.get(key, 0)
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= 1_000_000:
        raise ValueError(f"{key} must be an integer 0-1000000, got {str(value)[:40]!r}")
    return value


@dataclass
class WorkerInfo:
    """A worker as its heartbeat describes it."""

    id: str
    capacity: int
    load: int
    version: str
    ts: float  # the worker's own unix time at the heartbeat
    lease_ttl: float = 0.0

    @classmethod
    def parse(cls, key: str, value: bytes) -> WorkerInfo:
        """ValueError, naming the field, for anything but a heartbeat (the bucket is shared)."""
        data: Any = json.loads(value)
        if not isinstance(data, dict):
            raise ValueError("expected a JSON object")
        version = data.get("version", "")
        if not isinstance(version, str):
            raise ValueError("version must be a string")
        return cls(
            id=key,
            capacity=_count(data, "capacity"),
            load=_count(data, "load"),
            version=version[:64],
            ts=_number(data, "ts", 0.0),
            lease_ttl=_number(data, "lease_ttl", 0.0),
        )


def worker_json(info: WorkerInfo, alive: bool) -> dict[str, Any]:
    return {
        "id": info.id,
        "alive": alive,
        "load": info.load,
        "capacity": info.capacity,
        "version": info.version,
    }


def source_json(
    sid: str,
    owner: str | None,
    since: float | None,
    epoch: int | None,
    lease: int | None,
    placed_on: str | None,
    last_owner: str | None = None,
) -> dict[str, Any]:
    return {
        "id": sid,
        "owner": owner,
        "owned_since": since,
        "epoch": epoch,
        "lease": lease,
        "placed_on": placed_on,
        "last_owner": last_owner,
    }


def lease_owner(stored: StoredLease, alive: Collection[str]) -> tuple[bool, str | None]:
    """Whether a stored lease makes its worker the source's owner, and else who last held it.

    A claim its holder has not confirmed (number 0) is no owner. Nor is the lease of a
    worker that is gone (no heartbeat within its TTL): with no room left in the fleet
    nobody takes the source over, and the lease would name the dead worker for ever.
    """
    if stored.number <= 0:
        return False, None
    if stored.worker not in alive:
        return False, stored.worker
    return True, None


async def _items(js: JetStreamContext, kv: KeyValue, bucket: str) -> dict[str, bytes]:
    items = await bucket_items(js, kv, bucket)  # one listing request, then one get per key
    return {k: v for k, v in items.items() if not k.startswith(META_PREFIX)}


async def read_status(js: JetStreamContext, fleet: str) -> dict[str, Any]:
    """``{"fleet", "workers": [...], "sources": [...]}``, the shape ``/v1/fleet`` answers.

    An entry that does not parse is left out of ``workers``, and a lease that does not
    parse (or a claim not yet confirmed) shows no owner; ``skipped`` counts them.
    """
    buckets: dict[str, dict[str, bytes]] = {}
    for kind in ("sources", "leases", "workers"):
        try:
            kv = await js.key_value(bucket_name(fleet, kind))
        except BucketNotFoundError:
            buckets[kind] = {}
            continue
        buckets[kind] = await _items(js, kv, bucket_name(fleet, kind))
    now = time.time()
    skipped = 0
    workers = []
    alive: set[str] = set()
    for wid, value in buckets["workers"].items():
        try:
            info = WorkerInfo.parse(wid, value)
        except ValueError:
            skipped += 1
            continue
        if now - info.ts < (info.lease_ttl or 12.0):
            alive.add(info.id)
        workers.append(worker_json(info, info.id in alive))
    leases: dict[str, StoredLease] = {}
    for sid, held in buckets["leases"].items():
        try:
            leases[sid] = parse_lease(held)
        except ValueError:
            if sid in buckets["sources"]:
                skipped += 1
    # Where the workers' placement wants each source, computed the way every worker does
    # from the same buckets: it differs from the owner while a source moves.
    capacities = {w["id"]: w["capacity"] for w in workers if w["alive"]}
    placed = place(buckets["sources"], capacities, {sid: held.worker for sid, held in leases.items()})
    sources = []
    for sid in buckets["sources"]:
        owner, since, epoch, number, last = None, None, None, None, None
        stored = leases.get(sid)
        if stored is not None:
            owns, last = lease_owner(stored, alive)
            if owns:
                owner, since, epoch, number = stored.worker, stored.since, stored.epoch, stored.number
        sources.append(source_json(sid, owner, since, epoch, number, placed.get(sid), last))
    return {"fleet": fleet, "workers": workers, "sources": sources, "skipped": skipped}


def format_status(status: dict[str, Any]) -> str:
    """Two plain tables: workers, then sources."""
    lines = [f"fleet {status['fleet']}", "", f"{'WORKER':<32} {'ALIVE':<6} {'LOAD':>9}  VERSION"]
    for w in status["workers"]:
        load = f"{w['load']}/{w['capacity']}"
        lines.append(f"{w['id']:<32} {'yes' if w['alive'] else 'no':<6} {load:>9}  {w['version']}")
    lines += ["", f"{'SOURCE':<24} {'OWNER':<32} {'FENCE':>16}  OWNED SINCE"]
    for s in status["sources"]:
        since = (
            time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(s["owned_since"])) if s["owned_since"] else "-"
        )
        fence = f"{s['epoch']}/{s['lease']}" if s["lease"] else "-"
        owner = s["owner"] or (f"- (was {s['last_owner']})" if s.get("last_owner") else "-")
        if s.get("placed_on") and s["placed_on"] != s["owner"]:
            owner += f" (to {s['placed_on']})"
        lines.append(f"{s['id']:<24} {owner:<32} {fence:>16}  {since}")
    if status.get("skipped"):
        lines += ["", f"{status['skipped']} stored entr(y/ies) did not parse and were skipped"]
    return "\n".join(lines)
