"""Adapters that plug the gateway into agent frameworks, as clients of the public protocol.

Each lives in its own package and installs with its extra: ``pip install 'tts-gateway[pipecat]'``
for :mod:`tts_gateway.integrations.pipecat`, ``'tts-gateway[livekit]'`` for :mod:`tts_gateway.integrations.livekit`.
"""
