"""The device-state observer on in-memory tables: once-per-batch writes, device attribution,
windows that add up, expiry."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from streamapp.agents.observer import Outcome
from streamapp.tables import DeviceStateObserver, DeviceStateReader, MemoryDeviceTables, WindowPlan
from streamapp.tables.base import bucket_key, split_bucket_key

REQUESTS = "inference-request"
PLAN = WindowPlan(tumbling_ms=10_000, hopping_ms=30_000, step_ms=5_000, expires_ms=60_000)


@dataclass
class Message:
    topic: str
    partition: int
    key: bytes | None


@dataclass
class Event:
    message: Message


class Clock:
    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def result(device: str, seq: int, ts: float, *, topic: str = REQUESTS, key: bytes | None = None,
           kind: str = "result", reason: str | None = None) -> Outcome:
    event = Event(Message(topic, 1, device.encode() if key is None else key))
    ok = kind == "result"
    return Outcome(
        kind=kind,  # type: ignore[arg-type]
        device_id=device, request_id=f"{device}-{seq}", seq=seq, model="digits", reason=reason,
        label=str(seq % 3) if ok else None, score=0.5 if ok else None,
        e2e_ms=float(seq) if ok else None, queue_ms=1.0 if ok else None,
        infer_ms=1.0 if ok else None, attempt=0, ts=ts, partition=1, event=event,
    )


def make(now: float = 1_000.0) -> tuple[MemoryDeviceTables, DeviceStateObserver,
                                        DeviceStateReader, Clock]:
    tables, clock = MemoryDeviceTables(), Clock(now)
    observer = DeviceStateObserver(tables, PLAN, request_topic=REQUESTS, ewma_alpha=0.5,
                                   clock=clock)
    return tables, observer, DeviceStateReader(tables, PLAN, clock=clock), clock


async def test_one_flush_writes_each_device_once_whatever_the_number_of_outcomes() -> None:
    tables, observer, reader, _ = make()
    for seq in range(10):
        observer.on_outcome(result("cam1", seq, 1_000.0))
        observer.on_outcome(result("cam2", seq, 1_000.0))
    assert tables.writes == 0  # nothing before the flush
    await observer.flush()
    # per device: 1 stats row + 2 bucket series (tumbling 10 s, hopping step 5 s)
    assert tables.writes == 2 * (1 + 2)
    assert tables.flushes == 1
    # every row was written inside its own device's write context
    assert all(split_bucket_key(key)[0] == device if b"\x00" in key else key == device
               for device, key in tables.written_by)
    stats = reader.stats(b"cam1")
    assert stats is not None and stats["counts"]["result"] == 10 and stats["last_seq"] == 9
    await observer.flush()  # nothing pending: nothing written
    assert tables.writes == 6


async def test_windows_add_up_to_the_totals() -> None:
    _, observer, reader, clock = make(now=1_000.0)
    for i in range(40):  # 40 outcomes spread over 20 s, a few dead letters
        ts = 1_000.0 + i / 2
        kind = "dead_letter" if i % 10 == 0 else "result"
        observer.on_outcome(result("cam1", i, ts, kind=kind, reason="bad_shape"))
        if i % 7 == 6:
            await observer.flush()
    await observer.flush()
    clock.now = 1_020.0
    stats = reader.stats(b"cam1")
    assert stats is not None and stats["total"] == 40
    for kind in ("tumbling", "hopping"):
        windows = reader.windows(b"cam1", kind, last=PLAN.max_last(kind))  # type: ignore[arg-type]
        assert windows is not None
    tumbling = reader.windows(b"cam1", "tumbling", last=6)
    assert tumbling is not None
    assert sum(w["count"] for w in tumbling) == 40
    assert sum(w["dead_letters"] for w in tumbling) == 4
    assert sum(sum(w["labels"].values()) for w in tumbling) == 36
    newest_hop = reader.windows(b"cam1", "hopping", last=1)
    assert newest_hop is not None and newest_hop[0]["count"] == 40  # the last 30 s hold it all
    assert reader.windows(b"nobody", "tumbling", last=3) is None


async def test_the_record_key_identifies_the_device_and_retries_use_device_id() -> None:
    tables, observer, reader, _ = make()
    # key mismatch: the row goes to the record key (the partition owner's key)
    observer.on_outcome(result("cam9", 0, 1_000.0, key=b"gateway-key",
                               kind="dead_letter", reason="key_mismatch"))
    # any dead letter whose value named another device (read from a rejected value) too
    observer.on_outcome(result("cam8", 0, 1_000.0, key=b"gateway-key",
                               kind="dead_letter", reason="bad_shape"))
    # a 600,000-byte device key: no row (its changelog record would be too large to produce)
    observer.on_outcome(result("d" * 600_000, 0, 1_000.0, key=b"d" * 600_000,
                               kind="dead_letter", reason="unproducible_outcome"))
    # a retried request arrives from the retry topic, keyed by request id
    observer.on_outcome(result("cam1", 1, 1_000.0, topic="inference-retry", key=b"cam1-1",
                               kind="retry", reason="engine_oom"))
    # an invalid retry record names a device nobody checked: not attributable
    observer.on_outcome(result("cam7", 0, 1_000.0, topic="inference-retry", key=b"rr-nb",
                               kind="dead_letter", reason="invalid_retry_record"))
    # undecodable value, no key: not attributable
    anonymous = result("x", 0, 1_000.0, key=b"", kind="dead_letter", reason="invalid_json")
    anonymous.device_id = None
    observer.on_outcome(anonymous)
    # keys no view could be asked for (issue 19): their dead letters are not attributed, so
    # /devices never lists a device that /devices/{id} refuses
    for bad in ("tab\tdev", "nul\x00dev", "rtl-\u202e-abc", "d" * 257):
        observer.on_outcome(result(bad, 0, 1_000.0, kind="dead_letter", reason="bad_device_id"))
    observer.on_outcome(result("x", 0, 1_000.0, key=b"\xff\xfe", kind="dead_letter",
                               reason="key_mismatch"))
    await observer.flush()
    assert sorted(tables.stats) == [b"cam1", b"gateway-key"]
    assert observer.stats.unattributed == 3 + 5
    gateway = reader.stats(b"gateway-key")
    assert gateway is not None and gateway["dead_letters_by_reason"] == {
        "key_mismatch": 1, "bad_shape": 1
    }
    cam1 = reader.stats(b"cam1")
    assert cam1 is not None and cam1["retries_by_reason"] == {"engine_oom": 1}
    assert cam1["total"] == 0


async def test_expired_buckets_are_deleted_when_the_device_writes_again() -> None:
    tables, observer, reader, clock = make(now=1_000.0)
    observer.on_outcome(result("cam1", 0, 1_000.0))
    await observer.flush()
    assert {split_bucket_key(k)[1:] for k in tables.buckets} == {(10_000, 1_000_000),
                                                                (5_000, 1_000_000)}
    clock.now = 1_100.0
    old = reader.windows(b"cam1", "tumbling", last=6)
    assert old is not None and sum(w["count"] for w in old) == 0  # expired: not served
    observer.on_outcome(result("cam1", 1, 1_100.0))
    await observer.flush()
    assert {split_bucket_key(k)[1:] for k in tables.buckets} == {(10_000, 1_100_000),
                                                                (5_000, 1_100_000)}
    assert tables.deletes == 2 and observer.stats.buckets_expired == 2
    stats = reader.stats(b"cam1")
    assert stats is not None and stats["total"] == 2  # counters never expire


async def test_a_failing_device_does_not_stop_the_others() -> None:
    class Flaky(MemoryDeviceTables):
        def set_stats(self, device_key: bytes, row: dict[str, Any]) -> None:
            if device_key == b"bad":
                raise RuntimeError("disk full")
            super().set_stats(device_key, row)

    tables = Flaky()
    observer = DeviceStateObserver(tables, PLAN, request_topic=REQUESTS, ewma_alpha=0.5,
                                   clock=lambda: 1_000.0)
    observer.on_outcome(result("bad", 0, 1_000.0))
    observer.on_outcome(result("good", 0, 1_000.0))
    await observer.flush()
    assert observer.stats.failures == 1
    assert list(tables.stats) == [b"good"]


def test_bucket_keys_parse_back_whatever_the_device_key_holds() -> None:
    for device in (b"cam1", b"a\x00b", b"", "kamera-\u00fc".encode()):
        key = bucket_key(device, 10_000, 1_796_000_000_000)
        assert split_bucket_key(key) == (device, 10_000, 1_796_000_000_000)


async def test_outcomes_of_records_read_to_fill_a_gap_count_for_their_own_device() -> None:
    # Records read to fill a consumer gap share the Faust event of the record that revealed the
    # gap (streamapp.app.admitted), whose key is another device's.
    tables, observer, reader, _ = make()
    trigger = Event(Message(REQUESTS, 1, b"cam1"))
    for seq, device in enumerate(["cam2", "cam3", "cam2", "cam1"]):
        outcome = result(device, seq, 1_000.0)
        outcome.event = trigger
        observer.on_outcome(outcome)
    await observer.flush()
    counts = {d: (reader.stats(d.encode()) or {}).get("counts", {}).get("result")
              for d in ("cam1", "cam2", "cam3")}
    assert counts == {"cam1": 1, "cam2": 2, "cam3": 1}
    assert all(key.split(b"\x00")[0] == device for device, key in tables.written_by)
