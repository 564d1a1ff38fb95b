#!/usr/bin/env bash
# Initialise the cluster on first start (role, password, database from POSTGRES_*), then run
# postgres in the foreground as the postgres user, on 127.0.0.1:${PGPORT:-5432}.
set -euo pipefail
: "${POSTGRES_USER:?}" "${POSTGRES_PASSWORD:?}" "${POSTGRES_DB:=${POSTGRES_USER}}"
export PGPORT="${PGPORT:-5432}"
mkdir -p "${PGDATA}" /run/postgresql
chown postgres:postgres "${PGDATA}" /run/postgresql
chmod 700 "${PGDATA}"
as_pg() { runuser -u postgres -- "$@"; }
if [[ ! -s "${PGDATA}/PG_VERSION" ]]; then
  pwfile="$(mktemp)"; printf '%s' "${POSTGRES_PASSWORD}" > "${pwfile}"; chown postgres "${pwfile}"
  as_pg initdb --username="${POSTGRES_USER}" --pwfile="${pwfile}" --auth-host=scram-sha-256 --auth-local=trust \
    --encoding=UTF8 -D "${PGDATA}" >/dev/null
  rm -f "${pwfile}"
  as_pg pg_ctl -D "${PGDATA}" -o "-c listen_addresses='' -c unix_socket_directories=/run/postgresql" -w start >/dev/null
  if [[ "${POSTGRES_DB}" != postgres ]]; then
    as_pg psql -h /run/postgresql -U "${POSTGRES_USER}" -d postgres -v ON_ERROR_STOP=1 -q \
      -c "CREATE DATABASE \"${POSTGRES_DB}\" OWNER \"${POSTGRES_USER}\""
  fi
  as_pg pg_ctl -D "${PGDATA}" -m fast -w stop >/dev/null
  echo "initialised ${PGDATA}: role ${POSTGRES_USER}, database ${POSTGRES_DB}"
fi
exec runuser -u postgres -- postgres -D "${PGDATA}" -c listen_addresses=127.0.0.1 -c port="${PGPORT}" \
  -c unix_socket_directories=/run/postgresql
