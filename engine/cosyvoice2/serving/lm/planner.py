"""Decoding plans of the LM stage: a reply as a series of :class:`Chunk` rounds that any
backend can run (plain torch in :mod:`.torch_stage`, vLLM streaming input in :mod:`.vllm_stage`).

:func:`offline_chunk` is whole-text synthesis in one round; :class:`BistreamPlanner` plans
rounds while the text still arrives, as the official bistream inference does.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from tts_gateway.engine.cosyvoice2.modeldir.configs import UnifiedVocab


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
    - ``text_read``: how many of the reply's text tokens (the voice prompt's transcript not
      counted) the context holds once this round's ids are in: the model cannot have spoken
      text beyond them when it makes this round's speech tokens (word timings build on it).
    """

    ids: tuple[int, ...]
    stop: frozenset[int]
    min_tokens: int = 0
    max_tokens: int | None = None
    final: bool = False
    text_read: int = 0


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
        text_read=len(text),
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
        self._prompt_text_left = len(self._text)  # of self._text, the prompt's transcript
        self._text_read = 0  # the reply's text tokens planned into the context
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
            self._context += self._take_text(n_text) + self._prompt_speech[:n_speech]
            del self._prompt_speech[:n_speech]
        if self._prompt_speech:
            return None
        # After a fill (or at the start without prompt speech) the model waits for a group of
        # text; right after the prompt's groups it continues its partial speech group first.
        if self._rounds or len(self._context) == 1:
            if len(self._text) < n_text:
                return None
            self._context += self._take_text(n_text)
        budget = n_speech if self._rounds else self._first_budget
        self._open = Chunk(
            ids=tuple(self._context), stop=frozenset({self.vocab.fill_class}), max_tokens=budget, final=False,
            text_read=self._text_read,
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
        ids += self._context + self._take_text(len(self._text)) + [self.vocab.task_id]
        self._context = []
        return Chunk(
            ids=tuple(ids),
            stop=frozenset({self.vocab.eos_class}),
            max_tokens=self.final_max_tokens,
            final=True,
            text_read=self._text_read,
        )

    def _take_text(self, n: int) -> list[int]:
        """The next ``n`` waiting text ids, counted as read (those past the prompt's transcript)."""
        taken, self._text = self._text[:n], self._text[n:]
        prompt = min(n, self._prompt_text_left)
        self._prompt_text_left -= prompt
        self._text_read += n - prompt
        return taken

    def _check_can_plan(self) -> None:
        if self._finished:
            raise RuntimeError("the text has already ended")
        if self._open is not None:
            raise RuntimeError("report the open round with round_done() first")
