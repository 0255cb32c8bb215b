"""Compiled twins of ``cdc_platform/snapshot``'s modules (see ``cdc_platform/speedups.py``)."""
