"""serving/encoder_graphs.py: the first-chunk lane's token encodes by fixed shapes.

What a graph replays is ``EncoderGraphs``' program over its static buffers; here it runs
eagerly (``graphs=False``), so these tests prove that the padded, bucketed program with host
counts gives what ``encode_tokens`` gives. That a replay equals the eager program is checked
on a GPU at start-up (``replay_error``, logged).
"""

from __future__ import annotations

import pytest
import torch
from torch import Tensor, nn

from tts_gateway.engine.cosyvoice2.model.flow_encoder import TokenEncoder, encode_joined, encode_tokens, join_rows
from tts_gateway.engine.cosyvoice2.modeldir.configs import FlowEncoderConfig
from tts_gateway.engine.cosyvoice2.serving.encoder_graphs import EncoderGraphs, EncoderKey
from tests.reference import randomize

VOCAB = 6561


@pytest.fixture(scope="module")
def encoder() -> TokenEncoder:
    return randomize(TokenEncoder(FlowEncoderConfig.tiny(), vocab_size=VOCAB), seed=5, spread=0.2).eval()


def rows(prompt_lengths: list[int], new_lengths: list[int], seed: int) -> tuple[Tensor, ...]:
    """token, token_len, prompt_token, prompt_token_len, embedding of rows padded as the runner pads them."""
    generator = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, VOCAB, (n,), generator=generator) for n in prompt_lengths]
    news = [torch.randint(0, VOCAB, (n,), generator=generator) for n in new_lengths]
    return (
        nn.utils.rnn.pad_sequence(news, batch_first=True),
        torch.tensor(new_lengths),
        nn.utils.rnn.pad_sequence(prompts, batch_first=True),
        torch.tensor(prompt_lengths),
        torch.randn(len(news), 192, generator=generator),
    )


def max_diff(a: Tensor, b: Tensor) -> float:
    assert a.shape == b.shape, (a.shape, b.shape)
    return float((a - b).abs().max())


@pytest.mark.parametrize("streaming", [True, False])
def test_encoding_joined_rows_wider_than_needed_pads_exactly(encoder, streaming):
    """encode_joined at a width past the widest row: the same mu for every row's frames, zero after."""
    token, token_len, prompt, prompt_len, embedding = rows([17, 0, 30], [41, 12, 55], seed=1)
    finalize = torch.tensor([True, False, False])
    with torch.inference_mode():
        expected = encode_tokens(encoder, token, token_len, prompt, prompt_len, embedding, streaming, finalize)
        ids, lengths = join_rows(prompt, prompt_len, token, token_len, width=100)
        encoded = (lengths - torch.where(finalize, 0, 3)).clamp(min=0)
        mu, mel_len, spk = encode_joined(encoder, ids, lengths, encoded, embedding, 95, streaming)
    frames = expected[0].size(2)
    assert mu.shape == (3, 80, 190) and frames == 2 * 82
    assert max_diff(mu[:, :, :frames], expected[0]) <= 1e-5
    assert torch.all(mu[:, :, frames:] == 0)
    assert torch.equal(mel_len, expected[1])
    assert max_diff(spk, expected[2]) <= 1e-6


@pytest.mark.parametrize("finalize", [False, True])
def test_the_lane_encoder_program_equals_encode_tokens(encoder, finalize):
    """Three rows of two voices go padded to four rows and the next width; what comes back is
    what encode_tokens gives the three rows, frame for frame."""
    graphs = EncoderGraphs(encoder, batches=(1, 2, 4), widths=(30, 45), graphs=False)
    token, token_len, prompt, prompt_len, embedding = rows([17, 30, 17], [23, 12, 7], seed=2)
    totals = [40, 42, 24]
    with torch.inference_mode():
        expected = encode_tokens(encoder, token, token_len, prompt, prompt_len, embedding, True, finalize)
        got = graphs.run(token, token_len, prompt, prompt_len, embedding, totals, finalize)
    assert got is not None
    assert graphs.key(3, max(totals) - (0 if finalize else 3)) == EncoderKey(4, 45)
    assert got[0].shape == expected[0].shape  # trimmed back to the widest row
    assert max_diff(got[0], expected[0]) <= 1e-5
    assert torch.equal(got[1], expected[1])
    assert max_diff(got[2], expected[2]) <= 1e-6


def test_a_later_call_is_not_mixed_with_the_last(encoder):
    """The static buffers are refilled each call: a call of one short row after a call of wide
    rows gives that row's own encoding."""
    graphs = EncoderGraphs(encoder, batches=(1, 2), widths=(60,), graphs=False)
    wide = rows([30, 25], [28, 30], seed=3)
    short = rows([10], [9], seed=4)
    with torch.inference_mode():
        graphs.run(*wide, totals=[58, 55], finalize=False)
        got = graphs.run(*short, totals=[19], finalize=False)
        expected = encode_tokens(encoder, *short[:4], short[4], True, False)
    assert max_diff(got[0], expected[0]) <= 1e-5 and torch.equal(got[1], expected[1])


def test_a_call_no_key_holds_is_left_to_the_eager_encoder(encoder):
    graphs = EncoderGraphs(encoder, batches=(1, 2), widths=(30, 50), graphs=False)
    assert graphs.key(1, 10) == EncoderKey(1, 30) and graphs.key(2, 31) == EncoderKey(2, 50)
    assert graphs.key(3, 10) is None and graphs.key(1, 51) is None
    args = rows([40, 40, 40], [10, 10, 10], seed=5)
    with torch.inference_mode():
        assert graphs.run(*args, totals=[50, 50, 50], finalize=False) is None  # three rows
        assert graphs.run(*rows([40], [15], seed=6), totals=[55], finalize=True) is None  # 55 tokens


def test_graphs_need_a_cuda_encoder_and_some_shapes(encoder):
    with pytest.raises(ValueError, match="CUDA"):
        EncoderGraphs(encoder, batches=(1,), widths=(30,))
    with pytest.raises(ValueError, match="no encoder shapes"):
        EncoderGraphs(encoder, batches=(), widths=(30,), graphs=False)


def test_graphs_whose_replay_differs_from_their_eager_run_are_left_unused(encoder, caplog):
    """Start-up checks the largest key's replay against its eager run: graphs whose replay
    differs (here, a stand-in for a broken capture) or fails are not used, and the log says so."""
    from tts_gateway.engine.cosyvoice2.serving import startup

    class Checked(EncoderGraphs):
        error = 0.0

        def capture(self):  # on a CPU: the programs run eagerly
            pass

        def replay_error(self, key):
            assert key == EncoderKey(4, 45)  # the largest
            return self.error

    def make(error):
        Checked.error = error
        return lambda: Checked(encoder, batches=(1, 2, 4), widths=(30, 45), graphs=False)

    assert isinstance(startup.checked_encoder_graphs(make(0.0), "first-chunk lane"), Checked)
    for error in (0.5, float("nan")):
        assert startup.checked_encoder_graphs(make(error), "first-chunk lane") is None
    assert "differs from its eager run" in caplog.text
    assert startup.checked_encoder_graphs(lambda: EncoderGraphs(encoder, (1,), (30,)), "first-chunk lane") is None
    assert "need the token encoder on a CUDA device" in caplog.text
