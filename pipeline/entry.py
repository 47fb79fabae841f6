"""The ``vidpipe`` console script (``[project.scripts]`` in pyproject.toml).

Loading :mod:`pipeline.cli` imports the runtime (NumPy, SciPy, OpenCV, the inference
backends): about a second in which a Ctrl-C would otherwise end in a KeyboardInterrupt
traceback. This module imports nothing before it starts loading the CLI, so a Ctrl-C
then ends the command as one a moment later would: a ``run`` stops (one line, exit 0),
``tune`` or ``models add`` say they were interrupted (exit 130; docs/cli.md).
"""

from __future__ import annotations

import signal
import sys
from types import FrameType

# The commands with sub-commands, and theirs (as pipeline/cli.py's parser has them).
SUBCOMMANDS = {"models": ("list", "add", "quantize"), "fleet": ("add", "remove", "list")}


def main() -> int:
    # SIGTERM (a pod deleted, `docker stop`) or SIGHUP (a closed terminal) while the CLI
    # loads is a stop like Ctrl-C, not a silent exit 143 or 129; `run` installs its own
    # handler once its loop runs.
    signal.signal(signal.SIGTERM, _terminated)
    signal.signal(signal.SIGHUP, _terminated)
    try:
        from pipeline.cli import main as run_command
    except KeyboardInterrupt:
        return _stopped_while_loading(sys.argv[1:])
    return run_command()


def _terminated(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt


def _stopped_while_loading(argv: list[str]) -> int:
    """What the CLI says of a Ctrl-C while it starts, read from the raw arguments (the parser
    is not loaded): the command is the first word (with its sub-command: ``models add``),
    ``--log-format json`` picks the format."""
    from pipeline.console import stopped_while_starting

    words = [arg for arg in argv if not arg.startswith("-")]
    command = words[0] if words else None
    subcommands = SUBCOMMANDS.get(command or "", ())
    sub = next((word for word in words[1:] if word in subcommands), None)
    if sub is not None:
        command = f"{command} {sub}"
    pairs = zip(argv, [*argv[1:], ""], strict=True)
    json_lines = any(a == "--log-format=json" or (a, b) == ("--log-format", "json") for a, b in pairs)
    return stopped_while_starting(command, json_lines=json_lines)
