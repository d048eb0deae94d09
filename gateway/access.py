"""Which browsers and host names may reach the gateway: one rule for the WebSocket
handshake and the HTTP routes.

- **Host** (``[server] allowed_hosts``): a name the gateway was not told it serves is
  refused, so that a page on a domain an attacker rebinds to the gateway's address (DNS
  rebinding) cannot talk to it from a victim's browser.
- **Origin** (``[server] allowed_origins``): browsers name the page that opens a
  WebSocket or makes a cross-origin request. A page is allowed when it is the gateway's own
  (its origin names the host and port the request was sent to), when it is listed, or
  when the list is ``["*"]``. A request with no Origin is not from a page (a server-side
  client), and is allowed: those prove themselves with a key.
"""

from __future__ import annotations

from typing import NamedTuple
from urllib.parse import urlsplit

from tts_gateway.gateway.config import ServerSettings
from tts_gateway.gateway.protocol import quoted

ANY_ORIGIN = "*"


class Denied(NamedTuple):
    status: int  # the HTTP status, on either route
    code: str  # the JSON error's code on the HTTP routes, and the metrics' label
    message: str


class AccessPolicy:
    def __init__(self, settings: ServerSettings) -> None:
        self._origins = frozenset(origin.lower() for origin in settings.allowed_origins)
        self._hosts = frozenset(host.lower() for host in settings.allowed_hosts)

    def refusal(self, host: str | None, origin: str | None) -> Denied | None:
        """Why a request with these Host and Origin headers is refused, or None."""
        if self._hosts and (not host or _host_name(host) not in self._hosts):
            return Denied(421, "misdirected", f"this gateway does not serve the host {quoted(host or '')}")
        if not self._origin_allowed(origin, host):
            return Denied(403, "forbidden_origin", f"pages of the origin {quoted(origin)} may not call this "
                                                    "gateway ([server] allowed_origins)")
        return None

    def _origin_allowed(self, origin: str | None, host: str | None) -> bool:
        if origin is None or ANY_ORIGIN in self._origins:
            return True
        origin = origin.lower()
        if origin in self._origins:
            return True
        # The gateway's own pages: browsers omit a default port in both headers alike.
        # The scheme is not compared: behind a balancer that ends TLS, the gateway's own
        # https page reaches it over plain http.
        return bool(host) and urlsplit(origin).netloc == host.lower()


def _host_name(host: str) -> str:
    """``example.com:8443`` -> ``example.com``; ``[::1]:80`` -> ``[::1]``."""
    host = host.lower()
    if host.startswith("["):
        return host[: host.find("]") + 1]
    return host.partition(":")[0].rstrip(".")
