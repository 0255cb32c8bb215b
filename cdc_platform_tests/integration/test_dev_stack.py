"""The README's first command, end to end, in smoke mode (start, verify, stop)."""

import asyncio
import contextlib
import http.server
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import pytest

from cdc_platform.dev.servers import PortTaken, free_port
from cdc_platform.dev.stack import REPO_ROOT, DevOptions, DevStack
from cdc_platform.jetstream.connection import connect_nats
from cdc_platform.settings import NatsSettings
from cdc_platform_tests.fixtures.services import CLI


@pytest.fixture
def state_root():
    # Not pytest's tmp_path: another pytest session resets its root to 0700, which locks
    # the unprivileged PostgreSQL OS user out of its data directory.
    path = Path(tempfile.mkdtemp(prefix="cdc-dev-test-"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def test_dev_stack_comes_up_and_stops_cleanly(state_root):
    tmp_path = state_root
    ports = [str(free_port()) for _ in range(4)]
    result = subprocess.run(
        [CLI, "dev", "--state-dir", str(tmp_path / "state"), "--smoke",
         "--ui-port", ports[0], "--pg-port", ports[1], "--nats-port", ports[2],
         "--nats-monitor-port", ports[3]],
        capture_output=True, text=True, timeout=300, check=False,
        env={k: v for k, v in __import__("os").environ.items()
             if not k.startswith(("CDC_", "PG_", "NATS_", "POSTGRES_"))},
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-4000:]
    assert "smoke check passed" in output
    assert f"Dagster UI  http://127.0.0.1:{ports[0]}" in output
    assert "dev stack stopped" in output
    secrets_file = tmp_path / "state" / "secrets.env"
    password = secrets_file.read_text().split("CDC_PG_PASSWORD=")[1].splitlines()[0]
    assert password not in output  # secrets never printed
    assert oct(secrets_file.stat().st_mode & 0o777) == "0o600"
    # ... nor written by a child process (Dagster's logs and storage, the servers' logs): only
    # the .env files that hand the secrets over hold them
    holding = [str(path) for path in (tmp_path / "state").rglob("*")
               if path.is_file() and not path.is_symlink() and path.suffix != ".env"
               and path.stat().st_size < 64 << 20 and password.encode() in path.read_bytes()]
    assert holding == [], holding
    # nothing left running (processes that were told to stop get a moment to exit)
    deadline = time.monotonic() + 10
    while True:
        left = subprocess.run(["pgrep", "-af", str(tmp_path)], capture_output=True, text=True,
                              check=False)
        if left.returncode == 1 or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert left.returncode == 1, left.stdout + output[-3000:]


def _listen(port: int) -> socket.socket | None:
    """Hold ``port`` like another program would (None when something already does)."""
    sock = socket.socket()
    try:
        sock.bind(("127.0.0.1", port))
    except OSError:
        sock.close()
        return None
    sock.listen()
    return sock


def _cdc_events(state_dir: Path) -> int:
    """How many CDC events of the demo table the stack's nats-server stores."""
    env_text = (state_dir / "dev.env").read_text()
    url = env_text.split("CDC_NATS_URL=")[1].splitlines()[0].strip("'")

    async def count() -> int:
        client = await connect_nats(NatsSettings(url=url))
        try:
            info = await client.jetstream().stream_info("CDC", subjects_filter="cdc.users.>")
            return sum((info.state.subjects or {}).values())
        finally:
            await client.close()

    return asyncio.run(count())


def _wait_for_more_events(state_dir: Path, than: int, timeout: float, what: str) -> int:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(Exception):
            now = _cdc_events(state_dir)
            if now > than:
                return now
        time.sleep(2)
    raise AssertionError(f"no new CDC events within {timeout:.0f}s {what}")


def _start_stack(state_dir: Path, log_path: Path) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("CDC_", "PG_", "NATS_", "POSTGRES_"))}
    env.update(CDC_RUN_LIVENESS_TIMEOUT="20", CDC_RUN_LIVENESS_INTERVAL="2",
               CDC_RELAUNCH_BACKOFF="1")
    with open(log_path, "ab") as out:
        return subprocess.Popen([CLI, "dev", "--state-dir", str(state_dir)], env=env,
                                stdout=out, stderr=subprocess.STDOUT, start_new_session=True)


def _stop_stack(process: subprocess.Popen, log_path: Path) -> None:
    process.send_signal(signal.SIGINT)  # Ctrl-C
    try:
        process.wait(120)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        raise AssertionError("the dev stack did not stop within 120s: "
                             + log_path.read_text()[-3000:]) from None


def _wait_until_materialized(state_dir: Path, assets: tuple[str, ...], timeout: float) -> None:
    """The stack materializes ``assets`` in the background as it starts; on a loaded machine
    that can take longer than the CDC run needs to stream."""
    import dagster as dg

    deadline = time.monotonic() + timeout
    while True:
        with dg.DagsterInstance.from_config(str(state_dir / "dagster_home")) as instance:
            missing = [asset for asset in assets
                       if not instance.get_latest_materialization_event(dg.AssetKey(asset))]
        if not missing:
            return
        assert time.monotonic() < deadline, f"never materialized: {missing}"
        time.sleep(2)


def _cdc_runs(state_dir: Path) -> list:
    import dagster as dg

    with dg.DagsterInstance.from_config(str(state_dir / "dagster_home")) as instance:
        return [(run.run_id, run.status) for run in
                instance.get_runs(dg.RunsFilter(job_name="cdc_job"))]


def test_cdc_comes_back_after_restarts_and_a_killed_run_worker(state_root):
    """With the usual ports taken: stop and start twice, CDC streams again each time and the
    stopped runs end CANCELED; a SIGKILLed run worker is replaced within the liveness bound."""
    import dagster as dg

    held = [sock for sock in map(_listen, (9090, 3000, 4222)) if sock is not None]
    state_dir, log_path = state_root / "state", state_root / "dev.log"
    try:
        events = 0
        for cycle in range(2):
            stack = _start_stack(state_dir, log_path)
            try:
                events = _wait_for_more_events(state_dir, events, 240,
                                               f"after start {cycle + 1}")
                if cycle == 0:
                    # the run worker and its step process: multiprocessing children of the
                    # daemon's code server (no other Dagster runs here)
                    workers = subprocess.run(["pgrep", "-f", "multiprocessing.spawn import"],
                                             capture_output=True, text=True, check=False)
                    pids = [int(pid) for pid in workers.stdout.split()]
                    assert pids, "no cdc_job run worker found"
                    for pid in pids:
                        os.kill(pid, signal.SIGKILL)
                    killed_at = time.monotonic()
                    time.sleep(5)
                    settled = _cdc_events(state_dir)
                    events = _wait_for_more_events(state_dir, settled, 150,
                                                   "after the run worker was killed")
                    assert time.monotonic() - killed_at < 150
                else:  # not "never materialized" in the UI
                    _wait_until_materialized(state_dir, ("jetstream_topology", "schemas"), 180)
            finally:
                _stop_stack(stack, log_path)
            output = log_path.read_text()
            assert "dev stack stopped" in output
            runs = _cdc_runs(state_dir)
            assert runs and all(status in (dg.DagsterRunStatus.CANCELED,
                                           dg.DagsterRunStatus.FAILURE)
                                for _, status in runs), runs
            assert runs[0][1] == dg.DagsterRunStatus.CANCELED, runs  # the latest: stopped
        output = log_path.read_text()
        assert "source " in output and "dev.env" in output
        assert oct((state_dir / "dev.env").stat().st_mode & 0o777) == "0o600"
        assert "/metrics" in output
    finally:
        for sock in held:
            sock.close()


def test_a_stop_while_the_smoke_check_waits_for_cdc_is_honoured(state_root):
    """SIGTERM once the stack is up, while `dev --smoke` waits for CDC events: it stops what
    it started and exits 1 without claiming the check passed (it ignored the signal until CDC
    streamed, then passed)."""
    ports = [str(free_port()) for _ in range(4)]
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("CDC_", "PG_", "NATS_", "POSTGRES_"))}
    log_path = state_root / "dev.log"
    with open(log_path, "ab") as out:
        process = subprocess.Popen(
            [CLI, "dev", "--state-dir", str(state_root / "state"), "--smoke",
             "--ui-port", ports[0], "--pg-port", ports[1], "--nats-port", ports[2],
             "--nats-monitor-port", ports[3]],
            env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 240
        while "dev stack is up" not in log_path.read_text():
            assert process.poll() is None and time.monotonic() < deadline, \
                log_path.read_text()[-3000:]
            time.sleep(0.2)
        process.send_signal(signal.SIGTERM)
        code = process.wait(120)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
    output = log_path.read_text()
    assert code == 1, output[-3000:]
    assert "smoke check passed" not in output
    assert "smoke check stopped before it finished" in output
    assert "dev stack stopped" in output


def test_a_ui_port_another_ui_holds_is_not_taken_for_ours(tmp_path):
    """The default UI port was free when the stack looked and another UI holds it when ours
    starts: ours cannot listen there, and the other one's answers must not count as ours
    (before, the stack waited for any 200 on the port, and printed the other's address)."""
    class Answering(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.end_headers()
            self.wfile.write(b"{}")

        def log_message(self, *args):
            pass

    other = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Answering)
    threading.Thread(target=other.serve_forever, daemon=True).start()
    stack = DevStack(DevOptions(state_dir=tmp_path))
    stack.ports["ui_port"] = other.server_address[1]
    home = tmp_path / "dagster_home"
    home.mkdir()
    env = {**os.environ, "DAGSTER_HOME": str(home)}
    try:
        with pytest.raises(PortTaken, match="address already in use"):
            stack._start_webserver(env, str(REPO_ROOT / "workspace.yaml"),
                                   tmp_path / "webserver.log", timeout=120)
        assert stack.processes == []
    finally:
        other.shutdown()
        other.server_close()
