"""``/health``, ``/ready``, ``/engines`` and ``/cluster``."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import faust
from faust.web import Request, Response

from streamapp.views.errors import ApiView
from streamapp.views.params import check_params

if TYPE_CHECKING:
    from streamapp.state import WorkerState

__all__ = ["add_health_views"]


def add_health_views(app: faust.App, state: WorkerState) -> None:
    @app.page("/health")
    class Health(ApiView):
        """Liveness: the worker's event loop answers."""

        async def get(self, request: Request) -> Response:
            check_params(request.query, ())
            return self.json({"status": "ok", "worker": state.worker})

    @app.page("/ready")
    class Ready(ApiView):
        """200 when partitions are assigned, engines warmed up, tables recovered, their
        partition count matches the topics', the executor server is reachable (with
        ``gpu_executor=shared``), a broker answers a Kafka request and the worker
        makes progress while records wait; else 503. ``state`` is ``degraded`` (with the
        reasons in ``degraded``) while device state is degraded; rows kept in memory only (a
        full disk) alone keep 200."""

        async def get(self, request: Request) -> Response:
            check_params(request.query, ())
            checks = state.readiness()
            broker, problems = await state.broker_checks()
            problems.update(state.readiness_problems(checks))
            checks.update(broker)
            ready = all(checks.values())
            degraded = state.degraded()  # served and kept, but not as it should be
            if "table_partitions" in degraded:
                problems["table_partitions_match"] = degraded["table_partitions"]
            body: dict[str, Any] = {
                "ready": ready,
                "checks": checks,
                "problems": problems,
                "assigned": [f"{t}:{p}" for t, p in state.assigned()],
                "url": state.url,
                **state.runtime.describe(),
            }
            body["ready"] = ready  # describe() has the runtime's own flag
            body["state"] = "degraded" if degraded else "ok"
            body["degraded"] = degraded
            return self.json(body, status=200 if ready else 503)

    @app.page("/engines")
    class Engines(ApiView):
        """The engine serving each model."""

        async def get(self, request: Request) -> Response:
            check_params(request.query, ())
            return self.json(state.runtime.describe()["engines"])

    @app.page("/cluster")
    class Cluster(ApiView):
        """The workers of the group (web URLs) and the partitions each one owns."""

        async def get(self, request: Request) -> Response:
            check_params(request.query, ())
            topic = state.tables.stats.changelog_topic.get_topic_name()
            try:
                metadata = app.router.table_metadata(state.tables.stats.name)
            except KeyError:
                metadata = {}
            workers = [
                {"url": str(url), "partitions": sorted(metadata[url].get(topic) or [])}
                for url in sorted(metadata, key=str)
            ]
            return self.json({"self": state.url, "worker": state.worker, "workers": workers})
