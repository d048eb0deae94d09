"""The load generator (`tts-gateway bench`) against a real gateway on the Piper voice.

These check that the tool works (records, summary, files), not how fast the machine is.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

import tts_gateway.gateway.loadgen as loadgen
from tests.conftest import ws_url

SUMMARY_KEYS = {"contexts", "outcomes", "ttfa_ms", "stall_free_fraction", "stalls", "stall_ms", "rtf_p50",
                "audio_s", "errors", "errors_by_code", "stalls_by_audio_s", "slack_ms_by_chunk", "words_timed"}


def test_a_stall_is_placed_by_the_audio_before_it():
    """The playback clock counts a chunk that arrives after the audio ran out as a stall, and
    records how much of the reply had been received before it (which chunk was late)."""
    record = loadgen.Record(1, 0, "full", 10)
    playback = loadgen.Playback()
    for now, duration_ms in ((0.0, 240), (0.1, 1000), (1.5, 2000), (5.0, 500)):
        playback.add(now, duration_ms, record)
        record.audio_ms += duration_ms
    # Out at 0.24 s (second chunk in time), 1.24 s (third 0.26 s late), 3.5 s (fourth 1.5 s late).
    assert record.stalls == 2 and record.stall_ms == pytest.approx(260 + 1500)
    assert record.stall_audio_ms == [1240.0, 3240.0]
    assert loadgen.summarize([record])["stalls_by_audio_s"] == {"0-0.5": 0, "0.5-1.5": 1, "1.5-3.5": 1,
                                                                 "3.5-7.5": 0, "7.5+": 0}


def test_each_later_chunk_records_the_audio_still_buffered_when_it_arrived():
    """Slack: how much audio the listener still had when a chunk arrived (negative: waited),
    summarised by the chunk's place in its reply, chunks 5 and later together."""
    records = []
    for arrivals in (((0.0, 240), (0.1, 1000), (1.5, 2000), (5.0, 500), (5.2, 500)), ((0.0, 240), (0.2, 400))):
        record = loadgen.Record(1, 0, "full", 10)
        playback = loadgen.Playback()
        for now, duration_ms in arrivals:
            playback.add(now, duration_ms, record)
        records.append(record)
    assert records[0].slack_ms == [140.0, -260.0, -1500.0, 300.0] and records[1].slack_ms == [40.0]
    assert loadgen.summarize(records)["slack_ms_by_chunk"] == {
        "2": {"p5": 45.0, "p50": 90.0, "n": 2}, "3": {"p5": -260.0, "p50": -260.0, "n": 1},
        "4": {"p5": -1500.0, "p50": -1500.0, "n": 1}, "5+": {"p5": 300.0, "p50": 300.0, "n": 1},
    }


def test_a_level_is_at_capacity_with_its_first_audio_p95_at_the_limit_itself():
    def summary(p95, stalls=0, errors=0):
        return {"ttfa_ms": {"p95": p95}, "stalls": stalls, "errors": errors}

    assert loadgen.stall_free(summary(400.0), 400.0) and loadgen.stall_free(summary(120.0), 400.0)
    assert not loadgen.stall_free(summary(400.1), 400.0)
    assert not loadgen.stall_free(summary(120.0, stalls=1), 400.0)
    assert not loadgen.stall_free(summary(120.0, errors=1), 400.0)
    assert not loadgen.stall_free(summary(None), 400.0)  # a level with no first audio at all


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
    assert result["summary"]["words_timed"] > 0  # the Piper voice times its words
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


async def test_sessions_can_ask_for_no_word_timings(gateway):
    result = await loadgen.run(ws_url(gateway), sessions=1, workload="full", duration=3, word_timings=False)
    assert result["summary"]["ttfa_ms"]["n"] >= 1 and result["summary"]["words_timed"] == 0
    assert result["config"]["word_timings"] is False


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


async def test_next_turn_waits_until_the_reply_is_heard_and_the_user_has_spoken(gateway, tmp_path):
    """Paced turns: an agent's next reply starts only after its listener has heard the last one
    (first audio + its duration) and the user's turn; back to back, it starts at ``done``."""
    corpus = tmp_path / "short.txt"
    corpus.write_text("Hello there, how are you today?\nSure, I can help with that.\n")
    gap = 0.7
    paced = await loadgen.run(ws_url(gateway), sessions=2, workload="full", duration=6, corpus=corpus,
                              turn_gap=(gap, gap))
    eager = await loadgen.run(ws_url(gateway), sessions=2, workload="full", duration=4, corpus=corpus,
                              turn_gap=None)
    assert paced["config"]["turn_gap_s"] == [gap, gap] and eager["config"]["turn_gap_s"] is None

    def turns(result):
        for agent in (0, 1):
            records = [r for r in result["records"] if r["agent"] == agent]
            yield from zip(records, records[1:])

    paced_turns, eager_turns = list(turns(paced)), list(turns(eager))
    assert paced_turns and eager_turns
    for last, following in paced_turns:
        heard = last["started_s"] + (last["ttfa_ms"] + last["audio_ms"] + last["stall_ms"]) / 1000
        assert following["started_s"] >= heard + gap - 0.01
    # Piper speaks much faster than real time: back to back, each next reply starts long
    # before the listener could have heard the last one.
    assert all(following["started_s"] < last["started_s"] + last["audio_ms"] / 1000 for last, following in eager_turns)


async def test_turn_gap_is_checked():
    for bad in ((-1.0, 2.0), (3.0, 1.0)):
        with pytest.raises(ValueError, match="turn gap"):
            await loadgen.run("ws://127.0.0.1:9/v1/stream", duration=4, turn_gap=bad)
    with pytest.raises(SystemExit) as exit_info:
        loadgen.main(["--url", "ws://127.0.0.1:9/v1/stream", "--turn-gap", "2,1"])
    assert exit_info.value.code == 2
    assert loadgen.parse_turn_gap("1.5") == (1.5, 1.5)


async def test_start_spread_must_fit_the_level():
    for bad in (-1.0, 4.0):
        with pytest.raises(ValueError, match="start_spread"):
            await loadgen.run("ws://127.0.0.1:9/v1/stream", duration=4, start_spread=bad)
        with pytest.raises(SystemExit) as exit_info:  # the CLI says so as a usage error
            loadgen.main(["--url", "ws://127.0.0.1:9/v1/stream", "--duration", "4", "--start-spread", str(bad)])
        assert exit_info.value.code == 2


def test_bench_help():
    result = subprocess.run([sys.executable, "-m", "tts_gateway.gateway", "bench", "--help"],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert "--workload" in result.stdout and "--ramp" in result.stdout
