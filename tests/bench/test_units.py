"""The benchmark's own arithmetic: profile attribution, result parsing, ratios."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.profile import summarize
from bench.report import format_report, ratios
from bench.workloads import result_parse, workload
from streamapp.codecs import encode_result


def test_profile_attributes_samples_to_the_innermost_known_package(tmp_path: Path) -> None:
    raw = tmp_path / "p.txt"
    raw.write_text(
        "thread (1): MainThread;run (/x/asyncio/base_events.py:1);"
        "_emit (/x/streamapp/agents/pipeline.py:9);dumps (/x/json/__init__.py:3) 30\n"
        "thread (1): MainThread;run (/x/asyncio/base_events.py:1);"
        "send (/x/faust/topics.py:2);send (/x/aiokafka/producer.py:5) 20\n"
        "thread (1): MainThread;_run_once (/x/asyncio/base_events.py:1) 10\n"
        "thread (2): cuda-pack_0;pack (/x/engines/executor/cuda.py:4) 5\n"
    )

    summary = summarize(raw, rate=100, duration_s=1.0)

    assert summary["main_busy_pct"] == 60.0
    assert summary["main_by_group"] == {"streamapp": 30.0, "aiokafka": 20.0, "asyncio": 10.0}
    assert summary["ours_pct"] == 30.0
    assert summary["threads"]["cuda-pack_0"] == 5.0


def test_result_parse_recovers_the_request_ts() -> None:
    value = encode_result({"request_id": "r", "ts": 1_800_000_000.25, "e2e_ms": 250.0,
                           "batch_size": 7}, "json")

    ts, size = result_parse(value)

    assert ts == pytest.approx(1_800_000_000.0) and size == 7


def test_digits_payload_is_a_valid_request() -> None:
    from streamapp.codecs import check_key, decode_request

    wl = workload("digits", run="t")
    key, value = wl.payload(17, 1_800_000_000.0)
    request = decode_request(value, now=1_800_000_000.0)

    check_key(key, request)
    assert (request.device_id, request.seq, request.model) == ("device-01", 1, "digits")
    assert request.tensor is not None and request.tensor.shape == (8, 8)


def test_ratios_and_report() -> None:
    results = {
        "profile": "t", "env": {}, "workloads": {"w": {
            "describe": "d", "payload_bytes": 1,
            "plan": {"delay_ms": 5.0, "batch": 32, "backend": "x", "inflight": 2,
                     "partitions": 4, "async_inflight": 4},
            "engine": {"items_per_s": 10_000.0, "batch_ms_p50": 1.0, "batch": 32,
                       "mode": "infer"},
            "transport": {"msgs_per_s": 50_000.0, "mb_per_s": 1.0},
            "saturation": {"results_per_s": 9_000.0, "window": 10},
            "open_loop": [{"level": 0.7, "rate": 6300.0, "results_per_s": 6300.0,
                           "p50_ms": 4.0, "p95_ms": 6.0, "p99_ms": 16.0, "complete": True}],
            "seeds": {"sync": {"results_per_s": 900.0}, "async": {"results_per_s": 2000.0},
                      "dynamic": {"results_per_s": 9_000.0}},
        }},
    }

    r = ratios(results)["w"]

    assert r["product_over_limit"] == pytest.approx(0.9) and r["limit"] == "engine"
    assert r["dynamic_over_sync"] == pytest.approx(10.0)
    assert r["p99_over_budget"] == pytest.approx(16.0 / 8.0)
    text = format_report(results)
    assert "900 → 2,000 → 9,000 req/s" in text
    assert text.strip().splitlines()[-1].startswith("  w: product / min(engine, transport)")
