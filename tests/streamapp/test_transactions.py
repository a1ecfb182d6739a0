"""streamapp.transactions without a broker: the transactional id, the refusal on the embedded
broker, TxnOffsetCommit v3 (KIP-447) on the wire, the send gate, and a commit's order."""

from __future__ import annotations

import asyncio
from io import BytesIO
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from aiokafka.errors import IllegalGenerationError
from aiokafka.structs import OffsetAndMetadata, TopicPartition

from streamapp.exceptions import ConfigError
from streamapp.settings import load_settings
from streamapp.transactions import (
    GroupMetadata,
    GroupTxnOffsetCommitHandler,
    SendGate,
    TransactionCommitter,
    TxnOffsetCommitResponse_v3,
    check_guarantee,
    transactional_id,
    use_group_metadata,
)


def test_the_transactional_id_is_stable_per_instance(tmp_path: Path) -> None:
    one = load_settings(app_id="app", data_dir=tmp_path / "a")
    assert transactional_id(one) == transactional_id(load_settings(app_id="app",
                                                                   data_dir=tmp_path / "a"))
    assert transactional_id(one) != transactional_id(load_settings(app_id="app",
                                                                   data_dir=tmp_path / "b"))
    named = load_settings(app_id="app", group_instance_id="gpu-0")
    assert transactional_id(named) == "app-eos-gpu-0"


def test_exactly_once_is_refused_on_the_embedded_broker() -> None:
    with pytest.raises(ConfigError, match=r"needs Apache Kafka.*no transactions"):
        check_guarantee(load_settings(processing_guarantee="exactly_once",
                                      broker_kind="embedded"))
    check_guarantee(load_settings(processing_guarantee="exactly_once", broker_kind="kafka"))
    check_guarantee(load_settings(broker_kind="embedded"))  # at_least_once: anywhere


class _Txn:
    transactional_id, producer_id, producer_epoch = "app-eos-w", 7, 3

    def __init__(self) -> None:
        self.committed: list[tuple[TopicPartition, int, str]] = []

    def offset_committed(self, tp: TopicPartition, offset: int, group_id: str) -> None:
        self.committed.append((tp, offset, group_id))


def _handler(offsets: dict[TopicPartition, OffsetAndMetadata]) -> Any:
    sender = SimpleNamespace(_txn_manager=_Txn(), _retry_backoff=0.1)
    metadata = GroupMetadata(generation_id=5, member_id="member-1", group_instance_id="w")
    cls = type("H", (GroupTxnOffsetCommitHandler,), {"metadata": staticmethod(lambda: metadata)})
    return cls(sender, offsets, "app")


def test_offsets_go_with_the_group_generation_and_member_id_v3() -> None:
    handler = _handler({TopicPartition("req", 1): OffsetAndMetadata(42, "")})
    request = handler.create_request().prepare({28: (0, 5)})
    assert request.API_VERSION == 3 and request.FLEXIBLE_VERSION
    fields = request.to_object()
    assert (fields["transactional_id"], fields["group_id"], fields["producer_id"],
            fields["producer_epoch"]) == ("app-eos-w", "app", 7, 3)
    assert (fields["generation_id"], fields["member_id"], fields["group_instance_id"]) == \
        (5, "member-1", "w")
    assert fields["topics"][0]["topic"] == "req"
    assert fields["topics"][0]["partitions"][0]["offset"] == 42
    request.encode()  # serialises (compact strings, tagged fields)


def _response(error_code: int) -> Any:
    wire = TxnOffsetCommitResponse_v3(0, [("req", [(1, error_code, {})], {})], {}).encode()
    return TxnOffsetCommitResponse_v3.decode(BytesIO(wire))


def test_a_v3_answer_is_handled_as_aiokafka_handles_v0() -> None:
    handler = _handler({TopicPartition("req", 1): OffsetAndMetadata(42, "")})
    assert handler.handle_response(_response(0)) is None
    assert handler._sender._txn_manager.committed == [(TopicPartition("req", 1), 42, "app")]
    with pytest.raises(IllegalGenerationError):  # a zombie of an older generation
        handler.handle_response(_response(IllegalGenerationError.errno))


def test_use_group_metadata_replaces_the_senders_offset_commit() -> None:
    sender = SimpleNamespace()
    use_group_metadata(sender, lambda: GroupMetadata(1, "m", None))
    assert asyncio.iscoroutinefunction(sender._do_txn_offset_commit)


async def test_the_gate_holds_sends_while_closed_and_waits_for_those_under_way() -> None:
    gate, sent = SendGate(), []
    release = asyncio.Event()

    async def send(name: str) -> str:
        if name == "slow":
            await release.wait()
        sent.append(name)
        return name

    gated = gate.wrap(send)
    slow = asyncio.ensure_future(gated("slow"))
    await asyncio.sleep(0)
    closing = asyncio.ensure_future(gate.close())
    await asyncio.sleep(0.01)
    assert not closing.done()  # waits for the send under way
    held = asyncio.ensure_future(gated("held"))
    release.set()
    await closing
    await asyncio.sleep(0.01)
    assert sent == ["slow"] and not held.done()
    gate.open()
    assert await held == "held" and await slow == "slow"


class _Producer:
    def __init__(self, fail: bool = False) -> None:
        self.calls: list[str] = []
        self.fail = fail
        self._txn_manager = SimpleNamespace(is_empty_transaction=lambda: False)

    async def send_offsets_to_transaction(self, offsets: Any, group_id: str) -> None:
        pairs = sorted((tp.partition, o.offset) for tp, o in offsets.items())
        self.calls.append(f"offsets {pairs}")

    async def commit_transaction(self) -> None:
        if self.fail:
            raise RuntimeError("broker gone")
        self.calls.append("commit")

    async def begin_transaction(self) -> None:
        self.calls.append("begin")

    async def abort_transaction(self) -> None:
        self.calls.append("abort")


async def test_a_commit_settles_flushes_then_commits_the_offsets_and_begins_the_next() -> None:
    producer, calls = _Producer(), []
    crashed: list[BaseException] = []

    async def settle() -> None:
        calls.append("settle")

    async def flush() -> None:
        calls.append("flush")

    async def crash(exc: BaseException) -> None:
        crashed.append(exc)

    committer = TransactionCommitter(None, SendGate(), group_id="app",
                                     outputs_lock=asyncio.Lock(), flush_buffer=flush,
                                     crash=crash)
    committer.on_started(producer)
    committer.settle = settle
    done = await committer.commit(lambda: {("req", 0): 10, ("req", 1): 4})
    assert done == {("req", 0): 10, ("req", 1): 4}
    assert calls == ["settle", "flush"]
    assert producer.calls == ["offsets [(0, 10), (1, 4)]", "commit", "begin"]
    assert committer.stats.commits == 1 and not crashed


async def test_a_failed_commit_aborts_and_stops_the_worker() -> None:
    producer, crashed = _Producer(fail=True), []

    async def nothing() -> None:
        return None

    async def crash(exc: BaseException) -> None:
        crashed.append(exc)

    committer = TransactionCommitter(None, SendGate(), group_id="app",
                                     outputs_lock=asyncio.Lock(), flush_buffer=nothing,
                                     crash=crash)
    committer.on_started(producer)
    assert await committer.commit(lambda: {("req", 0): 1}) == {}
    assert producer.calls[-1] == "abort"
    assert len(crashed) == 1 and "could not be committed" in str(crashed[0])
    assert committer.stats.failures == 1
    assert await committer.commit(lambda: {("req", 0): 2}) == {}  # never again after a failure
