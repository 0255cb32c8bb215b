"""Compiled twins of ``cdc_platform/bridge``'s modules (see ``cdc_platform/speedups.py``)."""
