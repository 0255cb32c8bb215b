"""Source verifications (docs/verification.md Part 2, item 2): a table's digest at an exact
point of the CDC stream, published on ``cdc.cdc-platform.verify.{table}.{id}`` for mirrors to
compare with. Start at :mod:`cdc_platform.verify.job`."""

from cdc_platform.verify.job import (
    VerificationResult,
    new_verification_id,
    run_verification,
    verify_table,
)

__all__ = ["VerificationResult", "new_verification_id", "run_verification", "verify_table"]
