"""``cdc-platform dev``: the whole platform on one machine, for trying it and developing it.

With no servers given it starts, in ``--state-dir``: a local PostgreSQL (logical WAL, the
``cdc_platform/sql/`` scripts applied, a demo table with a trickle of writes) and a local
nats-server with JetStream (streams and KV provisioned), then Dagster (webserver + daemon) on
``workspace.yaml``. Servers given by environment (``CDC_PG_HOST``/``PG_HOST``/``CDC_PG_DSN``,
``CDC_NATS_URL``/``NATS_URL``/``NATS_HOST``) are used as they are and nothing is started for
them. Ctrl-C (or SIGTERM) stops everything it started, in reverse order.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import psycopg

from cdc_platform.dev.demo import DEMO_TABLES, DemoWorkload, create_demo_tables
from cdc_platform.dev.runs import cancel_runs, failed_runs
from cdc_platform.dev.servers import (
    LocalNatsServer,
    LocalPostgres,
    PortTaken,
    free_port,
    listens_on,
    log_size,
    port_is_open,
    read_from,
    said_port_taken,
    start_logical_postgres,
    start_on_free_ports,
)
from cdc_platform.errors import CdcError
from cdc_platform.jetstream.connection import connect_nats
from cdc_platform.jetstream.provision import provision
from cdc_platform.postgres.admin import provision_database
from cdc_platform.settings import NatsSettings, PostgresSettings, load_settings
from cdc_platform.stopping import StopSignals

log = logging.getLogger(__name__)

REPO_ROOT = Path(__file__).resolve().parents[2]
EXTERNAL_PG_VARS = ("CDC_PG_HOST", "PG_HOST", "CDC_PG_DSN")
EXTERNAL_NATS_VARS = ("CDC_NATS_URL", "NATS_URL", "CDC_NATS_HOST", "NATS_HOST")


# Ports used when free; a port not given and taken by something else is replaced by a free
# one (printed in the banner): a developer's machine often runs PostgreSQL, NATS, Grafana...
DEFAULT_PORTS = {"ui_port": 3000, "pg_port": 54329, "nats_port": 4222,
                 "nats_monitor_port": 8222}
# How long a stop waits for the runs it cancels (the bridge's own shutdown bound is 30 s).
RUN_CANCEL_SECONDS = 45.0


@dataclass
class DevOptions:
    state_dir: Path
    ui_port: int | None = None  # None: DEFAULT_PORTS, or a free port when that is taken
    pg_port: int | None = None
    nats_port: int | None = None
    nats_monitor_port: int | None = None
    telemetry_port: int | None = None  # None: a free port
    dagster: bool = True
    demo_writes_per_second: float = 2.0
    smoke: bool = False  # start, verify, stop: what the tests and CI run


@dataclass
class _Secrets:
    """Generated once per state dir, kept in a 0600 file, never printed."""

    path: Path
    values: dict[str, str] = field(default_factory=dict)

    @classmethod
    def load(cls, path: Path) -> _Secrets:
        secrets_file = cls(path)
        if path.exists():
            for line in path.read_text().splitlines():
                key, _, value = line.partition("=")
                secrets_file.values[key] = value
        for key in ("PG_SUPERUSER_PASSWORD", "CDC_PG_PASSWORD"):
            secrets_file.values.setdefault(key, secrets.token_urlsafe(18))
        path.write_text("".join(f"{k}={v}\n" for k, v in secrets_file.values.items()))
        path.chmod(0o600)
        return secrets_file


class DevStack:
    def __init__(self, options: DevOptions) -> None:
        self.options = options
        self.state_dir = options.state_dir.resolve()
        self.stop_requested = threading.Event()
        self.postgres: LocalPostgres | None = None
        self.nats: LocalNatsServer | None = None
        self.workload: DemoWorkload | None = None
        self.processes: list[tuple[str, subprocess.Popen]] = []
        self._helpers: list[subprocess.Popen] = []  # one-off commands, not watched
        self.child_env: dict[str, str] = {}
        self.pg_settings: PostgresSettings | None = None
        self.nats_settings: NatsSettings | None = None
        self.ports = {name: self._choose_port(name, getattr(options, name))
                      for name in DEFAULT_PORTS}
        self.telemetry_port = options.telemetry_port or free_port()
        self.dagster_home = self.state_dir / "dagster_home"
        self._reported_failures: set[str] = set()
        self._dagster_instance = None

    @staticmethod
    def _choose_port(name: str, given: int | None) -> int:
        flag = "--" + name.replace("_", "-")
        if given is not None:
            if port_is_open("127.0.0.1", given):
                raise CdcError(f"port {given} ({flag}) is taken: stop what listens there or "
                               "choose another")
            return given
        preferred = DEFAULT_PORTS[name]
        if not port_is_open("127.0.0.1", preferred):
            return preferred
        log.info("port %d is taken: using a free one for %s", preferred, flag)
        return 0  # (the server chooses, and chooses again if another takes it first)

    def _given(self, name: str) -> bool:
        return getattr(self.options, name) is not None

    def _fall_back(self, names: tuple[str, ...], exc: PortTaken) -> None:
        """A default port was free when we looked and taken when the server started:
        free ports instead (a port the user gave is an error)."""
        if any(self._given(name) or self.ports[name] == 0 for name in names):
            raise exc
        log.info("%s; using free ports for %s", exc, ", ".join(names))
        for name in names:
            self.ports[name] = 0

    # -- bring up ----------------------------------------------------------------------
    def run(self, stops: StopSignals) -> int:
        """Until a stop signal (the smoke check: until it passed); 1 when a stop came before
        the smoke check could pass."""
        with stops.listening(self.stop_requested.set):
            try:
                self.start()
                if self.options.smoke:
                    self.verify()
                    if self.stop_requested.is_set():
                        print("smoke check stopped before it finished", file=sys.stderr,
                              flush=True)
                        return 1
                    print("smoke check passed: PostgreSQL, NATS and Dagster are up", flush=True)
                    return 0
                while not self.stop_requested.wait(2.0):
                    self._check_children()
                    self._report_failed_runs()
                return 0
            finally:
                if stops.received is not None:
                    log.info("received %s, stopping", stops.received.name)
                self.stop()

    def start(self) -> None:
        self.state_dir.mkdir(parents=True, exist_ok=True)
        secrets_file = _Secrets.load(self.state_dir / "secrets.env")
        self.pg_settings = pg_settings = self._start_postgres(secrets_file)
        if self.stop_requested.is_set():
            return
        self.nats_settings = nats_settings = self._start_nats()
        topology = load_settings().topology
        asyncio.run(self._provision_nats(nats_settings, topology))
        self.child_env = self._platform_env(pg_settings, nats_settings)
        if self.stop_requested.is_set():
            return
        if self.options.dagster:
            self._start_dagster()
            with contextlib.suppress(Exception):  # failures of earlier sessions: reported then
                self._reported_failures = {run_id for run_id, _, _ in
                                           failed_runs(self._instance(), since_run_ids=set())}
        self._print_banner(pg_settings, nats_settings)

    def _start_postgres(self, secrets_file: _Secrets) -> PostgresSettings:
        if any(os.environ.get(name) for name in EXTERNAL_PG_VARS):
            settings = load_settings(PostgresSettings)
            log.info("using the PostgreSQL given by the environment: %s", settings.describe())
            with psycopg.connect(settings.conninfo(), autocommit=True):
                pass  # fail now, clearly, if it is unreachable or refuses us
            return settings
        try:
            self.postgres = start_logical_postgres(
                self.state_dir / "postgres", port=self.ports["pg_port"],
                superuser_password=secrets_file.values["PG_SUPERUSER_PASSWORD"])
        except PortTaken as exc:
            self._fall_back(("pg_port",), exc)
            self.postgres = start_logical_postgres(
                self.state_dir / "postgres", port=self.ports["pg_port"],
                superuser_password=secrets_file.values["PG_SUPERUSER_PASSWORD"])
        self.ports["pg_port"] = self.postgres.port
        settings = PostgresSettings(
            host=self.postgres.host, port=self.postgres.port, database="postgres",
            user="bridge_reader", password=secrets_file.values["CDC_PG_PASSWORD"],
            sslmode="disable",
        )
        with psycopg.connect(self.postgres.superuser_conninfo(), autocommit=True) as conn:
            create_demo_tables(conn)
            provision_database(conn, publication=settings.publication, role=settings.user,
                               tables=list(DEMO_TABLES),
                               role_password=settings.password.get_secret_value())
        self.workload = DemoWorkload(self.postgres.superuser_conninfo(),
                                     self.options.demo_writes_per_second)
        self.workload.start()
        return settings

    def _start_nats(self) -> NatsSettings:
        if any(os.environ.get(name) for name in EXTERNAL_NATS_VARS):
            settings = load_settings(NatsSettings)
            log.info("using the NATS given by the environment: %s", settings.describe())
            return settings
        names = ("nats_port", "nats_monitor_port")
        self.nats = LocalNatsServer(self.state_dir / "nats", port=self.ports["nats_port"],
                                    monitor_port=self.ports["nats_monitor_port"])
        try:
            self.nats.start()
        except PortTaken as exc:
            self._fall_back(names, exc)
            self.nats = LocalNatsServer(self.state_dir / "nats", port=self.ports["nats_port"],
                                        monitor_port=self.ports["nats_monitor_port"])
            self.nats.start()
        self.ports.update(nats_port=self.nats.port, nats_monitor_port=self.nats.monitor_port)
        return NatsSettings(url=self.nats.url)

    async def _provision_nats(self, settings: NatsSettings, topology) -> None:
        client = await connect_nats(settings, name="cdc-platform-dev")
        try:
            # the embedded server is ours: bring a store from an older version up to date;
            # an external one is only verified
            report = await provision(client.jetstream(), topology,
                                     update=self.nats is not None)
            log.info("JetStream: %s", report.summary())
        finally:
            await client.close()

    def _platform_env(self, pg: PostgresSettings, nats: NatsSettings) -> dict[str, str]:
        """What the Dagster processes need to find the servers (secrets included)."""
        env = {
            "CDC_PG_HOST": pg.host, "CDC_PG_PORT": str(pg.port), "CDC_PG_DB": pg.database,
            "CDC_PG_USER": pg.user, "CDC_PG_SSLMODE": pg.sslmode,
            "CDC_PUBLICATION": pg.publication, "CDC_SLOT": pg.slot,
            "CDC_NATS_URL": ",".join(nats.servers()),
            "CDC_HTTP_PORT": str(self.telemetry_port),
        }
        if pg.password is not None:
            env["CDC_PG_PASSWORD"] = pg.password.get_secret_value()
        if pg.dsn is not None:
            env["CDC_PG_DSN"] = pg.dsn.get_secret_value()
        if nats.user is not None:
            env["CDC_NATS_USER"] = nats.user
            env["CDC_NATS_PASSWORD"] = nats.password.get_secret_value() if nats.password else ""
        return env

    def _start_dagster(self) -> None:
        dagster_home = self.dagster_home
        dagster_home.mkdir(exist_ok=True)
        shutil.copy(REPO_ROOT / "dagster.yaml", dagster_home / "dagster.yaml")
        env = {**os.environ, **self.child_env, "DAGSTER_HOME": str(dagster_home)}
        self._write_env_file({**self.child_env, "DAGSTER_HOME": str(dagster_home)})
        bin_dir = Path(sys.executable).parent
        workspace = str(REPO_ROOT / "workspace.yaml")
        logs = self.state_dir / "logs"
        logs.mkdir(exist_ok=True)
        # Create/upgrade the instance storage once, before two processes race to do it
        # (SQLite + alembic: "more than one head" otherwise).
        migrated = subprocess.run([str(bin_dir / "dagster"), "instance", "migrate"], env=env,
                                  cwd=REPO_ROOT, capture_output=True, text=True, check=False)
        if migrated.returncode != 0:
            raise CdcError(f"dagster instance migrate failed: {migrated.stderr.strip()[-500:]}")
        with open(logs / "dagster-daemon.log", "ab") as out:
            self.processes.append(("dagster-daemon", subprocess.Popen(
                [str(bin_dir / "dagster-daemon"), "run", "-w", workspace], cwd=REPO_ROOT,
                env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)))
        start_on_free_ports(
            lambda: self._start_webserver(env, workspace, logs / "dagster-webserver.log"),
            None if self._given("ui_port") else lambda: self.ports.update(ui_port=0))
        # The stack provisioned NATS and the bridge publishes schemas, but the UI should not
        # say "never materialized": materialize both for real (idempotent), in the background.
        with open(logs / "materialize-platform.log", "ab") as out:
            self._helpers.append(subprocess.Popen(
                [str(bin_dir / "dagster"), "asset", "materialize", "--select",
                 "jetstream_topology,schemas", "-m", "cdc_platform.definitions", "-a", "defs"],
                cwd=REPO_ROOT, env=env,
                stdout=out, stderr=subprocess.STDOUT, start_new_session=True))

    def _start_webserver(self, env: dict[str, str], workspace: str, log_file: Path,
                         timeout: float = 180) -> None:
        """Start the UI and wait until it answers: ours, holding the port, since another UI
        may hold it (ours then exits) and answer meanwhile."""
        port = self.ports["ui_port"] or free_port()
        self.ports["ui_port"] = port
        log_offset = log_size(log_file)
        with open(log_file, "ab") as out:
            process = subprocess.Popen(
                [str(Path(sys.executable).parent / "dagster-webserver"), "-h", "127.0.0.1",
                 "-p", str(port), "-w", workspace], cwd=REPO_ROOT, env=env, stdout=out,
                stderr=subprocess.STDOUT, start_new_session=True)
        url = f"http://127.0.0.1:{port}/server_info"
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and not self.stop_requested.is_set():
            said = read_from(log_file, log_offset)
            if process.poll() is not None:
                if said_port_taken(said):
                    raise PortTaken(f"the Dagster UI could not listen on port {port}: "
                                    "address already in use")
                raise CdcError(f"dagster-webserver exited with code {process.returncode} "
                               f"(see {log_file})")
            self._check_children()
            if listens_on(process.pid, port) is not False:  # (None: cannot tell)
                with (contextlib.suppress(OSError),
                      urllib.request.urlopen(url, timeout=2) as response):
                    if response.status == 200:
                        self.processes.append(("dagster-webserver", process))
                        return
            time.sleep(0.5)
        if self.stop_requested.is_set():
            self.processes.append(("dagster-webserver", process))  # (stop() ends it)
            return
        process.kill()
        raise CdcError(f"Dagster UI did not answer on {url} within {timeout:.0f}s "
                       f"(see {log_file})")

    def _check_children(self) -> None:
        for name, process in self.processes:
            if process.poll() is not None:
                raise CdcError(f"{name} exited with code {process.returncode} "
                               f"(see {self.state_dir / 'logs' / (name + '.log')})")

    def _print_banner(self, pg: PostgresSettings, nats: NatsSettings) -> None:
        lines = ["", "cdc_platform dev stack is up:",
                 (f"  PostgreSQL  {pg.describe()}  publication={pg.publication} "
                 f"slot={pg.slot}  (passwords in {self.state_dir / 'secrets.env'})"),
                 f"  NATS        {nats.describe()}"]
        if self.options.dagster:
            lines.append(f"  Dagster UI  http://127.0.0.1:{self.ports['ui_port']}")
            lines.append(f"  CDC bridge  http://127.0.0.1:{self.telemetry_port}/metrics "
                         "(once cdc_job runs)")
        if self.workload is not None:
            lines.append(f"  demo tables {', '.join(DEMO_TABLES)} "
                         f"(~{self.options.demo_writes_per_second:g} writes/s)")
        if self.options.dagster:
            lines.append(f"For the dagster and cdc-platform commands of the README, first: "
                         f"source {self.env_file}")
        lines.append("Press Ctrl-C to stop everything.")
        print("\n".join(lines), flush=True)

    # -- checks ------------------------------------------------------------------------
    def verify(self) -> None:
        """What a newcomer should see: slot creatable by the role, streams and KV present,
        the UI answering."""
        if self.stop_requested.is_set():
            return
        assert self.pg_settings is not None and self.nats_settings is not None
        with psycopg.connect(self.pg_settings.conninfo(), autocommit=True) as conn:
            slot = f"smoke_{secrets.token_hex(3)}"
            conn.execute("SELECT pg_create_logical_replication_slot(%s, 'pgoutput', true)",
                         (slot,))
        asyncio.run(self._verify_nats(self.nats_settings))
        if self.options.dagster:
            self._check_children()
            url = f"http://127.0.0.1:{self.ports['ui_port']}/server_info"
            with urllib.request.urlopen(url, timeout=5) as response:
                if response.status != 200:
                    raise CdcError(f"the Dagster UI answered {response.status} on {url}")

    async def _verify_nats(self, settings: NatsSettings) -> None:
        topology = load_settings().topology
        client = await connect_nats(settings, name="cdc-platform-dev-check")
        try:
            js = client.jetstream()
            for stream in (topology.cdc.name, topology.init.name, topology.requests.name):
                await js.stream_info(stream)
            await js.key_value(topology.schemas.bucket)
            if self.options.dagster and self.workload is not None:
                await self._wait_for_cdc(js, topology.cdc.name, timeout=180)
        finally:
            await client.close()

    async def _wait_for_cdc(self, js, stream: str, timeout: float) -> None:
        """The daemon's cdc_sensor launches cdc_job; demo writes must reach the stream."""
        subject = f"cdc.{DEMO_TABLES[0]}.>"
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            info = await js.stream_info(stream, subjects_filter=subject)
            if info.state.subjects:
                log.info("CDC is streaming: %s", info.state.subjects)
                return
            for _ in range(10):  # a stop is noticed within 0.1 s
                if self.stop_requested.is_set():
                    return
                await asyncio.sleep(0.1)
        raise CdcError(f"no CDC events on {subject} within {timeout:.0f}s: is the "
                       f"cdc_sensor running? (see {self.state_dir / 'logs'})")

    # -- Dagster runs ------------------------------------------------------------------
    @property
    def env_file(self) -> Path:
        return self.state_dir / "dev.env"

    def _write_env_file(self, env: dict[str, str]) -> None:
        """What a shell needs for `dagster job launch` and friends (holds the password:
        0600, like secrets.env)."""
        self.env_file.touch(mode=0o600)
        self.env_file.chmod(0o600)
        self.env_file.write_text("".join(f"export {key}={shlex.quote(value)}\n"
                                         for key, value in sorted(env.items())))

    def _instance(self):
        """The Dagster instance of the stack, opened once (None without Dagster)."""
        if self._dagster_instance is None and self.options.dagster \
                and (self.dagster_home / "dagster.yaml").exists():
            from dagster import DagsterInstance

            logging.getLogger("alembic").setLevel(logging.WARNING)
            self._dagster_instance = DagsterInstance.from_config(str(self.dagster_home))
        return self._dagster_instance

    def _report_failed_runs(self) -> None:
        """A failed run (cdc_job above all) shows in this terminal, not only in the UI."""
        with contextlib.suppress(Exception):  # the UI is where the details are anyway
            instance = self._instance()
            if instance is None:
                return
            for failure in failed_runs(instance, since_run_ids=self._reported_failures):
                self._reported_failures.add(failure[0])
                print(f"Dagster run {failure[0]} of {failure[1]} failed: {failure[2]}",
                      file=sys.stderr, flush=True)

    def _cancel_runs(self) -> None:
        """Ends the runs in progress as CANCELED (the bridge stops gracefully, with its final
        ack) while the processes that can stop them are still up."""
        try:
            instance = self._instance()
        except Exception as exc:  # noqa: BLE001 - stopping must go on
            log.warning("could not open the Dagster instance to cancel runs: %s", exc)
            return
        if instance is None:
            return
        cancel_runs(instance, timeout=RUN_CANCEL_SECONDS)

    # -- tear down ---------------------------------------------------------------------
    def stop(self) -> None:
        for helper in self._helpers:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(helper.pid, signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                helper.wait(10)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(helper.pid, signal.SIGKILL)
        self._helpers.clear()
        if self.processes:
            self._cancel_runs()
        # The daemon first, right after the runs were canceled: its sensor would start a
        # new CDC run for the one just canceled.
        for name, process in sorted(self.processes, key=lambda named: named[0] != "dagster-daemon"):
            # Each child leads its own process group: signal the group so that the code
            # servers Dagster spawns go too.
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGTERM)
            try:
                process.wait(20)
            except subprocess.TimeoutExpired:
                log.warning("%s did not stop in 20s, killing it", name)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)  # stragglers in the group
            process.wait()
        self.processes.clear()
        if self._dagster_instance is not None:
            with contextlib.suppress(Exception):
                self._dagster_instance.dispose()
            self._dagster_instance = None
        if self.workload is not None:
            self.workload.stop()
            self.workload = None
        if self.nats is not None:
            self.nats.stop()
            self.nats = None
        if self.postgres is not None:
            self.postgres.stop()
            self.postgres = None
        log.info("dev stack stopped")

