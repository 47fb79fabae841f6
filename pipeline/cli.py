"""The ``vidpipe`` command.

::

    vidpipe run CONFIG [--source URL ...] [--nats URL | --nats-port N] [--http HOST:PORT]
                       [--max-frames N] [--duration S] [--publish core|jetstream] [--summary]
                       [--no-progress]
    vidpipe validate CONFIG
    vidpipe subscribe [--nats URL] [SUBJECT] [--count N] [--timeout S]
    vidpipe models list REPO
    vidpipe models add MODEL.onnx [--repo DIR] [--name NAME] [--link] [--backend B] [--instances N]
    vidpipe models quantize NAME --from SOURCE... [--repo DIR] [--frames N] [--every K]
                            [--min-agreement A]
    vidpipe tune REPO MODEL [--concurrency N] [--seconds S] [--trial-inferences N]
                            [--latency-budget-ms MS] [--source FILE --streams N] [--write]
    vidpipe run CONFIG --fleet NAME ...      share the sources with other workers (docs/fleet.md)
    vidpipe fleet add URL [--id ID] | remove ID | list [--json]   --nats URL --fleet NAME
    vidpipe serve-rtsp FILE... [--port N] [--host ADDR]   looping RTSP cameras for trials

Exit codes (``pipeline/console.py``): 0 done, or ``run`` stopped by Ctrl-C or SIGTERM, 1
runtime failure (no source produced anything, NATS unreachable, a model unavailable), 2 bad
config or usage (``FILE:LINE: ...``, every problem of a file at once), 130 forced exit (a
second Ctrl-C), or Ctrl-C before ``tune``, ``models add``/``quantize`` and the like finished.

The console script enters through ``pipeline/entry.py``, which loads this module where a
Ctrl-C is a stop, not a traceback.

``--log-format json`` makes everything vidpipe itself writes JSON, one object a
line: logs, the embedded server's URL, the summary, errors.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import difflib
import json
import logging
import math
import os
import shutil
import signal
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pipeline
from inference.schema import MAX_REPORTED_ERRORS, ConfigError, raise_errors
from pipeline.config import HttpConfig, PipelineConfig, load_config, missing_source_files
from pipeline.console import (
    EXIT_FORCED,
    EXIT_OK,
    EXIT_RUNTIME,
    EXIT_USAGE,
    interrupted,
    say,
    stopped_while_starting,
)
from pipeline.redact import redact_url
from pipeline.sources.schemes import SCHEME_OPTIONS

log = logging.getLogger("vidpipe")
# What ends `run` and `subscribe` gracefully: Ctrl-C, a supervisor's stop, a closed terminal.
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


EXAMPLES = """\
examples:
  vidpipe validate configs/demo.yaml            check a config (and its models and files)
  vidpipe run configs/demo.yaml --summary       run it; an embedded NATS server on 127.0.0.1:4222
  vidpipe run configs/demo.yaml --source clip.mp4 --max-frames 100
  vidpipe run configs/demo.yaml --source rtsp://cam/stream --http 127.0.0.1:8080
  vidpipe subscribe                             print what a running pipeline publishes
  vidpipe models list samples/models            the model repository and each model's state
"""


class _HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """Examples kept as written, every option with its default.

    A default argparse would show as ``None`` or ``False`` is written into the
    option's help instead, in words (``default: no limit``).
    """

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None or isinstance(action.default, bool) or action.default == argparse.SUPPRESS:
            return action.help
        if action.help and "default" in action.help:
            return action.help  # it says its default in its own words already
        return super()._get_help_string(action)


class _Parser(argparse.ArgumentParser):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", _HelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> Any:  # argparse's own exit code is already 2
        self.print_usage(sys.stderr)
        print(f"{self.prog}: error: {message}", file=sys.stderr)
        raise SystemExit(EXIT_USAGE)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="vidpipe", description="Streaming video analytics: cameras in, detections out.", epilog=EXAMPLES
    )
    parser.add_argument("--version", action="version", version=f"vidpipe {pipeline.__version__}")
    # Logging options go after the command (`vidpipe run --debug ...`), on every command.
    common = _Parser(add_help=False)
    common.add_argument(
        "--log-format", choices=["plain", "json"], default="plain", help="json: every line a JSON object"
    )
    common.add_argument(
        "--log-level",
        default="info",
        choices=["debug", "info", "warning", "error"],
        help="debug adds the config, each source's parameters and each model's instances",
    )
    common.add_argument("--debug", action="store_true", help="show tracebacks (default: off)")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    run = sub.add_parser("run", help="run a pipeline", parents=[common], epilog=EXAMPLES)
    run.add_argument("config", help="pipeline YAML")
    run.add_argument(
        "--source",
        action="append",
        metavar="URL",
        help="replace the config's sources (repeatable; default: the config's)",
    )
    run.add_argument(
        "--nats",
        metavar="URL",
        help="NATS server, or several seed URLs of one cluster as a,b,c "
        "(default: nats.url or nats.servers, else an embedded one on 127.0.0.1:4222 or a free port)",
    )
    run.add_argument(
        "--nats-port",
        type=int,
        metavar="N",
        help="the embedded server's port (default: nats.port, else 4222 when free, else any free one)",
    )
    run.add_argument(
        "--http",
        metavar="HOST:PORT",
        help="serve metrics, health, API and WHIP here (default: http.listen if set, else none)",
    )
    run.add_argument(
        "--max-frames", type=int, metavar="N", help="stop each source after N frames (default: no limit)"
    )
    run.add_argument(
        "--duration", type=float, metavar="S", help="stop after S seconds (default: when the sources end)"
    )
    run.add_argument(
        "--publish", choices=["core", "jetstream"], help="override nats.publish (default: the config's)"
    )
    run.add_argument(
        "--summary",
        action="store_true",
        help="print a line per second from the output, totals per label (default: off)",
    )
    run.add_argument(
        "--no-progress",
        dest="progress",
        action="store_false",
        help="no progress line (default: shown for files when stderr is a terminal)",
    )
    run.add_argument("--fleet", metavar="NAME", help="join the fleet NAME (JetStream on the NATS server)")

    validate = sub.add_parser(
        "validate", help="check a pipeline YAML, its models and files, and exit", parents=[common]
    )
    validate.add_argument("config", help="pipeline YAML")
    validate.add_argument(
        "--source",
        action="append",
        metavar="URL",
        help="check with these sources in place of the config's, as `run --source` runs it (repeatable)",
    )

    subscribe = sub.add_parser("subscribe", help="print detections as JSON lines", parents=[common])
    subscribe.add_argument("subject", nargs="?", default="vidpipe.>", help="NATS subject (wildcards allowed)")
    subscribe.add_argument("--nats", default="nats://127.0.0.1:4222", metavar="URL", help="NATS server")
    subscribe.add_argument("--count", type=int, help="exit after N messages (default: no limit)")
    subscribe.add_argument("--timeout", type=float, help="exit after S seconds (default: at Ctrl-C)")

    models = sub.add_parser("models", help="model repository tools", parents=[common])
    models_sub = models.add_subparsers(dest="models_command", required=True, parser_class=_Parser)
    models_list = models_sub.add_parser(
        "list", help="list models, their inputs/outputs and state", parents=[common]
    )
    models_list.add_argument("repo", help="model repository folder")
    models_add = models_sub.add_parser(
        "add",
        help="add an ONNX model: write its config.yaml from the file, then load it",
        parents=[common],
        description="Reads the model's inputs, outputs and Ultralytics metadata (task, imgsz, names, "
        "batch), writes REPO/NAME/config.yaml and REPO/NAME/1/model.onnx, and loads the model to "
        "prove the config works.",
    )
    models_add.add_argument("model", help="the .onnx file")
    models_add.add_argument("--repo", default="models", help="model repository folder")
    models_add.add_argument("--name", help="model name (default: the file name without .onnx)")
    models_add.add_argument("--link", action="store_true", help="symlink the file instead of copying it")
    models_add.add_argument(
        "--backend",
        choices=["openvino", "onnxruntime"],
        help="the runtime (default: openvino where installed, else onnxruntime)",
    )
    models_add.add_argument(
        "--instances",
        type=int,
        metavar="N",
        help="instances to run (default: 1, 2 or one per CPU, whichever a short measurement finds fastest)",
    )

    quantize = models_sub.add_parser(
        "quantize",
        help="INT8 from your own video: calibrate, check against the float model, write a new version",
        parents=[common],
        description="Calibrates an INT8 OpenVINO model (NNCF) on frames of your files or cameras, taken "
        "through the model's own preprocessing; every fourth frame is held out to compare the INT8 "
        "answers with the float model's. A model that agrees less than --min-agreement is refused and "
        "nothing is written; otherwise it becomes the model's next version (the float one stays).",
    )
    quantize.add_argument("name", help="model name (its folder in the repository)")
    quantize.add_argument("--repo", default="models", help="model repository folder")
    quantize.add_argument(
        "--from",
        dest="sources",
        action="append",
        required=True,
        metavar="SOURCE",
        help="a file or camera URL to take frames from (repeatable)",
    )
    quantize.add_argument(
        "--crops-of",
        metavar="DETECTOR",
        help="calibrate and check on the objects this detector of the repository finds in the frames "
        "(for a classifier or recogniser a pipeline feeds crops, e.g. --crops-of ppocr_det)",
    )
    quantize.add_argument("--frames", type=int, default=300, metavar="N", help="frames in all")
    quantize.add_argument("--every", type=int, default=5, metavar="K", help="take every K-th frame")
    quantize.add_argument(
        "--min-agreement",
        type=float,
        default=0.95,
        metavar="A",
        help="the share of answers (boxes at IoU >= 0.7 and per-frame counts, labels, text) that must agree",
    )

    tune = sub.add_parser(
        "tune", help="measure a model's configurations and pick the fastest", parents=[common]
    )
    tune.add_argument("repo", help="model repository folder")
    tune.add_argument("model", help="model name (its folder in the repository)")
    tune.add_argument("--concurrency", type=int, default=8, metavar="N", help="callers in flight")
    tune.add_argument("--seconds", type=float, default=120.0, metavar="S", help="the whole search")
    tune.add_argument(
        "--trial-inferences",
        type=int,
        default=64,
        metavar="N",
        help="answers timed per point, after a warm-up (at least 4 per caller)",
    )
    tune.add_argument("--latency-budget-ms", type=float, metavar="MS", help="p99 limit for the pick")
    tune.add_argument(
        "--source",
        metavar="FILE",
        help="measure under the pipeline's load: each caller decodes this video as a stream of its own",
    )
    tune.add_argument(
        "--streams",
        type=int,
        metavar="N",
        help="streams of --source at once (default: --concurrency)",
    )
    tune.add_argument(
        "--write",
        action="store_true",
        help="write the pick into config.yaml once it beats the current configuration in interleaved turns",
    )

    serve = sub.add_parser(
        "serve-rtsp",
        help="serve video files as looping live RTSP cameras, for trials",
        parents=[common],
        description="Each file plays forever at its frame rate on rtsp://HOST:PORT/NAME (NAME: the "
        "file name without its extension); the URLs are printed one per line. Ctrl-C stops. Needs "
        "GStreamer's RTSP server for the system Python (docs/sources.md).",
    )
    serve.add_argument("files", nargs="+", metavar="FILE", help="video files")
    serve.add_argument("--port", type=int, default=8554, help="RTSP port (default: 8554)")
    serve.add_argument(
        "--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1; 0.0.0.0: all)"
    )

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
        if args.command == "tune":
            return cmd_tune(args)
        if args.command == "fleet":
            return asyncio.run(cmd_fleet(args))
        if args.command == "serve-rtsp":
            return cmd_serve_rtsp(args)
    except ConfigError as exc:
        if args.log_format == "json":
            for err in exc.errors[:MAX_REPORTED_ERRORS]:
                _say(
                    args,
                    err.render(),
                    level="error",
                    stream=sys.stderr,
                    file=err.file,
                    line=err.line,
                    key=err.path,
                )
        else:
            print(str(exc), file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        # Ctrl-C before the command could stop by itself: a run stops (nothing ran yet), another
        # command without a word of its own about it (validate, models list, fleet) is interrupted.
        return stopped_while_starting(_command_name(args), json_lines=args.log_format == "json")
    except Exception as exc:
        if args.debug:
            if _traceback_as_json(args, exc):
                return EXIT_RUNTIME
            raise
        _say(args, f"vidpipe: {exc} (run with --debug for details)", level="error", stream=sys.stderr)
        return EXIT_RUNTIME
    return EXIT_USAGE


def _traceback_as_json(args: argparse.Namespace, exc: BaseException) -> bool:
    """With ``--debug --log-format json``, the failure and its traceback as one JSON line
    (``exc``, as log records carry it), where raising would print the traceback as text
    among the JSON lines. False: plain logs, so the caller raises."""
    if args.log_format != "json":
        return False
    import traceback

    text = "".join(traceback.format_exception(exc)).rstrip()
    _say(args, f"vidpipe: {exc}", level="error", stream=sys.stderr, exc=text)
    return True


def _command_name(args: argparse.Namespace) -> str:
    """The command as typed: ``tune``, ``models add``, ``fleet list``."""
    sub = getattr(args, "models_command", None) or getattr(args, "fleet_command", None)
    return f"{args.command} {sub}" if sub else str(args.command)


def _interrupted(args: argparse.Namespace, outcome: str) -> int:
    """Ctrl-C ended this command before its result: one line, exit 130."""
    return interrupted(_command_name(args), outcome, json_lines=args.log_format == "json")


def _say(
    args: argparse.Namespace, text: str, *, level: str = "info", stream: Any = None, **fields: Any
) -> None:
    """A line for the operator: as is, or with ``--log-format json`` one JSON object like a log record."""
    say(text, json_lines=getattr(args, "log_format", "plain") == "json", level=level, stream=stream, **fields)


def cmd_validate(args: argparse.Namespace) -> int:
    # Everything `run` would refuse, the model repository and source files included.
    _not_a_video(args.config)
    cfg = load_config(args.config, sources=args.source, require_sources=True, check_resources=True)
    if args.source:
        # `run` goes on without a missing --source file (as with a camera that is down) and
        # so load_config leaves them; asked to validate them, say what run would find.
        raise_errors(
            missing_source_files(cfg.sources, "--source", "", "relative paths start at the working folder")
        )
    _check_settings(_with_http(cfg, None), args)
    whip = _whip_without_http(cfg, args)
    if whip is not None:
        _say(args, f"warning: {whip}", level="warning", stream=sys.stderr)
    _say(
        args,
        f"{args.config}: ok (pipeline {cfg.pipeline}: {len(cfg.sources)} source(s), "
        f"{len(cfg.stages)} stage(s))",
    )
    return EXIT_OK


def cmd_models(args: argparse.Namespace) -> int:
    from inference.repository import describe_repository

    if args.models_command == "add":
        return cmd_models_add(args)
    if args.models_command == "quantize":
        return cmd_models_quantize(args)
    repo = Path(args.repo)
    if repo.exists() and not repo.is_dir():
        raise ConfigError(str(repo), None, "", "is a file, not a model repository folder", "give the folder")
    if not repo.is_dir():
        raise ConfigError(str(repo), None, "", "model repository folder not found", "check the path")
    table = describe_repository(repo)
    print(table.text)
    return EXIT_RUNTIME if table.unavailable else EXIT_OK


def cmd_models_add(args: argparse.Namespace) -> int:
    """``vidpipe models add MODEL.onnx``: exit 2 for a file it cannot describe, 1 if it does not load,
    130 when Ctrl-C ends it (what it had written is removed)."""
    from inference.repository import model_in_folder

    model = Path(args.model)
    version = 1
    if model.is_dir():
        # A model folder (Triton's layout: config.pbtxt, 1/model.onnx): its ONNX file, named
        # after the folder, as Triton names it.
        found = model_in_folder(model)
        if found is None:
            raise ConfigError(str(model), None, "", "is a folder, not a model file", "give the .onnx file")
        if args.name is None:
            args.name = model.resolve().name
        # Its version number is kept: Triton's "version 10" is vidpipe's version 10 too.
        version = int(found.parent.name)
        if (model / "config.pbtxt").is_file():
            print(
                f"note: {model / 'config.pbtxt'} is not read: config.yaml is written from the ONNX file "
                "(carry max_batch_size, dynamic_batching and instance_group over by hand where they differ)"
            )
        model = found
    if not model.is_file():
        raise ConfigError(str(model), None, "", "model file not found", "check the path")
    if args.instances is not None and args.instances < 1:
        raise ConfigError("--instances", None, "", "must be at least 1")
    repo = Path(args.repo)
    if repo.exists() and not repo.is_dir():
        raise ConfigError(
            str(repo), None, "", "--repo is a file, not a folder", "give the model repository folder"
        )
    try:
        repo.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(
            str(repo), None, "", f"cannot create the model repository folder: {exc.strerror or exc}"
        ) from None
    # The folder add_model makes (it names the model after the file as given): a Ctrl-C
    # before the end removes it, so that the same command can simply be run again.
    folder = repo / (args.name or model.stem)
    made_here = not folder.exists() and not folder.is_symlink()
    # A model folder already in the repository (root/NAME/N/model.onnx) gets its config.yaml
    # beside its versions: nothing is copied.
    in_place = not made_here and model.resolve().parent.parent == folder.resolve()
    try:
        return _add_model(args, model, repo, in_place, version)
    except KeyboardInterrupt:
        if made_here:
            shutil.rmtree(folder, ignore_errors=True)
            return _interrupted(
                args, f"the model was not added; nothing is left at {folder}, so the command can be run again"
            )
        return _interrupted(args, "nothing was written")


def _add_model(args: argparse.Namespace, model: Path, repo: Path, in_place: bool, version: int) -> int:
    from inference.introspect import ModelIntrospectionError
    from inference.repository import add_model, read_source
    from inference.tuning import TrialPoint, choose_instances, write_tuned_config

    try:
        added = asyncio.run(
            add_model(
                model,
                repo,
                args.name,
                link=args.link,
                backend=args.backend,
                instances=args.instances or 1,
                in_place=in_place,
                version=version,
            )
        )
    except ModelIntrospectionError as exc:
        print(f"vidpipe: {exc}", file=sys.stderr)
        return EXIT_USAGE
    text = added.config_text
    choice = None
    if args.instances is None:
        # A bounded number of answers per count (not seconds): seconds on a fast model, longer on a slow one.
        choice = asyncio.run(choose_instances(repo, added.name))
        if choice.chosen != 1:
            point = TrialPoint.from_config(read_source(repo, added.name).config)
            write_tuned_config(added.config_file, dataclasses.replace(point, instances=choice.chosen))
            text = added.config_file.read_text(encoding="utf-8")
    print(f"wrote {added.config_file}:")
    print(text, end="")
    print(f"model file: {added.model_file}")
    for note in added.description.notes:
        print(f"note: {note}")
    print(f"model {added.name} loads: {added.status.state.value} on {added.status.backend}")
    if choice is not None:
        print(choice.describe())
    if added.description.max_batch_size == 1:
        suggested = choice.chosen if choice is not None else args.instances
        print(
            "batch: the model was exported with a fixed batch of 1, so each instance runs one image at a "
            f"time; suggested instances: {suggested}. Re-export with a dynamic batch axis "
            "(ultralytics: dynamic=True) to batch images from several cameras"
        )
    return EXIT_OK


def cmd_models_quantize(args: argparse.Namespace) -> int:
    """``vidpipe models quantize NAME --from SOURCE...``: exit 1 when the INT8 model is refused.

    Everything that can be checked is checked before the first frame is decoded (a camera
    may take seconds to give 300 frames): the numbers, the model (exit 2 with a did-you-mean),
    whether it can be quantized, and the sources' schemes.
    """
    from inference.quantize import (
        READABLE_SCHEMES,
        QuantizeError,
        QuantizeRefused,
        check_quantizable,
        quantize_model,
        read_frames,
        split_frames,
        video_file_problem,
    )
    from pipeline.sources.schemes import check_url
    from pipeline.urls import resolve_url, scheme_name

    for flag, value in (("--frames", args.frames), ("--every", args.every)):
        if value < 1:
            raise ConfigError(flag, None, "", "must be at least 1")
    if not 0 < args.min_agreement <= 1:
        raise ConfigError("--min-agreement", None, "", "must be in (0, 1]")
    repo = Path(args.repo)
    if not repo.is_dir():
        raise ConfigError(args.repo, None, "", "model repository folder not found", "check the path")
    _check_model(repo, args.name)
    if args.crops_of is not None:
        _check_model(repo, args.crops_of)
    urls = []
    for source in args.sources:
        problem = check_url(source)
        if problem:
            raise ConfigError("--from", None, "", f"{source}: {problem}")
        scheme = scheme_name(source)
        if scheme not in READABLE_SCHEMES:
            raise ConfigError(
                "--from",
                None,
                "",
                f"{source}: quantize reads video files and rtsp, http, udp, rtp and srt streams; "
                f"{scheme}:// is not supported",
                "record a clip from it and give the file",
            )
        url = resolve_url(source, Path.cwd()).removeprefix("file://")
        # A file is opened now (exit 2): a typo'd path is a usage error, not a failed calibration.
        unreadable = video_file_problem(Path(url)) if scheme == "file" else None
        if unreadable is not None:
            raise ConfigError("--from", None, "", f"{url}: {unreadable[0]}", unreadable[1])
        urls.append(url)
    config_file = repo / args.name / "config.yaml"
    try:
        source, _ = check_quantizable(repo, args.name)
        _check_crops_of(args, repo, source.config)
        frames = read_frames(urls, args.frames, every=args.every)
        print(f"{len(frames)} frame(s) from {len(urls)} source(s)", flush=True)
        if len(frames) < args.frames:
            _, held = split_frames(frames)
            ended = "the source ended" if len(urls) == 1 else "the sources ended"
            _say(
                args,
                f"vidpipe: warning: read {len(frames)} of {args.frames} frames: {ended}; the check rests on "
                f"{len(held)} frame(s) (give a longer clip, more sources or a smaller --every)",
                level="warning",
                stream=sys.stderr,
            )
        result = quantize_model(
            repo, args.name, frames, min_agreement=args.min_agreement, crops_of=args.crops_of
        )
    except QuantizeRefused as exc:
        print(f"vidpipe: refused: {exc}", file=sys.stderr)
        return EXIT_RUNTIME
    except QuantizeError as exc:
        print(f"vidpipe: {exc}", file=sys.stderr)
        return EXIT_RUNTIME
    except KeyboardInterrupt:
        return _interrupted(args, f"nothing was written ({config_file} unchanged)")
    images = f"crop(s) of {result.crops_of}'s objects" if result.crops_of else "frame(s)"
    print(
        f"model {result.name}: INT8 version {result.version} written to {result.model_file} "
        f"(calibrated on {result.calibration_frames} {images})"
    )
    print(f"check: {result.agreement.describe()} (threshold {result.threshold:g})")
    print(f"wrote {result.config_file}: " + "; ".join(result.changes))
    print(f"to roll back: {result.rollback}")
    return EXIT_OK


def _check_crops_of(args: argparse.Namespace, repo: Path, config: Any) -> None:
    """``--crops-of`` names a detector; a model that reads crops is warned without it."""
    from inference.quantize import DETECTION_KINDS, is_detector
    from inference.repository import read_source

    if args.crops_of is not None:
        detector = read_source(repo, args.crops_of).config
        if not is_detector(detector):
            raise ConfigError(
                "--crops-of",
                None,
                "",
                f"{args.crops_of}: a {detector.task.kind} model finds no objects to crop",
                f"name a detector: a model of task kind {' or '.join(DETECTION_KINDS)}",
            )
    elif not is_detector(config):
        _say(
            args,
            f"vidpipe: warning: {args.name} is a {config.task.kind} model: in a pipeline it reads crops of "
            "a detector's objects, not whole frames; calibrated on whole frames, its INT8 ranges and its "
            "check are not those of the crops (give --crops-of DETECTOR)",
            level="warning",
            stream=sys.stderr,
        )


def _check_model(repo: Path, name: str) -> None:
    """A model of ``repo`` whose config.yaml reads (exit 2 with FILE:LINE, or a did-you-mean)."""
    from inference.repository import read_source
    from pipeline.config import missing_model_hint

    hint = missing_model_hint(repo, name)
    if hint is not None:
        raise ConfigError(str(repo), None, "", f"no model {name!r} in this repository", hint)
    read_source(repo, name)  # a config.yaml that does not read fails here, at its line


def cmd_tune(args: argparse.Namespace) -> int:
    from inference.tuning import TrialResult, TuneError, format_table, tune, write_tuned_config

    for flag, value in (
        ("--concurrency", args.concurrency),
        ("--seconds", args.seconds),
        ("--trial-inferences", args.trial_inferences),
    ):
        if not value > 0 or not math.isfinite(value):  # NaN fails both comparisons
            raise ConfigError(flag, None, "", "must be a finite number greater than 0")
    if args.latency_budget_ms is not None and args.latency_budget_ms <= 0:
        raise ConfigError("--latency-budget-ms", None, "", "must be greater than 0")
    if args.streams is not None:
        if args.source is None:
            raise ConfigError("--streams", None, "", "needs --source FILE", "--source clip.mp4 --streams 4")
        if args.streams <= 0:
            raise ConfigError("--streams", None, "", "must be greater than 0")
    if args.source is not None and not Path(args.source).is_file():
        raise ConfigError(args.source, None, "", "video file not found", "check the path")
    if not Path(args.repo).is_dir():
        raise ConfigError(args.repo, None, "", "model repository folder not found", "check the path")
    _check_model(Path(args.repo), args.model)

    finished: list[TrialResult] = []

    def progress(n: int, r: TrialResult) -> None:
        finished.append(r)
        outcome = (
            f"failed: {r.error}"
            if r.error
            else f"{r.throughput:.1f}/s p50 {r.p50_ms:.1f} ms p99 {r.p99_ms:.1f} ms batch {r.mean_batch:.1f}"
        )
        print(f"[{n:2d} {r.seconds:4.1f}s] {r.point.describe()} -> {outcome}", file=sys.stderr, flush=True)

    try:
        report = asyncio.run(
            tune(
                Path(args.repo),
                args.model,
                concurrency=args.streams or args.concurrency,
                budget_s=args.seconds,
                inferences=args.trial_inferences,
                latency_budget_ms=args.latency_budget_ms,
                on_result=progress,
                verify_rounds=3 if args.write else 0,
                stream_file=args.source,
            )
        )
    except TuneError as exc:
        print(f"vidpipe: {exc}", file=sys.stderr)
        return EXIT_RUNTIME
    except KeyboardInterrupt:
        # What was measured is still worth seeing; nothing is picked from a search cut short.
        if finished:
            print(format_table(finished), flush=True)
        config_file = Path(args.repo) / args.model / "config.yaml"
        return _interrupted(
            args, f"{len(finished)} trial(s) finished; nothing was written ({config_file} unchanged)"
        )
    print(report.table())
    print(report.summary())
    if report.picked is None:
        return EXIT_RUNTIME
    if args.write:
        point = report.to_write
        if point is None:
            print(f"{report.config_file}: unchanged (the current configuration is as fast as the pick)")
            return EXIT_OK
        changes = write_tuned_config(report.config_file, point)
        print(f"wrote {report.config_file}: " + "; ".join(changes))
        callers = args.streams or args.concurrency
        if point.max_batch_size < report.start.max_batch_size and point.max_batch_size <= callers:
            # The search tries batches up to the callers it measured with: a pipeline that
            # sends more at once would batch more than this file now allows.
            how = f"--streams {args.streams}" if args.streams else f"--concurrency {args.concurrency}"
            print(
                f"note: max_batch_size went from {report.start.max_batch_size} to {point.max_batch_size}: "
                f"measured with {callers} caller(s) ({how}); if more sources or crops reach this model "
                "at once, tune with as many",
            )
    return EXIT_OK


async def _connect_client(servers: str) -> Any:
    """A short-lived client (subscribe, fleet): a server that cannot be reached is one clear
    line from the caller, not nats-py's own "encountered error" lines before it."""
    import nats

    async def quiet(exc: Exception) -> None:
        log.debug("nats: %s", exc)

    return await nats.connect(
        servers=servers.split(","), connect_timeout=5, max_reconnect_attempts=3, error_cb=quiet
    )


async def _wait_for_server(servers: str, problems: list[str], args: argparse.Namespace) -> Any:
    """A client that keeps trying until a server answers, and reconnects for as long as it runs:
    a subscriber may start before the pipeline and outlive a server restart. The first
    failure to connect is said once on stderr (in ``args``' log format); ``problems`` gets each one."""
    import nats

    connected = False

    async def on_error(exc: Exception) -> None:
        log.debug("nats: %s", exc)
        if not connected:
            if not problems:
                _say(
                    args,
                    f"vidpipe: waiting for NATS at {redact_url(servers)} ({exc or type(exc).__name__}); "
                    "Ctrl-C to stop",
                    level="warning",
                    stream=sys.stderr,
                )
            problems.append(str(exc) or type(exc).__name__)

    nc = await nats.connect(
        servers=servers.split(","),
        connect_timeout=2,
        reconnect_time_wait=1,
        max_reconnect_attempts=-1,
        error_cb=on_error,
    )
    connected = True
    return nc


async def cmd_subscribe(args: argparse.Namespace) -> int:
    started = time.monotonic()
    problems: list[str] = []
    try:
        nc = await asyncio.wait_for(_wait_for_server(args.nats, problems, args), timeout=args.timeout)
    except TimeoutError:
        why = f": {problems[-1]}" if problems else ""
        _say(
            args,
            f"vidpipe: cannot connect to NATS at {redact_url(args.nats)} in {args.timeout:g}s{why}",
            level="error",
            stream=sys.stderr,
        )
        return EXIT_RUNTIME
    except Exception as exc:  # a URL the client refuses outright
        _say(
            args,
            f"vidpipe: cannot connect to NATS at {redact_url(args.nats)}: {exc}",
            level="error",
            stream=sys.stderr,
        )
        return EXIT_RUNTIME
    done = asyncio.Event()
    received = 0

    async def on_msg(msg: Any) -> None:
        nonlocal received
        if args.count is not None and received >= args.count:
            return  # already delivered before the connection closes: --count means exactly N
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
    for sig in STOP_SIGNALS:
        loop.add_signal_handler(sig, done.set)
    remaining = None if args.timeout is None else max(0.0, args.timeout - (time.monotonic() - started))
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(done.wait(), timeout=remaining)
    await nc.close()
    if received == 0:
        # Silence is the one answer a newcomer cannot read: say what was listened to, and where.
        _say(
            args,
            f"vidpipe: no messages on {args.subject} at {redact_url(args.nats)} in "
            f"{time.monotonic() - started:.0f}s (is a pipeline running and publishing there?)",
            level="warning",
            stream=sys.stderr,
        )
    return EXIT_OK


def cmd_serve_rtsp(args: argparse.Namespace) -> int:
    from pipeline.serve_rtsp import ServeRtspError, serve_rtsp

    if not 1 <= args.port <= 65535:
        raise ConfigError("--port", None, "", f"must be a port (1-65535), got {args.port}")
    missing = [f for f in args.files if not Path(f).is_file()]
    if missing:
        raise ConfigError(missing[0], None, "", "file not found")
    try:
        return serve_rtsp(args.files, args.port, args.host)
    except ServeRtspError as exc:
        print(f"vidpipe serve-rtsp: {exc}", file=sys.stderr)
        return EXIT_RUNTIME


# A file given where the pipeline's YAML goes, that is a video: say where it goes instead.
VIDEO_SUFFIXES = (".mp4", ".m4v", ".mov", ".mkv", ".webm", ".avi", ".ts", ".mts", ".flv", ".h264", ".h265")


def _not_a_video(config: str) -> None:
    if Path(config).suffix.lower() in VIDEO_SUFFIXES:
        raise ConfigError(
            config,
            None,
            "",
            "is a video, not a pipeline file",
            f"run a pipeline on it: vidpipe run configs/demo.yaml --source {config}",
        )


def cmd_run(args: argparse.Namespace) -> int:
    _not_a_video(args.config)
    cfg = _load_for_run(args)
    _check_nats_port_free(cfg, args)
    _check_http_port_free(cfg, args)
    if args.max_frames is not None and args.max_frames < 1:
        raise ConfigError("--max-frames", None, "", "must be at least 1")
    if args.duration is not None and args.duration <= 0:
        raise ConfigError("--duration", None, "", "must be greater than 0")
    return asyncio.run(run_pipeline(cfg, args))


def _load_for_run(args: argparse.Namespace) -> PipelineConfig:
    """The config ``run`` runs, with the command line's settings in it. Refused (exit 2),
    every problem at once, for what ``validate`` refuses in the file, the model repository
    and the models' configs and files (with the same messages and warnings) and for
    settings ``run`` cannot use, before anything starts: not the embedded NATS server, not
    a model.

    Sources are left to the run: a missing file or a camera that is down fails that source
    only, and the others go on. So the file is loaded twice: with its sources (or the
    ``--source`` ones), and without any but with what lies outside it. Only the second
    reads the models' files (as ``validate`` does), before their load reads them again.
    """
    errors: list[ConfigError] = []
    cfg: PipelineConfig | None = None
    try:
        cfg = load_config(
            args.config,
            sources=args.source,
            require_sources=not (args.http or args.fleet),
            fleet_name=args.fleet,
        )
    except ConfigError as exc:
        errors.extend(exc.errors)
    if cfg is not None:
        try:
            if args.publish:
                cfg = dataclasses.replace(cfg, nats=dataclasses.replace(cfg.nats, publish=args.publish))
            cfg = _with_http(_with_fleet(cfg, args.fleet), args.http)
            _check_settings(cfg, args)
        except ConfigError as exc:
            errors.extend(exc.errors)
    try:
        load_config(args.config, sources=[], check_resources=True, fleet_name=args.fleet)
    except ConfigError as exc:
        # The file's own problems come back from both loads: each is said once.
        said = {e.render() for e in errors}
        errors.extend(e for e in exc.errors if e.render() not in said)
    raise_errors(errors)
    assert cfg is not None  # a load that failed left errors
    return cfg


async def run_pipeline(cfg: PipelineConfig, args: argparse.Namespace) -> int:
    from pipeline.nats_server import EmbeddedNats
    from pipeline.progress import Progress
    from pipeline.runtime import Runtime
    from pipeline.summary import Summary

    embedded: EmbeddedNats | None = None
    nats_url = args.nats or cfg.nats.url or (",".join(cfg.nats.servers) or None)
    if nats_url is None:
        port = args.nats_port or cfg.nats.port
        embedded = EmbeddedNats(port, prefer_default_port=True).start()
        nats_url = embedded.url
        _say(args, f"embedded NATS server at {nats_url}", url=nats_url)
    _log_config(cfg)
    runtime = Runtime(cfg, nats_url=nats_url, max_frames=args.max_frames)
    fleet: Any = None
    summary: Summary | None = None
    progress: Progress | None = None
    api: Any = None
    loop = asyncio.get_running_loop()
    signals = 0
    starting = True  # until the sources start (or the fleet is joined)

    def on_signal(sig: signal.Signals) -> None:
        nonlocal signals
        signals += 1
        if signals == 1:
            if sig == signal.SIGHUP:
                # A closed terminal, or a supervisor's reload: vidpipe reloads models over the
                # API, not its config on SIGHUP, so the graceful stop is what is left to do.
                log.info("SIGHUP: vidpipe does not reload its config on SIGHUP; stopping")
            if not starting:
                log.info("stopping: finishing frames in flight (signal again to force)")
            elif runtime.loading_model is not None:
                # A model's load runs in a thread that cannot be cut short (an OpenVINO
                # compile, a TensorRT build): say what the stop waits for.
                log.info(
                    "stopping: no source will start; model %s finishes loading first (signal again to force)",
                    runtime.loading_model,
                )
            else:
                log.info("stopping: no source will start (signal again to force)")
            runtime.request_stop()
        else:
            log.warning("forced exit")
            if embedded is not None:
                # os._exit skips every finally: stop the server and remove its store here.
                embedded.stop(kill=True)
                embedded.cleanup()
            os._exit(EXIT_FORCED)

    for sig in STOP_SIGNALS:
        loop.add_signal_handler(sig, on_signal, sig)
    try:
        if args.summary:
            summary = Summary(
                nats_url,
                f"{cfg.nats.subject_prefix}.{cfg.pipeline}.>",
                sys.stdout,
                json_lines=args.log_format == "json",
                dropped=lambda: _dropped(runtime),
            )
            await summary.start()
        if cfg.fleet is not None:
            fleet = await _start_fleet(runtime, cfg, nats_url)
        else:
            await runtime.start()
        starting = False
        if runtime.stop_requested and not runtime.source_ids_seen:
            # Stopped while starting (the models loading): no source ran, so there is no
            # run to sum up, only what a stop while vidpipe loads says too.
            if fleet is not None:
                await fleet.stop()
            await runtime.stop()
            if summary is not None:
                await summary.stop(totals=False)
                summary = None
            _ignore_stop_signals(loop)
            return stopped_while_starting(_command_name(args), json_lines=args.log_format == "json")
        _log_models(runtime)
        if getattr(args, "progress", False) and _wants_progress(cfg, args.log_format):
            total = await asyncio.to_thread(_total_frames, cfg, args.max_frames)
            progress = Progress(runtime.published_total, total, sys.stderr)
            progress.start()
        if cfg.http is not None:
            from pipeline.api import ApiServer

            api = ApiServer(runtime, cfg.http, fleet=fleet)
            await api.start()
            if not cfg.sources:
                # A server waiting for sources added through the API.
                runtime.keep_running()
        await runtime.wait(args.duration)
        # Why each source that never published is not up (read before the stop overwrites it).
        silent = {
            sid: f"{run.source.state.value}: {run.source.reason}"
            if run.source.reason
            else run.source.state.value
            for sid, run in runtime.sources.items()
            if run.counters.published == 0 and run.source.state.value in ("connecting", "backoff")
        }
        if fleet is not None:
            await fleet.stop()  # hand every source over before the runtime closes
        await runtime.stop()
        if progress is not None:
            await progress.stop()
            progress = None
        if summary is not None:
            await summary.stop()
            summary = None
    except ConfigError:
        raise
    except Exception as exc:
        if args.debug and not _traceback_as_json(args, exc):
            raise
        if not args.debug:
            _say(args, f"vidpipe: {exc}", level="error", stream=sys.stderr)
        with contextlib.suppress(Exception):
            await runtime.stop()
        return EXIT_RUNTIME
    finally:
        if progress is not None:
            await progress.stop()
        if api is not None:
            await api.stop()
        if summary is not None:
            with contextlib.suppress(Exception):
                await summary.stop()
        if embedded is not None:
            embedded.cleanup()
    published = runtime.published_total()
    failed = [r.source.id for r in runtime.sources.values() if r.source.state.value == "failed"]
    unsent = sum(runtime.publisher.unsent.values())
    overflowed = sum(runtime.publisher.overflowed.values())
    log.info(
        "done: %d frame(s) published from %d source(s)%s%s%s%s%s",
        published,
        len(runtime.source_ids_seen),
        _dropped_text(_dropped(runtime)),
        f"; not sent: {overflowed} message(s) dropped from the full outbox while NATS was away"
        if overflowed
        else "",
        f"; not sent: {unsent} message(s), NATS unreachable at the stop" if unsent else "",
        f"; failed: {', '.join(failed)}" if failed else "",
        "".join(f"; {sid} never up ({why})" for sid, why in silent.items()),
    )
    # Nothing produced is a failure, unless the operator stopped the run before the first
    # frame (Ctrl-C, SIGTERM) and no source failed: a stop asked for is exit 0 at any time.
    # So are messages lost in a run that ended by itself (the files' end): not sent at the
    # stop, or refused on the way (over the server's max_payload).
    nothing = published == 0 and runtime.sources and (failed or not signals)
    lost = unsent or overflowed or _dropped(runtime).get("publish_failed", 0)
    code = EXIT_RUNTIME if nothing or (lost and not signals) else EXIT_OK
    _ignore_stop_signals(loop)
    return code


def _ignore_stop_signals(loop: asyncio.AbstractEventLoop) -> None:
    """The run is over and said so: a stop signal from now on (a supervisor's second
    SIGTERM) is ignored while the process exits with the run's own code. Without this,
    closing the loop and then the interpreter's finalization put SIGTERM back to its
    default, and a signal during the teardown (threads joined, native libraries unloaded,
    up to a few hundred ms) ended a finished run as killed (143). Only SIG_IGN outlives
    finalization; a teardown that hangs still ends with SIGKILL."""
    for sig in STOP_SIGNALS:
        loop.remove_signal_handler(sig)
        signal.signal(sig, signal.SIG_IGN)


def _dropped(runtime: Any) -> dict[str, int]:
    """Frames dropped so far by reason, all sources together (as ``/v1/sources`` has them)."""
    total: dict[str, int] = {}
    for run in list(runtime.sources.values()):
        for reason, n in run.dropped.items():
            total[reason] = total.get(reason, 0) + n
    return {reason: n for reason, n in total.items() if n}


def _dropped_text(dropped: dict[str, int]) -> str:
    """``; dropped 362 (stage_error)``, ``; dropped 40 (max_fps 30, queue_full 10)``, or nothing."""
    if not dropped:
        return ""
    if len(dropped) == 1:
        ((reason, n),) = dropped.items()
        return f"; dropped {n} ({reason})"
    reasons = ", ".join(f"{r} {n}" for r, n in sorted(dropped.items(), key=lambda kv: (-kv[1], kv[0])))
    return f"; dropped {sum(dropped.values())} ({reasons})"


def _with_http(cfg: PipelineConfig, listen: str | None) -> PipelineConfig:
    """The http settings a run uses: ``--http`` moves the server, ``VIDPIPE_HTTP_TOKEN`` gives the token."""
    env_token = os.environ.get("VIDPIPE_HTTP_TOKEN")
    if listen:
        token = env_token or (cfg.http.token if cfg.http else None)
        # --http moves the server; the file's other http settings (limits, roots) stay.
        http = cfg.http or HttpConfig()
        return dataclasses.replace(cfg, http=dataclasses.replace(http, listen=listen, token=token))
    if cfg.http is not None and env_token:
        return dataclasses.replace(cfg, http=dataclasses.replace(cfg.http, token=env_token))
    return cfg


def _check_settings(cfg: PipelineConfig, args: argparse.Namespace) -> None:
    """What ``run`` refuses before anything starts and ``validate`` reports too (exit 2): an
    exposed API without a good token, a listen address it cannot use, a port for the
    embedded NATS server beside a server named elsewhere."""
    errors: list[ConfigError] = []
    if cfg.http is not None:
        from pipeline.api import ApiConfigError, check_http_config

        try:
            check_http_config(cfg.http)
        except ApiConfigError as exc:
            env_token = os.environ.get("VIDPIPE_HTTP_TOKEN")
            if exc.key == "http.token" and env_token and cfg.http.token == env_token:
                # The token came from the environment, not from the file's http.token.
                problem = str(exc).removeprefix("http.token ")
                errors.append(ConfigError("VIDPIPE_HTTP_TOKEN", None, "", problem))
            elif getattr(args, "http", None):
                errors.append(ConfigError("--http", None, "", str(exc)))
            else:
                line = cfg.line(exc.key) or cfg.line("http")
                # The message names its key ("http.listen: ...", "http.token is ..."): shown once.
                text = str(exc)
                key, problem = (
                    (exc.key, text.removeprefix(f"{exc.key}: "))
                    if text.startswith(f"{exc.key}:")
                    else ("", text)
                )
                errors.append(ConfigError(cfg.file, line, key, problem))
    whip = _whip_without_http(cfg, args)
    if whip is not None and args.command == "run":
        errors.append(whip)
    nats_port = getattr(args, "nats_port", None)
    port = nats_port or cfg.nats.port
    where, line = ("--nats-port", None) if nats_port else (cfg.file, cfg.line("nats.port"))
    key = "" if nats_port else "nats.port"
    if nats_port is not None and not 1 <= nats_port <= 65535:
        errors.append(ConfigError(where, line, key, f"must be a port (1-65535), got {nats_port}"))
    elif port is not None and (getattr(args, "nats", None) or cfg.nats.url):
        named = "--nats" if getattr(args, "nats", None) else "nats.url"
        errors.append(ConfigError(
            where, line, key, f"applies to the embedded NATS server only, and {named} names a server",
            "drop one of them",
        ))  # fmt: skip
    raise_errors(errors)


def _whip_without_http(cfg: PipelineConfig, args: argparse.Namespace) -> ConfigError | None:
    """A ``whip://`` source with no HTTP server to take its publisher's offer: it would wait
    for ever. ``run`` refuses it; ``validate`` (which cannot see ``--http``) warns."""
    if cfg.http is not None or cfg.fleet is not None:
        return None
    for i, source in enumerate(cfg.sources):
        if source.scheme == "whip":
            given = getattr(args, "source", None)
            where, line = ("--source", None) if given else (cfg.file, cfg.line(f"sources[{i}].url"))
            return ConfigError(
                where,
                line,
                "" if given else f"sources[{i}].url",
                f"{f'{source.url}: ' if given else ''}a whip:// source needs the HTTP server, which takes "
                "its publisher's offer",
                "add http: {listen: 127.0.0.1:8080} to the file, or run with --http 127.0.0.1:8080",
            )
    return None


def _check_http_port_free(cfg: PipelineConfig, args: argparse.Namespace) -> None:
    """The API's address must be free before models load and sources connect (exit 2)."""
    if cfg.http is None:
        return
    from pipeline.api import ApiConfigError, parse_listen
    from pipeline.api.listen import bind

    host, port = parse_listen(cfg.http.listen)
    if port == 0:
        return  # any free port
    where, line, key = (
        ("--http", None, "") if args.http else (cfg.file, cfg.line("http.listen"), "http.listen")
    )
    try:
        bind(host, port, cfg.http.listen).close()
    except ApiConfigError as exc:
        raise ConfigError(
            where, line, key, str(exc).removeprefix("http.listen "),
            "stop what listens there or choose another port",
        ) from None  # fmt: skip


def _check_nats_port_free(cfg: PipelineConfig, args: argparse.Namespace) -> None:
    """A port asked for the embedded server must be free when the run starts (exit 2)."""
    from pipeline.nats_server import port_is_free

    port = args.nats_port or cfg.nats.port
    where, line = ("--nats-port", None) if args.nats_port else (cfg.file, cfg.line("nats.port"))
    key = "" if args.nats_port else "nats.port"
    if port is None or args.nats or cfg.nats.url:
        return
    if not port_is_free(port):
        raise ConfigError(
            where, line, key, f"port {port} on 127.0.0.1 is in use",
            "stop what listens there, choose another port, or pass --nats URL to use that server",
        )  # fmt: skip


def _wants_progress(cfg: PipelineConfig, log_format: str = "plain") -> bool:
    """A progress line for a run of files (not looped) when a person watches stderr; never
    in JSON logs, where every line must parse (a container run with a TTY)."""
    if not cfg.sources or not sys.stderr.isatty() or log_format == "json":
        return False
    return all(s.scheme == "file" and not s.loop for s in cfg.sources)


def _total_frames(cfg: PipelineConfig, max_frames: int | None) -> int | None:
    """All the frames the run will publish, from the containers; None when one does not say."""
    from pipeline.progress import file_frame_count

    total = 0
    for src in cfg.sources:
        count = file_frame_count(src.url)
        if count is None:
            return None
        total += min(count, max_frames) if max_frames else count
    return total


_SCHEME_KEYS = {key for keys in SCHEME_OPTIONS.values() for key in keys}


def _log_config(cfg: PipelineConfig) -> None:
    """``--log-level debug``: what was loaded and how each source will be opened (redacted)."""
    if not log.isEnabledFor(logging.DEBUG):
        return
    log.debug(
        "config %s: pipeline %s, %d source(s), stages %s, models %s, nats publish %s, runtime %s",
        cfg.file,
        cfg.pipeline,
        len(cfg.sources),
        " -> ".join(f"{s.name} ({s.type})" for s in cfg.stages) or "none",
        cfg.models_path() or "none",
        cfg.nats.publish,
        dataclasses.asdict(cfg.runtime),
    )
    for src in cfg.sources:
        # The keys this scheme takes (SCHEME_OPTIONS), not those of every other scheme.
        takes = SCHEME_OPTIONS.get(src.scheme)
        params = {
            k: v
            for k, v in dataclasses.asdict(src).items()
            if k not in ("id", "url") and (takes is None or k in takes or k not in _SCHEME_KEYS)
        }
        log.debug(
            "source %s: %s (%s, %s) %s",
            src.source_id,
            redact_url(src.url),
            src.scheme,
            "live" if src.live else "file",
            " ".join(f"{k}={v}" for k, v in params.items()),
        )


def _log_models(runtime: Any) -> None:
    """``--log-level debug``: each model's version, backend, instances and batching."""
    if not log.isEnabledFor(logging.DEBUG) or runtime.models is None:
        return
    from inference.model import ModelState

    for status in runtime.models.status():
        if status.state is ModelState.UNLOADED:
            log.debug("model %s: in the repository, not used by this pipeline (not loaded)", status.name)
            continue
        log.debug(
            "model %s: version %s, %s %s, preprocess %s, %d instance(s), max_batch_size %d, inputs %s, "
            "state %s",
            status.name,
            status.version or "-",
            status.backend,
            status.precision or "",
            status.preprocess or "-",
            status.instance_count,
            status.max_batch_size,
            ", ".join(f"{t.name}{list(t.shape)}" for t in status.inputs),
            status.state.value,
        )


# -- fleet ------------------------------------------------------------------------------------


def _with_fleet(cfg: PipelineConfig, name: str | None) -> PipelineConfig:
    """``--fleet NAME`` joins (or renames) the config's ``fleet:``."""
    if name is None:
        return cfg
    from pipeline.config import FleetConfig
    from pipeline.names import check_name

    problem = check_name(name)
    if problem:
        raise ConfigError("--fleet", None, "", problem)
    fleet = dataclasses.replace(cfg.fleet, name=name) if cfg.fleet else FleetConfig(name=name)
    return dataclasses.replace(cfg, fleet=fleet)


async def _start_fleet(runtime: Any, cfg: PipelineConfig, nats_url: str) -> Any:
    """Prepare the runtime without its sources, then join the fleet, which starts them
    (None: a stop came while the models loaded, and nothing joined)."""
    from pipeline.fleet.worker import FleetWorker

    assert cfg.fleet is not None
    await runtime.prepare()
    if runtime.stop_requested:
        return None  # stopped while the models loaded: no fleet to join
    fleet = FleetWorker(runtime, cfg.fleet, nats_url)
    await fleet.start()
    return fleet


async def cmd_fleet(args: argparse.Namespace) -> int:
    """``vidpipe fleet add|remove|list``: a misspelt ``--fleet`` is named with the fleets the
    server has; only ``add`` may start a fleet (a set prepared before its workers start)."""
    from pipeline.fleet.buckets import NoJetStream, fleet_names
    from pipeline.names import check_name

    problem = check_name(args.fleet)
    if problem:
        raise ConfigError("--fleet", None, "", problem)
    try:
        nc = await _connect_client(args.nats)
    except Exception as exc:
        print(f"vidpipe: cannot connect to NATS at {redact_url(args.nats)}: {exc}", file=sys.stderr)
        return EXIT_RUNTIME
    try:
        js = nc.jetstream()
        try:
            fleets = await fleet_names(js)
        except NoJetStream:
            raise RuntimeError(
                f"NATS at {redact_url(args.nats)} has no JetStream, where fleets keep their state: "
                "start nats-server with -js"
            ) from None
        if args.fleet_command == "add":
            return await _fleet_add(args, js, fleets)
        if args.fleet not in fleets:
            raise ConfigError(
                "--fleet", None, "", f"no fleet {args.fleet!r} on {redact_url(args.nats)}",
                _fleets_hint(args.fleet, fleets),
            )  # fmt: skip
        if args.fleet_command == "list":
            from pipeline.fleet.status import format_status, read_status

            status = await read_status(js, args.fleet)
            print(json.dumps(status, indent=2) if args.json else format_status(status))
            return EXIT_OK
        return await _fleet_remove(args, js)
    finally:
        await nc.close()


def _fleets_hint(fleet: str, fleets: list[str]) -> str:
    """A did-you-mean for a fleet name, and the fleets the server has."""
    if not fleets:
        return (
            "the server has no fleet yet; workers make theirs as they start: vidpipe run CONFIG --fleet NAME"
        )
    close = difflib.get_close_matches(fleet, fleets, n=1)
    there = f"fleets there: {', '.join(fleets)}"
    return f"did you mean {close[0]!r}? {there}" if close else there


async def _fleet_add(args: argparse.Namespace, js: Any, fleets: list[str]) -> int:
    """Add a desired source, with the checks of ``POST /v1/sources`` on a worker of the fleet."""
    from pipeline.config import parse_source
    from pipeline.fleet.buckets import bucket_items, bucket_name, open_bucket
    from pipeline.fleet.desired import DesiredSources
    from pipeline.urls import whip_name

    data = {"url": args.url, **({"id": args.id} if args.id is not None else {})}
    try:
        source = parse_source(data, base_dir=Path.cwd())  # the checks of every other door
    except ConfigError as exc:
        flag = "--id" if exc.path.endswith(".id") else "url"
        raise ConfigError(flag, None, "", exc.problem, exc.hint) from None
    new = args.fleet not in fleets
    kv = await open_bucket(js, args.fleet, "sources")
    stored = await bucket_items(js, kv, bucket_name(args.fleet, "sources"))
    if source.scheme == "whip":
        # Workers refuse to start a second source a publisher's name would reach: refuse it here.
        owner = _whip_owner(source, stored)
        if owner is not None:
            taken = f"whip name {whip_name(source.url)!r} is already used by source {owner!r}"
            raise ConfigError(
                "url", None, "", f"{taken} in fleet {args.fleet}",
                f"give this publisher another name, whip://<name>, or remove {owner!r} first",
            )  # fmt: skip
    if not await DesiredSources(js, args.fleet, kv).add(source):
        print(f"vidpipe: fleet {args.fleet} already has a source {source.source_id}", file=sys.stderr)
        return EXIT_USAGE
    print(f"fleet {args.fleet}: source {source.source_id} added")
    if new:
        others = [f for f in fleets if f != args.fleet]
        there = f"fleets there: {', '.join(others)}" if others else "no other fleet there"
        _say(
            args,
            f"vidpipe: note: fleet {args.fleet} is new on {redact_url(args.nats)} ({there}): no worker runs "
            "it yet, and workers that join it will run this set, not their file's sources",
            stream=sys.stderr,
        )
    return EXIT_OK


def _whip_owner(source: Any, stored: dict[str, bytes]) -> str | None:
    """The desired source (another id) whose ``whip://`` name ``source`` would take, if any."""
    from pipeline.fleet.buckets import META_PREFIX
    from pipeline.fleet.desired import decode_source
    from pipeline.urls import whip_name

    for sid, value in stored.items():
        if sid == source.source_id or sid.startswith(META_PREFIX):
            continue
        try:
            other = decode_source(sid, value)
        except Exception:  # noqa: S112 - a stored value that does not parse takes no name (workers skip it)
            continue
        if other.scheme == "whip" and whip_name(other.url) == whip_name(source.url):
            return sid
    return None


async def _fleet_remove(args: argparse.Namespace, js: Any) -> int:
    from nats.js.errors import BucketNotFoundError

    from pipeline.fleet.buckets import bucket_name
    from pipeline.fleet.desired import DesiredSources

    try:
        kv = await js.key_value(bucket_name(args.fleet, "sources"))
    except BucketNotFoundError:
        kv = None
    if kv is None or not await DesiredSources(js, args.fleet, kv).remove(args.id):
        print(f"vidpipe: fleet {args.fleet} has no source {args.id}", file=sys.stderr)
        return EXIT_USAGE
    print(f"fleet {args.fleet}: source {args.id} removed")
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
