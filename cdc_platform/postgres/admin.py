"""Applying the DBA scripts in ``cdc_platform/sql/`` from Python (dev stack, tests,
``cdc-platform setup-db``).

The scripts are the ones a DBA runs with psql; parameters travel as ``cdc.*`` session
settings, exactly as ``PGOPTIONS="-c cdc.role=..."`` would set them.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator, Mapping
from pathlib import Path

import psycopg
from psycopg import sql

from cdc_platform.errors import CdcError

log = logging.getLogger(__name__)

SERVER_SETTINGS_SQL = "00_server_settings.sql"
PUBLICATION_SQL = "10_publication.sql"
ROLE_SQL = "20_role.sql"


def sql_dir() -> Path:
    """The package's ``sql/`` folder, ``cdc_platform/sql`` (``CDC_SQL_DIR`` overrides)."""
    override = os.environ.get("CDC_SQL_DIR")
    path = Path(override) if override else Path(__file__).resolve().parents[1] / "sql"
    if not (path / SERVER_SETTINGS_SQL).exists():
        raise CdcError(f"sql scripts not found in {path} (set CDC_SQL_DIR)")
    return path


def split_statements(script: str) -> Iterator[str]:
    """Split a psql script into statements at ``;`` outside quotes, dollar quotes, comments.

    Statements run one by one because ``ALTER SYSTEM`` refuses to run inside the implicit
    transaction block of a multi-statement query.
    """
    start = index = 0
    length = len(script)
    while index < length:
        char = script[index]
        if script.startswith("--", index):
            index = script.find("\n", index)
            index = length if index < 0 else index
        elif script.startswith("/*", index):
            end = script.find("*/", index + 2)
            index = length if end < 0 else end + 2
            continue
        elif char in ("'", '"'):
            end = index + 1
            while True:
                end = script.find(char, end)
                if end < 0 or not script.startswith(char, end + 1):
                    break
                end += 2  # doubled quote inside the literal
            index = length if end < 0 else end + 1
            continue
        elif char == "$":
            tag_end = script.find("$", index + 1)
            tag = script[index : tag_end + 1] if tag_end > 0 else ""
            if tag and (tag == "$$" or tag[1:-1].replace("_", "a").isalnum()):
                end = script.find(tag, tag_end + 1)
                index = length if end < 0 else end + len(tag)
                continue
        elif char == ";":
            statement = script[start:index].strip()
            if _has_code(statement):
                yield statement
            start = index + 1
        index += 1
    tail = script[start:].strip()
    if _has_code(tail):
        yield tail


def _has_code(statement: str) -> bool:
    return any(line.strip() and not line.strip().startswith("--")
               for line in statement.splitlines())


def apply_sql_file(conn: psycopg.Connection, name: str,
                   params: Mapping[str, str] | None = None) -> None:
    """Run ``sql/<name>`` on ``conn`` (autocommit) with ``cdc.<key>`` settings from params."""
    path = sql_dir() / name
    for key, value in (params or {}).items():
        conn.execute("SELECT set_config(%s, %s, false)", (f"cdc.{key}", value))
    for statement in split_statements(path.read_text()):
        try:
            conn.execute(statement.encode())
        except psycopg.Error as exc:
            raise CdcError(f"{name}: {exc.diag.message_primary or exc}") from exc
    log.info("applied %s", name)


def restart_needed(conn: psycopg.Connection) -> bool:
    """True when settings changed by ALTER SYSTEM wait for a server restart."""
    conn.execute("SELECT pg_reload_conf()")
    # The reload is asynchronous; pending_restart shows only once the config is re-read,
    # so also compare the file settings directly.
    row = conn.execute(
        "SELECT count(*) FROM pg_file_settings f JOIN pg_settings s USING (name) "
        "WHERE NOT f.applied AND s.context = 'postmaster'"
    ).fetchone()
    return bool(row and row[0])


def set_role_password(conn: psycopg.Connection, role: str, password: str) -> None:
    """Set a password without sending it in clear text (hashed client side, like \\password)."""
    hashed = conn.pgconn.encrypt_password(password.encode(), role.encode(), b"scram-sha-256")
    conn.execute(sql.SQL("ALTER ROLE {} PASSWORD {}").format(
        sql.Identifier(role), sql.Literal(hashed.decode())))


def provision_database(conn: psycopg.Connection, *, publication: str, role: str,
                       tables: list[str], role_password: str | None = None) -> None:
    """Publication then role, as a DBA would; the connection must be a superuser's."""
    apply_sql_file(conn, PUBLICATION_SQL,
                   {"publication": publication, "tables": ",".join(tables)})
    apply_sql_file(conn, ROLE_SQL, {"role": role, "publication": publication})
    if role_password is not None:
        set_role_password(conn, role, role_password)
