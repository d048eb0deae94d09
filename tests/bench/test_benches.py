"""The benchmarks' CPU paths run (smoke tests): each script measures, reports JSON and puts
back what it changed. Their numbers come from the GPU (docs/benchmarks.md)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from bench import encoder_graphs as bench_encoder_graphs
from bench import estimator_ops as bench_estimator_ops
from bench import flow_graphs as bench_flow_graphs
from bench import flow_profile as bench_flow_profile
from bench import gpu_sharing as bench_gpu_sharing
from bench import launch_waits as bench_launch_waits
from bench import sdpa_choice as bench_sdpa_choice
from bench import token2wav_chunk_cost as bench_token2wav_chunk_cost
from bench import word_timings_cost as bench_word_timings_cost


def test_bench_flow_graphs_smoke_cpu(tmp_path, capsys) -> None:
    """bench/flow_graphs.py runs on CPU (tiny model, bf16 vs float32), skipping graphs with a note."""
    out = tmp_path / "flow_graphs.json"
    report = bench_flow_graphs.main(
        ["--size", "tiny", "--device", "cpu", "--dtype", "bfloat16", "--batches", "1,3,4", "--frames", "60",
         "--repeats", "1", "--json", str(out)]
    )
    assert bench_flow_graphs.NO_CUDA_NOTE in capsys.readouterr().out
    assert json.loads(out.read_text()) == report
    assert report["note"] == bench_flow_graphs.NO_CUDA_NOTE
    assert [row["batch"] for row in report["results"]] == [1, 3, 4]
    for row in report["results"]:
        assert "graph_ms" not in row
        assert row["eager_ms"] > 0
        assert row["bucket"] == [1 if row["batch"] == 1 else 4, 100]  # batch buckets 1, 2, 4
        assert row["fp32_max_abs"] > 0.1
        assert 0 < row["eager_vs_fp32_rel"] < 0.1  # bf16 rounding, not a broken solve
        # padding changes matmul shapes, hence bf16 rounding: small, but not necessarily 0
        assert row["padded_eager_vs_eager_max_abs"] < 0.1 * row["fp32_max_abs"]


def test_bench_encoder_graphs_smoke_cpu(tmp_path, capsys) -> None:
    """bench/encoder_graphs.py runs on CPU (tiny model, float32): the graphs' programs, run
    eagerly on their padded buffers, give the eager encoders' mu, the lane's and every paged
    step's (all of them served by a program)."""
    out = tmp_path / "encoder_graphs.json"
    report = bench_encoder_graphs.main(
        ["--size", "tiny", "--device", "cpu", "--dtype", "float32", "--batches", "1,3", "--turns", "3",
         "--feeds", "103,25,50", "--repeats", "1", "--json", str(out)]
    )
    assert bench_encoder_graphs.NO_CUDA_NOTE in capsys.readouterr().out
    assert json.loads(out.read_text()) == report
    assert report["lane"]["widths"] == [100, 125] and report["lane"]["graphs"] == 8
    assert [row["batch"] for row in report["lane"]["batches"]] == [1, 3]
    assert [step["cached_tokens"] for step in report["paged"]["steps"]] == [0, 100, 125]
    for row in (*report["lane"]["batches"], *report["paged"]["steps"]):
        assert row["graph_vs_eager_max_abs"] <= 1e-5 * row["mu_max_abs"] and row["mu_max_abs"] > 0.1
        assert row["eager_ms"] > 0 and row["graph_ms"] > 0
    assert all(step["by_graph"] for step in report["paged"]["steps"])


def test_bench_launch_waits_smoke_cpu(tmp_path) -> None:
    """One turn, then two, streamed through a paged runner to their ends, a launch per chunk (a
    CPU has no waits to find nor a GPU clock to read: a smoke test of the script)."""
    out = tmp_path / "waits.json"
    mels = tmp_path / "mels.npz"
    report = bench_launch_waits.main(
        ["--size", "tiny", "--device", "cpu", "--rows", "1,2", "--json", str(out), "--mels", str(mels)]
    )
    assert json.loads(out.read_text()) == report
    assert [call["rows"] for call in report["calls"]] == sorted(call["rows"] for call in report["calls"])
    assert {call["rows"] for call in report["calls"]} == {1, 2} and len(report["calls"]) >= 8
    assert all(call["gpu_ms"] == {} for call in report["calls"])  # no GPU clock here
    assert all(call["padded_row_frames"] >= call["row_frames"] > 0 for call in report["calls"])
    assert report["launches_that_waited"] == 0
    assert report["decoder_cost"] is None  # nothing timed on a CPU to fit
    sizes = [50, 800, 1920]
    calls = [{"padded_row_frames": n, "gpu_ms": {"decoder": 70 + 0.065 * n}} for n in sizes]
    calls.append({"padded_row_frames": 0, "gpu_ms": {"vocoder": 9.0}})  # no decoder: not fitted
    assert bench_launch_waits.decoder_cost(calls) == {"calls": 3, "ms_per_call": 70.0, "us_per_row_frame": 65.0}
    with np.load(mels) as saved:
        turns = [saved[name] for name in saved.files]
    # One turn, then two; each turn's mel is all its chunks' (400 tokens and more, 2 frames each).
    assert len(turns) == 3 and all(turn.shape[0] == 80 and turn.shape[1] >= 800 for turn in turns)
    again = tmp_path / "again.npz"  # the same options again: the same mels
    bench_launch_waits.main(["--size", "tiny", "--device", "cpu", "--rows", "1,2", "--mels", str(again)])
    assert bench_launch_waits.compare_mels(mels, again) == {"turns": 3, "relative_rms": 0.0, "max_abs": 0.0}
    louder = tmp_path / "louder.npz"
    np.savez(louder, *[turn * 1.01 for turn in turns])
    apart = bench_launch_waits.compare_mels(mels, louder)
    assert apart["relative_rms"] == pytest.approx(0.01, rel=1e-3) and apart["max_abs"] > 0
    np.savez(louder, *turns[:2])
    with pytest.raises(ValueError, match="different turns"):
        bench_launch_waits.compare_mels(mels, louder)


def test_bench_flow_profile_smoke_cpu(tmp_path) -> None:
    """bench/flow_profile.py runs on CPU; the decoder's bias gives the boolean mask's mel exactly,
    the fused norms run the plain torch ops on a CPU (the same mel again), and the script puts the
    decoder back as it was."""
    from tts_gateway.engine.cosyvoice2.model import estimator, fused_kernels

    shipped, switched = estimator.attention_bias, fused_kernels.enabled
    out = tmp_path / "profile.json"
    report = bench_flow_profile.main(
        ["--size", "tiny", "--device", "cpu", "--shapes", "2x60", "--variants", "bool,bias,fused", "--repeats", "1",
         "--json", str(out)]
    )
    assert json.loads(out.read_text()) == report
    (shape,) = report["shapes"]
    assert (shape["rows"], shape["frames"]) == (2, 60)
    assert shape["variants"]["bool"]["graph_ms"] > 0
    assert shape["variants"]["bias"]["max_abs_vs_bool"] == 0.0
    assert shape["variants"]["fused"]["max_abs_vs_bias"] == 0.0 < shape["variants"]["fused"]["mel_abs_max"]
    assert estimator.attention_bias is shipped
    assert fused_kernels.enabled is switched  # restored after the fused variant


def test_bench_gpu_sharing_smoke_cpu(tmp_path) -> None:
    """bench/gpu_sharing.py runs each mode on CPU (eager solves): one worker, two worker
    processes started together, two threads; each worker reports its own rate."""
    report = bench_gpu_sharing.main(["--device", "cpu", "--size", "tiny", "--shapes", "1x60", "--seconds", "0.5",
                                     "--json", str(tmp_path / "sharing.json")])
    modes = report["shapes"][0]["modes"]
    assert list(modes) == ["alone", "two_processes", "two_streams"]
    assert [len(modes[mode]["workers"]) for mode in modes] == [1, 2, 2]
    for mode in modes.values():
        assert all(w["solves_per_s"] > 0 and w["median_ms"] > 0 for w in mode["workers"])
        assert mode["solves_per_s"] == pytest.approx(sum(w["solves_per_s"] for w in mode["workers"]), abs=0.02)
    assert json.loads((tmp_path / "sharing.json").read_text()) == report


def test_bench_sdpa_choice_smoke_cpu(tmp_path) -> None:
    """bench/sdpa_choice.py on CPU: SDPA's choice and a timing for every case, the key frames of
    a prefix case counting the prefix; the cuDNN probe is GPU-only."""
    report = bench_sdpa_choice.main(["--device", "cpu", "--repeats", "1", "--json", str(tmp_path / "sdpa.json")])
    assert len(report["cases"]) == 2 * len(bench_sdpa_choice.CASES)
    expected = [(*case, aligned) for case in bench_sdpa_choice.CASES for aligned in (False, True)]
    for case, (layout, rows, frames, prefix, aligned) in zip(report["cases"], expected):
        assert (case["layout"], case["rows"], case["key_frames"]) == (layout, rows, prefix + frames)
        assert case["aligned_bias"] is aligned
        assert hasattr(bench_sdpa_choice.SDPBackend, case["choice"]) and case["choice_ms"] > 0
        assert 0 <= case["max_abs_vs_math"] < 0.05  # bf16 rounding of the strided views' attention
        assert "cudnn_ms" not in case
    assert json.loads((tmp_path / "sdpa.json").read_text()) == report


def test_word_timings_cost_reports_the_difference(tmp_path) -> None:
    """bench/word_timings_cost.py replays replies with and without word timings (CPU)."""
    out = tmp_path / "cost.json"
    assert bench_word_timings_cost.main(["--replies", "5", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["replies"] == 5
    assert result["with_word_timings_ms_per_reply"] > 0 and result["without_ms_per_reply"] > 0


def test_bench_estimator_ops_counts_a_forward(tmp_path) -> None:
    """bench/estimator_ops.py: the same op count at every shape (a step's ops do not depend on
    its frames or rows), views left out; a bad shape is a CLI error."""
    out = tmp_path / "ops.json"
    report = bench_estimator_ops.main(["--size", "tiny", "--shapes", "2x50,4x120", "--json", str(out)])
    first, second = report["results"]
    assert (first["rows"], first["frames"], second["rows"], second["frames"]) == (2, 50, 4, 120)
    assert first["ops"] == second["ops"] == sum(first["by_name"].values()) > 0
    assert first["by_name"]["aten::linear"] > 0 and not bench_estimator_ops.VIEW_OPS & set(first["by_name"])
    assert json.loads(out.read_text()) == report
    fused = bench_estimator_ops.main(["--size", "tiny", "--shapes", "2x50", "--fused"])["results"][0]["by_name"]
    # Each transformer block's norms (with the residual add before) are fused kernels; so are the
    # ResNet blocks' norms, with their Mish and mask.
    assert fused["kernel::add_norm"] > 0 and fused["kernel::norm_mish_mask"] > 0
    assert "aten::layer_norm" not in fused and fused["aten::mish"] < first["by_name"]["aten::mish"]
    assert sum(fused.values()) < first["ops"]
    # A paged call's Euler step: one attention kernel per layer (the tiny estimator's 4), whose
    # new inputs its norms write into the pages, no copy of their own.
    paged = bench_estimator_ops.main(["--size", "tiny", "--shapes", "2x50,3x60", "--paged", "--fused"])["results"]
    assert paged[0]["ops"] == paged[1]["ops"] > 0
    assert paged[0]["by_name"]["kernel::paged_attention"] == 4 and "aten::index_copy_" not in paged[0]["by_name"]
    with pytest.raises(SystemExit):
        bench_estimator_ops.main(["--size", "tiny", "--shapes", "2x0"])


def test_bench_estimator_ops_counts_what_compiling_leaves() -> None:
    """bench/estimator_ops.py --inductor: the kernels of torch.compile's code for the forward,
    Inductor's own fused ones and the library calls it leaves (one attention per layer), fewer
    than eager's ops, and a result equal to eager's."""
    eager = bench_estimator_ops.main(["--size", "tiny", "--shapes", "2x50"])["results"][0]
    compiled = bench_estimator_ops.main(["--size", "tiny", "--shapes", "2x50", "--inductor"])["results"][0]
    kernels = compiled["by_name"]
    assert compiled["kernels"] < eager["ops"]
    assert kernels["fused"] > 0 and kernels["addmm"] > 0 and kernels["convolution"] > 0
    assert sum(count for name, count in kernels.items() if "attention" in name) == 4
    assert compiled["max_abs_vs_eager"] < 1e-5
    with pytest.raises(SystemExit):
        bench_estimator_ops.main(["--size", "tiny", "--shapes", "2x50", "--inductor", "--paged"])


def test_bench_token2wav_chunk_cost_streams_both_exact_modes(tmp_path) -> None:
    """bench/token2wav_chunk_cost.py: each exact flow mode streamed chunk by chunk, its audio
    checked against the other's, and a whole-text pass, all in one report."""
    out = tmp_path / "cost.json"
    assert bench_token2wav_chunk_cost.main(["--size", "tiny", "--device", "cpu", "--chunks", "3", "--repeats", "1",
                                            "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["check"]["enforced"] and report["check"]["passed"]
    for mode in ("recompute", "incremental"):
        result = report["modes"][mode]
        assert len(result["chunks"]) == 3 and not any(chunk["final"] for chunk in result["chunks"])
        assert result["final"]["final"] and result["audio_s"] > 0
    assert report["offline"]["audio_s"] > 0
