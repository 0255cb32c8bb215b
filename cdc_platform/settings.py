"""Settings: pydantic models read from environment variables.

Each model accepts our own ``CDC_*`` names and, where the seed Zig bridge had one, the
seed's name too (``PG_HOST``, ``POSTGRES_BRIDGE_USER``, ``NATS_BRIDGE_PASSWORD``...), so an
existing deployment's environment keeps working. Secrets are ``SecretStr``: they never
appear in a repr, a log line or an error message.

``load_settings()`` turns a validation failure into one ``ConfigError`` line that names the
environment variable and what is wrong with it.
"""

from __future__ import annotations

import os
import re
import ssl
from typing import Annotated, Any, Literal, cast
from urllib.parse import urlsplit, urlunsplit

import psycopg
from psycopg.conninfo import conninfo_to_dict, make_conninfo
from pydantic import (
    AfterValidator,
    AliasChoices,
    BeforeValidator,
    Field,
    SecretStr,
    ValidationError,
    create_model,
    field_validator,
)
from pydantic.fields import FieldInfo
from pydantic_settings import BaseSettings, SettingsConfigDict

from cdc_platform.errors import ConfigError
from cdc_platform.wire.signing import MessageSigner, SignatureVerifier, public_key_bytes
from cdc_platform.wire.subjects import MIRROR_ID_PATTERN

_DURATION_UNITS = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}
_SIZE_UNITS = {"": 1, "b": 1, "k": 1024, "kb": 1024, "kib": 1024, "m": 1024**2, "mb": 1024**2,
               "mib": 1024**2, "g": 1024**3, "gb": 1024**3, "gib": 1024**3, "t": 1024**4,
               "tb": 1024**4, "tib": 1024**4}


def parse_duration_seconds(value: Any) -> float:
    """``"90s"``, ``"15m"``, ``"7d"``, ``"1h30m"`` or a number of seconds -> seconds."""
    if isinstance(value, (int, float)):
        return float(value)
    text = str(value).strip().lower()
    if re.fullmatch(r"\d+(\.\d+)?", text):
        return float(text)
    parts = re.findall(r"(\d+(?:\.\d+)?)(ms|s|m|h|d|w)", text)
    if not parts or "".join(n + u for n, u in parts) != text:
        raise ValueError("not a duration (use e.g. 90s, 15m, 7d, 1h30m)")
    return sum(float(n) * _DURATION_UNITS[u] for n, u in parts)


def parse_size_bytes(value: Any) -> int:
    """``"8G"``, ``"512MiB"``, ``"1048576"`` or -1 (unlimited) -> bytes."""
    if isinstance(value, int):
        return value
    text = str(value).strip().lower()
    if text == "-1":
        return -1
    match = re.fullmatch(r"(\d+(?:\.\d+)?)\s*([a-z]*)", text)
    if not match or match.group(2) not in _SIZE_UNITS:
        raise ValueError("not a size (use e.g. 512M, 8G, or -1 for unlimited)")
    return int(float(match.group(1)) * _SIZE_UNITS[match.group(2)])


Seconds = Annotated[float, BeforeValidator(parse_duration_seconds)]
Bytes = Annotated[int, BeforeValidator(parse_size_bytes)]


def _readable(path: str, variable: str) -> str:
    """``path`` when it names a readable file, else a ConfigError naming the variable (nats-py
    would only fail later, inside its connect, with a less helpful message)."""
    try:
        with open(path, "rb"):
            return path
    except OSError as exc:
        raise ConfigError(f"{variable} {path}: not readable ({exc.strerror})") from None


def _read_seed(path: str) -> str:
    """The nkey seed a file holds (ValueError saying why not, never quoting it)."""
    try:
        with open(path, encoding="ascii") as file:
            seed = file.read().strip()
        MessageSigner(seed)
    except OSError as exc:
        raise ValueError(f"{path}: not readable ({exc.strerror})") from None
    except (UnicodeDecodeError, ValueError):
        raise ValueError(f"{path} holds no nkey seed (S..., 58 characters)") from None
    return seed


def _listed(text: str) -> list[str]:
    return [item.strip() for item in text.split(",") if item.strip()]


def _public_keys(text: str) -> str:
    for key in _listed(text):
        public_key_bytes(key)
    return text


# public nkeys, comma-separated (several while keys are rotated)
PublicKeys = Annotated[str, AfterValidator(_public_keys)]


def _env(*names: str) -> AliasChoices:
    return AliasChoices(*names)


class _Settings(BaseSettings):
    model_config = SettingsConfigDict(
        extra="ignore", populate_by_name=True, hide_input_in_errors=True, frozen=True
    )


class PostgresSettings(_Settings):
    """Where the source database is and how the platform reaches it."""

    host: str = Field("localhost", validation_alias=_env("CDC_PG_HOST", "PG_HOST"))
    port: int = Field(5432, ge=1, le=65535, validation_alias=_env("CDC_PG_PORT", "PG_PORT"))
    database: str = Field("postgres", validation_alias=_env("CDC_PG_DB", "PG_DB"))
    user: str = Field(
        "bridge_reader", validation_alias=_env("CDC_PG_USER", "POSTGRES_BRIDGE_USER")
    )
    password: SecretStr | None = Field(
        None, validation_alias=_env("CDC_PG_PASSWORD", "POSTGRES_BRIDGE_PASSWORD")
    )
    dsn: SecretStr | None = Field(
        None,
        validation_alias=_env("CDC_PG_DSN"),
        description="libpq DSN/URI; overrides host/port/db/user/password when set.",
    )
    sslmode: Literal["disable", "allow", "prefer", "require", "verify-ca", "verify-full"] = (
        Field("prefer", validation_alias=_env("CDC_PG_SSLMODE", "PGSSLMODE"))
    )
    connect_timeout: int = Field(10, ge=1, validation_alias=_env("CDC_PG_CONNECT_TIMEOUT"))
    publication: str = Field("cdc_pub", validation_alias=_env("CDC_PUBLICATION"))
    slot: str = Field("cdc_slot", validation_alias=_env("CDC_SLOT"))
    slot_wait_seconds: Seconds = Field(
        600.0, gt=0, validation_alias=_env("CDC_SLOT_WAIT"),
        description="How long a snapshot waits for the bridge's slot (CDC_SLOT) to exist and "
        "not be lost before it writes its watermark: one written while there is none (the "
        "bridge not started yet, or replacing a lost slot) is in no slot's stream, and no "
        "consumer could cut over. Then it fails, publishing nothing. A stopped bridge's slot "
        "exists: no wait. (Verifications wait within CDC_VERIFY_WAIT.)")

    @field_validator("dsn")
    @classmethod
    def _usable_dsn(cls, value: SecretStr | None) -> SecretStr | None:
        # A DSN libpq cannot use never connects: a configuration error now, not "unreachable"
        # retried forever. (libpq's parse error is not repeated: it may quote the password.)
        if value is None:
            return value
        try:
            params = conninfo_to_dict(value.get_secret_value())
        except psycopg.ProgrammingError:
            raise ValueError("not a libpq connection string or URI") from None
        for port in str(params.get("port") or "").split(","):
            if port and not (port.isdigit() and 1 <= int(port) <= 65535):
                raise ValueError(f"port {port!r} is not a port number (1-65535)")
        return value

    @field_validator("publication", "slot")
    @classmethod
    def _identifier(cls, value: str) -> str:
        # Slot names are restricted by PostgreSQL to [a-z0-9_]{1,63}; publication names are
        # identifiers, kept to the same safe set so they never need quoting in commands.
        if not re.fullmatch(r"[a-z0-9_]{1,63}", value):
            raise ValueError("must match [a-z0-9_]{1,63}")
        return value

    def conninfo(self, *, replication: bool = False, application_name: str = "cdc_platform",
                 **extra: Any) -> str:
        """A libpq connection string; holds the password, so never log it."""
        params: dict[str, Any] = {
            "connect_timeout": self.connect_timeout,
            "application_name": application_name,
        }
        if self.dsn is None:
            params.update(host=self.host, port=self.port, dbname=self.database,
                          user=self.user, sslmode=self.sslmode)
            if self.password is not None:
                params["password"] = self.password.get_secret_value()
        if replication:
            params["replication"] = "database"
        params.update(extra)
        base = self.dsn.get_secret_value() if self.dsn is not None else ""
        return make_conninfo(base, **params)

    def describe(self) -> str:
        """Where we connect, for logs: no password."""
        if self.dsn is not None:
            return "dsn=<set>"
        return f"{self.user}@{self.host}:{self.port}/{self.database}"


class NatsSettings(_Settings):
    """Where the NATS server is and how the platform authenticates."""

    url: SecretStr | None = Field(
        None,  # secret: a URL may carry user:password
        validation_alias=_env("CDC_NATS_URL", "NATS_URL"),
        description="nats://host:port, comma-separated for a cluster; overrides host/port.",
    )
    host: str = Field("localhost", validation_alias=_env("CDC_NATS_HOST", "NATS_HOST"))
    port: int = Field(4222, ge=1, le=65535, validation_alias=_env("CDC_NATS_PORT", "NATS_PORT"))
    user: str | None = Field(None, validation_alias=_env("CDC_NATS_USER", "NATS_BRIDGE_USER"))
    password: SecretStr | None = Field(
        None, validation_alias=_env("CDC_NATS_PASSWORD", "NATS_BRIDGE_PASSWORD")
    )
    token: SecretStr | None = Field(None, validation_alias=_env("CDC_NATS_TOKEN", "NATS_TOKEN"))
    # a .creds file (user JWT + nkey seed, decentralized auth) or a bare nkey seed file
    creds_file: str | None = Field(None, validation_alias=_env("CDC_NATS_CREDS", "NATS_CREDS"))
    nkey_seed_file: str | None = Field(None, validation_alias=_env("CDC_NATS_NKEY_SEED"))
    # TLS: the CA that signed the server's certificate, and this client's certificate and key
    # when the server verifies clients (a tls:// URL or any of these turns TLS on)
    tls_ca_file: str | None = Field(None, validation_alias=_env("CDC_NATS_TLS_CA"))
    tls_cert_file: str | None = Field(None, validation_alias=_env("CDC_NATS_TLS_CERT"))
    tls_key_file: str | None = Field(None, validation_alias=_env("CDC_NATS_TLS_KEY"))
    connect_timeout: float = Field(5.0, gt=0, validation_alias=_env("CDC_NATS_CONNECT_TIMEOUT"))

    @field_validator("url")
    @classmethod
    def _valid_urls(cls, value: SecretStr | None) -> SecretStr | None:
        if value is None:
            return None
        for server in value.get_secret_value().split(","):
            parts = urlsplit(server.strip())
            if parts.scheme not in ("nats", "tls", "ws", "wss") or not parts.hostname:
                raise ValueError("must be nats://host:port (comma-separated for several)")
        return value

    def servers(self) -> list[str]:
        if self.url is not None:
            return [s.strip() for s in self.url.get_secret_value().split(",")]
        return [f"nats://{self.host}:{self.port}"]

    def connect_options(self) -> dict[str, Any]:
        """Keyword arguments for ``nats.connect``; holds secrets, so never log them."""
        options: dict[str, Any] = {
            "servers": self.servers(),
            "connect_timeout": self.connect_timeout,
            "name": "cdc_platform",
        }
        if self.user is not None:
            options["user"] = self.user
            options["password"] = self.password.get_secret_value() if self.password else ""
        if self.token is not None:
            options["token"] = self.token.get_secret_value()
        if self.creds_file is not None:
            options["user_credentials"] = _readable(self.creds_file,
                                                    self.variable("creds_file"))
        if self.nkey_seed_file is not None:
            options["nkeys_seed"] = _readable(self.nkey_seed_file,
                                              self.variable("nkey_seed_file"))
        tls = self.tls_context()
        if tls is not None:
            options["tls"] = tls
        return options

    def tls_context(self) -> ssl.SSLContext | None:
        """The client's TLS context (None: no TLS asked for); ConfigError naming the file a
        certificate or key could not be read from."""
        wanted = (self.tls_ca_file, self.tls_cert_file, self.tls_key_file)
        uses_tls = any(server.startswith(("tls://", "wss://")) for server in self.servers())
        if not uses_tls and all(value is None for value in wanted):
            return None
        ca, cert, key = (self.variable(name) for name in (
            "tls_ca_file", "tls_cert_file", "tls_key_file"))
        if (self.tls_cert_file is None) != (self.tls_key_file is None):
            raise ConfigError(f"{cert} and {key} go together (a client certificate and its "
                              "key)")
        try:
            context = ssl.create_default_context(cafile=self.tls_ca_file)
        except (OSError, ssl.SSLError) as exc:
            raise ConfigError(f"{ca} {self.tls_ca_file}: not a readable CA "
                              f"certificate ({exc.__class__.__name__})") from None
        if self.tls_cert_file is not None:
            try:
                context.load_cert_chain(self.tls_cert_file, self.tls_key_file)
            except (OSError, ssl.SSLError) as exc:
                raise ConfigError(f"{cert} {self.tls_cert_file} / {key} "
                                  f"{self.tls_key_file}: not a readable certificate and key "
                                  f"({exc.__class__.__name__})") from None
        return context

    @classmethod
    def variable(cls, field: str) -> str:
        """The environment variable of ``field`` (our own name), for error messages."""
        alias = cast(AliasChoices, cls.model_fields[field].validation_alias)
        return str(alias.choices[0])

    def describe(self) -> str:
        """Server list for logs, credentials inside URLs redacted."""
        redacted = []
        for server in self.servers():
            parts = urlsplit(server)
            netloc = parts.hostname or ""
            if parts.port:
                netloc = f"{netloc}:{parts.port}"
            redacted.append(urlunsplit((parts.scheme, netloc, parts.path, "", "")))
        return ",".join(redacted)


def _nats_settings_named(prefix: str, doc: str,
                        base: type[NatsSettings] = NatsSettings) -> type[NatsSettings]:
    """:class:`NatsSettings` read from ``{prefix}_*`` in place of ``CDC_NATS_*`` (the same
    fields, e.g. ``CDC_READERS_NATS_URL``, ``CDC_READERS_NATS_USER``), for a second
    connection with another credential."""
    fields: dict[str, Any] = {}
    for name, info in NatsSettings.model_fields.items():
        alias = info.validation_alias
        first = str(alias.choices[0]) if isinstance(alias, AliasChoices) else str(alias)
        renamed = FieldInfo.merge_field_infos(
            info, validation_alias=_env(first.replace("CDC_NATS_", f"{prefix}_", 1)))
        fields[name] = (info.annotation, renamed)
    return create_model(f"{prefix.title().replace('_', '')}Settings", __base__=base,
                        __doc__=doc, **fields)


# `cdc-platform provision --readers`: the READERS account of deploy/nats/nats-server.conf
ReadersNatsSettings = _nats_settings_named(
    "CDC_READERS_NATS", "The READERS account's admin credential (its mirror streams).")


class _OwnCredential(NatsSettings):
    """A connection of one purpose with a NATS user of its own (``{PREFIX}_*``). Unset (no
    variable of its prefix), that purpose uses the main connection; where the server is (URL
    or host and port, the TLS CA) defaults to the main connection's, the credentials never
    do."""

    def resolved(self, main: NatsSettings) -> NatsSettings | None:
        """The settings to connect with (None: no variable set, use the main connection):
        the server's location taken from ``main`` where none is set here."""
        given = self.model_fields_set
        if not given:
            return None
        inherited = {} if given & {"url", "host", "port"} else {
            "url": main.url, "host": main.host, "port": main.port}
        if "tls_ca_file" not in given:
            inherited["tls_ca_file"] = main.tls_ca_file
        return self.model_copy(update=inherited)


class ReplyNatsSettings(_nats_settings_named("CDC_REPLY_NATS", "", _OwnCredential)):  # type: ignore[misc]
    """The connection that replies to snapshot requests go through (docs/wire-contract.md
    "Snapshots"): a NATS user that may publish inbox subjects and nothing else, so a requester's
    ``reply_to`` can never make the platform write anywhere else (``CDC_REPLY_NATS_*``)."""


class SensorNatsSettings(_nats_settings_named("CDC_SENSOR_NATS", "", _OwnCredential)):  # type: ignore[misc]
    """The connection the snapshot request sensor reads requests with: a NATS user that may
    read SNAPSHOT_REQUESTS through its durable and look snapshots up, and write nothing
    (``CDC_SENSOR_NATS_*``), also where the sensor's process holds the bridge's credential
    for the runs it hosts (deploy/docker-compose.yaml)."""


class FleetNatsSettings(_nats_settings_named("CDC_FLEET_NATS", "", _OwnCredential)):  # type: ignore[misc]
    """The connection ``mirror_fleet_sensor`` reads the mirrors' states with: a NATS user that
    may read the ``mirrors`` KV bucket and nothing else (``CDC_FLEET_NATS_*``), since what
    the bucket holds was written by readers."""


class StreamLimits(_Settings):
    """Limits shared by the three streams; each stream gets its own env prefix."""

    name: str
    subjects: tuple[str, ...]
    max_age_seconds: Seconds
    max_bytes: Bytes
    max_msgs: int = Field(-1, ge=-1)
    replicas: int = Field(1, ge=1, le=5)
    duplicate_window_seconds: Seconds = 120.0
    max_message_bytes: int = Field(-1, ge=-1)  # headers and payload; -1: the server's limit
    max_msgs_per_subject: int = Field(-1, ge=-1)
    # ADR-50 fast-ingest batch publishing (nats-server >= 2.14); the CDC bridge's fast path.
    allow_batched: bool = False


class CdcStreamSettings(StreamLimits):
    """The ``CDC`` stream. Its retention bounds how old a snapshot's cutover point may be:
    a consumer must start reading CDC at the cutover sequence before it is aged out."""

    name: str = "CDC"
    subjects: tuple[str, ...] = ("cdc.>",)
    max_age_seconds: Seconds = Field(7 * 86400.0, validation_alias=_env("CDC_STREAM_MAX_AGE"))
    max_bytes: Bytes = Field(8 * 1024**3, validation_alias=_env("CDC_STREAM_MAX_BYTES"))
    max_msgs: int = Field(-1, ge=-1, validation_alias=_env("CDC_STREAM_MAX_MSGS"))
    replicas: int = Field(1, ge=1, le=5, validation_alias=_env("CDC_STREAM_REPLICAS"))
    duplicate_window_seconds: Seconds = Field(
        120.0, validation_alias=_env("CDC_STREAM_DUPLICATE_WINDOW")
    )
    allow_batched: bool = Field(True, validation_alias=_env("CDC_STREAM_ALLOW_BATCHED"))


class InitStreamSettings(StreamLimits):
    """The ``INIT`` stream of snapshot chunks and meta messages."""

    name: str = "INIT"
    subjects: tuple[str, ...] = ("init.>",)
    max_age_seconds: Seconds = Field(7 * 86400.0, validation_alias=_env("CDC_INIT_MAX_AGE"))
    max_bytes: Bytes = Field(8 * 1024**3, validation_alias=_env("CDC_INIT_MAX_BYTES"))
    max_msgs: int = Field(10_000_000, ge=-1, validation_alias=_env("CDC_INIT_MAX_MSGS"))
    replicas: int = Field(1, ge=1, le=5, validation_alias=_env("CDC_INIT_REPLICAS"))
    duplicate_window_seconds: Seconds = Field(
        600.0, validation_alias=_env("CDC_INIT_DUPLICATE_WINDOW")
    )


class RequestStreamSettings(StreamLimits):
    """The ``SNAPSHOT_REQUESTS`` stream that keeps ``snapshot.request.>`` messages until a
    sensor has turned them into runs (requests survive while nothing listens)."""

    name: str = "SNAPSHOT_REQUESTS"
    subjects: tuple[str, ...] = ("snapshot.request.>",)
    max_age_seconds: Seconds = Field(86400.0, validation_alias=_env("CDC_REQUESTS_MAX_AGE"))
    max_bytes: Bytes = Field(64 * 1024**2, validation_alias=_env("CDC_REQUESTS_MAX_BYTES"))
    max_msgs: int = Field(100_000, ge=-1, validation_alias=_env("CDC_REQUESTS_MAX_MSGS"))
    replicas: int = Field(1, ge=1, le=5, validation_alias=_env("CDC_REQUESTS_REPLICAS"))
    # Hostile input: nats-server refuses a request message over this (the requester gets
    # its error, the platform never sees it); a body over 4 KB that fits is refused by the
    # sensor with a reply naming the limit. The stream holds pending requests only and,
    # when full, refuses new ones (provision.stream_config): a flood pushes out no pending
    # request; on one table's subject, it replaces that table's older requests only.
    max_message_bytes: int = Field(8192, ge=-1,
                                   validation_alias=_env("CDC_REQUESTS_MAX_MESSAGE_BYTES"))
    max_msgs_per_subject: int = Field(100, ge=-1,
                                      validation_alias=_env("CDC_REQUESTS_MAX_PER_TABLE"))

    @field_validator("max_message_bytes")
    @classmethod
    def _room_for_a_body(cls, value: int) -> int:
        if value != -1 and value < _MIN_REQUEST_MESSAGE_BYTES:
            raise ValueError(f"must be -1 (no limit) or at least {_MIN_REQUEST_MESSAGE_BYTES}: "
                             "a 4 KB request body and its headers must fit")
        return value


# A snapshot request body is at most 4 KB (wire.REQUEST_BODY_MAX_BYTES) plus headers.
_MIN_REQUEST_MESSAGE_BYTES = 4096 + 1024


class SchemaBucketSettings(_Settings):
    """The ``schemas`` KV bucket (key = wire table name)."""

    bucket: str = Field("schemas", validation_alias=_env("CDC_SCHEMAS_BUCKET"))
    history: int = Field(10, ge=1, le=64, validation_alias=_env("CDC_SCHEMAS_HISTORY"))
    replicas: int = Field(1, ge=1, le=5, validation_alias=_env("CDC_SCHEMAS_REPLICAS"))


class DictionaryBucketSettings(_Settings):
    """The KV bucket of per-table zstd dictionaries (key = ``{table}.{dictionary id}``)."""

    bucket: str = Field("zstd_dictionaries", validation_alias=_env("CDC_DICTIONARY_BUCKET"))
    replicas: int = Field(1, ge=1, le=5, validation_alias=_env("CDC_DICTIONARY_REPLICAS"))


class LargeBucketSettings(_Settings):
    """The Object Store bucket of payloads over max_payload (claim checks); its objects live
    as long as the CDC stream keeps events (the CDC stream's max age)."""

    bucket: str = Field("cdc_large", validation_alias=_env("CDC_LARGE_BUCKET"))
    replicas: int = Field(1, ge=1, le=5, validation_alias=_env("CDC_LARGE_REPLICAS"))


class MirrorStateBucketSettings(_Settings):
    """The ``mirrors`` KV bucket: each mirror's state (key = its mirror id), written by the
    mirrors through READERS' ``mirror.state.>`` import; a mirror that stops writing is gone
    from it after ``max_age`` (docs/verification.md Part 2, item 5)."""

    bucket: str = Field("mirrors", validation_alias=_env("CDC_MIRROR_STATE_BUCKET"))
    max_age_seconds: Seconds = Field(120.0, gt=0, validation_alias=_env("CDC_MIRROR_STATE_TTL"))
    max_value_bytes: Bytes = Field(64 * 1024, validation_alias=_env(
        "CDC_MIRROR_STATE_MAX_VALUE_BYTES"))
    max_bytes: Bytes = Field(64 * 1024**2, validation_alias=_env("CDC_MIRROR_STATE_MAX_BYTES"))
    replicas: int = Field(1, ge=1, le=5, validation_alias=_env("CDC_MIRROR_STATE_REPLICAS"))


class EncodingSettings(_Settings):
    """Payload encoding and snapshot compression."""

    format: Literal["msgpack", "json"] = Field("msgpack", validation_alias=_env("CDC_FORMAT"))
    zstd: bool = Field(False, validation_alias=_env("CDC_ZSTD"))
    zstd_level: int = Field(3, ge=1, le=22, validation_alias=_env("CDC_ZSTD_LEVEL"))
    zstd_dictionary: bool = Field(True, validation_alias=_env("CDC_ZSTD_DICTIONARY"))
    chunk_rows: int = Field(10_000, ge=1, validation_alias=_env("CDC_CHUNK_ROWS"))


class VerifySettings(_Settings):
    """Source verifications (docs/verification.md Part 2, item 2)."""

    # how long a verification waits for the bridge to have stored every transaction below
    # its digest's lsn before it fails ("the bridge is behind")
    wait_seconds: Seconds = Field(600.0, gt=0, validation_alias=_env("CDC_VERIFY_WAIT"))
    yield_lag_bytes: Bytes = Field(
        16 * 1024**2, ge=0, validation_alias=_env("CDC_VERIFY_YIELD_LAG"),
        description="A verification gives way to CDC: its tasks pause before and between "
        "blocks of rows once the bridge's slot has more than this much WAL unconfirmed "
        "(pg_current_wal_lsn() - confirmed_flush_lsn, read at most every 0.05 s), until the "
        "bridge has caught up: confirmed the WAL flushed when they began to pause, or "
        "down to a sixteenth of this behind. Above "
        "what a keeping-up bridge shows between its confirmations (the WAL written in ~1 s "
        "at peak), below CDC_LAG_WARN. 0: never pause. No slot, or no bridge streaming it: "
        "no pause.")
    max_yield_seconds: Seconds = Field(
        300.0, ge=0, validation_alias=_env("CDC_VERIFY_MAX_YIELD"),
        description="How long a verification's tasks pause for the bridge in all, at most "
        "(each task gets its share: this over the waves of tasks the cores run), then go "
        "on while the bridge is behind, said in the log: the verification holds an "
        "exported snapshot (VACUUM cannot remove rows deleted after it) and its temporary "
        "slot's WAL meanwhile. 0: never pause.")
    nice: int = Field(
        10, ge=0, le=19, validation_alias=_env("CDC_VERIFY_NICE"),
        description="`cdc-platform verify` runs at this nice value (Unix; never lowered "
        "below the one it started with), and with it the local Spark it starts: the "
        "verification is its process's only work, so the bridge, its walsender and "
        "nats-server get the cores first on a shared machine. 0: as started. Dagster runs "
        "and Spark clusters are not reniced (their processes serve other work too).")


class BridgeSettings(_Settings):
    """How the CDC bridge runs (message mode, heartbeats, telemetry, monitoring)."""

    message_mode: Literal["per-change", "batched"] = Field(
        "per-change", validation_alias=_env("CDC_MESSAGE_MODE"))
    publish_mode: Literal["auto", "fast-batch", "per-message"] = Field(
        "auto", validation_alias=_env("CDC_PUBLISH_MODE"))
    batch_max_events: int = Field(500, ge=1, le=10_000,
                                  validation_alias=_env("CDC_BATCH_MAX_EVENTS"))
    heartbeat_interval_seconds: Seconds = Field(
        10.0, gt=0, validation_alias=_env("CDC_HEARTBEAT_INTERVAL"))
    status_interval_seconds: Seconds = Field(
        1.0, gt=0, le=10, validation_alias=_env("CDC_STATUS_INTERVAL"))
    http_host: str = Field("127.0.0.1", validation_alias=_env("CDC_HTTP_HOST"))
    http_port: int = Field(9090, ge=0, le=65535, validation_alias=_env("CDC_HTTP_PORT"))
    admin_token: SecretStr | None = Field(None, validation_alias=_env("CDC_ADMIN_TOKEN"))
    metrics_log_interval_seconds: Seconds = Field(
        15.0, gt=0, validation_alias=_env("CDC_METRICS_LOG_INTERVAL"))
    lag_check_interval_seconds: Seconds = Field(
        30.0, gt=0, validation_alias=_env("CDC_LAG_CHECK_INTERVAL"))
    lag_warn_bytes: Bytes = Field(512 * 1024**2, validation_alias=_env("CDC_LAG_WARN"))
    lag_critical_bytes: Bytes = Field(1024**3, validation_alias=_env("CDC_LAG_CRITICAL"))
    # a table added to the publication gets its schema in KV within this
    publication_poll_seconds: Seconds = Field(
        5.0, gt=0, validation_alias=_env("CDC_PUBLICATION_POLL_INTERVAL"))
    # warn when safe_wal_size (WAL left before max_slot_wal_keep_size) drops below this;
    # critical below a quarter of it
    safe_wal_warn_bytes: Bytes = Field(2 * 1024**3, validation_alias=_env("CDC_SAFE_WAL_WARN"))
    max_in_flight_messages: int = Field(20_000, ge=100,
                                        validation_alias=_env("CDC_MAX_IN_FLIGHT"))
    max_in_flight_bytes: Bytes = Field(64 * 1024**2,
                                       validation_alias=_env("CDC_MAX_IN_FLIGHT_BYTES"))
    reconnect_min_seconds: Seconds = Field(1.0, gt=0, validation_alias=_env("CDC_RECONNECT_MIN"))
    reconnect_max_seconds: Seconds = Field(30.0, gt=0,
                                           validation_alias=_env("CDC_RECONNECT_MAX"))
    shutdown_timeout_seconds: Seconds = Field(
        30.0, gt=0, validation_alias=_env("CDC_SHUTDOWN_TIMEOUT"))
    # an invalidated slot: "stop" (say what to do) or "resync" (mark the gap in CDC, drop the
    # slot, stream from a new one; mirrors verify and repair: docs/verification.md)
    on_slot_lost: Literal["stop", "resync"] = Field(
        "stop", validation_alias=_env("CDC_ON_SLOT_LOST"))
    # an nkey seed file: the bridge signs every message it publishes (docs/wire-contract.md
    # "Signatures")
    signing_key_seed: str | None = Field(None, validation_alias=_env("CDC_SIGNING_KEY_SEED"))

    @field_validator("signing_key_seed")
    @classmethod
    def _usable_seed(cls, value: str | None) -> str | None:
        if value is not None:
            _read_seed(value)
        return value

    def signing_seed(self) -> str | None:
        """The seed's text (None: signing is off); snapshot tasks get it with their spec."""
        return _read_seed(self.signing_key_seed) if self.signing_key_seed else None

    def signer(self) -> MessageSigner | None:
        """What signs the platform's messages (None: signing is off)."""
        seed = self.signing_seed()
        return MessageSigner(seed) if seed is not None else None


class OrchestrationSettings(_Settings):
    """Dagster-side knobs read when the code location loads (no secrets here)."""

    spark_master: str = Field("local[*]", validation_alias=_env("CDC_SPARK_MASTER"))
    spark_driver_memory: str = Field("1g", validation_alias=_env("CDC_SPARK_DRIVER_MEMORY"))
    snapshot_cron: str = Field("0 3 * * *", validation_alias=_env("CDC_SNAPSHOT_CRON"))
    snapshot_timezone: str = Field("UTC", validation_alias=_env("CDC_SNAPSHOT_TIMEZONE"))
    # verification_schedule's cron (docs/verification.md), in snapshot_timezone; unset: off
    verify_cron: str | None = Field(None, validation_alias=_env("CDC_VERIFY_CRON"))
    cdc_observe_interval_seconds: Seconds = Field(
        30.0, gt=0, validation_alias=_env("CDC_OBSERVE_INTERVAL"))
    # snapshots of tables up to this size run without Spark (see SnapshotOptions)
    snapshot_local_max_bytes: Bytes = Field(
        64 * 1024**2, validation_alias=_env("CDC_SNAPSHOT_LOCAL_MAX_BYTES"))
    # a request is answered with a snapshot of the table at most this old (0: always new)
    snapshot_reuse_seconds: Seconds = Field(
        300.0, ge=0, validation_alias=_env("CDC_SNAPSHOT_REUSE_SECONDS"))
    # a table's snapshot runs started by requests begin at least this far apart: a request
    # for a fresher snapshot gets one this young, or waits for the next run
    snapshot_min_interval_seconds: Seconds = Field(
        60.0, ge=0, validation_alias=_env("CDC_SNAPSHOT_MIN_INTERVAL"))
    # a table's verification runs started by requests begin at least this far apart (one
    # asking other bits or buckets meanwhile is refused until the held one started)
    verify_min_interval_seconds: Seconds = Field(
        60.0, ge=0, validation_alias=_env("CDC_VERIFY_MIN_INTERVAL"))
    cdc_relaunch_backoff_seconds: Seconds = Field(
        30.0, gt=0, validation_alias=_env("CDC_RELAUNCH_BACKOFF"))
    # A cdc_job run whose worker wrote no liveness tag for this long is dead (killed, its
    # host gone): cdc_sensor marks it failed and launches a new one.
    cdc_liveness_timeout_seconds: Seconds = Field(
        90.0, ge=10, validation_alias=_env("CDC_RUN_LIVENESS_TIMEOUT"))
    cdc_liveness_interval_seconds: Seconds = Field(
        10.0, gt=0, validation_alias=_env("CDC_RUN_LIVENESS_INTERVAL"))
    # mirrors_fresh fails when a mirror is this far behind the source's commit time, or
    # when a mirror seen within CDC_MIRROR_GONE_KEEP stopped reporting (then forgotten)
    mirror_lag_critical_seconds: Seconds = Field(
        300.0, gt=0, validation_alias=_env("CDC_MIRROR_LAG_CRITICAL"))
    mirror_gone_keep_seconds: Seconds = Field(
        86400.0, gt=0, validation_alias=_env("CDC_MIRROR_GONE_KEEP"))
    # the public nkeys of the platform's signing keys (comma-separated, for rotation): the
    # snapshot request sensor hands out only snapshots they signed, without holding the seed
    signing_public_keys: PublicKeys = Field("", validation_alias=_env("CDC_SIGNING_PUBLIC_KEYS"))

    def snapshot_verifier(self) -> SignatureVerifier | None:
        """What a snapshot the sensor hands out must be signed by: the keys given, else the
        platform's own key when this process holds its seed (one environment for all, as in
        the dev stack), else nothing (signing is off)."""
        keys = _listed(self.signing_public_keys)
        if not keys:
            signer = load_settings(BridgeSettings).signer()
            keys = [signer.public_key] if signer is not None else []
        return SignatureVerifier(keys) if keys else None


class MirrorSettings(_Settings):
    """``cdc-platform mirror``: how it bootstraps, follows and reports (docs/mirror.md)."""

    snapshot_max_age_seconds: Seconds = Field(
        600.0, ge=0, validation_alias=_env("CDC_MIRROR_SNAPSHOT_MAX_AGE"))
    snapshot_wait_seconds: Seconds = Field(
        3600.0, gt=0, validation_alias=_env("CDC_MIRROR_SNAPSHOT_WAIT"))
    status_interval_seconds: Seconds = Field(
        10.0, gt=0, validation_alias=_env("CDC_MIRROR_STATUS_INTERVAL"))
    fetch_batch: int = Field(256, ge=1, le=10_000, validation_alias=_env("CDC_MIRROR_FETCH_BATCH"))
    # public nkeys, comma-separated: only messages signed by one of them are applied
    trusted_keys: PublicKeys = Field("", validation_alias=_env("CDC_MIRROR_TRUSTED_KEYS"))
    # keep each table's digest current as changes apply (docs/verification.md "Mirror
    # upkeep"); off: none kept (``mirror verify`` says so), for comparing the apply rate
    digests: bool = Field(True, validation_alias=_env("CDC_MIRROR_DIGESTS"))
    # at a verify marker, recompute the table's digest from its rows on a second connection
    # (finds rows changed behind the mirror's back); never: compare the kept digest only
    verify_scan: Literal["at_marker", "never"] = Field(
        "at_marker", validation_alias=_env("CDC_MIRROR_VERIFY_SCAN"))
    # digest deltas a verification logs between its marker and its digest message at most
    # (past it: that verification is not comparable)
    verify_log_rows: int = Field(1_000_000, ge=1,
                                 validation_alias=_env("CDC_MIRROR_VERIFY_LOG_ROWS"))

    def verifier(self) -> SignatureVerifier | None:
        """What checks each message before it is applied (None: no key is trusted)."""
        keys = _listed(self.trusted_keys)
        return SignatureVerifier(keys) if keys else None

    # The key of this mirror's state in KV `mirrors` (mirror.state.{mirror_id}): a name, or
    # `{team}.{name}` for a team's user (which may publish mirror.state.{team}.> only).
    # Unset: `{hostname}-{file stem}`, made a subject token (mirror/fleet.py).
    mirror_id: str | None = Field(None, validation_alias=_env("CDC_MIRROR_ID"))
    state_interval_seconds: Seconds = Field(
        30.0, gt=0, validation_alias=_env("CDC_MIRROR_STATE_INTERVAL"))

    @field_validator("mirror_id")
    @classmethod
    def _state_key(cls, value: str | None) -> str | None:
        if value is not None and not re.fullmatch(MIRROR_ID_PATTERN, value):
            raise ValueError("must be {name} or {team}.{name} (each: letters, digits, _ or -, "
                             "up to 64)")
        return value

    # The subject prefix of this mirror's inboxes (nats-py's inbox_prefix): where its replies,
    # pull deliveries and snapshot replies come. A team user of deploy/nats may subscribe to
    # its own prefix only (`_INBOX_team_a`), so no other team reads what it is sent.
    inbox_prefix: str = Field("_INBOX", validation_alias=_env("CDC_MIRROR_INBOX_PREFIX"))

    @field_validator("inbox_prefix")
    @classmethod
    def _reply_prefix(cls, value: str) -> str:
        # the snapshot sensor replies only to inbox subjects (snapshot.requests)
        if not re.fullmatch(r"_INBOX(_[A-Za-z0-9_-]{1,64})?", value):
            raise ValueError("must be _INBOX or _INBOX_{name} (name: letters, digits, _ or -, "
                             "up to 64)")
        return value


class NatsTopology(_Settings):
    """All the JetStream objects the platform provisions."""

    cdc: CdcStreamSettings = Field(default_factory=CdcStreamSettings)
    init: InitStreamSettings = Field(default_factory=InitStreamSettings)
    requests: RequestStreamSettings = Field(default_factory=RequestStreamSettings)
    schemas: SchemaBucketSettings = Field(default_factory=SchemaBucketSettings)
    dictionaries: DictionaryBucketSettings = Field(default_factory=DictionaryBucketSettings)
    large: LargeBucketSettings = Field(default_factory=LargeBucketSettings)
    mirrors: MirrorStateBucketSettings = Field(default_factory=MirrorStateBucketSettings)


class PlatformSettings(_Settings):
    """Everything, read at once so that every bad variable is reported before starting."""

    postgres: PostgresSettings = Field(default_factory=PostgresSettings)
    nats: NatsSettings = Field(default_factory=NatsSettings)
    topology: NatsTopology = Field(default_factory=NatsTopology)
    encoding: EncodingSettings = Field(default_factory=EncodingSettings)
    bridge: BridgeSettings = Field(default_factory=BridgeSettings)
    verify: VerifySettings = Field(default_factory=VerifySettings)


def _env_name(model: type[BaseSettings], field: str) -> str:
    """The variable the bad value came from (the one set, of a setting's several names)."""
    info = model.model_fields.get(field) or next(
        (candidate for candidate in model.model_fields.values()
         if isinstance(candidate.validation_alias, AliasChoices)
         and field in map(str, candidate.validation_alias.choices)), None)
    alias = info.validation_alias if info else None
    if isinstance(alias, AliasChoices):
        names = [str(a) for a in alias.choices]
        present = {name.upper() for name in os.environ}
        given = [name for name in names if name.upper() in present]
        return given[0] if given else " / ".join(names)
    prefix = model.model_config.get("env_prefix", "")
    return f"{prefix}{field}".upper()


def variable_names() -> set[str]:
    """Every environment variable some setting reads (its own name and the seed's)."""
    names: set[str] = set()
    models: list[type[_Settings]] = list(_Settings.__subclasses__())
    while models:
        model = models.pop()
        models.extend(model.__subclasses__())
        for field in model.model_fields.values():
            alias = field.validation_alias
            if isinstance(alias, AliasChoices):
                names.update(choice for choice in alias.choices if isinstance(choice, str))
            elif isinstance(alias, str):
                names.add(alias)
    return names


def load_settings(model: type[_Settings] = PlatformSettings, **overrides: Any) -> Any:
    """Build ``model`` from the environment; one ``ConfigError`` line on bad input."""
    try:
        if model is PlatformSettings:
            # Sub-models read their own variables; build them one by one so the error
            # names the right variable.
            parts = {}
            for name, sub in (("postgres", PostgresSettings), ("nats", NatsSettings),
                              ("topology", NatsTopology), ("encoding", EncodingSettings),
                              ("bridge", BridgeSettings), ("verify", VerifySettings)):
                parts[name] = overrides.pop(name, None) or load_settings(sub)
            return PlatformSettings(**parts)
        if model is NatsTopology:
            return NatsTopology(
                cdc=load_settings(CdcStreamSettings), init=load_settings(InitStreamSettings),
                requests=load_settings(RequestStreamSettings),
                schemas=load_settings(SchemaBucketSettings),
                mirrors=load_settings(MirrorStateBucketSettings),
            )
        return model(**overrides)
    except ValidationError as exc:
        error = exc.errors()[0]
        field = str(error["loc"][0]) if error["loc"] else "?"
        raise ConfigError(
            f"invalid setting {_env_name(model, field)}: {error['msg']}"
        ) from None
