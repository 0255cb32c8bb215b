"""The dev stack's local servers on this machine: what they change outside their own dirs."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

from cdc_platform.dev.servers import _make_traversable, _server_os_user


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
