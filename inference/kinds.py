"""Kinds: a name in the YAML that selects a class, and the options each kind takes.

A model's ``backend:`` selects what ``backend_options:`` may hold, and
``task.kind`` what the rest of ``task:`` may hold; each kind has its own frozen
options dataclass. A :class:`Kinds` registry maps the names to them and
validates a mapping against the kind it names, so a key that belongs to
another kind is an error at its line that says where it belongs::

    backend: openvino
    backend_options: {workspace_mb: 2048}
    # config.yaml:9: backend_options.workspace_mb: belongs to backend tensorrt, not openvino
    #   (hint: backend openvino takes: device, precision, preprocess, ...)

A field of a config dataclass is tied to a registry through its metadata,
``spec(kinds=REGISTRY)`` (the kind is the mapping's own ``kind:`` key) or
``spec(kinds=REGISTRY, kind_key="backend")`` (the kind is a sibling key).
"""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Callable, Iterator
from typing import Any, ClassVar, Generic, Protocol, TypeVar

from inference.schema import ConfigError, LineDict, build, line_of, raise_errors

T = TypeVar("T")


class NamedKind(Protocol):
    """A class that names its kind and its options, as backends and tasks do."""

    kind: ClassVar[str]
    options_type: ClassVar[type[Any]]


C = TypeVar("C", bound=type[NamedKind])


def _identity(value: Any) -> type[Any]:
    return value


class Kinds(Generic[T]):
    """Named kinds of one thing (``what``: "backend", "task kind"), each with its options dataclass.

    ``options`` gives a registered value's options class; by default the value
    is the options class itself. ``tag`` is the key inside a mapping that names
    its kind, when no sibling key does.
    """

    def __init__(
        self, what: str, *, tag: str = "kind", options: Callable[[T], type[Any]] = _identity
    ) -> None:
        self.what = what
        self.tag = tag
        self._options_of = options
        self._kinds: dict[str, T] = {}

    def register(self, name: str, value: T) -> T:
        """Add kind ``name``; registering another value under a taken name is an error."""
        taken = self._kinds.get(name)
        if taken is not None and taken is not value:
            raise ValueError(f"{self.what} {name!r} is already {taken!r}")
        self._kinds[name] = value
        return value

    def unregister(self, name: str) -> None:
        self._kinds.pop(name, None)

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and name in self._kinds

    def __getitem__(self, name: str) -> T:
        return self._kinds[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._kinds)

    def get(self, name: str) -> T | None:
        return self._kinds.get(name)

    def names(self) -> list[str]:
        """Every kind, in the order they were registered."""
        return list(self._kinds)

    def options(self, name: str) -> type[Any]:
        """The options dataclass of kind ``name``; KeyError when there is none."""
        return self._options_of(self._kinds[name])

    def keys_of(self, name: str) -> list[str]:
        """The keys kind ``name`` takes in YAML."""
        return [
            f.name for f in dataclasses.fields(self.options(name)) if f.init and f.metadata.get("yaml", True)
        ]

    def check(self, value: Any) -> tuple[str, str] | None:
        """``None`` for a known kind, else ``(problem, hint)`` (for ``spec(check=...)``)."""
        if value in self:
            return None
        choices = ", ".join(repr(k) for k in self._kinds)
        close = difflib.get_close_matches(str(value), self.names(), n=1)
        hint = f"did you mean {close[0]!r}?" if close else ""
        return f"unknown {self.what} {value!r}; expected one of {choices}", hint

    def build(self, data: Any, kind: str | None, file: str, path: str, line: int | None = None) -> Any:
        """Validate ``data`` (a parsed mapping) into the options of ``kind``.

        ``kind`` None: the mapping names its kind at :attr:`tag`. Keys that another
        kind takes are reported as belonging there, the rest as schema errors (unknown
        keys with a did-you-mean, types, bounds), all in one pass.
        """
        line = line_of(data) or line
        if not isinstance(data, dict):
            shown = "a list" if isinstance(data, list) else repr(data)
            raise ConfigError(file, line, path, f"expected a mapping, got {shown}")
        if kind is None:
            named = data.get(self.tag)
            at = f"{path}.{self.tag}"
            if named is None:
                raise ConfigError(
                    file, line, path, f"missing required key {self.tag!r}", " or ".join(self._kinds)
                )
            problem = self.check(named)
            if problem is not None:
                raise ConfigError(file, line_of(data, self.tag) or line, at, *problem)
            kind = str(named)
        takes = self.keys_of(kind)
        # Each key once against a map of the others' keys: a body may hold thousands of keys.
        owners_of: dict[str, list[str]] = {}
        for other in self._kinds:
            if other != kind:
                for key in self.keys_of(other):
                    owners_of.setdefault(key, []).append(other)
        errors: list[ConfigError] = []
        misplaced: set[str] = set()
        for key in data:
            owners = owners_of.get(key) if key not in takes else None
            if owners:
                misplaced.add(key)
                errors.append(
                    ConfigError(
                        file,
                        line_of(data, key) or line,
                        f"{path}.{key}",
                        f"belongs to {self.what} {' or '.join(owners)}, not {kind}",
                        f"{self.what} {kind} takes: {', '.join(takes)}",
                    )
                )
        rest = data
        if errors:
            # Validated without them, so their kind's unknown-key check does not repeat them.
            rest = LineDict({k: v for k, v in data.items() if k not in misplaced})
            rest.line = line or 0
            rest.key_lines = getattr(data, "key_lines", {})
        try:
            built = build(rest, self.options(kind), file, path)
        except ConfigError as exc:
            errors.append(exc)
        raise_errors(errors)
        return built


def _options_type(cls: type[NamedKind]) -> type[Any]:
    return cls.options_type


class ClassKinds(Kinds[C]):
    """Classes that name their kind and options (backends, tasks), kept in step with ``options``.

    The config loader checks YAML against ``options`` (a :class:`Kinds` of options
    classes) without importing the classes that run them; :meth:`add` registers a
    class here and its options there, so the two never disagree.
    """

    def __init__(self, options: Kinds[Any]) -> None:
        super().__init__(options.what, tag=options.tag, options=_options_type)
        self.options_kinds = options

    def add(self, cls: C) -> C:
        """Make ``cls.kind`` a kind taking ``cls.options_type``; a name taken by another class is an error.

        Register before configs are read.
        """
        self.options_kinds.register(cls.kind, cls.options_type)
        return self.register(cls.kind, cls)
