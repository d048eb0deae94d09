"""How much of the reply's text the LM had read for each speech token (word timings build on
it): the planner counts it per round, and both LM stages report it before the round's tokens.

The vLLM stage runs on the stand-in engine of test_vllm.py (vLLM's streaming-input rules on
the torch model), so its counting is checked on CPU without vLLM.
"""

from __future__ import annotations

import asyncio

import pytest

from tts_gateway.engine.cosyvoice2.serving.lm.planner import BistreamPlanner, offline_chunk
from tts_gateway.engine.cosyvoice2.serving.lm.torch_stage import TorchLMStage
from tests.engine.cosyvoice2.serving.lm.test_vllm import (  # noqa: F401 (plain_inputs: a fixture)
    PROMPT_SPEECH,
    PROMPT_TEXT,
    TEXT,
    VOCAB,
    StreamingInputEngine,
    plain_inputs,
    random_model,
    stage_on,
)

# 7 prompt text tokens and 22 prompt speech tokens take two groups of 5 text tokens: 3 of
# the reply's are read before the first round, whose budget completes the prompt's speech
# group (8 tokens); then 5 more per round of 15, and the final round reads nothing new.
# Replies are capped at 6 speech tokens per text token: 23 * 6 = 138 = 8 + 4 * 15 + 70.
EXPECTED = [(3, 8), (8, 15), (13, 15), (18, 15), (23, 15 + 70)]


def test_the_planner_counts_the_replys_text_each_round_has_read():
    planner = BistreamPlanner(VOCAB, PROMPT_TEXT, PROMPT_SPEECH, first_round_budget=True)
    read = []
    for token in TEXT:
        chunk = planner.push_text([token])
        if chunk is not None:
            read.append(chunk.text_read)
            planner.round_done([1] * chunk.max_tokens)
    read.append(planner.finish().text_read)
    assert read == [3, 8, 13, 18, 23, 23]


def test_without_a_voice_prompt_the_first_round_reads_five_tokens():
    planner = BistreamPlanner(VOCAB)
    assert [planner.push_text([t]) for t in TEXT[:4]] == [None] * 4
    assert planner.push_text([TEXT[4]]).text_read == 5
    planner.round_done([1])
    planner.push_text(TEXT[5:7])
    assert planner.finish().text_read == 7


def test_whole_text_synthesis_reads_all_of_it_at_once():
    assert offline_chunk(VOCAB, TEXT[:6], PROMPT_TEXT, PROMPT_SPEECH).text_read == 6


async def reported(stage) -> list[tuple[int, int]]:
    """(text tokens read, speech tokens delivered after it) as the stage reports them."""
    rounds: list[list[int]] = []
    done = asyncio.get_running_loop().create_future()

    def on_tokens(tokens: list[int]) -> None:
        assert rounds, "speech tokens before the text they were made with"
        rounds[-1][1] += len(tokens)

    def on_text_read(count: int) -> None:
        rounds.append([count, 0])

    stream = stage.open(PROMPT_TEXT, PROMPT_SPEECH, on_tokens, done.set_result, on_text_read=on_text_read)
    stream.push_text_ids(TEXT)
    stream.end_text()
    assert await asyncio.wait_for(done, 60) is None
    return [(read, tokens) for read, tokens in rounds]


def never_ending_model():
    """Random weights that never sample fill or eos: every round runs to its budget, the reply to its cap."""
    return random_model(seed=2, fill_bias=-100.0, eos_bias=-100.0)


async def test_the_torch_stage_reports_what_each_round_had_read():
    stage = TorchLMStage(never_ending_model())
    stage.max_speech_per_text_token = 6.0
    assert await reported(stage) == EXPECTED


@pytest.mark.parametrize("greedy", [True, False])
async def test_the_vllm_stage_reports_what_each_round_had_read(plain_inputs, greedy):  # noqa: F811
    stage = stage_on(StreamingInputEngine(never_ending_model()), greedy=greedy)
    stage.max_speech_per_text_token = 6.0
    assert await reported(stage) == EXPECTED
