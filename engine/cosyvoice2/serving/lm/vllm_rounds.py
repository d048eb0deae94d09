"""Decoding rounds (:class:`~engine.cosyvoice2.model.llm.Chunk`) as vLLM streaming-input requests.

No vLLM import here: this is the translation both sides of the vLLM backend share (the
request builder in ``vllm_stage`` and the logits processor in ``vllm_model``), kept pure so
that CPU tests can check it against the plain-torch backend.

One utterance is one vLLM streaming request; each round is one ``StreamingInput``:

- ``prompt_token_ids`` = the round's unified ids; vLLM appends them to the context;
- the round's stop classes are ``stop_token_ids``; a stop token ends the round and vLLM
  drops the last sampled token from the context before the next input, which is exactly
  "fill is never fed back";
- a round ends at its limit (the budget of 15 speech tokens, or the final round's
  safety bound) through the logits processor, not through ``max_tokens``: once the
  limit is emitted, only the round's stop classes may be sampled (fill for a budget
  round, eos for the final one). vLLM 0.26 keeps a streaming request's ``max_tokens``
  from its first input for every later one (vLLM PR #57676, open), so a per-round
  ``max_tokens`` would cut the final round at the first round's 16 tokens. Every round
  therefore asks for all the room the model has left, which is never the binding limit;
  the forced stop token is sampled and dropped from the context like fill (and
  :class:`RoundTracker` does not emit it);
- what the sampler may choose is decided per round by :class:`RoundRule`, which the
  logits processor applies: speech tokens always; eos only when it ends the round and
  ``min_tokens`` tokens were emitted; fill and the unused class only when they end it;
  after ``limit`` tokens, nothing but the round's stop classes.
  This equals the torch backend's ``mask_impossible`` mode, with masking in place of
  redrawing a suppressed eos.
- repetition-aware sampling needs the recent decoded classes; vLLM restarts a request's
  output list at every input, so each round carries the history before it.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from tts_gateway.engine.cosyvoice2.modeldir.configs import UnifiedVocab
from tts_gateway.engine.cosyvoice2.serving.lm.planner import Chunk
from tts_gateway.engine.cosyvoice2.modeldir.configs import SamplingConfig

# The key of SamplingParams.extra_args that carries a RoundRule.
EXTRA_ARGS_KEY = "cosyvoice2"


@dataclass(frozen=True)
class RoundRule:
    """What the logits processor enforces for one request's current round."""

    # Unified ids of the special classes (eos, unused, fill) the sampler may take, apart from eos.
    special_allowed: tuple[int, ...]
    eos: int | None  # the unified eos id when eos may end this round, else None
    min_tokens: int  # eos is masked until this many tokens were sampled in the round
    # After this many tokens only the round's stop classes may be sampled (None: no limit).
    limit: int | None
    # ras_sampling's (top_p, top_k, win_size, tau_r); None: the request samples as vLLM does (e.g. greedy)
    ras: tuple[float, int, int, float] | None
    history: tuple[int, ...]  # the last decoded classes before this round (for the ras window)

    def to_extra_args(self) -> dict:
        return {
            EXTRA_ARGS_KEY: {
                "special_allowed": list(self.special_allowed),
                "eos": self.eos,
                "min_tokens": self.min_tokens,
                "limit": self.limit,
                "ras": list(self.ras) if self.ras is not None else None,
                "history": list(self.history),
            }
        }

    @classmethod
    def from_extra_args(cls, extra_args: dict | None) -> RoundRule | None:
        """The rule a request carries; None for requests without one (vLLM's own warm-up)."""
        if not extra_args or EXTRA_ARGS_KEY not in extra_args:
            return None
        raw = extra_args[EXTRA_ARGS_KEY]
        try:
            ras = raw["ras"]
            return cls(
                special_allowed=tuple(int(i) for i in raw["special_allowed"]),
                eos=None if raw["eos"] is None else int(raw["eos"]),
                min_tokens=int(raw["min_tokens"]),
                limit=None if raw["limit"] is None else int(raw["limit"]),
                ras=None if ras is None else (float(ras[0]), int(ras[1]), int(ras[2]), float(ras[3])),
                history=tuple(int(c) for c in raw["history"]),
            )
        except (KeyError, TypeError, ValueError, IndexError) as exc:
            raise ValueError(f"malformed extra_args[{EXTRA_ARGS_KEY!r}]: {exc}") from None

    def allowed_specials(self, sampled_in_round: int) -> tuple[int, ...]:
        """Unified ids of the special classes open at this step of the round."""
        if self.eos is not None and (sampled_in_round >= self.min_tokens or self.must_stop(sampled_in_round)):
            return (*self.special_allowed, self.eos)
        return self.special_allowed

    def must_stop(self, sampled_in_round: int) -> bool:
        """The round has emitted its limit: the next token must be one of its stop classes."""
        return self.limit is not None and sampled_in_round >= self.limit

    def recent(self, vocab: UnifiedVocab, round_output_ids: Sequence[int]) -> list[int]:
        """The ras window: the last ``win_size`` decoded classes, history first."""
        assert self.ras is not None
        win = self.ras[2]
        tail = [t - vocab.speech_offset for t in round_output_ids[-win:]]
        return ([*self.history, *tail])[-win:]


@dataclass(frozen=True)
class RoundRequest:
    """One ``StreamingInput``: the ids to append and the sampling parameters of the round."""

    prompt_token_ids: list[int]
    stop_token_ids: list[int]
    max_tokens: int
    rule: RoundRule


def round_request(
    chunk: Chunk,
    vocab: UnifiedVocab,
    sampling: SamplingConfig | None,
    history: Sequence[int],
    final_limit: int,
    room: int,
) -> RoundRequest:
    """The vLLM request of one round. ``sampling`` None: greedy (tests).

    ``history``: the classes decoded before this round, fill marks included, as the torch
    backend's sampler sees them. ``final_limit``: the limit of a round without a budget
    (the final round's safety bound). ``room``: the tokens the model's length leaves after
    this round's ids, which becomes ``max_tokens`` (see the module docstring).
    """
    eos = vocab.eos_class
    specials = range(vocab.speech_token_size, vocab.num_speech_classes)
    special_allowed = tuple(vocab.speech(c) for c in specials if c in chunk.stop and c != eos)
    ras = None
    if sampling is not None:
        ras = (sampling.top_p, sampling.top_k, sampling.win_size, sampling.tau_r)
        history = history[-sampling.win_size :]
    else:
        history = ()
    rule = RoundRule(
        special_allowed=special_allowed,
        eos=vocab.speech(eos) if eos in chunk.stop else None,
        min_tokens=chunk.min_tokens,
        limit=final_limit if chunk.max_tokens is None else chunk.max_tokens,
        ras=ras,
        history=tuple(history),
    )
    return RoundRequest(
        prompt_token_ids=list(chunk.ids),
        stop_token_ids=sorted(vocab.speech(c) for c in chunk.stop),
        max_tokens=room,
        rule=rule,
    )


class RoundTracker:
    """Turns the token ids vLLM returns for one round into the speech tokens to emit.

    Feed every delta; ``done`` turns True at the round's end: a stop class, or any token
    after the budget (the processor makes it a stop class; vLLM drops it from the
    context, and so is it never emitted).
    """

    def __init__(self, chunk: Chunk, vocab: UnifiedVocab) -> None:
        self.chunk = chunk
        self.vocab = vocab
        self.emitted: list[int] = []
        self.done = False
        self.finish_reason: str | None = None  # vLLM's, for the round's last output (diagnostics)

    def feed(self, token_ids: Iterable[int]) -> list[int]:
        new: list[int] = []
        for token in token_ids:
            if self.done:
                raise RuntimeError("the LLM returned tokens after its round ended")
            speech_class = self.vocab.speech_class(token)
            if speech_class in self.chunk.stop or (
                self.chunk.max_tokens is not None and len(self.emitted) == self.chunk.max_tokens
            ):
                self.done = True
                continue
            if speech_class >= self.vocab.speech_token_size:
                raise RuntimeError(f"the model produced speech class {speech_class} where it cannot occur")
            self.emitted.append(speech_class)
            new.append(speech_class)
        return new

    def history_after(self, history: list[int]) -> list[int]:
        """The sampler's history once this round is over (fill marks the end of a non-final round)."""
        return [*history, *self.emitted] + ([] if self.chunk.final else [self.vocab.fill_class])
