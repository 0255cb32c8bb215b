"""The other ways a NATS server asks clients who they are, each against a real nats-server: a
token, a bare nkey (a seed file) and a credentials file (a user JWT signed by an account an
operator signed: decentralized auth, JetStream on). The platform provisions and the bridge
streams with each, through the settings and through the Dagster resource; a wrong one is
refused clearly, naming no secret."""

from __future__ import annotations

import base64
import hashlib
import json
import os
import time
from pathlib import Path

import nacl.signing
import nkeys
import pytest

from cdc_platform.defs.resources import NatsResource
from cdc_platform.dev.servers import free_port
from cdc_platform.errors import ConfigError, NatsAuthError
from cdc_platform.jetstream.connection import close_nats, connect_nats
from cdc_platform.jetstream.provision import provision
from cdc_platform.replication.slots import read_slot
from cdc_platform.settings import NatsSettings, NatsTopology
from cdc_platform_tests.fixtures.bridge import running_bridge, wait_for
from cdc_platform_tests.fixtures.services import (
    nats_server_from,
    platform_settings,
    random_name,
    read_subjects,
    secret_for_test,
)


def _new_key(prefix: int) -> nkeys.KeyPair:
    seed = nkeys.encode_seed(nacl.signing.SigningKey.generate().encode(), prefix)
    return nkeys.from_seed(bytearray(seed))


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).decode().rstrip("=")


def _jwt(issuer: nkeys.KeyPair, subject: nkeys.KeyPair, name: str, claims: dict) -> str:
    """A NATS JWT (v2): ed25519-nkey signed by ``issuer`` (what ``nsc`` writes)."""
    body = {"iat": int(time.time()), "iss": issuer.public_key.decode(), "name": name,
            "sub": subject.public_key.decode(), "nats": {**claims, "version": 2}}
    body["jti"] = base64.b32encode(hashlib.sha256(
        json.dumps(body, sort_keys=True).encode()).digest()).decode().rstrip("=")
    signed = (f"{_b64(json.dumps({'typ': 'JWT', 'alg': 'ed25519-nkey'}).encode())}."
              f"{_b64(json.dumps(body).encode())}")
    return f"{signed}.{_b64(issuer.sign(signed.encode()))}"


_UNLIMITED = {"subs": -1, "data": -1, "payload": -1, "imports": -1, "exports": -1,
              "wildcards": True, "conn": -1, "leaf": -1}


def _operator_mode(base: Path) -> tuple[str, Path, Path]:
    """(server config lines, a user's creds file, a creds file of a user no account signed)."""
    operator, system = _new_key(nkeys.PREFIX_BYTE_OPERATOR), _new_key(nkeys.PREFIX_BYTE_ACCOUNT)
    account, user = _new_key(nkeys.PREFIX_BYTE_ACCOUNT), _new_key(nkeys.PREFIX_BYTE_USER)
    stranger_account = _new_key(nkeys.PREFIX_BYTE_ACCOUNT)
    operator_jwt = _jwt(operator, operator, "operator",
                        {"type": "operator", "system_account": system.public_key.decode()})
    system_jwt = _jwt(operator, system, "SYS", {"type": "account", "limits": _UNLIMITED})
    account_jwt = _jwt(operator, account, "platform", {"type": "account", "limits": {
        **_UNLIMITED, "mem_storage": -1, "disk_storage": -1, "streams": -1, "consumer": -1}})
    creds = []
    for name, issuer in (("bridge", account), ("stranger", stranger_account)):
        user_jwt = _jwt(issuer, user, name, {"type": "user", "pub": {}, "sub": {},
                                             "subs": -1, "data": -1, "payload": -1})
        path = base / f"{name}.creds"
        path.write_text(f"-----BEGIN NATS USER JWT-----\n{user_jwt}\n"
                        "------END NATS USER JWT------\n\n"
                        f"-----BEGIN USER NKEY SEED-----\n{user.seed.decode()}\n"
                        "------END USER NKEY SEED------\n")
        path.chmod(0o600)
        creds.append(path)
    config = (f"operator: {operator_jwt}\nresolver: MEMORY\n"
              f"system_account: {system.public_key.decode()}\n"
              f"resolver_preload: {{ {account.public_key.decode()}: {account_jwt}, "
              f"{system.public_key.decode()}: {system_jwt} }}\n")
    return config, creds[0], creds[1]


@pytest.fixture(params=["token", "nkey", "creds"])
def authenticated_nats(request, tmp_path):
    """(url, the settings' auth fields that get in, the same with a wrong credential)."""
    port = free_port()
    env = dict(os.environ)
    if request.param == "token":
        token = env["NATS_TOKEN"] = secret_for_test()  # from the environment, as deployed
        auth = "authorization { token: $NATS_TOKEN }\n"
        good, bad = {"token": token}, {"token": "not-the-token"}
    elif request.param == "nkey":
        key, other = _new_key(nkeys.PREFIX_BYTE_USER), _new_key(nkeys.PREFIX_BYTE_USER)
        seeds = []
        for name, pair in (("user", key), ("other", other)):
            path = tmp_path / f"{name}.nk"
            path.write_bytes(pair.seed)
            path.chmod(0o600)
            seeds.append(str(path))
        auth = f"authorization {{ users: [ {{ nkey: {key.public_key.decode()} }} ] }}\n"
        good, bad = {"nkey_seed_file": seeds[0]}, {"nkey_seed_file": seeds[1]}
    else:
        auth, creds, stranger = _operator_mode(tmp_path)
        good, bad = {"creds_file": str(creds)}, {"creds_file": str(stranger)}
    config = tmp_path / "nats.conf"
    config.write_text(f"listen: 127.0.0.1:{port}\n"
                      f'jetstream {{ store_dir: "{tmp_path / "js"}" }}\n{auth}')
    with nats_server_from(config, port, tmp_path / "nats.log", env):
        yield f"nats://127.0.0.1:{port}", good, bad


async def test_the_platform_provisions_and_streams(authenticated_nats, cdc_database,
                                                   pg_admin, monkeypatch):
    url, good, _bad = authenticated_nats
    for name in [name for name in os.environ if name.startswith(("CDC_NATS_", "NATS_"))]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("CDC_NATS_URL", url)
    variables = {"user": "CDC_NATS_USER", "password": "CDC_NATS_PASSWORD",
                 "token": "CDC_NATS_TOKEN", "creds_file": "CDC_NATS_CREDS",
                 "nkey_seed_file": "CDC_NATS_NKEY_SEED"}
    for field, value in good.items():
        monkeypatch.setenv(variables[field], value)
    nats_settings = NatsResource().settings()  # as Dagster gives them: from the environment
    client = await connect_nats(nats_settings)
    try:
        await provision(client.jetstream(), NatsTopology())
        table = random_name("authed")
        pg_admin.execute(f"CREATE TABLE {table} (id int PRIMARY KEY)")
        cdc_database.add_tables(pg_admin, table)
        settings = platform_settings(cdc_database, url)
        settings = settings.model_copy(update={"nats": NatsSettings(url=url, **good)})
        async with running_bridge(settings):
            await wait_for(lambda: read_slot(pg_admin, cdc_database.slot) is not None)
            pg_admin.execute(f"INSERT INTO {table} SELECT generate_series(1, 20)")
            assert len(await read_subjects(client, "CDC", f"cdc.{table}.>", expect=20)) == 20
    finally:
        await close_nats(client, 5)


async def test_a_wrong_credential_is_refused_clearly(authenticated_nats):
    url, good, bad = authenticated_nats
    with pytest.raises(NatsAuthError, match="refused our credentials") as refused:
        await connect_nats(NatsSettings(url=url, **bad))
    assert all(str(value) not in str(refused.value) for value in good.values())


def test_an_unreadable_credentials_file_names_its_variable(tmp_path):
    for field, variable in (("creds_file", "CDC_NATS_CREDS"),
                            ("nkey_seed_file", "CDC_NATS_NKEY_SEED")):
        with pytest.raises(ConfigError, match=f"{variable} .*missing.*not readable"):
            NatsSettings(**{field: str(tmp_path / "missing")}).connect_options()
