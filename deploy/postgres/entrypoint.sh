#!/bin/sh
# First start: initdb with POSTGRES_USER as superuser (password from POSTGRES_PASSWORD, never on a command line) and
# create POSTGRES_DB, as the official image does; then run the server as `postgres` with the given arguments.
set -eu

PGBIN=$(ls -d /usr/lib/postgresql/*/bin | sort -V | tail -n 1)
PATH=$PGBIN:$PATH
export PATH PGDATA="${PGDATA:-/var/lib/postgresql/data}"

if [ "$(id -u)" = 0 ]; then
    mkdir -p "$PGDATA" /run/postgresql
    chown postgres:postgres "$PGDATA" /run/postgresql
    chmod 700 "$PGDATA"
    exec setpriv --reuid=postgres --regid=postgres --init-groups "$0" "$@"
fi

if [ ! -s "$PGDATA/PG_VERSION" ]; then
    : "${POSTGRES_PASSWORD:?POSTGRES_PASSWORD must be set}"
    user=${POSTGRES_USER:-postgres}
    pwfile=$(mktemp)
    printf '%s\n' "$POSTGRES_PASSWORD" >"$pwfile"
    initdb --username="$user" --pwfile="$pwfile" --auth-local=trust --auth-host=scram-sha-256 \
        --encoding=UTF8 --locale=C.UTF-8 >/dev/null
    rm -f "$pwfile"
    # Connections from other containers: password-checked, like the official image. The listening address is set
    # here and can be narrowed with `-c listen_addresses=...` (deploy/compose.hostnet.yml does).
    echo "host all all all scram-sha-256" >>"$PGDATA/pg_hba.conf"
    echo "listen_addresses = '*'" >>"$PGDATA/postgresql.conf"
    db=${POSTGRES_DB:-$user}
    if [ "$db" != postgres ]; then
        # A private socket-only server for the setup: nothing can connect before the database exists.
        pg_ctl -D "$PGDATA" -o "-c listen_addresses='' -c unix_socket_directories=/run/postgresql" -w start >/dev/null
        createdb --host=/run/postgresql --username="$user" --maintenance-db=postgres -- "$db"
        pg_ctl -D "$PGDATA" -m fast -w stop >/dev/null
    fi
    echo "postgres-entrypoint: initialised $PGDATA (user $user, database $db)"
fi

[ "${1:-}" = postgres ] && shift
exec postgres -D "$PGDATA" -c unix_socket_directories=/run/postgresql "$@"
