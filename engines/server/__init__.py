"""One executor process per GPU, shared by every worker of the host (issue 17, item 3).

:class:`ExecutorServer` loads nothing itself: it serves the in-process executors it is given
(loaded once, through the registry and backends) on a Unix domain socket, and merges the
sub-batches of all its clients in one dynamic batcher per model. :class:`SharedExecutor` is the
client, an :class:`~engines.executor.base.Executor` like the in-process ones, so the pipeline
that uses it is unchanged. Payloads travel through ``multiprocessing.shared_memory`` slots; the
socket carries small msgpack headers (:mod:`engines.server.protocol`). Nothing is pickled.
"""

from __future__ import annotations

from engines.server.client import RemoteEngine, RemoteImageEngine, SharedExecutor, query_stats
from engines.server.server import BatchStats, ExecutorServer

__all__ = [
    "BatchStats",
    "ExecutorServer",
    "RemoteEngine",
    "RemoteImageEngine",
    "SharedExecutor",
    "query_stats",
]
