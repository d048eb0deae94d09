"""A token2wav call as the runner and the scheduler pass it between them.

``Lane`` is what a second worker thread (the first-chunk lane) runs its calls on.
``LaunchedCall`` is what ``Token2WavRunner.launch`` hands back and ``finish`` takes: the
call's audio on its way to the host, its share of the work totals and its time by phase,
whose sum the scheduler books (latency.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from tts_gateway.engine.cosyvoice2.serving.encoder_graphs import EncoderGraphs
    from tts_gateway.engine.cosyvoice2.serving.flow_graphs import FlowGraphs
    from tts_gateway.engine.cosyvoice2.serving.hift_graphs import HiftGraphs
    from tts_gateway.engine.cosyvoice2.serving.phase_clock import PhaseClock


@dataclass(frozen=True)
class Lane:
    """What a second worker thread runs chunks on while the first runs others: its own CUDA
    stream (of high priority, so that its kernels go first on a busy GPU) and its own CUDA
    graphs (graphs that share a memory pool or static buffers must not replay at the same
    time). Its calls run whole, or with ``after_prefix`` a call of several rows whose voices
    the bank holds runs after their voice prefixes, pinning their slots meanwhile (the first
    thread takes the bank's slots); it keeps nothing in the turn pool."""

    stream: torch.cuda.Stream | None = None
    flow_graphs: FlowGraphs | None = None
    hift_graphs: HiftGraphs | None = None
    encoder_graphs: EncoderGraphs | None = None
    after_prefix: bool = False


@dataclass
class LaunchedCall:
    """A call whose work is enqueued (``Token2WavRunner.launch``): its chunks' audio, one after
    another in ``host`` (pinned host memory on a GPU, filled once ``done`` has passed), their
    ``lengths``, and the phase clock it ran on (``infix``: its thread's, in the totals' names);
    ``work``, its own share of ``work_totals`` (the flow's counters, named without ``flow_``:
    its flow calls, the row-frames they needed and computed, its graph and eager calls).
    ``finish`` sets ``gpu_phase_seconds``, the call's time on its stream by phase (None off a
    GPU; ``gpu_seconds`` is their sum), and unpins the voice-prefix slots the call read
    (``pinned``: a lane's call after prefixes)."""

    host: torch.Tensor
    lengths: list[int]
    done: torch.cuda.Event | None
    clock: PhaseClock
    infix: str
    work: dict[str, int] = field(default_factory=dict)
    gpu_phase_seconds: dict[str, float] | None = None
    pinned: list[int] = field(default_factory=list)

    @property
    def gpu_seconds(self) -> float | None:
        """The call's time on its stream (None off a GPU, or before ``finish``)."""
        return None if self.gpu_phase_seconds is None else sum(self.gpu_phase_seconds.values())
