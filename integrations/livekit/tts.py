"""A LiveKit Agents ``tts.TTS`` that speaks through the gateway's WebSocket protocol.

All streams of one ``GatewayTTS`` share one gateway session; each ``SynthesizeStream`` is one
gateway context and one LiveKit segment. ``push_text`` sends the delta at once (the gateway
segments and normalises the text itself), ``flush`` asks the gateway to speak what it holds,
``end_input`` ends the context. Closing a stream early (an interruption) cancels the context,
and the gateway stops generating it. The gateway's ``alignment`` frames become aligned
transcripts: one ``TimedString`` per word, its times in seconds from the segment's start.
"""

from __future__ import annotations

import asyncio

from livekit.agents import APIConnectionError, APIError, tts
from livekit.agents.types import DEFAULT_API_CONNECT_OPTIONS, APIConnectOptions
from livekit.agents.voice.io import TimedString

from tts_gateway.gateway.client import Alignment, Context, GatewayError, TTSClient
from tts_gateway.integrations.gateway_options import GatewayOptions


class GatewayTTS(tts.TTS):
    """Speech from a tts-gateway at ``url`` (``ws://host:8765/v1/stream``), with word timings.

    ``options`` carry the key, voice and speed; ``sample_rate`` is one the gateway supports.
    Audio is 16-bit PCM, mono.
    """

    def __init__(self, *, url: str, options: GatewayOptions | None = None, sample_rate: int = 24000) -> None:
        super().__init__(
            capabilities=tts.TTSCapabilities(streaming=True, aligned_transcript=True),
            sample_rate=sample_rate,
            num_channels=1,
        )
        self._url = url
        self._options = options or GatewayOptions()
        self._client: TTSClient | None = None
        self._connecting = asyncio.Lock()

    @property
    def provider(self) -> str:
        return "tts-gateway"

    def synthesize(
        self, text: str, *, conn_options: APIConnectOptions = DEFAULT_API_CONNECT_OPTIONS
    ) -> tts.ChunkedStream:
        return self._synthesize_with_stream(text, conn_options=conn_options)

    def stream(self, *, conn_options: APIConnectOptions = DEFAULT_API_CONNECT_OPTIONS) -> GatewaySynthesizeStream:
        return GatewaySynthesizeStream(tts=self, conn_options=conn_options)

    async def aclose(self) -> None:
        if self._client is not None:
            await self._client.close()
            self._client = None

    async def _open_context(self) -> Context:
        """A new context on the shared session, connecting (again) when there is none."""
        async with self._connecting:
            if self._client is None or self._client.closed:
                try:
                    self._client = await self._options.connect(self._url, self.sample_rate)
                except (OSError, TimeoutError) as error:
                    raise APIConnectionError(f"cannot reach the tts-gateway at {self._url}: {error}") from error
            return self._options.context(self._client)


class GatewaySynthesizeStream(tts.SynthesizeStream):
    """One gateway context: text in as it is pushed, audio and timed words out as they come."""

    _tts: GatewayTTS

    async def _run(self, output_emitter: tts.AudioEmitter) -> None:
        context = await self._tts._open_context()
        output_emitter.initialize(
            request_id=context.context_id,
            sample_rate=self._tts.sample_rate,
            num_channels=1,
            mime_type="audio/pcm",
            stream=True,
        )
        output_emitter.start_segment(segment_id=context.context_id)
        sending = asyncio.create_task(self._send(context))
        try:
            async for event in context.events():
                if isinstance(event, Alignment):
                    output_emitter.push_timed_transcript(
                        [TimedString(f"{w.text} ", start_time=w.start_ms / 1000, end_time=w.end_ms / 1000) for w in event.words]
                    )
                else:
                    output_emitter.push(event.data)
            await sending  # its failure, if any
            output_emitter.end_segment()
        except GatewayError as error:
            raise APIError(f"tts-gateway: {error.code}: {error.message}", retryable=False) from error
        finally:
            sending.cancel()
            await asyncio.gather(sending, return_exceptions=True)
            if not context.finished:
                await context.cancel()  # closed early: the gateway stops generating at once

    async def _send(self, context: Context) -> None:
        async for item in self._input_ch:
            if isinstance(item, self._FlushSentinel):
                await context.flush()
            else:
                await context.send_text(item)
        await context.end()
