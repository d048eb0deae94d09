"""Prometheus metrics. Names carry the ``tts_`` prefix and base units (seconds);
counters end in ``_total``.

Every observation goes through a :class:`Metrics` method, which also feeds the rolling
per-second windows behind ``GET /v1/stats`` (:mod:`tts_gateway.gateway.stats`): one choke point, so
the dashboard and Prometheus never disagree about what happened.

Each server owns its registry, so several gateways (tests, embedding) never share
counters. Engine queue depth is read from the engine when Prometheus scrapes, so it is
never stale. GPU gauges come from NVML through :class:`tts_gateway.gateway.gpu_metrics.GpuSampler`,
which the server starts and stops.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from tts_gateway.engine.base import EngineStats
from tts_gateway.engine.registry import ENGINES
from tts_gateway.gateway.gpu_metrics import GpuSampler
from tts_gateway.gateway.key_limits import LIMITS, KeyAccount, KeyLimits
from tts_gateway.gateway.protocol import ContextFinished
from tts_gateway.gateway.stats import RollingStats

# First audio is the product's headline number: fine buckets where it matters.
TTFA_BUCKETS = (0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 10.0)
RTF_BUCKETS = (0.01, 0.02, 0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 5.0)
STALL_BUCKETS = (0.0, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
LOOP_LAG_BUCKETS = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0)
LOOP_LAG_PERIOD_S = 0.05
LOOP_TASKS_EVERY = 20  # loop-lag ticks between two counts of the loop's tasks (once a second)


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
        self.loop_lag = Histogram(
            "tts_event_loop_lag_seconds",
            "How late the gateway's event loop ran a timer: time every session waits before it is served.",
            buckets=LOOP_LAG_BUCKETS,
            registry=r,
        )
        self.loop_tasks = Gauge(
            "tts_event_loop_tasks", "Tasks alive on the gateway's event loop (a leak shows as growth).", registry=r
        )
        r.register(_EngineCollector(engine_name, engine_stats))
        self._engine_stats = engine_stats
        self.rolling = RollingStats()
        self.gpu = GpuSampler(r)

    def count_keys(self, key_limits: KeyLimits) -> None:
        """Export each key's usage and refusals, read from its account at each scrape."""
        self.registry.register(_KeyCollector(key_limits.accounts))

    # ------------------------------------------------------------ observations

    def audio(self, seconds: float) -> None:
        """Audio handed to a client."""
        self.audio_sent.inc(seconds)
        self.rolling.audio_sent(seconds)

    def error(self, code: str) -> None:
        """An error answered to a client (error frame or HTTP error), by code."""
        code = str(code)
        self.errors.labels(code).inc()
        self.rolling.error(code)

    def context_started(self) -> None:
        self.contexts_active.inc()

    def context_finished(self, event: ContextFinished) -> None:
        self.contexts.labels(event.outcome).inc()
        self.contexts_active.dec()
        self.rolling.context_finished(event.outcome)
        if event.ttfa_s is not None:
            self.ttfa.observe(event.ttfa_s)
            self.rolling.ttfa(event.ttfa_s)
        if event.audio_s > 0:
            self.rtf.observe(event.compute_s / event.audio_s)
            self.context_stall.observe(event.stall_s)
            self.stall_seconds.inc(event.stall_s)
            self.stalls.inc(event.stalls)
            self.rolling.stall(event.stall_s, event.stalls)

    async def watch_loop_lag(self) -> None:
        """Observe the event loop's lag until cancelled: a timer due every 50 ms, and how late it ran.

        Every session's frames, every engine callback and every scrape share this loop; a
        lag here is a delay for all of them at once (and on a GPU host, often a CPU-bound
        thread holding the GIL)."""
        loop = asyncio.get_running_loop()
        tick = 0
        while True:
            due = loop.time() + LOOP_LAG_PERIOD_S
            await asyncio.sleep(LOOP_LAG_PERIOD_S)
            self.loop_lag.observe(max(0.0, loop.time() - due))
            if tick % LOOP_TASKS_EVERY == 0:
                self.loop_tasks.set(len(asyncio.all_tasks(loop)))
            tick += 1

    # ------------------------------------------------------------ reading

    def stats(self, window_s: int) -> dict:
        """The ``GET /v1/stats`` body: rolling series over ``window_s`` and current gauges."""
        rolling = self.rolling.window(window_s)
        totals = rolling["totals"]
        engine = self._engine_stats()
        gauge = self.registry.get_sample_value
        return {
            "now": rolling["now"],
            "window_s": window_s,
            "series": rolling["series"],
            "current": {
                "sessions": int(gauge("tts_active_sessions") or 0),
                "contexts": int(gauge("tts_active_contexts") or 0),
                "engine_queue_depth": engine.queued,
                "engine_running": engine.running,
                "engine_utterances": engine.utterances,
                "ttfa_p50_ms": totals["ttfa_p50_ms"],
                "ttfa_p95_ms": totals["ttfa_p95_ms"],
                "ttfa_count": totals["ttfa_count"],
                "audio_s": totals["audio_s"],
                "stall_s": totals["stall_s"],
                "stalls": totals["stalls"],
                "errors_by_code": totals["errors_by_code"],
                "contexts_by_outcome": totals["contexts_by_outcome"],
            },
            "gpu": self.gpu.metrics.summary() if self.gpu.metrics else None,
        }

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _EngineCollector:
    def __init__(self, engine_name: str, stats: Callable[[], EngineStats]) -> None:
        self._engine = engine_name
        self._stats = stats
        # The help texts of the engine's own series, from its descriptor. An engine built
        # outside the registry (a test's stand-in) has none: its series get a generic one.
        described = ENGINES.get(engine_name)
        self._gauges = described.gauges if described else {}
        self._totals = described.totals if described else {}

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
        # Engine-specific series (e.g. the LLM stage's): named by the engine, documented by its descriptor.
        for key, value in sorted(stats.extra.items()):
            family = GaugeMetricFamily(f"tts_{key}", self._gauges.get(key, "Engine-specific gauge."), labels=["engine"])
            family.add_metric([self._engine], value)
            yield family
        for key, value in sorted(stats.totals.items()):
            family = CounterMetricFamily(f"tts_{key}", self._totals.get(key, "Engine-specific total."), labels=["engine"])
            family.add_metric([self._engine], value)
            yield family


class _KeyCollector:
    """Per-key series, labelled by the key's short hash (never the key). The keys come from
    the config, so the label takes a bounded set of values."""

    def __init__(self, accounts: Mapping[str, KeyAccount]) -> None:
        self._accounts = accounts

    def collect(self):
        sessions = GaugeMetricFamily("tts_key_sessions", "Sessions and speech requests open, per API key.", labels=["key"])
        contexts = GaugeMetricFamily("tts_key_contexts", "Contexts open (speech requests included), per API key.",
                                     labels=["key"])
        chars = CounterMetricFamily("tts_key_chars", "Characters of text taken to speak, per API key.", labels=["key"])
        refusals = CounterMetricFamily("tts_key_refusals", "Requests refused by a per-key limit, by limit.",
                                       labels=["key", "limit"])
        for key, account in self._accounts.items():
            sessions.add_metric([key], account.sessions)
            contexts.add_metric([key], account.contexts)
            chars.add_metric([key], account.chars_total)
            for limit in LIMITS:
                refusals.add_metric([key, limit], account.refusals[limit])
        yield from (sessions, contexts, chars, refusals)


# Every registered engine's own series, as exported: what a dashboard may query beyond the
# always-present series.
ENGINE_METRIC_NAMES = frozenset(
    [f"tts_{key}" for engine in ENGINES.values() for key in engine.gauges]
    + [f"tts_{key}_total" for engine in ENGINES.values() for key in engine.totals]
)
