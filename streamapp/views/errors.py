"""JSON errors for the web API: every error is ``{"error": code, "message": ..., "status": n}``."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web
from faust.web import View

__all__ = ["ApiError", "ApiView", "json_http_errors"]

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
    logged and answered as a 500 JSON error instead of aiohttp's plain-text page."""

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



@web.middleware
async def json_http_errors(
    request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    """aiohttp's own errors as JSON like every other answer: 404 ``not_found`` for a path no
    endpoint serves, 405 ``method_not_allowed`` (aiohttp answers them in plain text)."""
    try:
        return await handler(request)
    except web.HTTPException as exc:
        if exc.status < 400 or exc.content_type == "application/json":
            raise
        if exc.status == 404:
            code, message = "not_found", (
                f"no endpoint serves {request.path}; the endpoints are /health, /ready, "
                "/engines, /metrics, /cluster, /devices, /devices/{device_id} and "
                "/devices/{device_id}/windows (docs/api.md)")
        elif exc.status == 405:
            code, message = "method_not_allowed", (
                f"{request.method} is not allowed on {request.path}; the web API answers GET")
        else:
            code, message = exc.reason.lower().replace(" ", "_"), exc.reason
        return web.json_response({"error": code, "message": message, "status": exc.status},
                                 status=exc.status, headers={
                                     k: v for k, v in exc.headers.items() if k == "Allow"})
