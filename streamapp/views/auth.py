"""The web API behind a bearer token (issue 21): deny by default.

With ``web_token`` (or ``web_token_file``) set, every request must carry
``Authorization: Bearer <token>``, whatever its path — the device views, ``/cluster``,
``/engines``, every admin action, and any route added later — except the paths listed in
``web_open_paths`` (``/health``, ``/ready`` and ``/metrics`` by default, so that probes and
scrapers need no secret). The check is an aiohttp middleware, so a new route is protected
without being named here. A wrong or missing token is a 401 JSON error that says what to send,
never what was sent or expected; tokens are compared in constant time
(:func:`hmac.compare_digest`). Queries a worker forwards to the device's owner carry the
worker's own token (:meth:`WebAuth.headers`; all workers of a group share it).
"""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable, Collection

from aiohttp import web

from streamapp.views.errors import shown_path

__all__ = ["WEB_AUTH_KEY", "WebAuth"]

_SCHEME = "bearer"


class WebAuth:
    """The bearer-token check of the web server.

    Args:
        token: The token requests must carry; "" turns the check off (every path open).
        open_paths: Paths answered without a token (exact matches, e.g. ``/health``).

    Attributes:
        refused: Requests answered 401 so far.
    """

    def __init__(self, token: str, open_paths: Collection[str]) -> None:
        self._token = token.encode("utf-8")
        self.open_paths = frozenset(open_paths)
        self.refused = 0

    @property
    def enabled(self) -> bool:
        """Whether a token is required (on the paths not open)."""
        return bool(self._token)

    def headers(self) -> dict[str, str]:
        """Headers that authenticate a request this worker sends to another worker
        (``{}`` when no token is configured)."""
        return {"Authorization": f"Bearer {self._token.decode()}"} if self._token else {}

    def allows(self, path: str, authorization: str | None) -> bool:
        """Whether a request for ``path`` with this ``Authorization`` header value is let in."""
        if not self._token or path in self.open_paths:
            return True
        scheme, _, given = (authorization or "").strip().partition(" ")
        if scheme.lower() != _SCHEME:
            return False
        # constant time in the token's content: no timing tells how much of a guess matched
        return hmac.compare_digest(given.strip().encode("utf-8", "surrogateescape"), self._token)

    def refusal(self, path: str) -> web.Response:
        """The 401 answer (it names neither the token given nor the one expected)."""
        self.refused += 1
        return web.json_response(
            {"error": "unauthorized", "status": 401,
             "message": f"{shown_path(path)} needs the worker's web token: send the header "
             "'Authorization: Bearer <token>' with the value of STREAMAPP_WEB_TOKEN (or of "
             "the file STREAMAPP_WEB_TOKEN_FILE names)"},
            status=401, headers={"WWW-Authenticate": 'Bearer realm="streamapp"'},
        )

    def middleware(self) -> Callable[..., Awaitable[web.StreamResponse]]:
        """The aiohttp middleware applying the check to every route (append it to the web
        app's ``middlewares`` before the server starts)."""

        @web.middleware
        async def authenticate(
            request: web.Request,
            handler: Callable[[web.Request], Awaitable[web.StreamResponse]],
        ) -> web.StreamResponse:
            if not self.allows(request.path, request.headers.get("Authorization")):
                return self.refusal(request.path)
            return await handler(request)

        return authenticate


#: Where the web app keeps its :class:`WebAuth` (for the forwarding of device queries).
WEB_AUTH_KEY = web.AppKey("streamapp_web_auth", WebAuth)
