"""The stage kinds vidpipe knows (``type:`` in the YAML) and how a stage is built.

The built-in kinds are ``infer``, ``track`` and ``zones``; another kind is a
:class:`~pipeline.stages.base.Stage` subclass with its own ``kind`` and
``options_type``, added with :func:`register_stage` before the config is
loaded::

    @register_stage
    class Blur(Stage):
        kind = "blur"
        options_type = BlurOptions      # a frozen dataclass deriving from StageOptions
        async def process(self, frame: Frame) -> None: ...

    stages:
      - {name: faces, type: blur, radius: 9}
"""

from __future__ import annotations

from inference.kinds import Kinds
from pipeline.stages.base import Stage, StageContext, StageOptions
from pipeline.stages.infer import InferStage
from pipeline.stages.track import TrackStage
from pipeline.stages.zones import ZonesStage


def _options(cls: type[Stage]) -> type:
    return cls.options_type


# The same registry backends and task kinds use (inference.kinds): type -> stage class.
_KINDS: Kinds[type[Stage]] = Kinds("stage type", tag="type", options=_options)


def register_stage(cls: type[Stage]) -> type[Stage]:
    """Make ``cls.kind`` a stage type; registering another class under a taken kind is an error."""
    taken = _KINDS.get(cls.kind)
    if taken is not None and taken is not cls:
        raise ValueError(f"stage kind {cls.kind!r} is already {taken.__module__}.{taken.__qualname__}")
    _KINDS.register(cls.kind, cls)
    return cls


def unregister_stage(kind: str) -> None:
    """Forget a kind added with :func:`register_stage` (the built-ins stay)."""
    if kind in BUILTIN_KINDS:
        raise ValueError(f"stage kind {kind!r} is built in")
    _KINDS.unregister(kind)


def stage_kinds() -> dict[str, type[Stage]]:
    """Every known kind, built-ins first."""
    return {kind: _KINDS[kind] for kind in _KINDS}


def stage_kind(kind: str) -> type[Stage]:
    """The class for ``kind``; KeyError when there is none."""
    return _KINDS[kind]


def create_stage(options: StageOptions, context: StageContext) -> Stage:
    """The stage for one ``stages[]`` entry (already validated against its kind's options)."""
    cls = _KINDS.get(options.type)
    if cls is None:
        raise ValueError(f"unknown stage type {options.type!r}")
    if not isinstance(options, cls.options_type):
        raise TypeError(f"stage {options.name}: {cls.kind} takes {cls.options_type.__name__}")
    return cls(options, context)


BUILTIN_KINDS = ("infer", "track", "zones")
for _cls in (InferStage, TrackStage, ZonesStage):
    register_stage(_cls)

__all__ = [
    "BUILTIN_KINDS",
    "create_stage",
    "register_stage",
    "stage_kind",
    "stage_kinds",
    "unregister_stage",
]
