"""The source classes: which :class:`~pipeline.sources.base.Source` serves each scheme.

Each class names the schemes it serves and whether it serves them live or as
finite files; :func:`register_source` adds it, as :func:`~pipeline.stages.registry.register_stage`
does for stage kinds. The built-in classes are registered here; another one (a
scheme already in :mod:`pipeline.sources.schemes`) is added before sources start::

    @register_source
    class MyRtspSource(LiveSource):
        schemes = ("rtsp", "rtsps")
        serves_live = True

Only the runtime imports this module (it imports PyAV and aiortc through the
classes); config and the API ask :mod:`pipeline.sources.schemes`.
"""

from __future__ import annotations

from pipeline.config import SourceConfig
from pipeline.sources.base import Source, SourceContext
from pipeline.sources.file import FileSource
from pipeline.sources.pattern import TestPatternSource
from pipeline.sources.rtsp import RtspSource
from pipeline.sources.schemes import SCHEMES, scheme_of
from pipeline.sources.stream import StreamSource
from pipeline.sources.whip import WhipSource

__all__ = ["class_of", "create_source", "register_source", "source_class"]

# (scheme, live) -> the class serving it.
_CLASSES: dict[tuple[str, bool], type[Source]] = {}


def register_source(cls: type[Source]) -> type[Source]:
    """Make ``cls`` serve its ``schemes`` (live or finite, by ``serves_live``); the last one wins."""
    for scheme in cls.schemes:
        known = SCHEMES.get(scheme)
        if known is None:
            known_names = ", ".join(SCHEMES)
            raise ValueError(f"{cls.__qualname__}: unknown source scheme {scheme!r}; known: {known_names}")
        if (known.can_be_live if cls.serves_live else known.can_be_finite) is False:
            mode = "live" if cls.serves_live else "finite"
            raise ValueError(f"{cls.__qualname__}: {scheme}:// sources are never {mode}")
        _CLASSES[scheme, cls.serves_live] = cls
    return cls


def source_class(scheme: str, live: bool) -> type[Source]:
    """The class serving ``scheme`` live or finite; KeyError when there is none."""
    return _CLASSES[scheme, live]


def class_of(config: SourceConfig) -> type[Source]:
    """The class serving a config's URL scheme (and ``live``)."""
    return source_class(scheme_of(config.url).name, config.live is True)


def create_source(config: SourceConfig, context: SourceContext | None = None) -> Source:
    """The :class:`~pipeline.sources.base.Source` for a config's URL scheme (and ``live``)."""
    return class_of(config)(config, context)


for _cls in (FileSource, TestPatternSource, RtspSource, WhipSource, StreamSource):
    register_source(_cls)
