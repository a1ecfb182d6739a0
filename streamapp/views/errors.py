"""JSON errors for the web API: every error is ``{"error": code, "message": ..., "status": n}``,
those of aiohttp itself too: a path no route serves, a method a route does not answer
(:func:`json_http_errors`) and a request aiohttp cannot read, e.g. a URL over
:data:`MAX_URL_BYTES` (:class:`JsonErrorsAppRunner`)."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from http import HTTPStatus
from typing import Any

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError, LineTooLong
from aiohttp.web_request import BaseRequest
from faust.web import View

__all__ = [
    "KEEPALIVE_S",
    "LINGER_S",
    "MAX_HEADER_BYTES",
    "MAX_URL_BYTES",
    "ApiError",
    "ApiView",
    "JsonErrorsAppRunner",
    "JsonErrorsRequestHandler",
    "json_http_errors",
    "unreadable_request",
]

log = logging.getLogger(__name__)


class ApiError(Exception):
    """An HTTP error with a machine-readable code and a message that says how to fix it.

    Args:
        status: HTTP status (400 bad query, 404 unknown device, 503 not ready / owner away).
        code: Short code, e.g. ``bad_query``, ``unknown_device``.
        message: What was wrong with which value, and what is allowed.
    """

    def __init__(self, status: int, code: str, message: str, **extra: Any) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message
        self.extra = extra

    def body(self) -> dict[str, Any]:
        return {"error": self.code, "message": self.message, "status": self.status, **self.extra}


class ApiView(View):
    """A Faust view whose handlers may raise :class:`ApiError`; anything else unexpected is
    logged and answered as a 500 JSON error instead of aiohttp's plain-text page.

    It is routed for the methods it answers: HEAD only beside GET (Faust routes HEAD for every
    view, and a view without GET refuses it), so a method it does not answer, HEAD included,
    is aiohttp's 405 whose ``Allow`` names exactly those (:func:`json_http_errors`)."""

    def get_methods(self) -> set[str]:
        methods = set(super().get_methods())
        if "GET" not in methods and self.methods["head"].__code__ is View.head.__code__:
            methods.discard("HEAD")
        return methods

    async def dispatch(self, request: Any) -> Any:
        try:
            return await super().dispatch(request)
        except ApiError as exc:
            return self.json(exc.body(), status=exc.status)
        except Exception:
            log.exception("%s %s failed", request.method, request.path)
            return self.json(
                {"error": "internal_error", "status": 500,
                 "message": "the worker failed to answer; its log has the traceback"},
                status=500,
            )


def _endpoints() -> str:
    """streamapp's endpoints (:data:`streamapp.views.ENDPOINTS`, what docs/api.md documents and
    a test keeps equal to the routes streamapp registers), as ``GET /health, ... and POST
    /models/{name}/load``: not the routes Faust adds to a running worker's table itself
    (``/router/``, ``/table/``, ``GET /``, ...), which the API does not document."""
    from streamapp.views import ENDPOINTS  # this module is imported by streamapp.views

    endpoints = [f"{method} {path}" for method, path, *_ in ENDPOINTS]
    if len(endpoints) < 2:
        return "".join(endpoints)
    return ", ".join(endpoints[:-1]) + " and " + endpoints[-1]


#: The most characters of a request's path an error message repeats.
MAX_PATH_SHOWN = 200


def shown_path(path: str) -> str:
    """``path`` as an error message repeats it: at most :data:`MAX_PATH_SHOWN` characters, an
    ellipsis marking a cut."""
    return path if len(path) <= MAX_PATH_SHOWN else path[:MAX_PATH_SHOWN] + "…"


def _methods(methods: set[str]) -> list[str]:
    """``methods`` to name in a message: HEAD only where it is all (aiohttp adds HEAD beside
    GET, Faust beside every method of a view)."""
    return sorted(methods - {"HEAD"}) or sorted(methods)


@web.middleware
async def json_http_errors(
    request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    """aiohttp's own errors as JSON like every other answer: 404 ``not_found`` for a path no
    endpoint serves, 405 ``method_not_allowed`` (aiohttp answers them in plain text). The 404
    lists streamapp's endpoints, the 405 the methods the routes table holds for the path."""
    try:
        return await handler(request)
    except web.HTTPException as exc:
        if exc.status < 400 or exc.content_type == "application/json":
            raise
        path = shown_path(request.path)
        if exc.status == 404:
            code, message = "not_found", (
                f"no endpoint serves {path}; the endpoints are {_endpoints()} "
                "(docs/api.md)")
        elif isinstance(exc, web.HTTPMethodNotAllowed):
            code, message = "method_not_allowed", (
                f"{request.method} is not allowed on {path}; it answers "
                f"{' and '.join(_methods(set(exc.allowed_methods)))} (docs/api.md)")
        else:
            code, message = exc.reason.lower().replace(" ", "_"), exc.reason
        return web.json_response({"error": code, "message": message, "status": exc.status},
                                 status=exc.status, headers={
                                     k: v for k, v in exc.headers.items() if k == "Allow"})


#: The longest URL (path and query, bytes) the web server reads: longer is 414 ``uri_too_long``.
MAX_URL_BYTES = 8192
#: The longest request header name, and the longest header value (bytes), it reads: longer
#: is 431
#: ``header_too_long``. aiohttp's default, named here because the two limits must differ:
#: aiohttp raises the same error (:class:`~aiohttp.http_exceptions.LineTooLong`) for both, and
#: the limit it carries is what tells them apart.
MAX_HEADER_BYTES = 8190
#: Seconds the server keeps discarding the unread body of a request it has answered before it
#: closes the connection (aiohttp's lingering close; its default of 10 s let a client that
#: declares ``Content-Length: 99999999999`` hold a connection 10 s per request).
LINGER_S = 1.0
#: Seconds a connection may stay without a complete request: idle between requests, or
#: still sending its first request's head (aiohttp's keep-alive timeout, which it also arms
#: when a connection opens; its default of 75 s let 3,000 connections that never finished
#: their headers hold 3,000 file descriptors for that long, new-user trial, ninth session).
#: Above aiohttp's client pool keep-alive (15 s), which the workers' forwarded device queries
#: use: a server that closed first could close a pooled connection as a query is sent on it.
KEEPALIVE_S = 30.0


def unreadable_request(status: int, exc: BaseException | None,
                       message: str | None = None) -> ApiError:
    """The JSON error for a request aiohttp could not read (``status`` and ``exc`` as its
    request handler passes them to ``handle_error``): a URL or a header over the limits, a
    malformed request line or header, or (500) a failure outside the views."""
    if isinstance(exc, LineTooLong):
        if exc.args[1:2] == (MAX_URL_BYTES,):
            return ApiError(414, "uri_too_long", (
                f"the URL (path and query) is longer than {MAX_URL_BYTES:,} bytes, the most "
                "the web API reads; a device id is at most 256 characters (docs/api.md)"))
        return ApiError(431, "header_too_long", (
            f"a request header name or value is longer than {MAX_HEADER_BYTES:,} bytes, the "
            "most the web API reads of each"))
    if status >= 500:
        return ApiError(500, "internal_error",
                        "the worker failed to answer; its log has the traceback")
    reason = _one_line(message or (exc.message if isinstance(exc, HttpProcessingError) else "")
                       or str(exc))
    try:
        code = HTTPStatus(status).phrase.lower().replace(" ", "_")
    except ValueError:  # not a status http knows
        code = "bad_request"
    return ApiError(status, code, f"the request is not valid HTTP/1.1: {reason}")


def _one_line(reason: str) -> str:
    """The HTTP parser's reason on one line: its lines joined, without the copy of the bad
    input and the caret under it, e.g. ``Bad status line: Invalid HTTP version``."""
    lines = [line.strip().rstrip(":") for line in reason.splitlines()]
    kept = [line for line in lines if line and set(line) != {"^"}
            and not line.startswith(("b'", 'b"'))]
    text = ": ".join(kept) or "unreadable request"
    return text if len(text) <= MAX_PATH_SHOWN else text[:MAX_PATH_SHOWN] + "…"


class JsonErrorsRequestHandler(web.RequestHandler):
    """aiohttp's connection handler, but a request it cannot read is answered with a JSON
    error (:func:`unreadable_request`) like every other answer instead of aiohttp's plain
    text. Such a request never reaches the app (no route, no middleware), so this is the only
    place that can answer it; its connection is closed, as aiohttp does."""

    def handle_error(self, request: BaseRequest, status: int = 500,
                     exc: BaseException | None = None,
                     message: str | None = None) -> web.StreamResponse:
        error = unreadable_request(status, exc, message)
        if error.status >= 500:
            self.log_exception("Error handling request from %s", request.remote, exc_info=exc)
        else:  # the client's mistake: no traceback in the worker's log
            log.debug("answered %d %s to %s: %s", error.status, error.code, request.remote,
                      exc or message)
        if request.writer.output_size > 0:  # as aiohttp: too late for another answer
            raise ConnectionError("Response is sent already, cannot send another response "
                                  "with the error message")
        response = web.json_response(error.body(), status=error.status)
        response.force_close()
        return response


class _JsonErrorsServer(web.Server):
    """aiohttp's server (the protocol factory a site listens with), whose connections are
    :class:`JsonErrorsRequestHandler`: aiohttp has no setting for the handler's class."""

    def __call__(self) -> web.RequestHandler:
        return JsonErrorsRequestHandler(self, loop=self._loop, **self._kwargs)


class JsonErrorsAppRunner(web.AppRunner):
    """An :class:`~aiohttp.web.AppRunner` whose server reads URLs up to
    :data:`MAX_URL_BYTES` and headers up to :data:`MAX_HEADER_BYTES`, answers a request it
    cannot read in JSON (:class:`JsonErrorsRequestHandler`), and after answering a request
    whose body was not read (a 405, say) discards the rest of that body for at most
    :data:`LINGER_S` before it closes the connection, and closes a connection without a
    complete request for :data:`KEEPALIVE_S`."""

    def __init__(self, app: web.Application, **kwargs: Any) -> None:
        super().__init__(app, max_line_size=MAX_URL_BYTES, max_field_size=MAX_HEADER_BYTES,
                         lingering_time=LINGER_S, keepalive_timeout=KEEPALIVE_S, **kwargs)

    async def _make_server(self) -> web.Server:
        server = await super()._make_server()
        # the server the app built, its settings kept; only the handler it makes differs
        server.__class__ = _JsonErrorsServer
        return server
