"""Per-context audio output: streaming resampling (soxr) and sample encoding.

Engines produce float32 at their native rate; each context asks for its own rate and
encoding. The resampler keeps state across chunks so chunk borders leave no clicks;
its small look-ahead is returned by :meth:`StreamEncoder.finish` at the end.
"""

from __future__ import annotations

import numpy as np
import soxr

from tts_gateway.gateway.wire import ENCODINGS


class StreamEncoder:
    def __init__(self, in_rate: int, out_rate: int, encoding: str) -> None:
        if encoding not in ENCODINGS:
            raise ValueError(f"unsupported encoding {encoding!r}")
        self.out_rate = out_rate
        self.encoding = encoding
        self._resampler = (
            soxr.ResampleStream(in_rate, out_rate, 1, dtype="float32", quality="HQ")
            if in_rate != out_rate
            else None
        )

    def encode(self, samples: np.ndarray) -> tuple[bytes, int]:
        """Return (bytes, samples at the output rate) for one chunk of engine audio."""
        return self._convert(np.asarray(samples, dtype=np.float32), last=False)

    def finish(self) -> tuple[bytes, int]:
        """Flush the resampler's look-ahead at the end of a context."""
        return self._convert(np.zeros(0, dtype=np.float32), last=True)

    def _convert(self, samples: np.ndarray, last: bool) -> tuple[bytes, int]:
        if self._resampler is not None:
            samples = self._resampler.resample_chunk(samples, last=last)
        return encode_samples(samples, self.encoding), len(samples)


def encode_samples(samples: np.ndarray, encoding: str) -> bytes:
    if encoding == "pcm_f32le":
        return np.clip(samples, -1.0, 1.0).astype("<f4").tobytes()
    pcm16 = float_to_s16(samples)
    if encoding == "pcm_s16le":
        return pcm16.astype("<i2").tobytes()
    if encoding == "mulaw":
        return s16_to_mulaw(pcm16).tobytes()
    raise ValueError(f"unsupported encoding {encoding!r}")


def float_to_s16(samples: np.ndarray) -> np.ndarray:
    return np.round(np.clip(samples, -1.0, 1.0) * 32767.0).astype(np.int16)


# G.711 mu-law. The standard's bias and clip keep the segment arithmetic exact.
_MULAW_BIAS = 0x84
_MULAW_CLIP = 32635


def s16_to_mulaw(pcm: np.ndarray) -> np.ndarray:
    x = pcm.astype(np.int32)
    sign = (x < 0).astype(np.int32) << 7
    magnitude = np.minimum(np.abs(x), _MULAW_CLIP) + _MULAW_BIAS
    exponent = np.floor(np.log2(magnitude)).astype(np.int32) - 7
    mantissa = (magnitude >> (exponent + 3)) & 0x0F
    return (~(sign | (exponent << 4) | mantissa) & 0xFF).astype(np.uint8)


def mulaw_to_s16(codes: np.ndarray) -> np.ndarray:
    u = ~codes.astype(np.int32) & 0xFF
    exponent = (u >> 4) & 0x07
    mantissa = u & 0x0F
    magnitude = (((mantissa << 3) + _MULAW_BIAS) << exponent) - _MULAW_BIAS
    return np.where(u & 0x80, -magnitude, magnitude).astype(np.int16)


def decode(data: bytes, encoding: str) -> np.ndarray:
    """Bytes of one encoding back to float32 samples (clients, tests, tools)."""
    if encoding == "pcm_f32le":
        return np.frombuffer(data, dtype="<f4").astype(np.float32)
    if encoding == "pcm_s16le":
        return np.frombuffer(data, dtype="<i2").astype(np.float32) / 32767.0
    if encoding == "mulaw":
        return mulaw_to_s16(np.frombuffer(data, dtype=np.uint8)).astype(np.float32) / 32767.0
    raise ValueError(f"unsupported encoding {encoding!r}")
