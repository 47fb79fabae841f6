"""Publishing: one message per processed frame to ``vidpipe.<pipeline>.<source>.detections``,
then one per event found in it to ``vidpipe.<pipeline>.<source>.events``; besides, one per
event clip written to ``vidpipe.<pipeline>.<source>.clips`` (:meth:`Publisher.publish_clip`).

::

    nats:
      url: nats://127.0.0.1:4222   # omit to start an embedded server
      publish: core                # core | jetstream
      outbox_size: 1000            # core: messages kept while disconnected

``core`` is fire-and-forget: while the connection is down, messages wait in a
bounded outbox; when it is full they are dropped and counted
(``vidpipe_publish_errors_total{reason="outbox_full"}``). The ``reason`` of
that counter is one of ``outbox_full``, ``retry``, ``shutdown``, ``failed`` and
``too_large`` (over the server's ``max_payload``: dropped, never sent).
A task sends the outbox only while it holds messages: it starts when one is
queued, waits for the reconnect (an event, no polling) and ends once the
outbox is empty.

``jetstream`` acknowledges every message. The stream for ``<prefix>.>`` is
created or verified at start; each message carries ``Nats-Msg-Id:
<pipeline>/<source>/<run>/<frame>`` (``<run>`` tells apart runs of a source whose
frame numbers start again at 0; an event adds ``/<n>``, its place among the
frame's events; a clip ``/clip-<k>`` after its event's frame, ``<k>`` its ``clips``
output's place) so a retry after a lost ack is de-duplicated by the server. A
message is retried until acknowledged, with :func:`~pipeline.backoff.backoff_delay`
between tries (0.1 s doubling to 2 s); the per-source publisher waits
meanwhile, which backs pressure up the graph instead of dropping.

Clips messages (and status messages, ``nats.status``) take the same way, outbox
or acks, and their losses are counted alike; each is sent by a task of its own
(a clip is written on a worker thread, a state changes on a source's thread: not in
a source's publisher), which :meth:`Publisher.close` waits for first.

Without a URL (a program embedding vidpipe without NATS, see docs/embedding.md)
nothing connects anywhere: each message only goes to ``on_message``. With a URL,
``on_message`` (when set) gets each message too, before it is sent, so the
embedding program sees exactly what subscribers receive.

In a fleet (docs/fleet.md) a :class:`Fence` is asked before every message,
retries included: a worker whose lease on a source may have passed to another
worker sends nothing more for it. Detections and events then carry ``worker``,
``epoch`` and ``lease`` (the fence, docs/messages.md).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import os
import time
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

import nats
from nats.aio.client import Client as NatsClient
from nats.js import JetStreamContext
from nats.js.api import DiscardPolicy, StreamConfig

from inference.errors import VidpipeError
from inference.ratelimit import RateLimitedLog
from pipeline.backoff import Backoff, backoff_delay
from pipeline.cancel import cancel_and_wait
from pipeline.config import NatsConfig
from pipeline.events import Event, events_subject
from pipeline.frames import Frame
from pipeline.messages import build_message, encode, subject_for
from pipeline.metrics import Metrics
from pipeline.redact import redact_url

log = logging.getLogger("vidpipe.publish")

# Between tries of a JetStream publish that was not acknowledged.
ACK_RETRY = Backoff(min_delay=0.1, max_delay=2.0)


class PublishError(VidpipeError):
    """NATS could not be reached or set up; the message says where and what to do."""


class MessageTooLarge(PublishError):
    """A message over the server's ``max_payload``: dropped before it is sent, since the
    server would answer it by closing the connection (with every acked publish waiting)."""


# What a JetStream publish adds to the payload: "NATS/1.0\r\nNats-Msg-Id: <id>\r\n\r\n".
_HEADER_BYTES = 32

# A source's state changes (nats.status): docs/messages.md, pipeline/schemas/status.v1.json.
STATUS_SCHEMA = "vidpipe.status/v1"


def status_subject(prefix: str, pipeline: str, source: str) -> str:
    """``vidpipe.<pipeline>.<source>.status``."""
    return f"{prefix}.{pipeline}.{source}.status"


class Fence(Protocol):
    """Who may publish for a source right now (a fleet worker's leases)."""

    def may_publish(self, source: str) -> bool:
        """False once this process's lease on ``source`` may have passed to another."""
        ...

    def owner(self, source: str) -> tuple[str, int, int] | None:
        """``(worker id, epoch, lease)`` to stamp on ``source``'s messages; None outside a fleet."""
        ...


def stream_name(prefix: str) -> str:
    return prefix.upper().replace("-", "_")


class Publisher:
    """Owns the NATS connection and publishes frames in the mode the config asks for."""

    def __init__(
        self,
        config: NatsConfig,
        url: str | None,
        pipeline: str,
        metrics: Metrics,
        *,
        fence: Fence | None = None,
        on_sent: Callable[[str], None] | None = None,
        on_message: Callable[[dict[str, Any]], Awaitable[None]] | None = None,
    ) -> None:
        self.config = config
        self.url = url
        self.pipeline = pipeline
        self.metrics = metrics
        self.nc: NatsClient | None = None
        self.js: JetStreamContext | None = None
        # (subject, source, payload, kind): kind is "detections" or the event's type.
        self._outbox: collections.deque[tuple[str, str, bytes, str]] = collections.deque()
        # Sends the outbox; exists only while the outbox holds messages.
        self._flusher: asyncio.Task[None] | None = None
        self._drained = asyncio.Event()  # set whenever the outbox is empty
        self._drained.set()
        self._closing = False
        # What a failed first connection says to do (the CLI's flags; an embedding program's own).
        self.connect_hint = "check --nats / nats.url, or omit both to start an embedded server"
        # Messages of each source still in the outbox when the stop gave up on them.
        self.unsent: dict[str, int] = {}
        # Messages of each source the full outbox dropped (its oldest) while NATS was away.
        self.overflowed: dict[str, int] = {}
        # Clips and status messages on their way (core: sent or queued at once; JetStream: till acked).
        self._aside: set[asyncio.Task[None]] = set()
        self._warnings = RateLimitedLog(logger=log, level=logging.WARNING)
        # Set while the connection is up; the reconnect callback sets it, which wakes the flusher.
        self.connected = asyncio.Event()
        # Told of every detections message that really left (sent, flushed from the outbox, or acked).
        self._on_sent = on_sent
        # Awaited with each message in publish order (per source); its wait is backpressure.
        self._on_message = on_message
        # Asked before every message when this process is one worker of a fleet.
        self.fence = fence
        self.display_url = redact_url(url) if url is not None else "no NATS (messages to this process only)"
        self._errors = RateLimitedLog(logger=log)
        if url is not None:
            # Read at each scrape, nothing per message; without a URL there is no connection.
            metrics.nats_connected.labels(pipeline).set_function(self._connected_value)
            metrics.publish_outbox.labels(pipeline).set_function(lambda: float(len(self._outbox)))

    def _connected_value(self) -> float:
        """``vidpipe_nats_connected``: 1 while the client's link is up (not while it reconnects)."""
        return 1.0 if self.nc is not None and self.nc.is_connected else 0.0

    @property
    def flushing(self) -> bool:
        """Whether a task is sending the outbox (only while the outbox holds messages)."""
        return self._flusher is not None and not self._flusher.done()

    @property
    def outbox_size(self) -> int:
        """Messages waiting in the core-mode outbox."""
        return len(self._outbox)

    @property
    def mode(self) -> str:
        return self.config.publish if self.url is not None else "local"

    async def connect(self, timeout: float = 5.0) -> None:
        if self.url is None:
            # Nothing to connect to: publishing (to on_message) is always possible.
            self.connected.set()
            return
        url = self.url

        async def on_disconnect() -> None:
            self.connected.clear()
            if not self._closing:
                log.warning("NATS connection to %s lost; reconnecting", self.display_url)

        async def on_reconnect() -> None:
            self.connected.set()
            log.info("NATS reconnected to %s", self.display_url)

        last: list[Exception] = []  # the client's latest error while the first connect retries

        async def on_error(exc: Exception) -> None:
            if not self._closing:
                # The server refuses wrong credentials, then drops the connection: the
                # "connection reset" that follows must not hide the reason.
                if not (last and "authorization violation" in str(last[0]).lower()):
                    last[:] = [exc]
                log.debug("NATS error: %s", exc)

        try:
            # The client retries a first connection forever when reconnects are unlimited;
            # a broker that is not there at start is an operator error to report now.
            self.nc = await asyncio.wait_for(self._open(url, on_disconnect, on_reconnect, on_error), timeout)
        except Exception as exc:
            reason = "timed out" if isinstance(exc, TimeoutError) else (str(exc) or exc.__class__.__name__)
            if isinstance(exc, TimeoutError) and last:
                # Why it kept retrying: a refused port, wrong credentials ("authorization violation").
                reason = f"timed out after {timeout:g}s; last error: {_connect_error(last[0])}"
            raise PublishError(
                f"cannot connect to NATS at {self.display_url}: {reason}; {self.connect_hint}"
            ) from None
        self.connected.set()
        if self.mode == "jetstream":
            self.js = self.nc.jetstream()
            await self._ensure_stream()

    async def _open(self, url: str, on_disconnect: Any, on_reconnect: Any, on_error: Any) -> NatsClient:
        return await nats.connect(
            servers=url.split(","),  # several seed URLs of one cluster: a,b,c
            connect_timeout=2,
            max_reconnect_attempts=-1,
            reconnect_time_wait=0.25,
            disconnected_cb=on_disconnect,
            reconnected_cb=on_reconnect,
            error_cb=on_error,
            name=f"vidpipe-{self.pipeline}",
        )

    async def _ensure_stream(self) -> None:
        assert self.js is not None
        name = stream_name(self.config.subject_prefix)
        subjects = [f"{self.config.subject_prefix}.>"]
        try:
            info = await self.js.stream_info(name)
            if not set(subjects) <= set(info.config.subjects or []):
                raise PublishError(
                    f"JetStream stream {name} exists but does not cover {subjects[0]}; "
                    "add the subject to it or delete it"
                )
        except nats.js.errors.NotFoundError:
            age, size = self.config.stream_max_age, self.config.stream_max_bytes
            # Limits: JetStream keeps everything by default, until the server's disk is full.
            stream = StreamConfig(
                name=name,
                subjects=subjects,
                duplicate_window=120.0,
                max_age=age or None,
                max_bytes=size or None,
                discard=DiscardPolicy.OLD,
            )
            await self.js.add_stream(stream)
            log.info(
                "created JetStream stream %s for %s (keeps %s, %s)",
                name,
                subjects[0],
                f"{age:g} s" if age else "messages of any age",
                f"{size} bytes" if size else "any size",
            )

    async def publish(self, frame: Frame, stream_id: str = "") -> float | None:
        """Publish one frame's message, then its events (called in frame order per source).

        ``stream_id`` tells apart runs of the same source (a restart, a source removed
        and added again) whose frame numbers start again at 0, so JetStream's
        de-duplication never mistakes a new frame for a retry of an old one.

        Returns the capture-to-publish latency in seconds, as observed in
        ``vidpipe_e2e_latency_seconds``, or None when the message did not leave now
        (queued while NATS is away, or refused by the fleet's fence).
        """
        owner = self.fence.owner(frame.source) if self.fence is not None else None
        message = build_message(self.pipeline, frame, time.time(), owner)
        if self._on_message is not None:
            await self._on_message(message)
        for obj in frame.objects:
            self.metrics.objects.labels(self.pipeline, frame.source, obj.label).inc()
        latency: float | None = max(0.0, message["publish_ts"] - frame.capture_ts)
        if self.url is None:
            # No NATS: the message went to this process only.
            self._sent(frame.source, "detections")
        else:
            assert self.nc is not None
            subject = subject_for(self.config.subject_prefix, self.pipeline, frame.source)
            msg_id = f"{self.pipeline}/{frame.source}/{stream_id}/{frame.index}"
            sent = await self._send(
                subject, frame.source, encode(message), msg_id, "detections", f"frame {frame.index}"
            )
            latency = latency if sent else None
        if latency is not None:
            self.metrics.e2e_latency.labels(self.pipeline, frame.source).observe(latency)
        if frame.events and self.url is not None:
            await self.publish_events(frame.source, frame.events, stream_id, str(frame.index))
        return latency

    async def publish_events(self, source: str, events: list[Event], stream_id: str, key: str) -> None:
        """Publish ``events`` of ``source``, one message each, in order.

        ``key`` (the frame's index, or ``end`` for those a source's end closes) and
        each event's place in ``events`` make its de-duplication id.
        """
        subject = events_subject(self.config.subject_prefix, self.pipeline, source)
        owner = self.fence.owner(source) if self.fence is not None else None
        for n, event in enumerate(events):
            message = event.to_message(self.pipeline, source)
            if owner is not None:
                message["worker"], message["epoch"], message["lease"] = owner
            payload = encode(message)
            msg_id = f"{self.pipeline}/{source}/{stream_id}/{key}/{n}"
            await self._send(subject, source, payload, msg_id, event.type, f"{event.type} event of {key}")

    def publish_clip(
        self, subject: str, source: str, message: dict[str, Any], stream_id: str, key: str
    ) -> None:
        """Send a clips message of ``source`` the way events go (outbox or acks), without waiting.

        ``stream_id`` and ``key`` (``<event frame>/clip-<k>``) make its de-duplication id.
        Called on the event loop; :meth:`close` waits for the messages still on their way.
        """
        if self.url is None:
            return  # no NATS: the clip is logged and kept, nothing is sent anywhere
        msg_id = f"{self.pipeline}/{source}/{stream_id}/{key}"
        self._send_aside(subject, source, encode(message), msg_id, "clips", "clip")

    def publish_status(self, source: str, message: dict[str, Any], msg_id: str) -> None:
        """Send a source's status message (``nats.status``) the way clips go, without waiting.

        In a fleet it carries the publishing worker's fence, as events do.
        """
        if self.url is None:
            return
        owner = self.fence.owner(source) if self.fence is not None else None
        if owner is not None:
            message["worker"], message["epoch"], message["lease"] = owner
        subject = status_subject(self.config.subject_prefix, self.pipeline, source)
        self._send_aside(subject, source, encode(message), msg_id, "status", f"{message['state']} status")

    def _send_aside(
        self, subject: str, source: str, payload: bytes, msg_id: str, kind: str, what: str
    ) -> None:
        """A message outside a source's frame order (clips, status) sent by a task of its own."""
        task = asyncio.create_task(
            self._deliver_aside(subject, source, payload, msg_id, kind, what), name="nats-aside"
        )
        self._aside.add(task)
        task.add_done_callback(self._aside.discard)

    async def _deliver_aside(
        self, subject: str, source: str, payload: bytes, msg_id: str, kind: str, what: str
    ) -> None:
        if self.nc is None:
            self._unsent(collections.Counter([source]))  # announced after the stop: lost as at it
            return
        try:
            await self._send(subject, source, payload, msg_id, kind, what)
        except asyncio.CancelledError:
            # The stop gave up on it (JetStream had not acknowledged it): counted as not sent.
            self._unsent(collections.Counter([source]))
            raise
        except PublishError:
            pass  # the connection closed: already counted and logged as failed

    async def _finish_aside(self, timeout: float) -> None:
        """Wait up to ``timeout`` s for the clips and status messages on their way; give up on the rest."""
        if not self._aside:
            return
        _, late = await asyncio.wait(set(self._aside), timeout=timeout)
        for task in late:
            task.cancel()
        await asyncio.gather(*late, return_exceptions=True)

    async def _send(
        self, subject: str, source: str, payload: bytes, msg_id: str, kind: str, what: str
    ) -> bool:
        """One message, the way the mode asks; True when it left now (not queued, not dropped)."""
        assert self.nc is not None
        if self.fence is not None and not self.fence.may_publish(source):
            return False  # the fence counts what it refused
        size = len(payload) + (len(msg_id) + _HEADER_BYTES if self.js is not None else 0)
        limit = self.nc.max_payload
        if limit and size > limit:
            self.metrics.publish_errors.labels(self.pipeline, source, "too_large").inc()
            problem = (
                f"the {what} message of {source} is {size} bytes, over the NATS server's max_payload "
                f"({limit} bytes) at {self.display_url}; dropped (raise max_payload in the server's "
                "config, or have fewer objects per frame: classes, max_objects)"
            )
            if kind == "detections":
                raise MessageTooLarge(problem)
            self._errors(f"too_large:{source}", problem)
            return False
        if self.js is not None:
            await self._publish_acked(subject, source, what, payload, msg_id)
        elif self.nc.is_connected and not self._outbox:
            try:
                await self.nc.publish(subject, payload)
            except Exception as exc:
                self._error(source, exc)
                return False
        else:
            # Keep order: once anything waits in the outbox, new messages queue behind it.
            self._queue((subject, source, payload, kind))
            return False
        self._sent(source, kind)
        return True

    async def _publish_acked(self, subject: str, source: str, what: str, payload: bytes, msg_id: str) -> None:
        assert self.js is not None
        headers = {"Nats-Msg-Id": msg_id}
        failures = 0
        while True:
            if self.fence is not None and not self.fence.may_publish(source):
                return  # the lease ran out while retrying: another worker may own the source now
            try:
                await self.js.publish(subject, payload, headers=headers, timeout=2.0)
                return
            except Exception as exc:
                if self.nc is None or self.nc.is_closed:
                    self._error(source, exc)
                    raise PublishError(f"NATS connection closed; {what} of {source} not sent") from None
                self.metrics.publish_errors.labels(self.pipeline, source, "retry").inc()
                log.debug("retrying %s of %s: %s", what, source, exc)
                await asyncio.sleep(backoff_delay(failures, ACK_RETRY, 0.5))
                failures += 1

    def _queue(self, item: tuple[str, str, bytes, str]) -> None:
        """Put ``item`` in the outbox (dropping the oldest when full) and make sure a task sends it."""
        if len(self._outbox) >= self.config.outbox_size:
            _, dropped_source, _, _ = self._outbox.popleft()
            self._overflow(dropped_source)
        self._outbox.append(item)
        self._drained.clear()
        if not self.flushing and not self._closing:
            self._flusher = asyncio.create_task(self._flush_outbox(), name="nats-outbox")

    async def _flush_outbox(self) -> None:
        """Send the outbox oldest first; return once it is empty.

        While the connection is down this waits for ``connected``, which the reconnect
        callback sets: nothing wakes up on a timer. nats-py would buffer a publish made
        while reconnecting too, but by bytes, failing when full, and it would send it
        without asking the fence again; so messages wait here until the link is back.
        """
        try:
            while self._outbox and self.nc is not None:
                if not self.nc.is_connected:
                    # Cleared here as well: the disconnect callback may not have run yet.
                    self.connected.clear()
                    await self.connected.wait()
                    continue
                # Taken out before the await: a full outbox drops its oldest meanwhile.
                item = subject, source, payload, kind = self._outbox.popleft()
                if self.fence is not None and not self.fence.may_publish(source):
                    continue  # queued under a lease that may have passed on; the fence counts it
                try:
                    await self.nc.publish(subject, payload)
                except Exception as exc:
                    if self.nc is not None and self.nc.is_connected:
                        self._error(source, exc)  # this message cannot go (too big, bad subject)
                    else:
                        self._putback(item)  # the link went: it goes first once it is back
                    continue
                self._sent(source, kind)
        finally:
            if not self._outbox:
                self._drained.set()

    def _putback(self, item: tuple[str, str, bytes, str]) -> None:
        """Return the message a lost link interrupted to the head of the outbox, keeping the bound."""
        self._outbox.appendleft(item)
        if len(self._outbox) > self.config.outbox_size:
            self._outbox.popleft()
            self._overflow(item[1])

    def _overflow(self, source: str) -> None:
        """Count (and say, once per 10 s) a message of ``source`` the full outbox dropped."""
        self.metrics.publish_errors.labels(self.pipeline, source, "outbox_full").inc()
        self.overflowed[source] = self.overflowed.get(source, 0) + 1
        self._warnings(
            "outbox_full",
            f"NATS at {self.display_url} is away and the outbox is full ({self.config.outbox_size} "
            "messages): the oldest are dropped (raise nats.outbox_size, or publish: jetstream to "
            "wait for the broker instead)",
        )

    def _unsent(self, lost: collections.Counter[str]) -> None:
        """Count, and say, the messages of each source the stop gave up on."""
        for source, n in lost.items():
            self.metrics.publish_errors.labels(self.pipeline, source, "shutdown").inc(n)
            self.unsent[source] = self.unsent.get(source, 0) + n
        if lost:
            log.warning(
                "%d message(s) not sent: NATS at %s did not take them before the stop (%s)",
                sum(lost.values()),
                self.display_url,
                ", ".join(f"{source} {n}" for source, n in sorted(lost.items())),
            )

    def _sent(self, source: str, kind: str) -> None:
        if kind in ("clips", "status"):
            return  # vidpipe_events_total counts events only
        if kind != "detections":
            self.metrics.events.labels(self.pipeline, source, kind).inc()
            return
        # Counted once, by the listener (the runtime's source counters, which /metrics reads).
        if self._on_sent is not None:
            self._on_sent(source)

    def _error(self, source: str, exc: Exception) -> None:
        self.metrics.publish_errors.labels(self.pipeline, source, "failed").inc()
        self._errors(
            f"publish:{type(exc).__name__}",
            f"publishing for {source} failed: {type(exc).__name__}: {exc}; message dropped",
        )

    async def close(self, timeout: float = 5.0) -> None:
        """Flush what is pending, then close the connection."""
        deadline = time.monotonic() + timeout
        # First the clips and status messages on their way: in core mode they join the outbox now.
        await self._finish_aside(timeout)
        self._closing = True
        if self.nc is None:
            return
        if self._outbox:
            # Waited for whether the link is up or not: a broker back within the timeout
            # still gets what was accepted.
            if not self.nc.is_connected:
                log.warning(
                    "stopping: %d message(s) wait for NATS at %s, which is not connected; "
                    "waiting up to %gs for it",
                    len(self._outbox),
                    self.display_url,
                    timeout,
                )
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._drained.wait(), max(0.0, deadline - time.monotonic()))
        await cancel_and_wait(self._flusher)
        lost = collections.Counter(source for _, source, _, _ in self._outbox)
        self._outbox.clear()
        self._unsent(lost)
        try:
            if self.nc.is_connected:
                await self.nc.flush(timeout=max(1, int(deadline - time.monotonic())))
        except Exception as exc:
            log.warning("NATS flush at shutdown failed: %s", exc)
        try:
            # Bounded: a stalled link never answers, and a stop must not wait for it.
            await asyncio.wait_for(self.nc.close(), 5.0)
        except Exception:  # closing a broken connection may raise; nothing left to do
            log.debug("NATS close failed", exc_info=True)
        self.nc = None


def _connect_error(exc: Exception) -> str:
    """nats-py's error in an operator's words: its text without the ``nats:`` prefix and quotes."""
    text = str(exc).strip() or type(exc).__name__
    text = text.removeprefix("nats: ").strip("'\"")
    if isinstance(exc, OSError) and exc.errno is not None:
        text = os.strerror(exc.errno).lower()
    if "authorization violation" in text.lower():
        text += " (check the user and password, or token, in the NATS URL)"
    return text
