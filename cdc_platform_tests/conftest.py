import signal

import pytest

pytest_plugins = ["cdc_platform_tests.fixtures.services"]


def pytest_configure(config):
    """Stop signals as an interactive session has them. A session started in the background
    (CI under nohup, ``make test &``) inherits an ignored SIGINT; Dagster, run in this process,
    gives SIGTERM SIGINT's disposition, and every child then inherits an ignored SIGTERM:
    Dagster's compute-log ``tail`` outlived its ``terminate()`` by 30 s per materialization,
    and a command under test lost a stop sent before it installed its handler."""
    if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    if signal.getsignal(signal.SIGTERM) == signal.SIG_IGN:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


def pytest_report_header(config):
    """Which PostgreSQL the session's server runs (CDC_PG_BIN_DIR picks another)."""
    from cdc_platform.dev.servers import find_postgres_bin_dir, server_version

    bin_dir = find_postgres_bin_dir()
    return f"postgresql: PostgreSQL {server_version(bin_dir)} ({bin_dir})"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """Never log secrets: after each test, none of its captured output (stdout, stderr, log
    records) may hold a password a fixture handed to the platform."""
    outcome = yield
    report = outcome.get_result()
    if report.when != "teardown":
        return
    from cdc_platform_tests.fixtures.services import TEST_SECRETS

    for title, content in report.sections:
        leaked = [secret for secret in TEST_SECRETS if secret in content]
        if leaked:
            report.outcome = "failed"
            report.longrepr = (f"{title} holds a test password (a secret reached an output): "
                               f"{content[max(0, content.find(leaked[0]) - 200):][:400]!r}")
            return


_SCANNED_BYTES = 64 << 20  # larger files are data, not logs


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
    """Under pytest-xdist: a worker's passwords come back to the controller, which scans the
    whole temp root (each worker's is under it) when the session finishes."""
    from cdc_platform_tests.fixtures.services import TEST_SECRETS

    output = getattr(node, "workeroutput", None) or {}
    if "test_secrets" not in output:  # (a worker that crashed: the run fails anyway)
        reporter = node.config.pluginmanager.get_plugin("terminalreporter")
        if reporter is not None:
            worker = getattr(getattr(node, "gateway", None), "id", "a worker")
            reporter.write_line(f"{worker} ended without handing over its passwords: its "
                                "files are searched for the other workers' only", red=True)
    TEST_SECRETS.update(output.get("test_secrets", ()))


def pytest_sessionfinish(session, exitstatus):
    """Never log secrets, child processes included: what Dagster runs, the dev stack and the
    CLI wrote under the session's temp dir (run logs, compute logs, Dagster's event log and
    run storage, mirror files) may not hold a password a fixture handed to the platform."""
    from cdc_platform_tests.fixtures.services import TEST_SECRETS

    worker_output = getattr(session.config, "workeroutput", None)
    if worker_output is not None:  # an xdist worker: the controller scans
        worker_output["test_secrets"] = sorted(TEST_SECRETS)
        return
    factory = getattr(session.config, "_tmp_path_factory", None)
    if factory is None or not TEST_SECRETS:
        return
    secrets = [secret.encode() for secret in TEST_SECRETS]
    leaks = []
    for path in factory.getbasetemp().rglob("*"):
        try:
            if not path.is_file() or path.is_symlink() or path.stat().st_size > _SCANNED_BYTES:
                continue
            data = path.read_bytes()
        except OSError:
            continue  # (removed meanwhile, or a socket)
        if any(secret in data for secret in secrets):
            leaks.append(str(path))
    if leaks:
        reporter = session.config.pluginmanager.get_plugin("terminalreporter")
        if reporter is not None:
            reporter.write_line("a test password reached files written during the tests: "
                                + ", ".join(leaks), red=True)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
