-- cdc_platform: server settings that logical replication needs.
--
-- Run as a superuser, then RESTART PostgreSQL (wal_level, max_replication_slots and
-- max_wal_senders only take effect at start):
--     psql -d postgres -f cdc_platform/sql/00_server_settings.sql && pg_ctl restart -D "$PGDATA"
-- Idempotent. The numbers are minimums for one platform instance: keep higher values if the
-- server already has them (every slot and every walsender, ours included, counts).
--
-- max_slot_wal_keep_size bounds the WAL a stalled slot may pin: past it PostgreSQL
-- invalidates the slot (the bridge then stops and says to re-snapshot) instead of filling
-- the disk. wal_sender_timeout is generous because a bridge waiting on NATS still answers
-- keepalives, but a long GC/Spark pause should not drop the connection.
ALTER SYSTEM SET wal_level = 'logical';
ALTER SYSTEM SET max_replication_slots = 10;
ALTER SYSTEM SET max_wal_senders = 10;
ALTER SYSTEM SET max_slot_wal_keep_size = '10GB';
ALTER SYSTEM SET wal_sender_timeout = '300s';
