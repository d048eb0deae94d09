"""What a run found: per-level summaries, the stall-free test, a Markdown table and charts."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from tts_gateway.gateway.loadgen.agents import WHOLE_REPLY_WORKLOADS, Record


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    rank = q / 100 * (len(ordered) - 1)  # linear interpolation between closest ranks
    low = int(rank)
    high = min(low + 1, len(ordered) - 1)
    return round(ordered[low] + (ordered[high] - ordered[low]) * (rank - low), 1)


def p50_p95(values: list[float]) -> dict | None:
    """How many values, their median and 95th percentile (None: no value)."""
    return {"n": len(values), "p50": percentile(values, 50), "p95": percentile(values, 95)} if values else None


# Bins of stalls by the reply's audio before them (seconds). With the GPU engine's 10-token
# first chunk (0.4 s) and hops of 1, 2, 4 and 8 s, the bins are about its 2nd, 3rd, 4th, 5th
# and later chunks.
STALL_AUDIO_BINS_S = (0.5, 1.5, 3.5, 7.5)


def stalls_by_audio_s(records: list[Record]) -> dict[str, int]:
    """Stalls counted by how much of its reply the listener had received before each."""
    edges = (0.0, *STALL_AUDIO_BINS_S)
    labels = [f"{low:g}-{high:g}" for low, high in zip(edges, edges[1:])] + [f"{edges[-1]:g}+"]
    counts = dict.fromkeys(labels, 0)
    for record in records:
        for audio_ms in record.stall_audio_ms:
            counts[labels[sum(audio_ms / 1000 >= edge for edge in STALL_AUDIO_BINS_S)]] += 1
    return counts


SLACK_CHUNKS = 4  # slack_ms_by_chunk: chunks 2, 3 and 4 each, then 5 and later together


def slack_ms_by_chunk(records: list[Record]) -> dict[str, dict]:
    """The audio still buffered when each chunk arrived (``Record.slack_ms``), by the chunk's
    place in its reply: p5 and p50 in ms, and how many chunks."""
    by_chunk: dict[str, list[float]] = {}
    for record in records:
        for index, slack in enumerate(record.slack_ms, start=2):
            key = str(index) if index <= SLACK_CHUNKS else f"{SLACK_CHUNKS + 1}+"
            by_chunk.setdefault(key, []).append(slack)
    return {key: {"p5": percentile(values, 5), "p50": percentile(values, 50), "n": len(values)}
            for key, values in sorted(by_chunk.items())}


def summarize(records: list[Record]) -> dict:
    spoken = [r for r in records if r.ttfa_ms is not None]
    ttfa = [r.ttfa_ms for r in spoken]
    rtf = [r.rtf for r in records if r.rtf is not None]
    errors: dict[str, int] = {}
    for r in records:
        if r.outcome == "error":
            errors[r.error_code or "unknown"] = errors.get(r.error_code or "unknown", 0) + 1
    outcomes: dict[str, int] = {}
    for r in records:
        outcomes[r.outcome] = outcomes.get(r.outcome, 0) + 1
    return {
        "contexts": len(records),
        "outcomes": outcomes,
        "no_audio": len(records) - len(spoken),  # contexts whose listener heard nothing (errors included)
        "truncated": outcomes.get("truncated", 0),  # still running when the level's time was up
        "ttfa_ms": {"p50": percentile(ttfa, 50), "p95": percentile(ttfa, 95), "p99": percentile(ttfa, 99),
                    "n": len(ttfa)},
        "stall_free_fraction": round(sum(r.stalls == 0 for r in spoken) / len(spoken), 3) if spoken else None,
        "stalls": sum(r.stalls for r in records),
        "stall_ms": round(sum(r.stall_ms for r in records), 1),
        "stalls_by_audio_s": stalls_by_audio_s(records),
        "slack_ms_by_chunk": slack_ms_by_chunk(records),
        "rtf_p50": None if not rtf else round(sorted(rtf)[len(rtf) // 2], 3),
        "audio_s": round(sum(r.audio_ms for r in records) / 1000, 2),
        "words_timed": sum(r.words for r in records),
        "errors": sum(errors.values()),
        "errors_by_code": errors,
    }


def ramp_result(config: dict, levels: list[tuple[int, list[Record]]], ttfa_p95_ms: float) -> dict:
    """The result of a run: ``config``, each level's summary (``levels``: (sessions, its
    records) in the order run), the last level's summary, the stall-free capacity and every
    record. The one shape `tts-gateway bench` and bench/official_baseline.py write."""
    summaries = [{"sessions": sessions, "summary": summarize(records)} for sessions, records in levels]
    passing = [level["sessions"] for level in summaries if stall_free(level["summary"], ttfa_p95_ms)]
    return {
        "config": config,
        "summary": summaries[-1]["summary"],
        "levels": summaries,
        "stall_free_capacity": max(passing) if passing else None,
        "records": [dataclasses.asdict(record) for _, records in levels for record in records],
    }


def stall_free(summary: dict, ttfa_p95_ms: float) -> bool:
    """A level at capacity: no stall, no error, first audio p95 within the limit (the limit included,
    as the capacity targets are written)."""
    p95 = summary["ttfa_ms"]["p95"]
    return summary["stalls"] == 0 and summary["errors"] == 0 and p95 is not None and p95 <= ttfa_p95_ms


def markdown_table(result: dict) -> str:
    cfg = result["config"]
    rate = f" at {cfg['tokens_per_second']:g} tokens/s" if cfg["workload"] not in WHOLE_REPLY_WORKLOADS else ""
    lines = [
        f"Workload `{cfg['workload']}`{rate}, {cfg['duration_s']:g} s per level, corpus {cfg['corpus']}.",
        "",
        "| sessions | contexts | TTFA p50 ms | TTFA p95 ms | TTFA p99 ms | stall-free | stalls | stall ms "
        "| RTF p50 | audio s | errors |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for level in result["levels"]:
        s = level["summary"]
        t = s["ttfa_ms"]
        free = "–" if s["stall_free_fraction"] is None else f"{s['stall_free_fraction']:.0%}"
        lines.append(f"| {level['sessions']} | {s['contexts']} | {t['p50']} | {t['p95']} | {t['p99']} | {free} "
                     f"| {s['stalls']} | {s['stall_ms']} | {s['rtf_p50']} | {s['audio_s']} | {s['errors']} |")
    capacity = result["stall_free_capacity"]
    lines += ["", f"Stall-free capacity (no stalls, no errors, TTFA p95 <= {cfg['ttfa_p95_ms_limit']:g} ms): "
              + (f"{capacity} sessions." if capacity else "none of the levels run."), ""]
    return "\n".join(lines)


def write_plots(result: dict, directory: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    directory.mkdir(parents=True, exist_ok=True)
    levels = [lv["sessions"] for lv in result["levels"]]
    workload = result["config"]["workload"]
    ttfa = [[r["ttfa_ms"] for r in result["records"] if r["sessions"] == n and r["ttfa_ms"] is not None]
            for n in levels]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.boxplot([values or [float("nan")] for values in ttfa])
    ax.set_xticks(range(1, len(levels) + 1), [str(n) for n in levels])
    ax.set(xlabel="concurrent sessions", ylabel="TTFA (ms, client)", title=f"TTFA per concurrency ({workload})")
    fig.tight_layout()
    paths = [directory / f"ttfa_{workload}.png"]
    fig.savefig(paths[0], dpi=100)
    plt.close(fig)
    fractions = [lv["summary"]["stall_free_fraction"] for lv in result["levels"]]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(levels, [f if f is not None else float("nan") for f in fractions], marker="o")
    ax.set(xlabel="concurrent sessions", ylabel="stall-free contexts (fraction)", ylim=(0, 1.05),
           title=f"Stall-free fraction vs concurrency ({workload})")
    fig.tight_layout()
    paths.append(directory / f"stall_free_{workload}.png")
    fig.savefig(paths[1], dpi=100)
    plt.close(fig)
    return paths
