"""The client side of ``streamapp models`` and ``streamapp models load``: ask one worker, which
reaches every worker of its group (:mod:`streamapp.views.models`), and print the answer."""

from __future__ import annotations

import json
import urllib.error
import urllib.parse
import urllib.request
from typing import Any

__all__ = ["COMMAND_TIMEOUT_S", "LIST_TIMEOUT_S", "format_listing", "format_load", "request_json"]

#: Seconds the command waits for the group's answer (a load prepares on every worker first).
COMMAND_TIMEOUT_S = 330.0
#: Seconds ``streamapp models`` waits for a listing: the worker asks each worker of its
#: group within ``CALL_TIMEOUT_S`` (10 s) at once, so a hung worker it asks costs 10 s, and a
#: hung worker asked directly no more than this.
LIST_TIMEOUT_S = 30.0


def request_json(url: str, method: str = "GET", timeout_s: float = COMMAND_TIMEOUT_S,
                 token: str = "") -> tuple[int, Any]:
    """``(HTTP status, decoded JSON body)`` of a call to a worker.

    Args:
        token: The workers' web token (``web_token``), sent as ``Authorization: Bearer``
            when not empty (as ``streamapp status`` sends it).

    Raises:
        OSError: The worker did not answer (``urllib.error.URLError`` is one).
        ValueError: It answered, but not with JSON.
    """
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    request = urllib.request.Request(url, method=method, data=b"" if method == "POST" else None,
                                     headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            return response.status, json.loads(response.read() or b"null")
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"null")


def load_url(base: str, name: str, version: str | None, keep: bool) -> str:
    """The ``POST /models/{name}/load`` URL on the worker at ``base``."""
    query = {k: v for k, v in (("version", version), ("keep", "true" if keep else None)) if v}
    path = f"/models/{urllib.parse.quote(name, safe='')}/load"
    return base.rstrip("/") + path + (f"?{urllib.parse.urlencode(query)}" if query else "")


def format_listing(body: dict[str, Any]) -> list[str]:
    """Lines of ``streamapp models``: per worker and model, the current version (``*``) among
    the loaded and available ones."""
    lines = []
    for worker in body.get("workers", []):
        who = worker.get("worker") or "?"
        if worker.get("status") in ("unreachable", "refused"):
            lines.append(f"{worker['url']} ({who}): {worker.get('message')}")
            continue
        lines.append(f"{worker['url']} ({who})")
        for name, model in sorted((worker.get("models") or {}).items()):
            loaded = model.get("loaded", {})
            shown = [f"{'*' if v == model.get('current') else ''}{v}"
                     f"{'' if v in loaded else ' (on disk)'}"
                     for v in model.get("available", [])]
            shown += [f"{v} (loaded, not on disk)" for v in loaded
                      if v not in model.get("available", [])]
            tag = loaded.get(model.get("current"), "")
            lines.append(f"  {name}: current {model.get('current')} ({tag}); versions "
                         f"{', '.join(shown)}")
    return lines


def format_load(status: int, body: dict[str, Any]) -> list[str]:
    """Lines of ``streamapp models load``: the outcome, then each worker's."""
    if status == 200:
        lines = [f"{body['model']} version {body['version']} is serving on "
                 f"{len(body['workers'])} worker(s)"]
    else:
        workers = body.get("workers") or []
        refused = [w for w in workers if w.get("status") in ("refused", "unreachable")]
        # the message repeats the first refusal, which its worker's line below says already
        message = (f"version {body.get('version')} of {body.get('model')} is refused by "
                   f"{len(refused)} of {len(workers)} worker(s), the old version keeps serving"
                   if refused else body.get("message"))
        lines = [f"refused ({body.get('error')}, HTTP {status}): {message}"]
    for worker in body.get("workers", []):
        who = worker.get("worker") or worker.get("url")
        if worker.get("status") in ("refused", "unreachable"):
            lines.append(f"  {who}: {worker['status']} {worker.get('reason')}: "
                         f"{worker.get('message')}")
        else:
            # a worker that only prepared (another refused) has switched from nothing yet
            was = ("" if worker.get("previous") is None
                   else f"was {worker.get('previous')}, ")
            lines.append(f"  {who}: {worker.get('status', 'prepared')} ({was}"
                         f"{worker.get('engine')}, {worker.get('samples_checked', 0)} "
                         "sample(s) checked)")
    return lines
