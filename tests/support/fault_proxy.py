"""A TCP proxy that can cut, stall or slow a client's links to NATS: faults for fleet trials.

One :class:`Faults` per client (a fleet worker) and one :class:`Proxy` per NATS
node it may reach; the worker is given the proxies' URLs instead of the nodes'::

    faults = Faults()
    proxy = Proxy(faults, node_port)
    await proxy.start()                  # the worker connects to proxy.url
    faults.set("stall")                  # hold every byte both ways, deliver it later
    faults.set("cut")                    # reset every connection and refuse new ones
    faults.set("slow", delay=1.0)        # deliver every chunk a second late
    faults.set("stall", publisher_only=True)  # only the pipeline's publishing connection
    faults.set("ok")

A connection is the publishing one when its ``CONNECT`` names it ``vidpipe-<pipeline>``
(the fleet's own is ``vidpipe-fleet-<worker>``). Used by ``bench/fleet.py`` and the
fleet tests.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import socket
import struct
import time
from dataclasses import dataclass, field
from typing import Any

from pipeline.nats_server import free_port


@dataclass
class Faults:
    """What a worker's links suffer now; ``publisher_only`` limits it to the publishing connection."""

    mode: str = "ok"  # ok, stall, cut, slow
    delay: float = 0.0
    publisher_only: bool = False
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    links: set[Link] = field(default_factory=set)

    def set(self, mode: str, delay: float = 0.0, publisher_only: bool = False) -> None:
        self.mode, self.delay, self.publisher_only = mode, delay, publisher_only
        if mode == "cut":
            for link in list(self.links):
                if self.applies(link):
                    link.reset()
        self.changed.set()
        self.changed = asyncio.Event()

    def applies(self, link: Link) -> bool:
        return not self.publisher_only or link.publisher


class Link:
    """One proxied client connection: two pumps, each a queue of (due time, bytes)."""

    def __init__(self, faults: Faults, client: Any, upstream: Any) -> None:
        self.faults = faults
        self.client = client  # (reader, writer)
        self.upstream = upstream
        self.publisher = False
        self.tasks: list[asyncio.Task[None]] = []

    def reset(self) -> None:
        for _, writer in (self.client, self.upstream):
            sock = writer.get_extra_info("socket")
            if sock is not None:
                with contextlib.suppress(OSError):
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            writer.close()
        for t in self.tasks:
            t.cancel()

    async def pump(self, reader: Any, writer: Any, from_client: bool) -> None:
        queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()

        async def read() -> None:
            first = from_client
            while data := await reader.read(65536):
                if first:
                    # The client's CONNECT names it: vidpipe-fleet-<id> or vidpipe-<pipeline>.
                    named = re.search(r'"name":\s*"(vidpipe-[^"]*)"', data.decode("latin-1"))
                    self.publisher = named is not None and not named[1].startswith("vidpipe-fleet-")
                    first = False
                delay = self.faults.delay if self.faults.mode == "slow" and self.faults.applies(self) else 0.0
                await queue.put((time.monotonic() + delay, data))
            await queue.put((0.0, b""))

        async def write() -> None:
            while True:
                due, data = await queue.get()
                while self.faults.mode == "stall" and self.faults.applies(self):
                    await self.faults.changed.wait()
                wait = due - time.monotonic()
                if wait > 0:
                    await asyncio.sleep(wait)
                if not data:
                    writer.close()
                    return
                writer.write(data)
                await writer.drain()

        reading = asyncio.create_task(read())
        try:
            await write()
        finally:
            reading.cancel()


class Proxy:
    """Listens on a free port and forwards to one node, through a worker's :class:`Faults`."""

    def __init__(self, faults: Faults, target_port: int) -> None:
        self.faults = faults
        self.target_port = target_port
        self.port = free_port()
        self.server: asyncio.Server | None = None

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"

    async def start(self) -> None:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", self.port)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self.faults.mode == "cut" and not self.faults.publisher_only:
            writer.close()
            return
        try:
            up = await asyncio.open_connection("127.0.0.1", self.target_port)
        except OSError:
            writer.close()
            return
        link = Link(self.faults, (reader, writer), up)
        self.faults.links.add(link)
        link.tasks = [
            asyncio.create_task(link.pump(reader, up[1], True)),
            asyncio.create_task(link.pump(up[0], writer, False)),
        ]
        try:
            await asyncio.gather(*link.tasks, return_exceptions=True)
        finally:
            self.faults.links.discard(link)
            for w in (writer, up[1]):
                w.close()

    async def stop(self) -> None:
        if self.server is not None:
            self.server.close()
        for link in list(self.faults.links):
            link.reset()
