"""The ``streamapp`` command line: ``broker``, ``worker``, ``publish``, ``demo``, ``settings``,
``status``, ``results tail``, ``dlq tail`` / ``dlq replay``, ``tables rebuild`` and
``models check``."""

from __future__ import annotations

import asyncio
import logging
import sys
import time
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Annotated, Any, Optional, TypeVar

import typer
from aiokafka.errors import KafkaConnectionError, KafkaError

from engines.exceptions import EngineError
from streamapp.exceptions import ConfigError, PublishError, SecurityError, StreamAppError
from streamapp.settings import Settings

__all__ = ["cli", "main"]

cli = typer.Typer(
    name="streamapp",
    help="Kafka stream processing that turns keyed device events into model predictions.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
    context_settings={"show_default": True},
)



def _setting(name: str, extra: str = "") -> str:
    """The help of an option that sets the setting ``name``: its description (Markdown
    backticks dropped), ``extra``, its environment variable and its default."""
    field = Settings.model_fields[name]
    default = field.default
    if isinstance(default, tuple):
        default = ",".join(map(str, default))
    text = (field.description or "").replace("`", "")
    return (f"{text}{' ' + extra if extra else ''} Env STREAMAPP_{name.upper()}; "
            f"default: {default if default != '' else 'none'}.")


Broker = Annotated[
    Optional[str], typer.Option("--broker", "-b", help=_setting("broker"))
]


def _error_line(exc: BaseException, bootstrap: str, settings: Any = None) -> str:
    """The one line every command prints for a failure: a Kafka client error, or one of ours
    that a broker which did not answer caused, as :func:`streamapp.kafka.unreachable_line` words
    it; ours else.
    A refused login, certificate or ACL says which (:class:`SecurityError`; with
    ``settings``, a Kafka client error is looked into:
    :func:`streamapp.kafka.connection_error`)."""
    from streamapp.kafka import unreachable_line

    if isinstance(exc, SecurityError):
        return str(exc)
    client_error = exc if isinstance(exc, KafkaError) else exc.__cause__
    if settings is not None and isinstance(client_error, KafkaError):
        from streamapp.kafka import connection_error

        found = connection_error(settings, client_error, "")
        if isinstance(found, SecurityError):
            return str(found)
    if isinstance(exc, KafkaError):
        return unreachable_line(bootstrap, exc)
    if isinstance(exc.__cause__, KafkaConnectionError) and not isinstance(exc, PublishError):
        return unreachable_line(bootstrap, exc.__cause__)
    return str(exc)


def _quiet_kafka_client() -> int:
    """Leave connection errors to this command's one-line message: aiokafka logs each failed
    connect at ERROR as well. Returns the level to restore (the worker does, before Faust
    starts: a running worker keeps aiokafka's log)."""
    logger = logging.getLogger("aiokafka")
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    return level


def _fail(message: str, code: int = 1) -> typer.Exit:
    typer.secho(f"error: {message}", fg=typer.colors.RED, err=True)
    return typer.Exit(code)


def _check_port(port: int | None, option: str = "--port", *, free: str | None = None) -> None:
    """Refuse a TCP port outside 1-65535 (0 too, unless ``free`` says what 0 means) with one
    usage line (exit 2), before a library raises a traceback for it."""
    low = 0 if free else 1
    if port is not None and not low <= port <= 65535:
        also = f", or 0 for {free}" if free else ", or leave it out for a free one"
        raise _fail(f"{option} must be a TCP port, 1-65535{also}; got {port}", 2)


@cli.command()
def broker(
    port: Annotated[Optional[int], typer.Option(help="Port to listen on (default: a free one).")]
    = None,
    kafka: Annotated[bool, typer.Option(
        "--kafka", help="Run Apache Kafka (KRaft, one node; jars fetched with Maven once) "
        "instead of the embedded broker.")] = False,
    data_dir: Annotated[Optional[Path], typer.Option(
        help="With --kafka: keep the data here (default: a temporary directory).")] = None,
    secure: Annotated[bool, typer.Option(
        "--secure", help="With --kafka: a SASL_SSL listener (SCRAM-SHA-512, a CA made for "
        "the run), the StandardAuthorizer, users admin, worker and publisher with the ACLs of "
        "docs/deployment.md, and the topics of STREAMAPP_APP_ID; each user's settings are "
        "written to <data dir>/client-<user>.env (mode 0600).")] = False,
) -> None:
    """Run the embedded Kafka-compatible broker (Tansu), or Apache Kafka with --kafka, on
    127.0.0.1 until Ctrl-C; prints "bootstrap: HOST:PORT"."""
    _check_port(port)
    if secure and not kafka:
        raise _fail("--secure needs --kafka (the embedded broker has no TLS or SASL)", 2)
    if kafka:
        from streamapp.kafka_server import run_kafka_forever

        raise typer.Exit(run_kafka_forever(port, data_dir, secure=secure))
    if data_dir is not None:
        raise _fail("--data-dir needs --kafka (the embedded broker keeps data in memory)", 2)
    from streamapp.broker import run_broker_forever

    raise typer.Exit(run_broker_forever(port))


def _check_web_ports(settings: Any, workers: int) -> None:
    """Fail with one line when a worker's web port is taken (before Faust would fail with a
    traceback after loading the models). Worker i of ``--processes`` uses web_port + i."""
    from streamapp.children import port_taken

    for i in range(workers if settings.web_port else 0):  # 0: a free port each
        port = settings.web_port + i
        if port_taken(settings.web_bind, port):
            raise StreamAppError(
                f"web port {port} on {settings.web_bind} is already in use (another worker on "
                f"this host?): give this worker its own --web-port (STREAMAPP_WEB_PORT)"
            )


def use_event_loop(name: str) -> None:
    """Make new event loops ``name`` ones (``asyncio`` or ``uvloop``), before Faust creates its
    own (the app's loop and its consumer thread's).

    Raises:
        ConfigError: uvloop was asked for and is not installed.
    """
    if name != "uvloop":
        return
    try:
        import uvloop
    except ImportError:
        raise ConfigError(
            "event_loop=uvloop but uvloop is not installed: pip install 'streamapp[uvloop]', "
            "or set STREAMAPP_EVENT_LOOP=asyncio"
        ) from None
    asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())


def _changelog_topics(settings: Any, app: Any) -> list[str]:
    """The changelog topics of the worker's tables (of ``app`` when built, else by name)."""
    if app is not None:
        from streamapp.faust_compat import changelog_topics

        return changelog_topics(app)
    from streamapp.partitions import TABLE_NAMES, changelog_topic

    return [changelog_topic(settings.app_id, t) for t in TABLE_NAMES]


@cli.command()
def worker(
    broker: Broker = None,
    app_id: Annotated[Optional[str], typer.Option(help=_setting("app_id"))] = None,
    backend: Annotated[Optional[str], typer.Option(help=_setting("backend"))] = None,
    models: Annotated[Optional[str], typer.Option(help=_setting("models"))] = None,
    models_dir: Annotated[Optional[Path], typer.Option(help=_setting("models_dir"))] = None,
    max_batch_size: Annotated[Optional[int], typer.Option(help=_setting("max_batch_size"))]
    = None,
    max_batch_delay_ms: Annotated[Optional[float], typer.Option(
        help=_setting("max_batch_delay_ms"))] = None,
    max_inflight_batches: Annotated[Optional[int], typer.Option(
        help=_setting("max_inflight_batches"))] = None,
    topic_prefix: Annotated[Optional[str], typer.Option(help=_setting("topic_prefix"))] = None,
    topic_partitions: Annotated[Optional[int], typer.Option(
        help=_setting("topic_partitions"))] = None,
    web_port: Annotated[Optional[int], typer.Option(help=_setting(
        "web_port", "With --processes: of the first worker; worker i gets web_port + i."))]
    = None,
    web_bind: Annotated[Optional[str], typer.Option(help=_setting("web_bind"))] = None,
    data_dir: Annotated[Optional[Path], typer.Option(help=_setting(
        "data_dir", "One worker per directory; with --processes, worker i uses "
        "<data_dir>/worker-<i>."))] = None,
    log_level: Annotated[Optional[str], typer.Option(help=_setting("log_level"))] = None,
    processes: Annotated[Optional[int], typer.Option(
        min=1, help="Run and supervise N worker processes of one group on this host (own "
        "data dir, web port, group instance id and GPU each; restarted when they die). "
        "See docs/scaling.md.")] = None,
    reset_data_dir: Annotated[bool, typer.Option(
        "--reset-data-dir", help="Start afresh when the data dir holds the tables of another "
        "cluster or app: drop them (this cluster's are restored from its changelogs).")]
    = False,
    intake: Annotated[Optional[str], typer.Option(help=_setting("intake"))] = None,
    gpu_executor: Annotated[Optional[str], typer.Option(
        help="'inprocess' (default: each worker loads its engines) or 'shared' (one executor "
        "server per GPU merges every worker's batches; with --processes it is started per "
        "GPU, else start `streamapp gpu-server` first). See docs/scaleout.md.")] = None,
) -> None:
    """Run a worker: consume requests, batch, infer, produce results and dead letters.

    Every option can also be set as an environment variable STREAMAPP_<OPTION> (flags win).
    """
    from streamapp.datadir import check_data_dir, lock_data_dir
    from streamapp.kafka import (
        cluster_facts,
        create_topics,
        kafka_security_options,
        resolve_broker_kind,
        run_sync,
    )
    from streamapp.partitions import plan_partitions
    from streamapp.settings import load_settings, web_token
    from streamapp.transactions import check_guarantee

    _check_port(web_port, "--web-port", free="a free port")
    flags: dict[str, Any] = dict(
        broker=broker, app_id=app_id, backend=backend, models=models, models_dir=models_dir,
        max_batch_size=max_batch_size, max_batch_delay_ms=max_batch_delay_ms,
        max_inflight_batches=max_inflight_batches, topic_prefix=topic_prefix,
        topic_partitions=topic_partitions, web_port=web_port, web_bind=web_bind,
        data_dir=data_dir, log_level=log_level, gpu_executor=gpu_executor, intake=intake,
    )
    aiokafka_level = _quiet_kafka_client()
    bootstrap = broker or ""
    try:
        settings = resolve_broker_kind(load_settings(**flags))
        bootstrap = settings.bootstrap_servers
        web_token(settings)  # an unusable web_token_file: one line now, not in every child
        check_guarantee(settings)  # exactly_once needs transactions: before any start
        if processes is None:
            use_event_loop(settings.event_loop)
        # One process per data directory (RocksDB): fail here, before joining the group.
        lock_data_dir(settings.data_dir, holder="supervisor" if processes else "worker")
        _check_web_ports(settings, processes or 1)
        # The tables take the partition count of the topics that exist (a gateway may have
        # published first and the broker auto-created the request topic), or refuse.
        facts = cluster_facts(settings)
        plan = plan_partitions(settings, facts.partitions)
        notes = list(plan.notes)
        update: dict[str, Any] = {"topic_partitions": plan.partitions}
        if processes is None and settings.web_port == 0:  # a single worker: pick it now
            from streamapp.children import free_port

            update["web_port"] = free_port(settings.web_bind)
            notes.append(f"web port 0: this worker serves on port {update['web_port']}")
        settings = settings.model_copy(update=update)
        # Window sizes are fixed for a deployment: refuse others than the stored state's.
        from streamapp.tables.stored_windows import check_stored_windows

        notices = [n for n in (check_stored_windows(settings),) if n]
        app = None
        if processes is None:
            from streamapp.app import create_app

            note = check_data_dir(
                settings.data_dir, cluster_id=facts.cluster_id, app_id=settings.app_id,
                partitions=settings.topic_partitions, reset=reset_data_dir,
            )
            notes += [note] if note else []
            app = create_app(settings)
            loaded = app.streamapp_runtime.preload()  # type: ignore[attr-defined]
        for line in notes:
            typer.secho(f"warning: {line}", fg=typer.colors.YELLOW, err=True)
        # Create our topics and the tables' changelogs before Faust touches them: brokers that
        # auto-create topics (Tansu does) would pick their default count, and a changelog Faust
        # creates once its consumer has fetched metadata is read as 0 partitions (issue 18).
        topics = {t: settings.topic_partitions for t in settings.topics}
        changelogs = _changelog_topics(settings, app)
        create_topics(
            settings.bootstrap_servers,
            {**topics, **dict.fromkeys(changelogs, settings.topic_partitions)},
            replication_factor=settings.topic_replication_factor,
            security=kafka_security_options(settings),
            configs={name: {"cleanup.policy": "compact", **settings.changelog_topic_configs}
                     for name in changelogs},
        )
        if settings.security_protocol.startswith("SASL_") and settings.broker_kind == "kafka":
            from streamapp.acls import check_worker_acls

            # a missing ACL: one line now, not produce errors while the worker keeps reading
            run_sync(lambda: check_worker_acls(
                settings, changelogs, security=kafka_security_options(settings)))
    except (StreamAppError, EngineError) as exc:
        raise _fail(_error_line(exc, bootstrap)) from None
    logging.getLogger("aiokafka").setLevel(aiokafka_level)
    if app is None:
        from streamapp.supervisor import run_supervisor

        raise typer.Exit(run_supervisor(settings, processes or 1, flags))
    from streamapp.faust_compat import make_worker
    from streamapp.logs import startup_block

    banner = startup_block(settings, loaded)
    sys.setswitchinterval(settings.gil_switch_interval_ms / 1000.0)
    make_worker(app, settings.log_level, banner, notices).execute_from_commandline()


@cli.command("gpu-server")
def gpu_server(
    backend: Annotated[Optional[str], typer.Option(help="Engine backend or 'auto'.")] = None,
    models: Annotated[Optional[str], typer.Option(help="Comma-separated model names.")] = None,
    max_batch_size: Annotated[Optional[int], typer.Option(
        help="Largest merged batch (the engine's max batch).")] = None,
    socket_path: Annotated[Optional[str], typer.Option(
        "--socket", help="Unix socket to listen on (STREAMAPP_GPU_SERVER_SOCKET).")] = None,
    batch_delay_ms: Annotated[Optional[float], typer.Option(
        help="Longest a merged batch waits for other workers (STREAMAPP_GPU_SERVER_BATCH_"
        "DELAY_MS).")] = None,
) -> None:
    """Run the executor server of one GPU: load the models once and serve the host's workers
    (started with --gpu-executor shared) from one dynamic batcher. `streamapp worker
    --processes N --gpu-executor shared` starts one per GPU itself."""
    from streamapp.gpu_server import run_gpu_server
    from streamapp.settings import load_settings

    try:
        settings = load_settings(backend=backend, models=models, max_batch_size=max_batch_size,
                                 gpu_server_socket=socket_path,
                                 gpu_server_batch_delay_ms=batch_delay_ms)
        code = run_gpu_server(settings)
    except (StreamAppError, EngineError, OSError) as exc:
        raise _fail(str(exc)) from None
    raise typer.Exit(code)


def _own_frames(files: list[str], directory: Path | None) -> tuple[list[str], list[Any]]:
    """``(names, inputs)`` of the frames of ``--file`` (``-``: stdin) and ``--dir``, all read
    before anything is sent.

    Raises:
        FrameError: A file is not a frame (which one, and why).
    """
    from streamapp.frames import frame_files, iter_frames, read_stdin

    paths = [Path(f) for f in files if f != "-"]
    if directory is not None:
        paths += frame_files(directory)
    names, inputs = [], []
    for path, value in iter_frames(paths):
        names.append(str(path))
        inputs.append(value)
    if "-" in files:
        names.append("stdin")
        inputs.append(read_stdin())
    return names, inputs


@cli.command()
def publish(
    broker: Broker = None,
    devices: Annotated[int, typer.Option(min=1, help="Number of devices (device-00, ...); "
                       "frames go to them in turn.")] = 16,
    device: Annotated[Optional[str], typer.Option(
        "--device", "-d", metavar="ID",
        help="Send every frame from this device_id instead of --devices.")]
    = None,
    file: Annotated[Optional[list[str]], typer.Option(
        "--file", metavar="PATH", help="Send this frame (PNG, JPEG or .npy array) instead of the "
        "digits; repeatable; '-' reads one frame from stdin.")] = None,
    directory: Annotated[Optional[Path], typer.Option(
        "--dir", metavar="DIR",
        help="Send every .png, .jpg, .jpeg and .npy file of this directory, by name.")]
    = None,
    count: Annotated[Optional[int], typer.Option(min=1, help="Frames to send (default: each "
                     "frame once, all 1,797 digits; repeats the frames when larger).")] = None,
    rate: Annotated[Optional[float], typer.Option(min=0.001, help="Frames per second "
                    "(default: as fast as possible).")] = None,
    codec: Annotated[str, typer.Option(help="json (base64 tensors) or msgpack.")] = "json",
    topic_prefix: Annotated[Optional[str], typer.Option()] = None,
    model: Annotated[str, typer.Option(help="Model name put in each request.")] = "digits",
    deadline: Annotated[Optional[float], typer.Option(
        metavar="MS", help="Relative deadline of each request, milliseconds (above 0, at most "
        "86400000): older when its batch would start, a request gets an expired result "
        "instead of a prediction (docs/delivery.md, Queue policy). Default: the model's "
        "queue policy, if any.")] = None,
) -> None:
    """Publish frames keyed by device: scikit-learn's handwritten digits, or one's own files
    (--file, --dir, stdin).

    Every file is read and checked before anything is sent: one that is not a PNG, JPEG or
    .npy array (or is larger than max_request_bytes as a request) is one error line, exit 1.
    Creates the request topic with STREAMAPP_TOPIC_PARTITIONS partitions (default 16) when it
    does not exist, so that a worker started later finds the count its tables use. See the
    answers with `streamapp results tail`.
    """
    from streamapp.client import check_request_size, frame_requests, load_digits_frames
    from streamapp.client import publish as publish_requests
    from streamapp.frames import checked_deadline
    from streamapp.kafka import kafka_security_options
    from streamapp.records import TensorPayload, device_id_problem
    from streamapp.settings import load_settings

    if codec not in ("json", "msgpack"):
        raise _fail(f"--codec must be json or msgpack, got {codec!r}", 2)
    try:
        checked_deadline(deadline, "--deadline", "leave it out")
    except StreamAppError as exc:
        raise _fail(str(exc), 2) from None
    if device is not None and (problem := device_id_problem(device)) is not None:
        # the worker would dead-letter every frame as bad_device_id (an empty one used to be
        # replaced by device-00 without a word)
        raise _fail(f"--device {device!r}: {problem}", 2)
    files = file or []
    if files.count("-") > 1:
        raise _fail("--file - (stdin) can be given once", 2)
    try:
        settings = load_settings(broker=broker, topic_prefix=topic_prefix)
        security = kafka_security_options(settings)
        if files or directory is not None:
            names, inputs = _own_frames(files, directory)
        else:
            images, _ = load_digits_frames()
            names = [f"digit {i}" for i in range(len(images))]
            inputs = [TensorPayload(str(i.dtype), i.shape, i.tobytes()) for i in images]
        n = count or len(inputs)
        indices = [i % len(inputs) for i in range(n)]
        device_ids = [device] if device is not None else [f"device-{d:02d}" for d in range(devices)]
        requests = frame_requests(inputs, device_ids=device_ids, model=model, indices=indices,
                                  deadline=deadline)
        for index, request in requests[:len(inputs)]:  # the others repeat these
            check_request_size(request, codec, settings.max_request_bytes,  # type: ignore[arg-type]
                               names[index])
    except StreamAppError as exc:
        raise _fail(str(exc)) from None
    _quiet_kafka_client()
    started = time.monotonic()
    try:
        sent = asyncio.run(
            publish_requests(
                settings.bootstrap_servers, settings.request_topic, requests,
                codec=codec,  # type: ignore[arg-type]
                rate_per_s=rate, progress=True, security=security,
                partitions=settings.topic_partitions,
                replication_factor=settings.topic_replication_factor,
            )
        )
    except (StreamAppError, KafkaError) as exc:
        raise _fail(_error_line(exc, settings.bootstrap_servers, settings)) from None
    span = time.monotonic() - started  # connecting, sending and every acknowledgement
    senders = f"device {device}" if device else f"{min(devices, len(sent))} devices"
    frames = f"{len(sent)} frame{'s' * (len(sent) != 1)}"
    typer.echo(f"published {frames} from {senders} to {settings.request_topic} in {span:.2f} s")


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


# -- dlq ------------------------------------------------------------------------------------------

def _command_group(name: str, help: str) -> typer.Typer:
    """A ``streamapp NAME ...`` group of subcommands."""
    group = typer.Typer(name=name, help=help, no_args_is_help=True, add_completion=False,
                        pretty_exceptions_enable=False)
    cli.add_typer(group, name=name)
    return group


dlq_cli = _command_group("dlq", "Inspect and replay dead letters (the inference-dlq topic).")

TopicPrefix = Annotated[
    Optional[str], typer.Option(help="Topic name prefix (env STREAMAPP_TOPIC_PREFIX).")
]
Device = Annotated[Optional[str], typer.Option("--device", "-d", help="Only this device_id.")]
Since = Annotated[
    Optional[str],
    typer.Option(help="Only records since: a duration (10m, 2h, 1h30m), epoch seconds or "
                 "ISO 8601 (2026-05-01T12:00:00Z)."),
]
Follow = Annotated[bool, typer.Option("--follow", "-f", help="Keep printing new records until "
                   "Ctrl-C.")]
Limit = Annotated[int, typer.Option("--limit", "-n", min=0, help="Show the last N matching "
                  "records (0: all).")]

_E = TypeVar("_E")


def _topic_context(broker: str | None, topic_prefix: str | None) -> tuple[Any, dict[str, Any]]:
    from streamapp.kafka import kafka_security_options
    from streamapp.settings import load_settings

    try:
        settings = load_settings(broker=broker, topic_prefix=topic_prefix)
        return settings, kafka_security_options(settings)
    except StreamAppError as exc:
        raise _fail(str(exc)) from None


def _since(since: str | None) -> float | None:
    from streamapp.tail import parse_since

    if since is None:
        return None
    try:
        return parse_since(since)
    except ValueError as exc:
        raise _fail(str(exc), 2) from None


async def _print_tail(
    reader: Any,
    *,
    keep: Callable[[_E], bool],
    order: Callable[[_E], Any],
    limit: int,
    follow: bool,
    show: Callable[[list[_E], bool], None],
    summary: Callable[[int, int, int], str],
) -> None:
    """The body of a ``tail`` command: read ``reader`` to its end, print the last ``limit``
    entries that ``keep`` accepts in ``order``, a ``summary(shown, matching, read)`` line on
    stderr, then (``follow``) every new matching entry until Ctrl-C."""
    everything: list[_E] = await reader.read_to_end()
    matching = sorted((e for e in everything if keep(e)), key=order)
    shown = matching[-limit:] if limit else matching
    show(shown, bool(shown) or follow)
    typer.echo(summary(len(shown), len(matching), len(everything)), err=True)
    if follow:
        async for entry in reader.follow():
            if keep(entry):
                show([entry], False)


def _run_tail(settings: Any, run: Callable[[], Coroutine[Any, Any, None]]) -> None:
    """``asyncio.run(run())`` with our errors as one line, and Ctrl-C as a clean end."""
    _quiet_kafka_client()
    try:
        asyncio.run(run())
    except (StreamAppError, KafkaError) as exc:
        raise _fail(_error_line(exc, settings.bootstrap_servers, settings)) from None
    except KeyboardInterrupt:
        pass


@dlq_cli.command("tail")
def dlq_tail(
    broker: Broker = None,
    topic_prefix: TopicPrefix = None,
    reason: Annotated[Optional[str], typer.Option("--reason", "-r", help="Only this reason "
                      "code.")] = None,
    device: Device = None,
    since: Since = None,
    follow: Follow = False,
    limit: Limit = 50,
    as_json: Annotated[bool, typer.Option("--json", help="One JSON object per line (the "
                       "dead letter, key and value base64, plus its dlq position).")] = False,
) -> None:
    """Show dead letters: time, device, request_id, reason, stage, message, source."""
    from streamapp.dlq import (
        DeadLetterEntry,
        DeadLetterFilter,
        DeadLetterReader,
        format_entries,
        format_json_lines,
    )

    settings, security = _topic_context(broker, topic_prefix)
    where = DeadLetterFilter(reason=reason, device=device, since=_since(since),
                             retry_topic=settings.retry_topic)

    def show(entries: list[DeadLetterEntry], header: bool) -> None:
        text = (
            format_json_lines(entries)
            if as_json
            else format_entries(entries, header=header, fixed=follow,
                                retry_topic=settings.retry_topic)
        )
        if text:
            typer.echo(text)

    async def run() -> None:
        async with DeadLetterReader(
            settings.bootstrap_servers, settings.dlq_topic, security=security
        ) as reader:
            def summary(shown: int, matching: int, read: int) -> str:
                skipped = f", {reader.skipped} not decodable" if reader.skipped else ""
                return (f"{shown} shown of {matching} matching ({where.describe()}) of "
                        f"{read} dead letters in {settings.dlq_topic}{skipped}")

            await _print_tail(
                reader, keep=where.matches,
                order=lambda e: (e.failed_at, e.partition, e.offset),
                limit=limit, follow=follow, show=show, summary=summary,
            )

    _run_tail(settings, run)


@dlq_cli.command("replay")
def dlq_replay(
    reason: Annotated[str, typer.Option("--reason", "-r", help="Replay dead letters with this "
                      "reason code (required).")],
    broker: Broker = None,
    topic_prefix: TopicPrefix = None,
    device: Device = None,
    since: Since = None,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Count what would be replayed, "
                       "publish nothing.")] = False,
) -> None:
    """Re-publish the original requests of matching dead letters to the request topic.

    Each original key and value is sent unchanged, so the worker handles it as a new request
    (attempt 0). Fix the cause first; replaying twice sends the requests twice. A dead letter
    of the retry topic (invalid_retry_record) is replayed as the request its retry record
    carries, when that can be read; letters that hold no request are skipped and counted.
    """
    from streamapp.codecs import REASONS
    from streamapp.dlq import DeadLetterFilter, describe_causes, replay_dead_letters

    settings, security = _topic_context(broker, topic_prefix)
    where = DeadLetterFilter(reason=reason, device=device, since=_since(since),
                             retry_topic=settings.retry_topic)
    if reason not in REASONS:
        typer.secho(
            f"warning: {reason!r} is not a known reason code ({', '.join(REASONS)})",
            fg=typer.colors.YELLOW, err=True,
        )
    _quiet_kafka_client()
    try:
        report = asyncio.run(
            replay_dead_letters(
                settings.bootstrap_servers, settings.dlq_topic, settings.request_topic,
                where=where, dry_run=dry_run, security=security,
                retry_topic=settings.retry_topic,
            )
        )
    except (StreamAppError, KafkaError) as exc:
        raise _fail(_error_line(exc, settings.bootstrap_servers)) from None
    recreated = (
        f" ({report.recreated} of them re-created from the retry record that held the request)"
        if report.recreated else ""
    )
    # the count once: by cause only when there are several
    causes = (next(iter(report.not_replayed)) if len(report.not_replayed) == 1
              else describe_causes(report.not_replayed))
    not_replayable = (
        f"; {report.skipped} matching cannot be replayed, they hold no request ({causes})"
        if report.skipped else ""
    )
    if dry_run:
        typer.echo(
            f"dry run: would replay {report.matched - report.skipped} dead letters "
            f"({where.describe()}) to {report.request_topic}{recreated}; nothing published"
            f"{not_replayable}"
        )
    else:
        typer.echo(
            f"replayed {report.replayed} dead letters ({where.describe()}) to "
            f"{report.request_topic}{recreated}{not_replayable}"
        )


# -- results -------------------------------------------------------------------------------------

results_cli = _command_group("results", "Read the predictions (the inference-result topic).")


@results_cli.command("tail")
def results_tail(
    broker: Broker = None,
    topic_prefix: TopicPrefix = None,
    device: Device = None,
    since: Since = None,
    follow: Follow = False,
    limit: Limit = 50,
    as_json: Annotated[bool, typer.Option("--json", help="One JSON object per line (the "
                       "result plus its record position).")] = False,
) -> None:
    """Show results, one 80-column line each: device, seq, model and engine, top label and
    score, end-to-end latency (ms). Oldest first; a record that is not a result gets a line
    saying why."""
    from streamapp.results import (
        RESULT_HEADER,
        ResultEntry,
        ResultReader,
        format_result_json,
        format_result_line,
    )
    from streamapp.tail import iso_utc

    settings, security = _topic_context(broker, topic_prefix)
    since_s = _since(since)

    def show(entries: list[ResultEntry], header: bool) -> None:
        if as_json:
            text = format_result_json(entries)
        else:
            text = "\n".join([RESULT_HEADER] * header + [format_result_line(e) for e in entries])
        if text:
            typer.echo(text)

    async def run() -> None:
        async with ResultReader(
            settings.bootstrap_servers, settings.result_topic, security=security
        ) as reader:
            from_end = False
            if since_s is not None:
                await reader.start_at_time(since_s)
            elif device is None and limit:
                await reader.start_at_last(limit)  # else: a device's results may be anywhere
                # new-user trials read "3 shown of 38 matching (all) of 38 records read" as
                # "the topic holds 38 results" (it held 1,797), and then "(the last 50 of
                # each partition)" after "601 matching" as a count of the topic still
                from_end = True
            described = " ".join(
                ([f"device={device}"] if device is not None else [])
                + ([f"since={iso_utc(since_s)}"] if since_s is not None else [])
            ) or "all"

            def summary(shown: int, matching: int, read: int) -> str:
                if from_end:
                    return (f"{shown} shown of {matching} matching ({described}) in the last "
                            f"{limit} records of each partition of {settings.result_topic} "
                            f"({read} read; -n 0 reads the whole topic)")
                return (f"{shown} shown of {matching} matching ({described}) of {read} "
                        f"records read from {settings.result_topic}")

            await _print_tail(
                reader, keep=lambda e: device is None or e.device == device,
                order=lambda e: (e.timestamp_ms, e.partition, e.offset),
                limit=limit, follow=follow, show=show, summary=summary,
            )

    _run_tail(settings, run)


# -- tables (streamapp.rebuild) -----------------------------------------------------------------

tables_cli = _command_group("tables", "Maintain the worker's tables (device state, retry "
                            "counters) and their changelog topics.")


@tables_cli.command("rebuild")
def tables_rebuild(
    broker: Broker = None,
    app_id: Annotated[Optional[str], typer.Option(help="The workers' app id (consumer "
                      "group; env STREAMAPP_APP_ID).")] = None,
    topic_prefix: TopicPrefix = None,
    partitions: Annotated[Optional[int], typer.Option(min=1, help="Partition count to move "
                          "to (default: the request topic's); the request and retry topics "
                          "are grown to it too.")] = None,
) -> None:
    """Move the tables to the request topic's partition count, after partitions were added.

    Stop every worker of the group first. Grows the retry topic and the changelogs, then writes
    each row whose partition changed to its new partition (nothing is lost; running it again
    is safe). Workers started afterwards restore their tables from the changelogs.
    """
    from streamapp.rebuild import rebuild_tables
    from streamapp.settings import load_settings

    try:
        settings = load_settings(broker=broker, app_id=app_id, topic_prefix=topic_prefix)
    except StreamAppError as exc:
        raise _fail(str(exc)) from None
    _quiet_kafka_client()
    try:
        report = rebuild_tables(settings, partitions)
    except (StreamAppError, KafkaError) as exc:
        raise _fail(_error_line(exc, settings.bootstrap_servers)) from None
    for topic, (before, after) in report.grown.items():
        typer.echo(f"grew {topic} from {before} to {after} partitions")
    for table, rows in report.rows.items():
        typer.echo(f"{table}: {rows} rows, {report.moved[table]} moved to their new partition")
    typer.echo(f"tables of {settings.app_id!r} have {report.partitions} partitions; start the "
               f"workers with STREAMAPP_TOPIC_PARTITIONS={report.partitions} (they restore their "
               "tables from the changelogs)")


# -- models (streamapp.models.check, streamapp.models.commands, streamapp.views.models) -------

models_cli = typer.Typer(name="models", add_completion=False, pretty_exceptions_enable=False,
                         invoke_without_command=True,
                         help="List each worker's model versions, hot-swap a version, check "
                         "model folders (docs/models.md).")
cli.add_typer(models_cli, name="models")

WorkerUrl = Annotated[Optional[str], typer.Option(
    "--url", help="A worker's web URL; it reaches the others of its group (default "
    "http://127.0.0.1:<STREAMAPP_WEB_PORT>).")]


def _web_token(settings: Any) -> str:
    """The workers' web token (STREAMAPP_WEB_TOKEN or STREAMAPP_WEB_TOKEN_FILE; "" when none is
    set) that every command calling a worker's web API sends; an unusable one is one line."""
    from streamapp.settings import web_token

    try:
        return web_token(settings)
    except StreamAppError as exc:
        raise _fail(str(exc)) from None


def _shown_url(url: str) -> str | None:
    """``url`` as messages print it: its user info (``user:password@``) replaced by ``***@``
    and its query and fragment (``?token=...``) left out, so that no secret reaches a
    terminal or a log; None when it cannot be parsed (then print none of it)."""
    from urllib.parse import urlsplit, urlunsplit

    try:
        parts = urlsplit(url)
    except ValueError:  # e.g. an unclosed IPv6 bracket
        return None
    netloc = parts.netloc
    if "@" in netloc:
        netloc = "***@" + netloc.rpartition("@")[2]
    shown = urlunsplit((parts.scheme, netloc, parts.path, "", ""))
    if not netloc and "@" in shown:  # no "//" (user:pw@host:6066): the user info is the path's
        shown = "***@" + shown.rpartition("@")[2]
    return shown


def _check_url(url: str) -> None:
    """Refuse a ``--url`` that is not an http:// or https:// URL with a host (and a port in
    range, when it has one), or that carries a user name, password, query or fragment, with
    one usage line (exit 2) that echoes none of those, before any request."""
    from urllib.parse import urlsplit

    try:
        parts = urlsplit(url)
        usable = parts.scheme in ("http", "https") and bool(parts.hostname)
        _ = parts.port  # raises ValueError when it is not a port (0-65535)
    except ValueError:
        usable = False
    if not usable:
        shown = _shown_url(url)
        raise _fail("--url must be an http:// or https:// URL such as http://localhost:6066"
                    + ("" if shown is None else f"; got {shown!r}"), 2)
    # urllib would send a user name and password as part of the host name, and a query or
    # fragment would swallow the path appended to the URL (/models): refuse both
    if parts.username is not None or parts.password is not None:
        raise _fail("--url must not carry a user name or password (got "
                    f"{_shown_url(url)!r}): the worker takes its web token from "
                    "STREAMAPP_WEB_TOKEN (or STREAMAPP_WEB_TOKEN_FILE) set here", 2)
    if parts.query or parts.fragment or url.rstrip().endswith(("?", "#")):
        hidden = ("?…" if "?" in url else "") + ("#…" if "#" in url else "")  # shown, not said
        raise _fail("--url must be the worker's base URL, without a query or fragment, such "
                    f"as http://localhost:6066 (got {(_shown_url(url) or '') + hidden!r}); the "
                    "web token goes in STREAMAPP_WEB_TOKEN", 2)


def _worker(url: str | None) -> tuple[str, str]:
    """The worker's web URL (``--url``, else this host's STREAMAPP_WEB_PORT) and the web token
    to send it.

    Raises:
        typer.Exit: 2 with a usage line when ``url`` is not an http(s) URL
            (:func:`_check_url`); 1 with one line when the settings or the token are unusable.
    """
    from streamapp.settings import load_settings

    if url is not None:
        _check_url(url)
    try:
        settings = load_settings()
    except StreamAppError as exc:
        raise _fail(str(exc)) from None
    default = f"http://127.0.0.1:{settings.web_port}"
    return url if url is not None else default, _web_token(settings)


def _ask(base: str, url: str, token: str, method: str = "GET",
         timeout_s: float | None = None) -> tuple[int, Any]:
    """A call to the worker at ``base`` (a URL :func:`_check_url` passed) with the web token;
    a worker that does not answer or refuses the token (401) is one error line.

    Raises:
        typer.Exit: 1 when the worker does not answer, answers with no JSON, or answers 401.
    """
    from http.client import HTTPException
    from json import JSONDecodeError

    from streamapp.models.commands import request_json

    # a --url with user info, a query or a fragment was refused (_check_url): nothing secret
    shown = _shown_url(base) or "the --url given"
    try:
        status, body = (request_json(url, method, token=token) if timeout_s is None
                        else request_json(url, method, timeout_s=timeout_s, token=token))
    except JSONDecodeError as exc:
        raise _fail(f"{shown} answered, but not with JSON ({exc}); is it a streamapp worker's "
                    "web port (STREAMAPP_WEB_PORT)?") from None
    except (OSError, ValueError, HTTPException) as exc:  # InvalidURL is an HTTPException
        problem = " ".join(str(exc).split())  # one line, whatever a server sent
        raise _fail(f"the worker at {shown} did not answer ({problem}); is it running? give "
                    "its web URL with --url") from None
    if status == 401:
        message = body.get("message") if isinstance(body, dict) else None
        sent = ("the STREAMAPP_WEB_TOKEN (or STREAMAPP_WEB_TOKEN_FILE) set here is not the "
                "worker's" if token else "set STREAMAPP_WEB_TOKEN (or STREAMAPP_WEB_TOKEN_FILE) "
                "to the worker's web token")
        raise _fail(f"{shown} answered 401 (unauthorized): {message or 'no web token'}; {sent}")
    return status, body


@models_cli.callback()
def models_list(ctx: typer.Context, url: WorkerUrl = None) -> None:
    """Every worker's versions of each model: the current one (*), loaded, on disk.

    Sends the web token (STREAMAPP_WEB_TOKEN or STREAMAPP_WEB_TOKEN_FILE) when one is set.
    Exits 1 when a worker does not answer, 2 when --url is not an http:// or https:// URL.
    """
    if ctx.invoked_subcommand is not None:
        if url is not None:  # `models --url URL load ...`: the subcommand's default
            _check_url(url)
            ctx.obj = {"url": url}
        return
    from streamapp.models.commands import LIST_TIMEOUT_S, format_listing

    base, token = _worker(url)
    status, body = _ask(base, base.rstrip("/") + "/models", token, timeout_s=LIST_TIMEOUT_S)
    if status != 200 or not isinstance(body, dict):
        message = body.get("message") if isinstance(body, dict) else None
        raise _fail(f"{_shown_url(base) or 'the worker'} answered {status}: {message or body}")
    for line in format_listing(body):
        typer.echo(line)
    if any(w.get("status") == "unreachable" for w in body.get("workers", [])):
        raise typer.Exit(1)


@models_cli.command("load")
def models_load(
    ctx: typer.Context,
    name: Annotated[str, typer.Argument(help="The model, e.g. digits.")],
    version: Annotated[Optional[str], typer.Option(
        help="The version (default: the highest in the repository); an older one is the "
        "rollback.")] = None,
    keep: Annotated[bool, typer.Option("--keep", help="Keep the previous version loaded for "
                    "requests that pin it.")] = False,
    url: WorkerUrl = None,
) -> None:
    """Load a version on every worker of the group, warm it up, check it against its declared
    samples, then switch between two batches. Exits 1 when it is refused (the old version
    keeps serving) and prints each worker's reason; exits 2 when --url is not an http:// or
    https:// URL. Sends the web token (STREAMAPP_WEB_TOKEN or STREAMAPP_WEB_TOKEN_FILE) when one
    is set. ``streamapp models --url URL load ...`` works as ``load ... --url URL``."""
    from streamapp.models.commands import format_load, load_url

    if url is None and isinstance(ctx.obj, dict):
        url = ctx.obj.get("url")
    if version is not None and not version.strip():
        raise _fail("--version must name a version, e.g. --version 2 (leave it out for the "
                    "highest)", 2)
    base, token = _worker(url)
    status, body = _ask(base, load_url(base, name, version, keep), token, "POST")
    for line in format_load(status, body if isinstance(body, dict) else {}):
        typer.echo(line, err=status != 200)
    if status != 200:
        raise typer.Exit(1)


@models_cli.command("check")
def models_check(
    paths: Annotated[Optional[list[Path]], typer.Argument(
        help="Model folders (metadata.json + model file). Default: the worker's models "
        "(STREAMAPP_MODELS in STREAMAPP_MODELS_DIR).")] = None,
    backend: Annotated[Optional[str], typer.Option(help=_setting("backend"))] = None,
    models_dir: Annotated[Optional[Path], typer.Option(help=_setting("models_dir"))] = None,
    models: Annotated[Optional[str], typer.Option(help=_setting("models"))] = None,
) -> None:
    """Check that a worker can serve a model folder, and print which requests it accepts.

    Loads the model file with the backend, compares metadata.json with the engine's IO tensors,
    runs one batch, then the checks of worker start and `models load`: a warm-up batch and the
    samples the metadata declares. A model with version folders is checked at every version,
    with a summary of each and the version a worker starts on. Each problem is one line on
    stderr; exits 1 if any folder has one.
    """
    from streamapp.models.check import check_model, format_check, format_versions
    from streamapp.models.repository import ModelRepository
    from streamapp.settings import load_settings

    try:
        settings = load_settings(backend=backend, models_dir=models_dir, models=models)
    except StreamAppError as exc:
        raise _fail(str(exc)) from None
    if not paths:
        root = ModelRepository(settings.models_dir).root
        paths = [root / name for name in settings.models]
    # A repository (a folder of model folders) stands for each model in it, a model with
    # version folders for each version.
    paths = [m for p in paths for m in _model_folders(p)]
    failed = 0
    checks = []
    for i, path in enumerate(paths):
        check = check_model(path, backend=settings.backend,
                            max_batch_size=settings.max_batch_size)
        checks.append(check)
        if check.ok:
            typer.echo(("\n" if i else "") + "\n".join(format_check(check, top_k=settings.top_k)))
            continue
        failed += 1
        for problem in check.problems:
            typer.secho(f"error: {path}: {problem}", fg=typer.colors.RED, err=True)
    summary = format_versions(checks)
    if summary:
        typer.echo("\n" + "\n".join(summary))
    if failed:
        raise typer.Exit(1)
    versioned = [p.name.isdigit() and not (p / "model.onnx").is_dir() for p in paths]
    names = ",".join(dict.fromkeys(p.parent.name if v else p.name
                                   for p, v in zip(paths, versioned, strict=True)))
    where = {p.parent.parent if v else p.parent for p, v in zip(paths, versioned, strict=True)}
    dir_flag = f" --models-dir {next(iter(where))}" if len(where) == 1 and where != {
        ModelRepository().root} else ""
    typer.echo(f"ok: streamapp worker{dir_flag} --models {names} serves "
               f"{'it' if len(paths) == 1 else 'them'}")


def _model_folders(path: Path) -> list[Path]:
    """The model folders ``path`` stands for: itself (a folder with ``metadata.json``, or not a
    folder) and its version folders (``NAME/<V>/``), or every version of every model in it (a
    repository)."""
    from streamapp.exceptions import ModelNotFoundError
    from streamapp.models.repository import ModelRepository

    if not path.is_dir():
        return [path]
    versions = sorted((p for p in path.iterdir() if p.name.isdigit()
                       and (p / "metadata.json").is_file()), key=lambda p: int(p.name))
    if (path / "metadata.json").exists():
        return [path, *versions]  # a flat folder may hold version folders too
    if versions:
        return versions
    repo = ModelRepository(path)
    found = []
    for name in repo.names():
        try:
            found += list(repo.versions(name).values())
        except (ModelNotFoundError, ConfigError):
            found.append(path / name)
    return found or [path]


# -- status (streamapp.status) -------------------------------------------------------------------


@cli.command()
def status(
    urls: Annotated[Optional[list[str]], typer.Argument(
        help="Worker web URLs (default: the workers a `worker --processes N` lists in "
        "<data_dir>/supervisor.json, else http://127.0.0.1:<STREAMAPP_WEB_PORT>).")] = None,
    data_dir: Annotated[Optional[Path], typer.Option(help="Where a supervisor's "
                        "supervisor.json is looked for (env STREAMAPP_DATA_DIR).")] = None,
    watch: Annotated[bool, typer.Option("--watch", "-w", help="Refresh until Ctrl-C.")] = False,
    interval: Annotated[float, typer.Option(min=0.1, help="Seconds between the two scrapes "
                        "that rates are computed from (and between refreshes).")] = 2.0,
    top: Annotated[int, typer.Option(min=1, help="Devices to list.")] = 5,
    discover: Annotated[bool, typer.Option(help="Also show every worker the first one's "
                        "/cluster names.")] = True,
) -> None:
    """Terminal view of workers: throughput, DLQ rate, p50/p99, batch size, lag, top devices.

    Sends the web token (STREAMAPP_WEB_TOKEN or STREAMAPP_WEB_TOKEN_FILE) when one is set.
    Exits 1 when a worker is unreachable or not ready (without --watch).
    """
    from streamapp.settings import load_settings
    from streamapp.status import run_status, supervised_urls

    restarts = supervisor_dir = None
    try:
        current = load_settings(data_dir=data_dir)
    except StreamAppError as exc:
        raise _fail(str(exc)) from None
    token = _web_token(current)
    if not urls:
        restarts = supervised_urls(current.data_dir)
        supervisor_dir = current.data_dir if restarts else None
        urls = list(restarts) if restarts else [f"http://127.0.0.1:{current.web_port}"]
    raise typer.Exit(run_status(urls, interval_s=interval, watch=watch, top=top,
                                discover_peers=discover, restarts=restarts,
                                supervisor_dir=supervisor_dir, token=token))


def main() -> None:
    """Console-script entry point."""
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    cli(prog_name="streamapp")
    sys.exit(0)
