"""The wire module (gateway/wire.py) is the one definition of the protocol: the gateway's
state machine sends exactly the frames it describes and follows its error rules (the client
reads the same rules; tests/gateway/test_client.py holds it to them)."""

from __future__ import annotations

import pytest

from tts_gateway.gateway.protocol import CloseSession
from tts_gateway.gateway.wire import (
    CLIENT_FIELDS,
    CONTEXT_SURVIVING_CODES,
    GATEWAY_FIELDS,
    SESSION_ENDING_CODES,
    ClientMessage,
    ErrorCode,
    GatewayMessage,
)
from tests.gateway.test_protocol import Word, frames, make_session, msg, only_error, tone


def test_every_frame_the_gateway_sends_has_exactly_the_wire_fields():
    session = make_session(default_sample_rate=22050)
    sent = [*session.open({}, 0.0)]
    sent += session.receive_message(msg(type="text", context_id="a", text="Hello"), now=0.0)
    sent += session.audio_ready(0, tone(0.1), [Word("Hello", 0.0, 0.1)], 0.01, now=0.1)
    sent += session.receive_message(msg(type="end", context_id="a"), now=0.2)
    sent += session.utterance_finished(0, now=0.3)
    sent += session.receive_message(msg(type="text", context_id="b", text="Hi"), now=0.4)
    sent += session.receive_message(msg(type="cancel", context_id="b"), now=0.5)
    sent += session.receive_message(msg(type="flush", context_id="b"), now=0.6)  # no longer open: an error
    for frame in frames(sent):
        assert set(frame) == GATEWAY_FIELDS[frame["type"]], frame
    assert {frame["type"] for frame in frames(sent)} == set(GatewayMessage)


@pytest.mark.parametrize("kind", list(ClientMessage))
def test_a_client_message_takes_exactly_the_wire_fields(kind):
    values = {"type": kind, "context_id": "c", "text": "Hi", "voice": "joe", "sample_rate": 24000,
              "encoding": "pcm_s16le", "speed": 1.0}
    session = make_session()
    session.receive_message(msg(type="text", context_id="c", text="Hi", voice="joe", sample_rate=24000,
                                encoding="pcm_s16le", speed=1.0), now=0.0)
    with_all = {name: values[name] for name in CLIENT_FIELDS[kind]}
    assert frames(session.receive_message(msg(**with_all, colour="blue"), now=0.1), "error")[0]["code"] == (
        "bad_message"
    )
    assert frames(session.receive_message(msg(**with_all), now=0.2), "error") == []


def _open(session):
    session.receive_message(msg(type="text", context_id="c", text="Hi"), now=0.0)


def _open_and_end(session):
    _open(session)
    session.receive_message(msg(type="end", context_id="c"), now=0.0)


def _open_and_drain(session):
    _open(session)
    session.start_drain()


def _open_two(session):  # the session's limit in make_session
    _open(session)
    session.receive_message(msg(type="text", context_id="d", text="Hi"), now=0.0)


# (code, what comes before, the step that draws the error): one case for every code a
# context can get.
CONTEXT_ERRORS = [
    (ErrorCode.BAD_MESSAGE, _open_and_end, lambda s: s.receive_message(msg(type="text", context_id="c", text="x"), 1)),
    (ErrorCode.TEXT_TOO_LONG, _open, lambda s: s.receive_message(msg(type="text", context_id="c", text="x" * 60), 1)),
    (ErrorCode.UNKNOWN_VOICE, _open, lambda s: s.receive_message(msg(type="text", context_id="e", text="x",
                                                                     voice="nobody"), 1)),
    (ErrorCode.UNSUPPORTED_FORMAT, _open, lambda s: s.receive_message(msg(type="text", context_id="e", text="x",
                                                                          encoding="mp3"), 1)),
    (ErrorCode.TOO_MANY_CONTEXTS, _open_two, lambda s: s.receive_message(msg(type="text", context_id="e", text="x"), 1)),
    (ErrorCode.UNKNOWN_CONTEXT, _open, lambda s: s.receive_message(msg(type="flush", context_id="e"), 1)),
    (ErrorCode.OVERLOADED, _open_and_drain, lambda s: s.receive_message(msg(type="text", context_id="e", text="x"), 1)),
    (ErrorCode.INTERNAL, _open, lambda s: s.utterance_failed(0, "boom")),
]


@pytest.mark.parametrize("code, before, step", CONTEXT_ERRORS, ids=[str(case[0]) for case in CONTEXT_ERRORS])
def test_a_context_outlives_an_error_exactly_when_the_wire_says(code, before, step):
    session = make_session()
    before(session)
    open_before = set(session.contexts)
    error = only_error(step(session))
    assert error["code"] == code
    context_id = error["context_id"]
    survives = context_id in open_before and code in CONTEXT_SURVIVING_CODES
    assert (context_id in session.contexts) == survives
    assert not session.closed


def test_every_code_a_context_can_get_has_a_case_above():
    # engine_failed ends every context and then the session: test_engine_failure_ends_... below.
    assert {case[0] for case in CONTEXT_ERRORS} == set(ErrorCode) - {ErrorCode.IDLE_TIMEOUT, ErrorCode.ENGINE_FAILED}


def test_engine_failure_ends_every_context_then_the_session_as_the_wire_says():
    session = make_session()
    _open_two(session)
    actions = session.engine_failed("the backend died")
    errors = frames(actions, "error")
    assert [(e["code"], e["context_id"]) for e in errors] == [
        (ErrorCode.ENGINE_FAILED, "c"), (ErrorCode.ENGINE_FAILED, "d"), (ErrorCode.ENGINE_FAILED, None)
    ]
    assert ErrorCode.ENGINE_FAILED not in CONTEXT_SURVIVING_CODES and session.contexts == {}
    closes = [action.code for action in actions if isinstance(action, CloseSession)]
    assert closes == [SESSION_ENDING_CODES[ErrorCode.ENGINE_FAILED]] and session.closed


SESSION_ERRORS = [
    (ErrorCode.BAD_MESSAGE, lambda s: s.receive_message("not json", now=1.0)),
    (ErrorCode.IDLE_TIMEOUT, lambda s: s.check_idle(now=1e6)),
    (ErrorCode.OVERLOADED, lambda s: s.client_not_reading()),
    (ErrorCode.ENGINE_FAILED, lambda s: s.engine_failed("the backend died")),
]


@pytest.mark.parametrize("code, step", SESSION_ERRORS, ids=[str(case[0]) for case in SESSION_ERRORS])
def test_a_session_error_after_ready_ends_the_session_exactly_when_the_wire_says(code, step):
    session = make_session()
    session.open({}, 0.0)
    _open(session)
    actions = step(session)
    # engine_failed first ends each open context with an error of its own.
    error = only_error([a for a in actions if not (hasattr(a, "frame") and a.frame.get("context_id"))])
    assert (error["code"], error["context_id"]) == (code, None)
    closes = [action.code for action in actions if isinstance(action, CloseSession)]
    if code in SESSION_ENDING_CODES:
        assert closes == [SESSION_ENDING_CODES[code]] and session.contexts == {} and session.closed
    else:
        assert closes == [] and "c" in session.contexts and not session.closed


def test_every_session_ending_code_has_a_case_above():
    assert set(SESSION_ENDING_CODES) <= {case[0] for case in SESSION_ERRORS}


def test_control_character_rule_is_one_function_for_every_route():
    from tts_gateway.gateway.wire import control_character_error

    assert control_character_error("Tabs\tand\nline\r\nbreaks are text.") is None
    message = control_character_error("Hello \u0000 world.")
    assert message is not None and "U+0000" in message and "position 6" in message
