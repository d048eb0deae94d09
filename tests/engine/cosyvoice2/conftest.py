"""Fixtures of the CosyVoice2 tests: the official flow decoder and flow beside ours, same weights."""

from __future__ import annotations

import pytest
from torch import nn

from tts_gateway.engine.cosyvoice2.model.cfm import CFM
from tts_gateway.engine.cosyvoice2.model.flow import Flow
from tts_gateway.engine.cosyvoice2.modeldir.configs import CFMConfig, FlowConfig
from tests.engine.cosyvoice2.flow_pairs import official_cfm, official_flow, randomize_


@pytest.fixture(scope="module")
def cfm_pair() -> tuple[nn.Module, CFM]:
    reference = randomize_(official_cfm(CFMConfig.tiny()), seed=1)
    ours = CFM(CFMConfig.tiny()).eval()
    ours.load_state_dict(reference.state_dict(), strict=True)
    return reference, ours


@pytest.fixture(scope="module")
def flow_pair() -> tuple[nn.Module, Flow]:
    reference = randomize_(official_flow(FlowConfig.tiny()), seed=7)
    ours = Flow(FlowConfig.tiny()).eval()
    ours.load_state_dict(reference.state_dict(), strict=True)
    return reference, ours
