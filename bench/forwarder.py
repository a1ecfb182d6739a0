"""A Faust agent that only forwards: Faust's own per-event cost on this machine (a ceiling).

Run as a child process by the benchmark (``python -m bench.forwarder``), configured through
``BENCH_FWD_*`` variables and the same Faust options as the worker
(:func:`streamapp.app.faust_options`: group timings, linger, stream buffer, fetch wait), so the only
difference from the product is what the agent does with an event: here ``send`` the same key
and value to the output topic, nothing else.
"""

from __future__ import annotations

import os
from typing import Any

import faust

from streamapp.app import faust_options
from streamapp.faust_compat import set_fetch_max_wait
from streamapp.settings import load_settings


def create_app() -> faust.App:
    settings = load_settings()
    app = faust.App(f"{settings.app_id}", **faust_options(settings))
    raw = {"key_type": bytes, "value_type": bytes, "key_serializer": "raw",
           "value_serializer": "raw"}
    partitions = settings.topic_partitions
    source = app.topic(os.environ["BENCH_FWD_SOURCE"], partitions=partitions, **raw)
    sink = app.topic(os.environ["BENCH_FWD_SINK"], partitions=partitions, **raw)

    @app.agent(source, name="forward")
    async def forward(stream: faust.StreamT[bytes]) -> None:
        async for event in stream.events():
            # force=True: hand the record to the producer now rather than attaching it to
            # the source event (Faust's default inside an agent).
            await sink.send(key=event.key, value=event.value, force=True)

    @app.on_partitions_assigned.connect  # type: ignore[arg-type]
    async def on_assigned(app_: Any, assigned: set[Any], **kwargs: Any) -> None:
        # The same fetch wait as the worker (Faust fixes 1500 ms; see settings.fetch_max_wait_ms).
        set_fetch_max_wait(app, settings.fetch_max_wait_ms)

    return app


def main() -> None:
    faust.Worker(create_app(), loglevel="warning").execute_from_commandline()


if __name__ == "__main__":
    main()
