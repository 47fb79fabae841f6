"""The fleet as ``vidpipe fleet list`` shows it, read straight from the buckets.

A one-shot reader cannot watch a heartbeat change, so it calls a worker alive
when its last heartbeat (the worker's own clock) is younger than its
``lease_ttl``; a running worker's ``/v1/fleet`` judges on its own clock instead.
"""

from __future__ import annotations

import json
import time
from typing import Any

from nats.js import JetStreamContext
from nats.js.errors import BucketNotFoundError, KeyDeletedError, KeyNotFoundError, NoKeysError
from nats.js.kv import KeyValue

from pipeline.fleet.buckets import bucket_name
from pipeline.fleet.leases import parse_lease


async def _items(kv: KeyValue) -> dict[str, bytes]:
    try:
        keys = await kv.keys()
    except NoKeysError:
        return {}
    out: dict[str, bytes] = {}
    for key in sorted(keys):
        try:
            entry = await kv.get(key)
        except (KeyNotFoundError, KeyDeletedError):
            continue
        if entry.value:
            out[key] = entry.value
    return out


async def read_status(js: JetStreamContext, fleet: str) -> dict[str, Any]:
    """``{"fleet", "workers": [...], "sources": [...]}``, the shape ``/v1/fleet`` answers."""
    buckets: dict[str, dict[str, bytes]] = {}
    for kind in ("sources", "leases", "workers"):
        try:
            kv = await js.key_value(bucket_name(fleet, kind))
        except BucketNotFoundError:
            buckets[kind] = {}
            continue
        buckets[kind] = await _items(kv)
    now = time.time()
    workers = []
    for wid, value in buckets["workers"].items():
        data = json.loads(value)
        alive = now - float(data.get("ts", 0.0)) < float(data.get("lease_ttl", 8.0))
        workers.append(
            {
                "id": wid,
                "alive": alive,
                "load": int(data.get("load", 0)),
                "capacity": int(data.get("capacity", 0)),
                "version": str(data.get("version", "")),
            }
        )
    sources = []
    for sid in buckets["sources"]:
        lease = buckets["leases"].get(sid)
        owner, since, number = parse_lease(lease) if lease is not None else ("", 0.0, 0)
        sources.append(
            {"id": sid, "owner": owner or None, "owned_since": since or None, "lease": number or None}
        )
    return {"fleet": fleet, "workers": workers, "sources": sources}


def format_status(status: dict[str, Any]) -> str:
    """Two plain tables: workers, then sources."""
    lines = [f"fleet {status['fleet']}", "", f"{'WORKER':<32} {'ALIVE':<6} {'LOAD':>9}  VERSION"]
    for w in status["workers"]:
        load = f"{w['load']}/{w['capacity']}"
        lines.append(f"{w['id']:<32} {'yes' if w['alive'] else 'no':<6} {load:>9}  {w['version']}")
    lines += ["", f"{'SOURCE':<24} {'OWNER':<32} {'LEASE':>8}  OWNED SINCE"]
    for s in status["sources"]:
        since = (
            time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(s["owned_since"])) if s["owned_since"] else "-"
        )
        lines.append(f"{s['id']:<24} {s['owner'] or '-':<32} {s['lease'] or '-':>8}  {since}")
    return "\n".join(lines)
