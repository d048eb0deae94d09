"""GPU metrics from NVML: what the card is doing while it serves speech.

Gauges carry the ``tts_gpu_`` prefix, base units (bytes, hertz, watts, ratio 0-1,
celsius) and a ``gpu`` label (the NVML device index). ``tts_gpu_throttled{reason=...}``
is 1 while NVML reports that reason for running the clocks below their maximum: a hot
card under sustained load shows ``sw_thermal`` / ``hw_thermal`` or ``sw_power_cap``
here, and its time to first audio grows with it.

NVML comes from the optional ``nvidia-ml-py`` package (``pip install 'tts-gateway[gpu]'``).
Without it, or without a GPU, the sampler does nothing and says so once in the log.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import CollectorRegistry, Gauge

log = logging.getLogger("tts_gateway.gpu")

SAMPLE_INTERVAL_S = 1.0

# NVML's clock event ("throttle") reason bits, stable across driver versions
# (nvmlClocksEventReason* in nvml.h). GPU idle (0x1) is left out: an idle card lowering
# its clocks is not throttling, and alerts on max(tts_gpu_throttled) must not fire on it.
THROTTLE_REASONS = {
    "applications_clocks": 0x2,
    "sw_power_cap": 0x4,
    "hw_slowdown": 0x8,
    "sync_boost": 0x10,
    "sw_thermal": 0x20,
    "hw_thermal": 0x40,
    "hw_power_brake": 0x80,
    "display_clocks": 0x100,
}

# Gauges labelled by gpu: name -> (GpuReading field, help).
VALUE_GAUGES = {
    "tts_gpu_utilization_ratio": ("utilization_ratio", "Share of the last sample period the GPU ran kernels, 0 to 1."),
    "tts_gpu_memory_used_bytes": ("memory_used_bytes", "GPU memory in use (all processes)."),
    "tts_gpu_memory_total_bytes": ("memory_total_bytes", "GPU memory installed."),
    "tts_gpu_temperature_celsius": ("temperature_celsius", "GPU core temperature."),
    "tts_gpu_sm_clock_hertz": ("sm_clock_hertz", "Current SM (shader) clock."),
    "tts_gpu_memory_clock_hertz": ("memory_clock_hertz", "Current memory clock."),
    "tts_gpu_power_watts": ("power_watts", "Current power draw."),
}
THROTTLED = "tts_gpu_throttled"  # labelled by gpu and reason
GPU_METRIC_NAMES = (*VALUE_GAUGES, THROTTLED)


@dataclass(frozen=True)
class GpuReading:
    """One sample of one GPU, in base units. A field is None when the card does not report it."""

    index: int
    utilization_ratio: float | None = None
    memory_used_bytes: int | None = None
    memory_total_bytes: int | None = None
    temperature_celsius: float | None = None
    sm_clock_hertz: float | None = None
    memory_clock_hertz: float | None = None
    power_watts: float | None = None
    throttle_mask: int | None = None
    unsupported: dict[str, str] = field(default_factory=dict)  # field -> NVML's reason

    def throttled(self) -> dict[str, bool]:
        """Each known throttle reason, active or not; empty when the card does not say."""
        if self.throttle_mask is None:
            return {}
        return {reason: bool(self.throttle_mask & bit) for reason, bit in THROTTLE_REASONS.items()}


def read_gpu(nvml: Any, index: int) -> GpuReading:
    """Sample one GPU through ``nvml`` (the pynvml module) and convert to base units."""
    handle = nvml.nvmlDeviceGetHandleByIndex(index)
    # ClocksEventReasons is the new name (driver 535+ bindings); older bindings only have ClocksThrottleReasons.
    reasons = getattr(nvml, "nvmlDeviceGetCurrentClocksEventReasons", None) or (
        nvml.nvmlDeviceGetCurrentClocksThrottleReasons
    )
    probes: dict[str, Callable[[], Any]] = {
        "utilization_ratio": lambda: nvml.nvmlDeviceGetUtilizationRates(handle).gpu / 100.0,
        "temperature_celsius": lambda: float(nvml.nvmlDeviceGetTemperature(handle, nvml.NVML_TEMPERATURE_GPU)),
        "sm_clock_hertz": lambda: nvml.nvmlDeviceGetClockInfo(handle, nvml.NVML_CLOCK_SM) * 1e6,  # MHz
        "memory_clock_hertz": lambda: nvml.nvmlDeviceGetClockInfo(handle, nvml.NVML_CLOCK_MEM) * 1e6,
        "power_watts": lambda: nvml.nvmlDeviceGetPowerUsage(handle) / 1000.0,  # mW
        "throttle_mask": lambda: int(reasons(handle)),
    }
    values: dict[str, Any] = {}
    unsupported: dict[str, str] = {}
    try:
        memory = nvml.nvmlDeviceGetMemoryInfo(handle)
        values.update(memory_used_bytes=int(memory.used), memory_total_bytes=int(memory.total))
    except nvml.NVMLError as exc:
        unsupported["memory"] = str(exc)
    for name, probe in probes.items():
        try:  # some cards (and MIG slices) do not report every field: keep the others
            values[name] = probe()
        except nvml.NVMLError as exc:
            unsupported[name] = str(exc)
    return GpuReading(index, **values, unsupported=unsupported)


def load_nvml() -> tuple[Any | None, str]:
    """``(pynvml, "")`` initialised with at least one GPU, or ``(None, why not)``."""
    try:
        import pynvml
    except ImportError:
        return None, "nvidia-ml-py is not installed (pip install 'tts-gateway[gpu]')"
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as exc:
        return None, f"NVML did not start ({exc}): no NVIDIA driver here"
    count = pynvml.nvmlDeviceGetCount()
    if count == 0:
        pynvml.nvmlShutdown()
        return None, "NVML sees no GPU"
    return pynvml, ""


class GpuMetrics:
    """The GPU gauges on a registry, and the latest readings for ``GET /v1/stats``."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self._values = {
            field_name: Gauge(name, doc, ["gpu"], registry=registry)
            for name, (field_name, doc) in VALUE_GAUGES.items()
        }
        self._throttled = Gauge(
            THROTTLED, "1 while the GPU's clocks are held down for this reason.", ["gpu", "reason"], registry=registry
        )
        self.latest: list[GpuReading] = []

    def update(self, readings: list[GpuReading]) -> None:
        for reading in readings:
            gpu = str(reading.index)
            for field_name, gauge in self._values.items():
                value = getattr(reading, field_name)
                if value is not None:
                    gauge.labels(gpu).set(value)
            for reason, active in reading.throttled().items():
                self._throttled.labels(gpu, reason).set(1 if active else 0)
        self.latest = readings

    def summary(self) -> dict | None:
        """All GPUs as the dashboard's one GPU table: mean utilisation, summed memory and power,
        hottest temperature, throttle reasons active on any card. None before the first sample."""
        readings = self.latest
        if not readings:
            return None

        def present(name: str) -> list:
            return [v for r in readings if (v := getattr(r, name)) is not None]

        utilization = present("utilization_ratio")
        temperature = present("temperature_celsius")
        power = present("power_watts")
        return {
            "gpus": len(readings),
            "gpu_utilization_ratio": sum(utilization) / len(utilization) if utilization else None,
            "gpu_memory_used_bytes": sum(present("memory_used_bytes")) or None,
            "gpu_memory_total_bytes": sum(present("memory_total_bytes")) or None,
            "gpu_temperature_celsius": max(temperature) if temperature else None,
            "gpu_power_watts": sum(power) if power else None,
            "gpu_throttled": sorted({reason for r in readings for reason, on in r.throttled().items() if on}),
        }


class GpuSampler:
    """Polls NVML every ``interval_s`` into :class:`GpuMetrics`; a no-op without NVML or a GPU."""

    def __init__(
        self,
        metrics_registry: CollectorRegistry,
        *,
        interval_s: float = SAMPLE_INTERVAL_S,
        nvml_loader: Callable[[], tuple[Any | None, str]] = load_nvml,
    ) -> None:
        self._registry = metrics_registry
        self._interval_s = interval_s
        self._load = nvml_loader
        self._nvml: Any | None = None
        self._count = 0
        self._task: asyncio.Task | None = None
        self._reported: set[tuple[int, str]] = set()  # (gpu, field) whose absence was logged
        self.metrics: GpuMetrics | None = None  # None: not sampling

    @property
    def running(self) -> bool:
        return self._task is not None

    async def start(self) -> None:
        nvml, why_not = self._load()
        if nvml is None:
            log.info("GPU metrics off: %s", why_not)
            return
        self._nvml = nvml
        self._count = nvml.nvmlDeviceGetCount()
        # Registered only now: a gateway without a GPU exports no empty GPU families.
        self.metrics = GpuMetrics(self._registry)
        await self._sample()  # the first values are there before the first scrape
        log.info("GPU metrics on: %d GPU(s), sampled every %.1f s", self._count, self._interval_s)
        self._task = asyncio.create_task(self._run(), name="gpu-metrics")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        if self._nvml is not None:
            self._nvml.nvmlShutdown()
            self._nvml = None

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self._interval_s)
            await self._sample()

    async def _sample(self) -> None:
        # A worker thread: NVML calls are usually sub-millisecond, but power and clock
        # queries can block for tens of ms on some drivers, which the event loop (and
        # every stream's first audio) must not wait for.
        try:
            readings = await asyncio.to_thread(self._read_all)
        except self._nvml.NVMLError as exc:  # e.g. the card fell off the bus: keep the gateway serving
            log.warning("GPU metrics: sampling failed: %s", exc)
            return
        self.metrics.update(readings)

    def _read_all(self) -> list[GpuReading]:
        readings = [read_gpu(self._nvml, index) for index in range(self._count)]
        for reading in readings:
            for name, why in reading.unsupported.items():
                if (reading.index, name) not in self._reported:
                    self._reported.add((reading.index, name))
                    log.info("GPU %d does not report %s (%s); its gauge stays empty", reading.index, name, why)
        return readings
