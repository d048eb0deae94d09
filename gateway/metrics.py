"""Prometheus metrics. Names carry the ``tts_`` prefix and base units (seconds);
counters end in ``_total``.

Each server owns its registry, so several gateways (tests, embedding) never share
counters. Engine queue depth is read from the engine when Prometheus scrapes, so it is
never stale.
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily

from engine.base import EngineStats
from gateway.protocol import ContextFinished

# First audio is the product's headline number: fine buckets where it matters.
TTFA_BUCKETS = (0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 10.0)
RTF_BUCKETS = (0.01, 0.02, 0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 5.0)
STALL_BUCKETS = (0.0, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class Metrics:
    def __init__(self, engine_name: str, engine_stats: Callable[[], EngineStats]) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.ttfa = Histogram(
            "tts_time_to_first_audio_seconds",
            "First text of a context received to its first audio sent.",
            buckets=TTFA_BUCKETS,
            registry=r,
        )
        self.rtf = Histogram(
            "tts_real_time_factor",
            "Engine compute time per second of audio, per finished context.",
            buckets=RTF_BUCKETS,
            registry=r,
        )
        self.context_stall = Histogram(
            "tts_context_playback_stall_seconds",
            "Estimated playback stall per context: how much later than needed its audio was sent.",
            buckets=STALL_BUCKETS,
            registry=r,
        )
        self.audio_sent = Counter("tts_audio_sent_seconds_total", "Audio sent to clients.", registry=r)
        self.stall_seconds = Counter(
            "tts_playback_stall_seconds_total",
            "Estimated client playback stall: chunks sent later than a client playing from the first chunk needed them.",
            registry=r,
        )
        self.stalls = Counter("tts_playback_stalls_total", "Chunks sent after their playback time.", registry=r)
        self.sessions_active = Gauge("tts_active_sessions", "Open WebSocket sessions.", registry=r)
        self.contexts_active = Gauge("tts_active_contexts", "Contexts being spoken.", registry=r)
        self.sessions = Counter("tts_sessions_total", "Sessions accepted.", registry=r)
        self.contexts = Counter("tts_contexts_total", "Contexts finished, by outcome.", ["outcome"], registry=r)
        self.errors = Counter("tts_errors_total", "Error frames sent, by code.", ["code"], registry=r)
        self.ready = Gauge("tts_engine_ready", "1 once the engine is loaded and warmed.", registry=r)
        r.register(_EngineCollector(engine_name, engine_stats))

    def context_finished(self, event: ContextFinished) -> None:
        self.contexts.labels(event.outcome).inc()
        self.contexts_active.dec()
        if event.ttfa_s is not None:
            self.ttfa.observe(event.ttfa_s)
        if event.audio_s > 0:
            self.rtf.observe(event.compute_s / event.audio_s)
            self.context_stall.observe(event.stall_s)
            self.stall_seconds.inc(event.stall_s)
            self.stalls.inc(event.stalls)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _EngineCollector:
    def __init__(self, engine_name: str, stats: Callable[[], EngineStats]) -> None:
        self._engine = engine_name
        self._stats = stats

    def collect(self):
        stats = self._stats()
        for name, doc, value in (
            ("tts_engine_queue_depth", "Units of engine work ready but not started.", stats.queued),
            ("tts_engine_running", "Units of engine work in progress.", stats.running),
            ("tts_engine_utterances", "Open engine utterances.", stats.utterances),
        ):
            family = GaugeMetricFamily(name, doc, labels=["engine"])
            family.add_metric([self._engine], value)
            yield family
