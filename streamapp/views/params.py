"""Validation of path and query parameters (every failure is a 400 :class:`ApiError`)."""

from __future__ import annotations

import urllib.parse
from collections.abc import Collection, Mapping
from typing import Any, TypeVar

from streamapp.views.errors import ApiError

__all__ = ["check_params", "choice", "device_id_from_path", "device_key", "int_param"]

#: Longest device id accepted in a URL (characters).
MAX_DEVICE_ID_CHARS = 256

T = TypeVar("T", bound=str)


def device_key(device_id: str) -> bytes:
    """The table key of a device id from the URL path: its UTF-8 bytes.

    Raises:
        ApiError: 400 when the id is empty, too long, not valid UTF-8 or holds control
            characters.
    """
    if not device_id:
        raise ApiError(400, "bad_device_id", "the device id is empty")
    if len(device_id) > MAX_DEVICE_ID_CHARS:
        raise ApiError(
            400, "bad_device_id",
            f"the device id is {len(device_id)} characters long; at most "
            f"{MAX_DEVICE_ID_CHARS} are allowed",
        )
    if "\ufffd" in device_id:
        raise ApiError(400, "bad_device_id", "the device id is not valid percent-encoded UTF-8")
    if not device_id.isprintable():
        raise ApiError(
            400, "bad_device_id",
            f"the device id {device_id!r} holds control characters; device ids are printable "
            "text (percent-encode them in the URL)",
        )
    try:
        return device_id.encode("utf-8")
    except UnicodeEncodeError:  # lone surrogates
        raise ApiError(400, "bad_device_id", "the device id is not valid UTF-8") from None


def device_id_from_path(request: Any, index: int = 2) -> str:
    """The device id in path segment ``index`` (``/devices/{id}`` → 2), percent-decoded
    strictly: aiohttp leaves escapes that are not UTF-8 (``%FF``) as they are, which would
    make ``/devices/%FF`` the device literally named ``%FF``.

    Raises:
        ApiError: 400 when the segment is not percent-encoded UTF-8.
    """
    raw = request.rel_url.raw_parts[index]
    try:
        return urllib.parse.unquote_to_bytes(raw).decode("utf-8")
    except UnicodeDecodeError:
        raise ApiError(
            400, "bad_device_id",
            f"the device id {raw!r} is not percent-encoded UTF-8; encode the id's UTF-8 bytes",
        ) from None


def check_params(query: Mapping[str, str], allowed: Collection[str]) -> None:
    """Reject unknown or repeated query parameters (a typo should not be silently ignored)."""
    unknown = sorted(set(query) - set(allowed))
    if unknown:
        names = ", ".join(sorted(allowed)) or "none"
        raise ApiError(
            400, "bad_query",
            f"unknown query parameter(s) {', '.join(unknown)}; allowed: {names}",
        )
    getall = getattr(query, "getall", None)
    if getall is not None:
        for name in query:
            if len(getall(name)) > 1:
                raise ApiError(400, "bad_query", f"query parameter {name!r} is given twice")


def int_param(query: Mapping[str, str], name: str, *, default: int, low: int, high: int) -> int:
    """An integer query parameter in ``[low, high]``."""
    raw = query.get(name)
    if raw is None:
        return default
    try:
        value = int(raw, 10)
    except ValueError:
        raise ApiError(
            400, "bad_query", f"{name}={raw!r} is not an integer; use {low}..{high}"
        ) from None
    if not low <= value <= high:
        raise ApiError(400, "bad_query", f"{name}={value} is out of range; use {low}..{high}")
    return value


def choice(query: Mapping[str, str], name: str, choices: tuple[T, ...], *, default: T) -> T:
    """A query parameter that must be one of ``choices``."""
    raw = query.get(name)
    if raw is None:
        return default
    for option in choices:
        if raw == option:
            return option
    raise ApiError(
        400, "bad_query", f"{name}={raw!r} is not allowed; use one of {', '.join(choices)}"
    )
