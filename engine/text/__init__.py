"""Text front end of the gateway: agent reply text -> speakable fragments.

Agents stream their reply text in small deltas.  :class:`TextNormalizer`
turns the raw deltas (Markdown, emoji, digits, symbols, English and Chinese)
into plain spoken-form text and commits it as soon as nothing still to come
can change it; :class:`Segmenter` cuts that text into fragments - a short
first one for low latency, whole sentences after that - each synthesised as
one unit by the TTS engine.

    normalizer, segmenter = TextNormalizer(), Segmenter()
    for delta in deltas:
        for fragment in segmenter.push(normalizer.push(delta)):
            speak(fragment)
    for fragment in segmenter.push(normalizer.flush()) + segmenter.flush():
        speak(fragment)

Pure standard library.
"""

from .normalize import TextNormalizer, normalize
from .segment import Segmenter

__all__ = ["TextNormalizer", "normalize", "Segmenter"]
