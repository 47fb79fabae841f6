"""The root of vidpipe's errors.

Every error vidpipe raises on purpose derives from :class:`VidpipeError`, so an
embedding program can catch them all with one ``except``. Specific errors live
with the concept they belong to (``ConfigError`` in :mod:`inference.schema`,
``SourceError`` with the sources, ...) and carry the fields an operator needs:
the file and line, the source, the model.
"""

from __future__ import annotations

__all__ = ["VidpipeError"]


class VidpipeError(Exception):
    """Something vidpipe refused or could not do; the message says what and what to do."""
