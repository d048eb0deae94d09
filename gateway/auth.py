"""Who is calling, on every route: an API key (``Authorization: Bearer KEY`` or
``?api_key=KEY``) or a browser token minted with one (``Bearer tg1.…`` or ``?token=``).

Either way the caller is known by its key's short hash (:func:`tts_gateway.gateway.tokens.key_id`):
per-key limits and metrics count a token against the key that minted it. With no keys
configured the gateway is open, and every caller shares one anonymous key.
"""

from __future__ import annotations

import hmac
import time
from collections.abc import Mapping
from dataclasses import dataclass

from tts_gateway.gateway.config import AuthSettings
from tts_gateway.gateway.tokens import TOKEN_PREFIX, TokenClaims, TokenError, TokenSigner, key_id

ANONYMOUS = "anonymous"  # the key of every caller of a gateway with no keys configured


class Unauthorized(Exception):
    """Missing or wrong credentials; the message says which, for the 401."""


@dataclass(frozen=True)
class Caller:
    key_id: str  # the short hash of the caller's key, or ANONYMOUS
    token: TokenClaims | None = None  # set when the caller presented a token


class Authenticator:
    def __init__(self, settings: AuthSettings) -> None:
        self._keys = settings.api_keys
        self._key_ids = frozenset(key_id(key) for key in self._keys) or frozenset({ANONYMOUS})
        self.signer = TokenSigner(settings.token_secret)

    @property
    def key_ids(self) -> frozenset[str]:
        """Every key a caller can be counted against: bounds the per-key tables and metrics."""
        return self._key_ids

    def caller(self, authorization: str, query: Mapping[str, str], now: float | None = None) -> Caller:
        """The caller a request's credentials name, or :class:`Unauthorized`.

        A bearer header wins over the query (browsers can only use the latter); a token is
        told from a key by its prefix."""
        bearer = authorization[7:].strip() if authorization.lower().startswith("bearer ") else ""
        if bearer.startswith(TOKEN_PREFIX) or (not bearer and "token" in query):
            return self._token_caller(bearer or query["token"], time.time() if now is None else now)
        return Caller(self._key_id(bearer or query.get("api_key") or ""))

    def _key_id(self, presented: str) -> str:
        if not self._keys:
            return ANONYMOUS
        if not presented:
            raise Unauthorized("missing API key or token")
        # Every key is compared in constant time, so timing reveals nothing about them.
        matches = [hmac.compare_digest(presented.encode(), key.encode()) for key in self._keys]
        if not any(matches):
            raise Unauthorized("invalid API key")
        return key_id(self._keys[matches.index(True)])

    def _token_caller(self, token: str, now: float) -> Caller:
        try:
            claims = self.signer.verify(token, now)
        except TokenError as exc:
            raise Unauthorized(str(exc)) from None
        if claims.key_id not in self._key_ids:
            raise Unauthorized("the key that minted this token is no longer accepted")
        return Caller(claims.key_id, claims)
