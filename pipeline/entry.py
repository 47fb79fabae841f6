"""The ``vidpipe`` console script (``[project.scripts]`` in pyproject.toml).

Loading :mod:`pipeline.cli` imports the runtime (NumPy, SciPy, OpenCV, the inference
backends): about a second in which a Ctrl-C would otherwise end in a KeyboardInterrupt
traceback. This module imports nothing before it starts loading the CLI, so a Ctrl-C
then is a stop like one a moment later: one line, exit 0 (docs/cli.md).
"""

from __future__ import annotations

import sys


def main() -> int:
    try:
        from pipeline.cli import main as run_command
    except KeyboardInterrupt:
        return _stopped_while_loading(sys.argv[1:])
    return run_command()


def _stopped_while_loading(argv: list[str]) -> int:
    """What the CLI says of a Ctrl-C while it starts, read from the raw arguments (the parser
    is not loaded): the command is the first word, ``--log-format json`` picks the format."""
    from pipeline.console import stopped_while_starting

    command = next((arg for arg in argv if not arg.startswith("-")), None)
    pairs = zip(argv, [*argv[1:], ""], strict=True)
    json_lines = any(a == "--log-format=json" or (a, b) == ("--log-format", "json") for a, b in pairs)
    return stopped_while_starting(command, json_lines=json_lines)
