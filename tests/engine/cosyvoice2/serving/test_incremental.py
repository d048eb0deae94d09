"""Incremental streaming (serving/incremental.py) against the official flow: keeping an
utterance's flow state and computing only new frames gives what the official streaming loop
gives when it re-runs the whole flow for every chunk."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor, nn

from tts_gateway.engine.cosyvoice2.serving.incremental import CFMStreamCache, FlowStreamCache, forward_chunk, inference_chunk
from tests.engine.cosyvoice2.flow_pairs import (
    STEPS, TOLERANCE, Utterance, decoder_inputs, max_err, official_steps, utterance,
)


@pytest.mark.parametrize("steps", STEPS)
def test_chunk_causality_flow_decoder_incremental(cfm_pair, steps) -> None:
    """forward_chunk (serving/incremental.py) over growing prefixes returns the same mel as a full
    re-run per prefix, with the cache's number of Euler steps."""
    _, ours = cfm_pair
    total = 210
    mu, mask, spks, cond = decoder_inputs(frames=total, prompt=36, seed=30)
    cache = CFMStreamCache(steps)
    chunk = ours.config.estimator.static_chunk_size
    ends = [86, 150, 175, 210]  # boundaries on and off the 50-frame grid
    for end in ends:
        start = cache.committed[0] if cache.started else 0
        commit = (end // chunk) * chunk - start
        with torch.inference_mode():
            expected = ours(mu[:, :, :end], mask[:, :, :end], spks, cond[:, :, :end], streaming=True, n_timesteps=steps)
            got = forward_chunk(
                ours, cache, mu[:, :, start:end], mask[:, :, start:end], spks, cond[:, :, start:end],
                ours.noise[:, :, start:end], [start], [commit],
            )
        assert max_err(got, expected[:, :, start:end]) <= 1e-5, end
        assert cache.committed == [(end // chunk) * chunk]


def official_stream(reference: nn.Module, speech: Utterance, hops: list[int]) -> list[Tensor]:
    """The official CosyVoice2 streaming loop: for every hop, re-run the flow on prompt + all
    tokens so far (+ 3 look-ahead tokens) and keep the frames after the previous hop;
    finally run once more with finalize=True."""
    pieces, offset = [], 0
    for hop in hops:
        n = offset + hop + 3
        mel, _ = reference.inference(*speech.args(n), True, False)
        pieces.append(mel[:, :, 2 * offset :])
        offset += hop
    mel, _ = reference.inference(*speech.args(), True, True)
    pieces.append(mel[:, :, 2 * offset :])
    return pieces


@pytest.mark.parametrize("steps", STEPS)
def test_equivalence_flow_incremental(flow_pair, steps) -> None:
    """``inference_chunk`` (serving/incremental.py) computes only the frames after the last complete chunk and
    returns exactly what the official full re-run returns, chunk by chunk, both solving with
    the same number of Euler steps.

    Measured: max abs diff <= 2.4e-6 for both the official chunking (first hop padded so
    that prompt + tokens end on a 25-token boundary) and arbitrary hop sizes.
    """
    reference, ours = flow_pair
    speech = utterance(prompt=13, tokens=130, seed=60)
    aligned = [25 + (-13) % 25, 25, 25, 25]
    for hops in (aligned, [17, 30, 9, 40]):
        with torch.inference_mode(), official_steps(reference, steps):
            expected = official_stream(reference, speech, hops)
        cache, offset = FlowStreamCache(steps), 0
        for i, hop in enumerate(hops + [None]):
            final = hop is None
            n = speech.token.shape[1] if final else offset + hop + 3
            with torch.inference_mode():
                mel, mel_len = inference_chunk(ours, cache, *speech.args(n), finalize=final)
            assert mel.shape[2] == int(mel_len[0]) == expected[i].shape[2]
            assert max_err(mel, expected[i]) <= TOLERANCE, (hops, i)
            offset += 0 if final else hop
        # Only whole chunks were ever cached: decoder and encoder agree on where they end.
        assert cache.decoder.committed[0] % 50 == 0
        assert cache.decoder.committed[0] == 2 * cache.encoder[0].committed or cache.encoder[0].finished


def test_equivalence_flow_incremental_batched(flow_pair) -> None:
    """Two sessions (different prompts and hop sizes) streamed in one cache: each equals its official stream."""
    reference, ours = flow_pair
    sessions = [utterance(13, 90, seed=70), utterance(30, 70, seed=71)]
    hops = [[37, 25, 20], [20, 30, 10]]
    with torch.inference_mode():
        expected = [official_stream(reference, s, h) for s, h in zip(sessions, hops)]
    cache, offsets = FlowStreamCache(), [0, 0]
    for step in range(len(hops[0]) + 1):
        final = step == len(hops[0])
        counts = [s.token.shape[1] if final else o + h[step] + 3 for s, o, h in zip(sessions, offsets, hops)]
        parts = [s.args(n) for s, n in zip(sessions, counts)]
        token = torch.zeros(2, max(counts), dtype=torch.long)
        for row, n in enumerate(counts):
            token[row, :n] = parts[row][0][0]
        prompt_token = torch.zeros(2, 30, dtype=torch.long)
        prompt_feat = torch.zeros(2, 60, 80)
        for row, s in enumerate(sessions):
            prompt_token[row, : s.prompt_token.shape[1]] = s.prompt_token[0]
            prompt_feat[row, : s.prompt_feat.shape[1]] = s.prompt_feat[0]
        with torch.inference_mode():
            mel, mel_len = inference_chunk(ours, 
                cache, token, torch.tensor(counts), prompt_token, torch.tensor([13, 30]), prompt_feat,
                torch.tensor([26, 60]), torch.cat([s.embedding for s in sessions]), finalize=final,
            )
        for row in range(2):
            want = expected[row][step]
            assert int(mel_len[row]) == want.shape[2]
            assert max_err(mel[row : row + 1, :, : want.shape[2]], want) <= TOLERANCE, (step, row)
        if not final:
            offsets = [o + h[step] for o, h in zip(offsets, hops)]
def test_equivalence_flow_empty_prompt(flow_pair) -> None:
    """No prompt (no prompt tokens, no prompt mel): whole and incremental inference."""
    reference, ours = flow_pair
    speech = Utterance(
        prompt_token=torch.zeros(1, 0, dtype=torch.long),
        token=torch.randint(0, 100, (1, 60), generator=torch.Generator().manual_seed(42)),
        prompt_feat=torch.zeros(1, 0, 80),
        embedding=torch.randn(1, 192, generator=torch.Generator().manual_seed(43)),
    )
    with torch.inference_mode():
        expected, _ = reference.inference(*speech.args(), False, True)
        got = ours.inference(*speech.args(), streaming=False, finalize=True)
        assert max_err(got, expected) <= TOLERANCE
        cache = FlowStreamCache()
        for (n, final), want in zip(((28, False), (60, True)), official_stream(reference, speech, [25])):
            mel, _ = inference_chunk(ours, cache, *speech.args(n), finalize=final)
            assert max_err(mel, want) <= TOLERANCE
