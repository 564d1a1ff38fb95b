#!/usr/bin/env bash
# `make image-test`: build the image (deploy/image/build.sh), then run it for real: the smoke
# tests inside the container (tests/test_deploy_image.py) and the compose stack with a DAG run
# through the REST API (tests/test_deploy_stack.py). Stops the dockerd it started and checks
# that no container of these tests is left.
#   usage: deploy/image/test.sh [pytest args]        MFT_TORCH_VARIANT=cu130: the GPU variant's tests
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
trap engine_down EXIT

t0=$(date +%s)
engine_up
"${root}/deploy/image/build.sh"
t1=$(date +%s)
if [[ "${MFT_TORCH_VARIANT:-cpu}" == cpu ]]; then
  export MFT_TEST_IMAGE="${MFT_IMAGE}" MFT_TEST_POSTGRES_IMAGE="${MFT_CI_POSTGRES_IMAGE:-mft-postgres:ci}"
  tests=("${root}/tests/test_deploy_image.py" "${root}/tests/test_deploy_stack.py")
else  # the GPU variant on a host without a GPU: its torch and libraries load, the entry points import
  export MFT_TEST_CUDA_IMAGE="${MFT_IMAGE}"
  tests=("${root}/tests/test_deploy_image_cuda.py")
fi
rc=0
"${root}/.venv/bin/python" -m pytest -q -p no:cacheprovider --durations=10 "${tests[@]}" "$@" || rc=$?
t2=$(date +%s)
left="$( { "${DOCKER}" ps -aq --filter name=mft-test-; "${DOCKER}" ps -aq --filter label=com.docker.compose.project=mft-ci; } | sort -u)"
if [[ -n "${left}" ]]; then log "containers left behind: ${left}"; "${DOCKER}" rm -f ${left} >/dev/null; rc=1; fi
log "build $((t1 - t0)) s, tests $((t2 - t1)) s, total $((t2 - t0)) s (rc ${rc})"
exit "${rc}"
