pytest_plugins = ["cdc_platform_tests.fixtures.services"]
