"""A once-a-second console summary, computed from the pipeline's own NATS output.

``vidpipe run --summary`` subscribes to ``vidpipe.<pipeline>.>`` like any
consumer would and reads its detections messages (one per frame) and its events,
so what it prints is what subscribers really receive::

    [  3s] lobby: 24.9 fps  2.0 obj/frame  latency p50 41 ms p99 77 ms | text: "EXIT 12", "GATE B"

and at the end the totals, with the objects counted per label, the events per
type and the line crossings per line and direction::

    received 75 messages from 1 source(s); objects: square x75, text x150; most read text: "EXIT 12" x40;
    events: track_start x1, track_end x1, line_cross x2; crossings: door in x1, door out x1

With ``json_lines`` (``--log-format json``) each line is a JSON object instead.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections import Counter, defaultdict
from collections.abc import Callable
from typing import Any, TextIO

import nats

from pipeline.cancel import cancel_and_wait
from pipeline.events import EVENT_TYPES


def percentile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    idx = min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))
    return ordered[idx]


class Summary:
    """Collects messages and prints one line per second."""

    def __init__(
        self,
        nats_url: str,
        subject: str,
        out: TextIO,
        *,
        json_lines: bool = False,
        dropped: Callable[[], dict[str, int]] | None = None,
    ) -> None:
        self.nats_url = nats_url
        # The pipeline's frames dropped so far by reason (they never reach NATS): a second
        # without frames says whether they were dropped, and why.
        self._dropped_now = dropped
        self._dropped_before: dict[str, int] = dict(dropped()) if dropped is not None else {}
        self.json_lines = json_lines
        self.labels: Counter[str] = Counter()
        self.subject = subject
        self.out = out
        self._nc: Any = None
        self._task: asyncio.Task[None] | None = None
        self._window: dict[str, list[dict[str, Any]]] = defaultdict(list)
        self.totals: Counter[str] = Counter()
        self.texts: Counter[str] = Counter()
        self.events: Counter[str] = Counter()  # by type
        self.crossings: Counter[tuple[str, str]] = Counter()  # by (line, direction)
        self._start = time.monotonic()

    async def start(self) -> None:
        self._nc = await nats.connect(self.nats_url, name="vidpipe-summary")

        async def on_msg(msg: Any) -> None:
            events = msg.subject.endswith(".events")
            if not (events or msg.subject.endswith(".detections")):
                return  # clips and other subjects are neither frames nor events
            try:
                data = json.loads(msg.data)
            except ValueError:
                return
            if not isinstance(data, dict):
                return
            if events:
                self._count_event(data)
                return
            data["_received"] = time.time()
            self._window[data.get("source", "?")].append(data)

        await self._nc.subscribe(self.subject, cb=on_msg)
        self._task = asyncio.create_task(self._tick())

    def _count_event(self, event: dict[str, Any]) -> None:
        kind = str(event.get("type", "?"))
        self.events[kind] += 1
        if kind == "line_cross":
            self.crossings[(str(event.get("line", "?")), str(event.get("direction", "?")))] += 1

    async def _tick(self) -> None:
        while True:
            await asyncio.sleep(1.0)
            self.print_line()

    def print_line(self) -> None:
        elapsed = time.monotonic() - self._start
        window, self._window = self._window, defaultdict(list)
        parts = []
        texts: list[str] = []
        for source in sorted(window):
            msgs = window[source]
            self.totals[source] += len(msgs)
            objects = sum(len(m.get("objects", [])) for m in msgs)
            lat = [m["_received"] - m["capture_ts"] for m in msgs if "capture_ts" in m]
            p50, p99 = percentile(lat, 0.5) * 1000, percentile(lat, 0.99) * 1000
            parts.append(
                f"{source}: {len(msgs):5.1f} fps {objects / max(1, len(msgs)):4.1f} obj/frame "
                f"latency p50 {p50:4.0f} ms p99 {p99:4.0f} ms"
            )
            for m in msgs:
                for obj in m.get("objects", []):
                    self.labels[str(obj.get("label", "?"))] += 1
                    text = obj.get("text")
                    if text:
                        self.texts[text] += 1
                        if text not in texts:
                            texts.append(text)
        idle = "no frames this second" if self.totals else "waiting for frames"
        dropped = self._dropped_since_last()
        if dropped:
            count = sum(dropped.values())
            by_count = sorted(dropped.items(), key=lambda kv: (-kv[1], kv[0]))
            reasons = by_count[0][0] if len(by_count) == 1 else ", ".join(f"{r} {n}" for r, n in by_count)
            if parts:
                parts.append(f"dropped {count} ({reasons})")
            idle = f"no frames published: {count} dropped this second ({reasons})"
        line = f"[{elapsed:4.0f}s] " + ("; ".join(parts) if parts else idle)
        if texts:
            line += " | text: " + ", ".join(f'"{t}"' for t in texts[:6])
        self._print(
            line,
            elapsed_s=round(elapsed, 1),
            sources={s: len(window[s]) for s in sorted(window)},
            **({"dropped": dropped} if dropped else {}),
        )

    def _dropped_since_last(self) -> dict[str, int]:
        """Frames dropped since the previous line, by reason."""
        if self._dropped_now is None:
            return {}
        now = dict(self._dropped_now())
        since = {r: n - self._dropped_before.get(r, 0) for r, n in now.items()}
        self._dropped_before = now
        return {r: n for r, n in since.items() if n > 0}

    def _print(self, line: str, **fields: Any) -> None:
        if self.json_lines:
            record = {"ts": round(time.time(), 3), "level": "info", "logger": "vidpipe.summary", "msg": line}
            line = json.dumps({**record, **fields}, ensure_ascii=False)
        print(line, file=self.out, flush=True)

    async def stop(self, totals: bool = True) -> None:
        """Stop reading; ``totals``: print the run's closing ``received ...`` line (not for a
        run stopped before any source started, which has nothing to sum up)."""
        if self._nc is not None:
            # The server may already be gone at shutdown.
            with contextlib.suppress(Exception):
                await self._nc.flush(timeout=2)
        await asyncio.sleep(0.1)
        await cancel_and_wait(self._task)
        if any(self._window.values()):  # what came since the last line; nothing new: no line
            self.print_line()
        if self._nc is not None:
            await self._nc.close()
        if not totals:
            return
        total = sum(self.totals.values())
        common = ", ".join(f'"{t}" x{n}' for t, n in self.texts.most_common(8))
        labels = ", ".join(
            f"{label} x{n}" for label, n in sorted(self.labels.items(), key=lambda kv: (-kv[1], kv[0]))
        )
        # Events in the order they happen to a track; crossings by line, then in before out.
        order: dict[str, int] = {kind: i for i, kind in enumerate(EVENT_TYPES)}
        events = ", ".join(
            f"{kind} x{n}" for kind, n in sorted(self.events.items(), key=lambda kv: order.get(kv[0], 99))
        )
        crossings = ", ".join(f"{line} {d} x{n}" for (line, d), n in sorted(self.crossings.items()))
        self._print(
            f"received {total} messages from {len(self.totals)} source(s)"
            + (f"; objects: {labels}" if labels else "")
            + (f"; most read text: {common}" if common else "")
            + (f"; events: {events}" if events else "")
            + (f"; crossings: {crossings}" if crossings else ""),
            messages=total,
            sources=dict(self.totals),
            labels=dict(self.labels),
            events=dict(self.events),
            crossings={f"{line} {d}": n for (line, d), n in sorted(self.crossings.items())},
        )
