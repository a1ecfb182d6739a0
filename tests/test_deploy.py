"""The production deployment files: they cannot run here (no Docker engine), so check that they
parse, that the workers are configured only with settings that exist (and valid values), that
they scale, and that Prometheus and Grafana look at metrics the workers export."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from streamapp.metrics import METRIC_FAMILIES
from streamapp.settings import Settings

ROOT = Path(__file__).resolve().parent.parent
COMPOSE = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
SERVICES: dict[str, Any] = COMPOSE["services"]
#: The worker services, one per GPU (worker-gpu0, worker-gpu1, ...).
WORKERS: dict[str, Any] = {n: s for n, s in SERVICES.items() if n.startswith("worker-gpu")}


def _env(service: dict[str, Any]) -> dict[str, str]:
    env = service.get("environment") or {}
    if isinstance(env, list):
        env = dict(item.split("=", 1) for item in env)
    return {str(k): str(v) for k, v in env.items()}


def test_the_stack_has_kafka_topics_workers_prometheus_and_grafana() -> None:
    assert set(SERVICES) >= {"kafka", "topics", "prometheus", "grafana"}
    assert len(WORKERS) >= 2
    kafka = _env(SERVICES["kafka"])
    assert "controller" in kafka["KAFKA_PROCESS_ROLES"]  # KRaft, no ZooKeeper
    assert kafka["KAFKA_AUTO_CREATE_TOPICS_ENABLE"] == "false"


def test_every_streamapp_variable_is_a_setting_with_a_valid_value() -> None:
    fields = set(Settings.model_fields)
    seen = 0
    for name, service in SERVICES.items():
        values = {}
        for var, value in _env(service).items():
            if not var.startswith("STREAMAPP_"):
                continue
            field = var.removeprefix("STREAMAPP_").lower()
            assert field in fields, f"{name}: {var} is not a setting"
            values[field] = value
        if values:
            seen += 1
            Settings(**values)  # raises on a bad value (type, range, cross-field checks)
    assert seen >= 1


def test_each_worker_service_reserves_its_own_gpu() -> None:
    # `--scale worker=N` with `count: 1` put every replica on the same GPU: one service per GPU
    gpus = []
    for name, worker in WORKERS.items():
        assert "container_name" not in worker and "ports" not in worker
        (device,) = worker["deploy"]["resources"]["reservations"]["devices"]
        assert device["driver"] == "nvidia" and "gpu" in device["capabilities"]
        assert "count" not in device, f"{name}: pin the GPU with device_ids, not count"
        (gpu,) = device["device_ids"]
        gpus.append(gpu)
        env = _env(worker)
        assert env["STREAMAPP_WEB_BIND"] == "0.0.0.0"
        assert (ROOT / worker["build"]["dockerfile"]).is_file()
        assert worker["depends_on"]["topics"]["condition"] == "service_completed_successfully"
        # Prometheus (dns_sd name "worker") and peers find every worker under one name
        assert worker["networks"]["default"]["aliases"] == ["worker"]
        assert worker["command"][0] == "worker"
    assert sorted(gpus) == [str(i) for i in range(len(WORKERS))]
    assert set(SERVICES["prometheus"]["depends_on"]) == set(WORKERS)


def test_the_topic_step_creates_every_topic_with_the_workers_partition_count() -> None:
    topics = SERVICES["topics"]
    script = "\n".join(topics["command"])
    settings = Settings(topic_prefix="")
    for topic in (settings.request_topic, settings.result_topic, settings.dlq_topic,
                  settings.retry_topic):
        assert topic in script
    for worker in WORKERS.values():
        partitions = _env(worker)["STREAMAPP_TOPIC_PARTITIONS"]
        assert _env(topics)["PARTITIONS"] == partitions
        assert int(partitions) >= len(WORKERS)


def test_prometheus_scrapes_every_worker_replica() -> None:
    config = yaml.safe_load((ROOT / "deploy" / "prometheus.yml").read_text())
    (job,) = config["scrape_configs"]
    assert job["metrics_path"] == "/metrics"
    (sd,) = job["dns_sd_configs"]
    assert sd["names"] == ["worker"] and sd["type"] == "A"
    for worker in WORKERS.values():
        assert str(sd["port"]) == _env(worker)["STREAMAPP_WEB_PORT"]
    mounts = SERVICES["prometheus"]["volumes"]
    assert any(m.startswith("./deploy/prometheus.yml:") for m in mounts)


def _exported_series() -> set[str]:
    names = set()
    for name, kind, *_ in METRIC_FAMILIES:
        names.add(name)
        if kind == "histogram":
            names |= {f"{name}_bucket", f"{name}_sum", f"{name}_count"}
    return names


@pytest.mark.parametrize("path", sorted((ROOT / "deploy" / "grafana").rglob("*.yml")))
def test_grafana_provisioning_parses(path: Path) -> None:
    assert yaml.safe_load(path.read_text())["apiVersion"] == 1


def test_the_dashboard_only_queries_metrics_the_workers_export() -> None:
    dashboard = json.loads((ROOT / "deploy/grafana/dashboards/streamapp.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    assert len(exprs) >= 10
    used = {m for e in exprs for m in re.findall(r"\bstreamapp_[a-z0-9_]+", e)}
    assert used - _exported_series() == set()
    # the operator questions are on it: throughput, latency, batch, lag, DLQ, GPU
    for family in ("streamapp_requests_total", "streamapp_e2e_duration_seconds_bucket",
                   "streamapp_queue_duration_seconds_bucket",
                   "streamapp_inference_duration_seconds_bucket",
                   "streamapp_batch_size_sum", "streamapp_consumer_lag",
                   "streamapp_dead_letters_total", "streamapp_retries_total",
                   "streamapp_gpu_utilization_ratio"):
        assert family in used
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    provisioned = yaml.safe_load(
        (ROOT / "deploy/grafana/provisioning/dashboards/streamapp.yml").read_text())
    assert provisioned["providers"][0]["options"]["path"] == "/var/lib/grafana/dashboards"
