"""How the ``vidpipe`` command talks and ends: its exit codes (docs/cli.md), the lines it
writes for the operator (plain, or one JSON object each with ``--log-format json``) and
the line of a run stopped before it started.

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

STOPPED_WHILE_STARTING = "vidpipe: stopped while starting; nothing was processed"


def say(
    text: str, *, json_lines: bool, level: str = "info", stream: TextIO | None = None, **fields: Any
) -> None:
    """A line for the operator: as is, or with ``json_lines`` one JSON object like a log record."""
    if json_lines:
        record = {"ts": round(time.time(), 3), "level": level, "logger": "vidpipe", "msg": text}
        text = json.dumps({**record, **{k: v for k, v in fields.items() if v not in (None, "")}})
    print(text, file=stream or sys.stdout, flush=True)


def stopped_while_starting(command: str | None, *, json_lines: bool) -> int:
    """Ctrl-C before the command could stop by itself (while it loaded or started): a stop the
    operator asked for, not a failure, so exit 0 like a Ctrl-C later on. A ``run`` says so."""
    if command == "run":
        say(STOPPED_WHILE_STARTING, json_lines=json_lines, stream=sys.stderr)
    return EXIT_OK
