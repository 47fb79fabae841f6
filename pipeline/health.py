"""Liveness and readiness, as ``/healthz`` and ``/readyz`` report them.

* live: the process answers HTTP, so its event loop turns, and (in a fleet) its own
  loops run (restart it otherwise). Nothing outside the process counts: an unreachable
  NATS would restart every replica at once and mend nothing;
* ready: every model the stages use is loaded, NATS is connected (in a fleet, this
  worker's heartbeat lands too), and at least one source delivers frames: it is up,
  and its last ``FAILING_FRAMES`` frames did not all fail in a stage (send traffic /
  count it as serving otherwise). A pipeline whose sources are added over the API or
  placed by a fleet (``sources_required=False``) is ready with none, since the request
  that adds one has to reach it; once it runs some, one of them must deliver frames.
"""

from __future__ import annotations

from inference.model import ModelState
from pipeline.sources.base import SourceState
from pipeline.stats import PipelineReport

# A source whose last this many frames all failed in a stage (none published) delivers nothing.
FAILING_FRAMES = 10


def readiness_problems(report: PipelineReport, sources_required: bool = True) -> list[str]:
    """Why the pipeline in ``report`` is not ready, one short reason each; empty when ready.

    ``sources_required``: False where sources come from elsewhere than the configuration
    (the API, a fleet's placement), so that running none is no reason.
    """
    reasons: list[str] = []
    needed = set(report.models_needed)
    if needed and not report.models_loaded:
        reasons.append("models are not loaded yet")
    elif needed:
        seen = set()
        for model in report.models:
            seen.add(model.name)
            if model.state is not ModelState.READY:
                detail = f": {model.reason}" if model.reason else ""
                reasons.append(f"model {model.name} is {model.state.value}{detail}")
        reasons.extend(f"model {name} is not loaded" for name in sorted(needed - seen))
    if not report.nats_connected:
        reasons.append("NATS is not connected")
    if not report.sources:
        if sources_required:
            reasons.append("no sources")
    elif not any(src.state is SourceState.UP for src in report.sources):
        states = ", ".join(f"{src.id} {src.state.value}" for src in report.sources)
        reasons.append(f"no source is up ({states})")
    elif all(src.failing >= FAILING_FRAMES for src in report.sources if src.state is SourceState.UP):
        up = [src for src in report.sources if src.state is SourceState.UP]
        failing = ", ".join(f"{src.id}: its last {src.failing} frames" for src in up)
        reasons.append(f"no source delivers frames: a stage fails on every one ({failing}; see the log)")
    return reasons


__all__ = ["readiness_problems"]
