#!/bin/sh
# First start: a cluster owned by POSTGRES_USER with POSTGRES_PASSWORD, database POSTGRES_DB,
# password logins from the compose network. Then postgres in the foreground as PID 1's child.
set -eu
mkdir -p "$PGDATA" /run/postgresql
chown -R postgres:postgres "$PGDATA" /run/postgresql
chmod 700 "$PGDATA"
if [ ! -s "$PGDATA/PG_VERSION" ]; then
    pwfile=$(mktemp) && printf '%s' "$POSTGRES_PASSWORD" > "$pwfile" && chown postgres "$pwfile"
    su postgres -c "initdb -D '$PGDATA' -U '$POSTGRES_USER' --pwfile='$pwfile' -A scram-sha-256" >/dev/null
    rm -f "$pwfile"
    echo "host all all all scram-sha-256" >> "$PGDATA/pg_hba.conf"
    su postgres -c "pg_ctl -D '$PGDATA' -o '-c listen_addresses=' -w start" >/dev/null
    PGPASSWORD="$POSTGRES_PASSWORD" su postgres -c "PGPASSWORD='$POSTGRES_PASSWORD' createdb -h /run/postgresql -U '$POSTGRES_USER' '$POSTGRES_DB'"
    su postgres -c "pg_ctl -D '$PGDATA' -m fast -w stop" >/dev/null
fi
exec su postgres -c "exec postgres -D '$PGDATA' -c listen_addresses='*'"
