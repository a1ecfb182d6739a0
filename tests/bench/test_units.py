"""The benchmark's own arithmetic: profile attribution, result parsing, ratios."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from bench.profile import describe, summarize
from bench.report import format_report, format_scaleout, ratios, scaleout_targets
from bench.scaleout import SCALE_PROFILES, limiting, run_scaleout, summarize_series
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
    line = describe(summary)
    assert line.startswith("event-loop thread busy 60 %; streamapp 30 %, aiokafka 20 %")
    assert "_emit (agents/pipeline.py) 30.0 %" in line and "cuda-pack_0 5 %" in line
    assert describe({"skipped": "py-spy not installed"}) == "py-spy not installed"


def test_result_parse_recovers_the_request_ts() -> None:
    value = encode_result({"request_id": "r", "ts": 1_800_000_000.25, "e2e_ms": 250.0,
                           "queue_ms": 12.5, "infer_ms": 3.0, "batch_size": 7}, "json")

    ts, size, stages = result_parse(value)

    assert ts == pytest.approx(1_800_000_000.0) and size == 7
    assert stages == (12.5, 3.0, 250.0)


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


def _point(n: int, rate: float | None, workers_cpu: float, *, broker: float = 50.0,
           host: float = 60.0, gpu: float | None = None, cores: int = 16) -> dict[str, Any]:
    util: dict[str, Any] = {"cpu_pct": {**{f"w{i}": workers_cpu for i in range(n)},
                                        "broker": broker},
                            "machine_cpu_pct": host, "cores": cores}
    if gpu is not None:
        util["gpu_util_pct"] = gpu
    return {"n": n, "backlog": 1000 * n, "outcomes": 1000 * n, "complete": True,
            "results_per_s": rate, "utilisation": util}


def test_limiting_resource_is_the_one_nearest_its_limit() -> None:
    assert limiting(_point(2, 1000.0, 97.0))[0] == "worker CPU"
    assert limiting(_point(8, 1000.0, 40.0, gpu=91.0))[0] == "GPU"
    assert limiting(_point(8, 1000.0, 40.0, broker=1400.0))[0] == "broker CPU"
    assert limiting(_point(2, 1000.0, 40.0, host=95.0, cores=2))[0] == "host CPU"
    # Workers at 60 % with the aiokafka clients at 1,100/s for the same N: transport.
    limit, fractions = limiting(_point(4, 1000.0, 60.0), transport_per_s=1100.0)
    assert limit == "transport" and fractions["transport"] == pytest.approx(0.91)
    assert limiting(_point(4, 1000.0, 30.0))[0] == "none"


def _section() -> dict[str, Any]:
    return {
        "profile": "gpu", "launcher": "own",
        "plans": [{"workload": "digits", "backend": "torch", "batch": 64, "delay_ms": 5.0,
                   "inflight": 2, "partitions": 32, "devices": 256, "backlog_max": 36_000,
                   "backlog_per_worker": 3_000}],
        "engine": {"resnet50-tensor": {"items_per_s": 13_700.0, "batch": 64}},
        "series": {
            "digits workers": {"workload": "digits", "kind": "workers", "mps": False,
                               "points": [_point(8, 13_000.0, 99.0), _point(1, 2_000.0, 99.0)]},
            "digits faust": {"workload": "digits", "kind": "faust", "mps": False,
                             "points": [_point(1, 3_000.0, 99.0)]},
            "resnet50-tensor workers": {
                "workload": "resnet50-tensor", "kind": "workers", "mps": False,
                "points": [_point(1, 300.0, 100.0), _point(8, 1_200.0, 80.0, gpu=40.0)]},
            "resnet50-tensor aiokafka": {
                "workload": "resnet50-tensor", "kind": "aiokafka", "mps": False,
                "points": [_point(8, 4_000.0, 50.0)]},
            "resnet50-tensor workers MPS": {
                "workload": "resnet50-tensor", "kind": "workers", "mps": True,
                "points": [_point(8, 1_500.0, 80.0, gpu=55.0)]},
        },
        "skipped": ["digits faust N=12: SKIPPED, estimated 16 s and 15 s of the budget left"],
    }


def test_scaleout_efficiency_and_targets() -> None:
    section = _section()

    rows = summarize_series(section)

    assert [r["n"] for r in rows["digits workers"]] == [1, 8]
    assert rows["digits workers"][1]["efficiency"] == pytest.approx(13_000 / (8 * 2_000))
    # The transport fraction of a worker series comes from the aiokafka clients at that N.
    assert rows["resnet50-tensor workers"][1]["fractions"]["transport"] == pytest.approx(0.3)
    targets = {t["name"]: t for t in scaleout_targets(section)}
    assert targets["digits workers: N=8 ÷ (8 × N=1)"]["ok"] is True  # 0.8125
    assert targets["digits workers: largest aggregate (N=8)"]["ok"] is False
    assert targets["digits workers: one worker"]["ok"] is True
    assert targets["digits: one worker ÷ one Faust forwarder (backlog drain)"]["value"] == "0.67"
    resnet = targets["resnet50-tensor workers N=8: aggregate ÷ min(engine, aiokafka clients at "
                     "this N)"]
    assert resnet["value"] == "0.30" and resnet["ok"] is False
    assert targets["resnet50-tensor N=8: with ÷ without CUDA MPS"]["value"] == "1.25"
    assert targets["recommendation (largest N with both)"]["value"] == "CUDA MPS"
    text = "\n".join(format_scaleout(section))
    assert "SKIPPED: digits faust N=12" in text
    assert "efficiency" in text and "→ SHORT" in text


def test_scaleout_targets_say_so_when_no_drain_could_be_timed() -> None:
    """A fast machine drains the smoke profile's tiny backlogs too quickly to time: the targets
    block still names the series and says why it has no value (CI, 2026-12-02)."""
    section = {"plans": [], "engine": {}, "series": {"digits workers": {
        "workload": "digits", "kind": "workers", "mps": False,
        "points": [{**_point(n, None, 50.0), "too_short": True} for n in (1, 2)]}}}

    targets = scaleout_targets(section)

    assert [(t["name"], t["value"], t["ok"]) for t in targets] == [
        ("digits workers: every drain too short to time", "-", None)]
    text = "\n".join(format_scaleout(section))
    assert "scale-out targets (issue 9" in text and "too short to time" in text


def test_gpu_plan_fits_its_budget_and_cuts_the_least_important_last() -> None:
    logged: list[str] = []
    results: dict[str, Any] = {}

    budget = 360
    run_scaleout(SCALE_PROFILES["gpu"], results, Path("."), log=logged.append, budget_s=budget,
                 dry_run=True)

    planned = [line.split(":")[0].strip() for line in logged if "about" in line]
    skipped = results["scaleout"]["skipped"]
    assert planned[0] == "digits workers N=1"
    assert "resnet50-tensor workers N=12" in planned
    assert skipped and all("SKIPPED" in s for s in skipped)
    # MPS comes after the worker series and the key ceilings: a 360 s budget cuts it.
    assert not any("with CUDA MPS" in p for p in planned)
    assert any(s.startswith("resnet50-tensor workers N=8 with CUDA MPS: SKIPPED") for s in skipped)
    last_total = [line for line in logged if "(total" in line][-1]
    assert float(last_total.split("(total ")[1].split(" s)")[0]) <= budget


def test_the_benchmark_modules_import_each_other_in_one_direction() -> None:
    """bench.run uses bench.scaleout, which uses bench.common; never the way back (issue 17)."""
    import ast

    root = Path(__file__).resolve().parents[2] / "bench"

    def imported(name: str) -> set[str]:
        tree = ast.parse((root / f"{name}.py").read_text())
        found = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module:
                found.add(node.module)
                found.update(f"{node.module}.{a.name}" for a in node.names)
            elif isinstance(node, ast.Import):
                found.update(a.name for a in node.names)
        return found

    assert "bench.scaleout" in imported("run")
    assert not {"bench.run", "bench.hotpath"} & imported("scaleout")
    assert not {"bench.run", "bench.scaleout", "bench.hotpath"} & imported("common")


def test_each_gpu_of_a_multi_gpu_host_gets_its_own_mean_utilisation() -> None:
    from bench.procs import Sampler, gpu_sample

    sampler = Sampler({})
    sampler.samples = [
        {"t": float(t), "cpu": {}, "rss": {}, "machine_cpu": 10.0,
         "gpu": gpu_sample([u0, u1], 1024.0)}
        for t, (u0, u1) in enumerate([(90.0, 10.0), (70.0, 30.0)])]

    util = sampler.summary(0.0, 1.0)

    assert util["gpu_util_pct"] == 50.0  # the mean over both GPUs
    assert util["gpu_util_pct_per_gpu"] == [80.0, 20.0]
    one = Sampler({})
    one.samples = [{"t": 0.0, "cpu": {}, "rss": {}, "machine_cpu": 1.0,
                    "gpu": gpu_sample([40.0], 10.0)}]
    assert "gpu_util_pct_per_gpu" not in one.summary(0.0, 1.0)  # one GPU: the mean says it all


def test_worker_ports_are_chosen_below_the_ephemeral_range(monkeypatch: pytest.MonkeyPatch) -> None:
    """An outgoing connection can take a port of the OS's ephemeral range between the check and
    the worker's bind, and a GET on a port nobody listens on can connect to itself there (H200,
    2026-12-03): the N workers' ports lie below that range and were free a moment ago."""
    import socket

    from bench import scaleout

    monkeypatch.setattr(scaleout, "_ephemeral_low", lambda: 40_000)
    for _ in range(20):
        base = scaleout._free_port_range(16)
        assert 28_000 <= base and base + 16 <= 40_000
        with socket.socket() as s:
            s.bind(("127.0.0.1", base + 15))


def test_ceilings_override_leaves_the_worker_series_alone() -> None:
    logged: list[str] = []
    results: dict[str, Any] = {}

    run_scaleout(SCALE_PROFILES["gpu"], results, Path("."), log=logged.append, budget_s=10_000,
                 dry_run=True, only=("digits",), ns=(8, 16), ceilings=())

    planned = [line.split(":")[0].strip() for line in logged if "about" in line]
    assert planned == ["digits workers N=8", "digits workers N=16"]


def _make_cycles(n: int) -> None:
    for _ in range(n):
        a: list[Any] = []
        a.append(a)


@pytest.mark.parametrize("quiet", ["1", "0"])
def test_quiet_gc_keeps_the_collector_off_while_measuring_and_counts_what_ran(
    quiet: str, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Quiet (the default): no automatic collection while the block runs, however much
    cyclic garbage it makes, and the collector is back on after; BENCH_GC_QUIET=0: the
    collector runs as usual, and the block's collections are counted."""
    import gc

    from bench.load import quiet_gc

    monkeypatch.setenv("BENCH_GC_QUIET", quiet)
    out: dict[str, Any] = {}
    assert gc.isenabled()
    with quiet_gc(out):
        assert gc.isenabled() is (quiet == "0")
        _make_cycles(20_000)  # far beyond the youngest generation's threshold (700)
    assert gc.isenabled()
    assert out["bench_gc"]["quiet"] is (quiet == "1")
    if quiet == "1":
        assert out["bench_gc"] == {"quiet": True, "collections": 0, "total_ms": 0.0,
                                   "max_ms": 0.0}
    else:
        assert out["bench_gc"]["collections"] > 0


def test_a_workload_rebuilt_in_another_process_sends_the_same_requests() -> None:
    """The open loop's generator process rebuilds the workload from its pickled factory:
    request n at time ts must be the same key and bytes as the benchmark's own."""
    import pickle

    wl = workload("digits", run="rebuilt", devices=7, fields={"deadline": 500.0})
    factory = wl.payload_factory()
    assert factory is not None
    rebuilt = pickle.loads(pickle.dumps(factory))()
    for n in (0, 1, 6, 7, 1796, 1797, 40_000):
        assert rebuilt(n, 1.8e9 + n) == wl.payload(n, 1.8e9 + n)
    assert rebuilt(3, 1.0) != wl.payload(4, 1.0)


def test_the_generator_process_says_why_it_failed() -> None:
    """A generator whose payloads cannot be built fails the open loop with the child's
    traceback instead of leaving the measurement waiting."""
    import asyncio
    import operator
    from functools import partial

    from bench.load import GeneratorProcess

    gen = GeneratorProcess("127.0.0.1:9", "requests", partial(operator.truediv, 1, 0),
                           rate=10.0, n=10)
    with pytest.raises(RuntimeError, match=r"(?s)generator process failed.*ZeroDivisionError"):
        asyncio.run(gen.start(timeout_s=60.0))
    assert gen._process.exitcode is not None  # start() ended the process it started


def test_thread_cpu_names_each_busy_thread_by_its_python_name(
        capsys: pytest.CaptureFixture[str]) -> None:
    """bench.thread_cpu reads a child's threads from /proc and labels them with py-spy's
    Python names: a thread that starts spinning after the first sample shows as
    ``[late-spinner]`` with most of a core in its first interval, not ``[native]`` or 0."""
    import subprocess
    import sys

    from bench.procs import py_spy
    from bench.thread_cpu import python_thread_names, sample

    if py_spy() is None:
        pytest.skip("py-spy is not installed")
    code = ("import threading, time\n"
            "def spin():\n"
            "    while True: pass\n"
            "print('ready', flush=True); time.sleep(0.7)\n"
            "threading.Thread(target=spin, name='late-spinner', daemon=True).start()\n"
            "time.sleep(60)\n")
    child = subprocess.Popen([sys.executable, "-c", code, "thread-cpu-test-marker"],
                             stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None and child.stdout.readline() == "ready\n"
        if python_thread_names(child.pid) is None:
            pytest.skip("py-spy may not attach here (ptrace permission)")
        assert sample("thread-cpu-test-marker", 2.0, 0.5, 20.0)
        names = python_thread_names(child.pid)
    finally:
        child.kill()
        child.communicate()
    assert names is not None and names[child.pid] == "MainThread"
    spinner = next(tid for tid, name in names.items() if name == "late-spinner")
    header, *lines = capsys.readouterr().out.splitlines()
    assert "'thread-cpu-test-marker'" in header and "py-spy" in header
    assert lines and all(f"pid {child.pid}:" in line for line in lines)
    spinning = [line for line in lines if f"/{spinner}[late-spinner]" in line]
    assert spinning and spinning[0] == next(line for line in lines if f"/{spinner}[" in line)
    assert not any(f"/{spinner}[native]" in line for line in lines)


def test_thread_cpu_names_an_unnamed_python_thread_and_retries_a_failed_dump(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """py-spy lists a thread of a process that never imported threading without a name
    (``[python]``, not ``[native]``); a failed dump is asked again, and a thread py-spy did
    not list becomes native only once a dump one interval after it appeared missed it."""
    import bench.thread_cpu as tc

    monkeypatch.setattr(tc, "py_spy", lambda: "/bin/py-spy")

    class Done:
        returncode, stdout = 0, ('Process 7: python x.py\n\nThread 7 (active+gil)\n'
                                 '    <module> (x.py:3)\nThread 9 (idle): "Thread-1"\n')
    monkeypatch.setattr(tc.subprocess, "run", lambda *a, **k: Done())
    assert tc.python_thread_names(7) == {7: "python", 9: "Thread-1"}

    dumps: list[dict[int, str] | None] = [None, {7: "MainThread"}, {7: "MainThread"}]
    monkeypatch.setattr(tc, "python_thread_names", lambda pid: dumps.pop(0))
    names = tc._Names(7, settle_s=1.0)
    names.update({7, 8}, now=10.0)  # the dump fails
    assert names.label("python/7") == "python/7[?]" and not names.note
    names.update({7, 8}, now=10.5)  # 8 is not listed, but is only 0.5 s old
    assert names.label("python/7") == "python/7[MainThread]"
    assert names.label("python/8") == "python/8[?]"
    names.update({7, 8}, now=11.5)  # still not listed a whole interval later
    assert names.label("python/8") == "python/8[native]"
    assert not dumps


def test_thread_cpu_keeps_a_renamed_threads_baseline(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """A thread that renames itself (prctl, as RocksDB's and OpenMP's do) is the same thread:
    its interval is its CPU since the last sample, not its whole life (re-trial: 180 % for
    a thread of a 45 % process)."""
    import re

    import bench.thread_cpu as tc

    snapshots = [{"python/7": (0.0, 0.0), "worker/8": (2.0, 0.0)},
                 {"python/7": (0.0, 0.0), "renamed/8": (2.25, 0.0)}]
    monkeypatch.setattr(tc, "_pids", lambda pattern: [7])
    monkeypatch.setattr(tc, "thread_times", lambda pid: snapshots[0])
    monkeypatch.setattr(tc, "process_times",
                        lambda pid: (sum(u for u, _ in snapshots[0].values()), 0.0))
    monkeypatch.setattr(tc.time, "sleep", lambda s: snapshots.pop(0))
    # monotonic(): the deadline, the first sample, its deadline check, then 0.5 s later the
    # second sample and its check
    times = iter([0.0, 0.0, 0.0, 0.0, 0.5, 1.0])
    monkeypatch.setattr(tc.time, "monotonic", lambda: next(times))
    assert tc.sample("x", 1.0, 0.5, 0.0, names=False)
    line = capsys.readouterr().out.splitlines()[-1]
    assert re.search(r"user 50 % \+ system 0 %; renamed/8 50\b", line), line


def test_the_backlog_rate_is_over_the_answering_samples_or_a_stated_lower_bound() -> None:
    from bench.run import backlog_rate

    # answering for 2 s, then idle: the idle samples do not dilute the rate
    assert backlog_rate([(3.0, 1000), (4.0, 3000), (5.0, 5000), (6.0, 5000), (7.0, 5000)],
                        2.5) == (2000, "2,000/s")
    # everything answered before the first sample (the smoke run's 5,000): not "0/s"
    rate, text = backlog_rate([(3.0, 5000), (4.0, 5000)], 2.5)
    assert rate == 10000
    assert text == ("10,000/s from ready to the first sample with 5,000: 5,000 were "
                    "answered by the first sample, 0.5 s after ready")
    # most answered by the first sample, the stragglers by the second (new-user trial:
    # "8/s" from the last 9 of 5,000)
    rate, text = backlog_rate([(8.9, 4991), (10.0, 5000)], 7.76)
    assert rate == round(5000 / (10.0 - 7.76))
    assert "4,991 were answered by the first sample" in text
    # a sample where /metrics did not answer is not a count of 0, and the line says so
    assert backlog_rate([(3.0, 1000), (4.0, 3000), (5.0, None)], 2.5) == (
        2000, "2,000/s; 1 of 3 /metrics polls failed")
    assert backlog_rate([(3.0, None)], 2.5) == (None, "the worker's /metrics never answered")
    # a restarted worker's count starts again: the highest count stands
    assert backlog_rate([(1.0, 1000), (2.0, 5000), (3.0, 0)], 0.5) == (4000, "4,000/s")
    assert backlog_rate([(3.0, 0), (4.0, 0)], 2.5) == (None, "none answered")
    assert backlog_rate([], 2.5) == (None, "the worker's /metrics never answered")


def test_table_memory_refuses_a_bad_table_setting_only_for_the_run_that_takes_it() -> None:
    """``bench.table_memory --configs faust`` runs Faust's defaults, which take no
    STREAMAPP_TABLE_* setting: a bad one there is not its error (re-trial, twelfth session);
    ``--configs streamapp`` refuses it in one usage line before any run."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "STREAMAPP_TABLE_BLOCK_CACHE_MIB": "-1"}
    args = [sys.executable, "-m", "bench.table_memory", "--seconds", "15", "--sample-s", "15",
            "--partitions", "2", "--idle-s", "0", "--configs"]
    faust = subprocess.run([*args, "faust"], env=env, capture_output=True, text=True,
                           timeout=120)
    assert faust.returncode == 0, faust.stderr
    assert "faust: 4 databases" in faust.stdout  # two tables × two partitions
    ours = subprocess.run([*args, "streamapp"], env=env, capture_output=True, text=True,
                          timeout=120)
    assert ours.returncode == 2
    assert "table_block_cache_mib" in ours.stderr and "Traceback" not in ours.stderr
    # a setting the Faust run does take is still checked, in one line (new-user trial)
    env = {**os.environ, "STREAMAPP_STATE_FLUSH_INTERVAL_MS": "abc"}
    faust = subprocess.run([*args, "faust"], env=env, capture_output=True, text=True,
                           timeout=120)
    assert faust.returncode == 2
    assert "state_flush_interval_ms" in faust.stderr and "Traceback" not in faust.stderr
    # exactly-once keeps device tables in memory, and --json must name a file: refused before
    # any run, in one line (re-trial)
    for extra_env, extra_args, said in (
            ({"STREAMAPP_PROCESSING_GUARANTEE": "exactly_once"}, [], "exactly_once"),
            ({}, ["--json", str(Path(__file__).parent)], "--json")):
        bad = subprocess.run([*args, "faust", *extra_args], env={**os.environ, **extra_env},
                             capture_output=True, text=True, timeout=120)
        assert bad.returncode == 2 and said in bad.stderr and "Traceback" not in bad.stderr


def test_host_speed_reads_busy_and_steal_shares_from_two_cpu_times_readings() -> None:
    """`bench.host_speed` (env.txt of the GPU calls): busy excludes idle, iowait and steal;
    steal is the hypervisor's share."""
    from collections import namedtuple

    from bench.host_speed import _model_and_mhz, cpu_shares

    times = namedtuple("times", "user nice system idle iowait irq softirq steal guest")
    before = times(100, 0, 50, 800, 10, 0, 0, 40, 0)
    after = times(160, 0, 70, 1100, 10, 0, 0, 60, 0)
    busy, steal = cpu_shares(before, after)  # delta: 60 + 20 busy, 300 idle, 20 steal of 400
    assert busy == pytest.approx(20.0)
    assert steal == pytest.approx(5.0)
    assert cpu_shares(before, before) == (0.0, 0.0)
    cpuinfo = ("processor\t: 0\nmodel name\t: Intel(R) Xeon(R) Processor\ncpu MHz\t\t: 2100.004\n"
               "processor\t: 1\nmodel name\t: other\ncpu MHz\t\t: 900.0\n")
    assert _model_and_mhz(cpuinfo) == ("Intel(R) Xeon(R) Processor", "2100")
    assert _model_and_mhz("") == ("?", "?")
