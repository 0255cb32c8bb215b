"""The README's first command, end to end, in smoke mode (start, verify, stop)."""

import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from cdc_platform.dev.servers import free_port


@pytest.fixture
def state_root():
    # Not pytest's tmp_path: another pytest session resets its root to 0700, which locks
    # the unprivileged PostgreSQL OS user out of its data directory.
    path = Path(tempfile.mkdtemp(prefix="cdc-dev-test-"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def test_dev_stack_comes_up_and_stops_cleanly(state_root):
    tmp_path = state_root
    cli = Path(sys.executable).parent / "cdc-platform"
    ports = [str(free_port()) for _ in range(4)]
    result = subprocess.run(
        [str(cli), "dev", "--state-dir", str(tmp_path / "state"), "--smoke",
         "--ui-port", ports[0], "--pg-port", ports[1], "--nats-port", ports[2],
         "--nats-monitor-port", ports[3]],
        capture_output=True, text=True, timeout=300,
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
    # nothing left running (processes that were told to stop get a moment to exit)
    deadline = time.monotonic() + 10
    while True:
        left = subprocess.run(["pgrep", "-af", str(tmp_path)], capture_output=True, text=True)
        if left.returncode == 1 or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert left.returncode == 1, left.stdout + output[-3000:]
