"""The Kafka ACLs a worker and a publisher need, and a way to create them (issue 21).

With an authorizer (``StandardAuthorizer`` on KRaft) and ``allow.everyone.if.no.acl.found=false``
a user may do only what an ACL allows. :func:`worker_acls` is the least a worker needs:

* read ``inference-request`` and ``inference-retry`` (Read, Describe), in its group (Read);
* write ``inference-result``, ``inference-dlq`` and ``inference-retry`` (Write, Describe);
* its tables' changelogs and Faust's leader topic, all named ``<app_id>-...`` (Read, Write,
  Describe, Create: a prefixed ACL, so a new table needs no new ACL);
* its transactional ids, ``<app_id>...`` (Write, Describe; for
  ``processing_guarantee=exactly_once``).

The topics themselves are created by an administrator (or ``streamapp worker`` run once as
one): a worker that finds them missing would need Create on them. :func:`publisher_acls` lets a
publisher write requests and nothing else — it cannot read results.

:func:`create_acls` sends Kafka's CreateAcls request (API key 30) with aiokafka's protocol
classes (its admin client has no method for it); :func:`kafka_acls_commands` prints the same
ACLs as ``kafka-acls.sh`` command lines for an operator (docs/deployment.md shows them).
"""

from __future__ import annotations

import asyncio
import enum
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.errors import KafkaError, for_code
from aiokafka.protocol.admin import CreateAclsRequest
from aiokafka.protocol.api import Request, RequestStruct, Response
from aiokafka.protocol.types import Array, Boolean, Int16, Int32, Schema, String

from streamapp.exceptions import BrokerError
from streamapp.kafka import describe_error
from streamapp.settings import Settings

__all__ = [
    "Acl",
    "Operation",
    "PatternType",
    "ResourceType",
    "check_worker_acls",
    "create_acls",
    "kafka_acls_commands",
    "publisher_acls",
    "worker_acls",
]


class ResourceType(enum.IntEnum):
    """Kafka's ``ResourceType`` codes (org.apache.kafka.common.resource.ResourceType)."""

    TOPIC = 2
    GROUP = 3
    CLUSTER = 4
    TRANSACTIONAL_ID = 5


class PatternType(enum.IntEnum):
    """Kafka's ``PatternType`` codes: a name, or every name with this prefix."""

    LITERAL = 3
    PREFIXED = 4


class Operation(enum.IntEnum):
    """Kafka's ``AclOperation`` codes (those streamapp's users need)."""

    READ = 3
    WRITE = 4
    CREATE = 5
    DESCRIBE = 8


#: ``AclPermissionType.ALLOW``.
_ALLOW = 3
#: kafka-acls.sh's resource options.
_RESOURCE_OPTION = {
    ResourceType.TOPIC: "--topic", ResourceType.GROUP: "--group",
    ResourceType.TRANSACTIONAL_ID: "--transactional-id", ResourceType.CLUSTER: "--cluster",
}


@dataclass(frozen=True)
class Acl:
    """One ALLOW rule: ``principal`` may do ``operation`` on a resource, from any host.

    Attributes:
        principal: ``User:<name>`` (the SASL user name).
        resource: The resource type.
        name: The resource's name, or its prefix with ``PatternType.PREFIXED``.
        operation: What is allowed.
        pattern: Literal name or prefix.
    """

    principal: str
    resource: ResourceType
    name: str
    operation: Operation
    pattern: PatternType = PatternType.LITERAL


def _grant(principal: str, resource: ResourceType, names: Iterable[str],
           operations: Iterable[Operation],
           pattern: PatternType = PatternType.LITERAL) -> list[Acl]:
    ops = list(operations)
    return [Acl(principal, resource, name, op, pattern) for name in names for op in ops]


def worker_acls(settings: Settings, user: str) -> list[Acl]:
    """The least a worker of ``settings.app_id`` running as SASL user ``user`` needs (see the
    module docstring)."""
    p = f"User:{user}"
    topic, prefixed = ResourceType.TOPIC, PatternType.PREFIXED
    read, write, describe, create = (Operation.READ, Operation.WRITE, Operation.DESCRIBE,
                                     Operation.CREATE)
    return [
        *_grant(p, topic, [settings.request_topic, settings.retry_topic], [read, describe]),
        *_grant(p, topic, [settings.result_topic, settings.dlq_topic, settings.retry_topic],
                [write]),
        *_grant(p, topic, [settings.result_topic, settings.dlq_topic], [describe]),
        *_grant(p, topic, [f"{settings.app_id}-"], [read, write, describe, create], prefixed),
        *_grant(p, ResourceType.GROUP, [settings.app_id], [read, describe]),
        *_grant(p, ResourceType.TRANSACTIONAL_ID, [settings.app_id], [write, describe],
                prefixed),
    ]


def publisher_acls(settings: Settings, user: str) -> list[Acl]:
    """What a publisher (``streamapp publish``, a gateway) running as ``user`` needs: write
    and describe the request topic, nothing else."""
    return _grant(f"User:{user}", ResourceType.TOPIC, [settings.request_topic],
                  [Operation.WRITE, Operation.DESCRIBE])


async def create_acls(
    bootstrap_servers: str, acls: Sequence[Acl], *, security: Mapping[str, Any],
    timeout_s: float = 30.0,
) -> None:
    """Create ``acls`` (existing ones are kept; creating one twice is no error).

    Args:
        bootstrap_servers: ``host:port,...`` of the cluster.
        acls: The rules.
        security: aiokafka security options of a user allowed to alter ACLs (a super user).
        timeout_s: Seconds the whole call may take.

    Raises:
        BrokerError: The broker refused one (e.g. the user may not alter ACLs; the Kafka
            error is named) or did not answer.
    """
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap_servers,
                                request_timeout_ms=int(timeout_s * 1000), **security)
    try:
        async with asyncio.timeout(timeout_s):
            await admin.start()
            for acl in acls:
                request = CreateAclsRequest(
                    acl.resource, acl.name, acl.pattern, acl.principal, "*", acl.operation,
                    _ALLOW,
                )
                # the admin client sends to any node: the broker forwards to the controller
                response = await admin._send_request(request)
                for answer in response.to_object()["creation_responses"]:
                    if answer["error_code"]:
                        error = for_code(answer["error_code"])
                        raise BrokerError(
                            f"the broker refused the ACL {acl.principal} {acl.operation.name} "
                            f"{acl.resource.name} {acl.name!r}: {error.__name__} "
                            f"{answer.get('error_message') or ''}".rstrip()
                            + "; create ACLs as a super user"
                        )
    except (KafkaError, OSError, TimeoutError) as exc:
        raise BrokerError(
            f"cannot create ACLs on {bootstrap_servers}: {describe_error(exc)}"
        ) from exc
    finally:
        await admin.close()


# -- what a user may do: Metadata v8's authorized operations (KIP-430) -------------------------
# aiokafka's MetadataRequest stops at v5; v8 adds each topic's authorized operations as a bit
# field (bit n set: AclOperation code n allowed).

_PARTITION = Array(
    ("error_code", Int16), ("partition", Int32), ("leader", Int32), ("leader_epoch", Int32),
    ("replicas", Array(Int32)), ("isr", Array(Int32)), ("offline_replicas", Array(Int32)),
)


class _MetadataResponseV8(Response):
    API_KEY = 3
    API_VERSION = 8
    SCHEMA = Schema(
        ("throttle_time_ms", Int32),
        ("brokers", Array(("node_id", Int32), ("host", String("utf-8")), ("port", Int32),
                          ("rack", String("utf-8")))),
        ("cluster_id", String("utf-8")),
        ("controller_id", Int32),
        ("topics", Array(("error_code", Int16), ("topic", String("utf-8")),
                         ("is_internal", Boolean), ("partitions", _PARTITION),
                         ("topic_authorized_operations", Int32))),
        ("cluster_authorized_operations", Int32),
    )


class _MetadataRequestV8(RequestStruct):
    API_KEY = 3
    API_VERSION = 8
    RESPONSE_TYPE = _MetadataResponseV8
    SCHEMA = Schema(
        ("topics", Array(String("utf-8"))), ("allow_auto_topic_creation", Boolean),
        ("include_cluster_authorized_operations", Boolean),
        ("include_topic_authorized_operations", Boolean),
    )


class _AuthorizedOperations(Request[_MetadataRequestV8]):
    API_KEY = 3

    def __init__(self, topics: Sequence[str]) -> None:
        self._topics = list(topics)

    def build(self, request_struct_class: type[_MetadataRequestV8]) -> _MetadataRequestV8:
        return request_struct_class(self._topics, False, False, True)


#: What Kafka answers for authorized operations it was not asked for or cannot tell.
_UNKNOWN_OPERATIONS = -(2**31)


def _needs(acls: Iterable[Acl], topics: Iterable[str]) -> dict[str, set[Operation]]:
    """Topic -> operations ``acls`` grant on it (literal names, and prefixed ones for each of
    ``topics`` they match)."""
    needs: dict[str, set[Operation]] = {}
    names = list(topics)
    for acl in acls:
        if acl.resource is not ResourceType.TOPIC:
            continue
        matched = [acl.name] if acl.pattern is PatternType.LITERAL else [
            n for n in names if n.startswith(acl.name)]
        for name in matched:
            needs.setdefault(name, set()).add(acl.operation)
    return needs


async def check_worker_acls(
    settings: Settings, changelogs: Sequence[str], *, security: Mapping[str, Any],
    timeout_s: float = 15.0,
) -> None:
    """Refuse to start a worker whose user may not do on its topics what
    :func:`worker_acls` lists, naming the first missing operation (the broker would
    otherwise refuse its produce requests one by one while it keeps reading).

    Asks the broker for the user's authorized operations on each topic (Metadata v8,
    KIP-430); a broker that cannot tell (no authorizer, an older protocol) passes.

    Raises:
        SecurityError: An operation is missing (one line: user, operation, topic, the fix).
    """
    from aiokafka.client import AIOKafkaClient

    from streamapp.exceptions import SecurityError

    needs = _needs(worker_acls(settings, settings.sasl_username), changelogs)
    client = AIOKafkaClient(bootstrap_servers=settings.bootstrap_servers,
                            request_timeout_ms=int(timeout_s * 1000), **security)
    try:
        async with asyncio.timeout(timeout_s):
            await client.bootstrap()
            response = await client.send(client.get_random_node(),
                                         _AuthorizedOperations(sorted(needs)))
    except (KafkaError, OSError, TimeoutError, NotImplementedError):
        return  # the broker cannot say: the produce path reports what it refuses
    finally:
        await client.close()
    for topic in response.to_object()["topics"]:
        name, allowed = topic["topic"], topic["topic_authorized_operations"]
        if topic["error_code"] == 0 and allowed == _UNKNOWN_OPERATIONS:
            continue
        granted = set() if topic["error_code"] else {
            op for op in Operation if allowed & (1 << op.value)}
        missing = sorted(needs.get(name, set()) - granted)
        if missing:
            raise SecurityError(
                f"the broker does not allow user {settings.sasl_username!r} to "
                f"{' and '.join(op.name for op in missing)} topic {name!r}, which a worker "
                "needs: grant it the worker ACLs docs/deployment.md lists (streamapp.acls)"
            )


def kafka_acls_commands(acls: Sequence[Acl], bootstrap: str = "<broker:9093>") -> list[str]:
    """The ``kafka-acls.sh`` command lines that create ``acls`` (one per principal, resource
    and operation set), for an operator's shell."""
    groups: dict[tuple[str, ResourceType, str, PatternType], list[Operation]] = {}
    for acl in acls:
        groups.setdefault((acl.principal, acl.resource, acl.name, acl.pattern),
                          []).append(acl.operation)
    lines = []
    for (principal, resource, name, pattern), ops in groups.items():
        parts = ["kafka-acls.sh", "--bootstrap-server", bootstrap,
                 "--command-config", "admin.properties", "--add",
                 "--allow-principal", principal]
        parts += [f"--operation {op.name.title()}" for op in ops]
        parts += [_RESOURCE_OPTION[resource], name]
        if pattern is PatternType.PREFIXED:
            parts += ["--resource-pattern-type", "prefixed"]
        lines.append(" ".join(parts))
    return lines
