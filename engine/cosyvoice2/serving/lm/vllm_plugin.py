"""The ``cosyvoice2`` entry point of vLLM's ``vllm.general_plugins`` group.

vLLM runs every general plugin in each of its processes (the front end and the engine
core it spawns), so the architecture is known wherever a model is built. Registration is
by name, so this imports neither the model nor CUDA.
"""

from __future__ import annotations

from tts_gateway.engine.cosyvoice2.serving.lm.vllm_convert import ARCHITECTURE


def register() -> None:
    from vllm import ModelRegistry

    if ARCHITECTURE not in ModelRegistry.get_supported_archs():
        ModelRegistry.register_model(ARCHITECTURE, "tts_gateway.engine.cosyvoice2.serving.lm.vllm_model:CosyVoice2ForVLLM")
