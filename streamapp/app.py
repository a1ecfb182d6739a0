"""The Faust application and the one place the worker is wired together: Faust options,
topics, tables, delivery, runtime, state, web views and the two agents.

``faust -A streamapp.app worker`` finds the module attribute ``app``, created on first access
from the environment (``STREAMAPP_*``); ``streamapp worker`` builds it with :func:`create_app`
from CLI flags. Nothing is read at import time.
"""

from __future__ import annotations

import asyncio
import json
import logging
import sys
from collections.abc import Sequence
from typing import Any

import faust
from yarl import URL

from streamapp.agents.pipeline import SourceMessage
from streamapp.delivery import Delivery
from streamapp.exceptions import BrokerError
from streamapp.faust_compat import (
    FaustConsumer,
    FaustSink,
    changelog_topics,
    event_context,
    flush_producer,
    group_metadata,
    guard_undecodable_batches,
    install_direct_intake,
    make_producer_transactional,
    producer_client,
    recover_past_transaction_markers,
    screen_changelog,
    set_fetch_max_wait,
    set_producer_buffer_max,
    set_read_committed,
    tolerate_stale_member_url,
)
from streamapp.intake import IntakeBuffer
from streamapp.kafka import resolve_broker_kind, ssl_context
from streamapp.partitions import (
    RETRY_TABLE,
    PartitionCheck,
    TablePartitionsError,
    wait_for_metadata,
)
from streamapp.retry import RetryRecord
from streamapp.runtime import WorkerRuntime
from streamapp.settings import Settings, load_settings
from streamapp.state import UNASSIGNED_WARN_S, advertised_host, build_state
from streamapp.tables.rows import RowScreen
from streamapp.topology import TopicWatch
from streamapp.transactions import (
    TRANSACTION_TIMEOUT_MS,
    LockedSink,
    SendGate,
    TransactionCommitter,
    check_guarantee,
    transactional_id,
    use_group_metadata,
)
from streamapp.views import install_views

__all__ = ["TableRetryStore", "create_app"]

log = logging.getLogger(__name__)


def faust_options(settings: Settings) -> dict[str, Any]:
    """Every Faust app setting derived from ours (group timings per docs/broker.md).

    Security: ``broker_credentials`` is a ``faust.SSLCredentials`` (SSL), a
    ``faust.SASLCredentials`` (SASL_PLAINTEXT; with the TLS context for SASL_SSL), or absent
    (PLAINTEXT); Faust hands it to every consumer and producer it creates.

    Raises:
        ConfigError: A TLS file cannot be loaded (see :func:`streamapp.kafka.ssl_context`).
    """
    security: dict[str, Any] = {}
    context = ssl_context(settings)
    if settings.security_protocol.startswith("SASL_"):
        security["broker_credentials"] = faust.SASLCredentials(
            username=settings.sasl_username,
            password=settings.sasl_password.get_secret_value(),
            mechanism=settings.sasl_mechanism,
            ssl_context=context,  # SASL_SSL when given, SASL_PLAINTEXT when None
        )
    elif context is not None:
        security["broker_credentials"] = faust.SSLCredentials(context)
    return {
        **security,
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
        "broker_max_poll_records": settings.max_poll_records,
        "consumer_max_fetch_size": max(settings.max_fetch_bytes, 2 * settings.max_request_bytes),
        "producer_max_request_size": settings.max_produce_bytes,
        "stream_buffer_maxsize": settings.stream_buffer_maxsize,
        "topic_partitions": settings.topic_partitions,
        "topic_replication_factor": settings.topic_replication_factor,
        "consumer_auto_offset_reset": "earliest",
        "consumer_group_instance_id": settings.group_instance_id or None,
        "key_serializer": "raw",
        "value_serializer": "raw",
        "web_enabled": True,
        # Routing needs the URL peers reach us at (Faust derives it from web_host, where ours
        # is the bind address; a wildcard bind would advertise 0.0.0.0).
        "canonical_url": URL(f"http://{advertised_host(settings)}:{settings.web_port}"),
        "recovery_consistency_check": settings.consistency_check,
        # New partitions are seen (and read) within this, not Faust's 5 min (issue 18).
        "consumer_metadata_max_age_ms": int(settings.metadata_refresh_interval_s * 1000),
        "producer_metadata_max_age_ms": int(settings.metadata_refresh_interval_s * 1000),
    }


class TableRetryStore:
    """:class:`~streamapp.retry.RetryStore` on the changelogged ``retry_counts`` table.

    Keys are the request id's UTF-8 bytes and values JSON bytes encoded here; the table uses
    Faust's raw serializers (``key_type``/``value_type`` bytes). With a JSON key serializer on
    the changelog, recovery failed to decode the raw keys and a restarted worker never became
    ready once any request had been retried.
    """

    def __init__(self, table: Any, check: PartitionCheck | None = None) -> None:
        self.table = table
        self.check = check
        #: Reads the rows and screens the changelog records the table restores
        #: (:mod:`streamapp.tables.rows`): one that cannot be read is logged, counted and
        #: dropped, and never stops the recovery of the worker's other tables.
        self.screen = RowScreen(table.name, "retry")
        screen_changelog(table, self.screen)

    def _writable(self) -> bool:
        return self.check is None or self.check.gate()

    def record_attempt(self, record: RetryRecord, event: Any) -> None:
        if not self._writable():
            return
        with event_context(event):
            self.table[record.request_id.encode()] = json.dumps(record.row()).encode()

    def finish(self, request_id: str, event: Any) -> None:
        key = request_id.encode()
        if not self._writable():
            return
        with event_context(event):
            if key in self.table:
                del self.table[key]

    def get(self, request_id: str) -> dict[str, Any] | None:
        """The row of a request, or None (also when its stored bytes are not a row: logged)."""
        key = request_id.encode()
        return self.screen.read(key, self.table.get(key))


def _transactions(
    app: faust.App, conf: Settings, faust_side: FaustConsumer
) -> TransactionCommitter | None:
    """With ``processing_guarantee="exactly_once"``: Faust's producer made transactional and
    the committer of its transactions (:mod:`streamapp.transactions`); else None.

    Raises:
        ConfigError: exactly_once on the embedded broker (it has no transactions).
    """
    check_guarantee(conf)
    if conf.processing_guarantee != "exactly_once":
        return None
    gate = SendGate()
    committer = TransactionCommitter(
        None, gate, group_id=app.conf.id, outputs_lock=asyncio.Lock(),
        flush_buffer=app.producer.flush, crash=faust_side.crash,
    )
    instance = conf.group_instance_id or None

    def started(producer: Any) -> None:
        use_group_metadata(producer._sender, lambda: group_metadata(app, instance))
        committer.on_started(producer)

    make_producer_transactional(app, transactional_id(conf), gate.wrap, started,
                                transaction_timeout_ms=TRANSACTION_TIMEOUT_MS)
    recover_past_transaction_markers(app, conf)
    return committer


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
    # A batch the consumer cannot decode becomes dead letters there, never a stopped partition.
    guard_undecodable_batches((conf.request_topic, conf.retry_topic))
    raw = {"key_type": bytes, "value_type": bytes, "key_serializer": "raw",
           "value_serializer": "raw"}
    partitions = conf.topic_partitions
    # acks=False: Faust's own ack/commit bookkeeping loses records around rebalances; offsets
    # of our source topics are committed by streamapp.delivery instead.
    request_topic = app.topic(
        conf.request_topic, partitions=partitions, acks=False, **raw  # type: ignore[arg-type]
    )
    retry_topic = app.topic(
        conf.retry_topic, partitions=partitions, acks=False, **raw  # type: ignore[arg-type]
    )
    outputs = {
        name: app.topic(name, partitions=partitions, **raw)  # type: ignore[arg-type]
        for name in (conf.result_topic, conf.dlq_topic, conf.retry_topic)
    }
    # Attempt counters, keyed by request_id like the retry topic (so they are co-partitioned).
    # Memory store + changelog: restored from the changelog on start; no persisted offsets that
    # Tansu's wrong ListOffsets answer could contradict (docs/broker.md).
    retry_counts = app.Table(
        RETRY_TABLE,
        # key_type/value_type bytes select Faust's raw serializers for the changelog too (a
        # Schema argument does not reach the changelog topic's key decoding in Faust 0.15.3)
        key_type=bytes, value_type=bytes,
        partitions=partitions, store="memory://",
        extra_topic_configs=conf.changelog_topic_configs,
    )
    check = PartitionCheck(app, conf)
    retry_store = TableRetryStore(retry_counts, check)
    faust_side = FaustConsumer(app, conf)
    transactions = _transactions(app, conf, faust_side)
    delivery = Delivery(faust_side, commit_interval_s=conf.commit_interval_ms / 1000.0,
                        transactions=transactions)
    # Acknowledgements count only on partitions that exist (a broker that came back empty
    # acknowledges records to vanished topics: streamapp.topology).
    watch = TopicWatch(
        conf.topics, lambda: producer_client(app),
        lambda problem: faust_side.crash(BrokerError(problem)),
    )
    runtime = WorkerRuntime(conf, delivery, faust_side, ack_guard=watch,
                            transactions=transactions)
    sink: Any = FaustSink(outputs, app)
    if transactions is not None:
        sink = LockedSink(sink, transactions.outputs_lock)
    state = build_state(app, conf, runtime, check)  # device tables and metrics
    install_views(app, state)  # /health /ready /engines /metrics /devices ...
    observers = state.observers
    tolerate_stale_member_url(app)
    app.streamapp_runtime = runtime  # type: ignore[attr-defined]
    app.streamapp_settings = conf  # type: ignore[attr-defined]
    app.streamapp_retry_counts = retry_counts  # type: ignore[attr-defined]
    app.streamapp_state = state  # type: ignore[attr-defined]
    state.screens.append(retry_store.screen)

    @app.on_partitions_assigned.connect  # type: ignore[arg-type]
    async def on_assigned(app_: Any, assigned: set[Any], **kwargs: Any) -> None:
        if transactions is not None:
            # The producer's id is initialised first: that fences this worker's previous
            # incarnation and ends its open transaction, before any committed offset is read.
            await transactions.started.wait()
        try:  # before any table write: Faust would read an unknown changelog as 0 partitions
            await wait_for_metadata(app, dict.fromkeys(changelog_topics(app), partitions))
        except TablePartitionsError as exc:
            log.critical("%s", exc)
            await app.crash(exc)
            return
        if not set_fetch_max_wait(app, conf.fetch_max_wait_ms, conf.fetch_min_bytes):
            log.warning("could not set the consumer's fetch_max_wait_ms and fetch_min_bytes "
                        "(Faust's consumer has no aiokafka fetcher where faust_compat looks): "
                        "fetches wait Faust's 1,500 ms for 1 byte")
        else:
            log.debug("fetches wait at most %g ms for %d bytes", conf.fetch_max_wait_ms,
                      conf.fetch_min_bytes)
        set_read_committed(app)
        # room for one state flush (a stats row and window buckets per device touched since
        # the last one: thousands with thousands of devices), so that a flush does not stall
        # the consumer (see set_producer_buffer_max)
        set_producer_buffer_max(
            app, max(16_384, 8 * conf.max_batch_size * conf.max_inflight_batches)
        )
        delivery.on_assigned({
            (tp.topic, tp.partition) for tp in assigned
            if tp.topic in (conf.request_topic, conf.retry_topic)
        })

    @app.timer(conf.metadata_refresh_interval_s)
    async def check_partitions() -> None:
        # logs the ERROR line even while no request and no /ready call looks
        _ = check.degraded

    def log_unassigned() -> None:
        # Faust starts timers only after the first assignment's recovery: a plain callback
        unassigned = state.unassigned_problem()
        if unassigned is not None:
            log.warning("%s", unassigned)

    @app.on_before_shutdown.connect  # type: ignore[arg-type]
    async def on_shutdown(app_: Any, **kwargs: Any) -> None:
        # Faust has stopped fetching but its consumer still runs: the last moment to commit.
        await runtime.finish_for_shutdown()

    @app.on_partitions_revoked.connect  # type: ignore[arg-type]
    async def on_revoked(app_: Any, revoked: set[Any], **kwargs: Any) -> None:
        await delivery.on_revoked({(tp.topic, tp.partition) for tp in revoked})
        # The device rows that revocation's state flush wrote reach the changelog before the
        # partitions' next owner reads its end: Faust flushed its producer before sending this
        # signal, and a signal's receivers run in no set order (a device's count was one below
        # its result records after a handover, tests/integration/test_state_handover.py).
        await flush_producer(app)

    async def admitted_direct(records: Sequence[Any]) -> list[SourceMessage]:
        """The records to process for a chunk of the direct intake (streamapp.intake)."""
        return await delivery.admit_many([
            (r.topic, r.partition, r.offset, r.key, r.value, r) for r in records])

    async def admitted(events: Sequence[Any]) -> list[SourceMessage]:
        """The records to process for these events, in read order (more than one per event
        after a consumer gap)."""
        return await delivery.admit_many([
            (m.topic, m.partition, m.offset, m.key, m.value, event)
            for event in events for m in (event.message,)
        ])

    # Records reach the agents in chunks (intake=faust: Faust's take_events, at most
    # ``max_batch_size`` or what arrived within ``intake_wait_ms``; intake=direct: one fetched
    # partition's records at a time, see streamapp/intake.py). Admission, decoding and
    # queueing then run once per chunk instead of once per record (issue 17).
    chunk, within = conf.max_batch_size, conf.intake_wait_ms / 1000.0
    # intake=direct: Faust's fetcher hands each fetched partition's records to these buffers
    # (streamapp/intake.py); the agents' streams then stay empty.
    intake: dict[str, IntakeBuffer] = {}
    if conf.intake == "direct":
        limit = 2 * conf.max_batch_size * (conf.max_inflight_batches + 1)
        intake = {conf.request_topic: IntakeBuffer(limit), conf.retry_topic: IntakeBuffer(limit)}
        install_direct_intake(app, intake)

        @app.on_partitions_revoked.connect  # type: ignore[arg-type]
        async def drop_fetched(app_: Any, revoked: set[Any], **kwargs: Any) -> None:
            for buffer in intake.values():  # their next owner reads them (Faust drops its
                buffer.clear()              # streams' buffers on a rebalance too)

    @app.agent(request_topic, name="inference")
    async def inference(stream: faust.StreamT[bytes]) -> None:
        # noack + acks=False: a record counts as finished only when the broker acknowledged its
        # result, retry record or dead letter (see streamapp.delivery).
        # a worker that never gets a partition says why, once (also with nobody asking /ready)
        watchdog = asyncio.get_running_loop().call_later(UNASSIGNED_WARN_S, log_unassigned)
        pipeline = await runtime.acquire(sink, retry_store, observers)
        try:
            if intake:
                async for records in intake[conf.request_topic].chunks(stream, chunk):
                    await pipeline.handle_many(await admitted_direct(records))
            else:
                async for events in stream.noack().take_events(chunk, within):  # type: ignore[attr-defined]
                    await pipeline.handle_many(await admitted(events))
        finally:
            watchdog.cancel()
            await runtime.release()

    @app.agent(retry_topic, name="retry")
    async def retry(stream: faust.StreamT[bytes]) -> None:
        await runtime.acquire(sink, retry_store, observers)
        try:
            if intake:
                async for records in intake[conf.retry_topic].chunks(stream, chunk):
                    for message in await admitted_direct(records):
                        await runtime.schedule_retry(message, retry_store)
            else:
                async for events in stream.noack().take_events(chunk, within):  # type: ignore[attr-defined]
                    for message in await admitted(events):
                        await runtime.schedule_retry(message, retry_store)
        finally:
            await runtime.release()

    return app


def __getattr__(name: str) -> Any:
    # ``faust -A streamapp.app`` looks up ``app`` here; build it from the environment once.
    if name == "app":
        settings = load_settings()
        if "worker" in sys.argv[1:]:  # `faust -A streamapp.app worker`: one per data dir
            from streamapp.datadir import lock_data_dir

            lock_data_dir(settings.data_dir)
        built = create_app(resolve_broker_kind(settings))
        globals()["app"] = built
        return built
    raise AttributeError(name)
