"""GET /v1/stats: rolling windows fed by the same observations as /metrics."""

from __future__ import annotations

import orjson
import pytest

from tts_gateway.gateway.client import TTSClient
from tts_gateway.gateway.stats import MAX_WINDOW_S, RollingStats

from tests.conftest import make_config, running_gateway, until, ws_url
from tests.gateway.test_server import http_get


async def test_stats_report_a_spoken_context(gateway):
    async with TTSClient.connect(ws_url(gateway)) as tts:
        await until(tts.context().speak("Counting this one."), 30)
    status, body, content_type = await http_get(f"http://127.0.0.1:{gateway.port}/v1/stats?window=30")
    stats = orjson.loads(body)
    assert status == 200 and content_type == "application/json"
    assert stats["window_s"] == 30 and stats["gpu"] is None
    series = stats["series"]
    assert len(series["t"]) == 30 and series["t"][-1] == int(stats["now"])
    assert all(len(values) == 30 for values in series.values())
    assert [x for x in series["ttfa_p50_ms"] if x is not None], "the context's TTFA is in the series"
    current = stats["current"]
    assert current["ttfa_count"] == 1 and 0 < current["ttfa_p50_ms"] == current["ttfa_p95_ms"] < 5000
    assert 0.5 < current["audio_s"] < 3.0
    assert sum(series["audio_s_per_s"]) == pytest.approx(current["audio_s"], abs=0.01)
    assert current["contexts_by_outcome"] == {"done": 1}
    assert (current["sessions"], current["contexts"], current["engine_queue_depth"]) == (0, 0, 0)
    # The same observation as Prometheus's histogram.
    assert gateway.metrics.registry.get_sample_value("tts_time_to_first_audio_seconds_count") == 1


@pytest.mark.parametrize("window", ["0", "-5", "abc", "1.5", str(MAX_WINDOW_S + 1)])
async def test_bad_window_is_400(gateway, window):
    status, body, _ = await http_get(f"http://127.0.0.1:{gateway.port}/v1/stats?window={window}")
    assert status == 400 and orjson.loads(body)["error"]["code"] == "bad_request"


async def test_default_window_and_errors_by_code(gateway):
    await http_get(f"http://127.0.0.1:{gateway.port}/v1/stats?window=0")  # not an error the gateway counts
    gateway.metrics.error("unknown_voice")
    stats = orjson.loads((await http_get(f"http://127.0.0.1:{gateway.port}/v1/stats"))[1])
    assert stats["window_s"] == 60 and stats["current"]["errors_by_code"] == {"unknown_voice": 1}
    assert sum(stats["series"]["errors"]) == 1


async def test_stats_need_the_api_key(piper_engine):
    async with running_gateway(make_config(auth={"api_keys": ("k-secret",)}), piper_engine) as gw:
        base = f"http://127.0.0.1:{gw.port}/v1/stats"
        assert (await http_get(base))[0] == 401
        assert (await http_get(base + "?api_key=wrong"))[0] == 401
        assert (await http_get(base, {"Authorization": "Bearer k-secret"}))[0] == 200
        assert (await http_get(base + "?api_key=k-secret&window=5"))[0] == 200


def test_rolling_windows_forget_old_seconds():
    now = [1000.0]
    rolling = RollingStats(clock=lambda: now[0])
    for ttfa in (0.1, 0.2, 0.3, 0.4):
        rolling.ttfa(ttfa)
    rolling.audio_sent(1.5)
    now[0] += 10
    rolling.ttfa(1.0)
    window = rolling.window(5)
    assert window["totals"]["ttfa_count"] == 1 and window["totals"]["audio_s"] == 0
    window = rolling.window(20)
    assert window["totals"]["ttfa_count"] == 5 and window["totals"]["ttfa_p50_ms"] == 300.0
    assert window["series"]["ttfa_p95_ms"][-11] == 400.0 and window["series"]["audio_s_per_s"][-11] == 1.5
    now[0] += MAX_WINDOW_S + 10
    rolling.audio_sent(0.1)
    assert len(rolling._seconds) <= MAX_WINDOW_S
    assert rolling.window(MAX_WINDOW_S)["totals"]["ttfa_count"] == 0


async def test_dashboard_page_is_served(gateway):
    base = f"http://127.0.0.1:{gateway.port}"
    status, body, content_type = await http_get(base + "/dashboard")
    assert status == 200 and content_type.startswith("text/html") and b"dashboard.js" in body
    status, body, content_type = await http_get(base + "/dashboard.js")
    assert status == 200 and "javascript" in content_type and b"/v1/stats" in body and b"dashboardState" in body
    assert (await http_get(base + "/"))[0] == 200
