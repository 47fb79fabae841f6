"""Which worker should run each source: rendezvous hashing under capacity.

A pure function of the source ids and the live workers' capacities, so every
worker that sees the same fleet computes the same answer without talking to
the others. Each worker first gets a quota, a fair share of the sources capped
by its ``max_sources``. A source stays with the live worker that holds its lease
while that worker's quota has room; the others are then taken in descending hash
order, each going to the best-scoring worker that still has room. So adding or
removing a source moves no other source unless the shares must change, and a
worker that joins or leaves moves only the sources its quota forces: every move
resets that camera's tracks and cuts its recordings.
"""

from __future__ import annotations

import hashlib
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field


def score(source: str, worker: str) -> int:
    """The rendezvous weight of a source on a worker: a 64-bit hash of the pair."""
    digest = hashlib.blake2b(f"{source}\0{worker}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


def quotas(
    count: int, capacities: Mapping[str, int], held: Mapping[str, int] | None = None
) -> dict[str, int]:
    """How many of ``count`` sources each worker takes: shares that differ by at most one.

    Units go round skipping workers at their capacity, the workers that hold the
    most sources now first (``held``: so the larger shares stay where the sources
    already run), then in an order fixed by each worker id's hash (so who gets
    them does not depend on start order). The shares sum to ``count`` unless the
    capacities sum to less.
    """
    now = held or {}
    order = sorted(capacities, key=lambda w: (-now.get(w, 0), score("", w), w))
    share = dict.fromkeys(order, 0)
    left = count
    while left > 0:
        gave = False
        for worker in order:
            if left == 0:
                break
            if share[worker] < capacities[worker]:
                share[worker] += 1
                left -= 1
                gave = True
        if not gave:
            break
    return share


def place(
    sources: Iterable[str], capacities: Mapping[str, int], holders: Mapping[str, str] | None = None
) -> dict[str, str]:
    """``{source: worker}`` for every source that fits; sources over the total capacity are left out.

    ``holders`` maps a source to the worker that holds its lease now; holders that
    are not live (not in ``capacities``) count for nothing.
    """
    wanted = set(sources)
    ids = sorted(wanted)
    held = {s: w for s, w in (holders or {}).items() if w in capacities and s in wanted}
    room = quotas(len(ids), capacities, Counter(held.values()))
    placed: dict[str, str] = {}
    # A holder over its quota keeps its best-scoring sources; the rest are placed anew.
    for _, source, worker in sorted(((score(s, w), s, w) for s, w in held.items()), reverse=True):
        if room[worker] > 0:
            placed[source] = worker
            room[worker] -= 1
    pairs = sorted(
        ((score(s, w), s, w) for s in ids if s not in placed for w in room if room[w] > 0), reverse=True
    )
    for _, source, worker in pairs:
        if source in placed or room[worker] == 0:
            continue
        placed[source] = worker
        room[worker] -= 1
        if len(placed) == len(ids):
            break
    return placed


@dataclass
class LiveSet:
    """The live workers as one worker sees them, and since when; times are monotonic seconds.

    Placement acts only on a set that has held still for ``settle`` (a worker that
    briefly sees no peers does not take every source), and a source is handed to
    another worker only once that worker has been alive, without a break, for
    ``handback``: a worker back from a partition gets its sources after that stable
    period, so each moves twice at most (away and back), never on a passing heartbeat.
    """

    settle: float
    handback: float
    members: frozenset[str] = frozenset()
    since: float = 0.0  # when the set last changed
    alive_since: dict[str, float] = field(default_factory=dict)

    def note(self, now: float, members: Iterable[str]) -> bool:
        """Record the live set seen at ``now``; True once it has held still for ``settle``."""
        live = frozenset(members)
        if live != self.members:
            self.members, self.since = live, now
        for worker in list(self.alive_since):
            if worker not in live:
                del self.alive_since[worker]  # a break: its stable period starts again
        for worker in live:
            self.alive_since.setdefault(worker, now)
        return now - self.since >= self.settle

    def may_hand_to(self, worker: str, now: float) -> bool:
        """Whether ``worker`` has been alive without a break for ``handback``."""
        since = self.alive_since.get(worker)
        return since is not None and now - since >= self.handback
