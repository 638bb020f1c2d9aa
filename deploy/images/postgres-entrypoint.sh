#!/bin/sh
# First start: create the cluster with POSTGRES_USER as its superuser (password from POSTGRES_PASSWORD_FILE) and
# POSTGRES_DB, then serve. Later starts only serve. Connections over the network need the password
# (scram-sha-256); only the local socket inside the container trusts (for pg_isready and psql in the container).
set -eu
: "${POSTGRES_USER:=postgres}"
: "${POSTGRES_DB:=$POSTGRES_USER}"
if [ ! -s "$PGDATA/PG_VERSION" ]; then
  if [ -z "${POSTGRES_PASSWORD_FILE:-}" ] || [ ! -r "$POSTGRES_PASSWORD_FILE" ]; then
    echo "postgres-entrypoint: POSTGRES_PASSWORD_FILE must name a readable file (got '${POSTGRES_PASSWORD_FILE:-}')" >&2
    exit 1
  fi
  initdb --pgdata="$PGDATA" --username="$POSTGRES_USER" --pwfile="$POSTGRES_PASSWORD_FILE" \
         --auth-local=trust --auth-host=scram-sha-256 --encoding=UTF8 --locale=C.UTF-8 >/dev/null
  echo "host all all all scram-sha-256" >> "$PGDATA/pg_hba.conf"
  if [ "$POSTGRES_DB" != "postgres" ]; then
    # A server on the socket only, for this one statement: nothing outside can connect meanwhile.
    pg_ctl --pgdata="$PGDATA" --options="-c listen_addresses=''" --wait --silent start
    createdb --username="$POSTGRES_USER" --maintenance-db=postgres "$POSTGRES_DB"
    pg_ctl --pgdata="$PGDATA" --mode=fast --wait --silent stop
  fi
fi
exec postgres -D "$PGDATA" -c listen_addresses='*' "$@"
