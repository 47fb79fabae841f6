"""The reference docs cover every config key the code accepts."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Any

import pytest

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


@pytest.mark.parametrize(
    ("doc", "classes"),
    [
        ("config.md", [PipelineConfig, SourceConfig, ReconnectConfig, StageOptions, InferOptions, TrackOptions,
                       ZonesOptions, ZoneConfig, LineConfig, NatsConfig, RuntimeConfig, HttpConfig, FleetConfig]),
        ("models.md", [ModelConfig, ModelFile, InputConfig, DynamicBatching, QueuePolicy, InstanceGroup,
                       *(TASK_OPTIONS[k] for k in TASK_OPTIONS), *(BACKEND_OPTIONS[k] for k in BACKEND_OPTIONS)]),
        ("outputs.md", [FileOutputConfig, ClipsOutputConfig]),
    ],
)  # fmt: skip
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
