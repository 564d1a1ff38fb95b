#!/usr/bin/env bash
# Write .env for the compose stack from .env.example, with a fresh random value for every
# `change-me` placeholder. Refuses to overwrite an existing .env (your secrets live there).
#   usage: deploy/init-env.sh [TARGET]        (default: .env in the repository root)
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
target="${1:-${root}/.env}"
if [[ -e "${target}" ]]; then
  echo "${target} exists; not overwriting it (delete it first to start over)" >&2
  exit 1
fi
command -v openssl >/dev/null || { echo "openssl is needed to generate secrets" >&2; exit 1; }

umask 077
while IFS= read -r line || [[ -n "${line}" ]]; do
  if [[ "${line}" =~ ^([A-Z0-9_]+)=change-me$ ]]; then
    key="${BASH_REMATCH[1]}"
    if [[ "${key}" == AIRFLOW_FERNET_KEY ]]; then
      value="$(openssl rand -base64 32 | tr '+/' '-_')"   # Fernet: urlsafe base64 of 32 bytes
    else
      value="$(openssl rand -hex 24)"
    fi
    printf '%s=%s\n' "${key}" "${value}"
  else
    printf '%s\n' "${line}"
  fi
done < "${root}/.env.example" > "${target}"

staging="${root}/.cache/staging"
mkdir -p "${staging}"
sed -i "s#^MFT_STAGING_DIR=.*#MFT_STAGING_DIR=${staging}#" "${target}"
if [[ -S /var/run/docker.sock ]]; then
  sed -i "s/^DOCKER_GID=.*/DOCKER_GID=$(stat -c %g /var/run/docker.sock)/" "${target}"
fi
echo "wrote ${target} (mode 600); keep it out of git"
