"""CosyVoice2's ``tts-gateway voice add`` and ``voice list``: the store of zero-shot voices.

The CLI runs these through the engine's descriptor, with the engine's settings from the
config; no engine is built (registering a voice needs only the frontend).
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from tts_gateway.engine.cosyvoice2.settings import CosyVoice2Settings
from tts_gateway.engine.descriptor import CommandError

if TYPE_CHECKING:
    from tts_gateway.engine.cosyvoice2.frontend.voices import VoiceStore


def voice_add(settings: CosyVoice2Settings, args: argparse.Namespace) -> int:
    store = _voice_store(settings)
    try:
        voice_id = store.add(args.name, args.wav.read_bytes(), args.text)
    except ValueError as exc:  # unusable audio or text, a name already taken: the message says which
        raise CommandError(str(exc)) from exc
    print(voice_id)
    return 0


def voice_list(settings: CosyVoice2Settings, args: argparse.Namespace) -> int:
    for info in _voice_store(settings).list():
        print(f"{info.id}  {info.name}  {info.seconds:.1f} s  {info.prompt_text!r}")
    return 0


def _voice_store(settings: CosyVoice2Settings) -> VoiceStore:
    if not settings.model_dir:
        raise CommandError(
            "set engine.cosyvoice2.model_dir (config.toml or TTS_GATEWAY__ENGINE__COSYVOICE2__MODEL_DIR)"
        )
    # Imported only now (they need torch), so that an unset model_dir is reported as such on a
    # machine without torch too.
    from tts_gateway.engine.cosyvoice2.frontend.prompt import CosyVoice2Frontend
    from tts_gateway.engine.cosyvoice2.frontend.voices import VoiceStore

    return VoiceStore(settings.voices_path, lambda: CosyVoice2Frontend(settings.model_dir))
