"""``/metrics``: Prometheus text exposition of this worker's registry."""

from __future__ import annotations

from typing import TYPE_CHECKING

import faust
from faust.web import Request, Response

from streamapp.metrics import CONTENT_TYPE_LATEST
from streamapp.views.errors import ApiView
from streamapp.views.limits import Cached
from streamapp.views.params import check_params

if TYPE_CHECKING:
    from streamapp.state import WorkerState

__all__ = ["add_metrics_view"]


def add_metrics_view(app: faust.App, state: WorkerState, cache_s: float = 0.0) -> None:
    """Register ``/metrics``.

    Args:
        cache_s: The text is rendered at most once per this many seconds (``web_cache_ms``):
            a dashboard or a scrape storm costs the event loop one render per interval.
    """
    rendered: Cached[bytes] = Cached(cache_s, max_keys=1)

    @app.page("/metrics")
    class MetricsView(ApiView):
        """Prometheus metrics (text format 0.0.4)."""

        async def get(self, request: Request) -> Response:
            check_params(request.query, ())
            body = await rendered.get("metrics", state.metrics.render)
            # aiohttp refuses a charset inside content_type; the text format is UTF-8 anyway
            return self.bytes(body, content_type=CONTENT_TYPE_LATEST.split(";")[0])
