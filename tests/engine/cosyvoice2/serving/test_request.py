"""An utterance's request: its status only moves forward, along the state machine's edges."""

from __future__ import annotations

import pytest

from tts_gateway.engine.cosyvoice2.serving.request import Request, RequestStatus

S = RequestStatus
FORWARD = [S.OPEN, S.INPUT_ENDED, S.TOKENS_DONE, S.FINISHED]


def request_at(status: RequestStatus) -> Request:
    return Request(prompt=None, stream=None, output=None, status=status)


def test_a_request_goes_from_open_to_finished_one_step_at_a_time():
    request = request_at(S.OPEN)
    for status in FORWARD[1:]:
        request.advance(status)
        assert request.status is status
    assert request.status.ended


@pytest.mark.parametrize("start", FORWARD[:-1])
@pytest.mark.parametrize("end", [S.CANCELLED, S.FAILED])
def test_any_request_not_ended_can_be_cancelled_or_fail(start, end):
    request = request_at(start)
    assert not request.status.ended
    request.advance(end)
    assert request.status is end and request.status.ended


@pytest.mark.parametrize(("start", "to"), [
    (S.OPEN, S.TOKENS_DONE),  # speech ends only after its text has
    (S.OPEN, S.FINISHED),
    (S.INPUT_ENDED, S.FINISHED),  # the last chunk comes after the last token
    (S.TOKENS_DONE, S.INPUT_ENDED),  # never backwards
    (S.FINISHED, S.CANCELLED),  # an ended request stays as it ended
    (S.CANCELLED, S.FAILED),
    (S.FAILED, S.FINISHED),
    (S.OPEN, S.OPEN),
])
def test_moves_the_state_machine_does_not_have_are_refused(start, to):
    request = request_at(start)
    with pytest.raises(ValueError, match=f"{start.value} cannot become {to.value}"):
        request.advance(to)
    assert request.status is start


def test_each_request_has_its_own_id():
    assert len({request_at(S.OPEN).request_id for _ in range(5)}) == 5
