"""Kafka plumbing shared by the worker, the CLI, the DLQ tools and the tests: security options
(TLS/SASL), topic creation, partition listing and direct partition reads.

This is the one module that reaches into aiokafka beyond its public client classes (the
metadata refresh of :func:`partitions_of`, the admin and bare clients); Faust's internals are
reached only from :mod:`streamapp.faust_compat`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import ssl
import threading
import time
from collections.abc import Awaitable, Callable, Coroutine, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar

from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient, NewPartitions, NewTopic
from aiokafka.client import AIOKafkaClient
from aiokafka.errors import (
    AuthenticationFailedError,
    ClusterAuthorizationFailedError,
    GroupAuthorizationFailedError,
    KafkaConnectionError,
    KafkaError,
    SaslAuthenticationFailed,
    TopicAuthorizationFailedError,
    TransactionalIdAuthorizationFailed,
    UnsupportedSaslMechanismError,
    for_code,
)

from streamapp.exceptions import BrokerError, ConfigError, SecurityError
from streamapp.settings import Settings

log = logging.getLogger(__name__)

__all__ = [
    "ClusterFacts",
    "IsolationLevel",
    "add_partitions",
    "cluster_facts",
    "connection_error",
    "create_topics",
    "denied_line",
    "describe_error",
    "ensure_topics",
    "kafka_security_options",
    "last_data_offsets",
    "partitions_of",
    "probe_metadata",
    "read_partition_range",
    "read_partition_tails",
    "run_sync",
    "security_problem",
    "ssl_context",
    "start_or_close",
    "unreachable_line",
    "with_admin",
]

#: How a reader treats transactions (aiokafka's ``isolation_level``): ``read_committed`` hands
#: out records of committed transactions only, ``read_uncommitted`` every record.
IsolationLevel = Literal["read_committed", "read_uncommitted"]


def describe_error(exc: BaseException) -> str:
    """``Type: message`` of an exception, the type named once.

    aiokafka puts the type into the message and prefixes the error code, so ``str()`` of its
    errors reads ``KafkaConnectionError: Unable to ...`` or ``[Error 7] RequestTimedOutError:
    RequestTimedOutError: ...``; every message of ours that quotes a client error goes through
    here so that none names the type twice.
    """
    name = type(exc).__name__
    text = str(exc).strip()
    repeat = re.compile(rf"^(\[Error -?\d+\] )?{re.escape(name)}(: ?|$)")
    while (shorter := repeat.sub("", text, count=1).strip()) != text:
        text = shorter
    return f"{name}: {text}" if text else name


def unreachable_line(bootstrap: str, exc: BaseException,
                     setting: str = "--broker / STREAMAPP_BROKER") -> str:
    """One line for a Kafka client error: what failed, then what to check (the CLI's and the
    client's wording for a broker that did not answer).

    Args:
        bootstrap: The ``host:port`` list that was tried.
        exc: The client error (a :class:`KafkaConnectionError` reads "no broker answered").
        setting: Where the broker address comes from, for the hint.
    """
    if isinstance(exc, KafkaConnectionError):
        what = "no broker answered (connection refused or timed out)"
    else:
        what = describe_error(exc)
    return (
        f"cannot talk to the broker at {bootstrap}: {what}. Is it running (streamapp broker), "
        f"and are {setting} and the security settings right?"
    )


_T = TypeVar("_T")

#: Kafka error code TOPIC_ALREADY_EXISTS.
_TOPIC_ALREADY_EXISTS = 36


# -- security --------------------------------------------------------------------------------------


def ssl_context(settings: Settings) -> ssl.SSLContext | None:
    """The TLS context for ``security_protocol`` SSL or SASL_SSL, else None.

    Verifies the brokers' certificates against ``ssl_cafile`` (default: the system's trust
    store), checks host names unless ``ssl_check_hostname`` is false, and presents
    ``ssl_certfile``/``ssl_keyfile`` when set (mutual TLS).

    Raises:
        ConfigError: A file is missing or is not valid PEM; the message names the setting.
    """
    if not settings.security_protocol.endswith("SSL"):
        return None
    cafile = settings.ssl_cafile
    try:
        context = ssl.create_default_context(
            ssl.Purpose.SERVER_AUTH, cafile=str(cafile) if cafile else None
        )
    except (OSError, ssl.SSLError) as exc:
        raise ConfigError(
            f"ssl_cafile {str(cafile)!r} cannot be used as CA certificates: {exc}; give a PEM "
            "file (STREAMAPP_SSL_CAFILE)"
        ) from None
    context.check_hostname = settings.ssl_check_hostname
    if settings.ssl_certfile is not None:
        password = settings.ssl_key_password.get_secret_value() or None
        try:
            context.load_cert_chain(
                str(settings.ssl_certfile),
                str(settings.ssl_keyfile) if settings.ssl_keyfile else None,
                password=password,
            )
        except (OSError, ssl.SSLError) as exc:
            raise ConfigError(
                f"ssl_certfile {str(settings.ssl_certfile)!r} / ssl_keyfile "
                f"{str(settings.ssl_keyfile)!r} cannot be loaded: {exc}; give a PEM certificate "
                "and its key (and ssl_key_password if the key is encrypted)"
            ) from None
    return context


def kafka_security_options(settings: Settings) -> dict[str, Any]:
    """Keyword arguments for aiokafka clients (producer, consumer, admin) from the settings.

    Args:
        settings: ``security_protocol``, ``sasl_*`` and ``ssl_*``.

    Returns:
        ``security_protocol``, plus ``ssl_context`` with SSL/SASL_SSL and ``sasl_mechanism``,
        ``sasl_plain_username``, ``sasl_plain_password`` with SASL_* (aiokafka uses these two
        for SCRAM as well). Holds the password in clear: never log it.

    Raises:
        ConfigError: See :func:`ssl_context`.
    """
    options: dict[str, Any] = {"security_protocol": settings.security_protocol}
    context = ssl_context(settings)
    if context is not None:
        options["ssl_context"] = context
    if settings.security_protocol.startswith("SASL_"):
        options["sasl_mechanism"] = settings.sasl_mechanism
        options["sasl_plain_username"] = settings.sasl_username
        options["sasl_plain_password"] = settings.sasl_password.get_secret_value()
    return options


#: OpenSSL's X509_V_ERR_HOSTNAME_MISMATCH and the codes of a chain no trusted CA signed.
_HOSTNAME_MISMATCH = 62
_UNTRUSTED = frozenset({18, 19, 20, 21, 27})
#: Kafka's authorization errors (an ACL is missing), by the resource they name.
_DENIED = {
    TopicAuthorizationFailedError: "the topic", GroupAuthorizationFailedError: "the group",
    ClusterAuthorizationFailedError: "the cluster",
    TransactionalIdAuthorizationFailed: "the transactional id",
}


def denied_line(settings: Settings, exc: BaseException) -> str | None:
    """One line for an authorization error (a Kafka ACL is missing), else None.

    Names the user and the resource Kafka named, and where the worker's and the publisher's
    ACLs are listed; never a password.
    """
    for kind, what in _DENIED.items():
        if isinstance(exc, kind):
            user = settings.sasl_username or "ANONYMOUS"
            return (
                f"the broker denied user {user!r} access to {what} "
                f"({describe_error(exc)}): grant it the ACLs docs/deployment.md lists for a "
                "worker or a publisher (streamapp.acls), or use another user"
            )
    return None


async def security_problem(settings: Settings, timeout_s: float = 10.0) -> str | None:
    """Why the TLS handshake or the SASL login with the first bootstrap server that answers
    fails, in one line (what is wrong with which setting, and how to fix it); None when one of
    them accepts the connection, none can be reached at all, or no security is configured.

    aiokafka logs these causes but raises only "Unable to bootstrap": this connects once more,
    by hand, to learn them. Never names a password.
    """
    if settings.security_protocol == "PLAINTEXT":
        return None
    from aiokafka.conn import create_conn

    options = kafka_security_options(settings)
    found: str | None = None
    for server in settings.bootstrap_servers.split(","):
        host, _, port = server.rpartition(":")
        try:
            conn = await asyncio.wait_for(
                create_conn(host, int(port), request_timeout_ms=int(timeout_s * 1000),
                            **options),
                timeout_s)
        except ssl.SSLCertVerificationError as exc:
            found = _certificate_problem(settings, server, exc)
        except ssl.SSLError as exc:
            found = (
                f"the TLS handshake with {server} failed ({exc.reason or exc}): is it a TLS "
                f"listener? security_protocol is {settings.security_protocol} "
                "(STREAMAPP_SECURITY_PROTOCOL)"
            )
        except (SaslAuthenticationFailed, AuthenticationFailedError):
            found = (
                f"{server} refused the login of user {settings.sasl_username!r} with "
                f"{settings.sasl_mechanism}: wrong user name or password "
                "(STREAMAPP_SASL_USERNAME, STREAMAPP_SASL_PASSWORD), or the user has no "
                f"{settings.sasl_mechanism} credentials on the broker"
            )
        except UnsupportedSaslMechanismError:
            found = (
                f"{server} does not accept SASL mechanism {settings.sasl_mechanism}: set "
                "STREAMAPP_SASL_MECHANISM to one its listener enables"
            )
        except (OSError, TimeoutError, KafkaError):
            continue  # unreachable: the caller's own message says so
        else:
            conn.close()
            return None
        if found is not None:
            return found
    return found


def _certificate_problem(
    settings: Settings, server: str, exc: ssl.SSLCertVerificationError
) -> str:
    host = server.rpartition(":")[0]
    if exc.verify_code == _HOSTNAME_MISMATCH:
        return (
            f"the certificate of {server} does not name {host!r} ({exc.verify_message}): "
            "connect by a name or address the certificate holds (--broker), or, on a trusted "
            "network only, set STREAMAPP_SSL_CHECK_HOSTNAME=false"
        )
    ca = f"ssl_cafile {str(settings.ssl_cafile)!r}" if settings.ssl_cafile else (
        "the system's trust store (ssl_cafile is not set)")
    if exc.verify_code in _UNTRUSTED:
        return (
            f"the certificate of {server} is not signed by a CA in {ca} "
            f"({exc.verify_message}): set STREAMAPP_SSL_CAFILE to the PEM file of the CA "
            "that signed the brokers' certificates"
        )
    return (
        f"the certificate of {server} was refused ({exc.verify_message}); check it and "
        f"{ca}"
    )


async def start_or_close(client: Any) -> None:
    """Start an aiokafka producer/consumer; if that fails, close it before re-raising (aiokafka
    leaves a half-started client behind otherwise, and warns about it at exit)."""
    try:
        await client.start()
    except BaseException:
        await client.stop()
        raise


class PartitionRange(list[tuple[int, bytes | None, bytes | None]]):
    """What :func:`read_partition_range` read: ``(offset, key, value)`` records in offset order.

    Attributes:
        deleted_before: Offsets of the range below this were deleted by retention (the range's
            start when none were). Other offsets of the range without a record hold no data:
            transaction markers and records of aborted transactions.
    """

    deleted_before: int = 0


async def read_partition_range(
    bootstrap_servers: str,
    topic: str,
    partition: int,
    start: int,
    end: int,
    *,
    security: dict[str, Any] | None = None,
    timeout_s: float = 30.0,
) -> PartitionRange:
    """Read the records ``start <= offset < end`` of one partition, outside any consumer group.

    Reads committed records only (``isolation_level=read_committed``, like the worker's
    consumer), and stops as soon as the reader's position reaches ``end``: transaction markers
    and aborted records occupy offsets but are never returned.

    Returns:
        The records, in offset order, with ``deleted_before`` set (offsets below it no longer
        exist: retention); fewer than ``end - start`` when some offsets hold no data records or
        the timeout passed.
    """
    consumer = AIOKafkaConsumer(
        bootstrap_servers=bootstrap_servers, group_id=None, enable_auto_commit=False,
        auto_offset_reset="earliest", isolation_level="read_committed", **(security or {}),
    )
    await start_or_close(consumer)
    out = PartitionRange()
    out.deleted_before = start
    try:
        tp = TopicPartition(topic, partition)
        consumer.assign([tp])
        log_start = (await consumer.beginning_offsets([tp]))[tp]
        out.deleted_before = max(start, min(log_start, end))
        consumer.seek(tp, out.deleted_before)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            batch = await consumer.getmany(tp, timeout_ms=200, max_records=10_000)
            for record in batch.get(tp, []):
                if record.offset >= end:
                    return out
                out.append((record.offset, record.key, record.value))
            if await consumer.position(tp) >= end:  # also past markers and aborted records
                return out
    finally:
        await consumer.stop()
    return out


async def last_data_offsets(
    bootstrap_servers: str,
    tps: Sequence[tuple[str, int]],
    *,
    security: dict[str, Any] | None = None,
    timeout_s: float = 10.0,
) -> dict[tuple[str, int], int]:
    """The offset of the last committed data record of each partition, read with
    ``read_committed`` below its last stable offset; -1 for a partition without one.

    With transactions a partition's last offsets are transaction markers (and records of
    aborted transactions), which no consumer is handed: its high watermark - 1 is not the
    offset of a record. Reads back from the end, doubling the tail read until a record is
    found or the log start is reached.

    Raises:
        BrokerError: The broker did not answer within ``timeout_s``.
    """
    if not tps:
        return {}
    consumer = AIOKafkaConsumer(
        bootstrap_servers=bootstrap_servers, group_id=None, enable_auto_commit=False,
        auto_offset_reset="earliest", isolation_level="read_committed", **(security or {}),
    )
    await start_or_close(consumer)
    try:
        parts = [TopicPartition(t, p) for t, p in tps]
        consumer.assign(parts)
        begin = await consumer.beginning_offsets(parts)
        ends = await consumer.end_offsets(parts)
        out = {(tp.topic, tp.partition): -1 for tp in parts}
        deadline = time.monotonic() + timeout_s
        for tp in parts:
            tail, stop = 16, ends[tp]
            while stop > begin[tp]:
                start = max(begin[tp], stop - tail)
                consumer.seek(tp, start)
                last = -1
                while await consumer.position(tp) < stop:
                    if time.monotonic() > deadline:
                        raise BrokerError(f"reading the end of {tp.topic}[{tp.partition}] took "
                                          f"more than {timeout_s:g} s")
                    batch = await consumer.getmany(tp, timeout_ms=200)
                    for record in batch.get(tp, ()):
                        if record.offset < stop:
                            last = max(last, record.offset)
                if last >= 0:
                    out[(tp.topic, tp.partition)] = last
                    break
                stop, tail = start, tail * 2
        return out
    finally:
        await consumer.stop()


async def read_partition_tails(
    bootstrap_servers: str,
    topic: str,
    last: int,
    *,
    security: dict[str, Any] | None = None,
    timeout_s: float = 10.0,
) -> dict[int, list[tuple[int, bytes | None, bytes | None]]]:
    """The last records (about ``last``) of every partition of ``topic``, with one consumer.

    The end of each partition comes from ListOffsets, which the embedded broker answers with
    the start of the last stored batch + 1 (docs/broker.md): the tail read may then miss the
    rest of that batch, never more.

    Returns:
        ``{partition: [(offset, key, value), ...]}`` in offset order; ``{}`` when the topic
        does not exist (it is not created).
    """
    consumer = AIOKafkaConsumer(
        bootstrap_servers=bootstrap_servers, group_id=None, enable_auto_commit=False,
        auto_offset_reset="earliest", isolation_level="read_committed", **(security or {}),
    )
    await start_or_close(consumer)
    try:
        # all topics' metadata, without naming the topic (naming it would auto-create it on
        # Tansu); the consumer's own view may not hold it yet
        cluster = await consumer._client.fetch_all_metadata()
        partitions = cluster.partitions_for_topic(topic)
        if not partitions:
            return {}
        tps = [TopicPartition(topic, p) for p in sorted(partitions)]
        consumer.assign(tps)
        begin = await consumer.beginning_offsets(tps)
        ends = await consumer.end_offsets(tps)
        out: dict[int, list[tuple[int, bytes | None, bytes | None]]] = {
            tp.partition: [] for tp in tps}
        pending = {tp for tp in tps if ends[tp] > begin[tp]}
        for tp in pending:
            consumer.seek(tp, max(begin[tp], ends[tp] - last))
        deadline = time.monotonic() + timeout_s
        while pending and time.monotonic() < deadline:
            batch = await consumer.getmany(*pending, timeout_ms=200)
            for tp, records in batch.items():
                out[tp.partition] += [(r.offset, r.key, r.value) for r in records]
            for tp in list(pending):
                if await consumer.position(tp) >= ends[tp]:
                    pending.discard(tp)
        return out
    finally:
        await consumer.stop()


async def partitions_of(consumer: AIOKafkaConsumer, topic: str) -> set[int]:
    """The partition numbers of ``topic``, refreshing the consumer's metadata until it knows
    them.

    Raises:
        RuntimeError: The topic has no partitions after 50 metadata refreshes.
    """
    # Topics are created before any client runs (see :func:`create_topics`); asking for
    # a missing one would auto-create it on Tansu.
    for _ in range(50):
        parts = consumer.partitions_for_topic(topic)
        if parts:
            return set(parts)
        await consumer._client.force_metadata_update()
    raise RuntimeError(f"topic {topic!r} has no partitions; was it created?")


# -- topics ------------------------------------------------------------------------------------


def create_topics(
    bootstrap_servers: str,
    topics: Mapping[str, int],
    *,
    replication_factor: int = 1,
    timeout_s: float = 15.0,
    security: Mapping[str, Any] | None = None,
    configs: Mapping[str, Mapping[str, str]] | None = None,
) -> list[str]:
    """Create the topics that do not exist yet.

    Existing topics are left as they are, even when their partition count differs (Tansu
    auto-creates a topic with 4 partitions as soon as a client asks for its metadata, so create
    topics before any producer or consumer touches them).

    Args:
        bootstrap_servers: ``"HOST:PORT"`` of the broker.
        topics: Topic name -> number of partitions (>= 1).
        replication_factor: Replicas per partition; 1 on a single-node broker.
        timeout_s: Seconds the whole operation may take.
        security: aiokafka security options
            (:func:`kafka_security_options`); None: plaintext.
        configs: Topic name -> topic configs (e.g. ``{"cleanup.policy": "compact"}``) for
            the topics created here; other topics get the broker's defaults.

    Returns:
        Names of the topics this call created, in the order given.

    Raises:
        BrokerError: The broker cannot be reached, did not answer in time, or refused to create
            a topic (the Kafka error is named).
    """
    for name, partitions in topics.items():
        if not name or not isinstance(partitions, int) or partitions < 1:
            raise BrokerError(
                f"Cannot create topic {name!r} with {partitions!r} partitions: the name must be "
                "non-empty and the partition count an integer >= 1."
            )
    if not topics:
        return []
    return run_sync(
        lambda: ensure_topics(
            bootstrap_servers, topics, replication_factor=replication_factor,
            timeout_s=timeout_s, security=security, configs=configs,
        )
    )


async def ensure_topics(
    bootstrap_servers: str,
    topics: Mapping[str, int],
    *,
    replication_factor: int = 1,
    timeout_s: float = 15.0,
    security: Mapping[str, Any] | None = None,
    configs: Mapping[str, Mapping[str, str]] | None = None,
) -> list[str]:
    """:func:`create_topics` for async callers (the names and counts are not checked here)."""
    topics = dict(topics)
    if not topics:
        return []
    admin = AIOKafkaAdminClient(
        bootstrap_servers=bootstrap_servers,
        request_timeout_ms=max(1, int(timeout_s * 1000)),
        **(security or {}),
    )
    configs = configs or {}
    try:
        async with asyncio.timeout(timeout_s):
            await admin.start()
            # list_topics() names no topic, so it cannot trigger Tansu's auto-creation.
            existing = set(await admin.list_topics())
            missing = [name for name in topics if name not in existing]
            if not missing:
                return []
            response = await admin.create_topics(
                [
                    NewTopic(name, topics[name], replication_factor,
                             topic_configs=dict(configs.get(name, {})))
                    for name in missing
                ]
            )
    except TimeoutError as err:
        raise BrokerError(
            f"Creating topics {sorted(topics)} on {bootstrap_servers} took longer than "
            f"{timeout_s} s. Check that the broker runs there, or raise timeout_s."
        ) from err
    except (KafkaError, OSError) as err:
        raise BrokerError(
            f"Cannot create topics {sorted(topics)} on {bootstrap_servers}: "
            f"{describe_error(err)}. Check that a Kafka broker listens there."
        ) from err
    finally:
        await admin.close()
    created: list[str] = []
    problems: list[str] = []
    codes: dict[str, int] = {}
    for entry in response.to_object()["topic_errors"]:
        name, code, message = entry["topic"], entry["error_code"], entry.get("error_message")
        codes[name] = code
        if code == 0:
            created.append(name)
        elif code != _TOPIC_ALREADY_EXISTS:  # created concurrently since list_topics: fine
            problems.append(f"{name!r}: {for_code(code).__name__} ({code}) {message or ''}".strip())
    denied = [name for name, code in codes.items() if code == TopicAuthorizationFailedError.errno]
    if denied:
        raise SecurityError(
            f"the broker at {bootstrap_servers} denied creating topics {sorted(denied)} "
            "(TopicAuthorizationFailedError): this user may not create them, or not even see "
            "them; create them as an administrator and grant the user the ACLs "
            "docs/deployment.md lists for a worker or a publisher"
        )
    if problems:
        raise BrokerError(
            f"The broker at {bootstrap_servers} refused to create topics: {'; '.join(problems)}. "
            "Fix the topic name or partition count, or delete the conflicting topic."
        )
    return [name for name in missing if name in created]


@dataclass(frozen=True)
class ClusterFacts:
    """What a broker says about itself and its topics.

    Attributes:
        cluster_id: The id the cluster reports (Apache Kafka: a base64 UUID fixed when its
            storage was formatted; the embedded broker: always ``tansu_cluster``); "" when none.
        partitions: Topic name -> partition count, of every topic that exists.
    """

    cluster_id: str
    partitions: dict[str, int] = field(default_factory=dict)


async def with_admin(
    settings: Settings, use: Callable[[AIOKafkaAdminClient], Awaitable[_T]],
    timeout_s: float = 15.0,
) -> _T:
    """Run ``use(admin)`` with an admin client of ``settings.broker`` (security included),
    closed afterwards; the whole call is bounded by ``timeout_s`` seconds.

    Raises:
        TimeoutError: It took longer. KafkaError / OSError: from aiokafka.
    """
    admin = AIOKafkaAdminClient(
        bootstrap_servers=settings.bootstrap_servers,
        request_timeout_ms=max(1, int(timeout_s * 1000)),
        **kafka_security_options(settings),
    )
    try:
        async with asyncio.timeout(timeout_s):
            await admin.start()
            return await use(admin)
    finally:
        await admin.close()


def cluster_facts(settings: Settings, timeout_s: float = 15.0) -> ClusterFacts:
    """Ask ``settings.broker`` for its cluster id and the partition counts of its topics.

    Asks for the metadata of all topics (naming none), so the embedded broker auto-creates
    nothing.

    Raises:
        BrokerError: The broker did not answer within ``timeout_s`` (seconds).
    """

    async def ask(admin: AIOKafkaAdminClient) -> ClusterFacts:
        described = await admin.describe_cluster()
        topics = await admin.describe_topics()
        return ClusterFacts(
            cluster_id=str(described.get("cluster_id") or ""),
            partitions={
                t["topic"]: len(t["partitions"]) for t in topics
                if not t.get("error_code") and t["partitions"]
            },
        )

    try:
        return run_sync(lambda: with_admin(settings, ask, timeout_s))
    except (KafkaError, OSError, TimeoutError) as exc:
        raise connection_error(
            settings, exc,
            f"cannot read the topics of {settings.bootstrap_servers} ({describe_error(exc)}); "
            "is the broker running, and are --broker and the security settings right?",
        ) from exc


def connection_error(settings: Settings, exc: BaseException, otherwise: str) -> BrokerError:
    """The error to raise for a client error ``exc``: a refused login or certificate
    (:func:`security_problem`), a missing ACL (:func:`denied_line`), else ``otherwise``.
    Call it from synchronous code only (it may connect once more)."""
    line = denied_line(settings, exc)
    if line is None and settings.security_protocol != "PLAINTEXT":
        line = run_sync(lambda: security_problem(settings))
    return SecurityError(line) if line else BrokerError(otherwise)


def add_partitions(
    settings: Settings, totals: Mapping[str, int], timeout_s: float = 30.0
) -> None:
    """Grow existing topics to ``totals`` partitions (Kafka's CreatePartitions; the embedded
    broker refuses it). Kafka cannot remove partitions.

    Args:
        settings: The broker and security settings.
        totals: Topic name -> the partition count it should have (larger than it has).
        timeout_s: Seconds the broker may take.

    Raises:
        BrokerError: The broker refused (the Kafka error is named) or did not answer.
    """
    if not totals:
        return

    async def grow(admin: AIOKafkaAdminClient) -> None:
        await admin.create_partitions({t: NewPartitions(total_count=n) for t, n in totals.items()})

    try:
        run_sync(lambda: with_admin(settings, grow, timeout_s))
    except (KafkaError, OSError, TimeoutError) as exc:
        raise BrokerError(
            f"cannot add partitions to {sorted(totals)} on {settings.bootstrap_servers}: "
            f"{describe_error(exc)} (the embedded broker cannot add partitions; Apache "
            "Kafka can)"
        ) from exc


async def probe_metadata(host: str, port: int, timeout_s: float) -> None:
    """One readiness probe: a TCP connect, then a Kafka metadata request via aiokafka."""
    # A bare connect first, so that aiokafka does not log an error for every refused poll.
    _, writer = await asyncio.open_connection(host, port)
    writer.close()
    with contextlib.suppress(OSError):
        await writer.wait_closed()
    client = AIOKafkaClient(
        bootstrap_servers=f"{host}:{port}",
        request_timeout_ms=int(timeout_s * 1000),
    )
    try:
        await client.bootstrap()
        await client.fetch_all_metadata()
    finally:
        await client.close()


def run_sync(factory: Callable[[], Coroutine[Any, Any, _T]]) -> _T:
    """Run a coroutine to completion from synchronous code.

    Uses ``asyncio.run`` directly, or in a short-lived thread when this thread already runs an
    event loop (e.g. called from an async test); the caller's loop is blocked meanwhile.
    """
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(factory())
    outcome: dict[str, Any] = {}

    def _target() -> None:
        try:
            outcome["value"] = asyncio.run(factory())
        except BaseException as err:  # re-raised in the caller's thread
            outcome["error"] = err

    thread = threading.Thread(target=_target, name="streamapp-broker-sync", daemon=True)
    thread.start()
    thread.join()
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]  # type: ignore[no-any-return]


#: The cluster id the embedded broker (Tansu 0.6) reports in every metadata response.
EMBEDDED_CLUSTER_ID = "tansu_cluster"


def detect_broker_kind(settings: Settings, timeout_s: float = 10.0) -> str:
    """Which kind of broker ``settings.broker`` is: ``"embedded"`` (Tansu, recognised by the
    cluster id it reports) or ``"kafka"`` (anything else: Apache Kafka or a compatible service).

    Raises:
        BrokerError: The broker did not answer a metadata request within ``timeout_s``.
    """

    async def cluster_id() -> str | None:
        admin = AIOKafkaAdminClient(
            bootstrap_servers=settings.bootstrap_servers,
            request_timeout_ms=int(timeout_s * 1000),
            **kafka_security_options(settings),
        )
        try:
            await admin.start()
            described = await asyncio.wait_for(admin.describe_cluster(), timeout_s)
        finally:
            await admin.close()
        return described.get("cluster_id")

    try:
        found = run_sync(cluster_id)
    except (KafkaError, OSError, TimeoutError) as exc:
        problem = run_sync(lambda: security_problem(settings))
        if problem is not None:
            raise SecurityError(problem) from exc
        raise BrokerError(
            f"cannot tell which broker {settings.bootstrap_servers} is ({type(exc).__name__}: "
            f"{exc}); set STREAMAPP_BROKER_KIND to 'kafka' or 'embedded'"
        ) from exc
    return "embedded" if found == EMBEDDED_CLUSTER_ID else "kafka"


def resolve_broker_kind(settings: Settings) -> Settings:
    """``settings`` with ``broker_kind`` decided: unchanged unless it is ``"auto"``, then
    asked of the broker (:func:`detect_broker_kind`); an unreachable broker counts as
    ``"kafka"`` (Faust's normal behaviour, the safe side) with a warning."""
    if settings.broker_kind != "auto":
        return settings
    try:
        kind = detect_broker_kind(settings)
    except SecurityError:
        raise
    except BrokerError:
        log.warning("the broker at %s did not answer; assuming it is Apache Kafka (set "
                    "STREAMAPP_BROKER_KIND to skip this check)", settings.bootstrap_servers)
        kind = "kafka"
    return settings.model_copy(update={"broker_kind": kind})
