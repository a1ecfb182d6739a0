"""``python -m bench hotpath``: its arithmetic, and one tiny run end to end on the embedded
broker so that it cannot rot (the real measurement is ``make bench-hotpath`` on Apache
Kafka)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench.hotpath import HotpathConfig, batch_summary, format_hotpath, hotpath_ratios

ROOT = Path(__file__).resolve().parents[2]


def test_batch_sizes_are_summarised_per_result_and_per_batch() -> None:
    # one batch of 64, two of 4, one of 1: 73 results
    sizes = [64] * 64 + [4] * 8 + [1]

    s = batch_summary(sizes, 64)

    assert s["mean_batch"] == pytest.approx((64 * 64 + 4 * 8 + 1) / 73, abs=0.01)
    assert s["mean_batch_per_batch"] == pytest.approx(73 / 4)
    assert s["full_fraction"] == pytest.approx(64 / 73, abs=1e-4)
    assert s["batch_hist"] == {1: 1, 4: 8, 64: 64}


def test_ratios_compare_the_product_with_the_yardstick_against_issue_17s_targets() -> None:
    rungs = {"yardstick": {"cpu_us_per_record_self": 80.0, "records_per_s": 12_000.0},
             "product": {"cpu_us_per_record_self": 100.0, "records_per_s": 6_000.0,
                         "mean_batch": 56.0}}

    r = hotpath_ratios(rungs, 64)

    assert r["cpu_per_record"] == {"value": 1.25, "target": 1.4, "op": "<=", "met": True}
    assert r["rate"]["value"] == 0.5 and r["rate"]["met"] is False
    assert r["batch_fill"]["value"] == 0.875 and r["batch_fill"]["met"] is True
    assert hotpath_ratios({"product": rungs["product"]}, 64)["rate"]["met"] is None


def test_at_a_paced_rate_the_ratios_have_no_target_and_there_is_no_batch_fill() -> None:
    rungs = {"yardstick": {"cpu_us_per_record_self": 400.0, "records_per_s": 1_000.0},
             "product": {"cpu_us_per_record_self": 500.0, "records_per_s": 990.0,
                         "mean_batch": 6.0}}

    r = hotpath_ratios(rungs, 64, paced=True)

    assert r == {"cpu_per_record": {"value": 1.25, "target": None, "op": "", "met": None},
                 "rate": {"value": 0.99, "target": None, "op": "", "met": None}}


def test_worker_env_overrides_the_worker_settings_and_the_yardsticks_batch() -> None:
    config = HotpathConfig(worker_env={"STREAMAPP_MAX_BATCH_SIZE": "128", "OMP_NUM_THREADS": "1"})

    settings = config.worker_settings()

    assert settings["max_batch_size"] == "128" and config.batch_bound == 128
    assert "omp_num_threads" not in settings and settings["models"] == "digits"


@pytest.mark.slow
@pytest.mark.kafka
@pytest.mark.timeout(300)
def test_hotpath_measures_both_rungs(tmp_path: Path) -> None:
    out = tmp_path / "hotpath"
    proc = subprocess.run(
        [sys.executable, "-m", "bench", "hotpath", "--requests", "2000", "--broker", "embedded",
         "--out", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=280,
    )

    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = json.loads((out / "bench.json").read_text())
    for name in ("yardstick", "product"):
        rung = results["rungs"][name]
        assert rung["complete"] and rung["records"] >= 2000, rung
        assert rung["records_per_s"] > 0 and rung["cpu_us_per_record_self"] > 0
    product = results["rungs"]["product"]
    assert product["other"] == 0  # no dead letters
    assert 1 <= product["mean_batch"] <= 64 and sum(product["batch_hist"].values()) == 2000
    assert results["ratios"]["cpu_per_record"]["value"] > 0
    assert (out / "report.txt").read_text() == format_hotpath(results) + "\n"


@pytest.mark.slow
@pytest.mark.kafka
@pytest.mark.timeout(300)
def test_hotpath_at_a_paced_rate_measures_the_paced_records_only(tmp_path: Path) -> None:
    out = tmp_path / "paced"
    proc = subprocess.run(
        [sys.executable, "-m", "bench", "hotpath", "--rate", "400", "--requests", "800",
         "--warmup", "300", "--rungs", "product", "--broker", "embedded", "--out", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=280,
    )

    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = json.loads((out / "bench.json").read_text())
    product = results["rungs"]["product"]
    assert product["complete"] and product["records"] == 300 + 800, product
    # the span starts at the fetch that completed the warm-up (the paced sends start then):
    # it holds the 800 paced records, which cannot come out faster than they are sent
    assert product["span_records"] == 800, product
    assert product["span_s"] >= 799 / 400, product
    assert product["rate"] == 400.0 and product["cpu_us_per_record_self"] > 0
    assert "sent at 400/s once a warm-up of 300 drained" in (out / "report.txt").read_text()
