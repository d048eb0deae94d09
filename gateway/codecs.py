"""The speech route's response formats (OpenAI's): each an encoder that turns engine audio
into bytes of its format as the audio arrives, so that the response streams.

Every format carries 24 kHz mono, as OpenAI's do: the engine's audio is resampled first
(gateway/audio.py). ``wav`` and ``pcm`` are 16-bit samples; ``mp3``, ``opus`` (in Ogg),
``flac`` and ``aac`` (ADTS) are encoded with PyAV (FFmpeg). A compressed format holds
back what its codec needs to fill a frame (tens of milliseconds) until the next chunk
or the end.
"""

from __future__ import annotations

import struct

import av
import numpy as np

from tts_gateway.gateway.audio import StreamEncoder

SPEECH_RATE = 24000  # OpenAI's rate for every response format
# OpenAI's Content-Type for each response format.
CONTENT_TYPES = {
    "wav": "audio/wav",
    "pcm": "audio/pcm",
    "mp3": "audio/mpeg",
    "opus": "audio/opus",
    "flac": "audio/flac",
    "aac": "audio/aac",
}
# Each compressed format's FFmpeg container and codec, and the codec's bit rate (None: lossless).
_CONTAINERS = {
    "mp3": ("mp3", "libmp3lame", 64_000),
    "opus": ("ogg", "libopus", 32_000),
    "flac": ("flac", "flac", None),
    "aac": ("adts", "aac", 64_000),
}
# Ogg's pages are flushed every 20 ms of audio rather than every second: the stream stays live.
_MUXER_OPTIONS = {"ogg": {"page_duration": "20000"}}


class SpeechEncoder:
    """Engine audio in, bytes of one response format out: ``encode`` per chunk, then
    ``finish``. Each returns (bytes, samples of 24 kHz audio they add)."""

    def __init__(self, fmt: str, engine_rate: int) -> None:
        if fmt not in CONTENT_TYPES:
            raise ValueError(f"unknown response format {fmt!r}")
        self.content_type = CONTENT_TYPES[fmt]
        self._pcm = StreamEncoder(engine_rate, SPEECH_RATE, "pcm_s16le")
        self._header = streaming_wav_header(SPEECH_RATE) if fmt == "wav" else b""
        self._compressor = _Compressor(*_CONTAINERS[fmt]) if fmt in _CONTAINERS else None

    def header(self) -> bytes:
        """What the body starts with before any audio (a WAV header with sizes "unknown")."""
        return self._header

    def encode(self, samples: np.ndarray) -> tuple[bytes, int]:
        return self._compress(*self._pcm.encode(samples), last=False)

    def finish(self) -> tuple[bytes, int]:
        """The resampler's look-ahead and the codec's last frames: the end of the body."""
        return self._compress(*self._pcm.finish(), last=True)

    def _compress(self, pcm16: bytes, n: int, last: bool) -> tuple[bytes, int]:
        if self._compressor is None:
            return pcm16, n
        return self._compressor.compress(pcm16, last), n


class _Compressor:
    """16-bit 24 kHz mono PCM into one FFmpeg container, written to memory as it comes."""

    def __init__(self, container: str, codec: str, bit_rate: int | None) -> None:
        self._sink = _Sink()
        self._container = av.open(self._sink, mode="w", format=container, options=_MUXER_OPTIONS.get(container, {}))
        self._stream = self._container.add_stream(codec, rate=SPEECH_RATE, layout="mono")
        if bit_rate:
            self._stream.bit_rate = bit_rate
        self._pts = 0

    def compress(self, pcm16: bytes, last: bool) -> bytes:
        if pcm16:
            samples = np.frombuffer(pcm16, dtype="<i2").reshape(1, -1)
            frame = av.AudioFrame.from_ndarray(samples, format="s16", layout="mono")
            frame.sample_rate = SPEECH_RATE
            frame.pts = self._pts
            self._pts += samples.shape[1]
            self._container.mux(self._stream.encode(frame))
        if last:
            self._container.mux(self._stream.encode(None))  # the codec's held-back frames
            self._container.close()  # the container's trailer
        return self._sink.take()


class _Sink:
    """A write-only file for FFmpeg: no seek, so every container is written as a stream
    (no header rewritten at the end)."""

    def __init__(self) -> None:
        self._parts: list[bytes] = []

    def write(self, data) -> int:
        self._parts.append(bytes(data))
        return len(data)

    def take(self) -> bytes:
        data, self._parts = b"".join(self._parts), []
        return data


def streaming_wav_header(sample_rate: int) -> bytes:
    """A 16-bit mono WAV header whose sizes say "unknown" (0xFFFFFFFF), for a stream."""
    unknown = 0xFFFFFFFF
    return struct.pack(
        "<4sI4s4sIHHIIHH4sI",
        b"RIFF", unknown, b"WAVE", b"fmt ", 16, 1, 1, sample_rate, sample_rate * 2, 2, 16, b"data", unknown,
    )
