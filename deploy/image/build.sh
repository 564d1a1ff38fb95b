#!/usr/bin/env bash
# Build the project image from the repository's Dockerfile on a machine without an image
# registry (CI): start dockerd if needed, bootstrap the Debian base if absent, serve the local
# CPU torch wheel on loopback as a package index, build with --network host.
#   usage: deploy/image/build.sh            (MFT_IMAGE=mft:ci, MFT_BASE_IMAGE=mft-base:bookworm)
#          MFT_TORCH_VARIANT=cu130 deploy/image/build.sh   the GPU variant (MFT_IMAGE=mft:ci-cu130):
#            torch's CUDA 13.0 build and lock-cuda.txt from PyPI, or from TORCH_INDEX_URL if set
# Leaves no dockerd running unless one was running before.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

index_pid=""
cleanup() { [[ -z "${index_pid}" ]] || kill "${index_pid}" 2>/dev/null || true; engine_down; }
trap cleanup EXIT

variant="${MFT_TORCH_VARIANT:-cpu}"
torch_version="$(sed -n 's/^torch==//p' "${root}/requirements/lock.txt")"
torch_version="${torch_version%%+*}"
torch_index="${TORCH_INDEX_URL:-}"
torch_local="+${variant}"
if [[ "${variant}" != cpu && -z "${torch_index}" ]]; then
  # PyTorch's own index may be unreachable (CI reaches only PyPI); PyPI's torch for linux x86_64
  # is the CUDA 13.0 build, published without the local label
  [[ "${variant}" == cu130 ]] || { log "TORCH_VARIANT=${variant}: PyPI has only cu130; set TORCH_INDEX_URL"; exit 2; }
  torch_index="https://pypi.org/simple"
  torch_local=""
  log "torch ${torch_version} (CUDA 13.0 build) from ${torch_index}"
fi
# The CPU torch wheel: PyTorch's own CPU index, or a local copy of the wheel (PIP_FIND_LINKS,
# /opt/wheels on this kind of machine) served as a PEP 503 index on 127.0.0.1.
if [[ -z "${torch_index}" ]]; then
  wheel="$(ls "${TORCH_WHEEL_DIR:-${PIP_FIND_LINKS:-/opt/wheels}}"/torch-"${torch_version}"+cpu-cp311-*.whl 2>/dev/null | head -1 || true)"
  if [[ -n "${wheel}" ]]; then
    idx="${state}/torch-index"
    rm -rf "${idx}" && mkdir -p "${idx}/torch"
    ln -s "${wheel}" "${idx}/torch/$(basename "${wheel}")"
    printf '<a href="%s">%s</a>\n' "$(basename "${wheel}")" "$(basename "${wheel}")" > "${idx}/torch/index.html"
    # a fixed port keeps TORCH_INDEX_URL, a build argument, the same between builds, so the
    # venv layer stays cached; any free port if that one is taken (the build then misses the cache)
    port="${MFT_TORCH_INDEX_PORT:-38751}"
    python3 -c "import socket; socket.create_server(('127.0.0.1', ${port})).close()" 2>/dev/null || port=0
    python3 -m http.server --bind 127.0.0.1 "${port}" --directory "${idx}" >"${state}/torch-index.log" 2>&1 &
    index_pid=$!
    for _ in $(seq 50); do grep -q 'port [0-9]' "${state}/torch-index.log" && break; sleep 0.1; done
    port="$(sed -n 's/.* port \([0-9]*\).*/\1/p' "${state}/torch-index.log" | head -1)"
    [[ -n "${port}" ]] || { log "local torch index did not start"; exit 2; }
    torch_index="http://127.0.0.1:${port}/"
    log "torch ${torch_version}+cpu from ${wheel} via ${torch_index}"
  else
    torch_index="https://download.pytorch.org/whl/cpu"
  fi
fi

engine_up
base_image_up
log "building ${MFT_IMAGE} from ${MFT_BASE_IMAGE} (TORCH_VARIANT=${variant})"
start=$(date +%s)
DOCKER_BUILDKIT=1 "${DOCKER}" build --network host --progress plain \
  --build-arg BASE_IMAGE="${MFT_BASE_IMAGE}" \
  --build-arg TORCH_VARIANT="${variant}" --build-arg TORCH_LOCAL_VERSION="${torch_local}" \
  --secret id=ca-bundle,src="${CA_BUNDLE:-/etc/ssl/certs/ca-certificates.crt}" \
  --build-arg TORCH_INDEX_URL="${torch_index}" \
  -t "${MFT_IMAGE}" "${root}" 2>&1 | tee "${state}/build.log" | grep -E '^#[0-9]+ (\[|DONE|ERROR|CACHED)|ERROR|error:' >&2
log "built ${MFT_IMAGE} in $(( $(date +%s) - start )) s ($("${DOCKER}" image inspect -f '{{.Size}}' "${MFT_IMAGE}" | awk '{printf "%.1f GB", $1/1e9}'))"

[[ "${variant}" == cpu ]] || exit 0
# PostgreSQL for the CI stack, from Debian's package on the same base (docker-compose.ci.yaml)
log "building ${MFT_CI_POSTGRES_IMAGE:-mft-postgres:ci}"
DOCKER_BUILDKIT=1 "${DOCKER}" build --network host --progress plain \
  --build-arg BASE_IMAGE="${MFT_BASE_IMAGE}" -f "${root}/deploy/image/postgres.Dockerfile" \
  -t "${MFT_CI_POSTGRES_IMAGE:-mft-postgres:ci}" "${root}/deploy/image" >>"${state}/build.log" 2>&1 \
  || { tail -30 "${state}/build.log" >&2; exit 1; }
