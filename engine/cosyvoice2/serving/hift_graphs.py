"""CUDA graphs of the HiFT vocoder for the chunk shapes streaming repeats.

At small batch HiFT is launch-bound like the flow: one call is ~500 small kernels (54
convolutions, each behind a five-op Snake activation, the source STFT and the iSTFT);
in the gateway's H200 profile at one session it took ~40 % of token2wav's time. A
replay is one launch. Capture needs the vocoder free of host syncs, which is why it
uses ``hift.overlap_add_istft`` rather than ``torch.istft``. On the H200 the 14 graphs
of one voice at batch buckets up to 64 capture in ~2 s, replay within 4.4e-5 of the
eager vocoder, and cut one session's first audio from 236 to 167 ms (p50).

Streaming repeats very few HiFT shapes: every chunk after the first is the cached 8 mel
frames plus one hop (58 frames with the official 25-token hop) with 8 frames of cached
excitation, and every first chunk of a voice has the same length without a cache. A
graph is keyed by (batch bucket, frames, cached samples); final chunks, whose length
varies, run eagerly, unless their shapes are allowed row by row (``allow_row_by_row``,
``hift_graphs_all_lengths``, on by default): then one graph of one row per length, replayed
for each row.

Why: at 64 sessions on an H100 (eleventh round) the engine thread's vocoder phase took
~83 ms of thread time a call, most of it inside eager vocoder calls, against ~53 ms of
vocoder work on the GPU. Whether that thread time is the host launching ~500 small kernels
a call (and building cuDNN and cuFFT plans for each shape new to the process: last chunks'
lengths times a call's rows are many shapes) or waiting behind the decoder's queued work is
not known; what the graphs can shorten is the vocoder's GPU phase, where the GPU waits for
launches. Graphs of one row keep their count at the number of lengths (the last hop and its
look-ahead: 224-247 a voice with 200-token hops, 52-76 with the default 25). A group of several rows of
one such length replays its graph once per row.

Padding: batches are padded up to their bucket with copies of row 0 and cut back after
the replay. HiFT's rows are independent (convolutions, STFTs and the excitation are per
row), so a real row's audio is what an unpadded call computes, apart from its random
draws: the excitation's noise and start phases are drawn from the global CUDA RNG for
the whole padded batch. They are draws of the same distribution, as every eager call's
are; the official vocoder draws fresh noise on every call as well.

Capture: the shapes the engine allows (its steady-state chunks and each voice's first
chunk) are captured at every batch bucket before the gateway reports ready; a shape
allowed later (a voice added while serving) is captured on first use (one warm-up call
plus one capture on the worker thread). Each capture is checked once against the eager call on
the same inputs and RNG state (``max_error``); the engine logs the largest.

All graphs share one private memory pool; each graph owns its static input and output
tensors. Replays happen on the token2wav worker thread only.

Memory: a graph's pool holds every intermediate of its call, which grows with rows x frames
(the upsampled signal is 120 samples of 64 channels a frame, in the vocoder's float32). With
graphs of every shape at every bucket up to 64 rows the pool took 27.3 GiB on an H100, most
of the gateway's memory after the turn pool. So a shape's graphs go up to the largest bucket
within ``GRAPH_ROW_FRAMES`` (``rows_per_replay``), and a call of more rows replays its graph
several times, a part of the rows each: HiFT's rows are independent, and a part that size
still fills the GPU.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import Tensor

from tts_gateway.engine.cosyvoice2.serving.buckets import (
    batch_buckets, capture_after_warm_up, holding_capture_lock, pad_rows,
)
from tts_gateway.engine.cosyvoice2.model.hift import HiFT

log = logging.getLogger(__name__)

# The most mel frames (rows x frames) one vocoder graph covers: what bounds its memory.
GRAPH_ROW_FRAMES = 4096


@dataclass(frozen=True)
class HiftKey:
    batch: int  # padded rows
    frames: int  # mel frames
    cached: int  # excitation samples taken from the previous chunk


def graph_key(
    batches: tuple[int, ...], shapes: set[tuple[int, int]], batch: int, frames: int, cached: int
) -> HiftKey | None:
    """The graph a call of this shape uses: its batch padded to a bucket, its shape one of
    ``shapes`` (frames, cached samples); None when it runs eagerly."""
    bucket = next((b for b in batches if b >= batch), None)
    if bucket is None or (frames, cached) not in shapes:
        return None
    return HiftKey(bucket, frames, cached)


def rows_per_replay(batches: tuple[int, ...], frames: int) -> int:
    """The rows a graph of chunks of ``frames`` mel frames takes at most: the largest batch
    bucket within GRAPH_ROW_FRAMES (the smallest bucket if none is)."""
    return max([b for b in batches if b * frames <= GRAPH_ROW_FRAMES], default=batches[0])


class _CapturedVocoder:
    def __init__(self, graph: torch.cuda.CUDAGraph, mel: Tensor, cache: Tensor, wav: Tensor, source: Tensor):
        self.graph = graph
        self.mel, self.cache = mel, cache  # static inputs
        self.wav, self.source = wav, source  # static outputs
        self.error = 0.0  # |replay - eager| when checked at capture (nan: the check could not run)

    def replay(self, mel: Tensor, cache_source: Tensor) -> tuple[Tensor, Tensor]:
        """Its call on these rows (padded to its batch), as fresh tensors."""
        batch, rows = self.mel.shape[0], mel.shape[0]
        self.mel.copy_(pad_rows(mel, batch))
        self.cache.copy_(pad_rows(cache_source, batch))
        self.graph.replay()
        return self.wav[:rows].clone(), self.source[:rows].clone()


def _joined(parts: list[tuple[Tensor, Tensor]]) -> tuple[Tensor, Tensor]:
    """The audio and excitation of calls on consecutive rows, as one call's."""
    return torch.cat([wav for wav, _ in parts]), torch.cat([source for _, source in parts])


def _largest_error(captured: Iterable[_CapturedVocoder]) -> float:
    """The largest |replay - eager| of these graphs; nan if any could not be checked."""
    errors = [c.error for c in captured]
    return float("nan") if any(math.isnan(e) for e in errors) else max(errors, default=0.0)


class HiftGraphs:
    """CUDA graphs of ``HiFT.forward(mel, cache_source)`` (global RNG) by shape bucket.

    Shapes are registered with ``allow`` (chunk length, cached excitation samples);
    ``capture_allowed`` captures them at every batch bucket ahead of serving. ``run``
    replays the graph of a call's bucket (capturing it on first use for a shape allowed
    later, e.g. a new voice's first chunk) and returns None for every other shape, which
    the caller runs eagerly (final chunks, batches over the largest bucket). Shapes registered
    with ``allow_row_by_row`` get a graph of one row each (``capture_rows``, at start-up only),
    replayed once per row.
    """

    def __init__(self, hift: HiFT, max_batch: int, *, priority: int = 0) -> None:
        weight = next(hift.parameters())
        if weight.device.type != "cuda":
            raise ValueError(f"CUDA graphs need HiFT on a CUDA device, it is on {weight.device}")
        self.hift = hift
        self.device = weight.device
        self.dtype = weight.dtype
        self.batches = batch_buckets(max_batch)
        self.shapes: set[tuple[int, int]] = set()
        self.row_shapes: set[tuple[int, int]] = set()  # graphs of one row, replayed row by row
        self.graphs: dict[HiftKey, _CapturedVocoder] = {}
        self.capture_seconds = 0.0
        self._pool = torch.cuda.graph_pool_handle()
        # Captured kernels keep the priority of the stream they were captured on.
        self._stream = torch.cuda.Stream(self.device, priority=priority)

    def allow(self, frames: int, cached: int) -> None:
        if frames < 1 or cached < 0:
            raise ValueError(f"not a chunk shape: {frames} frames, {cached} cached samples")
        self.shapes.add((frames, cached))

    def allow_row_by_row(self, frames: int, cached: int) -> None:
        """A shape whose calls replay a graph of one row for each row (one graph per length)."""
        if frames < 1 or cached < 0:
            raise ValueError(f"not a chunk shape: {frames} frames, {cached} cached samples")
        self.row_shapes.add((frames, cached))

    @torch.inference_mode()
    def capture_allowed(self) -> None:
        """Graphs of every allowed shape at every batch bucket up to its ``rows_per_replay``
        (ahead of serving). Largest first, as the flow's: a smaller graph then fits in the pool
        blocks a larger one's capture freed, instead of growing the pool by its own."""
        keys = [
            HiftKey(batch, frames, cached) for frames, cached in self.shapes
            for batch in self.batches[: self.batches.index(rows_per_replay(self.batches, frames)) + 1]
        ]
        for key in sorted(keys, key=lambda k: (k.batch * k.frames, k.batch, k.frames, k.cached), reverse=True):
            if key not in self.graphs:
                self._capture(key)

    @property
    def max_error(self) -> float:
        """The largest |replay - eager| of every graph's check at capture."""
        return _largest_error(self.graphs.values())

    @torch.inference_mode()
    def capture_rows(self) -> tuple[int, float]:
        """The one-row graphs of the shapes allowed row by row (after ``capture_allowed``); a
        shape whose capture fails is logged and stays eager. Returns how many were captured and
        their own largest |replay - eager| (``max_error`` covers every graph)."""
        captured: list[_CapturedVocoder] = []
        for frames, cached in sorted(self.row_shapes - self.shapes, reverse=True):
            key = HiftKey(1, frames, cached)
            if key in self.graphs:
                continue
            try:
                captured.append(self._capture(key))
            except Exception as exc:  # an optional speed-up: this length runs eagerly
                log.error("HiFT CUDA graph %s could not be captured, that length runs eagerly: %s", key, exc)
                self.row_shapes.discard((frames, cached))
        return len(captured), _largest_error(captured)

    @holding_capture_lock
    def _capture(self, key: HiftKey) -> _CapturedVocoder:
        started = time.perf_counter()
        mel = torch.randn(key.batch, self.hift.config.in_channels, key.frames, device=self.device, dtype=self.dtype)
        cache = 0.1 * torch.randn(key.batch, 1, key.cached, device=self.device, dtype=self.dtype)
        graph, (wav, source) = capture_after_warm_up(lambda: self.hift(mel, cache), self._stream, self._pool)
        captured = _CapturedVocoder(graph, mel, cache, wav, source)
        try:
            captured.error = self._check(captured)
        except RuntimeError as exc:  # the graph itself was captured; only its check could not run
            log.warning("HiFT CUDA graph %s captured but not checked against eager: %s", key, exc)
            captured.error = float("nan")
        self.graphs[key] = captured
        self.capture_seconds += time.perf_counter() - started
        return captured

    def _check(self, captured: _CapturedVocoder) -> float:
        """|replay - eager| on the same inputs and RNG state."""
        state = torch.cuda.get_rng_state(self.device)
        captured.graph.replay()
        replayed = captured.wav.clone()
        torch.cuda.set_rng_state(state, self.device)
        eager, _ = self.hift(captured.mel, captured.cache)
        return float((replayed - eager).abs().max())

    @torch.inference_mode()
    def run(self, mel: Tensor, cache_source: Tensor) -> tuple[Tensor, Tensor] | None:
        """``hift(mel, cache_source)`` by graph replay (fresh tensors), or None: run it eagerly.
        Rows beyond the shape's ``rows_per_replay`` go in further replays."""
        rows, _, frames = mel.shape
        shape = (frames, cache_source.shape[2])
        if shape in self.row_shapes and shape not in self.shapes:
            return self._run_row_by_row(mel, cache_source)
        part = rows_per_replay(self.batches, frames)
        if rows > part:
            parts = []
            for i in range(0, rows, part):
                replayed = self.run(mel[i : i + part], cache_source[i : i + part])
                if replayed is None:
                    return None
                parts.append(replayed)
            return _joined(parts)
        key = graph_key(self.batches, self.shapes, rows, frames, cache_source.shape[2])
        if key is None or mel.dtype != self.dtype:
            return None
        captured = self.graphs.get(key)
        if captured is None:
            log.info("capturing a HiFT CUDA graph on first use: %s", key)
            try:
                captured = self._capture(key)
            except Exception as exc:  # the shape stays eager; the vocoder still runs
                log.error("HiFT CUDA graph %s could not be captured, that shape runs eagerly: %s", key, exc)
                self.shapes.discard((frames, key.cached))
                return None
        return captured.replay(mel, cache_source)

    def _run_row_by_row(self, mel: Tensor, cache_source: Tensor) -> tuple[Tensor, Tensor] | None:
        """A row-by-row shape's call: its one-row graph replayed for each row (None where it has
        none, or another dtype: eager)."""
        captured = self.graphs.get(HiftKey(1, mel.shape[2], cache_source.shape[2]))
        if captured is None or mel.dtype != self.dtype:
            return None
        # One after another on this stream: each copies its outputs out before the next replay.
        rows = range(mel.shape[0])
        return _joined([captured.replay(mel[row : row + 1], cache_source[row : row + 1]) for row in rows])
