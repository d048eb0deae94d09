"""CosyVoice2 LLM stage: text tokens -> speech tokens, offline and with streaming text.

The model is a Qwen2.5-0.5B backbone run on input embeddings, with three input tables and
its own output head:

- text tokens use the backbone's ``embed_tokens``;
- two special inputs, ``sos_eos`` (start of sequence) and ``task_id`` (start of speech),
  use ``llm_embedding``;
- speech classes use ``speech_embedding``: the ``speech_token_size`` (6561) speech tokens,
  then eos (6561), an unused class (6562) and the *fill* class (6563);
- ``llm_decoder`` maps the last hidden state to logits over those 6564 speech classes
  (the backbone's own ``lm_head`` is never used; it exists so the checkpoint loads).

Parameter names equal the official ``cosyvoice.llm.llm.Qwen2LM``, so the ``llm.pt`` of a
CosyVoice2 model directory loads with ``load_state_dict(strict=True)`` as it is.

Every sequence the model sees is a list of :class:`~tts_gateway.engine.cosyvoice2.modeldir.configs.UnifiedVocab`
ids. Decoding (rounds, sampling, the KV cache) is the serving layer's: engine/cosyvoice2/serving/lm/.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers import DynamicCache, Qwen2Config, Qwen2ForCausalLM, Qwen2Model

from tts_gateway.engine.cosyvoice2.modeldir.configs import LLMConfig

OFFICIAL_TARGET = LLMConfig.OFFICIAL_TARGET


# Config keys that describe how a checkpoint was stored, not the model's shapes.
_STORAGE_KEYS = ("torch_dtype", "dtype", "transformers_version")


def qwen2_config(config: LLMConfig) -> Qwen2Config:
    """The backbone's transformers config (``CosyVoice-BlankEN/config.json``)."""
    return Qwen2Config(**{k: v for k, v in config.qwen.items() if k not in _STORAGE_KEYS})


class QwenBackbone(nn.Module):
    """Holds the HF Qwen2 so that parameter names read ``llm.model.model...`` as in llm.pt."""

    def __init__(self, config: Qwen2Config) -> None:
        super().__init__()
        self.model = Qwen2ForCausalLM(config)


# transformers 5 renamed Qwen2Model.forward's ``past_key_values`` to ``cache``.
_CACHE_KWARG = "cache" if "cache" in inspect.signature(Qwen2Model.forward).parameters else "past_key_values"


class CosyVoice2LM(nn.Module):
    """The CosyVoice2 LLM (inference only), parameter for parameter the official Qwen2LM."""

    def __init__(self, config: LLMConfig) -> None:
        super().__init__()
        qwen = qwen2_config(config)
        if not config.llm_input_size == config.llm_output_size == qwen.hidden_size:
            raise ValueError("llm_input_size and llm_output_size must equal the backbone's hidden_size")
        self.config = config
        self.vocab = config.vocab
        self.llm_embedding = nn.Embedding(2, config.llm_input_size)
        self.llm = QwenBackbone(qwen)
        self.llm_decoder = nn.Linear(config.llm_output_size, self.vocab.num_speech_classes)
        self.speech_embedding = nn.Embedding(self.vocab.num_speech_classes, config.llm_input_size)

    @property
    def text_embedding(self) -> nn.Embedding:
        return self.llm.model.model.embed_tokens

    def embed(self, unified_ids: torch.Tensor) -> torch.Tensor:
        """Input embeddings of unified ids (any shape) -> (*shape, hidden)."""
        vocab = self.vocab
        if unified_ids.numel() and (int(unified_ids.min()) < 0 or int(unified_ids.max()) >= vocab.size):
            raise IndexError(f"unified ids must lie in [0, {vocab.size})")
        # Look every id up in all three tables (clamped into range) and keep the right row:
        # branch-free, and the kept rows are the tables' exact values.
        text = self.text_embedding(unified_ids.clamp(max=vocab.text_vocab_size - 1))
        special = self.llm_embedding((unified_ids - vocab.sos_eos).clamp(0, 1))
        speech = self.speech_embedding((unified_ids - vocab.speech_offset).clamp(min=0))
        is_text = (unified_ids < vocab.sos_eos).unsqueeze(-1)
        is_speech = (unified_ids >= vocab.speech_offset).unsqueeze(-1)
        return torch.where(is_text, text, torch.where(is_speech, speech, special))

    def hidden(self, inputs_embeds: torch.Tensor, cache: DynamicCache | None = None) -> torch.Tensor:
        """Causal pass over (batch, time, hidden) embeddings that follow ``cache`` -> last hidden states.

        ``cache`` (if given) is extended in place with the new positions.
        """
        kwargs = {_CACHE_KWARG: cache, "use_cache": cache is not None}
        return self.llm.model.model(inputs_embeds=inputs_embeds, **kwargs).last_hidden_state

    def forward(self, inputs_embeds: torch.Tensor, cache: DynamicCache | None = None) -> torch.Tensor:
        """Speech-class logits of every position (see :meth:`hidden`)."""
        return self.llm_decoder(self.hidden(inputs_embeds, cache))

    @classmethod
    def from_state_dict(
        cls,
        config: LLMConfig,
        state_dict: Mapping[str, torch.Tensor],
        *,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
    ) -> CosyVoice2LM:
        """Build without a random init (which takes seconds at full size) and load strictly."""
        with torch.device("meta"):
            model = cls(config)
        model.to(dtype).to_empty(device=device)
        qwen = model.llm.model
        # Buffers outside the state dict (the rotary frequencies) are computed at init: redo that.
        with torch.device(device):
            qwen.model.rotary_emb = type(qwen.model.rotary_emb)(config=qwen.config)
        if qwen.config.tie_word_embeddings:
            # to_empty gave each name its own tensor; the checkpoint must hold one matrix twice.
            embed_key, head_key = "llm.model.model.embed_tokens.weight", "llm.model.lm_head.weight"
            if embed_key in state_dict and head_key in state_dict:
                if not torch.equal(state_dict[embed_key], state_dict[head_key]):
                    raise ValueError(f"tie_word_embeddings is set but {head_key} differs from {embed_key}")
            qwen.lm_head.weight = qwen.model.embed_tokens.weight
        model.load_state_dict(state_dict, strict=True)
        return model.eval()


def load_llm(
    model_dir: str | Path, *, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32, **yaml_kwargs: Any
) -> CosyVoice2LM:
    """The LLM of an official CosyVoice2 model directory (``llm.pt`` + ``CosyVoice-BlankEN/config.json``)."""
    config = LLMConfig.full(model_dir, **yaml_kwargs)
    state = torch.load(Path(model_dir) / "llm.pt", map_location="cpu", weights_only=True, mmap=True)
    return CosyVoice2LM.from_state_dict(config, state, device=device, dtype=dtype)
