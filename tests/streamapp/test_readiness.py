"""The readiness checks that ask the broker and watch progress (issue 19, item 3).

A broker process stopped with SIGSTOP still completes TCP handshakes (the kernel does), so the
stand-in for it here is a server that accepts connections and never answers.
"""

from __future__ import annotations

import asyncio
import socket
import struct
import time
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest

from streamapp.readiness import ProgressWatch, probe_kafka

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


async def _silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        await reader.read()  # accepts, reads, never answers: what a frozen broker looks like
    finally:
        writer.close()


async def _answers_api_versions(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    size = struct.unpack(">i", await reader.readexactly(4))[0]
    request = await reader.readexactly(size)
    api_key, version, correlation_id = struct.unpack(">hhi", request[:8])
    assert (api_key, version) == (18, 0)
    body = struct.pack(">hi", 0, 0)  # error_code 0, no API keys listed
    writer.write(struct.pack(">ii", 4 + len(body), correlation_id) + body)
    await writer.drain()
    writer.close()


async def _answers_garbage(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    await reader.read(1)
    writer.write(b"HTTP/1.1 400 Bad Request\r\n\r\n")
    await writer.drain()
    writer.close()


@pytest.fixture
async def serve() -> AsyncIterator[Callable[[Handler], Awaitable[str]]]:
    servers: list[asyncio.Server] = []

    async def start(handler: Handler) -> str:
        server = await asyncio.start_server(handler, "127.0.0.1", 0)
        servers.append(server)
        return f"127.0.0.1:{server.sockets[0].getsockname()[1]}"

    yield start
    for server in servers:
        server.close()
        await server.wait_closed()


def _closed_port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


async def test_a_broker_that_accepts_but_never_answers_is_not_responsive(
    serve: Callable[[Handler], Awaitable[str]],
) -> None:
    server = await serve(_silent)
    began = time.monotonic()

    problem = await probe_kafka(server, timeout_s=0.3)

    assert problem == f"{server} did not answer a Kafka ApiVersions request within 0.3 s"
    assert time.monotonic() - began < 2.0


async def test_a_broker_answering_api_versions_is_responsive(
    serve: Callable[[Handler], Awaitable[str]],
) -> None:
    assert await probe_kafka(await serve(_answers_api_versions), timeout_s=1.0) is None


async def test_one_answering_bootstrap_server_is_enough(
    serve: Callable[[Handler], Awaitable[str]],
) -> None:
    servers = f"{await serve(_silent)},{await serve(_answers_api_versions)},{_closed_port()}"

    assert await probe_kafka(servers, timeout_s=0.3) is None


async def test_every_server_failing_says_why_for_each(
    serve: Callable[[Handler], Awaitable[str]],
) -> None:
    frozen, closed, other = await serve(_silent), _closed_port(), await serve(_answers_garbage)

    problem = await probe_kafka(f"{frozen},{closed},{other}", timeout_s=0.3)

    assert problem is not None
    first, second, third = problem.split("; ")
    assert first == f"{frozen} did not answer a Kafka ApiVersions request within 0.3 s"
    assert second == f"{closed} refused the connection (no broker listens there)"
    assert third.startswith(f"{other} answered, but not as a Kafka broker")


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_no_progress_while_records_wait_is_a_stall_after_stall_s() -> None:
    clock = Clock()
    watch = ProgressWatch(stall_s=15.0, clock=clock)

    assert watch.observe(("read", 10), waiting=50) is None
    clock.now += 15.0
    assert watch.observe(("read", 10), waiting=50) is None  # not more than 15 s yet
    clock.now += 1.0
    assert watch.observe(("read", 10), waiting=50) == 16.0
    # any progress (a record read, a commit, a fetch) starts the count again
    assert watch.observe(("read", 11), waiting=49) is None
    clock.now += 10.0
    assert watch.observe(("read", 11), waiting=49) is None


def test_an_idle_worker_with_nothing_waiting_never_stalls() -> None:
    clock = Clock()
    watch = ProgressWatch(stall_s=15.0, clock=clock)

    for _ in range(5):
        assert watch.observe(("read", 10), waiting=0) is None
        clock.now += 60.0
    # records start to wait now: the count starts now, not at the last progress
    assert watch.observe(("read", 10), waiting=3) is None
    clock.now += 16.0
    assert watch.observe(("read", 10), waiting=3) == 16.0


def test_stall_s_zero_never_reports_a_stall() -> None:
    clock = Clock()
    watch = ProgressWatch(stall_s=0.0, clock=clock)

    watch.observe("same", waiting=10)
    clock.now += 3600.0
    assert watch.observe("same", waiting=10) is None


def test_an_unreachable_gpu_server_says_why_in_problems() -> None:
    """``/ready``'s ``problems`` names the executor server that is down and the wait; a
    reachable one adds nothing."""
    from types import SimpleNamespace

    from streamapp.settings import Settings
    from streamapp.state import WorkerState

    down = SimpleNamespace(executor=SimpleNamespace(connected=False, path="/tmp/g.sock"))
    up = SimpleNamespace(executor=SimpleNamespace(connected=True, path="/tmp/h.sock"))
    state = SimpleNamespace(
        runtime=SimpleNamespace(ready=True, models={"digits": down, "other": up}),
        settings=Settings(gpu_executor="shared", gpu_server_wait_s=45))
    problems = WorkerState.readiness_problems(state, {"gpu_server_reachable": False})  # type: ignore[arg-type]
    assert list(problems) == ["gpu_server_reachable"]
    assert problems["gpu_server_reachable"].startswith(
        "the executor server at /tmp/g.sock is not reachable")
    assert "gpu_server_wait_s (45 s)" in problems["gpu_server_reachable"]
    assert WorkerState.readiness_problems(state, {"gpu_server_reachable": True}) == {}  # type: ignore[arg-type]


def test_a_worker_without_partitions_says_why_after_a_minute() -> None:
    """A worker that got no partition: ``/ready``'s ``problems`` says why only once
    UNASSIGNED_WARN_S passed (a group forming takes seconds), and names the embedded broker's
    stuck group (a new-user trial, 2026-12-03: 3 of 4 restarts after `--processes 2`)."""
    from types import SimpleNamespace

    from streamapp.settings import Settings
    from streamapp.state import UNASSIGNED_WARN_S, WorkerState

    partitions: list[tuple[str, int]] = []
    state = SimpleNamespace(started=100.0, settings=Settings(topic_prefix="cams."),
                            assigned=lambda: partitions)
    problem = WorkerState.unassigned_problem

    assert problem(state, now=100.0 + UNASSIGNED_WARN_S - 1) is None  # type: ignore[arg-type]
    text = problem(state, now=100.0 + UNASSIGNED_WARN_S + 5)  # type: ignore[arg-type]
    assert text is not None and text.startswith(
        "no partition of cams.inference-request assigned 65 s after")
    assert "restart `streamapp broker` or give the workers a new --app-id" in text
    partitions.append(("cams.inference-request", 0))
    assert problem(state, now=100.0 + 3600) is None  # type: ignore[arg-type]
