"""The LLM stage behind the CosyVoice2 engine: text token ids in, speech tokens out.

The engine talks to one small interface, so the plain-torch stage (:mod:`.torch_stage`:
CPU tests, small deployments) and the vLLM stage (:mod:`.vllm_stage`: continuous batching
on a GPU) are interchangeable. Both follow the official bistream semantics through
:class:`~tts_gateway.engine.cosyvoice2.serving.lm.planner.BistreamPlanner`: 5 text tokens in, up to 15 speech tokens
out, a fill token asks for more text and is never fed back, and at the end of input the
rest of the text plus ``task_id`` is appended and decoding runs to eos.

Speech tokens are delivered through a callback on the event loop's thread. Before a round's
first speech token, ``on_text_read`` (if given) gets the round's
:attr:`~engine.cosyvoice2.serving.lm.planner.Chunk.text_read`: how many of the reply's text
tokens the model had read when it made the tokens that follow. It is a plain integer the
planner already knows, so reporting it costs the decoding nothing.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Sequence

# Safety bound on speech per text token (the official offline maximum ratio is 20):
# a model that never samples eos cannot speak forever. Each stage reads its own
# ``max_speech_per_text_token`` (the engine sets it from config).
MAX_SPEECH_PER_TEXT_TOKEN = 20


class LMStream(abc.ABC):
    """One utterance's decoding. Methods are called on the event loop's thread."""

    @abc.abstractmethod
    def push_text_ids(self, ids: Sequence[int]) -> None: ...

    @abc.abstractmethod
    def end_text(self) -> None: ...

    @abc.abstractmethod
    def cancel(self) -> None:
        """Stop decoding at once; no more tokens are delivered."""


class LMStage(abc.ABC):
    # Speech tokens a reply may have per text token before it is ended without eos.
    max_speech_per_text_token: float = MAX_SPEECH_PER_TEXT_TOKEN

    @abc.abstractmethod
    def open(
        self,
        prompt_text_ids: Sequence[int],
        prompt_speech_tokens: Sequence[int],
        on_tokens: Callable[[list[int]], None],
        on_done: Callable[[BaseException | None], None],
        on_text_read: Callable[[int], None] | None = None,
    ) -> LMStream:
        """Start decoding for one utterance; ``on_done(None)`` after the last token, or with the error.

        ``on_text_read(n)``: the speech tokens delivered from now on were made with ``n`` of
        the reply's text tokens read (called when a round that read more starts delivering)."""

    def running(self) -> int:
        return 0

    def failure(self) -> str | None:
        """Why this stage can decode no more, or None."""
        return None

    def metrics(self) -> tuple[dict[str, float], dict[str, float]]:
        """Gauges and running totals for the gateway's metrics (names without the tts_ prefix)."""
        return {"llm_streams": float(self.running())}, {}

    async def close(self) -> None:
        pass
