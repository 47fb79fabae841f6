"""Helpers shared by the benches: machine facts, load, latency statistics, temp model repositories."""

from __future__ import annotations

import copy
import datetime
import math
import os
import platform
import resource
import statistics
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]
SAMPLE_MODELS = ROOT / "samples" / "models"


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def load_average() -> tuple[float, float, float]:
    return os.getloadavg()


def describe_load() -> str:
    one, five, fifteen = load_average()
    return f"{one:.2f}, {five:.2f}, {fifteen:.2f}"


def utc_now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def process_cpu_seconds() -> float:
    """User + system CPU time of this process (all threads) so far."""
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0-100) by linear interpolation; NaN for no values."""
    if not values:
        return math.nan
    data = sorted(values)
    pos = (len(data) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(data) - 1)
    return data[lo] + (data[hi] - data[lo]) * (pos - lo)


def median(values: Iterable[float]) -> float:
    data = [v for v in values if not math.isnan(v)]
    return statistics.median(data) if data else math.nan


@dataclass
class Window:
    """Completions recorded during one measurement: ``(wall time, latency seconds)`` pairs.

    Only completions inside ``[start, end]`` count, so warm-up and drain do not.
    """

    start: float = 0.0
    end: float = 0.0
    samples: list[tuple[float, float]] = field(default_factory=list)
    units_per_sample: int = 1
    cpu_seconds: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)

    def inside(self) -> list[float]:
        return [lat for t, lat in self.samples if self.start <= t <= self.end]

    @property
    def seconds(self) -> float:
        return max(1e-9, self.end - self.start)

    @property
    def rate(self) -> float:
        """Units (frames or crops) per second inside the window."""
        return len(self.inside()) * self.units_per_sample / self.seconds

    @property
    def cpu_cores(self) -> float:
        """CPU cores this process used on average during the window."""
        return self.cpu_seconds / self.seconds

    def latency_ms(self, q: float) -> float:
        return percentile(self.inside(), q) * 1e3

    @property
    def in_system(self) -> float:
        """Requests in flight on average (Little's law: completions/s × mean latency)."""
        lat = self.inside()
        return len(lat) / self.seconds * (sum(lat) / len(lat)) if lat else math.nan


class CpuMeter:
    """Measures this process's CPU use between :meth:`begin` and :meth:`finish`."""

    def __init__(self) -> None:
        self._cpu0 = 0.0

    def begin(self, window: Window) -> None:
        window.start = time.time()
        self._cpu0 = process_cpu_seconds()

    def finish(self, window: Window) -> None:
        window.end = time.time()
        window.cpu_seconds = process_cpu_seconds() - self._cpu0


def deep_merge(base: Mapping[str, Any], overrides: Mapping[str, Any]) -> dict[str, Any]:
    """``base`` with ``overrides`` applied; nested mappings merge, everything else replaces."""
    out = copy.deepcopy(dict(base))
    for key, value in overrides.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def write_model_config(repo: Path, name: str, overrides: Mapping[str, Any]) -> Path:
    """Copy ``samples/models/<name>/config.yaml`` into ``repo`` with ``overrides`` applied.

    The shipped PP-OCR configs point at the model files inside the installed
    wheel (``model_file.package``), so a copied config loads the same model.
    """
    src = SAMPLE_MODELS / name / "config.yaml"
    data = yaml.safe_load(src.read_text(encoding="utf-8"))
    merged = deep_merge(data, overrides)
    dst = repo / name / "config.yaml"
    dst.parent.mkdir(parents=True, exist_ok=True)
    dst.write_text(yaml.safe_dump(merged, sort_keys=False), encoding="utf-8")
    return dst


def fmt(value: float, digits: int = 1) -> str:
    return "-" if math.isnan(value) else f"{value:.{digits}f}"


def table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """A Markdown table (also readable as plain text)."""
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]

    def line(cells: Sequence[str]) -> str:
        return "| " + " | ".join(str(c).ljust(w) for c, w in zip(cells, widths, strict=True)) + " |"

    sep = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    return "\n".join([line(header), sep, *(line(r) for r in rows)])
