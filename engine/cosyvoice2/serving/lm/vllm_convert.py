"""Converts the official ``llm.pt`` into a model directory vLLM loads (no vLLM import here).

vLLM serves token ids only with streaming input, so the directory describes the CosyVoice2
LM over its :class:`~engine.cosyvoice2.model.llm.UnifiedVocab`:

- ``model.embed_tokens``: one table, text rows, then ``llm_embedding`` (sos_eos, task_id),
  then ``speech_embedding``; so ``embed(unified id)`` is the row the official model uses;
- ``model.layers.*`` / ``model.norm``: the Qwen2 backbone as it is;
- ``speech_head``: ``llm_decoder`` (logits over the speech classes, with its bias);
- the backbone's unused ``lm_head`` is dropped.

``config.json`` is the backbone's Qwen2 config with ``vocab_size`` = the unified size and
``architectures = ["CosyVoice2ForVLLM"]`` (registered by the ``cosyvoice2`` vLLM plugin),
plus a ``cosyvoice2`` block the model reads its vocabulary layout from.

The directory is cached next to the model (``<model_dir>/vllm-lm``) and rebuilt when
``llm.pt`` or the converter changes.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from tts_gateway.engine.cosyvoice2.modeldir.configs import LLMConfig, UnifiedVocab
from tts_gateway.engine.cosyvoice2.modeldir.staging import staged_directory

ARCHITECTURE = "CosyVoice2ForVLLM"
CONVERTER_VERSION = 1
CACHE_DIR_NAME = "vllm-lm"
_SOURCE_FILE = "converted_from.json"


def unified_state_dict(state: dict[str, torch.Tensor], vocab: UnifiedVocab) -> dict[str, torch.Tensor]:
    """The official LLM state dict renamed and merged into the unified layout."""
    text = state["llm.model.model.embed_tokens.weight"]
    special = state["llm_embedding.weight"]
    speech = state["speech_embedding.weight"]
    if text.shape[0] != vocab.text_vocab_size or speech.shape[0] != vocab.num_speech_classes or special.shape[0] != 2:
        raise ValueError(
            f"llm.pt tables ({text.shape[0]} text, {special.shape[0]} special, {speech.shape[0]} speech rows) "
            f"do not match the config ({vocab.text_vocab_size}, 2, {vocab.num_speech_classes})"
        )
    out = {"model.embed_tokens.weight": torch.cat([text, special, speech]).contiguous()}
    backbone = "llm.model.model."
    for name, tensor in state.items():
        if name.startswith(backbone) and name != backbone + "embed_tokens.weight":
            out["model." + name[len(backbone) :]] = tensor.contiguous()
    out["speech_head.weight"] = state["llm_decoder.weight"].contiguous()
    out["speech_head.bias"] = state["llm_decoder.bias"].contiguous()
    return out


def vllm_config_json(config: LLMConfig) -> dict:
    vocab = config.vocab
    qwen = {k: v for k, v in config.qwen.items() if k not in ("torch_dtype", "dtype", "transformers_version")}
    qwen.update(
        architectures=[ARCHITECTURE],
        model_type="qwen2",
        vocab_size=vocab.size,
        tie_word_embeddings=False,
        # Speech ends at the eos class, handled per round; no text eos/bos applies.
        bos_token_id=None,
        eos_token_id=None,
        torch_dtype="float32",
        cosyvoice2={
            "text_vocab_size": vocab.text_vocab_size,
            "speech_token_size": vocab.speech_token_size,
            "speech_offset": vocab.speech_offset,
            "num_speech_classes": vocab.num_speech_classes,
        },
    )
    return qwen


def _fingerprint(llm_pt: Path) -> dict:
    stat = llm_pt.stat()
    return {"llm.pt": {"size": stat.st_size, "mtime_ns": stat.st_mtime_ns}, "converter": CONVERTER_VERSION}


def convert(model_dir: str | Path, config: LLMConfig, out_dir: str | Path | None = None) -> Path:
    """Write (or reuse) the vLLM directory of ``model_dir``'s LLM; returns its path.

    ``config``: the LLM's config as the model directory's yaml gives it.
    """
    from safetensors.torch import save_file

    model_dir = Path(model_dir)
    out = Path(out_dir) if out_dir is not None else model_dir / CACHE_DIR_NAME
    llm_pt = model_dir / "llm.pt"
    fingerprint = _fingerprint(llm_pt)
    marker = out / _SOURCE_FILE
    if marker.is_file() and json.loads(marker.read_text()) == fingerprint:
        return out
    state = torch.load(llm_pt, map_location="cpu", weights_only=True, mmap=True)
    tensors = unified_state_dict(state, config.vocab)
    with staged_directory(out) as staging:
        save_file(tensors, str(staging / "model.safetensors"), metadata={"format": "pt"})
        (staging / "config.json").write_text(json.dumps(vllm_config_json(config), indent=1))
        (staging / _SOURCE_FILE).write_text(json.dumps(fingerprint))
    return out
