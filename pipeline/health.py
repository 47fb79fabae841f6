"""Liveness and readiness, as ``/healthz`` and ``/readyz`` report them.

* live: the process answers HTTP, so its event loop turns (restart it otherwise);
* ready: every model the stages use is loaded, NATS is connected, and at least
  one source delivers frames (send traffic / count it as serving otherwise).
"""

from __future__ import annotations

from typing import Any

from pipeline.sources.base import SourceState


def readiness_problems(runtime: Any) -> list[str]:
    """Why ``runtime`` is not ready, one short reason each; empty when ready."""
    reasons: list[str] = []
    needed = {s.model for s in runtime.config.stages if s.model}
    models = runtime.models
    if needed and models is None:
        reasons.append("models are not loaded yet")
    elif needed and callable(getattr(models, "status", None)):
        seen = set()
        for status in models.status():
            if status.name not in needed:
                continue
            seen.add(status.name)
            state = str(getattr(status.state, "value", status.state)).lower()
            if state != "ready":
                detail = f": {status.reason}" if getattr(status, "reason", "") else ""
                reasons.append(f"model {status.name} is {state}{detail}")
        reasons.extend(f"model {name} is not loaded" for name in sorted(needed - seen))
    if not runtime.publisher.connected.is_set():
        reasons.append("NATS is not connected")
    runs = list(runtime.sources.values())
    if not runs:
        reasons.append("no sources")
    elif not any(run.source.state == SourceState.UP for run in runs):
        states = ", ".join(f"{run.source.id} {run.source.state.value}" for run in runs)
        reasons.append(f"no source is up ({states})")
    return reasons


__all__ = ["readiness_problems"]
