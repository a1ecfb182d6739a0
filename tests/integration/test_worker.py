"""The worker end to end on the embedded broker with the real digits model."""

from __future__ import annotations

import base64
import json
from collections import defaultdict

import msgpack
import numpy as np
import pytest

from streamapp.broker import EmbeddedBroker
from streamapp.client import (
    Outcomes,
    collect_outcomes,
    digits_requests,
    load_digits_frames,
    publish,
    publish_values,
)
from streamapp.codecs import encode_request
from streamapp.demo import offline_predictions
from streamapp.process import WorkerProcess
from streamapp.records import InferenceRequest, TensorPayload
from streamapp.settings import Settings

pytestmark = [pytest.mark.kafka]


@pytest.fixture(scope="module")
def digits() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    images, labels = load_digits_frames()
    return images, labels, offline_predictions(images)


def _until(n: int) -> object:
    return lambda o: len(o.results) + len(o.dead_letters) >= n


@pytest.mark.parametrize(
    ("codec", "worker_options"),
    [("json", {}), ("msgpack", {}), ("msgpack", {"intake": "faust"})],
    ids=["json", "msgpack", "msgpack-faust-intake"],  # intake=direct is the default
)
async def test_500_frames_from_8_devices_are_answered_in_device_order(
    kafka_broker: EmbeddedBroker,
    worker: WorkerProcess,
    worker_settings: Settings,
    digits: tuple[np.ndarray, np.ndarray, np.ndarray],
    codec: str,
) -> None:
    images, _, offline = digits
    requests = digits_requests(images, devices=8, indices=range(500))
    sent = await publish(
        kafka_broker.bootstrap_servers, worker_settings.request_topic, requests, codec=codec
    )
    out = await collect_outcomes(
        kafka_broker.bootstrap_servers, worker_settings.result_topic, worker_settings.dlq_topic,
        done=_until(500), timeout_s=60,
    )
    assert out.dead_letters == []
    assert len(out.results) == 500
    by_id = {s.request_id: s for s in sent}
    assert {r["request_id"] for r in out.results} == set(by_id)
    for r in out.results:
        s = by_id[r["request_id"]]
        assert int(r["outputs"]["top_k"][0]["label"]) == offline[s.index]
        assert (r["device_id"], r["seq"], r["attempt"]) == (s.device_id, s.seq, 0)
        assert r["engine"].startswith("onnxruntime-")
    seqs: dict[str, list[int]] = defaultdict(list)
    for r in out.results:  # topic order
        seqs[r["device_id"]].append(r["seq"])
    assert sorted(seqs) == [f"device-{d:02d}" for d in range(8)]
    for device, device_seqs in seqs.items():
        assert device_seqs == sorted(device_seqs), f"{device} out of order"
        assert device_seqs == list(range(len(device_seqs)))


def _good(images: np.ndarray, index: int, device: str, seq: int) -> InferenceRequest:
    image = images[index]
    return InferenceRequest(
        request_id=f"good-{index}", device_id=device, seq=seq, ts=1.0e9, model="digits",
        tensor=TensorPayload("uint8", (8, 8), image.tobytes()),
    )


def _bad_values(images: np.ndarray) -> dict[str, tuple[str, bytes]]:
    """Bad-input kind → (expected reason, record value)."""
    tensor = {"dtype": "uint8", "shape": [8, 8],
              "data": base64.b64encode(images[0].tobytes()).decode()}
    base = {"request_id": "bad", "device_id": "dev-bad", "seq": 0, "ts": 1.0e9,
            "model": "digits", "tensor": tensor}

    def js(**changes: object) -> bytes:
        body = {**base, **changes}
        return json.dumps({k: v for k, v in body.items() if v is not None}).encode()

    return {
        "not-json": ("invalid_json", b"{this is not json"),
        "not-msgpack": ("invalid_msgpack", b"\x85\xa3abc\xc1"),
        "missing-field": ("missing_field", js(request_id="bad-missing", model=None)),
        "unknown-model": ("unknown_model", js(request_id="bad-model", model="resnet-9000")),
        "wrong-dtype": ("bad_dtype", js(request_id="bad-dtype", tensor={
            **tensor, "dtype": "int32", "data": base64.b64encode(
                images[0].astype(np.int32).tobytes()).decode()})),
        "wrong-shape": ("bad_shape", js(request_id="bad-shape", tensor={
            **tensor, "shape": [64]})),
        "msgpack-wrong-shape": ("bad_shape", msgpack.packb({
            **base, "request_id": "bad-mp-shape",
            "tensor": {"dtype": "uint8", "shape": [4, 16], "data": images[0].tobytes()}})),
    }


async def test_each_bad_input_gets_one_dead_letter_and_good_frames_around_it_are_answered(
    kafka_broker: EmbeddedBroker,
    worker: WorkerProcess,
    worker_settings: Settings,
    digits: tuple[np.ndarray, np.ndarray, np.ndarray],
) -> None:
    images, _, offline = digits
    bad = _bad_values(images)
    records: list[tuple[bytes | None, bytes]] = []
    good_ids = {}
    seq = 0
    for i, (_, value) in enumerate(bad.values()):
        # the same device sends good frames before and after each bad one
        for index in (2 * i, 2 * i + 1):
            request = _good(images, index, "dev-bad", seq)
            seq += 1
            good_ids[request.request_id] = index
            records.append((b"dev-bad", encode_request(request, "json")))
            if index % 2 == 0:
                records.append((b"dev-bad", value))
    await publish_values(kafka_broker.bootstrap_servers, worker_settings.request_topic, records)
    out: Outcomes = await collect_outcomes(
        kafka_broker.bootstrap_servers, worker_settings.result_topic, worker_settings.dlq_topic,
        done=_until(len(records)), timeout_s=60,
    )
    assert {r["request_id"]: int(r["outputs"]["top_k"][0]["label"]) for r in out.results} == {
        rid: offline[index] for rid, index in good_ids.items()
    }
    assert [r["seq"] for r in out.results] == list(range(len(good_ids)))
    got = [(d.error["reason"], d.value) for d in out.dead_letters]
    assert sorted(got) == sorted(bad.values())  # exactly one each, original value untouched
    for letter in out.dead_letters:
        assert letter.key == b"dev-bad"
        assert letter.source["topic"] == worker_settings.request_topic
        assert letter.error["message"]
    # the worker kept serving: still ready, and nothing restarted it
    status, body = worker.get("/ready")
    assert status == 200 and body["ready"] is True


async def test_the_tables_changelogs_are_compacted_with_short_segments(
    kafka_broker: EmbeddedBroker, broker_kind: str, worker_settings: Settings,
    request: pytest.FixtureRequest,
) -> None:
    """Kafka compacts only closed segments: the worker creates its changelogs with
    ``segment.ms`` = ``changelog_segment_ms`` so that a restoring worker does not read every
    update ever made (Kafka's default segment lives 7 days)."""
    if broker_kind != "kafka":
        pytest.skip("the embedded broker keeps everything in memory and reports no topic configs")
    from aiokafka.admin import AIOKafkaAdminClient
    from aiokafka.admin.config_resource import ConfigResource, ConfigResourceType

    request.getfixturevalue("worker")  # a ready worker: it created its changelogs

    admin = AIOKafkaAdminClient(bootstrap_servers=kafka_broker.bootstrap_servers)
    await admin.start()
    try:
        names = [f"{worker_settings.app_id}-{table}-changelog"
                 for table in ("device_stats", "device_windows", "retry_counts")]
        responses = await admin.describe_configs(
            [ConfigResource(ConfigResourceType.TOPIC, name) for name in names])
    finally:
        await admin.close()
    configs = {
        resource[3]: {entry[0]: entry[1] for entry in resource[4]}
        for response in responses for resource in response.resources
    }
    assert set(configs) == set(names)
    for name in names:
        assert configs[name]["segment.ms"] == str(worker_settings.changelog_segment_ms), name
        assert configs[name]["cleanup.policy"] == "compact", name
