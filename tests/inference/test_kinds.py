"""Kinds: one registry maps a name in the YAML to a class and checks the options it takes."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import pytest

from inference.kinds import ClassKinds, Kinds
from inference.schema import ConfigError, build, load_yaml_text, spec


@dataclass(frozen=True)
class BlurOptions:
    kind: str = "blur"
    radius: int = field(default=3, metadata=spec(ge=1))


@dataclass(frozen=True)
class SharpenOptions:
    kind: str = "sharpen"
    amount: float = 1.0
    radius: int = 1


def filters() -> Kinds[type]:
    kinds: Kinds[type] = Kinds("filter")
    kinds.register("blur", BlurOptions)
    kinds.register("sharpen", SharpenOptions)
    return kinds


def test_the_kind_named_inside_the_mapping_selects_its_options() -> None:
    kinds = filters()
    data = load_yaml_text("filter:\n  kind: sharpen\n  amount: 2.5\n", "f.yaml")
    assert kinds.build(data["filter"], None, "f.yaml", "filter") == SharpenOptions(amount=2.5)
    assert kinds.build({"radius": 5}, "blur", "request", "filter") == BlurOptions(radius=5)


def test_a_key_of_another_kind_says_where_it_belongs_and_a_typo_gets_a_suggestion() -> None:
    kinds = filters()
    data = load_yaml_text("filter:\n  kind: blur\n  amount: 2\n  radiu: 4\n  radius: 0\n", "f.yaml")
    with pytest.raises(ConfigError) as err:
        kinds.build(data["filter"], None, "f.yaml", "filter")
    assert str(err.value).splitlines() == [
        "f.yaml:3: filter.amount: belongs to filter sharpen, not blur (hint: filter blur takes: kind, radius)",
        "f.yaml:4: filter.radiu: unknown key (hint: did you mean 'radius'?)",
        "f.yaml:5: filter.radius: must be at least 1, got 0",
    ]


def test_an_unknown_or_missing_kind_is_an_error_at_its_key() -> None:
    kinds = filters()
    with pytest.raises(ConfigError) as err:
        kinds.build(load_yaml_text("kind: blurr\n", "f.yaml"), None, "f.yaml", "filter")
    assert str(err.value) == (
        "f.yaml:1: filter.kind: unknown filter 'blurr'; expected one of 'blur', 'sharpen' "
        "(hint: did you mean 'blur'?)"
    )
    with pytest.raises(ConfigError) as err:
        kinds.build(json.loads('{"radius": 2}'), None, "request", "filter")
    assert str(err.value) == "request: filter: missing required key 'kind' (hint: blur or sharpen)"


def test_a_name_is_registered_once() -> None:
    kinds = filters()
    kinds.register("blur", BlurOptions)  # the same class again: nothing changes
    with pytest.raises(ValueError, match="filter 'blur' is already"):
        kinds.register("blur", SharpenOptions)
    assert kinds.names() == ["blur", "sharpen"] and "blur" in kinds and ["blur"] not in kinds


def test_a_field_tied_to_kinds_is_built_by_them() -> None:
    kinds = filters()

    @dataclass(frozen=True)
    class Step:
        name: str
        filter: object = field(metadata=spec(kinds=kinds))

    step = build(load_yaml_text("name: a\nfilter: {kind: blur, radius: 2}\n", "s.yaml"), Step, "s.yaml")
    assert step.filter == BlurOptions(radius=2)
    with pytest.raises(ConfigError) as err:
        build(load_yaml_text("name: a\nfilter: {kind: blur, amount: .nan}\n", "s.yaml"), Step, "s.yaml")
    assert str(err.value) == (
        "s.yaml:2: filter.amount: belongs to filter sharpen, not blur (hint: filter blur takes: kind, radius)"
    )


class Blur:
    kind = "blur"
    options_type = BlurOptions


class Sharpen:
    kind = "sharpen"
    options_type = SharpenOptions


class OtherBlur:
    kind = "blur"
    options_type = SharpenOptions


def test_classes_register_with_their_options_and_the_config_side_sees_them() -> None:
    options: Kinds[type] = Kinds("filter")
    classes: ClassKinds[type] = ClassKinds(options)
    assert classes.add(Blur) is Blur and classes.add(Sharpen) is Sharpen
    assert classes["sharpen"] is Sharpen and classes.options("sharpen") is SharpenOptions
    # The options registry (what a config loader reads) holds the same names and classes.
    assert options.names() == ["blur", "sharpen"] and options["blur"] is BlurOptions
    assert classes.build({"radius": 2}, "blur", "request", "filter") == BlurOptions(radius=2)
    with pytest.raises(ValueError, match="filter 'blur' is already"):
        classes.add(OtherBlur)
    assert classes["blur"] is Blur and options["blur"] is BlurOptions
