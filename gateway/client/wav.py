"""Saving what the client received."""

from __future__ import annotations

import wave


def write_wav(path: str, pcm_s16le: bytes, sample_rate: int) -> None:
    """Write mono 16-bit little-endian PCM (encoding ``pcm_s16le``) to a WAV file."""
    with wave.open(str(path), "wb") as wav:
        wav.setnchannels(1)
        wav.setsampwidth(2)
        wav.setframerate(sample_rate)
        wav.writeframes(pcm_s16le)

