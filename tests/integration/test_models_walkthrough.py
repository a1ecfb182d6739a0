"""docs/models.md, followed as a user would: its blocks marked ``<!-- walkthrough: NAME -->`` are
run as written — the export script makes a second model (a scikit-learn classifier as ONNX),
the metadata goes into a repository, ``streamapp models check`` prints what the page shows, a
worker started with the page's flags answers the page's ``publish`` with the labels the model
gives offline, and an image request is answered once the page's ``image`` section is added.

The one liberty taken: the page's image section is applied before the worker starts (the page
restarts the worker after it), which saves a worker start.
"""

from __future__ import annotations

import asyncio
import hashlib
import io
import json
import re
import runpy
import shlex
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort
import pytest
from PIL import Image
from typer.testing import CliRunner

from engines.cli import app as engines_app
from streamapp.cli import cli
from streamapp.client import collect_outcomes
from streamapp.client import publish as publish_requests
from streamapp.process import WorkerProcess
from streamapp.records import InferenceRequest
from streamapp.results import RESULT_HEADER
from tests.conftest import Broker

pytestmark = [pytest.mark.kafka]

PAGE = Path(__file__).resolve().parents[2] / "docs" / "models.md"
_BLOCK = re.compile(r"<!-- walkthrough: ([\w-]+) -->\n```\w*\n(.*?)```", re.S)


def page_blocks() -> dict[str, str]:
    """Walk-through name → the text of its fenced block."""
    return dict(_BLOCK.findall(PAGE.read_text()))


def console(block: str) -> tuple[list[str], list[str]]:
    """``$ streamapp ARGS`` and its output lines → (ARGS, lines)."""
    first, *lines = block.rstrip("\n").splitlines()
    assert first.startswith("$ streamapp "), first
    return shlex.split(first.removeprefix("$ streamapp ")), lines


def same_output(got: str, want: list[str]) -> None:
    """``got`` is the page's output but for the backend's version and the model's hash (they
    change with ONNX Runtime and scikit-learn releases)."""
    def norm(text: str) -> str:
        return re.sub(r"onnxruntime-[\w.]+:[0-9a-f]{8}", "onnxruntime-V:HASH", text)

    assert norm(got).splitlines() == [norm(line) for line in want]


def session_hash(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_the_page_has_each_step() -> None:
    assert set(page_blocks()) == {"export", "inspect", "metadata", "check",
                                  "check-wrong-input", "serve", "tail", "image", "check-image"}


async def test_the_models_page_from_an_onnx_file_to_answers(
    kafka_broker: Broker, app_id: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    blocks = page_blocks()
    monkeypatch.chdir(tmp_path)
    env = {"STREAMAPP_APP_ID": app_id, "STREAMAPP_TOPIC_PREFIX": f"{app_id}.",
           "STREAMAPP_TOPIC_PARTITIONS": "4"}
    runner = CliRunner()

    # 1. the export script, as written
    script = tmp_path / "export.py"
    script.write_text(blocks["export"])
    namespace = runpy.run_path(str(script))
    onnx_file = tmp_path / "models" / "digits-logreg" / "model.onnx"
    assert onnx_file.is_file()
    # engines inspect ends with the IO tensors the page shows (after its "...")
    first, *shown = blocks["inspect"].rstrip("\n").splitlines()
    assert first.startswith("$ engines ") and shown[0] == "..."
    out = runner.invoke(engines_app, shlex.split(first.removeprefix("$ engines ")))
    assert out.exit_code == 0, out.output
    assert out.stdout.splitlines()[-len(shown) + 1:] == shown[1:]

    # 3. the smallest metadata.json
    folder = onnx_file.parent
    (folder / "metadata.json").write_text(blocks["metadata"])

    # 4. the check prints what the page shows; a wrong input name is the page's one line
    args, want = console(blocks["check"])
    out = runner.invoke(cli, args, env=env)
    assert out.exit_code == 0, out.output
    same_output(out.stdout, want)
    meta = json.loads(blocks["metadata"])
    wrong = {**meta, "input": {**meta["input"], "name": "input"}}
    (folder / "metadata.json").write_text(json.dumps(wrong))
    args, want = console(blocks["check-wrong-input"])
    out = runner.invoke(cli, args, env=env)
    assert out.exit_code == 1 and out.stdout == ""
    assert out.stderr.splitlines() == want

    # 6. the image section merged into the metadata, checked again
    image_part = json.loads(blocks["image"])
    (folder / "metadata.json").write_text(json.dumps({**meta, **image_part}))
    args, want = console(blocks["check-image"])
    out = runner.invoke(cli, args, env=env)
    assert out.exit_code == 0, out.output
    same_output(out.stdout, want)

    # 5. serve: the page's commands, the session broker standing in for `streamapp broker`
    commands = [shlex.split(line.split("#")[0]) for line in blocks["serve"].splitlines()]
    assert [c[:2] for c in commands] == [["streamapp", "broker"], ["streamapp", "worker"],
                                         ["streamapp", "publish"], ["streamapp", "results"]]

    def ours(command: list[str]) -> list[str]:
        return [a.replace("kafka://127.0.0.1:PORT", kafka_broker.url) for a in command[1:]]

    worker = WorkerProcess(
        {"app_id": app_id, "topic_prefix": f"{app_id}.", "topic_partitions": 4,
         "data_dir": tmp_path / "data", "backend": "onnxruntime"},
        log_path=tmp_path / "worker.log", cwd=tmp_path, args=tuple(ours(commands[1])[1:]),
    )
    with worker:
        worker.wait_ready()
        out = await asyncio.to_thread(runner.invoke, cli, ours(commands[2]), env=env)
        assert out.exit_code == 0, out.output
        publish_args = ours(commands[2])
        devices = int(publish_args[publish_args.index("--devices") + 1])
        count = int(publish_args[publish_args.index("--count") + 1])

        # an image request: a digit as the PNG a camera would send (light ink on black)
        X, _ = namespace["X"], namespace["y"]
        pixels = np.round(X[7].reshape(8, 8) * 255 / 16).astype(np.uint8)
        png = io.BytesIO()
        Image.fromarray(pixels, mode="L").save(png, format="PNG")
        image_request = InferenceRequest(f"{app_id}-image", "camera-1", 0, 0.0, "digits-logreg",
                                         image=png.getvalue())
        await publish_requests(kafka_broker.bootstrap_servers, f"{app_id}.inference-request",
                               [(7, image_request)], partitions=4)

        outcomes = await collect_outcomes(
            kafka_broker.bootstrap_servers, f"{app_id}.inference-result",
            f"{app_id}.inference-dlq", done=lambda o: len(o.results) >= count + 1,
            timeout_s=60,
        )
        assert outcomes.dead_letters == []
        tail = await asyncio.to_thread(runner.invoke, cli, ours(commands[3]), env=env)
        assert tail.exit_code == 0, tail.output

    # the answers are the model's own: ONNX Runtime on the exported file, offline
    session = ort.InferenceSession(str(onnx_file), providers=["CPUExecutionProvider"])
    label, _ = session.run(None, {"X": X[: count].astype(np.float32)})
    offline = {f"device-{n % devices:02d}": {} for n in range(count)}  # device → seq → label
    for n in range(count):
        offline[f"device-{n % devices:02d}"][n // devices] = str(label[n])
    by_device: dict[str, Any] = {}
    for result in outcomes.results:
        assert result["model"] == "digits-logreg"
        by_device.setdefault(result["device_id"], {})[result["seq"]] = (
            result["outputs"]["top_k"][0]["label"])
    image_answer = by_device.pop("camera-1")
    assert by_device == offline
    (image_label,) = session.run(["label"], {"X": X[7:8].astype(np.float32)})[0]
    assert image_answer == {0: str(image_label)}

    # results tail: the page's -n 5 lines, each a digits-logreg answer the model gives, in the
    # columns of the page's sample
    lines = tail.stdout.splitlines()
    sample = blocks["tail"].splitlines()
    assert lines[0] == sample[0] == RESULT_HEADER and len(lines) == len(sample) == 1 + 5
    for line, shown in zip(lines[1:], sample[1:], strict=True):
        device, seq, model, version, engine, top, _score, _e2e = line.split()
        assert model == "digits-logreg" == shown.split()[2]
        assert version == "v1" == shown.split()[3]  # the flat folder is version 1
        assert engine.endswith(":" + session_hash(onnx_file)[:8]) and len(line) == len(shown)
        assert top == (image_answer[0] if device == "camera-1" else offline[device][int(seq)])
