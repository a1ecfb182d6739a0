"""Validation of path and query parameters (every failure is a 400 :class:`ApiError`)."""

from __future__ import annotations

import re
import urllib.parse
from collections.abc import Collection, Mapping
from typing import Any, TypeVar

from streamapp.records import device_id_problem
from streamapp.views.errors import ApiError

__all__ = ["check_params", "choice", "device_id_from_path", "device_key", "int_param"]

T = TypeVar("T", bound=str)

#: What an integer query parameter may look like: ASCII digits (int() would also take other
#: scripts' digits, '_' separators and spaces), at most 18 of them, so the value is read in
#: constant time and compared with its range as it is.
_INTEGER_RE = re.compile(r"-?[0-9]{1,18}")


def device_key(device_id: str) -> bytes:
    """The table key of a device id from the URL path: its UTF-8 bytes.

    The id must follow the rule requests are checked with at intake
    (:func:`streamapp.records.device_id_problem`), so that every device the worker records can
    be asked for and no other.

    Raises:
        ApiError: 400 ``bad_device_id`` when the id is empty, longer than 256 characters or
            holds a control, format or separator character.
    """
    problem = device_id_problem(device_id)
    if problem is not None:
        shown = device_id if len(device_id) <= 64 else device_id[:61] + "..."
        raise ApiError(400, "bad_device_id", f"the device id {shown!r} {problem}")
    return device_id.encode("utf-8")


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
    """An integer query parameter in ``[low, high]``.

    Raises:
        ApiError: 400 ``bad_query`` when it is not written in ASCII digits (an optional '-')
            or is outside the range; a number of more than 18 digits is out of range, and the
            error shows at most its first 20 characters.
    """
    raw = query.get(name)
    if raw is None:
        return default
    if re.fullmatch(r"-?[0-9]+", raw) and not _INTEGER_RE.fullmatch(raw):
        shown = raw if len(raw) <= 20 else raw[:17] + "..."
        raise ApiError(400, "bad_query", f"{name}={shown} is out of range; use {low}..{high}")
    if not _INTEGER_RE.fullmatch(raw):
        shown = repr(raw if len(raw) <= 20 else raw[:17] + "...")
        raise ApiError(
            400, "bad_query", f"{name}={shown} is not an integer; use {low}..{high}"
        )
    value = int(raw)
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
