"""The stage contract and the registry of stage kinds (``type:`` in the YAML)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

from pipeline.config import PipelineConfig, StageConfig
from pipeline.frames import Frame

if TYPE_CHECKING:
    from inference.repository import ModelRepository
    from pipeline.metrics import Metrics


@dataclass
class StageContext:
    """What a stage may use: the pipeline config, the model repository and the metrics."""

    config: PipelineConfig
    models: ModelRepository | None  # None when the pipeline has no infer stage
    metrics: Metrics


class Stage(ABC):
    """One node of the graph; ``process`` adds to ``frame.objects``.

    Stages with ``ordered = True`` keep state across frames (tracking); they and
    every stage after them run in frame order per source.
    """

    ordered: ClassVar[bool] = False

    def __init__(self, config: StageConfig, context: StageContext) -> None:
        self.config = config
        self.name = config.name
        self.context = context

    async def start(self) -> None:  # noqa: B027 - optional hook
        """Acquire what the stage needs (models are loaded by the runtime)."""

    @abstractmethod
    async def process(self, frame: Frame) -> None:
        """Do this stage's work on one frame."""

    def forget_source(self, source: str) -> None:  # noqa: B027 - optional hook
        """Drop per-source state when a source is removed."""

    async def stop(self) -> None:  # noqa: B027 - optional hook
        """Release resources."""


def create_stage(config: StageConfig, context: StageContext) -> Stage:
    """The stage for ``config.type``."""
    if config.type == "infer":
        from pipeline.stages.infer import InferStage

        return InferStage(config, context)
    if config.type == "track":
        from pipeline.stages.track import TrackStage

        return TrackStage(config, context)
    raise ValueError(f"unknown stage type {config.type!r}")
