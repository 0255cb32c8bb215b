"""How a verification's tasks share CDC_VERIFY_MAX_YIELD (cdc_platform/verify/job.py
``yield_policy``), and the settings that drive it, read from the environment."""

from __future__ import annotations

import pytest

from cdc_platform.errors import ConfigError
from cdc_platform.settings import PlatformSettings, VerifySettings, load_settings
from cdc_platform.snapshot.options import SnapshotOptions
from cdc_platform.verify.job import yield_policy


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    import os

    for name in list(os.environ):
        if name.startswith("CDC_"):
            monkeypatch.delenv(name)


def _settings(**verify) -> PlatformSettings:
    return PlatformSettings().model_copy(update={"verify": VerifySettings(**verify)})


@pytest.mark.parametrize(("ranges", "parallelism", "share"), [
    (1, 2, 300.0), (2, 2, 300.0), (3, 2, 150.0), (4, 2, 150.0), (8, 2, 75.0), (5, 1, 60.0)])
def test_tasks_running_one_after_the_other_share_the_most_a_verification_yields(
        ranges, parallelism, share):
    """Tasks running at once pause at once: the waves of tasks divide the bound, so the
    verification pauses about CDC_VERIFY_MAX_YIELD at most, whatever its ranges."""
    policy = yield_policy(_settings(max_yield_seconds=300), None,
                          SnapshotOptions(local_parallelism=parallelism), ranges)
    assert policy.budget_seconds == share
    assert policy.enabled and policy.lag_bytes == 16 * 1024**2


def test_yielding_is_off_with_a_zero_lag_or_bound():
    options = SnapshotOptions()
    assert not yield_policy(_settings(yield_lag_bytes=0), None, options, 4).enabled
    assert not yield_policy(_settings(max_yield_seconds=0), None, options, 4).enabled


def test_the_settings_read_sizes_durations_and_the_nice_value(monkeypatch):
    monkeypatch.setenv("CDC_VERIFY_YIELD_LAG", "64MiB")
    monkeypatch.setenv("CDC_VERIFY_MAX_YIELD", "2m")
    monkeypatch.setenv("CDC_VERIFY_NICE", "19")
    verify = load_settings(PlatformSettings).verify
    assert (verify.yield_lag_bytes, verify.max_yield_seconds, verify.nice) == (
        64 * 1024**2, 120.0, 19)
    monkeypatch.setenv("CDC_VERIFY_NICE", "20")
    with pytest.raises(ConfigError, match="CDC_VERIFY_NICE"):
        load_settings(PlatformSettings)
