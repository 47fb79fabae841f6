"""Typed YAML configuration with errors that point at ``FILE:LINE``.

Both model configs (``models/<name>/config.yaml``) and pipeline configs are
described as frozen dataclasses. :func:`load_yaml` parses a file with the safe
loader while remembering the line of every key and list item, and
:func:`build` turns the parsed tree into the dataclass, checking types, ranges
and unknown keys. Every problem becomes a :class:`ConfigError` whose message
reads ``FILE:LINE: path.to.key: what is wrong (hint: what to do)``.

A dataclass field can carry validation metadata::

    threshold: float = field(default=0.5, metadata=spec(ge=0, le=1, help="..."))
    backend_options: BackendOptions = field(metadata=spec(kinds=BACKEND_OPTIONS, kind_key="backend"))

The second form makes a field's options class depend on a kind
(:mod:`inference.kinds`). Every number read is finite (``.nan``, ``.inf`` and
JSON's ``NaN``/``Infinity`` are refused) and every integer fits 64 bits.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import re
import types
import typing
from collections.abc import Callable, Mapping
from dataclasses import MISSING, dataclass
from pathlib import Path
from typing import Any, Literal, Protocol, TypeVar, Union, get_args, get_origin

import yaml

from inference.errors import VidpipeError

T = TypeVar("T")


class ConfigError(VidpipeError, ValueError):
    """A configuration problem located at ``file:line``; ``path`` is the dotted key to fix."""

    def __init__(self, file: str, line: int | None, path: str, problem: str, hint: str = "") -> None:
        self.file = file
        self.line = line
        self.path = path
        self.problem = problem
        self.hint = hint
        super().__init__(self.render())

    def render(self) -> str:
        where = f"{self.file}:{self.line}" if self.line else self.file
        what = f"{self.path}: {self.problem}" if self.path else self.problem
        return f"{where}: {what}" + (f" (hint: {self.hint})" if self.hint else "")

    @property
    def errors(self) -> list[ConfigError]:
        """Every problem this error stands for: itself (:class:`ConfigErrors` holds several)."""
        return [self]


# Enough to fix a file in one pass without burying the first problems under the rest.
MAX_REPORTED_ERRORS = 20


class ConfigErrors(ConfigError):
    """Several configuration problems found in one pass, in file and line order.

    ``file``, ``line``, ``path``, ``problem`` and ``hint`` are the first problem's
    (for callers that show one); ``str()`` is one ``FILE:LINE: ...`` line per
    problem, at most :data:`MAX_REPORTED_ERRORS`, then a count of the rest.
    """

    def __init__(self, errors: list[ConfigError]) -> None:
        flat = [e for err in errors for e in err.errors]
        self._errors = sorted(flat, key=lambda e: (e.file, e.line or 0))
        first = self._errors[0]
        super().__init__(first.file, first.line, first.path, first.problem, first.hint)

    @property
    def errors(self) -> list[ConfigError]:
        return list(self._errors)

    def render(self) -> str:
        if not getattr(self, "_errors", None):
            return super().render()
        shown = [e.render() for e in self._errors[:MAX_REPORTED_ERRORS]]
        rest = len(self._errors) - len(shown)
        if rest:
            shown.append(f"... and {rest} more problem(s)")
        return "\n".join(shown)


# Unknown keys of one mapping reported one by one (with a did-you-mean); the rest are counted.
MAX_UNKNOWN_REPORTED = 5


def raise_errors(errors: list[ConfigError]) -> None:
    """Raise nothing for no errors, the error itself for one, :class:`ConfigErrors` for more."""
    flat = [e for err in errors for e in err.errors]
    if len(flat) == 1:
        raise flat[0]
    if flat:
        raise ConfigErrors(flat)


@dataclass(frozen=True, eq=False)
class ConfigOrigin:
    """Where a built config came from: its file and the parsed YAML that remembers lines.

    Checks that can only run later (a model file that does not match its
    config, a provider this machine lacks) use it to point at the key's line.
    """

    file: str
    data: Any = None

    def line(self, key: str) -> int | None:
        """The line of a dotted key, or of its nearest parent present in the file."""
        node = self.data
        line = line_of(node)
        for part in key.split("."):
            here = line_of(node, part) if isinstance(node, dict) else None
            if here is None:
                break
            line = here
            node = node.get(part)
        return line


class LineDict(dict[str, Any]):
    """A mapping that remembers the line of each key (1-based)."""

    line: int = 0
    key_lines: dict[str, int]


class LineList(list[Any]):
    """A sequence that remembers the line of each item (1-based)."""

    line: int = 0
    item_lines: list[int]


class _LineLoader(yaml.SafeLoader):
    """The safe loader, recording where each mapping key and list item sits."""


def _construct_mapping(loader: _LineLoader, node: yaml.MappingNode) -> LineDict:
    out = LineDict()
    out.line = node.start_mark.line + 1
    out.key_lines = {}
    loader.flatten_mapping(node)
    for key_node, value_node in node.value:
        key = loader.construct_object(key_node, deep=True)
        if not isinstance(key, str):
            raise yaml.constructor.ConstructorError(
                None, None, f"mapping keys must be strings, got {key!r}", key_node.start_mark
            )
        if key in out:
            raise yaml.constructor.ConstructorError(None, None, f"duplicate key {key!r}", key_node.start_mark)
        out[key] = loader.construct_object(value_node, deep=True)
        out.key_lines[key] = key_node.start_mark.line + 1
    return out


def _construct_sequence(loader: _LineLoader, node: yaml.SequenceNode) -> LineList:
    out = LineList(loader.construct_object(child, deep=True) for child in node.value)
    out.line = node.start_mark.line + 1
    out.item_lines = [child.start_mark.line + 1 for child in node.value]
    return out


# YAML 1.2 booleans: only true/false. YAML 1.1 would read the cascade key `on:`
# (and yes/no/off) as a boolean.
_LineLoader.yaml_implicit_resolvers = {
    first: [(tag, rx) for tag, rx in resolvers if tag != "tag:yaml.org,2002:bool"]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
_LineLoader.add_implicit_resolver(
    "tag:yaml.org,2002:bool",
    re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"),
    list("tTfF"),
)
_LineLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)
_LineLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_SEQUENCE_TAG, _construct_sequence)


class _OutOfRange(yaml.constructor.ConstructorError):
    """An integer with more digits than Python converts (``sys.get_int_max_str_digits``)."""


def _construct_int(loader: _LineLoader, node: yaml.ScalarNode) -> int:
    try:
        return int(yaml.SafeLoader.construct_yaml_int(loader, node))
    except ValueError:
        digits = sum(c.isdigit() for c in node.value)
        raise _OutOfRange(
            None, None, f"out of range: an integer of {digits} digits", node.start_mark
        ) from None


_LineLoader.add_constructor("tag:yaml.org,2002:int", _construct_int)


# Bounds on what a config file may make the loader build. Real pipeline and model
# configs are a few hundred nodes, a few levels deep and a few KiB; the bounds stop a
# file (or an API body) whose aliases expand to millions of nodes ("billion laughs")
# before it is expanded, and stop nesting deep enough to exhaust the parser's stack.
MAX_CONFIG_BYTES = 1024 * 1024
MAX_CONFIG_NODES = 100_000
MAX_CONFIG_DEPTH = 32


def _check_expansion(root: yaml.Node, file: str) -> None:
    """Refuse a document that would expand past :data:`MAX_CONFIG_NODES` or :data:`MAX_CONFIG_DEPTH`.

    Aliases are shared nodes in the composed graph, so sizes are counted once per
    node (memoised): the check costs the file's size, not its expansion's.
    """
    sizes: dict[int, int] = {}
    depths: dict[int, int] = {}
    active: set[int] = set()

    def fail(node: yaml.Node, problem: str, hint: str) -> ConfigError:
        return ConfigError(file, node.start_mark.line + 1, "", problem, hint)

    def visit(node: yaml.Node, level: int) -> None:
        key = id(node)
        if key in sizes:
            return
        if level > MAX_CONFIG_DEPTH:
            raise fail(node, f"nested deeper than {MAX_CONFIG_DEPTH} levels", "flatten the structure")
        if key in active:
            raise fail(node, "an alias refers to a node that contains it", "remove the recursive alias")
        children: list[yaml.Node] = []
        if isinstance(node, yaml.SequenceNode):
            children = list(node.value)
        elif isinstance(node, yaml.MappingNode):
            children = [part for pair in node.value for part in pair]
        active.add(key)
        for child in children:
            visit(child, level + 1)
        active.discard(key)
        sizes[key] = 1 + sum(sizes[id(c)] for c in children)
        depths[key] = 1 + max((depths[id(c)] for c in children), default=0)
        if sizes[key] > MAX_CONFIG_NODES:
            raise fail(
                node,
                f"expands to more than {MAX_CONFIG_NODES:,} values (through aliases)",
                "a config needs far fewer; remove the repeated aliases",
            )
        if level + depths[key] - 1 > MAX_CONFIG_DEPTH:
            raise fail(node, f"nested deeper than {MAX_CONFIG_DEPTH} levels", "flatten the structure")

    visit(root, 1)


def load_yaml_text(text: str, file: str) -> Any:
    """Parse YAML text safely; syntax errors and oversized documents become :class:`ConfigError`."""
    if len(text) > MAX_CONFIG_BYTES:
        raise ConfigError(
            file, None, "", f"larger than {MAX_CONFIG_BYTES // 1024} KiB", "is this the right file?"
        )
    loader = _LineLoader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        _check_expansion(node, file)
        return loader.construct_document(node)
    except RecursionError:
        raise ConfigError(
            file, None, "", f"nested deeper than {MAX_CONFIG_DEPTH} levels", "flatten the structure"
        ) from None
    except _OutOfRange as exc:
        line = exc.problem_mark.line + 1 if exc.problem_mark else None
        raise ConfigError(file, line, "", str(exc.problem)) from None
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        # An unclosed bracket or quote is reported at the end of the file; the line
        # where it was opened is the one to fix.
        if exc.context_mark is not None and "<stream end>" in str(exc.problem):
            mark = exc.context_mark
        line = mark.line + 1 if mark else None
        problem = f"invalid YAML: {exc.problem or exc.context}"
        if exc.context:
            problem += f" ({exc.context})"
        raise ConfigError(file, line, "", problem, "check indentation, colons and quotes") from None
    except yaml.YAMLError as exc:
        raise ConfigError(file, None, "", f"invalid YAML: {exc}") from None
    finally:
        loader.dispose()


def load_yaml(path: str | Path) -> Any:
    """Read and parse a YAML file; a missing or unreadable file is a :class:`ConfigError`."""
    p = Path(path)
    try:
        if p.is_file() and p.stat().st_size > MAX_CONFIG_BYTES:
            raise ConfigError(
                str(p), None, "", f"larger than {MAX_CONFIG_BYTES // 1024} KiB", "is this the right file?"
            )
        text = p.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(str(p), None, "", "file not found", "check the path") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(
            str(p),
            None,
            "",
            f"not a YAML text file (byte {exc.start} is not UTF-8 text)",
            "is this the right file?",
        ) from None
    except OSError as exc:
        raise ConfigError(str(p), None, "", f"cannot read file: {exc}") from None
    return load_yaml_text(text, str(p))


def spec(
    *,
    ge: float | None = None,
    le: float | None = None,
    gt: float | None = None,
    min_len: int | None = None,
    help: str = "",
    check: Callable[[Any], str | tuple[str, str] | None] | None = None,
    kinds: KindOptions | None = None,
    kind_key: str | None = None,
) -> dict[str, Any]:
    """Validation metadata for a dataclass field (bounds, a help hint, a custom check).

    ``check`` returns the problem, or ``(problem, hint)``, or None. ``kinds``: the
    field's options class depends on a kind (:class:`inference.kinds.Kinds`),
    named by the sibling key ``kind_key`` or, without one, inside the mapping.
    """
    return {
        "ge": ge,
        "le": le,
        "gt": gt,
        "min_len": min_len,
        "help": help,
        "check": check,
        "kinds": kinds,
        "kind_key": kind_key,
    }


class KindOptions(Protocol):
    """What a field's ``spec(kinds=...)`` must do (see :class:`inference.kinds.Kinds`)."""

    def __contains__(self, name: object) -> bool: ...

    def build(self, data: Any, kind: str | None, file: str, path: str, line: int | None = None) -> Any: ...


@dataclass
class _Ctx:
    file: str
    path: str
    line: int | None

    def child(self, key: str | int, line: int | None) -> _Ctx:
        if isinstance(key, int):
            path = f"{self.path}[{key}]"
        else:
            path = f"{self.path}.{key}" if self.path else key
        return _Ctx(self.file, path, line or self.line)

    def error(self, problem: str, hint: str = "") -> ConfigError:
        return ConfigError(self.file, self.line, self.path, problem, hint)


def _describe(tp: Any) -> str:
    origin = get_origin(tp)
    if tp is int:
        return "an integer"
    if tp is float:
        return "a number"
    if tp is str:
        return "a string"
    if tp is bool:
        return "true or false"
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in get_args(tp))
    if origin in (list, tuple):
        return "a list"
    if origin in (dict, Mapping):
        return "a mapping"
    if dataclasses.is_dataclass(tp):
        return "a mapping"
    if origin in (Union, types.UnionType):
        return " or ".join(_describe(a) for a in get_args(tp) if a is not type(None))
    return getattr(tp, "__name__", str(tp))


def shown(value: Any) -> str:
    """A value as an error message shows it: its kind for containers, else its repr (cut short)."""
    if isinstance(value, dict):
        return "a mapping"
    if isinstance(value, list):
        return "a list"
    if value is None:
        return "nothing (null)"
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


# Integers (and integers given for numbers) beyond 64 bits are refused where they are
# read: no setting needs them, and a 400-digit one would overflow on first use.
MAX_INTEGER = 2**63 - 1


def _too_large(value: int) -> str:
    digits = len(str(abs(value)))
    return f"out of range: an integer of {digits} digits (at most ±{MAX_INTEGER:,})"


def _convert(value: Any, tp: Any, ctx: _Ctx, meta: Mapping[str, Any]) -> Any:
    origin = get_origin(tp)
    if tp is Any:
        return value
    if origin in (Union, types.UnionType):
        args = get_args(tp)
        if value is None and type(None) in args:
            return None
        errors: list[ConfigError] = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _convert(value, arg, ctx, meta)
            except ConfigError as exc:
                errors.append(exc)
        # One non-None alternative: its own error is the most precise.
        if len(errors) == 1:
            raise errors[0]
        raise ctx.error(f"expected {_describe(tp)}, got {shown(value)}", meta.get("help", ""))
    if dataclasses.is_dataclass(tp) and isinstance(tp, type):
        if not isinstance(value, dict):
            raise ctx.error(f"expected a mapping, got {shown(value)}", meta.get("help", ""))
        return _build_dataclass(value, tp, ctx)
    if origin is Literal:
        choices = get_args(tp)
        if value not in choices:
            close = difflib.get_close_matches(str(value), [str(c) for c in choices], n=1)
            hint = f"did you mean {close[0]!r}?" if close else meta.get("help", "")
            raise ctx.error(f"expected {_describe(tp)}, got {shown(value)}", hint)
        return value
    if origin in (list, tuple):
        if not isinstance(value, list):
            raise ctx.error(f"expected a list, got {shown(value)}", meta.get("help", ""))
        item_tp = (get_args(tp) or (Any,))[0]
        lines = getattr(value, "item_lines", [None] * len(value))
        items: list[Any] = []
        item_errors: list[ConfigError] = []
        for i, v in enumerate(value):
            try:
                items.append(_convert(v, item_tp, ctx.child(i, lines[i] if i < len(lines) else None), {}))
            except ConfigError as exc:
                item_errors.append(exc)
        raise_errors(item_errors)
        return tuple(items) if origin is tuple else items
    if origin in (dict, Mapping):
        if not isinstance(value, dict):
            raise ctx.error(f"expected a mapping, got {shown(value)}", meta.get("help", ""))
        _, val_tp = get_args(tp) or (str, Any)
        key_lines = getattr(value, "key_lines", {})
        return {k: _convert(v, val_tp, ctx.child(k, key_lines.get(k)), {}) for k, v in value.items()}
    if tp is bool:
        if not isinstance(value, bool):
            raise ctx.error(f"expected true or false, got {shown(value)}", meta.get("help", ""))
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ctx.error(f"expected an integer, got {shown(value)}", meta.get("help", ""))
        if not -MAX_INTEGER <= value <= MAX_INTEGER:
            raise ctx.error(_too_large(value), meta.get("help", ""))
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ctx.error(f"expected a number, got {shown(value)}", meta.get("help", ""))
        if isinstance(value, int) and not -MAX_INTEGER <= value <= MAX_INTEGER:
            raise ctx.error(_too_large(value), meta.get("help", ""))
        if not math.isfinite(value):
            # NaN passes every bound check (each comparison is false) and inf overflows
            # arithmetic later: a reconnect delay of NaN retried without pause.
            raise ctx.error(f"expected a finite number, got {value}", meta.get("help", ""))
        return float(value)
    if tp is str:
        if isinstance(value, (int, float)):
            # YAML read `id: 7` (or `name: 1.5`, `pipeline: yes`...) as a number or a boolean.
            key = ctx.path.rsplit(".", 1)[-1]
            written = str(value).lower() if isinstance(value, bool) else str(value)
            quoted = f'"{written}"' if key.endswith("]") else f'{key}: "{written}"'
            raise ctx.error(f"expected a string, got {shown(value)}", f"write it in quotes: {quoted}")
        if not isinstance(value, str):
            raise ctx.error(f"expected a string, got {shown(value)}", meta.get("help", ""))
        return value
    raise TypeError(f"unsupported config type {tp!r} at {ctx.path}")


def _check_bounds(value: Any, ctx: _Ctx, meta: Mapping[str, Any]) -> None:
    if value is None:
        return
    hint = meta.get("help", "")
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if meta.get("ge") is not None and value < meta["ge"]:
            raise ctx.error(f"must be at least {meta['ge']}, got {value}", hint)
        if meta.get("gt") is not None and value <= meta["gt"]:
            raise ctx.error(f"must be greater than {meta['gt']}, got {value}", hint)
        if meta.get("le") is not None and value > meta["le"]:
            raise ctx.error(f"must be at most {meta['le']}, got {value}", hint)
    if meta.get("min_len") is not None and len(value) < meta["min_len"]:
        raise ctx.error(f"must have at least {meta['min_len']} item(s)", hint)
    check = meta.get("check")
    if check is not None:
        problem = check(value)
        if isinstance(problem, tuple):
            raise ctx.error(*problem)
        if problem:
            raise ctx.error(problem, hint)


def _build_dataclass(data: dict[str, Any], cls: type[T], ctx: _Ctx) -> T:
    hints = typing.get_type_hints(cls)
    # Fields marked yaml=False (e.g. a config's origin) are set by code, never by the file.
    fields = {
        f.name: f
        for f in dataclasses.fields(cls)  # type: ignore[arg-type]
        if f.init and f.metadata.get("yaml", True)
    }
    key_lines: dict[str, int] = getattr(data, "key_lines", {})
    # Every problem of this mapping (and those below it) is collected, not just the first.
    errors: list[ConfigError] = []
    suggested: set[str] = set()  # a missing key an unknown one was taken for is not said twice
    unknown = [key for key in data if key not in fields]
    # Past the errors a reader is shown, unknown keys are counted, not each matched and
    # reported: a body of 60,000 keys would otherwise cost seconds of suggestions.
    shown = unknown if len(unknown) <= MAX_REPORTED_ERRORS else unknown[: MAX_REPORTED_ERRORS - 1]
    for key in shown:
        close = difflib.get_close_matches(key, list(fields), n=1)
        suggested.update(close)
        hint = f"did you mean {close[0]!r}?" if close else "allowed keys: " + ", ".join(fields)
        errors.append(ctx.child(key, key_lines.get(key)).error("unknown key", hint))
    if len(shown) < len(unknown):
        rest = len(unknown) - len(shown)
        errors.append(ctx.error(f"{rest} more unknown key(s)", "allowed keys: " + ", ".join(fields)))
    kwargs: dict[str, Any] = {}
    for name, f in fields.items():
        child = ctx.child(name, key_lines.get(name))
        if name not in data:
            if f.default is MISSING and f.default_factory is MISSING and name not in suggested:
                errors.append(ctx.error(f"missing required key {name!r}", f.metadata.get("help", "")))
            continue
        try:
            kinds = f.metadata.get("kinds")
            if kinds is not None:
                by = f.metadata.get("kind_key")
                kind = data.get(by, fields[by].default) if by else None
                if by and kind not in kinds:
                    continue  # the kind's own key says what is wrong with it
                value = kinds.build(data[name], kind, child.file, child.path, child.line)
            else:
                value = _convert(data[name], hints[name], child, f.metadata)
            _check_bounds(value, child, f.metadata)
        except ConfigError as exc:
            errors.append(exc)
            continue
        kwargs[name] = value
    raise_errors(errors)
    try:
        obj = cls(**kwargs)
    except ValueError as exc:  # __post_init__ cross-field checks
        raise ctx.error(str(exc)) from None
    return obj


def build(data: Any, cls: type[T], file: str, path: str = "") -> T:
    """Validate parsed YAML ``data`` into the dataclass ``cls``."""
    line = getattr(data, "line", None) or 1
    ctx = _Ctx(file, path, line)
    if not isinstance(data, dict):
        raise ctx.error(f"expected a mapping at the top level, got {shown(data)}")
    return _build_dataclass(data, cls, ctx)


def line_of(data: Any, key: str | int | None = None) -> int | None:
    """The line of ``key`` (or of the node itself) in parsed YAML, when known."""
    if key is None:
        return getattr(data, "line", None)
    if isinstance(key, int):
        lines = getattr(data, "item_lines", None)
        return lines[key] if lines and key < len(lines) else None
    lines_map = getattr(data, "key_lines", None)
    return lines_map.get(key) if lines_map else None
