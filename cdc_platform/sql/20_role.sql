-- cdc_platform: the least-privilege role the platform connects as.
--
-- Run as a superuser AFTER 10_publication.sql, then set the password yourself
-- (`\password bridge_reader` in psql: it never appears in logs or in this file):
--     PGOPTIONS="-c cdc.role=bridge_reader -c cdc.publication=cdc_pub" \
--         psql -d mydb -f cdc_platform/sql/20_role.sql
--   cdc.role                 role name (default bridge_reader)
--   cdc.publication          publication whose tables the role may read (default cdc_pub)
-- The role gets: LOGIN, REPLICATION (to stream a slot), CONNECT on this database, USAGE on
-- the published tables' schemas, SELECT on the published tables only (snapshots), and
-- EXECUTE on pg_logical_emit_message (heartbeats and snapshot watermarks). Nothing else:
-- no superuser, no write access, no CREATE, no default privileges on tables created later
-- (a SELECT it held on a table no longer published, or default privileges an older version
-- of this script granted, are revoked). pg_logical_emit_message is revoked from PUBLIC
-- in this database (PostgreSQL grants it to every role by default): only superusers and the
-- roles granted it explicitly may emit logical decoding messages here.
-- REPLICATION itself reads more than SELECT does: see docs/operations.md "PostgreSQL setup
-- (DBA)" for what it can read and the pg_hba.conf lines to use.
-- Works on PostgreSQL 15 to 18.
-- Idempotent: re-run it after adding tables to or dropping them from the publication.
DO $$
DECLARE
    role_name text := coalesce(nullif(current_setting('cdc.role', true), ''), 'bridge_reader');
    pub_name text := coalesce(nullif(current_setting('cdc.publication', true), ''), 'cdc_pub');
    published record;
    granted record;
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
    -- SELECT on published tables only: revoke it from every other relation
    FOR granted IN
        SELECT DISTINCT c.oid::regclass AS relation
        FROM pg_class c, aclexplode(c.relacl) acl
        WHERE acl.grantee = role_name::regrole AND acl.privilege_type = 'SELECT'
          AND c.oid NOT IN (SELECT format('%I.%I', schemaname, tablename)::regclass
                            FROM pg_publication_tables WHERE pubname = pub_name)
    LOOP
        EXECUTE format('REVOKE SELECT ON TABLE %s FROM %I', granted.relation, role_name);
        RAISE NOTICE 'revoked SELECT on % (not in publication %)', granted.relation, pub_name;
    END LOOP;
    -- and no table created later: older versions granted default privileges in public
    FOR granted IN
        SELECT DISTINCT d.defaclrole::regrole AS owner, d.defaclnamespace
        FROM pg_default_acl d, aclexplode(d.defaclacl) acl
        WHERE acl.grantee = role_name::regrole AND d.defaclobjtype = 'r'
    LOOP
        IF granted.defaclnamespace = 0 THEN
            EXECUTE format('ALTER DEFAULT PRIVILEGES FOR ROLE %s REVOKE ALL ON TABLES FROM %I',
                           granted.owner, role_name);
        ELSE
            EXECUTE format(
                'ALTER DEFAULT PRIVILEGES FOR ROLE %s IN SCHEMA %s REVOKE ALL ON TABLES FROM %I',
                granted.owner, granted.defaclnamespace::regnamespace, role_name);
        END IF;
    END LOOP;
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
