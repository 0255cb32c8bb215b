-- cdc_platform: the least-privilege role the platform connects as.
--
-- Run as a superuser AFTER 10_publication.sql, then set the password yourself
-- (`\password bridge_reader` in psql: it never appears in logs or in this file):
--     PGOPTIONS="-c cdc.role=bridge_reader -c cdc.publication=cdc_pub" \
--         psql -d mydb -f sql/20_role.sql
--   cdc.role                 role name (default bridge_reader)
--   cdc.publication          publication whose tables the role may read (default cdc_pub)
--   cdc.future_table_schemas comma-separated schemas whose FUTURE tables the role may read
--                            (default public; empty: none). ALTER DEFAULT PRIVILEGES applies
--                            to tables created by the role running this script.
-- The role gets: LOGIN, REPLICATION (to stream a slot), CONNECT on this database, USAGE on
-- the published tables' schemas, SELECT on the published tables only (snapshots), and
-- EXECUTE on pg_logical_emit_message (heartbeats and snapshot watermarks). Nothing else:
-- no superuser, no write access, no CREATE. pg_logical_emit_message is revoked from PUBLIC
-- in this database (PostgreSQL grants it to every role by default): only superusers and the
-- roles granted it explicitly may emit logical decoding messages here.
-- Works on PostgreSQL 15 to 18.
-- Idempotent: re-run it after adding tables to the publication.
DO $$
DECLARE
    role_name text := coalesce(nullif(current_setting('cdc.role', true), ''), 'bridge_reader');
    pub_name text := coalesce(nullif(current_setting('cdc.publication', true), ''), 'cdc_pub');
    future_schemas text := coalesce(current_setting('cdc.future_table_schemas', true), 'public');
    schema_name text;
    published record;
    emit_function regprocedure;
BEGIN
    IF NOT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = role_name) THEN
        EXECUTE format('CREATE ROLE %I WITH LOGIN REPLICATION', role_name);
        RAISE NOTICE 'created role % (set its password with \password %)', role_name, role_name;
    ELSE
        EXECUTE format('ALTER ROLE %I WITH LOGIN REPLICATION', role_name);
    END IF;
    EXECUTE format('GRANT CONNECT ON DATABASE %I TO %I', current_database(), role_name);
    FOR published IN
        SELECT DISTINCT schemaname, tablename FROM pg_publication_tables WHERE pubname = pub_name
    LOOP
        EXECUTE format('GRANT USAGE ON SCHEMA %I TO %I', published.schemaname, role_name);
        EXECUTE format('GRANT SELECT ON TABLE %I.%I TO %I',
                       published.schemaname, published.tablename, role_name);
    END LOOP;
    IF future_schemas <> '' THEN
        FOREACH schema_name IN ARRAY string_to_array(future_schemas, ',') LOOP
            schema_name := trim(schema_name);
            EXECUTE format('GRANT USAGE ON SCHEMA %I TO %I', schema_name, role_name);
            EXECUTE format('ALTER DEFAULT PRIVILEGES IN SCHEMA %I GRANT SELECT ON TABLES TO %I',
                           schema_name, role_name);
        END LOOP;
    END IF;
    -- pg_logical_emit_message(boolean, text, text) gained a fourth argument (flush boolean
    -- DEFAULT false) in PostgreSQL 17: grant whichever text variants this server has. Every
    -- variant is revoked from PUBLIC (the default lets any role emit a message the bridge
    -- would publish as a watermark) and kept for the role alone.
    FOR emit_function IN
        SELECT oid::regprocedure FROM pg_proc
        WHERE proname = 'pg_logical_emit_message'
          AND pronamespace = 'pg_catalog'::regnamespace
    LOOP
        EXECUTE format('REVOKE EXECUTE ON FUNCTION %s FROM PUBLIC', emit_function);
    END LOOP;
    FOR emit_function IN
        SELECT oid::regprocedure FROM pg_proc
        WHERE proname = 'pg_logical_emit_message'
          AND pronamespace = 'pg_catalog'::regnamespace
          AND proargtypes[2] = 'text'::regtype
    LOOP
        EXECUTE format('GRANT EXECUTE ON FUNCTION %s TO %I', emit_function, role_name);
    END LOOP;
END
$$;
