"""deploy/ kept honest without Docker: the compose file parses and names files that exist,
every platform variable it sets is a setting, the Dockerfile copies what exists, the Dagster
instance config in deploy/ loads, the workspace points at the compose code location, the
init script is valid sh. (The NATS config is started for real in test_nats_permissions.)"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import yaml

from cdc_platform.settings import variable_names

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"


def test_the_compose_file_names_files_that_exist_and_known_settings():
    compose = yaml.safe_load((DEPLOY / "docker-compose.yaml").read_text())
    services = compose["services"]
    assert {"postgres", "dagster-db", "nats", "code", "webserver", "daemon"} <= set(services)
    for name, service in services.items():
        for volume in service.get("volumes", []):
            source = volume.split(":")[0]
            if source.startswith("."):
                assert (DEPLOY / source).exists(), f"{name}: {source} does not exist"
        build = service.get("build")
        if build:
            context = (DEPLOY / build["context"]).resolve()
            assert (context / build["dockerfile"]).is_file()
        for variable in service.get("environment", {}):
            if variable.startswith("CDC_") and name not in ("postgres",):
                assert variable in variable_names(), f"{name}: {variable} is no setting"
        for port in service.get("ports", []):
            # published ports: the UI only on localhost; NATS for mirrors (it has users)
            assert port.startswith("127.0.0.1:") or name == "nats", (name, port)
    # the three services running the platform share one environment
    assert services["webserver"]["environment"] == services["code"]["environment"]


def test_the_dockerfile_copies_what_exists_and_runs_as_a_user():
    dockerfile = (DEPLOY / "docker" / "Dockerfile").read_text()
    for line in dockerfile.splitlines():
        if line.startswith("COPY") and "--from=" not in line:
            for source in line.split()[1:-1]:
                assert (REPO / source).exists(), source
    assert re.search(r"^USER (?!root)\w+", dockerfile, re.MULTILINE)
    assert dockerfile.count("FROM ") == 2  # build stage with a compiler, runtime without


def test_the_deploy_dagster_instance_config_loads(monkeypatch):
    from dagster._core.instance.config import dagster_instance_config

    for name in ("DAGSTER_PG_HOST", "DAGSTER_PG_USERNAME", "DAGSTER_PG_PASSWORD",
                 "DAGSTER_PG_DB"):
        monkeypatch.setenv(name, "x")
    config, _custom_class = dagster_instance_config(str(DEPLOY / "dagster"))
    assert "postgres" in config["storage"]
    assert config["run_coordinator"]["class"] == "QueuedRunCoordinator"
    workspace = yaml.safe_load((DEPLOY / "dagster" / "workspace.yaml").read_text())
    assert workspace["load_from"][0]["grpc_server"] == {
        "host": "code", "port": 4000, "location_name": "cdc_platform"}


def test_the_postgres_init_script_is_valid_sh():
    subprocess.run(["sh", "-n", str(DEPLOY / "postgres" / "30_role_password.sh")], check=True)
