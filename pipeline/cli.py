"""The ``vidpipe`` command.

::

    vidpipe run CONFIG [--source URL ...] [--nats URL] [--http HOST:PORT]
                       [--max-frames N] [--duration S] [--publish core|jetstream] [--summary]
    vidpipe validate CONFIG
    vidpipe subscribe [--nats URL] [SUBJECT] [--count N] [--timeout S]
    vidpipe models list REPO
    vidpipe run CONFIG --fleet NAME ...      share the sources with other workers (docs/fleet.md)
    vidpipe fleet add URL [--id ID] | remove ID | list [--json]   --nats URL --fleet NAME

Exit codes: 0 done, 1 runtime failure (no source produced anything, NATS
unreachable, a model unavailable), 2 bad config or usage (``FILE:LINE: ...``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import logging
import os
import signal
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from inference.schema import ConfigError
from pipeline.config import HttpConfig, PipelineConfig, load_config
from pipeline.redact import redact_url

log = logging.getLogger("vidpipe")

EXIT_OK = 0
EXIT_RUNTIME = 1
EXIT_USAGE = 2


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> Any:  # argparse's own exit code is already 2
        self.print_usage(sys.stderr)
        print(f"{self.prog}: error: {message}", file=sys.stderr)
        raise SystemExit(EXIT_USAGE)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="vidpipe", description="Streaming video analytics: cameras in, detections out.")
    # Logging options go after the command (`vidpipe run --debug ...`), on every command.
    common = _Parser(add_help=False)
    common.add_argument("--log-format", choices=["plain", "json"], default="plain")
    common.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    common.add_argument("--debug", action="store_true", help="show tracebacks")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    run = sub.add_parser("run", help="run a pipeline", parents=[common])
    run.add_argument("config", help="pipeline YAML")
    run.add_argument(
        "--source", action="append", metavar="URL", help="replace the config's sources (repeatable)"
    )
    run.add_argument("--nats", metavar="URL", help="NATS server; default: config, else an embedded one")
    run.add_argument("--http", metavar="HOST:PORT", help="serve metrics, health, API and WHIP here")
    run.add_argument("--max-frames", type=int, metavar="N", help="stop each source after N frames")
    run.add_argument("--duration", type=float, metavar="S", help="stop after S seconds")
    run.add_argument("--publish", choices=["core", "jetstream"], help="override nats.publish")
    run.add_argument("--summary", action="store_true", help="print a line per second from the output")
    run.add_argument("--fleet", metavar="NAME", help="join the fleet NAME (JetStream on the NATS server)")

    validate = sub.add_parser("validate", help="check a pipeline YAML and exit", parents=[common])
    validate.add_argument("config")

    subscribe = sub.add_parser("subscribe", help="print detections as JSON lines", parents=[common])
    subscribe.add_argument("subject", nargs="?", default="vidpipe.>")
    subscribe.add_argument("--nats", default="nats://127.0.0.1:4222", metavar="URL")
    subscribe.add_argument("--count", type=int, help="exit after N messages")
    subscribe.add_argument("--timeout", type=float, help="exit after S seconds")

    models = sub.add_parser("models", help="model repository tools", parents=[common])
    models_sub = models.add_subparsers(dest="models_command", required=True, parser_class=_Parser)
    models_list = models_sub.add_parser(
        "list", help="list models, their inputs/outputs and state", parents=[common]
    )
    models_list.add_argument("repo")

    fleet = sub.add_parser("fleet", help="a fleet's desired sources, workers and leases", parents=[common])
    fleet_sub = fleet.add_subparsers(dest="fleet_command", required=True, parser_class=_Parser)
    fleet_common = _Parser(add_help=False, parents=[common])
    fleet_common.add_argument("--nats", default="nats://127.0.0.1:4222", metavar="URL")
    fleet_common.add_argument("--fleet", required=True, metavar="NAME")
    fleet_add = fleet_sub.add_parser("add", help="add a desired source", parents=[fleet_common])
    fleet_add.add_argument("url")
    fleet_add.add_argument("--id", help="source id; default: derived from the URL")
    fleet_remove = fleet_sub.add_parser("remove", help="remove a desired source", parents=[fleet_common])
    fleet_remove.add_argument("id")
    fleet_list = fleet_sub.add_parser("list", help="workers and who runs each source", parents=[fleet_common])
    fleet_list.add_argument("--json", action="store_true", help="print JSON")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from pipeline.logs import setup_logging

    setup_logging(args.log_level, args.log_format, args.debug)
    try:
        if args.command == "validate":
            return cmd_validate(args)
        if args.command == "run":
            return cmd_run(args)
        if args.command == "subscribe":
            return asyncio.run(cmd_subscribe(args))
        if args.command == "models":
            return cmd_models(args)
        if args.command == "fleet":
            return asyncio.run(cmd_fleet(args))
    except ConfigError as exc:
        print(str(exc), file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        return EXIT_OK
    except Exception as exc:
        if args.debug:
            raise
        print(f"vidpipe: {exc} (run with --debug for details)", file=sys.stderr)
        return EXIT_RUNTIME
    return EXIT_USAGE


def cmd_validate(args: argparse.Namespace) -> int:
    cfg = load_config(args.config)
    print(
        f"{args.config}: ok (pipeline {cfg.pipeline}: {len(cfg.sources)} source(s), "
        f"{len(cfg.stages)} stage(s))"
    )
    return EXIT_OK


def cmd_models(args: argparse.Namespace) -> int:
    from inference.repository import describe_repository

    repo = Path(args.repo)
    if not repo.is_dir():
        raise ConfigError(str(repo), None, "", "model repository folder not found", "check the path")
    print(describe_repository(repo))
    return EXIT_OK


async def cmd_subscribe(args: argparse.Namespace) -> int:
    import nats

    try:
        nc = await nats.connect(args.nats, connect_timeout=5, max_reconnect_attempts=3)
    except Exception as exc:
        print(f"vidpipe: cannot connect to NATS at {redact_url(args.nats)}: {exc}", file=sys.stderr)
        return EXIT_RUNTIME
    done = asyncio.Event()
    received = 0

    async def on_msg(msg: Any) -> None:
        nonlocal received
        try:
            line = json.dumps(json.loads(msg.data), ensure_ascii=False, separators=(",", ":"))
        except ValueError:
            line = json.dumps({"subject": msg.subject, "data": msg.data.decode(errors="replace")})
        print(line, flush=True)
        received += 1
        if args.count is not None and received >= args.count:
            done.set()

    await nc.subscribe(args.subject, cb=on_msg)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, done.set)
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(done.wait(), timeout=args.timeout)
    await nc.close()
    return EXIT_OK


def cmd_run(args: argparse.Namespace) -> int:
    cfg = load_config(args.config, sources=args.source)
    if args.publish:
        cfg = dataclasses.replace(cfg, nats=dataclasses.replace(cfg.nats, publish=args.publish))
    cfg = _with_fleet(cfg, args.fleet)
    env_token = os.environ.get("VIDPIPE_HTTP_TOKEN")
    if args.http:
        token = env_token or (cfg.http.token if cfg.http else None)
        # --http moves the server; the file's other http settings (limits, roots) stay.
        http = cfg.http or HttpConfig()
        cfg = dataclasses.replace(cfg, http=dataclasses.replace(http, listen=args.http, token=token))
    elif cfg.http is not None and env_token:
        cfg = dataclasses.replace(cfg, http=dataclasses.replace(cfg.http, token=env_token))
    if cfg.http is not None:
        # Refuse an exposed API without a token before anything starts (usage error, exit 2).
        from pipeline.api import ApiConfigError, check_http_config

        try:
            check_http_config(cfg.http)
        except ApiConfigError as exc:
            raise ConfigError("--http" if args.http else cfg.file, None, "", str(exc)) from None
    if args.max_frames is not None and args.max_frames < 1:
        raise ConfigError("--max-frames", None, "", "must be at least 1")
    if args.duration is not None and args.duration <= 0:
        raise ConfigError("--duration", None, "", "must be greater than 0")
    if not cfg.sources and cfg.http is None and cfg.fleet is None:
        raise ConfigError(
            cfg.file, None, "sources", "no sources", "add sources: in the file, or pass --source URL"
        )
    return asyncio.run(run_pipeline(cfg, args))


async def run_pipeline(cfg: PipelineConfig, args: argparse.Namespace) -> int:
    from pipeline.nats_server import EmbeddedNats
    from pipeline.runtime import Runtime
    from pipeline.summary import Summary

    embedded: EmbeddedNats | None = None
    nats_url = args.nats or cfg.nats.url
    if nats_url is None:
        embedded = EmbeddedNats().start()
        nats_url = embedded.url
        print(f"embedded NATS server at {nats_url}", flush=True)
    runtime = Runtime(cfg, nats_url=nats_url, max_frames=args.max_frames)
    fleet: Any = None
    summary: Summary | None = None
    api: Any = None
    loop = asyncio.get_running_loop()
    signals = 0

    def on_signal() -> None:
        nonlocal signals
        signals += 1
        if signals == 1:
            log.info("stopping: finishing frames in flight (signal again to force)")
            runtime.request_stop()
        else:
            log.warning("forced exit")
            os._exit(EXIT_RUNTIME if runtime.published_total() == 0 else EXIT_OK)

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, on_signal)
    try:
        if args.summary:
            summary = Summary(nats_url, f"{cfg.nats.subject_prefix}.{cfg.pipeline}.>", sys.stdout)
            await summary.start()
        if cfg.fleet is not None:
            fleet = await _start_fleet(runtime, cfg, nats_url)
        else:
            await runtime.start()
        if cfg.http is not None:
            from pipeline.api import ApiServer

            api = ApiServer(runtime, cfg.http, fleet=fleet)
            await api.start()
            if not cfg.sources:
                # A server waiting for sources added through the API.
                runtime.keep_running()
        await runtime.wait(args.duration)
        if fleet is not None:
            await fleet.stop()  # hand every source over before the runtime closes
        await runtime.stop()
        if summary is not None:
            await summary.stop()
            summary = None
    except ConfigError:
        raise
    except Exception as exc:
        if args.debug:
            raise
        print(f"vidpipe: {exc}", file=sys.stderr)
        with contextlib.suppress(Exception):
            await runtime.stop()
        return EXIT_RUNTIME
    finally:
        if api is not None:
            await api.stop()
        if summary is not None:
            with contextlib.suppress(Exception):
                await summary.stop()
        if embedded is not None:
            embedded.cleanup()
    published = runtime.published_total()
    failed = [r.source.id for r in runtime.sources.values() if r.source.state.value == "failed"]
    log.info(
        "done: %d frame(s) published from %d source(s)%s",
        published,
        len(runtime.sources),
        f"; failed: {', '.join(failed)}" if failed else "",
    )
    if published == 0 and runtime.sources:
        return EXIT_RUNTIME
    return EXIT_OK


# -- fleet ------------------------------------------------------------------------------------


def _with_fleet(cfg: PipelineConfig, name: str | None) -> PipelineConfig:
    """``--fleet NAME`` joins (or renames) the config's ``fleet:``."""
    if name is None:
        return cfg
    from pipeline.config import FleetConfig
    from pipeline.stages.base import check_name

    problem = check_name(name)
    if problem:
        raise ConfigError("--fleet", None, "", problem)
    fleet = dataclasses.replace(cfg.fleet, name=name) if cfg.fleet else FleetConfig(name=name)
    return dataclasses.replace(cfg, fleet=fleet)


async def _start_fleet(runtime: Any, cfg: PipelineConfig, nats_url: str) -> Any:
    """Prepare the runtime without its sources, then join the fleet, which starts them."""
    from pipeline.fleet.worker import FleetWorker

    assert cfg.fleet is not None
    await runtime.prepare()
    fleet = FleetWorker(runtime, cfg.fleet, nats_url)
    await fleet.start()
    print(f"fleet {fleet.name}: worker {fleet.id}", flush=True)
    return fleet


async def cmd_fleet(args: argparse.Namespace) -> int:
    import nats

    from pipeline.config import SourceConfig
    from pipeline.fleet.buckets import open_bucket
    from pipeline.fleet.desired import DesiredSources
    from pipeline.fleet.status import format_status, read_status
    from pipeline.sources.schemes import check_url, derive_id, resolve_url
    from pipeline.stages.base import check_name

    problem = check_name(args.fleet)
    if problem:
        raise ConfigError("--fleet", None, "", problem)
    try:
        nc = await nats.connect(args.nats, connect_timeout=5, max_reconnect_attempts=3)
    except Exception as exc:
        print(f"vidpipe: cannot connect to NATS at {redact_url(args.nats)}: {exc}", file=sys.stderr)
        return EXIT_RUNTIME
    try:
        js = nc.jetstream()
        if args.fleet_command == "list":
            status = await read_status(js, args.fleet)
            print(json.dumps(status, indent=2) if args.json else format_status(status))
            return EXIT_OK
        desired = DesiredSources(await open_bucket(js, args.fleet, "sources"))
        if args.fleet_command == "add":
            problem = check_url(args.url)
            if problem:
                raise ConfigError("url", None, "", problem)
            if args.id is not None and check_name(args.id):
                raise ConfigError("--id", None, "", str(check_name(args.id)))
            url = resolve_url(args.url, Path.cwd())
            source = SourceConfig(url=url, id=args.id or derive_id(url))
            if not await desired.add(source):
                print(f"vidpipe: fleet {args.fleet} already has a source {source.source_id}", file=sys.stderr)
                return EXIT_USAGE
            print(f"fleet {args.fleet}: source {source.source_id} added")
            return EXIT_OK
        if not await desired.remove(args.id):
            print(f"vidpipe: fleet {args.fleet} has no source {args.id}", file=sys.stderr)
            return EXIT_USAGE
        print(f"fleet {args.fleet}: source {args.id} removed")
        return EXIT_OK
    finally:
        await nc.close()


if __name__ == "__main__":
    sys.exit(main())
