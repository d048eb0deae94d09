"""The CosyVoice2 LM as a vLLM model, and its per-request logits processor (imports vLLM).

Registered with vLLM in each of its processes by :mod:`tts_gateway.engine.cosyvoice2.serving.lm.vllm_plugin`;
loads a directory written by :mod:`tts_gateway.engine.cosyvoice2.serving.lm.vllm_convert`.

:class:`CosyVoice2ForVLLM` is vLLM's own Qwen2 backbone (so it gets vLLM's attention
kernels, prefix caching, torch.compile and CUDA graphs) over one unified vocabulary: the
embedding table holds text, special and speech rows, and the head (``speech_head``, the
official ``llm_decoder``) scores the speech classes only. Logits are returned over the
whole unified vocabulary with every non-speech id at -inf, because vLLM samples token ids
of the vocabulary it was given.

:class:`CosyVoice2LogitsProcessor` applies each request's :class:`RoundRule` inside vLLM's
sampler: which special classes the round may take, and repetition-aware sampling as the
exact distribution of the official two-draw procedure
(:func:`tts_gateway.engine.cosyvoice2.serving.lm.sampling.ras_log_probs`).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn
from vllm.config import VllmConfig
from vllm.model_executor.models.qwen2 import Qwen2Model
from vllm.model_executor.models.utils import AutoWeightsLoader, maybe_prefix
from vllm.sequence import IntermediateTensors
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor, MoveDirectionality

from tts_gateway.engine.cosyvoice2.modeldir.configs import UnifiedVocab
from tts_gateway.engine.cosyvoice2.serving.lm.sampling import ras_log_probs
from tts_gateway.engine.cosyvoice2.serving.lm.vllm_rounds import RoundRule


def _vocab(hf_config) -> UnifiedVocab:
    layout = hf_config.cosyvoice2
    return UnifiedVocab(int(layout["text_vocab_size"]), int(layout["speech_token_size"]))


class CosyVoice2ForVLLM(nn.Module):
    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        super().__init__()
        config = vllm_config.model_config.hf_config
        self.config = config
        self.vocab = _vocab(config)
        if config.vocab_size != self.vocab.size:
            raise ValueError(f"vocab_size {config.vocab_size} is not the unified size {self.vocab.size}")
        self.model = Qwen2Model(vllm_config=vllm_config, prefix=maybe_prefix(prefix, "model"))
        self.speech_head = nn.Linear(config.hidden_size, self.vocab.num_speech_classes, bias=True)
        self.make_empty_intermediate_tensors = self.model.make_empty_intermediate_tensors

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_input_ids(input_ids)

    def forward(
        self,
        input_ids: torch.Tensor | None,
        positions: torch.Tensor,
        intermediate_tensors: IntermediateTensors | None = None,
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor | IntermediateTensors:
        return self.model(input_ids, positions, intermediate_tensors, inputs_embeds)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        speech = self.speech_head(hidden_states)
        logits = speech.new_full((hidden_states.shape[0], self.vocab.size), float("-inf"))
        offset = self.vocab.speech_offset
        logits[:, offset : offset + self.vocab.num_speech_classes] = speech
        return logits

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return AutoWeightsLoader(self).load_weights(weights)


class CosyVoice2LogitsProcessor(LogitsProcessor):
    """Applies each request's :class:`RoundRule` (requests without one are left alone)."""

    @classmethod
    def validate_params(cls, sampling_params) -> None:
        RoundRule.from_extra_args(sampling_params.extra_args)  # raises ValueError if malformed

    def __init__(self, vllm_config: VllmConfig, device: torch.device, is_pin_memory: bool) -> None:
        self.vocab = _vocab(vllm_config.model_config.hf_config)
        self.device = device
        self.pin_memory = is_pin_memory
        # batch row -> (rule, the request's live output-token list for this round)
        self.rows: dict[int, tuple[RoundRule, list[int]]] = {}

    def is_argmax_invariant(self) -> bool:
        return False  # masking special classes changes greedy picks too

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        if batch_update is None:
            return
        for index in batch_update.removed:
            self.rows.pop(index, None)
        for index, params, _prompt, output_ids in batch_update.added:
            rule = RoundRule.from_extra_args(params.extra_args) if params is not None else None
            if rule is None:
                self.rows.pop(index, None)
            else:
                self.rows[index] = (rule, output_ids)
        for a, b, direction in batch_update.moved:
            row_a, row_b = self.rows.pop(a, None), self.rows.pop(b, None)
            if row_a is not None:
                self.rows[b] = row_a
            if direction == MoveDirectionality.SWAP and row_b is not None:
                self.rows[a] = row_b

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        vocab = self.vocab
        n_special = vocab.num_speech_classes - vocab.speech_token_size
        rows = sorted(i for i in self.rows if i < logits.shape[0])
        if not rows:
            return logits
        # Special classes a row may not take now: one small host-built mask, one copy.
        # (The speech classes are thousands of columns: they are closed by row index, only
        # for the rare rows at their round's limit, which must stop now.)
        first_special = vocab.speech(vocab.speech_token_size)
        closed = [[True] * n_special for _ in rows]
        stopping = []
        for k, i in enumerate(rows):
            rule, output_ids = self.rows[i]
            if rule.must_stop(len(output_ids)):
                stopping.append(i)
            for unified in rule.allowed_specials(len(output_ids)):
                closed[k][unified - first_special] = False
        index = self._to_device(rows, torch.long)
        specials = logits[index, first_special : first_special + n_special]
        logits[index, first_special : first_special + n_special] = specials.masked_fill(
            self._to_device(closed, torch.bool), float("-inf")
        )
        if stopping:
            logits[self._to_device(stopping, torch.long), vocab.speech_offset : first_special] = float("-inf")
        ras_rows = [i for i in rows if self.rows[i][0].ras is not None and i not in stopping]
        if ras_rows:
            self._apply_ras(logits, ras_rows)
        return logits

    def _apply_ras(self, logits: torch.Tensor, rows: list[int]) -> None:
        """Replaces the speech logits of ``rows`` by the log of the ras distribution."""
        vocab = self.vocab
        start, end = vocab.speech_offset, vocab.speech_offset + vocab.num_speech_classes
        windows, top_p, top_k, min_repeats = [], [], [], []
        width = max(self.rows[i][0].ras[2] for i in rows)
        for i in rows:
            rule, output_ids = self.rows[i]
            p, k, win, tau = rule.ras
            recent = rule.recent(vocab, output_ids)
            windows.append(recent + [-1] * (width - len(recent)))
            top_p.append(p)
            top_k.append(k)
            min_repeats.append(win * tau)
        index = self._to_device(rows, torch.long)
        logits[index, start:end] = ras_log_probs(
            logits[index, start:end],
            self._to_device(windows, torch.long),
            self._to_device(top_p, torch.float32),
            self._to_device(top_k, torch.long),
            self._to_device(min_repeats, torch.float32),
        ).to(logits.dtype)

    def _to_device(self, data: list, dtype: torch.dtype) -> torch.Tensor:
        """Host data onto the sampler's device without waiting for the GPU.

        A copy from ordinary (pageable) host memory makes the CPU wait until the GPU has
        finished everything queued, here the whole forward pass, every step; from pinned
        memory it is queued like a kernel, and vLLM keeps preparing the next step meanwhile.
        """
        host = torch.tensor(data, dtype=dtype, pin_memory=self.pin_memory)
        return host.to(self.device, non_blocking=True)
