"""The root of vidpipe's errors.

Every error vidpipe raises on purpose derives from :class:`VidpipeError`, so an
embedding program can catch them all with one ``except``. Specific errors live
with the concept they belong to (``ConfigError`` in :mod:`inference.schema`,
``SourceError`` with the sources, ...) and carry the fields an operator needs:
the file and line, the source, the model.
"""

from __future__ import annotations

__all__ = ["VidpipeError", "WholeBatchFailure"]


class VidpipeError(Exception):
    """Something vidpipe refused or could not do; the message says what and what to do."""


class WholeBatchFailure(VidpipeError):
    """A batch failed for a reason none of its inputs caused (a server down or too slow, no
    free batch buffer).

    The batcher retries a failed batch's requests one by one to find the input the model
    raises on; an error of this kind would only fail again, each time after as long.
    """
