"""The HTTP server under attack: a live server on a real socket, hostile clients.

Each test stands for one hole found in a running instance: idle and slow sockets,
the open-file limit, too many sources, cross-site requests, ambiguous bodies,
probing for files, and model configs that would run a package's code.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import resource
import shutil
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import aiohttp
import pytest

from inference.repository import ModelRepository
from inference.schema import ConfigError
from pipeline.config import load_config
from pipeline.nats_server import EmbeddedNats
from tests.conftest import ROOT, run_cli
from tests.pipeline.stack import Stack
from tests.support.processes import stop_process

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


# The cap's eviction of silent connections and the per-client cap: test_hostile_probes.py.


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


def test_a_request_that_is_not_valid_http_is_one_warning_line(
    tmp_path: Path, nats_server: EmbeddedNats
) -> None:
    path = tmp_path / "p.yaml"
    path.write_text(config(nats_server))
    proc = subprocess.Popen(
        [sys.executable, "-m", "pipeline.cli", "run", str(path)],
        cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert proc.stderr is not None
        while "HTTP API on http://127.0.0.1:" not in (line := proc.stderr.readline()):
            assert line, "vidpipe ended before its API was up"
        port = int(line.rsplit(":", 1)[1].split()[0])
        with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
            sock.sendall(
                b"POST /v1/sources HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: a\r\n"
                b"Content-Type: b\r\nContent-Length: 0\r\n\r\n"
            )
            answer = sock.recv(4096)
    finally:
        stop_process(proc)  # type: ignore[arg-type]
    err = proc.stderr.read()
    assert answer.startswith(b"HTTP/1.0 400 Bad Request\r\n"), answer
    said = [ln.split(" ", 1)[1] for ln in err.splitlines() if "not valid HTTP" in ln]
    assert said == [
        "warning HTTP: refused a request from 127.0.0.1 that is not valid HTTP: "
        "Duplicate 'Content-Type' header found."
    ], err
    assert " error " not in err, err


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
        stop_process(proc)
        stderr.close()


# -- 2. sources per process ------------------------------------------------------------------


def test_config_with_more_sources_than_the_limit_names_the_line(tmp_path: Path) -> None:
    path = tmp_path / "p.yaml"
    path.write_text(
        "pipeline: p\nruntime: {max_sources: 2}\nsources:\n"
        "  - url: test://?id=a\n  - url: test://?id=b\n  - url: test://?id=c\n"
    )
    with pytest.raises(ConfigError) as caught:
        load_config(path)
    assert str(caught.value) == (
        f"{path}:6: sources: 3 sources, more than runtime.max_sources (2)"
        " (hint: run fewer sources per process, or raise runtime.max_sources)"
    )
    # The default is 64.
    path.write_text("pipeline: p\nsources:\n" + "".join(f"  - url: test://?id=s{i}\n" for i in range(65)))
    with pytest.raises(ConfigError, match=r":67: sources: 65 sources, more than runtime.max_sources \(64\)"):
        load_config(path)


async def test_sources_over_the_limit_are_refused_without_a_thread(
    tmp_path: Path, nats_server: EmbeddedNats
) -> None:
    stack = await Stack.start(
        tmp_path,
        config(nats_server, '{id: a, url: "test://?fps=5"}', extra="runtime: {max_sources: 2}\n"),
        nats_server.url,
    )
    try:
        status, body = await stack.json("POST", "/v1/sources", json={"id": "b", "url": "test://?fps=5"})
        assert status == 201, body
        threads = threading.active_count()
        for i in range(20):
            status, body = await stack.json(
                "POST", "/v1/sources", json={"id": f"x{i}", "url": "test://?fps=5"}
            )
            assert (status, body) == (
                429,
                {
                    "error": "runtime.max_sources: 2 source(s) already, the limit of this process; "
                    "remove one first or raise runtime.max_sources"
                },
            )
        assert threading.active_count() == threads
        assert sorted(stack.runtime.sources) == ["a", "b"]
        # Removing one makes room again.
        assert (await stack.json("DELETE", "/v1/sources/a"))[0] == 204
        assert (await stack.json("POST", "/v1/sources", json={"id": "c", "url": "test://?fps=5"}))[0] == 201
    finally:
        await stack.close()


# -- 3. cross-site requests ------------------------------------------------------------------

RELOAD_PIPELINE = """\
pipeline: hot
models: {models}
nats: {{url: "{nats}"}}
http: {{listen: "127.0.0.1:0"}}
sources:
  - {{id: cam, url: "test://?fps=10&width=160&height=120"}}
stages:
  - {{name: objects, type: infer, model: squares}}
"""


def reloads(caplog: pytest.LogCaptureFixture, name: str) -> int:
    return sum(r.getMessage().startswith(f"model {name} reloaded: ") for r in caplog.records)


async def test_cross_site_requests_cannot_change_state(
    tmp_path: Path, sample_models: Path, nats_server: EmbeddedNats, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="vidpipe.inference.repository")
    repo = tmp_path / "models"
    shutil.copytree(sample_models / "squares", repo / "squares")
    shutil.copytree(sample_models / "squares", repo / "spare")
    spare = repo / "spare" / "config.yaml"
    spare.write_text(spare.read_text().replace("name: squares", "name: spare"))
    stack = await Stack.start(
        tmp_path, RELOAD_PIPELINE.format(models=repo, nats=nats_server.url), nats_server.url
    )
    own = stack.api.url
    try:
        # What a page on another site can make a browser send: a form post, no preflight.
        status, body = await stack.json(
            "POST",
            "/v1/models/squares/reload",
            data="x=1",
            headers={"Content-Type": "application/x-www-form-urlencoded", "Origin": "http://evil.example"},
        )
        assert (status, body) == (
            403,
            {"error": "cross-site request refused (Origin 'http://evil.example' is not this server)"},
        )
        status, body = await stack.json(
            "POST", "/v1/models/squares/reload", json={}, headers={"Sec-Fetch-Site": "cross-site"}
        )
        assert (status, body) == (403, {"error": "cross-site request refused (Sec-Fetch-Site: cross-site)"})
        for method, path in (
            ("POST", "/v1/sources"),
            ("DELETE", "/v1/sources/cam"),
            ("POST", "/whip/cam"),
            ("DELETE", "/whip/cam/x"),
            ("POST", "/whep/cam"),
            ("DELETE", "/whep/cam/x"),
            ("DELETE", "/v1/models/spare"),
        ):
            status, body = await stack.json(method, path, json={"url": "test://"}, headers={"Origin": "null"})
            assert status == 403, (method, path, body)
        assert sorted(stack.runtime.sources) == ["cam"]
        # A live-view offer is SDP, nothing else.
        status, body = await stack.json("POST", "/whep/cam", json={"sdp": "v=0"})
        assert (status, body) == (
            415,
            {"error": "Content-Type must be application/sdp, got 'application/json'"},
        )
        # The form type is refused even without an Origin (a non-browser client that forgot it).
        status, body = await stack.json(
            "POST",
            "/v1/models/squares/reload",
            data="x=1",
            headers={"Content-Type": "application/x-www-form-urlencoded"},
        )
        assert (status, body) == (
            415,
            {"error": "Content-Type must be application/json, got 'application/x-www-form-urlencoded'"},
        )
        assert reloads(caplog, "squares") == 0

        # The dashboard's own requests carry the server's origin.
        status, body = await stack.json("POST", "/v1/models/squares/reload", json={}, headers={"Origin": own})
        assert (status, body["state"]) == (200, "ready"), body
        assert reloads(caplog, "squares") == 1

        # Two reloads at once: one reload, one answer for both. On a busy machine the second
        # request can arrive after the first reload is done: then it is a reload of its own.
        (s1, b1), (s2, b2) = await asyncio.gather(
            stack.json("POST", "/v1/models/squares/reload", json={}),
            stack.json("POST", "/v1/models/squares/reload", json={}),
        )
        assert (s1, s2) == (200, 200)
        done = reloads(caplog, "squares") - 1
        assert done in (1, 2), done
        assert done == 2 or b1 == b2, (b1, b2)

        # A model the pipeline does not use: only on request.
        status, body = await stack.json("POST", "/v1/models/spare/reload", json={})
        assert (status, body) == (
            409,
            {
                "error": "model 'spare' is not used by this pipeline; send {\"force\": true} to reload it anyway"
            },
        )
        assert reloads(caplog, "spare") == 0
        status, body = await stack.json("POST", "/v1/models/spare/reload", json={"force": True})
        assert (status, body["name"], body["state"]) == (200, "spare", "ready")
        assert reloads(caplog, "spare") == 1

        # A reload body is small.
        status, body = await stack.json(
            "POST",
            "/v1/models/squares/reload",
            data=b" " * (64 * 1024 + 1),
            headers={"Content-Type": "application/json"},
        )
        assert (status, body) == (413, {"error": "reload body larger than 65536 bytes"})
        status, body = await stack.json("POST", "/v1/models/squares/reload", json={"force": 1})
        assert (status, body) == (400, {"error": "force: expected true or false, got 1"})
        assert reloads(caplog, "squares") == 1 + done  # refused bodies reload nothing

        # A body that arrives in two TCP segments is read whole, not cut at the first.
        reader, writer = await asyncio.open_connection("127.0.0.1", stack.api.port)
        payload = b'{"force": true' + b" " * 3000 + b"}"
        writer.write(
            b"POST /v1/models/spare/reload HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            b"Content-Type: application/json\r\nConnection: close\r\n"
            + f"Content-Length: {len(payload)}\r\n\r\n".encode()
            + payload[:1000]
        )
        await writer.drain()
        await asyncio.sleep(0.3)
        writer.write(payload[1000:])
        await writer.drain()
        answer = await asyncio.wait_for(reader.read(), 30)
        writer.close()
        assert answer.startswith(b"HTTP/1.1 200"), answer[:200]
        assert reloads(caplog, "spare") == 2
    finally:
        await stack.close()


# -- 4. smaller ------------------------------------------------------------------------------


async def test_duplicate_json_keys_are_refused(tmp_path: Path, nats_server: EmbeddedNats) -> None:
    stack = await Stack.start(tmp_path, config(nats_server), nats_server.url)
    try:
        for text, key in (
            ('{"url": "test://", "url": "whip://x"}', "url"),
            ('{"url": "test://", "reconnect": {"min_delay": 1, "min_delay": 2}}', "min_delay"),
        ):
            status, body = await stack.json(
                "POST", "/v1/sources", data=text, headers={"Content-Type": "application/json"}
            )
            assert (status, body) == (400, {"error": f"body: duplicate key {key!r}"})
        assert stack.runtime.sources == {}
    finally:
        await stack.close()


def test_short_token_off_loopback_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "p.yaml"
    path.write_text("pipeline: p\nsources:\n  - url: test://?fps=5\n")
    result = run_cli(
        "run", str(path), "--http", "0.0.0.0:0", timeout=60, env={"VIDPIPE_HTTP_TOKEN": "short-token"}
    )
    assert result.returncode == 2, result.stderr
    # The token came from the environment: the error names it, not a key the file lacks.
    assert result.stderr.startswith(
        "VIDPIPE_HTTP_TOKEN: is 11 characters; off loopback it must have at least 16"
    ), result.stderr
    assert "Traceback" not in result.stderr
    # From the file, with --http: the file's key.
    path.write_text(path.read_text() + "http: {token: short-token}\n")
    result = run_cli("run", str(path), "--http", "0.0.0.0:0", timeout=60)
    assert result.returncode == 2, result.stderr
    assert result.stderr.startswith("--http: http.token is 11 characters;"), result.stderr


async def test_readyz_without_the_token_gives_counts_only(tmp_path: Path, nats_server: EmbeddedNats) -> None:
    token = "a-long-enough-token-1234"
    stack = await Stack.start(
        tmp_path,
        config(nats_server, '{id: secret-cam, url: "whip://secret-cam"}', http=f"token: {token}"),
        nats_server.url,
        token=token,
    )
    try:
        async with (
            aiohttp.ClientSession(base_url=stack.api.url) as anonymous,
            anonymous.get("/readyz") as resp,
        ):
            assert resp.status == 503
            text = await resp.text()
        assert "secret-cam" not in text
        assert json.loads(text) == {
            "ready": False,
            "sources": 1,
            "sources_up": 0,
            "models": 0,
            "models_ready": 0,
            "nats_connected": True,
        }
        # With the token: the reasons, ids and all.
        assert await stack.json("GET", "/readyz") == (
            503,
            {"ready": False, "reasons": ["no source is up (secret-cam connecting)"]},
        )
    finally:
        await stack.close()


async def test_files_outside_file_roots_cannot_be_probed(
    tmp_path: Path, nats_server: EmbeddedNats, demo_clip: Path
) -> None:
    clips = tmp_path / "clips"
    clips.mkdir()
    shutil.copy(demo_clip, clips / "demo.mp4")
    outside = tmp_path / "outside.mp4"
    shutil.copy(demo_clip, outside)
    refusal = (
        403,
        {
            "error": "sources.url: files can be added over the API only from the folders in http.file_roots"
            " (hint: it lists none: add a folder to http.file_roots in the pipeline file)"
        },
    )

    stack = await Stack.start(tmp_path, config(nats_server), nats_server.url)
    try:
        # No roots by default: not even a file next to the config.
        for url in (str(clips / "demo.mp4"), "clips/demo.mp4", f"file://{clips}/demo.mp4"):
            assert await stack.json("POST", "/v1/sources", json={"url": url}) == refusal, url
    finally:
        await stack.close()

    # With roots set, which folders they are is not told to the caller.
    refusal = (
        403,
        {"error": "sources.url: files can be added over the API only from the folders in http.file_roots"},
    )
    stack = await Stack.start(tmp_path, config(nats_server, http="file_roots: [clips]"), nats_server.url)
    try:
        answers = [
            await stack.json("POST", "/v1/sources", json={"url": url})
            for url in (
                str(outside),  # exists
                str(tmp_path / "missing.mp4"),  # does not
                "/etc/passwd",
                "/nonexistent/x.mp4",
                f"{clips}/../outside.mp4",  # climbs out of the root
            )
        ]
        assert answers == [refusal] * len(answers)
        (clips / "link.mp4").symlink_to(outside)
        assert await stack.json("POST", "/v1/sources", json={"url": "clips/link.mp4"}) == refusal
        assert stack.runtime.sources == {}
        # Inside a root, a file that is not there (or a folder) is refused at once, not started.
        assert await stack.json("POST", "/v1/sources", json={"url": "clips/nope.mp4"}) == (
            400,
            {"error": f"sources.url: file not found: {clips / 'nope.mp4'}"},
        )
        (clips / "sub").mkdir()
        assert await stack.json("POST", "/v1/sources", json={"url": "clips/sub"}) == (
            400,
            {"error": f"sources.url: {clips / 'sub'} is a folder, not a video file"},
        )
        assert stack.runtime.sources == {}
        status, body = await stack.json("POST", "/v1/sources", json={"url": "clips/demo.mp4"})
        assert (status, body["id"]) == (201, "demo"), body
        # One source by its id, as the list shows it.
        status, one = await stack.json("GET", "/v1/sources/demo")
        assert (status, one["id"], one["url"]) == (200, "demo", str(clips / "demo.mp4")), one
        assert await stack.json("GET", "/v1/sources/nope") == (404, {"error": "no source 'nope'"})
    finally:
        await stack.close()


# -- 5. model files in packages --------------------------------------------------------------


async def test_model_file_package_is_not_imported(
    tmp_path: Path, sample_models: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    marker = tmp_path / "imported"
    site = tmp_path / "site"
    package = site / "vidpipe_test_weights"
    (package / "data").mkdir(parents=True)
    # Code that must never run just because a model config names the package.
    (package / "__init__.py").write_text(f"open({str(marker)!r}, 'w').close()\n")
    (package / "data" / "__init__.py").write_text(f"open({str(marker)!r}, 'w').close()\n")
    shutil.copy(sample_models / "squares" / "model.onnx", package / "data" / "model.onnx")
    monkeypatch.syspath_prepend(str(site))

    repo = tmp_path / "models"
    (repo / "squares").mkdir(parents=True)
    text = (sample_models / "squares" / "config.yaml").read_text()
    for pkg in ("vidpipe_test_weights", "vidpipe_test_weights.data"):
        path = "data/model.onnx" if "." not in pkg else "model.onnx"
        (repo / "squares" / "config.yaml").write_text(
            text.replace("model_file: {path: model.onnx}", f"model_file: {{package: {pkg}, path: {path}}}")
        )
        models = ModelRepository(repo)
        try:
            status = await models.load("squares")
            assert (status.state.value, status.reason) == ("ready", ""), pkg
        finally:
            await models.close()
        assert not marker.exists(), f"resolving {pkg} ran its __init__.py"
        assert "vidpipe_test_weights" not in sys.modules
