"""API-key checks shared by every route: ``Authorization: Bearer KEY`` or ``?api_key=KEY``."""

from __future__ import annotations

import hmac


def authorized(keys: tuple[str, ...], authorization: str, query_key: str | None) -> bool:
    """True when no keys are configured, or the request presents one of them.

    A bearer header wins over the query parameter (browsers can only use the latter).
    Every key is compared in constant time, so timing reveals nothing about them.
    """
    if not keys:
        return True
    presented = authorization[7:].strip() if authorization.lower().startswith("bearer ") else (query_key or "")
    if not presented:
        return False
    matches = [hmac.compare_digest(presented.encode(), key.encode()) for key in keys]
    return any(matches)
