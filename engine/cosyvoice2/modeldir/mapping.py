"""Typed configs to and from the inert nodes of ``cosyvoice2.yaml`` (:mod:`.hyperyaml`).

A node is mapped onto a config dataclass by field name, checking its target against the
config's ``OFFICIAL_TARGET``. An argument our inference does not know fails loudly
(:class:`ConfigError`), except the ones listed in :data:`TRAINING_ONLY` (losses, dropout,
training schedules) and :data:`UNUSED_AT_INFERENCE`, which are reported as ignored and
otherwise skipped. :func:`config_to_node` goes the other way, for writing a yaml.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Mapping
from typing import Any

from tts_gateway.engine.cosyvoice2.modeldir.hyperyaml import ConfigError, YamlObject


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


def field_hints(cls: type) -> dict[str, Any]:
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


def convert_value(value: Any, hint: Any, where: str, ignored: list[str]) -> Any:
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
            items = [convert_value(v, a, f"{where}[{i}]", ignored) for i, (v, a) in enumerate(zip(value, args, strict=True))]
        else:
            item_hint = args[0] if args else Any
            items = [convert_value(v, item_hint, f"{where}[{i}]", ignored) for i, v in enumerate(value)]
        return tuple(items) if (origin is tuple or hint is tuple) else items
    if origin is dict or hint is dict:
        if isinstance(value, YamlObject):
            raise ConfigError(f"{where}: expected a mapping, got !{value.kind}:{value.target}")
        if not isinstance(value, Mapping):
            raise ConfigError(f"{where}: expected a mapping, got {value!r}")
        args = typing.get_args(hint)
        item_hint = args[1] if len(args) == 2 else Any
        return {k: convert_value(v, item_hint, f"{where}.{k}", ignored) for k, v in value.items()}
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






def official_target(cls: type) -> str | None:
    target = getattr(cls, "OFFICIAL_TARGET", None)
    return target if isinstance(target, str) else None


def _yaml_fields(cls: type) -> list[dataclasses.Field]:
    """Dataclass fields that are constructor arguments in the yaml (metadata yaml=False opts out)."""
    return [f for f in dataclasses.fields(cls) if f.metadata.get("yaml", True) and f.init]


def config_from_node(cls: type, node: Any, where: str = "", ignored: list[str] | None = None) -> Any:
    """Build dataclass ``cls`` from a ``!new:``/``!name:`` node (or, for target-less configs, a mapping).

    Every argument must be a field of ``cls`` or listed in :data:`TRAINING_ONLY` or
    :data:`UNUSED_AT_INFERENCE` for the node's target; skipped arguments are appended to
    ``ignored`` as dotted paths.
    """
    ignored = [] if ignored is None else ignored
    where = where or cls.__name__
    target = official_target(cls)
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
    hints = field_hints(cls)
    known = {f.name: f for f in _yaml_fields(cls)}
    values: dict[str, Any] = {}
    for key, value in kwargs.items():
        path = f"{where}.{key}"
        if key in known:
            values[key] = convert_value(value, hints.get(key, Any), path, ignored)
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
        target = official_target(type(cfg))
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


def check_supported_tree(cfg: Any, where: str) -> None:
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
        check_supported_tree(getattr(cfg, f.name), f"{where}.{f.name}")
