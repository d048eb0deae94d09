"""Ordering engine work by the listener's need: the shared scheduling key of every engine.

An utterance's *playback deadline* is when its listener runs out of audio, assuming
playback starts with the first chunk. One that has produced nothing yet is already due
(since its first work became ready); one that is playing is due when the audio it has
produced so far ends. Engines run the earliest deadline first, not the earliest request.
"""

from __future__ import annotations


class PlaybackClock:
    def __init__(self) -> None:
        self.ready_since: float | None = None
        self.first_audio_at: float | None = None
        self.audio_s = 0.0

    def ready(self, now: float) -> None:
        """Work became ready (only the first call counts)."""
        if self.ready_since is None:
            self.ready_since = now

    def produced(self, seconds: float, now: float) -> None:
        if self.first_audio_at is None:
            self.first_audio_at = now
        self.audio_s += seconds

    def deadline(self, now: float) -> float:
        if self.first_audio_at is None:
            self.ready(now)
            return self.ready_since
        return self.first_audio_at + self.audio_s
