"""The cutover rule (docs/wire-contract.md "The cutover rule"): where a snapshot ends and the stream
begins, so that no row is lost and none is applied twice.

A consumer loads every chunk of a snapshot, then applies exactly the events of the table whose
``commit_lsn`` is at least the snapshot's ``lsn``, reading ``CDC`` from ``cdc_start_seq`` (any
earlier sequence is also correct). Once applying, it keeps a high-water mark
``(commit_lsn, ordinal)`` of the last event applied, so a redelivered copy is skipped.
"""

from __future__ import annotations

# The rule in words, in every snapshot meta (``cutover_rule``).
CUTOVER_RULE = (
    "Load every chunk of this snapshot ({chunk_subject_prefix}*: batch_count chunks; chunk "
    "numbers are partition*1000000+n, not contiguous). Then read stream {cdc_stream} from "
    "sequence cdc_start_seq (the watermark marker on {watermark_subject}; any earlier sequence "
    "is also correct) and apply exactly the events of table {table} whose commit_lsn >= "
    "{lsn}; skip those with commit_lsn < {lsn}, they are in the snapshot. Compare LSNs 'X/Y' "
    "as (X << 32) | Y, never as strings.")


def cutover_rule_text(*, chunk_subject_prefix: str, cdc_stream: str, watermark_subject: str,
                      table: str, lsn: str) -> str:
    return CUTOVER_RULE.format(chunk_subject_prefix=chunk_subject_prefix,
                               cdc_stream=cdc_stream, watermark_subject=watermark_subject,
                               table=table, lsn=lsn)


def applies(commit_lsn: int, ordinal: int, *, cutover_lsn: int,
            high_water: tuple[int, int]) -> bool:
    """Whether an event (``commit_lsn``, ``ordinal``; LSNs as integers) is to be applied by a
    consumer that bootstrapped at ``cutover_lsn`` and last applied ``high_water`` (a
    ``(commit_lsn, ordinal)``; ``(0, -1)`` before the first)."""
    return commit_lsn >= cutover_lsn and (commit_lsn, ordinal) > high_water

