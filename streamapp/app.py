"""The Faust application: topics, the request agent and the worker's web views.

``faust -A streamapp.app worker`` finds the module attribute ``app``, created on first access
from the environment (``STREAMAPP_*``); ``streamapp worker`` builds it with :func:`create_app`
from CLI flags. Nothing is read at import time.
"""

from __future__ import annotations

import logging
from typing import Any

import faust
from faust.web import Request, Response, View

from streamapp.agents.pipeline import SourceMessage
from streamapp.runtime import FaustSink, WorkerRuntime
from streamapp.settings import Settings, load_settings

__all__ = ["create_app"]

log = logging.getLogger(__name__)


def faust_options(settings: Settings) -> dict[str, Any]:
    """Faust app settings derived from ours (group timings per shared/BROKER.md)."""
    return {
        "broker": settings.faust_broker,
        "datadir": str(settings.data_dir),
        "web_bind": settings.web_bind,
        "web_port": settings.web_port,
        "web_host": settings.web_bind,
        "broker_session_timeout": settings.session_timeout_s,
        "broker_heartbeat_interval": settings.heartbeat_interval_s,
        "broker_rebalance_timeout": settings.rebalance_timeout_s,
        "broker_request_timeout": settings.request_timeout_s,
        "producer_linger_ms": settings.producer_linger_ms,
        "stream_buffer_maxsize": settings.stream_buffer_maxsize,
        "topic_partitions": settings.topic_partitions,
        "topic_replication_factor": 1,
        "consumer_auto_offset_reset": "earliest",
        "key_serializer": "raw",
        "value_serializer": "raw",
        "web_enabled": True,
    }


def create_app(settings: Settings | None = None) -> faust.App:
    """Build the worker's Faust app.

    Args:
        settings: Defaults to :func:`~streamapp.settings.load_settings` (the environment).

    Returns:
        The app, with the ``inference`` agent on the request topic and the web views
        ``/health``, ``/ready`` and ``/engines``.
    """
    if settings is None:
        settings = load_settings()
    conf = settings
    app = faust.App(conf.app_id, **faust_options(conf))
    raw = {"key_type": bytes, "value_type": bytes, "key_serializer": "raw",
           "value_serializer": "raw"}
    request_topic = app.topic(
        settings.request_topic, partitions=settings.topic_partitions, **raw  # type: ignore[arg-type]
    )
    outputs = {
        name: app.topic(name, partitions=settings.topic_partitions, **raw)  # type: ignore[arg-type]
        for name in (settings.result_topic, settings.dlq_topic)
    }
    runtime = WorkerRuntime(settings)
    app.streamapp_runtime = runtime  # type: ignore[attr-defined]
    app.streamapp_settings = settings  # type: ignore[attr-defined]

    @app.agent(request_topic, name="inference")
    async def inference(stream: faust.StreamT[bytes]) -> None:
        # noack: a record is acked by the pipeline once its outcome was acknowledged by the
        # broker, not when the next record is read (Faust's default).
        pipeline = await runtime.start(FaustSink(outputs))
        try:
            async for event in stream.noack().events():  # type: ignore[attr-defined]
                message = event.message
                await pipeline.handle(
                    SourceMessage(
                        key=message.key,
                        value=message.value,
                        topic=message.topic,
                        partition=message.partition,
                        offset=message.offset,
                        ack=event.ack,
                    )
                )
        finally:
            await runtime.stop()

    @app.page("/health")
    class Health(View):
        async def get(self, request: Request) -> Response:
            return self.json({"status": "ok", "worker": runtime.worker})

    @app.page("/ready")
    class Ready(View):
        async def get(self, request: Request) -> Response:
            assigned = sorted(
                f"{tp.topic}:{tp.partition}"
                for tp in app.consumer.assignment()
                if tp.topic == conf.request_topic
            )
            ready = runtime.ready and bool(assigned)
            body = {"ready": ready, "assigned": assigned, **runtime.describe()}
            return self.json(body, status=200 if ready else 503)

    @app.page("/engines")
    class Engines(View):
        async def get(self, request: Request) -> Response:
            return self.json(runtime.describe()["engines"])

    return app


def __getattr__(name: str) -> Any:
    # ``faust -A streamapp.app`` looks up ``app`` here; build it from the environment once.
    if name == "app":
        built = create_app()
        globals()["app"] = built
        return built
    raise AttributeError(name)
