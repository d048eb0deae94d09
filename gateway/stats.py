"""Rolling per-second windows for the live dashboard (``GET /v1/stats``).

:class:`tts_gateway.gateway.metrics.Metrics` feeds every observation it records into one
:class:`RollingStats`, so the dashboard and Prometheus count the same events. Memory is
bounded: one bucket per second for the last :data:`MAX_WINDOW_S` seconds, and at most
:data:`MAX_TTFA_PER_S` TTFA samples per bucket.
"""

from __future__ import annotations

import collections
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

MAX_WINDOW_S = 300
DEFAULT_WINDOW_S = 60
MAX_TTFA_PER_S = 1000


@dataclass(slots=True)
class _Second:
    t: int
    ttfa_s: list[float] = field(default_factory=list)
    audio_s: float = 0.0
    stall_s: float = 0.0
    stalls: int = 0
    errors: collections.Counter = field(default_factory=collections.Counter)
    contexts: collections.Counter = field(default_factory=collections.Counter)


class RollingStats:
    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self._clock = clock
        self._seconds: collections.deque[_Second] = collections.deque(maxlen=MAX_WINDOW_S)

    # ------------------------------------------------------------ observations

    def _now(self) -> _Second:
        t = int(self._clock())
        if not self._seconds or self._seconds[-1].t != t:
            self._seconds.append(_Second(t))
        return self._seconds[-1]

    def ttfa(self, seconds: float) -> None:
        samples = self._now().ttfa_s
        if len(samples) < MAX_TTFA_PER_S:
            samples.append(seconds)

    def audio_sent(self, seconds: float) -> None:
        self._now().audio_s += seconds

    def stall(self, seconds: float, count: int) -> None:
        bucket = self._now()
        bucket.stall_s += seconds
        bucket.stalls += count

    def error(self, code: str) -> None:
        self._now().errors[code] += 1

    def context_finished(self, outcome: str) -> None:
        self._now().contexts[outcome] += 1

    # ------------------------------------------------------------ reading

    def window(self, window_s: int) -> dict:
        """Per-second series over the last ``window_s`` seconds (oldest first) and totals over it."""
        clock = self._clock()
        now = int(clock)
        first = now - window_s + 1
        by_t = {b.t: b for b in self._seconds if b.t >= first}
        ts = list(range(first, now + 1))
        seconds = [by_t.get(t) or _Second(t) for t in ts]
        all_ttfa = sorted(x for b in seconds for x in b.ttfa_s)
        errors: collections.Counter = sum((b.errors for b in seconds), collections.Counter())
        contexts: collections.Counter = sum((b.contexts for b in seconds), collections.Counter())
        return {
            "now": round(clock, 3),
            "series": {
                "t": ts,
                "ttfa_p50_ms": [_ms(_quantile(sorted(b.ttfa_s), 0.5)) for b in seconds],
                "ttfa_p95_ms": [_ms(_quantile(sorted(b.ttfa_s), 0.95)) for b in seconds],
                "audio_s_per_s": [round(b.audio_s, 3) for b in seconds],
                "stall_s": [round(b.stall_s, 3) for b in seconds],
                "errors": [sum(b.errors.values()) for b in seconds],
            },
            "totals": {
                "ttfa_p50_ms": _ms(_quantile(all_ttfa, 0.5)),
                "ttfa_p95_ms": _ms(_quantile(all_ttfa, 0.95)),
                "ttfa_count": len(all_ttfa),
                "audio_s": round(sum(b.audio_s for b in seconds), 3),
                "stall_s": round(sum(b.stall_s for b in seconds), 3),
                "stalls": sum(b.stalls for b in seconds),
                "errors_by_code": dict(errors),
                "contexts_by_outcome": dict(contexts),
            },
        }


def parse_window(value: str | None) -> int:
    """The ``window`` query parameter: whole seconds, 1 to MAX_WINDOW_S (default 60)."""
    if value is None:
        return DEFAULT_WINDOW_S
    try:
        window = int(value)
    except ValueError:
        raise ValueError(f"window must be a whole number of seconds, not {value!r}") from None
    if not 1 <= window <= MAX_WINDOW_S:
        raise ValueError(f"window must be from 1 to {MAX_WINDOW_S} seconds")
    return window


def _quantile(ordered: list[float], q: float) -> float | None:
    """Nearest-rank quantile of sorted samples; None when there are none."""
    if not ordered:
        return None
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000.0, 1)
