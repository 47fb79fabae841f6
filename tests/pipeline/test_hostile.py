"""Hostile input: every door that takes input refuses what would hurt the process.

Each test feeds one attack to the real thing (the CLI in a subprocess, a live HTTP
server on a real socket, FFmpeg through PyAV) and checks that it is refused with a
clear reason, quickly, and without a traceback.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from inference.schema import MAX_CONFIG_DEPTH, ConfigError
from pipeline.config import load_config
from tests.conftest import run_cli

GOOD = """\
pipeline: shop
sources:
  - url: test://?frames=3
"""

# Nine levels of nine aliases: 9**9 (387 million) strings once expanded.
ALIAS_BOMB = "".join(
    f"{name}: &{name} [{', '.join([f'*{prev}'] * 9) if prev else ', '.join(['lol'] * 9)}]\n"
    for prev, name in zip([None, *"abcdefgh"], "abcdefghi", strict=True)
)


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "pipeline.yaml"
    path.write_text(text)
    return path


# -- config parsing ------------------------------------------------------------------------


def test_alias_bomb_is_refused_at_once_with_file_and_line(tmp_path: Path) -> None:
    path = write(
        tmp_path, GOOD + "extra:\n" + "".join("  " + line + "\n" for line in ALIAS_BOMB.splitlines())
    )
    started = time.monotonic()
    result = run_cli("validate", str(path), timeout=60)
    elapsed = time.monotonic() - started
    assert result.returncode == 2, result.stderr
    assert f"{path}:" in result.stderr
    assert "expands to more than 100,000 values (through aliases)" in result.stderr
    assert "Traceback" not in result.stderr
    # Expanding it took 32 s and 2.2 GB before the check; refusing it is a Python start-up.
    assert elapsed < 15


def test_deep_nesting_is_refused_with_a_config_error(tmp_path: Path) -> None:
    path = write(tmp_path, GOOD + "extra: " + "[" * 5000 + "]" * 5000 + "\n")
    result = run_cli("validate", str(path), timeout=60)
    assert result.returncode == 2, result.stderr
    assert f"nested deeper than {MAX_CONFIG_DEPTH} levels" in result.stderr
    assert "Traceback" not in result.stderr and "RecursionError" not in result.stderr


def test_moderate_nesting_past_the_bound_names_the_line(tmp_path: Path) -> None:
    deep = "[" * (MAX_CONFIG_DEPTH + 1) + "]" * (MAX_CONFIG_DEPTH + 1)
    path = write(tmp_path, GOOD + f"extra: {deep}\n")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert info.value.line == 4
    assert f"nested deeper than {MAX_CONFIG_DEPTH} levels" in str(info.value)


def test_oversized_config_file_is_refused_before_parsing(tmp_path: Path) -> None:
    path = write(tmp_path, GOOD + "# " + "x" * (2 * 1024 * 1024) + "\n")
    result = run_cli("validate", str(path), timeout=60)
    assert result.returncode == 2, result.stderr
    assert "larger than 1024 KiB" in result.stderr


def test_anchors_and_merge_keys_still_work(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        "pipeline: shop\n"
        "x-camera: &camera {queue_size: 3, max_fps: 5}\n"
        "sources:\n"
        "  - {<<: *camera, id: a, url: 'test://?frames=3'}\n"
        "  - {<<: *camera, id: b, url: 'test://?frames=3'}\n",
    )
    with pytest.raises(ConfigError, match="x-camera: unknown key"):
        load_config(path)  # the anchor's own key is still an unknown key; the merges parsed


# -- identifiers ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "line", "field"),
    [
        (GOOD.replace("pipeline: shop", 'pipeline: "shop\\n"'), 1, "pipeline"),
        (GOOD + 'nats: {subject_prefix: "vidpipe\\n"}\n', 4, "nats.subject_prefix"),
    ],
)
def test_identifier_with_trailing_newline_is_refused(
    tmp_path: Path, text: str, line: int, field: str
) -> None:
    # "$" matches before a final newline: such an id passed, and its source published nothing.
    with pytest.raises(ConfigError) as info:
        load_config(write(tmp_path, text))
    assert (info.value.path, info.value.line) == (field, line)
    assert "is not a valid name" in info.value.problem


def test_source_id_with_trailing_newline_is_refused(tmp_path: Path) -> None:
    path = write(tmp_path, 'pipeline: shop\nsources:\n  - {id: "cam1\\n", url: "test://?frames=3"}\n')
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert info.value.path == "sources[0].id"
    assert "'cam1\\n' is not a valid name" in info.value.problem
