"""``streamapp worker --processes N``: N worker processes of one group on this host.

Each child is an ordinary ``streamapp worker`` with its own data directory
(``<data_dir>/worker-<i>``), web port (``web_port + i``), static group instance id
(``<host>-<i>``, or ``<group_instance_id>-<i>`` when one is set) and GPU (round-robin over the
visible GPUs through ``CUDA_VISIBLE_DEVICES``; none visible: CPU). A child that exits on its own
is restarted after an exponential backoff; one that keeps crashing soon after its start stops the
whole group with a clear message (crash-loop limit). SIGTERM or SIGINT to the parent is passed to
every child as SIGTERM; each drains and commits (Faust's clean shutdown), and the parent exits 0
when all have stopped, 1 when one failed to stop in time (it is then SIGKILLed) or exited
non-zero. The parent writes ``<data_dir>/supervisor.json`` (children, pids, ports, restarts),
which ``streamapp status`` reads.

Why our own and not a library (evaluated for: in-process use from asyncio, restart with
exponential backoff, signal forwarding with a drain timeout, Python 3.11, maintained):

- circus (0.19, 2025): a separate arbiter daemon driven over ZeroMQ, restart counts but a fixed
  ``retry_in`` delay rather than exponential backoff; it would add pyzmq/tornado and a second
  control plane for what is ~150 lines here.
- supervisor (supervisord): a daemon with an INI config, not usable in-process, no per-child
  environment computed at start (GPU, instance id after a restart).
- honcho: runs a Procfile and stops everything when one process exits; no restarts.
- multiprocess / multiprocessing pools: task pools, not long-lived supervised processes with
  their own sessions and signal handling.

So this module is a small supervisor on ``asyncio`` subprocesses; Faust inside each child does
the hard part (drain, commit, leave the group).

Static membership after a restart (docs/scaling.md, "Restarts and static membership"): a child
starts with its static instance id, and a restarted child joins with dynamic membership (no
instance id). On the embedded broker (Tansu 0.6) a static member that rejoins before its old
session expired gets the old member id back and, when its metadata changed (a restarted Faust
worker's always does: it carries the member's assignment), a rebalance starts without a new
generation, so the other members never rejoin and the restarted one loops on JoinGroup without
partitions (``scripts/repro_static_rejoin.py``); a restart under a new static id stalls instead
when the dead member was the group leader, because Tansu evicts expired members only while
handling requests of dynamic members. A dynamic restart is a new member on every broker, and
its requests let Tansu evict the dead static member once its session has expired.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from streamapp.tasks import wait_event

__all__ = [
    "STATE_NAME",
    "ChildSpec",
    "RestartPolicy",
    "ServerSpec",
    "Supervisor",
    "gpu_for",
    "plan_children",
    "plan_servers",
    "read_state",
    "run_supervisor",
    "server_for",
    "visible_gpus",
]

log = logging.getLogger("streamapp.supervisor")

#: The file in the base data directory that lists the children (read by ``streamapp status``).
STATE_NAME = "supervisor.json"


# -- GPUs ------------------------------------------------------------------------------------


def _parse_cuda_visible_devices(value: str) -> list[str]:
    """The entries of ``CUDA_VISIBLE_DEVICES`` as CUDA reads them: comma-separated indices or
    UUIDs (``GPU-...``, ``MIG-...``), cut at the first empty or negative entry ("-1" hides all)."""
    out: list[str] = []
    for entry in value.split(","):
        entry = entry.strip()
        if not entry or entry.startswith("-"):
            break
        out.append(entry)
    return out


def _nvml_count() -> int | None:
    try:
        import pynvml  # nvidia-ml-py, optional (extras gpu/bench)
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
        try:
            return int(pynvml.nvmlDeviceGetCount())
        finally:
            pynvml.nvmlShutdown()
    except pynvml.NVMLError:
        return None


def _nvidia_smi_count() -> int | None:
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    try:
        out = subprocess.run([exe, "-L"], capture_output=True, text=True, timeout=10, check=True)
    except (OSError, subprocess.SubprocessError):
        return None
    return sum(1 for line in out.stdout.splitlines() if line.startswith("GPU "))


def visible_gpus(
    environ: Mapping[str, str] | None = None,
    *,
    count: Callable[[], int | None] | None = None,
) -> list[str]:
    """The GPUs this host's workers may use, as ``CUDA_VISIBLE_DEVICES`` entries.

    ``CUDA_VISIBLE_DEVICES`` wins when set (also when empty: no GPU); otherwise the GPUs NVML
    counts (``nvidia-ml-py`` when installed), then ``nvidia-smi -L``; none found: ``[]`` (CPU).
    Never imports torch or CUDA.

    Args:
        environ: The environment (default ``os.environ``).
        count: How to count GPUs when the variable is unset (tests); default NVML, then
            ``nvidia-smi``.

    Returns:
        Entries such as ``["0", "1"]`` or ``["GPU-6f3e..."]``.
    """
    environ = os.environ if environ is None else environ
    if "CUDA_VISIBLE_DEVICES" in environ:
        return _parse_cuda_visible_devices(environ["CUDA_VISIBLE_DEVICES"])
    if count is None:
        n = _nvml_count()
        n = _nvidia_smi_count() if n is None else n
    else:
        n = count()
    return [str(i) for i in range(n or 0)]


def gpu_for(index: int, gpus: Sequence[str]) -> str | None:
    """The GPU of child ``index``: round-robin over ``gpus``; None when there is none (CPU)."""
    return gpus[index % len(gpus)] if gpus else None


# -- children --------------------------------------------------------------------------------


@dataclass(frozen=True)
class ChildSpec:
    """What makes child ``index`` different from its siblings.

    Attributes:
        index: 0 … N-1.
        data_dir: Its own data directory (RocksDB tables, lock).
        web_port: Its web server port (``/ready``, ``/metrics``).
        instance_id: Its static group instance id at the first start.
        gpu: Its ``CUDA_VISIBLE_DEVICES`` entry, or None (inherit: CPU or what the user set).
        worker_name: Name put in its results, or None (default host:pid).
    """

    index: int
    data_dir: Path
    web_port: int
    instance_id: str
    gpu: str | None = None
    worker_name: str | None = None

    def instance_id_after(self, restarts: int) -> str:
        """The group instance id at the ``restarts``-th restart: the static id at the first
        start, empty (dynamic membership) after a restart (see the module docstring)."""
        return self.instance_id if restarts == 0 else ""

    def environment(self, restarts: int = 0) -> dict[str, str]:
        """The ``STREAMAPP_*`` (and ``CUDA_VISIBLE_DEVICES``) variables of this child."""
        env = {
            "STREAMAPP_DATA_DIR": str(self.data_dir),
            "STREAMAPP_WEB_PORT": str(self.web_port),
            # empty: dynamic membership (a restarted child, see the module docstring)
            "STREAMAPP_GROUP_INSTANCE_ID": self.instance_id_after(restarts),
        }
        if self.gpu is not None:
            env["CUDA_VISIBLE_DEVICES"] = self.gpu
        if self.worker_name is not None:
            env["STREAMAPP_WORKER_NAME"] = self.worker_name
        return env


@dataclass(frozen=True)
class ServerSpec:
    """The executor server of one GPU (``gpu_executor=shared``; :mod:`streamapp.gpu_server`).

    Attributes:
        index: 0 … one less than the number of GPUs (one server when there is none: CPU).
        gpu: Its ``CUDA_VISIBLE_DEVICES`` entry, or None (CPU, or what the user set).
        socket: Its Unix socket; the workers on its GPU connect there.
    """

    index: int
    gpu: str | None
    socket: str

    def environment(self) -> dict[str, str]:
        env = {"STREAMAPP_GPU_SERVER_SOCKET": self.socket}
        if self.gpu is not None:
            env["CUDA_VISIBLE_DEVICES"] = self.gpu
        return env


def plan_servers(gpus: Sequence[str], folder: Path) -> list[ServerSpec]:
    """One executor server per visible GPU (one for the CPU when none), sockets in
    ``folder``."""
    return [ServerSpec(i, gpu, str(folder / f"gpu-{i}.sock"))
            for i, gpu in enumerate(gpus or [None])]  # type: ignore[list-item]


def server_for(child: ChildSpec, servers: Sequence[ServerSpec]) -> ServerSpec:
    """The server on ``child``'s GPU (the first one when it has none)."""
    return next((s for s in servers if s.gpu == child.gpu), servers[0])


def plan_children(
    n: int,
    *,
    data_dir: Path,
    web_port: int,
    group_instance_id: str = "",
    worker_name: str = "",
    gpus: Sequence[str] = (),
    host: str | None = None,
    free_port: Callable[[], int] | None = None,
    static_ids: bool = True,
) -> list[ChildSpec]:
    """The N children: ``data_dir/worker-<i>``, port ``web_port + i`` (a free port each when
    ``web_port`` is 0), instance id ``<group_instance_id or host>-<i>`` (none when
    ``static_ids`` is False: dynamic membership), GPU round-robin.

    Raises:
        ValueError: ``n`` < 1, or ``web_port + n - 1`` is beyond 65535.
    """
    if n < 1:
        raise ValueError(f"--processes must be at least 1, got {n}")
    if web_port and web_port + n - 1 > 65535:
        raise ValueError(
            f"web ports {web_port}…{web_port + n - 1} go beyond 65535; lower --web-port"
        )
    if web_port == 0 and free_port is None:
        from streamapp.children import free_ports

        # picked together, so that two children cannot be handed the same port
        picked = iter(free_ports(n))
        free_port = picked.__next__
    prefix = group_instance_id or (host or socket.gethostname())
    return [
        ChildSpec(
            index=i,
            data_dir=Path(data_dir) / f"worker-{i}",
            web_port=web_port + i if web_port else free_port(),  # type: ignore[misc]
            instance_id=f"{prefix}-{i}" if static_ids else "",
            gpu=gpu_for(i, gpus),
            worker_name=f"{worker_name}-{i}" if worker_name else None,
        )
        for i in range(n)
    ]


@dataclass(frozen=True)
class RestartPolicy:
    """When a child that exited on its own is started again.

    Attributes:
        backoff_base_s: Delay before the first restart (s); doubles with each quick crash.
        backoff_max_s: Longest delay (s).
        stable_after_s: A child that ran this long before exiting counts as healthy: its next
            restart waits ``backoff_base_s`` again and its crash count is reset (s).
        max_quick_crashes: Crashes in a row, each within ``stable_after_s`` of the start, after
            which the supervisor gives up (crash loop) and stops every child.
    """

    backoff_base_s: float = 1.0
    backoff_max_s: float = 30.0
    stable_after_s: float = 60.0
    max_quick_crashes: int = 5

    def backoff_s(self, quick_crashes: int) -> float:
        """Delay before the restart that follows ``quick_crashes`` quick crashes in a row
        (0 or 1: ``backoff_base_s``; then doubling, capped at ``backoff_max_s``)."""
        return min(self.backoff_max_s, self.backoff_base_s * 2 ** max(0, quick_crashes - 1))


@dataclass
class _Child:
    spec: ChildSpec
    state: str = "starting"  # starting | running | backoff | stopping | stopped | failed
    pid: int | None = None
    restarts: int = 0
    quick_crashes: int = 0
    last_exit: int | None = None
    started_at: float | None = None
    killed: bool = False  # SIGKILLed after the stop timeout
    process: asyncio.subprocess.Process | None = field(default=None, repr=False)


@dataclass
class _Server:
    spec: ServerSpec
    state: str = "starting"  # starting | ready | backoff | stopping | stopped | failed
    pid: int | None = None
    restarts: int = 0
    quick_crashes: int = 0
    last_exit: int | None = None
    ready: asyncio.Event = field(default_factory=asyncio.Event, repr=False)
    process: asyncio.subprocess.Process | None = field(default=None, repr=False)


def describe_exit(rc: int) -> str:
    if rc < 0:
        with contextlib.suppress(ValueError):
            return f"signal {signal.Signals(-rc).name}"
    return f"exit code {rc}"


def _die_with_parent() -> None:
    """In the child before exec: get SIGTERM when the supervisor dies (Linux prctl
    PR_SET_PDEATHSIG), so a SIGKILLed supervisor leaves no orphan workers."""
    if sys.platform.startswith("linux"):
        import ctypes

        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)


class Supervisor:
    """Runs and watches the children until SIGTERM/SIGINT (see the module docstring).

    Args:
        specs: The children (:func:`plan_children`).
        environ: The environment every child starts from (the parent's, plus the settings
            given as flags, as ``STREAMAPP_*``); each child's own variables are added.
        state_path: Where the children are listed for ``streamapp status`` (JSON).
        policy: Restart backoff and crash-loop limit.
        stop_timeout_s: How long children may take to drain and commit after SIGTERM before
            they are SIGKILLed (s).
        command: The child's command line (default ``python -m streamapp worker``).
        output: Binary stream that children's output lines go to, each prefixed with
            ``[<index>] `` (default: the parent's stdout).
        servers: Executor servers to run (``gpu_executor=shared``), one per GPU: each is
            started first, its workers only once its socket accepts connections; one that
            exits is restarted with the same backoff (its workers' batches in flight fail
            retriably meanwhile); they are stopped after every worker has stopped.
        server_command: A server's command line (default ``python -m streamapp gpu-server``).
        server_ready_timeout_s: How long a server may take to load its models (s).
    """

    def __init__(
        self,
        specs: Sequence[ChildSpec],
        *,
        environ: Mapping[str, str],
        state_path: Path,
        policy: RestartPolicy | None = None,
        stop_timeout_s: float = 30.0,
        command: Sequence[str] | None = None,
        output: Any = None,
        servers: Sequence[ServerSpec] = (),
        server_command: Sequence[str] | None = None,
        server_ready_timeout_s: float = 300.0,
    ) -> None:
        self.children = [_Child(spec) for spec in specs]
        self.servers = [_Server(spec) for spec in servers]
        self.server_command = list(server_command or [sys.executable, "-m", "streamapp",
                                                      "gpu-server"])
        self.server_ready_timeout_s = server_ready_timeout_s
        self._servers_stop = asyncio.Event()
        self.environ = dict(environ)
        self.state_path = state_path
        self.policy = policy or RestartPolicy()
        self.stop_timeout_s = stop_timeout_s
        self.command = list(command or [sys.executable, "-m", "streamapp", "worker"])
        self.output = output if output is not None else sys.stdout.buffer
        self._stop = asyncio.Event()
        self._killer: asyncio.Task[None] | None = None
        self._failed: str | None = None
        self.started_at = time.time()

    # -- public --------------------------------------------------------------------------------

    def request_stop(self, reason: str = "stop requested") -> None:
        """Begin the shutdown: every running child gets SIGTERM (idempotent)."""
        if self._stop.is_set():
            return
        log.info("supervisor: %s; stopping %d workers", reason, len(self.children))
        self._stop.set()
        self._killer = asyncio.get_running_loop().create_task(self._kill_stragglers())
        for child in self.children:
            self._signal(child, signal.SIGTERM)
            if child.state in ("starting", "running"):
                child.state = "stopping"
        self._write_state()

    async def run(self) -> int:
        """Start every child, watch them, and return the exit code once all have stopped.

        Returns:
            0 when every child stopped cleanly after the stop request; 1 when one had to be
            SIGKILLed, exited non-zero while stopping, or the crash-loop limit was reached.
        """
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.request_stop, f"got {signal.Signals(sig).name}")
        server_tasks = [asyncio.create_task(self._watch_server(s)) for s in self.servers]
        try:
            results = await asyncio.gather(*(self._watch(c) for c in self.children))
        finally:
            self._servers_stop.set()  # the workers have drained: the servers go last
            for server in self.servers:
                self._signal(server, signal.SIGTERM)
            servers_clean = await self._stop_servers(server_tasks)
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.remove_signal_handler(sig)
            if self._killer is not None:
                self._killer.cancel()
            self._write_state()
        if self._failed:
            log.error("supervisor: %s", self._failed)
            return 1
        return 0 if all(results) and servers_clean else 1

    # -- executor servers ------------------------------------------------------------------------

    async def _watch_server(self, server: _Server) -> bool:
        """Run one executor server until the workers have stopped; restart it when it exits.
        True when it stopped cleanly."""
        spec = server.spec
        while not self._servers_stop.is_set():
            env = {**self.environ, **spec.environment()}
            env.setdefault("PYTHONUNBUFFERED", "1")
            server.process = await asyncio.create_subprocess_exec(
                *self.server_command, env=env, stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.STDOUT, start_new_session=True,
                preexec_fn=_die_with_parent,
            )
            server.pid, server.state = server.process.pid, "starting"
            started = time.monotonic()
            log.info("supervisor: gpu-server %d started (pid %d, gpu %s, socket %s%s)",
                     spec.index, server.pid, spec.gpu if spec.gpu is not None else "-",
                     spec.socket, f", restart {server.restarts}" if server.restarts else "")
            self._write_state()
            output = asyncio.create_task(self._pipe(server.process, f"[gpu-server {spec.index}] "))
            ready = asyncio.create_task(self._server_ready(server))
            rc = await server.process.wait()
            ready.cancel()
            await output
            server.ready.clear()
            server.last_exit, server.pid, server.process = rc, None, None
            if self._servers_stop.is_set():
                server.state = "stopped" if rc == 0 else "failed"
                self._write_state()
                return rc == 0
            ran_s = time.monotonic() - started
            server.quick_crashes = (server.quick_crashes + 1
                                    if ran_s < self.policy.stable_after_s else 1)
            if server.quick_crashes >= self.policy.max_quick_crashes:
                server.state = "failed"
                self._failed = (f"gpu-server {spec.index} crashed {server.quick_crashes} times "
                                f"in a row (last: {describe_exit(rc)}); its log lines are the "
                                f"ones prefixed [gpu-server {spec.index}] above")
                self.request_stop(f"gpu-server {spec.index} is in a crash loop")
                self._write_state()
                return False
            delay = self.policy.backoff_s(server.quick_crashes)
            server.state = "backoff"
            log.warning("supervisor: gpu-server %d exited with %s after %.1f s; restart %d in "
                        "%.1f s (its workers' batches wait for it, gpu_server_wait_s)", spec.index,
                        describe_exit(rc), ran_s, server.restarts + 1, delay)
            self._write_state()
            await wait_event(self._servers_stop, delay)
            server.restarts += 1
        server.state = "stopped"
        return True

    async def _stop_servers(self, tasks: Sequence[asyncio.Task[bool]]) -> bool:
        """Wait for the SIGTERMed servers (``stop_timeout_s``, then SIGKILL)."""
        if not tasks:
            return True
        done, _ = await asyncio.wait(tasks, timeout=self.stop_timeout_s)
        if len(done) < len(tasks):
            for server in self.servers:
                log.error("supervisor: gpu-server %d did not stop within %.0f s; SIGKILL",
                          server.spec.index, self.stop_timeout_s)
                self._signal(server, signal.SIGKILL)
            await asyncio.wait(tasks)
            return False
        return all(t.result() for t in tasks)

    async def _server_ready(self, server: _Server) -> None:
        """Set ``server.ready`` once its socket accepts a connection (it listens only after
        loading and warming up its models); stop everything when it takes too long."""
        deadline = time.monotonic() + self.server_ready_timeout_s
        while True:
            try:
                _, writer = await asyncio.open_unix_connection(server.spec.socket)
            except OSError:
                if time.monotonic() > deadline:
                    self._failed = (f"gpu-server {server.spec.index} did not listen on "
                                    f"{server.spec.socket} within "
                                    f"{self.server_ready_timeout_s:.0f} s")
                    self.request_stop(f"gpu-server {server.spec.index} is not ready")
                    return
                await asyncio.sleep(0.1)
                continue
            writer.close()
            server.state = "ready"
            server.ready.set()
            log.info("supervisor: gpu-server %d ready (%s)", server.spec.index,
                     server.spec.socket)
            self._write_state()
            return

    async def _pipe(self, proc: asyncio.subprocess.Process, prefix: str) -> None:
        if proc.stdout is not None:
            tag = prefix.encode()
            while line := await proc.stdout.readline():
                self.output.write(tag + line)
                self.output.flush()

    async def _server_up(self, child: _Child) -> None:
        """Wait until the executor server of ``child``'s GPU is ready (no servers: at once),
        or the stop request."""
        if not self.servers:
            return
        servers = [s.spec for s in self.servers]
        mine = self.servers[servers.index(server_for(child.spec, servers))]
        if mine.ready.is_set():
            return
        waits = [asyncio.create_task(mine.ready.wait()), asyncio.create_task(self._stop.wait())]
        try:
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for w in waits:
                w.cancel()

    # -- per child -------------------------------------------------------------------------------

    async def _watch(self, child: _Child) -> bool:
        """Run one child until the stop request; True when it stopped cleanly."""
        i = child.spec.index
        clean = True
        while not self._stop.is_set():
            await self._server_up(child)
            if self._stop.is_set():
                break
            await self._start(child)
            rc = await self._wait(child)
            ran_s = time.monotonic() - (child.started_at or time.monotonic())
            child.last_exit, child.pid, child.process = rc, None, None
            if self._stop.is_set():  # it exited because we asked it to
                clean = rc == 0 and not child.killed
                break
            child.quick_crashes = (
                child.quick_crashes + 1 if ran_s < self.policy.stable_after_s else 1
            )
            if child.quick_crashes >= self.policy.max_quick_crashes:
                child.state = "failed"
                self._failed = (
                    f"worker {i} crashed {child.quick_crashes} times in a row, each within "
                    f"{self.policy.stable_after_s:.0f} s of its start (last: "
                    f"{describe_exit(rc)}); gave up and stopped every worker. Its log lines "
                    f"are the ones prefixed [{i}] above: fix the cause and start again."
                )
                self.request_stop(f"worker {i} is in a crash loop")
                return False
            delay = self.policy.backoff_s(child.quick_crashes)
            child.state = "backoff"
            log.warning(
                "supervisor: worker %d exited with %s after %.1f s; restart %d in %.1f s",
                i, describe_exit(rc), ran_s, child.restarts + 1, delay,
            )
            self._write_state()
            await wait_event(self._stop, delay)
            if not self._stop.is_set():
                child.restarts += 1
        child.state = "stopped" if clean else "failed"
        (log.info if clean else log.error)(
            "supervisor: worker %d stopped (%s)%s", i,
            "not running" if child.last_exit is None else describe_exit(child.last_exit),
            "" if clean else ": it did not stop cleanly",
        )
        self._write_state()
        return clean

    async def _start(self, child: _Child) -> None:
        spec = child.spec
        env = {**self.environ, **spec.environment(child.restarts)}
        if self.servers:
            env["STREAMAPP_GPU_SERVER_SOCKET"] = server_for(
                spec, [s.spec for s in self.servers]).socket
        env.setdefault("PYTHONUNBUFFERED", "1")
        child.process = await asyncio.create_subprocess_exec(
            *self.command, env=env, stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
            start_new_session=True,  # a terminal's Ctrl-C reaches only us; we forward SIGTERM
            preexec_fn=_die_with_parent,
        )
        child.pid, child.state = child.process.pid, "running"
        child.started_at = time.monotonic()
        log.info(
            "supervisor: worker %d started (pid %d, port %d, data %s, instance %s, gpu %s%s)",
            spec.index, child.pid, spec.web_port, spec.data_dir,
            env["STREAMAPP_GROUP_INSTANCE_ID"] or "none (dynamic)",
            spec.gpu if spec.gpu is not None else "-",
            f", restart {child.restarts}" if child.restarts else "",
        )
        self._write_state()
        if self._stop.is_set():  # the stop request came while it was being created
            self._signal(child, signal.SIGTERM)

    async def _wait(self, child: _Child) -> int:
        proc = child.process
        assert proc is not None
        if proc.stdout is not None:
            prefix = f"[{child.spec.index}] ".encode()
            while line := await proc.stdout.readline():
                self.output.write(prefix + line)
                self.output.flush()
        return await proc.wait()

    async def _kill_stragglers(self) -> None:
        await asyncio.sleep(self.stop_timeout_s)
        for child in self.children:
            if child.process is not None and child.process.returncode is None:
                log.error(
                    "supervisor: worker %d did not stop within %.0f s of SIGTERM; SIGKILL",
                    child.spec.index, self.stop_timeout_s,
                )
                child.killed = True
                self._signal(child, signal.SIGKILL)

    @staticmethod
    def _signal(child: _Child | _Server, sig: int) -> None:
        proc = child.process
        if proc is None or proc.returncode is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)

    # -- state file --------------------------------------------------------------------------------

    def state(self) -> dict[str, Any]:
        """What ``supervisor.json`` holds (see :func:`read_state`)."""
        return {
            "pid": os.getpid(),
            "started_at": self.started_at,
            "stopping": self._stop.is_set(),
            "children": [
                {
                    **{k: str(v) if isinstance(v, Path) else v
                       for k, v in asdict(c.spec).items()},
                    "instance_id": c.spec.instance_id_after(c.restarts),
                    "url": f"http://127.0.0.1:{c.spec.web_port}",
                    "pid": c.pid, "state": c.state, "restarts": c.restarts,
                    "last_exit": c.last_exit,
                }
                for c in self.children
            ],
            "servers": [
                {**asdict(s.spec), "pid": s.pid, "state": s.state, "restarts": s.restarts,
                 "last_exit": s.last_exit}
                for s in self.servers
            ],
        }

    def _write_state(self) -> None:
        tmp = self.state_path.with_suffix(".tmp")
        try:
            tmp.write_text(json.dumps(self.state(), indent=2))
            os.replace(tmp, self.state_path)
        except OSError as exc:  # status is a convenience: never stop the workers for it
            log.warning("supervisor: cannot write %s: %s", self.state_path, exc)


def read_state(data_dir: Path) -> dict[str, Any] | None:
    """The supervisor's ``supervisor.json`` in ``data_dir``, or None when there is none.

    Keys: ``pid``, ``started_at`` (epoch s), ``stopping``, and ``children``: a list of
    ``{index, data_dir, web_port, url, instance_id, gpu, worker_name, pid, state, restarts,
    last_exit}``. The file stays after the supervisor exits (states ``stopped``/``failed``).
    """
    try:
        return json.loads((Path(data_dir) / STATE_NAME).read_text())  # type: ignore[no-any-return]
    except FileNotFoundError:
        return None


def run_supervisor(settings: Any, n: int, flags: Mapping[str, Any]) -> int:
    """``streamapp worker --processes N`` after the topics exist: plan, start and watch.

    Args:
        settings: The parent's :class:`~streamapp.settings.Settings` (environment + flags).
        n: Number of worker processes.
        flags: The settings given as command-line flags (None: not given); passed to every
            child as ``STREAMAPP_<NAME>`` so that children see what the parent saw.

    Returns:
        The exit code (see :meth:`Supervisor.run`).
    """
    log.setLevel(logging.INFO)
    if settings.topic_partitions < n:
        log.warning(
            "supervisor: topic_partitions is %d but --processes is %d: %d workers will get no "
            "partition and stay idle (standbys). Set --topic-partitions / "
            "STREAMAPP_TOPIC_PARTITIONS >= %d before the topics are created (existing topics "
            "keep their partition count).",
            settings.topic_partitions, n, n - settings.topic_partitions, n,
        )
    gpus = visible_gpus()
    data_dir = Path(settings.data_dir).resolve()
    # On the embedded broker static members that come back (a restarted supervisor, a child
    # restarted before its old session expired) can loop on JoinGroup without partitions (the
    # module docstring): children there use dynamic membership from the start.
    static_ids = settings.broker_kind != "embedded"
    if not static_ids:
        log.info("supervisor: embedded broker: the workers join with dynamic membership")
    specs = plan_children(
        n, data_dir=data_dir, web_port=settings.web_port,
        group_instance_id=settings.group_instance_id, worker_name=settings.worker_name,
        gpus=gpus, static_ids=static_ids,
    )
    log.info("supervisor: %d workers of group %s, GPUs %s", n, settings.app_id,
             ",".join(gpus) if gpus else "none (CPU)")
    environ = dict(os.environ)
    for name, value in flags.items():
        if value is not None:
            environ[f"STREAMAPP_{name.upper()}"] = (
                ",".join(map(str, value)) if isinstance(value, list | tuple) else str(value)
            )
    servers: list[ServerSpec] = []
    folder = None
    if settings.gpu_executor == "shared":
        # A private folder (mode 0700) with a short path: a Unix socket path has at most
        # 107 bytes, which a deep data directory could exceed.
        folder = Path(tempfile.mkdtemp(prefix="streamapp-gpu-"))
        servers = plan_servers(gpus, folder)
        log.info("supervisor: gpu_executor=shared: %d executor server(s) (%s)", len(servers),
                 ", ".join(f"gpu {s.gpu if s.gpu is not None else '-'}: {s.socket}"
                           for s in servers))
    supervisor = Supervisor(
        specs, environ=environ, state_path=data_dir / STATE_NAME,
        stop_timeout_s=max(30.0, 2 * settings.session_timeout_s), servers=servers,
    )
    try:
        return asyncio.run(supervisor.run())
    finally:
        if folder is not None:
            shutil.rmtree(folder, ignore_errors=True)
