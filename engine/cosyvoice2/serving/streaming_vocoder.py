"""The token2wav runner's vocoder: each utterance's new mel to audio, chunk after chunk without seams.

A chunk's mel goes to HiFT behind the last 8 frames of the chunk before it, with the
excitation (source) drawn for those frames, and the last 8 x 480 samples of each chunk's audio
are held back and cross-faded into the next chunk's first ones; the last chunk flushes all
(chunking.py gives the rule). Those caches are each utterance's own (``StreamState.hift_*``).
Chunks of the same shape, which in steady state is all of them, run as one vocoder call, a
CUDA graph's replay where one holds the shape (hift_graphs.py).
"""

from __future__ import annotations

import numpy as np
import torch

from tts_gateway.engine.cosyvoice2.model.hift import HiFT
from tts_gateway.engine.cosyvoice2.serving.buckets import CAPTURE_LOCK
from tts_gateway.engine.cosyvoice2.serving.chunking import MEL_CACHE_FRAMES, ChunkJob, ChunkSchedule
from tts_gateway.engine.cosyvoice2.serving.flow_work import FlowWork
from tts_gateway.engine.cosyvoice2.serving.hift_graphs import HiftGraphs


def _read_on_this_stream(*tensors: torch.Tensor) -> None:
    """Tensors of an utterance's state that this call reads on the current stream, which may
    not be the stream that made them (a turn's first chunk runs on the first-chunk lane's):
    once they are replaced, the allocator must not hand their memory to the other stream's
    work before this stream's reads of them have run."""
    for tensor in tensors:
        if tensor.is_cuda:
            tensor.record_stream(torch.cuda.current_stream(tensor.device))


class StreamingVocoder:
    """``hift`` on the chunks of many utterances as ``schedule`` cuts them (which it moves past
    each chunk emitted); counts the calls no graph held in ``work``."""

    def __init__(self, hift: HiFT, schedule: ChunkSchedule, work: FlowWork) -> None:
        self.hift = hift
        self.schedule = schedule
        self.work = work
        self._window = torch.from_numpy(np.hamming(2 * schedule.cache_samples))

    def run(
        self, inputs: list[tuple[torch.Tensor, torch.Tensor]], graphs: HiftGraphs | None
    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Each chunk's audio and source from its ``hift_input``: one call for every group of
        chunks of the same shape (cached 8 frames + one hop in steady state). ``graphs``: the
        calling thread's vocoder graphs."""
        groups: dict[tuple, list[int]] = {}
        for i, (mel, cache_source) in enumerate(inputs):
            groups.setdefault((mel.shape[2], cache_source.shape[2]), []).append(i)
        speech: list[torch.Tensor | None] = [None] * len(inputs)
        source: list[torch.Tensor | None] = [None] * len(inputs)
        for rows in groups.values():
            mel = torch.cat([inputs[i][0] for i in rows])
            cache_source = torch.cat([inputs[i][1] for i in rows])
            wav, src = self.vocode(mel, cache_source, graphs)
            for k, i in enumerate(rows):
                speech[i], source[i] = wav[k : k + 1], src[k : k + 1]
        return speech, source

    def vocode(
        self, mel: torch.Tensor, cache_source: torch.Tensor, graphs: HiftGraphs | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One vocoder call: a replay of ``graphs`` where they hold its shape, else the eager one."""
        with CAPTURE_LOCK:  # it draws noise: not while the other thread captures a graph
            if graphs is not None:
                replayed = graphs.run(mel, cache_source)
                if replayed is not None:
                    return replayed
            self.work.count("vocoder_eager_calls")
            return self.hift(mel, cache_source)

    def hift_input(self, job: ChunkJob, mel: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The chunk's mel behind the cached frames of the last chunk, and the cached source."""
        state = job.request.stream
        mel = mel.to(self._dtype)
        if state.hift_mel is None:
            return mel, mel.new_zeros(1, 1, 0)
        _read_on_this_stream(state.hift_mel, state.hift_source)
        return torch.cat([state.hift_mel, mel], dim=2), state.hift_source

    def emit(self, job: ChunkJob, mel: torch.Tensor, speech: torch.Tensor, source: torch.Tensor) -> torch.Tensor:
        """The chunk's audio (float32, on the device): cross-faded with the last chunk's tail, its
        own tail held back for the next (all of it at the end of the turn); moves the utterance
        past the chunk. The flow's stored state is the runner's to release (``Token2WavRunner._emit``)."""
        state = job.request.stream
        cache_samples = self.schedule.cache_samples
        if state.hift_speech is not None:
            _read_on_this_stream(state.hift_speech)
            speech = self._cross_fade(speech, state.hift_speech)
        if job.finalize:
            state.hift_mel = state.hift_source = state.hift_speech = None
        else:
            state.hift_mel = mel[:, :, -MEL_CACHE_FRAMES:]
            state.hift_source = source[:, :, -cache_samples:]
            state.hift_speech = speech[:, -cache_samples:]
            speech = speech[:, :-cache_samples]
        self.schedule.spoken(job)
        return speech[0].float()

    @property
    def _dtype(self) -> torch.dtype:
        return next(self.hift.parameters()).dtype

    def _cross_fade(self, speech: torch.Tensor, previous_tail: torch.Tensor) -> torch.Tensor:
        """Blend the held-back tail of the last chunk into the start of this one."""
        n = self.schedule.cache_samples
        if self._window.device != speech.device:  # once: a copy per chunk would wait for the GPU
            self._window = self._window.to(speech.device)
        window = self._window
        head = speech[:, :n].double() * window[:n] + previous_tail.double() * window[n:]
        return torch.cat([head.to(speech.dtype), speech[:, n:]], dim=1)
