"""The load generator (`tts-gateway bench`) against a real gateway on the Piper voice.

These check that the tool works (records, summary, files), not how fast the machine is.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

import gateway.loadgen as loadgen
from tests.conftest import ws_url

SUMMARY_KEYS = {"contexts", "outcomes", "ttfa_ms", "stall_free_fraction", "stalls", "stall_ms", "rtf_p50",
                "audio_s", "errors", "errors_by_code"}


def test_corpus_loads_with_line_breaks():
    english, chinese = loadgen.load_corpus("en"), loadgen.load_corpus("zh")
    assert len(english) >= 25 and len(chinese) >= 15
    assert any("\n- " in reply for reply in english)  # markdown lists survive the one-line-per-reply file
    assert len(loadgen.load_corpus("mix")) == len(english) + len(chinese)


async def test_llm_run_writes_json_markdown_and_plots(gateway, tmp_path):
    result = await loadgen.run(
        ws_url(gateway), sessions=2, workload="llm", duration=6, json_path=tmp_path / "out.json",
        markdown=tmp_path / "out.md", plots=tmp_path / "plots",
    )
    records = result["records"]
    assert records and {r["agent"] for r in records} == {0, 1}
    assert all(r["ttfa_ms"] > 0 for r in records if r["ttfa_ms"] is not None)
    assert any(r["outcome"] == "done" and r["rtf"] > 0 and r["audio_ms"] > 0 for r in records)
    assert SUMMARY_KEYS <= result["summary"].keys()
    assert result["summary"]["errors"] == 0
    assert {"p50", "p95", "p99"} <= result["summary"]["ttfa_ms"].keys()
    assert json.loads((tmp_path / "out.json").read_text())["config"]["workload"] == "llm"
    assert "| sessions |" in (tmp_path / "out.md").read_text()
    pngs = sorted(p.name for p in (tmp_path / "plots").glob("*.png"))
    assert pngs == ["stall_free_llm.png", "ttfa_llm.png"]
    assert all((tmp_path / "plots" / name).read_bytes()[:4] == b"\x89PNG" for name in pngs)


@pytest.mark.parametrize("workload", ["barge-in", "full-barge-in"])
async def test_barge_in_cancels(gateway, workload):
    result = await loadgen.run(ws_url(gateway), sessions=2, workload=workload, duration=5, seed=1)
    assert result["summary"]["outcomes"].get("cancelled", 0) >= 1
    assert result["summary"]["errors"] == 0
    assert result["summary"]["ttfa_ms"]["n"] >= 2


async def test_ramp_reports_a_capacity(gateway):
    result = await loadgen.run(ws_url(gateway), ramp=[1, 2], workload="full", duration=3)
    assert [level["sessions"] for level in result["levels"]] == [1, 2]
    assert result["stall_free_capacity"] in (1, 2, None)
    assert {r["sessions"] for r in result["records"]} == {1, 2}


async def test_start_spread_staggers_each_agents_first_turn(gateway):
    """Each agent's first turn starts at its seeded moment within the spread, not all at once."""
    import random

    spread, sessions = 2.0, 3
    result = await loadgen.run(ws_url(gateway), sessions=sessions, workload="full", duration=4, seed=5,
                               start_spread=spread)
    assert result["config"]["start_spread_s"] == spread
    for agent in range(sessions):
        planned = random.Random(f"5-{sessions}-{agent}").uniform(0, spread)
        first = min(r["started_s"] for r in result["records"] if r["agent"] == agent)
        assert planned <= first < planned + 1.0  # + connecting
    assert max(min(r["started_s"] for r in result["records"] if r["agent"] == a) for a in range(sessions)) > 0.5


async def test_start_spread_must_fit_the_level():
    for bad in (-1.0, 4.0):
        with pytest.raises(ValueError, match="start_spread"):
            await loadgen.run("ws://127.0.0.1:9/v1/stream", duration=4, start_spread=bad)
        with pytest.raises(SystemExit) as exit_info:  # the CLI says so as a usage error
            loadgen.main(["--url", "ws://127.0.0.1:9/v1/stream", "--duration", "4", "--start-spread", str(bad)])
        assert exit_info.value.code == 2


def test_bench_help():
    result = subprocess.run([sys.executable, "-m", "gateway", "bench", "--help"],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert "--workload" in result.stdout and "--ramp" in result.stdout
