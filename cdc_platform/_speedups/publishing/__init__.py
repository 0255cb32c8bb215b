"""Compiled twins of ``cdc_platform/publishing``'s modules (see ``cdc_platform/speedups.py``)."""
