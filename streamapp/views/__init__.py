"""The worker's web API (Faust views on its aiohttp server).

Every answer is JSON except ``/metrics``; every error is
``{"error": code, "message": ..., "status": n}`` (400 bad query, 404 unknown device, 503 not
ready or busy, 429 rate limited; the last two with ``Retry-After``), also for a request the web
server cannot read (414 URL or 431 header too long, 400 not HTTP:
:class:`~streamapp.views.errors.JsonErrorsAppRunner`). Device queries are answered
by the worker that owns the device and forwarded there from any other worker
(:mod:`streamapp.views.routing`). :data:`ENDPOINTS` is the API reference; the docs/api.md's
table is kept equal to it by a test. What queries may take from the event loop is bounded
(:mod:`streamapp.views.limits`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import faust

from streamapp.faust_compat import set_web_runner
from streamapp.settings import web_token
from streamapp.views.auth import WEB_AUTH_KEY, WebAuth
from streamapp.views.devices import add_device_views
from streamapp.views.errors import ApiError, ApiView, JsonErrorsAppRunner, json_http_errors
from streamapp.views.health import add_health_views
from streamapp.views.limits import WebLimits
from streamapp.views.metrics import add_metrics_view
from streamapp.views.models import add_model_views

if TYPE_CHECKING:
    from streamapp.state import WorkerState

__all__ = ["ENDPOINTS", "ApiError", "ApiView", "WebAuth", "api_reference", "install_views"]

#: ``(method, path, query parameters, description)`` of every endpoint.
ENDPOINTS: tuple[tuple[str, str, str, str], ...] = (
    ("GET", "/health", "",
     "Liveness: 200 `{\"status\": \"ok\"}` while the event loop answers."),
    ("GET", "/ready", "",
     "Readiness: 200 when partitions are assigned, every engine is loaded and warmed up, the "
     "tables are recovered and their partition count matches the request and retry topics' "
     "(`table_partitions_match`; docs/tables.md), with `gpu_executor=shared` the executor "
     "server is reachable (`gpu_server_reachable`), a bootstrap server answers a Kafka request "
     "within `ready_probe_timeout_ms` and, while records wait, the worker made progress within "
     "`ready_stall_s`; 503 otherwise. Body: `ready`, `checks` (name → bool), `problems` "
     "(failing check → why), `assigned`, `engines`, `state` (`ok`, or `degraded` while device "
     "state is degraded: kept in memory only, e.g. a full disk, which alone keeps 200, or "
     "partition counts that differ) and `degraded` (why, by component)."),
    ("GET", "/engines", "",
     "Per model: backend, engine tag (version + model/plan hash), device, precision, "
     "max batch size."),
    ("GET", "/metrics", "",
     "Prometheus text format (see *Metrics*), rendered at most once per `web_cache_ms`."),
    ("GET", "/cluster", "",
     "This worker's URL and every worker of the group with the partitions it owns."),
    ("GET", "/models", "",
     "Every worker's model versions (each worker of the group is asked, as `/cluster` lists "
     "them): per worker `models` → `current` version, `loaded` (version → engine tag), "
     "`available` (versions in the repository), `swaps` (the last ones: `version`, `previous`, "
     "`engine`, `at`, and once the old version is closed `unloaded` and "
     "`device_memory_returned_bytes`, null on a CPU); an unreachable worker shows "
     "`status: unreachable`."),
    ("POST", "/models/{name}/load", "`version` (default the highest in the repository), "
     "`keep` (`false`, `true`: keep the previous version loaded for requests that pin it)",
     "Hot swap on every worker of the group (docs/versions.md): each worker loads the version, "
     "runs a warm-up batch and the samples its metadata declares; only when all succeeded does "
     "each switch, between two batches. 200 `{model, version, status: serving, workers}`. "
     "Refused (the old version keeps serving everywhere): 404 `version_not_found` / "
     "`unknown_model`, 409 `incompatible_version` / `busy` / `not_supported` "
     "(`gpu_executor=shared`), 422 `bad_metadata` / `load_failed` / `warmup_failed` / "
     "`check_failed`, 503 `not_ready` / `worker_unreachable`; the body's `workers` gives each "
     "worker's `status`, `reason` and `message`. 502 `commit_incomplete` when a worker did not "
     "switch after all had prepared."),
    ("POST", "/models/{name}/unload", "`version` (required)",
     "Unload on every worker a version kept with `keep=true` (not the current one); its "
     "device memory is returned once its last batch finished. 404 `version_not_found` when "
     "not loaded, 409 `version_serving` for the version serving (load another first)."),
    ("GET", "/devices", "`limit` (1–1000, 100), `sort` (`device_id`, `-total`, `-last_seen`), "
     "`cursor` (the previous page's `next_cursor`) or `offset` (0)",
     "Devices **this** worker owns: `count`, `devices` (id, total, counts, last seq, last "
     "seen, e2e EWMA), `next_cursor` and `next_offset` (null on the last page). From a "
     "snapshot up to `web_cache_ms` old (longer while a scan of many devices is slow). Only "
     "`sort=device_id` walks every device exactly once: with `-total` or `-last_seen` a later "
     "page is cut from a newer snapshot, so devices whose values changed in between can be "
     "skipped or repeated."),
    ("GET", "/devices/{device_id}", "",
     "The device's stats from its owner (any worker forwards): `total`, `counts` by outcome "
     "(`expired` and `superseded` too once the device has one, docs/delivery.md), dead "
     "letters and retries by reason, `last_seq`, `last_result`, `latency_ewma_ms`, "
     "`clock_skew`, `first_seen`, `last_seen`, and `state_reset` (`reason`, `detail`, `at`, "
     "`source`) when its stored row could not be read and its counts started afresh at `at` "
     "(docs/tables.md). 404 when unknown."),
    ("GET", "/devices/{device_id}/windows", "`kind` (`tumbling`, `hopping`), "
     "`last` (1–what expiry keeps, at most 1000; 6)",
     "The device's `last` windows, oldest first, empty ones included: `start`, `end`, "
     "`count`, `results`, `dead_letters`, `retries`, `skipped` (expired or superseded by a "
     "queue policy), `e2e_mean_ms`, `e2e_max_ms`, `labels` "
     "(and `state_reset` when a stored bucket of it could not be read)."),
)


def api_reference() -> str:
    """The Markdown table of :data:`ENDPOINTS` (what docs/api.md shows)."""
    rows = ["| method | path | query | answer |", "|---|---|---|---|"]
    for method, path, query, text in ENDPOINTS:
        rows.append(f"| {method} | `{path}` | {query or '—'} | {text} |")
    return "\n".join(rows)


def install_views(app: faust.App, state: WorkerState) -> WebLimits:
    """Register every endpoint of :data:`ENDPOINTS` on ``app``, answer paths no endpoint
    serves with JSON errors too (:func:`~streamapp.views.errors.json_http_errors`), and
    requests aiohttp cannot read, e.g. a URL too long
    (:class:`~streamapp.views.errors.JsonErrorsAppRunner`), behind the
    web token (:mod:`streamapp.views.auth`: every route, those registered later included,
    except ``web_open_paths``) and the bounds of :mod:`streamapp.views.limits`
    (``web_max_concurrent_requests``, ``web_max_requests_per_s``, ``web_cache_ms``).

    Returns:
        The bounds' state (counters of refused requests).

    Raises:
        ConfigError: ``web_token_file`` cannot be read or holds no usable token.
    """
    settings = state.settings
    limits = WebLimits(settings.web_max_concurrent_requests, settings.web_max_requests_per_s)
    auth = WebAuth(web_token(settings), settings.web_open_paths)
    # faust.web.Web's type has no web_app; the aiohttp driver (the only one) has. The JSON
    # errors outermost: a refusal by the bounds is JSON already. The token before the bounds:
    # requests without it do not use up the rate bound of those with it.
    web_app = app.web.web_app  # type: ignore[attr-defined]
    web_app[WEB_AUTH_KEY] = auth
    web_app.middlewares.append(json_http_errors)
    web_app.middlewares.append(auth.middleware())
    web_app.middlewares.append(limits.middleware())
    # requests aiohttp cannot read (a URL over MAX_URL_BYTES, ...) never reach a middleware
    set_web_runner(app, lambda web_app: JsonErrorsAppRunner(web_app, access_log=None))
    cache_s = settings.web_cache_ms / 1000.0
    add_health_views(app, state)
    add_metrics_view(app, state, cache_s)
    add_device_views(app, state, cache_s)
    add_model_views(app, state)
    return limits
