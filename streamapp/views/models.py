"""``/models``, ``/models/{name}/load`` and ``/models/{name}/unload``: versions and hot swap
across the group.

Any worker takes the command and reaches every worker of the group over HTTP, the way device
queries are forwarded (:mod:`streamapp.views.routing`): the workers are the ones the group's
assignment names (``/cluster``), and a forwarded request carries the forwarding header so that
it is answered where it lands. A load is two-phase: every worker prepares the version (loads,
warms up, checks its samples: :mod:`streamapp.models.swap`); only when all of them succeeded
does each switch, else each discards it and the answer names every worker's reason. Why HTTP
and not a control topic: the command must answer with each worker's outcome (refused with
which reason, or serving), which a topic cannot give without a reply channel; a worker that
starts later serves the version recorded in the repository's ``current`` file.
"""

from __future__ import annotations

import asyncio
import logging
import urllib.parse
from typing import TYPE_CHECKING, Any

import aiohttp
import faust
from faust.web import Request, Response

from streamapp.exceptions import ModelSwapError
from streamapp.models.repository import normal_version
from streamapp.views.errors import ApiError, ApiView
from streamapp.views.params import check_params, choice
from streamapp.views.routing import FORWARDED_HEADER, call_worker, group_urls, same_worker

if TYPE_CHECKING:
    from streamapp.state import WorkerState

__all__ = ["SWAP_TIMEOUT_S", "add_model_views"]

log = logging.getLogger(__name__)

#: Seconds a worker gets to prepare a version (load a plan, warm up, run the samples).
SWAP_TIMEOUT_S = 300.0
#: Seconds a worker gets to list its versions or switch to a prepared one.
CALL_TIMEOUT_S = 10.0
PHASES = ("prepare", "commit", "abort")


def _refusal(exc: ModelSwapError, worker: str, url: str) -> dict[str, Any]:
    return {"worker": worker, "url": url, "status": "refused", "reason": exc.reason,
            "message": str(exc), "http_status": exc.status}


def add_model_views(app: faust.App, state: WorkerState) -> None:
    """Register the model version endpoints (see the module docstring and docs/api.md)."""
    swapper = state.runtime.swapper

    async def each_worker(method: str, path_qs: str, timeout_s: float,
                          local: Any) -> list[dict[str, Any]]:
        """Call every worker of the group at once: this one through ``local()``, the others
        over HTTP. Each answer is the worker's JSON body plus ``url`` and ``http_status``; an
        unreachable worker gives ``status: unreachable``."""
        own = state.url

        async def one(url: str) -> dict[str, Any]:
            if same_worker(url, own):
                try:
                    body = await local()
                    return {"url": own, "worker": state.worker, "http_status": 200, **body}
                except ModelSwapError as exc:
                    return _refusal(exc, state.worker, own)
            try:
                status, body = await call_worker(app, url, method, path_qs, timeout_s)
            except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
                log.warning("%s %s on %s failed: %s", method, path_qs, url, exc)
                return {"url": url, "status": "unreachable", "reason": "worker_unreachable",
                        "message": f"{url} did not answer ({type(exc).__name__}: {exc})",
                        "http_status": 503}
            body = body if isinstance(body, dict) else {"body": body}
            if status >= 400:
                return {"url": url, "worker": body.get("worker"), "status": "refused",
                        "reason": body.get("error", "error"), "message": body.get("message"),
                        "http_status": status}
            return {"url": url, "http_status": status, **body}

        return list(await asyncio.gather(*(one(u) for u in group_urls(app, state.tables))))

    @app.page("/models")
    class Models(ApiView):
        """Every worker's model versions: current, loaded, available, the last swaps."""

        async def get(self, request: Request) -> Response:
            check_params(request.query, ())
            if request.headers.get(FORWARDED_HEADER):
                return self.json({"worker": state.worker, "url": state.url,
                                  "models": swapper.describe()})

            async def local() -> dict[str, Any]:
                return {"models": swapper.describe()}

            workers = await each_worker("GET", "/models", CALL_TIMEOUT_S, local)
            return self.json({"self": state.url, "workers": workers})

    @app.page("/models/{name}/load")
    class Load(ApiView):
        """Load a version on every worker, check it, then switch (two-phase)."""

        async def post(self, request: Request, name: str) -> Response:
            query = request.query
            forwarded = bool(request.headers.get(FORWARDED_HEADER))
            check_params(query, ("version", "keep", "phase") if forwarded else
                         ("version", "keep"))
            keep = choice(query, "keep", ("false", "true"), default="false") == "true"
            version = normal_version(query["version"]) if query.get("version") else None
            if forwarded:
                return self.json(await self._phase(name, version, keep, query.get("phase")))
            if version is None:
                try:  # unknown_model for a model this worker does not serve
                    version = swapper.target_version(name)
                except ModelSwapError as exc:
                    raise ApiError(exc.status, exc.reason, str(exc)) from None
            quoted = urllib.parse.quote(name, safe="")
            base = f"/models/{quoted}/load?version={urllib.parse.quote(version, safe='')}"
            prepared = await each_worker(
                "POST", f"{base}&phase=prepare", SWAP_TIMEOUT_S,
                lambda: swapper.prepare(name, version))
            refused = [w for w in prepared if w.get("status") in ("refused", "unreachable")]
            if refused:
                await each_worker("POST", f"{base}&phase=abort", CALL_TIMEOUT_S,
                                  lambda: self._abort(name, version))
                first = refused[0]
                raise ApiError(
                    max(int(w["http_status"]) for w in refused), str(first["reason"]),
                    f"version {version} of {name} is refused by {len(refused)} of "
                    f"{len(prepared)} worker(s), the old version keeps serving; "
                    f"{first.get('worker') or first['url']}: {first['message']}",
                    model=name, version=version, workers=prepared,
                )
            committed = await each_worker(
                "POST", f"{base}&phase=commit&keep={'true' if keep else 'false'}",
                CALL_TIMEOUT_S, lambda: swapper.commit(name, version, keep=keep))
            for worker in committed:
                worker.setdefault("status", "serving")
                for got in prepared:
                    if got["url"] == worker["url"]:
                        worker.update({k: got[k] for k in ("samples_checked", "load_ms")
                                       if k in got})
            failed = [w for w in committed if w["status"] != "serving"]
            if failed:
                raise ApiError(
                    502, "commit_incomplete",
                    f"version {version} of {name} was prepared everywhere but "
                    f"{len(failed)} worker(s) did not switch ({failed[0]['message']}); the "
                    "others serve it: run the load again", model=name, version=version,
                    workers=committed,
                )
            return self.json({"model": name, "version": version, "status": "serving",
                              "workers": committed})

        async def _phase(self, name: str, version: str | None, keep: bool,
                         phase: str | None) -> dict[str, Any]:
            if phase not in PHASES:
                raise ApiError(400, "bad_query", f"phase={phase!r}; use one of "
                               f"{', '.join(PHASES)}")
            if version is None:
                raise ApiError(400, "bad_query", "a forwarded load names its version")
            try:
                if phase == "prepare":
                    body = await swapper.prepare(name, version)
                elif phase == "commit":
                    body = await swapper.commit(name, version, keep=keep)
                else:
                    body = await self._abort(name, version)
            except ModelSwapError as exc:
                raise ApiError(exc.status, exc.reason, str(exc), worker=state.worker) from None
            return {"worker": state.worker, **body}

        @staticmethod
        async def _abort(name: str, version: str) -> dict[str, Any]:
            return {"model": name, "version": version,
                    "status": "discarded" if await swapper.abort(name, version) else "none"}

    @app.page("/models/{name}/unload")
    class Unload(ApiView):
        """Unload a version kept loaded (``keep=true``) on every worker."""

        async def post(self, request: Request, name: str) -> Response:
            query = request.query
            check_params(query, ("version",))
            if not query.get("version"):
                raise ApiError(400, "bad_query", "give the version to unload: ?version=V")
            version = normal_version(query["version"])

            async def local() -> dict[str, Any]:
                await swapper.unload(name, version)
                return {"model": name, "version": version, "status": "unloaded"}

            if request.headers.get(FORWARDED_HEADER):
                try:
                    return self.json({"worker": state.worker, **await local()})
                except ModelSwapError as exc:
                    raise ApiError(exc.status, exc.reason, str(exc)) from None
            path = (f"/models/{urllib.parse.quote(name, safe='')}/unload?version="
                    f"{urllib.parse.quote(version, safe='')}")
            workers = await each_worker("POST", path, CALL_TIMEOUT_S, local)
            refused = [w for w in workers if w.get("status") != "unloaded"]
            if refused:
                raise ApiError(max(int(w["http_status"]) for w in refused),
                               str(refused[0]["reason"]), str(refused[0]["message"]),
                               workers=workers)
            return self.json({"model": name, "version": version, "workers": workers})
