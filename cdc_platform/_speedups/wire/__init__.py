"""Compiled twins of ``cdc_platform/wire``'s modules (see ``cdc_platform/speedups.py``)."""
