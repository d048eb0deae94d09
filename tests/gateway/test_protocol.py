"""The session state machine, driven with plain calls: no socket, no engine, no loop."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import orjson
import pytest

from tts_gateway.gateway.audio import decode
from tts_gateway.gateway.protocol import (
    CancelUtterance,
    CloseSession,
    ContextFinished,
    EndInput,
    FlushInput,
    PushText,
    SendBytes,
    SendJson,
    Session,
    SessionSettings,
    StartUtterance,
)

VOICES = ({"id": "joe", "name": "Joe", "language": "en-US", "engine": "test"}, {"id": "amy", "name": "Amy", "language": "en-US", "engine": "test"})


def make_session(**overrides) -> Session:
    settings = dict(voices=VOICES, default_voice="joe", native_rate=22050, max_contexts=2, max_text_chars=50)
    settings.update(overrides)
    return Session("s1", SessionSettings(**settings))


def msg(**fields) -> str:
    return orjson.dumps(fields).decode()


def frames(actions, kind=None):
    out = [a.frame for a in actions if isinstance(a, SendJson)]
    return [f for f in out if kind is None or f["type"] == kind]


def only_error(actions) -> dict:
    errors = frames(actions, "error")
    assert len(errors) == 1, actions
    return errors[0]


@dataclass
class Word:
    text: str
    start_s: float
    end_s: float


def tone(seconds: float, rate: int = 22050) -> np.ndarray:
    t = np.arange(int(seconds * rate)) / rate
    return (0.5 * np.sin(2 * np.pi * 220 * t)).astype(np.float32)


def test_open_sends_ready_with_defaults():
    session = make_session()
    [ready] = frames(session.open({}, 0.0))
    assert ready == {
        "type": "ready",
        "protocol": 1,
        "session_id": "s1",
        "voice": "joe",
        "sample_rate": 24000,
        "encoding": "pcm_s16le",
        "voices": list(VOICES),
    }


def test_query_sets_session_defaults():
    session = make_session()
    [ready] = frames(session.open({"voice": "amy", "sample_rate": "16000", "encoding": "mulaw"}, 0.0))
    assert (ready["voice"], ready["sample_rate"], ready["encoding"]) == ("amy", 16000, "mulaw")


@pytest.mark.parametrize(
    "query, code",
    [
        ({"voice": "nobody"}, "unknown_voice"),
        ({"sample_rate": "11025"}, "unsupported_format"),
        ({"sample_rate": "fast"}, "unsupported_format"),
        ({"encoding": "mp3"}, "unsupported_format"),
        ({"colour": "blue"}, "bad_message"),
    ],
)
def test_bad_query_is_refused_with_error_then_close(query, code):
    actions = make_session().open(query, 0.0)
    assert only_error(actions)["code"] == code
    assert isinstance(actions[-1], CloseSession) and actions[-1].code == 1008


def test_text_flush_end_drive_the_engine_in_order():
    session = make_session()
    session.open({}, 0.0)
    a1 = session.receive_message(msg(type="text", context_id="c1", text="Hel", speed=1.5), now=1.0)
    assert a1 == [StartUtterance(0, "joe", 1.5), PushText(0, "Hel")]
    assert session.receive_message(msg(type="text", context_id="c1", text="lo"), now=1.1) == [PushText(0, "lo")]
    assert session.receive_message(msg(type="flush", context_id="c1"), now=1.2) == [FlushInput(0)]
    assert session.receive_message(msg(type="end", context_id="c1"), now=1.3) == [EndInput(0)]


def test_context_id_defaults_to_default():
    session = make_session()
    session.receive_message(msg(type="text", text="hi"), now=0.0)
    assert list(session.contexts) == ["default"]


def test_audio_frames_header_then_bytes_with_seq_and_offsets():
    session = make_session(default_sample_rate=22050)
    session.open({}, 0.0)
    session.receive_message(msg(type="text", context_id="c1", text="Hello"), now=10.0)
    a = session.audio_ready(0, tone(0.25), [], 0.05, now=10.08)
    b = session.audio_ready(0, tone(0.5), [], 0.05, now=10.1)
    for actions, seq, offset, duration in ((a, 0, 0.0, 250.0), (b, 1, 250.0, 500.0)):
        header, payload = actions
        assert isinstance(header, SendJson) and isinstance(payload, SendBytes)
        assert header.frame == {
            "type": "audio",
            "context_id": "c1",
            "seq": seq,
            "offset_ms": offset,
            "duration_ms": duration,
            "bytes": len(payload.data),
        }
        assert len(payload.data) == int(duration / 1000 * 22050) * 2
    session.receive_message(msg(type="end", context_id="c1"), now=10.2)
    done_actions = session.utterance_finished(0, now=10.3)
    [done] = frames(done_actions, "done")
    assert done == {"type": "done", "context_id": "c1", "audio_ms": 750.0, "ttfa_ms": 80.0}
    [finished] = [a for a in done_actions if isinstance(a, ContextFinished)]
    assert finished.outcome == "done" and finished.compute_s == pytest.approx(0.1)
    assert session.contexts == {}


def test_resampled_context_flushes_resampler_tail_at_done():
    session = make_session()
    session.open({}, 0.0)
    session.receive_message(msg(type="text", text="Hi", sample_rate=48000, encoding="pcm_f32le"), now=0.0)
    sent = []
    for _ in range(5):
        sent += session.audio_ready(0, tone(0.2), [], 0.0, now=0.1)
    session.receive_message(msg(type="end"), now=0.2)
    sent += session.utterance_finished(0, now=0.3)
    audio = b"".join(a.data for a in sent if isinstance(a, SendBytes))
    samples = decode(audio, "pcm_f32le")
    assert len(samples) == 48000  # exactly 1 s: nothing lost in the resampler
    assert frames(sent, "done")[0]["audio_ms"] == 1000.0


def test_alignment_is_placed_on_the_context_timeline():
    session = make_session(default_sample_rate=22050)
    session.receive_message(msg(type="text", text="Hello world"), now=0.0)
    session.audio_ready(0, tone(0.5), [], 0.0, now=0.1)
    actions = session.audio_ready(0, tone(0.5), [Word("world", 0.1, 0.4)], 0.0, now=0.2)
    [alignment] = frames(actions, "alignment")
    assert alignment["words"] == [{"text": "world", "start_ms": 600.0, "end_ms": 900.0}]


def test_a_session_may_ask_for_no_word_timings():
    session = make_session()
    assert frames(session.open({"word_timings": "false"}, 0.0))[0]["type"] == "ready"
    assert not session.word_timings
    session.receive_message(msg(type="text", text="Hello world"), now=0.0)
    actions = session.audio_ready(0, tone(0.5), [Word("Hello", 0.0, 0.3)], 0.0, now=0.1)
    assert frames(actions, "audio") and not frames(actions, "alignment")
    wanting = make_session()
    wanting.open({"word_timings": "true"}, 0.0)
    assert wanting.word_timings
    for value in ("no", "0", "False", ""):
        actions = make_session().open({"word_timings": value}, 0.0)
        error = only_error(actions)
        assert error["code"] == "bad_message" and "word_timings must be true or false" in error["message"], value
        assert actions[-1] == CloseSession(1008, error["message"])


def test_cancel_stops_engine_and_drops_late_audio():
    session = make_session()
    session.receive_message(msg(type="text", context_id="c1", text="Hello"), now=0.0)
    actions = session.receive_message(msg(type="cancel", context_id="c1"), now=0.1)
    assert actions[0] == CancelUtterance(0)
    assert frames(actions) == [{"type": "cancelled", "context_id": "c1"}]
    assert isinstance(actions[-1], ContextFinished) and actions[-1].outcome == "cancelled"
    # Audio the engine had in flight arrives after the cancel: it must go nowhere,
    # even once the id is reused by a new context.
    session.receive_message(msg(type="text", context_id="c1", text="New turn"), now=0.2)
    assert session.audio_ready(0, tone(0.1), [], 0.0, now=0.3) == []
    assert session.utterance_finished(0, now=0.3) == []
    assert frames(session.audio_ready(1, tone(0.1), [], 0.0, now=0.3), "audio")[0]["seq"] == 0


def test_multiple_contexts_have_independent_timelines():
    session = make_session(default_sample_rate=22050)
    session.receive_message(msg(type="text", context_id="a", text="One"), now=0.0)
    session.receive_message(msg(type="text", context_id="b", text="Two"), now=0.0)
    session.audio_ready(0, tone(0.2), [], 0.0, now=0.1)
    [hb] = frames(session.audio_ready(1, tone(0.2), [], 0.0, now=0.1), "audio")
    [ha] = frames(session.audio_ready(0, tone(0.2), [], 0.0, now=0.2), "audio")
    assert (hb["context_id"], hb["seq"], hb["offset_ms"]) == ("b", 0, 0.0)
    assert (ha["context_id"], ha["seq"], ha["offset_ms"]) == ("a", 1, 200.0)


@pytest.mark.parametrize(
    "message, code",
    [
        ("not json", "bad_message"),
        ("[1, 2]", "bad_message"),
        (msg(type="shout", text="x"), "bad_message"),
        (msg(type=["text"], text="x"), "bad_message"),
        (msg(type="text", text="x", encoding=["mulaw"]), "unsupported_format"),
        (msg(type="text", text=5), "bad_message"),
        (msg(type="text", text="x", context_id=""), "bad_message"),
        (msg(type="text", text="x", context_id="c" * 129), "bad_message"),
        (msg(type="text", text="x", volume=3), "bad_message"),
        (msg(type="text", text="x", speed=9), "bad_message"),
        (msg(type="text", text="x", speed=True), "bad_message"),
        (msg(type="text", text="x", voice="nobody"), "unknown_voice"),
        (msg(type="text", text="x", sample_rate=12345), "unsupported_format"),
        (msg(type="text", text="x", sample_rate="24000"), "unsupported_format"),
        (msg(type="text", text="x", encoding="opus"), "unsupported_format"),
        (msg(type="text", text="x" * 51), "text_too_long"),
        (msg(type="flush", context_id="ghost"), "unknown_context"),
        (msg(type="end", context_id="ghost"), "unknown_context"),
        (msg(type="cancel", context_id="ghost"), "unknown_context"),
    ],
)
def test_bad_messages_get_an_error_and_change_nothing(message, code):
    session = make_session()
    actions = session.receive_message(message, now=0.0)
    assert only_error(actions)["code"] == code
    assert not any(isinstance(a, (StartUtterance, PushText, CloseSession)) for a in actions)
    assert session.contexts == {} and not session.closed
    # The socket stays usable.
    assert session.receive_message(msg(type="text", text="ok"), now=0.1)[0] == StartUtterance(0, "joe", 1.0)


def test_binary_frame_from_client_is_bad_message():
    assert only_error(make_session().receive_message(b"\x00\x01", now=0.0))["code"] == "bad_message"


def test_text_too_long_keeps_context_and_earlier_text():
    session = make_session()
    session.receive_message(msg(type="text", context_id="c", text="x" * 40), now=0.0)
    error = only_error(session.receive_message(msg(type="text", context_id="c", text="y" * 11), now=0.1))
    assert error == {"type": "error", "code": "text_too_long", "message": error["message"], "context_id": "c"}
    assert session.receive_message(msg(type="text", context_id="c", text="y" * 10), now=0.2) == [PushText(0, "y" * 10)]


def test_too_many_contexts():
    session = make_session()
    session.receive_message(msg(type="text", context_id="a", text="1"), now=0.0)
    session.receive_message(msg(type="text", context_id="b", text="2"), now=0.0)
    assert only_error(session.receive_message(msg(type="text", context_id="c", text="3"), now=0.0))["code"] == (
        "too_many_contexts"
    )
    session.receive_message(msg(type="cancel", context_id="a"), now=0.0)
    assert isinstance(session.receive_message(msg(type="text", context_id="c", text="3"), now=0.0)[0], StartUtterance)


def test_text_after_end_and_changed_options_are_refused():
    session = make_session()
    session.receive_message(msg(type="text", context_id="c", text="Hi", voice="amy"), now=0.0)
    assert session.receive_message(msg(type="text", context_id="c", text=" there", voice="amy"), now=0.0) == [
        PushText(0, " there")
    ]
    assert only_error(session.receive_message(msg(type="text", context_id="c", text="!", voice="joe"), now=0.0))[
        "code"
    ] == "bad_message"
    session.receive_message(msg(type="end", context_id="c"), now=0.0)
    for late in (msg(type="text", context_id="c", text="more"), msg(type="flush", context_id="c"), msg(type="end", context_id="c")):
        assert only_error(session.receive_message(late, now=0.0))["code"] == "bad_message"
    # Cancel is still allowed while the rest is being spoken.
    assert frames(session.receive_message(msg(type="cancel", context_id="c"), now=0.0))[0]["type"] == "cancelled"


def test_engine_failure_reports_internal_and_frees_the_context():
    session = make_session()
    session.receive_message(msg(type="text", context_id="c", text="Hi"), now=0.0)
    actions = session.utterance_failed(0, "boom")
    error = only_error(actions)
    assert error["code"] == "internal" and error["context_id"] == "c" and "boom" in error["message"]
    assert CancelUtterance(0) in actions and session.contexts == {}


def test_stall_estimate_counts_late_chunks_after_the_first():
    session = make_session(default_sample_rate=22050)
    session.receive_message(msg(type="text", text="Hi"), now=0.0)
    session.audio_ready(0, tone(1.0), [], 0.0, now=1.0)  # playback starts at 1.0
    session.audio_ready(0, tone(1.0), [], 0.0, now=1.5)  # needed at 2.0: early
    session.audio_ready(0, tone(1.0), [], 0.0, now=3.25)  # needed at 3.0: 0.25 s late
    session.audio_ready(0, tone(1.0), [], 0.0, now=4.0)  # needed at 4.25 (after the pause): early
    session.receive_message(msg(type="end"), now=4.0)
    [finished] = [a for a in session.utterance_finished(0, now=4.1) if isinstance(a, ContextFinished)]
    assert finished.stalls == 1 and finished.stall_s == pytest.approx(0.25)
    assert finished.ttfa_s == pytest.approx(1.0)


def test_idle_timeout_cancels_and_closes():
    session = make_session()
    session.receive_message(msg(type="text", text="Hi"), now=0.0)
    assert session.check_idle(now=59.9) == []
    actions = session.check_idle(now=60.0)
    assert only_error(actions)["code"] == "idle_timeout"
    assert CancelUtterance(0) in actions and isinstance(actions[-1], CloseSession)


def test_client_not_reading_is_cut_off():
    session = make_session()
    session.receive_message(msg(type="text", text="Hi"), now=0.0)
    actions = session.client_not_reading()
    assert actions[0] == CancelUtterance(0)
    assert only_error(actions)["code"] == "overloaded"
    assert actions[-1] == CloseSession(1008, "client not reading")
    assert session.receive_message(msg(type="text", text="more"), now=1.0) == []


def test_overloaded_refusal_closes_with_1013():
    actions = make_session().refuse_overloaded()
    assert only_error(actions)["code"] == "overloaded" and actions[-1].code == 1013


def test_drain_refuses_new_contexts_but_lets_running_ones_finish():
    session = make_session()
    session.receive_message(msg(type="text", context_id="a", text="Hi"), now=0.0)
    session.start_drain()
    assert only_error(session.receive_message(msg(type="text", context_id="b", text="Yo"), now=0.0))["code"] == (
        "overloaded"
    )
    assert session.receive_message(msg(type="end", context_id="a"), now=0.0) == [EndInput(0)]
    actions = session.shutdown()
    assert CancelUtterance(0) in actions and actions[-1].code == 1001


def test_connection_lost_cancels_everything():
    session = make_session()
    session.receive_message(msg(type="text", context_id="a", text="Hi"), now=0.0)
    session.receive_message(msg(type="text", context_id="b", text="Yo"), now=0.0)
    actions = session.connection_lost()
    assert {a.key for a in actions if isinstance(a, CancelUtterance)} == {0, 1}
    assert session.contexts == {}


@pytest.mark.parametrize(
    "message",
    [
        msg(type="x" * 60_000),
        msg(type="text", text="Hi", voice="v" * 60_000),
        msg(type="text", text="Hi", encoding="e" * 60_000),
        msg(type="text", text="Hi", sample_rate=list(range(20_000))),
        msg(type="end", **{f"field{i}": 1 for i in range(5_000)}),
    ],
)
def test_errors_quote_client_input_short(message):
    """An error never echoes a client's input at length: quoted values end in an ellipsis."""
    session = make_session()
    session.open({}, 0.0)
    error = only_error(session.receive_message(message, 0.0))
    assert len(error["message"]) < 200 and "…" in error["message"]


def test_bad_query_parameter_names_are_quoted_short():
    error = only_error(make_session().open({"p" * 60_000: "1"}, 0.0))
    assert len(error["message"]) < 200


@pytest.mark.parametrize("text", ["Hello \u0000 world.", "bell\u0007", "escape \u001b[31m", "del\u007f", "c1 \u0085"])
def test_control_characters_in_text_are_refused(text):
    session = make_session()
    session.open({}, 0.0)
    actions = session.receive_message(msg(type="text", context_id="c", text=text), 0.0)
    error = only_error(actions)
    assert error["code"] == "bad_message" and error["context_id"] == "c" and "control character" in error["message"]
    assert not any(isinstance(a, (StartUtterance, PushText)) for a in actions)
    assert session.idle  # the context was not opened


def test_tabs_and_line_breaks_are_ordinary_text():
    session = make_session(max_text_chars=100)
    session.open({}, 0.0)
    actions = session.receive_message(msg(type="text", text="One\ttwo\nthree\r\nfour."), 0.0)
    assert [a for a in actions if isinstance(a, PushText)] == [PushText(0, "One\ttwo\nthree\r\nfour.")]


def test_a_keepalive_keeps_a_quiet_session_open_and_nothing_else():
    session = make_session()
    session.open({}, 0.0)
    assert session.receive_message(msg(type="keepalive"), now=50.0) == []
    assert session.check_idle(now=100.0) == []  # 50 s after the keepalive
    session.heard(now=105.0)  # a WebSocket ping
    assert session.check_idle(now=164.9) == []
    assert only_error(session.check_idle(now=165.0))["code"] == "idle_timeout"
    other = make_session()
    other.open({}, 0.0)
    error = only_error(other.receive_message(msg(type="keepalive", context_id="c"), now=1.0))
    assert error["code"] == "bad_message" and "context_id" in error["message"]


def test_audio_going_out_counts_as_activity():
    session = make_session()
    session.open({}, 0.0)
    session.receive_message(msg(type="text", text="Hi"), now=0.0)
    session.audio_ready(0, np.zeros(1600, np.float32), [], 0.0, now=59.0)
    assert session.check_idle(now=100.0) == []


def test_a_session_chooses_its_inactivity_timeout_within_the_bound():
    session = make_session()
    session.open({"inactivity_timeout": "5"}, 0.0)
    assert session.check_idle(now=4.9) == [] and only_error(session.check_idle(now=5.0))["code"] == "idle_timeout"
    longest = make_session()
    longest.open({"inactivity_timeout": "180"}, 0.0)
    assert longest.check_idle(now=179.0) == []
    for value in ("181", "0", "-1", "soon", "nan", "inf"):
        actions = make_session().open({"inactivity_timeout": value}, 0.0)
        error = only_error(actions)
        assert error["code"] == "bad_message" and "inactivity_timeout" in error["message"], value
        assert actions[-1] == CloseSession(1008, error["message"])


# ---------------------------------------------------------------- the key's allowance


class CountingAllowance:
    """A key allowed ``places`` contexts at once and ``chars`` characters in all."""

    def __init__(self, places: int, chars: int) -> None:
        self.places, self.chars, self.open = places, chars, 0

    def open_context(self, chars: int, now: float):
        if self.open >= self.places:
            return Refusal("no context place")
        if (refused := self.spend_chars(chars, now)) is not None:
            return refused
        self.open += 1
        return None

    def close_context(self) -> None:
        self.open -= 1

    def spend_chars(self, chars: int, now: float):
        if chars > self.chars:
            return Refusal("no characters left")
        self.chars -= chars
        return None


@dataclass
class Refusal:
    message: str


def test_the_keys_allowance_refuses_contexts_and_text_with_overloaded():
    allowance = CountingAllowance(places=1, chars=20)
    session = make_session()
    session.allowance = allowance
    session.open({}, 0.0)
    assert any(isinstance(a, StartUtterance) for a in session.receive_message(msg(type="text", context_id="a", text="Hello"), 0.0))
    error = only_error(session.receive_message(msg(type="text", context_id="b", text="Hi"), 0.0))
    assert (error["code"], error["context_id"], error["message"]) == ("overloaded", "b", "no context place")
    assert set(session.contexts) == {"a"} and allowance.chars == 15
    # Text past the budget in the middle of a context ends it, and gives its place back.
    actions = session.receive_message(msg(type="text", context_id="a", text="x" * 16), 0.0)
    assert only_error(actions)["message"] == "no characters left"
    assert any(isinstance(a, CancelUtterance) for a in actions) and not session.contexts and allowance.open == 0
    # Every way out of a context gives its place back: done, cancel, a lost connection.
    for finish in ("done", "cancel", "lost"):
        actions = session.receive_message(msg(type="text", context_id="c", text="Hi"), 0.0)
        (start,) = [a for a in actions if isinstance(a, StartUtterance)]
        assert allowance.open == 1
        if finish == "done":
            session.receive_message(msg(type="end", context_id="c"), 0.0)
            session.utterance_finished(start.key, 0.0)
        elif finish == "cancel":
            session.receive_message(msg(type="cancel", context_id="c"), 0.0)
        else:
            session.connection_lost()
        assert allowance.open == 0, finish
    # A context refused for its characters takes no place.
    session = make_session()
    session.allowance = allowance = CountingAllowance(places=1, chars=3)
    session.open({}, 0.0)
    assert only_error(session.receive_message(msg(type="text", context_id="a", text="Hello"), 0.0))["code"] == "overloaded"
    assert allowance.open == 0 and allowance.chars == 3
