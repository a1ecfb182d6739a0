"""The supervisor's pure parts (GPU round-robin, child plan, backoff) and its process handling
with a stand-in child command (a tiny Python script, no broker)."""

from __future__ import annotations

import asyncio
import io
import json
import os
import signal
import sys
from pathlib import Path

import pytest

from streamapp.supervisor import (
    RestartPolicy,
    Supervisor,
    gpu_for,
    plan_children,
    read_state,
    visible_gpus,
)


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("0,1,2,3", ["0", "1", "2", "3"]),
        (" 2, 5 ", ["2", "5"]),
        ("GPU-6f3e,GPU-77aa", ["GPU-6f3e", "GPU-77aa"]),
        ("", []),  # set but empty: no GPU
        ("-1", []),
        ("0,-1,1", ["0"]),  # CUDA stops at the first invalid entry
    ],
)
def test_cuda_visible_devices_wins_over_the_gpu_count(value: str, expected: list[str]) -> None:
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": value}, count=lambda: 8) == expected


def test_without_the_variable_the_counted_gpus_are_used_and_none_means_cpu() -> None:
    assert visible_gpus({}, count=lambda: 3) == ["0", "1", "2"]
    assert visible_gpus({}, count=lambda: None) == []
    assert visible_gpus({}, count=lambda: 0) == []


def test_gpus_are_handed_out_round_robin() -> None:
    assert [gpu_for(i, ["0", "1", "2"]) for i in range(7)] == ["0", "1", "2", "0", "1", "2", "0"]
    assert [gpu_for(i, ["7"]) for i in range(3)] == ["7", "7", "7"]
    assert gpu_for(0, []) is None


def test_each_child_gets_its_own_dir_port_instance_id_and_gpu(tmp_path: Path) -> None:
    specs = plan_children(5, data_dir=tmp_path, web_port=7000, gpus=["0", "1"], host="h1")
    assert [s.data_dir for s in specs] == [tmp_path / f"worker-{i}" for i in range(5)]
    assert [s.web_port for s in specs] == [7000, 7001, 7002, 7003, 7004]
    assert [s.instance_id for s in specs] == [f"h1-{i}" for i in range(5)]
    assert [s.gpu for s in specs] == ["0", "1", "0", "1", "0"]
    env = specs[3].environment()
    assert env == {
        "STREAMAPP_DATA_DIR": str(tmp_path / "worker-3"), "STREAMAPP_WEB_PORT": "7003",
        "STREAMAPP_GROUP_INSTANCE_ID": "h1-3", "CUDA_VISIBLE_DEVICES": "1",
    }


def test_a_user_set_instance_id_and_name_get_the_index_and_no_gpu_leaves_the_env(
    tmp_path: Path,
) -> None:
    specs = plan_children(2, data_dir=tmp_path, web_port=6066, group_instance_id="pod-7",
                          worker_name="edge", gpus=[])
    assert [s.instance_id for s in specs] == ["pod-7-0", "pod-7-1"]
    env = specs[1].environment()
    assert env["STREAMAPP_WORKER_NAME"] == "edge-1"
    assert "CUDA_VISIBLE_DEVICES" not in env


def test_port_zero_picks_a_free_port_per_child_and_bad_counts_are_refused(tmp_path: Path) -> None:
    ports = iter([5001, 5002])
    specs = plan_children(2, data_dir=tmp_path, web_port=0, free_port=lambda: next(ports))
    assert [s.web_port for s in specs] == [5001, 5002]
    with pytest.raises(ValueError, match="at least 1"):
        plan_children(0, data_dir=tmp_path, web_port=6066)
    with pytest.raises(ValueError, match="65535"):
        plan_children(3, data_dir=tmp_path, web_port=65534)


def test_a_restarted_child_joins_without_a_static_instance_id(tmp_path: Path) -> None:
    (spec,) = plan_children(1, data_dir=tmp_path, web_port=6066, host="h")
    assert [spec.environment(r)["STREAMAPP_GROUP_INSTANCE_ID"] for r in range(3)] == [
        "h-0", "", ""]


def test_backoff_doubles_from_the_base_up_to_the_cap() -> None:
    policy = RestartPolicy(backoff_base_s=0.5, backoff_max_s=5.0)
    assert [policy.backoff_s(n) for n in range(7)] == [0.5, 0.5, 1.0, 2.0, 4.0, 5.0, 5.0]


# -- the process handling, with a stand-in child ------------------------------------------------

# A stand-in worker: writes its pid, then sleeps; on SIGTERM prints "drained" and exits 0 unless
# its data dir holds a "hang" file (then it ignores SIGTERM), or "crash" (exits 3 at once).
CHILD = r"""
import os, signal, sys, time
d = os.environ["STREAMAPP_DATA_DIR"]
os.makedirs(d, exist_ok=True)
if os.path.exists(os.path.join(d, "..", "crash")):
    sys.exit(3)
with open(os.path.join(d, "starts"), "a") as f:
    f.write(f"{os.getpid()} {os.environ['STREAMAPP_GROUP_INSTANCE_ID'] or '-'}\n")
def stop(*_):
    if os.path.exists(os.path.join(d, "hang")):
        return
    print("drained", flush=True)
    sys.exit(0)
signal.signal(signal.SIGTERM, stop)
print("up", flush=True)
while True:
    time.sleep(0.05)
"""


def _supervisor(tmp_path: Path, n: int, **kwargs: object) -> tuple[Supervisor, io.BytesIO]:
    out = io.BytesIO()
    specs = plan_children(n, data_dir=tmp_path, web_port=7100, host="h")
    sup = Supervisor(
        specs, environ=dict(os.environ), state_path=tmp_path / "supervisor.json",
        command=[sys.executable, "-c", CHILD], output=out, **kwargs,  # type: ignore[arg-type]
    )
    return sup, out


async def _until(predicate: object, timeout_s: float = 30.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not predicate():  # type: ignore[operator]
        assert asyncio.get_running_loop().time() < deadline, "condition not met in time"
        await asyncio.sleep(0.05)


def _starts(tmp_path: Path, i: int) -> list[list[str]]:
    path = tmp_path / f"worker-{i}" / "starts"
    return [line.split() for line in path.read_text().splitlines()] if path.exists() else []


async def test_a_killed_child_is_restarted_and_sigterm_stops_all_cleanly(tmp_path: Path) -> None:
    sup, out = _supervisor(tmp_path, 2, policy=RestartPolicy(backoff_base_s=0.1))
    task = asyncio.create_task(sup.run())
    await _until(lambda: len(_starts(tmp_path, 0)) == 1 and len(_starts(tmp_path, 1)) == 1)
    state = read_state(tmp_path)
    assert state is not None
    assert [c["web_port"] for c in state["children"]] == [7100, 7101]
    assert [c["url"] for c in state["children"]] == ["http://127.0.0.1:7100",
                                                     "http://127.0.0.1:7101"]
    first_pid = int(_starts(tmp_path, 1)[0][0])
    os.kill(first_pid, signal.SIGKILL)
    await _until(lambda: len(_starts(tmp_path, 1)) == 2)
    pid, instance = _starts(tmp_path, 1)[1]
    assert int(pid) != first_pid and instance == "-"  # dynamic membership after a restart
    await _until(lambda: (read_state(tmp_path) or {})["children"][1]["restarts"] == 1)
    os.kill(os.getpid(), signal.SIGTERM)  # what `kill <supervisor>` does
    assert await asyncio.wait_for(task, 30) == 0
    lines = out.getvalue().decode().splitlines()
    assert sorted(line for line in lines if "drained" in line) == ["[0] drained", "[1] drained"]
    final = read_state(tmp_path)
    assert final is not None
    assert [c["state"] for c in final["children"]] == ["stopped", "stopped"]
    assert [c["last_exit"] for c in final["children"]] == [0, 0]
    assert [c["restarts"] for c in final["children"]] == [0, 1]


async def test_a_child_that_ignores_sigterm_is_killed_and_the_exit_code_says_so(
    tmp_path: Path,
) -> None:
    sup, _ = _supervisor(tmp_path, 2, stop_timeout_s=1.0)
    task = asyncio.create_task(sup.run())
    await _until(lambda: len(_starts(tmp_path, 0)) == 1 and len(_starts(tmp_path, 1)) == 1)
    (tmp_path / "worker-1" / "hang").touch()
    sup.request_stop("test")
    assert await asyncio.wait_for(task, 30) == 1
    final = read_state(tmp_path)
    assert final is not None
    assert [c["state"] for c in final["children"]] == ["stopped", "failed"]
    assert final["children"][1]["last_exit"] == -signal.SIGKILL


async def test_a_crash_loop_stops_the_group_with_a_clear_message(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    (tmp_path / "crash").touch()
    policy = RestartPolicy(backoff_base_s=0.01, backoff_max_s=0.05, max_quick_crashes=3)
    sup, _ = _supervisor(tmp_path, 1, policy=policy)
    assert await asyncio.wait_for(sup.run(), 30) == 1
    final = read_state(tmp_path)
    assert final is not None
    assert final["children"][0]["state"] == "failed"
    assert final["children"][0]["restarts"] == 2  # started 3 times, crashed 3 times
    assert final["children"][0]["last_exit"] == 3
    (message,) = [r.getMessage() for r in caplog.records if "crash" in r.getMessage()
                  and "gave up" in r.getMessage()]
    assert "worker 0 crashed 3 times in a row" in message and "exit code 3" in message


def test_the_state_file_is_json_with_every_child(tmp_path: Path) -> None:
    sup, _ = _supervisor(tmp_path, 3)
    sup._write_state()
    state = json.loads((tmp_path / "supervisor.json").read_text())
    assert [c["index"] for c in state["children"]] == [0, 1, 2]
    assert [c["data_dir"] for c in state["children"]] == [
        str(tmp_path / f"worker-{i}") for i in range(3)]
    assert read_state(tmp_path / "nowhere") is None


@pytest.mark.parametrize("processes", [None, 2])
def test_a_worker_whose_web_port_is_taken_stops_with_one_clear_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, processes: int | None
) -> None:
    import socket

    from typer.testing import CliRunner

    from streamapp.cli import cli

    with socket.socket() as server:  # another worker's web server on the second port
        server.bind(("127.0.0.1", 0))
        server.listen()
        taken = server.getsockname()[1]
        first = taken - 1 if processes else taken
        monkeypatch.setenv("STREAMAPP_BROKER_KIND", "kafka")  # no broker probe
        args = ["worker", "--broker", "kafka://127.0.0.1:9", "--data-dir", str(tmp_path),
                "--web-port", str(first)]
        result = CliRunner().invoke(cli, args + (["--processes", "2"] if processes else []))
    assert result.exit_code == 1, result.output
    assert f"web port {taken} on 127.0.0.1 is already in use" in result.output
    assert "Traceback" not in result.output
