"""vidpipe's pipeline runtime: config, sources, stage graph, publishing, metrics, API and CLI.

Embedding (docs/embedding.md)::

    from pipeline import Pipeline

    async with Pipeline.from_file("configs/demo.yaml") as pipe:
        async for message in pipe.results():
            ...
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

if TYPE_CHECKING:
    from pipeline.embed import Message, Pipeline, ResultStream

__all__ = ["Message", "Pipeline", "ResultStream", "__version__"]


def __getattr__(name: str) -> Any:
    # The embedding API loads the runtime (PyAV, NATS, models) only when asked for, so
    # `import pipeline.config` and the CLI's start stay light.
    if name in ("Message", "Pipeline", "ResultStream"):
        from pipeline import embed

        return getattr(embed, name)
    raise AttributeError(f"module 'pipeline' has no attribute {name!r}")
