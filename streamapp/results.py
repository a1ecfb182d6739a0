"""Reading and showing the records of ``inference-result``: ``streamapp results tail``.

The topic is read with :class:`streamapp.tail.TopicReader` (no consumer group, nothing
committed; the end is the fetch high watermark). Every record becomes a :class:`ResultEntry`:
a result, or — for anything else someone wrote to the topic — the reason it is not one, shown as
one line of its own instead of stopping the read.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from aiokafka import TopicPartition
from aiokafka.structs import ConsumerRecord

from streamapp.codecs import decode_result
from streamapp.tail import TopicReader, cell, pad

__all__ = [
    "RESULT_HEADER",
    "ResultEntry",
    "ResultReader",
    "check_result",
    "format_result_json",
    "format_result_line",
]

#: Column widths of :func:`format_result_line`: 74 characters and 5 one-space gaps, so that a
#: line (79 characters at most) fits an 80-column terminal without wrapping. The model column
#: holds the bundled model's name and engine tag whole (``digits onnxruntime-1.32.0:1ec95d21``).
_WIDTHS = {"device": 12, "seq": 7, "model": 34, "label": 8, "score": 6, "e2e_ms": 7}
_RIGHT = {"seq", "score", "e2e_ms"}
_LINE_MAX = sum(_WIDTHS.values()) + len(_WIDTHS) - 1
#: Characters kept at the end of a cut engine tag: ``:`` and the 8 hex digits of the model hash.
_TAG_TAIL = 9


def _join(cells: dict[str, str]) -> str:
    return " ".join(pad(cells[c], w, right=c in _RIGHT) for c, w in _WIDTHS.items()).rstrip()


#: The column names, aligned with :func:`format_result_line`.
RESULT_HEADER = _join({c: c.upper() for c in _WIDTHS} | {"model": "MODEL ENGINE"})


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def check_result(body: Any) -> dict[str, Any]:
    """``body`` if it has the result fields a line shows, with the right types.

    Args:
        body: A decoded result value (:func:`streamapp.codecs.decode_result`).

    Returns:
        ``body``, unchanged.

    Raises:
        ValueError: Not a mapping, or which field is missing or of which wrong type.
    """
    if not isinstance(body, dict):
        raise ValueError(f"a {type(body).__name__}, not a result object")
    kinds: dict[str, tuple[type, ...]] = {
        "request_id": (str,), "device_id": (str,), "model": (str,), "engine": (str,),
        "outputs": (dict,),
    }
    for name, kind in kinds.items():
        if name not in body:
            raise ValueError(f"no {name!r} field")
        if not isinstance(body[name], kind):
            raise ValueError(f"{name!r} is a {type(body[name]).__name__}, not a {kind[0].__name__}")
    if not isinstance(body.get("seq"), int) or isinstance(body["seq"], bool):
        raise ValueError(f"'seq' is {body.get('seq')!r}, not an integer")
    if not _number(body.get("e2e_ms")):
        raise ValueError(f"'e2e_ms' is {body.get('e2e_ms')!r}, not a number")
    top_k = body["outputs"].get("top_k")
    if top_k is not None and not (
        isinstance(top_k, list)
        and all(isinstance(t, dict) and "label" in t and _number(t.get("score")) for t in top_k)
    ):
        raise ValueError("'outputs.top_k' is not a list of {label, score}")
    return body


@dataclass(frozen=True, slots=True)
class ResultEntry:
    """One record of the result topic and where it is.

    Attributes:
        result: The result (``InferenceResult.to_dict()`` fields), or None when the record is
            not a valid result.
        problem: Why it is not one (None for a result).
        partition / offset: Its position in the result topic.
        timestamp_ms: The record's Kafka timestamp (epoch milliseconds).
        key: The record key (the device id, for results the worker wrote).
        size: The value's length in bytes.
    """

    result: dict[str, Any] | None
    problem: str | None
    partition: int
    offset: int
    timestamp_ms: int
    key: bytes | None
    size: int

    @property
    def device(self) -> str:
        """``device_id``, else the key (UTF-8), else ``"-"``."""
        if self.result is not None:
            return str(self.result["device_id"])
        return "-" if self.key is None else self.key.decode("utf-8", "replace")

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: the result's fields plus ``record`` (partition, offset, timestamp_ms);
        for an invalid record ``invalid`` (the problem), ``key`` and ``record`` instead."""
        position = {"partition": self.partition, "offset": self.offset,
                    "timestamp_ms": self.timestamp_ms}
        if self.result is None:
            return {"invalid": self.problem, "key": None if self.key is None else self.device,
                    "size": self.size, "record": position}
        return {**self.result, "record": position}


class ResultReader(TopicReader[ResultEntry]):
    """Reads a result topic (``settings.result_topic``); see :class:`streamapp.tail.TopicReader`.

    Every record yields an entry: records that are not results carry ``problem``.
    """

    def decode(self, tp: TopicPartition, record: ConsumerRecord[Any, Any]) -> ResultEntry:
        value = record.value or b""
        result: dict[str, Any] | None = None
        problem = None
        try:
            body = decode_result(value)
        except Exception as exc:  # anything at all someone wrote to the topic
            problem = f"neither JSON nor msgpack ({type(exc).__name__}: {exc})"
        else:
            try:
                result = check_result(body)
            except ValueError as exc:
                problem = str(exc)
        return ResultEntry(result, problem, tp.partition, record.offset, record.timestamp,
                           record.key, len(value))


def _middle_cut(value: str, width: int) -> str:
    """``value`` cut in the middle to ``width``, keeping its last :data:`_TAG_TAIL` characters
    (the model hash of an engine tag tells two versions apart)."""
    if len(value) <= width:
        return value
    tail = min(_TAG_TAIL, width // 2)
    return value[: width - tail - 1] + "…" + value[-tail:]


def _model_cell(result: dict[str, Any]) -> str:
    """``digits v2 onnxruntime-1.20.1:1ec95d21``: model, version (results written before
    versions existed have none) and engine tag."""
    version = result.get("model_version")
    named = f"{result['model']} v{version}" if isinstance(version, str) else result["model"]
    return f"{named} {result['engine']}"


def format_result_line(entry: ResultEntry) -> str:
    """One line of at most 79 characters (an 80-column terminal), aligned with
    :data:`RESULT_HEADER`: device, seq, model and engine tag, top label and score, e2e latency
    (ms). A record that is not a result reads ``partition@offset  not a result (key, size):
    problem``.

    Long cells end with "…"; the engine tag is cut in its middle so that its model hash stays,
    a seq above 9,999,999 keeps its last digits (``…2345678``), the ones that change, and a
    latency of 100 s or more is written in seconds with its unit (``98765s``).
    Results without ``outputs.top_k`` (named tensors) show ``-`` for label and score; a
    request a queue policy kept from the engine shows its ``outcome`` (``expired``,
    ``superseded``) in full as the label: a label longer than its column runs on into the
    score column where there is no score.
    """
    if entry.result is None:
        key = "no key" if entry.key is None else f"key {entry.device!r}"
        return cell(
            f"{entry.partition}@{entry.offset}  not a result ({key}, {entry.size} B): "
            f"{entry.problem}", _LINE_MAX,
        )
    r = entry.result
    top = (r["outputs"].get("top_k") or [None])[0]
    e2e = float(r["e2e_ms"])
    cells = {
        "device": entry.device,
        "seq": str(r["seq"]),
        "model": _middle_cut(_model_cell(r), _WIDTHS["model"]),
        "label": str(r.get("outcome", "-")) if top is None and r.get("outcome", "answered")
        != "answered" else "-" if top is None else str(top["label"]),
        "score": "-" if top is None else f"{float(top['score']):.3f}",
        "e2e_ms": f"{e2e:.1f}" if e2e < 100_000 else f"{e2e / 1000:.0f}s",
    }
    seq = cells.pop("seq")
    cut = {c: cell(v, _WIDTHS[c]) for c, v in cells.items()}
    cut["seq"] = seq if len(seq) <= _WIDTHS["seq"] else "…" + seq[1 - _WIDTHS["seq"]:]
    if cells["score"] == "-" and len(cells["label"]) > _WIDTHS["label"]:
        # no score to show (``superseded``, a long label of a result without scores): the
        # label runs on into the score column up to its right-aligned "-"
        wide = _WIDTHS["label"] + _WIDTHS["score"] - 1
        widths = {**_WIDTHS, "label": wide + 2}
        cut["label"] = pad(cells["label"], wide) + " -"
        return " ".join(pad(cut[c], w, right=c in _RIGHT) for c, w in widths.items()
                        if c != "score").rstrip()
    return _join(cut)


def _jsonable(value: Any) -> Any:
    if isinstance(value, bytes):  # msgpack results may carry raw bytes
        return base64.b64encode(value).decode("ascii")
    raise TypeError(f"{type(value).__name__} is not JSON serializable")


def format_result_json(entries: Iterable[ResultEntry]) -> str:
    """One JSON object per entry and line (:meth:`ResultEntry.to_dict`; bytes as base64)."""
    return "\n".join(
        json.dumps(e.to_dict(), separators=(",", ":"), default=_jsonable) for e in entries
    )
