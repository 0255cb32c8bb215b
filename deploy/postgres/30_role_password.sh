#!/bin/sh
# docker-entrypoint-initdb.d: the platform role's password, from the environment (never in a
# file or a log). Runs after 10_publication.sql and 20_role.sql.
set -eu
psql -v ON_ERROR_STOP=1 -v password="$CDC_PG_PASSWORD" --username "$POSTGRES_USER" \
     --dbname "$POSTGRES_DB" <<'SQL'
ALTER ROLE bridge_reader PASSWORD :'password';
SQL
