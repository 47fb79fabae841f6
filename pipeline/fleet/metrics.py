"""The fleet's Prometheus metrics, on the runtime's registry (docs/operations.md).

``reason`` label values are fixed sets: takeovers ``new`` (a source never run
before, or freshly added), ``released`` (handed over by a drain or a rebalance),
``expired`` (its holder stopped renewing) and ``resumed`` (its own lease, given
up while NATS was out of reach and taken by no one); releases ``rebalance``,
``removed``, ``drain``, ``publish`` (the publishing connection did not answer in
time) and ``failed`` (the source could not start here); losses ``taken``
(another worker wrote the lease) and ``deadline`` (no renewal in time).
``bucket`` is sources, leases or workers.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

TAKEOVER_REASONS = ("new", "released", "expired", "resumed")
RELEASE_REASONS = ("rebalance", "removed", "drain", "publish", "failed")
LOSS_REASONS = ("taken", "deadline")
BUCKETS = ("sources", "leases", "workers")

RENEW_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


class FleetMetrics:
    """Sources owned, workers alive, takeovers, releases, losses, renewal latency, fenced messages."""

    def __init__(self, registry: CollectorRegistry, fleet: str) -> None:
        r = registry
        self.fleet = fleet
        self.sources_owned = Gauge(
            "vidpipe_fleet_sources_owned", "Sources this worker holds a lease on", ["fleet"], registry=r
        )
        self.workers_alive = Gauge(
            "vidpipe_fleet_workers_alive",
            "Workers of the fleet this worker sees alive",
            ["fleet"],
            registry=r,
        )
        self.takeovers = Counter(
            "vidpipe_fleet_takeovers",
            "Sources this worker took, by reason (" + ", ".join(TAKEOVER_REASONS) + ")",
            ["fleet", "reason"],
            registry=r,
        )
        self.releases = Counter(
            "vidpipe_fleet_releases",
            "Sources this worker handed over, by reason (" + ", ".join(RELEASE_REASONS) + ")",
            ["fleet", "reason"],
            registry=r,
        )
        self.losses = Counter(
            "vidpipe_fleet_leases_lost",
            "Leases this worker lost without releasing, by reason (" + ", ".join(LOSS_REASONS) + ")",
            ["fleet", "reason"],
            registry=r,
        )
        self.renew_latency = Histogram(
            "vidpipe_fleet_lease_renew_seconds",
            "Round trip of one lease renewal (compare-and-swap) to JetStream",
            ["fleet"],
            buckets=RENEW_BUCKETS,
            registry=r,
        )
        self.fenced = Counter(
            "vidpipe_fleet_fenced_messages",
            "Messages not sent because this worker's lease on the source may have passed on",
            ["fleet"],
            registry=r,
        )
        for reason in TAKEOVER_REASONS:
            self.takeovers.labels(fleet, reason)
        for reason in RELEASE_REASONS:
            self.releases.labels(fleet, reason)
        for reason in LOSS_REASONS:
            self.losses.labels(fleet, reason)
        self.bad_entries = Counter(
            "vidpipe_fleet_bad_entries",
            "Stored values that did not parse and were skipped, by bucket (once per revision)",
            ["fleet", "bucket"],
            registry=r,
        )
        self.buckets_recreated = Counter(
            "vidpipe_fleet_buckets_recreated",
            "Fleet buckets this worker found missing or replaced and opened again, by bucket",
            ["fleet", "bucket"],
            registry=r,
        )
        self.restarts = Counter(
            "vidpipe_fleet_source_restarts",
            "Owned sources restarted because their desired entry changed",
            ["fleet"],
            registry=r,
        )
        self.fenced.labels(fleet)
        self.restarts.labels(fleet)
        for bucket in BUCKETS:
            self.bad_entries.labels(fleet, bucket)
            self.buckets_recreated.labels(fleet, bucket)
