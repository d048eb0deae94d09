"""Async Python client for the tts-gateway streaming protocol (v1).

Built for LLM agents: connect once, open one context per reply, push the
model's text deltas as they arrive, and iterate the audio as it is produced::

    from tts_gateway.gateway.client import TTSClient

    async with TTSClient.connect("ws://127.0.0.1:8765/v1/stream", api_key=KEY) as tts:
        reply = tts.context(voice="joe")

        async def pump():
            async for delta in llm_stream():
                await reply.send_text(delta)
            await reply.end()

        pump_task = asyncio.create_task(pump())
        async for chunk in reply:            # AudioChunk objects, in order
            play(chunk.data)
        print(reply.done.ttfa_ms, reply.alignments)

or, when nothing else needs doing meanwhile, ``audio = await reply.speak(deltas)``.

How frames reach a context
--------------------------
One reader task owns the receiving side of the socket. It pairs every
``audio`` header with the binary frame that follows it and puts the resulting
:class:`AudioChunk` on its context's queue. Word timings (``alignment``) are
appended to ``Context.alignments`` as they arrive, and queued as :class:`Alignment`
for ``Context.events()``, which yields them among the audio in wire order; ``done`` / ``cancelled``
set ``Context.done`` / ``Context.cancelled`` and end the context's iteration
once its queued audio has been consumed.

Backpressure
------------
Each context's queue is bounded (``max_queued_chunks``, default 1024 chunks,
i.e. minutes of audio). When a consumer falls that far behind, the reader waits
for it instead of buffering more. The socket then stops being read, which
stalls every context of the session and, once the gateway's per-session send
buffer is full, makes the gateway cut the session off: error ``overloaded``
and close code 1008, or ``connection_closed`` when that frame, stuck behind
the unread audio, is not reached before the gateway aborts the connection.
Memory stays bounded either way. Audio of a context you
cancelled is discarded, so a cancelled context never blocks the reader; but do
not open a context and leave its audio unread.

Errors
------
Everything the gateway reports, and every way a session can end, surfaces as
:class:`GatewayError`. Its ``code`` is one of the protocol's error codes or one
of two client-side codes: ``connection_closed`` (the socket closed without an
explanatory ``error`` frame) and ``protocol_error`` (the gateway broke the
framing rules, e.g. a binary frame without an ``audio`` header). A handshake
refused over HTTP (401 for a bad key) raises ``websockets.InvalidStatus``
from :meth:`TTSClient.connect`.
"""

from tts_gateway.gateway.client.context import Context
from tts_gateway.gateway.client.frames import Alignment, AudioChunk, Done, GatewayError, Word
from tts_gateway.gateway.client.session import TTSClient
from tts_gateway.gateway.client.wav import write_wav

__all__ = [
    "Alignment",
    "AudioChunk",
    "Context",
    "Done",
    "GatewayError",
    "TTSClient",
    "Word",
    "write_wav",
]
