"""A model directory's whole configuration: ``cosyvoice2.yaml`` (+ the Qwen2 backbone's
``CosyVoice-BlankEN/config.json``) read into typed configs, and checked for how the three
stages fit together."""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tts_gateway.engine.cosyvoice2.modeldir.configs import FlowConfig, FrontendConfig, HiFTConfig, LLMConfig
from tts_gateway.engine.cosyvoice2.modeldir.hyperyaml import ConfigError, YamlObject, load_yaml
from tts_gateway.engine.cosyvoice2.modeldir.mapping import check_supported_tree, convert_value, field_hints, official_target, config_from_node


QWEN_ENCODER_TARGET = "cosyvoice.llm.llm.Qwen2Encoder"


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
        hints = field_hints(FrontendConfig)
        for key, value in feat.kwargs.items():
            if key not in ("n_fft", "num_mels", "sampling_rate", "hop_size", "win_size", "fmin", "fmax", "center"):
                raise ConfigError(f"feat_extractor.{key}: unsupported argument")
            setattr(fe, key, convert_value(value, hints[key], f"feat_extractor.{key}", ignored))
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
        check_supported_tree(cfg, name)
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
        raise ConfigError(f"llm: expected !new:{official_target(cls)}, got {node!r}")
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
