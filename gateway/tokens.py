"""Short-lived browser tokens: what a page holds instead of an API key.

A backend that holds a key asks ``POST /v1/tokens`` for a token and hands it to the
browser, which passes it as ``?token=`` on the WebSocket or as a bearer on HTTP. The key
itself never reaches the page, and a leaked token stops working within its lifetime.

A token is ``tg1.<claims>.<signature>``: the claims are base64url JSON naming the key
that minted it (by its short hash, never the key), its expiry (Unix seconds) and optional
limits of its own; the signature is HMAC-SHA256 over the claims with the server's secret.
Nothing is stored per token: any process with the same secret can check it.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import secrets
from dataclasses import dataclass

import orjson

TOKEN_PREFIX = "tg1."
MAX_TOKEN_CHARS = 512  # a real one is about 150; longer input is not parsed at all


class TokenError(Exception):
    """A token that is malformed, forged or expired; the message says which."""


@dataclass(frozen=True)
class TokenClaims:
    key_id: str  # the short hash of the key that minted it
    expires_at: float  # Unix seconds
    token_id: str  # random: tells tokens of one key apart, for their own limits
    max_sessions: int | None = None  # sessions open at once with this token, if it is limited


def key_id(key: str) -> str:
    """The short hash that names an API key in tokens, metrics and logs (never the key)."""
    return hashlib.sha256(key.encode()).hexdigest()[:12]


class TokenSigner:
    def __init__(self, secret: str) -> None:
        # No secret configured: a random one, for this process only.
        self._secret = secret.encode() if secret else secrets.token_bytes(32)

    def mint(self, key: str, expires_at: float, max_sessions: int | None = None) -> str:
        """A token for the key named by ``key`` (its :func:`key_id`)."""
        claims = {"k": key, "exp": round(expires_at), "id": secrets.token_hex(8)}
        if max_sessions is not None:
            claims["ms"] = max_sessions
        body = _b64(orjson.dumps(claims))
        return f"{TOKEN_PREFIX}{body}.{self._sign(body)}"

    def verify(self, token: str, now: float) -> TokenClaims:
        """The token's claims, or :class:`TokenError` saying what is wrong with it."""
        if len(token) > MAX_TOKEN_CHARS or not token.startswith(TOKEN_PREFIX):
            raise TokenError("not a gateway token")
        body, _, signature = token[len(TOKEN_PREFIX):].partition(".")
        if not hmac.compare_digest(signature.encode(), self._sign(body).encode()):
            raise TokenError("token signature is invalid")
        try:
            claims = orjson.loads(base64.urlsafe_b64decode(body + "=" * (-len(body) % 4)))
            parsed = TokenClaims(str(claims["k"]), float(claims["exp"]), str(claims["id"]), claims.get("ms"))
        except (ValueError, KeyError, TypeError):  # signed by us, so never expected
            raise TokenError("token claims are unreadable") from None
        if parsed.expires_at <= now:
            raise TokenError("token has expired; ask for a new one")
        return parsed

    def _sign(self, body: str) -> str:
        return _b64(hmac.new(self._secret, body.encode(), hashlib.sha256).digest())


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()
