"""The HTTP server under attack: a live server on a real socket, hostile clients.

Each test stands for one hole found in a running instance: idle and slow sockets,
the open-file limit, too many sources, cross-site requests, ambiguous bodies,
probing for files, and model configs that would run a package's code.
"""

from __future__ import annotations

import asyncio
import os
import resource
import socket
import subprocess
import sys
import time
from pathlib import Path

from pipeline.nats_server import EmbeddedNats
from tests.conftest import ROOT
from tests.pipeline.stack import Stack

CONFIG = """\
pipeline: hostile
sources:{sources}
nats: {{url: "{nats}"}}
http: {{listen: "127.0.0.1:0"{http}}}
{extra}"""


def config(nats: EmbeddedNats, *sources: str, http: str = "", extra: str = "") -> str:
    block = "".join(f"\n  - {s}" for s in sources) or " []"
    return CONFIG.format(sources=block, nats=nats.url, http=f", {http}" if http else "", extra=extra)


async def closed_within(reader: asyncio.StreamReader, timeout: float) -> float | None:
    """Seconds until the server closed the connection, or None if it stayed open ``timeout``."""
    t0 = time.monotonic()
    try:
        while await asyncio.wait_for(reader.read(65536), timeout - (time.monotonic() - t0)):
            pass
    except TimeoutError:
        return None
    except ConnectionError:
        pass
    return time.monotonic() - t0


async def healthz(port: int, timeout: float = 3.0) -> bytes:
    """The raw answer to one ``GET /healthz`` on a fresh connection."""
    reader, writer = await asyncio.wait_for(asyncio.open_connection("127.0.0.1", port), timeout)
    try:
        writer.write(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
        return await asyncio.wait_for(reader.read(), timeout)
    finally:
        writer.close()


# -- 1. connection limits --------------------------------------------------------------------


async def test_connections_over_the_cap_are_closed_at_once(tmp_path: Path, nats_server: EmbeddedNats) -> None:
    stack = await Stack.start(
        tmp_path, config(nats_server, http="max_connections: 4, header_timeout: 60"), nats_server.url
    )
    port = stack.api.port
    assert port is not None
    held = [await asyncio.open_connection("127.0.0.1", port) for _ in range(4)]
    try:
        await asyncio.sleep(0.3)  # all four accepted and idle
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        elapsed = await closed_within(reader, 3.0)
        writer.close()
        assert elapsed is not None and elapsed < 1.0, "the fifth connection was kept open"
        for _, w in held:
            w.close()
        await asyncio.sleep(0.3)
        answer = await healthz(port)
        assert answer.startswith(b"HTTP/1.1 200 OK"), answer
        assert answer.endswith(b'{"status": "ok"}')
    finally:
        for _, w in held:
            w.close()
        await stack.close()


async def test_slow_request_head_is_cut_off(tmp_path: Path, nats_server: EmbeddedNats) -> None:
    stack = await Stack.start(tmp_path, config(nats_server, http="header_timeout: 2"), nats_server.url)
    port = stack.api.port
    assert port is not None
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        closed = asyncio.create_task(closed_within(reader, 8.0))
        writer.write(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n")
        # A header byte every half second: each one resets nothing.
        for _ in range(16):
            if closed.done():
                break
            await asyncio.sleep(0.5)
            if not writer.is_closing():
                writer.write(b"X")
        elapsed = await closed
        assert elapsed is not None, "a trickled request head kept the connection for 8 s"
        assert 1.8 <= elapsed < 3.5, elapsed
    finally:
        writer.close()
        await stack.close()


async def test_idle_keepalive_connection_is_closed(tmp_path: Path, nats_server: EmbeddedNats) -> None:
    stack = await Stack.start(
        tmp_path, config(nats_server, http="keepalive_timeout: 1, header_timeout: 60"), nats_server.url
    )
    port = stack.api.port
    assert port is not None
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        head = await reader.readuntil(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200 OK")
        length = int(
            next(x for x in head.split(b"\r\n") if x.lower().startswith(b"content-length")).split(b":")[1]
        )
        assert await reader.readexactly(length) == b'{"status": "ok"}'
        elapsed = await closed_within(reader, 5.0)
        assert elapsed is not None, "an idle keep-alive connection was kept open"
        assert 0.5 <= elapsed < 3.0, elapsed
    finally:
        writer.close()
        await stack.close()


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def test_open_file_limit_no_flood_no_busy_loop(tmp_path: Path, nats_server: EmbeddedNats) -> None:
    path = tmp_path / "p.yaml"
    path.write_text(config(nats_server))
    fd_limit = 256

    def low_fd_limit() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (fd_limit, fd_limit))

    stderr = (tmp_path / "stderr.txt").open("w+")
    proc = subprocess.Popen(
        [sys.executable, "-m", "pipeline.cli", "run", str(path)],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=stderr,
        preexec_fn=low_fd_limit,
    )
    sockets: list[socket.socket] = []
    try:
        deadline = time.monotonic() + 60
        port = None
        while port is None:
            assert proc.poll() is None, Path(stderr.name).read_text()
            assert time.monotonic() < deadline, Path(stderr.name).read_text()
            for line in Path(stderr.name).read_text().splitlines():
                if "HTTP API on http://127.0.0.1:" in line:
                    port = int(line.rsplit(":", 1)[1].split()[0])
            time.sleep(0.1)
        lines_before = len(Path(stderr.name).read_text().splitlines())
        cpu_before = _cpu_seconds(proc.pid)

        # Twice the process's descriptors, all silent.
        for _ in range(2 * fd_limit):
            s = socket.socket()
            s.setblocking(False)
            s.connect_ex(("127.0.0.1", port))
            sockets.append(s)
        time.sleep(3.0)
        # While they are open the server still answers every new connection at once
        # (here by refusing it: the cap is below the descriptor limit).
        t0 = time.monotonic()
        probe = socket.create_connection(("127.0.0.1", port), timeout=2.0)
        try:
            probe.sendall(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
            answer = probe.recv(4096)
        except ConnectionError:
            answer = b""
        except TimeoutError:
            answer = b"(no answer)"
        probe.close()
        assert time.monotonic() - t0 < 1.5
        assert answer == b"" or answer.startswith(b"HTTP/1.1 200"), answer
        for s in sockets:
            s.close()
        sockets.clear()

        async def recovered() -> bytes:
            end = time.monotonic() + 5
            while True:
                try:
                    return await healthz(port, timeout=1.0)
                except (OSError, TimeoutError):
                    if time.monotonic() > end:
                        raise
                    await asyncio.sleep(0.2)

        assert asyncio.run(recovered()).startswith(b"HTTP/1.1 200 OK")
        cpu = _cpu_seconds(proc.pid) - cpu_before
        assert cpu < 1.0, f"{cpu:.2f} s of CPU while idle sockets were open"
        text = Path(stderr.name).read_text()
        new_lines = text.splitlines()[lines_before:]
        assert len(new_lines) <= 3, "\n".join(new_lines[:20])
        assert "http.max_connections 256 lowered to 128: half of this process's open-file limit (256)" in text
        assert proc.poll() is None
    finally:
        for s in sockets:
            s.close()
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        stderr.close()
