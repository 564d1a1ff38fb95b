#!/usr/bin/env bash
# `make image-test`: build the image (deploy/image/build.sh), then run it for real: the smoke
# tests inside the container (tests/test_deploy_image.py) and the compose stack with a DAG run
# through the REST API (tests/test_deploy_stack.py). Stops the dockerd it started and checks
# that no container of these tests is left.
#   usage: deploy/image/test.sh [pytest args]
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
trap engine_down EXIT

t0=$(date +%s)
engine_up
"${root}/deploy/image/build.sh"
t1=$(date +%s)
export MFT_TEST_IMAGE="${MFT_IMAGE}" MFT_TEST_POSTGRES_IMAGE="${MFT_CI_POSTGRES_IMAGE:-mft-postgres:ci}"
rc=0
"${root}/.venv/bin/python" -m pytest -q -p no:cacheprovider --durations=10 \
  "${root}/tests/test_deploy_image.py" "${root}/tests/test_deploy_stack.py" "$@" || rc=$?
t2=$(date +%s)
left="$( { "${DOCKER}" ps -aq --filter name=mft-test-; "${DOCKER}" ps -aq --filter label=com.docker.compose.project=mft-ci; } | sort -u)"
if [[ -n "${left}" ]]; then log "containers left behind: ${left}"; "${DOCKER}" rm -f ${left} >/dev/null; rc=1; fi
log "build $((t1 - t0)) s, tests $((t2 - t1)) s, total $((t2 - t0)) s (rc ${rc})"
exit "${rc}"
