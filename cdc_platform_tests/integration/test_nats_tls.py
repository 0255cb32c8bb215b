"""NATS over TLS against a real nats-server that verifies client certificates: the platform
connects and provisions with CDC_NATS_TLS_CA/CERT/KEY, and says clearly what is wrong when a
certificate is missing or unreadable."""

from __future__ import annotations

import asyncio
import subprocess
import time
from pathlib import Path

import pytest

from cdc_platform.dev.servers import free_port
from cdc_platform.errors import ConfigError, NatsUnreachable
from cdc_platform.jetstream.connection import close_nats, connect_nats
from cdc_platform.jetstream.provision import provision
from cdc_platform.settings import NatsSettings, NatsTopology
from cdc_platform_tests.fixtures.services import nats_server_from


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


def _certificates(base: Path) -> Path:
    """A CA, a server certificate for 127.0.0.1/localhost and a client certificate."""
    base.mkdir()
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj",
             "/CN=test-ca", "-keyout", "ca.key", "-out", "ca.pem", cwd=base)
    (base / "server.ext").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    for name, extra in (("server", ["-extfile", "server.ext"]), ("client", [])):
        _openssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", f"/CN={name}",
                 "-keyout", f"{name}.key", "-out", f"{name}.csr", cwd=base)
        _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
                 "-CAcreateserial", "-days", "2", "-out", f"{name}.pem", *extra, cwd=base)
    return base


@pytest.fixture
def tls_nats(tmp_path):
    certs = _certificates(tmp_path / "certs")
    port = free_port()
    config = tmp_path / "nats.conf"
    config.write_text(
        f"listen: 127.0.0.1:{port}\n"
        f'jetstream {{ store_dir: "{tmp_path / "js"}" }}\n'
        f'tls {{ cert_file: "{certs / "server.pem"}", key_file: "{certs / "server.key"}", '
        f'ca_file: "{certs / "ca.pem"}", verify: true, timeout: 2 }}\n')
    with nats_server_from(config, port, tmp_path / "nats.log"):
        yield f"tls://127.0.0.1:{port}", certs


async def test_the_platform_connects_with_a_client_certificate(tls_nats):
    url, certs = tls_nats
    settings = NatsSettings(url=url, tls_ca_file=str(certs / "ca.pem"),
                            tls_cert_file=str(certs / "client.pem"),
                            tls_key_file=str(certs / "client.key"))
    client = await connect_nats(settings)
    try:
        js = client.jetstream()
        report = await provision(js, NatsTopology())
        assert "CDC" in report.created
        ack = await js.publish("cdc.tls_check.insert", b"\x80")
        assert ack.stream == "CDC"
    finally:
        await close_nats(client, 5)


async def test_without_its_certificate_the_client_is_refused_clearly(tls_nats):
    url, certs = tls_nats
    with pytest.raises(NatsUnreachable, match="cannot reach NATS"):
        await connect_nats(NatsSettings(url=url, tls_ca_file=str(certs / "ca.pem")))


@pytest.mark.parametrize("mistake", ["another CA", "a nats:// URL"])
async def test_a_server_certificate_not_verified_is_said_at_once(tls_nats, tmp_path, mistake):
    """The server's certificate not verified on our side: its CA not the one given, or none
    given with a ``nats://`` URL to a TLS-only server (nats-py upgrades to TLS, against the
    system's CAs). nats-py 2.16 then waited forever for the socket to close."""
    url, certs = tls_nats
    if mistake == "another CA":
        other = _certificates(tmp_path / "other")
        settings = NatsSettings(url=url, tls_ca_file=str(other / "ca.pem"),
                                tls_cert_file=str(certs / "client.pem"),
                                tls_key_file=str(certs / "client.key"))
    else:
        settings = NatsSettings(url=url.replace("tls://", "nats://"))
    started = time.monotonic()
    with pytest.raises(NatsUnreachable, match="TLS certificate was not verified .* check "
                                              "CDC_NATS_TLS_CA"):
        async with asyncio.timeout(30):
            await connect_nats(settings)
    assert time.monotonic() - started < settings.connect_timeout


def test_unreadable_or_half_given_certificates_are_config_errors(tmp_path):
    with pytest.raises(ConfigError, match="CDC_NATS_TLS_CA .*missing.pem"):
        NatsSettings(url="tls://127.0.0.1:4222",
                     tls_ca_file=str(tmp_path / "missing.pem")).connect_options()
    with pytest.raises(ConfigError, match="go together"):
        NatsSettings(url="nats://127.0.0.1:4222",
                     tls_cert_file=str(tmp_path / "c.pem")).connect_options()
    assert "tls" not in NatsSettings(url="nats://127.0.0.1:4222").connect_options()
