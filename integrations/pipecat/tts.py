"""A Pipecat ``TTSService`` that speaks through the gateway's WebSocket protocol.

One session per service; one gateway context per assistant turn, with Pipecat's turn
context id as its id. Text goes in token by token (the gateway segments and normalises it
itself, so Pipecat does not wait for whole sentences); the end of the LLM's reply ends the
context; an interruption cancels it, and the client drops any of its audio still on the way.
Pipecat measures time to first byte from the turn's first text to its first audio, and
times its word frames from the gateway's ``alignment`` frames: their ``start_ms`` is on
the context's audio timeline, which is where Pipecat wants a word's timestamp.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator

from pipecat.frames.frames import CancelFrame, EndFrame, Frame, StartFrame, TTSAudioRawFrame, TTSStoppedFrame
from pipecat.services.settings import TTSSettings
from pipecat.services.tts_service import TextAggregationMode, TTSService

from tts_gateway.gateway.client import Alignment, Context, GatewayError, TTSClient
from tts_gateway.integrations.gateway_options import GatewayOptions


class GatewayTTSService(TTSService):
    """Speech from a tts-gateway at ``url`` (``ws://host:8765/v1/stream``), with word timestamps.

    ``options`` carry the key, voice and speed. The audio comes as 16-bit PCM at the pipeline's
    output rate, or ``sample_rate`` when given (one the gateway supports).
    """

    def __init__(self, *, url: str, options: GatewayOptions | None = None, sample_rate: int | None = None, **kwargs):
        super().__init__(
            # The gateway cuts the text into speakable pieces itself; tokens go straight on.
            text_aggregation_mode=kwargs.pop("text_aggregation_mode", TextAggregationMode.TOKEN),
            push_text_frames=False,  # the words come back as timed frames from the alignments
            push_start_frame=True,
            sample_rate=sample_rate,
            settings=TTSSettings(model=None, voice=options.voice if options else None, language=None),
            **kwargs,
        )
        self._url = url
        self._options = options or GatewayOptions()
        self._client: TTSClient | None = None
        self._contexts: dict[str, Context] = {}  # open turns by Pipecat context id
        self._readers: set[asyncio.Task] = set()

    def can_generate_metrics(self) -> bool:
        return True

    # -- lifecycle ---------------------------------------------------------------

    async def start(self, frame: StartFrame) -> None:
        await super().start(frame)
        self._client = await self._options.connect(self._url, self.sample_rate)

    async def stop(self, frame: EndFrame) -> None:
        await super().stop(frame)
        await self._close()

    async def cancel(self, frame: CancelFrame) -> None:
        await super().cancel(frame)
        await self._close()

    async def _close(self) -> None:
        for reader in list(self._readers):
            reader.cancel()
        await asyncio.gather(*self._readers, return_exceptions=True)
        if self._client is not None:
            await self._client.close()
            self._client = None

    # -- text in -----------------------------------------------------------------

    async def run_tts(self, text: str, context_id: str) -> AsyncGenerator[Frame | None, None]:
        """Send a piece of the turn's text; the audio comes through the context's reader."""
        context = self._contexts.get(context_id)
        try:
            if context is None:
                context = self._open(context_id)
            await context.send_text(text)
            await self.start_tts_usage_metrics(text)
        except (GatewayError, RuntimeError, OSError) as error:
            await self.push_error(error_msg=f"tts-gateway: {error}")
        yield None  # audio arrives on the reader task

    def _open(self, context_id: str) -> Context:
        if self._client is None:
            raise RuntimeError("the service is not started")
        context = self._options.context(self._client, context_id)
        self._contexts[context_id] = context
        reader = self.create_task(self._read(context), f"tts-gateway-{context_id}")
        self._readers.add(reader)
        reader.add_done_callback(self._readers.discard)
        return context

    async def flush_audio(self, context_id: str | None = None) -> None:
        """The LLM's reply is complete: the gateway speaks the rest and ends the context."""
        context = self._contexts.get(context_id or self.get_active_audio_context_id() or "")
        if context is not None:
            await context.end()

    async def on_audio_context_interrupted(self, context_id: str) -> None:
        """Barge-in: the gateway stops the turn at once and none of its audio is played."""
        await self.stop_all_metrics()
        context = self._contexts.get(context_id)
        if context is not None:
            await context.cancel()
        await super().on_audio_context_interrupted(context_id)

    # -- audio and words out -----------------------------------------------------

    async def _read(self, context: Context) -> None:
        context_id = context.context_id
        try:
            async for event in context.events():
                if isinstance(event, Alignment):
                    words = [(word.text, word.start_ms / 1000.0) for word in event.words]
                    await self.add_word_timestamps(words, context_id)
                else:
                    frame = TTSAudioRawFrame(event.data, self.sample_rate, 1, context_id=context_id)
                    await self.append_to_audio_context(context_id, frame)
        except GatewayError as error:
            await self.push_error(error_msg=f"tts-gateway: {error.code}: {error.message}")
        finally:
            self._contexts.pop(context_id, None)
        if not context.cancelled:
            await self.append_to_audio_context(context_id, TTSStoppedFrame(context_id=context_id))
            await self.remove_audio_context(context_id)
