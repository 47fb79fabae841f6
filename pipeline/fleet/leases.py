"""Leases: which worker runs a source, held in ``vidpipe_fleet_<fleet>_leases``.

One key per source; the value says who holds it::

    {"worker": "cam-host-1-4121", "since": 1795000000.0, "epoch": 1795000000, "lease": 1843}

* **claim**: create-if-absent, or, to take over a lease that stopped changing,
  compare-and-swap on the revision this worker saw. Of several workers racing,
  exactly one succeeds. A claim whose answer does not come back in time is
  read back: the key's revision and value decide, not the client's timeout. A
  claim that cannot be confirmed either way is withdrawn once the key can be
  read again.
* **renew**: compare-and-swap on the revision of the last renewal; it fails
  once anyone else has written the key.
* **release**: delete, again only if the revision is still ours.

The **fence** stamped on messages is the pair ``(epoch, lease)``: ``lease`` is
the revision of the claim, ``epoch`` a number kept in the bucket itself under
the key ``=epoch`` (not a source id: ids are letters, digits, ``_`` and ``-``).
Revisions only grow within one bucket, but a bucket that is deleted and
re-created starts them again at 1; whoever re-creates it writes an epoch larger
than any it has seen and no smaller than the unix time in seconds, so pairs
compared in order (epoch first) grow across the loss too.

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
import math
import time
from dataclasses import dataclass
from typing import Any

from nats.js.errors import APIError, KeyDeletedError, KeyNotFoundError, KeyWrongLastSequenceError
from nats.js.kv import KeyValue

# Part of the TTL kept between the local deadline and the earliest takeover: it
# absorbs a message already handed to the client when the deadline passes.
SAFETY_FRACTION = 0.25
# JetStream's "wrong last sequence" error codes (a compare-and-swap that lost).
WRONG_LAST_SEQUENCE = (10071, 10164)
# The key of the bucket's epoch; '=' cannot start a source id, so it is never a lease.
EPOCH_KEY = "=epoch"


@dataclass
class Lease:
    """A lease this worker holds."""

    source: str
    worker: str
    number: int  # the claim's revision: what messages carry as ``lease``
    revision: int  # the latest renewal's revision: what the next CAS expects
    since: float  # unix time of the claim
    deadline: float  # monotonic: publish nothing for the source after this
    epoch: int = 0  # the bucket's epoch at the claim: what messages carry as ``epoch``
    fenced: bool = False  # set once the worker gives the source up (released or lost)
    # Given up at its deadline (not taken): the holder may resume it while the key names it.
    lapsed: bool = False

    def valid(self, now: float | None = None) -> bool:
        return not self.fenced and (time.monotonic() if now is None else now) < self.deadline


@dataclass(frozen=True)
class StoredLease:
    """A lease as the bucket holds it; ``number`` 0 is a claim its holder has not confirmed yet."""

    worker: str
    since: float
    number: int
    epoch: int


def lease_value(worker: str, since: float, number: int, epoch: int = 0) -> bytes:
    data = {"worker": worker, "since": since, "epoch": epoch, "lease": number}
    return json.dumps(data, separators=(",", ":")).encode()


def _count(data: dict[str, Any], key: str) -> int:
    value = data.get(key, 0)
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < 2**63:
        raise ValueError(f"{key} must be an integer >= 0, got {str(value)[:40]!r}")
    return value


def parse_lease(value: bytes) -> StoredLease:
    """A stored lease; ValueError, saying which field, for anything else (the bucket is shared)."""
    data: Any = json.loads(value)
    if not isinstance(data, dict):
        raise ValueError("expected a JSON object")
    worker, since = data.get("worker"), data.get("since", 0.0)
    if not isinstance(worker, str) or not worker:
        raise ValueError("worker must be a non-empty string")
    if isinstance(since, bool) or not isinstance(since, int | float) or not math.isfinite(since):
        raise ValueError("since must be a finite number")
    return StoredLease(worker, float(since), _count(data, "lease"), _count(data, "epoch"))


def parse_epoch(value: bytes) -> int:
    """The epoch stored under ``=epoch``: a decimal integer >= 1."""
    text = value.decode("ascii", "replace").strip()
    if not text.isdigit() or len(text) > 18 or int(text) < 1:
        raise ValueError(f"epoch must be a decimal integer >= 1, got {text[:40]!r}")
    return int(text)


class LeaseTable:
    """Claim, renew and release leases of one worker in a fleet's lease bucket."""

    def __init__(self, kv: KeyValue, worker: str, ttl: float, *, timeout: float | None = None) -> None:
        self.kv = kv
        self.worker = worker
        self.ttl = ttl
        self.margin = ttl * SAFETY_FRACTION
        # A request slower than this is treated as failed (the next renewal retries).
        self.timeout = timeout if timeout is not None else max(0.5, ttl / 4)
        self.epoch = 0  # set by load_epoch before the first claim
        # Claims sent whose outcome is unknown: source -> the claim's ``since`` (its token).
        self.unconfirmed: dict[str, float] = {}
        # Leases given up by deadline, still to delete if the key names them: source -> lease.
        self.abandoned: dict[str, Lease] = {}

    async def load_epoch(self, floor: int = 0) -> int:
        """The bucket's epoch, written first when absent: above ``floor`` and no smaller than now."""
        while True:
            try:
                entry = await asyncio.wait_for(self.kv.get(EPOCH_KEY), self.timeout)
            except (KeyNotFoundError, KeyDeletedError):
                entry = None
            stored = 0
            if entry is not None and entry.value is not None:
                with contextlib.suppress(ValueError):
                    stored = parse_epoch(entry.value)
            if stored and stored >= floor:
                self.epoch = stored
                return stored
            fresh = str(max(floor + 1, int(time.time()))).encode()
            try:
                if entry is None:
                    await asyncio.wait_for(self.kv.create(EPOCH_KEY, fresh), self.timeout)
                else:
                    # Missing, unreadable or older than one seen before: a lost bucket came back.
                    await asyncio.wait_for(
                        self.kv.update(EPOCH_KEY, fresh, last=entry.revision), self.timeout
                    )
            except KeyWrongLastSequenceError:
                pass  # another worker wrote it first: read theirs
            else:
                self.epoch = int(fresh)
                return self.epoch

    async def claim(self, source: str, last: int | None = None) -> Lease | None:
        """Take ``source``: if absent (``last`` None), else if still at revision ``last``.

        None when another worker got there first, or when the outcome cannot be
        known yet (the claim is then withdrawn by :meth:`withdraw_unconfirmed`).
        """
        sent = time.monotonic()
        since = time.time()
        value = lease_value(self.worker, since, 0, self.epoch)
        try:
            if last is None:
                revision = await asyncio.wait_for(self.kv.create(source, value), self.timeout)
            else:
                revision = await asyncio.wait_for(self.kv.update(source, value, last=last), self.timeout)
        except KeyWrongLastSequenceError:
            return None
        except Exception as exc:
            if isinstance(exc, APIError) and exc.err_code in WRONG_LAST_SEQUENCE:
                return None
            # The request may have been applied on the server all the same: read it back.
            self.unconfirmed[source] = since
            found = await self._read_back(source, since)
            if found is None:
                return None
            self.unconfirmed.pop(source, None)
            revision = found
        deadline = sent + self.ttl - self.margin
        lease = Lease(source, self.worker, revision, revision, since, deadline, self.epoch)
        # Write the lease number into the value at once, so readers can tell owners apart;
        # if that fails, the claim still stands until its deadline.
        with contextlib.suppress(Exception):
            await self.renew(lease)
        return lease

    async def _read_back(self, source: str, since: float) -> int | None:
        """The revision of this worker's claim ``since`` if the key holds it; None otherwise."""
        try:
            entry = await asyncio.wait_for(self.kv.get(source), self.timeout)
        except (KeyNotFoundError, KeyDeletedError):
            self.unconfirmed.pop(source, None)  # not applied: nothing to withdraw
            return None
        except Exception:
            return None  # still unknown
        mine = False
        if entry.value is not None and entry.revision is not None:
            with contextlib.suppress(ValueError):
                stored = parse_lease(entry.value)
                mine = stored.worker == self.worker and stored.since == since
        if not mine:
            self.unconfirmed.pop(source, None)
            return None
        return entry.revision

    def abandon(self, lease: Lease) -> None:
        """A lease this worker stopped using at its deadline: delete it once the key can be read.

        Renewals that timed out here may still reach the server after a reconnect (the
        client queues them) and make the lease look alive to everyone for another TTL.
        """
        self.abandoned[lease.source] = lease

    async def withdraw_unconfirmed(self) -> int:
        """Delete the claims whose outcome was unknown and that did land, and abandoned leases
        (those ``lapsed`` wait: their holder may :meth:`resume` them)."""
        withdrawn = 0
        for source, lease in list(self.abandoned.items()):
            if lease.lapsed:
                continue
            entry: Any = None
            try:
                entry = await asyncio.wait_for(self.kv.get(source), self.timeout)
            except (KeyNotFoundError, KeyDeletedError):
                self.abandoned.pop(source, None)
            except Exception as exc:
                entry = exc  # not reachable yet: try again next round
            if entry is None or isinstance(entry, Exception):
                continue
            mine = False
            if entry.value is not None and entry.revision is not None:
                with contextlib.suppress(ValueError):
                    stored = parse_lease(entry.value)
                    held = (stored.worker, stored.number, stored.epoch)
                    mine = held == (self.worker, lease.number, lease.epoch)
            if not mine:
                self.abandoned.pop(source, None)
                continue
            # A late renewal may land between the read and the delete: then try again next round.
            with contextlib.suppress(APIError, TimeoutError):
                await asyncio.wait_for(self.kv.delete(source, last=entry.revision), self.timeout)
                self.abandoned.pop(source, None)
                withdrawn += 1
        for source, since in list(self.unconfirmed.items()):
            revision = await self._read_back(source, since)
            if revision is None:
                continue
            with contextlib.suppress(APIError):
                await asyncio.wait_for(self.kv.delete(source, last=revision), self.timeout)
                withdrawn += 1
            self.unconfirmed.pop(source, None)
        return withdrawn

    async def resume(self, lease: Lease) -> bool:
        """Hold again a lease given up at its deadline: a renewal, so only if the key still names it.

        A compare-and-swap on the lease's last revision, like any renewal: it fails once
        another worker has written the key, so no one who took the source over loses it.
        """
        self.abandoned.pop(lease.source, None)
        try:
            kept = await self.renew(lease)
        except Exception:
            self.abandoned[lease.source] = lease  # not reachable yet: the next round decides
            raise
        if kept:
            lease.fenced = lease.lapsed = False
        return kept

    async def renew(self, lease: Lease) -> bool:
        """Extend ``lease``; False when it was lost (someone else wrote the key).

        A timeout or a broken connection raises: the lease may still be ours, and
        its deadline decides.
        """
        sent = time.monotonic()
        value = lease_value(self.worker, lease.since, lease.number, lease.epoch)
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
            try:
                stored = parse_lease(entry.value)
            except ValueError:
                # Not a lease: no worker claimed the key, so the claim still stands. Write it
                # back over the junk, again only if nothing else was written since.
                try:
                    revision = await asyncio.wait_for(
                        self.kv.update(lease.source, value, last=entry.revision), self.timeout
                    )
                except KeyWrongLastSequenceError:
                    return False
            else:
                if (stored.worker, stored.number, stored.epoch) != (self.worker, lease.number, lease.epoch):
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
