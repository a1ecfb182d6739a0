"""One frozen, typed settings object for the worker, the CLI and the tests.

Values come from (highest first): explicit keyword arguments / CLI flags, environment variables
prefixed ``STREAMAPP_`` (e.g. ``STREAMAPP_MAX_BATCH_SIZE=64``), then the defaults below. Nothing
is read at import time: call :func:`load_settings` (or ``Settings()``) when you need them.
"""

from __future__ import annotations

import difflib
import os
import re
from pathlib import Path
from typing import Annotated, Any, Literal, get_args, get_origin

from pydantic import (
    Field,
    SecretStr,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from engines.registry import AUTO, registered_backends
from streamapp.exceptions import ConfigError

__all__ = [
    "BROKER_FORMS",
    "DEFAULT_TOPIC_PARTITIONS",
    "MAX_BATCH_SIZE",
    "MAX_TOPIC_PARTITIONS",
    "TRANSACTION_TIMEOUT_MS",
    "UPPER_BOUNDS",
    "WEB_OPEN_PATHS",
    "Backend",
    "BrokerKind",
    "Codec",
    "GpuExecutor",
    "SaslMechanism",
    "SecurityProtocol",
    "Settings",
    "load_settings",
    "settings_reference",
    "web_token",
]

Codec = Literal["json", "msgpack"]
#: An engine backend: ``auto`` or a name registered in :mod:`engines.registry`.
Backend = str
ImageDecode = Literal["auto", "cpu"]
GpuExecutor = Literal["inprocess", "shared"]
Intake = Literal["faust", "direct"]
BrokerKind = Literal["auto", "kafka", "embedded"]
SecurityProtocol = Literal["PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL"]
SaslMechanism = Literal["PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512"]
ProcessingGuarantee = Literal["at_least_once", "exactly_once"]

#: Paths that may be answered without the web token (``web_open_paths``), all by default:
#: what orchestrators probe and Prometheus scrapes.
WEB_OPEN_PATHS = ("/health", "/ready", "/metrics")
#: What a web token may hold (RFC 6750's b64token) and its least length.
_WEB_TOKEN_RE = re.compile(r"[A-Za-z0-9\-._~+/]+=*")
WEB_TOKEN_MIN_CHARS = 16

#: Partitions of the topics a worker or ``streamapp publish`` creates, unless configured.
DEFAULT_TOPIC_PARTITIONS = 16

#: Defaults from docs/broker.md: with these a worker joins its group in about 5 s on Tansu
#: (Tansu holds each JoinGroup for half the session timeout).
_FAST_GROUP = {"session_timeout_s": 6.0, "heartbeat_interval_s": 1.0, "rebalance_timeout_s": 6.0}

#: The forms a bootstrap server may take in ``broker`` (the only scheme is Kafka's, as in
#: Faust's URLs and :attr:`streamapp.broker.EmbeddedBroker.url`).
BROKER_FORMS = "kafka://host:port or host:port (several separated by ';' or ',')"

#: How long the broker keeps the open transaction of a worker that died before it aborts it
#: (ms): ``read_committed`` readers of its partitions wait that long behind it, unless the
#: worker restarts in place sooner (its restart aborts it at once). Kafka Streams uses 10 s;
#: 20 s leaves room for a loaded 2-core machine (a commit that takes longer stops the worker).
#: With exactly_once, ``commit_interval_ms`` may be at most half of it.
TRANSACTION_TIMEOUT_MS = 20_000

#: Most requests in one batch: see ``UPPER_BOUNDS["max_batch_size"]``.
MAX_BATCH_SIZE = 4096
#: Most partitions of the worker's topics (``topic_partitions``; ``tables rebuild --partitions``).
MAX_TOPIC_PARTITIONS = 1024

_MINUTE_MS = 60_000.0
_HOUR_MS = 3_600_000.0
_HOUR_S = 3600.0
_DAY_S = 86_400.0
_MIB = 1024 * 1024

#: Upper bounds of numeric settings, and why each is there: a larger value would make a worker
#: fail or look hung (often a value in the wrong unit). Settings validation refuses one with
#: this reason; each setting's description (docs/settings.md) states its bound.
UPPER_BOUNDS: dict[str, tuple[float, str]] = {
    "topic_partitions": (
        MAX_TOPIC_PARTITIONS, "the worker creates seven topics of this many partitions "
        "(request, result, DLQ, retry and the three table changelogs) and opens a table store "
        "per partition it owns",
    ),
    "max_batch_size": (
        MAX_BATCH_SIZE, "engines size their buffers for this many rows (the GPU executor "
        "allocates pinned host and GPU memory of max_batch_size rows per CUDA stream and batch "
        "in flight when it loads a model: 2.3 GiB a buffer at 4096 rows of a 3x224x224 float32 "
        "input), and the worker keeps reading until max_batch_size x (max_inflight_batches + 1) "
        "requests wait",
    ),
    "max_inflight_batches": (
        64, "each batch in flight holds an engine thread (CPU) or a pinned staging slot of "
        "max_batch_size rows (GPU executor), and the worker keeps reading until "
        "max_batch_size x (max_inflight_batches + 1) requests wait",
    ),
    "cuda_streams": (
        32, "a GPU runs the work of at most 32 streams concurrently "
        "(CUDA_DEVICE_MAX_CONNECTIONS), and each stream holds GPU buffers of max_batch_size rows",
    ),
    "fetch_max_wait_ms": (
        _MINUTE_MS, "a fetch that waits longer than request_timeout_s times out, and at light "
        "load every request would wait this long",
    ),
    "fetch_min_bytes": (
        50 * 1024 * 1024, "a fetch response carries at most fetch.max.bytes (50 MiB, aiokafka's "
        "and Kafka's default), so a larger minimum makes every fetch wait the whole "
        "fetch_max_wait_ms",
    ),
    "producer_linger_ms": (
        _MINUTE_MS, "every result, retry and dead letter would wait this long before it is "
        "sent, and its request's commit with it",
    ),
    "intake_wait_ms": (_MINUTE_MS, "at light load every request would wait this long"),
    "max_batch_delay_ms": (_MINUTE_MS, "at light load every request would wait this long"),
    "max_batch_hold_ms": (
        _MINUTE_MS, "with a backlog every batch could be held this long",
    ),
    "gpu_server_batch_delay_ms": (
        _MINUTE_MS, "every batch of the executor server could wait this long",
    ),
    "commit_interval_ms": (
        _MINUTE_MS, "a crash re-delivers everything finished since the last commit",
    ),
    "state_flush_interval_ms": (
        _HOUR_MS, "at light load a request's offset is committed only after this flush",
    ),
    "retry_backoff_max_ms": (
        _HOUR_MS, "the retry agent refuses a retry record due more than a day ahead "
        "(MAX_RETRY_DELAY_S) as invalid_retry_record, and an hour stays within it whatever the "
        "jitter",
    ),
    "ready_probe_timeout_ms": (
        _MINUTE_MS, "/ready would answer no sooner than this when the broker does not",
    ),
    "web_cache_ms": (_MINUTE_MS, "/metrics and /devices would answer that old a snapshot"),
    "session_timeout_s": (
        1800.0, "Kafka brokers refuse a longer session (group.max.session.timeout.ms, 30 "
        "minutes by default), so the worker would never join its group",
    ),
    "rebalance_timeout_s": (
        3600.0, "a member that does not rejoin would hold up the group's rebalance this long",
    ),
    "request_timeout_s": (
        3600.0, "a broker that does not answer would stall the worker this long",
    ),
    "topic_replication_factor": (
        16, "each replica is a full copy of every topic on another broker, and Kafka refuses a "
        "factor above the cluster's broker count (3 is the production norm)",
    ),
    "changelog_segment_ms": (
        7 * 24 * _HOUR_MS, "Kafka compacts only closed segments, so a worker that restores a "
        "table would read every update of that long (Kafka's own default is 7 days)",
    ),
    "metadata_refresh_interval_s": (
        _HOUR_S, "partitions added to the request or retry topic would go unread, and a "
        "partition count that no longer matches the tables' unreported, this long",
    ),
    "max_poll_records": (
        100_000, "one fetch's records are held in memory and handed to the agents at once",
    ),
    "max_fetch_bytes": (
        64 * _MIB, "the consumer may hold this much per partition it reads (1 GiB for 16 "
        "partitions at the bound)",
    ),
    "stream_buffer_maxsize": (
        100_000, "Faust holds this many events in memory per partition before it pauses "
        "fetches, so backpressure would come only after that many",
    ),
    "cuda_inline_pack_kib": (
        65_536, "the event loop's thread copies a batch this large itself and answers nothing "
        "else meanwhile",
    ),
    "gpu_server_wait_s": (
        _HOUR_S, "reading pauses while a batch waits, so the worker would look hung this long",
    ),
    "image_decode_threads": (
        256, "each thread holds decoded images in memory, and threads beyond the CPU cores "
        "add memory, not speed",
    ),
    "max_image_pixels": (
        16384 * 16384, "a decoded RGB image of that many pixels takes 768 MiB",
    ),
    "max_request_bytes": (
        64 * _MIB, "every request waiting for a batch is held in memory (Kafka's default record "
        "limit is 1 MB)",
    ),
    "max_dead_letter_value_bytes": (
        64 * _MIB, "a dead letter carries the value base64-encoded, 4/3 as big, in one record",
    ),
    "table_write_buffer_mib": (
        1024.0, "each table database may hold two write buffers of this size, and a worker "
        "has two databases per partition it owns (a value in bytes, 67108864, would be 64 TiB)",
    ),
    "table_block_cache_mib": (
        4096.0, "each table database has a block cache of this size, and a worker has two "
        "databases per partition it owns (a value in bytes would be terabytes)",
    ),
    "max_clock_skew_s": (
        _DAY_S, "a larger tolerance would take device clocks off by days as right and measure "
        "their requests' e2e latency from them",
    ),
    "max_produce_bytes": (
        64 * _MIB, "every result, retry and dead letter up to this size is held in the "
        "producer's memory, and Kafka brokers refuse records above message.max.bytes (1 MB by "
        "default)",
    ),
    "top_k": (1000, "each classification result carries this many labels"),
    "state_flush_max_records": (
        100_000, "a crash re-delivers up to this many finished records",
    ),
    "max_retries": (
        100, "a failing request goes through the retry topic this many times, each after a "
        "backoff of up to retry_backoff_max_ms, before it reaches the DLQ",
    ),
    "failure_quarantine_s": (
        _DAY_S, "the device's requests would run alone, one batch each, this long",
    ),
    "retry_backoff_base_ms": (
        _HOUR_MS, "the backoff is capped at retry_backoff_max_ms (at most an hour) anyway",
    ),
    "ready_stall_s": (
        _HOUR_S, "/ready would report a worker that makes no progress only after this long",
    ),
    "web_max_concurrent_requests": (
        1024, "web requests are answered on the event loop that runs inference",
    ),
    "web_max_requests_per_s": (
        100_000, "0 is the setting for no rate bound; a web request shares the event loop with "
        "inference",
    ),
    "window_expires_s": (
        _DAY_S, "every device keeps a bucket per tumbling window and hopping step within it, in "
        "memory and in the table changelog (8,640 a series at the 10 s defaults)",
    ),
}


def _bound(name: str) -> str:
    """The sentence a bounded setting's description ends with."""
    bound, why = UPPER_BOUNDS[name]
    return f" At most {bound:,.0f}: {why}."


#: Most characters of a refused number that a settings error echoes (then "…").
_MAX_SHOWN_CHARS = 40


def _shown_number(value: float) -> str:
    """A refused number as a settings error echoes it, short whatever its size: an int with
    thousands separators, cut after :data:`_MAX_SHOWN_CHARS` characters with "…" and its digit
    count; a float from 1e15 up in exponent form (``1e+30``, never its 300 rounded digits), a
    smaller one with separators when integral (``5,000``), else in its shortest form
    (``2700.5``)."""
    if isinstance(value, int):
        try:
            text = f"{value:,}"
        except ValueError:  # more digits than Python converts (sys.get_int_max_str_digits())
            return f"a number of about {value.bit_length() * 30103 // 100000 + 1:,} digits"
        if len(text) <= _MAX_SHOWN_CHARS:
            return text
        digits = sum(c.isdigit() for c in text)
        return f"{text[:_MAX_SHOWN_CHARS - 1].rstrip(',')}… ({digits:,} digits)"
    if abs(value) >= 1e15:
        return f"{value:.6g}"
    return f"{value:,.0f}" if value.is_integer() else repr(value)


class Settings(BaseSettings):
    """Worker settings. Field names carry their units.

    Raises:
        pydantic.ValidationError: (through ``Settings(...)``) a value has the wrong type or range;
            :func:`load_settings` turns it into :class:`ConfigError`.
    """

    # hide_input_in_errors: a validation error must not print the inputs (sasl_password).
    # allow_inf_nan=False: every float setting is a finite number ("inf" is no bound and no
    # delay; the upper bounds are in UPPER_BOUNDS).
    model_config = SettingsConfigDict(
        env_prefix="STREAMAPP_", frozen=True, extra="forbid", hide_input_in_errors=True,
        allow_inf_nan=False,
    )

    # -- Kafka ---------------------------------------------------------------------------------
    broker: str = Field(
        "kafka://127.0.0.1:9092",
        description="Bootstrap servers: kafka://host:port or host:port, several separated "
        "by ';' or ',' (kafka://host:port;kafka://host2:port). No other scheme: TLS and SASL "
        "are set by security_protocol.",
    )
    broker_kind: BrokerKind = Field(
        "auto",
        description="What 'broker' is: 'kafka' (Apache Kafka or a compatible service) or "
        "'embedded' (the Tansu broker of 'streamapp broker', the demo and the tests); 'auto' "
        "asks the broker at start (Tansu reports cluster id 'tansu_cluster'). 'embedded' turns "
        "on the workarounds for its wrong end offsets (changelog seals, no table consistency "
        "check; docs/broker.md).",
    )
    app_id: str = Field(
        "streamapp",
        description="Faust app id = Kafka consumer group id. Fixed for a deployment: it names "
        "the group's committed offsets and the tables' changelogs (docs/settings.md).",
    )
    topic_prefix: str = Field(
        "", description="Prefix for every topic name, e.g. 'prod.'. Fixed for a deployment "
        "(other topics; docs/settings.md).",
    )
    topic_partitions: int = Field(
        DEFAULT_TOPIC_PARTITIONS, ge=1,
        description="Partitions of the request, result, DLQ and retry topics when the worker "
        "creates them (and of the tables' changelogs); the most workers that can share the load "
        "(16: room for `worker --processes 12` on one host, docs/scaling.md). Fixed for a "
        "deployment: the tables are partitioned like the request topic (docs/settings.md)."
        + _bound("topic_partitions"),
    )
    topic_replication_factor: int = Field(
        1, ge=1,
        description="Replicas of the topics and changelogs the worker creates; use 3 on a "
        "production Kafka cluster (the embedded broker has one node)."
        + _bound("topic_replication_factor"),
    )
    changelog_segment_ms: int = Field(
        600_000, ge=1000,
        description="segment.ms (milliseconds) of the tables' changelog topics when the worker "
        "creates them. Kafka compacts only closed segments, so a changelog keeps every update "
        "until its segment rolls (Kafka's default: 7 days), and a worker that restores a table "
        "reads all of them; a short segment bounds that history. Existing topics keep theirs."
        + _bound("changelog_segment_ms"),
    )
    result_codec: Codec = Field("json", description="Encoding of result records.")
    session_timeout_s: float = Field(
        _FAST_GROUP["session_timeout_s"], gt=0,
        description="Consumer group session timeout (s); a dead worker is noticed after this."
        + _bound("session_timeout_s"),
    )
    heartbeat_interval_s: float = Field(
        _FAST_GROUP["heartbeat_interval_s"], gt=0, description="Group heartbeat interval (s)."
    )
    rebalance_timeout_s: float = Field(
        _FAST_GROUP["rebalance_timeout_s"], gt=0,
        description="Group rebalance timeout (s)." + _bound("rebalance_timeout_s"),
    )
    request_timeout_s: float = Field(
        30.0, gt=0,
        description="Kafka request timeout (s); must exceed session_timeout_s and "
        "fetch_max_wait_ms." + _bound("request_timeout_s"),
    )
    fetch_max_wait_ms: float = Field(
        25.0, gt=0,
        description="Longest a fetch waits for data (ms). Faust fixes 1500 ms; the embedded "
        "broker always waits that long when a partition is idle, so it sets the latency floor "
        "at light load. Below request_timeout_s." + _bound("fetch_max_wait_ms"),
    )
    fetch_min_bytes: int = Field(
        1, ge=1,
        description="Bytes a fetch waits for, up to fetch_max_wait_ms (Kafka's fetch.min.bytes; "
        "1: answered as soon as one record is there). Larger values make a paced stream "
        "arrive in fewer, larger fetches, for less consumer CPU per record at light load, and "
        "add up to fetch_max_wait_ms of latency there (docs/performance.md)."
        + _bound("fetch_min_bytes"),
    )
    metadata_refresh_interval_s: float = Field(
        30.0, ge=1.0,
        description="How often the worker's consumer and producer refresh the topics' metadata "
        "(s; Faust's default: 5 min). Partitions added to the request or retry topic are read, "
        "and a partition count that no longer matches the tables' is reported (/ready 503, "
        "streamapp_state_degraded), within this long (docs/tables.md)."
        + _bound("metadata_refresh_interval_s"),
    )
    group_instance_id: str = Field(
        "",
        description="Static group membership id (KIP-345), unique per worker and stable across "
        "its restarts (e.g. the pod name); a restarted worker then gets its partitions back "
        "without a rebalance. Empty: dynamic membership.",
    )
    producer_linger_ms: float = Field(
        1.0, ge=0, description="Producer batching delay (ms)." + _bound("producer_linger_ms")
    )
    intake: Intake = Field(
        "direct",
        description="How fetched requests and retries reach the agents: 'direct' (each "
        "fetched partition's records handed over as one list by Faust's fetcher; "
        "streamapp/intake.py) or 'faust' (one Faust event per record through the agents' "
        "streams, in chunks of intake_wait_ms: about 3x the CPU per result on the H200 host, "
        "docs/performance.md).",
    )
    intake_wait_ms: float = Field(
        2.0, gt=0,
        description="With intake='faust': longest the agents wait for more records before "
        "handling what they read (ms; Faust's take_events). Records are admitted, decoded "
        "and queued in chunks of up to max_batch_size; at light load this adds at most this "
        "much latency." + _bound("intake_wait_ms"),
    )
    max_poll_records: int = Field(
        5000, ge=1,
        description="Most records one fetch hands the worker (Faust's broker_max_poll_records; "
        "Faust's default of 1,000 halved a batched agent's rate in issue 17's measurements)."
        + _bound("max_poll_records"),
    )
    max_fetch_bytes: int = Field(
        4 * 1024 * 1024, ge=65536,
        description="Most bytes one fetch returns per partition (Faust's "
        "consumer_max_fetch_size; 4 MiB)."
        + _bound("max_fetch_bytes"),
    )
    stream_buffer_maxsize: int = Field(
        4096, ge=1, description="Messages Faust buffers per partition before pausing fetches."
        + _bound("stream_buffer_maxsize")
    )

    # -- Batching and engines --------------------------------------------------------------------
    max_batch_size: int = Field(
        32, ge=1,
        description="A batch closes at this many requests (an engine with a smaller max batch, "
        "e.g. a TensorRT plan's optimization profile, caps it)." + _bound("max_batch_size"),
    )
    max_batch_delay_ms: float = Field(
        5.0, ge=0,
        description="A batch closes this long after its first request (ms)."
        + _bound("max_batch_delay_ms"),
    )
    max_inflight_batches: int = Field(
        2, ge=1,
        description="Batches running at once; reading pauses beyond this (backpressure)."
        + _bound("max_inflight_batches"),
    )
    backend: Backend = Field(
        "auto", description="Engine backend: onnxruntime, tensorrt, torch, or 'auto' (the first "
        "of tensorrt, torch, onnxruntime that runs here and loads the model). `engines backends` "
        "lists what is registered and available."
    )
    cuda_streams: int = Field(
        2, ge=1,
        description="CUDA streams of the GPU executor (GPU backends only); batches in flight "
        "are spread over them, ceil(max_inflight_batches / cuda_streams) per stream."
        + _bound("cuda_streams"),
    )
    cuda_inline_pack_kib: int = Field(
        256, ge=0,
        description="A batch whose inputs take at most this many KiB is packed into pinned "
        "memory and enqueued on the event loop's thread, not handed to a pack thread: the "
        "copy costs microseconds, the thread crossing up to a GIL switch interval (GPU "
        "backends only; images the engine decodes always go to a pack thread). 0: never."
        + _bound("cuda_inline_pack_kib"),
    )
    cuda_poll_ms: float = Field(
        5.0, ge=0, le=1000,
        description="How long the event loop polls the completion of a batch it enqueued "
        "itself (cuda_inline_pack_kib) before a waiter thread takes it over (ms): answering a "
        "small batch on the loop saves two GIL crossings (GPU backends only). 0: the waiter "
        "thread always.",
    )
    gc_freeze: bool = Field(
        True,
        description="Once the models are loaded and warmed up, move every object alive to "
        "the garbage collector's permanent generation (gc.freeze; Instagram's fix for "
        "full collections that scan the start-up heap). With torch and Faust loaded a full "
        "collection of that heap took about 40 ms on the 2-core machine, a pause every "
        "few seconds under load that then queues requests (docs/performance.md).",
    )
    gil_switch_interval_ms: float = Field(
        5.0, gt=0, le=100,
        description="CPython's thread switch interval in the worker and executor server "
        "processes (ms; sys.setswitchinterval, CPython's default 5 ms). A batch crosses "
        "threads three times (pack, CUDA completion, back to the event loop) and each crossing "
        "can wait this long for the GIL while the event loop runs Python: lower it for "
        "latency (docs/performance.md, issue 17).",
    )
    gpu_executor: GpuExecutor = Field(
        "inprocess",
        description="Where a worker's engines run: 'inprocess' (each worker loads its own, "
        "one CUDA context per worker) or 'shared' (one executor server process per GPU loads "
        "them once and merges the batches of every worker of the host into full batches; "
        "`worker --processes N` starts one per GPU; docs/scaleout.md).",
    )
    gpu_server_socket: str = Field(
        "",
        description="Unix socket of the executor server a worker with gpu_executor=shared "
        "uses, and where `streamapp gpu-server` listens; `worker --processes N` sets it per "
        "GPU. Empty: <temp dir>/streamapp-<uid>/gpu-server.sock.",
    )
    gpu_server_batch_delay_ms: float = Field(
        2.0, ge=0,
        description="Longest the executor server holds a merged batch open for other "
        "workers' batches after the first one arrived (ms); while every executor slot is busy "
        "it keeps filling anyway. Only with gpu_executor=shared."
        + _bound("gpu_server_batch_delay_ms"),
    )
    gpu_server_wait_s: float = Field(
        60.0, ge=0,
        description="How long a batch waits for an unreachable executor server to come back "
        "(restarted by `worker --processes N`) before it fails retriably through the retry "
        "topic (s); the batches it held are sent again (at-least-once), and waiting does not "
        "use up the requests' max_retries. Reading pauses meanwhile (backpressure). 0: fail "
        "at once. Only with gpu_executor=shared."
        + _bound("gpu_server_wait_s"),
    )
    models_dir: Path | None = Field(
        None, description="Model repository; default: the models bundled with streamapp."
    )

    # -- Images ------------------------------------------------------------------------------------
    image_decode_threads: int = Field(
        0, ge=0,
        description="Threads that decode and pre-process image requests off the event loop "
        "(Pillow releases the GIL while it decodes and resizes). 0: one per CPU core, at most 8."
        + _bound("image_decode_threads"),
    )
    image_decode: ImageDecode = Field(
        "auto",
        description="Where JPEG frames are decoded: 'auto' on the GPU (nvJPEG) when the engine "
        "offers it (the torch backend with torchvision), else on the CPU; 'cpu' always on the "
        "CPU (Pillow).",
    )
    max_image_pixels: int = Field(
        16_777_216, ge=1,
        description="Largest image accepted (width x height from its header, checked before "
        "decoding; larger ones go to the DLQ as image_too_large). A model's metadata "
        "image.max_pixels may lower it. Default 4096 x 4096."
        + _bound("max_image_pixels"),
    )
    models: Annotated[tuple[str, ...], NoDecode] = Field(
        ("digits",), description="Models to load (comma-separated in the environment)."
    )
    max_request_bytes: int = Field(
        1_048_576, ge=64, description="Largest request value accepted (bytes)."
        + _bound("max_request_bytes")
    )
    max_dead_letter_value_bytes: int = Field(
        524_288, ge=0,
        description="Larger original values are left out of dead letters (their size and sha256 "
        "are kept): base64 makes them 4/3 as big and a Kafka record is limited (1 MB default)."
        + _bound("max_dead_letter_value_bytes"),
    )
    max_clock_skew_s: float = Field(
        300.0, gt=0,
        description="A request's ts further than this from when it reached Kafka (its record "
        "timestamp) is a wrong device clock: e2e latency is then measured from the record "
        "timestamp and the result carries clock_skew_ms (seconds; docs/faults.md)."
        + _bound("max_clock_skew_s"),
    )
    max_produce_bytes: int = Field(
        1_000_000, ge=4096,
        description="Largest record the worker produces (bytes, key + value + record overhead; "
        "the producer's max_request_size). Keep it at or below the topics' max.message.bytes. "
        "A result, retry record or dead letter that would be larger becomes a small "
        "unproducible_outcome dead letter."
        + _bound("max_produce_bytes"),
    )
    top_k: int = Field(
        3, ge=1,
        description="Labels with scores in each classification result." + _bound("top_k"),
    )

    # -- Delivery: commits, retries ----------------------------------------------------------------
    commit_interval_ms: float = Field(
        50.0, gt=0,
        description="How often finished source offsets are committed (ms). A record is finished "
        "once the device state flush after its outcome ran (state_flush_interval_ms, "
        "state_flush_max_records); docs/delivery.md gives what a crash re-delivers. With "
        f"exactly_once at most {TRANSACTION_TIMEOUT_MS // 2:,} (half the transaction timeout: "
        "a transaction stays open for one interval)." + _bound("commit_interval_ms"),
    )
    processing_guarantee: ProcessingGuarantee = Field(
        "at_least_once",
        description="'at_least_once': outcomes are produced, then source offsets committed "
        "(a crash re-delivers what was in flight). 'exactly_once' (Apache Kafka only): each "
        "commit_interval_ms the outcomes, table changelog writes and source offsets of that "
        "interval are committed in one Kafka transaction (transactional id per worker "
        "instance, consumer group generation checked as KIP-447 does); read_committed "
        "consumers see every request's outcome once. Costs latency (outcomes become visible "
        "at the commit) and throughput; docs/delivery.md says when to choose which.",
    )
    state_flush_interval_ms: float = Field(
        500.0, ge=0,
        description="How often device state (device_stats, window buckets) is written to its "
        "tables (ms): one row per device and table per flush, whatever the rate. A request "
        "offset is committed only after the flush that follows its outcome, so a crash "
        "re-delivers what was in flight, what finished since the last flush (at most "
        "state_flush_max_records) and what finished within one commit_interval_ms. 0 writes "
        "after every group of outcomes produced (the most changelog records)."
        + _bound("state_flush_interval_ms"),
    )
    max_batch_hold_ms: float = Field(
        20.0, ge=0,
        description="With a backlog in the worker's partitions (records in the broker beyond "
        "the last one read, by the fetch high watermark), a batch not full when "
        "max_batch_delay_ms passed keeps filling for the records already waiting, up to this "
        "long after its first request (ms): full batches when intake, not the engine, is the "
        "limit. At or below max_batch_delay_ms: never held." + _bound("max_batch_hold_ms"),
    )
    state_flush_max_records: int = Field(
        1024, ge=1,
        description="Flush device state sooner, as soon as this many finished records wait "
        "for it (records whose outcome the broker has, not yet committed): bounds what a "
        "crash re-delivers at high rates (this many plus what was in flight), at the cost of "
        "more changelog records (one per device touched per flush)."
        + _bound("state_flush_max_records"),
    )
    max_retries: int = Field(
        3, ge=0, description="Retries of a transient failure before the request goes to the DLQ."
        + _bound("max_retries")
    )
    failure_quarantine_s: float = Field(
        30.0, ge=0,
        description="After a request failed alone while the other requests of its batch passed, "
        "its device's requests run alone, never in a batch with other devices' requests, until "
        "this long after its last failure (s); retries always run alone. Keeps a failing device "
        "from failing its neighbours' batches. 0: only retries run alone."
        + _bound("failure_quarantine_s"),
    )
    retry_backoff_base_ms: float = Field(
        200.0, ge=0, description="Backoff before retry n is base * 2**(n-1) (ms), capped."
        + _bound("retry_backoff_base_ms")
    )
    retry_backoff_max_ms: float = Field(
        10_000.0, ge=0, description="Backoff cap (ms)." + _bound("retry_backoff_max_ms")
    )
    retry_jitter: float = Field(
        0.2, ge=0, le=1,
        description="Backoff is multiplied by a uniform factor in [1 - jitter, 1 + jitter].",
    )

    # -- Worker ------------------------------------------------------------------------------------
    worker_name: str = Field("", description="Name put in results; default host:pid.")
    data_dir: Path = Field(Path("data"), description="Faust data dir (tables, RocksDB).")
    web_bind: str = Field("127.0.0.1", description="Address the worker's web server binds.")
    web_port: int = Field(6066, ge=0, le=65535, description="Web server port.")
    ready_probe_timeout_ms: float = Field(
        1000.0, gt=0,
        description="How long /ready waits for a bootstrap server to answer a Kafka "
        "ApiVersions request (ms); none answering makes the worker not ready "
        "(broker_responsive). Keep a Kubernetes readinessProbe's timeoutSeconds above it."
        + _bound("ready_probe_timeout_ms"),
    )
    ready_stall_s: float = Field(
        15.0, ge=0,
        description="/ready answers 503 (making_progress) when records wait in the worker's "
        "source partitions and for this long (seconds) no record was read, no offset "
        "committed and no fetch moved a position or high watermark. 0: never."
        + _bound("ready_stall_s"),
    )
    event_loop: Literal["asyncio", "uvloop"] = Field(
        "asyncio",
        description="The worker's event loop: asyncio, or uvloop (pip install "
        "'streamapp[uvloop]'), which measured 2-9 % less CPU per record for a batched Faust "
        "agent (docs/performance.md).",
    )
    log_level: Literal["debug", "info", "warning", "error"] = Field(
        "info", description="Worker log level."
    )

    # -- Tables and web (streamapp.tables, streamapp.views, streamapp.metrics) ---------------------
    web_host: str = Field(
        "",
        description="Host name other workers use to reach this worker's web server (requests "
        "for a device are forwarded to the worker that owns it); default: web_bind, or the "
        "host name when web_bind is 0.0.0.0.",
    )
    web_max_concurrent_requests: int = Field(
        8, ge=1,
        description="Web requests answered at once; one more gets 503 busy with Retry-After "
        "(/health and /ready are never refused). Queries share the event loop with inference."
        + _bound("web_max_concurrent_requests"),
    )
    web_max_requests_per_s: float = Field(
        100.0, ge=0,
        description="Web requests admitted per second (a token bucket: bursts up to one "
        "second's worth; /health and /ready not counted); beyond it 429 rate_limited with "
        "Retry-After. Forwarded device queries count on both workers. 0: no rate bound."
        + _bound("web_max_requests_per_s"),
    )
    web_cache_ms: float = Field(
        250.0, ge=0,
        description="/metrics is rendered, and the /devices listing's snapshot taken, at most "
        "once per this interval (ms); between, answers come from memory. The snapshot is also "
        "kept at least four times as long as taking it lasted." + _bound("web_cache_ms"),
    )
    web_token: SecretStr = Field(
        SecretStr(""),
        description="Bearer token the web API requires (header 'Authorization: Bearer "
        "<token>') on every path but web_open_paths, new routes included; workers forward "
        "device queries with it, so every worker of a group needs the same one. At least 16 "
        "characters of A-Z a-z 0-9 - . _ ~ + / (e.g. python -c 'import secrets; "
        "print(secrets.token_urlsafe(32))'); never printed. Empty (and no web_token_file): "
        "the web API is open to whoever reaches web_bind.",
    )
    web_token_file: Path | None = Field(
        None,
        description="File holding web_token (its first line; read when the worker starts), "
        "e.g. a mounted Kubernetes secret. Set this or web_token, not both.",
    )
    web_open_paths: Annotated[tuple[str, ...], NoDecode] = Field(
        WEB_OPEN_PATHS,
        description="Paths answered without the web token (comma-separated in the "
        "environment; any of /health, /ready, /metrics; empty: none). Only with web_token.",
    )
    tumbling_window_s: float = Field(
        10.0, gt=0,
        description="Size of the per-device tumbling windows (s). Fixed for a deployment: the "
        "stored window buckets have this size; a worker whose stored state was written with "
        "another refuses to start (see accept_window_change).",
    )
    hopping_window_s: float = Field(
        60.0, gt=0,
        description="Size of the per-device hopping windows (s); may change (a hopping window "
        "is summed from hopping_step_s buckets when it is read).",
    )
    hopping_step_s: float = Field(
        10.0, gt=0,
        description="Hopping windows start every this many seconds; hopping_window_s must be a "
        "multiple of it. Fixed for a deployment, like tumbling_window_s.",
    )
    window_expires_s: float = Field(
        3600.0, gt=0,
        description="Windows older than this (s) are deleted from the tables and no longer served."
        + _bound("window_expires_s"),
    )
    accept_window_change: bool = Field(
        False,
        description="Start although the stored device state was written with another "
        "tumbling_window_s or hopping_step_s (logged as a WARNING): totals are kept, windows "
        "start empty at the new sizes, and those of the old sizes are no longer served. Unset, "
        "such a worker refuses to start (exit 1) with the stored and configured values.",
    )
    latency_ewma_alpha: float = Field(
        0.1, gt=0, le=1,
        description="Weight of the newest request in each device's latency EWMA.",
    )
    table_write_buffer_mib: float = Field(
        1.0, ge=0.0625,
        description="Write buffer (memtable) size of each table database, MiB: RocksDB keeps "
        "at most two per database (one taking writes, one being flushed to disk), and a worker "
        "opens one database per table (device_stats, device_windows) and partition it owns, so "
        "its memtables take at most 2 x 2 x partitions x this (64 MiB with all 16 partitions). "
        "Faust's default, 64 MiB x 3 per database, did not fill in 20 minutes at 400 results/s "
        "from 300 devices and grew the tables' process by 83 MiB in 270 s (docs/tables.md, "
        "'Memory'). At least 0.0625 (64 KiB): RocksDB raises a smaller write buffer to that. "
        "Not used with processing_guarantee=exactly_once (memory tables)."
        + _bound("table_write_buffer_mib"),
    )
    table_block_cache_mib: float = Field(
        2.0, ge=0.0625,
        description="Block cache of each table database, MiB (rows read from disk files; rows "
        "written lately are read from the write buffers, and the OS page cache keeps the files "
        "too): at most 2 x partitions owned x this per worker (64 MiB with all 16 partitions). "
        "Faust's default is 2 GiB per database. At least 0.0625 (64 KiB): a smaller value "
        "rounded to a cache of no bytes." + _bound("table_block_cache_mib"),
    )
    table_consistency_check: bool | None = Field(
        None,
        description="Refuse to start when a table's local offset is past the end of its "
        "changelog (Faust's recovery_consistency_check). Unset: on with broker_kind 'kafka', "
        "off with 'embedded' (it under-reports changelog ends, docs/broker.md).",
    )

    @model_validator(mode="after")
    def _check_windows(self) -> Settings:
        ratio = self.hopping_window_s / self.hopping_step_s
        if abs(ratio - round(ratio)) > 1e-9 or round(ratio) < 1:
            raise ValueError(
                f"hopping_window_s ({self.hopping_window_s}) must be a whole multiple of "
                f"hopping_step_s ({self.hopping_step_s}), e.g. 60 and 10"
            )
        longest = max(self.tumbling_window_s, self.hopping_window_s)
        if self.window_expires_s < longest:
            raise ValueError(
                f"window_expires_s ({self.window_expires_s}) must be at least the longest window "
                f"({longest}); raise it or shorten the windows"
            )
        for name in ("tumbling_window_s", "hopping_step_s"):
            value = getattr(self, name)
            if abs(value * 1000 - round(value * 1000)) > 1e-6:
                raise ValueError(f"{name} ({value}) must be a whole number of milliseconds")
        return self

    # -- Security ----------------------------------------------------------------------------------
    # Passed to Faust (broker_credentials) and to every aiokafka client (streamapp.client).
    security_protocol: SecurityProtocol = Field(
        "PLAINTEXT",
        description="How clients talk to Kafka: PLAINTEXT, SSL (TLS), SASL_PLAINTEXT (SASL "
        "without TLS: passwords in clear, test setups only) or SASL_SSL.",
    )
    sasl_mechanism: SaslMechanism = Field(
        "PLAIN", description="SASL mechanism with SASL_PLAINTEXT / SASL_SSL."
    )
    sasl_username: str = Field("", description="SASL user name (required with SASL_*).")
    sasl_password: SecretStr = Field(
        SecretStr(""),
        description="SASL password (required with SASL_*); never printed or logged.",
    )
    ssl_cafile: Path | None = Field(
        None,
        description="PEM file with the CA certificates that signed the brokers' certificates "
        "(SSL / SASL_SSL); default: the system's trust store.",
    )
    ssl_certfile: Path | None = Field(
        None, description="PEM client certificate for mutual TLS (SSL / SASL_SSL)."
    )
    ssl_keyfile: Path | None = Field(
        None, description="PEM private key of ssl_certfile, when not inside that file."
    )
    ssl_key_password: SecretStr = Field(
        SecretStr(""), description="Password of an encrypted ssl_keyfile; never printed."
    )
    ssl_check_hostname: bool = Field(
        True, description="Check that each broker's certificate names its host (SSL / SASL_SSL)."
    )

    @model_validator(mode="after")
    def _check_security(self) -> Settings:
        sasl = self.security_protocol.startswith("SASL_")
        tls = self.security_protocol.endswith("SSL")
        if sasl and not (self.sasl_username and self.sasl_password.get_secret_value()):
            raise ValueError(
                f"security_protocol {self.security_protocol} needs sasl_username and "
                "sasl_password (STREAMAPP_SASL_USERNAME, STREAMAPP_SASL_PASSWORD)"
            )
        if not sasl and (self.sasl_username or self.sasl_password.get_secret_value()):
            raise ValueError(
                f"sasl_username/sasl_password are set but security_protocol is "
                f"{self.security_protocol}; use SASL_SSL (or SASL_PLAINTEXT) to send them"
            )
        files = [n for n in ("ssl_cafile", "ssl_certfile", "ssl_keyfile") if getattr(self, n)]
        if files and not tls:
            raise ValueError(
                f"{', '.join(files)} set but security_protocol is {self.security_protocol}; use "
                "SSL or SASL_SSL for TLS"
            )
        if self.ssl_keyfile and not self.ssl_certfile:
            raise ValueError("ssl_keyfile is set without ssl_certfile; set both for mutual TLS")
        return self

    @model_validator(mode="after")
    def _check_web_token(self) -> Settings:
        if self.web_token.get_secret_value() and self.web_token_file is not None:
            raise ValueError("web_token and web_token_file are both set; set one of them")
        token = self.web_token.get_secret_value()
        if token:
            check_web_token(token, "web_token")
        extra = sorted(set(self.web_open_paths) - set(WEB_OPEN_PATHS))
        if extra:
            raise ValueError(
                f"web_open_paths may list only {', '.join(WEB_OPEN_PATHS)}, not "
                f"{', '.join(extra)}: every other path needs the web token"
            )
        return self

    @field_validator("models", "web_open_paths", mode="before")
    @classmethod
    def _split_lists(cls, value: Any) -> Any:
        if isinstance(value, str):
            return tuple(m.strip() for m in value.split(",") if m.strip())
        return value

    @model_validator(mode="after")
    def _check(self) -> Settings:
        if self.heartbeat_interval_s >= self.session_timeout_s:
            raise ValueError(
                f"heartbeat_interval_s ({self.heartbeat_interval_s}) must be smaller than "
                f"session_timeout_s ({self.session_timeout_s})"
            )
        if not self.models:
            raise ValueError("models is empty; name at least one model, e.g. 'digits'")
        if self.request_timeout_s <= self.session_timeout_s:
            raise ValueError(
                f"request_timeout_s ({self.request_timeout_s}) must be larger than "
                f"session_timeout_s ({self.session_timeout_s}) (Kafka clients require it); "
                "raise STREAMAPP_REQUEST_TIMEOUT_S too"
            )
        if self.fetch_max_wait_ms >= self.request_timeout_s * 1000.0:
            raise ValueError(
                f"fetch_max_wait_ms ({self.fetch_max_wait_ms}) must be shorter than "
                f"request_timeout_s ({self.request_timeout_s} s): the broker holds a fetch that "
                "long when there is nothing to read, and the client gives it up after "
                "request_timeout_s"
            )
        most = TRANSACTION_TIMEOUT_MS / 2
        if self.processing_guarantee == "exactly_once" and self.commit_interval_ms > most:
            raise ValueError(
                f"commit_interval_ms ({self.commit_interval_ms}) must be at most {most:,.0f} "
                "with processing_guarantee=exactly_once: each interval is one Kafka "
                f"transaction, which the broker aborts after {TRANSACTION_TIMEOUT_MS:,} ms "
                "(that stops the worker)"
            )
        return self

    @field_validator("broker")
    @classmethod
    def _broker_addresses(cls, value: str) -> str:
        # Each server as [kafka://]host:port with a TCP port: a port past 65535 reached the
        # socket layer as a traceback (OverflowError) in every command, and any other scheme
        # (http://, tcp://, SASL_SSL://) was dropped silently by bootstrap_servers.
        parts = [p.strip() for p in value.replace(",", ";").split(";") if p.strip()]
        if not parts:
            raise PydanticCustomError(
                "broker_empty", "names no bootstrap server: give {forms}, e.g. "
                "kafka://127.0.0.1:9092", {"forms": BROKER_FORMS},
            )
        if "@" in value:
            # kafka://user:password@host:port: checked first, and the value never echoed (it
            # would show the password in this error and in every later one).
            raise PydanticCustomError(
                "broker_userinfo",
                "holds user info (user:password@ before a host): a bootstrap server is "
                "{forms}; give credentials as STREAMAPP_SASL_USERNAME and "
                "STREAMAPP_SASL_PASSWORD with STREAMAPP_SECURITY_PROTOCOL=SASL_SSL",
                {"forms": BROKER_FORMS},
            )
        for part in parts:
            scheme, sep, address = part.partition("://")
            if not sep:
                address = part
            elif scheme.lower() != "kafka":
                # A listener's protocol name (SASL_SSL://host:port) is a setting of its own.
                hint = (
                    f"; the protocol is set by STREAMAPP_SECURITY_PROTOCOL={scheme.upper()}"
                    if scheme.upper() in get_args(SecurityProtocol) else ""
                )
                raise PydanticCustomError(
                    "broker_scheme",
                    "{part} has the scheme {scheme}://, not Kafka's: give "
                    "{forms}{hint}",
                    {"part": repr(part), "scheme": scheme, "forms": BROKER_FORMS, "hint": hint},
                )
            host, sep, port = address.rpartition(":")
            # isascii: str.isdigit() and int() also take other scripts' digits ('٥٩٧٧٣')
            if (not sep or not host or "/" in host or not port.isascii() or not port.isdigit()
                    or not 1 <= int(port) <= 65535):
                raise PydanticCustomError(
                    "broker_address",
                    "{part} is not host:port with a port of 1-65535: give {forms}, e.g. "
                    "kafka://127.0.0.1:9092",
                    {"part": repr(part), "forms": BROKER_FORMS},
                )
        return value

    @field_validator(*UPPER_BOUNDS)
    @classmethod
    def _at_most(cls, value: float, info: ValidationInfo) -> float:
        bound, why = UPPER_BOUNDS[str(info.field_name)]
        if value > bound:
            raise PydanticCustomError(
                "at_most", "must be at most {bound}, not {got}: {why}",
                {"bound": f"{bound:,.0f}", "got": _shown_number(value), "why": why},
            )
        return value

    @field_validator("backend")
    @classmethod
    def _known_backend(cls, value: str) -> str:
        # Test-only backends are registered only by tests (engines.testing), so production
        # settings cannot name them.
        names = registered_backends()
        if value != AUTO and value not in names:
            raise ValueError(
                f"unknown backend {value!r}; use {AUTO!r} or one of: {', '.join(names)}"
            )
        return value

    @field_validator("log_level", mode="before")
    @classmethod
    def _lower_log_level(cls, value: Any) -> Any:
        return value.lower() if isinstance(value, str) else value

    # -- Derived -----------------------------------------------------------------------------------
    def topic(self, name: str) -> str:
        """Full topic name for a logical name: ``request`` → ``<prefix>inference-request``."""
        return f"{self.topic_prefix}inference-{name}"

    @property
    def request_topic(self) -> str:
        return self.topic("request")

    @property
    def result_topic(self) -> str:
        return self.topic("result")

    @property
    def dlq_topic(self) -> str:
        return self.topic("dlq")

    @property
    def retry_topic(self) -> str:
        return self.topic("retry")

    @property
    def topics(self) -> tuple[str, ...]:
        """Every topic the worker reads or writes (create them with ``topic_partitions``)."""
        return (self.request_topic, self.result_topic, self.dlq_topic, self.retry_topic)

    @property
    def changelog_topic_configs(self) -> dict[str, str]:
        """Topic configs of the tables' changelogs (Faust adds ``cleanup.policy=compact``)."""
        return {"segment.ms": str(self.changelog_segment_ms)}

    @property
    def bootstrap_servers(self) -> str:
        """``host:port,host2:port`` for plain Kafka clients (aiokafka)."""
        parts = [p.strip() for p in self.broker.replace(",", ";").split(";") if p.strip()]
        return ",".join(p.split("://", 1)[-1] for p in parts)

    @property
    def consistency_check(self) -> bool:
        """Whether Faust's table consistency check is on (``table_consistency_check``, else
        on for Apache Kafka and off for the embedded broker)."""
        if self.table_consistency_check is not None:
            return self.table_consistency_check
        return self.broker_kind != "embedded"

    @property
    def faust_broker(self) -> str:
        """The broker list in Faust's URL form."""
        return ";".join(f"kafka://{s}" for s in self.bootstrap_servers.split(","))


#: Prefix of the environment variables that set :class:`Settings` fields.
ENV_PREFIX = "STREAMAPP_"
#: Variables with :data:`ENV_PREFIX` that are not settings but read elsewhere in the project:
#: the Apache Kafka jar cache and the broker's JVM options (``streamapp.kafka_server``'s
#: ``HOME_ENV`` and ``JVM_OPTS_ENV``; a test keeps the two lists equal). A worker started
#: where they are set (the benchmark, a shell that ran ``streamapp broker --kafka``) ignores them.
OTHER_ENV = frozenset({"STREAMAPP_KAFKA_HOME", "STREAMAPP_KAFKA_JVM_OPTS"})


def check_web_token(token: str, source: str) -> str:
    """``token`` if it can be a web token (RFC 6750 characters, at least
    :data:`WEB_TOKEN_MIN_CHARS` long).

    Raises:
        ValueError: It cannot; the message names ``source``, never the token.
    """
    if not _WEB_TOKEN_RE.fullmatch(token) or len(token) < WEB_TOKEN_MIN_CHARS:
        raise ValueError(
            f"{source} must be at least {WEB_TOKEN_MIN_CHARS} characters of A-Z a-z 0-9 - . _ "
            f"~ + / (the value given, of {len(token)} characters, is not); make one with "
            "python -c 'import secrets; print(secrets.token_urlsafe(32))'"
        )
    return token


def web_token(settings: Settings) -> str:
    """The web API's bearer token: ``web_token``, or the first line of ``web_token_file``;
    "" when neither is set (the web API is open). Holds the secret: never log it.

    Raises:
        ConfigError: The file cannot be read, or what it holds cannot be a token.
    """
    if settings.web_token_file is None:
        return settings.web_token.get_secret_value()
    path = settings.web_token_file
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        why = exc.strerror if isinstance(exc, OSError) and exc.strerror else type(exc).__name__
        raise ConfigError(
            f"web_token_file {str(path)!r} cannot be read ({why}); give a readable file whose "
            "first line is the token (STREAMAPP_WEB_TOKEN_FILE)"
        ) from None
    try:
        return check_web_token(lines[0].strip() if lines else "", f"web_token_file {str(path)!r}")
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


def load_settings(**overrides: Any) -> Settings:
    """Build settings from the environment, with ``overrides`` (e.g. CLI flags) on top.

    ``None`` overrides are ignored, so CLI options default to "not given".

    Raises:
        ConfigError: A value is invalid; the message names the field and the problem.
    """
    given = {k: v for k, v in overrides.items() if v is not None}
    fields = Settings.model_fields
    # The settings are read whatever the case of the names, so the check ignores it too.
    unknown = sorted(
        name for name in os.environ
        if name.upper().startswith(ENV_PREFIX) and name[len(ENV_PREFIX):].lower() not in fields
        and name.upper() not in OTHER_ENV
    )
    if unknown:
        known = [f"{ENV_PREFIX}{f.upper()}" for f in Settings.model_fields]
        hints = [
            f"{name} (did you mean {close[0]}?)" if (close := difflib.get_close_matches(
                name.upper(), known, n=1)) else name
            for name in unknown
        ]
        raise ConfigError(f"unknown setting(s) in the environment: {', '.join(hints)}")
    try:
        return Settings(**given)
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in err['loc']) or 'settings'}: {err['msg']}"
            + _echoed_input(err)
            for err in exc.errors()
        )
        raise ConfigError(
            f"invalid settings ({problems}); environment variables use the prefix STREAMAPP_"
        ) from exc


#: pydantic errors of numbers and choices whose message does not show the value given.
_ECHOED_ERRORS = frozenset({"greater_than", "greater_than_equal", "less_than",
                            "less_than_equal", "literal_error", "enum"})


def _echoed_input(err: Any) -> str:
    """``, got '1e30'`` for a value that did not parse as its number or flag type (pydantic
    says only "unable to parse string as an integer"), or ``, got -5`` for a number below its
    minimum or a choice not offered, cut after :data:`_MAX_SHOWN_CHARS` characters; nothing
    for other errors, whose messages say what was wrong (a refused secret is never echoed:
    strings always parse and have no bounds)."""
    kind, given = str(err.get("type", "")), err.get("input")
    if kind.endswith("_parsing") and isinstance(given, str):
        text = given
    elif kind in _ECHOED_ERRORS and isinstance(given, (str, int, float)):
        text = given if isinstance(given, str) else _shown_number(given)
    else:
        return ""
    if len(text) > _MAX_SHOWN_CHARS:
        text = f"{text[:_MAX_SHOWN_CHARS - 1]}…"
    return f", got {text!r}" if isinstance(given, str) else f", got {text}"


def settings_reference() -> str:
    """A Markdown table of every setting: environment variable, type, default, description.

    The settings reference in docs/settings.md is this output (a test keeps them in sync).
    """
    rows = ["| variable | type | default | description |", "|---|---|---|---|"]
    for name, info in Settings.model_fields.items():
        args = get_args(info.annotation)
        if get_origin(info.annotation) is Literal:
            annotation = " / ".join(f"`{a}`" for a in args)
        elif info.annotation is not None and getattr(info.annotation, "__metadata__", None):
            annotation = "comma-separated list"
        else:
            annotation = getattr(info.annotation, "__name__", None) or str(info.annotation)
            annotation = annotation.replace("typing.", "").replace("pathlib.", "")
        default = info.default
        if isinstance(default, tuple):
            default = ",".join(default)
        rows.append(
            f"| `STREAMAPP_{name.upper()}` | {annotation.replace('|', 'or')} | `{default}` | "
            f"{info.description or ''} |"
        )
    return "\n".join(rows)
