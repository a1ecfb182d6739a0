"""Child processes of ours (the embedded broker, workers, benchmark processes): one way to pick
a free port, start a child in its own process group that dies with its parent, and stop it.

Used by :mod:`streamapp.broker`, :mod:`streamapp.process` and ``bench/procs.py``.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import os
import re
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Callable, Collection
from pathlib import Path
from typing import Any

__all__ = ["free_port", "popen_child", "read_tail", "terminate_group"]

_ANSI_ESCAPE = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")

#: ``PR_SET_PDEATHSIG`` from ``<linux/prctl.h>``.
_PR_SET_PDEATHSIG = 1


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port the OS considered free a moment ago on ``host`` (bind to port 0, release).

    Another process may take it before the caller binds it: callers that start a server on it
    retry on a new port when the bind fails (see :class:`streamapp.broker.EmbeddedBroker`).
    """
    return free_ports(1, host)[0]


def free_ports(n: int, host: str = "127.0.0.1", exclude: Collection[int] = ()) -> list[int]:
    """``n`` distinct TCP ports the OS considered free a moment ago on ``host``, none of them
    in ``exclude``. The sockets are held until all are bound, so that two calls to
    :func:`free_port` in a row cannot hand out the same port twice (a Kafka node once got
    one port for its client and controller listeners, and refused to start)."""
    with contextlib.ExitStack() as stack:
        ports: list[int] = []
        while len(ports) < n:
            sock = stack.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM))
            sock.bind((host, 0))
            port = int(sock.getsockname()[1])
            if port not in exclude:
                ports.append(port)
        return ports


def port_taken(host: str, port: int) -> bool:
    """Whether a TCP server already listens on ``host:port`` (binding it fails with
    EADDRINUSE). Binds with ``SO_REUSEADDR`` as servers do, so a port left in TIME_WAIT by a
    stopped worker counts as free."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return True
    return False


def _die_with_parent() -> Callable[[], None] | None:
    """A ``preexec_fn`` asking Linux to SIGKILL the child when its parent dies, so that a
    killed test run or benchmark leaves no broker or worker behind; None off Linux."""
    if not sys.platform.startswith("linux"):
        return None
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    libc = ctypes.CDLL(name, use_errno=True)

    def preexec() -> None:
        # Runs in the child between fork and exec; errors are ignored (best effort).
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)

    return preexec


def popen_child(command: list[str], **kwargs: Any) -> subprocess.Popen[bytes]:
    """``subprocess.Popen`` in a new session (its own process group, so that
    :func:`terminate_group` reaches its children too) that is killed when this process dies.

    Linux sends the parent-death signal when the *thread* that started the child exits, so it
    is asked for only when the main thread starts the child; children started from other
    threads are stopped by their owner (:func:`terminate_group`).

    Args:
        command: Program and arguments.
        **kwargs: Passed to ``Popen`` (``stdout``, ``env``, ``cwd`` ...).
    """
    # Only from the main thread: a child started from a short-lived thread (a benchmark's
    # launcher pool) would otherwise be killed as soon as that thread ends.
    preexec = _die_with_parent() if threading.current_thread() is threading.main_thread() else None
    return subprocess.Popen(command, start_new_session=True, preexec_fn=preexec, **kwargs)


def terminate_group(
    process: subprocess.Popen[bytes], timeout_s: float = 15.0, sig: int = signal.SIGTERM
) -> int | None:
    """Send ``sig`` to the child's process group, wait up to ``timeout_s``, then SIGKILL the
    group; reaps the child. Idempotent.

    Args:
        process: A child started by :func:`popen_child` (leader of its own group).
        timeout_s: Seconds to wait for it to exit after ``sig``.
        sig: The first signal (SIGTERM: a clean stop; SIGKILL: a crash).

    Returns:
        Its exit status (negative: killed by that signal).
    """
    if process.poll() is not None:
        return process.returncode  # reaped: its pid (and group id) may be someone else's now
    # The unreaped child keeps its group id reserved, so signalling the group is safe until wait.
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, sig)
    try:
        return process.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(process.pid, signal.SIGKILL)
        return process.wait()


def read_tail(path: Path | None, offset: int, max_bytes: int) -> str:
    """The last ``max_bytes`` of a child's log file from ``offset`` on (decoded leniently);
    "" when there is no file."""
    if path is None:
        return ""
    try:
        with path.open("rb") as handle:
            size = handle.seek(0, os.SEEK_END)
            handle.seek(max(offset, size - max_bytes))
            data = handle.read()
    except OSError:
        return ""
    return _ANSI_ESCAPE.sub("", data.decode("utf-8", errors="replace")).strip()
