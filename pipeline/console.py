"""How the ``vidpipe`` command talks and ends: its exit codes (docs/cli.md), the lines it
writes for the operator (plain, or one JSON object each with ``--log-format json``) and
the line of a command stopped by Ctrl-C.

Standard library only: the console script's entry (:mod:`pipeline.entry`) uses it while
:mod:`pipeline.cli`, which imports the runtime, may not have loaded.
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any, TextIO

EXIT_OK = 0
EXIT_RUNTIME = 1
EXIT_USAGE = 2
EXIT_FORCED = 130  # a second Ctrl-C: 128 + SIGINT, as shells report it
EXIT_INTERRUPTED = 130  # Ctrl-C ended a command that has a result (tune, models add/quantize, ...)

STOPPED_WHILE_STARTING = "vidpipe: stopped while starting; nothing was processed"
# Commands that run until stopped: Ctrl-C (or SIGTERM) is how they end, at any moment, exit 0.
STOP_COMMANDS = ("run", "subscribe", "serve-rtsp")


def say(
    text: str, *, json_lines: bool, level: str = "info", stream: TextIO | None = None, **fields: Any
) -> None:
    """A line for the operator: as is, or with ``json_lines`` one JSON object like a log record."""
    if json_lines:
        record = {"ts": round(time.time(), 3), "level": level, "logger": "vidpipe", "msg": text}
        text = json.dumps({**record, **{k: v for k, v in fields.items() if v not in (None, "")}})
    print(text, file=stream or sys.stdout, flush=True)


def interrupted(command: str, outcome: str, *, json_lines: bool) -> int:
    """Ctrl-C ended ``command`` before its result: one line saying what was (not) written, exit
    130, so that ``vidpipe tune --write && deploy`` does not go on as if the command had succeeded."""
    say(
        f"vidpipe {command}: interrupted; {outcome}",
        json_lines=json_lines,
        level="warning",
        stream=sys.stderr,
    )
    return EXIT_INTERRUPTED


def stopped_while_starting(command: str | None, *, json_lines: bool) -> int:
    """Ctrl-C before the command could stop by itself (while it loaded or started).

    For the commands that run until stopped (:data:`STOP_COMMANDS`) it is a stop the operator
    asked for, not a failure: exit 0 like a Ctrl-C later on, and a ``run`` says so. Any other
    command (``command`` as typed: ``tune``, ``models add``) was interrupted: exit 130.
    """
    if command is None or command in STOP_COMMANDS:
        if command == "run":
            say(STOPPED_WHILE_STARTING, json_lines=json_lines, stream=sys.stderr)
        return EXIT_OK
    return interrupted(command, "nothing was written", json_lines=json_lines)
