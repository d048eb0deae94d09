"""Per-key limits: sessions and contexts open at once, and characters spoken per minute.

One :class:`KeyAccount` per configured key (or the one anonymous key), shared by every
session and speech request of that key and of the tokens it minted. The accounts are
made once from the config, so the table (and the metrics labelled by key) never grows.

The protocol core asks a session's account about contexts and text
(:class:`tts_gateway.gateway.protocol.Allowance`); the server and the HTTP routes ask it about
sessions and speech requests. Times are the event loop's monotonic seconds.
"""

from __future__ import annotations

import math
from collections import Counter
from typing import NamedTuple

from tts_gateway.gateway.auth import Caller
from tts_gateway.gateway.config import LimitSettings

WINDOW_S = 60.0  # the characters budget is per minute
# When a place (session, context) frees up is not known: clients are told to retry after this.
PLACE_RETRY_AFTER_S = 1
LIMITS = ("sessions", "contexts", "chars")  # what a refusal names: the metrics' label


class Refusal(NamedTuple):
    limit: str  # one of LIMITS
    message: str
    retry_after_s: int | None  # None: retrying the same request can never succeed


class KeyAccount:
    """What one key uses now, and what it was refused."""

    def __init__(self, limits: LimitSettings) -> None:
        self._max_sessions = limits.max_sessions_per_key
        self._max_contexts = limits.max_contexts_per_key
        self._chars_per_minute = limits.chars_per_minute_per_key
        self.sessions = 0
        self.contexts = 0
        self.chars_total = 0
        self.refusals: Counter[str] = Counter()
        # A token bucket: full at the minute's budget, refilled evenly over the minute.
        self._budget = float(self._chars_per_minute)
        self._budget_at = 0.0

    def open_session(self) -> Refusal | None:
        if self._max_sessions and self.sessions >= self._max_sessions:
            return self.refuse("sessions", f"this key has {self._max_sessions} sessions and speech requests "
                                           "open, its limit", PLACE_RETRY_AFTER_S)
        self.sessions += 1
        return None

    def close_session(self) -> None:
        self.sessions -= 1

    def open_context(self, chars: int, now: float) -> Refusal | None:
        """A context place and its first ``chars`` characters of text: both or neither."""
        if self._max_contexts and self.contexts >= self._max_contexts:
            return self.refuse("contexts", f"this key has {self._max_contexts} contexts open, its limit",
                               PLACE_RETRY_AFTER_S)
        if (refused := self.spend_chars(chars, now)) is not None:
            return refused
        self.contexts += 1
        return None

    def close_context(self) -> None:
        self.contexts -= 1

    def spend_chars(self, chars: int, now: float) -> Refusal | None:
        """Take ``chars`` from the minute's budget, or refuse them all."""
        if self._chars_per_minute and chars:
            capacity = self._chars_per_minute
            rate = capacity / WINDOW_S
            self._budget = min(capacity, self._budget + (now - self._budget_at) * rate)
            self._budget_at = now
            if chars > capacity:
                return self.refuse("chars", f"{chars} characters at once exceed this key's budget of {capacity} "
                                             "characters per minute; send less at a time", None)
            if chars > self._budget:
                wait = math.ceil((chars - self._budget) / rate)
                return self.refuse("chars", f"this key has spoken its {capacity} characters per minute; "
                                             f"retry in {wait} s", wait)
            self._budget -= chars
        self.chars_total += chars
        return None

    def refuse(self, limit: str, message: str, retry_after_s: int | None) -> Refusal:
        self.refusals[limit] += 1
        return Refusal(limit, message, retry_after_s)


class KeyLimits:
    """Every key's account, and the sessions of tokens that carry a limit of their own."""

    def __init__(self, limits: LimitSettings, key_ids: frozenset[str]) -> None:
        self.accounts = {key: KeyAccount(limits) for key in sorted(key_ids)}
        # Sessions open per token that carries a limit of its own. An entry lives while its
        # token has a session open: at most max_sessions entries.
        self._token_sessions: Counter[str] = Counter()

    def open_session(self, caller: Caller) -> Refusal | None:
        """Take a session place for ``caller`` (a WebSocket session or a speech request)."""
        account = self.accounts[caller.key_id]
        token = caller.token
        limited = token is not None and token.max_sessions is not None
        if limited and self._token_sessions[token.token_id] >= token.max_sessions:  # reading adds no entry
            return account.refuse("sessions", f"this token allows {token.max_sessions} sessions at once",
                                  PLACE_RETRY_AFTER_S)
        refused = account.open_session()
        if refused is None and limited:
            self._token_sessions[token.token_id] += 1
        return refused

    def close_session(self, caller: Caller) -> None:
        self.accounts[caller.key_id].close_session()
        token = caller.token
        if token is not None and token.max_sessions is not None:
            self._token_sessions[token.token_id] -= 1
            if self._token_sessions[token.token_id] <= 0:
                del self._token_sessions[token.token_id]

    def open_speech(self, caller: Caller, chars: int, now: float) -> Refusal | None:
        """A speech request: a session place, a context place and its text, all or none."""
        if (refused := self.open_session(caller)) is not None:
            return refused
        if (refused := self.accounts[caller.key_id].open_context(chars, now)) is not None:
            self.close_session(caller)
        return refused

    def close_speech(self, caller: Caller) -> None:
        self.accounts[caller.key_id].close_context()
        self.close_session(caller)
