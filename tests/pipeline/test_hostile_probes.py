"""Health probes under a flood of idle sockets, against a live ``vidpipe run`` server.

The flood (``tests/support/socket_flood.py``) holds 1,500 silent connections and
re-opens each one the server closes. 1,500 is what the issue's reproduction held;
the test process and the server each keep well inside this machine's open-file
limit with it (the test raises its own soft limit to the hard one first).
"""

from __future__ import annotations

import asyncio
import resource
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from pipeline.nats_server import EmbeddedNats
from tests.conftest import ROOT
from tests.pipeline.stack import Stack, until
from tests.support.processes import stop_process
from tests.support.socket_flood import SocketFlood

FLOOD = 1500
FLOOD_SOURCES = [f"127.0.0.{i}" for i in range(2, 10)]


@pytest.fixture
def server(tmp_path: Path, nats_server: EmbeddedNats) -> Iterator[int]:
    """A ``vidpipe run`` with default connection limits and one test pattern; yields its HTTP port."""
    path = tmp_path / "p.yaml"
    path.write_text(
        'pipeline: probes\nsources: [{url: "test://?width=64&height=48&fps=5"}]\n'
        f'nats: {{url: "{nats_server.url}"}}\nhttp: {{listen: "127.0.0.1:0"}}\n'
    )
    stderr_path = tmp_path / "stderr.txt"
    with stderr_path.open("w+") as stderr:
        proc = subprocess.Popen(
            [sys.executable, "-m", "pipeline.cli", "run", str(path)],
            cwd=ROOT,
            stdout=subprocess.DEVNULL,
            stderr=stderr,
        )
        try:
            deadline = time.monotonic() + 60
            port = None
            while port is None:
                assert proc.poll() is None, stderr_path.read_text()
                assert time.monotonic() < deadline, stderr_path.read_text()
                for line in stderr_path.read_text().splitlines():
                    if "HTTP API on http://127.0.0.1:" in line:
                        port = int(line.rsplit(":", 1)[1].split()[0])
                time.sleep(0.1)
            yield port
        finally:
            stop_process(proc)


def probe(port: int, path: str, source: str = "127.0.0.1", timeout: float = 2.0) -> tuple[float, bytes]:
    """Seconds to a complete answer to ``GET path`` on a fresh connection from ``source``, and the answer."""
    t0 = time.monotonic()
    with socket.socket() as sock:
        sock.settimeout(timeout)
        sock.bind((source, 0))
        sock.connect(("127.0.0.1", port))
        sock.sendall(f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n".encode())
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
            sock.settimeout(max(0.01, timeout - (time.monotonic() - t0)))
    return time.monotonic() - t0, answer


def ready(port: int) -> bool:
    try:
        return probe(port, "/readyz")[1].startswith(b"HTTP/1.1 200 OK")
    except OSError:
        return False


def test_probes_answer_while_1500_idle_sockets_are_held(server: int) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < 4 * FLOOD:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, 4 * FLOOD), hard))
    with SocketFlood(server, FLOOD, FLOOD_SOURCES) as flood:
        # Wait until the flood holds its sockets and the server has shed some of them
        # (and until the pattern is up, so /readyz says 200).
        deadline = time.monotonic() + 30
        while flood.held < FLOOD or flood.reopened < 100 or not ready(server):
            assert time.monotonic() < deadline, (flood.held, flood.reopened)
            time.sleep(0.05)
        results = []
        # From an address of its own and from a flooding address (its per-client cap is full).
        for source in ("127.0.0.1", FLOOD_SOURCES[0]):
            for path in ("/healthz", "/readyz") * 5:
                try:
                    elapsed, answer = probe(server, path, source)
                except OSError as exc:
                    elapsed, answer = 99.0, repr(exc).encode()
                results.append((source, path, round(elapsed, 3), answer.split(b"\r\n", 1)[0]))
        assert flood.held >= FLOOD - 50, flood.held  # still flooding while the probes ran
    # Only the probes that failed, so a failure says which and how.
    failed = [r for r in results if r[3] != b"HTTP/1.1 200 OK" or r[2] >= 2.0]
    assert failed == [], (failed, flood.held, flood.reopened)


async def test_the_cap_evicts_the_oldest_silent_connection_and_refuses_when_all_are_busy(
    tmp_path: Path, nats_server: EmbeddedNats
) -> None:
    http = 'listen: "127.0.0.1:0", max_connections: 4, header_timeout: 60'
    yaml = f'pipeline: probes\nsources: []\nnats: {{url: "{nats_server.url}"}}\nhttp: {{{http}}}\n'
    stack = await Stack.start(tmp_path, yaml, nats_server.url)
    port = stack.api.port
    assert port is not None
    try:
        # Four silent connections fill the cap; a fifth takes the oldest one's place.
        silent = [await asyncio.open_connection("127.0.0.1", port) for _ in range(4)]
        await asyncio.sleep(0.3)  # all four accepted
        assert stack.api.site is not None and stack.api.site.stats.open == 4
        elapsed, answer = await asyncio.to_thread(probe, port, "/healthz")
        assert answer.startswith(b"HTTP/1.1 200 OK") and elapsed < 1.0
        assert await asyncio.wait_for(silent[0][0].read(), 2.0) == b""  # the oldest was closed
        assert stack.api.site.stats.evicted == 1
        for _, writer in silent:
            writer.close()
        # Four keep-alive connections that each sent a request: none may be evicted.
        busy = []
        for _ in range(4):
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
            assert (await reader.readuntil(b'{"status": "ok"}')).startswith(b"HTTP/1.1 200 OK")
            busy.append((reader, writer))
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        assert await asyncio.wait_for(reader.read(), 2.0) == b""  # closed: it never spoke
        writer.close()
        assert stack.api.site.stats.refused >= 1
        for _, writer in busy:
            writer.close()
    finally:
        await stack.close()


async def test_one_client_address_holds_at_most_its_cap(tmp_path: Path, nats_server: EmbeddedNats) -> None:
    http = 'listen: "127.0.0.1:0", max_connections: 16, max_connections_per_client: 3, header_timeout: 60'
    yaml = f'pipeline: probes\nsources: []\nnats: {{url: "{nats_server.url}"}}\nhttp: {{{http}}}\n'
    stack = await Stack.start(tmp_path, yaml, nats_server.url)
    port = stack.api.port
    assert port is not None and stack.api.site is not None
    site = stack.api.site
    try:
        held = []
        for source in ("127.0.0.2", "127.0.0.2", "127.0.0.2", "127.0.0.3"):
            held.append(await asyncio.open_connection("127.0.0.1", port, local_addr=(source, 0)))
        await until(lambda: site.per_client == {"127.0.0.2": 3, "127.0.0.3": 1}, what="four connections")
        # A fourth silent one from 127.0.0.2 takes no slot: it is closed when it stays silent.
        reader, writer = await asyncio.open_connection("127.0.0.1", port, local_addr=("127.0.0.2", 0))
        assert await asyncio.wait_for(reader.read(), 2.0) == b""
        writer.close()
        assert (site.stats.open, site.stats.evicted, site.per_client["127.0.0.2"]) == (4, 0, 3)
        # One that speaks takes the place of 127.0.0.2's oldest silent connection.
        elapsed, answer = await asyncio.to_thread(probe, port, "/healthz", "127.0.0.2")
        assert answer.startswith(b"HTTP/1.1 200 OK") and elapsed < 1.0
        assert await asyncio.wait_for(held[0][0].read(), 2.0) == b""
        assert site.stats.evicted == 1
        assert site.per_client["127.0.0.3"] == 1  # another address's connection was never touched
        for _, w in held:
            w.close()
    finally:
        await stack.close()


async def test_stopping_the_server_closes_its_socket_and_the_silent_connections(
    tmp_path: Path, nats_server: EmbeddedNats
) -> None:
    http = 'listen: "127.0.0.1:0", header_timeout: 60'
    yaml = f'pipeline: probes\nsources: []\nnats: {{url: "{nats_server.url}"}}\nhttp: {{{http}}}\n'
    stack = await Stack.start(tmp_path, yaml, nats_server.url)
    port = stack.api.port
    assert port is not None and stack.api.site is not None
    site = stack.api.site
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        await until(lambda: site.stats.open == 1, what="the silent connection to be held")
    finally:
        await stack.close()
    # Held silent with a minute to go, it is closed by the stop, not by its deadline.
    assert await asyncio.wait_for(reader.read(), 2.0) == b""
    writer.close()
    assert site.stats.open == 0
    with pytest.raises(ConnectionRefusedError):
        await asyncio.open_connection("127.0.0.1", port)
