import pytest

pytest_plugins = ["cdc_platform_tests.fixtures.services"]


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
