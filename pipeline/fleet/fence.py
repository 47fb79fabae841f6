"""The fence a fleet worker's publisher asks before every message (docs/messages.md).

The runtime builds it when its config has a ``fleet:`` section and hands it to its
publisher; the :class:`~pipeline.fleet.worker.FleetWorker` later fills it: the
leases it holds, and until when its publishing connection is known to deliver. A
message goes out only while its source's lease is valid here and the connection
has answered recently; each one held back is counted
(``vidpipe_fleet_fenced_messages_total``).
"""

from __future__ import annotations

import math
import os
import socket
import time

from prometheus_client import Counter

from pipeline.fleet.leases import Lease

__all__ = ["LeaseFence", "default_worker_id"]


def default_worker_id() -> str:
    """``<hostname>-<pid>``, with characters a KV key cannot hold replaced."""
    host = "".join(c if c.isalnum() or c in "-_" else "-" for c in socket.gethostname()) or "host"
    return f"{host}-{os.getpid()}"


class LeaseFence:
    """Who may publish for a source right now: this worker, while it holds a valid lease."""

    def __init__(self, worker_id: str, refused: Counter) -> None:
        self.worker_id = worker_id
        # The leases this worker holds, by source; the worker adds and removes them.
        self.owned: dict[str, Lease] = {}
        # Monotonic time until which the publishing connection is known to deliver.
        self.publish_until = math.inf
        self._refused = refused  # the fleet's fenced-messages counter

    def may_publish(self, source: str) -> bool:
        lease = self.owned.get(source)
        now = time.monotonic()
        if lease is not None and lease.valid(now) and now < self.publish_until:
            return True
        self._refused.inc()
        return False

    def owner(self, source: str) -> tuple[str, int, int] | None:
        lease = self.owned.get(source)
        return (self.worker_id, lease.epoch, lease.number) if lease is not None else None
