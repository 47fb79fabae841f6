"""What a name in vidpipe may be: pipelines, sources, stages, fleets and zones become
parts of NATS subjects and metric labels, so they hold letters, digits, ``_`` and ``-``.

::

    pipeline: lobby-cams          # a name
    sources:
      - {id: door_1, url: rtsp://cam-1/stream}
"""

from __future__ import annotations

import re

__all__ = ["NAME_HELP", "check_name"]

# fullmatch, not "$": "$" also matches before a final newline, and "cam1\n" would pass.
_NAME_RE = re.compile(r"[A-Za-z0-9_-]{1,64}")
NAME_HELP = "use 1-64 letters, digits, '_' or '-' (it becomes part of a NATS subject)"


def check_name(value: str) -> str | None:
    """None when ``value`` may be a pipeline, source or stage name; else the problem."""
    return None if _NAME_RE.fullmatch(value) else f"{value!r} is not a valid name"
