"""The stage contract: what every stage kind declares and what it may use.

A stage kind is a :class:`Stage` subclass that names itself (``kind``, the
``type:`` in the YAML) and its options (a frozen dataclass deriving from
:class:`StageOptions`). :mod:`pipeline.stages.registry` lists the kinds and
builds the stage for each ``stages[]`` entry; the options dataclass is what the
config loader validates the entry against, so a key one kind does not take is
a ``FILE:LINE`` error, not a silently ignored value::

    stages:
      - {name: text, type: infer, model: ppocr_det}   # InferOptions
      - {name: track, type: track, iou: 0.3}          # TrackOptions
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar, Protocol

from inference.ratelimit import RateLimitedLog
from inference.schema import spec
from pipeline.auto_interval import TrackBoard
from pipeline.frames import Frame
from pipeline.names import NAME_HELP, check_name

if TYPE_CHECKING:
    from inference.repository import ModelRepository
    from pipeline.events import Event
    from pipeline.metrics import Metrics


@dataclass(frozen=True)
class StageOptions:
    """The keys every stage takes; each kind derives its own options from this."""

    # The keys the config checks read of an entry, beyond name and type: problem_keys those
    # :meth:`problems` reads, graph_keys those the graph's and the models' checks read (through
    # the other methods here, or by name). When an entry has a wrong value under another key,
    # the loader checks the rest of it as if that key were at its default, so all its problems
    # are reported at once. None: the checks may read any key, and a wrong one stops them.
    problem_keys: ClassVar[frozenset[str] | None] = None
    graph_keys: ClassVar[frozenset[str] | None] = None

    name: str = field(metadata=spec(check=check_name, help=NAME_HELP))
    type: str = field(metadata=spec(help="the stage kind: infer, track, ..."))

    def models(self) -> tuple[str, ...]:
        """Models this stage runs (the runtime loads them; readiness waits for them)."""
        return ()

    def references(self) -> dict[str, str]:
        """Keys that name an earlier stage whose objects this stage reads: key -> stage name."""
        return {}

    def problems(self) -> list[tuple[str, str]]:
        """Checks across this stage's own keys: ``(key, problem)`` for each one that fails."""
        return []

    def order_problems(self, earlier: list[StageOptions]) -> list[tuple[str, str]]:
        """Checks against the stages listed before this one: ``(key, problem)`` for each that fails."""
        return []

    def later_problems(self, later: list[StageOptions]) -> list[tuple[str, str]]:
        """Checks against the stages listed after this one: ``(key, problem)`` for each that fails."""
        return []


class SourceInfo(Protocol):
    """What a stage reads of a source's config (``SourceConfig`` is one)."""

    @property
    def source_id(self) -> str: ...

    @property
    def live(self) -> bool | None: ...


class GraphConfig(Protocol):
    """What a stage reads of the pipeline config (``PipelineConfig`` is one): the
    pipeline's name, its sources and every stage's options. A protocol, so the stage
    contract does not import the config module that imports it."""

    @property
    def pipeline(self) -> str: ...

    @property
    def sources(self) -> Sequence[SourceInfo]: ...

    @property
    def stages(self) -> Sequence[StageOptions]: ...


@dataclass
class StageContext:
    """What a stage may use: the pipeline config, the model repository, the metrics, the error log."""

    config: GraphConfig
    models: ModelRepository | None  # None when the pipeline has no infer stage
    metrics: Metrics
    # Rate-limited ERROR lines shared by the runtime and the stages (one per kind per interval).
    errors: RateLimitedLog = field(default_factory=RateLimitedLog)
    # Tracks after each frame, written by the track stage, read by interval: auto detectors.
    tracks: TrackBoard = field(default_factory=TrackBoard)


class Stage(ABC):
    """One node of the graph; ``process`` adds to ``frame.objects``.

    Stages with ``ordered = True`` keep state across frames (tracking); they and
    every stage after them run in frame order per source. ``finds_objects``
    says whether other stages may name this one in ``on:``.
    """

    kind: ClassVar[str]
    options_type: ClassVar[type[StageOptions]] = StageOptions
    ordered: ClassVar[bool] = False
    finds_objects: ClassVar[bool] = False

    def __init__(self, options: StageOptions, context: StageContext) -> None:
        self.options = options
        self.name = options.name
        self.context = context

    async def start(self) -> None:  # noqa: B027 - optional hook
        """Acquire what the stage needs (models are loaded by the runtime)."""

    @abstractmethod
    async def process(self, frame: Frame) -> None:
        """Do this stage's work on one frame."""

    def end_source(self, source: str) -> list[Event]:
        """The source has no more frames (it ended, was removed, or the pipeline stops),
        or its live stream broke (left ``up`` for ``backoff``; frames of a new
        connection may follow, and state kept across frames should start over).

        Called in order after its last frame, for ordered stages; returns the events
        that closes (tracks that end), which are published like a frame's.
        """
        return []

    def forget_source(self, source: str) -> None:  # noqa: B027 - optional hook
        """Drop per-source state when a source is removed."""

    async def stop(self) -> None:  # noqa: B027 - optional hook
        """Release resources."""
