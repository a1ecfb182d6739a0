"""The few places where streamapp reaches into Faust internals, kept in one module.

faust-streaming is pinned (0.15.3); each helper says what it relies on and why there is no
public API for it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import weakref
from collections.abc import (
    Awaitable,
    Callable,
    Iterable,
    Iterator,
    Mapping,
    Sequence,
)
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import faust
from aiokafka.errors import MessageSizeTooLargeError
from faust.streams import _current_event
from faust.types import TP

from streamapp.intake import DirectRecord, IntakeBuffer, direct_records
from streamapp.kafka import kafka_security_options, read_partition_range
from streamapp.record_batches import guard_record_batches, is_skipped_stand_in
from streamapp.settings import Settings

__all__ = [
    "FaustConsumer",
    "FaustSink",
    "PartitionMarks",
    "StandInEvent",
    "commit_offsets",
    "committed_or_earliest",
    "event_context",
    "flush_producer",
    "group_metadata",
    "guard_undecodable_batches",
    "install_direct_intake",
    "make_producer_transactional",
    "make_worker",
    "partition_marks",
    "producer_buffer_stalled",
    "producer_client",
    "recover_past_transaction_markers",
    "screen_changelog",
    "set_fetch_max_wait",
    "set_producer_buffer_max",
    "set_read_committed",
    "set_web_runner",
    "tolerate_stale_member_url",
]

log = logging.getLogger(__name__)


@contextmanager
def event_context(event: Any) -> Iterator[None]:
    """Make ``event`` Faust's *current event* inside the block.

    Faust tables find the partition of a write (changelog and RocksDB store) from the current
    event, which Faust only sets while an agent iterates its stream. The pipeline writes tables
    after a batch finished, outside that iteration, so it sets the event the row belongs to.
    """
    token = _current_event.set(weakref.ref(event) if event is not None else None)
    try:
        yield
    finally:
        _current_event.reset(token)


async def committed_or_earliest(app: Any, topic: str, partition: int) -> int:
    """The group's committed offset of a partition, or its log start when none was committed.

    Uses the aiokafka consumer that Faust runs in its consumer thread (Faust exposes no call
    for a committed offset).
    """
    from aiokafka import TopicPartition

    thread = app.consumer._thread
    consumer = thread._ensure_consumer()
    committed = await thread.call_thread(consumer.committed, TopicPartition(topic, partition))
    if committed is not None and committed >= 0:
        return int(committed)
    earliest = await app.consumer.earliest_offsets(TP(topic, partition))
    return int(next(iter(earliest.values()), 0) or 0)


async def flush_producer(app: Any) -> bool:
    """Wait until every record handed to Faust's producer (its buffer included) is delivered.

    Faust's own buffer flush gives up after 0.1 s without progress, so it is repeated (at most
    20 times) until the buffer is empty.

    Returns:
        False when the producer is stopped (logged at DEBUG), else True.
    """
    producer = app.producer
    try:
        for _ in range(20):
            await producer.flush()
            if producer.buffer.size == 0:
                break
    except Exception as exc:  # the producer is stopped
        log.debug("producer flush skipped: %s", exc)
        return False
    return True


async def commit_offsets(app: Any, offsets: Mapping[tuple[str, int], int]) -> bool:
    """Commit ``{(topic, partition): next offset}`` for the group, bypassing Faust's ack-based
    bookkeeping (see :mod:`streamapp.offsets`). Partitions no longer assigned are skipped by
    Faust's driver. Returns True when the broker accepted the commit."""
    assigned = app.consumer.assignment()
    # Only partitions still assigned: Faust's driver filters too, but hands aiokafka an empty
    # dict when none is left, and aiokafka's ValueError then crashes Faust's consumer.
    tps = {TP(t, p): o for (t, p), o in offsets.items() if TP(t, p) in assigned}
    if not tps:
        return False
    ok: bool = await app.consumer._commit(tps)
    return ok


def set_fetch_max_wait(app: Any, ms: float, min_bytes: int = 1) -> bool:
    """Set how long the worker's fetch requests wait for data (aiokafka ``fetch_max_wait_ms``)
    and for how many bytes (``fetch_min_bytes``).

    Faust 0.15.3 creates its consumer with a fixed ``fetch_max_wait_ms=1500`` and aiokafka's
    ``fetch_min_bytes=1``. Kafka answers a fetch as soon as ``min_bytes`` are there, but the
    embedded broker holds it for the whole wait when the partition was empty, so at light load
    every request waited up to 1.5 s. aiokafka reads both values from its fetcher on every
    request, so changing them there takes effect at once.

    Returns:
        True when the consumer existed and was changed.
    """
    consumer = getattr(getattr(app.consumer, "_thread", None), "_consumer", None)
    fetcher = getattr(consumer, "_fetcher", None)
    if fetcher is None or not hasattr(fetcher, "_fetch_max_wait_ms") \
            or not hasattr(fetcher, "_fetch_min_bytes"):
        return False
    fetcher._fetch_max_wait_ms = int(ms)
    fetcher._fetch_min_bytes = int(min_bytes)
    return True


def set_web_runner(app: Any, make_runner: Callable[[Any], Any]) -> Any:
    """Serve the app's web views with the aiohttp runner ``make_runner(web_app)`` returns.

    Faust 0.15.3's aiohttp driver builds its runner itself (``Web._runner``, an
    ``AppRunner(web_app, access_log=None)``, set up and given a site in ``start_server``) and
    has no setting for it nor for aiohttp's request handler; streamapp's runner answers
    requests aiohttp cannot read in JSON (:class:`streamapp.views.errors.JsonErrorsAppRunner`).
    Call it before the web server starts.

    Returns:
        The runner now in use.
    """
    web = app.web
    runner = make_runner(web.web_app)
    web._runner = runner
    return runner


def set_producer_buffer_max(app: Any, messages: int) -> bool:
    """Let Faust's producer buffer hold ``messages`` records before it stalls the consumer, and
    count the stalls (see :func:`producer_buffer_stalled`).

    Table writes reach the changelog through Faust's producer buffer, and Faust's conductor
    checks before handing *every* record to an agent whether that buffer holds more than
    ``ProducerBuffer.max_messages`` (a class constant, 100, with no setting); if so it logs
    "producer buffer full" and waits until that many records were sent. One batch's table flush
    writes a stats row and window buckets for each device it touched (more than 100 records for
    a batch of 32), so with 100 nearly every batch stalled the consumer. The buffer drains at
    the producer's pace; our own backpressure (``max_inflight_batches``) bounds how much a
    worker writes per batch.

    Returns:
        True when the producer's buffer existed and was changed.
    """
    buffer = getattr(getattr(app, "producer", None), "buffer", None)
    if buffer is None or not hasattr(buffer, "max_messages"):
        return False
    buffer.max_messages = int(messages)
    if not hasattr(buffer, "streamapp_flushing"):
        # Faust's wait_until_ebb calls self.flush_atmost: an instance attribute is found first.
        flush_atmost = buffer.flush_atmost

        async def counted_flush_atmost(max_messages: int | None) -> int:
            buffer.streamapp_flushing += 1
            try:
                flushed: int = await flush_atmost(max_messages)
                return flushed
            finally:
                buffer.streamapp_flushing -= 1

        buffer.streamapp_flushing = 0
        buffer.flush_atmost = counted_flush_atmost
    return True


def producer_buffer_stalled(app: Any) -> bool:
    """Whether Faust's producer buffer is over its limit or being flushed (the conductor then
    holds the record it was about to hand to an agent, and the rest of its fetched batch)."""
    buffer = app.producer.buffer
    return bool(buffer.size > buffer.max_messages or getattr(buffer, "streamapp_flushing", 0))


class Worker(faust.Worker):  # type: ignore[misc]
    """Faust's worker with our log set-up (:func:`make_worker`); its name shows as
    ``[^Worker]`` in the log, like Faust's."""

    banner = ""
    notices: Sequence[str] = ()

    def on_setup_root_logger(self, logger: logging.Logger, level: int) -> None:
        # Called once Faust configured logging, before its first line ("Starting...").
        super().on_setup_root_logger(logger, level)
        if level > logging.DEBUG:
            from streamapp.logs import QuietChangelogs

            for handler in logger.handlers:
                handler.addFilter(QuietChangelogs())
        if self.banner:
            log.info("%s", self.banner)
        for notice in self.notices:
            log.warning("%s", notice)


def make_worker(app: Any, loglevel: str, banner: str = "", notices: Sequence[str] = ()
                ) -> faust.Worker:
    """A ``faust.Worker`` for ``app`` without Faust's terminal spinner, whose log starts with
    ``banner`` (:func:`streamapp.logs.startup_block`) and ``notices`` (one WARNING each: what
    the checks before the start found) and, above debug, leaves out Faust's
    per-changelog-table INFO lines (:class:`streamapp.logs.QuietChangelogs`).

    With a log level of warning or above, Faust's worker keeps a progress spinner that it feeds
    from logging: it sets the *root logger* to DEBUG and adds a DEBUG handler, so every
    ``log.debug`` of aiokafka, Faust and ours builds a log record (py-spy showed
    ``Logger.makeRecord`` under the producer's send path) that no handler prints. Without the
    spinner the root logger stays at ``loglevel``.
    """
    worker = Worker(app, loglevel=loglevel)
    worker.spinner = None
    worker.banner = banner
    worker.notices = tuple(notices)
    return worker


def set_read_committed(app: Any) -> bool:
    """Make the worker's consumer read committed records only (``isolation_level``
    ``read_committed``): records of aborted transactions are never handed out, and records of
    open transactions only once committed.

    Faust 0.15.3 sets read_committed only with ``processing_guarantee="exactly_once"`` (which
    needs transactions, absent on the embedded broker). aiokafka's fetcher reads the level on
    every fetch request and response, so setting it there takes effect from the next fetch;
    call it on every assignment, before the partitions are fetched.

    Returns:
        True when the consumer existed and was changed.
    """
    from aiokafka.consumer.fetcher import READ_COMMITTED

    consumer = getattr(getattr(app.consumer, "_thread", None), "_consumer", None)
    fetcher = getattr(consumer, "_fetcher", None)
    if fetcher is None or not hasattr(fetcher, "_isolation_level"):
        return False
    fetcher._isolation_level = READ_COMMITTED
    return True


def make_producer_transactional(
    app: Any, transactional_id: str, wrap_send: Callable[[Any], Any],
    on_started: Callable[[Any], None], *, transaction_timeout_ms: int,
) -> None:
    """Make the aiokafka producer Faust starts for ``app`` transactional (our batch sink and
    Faust's table changelogs both write through it: :mod:`streamapp.transactions`).

    Faust 0.15.3 builds that producer in ``Producer._new_producer()`` on start, with
    ``transactional_id=None`` unless its own (per-partition) exactly-once mode is on. The patch
    passes ``transactional_id``, idempotence and ``acks=all``; once the producer started (its
    producer id initialised, which fences an earlier instance of the id and waits for its open
    transaction to end), a first transaction begins, before anything can be sent. ``send`` and
    ``send_batch`` are replaced by ``wrap_send(method)``; ``on_started(producer)`` is called
    with the new aiokafka producer once it started and began (once per start).
    ``transaction_timeout_ms``: how long the broker keeps a transaction of a dead producer
    open before it aborts it (read_committed readers wait that long behind it).
    """
    producer = app.producer
    new_producer = producer._new_producer

    def transactional(transactional_id_: str | None = None) -> Any:
        client = new_producer(transactional_id=transactional_id)
        started = client.start

        async def start_and_begin() -> None:
            await started()
            await client.begin_transaction()
            on_started(client)

        client.start = start_and_begin
        client.send = wrap_send(client.send)
        client.send_batch = wrap_send(client.send_batch)
        return client

    settings_extra = producer._settings_extra
    producer._new_producer = transactional
    producer._settings_extra = lambda: {
        **settings_extra(), "acks": "all", "enable_idempotence": True,
        "transaction_timeout_ms": transaction_timeout_ms,
    }


def recover_past_transaction_markers(app: Any, settings: Settings) -> None:
    """Let table recovery end on changelogs written in transactions (exactly_once).

    Faust 0.15.3 restores a changelog partition until it applied the record at the partition's
    high watermark - 1. Written in transactions, a partition ends with a transaction marker
    (and records of aborted transactions), which the consumer never hands out: recovery then
    never ended (the worker logged "No event received for active tp" forever). Faust's own
    fix-up runs only in its exactly-once mode and only after two 5 s idle timeouts. The patch
    replaces each target of ``Recovery._build_highwaters`` by the offset of the partition's
    last committed record (:func:`streamapp.kafka.last_data_offsets`), so recovery ends when
    that record is applied.
    """
    from streamapp.kafka import last_data_offsets

    recovery = app.tables.recovery
    build_highwaters = recovery._build_highwaters

    async def to_last_records(consumer: Any, tps: Any, destination: Any, title: str) -> None:
        await build_highwaters(consumer, tps, destination, title)
        wanted = [(tp.topic, tp.partition) for tp in tps if destination.get(tp, -1) >= 0]
        lasts = await last_data_offsets(settings.bootstrap_servers, wanted,
                                        security=kafka_security_options(settings))
        for tp in tps:
            last = lasts.get((tp.topic, tp.partition))
            if last is not None and last != destination.get(tp):
                destination[tp] = last

    recovery._build_highwaters = to_last_records


def group_metadata(app: Any, group_instance_id: str | None) -> Any:
    """The consumer group generation and member id of the worker's consumer (Faust's aiokafka
    consumer, run in its consumer thread), as a
    :class:`streamapp.transactions.GroupMetadata`; generation -1 when not joined."""
    from streamapp.transactions import GroupMetadata

    consumer = getattr(getattr(app.consumer, "_thread", None), "_consumer", None)
    coordinator = getattr(consumer, "_coordinator", None)
    generation = getattr(coordinator, "generation", -1)
    member_id = getattr(coordinator, "member_id", "") or ""
    return GroupMetadata(int(generation), str(member_id), group_instance_id or None)


def tolerate_stale_member_url(app: Any) -> None:
    """Let a restarted static member whose web URL changed take its assignment, then rejoin.

    Faust's assignor puts each member's web URL (``canonical_url``) into the group metadata and,
    on every assignment, asserts that the URL the leader wrote for this member is its own. On
    Apache Kafka a static member (``group_instance_id``) that restarts while its group is stable
    rejoins *without* a rebalance (KIP-345): the coordinator hands back the assignment computed
    for the member's previous incarnation, with its previous URL. When the URL changed (a new
    web port or host), Faust's assertion failed inside aiokafka's coordinator task, which
    then stopped for good: the worker never got partitions and never became ready (seen in
    ``test_sigkill_at_random_moments_loses_nothing[kafka]``, a new free web port each
    restart). Here the mismatch is logged and the member asks for a rejoin, so the leader
    computes a fresh assignment with the new URL (which routes table queries to it); the
    partitions themselves are taken at once.
    """
    assignor = app.assignor
    on_assignment = assignor.on_assignment

    def checked_on_assignment(assignment: Any) -> None:
        from faust.assignor.client_assignment import ClientMetadata

        written = ClientMetadata.loads(assignor._decompress(assignment.user_data)).url
        own = str(assignor._url)
        if written == own:
            on_assignment(assignment)
            return
        try:
            on_assignment(assignment)  # sets the whole assignment, then asserts the URL last
        except AssertionError as exc:
            if str(exc):  # Faust's other assertion (partitions), which carries a message
                raise
        log.warning(
            "the group's assignment names this worker's previous URL %s (now %s): a static "
            "member restarted without a rebalance; rejoining so the group learns the new URL",
            written, own,
        )
        consumer = getattr(getattr(app.consumer, "_thread", None), "_consumer", None)
        coordinator = getattr(consumer, "_coordinator", None)
        if coordinator is not None:
            coordinator.request_rejoin()

    assignor.on_assignment = checked_on_assignment


def install_direct_intake(app: Any, buffers: Mapping[str, IntakeBuffer]) -> None:
    """Make Faust's fetcher hand the records of ``buffers``' topics to those buffers, one list
    per fetched partition (:mod:`streamapp.intake`), instead of one event per record through
    the conductor and the agents' streams; records of every other topic take Faust's path.

    Faust 0.15.3's ``Consumer._drain_messages`` (the fetcher's loop: ``getmany`` and a
    ``wait_first(callback(message), suspend_flow.wait())`` per record) has no hook for this:
    the class method is replaced, once per process, by one that runs Faust's own loop for any
    app without buffers (several apps share a test process) and :func:`_drain_direct` for an
    app with them.
    """
    app.streamapp_intake = dict(buffers)
    from faust.transport.consumer import Consumer

    if getattr(Consumer._drain_messages, "streamapp_direct", False):
        return
    faust_drain = Consumer._drain_messages

    async def drain(self: Any, fetcher: Any) -> None:
        intake = getattr(self.app, "streamapp_intake", None)
        if not intake:
            await faust_drain(self, fetcher)
        else:
            await _drain_direct(self, fetcher, intake)

    drain.streamapp_direct = True  # type: ignore[attr-defined]
    Consumer._drain_messages = drain  # type: ignore[method-assign]


async def _drain_direct(consumer: Any, fetcher: Any, intake: Mapping[str, IntakeBuffer]) -> None:
    """Faust's drain loop (``Consumer._drain_messages`` and ``getmany`` of faust-streaming
    0.15.3, same checks in the same order) with the records of ``intake``'s topics handed over
    a partition at a time. Not for topics with acks enabled (Faust's gap bookkeeping is per
    record; our source topics have acks off: :mod:`streamapp.delivery` commits them)."""
    from faust.transport.consumer import CONSUMER_FETCHING

    app = consumer.app
    stopped, fetcher_stopped = consumer._stopped.is_set, fetcher._stopped.is_set
    try:
        while not (stopped() or fetcher_stopped()):
            consumer.diag.set_flag(CONSUMER_FETCHING)
            records, active = await consumer._wait_next_records(1.0)
            # Faust awaits consumer.sleep(0) here: asyncio.wait_for on the stopped event, a
            # task started and cancelled per fetch (13 µs against 2.5 µs on the 2-core
            # machine); a bare yield does the same, and the loop checks the stop next.
            await asyncio.sleep(0)
            if records is None or consumer.should_stop:
                continue
            if not consumer.flow_active:
                try:
                    await consumer.perform_seek()
                except Exception as exc:
                    log.warning("exception performing seek when flow not active %s", exc)
                continue
            generation = app.consumer_generation_id
            # Fetched and not handed over yet: counted as waiting, so that the gap sweeper does
            # not take them for skipped records (FaustConsumer.settled) while a put waits.
            unheld = {tp: (intake[tp.topic], len(fetched)) for tp, fetched in records.items()
                      if tp.topic in intake}
            for buffer, n in unheld.values():
                buffer.waiting += n
            try:
                await _hand_over_fetched(consumer, records, active, generation, intake, unheld)
            finally:
                for buffer, n in unheld.values():
                    buffer.waiting -= n
            consumer.diag.unset_flag(CONSUMER_FETCHING)
    except consumer.consumer_stopped_errors:
        if app.should_stop:
            log.info("Broker stopped consumer, shutting down...")
            return
        raise
    except asyncio.CancelledError:
        if app.should_stop:
            log.info("Consumer shutting down for user cancel.")
            return
        raise
    finally:
        consumer.diag.unset_flag(CONSUMER_FETCHING)


async def _hand_over_fetched(
    consumer: Any, records: Mapping[Any, list[Any]], active: Any, generation: int,
    intake: Mapping[str, IntakeBuffer], unheld: dict[Any, tuple[IntakeBuffer, int]],
) -> None:
    """One fetch's records: each partition's of ``intake``'s topics to its buffer as one list,
    every other record through Faust's conductor (Faust's per-record path)."""
    app = consumer.app
    read_offset = consumer._read_offset
    callback, to_message, monitor = consumer.callback, consumer._to_message, app.monitor
    commit_every = consumer._commit_every
    acks_enabled_for = app.topics.acks_enabled_for
    flow_control, producer_buffer = app.flow_control, app.producer.buffer
    suspend_flow = consumer.suspend_flow

    async def hand_over(buffer: IntakeBuffer, records: list[DirectRecord]) -> None:
        await flow_control.acquire()  # the conductor's per-record waits, once per list
        await producer_buffer.wait_until_ebb()
        await buffer.put(records)

    for tp, fetched in records.items():
        held = unheld.pop(tp, None)  # from here on counted by the put, or dropped
        if held is not None:
            held[0].waiting -= held[1]
        if not consumer.flow_active or app.consumer_generation_id != generation:
            break
        if not (active is None or tp in active or tp in consumer._buffered_partitions):
            continue
        monitor.track_tp_end_offset(tp, consumer.highwater(tp))
        last = read_offset[tp]
        fresh = fetched if last is None else [r for r in fetched if r.offset >= last]
        if not fresh:
            continue
        buffer = intake.get(tp.topic)
        if buffer is not None and not acks_enabled_for(tp.topic):
            direct = direct_records(tp.topic, tp.partition, fresh)
            # Nothing to wait for (flow on, producer buffer below its bound, room in the
            # buffer): hand the list over now. Faust's wait_first starts four tasks and an
            # asyncio.wait per call, about 47 µs on the 2-core machine; paced, a fetch brings
            # a few records per partition, so that was paid every few records (issue 17).
            if (flow_control.is_active() and not suspend_flow.is_set()
                    and producer_buffer.size <= producer_buffer.max_messages
                    and buffer.put_nowait(direct)):
                read_offset[tp] = fresh[-1].offset
                continue
            await consumer.wait_first(hand_over(buffer, direct), suspend_flow.wait())
            read_offset[tp] = fresh[-1].offset
            continue
        for record in fresh:  # Faust's own path for every other topic
            message = to_message(tp, record)
            r_offset = read_offset[tp]
            if r_offset is not None and message.offset < r_offset:
                continue
            gap = message.offset - (r_offset or 0)
            if gap > 1 and r_offset and acks_enabled_for(message.topic):
                await consumer._add_gap(tp, r_offset + 1, message.offset)
            if commit_every is not None and consumer._n_acked >= commit_every:
                consumer._n_acked = 0
                await consumer.commit()
            await consumer.wait_first(callback(message), suspend_flow.wait())
            read_offset[tp] = message.offset


def guard_undecodable_batches(source_topics: Iterable[str]) -> None:
    """Make record batches the consumer cannot decode harmless (:mod:`streamapp.record_batches`):
    those of ``source_topics`` (request and retry) become dead letters, those of the tables'
    changelogs are skipped, and the one stand-in record a skipped batch leaves (so that Faust's
    recovery reaches the partition's end) never reaches a table.

    Faust 0.15.3 applies changelog records in ``Collection.apply_changelog_batch(batch)`` (a
    list of events, from recovery and standby reads), with no filter hook: the patch drops the
    stand-ins from that list. A stand-in has key and value None and an offset
    :func:`~streamapp.record_batches.is_skipped_stand_in` knows; no real changelog record has a
    None key. Installed once per process; idempotent.
    """
    guard_record_batches(source_topics)
    from faust.tables.base import Collection

    if getattr(Collection.apply_changelog_batch, "streamapp_guarded", False):
        return
    apply_changelog_batch = Collection.apply_changelog_batch

    def without_stand_ins(self: Any, batch: Iterable[Any]) -> None:
        apply_changelog_batch(self, [event for event in batch if not _skipped(event.message)])

    without_stand_ins.streamapp_guarded = True  # type: ignore[attr-defined]
    Collection.apply_changelog_batch = without_stand_ins  # type: ignore[method-assign]


def open_rocksdict_with_given_options() -> None:
    """Make Faust's rocksdict stores open an *existing* database with the options Faust was
    given, as they open a new one.

    Faust 0.15.3 opens each table partition's database with ``rocksdict.Rdict(path,
    options=..., access_type=...)`` (``faust.stores.rocksdb.RocksDBOptions.open``). Given no
    ``column_families``, rocksdict 0.3 reads the database's own ``OPTIONS`` file and opens it
    with those options, not the ones passed: a data directory written before the tables had
    memory bounds kept Faust's 64 MiB x 3 write buffers, and its block cache fell to
    rocksdict's 8 MiB default (found by the twelfth session's new-user trial). Passing
    ``column_families={}`` makes rocksdict use the given options; Faust's stores use only the
    default column family. Installed once per process; idempotent.
    """
    from faust.stores.rocksdb import RocksDBOptions

    if getattr(RocksDBOptions.open, "streamapp_given_options", False):
        return
    open_ = RocksDBOptions.open

    def open_with_given_options(self: Any, path: Any, *, read_only: bool = False) -> Any:
        if not self.use_rocksdict:
            return open_(self, path, read_only=read_only)
        import rocksdict

        access = (rocksdict.AccessType.read_write() if self.ttl is None
                  else rocksdict.AccessType.with_ttl(self.ttl))
        return open_rdict(path, self.as_options(), access)

    open_with_given_options.streamapp_given_options = True  # type: ignore[attr-defined]
    RocksDBOptions.open = open_with_given_options  # type: ignore[method-assign]


def open_rdict(path: Any, options: Any, access_type: Any) -> Any:
    """``rocksdict.Rdict`` at ``path`` opened with ``options`` even when the database exists
    (``column_families={}``: see :func:`open_rocksdict_with_given_options`), with default
    read options, as Faust opens its stores.

    Raises:
        Exception: rocksdict's plain Exception for a RocksDB error (a full disk, a lock).
    """
    import rocksdict

    db = rocksdict.Rdict(str(path), options=options, column_families={},
                         access_type=access_type)
    db.set_read_options(rocksdict.ReadOptions())
    return db


def screen_changelog(table: Any, screen: Any) -> None:
    """Pass every changelog record ``table`` restores through ``screen`` before it is applied.

    ``screen.changelog(topic, partition, offset, key, value)`` returns a
    :class:`~streamapp.tables.rows.Verdict`: keep the record, replace its value (None: a
    tombstone) or drop it. Faust 0.15.3 hands restored records to
    ``table.apply_changelog_batch(batch)`` (recovery and standby reads) with no filter hook;
    the RocksDB store writes ``event.message.value`` as it is, the memory store
    ``event.value``, so a replacement sets both. The table must use raw value bytes
    (``value_type=bytes``): with Faust's JSON codec a value that is not UTF-8 JSON raised in
    the changelog channel *before* this point, Faust's recovery loop logged "Error in recovery"
    and never passed the record, and the worker never became ready (issue 18, item 1).
    Installed on the table instance (recovery looks the method up there).
    """
    apply_changelog_batch = table.apply_changelog_batch

    def screened(batch: Iterable[Any]) -> None:
        kept = []
        for event in batch:
            m = event.message
            verdict = screen.changelog(m.topic, m.partition, m.offset, m.key, m.value)
            if verdict.action == "drop":
                continue
            if verdict.action == "replace":
                m.value = verdict.value
                event.value = verdict.value
            kept.append(event)
        apply_changelog_batch(kept)

    table.apply_changelog_batch = screened


def _skipped(message: Any) -> bool:
    return (message.key is None and message.value is None
            and is_skipped_stand_in(message.topic, message.partition, message.offset))


class _StandInMessage:
    __slots__ = ("key", "offset", "partition", "topic")

    def __init__(self, topic: str, partition: int, key: bytes | None, offset: int) -> None:
        self.topic = topic
        self.partition = partition
        self.key = key
        self.offset = offset


class StandInEvent:
    """Just enough of a Faust event for a table write (``message.topic``, ``.partition``,
    ``.key``, ``.offset``), for records that did not arrive as a Faust event of their own:
    those read to fill a consumer gap, and outcomes written for another partition's key.
    Weak-referenceable, as Faust keeps the current event through a weakref."""

    __slots__ = ("__weakref__", "message")

    def __init__(self, topic: str, partition: int, key: bytes | None, offset: int = -1) -> None:
        self.message = _StandInMessage(topic, partition, key, offset)


class FaustConsumer:
    """The worker's side of Faust: :class:`streamapp.delivery.Consumer` over Faust's consumer,
    and :class:`streamapp.runtime.WorkerHost` (flush the producer, crash the app).

    Args:
        app: The worker's Faust app.
        settings: ``bootstrap_servers`` and the security settings (for direct partition reads).
    """

    def __init__(self, app: Any, settings: Settings) -> None:
        self.app = app
        self.settings = settings

    async def committed_or_earliest(self, topic: str, partition: int) -> int:
        return await committed_or_earliest(self.app, topic, partition)

    async def commit(self, offsets: Mapping[tuple[str, int], int]) -> bool:
        return await commit_offsets(self.app, offsets)

    def highwater(self, topic: str, partition: int) -> int | None:
        """The partition's high watermark from the last fetch response (right on Tansu too), or
        None while it is not assigned or not fetched yet."""
        try:
            mark = self.app.consumer.highwater(TP(topic, partition))
        except Exception:  # not assigned (revoked), consumer not started
            return None
        return None if mark is None else int(mark)

    async def position(self, topic: str, partition: int) -> int | None:
        position = await self.app.consumer.position(TP(topic, partition))
        return None if position is None else int(position)

    def settled(self, topic: str) -> bool:
        """False while Faust may hold records of ``topic`` it fetched but has not handed to the
        agent: while rebalancing, recovering tables (it seeks back afterwards), stopping, with
        its flow suspended, while its conductor waits for the producer buffer (it then holds a
        fetched batch), or while the topic's stream buffers are not empty."""
        app = self.app
        if app.rebalancing or app.in_recovery or app.should_stop:
            return False
        if not app.flow_control.is_active() or producer_buffer_stalled(app):
            return False
        # The conductor's index of the channels (agents' stream buffers) of each topic; Faust
        # has no public call for it.
        channels = getattr(app.topics, "_topic_name_index", None)
        if channels is None:
            return False  # cannot tell: never read what may still arrive
        intake = getattr(app, "streamapp_intake", None) or {}
        if topic in intake and not intake[topic].empty():  # direct intake (streamapp.intake)
            return False
        return all(channel.queue.empty() for channel in channels.get(topic, ()))

    async def read_range(
        self, topic: str, partition: int, start: int, end: int
    ) -> list[tuple[int, bytes | None, bytes | None]]:
        return await read_partition_range(
            self.settings.bootstrap_servers, topic, partition, start, end,
            security=kafka_security_options(self.settings),
        )

    async def flush(self) -> None:
        """Wait until the producer has sent everything buffered."""
        await self.app.producer.flush()

    async def crash(self, exc: BaseException) -> None:
        """Stop the worker with ``exc`` (it cannot serve)."""
        await self.app.crash(exc)


def changelog_topics(app: Any) -> list[str]:
    """The changelog topic names of ``app``'s tables."""
    names = []
    for table in getattr(app, "tables", {}).values():
        with contextlib.suppress(Exception):
            names.append(table.changelog_topic.get_topic_name())
    return names


def producer_client(app: Any) -> Any:
    """The aiokafka client of the producer Faust runs (Faust exposes only its own wrapper)."""
    return app.producer._ensure_producer().client


def track_metadata(client: Any, topics: Iterable[str]) -> None:
    """Make an aiokafka client's metadata refreshes always include ``topics``.

    aiokafka's client asks for the metadata of *all* topics until a topic is added to the set it
    tracks, and from then on only of that set, replacing what it knew. A topic it learned from
    an all-topics answer is never added (``_wait_on_metadata`` returns early for a known topic):
    once Faust adds a changelog topic that did not exist at start, the producer forgets the
    result topic's partitions, every batch for it waits for a leader, and the sender asks for
    metadata in a tight loop until the batches expire (``producer_request_timeout``, 20 min):
    a worker that answered nothing with a backlog waiting, in one start of four on Apache Kafka
    (bench hotpath, 2026-12-01). Adding every topic we produce to fixes that.
    """
    tracked = getattr(client, "_topics", None)
    if not isinstance(tracked, set):
        return
    for topic in topics:
        if topic not in tracked:
            client.add_topic(topic)


class FaustSink:
    """:class:`streamapp.agents.pipeline.BatchSink` over Faust topics (raw key and value bytes).

    ``send`` goes through the Faust topic (one record). ``send_many`` hands records straight to
    the aiokafka producer Faust runs (``app.producer``), one ``create_batch``/``send_batch`` per
    partition, with the partition aiokafka's own partitioner picks for the key (murmur2, as
    ``send`` does): Faust's per-record send path (its message objects, callbacks and sensors)
    cost more CPU than the rest of a digits request together (issue 17), and there is no
    public Faust call for a batch.

    Args:
        topics: Topic name -> Faust topic.
        app: The Faust app whose producer ``send_many`` uses; None: ``send_many`` sends each
            record through ``send``.
    """

    def __init__(self, topics: dict[str, Any], app: Any = None) -> None:
        self._topics = topics
        self._app = app
        self._tracked: Any = None  # the producer client whose metadata tracks our topics

    async def send(self, topic: str, key: bytes | None, value: bytes) -> Awaitable[Any]:
        if self._app is not None:
            self._producer()
        fut: Awaitable[Any] = await self._topics[topic].send(key=key, value=value)
        return fut

    def _producer(self) -> Any:
        """The aiokafka producer Faust runs, its metadata tracking every topic we produce to
        (:func:`track_metadata`)."""
        producer = self._app.producer._ensure_producer()
        if self._tracked is not producer.client:
            track_metadata(producer.client, [*self._topics, *changelog_topics(self._app)])
            self._tracked = producer.client
        return producer

    async def send_many(
        self, records: Sequence[tuple[str, bytes | None, bytes]]
    ) -> list[Awaitable[Any] | BaseException]:
        """See :meth:`streamapp.agents.pipeline.BatchSink.send_many`. A record whose partition
        already has a batch waiting in the producer waits until that one is sent (aiokafka
        keeps one queued batch per partition), which keeps each partition's order."""
        if self._app is None:
            out: list[Awaitable[Any] | BaseException] = []
            for topic, key, value in records:
                try:
                    out.append(await self.send(topic, key, value))
                except Exception as exc:
                    out.append(exc)
            return out
        producer = self._producer()
        groups: dict[tuple[str, int], list[int]] = {}
        partitions: dict[str, tuple[list[int], list[int]]] = {}
        partitioner = producer._partitioner
        for i, (topic, key, _) in enumerate(records):
            known = partitions.get(topic)
            if known is None:
                await producer.client._wait_on_metadata(topic)
                metadata = producer.client.cluster
                known = partitions[topic] = (
                    sorted(metadata.partitions_for_topic(topic)),
                    sorted(metadata.available_partitions_for_topic(topic)),
                )
            partition = partitioner(key, *known)
            group = groups.get((topic, partition))
            if group is None:
                groups[(topic, partition)] = [i]
            else:
                group.append(i)
        result: list[Awaitable[Any] | BaseException | None] = [None] * len(records)
        for (topic, partition), indices in groups.items():
            batch = producer.create_batch()
            members: list[int] = []
            for i in indices:
                _, key, value = records[i]
                try:
                    appended = batch.append(key=key, value=value, timestamp=None)
                    if appended is None and members:  # full: send it, start the next one
                        future = await producer.send_batch(batch, topic, partition=partition)
                        for j in members:
                            result[j] = future
                        batch, members = producer.create_batch(), []
                        appended = batch.append(key=key, value=value, timestamp=None)
                    if appended is None:
                        raise MessageSizeTooLargeError(
                            f"a record of {len(value)} bytes does not fit in an empty batch"
                        )
                except Exception as exc:  # this record cannot be produced (e.g. too large)
                    result[i] = exc
                    continue
                members.append(i)
            if members:
                future = await producer.send_batch(batch, topic, partition=partition)
                for j in members:
                    result[j] = future
        return [r if r is not None else RuntimeError("not sent") for r in result]


@dataclass
class PartitionMarks:
    """Where this worker's assigned source partitions stand, from its consumer.

    Attributes:
        highwater: High watermark of the last fetch response per fetched ``(topic,
            partition)`` (right on Tansu, unlike its ListOffsets answer, docs/broker.md).
        position: The consumer's fetch position (next offset to fetch) of those partitions.
        assigned: Partitions assigned per topic.
    """

    highwater: dict[tuple[str, int], int] = field(default_factory=dict)
    position: dict[tuple[str, int], int] = field(default_factory=dict)
    assigned: dict[str, int] = field(default_factory=dict)

    @property
    def lag(self) -> dict[tuple[str, int], int]:
        """Records not fetched yet: high watermark − position, per partition with both."""
        return {tp: max(0, hw - self.position[tp]) for tp, hw in self.highwater.items()
                if tp in self.position}


async def partition_marks(app: Any, topics: Iterable[str]) -> PartitionMarks:
    """High watermarks and positions of this worker's assigned partitions of ``topics``."""
    wanted = tuple(topics)
    marks = PartitionMarks(assigned=dict.fromkeys(wanted, 0))
    consumer = app.consumer
    tps = []
    with contextlib.suppress(Exception):  # consumer not started yet
        tps = [tp for tp in consumer.assignment() if tp.topic in wanted]
    for tp in tps:
        marks.assigned[tp.topic] += 1
        try:
            hw = consumer.highwater(tp)  # None until the partition was fetched
            position = await consumer.position(tp) if hw is not None else None
        except Exception:  # e.g. revoked between assignment() and here
            continue
        if hw is None:
            continue
        marks.highwater[(tp.topic, tp.partition)] = int(hw)
        if position is not None:
            marks.position[(tp.topic, tp.partition)] = int(position)
    return marks
