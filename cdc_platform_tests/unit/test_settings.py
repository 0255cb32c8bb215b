import pytest

from cdc_platform.errors import ConfigError
from cdc_platform.settings import (
    EncodingSettings,
    NatsSettings,
    PlatformSettings,
    PostgresSettings,
    ReplyNatsSettings,
    load_settings,
    parse_duration_seconds,
    parse_size_bytes,
)


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    import os

    for name in list(os.environ):
        if name.startswith(("CDC_", "PG_", "POSTGRES_BRIDGE_", "NATS_")):
            monkeypatch.delenv(name)


def test_seed_variable_names_are_accepted(monkeypatch):
    monkeypatch.setenv("PG_HOST", "db.internal")
    monkeypatch.setenv("PG_PORT", "6543")
    monkeypatch.setenv("PG_DB", "app")
    monkeypatch.setenv("POSTGRES_BRIDGE_USER", "bridge_reader")
    monkeypatch.setenv("POSTGRES_BRIDGE_PASSWORD", "pg-secret")
    monkeypatch.setenv("NATS_HOST", "nats.internal")
    monkeypatch.setenv("NATS_BRIDGE_USER", "bridge_user")
    monkeypatch.setenv("NATS_BRIDGE_PASSWORD", "nats-secret")
    settings = load_settings()
    assert (settings.postgres.host, settings.postgres.port, settings.postgres.database) == (
        "db.internal", 6543, "app")
    assert settings.postgres.password.get_secret_value() == "pg-secret"
    assert settings.nats.servers() == ["nats://nats.internal:4222"]
    assert settings.nats.connect_options()["password"] == "nats-secret"


def test_our_names_win_over_seed_names(monkeypatch):
    monkeypatch.setenv("PG_HOST", "seed")
    monkeypatch.setenv("CDC_PG_HOST", "ours")
    assert load_settings(PostgresSettings).host == "ours"


def test_nats_url_form_and_cluster_list(monkeypatch):
    monkeypatch.setenv("NATS_URL", "nats://a:4222, nats://b:4223")
    assert load_settings(NatsSettings).servers() == ["nats://a:4222", "nats://b:4223"]


@pytest.mark.parametrize(
    ("variable", "value", "named"),
    [
        ("PG_PORT", "not-a-port", "PG_PORT"),
        ("CDC_PG_PORT", "70000", "CDC_PG_PORT"),
        ("CDC_SLOT", "Bad-Slot", "CDC_SLOT"),
        ("NATS_URL", "http://x", "NATS_URL"),
        ("CDC_STREAM_MAX_AGE", "7 fortnights", "CDC_STREAM_MAX_AGE"),
        ("CDC_INIT_MAX_BYTES", "lots", "CDC_INIT_MAX_BYTES"),
        ("CDC_FORMAT", "xml", "CDC_FORMAT"),
        ("CDC_CHUNK_ROWS", "0", "CDC_CHUNK_ROWS"),
        ("CDC_PG_DSN", "host=db port=abc", "CDC_PG_DSN"),
        ("CDC_PG_DSN", "host=db password=pw oops", "CDC_PG_DSN"),
        ("CDC_REQUESTS_MAX_MESSAGE_BYTES", "1000", "CDC_REQUESTS_MAX_MESSAGE_BYTES"),
    ],
)
def test_bad_input_is_one_line_naming_the_variable(monkeypatch, variable, value, named):
    monkeypatch.setenv(variable, value)
    with pytest.raises(ConfigError) as error:
        load_settings()
    message = str(error.value)
    assert message.startswith(f"invalid setting {named}: ")  # the variable set, alone
    assert "\n" not in message
    assert value not in message or value in ("0",)  # input is not echoed back


def test_the_readers_credential_and_a_mirrors_inbox_prefix(monkeypatch):
    """`provision --readers` connects with CDC_READERS_NATS_* (the fields of CDC_NATS_*,
    read apart from them); a mirror's inbox prefix is one the snapshot sensor replies to."""
    from cdc_platform.settings import MirrorSettings, ReadersNatsSettings

    monkeypatch.setenv("CDC_NATS_USER", "provisioner")
    monkeypatch.setenv("CDC_READERS_NATS_USER", "readers_admin")
    monkeypatch.setenv("CDC_READERS_NATS_URL", "nats://n1:4222,nats://n2:4222")
    readers = load_settings(ReadersNatsSettings)
    assert (readers.user, readers.servers()) == ("readers_admin",
                                                 ["nats://n1:4222", "nats://n2:4222"])
    assert load_settings(NatsSettings).user == "provisioner"
    monkeypatch.setenv("CDC_READERS_NATS_PORT", "0")
    with pytest.raises(ConfigError, match="^invalid setting CDC_READERS_NATS_PORT: "):
        load_settings(ReadersNatsSettings)

    monkeypatch.setenv("CDC_MIRROR_INBOX_PREFIX", "_INBOX_team_a")
    assert load_settings(MirrorSettings).inbox_prefix == "_INBOX_team_a"
    for wrong in ("INBOX_team_a", "_INBOX_team.a", "_INBOX_"):
        monkeypatch.setenv("CDC_MIRROR_INBOX_PREFIX", wrong)
        with pytest.raises(ConfigError, match="^invalid setting CDC_MIRROR_INBOX_PREFIX: "):
            load_settings(MirrorSettings)


def test_secrets_never_printed(monkeypatch):
    monkeypatch.setenv("POSTGRES_BRIDGE_PASSWORD", "pg-very-secret")
    monkeypatch.setenv("NATS_URL", "nats://user:nats-very-secret@h:4222")
    monkeypatch.setenv("NATS_BRIDGE_PASSWORD", "nats-pw-secret")
    settings = load_settings()
    for text in (repr(settings), str(settings), settings.postgres.describe(),
                 settings.nats.describe(), repr(settings.model_dump())):
        assert "very-secret" not in text
        assert "nats-pw-secret" not in text
    assert settings.nats.describe() == "nats://h:4222"


def test_bad_secret_value_not_echoed_in_error(monkeypatch):
    monkeypatch.setenv("CDC_PG_CONNECT_TIMEOUT", "secret-looking-value")
    with pytest.raises(ConfigError) as error:
        load_settings(PostgresSettings)
    assert "secret-looking-value" not in str(error.value)


def test_conninfo_carries_replication_and_password():
    settings = PostgresSettings(host="h", port=5, user="u", password="p", database="d")
    conninfo = settings.conninfo(replication=True)
    assert "replication=database" in conninfo and "password=p" in conninfo
    assert "p" not in settings.describe().split("@")[0].replace("u", "")


@pytest.mark.parametrize(("text", "seconds"),
                         [("90", 90), ("90s", 90), ("15m", 900), ("7d", 604800),
                          ("1h30m", 5400), ("500ms", 0.5), (60, 60)])
def test_durations(text, seconds):
    assert parse_duration_seconds(text) == seconds


@pytest.mark.parametrize(("text", "size"),
                         [("1024", 1024), ("8G", 8 * 1024**3), ("512MiB", 512 * 1024**2),
                          ("-1", -1), ("1.5k", 1536)])
def test_sizes(text, size):
    assert parse_size_bytes(text) == size


def test_defaults_keep_cdc_well_beyond_seed_minute():
    settings = PlatformSettings()
    assert settings.topology.cdc.max_age_seconds >= 86400
    assert settings.encoding == EncodingSettings()


def test_the_deploy_env_example_is_valid_settings(monkeypatch):
    """deploy/cdc-platform.env.example loads as it is (every name known, every value valid)."""
    from pathlib import Path

    from cdc_platform.settings import variable_names

    known = variable_names() | {"DAGSTER_HOME"}  # (Dagster's own)
    example = Path(__file__).resolve().parents[2] / "deploy" / "cdc-platform.env.example"
    for line in example.read_text().splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            name, _, value = line.partition("=")
            assert name.strip() in known, f"{name} is no setting"
            monkeypatch.setenv(name.strip(), value.strip())
    settings = load_settings(PlatformSettings)
    assert settings.nats.servers()[0].startswith("tls://")
    assert settings.nats.tls_ca_file == "/etc/cdc-platform/nats-ca.pem"
    assert settings.postgres.sslmode == "verify-full"


def test_the_reply_connection_has_its_own_credentials(monkeypatch, tmp_path):
    """Unset: replies go through the main connection; set: its own user on the main
    connection's servers (unless it names its own), never the main connection's password."""
    monkeypatch.setenv("CDC_NATS_URL", "nats://nats.internal:4222")
    monkeypatch.setenv("CDC_NATS_USER", "sensor")
    monkeypatch.setenv("CDC_NATS_PASSWORD", "sensor-secret")
    main = load_settings(NatsSettings)
    assert load_settings(ReplyNatsSettings).resolved(main) is None
    monkeypatch.setenv("CDC_REPLY_NATS_USER", "replier")
    replies = load_settings(ReplyNatsSettings).resolved(main)
    assert replies.servers() == ["nats://nats.internal:4222"]
    assert (replies.connect_options()["user"], replies.connect_options()["password"]) == (
        "replier", "")
    monkeypatch.setenv("CDC_REPLY_NATS_URL", "nats://replies.internal:4222")
    assert load_settings(ReplyNatsSettings).resolved(main).servers() == [
        "nats://replies.internal:4222"]
    monkeypatch.setenv("CDC_REPLY_NATS_CREDS", str(tmp_path / "missing.creds"))
    with pytest.raises(ConfigError, match="CDC_REPLY_NATS_CREDS .*missing.creds"):
        load_settings(ReplyNatsSettings).resolved(main).connect_options()
