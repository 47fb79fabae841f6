"""The reference docs cover every config key the code accepts."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from inference.config import (
    BACKEND_OPTIONS,
    TASK_OPTIONS,
    DynamicBatching,
    InputConfig,
    InstanceGroup,
    ModelConfig,
    ModelFile,
    QueuePolicy,
)
from pipeline.config import (
    ClipsOutputConfig,
    FileOutputConfig,
    FleetConfig,
    HttpConfig,
    NatsConfig,
    PipelineConfig,
    ReconnectConfig,
    RuntimeConfig,
    SourceConfig,
)
from pipeline.stages.base import StageOptions
from pipeline.stages.infer import InferOptions
from pipeline.stages.track import TrackOptions
from pipeline.stages.zones import LineConfig, ZoneConfig, ZonesOptions
from tests.conftest import ROOT

LOADER_FIELDS = {"base_dir", "file", "lines"}  # set by the loader, refused in YAML


DOCUMENTED = [
        ("config.md", [PipelineConfig, SourceConfig, ReconnectConfig, StageOptions, InferOptions, TrackOptions,
                       ZonesOptions, ZoneConfig, LineConfig, NatsConfig, RuntimeConfig, HttpConfig, FleetConfig]),
        ("models.md", [ModelConfig, ModelFile, InputConfig, DynamicBatching, QueuePolicy, InstanceGroup,
                       *(TASK_OPTIONS[k] for k in TASK_OPTIONS), *(BACKEND_OPTIONS[k] for k in BACKEND_OPTIONS)]),
        ("outputs.md", [FileOutputConfig, ClipsOutputConfig]),
]  # fmt: skip


@pytest.mark.parametrize(("doc", "classes"), DOCUMENTED)
def test_every_config_key_is_documented(doc: str, classes: list[type]) -> None:
    # The reference tables count, not the examples in fenced blocks.
    text = re.sub(r"```.*?```", "", (ROOT / "docs" / doc).read_text(), flags=re.S)
    documented = {word for code in re.findall(r"`([^`]+)`", text) for word in re.findall(r"[a-z_0-9]+", code)}
    missing = [
        f"{cls.__name__}.{f.name}"
        for cls in classes
        for f in dataclasses.fields(cls)
        if f.name not in LOADER_FIELDS and f.name not in documented
    ]
    assert not missing, f"docs/{doc} does not mention: {', '.join(missing)}"


def test_readme_names_the_two_commands_and_ci_runs_the_test_one() -> None:
    readme = (ROOT / "README.md").read_text()
    assert "make demo" in readme and "make test" in readme
    assert "make test" in (ROOT / ".ci" / "run").read_text()


def test_readme_pipeline_example_is_valid(tmp_path: Path) -> None:
    from pipeline.config import load_config

    readme = (ROOT / "README.md").read_text()
    blocks = [b for b in re.findall(r"```yaml\n(.*?)```", readme, re.S) if b.startswith("pipeline:")]
    assert blocks
    for i, block in enumerate(blocks):
        path = tmp_path / f"example{i}.yaml"
        path.write_text(block)
        assert load_config(path).stages


def test_every_module_is_on_the_architecture_map() -> None:
    # docs/architecture.md is the map a newcomer reads first: a module missing from it
    # is a room nobody can find.
    text = (ROOT / "docs" / "architecture.md").read_text()
    modules = sorted(
        path.relative_to(ROOT)
        for package in ("pipeline", "inference")
        for path in (ROOT / package).rglob("*.py")
        if path.name != "__init__.py"
    )
    missing = [str(m) for m in modules if m.name not in text]
    assert not missing, f"docs/architecture.md does not name: {', '.join(missing)}"


def _documented_defaults(doc: str) -> dict[str, list[object]]:
    """Each key of the reference tables with the default(s) written for it (``none`` as None)."""
    out: dict[str, list[object]] = {}
    column = key_column = None
    for line in (ROOT / "docs" / doc).read_text().splitlines():
        if not line.startswith("|"):
            column = None
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if column is None:
            column = cells.index("default") if "default" in cells else -1
            # Per-kind tables name the kind first and the key in a column of its own.
            key_column = cells.index("key") if "key" in cells else 0
            continue
        if column < 0 or len(cells) <= column or set(cells[0]) <= {"-", " "}:
            continue
        keys = [k.split(".")[-1] for k in re.findall(r"`([a-z_0-9.]+)`", cells[key_column or 0])]
        cell = cells[column]
        values: list[object]
        if cell == "none":
            values = [None] * len(keys)
        elif not cell.startswith("`"):  # "required", "the model's", "all but `v4l2`": prose
            continue
        else:
            values = [yaml.safe_load(v) for v in re.findall(r"`([^`]+)`", cell)]
        if len(values) == len(keys):
            for key, value in zip(keys, values, strict=True):
                out.setdefault(key, []).append(value)
    return out


def _same(documented: object, default: object) -> bool:
    if isinstance(documented, str) and re.fullmatch(r"\d+/\d+", documented):
        num, den = documented.split("/")
        documented = int(num) / int(den)
    if isinstance(default, tuple):
        default = list(default)
    if documented is None:  # "none": no value, or an empty list or string
        return default in (None, [], "")
    if default is None:  # derived at run time; the docs name where from (`runtime.max_sources`)
        return isinstance(documented, str)
    if isinstance(default, list) and default and not isinstance(documented, list):
        # One number for every channel: `0` documents [0.0, 0.0, 0.0].
        return all(_same(documented, item) for item in default)
    if (
        isinstance(default, float)
        and isinstance(documented, int | float)
        and not isinstance(documented, bool)
    ):
        return abs(default - documented) < 1e-9
    return type(documented) is type(default) and documented == default


@pytest.mark.parametrize(("doc", "classes"), DOCUMENTED)
def test_every_documented_default_is_the_code_default(doc: str, classes: list[type]) -> None:
    # The dataclass is where a default is written; the tables must say the same value.
    documented = _documented_defaults(doc)
    wrong = []
    for cls in classes:
        for f in dataclasses.fields(cls):
            if f.name not in documented or f.name in LOADER_FIELDS:
                continue
            if f.default is not dataclasses.MISSING:
                default = f.default
            elif f.default_factory is not dataclasses.MISSING:
                default = f.default_factory()
            else:
                continue
            simple = int | float | str | bool | type(None)
            if isinstance(default, list | tuple) and not all(isinstance(v, simple) for v in default):
                continue
            if not isinstance(default, simple | list | tuple):
                continue
            if not any(_same(value, default) for value in documented[f.name]):
                wrong.append(f"{cls.__name__}.{f.name} = {default!r}, docs/{doc} says {documented[f.name]}")
    assert not wrong, "\n".join(wrong)


@pytest.mark.parametrize(
    ("heading", "kinds"), [("### Task options", TASK_OPTIONS), ("### Backend options", BACKEND_OPTIONS)]
)
def test_the_per_kind_tables_list_exactly_each_kind_s_keys(heading: str, kinds: Any) -> None:
    text = (ROOT / "docs" / "models.md").read_text()
    section = text.split(heading, 1)[1].split("\n#", 1)[0]
    rows = re.findall(r"^\| `([a-z_0-9]+)` \| `([a-z_0-9]+)` \|", section, re.M)
    documented = {(kind, key) for kind, key in rows}
    # The tag itself (task.kind) is the table's first column, not a row.
    wanted = {(kind, key) for kind in kinds for key in kinds.keys_of(kind) if key != "kind"}
    assert sorted(documented) == sorted(wanted)
