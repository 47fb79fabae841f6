"""Leases: which worker runs a source, held in ``vidpipe_fleet_<fleet>_leases``.

One key per source; the value says who holds it::

    {"worker": "cam-host-1-4121", "since": 1795000000.0, "lease": 1843}

* **claim**: create-if-absent, or, to take over a lease that stopped changing,
  compare-and-swap on the revision this worker saw. Of several workers racing,
  exactly one succeeds.
* **renew**: compare-and-swap on the revision of the last renewal; it fails
  once anyone else has written the key.
* **release**: delete, again only if the revision is still ours.

The lease number stamped on messages is the revision of the claim: JetStream
revisions only grow, so a later owner always has a larger one.

Fencing does not trust the server to say when a lease ran out. Each successful
renewal sets a local monotonic ``deadline``: the time the request was *sent*
plus ``ttl`` minus a safety margin. Other workers call a lease expired only
after its revision has not changed for ``ttl`` on their own clock since they
first saw it, which is after the write, which is after the send. So the holder
stops publishing before anyone else may take over, however long it was paused.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from dataclasses import dataclass

from nats.js.errors import APIError, KeyDeletedError, KeyNotFoundError, KeyWrongLastSequenceError
from nats.js.kv import KeyValue

# Part of the TTL kept between the local deadline and the earliest takeover: it
# absorbs a message already handed to the client when the deadline passes.
SAFETY_FRACTION = 0.25
# JetStream's "wrong last sequence" error codes (a compare-and-swap that lost).
WRONG_LAST_SEQUENCE = (10071, 10164)


@dataclass
class Lease:
    """A lease this worker holds."""

    source: str
    worker: str
    number: int  # the claim's revision: what messages carry as ``lease``
    revision: int  # the latest renewal's revision: what the next CAS expects
    since: float  # unix time of the claim
    deadline: float  # monotonic: publish nothing for the source after this
    fenced: bool = False  # set once the worker gives the source up (released or lost)

    def valid(self, now: float | None = None) -> bool:
        return not self.fenced and (time.monotonic() if now is None else now) < self.deadline


def lease_value(worker: str, since: float, number: int) -> bytes:
    return json.dumps({"worker": worker, "since": since, "lease": number}, separators=(",", ":")).encode()


def parse_lease(value: bytes) -> tuple[str, float, int]:
    """``(worker, since, lease number)`` of a stored lease; number 0 for a claim not yet renewed."""
    data = json.loads(value)
    return str(data.get("worker", "")), float(data.get("since", 0.0)), int(data.get("lease", 0))


class LeaseTable:
    """Claim, renew and release leases of one worker in a fleet's lease bucket."""

    def __init__(self, kv: KeyValue, worker: str, ttl: float, *, timeout: float | None = None) -> None:
        self.kv = kv
        self.worker = worker
        self.ttl = ttl
        self.margin = ttl * SAFETY_FRACTION
        # A request slower than this is treated as failed (the next renewal retries).
        self.timeout = timeout if timeout is not None else max(0.5, ttl / 4)

    async def claim(self, source: str, last: int | None = None) -> Lease | None:
        """Take ``source``: if absent (``last`` None), else if still at revision ``last``.

        None when another worker got there first.
        """
        sent = time.monotonic()
        since = time.time()
        try:
            if last is None:
                revision = await asyncio.wait_for(
                    self.kv.create(source, lease_value(self.worker, since, 0)), self.timeout
                )
            else:
                revision = await asyncio.wait_for(
                    self.kv.update(source, lease_value(self.worker, since, 0), last=last), self.timeout
                )
        except KeyWrongLastSequenceError:
            return None
        lease = Lease(source, self.worker, revision, revision, since, sent + self.ttl - self.margin)
        # Write the lease number into the value at once, so readers can tell owners apart;
        # if that fails, the claim still stands until its deadline.
        with contextlib.suppress(Exception):
            await self.renew(lease)
        return lease

    async def renew(self, lease: Lease) -> bool:
        """Extend ``lease``; False when it was lost (someone else wrote the key).

        A timeout or a broken connection raises: the lease may still be ours, and
        its deadline decides.
        """
        sent = time.monotonic()
        value = lease_value(self.worker, lease.since, lease.number)
        try:
            revision = await asyncio.wait_for(
                self.kv.update(lease.source, value, last=lease.revision), self.timeout
            )
        except KeyWrongLastSequenceError:
            # A renewal whose answer was lost may have been applied: the key then still
            # names this worker and this claim.
            try:
                entry = await asyncio.wait_for(self.kv.get(lease.source), self.timeout)
            except (KeyNotFoundError, KeyDeletedError):
                return False
            if entry.value is None or entry.revision is None:
                return False
            worker, _, number = parse_lease(entry.value)
            if worker != self.worker or number != lease.number:
                return False
            revision = entry.revision
        lease.revision = revision
        lease.deadline = sent + self.ttl - self.margin
        return True

    async def release(self, lease: Lease) -> bool:
        """Give ``lease`` up so another worker can claim it now; False if it was no longer ours."""
        lease.fenced = True
        try:
            await asyncio.wait_for(self.kv.delete(lease.source, last=lease.revision), self.timeout)
        except APIError as exc:
            if exc.err_code in WRONG_LAST_SEQUENCE:
                return False
            raise
        return True
