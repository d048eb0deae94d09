"""LiveKit Agents TTS for the gateway: ``from tts_gateway.integrations.livekit import GatewayTTS``.

``stream()`` speaks an LLM reply as it is pushed (push_text / flush / end_input), with word
timings as aligned transcripts; ``synthesize()`` speaks a whole text. See :class:`GatewayTTS`.
"""

from tts_gateway.integrations.gateway_options import GatewayOptions
from tts_gateway.integrations.livekit.tts import GatewayTTS

__all__ = ["GatewayOptions", "GatewayTTS"]
