"""Turn state in the paged pool (serving/turn_pool.py) against the official flow: a turn whose
calls start after its voice prefix and its stored chunks gives, at every call, the official
streaming re-run's mel over all tokens so far (``finalize`` on the last call)."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor, nn

from tts_gateway.engine.cosyvoice2.model.cfm import N_TIMESTEPS
from tts_gateway.engine.cosyvoice2.serving.prefix_bank import PrefixBank, flow_after_prefix, voice_prefix
from tts_gateway.engine.cosyvoice2.serving.turn_pool import (
    TABLE_PAGES,
    TurnRows,
    TurnStatePool,
    flow_paged,
    solve_paged,
)
from tests.engine.cosyvoice2.flow_pairs import STEPS, TOLERANCE, max_err, official_steps, utterance


def stack(tensors: list[Tensor]) -> Tensor:
    width = max(t.shape[1] for t in tensors)
    return torch.cat([nn.functional.pad(t, (0, 0) * (t.dim() - 2) + (0, width - t.shape[1])) for t in tensors])


def call_args(voices: list, counts: list[int]) -> tuple[Tensor, ...]:
    """``Flow.decoder_inputs``' arguments for a call of these voices' rows, ``counts[b]`` tokens each."""
    return (
        stack([v.token[:, :n] for v, n in zip(voices, counts)]), torch.tensor(counts),
        stack([v.prompt_token for v in voices]), torch.tensor([v.prompt_token.shape[1] for v in voices]),
        stack([v.prompt_feat for v in voices]), torch.tensor([v.prompt_feat.shape[1] for v in voices]),
        torch.cat([v.embedding for v in voices]),
    )


def whole(ours, args: tuple[Tensor, ...], finalize: bool | list[bool]):
    """A paged call's decoder inputs from its rows' tokens encoded whole (``call_args``), each
    row finalized or not, and the rows' end frames (read back here; the runner counts them)."""
    flags = torch.tensor(finalize) if isinstance(finalize, list) else finalize

    def inputs_from(starts: list[int]):
        inputs = ours.decoder_inputs(*args, True, flags, start=torch.tensor(starts))
        return inputs, [s + n for s, n in zip(starts, inputs.mask[:, 0].sum(dim=1).long().tolist())]

    return inputs_from


def voices_bank(ours, voices: list, steps: int = N_TIMESTEPS) -> PrefixBank:
    """A bank of these voices' prefixes, slot b for voice b, kept with their layer inputs."""
    with torch.inference_mode():
        prefixes = [voice_prefix(ours, v.prompt_token, v.prompt_feat, v.embedding, steps, True) for v in voices]
    bank = PrefixBank(ours.decoder, len(voices), 100, prefixes[0].keys[0], steps, keep_inputs=True)
    for slot, prefix in enumerate(prefixes):
        bank.put(slot, prefix)
    return bank


def row_errors(
    reference, voices: list, counts: list[int], finals: list[bool], result, steps: int = N_TIMESTEPS,
    recomputed: Tensor | None = None,
) -> list[float]:
    """Each row of a paged call (``counts[b]`` tokens, ``finals[b]``: its turn's last chunk)
    against the official streaming re-run; a row the call did not serve is read from
    ``recomputed`` (the same call by recompute after the voice prefix)."""
    served = [b for b, s in enumerate(result.served) if s]
    errors = []
    for b, (voice, n, finalize) in enumerate(zip(voices, counts, finals)):
        with torch.inference_mode(), official_steps(reference, steps):
            expected, _ = reference.inference(*voice.args(n), True, finalize)
        prompt = voice.prompt_feat.shape[1]
        start, end = int(result.start[b]), int(result.end[b])
        assert end - prompt == expected.shape[2]
        first = max(start, prompt)
        assert expected[:, :, first - prompt :].abs().max() > 1.0
        if b in served:
            row = served.index(b)
            got = result.mel[row : row + 1, :, first - start : end - start]
        else:
            got = recomputed[b : b + 1, :, first - prompt : end - prompt]
        errors.append(max_err(got, expected[:, :, first - prompt :]))
    return errors


def stream_turns(reference, ours, pool_pages: int, steps: int = N_TIMESTEPS) -> tuple[TurnStatePool, list[float]]:
    """Two turns of different voices streamed in shared calls, each call compared with the
    official streaming re-run at that row's token count, both solving with ``steps`` Euler
    steps (a row the pool cannot serve runs after its voice prefix by recompute, as the runner
    does); returns the pool and the errors."""
    voices = [utterance(60, 140, seed=80), utterance(30, 120, seed=81)]
    bank = voices_bank(ours, voices, steps)
    pool = TurnStatePool(ours.decoder, pool_pages, bank.keys[0], steps)
    slots = [0, 1]
    # Token counts per call: on and off chunk boundaries, rows at different points of their turn.
    calls = [(18, 23), (43, 48), (44, 73), (93, 98), (140, 120)]
    turns = [None, None]
    errors = []
    for k, counts in enumerate(calls):
        finalize = k == len(calls) - 1
        args = call_args(voices, counts)
        result, turns = flow_paged(ours, bank, pool, slots, turns, whole(ours, args, finalize), keep=[not finalize] * 2)
        recomputed = None
        if not all(result.served):
            with torch.inference_mode():
                recomputed, _ = flow_after_prefix(ours, bank, torch.tensor(slots), *args, finalize=finalize)
        errors += row_errors(reference, voices, counts, [finalize] * 2, result, steps, recomputed)
    for turn in turns:
        if turn is not None:
            pool.release(turn)
    return pool, errors


def one_voice(ours, tokens: int, seed: int):
    """A voice (a 60-token prompt, ``tokens`` more), its prefix (100 frames), and a bank of one
    slot holding it."""
    voice = utterance(60, tokens, seed=seed)
    with torch.inference_mode():
        prefix = voice_prefix(ours, voice.prompt_token, voice.prompt_feat, voice.embedding, keep_inputs=True)
    bank = PrefixBank(ours.decoder, 1, 100, prefix.keys[0], keep_inputs=True)
    bank.put(0, prefix)
    return voice, prefix, bank


@pytest.mark.parametrize("steps", STEPS)
def test_equivalence_paged_turns_with_the_official_streaming_flow(flow_pair, steps) -> None:
    """Every call of two turns batched together (different prefixes, ending inside a page,
    different numbers of stored frames, partial chunks recomputed) equals the official streaming
    re-run, the last call with finalize, both solving with the same number of Euler steps;
    the turns' pages all go back at the end."""
    reference, ours = flow_pair
    pool, errors = stream_turns(reference, ours, pool_pages=64, steps=steps)
    assert max(errors) <= TOLERANCE, errors
    assert pool.peak_pages >= 30  # both turns kept their frames (rather than recomputing)
    assert pool.fallbacks == 0
    assert pool.pages_in_use == 0


def test_a_full_pool_falls_back_to_recompute_exactly(flow_pair) -> None:
    """With room for the voice prefixes and a few pages, a turn that cannot grow gives its
    pages back and goes on by recompute: the same mel."""
    reference, ours = flow_pair
    pool, errors = stream_turns(reference, ours, pool_pages=20)
    assert max(errors) <= TOLERANCE, errors
    assert pool.fallbacks > 0
    assert 0 < pool.peak_pages <= 9  # 11 of the 20 pages hold the two voice prefixes
    assert pool.pages_in_use == 0


def test_pool_budget_and_bookkeeping(flow_pair) -> None:
    _, ours = flow_pair
    like = next(ours.parameters())
    page = TurnStatePool.page_bytes(ours.decoder, like.dtype)
    pool = TurnStatePool.within(ours.decoder, 9 * page, like)
    assert pool.pages == 8 and pool.turn_slots == 2
    assert abs(pool.nbytes - 9 * page) <= page  # a turn slot's share of conv context is rounded
    turn = pool.grow(None, 3)
    assert turn is not None and len(turn.pages) == 3 and pool.pages_in_use == 3
    assert pool.grow(turn, 6) is None and len(turn.pages) == 3
    other = pool.grow(None, 1)
    assert pool.grow(None, 1) is None  # two turn slots
    pool.release(turn)
    assert pool.fall_back(other).fell_back and pool.fall_back(None).fell_back
    assert pool.pages_in_use == 0 and pool.peak_pages == 4 and pool.fallbacks == 2
    # Room for a turn (one that fell back, to come back): as a new turn is admitted (one page of
    # the eight kept free), within the page table; asking takes nothing.
    assert pool.pages_between(20, 100) == 6 and pool.pages_between(16, 16) == 0  # pages 1..6, 1..0
    assert pool.has_room(0, 7 * 16) and not pool.has_room(0, 8 * 16)
    assert not pool.has_room(0, (TABLE_PAGES + 1) * 16)
    assert pool.pages_in_use == 0
    held = pool.grow(None, 5)
    assert not pool.has_room(0, 3 * 16) and pool.has_room(0, 2 * 16)
    pool.release(held)
    pool.count_return()
    assert pool.totals()["returns"] == 1
    with pytest.raises(ValueError, match="no page"):
        TurnStatePool.within(ours.decoder, page, like)
    # State is kept per Euler step: a page of 4 steps is 4/10 of one of the official 10.
    assert abs(10 * TurnStatePool.page_bytes(ours.decoder, like.dtype, 4) - 4 * page) < 10


def test_voice_prefix_pages_follow_the_bank(flow_pair) -> None:
    """A voice prefix is copied into pages once per bank slot and generation: a slot written
    again is copied again, into new pages, and the old ones go back."""
    _, ours = flow_pair
    _, prefix, bank = one_voice(ours, 10, seed=82)
    pool = TurnStatePool(ours.decoder, 16, prefix.keys[0])
    pages = pool.prefix_pages(bank, 0)
    assert len(pages) == 7  # 100 frames in pages of 16
    assert pool.prefix_pages(bank, 0) is pages
    # Page 2 of step 3, unconditioned row, of the second layer: frames 32-47 of the prefix.
    stored = pool.inputs[1].view(N_TIMESTEPS, 2, 17, 16, *pool.inputs[1].shape[2:])[3, 1, pages[2], :, 0]
    layers = len(ours.decoder.estimator.attention_layers)
    assert torch.equal(stored, prefix.inputs[3 * layers + 1][1, 32:48])
    bank.put(0, prefix)
    again = pool.prefix_pages(bank, 0)
    assert again is not pages and len(again) == 7 and pool.pages_in_use == 0


def test_a_pool_folds_the_attention_layers_for_paged_calls(flow_pair) -> None:
    """Paged calls attend over layer inputs through the folded projections: the pool folds them."""
    _, ours = flow_pair
    layers = ours.decoder.estimator.attention_layers
    for layer in layers:
        layer.qk_weight = layer.vo_weight = None  # as built, whatever pools earlier tests made
    TurnStatePool(ours.decoder, 1, next(ours.parameters()), steps=1)
    assert all(layer.qk_weight is not None and layer.vo_weight is not None for layer in layers)


def test_a_pool_and_a_bank_of_other_step_counts_are_refused(flow_pair) -> None:
    """A paged call reads the bank's and the pool's state at the same Euler step: both must be
    laid out for as many steps."""
    _, ours = flow_pair
    like = next(ours.parameters())
    bank = PrefixBank(ours.decoder, 1, 50, like, steps=4)
    pool = TurnStatePool(ours.decoder, 2, like, steps=N_TIMESTEPS)
    index = torch.zeros(1, dtype=torch.long)
    rows = TurnRows(index, index[:, None], index, index, index)
    mu = like.new_zeros(1, 80, 50)
    with pytest.raises(ValueError, match="a bank of 4 Euler steps with a pool of 10"):
        solve_paged(ours.decoder, bank, pool, rows, mu, like.new_ones(1, 1, 50), like.new_zeros(1, 80), mu)


def test_a_failed_call_gives_back_the_turns_it_made(flow_pair) -> None:
    """A decoder that raises (a GPU error, say) leaves no pages held by turns the call made,
    which no request holds yet; a turn that existed before keeps its pages for its owner
    to release."""
    _, ours = flow_pair
    voice, prefix, bank = one_voice(ours, 80, seed=83)
    pool = TurnStatePool(ours.decoder, 32, prefix.keys[0])
    older = pool.grow(None, 2)
    args = call_args([voice, voice], [40, 40])

    def failing(*_):
        raise RuntimeError("the decoder failed")

    with pytest.raises(RuntimeError, match="the decoder failed"):
        flow_paged(ours, bank, pool, [0, 0], [None, older], whole(ours, args, False), [True, True],
                   solve=failing)
    assert pool.pages_in_use == len(older.pages) > 2  # the older turn grew; the new one is gone
    pool.release(older)
    assert pool.pages_in_use == 0


def test_prefix_copies_of_voices_the_bank_dropped_are_freed(flow_pair) -> None:
    """When a prefix is copied into the pool, copies of prefixes the bank no longer holds (a
    slot written again, or a bank replaced) give their pages back."""
    _, ours = flow_pair
    _, prefix, _ = one_voice(ours, 10, seed=84)
    pool = TurnStatePool(ours.decoder, 20, prefix.keys[0])
    old_bank = PrefixBank(ours.decoder, 2, 100, prefix.keys[0], keep_inputs=True)
    old_bank.put(0, prefix)
    old_bank.put(1, prefix)
    pool.prefix_pages(old_bank, 0)
    pool.prefix_pages(old_bank, 1)
    assert pool.pages - len(pool._free_pages) == 14
    new_bank = PrefixBank(ours.decoder, 2, 100, prefix.keys[0], keep_inputs=True)
    new_bank.put(0, prefix)
    assert len(pool.prefix_pages(new_bank, 0)) == 7
    assert pool.pages - len(pool._free_pages) == 7  # both of the old bank's copies went back


def test_a_last_chunk_shares_a_paged_call_with_another_turns_later_chunk(flow_pair) -> None:
    """``finalize`` per row: one turn's last chunk and another's later chunk in one call each
    equal the official streaming re-run (the last with finalize); the later one goes on."""
    reference, ours = flow_pair
    voices = [utterance(60, 60, seed=85), utterance(30, 120, seed=86)]
    bank = voices_bank(ours, voices)
    pool = TurnStatePool(ours.decoder, 64, bank.keys[0])
    slots = [0, 1]
    turns = [None, None]
    errors = []
    for counts, finals in (([40, 48], [False, False]), ([60, 98], [True, False])):
        args = call_args(voices, counts)
        inputs_from = whole(ours, args, finals)
        result, turns = flow_paged(ours, bank, pool, slots, turns, inputs_from, keep=[not f for f in finals])
        assert all(result.served)
        errors += row_errors(reference, voices, counts, finals, result)
    assert max(errors) <= TOLERANCE, errors
    assert [turn.frames for turn in turns] == [50, 200]  # the last chunk committed nothing
    for turn in turns:
        pool.release(turn)
