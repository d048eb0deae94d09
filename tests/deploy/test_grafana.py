"""deploy/: the Grafana dashboard queries only metrics the gateway exposes; prometheus.yml parses."""

from __future__ import annotations

import json
import re

import pytest
import yaml

from websockets.asyncio.client import connect

from tts_gateway.gateway.client import TTSClient
from tts_gateway.gateway.gpu_metrics import GPU_METRIC_NAMES
from tts_gateway.gateway.metrics import ENGINE_METRIC_NAMES

from tests.conftest import until, ws_url
from tests.gateway.test_server import http_get, recv_json
from tests.paths import ROOT

DEPLOY = ROOT / "deploy"

# Exported only where NVML finds a GPU (gateway/gpu_metrics.py), so a CPU gateway here
# cannot show them: the dashboard may use these names and no others of the GPU family.
GPU_METRICS = frozenset(GPU_METRIC_NAMES)

METRIC_NAME = re.compile(r"\btts_[a-zA-Z0-9_]+")


def dashboard_exprs() -> list[str]:
    dashboard = json.loads((DEPLOY / "grafana" / "tts-gateway.json").read_text())
    panels = [p for p in dashboard["panels"] if p["type"] != "row"]
    assert len({p["id"] for p in dashboard["panels"]}) == len(dashboard["panels"])
    return [target["expr"] for panel in panels for target in panel["targets"]]


def exposed_names(text: str) -> set[str]:
    return {re.split(r"[{ ]", line, maxsplit=1)[0] for line in text.splitlines() if line and not line.startswith("#")}


async def test_every_dashboard_metric_is_exposed(gateway):
    async with TTSClient.connect(ws_url(gateway)) as tts:
        await until(tts.context().speak("Counting this one."), 30)
    async with connect(ws_url(gateway)) as ws:  # labelled series appear once they have a sample
        await recv_json(ws)
        await ws.send("{oops")
        assert (await recv_json(ws))["code"] == "bad_message"
    status, body, _ = await http_get(f"http://127.0.0.1:{gateway.port}/metrics")
    assert status == 200
    exposed = exposed_names(body.decode())
    assert {"tts_time_to_first_audio_seconds_bucket", "tts_errors_total", "tts_engine_queue_depth"} <= exposed
    exprs = dashboard_exprs()
    used = set()
    for expr in exprs:
        names = set(METRIC_NAME.findall(expr))
        assert names, f"no tts_ metric in {expr!r}"
        used |= names
    gpu_used = {name for name in used if name.startswith("tts_gpu_")}
    assert gpu_used - GPU_METRICS == set(), "GPU metric names gateway/gpu_metrics.py does not define"
    # The CosyVoice2 stages' series: exported by that engine only (its descriptor names them).
    engine_used = {name for name in used if name.startswith(("tts_llm_", "tts_token2wav_", "tts_first_audio_",
                                                               "tts_late_chunks_"))}
    assert engine_used - ENGINE_METRIC_NAMES == set(), "engine metric names no engine descriptor defines"
    assert used - gpu_used - engine_used - exposed == set(), "unknown metric names in the dashboard"
    assert gpu_used, "the dashboard has no GPU panels"
    assert engine_used, "the dashboard has no CosyVoice2 stage panels"


@pytest.mark.parametrize(
    ("family", "mark"), [(GPU_METRICS, "NVML"), (ENGINE_METRIC_NAMES, "CosyVoice2 engine only")], ids=["gpu", "cosyvoice2"]
)
def test_dashboard_marks_panels_that_only_some_gateways_fill(family, mark):
    dashboard = json.loads((DEPLOY / "grafana" / "tts-gateway.json").read_text())
    for panel in dashboard["panels"]:
        exprs = " ".join(t["expr"] for t in panel.get("targets", []))
        if set(METRIC_NAME.findall(exprs)) & family:
            assert mark in panel["description"], panel["title"]


def test_prometheus_config_scrapes_the_gateway():
    config = yaml.safe_load((DEPLOY / "prometheus.yml").read_text())
    [job] = config["scrape_configs"]
    assert job["metrics_path"] == "/metrics"
    assert job["static_configs"][0]["targets"] == ["127.0.0.1:8765"]
