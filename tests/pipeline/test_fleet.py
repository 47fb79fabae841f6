"""A fleet of real worker processes on a real nats-server with JetStream.

Three (then four) ``vidpipe run --fleet`` processes share six ``test://`` sources;
a separate subscriber reads every message and tells the workers apart by the
``worker`` and ``lease`` fields. Placement and lease races are tested alone too.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import nats
import pytest

import pipeline.api.fleet as fleet_api
from pipeline.config import SourceConfig, SourceRefused
from pipeline.fleet.buckets import (
    BucketView,
    bucket_items,
    bucket_keys,
    bucket_name,
    bucket_stream,
    open_bucket,
    purge_markers,
)
from pipeline.fleet.desired import decode_source, encode_source
from pipeline.fleet.fence import default_worker_id
from pipeline.fleet.leases import EPOCH_KEY, LeaseTable, lease_value, parse_lease
from pipeline.fleet.placement import LiveSet, place, quotas, score
from pipeline.fleet.status import format_status, read_status
from pipeline.nats_server import EmbeddedNats, free_port
from tests.conftest import ROOT, run_cli, validate_message
from tests.support.fault_proxy import Faults, Proxy

TTL = 3.0
SOURCES = [f"cam{i}" for i in range(1, 7)]


# --- placement, alone -------------------------------------------------------------------


def test_placement_is_the_same_whatever_order_workers_and_sources_come_in() -> None:
    caps = {"w1": 10, "w2": 10, "w3": 10}
    a = place(SOURCES, caps)
    b = place(list(reversed(SOURCES)), dict(reversed(list(caps.items()))))
    assert a == b
    assert sorted(a) == SOURCES


def test_placement_gives_every_worker_a_fair_share_within_its_capacity() -> None:
    placed = place(SOURCES, {"w1": 10, "w2": 10, "w3": 10})
    assert sorted(list(placed.values()).count(w) for w in ("w1", "w2", "w3")) == [2, 2, 2]
    placed = place(SOURCES, {"w1": 1, "w2": 10, "w3": 10})
    counts = {w: list(placed.values()).count(w) for w in ("w1", "w2", "w3")}
    assert counts["w1"] == 1 and counts["w2"] + counts["w3"] == 5 and abs(counts["w2"] - counts["w3"]) <= 1
    # Over the fleet's total capacity: the rest waits, unplaced.
    placed = place(SOURCES, {"w1": 2, "w2": 2})
    assert len(placed) == 4
    shares = quotas(7, {"a": 9, "b": 9, "c": 9, "d": 1})
    assert shares["d"] == 1 and sorted(shares.values()) == [1, 2, 2, 2]


def test_a_joining_worker_takes_only_its_share_and_the_rest_stay() -> None:
    sources = [f"s{i}" for i in range(40)]
    before = place(sources, {"w1": 64, "w2": 64, "w3": 64})
    after = place(sources, {"w1": 64, "w2": 64, "w3": 64, "w4": 64})
    moved = [s for s in sources if before[s] != after[s]]
    to_new = [s for s in moved if after[s] == "w4"]
    assert list(after.values()).count("w4") == 10
    # Most moves go to the new worker; quotas shift a few among the others.
    assert len(to_new) == 10 and len(moved) <= 14


def test_a_joining_worker_takes_its_share_from_the_others_and_nothing_else_moves() -> None:
    sources = [f"s{i}" for i in range(40)]
    caps = {"w1": 64, "w2": 64, "w3": 64}
    before = place(sources, caps)
    after = place(sources, {**caps, "w4": 64}, holders=before)
    moved = sorted(s for s in sources if before[s] != after[s])
    assert len(moved) == 10 and all(after[s] == "w4" for s in moved)
    counts = sorted(list(after.values()).count(w) for w in ("w1", "w2", "w3", "w4"))
    assert counts == [10, 10, 10, 10]


def test_adding_or_removing_a_source_moves_no_other_running_source() -> None:
    caps = {"w1": 64, "w2": 64, "w3": 64}
    for count in range(1, 30):
        sources = [f"cam{i}" for i in range(count)]
        now = place(sources, caps)
        grown = place([*sources, "new"], caps, holders=now)
        assert {s: grown[s] for s in sources} == now, f"adding a source to {count} moved another"
        for gone in sources:
            rest = [s for s in sources if s != gone]
            shrunk = place(rest, caps, holders=now)
            moved = [s for s in rest if shrunk[s] != now[s]]
            # Shares stay within one of each other: at most one source moves, only to even them.
            assert len(moved) <= 1, f"removing {gone} of {count} moved {moved}"
            counts = [list(shrunk.values()).count(w) for w in caps]
            assert max(counts) - min(counts) <= 1


def test_a_holder_over_its_share_keeps_its_best_sources_and_a_dead_holder_counts_for_nothing() -> None:
    for first in range(0, 60, 6):
        sources = [f"cam{i}" for i in range(first, first + 6)]
        placed = place(sources, {"w1": 10, "w2": 10}, holders=dict.fromkeys(sources, "w1"))
        best = sorted(sources, key=lambda s: score(s, "w1"), reverse=True)
        assert sorted(s for s in sources if placed[s] == "w1") == sorted(best[:3])
    # Holders that are not live, and sources no longer desired, are ignored.
    sources = [f"cam{i}" for i in range(6)]
    ghost = {**dict.fromkeys(sources, "w9"), "removed": "w1"}
    assert place(sources, {"w1": 10, "w2": 10}, holders=ghost) == place(sources, {"w1": 10, "w2": 10})


def test_a_leaving_worker_moves_only_its_own_sources_when_shares_allow() -> None:
    sources = [f"s{i}" for i in range(12)]
    before = place(sources, {"w1": 64, "w2": 64, "w3": 64, "w4": 64})
    after = place(sources, {"w1": 64, "w2": 64, "w3": 64})
    moved = [s for s in sources if before[s] != after[s]]
    assert {s for s in sources if before[s] == "w4"} <= set(moved)
    assert all(after[s] != "w4" for s in sources)


def test_the_live_set_is_stable_only_after_it_held_still_for_its_settle_time() -> None:
    live = LiveSet(settle=1.5, handback=12.0)
    assert live.note(100.0, {"a", "b", "c"}) is False  # just changed (from nothing)
    assert live.note(101.4, {"a", "b", "c"}) is False
    assert live.note(101.5, {"a", "b", "c"}) is True
    # A worker that briefly sees its peers vanish acts on nothing until that view held still.
    assert live.note(102.0, {"a"}) is False
    assert live.note(102.5, {"a", "b", "c"}) is False  # back: another change, the clock starts again
    assert live.note(103.9, {"a", "b", "c"}) is False
    assert live.note(104.0, {"a", "b", "c"}) is True
    assert (live.members, live.since) == (frozenset({"a", "b", "c"}), 102.5)


def test_a_returning_worker_gets_sources_handed_back_only_after_a_stable_period() -> None:
    live = LiveSet(settle=1.5, handback=12.0)
    live.note(0.0, {"a", "b"})
    assert live.may_hand_to("b", 11.9) is False
    assert live.may_hand_to("b", 12.0) is True
    live.note(20.0, {"a"})  # b partitioned away
    live.note(30.0, {"a", "b"})  # healed: b's first heartbeat is back
    assert live.may_hand_to("b", 30.0) is False
    live.note(35.0, {"a"})  # a second outage before the period is over: it starts again
    live.note(36.0, {"a", "b"})
    assert live.may_hand_to("b", 47.9) is False
    assert live.may_hand_to("b", 48.0) is True
    assert live.may_hand_to("c", 100.0) is False  # never seen alive


# --- leases against a real JetStream ---------------------------------------------------


async def test_concurrent_claims_of_one_source_let_exactly_one_worker_win(nats_server: EmbeddedNats) -> None:
    conns = [await nats.connect(nats_server.url) for _ in range(5)]
    try:
        kvs = [await open_bucket(nc.jetstream(), "race", "leases") for nc in conns]
        tables = [LeaseTable(kv, f"w{i}", TTL) for i, kv in enumerate(kvs)]
        results = await asyncio.gather(*(t.claim("cam1") for t in tables))
        winners = [r for r in results if r is not None]
        assert len(winners) == 1
        entry = await kvs[0].get("cam1")
        assert entry.value is not None
        stored = parse_lease(entry.value)
        assert (stored.worker, stored.number) == (winners[0].worker, winners[0].number)
    finally:
        for nc in conns:
            await nc.close()


async def test_a_takeover_fences_the_old_holder_out_of_renew_and_release(nats_server: EmbeddedNats) -> None:
    nc = await nats.connect(nats_server.url)
    try:
        kv = await open_bucket(nc.jetstream(), "race", "leases")
        old_table, new_table, late_table = (LeaseTable(kv, w, TTL) for w in ("old", "new", "late"))
        old = await old_table.claim("cam1")
        assert old is not None and old.valid()
        # Two workers saw the same stale revision; only one takeover lands.
        taken = await asyncio.gather(
            new_table.claim("cam1", last=old.revision), late_table.claim("cam1", last=old.revision)
        )
        assert sum(t is not None for t in taken) == 1
        new = next(t for t in taken if t is not None)
        assert new.number > old.number
        assert await old_table.renew(old) is False
        assert await old_table.release(old) is False and old.fenced and not old.valid()
        entry = await kv.get("cam1")
        assert entry.value is not None and parse_lease(entry.value).worker == new.worker
        assert await new_table.renew(new) is True
        assert await new_table.release(new) is True
        again = await old_table.claim("cam1")
        assert again is not None and again.number > new.number
    finally:
        await nc.close()


async def test_a_lease_not_renewed_stops_being_valid_before_others_may_take_it(
    nats_server: EmbeddedNats,
) -> None:
    nc = await nats.connect(nats_server.url)
    try:
        kv = await open_bucket(nc.jetstream(), "race", "leases")
        table = LeaseTable(kv, "w", 1.0)
        sent = time.monotonic()
        lease = await table.claim("cam1")
        assert lease is not None
        # Valid now; invalid once ttl minus the margin has passed since the request left.
        assert lease.valid()
        assert sent + 1.0 - table.margin <= lease.deadline < time.monotonic() + 1.0
        await asyncio.sleep(lease.deadline - time.monotonic() + 0.01)
        assert not lease.valid()
    finally:
        await nc.close()


async def test_a_bucket_lists_every_key_in_one_request_and_old_markers_are_purged(
    nats_server: EmbeddedNats,
) -> None:
    nc = await nats.connect(nats_server.url)
    try:
        js = nc.jetstream()
        kv = await open_bucket(js, "keys", "sources")
        name = bucket_name("keys", "sources")
        assert await bucket_keys(js, name) == []
        await kv.put("a", b"1")
        await kv.put("b", b"2")
        await kv.delete("b")
        await kv.put("c", b"3")
        await kv.purge("c")
        await kv.put("d", b"4")
        await kv.delete("d")
        await kv.put("d", b"5")  # back after a removal: a value again, never purged
        assert await bucket_keys(js, name) == ["a", "b", "c", "d"]
        assert await bucket_items(js, kv, name) == {"a": b"1", "d": b"5"}
        assert await purge_markers(js, name, older_than=3600) == []  # too young
        assert await purge_markers(js, name, older_than=0) == ["b", "c"]
        assert await bucket_keys(js, name) == ["a", "d"]
        assert (await kv.get("d")).value == b"5"
    finally:
        await nc.close()


async def test_a_view_is_ready_only_once_it_holds_every_key_of_the_bucket(nats_server: EmbeddedNats) -> None:
    # A worker releases an owned source missing from its view of the desired set: a view
    # that called itself ready with part of the bucket would stop sources that are wanted.
    nc = await nats.connect(nats_server.url)
    try:
        js = nc.jetstream()
        kv = await open_bucket(js, "many", "sources")
        filler = "x" * 400  # the initial values then span many reads of the connection
        for i in range(1500):
            await kv.put(f"cam{i:04d}", f"{i}{filler}".encode())
        await kv.delete("cam0007")
        for _ in range(3):
            view = BucketView(js, kv, bucket_name("many", "sources"))
            await view.start()
            try:
                assert len(view.entries) == 1499
                assert "cam0007" not in view.entries
                assert view.entries["cam1499"].value.startswith(b"1499x")
            finally:
                await view.stop()
        # The last message, the removal's marker, purged: the stream's last sequence now
        # names a message no watcher delivers, and the view must not wait for it.
        assert await purge_markers(js, bucket_name("many", "sources"), older_than=0) == ["cam0007"]
        view = BucketView(js, kv, bucket_name("many", "sources"))
        await view.start(timeout=10.0)
        assert len(view.entries) == 1499
        # Watching again returns at once (the worker's renewals wait on it), whole later.
        await view.restart(kv)
        assert not view.ready.is_set() and view.entries == {}
        await view.ready.wait()
        assert len(view.entries) == 1499
        await view.stop()
        empty = BucketView(js, await open_bucket(js, "none", "sources"), bucket_name("none", "sources"))
        await empty.start()  # nothing to wait for
        assert empty.entries == {}
        await empty.stop()
    finally:
        await nc.close()


async def test_a_lease_given_up_at_its_deadline_is_deleted_so_no_one_waits_a_ttl(
    nats_server: EmbeddedNats,
) -> None:
    nc = await nats.connect(nats_server.url)
    try:
        kv = await open_bucket(nc.jetstream(), "race", "leases")
        mine, theirs = LeaseTable(kv, "w1", TTL), LeaseTable(kv, "w2", TTL)
        gone = await mine.claim("cam1")
        taken = await mine.claim("cam2")
        assert gone is not None and taken is not None
        # A renewal that timed out here but landed later (queued across a reconnect).
        assert await mine.renew(gone)
        stolen = await theirs.claim("cam2", last=taken.revision)
        assert stolen is not None
        for lease in (gone, taken):
            lease.fenced = True
            mine.abandon(lease)
        assert await mine.withdraw_unconfirmed() == 1
        items = await bucket_items(nc.jetstream(), kv, bucket_name("race", "leases"))
        assert list(items) == ["cam2"]  # ours deleted; the other worker's claim kept
        assert parse_lease((await kv.get("cam2")).value or b"").worker == "w2"
        assert mine.abandoned == {}
    finally:
        await nc.close()


# --- the fleet as processes ------------------------------------------------------------


@dataclass
class Seen:
    """Every message the outside subscriber got, with the local time it arrived."""

    messages: list[tuple[float, dict[str, Any]]] = field(default_factory=list)

    def since(self, t: float) -> list[tuple[float, dict[str, Any]]]:
        return [(at, m) for at, m in self.messages if at >= t]

    def owners(self, window: float = 1.0) -> dict[str, str]:
        """The worker that published each source's latest message within ``window`` seconds."""
        cutoff = time.monotonic() - window
        out: dict[str, str] = {}
        for at, m in self.messages:
            if at >= cutoff:
                out[m["source"]] = m["worker"]
        return out

    def first_from_other(self, source: str, worker: str, after: float) -> float | None:
        for at, m in self.messages:
            if at >= after and m["source"] == source and m["worker"] != worker:
                return at
        return None


@dataclass
class Worker:
    proc: subprocess.Popen[bytes]
    http: int
    log: Path

    @property
    def id(self) -> str:
        return default_worker_id().rsplit("-", 1)[0] + f"-{self.proc.pid}"


class Fleet:
    def __init__(self, url: str, config: Path, tmp: Path) -> None:
        self.url = url
        self.config = config
        self.tmp = tmp
        self.workers: list[Worker] = []

    def start_worker(self) -> Worker:
        port = free_port()
        log = self.tmp / f"worker-{len(self.workers)}.log"
        proc = subprocess.Popen(
            [sys.executable, "-m", "pipeline.cli", "run", str(self.config), "--fleet", "cams",
             "--nats", self.url, "--http", f"127.0.0.1:{port}"],
            cwd=ROOT, stdout=log.open("wb"), stderr=subprocess.STDOUT,
        )  # fmt: skip
        worker = Worker(proc, port, log)
        self.workers.append(worker)
        return worker

    def by_id(self, wid: str) -> Worker:
        return next(w for w in self.workers if w.id == wid)

    def stop(self) -> None:
        for w in self.workers:
            if w.proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(w.proc.pid, signal.SIGCONT)
                w.proc.kill()
                w.proc.wait()


@pytest.fixture
async def seen(nats_server: EmbeddedNats) -> AsyncIterator[Seen]:
    result = Seen()
    nc = await nats.connect(nats_server.url)

    async def on_msg(msg: Any) -> None:
        result.messages.append((time.monotonic(), json.loads(msg.data)))

    await nc.subscribe("vidpipe.fleet.*.detections", cb=on_msg)
    await nc.flush()
    yield result
    await nc.close()


@pytest.fixture
def fleet(nats_server: EmbeddedNats, tmp_path: Path) -> Any:
    config = tmp_path / "fleet.yaml"
    lines = ["pipeline: fleet", f"fleet: {{name: cams, lease_ttl: {TTL:g}}}", "sources:"]
    lines += [f"  - url: test://?id={s}&width=64&height=48&fps=20" for s in SOURCES]
    config.write_text("\n".join(lines) + "\n")
    f = Fleet(nats_server.url, config, tmp_path)
    try:
        yield f
    finally:
        f.stop()


async def settle(
    seen: Seen, want: dict[str, int] | None, n_workers: int, timeout: float = 30.0
) -> dict[str, str]:
    """Until every source publishes, from ``n_workers`` workers, and owners held still for 1.5 s."""
    deadline = time.monotonic() + timeout
    last: dict[str, str] = {}
    still_since = time.monotonic()
    while time.monotonic() < deadline:
        await asyncio.sleep(0.25)
        owners = seen.owners(0.6)
        if owners != last:
            last, still_since = owners, time.monotonic()
            continue
        counts = sorted(list(owners.values()).count(w) for w in set(owners.values()))
        if (
            sorted(owners) == SOURCES
            and len(set(owners.values())) == n_workers
            and (want is None or counts == sorted(want.values()))
            and time.monotonic() - still_since >= 1.5
        ):
            return owners
    raise AssertionError(f"fleet did not settle: {last}")


def owner_changes(seen: Seen, source: str, after: float) -> list[str]:
    """The sequence of distinct consecutive workers that published ``source`` after ``after``."""
    seq: list[str] = []
    for _, m in seen.since(after):
        if m["source"] == source and (not seq or seq[-1] != m["worker"]):
            seq.append(m["worker"])
    return seq


async def test_a_fleet_runs_each_source_once_and_survives_kill_pause_drain_and_join(
    fleet: Fleet, seen: Seen, nats_server: EmbeddedNats
) -> None:
    a, b, c = fleet.start_worker(), fleet.start_worker(), fleet.start_worker()
    owners = await settle(seen, {"x": 2, "y": 2, "z": 2}, 3)
    assert set(owners.values()) == {a.id, b.id, c.id}

    # Each source is published by exactly one worker while nothing changes.
    t0 = time.monotonic()
    await asyncio.sleep(2.0)
    window = seen.since(t0)
    for source in SOURCES:
        workers = {m["worker"] for _, m in window if m["source"] == source}
        assert workers == {owners[source]}, (source, workers)
    for _, m in window[:20]:
        validate_message(m)
        assert isinstance(m["lease"], int) and m["lease"] >= 1

    # /v1/fleet on any worker names the same owners; `vidpipe fleet list` too.
    with urllib.request.urlopen(f"http://127.0.0.1:{b.http}/v1/fleet", timeout=5) as r:
        status = json.load(r)
    assert {s["id"]: s["owner"] for s in status["sources"]} == owners
    assert {w["id"] for w in status["workers"] if w["alive"]} == {a.id, b.id, c.id}
    assert all(w["version"] and w["load"] == 2 for w in status["workers"])
    listed = await asyncio.to_thread(
        run_cli, "fleet", "list", "--nats", nats_server.url, "--fleet", "cams", "--json", timeout=60
    )
    assert listed.returncode == 0, listed.stderr
    assert {s["id"]: s["owner"] for s in json.loads(listed.stdout)["sources"]} == owners

    # A 4th worker joins: it takes its share, and each moved source moves once.
    t_join = time.monotonic()
    d = fleet.start_worker()
    owners = await settle(seen, {"w": 2, "x": 2, "y": 1, "z": 1}, 4)
    assert 1 <= list(owners.values()).count(d.id) <= 2
    for source in SOURCES:
        assert len(owner_changes(seen, source, t_join)) <= 2, (source, owner_changes(seen, source, t_join))

    # kill -9: its sources resume on the others within lease_ttl + 2 s.
    victim = a if a.id in owners.values() else b
    lost = [s for s, w in owners.items() if w == victim.id]
    t_kill = time.monotonic()
    victim.proc.kill()
    await asyncio.sleep(TTL + 2.0)
    for source in lost:
        resumed = seen.first_from_other(source, victim.id, t_kill)
        assert resumed is not None and resumed - t_kill <= TTL + 2.0, (source, resumed and resumed - t_kill)
    owners = await settle(seen, None, 3)

    # SIGSTOP past the TTL, then SIGCONT: nothing more under its old leases once taken over.
    paused = next(w for w in fleet.workers if w.proc.poll() is None and w.id in owners.values())
    taken = {s for s, w in owners.items() if w == paused.id}
    old_lease = {m["source"]: m["lease"] for _, m in seen.messages if m["worker"] == paused.id}
    t_stop = time.monotonic()
    os.kill(paused.proc.pid, signal.SIGSTOP)
    await asyncio.sleep(TTL + 2.5)
    takeover = {s: seen.first_from_other(s, paused.id, t_stop) for s in taken}
    assert all(t is not None for t in takeover.values()), takeover
    os.kill(paused.proc.pid, signal.SIGCONT)
    await asyncio.sleep(3.0)
    stale = [
        m for at, m in seen.messages
        if m["worker"] == paused.id and m["source"] in taken
        and m["lease"] == old_lease[m["source"]] and at >= (takeover[m["source"]] or 0)
    ]  # fmt: skip
    assert stale == []
    owners = await settle(seen, None, 3)

    # SIGTERM: a drain hands its sources over within 3 s, and the worker exits 0.
    leaving = next(w for w in fleet.workers if w.proc.poll() is None and w.id in owners.values())
    moving = [s for s, w in owners.items() if w == leaving.id]
    t_term = time.monotonic()
    leaving.proc.send_signal(signal.SIGTERM)
    assert leaving.proc.wait(timeout=15) == 0
    await asyncio.sleep(max(0.0, t_term + 3.0 - time.monotonic()))
    for source in moving:
        moved = seen.first_from_other(source, leaving.id, t_term)
        assert moved is not None and moved - t_term <= 3.0, (source, moved and moved - t_term)

    # The desired set changes from the CLI: a 7th source starts somewhere, then stops, and
    # no running source moves for it (a move resets its tracks and cuts its recordings).
    owners = await settle(seen, None, sum(1 for w in fleet.workers if w.proc.poll() is None))
    t_before = time.monotonic()
    added = await asyncio.to_thread(run_cli, "fleet", "add", "test://?id=cam7&width=64&height=48&fps=20",
                                    "--nats", nats_server.url, "--fleet", "cams", timeout=60)  # fmt: skip
    assert added.returncode == 0, added.stderr
    t_add = time.monotonic()
    while not any(m["source"] == "cam7" for _, m in seen.since(t_add)):
        assert time.monotonic() - t_add < 10, "cam7 never published"
        await asyncio.sleep(0.1)
    removed = await asyncio.to_thread(
        run_cli, "fleet", "remove", "cam7", "--nats", nats_server.url, "--fleet", "cams", timeout=60
    )
    assert removed.returncode == 0, removed.stderr
    await asyncio.sleep(2.0)
    t_gone = time.monotonic()
    await asyncio.sleep(1.0)
    assert not any(m["source"] == "cam7" for _, m in seen.since(t_gone))
    assert {s: owner_changes(seen, s, t_before) for s in SOURCES} == {s: [owners[s]] for s in SOURCES}

    for w in fleet.workers:
        if w.proc.poll() is None:
            w.proc.send_signal(signal.SIGTERM)
    for w in fleet.workers:
        if w is not victim:
            assert w.proc.wait(timeout=15) == 0, w.log.read_text()[-2000:]


# --- one worker in process: the API in a fleet -----------------------------------------


async def test_sources_api_changes_the_fleet_desired_set_and_v1_fleet_shows_owners(
    nats_server: EmbeddedNats, tmp_path: Path
) -> None:
    import aiohttp

    from pipeline.api import ApiServer
    from pipeline.config import HttpConfig, load_config
    from pipeline.fleet.worker import FleetWorker
    from pipeline.runtime import Runtime

    path = tmp_path / "one.yaml"
    path.write_text(
        "pipeline: fleet\nfleet: {name: api, lease_ttl: 2, worker_id: only}\n"
        "sources:\n  - url: test://?id=cam1&width=64&height=48&fps=20\n"
    )
    cfg = load_config(path)
    assert cfg.fleet is not None and cfg.fleet.lease_ttl == 2 and cfg.fleet.worker_id == "only"
    runtime = Runtime(cfg, nats_url=nats_server.url)
    await runtime.prepare()
    fleet = FleetWorker(runtime, cfg.fleet, nats_server.url)
    await fleet.start()
    api = ApiServer(runtime, HttpConfig(listen="127.0.0.1:0"), fleet=fleet)
    await api.start()

    async def until(check: Any, what: str) -> None:
        deadline = time.monotonic() + 10
        while not check():
            assert time.monotonic() < deadline, what
            await asyncio.sleep(0.05)

    try:
        await until(lambda: "cam1" in runtime.sources, "the config's source never started")
        async with aiohttp.ClientSession() as http:
            body = {"url": "test://?width=64&height=48&fps=20", "id": "cam2"}
            async with http.post(f"{api.url}/v1/sources", json=body) as r:
                assert r.status == 202
                assert await r.json() == {"id": "cam2", "fleet": "api", "desired": True}
            async with http.post(f"{api.url}/v1/sources", json=body) as r:
                assert r.status == 409
                assert "already exists in fleet api" in (await r.json())["error"]
            await until(lambda: "cam2" in runtime.sources, "cam2 never started")
            async with http.get(f"{api.url}/v1/fleet") as r:
                status = await r.json()
            assert status["workers"] == [
                {"id": "only", "alive": True, "load": 2, "capacity": 64, "version": fleet.version}
            ]
            assert [(s["id"], s["owner"], s["placed_on"]) for s in status["sources"]] == [
                ("cam1", "only", "only"),
                ("cam2", "only", "only"),
            ]
            assert all(s["lease"] >= 1 and s["owned_since"] > 0 for s in status["sources"])
            async with http.delete(f"{api.url}/v1/sources/cam2") as r:
                assert r.status == 204
            async with http.delete(f"{api.url}/v1/sources/cam2") as r:
                assert r.status == 404
            await until(
                lambda: "cam2" not in runtime.sources and "cam2" not in fleet.owned, "cam2 kept running"
            )
            async with http.get(f"{api.url}/metrics") as r:
                metrics = await r.text()
        assert 'vidpipe_fleet_takeovers_total{fleet="api",reason="new"} 2.0' in metrics
        assert 'vidpipe_fleet_releases_total{fleet="api",reason="removed"} 1.0' in metrics
        assert 'vidpipe_fleet_sources_owned{fleet="api"} 1.0' in metrics
        assert 'vidpipe_fleet_lease_renew_seconds_count{fleet="api"}' in metrics
    finally:
        await api.stop()
        await fleet.stop()
        await runtime.stop()
    # The drain released every lease: nothing is left for anyone to wait out.
    nc = await nats.connect(nats_server.url)
    try:
        kv = await open_bucket(nc.jetstream(), "api", "leases")
        items = await bucket_items(nc.jetstream(), kv, bucket_name("api", "leases"))
        assert list(items) == [EPOCH_KEY]  # the bucket's epoch, no lease
    finally:
        await nc.close()


# --- one worker in process: the store is shared, lossy and untrusted ----------------------


@contextlib.asynccontextmanager
async def one_worker(
    url: str,
    tmp_path: Path,
    sources: list[str],
    *,
    fleet: str = "solo",
    worker_id: str = "only",
    refuse: set[str] | None = None,
) -> AsyncIterator[Any]:
    """A worker (runtime, fleet worker and API) in this process, lease_ttl 2 s.

    ``refuse``: source ids this host cannot start (its runtime raises for them, as for a
    file it does not have), for as long as the set holds them.
    """
    from pipeline.api import ApiServer
    from pipeline.config import HttpConfig, load_config
    from pipeline.fleet.worker import FleetWorker
    from pipeline.runtime import Runtime

    path = tmp_path / f"{worker_id}.yaml"
    lines = ["pipeline: fleet", f"fleet: {{name: {fleet}, lease_ttl: 2, worker_id: {worker_id}}}", "sources:"]
    # An id, or a whole URL (one with "://", or a file path).
    lines += [
        f"  - url: {s}" if "://" in s or "/" in s else f"  - url: test://?id={s}&width=64&height=48&fps=20"
        for s in sources
    ]
    path.write_text("\n".join(lines) + "\n")
    cfg = load_config(path)
    assert cfg.fleet is not None
    runtime = Runtime(cfg, nats_url=url)
    await runtime.prepare()
    if refuse is not None:
        add_source = runtime.add_source

        def add_or_refuse(config: Any) -> Any:
            if config.source_id in refuse:
                raise RuntimeError(f"{config.source_id} is not on this host")
            return add_source(config)

        runtime.add_source = add_or_refuse  # type: ignore[method-assign]
    worker = FleetWorker(runtime, cfg.fleet, url)
    await worker.start()
    api = ApiServer(runtime, HttpConfig(listen="127.0.0.1:0"), fleet=worker)
    await api.start()
    try:
        yield worker, api
    finally:
        await api.stop()
        await worker.stop()
        await runtime.stop()


async def until(check: Any, what: str, timeout: float = 15.0) -> None:
    """Until ``check()`` holds (polled on the loop), or fail saying ``what``."""
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, what
        await asyncio.sleep(0.05)


def fence(m: dict[str, Any]) -> tuple[int, int]:
    return (m["epoch"], m["lease"])


async def test_the_fence_grows_across_a_deleted_lease_bucket_and_the_consumer_rule_drops_nothing(
    nats_server: EmbeddedNats, tmp_path: Path
) -> None:
    messages: list[dict[str, Any]] = []
    nc = await nats.connect(nats_server.url)

    async def on_msg(msg: Any) -> None:
        messages.append(json.loads(msg.data))

    await nc.subscribe("vidpipe.fleet.*.detections", cb=on_msg)
    try:
        async with one_worker(nats_server.url, tmp_path, ["cam1", "cam2"]) as (worker, _):
            await until(lambda: {m["source"] for m in messages} == {"cam1", "cam2"}, "never published")
            before = {m["source"]: fence(m) for m in messages}
            assert all(e >= 1 and n >= 2 for e, n in before.values())  # revision 1 is the epoch
            validate_message(messages[-1])
            seen_before = len(messages)
            await nc.jetstream().delete_key_value("vidpipe_fleet_solo_leases")
            # The worker opens the bucket again with a larger epoch and claims anew.
            await until(
                lambda: (
                    {m["source"] for m in messages[seen_before:] if fence(m)[0] > before[m["source"]][0]}
                    == {"cam1", "cam2"}
                ),
                "sources never resumed under a new epoch",
                timeout=20,
            )
            assert worker.metrics.buckets_recreated.labels("solo", "leases")._value.get() == 1
        # The documented consumer rule: keep the highest (epoch, lease) per source, drop below it.
        highest: dict[str, tuple[int, int]] = {}
        dropped = 0
        for m in messages:
            if fence(m) < highest.get(m["source"], (0, 0)):
                dropped += 1
            else:
                highest[m["source"]] = fence(m)
        assert dropped == 0
        after = [fence(m) for m in messages[seen_before:] if fence(m)[0] > before[m["source"]][0]]
        assert all(f > max(before.values()) for f in after)
    finally:
        await nc.close()


async def test_events_carry_the_worker_and_the_fence(nats_server: EmbeddedNats) -> None:
    from pipeline.config import NatsConfig
    from pipeline.events import Event
    from pipeline.metrics import Metrics
    from pipeline.stages.publish import Publisher

    class Owner:
        def may_publish(self, source: str) -> bool:
            return source == "cam1"

        def owner(self, source: str) -> tuple[str, int, int] | None:
            return ("w1", 7, 42)

    got: list[dict[str, Any]] = []
    nc = await nats.connect(nats_server.url)
    arrived = asyncio.Event()

    async def on_msg(msg: Any) -> None:
        got.append(json.loads(msg.data))
        arrived.set()

    await nc.subscribe("vidpipe.p.*.events", cb=on_msg)
    await nc.flush()
    publisher = Publisher(NatsConfig(), nats_server.url, "p", Metrics(), fence=Owner())
    await publisher.connect()
    try:
        event = Event("track_start", 3, 0.1, time.time(), 5, "person", (1.0, 2.0, 3.0, 4.0))
        await publisher.publish_events("cam2", [event], "s", "3")  # fenced: not ours
        await publisher.publish_events("cam1", [event], "s", "3")
        await asyncio.wait_for(arrived.wait(), 5)
        assert [(m["source"], m["worker"], m["epoch"], m["lease"]) for m in got] == [("cam1", "w1", 7, 42)]
        import jsonschema

        from pipeline.events import events_schema

        jsonschema.validate(got[0], events_schema())
    finally:
        await publisher.close()
        await nc.close()


async def test_a_removed_source_stays_removed_and_a_wiped_set_is_seeded_again(
    nats_server: EmbeddedNats, tmp_path: Path
) -> None:
    # Bounded inside the test so that, should an await never return, the traceback names it.
    async with asyncio.timeout(120):
        await removed_stays_removed(nats_server, tmp_path)


async def removed_stays_removed(nats_server: EmbeddedNats, tmp_path: Path) -> None:
    async with one_worker(nats_server.url, tmp_path, ["cam1", "cam2"]) as (worker, _):
        await until(lambda: set(worker.owned) == {"cam1", "cam2"}, "never took both")
        assert worker.desired is not None and await worker.desired.remove("cam2")
        await until(lambda: set(worker.owned) == {"cam1"}, "cam2 kept running")
    # A worker starting with the same file does not bring cam2 back.
    async with one_worker(nats_server.url, tmp_path, ["cam1", "cam2"], worker_id="next") as (worker, _):
        await until(lambda: set(worker.owned) == {"cam1"}, "cam1 never resumed")
        assert worker.desired is not None
        desired = worker.desired
        assert list(await bucket_items(desired.js, desired.kv, desired.bucket)) == ["=seeded", "cam1"]
        # The whole desired set is lost: the worker makes the bucket again and seeds it.
        js = worker._nc.jetstream()
        await js.delete_key_value("vidpipe_fleet_solo_sources")
        await until(lambda: set(worker.owned) == {"cam1", "cam2"}, "the set was never seeded again", 20)
        assert worker.metrics.buckets_recreated.labels("solo", "sources")._value.get() == 1


async def test_a_file_the_workers_own_pipeline_file_names_runs_in_the_fleet(
    nats_server: EmbeddedNats, tmp_path: Path
) -> None:
    # The worker seeds its file's sources; the API's file_roots (none by default) refused
    # the file it had seeded itself, and the fleet ran nothing.
    from samples.make_clip import write_clip

    clip = write_clip(tmp_path / "clips" / "door.mp4", frames=5, width=64, height=48)
    async with asyncio.timeout(60), one_worker(nats_server.url, tmp_path, [str(clip)]) as (worker, _):
        await until(lambda: worker.runtime.sources.get("door") is not None, "the file never started")
        run = worker.runtime.sources["door"]
        await until(lambda: run.published == 5, "the file's frames were not all published")
        # A file the pipeline file does not name is still held to http.file_roots.
        assert worker.desired is not None
        other = write_clip(tmp_path / "clips" / "other.mp4", frames=2, width=64, height=48)
        with pytest.raises(SourceRefused, match=r"http\.file_roots"):
            decode_source(
                "other", encode_source(SourceConfig(url=str(other), id="other")), *worker._source_policy()
            )


async def test_an_update_restarts_the_owned_source_and_an_invalid_one_is_refused(
    nats_server: EmbeddedNats, tmp_path: Path
) -> None:
    import aiohttp

    async with one_worker(nats_server.url, tmp_path, []) as (worker, api):
        async with aiohttp.ClientSession() as http:
            body = {"url": "test://?width=64&height=48&fps=20", "id": "cam9"}
            async with http.post(f"{api.url}/v1/sources", json=body) as r:
                assert r.status == 202
            await until(lambda: "cam9" in worker.runtime.sources, "cam9 never started")
            # DELETE then POST with new settings: the owner runs the new ones.
            async with http.delete(f"{api.url}/v1/sources/cam9") as r:
                assert r.status == 204
            body["url"] = "test://?width=96&height=48&fps=20"
            async with http.post(f"{api.url}/v1/sources", json=body) as r:
                assert r.status == 202
            await until(
                lambda: (
                    "cam9" in worker.runtime.sources
                    and "width=96" in worker.runtime.sources["cam9"].config.url
                ),
                "the owner kept the old settings",
            )
            # Settings no source accepts: refused at the door, as on a single host.
            bad = {"url": "test://?width=1&height=48&fps=20", "id": "cam10"}
            async with http.post(f"{api.url}/v1/sources", json=bad) as r:
                assert r.status == 400
                assert "test:// parameter width=1 is out of range" in (await r.json())["error"]
        assert "cam10" not in worker.desired_ids()


async def test_the_desired_set_is_capped(
    nats_server: EmbeddedNats, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import aiohttp

    monkeypatch.setattr(fleet_api, "VIEW_WAIT_S", 0.2)

    async with one_worker(nats_server.url, tmp_path, ["cam1"]) as (worker, api):
        worker.max_desired = 1
        async with aiohttp.ClientSession() as http:
            body = {"url": "test://?width=64&height=48&fps=20"}
            async with http.post(f"{api.url}/v1/sources", json=body) as r:
                assert r.status == 429
                assert "holds 1 sources (fleet.max_desired)" in (await r.json())["error"]
            # While the view of the set is being read again it holds part of it (here:
            # nothing) and is not ready: the cap and a derived id are not judged on it.
            view = worker._views["sources"]
            view.ready.clear()
            view.entries.clear()
            for request in (body, {**body, "id": "cam2"}):
                async with http.post(f"{api.url}/v1/sources", json=request) as r:
                    assert r.status == 503
                    assert r.headers["Retry-After"] == "5"
                    assert (await r.json())["error"] == (
                        f"fleet {worker.name}: this worker is still reading the desired sources "
                        "(after a reconnect to NATS); retry in a few seconds"
                    )
            # Read again whole, the cap holds.
            await view.restart(view.kv)
            async with http.post(f"{api.url}/v1/sources", json={**body, "id": "cam2"}) as r:
                assert r.status == 429
        assert sorted(worker.desired_ids()) == ["cam1"]


async def test_a_repeated_whip_name_and_a_change_while_nats_is_down_are_refused(tmp_path: Path) -> None:
    import aiohttp

    server = EmbeddedNats().start()  # its own: this test stops it
    try:
        async with (
            one_worker(server.url, tmp_path, ["cam1"]) as (worker, api),
            aiohttp.ClientSession() as http,
        ):
            async with http.post(f"{api.url}/v1/sources", json={"url": "whip://door"}) as r:
                assert r.status == 202
            await until(lambda: "door" in worker.desired_ids(), "door in the desired set")
            # Publishers reach a WHIP source by its name: a second one would never be reached.
            async with http.post(f"{api.url}/v1/sources", json={"url": "whip://door", "id": "back"}) as r:
                assert r.status == 409
                assert (await r.json())["error"] == (
                    "sources.url: whip name 'door' is already used by source 'door' in fleet solo; "
                    "give this publisher another name"
                )
            server.stop()
            await until(lambda: not worker.connected, "the worker saw NATS go")
            # Nothing to change the set with: 503 and when to try again, never a 500.
            for method, path, body in (
                ("POST", "/v1/sources", {"url": "test://?id=cam2&width=64&height=48&fps=20"}),
                ("DELETE", "/v1/sources/cam1", None),
            ):
                async with http.request(method, f"{api.url}{path}", json=body) as r:
                    assert (r.status, r.headers.get("Retry-After")) == (503, "5"), method
                    assert (await r.json())["error"] == (
                        "fleet solo: NATS is not connected; retry once it is back"
                    )
    finally:
        server.stop()
    assert sorted(worker.desired_ids()) == ["cam1", "door"]


def test_replicas_over_one_on_a_server_without_a_cluster_is_refused_at_once(
    nats_server: EmbeddedNats, tmp_path: Path
) -> None:
    config = tmp_path / "r3.yaml"
    config.write_text(
        "pipeline: r3\nfleet: {name: r3, replicas: 3}\nsources:\n"
        "  - url: test://?id=cam1&width=64&height=48&fps=20\n"
    )
    refused = (
        f"vidpipe: fleet r3: fleet.replicas is 3, but the NATS server at {nats_server.url} runs "
        "JetStream without a cluster, which keeps one copy of each bucket: set fleet.replicas: 1, "
        "or give --nats the servers of a JetStream cluster of 3 or more nodes"
    )
    # Before, it retried for 30 s, then blamed JetStream being off.
    done = run_cli("run", str(config), "--nats", nats_server.url, timeout=25)
    assert done.returncode == 1, done.stderr
    assert done.stderr.strip().splitlines()[-1] == refused
    # The fleet's buckets made beforehand with one copy (`fleet add`): refused the same way,
    # not run on one copy.
    url = "test://?id=cam1&width=64&height=48&fps=20"
    added = run_cli("fleet", "add", url, "--nats", nats_server.url, "--fleet", "r3")
    assert added.returncode == 0, added.stderr
    done = run_cli("run", str(config), "--nats", nats_server.url, timeout=25)
    assert done.returncode == 1, done.stderr
    assert done.stderr.strip().splitlines()[-1] == refused


async def test_a_bucket_made_with_one_copy_gets_fleet_replicas_copies_on_a_cluster(tmp_path: Path) -> None:
    from bench.fleet import Cluster

    cluster = Cluster(tmp_path)
    cluster.start()
    try:
        await cluster.ready()
        urls = ",".join(cluster.urls)
        url = "test://?id=cam1&width=64&height=48&fps=20"
        added = await asyncio.to_thread(run_cli, "fleet", "add", url, "--nats", urls, "--fleet", "grow")
        assert added.returncode == 0, added.stderr
        nc = await nats.connect(servers=cluster.urls)
        try:
            js = nc.jetstream()
            stream = bucket_stream(bucket_name("grow", "sources"))
            assert (await js.stream_info(stream)).config.num_replicas == 1  # what fleet add made
            kv = await open_bucket(js, "grow", "sources", replicas=3)
            assert (await js.stream_info(stream)).config.num_replicas == 3
            deadline = time.monotonic() + 30
            while True:  # the new copies catch up: a leader and two current followers
                info = (await js.stream_info(stream)).cluster
                followers = [p for p in (info.replicas or []) if p.current] if info else []
                if info is not None and info.leader and len(followers) == 2:
                    break
                assert time.monotonic() < deadline, info
                await asyncio.sleep(0.2)
            assert (await kv.get("cam1")).value is not None  # the set is kept
        finally:
            await nc.close()
    finally:
        cluster.stop()


async def test_a_whip_publisher_at_the_wrong_worker_is_told_which_worker_runs_its_source(
    nats_server: EmbeddedNats, tmp_path: Path
) -> None:
    import aiohttp

    offer = {"data": "v=0\r\n", "headers": {"Content-Type": "application/sdp"}}
    async with (
        one_worker(nats_server.url, tmp_path, [], fleet="pub", worker_id="w1", refuse={"door"}) as (w1, api1),
        aiohttp.ClientSession() as http,
    ):
        async with http.post(f"{api1.url}/v1/sources", json={"url": "whip://door"}) as r:
            assert r.status == 202
        await until(lambda: "door" in w1.desired_ids(), "door in the desired set")
        # Desired, but no worker can run it: not there yet, worth a retry.
        async with http.post(f"{api1.url}/whip/door", **offer) as r:
            assert (r.status, r.headers.get("Retry-After")) == (503, "2")
            assert (await r.json())[
                "error"
            ] == "whip://door (source 'door') of fleet pub is not running yet; retry"
        async with one_worker(nats_server.url, tmp_path, [], fleet="pub", worker_id="w2") as (w2, _):
            await until(lambda: "door" in w2.owned, "w2 never took door", timeout=30)
            await until(lambda: w1.holders().get("door") == "w2", "w1 never saw w2's lease")
            async with http.post(f"{api1.url}/whip/door", **offer) as r:
                assert r.status == 404
                assert (await r.json())["error"] == (
                    "whip://door (source 'door') of fleet pub runs on worker 'w2', not this one: "
                    "publish there (GET /v1/fleet lists who runs what)"
                )
        async with http.post(f"{api1.url}/whip/window", **offer) as r:
            assert r.status == 404
            assert (await r.json())["error"] == "no whip:// source named 'window'"


async def test_a_nats_outage_is_one_log_line_per_interval_not_one_per_reconnect_attempt(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    server = EmbeddedNats().start()  # its own: this test stops it
    try:
        with caplog.at_level("DEBUG"):
            async with one_worker(server.url, tmp_path, ["cam1"]) as (worker, _):
                server.stop()
                # Reconnect attempts fail four times a second; wait for several of them.
                await until(lambda: worker._errors._last.get("nats", (0, 0))[1] >= 5, "failed reconnects")
    finally:
        server.stop()
    said = [
        r.getMessage() for r in caplog.records if r.name == "vidpipe.fleet" and "NATS at" in r.getMessage()
    ]
    assert len(said) == 1, said
    assert said[0].startswith(f"fleet solo: NATS at {server.url}: "), said
    assert not [r for r in caplog.records if r.getMessage() == "nats: encountered error"]


async def test_malformed_store_entries_are_skipped_counted_and_never_stop_placement(
    nats_server: EmbeddedNats, tmp_path: Path
) -> None:
    # Bounded inside the test so that, should an await never return, the traceback names it
    # (pytest-timeout's would show only the event loop's select).
    async with asyncio.timeout(150):
        await malformed_store_entries(nats_server, tmp_path)


async def malformed_store_entries(nats_server: EmbeddedNats, tmp_path: Path) -> None:
    import aiohttp

    nc = await nats.connect(nats_server.url)
    js = nc.jetstream()
    try:
        workers_kv = await open_bucket(js, "solo", "workers")
        leases_kv = await open_bucket(js, "solo", "leases")
        await workers_kv.put("junk", b'{"capacity": null}')
        await workers_kv.put("junk2", b"not json")
        async with one_worker(nats_server.url, tmp_path, ["cam1", "cam2"]) as (worker, api):
            await until(lambda: set(worker.owned) == {"cam1", "cam2"}, "placement stopped")
            # Junk over a held lease: the holder writes its lease back and keeps the source.
            held = worker.owned["cam1"]
            junk = await leases_kv.put("cam1", b'{"worker": 5}')
            await until(
                lambda: worker._views["leases"].entries["cam1"].revision > junk and parse_ok(worker, "cam1"),
                "the holder never wrote its lease back",
            )
            async with aiohttp.ClientSession() as http, http.get(f"{api.url}/v1/fleet") as r:
                assert r.status == 200
                status = await r.json()
            assert [w["id"] for w in status["workers"]] == ["only"]
            assert {s["id"]: s["owner"] for s in status["sources"]} == {"cam1": "only", "cam2": "only"}
            # In a thread: a CLI blocking the loop for seconds on a busy machine would stop
            # the worker renewing its leases (lease_ttl 2 s) and lose them.
            listed = await asyncio.to_thread(
                run_cli, "fleet", "list", "--nats", nats_server.url, "--fleet", "solo", "--json", timeout=60
            )
            assert listed.returncode == 0, listed.stderr
            assert json.loads(listed.stdout)["skipped"] == 2
            assert worker.metrics.bad_entries.labels("solo", "workers")._value.get() == 2
            assert worker.owned["cam1"] is held and not held.fenced
    finally:
        await nc.close()


async def test_a_source_that_cannot_start_here_is_released_counted_and_retried_later(
    nats_server: EmbeddedNats, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    refuse = {"cam2"}
    with caplog.at_level("ERROR", logger="vidpipe.fleet"):
        async with one_worker(nats_server.url, tmp_path, ["cam1", "cam2"], refuse=refuse) as (worker, _):
            failed = worker.metrics.releases.labels("solo", "failed")
            await until(lambda: failed._value.get() >= 1, "cam2 was never released")
            assert set(worker.owned) == {"cam1"} and "cam2" not in worker.runtime.sources
            assert worker.metrics.releases.labels("solo", "removed")._value.get() == 0
            # Retried after 2 × lease_ttl: once the host can run it, it runs.
            refuse.clear()
            await until(lambda: set(worker.owned) == {"cam1", "cam2"}, "cam2 was never retried", 30)
            assert "cam2" in worker.runtime.sources
    said = [r.getMessage() for r in caplog.records if "cannot start here" in r.getMessage()]
    assert said[0] == "fleet solo: source cam2 cannot start here: cam2 is not on this host; lease released"


def parse_ok(worker: Any, sid: str) -> bool:
    entry = worker._views["leases"].entries.get(sid)
    if entry is None:
        return False
    try:
        return parse_lease(entry.value).worker == worker.id
    except ValueError:
        return False


async def test_an_unconfirmed_claim_shows_no_owner_and_rewriting_it_does_not_hold_the_source(
    nats_server: EmbeddedNats, tmp_path: Path
) -> None:
    nc = await nats.connect(nats_server.url)
    js = nc.jetstream()
    stop = asyncio.Event()
    try:
        leases_kv = await open_bucket(js, "solo", "leases")
        # A worker behind a slow link: its claims land, it never learns so, and it claims again.
        revision = await leases_kv.create("cam1", lease_value("ghost", 1.0, 0, 1))

        async def ghost() -> None:
            nonlocal revision
            since = 2.0
            while not stop.is_set():
                await asyncio.sleep(0.3)
                with contextlib.suppress(Exception):
                    revision = await leases_kv.update(
                        "cam1", lease_value("ghost", since, 0, 1), last=revision
                    )
                since += 1

        task = asyncio.create_task(ghost())
        t0 = time.monotonic()
        async with one_worker(nats_server.url, tmp_path, ["cam1"]) as (worker, _):
            # Claimed, not owned: neither /v1/fleet nor `vidpipe fleet list` names an owner.
            assert [(s["id"], s["owner"]) for s in worker.status()["sources"]] == [("cam1", None)]
            listed = await read_status(js, "solo")
            assert [(s["id"], s["owner"], s["lease"]) for s in listed["sources"]] == [("cam1", None, None)]
            await until(lambda: "cam1" in worker.owned, "the rewritten claim held the source", timeout=12)
            # Taken over after the claim stood unconfirmed for lease_ttl (x2: not the target's
            # view yet), not kept away by each rewrite.
            assert time.monotonic() - t0 < 2 * 2.0 + 3.0
            stop.set()
            await task
    finally:
        stop.set()
        await nc.close()


async def test_a_body_with_a_flood_of_unknown_keys_is_one_quick_refusal(
    nats_server: EmbeddedNats, tmp_path: Path
) -> None:
    import aiohttp

    async with one_worker(nats_server.url, tmp_path, []) as (_, api):
        body = {"url": "test://?width=64&height=48&fps=20", **{f"k{i:05d}": 1 for i in range(60000)}}
        async with aiohttp.ClientSession() as http:
            t0 = time.perf_counter()
            async with http.post(f"{api.url}/v1/sources", json=body) as r:
                spent = time.perf_counter() - t0
                assert r.status == 400
                error = (await r.json())["error"]
        assert error.startswith("sources.k00000: unknown key")
        assert spent < 1.5, spent  # 3.3 s of loop time when every key got a suggestion


# --- faults on one worker's links (the TCP fault proxy) -------------------------------


@contextlib.asynccontextmanager
async def proxied(nats_server: EmbeddedNats) -> AsyncIterator[tuple[Faults, str]]:
    """A fault proxy in front of the server: its faults and the URL a worker is given."""
    faults = Faults()
    proxy = Proxy(faults, nats_server.port)
    await proxy.start()
    try:
        yield faults, proxy.url
    finally:
        await proxy.stop()


def accepted(seen: Seen) -> list[tuple[float, dict[str, Any]]]:
    """The messages the documented consumer rule keeps: the highest (epoch, lease) so far."""
    highest: dict[str, tuple[int, int]] = {}
    out = []
    for at, m in seen.messages:
        if fence(m) >= highest.get(m["source"], (0, 0)):
            highest[m["source"]] = fence(m)
            out.append((at, m))
    return out


def owners_in_turn(messages: list[tuple[float, dict[str, Any]]], source: str) -> list[str]:
    seq: list[str] = []
    for _, m in messages:
        if m["source"] == source and (not seq or seq[-1] != m["worker"]):
            seq.append(m["worker"])
    return seq


async def test_a_cut_shorter_than_the_lease_resumes_the_same_leases_when_nats_answers(
    nats_server: EmbeddedNats, tmp_path: Path, seen: Seen
) -> None:
    async with (
        proxied(nats_server) as (faults, url),
        one_worker(url, tmp_path, ["cam1", "cam2"], fleet="fleet", worker_id="cut") as (worker, _),
    ):
        await until(lambda: set(worker.owned) == {"cam1", "cam2"}, "never took its sources")
        before = {sid: (lease.epoch, lease.number) for sid, lease in worker.owned.items()}
        faults.set("cut")
        # Past its deadline the worker stops its sources and keeps the leases to resume.
        abandoned = worker.leases.abandoned
        await until(lambda: not worker.owned and len(abandoned) == 2, "leases never lapsed", timeout=20)
        assert all(lease.lapsed for lease in abandoned.values())
        faults.set("ok")
        healed = time.monotonic()
        await until(lambda: set(worker.owned) == {"cam1", "cam2"}, "sources never resumed", timeout=20)
        assert {sid: (lease.epoch, lease.number) for sid, lease in worker.owned.items()} == before
        assert worker.metrics.takeovers.labels("fleet", "resumed")._value.get() == 2
        await until(
            lambda: {m["source"] for at, m in seen.messages if at > healed} == {"cam1", "cam2"},
            "no messages after the cut",
        )
        # Under the same fence as before: the consumer rule keeps every one of them.
        assert {fence(m) for at, m in seen.messages if at > healed} == set(before.values())


async def test_after_a_nats_restart_each_of_two_workers_resumes_its_own_leases_at_once(
    nats_server: EmbeddedNats, tmp_path: Path, seen: Seen
) -> None:
    sources = ["cam1", "cam2", "cam3", "cam4"]
    async with (
        one_worker(nats_server.url, tmp_path, sources, fleet="fleet", worker_id="wa") as (a, _),
        one_worker(nats_server.url, tmp_path, sources, fleet="fleet", worker_id="wb") as (b, _),
    ):
        workers = (a, b)
        await until(lambda: len(a.owned) == 2 and len(b.owned) == 2, "never split", timeout=30)

        def held() -> dict[str, tuple[str, tuple[int, int]]]:
            """source -> (worker, fence) for every lease held now."""
            return {
                sid: (w.id, (lease.epoch, lease.number)) for w in workers for sid, lease in w.owned.items()
            }

        before = held()
        nats_server.stop()  # the same port and JetStream store when it comes back
        await until(lambda: not a.owned and not b.owned, "leases never lapsed", timeout=10)
        # Out long enough that, on each worker's frozen view, the other's heartbeat and
        # leases stood still for more than a TTL (2 s): that is no sign the other is gone.
        await asyncio.sleep(4.0)
        nats_server.start()
        back = time.monotonic()
        await until(lambda: held() == before, "the leases were not resumed as they were held", timeout=10)
        for w in workers:
            assert w.metrics.takeovers.labels("fleet", "resumed")._value.get() == 2, w.id
            assert w.metrics.takeovers.labels("fleet", "expired")._value.get() == 0, w.id
        await until(
            lambda: {m["source"] for at, m in seen.messages if at > back} == set(sources),
            "not every source published again",
        )
        # Each source published again by the worker that held it, under the same fence.
        after = {(m["source"], m["worker"], fence(m)) for at, m in seen.messages if at > back}
        assert after == {(sid, wid, lease) for sid, (wid, lease) in before.items()}
        await asyncio.sleep(2.0)
        assert held() == before  # and nothing moved a TTL later


async def test_a_worker_whose_publishing_connection_stalls_gives_its_leases_up_and_says_why(
    nats_server: EmbeddedNats, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    sources = ["cam1", "cam2", "cam3", "cam4"]
    async with (
        proxied(nats_server) as (faults, url),
        one_worker(url, tmp_path, sources, fleet="pub", worker_id="stuck") as (stuck, _),
        one_worker(nats_server.url, tmp_path, sources, fleet="pub", worker_id="other") as (other, _),
    ):
        await until(lambda: len(stuck.owned) == 2 and len(other.owned) == 2, "never split", timeout=30)
        held = sorted(stuck.owned)
        faults.set("stall", publisher_only=True)  # its KV connection stays fine
        stalled = time.monotonic()
        await until(lambda: not stuck.owned, "the stalled worker kept its leases", timeout=10)
        gave_up = time.monotonic() - stalled
        # Given up once a probe (every lease_ttl / 4) found no answer, before the fence's bound.
        assert gave_up <= 0.75 * 2 + 0.5 + 1.0, gave_up
        assert all(not stuck.fence.may_publish(sid) for sid in held)
        assert stuck.metrics.releases.labels("pub", "publish")._value.get() == 2
        for sid in held:
            line = f"fleet pub: released {sid}: the publishing connection has not answered for 1.5s"
            assert line in caplog.text
        # Its heartbeat is gone, so the other worker takes the sources at once.
        await until(lambda: set(other.owned) == set(sources), "the other worker never took them", timeout=15)
        assert "stuck" not in other.alive_workers(time.monotonic())
        faults.set("ok")
        # The connection still reads after the stall: a PING the probe had given up on
        # would have stopped its read loop when the PONG arrived.
        nc = stuck.runtime.publisher.nc
        assert nc is not None
        echo = await nc.subscribe("fleet-test.echo")
        await nc.publish("fleet-test.echo", b"ping")
        assert (await echo.next_msg(timeout=5)).data == b"ping"
        # It rejoins, and gets its share back after it stayed alive a TTL.
        await until(lambda: len(stuck.owned) == 2, "never got its share back", timeout=30)


async def test_sources_go_back_to_a_worker_back_from_a_partition_only_after_it_stayed_alive_a_ttl(
    nats_server: EmbeddedNats, tmp_path: Path, seen: Seen
) -> None:
    sources = ["cam1", "cam2", "cam3", "cam4"]
    async with (
        proxied(nats_server) as (faults, url),
        one_worker(url, tmp_path, sources, fleet="fleet", worker_id="away") as (away, _),
        one_worker(nats_server.url, tmp_path, sources, fleet="fleet", worker_id="home") as (home, _),
    ):
        await until(lambda: len(away.owned) == 2 and len(home.owned) == 2, "never split", timeout=30)
        held = set(away.owned)
        t0 = time.monotonic()
        faults.set("stall")  # a silent partition: every byte held, delivered at the heal
        await until(lambda: set(home.owned) == set(sources), "never taken over", timeout=20)
        faults.set("ok")
        healed = time.monotonic()
        await until(lambda: set(away.owned) == held, "never handed back", timeout=30)
        back = time.monotonic() - healed
        # Not on the returning worker's first heartbeat: after it stayed alive a TTL (2 s).
        assert back >= 2.0, back
        await until(
            lambda: (
                {m["source"] for at, m in seen.messages if at > healed + back and m["worker"] == "away"}
                == held
            ),
            "the returned worker never published its sources",
        )
        kept = accepted(seen)
        for sid in sources:
            # From a second before the fault: its own messages after it are held until the heal.
            after = [(at, m) for at, m in kept if at >= t0 - 1.0]
            # Away and back: two moves for the partitioned worker's sources, none for the rest.
            want = ["away", "home", "away"] if sid in held else ["home"]
            assert owners_in_turn(after, sid) == want, (sid, owners_in_turn(after, sid))


async def test_a_worker_that_cannot_reach_the_fleet_is_not_ready_but_alive_and_recovers_after(
    nats_server: EmbeddedNats, tmp_path: Path
) -> None:
    # Liveness failing on a NATS outage restarted every worker of a fleet at once.
    import aiohttp

    async with (
        proxied(nats_server) as (faults, url),
        one_worker(url, tmp_path, ["cam1"], fleet="lost", worker_id="lonely") as (worker, api),
        aiohttp.ClientSession(base_url=api.url) as http,
    ):
        await until(lambda: bool(worker.owned), "never took its source")

        async def probe(path: str) -> tuple[int, Any]:
            async with http.get(path) as r:
                return r.status, await r.json()

        assert await probe("/healthz") == (200, {"status": "ok"})
        faults.set("cut")  # no heartbeat can be written, no bucket opened
        cut = time.monotonic()
        ready: tuple[int, Any] = (200, None)
        while ready[0] == 200:
            assert time.monotonic() - cut < 60, "readyz never failed"
            assert await probe("/healthz") == (200, {"status": "ok"})
            await asyncio.sleep(0.5)
            ready = await probe("/readyz")
        code, body = ready
        assert code == 503
        assert any(r.startswith("fleet lost: ") for r in body["reasons"]), body
        assert await probe("/healthz") == (200, {"status": "ok"})
        faults.set("ok")
        await until(lambda: worker.readiness_problem() is None, "readyz never recovered", timeout=30)
        assert worker.health_problem() is None


async def test_a_lease_of_a_worker_that_is_gone_shows_no_owner_but_names_it(
    nats_server: EmbeddedNats,
) -> None:
    # No worker had room to take cam2 over: its lease still names the dead worker.
    nc = await nats.connect(nats_server.url)
    js = nc.jetstream()
    try:
        sources = await open_bucket(js, "gone", "sources")
        leases = await open_bucket(js, "gone", "leases")
        workers = await open_bucket(js, "gone", "workers")
        for sid in ("cam1", "cam2"):
            await sources.put(sid, encode_source(SourceConfig(url="test://?fps=5", id=sid)))
        now = time.time()
        for wid, ts in (("alive-1", now), ("dead-2", now - 60)):
            beat = {"capacity": 1, "load": 1, "version": "0", "ts": ts, "lease_ttl": 4.0}
            await workers.put(wid, json.dumps(beat).encode())
        await leases.put("cam1", lease_value("alive-1", now - 30, 7, 1))
        await leases.put("cam2", lease_value("dead-2", now - 90, 5, 1))
        status = await read_status(js, "gone")
    finally:
        await nc.close()
    # Placement from the same buckets: alive-1 has room for one source, the one it runs.
    assert [(s["id"], s["owner"], s["last_owner"], s["placed_on"]) for s in status["sources"]] == [
        ("cam1", "alive-1", None, "alive-1"),
        ("cam2", None, "dead-2", None),
    ]
    table = format_status(status).splitlines()
    assert [line.split()[:2] for line in table if line.startswith("cam")] == [
        ["cam1", "alive-1"],
        ["cam2", "-"],
    ]
    assert "(was dead-2)" in next(line for line in table if line.startswith("cam2"))


async def test_fleet_list_shows_where_a_source_is_moving(nats_server: EmbeddedNats) -> None:
    # w1 runs both sources; w2 has joined, so placement gives it one of them.
    nc = await nats.connect(nats_server.url)
    js = nc.jetstream()
    try:
        sources = await open_bucket(js, "moving", "sources")
        leases = await open_bucket(js, "moving", "leases")
        workers = await open_bucket(js, "moving", "workers")
        now = time.time()
        for wid in ("w1", "w2"):
            beat = {
                "capacity": 8,
                "load": 2 if wid == "w1" else 0,
                "version": "0",
                "ts": now,
                "lease_ttl": 4.0,
            }
            await workers.put(wid, json.dumps(beat).encode())
        for sid in ("cam1", "cam2"):
            await sources.put(sid, encode_source(SourceConfig(url="test://?fps=5", id=sid)))
            await leases.put(sid, lease_value("w1", now - 30, 7, 1))
        status = await read_status(js, "moving")
    finally:
        await nc.close()
    assert sorted((s["owner"], s["placed_on"]) for s in status["sources"]) == [("w1", "w1"), ("w1", "w2")]
    moving = next(s["id"] for s in status["sources"] if s["placed_on"] == "w2")
    table = format_status(status).splitlines()
    assert next(line for line in table if line.startswith(moving)).split()[1:4] == ["w1", "(to", "w2)"]


async def test_two_processes_with_one_worker_id_are_told_so(
    nats_server: EmbeddedNats, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.ERROR, logger="vidpipe")
    first, second = tmp_path / "a", tmp_path / "b"
    first.mkdir()
    second.mkdir()
    said = (
        "fleet twins: another process runs as worker twin; each worker needs its own id: give each "
        "host its own fleet.worker_id, or leave it out (host name and pid)"
    )
    async with (
        one_worker(nats_server.url, first, ["cam1"], fleet="twins", worker_id="twin"),
        one_worker(nats_server.url, second, [], fleet="twins", worker_id="twin"),
    ):
        await until(lambda: any(r.getMessage() == said for r in caplog.records), "the twin named", timeout=20)
