"""Start-up of the CosyVoice2 serving layer: the vLLM LM stage, and the CUDA graphs of the
flow and the vocoder, captured before the gateway reports ready.

Graphs are captured for the shapes serving asks for: every batch and context bucket of
streaming chunks (after the voice prefixes where there is a bank), final chunks a few at a
time, each voice's chunk shapes for the vocoder, and the first-chunk lane's own graphs.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
from collections.abc import Callable
from typing import TypeVar

import torch

from tts_gateway.engine.base import EngineError
from tts_gateway.engine.cosyvoice2.serving.buckets import FlowBuckets
from tts_gateway.engine.cosyvoice2.serving.call_plan import MAX_CALL_ROW_FRAMES
from tts_gateway.engine.cosyvoice2.serving.calls import Lane
from tts_gateway.engine.cosyvoice2.serving.encoder_graphs import EncoderGraphs
from tts_gateway.engine.cosyvoice2.serving.flow_graphs import FlowGraphs
from tts_gateway.engine.cosyvoice2.serving.hift_graphs import HiftGraphs
from tts_gateway.engine.cosyvoice2.serving.incremental_encoder_graphs import IncrementalEncoderGraphs
from tts_gateway.engine.cosyvoice2.serving.lm.stage import LMStage
from tts_gateway.engine.cosyvoice2.serving.runner import Token2WavRunner
from tts_gateway.engine.cosyvoice2.serving.scheduler import FIRST_LANE_MAX_BATCH
from tts_gateway.engine.cosyvoice2.settings import CosyVoice2Settings, VLLMSettings

log = logging.getLogger(__name__)

Graphs = TypeVar("Graphs", EncoderGraphs, IncrementalEncoderGraphs)

# Flow graphs of final chunks (full attention over the whole turn) up to this batch: a
# batch holds few of them, since each turn has one.
FINAL_GRAPH_MAX_BATCH = 8
# CUDA stream priority of the first-chunk lane: lower is higher, and torch maps a value
# past the device's range to its highest priority.
LANE_PRIORITY = -1000


def device_of(name: str) -> torch.device:
    """The device a ``device`` setting names (auto: cuda if present)."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def set_token2wav_mps_client(settings: VLLMSettings) -> None:
    """Token2wav's CUDA MPS client settings (``VLLMSettings.token2wav_environment``) into this
    process's environment. MPS reads them when the process makes its CUDA context, so this
    must come first; later, they would reach only processes started afterwards."""
    extra = settings.token2wav_environment()
    if extra and torch.cuda.is_initialized():
        log.warning("token2wav_mps_priority: this process's CUDA context exists already, MPS keeps its priority")
    os.environ.update(extra)


async def start_vllm_stage(settings: CosyVoice2Settings) -> LMStage:
    """Convert the LM for vLLM (cached beside the model), start it and warm every batch shape."""
    from tts_gateway.engine.cosyvoice2.modeldir.layout import missing_files
    from tts_gateway.engine.cosyvoice2.modeldir.reading import load_model_configs
    from tts_gateway.engine.cosyvoice2.serving.lm.vllm_convert import convert
    from tts_gateway.engine.cosyvoice2.serving.lm.vllm_stage import VLLMLMStage

    missing = missing_files(settings.model_dir)
    if missing:
        raise EngineError(f"model directory {settings.model_dir} is incomplete; missing: {', '.join(missing)}")
    configs = await asyncio.to_thread(load_model_configs, settings.model_dir)
    try:
        path = await asyncio.to_thread(convert, settings.model_dir, configs.llm)
    except (OSError, ValueError, KeyError) as exc:
        raise EngineError(f"cannot convert llm.pt for vLLM: {exc}") from exc
    return await VLLMLMStage.start(settings.vllm, str(path), configs.llm)


def capture_flow_graphs(runner: Token2WavRunner, settings: CosyVoice2Settings, device: torch.device) -> None:
    """CUDA graphs of the flow for every bucket served (after the voice-prefix bank, which
    they read)."""
    buckets = FlowBuckets.up_to(settings.graph_max_batch, settings.graph_max_frames, settings.graph_frame_step)
    bank = runner.prefixes.bank if runner.prefixes is not None else None
    pool = runner.turn_pool
    graphs = FlowGraphs(runner.flow.decoder, buckets, bank=bank, pool=pool, steps=runner.flow_steps)
    frames = buckets.frame_buckets()
    # Non-final chunks start after their voices' prefixes where there is a bank (frames:
    # those after the prefix), and after their turns' stored frames where there is a pool
    # (a turn the pool has no room for goes on after its prefix); else they run whole. Without a pool one row runs whole either way (the faster replay
    # on the H200: 85 vs 103 ms for a first chunk with the vocoder). Final chunks of full
    # attention end turns, a few at a time. The call planner keeps calls of several rows
    # within MAX_CALL_ROW_FRAMES, so larger graphs would not be replayed.
    budget = MAX_CALL_ROW_FRAMES
    graphs.capture([1] if bank is not None else buckets.batches, frames, [True], max_row_frames=budget)
    if pool is not None:
        graphs.capture(buckets.batches, frames, [True], max_row_frames=budget, paged=True)
    if bank is not None:
        graphs.capture(buckets.batches, frames, [True], after_prefix=True, max_row_frames=budget)
    if not runner.final_streaming:
        final_batches = [b for b in buckets.batches if b <= FINAL_GRAPH_MAX_BATCH]
        graphs.capture(final_batches, frames, [False], max_row_frames=budget)
    runner.flow_graphs = graphs
    # A small graph of each kind against its eager solve.
    checked = [buckets.key(3, 250, streaming, after) for streaming, after in ((True, bank is not None), (False, False))]
    if pool is not None:
        checked.append(buckets.key(3, 100, True, paged=True))
    errors = ", ".join(f"{key}: {graphs.replay_error(key):.2e}" for key in checked if key in graphs.graphs)
    log.info(
        "flow CUDA graphs: %d captured in %.1f s (%.2f GiB); |replay - eager| %s",
        len(graphs.graphs), graphs.capture_seconds, graphs.reserved_bytes / 2**30, errors,
    )


def capture_incremental_encoder_graphs(runner: Token2WavRunner, max_batch: int) -> None:
    """CUDA graphs of the paged calls' incremental token encoder (``paged_encoder_graphs``); where
    capture fails the engine thread encodes eagerly."""
    graphs = checked_encoder_graphs(lambda: IncrementalEncoderGraphs(runner.flow, max_batch), "paged calls")
    if graphs is not None:
        runner.token_encoder.graphs = graphs


def check_memory(settings: CosyVoice2Settings, device: torch.device) -> None:
    """What token2wav holds once every graph is captured (the flow's, the vocoder's and the
    lane's each add their pools), against ``token2wav_memory_gb``."""
    held = torch.cuda.memory_reserved(device) / 2**30
    log.info("token2wav holds %.1f GiB of %.1f GiB budgeted", held, settings.vllm.token2wav_memory_gb)
    if held > settings.vllm.token2wav_memory_gb:
        log.warning("token2wav holds more GPU memory than token2wav_memory_gb; raise it or lower max_batch")


def capture_hift_graphs(
    runner: Token2WavRunner, max_batch: int, voice_prompt_tokens: list[int], all_lengths: bool = False
) -> None:
    """CUDA graphs of the vocoder for every voice's chunk shapes at every batch bucket (a voice
    registered later: its shapes are allowed when it is first used, see the engine); with
    ``all_lengths`` (``hift_graphs_all_lengths``), one-row graphs of its last and early chunks'
    lengths too."""
    graphs = HiftGraphs(runner.hift, max_batch)
    runner.hift_graphs = graphs
    for prompt_tokens in voice_prompt_tokens:
        for shape in runner.schedule.chunk_shapes(prompt_tokens):
            graphs.allow(*shape)
        if all_lengths:
            for shape in runner.schedule.tail_shapes(prompt_tokens):
                graphs.allow_row_by_row(*shape)
    reserved = torch.cuda.memory_reserved(graphs.device)
    try:
        graphs.capture_allowed()
    except Exception as exc:  # an optional speed-up: the vocoder still runs, eagerly
        runner.hift_graphs = None
        log.error("HiFT CUDA graphs could not be captured, the vocoder runs eagerly: %s", exc)
        return
    log.info(
        "HiFT CUDA graphs: %d captured in %.1f s (%.2f GiB); largest |replay - eager| %.2e",
        len(graphs.graphs), graphs.capture_seconds, (torch.cuda.memory_reserved(graphs.device) - reserved) / 2**30,
        graphs.max_error,
    )
    if graphs.row_shapes:
        device, lengths = graphs.device, len(graphs.row_shapes - graphs.shapes)
        reserved, seconds, free = torch.cuda.memory_reserved(device), graphs.capture_seconds, _free_bytes(device)
        count, rows_error = graphs.capture_rows()
        log.info(
            "HiFT CUDA graphs of one row for last and early chunks: %d of %d lengths in %.1f s (%.2f GiB reserved, "
            "%.2f GiB of the card); largest |replay - eager| %.2e", count, lengths,
            graphs.capture_seconds - seconds, (torch.cuda.memory_reserved(device) - reserved) / 2**30,
            (free - _free_bytes(device)) / 2**30, rows_error,
        )


def _free_bytes(device: torch.device) -> int:
    """The card's free memory: what graphs hold beyond the allocator's pools shows here too."""
    return torch.cuda.mem_get_info(device)[0]


def first_chunk_lane(
    runner: Token2WavRunner, settings: CosyVoice2Settings, voice_prompt_tokens: list[int], device: torch.device
) -> Lane:
    """The first-chunk lane: a stream of the highest priority and its own graphs of every
    voice's opening chunks (``ChunkSchedule.opens_turn``: token encoder and flow run whole,
    and the vocoder) up to FIRST_LANE_MAX_BATCH. With ``first_chunk_lane_after_prefix`` (and a
    voice-prefix bank), graphs of their frames after the voice prefix too, for calls of
    several rows."""
    schedule = runner.schedule
    widths = sorted({width for tokens in voice_prompt_tokens for width in schedule.lane_widths(tokens)})
    buckets = FlowBuckets.up_to(FIRST_LANE_MAX_BATCH, widths[-1], settings.graph_frame_step)
    prefixes = runner.prefixes
    after_prefix = settings.first_chunk_lane_after_prefix and prefixes is not None and prefixes.fixed
    if settings.first_chunk_lane_after_prefix and not after_prefix:
        log.warning("first_chunk_lane_after_prefix needs a voice-prefix bank (prefix_voices): the lane runs whole")
    bank = prefixes.bank if after_prefix else None
    flow_graphs = FlowGraphs(runner.flow.decoder, buckets, bank=bank, priority=LANE_PRIORITY, steps=runner.flow_steps)
    flow_graphs.capture(buckets.batches, widths, [True])
    if after_prefix:
        after = {
            width - runner.flow.voice_prefix_frames(tokens)
            for tokens in voice_prompt_tokens for width in schedule.lane_widths(tokens)
        }
        flow_graphs.capture([b for b in buckets.batches if b > 1], sorted(after), [True], after_prefix=True)
        checked = min((key for key in flow_graphs.graphs if key.after_prefix), key=lambda key: key.row_frames)
        log.info("first-chunk lane after voice prefixes: |replay - eager| %s: %.2e",
                 checked, flow_graphs.replay_error(checked))
    hift_graphs = None
    if settings.hift_graphs:
        hift_graphs = HiftGraphs(runner.hift, FIRST_LANE_MAX_BATCH, priority=LANE_PRIORITY)
        for tokens in voice_prompt_tokens:
            for shape in schedule.lane_shapes(tokens):
                hift_graphs.allow(*shape)
        hift_graphs.capture_allowed()
    log.info(
        "first-chunk lane: %d flow and %d vocoder CUDA graphs in %.1f s (%.2f GiB)",
        len(flow_graphs.graphs), len(hift_graphs.graphs) if hift_graphs else 0,
        flow_graphs.capture_seconds + (hift_graphs.capture_seconds if hift_graphs else 0),
        flow_graphs.reserved_bytes / 2**30,
    )
    # Encoded tokens of the opening chunks, in whole 25-token chunks: a few widths for many voices.
    chunk = runner.flow.encoder.static_chunk_size
    tokens = {math.ceil(width / schedule.mel_ratio / chunk) * chunk for width in widths}
    encoder_graphs = lane_encoder_graphs(runner, buckets.batches, sorted(tokens))
    stream = torch.cuda.Stream(device, priority=LANE_PRIORITY)
    return Lane(stream, flow_graphs, hift_graphs, encoder_graphs, after_prefix=after_prefix)


# The most a token encoder graph's replay may differ from its program run eagerly on the same
# inputs (the same kernels: 0 on an H100) before its graphs are left unused.
ENCODER_REPLAY_TOLERANCE = 1e-2


def lane_encoder_graphs(runner: Token2WavRunner, batches: tuple[int, ...], widths: list[int]) -> EncoderGraphs | None:
    """CUDA graphs of the token encoder for the lane's calls (``widths``: encoded tokens of the
    voices' opening chunks); None where capture fails (the lane then encodes eagerly)."""
    return checked_encoder_graphs(
        lambda: EncoderGraphs(runner.flow, batches, widths, priority=LANE_PRIORITY), "first-chunk lane"
    )


def checked_encoder_graphs(make: Callable[[], Graphs], user: str) -> Graphs | None:
    """Token encoder graphs made and captured, their largest key's replay checked against its
    eager run; None, logged, where that fails (an optional speed-up: ``user`` encodes eagerly)."""
    reserved = torch.cuda.memory_reserved()
    try:
        graphs = make()
        graphs.capture()
        largest = graphs.largest_key()
        error = graphs.replay_error(largest)
        if not error <= ENCODER_REPLAY_TOLERANCE:  # NaN too
            raise RuntimeError(f"a replay differs from its eager run by {error:.2e}")
    except Exception as exc:
        log.error("token encoder CUDA graphs of the %s could not be used, it encodes eagerly: %s", user, exc)
        return None
    log.info(
        "%s: %d token encoder CUDA graphs in %.1f s (%.2f GiB); |replay - eager| %s: %.2e",
        user, len(graphs.programs), graphs.capture_seconds, (torch.cuda.memory_reserved() - reserved) / 2**30,
        largest, error,
    )
    return graphs
