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

Every sequence the model sees is a list of :class:`UnifiedVocab` ids, and decoding is
planned as a series of :class:`Chunk` rounds (:func:`offline_chunk`, :class:`BistreamPlanner`)
that any backend can run: :class:`TorchLMBackend` here, vLLM streaming input elsewhere.
"""

from __future__ import annotations

import inspect
import json
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers import DynamicCache, Qwen2Config, Qwen2ForCausalLM, Qwen2Model

from engine.cosyvoice2.serving.lm.sampling import Sampler, SamplingConfig, make_sampler

OFFICIAL_TARGET = "cosyvoice.llm.llm.Qwen2LM"

# Qwen2.5-0.5B, the backbone CosyVoice-BlankEN/config.json describes; used without a model directory.
QWEN2_5_0_5B: dict[str, Any] = {
    "architectures": ["Qwen2ForCausalLM"],
    "attention_dropout": 0.0,
    "bos_token_id": 151643,
    "eos_token_id": 151643,
    "hidden_act": "silu",
    "hidden_size": 896,
    "initializer_range": 0.02,
    "intermediate_size": 4864,
    "max_position_embeddings": 32768,
    "max_window_layers": 24,
    "model_type": "qwen2",
    "num_attention_heads": 14,
    "num_hidden_layers": 24,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-06,
    "rope_theta": 1000000.0,
    "sliding_window": 32768,
    "tie_word_embeddings": True,
    "use_cache": True,
    "use_sliding_window": False,
    "vocab_size": 151936,
}

# Config keys that describe how a checkpoint was stored, not the model's shapes.
_STORAGE_KEYS = ("torch_dtype", "dtype", "transformers_version")


@dataclass(frozen=True)
class LLMConfig:
    """The ``llm: !new:cosyvoice.llm.llm.Qwen2LM`` kwargs of ``cosyvoice2.yaml``, plus the backbone.

    ``length_normalized_loss`` and ``lsm_weight`` only matter for training; they are kept
    so that every yaml kwarg has a field of the same name.
    """

    llm_input_size: int = 896
    llm_output_size: int = 896
    speech_token_size: int = 6561
    length_normalized_loss: bool = True
    lsm_weight: float = 0.0
    mix_ratio: tuple[int, int] = (5, 15)
    sampling: SamplingConfig = SamplingConfig()
    # The backbone: the fields of CosyVoice-BlankEN/config.json.
    qwen: Mapping[str, Any] = field(default_factory=lambda: dict(QWEN2_5_0_5B))

    @classmethod
    def full(cls, model_dir: str | Path | None = None, **yaml_kwargs: Any) -> LLMConfig:
        """CosyVoice2-0.5B; with ``model_dir``, the backbone is read from its CosyVoice-BlankEN/config.json."""
        qwen = dict(QWEN2_5_0_5B)
        if model_dir is not None:
            qwen = json.loads((Path(model_dir) / "CosyVoice-BlankEN" / "config.json").read_text())
        return cls(qwen=qwen, **yaml_kwargs)

    @classmethod
    def tiny(cls) -> LLMConfig:
        """A few-MB model for tests; text ids < 1024, the real speech vocabulary."""
        qwen = dict(QWEN2_5_0_5B)
        qwen.update(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            max_window_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=1024,
            bos_token_id=None,
            eos_token_id=None,
        )
        return cls(llm_input_size=64, llm_output_size=64, qwen=qwen)

    def qwen_config(self) -> Qwen2Config:
        return Qwen2Config(**{k: v for k, v in self.qwen.items() if k not in _STORAGE_KEYS})

    @property
    def vocab(self) -> UnifiedVocab:
        return UnifiedVocab(int(self.qwen["vocab_size"]), self.speech_token_size)


@dataclass(frozen=True)
class UnifiedVocab:
    """One id space for everything the LLM reads, so that a backend can take token ids only.

    With ``T = text_vocab_size`` and ``S = speech_token_size``:

    ====================  ===========================  =====================
    unified id            meaning                      embedding row
    ====================  ===========================  =====================
    ``[0, T)``            text token t                 ``embed_tokens[t]``
    ``T``                 ``sos_eos``                  ``llm_embedding[0]``
    ``T + 1``             ``task_id``                  ``llm_embedding[1]``
    ``T + 2 + c``         speech class c in [0, S+3)   ``speech_embedding[c]``
    ====================  ===========================  =====================

    Speech classes are also what the head (``llm_decoder``) scores: ``c < S`` is a speech
    token, ``S`` is eos, ``S + 1`` is unused, ``S + 2`` is fill ("give me more text").
    A backend whose sampler must return unified ids (vLLM) maps class c to ``T + 2 + c``
    and gives the ``T + 2`` non-speech ids no probability.
    """

    text_vocab_size: int
    speech_token_size: int

    @property
    def sos_eos(self) -> int:
        return self.text_vocab_size

    @property
    def task_id(self) -> int:
        return self.text_vocab_size + 1

    @property
    def speech_offset(self) -> int:
        return self.text_vocab_size + 2

    @property
    def num_speech_classes(self) -> int:
        return self.speech_token_size + 3

    @property
    def size(self) -> int:
        return self.speech_offset + self.num_speech_classes

    @property
    def eos_class(self) -> int:
        return self.speech_token_size

    @property
    def fill_class(self) -> int:
        return self.speech_token_size + 2

    def speech(self, speech_class: int) -> int:
        """The unified id of a speech class (a speech token, eos, or fill)."""
        if not 0 <= speech_class < self.num_speech_classes:
            raise ValueError(f"speech class {speech_class} is outside [0, {self.num_speech_classes})")
        return self.speech_offset + speech_class

    def speech_class(self, unified_id: int) -> int:
        """The speech class of a unified id; ValueError for text and special ids."""
        if not self.speech_offset <= unified_id < self.size:
            raise ValueError(f"unified id {unified_id} is not a speech id")
        return unified_id - self.speech_offset

    def text(self, token_ids: Iterable[int]) -> list[int]:
        """Text token ids as unified ids (the same numbers, range-checked)."""
        ids = [int(t) for t in token_ids]
        for t in ids:
            if not 0 <= t < self.text_vocab_size:
                raise ValueError(f"text token {t} is outside [0, {self.text_vocab_size})")
        return ids


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
        qwen = config.qwen_config()
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


# ---------------------------------------------------------------------------------------
# Decoding plans


@dataclass(frozen=True)
class Chunk:
    """One decoding round: append ``ids`` to the context, then sample speech classes until a stop.

    - Each sampled speech token (class < S) is emitted and becomes part of the context.
    - A class in ``stop`` ends the round; it is neither emitted nor part of the context.
    - eos is *suppressed* when it is not in ``stop`` or fewer than ``min_tokens`` tokens were
      emitted in this round. The reference redraws (up to 100 times); a backend that cannot
      redraw masks eos instead, the same for plain random sampling, slightly different for
      nucleus sampling (masking lets the next class into the nucleus).
    - Any other non-speech class is an error (the model is broken).
    - After ``max_tokens`` emitted tokens the round ends as if a stop class had been
      sampled. (A backend that cannot stop without sampling may sample one more token and
      drop it: that is the same thing, since the stop class is not kept either.)
    - ``final``: the utterance ends with this round. Rounds that are not final end the
      backend's decoded history with the fill class (the sampler's repetition window sees it).
    """

    ids: tuple[int, ...]
    stop: frozenset[int]
    min_tokens: int = 0
    max_tokens: int | None = None
    final: bool = False


def offline_chunk(
    vocab: UnifiedVocab,
    text: Sequence[int],
    prompt_text: Sequence[int] = (),
    prompt_speech: Sequence[int] = (),
    *,
    min_token_text_ratio: float = 2,
    max_token_text_ratio: float = 20,
) -> Chunk:
    """The single round of whole-text synthesis (the reference ``Qwen2LM.inference``).

    Context: ``[sos_eos, prompt_text + text, task_id, prompt_speech]``; then decode until eos,
    with eos suppressed below ``len(text) * min_token_text_ratio`` tokens and at most
    ``len(text) * max_token_text_ratio`` tokens (prompt text does not count).

    The unused class and fill also end the round, as in upstream CosyVoice's later code
    and its vLLM path; the reference torch path instead skips them and feeds its last input
    again, a bug this does not reproduce.
    """
    ids = [vocab.sos_eos, *vocab.text(prompt_text), *vocab.text(text), vocab.task_id]
    ids += [vocab.speech(s) for s in prompt_speech]
    eos = vocab.eos_class
    return Chunk(
        ids=tuple(ids),
        stop=frozenset({eos, eos + 1, vocab.fill_class}),
        min_tokens=int(len(text) * min_token_text_ratio),
        max_tokens=int(len(text) * max_token_text_ratio),
        final=True,
    )


class BistreamPlanner:
    """Plans decoding while the text still arrives (the reference ``Qwen2LM.inference_bistream``).

    The model was trained on ``sos_eos``, then groups of 5 text tokens and 15 speech tokens
    (``mix_ratio``) after each of which it predicts fill, then the remaining text,
    ``task_id`` and the remaining speech, after which it predicts eos. Usage::

        planner = BistreamPlanner(vocab, prompt_text, prompt_speech)
        for piece in text_pieces:                 # text token ids, as they are tokenised
            chunk = planner.push_text(piece)      # at most one round per piece
            if chunk is not None:
                emitted = run(chunk)              # the speech tokens the round emitted
                planner.round_done(emitted)
        run(planner.finish())                     # decode until eos

    The reference pulls one piece, plans at most one round, runs it, then pulls the next;
    its frontend yields one text token per piece. Fed bigger pieces, it leaves the surplus
    text for the final round; this planner does exactly the same.

    The defaults reproduce the reference (cosyvoice-minicpmo 0.1.0, i.e. upstream CosyVoice
    before Dec 2025) exactly, quirks included:

    - ``refeed_last_input``: the reference's final round starts with the input of the last
      model call again (the last speech token, or the whole last round's ids if that round
      stopped at once). ``False`` gives the training layout instead.
    - ``first_round_budget``: the reference forces fill every 15 tokens only after the first
      sampled fill, so the first round is unbounded. ``True`` bounds it by the tokens that
      complete the last prompt group, as upstream CosyVoice does since Dec 2025.
    - ``final_max_tokens``: the reference puts no bound on the final round; set one to keep a
      model that never samples eos from running forever.
    """

    def __init__(
        self,
        vocab: UnifiedVocab,
        prompt_text: Sequence[int] = (),
        prompt_speech: Sequence[int] = (),
        mix_ratio: tuple[int, int] = (5, 15),
        *,
        refeed_last_input: bool = True,
        first_round_budget: bool = False,
        final_max_tokens: int | None = None,
    ) -> None:
        self.vocab = vocab
        self.text_per_group, self.speech_per_group = mix_ratio
        self.refeed_last_input = refeed_last_input
        self.final_max_tokens = final_max_tokens
        self._context = [vocab.sos_eos]  # planned ids not yet handed to a round
        self._text = vocab.text(prompt_text)  # text waiting for its group
        self._prompt_speech = [vocab.speech(s) for s in prompt_speech]
        self._first_budget: int | None = None
        if first_round_budget:
            self._first_budget = self.speech_per_group - len(self._prompt_speech) % self.speech_per_group
        self._rounds = 0
        self._open: Chunk | None = None
        self._last_input: tuple[int, ...] = ()  # the ids of the last model call of the last round
        self._finished = False

    @property
    def round_open(self) -> bool:
        """A round was planned and :meth:`round_done` has not reported it yet."""
        return self._open is not None

    @property
    def pending_text(self) -> int:
        """Text tokens received but not planned yet."""
        return len(self._text)

    def push_text(self, piece: Sequence[int]) -> Chunk | None:
        """Add a piece of text; returns the next interleaved round, or None to wait for more text."""
        self._check_can_plan()
        self._text += self.vocab.text(piece)
        # The prompt's speech tokens are interleaved with text first (prompt text, then new text).
        n_text, n_speech = self.text_per_group, self.speech_per_group
        while self._prompt_speech and len(self._text) >= n_text:
            self._context += self._text[:n_text] + self._prompt_speech[:n_speech]
            del self._text[:n_text], self._prompt_speech[:n_speech]
        if self._prompt_speech:
            return None
        # After a fill (or at the start without prompt speech) the model waits for a group of
        # text; right after the prompt's groups it continues its partial speech group first.
        if self._rounds or len(self._context) == 1:
            if len(self._text) < n_text:
                return None
            self._context += self._text[:n_text]
            del self._text[:n_text]
        budget = n_speech if self._rounds else self._first_budget
        self._open = Chunk(
            ids=tuple(self._context), stop=frozenset({self.vocab.fill_class}), max_tokens=budget, final=False
        )
        self._context = []
        return self._open

    def round_done(self, emitted: Sequence[int]) -> None:
        """Report the speech tokens (classes) the round returned by :meth:`push_text` emitted."""
        if self._open is None:
            raise RuntimeError("no round is open")
        self._last_input = (self.vocab.speech(emitted[-1]),) if emitted else self._open.ids
        self._open = None
        self._rounds += 1

    def finish(self) -> Chunk:
        """The text has ended: the final round, remaining text + task_id, decoded until eos.

        Prompt speech tokens that never got a text group are dropped, as in the reference.
        """
        self._check_can_plan()
        self._finished = True
        ids = list(self._last_input) if self.refeed_last_input else []
        ids += self._context + self._text + [self.vocab.task_id]
        self._context, self._text = [], []
        return Chunk(
            ids=tuple(ids),
            stop=frozenset({self.vocab.eos_class}),
            max_tokens=self.final_max_tokens,
            final=True,
        )

    def _check_can_plan(self) -> None:
        if self._finished:
            raise RuntimeError("the text has already ended")
        if self._open is not None:
            raise RuntimeError("report the open round with round_done() first")


# ---------------------------------------------------------------------------------------
# Plain-torch backend


class TorchLMBackend:
    """Runs decoding plans on a :class:`CosyVoice2LM` with a KV cache, one utterance at a time.

    The model can be shared; the cache and the decoded history belong to this object, so
    concurrent utterances need one backend each. ``generate_*`` are synchronous generators:
    the engine runs them in a worker thread and, for streaming text, passes an iterator that
    blocks until the next piece of token ids (or the end) is there.
    """

    MAX_EOS_REDRAWS = 100

    def __init__(
        self,
        model: CosyVoice2LM,
        sampler: Sampler | None = None,
        *,
        mask_impossible: bool = False,
        redraw_suppressed_eos: bool = True,
    ) -> None:
        """``mask_impossible``: give no probability to special classes a round cannot take
        (fill in the final round, the unused class anywhere). The reference raises when it
        samples one; a trained model practically never does, but serving should not fail a
        turn on it. Off, decoding is exactly the reference's.

        ``redraw_suppressed_eos=False``: mask eos where it is suppressed instead of redrawing,
        as a backend that samples once (vLLM) does; with greedy picks a redraw would repeat."""
        self.mask_impossible = mask_impossible
        self.redraw_suppressed_eos = redraw_suppressed_eos
        self.model = model
        self.vocab = model.vocab
        self.sampler = sampler if sampler is not None else make_sampler(model.config.sampling)
        self._cache: DynamicCache | None = None
        self._unfed: list[int] = []  # context positions not run through the model yet

    def reset(self) -> None:
        self._cache = DynamicCache()
        self._unfed = []

    @property
    def context_length(self) -> int:
        """Positions in the KV cache."""
        return 0 if self._cache is None else self._cache.get_seq_length()

    @torch.inference_mode()
    def append(self, unified_ids: Sequence[int]) -> torch.Tensor:
        """Extend the context by ``unified_ids`` -> float32 logits of the position after it.

        Positions deferred by a round that ended at its budget are run first.
        """
        feed = [*self._unfed, *unified_ids]
        if not feed:
            raise ValueError("nothing to append")
        if self._cache is None:
            self.reset()
        self._unfed = []
        device = self.model.llm_decoder.weight.device
        ids = torch.tensor([feed], dtype=torch.long, device=device)
        hidden = self.model.hidden(self.model.embed(ids), self._cache)
        return self.model.llm_decoder(hidden[0, -1]).float()

    def step(self, speech_class: int) -> torch.Tensor:
        """Feed one decoded speech class -> logits of the next position."""
        return self.append([self.vocab.speech(speech_class)])

    def sample(self, logits: torch.Tensor, history: list[int], *, allow_eos: bool) -> int:
        """One draw of the sampler; a suppressed eos is redrawn, as the reference does."""
        if not allow_eos and not self.redraw_suppressed_eos:
            logits = logits.clone()
            logits[self.vocab.eos_class] = float("-inf")
        scores = logits.log_softmax(dim=-1)
        for _ in range(self.MAX_EOS_REDRAWS + 1):
            speech_class = self.sampler(scores, history)
            if allow_eos or speech_class != self.vocab.eos_class:
                return speech_class
        raise RuntimeError(f"the sampler kept choosing eos where it is not allowed ({self.MAX_EOS_REDRAWS} redraws)")

    def run(self, chunk: Chunk, history: list[int]) -> Iterator[int]:
        """Run one round: yields its speech tokens; ``history`` collects what the sampler has seen."""
        vocab = self.vocab
        feed = list(chunk.ids)
        emitted = 0
        while chunk.max_tokens is None or emitted < chunk.max_tokens:
            logits = self.append(feed)
            if self.mask_impossible:
                impossible = [
                    special
                    for special in range(vocab.speech_token_size, vocab.num_speech_classes)
                    if special != vocab.eos_class and special not in chunk.stop
                ]
                logits = logits.clone()  # the model's output is an inference tensor
                logits[impossible] = float("-inf")
            allow_eos = vocab.eos_class in chunk.stop and emitted >= chunk.min_tokens
            speech_class = self.sample(logits, history, allow_eos=allow_eos)
            if speech_class in chunk.stop:
                feed = []
                break
            if speech_class >= vocab.speech_token_size:
                raise RuntimeError(f"the model produced speech class {speech_class} where it cannot occur")
            history.append(speech_class)
            emitted += 1
            yield speech_class
            feed = [vocab.speech(speech_class)]
        # A token emitted at the budget has not been run yet: it is run with the next round's ids.
        self._unfed += feed
        if not chunk.final:
            history.append(vocab.fill_class)

    def generate_offline(
        self,
        text: Sequence[int],
        prompt_text: Sequence[int] = (),
        prompt_speech: Sequence[int] = (),
        *,
        min_token_text_ratio: float = 2,
        max_token_text_ratio: float = 20,
    ) -> Iterator[int]:
        """Speech tokens for a whole text (see :func:`offline_chunk`)."""
        chunk = offline_chunk(
            self.vocab,
            text,
            prompt_text,
            prompt_speech,
            min_token_text_ratio=min_token_text_ratio,
            max_token_text_ratio=max_token_text_ratio,
        )
        self.reset()
        yield from self.run(chunk, [])

    def generate_bistream(
        self,
        text_pieces: Iterable[Sequence[int]],
        prompt_text: Sequence[int] = (),
        prompt_speech: Sequence[int] = (),
        max_reply_tokens: int | None = None,
        **planner_options: Any,
    ) -> Iterator[int]:
        """Speech tokens while the text arrives in pieces of token ids (see :class:`BistreamPlanner`).

        ``max_reply_tokens``: a bound on the whole reply; the final round may emit what the
        rounds before it left (at least one token).
        """
        planner = BistreamPlanner(
            self.vocab, prompt_text, prompt_speech, self.model.config.mix_ratio, **planner_options
        )
        self.reset()
        history: list[int] = []
        total = 0
        for piece in text_pieces:
            chunk = planner.push_text(piece)
            if chunk is None:
                continue
            emitted: list[int] = []
            for speech_class in self.run(chunk, history):
                emitted.append(speech_class)
                yield speech_class
            planner.round_done(emitted)
            total += len(emitted)
        final = planner.finish()
        if max_reply_tokens is not None:
            final = replace(final, max_tokens=max(1, max_reply_tokens - total))
        yield from self.run(final, history)


__all__ = [
    "OFFICIAL_TARGET",
    "QWEN2_5_0_5B",
    "BistreamPlanner",
    "Chunk",
    "CosyVoice2LM",
    "LLMConfig",
    "SamplingConfig",
    "TorchLMBackend",
    "UnifiedVocab",
    "load_llm",
    "offline_chunk",
]
