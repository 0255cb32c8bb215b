"""Snapshot partitions: one per published table (wire name), kept in sync with the publication."""

import dagster as dg

PUBLISHED_TABLES = "published_tables"  # the dynamic partitions' name
published_tables_partitions = dg.DynamicPartitionsDefinition(name=PUBLISHED_TABLES)
