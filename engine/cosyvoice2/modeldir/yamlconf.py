"""Read and write the model directory's ``cosyvoice2.yaml`` without hyperpyyaml.

The official file is hyperpyyaml: plain YAML plus tags that name Python objects
(``!new:pkg.Class`` builds an instance from the mapping under it, ``!name:pkg.func``
makes a partial, ``!apply:pkg.func`` calls at load time, ``!ref <key>`` points at
another top-level entry and may do arithmetic such as ``<chunk_size> * <token_mel_ratio>``).
Loading it the official way imports and constructs every object it names. Here the
tags become inert nodes (:class:`YamlObject`, :class:`Ref`): nothing named in the file
is imported. References are then resolved, and the ``llm``, ``flow`` and ``hift``
nodes are mapped onto our typed configs by field name, checking each node's target
against the config's ``OFFICIAL_TARGET``.

An argument our inference does not know fails loudly (:class:`ConfigError`), except
the ones listed in :data:`TRAINING_ONLY` (losses, dropout, training schedules) and
:data:`UNUSED_AT_INFERENCE`, which are reported in :attr:`ModelConfigs.ignored` and
otherwise skipped.

:func:`write_yaml` goes the other way and writes an official-style file (same keys,
tags and references as the released one, limited to what inference reads).
"""

from __future__ import annotations

import ast
import dataclasses
import json
import math
import operator
import os
import re
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

__all__ = [
    "ConfigError",
    "YamlObject",
    "Ref",
    "load_yaml",
    "config_from_node",
    "config_to_node",
    "ModelConfigs",
    "FrontendConfig",
    "load_model_configs",
    "dump_yaml",
    "write_yaml",
    "TRAINING_ONLY",
    "UNUSED_AT_INFERENCE",
]


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


class _Resolver:
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
    resolver = _Resolver(doc)
    return {key: resolver.top(key) for key in doc}


# ---------------------------------------------------------------------------
# Typed configs <-> nodes

# Constructor arguments that only matter for training. They are accepted and skipped
# when reading; when writing, the values here are emitted (the released model's) so
# that the official constructors, which require some of them, still work.
TRAINING_ONLY: dict[str, dict[str, Any]] = {
    "cosyvoice.llm.llm.Qwen2LM": {"length_normalized_loss": True, "lsm_weight": 0, "mix_ratio": [5, 15]},
    "cosyvoice.flow.flow.CausalMaskedDiffWithXvec": {"only_mask_loss": True},
    "cosyvoice.transformer.upsample_encoder.UpsampleConformerEncoder": {
        "dropout_rate": 0.1,
        "positional_dropout_rate": 0.1,
        "attention_dropout_rate": 0.1,
    },
    "cosyvoice.flow.flow_matching.CausalConditionalCFM": {},
    # inside CausalConditionalCFM's cfm_params (an omegaconf.DictConfig)
    "cfm_params": {"training_cfg_rate": 0.2, "reg_loss_type": "l1"},
    "cosyvoice.flow.decoder.CausalConditionalDecoder": {"dropout": 0.0},
    "cosyvoice.hifigan.generator.HiFTGenerator": {},
    "cosyvoice.hifigan.f0_predictor.ConvRNNF0Predictor": {},
}

# Constructor arguments that official CosyVoice2 code accepts but never reads at
# inference (training switches, or settings the inference path hard-codes). Skipped
# when reading and never written.
UNUSED_AT_INFERENCE: dict[str, frozenset[str]] = {
    "cosyvoice.flow.flow.CausalMaskedDiffWithXvec": frozenset({"decoder_conf", "mel_feat_conf"}),
    "cosyvoice.transformer.upsample_encoder.UpsampleConformerEncoder": frozenset(
        {"use_dynamic_chunk", "use_dynamic_left_chunk", "gradient_checkpointing"}),
}

# Nested mappings that the official constructors read as attribute containers.
_DICTCONFIG_FIELDS = {"cfm_params"}


def _hints(cls: type) -> dict[str, Any]:
    try:
        return typing.get_type_hints(cls)
    except Exception:  # pragma: no cover - unresolvable annotations: fall back to raw
        return {f.name: f.type for f in dataclasses.fields(cls)}


def _unwrap_optional(hint: Any) -> Any:
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return hint


def _convert(value: Any, hint: Any, where: str, ignored: list[str]) -> Any:
    hint = _unwrap_optional(hint)
    if value is None:
        return None
    if isinstance(hint, type) and dataclasses.is_dataclass(hint):
        return config_from_node(hint, value, where, ignored)
    origin = typing.get_origin(hint)
    if origin in (list, tuple) or hint in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{where}: expected a list, got {value!r}")
        args = typing.get_args(hint)
        if origin is tuple and args and args[-1] is not Ellipsis and len(args) == len(value):
            items = [_convert(v, a, f"{where}[{i}]", ignored) for i, (v, a) in enumerate(zip(value, args, strict=True))]
        else:
            item_hint = args[0] if args else Any
            items = [_convert(v, item_hint, f"{where}[{i}]", ignored) for i, v in enumerate(value)]
        return tuple(items) if (origin is tuple or hint is tuple) else items
    if origin is dict or hint is dict:
        if isinstance(value, YamlObject):
            raise ConfigError(f"{where}: expected a mapping, got !{value.kind}:{value.target}")
        if not isinstance(value, Mapping):
            raise ConfigError(f"{where}: expected a mapping, got {value!r}")
        args = typing.get_args(hint)
        item_hint = args[1] if len(args) == 2 else Any
        return {k: _convert(v, item_hint, f"{where}.{k}", ignored) for k, v in value.items()}
    if isinstance(value, YamlObject):
        raise ConfigError(f"{where}: unexpected !{value.kind}:{value.target}")
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if hint is int and isinstance(value, float):
        if not value.is_integer():
            raise ConfigError(f"{where}: expected an integer, got {value!r}")
        return int(value)
    if hint is bool and not isinstance(value, bool):
        raise ConfigError(f"{where}: expected true/false, got {value!r}")
    if hint in (int, float) and (isinstance(value, bool) or not isinstance(value, (int, float))):
        raise ConfigError(f"{where}: expected a number, got {value!r}")
    if hint is str and not isinstance(value, str):
        raise ConfigError(f"{where}: expected a string, got {value!r}")
    return value


# Official targets of configs that do not carry an OFFICIAL_TARGET class attribute.
_KNOWN_TARGETS = {
    "engine.cosyvoice2.model.llm.LLMConfig": "cosyvoice.llm.llm.Qwen2LM",
    "engine.cosyvoice2.serving.lm.sampling.SamplingConfig": "cosyvoice.utils.common.ras_sampling",
}
# Fields that are not constructor arguments in the yaml.
_NOT_YAML = {
    "engine.cosyvoice2.model.llm.LLMConfig": {"qwen"},
}
QWEN_ENCODER_TARGET = "cosyvoice.llm.llm.Qwen2Encoder"


def _qualname(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def _target_of(cls: type) -> str | None:
    target = cls.__dict__.get("OFFICIAL_TARGET") or getattr(cls, "OFFICIAL_TARGET", None)
    return target if isinstance(target, str) else _KNOWN_TARGETS.get(_qualname(cls))


def _yaml_fields(cls: type) -> list[dataclasses.Field]:
    """Dataclass fields that are constructor arguments in the yaml (metadata yaml=False opts out)."""
    skip = _NOT_YAML.get(_qualname(cls), set())
    return [f for f in dataclasses.fields(cls) if f.metadata.get("yaml", True) and f.init and f.name not in skip]


def config_from_node(cls: type, node: Any, where: str = "", ignored: list[str] | None = None) -> Any:
    """Build dataclass ``cls`` from a ``!new:``/``!name:`` node (or, for target-less configs, a mapping).

    Every argument must be a field of ``cls`` or listed in :data:`TRAINING_ONLY` or
    :data:`UNUSED_AT_INFERENCE` for the node's target; skipped arguments are appended to
    ``ignored`` as dotted paths.
    """
    ignored = [] if ignored is None else ignored
    where = where or cls.__name__
    target = _target_of(cls)
    if isinstance(node, YamlObject):
        if target is None:
            raise ConfigError(f"{where}: expected a plain mapping, got !{node.kind}:{node.target}")
        if node.target != target:
            raise ConfigError(f"{where}: this engine supports {target}, the model asks for {node.target}")
        if node.kind == "apply":
            raise ConfigError(f"{where}: !apply:{node.target} cannot be a model component")
        if node.args:
            raise ConfigError(f"{where}: positional arguments for {node.target} are not supported")
        kwargs = node.kwargs
        training = {*TRAINING_ONLY.get(node.target, {}), *UNUSED_AT_INFERENCE.get(node.target, ())}
    elif isinstance(node, Mapping):
        if target is not None:
            raise ConfigError(f"{where}: expected !new:{target}, got a plain mapping")
        kwargs, training = node, TRAINING_ONLY.get(where.rsplit(".", 1)[-1], {})
    else:
        raise ConfigError(f"{where}: expected a mapping for {cls.__name__}, got {node!r}")
    hints = _hints(cls)
    known = {f.name: f for f in _yaml_fields(cls)}
    values: dict[str, Any] = {}
    for key, value in kwargs.items():
        path = f"{where}.{key}"
        if key in known:
            values[key] = _convert(value, hints.get(key, Any), path, ignored)
        elif key in training:
            ignored.append(path)
        else:
            raise ConfigError(
                f"{path}: unsupported argument {key}={value!r} for {target or cls.__name__} "
                "(this engine does not implement it; refusing to guess)"
            )
    for name, f in known.items():
        if name not in values and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise ConfigError(f"{where}: required argument {name!r} is missing")
    try:
        return cls(**values)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{where}: {exc}") from exc


def _is_function_target(target: str) -> bool:
    return target.rsplit(".", 1)[-1][:1].islower()


def config_to_node(cfg: Any, field_name: str | None = None) -> Any:
    """Inverse of :func:`config_from_node`: a dataclass -> a YamlObject (or mapping) tree."""
    if dataclasses.is_dataclass(cfg) and not isinstance(cfg, type):
        target = _target_of(type(cfg))
        kwargs: dict[str, Any] = {}
        for f in _yaml_fields(type(cfg)):
            kwargs[f.name] = config_to_node(getattr(cfg, f.name), f.name)
        training = TRAINING_ONLY.get(target if target else (field_name or ""), {})
        for key, value in training.items():
            kwargs.setdefault(key, value)
        if target is None:
            if field_name in _DICTCONFIG_FIELDS:
                return YamlObject("new", "omegaconf.DictConfig", {"content": kwargs})
            return kwargs
        return YamlObject("name" if _is_function_target(target) else "new", target, kwargs)
    if isinstance(cfg, Mapping):
        node = {k: config_to_node(v) for k, v in cfg.items()}
        if field_name in _DICTCONFIG_FIELDS:
            training = TRAINING_ONLY.get(field_name, {})
            for key, value in training.items():
                node.setdefault(key, value)
            return YamlObject("new", "omegaconf.DictConfig", {"content": node})
        return node
    if isinstance(cfg, (list, tuple)):
        return [config_to_node(v) for v in cfg]
    return cfg


def _check_supported(cfg: Any, where: str) -> None:
    """Call ``check_supported()`` on every nested config that has one."""
    if not (dataclasses.is_dataclass(cfg) and not isinstance(cfg, type)):
        return
    check = getattr(cfg, "check_supported", None)
    if callable(check):
        try:
            check()
        except (ValueError, NotImplementedError) as exc:
            raise ConfigError(f"{where}: {exc}") from exc
    for f in dataclasses.fields(cfg):
        _check_supported(getattr(cfg, f.name), f"{where}.{f.name}")


# ---------------------------------------------------------------------------
# YAML text output


def _scalar(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "True" if value else "False"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isnan(value):
            return ".nan"
        if math.isinf(value):
            return ".inf" if value > 0 else "-.inf"
        text = repr(value)
        return text
    if isinstance(value, str):
        return "'" + value.replace("'", "''") + "'"
    raise ConfigError(f"cannot write {value!r} ({type(value).__name__}) to yaml")


def _flow(value: Any) -> str:
    if isinstance(value, Ref):
        return f"!{'copy' if value.copy else 'ref'} {value.expr}"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_flow(v) for v in value) + "]"
    if isinstance(value, Mapping) or isinstance(value, YamlObject):
        raise ConfigError("nested mappings inside a flow list are not written")
    return _scalar(value)


def _block(key: str, value: Any, indent: int, lines: list[str]) -> None:
    pad = " " * indent
    if isinstance(value, YamlObject):
        if value.args and value.kwargs:
            raise ConfigError(f"{key}: both positional and keyword arguments")
        head = f"{pad}{key}: !{value.kind}:{value.target}"
        if value.args:
            lines.append(f"{head} {_flow(list(value.args))}")
            return
        lines.append(head)
        for k, v in value.kwargs.items():
            _block(k, v, indent + 4, lines)
        return
    if isinstance(value, Mapping):
        lines.append(f"{pad}{key}:")
        for k, v in value.items():
            _block(k, v, indent + 4, lines)
        return
    if isinstance(value, (list, tuple)) and any(isinstance(v, (Mapping, YamlObject)) for v in value):
        raise ConfigError(f"{key}: lists of objects are not written")
    lines.append(f"{pad}{key}: {_flow(value)}")


def dump_yaml(doc: Mapping[str, Any], comments: Mapping[str, str] | None = None) -> str:
    """Serialise a tree of plain values, :class:`YamlObject` and :class:`Ref` to hyperpyyaml text.

    ``comments`` maps a top-level key to a comment line written above it.
    """
    lines: list[str] = []
    for key, value in doc.items():
        note = (comments or {}).get(key)
        if note is not None:
            if lines:
                lines.append("")
            lines.extend(f"# {line}" if line else "#" for line in note.splitlines())
        elif isinstance(value, YamlObject) and value.kwargs and lines and lines[-1]:
            lines.append("")
        _block(key, value, 0, lines)
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------
# The model directory's configuration


@dataclass
class FrontendConfig:
    """What the frontend reads from the yaml (``get_tokenizer``, ``allowed_special``, ``feat_extractor``)."""

    tokenizer_path: str = ""
    skip_special_tokens: bool = True
    allowed_special: str = "all"
    # matcha.utils.audio.mel_spectrogram arguments (the prompt mel)
    n_fft: int = 1920
    num_mels: int = 80
    sampling_rate: int = 24000
    hop_size: int = 480
    win_size: int = 1920
    fmin: float = 0
    fmax: float | None = 8000
    center: bool = False


TOKENIZER_TARGET = "cosyvoice.tokenizer.tokenizer.get_qwen_tokenizer"
FEAT_EXTRACTOR_TARGET = "matcha.utils.audio.mel_spectrogram"

# Top-level scalars of the released file, in order, with where their value lives.
_TOP_LEVEL = (
    "sample_rate",
    "llm_input_size",
    "llm_output_size",
    "spk_embed_dim",
    "qwen_pretrain_path",
    "token_frame_rate",
    "token_mel_ratio",
    "chunk_size",
    "num_decoding_left_chunks",
)


@dataclass
class ModelConfigs:
    """Everything the engine needs from ``cosyvoice2.yaml`` (+ ``CosyVoice-BlankEN/config.json``)."""

    llm: Any
    flow: Any
    hift: Any
    frontend: FrontendConfig
    sample_rate: int
    token_frame_rate: int
    token_mel_ratio: int
    chunk_size: int
    num_decoding_left_chunks: int
    ignored: list[str] = field(default_factory=list)  # training-only arguments that were skipped
    unused: list[str] = field(default_factory=list)  # top-level entries inference does not read


def _frontend_from(doc: Mapping[str, Any], ignored: list[str]) -> FrontendConfig:
    fe = FrontendConfig()
    tok = doc.get("get_tokenizer")
    if tok is not None:
        if not isinstance(tok, YamlObject) or tok.target != TOKENIZER_TARGET:
            got = f"!{tok.kind}:{tok.target}" if isinstance(tok, YamlObject) else repr(tok)
            raise ConfigError(f"get_tokenizer: this engine supports {TOKENIZER_TARGET} only, got {got}")
        for key, value in tok.kwargs.items():
            if key == "token_path":
                fe.tokenizer_path = str(value)
            elif key == "skip_special_tokens":
                fe.skip_special_tokens = bool(value)
            else:
                raise ConfigError(f"get_tokenizer.{key}: unsupported argument")
    if "allowed_special" in doc:
        fe.allowed_special = str(doc["allowed_special"])
    feat = doc.get("feat_extractor")
    if feat is not None:
        if not isinstance(feat, YamlObject) or feat.target != FEAT_EXTRACTOR_TARGET:
            raise ConfigError(f"feat_extractor: this engine supports {FEAT_EXTRACTOR_TARGET} only")
        hints = _hints(FrontendConfig)
        for key, value in feat.kwargs.items():
            if key not in ("n_fft", "num_mels", "sampling_rate", "hop_size", "win_size", "fmin", "fmax", "center"):
                raise ConfigError(f"feat_extractor.{key}: unsupported argument")
            setattr(fe, key, _convert(value, hints[key], f"feat_extractor.{key}", ignored))
    return fe


def _int(doc: Mapping[str, Any], key: str, default: int) -> int:
    value = doc.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{key}: expected an integer, got {value!r}")
    return value


def load_model_configs(
    source: str | os.PathLike,
    qwen_config: str | os.PathLike | Mapping[str, Any] | None = None,
) -> ModelConfigs:
    """Read a model directory (or a yaml file) into typed configs.

    ``source`` is the model directory (``cosyvoice2.yaml`` inside it, and the LLM
    backbone config from ``CosyVoice-BlankEN/config.json``) or a yaml path. ``qwen_config``
    overrides where the backbone config comes from (a path or the parsed dict); without
    one and without a directory, the LLM backbone is left to :class:`LLMConfig`'s defaults.
    """
    from engine.cosyvoice2.model.flow import FlowConfig
    from engine.cosyvoice2.model.hift import HiFTConfig
    from engine.cosyvoice2.model.llm import LLMConfig

    path = Path(source)
    model_dir = path if path.is_dir() else None
    yaml_path = path / "cosyvoice2.yaml" if model_dir else path
    if not yaml_path.is_file():
        raise ConfigError(f"{yaml_path}: not found (a CosyVoice2 model directory has cosyvoice2.yaml)")
    overrides = {"qwen_pretrain_path": str(model_dir / "CosyVoice-BlankEN")} if model_dir else None
    doc = load_yaml(yaml_path, overrides=overrides)
    for key in ("llm", "flow", "hift"):
        if key not in doc:
            raise ConfigError(f"{yaml_path}: no '{key}' entry")
    ignored: list[str] = []
    if qwen_config is None and model_dir is not None:
        qwen_config = model_dir / "CosyVoice-BlankEN" / "config.json"
    if isinstance(qwen_config, (str, os.PathLike)):
        try:
            qwen_config = json.loads(Path(qwen_config).read_text(encoding="utf-8"))
        except FileNotFoundError as exc:
            raise ConfigError(f"{qwen_config}: the Qwen2 backbone config is missing") from exc
    llm = _llm_from(LLMConfig, doc["llm"], qwen_config, ignored)
    flow = config_from_node(FlowConfig, doc["flow"], "flow", ignored)
    hift = config_from_node(HiFTConfig, doc["hift"], "hift", ignored)
    for name, cfg in (("llm", llm), ("flow", flow), ("hift", hift)):
        _check_supported(cfg, name)
    frontend = _frontend_from(doc, ignored)
    configs = ModelConfigs(
        llm=llm,
        flow=flow,
        hift=hift,
        frontend=frontend,
        sample_rate=_int(doc, "sample_rate", hift.sampling_rate),
        token_frame_rate=_int(doc, "token_frame_rate", flow.input_frame_rate),
        token_mel_ratio=_int(doc, "token_mel_ratio", flow.token_mel_ratio),
        chunk_size=_int(doc, "chunk_size", flow.encoder.static_chunk_size),
        num_decoding_left_chunks=_int(doc, "num_decoding_left_chunks",
                                      flow.decoder.estimator.num_decoding_left_chunks),
        ignored=ignored,
        unused=[k for k in doc if k not in (*_TOP_LEVEL, "llm", "flow", "hift", "get_tokenizer",
                                             "allowed_special", "feat_extractor")],
    )
    _check_consistency(configs)
    return configs


def _check_consistency(c: ModelConfigs) -> None:
    """The engine's fixed assumptions about how the three stages fit together."""
    problems = []
    if c.hift.sampling_rate != c.sample_rate:
        problems.append(f"hift.sampling_rate {c.hift.sampling_rate} != sample_rate {c.sample_rate}")
    fe = c.frontend
    if fe.sampling_rate != c.hift.sampling_rate:
        problems.append(f"feat_extractor.sampling_rate {fe.sampling_rate} != hift.sampling_rate {c.hift.sampling_rate}")
    if fe.num_mels != c.flow.output_size or c.hift.in_channels != c.flow.output_size:
        problems.append(f"mel sizes differ: feat_extractor {fe.num_mels}, flow {c.flow.output_size}, "
                        f"hift {c.hift.in_channels}")
    if fe.hop_size * c.flow.input_frame_rate * c.flow.token_mel_ratio != fe.sampling_rate:
        problems.append(f"mel hop {fe.hop_size} at {fe.sampling_rate} Hz is not {c.flow.token_mel_ratio} frames "
                        f"per {c.flow.input_frame_rate} Hz token")
    qwen = getattr(c.llm, "qwen", None)
    if isinstance(qwen, Mapping) and "hidden_size" in qwen:
        if not qwen["hidden_size"] == c.llm.llm_input_size == c.llm.llm_output_size:
            problems.append(f"llm_input_size {c.llm.llm_input_size} / llm_output_size {c.llm.llm_output_size} "
                            f"!= the Qwen2 backbone's hidden_size {qwen['hidden_size']}")
    if problems:
        raise ConfigError("inconsistent cosyvoice2.yaml: " + "; ".join(problems))


def _llm_from(cls: type, node: Any, qwen: Mapping[str, Any] | None, ignored: list[str]) -> Any:
    """The ``llm`` node: Qwen2LM kwargs + the ``Qwen2Encoder`` backbone (whose config is config.json)."""
    if not isinstance(node, YamlObject):
        raise ConfigError(f"llm: expected !new:{_target_of(cls)}, got {node!r}")
    kwargs = dict(node.kwargs)
    encoder = kwargs.pop("llm", None)
    if not isinstance(encoder, YamlObject) or encoder.target != QWEN_ENCODER_TARGET:
        got = f"!{encoder.kind}:{encoder.target}" if isinstance(encoder, YamlObject) else repr(encoder)
        raise ConfigError(f"llm.llm: this engine supports the {QWEN_ENCODER_TARGET} backbone only, got {got}")
    for key in encoder.kwargs:
        if key != "pretrain_path":
            raise ConfigError(f"llm.llm.{key}: unsupported argument for {QWEN_ENCODER_TARGET}")
    cfg = config_from_node(cls, YamlObject(node.kind, node.target, kwargs, list(node.args)), "llm", ignored)
    if qwen is not None:
        cfg = dataclasses.replace(cfg, qwen=dict(qwen))
    return cfg


def _llm_to_node(cfg: Any) -> YamlObject:
    node = config_to_node(cfg)
    kwargs: dict[str, Any] = {}
    for key, value in node.kwargs.items():
        if key == "sampling":
            kwargs["llm"] = YamlObject("new", QWEN_ENCODER_TARGET, {"pretrain_path": ""})
        kwargs[key] = value
    kwargs.setdefault("llm", YamlObject("new", QWEN_ENCODER_TARGET, {"pretrain_path": ""}))
    node.kwargs = kwargs
    return node


# (path inside the tree, reference written there when the value equals what it resolves to)
_LINKS = (
    (("llm", "llm_input_size"), "<llm_input_size>"),
    (("llm", "llm_output_size"), "<llm_output_size>"),
    (("llm", "llm", "pretrain_path"), "<qwen_pretrain_path>"),
    (("flow", "spk_embed_dim"), "<spk_embed_dim>"),
    (("flow", "input_frame_rate"), "<token_frame_rate>"),
    (("flow", "token_mel_ratio"), "<token_mel_ratio>"),
    (("flow", "encoder", "static_chunk_size"), "<chunk_size>"),
    (("flow", "decoder", "estimator", "static_chunk_size"), "<chunk_size> * <token_mel_ratio>"),
    (("flow", "decoder", "estimator", "num_decoding_left_chunks"), "<num_decoding_left_chunks>"),
    (("hift", "sampling_rate"), "<sample_rate>"),
    (("get_tokenizer", "token_path"), "<qwen_pretrain_path>"),
    (("feat_extractor", "sampling_rate"), "<sample_rate>"),
)


def _container(value: Any) -> dict[str, Any] | None:
    if isinstance(value, YamlObject):
        return value.kwargs
    return value if isinstance(value, dict) else None


def _link(tree: dict[str, Any], path: tuple[str, ...], expr: str) -> None:
    parent: Any = tree
    for key in path[:-1]:
        box = _container(parent)
        if box is None or key not in box:
            return
        parent = box[key]
    box = _container(parent)
    if box is None or path[-1] not in box:
        return
    resolver = _Resolver({k: v for k, v in tree.items() if not isinstance(v, YamlObject)})
    if resolver.ref(Ref(expr), ".".join(path)) == box[path[-1]]:
        box[path[-1]] = Ref(expr)


def official_tree(llm_cfg: Any, flow_cfg: Any, hift_cfg: Any, frontend: FrontendConfig | None = None,
                  qwen_pretrain_path: str = "", seed: int = 1986) -> dict[str, Any]:
    """The released cosyvoice2.yaml's inference entries as a node tree (see :func:`write_yaml`)."""
    fe = frontend or FrontendConfig(sampling_rate=hift_cfg.sampling_rate, num_mels=flow_cfg.output_size)
    tree: dict[str, Any] = {
        "__set_seed1": YamlObject("apply", "random.seed", args=[seed]),
        "__set_seed2": YamlObject("apply", "numpy.random.seed", args=[seed]),
        "__set_seed3": YamlObject("apply", "torch.manual_seed", args=[seed]),
        "__set_seed4": YamlObject("apply", "torch.cuda.manual_seed_all", args=[seed]),
        "sample_rate": hift_cfg.sampling_rate,
        "llm_input_size": llm_cfg.llm_input_size,
        "llm_output_size": llm_cfg.llm_output_size,
        "spk_embed_dim": flow_cfg.spk_embed_dim,
        "qwen_pretrain_path": qwen_pretrain_path,
        "token_frame_rate": flow_cfg.input_frame_rate,
        "token_mel_ratio": flow_cfg.token_mel_ratio,
        "chunk_size": flow_cfg.encoder.static_chunk_size,
        "num_decoding_left_chunks": flow_cfg.decoder.estimator.num_decoding_left_chunks,
        "llm": _llm_to_node(llm_cfg),
        "flow": config_to_node(flow_cfg),
        "hift": config_to_node(hift_cfg),
        "get_tokenizer": YamlObject("name", TOKENIZER_TARGET, {
            "token_path": qwen_pretrain_path, "skip_special_tokens": fe.skip_special_tokens}),
        "allowed_special": fe.allowed_special,
        "feat_extractor": YamlObject("name", FEAT_EXTRACTOR_TARGET, {
            "n_fft": fe.n_fft, "num_mels": fe.num_mels, "sampling_rate": fe.sampling_rate, "hop_size": fe.hop_size,
            "win_size": fe.win_size, "fmin": fe.fmin, "fmax": fe.fmax, "center": fe.center}),
    }
    for path, expr in _LINKS:
        _link(tree, path, expr)
    return tree


_COMMENTS = {
    "__set_seed1": "set random seed, so that you may reproduce your result.",
    "sample_rate": "fixed params",
    "chunk_size": "stream related params",
    "llm": "model params",
    "get_tokenizer": "processor functions",
}


def write_yaml(path: str | os.PathLike, llm_cfg: Any, flow_cfg: Any, hift_cfg: Any, *,
               frontend: FrontendConfig | None = None, qwen_pretrain_path: str = "", seed: int = 1986,
               header: str | None = None) -> Path:
    """Write an official-style ``cosyvoice2.yaml`` for these configs.

    The file has the released file's inference entries with the same tags and ``!ref``
    links (seeds, the fixed and streaming parameters, ``llm``, ``flow``, ``hift``,
    ``get_tokenizer``, ``allowed_special``, ``feat_extractor``); the GAN, dataset and
    training sections are left out. Training-only constructor arguments are written
    with the released values (:data:`TRAINING_ONLY`) when a config has no field for them.
    """
    tree = official_tree(llm_cfg, flow_cfg, hift_cfg, frontend, qwen_pretrain_path, seed)
    text = dump_yaml(tree, _COMMENTS)
    if header:
        text = "".join(f"# {line}\n" if line else "#\n" for line in header.splitlines()) + "\n" + text
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, out)
    return out
