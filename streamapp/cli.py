"""The ``streamapp`` command line: ``broker``, ``worker``, ``publish`` and ``demo``."""

from __future__ import annotations

import asyncio
import logging
import sys
from pathlib import Path
from typing import Annotated, Optional

import typer

from streamapp.exceptions import StreamAppError

__all__ = ["cli", "main"]

cli = typer.Typer(
    name="streamapp",
    help="Kafka stream processing that turns keyed device events into model predictions.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)

Broker = Annotated[
    Optional[str],
    typer.Option("--broker", "-b", help="Bootstrap servers, e.g. kafka://127.0.0.1:9092 "
                 "[env STREAMAPP_BROKER]"),
]


def _fail(message: str, code: int = 1) -> typer.Exit:
    typer.secho(f"error: {message}", fg=typer.colors.RED, err=True)
    return typer.Exit(code)


@cli.command()
def broker(
    port: Annotated[Optional[int], typer.Option(help="Port to listen on (default: a free one).")]
    = None,
) -> None:
    """Run the embedded Kafka-compatible broker (Tansu) on 127.0.0.1 until Ctrl-C."""
    from streamapp.broker import run_broker_forever

    raise typer.Exit(run_broker_forever(port))


@cli.command()
def worker(
    broker: Broker = None,
    app_id: Annotated[Optional[str], typer.Option(help="Consumer group / Faust app id.")] = None,
    backend: Annotated[Optional[str], typer.Option(help="Engine backend or 'auto'.")] = None,
    models: Annotated[Optional[str], typer.Option(help="Comma-separated model names.")] = None,
    max_batch_size: Annotated[Optional[int], typer.Option()] = None,
    max_batch_delay_ms: Annotated[Optional[float], typer.Option()] = None,
    max_inflight_batches: Annotated[Optional[int], typer.Option()] = None,
    topic_prefix: Annotated[Optional[str], typer.Option()] = None,
    topic_partitions: Annotated[Optional[int], typer.Option()] = None,
    web_port: Annotated[Optional[int], typer.Option()] = None,
    web_bind: Annotated[Optional[str], typer.Option()] = None,
    data_dir: Annotated[Optional[Path], typer.Option()] = None,
    log_level: Annotated[Optional[str], typer.Option()] = None,
) -> None:
    """Run a worker: consume requests, batch, infer, produce results and dead letters.

    Every option can also be set as an environment variable STREAMAPP_<OPTION> (flags win).
    """
    import faust

    from streamapp.app import create_app
    from streamapp.broker import create_topics
    from streamapp.settings import load_settings

    try:
        settings = load_settings(
            broker=broker, app_id=app_id, backend=backend, models=models,
            max_batch_size=max_batch_size, max_batch_delay_ms=max_batch_delay_ms,
            max_inflight_batches=max_inflight_batches, topic_prefix=topic_prefix,
            topic_partitions=topic_partitions, web_port=web_port, web_bind=web_bind,
            data_dir=data_dir, log_level=log_level,
        )
        # Create our topics with the configured partition count before Faust touches them:
        # brokers that auto-create topics (Tansu does) would otherwise pick their default.
        create_topics(
            settings.bootstrap_servers,
            {t: settings.topic_partitions
             for t in (settings.request_topic, settings.result_topic, settings.dlq_topic)},
        )
        app = create_app(settings)
    except StreamAppError as exc:
        raise _fail(str(exc)) from None
    faust.Worker(app, loglevel=settings.log_level).execute_from_commandline()


@cli.command()
def publish(
    broker: Broker = None,
    devices: Annotated[int, typer.Option(min=1, help="Number of devices.")] = 16,
    count: Annotated[Optional[int], typer.Option(min=1, help="Frames to send (default: all "
                     "1,797; repeats the images when larger).")] = None,
    rate: Annotated[Optional[float], typer.Option(min=0.001, help="Frames per second "
                    "(default: as fast as possible).")] = None,
    codec: Annotated[str, typer.Option(help="json (base64 tensors) or msgpack.")] = "json",
    topic_prefix: Annotated[Optional[str], typer.Option()] = None,
    model: Annotated[str, typer.Option(help="Model name put in each request.")] = "digits",
) -> None:
    """Publish scikit-learn's handwritten digits as frames from N devices (keyed by device)."""
    from streamapp.client import digits_requests, load_digits_frames
    from streamapp.client import publish as publish_requests
    from streamapp.settings import load_settings

    if codec not in ("json", "msgpack"):
        raise _fail(f"--codec must be json or msgpack, got {codec!r}", 2)
    try:
        settings = load_settings(broker=broker, topic_prefix=topic_prefix)
    except StreamAppError as exc:
        raise _fail(str(exc)) from None
    images, _ = load_digits_frames()
    n = count or len(images)
    indices = [i % len(images) for i in range(n)]
    requests = digits_requests(images, devices=devices, model=model, indices=indices)
    sent = asyncio.run(
        publish_requests(
            settings.bootstrap_servers, settings.request_topic, requests,
            codec=codec,  # type: ignore[arg-type]
            rate_per_s=rate, progress=True,
        )
    )
    span = sent[-1].sent_at - sent[0].sent_at if len(sent) > 1 else 0.0
    typer.echo(
        f"published {len(sent)} frames from {devices} devices to {settings.request_topic} "
        f"in {span:.2f} s"
    )


@cli.command()
def demo(
    devices: Annotated[int, typer.Option(min=1)] = 16,
    codec: Annotated[str, typer.Option(help="json or msgpack.")] = "json",
    backend: Annotated[str, typer.Option(help="Engine backend or 'auto'.")] = "auto",
    workdir: Annotated[Optional[Path], typer.Option(help="Where logs and data go "
                       "(default: a temporary folder).")] = None,
    timeout_s: Annotated[float, typer.Option(help="Give up waiting for results after this.")]
    = 120.0,
) -> None:
    """End to end: broker + one worker + all 1,797 digits from N devices; prints a summary.

    Exits 1 if a check fails (accuracy, agreement with offline inference, order, dead letters).
    """
    from streamapp.demo import run_demo

    if codec not in ("json", "msgpack"):
        raise _fail(f"--codec must be json or msgpack, got {codec!r}", 2)
    try:
        ok = run_demo(devices=devices, codec=codec,  # type: ignore[arg-type]
                      backend=backend, workdir=workdir,
                      timeout_s=timeout_s)
    except StreamAppError as exc:
        raise _fail(str(exc)) from None
    raise typer.Exit(0 if ok else 1)


@cli.command()
def settings(
    reference: Annotated[bool, typer.Option("--reference", help="Print the Markdown reference "
                         "of every setting instead of the current values.")] = False,
) -> None:
    """Print the effective settings (environment + defaults) as JSON."""
    from streamapp.settings import load_settings, settings_reference

    if reference:
        typer.echo(settings_reference())
        return
    try:
        current = load_settings()
    except StreamAppError as exc:
        raise _fail(str(exc)) from None
    typer.echo(current.model_dump_json(indent=2))


def main() -> None:
    """Console-script entry point."""
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    cli(prog_name="streamapp")
    sys.exit(0)
