"""The production deployment files: they cannot run here (no Docker engine), so check that they
are valid against the compose specification's schema, that the streamapp services are configured
only with settings that exist (and valid values) and run commands that exist, that the profiles
start what they need, that they scale, and that Prometheus and Grafana look at metrics the
workers export."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import typer
import yaml
from typer.testing import CliRunner

from streamapp.cli import cli
from streamapp.metrics import METRIC_FAMILIES
from streamapp.settings import Settings

ROOT = Path(__file__).resolve().parent.parent
COMPOSE = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
SERVICES: dict[str, Any] = COMPOSE["services"]
#: The worker services, one per GPU (worker-gpu0, worker-gpu1, ...).
WORKERS: dict[str, Any] = {n: s for n, s in SERVICES.items() if n.startswith("worker-gpu")}
#: Every service that runs a streamapp command (the worker image's entrypoint is `streamapp`).
STREAMAPP_SERVICES: dict[str, Any] = {
    n: s for n, s in SERVICES.items() if str(s.get("image", "")).startswith("streamapp-worker")
}
#: Every service that runs `streamapp worker`, in either profile.
ALL_WORKERS: dict[str, Any] = {n: s for n, s in STREAMAPP_SERVICES.items()
                               if s["command"][0] == "worker"}


def _env(service: dict[str, Any]) -> dict[str, str]:
    env = service.get("environment") or {}
    if isinstance(env, list):
        env = dict(item.split("=", 1) for item in env)
    return {str(k): str(v) for k, v in env.items()}


def test_the_compose_file_is_valid_against_the_compose_specification() -> None:
    # The schema of github.com/compose-spec/compose-spec, vendored (deploy/schema/README.md).
    schema = json.loads((ROOT / "deploy" / "schema" / "compose-spec.json").read_text())
    validator = jsonschema.Draft7Validator(schema)
    errors = [f"{e.json_path}: {e.message}" for e in validator.iter_errors(COMPOSE)]
    assert errors == []
    # The validator does find mistakes (a misspelt key is not silently accepted).
    broken = {**COMPOSE, "services": {**SERVICES, "kafka": {**SERVICES["kafka"], "restarts": 1}}}
    assert not validator.is_valid(broken)


def _profile(name: str | None) -> set[str]:
    """The services `docker compose --profile NAME up` starts (None: no profile given)."""
    return {n for n, s in SERVICES.items() if not s.get("profiles") or name in s["profiles"]}


@pytest.mark.parametrize("profile", [None, "cpu", "gpu"])
def test_each_profile_starts_everything_its_services_depend_on(profile: str | None) -> None:
    active = _profile(profile)
    for name in active:
        missing = set(SERVICES[name].get("depends_on") or ()) - active
        assert missing == set(), f"{name} depends on {missing}, not in profile {profile}"
    assert {"kafka", "topics", "prometheus", "grafana"} <= active


def test_the_cpu_profile_runs_the_bundled_model_on_onnx_runtime_and_publishes() -> None:
    cpu = _profile("cpu") - _profile(None)
    assert cpu == {"worker-cpu", "publisher"}
    worker = SERVICES["worker-cpu"]
    env = _env(worker)
    assert env["STREAMAPP_BACKEND"] == "onnxruntime" and "STREAMAPP_MODELS_DIR" not in env
    assert env["STREAMAPP_MODELS"] == "digits"  # bundled with streamapp
    assert worker["build"]["args"]["BASE_IMAGE"].startswith("python:")
    assert worker["build"]["args"]["EXTRAS"] == ""
    assert "gpu" not in json.dumps(worker.get("deploy", {}))
    # results appear without anyone publishing: the publisher waits for a ready worker
    publisher = SERVICES["publisher"]
    assert publisher["command"][0] == "publish"
    assert publisher["depends_on"]["worker-cpu"]["condition"] == "service_healthy"
    assert publisher["restart"] == "no"


def _published(service: dict[str, Any]) -> dict[int, tuple[str, int]]:
    """Container port → (host address, host port) of a service's `ports` (short syntax;
    all interfaces: "0.0.0.0")."""
    out = {}
    for entry in service.get("ports") or ():
        host, port, container = ["0.0.0.0", *str(entry).split(":")][-3:]
        out[int(container)] = (host, int(port))
    return out


def test_the_cpu_workers_web_port_is_published_on_the_hosts_loopback() -> None:
    worker = SERVICES["worker-cpu"]
    port = int(_env(worker)["STREAMAPP_WEB_PORT"])
    # docs use localhost:6066 (README, docs/api.md); the web API has no authentication
    assert _published(worker) == {port: ("127.0.0.1", 6066)}
    for name in ("prometheus", "grafana"):
        assert _published(SERVICES[name]), name


def test_the_gpu_workers_start_only_after_their_models_passed_the_check() -> None:
    check = SERVICES["models-check"]
    assert check["profiles"] == ["gpu"] and check["command"] == ["models", "check"]
    assert check["restart"] == "no"
    for name, worker in WORKERS.items():
        assert worker["profiles"] == ["gpu"]
        assert worker["depends_on"]["models-check"]["condition"] == (
            "service_completed_successfully"), name
        # the check sees the models the workers load, with the backend they use
        assert _env(worker) == _env(check) and worker["volumes"] == check["volumes"], name
        assert worker["image"] == check["image"]


def test_the_model_check_fails_with_one_line_while_the_shipped_repository_has_no_plans(
    runner: CliRunner, monkeypatch: pytest.MonkeyPatch,
) -> None:
    # deploy/models is what `docker compose --profile gpu up` mounts at /models by default
    env = _env(SERVICES["models-check"])
    (mount,) = SERVICES["models-check"]["volumes"]
    source = re.sub(r"\$\{[A-Z_]+:-([^}]*)\}", r"\1", mount.split(":/models")[0])
    env["STREAMAPP_MODELS_DIR"] = str(ROOT / source)
    out = runner.invoke(cli, SERVICES["models-check"]["command"], env=env)
    assert out.exit_code == 1
    (line,) = out.stderr.splitlines()
    assert line.startswith(f"error: {ROOT / source / 'digits'}: ") and "docs/" in line


def _parse_command(args: list[str]) -> str:
    """Parse `streamapp ARGS` as the CLI would, without running it; return the command's name.

    Raises:
        click.UsageError: (typer's) an unknown command or option, or a bad option value.
    """
    command: Any = typer.main.get_command(cli)
    ctx = command.make_context("streamapp", list(args))
    # groups (typer vendors click: duck-typed) hand the rest to their subcommand
    while hasattr(command, "resolve_command"):
        rest = [*ctx._protected_args, *ctx.args]
        name, command, rest = command.resolve_command(ctx, rest)
        ctx = command.make_context(name, rest, parent=ctx)
    return str(ctx.command_path)


@pytest.mark.parametrize("name", sorted(STREAMAPP_SERVICES))
def test_every_streamapp_service_runs_a_streamapp_command(name: str) -> None:
    service = STREAMAPP_SERVICES[name]
    assert (ROOT / service["build"]["dockerfile"]).is_file()
    assert _parse_command(service["command"]).startswith("streamapp ")


def test_a_bad_service_command_would_be_found() -> None:
    with pytest.raises(Exception, match="No such option"):
        _parse_command(["publish", "--devicez", "3"])
    with pytest.raises(Exception, match="No such command"):
        _parse_command(["modelz", "check"])
    with pytest.raises(Exception, match="valid integer"):
        _parse_command(["publish", "--devices", "many"])
    assert _parse_command(["models", "check"]) == "streamapp models check"


def test_the_streamapp_services_share_the_workers_broker_group_and_topics() -> None:
    keys = ("STREAMAPP_BROKER", "STREAMAPP_APP_ID", "STREAMAPP_TOPIC_PREFIX",
            "STREAMAPP_TOPIC_PARTITIONS")
    seen = {n: tuple(_env(s).get(k) for k in keys) for n, s in STREAMAPP_SERVICES.items()}
    assert len(set(seen.values())) == 1, seen
    assert len(ALL_WORKERS) == len(WORKERS) + 1


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
    assert seen == len(STREAMAPP_SERVICES) >= 4


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


def test_the_topic_step_creates_every_topic_with_the_workers_partition_count() -> None:
    topics = SERVICES["topics"]
    script = "\n".join(topics["command"])
    settings = Settings(topic_prefix="")
    for topic in (settings.request_topic, settings.result_topic, settings.dlq_topic,
                  settings.retry_topic):
        assert topic in script
    for worker in ALL_WORKERS.values():
        partitions = _env(worker)["STREAMAPP_TOPIC_PARTITIONS"]
        assert _env(topics)["PARTITIONS"] == partitions
        assert int(partitions) >= len(WORKERS)


def _web_ports(worker: dict[str, Any]) -> set[int]:
    """The ports a worker service's processes listen on: web_port, web_port + 1, ... for
    `worker --processes N`."""
    command = worker["command"]
    processes = int(command[command.index("--processes") + 1]) if (
        "--processes" in command) else 1
    port = int(_env(worker)["STREAMAPP_WEB_PORT"])
    return set(range(port, port + processes))


def test_prometheus_scrapes_every_worker_process_of_every_worker_service() -> None:
    config = yaml.safe_load((ROOT / "deploy" / "prometheus.yml").read_text())
    (job,) = config["scrape_configs"]
    assert job["metrics_path"] == "/metrics"
    scraped = set()
    for sd in job["dns_sd_configs"]:
        assert sd["names"] == ["worker"] and sd["type"] == "A"
        scraped.add(int(sd["port"]))
    for name, worker in ALL_WORKERS.items():
        # the alias Prometheus resolves, and every port the service's processes listen on
        assert worker["networks"]["default"]["aliases"] == ["worker"], name
        assert _web_ports(worker) <= scraped, name
    assert _web_ports({"command": ["worker", "--processes", "2"],
                       "environment": {"STREAMAPP_WEB_PORT": "6066"}}) == {6066, 6067}
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
