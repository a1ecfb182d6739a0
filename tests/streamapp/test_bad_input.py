"""Every kind of bad input, as raw Kafka records, gets its own reason code.

:func:`bad_input_records` is a catalogue of ``(kind, expected reason, key, value)`` records: one
or more per reason that a record's key and value alone decide. Each goes through what the
pipeline does before batching — :func:`~streamapp.codecs.decode_request`,
:func:`~streamapp.codecs.check_key`, the model lookup, :meth:`ModelConfig.preprocess` — and must
be refused with its reason. Integration tests can publish the same records to a worker.
"""

from __future__ import annotations

import base64
import io
import json
import time
from pathlib import Path

import pytest
from PIL import Image

from streamapp.codecs import REASONS, check_key, decode_request
from streamapp.exceptions import InvalidRequestError
from streamapp.models import BUNDLED_MODELS_DIR, ModelConfig, ModelRepository
from tests.bad_inputs import BadInput, bad_input_records

#: Reasons decided by the pipeline or the engine, not by one record's key and value.
NOT_FROM_ONE_RECORD = {
    "duplicate_request_id",
    "inference_failed",
    "retries_exhausted",
    "invalid_retry_record",
    "unproducible_outcome",
    "undecodable_record_batch",  # the batch's bytes, not a record's (test_record_batches.py)
    "internal_error",
}


def reason_of(record: BadInput, models: dict[str, ModelConfig]) -> str | None:
    """The reason the pipeline's checks refuse ``record`` with, or None if accepted."""
    try:
        request = decode_request(record.value, max_request_bytes=1 << 20)
        check_key(record.key, request)
        if request.model not in models:
            return "unknown_model"
        # a worker that loaded only the current version (the pipeline's check)
        if request.model_version not in (None, models[request.model].version):
            return "unknown_model_version"
        models[request.model].preprocess(request)
    except InvalidRequestError as exc:
        return exc.reason
    return None


@pytest.fixture(scope="module")
def models() -> dict[str, ModelConfig]:
    return {"digits": ModelRepository().get("digits")}


RECORDS = bad_input_records()


@pytest.mark.parametrize("record", RECORDS, ids=[r.kind for r in RECORDS])
def test_each_bad_input_gets_its_reason(record: BadInput, models: dict[str, ModelConfig]) -> None:
    assert record.reason in REASONS
    assert reason_of(record, models) == record.reason


def test_good_record_passes_every_check(models: dict[str, ModelConfig]) -> None:
    body = json.loads(RECORDS[4].value)  # a complete request but for seq's type
    body["seq"] = 7
    good = BadInput("good", "", b"dev-bad", json.dumps(body).encode())

    assert reason_of(good, models) is None


def test_unsupported_input(tmp_path: Path) -> None:
    meta = json.loads((BUNDLED_MODELS_DIR / "digits" / "metadata.json").read_text())
    del meta["image"]
    (tmp_path / "digits").mkdir()
    (tmp_path / "digits" / "metadata.json").write_text(json.dumps(meta))
    png = io.BytesIO()
    Image.new("L", (8, 8)).save(png, format="PNG")
    body = {"request_id": "r", "device_id": "d", "seq": 0, "ts": time.time(), "model": "digits",
            "image": base64.b64encode(png.getvalue()).decode()}
    record = BadInput("image-for-tensor-model", "unsupported_input", b"d",
                      json.dumps(body).encode())

    assert reason_of(record, {"digits": ModelRepository(tmp_path).get("digits")}) == (
        "unsupported_input"
    )


def test_catalogue_covers_every_reason_one_record_can_have() -> None:
    covered = {r.reason for r in RECORDS} | {"unsupported_input"}  # see test_unsupported_input

    assert covered == set(REASONS) - NOT_FROM_ONE_RECORD
    assert len(set(REASONS)) >= 12 + len(NOT_FROM_ONE_RECORD)
