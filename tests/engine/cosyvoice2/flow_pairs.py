"""The official flow and ours at tiny size, with the same random weights, and inputs for them:
what the flow's equivalence tests (model/, serving/) compare. The pairs themselves are the
``cfm_pair`` and ``flow_pair`` fixtures (conftest.py beside this file).

The official module gets a non-trivial random value for every parameter; its state dict
loads strictly into ours, so both compute with the same weights.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator

import torch
from torch import Tensor, nn

from tts_gateway.engine.cosyvoice2.model.cfm import N_TIMESTEPS
from tts_gateway.engine.cosyvoice2.modeldir.configs import CFMConfig, EstimatorConfig, FlowConfig
from tests.reference import official, randomize

TOLERANCE = 1e-4
# Euler step counts the serving paths are compared at: the official one, and another that the
# flow_steps setting may ask for.
STEPS = (N_TIMESTEPS, 4)


def randomize_(module: nn.Module, seed: int) -> nn.Module:
    return randomize(module, seed, spread=0.1)


def official_estimator(config: EstimatorConfig) -> nn.Module:
    decoder = official("cosyvoice.flow.decoder")
    return decoder.CausalConditionalDecoder(**dataclasses.asdict(config))


def official_cfm(config: CFMConfig) -> nn.Module:
    from omegaconf import DictConfig

    flow_matching = official("cosyvoice.flow.flow_matching")
    return flow_matching.CausalConditionalCFM(
        in_channels=config.in_channels,
        n_spks=config.n_spks,
        spk_emb_dim=config.spk_emb_dim,
        cfm_params=DictConfig(dataclasses.asdict(config.cfm_params)),
        estimator=official_estimator(config.estimator),
    )


def max_err(a: Tensor, b: Tensor) -> float:
    assert a.shape == b.shape, (a.shape, b.shape)
    return (a - b).abs().max().item()


def decoder_inputs(frames: int, prompt: int, seed: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """mu, mask, spks, cond for one row: cond holds a 'prompt mel' in the first frames."""
    generator = torch.Generator().manual_seed(seed)
    mu = torch.randn(1, 80, frames, generator=generator)
    spks = torch.randn(1, 80, generator=generator)
    cond = torch.zeros(1, 80, frames)
    cond[:, :, :prompt] = torch.randn(1, 80, prompt, generator=generator)
    return mu, torch.ones(1, 1, frames), spks, cond


def official_flow(config: FlowConfig) -> nn.Module:
    encoder = official("cosyvoice.transformer.upsample_encoder").UpsampleConformerEncoder(
        **dataclasses.asdict(config.encoder)
    )
    arguments = {
        f.name: getattr(config, f.name) for f in dataclasses.fields(config) if f.name not in ("encoder", "decoder")
    }
    flow = official("cosyvoice.flow.flow")
    return flow.CausalMaskedDiffWithXvec(**arguments, encoder=encoder, decoder=official_cfm(config.decoder))


@contextlib.contextmanager
def official_steps(flow: nn.Module, steps: int) -> Iterator[nn.Module]:
    """The official flow with its decoder solving in ``steps`` Euler steps, within the block.

    Its ``inference`` always asks the decoder for 10 (the released count); the decoder itself
    takes any ``n_timesteps``, so its forward is wrapped to ask for ``steps`` instead: the
    official computation at another step count, to compare ours with (flow_steps)."""
    decoder = flow.decoder
    released = decoder.forward
    decoder.forward = lambda *args, **kwargs: released(*args, **(kwargs | {"n_timesteps": steps}))
    try:
        yield flow
    finally:
        del decoder.forward  # the class's forward again


@dataclasses.dataclass
class Utterance:
    prompt_token: Tensor  # [1, P]
    token: Tensor  # [1, N]
    prompt_feat: Tensor  # [1, 2P, 80]
    embedding: Tensor  # [1, 192]

    def args(self, tokens: int | None = None) -> tuple[Tensor, ...]:
        """Official ``inference`` arguments up to ``embedding``, with the first ``tokens`` new tokens."""
        n = self.token.shape[1] if tokens is None else tokens
        p = self.prompt_token.shape[1]
        return (
            self.token[:, :n], torch.tensor([n]), self.prompt_token, torch.tensor([p]),
            self.prompt_feat, torch.tensor([2 * p]), self.embedding,
        )


def utterance(prompt: int, tokens: int, seed: int, vocab: int = 100) -> Utterance:
    generator = torch.Generator().manual_seed(seed)
    return Utterance(
        prompt_token=torch.randint(0, vocab, (1, prompt), generator=generator),
        token=torch.randint(0, vocab, (1, tokens), generator=generator),
        prompt_feat=torch.randn(1, 2 * prompt, 80, generator=generator),
        embedding=torch.randn(1, 192, generator=generator),
    )
