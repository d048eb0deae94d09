"""bench/soak.py: its growth rule, and a short run against a real Piper gateway."""

from __future__ import annotations

import json

from bench import soak


def flat(n: int, **overrides) -> list[dict[str, float]]:
    base = {"rss_mib": 500.0, "open_fds": 20.0, "loop_tasks": 10.0, "engine_utterances": 1.0, "engine_queue_depth": 0.0}
    return [base | overrides for _ in range(n)]


DRAINED = {"sessions": 0.0, "contexts": 0.0, "engine_utterances": 0.0}


def test_steady_series_pass_and_growing_ones_fail():
    assert soak.verdict(flat(9), DRAINED) == []
    # Resident memory: 10 % of the first third plus 32 MiB is allowed.
    assert soak.verdict(flat(6) + flat(3, rss_mib=580.0), DRAINED) == []
    leaking = soak.verdict(flat(6) + flat(3, rss_mib=600.0), DRAINED)
    assert len(leaking) == 1 and leaking[0].startswith("rss_mib grew")
    assert soak.verdict(flat(6) + flat(3, open_fds=60.0), DRAINED)[0].startswith("open_fds grew")


def test_work_left_after_the_traffic_fails():
    (problem,) = soak.verdict(flat(9), DRAINED | {"contexts": 2.0})
    assert "contexts is 2 after the traffic stopped" in problem


def test_soak_smoke_against_a_piper_gateway(tmp_path, capsys):
    """About 20 s of every scenario against `tts-gateway serve`: samples come in, the scenarios
    run, and everything drains when the traffic stops. (Growth over so short a run is warm-up,
    not a leak; the growth rule is tested above.)"""
    out = tmp_path / "soak.json"
    code = soak.main(["--warmup", "4", "--duration", "16", "--interval", "2", "--workers", "3", "--settle", "3",
                      "--seed", "1", "--json", str(out)])
    report = json.loads(out.read_text())
    assert code == (0 if report["passed"] else 1)
    assert len(report["samples"]) >= 6
    assert all(sample["rss_mib"] > 0 and sample["open_fds"] > 0 and "loop_tasks" in sample for sample in report["samples"])
    assert report["scenarios"]["conversation"]["ok"] > 0
    assert sum(s["ok"] + s["failed"] for s in report["scenarios"].values()) >= 10
    assert not [problem for problem in report["problems"] if "after the traffic stopped" in problem]
    assert report["final"]["engine_utterances"] == 0
