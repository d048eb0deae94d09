"""What every adapter needs to speak through a gateway: where it is, the key, the voice."""

from __future__ import annotations

from dataclasses import dataclass

from tts_gateway.gateway.client import Context, TTSClient


@dataclass(frozen=True)
class GatewayOptions:
    """``api_key`` for a gateway that requires one; ``voice`` one of the gateway's voices (its
    default when None); ``speed`` the speaking rate (0.5-2.0, the gateway's default when None)."""

    api_key: str | None = None
    voice: str | None = None
    speed: float | None = None

    async def connect(self, url: str, sample_rate: int | None) -> TTSClient:
        """A session whose audio is 16-bit PCM at ``sample_rate`` (the gateway's default when None)."""
        return await TTSClient.connect(url, api_key=self.api_key, sample_rate=sample_rate, encoding="pcm_s16le")

    def context(self, client: TTSClient, context_id: str | None = None) -> Context:
        return client.context(context_id, voice=self.voice, speed=self.speed)
