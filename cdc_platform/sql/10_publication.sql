-- cdc_platform: the publication whose tables are streamed and snapshotted.
--
-- Run as the owner of the tables (or a superuser). Parameters are session settings:
--     PGOPTIONS="-c cdc.publication=cdc_pub -c cdc.tables=public.users,sales.orders" \
--         psql -d mydb -f cdc_platform/sql/10_publication.sql
--   cdc.publication  publication name (default cdc_pub)
--   cdc.tables       comma-separated tables (schema-qualified or on the search_path) to add,
--                    or * for FOR ALL TABLES (needs a superuser); empty: create it empty.
-- Idempotent: creates the publication if missing and adds the tables it lacks. It never
-- drops tables (use ALTER PUBLICATION ... DROP TABLE on purpose).
DO $$
DECLARE
    pub_name text := coalesce(nullif(current_setting('cdc.publication', true), ''), 'cdc_pub');
    table_list text := coalesce(current_setting('cdc.tables', true), '');
    table_name text;
    rel regclass;
BEGIN
    IF NOT EXISTS (SELECT 1 FROM pg_publication WHERE pubname = pub_name) THEN
        IF table_list = '*' THEN
            EXECUTE format('CREATE PUBLICATION %I FOR ALL TABLES', pub_name);
        ELSE
            EXECUTE format('CREATE PUBLICATION %I', pub_name);
        END IF;
        RAISE NOTICE 'created publication %', pub_name;
    END IF;
    IF table_list NOT IN ('*', '') THEN
        FOREACH table_name IN ARRAY string_to_array(table_list, ',') LOOP
            rel := trim(table_name)::regclass;  -- a missing table fails here, by name
            IF NOT EXISTS (
                SELECT 1 FROM pg_publication_tables
                WHERE pubname = pub_name
                  AND format('%I.%I', schemaname, tablename)::regclass = rel
            ) THEN
                EXECUTE format('ALTER PUBLICATION %I ADD TABLE %s', pub_name, rel);
                RAISE NOTICE 'added % to publication %', rel, pub_name;
            END IF;
        END LOOP;
    END IF;
END
$$;
