"""CUDA graphs of the flow's token encoder, for the first-chunk lane's whole calls.

Why: at the lane's sizes the token encoder is bound by its launches, not by the GPU. A call
of prompt + first chunk issues ~2,800 small kernels (ten conformer blocks, the look-ahead
and upsampling convolutions, the projections), and on an H100 at 64 sessions it took ~20 ms
of the lane's ~100 ms call, the GPU waiting on the host most of it (docs/benchmarks.md). A
first audio waits for all of it. A replay is one launch.

What a graph holds: ``flow_encoder.encode_joined`` over static inputs, the rows' joined token
ids (prompt, then the chunk's tokens and look-ahead), their lengths, the encoded counts and
the speaker embeddings. It reads nothing back from the device, which ``encode_tokens`` does
for the widest row: the caller gives each row's token count, counted on the host.

Keys: (batch bucket, encoded tokens). The widths are those of the voices' opening chunks
(``ChunkSchedule.lane_widths``) rounded up to whole 25-token chunks, so that many voices share
a few; a call takes the smallest key that holds its rows and its widest row, and runs eagerly
where none does. Padding is exact up to floating-point rounding (a padded shape sums in
another order), as in the flow's graphs: rows are copies of row 0, cut off afterwards; tokens
past a row's length are masked in every attention, and the convolutions never read right of a
frame but for the look-ahead, which reads zeros there as at the end of an utterance. The
encoder's output is trimmed back to the widest row, so the decoder sees what the eager encoder
gives it.

``EncoderGraphs(..., graphs=False)`` runs the same program eagerly on the same static
buffers: the CPU tests (tests/engine/cosyvoice2/serving/test_encoder_graphs.py) prove that
equals ``encode_tokens``; that a replay equals the eager program is checked on a GPU, at
start-up (``replay_error``, in the log).

Graphs share one memory pool and replay on the lane's thread only, one at a time; their
outputs are copied out before the next replay can overwrite them.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from tts_gateway.engine.cosyvoice2.model.flow_encoder import Parts, encode_joined, join_rows, token_encoder_part
from tts_gateway.engine.cosyvoice2.serving.buckets import (
    CAPTURE_LOCK, capture_after_warm_up, holding_capture_lock, pad_rows,
)
from tts_gateway.engine.cosyvoice2.serving.uploads import to_device

log = logging.getLogger(__name__)

Encoding = tuple[Tensor, Tensor, Tensor]  # mu [B, 80, frames], mel_len [B], spk [B, 80]


@dataclass(frozen=True)
class EncoderKey:
    batch: int  # padded rows
    width: int  # encoded tokens (the look-ahead's follow them)

    @property
    def size(self) -> tuple[int, int]:
        """How large its graph is (rows x tokens, then rows): the order of capture and choice."""
        return self.batch * self.width, self.batch


class _Program:
    """One key's static inputs, what computes its outputs from them, and its graph once captured."""

    def __init__(self, parts: Parts, key: EncoderKey, device: torch.device, dtype: torch.dtype) -> None:
        encoder = token_encoder_part(parts, "encoder")
        speaker_dim = token_encoder_part(parts, "spk_embed_affine_layer").in_features
        self.parts, self.key = parts, key
        # A valid call to capture: every row full width (the values are replaced before each replay).
        self.ids = torch.zeros(key.batch, key.width + encoder.pre_lookahead_len, dtype=torch.long, device=device)
        self.lengths = torch.full((key.batch,), self.ids.size(1), dtype=torch.long, device=device)
        self.encoded = torch.full((key.batch,), key.width, dtype=torch.long, device=device)
        self.embedding = torch.randn(key.batch, speaker_dim, device=device, dtype=dtype)
        self.graph: torch.cuda.CUDAGraph | None = None
        self.outputs: Encoding | None = None

    def run(self) -> Encoding:
        return encode_joined(self.parts, self.ids, self.lengths, self.encoded, self.embedding, self.key.width, True)

    def replay(self) -> Encoding:
        if self.graph is None:
            self.outputs = self.run()
        else:
            self.graph.replay()
        return self.outputs


class EncoderGraphs:
    """Streaming token encodes of the lane's opening chunks by graph replay (module docstring).

    ``capture`` makes every key's graph ahead of serving; ``run`` encodes a call by the
    smallest key that holds it, or returns None (the caller encodes eagerly). ``graphs=False``:
    the same programs run eagerly (CPU tests)."""

    def __init__(
        self, parts: Parts, batches: Iterable[int], widths: Iterable[int], *, priority: int = 0, graphs: bool = True
    ) -> None:
        weight = token_encoder_part(parts, "encoder_proj").weight
        encoder = token_encoder_part(parts, "encoder")
        if graphs and weight.device.type != "cuda":
            raise ValueError(f"CUDA graphs need the token encoder on a CUDA device, it is on {weight.device}")
        self.parts = parts
        self.device, self.dtype = weight.device, weight.dtype
        self.lookahead, self.stride = encoder.pre_lookahead_len, encoder.stride
        self.batches = tuple(sorted(set(batches)))
        self.widths = tuple(sorted(set(widths)))
        if not self.batches or not self.widths or self.batches[0] < 1 or self.widths[0] < 1:
            raise ValueError(f"no encoder shapes: batches {self.batches}, widths {self.widths}")
        self.programs = {
            key: _Program(parts, key, self.device, self.dtype)
            for key in (EncoderKey(b, w) for b in self.batches for w in self.widths)
        }
        self.use_graphs = graphs
        self.capture_seconds = 0.0
        if graphs:
            self._pool = torch.cuda.graph_pool_handle()
            # Captured kernels keep the priority of the stream they were captured on.
            self._stream = torch.cuda.Stream(self.device, priority=priority)

    def key(self, rows: int, width: int) -> EncoderKey | None:
        """The key of a call of ``rows`` rows whose widest encodes ``width`` tokens; None: none holds it."""
        batch = next((b for b in self.batches if b >= rows), None)
        padded = next((w for w in self.widths if w >= width), None)
        return None if batch is None or padded is None else EncoderKey(batch, padded)

    def largest_key(self) -> EncoderKey:
        return max(self.programs, key=lambda key: key.size)

    @torch.inference_mode()
    def capture(self) -> None:
        """Every key's graph, largest first (smaller graphs then fit in the blocks a larger one's
        capture left in the shared pool)."""
        for key in sorted(self.programs, key=lambda k: k.size, reverse=True):
            self._capture(self.programs[key])

    @holding_capture_lock
    def _capture(self, program: _Program) -> None:
        started = time.perf_counter()
        program.graph, program.outputs = capture_after_warm_up(program.run, self._stream, self._pool)
        self.capture_seconds += time.perf_counter() - started

    @torch.inference_mode()
    def replay_error(self, key: EncoderKey) -> float:
        """Largest |replay - eager| of the key's mu, on the inputs it was captured with."""
        program = self.programs[key]
        replayed = program.replay()[0].clone()
        return float((replayed - program.run()[0]).abs().max())

    @torch.inference_mode()
    def run(
        self, token: Tensor, token_len: Tensor, prompt_token: Tensor, prompt_token_len: Tensor, embedding: Tensor,
        totals: Sequence[int], finalize: bool,
    ) -> Encoding | None:
        """``encode_tokens(..., streaming=True)`` of these rows (arguments as there), by the smallest
        key that holds them; ``totals``: each row's prompt + new tokens, counted on the host.
        None: no key holds the call (it runs eagerly)."""
        counts = [max(0, total - (0 if finalize else self.lookahead)) for total in totals]
        key = self.key(len(counts), max(counts))
        if key is None:
            return None
        program = self.programs[key]
        ids, lengths = join_rows(prompt_token, prompt_token_len, token, token_len, key.width + self.lookahead)
        program.ids.copy_(pad_rows(ids, key.batch))
        program.lengths.copy_(pad_rows(lengths, key.batch))
        program.encoded.copy_(pad_rows(to_device(counts, torch.long, self.device), key.batch))
        program.embedding.copy_(pad_rows(embedding.to(self.dtype), key.batch))
        with CAPTURE_LOCK:  # a replay while the other thread captures a graph would fail (buckets.py)
            mu, mel_len, spk = program.replay()
            rows = len(counts)
            return mu[:rows, :, : self.stride * max(counts)].clone(), mel_len[:rows].clone(), spk[:rows].clone()
