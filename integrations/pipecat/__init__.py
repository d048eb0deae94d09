"""Pipecat TTS service for the gateway: ``from tts_gateway.integrations.pipecat import GatewayTTSService``.

Streams the LLM's text in as it comes (one gateway context per assistant turn), barge-in
cancels the turn's context, and the gateway's word timings become Pipecat's word-timestamp
text frames. See :class:`GatewayTTSService`.
"""

from tts_gateway.integrations.gateway_options import GatewayOptions
from tts_gateway.integrations.pipecat.tts import GatewayTTSService

__all__ = ["GatewayOptions", "GatewayTTSService"]
