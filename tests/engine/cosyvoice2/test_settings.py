"""The CosyVoice2 engine's settings refuse values it cannot run with, saying which and why
(the config loader names the key: tests/gateway/test_config.py)."""

from __future__ import annotations

import pytest

from tts_gateway.engine.cosyvoice2.settings import CosyVoice2Settings


@pytest.mark.parametrize("flow_steps", [0, -3, 2.5, True, "10"])
def test_flow_steps_must_be_a_whole_number_of_at_least_one(flow_steps):
    with pytest.raises(ValueError, match=r"flow_steps must be an integer >= 1 \(10 is the official count\), got"):
        CosyVoice2Settings(flow_steps=flow_steps)


def test_flow_steps_default_to_the_official_count():
    assert CosyVoice2Settings().flow_steps == 10
    assert CosyVoice2Settings(flow_steps=4).flow_steps == 4


def test_the_docs_give_every_switch_its_default():
    """docs/cosyvoice2.md's settings tables give each on/off setting (engine and vLLM stage) the
    default it has: a switch whose default flips is documented as flipped."""
    import dataclasses
    import re

    from tts_gateway.engine.cosyvoice2.settings import VLLMSettings
    from tests.paths import ROOT

    documented: dict[str, str] = {}
    for line in (ROOT / "docs" / "cosyvoice2.md").read_text().splitlines():
        row = re.match(r"\| `(\w+)` \| ([^|]*) \|", line)
        if row:
            documented.setdefault(row[1], row[2].strip())  # the settings tables come first
    switches = {field.name: field.default for settings in (CosyVoice2Settings, VLLMSettings)
                for field in dataclasses.fields(settings) if isinstance(field.default, bool)}
    assert len(switches) >= 10
    assert {name: documented.get(name) for name in switches} == {
        name: str(default).lower() for name, default in switches.items()}
