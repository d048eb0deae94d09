"""GPU gauges from NVML, with a fake pynvml module: names, base units, throttle labels, and a no-op without NVML."""

from __future__ import annotations

import asyncio
import logging
import sys
import types
from types import SimpleNamespace

import orjson
import pytest

from tts_gateway.engine.base import EngineStats
from tts_gateway.gateway.gpu_metrics import GPU_METRIC_NAMES, THROTTLE_REASONS, GpuSampler
from tts_gateway.gateway.metrics import Metrics

from tests.conftest import make_config, running_gateway
from tests.gateway.test_server import http_get

MIB = 1024**2


class FakeNVMLError(Exception):
    pass


def fake_pynvml(*, gpus: int = 1, event_reasons: int = 0x20 | 0x4, unsupported: tuple[str, ...] = (),
                old_bindings: bool = False, init_error: bool = False) -> types.ModuleType:
    """A pynvml stand-in: GPU i is 42 % busy (+10 % per index), 1980 MHz SM, 350.5 W, 71 C (+5 per index)."""
    nvml = types.ModuleType("pynvml")
    nvml.calls = []
    nvml.NVMLError = FakeNVMLError
    nvml.NVML_TEMPERATURE_GPU = 0
    nvml.NVML_CLOCK_SM, nvml.NVML_CLOCK_MEM = 1, 2

    def maybe_unsupported(name):
        if name in unsupported:
            raise FakeNVMLError("Not Supported")

    def init():
        if init_error:
            raise FakeNVMLError("Driver Not Loaded")
        nvml.calls.append("init")

    def power(handle):
        maybe_unsupported("power")
        return 350_500  # mW

    nvml.nvmlInit = init
    nvml.nvmlShutdown = lambda: nvml.calls.append("shutdown")
    nvml.nvmlDeviceGetCount = lambda: gpus
    nvml.nvmlDeviceGetHandleByIndex = lambda index: index
    nvml.nvmlDeviceGetUtilizationRates = lambda h: SimpleNamespace(gpu=42 + 10 * h, memory=30)
    nvml.nvmlDeviceGetMemoryInfo = lambda h: SimpleNamespace(used=20_000 * MIB, total=141_000 * MIB, free=0)
    nvml.nvmlDeviceGetTemperature = lambda h, sensor: 71 + 5 * h if sensor == 0 else -1
    nvml.nvmlDeviceGetClockInfo = lambda h, clock: {1: 1980, 2: 2619}[clock]  # MHz
    nvml.nvmlDeviceGetPowerUsage = power
    if old_bindings:
        nvml.nvmlDeviceGetCurrentClocksThrottleReasons = lambda h: event_reasons
    else:
        nvml.nvmlDeviceGetCurrentClocksEventReasons = lambda h: event_reasons
    return nvml


def new_metrics() -> Metrics:
    return Metrics("fake", lambda: EngineStats())


async def test_gauges_carry_base_units_and_throttle_reasons(monkeypatch):
    nvml = fake_pynvml()
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    metrics = new_metrics()
    await metrics.gpu.start()
    try:
        value = metrics.registry.get_sample_value
        gpu0 = {"gpu": "0"}
        assert value("tts_gpu_utilization_ratio", gpu0) == pytest.approx(0.42)
        assert value("tts_gpu_memory_used_bytes", gpu0) == 20_000 * MIB
        assert value("tts_gpu_memory_total_bytes", gpu0) == 141_000 * MIB
        assert value("tts_gpu_temperature_celsius", gpu0) == 71
        assert value("tts_gpu_sm_clock_hertz", gpu0) == 1980e6
        assert value("tts_gpu_memory_clock_hertz", gpu0) == 2619e6
        assert value("tts_gpu_power_watts", gpu0) == pytest.approx(350.5)
        throttled = {r: value("tts_gpu_throttled", {"gpu": "0", "reason": r}) for r in THROTTLE_REASONS}
        assert throttled == {r: 1.0 if r in ("sw_thermal", "sw_power_cap") else 0.0 for r in THROTTLE_REASONS}
        text = metrics.render().decode()
        for name in GPU_METRIC_NAMES:
            assert f"# TYPE {name} gauge" in text
        assert 'tts_gpu_throttled{gpu="0",reason="hw_slowdown"} 0.0' in text
    finally:
        await metrics.gpu.stop()
    assert nvml.calls == ["init", "shutdown"]


async def test_the_sampler_follows_the_card(monkeypatch):
    nvml = fake_pynvml(event_reasons=0)
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    metrics = new_metrics()
    metrics.gpu = GpuSampler(metrics.registry, interval_s=0.01)
    await metrics.gpu.start()
    try:
        assert metrics.registry.get_sample_value("tts_gpu_throttled", {"gpu": "0", "reason": "hw_thermal"}) == 0
        nvml.nvmlDeviceGetCurrentClocksEventReasons = lambda h: 0x40  # the card got hot
        nvml.nvmlDeviceGetTemperature = lambda h, sensor: 91
        for _ in range(200):
            if metrics.registry.get_sample_value("tts_gpu_temperature_celsius", {"gpu": "0"}) == 91:
                break
            await asyncio.sleep(0.01)
        assert metrics.registry.get_sample_value("tts_gpu_throttled", {"gpu": "0", "reason": "hw_thermal"}) == 1
    finally:
        await metrics.gpu.stop()


async def test_old_bindings_and_unsupported_fields(monkeypatch, caplog):
    nvml = fake_pynvml(old_bindings=True, event_reasons=0x8, unsupported=("power",))
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    metrics = new_metrics()
    with caplog.at_level(logging.INFO, logger="tts_gateway.gpu"):
        await metrics.gpu.start()
        await metrics.gpu.stop()
    value = metrics.registry.get_sample_value
    assert value("tts_gpu_throttled", {"gpu": "0", "reason": "hw_slowdown"}) == 1
    assert value("tts_gpu_power_watts", {"gpu": "0"}) is None  # not reported: no made-up zero
    assert value("tts_gpu_sm_clock_hertz", {"gpu": "0"}) == 1980e6
    assert "GPU 0 does not report power_watts (Not Supported)" in caplog.text


async def test_stats_summarise_all_gpus(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml(gpus=2, event_reasons=0x4))
    metrics = new_metrics()
    assert metrics.stats(10)["gpu"] is None
    await metrics.gpu.start()
    await metrics.gpu.stop()
    gpu = metrics.stats(10)["gpu"]
    assert gpu["gpus"] == 2
    assert gpu["gpu_utilization_ratio"] == pytest.approx(0.47)  # mean of 42 % and 52 %
    assert gpu["gpu_memory_used_bytes"] == 2 * 20_000 * MIB
    assert gpu["gpu_memory_total_bytes"] == 2 * 141_000 * MIB
    assert gpu["gpu_temperature_celsius"] == 76  # the hotter card
    assert gpu["gpu_power_watts"] == pytest.approx(701.0)
    assert gpu["gpu_throttled"] == ["sw_power_cap"]
    assert metrics.registry.get_sample_value("tts_gpu_temperature_celsius", {"gpu": "1"}) == 76


@pytest.mark.parametrize("pynvml", [None, fake_pynvml(init_error=True), fake_pynvml(gpus=0)],
                         ids=["not installed", "no driver", "no gpu"])
async def test_without_nvml_or_a_gpu_the_sampler_is_a_no_op(monkeypatch, caplog, pynvml):
    monkeypatch.setitem(sys.modules, "pynvml", pynvml)  # None: `import pynvml` raises ImportError
    metrics = new_metrics()
    with caplog.at_level(logging.INFO, logger="tts_gateway.gpu"):
        await metrics.gpu.start()
        await metrics.gpu.stop()
    assert not metrics.gpu.running and metrics.gpu.metrics is None
    assert "tts_gpu_" not in metrics.render().decode()
    assert metrics.stats(10)["gpu"] is None
    [record] = [r for r in caplog.records if r.name == "tts_gateway.gpu"]  # said once
    assert record.levelno == logging.INFO and "GPU metrics off" in record.message


async def test_a_gateway_serves_the_gpu_metrics(monkeypatch, piper_engine):
    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml())
    async with running_gateway(make_config(), piper_engine) as gateway:
        status, body, _ = await http_get(f"http://127.0.0.1:{gateway.port}/metrics")
        assert status == 200
        assert 'tts_gpu_power_watts{gpu="0"} 350.5' in body.decode()
        status, body, _ = await http_get(f"http://127.0.0.1:{gateway.port}/v1/stats")
        assert orjson.loads(body)["gpu"]["gpu_throttled"] == ["sw_power_cap", "sw_thermal"]
