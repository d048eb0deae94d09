"""Write an official-style ``cosyvoice2.yaml`` (what ``make_checkpoint`` puts in a directory).

The file has the released file's inference entries with the same tags and ``!ref`` links
(seeds, the fixed and streaming parameters, ``llm``, ``flow``, ``hift``, ``get_tokenizer``,
``allowed_special``, ``feat_extractor``); the GAN, dataset and training sections are left
out. Reading it back is :func:`tts_gateway.engine.cosyvoice2.modeldir.reading.load_model_configs`.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from tts_gateway.engine.cosyvoice2.modeldir.configs import FrontendConfig
from tts_gateway.engine.cosyvoice2.modeldir.hyperyaml import ConfigError, Ref, YamlObject, Resolver
from tts_gateway.engine.cosyvoice2.modeldir.mapping import config_to_node
from tts_gateway.engine.cosyvoice2.modeldir.reading import FEAT_EXTRACTOR_TARGET, QWEN_ENCODER_TARGET, TOKENIZER_TARGET


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
    resolver = Resolver({k: v for k, v in tree.items() if not isinstance(v, YamlObject)})
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
