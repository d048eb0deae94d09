"""Voice prefixes (serving/prefix_bank.py) against the official flow: a streaming call that
starts its decoder after its voice's stored prefix gives the official whole re-run's mel."""

from __future__ import annotations

import threading

import pytest
import torch
from torch import Tensor, nn

from tts_gateway.engine.cosyvoice2.model.cfm import N_TIMESTEPS
from tts_gateway.engine.cosyvoice2.serving.prefix_bank import (
    PrefixBank,
    decoder_prefix,
    flow_after_prefix,
    recorded_inputs,
    voice_prefix,
)
from tests.engine.cosyvoice2.flow_pairs import STEPS, TOLERANCE, decoder_inputs, max_err, official_steps, utterance


@pytest.mark.parametrize("steps", STEPS)
def test_equivalence_flow_after_voice_prefix(flow_pair, steps) -> None:
    """Streaming calls that start their decoder after the voice's stored prefix give the
    official whole re-run's mel: rows of three voices in one batch (prefixes of 2, 1 and
    no whole chunks), at token counts on and off chunk boundaries, both solving with the
    same number of Euler steps."""
    reference, ours = flow_pair
    voices = [utterance(60, 50, seed=70), utterance(30, 45, seed=71), utterance(13, 30, seed=72)]
    with torch.inference_mode():
        prefixes = [voice_prefix(ours, v.prompt_token, v.prompt_feat, v.embedding, steps) for v in voices]
    assert [p.frames for p in prefixes] == [100, 50, 0]
    # Slots in another order than the voices, one slot left empty, and room for a longer prefix.
    bank = PrefixBank(ours.decoder, 4, 150, prefixes[0].keys[0], steps)
    for slot, prefix in zip((2, 0, 3), prefixes):
        bank.put(slot, prefix)
    rows = [(0, 50), (1, 20), (0, 9), (2, 30), (1, 45)]  # (voice, tokens so far)

    def stack(tensors: list[Tensor]) -> Tensor:
        width = max(t.shape[1] for t in tensors)
        return torch.cat([nn.functional.pad(t, (0, 0) * (t.dim() - 2) + (0, width - t.shape[1])) for t in tensors])

    speech = [voices[v] for v, _ in rows]
    slots = torch.tensor([(2, 0, 3)[v] for v, _ in rows])
    batch = (
        stack([s.token[:, :n] for s, (_, n) in zip(speech, rows)]), torch.tensor([n for _, n in rows]),
        stack([s.prompt_token for s in speech]), torch.tensor([s.prompt_token.shape[1] for s in speech]),
        stack([s.prompt_feat for s in speech]), torch.tensor([s.prompt_feat.shape[1] for s in speech]),
        torch.cat([s.embedding for s in speech]),
    )
    with torch.inference_mode():
        mel, mel_len = flow_after_prefix(ours, bank, slots, *batch, streaming=True, finalize=False)
    for i, (s, (_, n)) in enumerate(zip(speech, rows)):
        with torch.inference_mode(), official_steps(reference, steps):
            expected, _ = reference.inference(*s.args(n), True, False)
        assert int(mel_len[i]) == expected.shape[2]
        assert expected.abs().max() > 1.0
        assert max_err(mel[i : i + 1, :, : expected.shape[2]], expected) <= TOLERANCE, i
    with pytest.raises(ValueError, match="streaming"):
        flow_after_prefix(ours, bank, slots, *batch, streaming=False, finalize=True)


def test_a_bank_holds_prefixes_of_its_own_step_count(cfm_pair) -> None:
    """A prefix's state is per Euler step: a bank laid out for another step count refuses it."""
    _, ours = cfm_pair
    mu, _, spks, cond = decoder_inputs(frames=50, prompt=50, seed=73)
    prefix = decoder_prefix(ours, mu, spks, cond, 0, steps=4)
    PrefixBank(ours, 1, 50, mu, steps=4).put(0, prefix)
    with pytest.raises(ValueError, match="4 Euler steps does not fit a bank of 10"):
        PrefixBank(ours, 1, 50, mu, steps=N_TIMESTEPS).put(0, prefix)


def test_prefix_inputs_are_recorded_from_the_building_thread_only(cfm_pair) -> None:
    """A prefix's attention inputs are read while it is built; the first-chunk lane may run
    the same modules meanwhile on its own thread, and those calls are not recorded."""
    _, ours = cfm_pair
    layer = ours.estimator.attention_layers[0]
    x = torch.randn(2, 10, layer.dim)
    with torch.inference_mode(), recorded_inputs(ours, True) as inputs:
        lane = threading.Thread(target=layer, args=(x + 1, None, None))
        lane.start()
        lane.join()
        layer(x, None, None)
    assert len(inputs) == 1 and torch.equal(inputs[0], x)
    layer(x, None, None)
    assert len(inputs) == 1  # the hooks are gone
