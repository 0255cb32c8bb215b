"""deploy/ kept honest without Docker: the compose file parses and names files that exist,
every platform variable it sets is a setting, the Dockerfile copies what exists, the Dagster
instance config in deploy/ loads, the workspace points at the compose code location, the
init script is valid sh, the Helm values use only the official chart's keys and agree with
the instance config and the image. (The NATS config is started for real in test_nats_permissions.)"""

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
    make_certs = (DEPLOY / "nats" / "make-certs.sh").read_text()
    services = compose["services"]
    assert {"postgres", "dagster-db", "nats", "code", "webserver", "daemon"} <= set(services)
    for name, service in services.items():
        for volume in service.get("volumes", []):
            source = volume.split(":")[0]
            if source.startswith("./nats/tls/"):  # made by make-certs.sh, never committed
                assert f'"$dir/{source.removeprefix("./nats/tls/")}"' in make_certs, source
            elif source.startswith("."):
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
    # only the code location (sensors and runs) holds credentials of the platform's; the
    # webserver and the daemon run no platform code
    for name in ("webserver", "daemon"):
        assert not any(variable.startswith("CDC_") for variable in
                       services[name]["environment"]), name
    assert services["code"]["environment"]["CDC_NATS_USER"] == "bridge"


def test_compose_gives_nats_every_variable_its_config_reads():
    """nats-server refuses to start on a variable its config names and the environment
    lacks: compose sets each one the shipped config reads (the per-team template, commented
    out, reads none)."""
    config = (DEPLOY / "nats" / "nats-server.conf").read_text()
    active = "\n".join(line.split("#")[0] for line in config.splitlines())
    wanted = set(re.findall(r"\$(NATS_[A-Z_]+)", active))
    compose = yaml.safe_load((DEPLOY / "docker-compose.yaml").read_text())
    assert wanted == set(compose["services"]["nats"]["environment"])
    assert {"NATS_BRIDGE_PASSWORD", "NATS_CONSUMER_PASSWORD", "NATS_REPLIER_PASSWORD"} <= wanted
    # TLS on the client port, and the code location trusting its CA
    code = compose["services"]["code"]["environment"]
    assert code["CDC_NATS_URL"].startswith("tls://")
    assert any(volume.endswith(f":{code['CDC_NATS_TLS_CA']}:ro")
               for volume in compose["services"]["code"]["volumes"])


def test_the_nats_helper_scripts_are_valid_sh():
    for script in ("make-certs.sh", "make-password.sh"):
        subprocess.run(["sh", "-n", str(DEPLOY / "nats" / script)], check=True)


def _dockerfile_copies() -> list[str]:
    dockerfile = (DEPLOY / "docker" / "Dockerfile").read_text()
    sources = []
    for line in dockerfile.splitlines():
        if line.startswith("COPY") and "--from=" not in line:
            sources += [word for word in line.split()[1:-1] if not word.startswith("--")]
    return sources


def test_the_dockerfile_copies_what_exists_and_runs_as_a_user():
    dockerfile = (DEPLOY / "docker" / "Dockerfile").read_text()
    for source in _dockerfile_copies():
        assert (REPO / source).exists(), source
    user = re.search(r"^USER (\S+)", dockerfile, re.MULTILINE)
    assert user and user.group(1).split(":")[0] not in ("root", "0"), user
    assert dockerfile.count("FROM ") == 2  # build stage with a compiler, runtime without


def test_the_image_is_pinned_and_installs_only_locked_hashed_dependencies():
    """The image did not build: `python:3.11-slim` moved to a Debian release without Java 17.
    The base is pinned by version and release; every dependency comes from a lock, with
    hashes, that agrees with pyproject.toml."""
    dockerfile = (DEPLOY / "docker" / "Dockerfile").read_text()
    base = re.search(r"^ARG BASE_IMAGE=(\S+)", dockerfile, re.MULTILINE)
    assert base and re.fullmatch(r"python:3\.11\.\d+-slim-bookworm(@sha256:[0-9a-f]{64})?",
                                 base.group(1)), base
    assert re.findall(r"^FROM (\S+)", dockerfile, re.MULTILINE) == [
        "${BASE_IMAGE}", "${BASE_IMAGE}"]
    assert "--require-hashes" in dockerfile and "--no-build-isolation" in dockerfile
    assert re.search(r"pip install [^\n]*--no-deps", dockerfile)
    locked = {}
    for lock in ("requirements.lock", "build-requirements.lock"):
        text = (DEPLOY / "docker" / lock).read_text()
        for requirement in re.split(r"\n(?=\S)", text.strip()):
            if requirement.startswith("#"):
                continue
            name, _, version = requirement.split()[0].partition("==")
            name = name.split("[")[0]  # (extras are kept: pip --require-hashes wants them)
            assert version, f"{lock}: {name} is not pinned"
            assert "--hash=sha256:" in requirement, f"{lock}: {name} has no hash"
            locked[name.lower().replace("_", "-")] = version
    import tomllib

    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    wanted = list(project["dependencies"])
    extras = project["optional-dependencies"]
    for extra in ("deploy", "dagster", "spark"):
        wanted += [r for r in extras[extra] if not r.startswith("cdc_platform")]
    wanted += ["setuptools", "wheel", "cython"]
    for requirement in wanted:
        name = re.split(r"[<>=\[ ;]", requirement, maxsplit=1)[0].lower().replace("_", "-")
        assert name in locked, f"{name} (pyproject.toml) is not in the locks: run make lock"


def test_the_build_context_sends_only_what_the_image_copies():
    ignore = (REPO / ".dockerignore").read_text().split("\n")
    assert "*" in ignore  # everything is left out but what is named
    kept = {line[1:].rstrip("/") for line in ignore if line.startswith("!")}
    assert kept == {source.rstrip("/") for source in _dockerfile_copies()}
    for secret in ("deploy/.env", ".env"):
        assert subprocess.run(["git", "check-ignore", "-q", secret], cwd=REPO,
                              check=False).returncode == 0, f"{secret} is not git-ignored"


def test_the_package_ships_the_dba_scripts():
    """setup-db in the image (an installed package, no repository) needs cdc_platform/sql."""
    import tomllib

    from cdc_platform.postgres.admin import ROLE_SQL, sql_dir

    data = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert "sql/*.sql" in data["package-data"]["cdc_platform"]
    assert sql_dir() == REPO / "cdc_platform" / "sql" and (sql_dir() / ROLE_SQL).is_file()


def test_every_compose_service_restarts_and_says_when_it_is_healthy():
    compose = yaml.safe_load((DEPLOY / "docker-compose.yaml").read_text())
    for name, service in compose["services"].items():
        assert service.get("restart") == "unless-stopped", name
        assert service.get("healthcheck", {}).get("test"), f"{name} has no healthcheck"
        for dependency, condition in (service.get("depends_on") or {}).items():
            assert condition == {"condition": "service_healthy"}, (name, dependency)


def test_compose_runs_the_nats_server_the_tests_run():
    """compose pinned nats 2.11, where provisioning with allow_batched failed from the second
    start on (the bridge fell back silently): it runs the version the tests start."""
    from cdc_platform.dev.servers import find_nats_server

    compose = yaml.safe_load((DEPLOY / "docker-compose.yaml").read_text())
    image = compose["services"]["nats"]["image"]
    tested = subprocess.run([str(find_nats_server()), "--version"], capture_output=True,
                            text=True, check=True).stdout.split()[-1].lstrip("v")
    assert re.fullmatch(rf"nats:{re.escape(tested)}(-alpine)?", image), (image, tested)
    for name in ("postgres", "dagster-db"):
        major = int(re.fullmatch(r"postgres:(\d+)\.\d+(-bookworm)?",
                                 compose["services"][name]["image"]).group(1))
        assert 15 <= major <= 18, (name, major)


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


# The keys of the official Dagster chart's values.schema.json (dagster-io/dagster,
# helm/dagster/values.schema.json at bdb8547) under the sections deploy/helm/values.yaml sets.
# A dict lists a section's keys; FREE marks a value the chart takes as it is (a Kubernetes
# object, a list of them, or a map it passes on).
FREE = None
CHART_KEYS = {
    "dagsterWebserver": {
        "replicaCount": FREE, "image": FREE, "nameOverride": FREE, "pathPrefix": FREE,
        "service": {"type": FREE, "port": FREE, "annotations": FREE}, "workspace": FREE,
        "env": FREE, "envConfigMaps": FREE, "envSecrets": FREE,
        "deploymentLabels": FREE, "labels": FREE, "nodeSelector": FREE, "affinity": FREE,
        "tolerations": FREE, "podSecurityContext": FREE, "securityContext": FREE,
        "resources": FREE, "readinessProbe": FREE, "livenessProbe": FREE, "startupProbe": FREE,
        "annotations": FREE, "enableReadOnly": FREE, "dbStatementTimeout": FREE,
        "dbPoolRecycle": FREE, "logLevel": FREE, "schedulerName": FREE, "volumeMounts": FREE,
        "volumes": FREE, "initContainerResources": FREE},
    "dagster-user-deployments": {
        "enabled": FREE, "enableSubchart": FREE, "imagePullSecrets": FREE,
        "deployments": [{
            "name": FREE, "image": {"repository": FREE, "tag": FREE, "pullPolicy": FREE},
            "dagsterApiGrpcArgs": FREE, "codeServerArgs": FREE,
            "includeConfigInLaunchedRuns": {"enabled": FREE}, "deploymentNamespace": FREE,
            "port": FREE, "env": FREE, "envConfigMaps": FREE, "envSecrets": FREE,
            "annotations": FREE, "nodeSelector": FREE, "affinity": FREE, "tolerations": FREE,
            "podSecurityContext": FREE, "securityContext": FREE, "resources": FREE,
            "livenessProbe": FREE, "readinessProbe": FREE, "startupProbe": FREE,
            "labels": FREE, "volumeMounts": FREE, "volumes": FREE, "schedulerName": FREE,
            "initContainers": FREE, "sidecarContainers": FREE}]},
    "postgresql": {
        "image": FREE, "enabled": FREE, "postgresqlHost": FREE, "postgresqlUsername": FREE,
        "postgresqlPassword": FREE, "postgresqlDatabase": FREE, "postgresqlParams": FREE,
        "postgresqlScheme": FREE, "service": {"port": FREE}},
    "generatePostgresqlPasswordSecret": FREE,
    "global": {"postgresqlSecretName": FREE, "dagsterHome": FREE, "serviceAccountName": FREE,
               "celeryConfigSecretName": FREE},
    "runLauncher": {"type": FREE, "config": {"k8sRunLauncher": {
        "image": FREE, "imagePullPolicy": FREE, "jobNamespace": FREE,
        "loadInclusterConfig": FREE, "kubeconfigFile": FREE, "envConfigMaps": FREE,
        "envSecrets": FREE, "envVars": FREE, "volumeMounts": FREE, "volumes": FREE,
        "labels": FREE, "failPodOnRunFailure": FREE, "resources": FREE,
        "schedulerName": FREE, "securityContext": FREE, "runK8sConfig": FREE}}},
    "dagsterDaemon": {
        "enabled": FREE, "image": FREE, "heartbeatTolerance": FREE, "env": FREE,
        "envConfigMaps": FREE, "envSecrets": FREE, "deploymentLabels": FREE, "labels": FREE,
        "nodeSelector": FREE, "affinity": FREE, "tolerations": FREE,
        "podSecurityContext": FREE, "securityContext": FREE, "resources": FREE,
        "livenessProbe": FREE, "readinessProbe": FREE, "startupProbe": FREE,
        "annotations": FREE, "runMonitoring": FREE, "runRetries": FREE, "sensors": FREE,
        "schedules": FREE, "schedulerName": FREE, "volumeMounts": FREE, "volumes": FREE,
        "initContainerResources": FREE,
        "runCoordinator": {"enabled": FREE, "type": FREE, "config": {"queuedRunCoordinator": {
            "maxConcurrentRuns": FREE, "dequeueIntervalSeconds": FREE,
            "dequeueNumWorkers": FREE, "dequeueUseThreads": FREE,
            "blockOpConcurrencyLimitedRuns": FREE,
            "tagConcurrencyLimits": [{"key": FREE, "limit": FREE,
                                      "value": FREE}]}}}},
    "rabbitmq": {"enabled": FREE, "image": FREE, "rabbitmq": FREE, "service": FREE,
                 "volumePermissions": FREE},
    "redis": {"enabled": FREE, "internal": FREE, "usePassword": FREE, "password": FREE,
              "host": FREE, "port": FREE, "brokerDbNumber": FREE, "backendDbNumber": FREE,
              "brokerUrl": FREE, "backendUrl": FREE},
    "flower": {"enabled": FREE, "image": FREE, "service": FREE, "nodeSelector": FREE,
               "affinity": FREE, "tolerations": FREE, "podSecurityContext": FREE,
               "securityContext": FREE, "resources": FREE, "livenessProbe": FREE,
               "startupProbe": FREE, "annotations": FREE},
    "telemetry": {"enabled": FREE},
}


def _unknown_keys(values, documented, path="") -> list[str]:
    if documented is FREE:
        return []
    if isinstance(documented, list):
        assert isinstance(values, list), f"{path} must be a list"
        return [bad for index, item in enumerate(values)
                for bad in _unknown_keys(item, documented[0], f"{path}[{index}]")]
    assert isinstance(values, dict), f"{path} must be a map"
    unknown = [f"{path}.{key}".lstrip(".") for key in values if key not in documented]
    return unknown + [bad for key, value in values.items() if key in documented
                      for bad in _unknown_keys(value, documented[key], f"{path}.{key}")]


def test_the_helm_values_use_the_charts_keys_and_agree_with_the_platform():
    import importlib

    import dagster as dg

    values = yaml.safe_load((DEPLOY / "helm" / "values.yaml").read_text())
    assert _unknown_keys(values, CHART_KEYS) == []
    (deployment,) = values["dagster-user-deployments"]["deployments"]
    # the code location loads: the module and attribute its gRPC server is given
    arguments = deployment["dagsterApiGrpcArgs"]
    module = arguments[arguments.index("--module-name") + 1]
    attribute = arguments[arguments.index("--attribute") + 1]
    assert isinstance(getattr(importlib.import_module(module), attribute), dg.Definitions)
    # runs as the image's own user
    dockerfile = (DEPLOY / "docker" / "Dockerfile").read_text()
    uid = re.search(r"useradd .*--uid (\d+)", dockerfile).group(1)
    assert str(deployment["podSecurityContext"]["runAsUser"]) == uid
    # the pods that run platform code (the code server, the runs) read the same settings,
    # and each its own credential (NATS users `sensor` and `bridge`): the runs do not get
    # the code server's; the webserver and the daemon run none and hold no platform secret
    launcher = values["runLauncher"]["config"]["k8sRunLauncher"]
    assert deployment["envConfigMaps"] == launcher["envConfigMaps"]
    assert deployment["envSecrets"] == [{"name": "cdc-platform-sensor"}]
    assert launcher["envSecrets"] == [{"name": "cdc-platform-runs"}]
    assert deployment["includeConfigInLaunchedRuns"]["enabled"] is False
    for name in ("dagsterWebserver", "dagsterDaemon"):
        assert "envSecrets" not in values[name] and "envConfigMaps" not in values[name], name
    # the runs (the bridge, the Spark driver) get resources and a non-root security context
    assert launcher["resources"]["requests"] and launcher["resources"]["limits"]["memory"]
    assert launcher["securityContext"]["runAsNonRoot"] is True
    assert launcher["securityContext"]["allowPrivilegeEscalation"] is False
    assert str(launcher["securityContext"]["runAsUser"]) == uid
    assert "postgresqlPassword" not in values["postgresql"]  # from the Secret, not a value
    # the run coordination is the instance's in deploy/dagster/dagster.yaml
    instance = yaml.safe_load((DEPLOY / "dagster" / "dagster.yaml").read_text())
    coordinator = instance["run_coordinator"]["config"]
    queued = values["dagsterDaemon"]["runCoordinator"]["config"]["queuedRunCoordinator"]
    assert queued["maxConcurrentRuns"] == coordinator["max_concurrent_runs"]
    assert queued["tagConcurrencyLimits"] == coordinator["tag_concurrency_limits"]
    monitoring = values["dagsterDaemon"]["runMonitoring"]
    for chart_key, instance_key in (("enabled", "enabled"),
                                    ("startTimeoutSeconds", "start_timeout_seconds"),
                                    ("maxResumeRunAttempts", "max_resume_run_attempts"),
                                    ("pollIntervalSeconds", "poll_interval_seconds")):
        assert monitoring[chart_key] == instance["run_monitoring"][instance_key], chart_key


def test_the_provisioning_job_provisions_both_accounts_as_their_admins():
    """The provisioning step of the Helm deployment: the image's own user, the ConfigMap's
    settings and a Secret of its own (`provisioner`, `readers_admin`), both sides made."""
    values = yaml.safe_load((DEPLOY / "helm" / "values.yaml").read_text())
    (job,) = yaml.safe_load_all((DEPLOY / "helm" / "provision-job.yaml").read_text())
    assert job["kind"] == "Job"
    (container,) = job["spec"]["template"]["spec"]["containers"]
    (deployment,) = values["dagster-user-deployments"]["deployments"]
    image = deployment["image"]
    assert container["image"] == f"{image['repository']}:{image['tag']}"
    assert container["command"][-1] == "cdc-platform provision && cdc-platform provision --readers"
    assert container["envFrom"] == [{"configMapRef": {"name": "cdc-platform-config"}},
                                    {"secretRef": {"name": "cdc-platform-provision"}}]
    assert job["spec"]["template"]["spec"]["securityContext"]["runAsUser"] == \
        deployment["podSecurityContext"]["runAsUser"]
    (config,) = yaml.safe_load_all((DEPLOY / "helm" / "cdc-platform-config.yaml").read_text())
    assert "CDC_NATS_USER" not in config["data"]  # per pod, in its Secret
    assert config["data"]["CDC_READERS_NATS_URL"] == config["data"]["CDC_NATS_URL"]


def test_the_helm_files_it_names_exist_and_agree():
    """values.yaml named a ConfigMap file that was not in the repository; the bridge's metrics
    were bound to 127.0.0.1 (nothing could scrape them); nothing kept other pods off the code
    server's gRPC."""
    values_text = (DEPLOY / "helm" / "values.yaml").read_text()
    values = yaml.safe_load(values_text)
    for named in re.findall(r"-f (deploy/helm/\S+)", values_text):
        assert (REPO / named).is_file(), named
    (config,) = yaml.safe_load_all((DEPLOY / "helm" / "cdc-platform-config.yaml").read_text())
    assert config["kind"] == "ConfigMap"
    launcher = values["runLauncher"]["config"]["k8sRunLauncher"]
    assert {"name": config["metadata"]["name"]} in launcher["envConfigMaps"]
    settings = config["data"]
    for name in settings:
        assert name in variable_names() or name.startswith("PG"), f"{name} is no setting"
        assert not re.search(r"PASSWORD|TOKEN|SEED|CREDS|KEY$", name), f"{name} is a secret"
    assert settings["CDC_HTTP_HOST"] == "0.0.0.0"
    metadata = launcher["runK8sConfig"]["podTemplateSpecMetadata"]
    assert metadata["annotations"]["prometheus.io/port"] == settings["CDC_HTTP_PORT"]
    policies = list(yaml.safe_load_all((DEPLOY / "helm" / "network-policy.yaml").read_text()))
    code, telemetry = policies
    (deployment,) = values["dagster-user-deployments"]["deployments"]
    assert code["spec"]["podSelector"]["matchLabels"] == {
        "component": "user-deployments", "deployment": deployment["name"]}
    assert code["spec"]["ingress"][0]["ports"] == [{"protocol": "TCP",
                                                   "port": deployment["port"]}]
    clients = code["spec"]["ingress"][0]["from"][0]["podSelector"]["matchLabels"]
    for name in ("dagsterWebserver", "dagsterDaemon"):
        assert clients.items() <= values[name]["labels"].items(), name
    assert telemetry["spec"]["podSelector"]["matchLabels"].items() \
        <= metadata["labels"].items()
    assert telemetry["spec"]["ingress"][0]["ports"][0]["port"] == int(settings["CDC_HTTP_PORT"])
