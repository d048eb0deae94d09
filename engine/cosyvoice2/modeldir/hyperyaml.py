"""Read the model directory's ``cosyvoice2.yaml`` without hyperpyyaml, and without running it.

The official file is hyperpyyaml: plain YAML plus tags that name Python objects
(``!new:pkg.Class`` builds an instance from the mapping under it, ``!name:pkg.func``
makes a partial, ``!apply:pkg.func`` calls at load time, ``!ref <key>`` points at
another top-level entry and may do arithmetic such as ``<chunk_size> * <token_mel_ratio>``).
Loading it the official way imports and constructs every object it names. Here the
tags become inert nodes (:class:`YamlObject`, :class:`Ref`): nothing named in the file
is imported. :func:`load_yaml` parses and resolves the references;
:mod:`tts_gateway.engine.cosyvoice2.modeldir.mapping` maps the nodes onto typed configs.
"""

from __future__ import annotations

import ast
import operator
import os
import re
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml


class ConfigError(ValueError):
    """The model configuration is malformed or asks for something this engine does not do."""


# ---------------------------------------------------------------------------
# Inert tag nodes


@dataclass
class YamlObject:
    """A ``!new:``, ``!name:`` or ``!apply:`` node: what would be built, not built."""

    kind: str  # "new" | "name" | "apply"
    target: str
    kwargs: dict[str, Any] = field(default_factory=dict)
    args: list[Any] = field(default_factory=list)


@dataclass(frozen=True)
class Ref:
    """``!ref`` (or ``!copy``) before resolution: ``<key>`` references with optional arithmetic."""

    expr: str
    copy: bool = False


@dataclass(frozen=True)
class _Placeholder:
    pass


_FLOAT_12 = re.compile(
    r"""^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+]?[0-9]+)?
        |[-+]?(?:[0-9][0-9_]*)(?:[eE][-+]?[0-9]+)
        |[-+]?\.[0-9_]+(?:[eE][-+]?[0-9]+)?
        |[-+]?\.(?:inf|Inf|INF)
        |\.(?:nan|NaN|NAN))$""",
    re.X,
)
_BOOL_12 = re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$")


class _Loader(yaml.SafeLoader):
    """SafeLoader with YAML 1.2 scalars (``1e-06`` is a float, ``yes`` a string) and inert tags.

    hyperpyyaml reads with ruamel.yaml, a YAML 1.2 parser; PyYAML's 1.1 resolvers would
    read ``sigma_min: 1e-06`` as a string.
    """


_Loader.yaml_implicit_resolvers = {
    first: [(tag, rx) for tag, rx in resolvers if tag not in ("tag:yaml.org,2002:float", "tag:yaml.org,2002:bool")]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
_Loader.add_implicit_resolver("tag:yaml.org,2002:float", _FLOAT_12, list("-+0123456789."))
_Loader.add_implicit_resolver("tag:yaml.org,2002:bool", _BOOL_12, list("tTfF"))


def _construct_bool(loader: yaml.SafeLoader, node: yaml.Node) -> bool:
    return loader.construct_scalar(node).lower() == "true"


def _object_constructor(kind: str):
    def construct(loader: yaml.SafeLoader, suffix: str, node: yaml.Node) -> YamlObject:
        target = suffix.strip()
        if not target:
            raise ConfigError(f"!{kind}: tag without a target at {node.start_mark}")
        if isinstance(node, yaml.MappingNode):
            kwargs = loader.construct_mapping(node, deep=True)
            return YamlObject(kind, target, dict(kwargs))
        if isinstance(node, yaml.SequenceNode):
            return YamlObject(kind, target, {}, list(loader.construct_sequence(node, deep=True)))
        value = loader.construct_scalar(node)
        return YamlObject(kind, target, {}, [] if value in ("", None) else [value])

    return construct


def _ref_constructor(copy: bool):
    def construct(loader: yaml.SafeLoader, node: yaml.Node) -> Ref:
        return Ref(str(loader.construct_scalar(node)), copy)

    return construct


def _tuple_constructor(loader: yaml.SafeLoader, node: yaml.Node) -> tuple:
    return tuple(loader.construct_sequence(node, deep=True))


def _include_constructor(loader: yaml.SafeLoader, suffix: str, node: yaml.Node):
    raise ConfigError(f"!include:{suffix} is not supported in a model directory's yaml")


def _placeholder_constructor(loader: yaml.SafeLoader, node: yaml.Node) -> _Placeholder:
    return _Placeholder()


_Loader.add_constructor("tag:yaml.org,2002:bool", _construct_bool)
for _kind in ("new", "name", "apply"):
    _Loader.add_multi_constructor(f"!{_kind}:", _object_constructor(_kind))
_Loader.add_constructor("!ref", _ref_constructor(False))
_Loader.add_constructor("!copy", _ref_constructor(True))
_Loader.add_constructor("!tuple", _tuple_constructor)
_Loader.add_constructor("!PLACEHOLDER", _placeholder_constructor)
_Loader.add_multi_constructor("!include:", _include_constructor)


# ---------------------------------------------------------------------------
# Reference resolution

_REF = re.compile(r"<([^<>]+)>")
_ARITH_OPS = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}


def _arith(expr: str) -> Any:
    """Evaluate numbers, + - * / // % ** and parentheses; anything else raises ValueError."""

    def ev(node: ast.AST) -> Any:
        if isinstance(node, ast.Expression):
            return ev(node.body)
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _ARITH_OPS:
            return _ARITH_OPS[type(node.op)](ev(node.left), ev(node.right))
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
            value = ev(node.operand)
            return -value if isinstance(node.op, ast.USub) else value
        raise ValueError("not arithmetic")

    try:
        return ev(ast.parse(expr.strip(), mode="eval"))
    except SyntaxError as exc:
        raise ValueError("not arithmetic") from exc


class Resolver:
    def __init__(self, doc: dict[str, Any]) -> None:
        self.doc = doc
        self.done: dict[str, Any] = {}
        self.active: list[str] = []

    def top(self, key: str) -> Any:
        if key in self.done:
            return self.done[key]
        if key not in self.doc:
            raise ConfigError(f"!ref <{key}>: no such top-level key")
        if key in self.active:
            raise ConfigError(f"circular !ref: {' -> '.join(self.active + [key])}")
        self.active.append(key)
        try:
            value = self.walk(self.doc[key], key)
        finally:
            self.active.pop()
        self.done[key] = value
        return value

    def lookup(self, name: str) -> Any:
        # <key>, <key[sub][sub]>, <key.sub>
        parts = re.findall(r"[^.\[\]]+", name.strip())
        if not parts:
            raise ConfigError(f"empty reference <{name}>")
        value = self.top(parts[0])
        for part in parts[1:]:
            if isinstance(value, YamlObject):
                value = value.kwargs
            if isinstance(value, Mapping) and part in value:
                value = value[part]
            elif isinstance(value, (list, tuple)) and part.lstrip("-").isdigit():
                value = value[int(part)]
            else:
                raise ConfigError(f"!ref <{name}>: {part!r} not found")
        return value

    def ref(self, ref: Ref, where: str) -> Any:
        expr = ref.expr.strip()
        whole = _REF.fullmatch(expr)
        if whole:
            value = self.lookup(whole.group(1))
            return _deepcopy_tree(value) if ref.copy else value
        pieces = _REF.split(expr)
        names = pieces[1::2]
        if not names:
            raise ConfigError(f"{where}: !ref {expr!r} names no <key>")
        values = [self.lookup(n) for n in names]
        text = "".join(p if i % 2 == 0 else str(values[i // 2]) for i, p in enumerate(pieces))
        if all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
            try:
                return _arith(text)
            except (ValueError, ZeroDivisionError, OverflowError):
                pass
        # string interpolation, e.g. !ref <exp_dir>/save
        return "".join(p if i % 2 == 0 else str(values[i // 2]) for i, p in enumerate(pieces))

    def walk(self, value: Any, where: str) -> Any:
        if isinstance(value, Ref):
            return self.ref(value, where)
        if isinstance(value, _Placeholder):
            raise ConfigError(f"{where}: !PLACEHOLDER was not overridden")
        if isinstance(value, YamlObject):
            value.kwargs = {k: self.walk(v, f"{where}.{k}") for k, v in value.kwargs.items()}
            value.args = [self.walk(v, f"{where}[{i}]") for i, v in enumerate(value.args)]
            if value.kind == "new" and value.target == "omegaconf.DictConfig":
                # only a container for its 'content' mapping
                content = value.kwargs.get("content", value.args[0] if value.args else {})
                if not isinstance(content, Mapping):
                    raise ConfigError(f"{where}: omegaconf.DictConfig without a content mapping")
                return dict(content)
            return value
        if isinstance(value, dict):
            return {k: self.walk(v, f"{where}.{k}") for k, v in value.items()}
        if isinstance(value, list):
            return [self.walk(v, f"{where}[{i}]") for i, v in enumerate(value)]
        if isinstance(value, tuple):
            return tuple(self.walk(v, f"{where}[{i}]") for i, v in enumerate(value))
        return value


def _deepcopy_tree(value: Any) -> Any:
    if isinstance(value, YamlObject):
        return YamlObject(value.kind, value.target, {k: _deepcopy_tree(v) for k, v in value.kwargs.items()},
                          [_deepcopy_tree(v) for v in value.args])
    if isinstance(value, dict):
        return {k: _deepcopy_tree(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_deepcopy_tree(v) for v in value]
    return value


def load_yaml(source: str | os.PathLike | typing.TextIO, overrides: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Parse a hyperpyyaml file into plain data with inert :class:`YamlObject` nodes.

    ``source`` is a path, an open text file or the YAML text itself (anything with a
    newline). ``overrides`` replaces top-level values before references are resolved,
    as the official loader's ``overrides`` does (e.g. ``qwen_pretrain_path``).
    ``!apply:`` entries are kept as nodes and never run.
    """
    if hasattr(source, "read"):
        text = source.read()
    elif isinstance(source, str) and "\n" in source:
        text = source
    else:
        text = Path(source).read_text(encoding="utf-8")
    try:
        doc = yaml.load(text, Loader=_Loader)  # noqa: S506 - _Loader is a SafeLoader
    except yaml.YAMLError as exc:
        raise ConfigError(f"cosyvoice2.yaml is not valid YAML: {exc}") from exc
    if not isinstance(doc, dict):
        raise ConfigError("cosyvoice2.yaml: the top level must be a mapping")
    for key, value in (overrides or {}).items():
        doc[key] = value
    resolver = Resolver(doc)
    return {key: resolver.top(key) for key in doc}
