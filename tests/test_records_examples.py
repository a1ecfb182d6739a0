"""The "From any Kafka client" examples of docs/records.md build the record streamapp's own
encoder builds: run as printed, with stand-ins for confluent-kafka's Producer and for kcat that
keep what they were given (neither is a dependency; the worker tests cover the decoding)."""

from __future__ import annotations

import io
import os
import re
import subprocess
import sys
import time
import types
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from PIL import Image

from streamapp.codecs import decode_request, encode_request, tensor_to_array

ROOT = Path(__file__).resolve().parent.parent


def block(language: str) -> str:
    section = (ROOT / "docs" / "records.md").read_text().split("## From any Kafka client", 1)[1]
    match = re.search(rf"```{language}\n(.*?)```", section.split("\n## ", 1)[0], re.S)
    assert match is not None, f"no {language} block in the section"
    return match.group(1)


class _Producer:
    """confluent_kafka.Producer as far as the example uses it."""

    made: list[_Producer] = []

    def __init__(self, config: dict[str, Any]) -> None:
        self.config, self.flushed = config, False
        self.records: list[tuple[str, bytes, bytes]] = []
        _Producer.made.append(self)

    def produce(self, topic: str, key: bytes, value: bytes) -> None:
        self.records.append((topic, key, value))

    def flush(self, timeout: float) -> int:
        self.flushed = True
        return 0


@pytest.mark.parametrize("dtype", ["uint8", ">f4"])
def test_the_confluent_kafka_example_builds_our_encoders_bytes(
    dtype: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    frame = (np.arange(64).reshape(8, 8) % 17).astype(dtype)
    np.save(tmp_path / "frame.npy", frame)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setitem(sys.modules, "confluent_kafka",
                        types.SimpleNamespace(Producer=_Producer))
    _Producer.made.clear()

    exec(compile(block("python"), "docs/records.md", "exec"), {})

    (producer,) = _Producer.made
    assert producer.config == {"bootstrap.servers": "127.0.0.1:PORT", "acks": "all"}
    assert producer.flushed
    ((topic, key, value),) = producer.records
    request = decode_request(value)
    assert (topic, key, request.device_id, request.model) == (
        "inference-request", b"cam17", "cam17", "digits")
    assert encode_request(request, "json") == value
    assert request.tensor is not None
    np.testing.assert_array_equal(tensor_to_array(request.tensor), frame)


def test_the_kcat_example_sends_the_key_and_the_jpeg(tmp_path: Path) -> None:
    jpeg = io.BytesIO()
    Image.new("L", (32, 32), 180).save(jpeg, "JPEG")
    (tmp_path / "frame.jpg").write_bytes(jpeg.getvalue())
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    kcat = bin_dir / "kcat"
    kcat.write_text('#!/bin/sh\necho "$*" >> args.txt\n'
                    'case "$1" in -P) cat >> produced.txt ;; esac\n')
    kcat.chmod(0o755)

    subprocess.run(["bash", "-euo", "pipefail", "-c", block("bash")], cwd=tmp_path, check=True,
                   env={**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"}, timeout=30)

    args = (tmp_path / "args.txt").read_text().splitlines()
    assert args == [
        "-P -b 127.0.0.1:PORT -t inference-request -K | -X acks=all",
        "-C -b 127.0.0.1:PORT -t inference-result -o -1 -e",
    ]
    (line,) = (tmp_path / "produced.txt").read_bytes().splitlines()
    key, value = line.split(b"|", 1)
    request = decode_request(value)
    assert key == request.device_id.encode() == b"cam17"
    assert request.image == jpeg.getvalue() and request.tensor is None
    assert abs(request.ts - time.time()) < 60 and request.request_id.startswith("cam17-")
