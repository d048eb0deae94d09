"""serving/incremental_encoder_graphs.py: the paged calls' incremental encodes by fixed shapes.

The programs a graph replays run eagerly here (``graphs=False``) on the same static inputs, so
these tests prove that the padded, bucketed step (rows, new tokens and cached tokens padded,
caches copied in) gives what the eager incremental step gives, call after call. That a replay
equals its program is checked on a GPU at start-up (``replay_error``, logged).
"""

from __future__ import annotations

import pytest
import torch
from torch import Tensor

from tts_gateway.engine.cosyvoice2.model.flow_encoder import TokenEncoder
from tts_gateway.engine.cosyvoice2.modeldir.configs import FlowEncoderConfig
from tts_gateway.engine.cosyvoice2.serving.incremental_encoder import EncoderStreamState, IncrementalEncoder
from tts_gateway.engine.cosyvoice2.serving.incremental_encoder_graphs import IncrementalEncoderGraphs, IncrementalKey
from tests.reference import randomize

VOCAB = 6561
# Tokens fed to each of three turns step by step (a turn's first: its prompt and first chunk).
FEEDS = {"a": [40, 25, 25, 7], "b": [13, 60, 0, 12], "c": [77, 1, 30, 25]}


@pytest.fixture(scope="module")
def encoder() -> TokenEncoder:
    return randomize(TokenEncoder(FlowEncoderConfig.tiny(), vocab_size=VOCAB), seed=7, spread=0.2).eval()


def graphs_of(encoder: TokenEncoder, **kwargs) -> IncrementalEncoderGraphs:
    shapes = {"widths": (25, 50, 100), "cached": (0, 64, 128), **kwargs}
    return IncrementalEncoderGraphs(encoder, 4, graphs=False, **shapes)


def steps(encoder: IncrementalEncoder, names: list[str]) -> list[tuple[Tensor, ...]]:
    """Each step's outputs (mu, mel_start, mel_len, mel_final) for the turns ``names``, fed together."""
    generator = torch.Generator().manual_seed(3)
    streams = {name: torch.randint(0, VOCAB, (sum(feed),), generator=generator) for name, feed in FEEDS.items()}
    states = {name: EncoderStreamState() for name in names}
    seen = dict.fromkeys(names, 0)
    outs = []
    for step in range(4):
        chunk = []
        for name in names:
            chunk.append(streams[name][seen[name] : seen[name] + FEEDS[name][step]])
            seen[name] += FEEDS[name][step]
        out = encoder.step([states[name] for name in names], chunk, finalize=step == 3)
        outs.append((out.mu, out.mel_start, out.mel_len, out.mel_final))
    return outs


def assert_same_steps(got: list[tuple[Tensor, ...]], expected: list[tuple[Tensor, ...]]) -> None:
    for (mu, *counts), (mu_expected, *counts_expected) in zip(got, expected, strict=True):
        assert mu.shape == mu_expected.shape
        assert float((mu - mu_expected).abs().max()) <= 1e-5
        for a, b in zip(counts, counts_expected):
            assert torch.equal(a, b)


def test_steps_by_the_programs_equal_the_eager_steps(encoder):
    """Three turns stepped together, then new turns in rows that held those (the static inputs
    keep what the last call left): every step's frames and counts as the eager step gives them,
    and every call by a program."""
    graphs = graphs_of(encoder)
    with torch.inference_mode():
        for names in (list(FEEDS), ["b"], ["c", "a"]):
            eager = steps(IncrementalEncoder(encoder), names)
            by_programs = IncrementalEncoder(encoder)
            by_programs.graphs = graphs
            served = []
            run = IncrementalEncoderGraphs.run.__get__(graphs)
            graphs.run = lambda *a: served.append(run(*a)) or served[-1]
            assert_same_steps(steps(by_programs, names), eager)
            assert len(served) == 4 and None not in served, names


def test_a_step_no_key_holds_is_encoded_eagerly(encoder):
    """Caches longer than the widest cached bucket: those steps go eager, with the same result."""
    with torch.inference_mode():
        eager = steps(IncrementalEncoder(encoder), list(FEEDS))
        small = IncrementalEncoder(encoder)
        small.graphs = graphs_of(encoder, cached=(0, 25))
        served = []
        run = small.graphs.run
        small.graphs.run = lambda *a: served.append(run(*a)) or served[-1]
        assert_same_steps(steps(small, list(FEEDS)), eager)
    assert served[0] is not None and None in served[1:]


def test_the_smallest_key_that_holds_a_call_is_chosen(encoder):
    graphs = graphs_of(encoder, max_row_tokens=256, max_row_new_tokens=200)
    assert graphs.key(3, 30, 0) == IncrementalKey(4, 50, 0)
    assert graphs.key(1, 100, 65) == IncrementalKey(1, 100, 128)
    assert graphs.key(4, 10, 65) is None  # 4 rows of 128 cached tokens: past max_row_tokens
    assert graphs.key(5, 10, 0) is None and graphs.key(1, 101, 0) is None and graphs.key(1, 10, 129) is None
    assert IncrementalKey(4, 25, 128) not in graphs.programs  # 4 x 128 cached tokens > 256
    assert IncrementalKey(2, 25, 128) in graphs.programs
    assert IncrementalKey(4, 50, 0) in graphs.programs and IncrementalKey(4, 100, 0) not in graphs.programs
    assert graphs.key(4, 60, 0) is None  # 4 x 100 new tokens > 200


def test_the_distance_tables_are_grown_for_every_program_before_any_runs(encoder, monkeypatch):
    """A replay reads the tables' memory: no program may grow (reallocate) them. Every key at one
    row, each at its full width and cache, reads only what the constructor grew."""
    from tts_gateway.engine.cosyvoice2.model.flow_encoder import PositionTables

    graphs = graphs_of(encoder)
    tables = [table.data_ptr() for table in graphs.positions.tables]
    lookup = PositionTables.lookup

    def no_growth(self, layer, top, count):
        table = lookup(self, layer, top, count)
        assert self.tables[layer].data_ptr() == tables[layer], (layer, top, count)
        return table

    monkeypatch.setattr(PositionTables, "lookup", no_growth)
    with torch.inference_mode():
        for key in graphs.programs:
            if key.batch == 1:
                graphs._fill_for_capture(key)
                graphs.programs[key].run()


def test_a_stale_non_finite_cache_slot_of_another_turn_does_not_reach_a_row(encoder):
    """Slots past a row's cache are masked, and zeroed before each call: a value left there that
    is not finite (a turn before, in another dtype, or corrupt) cannot become 0 x inf = NaN."""
    graphs = graphs_of(encoder)
    ie = IncrementalEncoder(encoder)
    ie.graphs = graphs
    generator = torch.Generator().manual_seed(9)
    state = EncoderStreamState()
    with torch.inference_mode():
        ie.step([state], [torch.randint(0, VOCAB, (40,), generator=generator)])
        for flat in (*graphs.buffers.keys, *graphs.buffers.values):
            flat.fill_(float("inf"))
        out = ie.step([state], [torch.randint(0, VOCAB, (25,), generator=generator)])
    assert state.committed == 50 and torch.isfinite(out.mu).all()


def test_graphs_need_a_cuda_encoder(encoder):
    with pytest.raises(ValueError, match="CUDA"):
        IncrementalEncoderGraphs(encoder, 4)
